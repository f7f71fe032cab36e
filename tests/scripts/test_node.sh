#!/usr/bin/env bash
# test_node.sh: idemd with ioredis (tests/node/test_ioredis.js): claims, commit, done with
# result, SET NX, a pipeline, custom commands via redis.call. Runs `npm ci` in tests/node if
# node_modules is missing; if node, npm or the install is unavailable it says why and ends with
# `0 passed, 0 failed, 1 skipped` and exit code 77, which ctest reports as skipped (the test's
# SKIP_RETURN_CODE), never as passed.
set -u
. "$(dirname "$0")/idemd_lib.sh"
NODE_DIR=$IDEM_SOURCE_DIR/tests/node

skip() {
    echo "SKIP node tests: $1"
    echo "0 passed, 0 failed, 1 skipped"
    exit 77
}

command -v node >/dev/null || skip "node is not installed"
command -v npm >/dev/null || skip "npm is not installed"
if [ ! -d "$NODE_DIR/node_modules/ioredis" ]; then
    echo "npm ci in tests/node"
    if ! (cd "$NODE_DIR" && timeout 180 npm ci --no-audit --no-fund >"$T/npm.log" 2>&1); then
        tail -5 "$T/npm.log"
        rm -rf "$NODE_DIR/node_modules"
        skip "npm ci failed (registry unreachable?), see the lines above"
    fi
fi
echo "node $(node --version), ioredis $(node -p "require('$NODE_DIR/node_modules/ioredis/package.json').version")"

start_idemd_free main "$T/d" --test-clock || {
    echo "0 passed, 1 failed"
    exit 1
}
IDEMD_PORT=$PORT IDEMD_SOCK=$T/d/idemd.sock timeout -k 5 150 node "$NODE_DIR/test_ioredis.js" | tee "$T/node.out"
rc=${PIPESTATUS[0]}
if ! stop_idemd "$IDEMD_PID" TERM; then
    # one more failure: the closing line is printed again with it
    echo "FAIL idemd did not exit 0 on SIGTERM"
    read -r p _ f _ < <(grep -E '^[0-9]+ passed, [0-9]+ failed' "$T/node.out" | tail -1)
    echo "${p:-0} passed, $((${f:-0} + 1)) failed"
    rc=1
fi
exit "$rc"
