#!/usr/bin/env bash
# test_python.sh: runs tests/python/test_idemd.py (the contract over the wire with redis-py)
# with /usr/bin/python3 and Debian's python3-redis; the Python test starts and stops its own
# idemd instances on temp dirs and prints the closing `N passed, M failed` line.
set -u
source "$(dirname "$0")/python_lib.sh"

python_preflight idemd
echo "python $("$PY" -c 'import sys; print(sys.version.split()[0])'), redis-py $("$PY" -c 'import redis; print(redis.__version__)')"
# -u: unbuffered, so a timeout still shows how far it got
exec timeout -k 10 280 "$PY" -u "$IDEM_SOURCE_DIR/tests/python/test_idemd.py"
