#!/usr/bin/env bash
# CPU instructions per call of Envoy's rate limit service (examples/rls), counted by valgrind's
# callgrind: repeatable where the calls/s of scripts/bench-rls.sh move by several percent
# between rounds on a shared VM. It counts the server's own (user-space) instructions, one
# worker thread, under the load of examples/rls_load (the same calls as bench-rls.sh: one
# `remote_address` descriptor, 10 000 addresses, a limit never reached); not the kernel's, nor
# redis-server's in Redis modes.
#
# Usage: scripts/bench-rls-instructions.sh
# Environment (all optional):
#   MODES="none local local_noheaders"  (the modes of scripts/lib/rls-modes.sh: also redis,
#                    server, server_noprom, server_redis, limitador...; `none` is the bare
#                    tonic RLS answering OK without deciding, the floor)
#   DURATION=20s     load per mode (the server runs ~50x slower under callgrind)
#   PORT=8291 REDIS_PORT=6491 KEYS=10000 CONCURRENCY=16 CONNECTIONS=4 CARGO_TARGET_DIR
#   KEEP=dir         keep each mode's callgrind output there (for callgrind_annotate)
#
# For each mode: (instructions with load - instructions of a start and stop with no load)
# / calls answered.
set -euo pipefail
cd "$(dirname "$0")/.."
MODES=${MODES:-none local local_noheaders}
DURATION=${DURATION:-20s}
PORT=${PORT:-8291}
REDIS_PORT=${REDIS_PORT:-6491}
export KEYS=${KEYS:-10000} CONCURRENCY=${CONCURRENCY:-16} CONNECTIONS=${CONNECTIONS:-4}
TARGET=${CARGO_TARGET_DIR:-target}

# shellcheck source=lib/callgrind.sh
. scripts/lib/callgrind.sh
need valgrind valgrind
# shellcheck source=lib/rls-modes.sh
. scripts/lib/rls-modes.sh
rls_build

WORK=$(mktemp -d)
# shellcheck source=lib/bench-redis.sh
. scripts/lib/bench-redis.sh
bench_redis_start "$REDIS_PORT"
trap 'kill "$REDIS_PID" 2>/dev/null || true; wait "$REDIS_PID" 2>/dev/null || true; rm -rf "$WORK" "$REDIS_DIR"' EXIT
cat >"$WORK/rules.yaml" <<'YAML'
domain: edge
descriptors:
  - key: remote_address
    quota: "1000000/s"
YAML


# Instructions of one server run, loaded for $DURATION when $2 is 1; prints "Ir calls".
run() { # mode load
    local mode=$1 load=$2 calls=0
    TOKIO_WORKER_THREADS=1 RLS_RULES="$WORK/rules.yaml" rls_start "$mode" "$PORT" \
        valgrind --tool=callgrind --callgrind-out-file="$WORK/cg.out"
    local pid=$RLS_PID
    for _ in $(seq 1 300); do
        (exec 3<>"/dev/tcp/127.0.0.1/$PORT") 2>/dev/null && break
        sleep 0.1
    done
    if [ "$load" = 1 ]; then
        calls=$(WARMUP=0s DURATION=$DURATION ADDR="http://127.0.0.1:$PORT" \
            "$TARGET/release/examples/rls_load" | awk '{ print $4 + $6 + $8 }')
    fi
    kill "$pid"
    wait "$pid" 2>/dev/null || true
    if [ "$load" = 1 ] && [ -n "${KEEP:-}" ]; then
        mkdir -p "$KEEP"
        cp "$WORK/cg.out" "$KEEP/$mode.out"
    fi
    echo "$(callgrind_total "$WORK/cg.out") $calls"
}

printf '%-18s %14s %12s\n' mode instr/call vs_bare
bare=""
for mode in $MODES; do
    read -r idle _ < <(run "$mode" 0)
    read -r loaded calls < <(run "$mode" 1)
    per=$(((loaded - idle) / calls))
    [ -z "$bare" ] && [ "$mode" = none ] && bare=$per
    extra="-"
    [ -n "$bare" ] && extra=$(awk -v p="$per" -v b="$bare" 'BEGIN { printf "%+d (%.2fx)", p - b, b / p }')
    printf '%-18s %14d %12s\n' "$mode" "$per" "$extra"
done
