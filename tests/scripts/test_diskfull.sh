#!/usr/bin/env bash
# test_diskfull.sh: proves that idemd survives a really full disk. Its store lives on a small
# ext4 image (loop device; btrfs with IDEM_DISKFULL_FS=btrfs, test_diskfull_btrfs.sh) with 1 MiB
# log segments (idemd has no flag for the segment size; the
# store is created with tests/load/mkstore.c, and idemd keeps the size a store was created with).
# Scenario A: claims and commits from 4 connections while a filler file takes the rest of the
# filesystem, until claims answer -FULL; then idemd must not exit, must lose nothing it
# acknowledged, must still answer repeats (`done` + result), IDEM.GET and GET, and must answer
# -FULL to new claims; once the filler is removed new claims succeed again within seconds,
# without a restart; after a kill -9 and a restart every acknowledged key is there, and
# `idemctl verify` finds the store sound after a clean stop.
# Scenario B: the same with the --max-disk limit instead of a full filesystem, then a restart
# with a higher limit.
# The log's space is zero-filled ahead of it on both: on btrfs (copy on write) only because the
# store's files are made NOCOW, without which the log's writes over those zeros took new space,
# and failed on the full disk. Then others take the last blocks as well: idemd answers, is killed,
# restarts and stops cleanly with no block left.
# Scenario C: a new store, whose segments have room left when others take the last blocks:
# claims go on into the log's own space, idemd is killed under load, and claims after the
# restart go on into the spare the filler zero-filled, until FULL; nothing is fatal or lost.
# Scenario E: the store fills the disk itself with keys that then expire: the reserve it let go
# at the full disk gives compaction and a checkpoint room, and new claims are taken again.
# Scenario D (btrfs only): on a btrfs with two copies of the data no file is made NOCOW.
# Needs root, /dev/loop-control, losetup, mkfs.ext4 (mkfs.btrfs) and mount; without them it prints why and
# `0 passed, 0 failed, 1 skipped` (exit 77: ctest reports it skipped). Everything runs on
# 127.0.0.1 and a private unix socket, with bounded loops; the trap unmounts and detaches the
# loop device.
set -u

SRC=${IDEM_SOURCE_DIR:-$(cd "$(dirname "$0")/../.." && pwd)}
BUILD=${IDEM_BUILD_DIR:-$SRC/build}
IDEMD=$BUILD/idemd
IDEMCTL=$BUILD/idemctl
LOAD="python3 $SRC/tests/load/idemload.py"
RESULT_BYTES=512

passed=0
failed=0
ok() { passed=$((passed + 1)); echo "ok - $*"; }
not_ok() { failed=$((failed + 1)); echo "FAIL - $*"; }
check() { # check "description" command...: passes when the command succeeds
    local what=$1
    shift
    if "$@"; then ok "$what"; else not_ok "$what"; fi
}
skip_all() {
    echo "skipped: $*"
    echo "0 passed, 0 failed, 1 skipped"
    exit 77 # ctest: skipped
}

# ---- preconditions ----
[ "$(id -u)" = 0 ] || skip_all "not root (loop devices and mount need it)"
[ -e /dev/loop-control ] || skip_all "no /dev/loop-control"
FS=${IDEM_DISKFULL_FS:-ext4}
case "$FS" in
ext4) FS_MB=48 ;;
btrfs) FS_MB=128 ;; # mkfs.btrfs refuses less than 109 MiB (without --mixed)
*) echo "IDEM_DISKFULL_FS=$FS: ext4 or btrfs"; echo "0 passed, 1 failed"; exit 1 ;;
esac
[ "$FS" = btrfs ] && ! grep -qw btrfs /proc/filesystems && ! modprobe btrfs 2>/dev/null &&
    skip_all "the kernel has no btrfs"
for tool in losetup "mkfs.$FS" mount umount fallocate python3 cc pkg-config; do
    command -v "$tool" >/dev/null 2>&1 || skip_all "$tool is not installed"
done
[ -x "$IDEMD" ] || { echo "no idemd at $IDEMD"; echo "0 passed, 1 failed"; exit 1; }

WORK=$(mktemp -d "${TMPDIR:-/tmp}/idem-diskfull-XXXXXX")
MNT=$WORK/mnt
LOOPDEV=""
LOOPDEV2="" # scenario D's
PID=""
cleanup() {
    if [ -n "$PID" ] && kill -0 "$PID" 2>/dev/null; then
        kill -KILL "$PID" 2>/dev/null
        wait "$PID" 2>/dev/null
    fi
    if mountpoint -q "$MNT" 2>/dev/null; then
        umount "$MNT" 2>/dev/null || { sleep 1; umount "$MNT" 2>/dev/null; } || umount -l "$MNT"
    fi
    [ -n "$LOOPDEV" ] && losetup -d "$LOOPDEV" 2>/dev/null
    if [ -n "$LOOPDEV2" ]; then
        umount "$WORK/mnt2" 2>/dev/null || umount -l "$WORK/mnt2" 2>/dev/null
        losetup -d "$LOOPDEV2" 2>/dev/null
    fi
    rm -rf "$WORK"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

mkdir -p "$MNT"
truncate -s ${FS_MB}M "$WORK/fs.img"
if [ "$FS" = ext4 ]; then
    # -m 0: no blocks reserved for root (idemd runs as root here, and full must mean full)
    mkfs.ext4 -q -F -m 0 "$WORK/fs.img" >/dev/null 2>&1 || skip_all "mkfs.ext4 failed"
else
    mkfs.btrfs -q -f "$WORK/fs.img" >/dev/null 2>&1 || skip_all "mkfs.btrfs failed"
fi
LOOPDEV=$(losetup -f --show "$WORK/fs.img" 2>"$WORK/losetup.err") ||
    skip_all "losetup failed: $(cat "$WORK/losetup.err")"
mount "$LOOPDEV" "$MNT" 2>"$WORK/mount.err" || skip_all "mount failed: $(cat "$WORK/mount.err")"
echo "# store filesystem: $FS_MB MiB $FS on $LOOPDEV"

# ---- the small-segment store maker (built by CMake with the build's own flags) ----
if [ ! -x "$BUILD/idem-mkstore" ]; then
    not_ok "the build has no idem-mkstore (tests/load/mkstore.c)"
    echo "$passed passed, $failed failed"
    exit 1
fi
ln -s "$BUILD/idem-mkstore" "$WORK/mkstore"

PORT=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
SOCK=$WORK/idemd.sock # outside the full filesystem: the socket must be creatable at a restart

start_idemd() { # start_idemd DIR LOG [flags...]: starts idemd and waits until it answers
    local dir=$1 log=$2
    shift 2
    "$IDEMD" --dir "$dir" --port "$PORT" --socket "$SOCK" "$@" 2>>"$log" &
    PID=$!
    for _ in $(seq 1 200); do
        [ "$($LOAD cmd --port "$PORT" --timeout 2 EXISTS ready 2>/dev/null)" = ":0" ] && return 0
        kill -0 "$PID" 2>/dev/null || return 1
        sleep 0.05
    done
    return 1
}
alive() { kill -0 "$PID" 2>/dev/null; }
cmd() { $LOAD cmd --port "$PORT" "$@"; }
admin() { $LOAD cmd --unix "$SOCK" "$@"; }
avail_bytes() { df --output=avail -B1 "$MNT" | tail -1 | tr -d ' '; }
# fill PREFIX ACKFILE CONNS MAXKEYS: claims+commits until -FULL; prints the summary line
fill() { $LOAD fill --port "$PORT" --prefix "$1" --ack "$2" --conns "$3" --max-keys "$4" \
    --result-bytes "$RESULT_BYTES" --full-stop 10 --timeout 120; }
field_of() { sed -n "s/.*\b$1=\([0-9]*\).*/\1/p" <<<"$2"; }
take_last_blocks() { # take_last_blocks NAME: files NAME* take every block left (a few rounds:
    # btrfs frees reserved space only as its transactions commit)
    fallocate -l "$(avail_bytes)" "$MNT/$1" 2>/dev/null
    for i in 1 2 3 4 5; do
        dd if=/dev/zero of="$MNT/$1-$i" bs=4k 2>/dev/null
        sync -f "$MNT"
        [ "$(avail_bytes)" -lt 4096 ] && return 0
    done
    return 0
}
check_acks() { # check_acks "what" ACKFILE: every acknowledged key reads back (IDEM.GET, GET,
    # a repeated claim answering done with its result, or in flight with its token)
    local res
    res=$($LOAD check --port "$PORT" --ack "$2" --result-bytes "$RESULT_BYTES")
    echo "# $(head -1 <<<"$res")"
    grep '^  ' <<<"$res" | head -10
    check "$1 ($(wc -l <"$2") acknowledgements)" grep -q ' bad=0$' <<<"$(head -1 <<<"$res")"
}
stat_of() { $LOAD cmd --unix "$SOCK" IDEM.STATS | sed -n "s/.*\b$1 :\([0-9]*\).*/\1/p"; }
stop_term() { # SIGTERM and wait (at most 30 s); the exit code goes to RC
    kill -TERM "$PID"
    for _ in $(seq 1 300); do
        alive || break
        sleep 0.1
    done
    if alive; then kill -KILL "$PID"; fi
    wait "$PID"
    RC=$?
    PID=""
}
kill9() {
    kill -KILL "$PID"
    wait "$PID" 2>/dev/null
    PID=""
}

# =========================== Scenario A: the filesystem is full ===========================
A=$MNT/a
ACK_A=$WORK/ack-a
LOG_A=$WORK/idemd-a.log
: >"$ACK_A"
check "A: store created with 1 MiB segments" "$WORK/mkstore" "$A" 1048576
start_idemd "$A" "$LOG_A" || not_ok "A: idemd starts"
alive && ok "A: idemd starts on the loop filesystem"

out=$(fill warm "$ACK_A" 2 25)
echo "# warm-up: $out"
check "A: 50 warm-up claims committed with space free" test "$(field_of committed "$out")" = 50

# The filler takes all but 512 KiB: less than one segment, so the next segment cannot be made.
avail=$(avail_bytes)
fallocate -l $((avail - 512 * 1024)) "$MNT/filler" ||
    dd if=/dev/zero of="$MNT/filler" bs=1M count=$(((avail - 512 * 1024) / 1048576)) 2>/dev/null
echo "# filler: $(du -h "$MNT/filler" | cut -f1), free now $(avail_bytes) bytes"

t0=$(date +%s%N)
out=$(fill load "$ACK_A" 4 100000)
echo "# fill under load ($((($(date +%s%N) - t0) / 1000000)) ms): $out"
full=$(field_of full "$out")
committed=$(field_of committed "$out")
check "A: claims answer -FULL once the disk is full ($full -FULL answers)" test "${full:-0}" -gt 0
check "A: claims were acknowledged before it filled up ($committed committed)" test "${committed:-0}" -gt 0
check "A: no answer other than new/+OK/-FULL during the fill" test "$(field_of other "$out")" = 0
check "A: idemd is still running with the disk full" alive

r=$(cmd IDEM.CLAIM fresh:1 86400000 60000)
check "A: a new claim answers -FULL ($r)" grep -q '^-FULL' <<<"$r"
key=$(awk '$1=="C"{k=$2} END{print k}' "$ACK_A")
r=$(cmd IDEM.CLAIM "$key" 86400000 60000 FP "fp:$key")
check "A: a repeat of the last committed key answers done while full" grep -q '^done r:' <<<"$r"
r=$(cmd PING)
check "A: PING answers while full" test "$r" = "+PONG"
check_acks "A: every acknowledged key reads back while full" "$ACK_A"
r=$(admin IDEM.STATS)
echo "# stats while full: $(grep -o 'disk_free_bytes :[0-9]*\|fatal :[0-9]*\|claims_new :[0-9]*' <<<"$r" | tr '\n' ' ')"
check "A: IDEM.STATS reports no fatal error" grep -q 'fatal :0' <<<"$r"
check "A: idemd logged the full disk" grep -q 'event=full' "$LOG_A"
check "A: zeros are written ahead of the log (no fill_off, no fill_skipped)" \
    test "$(grep -c 'event=fill_off\|event=fill_skipped' "$LOG_A")" = 0
if [ "$FS" = btrfs ] && command -v lsattr >/dev/null 2>&1; then
    # Every file written over in place: not LOCK (a line of text, written over at each open;
    # btrfs keeps it inline), nor a checkpoint, written once from its start: one made while the
    # disk is full may have its mark refused (event=nocow_refused), which costs nothing; nor the
    # reserve (nor reserve.new, a new reserve while no room allows it), whose blocks
    # are never written. A file
    # gone between the listing and lsattr (a segment whose making the full disk refused, tried
    # again each second) is not counted.
    total=0 nocow=0 listing=
    for f in $(find "$A" -maxdepth 1 -type f ! -name LOCK ! -name '*.ckpt' ! -name 'reserve*' | sort); do
        a=$(lsattr "$f" 2>/dev/null) || continue
        total=$((total + 1)); listing+="# $a"$'\n'
        [[ "${a%% *}" == *C* ]] && nocow=$((nocow + 1))
    done
    check "A: on btrfs the store's files are NOCOW ($nocow of $total show C)" \
        test "$nocow" = "$total" -a "$nocow" -ge 3
    [ "$nocow" = "$total" ] || printf '%s' "$listing"
elif [ "$FS" = btrfs ]; then
    echo "# lsattr is not installed: the NOCOW mark is not checked"
fi
check "A: idemd is still running after the reads" alive

# Others take the last blocks too: nothing the store writes over in place may need new space
# (on btrfs only NOCOW files write over in place), and a restart must not need any.
take_last_blocks filler-last
echo "# the last blocks taken: free $(avail_bytes) bytes"
check "A: others hold every block ($(avail_bytes) bytes free)" test "$(avail_bytes)" -lt 4096
r=$(cmd IDEM.CLAIM fresh:2 86400000 60000)
check "A: with no block left a new claim answers -FULL ($r)" grep -q '^-FULL' <<<"$r"
r=$(cmd IDEM.CLAIM "$key" 86400000 60000 FP "fp:$key")
check "A: with no block left a repeat answers done" grep -q '^done r:' <<<"$r"
kill9
check "A: idemd restarts after kill -9 with no block left" start_idemd "$A" "$LOG_A"
check_acks "A: every acknowledged key is there after it" "$ACK_A"
r=$(cmd IDEM.CLAIM fresh:3 86400000 60000)
check "A: a new claim still answers -FULL ($r)" grep -q '^-FULL' <<<"$r"
# A restart that finds its log at the end of the disk (where in its segment it stood at the
# kill decides) lets the reserve go at its first try at the next segment, on the flusher, and
# again a second later after a try that found no room (disk_reserve.c). Once that has had its
# time, others take that room too, so that the closing checkpoint below finds none.
for _ in $(seq 1 15); do
    [ "$(stat_of disk_reserve_released)" = 1 ] && break
    sleep 0.1
done
echo "# reserve let go by this run: $(stat_of disk_reserve_released); $(avail_bytes) bytes free"
take_last_blocks filler-last-r
check "A: others hold the room the reserve let go too, if it did ($(avail_bytes) bytes free)" \
    test "$(avail_bytes)" -lt 4096
out=$(timeout 10 "$IDEMD" --dir "$A" --port 0 --socket "$WORK/second.sock" 2>&1 </dev/null)
check "A: a second idemd on the store is refused (the lock holds)" grep -q 'in use by another process' <<<"$out"
stop_term
check "A: SIGTERM with no block left exits 0 (exit $RC; the log holds everything)" test "$RC" = 0
check "A: it logged that the closing checkpoint found no space" grep -q 'event=checkpoint_skipped' "$LOG_A"
check "A: idemd restarts again with no block left" start_idemd "$A" "$LOG_A"
rm -f "$MNT"/filler-last*

# Free the space: new claims must succeed again without a restart, within a few seconds.
rm -f "$MNT/filler"
sync -f "$MNT" 2>/dev/null
t0=$(date +%s%N)
r=""
for i in $(seq 1 100); do
    r=$($LOAD claimcommit --port "$PORT" --key "after:$i" --ack "$ACK_A" --result-bytes "$RESULT_BYTES")
    grep -q '^new' <<<"$r" && break
    sleep 0.1
done
ms=$((($(date +%s%N) - t0) / 1000000))
check "A: after the filler is removed a new claim succeeds in ${ms} ms (at most 10 s)" grep -q '^new' <<<"$r"
check "A: and its commit answers +OK ($r)" test "$r" = "new +OK"
out=$(fill again "$ACK_A" 4 50)
echo "# after freeing space: $out"
check "A: 200 more claims commit after space came back" test "$(field_of committed "$out")" = 200

# Crash and restart: every acknowledged key is there.
kill9
check "A: idemd restarts on the same store after kill -9" start_idemd "$A" "$LOG_A"
check_acks "A: every acknowledged key survives the restart" "$ACK_A"
r=$(cmd IDEM.CLAIM post:1 86400000 60000)
check "A: new claims succeed after the restart" grep -q '^new :' <<<"$r"
stop_term
check "A: SIGTERM drains and exits 0 (exit $RC)" test "$RC" = 0
"$IDEMCTL" verify "$A" >"$WORK/verify-a" 2>&1
vrc=$?
sed 's/^/# /' "$WORK/verify-a" | tail -2
check "A: idemctl verify finds the store sound" test "$vrc" = 0

# =========================== Scenario B: --max-disk ===========================
B=$MNT/b
ACK_B=$WORK/ack-b
LOG_B=$WORK/idemd-b.log
: >"$ACK_B"
check "B: store created with 1 MiB segments" "$WORK/mkstore" "$B" 1048576
start_idemd "$B" "$LOG_B" --max-disk 6m || not_ok "B: idemd starts with --max-disk 6m"
out=$(fill cap "$ACK_B" 4 100000)
echo "# fill to --max-disk 6m: $out"
check "B: claims answer -FULL at --max-disk ($(field_of full "$out") answers)" test "$(field_of full "$out")" -gt 0
check "B: claims were acknowledged before the limit ($(field_of committed "$out"))" test "$(field_of committed "$out")" -gt 0
check "B: no unexpected answers during the fill" test "$(field_of other "$out")" = 0
check "B: idemd is still running at the limit" alive
check_acks "B: every acknowledged key reads back at the limit" "$ACK_B"
r=$(admin IDEM.STATS)
echo "# stats at the limit: $(grep -o 'disk_bytes :[0-9]*\|max_disk_bytes :[0-9]*' <<<"$r" | tr '\n' ' ')"
stop_term
check "B: SIGTERM at the limit exits 0 (exit $RC)" test "$RC" = 0
check "B: idemd restarts with --max-disk 32m" start_idemd "$B" "$LOG_B" --max-disk 32m
check_acks "B: every acknowledged key survives the restart" "$ACK_B"
r=$(cmd IDEM.CLAIM post:b 86400000 60000)
check "B: new claims succeed under the higher limit" grep -q '^new :' <<<"$r"
stop_term
check "B: SIGTERM exits 0 (exit $RC)" test "$RC" = 0

# ================ Scenario C: no block left, with room in the log's segments ================
# The log's own space is allocated, so claims go on into it; the writes after the crash (over
# the last block the log wrote, then over the filler's zeros) must need no new block.
C=$MNT/c
ACK_C=$WORK/ack-c
LOG_C=$WORK/idemd-c.log
: >"$ACK_C"
check "C: store created with 1 MiB segments" "$WORK/mkstore" "$C" 1048576
start_idemd "$C" "$LOG_C" || not_ok "C: idemd starts"
out=$(fill warmc "$ACK_C" 2 25)
check "C: 50 warm-up claims committed" test "$(field_of committed "$out")" = 50
# The filler zero-fills the spare (segment 2; with 1 MiB segments nothing of segment 1): wait
# until filefrag shows no unwritten extent in it, so that the log's writes there go over zeros.
SPARE_C=$C/wal-0000000000000002.log
if command -v filefrag >/dev/null 2>&1; then
    for _ in $(seq 1 200); do
        [ -f "$SPARE_C" ] && ! filefrag -v "$SPARE_C" 2>/dev/null | grep -q unwritten && break
        sleep 0.05
    done
    check "C: the spare is zero-filled (no unwritten extent)" \
        test -f "$SPARE_C" -a "$(filefrag -v "$SPARE_C" 2>/dev/null | grep -c unwritten)" = 0
else
    echo "# filefrag is not installed: the spare's zeros are not checked"
    sleep 1
fi
take_last_blocks filler-c
check "C: others hold every block ($(avail_bytes) bytes free)" test "$(avail_bytes)" -lt 4096
# At most 160 claims, about a third of the room (a claim and its commit take a block each at
# this rate): the restart must find room left.
fill loadc "$ACK_C" 4 40 >"$WORK/fill-c.out" 2>/dev/null &
FILL_PID=$!
for _ in $(seq 1 400); do # until 50 claims of the load are in, or it ended (at most 400 polls)
    [ "$(stat_of claims_new)" -ge 100 ] 2>/dev/null && break
    kill -0 "$FILL_PID" 2>/dev/null || break
    sleep 0.05
done
kill9
wait "$FILL_PID"
echo "# killed under load: $(head -1 "$WORK/fill-c.out")"
check "C: claims were acknowledged with no block left ($(grep -c . "$ACK_C") acknowledgements)" \
    test "$(grep -c . "$ACK_C")" -ge 90
check "C: idemd restarts after kill -9 under load" start_idemd "$C" "$LOG_C"
out=$(fill againc "$ACK_C" 4 100000)
echo "# claims after the restart: $out"
check "C: claims after the restart are acknowledged ($(field_of committed "$out") committed)" \
    test "$(field_of committed "$out")" -gt 0
check "C: and answer -FULL once the segments are used" test "$(field_of full "$out")" -gt 0
check "C: no answer other than new/+OK/-FULL" test "$(field_of other "$out")" = 0
r=$(admin IDEM.STATS)
check "C: no fatal error" grep -q 'fatal :0' <<<"$r"
kill9
check "C: idemd restarts once more" start_idemd "$C" "$LOG_C"
check_acks "C: every acknowledged key is there after the restarts" "$ACK_C"
check "C: no fatal error was logged" test "$(grep -c 'event=fatal_io_error' "$LOG_C")" = 0
check "C: no zeros were passed over (no fill_off, no fill_skipped)" \
    test "$(grep -c 'event=fill_off\|event=fill_skipped' "$LOG_C")" = 0
stop_term
check "C: SIGTERM exits 0 (exit $RC)" test "$RC" = 0
rm -f "$MNT"/filler-c*

# ======== Scenario E: the store fills the disk itself, and frees it once keys expire ========
# No filler: the log takes the file system until the next segment finds no room. The reserve
# (disk_reserve.h) is let go then, so that compaction and a checkpoint can free the expired
# keys' segments: before it, the store answered FULL for good, whatever expired. On ext4 the
# file system is made again as most are, with 5% of its blocks kept for root, which idemd, run
# as root here, fills too (df shows 0 bytes free while it still writes).
E_FS=ok
if [ "$FS" = ext4 ]; then
    umount "$MNT" && mkfs.ext4 -q -F "$LOOPDEV" >/dev/null 2>&1 && mount "$LOOPDEV" "$MNT" || E_FS=""
else
    rm -rf "$A" "$B" "$C" "$MNT"/filler*
fi
if [ -z "$E_FS" ] || ! mountpoint -q "$MNT"; then
    not_ok "E: the file system could not be made again: scenario E is not run"
else # scenario E, to its end
E=$MNT/e
ACK_E=$WORK/ack-e
LOG_E=$WORK/idemd-e.log
: >"$ACK_E"
check "E: store created with 1 MiB segments" "$WORK/mkstore" "$E" 1048576
check "E: idemd starts with a test clock" start_idemd "$E" "$LOG_E" --test-clock
check "E: the reserve is held, as IDEM.STATS says" \
    test "$(stat -c %s "$E/reserve")" = "$(stat_of disk_reserve_bytes)" -a -s "$E/reserve"
alloc=$(stat -c '%b %B %s' "$E/reserve" 2>/dev/null) || alloc="0 0 1"
check "E: and allocated ($alloc: blocks, bytes each, size)" \
    test "$(awk '{print ($1 * $2 >= $3 && $3 > 0) ? "yes" : "no"}' <<<"$alloc")" = yes
# Results of 4 KiB that lz4 cannot shrink fill the disk in about 10,000 keys, not 100,000
fille() { $LOAD fill --port "$PORT" --prefix "$1" --ack "$2" --conns 4 --max-keys "$3" \
    --result-bytes 4096 --incompressible --full-stop 10 --timeout 120; }
# A fill ends at its first -FULL answers, which may come while compaction still frees space
# (the log outran it): fill again until the store has let its reserve go.
other=0 fills=0
while [ "$fills" -lt 10 ]; do
    fills=$((fills + 1))
    out=$(fille "loade$fills" "$ACK_E" 100000)
    echo "# fill $fills by the store itself: $out, free $(avail_bytes) bytes"
    o=$(field_of other "$out")
    other=$((other + ${o:-1}))
    for _ in $(seq 1 30); do # the flusher tries the next segment again once a second
        [ "$(stat_of disk_reserve_released)" = 1 ] && break
        sleep 0.1
    done
    [ "$(stat_of disk_reserve_released)" = 1 ] && break
done
check "E: no answer other than new/+OK/-FULL" test "$other" = 0
check "E: the reserve was let go once the store filled the disk ($fills fills)" \
    test "$(stat_of disk_reserve_released)" = 1
check "E: and that was logged" grep -q 'event=disk_reserve_released' "$LOG_E"
r=$(cmd IDEM.CLAIM fresh:e 86400000 60000)
check "E: a new claim answers -FULL ($r)" grep -q '^-FULL' <<<"$r"
# Every key's ttl (a day) passes; the clock goes on in steps of 10 s, as compaction and the
# checkpoint that retires its segments count store time.
admin DEBUG CLOCK ADVANCE 172800000 >/dev/null
got=""
for i in $(seq 1 240); do # at most 240 tries (btrfs frees blocks as its transactions commit)
    admin DEBUG CLOCK ADVANCE 10000 >/dev/null
    r=$(cmd IDEM.CLAIM "after:e:$i" 86400000 60000)
    if grep -q '^new :' <<<"$r"; then got=$i; break; fi
    sleep 0.25
done
check "E: new claims are taken again once the keys expired, without a restart (try ${got:-none})" \
    test -n "$got"
# The live keys took about 18 MB before they expired: only their expiry frees more than that.
for _ in $(seq 1 300); do # at most 300 tries, about two minutes
    [ "$(avail_bytes)" -ge $((25 << 20)) ] && break
    admin DEBUG CLOCK ADVANCE 10000 >/dev/null
    sleep 0.25
done
check "E: the expired keys' space is freed ($(avail_bytes) bytes free, at least 25 MiB)" \
    test "$(avail_bytes)" -ge $((25 << 20))
check "E: the reserve was taken back" grep -q 'event=disk_reserve_taken' "$LOG_E"
check "E: IDEM.STATS says so" test "$(stat_of disk_reserve_released)" = 0
out=$(fille againe "$WORK/ack-e2" 250)
echo "# claims once the space came back: $out"
check "E: the freed space takes 1000 new keys ($(field_of committed "$out") committed)" \
    test "$(field_of committed "$out")" = 1000
r=$(admin IDEM.STATS)
check "E: no fatal error" grep -q 'fatal :0' <<<"$r"
res=$($LOAD check --port "$PORT" --ack "$WORK/ack-e2" --result-bytes 4096 --incompressible)
echo "# $(head -1 <<<"$res")"
check "E: every key acknowledged after the space came back reads back" \
    grep -q ' bad=0$' <<<"$(head -1 <<<"$res")"
stop_term
check "E: SIGTERM exits 0 (exit $RC)" test "$RC" = 0
"$IDEMCTL" verify "$E" >"$WORK/verify-e" 2>&1
vrc=$?
check "E: idemctl verify finds the store sound (exit $vrc)" test "$vrc" = 0
fi

# ====== Scenario D (btrfs): two copies of the data, where the files stay copy on write ======
# NOCOW would take away btrfs's checksums, with which it picks and repairs the good copy; so
# there nothing is marked, and no zeros are written ahead of the log.
if [ "$FS" = btrfs ] && command -v lsattr >/dev/null 2>&1; then
    MNT2=$WORK/mnt2
    mkdir -p "$MNT2"
    truncate -s 256M "$WORK/dup.img" # sparse; mkfs.btrfs wants 229 MiB for data DUP
    if mkfs.btrfs -q -f -d dup -m dup "$WORK/dup.img" >/dev/null 2>&1 &&
        LOOPDEV2=$(losetup -f --show "$WORK/dup.img" 2>/dev/null) && mount "$LOOPDEV2" "$MNT2"; then
        D=$MNT2/d
        LOG_D=$WORK/idemd-d.log
        check "D: store created on a btrfs with data DUP" "$WORK/mkstore" "$D" 1048576
        start_idemd "$D" "$LOG_D" || not_ok "D: idemd starts"
        nocow=$(for f in $(find "$D" -maxdepth 1 -type f); do lsattr "$f"; done 2>/dev/null | awk '$1 ~ /C/' | wc -l)
        check "D: no file is NOCOW there ($nocow show C)" test "$nocow" = 0
        check "D: no zeros are written ahead of the log (fill_off)" grep -q 'event=fill_off' "$LOG_D"
        r=$(cmd IDEM.CLAIM d:1 86400000 60000)
        check "D: claims are answered ($r)" grep -q '^new :' <<<"$r"
        stop_term
        check "D: SIGTERM exits 0 (exit $RC)" test "$RC" = 0
    else
        echo "# a btrfs with data DUP could not be made: scenario D is skipped"
    fi
fi

if [ "$failed" -gt 0 ]; then
    echo "# idemd logs (last lines):"
    tail -n 15 "$LOG_A" "$LOG_B" "$LOG_C" "$LOG_E" 2>/dev/null | sed 's/^/#   /'
fi
echo "$passed passed, $failed failed"
[ "$failed" -eq 0 ]
