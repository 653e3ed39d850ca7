# Sourced by scripts/bench-rls.sh and scripts/bench-rls-instructions.sh: the rate limit
# services they measure, by mode.
#
#   none                      examples/rls answering OK without deciding (the floor)
#   local, redis              examples/rls on the local backend, on Redis ($REDIS_URL)
#   server, server_redis      the tollgate-server binary (local, Redis), as deployed: Prometheus
#                             recording every decision (USE_PROMETHEUS=true, its default)
#   server_noprom             the binary without the Prometheus recorder
#   limitador, limitador_redis  limitador-server ($LIMITADOR, its limits file
#                             $LIMITADOR_LIMITS: one limit never reached on
#                             descriptors[0].remote_address of namespace edge), in memory and
#                             on Redis, with its rate-limit fields (-H DRAFT_VERSION_03)
#   <mode>_noheaders          without rate-limit fields in the answers
#
# rls_start MODE PORT [WRAP...]: starts MODE's server with its gRPC service on PORT (its HTTP
# port, where it has one, is PORT+1) under the command WRAP (taskset, valgrind); sets RLS_PID.
# Reads RLS_RULES (the rules file), REDIS_URL, TARGET.
rls_start() {
    local mode=$1 port=$2 headers=on backend=$1
    shift 2
    if [ "${backend%_noheaders}" != "$backend" ]; then
        backend=${backend%_noheaders}
        headers=off
    fi
    case $backend in
    server | server_noprom | server_redis)
        local store=local prom=true
        [ "$backend" = server_redis ] && store=redis
        [ "$backend" = server_noprom ] && prom=false
        GRPC_PORT=$port PORT=$((port + 1)) HOST=127.0.0.1 GRPC_HOST=127.0.0.1 \
            BACKEND=$store HEADERS=$headers USE_PROMETHEUS=$prom LOG_LEVEL=warn \
            RULES_FILE="$RLS_RULES" REDIS_URL="${REDIS_URL#redis://}" \
            "$@" "$TARGET/release/tollgate-server" >/dev/null 2>&1 &
        ;;
    limitador | limitador_redis)
        [ -x "${LIMITADOR:-}" ] || { echo "mode $mode: set LIMITADOR to limitador-server's path" >&2; return 1; }
        local storage=(memory) fields=NONE
        [ "$backend" = limitador_redis ] && storage=(redis "$REDIS_URL")
        # Like for like: limitador's own fields (X-RateLimit-Limit, -Remaining, -Reset) where
        # tollgate sends the IETF ones.
        [ "$headers" = on ] && fields=DRAFT_VERSION_03
        "$@" "$LIMITADOR" --rls-ip 127.0.0.1 --rls-port "$port" --http-ip 127.0.0.1 \
            --http-port $((port + 1)) -H "$fields" "$LIMITADOR_LIMITS" "${storage[@]}" \
            >/dev/null 2>&1 &
        ;;
    *)
        PORT=$port BACKEND=$backend HEADERS=$headers RULES_FILE="$RLS_RULES" \
            REDIS_URL="$REDIS_URL" "$@" "$TARGET/release/examples/rls" >/dev/null 2>&1 &
        ;;
    esac
    RLS_PID=$!
}

# rls_build: the release binaries every mode needs.
rls_build() {
    cargo build -q --release --features rls,redis --example rls --example rls_load
    cargo build -q --release --features server --bin tollgate-server
}
