#!/usr/bin/env bash
# test_redis_cli.sh: a first session with redis-cli against idemd (temp dir, --test-clock, a
# free 127.0.0.1 port, the unix socket as admin): every claim outcome, the owner calls, SET NX
# PX/EX/GET, GET, EXISTS, PTTL/TTL, DBSIZE, PING, ECHO, INFO, HELLO 2/3, CLIENT, SELECT,
# COMMAND, CONFIG GET, commands refused by name, the expiry boundary under DEBUG CLOCK, and
# roles with --user (NOAUTH, WRONGPASS, NOPERM).
set -u
. "$(dirname "$0")/idemd_lib.sh"

if ! command -v redis-cli >/dev/null; then
    echo "redis-cli not installed"
    echo "0 passed, 1 failed"
    exit 1
fi

start_idemd_free main "$T/d" --test-clock || {
    echo "0 passed, 1 failed"
    exit 1
}
SOCK=$T/d/idemd.sock
MAIN_PID=$IDEMD_PID

R() { redis-cli --no-raw -h 127.0.0.1 -p "$PORT" "$@" 2>&1; } # TCP: role worker
A() { redis-cli --no-raw -s "$SOCK" "$@" 2>&1; }            # unix socket: role admin

# expect NAME EXPECTED GOT: exact comparison of redis-cli's --no-raw output.
expect() {
    if [ "$2" = "$3" ]; then ok "$1"; else bad "$1" "expected: $(printf %q "$2")" "got:      $(printf %q "$3")"; fi
}
# expect_re NAME REGEX GOT: the output matches an extended regex (grep -E, whole output).
expect_re() {
    if printf '%s' "$3" | grep -Eq -- "$2"; then ok "$1"; else bad "$1" "expected /$2/" "got: $(printf %q "$3")"; fi
}
# expect_lines NAME PCRE GOT: the whole output matches a Perl regex across its lines (\n in the
# pattern; ^ and $ are the output's start and end). expect_re took a pattern with newlines for
# several patterns, any one of which matched: such checks could not fail.
expect_lines() {
    if printf '%s' "$3" | grep -Pzq -- "$2"; then ok "$1"; else bad "$1" "expected /$2/" "got: $(printf %q "$3")"; fi
}
tok() { sed -n 's/^2) (integer) //p' <<<"$1"; }
field() { # field NAME < IDEM.GET output (--no-raw): the value after the field name
    awk -v f="\"$1\"" '{ sub(/^ *[0-9]+\) /, "") } prev == f { gsub(/"/, ""); print; exit } { prev = $0 }'
}

# ---- connection commands ----
expect "PING" "PONG" "$(R PING)"
expect "PING msg" '"hello"' "$(R PING hello)"
expect "ECHO" '"hello world"' "$(R ECHO 'hello world')"
expect_re "INFO loading:0" '^loading:0' "$(R INFO | tr -d '\r')"
expect_re "INFO persistence" '^durability:sync' "$(R INFO persistence | tr -d '\r')"
expect_re "HELLO 3 -NOPROTO" '^\(error\) NOPROTO' "$(R HELLO 3)"
hello=$(R HELLO 2)
expect_re "HELLO 2 proto 2" '"proto"' "$hello"
expect_re "HELLO 2 proto 2 value" '\(integer\) 2' "$hello"
expect_re "CLIENT ID" '^\(integer\) [0-9]+$' "$(R CLIENT ID)"
expect "CLIENT SETNAME/GETNAME" $'OK\n"w-1"' "$(printf 'CLIENT SETNAME w-1\nCLIENT GETNAME\n' | R)"
expect "CLIENT SETINFO" "OK" "$(R CLIENT SETINFO lib-name cli-test)"
expect "SELECT 0" "OK" "$(R SELECT 0)"
expect_re "SELECT 1 refused" '^\(error\) ERR' "$(R SELECT 1)"
cmds=$(R COMMAND)
expect_re "COMMAND lists idem.claim" '"idem.claim"' "$cmds"
expect_re "COMMAND lists set" '"set"' "$cmds"
expect_re "COMMAND COUNT" '^\(integer\) [1-9][0-9]*$' "$(R COMMAND COUNT)"
expect_re "COMMAND DOCS answers" '^ *1\) "idem.claim"' "$(R COMMAND DOCS)"
expect "COMMAND DOCS names" $'1) "get"' "$(R COMMAND DOCS get nosuch | head -1)"
# Interactive redis-cli builds HELP and its typing hints from COMMAND DOCS (TERM=dumb: its line
# editor reads plain lines, under `script`'s terminal). It showed nothing for any command.
if command -v script >/dev/null; then
    help=$( (sleep 1; printf 'HELP IDEM.CLAIM\r\nHELP SET\r\nquit\r\n'; sleep 1) |
        TERM=dumb timeout 10 script -qec "redis-cli -h 127.0.0.1 -p $PORT" /dev/null 2>&1 |
        sed 's/\x1b\[[0-9;]*m//g' | tr -d '\r')
    expect_re "redis-cli HELP IDEM.CLAIM" \
        'IDEM.CLAIM key ttl_ms lease_ms \[FP content\] \[OWNER id\] \[WAIT ms\]' "$help"
    expect_re "redis-cli HELP IDEM.CLAIM summary" 'summary: Reserves a key before a side effect' "$help"
    expect_re "redis-cli HELP SET" 'SET key value NX PX milliseconds\|EX seconds \[GET\]' "$help"
fi
expect $'COMMAND INFO idem.claim' '1) 1) "idem.claim"' "$(R COMMAND INFO idem.claim | head -1)"
expect $'CONFIG GET durability (admin)' $'1) "durability"\n2) "sync"' "$(A CONFIG GET durability)"
expect_re "CONFIG GET * has dir" '"dir"' "$(A CONFIG GET '*')"
# Several patterns, as Redis 7 takes them: each setting once.
expect $'CONFIG GET two patterns' $'1) "port"\n2) "'"$PORT"$'"\n3) "durability"\n4) "sync"' \
    "$(A CONFIG GET durability port 'dur*')"
expect_re "CONFIG SET refused" '^\(error\) ERR' "$(A CONFIG SET durability none)"
expect_re "CONFIG GET long pattern named" 'pattern must be 0..127 bytes' "$(A CONFIG GET "$(printf 'd%.0s' $(seq 200))")"
expect_re "CONFIG GET worker NOPERM" '^\(error\) NOPERM' "$(R CONFIG GET durability)"

# ---- claim outcomes ----
out=$(R IDEM.CLAIM order:1 86400000 30000 FP '{"amount":100}')
expect_re "claim new" '^1\) "new"' "$out"
T1=$(tok "$out")
expect_re "token is an integer" '^[1-9][0-9]*$' "$T1"
expect "claim busy (clock stands still)" $'1) "busy"\n2) (integer) 30000' "$(R IDEM.CLAIM order:1 86400000 30000 FP '{"amount":100}')"
expect "GET of in_flight is nil" "(nil)" "$(R GET order:1)"
expect "PTTL of in_flight is -1" "(integer) -1" "$(R PTTL order:1)"
expect "TTL of in_flight is -1" "(integer) -1" "$(R TTL order:1)"
expect "EXTEND" "OK" "$(R IDEM.EXTEND order:1 "$T1" 60000)"
expect "busy after EXTEND" $'1) "busy"\n2) (integer) 60000' "$(R IDEM.CLAIM order:1 86400000 30000)"
expect_re "COMMIT stale token" '^\(error\) STALE' "$(R IDEM.COMMIT order:1 $((T1 + 1000)) inv_9f2)"
expect "COMMIT" "OK" "$(R IDEM.COMMIT order:1 "$T1" inv_9f2)"
expect "COMMIT repeated, same result" "OK" "$(R IDEM.COMMIT order:1 "$T1" inv_9f2)"
expect_re "COMMIT repeated, other result: CONFLICT" '^\(error\) CONFLICT' "$(R IDEM.COMMIT order:1 "$T1" inv_other)"
expect "claim done" $'1) "done"\n2) "inv_9f2"' "$(R IDEM.CLAIM order:1 86400000 30000 FP '{"amount":100}')"
expect "claim done without FP" $'1) "done"\n2) "inv_9f2"' "$(R IDEM.CLAIM order:1 86400000 30000)"
expect "claim mismatch" '1) "mismatch"' "$(R IDEM.CLAIM order:1 86400000 30000 FP '{"amount":999}')"
expect "GET committed" '"inv_9f2"' "$(R GET order:1)"
rec=$(R IDEM.GET order:1)
expect "IDEM.GET state" "committed" "$(field state <<<"$rec")"
expect "IDEM.GET result" "inv_9f2" "$(field result <<<"$rec")"
expect "IDEM.GET seen_count" "6" "$(field seen_count <<<"$rec")"
expect "IDEM.GET mismatch_count" "1" "$(field mismatch_count <<<"$rec")"
expect_re "IDEM.GET fingerprint hex" '^[0-9a-f]{32}$' "$(field fingerprint <<<"$rec")"
expect "IDEM.GET absent" "(nil)" "$(R IDEM.GET order:nope)"
expect_lines "conflicting_commits counted" '"conflicting_commits"\n *[0-9]+\) \(integer\) 1(\n|$)' "$(A IDEM.STATS)"

# OWNER: the same owner resumes with the same token; another owner is busy
out=$(R IDEM.CLAIM own:1 86400000 30000 OWNER worker-a)
TO=$(tok "$out")
expect "OWNER repeat: new, same token" $'1) "new"\n2) (integer) '"$TO" "$(R IDEM.CLAIM own:1 86400000 30000 OWNER worker-a)"
expect_re "other OWNER: busy" '^1\) "busy"' "$(R IDEM.CLAIM own:1 86400000 30000 OWNER worker-b)"

# release: the record is deleted, the next claim is new with a larger token
TR=$(tok "$(R IDEM.CLAIM rel:1 86400000 30000)")
expect "RELEASE" "OK" "$(R IDEM.RELEASE rel:1 "$TR")"
expect "RELEASE again: NOTFOUND" "$(printf '(error) NOTFOUND no such key (absent, expired or released)')" "$(R IDEM.RELEASE rel:1 "$TR")"
out=$(R IDEM.CLAIM rel:1 86400000 30000)
expect_re "claim after RELEASE: new" '^1\) "new"' "$out"
TR2=$(tok "$out")
if [ "${TR2:-0}" -gt "$TR" ]; then ok "token after release is larger"; else bad "token after release is larger" "$TR then $TR2"; fi
expect_re "RELEASE old token: STALE" '^\(error\) STALE' "$(R IDEM.RELEASE rel:1 "$TR")"

# hold: review with the note; the holder's token is no longer valid
TH=$(tok "$(R IDEM.CLAIM hold:1 86400000 30000)")
expect "HOLD" "OK" "$(R IDEM.HOLD hold:1 "$TH" 'gateway timed out')"
expect "HOLD repeated" "OK" "$(R IDEM.HOLD hold:1 "$TH" 'gateway timed out')"
expect "claim review" $'1) "review"\n2) "gateway timed out"' "$(R IDEM.CLAIM hold:1 86400000 30000)"
expect_re "COMMIT after HOLD: STALE" '^\(error\) STALE' "$(R IDEM.COMMIT hold:1 "$TH" x)"
expect "PTTL of review is -1" "(integer) -1" "$(R PTTL hold:1)"
expect_re "DEL of review refused (admin)" '^\(error\) ERR DEL refused' "$(A DEL hold:1)"
expect_re "DEL as worker: NOPERM" '^\(error\) NOPERM' "$(R DEL hold:1)"

# owner calls on an absent key
expect_re "COMMIT absent: NOTFOUND" '^\(error\) NOTFOUND' "$(R IDEM.COMMIT nokey 1 x)"
expect_re "HOLD absent: NOTFOUND" '^\(error\) NOTFOUND' "$(R IDEM.HOLD nokey 1 why)"
expect_re "EXTEND absent: NOTFOUND" '^\(error\) NOTFOUND' "$(R IDEM.EXTEND nokey 1 1000)"

# recover: the lease runs out at lease_until_ms (DEBUG CLOCK, admin only)
expect_re "DEBUG as worker: NOPERM" '^\(error\) NOPERM' "$(R DEBUG CLOCK GET)"
NOW=$(A DEBUG CLOCK GET | sed 's/(integer) //')
expect_re "DEBUG CLOCK GET" '^[1-9][0-9]+$' "$NOW"
expect_re "DEBUG CLOCK SET backwards refused" '^\(error\) ERR' "$(A DEBUG CLOCK SET $((NOW - 1)))"
TG=$(tok "$(R IDEM.CLAIM rec:1 86400000 1000)")
expect "DEBUG CLOCK ADVANCE 999" "(integer) $((NOW + 999))" "$(A DEBUG CLOCK ADVANCE 999)"
expect "lease_until-1: busy 1" $'1) "busy"\n2) (integer) 1' "$(R IDEM.CLAIM rec:1 86400000 1000)"
A DEBUG CLOCK ADVANCE 1 >/dev/null
out=$(R IDEM.CLAIM rec:1 86400000 1000)
expect_lines "lease_until: recover" '^1\) "recover"\n2\) \(integer\) [0-9]+\n3\) \(integer\) 2\n4\) \(integer\) '"$NOW"'$' "$out"
TG2=$(tok "$out")
expect_re "old owner after recover: STALE" '^\(error\) STALE' "$(R IDEM.COMMIT rec:1 "$TG" x)"
expect "recovering owner commits" "OK" "$(R IDEM.COMMIT rec:1 "$TG2" checked)"
# the old owner may still commit until the next claim (the transition is lazy)
TL=$(tok "$(R IDEM.CLAIM late:1 86400000 500)")
A DEBUG CLOCK ADVANCE 600 >/dev/null
expect "late owner commits before any claim" "OK" "$(R IDEM.COMMIT late:1 "$TL" late-but-ok)"
expect "then done" $'1) "done"\n2) "late-but-ok"' "$(R IDEM.CLAIM late:1 86400000 500)"

# ---- SET NX and the shared keyspace ----
expect "SET NX PX new" "OK" "$(R SET s:1 v1 NX PX 10000)"
expect "SET NX PX exists: nil" "(nil)" "$(R SET s:1 v2 NX PX 10000)"
expect "SET PX NX GET (any order): old value" '"v1"' "$(R SET s:1 v3 PX 10000 NX GET)"
expect "SET NX GET EX new: nil" "(nil)" "$(R SET s:2 w1 GET EX 10 NX)"
expect "GET after SET NX GET" '"w1"' "$(R GET s:2)"
expect "SET NX EX" "OK" "$(R SET s:3 x NX EX 5)"
expect "PTTL" "(integer) 10000" "$(R PTTL s:1)"
expect "TTL" "(integer) 10" "$(R TTL s:2)"
expect "PTTL absent" "(integer) -2" "$(R PTTL s:none)"
expect "TTL absent" "(integer) -2" "$(R TTL s:none)"
expect "GET absent" "(nil)" "$(R GET s:none)"
expect "EXISTS several" "(integer) 4" "$(R EXISTS s:1 s:2 s:none order:1 own:1)"
expect "claim sees SET NX record" $'1) "done"\n2) "v1"' "$(R IDEM.CLAIM s:1 10000 1000)"
expect_re "SET NX GET on in_flight: error" '^\(error\) ERR' "$(R SET own:1 z NX PX 1000 GET)"
expect "SET NX on in_flight: nil" "(nil)" "$(R SET own:1 z NX PX 1000)"
expect_re "DBSIZE as worker: NOPERM" '^\(error\) NOPERM' "$(R DBSIZE)"
# order:1 own:1 rel:1 hold:1 rec:1 late:1 s:1 s:2 s:3
expect "DBSIZE (admin)" "(integer) 9" "$(A DBSIZE)"

# ---- refused by name ----
expect_re "SET without NX refused" '^\(error\) ERR SET without NX is refused' "$(R SET s:9 v)"
expect_re "SET NX without PX refused" '^\(error\) ERR SET needs PX' "$(R SET s:9 v NX)"
expect_re "SET XX refused" '^\(error\) ERR SET XX is refused' "$(R SET s:1 v XX PX 100)"
expect_re "SET KEEPTTL refused" '^\(error\) ERR SET KEEPTTL is refused' "$(R SET s:1 v NX KEEPTTL)"
for c in "EXPIRE s:1 100" "PEXPIRE s:1 100" "PERSIST s:1" "GETSET s:1 v" "EXPIREAT s:1 1" "SETEX s:1 10 v" "GETDEL s:1" \
    "INCR s:1" "SETNX s:9 v" "RENAME s:1 s:9" "UNLINK s:1"; do
    set -- $c
    expect_re "$1 refused by name" "^\\(error\\) ERR $1 is refused: " "$(R $c)"
done
expect "refused commands changed nothing" $'"v1"\n(integer) 10000' "$(R GET s:1; R PTTL s:1)"
expect_re "unknown command" "^\\(error\\) ERR unknown command 'BITCOUNT'" "$(R BITCOUNT k)"

# ---- expiry boundary (rule 5) ----
R SET e:set v NX PX 1000 >/dev/null
TE=$(tok "$(R IDEM.CLAIM e:claim 1000 100000)")
R IDEM.COMMIT e:claim "$TE" r-e >/dev/null
TI=$(tok "$(R IDEM.CLAIM e:open 1000 100000)")
A DEBUG CLOCK ADVANCE 999 >/dev/null
expect "expires_at-1: PTTL 1" "(integer) 1" "$(R PTTL e:set)"
expect "expires_at-1: EXISTS" "(integer) 1" "$(R EXISTS e:set)"
expect "expires_at-1: claim is a repeat" $'1) "done"\n2) "r-e"' "$(R IDEM.CLAIM e:claim 1000 100000)"
A DEBUG CLOCK ADVANCE 1 >/dev/null
expect "expires_at: EXISTS 0" "(integer) 0" "$(R EXISTS e:set)"
expect "expires_at: GET nil" "(nil)" "$(R GET e:set)"
expect "expires_at: PTTL -2" "(integer) -2" "$(R PTTL e:set)"
expect "expires_at: SET NX new" "OK" "$(R SET e:set v2 NX PX 1000)"
out=$(R IDEM.CLAIM e:claim 1000 100000)
expect_re "expires_at: claim new" '^1\) "new"' "$out"
if [ "$(tok "$out")" -gt "$TE" ] 2>/dev/null; then ok "re-issued token larger"; else bad "re-issued token larger" "$TE then $(tok "$out")"; fi
A DEBUG CLOCK ADVANCE 5000 >/dev/null
expect "in_flight never expires" $'1) "busy"\n2) (integer) 94000' "$(R IDEM.CLAIM e:open 1000 100000)"
expect "in_flight owner commits after its ttl" "OK" "$(R IDEM.COMMIT e:open "$TI" late)"
expect "committed at/after expires_at: one more ttl" "(integer) 1000" "$(R PTTL e:open)"

# ---- bad input keeps the connection usable (one connection, pipelined by redis-cli) ----
long=$(head -c 600 /dev/zero | tr '\0' k)
out=$(printf 'IDEM.CLAIM %s 1000 1000\nIDEM.CLAIM k 0 1000\nIDEM.CLAIM k\nNOSUCH x\nPING\n' "$long" | R)
expect_lines "bad input then PING on the same connection" 'too long.*\n.*ttl_ms.*\n.*wrong number of arguments.*\n.*unknown command.*\nPONG$' "$out"

# ---- roles with --user ----
cat >"$T/users" <<EOF
# name:role:password
app:worker:wpw
rd:reader:rpw
default:worker:dpw
EOF
chmod 600 "$T/users"
MAINPORT=$PORT
start_idemd_free users "$T/u" --socket "" --users-file "$T/users" --user ops:admin:apw || bad "idemd with users starts"
U() { redis-cli --no-raw --no-auth-warning -h 127.0.0.1 -p "$PORT" "$@" 2>&1; }
expect "no AUTH: PING NOAUTH" "(error) NOAUTH Authentication required." "$(U PING)"
expect "no AUTH: claim NOAUTH" "(error) NOAUTH Authentication required." "$(U IDEM.CLAIM a 1000 1000)"
expect "no AUTH: unknown command NOAUTH" "(error) NOAUTH Authentication required." "$(U FLUSHALL)"
expect_re "wrong password: WRONGPASS" '^\(error\) WRONGPASS' "$(printf 'AUTH app nope\n' | U)"
expect "AUTH password alone: user default" $'OK\nPONG' "$(printf 'AUTH dpw\nPING\n' | U)"
expect_re "HELLO 2 AUTH" '"proto"' "$(printf 'HELLO 2 AUTH app wpw\n' | U)"
expect_re "worker claims" '^1\) "new"' "$(U --user app --pass wpw IDEM.CLAIM r:1 100000 1000)"
expect_re "worker: DBSIZE NOPERM" "^\\(error\\) NOPERM this user \\(role worker\\) has no permissions to run the 'dbsize' command" "$(U --user app --pass wpw DBSIZE)"
expect_re "worker: IDEM.STATS NOPERM" '^\(error\) NOPERM' "$(U --user app --pass wpw IDEM.STATS)"
expect_re "worker: IDEM.RESOLVE NOPERM" '^\(error\) NOPERM' "$(U --user app --pass wpw IDEM.RESOLVE r:1 release why FORCE)"
expect_re "reader: claim NOPERM" '^\(error\) NOPERM' "$(U --user rd --pass rpw IDEM.CLAIM r:2 100000 1000)"
expect_re "reader: SET NOPERM" '^\(error\) NOPERM' "$(U --user rd --pass rpw SET r:2 v NX PX 100)"
expect "reader: DBSIZE" "(integer) 1" "$(U --user rd --pass rpw DBSIZE)"
expect_re "reader: IDEM.STATS" '"claims_new"' "$(U --user rd --pass rpw IDEM.STATS)"
expect_re "reader: IDEM.GET" '"in_flight"' "$(U --user rd --pass rpw IDEM.GET r:1)"
expect_re "reader: DEL NOPERM" '^\(error\) NOPERM' "$(U --user rd --pass rpw DEL r:1)"
expect "admin: RESOLVE release FORCE" "OK" "$(U --user ops --pass apw IDEM.RESOLVE r:1 release 'checked: never charged' FORCE)"
expect_re "admin: audit has the resolve" '"checked: never charged"' "$(U --user ops --pass apw IDEM.AUDIT KEY r:1)"
expect_re "audit actor names the user" '"ops@127\.0\.0\.1:[0-9]+"' "$(U --user ops --pass apw IDEM.AUDIT KEY r:1)"
expect_re "admin: DEBUG CLOCK refused without --test-clock" 'needs idemd started with --test-clock' "$(U --user ops --pass apw DEBUG CLOCK GET)"
PORT=$MAINPORT

# ---- SIGTERM drains and exits 0 (both servers); the store reopens with its records ----
stop_idemd "$IDEMD_PID" TERM
rc=$?
if [ $rc -eq 0 ]; then ok "SIGTERM: exit 0 (users)"; else bad "SIGTERM: exit 0 (users)" "exit $rc"; fi
stop_idemd "$MAIN_PID" TERM
rc=$?
if [ $rc -eq 0 ]; then ok "SIGTERM: exit 0"; else bad "SIGTERM: exit 0" "exit $rc"; fi
if start_idemd main "$T/d" "$PORT" --test-clock; then
    expect "after restart: committed record" $'1) "done"\n2) "inv_9f2"' "$(R IDEM.CLAIM order:1 86400000 30000 FP '{"amount":100}')"
    expect "after restart: review record" $'1) "review"\n2) "gateway timed out"' "$(R IDEM.CLAIM hold:1 86400000 30000)"
    expect "after restart: PTTL of review" "(integer) -1" "$(R PTTL hold:1)"
    stop_idemd "$IDEMD_PID" TERM || bad "SIGTERM after restart: exit 0"
else
    bad "restart on the same dir"
fi

finish
