#!/usr/bin/env bash
# CPU instructions per request of the HTTP benchmark server, counted by valgrind's callgrind:
# repeatable to a fraction of a percent whatever else the machine is doing, where the req/s of
# scripts/bench-http.sh can move by ±10 % between rounds on a shared VM. It counts the
# server's own (user-space) instructions only: not the kernel's share (about two thirds of a
# request's time on the machine of BENCHMARKS.md, the same in every mode), nor redis-server's
# in Redis modes (measured separately below).
#
# Usage: scripts/bench-instructions.sh
# Environment (all optional):
#   MODES="none local tower_governor tower_governor_headers local_outer tower_governor_outer
#          tower_governor_headers_outer redis redis_outer"
#                    (`adaptive`: the adaptive concurrency layer alone, `local_adaptive`: inside
#                    the local rate limit; `local_metrics`, `redis_metrics`: with a Prometheus recorder installed;
#                    MODES= measures only redis-server's instructions per decision)
#   DURATION=8s      wrk load per mode (the server runs ~50x slower under callgrind)
#   PORT=3911
#   KEYS=one         the key distribution of scripts/wrk-keys.lua (e.g. uniform:10000)
#   HEADERS=ietf     tollgate's header style (bench_server's HEADERS; none, legacy, both)
#   BIN=...          a bench_server binary built elsewhere (not rebuilt), e.g. an older build
#   WARMUP=8s        with KEYS other than one: load first for this long, then zero the counts
#                    (callgrind_control -z), so that the count holds no key's first request (a
#                    new key's insertion and the tables' growth). Without it, modes serving
#                    fewer requests per run count more first requests each, and runs differ by
#                    a few hundred instructions.
#
# For each mode: (instructions with load - instructions of a start and stop with no load)
# / requests served. Under callgrind the server is slow and Redis (not instrumented) is not,
# so Redis calls carry fewer decisions each than at full speed: per-request numbers of the
# Redis modes are upper bounds. Then redis-server's instructions per decision, for script calls
# of 1 and of 16 decisions on one hot key and on 16 different keys
# (scripts/bench-redis-instructions.sh).
set -euo pipefail
cd "$(dirname "$0")/.."

MODES=${MODES-"none local tower_governor tower_governor_headers local_outer tower_governor_outer tower_governor_headers_outer redis redis_outer"}
DURATION=${DURATION:-8s}
PORT=${PORT:-3911}
TARGET=${CARGO_TARGET_DIR:-target}

# shellcheck source=lib/callgrind.sh
. scripts/lib/callgrind.sh
need valgrind valgrind
need wrk wrk
need redis-server redis-server

KEYS=${KEYS:-one}
WARMUP=${WARMUP:-$([ "$KEYS" = one ] && echo 0 || echo 8s)}
if [ -n "$MODES" ] && [ -z "${BIN:-}" ]; then
    echo "building bench_server (release)..." >&2
    cargo build --release --quiet --example bench_server --features "local axum redis metrics"
fi
BIN=${BIN:-"$TARGET/release/examples/bench_server"}

WORK=$(mktemp -d)
REDIS_PORT=$((PORT + 1000))
redis-server --port "$REDIS_PORT" --bind 127.0.0.1 --save "" --appendonly no --dir "$WORK" \
    --daemonize no >/dev/null &
REDIS_PID=$!
# Waits for Redis to exit: a run started right after this one binds the same port.
trap 'kill "$REDIS_PID" 2>/dev/null || true; wait "$REDIS_PID" 2>/dev/null || true; rm -rf "$WORK"' EXIT
for _ in $(seq 1 50); do
    redis-cli -p "$REDIS_PORT" ping >/dev/null 2>&1 && break
    sleep 0.1
done
# A Redis of an earlier run still on the port would answer the ping, then exit: this one must
# be the one listening.
if ! kill -0 "$REDIS_PID" 2>/dev/null; then
    echo "redis-server could not start on port $REDIS_PORT (in use?); set PORT" >&2
    exit 1
fi


# Instructions of one server run, with `wrk` for $DURATION when $2 is 1; prints "Ir requests".
run() { # mode load
    local mode=$1 load=$2 backend=$1 layer=route requests=0 metrics=""
    # `*_metrics`: the same with a Prometheus recorder installed (feature `metrics`).
    if [ "${backend%_metrics}" != "$backend" ]; then
        backend=${backend%_metrics}
        metrics=1
    fi
    if [ "${backend%_outer}" != "$backend" ]; then
        backend=${backend%_outer}
        layer=outer
    fi
    # One worker thread: the server's work is counted the same way whatever the machine.
    TOKIO_WORKER_THREADS=1 METRICS=$metrics BACKEND=$backend LAYER=$layer PORT=$PORT REDIS_URL="redis://127.0.0.1:$REDIS_PORT" \
        valgrind --tool=callgrind --callgrind-out-file="$WORK/cg.out" "$BIN" >/dev/null 2>&1 &
    local pid=$!
    for _ in $(seq 1 300); do
        (exec 3<>"/dev/tcp/127.0.0.1/$PORT") 2>/dev/null && break
        sleep 0.1
    done
    if [ "$WARMUP" != 0 ]; then
        KEYS=$KEYS wrk -t1 -c8 -d"$WARMUP" -s scripts/wrk-keys.lua "http://127.0.0.1:$PORT/hello" \
            >/dev/null
        callgrind_control -z "$pid" >/dev/null 2>&1
    fi
    if [ "$load" = 1 ]; then
        requests=$(KEYS=$KEYS wrk -t1 -c8 -d"$DURATION" -s scripts/wrk-keys.lua \
            "http://127.0.0.1:$PORT/hello" |
            awk '/requests in/ { print $1 }')
    elif [ "$WARMUP" != 0 ]; then
        sleep "${DURATION%s}"
    fi
    # SIGTERM: background jobs of a non-interactive shell ignore SIGINT.
    kill "$pid"
    wait "$pid" 2>/dev/null || true
    echo "$(callgrind_total "$WORK/cg.out") $requests"
}

echo "keys: $KEYS, tollgate headers: ${HEADERS:-ietf}" >&2
printf '%-22s %14s %12s\n' mode instr/request vs_bare
bare=""
for mode in $MODES; do
    read -r idle _ < <(run "$mode" 0)
    read -r loaded requests < <(run "$mode" 1)
    per=$(((loaded - idle) / requests))
    [ -z "$bare" ] && [ "$mode" = none ] && bare=$per
    extra="-"
    [ -n "$bare" ] && extra=$(awk -v p="$per" -v b="$bare" 'BEGIN { printf "%+d", p - b }')
    printf '%-22s %14d %12s\n' "$mode" "$per" "$extra"
done

# redis-server's own instructions per decision of the script, under callgrind, fed by
# redis-benchmark (GCRA; scripts/bench-redis-instructions.sh measures windows too).
echo
ALGOS=gcra scripts/bench-redis-instructions.sh
