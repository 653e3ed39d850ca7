#!/usr/bin/env bash
# Restart soak: load through bench_server on Redis while Redis is restarted every few seconds.
#
# Usage: scripts/redis-restart-soak.sh
# Environment (all optional):
#   DURATION=60       seconds of load per failure policy
#   EVERY=5           seconds between Redis restarts (Redis is down ~0.5 s each time)
#   POLICIES="open closed"   the failure policies to soak (bench_server's ON_FAILURE)
#   PORT=3911         bench_server's port (Redis on PORT + 1000)
#
# For each policy: wrk (1 thread, 32 connections, 10 000 uniform keys) for DURATION seconds
# against bench_server (BACKEND=redis, STATS=1), while Redis is killed and started again every
# EVERY seconds (no persistence: buckets start full after each restart). Prints the requests,
# the non-2xx answers (503 in fail-closed), and, from the backend's counters, the decisions
# Redis made after each restart: shared limiting resumes when they grow again.
set -euo pipefail
cd "$(dirname "$0")/.."

DURATION=${DURATION:-60}
EVERY=${EVERY:-5}
POLICIES=${POLICIES:-"open closed"}
PORT=${PORT:-3911}
REDIS_PORT=$((PORT + 1000))
TARGET=${CARGO_TARGET_DIR:-target}
command -v wrk >/dev/null || { echo "needs wrk (apt-get install wrk)" >&2; exit 1; }
command -v redis-server >/dev/null || { echo "needs redis-server" >&2; exit 1; }

cargo build --release --quiet --example bench_server --features "local axum redis"
BIN="$TARGET/release/examples/bench_server"
DIR=$(mktemp -d)
REDIS_PID=""
SERVER_PID=""
cleanup() {
    [ -n "$SERVER_PID" ] && kill "$SERVER_PID" 2>/dev/null || true
    [ -n "$REDIS_PID" ] && kill "$REDIS_PID" 2>/dev/null || true
    rm -rf "$DIR"
}
trap cleanup EXIT

start_redis() {
    redis-server --port "$REDIS_PORT" --bind 127.0.0.1 --save "" --appendonly no \
        --dir "$DIR" >/dev/null &
    REDIS_PID=$!
    for _ in $(seq 1 100); do
        redis-cli -p "$REDIS_PORT" ping >/dev/null 2>&1 && return
        sleep 0.02
    done
}

for policy in $POLICIES; do
    start_redis
    ON_FAILURE=$policy STATS=1 BACKEND=redis REDIS_URL="redis://127.0.0.1:$REDIS_PORT" \
        PORT=$PORT "$BIN" >/dev/null 2>"$DIR/stats.$policy" &
    SERVER_PID=$!
    for _ in $(seq 1 100); do
        curl -fs "http://127.0.0.1:$PORT/hello" >/dev/null 2>&1 && break
        sleep 0.05
    done
    KEYS=uniform:10000 wrk -t1 -c32 -d"${DURATION}s" -s scripts/wrk-keys.lua \
        "http://127.0.0.1:$PORT/hello" >"$DIR/wrk.$policy" &
    WRK_PID=$!
    restarts=0
    end=$((SECONDS + DURATION))
    while [ $((SECONDS + EVERY)) -lt "$end" ]; do
        sleep "$EVERY"
        kill -9 "$REDIS_PID" 2>/dev/null || true
        wait "$REDIS_PID" 2>/dev/null || true
        sleep 0.5
        start_redis
        restarts=$((restarts + 1))
    done
    wait "$WRK_PID"
    kill "$SERVER_PID"
    wait "$SERVER_PID" 2>/dev/null || true
    SERVER_PID=""
    kill "$REDIS_PID" 2>/dev/null || true
    wait "$REDIS_PID" 2>/dev/null || true
    REDIS_PID=""
    requests=$(awk '/requests in/ {print $1}' "$DIR/wrk.$policy")
    non2xx=$(awk '/Non-2xx/ {print $NF}' "$DIR/wrk.$policy")
    errors=$(awk '/Socket errors/ {print}' "$DIR/wrk.$policy")
    echo "ON_FAILURE=$policy: ${DURATION}s, $restarts restarts of Redis, $requests requests, ${non2xx:-0} non-2xx ${errors:+($errors)}"
    # The backend's counters each second: decisions Redis made (redis_calls) and the failure
    # policy's answers; a second in which redis_calls grew after a restart is limiting again.
    awk -F'[:,]' '
        /redis_calls/ {
            for (i = 1; i <= NF; i++) {
                if ($i ~ /redis_calls/) calls = $(i + 1) + 0
                if ($i ~ /fail_open/) open = $(i + 1) + 0
                if ($i ~ /fail_closed/) closed = $(i + 1) + 0
                if ($i ~ /breaker_trips/) trips = $(i + 1) + 0
            }
            if (n > 0 && calls > last) resumed++
            last = calls
            n++
        }
        END {
            printf "  %d seconds with decisions by Redis out of %d; fail-open answers %d, fail-closed %d, breaker trips %d\n", resumed, n - 1, open, closed, trips
        }' "$DIR/stats.$policy"
done
