#!/usr/bin/env python3
"""Turns one oha run of scripts/bench-adaptive.sh (GENERATOR=oha) into examples/adaptive_load's files.

Usage (the bench script calls it):
    scripts/oha-adaptive.py OHA_DB OHA_JSON RAW_OUT SECONDS_OUT SUMMARY_OUT

oha (`-q RATE --latency-correction`, `--db-url OHA_DB`) stores each answered request: its URL,
when its pacer released it (`start_latency_correction`), when it was sent and answered, and its
status, in seconds since oha's own start; requests it gave up on (`-t`) or could not send are
only counted, in OHA_JSON's `errorDistribution`. This writes, as examples/adaptive_load does:
- RAW_OUT: one row per answered request, `due_s,done_s,latency_ms,outcome,critical`, seconds
  since the load began (oha's start plus OFFSET_S), the latency oha measured (from its pacer's
  release, so a request waiting for a free connection counts the wait);
- SECONDS_OUT and SUMMARY_OUT: rows appended in adaptive_load's columns (no limit: oha does
  not poll it), so scripts/plot-adaptive.py reads them unchanged.

The environment gives the run: LOAD, CONTENDER, RATE, DURATION, START (seconds from the
server's start to the load's), OFFSET_S (oha's start minus the load's, seconds), CAPACITY,
SERVICE_MS, CAPACITY_SCHEDULE, SLO_MS (default 4 × SERVICE_MS).

`max_lag_ms` in the summary is how late oha's pacer released a request against a fixed
schedule (the k-th release against k / RATE; meaningful when no request failed to be sent),
which oha's own latency does not count.
"""
import csv
import json
import math
import os
import sqlite3
import sys

db, js, raw_out, seconds_out, summary_out = sys.argv[1:6]
env = os.environ
load, contender = env["LOAD"], env["CONTENDER"]
rate = float(env["RATE"])
duration = int(env["DURATION"])
start = int(env.get("START", "1"))
offset = float(env.get("OFFSET_S", "0"))
capacity = int(env.get("CAPACITY", "16"))
service_ms = float(env.get("SERVICE_MS", "20"))
slo_ms = float(env.get("SLO_MS", 4 * service_ms))
steps = []
for part in filter(None, (p.strip() for p in env.get("CAPACITY_SCHEDULE", "").split(","))):
    c, at = part.split("@")
    steps.append((int(at.rstrip("s")), int(c)))
steps.sort()


def capacity_at(t):  # t: seconds since the server's start
    c = capacity
    for at, cap in steps:
        if at <= t:
            c = cap
    return c


rows = sqlite3.connect(db).execute(
    "SELECT url, start_latency_correction, start, end, duration, status FROM oha ORDER BY start_latency_correction"
).fetchall()
summary = json.load(open(js))
failed = sum(summary.get("errorDistribution", {}).values())
timeouts = sum(n for e, n in summary.get("errorDistribution", {}).items() if "timeout" in e.lower())

requests = []  # (due_s, done_s, latency_ms, outcome, critical), seconds since the load began
lags = []
for k, (url, due, sent, end, dur, status) in enumerate(rows):
    due = sent if due is None else due
    outcome = "ok" if 200 <= status < 300 else "rejected" if status == 503 else "error"
    requests.append((due + offset, end + offset, 1000 * dur, outcome, int(url.rstrip("/").endswith("/critical"))))
    lags.append(1000 * (due - k / rate))

with open(raw_out, "w", newline="") as f:
    w = csv.writer(f)
    w.writerow(["due_s", "done_s", "latency_ms", "outcome", "critical"])
    for due, done, lat, outcome, crit in requests:
        w.writerow([f"{due:.6f}", f"{done:.6f}", f"{lat:.3f}", outcome, crit])


def q(sorted_values, p):
    """The p-quantile (nearest rank, as adaptive_load takes it) in ms, '' when empty."""
    if not sorted_values:
        return ""
    rank = min(max(math.ceil(p * len(sorted_values)), 1), len(sorted_values))
    return f"{sorted_values[rank - 1]:.2f}"


def mean(values):
    return f"{sum(values) / len(values):.2f}" if values else ""


seconds = [dict(sent=0, ok=0, good=0, rejected=0, crit_sent=0, crit_ok=0, crit_good=0, admitted=[], rej=[])
           for _ in range(duration)]
for due, done, lat, outcome, crit in requests:
    ts = int(due) if due >= 0 else -1
    if 0 <= ts < duration:
        seconds[ts]["sent"] += 1
        seconds[ts]["crit_sent"] += crit
    td = int(done) if done >= 0 else -1
    if not 0 <= td < duration:
        continue
    s = seconds[td]
    good = outcome == "ok" and lat <= slo_ms
    if outcome == "ok":
        s["ok"] += 1
        s["good"] += good
        s["crit_ok"] += crit
        s["crit_good"] += crit and good
    if outcome == "rejected":
        s["rejected"] += 1
        s["rej"].append(lat)
    else:
        s["admitted"].append(lat)

new = not os.path.exists(seconds_out) or os.path.getsize(seconds_out) == 0
with open(seconds_out, "a") as f:
    if new:
        f.write("load,contender,t,capacity_rps,sent,ok,good,rejected,timeouts,errors,p50_ms,p99_ms,mean_ms,"
                "rej_p99_ms,rej_sent_p99_ms,crit_sent,crit_ok,crit_good,limit,limit_min,limit_max,lag_ms\n")
    for t, s in enumerate(seconds):
        a, r = sorted(s["admitted"]), sorted(s["rej"])
        f.write(f"{load},{contender},{t},{capacity_at(t + start) * 1000 / service_ms:.0f},{s['sent']},{s['ok']},"
                f"{s['good']},{s['rejected']},0,0,{q(a, 0.5)},{q(a, 0.99)},{mean(a)},{q(r, 0.99)},,"
                f"{s['crit_sent']},{s['crit_ok']},{s['crit_good']},,,,\n")

admitted = sorted(lat for _, _, lat, o, _ in requests if o != "rejected")
rejected = sorted(lat for _, _, lat, o, _ in requests if o == "rejected")
ok = sum(o == "ok" for _, _, _, o, _ in requests)
good = sum(o == "ok" and lat <= slo_ms for _, _, lat, o, _ in requests)
crit = [(o, lat) for _, _, lat, o, c in requests if c]
new = not os.path.exists(summary_out) or os.path.getsize(summary_out) == 0
with open(summary_out, "a") as f:
    if new:
        f.write("load,contender,rate,seconds,sent,ok,good,rejected,timeouts,errors,p50_ms,p99_ms,mean_ms,"
                "settled_p50_ms,settled_p99_ms,settled_mean_ms,rej_p50_ms,rej_p99_ms,rej_sent_p99_ms,"
                "crit_sent,crit_ok,crit_good,max_lag_ms\n")
    f.write(f"{load},{contender},{rate:.0f},{duration},{len(requests) + failed},{ok},{good},{len(rejected)},"
            f"{timeouts},{failed - timeouts + sum(o == 'error' for _, _, _, o, _ in requests)},"
            f"{q(admitted, 0.5)},{q(admitted, 0.99)},{mean(admitted)},,,,{q(rejected, 0.5)},{q(rejected, 0.99)},,"
            f"{len(crit)},{sum(o == 'ok' for o, _ in crit)},{sum(o == 'ok' and l <= slo_ms for o, l in crit)},"
            f"{max(lags, default=0):.2f}\n")
lags.sort()
print(f"{load} {contender} (oha): {len(requests)} answered, {failed} failed {summary.get('errorDistribution', {})}, "
      f"good {good}, rejected {len(rejected)}, p99 {q(admitted, 0.99)} ms; pacer lag p99 {q(lags, 0.99)} ms, "
      f"max {max(lags, default=0):.2f} ms", file=sys.stderr)
