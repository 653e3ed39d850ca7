#!/usr/bin/env bash
# examples/retry_storm in each mode at 1x, 3x and 10x its upstream's capacity (800 calls a
# second), then a 10x spike that ends (8000@0s,400@10s) with the throttle's default window and
# longer ones: the numbers of BENCHMARKS.md, "Retry storms".
#
# Then each mode through a schedule of 3x, a spike to 10x from 5 s and half the capacity
# from 15 s, second by second into target/bench-retry-storm/<mode>.txt, plotted by
# scripts/plot-retry-storm.py into docs/retry-storm.png (matplotlib in a venv under target/).
#
# Usage: scripts/bench-retry-storm.sh   (SECS=15 per steady run)
set -euo pipefail
cd "$(dirname "$0")/.."
SECS=${SECS:-15}
cargo build --release --quiet --example retry_storm
BIN=${CARGO_TARGET_DIR:-target}/release/examples/retry_storm
for rate in 800 2400 8000; do
    for mode in naive tower budget throttle both; do
        printf '%-8s %5s/s  ' "$mode" "$rate"
        MODE=$mode RATE=$rate SECS=$SECS "$BIN" | tail -1
    done
done
for window in 250 500 1000 2000; do
    echo "spike 8000/s then 400/s from 10 s, MODE=both, THROTTLE_WINDOW_MS=$window:"
    MODE=both RATE=8000@0s,400@10s SECS=16 THROTTLE_WINDOW_MS=$window "$BIN" | sed -n '2p;10,17p'
done
OUT=target/bench-retry-storm
mkdir -p "$OUT"
for mode in naive budget throttle both; do
    MODE=$mode RATE=2400@0s,8000@5s,400@15s SECS=22 "$BIN" > "$OUT/$mode.txt"
done
if [ ! -x target/plot-venv/bin/python ]; then
    python3 -m venv target/plot-venv
    target/plot-venv/bin/pip install --quiet matplotlib
fi
target/plot-venv/bin/python scripts/plot-retry-storm.py "$OUT" docs/retry-storm.png
