#!/usr/bin/env bash
# The CI-tier test suite: builds Debug, Asan (ASan + UBSan) and Release (which warns about what
# only the optimiser sees) and runs every test binary in each through ctest (each binary has a
# timeout). Reduced counts; IDEM_LONG=1 selects the long
# tier's counts (see docs/reliability.md). Usage: tests/run.sh [ctest args...]
set -euo pipefail
cd "$(dirname "$0")/.."
./tools/install-deps.sh
jobs=$(nproc)
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
  (cd "$dir" && ctest --output-on-failure --timeout 900 "${select[@]}" "$@")
done
# The criterion tests once more on the other real I/O backend (pwrite + fdatasync), and the
# kill -9 loop, whose idemd then flushes with fdatasync.
echo "== Debug tests on the thread I/O backend"
(cd build-debug && IDEM_IO_BACKEND=thread ctest --output-on-failure --timeout 900 -LE script "$@")
(cd build-debug && IDEM_IO_BACKEND=thread ctest --output-on-failure --timeout 900 -R '^test_kill9$' "$@")
