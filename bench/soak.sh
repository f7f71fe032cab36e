#!/usr/bin/env bash
# Soak (issue 5): do idemd's memory and disk use stay flat under a steady stream of fresh keys
# with a TTL, i.e. are expired keys reclaimed as fast as new ones arrive?
#
# Starts idemd (durability sync, the default) on a temporary directory, listening on 127.0.0.1
# and its unix socket only, and drives it for --duration seconds at --rate claims/s with fresh
# keys and --ttl-ms, paced in 1-second slices by idem-soak-load (bench/soak_load.c, built next
# to idemd when hiredis is there) or else bench/soak_load.py (standard-library Python).
# The default workload is what a worker does: IDEM.CLAIM key ttl lease, then IDEM.COMMIT with
# the token, so each record is committed and expires ttl after its first claim. (`--workload
# claim` sends claims only: those records stay in_flight, which by the contract never expire, so
# memory and disk must grow; `--workload setnx` uses SET key v NX PX ttl.) The rate reached is
# reported; a 2-core machine may not reach 100 k claims/s, and that is said, not failed.
#
# Every 10 s it samples idemd's RSS (VmRSS, /proc/PID/status), its anonymous memory
# (Anonymous, /proc/PID/smaps_rollup), the store directory's size on disk (du -sk), and from
# IDEM.STATS: keys, expired_total, wal_bytes, memory_bytes (the index), compactions.
#
# Verdict rule: samples taken after a warm-up of 3 TTLs count (at least 6 of them are needed,
# else the verdict is "inconclusive", exit 2). Memory (RSS and anonymous) and disk (du) are
# flat when, for each of them, the mean of the last third of those samples is below 1.25 times
# the mean of the first third: a trend, not a swing (the live set rises and falls with the rate
# actually reached, and compaction catches up in steps). max/min is printed for information.
# Exit 0 when flat, 1 when any of them grows, 2 on usage errors or an inconclusive run.
#
# usage: bench/soak.sh [--duration SECONDS] [--rate N] [--ttl-ms MS] [--idemd PATH]
#                      [--workload claim-commit|claim|setnx] [--loaders N] [--lease-ms MS]
#                      [--interval S] [--out DIR] [--keep-data]
#   defaults: 7200 s, 100000 claims/s, 60000 ms, build-rel/idemd else build/idemd,
#   claim-commit, 2 loader processes (the rate is split between them), lease 30000 ms,
#   a sample every 10 s. Samples and logs go to --out (default a new temporary directory).
set -euo pipefail

HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(cd "$HERE/.." && pwd)
DURATION=7200
RATE=100000
TTL_MS=60000
LEASE_MS=30000
IDEMD=""
WORKLOAD=claim-commit
LOADERS=2
INTERVAL=10
OUT=""
KEEP=0
BAND=1.25

while [ $# -gt 0 ]; do
    case "$1" in
    --duration) DURATION=$2; shift ;;
    --rate) RATE=$2; shift ;;
    --ttl-ms) TTL_MS=$2; shift ;;
    --lease-ms) LEASE_MS=$2; shift ;;
    --idemd) IDEMD=$2; shift ;;
    --workload) WORKLOAD=$2; shift ;;
    --loaders) LOADERS=$2; shift ;;
    --interval) INTERVAL=$2; shift ;;
    --out) OUT=$2; shift ;;
    --keep-data) KEEP=1 ;;
    -h | --help) sed -n '2,/^set -euo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "unknown option $1" >&2; exit 2 ;;
    esac
    shift
done
for v in DURATION RATE TTL_MS LEASE_MS LOADERS INTERVAL; do
    case ${!v} in '' | *[!0-9]*) echo "$v must be a positive integer" >&2; exit 2 ;; esac
    [ "${!v}" -gt 0 ] || { echo "$v must be a positive integer" >&2; exit 2; }
done
case $WORKLOAD in claim-commit | claim | setnx) ;; *) echo "unknown workload $WORKLOAD" >&2; exit 2 ;; esac
if [ -z "$IDEMD" ]; then
    if [ -x "$ROOT/build-rel/idemd" ]; then IDEMD=$ROOT/build-rel/idemd; else IDEMD=$ROOT/build/idemd; fi
fi
[ -x "$IDEMD" ] || { echo "no idemd at $IDEMD (build it: cmake -S . -B build-rel -DCMAKE_BUILD_TYPE=Release -DIDEM_TESTS=OFF && cmake --build build-rel)" >&2; exit 2; }
command -v redis-cli >/dev/null || { echo "redis-cli missing (apt-get install redis-tools)" >&2; exit 2; }
command -v python3 >/dev/null || { echo "python3 missing" >&2; exit 2; }
# The C loader built next to idemd (idem-soak-load, hiredis) leaves idemd more of the CPU than
# the Python one; both take the same options and write the same logs.
if [ -x "$(dirname "$IDEMD")/idem-soak-load" ]; then
    LOADER=("$(dirname "$IDEMD")/idem-soak-load")
else
    LOADER=(python3 "$HERE/soak_load.py")
fi

log() { printf '%s %s\n' "$(date +%H:%M:%S)" "$*" >&2; }

TMP=$(mktemp -d /tmp/idem-soak.XXXXXX)
[ -n "$OUT" ] || OUT=$(mktemp -d /tmp/idem-soak-results.XXXXXX)
mkdir -p "$OUT"
DIR=$TMP/store
SOCK=$TMP/idemd.sock
IDEMD_PID=""
LOAD_PIDS=()

stop_pid() { # pid seconds: SIGTERM, wait, then SIGKILL; only this pid
    local pid=$1 t=$2 i=0
    kill -0 "$pid" 2>/dev/null || { wait "$pid" 2>/dev/null || true; return 0; }
    kill -TERM "$pid" 2>/dev/null || true
    while kill -0 "$pid" 2>/dev/null && [ $i -lt $((t * 10)) ]; do sleep 0.1; i=$((i + 1)); done
    if kill -0 "$pid" 2>/dev/null; then
        log "pid $pid still running after ${t}s: SIGKILL"
        kill -KILL "$pid" 2>/dev/null || true
    fi
    wait "$pid" 2>/dev/null || true
}
cleanup() {
    local rc=$?
    trap - EXIT INT TERM
    for p in "${LOAD_PIDS[@]}"; do stop_pid "$p" 5; done
    [ -z "$IDEMD_PID" ] || stop_pid "$IDEMD_PID" 60
    if [ "$KEEP" = 0 ]; then rm -rf "$TMP"; else log "store kept in $TMP"; fi
    exit $rc
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

PORT=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
"$IDEMD" --dir "$DIR" --socket "$SOCK" --bind 127.0.0.1 --port "$PORT" >"$OUT/idemd.log" 2>&1 &
IDEMD_PID=$!
i=0
until redis-cli -s "$SOCK" PING 2>/dev/null | grep -q PONG; do
    kill -0 "$IDEMD_PID" 2>/dev/null || { log "idemd died at start; see $OUT/idemd.log"; exit 2; }
    i=$((i + 1)); [ $i -lt 600 ] || { log "idemd not ready after 60s"; exit 2; }
    sleep 0.1
done

{
    echo "idemd=$("$IDEMD" --version 2>&1 | head -1)"
    echo "workload=$WORKLOAD rate=$RATE duration=$DURATION ttl_ms=$TTL_MS lease_ms=$LEASE_MS loaders=$LOADERS interval=$INTERVAL"
    echo "loader=${LOADER[*]}"
    echo "nproc=$(nproc) mem_total=$(awk '/MemTotal/ {print $2 " kB"}' /proc/meminfo) kernel=$(uname -r)"
    echo "load_start=$(cat /proc/loadavg)"
} >"$OUT/meta.txt"
log "idemd pid $IDEMD_PID on 127.0.0.1:$PORT; results in $OUT"
sed 's/^/  /' "$OUT/meta.txt" >&2

# ------------------------------------------------------------------ load
per=$((RATE / LOADERS)); extra=$((RATE % LOADERS))
for n in $(seq 1 "$LOADERS"); do
    r=$per; [ "$n" -le "$extra" ] && r=$((r + 1))
    timeout $((DURATION + 120)) "${LOADER[@]}" --port "$PORT" --rate "$r" \
        --duration "$DURATION" --ttl-ms "$TTL_MS" --lease-ms "$LEASE_MS" --workload "$WORKLOAD" \
        --log "$OUT/load$n.log" 2>"$OUT/load$n.err" &
    LOAD_PIDS+=($!)
done

# ------------------------------------------------------------------ samples
stat_of() { awk -v k="$1" '$1 == k {print $2}' "$2"; }
SAMPLES=$OUT/samples.tsv
printf 't_s\tclaims_s\trss_mb\tanon_mb\tdisk_mb\tkeys\texpired_total\twal_mb\tindex_mb\tcompactions\n' >"$SAMPLES"
loads_alive() { for p in "${LOAD_PIDS[@]}"; do kill -0 "$p" 2>/dev/null && return 0; done; return 1; }
claims_so_far() { cat "$OUT"/load*.log 2>/dev/null | awk '{s += $2} END {print s + 0}'; }
T0=$(date +%s.%N)
prev_claims=0
prev_t=0
k=1
while :; do
    next=$(python3 -c "print($T0 + $k * $INTERVAL)")
    while loads_alive && python3 -c "import sys,time; sys.exit(0 if time.time() < $next else 1)"; do sleep 0.5; done
    loads_alive || break
    kill -0 "$IDEMD_PID" 2>/dev/null || { log "idemd died; see $OUT/idemd.log"; exit 2; }
    t=$((k * INTERVAL))
    rss=$(awk '/^VmRSS:/ {print $2}' "/proc/$IDEMD_PID/status")
    anon=$(awk '/^Anonymous:/ {print $2}' "/proc/$IDEMD_PID/smaps_rollup")
    disk=$(du -sk "$DIR" | cut -f1)
    redis-cli -s "$SOCK" IDEM.STATS | tr -d '\r' | paste - - >"$TMP/stats"
    c=$(claims_so_far)
    printf '%d\t%d\t%.1f\t%.1f\t%.1f\t%s\t%s\t%.1f\t%.1f\t%s\n' "$t" $(((c - prev_claims) / (t - prev_t))) \
        "$(echo "$rss / 1024" | bc -l)" "$(echo "$anon / 1024" | bc -l)" "$(echo "$disk / 1024" | bc -l)" \
        "$(stat_of keys "$TMP/stats")" "$(stat_of expired_total "$TMP/stats")" \
        "$(echo "$(stat_of wal_bytes "$TMP/stats") / 1048576" | bc -l)" \
        "$(echo "$(stat_of memory_bytes "$TMP/stats") / 1048576" | bc -l)" \
        "$(stat_of compactions "$TMP/stats")" >>"$SAMPLES"
    tail -1 "$SAMPLES" | awk -F'\t' '{printf "t=%ss claims/s=%s rss=%sMB anon=%sMB disk=%sMB keys=%s expired=%s wal=%sMB compactions=%s\n", $1, $2, $3, $4, $5, $6, $7, $8, $10}' >&2
    prev_claims=$c
    prev_t=$t
    k=$((k + 1))
done
for p in "${LOAD_PIDS[@]}"; do wait "$p" || log "a loader exited with status $?"; done
LOAD_PIDS=()
cat "$OUT"/load*.err >&2 || true

# ------------------------------------------------------------------ report
echo
echo "# idemd soak: workload $WORKLOAD, target $RATE claims/s, ttl $TTL_MS ms, $DURATION s, $(nproc) cores"
column -t -s $'\t' "$SAMPLES"
echo
python3 - "$SAMPLES" "$OUT" "$RATE" "$TTL_MS" "$BAND" <<'EOF'
import glob, sys
samples, out, rate, ttl_ms, band = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), float(sys.argv[5])
per_s = {}
for f in glob.glob(out + "/load*.log"):
    for line in open(f):
        t, sent, new, other, err = map(int, line.split())
        a = per_s.setdefault(t, [0, 0, 0, 0])
        for i, v in enumerate((sent, new, other, err)):
            a[i] += v
secs = sorted(per_s)
tot = [sum(per_s[t][i] for t in secs) for i in range(4)]
reached = tot[0] / len(secs) if secs else 0
short = sum(1 for t in secs if per_s[t][0] < rate)
print("rate: target %d claims/s, reached %.0f claims/s on average (%d of %d seconds short of target); "
      "outcomes: new %d, other %d, errors %d" % (rate, reached, short, len(secs), tot[1], tot[2], tot[3]))
if reached < rate * 0.95:
    print("note: the target rate was not reached on this machine (load generator and idemd share its cores);"
          " the soak ran at the rate reached")
rows = [l.rstrip("\n").split("\t") for l in open(samples)]
hdr, rows = rows[0], rows[1:]
warm = 3 * ttl_ms / 1000.0
after = [r for r in rows if float(r[0]) >= warm]
print("warm-up: 3 TTLs = %.0f s; %d of %d samples after it" % (warm, len(after), len(rows)))
if len(after) < 6:
    print("VERDICT: inconclusive (fewer than 6 samples after the warm-up; run longer)")
    sys.exit(2)
grow = []
third = len(after) // 3
for name in ("rss_mb", "anon_mb", "disk_mb", "keys", "wal_mb", "index_mb"):
    i = hdr.index(name)
    v = [float(r[i]) for r in after]
    lo, hi = min(v), max(v)
    first = sum(v[:third]) / third
    last = sum(v[-third:]) / third
    trend = last / first if first > 0 else float("inf")
    gated = name in ("rss_mb", "anon_mb", "disk_mb")
    ok = trend < band
    print("%-8s min %-12g max %-12g max/min %.2f  last/first third %.2f %s" % (
        name, lo, hi, hi / lo if lo > 0 else float("inf"), trend,
        ("ok" if ok else "GROWS") if gated else "(informational)"))
    if gated and not ok:
        grow.append(name)
if grow:
    print("VERDICT: GROWS (%s: the last third of the samples after warm-up averages >= %.2fx the "
          "first; expired keys are not reclaimed fast enough)" % (", ".join(grow), band))
    sys.exit(1)
print("VERDICT: FLAT (memory and disk: last third within %.2fx the first third after warm-up)"
      % band)
EOF
