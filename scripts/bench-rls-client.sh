#!/usr/bin/env bash
# RlsBackend against real rate limit services (examples/rls_client_bench): a denial flood
# (calls that reach the service), the p99 added over calling the service directly, decisions
# per second beside a RedisBackend on the same machine, and the worst decision time against a
# server that accepts and never answers. Services: tollgate-server (release, local store), and
# limitador when LIMITADOR names its binary (`-H DRAFT_VERSION_03`, in memory, limits in
# scripts/limitador-client-limits.yaml). One rule: `client`, 10 an hour per value.
#
# Usage: scripts/bench-rls-client.sh
# Environment (all optional): LIMITADOR, BASE_PORT=9400, SAMPLES=5000, DURATION=5 (seconds),
#   CONCURRENCY=64, CARGO_TARGET_DIR
set -euo pipefail
cd "$(dirname "$0")/.."
BASE=${BASE_PORT:-9400}
TARGET=${CARGO_TARGET_DIR:-target}
export SAMPLES=${SAMPLES:-5000} CONCURRENCY=${CONCURRENCY:-64}

cargo build -q --release --features server --bin tollgate-server
cargo build -q --release --features rls-client,redis --example rls_client_bench
WORK=$(mktemp -d)
# shellcheck source=lib/bench-redis.sh
. scripts/lib/bench-redis.sh
bench_redis_start $((BASE + 9))
trap 'kill $(jobs -p) 2>/dev/null || true; rm -rf "$WORK" "$REDIS_DIR"' EXIT
cat >"$WORK/rules.yaml" <<'YAML'
domain: edge
descriptors:
  - key: client
    rate_limit: { unit: hour, requests_per_unit: 10 }
YAML

# A server that accepts connections and reads, never answering.
python3 -c '
import socket, sys, threading
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("127.0.0.1", int(sys.argv[1]))); s.listen(128)
def drain(c):
    while c.recv(65536): pass
while True:
    c, _ = s.accept(); threading.Thread(target=drain, args=(c,), daemon=True).start()
' $((BASE + 8)) &
HUNG_URL=http://127.0.0.1:$((BASE + 8))

echo "machine: $(nproc) cores, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs); $(git rev-parse --short HEAD)"
GRPC_PORT=$BASE PORT=$((BASE + 1)) HOST=127.0.0.1 GRPC_HOST=127.0.0.1 LOG_LEVEL=warn \
    RULES_FILE="$WORK/rules.yaml" "$TARGET/release/tollgate-server" 2>"$WORK/server.log" &
until curl -fsS -o /dev/null "http://127.0.0.1:$((BASE + 1))/healthcheck" 2>/dev/null; do sleep 0.05; done
echo "== tollgate-server"
RLS_URL=http://127.0.0.1:$BASE REDIS_URL=$REDIS_URL HUNG_URL=$HUNG_URL \
    "$TARGET/release/examples/rls_client_bench"

if [ -n "${LIMITADOR:-}" ]; then
    "$LIMITADOR" --rls-ip 127.0.0.1 --rls-port $((BASE + 2)) --http-ip 127.0.0.1 \
        --http-port $((BASE + 3)) -H DRAFT_VERSION_03 scripts/limitador-client-limits.yaml memory \
        >"$WORK/limitador.log" 2>&1 &
    until curl -fsS -o /dev/null "http://127.0.0.1:$((BASE + 3))/status" 2>/dev/null; do sleep 0.05; done
    echo "== limitador (in memory, -H DRAFT_VERSION_03)"
    RLS_URL=http://127.0.0.1:$((BASE + 2)) "$TARGET/release/examples/rls_client_bench"
fi
