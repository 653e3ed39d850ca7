#!/usr/bin/env python3
"""Plots and tabulates issue 46's real-time benchmark (scripts/bench-adaptive.sh).

Usage:
    scripts/plot-adaptive.py [target/bench-adaptive/results] [docs/adaptive-bench.png]

Reads seconds.csv (one row per second, contender and load) and summary.csv (one row per run)
written by examples/adaptive_load, draws one column of panels per load (goodput with the
capacity and 90 % of it, p99 of admitted requests, rejections per second, the limit; one line
per contender) into the PNG, and prints a Markdown table and the goals of the issue, met or
not, computed from the same rows. Needs matplotlib (the bench script installs it in a venv).
"""
import csv
import statistics
import sys
from collections import defaultdict

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

src = sys.argv[1] if len(sys.argv) > 1 else "target/bench-adaptive/results"
dst = sys.argv[2] if len(sys.argv) > 2 else "docs/adaptive-bench.png"

COLORS = {"none": "#888888", "static": "#1f77b4", "adaptive": "#2ca02c", "envoy": "#d62728"}
NAMES = {
    "none": "no limit",
    "static": "static cap",
    "adaptive": "tollgate adaptive",
    "envoy": "Envoy adaptive_concurrency",
}


def num(v):
    return float(v) if v not in ("", None) else None


seconds = defaultdict(list)  # (load, contender) -> rows in time order
loads, contenders = [], []
for r in csv.DictReader(open(f"{src}/seconds.csv")):
    seconds[(r["load"], r["contender"])].append(r)
    if r["load"] not in loads:
        loads.append(r["load"])
    if r["contender"] not in contenders:
        contenders.append(r["contender"])
summary = {(r["load"], r["contender"]): r for r in csv.DictReader(open(f"{src}/summary.csv"))}


def changes(rows):
    """The seconds (since the load's start) where the capacity changed, the start included."""
    out, last = [0], None
    for r in rows:
        c = r["capacity_rps"]
        if last is not None and c != last:
            out.append(int(r["t"]))
        last = c
    return out


def settled(rows):
    """The rows 10 s or more after the last change (the start counts as one)."""
    marks = changes(rows)
    return [r for r in rows if int(r["t"]) >= max(m for m in marks if m <= int(r["t"])) + 10]


# --- the plot -----------------------------------------------------------------------------
panels = ["goodput (2xx within SLO, /s)", "p99 of admitted (ms)", "rejections (/s)", "limit"]
fig, axes = plt.subplots(len(panels), len(loads), figsize=(5.2 * len(loads), 11), sharex="col", squeeze=False)
for j, load in enumerate(loads):
    for contender in contenders:
        rows = seconds.get((load, contender))
        if not rows:
            continue
        t = [int(r["t"]) for r in rows]
        style = dict(color=COLORS.get(contender), label=NAMES.get(contender, contender), lw=1.4)
        axes[0][j].plot(t, [int(r["good"]) for r in rows], **style)
        axes[1][j].plot(t, [num(r["p99_ms"]) for r in rows], **style)
        axes[2][j].plot(t, [int(r["rejected"]) for r in rows], **style)
        if any(r["limit"] for r in rows):
            axes[3][j].plot(t, [num(r["limit"]) for r in rows], **style)
            # Where the limit dipped within a second (Envoy's minRTT window lasts less than one).
            axes[3][j].plot(t, [num(r["limit_min"]) for r in rows], color=style["color"], lw=0.6, ls=":")
    rows = seconds[(load, contenders[0])]
    t = [int(r["t"]) for r in rows]
    cap = [float(r["capacity_rps"]) for r in rows]
    axes[0][j].step(t, cap, where="post", color="black", ls="--", lw=0.8, label="capacity")
    axes[0][j].step(t, [0.9 * c for c in cap], where="post", color="black", ls=":", lw=0.8, label="90 % of capacity")
    rate = summary[(load, contenders[0])]["rate"]
    axes[0][j].set_title(f"{load}× capacity ({float(rate):.0f} requests/s)")
    axes[1][j].set_yscale("log")
    for i in range(len(panels)):
        ax = axes[i][j]
        lo = [r for r in rows if float(r["capacity_rps"]) < max(cap)]
        if lo:
            ax.axvspan(int(lo[0]["t"]), int(lo[-1]["t"]) + 1, color="#f3e6c8", lw=0, zorder=0)
        ax.grid(alpha=0.3)
        if j == 0:
            ax.set_ylabel(panels[i])
    axes[-1][j].set_xlabel("seconds (shaded: capacity halved)")
axes[0][0].legend(fontsize=8, loc="lower left")
# What the run was: its commit and generator, from runs.log when there is one.
about = ""
try:
    log = open(f"{src}/runs.log").read().splitlines()
    commit = next((l.split()[1] for l in log if l.startswith("commit ")), "")
    generator = next((l.split(": ", 1)[1].split(" (")[0] for l in log if l.startswith("generator: ")), "adaptive_load")
    about = f" ({generator}, at {commit})" if commit else ""
except OSError:
    pass
fig.suptitle(f"examples/adaptive under an open-loop load{about}: tollgate's adaptive limit against Envoy's filter")
fig.tight_layout()
fig.savefig(dst, dpi=110)

# --- the table ------------------------------------------------------------------------------
print(f"Plot: {dst}\n")
print("| load | contender | goodput /s (settled mean) | worst settled second, % of capacity | "
      "p50 ms | p99 ms | p99 ms, settled | rejected | rejection p99 ms (from due / from send) | "
      "most rejections in a settled second | lowest limit after 5 s | timeouts | /critical 2xx (within SLO) |")
print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
verdicts = []
for load in loads:
    for contender in contenders:
        rows, s = seconds.get((load, contender)), summary.get((load, contender))
        if not rows or not s:
            continue
        st = settled(rows)
        mean_good = statistics.mean(int(r["good"]) for r in st) if st else 0
        worst = min(st, key=lambda r: int(r["good"]) / float(r["capacity_rps"])) if st else None
        worst_txt = f"{100 * int(worst['good']) / float(worst['capacity_rps']):.0f} % (t={worst['t']})" if worst and float(load) > 1 else "—"
        limits = [int(r["limit_min"]) for r in rows if r["limit_min"] and int(r["t"]) >= 5]
        crit = "—"
        if int(s["crit_sent"]):
            crit = (f"{100 * int(s['crit_ok']) / int(s['crit_sent']):.1f} % "
                    f"({100 * int(s['crit_good']) / int(s['crit_sent']):.1f} %)")
        rej_pct = 100 * int(s["rejected"]) / max(1, int(s["sent"]))
        print(f"| {load}× | {NAMES.get(contender, contender)} | {mean_good:.0f} | {worst_txt} | "
              f"{s['p50_ms']} | {s['p99_ms']} | {s['settled_p99_ms']} | {s['rejected']} ({rej_pct:.1f} %) | "
              f"{s['rej_p99_ms'] or '—'} / {s['rej_sent_p99_ms'] or '—'} | "
              f"{max((int(r['rejected']) for r in st), default=0)} | {min(limits) if limits else '—'} | "
              f"{s['timeouts']} | {crit} |")

# --- the goals -----------------------------------------------------------------------------
print("\nGoals (issue 46):\n")
base = summary.get(("0.3", "none"))
no_load_p99 = num(base["p99_ms"]) if base else None
if no_load_p99:
    print(f"- no-load p99 (0.3×, no limit): {no_load_p99:.2f} ms; 2× = {2 * no_load_p99:.2f} ms")
for contender in [c for c in contenders if c != "none"]:
    name = NAMES.get(contender, contender)
    lines = []
    for load in [l for l in loads if float(l) > 1]:
        rows, s = seconds.get((load, contender)), summary.get((load, contender))
        if not rows:
            continue
        st = settled(rows)
        below = [r for r in st if int(r["good"]) < 0.9 * float(r["capacity_rps"])]
        if st:
            lines.append(f"goodput ≥ 90 % of capacity every settled second at {load}×: "
                         f"{'met' if not below else 'MISSED'} ({len(below)} of {len(st)} seconds below"
                         + (f"; worst {min(int(r['good']) for r in below)}/s at t={min(below, key=lambda r: int(r['good']))['t']}" if below else "")
                         + ")")
        p99, sp99 = num(s["p99_ms"]), num(s["settled_p99_ms"])
        if no_load_p99 and p99 and sp99:
            lines.append(f"p99 ≤ 2× no-load at {load}×: whole run {p99:.1f} ms "
                         f"{'met' if p99 <= 2 * no_load_p99 else 'MISSED'}, settled {sp99:.1f} ms "
                         f"{'met' if sp99 <= 2 * no_load_p99 else 'MISSED'}")
        if s["rej_p99_ms"]:
            r1, r2 = num(s["rej_p99_ms"]), num(s["rej_sent_p99_ms"])
            per_second = statistics.median(num(r["rej_p99_ms"]) for r in rows if r["rej_p99_ms"])
            sent_txt = f"{r2:.2f} ms from send" if r2 is not None else "from send not measured"
            lines.append(f"rejections < 1 ms at p99 at {load}×: {r1:.2f} ms from due (p50 {s['rej_p50_ms']}), {sent_txt}; median of the seconds' p99 {per_second:.2f} ms: "
                         f"{'met' if r1 < 1 else ('met from the send only' if r2 is not None and r2 < 1 else 'MISSED')}")
        if int(s["crit_sent"]):
            ratio = int(s["crit_ok"]) / int(s["crit_sent"])
            lines.append(f"/critical ≥ 95 % success at {load}×: {100 * ratio:.1f} % "
                         f"({100 * int(s['crit_good']) / int(s['crit_sent']):.1f} % within the SLO) "
                         f"{'met' if ratio >= 0.95 else 'MISSED'}")
    low, low_none = summary.get(("0.3", contender)), summary.get(("0.3", "none"))
    if low and low_none:
        added = [(100 * (num(low[k]) / num(low_none[k]) - 1)) for k in ("mean_ms", "p50_ms", "p99_ms")]
        lines.append(f"0.3×: {low['rejected']} rejected, added latency mean {added[0]:+.1f} %, p50 {added[1]:+.1f} %, "
                     f"p99 {added[2]:+.1f} %: {'met' if int(low['rejected']) == 0 and added[0] <= 1 else 'MISSED'}")
    print(f"- **{name}**")
    for line in lines:
        print(f"  - {line}")

if "adaptive" in contenders and "envoy" in contenders:
    print("- **tollgate against Envoy's filter** (overload loads)")
    for load in [l for l in loads if float(l) > 1]:
        a, e = summary.get((load, "adaptive")), summary.get((load, "envoy"))
        if not a or not e:
            continue
        ra, re_ = seconds[(load, "adaptive")], seconds[(load, "envoy")]
        if not settled(ra) or not settled(re_):
            continue
        burst_a = max(int(r["rejected"]) for r in settled(ra))
        burst_e = max(int(r["rejected"]) for r in settled(re_))
        med_a = statistics.median(int(r["rejected"]) for r in settled(ra))
        med_e = statistics.median(int(r["rejected"]) for r in settled(re_))
        pinned = [r["t"] for r in re_ if r["limit_min"] and int(r["limit_min"]) <= 3 and int(r["t"]) >= 2]
        print(f"  - {load}×: good answers {a['good']} against {e['good']} "
              f"({'ahead' if int(a['good']) > int(e['good']) else 'NOT ahead'}); p99 {a['p99_ms']} against "
              f"{e['p99_ms']} ms ({'ahead' if num(a['p99_ms']) < num(e['p99_ms']) else 'NOT ahead'}); "
              f"settled seconds' rejections, median/most: tollgate {med_a:.0f}/{burst_a}, Envoy {med_e:.0f}/{burst_e}; "
              f"Envoy's limit pinned to 3 in seconds {', '.join(pinned) or 'none'}")
