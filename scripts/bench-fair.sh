#!/usr/bin/env bash
# Issue 60's real-time benchmark: fair shedding (flows and criticality) against Envoy's adaptive
# concurrency filter, on real sockets.
#
# examples/adaptive (CAPACITY requests at once, SERVICE_MS ± 50 % each, the rest queued in the
# handler) is loaded by examples/fair_load (open loop, Poisson arrivals, latency from when a
# request was due; classes keyed by x-tenant and x-criticality), once per contender and
# scenario, one after another:
#   fair     tollgate's AdaptiveLayer with flows by x-tenant and criticality from
#            x-criticality, and its fair queue (QUEUE=on: 64 waiting, LIFO, 30 ms at most);
#   fair_nq  the same without the queue (a request over the limit is refused at once);
#   plain    the same limit and queue, without flows or criticality (FAIR=off): whoever comes
#            when the slots are gone is refused;
#   envoy    Envoy 1.40's envoy.filters.http.adaptive_concurrency (scripts/envoy-adaptive.yaml)
#            in front of the example with LIMIT=none.
# Scenarios (examples/fair_load): quiet (the four quiet tenants alone: the no-load p99),
# tenants (four quiet tenants at 0.12 of capacity, a noisy one at 2.52), criticality (critical
# 0.3, default 0.2, sheddable 0.2 spiking to 2.4 in the middle third).
#
# Writes $RESULTS/{summary.csv,seconds.csv,runs.log,table.md} and docs/fair-bench.png
# (scripts/plot-fair.py, matplotlib in target/plot-venv).
#
# Usage: scripts/bench-fair.sh
# Environment (all optional): CONTENDERS="fair fair_nq plain envoy"
#   SCENARIOS="quiet tenants criticality" DURATION=45 FROM=10 CAPACITY=16 SERVICE_MS=20
#   MIN_RTT_INTERVAL=30s ENVOY (a binary) PLOT=1 CARGO_TARGET_DIR (default
#   target/bench-adaptive) RESULTS (default target/bench-adaptive/fair)
#   PIN=1 when nproc ≥ 2 SERVER_CPU=0 LOAD_CPU=1
#   TOLERANCE (exported: the example's gradient tolerance, 1.25 unless given)
set -euo pipefail
cd "$(dirname "$0")/.."
CONTENDERS=${CONTENDERS:-fair fair_nq plain envoy}
SCENARIOS=${SCENARIOS:-quiet tenants criticality}
DURATION=${DURATION:-45}
FROM=${FROM:-10}
CAPACITY=${CAPACITY:-16}
SERVICE_MS=${SERVICE_MS:-20}
MIN_RTT_INTERVAL=${MIN_RTT_INTERVAL:-30s}
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-$PWD/target/bench-adaptive}
RESULTS=${RESULTS:-target/bench-adaptive/fair}
PLOT=${PLOT:-1}
PIN=${PIN:-$([ "$(nproc)" -ge 2 ] && echo 1 || echo 0)}
SERVER_CPU=${SERVER_CPU:-0}
LOAD_CPU=${LOAD_CPU:-1}
# shellcheck source=scripts/lib/procs.sh
. scripts/lib/procs.sh

# shellcheck source=scripts/lib/envoy.sh
. scripts/lib/envoy.sh
if [[ " $CONTENDERS " == *" envoy "* ]]; then
  envoy_find
fi

cargo build -q --release --example adaptive --example fair_load
BIN=$CARGO_TARGET_DIR/release/examples
mkdir -p "$RESULTS"
rm -f "$RESULTS"/summary.csv "$RESULTS"/seconds.csv "$RESULTS"/runs.log
ulimit -n "$(ulimit -Hn)" 2>/dev/null || true


{
  echo "# $(date -u +%FT%TZ) on $(nproc) cores: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs)"
  echo "# commit $(git rev-parse --short HEAD 2>/dev/null || echo '?'); CAPACITY=$CAPACITY SERVICE_MS=$SERVICE_MS DURATION=$DURATION FROM=$FROM PIN=$PIN"
  if [ -n "${ENVOY:-}" ]; then echo "# envoy: $("$ENVOY" --version | grep -o 'version: .*')"; fi
} | tee "$RESULTS/runs.log"

run() { # contender scenario
  local contender=$1 scenario=$2 port url envoy="" server
  local limit=adaptive fair=on queue=on
  case $contender in
    fair) ;;
    fair_nq) queue=off ;;
    plain) fair=off ;;
    envoy) limit=none ;;
    *) echo "unknown contender $contender" >&2; exit 1 ;;
  esac
  port=$(free_port)
  url=http://127.0.0.1:$port/
  PORT=$port CAPACITY=$CAPACITY SERVICE_MS=$SERVICE_MS LIMIT=$limit FAIR=$fair QUEUE=$queue \
    "${on_server[@]}" "$BIN/adaptive" >"$dir/server.log" 2>&1 &
  server=$!
  pids+=("$server")
  wait_port "$port"
  if [ "$contender" = envoy ]; then
    local listen admin
    listen=$(free_port) admin=$(free_port)
    sed -e "s/@LISTEN_PORT@/$listen/; s/@UPSTREAM_PORT@/$port/; s/@ADMIN_PORT@/$admin/; s/@MIN_RTT_INTERVAL@/$MIN_RTT_INTERVAL/" \
      scripts/envoy-adaptive.yaml >"$dir/envoy.yaml"
    "$ENVOY" --mode validate -c "$dir/envoy.yaml" >"$dir/validate.log" 2>&1 || { cat "$dir/validate.log"; exit 1; }
    "${on_server[@]}" "$ENVOY" -c "$dir/envoy.yaml" --concurrency 1 -l warning \
      --disable-hot-restart >"$dir/envoy.log" 2>&1 &
    envoy=$!
    pids+=("$envoy")
    wait_port "$admin"
    wait_port "$listen"
    url=http://127.0.0.1:$listen/
  fi
  echo "== $contender, $scenario: $(uptime | sed 's/.*load/load/')" | tee -a "$RESULTS/runs.log"
  URL=$url SCENARIO=$scenario DURATION=$DURATION FROM=$FROM CAPACITY=$CAPACITY \
    SERVICE_MS=$SERVICE_MS CONTENDER=$contender SUMMARY="$RESULTS/summary.csv" \
    OUT="$RESULTS/seconds.csv" "${on_load[@]}" "$BIN/fair_load" 2>&1 |
    sed 's/^/   /' | tee -a "$RESULTS/runs.log"
  if [ -z "$envoy" ]; then
    curl -s "${url}limit" | sed 's/^/   /' >>"$RESULTS/runs.log"
  else
    curl -s "http://127.0.0.1:$admin/stats?filter=adaptive_concurrency" | sed 's/^/   /' >>"$RESULTS/runs.log"
    kill "$envoy"
    wait "$envoy" 2>/dev/null || true
  fi
  kill "$server"
  wait "$server" 2>/dev/null || true
}

for contender in $CONTENDERS; do
  for scenario in $SCENARIOS; do
    run "$contender" "$scenario"
  done
done

# The table: each class's 2xx within the SLO and p99, and the quiet tenants' p99 against their
# no-load p99 (the quiet scenario, same contender).
python3 - "$RESULTS/summary.csv" >"$RESULTS/table.md" <<'PY'
import csv, sys
rows = list(csv.DictReader(open(sys.argv[1])))
alone = {}
for r in rows:
    if r["scenario"] == "quiet":
        alone[r["contender"]] = max(alone.get(r["contender"], 0.0), float(r["p99_ms"]))
print("| contender | scenario | class | sent | 2xx within the SLO | p99 of 2xx (ms) | p99 / no-load p99 |")
print("|---|---|---|---:|---:|---:|---:|")
for r in rows:
    ratio = ""
    if r["scenario"] != "quiet" and r["contender"] in alone and alone[r["contender"]] > 0:
        ratio = f"{float(r['p99_ms']) / alone[r['contender']]:.2f}×"
    print(f"| {r['contender']} | {r['scenario']} | {r['class']} | {r['sent']} | "
          f"{100 * float(r['good_share']):.2f} % | {float(r['p99_ms']):.1f} | {ratio} |")
PY
cat "$RESULTS/table.md"

if [ "$PLOT" = 1 ]; then
  if [ ! -x target/plot-venv/bin/python ]; then
    python3 -m venv target/plot-venv
    target/plot-venv/bin/pip install -q matplotlib
  fi
  target/plot-venv/bin/python scripts/plot-fair.py "$RESULTS/summary.csv" "$RESULTS/seconds.csv" docs/fair-bench.png
fi
