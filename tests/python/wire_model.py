"""wire_model.py: a seeded random sequence of commands against a live idemd, each reply checked
against a reference model of the contract (the engine's own model test, tests/test_threads.c,
does the same through the C API; this one checks what idemd makes of it on the wire).

idemd runs with --test-clock on a temp dir; one admin connection (the unix socket) sends, one at
a time, over six keys (binary: one with a NUL, one with CR LF, one a prefix of the others):
  IDEM.CLAIM with FP and OWNER drawn (and now and then WAIT of a few ms on a busy key), the owner
  calls with the owner's, an earlier or an unknown token, IDEM.RESOLVE with and without FORCE
  and RESULT, SET NX with PX or EX and GET in any order, DEL of one to three keys, DEBUG CLOCK SET
  (half the time to a lease end or an expiry, or 1 ms before), and restarts (SIGTERM; in sync
  mode also SIGKILL, after which every acknowledged change must be there).
Each reply must be the one the model predicts, in type and value: the claim arrays and their
integers, -STALE / -NOTFOUND / -CONFLICT and the state errors, +OK or nil of SET and its GET,
DEL's count or its refusal. After each step the key is read back four ways: IDEM.GET (state,
first_seen_ms, expires_at_ms, the owner's token, lease_until_ms, attempts, last_grant_ms,
result, note), GET, EXISTS and PTTL/TTL; every key after each restart. Tokens rise.

Run: IDEM_BUILD_DIR=build /usr/bin/python3 tests/python/wire_model.py [--steps N] [--seed N]
      [--durability sync|batch|none] [--policy recover|review]
Prints the seed and `N passed, M failed`; a failure names the step, the request and the reply."""

import argparse
import os
import random
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import redis  # noqa: E402

from idemd_server import Idemd, RawConn, record  # noqa: E402

ABSENT, IN_FLIGHT, COMMITTED, REVIEW = "absent", "in_flight", "committed", "review"
KEYS = [b"mkey-0", b"mkey-1", b"mkey-2", b"m\x00ey-3", b"mk\r\ny-4", b"mkey-"]
FPS = [None, b"content-A", b"content-B"]
OWNERS = [None, b"w1", b"w2"]
LEASES = [100, 1000, 4000, 20000]
GRANTED = 8  # stale tokens remembered per key


class Failure(Exception):
    pass


def ttl_of(k):
    return 3000 * (k + 1)


class Key:
    def __init__(self):
        self.state = ABSENT
        self.first_seen = self.expires_at = self.lease_until = self.last_grant = 0
        self.token = 0  # in_flight: the owner's token
        self.finisher = 0  # committed: the token that committed (0: operator or SET); review: holder
        self.attempts = 0
        self.fp = 0
        self.owner = 0
        self.result = b""
        self.note = None  # review: the note, where known
        self.expiry_moved = False  # finished at or after expires_at: expires_at moved on
        self.granted = []

    def made(self, state, now, ttl):
        """Made anew at now (a claim of an absent key, a SET): the tokens granted are kept."""
        granted = self.granted
        self.__init__()
        self.granted = granted
        self.state = state
        self.first_seen = now
        self.expires_at = now + ttl


class Model:
    def __init__(self, args):
        self.args = args
        self.rng = random.Random(args.seed)
        self.now = 0
        self.max_token = 0
        self.keys = [Key() for _ in KEYS]
        self.step = 0
        self.req = None
        self.srv = Idemd("--test-clock", "--durability", args.durability,
                         "--on-lease-expiry", args.policy, port=0, name="wire-model")
        self.conn = None
        self.restarts = self.kills = self.clock_behind = 0
        self.waits = 0
        self.focus = None  # a key whose boundary the clock was just set to
        self.wrote_at = 0  # the store clock of the last change acknowledged

    # ---- plumbing ----

    def check(self, cond, what):
        if not cond:
            raise Failure("seed %d step %d: %s\n  request: %r" % (self.args.seed, self.step, what,
                                                                 self.req))

    def call(self, *args):
        self.req = args
        self.conn.send(*args)
        return self.conn.reply()

    def expect_error(self, reply, code, what):
        self.check(isinstance(reply, redis.ResponseError) and str(reply).startswith(code + " "),
                   "%s: %r, not -%s" % (what, reply, code))

    def connect(self):
        self.conn = RawConn(self.srv.sock, timeout=30)
        now = self.call("DEBUG", "CLOCK", "GET")
        self.check(isinstance(now, int), "DEBUG CLOCK GET: %r" % (now,))
        if now < self.now:
            # A move of the test clock that no answer rested on may be lost with a kill
            # (sync mode makes a clock durable before an answer that depends on it).
            self.clock_behind += 1
            self.check(self.srv_killed, "the store clock went back at a clean restart: %d < %d"
                       % (now, self.now))
            # never behind a change acknowledged (sync: durable with the clock it was made at)
            self.check(now >= self.wrote_at, "the store clock went back past an acknowledged "
                       "change: %d < %d" % (now, self.wrote_at))
            self.check(self.call("DEBUG", "CLOCK", "SET", self.now) == self.now, "clock set")
        else:
            self.now = now

    def restart(self):
        self.conn.close()
        kill = self.args.durability == "sync" and self.rng.random() < 0.5
        rc = self.srv.kill(9 if kill else 15)
        self.check(kill or rc == 0, "idemd exited %s at SIGTERM" % rc)
        self.srv_killed = kill
        self.kills += kill
        self.restarts += 1
        self.srv.start()
        self.connect()

    def eff(self, m):
        if m.state == COMMITTED and self.now >= m.expires_at:
            return ABSENT
        return m.state

    def grant(self, m, token):
        self.check(isinstance(token, int) and token > self.max_token,
                   "token %r not above every earlier one (%d)" % (token, self.max_token))
        self.check(token < 2 ** 63, "token %d over the limit" % token)
        self.max_token = token
        m.granted = (m.granted + [token])[-GRANTED:]

    def pick_token(self, m):
        r = self.rng.randrange(10)
        if r < 6:
            if m.state == IN_FLIGHT:
                return m.token
            if m.finisher:
                return m.finisher
        if r < 9 and m.granted:
            return self.rng.choice(m.granted)
        return self.max_token + 1 + self.rng.randrange(1000)

    def fresh(self, m, fp, owner, lease, token, k):
        m.made(IN_FLIGHT, self.now, ttl_of(k))
        m.lease_until = self.now + lease
        m.last_grant = self.now
        m.attempts = 1
        m.token = token
        m.fp = fp
        m.owner = owner

    def finish(self, m, k):
        m.state = COMMITTED
        if self.now >= m.expires_at:
            m.expires_at = self.now + ttl_of(k)
            m.expiry_moved = True

    # ---- the reads of one key ----

    def check_key(self, k):
        m = self.keys[k]
        key = KEYS[k]
        eff = self.eff(m)
        if eff == ABSENT:
            m.state = ABSENT
        rec = record(self.call("IDEM.GET", key))
        self.check((rec is not None) == (eff != ABSENT),
                   "key %d: IDEM.GET %r, model %s" % (k, rec, eff))
        exists = self.call("EXISTS", key)
        self.check(exists == (0 if eff == ABSENT else 1), "key %d: EXISTS %r, model %s"
                   % (k, exists, eff))
        get = self.call("GET", key)
        pttl = self.call("PTTL", key)
        ttl = self.call("TTL", key)
        if eff == ABSENT:
            self.check(get is None and pttl == -2 and ttl == -2,
                       "key %d absent: GET %r PTTL %r TTL %r" % (k, get, pttl, ttl))
            return
        num = lambda name: int(rec[name]) if name in rec else None  # noqa: E731
        self.check(rec["key"] == key, "key %d: IDEM.GET key %r" % (k, rec["key"]))
        self.check(rec["state"].decode() == eff, "key %d: state %r, model %s"
                   % (k, rec["state"], eff))
        self.check(num("first_seen_ms") == m.first_seen, "key %d: first_seen_ms %r, model %d"
                   % (k, num("first_seen_ms"), m.first_seen))
        if not m.expiry_moved:
            self.check(num("expires_at_ms") == m.first_seen + ttl_of(k),
                       "key %d: expires_at_ms %r, model %d" % (k, num("expires_at_ms"),
                                                               m.first_seen + ttl_of(k)))
        if eff == IN_FLIGHT:
            self.check(num("token") == m.token and num("lease_until_ms") == m.lease_until and
                       num("attempts") == m.attempts and num("last_grant_ms") == m.last_grant,
                       "key %d in flight: %r, model token %d lease_until %d attempts %d "
                       "last_grant %d" % (k, rec, m.token, m.lease_until, m.attempts,
                                          m.last_grant))
            self.check(get is None and pttl == -1 and ttl == -1,
                       "key %d in flight: GET %r PTTL %r TTL %r" % (k, get, pttl, ttl))
        elif eff == COMMITTED:
            self.check(rec.get("result") == m.result and get == m.result,
                       "key %d: result %r, GET %r, model %r" % (k, rec.get("result"), get,
                                                                m.result))
            left = num("expires_at_ms") - self.now
            self.check(pttl == left and ttl == (left + 500) // 1000,
                       "key %d committed: PTTL %r TTL %r, expires_at_ms - now %d"
                       % (k, pttl, ttl, left))
            if not m.expiry_moved:
                self.check(left == m.expires_at - self.now, "key %d: expires_at" % k)
        else:
            if m.note is not None:
                self.check(rec.get("note") == m.note, "key %d: note %r, model %r"
                           % (k, rec.get("note"), m.note))
            self.check(get is None and pttl == -1 and ttl == -1,
                       "key %d in review: GET %r PTTL %r TTL %r" % (k, get, pttl, ttl))

    # ---- the operations ----

    def op_claim(self, k):
        m = self.keys[k]
        eff = self.eff(m)
        lease = self.rng.choice(LEASES)
        owner = self.rng.randrange(3)
        fp = self.rng.randrange(3)
        if eff != ABSENT and m.fp == 0:
            fp = 0  # a repeat never brings the first fingerprint: not specified
        if eff == IN_FLIGHT and owner and owner == m.owner and fp and fp != m.fp:
            fp = m.fp
        args = ["IDEM.CLAIM", KEYS[k], ttl_of(k), lease]
        opts = []
        if fp:
            opts.append(["FP", FPS[fp]])
        if owner:
            opts.append(["OWNER", OWNERS[owner]])
        conflict = eff != ABSENT and fp and m.fp and fp != m.fp
        busy = eff == IN_FLIGHT and not conflict and self.now < m.lease_until and not (
            owner and owner == m.owner)
        wait = busy and self.rng.random() < 0.1
        if wait:
            opts.append(["WAIT", self.rng.randrange(1, 20)])
            self.waits += 1
        self.rng.shuffle(opts)
        for o in opts:
            args += o
        r = self.call(*args)
        self.check(isinstance(r, list) and r and isinstance(r[0], bytes), "claim: %r" % (r,))
        out = r[0].decode()
        if eff == ABSENT:
            self.check(out == "new" and len(r) == 2, "claim of absent key %d: %r" % (k, r))
            self.grant(m, r[1])
            self.fresh(m, fp, owner, lease, r[1], k)
        elif eff == IN_FLIGHT:
            if conflict:
                self.check(r == [b"mismatch"], "key %d in flight, other content: %r" % (k, r))
            elif self.now < m.lease_until:
                if owner and owner == m.owner:
                    self.check(r == [b"new", m.token], "key %d: owner repeat %r, token %d"
                               % (k, r, m.token))
                    m.lease_until = self.now + lease
                else:
                    self.check(r == [b"busy", m.lease_until - self.now],
                               "key %d: lease runs: %r, model lease_left %d"
                               % (k, r, m.lease_until - self.now))
            elif self.args.policy == "review":
                self.check(r == [b"review", b"lease expired"],
                           "key %d: lease ran out (review policy): %r" % (k, r))
                m.state = REVIEW
                m.finisher = 0
                m.note = b"lease expired"
            else:
                self.check(out == "recover" and len(r) == 4 and r[2] == m.attempts + 1 and
                           r[3] == m.last_grant,
                           "key %d: lease ran out: %r, model attempts %d last_grant %d"
                           % (k, r, m.attempts + 1, m.last_grant))
                self.grant(m, r[1])
                m.token = r[1]
                m.attempts += 1
                m.last_grant = self.now
                m.lease_until = self.now + lease
                m.owner = owner
        elif eff == COMMITTED:
            if conflict:
                self.check(r == [b"mismatch"], "key %d committed, other content: %r" % (k, r))
            else:
                self.check(r == [b"done", m.result], "key %d committed: %r, model result %r"
                           % (k, r, m.result))
        else:  # other content too: a record in review answers review, and records nothing
            self.check(out == "review" and len(r) == 2 and (m.note is None or r[1] == m.note),
                       "key %d in review: %r, model note %r" % (k, r, m.note))

    def op_owner(self, k, kind):
        m = self.keys[k]
        eff = self.eff(m)
        if eff == ABSENT:
            m.state = ABSENT
        tok = self.pick_token(m)
        key = KEYS[k]
        res = b"res-%d" % self.rng.randrange(3)
        note = b"hold-%d-%d" % (k, self.rng.randrange(2))  # a repeat may bring another
        lease = 100 + self.rng.randrange(5000)
        if kind == "commit":
            r = self.call("IDEM.COMMIT", key, tok, res)
        elif kind == "release":
            r = self.call("IDEM.RELEASE", key, tok)
        elif kind == "hold":
            r = self.call("IDEM.HOLD", key, tok, note)
        else:
            r = self.call("IDEM.EXTEND", key, tok, lease)
        if eff == ABSENT:
            return self.expect_error(r, "NOTFOUND", "%s on absent key %d" % (kind, k))
        if eff == IN_FLIGHT:
            if tok != m.token:
                return self.expect_error(r, "STALE", "%s with a stale token on key %d" % (kind, k))
            self.check(r == b"OK", "%s by the owner of key %d: %r" % (kind, k, r))
            if kind == "commit":
                m.result = res
                m.finisher = tok
                self.finish(m, k)
            elif kind == "release":
                m.state = ABSENT
            elif kind == "hold":
                m.state = REVIEW
                m.finisher = tok
                m.note = note
            else:
                m.lease_until = self.now + lease
            return
        if eff == COMMITTED and m.finisher and tok == m.finisher:
            if kind == "commit":
                if res == m.result:
                    self.check(r == b"OK", "repeated commit on key %d: %r" % (k, r))
                else:
                    self.expect_error(r, "CONFLICT", "commit of another result on key %d" % k)
            else:
                self.expect_error(r, "STALE", "%s after commit on key %d" % (kind, k))
            return
        if eff == REVIEW and kind == "hold" and m.finisher and tok == m.finisher:
            self.check(r == b"OK", "repeated hold on key %d: %r" % (k, r))
            m.note = note  # the last reason a hold gave
            return
        self.expect_error(r, "STALE", "%s with a token not current on key %d (%s)"
                          % (kind, k, eff))

    def op_resolve(self, k):
        m = self.keys[k]
        eff = self.eff(m)
        action = self.rng.choice(["commit", "release", "settle"])
        force = self.rng.random() < 0.5
        res = b"op-%d" % self.rng.randrange(3)
        with_result = action == "commit" and self.rng.random() < 0.5
        args = ["IDEM.RESOLVE", KEYS[k], action, "model"]
        opts = []
        if with_result:
            opts.append(["RESULT", res])
        if force:
            opts.append(["FORCE"])
        self.rng.shuffle(opts)
        for o in opts:
            args += o
        r = self.call(*args)
        if eff == ABSENT:
            m.state = ABSENT
            return self.expect_error(r, "NOTFOUND", "resolve of absent key %d" % k)
        if eff == COMMITTED:
            return self.check(isinstance(r, redis.ResponseError) and "is committed" in str(r),
                              "resolve of committed key %d: %r" % (k, r))
        if eff == IN_FLIGHT and self.now < m.lease_until and not force:
            return self.check(isinstance(r, redis.ResponseError) and "lease still runs" in str(r),
                              "resolve of key %d with a running lease: %r" % (k, r))
        self.check(r == b"OK", "resolve %s of key %d (%s): %r" % (action, k, eff, r))
        m.finisher = 0  # a resolve leaves no owner: every token is stale
        if action == "release":
            m.state = ABSENT
            return
        m.result = res if with_result else b""
        self.finish(m, k)

    def op_del(self):
        ks = self.rng.sample(range(len(KEYS)), self.rng.randrange(1, 4))
        effs = [self.eff(self.keys[k]) for k in ks]
        r = self.call("DEL", *[KEYS[k] for k in ks])
        if any(e in (IN_FLIGHT, REVIEW) for e in effs):
            return self.check(isinstance(r, redis.ResponseError) and "DEL refused" in str(r),
                              "DEL of %r (%r): %r, not refused" % (ks, effs, r))
        self.check(r == sum(e == COMMITTED for e in effs), "DEL of %r (%r): %r" % (ks, effs, r))
        for k in ks:
            self.keys[k].state = ABSENT

    def op_set(self, k):
        m = self.keys[k]
        eff = self.eff(m)
        get_old = self.rng.random() < 0.5
        val = b"set-%d" % self.rng.randrange(3)
        opts = [["NX"], ["PX", ttl_of(k)] if self.rng.random() < 0.5 else ["EX", ttl_of(k) // 1000]]
        if get_old:
            opts.append(["GET"])
        self.rng.shuffle(opts)
        args = ["SET", KEYS[k], val]
        for o in opts:
            args += o
        r = self.call(*args)
        if eff == ABSENT:
            self.check(r == (None if get_old else b"OK"), "SET of absent key %d: %r" % (k, r))
            m.made(COMMITTED, self.now, ttl_of(k))
            m.result = val
        elif eff == COMMITTED:
            self.check(r == (m.result if get_old else None), "SET of committed key %d: %r, "
                       "model %r" % (k, r, m.result))
        elif get_old:
            self.check(isinstance(r, redis.ResponseError) and str(r).startswith("ERR "),
                       "SET GET of unfinished key %d: %r" % (k, r))
        else:
            self.check(r is None, "SET of unfinished key %d: %r" % (k, r))

    def op_clock(self):
        target = self.now + self.rng.randrange(3000)
        if self.rng.random() < 0.5:
            k = self.rng.randrange(len(KEYS))
            m = self.keys[k]
            eff = self.eff(m)
            # an unfinished record's expires_at too: one finished at it keeps its outcome a ttl
            b = m.expires_at if eff in (COMMITTED, REVIEW) else 0
            if eff == IN_FLIGHT:
                b = self.rng.choice([m.lease_until, m.expires_at])
            b -= self.rng.randrange(2)
            if b > self.now:
                target = b
                self.focus = k  # the next step is on this key more often than not
        r = self.call("DEBUG", "CLOCK", "SET", target)
        self.check(r == target, "DEBUG CLOCK SET %d: %r" % (target, r))
        self.now = target
        self.check(self.call("DEBUG", "CLOCK", "GET") == target, "the test clock moved")

    def run(self):
        self.srv_killed = False
        self.srv.start()
        self.connect()
        try:
            for self.step in range(self.args.steps):
                k = self.rng.randrange(len(KEYS))
                if self.focus is not None and self.rng.random() < 0.6:
                    k = self.focus
                self.focus = None
                before = [vars(m).copy() for m in self.keys]
                r = self.rng.randrange(1000)
                if r < 350:
                    self.op_claim(k)
                elif r < 500:
                    self.op_owner(k, "commit")
                elif r < 550:
                    self.op_owner(k, "release")
                elif r < 600:
                    self.op_owner(k, "hold")
                elif r < 660:
                    self.op_owner(k, "extend")
                elif r < 700:
                    self.op_resolve(k)
                elif r < 730:
                    self.op_del()
                elif r < 770:
                    self.op_set(k)
                elif r < 990:
                    self.op_clock()
                else:
                    self.restart()
                    for i in range(len(KEYS)):
                        self.check_key(i)
                    continue
                if before != [vars(m) for m in self.keys]:
                    self.wrote_at = self.now  # a change was acknowledged at this clock
                self.check_key(k)
            for i in range(len(KEYS)):
                self.check_key(i)
        finally:
            self.conn.close()
        rc = self.srv.stop()
        self.check(rc == 0, "idemd exited %s at SIGTERM" % rc)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=3000)
    ap.add_argument("--seed", type=int, default=random.randrange(1, 2 ** 32))
    ap.add_argument("--durability", default="sync", choices=["sync", "batch", "none"])
    ap.add_argument("--policy", default="recover", choices=["recover", "review"])
    args = ap.parse_args()
    print("wire_model: seed %d, %d steps, --durability %s --on-lease-expiry %s"
          % (args.seed, args.steps, args.durability, args.policy), flush=True)
    m = Model(args)
    try:
        m.run()
    except Failure as e:
        print("FAIL %s" % e)
        print("idemd log (tail):\n" + open(m.srv.log_path, "rb").read()[-3000:].decode(
            errors="replace"))
        print("0 passed, 1 failed")
        return 1
    print("wire_model: %d steps, %d restarts (%d by SIGKILL, the clock behind after %d), "
          "%d claims with WAIT, last token %d" % (args.steps, m.restarts, m.kills, m.clock_behind,
                                                  m.waits, m.max_token))
    print("1 passed, 0 failed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
