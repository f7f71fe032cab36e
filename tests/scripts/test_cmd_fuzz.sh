#!/usr/bin/env bash
# test_cmd_fuzz.sh: random commands against a live idemd (tests/python/cmd_fuzz.py, with
# /usr/bin/python3): pipelines of well-framed requests with names and arguments drawn at random,
# each answered once, in order, well-formed, the connection kept; backups made meanwhile
# verified; idemd alive, its log clean, exit 0 at SIGTERM (or SIGKILL in sync mode), the store
# verified and opened again with its records, and so is a backup of it at rest. Two runs of CMD_FUZZ_SECONDS (default
# 15) with different seeds, so two of idemd's drawn settings; CMD_FUZZ_SEED picks the first
# (the second is one more). The long tier runs it for longer (tests/long/run.sh, cmd_fuzz).
set -u
source "$(dirname "$0")/python_lib.sh"
SECONDS_EACH=${CMD_FUZZ_SECONDS:-15}
SEED=${CMD_FUZZ_SEED:-$(( $(od -An -N4 -tu4 /dev/urandom) + 1 ))}

python_preflight idemd idemctl
status=0
for run in 0 1; do
    # the time limit: the run, a claim's WAIT of up to 60 s that a draw may make, restarts
    timeout -k 10 $(( SECONDS_EACH + 150 )) "$PY" -u "$IDEM_SOURCE_DIR/tests/python/cmd_fuzz.py" \
        --seconds "$SECONDS_EACH" --seed $(( SEED + run )) || status=1
done
exit $status
