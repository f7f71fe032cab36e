"""cmd_fuzz.py: random commands against a live idemd (the command layer; fuzz_resp covers the
parser below it). idemd runs with --test-clock on a temp dir; a few connections (admin on the
unix socket, worker on TCP) send pipelines of well-framed requests whose names and arguments are
drawn at random: every command of the table and the refused ones, options in any order, twice or
misspelt, numbers at and past every bound (0, -1, 2^63, "1e3", " 5"), keys from empty to past
512 bytes with CR, LF and NUL in them, results past --result-max, tokens that are and are not the
owner's, inline requests, and now and then IDEM.BACKUP into a new directory, one that exists
or one idemd refuses. Checked, for every request:
  - exactly one reply comes, in order, within 30 s and what a WAIT the request makes allows
    (WAIT is drawn at most 100 ms, but a mutation may make a longer one); every pipeline ends
    with an ECHO of a fresh nonce, which must come back last with nothing after it;
  - it is well-formed RESP2; an error reply is `-CODE message` with an upper-case code and a
    message that says something; PING and ECHO answer their message;
  - a token granted is above every one granted before, or its key's own (an OWNER resuming);
  - the connection stays open, but after QUIT;
  - each backup answered +OK passes `idemctl verify` (it is then removed); a refused or failed
    one leaves nothing;
and at the end: idemd is still running and its log holds no sanitizer report, failed assertion,
fatal store error or error-level event; a backup of the store at rest is made; SIGTERM makes
idemd exit 0 (in sync mode half the runs SIGKILL it instead, so the reopen replays the log);
`idemctl verify` passes the store; it opens again with every key's record as it was (or
expired), a new claim's token above every one granted, and exits 0 again with a clean log; the
backup at rest passes `idemctl verify` and opens with every record as the store had it.

Run: IDEM_BUILD_DIR=build /usr/bin/python3 tests/python/cmd_fuzz.py [--seconds S] [--seed N]
Prints the seed, the counts and `N passed, M failed` (N, M: checks). On a failure the batch
that broke it is printed (repr, cut)."""

import argparse
import atexit
import os
import random
import shutil
import socket
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import redis  # noqa: E402

from idemd_server import BUILD_DIR, Idemd  # noqa: E402

RESULT_MAX = 4096  # idemd's --result-max here: arguments past it are drawn cheaply
KEYS = [b"k%d" % i for i in range(12)]
BACKUP_ODDS = 0.001  # of a request being IDEM.BACKUP (drawn whole: it writes where it is told)
NAMES = [
    "IDEM.CLAIM", "IDEM.COMMIT", "IDEM.RELEASE", "IDEM.HOLD", "IDEM.EXTEND", "IDEM.GET",
    "IDEM.SCAN", "IDEM.STATS", "IDEM.RESOLVE", "IDEM.AUDIT", "IDEM.ATTENTION", "SET", "GET",
    "EXISTS", "PTTL", "TTL", "DEL", "DBSIZE", "PING", "ECHO", "INFO", "AUTH", "HELLO", "CLIENT",
    "SELECT", "COMMAND", "CONFIG", "DEBUG", "QUIT",
    # refused by name, unknown, or near a known name
    "GETSET", "EXPIRE", "SETEX", "INCR", "FLUSHALL", "UNLINK", "MSET", "idem.claim", "Set",
    "IDEM.", "IDEM.CLAIMX", "", "X" * 300,
]
WORDS = [
    "NX", "XX", "PX", "EX", "GET", "KEEPTTL", "FP", "OWNER", "WAIT", "EXPECT", "FORCE", "RESULT",
    "KEY", "COUNT", "BEFORE", "STATE", "OLDER", "CURSOR", "CLOCK", "GET", "SET", "ADVANCE",
    "commit", "release", "settle", "in_flight", "committed", "review", "DOCS", "COUNT", "INFO",
    "SETNAME", "SETINFO", "GETNAME", "ID", "LIB-NAME", "LIB-VER", "idem", "server", "all",
    "everything", "persistence", "clients", "AUTH", "default", "2", "3", "0", "*", "maxmemory",
]
NUMBERS = [
    "0", "1", "2", "-1", "10", "100", "1000", "60001", "86400000", "315360000000",
    "315360000001", "4294967295", "4294967296", "9223372036854775807", "9223372036854775808",
    "-9223372036854775808", "18446744073709551616", "99999999999999999999999", "1e3", "0x10",
    " 5", "5 ", "+5", "05", "", "1.5", "-0", "9007199254740993", "4611686018427387904",
]
# whole requests drawn as a unit: each command in a likely shape, arguments then mutated
TEMPLATES = [
    ["IDEM.CLAIM", "$key", "$ttl", "$lease"],
    ["IDEM.CLAIM", "$key", "$ttl", "$lease", "FP", "$bytes"],
    ["IDEM.CLAIM", "$key", "$ttl", "$lease", "OWNER", "$owner"],
    ["IDEM.CLAIM", "$key", "$ttl", "$lease", "WAIT", "$wait"],
    ["IDEM.CLAIM", "$key", "$ttl", "$lease", "FP", "$bytes", "OWNER", "$owner", "WAIT", "$wait"],
    ["IDEM.COMMIT", "$key", "$token", "$bytes"],
    ["IDEM.RELEASE", "$key", "$token"],
    ["IDEM.HOLD", "$key", "$token", "$bytes"],
    ["IDEM.EXTEND", "$key", "$token", "$lease"],
    ["IDEM.GET", "$key"],
    ["IDEM.SCAN", "$num"],
    ["IDEM.SCAN", "$num", "STATE", "$word", "OLDER", "$num", "COUNT", "$num"],
    ["IDEM.STATS"],
    ["IDEM.RESOLVE", "$key", "$word", "$bytes"],
    ["IDEM.RESOLVE", "$key", "commit", "$bytes", "RESULT", "$bytes", "EXPECT", "$num", "FORCE"],
    ["IDEM.RESOLVE", "$key", "release", "$bytes", "FORCE"],
    ["IDEM.RESOLVE", "$key", "settle", "$bytes", "EXPECT", "$num"],
    ["IDEM.AUDIT"],
    ["IDEM.AUDIT", "KEY", "$key", "COUNT", "$num", "BEFORE", "$num"],
    ["IDEM.ATTENTION", "OLDER", "$num", "COUNT", "$num"],
    ["SET", "$key", "$bytes", "NX", "PX", "$ttl"],
    ["SET", "$key", "$bytes", "NX", "EX", "$num", "GET"],
    ["SET", "$key", "$bytes", "GET", "PX", "$ttl", "NX"],
    ["GET", "$key"],
    ["EXISTS", "$key", "$key", "$key"],
    ["PTTL", "$key"],
    ["TTL", "$key"],
    ["DEL", "$key"],
    ["DEL", "$key", "$key", "$key"],
    ["DBSIZE"],
    ["PING"],
    ["PING", "$bytes"],
    ["ECHO", "$bytes"],
    ["INFO"],
    ["INFO", "$word"],
    ["AUTH", "$bytes"],
    ["AUTH", "$bytes", "$bytes"],
    ["AUTH", "$user", "$password"],
    ["HELLO", "2", "AUTH", "$user", "$password"],
    ["HELLO"],
    ["HELLO", "$num"],
    ["HELLO", "2", "SETNAME", "$owner"],
    ["HELLO", "2", "AUTH", "$bytes", "$bytes"],
    ["CLIENT", "SETNAME", "$owner"],
    ["CLIENT", "SETINFO", "$word", "$bytes"],
    ["CLIENT", "ID"],
    ["CLIENT", "GETNAME"],
    ["SELECT", "$num"],
    ["COMMAND"],
    ["COMMAND", "DOCS", "$word"],
    ["COMMAND", "COUNT"],
    ["COMMAND", "INFO", "$word"],
    ["CONFIG", "GET", "$word"],
    ["DEBUG", "CLOCK", "GET"],
    ["DEBUG", "CLOCK", "ADVANCE", "$clock"],
    ["DEBUG", "CLOCK", "SET", "$num"],
    ["DEBUG", "$word"],
]
# with --user (drawn for some runs): each connection authenticates first, and AUTH requests
# drawn later switch it between roles or fail
USERS = [(b"boss", b"admin", b"pa55-admin"), (b"w", b"worker", b"pa55-worker"),
         (b"r", b"reader", b"pa55-reader")]
INLINE = [b"PING", b"PING hello", b"DBSIZE", b"GET k1", b"EXISTS k1 k2", b"IDEM.STATS",
          b"ECHO x", b"TTL k3", b"INFO idem", b"COMMAND COUNT", b"PING\r"]


class Failure(Exception):
    pass


class Fuzzer:
    def __init__(self, rnd, store_dir, backup_root):
        self.rnd = rnd
        self.store_dir = store_dir  # bytes, as are the paths below
        self.backup_root = backup_root  # where IDEM.BACKUP is sent: one new directory each
        self.dests = []  # the new paths drawn for IDEM.BACKUP (drawn again: it exists)
        self.unsent = set()  # those not yet sent: on an admin connection, the first send is made
        self.backups = []  # those answered +OK, not yet verified and removed
        self.tokens = {}  # key -> tokens granted on it (recent first)
        self.max_token = 0  # the highest token granted so far

    def key(self):
        r = self.rnd.random()
        if r < 0.8:
            return self.rnd.choice(KEYS)
        if r < 0.85:
            return b""
        if r < 0.9:
            return bytes(self.rnd.getrandbits(8) for _ in range(self.rnd.randint(1, 20)))
        if r < 0.95:
            return b"x" * self.rnd.choice([511, 512, 513, 1000])
        return b"k\r\n\x00" + self.rnd.choice(KEYS)

    def bytes_arg(self):
        r = self.rnd.random()
        if r < 0.6:
            return b"r%d" % self.rnd.randint(0, 5)
        if r < 0.7:
            return b""
        if r < 0.85:
            return bytes(self.rnd.getrandbits(8) for _ in range(self.rnd.randint(1, 64)))
        return b"v" * self.rnd.choice([RESULT_MAX - 1, RESULT_MAX, RESULT_MAX + 1, 5000, 70000])

    def number(self, small=None):
        if small and self.rnd.random() < 0.7:
            return str(self.rnd.choice(small)).encode()
        if self.rnd.random() < 0.2:
            return str(self.rnd.randint(-10, 10 ** 6)).encode()
        return self.rnd.choice(NUMBERS).encode()

    def token(self, key):
        seen = self.tokens.get(key)
        if seen and self.rnd.random() < 0.7:
            return str(self.rnd.choice(seen[:3])).encode()
        return self.number([1, 2, 1 << 40])

    def arg(self, kind, key):
        if kind == "$key":
            return key
        if kind == "$bytes":
            return self.bytes_arg()
        if kind == "$ttl":
            return self.number([1, 50, 1000, 60000, 86400000])
        if kind == "$lease":
            return self.number([1, 20, 1000, 30000])
        if kind == "$wait":
            return self.rnd.choice([b"1", b"10", b"50", b"100", b"60001", b"0", b"-1", b"x"])
        if kind == "$clock":
            return self.number([1, 10, 1000, 100000])
        if kind == "$token":
            return self.token(key)
        if kind == "$owner":
            return self.rnd.choice([b"w1", b"w2", b"", b"o" * 300])
        if kind == "$num":
            return self.number([0, 1, 10, 100])
        if kind == "$user":
            return self.rnd.choice([u[0] for u in USERS] + [b"default", b"nobody"])
        if kind == "$password":
            return self.rnd.choice([u[2] for u in USERS] + [b"wrong"])
        if kind == "$word":
            return self.rnd.choice(WORDS).encode()
        return kind.encode()

    def dest(self):
        """IDEM.BACKUP's directory: mostly a new one under backup_root; else one drawn before
        (it exists, or a copy into it is running), or one idemd refuses (relative, empty, in the
        store, with a control character or a quote, under a missing directory)."""
        r = self.rnd.random()
        if r < 0.6 or not self.dests:
            self.dests.append(os.path.join(self.backup_root, b"b%d" % len(self.dests)))
            self.unsent.add(self.dests[-1])
            return self.dests[-1]
        if r < 0.8:
            return self.rnd.choice(self.dests)
        return self.rnd.choice([b"rel/b", b"", os.path.join(self.store_dir, b"inner"),
                                os.path.join(self.backup_root, b"b\x01"),
                                os.path.join(self.backup_root, b'q"b'),
                                os.path.join(self.backup_root, b"missing", b"b")])

    def request(self):
        """One request: (argv, inline line or None)."""
        if self.rnd.random() < 0.03:
            return None, self.rnd.choice(INLINE)
        if self.rnd.random() < BACKUP_ODDS:
            argv = [b"IDEM.BACKUP", self.dest()]
            r = self.rnd.random()
            if r < 0.1:
                argv[0] = argv[0].lower()
            elif r < 0.2:
                argv.append(self.rnd.choice([self.dest(), b"NOW"]))  # one too many
            return argv, None
        if self.rnd.random() < 0.08:
            name = self.rnd.choice(NAMES)
            argv = [name.encode()] + [self.rnd.choice([self.key(), self.bytes_arg(),
                                                        self.number(), self.rnd.choice(WORDS).encode()])
                                      for _ in range(self.rnd.randint(0, 6))]
            return argv, None
        tpl = self.rnd.choice(TEMPLATES)
        key = self.key()
        argv = [self.arg(t, key) if t.startswith("$") else t.encode() for t in tpl]
        # mutations: drop, duplicate, swap, replace, case
        for _ in range(self.rnd.choice([0, 0, 0, 1, 1, 2, 3])):
            m = self.rnd.random()
            i = self.rnd.randrange(len(argv))
            if m < 0.25 and len(argv) > 1:
                del argv[self.rnd.randrange(1, len(argv))]
            elif m < 0.45:
                argv.insert(i + 1, argv[i])
            elif m < 0.6 and len(argv) > 2:
                j = self.rnd.randrange(1, len(argv))
                argv[i], argv[j] = argv[j], argv[i]
            elif m < 0.85:
                argv[self.rnd.randrange(len(argv))] = self.rnd.choice(
                    [self.number(), self.rnd.choice(WORDS).encode(), self.key(), self.bytes_arg()])
            else:
                argv[0] = argv[0].lower()
        return argv, None

    def note_backup(self, argv, reply, admin):
        """IDEM.BACKUP: +OK only into a path drawn as new, and always for the first send of one
        on an admin connection (a backup may be running already, from the same pipeline)."""
        first = len(argv) == 2 and argv[1] in self.unsent
        self.unsent.discard(argv[1] if len(argv) > 1 else None)
        if reply == b"OK":
            if len(argv) != 2 or argv[1] not in self.dests:
                raise Failure("IDEM.BACKUP into %r answered +OK" % (argv[1:],))
            self.backups.append(argv[1])
        elif first and admin and not (isinstance(reply, tuple) and
                                      "a backup is running already" in reply[2]):
            raise Failure("IDEM.BACKUP into %r, new, answered %r" % (argv[1], reply))

    def note_reply(self, argv, reply):
        """Checks what a reply can be held to without a model (a PING's PONG, an ECHO's
        message, a token above every one before it but its key's own: tokens never repeat or go
        back), and keeps the tokens
        granted, so that owner calls are sometimes the owner's."""
        name = argv[0].upper() if argv else b""
        if name == b"PING" and len(argv) == 1 and reply != b"PONG":
            raise Failure("PING answered %r" % (reply,))
        if name in (b"PING", b"ECHO") and len(argv) == 2 and reply != argv[1]:
            raise Failure("%s of %d bytes answered %r" % (name, len(argv[1]), reply[:60]))
        if name != b"IDEM.CLAIM" or len(argv) < 2:
            return
        if isinstance(reply, list) and len(reply) >= 2 and reply[0] in (b"new", b"recover"):
            token = reply[1]
            if not isinstance(token, int) or token <= 0:
                raise Failure("a claim granted token %r" % (token,))
            own = self.tokens.get(argv[1])
            if token <= self.max_token and not (own and token == own[0]):
                raise Failure("token %d granted on %r after %d (tokens never repeat or go back)"
                              % (token, argv[1], self.max_token))
            self.max_token = max(self.max_token, token)
            self.tokens.setdefault(argv[1], []).insert(0, token)
            del self.tokens[argv[1]][5:]


def encode(argv, inline):
    if inline is not None:
        return inline + b"\r\n"
    out = [b"*%d\r\n" % len(argv)]
    for a in argv:
        out.append(b"$%d\r\n%s\r\n" % (len(a), a))
    return b"".join(out)


def wait_allowance(argv):
    """The seconds a claim's WAIT may hold its reply (and the replies after it), if idemd takes
    the option as it is drawn."""
    if not argv or argv[0].upper() != b"IDEM.CLAIM":
        return 0
    total = 0
    for i, a in enumerate(argv[:-1]):
        if a.upper() == b"WAIT":
            try:
                ms = int(argv[i + 1])
            except ValueError:
                continue
            if 0 < ms <= 60000:
                total = max(total, ms / 1000 + 1)
    return total


def request_name(argv, inline):
    if inline is not None:
        return inline.split(b" ")[0].split(b"\r")[0].upper()
    return argv[0].upper()


class Conn:
    def __init__(self, idemd, tcp, users):
        self.tcp = tcp
        if tcp:
            self.sock = socket.create_connection(("127.0.0.1", idemd.port), timeout=30)
        else:
            self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            self.sock.settimeout(30)
            self.sock.connect(idemd.sock)
        self.buf = b""
        if users:
            user = USERS[1] if tcp else USERS[0]
            self.sock.sendall(encode([b"AUTH", user[0], user[2]], None))
            if self.reply(time.monotonic() + 30) != b"OK":
                raise Failure("AUTH as %r refused" % user[0])

    def _fill(self, deadline):
        self.sock.settimeout(max(0.05, deadline - time.monotonic()))
        try:
            chunk = self.sock.recv(1 << 20)
        except socket.timeout:
            raise Failure("no reply within the deadline (a hang?)")
        except ConnectionResetError:
            chunk = b""
        if not chunk:
            raise Failure("the connection was closed before a reply ended: %r" % self.buf[:200])
        self.buf += chunk

    def _line(self, deadline):
        while True:
            i = self.buf.find(b"\r\n")
            if i >= 0:
                line, self.buf = self.buf[:i], self.buf[i + 2:]
                if b"\r" in line or b"\n" in line:
                    raise Failure("a bare CR or LF in a reply line: %r" % line[:200])
                return line
            if len(self.buf) > (1 << 20):
                raise Failure("a reply line over 1 MiB")
            self._fill(deadline)

    def reply(self, deadline, depth=0):
        line = self._line(deadline)
        kind, rest = line[:1], line[1:]
        if kind == b"+":
            return rest
        if kind == b"-":
            text = rest.decode(errors="replace")
            code, _, msg = text.partition(" ")
            if not code or not code.isupper() or len(msg.strip()) < 3:
                raise Failure("an error reply that names nothing: %r" % line[:200])
            return ("error", code, msg)
        if kind == b":":
            try:
                return int(rest)
            except ValueError:
                raise Failure("a bad integer reply: %r" % line[:200])
        if kind in (b"$", b"*"):
            try:
                n = int(rest)
            except ValueError:
                raise Failure("a bad length: %r" % line[:200])
            if n == -1:
                return None
            if n < -1:
                raise Failure("a negative length: %r" % line[:200])
            if kind == b"$":
                while len(self.buf) < n + 2:
                    self._fill(deadline)
                data, end, self.buf = self.buf[:n], self.buf[n:n + 2], self.buf[n + 2:]
                if end != b"\r\n":
                    raise Failure("a bulk string not ended by CRLF")
                return data
            if depth > 8:
                raise Failure("arrays nested deeper than 8")
            return [self.reply(deadline, depth + 1) for _ in range(n)]
        raise Failure("not a RESP2 reply: %r" % line[:200])

    def closed_after_quit(self, deadline):
        """After QUIT's +OK the connection ends (a reset where requests after it were left
        unread)."""
        self.sock.settimeout(max(0.05, deadline - time.monotonic()))
        try:
            rest = self.sock.recv(1 << 16)
        except ConnectionResetError:
            rest = b""
        except socket.timeout:
            rest = None
        return rest == b"" and not self.buf

    def close(self):
        self.sock.close()


# IDEM.BACKUP's refusals the fuzzer provokes, which idemd logs as event=backup_failed
BACKUP_REFUSALS = (": it exists", "the copy would lie within the directory it copies",
                   "/missing/b.partial: No such file or directory")


def log_faults(path, allow=()):
    """The faults idemd's log shows, but those in allow and the backups refused as drawn."""
    with open(path, "rb") as f:
        text = f.read().decode(errors="replace")
    lines = [ln for ln in text.splitlines() if not (
        "event=backup_failed" in ln and any(r in ln for r in BACKUP_REFUSALS))]
    text = "\n".join(lines)
    bad = [m for m in ("AddressSanitizer", "runtime error", "LeakSanitizer", "Assertion",
                       "assertion", "event=fatal", "Segmentation", "level=error",
                       "event=compaction_stopped", "event=delete_failed", "event=fill_failed",
                       "event=recovery_dropped_tail") if m in text and m not in allow]
    return bad, text


def verify(path):
    """idemctl verify of a store directory: None, or what it said."""
    v = subprocess.run([os.path.join(BUILD_DIR, "idemctl"), "verify", path],
                       capture_output=True, text=True, timeout=120)
    return None if v.returncode == 0 else "exit %d: %s %s" % (
        v.returncode, v.stdout[-2000:], v.stderr[-2000:])


def check_backups(fz):
    """Each backup answered +OK passes idemctl verify; it is then removed (they are 64 MiB and
    up), and its path may be drawn again as a new one."""
    for path in fz.backups:
        err = verify(path)
        if err:
            raise Failure("the backup into %r fails idemctl verify: %s" % (path, err))
        shutil.rmtree(path)
    n = len(fz.backups)
    del fz.backups[:]
    return n


def snapshot(srv):
    """Every key's record (IDEM.GET, which changes nothing) and the store clock."""
    a = srv.admin(socket_timeout=30)
    try:
        recs = {k: record_of(a.execute_command("IDEM.GET", k)) for k in KEYS}
        return recs, int(a.execute_command("DEBUG", "CLOCK", "GET"))
    finally:
        a.close()


def record_of(reply):
    return None if reply is None else {reply[i]: reply[i + 1] for i in range(0, len(reply), 2)}


def fewer_repeats(r1, r2):
    """r2 is r1 but for repeats its log holds no trace of: seen_count and last_seen_ms of plain
    repeats since the key's last logged version reach the disk only with a checkpoint, so a kill
    or a backup (which opens as the store would after a crash) may count fewer, never more
    (design.md section 20)."""
    if r1 is None or r2 is None:
        return False
    c1, c2 = dict(r1), dict(r2)
    n1, n2 = int(c1.pop(b"seen_count")), int(c2.pop(b"seen_count"))
    t1, t2 = int(c1.pop(b"last_seen_ms")), int(c2.pop(b"last_seen_ms"))
    return c1 == c2 and 1 <= n2 <= n1 and int(r1[b"first_seen_ms"]) <= t2 <= t1


def same_after_reopen(before, after, crash):
    """What a stop and a reopen may change: a committed record past its expiry by the clock
    after reads as absent; after a crash (a kill, or a backup, which opens as the store would
    after a crash) repeats may be undercounted. Returns the differences."""
    (recs, _), (recs2, clock2) = before, after
    diffs = []
    for k in KEYS:
        r1, r2 = recs[k], recs2[k]
        if r1 == r2 or (crash and fewer_repeats(r1, r2)):
            continue
        if (r1 is not None and r2 is None and r1.get(b"state") == b"committed"
                and int(r1[b"expires_at_ms"]) <= clock2):
            continue
        diffs.append("%r: %r then %r" % (k, r1, r2))
    return diffs


def check_final_backup(flags, auth, tmp, before):
    """The backup taken at rest passes idemctl verify, opens with every record as the snapshot
    read it (or expired), and its idemd exits 0 with a clean log. Returns (ok, what)."""
    path = os.path.join(tmp, "d")
    err = verify(path)
    if err:
        return False, "the backup at rest fails idemctl verify: %s" % err
    bk = Idemd(*flags, tmp=tmp, name="idemd-backup", auth=auth)
    try:
        bk.start()
        diffs = same_after_reopen(before, snapshot(bk), crash=True)
    except Exception as e:  # noqa: BLE001
        bk.kill(9)
        return False, "idemd did not open the backup at rest: %s" % e
    rc = bk.kill(15)
    bad, _ = log_faults(bk.log_path)
    if diffs:
        return False, "the backup at rest differs from the store:\n  " + "\n  ".join(diffs)
    if rc != 0 or bad:
        return False, "idemd on the backup exited %s, log faults %s" % (rc, bad)
    return True, "the backup at rest opened with %d keys as they were" % len(KEYS)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=float(os.environ.get("CMD_FUZZ_SECONDS", 20)))
    ap.add_argument("--seed", type=int, default=int(os.environ.get("CMD_FUZZ_SEED", 0)) or None)
    ap.add_argument("--conns", type=int, default=4)
    args = ap.parse_args()
    seed = args.seed or random.randrange(1, 1 << 48)
    print("cmd_fuzz: seed %d (--seed %d replays the requests; replies also depend on timing)"
          % (seed, seed))
    rnd = random.Random(seed)
    durability = rnd.choice(["sync", "batch", "none"])
    flags = ["--test-clock", "--result-max", str(RESULT_MAX), "--durability", durability]
    if rnd.random() < 0.3:
        flags += ["--on-lease-expiry", "review"]
    if rnd.random() < 0.3:
        flags += ["--max-keys", "8"]  # FULL for new keys once eight are held
    users = rnd.random() < 0.3
    for name, role, password in USERS if users else []:
        flags += ["--user", b":".join([name, role, password]).decode()]
    # the stop before the reopen: SIGKILL in sync mode, where every answer was durable
    kill9 = durability == "sync" and rnd.random() < 0.5
    print("cmd_fuzz: idemd %s; stopped by %s" % (" ".join(flags), "SIGKILL" if kill9 else "SIGTERM"))
    auth = (USERS[0][0].decode(), USERS[0][2].decode()) if users else None
    srv = Idemd(*flags, name="idemd-cmdfuzz", auth=auth).start()
    backup_root = tempfile.mkdtemp(prefix="idem-cmdfuzz-backups.")
    final_tmp = tempfile.mkdtemp(prefix="idem-cmdfuzz-final.")  # the last backup, opened
    for d in (backup_root, final_tmp) if os.environ.get("KEEP_TMP") != "1" else ():
        atexit.register(shutil.rmtree, d, True)  # at any exit, SIGTERM's too (idemd_server)
    fz = Fuzzer(rnd, srv.dir.encode(), backup_root.encode())
    passed = failed = 0
    counts = {"requests": 0, "batches": 0, "errors": 0, "quits": 0, "backups": 0}
    codes = {}
    conns = []
    end = time.monotonic() + args.seconds
    batch, ci, c, got = [], 0, None, 0
    before, final_backup = None, False
    try:
        conns = [Conn(srv, tcp=(i == 0), users=users) for i in range(args.conns)]
        c = conns[0]
        while time.monotonic() < end:
            ci = rnd.randrange(len(conns))
            c = conns[ci]
            batch = []
            for _ in range(rnd.choice([1, 1, 2, 4, 8, 16, 32])):
                batch.append(fz.request())
                if request_name(*batch[-1]) == b"QUIT":
                    break  # idemd closes with what follows unread: a send could meet EPIPE
            else:
                batch.append(([b"ECHO", b"nonce-%d" % counts["batches"]], None))
            got = 0
            c.sock.settimeout(30)
            c.sock.sendall(b"".join(encode(a, i) for a, i in batch))
            counts["batches"] += 1
            deadline = time.monotonic() + 30
            for got, (argv, inline) in enumerate(batch):
                deadline += wait_allowance(argv)  # replies come in order: after the wait
                reply = c.reply(deadline)
                counts["requests"] += 1
                if argv and argv[0].upper() == b"IDEM.BACKUP":  # unix is admin without users
                    fz.note_backup(argv, reply, admin=not users and not c.tcp)
                if isinstance(reply, tuple):
                    counts["errors"] += 1
                    codes[reply[1]] = codes.get(reply[1], 0) + 1
                else:
                    fz.note_reply(argv, reply)
                if request_name(argv, inline) == b"QUIT" and reply == b"OK":
                    counts["quits"] += 1
                    if not c.closed_after_quit(deadline):
                        raise Failure("the connection stayed open after QUIT")
                    c.close()
                    conns[ci] = c = Conn(srv, tcp=c.tcp, users=users)
            if c.buf:
                raise Failure("bytes after the last reply of a pipeline: %r" % c.buf[:200])
            if srv.proc.poll() is not None:
                raise Failure("idemd exited with %s" % srv.proc.returncode)
            counts["backups"] += check_backups(fz)
        batch = []
        # a refused or failed backup leaves nothing, nor does one refused for its place
        left = os.listdir(backup_root) + [p for p in os.listdir(srv.dir) if p.startswith("inner")]
        if left or os.path.exists("rel"):
            raise Failure("backups refused or failed left %r" % (left or "rel",))
        before = snapshot(srv)
        # a backup of the store at rest holds every record as the snapshot read it
        a = srv.admin(socket_timeout=120)
        try:
            a.execute_command("IDEM.BACKUP", os.path.join(final_tmp, "d"))
        except redis.RedisError as e:
            raise Failure("IDEM.BACKUP of the store at rest: %s" % e)
        finally:
            a.close()
        final_backup = True
        passed += 1
        print("cmd_fuzz: %(requests)d requests in %(batches)d pipelines, %(errors)d error "
              "replies, %(quits)d QUITs, %(backups)d backups verified" % counts)
        print("cmd_fuzz: error codes: %s" % ", ".join(
            "%s %d" % kv for kv in sorted(codes.items(), key=lambda kv: -kv[1])))
    except (Failure, OSError) as e:
        failed += 1
        print("FAIL: %s (connection %d, %s)" % (e, ci, "TCP" if c and c.tcp else "unix"))
        print("  the batch (%d requests, %d answered):" % (len(batch), got))
        for n, (argv, inline) in enumerate(batch):
            print("   ", "*" if n == got else " ", repr(inline) if inline is not None else
                  " ".join(repr(a[:40]) + ("+%d" % (len(a) - 40) if len(a) > 40 else "")
                           for a in argv))
        if got < len(batch) and batch[got][0] and len(batch[got][0]) > 1:
            try:  # what the request that got no answer met
                a = srv.admin(socket_timeout=5)
                print("  its key now: %r" % (a.execute_command("IDEM.GET", batch[got][0][1]),))
                print("  clock %r" % (a.execute_command("DEBUG", "CLOCK", "GET"),))
                st = a.execute_command("IDEM.STATS")
                print("  stats: %r" % (dict(zip(st[::2], st[1::2])),))
            except Exception as e2:  # noqa: BLE001
                print("  (no look at it: %s)" % e2)
        _, text = log_faults(srv.log_path)
        print("  idemd's last log lines:\n" + "\n".join(text.splitlines()[-8:]))
    for c in conns:
        c.close()
    alive = srv.proc is not None and srv.proc.poll() is None
    rc = srv.kill(9 if kill9 else 15) if alive else (srv.proc.returncode if srv.proc else None)
    bad, text = log_faults(srv.log_path)
    if alive and (rc == 0 or kill9) and not bad:
        passed += 1
    else:
        failed += 1
        print("FAIL: idemd %s, exit %s at %s, log faults %s\n%s" % (
            "running" if alive else "had exited", rc, "SIGKILL" if kill9 else "SIGTERM", bad,
            text[-3000:]))
    err = verify(srv.dir)
    if err is None:
        passed += 1
    else:
        failed += 1
        print("FAIL: idemctl verify %s" % err)
    try:
        srv.port = None  # a free port again: another process may have taken the last one
        srv.start()
        after = snapshot(srv)
        diffs = same_after_reopen(before, after, crash=kill9) if before else []
        a = srv.admin(socket_timeout=30)
        # A fresh key; at --max-keys, where the store may hold all it may, a key of the run
        # that a claim finds absent or expired (FULL answers the others).
        claim = None
        for k in [b"after-reopen"] + KEYS:
            try:
                claim = a.execute_command("IDEM.CLAIM", k, 60000, 60000)
            except redis.ResponseError as e:
                if not (str(e).startswith("FULL") and "--max-keys" in flags):
                    raise
                continue
            if claim[0] in (b"new", b"recover"):
                break
            claim = None
        a.close()
        if diffs:
            failed += 1
            print("FAIL: records changed by the %s and reopen:\n  " % (
                "kill" if kill9 else "stop") + "\n  ".join(diffs))
        elif claim is not None and claim[1] <= fz.max_token:
            failed += 1
            print("FAIL: a claim after the reopen answered %r (highest token before: %d)"
                  % (claim, fz.max_token))
        else:
            passed += 1
            print("cmd_fuzz: reopened, %d keys as they were, %s" % (
                len(KEYS), "next token %d" % claim[1] if claim else
                "no key to claim (every one held, at --max-keys)"))
    except Exception as e:  # noqa: BLE001
        failed += 1
        print("FAIL: idemd did not open the store again: %s" % e)
    rc = srv.kill(15)
    # a kill may leave a write in flight that no answer waited for (the wheel's deletes)
    bad, text = log_faults(srv.log_path, ("event=recovery_dropped_tail",) if kill9 else ())
    if rc == 0 and not bad:
        passed += 1
    else:
        failed += 1
        print("FAIL: the reopened idemd exited %s at SIGTERM, log faults %s" % (rc, bad))
    srv.stop()
    if final_backup:
        ok, what = check_final_backup(flags, auth, final_tmp, before)
        passed, failed = passed + ok, failed + (not ok)
        print(("cmd_fuzz: " if ok else "FAIL: ") + what)
    print("%d passed, %d failed" % (passed, failed))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
