#!/usr/bin/env bash
# Fuzzes tollgate's parsers for a bounded time, on the stable toolchain:
#
#   scripts/fuzz.sh                    # every target, 60 s each
#   FUZZ_SECONDS=300 scripts/fuzz.sh rules key_extract
#   FUZZ_MERGE=1 scripts/fuzz.sh       # then minimize what was found into fuzz/corpus/
#
# Targets (fuzz/fuzz_targets/, each calling a function of src/fuzz.rs, which says what is
# checked): key_extract (X-Forwarded-For, Forwarded, X-Real-IP, header keys), quota_str and
# quota_params (quota strings and numbers), quota_serde and rules (quotas, policies and rule
# sets from TOML / YAML / JSON), upstream_wait (Retry-After, grpc-retry-pushback-ms),
# redis_reply and sql_reply (the stores' replies read into decisions).
#
# cargo-fuzz is installed when missing. It runs libFuzzer with `-s none` (no sanitizer): the
# code is safe Rust (`unsafe_code = "forbid"`), and without a sanitizer no nightly flag is
# needed; overflow checks and debug assertions stay on. Each run starts from the committed
# corpus (fuzz/corpus/<target>) and writes new inputs to fuzz/target/corpus/<target>; a crash
# stops its target's run and is saved in fuzz/artifacts/<target>/. Keep a crash as a regression
# test by moving it to fuzz/regressions/<target>/<what-it-is> (`cargo test --lib fuzz` runs
# every file of fuzz/corpus/ and fuzz/regressions/ through its target). At the end, the
# executions and crashes (timeouts, out-of-memory) of each target are printed, and written to
# fuzz/target/fuzz-report.txt. Not part of CI's run (.ci/run): the corpus replay is, in the
# unit tests.
#
# Environment: FUZZ_SECONDS (default 60) per target; FUZZ_MERGE=1 to replace fuzz/corpus/<target>
# with a minimal set of it and of what was found (at most FUZZ_CORPUS_MAX inputs, default 200,
# covering the most edges; needs python3); FUZZ_ARGS, more libFuzzer options; CARGO_BUILD_JOBS
# as for cargo.
set -euo pipefail
cd "$(dirname "$0")/.."

seconds=${FUZZ_SECONDS:-60}

if ! cargo fuzz --version >/dev/null 2>&1; then
  echo "installing cargo-fuzz"
  cargo install cargo-fuzz --locked
fi

targets=("$@")
if [ ${#targets[@]} -eq 0 ]; then
  mapfile -t targets < <(cargo fuzz list)
fi

# Every target (they share one build of the crate), with the options `cargo fuzz run` uses.
cargo fuzz build -s none

# Replaces fuzz/corpus/<target> with at most FUZZ_CORPUS_MAX (200) inputs of it and of the
# run's corpus: libFuzzer's merge records the edges each input covers (counters off), and a
# greedy set cover keeps, input after input, the one covering the most edges not yet covered
# (the smaller of equals), until nothing is left to cover or the cap is reached.
minimize() {
  local t=$1 work=$2 tmp
  tmp=$(mktemp -d)
  mkdir "$tmp/merged"
  cargo fuzz run -s none "$t" "$tmp/merged" "fuzz/corpus/$t" "$work" -- -merge=1 \
    -use_counters=0 -merge_control_file="$tmp/control" >"$tmp/log" 2>&1 ||
    { cat "$tmp/log" >&2; return 1; }
  mkdir "$tmp/keep"
  python3 - "$tmp/control" "${FUZZ_CORPUS_MAX:-200}" <<'EOF' | while IFS= read -r f; do
import sys
lines = open(sys.argv[1], errors="replace").read().split("\n")
n = int(lines[0])
files = lines[2:2 + n]
size, feats = {}, {}
for line in lines[2 + n:]:
    p = line.split()
    if len(p) >= 3 and p[0] == "STARTED":
        size[int(p[1])] = int(p[2])
    elif p and p[0] == "FT":
        feats[int(p[1])] = set(p[2:])
seen, keep = set(), []
while len(keep) < int(sys.argv[2]) and feats:
    best = max(feats, key=lambda i: (len(feats[i] - seen), -size.get(i, 0)))
    gain = feats.pop(best) - seen
    if not gain:
        break
    seen |= gain
    keep.append(files[best])
total = len(set().union(*(set(v) for v in [seen] + list(feats.values()))))
print(f"kept {len(keep)} of {n} inputs, covering {len(seen)} of {total} edges", file=sys.stderr)
print("\n".join(keep))
EOF
    if [ -n "$f" ]; then cp "$f" "$tmp/keep/$(sha1sum <"$f" | cut -c1-40)"; fi
  done
  rm -rf "fuzz/corpus/$t"
  mv "$tmp/keep" "fuzz/corpus/$t"
  rm -rf "$tmp"
  echo "$t: corpus now $(ls "fuzz/corpus/$t" | wc -l) inputs, $(du -sh --apparent-size "fuzz/corpus/$t" | cut -f1)"
}

mkdir -p fuzz/target/logs
report=fuzz/target/fuzz-report.txt
printf '%-14s %6s %12s %8s %9s %5s  %s\n' target seconds executions crashes timeouts ooms \
  "new artifacts" >"$report"
failed=0
for t in "${targets[@]}"; do
  work=fuzz/target/corpus/$t
  artifacts=fuzz/artifacts/$t
  log=fuzz/target/logs/$t.log
  mkdir -p "$work" "$artifacts" "fuzz/corpus/$t"
  before=$(mktemp)
  ls "$artifacts" >"$before"
  echo "== $t: ${seconds}s (log: $log)"
  status=0
  # shellcheck disable=SC2086 # FUZZ_ARGS is a list of options
  cargo fuzz run -s none "$t" "$work" "fuzz/corpus/$t" -- \
    -max_total_time="$seconds" -timeout=10 -print_final_stats=1 \
    -artifact_prefix="$artifacts/" ${FUZZ_ARGS:-} >"$log" 2>&1 || status=$?
  new=$(ls "$artifacts" | grep -vxF -f "$before" || true)
  rm -f "$before"
  count() { if [ -n "$new" ]; then grep -c "^$1" <<<"$new" || true; else echo 0; fi; }
  crashes=$(count crash-)
  timeouts=$(count timeout-)
  ooms=$(count oom-)
  # libFuzzer's final statistics; `Done N runs` when they are missing.
  execs=$(grep -o 'stat::number_of_executed_units: [0-9]*' "$log" | tail -1 | grep -o '[0-9]*$' ||
    grep -o '^Done [0-9]* runs' "$log" | tail -1 | grep -o '[0-9][0-9]*' || echo "?")
  if [ "$status" -ne 0 ] && [ "$crashes$timeouts$ooms" = "000" ]; then
    echo "$t: cargo fuzz failed (exit $status), see $log" >&2
    failed=1
  fi
  if [ "$crashes$timeouts$ooms" != "000" ]; then
    failed=1
    grep -m1 -A3 "panicked at" "$log" || true
  fi
  printf '%-14s %6s %12s %8s %9s %5s  %s\n' "$t" "$seconds" "$execs" "$crashes" "$timeouts" \
    "$ooms" "$(echo $new)" >>"$report"
  if [ "${FUZZ_MERGE:-0}" = 1 ]; then
    minimize "$t" "$work"
  fi
done
echo
cat "$report"
exit "$failed"
