#!/bin/sh
# run.sh: builds the libFuzzer targets of tests/fuzz with clang and runs each for a while.
#
# usage: tests/fuzz/run.sh [build-dir] [seconds-per-target] [target...]
#   build-dir            where binaries, objects and the working corpora go (default build-fuzz)
#   seconds-per-target   -max_total_time of each run (default 30; the long tier uses 3600)
#   target...            a subset of the targets (default: all)
# Environment: CC (default clang), FUZZ_JOBS (parallel fuzzing processes per target, default 1),
#   FUZZ_BUILD_ONLY=1 (build, do not run).
# The committed seed corpus (tests/fuzz/corpus/<target>) is copied into build-dir/corpus/<target>
# and libFuzzer adds what it finds there; crash inputs land in build-dir/crashes/<target>/.
# Exit status: 0 when every target ran without a crash, 1 on a crash, 2 on a build failure.
set -u

here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
out=${1:-build-fuzz}
secs=${2:-30}
[ $# -ge 2 ] && shift 2 || shift $#
targets=${*:-"resp wal_replay checkpoint superblock"}
cc=${CC:-clang}
jobs=${FUZZ_JOBS:-1}

mkdir -p "$out/obj" "$out/corpus" "$out/crashes" || exit 2
out=$(cd "$out" && pwd)

cflags="-std=c11 -D_GNU_SOURCE -g -O1 -fno-omit-frame-pointer -Wall -Wextra -Wno-unused-parameter
        -fsanitize=address,undefined -fno-sanitize-recover=all
        -I$root/include -I$root/src -I$root/src/server"
libs="-luring -lxxhash -llz4 -lpthread -lm"

# The engine: every src/*.c, instrumented for coverage.
engine_objs=""
for src in "$root"/src/*.c; do
    obj="$out/obj/$(basename "$src" .c).o"
    $cc $cflags -fsanitize=fuzzer-no-link -c "$src" -o "$obj" || exit 2
    engine_objs="$engine_objs $obj"
done
$cc $cflags -fsanitize=fuzzer-no-link -c "$root/src/server/resp.c" -o "$out/obj/resp.o" || exit 2
$cc $cflags -fsanitize=fuzzer-no-link -c "$here/fuzz_store.c" -o "$out/obj/fuzz_store.o" || exit 2

for t in $targets; do
    case $t in
    resp) objs="$out/obj/resp.o" ;;
    *) objs="$engine_objs $out/obj/fuzz_store.o" ;;
    esac
    $cc $cflags -fsanitize=fuzzer "$here/fuzz_$t.c" $objs $libs -o "$out/fuzz_$t" || exit 2
done
echo "run.sh: built $targets in $out"
[ "${FUZZ_BUILD_ONLY:-0}" = 1 ] && exit 0

status=0
for t in $targets; do
    corpus="$out/corpus/$t"
    crashes="$out/crashes/$t"
    mkdir -p "$corpus" "$crashes"
    [ -d "$here/corpus/$t" ] && cp -n "$here/corpus/$t"/* "$corpus"/ 2>/dev/null
    dict=""
    [ -f "$here/fuzz_$t.dict" ] && dict="-dict=$here/fuzz_$t.dict"
    echo "run.sh: fuzz_$t for ${secs}s"
    # halt_on_error etc. are set by -fno-sanitize-recover; detect_leaks stays on.
    if [ "$jobs" -gt 1 ]; then
        par="-fork=$jobs -ignore_crashes=0"
    else
        par=""
    fi
    ASAN_OPTIONS=${ASAN_OPTIONS:-abort_on_error=1:detect_leaks=1} \
    UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1} \
        "$out/fuzz_$t" $par $dict -max_total_time="$secs" -timeout=20 -rss_limit_mb=4096 \
        -max_len=65536 -print_final_stats=1 -artifact_prefix="$crashes/" "$corpus" \
        >"$out/fuzz_$t.log" 2>&1
    rc=$?
    tail -n 20 "$out/fuzz_$t.log" | grep -E "stat::number_of_executed_units|stat::new_units_added" \
        | sed "s/^/run.sh: fuzz_$t /"
    if [ $rc -ne 0 ] || ls "$crashes" | grep -q .; then
        echo "run.sh: fuzz_$t FAILED (exit $rc); inputs in $crashes, log in $out/fuzz_$t.log"
        grep -m 3 -E "ERROR|SUMMARY|assertion failed|fuzz_[a-z_]+:" "$out/fuzz_$t.log" \
            | sed "s/^/run.sh:   /"
        status=1
    fi
done
exit $status
