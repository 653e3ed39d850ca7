#!/usr/bin/env bash
# Redis's share of Redis mode under HTTP load: bench_server (BACKEND=redis) and its own
# redis-server pinned to core 0, wrk on core 1 drawing clients from KEYS; prints req/s, the CPU
# time per request of redis-server and of bench_server (from /proc), Redis's own EVALSHA time
# per decision (INFO commandstats) and the decisions per script call. Compare builds with
# BINS="old-binary new-binary" (alternate them: BINS="a b b a"); ratios within one run only.
#
# Usage: scripts/bench-redis-cpu.sh
# Environment (all optional):
#   BINS=target/release/examples/bench_server   bench_server binaries, run in turn
#   KEYS=uniform:10000   DURATION=10s   CONNECTIONS=64   PORT=3998
set -euo pipefail
cd "$(dirname "$0")/.."
TARGET=${CARGO_TARGET_DIR:-target}
BINS=${BINS:-$TARGET/release/examples/bench_server}
export KEYS=${KEYS:-uniform:10000}
DURATION=${DURATION:-10s}
CONNECTIONS=${CONNECTIONS:-64}
PORT=${PORT:-3998}
REDIS_PORT=$((PORT + 1000))
HZ=$(getconf CLK_TCK)
ticks() { awk '{print $14 + $15}' "/proc/$1/stat"; }
field() { tr ':,' '\n\n' | awk -F= -v f="$1" '$1 == f {print $2}'; }

printf '%-44s %9s %14s %15s %15s %10s\n' binary req/s redis_cpu_us server_cpu_us evalsha_us/dec dec/call
for bin in $BINS; do
    dir=$(mktemp -d)
    taskset -c 0 redis-server --port "$REDIS_PORT" --bind 127.0.0.1 --save "" --appendonly no \
        --dir "$dir" --daemonize no >/dev/null &
    rpid=$!
    for _ in $(seq 1 50); do
        redis-cli -p "$REDIS_PORT" ping >/dev/null 2>&1 && break
        sleep 0.1
    done
    BACKEND=redis LAYER=route PORT=$PORT REDIS_URL="redis://127.0.0.1:$REDIS_PORT" \
        taskset -c 0 "$bin" >/dev/null 2>&1 &
    spid=$!
    for _ in $(seq 1 100); do
        (exec 3<>"/dev/tcp/127.0.0.1/$PORT") 2>/dev/null && break
        sleep 0.1
    done
    taskset -c 1 wrk -t1 -c"$CONNECTIONS" -d2s -s scripts/wrk-keys.lua "http://127.0.0.1:$PORT/hello" >/dev/null
    redis-cli -p "$REDIS_PORT" config resetstat >/dev/null
    r0=$(ticks "$rpid")
    s0=$(ticks "$spid")
    out=$(taskset -c 1 wrk -t1 -c"$CONNECTIONS" -d"$DURATION" -s scripts/wrk-keys.lua "http://127.0.0.1:$PORT/hello")
    r1=$(ticks "$rpid")
    s1=$(ticks "$spid")
    n=$(echo "$out" | awk '/requests in/ {print $1}')
    secs=$(echo "$out" | awk '/requests in/ {sub(/s,$/, "", $4); print $4}')
    stats=$(redis-cli -p "$REDIS_PORT" info commandstats | grep '^cmdstat_evalsha:' | tr -d '\r')
    calls=$(echo "$stats" | field calls)
    usec=$(echo "$stats" | field usec)
    awk -v b="$bin" -v n="$n" -v t="$secs" -v r=$((r1 - r0)) -v s=$((s1 - s0)) -v hz="$HZ" \
        -v c="$calls" -v u="$usec" 'BEGIN { printf "%-44s %9.0f %14.2f %15.2f %15.2f %10.1f\n",
        b, n / t, r * 1e6 / hz / n, s * 1e6 / hz / n, u / n, n / c }'
    kill "$spid"
    wait "$spid" 2>/dev/null || true
    redis-cli -p "$REDIS_PORT" shutdown nosave >/dev/null 2>&1 || true
    wait "$rpid" 2>/dev/null || true
    rm -rf "$dir"
done
