# Sourced by the benchmark scripts: starts a redis-server of their own.
#
# bench_redis_start PORT [PIN...]: installs redis-server if missing (Debian), starts it on PORT
# (bound to 127.0.0.1, keeping nothing on disk) under the optional pinning command PIN (e.g.
# `taskset -c 0`), and waits until it answers. Sets REDIS_PID, REDIS_DIR (its directory, for the
# caller to remove) and REDIS_URL.
bench_redis_start() {
    local port=$1
    shift
    command -v redis-server >/dev/null || {
        local sudo=""
        [ "$(id -u)" -ne 0 ] && sudo=sudo
        $sudo apt-get install -y -qq redis-server >/dev/null
    }
    REDIS_DIR=$(mktemp -d)
    "$@" redis-server --port "$port" --bind 127.0.0.1 --save "" --appendonly no \
        --dir "$REDIS_DIR" --daemonize no >/dev/null &
    REDIS_PID=$!
    REDIS_URL="redis://127.0.0.1:$port"
    for _ in $(seq 1 50); do
        redis-cli -p "$port" ping >/dev/null 2>&1 && break
        sleep 0.1
    done
}
