"""kill9_loop.py: the kill -9 loop (issue 3). idemd runs in sync mode on a temp dir; client
threads, one connection each, claim fresh keys (some with an OWNER id), commit, release, hold,
extend leases, resume in-flight keys (by token, or by claiming again with their OWNER) and repeat
settled ones, logging every acknowledged reply (and every request left unanswered) to a file,
flushed after each line. idemd is killed with SIGKILL after a random 50-500 ms (sometimes again
while it recovers), restarted on the same dir, and after each restart the log is replayed and
every acknowledged claim/commit is checked with IDEM.GET and by claiming again: the record is
there with the same token, the same result, committed records unchanged and first_seen
unchanged, no key is granted `new` twice (but to its own OWNER again, with the same token),
released keys stay absent, an acknowledged extend's lease end holds, and tokens are unique and
strictly increasing across restarts (and per connection).

Run: IDEM_BUILD_DIR=build /usr/bin/python3 tests/python/kill9_loop.py [--cycles N] [--seed S]
(env KILL_CYCLES, KILL_SEED). Runs of more than 100 cycles bound the checker's own work: every
cycle checks the keys it touched plus 1,000 others, every 100th all 50,000 tracked keys.
Prints the seed, one line per cycle and `N passed, M failed`
(N, M: cycles)."""

import argparse
import json
import os
import random
import signal
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import redis  # noqa: E402

from idemd_server import Idemd, record  # noqa: E402

TTL = 30 * 86400000  # nothing expires during a run (even the 10000-cycle tier)
LEASE = 7 * 86400000  # the longest lease: an in-flight claim stays busy throughout
LEASE_OWNED = 86400000  # claims with an OWNER: a day, so that an extend (to LEASE) shows
OWNED = 0.3  # of fresh claims, those made with an OWNER id
THREADS = 16
FIRST_SEEN_SLACK_MS = 1000
SIGNIFICANT = ("key", "state", "first_seen_ms", "expires_at_ms", "fingerprint", "lease_until_ms",
               "token", "owner", "attempts", "last_grant_ms", "result", "note", "mismatch_count",
               "version")
# batch/none mode: the contract allows losing the last 10 ms of acknowledged changes. Losses are
# always reported (the oldest, in ms before the kill); they fail the run only when
# KILL_LOSS_WINDOW_MS is set (the interval, a flush and scheduling slack: test_kill9.sh sets 250),
# as the window depends on the disk.
LOSS_WINDOW_S = float(os.environ.get("KILL_LOSS_WINDOW_MS", "inf")) / 1000
# rule 9 for resolves that were never acknowledged but took effect: a resolve durable without
# its audit entry fails the run (KILL_STRICT_AUDIT=0 only reports it)
STRICT_AUDIT = os.environ.get("KILL_STRICT_AUDIT", "1") == "1"
LOST = (redis.ConnectionError, redis.TimeoutError, OSError)


class Log:
    """The acknowledgement log: one JSON object a line, flushed after each."""

    def __init__(self, path):
        self.path = path
        self.f = open(path, "a", buffering=1)
        self.lock = threading.Lock()
        self.read_at = 0
        self.acked = 0  # replies written as acknowledged (not lost), in all

    def write(self, **ev):
        ev["at"] = round(time.monotonic(), 4)
        line = json.dumps(ev, separators=(",", ":")) + "\n"
        with self.lock:
            self.f.write(line)
            self.f.flush()
            self.acked += not ev.get("lost")

    def truncate_if_over(self, limit):
        """Long runs: drops the lines already checked once the file is over limit bytes."""
        with self.lock:
            if self.read_at > limit:
                self.f.truncate(0)
                self.read_at = 0

    def new_lines(self):
        with open(self.path) as f:
            f.seek(self.read_at)
            data = f.read()
        end = data.rfind("\n") + 1
        self.read_at += len(data[:end].encode())
        return [json.loads(x) for x in data[:end].splitlines() if x]


class Key:
    __slots__ = ("state", "token", "result", "fp", "pending", "first_seen", "snap", "acked_claims",
                 "at", "note", "audit", "audit_acked", "hold_note", "sent_ms", "mismatches",
                 "owner", "lease_min")

    def __init__(self, fp, owner=None):
        self.state = None  # in_flight, committed, released, lost_claim
        self.token = None
        self.result = None
        self.fp = fp
        self.pending = None  # ("commit", result) or ("release",): sent, never answered
        self.first_seen = None
        self.sent_ms = None  # (wall ms before the claim was sent, after its reply came)
        self.snap = None
        self.acked_claims = 0
        self.at = 0.0  # when the last acknowledged change was received (monotonic s)
        self.note = None  # review: the hold reason
        self.audit = None  # the reason of a resolve that took effect: in the audit trail
        self.audit_acked = False  # that resolve was acknowledged
        self.hold_note = None  # the note before a resolve (for a resolve lost in batch mode)
        self.mismatches = 0  # acknowledged claims with other content (rule 3: recorded)
        self.owner = owner  # the OWNER id it was claimed with (rule 7's re-entrant claims)
        self.lease_min = None  # in flight: the lease ends no sooner (wall ms), if known


class Checker:
    def __init__(self, lossy=False):
        self.lossy = lossy  # batch/none: the last acknowledged changes may be lost
        self.lost_acks = 0
        self.audit_gaps = []  # unacknowledged resolves that took effect without an audit entry
        self.lost_max_age = 0.0  # the oldest lost acknowledgement, in s before the kill
        self.lost_oldest = ""
        self.kill_at = 0.0
        self.keys = {}
        self.run_tokens = {}  # token -> key, granted in the run being replayed
        self.last_run_tokens = {}  # the same for the run before (unanswered claims join it)
        self.ntokens = 0
        self.prev_runs_max = 0  # the largest token of all earlier runs of idemd
        self.older_max = 0  # the same, before the run that was just killed
        self.run_max = 0
        self.last_tok_by_conn = {}
        self.violations = []
        self.warnings = []

    def bad(self, msg):
        self.violations.append(msg)

    def grant(self, key, tok, conn, how):
        if not isinstance(tok, int) or tok <= 0 or tok >= 1 << 63:
            return self.bad("%s %s: token %r is not in 1..2^63-1" % (how, key, tok))
        # unique: within a run by these maps, across runs because each run's tokens exceed
        # every earlier run's
        seen = self.last_run_tokens if conn is None else self.run_tokens
        if tok in seen and seen[tok] != key:
            self.bad("%s %s: token %d was already granted for %s" % (how, key, tok, seen[tok]))
        if tok not in seen:
            self.ntokens += 1
        seen[tok] = key
        if conn is None:  # seen only after the restart: issued by the run just killed
            if tok <= self.older_max:
                self.bad("%s %s: token %d is not above %d, the largest before its run" %
                         (how, key, tok, self.older_max))
            self.prev_runs_max = max(self.prev_runs_max, tok)
        elif tok <= self.prev_runs_max:
            self.bad("%s %s: token %d is not above %d, the largest before the restart" %
                     (how, key, tok, self.prev_runs_max))
        if conn is not None:
            last = self.last_tok_by_conn.get(conn, 0)
            if tok <= last:
                self.bad("%s %s: token %d not above %d, the previous one on this connection" %
                         (how, key, tok, last))
            self.last_tok_by_conn[conn] = tok
        self.run_max = max(self.run_max, tok)

    def apply(self, ev):
        """One line of the log, in the order written."""
        op, key = ev["op"], ev["key"]
        k = self.keys.get(key)
        conn = (ev["run"], ev["thr"])
        if op == "claim":  # a fresh key, never claimed before
            if k is not None:
                return self.bad("fresh key %s claimed twice by the client (test bug)" % key)
            k = self.keys[key] = Key(ev["fp"], ev.get("owner"))
            if ev.get("lost"):
                k.state = "lost_claim"
                return
            k.acked_claims += 1
            k.sent_ms = (ev["w0"], ev["w1"])
            if ev["out"] != "new":
                k.state = "lost_claim"  # whatever it is, IDEM.GET will tell
                return self.bad("fresh key %s: claim answered %r, not new" % (key, ev["reply"]))
            self.grant(key, ev["tok"], conn, "claim")
            k.state, k.token, k.at = "in_flight", ev["tok"], ev["at"]
            k.lease_min = ev["w0"] + (LEASE_OWNED if k.owner else LEASE)
        elif op == "extend":  # the owner runs its lease on: to w0 + LEASE at least
            k.snap = None  # a new version, or perhaps one (unanswered)
            if ev.get("lost"):
                return  # the lease moved on, or stayed: either way lease_min still holds
            if ev["out"] != "OK":
                return self.bad("extend %s token %d: answered %r" % (key, ev["tok"], ev["out"]))
            if k.state != "in_flight" or k.token != ev["tok"]:
                return self.bad("extend %s: acknowledged OK but the model has %s token %r" %
                                (key, k.state, k.token))
            k.at = ev["at"]
            k.lease_min = ev["w0"] + LEASE
        elif op == "reenter":  # a claim with the key's OWNER while its lease runs: same token
            k.snap = None
            if ev.get("lost"):
                k.lease_min = None  # it may have shortened an extended lease
                return
            k.acked_claims += 1
            if ev["reply"] != ["new", k.token]:
                return self.bad("claim %s with its OWNER %s (token %d): answered %r" %
                                (key, k.owner, k.token, ev["reply"]))
            k.at = ev["at"]
            k.lease_min = ev["w0"] + LEASE_OWNED
        elif op in ("commit", "release", "hold"):
            if ev.get("lost"):
                k.pending = (op, ev.get("res"))
                return
            if ev["out"] != "OK":
                return self.bad("%s %s token %d: answered %r" % (op, key, ev["tok"], ev["out"]))
            if k.state != "in_flight" or k.token != ev["tok"]:
                return self.bad("%s %s: acknowledged OK but the model has %s token %r" %
                                (op, key, k.state, k.token))
            k.at = ev["at"]
            if op == "commit":
                k.state, k.result, k.snap = "committed", ev["res"], None
            elif op == "hold":
                k.state, k.note, k.snap = "review", ev["res"], None
            else:
                k.state, k.snap = "released", None
        elif op == "resolve":  # an operator commits a review record: audited
            if ev.get("lost"):
                k.pending = (op, ev["res"])
                return
            if ev["out"] != "OK":
                return self.bad("resolve %s: answered %r" % (key, ev["out"]))
            if k.state != "review":
                return self.bad("resolve %s: acknowledged OK but the model has %s" % (key, k.state))
            k.at = ev["at"]
            k.hold_note = k.note
            k.state, k.result, k.note, k.audit, k.snap = "committed", ev["res"], ev["res"], ev["res"], None
            k.audit_acked = True
        elif op == "repeat":
            if ev.get("lost"):
                return
            k.acked_claims += 1
            self.check_repeat(key, k, ev["reply"], "repeat")
        elif op == "mismatch":  # a committed key claimed with other content
            k.snap = None  # recorded (or, unanswered, perhaps): a new version of the record
            if ev.get("lost"):
                return
            k.acked_claims += 1
            if ev["reply"] != ["mismatch"]:
                return self.bad("mismatch %s (%s): answered %r" % (key, k.state, ev["reply"]))
            k.mismatches += 1

    def check_repeat(self, key, k, reply, how):
        out = reply[0] if isinstance(reply, list) and reply else reply
        if out == "new" or out == "recover":
            self.bad("%s %s (%s): answered %r: granted again" % (how, key, k.state, reply))
        elif k.state == "committed":
            if reply != ["done", k.result]:
                self.bad("%s %s: expected done %r, got %r" % (how, key, k.result, reply))
        elif k.state == "review":
            if reply != ["review", k.note]:
                self.bad("%s %s: expected review %r, got %r" % (how, key, k.note, reply))
        elif k.state == "in_flight":
            if out != "busy":
                self.bad("%s %s (in_flight, token %d): expected busy, got %r" %
                         (how, key, k.token, reply))

    def verify(self, cl, keys, claim_again):
        """IDEM.GET of each key (pipelined) against the model; settles pending requests."""
        keys = list(keys)
        recs = []
        for i in range(0, len(keys), 500):
            p = cl.pipeline(transaction=False)
            for key in keys[i:i + 500]:
                p.execute_command("IDEM.GET", key)
            recs += [record(r) for r in p.execute()]
        for key, rec in zip(keys, recs):
            k = self.keys[key]
            rec = {n: (v.decode() if isinstance(v, bytes) else v) for n, v in rec.items()} if rec else None
            self.settle(key, k, rec)
            if rec is None:
                continue
            fs = int(rec["first_seen_ms"])
            if k.first_seen is None and k.sent_ms:
                # The first look: first_seen is when the acknowledged claim was made (the store
                # clock follows the wall clock here; a second of slack for its slew), and the
                # grant it made is the only one (a lease of a week is never recovered).
                w0, w1 = k.sent_ms
                if not w0 - FIRST_SEEN_SLACK_MS <= fs <= w1 + FIRST_SEEN_SLACK_MS:
                    self.bad("%s: first_seen_ms %d is not when it was claimed (%d..%d)" %
                             (key, fs, w0, w1))
                if int(rec["attempts"]) != 1 or int(rec["last_grant_ms"]) != fs:
                    self.bad("%s: attempts %s, last_grant_ms %s: not the one grant at %d" %
                             (key, rec["attempts"], rec["last_grant_ms"], fs))
            if k.first_seen is None:
                k.first_seen = fs
            elif fs != k.first_seen:
                self.bad("%s: first_seen_ms changed from %d to %d" % (key, k.first_seen, fs))
            if int(rec["expires_at_ms"]) != k.first_seen + TTL:
                self.bad("%s: expires_at_ms %s is not first_seen + ttl" % (key, rec["expires_at_ms"]))
            snap = tuple(rec.get(n) for n in SIGNIFICANT)
            if k.snap is None:
                k.snap = snap
            elif snap != k.snap:
                diff = {n: (a, b) for n, a, b in zip(SIGNIFICANT, k.snap, snap) if a != b}
                self.bad("%s (%s): record changed across a restart: %r" % (key, k.state, diff))
                k.snap = snap
            if not self.lossy and int(rec["mismatch_count"]) < k.mismatches:
                self.bad("%s: mismatch_count %s below %d acknowledged mismatches (rule 3)" %
                         (key, rec["mismatch_count"], k.mismatches))
            if (not self.lossy and k.state == "in_flight" and rec["state"] == "in_flight" and
                    k.lease_min and int(rec["lease_until_ms"]) < k.lease_min - FIRST_SEEN_SLACK_MS):
                self.bad("%s: lease_until_ms %s is before %d, the acknowledged lease's end" %
                         (key, rec["lease_until_ms"], k.lease_min))
            if k.state == "in_flight" and rec["state"] == "in_flight" and k.owner and \
                    rec.get("owner") != k.owner:
                self.bad("%s: owner %r, claimed by %r" % (key, rec.get("owner"), k.owner))
            if rec["state"] == "committed" and k.result is not None and rec.get("result") != k.result:
                self.bad("%s: result %r is not the committed %r" % (key, rec.get("result"), k.result))
            if int(rec["seen_count"]) < k.acked_claims:
                self.warnings.append("%s: seen_count %s below %d acknowledged claims" %
                                     (key, rec["seen_count"], k.acked_claims))
        if claim_again:
            live = [key for key in keys if key in self.keys and
                    self.keys[key].state in ("in_flight", "committed", "review")]
            p = cl.pipeline(transaction=False)
            w0 = int(time.time() * 1000)
            for key in live:
                k = self.keys[key]
                if k.state == "in_flight" and k.owner:  # its own worker resumes
                    p.execute_command("IDEM.CLAIM", key, TTL, LEASE_OWNED, "FP", k.fp, "OWNER",
                                      k.owner)
                else:
                    p.execute_command("IDEM.CLAIM", key, TTL, LEASE, "FP", k.fp)
            for key, reply in zip(live, p.execute(raise_on_error=False)):
                k = self.keys[key]
                reply = [x.decode() if isinstance(x, bytes) else x for x in reply] \
                    if isinstance(reply, list) else str(reply)
                k.acked_claims += 1
                if k.state == "in_flight" and k.owner:
                    if reply != ["new", k.token]:
                        self.bad("claim after restart %s with its OWNER %s (token %d): answered "
                                 "%r" % (key, k.owner, k.token, reply))
                    k.snap, k.lease_min = None, w0 + LEASE_OWNED
                else:
                    self.check_repeat(key, k, reply, "claim after restart")

    def verify_audit(self, cl, keys):
        """Rule 9: every acknowledged resolve is in the audit trail after the restart."""
        keys = [key for key in keys if key in self.keys and self.keys[key].audit]
        p = cl.pipeline(transaction=False)
        for key in keys:
            p.execute_command("IDEM.AUDIT", "KEY", key, "COUNT", 10)
        for key, entries in zip(keys, p.execute()):
            found = [record(e) for e in entries]
            want = self.keys[key].audit.encode()
            if any(e.get("reason") == want and e.get("state_before") == b"review" and
                   e.get("state_after") == b"committed" for e in found):
                continue
            if self.keys[key].audit_acked or STRICT_AUDIT:
                self.bad("%s: %s resolve (reason %r) took effect but is missing from the audit "
                         "trail: %r" % (key, "acknowledged" if self.keys[key].audit_acked
                                        else "unacknowledged", want, found))
            else:
                # known idemd bug: audit_write (src/audit.c) drops the store mutex in
                # store_quiesce after the resolve's record was appended, so the flusher can
                # make the change durable before its audit block is written
                self.audit_gaps.append(key)
                self.keys[key].audit = None  # reported once

    def settle(self, key, k, rec):
        st = rec["state"] if rec else None
        tok = int(rec["token"]) if rec and "token" in rec else None
        if k.state == "lost_claim":  # claim never answered: absent, or in flight with a token
            if rec is None:
                del self.keys[key]
            elif st == "in_flight":
                self.grant(key, tok, None, "unanswered claim")
                k.state, k.token, k.pending = "in_flight", tok, None
            else:
                self.bad("%s: unanswered claim, yet the record is %s" % (key, st))
            return
        if k.pending:
            what, res = k.pending
            k.pending = None
            if what == "commit" and st == "committed" and rec.get("result") == res:
                k.state, k.result, k.snap = "committed", res, None
                return
            if what == "release" and rec is None:
                k.state, k.snap = "released", None
                return
            if what == "hold" and st == "review" and rec.get("note") == res:
                k.state, k.note, k.snap = "review", res, None
                return
            if what == "resolve" and st == "committed" and rec.get("result") == res:
                k.state, k.result, k.note, k.audit, k.snap = "committed", res, res, res, None
                k.audit_acked = False
                return
            # else: the request was lost before it took effect; the record must be unchanged
        if self.lossy and not self.matches(k, rec):
            # an acknowledged change lost in the batch window: the record must still be one
            # this key had (absent, or in flight with the token granted for it)
            self.lost_acks += 1
            age = self.kill_at - k.at
            if age > self.lost_max_age:
                self.lost_max_age = age
                self.lost_oldest = "%s: acknowledged %s, found %s" % (key, k.state, st or "absent")
            if age > LOSS_WINDOW_S:
                self.bad("%s: acknowledged %s lost, %.0f ms before the kill (window %.0f ms)" %
                         (key, k.state, age * 1000, LOSS_WINDOW_S * 1000))
            if rec is None:
                del self.keys[key]
                return
            if st == "in_flight" and tok == k.token:
                k.state, k.snap = "in_flight", None
                return
            if st == "review" and k.state == "committed" and k.audit and rec.get("note") == k.hold_note:
                k.state, k.note, k.audit, k.snap = "review", k.hold_note, None, None  # resolve lost
                return
            # anything else is not a state this key ever had: reported below
        if k.state == "released":
            if rec is not None:
                self.bad("%s: released (acknowledged) but present again: %s token %s" % (key, st, tok))
        elif rec is None:
            self.bad("%s: acknowledged %s (token %d) but absent after restart" % (key, k.state, k.token))
        elif st != k.state:
            self.bad("%s: acknowledged %s (token %d) but the record is %s" % (key, k.state, k.token, st))
        elif k.state == "in_flight" and tok != k.token:
            self.bad("%s: in_flight with token %s, acknowledged token %d" % (key, tok, k.token))
        elif k.state == "review" and rec.get("note") != k.note:
            self.bad("%s: review note %r, acknowledged %r" % (key, rec.get("note"), k.note))
        elif k.state == "committed" and rec.get("result") != k.result:
            self.bad("%s: committed result %r, acknowledged %r" % (key, rec.get("result"), k.result))

    @staticmethod
    def matches(k, rec):
        st = rec["state"] if rec else None
        if k.state == "released":
            return rec is None
        if rec is None or st != k.state:
            return False
        if k.state == "in_flight":
            return int(rec["token"]) == k.token
        if k.state == "review":
            return rec.get("note") == k.note
        return rec.get("result") == k.result

    def end_run(self):
        self.older_max = self.prev_runs_max
        self.prev_runs_max = max(self.prev_runs_max, self.run_max)
        self.last_run_tokens, self.run_tokens = self.run_tokens, {}

    def forget_oldest(self, limit):
        """Keeps the model bounded for long runs: forgets the oldest finished keys."""
        excess = len(self.keys) - limit
        if excess <= 0:
            return
        for key in [key for key, k in self.keys.items()
                    if k.state in ("committed", "released") and not k.pending][:excess]:
            del self.keys[key]


def worker(sock, run, thr, seed, log, stop, committed, inflight, review, pool_lock, started,
           fresh_max, errors, killing):
    """One client thread until the kill. A reply it did not expect, or any other failure than
    the connection lost to the kill (killing set), goes to errors (the cycle fails): a thread
    that died quietly left the cycle checking less than it claimed."""
    rng = random.Random("%s/%d/%d" % (seed, run, thr))
    try:
        c = redis.UnixDomainSocketConnection(path=sock, socket_timeout=60)
        c.connect()
    except LOST as e:  # idemd is up and not yet killed: this is a failure
        errors.append("thread %d could not connect: %r" % (thr, e))
        started.release()
        return
    started.release()
    n = 0

    def call(*args):
        c.send_command(*args)
        r = c.read_response()
        if isinstance(r, list):
            return [x.decode() if isinstance(x, bytes) else x for x in r]
        return r.decode() if isinstance(r, bytes) else r

    def owner_call(op, key, tok, res=None):
        args = {"commit": ["IDEM.COMMIT", key, tok, res], "hold": ["IDEM.HOLD", key, tok, res],
                "release": ["IDEM.RELEASE", key, tok], "extend": ["IDEM.EXTEND", key, tok, LEASE]}[op]
        w0 = int(time.time() * 1000)
        try:
            try:
                out = call(*args)
            except redis.ResponseError as e:
                out = "-" + str(e)
        except LOST:
            log.write(op=op, run=run, thr=thr, key=key, tok=tok, res=res, lost=True)
            raise
        log.write(op=op, run=run, thr=thr, key=key, tok=tok, res=res, out=out, w0=w0)

    def give_back(item):  # an in-flight key another round may resume
        with pool_lock:
            inflight.append(item)

    try:
        while not stop.is_set():
            r = rng.random()
            item = None
            if r < 0.08:  # a review record: an operator resolves it, or someone claims it
                with pool_lock:
                    if review:
                        item = review.pop(rng.randrange(len(review)))
                if item:
                    key, fp, note = item
                    if rng.random() < 0.6:
                        res = "op-%s-%d" % (key, rng.randrange(1 << 30))
                        try:
                            try:
                                out = call("IDEM.RESOLVE", key, "commit", res, "RESULT", res)
                            except redis.ResponseError as e:
                                out = "-" + str(e)
                        except LOST:
                            log.write(op="resolve", run=run, thr=thr, key=key, res=res, lost=True)
                            raise
                        log.write(op="resolve", run=run, thr=thr, key=key, res=res, out=out)
                    else:
                        try:
                            reply = call("IDEM.CLAIM", key, TTL, LEASE, "FP", fp)
                        except LOST:
                            log.write(op="repeat", run=run, thr=thr, key=key, lost=True)
                            raise
                        log.write(op="repeat", run=run, thr=thr, key=key, reply=reply)
                    continue
            if r < 0.15:
                with pool_lock:
                    if inflight:
                        item = inflight.pop(rng.randrange(len(inflight)))
                if item and rng.random() < 0.5:  # the owner resumes: commit, or runs on
                    key, fp, tok, owner = item
                    x = rng.random()
                    if x < 0.5:
                        owner_call("commit", key, tok,
                                   "res-%s-resumed-%d" % (key, rng.randrange(1 << 30)))
                    elif x < 0.75 or not owner:
                        owner_call("extend", key, tok)
                        give_back(item)
                    else:  # its reply was lost, say: the same worker claims it again
                        w0 = int(time.time() * 1000)
                        try:
                            reply = call("IDEM.CLAIM", key, TTL, LEASE_OWNED, "FP", fp, "OWNER",
                                         owner)
                        except LOST:
                            log.write(op="reenter", run=run, thr=thr, key=key, lost=True)
                            raise
                        log.write(op="reenter", run=run, thr=thr, key=key, reply=reply, w0=w0)
                        give_back(item)
                    continue
                if item:  # anyone else: busy
                    key, fp, tok, owner = item
                    try:
                        reply = call("IDEM.CLAIM", key, TTL, LEASE, "FP", fp)
                    except LOST:
                        log.write(op="repeat", run=run, thr=thr, key=key, lost=True)
                        raise
                    log.write(op="repeat", run=run, thr=thr, key=key, reply=reply)
                    continue
            capped = fresh_max and n >= fresh_max
            if capped:
                time.sleep(0.002)
            if (r < 0.4 or capped) and committed:
                key, fp, res = committed[rng.randrange(len(committed))]
                op = "mismatch" if rng.random() < 0.1 else "repeat"
                try:
                    reply = call("IDEM.CLAIM", key, TTL, LEASE, "FP",
                                 "other-" + fp if op == "mismatch" else fp)
                except LOST:
                    log.write(op=op, run=run, thr=thr, key=key, lost=True)
                    raise
                log.write(op=op, run=run, thr=thr, key=key, reply=reply)
                continue
            key = "r%d.t%d.n%d" % (run, thr, n)
            n += 1
            fp = "body-%s-%d" % (key, rng.randrange(1 << 30))
            owner = "worker-%d-%d" % (run, thr) if rng.random() < OWNED else None
            claim = ["IDEM.CLAIM", key, TTL, LEASE_OWNED if owner else LEASE, "FP", fp]
            w0 = int(time.time() * 1000)
            try:
                reply = call(*(claim + (["OWNER", owner] if owner else [])))
            except LOST:
                log.write(op="claim", run=run, thr=thr, key=key, fp=fp, owner=owner, lost=True)
                raise
            log.write(op="claim", run=run, thr=thr, key=key, fp=fp, owner=owner, out=reply[0],
                      tok=reply[1] if len(reply) > 1 else None, reply=reply, w0=w0,
                      w1=int(time.time() * 1000))
            if reply[0] != "new":
                continue
            r = rng.random()
            if r < 0.6:
                owner_call("commit", key, reply[1], "res-%s-%d" % (key, rng.randrange(1 << 30)))
            elif r < 0.72:
                owner_call("release", key, reply[1])
            elif r < 0.84:
                owner_call("hold", key, reply[1], "held-%s-%d" % (key, rng.randrange(1 << 30)))
    except LOST as e:
        if not killing.is_set():  # idemd closed it, or went, before the kill
            errors.append("thread %d: connection lost before the kill: %r" % (thr, e))
    except Exception as e:
        errors.append("thread %d: %r" % (thr, e))
    finally:
        c.disconnect()


def log_problems(path, start):
    """Lines of idemd's log past byte start that report a fault no kill explains: a sanitizer's
    report, a failed assertion, a store failed for I/O."""
    with open(path, "rb") as f:
        f.seek(start)
        text = f.read().decode(errors="replace")
    marks = ("AddressSanitizer", "runtime error:", "LeakSanitizer", "assertion failed",
             "event=fatal")
    return [line[:300] for line in text.splitlines() if any(m in line for m in marks)]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cycles", type=int, default=int(os.environ.get("KILL_CYCLES", "20")))
    ap.add_argument("--seed", default=os.environ.get("KILL_SEED") or str(random.randrange(1 << 32)))
    ap.add_argument("--threads", type=int, default=THREADS)
    ap.add_argument("--tmp", default=None, help="work dir (default: a new temp dir)")
    ap.add_argument("--full-every", type=int, default=-1,
                    help="check every tracked key each N cycles (default 25 up to 100 cycles, "
                         "else 100)")
    ap.add_argument("--fresh-per-thread", type=int, default=int(os.environ.get("KILL_FRESH", "-1")),
                    help="fresh keys a thread claims per cycle (0: no limit; default: no limit "
                         "up to 100 cycles, else 20, so that long runs stay bounded)")
    ap.add_argument("--max-tracked", type=int, default=-1,
                    help="keys kept in the model (default 200000 up to 100 cycles, else 50000: "
                         "the model's per-cycle work grows with it)")
    ap.add_argument("--durability", default="sync", choices=("sync", "batch", "none"),
                    help="batch/none: acknowledged changes may be lost; tokens are still checked")
    args = ap.parse_args()
    if args.fresh_per_thread < 0:
        args.fresh_per_thread = 0 if args.cycles <= 100 else 20
    long_run = args.cycles > 100
    if args.full_every < 0:
        args.full_every = 100 if long_run else 25
    if args.max_tracked < 0:
        args.max_tracked = 50000 if long_run else 200000
    rng = random.Random(args.seed)
    print("kill9: durability %s, seed %s, cycles %d, threads %d (rerun: --seed %s --cycles %d)" %
          (args.durability, args.seed, args.cycles, args.threads, args.seed, args.cycles), flush=True)

    srv = Idemd("--durability", args.durability, tmp=args.tmp, port=0, name="kill9")
    log = Log(os.path.join(srv.tmp, "acks.jsonl"))
    chk = Checker(lossy=args.durability != "sync")
    passed = failed = 0
    seen_log = 0  # idemd's log up to here was looked at (log_problems)
    srv.start()
    t_start = time.monotonic()
    for cycle in range(1, args.cycles + 1):
        run = cycle
        # the pools the workers repeat and resume from: settled after the last check
        committed = [(key, k.fp, k.result) for key, k in chk.keys.items() if k.state == "committed"]
        if len(committed) > 5000:
            committed = rng.sample(committed, 5000)
        inflight = [(key, k.fp, k.token, k.owner) for key, k in chk.keys.items()
                    if k.state == "in_flight"]
        review = [(key, k.fp, k.note) for key, k in chk.keys.items() if k.state == "review"]
        stop = threading.Event()
        pool_lock = threading.Lock()
        started = threading.Semaphore(0)
        errors = []
        killing = threading.Event()
        nviol = len(chk.violations)  # this cycle's count from here: its threads' failures too
        ths = [threading.Thread(target=worker, args=(srv.sock, run, t, args.seed, log, stop, committed,
                                                     inflight, review, pool_lock, started,
                                                     args.fresh_per_thread, errors, killing),
                               daemon=True)
               for t in range(args.threads)]
        for th in ths:
            th.start()
        for _ in ths:
            started.acquire()
        # The kill comes once a reply of this cycle was acknowledged (a first flush under the
        # sanitizers on a loaded machine can take longer than the shortest delay), within 10 s.
        acked_before, wait_end = log.acked, time.monotonic() + 10
        while log.acked == acked_before and time.monotonic() < wait_end:
            time.sleep(0.005)
        delay = rng.uniform(0.05, 0.5)
        time.sleep(delay)
        chk.kill_at = time.monotonic()
        killing.set()
        rc = srv.kill(9)
        if rc != -signal.SIGKILL:  # it ended by itself: an abort, a sanitizer, a fatal exit
            chk.bad("idemd ended by itself before the kill (status %r)" % rc)
        stop.set()
        for th in ths:
            th.join(60)
            if th.is_alive():
                chk.bad("a client thread hangs after the kill")
        for e in errors:
            chk.bad("a client thread failed: %s" % e)
        # sometimes kill it again while it recovers
        rekill = ""
        if rng.random() < 0.2:
            d = rng.uniform(0.0, 0.03)
            srv.spawn(0)
            time.sleep(d)
            rc = srv.kill(9)
            if rc != -signal.SIGKILL:
                chk.bad("idemd ended by itself while it recovered (status %r)" % rc)
            rekill = ", killed again %d ms into a restart" % (d * 1000)
        t0 = time.monotonic()
        try:
            srv.start()
        except RuntimeError as e:
            print("cycle %d: idemd did not restart: %s" % (cycle, e), flush=True)
            failed += 1
            break
        recovery_ms = (time.monotonic() - t0) * 1000
        for line in log_problems(srv.log_path, seen_log):
            chk.bad("idemd's log: %s" % line)
        seen_log = os.path.getsize(srv.log_path)
        lost_note = ""
        events = log.new_lines()
        acks = sum(1 for e in events if not e.get("lost"))
        if acks == 0:
            chk.bad("no reply was acknowledged before the kill: the cycle checks nothing new")
        for e in events:
            chk.apply(e)
        chk.end_run()
        cl = srv.admin()
        try:
            full = cycle % args.full_every == 0 or cycle == args.cycles
            touched = {e["key"] for e in events}
            rest = [key for key in chk.keys if key not in touched]
            if not full and len(rest) > 1000:
                rest = rng.sample(rest, 1000)
            check = [key for key in touched if key in chk.keys] + rest
            chk.verify(cl, check, claim_again=True)
            chk.verify_audit(cl, check)
            st = cl.execute_command("IDEM.STATS")
            st = {st[i].decode(): st[i + 1] for i in range(0, len(st), 2)}
            if chk.lossy:
                lost_note = ", %d lost so far (oldest %.0f ms before its kill)" % (
                    chk.lost_acks, chk.lost_max_age * 1000)
            if st.get("fatal"):
                chk.bad("IDEM.STATS fatal=%r after restart" % st.get("fatal"))
        except LOST as e:
            chk.bad("idemd failed during the check: %r" % e)
        finally:
            cl.close()
        chk.forget_oldest(args.max_tracked)
        new_viol = chk.violations[nviol:]
        states = {}
        for k in chk.keys.values():
            states[k.state] = states.get(k.state, 0) + 1
        print("cycle %d: killed after %d ms%s, %d acks, restart %d ms, checked %d keys%s, %s: %s" %
              (cycle, delay * 1000, rekill, acks, recovery_ms, len(check), " (all)" if full else "",
               " ".join("%s=%d" % kv for kv in sorted(states.items())),
               "ok" if not new_viol else "%d VIOLATIONS" % len(new_viol)) + lost_note, flush=True)
        for v in new_viol[:20]:
            print("  VIOLATION " + v, flush=True)
        if new_viol:
            failed += 1
        else:
            passed += 1
            log.truncate_if_over(64 << 20)
    rc = srv.stop(keep=failed > 0)
    if rc not in (0, None):
        print("idemd exited %r on SIGTERM" % rc)
        failed += 1
    if failed:  # the acknowledgements and idemd's log, for whoever reads the failure
        print("kept %s (acks.jsonl, the store and idemd's log)" % srv.tmp)
    if chk.warnings:
        print("%d warnings (not failures: repeat counters may undercount after a crash, "
              "docs/design.md section 20), first: %s" % (len(chk.warnings), chk.warnings[0]))
    if chk.audit_gaps:
        print("rule 9 violated: %d unacknowledged resolves took effect (durable after the "
              "kill) without an audit entry, e.g. %s" %
              (len(chk.audit_gaps), chk.audit_gaps[0]))
    if chk.lossy:
        print("%d acknowledged changes lost in the %s window (allowed), the oldest %.1f ms before "
              "the kill (%s)" % (chk.lost_acks, args.durability, chk.lost_max_age * 1000,
                                 chk.lost_oldest))
    print("kill9: seed %s, %d cycles in %.1f s, %d keys tracked, %d tokens" %
          (args.seed, args.cycles, time.monotonic() - t_start, len(chk.keys), chk.ntokens))
    print("%d passed, %d failed" % (passed, failed))
    return 0 if failed == 0 and passed > 0 else 1


if __name__ == "__main__":
    sys.exit(main())
