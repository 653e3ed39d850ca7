#!/usr/bin/env bash
# Envoy's rate limit service under load: calls per second answered by examples/rls for
# BACKEND=none (a bare tonic RLS answering OK without deciding: the floor), local and redis,
# with the same load generator (examples/rls_load: 64 calls in flight over 4 HTTP/2
# connections, 10 000 distinct remote_address values, a limit never reached). The server and
# its redis-server are pinned to core 0, the generator to core 1. Rounds interleave the modes;
# the median of each is reported, with its ratio to the floor.
#
# Usage: scripts/bench-rls.sh   (limitador: LIMITADOR=path/to/limitador-server
#   LIMITADOR_LIMITS=scripts/limitador-limits.yaml, its limit the same as the rules below)
# Environment (all optional): MODES="none local redis" (the modes of scripts/lib/rls-modes.sh:
#   also server, server_noprom, server_redis for the tollgate-server binary, limitador and
#   limitador_redis with LIMITADOR and LIMITADOR_LIMITS, and <mode>_noheaders: without the IETF
#   fields in the answers) ROUNDS=3 DURATION=10s WARMUP=2s
#   KEYS=10000 CONCURRENCY=64 CONNECTIONS=4 PORT=8191 REDIS_PORT=6391 CARGO_TARGET_DIR
set -euo pipefail
cd "$(dirname "$0")/.."
MODES=${MODES:-none local redis}
ROUNDS=${ROUNDS:-3}
PORT=${PORT:-8191}
REDIS_PORT=${REDIS_PORT:-6391}
export DURATION=${DURATION:-10s} WARMUP=${WARMUP:-2s} KEYS=${KEYS:-10000}
export CONCURRENCY=${CONCURRENCY:-64} CONNECTIONS=${CONNECTIONS:-4}
TARGET=${CARGO_TARGET_DIR:-target}

command -v redis-server >/dev/null || { sudo apt-get install -y redis-server || apt-get install -y redis-server; }
# shellcheck source=lib/rls-modes.sh
. scripts/lib/rls-modes.sh
rls_build
dir=$(mktemp -d)
trap 'kill $(jobs -p) 2>/dev/null || true; rm -rf "$dir"' EXIT
# A limit never reached.
cat >"$dir/rules.yaml" <<'YAML'
domain: edge
descriptors:
  - key: remote_address
    quota: "1000000/s"
YAML
taskset -c 0 redis-server --port "$REDIS_PORT" --save "" --appendonly no --dir "$dir" >/dev/null &
sleep 0.5

run() { # mode -> calls/s
  RLS_RULES="$dir/rules.yaml" REDIS_URL="redis://127.0.0.1:$REDIS_PORT" rls_start "$1" "$PORT" taskset -c 0
  local server=$RLS_PID
  for _ in $(seq 1 50); do
    (exec 3<>"/dev/tcp/127.0.0.1/$PORT") 2>/dev/null && break
    sleep 0.1
  done
  ADDR="http://127.0.0.1:$PORT" taskset -c 1 "$TARGET/release/examples/rls_load" | tee -a "$dir/log" | awk '{print $2}'
  kill "$server"; wait "$server" 2>/dev/null || true
}

declare -A results
for round in $(seq 1 "$ROUNDS"); do
  for mode in $MODES; do
    results[$mode]+="$(run "$mode") "
  done
done
median() { tr ' ' '\n' | grep . | sort -n | awk '{a[NR]=$1} END {print a[int((NR+1)/2)]}'; }
floor=$(echo "${results[none]:-}" | median)
echo "machine: $(nproc) cores, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs); keys $KEYS, $CONCURRENCY in flight over $CONNECTIONS connections, rounds $ROUNDS × $DURATION"
printf '%-20s %12s %10s   %s\n' mode calls/s vs_bare rounds
for mode in $MODES; do
  m=$(echo "${results[$mode]}" | median)
  ratio=$([ -n "$floor" ] && awk -v a="$m" -v b="$floor" 'BEGIN {printf "%.2f", a / b}' || echo -)
  printf '%-20s %12s %10s   %s\n' "$mode" "$m" "$ratio" "${results[$mode]}"
done
grep -v "errors 0" "$dir/log" && echo "(some calls failed, above)" || true
