#!/usr/bin/env python3
"""idemload.py: a dependency-free RESP2 client for the disk-full test (test_diskfull.sh).

It proves nothing by itself; it drives idemd and checks answers for the script:
  fill   claims and commits keys from several connections until claims answer -FULL, and
         writes every acknowledged change to a file: `C key token` (committed: the commit
         answered +OK) or `I key token` (in flight: the claim answered new, its commit did not
         answer +OK, so only the claim is acknowledged)
  check  reads every acknowledged key back (IDEM.GET, GET, and a repeat claim of the committed
         ones, which must answer `done` with the same result) and prints what is wrong
  cmd    sends one command and prints the reply on one line
Everything talks to 127.0.0.1 (or a unix socket), with socket timeouts and bounded loops.
"""
import argparse
import hashlib
import socket
import sys
import threading
import time

TTL_MS = 86400000
LEASE_MS = 600000


class Resp:
    def __init__(self, port=None, unix=None, timeout=10.0):
        if unix:
            self.s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            self.s.settimeout(timeout)
            self.s.connect(unix)
        else:
            self.s = socket.create_connection(("127.0.0.1", port), timeout=timeout)
        self.buf = b""

    @staticmethod
    def encode(args):
        out = [b"*%d\r\n" % len(args)]
        for a in args:
            if isinstance(a, str):
                a = a.encode()
            elif isinstance(a, int):
                a = str(a).encode()
            out.append(b"$%d\r\n%s\r\n" % (len(a), a))
        return b"".join(out)

    def _line(self):
        while b"\r\n" not in self.buf:
            d = self.s.recv(65536)
            if not d:
                raise ConnectionError("connection closed by idemd")
            self.buf += d
        line, self.buf = self.buf.split(b"\r\n", 1)
        return line

    def _exact(self, n):
        while len(self.buf) < n + 2:
            d = self.s.recv(65536)
            if not d:
                raise ConnectionError("connection closed by idemd")
            self.buf += d
        data, self.buf = self.buf[:n], self.buf[n + 2:]
        return data

    def reply(self):
        line = self._line()
        t, rest = line[:1], line[1:]
        if t == b"+":
            return ("status", rest.decode())
        if t == b"-":
            return ("error", rest.decode())
        if t == b":":
            return int(rest)
        if t == b"$":
            n = int(rest)
            return None if n < 0 else self._exact(n)
        if t == b"*":
            n = int(rest)
            return None if n < 0 else [self.reply() for _ in range(n)]
        raise ValueError("bad reply line %r" % line)

    def call(self, *args):
        self.s.sendall(self.encode(args))
        return self.reply()

    def close(self):
        self.s.close()


def show(r):
    if isinstance(r, tuple):
        return ("+" if r[0] == "status" else "-") + r[1]
    if r is None:
        return "(nil)"
    if isinstance(r, int):
        return ":%d" % r
    if isinstance(r, bytes):
        return r.decode(errors="replace")
    return " ".join(show(x) for x in r)


INCOMPRESSIBLE = False  # --incompressible: results lz4 cannot shrink (the disk fills sooner)


def result_of(key, size):
    if INCOMPRESSIBLE:
        out = b"".join(hashlib.sha256(b"%s:%d" % (key.encode(), i)).digest()
                       for i in range(size // 32 + 1))
        return out[:size]
    base = ("r:" + key + ":").encode()
    return (base * (size // len(base) + 1))[:size]


def is_err(r, prefix):
    return isinstance(r, tuple) and r[0] == "error" and r[1].startswith(prefix)


def fill(a):
    lock = threading.Lock()
    acks = []
    stats = {"committed": 0, "inflight": 0, "full": 0, "other": 0, "other_samples": []}
    deadline = time.monotonic() + a.timeout
    stop = threading.Event()

    def note_other(what):
        with lock:
            stats["other"] += 1
            if len(stats["other_samples"]) < 5:
                stats["other_samples"].append(what)

    def worker(tid):
        c = Resp(port=a.port)
        fulls = 0
        for i in range(a.max_keys):
            if stop.is_set() or time.monotonic() > deadline:
                break
            key = "%s:%d:%d" % (a.prefix, tid, i)
            r = c.call("IDEM.CLAIM", key, TTL_MS, LEASE_MS, "FP", "fp:" + key)
            if is_err(r, "FULL"):
                with lock:
                    stats["full"] += 1
                fulls += 1
                if fulls >= a.full_stop:
                    break
                continue
            if not (isinstance(r, list) and r and r[0] == b"new"):
                note_other("claim %s -> %s" % (key, show(r)))
                continue
            tok = r[1]
            with lock:
                acks.append("I %s %d" % (key, tok))
            cr = c.call("IDEM.COMMIT", key, tok, result_of(key, a.result_bytes))
            with lock:
                if cr == ("status", "OK"):
                    acks[acks.index("I %s %d" % (key, tok))] = "C %s %d" % (key, tok)
                    stats["committed"] += 1
                else:
                    stats["inflight"] += 1
                    if not is_err(cr, "FULL"):
                        note_other("commit %s -> %s" % (key, show(cr)))
        c.close()

    ts = [threading.Thread(target=worker, args=(t,)) for t in range(a.conns)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    with open(a.ack, "a") as f:
        for line in acks:
            f.write(line + "\n")
    print("committed=%d inflight=%d full=%d other=%d %s" % (
        stats["committed"], stats["inflight"], stats["full"], stats["other"],
        "; ".join(stats["other_samples"])))
    return 0


def field(rec, name):
    for i in range(0, len(rec) - 1, 2):
        if rec[i] == name.encode():
            return rec[i + 1]
    return None


def check(a):
    c = Resp(port=a.port)
    bad = []
    n = 0
    with open(a.ack) as f:
        acked = {}
        for line in f:
            if line.strip():
                kind, key, tok = line.split()
                if acked.get(key, ("I",))[0] != "C":
                    acked[key] = (kind, tok)
    for key, (kind, tok) in acked.items():
        n += 1
        rec = c.call("IDEM.GET", key)
        if not isinstance(rec, list):
            bad.append("%s: IDEM.GET -> %s" % (key, show(rec)))
            continue
        state = field(rec, "state")
        if kind == "C":
            want = result_of(key, a.result_bytes)
            if state != b"committed" or field(rec, "result") != want:
                bad.append("%s: acknowledged commit, IDEM.GET state %s" % (key, state))
                continue
            g = c.call("GET", key)
            if g != want:
                bad.append("%s: GET -> %s" % (key, show(g)[:60]))
            if not a.no_repeat:
                r = c.call("IDEM.CLAIM", key, TTL_MS, LEASE_MS, "FP", "fp:" + key)
                if not (isinstance(r, list) and len(r) == 2 and r[0] == b"done" and r[1] == want):
                    bad.append("%s: repeat claim -> %s" % (key, show(r)[:60]))
        else:
            # an acknowledged claim whose commit was not acknowledged: in flight with its token
            # (or committed, if the commit reached the log but its reply was not a success)
            if state == b"in_flight":
                if field(rec, "token") != tok.encode():
                    bad.append("%s: in_flight with token %s, acknowledged %s" % (
                        key, field(rec, "token"), tok))
            elif state != b"committed":
                bad.append("%s: acknowledged claim, IDEM.GET state %s" % (key, state))
    c.close()
    print("checked=%d bad=%d" % (n, len(bad)))
    for b in bad[:20]:
        print("  " + b)
    return 1 if bad else 0


def claim_commit(a):
    """One claim of a fresh key; if it answers new, commits it and records the ack."""
    try:
        c = Resp(port=a.port)
        r = c.call("IDEM.CLAIM", a.key, TTL_MS, LEASE_MS, "FP", "fp:" + a.key)
        if isinstance(r, list) and r and r[0] == b"new":
            with open(a.ack, "a") as f:
                f.write("I %s %d\n" % (a.key, r[1]))
            cr = c.call("IDEM.COMMIT", a.key, r[1], result_of(a.key, a.result_bytes))
            if cr == ("status", "OK"):
                with open(a.ack, "a") as f:
                    f.write("C %s %d\n" % (a.key, r[1]))
            print("new %s" % show(cr))
        else:
            print(show(r))
        c.close()
        return 0
    except (OSError, ConnectionError, ValueError) as e:
        print("(connection error: %s)" % e)
        return 1


def cmd(a):
    try:
        c = Resp(port=a.port, unix=a.unix, timeout=a.timeout)
        print(show(c.call(*a.args)))
        c.close()
        return 0
    except (OSError, ConnectionError, ValueError) as e:
        print("(connection error: %s)" % e)
        return 1


def main():
    p = argparse.ArgumentParser()
    sub = p.add_subparsers(dest="sub", required=True)
    f = sub.add_parser("fill")
    f.add_argument("--port", type=int, required=True)
    f.add_argument("--prefix", required=True)
    f.add_argument("--ack", required=True)
    f.add_argument("--conns", type=int, default=4)
    f.add_argument("--result-bytes", type=int, default=512)
    f.add_argument("--max-keys", type=int, default=100000)
    f.add_argument("--full-stop", type=int, default=20)
    f.add_argument("--timeout", type=float, default=120)
    f.add_argument("--incompressible", action="store_true")
    c = sub.add_parser("check")
    c.add_argument("--port", type=int, required=True)
    c.add_argument("--ack", required=True)
    c.add_argument("--result-bytes", type=int, default=512)
    c.add_argument("--no-repeat", action="store_true")
    c.add_argument("--incompressible", action="store_true")
    k = sub.add_parser("claimcommit")
    k.add_argument("--port", type=int, required=True)
    k.add_argument("--key", required=True)
    k.add_argument("--ack", required=True)
    k.add_argument("--result-bytes", type=int, default=512)
    m = sub.add_parser("cmd")
    m.add_argument("--port", type=int)
    m.add_argument("--unix")
    m.add_argument("--timeout", type=float, default=10)
    m.add_argument("args", nargs="+")
    a = p.parse_args()
    global INCOMPRESSIBLE
    INCOMPRESSIBLE = getattr(a, "incompressible", False)
    return {"fill": fill, "check": check, "claimcommit": claim_commit, "cmd": cmd}[a.sub](a)


if __name__ == "__main__":
    sys.exit(main())
