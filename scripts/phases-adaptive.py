#!/usr/bin/env python3
"""Per-phase goodput and p99 of scripts/bench-adaptive.sh's runs (issue 55, finding 3).

Usage:
    scripts/phases-adaptive.py [RESULTS ...]     (default target/bench-adaptive/results)

Each RESULTS directory is one invocation of the bench script: runs.csv (one row per run kept:
load, contender, generator, rate, duration, the capacity schedule, steal) and requests/, one
CSV per run with every request (`due_s,done_s,latency_ms,outcome,critical`, seconds since the
load began; written by examples/adaptive_load with RAW, or by scripts/oha-adaptive.py from
oha's records). Several directories (one per generator) make one table.

A run at an overload (a capacity schedule) has three phases, its thirds (full capacity, halved,
full again). For each, over its last WINDOW seconds (5) by the time answers came:
- goodput: 2xx answers within the SLO (SLO_MS, default 4 × SERVICE_MS: 80 ms), `/critical`'s
  included, per second, as a share of the phase's capacity (CAPACITY / SERVICE_MS);
- p99 of admitted requests (every answer but a 503; a request given up counts at its timeout).
The no-load p99 is each generator's 0.3× run's p99 over the whole run: `none`'s when it ran,
else tollgate's (which at 0.3× refuses nothing). Goals (issue 55): goodput ≥ GOODPUT_GOAL
(0.95) in every phase, and p99 ≤ P99_FACTOR (1.3) × the no-load p99 in every phase.

Prints Markdown.
"""
import csv
import math
import os
import sys
from collections import OrderedDict

dirs = sys.argv[1:] or ["target/bench-adaptive/results"]
WINDOW = float(os.environ.get("WINDOW", "5"))
GOODPUT_GOAL = float(os.environ.get("GOODPUT_GOAL", "0.95"))
P99_FACTOR = float(os.environ.get("P99_FACTOR", "1.3"))
NAMES = {"none": "no limit", "static": "static cap", "adaptive": "tollgate", "envoy": "Envoy's filter"}


def p99(values):
    if not values:
        return None
    values = sorted(values)
    return values[min(max(math.ceil(0.99 * len(values)), 1), len(values)) - 1]


def capacity_at(run, t):
    """Requests at once at second t since the server's start."""
    c = int(run["capacity"])
    for part in filter(None, (p.strip() for p in run["schedule"].split(","))):
        cap, at = part.split("@")
        if int(at.rstrip("s")) <= t:
            c = int(cap)
    return c


def requests(d, run):
    with open(os.path.join(d, run["raw"])) as f:
        for r in csv.DictReader(f):
            yield float(r["done_s"]), float(r["latency_ms"]), r["outcome"]


def fmt(x, spec):
    return "—" if x is None else format(x, spec)


runs = OrderedDict()  # (generator, load, contender) -> (dir, row)
for d in dirs:
    path = os.path.join(d, "runs.csv")
    if not os.path.exists(path):
        print(f"(no {path})", file=sys.stderr)
        continue
    for row in csv.DictReader(open(path)):
        runs[(row["generator"], row["load"], row["contender"])] = (d, row)

generators = list(OrderedDict.fromkeys(g for g, _, _ in runs))
no_load, reference = {}, {}
for g in generators:
    for (gg, load, contender), (d, run) in runs.items():
        if gg == g and not run["schedule"]:
            dur = float(run["duration"])
            lat = [l for t, l, o in requests(d, run) if o != "rejected" and 0 <= t < dur]
            no_load[(g, contender)] = p99(lat)
    for c in ("none", "adaptive"):
        if no_load.get((g, c)):
            reference[g] = (no_load[(g, c)], c)
            break

print(f"Per phase: the last {WINDOW:g} s of each third (full capacity / halved / full); goodput = 2xx "
      f"within the SLO per second ÷ the phase's capacity; p99 of admitted requests over the same seconds.\n")
print("| generator | load | contender | goodput per phase | p99 ms per phase | steal | goodput ≥ "
      f"{GOODPUT_GOAL:g} | p99 ≤ {P99_FACTOR:g}× no-load |")
print("|---|---|---|---|---|---|---|---|")
verdicts = []
for (g, load, contender), (d, run) in runs.items():
    if not run["schedule"]:
        continue
    dur, start = float(run["duration"]), float(run["start"])
    slo = float(os.environ.get("SLO_MS", 4 * float(run["service_ms"])))
    ends = [dur * (k + 1) / 3 for k in range(3)]
    good, lat = [0, 0, 0], [[], [], []]
    for t, l, o in requests(d, run):
        for k, e in enumerate(ends):
            if e - WINDOW <= t < e:
                good[k] += o == "ok" and l <= slo
                if o != "rejected":
                    lat[k].append(l)
    shares, p99s = [], []
    for k, e in enumerate(ends):
        cap_rps = capacity_at(run, start + e - 0.5) * 1000 / float(run["service_ms"])
        shares.append(good[k] / WINDOW / cap_rps)
        p99s.append(p99(lat[k]))
    ref = reference.get(g)
    ok_good = all(s >= GOODPUT_GOAL for s in shares)
    ok_p99 = ref is not None and all(p is not None and p <= P99_FACTOR * ref[0] for p in p99s)
    miss_good = ", ".join(f"phase {k + 1}" for k, s in enumerate(shares) if s < GOODPUT_GOAL)
    miss_p99 = ", ".join(f"phase {k + 1}" for k, p in enumerate(p99s) if ref and (p is None or p > P99_FACTOR * ref[0]))
    print(f"| {g} | {load}× | {NAMES.get(contender, contender)} | "
          f"{' / '.join(f'{s:.3f}' for s in shares)} | {' / '.join(fmt(p, '.1f') for p in p99s)} | "
          f"{run.get('steal_pct', '?')} % | {'met' if ok_good else 'missed: ' + miss_good} | "
          f"{'met' if ok_p99 else 'missed: ' + (miss_p99 or 'no reference')} |")

print()
for g in generators:
    parts = [f"{NAMES.get(c, c)} {fmt(v, '.1f')} ms" for (gg, c), v in no_load.items() if gg == g]
    ref = reference.get(g)
    line = f"- no-load p99 (0.3×, whole run), {g}: {', '.join(parts) or '—'}"
    if ref:
        line += f"; the goal's reference: {NAMES.get(ref[1], ref[1])}'s, {P99_FACTOR:g}× = {P99_FACTOR * ref[0]:.1f} ms"
    print(line)
