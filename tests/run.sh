#!/usr/bin/env bash
# The CI-tier test suite: builds Debug, Asan (ASan + UBSan) and Release (which warns about what
# only the optimiser sees) and runs every test binary in each through ctest (each binary has a
# timeout). Reduced counts; IDEM_LONG=1 selects the long
# tier's counts (see docs/reliability.md). A test that could not run (a tool or a kernel feature
# missing: ctest reports it skipped) fails the suite, since a test that did not run proves
# nothing; IDEM_ALLOW_SKIP=1 accepts skips. Usage: tests/run.sh [ctest args...]
set -euo pipefail
cd "$(dirname "$0")/.."
./tools/install-deps.sh
# The ioredis test's runtime, for the tests alone (a node that is there, from any source, is kept).
# Tried, not required: without it the ioredis test is skipped, which the check below reports.
if ! command -v node >/dev/null || ! command -v npm >/dev/null; then
  sudo=""
  [ "$(id -u)" -eq 0 ] || sudo="sudo"
  { $sudo apt-get update -qq && DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq nodejs npm; } ||
    echo "warning: node and npm could not be installed: the ioredis test will be skipped"
fi
jobs=$(nproc)
ctest_log=$(mktemp)
trap 'rm -f "$ctest_log"' EXIT
# ctest in directory $1 with the rest as its arguments; fails when a test was skipped.
run_ctest() {
  local dir=$1
  shift
  (cd "$dir" && ctest --output-on-failure --timeout 900 "$@") | tee "$ctest_log"
  if grep -qE "\*\*\*Skipped|\*\*\*Not Run" "$ctest_log" && [ "${IDEM_ALLOW_SKIP:-0}" != 1 ]; then
    echo "error: tests were skipped (above); install what they name, or set IDEM_ALLOW_SKIP=1"
    return 1
  fi
}
# Debug runs everything; Asan runs everything but the fuzz script (the fuzz targets carry their
# own sanitizers); Release runs the criterion binaries; the thread backend pass runs them again.
for type in Debug Asan Release; do
  dir=build-$(echo "$type" | tr 'A-Z' 'a-z')
  echo "== $type build in $dir"
  cmake -S . -B "$dir" -DCMAKE_BUILD_TYPE="$type" >/dev/null
  cmake --build "$dir" -j"$jobs"
  case $type in
    Debug) select=() ;;
    Asan) select=(-LE fuzz) ;;
    *) select=(-LE script) ;;
  esac
  echo "== $type tests"
  run_ctest "$dir" "${select[@]}" "$@"
done
# The criterion tests once more on the other real I/O backend (pwrite + fdatasync), and the
# kill -9 loop, whose idemd then flushes with fdatasync.
echo "== Debug tests on the thread I/O backend"
IDEM_IO_BACKEND=thread run_ctest build-debug -LE script "$@"
IDEM_IO_BACKEND=thread run_ctest build-debug -R '^test_kill9$' "$@"
