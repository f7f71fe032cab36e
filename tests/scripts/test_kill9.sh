#!/usr/bin/env bash
# test_kill9.sh: the kill -9 loop (issue 3), driven by tests/python/kill9_loop.py with
# /usr/bin/python3 and python3-redis: idemd in sync mode on a temp dir is killed with SIGKILL
# at random moments (50-500 ms, sometimes again while it recovers) while 16 connections claim
# and commit, then restarted on the same dir; every acknowledged reply (logged, flushed per
# line) is checked after each restart: same token, same result, committed records and
# first_seen unchanged, no key granted `new` twice, tokens strictly increasing across restarts.
# KILL_CYCLES (default 20; the long tier runs 10000) and KILL_SEED choose the run.
set -u
IDEM_SOURCE_DIR=${IDEM_SOURCE_DIR:-$(cd "$(dirname "$0")/../.." && pwd)}
IDEM_BUILD_DIR=${IDEM_BUILD_DIR:-$IDEM_SOURCE_DIR/build}
export IDEM_SOURCE_DIR IDEM_BUILD_DIR
PY=/usr/bin/python3
CYCLES=${KILL_CYCLES:-20}

if ! "$PY" -c 'import redis' 2>/dev/null; then
    echo "python3-redis is missing for $PY (apt-get install python3-redis)"
    echo "0 passed, 1 failed"
    exit 1
fi
if [ ! -x "$IDEM_BUILD_DIR/idemd" ]; then
    echo "no idemd in IDEM_BUILD_DIR ($IDEM_BUILD_DIR)"
    echo "0 passed, 1 failed"
    exit 1
fi
# 20 cycles take about 20-40 s; a longer run gets no time limit from here.
limit=0
[ "$CYCLES" -le 100 ] && limit=280
if [ "$limit" -gt 0 ]; then
    exec timeout -k 10 "$limit" "$PY" -u "$IDEM_SOURCE_DIR/tests/python/kill9_loop.py" --cycles "$CYCLES"
fi
exec "$PY" -u "$IDEM_SOURCE_DIR/tests/python/kill9_loop.py" --cycles "$CYCLES"
