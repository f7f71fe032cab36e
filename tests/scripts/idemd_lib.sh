# idemd_lib.sh: helpers shared by the script tests (sourced, not run by ctest): a temp dir
# removed on exit, starting idemd on a free 127.0.0.1 port and waiting until it is ready,
# stopping every idemd started here by pid, and pass/fail counting with the closing line.

IDEM_SOURCE_DIR=${IDEM_SOURCE_DIR:-$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)}
IDEM_BUILD_DIR=${IDEM_BUILD_DIR:-$IDEM_SOURCE_DIR/build}
IDEMD=$IDEM_BUILD_DIR/idemd
SYS_PY=/usr/bin/python3

PASS=0
FAIL=0
SKIP=0
IDEM_PIDS=()
T=$(mktemp -d /tmp/idem-script.XXXXXX)

lib_cleanup() {
    local p
    for p in "${IDEM_PIDS[@]}"; do
        kill -9 "$p" 2>/dev/null
        wait "$p" 2>/dev/null
    done
    if [ "${KEEP_TMP:-0}" = 1 ]; then
        echo "kept $T"
    else
        rm -rf "$T"
    fi
}
trap lib_cleanup EXIT
trap 'exit 130' INT TERM

ok() {
    PASS=$((PASS + 1))
    [ -n "${VERBOSE:-}" ] && echo "ok   $1"
    return 0
}

bad() {
    FAIL=$((FAIL + 1))
    echo "FAIL $1"
    shift
    [ $# -gt 0 ] && printf '     %s\n' "$@"
    return 0
}

# finish: prints the closing line and exits with the verdict.
finish() {
    if [ "$SKIP" -gt 0 ]; then
        echo "$PASS passed, $FAIL failed, $SKIP skipped"
    else
        echo "$PASS passed, $FAIL failed"
    fi
    [ "$FAIL" -eq 0 ] && [ "$PASS" -gt 0 -o "$SKIP" -gt 0 ]
    exit $?
}

free_port() {
    $SYS_PY -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'
}

# start_idemd NAME DIR PORT [flags...]: starts idemd in the background (its log is
# $T/NAME.log), waits up to 30 s for event=ready, sets IDEMD_PID. Returns 1 if it exited or
# never became ready.
start_idemd() {
    local name=$1 dir=$2 port=$3
    shift 3
    touch "$T/$name.log"
    # Ready lines already in the log are an earlier start's: wait for one more.
    local ready_before
    ready_before=$(grep -c 'event=ready' "$T/$name.log")
    "$IDEMD" --dir "$dir" --port "$port" "$@" >>"$T/$name.log" 2>&1 &
    IDEMD_PID=$!
    IDEM_PIDS+=("$IDEMD_PID")
    local i
    for ((i = 0; i < 300; i++)); do
        if ! kill -0 "$IDEMD_PID" 2>/dev/null; then
            echo "idemd ($name) exited before ready:"
            tail -5 "$T/$name.log"
            return 1
        fi
        if [ "$(grep -c 'event=ready' "$T/$name.log")" -gt "$ready_before" ]; then
            return 0
        fi
        sleep 0.1
    done
    echo "idemd ($name) not ready after 30 s"
    return 1
}

# start_idemd_free NAME DIR [flags...]: as start_idemd on a free port (retried if the port is
# taken between the probe and the bind); sets PORT.
start_idemd_free() {
    local name=$1 dir=$2 try
    shift 2
    for try in 1 2 3 4 5; do
        PORT=$(free_port)
        start_idemd "$name" "$dir" "$PORT" "$@" && return 0
        grep -qi 'address already in use\|bind' "$T/$name.log" || return 1
    done
    return 1
}

stop_idemd() { # stop_idemd PID [signal]
    kill "-${2:-TERM}" "$1" 2>/dev/null
    wait "$1" 2>/dev/null
}
