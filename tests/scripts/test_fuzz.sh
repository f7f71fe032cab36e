#!/usr/bin/env bash
# test_fuzz.sh: the fuzz targets in the CI tier. Builds them with clang and libFuzzer, replays
# every committed crash input (each a bug found and fixed: it must pass now), then fuzzes each
# target for FUZZ_SECONDS (default 15) from the committed corpus. Without clang: a skip line.
set -u
root=${IDEM_SOURCE_DIR:-$(cd "$(dirname "$0")/../.." && pwd)}
out=${IDEM_BUILD_DIR:-$root/build}/fuzz
secs=${FUZZ_SECONDS:-15}
if ! command -v clang >/dev/null 2>&1; then
  echo "clang is not installed: the fuzz targets cannot be built"
  echo "0 passed, 0 failed, 1 skipped"
  exit 77 # ctest: skipped
fi
mkdir -p "$out"
pass=0
fail=0
if ! FUZZ_BUILD_ONLY=1 sh "$root/tests/fuzz/run.sh" "$out" 1 >"$out/build.log" 2>&1; then
  cat "$out/build.log"
  echo "0 passed, 1 failed"
  exit 1
fi
for input in "$root"/tests/fuzz/crashes/*; do
  name=$(basename "$input")
  case $name in
    resp*) target=resp ;;
    superblock*) target=superblock ;;
    checkpoint*) target=checkpoint ;;
    wal*) target=wal_replay ;;
    *) continue ;;
  esac
  if timeout 120 "$out/fuzz_$target" "$input" >"$out/replay.log" 2>&1; then
    pass=$((pass + 1))
  else
    echo "FAIL: crash input $name ($target) fails again:"
    tail -n 30 "$out/replay.log"
    fail=$((fail + 1))
  fi
done
rm -rf "$out/crashes" # inputs of an earlier run are not this run's findings
if sh "$root/tests/fuzz/run.sh" "$out" "$secs" >"$out/run.log" 2>&1; then
  pass=$((pass + 1))
else
  echo "FAIL: fuzzing found a crash:"
  tail -n 40 "$out/run.log"
  fail=$((fail + 1))
fi
echo "$pass passed, $fail failed"
[ "$fail" -eq 0 ]
