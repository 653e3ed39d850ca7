#!/usr/bin/env python3
"""Draws the algorithms side by side from real runs through the layer.

Usage:
    cargo run --example algorithm_traces > target/algorithm-traces.csv
    scripts/plot-algorithms.py [target/algorithm-traces.csv] [docs/algorithms.svg]

One row per algorithm, time across: every request is a mark, green when allowed, red when
denied (requests at the same instant are stacked), and a grey line counts the requests allowed
in the trailing 10 s (the quota's window), against the limit of 10 (dashed). Window edges
(every 10 s, aligned to the epoch) are thin vertical lines.

No dependencies beyond the Python standard library: the SVG is written by hand.
"""
import csv
import sys
from collections import defaultdict

src = sys.argv[1] if len(sys.argv) > 1 else "target/algorithm-traces.csv"
dst = sys.argv[2] if len(sys.argv) > 2 else "docs/algorithms.svg"

rows = list(csv.DictReader(open(src)))
order = []
by_algo = defaultdict(list)
for r in rows:
    if r["algorithm"] not in order:
        order.append(r["algorithm"])
    by_algo[r["algorithm"]].append((int(r["t_ms"]), r["status"] == "200"))

titles = {
    "gcra": "GCRA (10 per 10 s, burst 10)",
    "fixed": "fixed window (10 per 10 s)",
    "sliding": "sliding window (10 per 10 s, one sub-window)",
}
WINDOW_MS = 10_000
LIMIT = 10
end_ms = max(t for reqs in by_algo.values() for t, _ in reqs) + 2_000

W, left, right = 1100, 60, 20
row_h, top = 230, 30
H = top + row_h * len(order) + 40
plot_w = W - left - right


def x(t_ms):
    return left + plot_w * t_ms / end_ms


out = [
    f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" '
    f'font-family="sans-serif" font-size="12">',
    f'<rect width="{W}" height="{H}" fill="white"/>',
    f'<text x="{left}" y="18" font-size="14">The same traffic under each algorithm: '
    f"2 requests/s for 30 s, then 10 at 49 s and 10 at 50 s (a window edge)</text>",
]
for i, algo in enumerate(order):
    y0 = top + i * row_h
    base = y0 + row_h - 40  # the time axis of this row
    mark = 8  # pixels per request in the stacks
    scale = 8  # pixels per request on the count line (up to 20 fit)
    out.append(f'<text x="{left}" y="{y0 + 14}" font-weight="bold">{titles.get(algo, algo)}</text>')
    out.append(f'<line x1="{left}" y1="{base}" x2="{W - right}" y2="{base}" stroke="black"/>')
    for edge in range(0, end_ms + 1, WINDOW_MS):
        out.append(
            f'<line x1="{x(edge):.1f}" y1="{y0 + 20}" x2="{x(edge):.1f}" y2="{base}" '
            f'stroke="#ccc"/>'
        )
        out.append(f'<text x="{x(edge):.1f}" y="{base + 14}" text-anchor="middle">{edge // 1000} s</text>')
    # The limit, on the count line's scale.
    ly = base - LIMIT * scale
    out.append(
        f'<line x1="{left}" y1="{ly}" x2="{W - right}" y2="{ly}" stroke="#888" '
        f'stroke-dasharray="4 3"/>'
    )
    out.append(f'<text x="{left - 6}" y="{ly + 4}" text-anchor="end">10</text>')
    # Marks, stacked per instant.
    height = defaultdict(int)
    allowed_at = []
    for t, ok in by_algo[algo]:
        h = height[t]
        height[t] += 1
        cy = base - 6 - h * mark
        cx = x(t)
        if ok:
            allowed_at.append(t)
            out.append(f'<circle cx="{cx:.1f}" cy="{cy}" r="3.5" fill="#2a9d3a"/>')
        else:
            out.append(
                f'<path d="M{cx - 3:.1f},{cy - 3} l6,6 m0,-6 l-6,6" stroke="#d62828" '
                f'stroke-width="2"/>'
            )
    # Allowed in the trailing window, sampled every 100 ms.
    points = []
    for t in range(0, end_ms, 100):
        n = sum(1 for a in allowed_at if t - WINDOW_MS < a <= t)
        points.append(f"{x(t):.1f},{base - n * scale}")
    out.append(
        f'<polyline points="{" ".join(points)}" fill="none" stroke="#555" stroke-width="1.5"/>'
    )
    total = len(allowed_at)
    peak = max(
        sum(1 for a in allowed_at if t - WINDOW_MS < a <= t) for t in range(0, end_ms, 100)
    )
    out.append(
        f'<text x="{W - right}" y="{y0 + 14}" text-anchor="end">{total} allowed, '
        f"at most {peak} in any 10 s</text>"
    )
legend_y = H - 12
out.append(f'<circle cx="{left + 6}" cy="{legend_y - 4}" r="4" fill="#2a9d3a"/>')
out.append(f'<text x="{left + 16}" y="{legend_y}">allowed</text>')
out.append(
    f'<path d="M{left + 86},{legend_y - 8} l8,8 m0,-8 l-8,8" stroke="#d62828" stroke-width="2"/>'
)
out.append(f'<text x="{left + 100}" y="{legend_y}">denied (429)</text>')
out.append(
    f'<line x1="{left + 200}" y1="{legend_y - 4}" x2="{left + 230}" y2="{legend_y - 4}" '
    f'stroke="#555" stroke-width="1.5"/>'
)
out.append(f'<text x="{left + 236}" y="{legend_y}">allowed in the trailing 10 s</text>')
out.append("</svg>")
open(dst, "w").write("\n".join(out) + "\n")
print(f"wrote {dst}")
