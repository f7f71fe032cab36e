#!/usr/bin/env python3
"""Paced load for bench/soak.sh: fresh keys at a target rate, in 1-second slices, against idemd.

Each key is new (a random per-run prefix and a counter), so every claim should answer `new`.
Workloads:
  claim-commit  IDEM.CLAIM key ttl lease, then IDEM.COMMIT key token r (what a worker does; the
                record is committed and expires after the ttl). Commits of one batch travel in
                the same write as the claims of the next, so each batch costs one round trip.
  claim         IDEM.CLAIM only: records stay in_flight, which by the contract never expire
                (memory and disk must grow; a check that the verdict sees growth).
  setnx         SET key v NX PX ttl: a committed record in one command.
Each slice sends at most --rate claims; a slice that ends short is not made up later. One line a
second goes to --log: `t_s sent new other errors`. Standard library only.
"""
import argparse
import os
import re
import socket
import sys
import time

NEW_RE = re.compile(rb"\*2\r\n\$3\r\nnew\r\n:(\d+)\r\n")
NEW_HEAD = b"*2\r\n$3\r\nnew\r\n:"


class Conn:
    def __init__(self, host, port):
        self.s = socket.create_connection((host, port))
        self.s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.buf = bytearray()

    def fill(self):
        d = self.s.recv(1 << 20)
        if not d:
            raise ConnectionError("idemd closed the connection")
        self.buf += d

    def line(self, pos):
        while True:
            e = self.buf.find(b"\r\n", pos)
            if e >= 0:
                return e
            self.fill()

    def one(self, pos):
        """Parse one reply at pos; returns (value, next_pos). Errors come back as Exception."""
        e = self.line(pos)
        t = self.buf[pos:pos + 1]
        body = bytes(self.buf[pos + 1:e])
        if t in (b"+",):
            return body, e + 2
        if t == b"-":
            return Exception(body.decode(errors="replace")), e + 2
        if t == b":":
            return int(body), e + 2
        if t == b"$":
            n = int(body)
            if n < 0:
                return None, e + 2
            while len(self.buf) < e + 2 + n + 2:
                self.fill()
            return bytes(self.buf[e + 2:e + 2 + n]), e + 2 + n + 2
        if t == b"*":
            n = int(body)
            pos = e + 2
            out = []
            for _ in range(max(n, 0)):
                v, pos = self.one(pos)
                out.append(v)
            return out, pos
        raise ValueError("bad reply byte %r" % t)

    def replies(self, n):
        """Read n replies; returns the list (consumed from the buffer)."""
        pos = 0
        out = []
        for _ in range(n):
            v, pos = self.one(pos)
            out.append(v)
        del self.buf[:pos]
        return out

    def claim_tokens(self, n):
        """Read n claim replies; fast path while they are `new`. Returns (tokens, n_new,
        n_other, n_err); a token is None where the reply was not `new`."""
        pos = 0
        tokens = []
        while len(tokens) < n:
            m = NEW_RE.match(self.buf, pos)
            if m:
                tokens.append(int(m.group(1)))
                pos = m.end()
                continue
            rem = bytes(self.buf[pos:pos + 14])
            if NEW_HEAD.startswith(rem) and len(self.buf) - pos < 40:
                self.fill()  # a `new` reply still arriving
                continue
            break
        m_end = pos
        if len(tokens) == n:
            del self.buf[:m_end]
            return tokens, n, 0, 0
        # slow path: something else than `new` among them
        del self.buf[:m_end]
        rest = self.replies(n - len(tokens))
        tk = list(tokens)
        new = len(tokens)
        other = err = 0
        for v in rest:
            if isinstance(v, Exception):
                err += 1
                tk.append(None)
            elif isinstance(v, list) and v and v[0] == b"new":
                new += 1
                tk.append(v[1])
            else:
                other += 1
                tk.append(None)
        return tk, new, other, err


def bulk(b):
    return b"$%d\r\n%s\r\n" % (len(b), b)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--rate", type=int, default=100000)
    ap.add_argument("--duration", type=int, default=60)
    ap.add_argument("--ttl-ms", type=int, default=60000)
    ap.add_argument("--lease-ms", type=int, default=30000)
    ap.add_argument("--workload", choices=("claim-commit", "claim", "setnx"), default="claim-commit")
    ap.add_argument("--batch", type=int, default=1000)
    ap.add_argument("--log", default="-")
    a = ap.parse_args()

    prefix = os.urandom(6).hex().encode()
    ttl = str(a.ttl_ms).encode()
    lease = str(a.lease_ms).encode()
    keylen = len(b"soak:") + len(prefix) + 1 + 12
    kpre = b"soak:" + prefix + b":"
    claim_t = (b"*4\r\n$10\r\nIDEM.CLAIM\r\n$%d\r\n" % keylen + kpre.replace(b"%", b"%%") +
               b"%012x\r\n" + bulk(ttl) + bulk(lease))
    setnx_t = (b"*6\r\n$3\r\nSET\r\n$%d\r\n" % keylen + kpre.replace(b"%", b"%%") +
               b"%012x\r\n$1\r\nv\r\n$2\r\nNX\r\n$2\r\nPX\r\n" + bulk(ttl))
    commit_h = b"*4\r\n$11\r\nIDEM.COMMIT\r\n$%d\r\n" % keylen + kpre.replace(b"%", b"%%") + b"%012x\r\n"

    c = Conn(a.host, a.port)
    log = sys.stdout if a.log == "-" else open(a.log, "w", buffering=1)
    seq = 0
    totals = [0, 0, 0, 0]  # sent new other err
    pending = None  # (first_seq, tokens) of the last claim batch, commits not yet sent
    t0 = time.monotonic()
    for sl in range(a.duration):
        end = t0 + sl + 1
        sent = new = other = err = 0
        while sent < a.rate and time.monotonic() < end:
            n = min(a.batch, a.rate - sent)
            first = seq
            seq += n
            if a.workload == "setnx":
                c.s.sendall(b"".join([setnx_t % i for i in range(first, first + n)]))
                for v in c.replies(n):
                    if v == b"OK":
                        new += 1
                    elif isinstance(v, Exception):
                        err += 1
                    else:
                        other += 1
            else:
                out = [claim_t % i for i in range(first, first + n)]
                ncommit = 0
                if pending:
                    pf, toks = pending
                    cm = []
                    for j, tk in enumerate(toks):
                        if tk is None:
                            continue
                        ts = b"%d" % tk
                        cm.append(commit_h % (pf + j) + b"$%d\r\n%s\r\n$1\r\nr\r\n" % (len(ts), ts))
                    ncommit = len(cm)
                    out = cm + out
                    pending = None
                c.s.sendall(b"".join(out))
                if ncommit:
                    for v in c.replies(ncommit):
                        if isinstance(v, Exception):
                            err += 1
                toks, nn, no, ne = c.claim_tokens(n)
                new += nn
                other += no
                err += ne
                if a.workload == "claim-commit":
                    pending = (first, toks)
            sent += n
        rest = end - time.monotonic()
        if rest > 0:
            time.sleep(rest)
        totals = [totals[0] + sent, totals[1] + new, totals[2] + other, totals[3] + err]
        log.write("%d %d %d %d %d\n" % (sl + 1, sent, new, other, err))
    if pending:  # commit the last batch so nothing is left in_flight
        pf, toks = pending
        cm = []
        for j, tk in enumerate(toks):
            if tk is not None:
                ts = b"%d" % tk
                cm.append(commit_h % (pf + j) + b"$%d\r\n%s\r\n$1\r\nr\r\n" % (len(ts), ts))
        if cm:
            c.s.sendall(b"".join(cm))
            c.replies(len(cm))
    el = time.monotonic() - t0
    sys.stderr.write("soak_load: workload=%s sent=%d new=%d other=%d errors=%d in %.1fs: %.0f claims/s\n"
                     % (a.workload, totals[0], totals[1], totals[2], totals[3], el, totals[0] / el))


if __name__ == "__main__":
    main()
