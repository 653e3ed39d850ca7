#!/usr/bin/env bash
# Checks the SQL stores' migration templates (src/backend/sql/postgres.sql, mysql.sql) against
# running servers, with the decision semantics of src/backend/redis/gcra.lua:
#   ./scripts/sql-check.sh            both
#   ./scripts/sql-check.sh pg         PostgreSQL only
#   ./scripts/sql-check.sh mysql      MySQL / MariaDB only
# Servers (trust / no password), overridable:
#   PSQL="psql -h 127.0.0.1 -U postgres test"     MYSQL="mysql -h127.0.0.1 -uroot test"
# Needs psql and pgbench (PostgreSQL), mysql (MySQL / MariaDB). Creates tables and functions
# named tg_check_*, and drops them at the end.
#
# Decisions are written once for both stores, in the MySQL procedure's spec format without the
# key list: "cost|kind,a,limit,slices,hexkey|...;cost|...", at a fixed time in ns (T0).
set -euo pipefail
cd "$(dirname "$0")/.."

PSQL=${PSQL:-"psql -h 127.0.0.1 -U postgres test"}
MYSQL=${MYSQL:-"mysql -h127.0.0.1 -uroot test"}
which=${1:-all}
PGBENCH_SECS=${PGBENCH_SECS:-5}

T0=1700000000000000000 # ns; T0 / 1000 is a multiple of 5 s and of 1 s
fail=0
pass=0

expect() { # name got want
  if [ "$2" = "$3" ]; then
    pass=$((pass + 1))
  else
    fail=$((fail + 1))
    echo "FAIL $1: got '$2', want '$3'"
  fi
}

# The distinct keys of decisions, ascending (byte order = order of lowercase hex).
spec_keys() {
  tr ';|' '\n\n' <<<"$1" | awk -F, 'NF == 5 { print $5 }' | LC_ALL=C sort -u | paste -sd, -
}

# ---------------------------------------------------------------------------------------------
# PostgreSQL

pg() { $PSQL -X -q -At -v ON_ERROR_STOP=1 "$@"; }

pg_load() {
  sed -e 's/{table}/"public"."tg_check_buckets"/g' \
    -e 's/{decide}/"public"."tg_check_decide"/g' \
    -e "s/{unlogged}/${1:-}/g" src/backend/sql/postgres.sql | pg -f - 2>&1 |
    grep -v 'already exists, skipping' || true
}

# Converts decisions to the function's arrays and calls it; prints the reply, comma-separated.
pg_decide() { # now_ns decisions
  local now=$1 keys quotas decs
  keys=$(tr ';|' '\n\n' <<<"$2" | awk -F, 'NF == 5 { printf "%s'\''\\x%s'\''::bytea", (n++ ? "," : ""), $5 }')
  quotas=$(tr ';|' '\n\n' <<<"$2" | awk -F, 'NF == 5 { printf "%s%s,%s,%s,%s", (n++ ? "," : ""), $1, $2, $3, $4 }')
  # Per decision: its number of quotas, its cost, no reservation, no peek.
  decs=$(tr ';' '\n' <<<"$2" | awk -F'|' '{ printf "%s%d,%s,0,0", (n++ ? "," : ""), NF - 1, $1 }')
  pg -c "SELECT array_to_string(tg_check_decide(ARRAY[$keys], '{$quotas}', '{$decs}', $now), ',')"
}

pg_row() { pg -c "SELECT a || ',' || n || ',' || coalesce(array_to_string(c, ','), '-') || ',' || expires_us FROM tg_check_buckets WHERE k = '\\x$1'"; }

# ---------------------------------------------------------------------------------------------
# MySQL / MariaDB

my() { $MYSQL -N -B "$@"; }

my_load() {
  sed -e 's/{table}/`tg_check_buckets`/g' -e 's/{decide}/`tg_check_decide`/g' src/backend/sql/mysql.sql |
    awk 'BEGIN { RS = "\n-- statement\n" } { printf "%s\n//\n", $0 }' | my --delimiter='//'
}

my_decide() { # now_ns decisions
  # Each decision's head is "cost,max_wait,peek": no reservation, no peek.
  my -e "CALL tg_check_decide('$(spec_keys "$2");$(sed -E 's/(^|;)([0-9]+)\|/\1\2,0,0|/g' <<<"$2")', $1)"
}

my_row() { my -e "SELECT CONCAT_WS(',', a, n, COALESCE(c, '-'), expires_us) FROM tg_check_buckets WHERE k = UNHEX('$1')"; }

# ---------------------------------------------------------------------------------------------
# The same checks on both stores.

checks() { # pg|my
  local s=$1 decide="${1}_decide" row="${1}_row" i want
  local G="0,200000000,10,0"   # GCRA, one unit every 200 ms, burst 10
  local F60="1,60000000,1,0"   # fixed window of 60 s, limit 1 (T0 is 20 s into one)
  local F1="1,1000000,2,0"     # fixed window of 1 s, limit 2
  local S="2,5000000,10,12"    # sliding window of 12 sub-windows of 5 s, limit 10

  # A fresh bucket, one request: TAT 200 ms ahead.
  expect "$s fresh" "$($decide $T0 "1|$G,a1")" "0,200000000"
  expect "$s fresh row" "$($row a1)" "$((T0 + 200000000)),0,-,$(((T0 + 200000000) / 1000))"

  # Ten allowed, the eleventh denied (state as it stands), allowed again one emission later.
  for i in $(seq 1 10); do
    expect "$s burst $i" "$($decide $T0 "1|$G,a2")" "0,$((i * 200000000))"
  done
  expect "$s burst 11" "$($decide $T0 "1|$G,a2")" "1,2000000000"
  expect "$s refill" "$($decide $((T0 + 200000000)) "1|$G,a2")" "0,2000000000"
  # Never fits (cost 11 > burst 10), even on a full bucket.
  expect "$s never" "$($decide $T0 "11|$G,a1")" "2,200000000"
  # A cost of 3 on a fresh bucket.
  expect "$s cost 3" "$($decide $T0 "3|$G,a9")" "0,600000000"

  # All-or-nothing: the fixed window is full, so the GCRA quota (room) reports 3 and nothing is
  # written; with an empty fixed window both take the cost.
  expect "$s fixed" "$($decide $T0 "1|$F60,b1")" "0,1,40000000"
  expect "$s both denied" "$($decide $T0 "1|$G,b2|$F60,b1")" "3,0,1,1,40000000"
  expect "$s nothing written" "$($row b2)" "0,0,-,0"
  expect "$s both allowed" "$($decide $T0 "1|$G,b2|$F60,b3")" "0,200000000,0,1,40000000"
  # Never fits on one quota: 2, the others 3.
  expect "$s never + room" "$($decide $T0 "2|$G,b4|$F60,b5")" "3,0,2,0,40000000"

  # Three decisions on one key in one call (burst 2): each sees the previous ones.
  expect "$s batch" "$($decide $T0 "1|0,200000000,2,0,c1;1|0,200000000,2,0,c1;1|0,200000000,2,0,c1")" \
    "0,200000000,0,400000000,1,400000000"
  expect "$s batch row" "$($row c1)" "$((T0 + 400000000)),0,-,$(((T0 + 400000000) / 1000))"
  # Mixed batch: two keys interleaved, one decision with two quotas.
  expect "$s batch mixed" "$($decide $T0 "1|$G,c2;1|$F1,c3;1|$G,c2|$F1,c3;1|$F1,c3")" \
    "0,200000000,0,1,1000000,0,400000000,0,2,1000000,1,2,1000000"

  # Fixed window boundary: the last microsecond of a window, then the first of the next.
  local last=$((T0 + 999999000))
  expect "$s window 1" "$($decide $last "1|$F1,d1")" "0,1,1"
  expect "$s window 2" "$($decide $last "1|$F1,d1")" "0,2,1"
  expect "$s window 3" "$($decide $last "1|$F1,d1")" "1,2,1"
  expect "$s next window" "$($decide $((T0 + 1000000000)) "1|$F1,d1")" "0,1,1000000"
  expect "$s window row" "$($row d1)" "$((T0 / 1000000000 + 1)),1,-,$((T0 / 1000 + 2000000))"
  # A clock step back into the previous window: that window counts from zero (window.rs).
  expect "$s step back" "$($decide $last "1|$F1,d1")" "0,1,1"

  # Sliding window, 12 sub-windows of 5 s, limit 10. 4 counted in sub-window i0, then
  # 12 sub-windows and 1 s later the oldest sub-window (i0) still weighs 4 * 4/5 = 3.2:
  # 3.2 + 6 <= 10 fits, then 9.2 + 1 > 10 does not (with 3 instead of 3.2 it would).
  local z11="0,0,0,0,0,0,0,0,0,0,0"
  expect "$s sliding 4" "$($decide $T0 "4|$S,e1")" "0,0,$z11,0,4"
  local t2=$((T0 + 61000000000))
  expect "$s sliding 6" "$($decide $t2 "6|$S,e1")" "0,1000000,4,$z11,6"
  expect "$s sliding 1" "$($decide $t2 "1|$S,e1")" "1,1000000,4,$z11,6"
  expect "$s sliding row" "$($row e1)" "$((T0 / 5000000000 + 12)),$([ "$s" = my ] && echo 10 || echo 0),4,$z11,6,$(((T0 / 5000000000 + 25) * 5000000))"
  # One sub-window later the 4 left: 6 counted, 4 more fit, a fifth does not.
  local t3=$((T0 + 66000000000))
  expect "$s sliding shift" "$($decide $t3 "4|$S,e1")" "0,1000000,$z11,6,4"
  expect "$s sliding full" "$($decide $t3 "1|$S,e1")" "1,1000000,$z11,6,4"
  # 5 in the oldest sub-window, half-way through the current one, weigh 2.5: 2.5 + 7 fits,
  # 9.5 + 1 does not.
  expect "$s sliding half 5" "$($decide $T0 "5|$S,e2")" "0,0,$z11,0,5"
  local th=$((T0 + 62500000000))
  expect "$s sliding half 7" "$($decide $th "7|$S,e2")" "0,2500000,5,$z11,7"
  expect "$s sliding half 1" "$($decide $th "1|$S,e2")" "1,2500000,5,$z11,7"
  # Fewer than 12 sub-windows later the counts are moved on by that many.
  expect "$s sliding move" "$($decide $((T0 + 15000000000)) "1|$S,e3;1|$S,e3")" \
    "0,0,$z11,0,1,0,0,$z11,0,2"
  expect "$s sliding moved" "$($decide $((T0 + 30000000000)) "1|$S,e3")" \
    "0,0,0,0,0,0,0,0,0,0,0,2,0,0,1"
  # A sliding quota never fitting, and one of cost = limit on an empty window.
  expect "$s sliding never" "$($decide $T0 "11|$S,e4")" "2,0,$z11,0,0"
  expect "$s sliding exact" "$($decide $T0 "10|$S,e4")" "0,0,$z11,0,10"

  # The database's clock: a fresh bucket allows.
  expect "$s db clock" "$($decide NULL "1|0,1000000000000000,10,0,f1")" "0,1000000000000000"
}

# ---------------------------------------------------------------------------------------------

run_pg() {
  echo "== PostgreSQL: $($PSQL -X -At -c 'SHOW server_version')"
  pg -c 'DROP TABLE IF EXISTS tg_check_buckets, tg_check_log; DROP FUNCTION IF EXISTS tg_check_decide'
  pg_load 'UNLOGGED '
  checks pg
  # The migration again (idempotent): the rows stay.
  local before after
  before=$(pg -c 'SELECT count(*) FROM tg_check_buckets')
  pg_load 'UNLOGGED '
  after=$(pg -c 'SELECT count(*) FROM tg_check_buckets')
  expect "pg migration twice" "$after" "$before"
  expect "pg again" "$(pg_decide $T0 "1|0,200000000,10,0,a1")" "0,400000000"

  # Sweep: every row written at T0 (years ago) is expired; a row expiring later stays.
  local expired
  expired=$(pg -c "SELECT count(*) FROM tg_check_buckets WHERE expires_us < (extract(epoch FROM clock_timestamp()) * 1000000)::bigint")
  local sweep="DELETE FROM tg_check_buckets WHERE k IN (SELECT k FROM tg_check_buckets WHERE expires_us < (SELECT (extract(epoch FROM clock_timestamp()) * 1000000)::bigint) LIMIT 5 FOR UPDATE SKIP LOCKED)"
  local deleted=0 d
  while :; do
    d=$($PSQL -X -At -c "$sweep" | awk '{ print $2 }')
    deleted=$((deleted + d))
    [ "$d" -eq 5 ] || break
  done
  expect "pg sweep" "$deleted" "$expired"
  expect "pg sweep keeps" "$(pg -c 'SELECT count(*) FROM tg_check_buckets')" "1"

  # Concurrency: 16 clients for a few seconds on one key (burst 100, one unit back every 11.6
  # days), database clock: exactly 100 allowed.
  pg -c 'CREATE TABLE tg_check_log (code bigint)'
  local f
  f=$(mktemp)
  cat >"$f" <<'EOF'
INSERT INTO tg_check_log SELECT (tg_check_decide(ARRAY['\x686f74'::bytea], '{0,1000000000000000,100,0}', '{1,1,0,0}', NULL))[1];
EOF
  pgbench_run "hot key, logged" "$f" -c 16 -j 2
  expect "pg concurrent allowed" "$(pg -c 'SELECT count(*) FROM tg_check_log WHERE code = 0')" "100"
  echo "   calls: $(pg -c 'SELECT count(*) FROM tg_check_log')"
  # Two keys per call, given in either order, and a decision with both: no deadlock (pgbench
  # aborts a client on any error), exactly 100 allowed on each.
  pg -c 'TRUNCATE tg_check_log'
  cat >"$f" <<'EOF'
\set o random(0, 1)
INSERT INTO tg_check_log SELECT unnest(r[1:1] || r[3:3] || r[5:5] || r[7:7]) FROM (SELECT tg_check_decide(CASE WHEN :o = 0 THEN ARRAY['\x6b31'::bytea, '\x6b32', '\x6b31', '\x6b32'] ELSE ARRAY['\x6b32'::bytea, '\x6b31', '\x6b32', '\x6b31'] END, '{0,1000000000000000,100,0,0,1000000000000000,100,0,0,1000000000000000,100,0,0,1000000000000000,100,0}', '{1,1,0,0,1,1,0,0,2,1,0,0}', NULL) r) s;
EOF
  pgbench_run "two keys, logged" "$f" -c 16 -j 2
  local tat1 tat2
  tat1=$(pg -c "SELECT a FROM tg_check_buckets WHERE k = '\\x6b31'")
  tat2=$(pg -c "SELECT a FROM tg_check_buckets WHERE k = '\\x6b32'")
  local now_ns
  now_ns=$(pg -c "SELECT (extract(epoch FROM clock_timestamp()) * 1000000)::bigint * 1000")
  # 100 units taken on each (no more, no fewer): the TAT is 100 emissions after the first
  # call, a few seconds ago.
  expect "pg two keys k1 full" "$(( (tat1 - now_ns) / 1000000000000000 ))" "99"
  expect "pg two keys k2 full" "$(( (tat2 - now_ns) / 1000000000000000 ))" "99"

  # Throughput (not checks): one key, distinct keys, batches of 10 decisions.
  if [ "${BENCH:-1}" = 1 ]; then
    cat >"$f" <<'EOF'
SELECT tg_check_decide(ARRAY['\x686f7432'::bytea], '{0,1000,1000000000,0}', '{1,1,0,0}', NULL);
EOF
    pgbench_run "hot key (always allowed)" "$f" -c 16 -j 2
    pgbench_run "hot key, 1 client" "$f" -c 1 -j 1
    cat >"$f" <<'EOF'
\set r random(1, 1000000)
SELECT tg_check_decide(ARRAY[int8send(:r)], '{0,1000,1000000000,0}', '{1,1,0,0}', NULL);
EOF
    pgbench_run "distinct keys" "$f" -c 16 -j 2
    pgbench_run "distinct keys, 1 client" "$f" -c 1 -j 1
    cat >"$f" <<'EOF'
\set r random(1, 1000000)
SELECT tg_check_decide(ARRAY(SELECT int8send(:r * 10 + i) FROM generate_series(0, 9) i), '{0,1000,1000000000,0,0,1000,1000000000,0,0,1000,1000000000,0,0,1000,1000000000,0,0,1000,1000000000,0,0,1000,1000000000,0,0,1000,1000000000,0,0,1000,1000000000,0,0,1000,1000000000,0,0,1000,1000000000,0}', '{1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1}', NULL);
EOF
    pgbench_run "batches of 10 decisions, distinct keys" "$f" -c 16 -j 2
    cat >"$f" <<'EOF'
\set r random(1, 1000000)
SELECT tg_check_decide(ARRAY[int8send(:r)], '{2,1000000,1000000000,12}', '{1,1,0,0}', NULL);
EOF
    pgbench_run "distinct keys, sliding 12" "$f" -c 16 -j 2
  fi
  rm -f "$f"
  pg -c 'DROP TABLE IF EXISTS tg_check_buckets, tg_check_log; DROP FUNCTION IF EXISTS tg_check_decide'
}

pgbench_run() { # label script pgbench-args...
  local label=$1 script=$2 out
  shift 2
  if ! out=$(pgbench -h 127.0.0.1 -U postgres -n "$@" -T "$PGBENCH_SECS" -f "$script" test 2>&1); then
    fail=$((fail + 1))
    echo "FAIL pgbench $label:"
    echo "$out" | tail -5
    return
  fi
  echo "   pgbench $label ($*): $(echo "$out" | grep -E '^tps' | sed 's/ (without initial connection time)//'), latency $(echo "$out" | grep -E '^latency average' | awk '{ print $4, $5 }')"
}

run_my() {
  echo "== MySQL: $(my -e 'SELECT VERSION()')"
  my -e 'DROP TABLE IF EXISTS tg_check_buckets; DROP PROCEDURE IF EXISTS tg_check_decide'
  my_load
  checks my
  local before after
  before=$(my -e 'SELECT count(*) FROM tg_check_buckets')
  my_load
  after=$(my -e 'SELECT count(*) FROM tg_check_buckets')
  expect "my migration twice" "$after" "$before"
  expect "my again" "$(my_decide $T0 "1|0,200000000,10,0,a1")" "0,400000000"

  # The transaction runs READ COMMITTED: seen from another session while the call waits for a
  # lock held elsewhere.
  my_decide NULL "1|0,1000,1000000000,0,99" >/dev/null
  ($MYSQL -e "START TRANSACTION; SELECT * FROM tg_check_buckets WHERE k = UNHEX('99') FOR UPDATE; DO SLEEP(1.5); COMMIT;" >/dev/null &)
  sleep 0.3
  ($MYSQL -e "CALL tg_check_decide('99;1,0,0|0,1000,1000000000,0,99', NULL)" >/dev/null &)
  sleep 0.5
  expect "my read committed" "$(my -e "SELECT trx_isolation_level FROM information_schema.innodb_trx WHERE trx_state = 'LOCK WAIT' LIMIT 1")" "READ COMMITTED"
  wait
  sleep 1.2

  # Errors inside roll back and reach the caller (a bad key, after a decision was applied).
  local err
  err=$($MYSQL -e "CALL tg_check_decide('a5;1,0,0|0,200000000,10,0,a5;1,0,0|0,200000000,10,0,a6', $T0)" 2>&1 || true)
  expect "my error raised" "$(grep -c 'missing from the key list' <<<"$err")" "1"
  expect "my error rolled back" "$(my_row a5)" ""

  # Sweep.
  local expired deleted=0 d
  expired=$(my -e "SELECT count(*) FROM tg_check_buckets WHERE expires_us < TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', UTC_TIMESTAMP(6))")
  while :; do
    d=$(my -e "DELETE FROM tg_check_buckets WHERE expires_us < TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', UTC_TIMESTAMP(6)) LIMIT 5; SELECT ROW_COUNT()")
    deleted=$((deleted + d))
    [ "$d" -eq 5 ] || break
  done
  expect "my sweep" "$deleted" "$expired"

  # Concurrency: 16 clients, each a connection running CALLs back to back, on one key
  # (burst 100, very slow refill), database clock: exactly 100 allowed.
  local dir workers=16 calls=${MY_CALLS:-300}
  dir=$(mktemp -d)
  for _ in $(seq 1 "$calls"); do
    echo "CALL tg_check_decide('686f74;1,0,0|0,1000000000000000,100,0,686f74', NULL);"
  done >"$dir/calls.sql"
  local t0 t1
  t0=$(date +%s.%N)
  for w in $(seq 1 $workers); do
    $MYSQL -N -B <"$dir/calls.sql" >"$dir/out.$w" 2>"$dir/err.$w" &
  done
  wait
  t1=$(date +%s.%N)
  expect "my concurrent errors" "$(cat "$dir"/err.* | wc -l)" "0"
  expect "my concurrent calls" "$(cat "$dir"/out.* | wc -l)" "$((workers * calls))"
  expect "my concurrent allowed" "$(cat "$dir"/out.* | grep -c '^0,')" "100"
  echo "   mysql hot key: $((workers * calls)) calls by $workers clients in $(awk "BEGIN { print $t1 - $t0 }") s"
  # Two keys per call in one decision plus each alone, keys listed ascending by the caller.
  for _ in $(seq 1 "$calls"); do
    echo "CALL tg_check_decide('6b31,6b32;1,0,0|0,1000000000000000,100,0,6b32;1,0,0|0,1000000000000000,100,0,6b31|0,1000000000000000,100,0,6b32;1,0,0|0,1000000000000000,100,0,6b31', NULL);"
  done >"$dir/calls.sql"
  for w in $(seq 1 $workers); do
    $MYSQL -N -B <"$dir/calls.sql" >"$dir/out.$w" 2>"$dir/err.$w" &
  done
  wait
  expect "my two keys errors" "$(cat "$dir"/err.* | wc -l)" "0"
  # Units taken: per call, k2 alone (field 1), both (fields 3, 5), k1 alone (field 7).
  expect "my two keys k2" "$(cat "$dir"/out.* | awk -F, '{ n += ($1 == 0) + ($3 == 0) } END { print n }')" "100"
  expect "my two keys k1" "$(cat "$dir"/out.* | awk -F, '{ n += ($5 == 0) + ($7 == 0) } END { print n }')" "100"
  # Throughput: distinct keys.
  for w in $(seq 1 $workers); do
    for i in $(seq 1 "$calls"); do
      echo "CALL tg_check_decide('$(printf '%04x%04x' "$w" "$i");1,0,0|0,1000,1000000000,0,$(printf '%04x%04x' "$w" "$i")', NULL);"
    done >"$dir/calls.$w.sql"
  done
  t0=$(date +%s.%N)
  for w in $(seq 1 $workers); do
    $MYSQL -N -B <"$dir/calls.$w.sql" >"$dir/out.$w" 2>"$dir/err.$w" &
  done
  wait
  t1=$(date +%s.%N)
  expect "my distinct errors" "$(cat "$dir"/err.* | wc -l)" "0"
  echo "   mysql distinct keys: $((workers * calls)) calls by $workers clients in $(awk "BEGIN { print $t1 - $t0 }") s"
  rm -rf "$dir"
  my -e 'DROP TABLE IF EXISTS tg_check_buckets; DROP PROCEDURE IF EXISTS tg_check_decide'
}

case $which in
  pg) run_pg ;;
  mysql) run_my ;;
  *)
    run_pg
    run_my
    ;;
esac
echo "$pass passed, $fail failed"
[ "$fail" -eq 0 ]
