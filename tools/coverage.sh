#!/usr/bin/env bash
# coverage.sh: line coverage of src/ by the CI tier. Builds Debug with gcc --coverage in its own
# build directory (build-coverage), runs the CI tier's ctest there (the default I/O backend, then
# again with IDEM_IO_BACKEND=thread, as tests/run.sh does), and reports line coverage of the engine
# (src/*.c), the server (src/server/*.c) and both together with gcovr (installed from Debian if
# missing). Prints one line `coverage src/: NN.N% lines` and writes per-file tables.
#
# usage: tools/coverage.sh [--build-dir DIR] [--jobs N] [--no-test] [--no-thread] [-- ctest args]
#   --build-dir DIR  build directory (default build-coverage)
#   --jobs N         make and ctest parallelism (default 2: the machine is shared)
#   --no-test        only (re)compute the report from the .gcda files already there
#   --no-thread      skip the second ctest pass on the thread backend
# Output in DIR/coverage/: summary.txt (the figures), engine.txt, server.txt, src.txt, tools.txt
# (gcovr per-file tables with the missing line ranges), src.html (annotated sources), and
# ctest.log. Exit status: that of ctest (the report is written even when a test failed).
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build=build-coverage
jobs=2
run_tests=1
thread=1
while [ $# -gt 0 ]; do
  case $1 in
    --build-dir) build=$2; shift 2 ;;
    --jobs) jobs=$2; shift 2 ;;
    --no-test) run_tests=0; shift ;;
    --no-thread) thread=0; shift ;;
    --) shift; break ;;
    -h|--help) sed -n '2,16p' "$0"; exit 0 ;;
    *) echo "coverage.sh: unknown argument $1" >&2; exit 2 ;;
  esac
done
case $build in /*) ;; *) build=$root/$build ;; esac

if ! command -v gcovr >/dev/null 2>&1; then
  sudo=""
  [ "$(id -u)" -eq 0 ] || sudo="sudo"
  $sudo apt-get update -qq && DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq gcovr \
    || { echo "coverage.sh: gcovr missing and could not be installed" >&2; exit 2; }
fi

out=$build/coverage
status=0
if [ $run_tests = 1 ]; then
  "$root/tools/install-deps.sh"
  # The Coverage build type (-O0 so that lines map to code, atomic counters: the engine's
  # flusher and the tests' threads update them concurrently); benchmarks are not in the tier.
  cmake -S "$root" -B "$build" -DCMAKE_BUILD_TYPE=Coverage -DIDEM_BENCH=OFF >/dev/null || exit 2
  cmake --build "$build" -j"$jobs" >/dev/null || { echo "coverage.sh: build failed" >&2; exit 2; }
  # Counters from an earlier run would be added to this one.
  find "$build" -name '*.gcda' -delete
  mkdir -p "$out"
  start=$(date +%s)
  (cd "$build" && ctest -j"$jobs" --output-on-failure --timeout 900 "$@") >"$out/ctest.log" 2>&1
  status=$?
  if [ $thread = 1 ]; then
    (cd "$build" && IDEM_IO_BACKEND=thread ctest -j"$jobs" --output-on-failure --timeout 900 "$@") \
      >>"$out/ctest.log" 2>&1
    rc=$?
    [ $rc -ne 0 ] && status=$rc
  fi
  echo "coverage.sh: ctest took $(( $(date +%s) - start ))s, exit $status (log in $out/ctest.log)"
  grep -E "tests passed|tests failed|\*\*\*Failed|\*\*\*Timeout" "$out/ctest.log" | sed 's/^/coverage.sh:   /'
fi
mkdir -p "$out"

# One gcov pass, kept as JSON, then filtered four ways (paths are regexes on the absolute path).
# CMake's compiler probe (CMakeFiles/<version>/CompilerIdC) is left out.
gcovr -r "$root" --object-directory "$build" -j"$jobs" \
  --exclude-directories "$build/CMakeFiles/[0-9][^/]*" \
  --filter "$root/src/" --filter "$root/tools/" --json "$out/all.json" || exit 2
report() { # name, filter regex...
  local name=$1; shift
  local f=()
  for re in "$@"; do f+=(--filter "$re"); done
  gcovr -r "$root" -a "$out/all.json" "${f[@]}" --txt "$out/$name.txt" \
    --json-summary "$out/$name.summary.json" >/dev/null
}
report engine "$root/src/[^/]*\.c$"
report server "$root/src/server/"
report src "$root/src/"
report tools "$root/tools/"
gcovr -r "$root" -a "$out/all.json" --filter "$root/src/" --html-details "$out/src.html" >/dev/null

pct() { # summary json -> "NN.N% lines (covered/total)"
  python3 -c 'import json,sys; d=json.load(open(sys.argv[1]));
c,t=d["line_covered"],d["line_total"]; print("%.1f%% lines (%d/%d)" % (100.0*c/max(t,1),c,t))' "$1"
}
{
  echo "commit $(git -C "$root" rev-parse --short HEAD) on $(date -u +%Y-%m-%d)"
  echo "engine src/*.c:        $(pct "$out/engine.summary.json")"
  echo "server src/server/*.c: $(pct "$out/server.summary.json")"
  echo "idemctl tools/*.c:     $(pct "$out/tools.summary.json")"
  echo "least-covered files of src/ (lines not run):"
  python3 -c 'import json,sys; d=json.load(open(sys.argv[1]));
fs=sorted(d["files"], key=lambda f: f["line_percent"])
for f in fs[:8]: print("  %-26s %5.1f%%  %4d of %4d lines not run" % (f["filename"], f["line_percent"], f["line_total"]-f["line_covered"], f["line_total"]))' \
    "$out/src.summary.json"
  echo "coverage src/: $(python3 -c 'import json,sys; d=json.load(open(sys.argv[1])); print("%.1f" % (100.0*d["line_covered"]/max(d["line_total"],1)))' "$out/src.summary.json")% lines"
} >"$out/summary.txt"
cat "$out/summary.txt"
echo "coverage.sh: per-file tables in $out/{engine,server,src,tools}.txt, annotated sources in $out/src.html"
exit $status
