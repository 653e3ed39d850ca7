#!/usr/bin/env bash
# HTTP load benchmark: bare axum vs tollgate (local) vs tower_governor (vs tollgate-redis when
# available), with wrk, in interleaved rounds, server pinned to core 0 and wrk to core 1.
#
# Usage: scripts/bench-http.sh
# Environment (all optional):
#   ROUNDS=5          rounds; each runs every mode once, in a rotated order
#   DURATION=10s      wrk duration per run (after a 2 s warm-up)
#   CONNECTIONS=64    wrk connections (one wrk thread)
#   MODES="none local tower_governor redis local_outer tower_governor_outer redis_outer local_deny redis_deny"
#                     `local_fixed`, `local_sliding`, `redis_fixed`, `redis_sliding`: the same
#                     never-reached limit as a fixed or a sliding window (QUOTA) instead of GCRA.
#                     `redis_approx`, `redis_approx_sync`: the approximate Redis mode, asynchronous
#                     and synchronous (BACKEND=redis_approx, APPROX), on a never-reached
#                     one-second sliding window: compare with `local_sliding`.
#                     `*_outer` modes wrap the whole router (LAYER=outer) instead of
#                     `Router::layer`; `*_deny` modes flood one key that is always denied (DENY_KEY); the
#                     redis modes use REDIS_URL, or a redis-server this script starts on a free
#                     port, pinned to the server's core. `postgres`, `mysql` (and their
#                     `_deny`, `_fixed`, ... variants): the SQL backends, on DATABASE_URL /
#                     MYSQL_URL, or on a PostgreSQL / MariaDB this script starts in a temporary
#                     directory (as `nobody` when run as root), pinned to the server's core. A
#                     mode whose server does not start is skipped.
#   KEYS=one          the clients, as scripts/wrk-keys.lua draws them: `one` (no x-key: one
#                     client), `uniform:10000`, `uniform:1000000`, `zipf:100000` (a few heavy
#                     clients and a long tail). The `*_deny` modes always flood one key.
#   PORT=3901         server port
#   CARGO_TARGET_DIR  where cargo builds (default: target)
#   CSV=target/bench-http.csv   where the raw results go (round,mode,rps,p50_us,p99_us,cpu_us),
#                     for scripts/plot-bench.py
#
# redis_cmds is the commands Redis executed per request during the timed run (Redis modes,
# from INFO's total_commands_processed, which counts a script's call and each command the
# script runs).
# cpu_us is the CPU time the server (and, in Redis modes, redis-server) used per request during
# the measured run, from /proc: less disturbed by a noisy machine than req/s.
#
# Prints req/s, p50 and p99 latency and the ratio of req/s to bare axum for each run, then
# the medians over the rounds. Ratios are only meaningful within one run of this script.
set -euo pipefail
cd "$(dirname "$0")/.."

ROUNDS=${ROUNDS:-5}
DURATION=${DURATION:-10s}
CONNECTIONS=${CONNECTIONS:-64}
MODES=${MODES:-"none local tower_governor redis local_outer tower_governor_outer redis_outer local_deny redis_deny"}
PORT=${PORT:-3901}
export KEYS=${KEYS:-one}
TARGET=${CARGO_TARGET_DIR:-target}
CSV=${CSV:-$TARGET/bench-http.csv}

if ! command -v wrk >/dev/null; then
    echo "installing wrk..." >&2
    SUDO=""
    [ "$(id -u)" -ne 0 ] && SUDO=sudo
    $SUDO apt-get update -qq && $SUDO apt-get install -y -qq wrk >/dev/null
fi
if [ "$(nproc)" -lt 2 ]; then
    echo "warning: fewer than 2 cores; server and wrk will share a core" >&2
    PIN_SERVER=""
    PIN_WRK=""
else
    PIN_SERVER="taskset -c 0"
    PIN_WRK="taskset -c 1"
fi

features="local axum"
case " $MODES " in *" redis"*) features="$features redis" ;; esac
case " $MODES " in *" postgres"*) features="$features postgres" ;; esac
case " $MODES " in *" mysql"*) features="$features mysql" ;; esac
echo "building bench_server (release, features: $features)..." >&2
cargo build --release --quiet --example bench_server --features "$features"
BIN="$TARGET/release/examples/bench_server"

RESULTS=$(mktemp)
SERVER_PID=""
REDIS_PID=""
REDIS_DIR=""
cleanup() {
    if [ -n "$REDIS_PID" ]; then kill "$REDIS_PID" 2>/dev/null || true; fi
    if [ -n "$REDIS_DIR" ]; then rm -rf "$REDIS_DIR"; fi
    if [ -n "${PG_PID:-}" ]; then kill -QUIT "$PG_PID" 2>/dev/null || true; sleep 0.5; fi
    if [ -n "${PG_DIR:-}" ]; then rm -rf "$PG_DIR"; fi
    if [ -n "${MY_PID:-}" ]; then kill -KILL "$MY_PID" 2>/dev/null || true; sleep 0.2; fi
    if [ -n "${MY_DIR:-}" ]; then rm -rf "$MY_DIR"; fi
    if [ -n "$SERVER_PID" ]; then kill "$SERVER_PID" 2>/dev/null || true; fi
    if [ -s "$RESULTS" ]; then
        { echo "round,mode,rps,p50_us,p99_us,cpu_us,redis_cmds"; tr ' ' ',' <"$RESULTS"; } >"$CSV"
        echo "raw results: $CSV" >&2
    fi
    rm -f "$RESULTS"
}
trap cleanup EXIT

# Latency from wrk ("245.00us", "1.20ms", "2.00s") in microseconds.
to_us() {
    awk -v v="$1" 'BEGIN {
        n = v + 0
        if (v ~ /us$/) print n; else if (v ~ /ms$/) print n * 1000;
        else if (v ~ /s$/) print n * 1000000; else print n }'
}

wait_up() {
    for _ in $(seq 1 100); do
        if (exec 3<>"/dev/tcp/127.0.0.1/$PORT") 2>/dev/null; then return 0; fi
        if ! kill -0 "$SERVER_PID" 2>/dev/null; then return 1; fi
        sleep 0.05
    done
    return 1
}

case " $MODES " in
*" redis"*)
    if [ -z "${REDIS_URL:-}" ]; then
        REDIS_PORT=$((PORT + 1000))
        # shellcheck source=lib/bench-redis.sh
        . scripts/lib/bench-redis.sh
        bench_redis_start "$REDIS_PORT" $PIN_SERVER
        echo "redis-server on port $REDIS_PORT (core 0)" >&2
    fi
    export REDIS_URL
    ;;
esac

# As the servers' user: PostgreSQL refuses to run as root.
as_db_user() {
    if [ "$(id -u)" -eq 0 ]; then runuser -u nobody -- "$@"; else "$@"; fi
}
PG_PID=""
MY_PID=""
case " $MODES " in
*" postgres"*)
    if [ -z "${DATABASE_URL:-}" ]; then
        PG_BIN=$(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V | tail -1)
        [ -x "$PG_BIN/initdb" ] || {
            SUDO=""
            [ "$(id -u)" -ne 0 ] && SUDO=sudo
            $SUDO apt-get install -y -qq postgresql >/dev/null
            PG_BIN=$(ls -d /usr/lib/postgresql/*/bin | sort -V | tail -1)
        }
        PG_PORT=$((PORT + 1001))
        PG_DIR=$(mktemp -d)
        [ "$(id -u)" -eq 0 ] && chown nobody "$PG_DIR"
        as_db_user "$PG_BIN/initdb" -U postgres -A trust --no-sync -D "$PG_DIR/data" >/dev/null
        as_db_user $PIN_SERVER "$PG_BIN/postgres" -D "$PG_DIR/data" -p "$PG_PORT" -k "$PG_DIR" \
            -c listen_addresses=127.0.0.1 -c max_connections=300 >/dev/null 2>&1 &
        for _ in $(seq 1 100); do
            "$PG_BIN/pg_isready" -q -h 127.0.0.1 -p "$PG_PORT" && break
            sleep 0.1
        done
        PG_PID=$(head -1 "$PG_DIR/data/postmaster.pid")
        DATABASE_URL="postgres://postgres@127.0.0.1:$PG_PORT/postgres"
        echo "PostgreSQL on port $PG_PORT (core 0)" >&2
    fi
    export DATABASE_URL
    ;;
esac
case " $MODES " in
*" mysql"*)
    if [ -z "${MYSQL_URL:-}" ]; then
        command -v mariadbd >/dev/null || [ -x /usr/sbin/mariadbd ] || {
            SUDO=""
            [ "$(id -u)" -ne 0 ] && SUDO=sudo
            $SUDO apt-get install -y -qq mariadb-server >/dev/null
        }
        MY_PORT=$((PORT + 1002))
        MY_DIR=$(mktemp -d)
        [ "$(id -u)" -eq 0 ] && chown nobody "$MY_DIR"
        as_db_user mariadb-install-db --no-defaults --datadir="$MY_DIR/data" \
            --auth-root-authentication-method=normal --skip-test-db >/dev/null 2>&1
        as_db_user $PIN_SERVER /usr/sbin/mariadbd --no-defaults --datadir="$MY_DIR/data" \
            --port="$MY_PORT" --bind-address=127.0.0.1 --socket="$MY_DIR/sock" \
            --skip-log-bin --max-connections=300 >/dev/null 2>&1 &
        for _ in $(seq 1 100); do
            mariadb -h127.0.0.1 -P"$MY_PORT" -uroot -e 'CREATE DATABASE IF NOT EXISTS test' 2>/dev/null && break
            sleep 0.1
        done
        MY_PID=$(pgrep -f "mariadbd --no-defaults --datadir=$MY_DIR/data" | head -1)
        MYSQL_URL="mysql://root@127.0.0.1:$MY_PORT/test"
        echo "MariaDB on port $MY_PORT (core 0)" >&2
    fi
    ;;
esac

CLK_TCK=$(getconf CLK_TCK)
# CPU ticks (user + system) of a process.
ticks_of() { awk '{print $14 + $15}' "/proc/$1/stat" 2>/dev/null || echo 0; }
# CPU ticks (user + system) used so far by the server, plus the store in remote modes
# (redis-server; PostgreSQL's postmaster and its backends; mariadbd).
cpu_ticks() { # backend
    local t
    t=$(ticks_of "$SERVER_PID")
    if [ "${1%_approx}" = redis ] && [ -n "$REDIS_PID" ]; then
        t=$((t + $(ticks_of "$REDIS_PID")))
    fi
    if [ "$1" = postgres ] && [ -n "$PG_PID" ]; then
        for p in "$PG_PID" $(pgrep -P "$PG_PID"); do
            t=$((t + $(ticks_of "$p")))
        done
    fi
    if [ "$1" = mysql ] && [ -n "$MY_PID" ]; then
        t=$((t + $(ticks_of "$MY_PID")))
    fi
    echo "$t"
}

# Commands Redis has processed, when the modes use a Redis this script can ask.
redis_commands() {
    if [ -n "${REDIS_URL:-}" ] && command -v redis-cli >/dev/null; then
        redis-cli -u "$REDIS_URL" INFO stats 2>/dev/null | awk -F: '/^total_commands_processed/ {print $2 + 0}'
    fi
}

run_mode() { # round mode
    local round=$1 mode=$2
    local backend=${mode%_deny} deny_env=() wrk_header=() layer=route quota_env=() approx_env=()
    # `redis_approx_sync`: the approximate mode's synchronous variant.
    if [ "${backend%_approx_sync}" != "$backend" ]; then
        backend=${backend%_sync}
        approx_env=(APPROX=sync)
    fi
    # `*_fixed` / `*_sliding`: the same never-reached limit as a fixed or sliding window.
    case "$backend" in
    *_fixed)
        backend=${backend%_fixed}
        quota_env=("QUOTA=1000000000/s fixed")
        ;;
    *_sliding)
        backend=${backend%_sliding}
        quota_env=("QUOTA=1000000000/s sliding")
        ;;
    esac
    if [ "${backend%_outer}" != "$backend" ]; then
        backend=${backend%_outer}
        layer=outer
    fi
    if [ "${mode%_deny}" != "$mode" ]; then
        # Every request carries the one key that is always denied.
        deny_env=(DENY_KEY=flood)
        wrk_header=(-H "x-key: flood")
    else
        # The clients: KEYS, drawn by the wrk script.
        wrk_header=(-s scripts/wrk-keys.lua)
    fi
    local db_env=()
    [ "$backend" = mysql ] && db_env=(DATABASE_URL="${MYSQL_URL:-}")
    env "${deny_env[@]}" "${quota_env[@]}" "${db_env[@]}" "${approx_env[@]}" BACKEND=$backend LAYER=$layer PORT=$PORT $PIN_SERVER "$BIN" >/dev/null 2>/tmp/bench_server.err &
    SERVER_PID=$!
    if ! wait_up; then
        echo "  $mode: server did not start ($(tail -1 /tmp/bench_server.err)); skipped" >&2
        kill "$SERVER_PID" 2>/dev/null || true
        wait "$SERVER_PID" 2>/dev/null || true
        SERVER_PID=""
        return
    fi
    $PIN_WRK wrk -t1 -c"$CONNECTIONS" -d2s "${wrk_header[@]}" "http://127.0.0.1:$PORT/hello" >/dev/null
    local out ticks0 ticks1 cmds0="" cmds1=""
    [ "${backend#redis}" != "$backend" ] && cmds0=$(redis_commands)
    ticks0=$(cpu_ticks "$backend")
    out=$($PIN_WRK wrk -t1 -c"$CONNECTIONS" -d"$DURATION" --latency "${wrk_header[@]}" "http://127.0.0.1:$PORT/hello")
    ticks1=$(cpu_ticks "$backend")
    [ -n "$cmds0" ] && cmds1=$(redis_commands)
    kill "$SERVER_PID"
    wait "$SERVER_PID" 2>/dev/null || true
    SERVER_PID=""
    local rps p50 p99 non2xx requests cpu
    rps=$(echo "$out" | awk '/^Requests\/sec:/ {print $2}')
    requests=$(echo "$out" | awk '/requests in/ {print $1}')
    cpu=$(awk -v t="$((ticks1 - ticks0))" -v n="$requests" -v hz="$CLK_TCK" \
        'BEGIN { printf "%.2f", (n > 0 ? t * 1000000 / hz / n : 0) }')
    local cmds=-
    if [ -n "$cmds0" ] && [ -n "$cmds1" ]; then
        # Less the INFO that read the first count.
        cmds=$(awk -v a="$cmds0" -v b="$cmds1" -v n="$requests" \
            'BEGIN { printf "%.4f", (n > 0 ? (b - a - 1) / n : 0) }')
    fi
    p50=$(to_us "$(echo "$out" | awk '$1 == "50%" {print $2}')")
    p99=$(to_us "$(echo "$out" | awk '$1 == "99%" {print $2}')")
    non2xx=$(echo "$out" | awk '/Non-2xx/ {print $NF}')
    if [ -n "$non2xx" ] && [ "${mode%_deny}" = "$mode" ]; then
        echo "  warning: $mode answered $non2xx non-2xx responses" >&2
    fi
    echo "$round $mode $rps $p50 $p99 $cpu $cmds" >>"$RESULTS"
}

read -r -a modes <<<"$MODES"
n=${#modes[@]}
echo "rounds=$ROUNDS duration=$DURATION connections=$CONNECTIONS keys=$KEYS cores: server=0 wrk=1"
for round in $(seq 1 "$ROUNDS"); do
    # Rotate the order each round so no mode always runs first or last.
    order=()
    for i in $(seq 0 $((n - 1))); do
        order+=("${modes[$(((i + round - 1) % n))]}")
    done
    echo "round $round: ${order[*]}" >&2
    for mode in "${order[@]}"; do
        run_mode "$round" "$mode"
    done
done

echo
printf '%-6s %-21s %12s %10s %10s %8s %8s %10s\n' round mode req/s p50_us p99_us ratio cpu_us redis_cmds
awk '
    { rps[$1, $2] = $3; p50[$1, $2] = $4; p99[$1, $2] = $5; cpu[$1, $2] = $6; cmds[$1, $2] = $7; order[++k] = $1 SUBSEP $2 }
    END {
        for (i = 1; i <= k; i++) {
            split(order[i], a, SUBSEP); r = a[1]; m = a[2]
            bare = rps[r, "none"]
            ratio = bare > 0 ? sprintf("%.3f", rps[r, m] / bare) : "-"
            printf "%-6s %-21s %12.0f %10.1f %10.1f %8s %8.2f %10s\n", r, m, rps[r, m], p50[r, m], p99[r, m], ratio, cpu[r, m], cmds[r, m]
        }
    }' "$RESULTS"

echo
echo "medians over $ROUNDS rounds (ratio = median of the per-round ratios):"
printf '%-21s %12s %10s %10s %8s %8s %10s %10s\n' mode req/s p50_us p99_us ratio cpu_us cpu_ratio redis_cmds
median() { sort -g | awk '{ v[NR] = $1 } END { if (NR == 0) { print "-"; exit } if (NR % 2) print v[(NR + 1) / 2]; else print (v[NR / 2] + v[NR / 2 + 1]) / 2 }'; }
three() { awk -v v="$1" 'BEGIN { if (v == "-") print "-"; else printf "%.3f", v }'; }
for mode in "${modes[@]}"; do
    grep -q " $mode " "$RESULTS" || continue
    rps=$(awk -v m="$mode" '$2 == m {print $3}' "$RESULTS" | median)
    p50=$(awk -v m="$mode" '$2 == m {print $4}' "$RESULTS" | median)
    p99=$(awk -v m="$mode" '$2 == m {print $5}' "$RESULTS" | median)
    ratio=$(awk -v m="$mode" '
        $2 == "none" { bare[$1] = $3 } $2 == m { mine[$1] = $3 }
        END { for (r in mine) if (bare[r] > 0) print mine[r] / bare[r] }' "$RESULTS" | median)
    cpu=$(awk -v m="$mode" '$2 == m {print $6}' "$RESULTS" | median)
    # Bare axum's CPU per request over this mode's, per round: the throughput ratio a
    # CPU-bound core would give, less disturbed by a noisy machine.
    cpu_ratio=$(awk -v m="$mode" '
        $2 == "none" { bare[$1] = $6 } $2 == m { mine[$1] = $6 }
        END { for (r in mine) if (mine[r] > 0 && bare[r] > 0) print bare[r] / mine[r] }' "$RESULTS" | median)
    cmds=$(awk -v m="$mode" '$2 == m && $7 != "-" {print $7}' "$RESULTS" | median)
    # Without `none` among the modes there is no ratio to bare axum: "-".
    printf '%-21s %12.0f %10.1f %10.1f %8s %8.2f %10s %10s\n' "$mode" "$rps" "$p50" "$p99" \
        "$(three "$ratio")" "$cpu" "$(three "$cpu_ratio")" "$cmds"
done
