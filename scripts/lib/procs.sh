# Sourced by the benchmark scripts that start servers of their own.
#
# Sets `dir` (a temporary directory) and `pids` (the processes to stop), and a trap that kills
# them and removes the directory on exit; `on_server` and `on_load`, the commands that pin the
# server to core $SERVER_CPU and the load to core $LOAD_CPU when PIN=1 (empty otherwise);
# free_port prints a free TCP port on 127.0.0.1; wait_port PORT waits (up to 5 s) until
# something listens on it.
dir=$(mktemp -d)
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  rm -rf "$dir"
}
trap cleanup EXIT

on_server=() on_load=()
if [ "${PIN:-0}" = 1 ]; then
  on_server=(taskset -c "${SERVER_CPU:-0}") on_load=(taskset -c "${LOAD_CPU:-1}")
fi

free_port() {
  python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}
wait_port() { # port
  for _ in $(seq 1 100); do
    (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null && return 0
    sleep 0.05
  done
  echo "nothing listens on port $1" >&2
  return 1
}
