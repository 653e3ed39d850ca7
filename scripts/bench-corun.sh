#!/usr/bin/env bash
# Throughput ratios to bare axum measured side by side: the bare server and the server under
# test run at the same time, both pinned to core 0, each loaded by its own wrk on core 1. The
# kernel shares core 0 fairly between the two busy servers, so the ratio of their req/s is the
# ratio of their CPU cost per request, and whatever slows the machine down during a run slows
# both alike. On a shared VM whose speed drifts by ±10 % from one run to the next (which makes
# the sequential rounds of scripts/bench-http.sh noisy), this resolves a few percent.
#
# Usage: scripts/bench-corun.sh
# Environment (all optional):
#   MODES="local tower_governor local_outer tower_governor_outer"
#   PAIRS=6          runs per mode, alternating which port and wrk gets the bare server
#   DURATION=8s      per run
#   CONNECTIONS=32   per wrk
#   KEYS=one         the clients, as scripts/wrk-keys.lua draws them (`one`, `uniform:10000`,
#                    `uniform:1000000`, `zipf:100000`), the same for both servers
#   BASE=none        the mode every mode is compared with (e.g. tower_governor_outer, to
#                    compare tollgate with its peer directly rather than each with bare axum)
#   BASE_BIN=...     the bench_server binary that runs BASE (default: the one built here): an
#                    older build, to measure a change side by side, e.g.
#                    BASE=local_outer BASE_BIN=old/bench_server MODES=local_outer
#   `local_sliding`, `local_fixed`: the local backend on a never-reached one-second sliding or
#                    fixed window (QUOTA) instead of GCRA.
#   `redis_approx`:  the approximate Redis mode (asynchronous, on the same sliding window as
#                    `local_sliding`), with a redis-server this script starts on core 0 (or
#                    REDIS_URL). Its keys far from their limits cost Redis almost nothing
#                    (about 0.0002 commands per request), so redis-server barely competes for
#                    the core and the ratio is the mode's own cost per request, e.g.
#                    BASE=local_sliding MODES=redis_approx KEYS=uniform:1000000
#
# Control: the base against itself must give 1.000. The exact Redis and SQL modes are left out:
# their store would be a third busy process on core 0 (use scripts/bench-http.sh's cpu_us for
# them).
set -euo pipefail
cd "$(dirname "$0")/.."

MODES=${MODES:-"local tower_governor local_outer tower_governor_outer"}
PAIRS=${PAIRS:-6}
DURATION=${DURATION:-8s}
CONNECTIONS=${CONNECTIONS:-32}
export KEYS=${KEYS:-one}
BASE=${BASE:-none}
BASE_BIN=${BASE_BIN:-}
TARGET=${CARGO_TARGET_DIR:-target}
PORT_A=3921
PORT_B=3922

if [ "$(nproc)" -lt 2 ]; then
    echo "needs 2 cores: the servers on one, the load generators on the other" >&2
    exit 1
fi
command -v wrk >/dev/null || {
    SUDO=""
    [ "$(id -u)" -ne 0 ] && SUDO=sudo
    $SUDO apt-get install -y -qq wrk >/dev/null
}
features="local axum"
case " $BASE $MODES " in
*" redis"*)
    features="local axum redis"
    if [ -z "${REDIS_URL:-}" ]; then
        REDIS_PORT=4923
        # shellcheck source=lib/bench-redis.sh
        . scripts/lib/bench-redis.sh
        bench_redis_start "$REDIS_PORT" taskset -c 0
        echo "redis-server on port $REDIS_PORT (core 0)" >&2
    fi
    export REDIS_URL
    ;;
esac
echo "building bench_server (release, features: $features)..." >&2
cargo build --release --quiet --example bench_server --features "$features"
BIN="$TARGET/release/examples/bench_server"
BASE_BIN=${BASE_BIN:-$BIN}

PIDS=()
OUT=$(mktemp -d)
trap 'kill "${PIDS[@]}" ${REDIS_PID:-} 2>/dev/null || true; rm -rf "$OUT" ${REDIS_DIR:-}' EXIT

start() { # mode port binary
    local backend=$1 layer=route quota=()
    if [ "${backend%_outer}" != "$backend" ]; then
        backend=${backend%_outer}
        layer=outer
    fi
    case "$backend" in
    *_fixed)
        backend=${backend%_fixed}
        quota=("QUOTA=1000000000/s fixed")
        ;;
    *_sliding)
        backend=${backend%_sliding}
        quota=("QUOTA=1000000000/s sliding")
        ;;
    esac
    env "${quota[@]}" BACKEND=$backend LAYER=$layer PORT=$2 taskset -c 0 "$3" >/dev/null 2>&1 &
    PIDS+=($!)
    for _ in $(seq 1 100); do
        (exec 3<>"/dev/tcp/127.0.0.1/$2") 2>/dev/null && return 0
        sleep 0.05
    done
    echo "server $1 did not start" >&2
    exit 1
}

# One side-by-side run; prints req/s of the server on port A, then on port B.
corun() { # mode_a binary_a mode_b binary_b
    PIDS=()
    start "$1" "$PORT_A" "$2"
    start "$3" "$PORT_B" "$4"
    taskset -c 1 wrk -t1 -c"$CONNECTIONS" -d"$DURATION" -s scripts/wrk-keys.lua "http://127.0.0.1:$PORT_A/hello" >"$OUT/a" &
    local wa=$!
    taskset -c 1 wrk -t1 -c"$CONNECTIONS" -d"$DURATION" -s scripts/wrk-keys.lua "http://127.0.0.1:$PORT_B/hello" >"$OUT/b" &
    local wb=$!
    wait "$wa" "$wb"
    kill "${PIDS[@]}"
    wait "${PIDS[@]}" 2>/dev/null || true
    echo "$(awk '/^Requests\/sec:/ { print $2 }' "$OUT/a") $(awk '/^Requests\/sec:/ { print $2 }' "$OUT/b")"
}

median() { sort -g | awk '{ v[NR] = $1 } END { if (NR % 2) print v[(NR + 1) / 2]; else print (v[NR / 2] + v[NR / 2 + 1]) / 2 }'; }

printf '%-22s %8s %8s %8s   %s\n' mode median min max "ratios (mode req/s / $BASE req/s, run by run)"
control=1
for mode in "$BASE" $MODES; do
    # The first row is the control: the base against itself.
    mine_bin=$BIN
    [ "$control" = 1 ] && mine_bin=$BASE_BIN
    control=0
    ratios=()
    for pair in $(seq 1 "$PAIRS"); do
        # Alternate sides so that neither port nor wrk order favours one server.
        if [ $((pair % 2)) = 1 ]; then
            read -r bare mine < <(corun "$BASE" "$BASE_BIN" "$mode" "$mine_bin")
        else
            read -r mine bare < <(corun "$mode" "$mine_bin" "$BASE" "$BASE_BIN")
        fi
        ratios+=("$(awk -v m="$mine" -v b="$bare" 'BEGIN { printf "%.3f", m / b }')")
    done
    sorted=$(printf '%s\n' "${ratios[@]}" | sort -g)
    printf '%-22s %8.3f %8.3f %8.3f   %s\n' "$mode" \
        "$(printf '%s\n' "${ratios[@]}" | median)" "$(echo "$sorted" | head -1)" \
        "$(echo "$sorted" | tail -1)" "${ratios[*]}"
done
