#!/usr/bin/env bash
# tollgate-server at rest and loaded: the time from exec to a 200 /healthcheck, the resident
# memory (VmRSS) once ready, and with 100 000 live keys (every key asked once by
# examples/rls_load, under a rule of 100 an hour: each key's bucket stays live for the test),
# on the local backend (keys in the process) and on Redis (keys in Redis: the process keeps
# connections and the deny cache). Release build, as deployed (Prometheus on).
#
# Usage: scripts/bench-server.sh
# Environment (all optional): STARTS=5 KEYS=100000 PORT=8491 REDIS_PORT=6591 CARGO_TARGET_DIR
set -euo pipefail
cd "$(dirname "$0")/.."
STARTS=${STARTS:-5}
KEYS=${KEYS:-100000}
PORT=${PORT:-8491}
REDIS_PORT=${REDIS_PORT:-6591}
TARGET=${CARGO_TARGET_DIR:-target}
HTTP=$((PORT + 1))

# shellcheck source=lib/rls-modes.sh
. scripts/lib/rls-modes.sh
rls_build
WORK=$(mktemp -d)
# shellcheck source=lib/bench-redis.sh
. scripts/lib/bench-redis.sh
bench_redis_start "$REDIS_PORT"
trap 'kill $(jobs -p) 2>/dev/null || true; rm -rf "$WORK" "$REDIS_DIR"' EXIT
cat >"$WORK/rules.yaml" <<'YAML'
domain: edge
descriptors:
  - key: remote_address
    quota: "100/h"
YAML
export RLS_RULES="$WORK/rules.yaml" REDIS_URL TARGET

rss_kib() { awk '/^VmRSS/ { print $2 }' "/proc/$1/status"; }
now_ms() { date +%s%3N; }

# Milliseconds from exec to the first 200 /healthcheck (polled every 2 ms).
startup_ms() { # mode
    local t0 t1
    t0=$(now_ms)
    rls_start "$1" "$PORT"
    until curl -fsS -o /dev/null "http://127.0.0.1:$HTTP/healthcheck" 2>/dev/null; do
        sleep 0.002
    done
    t1=$(now_ms)
    kill "$RLS_PID"; wait "$RLS_PID" 2>/dev/null || true
    echo $((t1 - t0))
}

median() { tr ' ' '\n' | grep . | sort -n | awk '{a[NR]=$1} END {print a[int((NR+1)/2)]}'; }

echo "machine: $(nproc) cores, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs); $(git rev-parse --short HEAD)"
printf '%-14s %14s %14s %18s %16s\n' mode start_ms rest_MiB "${KEYS}_keys_MiB" per_key_bytes
for mode in server server_redis; do
    starts=""
    for _ in $(seq 1 "$STARTS"); do starts+="$(startup_ms "$mode") "; done
    rls_start "$mode" "$PORT"
    until curl -fsS -o /dev/null "http://127.0.0.1:$HTTP/healthcheck" 2>/dev/null; do sleep 0.01; done
    sleep 1
    rest=$(rss_kib "$RLS_PID")
    # Every key once (the generator cycles over KEYS addresses), then a pause for the
    # process to settle.
    calls=0
    while [ "$calls" -lt "$KEYS" ]; do
        out=$(WARMUP=0s DURATION=5s KEYS=$KEYS ADDR="http://127.0.0.1:$PORT" \
            "$TARGET/release/examples/rls_load")
        calls=$((calls + $(echo "$out" | awk '{ print $4 + $6 + $8 }')))
    done
    sleep 1
    loaded=$(rss_kib "$RLS_PID")
    kill "$RLS_PID"; wait "$RLS_PID" 2>/dev/null || true
    printf '%-14s %14s %14.1f %18.1f %16d\n' "$mode" "$(echo "$starts" | median)" \
        "$(awk -v k="$rest" 'BEGIN { print k / 1024 }')" \
        "$(awk -v k="$loaded" 'BEGIN { print k / 1024 }')" \
        $(((loaded - rest) * 1024 / KEYS))
done
