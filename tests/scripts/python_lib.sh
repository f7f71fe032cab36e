# python_lib.sh: what the script tests whose clients are Python share (sourced, not run by
# ctest): the build and source directories exported, /usr/bin/python3 as PY, and
# python_preflight, which ends the script as a failed test when python3-redis or one of the
# programs it names is missing from IDEM_BUILD_DIR.

IDEM_SOURCE_DIR=${IDEM_SOURCE_DIR:-$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)}
IDEM_BUILD_DIR=${IDEM_BUILD_DIR:-$IDEM_SOURCE_DIR/build}
export IDEM_SOURCE_DIR IDEM_BUILD_DIR
PY=/usr/bin/python3

python_preflight() { # program...
    local p
    if ! "$PY" -c 'import redis' 2>/dev/null; then
        echo "python3-redis is missing for $PY (apt-get install python3-redis)"
        echo "0 passed, 1 failed"
        exit 1
    fi
    for p in "$@"; do
        if [ ! -x "$IDEM_BUILD_DIR/$p" ]; then
            echo "no $p in IDEM_BUILD_DIR ($IDEM_BUILD_DIR)"
            echo "0 passed, 1 failed"
            exit 1
        fi
    done
}
