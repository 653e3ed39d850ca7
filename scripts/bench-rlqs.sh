#!/usr/bin/env bash
# A fleet of Envoys holding one shared limit through tollgate-server, two ways: RLQS (Envoy's
# rate_limit_quota filter with the docs' quota gateway, docs/envoy.md, streaming usage reports
# every 5 s) and RLS (the rate limit filter, a call per request, scripts/envoy-rls-fleet.yaml),
# both in front of a direct response, the same rule (400 requests a second for the tenant) and
# the same open-loop load (examples/fleet_load): 2x the limit offered, split 70/10/10/10 between
# 4 Envoys (--concurrency 1). Prints, per run, the fleet's admitted rate over the measured
# seconds (after WARMUP), each 5-s window's, and the server's CPU time (user + system, from
# /proc) per 1 000 requests of the fleet. Release build of tollgate-server (local backend).
#
# Usage: scripts/bench-rlqs.sh
# Environment (all optional): ENVOY (envoy on the PATH), LIMIT=400 DURATION=60 (seconds) WARMUP=20
#   BASE_PORT=9300 CARGO_TARGET_DIR
set -euo pipefail
cd "$(dirname "$0")/.."
ENVOY=${ENVOY:-envoy}
LIMIT=${LIMIT:-400}
SECONDS_RUN=${DURATION:-60}
WARMUP=${WARMUP:-20}
BASE=${BASE_PORT:-9300}
TARGET=${CARGO_TARGET_DIR:-target}
SERVER_GRPC=$BASE
SERVER_HTTP=$((BASE + 1))

cargo build -q --release --features server --bin tollgate-server
cargo build -q --release --example fleet_load
WORK=$(mktemp -d)
trap 'kill $(jobs -p) 2>/dev/null || true; rm -rf "$WORK"' EXIT

cat >"$WORK/rules.yaml" <<YAML
domain: edge
descriptors:
  - key: name
    value: api
    descriptors:
      - key: tenant
        rate_limit: { unit: second, requests_per_unit: $LIMIT }
YAML

# The docs' quota gateway with its ports, the service replaced by a direct response.
rlqs_config() { # listen_port
    awk '/<!-- envoy: quota -->/ { f = 1; next } f && /^```yaml$/ { next } f && /^```$/ { exit } f' docs/envoy.md |
        sed -e "s/port_value: 8080 /port_value: $1 /" -e "s/port_value: 8081 /port_value: $SERVER_GRPC /" \
            -e 's/route: { cluster: service }/direct_response: { status: 200, body: { inline_string: "ok" } }/'
}
rls_config() { # listen_port
    sed -e "s/@LISTEN_PORT@/$1/" -e "s/@UPSTREAM_PORT@/$(($1 + 100))/" \
        -e "s/@SERVER_PORT@/$SERVER_GRPC/" scripts/envoy-rls-fleet.yaml
}

# The process's CPU time in nanoseconds: every thread's time on a CPU (schedstat).
cpu_ns() { cat /proc/"$1"/task/*/schedstat | awk '{ s += $1 } END { printf "%d", s }'; }

run() { # mode: rlqs or rls
    local mode=$1 pids=() targets="" i port
    GRPC_PORT=$SERVER_GRPC PORT=$SERVER_HTTP HOST=127.0.0.1 GRPC_HOST=127.0.0.1 LOG_LEVEL=warn \
        RULES_FILE="$WORK/rules.yaml" "$TARGET/release/tollgate-server" 2>"$WORK/server-$mode.log" &
    local server=$!
    until curl -fsS -o /dev/null "http://127.0.0.1:$SERVER_HTTP/healthcheck" 2>/dev/null; do sleep 0.05; done
    local rates=($((LIMIT * 2 * 70 / 100)) $((LIMIT * 2 * 10 / 100)) $((LIMIT * 2 * 10 / 100)) $((LIMIT * 2 * 10 / 100)))
    for i in 0 1 2 3; do
        port=$((BASE + 10 + i))
        "${mode}_config" "$port" >"$WORK/envoy-$mode-$i.yaml"
        "$ENVOY" -c "$WORK/envoy-$mode-$i.yaml" --disable-hot-restart --concurrency 1 \
            --base-id $((BASE + i)) --log-level error >"$WORK/envoy-$mode-$i.log" 2>&1 &
        pids+=($!)
        targets+="${targets:+,}http://127.0.0.1:$port/@${rates[$i]}"
    done
    for i in 0 1 2 3; do
        until curl -s -o /dev/null "http://127.0.0.1:$((BASE + 10 + i))/" 2>/dev/null; do sleep 0.05; done
    done
    sleep 1
    local t0
    t0=$(cpu_ns "$server")
    TARGETS=$targets DURATION=$SECONDS_RUN HEADER=x-tenant:acme "$TARGET/release/examples/fleet_load" >"$WORK/load-$mode.txt"
    local t1
    t1=$(cpu_ns "$server")
    kill "${pids[@]}" "$server" 2>/dev/null || true
    wait "${pids[@]}" "$server" 2>/dev/null || true
    awk -v limit="$LIMIT" -v warm="$WARMUP" -v mode="$mode" -v ns=$((t1 - t0)) \
        -v secs="$SECONDS_RUN" '
        NR > 1 { ok[$1] += $3; sent += $3 + $4 + $5; failed += $5; per[$2] += ($1 >= warm) ? $3 : 0 }
        END {
            n = 0; total = 0
            for (s = warm; s < secs; s++) { total += ok[s]; n++ }
            printf "%s: fleet admitted %.1f/s over %d s after %d s of warm-up (%.2f%% of %d/s); ", mode, total / n, n, warm, 100 * total / n / limit, limit
            printf "per Envoy %.1f / %.1f / %.1f / %.1f per s\n", per[0] / n, per[1] / n, per[2] / n, per[3] / n
            printf "%s: 5-s windows (%% of the limit):", mode
            worst = 0
            for (w = warm; w + 5 <= secs; w += 5) {
                sum = 0; for (s = w; s < w + 5; s++) sum += ok[s]
                pct = 100 * sum / 5 / limit; printf " %.1f", pct
                d = pct - 100; if (d < 0) d = -d; if (d > worst) worst = d
            }
            printf "; worst %.1f%% off\n", worst
            printf "%s: the first %d s (Envoys joining, before their demand is known), admitted per s:", mode, warm
            over = 0
            for (s = 0; s < warm; s++) { printf " %d", ok[s]; if (ok[s] - limit > over) over = ok[s] - limit }
            printf "; most over the limit in a second: %d (%.0f%%)\n", over, 100 * over / limit
            printf "%s: %d requests (%d failed), server CPU %.3f s: %.3f ms per 1 000 requests\n", mode, sent, failed, ns / 1e9, ns / 1e6 / sent * 1000
        }' "$WORK/load-$mode.txt"
}

# The server alone for as long, no Envoy: what it spends idle (reloads, checks, upkeep).
idle() {
    GRPC_PORT=$SERVER_GRPC PORT=$SERVER_HTTP HOST=127.0.0.1 GRPC_HOST=127.0.0.1 LOG_LEVEL=warn \
        RULES_FILE="$WORK/rules.yaml" "$TARGET/release/tollgate-server" 2>/dev/null &
    local server=$! t0 t1
    until curl -fsS -o /dev/null "http://127.0.0.1:$SERVER_HTTP/healthcheck" 2>/dev/null; do sleep 0.05; done
    sleep 1
    t0=$(cpu_ns "$server")
    sleep "$SECONDS_RUN"
    t1=$(cpu_ns "$server")
    kill "$server"; wait "$server" 2>/dev/null || true
    echo "idle: server CPU $(awk -v ns=$((t1 - t0)) 'BEGIN { printf "%.3f", ns / 1e9 }') s in $SECONDS_RUN s with no Envoy"
}

echo "machine: $(nproc) cores, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs); $(git rev-parse --short HEAD); $("$ENVOY" --version | grep -o 'version: [^ ]*' | cut -d/ -f2)"
idle
run rlqs
run rls
