"""test_idemd.py: the idem contract over the wire with redis-py (python3-redis): claim
outcomes with FP and OWNER, exact expiry of finished records only (rule 5), mismatch records, recover (attempts, last_grant_ms), hold -> review,
IDEM.RESOLVE with EXPECT/FORCE and -CHANGED, the audit trail, IDEM.ATTENTION, IDEM.SCAN by
state, IDEM.STATS counters, reads off the event loop (a slow audit query holds up no other client,
nor do seventy slow scans at once; requests pipelined after a read are applied after it), WAIT woken by commit / release (one waiter gets new) / hold / lease
expiry (DEBUG CLOCK ADVANCE), pipelining (replies in order), 64 threads racing one key, and bad
input that keeps the connection usable. Starts its own idemd (--test-clock) on a temp dir.

Run: IDEM_BUILD_DIR=build /usr/bin/python3 tests/python/test_idemd.py
Prints `N passed, M failed` last; exits non-zero on any failure."""

import os
import socket
import sys
import threading
import time
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import redis  # noqa: E402

from idemd_server import Idemd, RawConn, record, stats  # noqa: E402

DAY = 86400000


class Base(unittest.TestCase):
    flags = ("--test-clock",)

    @classmethod
    def setUpClass(cls):
        cls.srv = Idemd(*cls.flags).start()
        cls.w = cls.srv.worker()
        cls.a = cls.srv.admin()

    @classmethod
    def tearDownClass(cls):
        cls.w.close()
        cls.a.close()
        rc = cls.srv.stop()
        assert rc == 0, "idemd exited %r on SIGTERM" % rc

    def key(self, suffix=""):
        return "%s.%s:%s" % (type(self).__name__, self._testMethodName, suffix)

    def claim(self, key, ttl=DAY, lease=30000, *opts, client=None):
        return (client or self.w).execute_command("IDEM.CLAIM", key, ttl, lease, *opts)

    def cmd(self, *args, client=None):
        return (client or self.w).execute_command(*args)

    def get(self, key):
        return record(self.w.execute_command("IDEM.GET", key))

    def now(self):
        return self.a.execute_command("DEBUG", "CLOCK", "GET")

    def advance(self, ms):
        return self.a.execute_command("DEBUG", "CLOCK", "ADVANCE", ms)

    def error(self, *args, client=None):
        """Runs a command that must fail; returns the error text (redis-py strips 'ERR ')."""
        with self.assertRaises(redis.ResponseError) as cm:
            (client or self.w).execute_command(*args)
        return str(cm.exception)

    def parked(self, key, n):
        """Waits until n WAIT claims are parked on key, the one new_token made being its first
        claim: each parked claim counts in seen_count when it parks. A sleep instead let a
        slow waiter arrive after the change it was to be woken by, and the test passed without
        a wait."""
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if int(self.get(key)["seen_count"]) >= 1 + n:
                return
            time.sleep(0.01)
        self.fail("%d waiters did not park on %s" % (n, key))

    def commands_total(self):
        """idemd's total_commands, read by an IDEM.STATS on the admin connection (counted too)."""
        return stats(self.a)["total_commands"]

    def wait_parsed(self, base, n):
        """Waits until idemd has parsed n more commands than the commands_total() that gave
        base, the IDEM.STATS calls made here left out: a read is handed to the reads thread as
        it is parsed, so this is when it is queued there, where a sleep only hoped so. Only for
        a test whose other clients are quiet meanwhile."""
        deadline = time.monotonic() + 30
        polls = 0
        while True:
            polls += 1
            got = self.commands_total() - base - polls
            if got >= n or time.monotonic() > deadline:
                break
            time.sleep(0.005)
        self.assertEqual(got, n, "commands parsed since the base")

    def new_token(self, key, *opts, lease=30000, ttl=DAY):
        r = self.claim(key, ttl, lease, *opts)
        self.assertEqual(r[0], b"new", r)
        self.assertIsInstance(r[1], int)
        return r[1]


class Claims(Base):
    def test_new_busy_done_with_fp(self):
        k = self.key()
        t0 = self.now()
        tok = self.new_token(k, "FP", b'{"amount":100}')
        self.assertEqual(self.claim(k, DAY, 30000, "FP", b'{"amount":100}'), [b"busy", 30000])
        self.assertEqual(self.cmd("IDEM.COMMIT", k, tok, "inv_1"), b"OK")
        self.assertEqual(self.claim(k, DAY, 30000, "FP", b'{"amount":100}'), [b"done", b"inv_1"])
        self.assertEqual(self.claim(k), [b"done", b"inv_1"], "no FP on the claim: not compared")
        rec = self.get(k)
        self.assertEqual(rec["state"], b"committed")
        self.assertEqual(int(rec["first_seen_ms"]), t0)
        self.assertEqual(int(rec["expires_at_ms"]), t0 + DAY)
        self.assertEqual(rec["seen_count"], b"4")
        self.assertEqual(rec["attempts"], b"1")
        self.assertEqual(int(rec["last_grant_ms"]), t0)
        self.assertEqual(len(rec["fingerprint"]), 32)
        self.assertNotIn("token", rec)
        self.assertNotIn("lease_until_ms", rec)
        # rule 4: a repeat later changes neither first_seen nor expiry, nor the version
        self.advance(5000)
        self.assertEqual(self.claim(k, DAY, 30000, "FP", b'{"amount":100}'), [b"done", b"inv_1"])
        rec2 = self.get(k)
        self.assertEqual(rec2["first_seen_ms"], rec["first_seen_ms"])
        self.assertEqual(rec2["expires_at_ms"], rec["expires_at_ms"])
        self.assertEqual(int(rec2["last_seen_ms"]), t0 + 5000)
        self.assertEqual(rec2["seen_count"], b"5")
        self.assertEqual(rec2["version"], rec["version"], "a plain repeat changes no version")
        self.assertEqual(self.cmd("GET", k), b"inv_1")

    def test_in_flight_record_fields(self):
        k = self.key()
        t0 = self.now()
        tok = self.new_token(k, "OWNER", "worker-7", "FP", "body", lease=12345, ttl=99999)
        rec = self.get(k)
        self.assertEqual(rec["state"], b"in_flight")
        self.assertEqual(int(rec["token"]), tok)
        self.assertEqual(rec["owner"], b"worker-7")
        self.assertEqual(int(rec["lease_until_ms"]), t0 + 12345)
        self.assertEqual(int(rec["expires_at_ms"]), t0 + 99999)
        self.assertNotIn("result", rec)
        self.assertIsNone(self.cmd("GET", k))
        self.assertEqual(self.cmd("PTTL", k), -1)

    def test_binary_keys_and_fp(self):
        k1 = b"bin\x00key\r\n" + self.key().encode()
        k2 = b"bin\x00key\r\x00" + self.key().encode()
        t1 = self.new_token(k1, "FP", b"\x00\xff\r\n")
        t2 = self.new_token(k2, "FP", b"\x00\xff\r\n")
        self.assertNotEqual(t1, t2)
        self.cmd("IDEM.COMMIT", k1, t1, b"\x00result\xff")
        self.assertEqual(self.claim(k1, DAY, 30000, "FP", b"\x00\xff\r\n"), [b"done", b"\x00result\xff"])
        self.assertEqual(self.claim(k1, DAY, 30000, "FP", b"\x00\xff\r"), [b"mismatch"])
        # the full key is compared: a 512-byte key differing in its last byte is another key
        base = b"x" * 511
        ta = self.new_token(base + b"a")
        tb = self.new_token(base + b"b")
        self.assertNotEqual(ta, tb)

    def test_mismatch_recorded(self):
        k = self.key()
        tok = self.new_token(k, "FP", "A")
        self.cmd("IDEM.COMMIT", k, tok, "res-A")
        v0 = self.get(k)["version"]
        t1 = self.now()
        self.assertEqual(self.claim(k, DAY, 30000, "FP", "B"), [b"mismatch"])
        rec = self.get(k)
        self.assertEqual(rec["state"], b"committed")
        self.assertEqual(rec["result"], b"res-A", "a mismatch overwrites nothing")
        self.assertEqual(rec["mismatch_count"], b"1")
        self.assertEqual(int(rec["last_mismatch_ms"]), t1)
        self.assertEqual(len(rec["last_mismatch_fp"]), 32)
        self.assertNotEqual(rec["last_mismatch_fp"], rec["fingerprint"])
        self.assertNotEqual(rec["version"], v0, "a recorded mismatch changes the version")
        self.assertEqual(self.claim(k, DAY, 30000, "FP", "A"), [b"done", b"res-A"])
        self.assertEqual(self.claim(k, DAY, 30000, "FP", "C"), [b"mismatch"])
        self.assertEqual(self.get(k)["mismatch_count"], b"2")

    def test_mismatch_in_flight_even_after_lease(self):
        k = self.key()
        self.new_token(k, "FP", "A", lease=1000)
        self.assertEqual(self.claim(k, DAY, 1000, "FP", "B"), [b"mismatch"])
        self.advance(1000)
        self.assertEqual(self.claim(k, DAY, 1000, "FP", "B"), [b"mismatch"])
        self.assertEqual(self.claim(k, DAY, 1000, "FP", "A")[0], b"recover")

    def test_owner_resumes_with_same_token(self):
        k = self.key()
        tok = self.new_token(k, "OWNER", "w1", lease=10000)
        self.advance(4000)
        self.assertEqual(self.claim(k, DAY, 10000, "OWNER", "w1"), [b"new", tok])
        # the repeat ran the lease on from now
        self.assertEqual(self.claim(k, DAY, 10000, "OWNER", "w2"), [b"busy", 10000])
        self.assertEqual(self.claim(k, DAY, 10000), [b"busy", 10000])
        self.advance(10000)
        r = self.claim(k, DAY, 10000, "OWNER", "w1")
        self.assertEqual(r[0], b"recover", "once the lease ran out the same owner recovers")
        self.assertGreater(r[1], tok)
        self.assertEqual(r[2], 2)

    def test_recover_attempts_and_last_grant(self):
        k = self.key()
        g0 = self.now()
        t1 = self.new_token(k, lease=1000)
        self.advance(999)
        self.assertEqual(self.claim(k, DAY, 1000), [b"busy", 1])
        self.advance(1)
        r = self.claim(k, DAY, 1000)
        self.assertEqual(r[0], b"recover")
        self.assertEqual(len(r), 4)
        t2, attempts, last_grant = r[1:]
        self.assertGreater(t2, t1)
        self.assertEqual(attempts, 2)
        self.assertEqual(last_grant, g0, "last_grant_ms is the grant whose lease ran out")
        g1 = self.now()
        self.assertTrue(self.error("IDEM.COMMIT", k, t1, "x").startswith("STALE"))
        self.advance(1000)
        r = self.claim(k, DAY, 1000)
        self.assertEqual(r[0], b"recover")
        self.assertEqual(r[2:], [3, g1])
        t3 = r[1]
        rec = self.get(k)
        self.assertEqual(rec["attempts"], b"3")
        self.assertEqual(int(rec["last_grant_ms"]), self.now())
        self.assertEqual(int(rec["token"]), t3)
        self.assertEqual(self.cmd("IDEM.COMMIT", k, t3, "found-it"), b"OK")
        self.assertEqual(self.claim(k), [b"done", b"found-it"])

    def test_release_then_new(self):
        k = self.key()
        t1 = self.new_token(k)
        self.assertEqual(self.cmd("IDEM.RELEASE", k, t1), b"OK")
        self.assertIsNone(self.get(k))
        self.assertTrue(self.error("IDEM.RELEASE", k, t1).startswith("NOTFOUND"))
        t2 = self.new_token(k)
        self.assertGreater(t2, t1)
        self.assertTrue(self.error("IDEM.RELEASE", k, t1).startswith("STALE"))

    def test_extend(self):
        k = self.key()
        t = self.new_token(k, lease=1000)
        self.advance(900)
        self.assertEqual(self.cmd("IDEM.EXTEND", k, t, 1000), b"OK")
        self.advance(900)
        self.assertEqual(self.claim(k, DAY, 1000), [b"busy", 100])
        self.assertTrue(self.error("IDEM.EXTEND", k, t + 1, 1000).startswith("STALE"))

    def test_commit_idempotent_and_conflict(self):
        k = self.key()
        t = self.new_token(k)
        before = stats(self.a)["conflicting_commits"]
        self.assertEqual(self.cmd("IDEM.COMMIT", k, t, "r1"), b"OK")
        self.assertEqual(self.cmd("IDEM.COMMIT", k, t, "r1"), b"OK")
        self.assertTrue(self.error("IDEM.COMMIT", k, t, "r2").startswith("CONFLICT"))
        self.assertEqual(self.cmd("GET", k), b"r1")
        self.assertEqual(stats(self.a)["conflicting_commits"], before + 1)

    def test_tokens_strictly_increase(self):
        toks = [self.new_token(self.key(i)) for i in range(50)]
        self.assertEqual(toks, sorted(set(toks)))

    def test_set_nx_with_redis_py(self):
        k = self.key()
        self.assertTrue(self.w.set(k, "v1", nx=True, px=10000))
        self.assertFalse(self.w.set(k, "v2", nx=True, px=10000))
        self.assertEqual(self.w.set(k, "v3", nx=True, ex=10, get=True), b"v1")
        self.assertIsNone(self.w.set(self.key("b"), "w", nx=True, px=500, get=True))
        self.assertEqual(self.w.get(k), b"v1")
        self.assertEqual(self.w.exists(k, self.key("b"), self.key("none")), 2)
        self.assertEqual(self.w.pttl(k), 10000)
        self.assertEqual(self.w.ttl(k), 10)
        self.assertEqual(self.claim(k), [b"done", b"v1"])
        # Refused by name, saying why (redis-py strips the "ERR "), as redis-cli shows them.
        with self.assertRaises(redis.ResponseError) as cm:
            self.w.set(k, "v4")
        self.assertTrue(str(cm.exception).startswith("SET without NX is refused: "), cm.exception)
        with self.assertRaises(redis.ResponseError) as cm:
            self.w.expire(k, 100)
        self.assertTrue(str(cm.exception).startswith("EXPIRE is refused: "), cm.exception)
        self.assertEqual(self.w.get(k), b"v1")
        self.assertEqual(self.w.pttl(k), 10000)

    def test_del_none_if_any_unfinished(self):
        a, b = self.key("a"), self.key("b")
        self.w.set(a, "v", nx=True, px=100000)
        self.new_token(b)
        self.assertIn("DEL refused", self.error("DEL", a, b, client=self.a))
        self.assertEqual(self.w.exists(a), 1)
        with self.assertRaises(redis.exceptions.NoPermissionError):
            self.w.delete(a)
        self.assertEqual(self.a.delete(a, self.key("none")), 1)
        self.assertEqual(self.w.exists(a), 0)


class Expiry(Base):
    """Rule 5 over the wire: expiry is exact, only finished records expire, and a record
    finished at or after its expiry keeps its outcome for one more ttl from then."""

    def test_committed_record_expires_exactly_at_expires_at(self):
        k = self.key()
        t0 = self.now()
        t = self.new_token(k, ttl=1000)
        self.assertEqual(self.cmd("IDEM.COMMIT", k, t, "r"), b"OK")
        self.assertEqual(int(self.get(k)["expires_at_ms"]), t0 + 1000)
        self.advance(999)  # expires_at - 1: a repeat
        self.assertEqual(self.claim(k, 1000), [b"done", b"r"])
        self.assertEqual(self.cmd("PTTL", k), 1)
        self.advance(1)  # expires_at: absent, a re-issue is new with a new first_seen
        self.assertIsNone(self.get(k))
        self.assertEqual(self.cmd("EXISTS", k), 0)
        t2 = self.new_token(k, ttl=1000)
        self.assertGreater(t2, t)
        rec = self.get(k)
        self.assertEqual(int(rec["first_seen_ms"]), t0 + 1000)
        self.assertEqual(rec["attempts"], b"1")

    def test_set_nx_expires_exactly(self):
        k = self.key()
        self.assertTrue(self.w.set(k, "v1", nx=True, px=500))
        self.advance(499)
        self.assertEqual(self.w.get(k), b"v1")
        self.assertIsNone(self.w.set(k, "v2", nx=True, px=500))
        self.advance(1)
        self.assertIsNone(self.w.get(k))
        self.assertTrue(self.w.set(k, "v2", nx=True, px=500))
        self.assertEqual(self.w.get(k), b"v2")
        # Never granted to an owner: IDEM.GET leaves out the fields of grants, as it leaves
        # out any field that does not apply (it showed attempts 0 and last_grant_ms 0).
        rec = self.get(k)
        self.assertEqual(rec["result"], b"v2")
        self.assertNotIn("attempts", rec)
        self.assertNotIn("last_grant_ms", rec)

    def test_in_flight_and_review_records_never_expire(self):
        k, h = self.key("in_flight"), self.key("review")
        t = self.new_token(k, ttl=1000, lease=7 * DAY)
        th = self.new_token(h, ttl=1000, lease=7 * DAY)
        self.assertEqual(self.cmd("IDEM.HOLD", h, th, "charged twice?"), b"OK")
        self.advance(100000)  # far past expires_at: the outcomes are open
        self.assertEqual(self.claim(k, 1000)[0], b"busy")
        self.assertEqual(self.claim(h, 1000), [b"review", b"charged twice?"])
        self.assertEqual(self.get(k)["state"], b"in_flight")
        self.assertEqual(self.cmd("EXISTS", k, h), 2)
        # Finished after its expiry: the outcome is kept one more ttl from that moment.
        at = self.now()
        self.assertEqual(self.cmd("IDEM.COMMIT", k, t, "late"), b"OK")
        self.assertEqual(int(self.get(k)["expires_at_ms"]), at + 1000)
        self.advance(999)
        self.assertEqual(self.claim(k, 1000), [b"done", b"late"])
        self.advance(1)
        self.assertEqual(self.claim(k, 1000)[0], b"new")

    def test_repeats_never_extend_expiry(self):
        k = self.key()
        t0 = self.now()
        t = self.new_token(k, ttl=1000)
        self.assertEqual(self.cmd("IDEM.COMMIT", k, t, "r"), b"OK")
        for _ in range(9):
            self.advance(100)
            self.assertEqual(self.claim(k, 1000), [b"done", b"r"])  # rule 4: first_seen stays
        rec = self.get(k)
        self.assertEqual(int(rec["first_seen_ms"]), t0)
        self.assertEqual(int(rec["expires_at_ms"]), t0 + 1000)
        self.advance(100)
        self.assertEqual(self.claim(k, 1000)[0], b"new")


class Operators(Base):
    def test_hold_review_resolve_expect(self):
        k = self.key()
        t = self.new_token(k)
        self.assertEqual(self.cmd("IDEM.HOLD", k, t, "gateway timed out"), b"OK")
        self.assertEqual(self.cmd("IDEM.HOLD", k, t, "gateway timed out"), b"OK")
        self.assertEqual(self.claim(k), [b"review", b"gateway timed out"])
        self.assertTrue(self.error("IDEM.COMMIT", k, t, "x").startswith("STALE"))
        rec = self.get(k)
        self.assertEqual(rec["state"], b"review")
        self.assertEqual(rec["note"], b"gateway timed out")
        v = int(rec["version"])
        with self.assertRaises(redis.exceptions.NoPermissionError):
            self.w.execute_command("IDEM.RESOLVE", k, "commit", "why")
        err = self.error("IDEM.RESOLVE", k, "commit", "ledger checked", "RESULT", "inv-7",
                         "EXPECT", v + 1000, client=self.a)
        self.assertTrue(err.startswith("CHANGED"), err)
        self.assertEqual(self.get(k)["state"], b"review", "-CHANGED changes nothing")
        self.assertEqual(self.cmd("IDEM.RESOLVE", k, "commit", "ledger checked", "RESULT", "inv-7",
                                  "EXPECT", v, client=self.a), b"OK")
        self.assertEqual(self.claim(k), [b"done", b"inv-7"])
        rec = self.get(k)
        self.assertEqual(rec["note"], b"ledger checked")
        err = self.error("IDEM.RESOLVE", k, "release", "again", client=self.a)
        self.assertTrue(err.startswith("the record is committed: it has its outcome"), err)
        self.assertEqual(self.claim(k), [b"done", b"inv-7"], "the refused resolve changed it")
        audit = [record(e) for e in self.cmd("IDEM.AUDIT", "KEY", k, client=self.a)]
        self.assertEqual(len(audit), 1)
        e = audit[0]
        self.assertIn(b"commit", e["action"])
        self.assertEqual(e["reason"], b"ledger checked")
        self.assertEqual(e["state_before"], b"review")
        self.assertEqual(e["state_after"], b"committed")
        self.assertEqual(int(e["version_before"]), v)
        self.assertEqual(e["version_after"], rec["version"])
        # Without users: the peer's uid on the unix socket (SO_PEERCRED); redis-py sets no name.
        self.assertEqual(e["actor"], ("uid=%d@unix" % os.getuid()).encode())
        self.assertEqual(int(e["at_ms"]), self.now())

    def test_resolve_force_on_running_lease(self):
        k = self.key()
        t = self.new_token(k)
        self.assertIn("lease", self.error("IDEM.RESOLVE", k, "release", "dup", client=self.a))
        self.assertEqual(self.get(k)["state"], b"in_flight")
        self.assertEqual(self.cmd("IDEM.RESOLVE", k, "release", "never sent", "FORCE", client=self.a), b"OK")
        self.assertIsNone(self.get(k))
        self.assertTrue(self.error("IDEM.COMMIT", k, t, "late").startswith("NOTFOUND"))
        self.assertGreater(self.new_token(k), t)

    def test_resolve_settle_expired_lease(self):
        k = self.key()
        t = self.new_token(k, lease=1000)
        self.advance(1000)
        self.assertEqual(self.cmd("IDEM.RESOLVE", k, "settle", "nothing to do", client=self.a), b"OK")
        rec = self.get(k)
        self.assertEqual(rec["state"], b"committed")
        self.assertEqual(rec["result"], b"")
        self.assertTrue(self.error("IDEM.COMMIT", k, t, "late").startswith("STALE"))
        self.assertEqual(self.claim(k), [b"done", b""])

    def test_resolve_commit_bumps_token(self):
        k = self.key()
        t = self.new_token(k)
        self.assertEqual(self.cmd("IDEM.RESOLVE", k, "commit", "done by hand", "FORCE", client=self.a), b"OK")
        self.assertEqual(self.claim(k), [b"done", b""])
        self.assertTrue(self.error("IDEM.COMMIT", k, t, "x").startswith("STALE"))

    def test_audit_outlives_keys_newest_first(self):
        k = self.key()
        self.w.set(k, "v", nx=True, px=100000)
        self.assertEqual(self.a.delete(k), 1)
        self.new_token(k)
        self.cmd("IDEM.RESOLVE", k, "release", "second", "FORCE", client=self.a)
        entries = [record(e) for e in self.cmd("IDEM.AUDIT", "KEY", k, client=self.a)]
        self.assertEqual(len(entries), 2, entries)
        self.assertEqual(entries[0]["reason"], b"second", "newest first")
        self.assertIn(b"del", entries[1]["action"].lower())
        self.assertEqual(entries[1]["state_before"], b"committed")
        self.assertEqual(entries[1]["state_after"], b"absent")
        self.assertGreater(int(entries[0]["seq"]), int(entries[1]["seq"]))
        self.assertEqual(len(self.cmd("IDEM.AUDIT", "COUNT", 1, client=self.a)), 1)
        allseq = [int(record(e)["seq"]) for e in self.cmd("IDEM.AUDIT", "COUNT", 100, client=self.a)]
        self.assertEqual(allseq, sorted(allseq, reverse=True))
        # BEFORE pages back through the whole trail, two entries a page.
        paged, before = [], None
        while True:
            args = ["IDEM.AUDIT", "COUNT", 2] + (["BEFORE", before] if before else [])
            page = [int(record(e)["seq"]) for e in self.cmd(*args, client=self.a)]
            if not page:
                break
            paged += page
            before = page[-1]
        self.assertEqual(paged[:len(allseq)], allseq)
        self.assertEqual(paged, sorted(set(paged), reverse=True), "a page repeated or skipped")
        self.assertTrue(self.error("IDEM.AUDIT", "BEFORE", 0, client=self.a).startswith("syntax"))

    def test_attention(self):
        review, expired, mism = self.key("review"), self.key("expired"), self.key("mismatch")
        fine, running = self.key("fine"), self.key("running")
        t = self.new_token(review)
        self.cmd("IDEM.HOLD", review, t, "why")
        self.new_token(expired, lease=1000)
        t = self.new_token(mism, "FP", "A")
        self.cmd("IDEM.COMMIT", mism, t, "r")
        self.claim(mism, DAY, 30000, "FP", "B")
        t = self.new_token(fine)
        self.cmd("IDEM.COMMIT", fine, t, "r")
        self.new_token(running, lease=DAY)
        self.advance(1000)
        recs = [record(r) for r in self.cmd("IDEM.ATTENTION", client=self.a)]
        keys = {r["key"].decode() for r in recs}
        for k in (review, expired, mism):
            self.assertIn(k, keys)
        for k in (fine, running):
            self.assertNotIn(k, keys)
        with self.assertRaises(redis.exceptions.NoPermissionError):
            self.w.execute_command("IDEM.ATTENTION")

    def test_scan_by_state(self):
        p = self.key()
        want = {"in_flight": set(), "committed": set(), "review": set()}
        for i in range(7):
            k = p + "f%d" % i
            self.new_token(k)
            want["in_flight"].add(k)
        for i in range(5):
            k = p + "c%d" % i
            t = self.new_token(k)
            self.cmd("IDEM.COMMIT", k, t, "r")
            want["committed"].add(k)
        for i in range(3):
            k = p + "r%d" % i
            t = self.new_token(k)
            self.cmd("IDEM.HOLD", k, t, "n")
            want["review"].add(k)

        def scan(*opts):
            got, cursor, rounds = [], 0, 0
            while True:
                cursor, keys = self.cmd("IDEM.SCAN", cursor, *opts, "COUNT", 3, client=self.a)
                got += [k.decode() for k in keys if k.decode().startswith(p)]
                rounds += 1
                self.assertLess(rounds, 10000)
                if int(cursor) == 0:
                    return got

        for state, keys in want.items():
            got = scan("STATE", state)
            self.assertEqual(sorted(got), sorted(keys), state)
        self.assertEqual(sorted(scan()), sorted(set().union(*want.values())))
        self.advance(10000)
        fresh = p + "fresh"
        self.new_token(fresh)
        older = scan("STATE", "in_flight", "OLDER", 5000)
        self.assertEqual(sorted(older), sorted(want["in_flight"]))
        self.assertIn(fresh, scan("STATE", "in_flight"))

    def test_stats_counters(self):
        s0 = stats(self.a)
        k1, k2, k3 = self.key(1), self.key(2), self.key(3)
        t = self.new_token(k1, "FP", "A")
        self.claim(k1, DAY, 30000, "FP", "A")  # busy
        self.cmd("IDEM.COMMIT", k1, t, "r1")
        self.claim(k1, DAY, 30000, "FP", "A")  # done
        self.claim(k1, DAY, 30000, "FP", "B")  # mismatch
        self.error("IDEM.COMMIT", k1, t, "r2")  # conflict
        self.new_token(k2, lease=1000)
        self.advance(1000)
        self.assertEqual(self.claim(k2)[0], b"recover")
        t3 = self.new_token(k3)
        self.cmd("IDEM.HOLD", k3, t3, "n")
        self.assertEqual(self.claim(k3)[0], b"review")
        s1 = stats(self.a)
        d = {n: s1[n] - s0[n] for n in s0 if isinstance(s0[n], int)}
        expect = {"claims_new": 3, "claims_busy": 1, "claims_done": 1, "claims_mismatch": 1,
                  "claims_recover": 1, "claims_review": 1, "mismatches": 1, "recoveries": 1,
                  "conflicting_commits": 1, "keys": 3, "keys_in_flight": 1, "keys_committed": 1,
                  "keys_review": 1}
        self.assertEqual({n: d[n] for n in expect}, expect)
        self.assertEqual(s1["loading"], 0)
        self.assertEqual(s1["fatal"], 0)
        self.assertEqual(self.a.dbsize(), s1["keys"])
        info = self.w.info("idem")
        self.assertEqual(info["claims_new"], s1["claims_new"])


class Wait(Base):
    def waiter(self, key, wait_ms=20000, lease=30000, out=None, *opts):
        """Starts a thread claiming key with WAIT on its own connection."""
        res = {"reply": None, "elapsed": None}

        def run():
            c = self.srv.worker()
            c.ping()
            t0 = time.monotonic()
            try:
                res["reply"] = c.execute_command("IDEM.CLAIM", key, DAY, lease, *opts, "WAIT", wait_ms)
            except Exception as e:  # reported by the test
                res["reply"] = e
            res["elapsed"] = time.monotonic() - t0
            c.close()

        th = threading.Thread(target=run, daemon=True)
        th.start()
        return th, res

    def test_wait_woken_by_commit(self):
        k = self.key()
        t = self.new_token(k)
        th, res = self.waiter(k)
        self.parked(k, 1)
        self.assertIsNone(res["reply"], "the waiter is parked")
        self.cmd("IDEM.COMMIT", k, t, "result-1")
        th.join(15)
        self.assertEqual(res["reply"], [b"done", b"result-1"])
        self.assertLess(res["elapsed"], 10)

    def test_wait_woken_by_release_one_new(self):
        k = self.key()
        t = self.new_token(k)
        waiters = [self.waiter(k) for _ in range(4)]
        self.parked(k, 4)
        self.cmd("IDEM.RELEASE", k, t)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and not any(r["reply"] for _, r in waiters):
            time.sleep(0.01)
        time.sleep(0.3)
        done = [r["reply"] for _, r in waiters if r["reply"] is not None]
        self.assertEqual(len(done), 1, "exactly one waiter gets new; the others wait on it: %r" % done)
        self.assertEqual(done[0][0], b"new")
        self.assertGreater(done[0][1], t)
        self.cmd("IDEM.COMMIT", k, done[0][1], "by-the-new-owner")
        for th, _ in waiters:
            th.join(15)
        replies = [r["reply"] for _, r in waiters]
        self.assertEqual(sum(1 for r in replies if r[0] == b"new"), 1, replies)
        self.assertEqual(sum(1 for r in replies if r == [b"done", b"by-the-new-owner"]), 3, replies)

    def test_wait_woken_by_hold(self):
        k = self.key()
        t = self.new_token(k)
        th, res = self.waiter(k)
        self.parked(k, 1)
        self.cmd("IDEM.HOLD", k, t, "unsure")
        th.join(15)
        self.assertEqual(res["reply"], [b"review", b"unsure"])

    def test_wait_woken_by_lease_expiry(self):
        k = self.key()
        g = self.now()
        t = self.new_token(k, lease=5000)
        th, res = self.waiter(k)
        self.parked(k, 1)
        self.assertIsNone(res["reply"])
        self.advance(4999)
        time.sleep(0.2)
        self.assertIsNone(res["reply"], "not woken before lease_until_ms")
        self.advance(1)
        th.join(15)
        r = res["reply"]
        self.assertEqual(r[0], b"recover", r)
        self.assertGreater(r[1], t)
        self.assertEqual(r[2:], [2, g])
        self.assertLess(res["elapsed"], 10)

    def test_wait_woken_by_resolve(self):
        k = self.key()
        self.new_token(k)
        th, res = self.waiter(k)
        self.parked(k, 1)
        self.cmd("IDEM.RESOLVE", k, "commit", "by hand", "RESULT", "r-op", "FORCE", client=self.a)
        th.join(15)
        self.assertEqual(res["reply"], [b"done", b"r-op"])

    def test_wait_times_out_busy(self):
        k = self.key()
        self.new_token(k)
        th, res = self.waiter(k, 400)
        th.join(15)
        self.assertEqual(res["reply"][0], b"busy", res)
        self.assertGreaterEqual(res["elapsed"], 0.38)

    def test_wait_on_absent_key_is_new(self):
        k = self.key()
        r = self.claim(k, DAY, 1000, "WAIT", 5000)
        self.assertEqual(r[0], b"new")

    def test_wait_over_limit_refused(self):
        self.assertIn("WAIT", self.error("IDEM.CLAIM", self.key(), DAY, 1000, "WAIT", 60001))


class WaitOrder(Base):
    def test_waiters_first_come_first_served(self):
        k = self.key()
        t = self.new_token(k, lease=DAY)
        res, ths = {}, []

        def run(name):
            c = self.srv.worker()
            c.ping()
            res[name] = c.execute_command("IDEM.CLAIM", k, DAY, DAY, "WAIT", 20000)
            c.close()

        for i, name in enumerate("ABC"):
            th = threading.Thread(target=run, args=(name,), daemon=True)
            th.start()
            ths.append(th)
            self.parked(k, i + 1)  # A parks first, then B, then C
        self.cmd("IDEM.RELEASE", k, t)
        ths[0].join(10)
        time.sleep(0.2)
        self.assertEqual(sorted(res), ["A"], "the first waiter gets new, the others wait")
        self.assertEqual(res["A"][0], b"new")
        self.cmd("IDEM.RELEASE", k, res["A"][1])
        ths[1].join(10)
        time.sleep(0.2)
        self.assertEqual(sorted(res), ["A", "B"])
        self.assertEqual(res["B"][0], b"new")
        self.cmd("IDEM.COMMIT", k, res["B"][1], "by-B")
        ths[2].join(10)
        self.assertEqual(res["C"], [b"done", b"by-B"])

    def test_reply_after_wait_keeps_order(self):
        """A PING pipelined behind a WAIT claim is answered after it, on the same connection."""
        k = self.key()
        self.new_token(k)
        so = socket.create_connection(("127.0.0.1", self.srv.port))
        try:
            so.sendall(b"IDEM.CLAIM " + k.encode() + b" 100000 100000 WAIT 800\r\nPING\r\n")
            so.settimeout(0.4)
            with self.assertRaises(socket.timeout):
                so.recv(100)
            so.settimeout(10)
            want = b"*2\r\n$4\r\nbusy\r\n:30000\r\n+PONG\r\n"
            got = b""
            while len(got) < len(want):
                d = so.recv(100)
                if not d:
                    break
                got += d
            self.assertEqual(got, want)
        finally:
            so.close()


class Framing(Base):
    def raw(self, data, until=None):
        """Sends data on a new connection; returns what comes back until the server closes it
        (marked <EOF>) or, with until, until the replies end with it; what came in 10 s
        otherwise. (Half a second of silence taken for the end failed on a loaded machine.)"""
        so = socket.create_connection(("127.0.0.1", self.srv.port))
        so.sendall(data)
        so.settimeout(10)
        out = b""
        try:
            while until is None or not out.endswith(until):
                d = so.recv(65536)
                if not d:
                    return out + b"<EOF>"
                out += d
            return out
        except socket.timeout:
            return out
        finally:
            so.close()

    def test_http_first_line_closes(self):
        self.assertEqual(self.raw(b"POST / HTTP/1.1\r\nHost: x\r\n\r\n"), b"<EOF>")
        self.assertEqual(self.raw(b"GET / HTTP/1.1\r\n\r\n"), b"<EOF>")
        self.assertEqual(self.raw(b"Host: 127.0.0.1\r\n\r\n"), b"<EOF>")
        # only the first line is checked; GET key is a command
        self.assertEqual(self.raw(b"GET k\r\nPING\r\n", b"+PONG\r\n"), b"$-1\r\n+PONG\r\n")

    def test_inline_commands(self):
        self.assertEqual(self.raw(b'ECHO "a\\x41\\n b"\r\n\r\nECHO \'c d\'\r\n', b"c d\r\n"),
                         b"$5\r\naA\n b\r\n$3\r\nc d\r\n")
        self.assertTrue(self.raw(b'ECHO "abc\r\nPING\r\n').endswith(b"<EOF>"), "unbalanced quotes")

    def test_too_many_arguments_keeps_connection(self):
        req = b"*70\r\n" + b"".join(b"$1\r\nx\r\n" for _ in range(70)) + b"PING\r\n"
        out = self.raw(req, b"+PONG\r\n")
        self.assertTrue(out.startswith(b"-ERR"), out)
        self.assertTrue(out.endswith(b"+PONG\r\n"), out)

    def test_bulk_over_protocol_limit_closes(self):
        out = self.raw(b"*2\r\n$4\r\nECHO\r\n$5000000\r\n")
        self.assertTrue(out.startswith(b"-ERR Protocol error"), out)
        self.assertTrue(out.endswith(b"<EOF>"), out)

    def test_long_key_discarded_while_streaming(self):
        # a 1 MiB key: over the field limit, under the protocol limit: refused, connection kept
        key = b"k" * (1 << 20)
        req = b"*4\r\n$10\r\nIDEM.CLAIM\r\n$%d\r\n%s\r\n$4\r\n1000\r\n$4\r\n1000\r\nPING\r\n" % (len(key), key)
        out = self.raw(req, b"+PONG\r\n")
        self.assertTrue(out.startswith(b"-ERR") and b"too long" in out, out[:200])
        self.assertTrue(out.endswith(b"+PONG\r\n"), out[-100:])

    def test_quit(self):
        self.assertEqual(self.raw(b"QUIT\r\nPING\r\n"), b"+OK\r\n<EOF>")


class Shutdown(Base):
    def parked_then_sigterm(self):
        k = self.key()
        self.new_token(k, lease=100000)
        res = {}

        def run():
            c = self.srv.worker()
            c.ping()
            t0 = time.monotonic()
            try:
                res["r"] = c.execute_command("IDEM.CLAIM", k, DAY, 100000, "WAIT", 30000)
            except Exception as e:
                res["r"] = e
            res["t"] = time.monotonic() - t0

        th = threading.Thread(target=run, daemon=True)
        th.start()
        self.parked(k, 1)
        rc = self.srv.kill(15)
        th.join(15)
        self.srv.start()  # the same dir, for tearDownClass and the next test
        type(self).w = self.srv.worker()
        type(self).a = self.srv.admin()
        return rc, res

    def test_sigterm_answers_waiting_claims_busy_and_exits_0(self):
        rc, res = self.parked_then_sigterm()
        self.assertEqual(rc, 0)
        self.assertEqual(res["r"][0], b"busy", res)
        self.assertEqual(res["r"][1], 100000, "lease_left_ms: the test clock stands still")
        self.assertLess(res["t"], 5)


class Idle(Base):
    """A fresh idemd that has served no engine operation, then one that has: idle, it sleeps in
    epoll_wait. (Its loop once spun a whole core from its start until the first operation.)"""

    WINDOW = 1.0
    # A spinning loop uses the whole window; a fresh store's log segments, zeroed by the
    # filler thread after start, may take a share of it on a slow disk.
    IDLE_MAX = 0.5

    def cpu_seconds(self):
        with open("/proc/%d/stat" % self.srv.proc.pid) as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def idle_cpu(self):
        before = self.cpu_seconds()
        time.sleep(self.WINDOW)
        return self.cpu_seconds() - before

    def test_idle_server_uses_no_cpu_before_and_after_its_first_claim(self):
        self.assertTrue(self.w.ping())
        used = self.idle_cpu()
        self.assertLess(used, self.IDLE_MAX * self.WINDOW,
                        "idle before any claim: %.2f s of CPU in %.1f s"
                        % (used, self.WINDOW))
        self.new_token(self.key())
        used = self.idle_cpu()
        self.assertLess(used, self.IDLE_MAX * self.WINDOW,
                        "idle after a claim: %.2f s of CPU in %.1f s"
                        % (used, self.WINDOW))


class SlowReads(Base):
    """A server whose reads each wait DELAY first (under --test-clock,
    IDEM_TEST_READS_DELAY_MS), on idemd's reads thread."""

    DELAY = 1.5

    @classmethod
    def setUpClass(cls):
        os.environ["IDEM_TEST_READS_DELAY_MS"] = str(int(cls.DELAY * 1000))
        try:
            super().setUpClass()
        finally:
            del os.environ["IDEM_TEST_READS_DELAY_MS"]


class Reads(SlowReads):
    """IDEM.SCAN, IDEM.ATTENTION and IDEM.AUDIT are made by a thread of their own: a slow one
    holds up its own connection only, and requests pipelined after it are applied after it."""

    def test_a_slow_audit_query_holds_up_no_other_client(self):
        k = self.key()
        self.new_token(k)
        self.cmd("IDEM.RESOLVE", k, "release", "slow read", "FORCE", client=self.a)
        size = self.cmd("DBSIZE", client=self.a)
        slow = RawConn(self.srv.sock)
        base = self.commands_total()
        t0 = time.monotonic()
        slow.send("IDEM.AUDIT", "KEY", k)
        self.wait_parsed(base, 1)  # the query is with the reads thread now (a sleep hoped so)
        self.assertTrue(self.w.ping())
        self.new_token(self.key("other"))
        self.assertEqual(self.cmd("DBSIZE", client=self.a), size + 1, "the claim made one key")
        # Every other client was answered while the query was out: its reply has not come.
        # (Made on the loop, the query would have been answered before any of them.)
        self.assertTrue(slow.pending(), "the slow query was answered before the other clients")
        entries = slow.reply()
        secs = time.monotonic() - t0
        slow.close()
        self.assertGreater(secs, self.DELAY * 0.9, "the query did not wait its delay")
        self.assertIsInstance(entries, list, entries)
        entries = [record(e) for e in entries]
        self.assertEqual([e["reason"] for e in entries], [b"slow read"], entries)

    def test_requests_pipelined_after_a_read_are_applied_after_it(self):
        # In review, so that IDEM.ATTENTION lists the key until the resolve and not after it
        # (an in_flight key with a running lease is listed by neither).
        k = self.key()
        t = self.new_token(k)
        self.assertEqual(self.cmd("IDEM.HOLD", k, t, "to review"), b"OK")
        p = self.a.pipeline(transaction=False)
        p.execute_command("IDEM.AUDIT", "KEY", k)
        p.execute_command("IDEM.SCAN", 0, "STATE", "review", "COUNT", 100000)
        p.execute_command("IDEM.ATTENTION", "OLDER", 0)
        p.execute_command("IDEM.RESOLVE", k, "release", "after the reads")
        p.execute_command("IDEM.AUDIT", "KEY", k)
        p.execute_command("IDEM.ATTENTION", "OLDER", 0)
        before, scan, listed, resolved, after, attention = p.execute()
        self.assertEqual(before, [], "the first query saw the resolve pipelined after it")
        self.assertIn(k.encode(), scan[1], "the scan missed the review key")
        self.assertIn(k.encode(), [record(r)["key"] for r in listed],
                      "the attention list before the resolve missed the review key")
        self.assertEqual(resolved, b"OK")
        self.assertEqual([record(e)["reason"] for e in after], [b"after the reads"])
        self.assertNotIn(k.encode(), [record(r)["key"] for r in attention],
                         "the attention list after the resolve was made before it")


class GoneReaders(SlowReads):
    """A client that sends a read and leaves withdraws it: the reads thread does not make it,
    and those who stay do not wait behind it. Counted in reads_withdrawn (IDEM.STATS)."""

    DELAY = 1.0
    LEAVERS = 4

    def test_reads_of_clients_that_left_are_not_made(self):
        k = self.key()
        self.new_token(k)
        withdrawn = stats(self.a)["reads_withdrawn"]
        # First in line, a client that stays: the thread makes its read (DELAY) while the
        # others queue behind it, are handed over (parsed), and leave.
        stay = RawConn(self.srv.sock)
        base = self.commands_total()
        stay.send("IDEM.SCAN", 0, "STATE", "in_flight")
        self.wait_parsed(base, 1)
        leavers = [RawConn(self.srv.sock) for _ in range(self.LEAVERS)]
        base = self.commands_total()
        for c in leavers:
            c.send("IDEM.SCAN", 0)
        self.wait_parsed(base, self.LEAVERS)  # received: each is queued for the thread
        for c in leavers:
            c.close()
        deadline = time.monotonic() + 20
        while (stats(self.a)["reads_withdrawn"] - withdrawn < self.LEAVERS
               and time.monotonic() < deadline):
            time.sleep(0.01)
        # Each read of a client that left was withdrawn, not made; none of those that stay.
        self.assertEqual(stats(self.a)["reads_withdrawn"] - withdrawn, self.LEAVERS,
                         "reads of clients that left were not withdrawn")
        scan = stay.reply()
        stay.close()
        self.assertIsInstance(scan, list, scan)
        self.assertIn(k.encode(), scan[1])
        c = self.srv.admin(socket_timeout=30)
        self.assertIn(k.encode(), c.execute_command("IDEM.SCAN", 0, "STATE", "in_flight")[1])
        c.close()
        self.assertEqual(stats(self.a)["reads_withdrawn"] - withdrawn, self.LEAVERS,
                         "a read of a client that stayed was withdrawn")


class ManyReads(SlowReads):
    """Reads past 64 at once go to the reads thread like the others: made on the loop, as they
    were, each stalled every client. With a small engine queue, reads waiting for the thread
    (which hold none of its slots) must not hold claims back either."""

    flags = ("--test-clock", "--queue-depth", "256")
    DELAY = 0.05
    READS = 250  # past the engine room of a 256-deep queue (256 - 64 for a request's ops)

    def test_seventy_slow_reads_at_once_hold_up_no_other_client(self):
        k = self.key()
        self.new_token(k)
        conns = [RawConn(self.srv.sock, timeout=self.READS * self.DELAY * 3 + 10)
                 for _ in range(self.READS)]
        base = self.commands_total()
        for c in conns:
            c.send("IDEM.SCAN", 0, "STATE", "in_flight")
        self.wait_parsed(base, self.READS)  # every scan is parsed and handed over
        t0 = time.monotonic()
        self.assertTrue(self.w.ping())
        self.new_token(self.key("other"))
        others = time.monotonic() - t0
        # The reads were queued before the claim and are not all made yet (the thread takes
        # READS x DELAY for them): the last one's reply has not come.
        self.assertTrue(conns[-1].pending(), "the last scan was answered before the claim")
        # Made on the loop, the reads past 64 would take (READS - 64) x DELAY; counted as
        # engine ops, they would hold the claim until 59 of them are done.
        self.assertLess(others, 1.0, "other clients waited %.2f s for reads" % others)
        # Every scan is answered, each with the in_flight key (the thread takes DELAY a read).
        for c in conns:
            got = c.reply()
            self.assertIsInstance(got, list, got)
            self.assertIn(k.encode(), got[1])
            c.close()


class Loading(Base):
    # acknowledged: durable (batch mode left a window); the test clock lets the test hold the
    # restarted server in -LOADING for 500 ms past its recovery (IDEM_TEST_LOAD_DELAY_MS), so
    # that a quick recovery is seen too
    flags = ("--durability", "sync", "--test-clock")
    KEYS = 100000

    def test_loading_while_recovering(self):
        for b in range(self.KEYS // 5000):
            p = self.a.pipeline(transaction=False)
            for i in range(5000):
                p.execute_command("SET", "load-%d-%d" % (b, i), "v" * 40, "NX", "PX", DAY)
            p.execute()
        self.srv.kill(9)
        os.environ["IDEM_TEST_LOAD_DELAY_MS"] = "500"
        try:
            self.srv.spawn(self.srv.port)
        finally:
            del os.environ["IDEM_TEST_LOAD_DELAY_MS"]
        seen_loading = pinged = info_loading = 0
        deadline = time.monotonic() + 60
        n = None
        while time.monotonic() < deadline:
            try:
                c = redis.Redis(unix_socket_path=self.srv.sock, socket_timeout=10)
                was_loading = False
                try:
                    # INFO first: loading only goes from 1 to 0, so a PING refused with
                    # -LOADING after it means INFO must have said loading:1 (no race).
                    was_loading = c.info("persistence")["loading"] == 1
                    # PING and ECHO answer -LOADING while the store recovers, as Redis does: a
                    # readiness probe that pings is not told ready too soon.
                    self.assertEqual(c.echo("x"), b"x")
                    self.assertEqual(c.info("persistence")["loading"], 0,
                                     "ECHO answered while the store recovers")
                    self.assertTrue(c.ping())
                    self.assertEqual(c.info("persistence")["loading"], 0,
                                     "PING answered while the store recovers")
                    pinged += 1
                    n = c.dbsize()
                    break
                except redis.BusyLoadingError:
                    seen_loading += 1
                    info_loading += was_loading
                finally:
                    c.close()
            except (redis.ConnectionError, FileNotFoundError, OSError):
                pass
            time.sleep(0.005)
        self.srv.wait_ready(30)
        type(self).w = self.srv.worker()
        type(self).a = self.srv.admin()
        self.assertEqual(n, self.KEYS, "every SET NX acknowledged before the kill")
        self.assertGreater(seen_loading, 0, "-LOADING while the store was opened")
        self.assertEqual(info_loading, seen_loading, "INFO says loading:1 while -LOADING")


class ReviewPolicy(Base):
    flags = ("--test-clock", "--on-lease-expiry", "review")

    def test_expired_lease_goes_to_review(self):
        k = self.key()
        t = self.new_token(k, lease=1000)
        self.advance(1000)
        r = self.claim(k)
        self.assertEqual(r[0], b"review", r)
        self.assertEqual(self.get(k)["state"], b"review")
        self.assertTrue(self.error("IDEM.COMMIT", k, t, "late").startswith("STALE"))
        self.cmd("IDEM.RESOLVE", k, "commit", "checked", "RESULT", "inv", client=self.a)
        self.assertEqual(self.claim(k), [b"done", b"inv"])

    def test_waiter_woken_to_review(self):
        k = self.key()
        self.new_token(k, lease=1000)
        res = {}

        def run():
            c = self.srv.worker()
            res["r"] = c.execute_command("IDEM.CLAIM", k, DAY, 1000, "WAIT", 20000)
            c.close()

        th = threading.Thread(target=run, daemon=True)
        th.start()
        self.parked(k, 1)
        self.advance(1000)
        th.join(15)
        self.assertEqual(res.get("r", [None])[0], b"review", res)


class Wire(Base):
    def test_pipeline_replies_in_order(self):
        p = self.key()
        pipe = self.w.pipeline(transaction=False)
        n = 60
        for i in range(n):
            pipe.execute_command("IDEM.CLAIM", "%s%d" % (p, i), DAY, 30000)
            pipe.execute_command("ECHO", "e%d" % i)
        pipe.execute_command("IDEM.CLAIM", p + "0", DAY, 30000)
        pipe.execute_command("NOSUCHCOMMAND")
        pipe.execute_command("PING")
        res = pipe.execute(raise_on_error=False)
        self.assertEqual(len(res), 2 * n + 3)
        toks = []
        for i in range(n):
            self.assertEqual(res[2 * i][0], b"new", res[2 * i])
            toks.append(res[2 * i][1])
            self.assertEqual(res[2 * i + 1], b"e%d" % i)
        self.assertEqual(toks, sorted(set(toks)), "tokens increase in request order")
        self.assertEqual(res[2 * n][0], b"busy")
        self.assertIsInstance(res[2 * n + 1], redis.ResponseError)
        self.assertIn(res[2 * n + 2], (b"PONG", True))
        pipe = self.w.pipeline(transaction=False)
        for i in range(n):
            pipe.execute_command("IDEM.COMMIT", "%s%d" % (p, i), toks[i], "r%d" % i)
            pipe.execute_command("GET", "%s%d" % (p, i))
        res = pipe.execute()
        for i in range(n):
            self.assertEqual(res[2 * i], b"OK")
            self.assertEqual(res[2 * i + 1], b"r%d" % i)

    def test_64_threads_race_one_key(self):
        nthreads = 64
        clients = [self.srv.worker() for _ in range(nthreads)]
        for c in clients:
            c.ping()  # connected before the race starts
        try:
            for rnd in range(3):
                k = self.key(rnd)
                barrier = threading.Barrier(nthreads)
                out = [None] * nthreads

                def run(i):
                    barrier.wait()
                    try:
                        out[i] = clients[i].execute_command(
                            "IDEM.CLAIM", k, DAY, 30000, "OWNER", "t%d" % i)
                    except Exception as e:
                        out[i] = e

                ths = [threading.Thread(target=run, args=(i,)) for i in range(nthreads)]
                for th in ths:
                    th.start()
                for th in ths:
                    th.join(60)
                    self.assertFalse(th.is_alive(), "a claim thread did not finish")
                outcomes = [r[0] if isinstance(r, list) else r for r in out]
                self.assertEqual(outcomes.count(b"new"), 1, outcomes)
                self.assertEqual(outcomes.count(b"busy"), nthreads - 1, outcomes)
                rec = self.get(k)
                self.assertEqual(rec["seen_count"], str(nthreads).encode())
                # The one new is the winner's: its owner and token are the record's, it
                # commits with the token, and a token no claim was given is stale.
                win = outcomes.index(b"new")
                token = out[win][1]
                self.assertEqual(rec["owner"], b"t%d" % win)
                self.assertEqual(int(rec["token"]), token)
                for i, r in enumerate(out):
                    if i != win:
                        self.assertTrue(0 < r[1] <= 30000, (i, r))
                with self.assertRaisesRegex(redis.ResponseError, "^STALE"):
                    clients[(win + 1) % nthreads].execute_command(
                        "IDEM.COMMIT", k, token + 1, "x")
                self.assertEqual(clients[win].execute_command("IDEM.COMMIT", k, token, "x"), b"OK")
            # SET NX race: exactly one sets
            k = self.key("set")
            barrier = threading.Barrier(nthreads)

            def run_set(i):
                try:
                    barrier.wait()
                    out[i] = clients[i].set(k, "v%d" % i, nx=True, px=100000)
                except Exception as e:  # a loser answers None: an error must not pass for one
                    out[i] = e

            out = ["not run"] * nthreads
            ths = [threading.Thread(target=run_set, args=(i,)) for i in range(nthreads)]
            for th in ths:
                th.start()
            for th in ths:
                th.join(60)
                self.assertFalse(th.is_alive(), "a SET NX thread did not finish")
            self.assertEqual(sum(1 for r in out if r is True), 1, out)
            self.assertEqual(sum(1 for r in out if r is None), nthreads - 1, out)
            winner = [i for i, r in enumerate(out) if r is True][0]
            self.assertEqual(self.w.get(k), b"v%d" % winner)
        finally:
            for c in clients:
                c.close()

    def test_bad_input_keeps_connection(self):
        c = self.srv.worker(single_connection_client=True)
        a = self.a
        cid = c.execute_command("CLIENT", "ID")
        n0 = a.dbsize()
        k = self.key()

        def bad(args, *needles):
            with self.assertRaises(redis.ResponseError) as cm:
                c.execute_command(*args)
            self.assertTrue(any(n in str(cm.exception) for n in needles),
                            "%r: %s" % (args[:1], cm.exception))
            self.assertTrue(c.ping())

        bad(("IDEM.CLAIM", "k" * 513, DAY, 1000), "too long")
        bad(("IDEM.CLAIM", "", DAY, 1000), "empty")
        bad(("IDEM.CLAIM", k, 0, 1000), "ttl_ms")
        bad(("IDEM.CLAIM", k, -5, 1000), "ttl_ms")
        bad(("IDEM.CLAIM", k, "abc", 1000), "ttl_ms")
        bad(("IDEM.CLAIM", k, DAY, 0), "lease_ms")
        bad(("IDEM.CLAIM", k, DAY, 1000, "FP"), "syntax")
        bad(("IDEM.CLAIM", k, DAY, 1000, "BOGUS", "x"), "syntax")
        bad(("IDEM.CLAIM", k), "wrong number of arguments")
        bad(("IDEM.COMMIT", k, 1), "wrong number of arguments")
        bad(("IDEM.COMMIT", k, "notanumber", "r"), "token")
        bad(("NOSUCHCMD", "x"), "unknown command")
        bad(("SET", k, "v"), "refused")
        self.assertEqual(a.dbsize(), n0, "bad input changed nothing")
        t = self.new_token(k)
        bad(("IDEM.COMMIT", k, t, b"x" * 65537), "over the limit", "too long")
        self.assertEqual(self.get(k)["state"], b"in_flight")
        self.assertEqual(c.execute_command("IDEM.COMMIT", k, t, b"x" * 65536), b"OK")
        self.assertEqual(len(c.get(k)), 65536)
        self.assertEqual(c.execute_command("IDEM.CLAIM", k + "k" * (512 - len(k)), DAY, 1000)[0], b"new")
        self.assertEqual(c.execute_command("CLIENT", "ID"), cid, "the same connection throughout")
        c.close()

    def test_large_fp_is_digested(self):
        k = self.key()
        body = os.urandom(1 << 20)
        t = self.new_token(k, "FP", body)
        self.cmd("IDEM.COMMIT", k, t, "r")
        self.assertEqual(self.claim(k, DAY, 1000, "FP", body), [b"done", b"r"])
        self.assertEqual(self.claim(k, DAY, 1000, "FP", body[:-1]), [b"mismatch"])

    def test_command_info_key_positions(self):
        info = self.w.execute_command("COMMAND", "INFO", "idem.claim", "idem.scan", "exists")
        self.assertEqual(info["idem.claim"]["first_key_pos"], 1)
        self.assertEqual(info["idem.scan"]["first_key_pos"], 0)
        self.assertEqual(info["exists"]["last_key_pos"], -1)

    def test_command_info_attention_has_no_key(self):
        info = self.w.execute_command("COMMAND", "INFO", "idem.attention")
        self.assertEqual(info["idem.attention"]["first_key_pos"], 0)

    def test_hello_and_client_from_redis_py(self):
        self.assertEqual(self.w.client_setname("py-worker"), True)
        self.assertIn(self.w.client_getname(), ("py-worker", b"py-worker"))
        with self.assertRaises(redis.ResponseError) as cm:
            self.w.execute_command("HELLO", 3)
        self.assertIn("NOPROTO", str(cm.exception))
        self.assertEqual(self.w.info()["loading"], 0)
        self.assertEqual(self.w.echo("x"), b"x")


class Result(unittest.TextTestResult):
    """Counts passes itself (an error in setUpClass is no test run, yet a failure)."""

    passed = 0

    def addSuccess(self, test):
        super().addSuccess(test)
        self.passed += 1


def main():
    suite = unittest.defaultTestLoader.loadTestsFromModule(sys.modules[__name__])
    result = unittest.TextTestRunner(verbosity=int(os.environ.get("VERBOSE", "1")) + 1,
                                     stream=sys.stdout, resultclass=Result).run(suite)
    failed = len(result.failures) + len(result.errors) + len(result.unexpectedSuccesses)
    skipped = len(result.skipped)
    passed = result.passed
    if result.expectedFailures:
        print("%d expected failures (known idemd bugs, marked in the test file)" %
              len(result.expectedFailures))
    if skipped:
        print("%d passed, %d failed, %d skipped" % (passed, failed, skipped))
    else:
        print("%d passed, %d failed" % (passed, failed))
    return 0 if failed == 0 and passed > 0 else 1


if __name__ == "__main__":
    sys.exit(main())
