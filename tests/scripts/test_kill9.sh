#!/usr/bin/env bash
# test_kill9.sh: the kill -9 loop (issue 3), driven by tests/python/kill9_loop.py with
# /usr/bin/python3 and python3-redis: idemd in sync mode on a temp dir is killed with SIGKILL
# at random moments (50-500 ms, sometimes again while it recovers) while 16 connections claim
# and commit, then restarted on the same dir; every acknowledged reply (logged, flushed per
# line) is checked after each restart: same token, same result, committed records and
# first_seen unchanged, no key granted `new` twice, tokens strictly increasing across restarts.
# Then a short batch-mode loop: acknowledged changes may be lost there, those of the last 10 ms
# (the batch interval) and of the flush under way only: a loss acknowledged more than
# KILL_LOSS_WINDOW_MS (default 250) before its kill fails the run. That is the interval, a flush
# (this machine's virtual disk takes 30-130 ms for one flush at times, in sync mode too: a loss
# 97 ms old was seen on a quiet machine, 130 ms under two kill loops) and scheduling slack; a
# flusher that stops or sleeps its idle second with changes pending still fails it. Tokens
# must still never repeat or go back. Last a durability-none loop: any acknowledged change may
# be lost there (nothing bounds the loss), but what the store holds must be what some reply
# said, and tokens must never repeat or go back ("in any mode").
# KILL_CYCLES (sync cycles, default 20; the long tier runs 10000), KILL_BATCH_CYCLES (default
# 5; 0: none), KILL_NONE_CYCLES (default 3; 0: none) and KILL_SEED choose the run.
set -u
source "$(dirname "$0")/python_lib.sh"
CYCLES=${KILL_CYCLES:-20}
BATCH_CYCLES=${KILL_BATCH_CYCLES:-5}
NONE_CYCLES=${KILL_NONE_CYCLES:-3}
LOOP=$IDEM_SOURCE_DIR/tests/python/kill9_loop.py

python_preflight idemd
OUT=$(mktemp /tmp/idem-kill9-out.XXXXXX)
LOOP_PID=
# the loop removes its own idemd and temp dir when it gets SIGTERM
trap '[ -n "$LOOP_PID" ] && kill "$LOOP_PID" 2>/dev/null && wait "$LOOP_PID"; rm -f "$OUT"' EXIT
trap 'exit 143' TERM INT

# run_loop ARGS...: one loop; short runs get a time limit, the long tier none.
run_loop() {
    local lim=()
    [ "$CYCLES" -le 100 ] && lim=(timeout -k 10 200)
    "${lim[@]}" "$PY" -u "$LOOP" "$@" > >(tee -a "$OUT") &
    LOOP_PID=$!
    wait "$LOOP_PID"
    local st=$?
    LOOP_PID=
    return "$st"
}

rc=0
run_loop --cycles "$CYCLES" --durability sync || rc=1
if [ "$BATCH_CYCLES" -gt 0 ]; then
    KILL_LOSS_WINDOW_MS=${KILL_LOSS_WINDOW_MS:-250} run_loop --cycles "$BATCH_CYCLES" \
        --durability batch || rc=1
fi
if [ "$NONE_CYCLES" -gt 0 ]; then
    KILL_LOSS_WINDOW_MS=inf run_loop --cycles "$NONE_CYCLES" --durability none || rc=1
fi
# the closing line: the cycles of both loops
read -r p f < <(grep -E '^[0-9]+ passed, [0-9]+ failed' "$OUT" | awk '{p += $1; f += $3} END {print p + 0, f + 0}')
[ "$rc" -ne 0 ] && [ "$f" -eq 0 ] && f=1
echo "kill9 total: sync $CYCLES + batch $BATCH_CYCLES + none $NONE_CYCLES cycles"
echo "$p passed, $f failed"
[ "$rc" -eq 0 ] && [ "$f" -eq 0 ]
