#!/usr/bin/env bash
# The ceiling for the Redis backend: redis-benchmark running EVALSHA of tollgate's GCRA script
# (src/backend/redis/gcra.lua) on a redis-server started here, on a free port, with the same
# arguments the backend sends for a one-quota policy. Compare with `cargo bench --bench redis
# --features redis`.
#
#   ./scripts/bench-redis-ceiling.sh [requests] [clients]
#
# On 2+ cores redis-server is pinned to core 0 and redis-benchmark to core 1, as
# scripts/bench-http.sh pins the HTTP server (and its Redis) and wrk.
set -euo pipefail
cd "$(dirname "$0")/.."
requests="${1:-200000}"
clients="${2:-64}"

dir="$(mktemp -d)"
port="$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')"
pin_server=""
pin_client=""
if [ "$(nproc)" -ge 2 ]; then
  pin_server="taskset -c 0"
  pin_client="taskset -c 1"
fi
$pin_server redis-server --port "$port" --bind 127.0.0.1 --save "" --appendonly no --dir "$dir" >/dev/null &
pid=$!
trap 'kill "$pid" 2>/dev/null || true; wait "$pid" 2>/dev/null || true; rm -rf "$dir"' EXIT
for _ in $(seq 1 100); do
  redis-cli -p "$port" ping >/dev/null 2>&1 && break
  sleep 0.05
done

sha="$(redis-cli -p "$port" -x script load < src/backend/redis/gcra.lua)"
echo "script sha1: $sha"
# KEYS[1] one bucket per random client; ARGV (see gcra.lua; numbers in hexadecimal): Redis
# TIME, one policy of one GCRA quota (kind 0, 1 us emission, burst 10^9, 0), one run of one
# decision of that policy costing 1.
# redis-benchmark -q redraws a progress line with \r: keep the final summary only.
summary() { tr '\r' '\n' | grep 'requests per second'; }
args=(EVALSHA "$sha" 1 "tollgate:{bench:b__rand_int__}:0g1000x1000000000" "" 1 1 0 3e8 3b9aca00 0 1 1 1 1)
echo "allowed decisions, $clients clients, no pipelining:"
$pin_client redis-benchmark -p "$port" -n "$requests" -c "$clients" -r 100000 -q "${args[@]}" | summary
echo "allowed decisions, $clients clients, pipeline 16 (what a busy multiplexed connection approaches):"
$pin_client redis-benchmark -p "$port" -n "$requests" -c "$clients" -r 100000 -P 16 -q "${args[@]}" | summary
# A batch as the backend sends it under load: 16 decisions in one call, on one hot key.
batch=(EVALSHA "$sha" 16)
for _ in $(seq 16); do batch+=("tollgate:{bench:bhot}:0g1000x1000000000"); done
# One run of 16 (0x10) decisions of policy 1 costing 1.
batch+=("" 1 1 0 3e8 3b9aca00 0 1 10 1 1)
echo "calls of 16 decisions on one hot key, $clients clients, no pipelining (x16 = decisions/s):"
$pin_client redis-benchmark -p "$port" -n "$((requests / 4))" -c "$clients" -q "${batch[@]}" | summary
echo "plain SET for reference:"
$pin_client redis-benchmark -p "$port" -n "$requests" -c "$clients" -r 100000 -q SET "k__rand_int__" v | summary
