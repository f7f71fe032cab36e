#!/usr/bin/env bash
# test_python.sh: runs tests/python/test_idemd.py (the contract over the wire with redis-py)
# with /usr/bin/python3 and Debian's python3-redis; the Python test starts and stops its own
# idemd instances on temp dirs and prints the closing `N passed, M failed` line.
set -u
IDEM_SOURCE_DIR=${IDEM_SOURCE_DIR:-$(cd "$(dirname "$0")/../.." && pwd)}
IDEM_BUILD_DIR=${IDEM_BUILD_DIR:-$IDEM_SOURCE_DIR/build}
export IDEM_SOURCE_DIR IDEM_BUILD_DIR
PY=/usr/bin/python3

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
echo "python $("$PY" -c 'import sys; print(sys.version.split()[0])'), redis-py $("$PY" -c 'import redis; print(redis.__version__)')"
# -u: unbuffered, so a timeout still shows how far it got
exec timeout -k 10 280 "$PY" -u "$IDEM_SOURCE_DIR/tests/python/test_idemd.py"
