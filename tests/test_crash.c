/*
 * test_crash.c: acknowledged means durable, under crashes of two kinds.
 *   power_loss: the store runs on the simulated disk; at a random flush or write the device
 *     fails (the store turns fatal), then power is lost: unsynced writes are dropped, torn at
 *     sector boundaries or bit-flipped. After reopening, every acknowledged claim, commit and
 *     release holds with its first_seen, token and result; unacknowledged ones may go either way;
 *     tokens never repeat.
 *   kill9: a child process claims and commits on a real directory and reports each
 *     acknowledgement through a pipe; it is killed with SIGKILL at a random moment, and the
 *     parent checks the same after reopening.
 * Seeds are printed; IDEM_SEED replays one, IDEM_LONG=1 runs the long-tier counts.
 */
#include <criterion/criterion.h>
#include <errno.h>
#include <pthread.h>
#include <stdatomic.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "idem.h"
#include "io_sim.h"
#include "store.h"
#include "testutil.h"

#define KEYS_MAX 512

enum model_state { M_NONE, M_NEW, M_COMMITTED, M_RELEASED };

struct model_key {
    int acked;            /* enum model_state, as acknowledged */
    int submitted_commit; /* a commit was submitted (maybe not acknowledged) */
    int submitted_release;
    int submitted_claim;
    int64_t token;
    int64_t first_seen_ms;
    char result[48];
};

/* The seed of the run under way, named by every assertion about an answer. */
static uint64_t run_seed;

struct model {
    struct model_key k[KEYS_MAX];
    int nkeys;
    int64_t max_token;
};

static void key_name(int i, char *buf)
{
    snprintf(buf, 32, "order-%05d", i);
}

static idem_options sim_options(void)
{
    idem_options o;
    idem_options_init(&o);
    o.test_clock = 1;
    o.segment_bytes = 64 * 1024;
    o.result_bytes_max = 4096;
    return o;
}

static idem_store *open_sim(struct io_sim *sim, int expect_ok)
{
    idem_options o = sim_options();
    idem_store *s = NULL;
    int rc = store_open_io("/sim/store", &o, io_sim_io(sim), 1, &s);
    if (expect_ok)
        cr_assert_eq(rc, IDEM_OK, "reopen failed: %s (%s)", idem_strerror(rc), idem_last_error());
    return rc == IDEM_OK ? s : NULL;
}

/* One round: a batch of random operations; returns 0 once the store has failed. */
static int run_round(idem_store *s, idem_queue *q, struct model *m, uint64_t *rng)
{
    idem_op ops[16];
    int idx[16];
    char keys[16][32];
    int n = 0;
    int64_t now = idem_clock_now(s);
    for (int j = 0; j < 16; j++) {
        uint64_t r = tu_rand(rng) % 10;
        idem_op op = {0};
        int i;
        if (r < 5 && m->nkeys < KEYS_MAX) {
            i = m->nkeys++;
            op.kind = IDEM_OP_CLAIM;
            op.ttl_ms = 1000000;
            op.lease_ms = 100000;
            m->k[i].submitted_claim = 1;
            m->k[i].first_seen_ms = now;
        } else {
            if (m->nkeys == 0) continue;
            i = (int)(tu_rand(rng) % (uint64_t)m->nkeys);
            struct model_key *k = &m->k[i];
            if (k->acked != M_NEW || k->submitted_commit || k->submitted_release) continue;
            if (r < 9) {
                op.kind = IDEM_OP_COMMIT;
                snprintf(k->result, sizeof k->result, "invoice-%d-%lld", i, (long long)k->token);
                op.data = k->result;
                op.data_len = (uint32_t)strlen(k->result);
                k->submitted_commit = 1;
            } else {
                op.kind = IDEM_OP_RELEASE;
                k->submitted_release = 1;
            }
            op.token = k->token;
        }
        key_name(i, keys[n]);
        op.key = keys[n];
        op.key_len = (uint32_t)strlen(keys[n]);
        idx[n] = i;
        ops[n++] = op;
    }
    if (n == 0) return 1;
    for (int t = 0; t < n; t++)
        ops[t].user_data = (uint64_t)t;
    cr_assert_eq(idem_submit(q, ops, (size_t)n), n);
    int got = 0, alive = 1;
    while (got < n) {
        idem_completion c[16];
        int k = idem_poll(q, c, 16, -1);
        cr_assert_gt(k, 0);
        /* Completions carry user_data = position in this batch. */
        for (int j = 0; j < k; j++, got++) {
            int t = (int)c[j].user_data;
            struct model_key *mk = &m->k[idx[t]];
            if (c[j].err == IDEM_EFATAL) {
                alive = 0;
                continue;
            }
            cr_assert_eq(c[j].err, IDEM_OK, "seed %llu: %s of key %d: %s",
                         (unsigned long long)run_seed,
                         ops[t].kind == IDEM_OP_CLAIM    ? "claim"
                         : ops[t].kind == IDEM_OP_COMMIT ? "commit"
                                                         : "release",
                         idx[t], idem_strerror(c[j].err));
            if (ops[t].kind == IDEM_OP_CLAIM) {
                cr_assert_eq(c[j].outcome, IDEM_NEW, "fresh key %d got %s", idx[t],
                             idem_outcome_name(c[j].outcome));
                cr_assert_gt(c[j].token, m->max_token, "token %lld repeats (max %lld)",
                             (long long)c[j].token, (long long)m->max_token);
                m->max_token = c[j].token;
                mk->token = c[j].token;
                mk->acked = M_NEW;
            } else if (ops[t].kind == IDEM_OP_COMMIT) {
                mk->acked = M_COMMITTED;
            } else {
                mk->acked = M_RELEASED;
            }
        }
    }
    return alive && !idem_is_fatal(s);
}

/* Checks every key of the model against the reopened store. */
static void check_model(idem_store *s, struct model *m, uint64_t seed)
{
    cr_assert_eq(store_check_index(s, NULL), IDEM_OK, "seed %llu: index inconsistent",
                 (unsigned long long)seed);
    idem_queue *q;
    cr_assert_eq(idem_queue_open(s, 4, &q), IDEM_OK);
    for (int i = 0; i < m->nkeys; i++) {
        const struct model_key *k = &m->k[i];
        char key[32];
        key_name(i, key);
        idem_completion c;
        cr_assert_eq(idem_get(q, key, strlen(key), &c), IDEM_OK);
        const idem_record *r = &c.record;
        switch (k->acked) {
        case M_COMMITTED:
            cr_assert(c.found, "seed %llu: acknowledged commit of %s lost",
                      (unsigned long long)seed, key);
            cr_assert_eq(r->state, IDEM_STATE_COMMITTED, "seed %llu: %s", (unsigned long long)seed,
                         key);
            cr_assert_eq(r->result_len, strlen(k->result));
            cr_assert(!memcmp(r->result, k->result, r->result_len));
            cr_assert_eq(r->first_seen_ms, k->first_seen_ms);
            break;
        case M_NEW:
            if (!c.found) {
                cr_assert(k->submitted_release, "seed %llu: acknowledged claim of %s lost",
                          (unsigned long long)seed, key);
                break;
            }
            cr_assert_eq(r->first_seen_ms, k->first_seen_ms);
            if (r->state == IDEM_STATE_COMMITTED) {
                cr_assert(k->submitted_commit, "seed %llu: %s committed unasked",
                          (unsigned long long)seed, key);
            } else {
                cr_assert_eq(r->state, IDEM_STATE_IN_FLIGHT);
                cr_assert_eq(r->token, k->token, "seed %llu: %s token changed",
                             (unsigned long long)seed, key);
            }
            break;
        case M_RELEASED:
            cr_assert(!c.found, "seed %llu: acknowledged release of %s undone",
                      (unsigned long long)seed, key);
            break;
        default:
            /* Never acknowledged: absent, or claimed with a token never handed to anyone. */
            if (c.found) {
                cr_assert(k->submitted_claim);
                cr_assert_eq(r->state, IDEM_STATE_IN_FLIGHT);
                cr_assert_eq(r->first_seen_ms, k->first_seen_ms);
            }
        }
    }
    /* A new claim after recovery gets a token above every token handed out before. */
    idem_claim_args a = {.ttl_ms = 1000, .lease_ms = 1000};
    idem_completion c;
    static int probes;
    char probe[32];
    snprintf(probe, sizeof probe, "after-crash-%d", probes++);
    cr_assert_eq(idem_claim(q, probe, strlen(probe), &a, &c), IDEM_OK);
    cr_assert_eq(c.outcome, IDEM_NEW);
    cr_assert_gt(c.token, m->max_token, "seed %llu: token %lld not above %lld",
                 (unsigned long long)seed, (long long)c.token, (long long)m->max_token);
    m->max_token = c.token;
    idem_queue_close(q);
}

static void power_loss_once(uint64_t seed)
{
    run_seed = seed;
    uint64_t rng = seed;
    struct io_sim *sim;
    cr_assert_eq(io_sim_create(seed, &sim), 0);
    struct model *m = calloc(1, sizeof *m);
    idem_store *s = open_sim(sim, 1);
    /* The device fails at a random flush or write from now on. */
    uint64_t nth = 1 + tu_rand(&rng) % 80;
    if (tu_rand(&rng) % 2)
        io_sim_fail_flush(sim, nth, -EIO);
    else
        io_sim_fail_write(sim, nth, -EIO);
    idem_queue *q;
    cr_assert_eq(idem_queue_open(s, 64, &q), IDEM_OK);
    for (int round = 0; round < 200; round++) {
        if (!run_round(s, q, m, &rng)) break;
        idem_clock_advance(s, 1 + (int64_t)(tu_rand(&rng) % 5));
    }
    store_abandon(s);
    unsigned flags = (unsigned)(tu_rand(&rng) % 4) & (IO_SIM_CRASH_TEAR | IO_SIM_CRASH_FLIP);
    io_sim_crash(sim, flags);
    s = open_sim(sim, 1);
    check_model(s, m, seed);
    cr_assert_eq(idem_close(s), IDEM_OK);
    /* A clean close and reopen keeps the same state. */
    s = open_sim(sim, 1);
    check_model(s, m, seed);
    cr_assert_eq(idem_close(s), IDEM_OK);
    free(m);
    io_sim_destroy(sim);
}

Test(crash, power_loss_keeps_every_acknowledged_change, .timeout = 300)
{
    uint64_t base = tu_seed("crash::power_loss");
    uint64_t n = tu_count(150, 20000);
    for (uint64_t i = 0; i < n; i++)
        power_loss_once(base + i);
}

/* ---- kill -9 of a real process ---- */

/* What the child reports after each acknowledged call. */
struct ack {
    int32_t key;
    int32_t kind; /* 1 claim acknowledged, 2 commit acknowledged */
    int64_t token;
};

static void child_run(const char *dir, int fd, uint64_t seed)
{
    idem_store *s;
    idem_options o;
    idem_options_init(&o);
    o.io_backend = (seed % 2) ? IDEM_IO_THREAD : IDEM_IO_AUTO;
    if (idem_open(dir, &o, &s) != IDEM_OK) _exit(3);
    idem_queue *q;
    if (idem_queue_open(s, 64, &q) != IDEM_OK) _exit(4);
    int64_t tokens[KEYS_MAX * 8];
    for (int i = 0; i < KEYS_MAX * 8; i++) {
        char key[32];
        key_name(i, key);
        idem_claim_args a = {.ttl_ms = 3600000, .lease_ms = 600000};
        idem_completion c;
        if (idem_claim(q, key, strlen(key), &a, &c) != IDEM_OK || c.outcome != IDEM_NEW) _exit(5);
        tokens[i] = c.token;
        struct ack ack = {i, 1, c.token};
        if (write(fd, &ack, sizeof ack) != sizeof ack) _exit(6);
        if (i % 2 == 0) {
            char res[48];
            snprintf(res, sizeof res, "invoice-%d-%lld", i, (long long)tokens[i]);
            if (idem_commit(q, key, strlen(key), tokens[i], res, strlen(res)) != IDEM_OK) _exit(7);
            ack.kind = 2;
            if (write(fd, &ack, sizeof ack) != sizeof ack) _exit(6);
        }
    }
    _exit(0);
}

Test(crash, kill9_keeps_every_acknowledged_claim_and_commit, .timeout = 300)
{
    uint64_t base = tu_seed("crash::kill9");
    uint64_t n = tu_count(12, 10000);
    for (uint64_t i = 0; i < n; i++) {
        char *dir = tu_mkdtemp("kill9");
        cr_assert(dir);
        /* Acknowledgements are read after the kill; the child writes each one only after the
         * call returned, so every ack read names a durable change. */
        int p[2];
        cr_assert_eq(pipe(p), 0);
        pid_t pid = fork();
        if (pid == 0) {
            close(p[0]);
            child_run(dir, p[1], base + i);
        }
        close(p[1]);
        uint64_t rng = base + i;
        usleep((useconds_t)(5000 + tu_rand(&rng) % 150000));
        kill(pid, SIGKILL);
        waitpid(pid, NULL, 0);
        static struct ack acks[KEYS_MAX * 16];
        size_t nacks = 0;
        while (nacks < sizeof acks / sizeof acks[0] &&
               read(p[0], &acks[nacks], sizeof acks[0]) == sizeof acks[0])
            nacks++;
        close(p[0]);
        idem_store *s;
        cr_assert_eq(idem_open(dir, NULL, &s), IDEM_OK, "reopen: %s", idem_last_error());
        idem_queue *q;
        cr_assert_eq(idem_queue_open(s, 4, &q), IDEM_OK);
        int64_t max_token = 0;
        for (size_t a = 0; a < nacks; a++) {
            char key[32];
            key_name(acks[a].key, key);
            idem_completion c;
            cr_assert_eq(idem_get(q, key, strlen(key), &c), IDEM_OK);
            cr_assert(c.found, "seed %llu: acknowledged %s lost", (unsigned long long)(base + i),
                      key);
            if (acks[a].kind == 2) {
                char res[48];
                snprintf(res, sizeof res, "invoice-%d-%lld", acks[a].key, (long long)acks[a].token);
                cr_assert_eq(c.record.state, IDEM_STATE_COMMITTED);
                cr_assert_eq(c.record.result_len, strlen(res));
                cr_assert(!memcmp(c.record.result, res, strlen(res)));
            } else if (c.record.state == IDEM_STATE_IN_FLIGHT) {
                cr_assert_eq(c.record.token, acks[a].token);
            }
            if (acks[a].token > max_token) max_token = acks[a].token;
        }
        idem_claim_args ca = {.ttl_ms = 1000, .lease_ms = 1000};
        idem_completion c;
        cr_assert_eq(idem_claim(q, "after-kill", 10, &ca, &c), IDEM_OK);
        cr_assert_gt(c.token, max_token);
        idem_queue_close(q);
        cr_assert_eq(idem_close(s), IDEM_OK);
        tu_rmtree(dir);
    }
}

/* Invariant 4: no answer is based on state that was not yet durable. While the flush that covers
 * a new claim has not finished, neither the claim nor a duplicate of it nor a read of the key is
 * answered; after a crash at that moment the key is absent, and nobody was told otherwise. */
Test(crash, answers_wait_for_the_flush_they_depend_on, .timeout = 60)
{
    struct io_sim *sim;
    cr_assert_eq(io_sim_create(5, &sim), 0);
    idem_store *s = open_sim(sim, 1);
    idem_queue *q1, *q2;
    cr_assert_eq(idem_queue_open(s, 8, &q1), IDEM_OK);
    cr_assert_eq(idem_queue_open(s, 8, &q2), IDEM_OK);
    idem_completion c[4];
    for (int round = 0; round < 2; round++) {
        char key[16];
        snprintf(key, sizeof key, "k%d", round);
        io_sim_hold(sim, 1); /* the disk takes the flush and does not answer */
        idem_op claim = {.kind = IDEM_OP_CLAIM,
                         .key = key,
                         .key_len = 2,
                         .ttl_ms = 60000,
                         .lease_ms = 60000,
                         .user_data = 1};
        cr_assert_eq(idem_submit(q1, &claim, 1), 1);
        cr_assert_eq(idem_poll(q1, c, 4, 100), 0, "the claim was answered before its flush");
        claim.user_data = 2;
        idem_op get = {.kind = IDEM_OP_GET, .key = key, .key_len = 2, .user_data = 3};
        cr_assert_eq(idem_submit(q2, &claim, 1), 1);
        cr_assert_eq(idem_submit(q2, &get, 1), 1);
        cr_assert_eq(idem_poll(q2, c, 4, 100), 0, "a duplicate or read was answered early");
        if (round == 1) break; /* the second round ends in a crash with the flush still held */
        io_sim_hold(sim, 0);
        cr_assert_eq(idem_poll(q1, c, 4, 5000), 1);
        cr_assert_eq(c[0].outcome, IDEM_NEW);
        int got = 0;
        while (got < 2) {
            int n = idem_poll(q2, c + got, 4, 5000);
            cr_assert_gt(n, 0);
            got += n;
        }
        cr_assert_eq(c[0].outcome, IDEM_BUSY);
        cr_assert(c[1].found);
    }
    /* Crash with the second claim's flush never answered: k1 must be absent after reopen (its
     * write may reach the disk only as an unsynced write, which the crash drops). */
    idem_queue_close(q1);
    idem_queue_close(q2);
    io_sim_fail_flush(sim, 1, -EIO); /* the held flush fails when the disk answers */
    io_sim_hold(sim, 0);
    store_abandon(s);
    io_sim_crash(sim, IO_SIM_CRASH_LOSE_ALL);
    s = open_sim(sim, 1);
    idem_queue *q;
    cr_assert_eq(idem_queue_open(s, 4, &q), IDEM_OK);
    cr_assert_eq(idem_get(q, "k0", 2, c), IDEM_OK);
    cr_assert(c[0].found, "the acknowledged claim of k0 was lost");
    cr_assert_eq(idem_get(q, "k1", 2, c), IDEM_OK);
    cr_assert(!c[0].found, "k1, never acknowledged, survived a crash that dropped its write");
    idem_queue_close(q);
    cr_assert_eq(idem_close(s), IDEM_OK);
    io_sim_destroy(sim);
}

/* Key "k" claimed (new), then the disk's flushes held: what a test submits next waits. */
struct held {
    struct io_sim *sim;
    idem_store *s;
    idem_queue *q[3];
    int64_t tok;
};

static int64_t frozen_mono_ms(void *ctx)
{
    (void)ctx;
    return 1000000;
}

/* A monotonic clock that stands still: a claim that comes in a new second of it is left to the
 * locked path (ops_read_begin), which would make a test of the reader's path depend on when the
 * second turns. */
static const idem_clock_source frozen_clock = {.monotonic_ms = frozen_mono_ms};

static void held_begin(struct held *h, uint64_t seed)
{
    cr_assert_eq(io_sim_create(seed, &h->sim), 0);
    idem_options o = sim_options();
    o.clock = &frozen_clock;
    cr_assert_eq(store_open_io("/sim/store", &o, io_sim_io(h->sim), 1, &h->s), IDEM_OK, "%s",
                 idem_last_error());
    for (int i = 0; i < 3; i++)
        cr_assert_eq(idem_queue_open(h->s, 8, &h->q[i]), IDEM_OK);
    idem_claim_args ca = {.ttl_ms = 60000, .lease_ms = 60000};
    idem_completion c;
    cr_assert_eq(idem_claim(h->q[0], "k", 1, &ca, &c), IDEM_OK);
    cr_assert_eq(c.outcome, IDEM_NEW);
    h->tok = c.token;
    io_sim_hold(h->sim, 1);
}

/* The held flush fails (unless the test failed it already) and the disk loses everything
 * unflushed: "k" is in flight again after the reopen, with its token. */
static void held_end(struct held *h, int failed)
{
    for (int i = 0; i < 3; i++)
        idem_queue_close(h->q[i]);
    if (!failed) io_sim_fail_flush(h->sim, 1, -EIO);
    io_sim_hold(h->sim, 0);
    store_abandon(h->s);
    io_sim_crash(h->sim, IO_SIM_CRASH_LOSE_ALL);
    idem_store *s = open_sim(h->sim, 1);
    idem_queue *q;
    idem_completion c;
    cr_assert_eq(idem_queue_open(s, 4, &q), IDEM_OK);
    cr_assert_eq(idem_get(q, "k", 1, &c), IDEM_OK);
    cr_assert(c.found && c.record.state == IDEM_STATE_IN_FLIGHT && c.record.token == h->tok,
              "an unacknowledged change survived, or the claim was lost");
    idem_queue_close(q);
    cr_assert_eq(idem_close(s), IDEM_OK);
    io_sim_destroy(h->sim);
}

/* A repeat of a committed key is answered without the store's lock (store.h, rw), but only once
 * the commit it reports is durable, blocking or not; a flush that fails turns it into EFATAL. */
static void *blocking_repeat(void *arg)
{
    idem_queue *q = arg;
    idem_claim_args ca = {.ttl_ms = 60000, .lease_ms = 60000};
    static idem_completion c;
    int rc = idem_claim(q, "k", 1, &ca, &c);
    return rc == IDEM_EFATAL ? (void *)&c : NULL;
}

Test(crash, a_repeat_answered_without_the_lock_waits_for_the_commit_it_reports, .timeout = 60)
{
    struct held h;
    held_begin(&h, 8);
    idem_completion c[4];
    idem_op commit = {.kind = IDEM_OP_COMMIT,
                      .key = "k",
                      .key_len = 1,
                      .token = h.tok,
                      .data = "r",
                      .data_len = 1,
                      .user_data = 1};
    cr_assert_eq(idem_submit(h.q[0], &commit, 1), 1);
    uint64_t reads = store_test_reads(h.s);
    idem_op repeat = {
        .kind = IDEM_OP_CLAIM, .key = "k", .key_len = 1, .ttl_ms = 60000, .lease_ms = 60000};
    cr_assert_eq(idem_submit(h.q[1], &repeat, 1), 1);
    cr_assert_eq(store_test_reads(h.s), reads + 1, "the repeat was not answered by a reader");
    cr_assert_eq(idem_poll(h.q[1], c, 4, 100), 0,
                 "a done was delivered before its commit was durable");
    pthread_t th;
    cr_assert_eq(pthread_create(&th, NULL, blocking_repeat, h.q[2]), 0);
    usleep(100000); /* answered under the read side too, unless a writer had the lock then */
    io_sim_fail_flush(h.sim, 1, -EIO);
    io_sim_hold(h.sim, 0);
    void *blocked;
    pthread_join(th, &blocked);
    cr_assert_not_null(blocked, "the blocking repeat did not end in EFATAL");
    cr_assert_eq(idem_poll(h.q[1], c, 4, 5000), 1);
    cr_assert_eq(c[0].err, IDEM_EFATAL, "a done of a commit never made durable was delivered");
    held_end(&h, 1);
}

/* The operator's views report only what is durable in sync mode (rule 8): a scan by state and
 * the attention list that see "k" held for review wait for the hold's flush, and a flush that
 * fails turns them into EFATAL. The attention list used to answer at once (twenty-fifth
 * session's review: it listed a review record that a crash then took back). */
struct view_call {
    idem_queue *q;
    int attention; /* else a scan of the review records */
    int rc;
    size_t n;
    atomic_int done;
};

static void *view_main(void *arg)
{
    struct view_call *v = arg;
    if (v->attention) {
        idem_attention_args a = {0};
        const idem_record *r;
        v->rc = idem_attention(v->q, &a, &r, &v->n);
    } else {
        idem_scan_args a = {.state = IDEM_STATE_REVIEW};
        uint64_t next;
        const void **keys;
        const uint32_t *lens;
        v->rc = idem_scan(v->q, &a, &next, &keys, &lens, &v->n);
    }
    atomic_store(&v->done, 1);
    return NULL;
}

/* Starts the attention list and a scan of review records, expects neither to answer while the
 * flush of `change` is held, then fails that flush: both end in EFATAL. */
static void views_wait_for_the_held_flush(struct held *h, const char *change)
{
    struct view_call v[2] = {{.q = h->q[1], .attention = 1}, {.q = h->q[2], .attention = 0}};
    pthread_t th[2];
    for (int i = 0; i < 2; i++)
        cr_assert_eq(pthread_create(&th[i], NULL, view_main, &v[i]), 0);
    usleep(200000);
    cr_assert(!atomic_load(&v[0].done),
              "the attention list answered %zu records before %s was "
              "durable",
              v[0].n, change);
    cr_assert(!atomic_load(&v[1].done), "a scan answered %zu keys before %s was durable", v[1].n,
              change);
    io_sim_fail_flush(h->sim, 1, -EIO);
    io_sim_hold(h->sim, 0);
    for (int i = 0; i < 2; i++) {
        pthread_join(th[i], NULL);
        cr_assert_eq(v[i].rc, IDEM_EFATAL, "%s: %s", v[i].attention ? "attention" : "scan",
                     idem_strerror(v[i].rc));
    }
}

Test(crash, operator_views_wait_for_the_changes_they_report, .timeout = 60)
{
    struct held h;
    held_begin(&h, 9);
    idem_op hold = {.kind = IDEM_OP_HOLD,
                    .key = "k",
                    .key_len = 1,
                    .token = h.tok,
                    .data = "why",
                    .data_len = 3,
                    .user_data = 1};
    cr_assert_eq(idem_submit(h.q[0], &hold, 1), 1);
    views_wait_for_the_held_flush(&h, "the hold");
    held_end(&h, 1);
}

/* Found by a review of the operator's views: they waited only for the changes of the records
 * they list. A resolve that took the only review record out of review answered the attention
 * list and a scan of review records with nothing at once, before it was durable; a crash then
 * brought the record back in review, which the operator had been told no record was in. */
Test(crash, operator_views_wait_for_a_change_that_took_a_record_out_of_them, .timeout = 60)
{
    struct held h;
    held_begin(&h, 10);
    io_sim_hold(h.sim, 0);
    idem_completion c;
    cr_assert_eq(idem_hold(h.q[0], "k", 1, h.tok, "why", 3), IDEM_OK);
    io_sim_hold(h.sim, 1);
    idem_op resolve = {.kind = IDEM_OP_RESOLVE,
                       .key = "k",
                       .key_len = 1,
                       .data = "checked",
                       .data_len = 7,
                       .action = IDEM_RESOLVE_COMMIT,
                       .actor = "test",
                       .user_data = 1};
    cr_assert_eq(idem_submit(h.q[0], &resolve, 1), 1);
    cr_assert_eq(idem_poll(h.q[0], &c, 1, 100), 0, "the resolve was answered before its flush: %s",
                 idem_strerror(c.err));
    views_wait_for_the_held_flush(&h, "the resolve that left them out");
    for (int i = 0; i < 3; i++)
        idem_queue_close(h.q[i]);
    store_abandon(h.s);
    io_sim_crash(h.sim, IO_SIM_CRASH_LOSE_ALL);
    idem_store *s = open_sim(h.sim, 1);
    idem_queue *q;
    cr_assert_eq(idem_queue_open(s, 4, &q), IDEM_OK);
    cr_assert_eq(idem_get(q, "k", 1, &c), IDEM_OK);
    cr_assert(c.found && c.record.state == IDEM_STATE_REVIEW, "the record is not in review");
    idem_queue_close(q);
    cr_assert_eq(idem_close(s), IDEM_OK);
    io_sim_destroy(h.sim);
}

/* An answer about an absent key (NOTFOUND, a GET that finds nothing) waits for the
 * DELETE that made it absent to be durable. */
Test(crash, answers_about_an_absent_key_wait_for_the_delete_they_report, .timeout = 60)
{
    struct held h;
    held_begin(&h, 7);
    idem_completion c[4];
    idem_op rel = {
        .kind = IDEM_OP_RELEASE, .key = "k", .key_len = 1, .token = h.tok, .user_data = 1};
    cr_assert_eq(idem_submit(h.q[0], &rel, 1), 1);
    cr_assert_eq(idem_poll(h.q[0], c, 4, 100), 0, "the release was answered before its flush");
    idem_op retry = rel;
    retry.user_data = 2;
    idem_op get = {.kind = IDEM_OP_GET, .key = "k", .key_len = 1, .user_data = 3};
    cr_assert_eq(idem_submit(h.q[1], &retry, 1), 1);
    cr_assert_eq(idem_submit(h.q[2], &get, 1), 1);
    cr_assert_eq(idem_poll(h.q[1], c, 4, 100), 0,
                 "a NOTFOUND was answered before the DELETE was durable");
    cr_assert_eq(idem_poll(h.q[2], c, 4, 100), 0,
                 "a read found nothing before the DELETE was durable");
    held_end(&h, 0);
}
