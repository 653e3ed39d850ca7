#!/usr/bin/env bash
# The whole test suite, as a new user (or CI) runs it:   ./scripts/test.sh
#
# Installs what a fresh Debian/Ubuntu machine lacks (redis-server and redis-cli for the Redis
# tests; PostgreSQL and MariaDB's server binaries for the SQL tests; every test starts its own
# servers on free ports in temporary directories, no system service is used; Chromium for the
# browser test, headless; cargo-nextest when missing), then runs every test with all features, and the doctests.
set -euo pipefail
cd "$(dirname "$0")/.."

need_apt=()
command -v redis-server >/dev/null 2>&1 || need_apt+=(redis-server)
command -v redis-cli >/dev/null 2>&1 || need_apt+=(redis-tools)
ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 || need_apt+=(postgresql)
{ [ -x /usr/sbin/mariadbd ] && command -v mariadb-install-db >/dev/null 2>&1; } ||
  need_apt+=(mariadb-server)
command -v "${CHROMIUM:-chromium}" >/dev/null 2>&1 || need_apt+=(chromium)
if [ ${#need_apt[@]} -gt 0 ]; then
  echo "installing: ${need_apt[*]}"
  sudo=""
  [ "$(id -u)" -eq 0 ] || sudo="sudo"
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "${need_apt[@]}"
fi
# The tests start their own servers; system services are not needed (Debian's packages may
# start them: the tests use other ports).

if ! cargo nextest --version >/dev/null 2>&1; then
  echo "installing cargo-nextest"
  cargo install cargo-nextest --locked
fi

cargo nextest run --all-features --no-fail-fast
cargo test --doc --all-features
