"""Plots scripts/bench-fair.sh's results: docs/fair-bench.png.

Left: the tenants scenario, each class's share of requests answered 2xx within the SLO, per
contender. Right: the criticality scenario over time, each class's share per second, for
tollgate (fair) and Envoy's filter.

Usage: plot-fair.py SUMMARY_CSV SECONDS_CSV OUT_PNG
"""

import csv
import sys
from collections import defaultdict

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

summary = list(csv.DictReader(open(sys.argv[1])))
seconds = list(csv.DictReader(open(sys.argv[2])))

fig, (left, mid, right) = plt.subplots(1, 3, figsize=(16, 4.8))

# Tenants: bars per contender, a group per class.
tenants = [r for r in summary if r["scenario"] == "tenants"]
contenders = list(dict.fromkeys(r["contender"] for r in tenants))
classes = list(dict.fromkeys(r["class"] for r in tenants))
width = 0.8 / max(1, len(contenders))
for i, contender in enumerate(contenders):
    share = {r["class"]: 100 * float(r["good_share"]) for r in tenants if r["contender"] == contender}
    xs = [j + i * width for j in range(len(classes))]
    left.bar(xs, [share.get(c, 0) for c in classes], width, label=contender)
left.set_xticks([j + 0.4 - width / 2 for j in range(len(classes))], classes)
left.set_ylabel("% of requests 2xx within the SLO")
left.set_title("One noisy tenant at 20× each quiet one (3× capacity)")
left.set_ylim(0, 105)
left.legend(fontsize=8)


def over_time(ax, contender):
    per = defaultdict(dict)
    for r in seconds:
        if r["scenario"] == "criticality" and r["contender"] == contender:
            sent = int(r["sent"])
            if sent:
                per[r["class"]][int(r["t"])] = 100 * int(r["good"]) / sent
    for cls, points in per.items():
        ts = sorted(points)
        ax.plot(ts, [points[t] for t in ts], label=cls)
    ax.set_ylim(0, 105)
    ax.set_xlabel("second")
    ax.set_title(f"Sheddable spikes 12× ({contender})")
    ax.legend(fontsize=8)


over_time(mid, "fair")
over_time(right, "envoy")
mid.set_ylabel("% 2xx within the SLO, per second")
fig.tight_layout()
fig.savefig(sys.argv[3], dpi=110)
print(f"wrote {sys.argv[3]}")
