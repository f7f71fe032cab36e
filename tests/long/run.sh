#!/usr/bin/env bash
# tests/long/run.sh: the long tier. Runs each randomised, crash, kill and fuzz suite with its full
# counts, each under a time limit, and writes the figures (seeds and cycles run, crash states
# checked, violations, fuzz hours, durations) to tests/long/results-<date>.txt as a table that
# docs/reliability.md quotes. --scale S multiplies every count and time (0.01 is a dry run).
#
# usage: tests/long/run.sh [--scale S] [--build-type Asan|Debug|Release] [--build-dir DIR]
#                          [--results FILE] [--only a,b] [--skip a,b] [--seed N] [--jobs N]
# Suites (names for --only/--skip), their full counts and time limits at scale 1:
#   power_loss  test_crash crash/power_loss*: 20,000 seeds (simulated disk, power lost)   2 h
#   kill9       test_crash crash/kill9*: 10,000 kill -9 cycles of a child process        4 h
#   compact     test_compact compact/crashes*: 5,000 crashes during compaction           2 h
#   crashstates test_crashstates crashstates/every*: 1,300 seeds, about 1.1 M crash states
#               (every persistence point of a small workload on the real I/O path, rebuilt
#               with prefixes and subsets of the unsynced writes, opened and checked)     2 h
#   threads     test_threads with IDEM_LONG=1 (the three model tests: 50,000 / 200,000 /
#               50,000 steps; hot-key races 200 rounds; 2,000 keys per thread)           1 h
#   index       test_index with IDEM_LONG=1 (5 M random operations, 10 M keys, the
#               2^24-entry directory)                                                    1 h
#   arena       test_index_arena with IDEM_LONG=1 (5 M random allocations and frees,
#               invariants checked every 997)                                            1 h
#   abuse       test_abuse with IDEM_LONG=1, when tests/test_abuse.c exists               2 h
#   kill9_idemd tests/scripts/test_kill9.sh with KILL_CYCLES=10000, when it exists      12 h
#               (2.4-3.1 s a cycle with the checks the loop has grown, a model of 50,000
#               keys and restarts of 0.5-1.5 s; 0.8 s in the sixteenth session)
#   cmd_fuzz    tests/scripts/test_cmd_fuzz.sh: random commands against idemd, two runs of
#               30 min (CMD_FUZZ_SECONDS=1800), when it exists                         1 h 10 min
#   wire_model  tests/scripts/test_wire_model.sh: the contract's model over the wire, three
#               settings of 300,000 steps (WIRE_MODEL_STEPS), when it exists          35 min
#   fuzz        tests/fuzz/run.sh, one hour per target, when it exists      targets h + 30 min
# The seeded crash suites (power_loss, kill9, compact, crashstates) run as chunks of the CI count
# each: chunk k is the test binary with IDEM_SEED=<base>+k*<CI count>, so the chunks together run
# exactly the seeds <base>..<base>+n-1 that one IDEM_LONG=1 run with IDEM_SEED=<base> would, but
# no process outlives the test's own criterion timeout (300 s, less than a full long run), a
# violation in one chunk does not hide the seeds after it, and the time limit stops between
# chunks. The other suites run once with IDEM_LONG=1 (at --scale below 1: once with the CI
# counts).
# Exit status: 0 when every suite that ran passed, 1 otherwise, 2 on a build failure.
set -uo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
scale=1
build_type=Asan
build=""
results=""
only=""
skip=""
seed_base=""
jobs=2
while [ $# -gt 0 ]; do
  case $1 in
    --scale) scale=$2; shift 2 ;;
    --build-type) build_type=$2; shift 2 ;;
    --build-dir) build=$2; shift 2 ;;
    --results) results=$2; shift 2 ;;
    --only) only=",$2,"; shift 2 ;;
    --skip) skip=",$2,"; shift 2 ;;
    --seed) seed_base=$2; shift 2 ;;
    --jobs) jobs=$2; shift 2 ;;
    -h|--help) sed -n '2,30p' "$0"; exit 0 ;;
    *) echo "long/run.sh: unknown argument $1" >&2; exit 2 ;;
  esac
done
awk -v s="$scale" 'BEGIN { exit !(s + 0 > 0 && s + 0 <= 100) }' \
  || { echo "long/run.sh: --scale must be a number in (0, 100]" >&2; exit 2; }
full=$(awk -v s="$scale" 'BEGIN { print (s + 0 >= 1) ? 1 : 0 }')
[ -n "$build" ] || build=build-long-$(echo "$build_type" | tr 'A-Z' 'a-z')
case $build in /*) ;; *) build=$root/$build ;; esac
day=$(date -u +%Y-%m-%d)
if [ -z "$results" ]; then
  if [ "$full" = 1 ]; then results=$root/tests/long/results-$day.txt
  else results=$root/tests/long/results-$day-scale$scale.txt; fi
fi
logs=$build/long-logs
mkdir -p "$logs"
rm -f "$logs"/*.log "$logs/fuzz-stats.txt"   # nothing from an earlier run is counted
if [ -z "$seed_base" ]; then
  # 40 random bits: room for every chunk's seed, short enough to read.
  seed_base=$(( $(od -An -N4 -tu4 /dev/urandom) * 256 + RANDOM % 256 ))
fi

scaled() { # count -> count * scale, rounded, at least 1
  awk -v n="$1" -v s="$scale" 'BEGIN { c = int(n * s + 0.5); print c < 1 ? 1 : c }'
}
limit_of() { # seconds at scale 1 -> scaled, at least 120 s
  awk -v n="$1" -v s="$scale" 'BEGIN { c = int(n * s + 0.5); print c < 120 ? 120 : c }'
}
want() { # suite name -> 0 when it is to run
  [ -n "$only" ] && [[ $only != *",$1,"* ]] && return 1
  [[ $skip == *",$1,"* ]] && return 1
  return 0
}
hms() { printf '%dh%02dm%02ds' $(($1 / 3600)) $(($1 % 3600 / 60)) $(($1 % 60)); }

echo "== long tier: scale $scale, $build_type build in $build, seed base $seed_base"
"$root/tools/install-deps.sh" || exit 2
cmake -S "$root" -B "$build" -DCMAKE_BUILD_TYPE="$build_type" -DIDEM_BENCH=OFF >/dev/null || exit 2
cmake --build "$build" -j"$jobs" >"$logs/build.log" 2>&1 \
  || { tail -30 "$logs/build.log"; echo "long/run.sh: build failed" >&2; exit 2; }
export IDEM_BUILD_DIR=$build IDEM_SOURCE_DIR=$root
export LSAN_OPTIONS=suppressions=$root/tests/lsan.supp
unset IDEM_LONG IDEM_SEED IDEM_IO_BACKEND

rows=()    # result table rows
notes=()   # failures and how to replay them
status=0
t_all=$(date +%s)

# Classifies one criterion log: pass, violation (a failed assertion), timeout, crash or error.
classify() { # log exit-status
  if grep -q "Assertion Failed" "$1"; then echo violation
  elif grep -q "Timed out" "$1" || [ "$2" = 124 ] || [ "$2" = 137 ]; then echo timeout
  elif grep -qE "CRASH|Unexpected signal|AddressSanitizer|runtime error:" "$1"; then echo crash
  elif [ "$2" = 0 ] && grep -qE "Synthesis: Tested: [1-9][0-9]* \| Passing: [1-9]" "$1"; then echo pass
  else echo error; fi
}

# A seeded crash suite in chunks of the CI count (see the header). With states_re (a sed -E
# script printing a number), the crash states checked are the sum of what it prints from each
# chunk's log, else one per passing seed.
#   name binary filter ci_count long_count unit limit_s what [states_re]
run_chunked() {
  local name=$1 bin=$2 filter=$3 ci=$4 long=$5 unit=$6 limit=$7 what=$8 states_re=${9:-}
  want "$name" || return 0
  local states=0 n
  local target chunks start now left k seed log rc kind
  target=$(scaled "$long")
  chunks=$(( (target + ci - 1) / ci ))
  limit=$(limit_of "$limit")
  local base=$(( seed_base + ${#rows[@]} * 1000000 ))
  local ok=0 viol=0 tout=0 crash=0 err=0 done_chunks=0 stopped=""
  start=$(date +%s)
  echo "== $name: $target $unit in $chunks chunks of $ci (limit $(hms "$limit")), seeds from $base"
  for (( k = 0; k < chunks; k++ )); do
    now=$(date +%s)
    left=$(( limit - (now - start) ))
    if [ $left -le 0 ]; then stopped=" (time limit after $done_chunks chunks)"; break; fi
    seed=$(( base + k * ci ))
    log=$logs/$name-$k.log
    IDEM_SEED=$seed timeout -k 10 $(( left + 30 )) "$build/$bin" --filter "$filter" --jobs 1 \
      >"$log" 2>&1
    rc=$?
    kind=$(classify "$log" $rc)
    done_chunks=$((done_chunks + 1))
    if [ -n "$states_re" ]; then
      n=$(sed -nE "$states_re" "$log" | tail -1)
      states=$((states + ${n:-0}))
    fi
    case $kind in
      pass) ok=$((ok + 1)); rm -f "$log" ;;
      violation) viol=$((viol + 1)) ;;
      timeout) tout=$((tout + 1)) ;;
      crash) crash=$((crash + 1)) ;;
      *) err=$((err + 1)) ;;
    esac
    if [ "$kind" != pass ]; then
      notes+=("$name chunk $k ($kind): replay with IDEM_SEED=$seed $bin --filter '$filter'" \
              " (runs $ci $unit from $seed); log $log:" \
              "$(grep -m 4 -E -A2 'Assertion Failed|Timed out|CRASH|ERROR|runtime error' "$log" \
                 | sed 's/^/      /')")
      echo "   chunk $k: $kind (log $log)"
    fi
    if (( (k + 1) % 10 == 0 )); then echo "   $((k + 1))/$chunks chunks, $((ok * ci)) $unit passed"; fi
  done
  local dur=$(( $(date +%s) - start ))
  local bad=$((viol + tout + crash + err))
  local verdict=pass
  [ $bad -gt 0 ] && { verdict=FAIL; status=1; }
  [ -n "$stopped" ] && verdict="$verdict, stopped"
  [ -n "$states_re" ] || states=$((ok * ci))
  rows+=("| $name | $what | $target | $((ok * ci)) of $((done_chunks * ci))$stopped | $states | $viol | $((tout + crash + err)) | $(hms "$dur") | $verdict |")
  echo "   $name: $((ok * ci)) $unit passed, $states crash states, violations $viol, timeouts/crashes/errors $((tout + crash + err)), $(hms "$dur")"
}

# A whole criterion binary: IDEM_LONG=1 at full scale, the CI counts below it.
#   name binary limit_s what_full what_ci
run_binary() {
  local name=$1 bin=$2 limit=$3 what_full=$4 what_ci=$5
  want "$name" || return 0
  if [ ! -x "$build/$bin" ]; then
    rows+=("| $name | not in this tree (tests/$bin.c) | - | - | - | - | - | - | not run |")
    echo "== $name: $bin not in this tree, skipped"
    return 0
  fi
  limit=$(limit_of "$limit")
  local log=$logs/$name.log start rc kind what tests passing
  start=$(date +%s)
  if [ "$full" = 1 ]; then what=$what_full; else what=$what_ci; fi
  echo "== $name: $bin ($what), limit $(hms "$limit")"
  if [ "$full" = 1 ]; then
    IDEM_LONG=1 timeout -k 10 "$limit" "$build/$bin" --jobs "$jobs" >"$log" 2>&1
  else
    timeout -k 10 "$limit" "$build/$bin" --jobs "$jobs" >"$log" 2>&1
  fi
  rc=$?
  kind=$(classify "$log" $rc)
  local dur=$(( $(date +%s) - start ))
  tests=$(sed -nE 's/.*Synthesis: Tested: ([0-9]+).*/\1/p' "$log" | tail -1)
  passing=$(sed -nE 's/.*Passing: ([0-9]+).*/\1/p' "$log" | tail -1)
  local failing=$(( ${tests:-0} - ${passing:-0} ))
  local viol=0 other=0
  if [ "$kind" != pass ]; then
    status=1
    [ "$kind" = violation ] && viol=$(grep -c "Assertion Failed" "$log") || other=1
    local seeds
    seeds=$(grep -E "seed [0-9]+" "$log" | sed -E 's/.*: seed ([0-9]+).*/\1/' | sort -u | tr '\n' ' ')
    notes+=("$name ($kind, $failing of ${tests:-?} tests failed): seeds printed: $seeds; log $log:" \
            "$(grep -m 4 -E -A2 'Assertion Failed|Timed out|CRASH|ERROR|runtime error' "$log" \
               | sed 's/^/      /')")
  fi
  rows+=("| $name | $what | ${tests:-?} tests | ${passing:-0} passed | - | $viol | $other | $(hms "$dur") | $([ "$kind" = pass ] && echo pass || echo "FAIL ($kind)") |")
  echo "   $name: ${passing:-0} of ${tests:-?} tests passed ($kind), $(hms "$dur")"
}

# tests/scripts/test_kill9.sh: kill -9 of idemd under load, when it exists.
run_kill9_idemd() {
  want kill9_idemd || return 0
  local script=$root/tests/scripts/test_kill9.sh
  if [ ! -f "$script" ]; then
    rows+=("| kill9_idemd | not in this tree (tests/scripts/test_kill9.sh) | - | - | - | - | - | - | not run |")
    echo "== kill9_idemd: tests/scripts/test_kill9.sh not in this tree, skipped"
    return 0
  fi
  local cycles limit log=$logs/kill9_idemd.log start rc
  cycles=$(scaled 10000)
  limit=$(limit_of 43200)
  echo "== kill9_idemd: KILL_CYCLES=$cycles, limit $(hms "$limit")"
  start=$(date +%s)
  KILL_CYCLES=$cycles timeout -k 10 "$limit" bash "$script" >"$log" 2>&1
  rc=$?
  local dur=$(( $(date +%s) - start )) verdict=pass
  if [ $rc -ne 0 ]; then
    status=1
    verdict="FAIL (exit $rc)"
    notes+=("kill9_idemd (exit $rc): log $log:" "$(tail -5 "$log" | sed 's/^/      /')")
  fi
  rows+=("| kill9_idemd | kill -9 of idemd under load | $cycles cycles | $([ $rc = 0 ] && echo "$cycles" || echo "see log") | $([ $rc = 0 ] && echo "$cycles" || echo -) | $([ $rc = 0 ] && echo 0 || echo "see log") | - | $(hms "$dur") | $verdict |")
  echo "   kill9_idemd: exit $rc, $(hms "$dur")"
}

# A suite's script, when this tree has it; else its row says so (returns 1).
suite_script() { # name path
  [ -f "$2" ] && return 0
  rows+=("| $1 | not in this tree (${2#"$root"/}) | - | - | - | - | - | - | not run |")
  echo "== $1: ${2#"$root"/} not in this tree, skipped"
  return 1
}

# A seeded script that failed: the run's status, the caller's verdict, and notes with the seeds
# its log printed.
seeded_failure() { # name rc log how-to-replay
  status=1
  verdict="FAIL (exit $2)"
  notes+=("$1 (exit $2): replay with the seed it printed ($4); log $3:" \
          "$(grep -E 'seed|FAIL' "$3" | head -8 | sed 's/^/      /')")
}

# tests/scripts/test_cmd_fuzz.sh: random commands against idemd, when it exists.
run_cmd_fuzz() {
  want cmd_fuzz || return 0
  local script=$root/tests/scripts/test_cmd_fuzz.sh
  suite_script cmd_fuzz "$script" || return 0
  local secs limit log=$logs/cmd_fuzz.log start rc requests seed
  seed=$(( seed_base + ${#rows[@]} * 1000000 ))
  secs=$(awk -v s="$scale" 'BEGIN { c = int(1800 * s + 0.5); print c < 10 ? 10 : c }')
  limit=$(( 2 * (secs + 150) + 60 ))
  echo "== cmd_fuzz: two runs of ${secs}s, seeds $seed and $((seed + 1)), limit $(hms "$limit")"
  start=$(date +%s)
  CMD_FUZZ_SECONDS=$secs CMD_FUZZ_SEED=$seed timeout -k 10 "$limit" bash "$script" >"$log" 2>&1
  rc=$?
  local dur=$(( $(date +%s) - start )) verdict=pass
  requests=$(sed -nE 's/^cmd_fuzz: ([0-9]+) requests.*/\1/p' "$log" | awk '{ s += $1 } END { print s + 0 }')
  [ $rc -eq 0 ] || seeded_failure cmd_fuzz $rc "$log" CMD_FUZZ_SEED
  rows+=("| cmd_fuzz | random commands against idemd, 2 x ${secs}s | 2 runs | $requests requests | - | $([ $rc = 0 ] && echo 0 || echo "see notes") | - | $(hms "$dur") | $verdict |")
  echo "   cmd_fuzz: $requests requests, exit $rc, $(hms "$dur")"
}

# tests/scripts/test_wire_model.sh: the contract's model over the wire, when it exists.
run_wire_model() {
  want wire_model || return 0
  local script=$root/tests/scripts/test_wire_model.sh
  suite_script wire_model "$script" || return 0
  local steps limit log=$logs/wire_model.log start rc seed restarts
  seed=$(( seed_base + ${#rows[@]} * 1000000 ))
  steps=$(scaled 300000)
  limit=$(( 3 * (60 + steps / 40) + 60 ))
  echo "== wire_model: three settings of $steps steps, seeds from $seed, limit $(hms "$limit")"
  start=$(date +%s)
  WIRE_MODEL_STEPS=$steps WIRE_MODEL_SEED=$seed timeout -k 10 "$limit" bash "$script" >"$log" 2>&1
  rc=$?
  local dur=$(( $(date +%s) - start )) verdict=pass
  restarts=$(sed -nE 's/^wire_model: [0-9]+ steps, ([0-9]+) restarts.*/\1/p' "$log" | awk '{ s += $1 } END { print s + 0 }')
  [ $rc -eq 0 ] || seeded_failure wire_model $rc "$log" "wire_model.py --seed"
  rows+=("| wire_model | the contract's model over the wire, 3 settings x $steps steps | 3 runs | $((3 * steps)) steps, $restarts restarts | - | $([ $rc = 0 ] && echo 0 || echo "see notes") | - | $(hms "$dur") | $verdict |")
  echo "   wire_model: $((3 * steps)) steps, $restarts restarts, exit $rc, $(hms "$dur")"
}

# tests/fuzz/run.sh: every libFuzzer target for an hour (scaled), when it exists.
run_fuzz() {
  want fuzz || return 0
  local script=$root/tests/fuzz/run.sh
  if [ ! -f "$script" ]; then
    rows+=("| fuzz | not in this tree (tests/fuzz/run.sh) | - | - | - | - | - | - | not run |")
    return 0
  fi
  local secs ntargets limit log=$logs/fuzz.log start rc
  secs=$(awk -v s="$scale" 'BEGIN { c = int(3600 * s + 0.5); print c < 10 ? 10 : c }')
  ntargets=$(ls "$root"/tests/fuzz/fuzz_*.c | grep -vc fuzz_store.c)
  limit=$(( ntargets * (secs + 60) + 1800 ))
  echo "== fuzz: $ntargets targets, ${secs}s each, limit $(hms "$limit")"
  start=$(date +%s)
  timeout -k 30 "$limit" sh "$script" "$build/fuzz" "$secs" >"$log" 2>&1
  rc=$?
  local dur=$(( $(date +%s) - start ))
  local execs
  execs=$(sed -nE 's/.*stat::number_of_executed_units: *([0-9]+).*/\1/p' "$log" \
          | awk '{ s += $1 } END { print s + 0 }')
  local hours
  hours=$(awk -v t="$ntargets" -v s="$secs" 'BEGIN { printf "%.2f", t * s / 3600 }')
  local verdict=pass
  if [ $rc -ne 0 ]; then
    status=1
    verdict="FAIL (exit $rc)"
    notes+=("fuzz (exit $rc): crash inputs in $build/fuzz/crashes; log $log:" \
            "$(grep -E 'FAILED|run.sh:   ' "$log" | head -8 | sed 's/^/      /')")
  fi
  sed -nE 's/^run.sh: (fuzz_[a-z_]+) stat::(number_of_executed_units|new_units_added): *([0-9]+)/\1 \2 \3/p' \
    "$log" >"$logs/fuzz-stats.txt"
  rows+=("| fuzz | libFuzzer, $ntargets targets x ${secs}s ($hours target-hours) | $ntargets targets | $execs inputs | - | $([ $rc = 0 ] && echo 0 || echo "see notes") | - | $(hms "$dur") | $verdict |")
  echo "   fuzz: $execs inputs over $hours target-hours, exit $rc, $(hms "$dur")"
}

ci_or_long() { [ "$full" = 1 ] && echo "$2" || echo "$1"; }

run_chunked power_loss test_crash 'crash/power_loss*' 150 20000 seeds 7200 \
  "power loss on the simulated disk (seeds; 1 crash state each)"
run_chunked kill9 test_crash 'crash/kill9*' 12 10000 cycles 14400 \
  "kill -9 of a child process on a real directory (cycles)"
run_chunked compact test_compact 'compact/crashes*' 40 5000 seeds 7200 \
  "crashes during compaction (seeds; 1 crash state each)"
run_chunked crashstates test_crashstates 'crashstates/every*' 10 1300 seeds 7200 \
  "crash states of a small workload on the real I/O path (seeds; ~1,000 states each)" \
  's/^crashstates: ([0-9]+) states$/\1/p'
run_binary threads test_threads 3600 \
  "IDEM_LONG=1: model 50,000 + 200,000 + 50,000 steps, races" \
  "CI counts: model 1,500 + 4,000 + 2,000 steps, races"
run_binary index test_index 3600 \
  "IDEM_LONG=1: 5 M random ops, 10 M keys, 2^24 directory" \
  "CI counts: 200,000 random ops, 1 M keys"
run_binary arena test_index_arena 3600 \
  "IDEM_LONG=1: 5 M random allocs and frees" \
  "CI counts: 200,000 random allocs and frees"
run_binary abuse test_abuse 7200 "IDEM_LONG=1" "CI counts"
run_kill9_idemd
run_cmd_fuzz
run_wire_model
run_fuzz

total=$(( $(date +%s) - t_all ))
{
  echo "# idem long tier results"
  echo
  if [ "$full" = 1 ]; then
    echo "Long tier at scale $scale."
  else
    echo "DRY RUN at scale $scale: counts and times divided; these are not long-tier figures."
  fi
  echo
  echo "- commit: $(git -C "$root" rev-parse --short HEAD)$(git -C "$root" diff --quiet HEAD -- src include tests || echo ' (with local changes)')"
  echo "- date (UTC): $(date -u '+%Y-%m-%d %H:%M')"
  echo "- command: tests/long/run.sh --scale $scale --build-type $build_type --seed $seed_base${only:+ --only ${only:1:-1}}${skip:+ --skip ${skip:1:-1}}"
  echo "- build: $build_type; machine: $(nproc) CPUs, Linux $(uname -r)"
  echo "- seed base: $seed_base (suite i's chunks start at base + i * 1000000)"
  echo "- total duration: $(hms "$total")"
  echo
  echo "| suite | what | target | run (passed of attempted) | crash states checked | violations | timeouts/crashes/errors | duration | verdict |"
  echo "|---|---|---|---|---|---|---|---|---|"
  printf '%s\n' "${rows[@]}"
  echo
  if [ -s "$logs/fuzz-stats.txt" ]; then
    echo "Fuzz targets (inputs executed, new corpus units):"
    echo
    awk '{ v[$1 " " $2] = $3; t[$1] = 1 } END { for (k in t) printf "- %s: %s inputs, %s new units\n", k, v[k " number_of_executed_units"], v[k " new_units_added"] }' \
      "$logs/fuzz-stats.txt" | sort
    echo
  fi
  if [ ${#notes[@]} -gt 0 ]; then
    echo "Failures:"
    echo
    printf '%s\n' "${notes[@]}"
  else
    echo "No failures."
  fi
} | sed "s#$root/##g" >"$results"   # paths relative to the source tree
echo "== long tier done in $(hms "$total"), exit $status; results in $results"
cat "$results"
exit $status
