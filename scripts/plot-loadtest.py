#!/usr/bin/env python3
"""Draws the load test (examples/loadtest.rs) over time, per shape, algorithm and backend.

Usage:
    cargo run --release --example loadtest --features redis > target/loadtest.csv
    scripts/plot-loadtest.py [target/loadtest.csv] [docs/loadtest.svg]

One panel per traffic shape (rows) and algorithm (columns): allowed (green) and denied (red)
responses per second, in 100 ms steps, for the local backend (solid) and Redis (dashed), with
the quota's rate (grey, dashed). Every number comes from a real run through the layer.

No dependencies beyond the Python standard library: the SVG is written by hand.
"""
import csv
import sys
from collections import defaultdict

src = sys.argv[1] if len(sys.argv) > 1 else "target/loadtest.csv"
dst = sys.argv[2] if len(sys.argv) > 2 else "docs/loadtest.svg"

series = defaultdict(dict)  # (shape, algorithm, backend) -> {t_ms: (allowed, denied)}
limits = {}
shapes, algorithms, backends = [], [], []
for r in csv.DictReader(open(src)):
    key = (r["shape"], r["algorithm"], r["backend"])
    series[key][int(r["t_ms"])] = (int(r["allowed"]), int(r["denied"]))
    limits[r["shape"]] = int(r["limit_per_s"])
    for v, seen in ((r["shape"], shapes), (r["algorithm"], algorithms), (r["backend"], backends)):
        if v not in seen:
            seen.append(v)
end_ms = max(t for s in series.values() for t in s) + 100

titles = {
    "under": "steady under the limit (10/s)",
    "over": "steady over the limit (40/s)",
    "burst": "5/s, a burst of 60 at 3 s",
    "ramp": "a ramp from 0 to 60/s",
    "many_keys": "50 clients at 30/s each",
}
pw, ph = 300, 130  # panel size
left, top, gap_x, gap_y = 70, 68, 30, 50
W = left + len(algorithms) * (pw + gap_x) + 10
H = top + len(shapes) * (ph + gap_y) + 40
out = [
    f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" font-family="sans-serif" '
    f'font-size="11">',
    f'<rect width="{W}" height="{H}" fill="white"/>',
    f'<text x="{left}" y="18" font-size="14">Allowed and denied responses per second over time '
    f"(quota: 20 per second per client), local backend and Redis</text>",
]
for j, algo in enumerate(algorithms):
    x0 = left + j * (pw + gap_x)
    out.append(f'<text x="{x0 + pw / 2}" y="38" text-anchor="middle" font-weight="bold">{algo}</text>')
for i, shape in enumerate(shapes):
    y0 = top + i * (ph + gap_y)
    peak = max(
        [
            10 * max(a, d)
            for (s, _, _), pts in series.items()
            if s == shape
            for a, d in pts.values()
        ]
        + [limits[shape] * 1.2]
    )
    out.append(f'<text x="{left}" y="{y0 - 6}">{titles.get(shape, shape)}</text>')
    for j, algo in enumerate(algorithms):
        x0 = left + j * (pw + gap_x)
        X = lambda t: x0 + pw * t / end_ms
        Y = lambda v: y0 + ph - ph * v / peak
        out.append(f'<rect x="{x0}" y="{y0}" width="{pw}" height="{ph}" fill="none" stroke="#999"/>')
        ly = Y(limits[shape])
        out.append(
            f'<line x1="{x0}" y1="{ly:.1f}" x2="{x0 + pw}" y2="{ly:.1f}" stroke="#888" '
            f'stroke-dasharray="4 3"/>'
        )
        if j == 0:
            out.append(f'<text x="{x0 - 4}" y="{ly + 4:.1f}" text-anchor="end">{limits[shape]}/s</text>')
        for sec in range(0, end_ms // 1000 + 1, 2):
            out.append(
                f'<text x="{X(sec * 1000):.1f}" y="{y0 + ph + 12}" text-anchor="middle" '
                f'fill="#666">{sec} s</text>'
            )
        for backend in backends:
            pts = series.get((shape, algo, backend), {})
            dash = ' stroke-dasharray="5 3"' if backend != "local" else ""
            for idx, color in ((0, "#2a9d3a"), (1, "#d62828")):
                line = " ".join(
                    f"{X(t):.1f},{Y(10 * pts.get(t, (0, 0))[idx]):.1f}"
                    for t in range(0, end_ms, 100)
                )
                out.append(
                    f'<polyline points="{line}" fill="none" stroke="{color}" '
                    f'stroke-width="1.5"{dash}/>'
                )
ly = H - 14
legend = [
    ("#2a9d3a", "", "allowed, local"),
    ("#2a9d3a", ' stroke-dasharray="5 3"', "allowed, Redis"),
    ("#d62828", "", "denied, local"),
    ("#d62828", ' stroke-dasharray="5 3"', "denied, Redis"),
]
for k, (color, dash, text) in enumerate(legend):
    x = left + k * 150
    out.append(
        f'<line x1="{x}" y1="{ly - 4}" x2="{x + 30}" y2="{ly - 4}" stroke="{color}" '
        f'stroke-width="1.5"{dash}/>'
    )
    out.append(f'<text x="{x + 36}" y="{ly}">{text}</text>')
out.append("</svg>")
open(dst, "w").write("\n".join(out) + "\n")
print(f"wrote {dst}")
