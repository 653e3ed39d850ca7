#!/usr/bin/env bash
# The floor under the Redis script's cost per distinct key (issue #18): what redis-server spends
# on the commands a decision needs, with no decision logic at all. Minimal Lua scripts, called
# with 16 keys (as a 16-decision call on 16 distinct keys), under callgrind:
#
#   get_set        a GET and a SET … PXAT per key (what the script does today, minus its logic)
#   mget_set       one MGET for the 16 keys, then a SET … PXAT per key
#   mget_keepttl   one MGET, then SET … KEEPTTL per key (an expiry that does not move)
#   mget           one MGET only
#   time           TIME only: the per-call cost of EVALSHA itself
#
# Each is run for 100 and 1 100 calls; (instructions(1100) - instructions(100)) / 1000 / 16 is
# printed per key. Usage: scripts/bench-redis-floor.sh (needs valgrind, redis-server,
# redis-benchmark; installs them on Debian when missing).
set -euo pipefail
cd "$(dirname "$0")/.."

# shellcheck source=lib/callgrind.sh
. scripts/lib/callgrind.sh
need valgrind valgrind
need redis-server redis-server
need redis-benchmark redis-tools

WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT

# Expiry an hour ahead, formatted once per call (as the script caches it).
HEAD="local t = redis.call('TIME')
local x = string.format('%d', t[1] * 1000 + 3600000)"
script() { # name, a statement before the loop over the keys, the statement per key (or none)
    {
        echo "$HEAD"
        [ -z "$2" ] || echo "$2"
        [ -z "$3" ] || printf 'for i = 1, #KEYS do\n  %s\nend\n' "$3"
        echo "return #KEYS"
    } >"$WORK/$1.lua"
}
MGET="local vs = redis.call('MGET', unpack(KEYS))"
SET_PXAT="redis.call('SET', KEYS[i], 'abcdefgh', 'PXAT', x)"
script get_set "" "local v = redis.pcall('GET', KEYS[i]); $SET_PXAT"
script mget_set "$MGET" "$SET_PXAT"
script mget_keepttl "$MGET" "redis.call('SET', KEYS[i], 'abcdefgh', 'KEEPTTL')"
script mget "$MGET" ""
script time "" ""

keys=()
for i in $(seq 1 16); do keys+=("tollgate:{bench:client-$i}:0g1000x4000000000"); done

instructions() { # script calls
    local port out
    port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
    out="$WORK/cg.out"
    valgrind --tool=callgrind --callgrind-out-file="$out" redis-server --port "$port" \
        --save "" --appendonly no >/dev/null 2>&1 &
    local pid=$!
    for _ in $(seq 1 100); do redis-cli -p "$port" ping >/dev/null 2>&1 && break; sleep 0.2; done
    local sha
    sha=$(redis-cli -p "$port" script load "$(cat "$1")")
    redis-benchmark -p "$port" -n "$2" -c 1 -q evalsha "$sha" 16 "${keys[@]}" >/dev/null 2>&1
    redis-cli -p "$port" shutdown nosave >/dev/null 2>&1 || true
    wait "$pid" 2>/dev/null || true
    callgrind_total "$out"
    rm -f "$out"
}

printf '%-14s %12s %10s\n' script per_call per_key
for s in get_set mget_set mget_keepttl mget time; do
    a=$(instructions "$WORK/$s.lua" 100)
    b=$(instructions "$WORK/$s.lua" 1100)
    printf '%-14s %12d %10d\n' "$s" $(((b - a) / 1000)) $(((b - a) / 1000 / 16))
done
