#!/usr/bin/env bash
# Server benchmark (issue 3): the same dedup workload against idemd, Redis 7 and PostgreSQL 15,
# started by this script on this machine, in one run.
#   - idemd and Redis: redis-benchmark, 50 clients, pipeline 1 and 32, random keys (-r):
#     `SET key:<rand> v NX PX 86400000` on both, and `IDEM.CLAIM key:<rand> 86400000 30000` on
#     idemd; Redis with appendonly no / appendfsync everysec / appendfsync always, idemd with
#     --durability none / batch / sync, each idemd command on a fresh server (see run_idemd).
#   - PostgreSQL: pgbench, 16 clients, `INSERT INTO idem(k) VALUES (:key) ON CONFLICT DO NOTHING
#     RETURNING k` with a random key, -M prepared, one insert per script (pipeline 1) or 32 in a
#     \startpipeline ... \endpipeline block (pipeline 32), synchronous_commit on and off.
#   - Memory per key: idemd anonymous memory (smaps_rollup) and RSS before/after loading N keys
#     with SET NX; Redis used_memory (INFO memory) and RSS likewise; PostgreSQL table + index size
#     per row at the end.
#   - idemd flush latency, and its own claim latency (IDEM.CLAIM, parsed to reply), from its
#     Prometheus histograms scraped before and after each run, and the store checkpoints taken
#     during each run (a checkpoint adds disk work to the run: see the report's note).
# Prints ops/s, p50, p99 per system and mode, ratios at equal durability, memory per key and the
# targets; raw outputs are kept in the results directory.
#
# usage: bench/server/run.sh [--quick] [--idemd PATH] [--out DIR] [--secs S] [--reps N]
#                            [--mem-keys N] [--only idemd,redis,postgresql] [--keep-data]
#                            [--idemd-args "FLAGS"]   (extra idemd flags, e.g. "--queue-depth 8192")
# Servers listen on 127.0.0.1 only; data lives in a temporary directory removed at the end;
# every server is stopped by its pid at the end, also on error or interrupt.
set -euo pipefail

HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
QUICK=0
IDEMD=""
OUT=""
SECS=""
REPS=""
MEMKEYS=""
ONLY="idemd,redis,postgresql"
KEEP=0
IDEMD_ARGS=""
CLIENTS=50
PG_CLIENTS=16
KEYSPACE=1000000000

while [ $# -gt 0 ]; do
    case "$1" in
    --quick) QUICK=1 ;;
    --idemd) IDEMD=$2; shift ;;
    --out) OUT=$2; shift ;;
    --secs) SECS=$2; shift ;;
    --reps) REPS=$2; shift ;;
    --mem-keys) MEMKEYS=$2; shift ;;
    --only) ONLY=$2; shift ;;
    --keep-data) KEEP=1 ;;
    --idemd-args) IDEMD_ARGS=$2; shift ;;
    -h | --help) sed -n '2,/^set -euo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "unknown option $1" >&2; exit 2 ;;
    esac
    shift
done

if [ "$QUICK" = 1 ]; then
    : "${SECS:=5}" "${REPS:=1}" "${MEMKEYS:=1000000}"
else
    : "${SECS:=15}" "${REPS:=5}" "${MEMKEYS:=5000000}"
fi
if [ -z "$IDEMD" ]; then
    if [ -x "$ROOT/build-rel/idemd" ]; then IDEMD=$ROOT/build-rel/idemd; else IDEMD=$ROOT/build/idemd; fi
fi
[ -x "$IDEMD" ] || { echo "no idemd at $IDEMD (build it: cmake -S . -B build-rel -DCMAKE_BUILD_TYPE=Release -DIDEM_TESTS=OFF && cmake --build build-rel)" >&2; exit 2; }
IDEMD=$(cd "$(dirname "$IDEMD")" && pwd)/$(basename "$IDEMD")
want() { case ",$ONLY," in *",$1,"*) return 0 ;; *) return 1 ;; esac; }

log() { printf '%s %s\n' "$(date +%H:%M:%S)" "$*" >&2; }

# ------------------------------------------------------------------ tools
APT_UPDATED=0
apt_install() {
    [ "$(id -u)" = 0 ] || { echo "missing $*; install it (apt-get install $*)" >&2; exit 2; }
    if [ "$APT_UPDATED" = 0 ]; then apt-get update -qq >&2; APT_UPDATED=1; fi
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$@" >&2
}
if want idemd || want redis; then
    command -v redis-server >/dev/null || apt_install redis-server
    command -v redis-benchmark >/dev/null && command -v redis-cli >/dev/null || apt_install redis-tools
fi
pg_bindir() { ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V | tail -1; }
if want postgresql; then
    [ -n "$(pg_bindir)" ] && [ -x "$(pg_bindir)/pgbench" ] || apt_install postgresql
    PGBIN=$(pg_bindir)
    [ -d /usr/lib/postgresql/15/bin ] && PGBIN=/usr/lib/postgresql/15/bin
fi
command -v python3 >/dev/null || apt_install python3
command -v curl >/dev/null || apt_install curl

# ------------------------------------------------------------------ state, cleanup
TMP=$(mktemp -d /tmp/idem-srvbench.XXXXXX)
chmod 711 "$TMP"
if [ -z "$OUT" ]; then OUT=$(mktemp -d /tmp/idem-srvbench-results.XXXXXX); fi
mkdir -p "$OUT/raw"
RES=$OUT/results.tsv
MEM=$OUT/memory.txt
printf 'system\tmode\tcmd\tpipeline\trep\tn\tops\tp50_ms\tp99_ms\tavg_ms\tload1\textra\n' >"$RES"
: >"$MEM"
PIDS=()
PG_DATA=""

stop_pid() { # pid [seconds]: SIGTERM, wait, then SIGKILL; only this pid
    local pid=$1 t=${2:-60} i=0
    kill -0 "$pid" 2>/dev/null || return 0
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
    for pid in "${PIDS[@]}"; do stop_pid "$pid" 30; done
    if [ -n "$PG_DATA" ] && [ -f "$PG_DATA/postmaster.pid" ]; then
        local pp
        pp=$(head -1 "$PG_DATA/postmaster.pid" 2>/dev/null || true)
        [ -n "$pp" ] && stop_pid "$pp" 60
    fi
    if [ "$KEEP" = 0 ]; then rm -rf "$TMP"; else log "data kept in $TMP"; fi
    [ $rc = 0 ] || log "stopped with status $rc; partial results in $OUT"
    exit $rc
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM
forget_pid() { local p=$1 a=(); for x in "${PIDS[@]}"; do [ "$x" = "$p" ] || a+=("$x"); done; PIDS=("${a[@]}"); }

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
load1() { cut -d' ' -f1 /proc/loadavg; }
wait_ping() { # port pid
    local i=0
    until redis-cli -p "$1" PING 2>/dev/null | grep -q PONG; do
        kill -0 "$2" 2>/dev/null || { log "server pid $2 died at start"; return 1; }
        i=$((i + 1)); [ $i -lt 600 ] || { log "server on port $1 not ready after 60s"; return 1; }
        sleep 0.1
    done
}
# INFO says when a store opened with data is recovered (loading:0), for the figures of its open.
wait_loaded() { # port pid
    local i=0
    until redis-cli -p "$1" INFO persistence 2>/dev/null | tr -d '\r' | grep -q '^loading:0$'; do
        kill -0 "$2" 2>/dev/null || { log "server pid $2 died while loading"; return 1; }
        i=$((i + 1)); [ $i -lt 600 ] || { log "server on port $1 still loading after 60s"; return 1; }
        sleep 0.1
    done
}
smaps_anon() { awk '/^Anonymous:/ {print $2 * 1024}' "/proc/$1/smaps_rollup"; }
rss_bytes() { awk '/^VmRSS:/ {print $2 * 1024}' "/proc/$1/status"; }
info_field() { redis-cli -p "$1" INFO "$2" | tr -d '\r' | awk -F: -v k="$3" '$1 == k {print $2}'; }

# ------------------------------------------------------------------ machine
{
    echo "mode=$([ "$QUICK" = 1 ] && echo quick || echo full)"
    echo "secs=$SECS"; echo "reps=$REPS"; echo "mem_keys=$MEMKEYS"
    echo "clients=$CLIENTS"; echo "pg_clients=$PG_CLIENTS"; echo "keyspace=$KEYSPACE"
    echo "idemd_version=$("$IDEMD" --version 2>&1 | head -1)${IDEMD_ARGS:+ $IDEMD_ARGS}"
    echo "redis_version=$(redis-server --version 2>/dev/null | awk '{print $3}')"
    [ -n "${PGBIN:-}" ] && echo "pg_version=$("$PGBIN/postgres" --version)"
    echo "nproc=$(nproc)"
    echo "mem_total=$(awk '/MemTotal/ {print $2 " kB"}' /proc/meminfo)"
    echo "kernel=$(uname -r)"
    echo "disk=$(df -h "$TMP" | awk 'NR==2 {print $1 " " $2 " size, " $4 " free"}')"
    echo "load_start=$(cat /proc/loadavg)"
} >"$OUT/meta.txt"
log "results in $OUT; data in $TMP"
sed 's/^/  /' "$OUT/meta.txt" >&2

# ------------------------------------------------------------------ redis-benchmark runs
# rb_once TAG PORT PIPELINE N CMD...: one redis-benchmark run; sets RB_OPS RB_P50 RB_P99 RB_AVG
# RB_MAX
rb_once() {
    local tag=$1 port=$2 p=$3 n=$4; shift 4
    local f=$OUT/raw/$tag.csv
    RB_OPS=""; RB_P50=""; RB_P99=""; RB_AVG=""; RB_MAX=""
    if ! timeout $((SECS * 6 + 120)) redis-benchmark -h 127.0.0.1 -p "$port" -c "$CLIENTS" -P "$p" \
        -n "$n" -r "$KEYSPACE" --csv "$@" >"$f" 2>"$OUT/raw/$tag.err"; then
        log "redis-benchmark $tag failed or timed out (status $?)"
        return 1
    fi
    local line
    line=$(grep -v '^"test"' "$f" | tail -1)
    [ -n "$line" ] || { log "redis-benchmark $tag printed no result"; return 1; }
    # "test","rps","avg","min","p50","p95","p99","max"
    RB_OPS=$(echo "$line" | awk -F'","' '{print $2}')
    RB_AVG=$(echo "$line" | awk -F'","' '{print $3}')
    RB_MAX=$(echo "$line" | awk -F'","' '{print $8}' | tr -d '"')
    RB_P50=$(echo "$line" | awk -F'","' '{print $5}')
    RB_P99=$(echo "$line" | awk -F'","' '{print $7}')
}

# rb_series SYSTEM MODE CMDNAME PORT PIDFILE-PID PIPELINE REPS CMD...
# A probe run sizes N for about SECS seconds (and warms up), then REPS measured runs.
rb_series() {
    local sys=$1 mode=$2 cname=$3 port=$4 pid=$5 p=$6 reps=$7; shift 7
    local tag="${sys}-${mode// /_}-${cname//[ .]/_}-P$p"
    local probe_n=$((p == 1 ? 10000 : 100000))
    if ! rb_once "$tag-probe" "$port" "$p" "$probe_n" "$@"; then
        printf '%s\t%s\t%s\t%s\t0\t0\tnan\tnan\tnan\tnan\t%s\tfailed=probe\n' "$sys" "$mode" "$cname" "$p" "$(load1)" >>"$RES"
        return 0
    fi
    local n
    n=$(python3 -c "print(max($probe_n, min(50000000, int(float('$RB_OPS') * $SECS))))")
    local r
    for r in $(seq 1 "$reps"); do
        local before="" after="" extra="" flushinfo="" ckpt0=0
        if [ "$sys" = idemd ]; then
            curl -s "http://127.0.0.1:$IDEM_MPORT/" >"$OUT/raw/$tag-r$r.metrics.before" || true
            before=$(idem_answered "$port")
            ckpt0=$(info_field "$port" idem checkpoints)
        fi
        local l0 ok=1
        l0=$(load1)
        log "$sys $mode $cname P$p run $r/$reps: n=$n"
        rb_once "$tag-r$r" "$port" "$p" "$n" "$@" || ok=0
        if ! kill -0 "$pid" 2>/dev/null; then
            log "$sys ($mode) pid $pid is gone after $tag-r$r"
            extra="failed=server_died"
            ok=0
        fi
        if [ "$sys" = idemd ] && [ $ok = 1 ]; then
            curl -s "http://127.0.0.1:$IDEM_MPORT/" >"$OUT/raw/$tag-r$r.metrics.after" || true
            after=$(idem_answered "$port")
            flushinfo=$(python3 "$HERE/report.py" flush "$OUT/raw/$tag-r$r.metrics.before" "$OUT/raw/$tag-r$r.metrics.after")
            local fp50 fp99 fn recs
            read -r fp50 fp99 fn <<<"$flushinfo"
            recs=$(awk '/^idem_flush_records_total/ {print $2}' "$OUT/raw/$tag-r$r.metrics.after")
            local recs0
            recs0=$(awk '/^idem_flush_records_total/ {print $2}' "$OUT/raw/$tag-r$r.metrics.before")
            local rpf="nan"
            [ "${fn:-0}" -gt 0 ] && rpf=$(python3 -c "print(round(($recs - $recs0) / $fn, 1))")
            # redis-benchmark may send up to a pipeline per client more than n; fewer answers
            # than n would mean requests idemd did not count
            local ans=$((after - before)) miss=0
            [ $ans -ge "$n" ] || { miss=$((n - ans)); log "idemd counted $ans answers for $n requests"; }
            local cp50 cp99 cn ckpts
            read -r cp50 cp99 cn < <(python3 "$HERE/report.py" claim "$OUT/raw/$tag-r$r.metrics.before" "$OUT/raw/$tag-r$r.metrics.after")
            ckpts=$(($(info_field "$port" idem checkpoints) - ckpt0))
            extra="flush_p50_us=$fp50;flush_p99_us=$fp99;flushes=$fn;rec_per_flush=$rpf;answered=$ans;unanswered=$miss;checkpoints=$ckpts"
            [ "${cn:-0}" -gt 0 ] && extra="$extra;claim_p50_us=$cp50;claim_p99_us=$cp99"
        fi
        [ $ok = 1 ] && extra="max_ms=$RB_MAX${extra:+;$extra}"
        if [ $ok = 1 ]; then
            printf '%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\n' "$sys" "$mode" "$cname" "$p" "$r" "$n" \
                "$RB_OPS" "$RB_P50" "$RB_P99" "$RB_AVG" "$l0" "$extra" >>"$RES"
            log "  -> $RB_OPS ops/s, p50 $RB_P50 ms, p99 $RB_P99 ms, max $RB_MAX ms ${flushinfo:+(flush p50/p99/count $flushinfo)}"
        else
            printf '%s\t%s\t%s\t%s\t%s\t%s\tnan\tnan\tnan\tnan\t%s\t%s\n' "$sys" "$mode" "$cname" "$p" "$r" "$n" \
                "$l0" "${extra:-failed=client}" >>"$RES"
            [ "${extra:-}" = failed=server_died ] && return 1
        fi
    done
}

# the claim and SET NX outcome counters of INFO idem, summed: requests idemd answered
idem_answered() {
    redis-cli -p "$1" INFO idem | tr -d '\r' | awk -F: '/^claims_(new|busy|done|mismatch|recover|review):/ {s += $2} END {print s + 0}'
}

SETNX=(SET 'key:__rand_int__' v NX PX 86400000)
CLAIM=(IDEM.CLAIM 'key:__rand_int__' 86400000 30000)

# A stopped server's data goes at once (unless --keep-data): a full run writes tens of GB in all,
# and a disk that fills up mid-run turns the later runs into error replies.
drop_data() { [ "$KEEP" = 1 ] || rm -rf "$1"; }

# ------------------------------------------------------------------ idemd
# idemd_start MODE TAG: a fresh idemd on its own directory; sets IDEM_PORT IDEM_PID IDEM_MPORT
idemd_start() {
    local mode=$1 tag=$2 dir=$TMP/idemd-$1-$2
    mkdir -p "$dir"
    IDEM_PORT=$(free_port)
    IDEM_MPORT=$(free_port)
    "$IDEMD" --dir "$dir" --socket "" --bind 127.0.0.1 --port "$IDEM_PORT" \
        --metrics-listen "127.0.0.1:$IDEM_MPORT" --durability "$mode" $IDEMD_ARGS >"$OUT/raw/idemd-$mode-$tag.log" 2>&1 &
    IDEM_PID=$!
    PIDS+=("$IDEM_PID")
    wait_ping "$IDEM_PORT" "$IDEM_PID"
    wait_loaded "$IDEM_PORT" "$IDEM_PID"
    log "idemd --durability $mode ($tag) pid $IDEM_PID port $IDEM_PORT"
}

idemd_stop() { # MODE TAG
    redis-cli -p "$IDEM_PORT" INFO idem | tr -d '\r' >"$OUT/raw/idemd-$1-$2.info" 2>/dev/null || true
    stop_pid "$IDEM_PID" 120
    forget_pid "$IDEM_PID"
    grep -E 'level=(warn|error|fatal)' "$OUT/raw/idemd-$1-$2.log" | head -5 >&2 || true
    drop_data "$TMP/idemd-$1-$2"
}

# Memory per key, on a server of its own (durability none).
run_idemd_memory() {
    idemd_start none memory
    local pid=$IDEM_PID port=$IDEM_PORT
    sleep 0.5
    local a0 r0 a1 r1 k
    a0=$(smaps_anon "$pid"); r0=$(rss_bytes "$pid")
    log "idemd: loading $MEMKEYS keys (SET NX, pipeline 32) for memory per key"
    timeout 600 redis-benchmark -h 127.0.0.1 -p "$port" -c "$CLIENTS" -P 32 -n "$MEMKEYS" -r "$KEYSPACE" \
        --csv "${SETNX[@]}" >"$OUT/raw/idemd-memload.csv" 2>"$OUT/raw/idemd-memload.err" || log "idemd memory load failed"
    sleep 1
    a1=$(smaps_anon "$pid"); r1=$(rss_bytes "$pid")
    k=$(info_field "$port" idem keys)
    {
        echo "idemd_keys=$k"
        echo "idemd_anon_before=$a0"; echo "idemd_anon_after=$a1"; echo "idemd_anon_delta=$((a1 - a0))"
        echo "idemd_rss_before=$r0"; echo "idemd_rss_after=$r1"; echo "idemd_rss_delta=$((r1 - r0))"
        echo "idemd_memory_bytes=$(info_field "$port" idem memory_bytes)"
        awk '/^RssFile:/ {print "idemd_rssfile_after=" $2 * 1024}' "/proc/$pid/status"
    } >>"$MEM"
    log "idemd: $k keys, anonymous +$((a1 - a0)) B, RSS +$((r1 - r0)) B"
    idemd_stop none memory
}

# Each command on a fresh server per mode: the store checkpoints every few million records and
# pauses while it does (seconds at millions of keys), so runs on one growing store would meet
# those pauses at different sizes and compare the commands unfairly.
run_idemd() {
    run_idemd_memory
    local mode cname
    for mode in none batch sync; do
        for cname in "SET NX" "IDEM.CLAIM"; do
            local -a cmd
            local tag p ok=1
            if [ "$cname" = "SET NX" ]; then cmd=("${SETNX[@]}"); tag=setnx; else cmd=("${CLAIM[@]}"); tag=claim; fi
            idemd_start "$mode" "$tag"
            for p in 1 32; do
                local reps=1
                [ $p = 1 ] && reps=$REPS
                rb_series idemd "$mode" "$cname" "$IDEM_PORT" "$IDEM_PID" "$p" "$reps" "${cmd[@]}" || { ok=0; break; }
            done
            idemd_stop "$mode" "$tag"
            [ $ok = 1 ] || log "idemd --durability $mode ($tag): runs stopped early (server gone)"
        done
    done
}

# ------------------------------------------------------------------ Redis
run_redis() {
    local mode
    for mode in no everysec always; do
        local dir=$TMP/redis-$mode port
        mkdir -p "$dir"
        port=$(free_port)
        local -a conf=(--port "$port" --bind 127.0.0.1 --dir "$dir" --save "" --daemonize no
            --logfile "$OUT/raw/redis-$mode.log")
        if [ "$mode" = no ]; then conf+=(--appendonly no); else conf+=(--appendonly yes --appendfsync "$mode"); fi
        redis-server "${conf[@]}" >/dev/null 2>&1 &
        local pid=$!
        PIDS+=("$pid")
        wait_ping "$port" "$pid"
        log "redis appendonly/appendfsync $mode pid $pid port $port"
        if [ "$mode" = no ]; then
            sleep 0.5
            local u0 r0 u1 r1 k
            u0=$(info_field "$port" memory used_memory); r0=$(rss_bytes "$pid")
            log "redis: loading $MEMKEYS keys (SET NX, pipeline 32) for memory per key"
            timeout 600 redis-benchmark -h 127.0.0.1 -p "$port" -c "$CLIENTS" -P 32 -n "$MEMKEYS" -r "$KEYSPACE" \
                --csv "${SETNX[@]}" >"$OUT/raw/redis-memload.csv" 2>"$OUT/raw/redis-memload.err" || log "redis memory load failed"
            sleep 1
            u1=$(info_field "$port" memory used_memory); r1=$(rss_bytes "$pid")
            k=$(redis-cli -p "$port" DBSIZE)
            {
                echo "redis_keys=$k"
                echo "redis_used_before=$u0"; echo "redis_used_after=$u1"; echo "redis_used_delta=$((u1 - u0))"
                echo "redis_rss_before=$r0"; echo "redis_rss_after=$r1"; echo "redis_rss_delta=$((r1 - r0))"
            } >>"$MEM"
            log "redis: $k keys, used_memory +$((u1 - u0)) B, RSS +$((r1 - r0)) B"
        fi
        local p
        for p in 1 32; do
            local reps=1
            [ $p = 1 ] && reps=$REPS
            rb_series redis "$mode" "SET NX" "$port" "$pid" "$p" "$reps" "${SETNX[@]}" || break
        done
        redis-cli -p "$port" INFO persistence | tr -d '\r' >"$OUT/raw/redis-$mode.persistence" 2>/dev/null || true
        stop_pid "$pid" 120
        forget_pid "$pid"
        drop_data "$dir"
    done
}

# ------------------------------------------------------------------ PostgreSQL
pg() { runuser -u postgres -- "$@"; }
run_pg() {
    PG_DATA=$TMP/pg
    local port
    port=$(free_port)
    mkdir -p "$PG_DATA"
    chown postgres "$PG_DATA"
    pg "$PGBIN/initdb" -D "$PG_DATA" -U postgres --auth=trust -E UTF8 >"$OUT/raw/pg-initdb.log" 2>&1
    cat >>"$PG_DATA/postgresql.conf" <<EOF
listen_addresses = '127.0.0.1'
port = $port
unix_socket_directories = '$PG_DATA'
max_connections = 64
shared_buffers = 1GB
max_wal_size = 8GB
checkpoint_timeout = 30min
fsync = on
synchronous_commit = on
EOF
    pg "$PGBIN/postgres" -D "$PG_DATA" >"$OUT/raw/pg.log" 2>&1 &
    local pid=$!
    PIDS+=("$pid")
    local i=0
    until "$PGBIN/pg_isready" -q -h 127.0.0.1 -p "$port"; do
        kill -0 "$pid" 2>/dev/null || { log "postgres died at start"; cat "$OUT/raw/pg.log" >&2; return 1; }
        i=$((i + 1)); [ $i -lt 600 ] || { log "postgres not ready"; return 1; }
        sleep 0.1
    done
    log "postgresql pid $pid port $port"
    local PSQL=("$PGBIN/psql" -X -q -h 127.0.0.1 -p "$port" -U postgres -d postgres -v ON_ERROR_STOP=1)
    "${PSQL[@]}" -c "CREATE TABLE idem(k text PRIMARY KEY)"
    local s1=$TMP/pg-p1.sql s32=$TMP/pg-p32.sql j
    printf '\\set key random(0, %d)\nINSERT INTO idem(k) VALUES (:key) ON CONFLICT DO NOTHING RETURNING k;\n' $((KEYSPACE - 1)) >"$s1"
    {
        for j in $(seq 1 32); do printf '\\set key%d random(0, %d)\n' "$j" $((KEYSPACE - 1)); done
        echo '\startpipeline'
        for j in $(seq 1 32); do printf 'INSERT INTO idem(k) VALUES (:key%d) ON CONFLICT DO NOTHING RETURNING k;\n' "$j"; done
        echo '\endpipeline'
    } >"$s32"
    chmod 644 "$s1" "$s32"
    local sc p r
    for sc in on off; do
        for p in 1 32; do
            local reps=1 script=$s1 per=1
            [ $p = 1 ] && reps=$REPS
            [ $p = 32 ] && { script=$s32; per=32; }
            for r in $(seq 1 "$reps"); do
                local tag="postgresql-sync_$sc-P$p-r$r" ldir l0
                ldir=$TMP/pglog-$tag
                mkdir -p "$ldir"
                "${PSQL[@]}" -c CHECKPOINT
                l0=$(load1)
                log "postgresql synchronous_commit=$sc P$p run $r/$reps: ${SECS}s"
                if ! PGOPTIONS="-c synchronous_commit=$sc" timeout $((SECS * 3 + 120)) \
                    "$PGBIN/pgbench" -h 127.0.0.1 -p "$port" -U postgres -n -M prepared -c "$PG_CLIENTS" -j 2 \
                    -T "$SECS" -f "$script" -l --log-prefix="$ldir/log" postgres >"$OUT/raw/$tag.out" 2>&1; then
                    log "pgbench $tag failed"; tail -5 "$OUT/raw/$tag.out" >&2
                    printf 'postgresql\tsync %s\tINSERT\t%s\t%s\t0\tnan\tnan\tnan\tnan\t%s\tfailed=pgbench\n' "$sc" "$p" "$r" "$l0" >>"$RES"
                    continue
                fi
                local tps lat n q
                tps=$(awk '/^tps = / {print $3; exit}' "$OUT/raw/$tag.out")
                lat=$(awk '/^latency average = / {print $4; exit}' "$OUT/raw/$tag.out")
                q=$(python3 "$HERE/report.py" pglog "$ldir"/log*)
                n=$(awk '{print $3}' <<<"$q")
                local ops
                ops=$(python3 -c "print(round(float('$tps') * $per, 1))")
                printf 'postgresql\tsync %s\tINSERT\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\tstatements=%s\n' "$sc" "$p" "$r" \
                    $((n * per)) "$ops" "$(awk '{print $1}' <<<"$q")" "$(awk '{print $2}' <<<"$q")" "$lat" "$l0" "$per" >>"$RES"
                log "  -> $ops ops/s (tps $tps), p50/p99 ms $(awk '{print $1 "/" $2}' <<<"$q")"
                rm -rf "$ldir"
            done
        done
    done
    local rows heap total idx
    rows=$("${PSQL[@]}" -At -c "SELECT count(*) FROM idem")
    heap=$("${PSQL[@]}" -At -c "SELECT pg_table_size('idem')")
    idx=$("${PSQL[@]}" -At -c "SELECT pg_indexes_size('idem')")
    total=$("${PSQL[@]}" -At -c "SELECT pg_total_relation_size('idem')")
    { echo "pg_rows=$rows"; echo "pg_heap_bytes=$heap"; echo "pg_index_bytes=$idx"; echo "pg_total_bytes=$total"; } >>"$MEM"
    log "postgresql: $rows rows, $total bytes (table + index)"
    stop_pid "$pid" 120
    forget_pid "$pid"
    PG_DATA=""
}

T0=$(date +%s)
want idemd && run_idemd
want redis && run_redis
want postgresql && run_pg
echo "load_end=$(cat /proc/loadavg)" >>"$OUT/meta.txt"
echo "elapsed_s=$(($(date +%s) - T0))" >>"$OUT/meta.txt"
log "done in $(($(date +%s) - T0)) s"
python3 "$HERE/report.py" report "$OUT" | tee "$OUT/report.md"
