#!/usr/bin/env python3
"""Plots scripts/bench-http.sh results: median req/s and p99 latency per mode, as one SVG.

Usage: scripts/plot-bench.py [target/bench-http.csv] [docs/bench-http.svg]

No dependencies beyond the Python standard library: the SVG is written by hand.
"""
import csv
import statistics
import sys
from collections import defaultdict

src = sys.argv[1] if len(sys.argv) > 1 else "target/bench-http.csv"
dst = sys.argv[2] if len(sys.argv) > 2 else "docs/bench-http.svg"

rows = list(csv.DictReader(open(src)))
order = []
rps = defaultdict(list)
p99 = defaultdict(list)
for r in rows:
    if r["mode"] not in order:
        order.append(r["mode"])
    rps[r["mode"]].append(float(r["rps"]))
    p99[r["mode"]].append(float(r["p99_us"]))
labels = {
    "none": "bare axum",
    "local": "tollgate local",
    "tower_governor": "tower_governor",
    "redis": "tollgate redis",
    "local_outer": "tollgate local, whole router",
    "tower_governor_outer": "tower_governor, whole router",
    "redis_outer": "tollgate redis, whole router",
    "local_deny": "local, denied key",
    "redis_deny": "redis, denied key",
}
bare = statistics.median(rps["none"]) if rps.get("none") else None

W, H, pad, bar_h, gap = 940, 80 + 2 * 40 * len(order), 230, 22, 18
out = [
    f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" font-family="sans-serif" font-size="13">',
    f'<rect width="{W}" height="{H}" fill="white"/>',
    f'<text x="10" y="22" font-size="16" font-weight="bold">HTTP throughput and p99 latency per mode (median of {len(rows) // max(1, len(order))} rounds, wrk)</text>',
]


def panel(y0, title, data, unit, fmt, ratio):
    out.append(f'<text x="10" y="{y0}" font-weight="bold">{title}</text>')
    top = max(statistics.median(v) for v in data.values()) or 1
    for i, mode in enumerate(order):
        med = statistics.median(data[mode])
        y = y0 + 12 + i * (bar_h + 6)
        w = (W - pad - 160) * med / top
        color = "#888" if mode == "none" else ("#3b7dd8" if "redis" not in mode else "#d8573b")
        out.append(f'<text x="10" y="{y + 16}">{labels.get(mode, mode)}</text>')
        out.append(f'<rect x="{pad}" y="{y}" width="{w:.1f}" height="{bar_h}" fill="{color}"/>')
        extra = f"  ({med / bare:.2f}× bare)" if ratio and bare else ""
        out.append(f'<text x="{pad + w + 6:.1f}" y="{y + 16}">{fmt(med)} {unit}{extra}</text>')
    return y0 + 12 + len(order) * (bar_h + 6) + gap


y = panel(55, "Throughput (higher is better)", rps, "req/s", lambda v: f"{v:,.0f}", True)
panel(y + 10, "p99 latency (lower is better)", p99, "µs", lambda v: f"{v:,.0f}", False)
out.append("</svg>")
open(dst, "w").write("\n".join(out))
print(f"wrote {dst}")
