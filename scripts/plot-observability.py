#!/usr/bin/env python3
"""Draws what tollgate's dashboard shows during a store outage and its recovery.

Usage:
    cargo nextest run --all-features --test monitoring_live   # writes target/observability-run.json
    scripts/plot-observability.py [target/observability-run.json] [docs/observability.png]

The data are the dashboard's main queries as the live test's real Prometheus answered them
(`query_range`, a point a second) while a tollgate server under load lost its Redis (killed)
and got it back (restarted): decisions by outcome, store errors, the circuit breaker, the
store's p99 latency, and the state of the `TollgateStoreFailing` alert. Needs matplotlib; the
script makes a virtualenv for it under target/ when it is missing.
"""
import json
import os
import subprocess
import sys

try:
    import matplotlib
except ImportError:
    venv = os.path.join(os.path.dirname(__file__), "..", "target", "plot-venv")
    py = os.path.join(venv, "bin", "python3")
    if not os.path.exists(py):
        subprocess.check_call([sys.executable, "-m", "venv", venv])
        subprocess.check_call([py, "-m", "pip", "install", "-q", "matplotlib"])
    os.execv(py, [py] + sys.argv)

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

src = sys.argv[1] if len(sys.argv) > 1 else "target/observability-run.json"
dst = sys.argv[2] if len(sys.argv) > 2 else "docs/observability.png"
run = json.load(open(src))
t0 = run["start"]


def series(name):
    for r in run[name]["result"]:
        xs = [float(t) - t0 for t, _ in r["values"]]
        ys = [float(v) for _, v in r["values"]]
        yield r["metric"], xs, ys


panels = [
    ("decisions", "Decisions by outcome (req/s)", lambda m: m.get("outcome", "")),
    ("errors", "Store errors (per s)", lambda m: m.get("kind", "")),
    ("breaker", "Circuit breaker open", lambda m: m.get("backend", "")),
    ("p99", "Store latency p99 (ms)", lambda m: "p99"),
    ("alert", "TollgateStoreFailing", lambda m: m.get("alertstate", "")),
]
fig, axes = plt.subplots(len(panels), 1, figsize=(9, 11), sharex=True)
for ax, (name, title, label) in zip(axes, panels):
    for metric, xs, ys in series(name):
        if name == "p99":
            ys = [y * 1000 for y in ys]
        ax.plot(xs, ys, label=label(metric), linewidth=1.5)
    ax.set_title(title, fontsize=10, loc="left")
    for at, what in ((run["killed"], "Redis killed"), (run["restarted"], "Redis back")):
        ax.axvline(at - t0, color="grey", linestyle="--", linewidth=1)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8, loc="upper right")
    ax.grid(alpha=0.3)
axes[0].annotate("Redis killed", (run["killed"] - t0, axes[0].get_ylim()[1]), fontsize=8,
                 xytext=(3, -10), textcoords="offset points")
axes[0].annotate("Redis back", (run["restarted"] - t0, axes[0].get_ylim()[1]), fontsize=8,
                 xytext=(3, -10), textcoords="offset points")
axes[-1].set_xlabel("seconds since Prometheus started scraping")
fig.suptitle("tollgate under load, its Redis killed and restarted: the dashboard's main queries,\n"
             "as a real Prometheus answered them (tests/monitoring_live.rs)", fontsize=10)
fig.tight_layout()
fig.savefig(dst, dpi=90)
print(f"wrote {dst}")
