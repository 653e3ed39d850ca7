#!/usr/bin/env bash
# redis-server's own CPU instructions per decision of tollgate's script
# (src/backend/redis/gcra.lua), counted by valgrind's callgrind: repeatable to a fraction of a
# percent whatever else the machine is doing. redis-server runs under callgrind, fed by
# redis-benchmark with EVALSHA calls of 1 and of 16 decisions, on one hot key and on 16
# different keys, as the backend sends them (one quota per policy); and, as real traffic has
# clients in different states, on 16 keys with costs 1..16.
#
# Usage: scripts/bench-redis-instructions.sh
# Environment (all optional):
#   ALGOS="gcra fixed sliding"   quota algorithms to measure (one quota per policy):
#                                gcra 1 us emission interval, huge burst; fixed a one-minute
#                                window; sliding one minute in 12 sub-windows; `calendar` a
#                                calendar month (not in the default); huge limits
#   SCRIPT=src/backend/redis/gcra.lua   the script to measure (e.g. an older version)
#   SUFFIX=":0..."               the key suffix after the hash tag (default: the backend's
#                                suffix for the quota)
#   LEGACY=1                     the arguments and key suffixes of tollgate 0.1's script, to
#                                measure it: SCRIPT=<that gcra.lua> LEGACY=1
#   CASES="1,0 16,0 16,1 16,2"   decisions per call, keys (0 one, 1 one per decision, 2 one
#                                per decision with costs 1..n: keys in different states)
#   PROFILE_DIR=dir              keep each run's callgrind profiles there:
#                                dir/<algo>-<decisions>-<keys>-<calls>.out, calls 100 and 1100
#                                (the difference is the 1000 calls measured)
#   REDIS_SERVER=redis-server         the server binary (one built with symbols gives a readable
#                                profile; counts differ a little from the packaged one)
#   PORT=<a free port>
#
# For each case: (instructions of 1100 calls - instructions of 100 calls) / 1000 / decisions
# per call, so that the server's start, stop and first calls (key creation) cancel out.
set -euo pipefail
cd "$(dirname "$0")/.."

ALGOS=${ALGOS:-"gcra fixed sliding"}
SCRIPT=${SCRIPT:-src/backend/redis/gcra.lua}
# A free port (a fixed one could be taken by tests running meanwhile, whose servers the
# `shutdown` below would stop).
PORT=${PORT:-$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')}
REDIS_SERVER=${REDIS_SERVER:-redis-server}

# shellcheck source=lib/callgrind.sh
. scripts/lib/callgrind.sh
need valgrind valgrind
need redis-server redis-server
need redis-benchmark redis-tools

WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT


# The quota's four script arguments (hexadecimal, see gcra.lua) and its key suffix (as
# src/backend/remote/keys.rs names them), by algorithm: huge limits, so that every decision is
# allowed and writes.
quota() { # algo
    case $1 in
    gcra) echo "0 3e8 ee6b2800 0 :0g1000x4000000000" ;;
    fixed) echo "1 3938700 ee6b2800 0 :0f60000000x4000000000" ;;
    sliding) echo "2 4c4b40 ee6b2800 b :0s5000000x11x4000000000" ;;
    # A calendar month (kind 5): the boundary 2026-12-01 00:00 UTC, 30-day windows on each
    # side, the calendar's id 0x12345 above the limit (see gcra.lua).
    calendar) echo "5 6b0e0e00 12345ee6b2800 9e3400278d00 :2.d0" ;;
    *) echo "unknown algorithm $1" >&2 && exit 1 ;;
    esac
}

# The same in the arguments and keys of tollgate 0.1's script (decimal numbers, a policy and a
# cost per decision), for SCRIPT=<that script> LEGACY=1.
legacy_quota() { # algo
    case $1 in
    gcra) echo "0 1000 4000000000 0 :0:1000x4000000000" ;;
    fixed) echo "1 60000000 4000000000 0 :0:f60000000x4000000000" ;;
    sliding) echo "2 5000000 4000000000 11 :0:s5000000x11x4000000000" ;;
    *) echo "unknown algorithm $1" >&2 && exit 1 ;;
    esac
}

# Instructions of redis-server serving $1 calls of $2 decisions of algorithm $4: on one key
# ($3 = 0), on $2 keys ($3 = 1), or on $2 keys with costs 1 .. $2 ($3 = 2: the keys' states and
# expiries differ, as they do in real traffic, where each client has its own history; GCRA's
# emission interval and a sliding window's sub-window are then a millisecond).
redis_run() { # calls decisions keys algo
    local args=() pid kind a b c suffix
    if [ -n "${LEGACY:-}" ]; then
        read -r kind a b c suffix < <(legacy_quota "$4")
        [ "$3" = 2 ] && [ "$kind" = 0 ] && a=1000000
        [ "$3" = 2 ] && [ "$kind" = 2 ] && a=1000
    else
        read -r kind a b c suffix < <(quota "$4")
        [ "$3" = 2 ] && [ "$kind" = 0 ] && a=f4240
        [ "$3" = 2 ] && [ "$kind" = 2 ] && a=3e8
    fi
    suffix=${SUFFIX:-$suffix}
    valgrind --tool=callgrind --callgrind-out-file="$WORK/r.out" "$REDIS_SERVER" --port "$PORT" \
        --bind 127.0.0.1 --save "" --appendonly no --dir "$WORK" >/dev/null 2>&1 &
    pid=$!
    for _ in $(seq 1 100); do
        redis-cli -p "$PORT" ping >/dev/null 2>&1 && break
        sleep 0.1
    done
    local sha
    sha=$(redis-cli -p "$PORT" -x script load <"$SCRIPT")
    args=(EVALSHA "$sha" "$2")
    for i in $(seq "$2"); do
        if [ "$3" = 0 ]; then args+=("tollgate:{bench:bhot}$suffix"); else args+=("tollgate:{bench:bk$i}$suffix"); fi
    done
    args+=("" 1 1 "$kind" "$a" "$b" "$c")
    if [ -n "${LEGACY:-}" ]; then
        args+=("$2")
        for i in $(seq "$2"); do args+=(1 "$([ "$3" = 2 ] && echo "$i" || echo 1)"); done
    elif [ "$3" = 2 ]; then
        args+=("$(printf %x "$2")")
        # Runs: count, policy, cost, longest wait (0: a plain decision), peek (0).
        for i in $(seq "$2"); do args+=(1 1 "$(printf %x "$i")" 0 0); done
    else
        args+=(1 "$(printf %x "$2")" 1 1 0 0)
    fi
    redis-benchmark -p "$PORT" -n "$1" -c 1 -q "${args[@]}" >/dev/null 2>&1
    # Check the script answered (an error reply would be cheap and wrong).
    local reply
    reply=$(redis-cli -p "$PORT" "${args[@]}" 2>&1 | head -1)
    case $reply in
    0 | 3) ;;
    *) echo "script error: $reply" >&2 && exit 1 ;;
    esac
    redis-cli -p "$PORT" shutdown nosave >/dev/null 2>&1 || true
    wait "$pid" 2>/dev/null || true
    if [ -n "${PROFILE_DIR:-}" ]; then
        cp "$WORK/r.out" "$PROFILE_DIR/$4-$2-$3-$1.out"
    fi
    callgrind_total "$WORK/r.out"
}

printf '%-8s %-34s %14s\n' algo "redis-server, one call of" instr/decision
for algo in $ALGOS; do
    for spec in ${CASES:-"1,0" "16,0" "16,1" "16,2"}; do
        IFS=, read -r n keys <<<"$spec"
        base=$(redis_run 100 "$n" "$keys" "$algo")
        more=$(redis_run 1100 "$n" "$keys" "$algo")
        case $keys in
        0) label="$n decision(s), one key" ;;
        1) label="$n decisions, $n keys" ;;
        *) label="$n decisions, $n keys, costs 1..$n" ;;
        esac
        printf '%-8s %-34s %14d\n' "$algo" "$label" $(((more - base) / 1000 / n))
    done
done
