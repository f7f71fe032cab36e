#!/usr/bin/env bash
# test_wire_model.sh: tests/python/wire_model.py (a seeded random sequence of commands against
# idemd, each reply checked against a reference model of the contract, every key read back four
# ways after each step and after each restart) in three settings: sync with the recover policy
# and restarts by SIGTERM or SIGKILL, batch with the review policy, none. WIRE_MODEL_STEPS steps
# each (default 4000); WIRE_MODEL_SEED picks the first seed (the others follow it).
set -u
source "$(dirname "$0")/python_lib.sh"
STEPS=${WIRE_MODEL_STEPS:-4000}
SEED=${WIRE_MODEL_SEED:-$(( $(od -An -N4 -tu4 /dev/urandom) + 1 ))}

python_preflight idemd
status=0
run=0
for cfg in "sync recover" "batch review" "none recover"; do
    set -- $cfg
    # a step takes about a millisecond, a restart a few hundred: ample, and the three settings
    # at the CI count within ctest's 600 s
    timeout -k 10 $(( 60 + STEPS / 40 )) "$PY" -u "$IDEM_SOURCE_DIR/tests/python/wire_model.py" \
        --steps "$STEPS" --seed $(( SEED + run )) --durability "$1" --policy "$2" || status=1
    run=$((run + 1))
done
exit $status
