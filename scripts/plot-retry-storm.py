#!/usr/bin/env python3
"""Plots scripts/bench-retry-storm.sh's spike runs: what the upstream received and the goodput,
second by second, per mode, for a load of 3x its capacity, a spike to 10x, and a fall to half.

Usage:
    scripts/plot-retry-storm.py [target/bench-retry-storm] [docs/retry-storm.png]

Reads <mode>.txt (examples/retry_storm's output, one line per second) for naive, budget,
throttle and both. Needs matplotlib (the bench script installs it in a venv).
"""
import os
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

src = sys.argv[1] if len(sys.argv) > 1 else "target/bench-retry-storm"
dst = sys.argv[2] if len(sys.argv) > 2 else "docs/retry-storm.png"
MODES = [
    ("naive", "naive retries", "#d62728"),
    ("budget", "retry budget", "#ff7f0e"),
    ("throttle", "throttle", "#1f77b4"),
    ("both", "budget and throttle", "#2ca02c"),
]

fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 7), sharex=True)
for mode, label, color in MODES:
    path = os.path.join(src, f"{mode}.txt")
    if not os.path.exists(path):
        continue
    secs, received, good = [], [], []
    with open(path) as f:
        for line in f:
            parts = line.split()
            if len(parts) != 8 or not parts[0].isdigit():
                continue
            secs.append(int(parts[0]))
            received.append(int(parts[3]))
            good.append(int(parts[7]))
    top.plot(secs, received, label=label, color=color)
    bottom.plot(secs, good, label=label, color=color)
for ax in (top, bottom):
    ax.axhline(800, color="#888888", linestyle="--", linewidth=1)
    ax.grid(alpha=0.3)
top.set_yscale("log")
top.set_ylabel("calls the upstream received / s")
bottom.set_ylabel("goodput (200 within 500 ms) / s")
bottom.set_xlabel("second (offered: 3x capacity, 10x from 5 s, 0.5x from 15 s)")
top.legend(loc="upper right")
top.set_title("examples/retry_storm: 16 workers x 20 ms (800/s, dashed), 10 clients, 3 retries")
fig.tight_layout()
fig.savefig(dst, dpi=110)
print(f"wrote {dst}")
