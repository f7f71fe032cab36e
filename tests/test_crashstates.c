/*
 * test_crashstates.c: crash-state enumeration on the real I/O path (CrashMonkey/ALICE style).
 *
 * A small seeded workload (claims, commits with results, releases, holds, extends, recoveries,
 * mismatches, SET NX, operator resolves and deletes, a checkpoint, a forced compaction that
 * retires segments, clean reopens, and a phase in durability none with idem_sync) runs on a real
 * temporary directory through the recording backend (tests/support/io_trace.h) over io_uring or
 * the thread backend (IDEM_IO_BACKEND=thread). After every round the test reads back each key
 * it touched, so the model holds every state a key went through, in submission order, with the
 * trace positions at which it was submitted, answered and acknowledged (answered in sync mode;
 * once a later idem_sync returned in durability none).
 *
 * Then every persistence point of the trace (tests/support/crash_state.h) is a crash point: the
 * store is rebuilt in a fresh directory from the durable state plus (a) every prefix of the
 * unsynced changes, each also with its last write torn at a sector boundary, and prefixes of
 * the pending directory operations, and (b) random subsets of them (a kept write torn now and
 * then). Each crash state is opened with the real backend and checked:
 *   - it opens (a torn write may instead be reported as corruption: counted and printed);
 *   - the index is consistent (store_check_index);
 *   - the keys show the state after one prefix of the submitted changes that holds every change
 *     acknowledged before the crash: same first_seen, token, result, note, lease and version
 *     (I1, I3), nothing that was not submitted, and the same cut for every key (I5); a
 *     committed record past its expiry (at the recovered clock) is absent;
 *   - the audit trail holds exactly the operator calls of that cut (rule 9);
 *   - every CS_REOPEN_EVERY-th state, a clean close and reopen shows the same records (I5);
 *   - a fresh claim gets a token above every token handed out before the crash and every token
 *     in the recovered records (I6);
 *   - after the clock moves 30 days on, in_flight and review records are still there and
 *     committed ones have expired (I7).
 * The recovery bugs this suite found have deterministic regression tests at the end of the file.
 *
 * Crash-state directories live in IDEM_CRASHSTATES_DIR, else /dev/shm (fsync there is free),
 * else TMPDIR. Prints `crashstates: seed N (replay with IDEM_SEED=N)`, a line per seed and
 * `crashstates: N states`; the first violating state of a seed is kept and its path printed;
 * IDEM_CRASHSTATES_DUMP=1 prints the trace. IDEM_LONG=1 selects the long-tier count, which
 * tests/long/run.sh runs in chunks of the CI count (one process would outlive the timeout).
 */
#include <criterion/criterion.h>
#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>
#include <xxhash.h>

#include "crash_state.h"
#include "idem.h"
#include "io.h"
#include "io_trace.h"
#include "store.h"
#include "testutil.h"
#include "util.h"

#define CS_KEYS           40
#define CS_ROUND_OPS_MAX  6
#define CS_WALL_MS        INT64_C(1800000000000) /* the injected wall clock: results replay */
#define CS_DAY_MS         INT64_C(86400000)
#define CS_SHORT_TTL_MS   1500
#define CS_RESULT_MAX     3000
#define CS_REOPEN_EVERY   32   /* every Nth state is also closed cleanly and reopened */
#define CS_REPORT_MAX     8    /* violations printed in full per seed */
#define CS_AUDIT_MAX      1024 /* audit entries read back (the workload makes far fewer) */
#define CS_ROUNDS         30   /* rounds per workload phase */
#define CS_RANDOM_SUBSETS 3    /* random subsets tried per crash point */
#define CS_CI_SEEDS       10   /* also the chunk size of crashstates in tests/long/run.sh */
#define CS_LONG_SEEDS     1300 /* about 800-1,000 states each */

/* A key's record as read back (idem_get), reduced to what must survive a crash. */
struct snap {
    int found, state;
    int64_t first_seen, expires_at, lease_until, token;
    uint32_t attempts, result_len, note_len;
    uint64_t version, result_hash, note_hash;
};

/* A change of one key, in submission order, with trace positions (io_trace_now). */
struct mop {
    int key;
    int audited;         /* resolve or del: the audit trail has an entry for it */
    uint64_t submit_seq; /* just before the idem_submit that carried it */
    uint64_t seen_seq;   /* just after its completion was polled */
    uint64_t ack_seq;    /* acknowledged durable: seen_seq in sync mode, after idem_sync in none */
    int64_t token_out;   /* a token handed out by it (new, recover), else 0 */
    struct snap after;
};

struct model {
    struct mop *ops;
    size_t n, cap;
};

struct workload {
    uint64_t rng;
    struct io_trace *t;
    char *dir;
    idem_store *s;
    idem_queue *q;
    int durability;
    struct model m;
    struct snap cur[CS_KEYS];
    int has_fp[CS_KEYS], owner[CS_KEYS];
    char data[CS_ROUND_OPS_MAX][CS_RESULT_MAX + 64];
    char keys[CS_ROUND_OPS_MAX][16];
};

static int64_t cs_wall(void *ctx)
{
    (void)ctx;
    return CS_WALL_MS;
}

static const idem_clock_source cs_clock = {.wall_ms = cs_wall};

static idem_options cs_options(int durability)
{
    idem_options o;
    idem_options_init(&o);
    o.test_clock = 1;
    o.clock = &cs_clock;
    o.durability = durability;
    o.segment_bytes = 64 * 1024;
    o.result_bytes_max = 4096;
    return o;
}

static void key_name(int k, char *buf)
{
    snprintf(buf, 16, "k-%03d", k);
}

static struct snap snap_of(const idem_completion *c)
{
    struct snap s = {0};
    if (!c->found) return s;
    const idem_record *r = &c->record;
    s.found = 1;
    s.state = r->state;
    s.first_seen = r->first_seen_ms;
    s.expires_at = r->expires_at_ms;
    s.lease_until = r->state == IDEM_STATE_IN_FLIGHT ? r->lease_until_ms : 0;
    s.token = r->state == IDEM_STATE_IN_FLIGHT ? r->token : 0;
    s.attempts = r->attempts;
    s.version = r->version;
    s.result_len = r->result_len;
    s.result_hash = XXH3_64bits(r->result, r->result_len);
    s.note_len = r->note_len;
    s.note_hash = XXH3_64bits(r->note, r->note_len);
    return s;
}

static int snap_equal(const struct snap *a, const struct snap *b)
{
    if (a->found != b->found) return 0;
    if (!a->found) return 1;
    return a->state == b->state && a->first_seen == b->first_seen &&
           a->expires_at == b->expires_at && a->lease_until == b->lease_until &&
           a->token == b->token && a->attempts == b->attempts && a->version == b->version &&
           a->result_len == b->result_len && a->result_hash == b->result_hash &&
           a->note_len == b->note_len && a->note_hash == b->note_hash;
}

/* What a get answers for a key last left in state e (NULL: never written) at store time now. */
static int snap_live(const struct snap *e, int64_t now)
{
    return e && e->found && !(e->state == IDEM_STATE_COMMITTED && now >= e->expires_at);
}

static int snap_matches(const struct snap *e, const struct snap *got, int64_t now)
{
    if (!snap_live(e, now)) return !got->found;
    return snap_equal(e, got);
}

static void snap_print(char *buf, size_t cap, const struct snap *s)
{
    if (!s || !s->found) {
        snprintf(buf, cap, "absent");
        return;
    }
    snprintf(buf, cap, "state %d first_seen %lld expires %lld token %lld version %llu result %u",
             s->state, (long long)s->first_seen, (long long)s->expires_at, (long long)s->token,
             (unsigned long long)s->version, s->result_len);
}

/* ---- the workload ---- */

static uint64_t wl_rand(struct workload *w, uint64_t n)
{
    return tu_rand(&w->rng) % n;
}

static struct io *real_backend(void)
{
    const char *env = getenv("IDEM_IO_BACKEND");
    struct io *io = NULL;
    if (!(env && strcmp(env, "thread") == 0) && io_uring_create(256, &io) == 0) return io;
    cr_assert_eq(io_thread_create(&io), 0);
    return io;
}

static void wl_open(struct workload *w, int durability)
{
    idem_options o = cs_options(durability);
    struct io *io = io_trace_wrap(w->t, real_backend());
    cr_assert(io);
    cr_assert_eq(store_open_io(w->dir, &o, io, 0, &w->s), IDEM_OK, "workload open: %s",
                 idem_last_error());
    cr_assert_eq(idem_queue_open(w->s, 64, &w->q), IDEM_OK);
    w->durability = durability;
}

static void wl_close(struct workload *w)
{
    idem_queue_close(w->q);
    cr_assert_eq(idem_close(w->s), IDEM_OK);
    w->s = NULL;
}

/* Content for results and notes: text, so that long results compress (LZ4). */
static uint32_t wl_text(struct workload *w, char *buf, uint32_t len)
{
    static const char words[] = "invoice paid refund order shipped ledger entry account ";
    for (uint32_t i = 0; i < len; i++)
        buf[i] = i % 97 == 0 ? (char)('a' + wl_rand(w, 26)) : words[i % (sizeof words - 1)];
    return len;
}

static void wl_claim(struct workload *w, int k, idem_op *op, int slot)
{
    op->kind = IDEM_OP_CLAIM;
    op->ttl_ms = wl_rand(w, 4) == 0 ? CS_SHORT_TTL_MS : (uint64_t)CS_DAY_MS;
    op->lease_ms = wl_rand(w, 3) == 0 ? 1000 : 60000;
    if (w->has_fp[k]) {
        /* The same content for a key's life, or once in a while other content (mismatch). */
        snprintf(w->data[slot], 32, "body-%d%s", k, wl_rand(w, 8) == 0 ? "-other" : "");
        op->fp = w->data[slot];
        op->fp_len = (uint32_t)strlen(w->data[slot]);
    }
    if (w->owner[k] || wl_rand(w, 3) == 0) {
        op->owner = "worker-7";
        op->owner_len = 8;
    }
}

static void wl_owner_call(struct workload *w, int k, idem_op *op, int slot)
{
    uint64_t r = wl_rand(w, 100);
    op->token = w->cur[k].token;
    if (r < 45) {
        op->kind = IDEM_OP_COMMIT;
        uint64_t size = wl_rand(w, 20);
        uint32_t len = size == 0  ? 1500 + (uint32_t)wl_rand(w, 1500)
                       : size < 6 ? 100 + (uint32_t)wl_rand(w, 500)
                                  : 8 + (uint32_t)wl_rand(w, 56);
        op->data = w->data[slot];
        op->data_len = wl_text(w, w->data[slot], len);
    } else if (r < 55) {
        op->kind = IDEM_OP_RELEASE;
    } else if (r < 65) {
        op->kind = IDEM_OP_HOLD;
        op->data = w->data[slot];
        op->data_len = wl_text(w, w->data[slot], 12 + (uint32_t)wl_rand(w, 40));
    } else if (r < 75) {
        op->kind = IDEM_OP_EXTEND;
        op->lease_ms = 30000;
    } else if (r < 90) {
        wl_claim(w, k, op, slot); /* busy, owner resume, or recover once the lease ran out */
    } else {
        op->kind = IDEM_OP_RESOLVE;
        op->action = IDEM_RESOLVE_COMMIT;
        op->flags = IDEM_F_FORCE;
        op->actor = "operator";
        op->data = "checked the target";
        op->data_len = 18;
        op->result = "found-by-hand";
        op->result_len = 13;
    }
}

/* Picks an operation for key k from its last known state; 0 to leave it alone this round. */
static int wl_choose(struct workload *w, int k, idem_op *op, int slot, int64_t now)
{
    memset(op, 0, sizeof *op);
    key_name(k, w->keys[slot]);
    op->key = w->keys[slot];
    op->key_len = (uint32_t)strlen(w->keys[slot]);
    op->user_data = (uint64_t)slot;
    const struct snap *c = &w->cur[k];
    if (!snap_live(c, now)) {
        if (wl_rand(w, 8) == 0) {
            op->kind = IDEM_OP_SET_IF_ABSENT;
            op->ttl_ms = wl_rand(w, 2) ? CS_SHORT_TTL_MS : (uint64_t)CS_DAY_MS;
            op->data = w->data[slot];
            op->data_len = wl_text(w, w->data[slot], 16);
            w->has_fp[k] = 0;
            return 1;
        }
        w->has_fp[k] = wl_rand(w, 2) == 0;
        w->owner[k] = 0;
        wl_claim(w, k, op, slot);
        w->owner[k] = op->owner != NULL;
        return 1;
    }
    if (c->state == IDEM_STATE_IN_FLIGHT) {
        wl_owner_call(w, k, op, slot);
        return 1;
    }
    if (c->state == IDEM_STATE_REVIEW) {
        op->kind = IDEM_OP_RESOLVE;
        op->action = 1 + (uint32_t)wl_rand(w, 3);
        op->actor = "operator";
        op->data = "decided";
        op->data_len = 7;
        return 1;
    }
    uint64_t r = wl_rand(w, 10);
    if (r < 5) wl_claim(w, k, op, slot); /* done, or mismatch with other content */
    if (r == 5) {
        op->kind = IDEM_OP_DEL;
        op->actor = "operator";
    }
    return r <= 5;
}

static void wl_record(struct workload *w, int k, const idem_op *op, const idem_completion *c,
                      uint64_t submit_seq, uint64_t seen_seq)
{
    cr_assert(c->err != IDEM_EFATAL && c->err != IDEM_ECORRUPT, "workload: %s on %s",
              idem_strerror(c->err), w->keys[op->user_data]);
    idem_completion g;
    cr_assert_eq(idem_get(w->q, op->key, op->key_len, &g), IDEM_OK);
    struct snap after = snap_of(&g);
    if (snap_equal(&after, &w->cur[k])) return; /* no change was logged */
    struct model *m = &w->m;
    if (m->n == m->cap) {
        m->cap = m->cap ? m->cap * 2 : 256;
        m->ops = realloc(m->ops, m->cap * sizeof *m->ops);
        cr_assert(m->ops);
    }
    struct mop *o = &m->ops[m->n++];
    *o = (struct mop){.key = k,
                      .audited = op->kind == IDEM_OP_RESOLVE || op->kind == IDEM_OP_DEL,
                      .submit_seq = submit_seq,
                      .seen_seq = seen_seq,
                      .ack_seq = w->durability == IDEM_DURABILITY_SYNC ? seen_seq : UINT64_MAX,
                      .after = after};
    int handed =
        op->kind == IDEM_OP_CLAIM && (c->outcome == IDEM_NEW || c->outcome == IDEM_RECOVER);
    if (c->err == IDEM_OK && handed) {
        cr_assert_eq(after.token, c->token, "the record holds another token than the answer");
        o->token_out = c->token;
    }
    w->cur[k] = after;
}

/* One round: up to CS_ROUND_OPS_MAX operations on distinct keys in one submit. */
static void wl_round(struct workload *w)
{
    idem_op ops[CS_ROUND_OPS_MAX];
    int keys[CS_ROUND_OPS_MAX], n = 0;
    int want = 1 + (int)wl_rand(w, CS_ROUND_OPS_MAX);
    int64_t now = idem_clock_now(w->s);
    for (int i = 0; i < want; i++) {
        int k = (int)wl_rand(w, CS_KEYS), dup = 0;
        for (int j = 0; j < n; j++)
            dup |= keys[j] == k;
        if (!dup && wl_choose(w, k, &ops[n], n, now)) keys[n++] = k;
    }
    if (n == 0) return;
    uint64_t submit_seq = io_trace_now(w->t);
    cr_assert_eq(idem_submit(w->q, ops, (size_t)n), n);
    idem_completion done[CS_ROUND_OPS_MAX];
    uint64_t seen[CS_ROUND_OPS_MAX];
    for (int got = 0; got < n;) {
        idem_completion c[CS_ROUND_OPS_MAX];
        int r = idem_poll(w->q, c, CS_ROUND_OPS_MAX, -1);
        cr_assert_gt(r, 0);
        uint64_t seq = io_trace_now(w->t);
        for (int j = 0; j < r; j++, got++) {
            done[c[j].user_data] = c[j];
            seen[c[j].user_data] = seq;
        }
    }
    for (int i = 0; i < n; i++)
        wl_record(w, keys[i], &ops[i], &done[i], submit_seq, seen[i]);
    uint64_t step = wl_rand(w, 10);
    cr_assert_eq(idem_clock_advance(w->s, step == 0 ? 2500 : (int64_t)wl_rand(w, 200)), IDEM_OK);
}

/* Durability none: everything submitted so far is acknowledged once idem_sync returns. */
static void wl_sync(struct workload *w)
{
    cr_assert_eq(idem_sync(w->s), IDEM_OK);
    uint64_t seq = io_trace_now(w->t);
    for (size_t i = 0; i < w->m.n; i++)
        if (w->m.ops[i].ack_seq == UINT64_MAX) w->m.ops[i].ack_seq = seq;
}

static void wl_rounds(struct workload *w, int n)
{
    for (int i = 0; i < n; i++) {
        wl_round(w);
        if (w->durability != IDEM_DURABILITY_NONE) continue;
        /* Batches are written every 10 ms without a flush: let a few pile up unsynced. */
        usleep(4000);
        if (wl_rand(w, 10) == 0) wl_sync(w);
    }
}

static void wl_run(struct workload *w, int rounds)
{
    wl_open(w, IDEM_DURABILITY_SYNC);
    wl_rounds(w, rounds);
    cr_assert_eq(idem_checkpoint(w->s), IDEM_OK);
    wl_rounds(w, rounds);
    /* Short-lived keys expire; every sealed segment is walked, copied forward and retired. */
    cr_assert_eq(idem_clock_advance(w->s, 5000), IDEM_OK);
    int rc = idem_compact(w->s, 20000);
    cr_assert(rc == IDEM_OK || rc == IDEM_EBUSY, "compact: %s", idem_strerror(rc));
    wl_rounds(w, rounds / 2);
    wl_close(w);
    wl_open(w, IDEM_DURABILITY_SYNC);
    wl_rounds(w, rounds);
    wl_close(w);
    wl_open(w, IDEM_DURABILITY_NONE);
    wl_rounds(w, rounds);
    wl_sync(w);
    wl_close(w);
    cr_assert_eq(io_trace_buffer_changes(w->t), 0, "a write buffer changed while in flight");
}

/* ---- checking one crash state ---- */

struct checker {
    const struct model *m;
    uint64_t seed;
    uint64_t x; /* the crash point: the trace seq of the event about to take effect */
    const char *dir;
    char desc[256];
    uint64_t states, refused, reopened, violations;
    int keep_state, kept;
    int64_t now;
    struct snap got[CS_KEYS];
    uint64_t audit_n;
    uint64_t audit_after[CS_AUDIT_MAX]; /* version_after of the recovered entries, oldest first */
};

static void violation(struct checker *c, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));

static void violation(struct checker *c, const char *fmt, ...)
{
    c->violations++;
    if (c->violations > CS_REPORT_MAX) return;
    char msg[1024];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    fprintf(stderr, "crashstates: VIOLATION seed %llu point %llu (%s): %s\n",
            (unsigned long long)c->seed, (unsigned long long)c->x, c->desc, msg);
    c->keep_state = 1;
}

/* Keeps the first violating state of a seed for a person to open (idemctl verify, status). */
static void keep_state(struct checker *c)
{
    if (!c->keep_state || c->kept) return;
    c->keep_state = 0;
    char keep[700];
    snprintf(keep, sizeof keep, "%s-violation", c->dir);
    if (rename(c->dir, keep) == 0) {
        fprintf(stderr, "crashstates: state kept in %s\n", keep);
        c->kept = 1;
    }
}

/* Reads every key of the model, in one submit (the queue holds CS_KEYS operations). */
static void read_keys(idem_queue *q, struct snap *out)
{
    char keys[CS_KEYS][16];
    idem_op ops[CS_KEYS];
    for (int k = 0; k < CS_KEYS; k++) {
        key_name(k, keys[k]);
        ops[k] = (idem_op){.kind = IDEM_OP_GET,
                           .key = keys[k],
                           .key_len = (uint32_t)strlen(keys[k]),
                           .user_data = (uint64_t)k};
    }
    cr_assert_eq(idem_submit(q, ops, CS_KEYS), CS_KEYS);
    for (int got = 0; got < CS_KEYS;) {
        idem_completion c[CS_KEYS];
        int n = idem_poll(q, c, CS_KEYS, -1);
        cr_assert_gt(n, 0);
        for (int i = 0; i < n; i++, got++) {
            cr_assert_eq(c[i].err, IDEM_OK, "get: %s", idem_strerror(c[i].err));
            out[c[i].user_data] = snap_of(&c[i]);
        }
    }
}

static void read_audit(struct checker *c, idem_queue *q)
{
    const idem_audit_entry *e;
    size_t n;
    cr_assert_eq(idem_audit(q, NULL, 0, CS_AUDIT_MAX, &e, &n), IDEM_OK);
    cr_assert_lt(n, CS_AUDIT_MAX, "more audit entries than this test reads");
    c->audit_n = n;
    for (size_t i = 0; i < n; i++)
        c->audit_after[n - 1 - i] = e[i].version_after;
}

/* Whether the recovered keys and audit trail are the state after model ops [0, g]. */
static int cut_holds(const struct checker *c, const int64_t *last_of_key, int64_t g)
{
    for (int k = 0; k < CS_KEYS; k++) {
        const struct snap *e = last_of_key[k] >= 0 ? &c->m->ops[last_of_key[k]].after : NULL;
        if (!snap_matches(e, &c->got[k], c->now)) return 0;
    }
    uint64_t n = 0;
    for (int64_t i = 0; i <= g; i++) {
        const struct mop *o = &c->m->ops[i];
        if (!o->audited) continue;
        uint64_t after = o->after.found ? o->after.version : 0;
        if (n >= c->audit_n || c->audit_after[n] != after) return 0;
        n++;
    }
    return n == c->audit_n;
}

/* Explains a failed cut: the first key whose record matches none of its possible states. */
static void cut_explain(struct checker *c, int64_t acked, int64_t submitted)
{
    for (int k = 0; k < CS_KEYS; k++) {
        int64_t lo = -1;
        for (int64_t i = 0; i <= acked; i++)
            if (c->m->ops[i].key == k) lo = i;
        int any = lo < 0 && snap_matches(NULL, &c->got[k], c->now);
        for (int64_t i = lo < 0 ? 0 : lo; i <= submitted; i++)
            any |= c->m->ops[i].key == k && snap_matches(&c->m->ops[i].after, &c->got[k], c->now);
        if (any) continue;
        char want[256], got[256];
        snap_print(want, sizeof want, lo >= 0 ? &c->m->ops[lo].after : NULL);
        snap_print(got, sizeof got, &c->got[k]);
        violation(c, "I1/I3: key k-%03d: acknowledged %s (op %lld), recovered %s (now %lld)", k,
                  want, (long long)lo, got, (long long)c->now);
        return;
    }
    violation(c,
              "I5: no single prefix of the submitted changes (ops %lld..%lld) explains the "
              "recovered keys and audit trail (%llu entries)",
              (long long)acked, (long long)submitted, (unsigned long long)c->audit_n);
}

/* The recovered state must be the state after a prefix [0, g] with acked <= g <= submitted. */
static void check_cut(struct checker *c)
{
    int64_t acked = -1, submitted = -1;
    for (size_t i = 0; i < c->m->n; i++) {
        if (c->m->ops[i].ack_seq <= c->x) acked = (int64_t)i;
        if (c->m->ops[i].submit_seq <= c->x) submitted = (int64_t)i;
    }
    int64_t last_of_key[CS_KEYS];
    for (int k = 0; k < CS_KEYS; k++)
        last_of_key[k] = -1;
    for (int64_t i = 0; i <= acked; i++)
        last_of_key[c->m->ops[i].key] = i;
    for (int64_t g = acked; g <= submitted; g++) {
        if (g > acked) last_of_key[c->m->ops[g].key] = g;
        if (cut_holds(c, last_of_key, g)) return;
    }
    cut_explain(c, acked, submitted);
}

/* I6: a fresh claim gets a token above every token handed out before the crash. */
static void check_tokens(struct checker *c, idem_queue *q)
{
    int64_t max = 0;
    for (size_t i = 0; i < c->m->n; i++)
        if (c->m->ops[i].seen_seq <= c->x && c->m->ops[i].token_out > max)
            max = c->m->ops[i].token_out;
    for (int k = 0; k < CS_KEYS; k++)
        if (c->got[k].token > max) max = c->got[k].token;
    idem_claim_args a = {.ttl_ms = 1000, .lease_ms = 1000};
    idem_completion r;
    int rc = idem_claim(q, "probe", 5, &a, &r);
    if (rc != IDEM_OK || r.outcome != IDEM_NEW) {
        violation(c, "fresh claim after recovery: %s, outcome %d", idem_strerror(rc), r.outcome);
        return;
    }
    if (r.token <= max)
        violation(c, "I6: fresh token %lld not above %lld", (long long)r.token, (long long)max);
}

/* I7: 30 days on, in_flight and review records are still there; committed ones expired. */
static void check_expiry(struct checker *c, idem_store *s, idem_queue *q)
{
    cr_assert_eq(idem_clock_advance(s, 30 * CS_DAY_MS), IDEM_OK);
    struct snap later[CS_KEYS];
    read_keys(q, later);
    for (int k = 0; k < CS_KEYS; k++) {
        const struct snap *g = &c->got[k];
        int open = g->found && g->state != IDEM_STATE_COMMITTED;
        if (open && !snap_equal(g, &later[k]))
            violation(c, "I7: key k-%03d (state %d) changed or expired 30 days on", k, g->state);
        if (!open && later[k].found)
            violation(c, "key k-%03d is still there 30 days after its expiry", k);
    }
}

/* I5: a clean close and reopen shows the same records and audit trail. */
static void check_reopen(struct checker *c, idem_store **s, idem_queue **q)
{
    idem_queue_close(*q);
    cr_assert_eq(idem_close(*s), IDEM_OK);
    idem_options o = cs_options(IDEM_DURABILITY_SYNC);
    int rc = idem_open(c->dir, &o, s);
    cr_assert_eq(rc, IDEM_OK, "reopen after a clean close: %s", idem_last_error());
    cr_assert_eq(idem_queue_open(*s, CS_KEYS, q), IDEM_OK);
    struct snap again[CS_KEYS];
    read_keys(*q, again);
    for (int k = 0; k < CS_KEYS; k++)
        if (!snap_equal(&again[k], &c->got[k]))
            violation(c, "I5: key k-%03d differs after a clean close and reopen", k);
    uint64_t n = c->audit_n;
    read_audit(c, *q);
    if (c->audit_n != n) violation(c, "I5: audit trail changed across a clean reopen");
    if (store_check_index(*s, NULL) != IDEM_OK) violation(c, "index inconsistent after reopen");
    c->reopened++;
}

static void check_state(struct checker *c, int torn)
{
    idem_options o = cs_options(IDEM_DURABILITY_SYNC);
    idem_store *s;
    int rc = idem_open(c->dir, &o, &s);
    c->states++;
    if (rc == IDEM_ECORRUPT && torn) {
        c->refused++;
        fprintf(stderr,
                "crashstates: seed %llu point %llu (%s): torn write reported as "
                "corruption: %s\n",
                (unsigned long long)c->seed, (unsigned long long)c->x, c->desc, idem_last_error());
        return;
    }
    if (rc != IDEM_OK) {
        violation(c, "open failed: %s (%s)", idem_strerror(rc), idem_last_error());
        return;
    }
    idem_queue *q;
    cr_assert_eq(idem_queue_open(s, CS_KEYS, &q), IDEM_OK);
    c->now = idem_clock_now(s);
    read_keys(q, c->got);
    read_audit(c, q);
    if (store_check_index(s, NULL) != IDEM_OK) violation(c, "index inconsistent");
    check_cut(c);
    if (c->states % CS_REOPEN_EVERY == 0) check_reopen(c, &s, &q);
    check_tokens(c, q);
    check_expiry(c, s, q);
    idem_queue_close(q);
    store_abandon(s);
}

/* ---- enumerating the crash states of one point ---- */

struct point {
    struct checker *c;
    struct cs_walk *w;
    size_t n, dirs;
    uint8_t keep[256];
    uint64_t seen[512];
    size_t nseen;
    uint64_t rng;
};

/* Builds and checks one selection unless this point checked it already. */
static void try_state(struct point *p, size_t dir_ops, int64_t torn, uint64_t torn_bytes)
{
    uint64_t tail[3] = {dir_ops, (uint64_t)torn, torn_bytes};
    uint64_t id = XXH3_64bits_withSeed(tail, sizeof tail, XXH3_64bits(p->keep, p->n));
    for (size_t i = 0; i < p->nseen; i++)
        if (p->seen[i] == id) return;
    if (p->nseen < IDEM_ARRAY_LEN(p->seen)) p->seen[p->nseen++] = id;
    struct cs_select sel = {
        .keep = p->keep, .dir_ops = dir_ops, .torn = torn, .torn_bytes = torn_bytes};
    char *d = p->c->desc;
    int len = snprintf(d, sizeof p->c->desc, "unsynced %zu keep ", p->n);
    for (size_t i = 0; i < p->n && len < 200; i++)
        len += snprintf(d + len, sizeof p->c->desc - (size_t)len, "%d", p->keep[i]);
    snprintf(d + len, sizeof p->c->desc - (size_t)len, " dir_ops %zu/%zu torn %lld@%llu", dir_ops,
             p->dirs, (long long)torn, (unsigned long long)torn_bytes);
    cr_assert_eq(cs_walk_build(p->w, &sel, p->c->dir), 0, "building %s", p->c->dir);
    check_state(p->c, torn >= 0);
    keep_state(p->c);
}

/* A sector boundary strictly inside unsynced write i, or 0 if it has fewer than two sectors. */
static uint64_t tear_at(struct point *p, size_t i)
{
    uint64_t len;
    if (!cs_walk_is_write(p->w, i, &len) || len < 1024) return 0;
    return 512 * (1 + tu_rand(&p->rng) % ((len - 1) / 512));
}

/* (a) prefixes of the unsynced changes (each also with its last write torn) and of the pending
 * directory operations; (b) random subsets, a kept write torn now and then. */
static void enumerate_point(struct point *p, int random_subsets)
{
    for (size_t k = 0; k <= p->n; k++) {
        memset(p->keep, 0, p->n);
        memset(p->keep, 1, k);
        try_state(p, 0, -1, 0);
        uint64_t at = k > 0 ? tear_at(p, k - 1) : 0;
        if (at) try_state(p, 0, (int64_t)k - 1, at);
    }
    for (size_t d = 1; d <= p->dirs; d++) {
        memset(p->keep, 1, p->n);
        try_state(p, d, -1, 0);
    }
    for (int r = 0; r < random_subsets && (p->n > 1 || p->dirs > 0); r++) {
        for (size_t i = 0; i < p->n; i++)
            p->keep[i] = tu_rand(&p->rng) & 1;
        size_t d = p->dirs ? tu_rand(&p->rng) % (p->dirs + 1) : 0;
        int64_t torn = -1;
        uint64_t at = 0;
        if (p->n && tu_rand(&p->rng) % 3 == 0) {
            size_t i = tu_rand(&p->rng) % p->n;
            at = p->keep[i] ? tear_at(p, i) : 0;
            torn = at ? (int64_t)i : -1;
        }
        try_state(p, d, torn, at);
    }
}

static const char *states_root(void)
{
    const char *env = getenv("IDEM_CRASHSTATES_DIR");
    if (env && *env) return env;
    struct stat st;
    if (stat("/dev/shm", &st) == 0 && S_ISDIR(st.st_mode) && access("/dev/shm", W_OK) == 0)
        return "/dev/shm";
    env = getenv("TMPDIR");
    return env && *env ? env : "/tmp";
}

/* IDEM_CRASHSTATES_DUMP=1: the trace, one event a line, for reading a failure. */
static void trace_dump(const struct io_trace *t)
{
    const char *env = getenv("IDEM_CRASHSTATES_DUMP");
    if (!env || *env != '1') return;
    const struct io_trace_event *ev = io_trace_events(t);
    for (size_t i = 0; i < io_trace_count(t); i++)
        fprintf(
            stderr, "trace %llu kind %d node %u off %llu len %llu ref %llu res %lld flags %u %s\n",
            (unsigned long long)ev[i].seq, ev[i].kind, ev[i].node, (unsigned long long)ev[i].off,
            (unsigned long long)ev[i].len, (unsigned long long)ev[i].ref, (long long)ev[i].res,
            ev[i].flags, ev[i].path ? ev[i].path : "");
}

/* A workload's directory: root/store on the real disk (TMPDIR), and where its crash states are
 * rebuilt. */
struct run_dirs {
    char *root;
    char store[600];
    char state[600];
};

static void run_dirs_make(struct run_dirs *d, uint64_t tag, int make_store)
{
    d->root = tu_mkdtemp("crashstates");
    cr_assert(d->root);
    snprintf(d->store, sizeof d->store, "%s/store", d->root);
    /* Made (and, being old, durable) like an operator's directory. */
    if (make_store) cr_assert_eq(mkdir(d->store, 0700), 0);
    snprintf(d->state, sizeof d->state, "%s/idem-crashstate-%d-%llu", states_root(), (int)getpid(),
             (unsigned long long)tag);
}

static void run_dirs_free(struct run_dirs *d)
{
    tu_rmtree(strdup(d->state));
    tu_rmtree(d->root);
}

/* One seed: the workload on a real directory, then every crash state of its trace. */
static void run_seed(uint64_t seed, int rounds, int random_subsets, struct checker *total)
{
    struct workload *w = calloc(1, sizeof *w);
    cr_assert(w);
    w->rng = seed;
    struct run_dirs d;
    run_dirs_make(&d, seed, 1);
    w->dir = d.store;
    cr_assert_eq(io_trace_create(&w->t), 0);
    wl_run(w, rounds);
    trace_dump(w->t);

    struct checker c = {.m = &w->m, .seed = seed, .dir = d.state};
    struct cs_walk *walk;
    cr_assert_eq(cs_walk_create(io_trace_events(w->t), io_trace_count(w->t), d.store, &walk), 0);
    struct point *p = calloc(1, sizeof *p);
    cr_assert(p);
    p->c = &c;
    p->w = walk;
    p->rng = seed ^ 0x5eed;
    uint64_t points = 0, most = 0;
    while (cs_walk_next(walk, &c.x)) {
        p->n = cs_walk_unsynced(walk);
        cr_assert_leq(p->n, sizeof p->keep, "too many unsynced changes for this test");
        p->dirs = cs_walk_dir_ops(walk);
        p->nseen = 0;
        if (p->n > most) most = p->n;
        enumerate_point(p, random_subsets);
        points++;
    }
    cs_walk_destroy(walk);
    free(p);
    total->states += c.states;
    total->refused += c.refused;
    total->reopened += c.reopened;
    total->violations += c.violations;
    fprintf(stderr,
            "crashstates: seed %llu: %zu events, %zu changes, %llu points, %llu states (at most "
            "%llu unsynced changes at a point)\n",
            (unsigned long long)seed, io_trace_count(w->t), w->m.n, (unsigned long long)points,
            (unsigned long long)c.states, (unsigned long long)most);
    io_trace_destroy(w->t);
    free(w->m.ops);
    free(w);
    run_dirs_free(&d);
}

/* 114-142 s under ASan: the timeout leaves room for a machine nearly four times slower, below
 * ctest's 600 s for the binary. */
Test(crashstates, every_crash_state_of_a_small_workload_recovers, .timeout = 560)
{
    uint64_t base = tu_seed("crashstates");
    uint64_t seeds = tu_count(CS_CI_SEEDS, CS_LONG_SEEDS);
    struct checker total = {0};
    time_t t0 = time(NULL);
    for (uint64_t i = 0; i < seeds; i++)
        run_seed(base + i, CS_ROUNDS, CS_RANDOM_SUBSETS, &total);
    fprintf(stderr, "crashstates: %llu states\n", (unsigned long long)total.states);
    fprintf(stderr,
            "crashstates: %llu seeds from %llu, %llu states, %llu of them also reopened cleanly, "
            "%llu torn writes reported as corruption, %llu violations, %llds\n",
            (unsigned long long)seeds, (unsigned long long)base, (unsigned long long)total.states,
            (unsigned long long)total.reopened, (unsigned long long)total.refused,
            (unsigned long long)total.violations, (long long)(time(NULL) - t0));
    cr_assert_eq(total.violations, 0, "crashstates: %llu violations (seed %llu)",
                 (unsigned long long)total.violations, (unsigned long long)base);
}

/* ---- regression tests of the recovery bugs this suite found (fixed in aeea059) ---- */

struct every_state {
    struct cs_walk *w;
    const char *dir;
    uint64_t states, refused;
    uint8_t keep[16];
    size_t n;
};

/* Builds and opens one state; counts and prints (the first three) refusals. */
static void open_one(struct every_state *e, size_t dir_ops, int64_t torn, uint64_t torn_bytes,
                     uint64_t x)
{
    struct cs_select sel = {
        .keep = e->keep, .dir_ops = dir_ops, .torn = torn, .torn_bytes = torn_bytes};
    cr_assert_eq(cs_walk_build(e->w, &sel, e->dir), 0);
    idem_options o = cs_options(IDEM_DURABILITY_SYNC);
    idem_store *s;
    int rc = idem_open(e->dir, &o, &s);
    e->states++;
    if (rc == IDEM_OK) {
        store_abandon(s);
        return;
    }
    if (e->refused++ < 3) {
        char keep[20] = "";
        for (size_t i = 0; i < e->n; i++)
            keep[i] = (char)('0' + e->keep[i]);
        fprintf(stderr, "crashstates: point %llu keep %s dir_ops %zu torn %lld@%llu: %s (%s)\n",
                (unsigned long long)x, keep, dir_ops, (long long)torn,
                (unsigned long long)torn_bytes, idem_strerror(rc), idem_last_error());
    }
}

/* Opens every crash state of the points after trace position from: every subset of the
 * unsynced changes (up to 10 of them; prefixes beyond), each prefix of the pending directory
 * operations, and every prefix of the unsynced changes with its last write torn at each sector
 * boundary. Returns the number of states that failed to open. */
static uint64_t open_every_state(struct io_trace *t, const struct run_dirs *d, uint64_t from)
{
    struct every_state e = {.dir = d->state};
    cr_assert_eq(cs_walk_create(io_trace_events(t), io_trace_count(t), d->store, &e.w), 0);
    uint64_t x;
    while (cs_walk_next(e.w, &x)) {
        if (x <= from) continue;
        e.n = cs_walk_unsynced(e.w);
        cr_assert_leq(e.n, sizeof e.keep);
        size_t dirs = cs_walk_dir_ops(e.w);
        uint64_t masks = e.n <= 10 ? UINT64_C(1) << e.n : e.n + 1;
        for (uint64_t m = 0; m < masks; m++) {
            for (size_t i = 0; i < e.n; i++)
                e.keep[i] = e.n <= 10 ? (m >> i) & 1 : i < m;
            for (size_t k = 0; k <= dirs; k++)
                open_one(&e, k, -1, 0, x);
        }
        for (size_t i = 0; i < e.n; i++) {
            uint64_t len;
            if (!cs_walk_is_write(e.w, i, &len)) continue;
            for (size_t j = 0; j < e.n; j++)
                e.keep[j] = j <= i;
            for (uint64_t at = 512; at < len && at <= 16 * 512; at += 512)
                open_one(&e, 0, (int64_t)i, at, x);
        }
    }
    cs_walk_destroy(e.w);
    fprintf(stderr, "crashstates: %llu states opened, %llu refused\n", (unsigned long long)e.states,
            (unsigned long long)e.refused);
    return e.refused;
}

/* The directories and trace of one regression test. */
static struct io_trace *regress_begin(struct run_dirs *d, uint64_t tag, int make_store)
{
    run_dirs_make(d, tag, make_store);
    struct io_trace *t;
    cr_assert_eq(io_trace_create(&t), 0);
    return t;
}

static void regress_end(struct run_dirs *d, struct io_trace *t)
{
    io_trace_destroy(t);
    run_dirs_free(d);
}

/* A workload of the regression tests: a store over the recording backend in dir. */
static idem_store *traced_open(struct io_trace *t, const char *dir, int durability)
{
    idem_options o = cs_options(durability);
    idem_store *s;
    cr_assert_eq(store_open_io(dir, &o, io_trace_wrap(t, real_backend()), 0, &s), IDEM_OK, "%s",
                 idem_last_error());
    return s;
}

static void claim_commit(idem_store *s, const char *key)
{
    idem_queue *q;
    cr_assert_eq(idem_queue_open(s, 4, &q), IDEM_OK);
    idem_claim_args a = {.ttl_ms = (uint64_t)CS_DAY_MS, .lease_ms = 60000};
    idem_completion c;
    cr_assert_eq(idem_claim(q, key, strlen(key), &a, &c), IDEM_OK);
    cr_assert_eq(c.outcome, IDEM_NEW);
    cr_assert_eq(idem_commit(q, key, strlen(key), c.token, "done", 4), IDEM_OK);
    idem_queue_close(q);
}

/* The first open of a new store created the file super, then wrote and flushed its two copies,
 * then synced the directory. A power loss after the name reached the disk and before the data
 * did left an empty super, and every later open failed ("both superblock copies fail their
 * checksum"), although the store never acknowledged anything. */
Test(crashstates, superblock_created_before_its_data_still_opens, .timeout = 120)
{
    struct run_dirs d;
    struct io_trace *t = regress_begin(&d, 1, 1);
    idem_store *s = traced_open(t, d.store, IDEM_DURABILITY_SYNC);
    cr_assert_eq(idem_close(s), IDEM_OK);
    cr_assert_eq(open_every_state(t, &d, 0), 0, "a crash state of a store's creation did not open");
    regress_end(&d, t);
}

/* Recovery numbers the next batch at least two above the last complete one (so a dropped
 * batch's number is never reused), also after a clean shutdown. The first batch after any open
 * is therefore last + 2; when a power loss tore it (or kept the first of its chunks only), the
 * next open found a valid frame of batch last + 2 beyond the end of the log and reported
 * corruption (scan_beyond allowed only last + 1) instead of a torn tail. */
Test(crashstates, first_batch_after_reopen_torn_by_power_loss_is_a_torn_tail, .timeout = 120)
{
    struct run_dirs d;
    struct io_trace *t = regress_begin(&d, 2, 1);
    idem_store *s = traced_open(t, d.store, IDEM_DURABILITY_SYNC);
    claim_commit(s, "before");
    cr_assert_eq(idem_close(s), IDEM_OK);
    uint64_t from = io_trace_now(t);
    s = traced_open(t, d.store, IDEM_DURABILITY_SYNC);
    /* One batch of two frames spanning several sectors: a small claim, then a large value. */
    static char value[3000];
    uint64_t rng = 2;
    for (size_t i = 0; i < sizeof value; i++)
        value[i] = (char)tu_rand(&rng);
    idem_op ops[2] = {
        {.kind = IDEM_OP_CLAIM, .key = "after", .key_len = 5, .ttl_ms = 60000, .lease_ms = 60000},
        {.kind = IDEM_OP_SET_IF_ABSENT,
         .key = "large",
         .key_len = 5,
         .ttl_ms = 60000,
         .data = value,
         .data_len = sizeof value,
         .user_data = 1}};
    idem_queue *q;
    cr_assert_eq(idem_queue_open(s, 4, &q), IDEM_OK);
    cr_assert_eq(idem_submit(q, ops, 2), 2);
    idem_completion c[2];
    for (int got = 0; got < 2;)
        got += idem_poll(q, c + got, 2, -1);
    idem_queue_close(q);
    cr_assert_eq(idem_close(s), IDEM_OK);
    cr_assert_eq(open_every_state(t, &d, from), 0,
                 "a torn first batch after a reopen did not open");
    regress_end(&d, t);
}

/* In durability none, batches are written every 10 ms without a flush, so a power loss may leave
 * a later batch on disk and an earlier one not. Recovery stopped at the gap, then called the
 * later batch's valid frames corruption (batch > last complete + 1), and the store did not
 * open. Durability none may lose those changes, but the store must open. */
Test(crashstates, durability_none_later_batch_on_disk_before_an_earlier_one_opens, .timeout = 120)
{
    struct run_dirs d;
    struct io_trace *t = regress_begin(&d, 3, 1);
    idem_store *s = traced_open(t, d.store, IDEM_DURABILITY_NONE);
    uint64_t from = io_trace_now(t);
    for (int i = 0; i < 4; i++) {
        char key[16];
        key_name(i, key);
        idem_queue *q;
        cr_assert_eq(idem_queue_open(s, 4, &q), IDEM_OK);
        idem_claim_args a = {.ttl_ms = 60000, .lease_ms = 60000};
        idem_completion c;
        cr_assert_eq(idem_claim(q, key, strlen(key), &a, &c), IDEM_OK);
        idem_queue_close(q);
        usleep(15000); /* the flusher writes this claim's batch, unsynced */
    }
    cr_assert_eq(idem_sync(s), IDEM_OK);
    cr_assert_eq(idem_close(s), IDEM_OK);
    cr_assert_eq(open_every_state(t, &d, from), 0, "durability none: a state did not open");
    regress_end(&d, t);
}

/* idem_open created the store directory (io_mkdir) but never synced its parent, so by io.h's own
 * rule (a create is durable only after a sync_dir of its directory) the directory, and with it
 * every acknowledged change, could be gone after a power loss. */
Test(crashstates, store_directory_made_at_open_survives_power_loss, .timeout = 120)
{
    struct run_dirs d;
    struct io_trace *t = regress_begin(&d, 4, 0);
    idem_store *s = traced_open(t, d.store, IDEM_DURABILITY_SYNC);
    claim_commit(s, "acknowledged");
    cr_assert_eq(idem_close(s), IDEM_OK);
    struct cs_walk *w;
    cr_assert_eq(cs_walk_create(io_trace_events(t), io_trace_count(t), d.store, &w), 0);
    uint64_t x;
    while (cs_walk_next(w, &x)) {
    }
    /* The end of the trace: everything flushed; only what no sync_dir covered is missing. */
    struct cs_select sel = {.keep = NULL, .dir_ops = 0, .torn = -1};
    cr_assert_eq(cs_walk_build(w, &sel, d.state), 0);
    cs_walk_destroy(w);
    idem_options o = cs_options(IDEM_DURABILITY_SYNC);
    cr_assert_eq(idem_open(d.state, &o, &s), IDEM_OK, "%s", idem_last_error());
    idem_queue *q;
    cr_assert_eq(idem_queue_open(s, 4, &q), IDEM_OK);
    idem_completion c;
    cr_assert_eq(idem_get(q, "acknowledged", 12, &c), IDEM_OK);
    cr_assert(c.found, "an acknowledged commit was lost with the store directory's name");
    idem_queue_close(q);
    cr_assert_eq(idem_close(s), IDEM_OK);
    regress_end(&d, t);
}
