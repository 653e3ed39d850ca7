#!/usr/bin/env bash
# The whole test suite, as a new user (or CI) runs it:   ./scripts/test.sh
#
# Installs what a fresh Debian/Ubuntu machine lacks (redis-server and redis-cli for the Redis
# tests, which start their own servers on free ports; cargo-nextest when missing), then runs
# every test with all features, and the doctests.
set -euo pipefail
cd "$(dirname "$0")/.."

need_apt=()
command -v redis-server >/dev/null 2>&1 || need_apt+=(redis-server)
command -v redis-cli >/dev/null 2>&1 || need_apt+=(redis-tools)
if [ ${#need_apt[@]} -gt 0 ]; then
  echo "installing: ${need_apt[*]}"
  sudo=""
  [ "$(id -u)" -eq 0 ] || sudo="sudo"
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "${need_apt[@]}"
fi
# The Redis tests start their own servers; a system service is not needed.

if ! cargo nextest --version >/dev/null 2>&1; then
  echo "installing cargo-nextest"
  cargo install cargo-nextest --locked
fi

cargo nextest run --all-features --no-fail-fast
cargo test --doc --all-features
