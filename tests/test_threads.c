/*
 * test_threads.c: concurrency and a randomised model test of the public API.
 *
 * - Many threads (each with its own idem_queue) racing for one key: exactly one `new`.
 * - Many threads claiming distinct keys: every key is there after a reopen.
 * - Blocking calls and the asynchronous form (idem_submit / idem_poll) mixed across threads.
 * - Claims with WAIT, woken by commit, release, hold, an expired lease, or their own timeout.
 * - A seeded model test: random claim / commit / release / hold / extend / resolve / del /
 *   set-if-absent / clock moves / close-and-reopen against a simple reference map that predicts
 *   every outcome and checks the invariants (at most one `new` per key per lifetime, first_seen
 *   never changes, tokens never repeat, unfinished records never expire). The seed is printed;
 *   IDEM_SEED replays it.
 *
 * Worker threads never call criterion assertions: they record the first failure in their
 * slot, and the test thread asserts after joining.
 */
#include <criterion/criterion.h>

#include <errno.h>
#include <inttypes.h>
#include <poll.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "idem.h"
#include "store.h"
#include "testutil.h"

#define TTL   600000u
#define LEASE 60000u

static char *g_dir;
static idem_options g_opts;
static idem_store *g_s;
static idem_queue *g_q;

static void store_open(void)
{
    int rc = idem_open(g_dir, &g_opts, &g_s);
    cr_assert_eq(rc, IDEM_OK, "idem_open: %s (%s)", idem_strerror(rc), idem_last_error());
    rc = idem_queue_open(g_s, 256, &g_q);
    cr_assert_eq(rc, IDEM_OK, "idem_queue_open: %s", idem_strerror(rc));
}

static long M_step(void);

static void store_close(void)
{
    if (g_q) idem_queue_close(g_q);
    g_q = NULL;
    if (g_s) {
        int rc = idem_close(g_s);
        g_s = NULL;
        cr_assert_eq(rc, IDEM_OK, "idem_close: %s (%s); model step %ld", idem_strerror(rc),
                     idem_last_error(), M_step());
    }
}

/* Where a test's backup goes: beside the store (a copy within it is refused). */
static const char *backup_dir_of(const char *dir)
{
    static char path[4200];
    snprintf(path, sizeof path, "%s-backup", dir);
    return path;
}

static void setup(void)
{
    g_dir = tu_mkdtemp("threads");
    cr_assert_not_null(g_dir);
    idem_options_init(&g_opts);
    g_opts.test_clock = 1;
    store_open();
}

static void teardown(void)
{
    if (g_q) idem_queue_close(g_q);
    g_q = NULL;
    if (g_s) (void)idem_close(g_s);
    g_s = NULL;
    if (g_dir) {
        char partial[4300];
        snprintf(partial, sizeof partial, "%s.partial", backup_dir_of(g_dir));
        tu_rmtree(strdup(partial));
        tu_rmtree(strdup(backup_dir_of(g_dir)));
    }
    tu_rmtree(g_dir);
    g_dir = NULL;
}

#define expect_rc(expr, want)                                                                      \
    do {                                                                                           \
        int rc_ = (expr);                                                                          \
        cr_assert_eq(rc_, (want), "%s: %s (%d), expected %s", #expr, idem_strerror(rc_), rc_,      \
                     idem_strerror(want));                                                         \
    } while (0)

static idem_claim_args claim_args(uint64_t ttl_ms, uint64_t lease_ms, uint32_t wait_ms)
{
    idem_claim_args a;
    memset(&a, 0, sizeof a);
    a.ttl_ms = ttl_ms;
    a.lease_ms = lease_ms;
    a.wait_ms = wait_ms;
    return a;
}

/* A failure slot for a worker thread. */
typedef struct worker {
    pthread_t th;
    int idx;
    char err[512];
} worker;

#define WFAIL(w, ...)                                                                              \
    do {                                                                                           \
        if (!(w)->err[0]) snprintf((w)->err, sizeof(w)->err, __VA_ARGS__);                         \
    } while (0)

/* Starts n threads running fn, thread i on ws[i] (cleared, idx i). */
static void start_all(worker *ws, size_t n, void *(*fn)(void *))
{
    memset(ws, 0, n * sizeof *ws);
    for (size_t i = 0; i < n; i++) {
        ws[i].idx = (int)i;
        cr_assert_eq(pthread_create(&ws[i].th, NULL, fn, &ws[i]), 0);
    }
}

static void join_all(worker *ws, size_t n)
{
    for (size_t i = 0; i < n; i++)
        pthread_join(ws[i].th, NULL);
    for (size_t i = 0; i < n; i++)
        cr_assert_eq(ws[i].err[0], 0, "thread %zu: %s", i, ws[i].err);
}

/*
 * Submits ops[0..n) on q (as many calls as the queue's depth needs) and polls until all n
 * completions arrived; out[i] is the completion of ops[i] (user_data must be i). Returns NULL or
 * a static description of the failure.
 */
static const char *run_async(idem_queue *q, idem_op *ops, size_t n, idem_completion *out)
{
    size_t sent = 0, got = 0;
    idem_completion tmp[64];
    for (size_t i = 0; i < n; i++)
        ops[i].user_data = i;
    while (got < n) {
        if (sent < n) {
            int r = idem_submit(q, ops + sent, n - sent);
            if (r < 0) return "idem_submit failed";
            sent += (size_t)r;
        }
        int p = idem_poll(q, tmp, 64, 30000);
        if (p < 0) return "idem_poll failed";
        if (p == 0) return "idem_poll: no completion within 30 s";
        for (int i = 0; i < p; i++) {
            if (tmp[i].user_data >= n) return "completion with a user_data never submitted";
            out[tmp[i].user_data] = tmp[i];
            got++;
        }
    }
    return NULL;
}

/* ------------------------------------------------------------------------------------------ */
/* Rule 1 under contention. */

TestSuite(race, .init = setup, .fini = teardown, .timeout = 120);

#define HOT_THREADS_MAX 64
#define HOT_ROUNDS_MAX  200

static pthread_barrier_t g_bar;
static size_t g_hot_rounds, g_hot_threads;
static int g_hot_outcome[HOT_ROUNDS_MAX][HOT_THREADS_MAX];
static int64_t g_hot_token[HOT_ROUNDS_MAX][HOT_THREADS_MAX];

static void *hot_worker(void *arg)
{
    worker *w = arg;
    idem_queue *q = NULL;
    int qrc = idem_queue_open(g_s, 8, &q);
    if (qrc != IDEM_OK) WFAIL(w, "idem_queue_open: %s", idem_strerror(qrc));
    for (size_t r = 0; r < g_hot_rounds; r++) {
        char key[32], res[32];
        snprintf(key, sizeof key, "hot-%zu", r);
        snprintf(res, sizeof res, "winner-%d", w->idx);
        idem_claim_args a = claim_args(TTL, LEASE, 0);
        idem_completion c;
        memset(&c, 0, sizeof c);
        pthread_barrier_wait(&g_bar);
        int rc = q ? idem_claim(q, key, strlen(key), &a, &c) : IDEM_EINVAL;
        if (rc != IDEM_OK) WFAIL(w, "round %zu: idem_claim: %s", r, idem_strerror(rc));
        g_hot_outcome[r][w->idx] = c.outcome;
        g_hot_token[r][w->idx] = c.token;
        pthread_barrier_wait(&g_bar);
        if (c.outcome == IDEM_NEW) {
            rc = idem_commit(q, key, strlen(key), c.token, res, strlen(res));
            if (rc != IDEM_OK) WFAIL(w, "round %zu: commit: %s", r, idem_strerror(rc));
        }
        pthread_barrier_wait(&g_bar);
        /* Every outcome of the round is written (the barrier above): the result is the one
         * its winner committed, no other round's. */
        char want[32] = "";
        for (size_t i = 0; i < g_hot_threads; i++)
            if (g_hot_outcome[r][i] == IDEM_NEW) snprintf(want, sizeof want, "winner-%zu", i);
        rc = q ? idem_claim(q, key, strlen(key), &a, &c) : IDEM_EINVAL;
        if (rc != IDEM_OK || c.outcome != IDEM_DONE)
            WFAIL(w, "round %zu: claim after commit: rc %d outcome %s", r, rc,
                  idem_outcome_name(c.outcome));
        else if (c.data_len != strlen(want) || memcmp(c.data, want, c.data_len) != 0)
            WFAIL(w, "round %zu: done with %.*s, not the winner's %s", r, (int)c.data_len,
                  (const char *)c.data, want);
    }
    if (q) idem_queue_close(q);
    return NULL;
}

static void hot_key_race(size_t nthreads)
{
    worker ws[HOT_THREADS_MAX];
    g_hot_rounds = tu_count(10, HOT_ROUNDS_MAX);
    g_hot_threads = nthreads;
    cr_assert_eq(pthread_barrier_init(&g_bar, NULL, (unsigned)nthreads), 0);
    start_all(ws, nthreads, hot_worker);
    join_all(ws, nthreads);
    pthread_barrier_destroy(&g_bar);
    int64_t last = 0;
    for (size_t r = 0; r < g_hot_rounds; r++) {
        int news = 0;
        int64_t tok = 0;
        for (size_t i = 0; i < nthreads; i++) {
            int o = g_hot_outcome[r][i];
            cr_assert(o == IDEM_NEW || o == IDEM_BUSY, "round %zu thread %zu: outcome %s", r, i,
                      idem_outcome_name(o));
            if (o == IDEM_NEW) {
                news++;
                tok = g_hot_token[r][i];
            }
        }
        cr_assert_eq(news, 1, "round %zu: %d threads got new", r, news);
        cr_assert_gt(tok, last, "round %zu: token %" PRId64 " not above %" PRId64, r, tok, last);
        last = tok;
    }
    idem_stats st;
    idem_get_stats(g_s, &st);
    cr_assert_eq(st.claims_new, g_hot_rounds);
    cr_assert_eq(st.claims_busy, g_hot_rounds * (nthreads - 1));
    cr_assert_eq(st.keys_committed, g_hot_rounds);
}

Test(race, sixteen_threads_claiming_one_key_get_exactly_one_new)
{
    hot_key_race(16);
}

Test(race, sixty_four_threads_claiming_one_key_get_exactly_one_new)
{
    hot_key_race(64);
}

/* ------------------------------------------------------------------------------------------ */
/* Many threads, distinct keys, all present after reopen. */

#define SPREAD_THREADS 16

static size_t g_spread_keys;

/* A queue of the given depth for worker w, or NULL (the failure recorded in w). */
static idem_queue *worker_queue(worker *w, uint32_t depth)
{
    idem_queue *q = NULL;
    int rc = idem_queue_open(g_s, depth, &q);
    if (rc != IDEM_OK) WFAIL(w, "idem_queue_open: %s", idem_strerror(rc));
    return rc == IDEM_OK ? q : NULL;
}

static void *spread_worker(void *arg)
{
    worker *w = arg;
    idem_queue *q = worker_queue(w, 8);
    if (!q) return NULL;
    int rc;
    for (size_t i = 0; i < g_spread_keys; i++) {
        char key[48], res[48];
        snprintf(key, sizeof key, "t%d-key-%zu", w->idx, i);
        snprintf(res, sizeof res, "t%d-res-%zu", w->idx, i);
        idem_claim_args a = claim_args(TTL, LEASE, 0);
        idem_completion c;
        rc = idem_claim(q, key, strlen(key), &a, &c);
        if (rc != IDEM_OK || c.outcome != IDEM_NEW) {
            WFAIL(w, "%s: rc %d outcome %s", key, rc, idem_outcome_name(c.outcome));
            break;
        }
        /* Every third key stays in flight; the rest are committed. */
        if (i % 3 != 0) {
            rc = idem_commit(q, key, strlen(key), c.token, res, strlen(res));
            if (rc != IDEM_OK) {
                WFAIL(w, "%s: commit: %s", key, idem_strerror(rc));
                break;
            }
        }
    }
    idem_queue_close(q);
    return NULL;
}

Test(race, many_threads_claiming_distinct_keys_all_present_after_reopen)
{
    worker ws[SPREAD_THREADS];
    g_spread_keys = tu_count(100, 2000);
    start_all(ws, SPREAD_THREADS, spread_worker);
    join_all(ws, SPREAD_THREADS);
    store_close();
    store_open();
    for (int t = 0; t < SPREAD_THREADS; t++) {
        for (size_t i = 0; i < g_spread_keys; i++) {
            char key[48], res[48];
            snprintf(key, sizeof key, "t%d-key-%zu", t, i);
            snprintf(res, sizeof res, "t%d-res-%zu", t, i);
            idem_completion c;
            expect_rc(idem_get(g_q, key, strlen(key), &c), IDEM_OK);
            cr_assert(c.found, "%s lost after reopen", key);
            if (i % 3 == 0) {
                cr_assert_eq(c.record.state, IDEM_STATE_IN_FLIGHT, "%s", key);
            } else {
                cr_assert_eq(c.record.state, IDEM_STATE_COMMITTED, "%s", key);
                cr_assert_eq(c.record.result_len, strlen(res), "%s", key);
                cr_assert(memcmp(c.record.result, res, strlen(res)) == 0, "%s", key);
            }
        }
    }
    idem_stats st;
    idem_get_stats(g_s, &st);
    uint64_t total = SPREAD_THREADS * g_spread_keys;
    uint64_t inflight = SPREAD_THREADS * ((g_spread_keys + 2) / 3);
    cr_assert_eq(st.keys, total);
    cr_assert_eq(st.keys_in_flight, inflight, "keys_in_flight %llu after reopen, expected %llu",
                 (unsigned long long)st.keys_in_flight, (unsigned long long)inflight);
    cr_assert_eq(st.keys_committed, total - inflight);
}

/* ------------------------------------------------------------------------------------------ */
/* Claims of committed keys answered without the store's lock (store.h, rw): many threads at
 * once, each repeat counted once, while another thread writes, moves the clock and deletes. */

#define DUP_KEYS    4096
#define DUP_READERS 4
#define DUP_BATCH   64

static atomic_uint_fast64_t g_dup_claims[DUP_KEYS];
static atomic_int g_dup_stop;
static size_t g_dup_rounds;

static void dup_key(char *key, size_t n, int k)
{
    snprintf(key, n, "dup-%d", k);
}

/* Every reader claims the same keys in the same order, each round starting together: the
 * first repeat of a key (which takes its counter entry) races between readers, as do the
 * counts after it. */
static void *dup_reader(void *arg)
{
    worker *w = arg;
    idem_queue *q = worker_queue(w, DUP_BATCH);
    static __thread char keys[DUP_BATCH][16];
    idem_op ops[DUP_BATCH];
    idem_completion out[DUP_BATCH];
    int which[DUP_BATCH];
    for (size_t r = 0; r < g_dup_rounds; r++) {
        uint64_t rng = 0x9e3779b97f4a7c15ull * (r + 1);
        for (int i = 0; i < DUP_BATCH; i++) {
            rng = rng * 6364136223846793005ull + 1442695040888963407ull;
            which[i] = (int)((rng >> 33) % DUP_KEYS);
            dup_key(keys[i], sizeof keys[i], which[i]);
            ops[i] = (idem_op){.kind = IDEM_OP_CLAIM,
                               .key = keys[i],
                               .key_len = (uint32_t)strlen(keys[i]),
                               .ttl_ms = TTL,
                               .lease_ms = LEASE};
        }
        pthread_barrier_wait(&g_bar); /* no break before it: the others would wait forever */
        const char *why = q ? run_async(q, ops, DUP_BATCH, out) : "no queue";
        if (why) {
            WFAIL(w, "round %zu: %s", r, why);
            continue;
        }
        for (int i = 0; i < DUP_BATCH; i++) {
            char want[16];
            snprintf(want, sizeof want, "res-%d", which[i]);
            if (out[i].err != IDEM_OK || out[i].outcome != IDEM_DONE ||
                out[i].data_len != strlen(want) || memcmp(out[i].data, want, strlen(want)) != 0)
                WFAIL(w, "round %zu: dup-%d: err %s outcome %s", r, which[i],
                      idem_strerror(out[i].err), idem_outcome_name(out[i].outcome));
            else
                atomic_fetch_add(&g_dup_claims[which[i]], 1);
        }
    }
    if (q) idem_queue_close(q);
    return NULL;
}

static void *dup_writer(void *arg)
{
    worker *w = arg;
    idem_queue *q = worker_queue(w, 8);
    if (!q) return NULL;
    int rc;
    idem_claim_args a = claim_args(TTL, LEASE, 0);
    for (int i = 0; !atomic_load(&g_dup_stop) && !w->err[0]; i++) {
        char key[32];
        idem_completion c;
        snprintf(key, sizeof key, "w-%d", i);
        rc = idem_claim(q, key, strlen(key), &a, &c);
        if (rc == IDEM_OK && c.outcome == IDEM_NEW)
            rc = idem_commit(q, key, strlen(key), c.token, "v", 1);
        else if (rc == IDEM_OK)
            WFAIL(w, "%s: outcome %s", key, idem_outcome_name(c.outcome));
        if (rc == IDEM_OK && i % 3 == 0) rc = idem_del(q, key, strlen(key), "test");
        if (rc == IDEM_OK && i % 16 == 0) rc = idem_clock_advance(g_s, 1);
        if (rc != IDEM_OK) WFAIL(w, "%s: %s", key, idem_strerror(rc));
    }
    idem_queue_close(q);
    return NULL;
}

Test(race, repeats_answered_by_many_threads_at_once_are_each_counted)
{
    static char keys[DUP_KEYS][16], res[DUP_KEYS][16];
    static idem_op ops[DUP_KEYS];
    static idem_completion out[DUP_KEYS];
    static uint64_t seen0[DUP_KEYS];
    for (int k = 0; k < DUP_KEYS; k++) {
        dup_key(keys[k], sizeof keys[k], k);
        snprintf(res[k], sizeof res[k], "res-%d", k);
        ops[k] = (idem_op){.kind = IDEM_OP_SET_IF_ABSENT,
                           .key = keys[k],
                           .key_len = (uint32_t)strlen(keys[k]),
                           .ttl_ms = TTL,
                           .data = res[k],
                           .data_len = (uint32_t)strlen(res[k])};
    }
    const char *why = run_async(g_q, ops, DUP_KEYS, out);
    cr_assert_null(why, "preload: %s", why);
    for (int k = 0; k < DUP_KEYS; k++) {
        cr_assert(out[k].err == IDEM_OK && out[k].outcome == IDEM_NEW, "preload of %s", keys[k]);
        idem_completion c;
        expect_rc(idem_get(g_q, keys[k], strlen(keys[k]), &c), IDEM_OK);
        seen0[k] = c.record.seen_count;
        atomic_store(&g_dup_claims[k], 0);
    }
    g_dup_rounds = tu_count(60, 600);
    uint64_t reads0 = store_test_reads(g_s);
    atomic_store(&g_dup_stop, 0);
    cr_assert_eq(pthread_barrier_init(&g_bar, NULL, DUP_READERS), 0);
    worker writer[1], readers[DUP_READERS];
    start_all(writer, 1, dup_writer);
    start_all(readers, DUP_READERS, dup_reader);
    for (size_t i = 0; i < DUP_READERS; i++)
        pthread_join(readers[i].th, NULL);
    atomic_store(&g_dup_stop, 1);
    join_all(writer, 1);
    pthread_barrier_destroy(&g_bar);
    for (size_t i = 0; i < DUP_READERS; i++)
        cr_assert_eq(readers[i].err[0], 0, "reader %zu: %s", i, readers[i].err);
    uint64_t claims = (uint64_t)DUP_READERS * g_dup_rounds * DUP_BATCH;
    uint64_t reads = store_test_reads(g_s) - reads0;
    /* Nearly all: a run of reads is left to the locked path when a second turns. */
    cr_assert_gt(reads, claims / 2, "%llu of %llu repeats answered by readers",
                 (unsigned long long)reads, (unsigned long long)claims);
    for (int pass = 0; pass < 2; pass++) {
        for (int k = 0; k < DUP_KEYS; k++) {
            idem_completion c;
            expect_rc(idem_get(g_q, keys[k], strlen(keys[k]), &c), IDEM_OK);
            uint64_t want = seen0[k] + atomic_load(&g_dup_claims[k]);
            cr_assert_eq(c.record.seen_count, want, "%s: seen_count %llu, %llu expected (%s)",
                         keys[k], (unsigned long long)c.record.seen_count, (unsigned long long)want,
                         pass ? "after a reopen" : "before a reopen");
        }
        store_close();
        store_open();
    }
    cr_assert_eq(store_check_index(g_s, NULL), IDEM_OK);
}

/* ------------------------------------------------------------------------------------------ */
/* Blocking calls and the async form, mixed across threads. */

#define MIX_THREADS 16
#define MIX_SHARED  24
#define MIX_OWN     48

static int g_mix_new[MIX_THREADS][MIX_SHARED];
static int64_t g_mix_tok[MIX_THREADS][MIX_SHARED];

static void mix_key(char *buf, size_t cap, int shared, int t, int i)
{
    if (shared)
        snprintf(buf, cap, "shared-%d", i);
    else
        snprintf(buf, cap, "own-%d-%d", t, i);
}

static void mix_blocking(worker *w, idem_queue *q)
{
    for (int j = 0; j < MIX_SHARED; j++) {
        int i = (j + w->idx) % MIX_SHARED; /* each thread starts elsewhere */
        char key[48], res[48];
        mix_key(key, sizeof key, 1, w->idx, i);
        snprintf(res, sizeof res, "by-%d", w->idx);
        idem_claim_args a = claim_args(TTL, LEASE, 0);
        idem_completion c;
        int rc = idem_claim(q, key, strlen(key), &a, &c);
        if (rc != IDEM_OK) {
            WFAIL(w, "%s: %s", key, idem_strerror(rc));
            return;
        }
        if (c.outcome == IDEM_NEW) {
            g_mix_new[w->idx][i] = 1;
            g_mix_tok[w->idx][i] = c.token;
            rc = idem_commit(q, key, strlen(key), c.token, res, strlen(res));
            if (rc != IDEM_OK) WFAIL(w, "%s: commit: %s", key, idem_strerror(rc));
        } else if (c.outcome != IDEM_BUSY && c.outcome != IDEM_DONE) {
            WFAIL(w, "%s: outcome %s", key, idem_outcome_name(c.outcome));
        }
    }
    for (int i = 0; i < MIX_OWN; i++) {
        char key[48];
        mix_key(key, sizeof key, 0, w->idx, i);
        idem_claim_args a = claim_args(TTL, LEASE, 0);
        idem_completion c;
        int rc = idem_claim(q, key, strlen(key), &a, &c);
        if (rc != IDEM_OK || c.outcome != IDEM_NEW) {
            WFAIL(w, "%s: rc %d outcome %s", key, rc, idem_outcome_name(c.outcome));
            return;
        }
        rc = idem_commit(q, key, strlen(key), c.token, key, strlen(key));
        if (rc != IDEM_OK) WFAIL(w, "%s: commit: %s", key, idem_strerror(rc));
    }
}

static void mix_async(worker *w, idem_queue *q)
{
    idem_op ops[MIX_OWN];
    idem_completion out[MIX_OWN];
    char keys[MIX_OWN][48];
    char res[48];
    snprintf(res, sizeof res, "by-%d", w->idx);
    /* Shared keys: claim all in one batch, then commit the ones won in a second batch. */
    memset(ops, 0, sizeof ops);
    for (int j = 0; j < MIX_SHARED; j++) {
        int i = (j + w->idx) % MIX_SHARED;
        mix_key(keys[j], sizeof keys[j], 1, w->idx, i);
        ops[j].kind = IDEM_OP_CLAIM;
        ops[j].key = keys[j];
        ops[j].key_len = (uint32_t)strlen(keys[j]);
        ops[j].ttl_ms = TTL;
        ops[j].lease_ms = LEASE;
    }
    const char *e = run_async(q, ops, MIX_SHARED, out);
    if (e) {
        WFAIL(w, "shared claims: %s", e);
        return;
    }
    size_t ncommit = 0;
    idem_op cops[MIX_SHARED];
    idem_completion cout[MIX_SHARED];
    memset(cops, 0, sizeof cops);
    for (int j = 0; j < MIX_SHARED; j++) {
        int i = (j + w->idx) % MIX_SHARED;
        if (out[j].err != IDEM_OK) {
            WFAIL(w, "%s: %s", keys[j], idem_strerror(out[j].err));
            return;
        }
        if (out[j].outcome == IDEM_NEW) {
            g_mix_new[w->idx][i] = 1;
            g_mix_tok[w->idx][i] = out[j].token;
            cops[ncommit].kind = IDEM_OP_COMMIT;
            cops[ncommit].key = keys[j];
            cops[ncommit].key_len = (uint32_t)strlen(keys[j]);
            cops[ncommit].token = out[j].token;
            cops[ncommit].data = res;
            cops[ncommit].data_len = (uint32_t)strlen(res);
            ncommit++;
        } else if (out[j].outcome != IDEM_BUSY && out[j].outcome != IDEM_DONE) {
            WFAIL(w, "%.200s: outcome %s", keys[j], idem_outcome_name(out[j].outcome));
        }
    }
    if (ncommit) {
        e = run_async(q, cops, ncommit, cout);
        if (e) {
            WFAIL(w, "shared commits: %s", e);
            return;
        }
        for (size_t j = 0; j < ncommit; j++)
            if (cout[j].err != IDEM_OK) WFAIL(w, "shared commit: %s", idem_strerror(cout[j].err));
    }
    /* Own keys: a batch of claims, then a batch of commits. */
    memset(ops, 0, sizeof ops);
    for (int i = 0; i < MIX_OWN; i++) {
        mix_key(keys[i], sizeof keys[i], 0, w->idx, i);
        ops[i].kind = IDEM_OP_CLAIM;
        ops[i].key = keys[i];
        ops[i].key_len = (uint32_t)strlen(keys[i]);
        ops[i].ttl_ms = TTL;
        ops[i].lease_ms = LEASE;
    }
    e = run_async(q, ops, MIX_OWN, out);
    if (e) {
        WFAIL(w, "own claims: %s", e);
        return;
    }
    for (int i = 0; i < MIX_OWN; i++) {
        if (out[i].err != IDEM_OK || out[i].outcome != IDEM_NEW) {
            WFAIL(w, "%s: err %d outcome %s", keys[i], out[i].err,
                  idem_outcome_name(out[i].outcome));
            return;
        }
        int64_t tok = out[i].token;
        memset(&ops[i], 0, sizeof ops[i]);
        ops[i].kind = IDEM_OP_COMMIT;
        ops[i].key = keys[i];
        ops[i].key_len = (uint32_t)strlen(keys[i]);
        ops[i].token = tok;
        ops[i].data = keys[i];
        ops[i].data_len = (uint32_t)strlen(keys[i]);
    }
    e = run_async(q, ops, MIX_OWN, out);
    if (e) {
        WFAIL(w, "own commits: %s", e);
        return;
    }
    for (int i = 0; i < MIX_OWN; i++)
        if (out[i].err != IDEM_OK)
            WFAIL(w, "%.200s: commit: %s", keys[i], idem_strerror(out[i].err));
}

static void *mix_worker(void *arg)
{
    worker *w = arg;
    idem_queue *q = NULL;
    int rc = idem_queue_open(g_s, 16, &q); /* smaller than a batch: submit must come back */
    if (rc != IDEM_OK) {
        WFAIL(w, "idem_queue_open: %s", idem_strerror(rc));
        return NULL;
    }
    pthread_barrier_wait(&g_bar);
    if (w->idx % 2)
        mix_async(w, q);
    else
        mix_blocking(w, q);
    idem_queue_close(q);
    return NULL;
}

Test(race, blocking_and_async_calls_mixed_across_threads)
{
    worker ws[MIX_THREADS];
    cr_assert_eq(pthread_barrier_init(&g_bar, NULL, MIX_THREADS), 0);
    start_all(ws, MIX_THREADS, mix_worker);
    join_all(ws, MIX_THREADS);
    pthread_barrier_destroy(&g_bar);
    for (int i = 0; i < MIX_SHARED; i++) {
        int news = 0, winner = -1;
        for (int t = 0; t < MIX_THREADS; t++) {
            if (g_mix_new[t][i]) {
                news++;
                winner = t;
            }
        }
        cr_assert_eq(news, 1, "shared-%d: %d threads got new", i, news);
        char key[48], res[48];
        mix_key(key, sizeof key, 1, 0, i);
        snprintf(res, sizeof res, "by-%d", winner);
        idem_completion c;
        expect_rc(idem_get(g_q, key, strlen(key), &c), IDEM_OK);
        cr_assert(c.found);
        cr_assert_eq(c.record.state, IDEM_STATE_COMMITTED);
        cr_assert_eq(c.record.result_len, strlen(res));
        cr_assert(memcmp(c.record.result, res, strlen(res)) == 0);
    }
    for (int t = 0; t < MIX_THREADS; t++) {
        for (int i = 0; i < MIX_OWN; i++) {
            char key[48];
            mix_key(key, sizeof key, 0, t, i);
            idem_claim_args a = claim_args(TTL, LEASE, 0);
            idem_completion c;
            expect_rc(idem_claim(g_q, key, strlen(key), &a, &c), IDEM_OK);
            cr_assert_eq(c.outcome, IDEM_DONE, "%s: %s", key, idem_outcome_name(c.outcome));
            cr_assert_eq(c.data_len, strlen(key));
            cr_assert(memcmp(c.data, key, strlen(key)) == 0);
        }
    }
}

Test(race, nothing_is_pending_after_blocking_calls_and_polled_completions)
{
    idem_queue *q;
    expect_rc(idem_queue_open(g_s, 8, &q), IDEM_OK);
    cr_assert_eq(idem_queue_pending(q), 0);
    idem_claim_args a = claim_args(TTL, LEASE, 0);
    idem_completion c;
    expect_rc(idem_claim(q, "k", 1, &a, &c), IDEM_OK);
    cr_assert_eq(idem_queue_pending(q), 0, "%u pending after a blocking claim",
                 idem_queue_pending(q));
    idem_op ops[3];
    idem_completion out[3];
    memset(ops, 0, sizeof ops);
    for (int i = 0; i < 3; i++) {
        ops[i].kind = IDEM_OP_GET;
        ops[i].key = "k";
        ops[i].key_len = 1;
    }
    cr_assert_eq(idem_submit(q, ops, 3), 3);
    cr_assert_eq(idem_queue_pending(q), 3);
    size_t got = 0;
    while (got < 3) {
        int n = idem_poll(q, out + got, 3 - got, 10000);
        cr_assert_gt(n, 0);
        got += (size_t)n;
    }
    cr_assert_eq(idem_queue_pending(q), 0, "%u pending after polling every completion",
                 idem_queue_pending(q));
    idem_queue_close(q);
}

/* The audit trail is read without the store's lock while the flusher appends to it: a reader
 * sees a whole prefix of the trail each time, newest first, never a damaged or partial entry,
 * and never fewer entries than it saw before. */
#define TRAIL_CALLS 400

static atomic_int trail_done;

static void *trail_reader(void *arg)
{
    worker *w = arg;
    idem_queue *q;
    if (idem_queue_open(g_s, 4, &q) != IDEM_OK) {
        WFAIL(w, "idem_queue_open failed");
        return NULL;
    }
    size_t seen = 0;
    int rounds = 0;
    while (!w->err[0]) {
        int last = atomic_load(&trail_done);
        int page = rounds % 3 == 2 && !last; /* the last read is a full one */
        const idem_audit_entry *e;
        size_t n = 0;
        int rc = page ? idem_audit_page(q, NULL, 0, 1 + (uint64_t)(rounds % 50), 10000, &e, &n)
                      : idem_audit(q, NULL, 0, 10000, &e, &n);
        if (rc != IDEM_OK) {
            WFAIL(w, "round %d: idem_audit: %s (%s)", rounds, idem_strerror(rc), idem_last_error());
            break;
        }
        for (size_t i = 0; i < n && !w->err[0]; i++) {
            char key[32];
            int len = snprintf(key, sizeof key, "trail-%" PRIu64, e[i].seq - 1);
            if (e[i].key_len != (uint32_t)len || memcmp(e[i].key, key, (size_t)len) ||
                strcmp(e[i].actor, "ops") || strcmp(e[i].reason, key + 6))
                WFAIL(w, "round %d: entry %zu (seq %" PRIu64 ") is not trail-%" PRIu64 "'s", rounds,
                      i, e[i].seq, e[i].seq - 1);
            if (i && e[i].seq + 1 != e[i - 1].seq)
                WFAIL(w, "round %d: seq %" PRIu64 " after %" PRIu64, rounds, e[i].seq,
                      e[i - 1].seq);
        }
        if (!page) {
            if (n < seen) WFAIL(w, "round %d: %zu entries after %zu", rounds, n, seen);
            seen = n;
        }
        rounds++;
        if (last) break;
    }
    if (!w->err[0] && seen != TRAIL_CALLS)
        WFAIL(w, "the last full read saw %zu entries of %d", seen, TRAIL_CALLS);
    idem_queue_close(q);
    return NULL;
}

Test(race, audit_trail_read_while_operator_calls_append_to_it)
{
    worker r = {.idx = 0};
    atomic_store(&trail_done, 0);
    cr_assert_eq(pthread_create(&r.th, NULL, trail_reader, &r), 0);
    idem_claim_args a = claim_args(TTL, LEASE, 0);
    for (int i = 0; i < TRAIL_CALLS; i++) {
        char key[32];
        snprintf(key, sizeof key, "trail-%d", i);
        idem_completion c;
        expect_rc(idem_claim(g_q, key, strlen(key), &a, &c), IDEM_OK);
        cr_assert_eq(c.outcome, IDEM_NEW);
        idem_op op = {.kind = IDEM_OP_RESOLVE,
                      .key = key,
                      .key_len = (uint32_t)strlen(key),
                      .data = key + 6,
                      .data_len = (uint32_t)strlen(key + 6),
                      .action = IDEM_RESOLVE_SETTLE,
                      .flags = IDEM_F_FORCE,
                      .actor = "ops"};
        expect_rc(idem_exec(g_q, &op, &c), IDEM_OK);
        cr_assert_eq(c.err, IDEM_OK, "resolve of %s: %s", key, idem_strerror(c.err));
    }
    atomic_store(&trail_done, 1);
    pthread_join(r.th, NULL);
    cr_assert_eq(r.err[0], 0, "%s", r.err);
}

/* Whether fd is readable now (poll, no wait). */
static int fd_readable(int fd)
{
    struct pollfd p = {.fd = fd, .events = POLLIN};
    int n = poll(&p, 1, 0);
    cr_assert_geq(n, 0, "poll: %s", strerror(errno));
    return n == 1 && (p.revents & POLLIN);
}

/* An event loop waits on the queue's fd: readable exactly while there is something to poll.
 * Readable with nothing to poll, the loop would wake at once, every time (idemd spun a core
 * from its start until its first engine operation). */
Test(race, queue_fd_is_readable_only_while_completions_wait)
{
    idem_queue *q;
    expect_rc(idem_queue_open(g_s, 8, &q), IDEM_OK);
    int fd = idem_queue_fd(q);
    cr_assert_geq(fd, 0);
    cr_assert_not(fd_readable(fd), "an idle queue's fd is readable");
    idem_op op = {
        .kind = IDEM_OP_CLAIM, .key = "fd-k", .key_len = 4, .ttl_ms = TTL, .lease_ms = LEASE};
    cr_assert_eq(idem_submit(q, &op, 1), 1);
    struct pollfd p = {.fd = fd, .events = POLLIN};
    cr_assert_eq(poll(&p, 1, 10000), 1, "no wake-up for a completed claim");
    idem_completion c;
    cr_assert_eq(idem_poll(q, &c, 1, 0), 1);
    cr_assert_eq(c.outcome, IDEM_NEW, "%s", idem_outcome_name(c.outcome));
    cr_assert_not(fd_readable(fd), "the fd stays readable after its completion was polled");
    idem_queue_close(q);

    /* Asked for after the completion is ready: readable at once. */
    expect_rc(idem_queue_open(g_s, 8, &q), IDEM_OK);
    op.kind = IDEM_OP_GET;
    cr_assert_eq(idem_submit(q, &op, 1), 1);
    idem_op sync = {.kind = IDEM_OP_SYNC};
    cr_assert_eq(idem_submit(q, &sync, 1), 1);
    expect_rc(idem_sync(g_s), IDEM_OK);
    fd = idem_queue_fd(q);
    cr_assert(fd_readable(fd), "completions were ready before the fd was asked for");
    idem_completion two[2];
    int got = 0;
    while (got < 2) {
        int n = idem_poll(q, two + got, (size_t)(2 - got), 10000);
        cr_assert_gt(n, 0);
        got += n;
    }
    cr_assert_eq(two[0].found, 1);
    cr_assert_not(fd_readable(fd));
    /* A blocking call leaves nothing to poll, and the fd says so: its completion, ready at
     * submit (the record is durable), signalled the fd. */
    idem_completion g;
    expect_rc(idem_get(q, "fd-k", 4, &g), IDEM_OK);
    cr_assert_eq(g.found, 1);
    cr_assert_not(fd_readable(fd), "a blocking call left the fd readable with nothing to poll");
    idem_queue_close(q);
}

/* The end of a flush wakes the threads waiting in idem_poll after it lets go of the store's
 * lock; a queue must not be closed (its condition destroyed) while that is under way. Threads
 * here open a queue, claim one key, poll with short timeouts (so some leave idem_poll on their
 * own, not woken), close the queue, and again. */
#define CHURN_THREADS 16
#define CHURN_ROUNDS  150

static void *queue_churner(void *arg)
{
    worker *w = arg;
    idem_claim_args a = claim_args(TTL, LEASE, 0);
    for (int r = 0; r < CHURN_ROUNDS && !w->err[0]; r++) {
        idem_queue *q;
        if (idem_queue_open(g_s, 2, &q) != IDEM_OK) {
            WFAIL(w, "round %d: idem_queue_open failed", r);
            break;
        }
        char key[48];
        snprintf(key, sizeof key, "churn-%d-%d", w->idx, r);
        idem_op op = {.kind = IDEM_OP_CLAIM,
                      .key = key,
                      .key_len = (uint32_t)strlen(key),
                      .ttl_ms = a.ttl_ms,
                      .lease_ms = a.lease_ms};
        idem_completion c;
        int n = idem_submit(q, &op, 1) == 1 ? 0 : -1;
        while (n == 0)
            n = idem_poll(q, &c, 1, r % 3); /* 0, 1 or 2 ms */
        if (n != 1 || c.err != IDEM_OK || c.outcome != IDEM_NEW)
            WFAIL(w, "round %d: %s: poll %d, err %d, outcome %d", r, key, n, n == 1 ? c.err : 0,
                  n == 1 ? c.outcome : 0);
        idem_queue_close(q);
    }
    return NULL;
}

Test(race, queues_closed_while_flushes_wake_their_threads)
{
    worker ws[CHURN_THREADS];
    start_all(ws, CHURN_THREADS, queue_churner);
    join_all(ws, CHURN_THREADS);
}

/* The same race made certain: each wake waits 100 ms after the lock is let go; the thread,
 * polling with a 20 ms timeout, collects its completion meanwhile and closes its queue. The close
 * must wait until the wake is over (the condition it would destroy is about to be signalled). */
static int64_t mono_us(void);

Test(race, a_queue_closes_only_after_the_wake_under_way)
{
    store_test_wake_delay(g_s, 100000);
    int waited = 0;
    for (int r = 0; r < 4; r++) {
        idem_queue *q;
        expect_rc(idem_queue_open(g_s, 2, &q), IDEM_OK);
        char key[32];
        snprintf(key, sizeof key, "wake-%d", r);
        idem_op op = {.kind = IDEM_OP_CLAIM,
                      .key = key,
                      .key_len = (uint32_t)strlen(key),
                      .ttl_ms = TTL,
                      .lease_ms = LEASE};
        cr_assert_eq(idem_submit(q, &op, 1), 1);
        idem_completion c;
        int n;
        while ((n = idem_poll(q, &c, 1, 20)) == 0)
            ;
        cr_assert_eq(n, 1);
        cr_assert_eq(c.err, IDEM_OK, "%s", idem_strerror(c.err));
        cr_assert_eq(c.outcome, IDEM_NEW);
        int64_t t0 = mono_us();
        idem_queue_close(q);
        waited += mono_us() - t0 > 30000;
        uint32_t notifying = __atomic_load_n(&g_s->notifying, __ATOMIC_ACQUIRE);
        cr_assert_eq(notifying, 0, "round %d: the queue closed while a wake was under way", r);
    }
    store_test_wake_delay(g_s, 0);
    cr_assert_gt(waited, 0, "no close met a wake under way: the test proves nothing");
}

/* The end of a flush wakes its blocked callers in a cascade (store.c, notify_ready_unlocked):
 * the flusher signals two, and each thread leaving idem_poll signals two more. A thread the
 * cascade skipped would sleep forever with its completion ready. 64 threads make every kind of
 * wait at once: blocking calls, idem_poll without a timeout, idem_poll with timeouts of 0-2 ms
 * (a wait that ends by itself must pass the cascade on too), and queues closed and opened again
 * between calls (a close while a waker holds the queue). Each call must come back (a stalled
 * cascade ends in the suite's timeout) with its own key's outcome, and every key is there
 * afterwards. */
#define CASCADE_THREADS 64

static size_t g_cascade_calls;

static void *cascade_worker(void *arg)
{
    worker *w = arg;
    idem_queue *q = NULL;
    int kind = w->idx % 4; /* 0, 1: idem_claim; 2: poll without timeout; 3: poll 0-2 ms */
    for (size_t i = 0; i < g_cascade_calls && !w->err[0]; i++) {
        if (!q && idem_queue_open(g_s, 4, &q) != IDEM_OK) {
            WFAIL(w, "idem_queue_open failed");
            break;
        }
        char key[48];
        snprintf(key, sizeof key, "cascade-%d-%zu", w->idx, i);
        idem_completion c;
        memset(&c, 0, sizeof c);
        int rc, n = 1;
        if (kind < 2) {
            idem_claim_args a = claim_args(TTL, LEASE, 0);
            rc = idem_claim(q, key, strlen(key), &a, &c);
        } else {
            idem_op op = {.kind = IDEM_OP_CLAIM,
                          .key = key,
                          .key_len = (uint32_t)strlen(key),
                          .ttl_ms = TTL,
                          .lease_ms = LEASE};
            rc = idem_submit(q, &op, 1) == 1 ? IDEM_OK : IDEM_EINVAL;
            n = 0;
            for (int tries = 0; rc == IDEM_OK && n == 0; tries++)
                n = idem_poll(q, &c, 1, kind == 2 ? -1 : tries % 3);
            rc = n == 1 ? c.err : rc;
        }
        if (rc != IDEM_OK || c.outcome != IDEM_NEW)
            WFAIL(w, "%s: rc %s, outcome %s", key, idem_strerror(rc), idem_outcome_name(c.outcome));
        if (i % 16 == (size_t)w->idx % 16) { /* close and open again, now and then */
            idem_queue_close(q);
            q = NULL;
        }
    }
    if (q) idem_queue_close(q);
    return NULL;
}

Test(race, sixty_four_threads_waiting_on_flushes_are_all_woken_in_the_cascade)
{
    worker ws[CASCADE_THREADS];
    g_cascade_calls = tu_count(40, 400);
    start_all(ws, CASCADE_THREADS, cascade_worker);
    join_all(ws, CASCADE_THREADS);
    store_lock(g_s);
    int listed = g_s->wake_head != NULL;
    uint32_t pins = __atomic_load_n(&g_s->notifying, __ATOMIC_ACQUIRE);
    store_unlock(g_s);
    cr_assert_not(listed, "a closed queue is still on the wake list");
    cr_assert_eq(pins, 0, "%u pins held after every queue closed", pins);
    idem_stats st;
    idem_get_stats(g_s, &st);
    cr_assert_eq(st.claims_new, CASCADE_THREADS * g_cascade_calls);
    for (int t = 0; t < CASCADE_THREADS; t += 7) {
        char key[48];
        snprintf(key, sizeof key, "cascade-%d-%zu", t, g_cascade_calls - 1);
        idem_completion c;
        expect_rc(idem_get(g_q, key, strlen(key), &c), IDEM_OK);
        cr_assert(c.found && c.record.state == IDEM_STATE_IN_FLIGHT, "%s", key);
    }
}

/* ------------------------------------------------------------------------------------------ */
/* An online backup holds changes back for one flush only; the copy holds what was acknowledged. */

#define BACKUP_FILL 16384 /* keys with 4 KiB results: about 64 MiB of log to copy */
#define LIVE_MAX    200000

static atomic_int g_live_stop;
static int64_t g_live_acked_us[LIVE_MAX]; /* when each live key's claim was acknowledged */
static atomic_int g_live_count;

static int64_t mono_us(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000 + ts.tv_nsec / 1000;
}

static void *live_claimer(void *arg)
{
    worker *w = arg;
    idem_queue *q;
    if (idem_queue_open(g_s, 4, &q) != IDEM_OK) {
        WFAIL(w, "idem_queue_open failed");
        return NULL;
    }
    idem_claim_args a = claim_args(TTL, LEASE, 0);
    for (int i = 0; i < LIVE_MAX && !atomic_load(&g_live_stop); i++) {
        char key[32];
        snprintf(key, sizeof key, "live-%d", i);
        idem_completion c;
        int rc = idem_claim(q, key, strlen(key), &a, &c);
        if (rc != IDEM_OK || c.outcome != IDEM_NEW) {
            WFAIL(w, "claim %s: %s, outcome %d", key, idem_strerror(rc), c.outcome);
            break;
        }
        g_live_acked_us[i] = mono_us();
        atomic_store(&g_live_count, i + 1);
    }
    idem_queue_close(q);
    return NULL;
}

Test(race, backup_goes_on_while_claims_are_acknowledged_and_holds_every_earlier_one)
{
    tu_fill_incompressible(g_q, BACKUP_FILL);
    worker w;
    memset(&w, 0, sizeof w);
    atomic_store(&g_live_stop, 0);
    atomic_store(&g_live_count, 0);
    cr_assert_eq(pthread_create(&w.th, NULL, live_claimer, &w), 0);
    while (atomic_load(&g_live_count) < 100) /* the claimer is running */
        usleep(1000);
    char dest[4200];
    snprintf(dest, sizeof dest, "%s", backup_dir_of(g_dir));
    int live_before = atomic_load(&g_live_count);
    int64_t t0 = mono_us();
    int rc = idem_backup(g_s, dest);
    int64_t t1 = mono_us();
    atomic_store(&g_live_stop, 1);
    join_all(&w, 1);
    cr_assert_eq(rc, IDEM_OK, "idem_backup: %s (%s)", idem_strerror(rc), idem_last_error());
    int live = atomic_load(&g_live_count), during = 0;
    for (int i = 0; i < live; i++)
        during += g_live_acked_us[i] > t0 && g_live_acked_us[i] < t1;
    /* Holding the store for the whole copy would let at most the claims already flushing at
     * its start through. */
    cr_assert_geq(during, 10, "%d claims acknowledged during a backup of %lld us", during,
                  (long long)(t1 - t0));

    idem_verify_report r;
    cr_assert_eq(idem_verify(dest, &r, NULL, NULL), IDEM_OK, "%s", idem_last_error());
    cr_assert_eq(r.errors, 0, "the backup fails verification: %s", r.first_error);
    idem_store *b;
    cr_assert_eq(idem_open(dest, &g_opts, &b), IDEM_OK, "%s", idem_last_error());
    idem_queue *bq;
    expect_rc(idem_queue_open(b, 4, &bq), IDEM_OK);
    for (int i = 0; i < BACKUP_FILL; i++) {
        char key[32];
        snprintf(key, sizeof key, "fill-%d", i);
        idem_completion c;
        expect_rc(idem_get(bq, key, strlen(key), &c), IDEM_OK);
        cr_assert(c.found && c.record.state == IDEM_STATE_COMMITTED, "%s not in the backup", key);
        cr_assert_eq(c.record.result_len, 4096, "%s", key);
    }
    int present = 0;
    for (int i = 0; i < live; i++) {
        char key[32];
        snprintf(key, sizeof key, "live-%d", i);
        idem_completion c;
        expect_rc(idem_get(bq, key, strlen(key), &c), IDEM_OK);
        if (i < live_before)
            cr_assert(c.found, "%s, acknowledged before the backup, is missing", key);
        if (c.found) cr_assert_eq(c.record.state, IDEM_STATE_IN_FLIGHT, "%s", key);
        /* The copy is one moment: a prefix of the claimer's sequence. */
        cr_assert(!c.found || present == i,
                  "%s is in the backup but live-%d is not (acked %lld us after the backup began, "
                  "which took %lld us; %d acked before it)",
                  key, present, (long long)(g_live_acked_us[present] - t0), (long long)(t1 - t0),
                  live_before);
        present += c.found;
    }
    idem_stats st;
    idem_get_stats(b, &st);
    cr_assert_eq(st.keys, (uint64_t)BACKUP_FILL + (uint64_t)present,
                 "keys %llu (in flight %llu, committed %llu), present %d",
                 (unsigned long long)st.keys, (unsigned long long)st.keys_in_flight,
                 (unsigned long long)st.keys_committed, present);
    idem_queue_close(bq);
    cr_assert_eq(idem_close(b), IDEM_OK);
}

static char g_backup_dest[4200];
static atomic_int g_backup_rc;

static void *backup_runner(void *arg)
{
    (void)arg;
    atomic_store(&g_backup_rc, idem_backup(g_s, g_backup_dest));
    return NULL;
}

/* Starts idem_backup of g_s beside g_dir (backup_dir_of) on a thread; returns once it is copying:
 * its partial directory is made (dest is named only once the copy is whole: waiting for it let
 * the tests close after the copy, not during it). */
static pthread_t backup_start(void)
{
    snprintf(g_backup_dest, sizeof g_backup_dest, "%s", backup_dir_of(g_dir));
    atomic_store(&g_backup_rc, 1);
    pthread_t th;
    cr_assert_eq(pthread_create(&th, NULL, backup_runner, NULL), 0);
    char partial[4300];
    snprintf(partial, sizeof partial, "%s.partial", g_backup_dest);
    struct stat st;
    while (stat(partial, &st) != 0 && stat(g_backup_dest, &st) != 0 &&
           atomic_load(&g_backup_rc) == 1)
        usleep(200);
    if (stat(g_backup_dest, &st) == 0) /* the test thread stood still for the whole copy */
        cr_skip_test("the copy was whole before the test could close during it");
    return th;
}

/* Joins the backup thread: the backup succeeded and the copy verifies; returns its index
 * entries. */
static uint64_t backup_finish(pthread_t th)
{
    pthread_join(th, NULL);
    cr_assert_eq(atomic_load(&g_backup_rc), IDEM_OK, "idem_backup: %s",
                 idem_strerror(atomic_load(&g_backup_rc)));
    idem_verify_report r;
    cr_assert_eq(idem_verify(g_backup_dest, &r, NULL, NULL), IDEM_OK, "%s", idem_last_error());
    cr_assert_eq(r.errors, 0, "the backup fails verification: %s", r.first_error);
    return r.index_entries;
}

/* Close while a backup copies, in durability none: close waits for the copy (which needs the
 * flusher to make its start durable and the store to read from) and then closes cleanly; the
 * copy and the store both hold what was written before. Close used to let the flusher exit
 * under the backup's wait, and hung. */
Test(race, close_during_a_backup_waits_for_it_without_durability)
{
    store_close();
    g_opts.durability = IDEM_DURABILITY_NONE;
    store_open();
    tu_fill_incompressible(g_q, BACKUP_FILL);
    pthread_t th = backup_start();
    for (int i = 0; i < 10; i++) { /* written during the copy, not flushed (mode none) */
        char key[32];
        snprintf(key, sizeof key, "late-%d", i);
        idem_completion c;
        expect_rc(idem_set_if_absent(g_q, key, strlen(key), "v", 1, TTL, 0, &c), IDEM_OK);
    }
    usleep(50000); /* the flusher writes them, without a flush: durable < last */
    store_close();
    backup_finish(th);
    store_open();
    idem_stats s;
    idem_get_stats(g_s, &s);
    cr_assert_eq(s.keys, BACKUP_FILL + 10, "keys %llu", (unsigned long long)s.keys);
}

/* The same on a read-only store: close skips the checkpoint there, and used to free the store
 * under the copy. */
Test(race, close_during_a_backup_of_a_read_only_store_waits_for_it)
{
    tu_fill_incompressible(g_q, BACKUP_FILL);
    store_close();
    g_opts.read_only = 1;
    store_open();
    pthread_t th = backup_start();
    store_close();
    cr_assert_eq(backup_finish(th), BACKUP_FILL);
}

/* idem_checkpoint takes a checkpoint in steps: claims go on being acknowledged while it scans
 * two million keys (the checkpoint used to hold every change back for the whole scan). The scan
 * takes 200-300 ms in a Debug build here (360-750 claims acknowledged meanwhile), so a claiming
 * thread the scheduler leaves out for a while on two busy cores still sees ten of them: with half
 * a million keys, a 20 ms scan under load once saw 3. */
Test(race, explicit_checkpoint_lets_claims_go_on, .timeout = 120)
{
    enum { KEYS = 2000000 };
    static idem_op ops[4096];
    static idem_completion out[4096];
    static char keyv[4096][24];
    for (int base = 0; base < KEYS; base += 4096) {
        int n = KEYS - base < 4096 ? KEYS - base : 4096;
        for (int i = 0; i < n; i++) {
            snprintf(keyv[i], sizeof keyv[i], "small-%d", base + i);
            ops[i] = (idem_op){.kind = IDEM_OP_SET_IF_ABSENT,
                               .key = keyv[i],
                               .key_len = (uint32_t)strlen(keyv[i]),
                               .ttl_ms = TTL,
                               .data = "v",
                               .data_len = 1};
        }
        idem_queue *q;
        expect_rc(idem_queue_open(g_s, 4096, &q), IDEM_OK);
        const char *err = run_async(q, ops, (size_t)n, out);
        idem_queue_close(q);
        cr_assert_null(err, "%s", err);
    }
    worker w;
    memset(&w, 0, sizeof w);
    atomic_store(&g_live_stop, 0);
    atomic_store(&g_live_count, 0);
    cr_assert_eq(pthread_create(&w.th, NULL, live_claimer, &w), 0);
    while (atomic_load(&g_live_count) < 50)
        usleep(1000);
    idem_stats before, after;
    idem_get_stats(g_s, &before);
    int64_t t0 = mono_us();
    expect_rc(idem_checkpoint(g_s), IDEM_OK);
    int64_t t1 = mono_us();
    atomic_store(&g_live_stop, 1);
    join_all(&w, 1);
    idem_get_stats(g_s, &after);
    cr_assert_gt(after.checkpoints, before.checkpoints);
    int live = atomic_load(&g_live_count), during = 0;
    for (int i = 0; i < live; i++)
        during += g_live_acked_us[i] > t0 && g_live_acked_us[i] < t1;
    cr_assert_geq(during, 10, "%d claims acknowledged during a checkpoint of %lld us", during,
                  (long long)(t1 - t0));
    /* Everything is there after a restart from that checkpoint. */
    store_close();
    store_open();
    idem_stats st;
    idem_get_stats(g_s, &st);
    cr_assert_eq(st.keys, (uint64_t)KEYS + (uint64_t)live);
}

/* ------------------------------------------------------------------------------------------ */
/* Claims with WAIT (real time), woken by the owner's call, a lease running out, or ms passing. */

#define WAITERS 4

static idem_queue *g_wq[WAITERS];

static void open_waiters(void)
{
    for (int i = 0; i < WAITERS; i++)
        expect_rc(idem_queue_open(g_s, 4, &g_wq[i]), IDEM_OK);
}

static void close_waiters(void)
{
    for (int i = 0; i < WAITERS; i++) {
        if (g_wq[i]) idem_queue_close(g_wq[i]);
        g_wq[i] = NULL;
    }
}

static void wait_teardown(void)
{
    close_waiters();
    teardown();
}

TestSuite(wait, .init = setup, .fini = wait_teardown, .timeout = 120);

static void submit_wait_claim(idem_queue *q, const char *key, uint32_t wait_ms, uint64_t ud)
{
    idem_op op;
    memset(&op, 0, sizeof op);
    op.kind = IDEM_OP_CLAIM;
    op.key = key;
    op.key_len = (uint32_t)strlen(key);
    op.ttl_ms = TTL;
    op.lease_ms = LEASE;
    op.wait_ms = wait_ms;
    op.user_data = ud;
    cr_assert_eq(idem_submit(q, &op, 1), 1);
}

/* Polls q without waiting; returns 1 and fills *c if a completion was ready. */
static int poll_now(idem_queue *q, idem_completion *c)
{
    int n = idem_poll(q, c, 1, 0);
    cr_assert_geq(n, 0, "idem_poll: %s", idem_strerror(n));
    return n;
}

/* Waits (by polling, up to 20 s real time) for the first completion on any of the waiters
 * still open; returns its index. */
static int first_woken(const int *open, idem_completion *c)
{
    for (int round = 0; round < 2000; round++) {
        for (int i = 0; i < WAITERS; i++) {
            if (!open[i]) continue;
            int n = idem_poll(g_wq[i], c, 1, 10);
            cr_assert_geq(n, 0);
            if (n == 1) return i;
        }
    }
    cr_assert_fail("no waiter woke within 20 s");
    return -1;
}

static int64_t claim_new_on(idem_queue *q, const char *key)
{
    idem_claim_args a = claim_args(TTL, LEASE, 0);
    idem_completion c;
    expect_rc(idem_claim(q, key, strlen(key), &a, &c), IDEM_OK);
    cr_assert_eq(c.outcome, IDEM_NEW);
    return c.token;
}

Test(wait, waiting_claim_answers_done_when_the_owner_commits)
{
    open_waiters();
    int64_t tok = claim_new_on(g_q, "k");
    submit_wait_claim(g_wq[0], "k", 20000, 7);
    idem_completion c;
    cr_assert_eq(poll_now(g_wq[0], &c), 0, "a waiting claim answered at once: %s",
                 idem_outcome_name(c.outcome));
    expect_rc(idem_commit(g_q, "k", 1, tok, "inv", 3), IDEM_OK);
    cr_assert_eq(idem_poll(g_wq[0], &c, 1, 20000), 1, "the waiter was not woken by commit");
    cr_assert_eq(c.user_data, 7);
    cr_assert_eq(c.err, IDEM_OK);
    cr_assert_eq(c.outcome, IDEM_DONE, "outcome %s", idem_outcome_name(c.outcome));
    cr_assert_eq(c.data_len, 3);
    cr_assert(memcmp(c.data, "inv", 3) == 0);
}

Test(wait, release_wakes_exactly_one_waiter_with_new_the_others_wait_on_it)
{
    open_waiters();
    int64_t tok = claim_new_on(g_q, "k");
    for (int i = 0; i < WAITERS; i++)
        submit_wait_claim(g_wq[i], "k", 20000, (uint64_t)i);
    idem_completion c;
    for (int i = 0; i < WAITERS; i++)
        cr_assert_eq(poll_now(g_wq[i], &c), 0);
    expect_rc(idem_release(g_q, "k", 1, tok), IDEM_OK);
    int open[WAITERS] = {1, 1, 1, 1};
    int w = first_woken(open, &c);
    cr_assert_eq(c.outcome, IDEM_NEW, "first woken waiter: %s", idem_outcome_name(c.outcome));
    cr_assert_gt(c.token, tok);
    int64_t t2 = c.token;
    open[w] = 0;
    /* The others still wait: on the new owner now. */
    for (int i = 0; i < WAITERS; i++)
        if (open[i])
            cr_assert_eq(poll_now(g_wq[i], &c), 0, "waiter %d answered %s", i,
                         idem_outcome_name(c.outcome));
    expect_rc(idem_commit(g_wq[w], "k", 1, t2, "second", 6), IDEM_OK);
    for (int i = 0; i < WAITERS; i++) {
        if (!open[i]) continue;
        cr_assert_eq(idem_poll(g_wq[i], &c, 1, 20000), 1);
        cr_assert_eq(c.outcome, IDEM_DONE, "waiter %d: %s", i, idem_outcome_name(c.outcome));
        cr_assert_eq(c.data_len, 6);
    }
}

Test(wait, hold_wakes_waiters_with_review)
{
    open_waiters();
    int64_t tok = claim_new_on(g_q, "k");
    submit_wait_claim(g_wq[0], "k", 20000, 0);
    submit_wait_claim(g_wq[1], "k", 20000, 1);
    expect_rc(idem_hold(g_q, "k", 1, tok, "unsure", 6), IDEM_OK);
    for (int i = 0; i < 2; i++) {
        idem_completion c;
        cr_assert_eq(idem_poll(g_wq[i], &c, 1, 20000), 1);
        cr_assert_eq(c.outcome, IDEM_REVIEW, "waiter %d: %s", i, idem_outcome_name(c.outcome));
        cr_assert_eq(c.data_len, 6);
        cr_assert(memcmp(c.data, "unsure", 6) == 0);
    }
}

Test(wait, lease_running_out_wakes_one_waiter_with_recover)
{
    open_waiters();
    int64_t tok = claim_new_on(g_q, "k");
    int64_t t0 = idem_clock_now(g_s);
    submit_wait_claim(g_wq[0], "k", 20000, 0);
    submit_wait_claim(g_wq[1], "k", 20000, 1);
    idem_completion c;
    expect_rc(idem_clock_advance(g_s, LEASE - 1), IDEM_OK);
    cr_assert_eq(idem_poll(g_wq[0], &c, 1, 50), 0, "woken before the lease ran out");
    expect_rc(idem_clock_advance(g_s, 1), IDEM_OK);
    int open[WAITERS] = {1, 1, 0, 0};
    int w = first_woken(open, &c);
    cr_assert_eq(c.outcome, IDEM_RECOVER, "woken waiter: %s", idem_outcome_name(c.outcome));
    cr_assert_eq(c.attempts, 2);
    cr_assert_eq(c.last_grant_ms, t0);
    cr_assert_gt(c.token, tok);
    int64_t t2 = c.token;
    int other = 1 - w;
    cr_assert_eq(poll_now(g_wq[other], &c), 0, "the other waiter answered %s",
                 idem_outcome_name(c.outcome));
    expect_rc(idem_commit(g_q, "k", 1, tok, "late", 4), IDEM_ESTALE);
    expect_rc(idem_commit(g_wq[w], "k", 1, t2, "ok", 2), IDEM_OK);
    cr_assert_eq(idem_poll(g_wq[other], &c, 1, 20000), 1);
    cr_assert_eq(c.outcome, IDEM_DONE);
}

static int64_t real_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

/* WAIT counts real time: the blocking claim answers busy after its 100 ms, not at once. */
Test(wait, waiting_claim_answers_busy_when_its_time_passes)
{
    open_waiters();
    claim_new_on(g_q, "k");
    idem_claim_args a = claim_args(TTL, LEASE, 100);
    idem_completion c;
    int64_t t0 = real_ms();
    expect_rc(idem_claim(g_wq[0], "k", 1, &a, &c), IDEM_OK);
    int64_t waited = real_ms() - t0;
    cr_assert_eq(c.outcome, IDEM_BUSY, "%s", idem_outcome_name(c.outcome));
    cr_assert_geq(waited, 99, "answered busy after %lld ms of a 100 ms WAIT", (long long)waited);
    cr_assert_eq(c.lease_left_ms, LEASE, "the test clock stood still");
}

/* Claims of new keys, always a batch in flight, until *stop: the flusher finds a batch to
 * flush at every round. */
static void *steady_writer(void *arg)
{
    atomic_int *stop = arg;
    idem_queue *q;
    if (idem_queue_open(g_s, 1024, &q) != IDEM_OK) return (void *)1;
    char(*keys)[24] = calloc(1024, 24);
    if (!keys) return (void *)1;
    idem_op ops[256];
    idem_completion c[256];
    uint64_t n = 0;
    long bad = 0;
    while (!atomic_load(stop) && !bad) {
        for (int i = 0; i < 256; i++, n++) {
            snprintf(keys[n % 1024], sizeof keys[0], "steady-%p-%llu", (void *)keys,
                     (unsigned long long)n);
            memset(&ops[i], 0, sizeof ops[i]);
            ops[i].kind = IDEM_OP_CLAIM;
            ops[i].key = keys[n % 1024];
            ops[i].key_len = (uint32_t)strlen(keys[n % 1024]);
            ops[i].ttl_ms = TTL;
            ops[i].lease_ms = LEASE;
        }
        int done = 0;
        while (done < 256 && !bad) {
            int k = idem_submit(q, ops + done, (size_t)(256 - done));
            if (k > 0) done += k;
            int got = idem_poll(q, c, 256, k > 0 ? 0 : 10);
            bad = got < 0 || k < 0;
        }
    }
    while (!bad && idem_poll(q, c, 256, 100) > 0) {
    }
    idem_queue_close(q);
    free(keys);
    return (void *)bad;
}

/* A WAIT deadline passes on time while other claims keep the flusher busy at every round (it
 * used to look at deadlines only in a round with nothing to flush). */
Test(wait, a_wait_deadline_passes_while_writes_keep_the_flusher_busy)
{
    open_waiters();
    claim_new_on(g_q, "k");
    atomic_int stop = 0;
    pthread_t t[2];
    for (int i = 0; i < 2; i++)
        cr_assert_eq(pthread_create(&t[i], NULL, steady_writer, &stop), 0);
    usleep(100 * 1000); /* the writers are under way */
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    submit_wait_claim(g_wq[0], "k", 300, 5);
    idem_completion c;
    int n = idem_poll(g_wq[0], &c, 1, 10000); /* the fault: no answer while the writes go on */
    clock_gettime(CLOCK_MONOTONIC, &t1);
    atomic_store(&stop, 1);
    for (int i = 0; i < 2; i++) {
        void *bad;
        pthread_join(t[i], &bad);
        cr_assert_null(bad, "a writer failed");
    }
    fprintf(stderr, "wait: answered after %lld ms\n",
            (long long)((t1.tv_sec - t0.tv_sec) * 1000 + (t1.tv_nsec - t0.tv_nsec) / 1000000));
    int64_t ms = (t1.tv_sec - t0.tv_sec) * 1000 + (t1.tv_nsec - t0.tv_nsec) / 1000000;
    cr_assert_eq(n, 1, "the waiting claim was not answered within 10 s of writes");
    cr_assert_eq(c.outcome, IDEM_BUSY, "%s", idem_outcome_name(c.outcome));
    cr_assert_lt(ms, 5000, "answered after %lld ms, its wait was 300 ms", (long long)ms);
}

static void *blocking_waiter(void *arg)
{
    worker *w = arg;
    idem_claim_args a = claim_args(TTL, LEASE, 20000);
    idem_completion c;
    memset(&c, 0, sizeof c);
    int rc = idem_claim(g_wq[w->idx], "k", 1, &a, &c);
    if (rc != IDEM_OK)
        WFAIL(w, "idem_claim: %s", idem_strerror(rc));
    else if (c.outcome != IDEM_DONE)
        WFAIL(w, "blocking waiter: %s", idem_outcome_name(c.outcome));
    else if (c.data_len != 1 || memcmp(c.data, "r", 1) != 0)
        WFAIL(w, "blocking waiter: done with another result");
    return NULL;
}

Test(wait, blocking_waiters_in_other_threads_and_an_async_waiter_see_the_commit)
{
    open_waiters();
    int64_t tok = claim_new_on(g_q, "k");
    submit_wait_claim(g_wq[0], "k", 20000, 0);
    worker ws[WAITERS - 1];
    memset(ws, 0, sizeof ws);
    for (int i = 0; i < WAITERS - 1; i++) {
        ws[i].idx = i + 1;
        cr_assert_eq(pthread_create(&ws[i].th, NULL, blocking_waiter, &ws[i]), 0);
    }
    /* Every waiter parks before the commit (each one's first run counts a repeat of the key):
     * the commit is what wakes them, not a claim made after it. */
    idem_stats before, st;
    idem_get_stats(g_s, &before);
    idem_completion g;
    for (int i = 0; i < 10000; i++) {
        expect_rc(idem_get(g_q, "k", 1, &g), IDEM_OK);
        if (g.record.seen_count >= 1 + WAITERS) break;
        usleep(1000);
    }
    cr_assert_eq(g.record.seen_count, 1 + WAITERS, "%llu of %d waiters parked",
                 (unsigned long long)g.record.seen_count - 1, WAITERS);
    expect_rc(idem_commit(g_q, "k", 1, tok, "r", 1), IDEM_OK);
    join_all(ws, WAITERS - 1);
    idem_completion c;
    cr_assert_eq(idem_poll(g_wq[0], &c, 1, 20000), 1);
    cr_assert_eq(c.outcome, IDEM_DONE);
    /* Each counted once, by the outcome it was answered with: not busy as it parked too. */
    idem_get_stats(g_s, &st);
    cr_assert_eq(st.claims_done - before.claims_done, WAITERS);
    cr_assert_eq(st.claims_busy, before.claims_busy);
}

/* A cancelled waiter (its caller is gone) answers busy, alone: the other waiters do not run
 * again for it, and their re-runs are not counted as claims. */
Test(wait, a_cancel_answers_only_the_cancelled_waiter)
{
    open_waiters();
    claim_new_on(g_q, "k");
    for (int i = 0; i < WAITERS; i++)
        submit_wait_claim(g_wq[i], "k", 20000, (uint64_t)i);
    idem_stats before, after;
    idem_get_stats(g_s, &before);
    expect_rc(idem_cancel_wait(g_wq[0], 0), IDEM_OK);
    expect_rc(idem_cancel_wait(g_wq[0], 0), IDEM_ENOTFOUND);
    idem_completion c;
    cr_assert_eq(idem_poll(g_wq[0], &c, 1, 5000), 1);
    cr_assert_eq(c.outcome, IDEM_BUSY, "%s", idem_outcome_name(c.outcome));
    cr_assert_eq(c.lease_left_ms, LEASE);
    for (int i = 1; i < WAITERS; i++)
        cr_assert_eq(poll_now(g_wq[i], &c), 0, "waiter %d answered %s", i,
                     idem_outcome_name(c.outcome));
    idem_get_stats(g_s, &after);
    cr_assert_eq(after.claims_busy, before.claims_busy + 1,
                 "the cancelled claim counts busy once; the others' re-runs are not claims");
}

/* Claims that share a user_data are cancelled oldest first, one a call, whatever their keys. */
Test(wait, claims_of_one_user_data_are_cancelled_oldest_first)
{
    open_waiters();
    idem_claim_args a = claim_args(TTL, LEASE, 0), b = claim_args(TTL, LEASE / 2, 0);
    idem_completion c;
    expect_rc(idem_claim(g_q, "a", 1, &a, &c), IDEM_OK);
    expect_rc(idem_claim(g_q, "b", 1, &b, &c), IDEM_OK);
    submit_wait_claim(g_wq[0], "b", 20000, 7);
    submit_wait_claim(g_wq[0], "a", 20000, 7);
    expect_rc(idem_cancel_wait(g_wq[0], 7), IDEM_OK);
    cr_assert_eq(idem_poll(g_wq[0], &c, 1, 5000), 1);
    cr_assert_eq(c.lease_left_ms, LEASE / 2, "the claim of b, parked first, was not the one");
    expect_rc(idem_cancel_wait(g_wq[0], 7), IDEM_OK);
    cr_assert_eq(idem_poll(g_wq[0], &c, 1, 5000), 1);
    cr_assert_eq(c.lease_left_ms, LEASE);
    expect_rc(idem_cancel_wait(g_wq[0], 7), IDEM_ENOTFOUND);
}

/* A cancel finds the claim parked with its user_data, whatever else of the queue was parked,
 * answered or parked again since: not one answered already (its slot may be reused), and not
 * one whose slot once had that user_data. */
Test(wait, a_cancel_finds_its_claim_among_those_answered_and_parked_again)
{
    idem_queue *q;
    expect_rc(idem_queue_open(g_s, 6, &q), IDEM_OK); /* polled slots are freed a poll late */
    int64_t tok[4];
    char key[4][2] = {"a", "b", "c", "d"};
    for (int i = 0; i < 4; i++) {
        tok[i] = claim_new_on(g_q, key[i]);
        submit_wait_claim(q, key[i], 20000, (uint64_t)(10 + i));
    }
    idem_completion c;
    for (int i = 1; i <= 2; i++) { /* the middle two answered by their keys' commits */
        expect_rc(idem_commit(g_q, key[i], 1, tok[i], "r", 1), IDEM_OK);
        cr_assert_eq(idem_poll(q, &c, 1, 5000), 1);
        cr_assert_eq(c.user_data, (uint64_t)(10 + i));
        cr_assert_eq(c.outcome, IDEM_DONE, "%s", idem_outcome_name(c.outcome));
    }
    expect_rc(idem_cancel_wait(q, 11), IDEM_ENOTFOUND);
    expect_rc(idem_cancel_wait(q, 12), IDEM_ENOTFOUND);
    submit_wait_claim(q, "a", 20000, 12); /* a freed slot, parked again under 12 */
    submit_wait_claim(q, "d", 20000, 20);
    const uint64_t order[4] = {13, 12, 10, 20};
    for (int i = 0; i < 4; i++) {
        expect_rc(idem_cancel_wait(q, order[i]), IDEM_OK);
        cr_assert_eq(idem_poll(q, &c, 1, 5000), 1);
        cr_assert_eq(c.user_data, order[i]);
        cr_assert_eq(c.outcome, IDEM_BUSY, "%s", idem_outcome_name(c.outcome));
        expect_rc(idem_cancel_wait(q, order[i]), IDEM_ENOTFOUND);
    }
    cr_assert_eq(poll_now(q, &c), 0);
    idem_queue_close(q);
}

static _Atomic int64_t g_wait_mono = 5000000;

static int64_t wait_mono_ms(void *ctx)
{
    (void)ctx;
    return atomic_load(&g_wait_mono);
}

/* A store of its own whose elapsed time comes from g_wait_mono, with the waiters' queues. */
static void open_waiters_on_moved_clock(void)
{
    static const idem_clock_source clock = {.monotonic_ms = wait_mono_ms};
    teardown();
    g_dir = tu_mkdtemp("threads");
    idem_options_init(&g_opts);
    g_opts.clock = &clock;
    store_open();
    open_waiters();
}

/* A waiter cancelled after the lease it waits on has run out, before any wake-up ran it, is
 * never granted the key: its caller is gone, and a recover for it would leave a token no one
 * holds and the key blocked for a whole lease. (Elapsed time from a clock the test moves: the
 * flusher, asleep until the lease end by the real clock, does not see the jump at once.) */
Test(wait, a_cancelled_waiter_is_never_granted_the_key)
{
    open_waiters_on_moved_clock();
    idem_claim_args a = claim_args(TTL, 30000, 0);
    idem_completion c;
    expect_rc(idem_claim(g_q, "k", 1, &a, &c), IDEM_OK);
    cr_assert_eq(c.outcome, IDEM_NEW);
    submit_wait_claim(g_wq[0], "k", 20000, 9);
    usleep(50000); /* the flusher has run its round for the park and sleeps */
    atomic_fetch_add(&g_wait_mono, 40000);
    int rc = idem_cancel_wait(g_wq[0], 9);
    if (rc == IDEM_ENOTFOUND) cr_skip_test("the flusher woke the waiter before the cancel");
    expect_rc(rc, IDEM_OK);
    cr_assert_eq(idem_poll(g_wq[0], &c, 1, 5000), 1);
    cr_assert_eq(c.outcome, IDEM_BUSY, "the gone waiter got %s", idem_outcome_name(c.outcome));
    idem_claim_args b = claim_args(TTL, 30000, 0);
    expect_rc(idem_claim(g_q, "k", 1, &b, &c), IDEM_OK);
    cr_assert_eq(c.outcome, IDEM_RECOVER, "the next claimer: %s", idem_outcome_name(c.outcome));
}

/* A lease made shorter (extend, or the owner's claim again with a shorter lease) moves the
 * moment the claims parked on the key may recover it: they used to keep the end they parked
 * with (30 s here) and recover the key only at their own deadline. (Elapsed time from a clock
 * the test moves, as above.) */
Test(wait, a_lease_made_shorter_ends_the_wait_at_its_new_end)
{
    open_waiters_on_moved_clock();
    for (int way = 0; way < 2; way++) {
        const char *key = way ? "reclaimed" : "extended";
        uint32_t len = (uint32_t)strlen(key);
        idem_claim_args a = claim_args(TTL, 30000, 0);
        a.owner = "w";
        a.owner_len = 1;
        idem_completion c;
        expect_rc(idem_claim(g_q, key, len, &a, &c), IDEM_OK);
        cr_assert_eq(c.outcome, IDEM_NEW);
        int64_t tok = c.token;
        submit_wait_claim(g_wq[way], key, 20000, 40 + (uint64_t)way);
        cr_assert_eq(poll_now(g_wq[way], &c), 0, "%s: answered at once", key);
        if (way) {
            a.lease_ms = 200;
            expect_rc(idem_claim(g_q, key, len, &a, &c), IDEM_OK);
            cr_assert_eq(c.outcome, IDEM_NEW, "the owner's claim again: %s",
                         idem_outcome_name(c.outcome));
        } else {
            expect_rc(idem_extend(g_q, key, len, tok, 200), IDEM_OK);
        }
        atomic_fetch_add(&g_wait_mono, 300);
        cr_assert_eq(idem_poll(g_wq[way], &c, 1, 5000), 1,
                     "%s: the waiter still waits on the lease's old end", key);
        cr_assert_eq(c.user_data, 40 + (uint64_t)way);
        cr_assert_eq(c.outcome, IDEM_RECOVER, "%s: %s", key, idem_outcome_name(c.outcome));
    }
}

/* Parked claims re-run after a release, in arrival order: B (owner x) gets new with a lease of
 * 30 s, C (owner y) parks again with that end, then A (owner x as well, lease 200 ms) resumes
 * x's claim and makes the lease end sooner. C used to keep the 30 s end it had noted and recover
 * the key only at its own deadline. (Elapsed time from a clock the test moves, as above.) */
Test(wait, a_lease_made_shorter_by_a_woken_owner_ends_the_others_wait)
{
    open_waiters_on_moved_clock();
    idem_claim_args a = claim_args(TTL, 30000, 0);
    idem_completion c;
    expect_rc(idem_claim(g_q, "k", 1, &a, &c), IDEM_OK);
    cr_assert_eq(c.outcome, IDEM_NEW);
    int64_t tok = c.token;
    static const struct {
        const char *owner;
        uint64_t lease_ms;
    } w[3] = {{"x", 30000}, {"y", 30000}, {"x", 200}};
    for (int i = 0; i < 3; i++) {
        idem_op op;
        memset(&op, 0, sizeof op);
        op.kind = IDEM_OP_CLAIM;
        op.key = "k";
        op.key_len = 1;
        op.ttl_ms = TTL;
        op.lease_ms = w[i].lease_ms;
        op.owner = w[i].owner;
        op.owner_len = 1;
        op.wait_ms = 20000;
        op.user_data = 70 + (uint64_t)i;
        cr_assert_eq(idem_submit(g_wq[i], &op, 1), 1);
        cr_assert_eq(poll_now(g_wq[i], &c), 0, "waiter %d answered at once", i);
    }
    expect_rc(idem_release(g_q, "k", 1, tok), IDEM_OK);
    cr_assert_eq(idem_poll(g_wq[0], &c, 1, 5000), 1);
    cr_assert_eq(c.outcome, IDEM_NEW, "B: %s", idem_outcome_name(c.outcome));
    cr_assert_eq(idem_poll(g_wq[2], &c, 1, 5000), 1);
    cr_assert_eq(c.outcome, IDEM_NEW, "A resumes x's claim: %s", idem_outcome_name(c.outcome));
    cr_assert_eq(poll_now(g_wq[1], &c), 0, "C answered before the lease ran out");
    atomic_fetch_add(&g_wait_mono, 300);
    cr_assert_eq(idem_poll(g_wq[1], &c, 1, 5000), 1, "C still waits on the lease's old end");
    cr_assert_eq(c.user_data, 71);
    cr_assert_eq(c.outcome, IDEM_RECOVER, "C: %s", idem_outcome_name(c.outcome));
}

/* Parked claims keep their fingerprint as its digest, not the content it was made from: a
 * thousand waiters with megabyte fingerprints must not hold gigabytes. The digest still decides
 * done against mismatch when they wake. */
Test(wait, parked_claims_keep_the_digest_of_a_large_fingerprint)
{
    enum { N = 32, FP = 1 << 20 };
    char *fp = malloc(FP), *other = malloc(FP);
    cr_assert(fp && other);
    memset(fp, 'f', FP);
    memcpy(other, fp, FP);
    other[FP - 1] = 'g';
    idem_queue *q;
    expect_rc(idem_queue_open(g_s, N + 1, &q), IDEM_OK);
    idem_claim_args a = claim_args(TTL, LEASE, 0);
    a.fp = fp;
    a.fp_len = FP;
    idem_completion c;
    expect_rc(idem_claim(g_q, "k", 1, &a, &c), IDEM_OK);
    cr_assert_eq(c.outcome, IDEM_NEW);
    int64_t tok = c.token;
    idem_op ops[N];
    for (int i = 0; i < N; i++)
        ops[i] = (idem_op){.kind = IDEM_OP_CLAIM,
                           .key = "k",
                           .key_len = 1,
                           .ttl_ms = TTL,
                           .lease_ms = LEASE,
                           .wait_ms = 20000,
                           .fp = i ? fp : other,
                           .fp_len = FP,
                           .user_data = (uint64_t)i};
    cr_assert_eq(idem_submit(q, ops, N), N);
    idem_completion out[N];
    int got = idem_poll(q, out, N, 100); /* the other content may be answered at once */
    cr_assert_leq(got, 1);
    uint64_t held = store_test_queue_buf_bytes(q);
    cr_assert_lt(held, (uint64_t)N * 4096, "parked claims hold %llu bytes",
                 (unsigned long long)held);
    expect_rc(idem_commit(g_q, "k", 1, tok, "r", 1), IDEM_OK);
    while (got < N) {
        int n = idem_poll(q, out + got, (size_t)(N - got), 20000);
        cr_assert_gt(n, 0, "waiters not woken by the commit");
        got += n;
    }
    for (int i = 0; i < N; i++) {
        int want = out[i].user_data == 0 ? IDEM_MISMATCH : IDEM_DONE;
        cr_assert_eq(out[i].outcome, want, "waiter %llu: %s", (unsigned long long)out[i].user_data,
                     idem_outcome_name(out[i].outcome));
    }
    idem_queue_close(q);
    free(fp);
    free(other);
}

/* A queue keeps few large copy buffers once they are returned: 8,192 slots that each copied a
 * 64 KiB result once kept 1 GiB for the life of the queue (idemd's engine queue). */
Test(wait, a_queue_keeps_few_large_buffers_after_large_answers)
{
    enum { N = 256, RESULT = 60 * 1024 };
    static char result[RESULT];
    memset(result, 'r', sizeof result);
    idem_claim_args a = claim_args(TTL, LEASE, 0);
    idem_completion c;
    expect_rc(idem_claim(g_q, "big", 3, &a, &c), IDEM_OK);
    expect_rc(idem_commit(g_q, "big", 3, c.token, result, sizeof result), IDEM_OK);
    idem_queue *q;
    expect_rc(idem_queue_open(g_s, N, &q), IDEM_OK);
    idem_op ops[N];
    for (int i = 0; i < N; i++)
        ops[i] =
            (idem_op){.kind = IDEM_OP_GET, .key = "big", .key_len = 3, .user_data = (uint64_t)i};
    cr_assert_eq(idem_submit(q, ops, N), N);
    idem_completion out[N];
    for (int got = 0; got < N;) {
        int n = idem_poll(q, out + got, (size_t)(N - got), 20000);
        cr_assert_gt(n, 0, "the gets were not answered");
        got += n;
    }
    for (int i = 0; i < N; i++)
        cr_assert(out[i].found && out[i].record.result_len == RESULT, "get %d", i);
    uint64_t during = store_test_queue_buf_bytes(q);
    cr_assert_geq(during, (uint64_t)N * RESULT, "each answer holds its copy until the next call");
    cr_assert_eq(idem_submit(q, ops, 1), 1); /* returns the slots of the last call */
    cr_assert_eq(idem_poll(q, out, 1, 20000), 1);
    uint64_t kept = store_test_queue_buf_bytes(q);
    cr_assert_leq(kept, 34 * 128 * 1024 + (uint64_t)N * 4096, "the queue kept %llu bytes",
                  (unsigned long long)kept);
    idem_queue_close(q);
}

/* Claims parked on thousands of keys, two on each, in buckets grown several times while they
 * park: a change of one key re-runs only its own claims, the first parked of them first. A
 * release grants each key to its first waiter alone; the commit of that grant answers the
 * second with the key's own result. */
Test(wait, a_change_of_one_key_among_thousands_parked_wakes_its_own_claims_in_order)
{
    enum { N = 2000 };
    static int64_t tok[N];
    static int order[N];
    char key[16], res[16];
    idem_queue *q;
    expect_rc(idem_queue_open(g_s, 2 * N + 1, &q), IDEM_OK);
    for (int i = 0; i < N; i++) {
        snprintf(key, sizeof key, "w%05d", i);
        tok[i] = claim_new_on(g_q, key);
        order[i] = i;
    }
    for (int round = 0; round < 2; round++)
        for (int i = 0; i < N; i++) {
            snprintf(key, sizeof key, "w%05d", i);
            submit_wait_claim(q, key, 60000, (uint64_t)(round * N + i));
        }
    idem_completion c;
    cr_assert_eq(poll_now(q, &c), 0, "a parked claim answered at once: %llu %s",
                 (unsigned long long)c.user_data, idem_outcome_name(c.outcome));
    srand(7);
    for (int i = N - 1; i > 0; i--) {
        int j = rand() % (i + 1), t = order[i];
        order[i] = order[j];
        order[j] = t;
    }
    /* Half the keys released, in a shuffled order: their first waiters alone get new. */
    static int64_t granted[N];
    for (int n = 0; n < N / 2; n++) {
        int k = order[n];
        snprintf(key, sizeof key, "w%05d", k);
        expect_rc(idem_release(g_q, key, strlen(key), tok[k]), IDEM_OK);
        cr_assert_eq(idem_poll(q, &c, 1, 20000), 1, "key %d released: no waiter woke", k);
        cr_assert_eq(c.user_data, (uint64_t)k, "key %d released: waiter %llu woke", k,
                     (unsigned long long)c.user_data);
        cr_assert_eq(c.outcome, IDEM_NEW, "key %d: %s", k, idem_outcome_name(c.outcome));
        granted[k] = c.token;
    }
    cr_assert_eq(idem_poll(q, &c, 1, 50), 0, "waiter %llu woke with no change of its key",
                 (unsigned long long)c.user_data);
    /* Those grants committed: each key's second waiter gets that key's result. */
    for (int n = 0; n < N / 2; n++) {
        int k = order[n];
        snprintf(key, sizeof key, "w%05d", k);
        snprintf(res, sizeof res, "r%05d", k);
        expect_rc(idem_commit(g_q, key, strlen(key), granted[k], res, strlen(res)), IDEM_OK);
        cr_assert_eq(idem_poll(q, &c, 1, 20000), 1, "key %d committed: no waiter woke", k);
        cr_assert_eq(c.user_data, (uint64_t)(N + k), "key %d committed: waiter %llu woke", k,
                     (unsigned long long)c.user_data);
        cr_assert_eq(c.outcome, IDEM_DONE, "key %d: %s", k, idem_outcome_name(c.outcome));
        cr_assert(c.data_len == strlen(res) && !memcmp(c.data, res, c.data_len),
                  "key %d: the second waiter got another key's result", k);
    }
    cr_assert_eq(idem_poll(q, &c, 1, 50), 0, "waiter %llu woke with no change of its key",
                 (unsigned long long)c.user_data);
    idem_queue_close(q); /* the other half leave the lists with their queue */
    for (int n = N / 2; n < N; n++) {
        int k = order[n];
        snprintf(key, sizeof key, "w%05d", k);
        expect_rc(idem_commit(g_q, key, strlen(key), tok[k], "x", 1), IDEM_OK);
    }
}

/* A woken claim is delivered in its place among the queue's completions: by submission order,
 * before a later change of its own key (parked claims wait on a list of their own). */
Test(wait, a_woken_claim_is_delivered_in_submission_order_before_the_change_that_woke_it)
{
    int64_t tok = claim_new_on(g_q, "k");
    idem_queue *q;
    expect_rc(idem_queue_open(g_s, 16, &q), IDEM_OK);
    submit_wait_claim(q, "k", 20000, 1);
    idem_op ops[2];
    memset(ops, 0, sizeof ops);
    ops[0].kind = IDEM_OP_CLAIM;
    ops[0].key = "other";
    ops[0].key_len = 5;
    ops[0].ttl_ms = TTL;
    ops[0].lease_ms = LEASE;
    ops[0].user_data = 2;
    ops[1].kind = IDEM_OP_COMMIT;
    ops[1].key = "k";
    ops[1].key_len = 1;
    ops[1].token = tok;
    ops[1].data = "inv";
    ops[1].data_len = 3;
    ops[1].user_data = 3;
    cr_assert_eq(idem_submit(q, ops, 2), 2);
    idem_completion c[4];
    size_t got = 0;
    for (int round = 0; round < 200 && got < 3; round++) {
        int n = idem_poll(q, c + got, 4 - got, 100);
        cr_assert_geq(n, 0, "idem_poll: %s", idem_strerror(n));
        got += (size_t)n;
    }
    cr_assert_eq(got, 3, "%zu completions", got);
    for (size_t i = 0; i < 3; i++)
        cr_assert_eq(c[i].user_data, i + 1, "completion %zu is op %llu", i,
                     (unsigned long long)c[i].user_data);
    cr_assert_eq(c[0].outcome, IDEM_DONE, "%s", idem_outcome_name(c[0].outcome));
    cr_assert(c[0].data_len == 3 && !memcmp(c[0].data, "inv", 3));
    cr_assert_eq(c[1].outcome, IDEM_NEW);
    cr_assert_eq(c[2].err, IDEM_OK);
    idem_queue_close(q);
}

/* Submits a get of an absent key on q and polls it, n times. Returns the microseconds taken. */
static int64_t gets_polled(idem_queue *q, int n)
{
    idem_op op;
    memset(&op, 0, sizeof op);
    op.kind = IDEM_OP_GET;
    op.key = "absent";
    op.key_len = 6;
    int64_t t0 = mono_us();
    for (int i = 0; i < n; i++) {
        op.user_data = UINT64_C(1) << 40 | (uint64_t)i;
        cr_assert_eq(idem_submit(q, &op, 1), 1);
        idem_completion c;
        cr_assert_eq(idem_poll(q, &c, 1, 20000), 1);
        cr_assert_eq(c.user_data, op.user_data);
    }
    return mono_us() - t0;
}

/* Found by a review of WAIT: parked claims stayed on their queue's list of outstanding slots,
 * so every poll walked them all (twice when nothing was ready), and so did the end of every
 * flush: with 30,000 claims parked, each completion on that queue cost a walk of 30,000 slots.
 * They are on a list of their own now. Not a timing of speed: the bound is three times the same
 * work on a queue with nothing parked (the walks made it tens of times that). */
Test(wait, polls_on_a_queue_of_thousands_of_parked_claims_do_not_walk_them)
{
    enum { P = 30000, M = 40000 };
    idem_queue *q, *base;
    expect_rc(idem_queue_open(g_s, 2 * P, &q), IDEM_OK);
    expect_rc(idem_queue_open(g_s, 64, &base), IDEM_OK);
    static idem_op ops[256];
    static char keys[256][16];
    for (int i = 0; i < P; i += 256) { /* P keys held on g_q, then a claim waiting on each */
        int n = P - i < 256 ? P - i : 256;
        memset(ops, 0, sizeof ops);
        for (int j = 0; j < n; j++) {
            snprintf(keys[j], sizeof keys[j], "p%06d", i + j);
            ops[j].kind = IDEM_OP_CLAIM;
            ops[j].key = keys[j];
            ops[j].key_len = (uint32_t)strlen(keys[j]);
            ops[j].ttl_ms = TTL;
            ops[j].lease_ms = LEASE;
        }
        idem_completion c[256];
        cr_assert_eq(run_async(g_q, ops, (size_t)n, c), NULL);
        for (int j = 0; j < n; j++) {
            cr_assert_eq(c[j].outcome, IDEM_NEW, "%s", keys[j]);
            submit_wait_claim(q, keys[j], 60000, (uint64_t)(i + j));
        }
    }
    idem_completion c;
    cr_assert_eq(poll_now(q, &c), 0, "a parked claim answered at once");
    int64_t t_base = gets_polled(base, M);
    int64_t t_parked = gets_polled(q, M);
    cr_assert_lt(t_parked, 3 * t_base + 500000,
                 "%d polls behind %d parked claims took %lld us, on a queue with none %lld us", M,
                 P, (long long)t_parked, (long long)t_base);
    /* Every one cancelled, the newest first, as a server whose clients all hang up at once
     * does: each cancel found its claim by a walk of the parked ones from the oldest (N^2/2
     * steps) until the fifty-seventh session. The same bound as the polls. */
    int64_t t_polls = gets_polled(base, P), t0 = mono_us();
    for (int i = P - 1; i >= 0; i--)
        expect_rc(idem_cancel_wait(q, (uint64_t)i), IDEM_OK);
    int64_t t_cancels = mono_us() - t0;
    cr_assert_lt(t_cancels, 3 * t_polls + 500000,
                 "%d cancels of parked claims took %lld us, as many polls %lld us", P,
                 (long long)t_cancels, (long long)t_polls);
    static uint8_t answered[P];
    for (int i = 0; i < P; i++) {
        cr_assert_eq(idem_poll(q, &c, 1, 20000), 1);
        cr_assert_eq(c.outcome, IDEM_BUSY, "cancelled claim %llu: %s",
                     (unsigned long long)c.user_data, idem_outcome_name(c.outcome));
        cr_assert(c.user_data < P && !answered[c.user_data], "claim %llu answered twice",
                  (unsigned long long)c.user_data);
        answered[c.user_data] = 1;
    }
    expect_rc(idem_cancel_wait(q, 0), IDEM_ENOTFOUND);
    idem_queue_close(base);
    idem_queue_close(q);
}

/* ------------------------------------------------------------------------------------------ */
/* Randomised model test. */

#define MK       6 /* keys */
#define MGRANTED 8 /* stale tokens remembered per key */
#define M_ABSENT 0

typedef struct mkey {
    int state; /* M_ABSENT or enum idem_state, as last set (expiry applied lazily) */
    int64_t first_seen, expires_at, lease_until, last_grant;
    int64_t token;    /* in_flight: the owner's token */
    int64_t finisher; /* committed: the token that committed (0: operator/SET); review: holder */
    uint32_t attempts;
    int fp, owner;
    char result[24];
    char note[24];
    int note_known;
    int expiry_moved; /* committed at or after expires_at: the field may show either time */
    int64_t granted[MGRANTED];
    int ngranted;
} mkey;

typedef struct model {
    uint64_t seed, rng;
    int policy;
    long step;
    int64_t now;
    int64_t max_token;
    mkey k[MK];
} model;

static model M;

static long M_step(void)
{
    return M.step;
}

#define MCHECK(cond, ...)                                                                          \
    do {                                                                                           \
        if (!(cond)) {                                                                             \
            char m_[400];                                                                          \
            snprintf(m_, sizeof m_, __VA_ARGS__);                                                  \
            cr_assert_fail("seed %llu (IDEM_SEED=%llu replays) step %ld: %s",                      \
                           (unsigned long long)M.seed, (unsigned long long)M.seed, M.step, m_);    \
        }                                                                                          \
    } while (0)

static uint64_t mttl(int k)
{
    return 3000u * (uint64_t)(k + 1);
}

static const char *mfp(int fp)
{
    return fp == 1 ? "content-A" : fp == 2 ? "content-B" : NULL;
}

static const char *mowner(int o)
{
    return o == 1 ? "w1" : o == 2 ? "w2" : NULL;
}

static uint64_t rnd(uint64_t n)
{
    return tu_rand(&M.rng) % n;
}

static void mkey_name(char *buf, size_t cap, int k)
{
    /* Binary keys sharing a prefix, one with a NUL byte (see mkey_len). */
    snprintf(buf, cap, "mkey-%d", k);
    if (k == 3) buf[1] = 0;
}

static size_t mkey_len(int k)
{
    return k == 5 ? 5 : 6; /* key 5 is "mkey-", a prefix of the others */
}

static int meff(const mkey *m)
{
    if (m->state == IDEM_STATE_COMMITTED && M.now >= m->expires_at) return M_ABSENT;
    return m->state;
}

static void mgrant(mkey *m, int64_t token)
{
    MCHECK(token > M.max_token, "token %" PRId64 " not above every earlier one (%" PRId64 ")",
           token, M.max_token);
    MCHECK(token < IDEM_TOKEN_MAX, "token %" PRId64 " over the limit", token);
    M.max_token = token;
    m->granted[m->ngranted % MGRANTED] = token;
    m->ngranted++;
}

static int64_t mpick_token(const mkey *m)
{
    uint64_t r = rnd(10);
    if (r < 6) {
        if (m->state == IDEM_STATE_IN_FLIGHT) return m->token;
        if (m->finisher) return m->finisher;
    }
    if (r < 9 && m->ngranted)
        return m->granted[rnd((uint64_t)(m->ngranted < MGRANTED ? m->ngranted : MGRANTED))];
    return M.max_token + 1 + (int64_t)rnd(1000);
}

static void mstore_open(void)
{
    store_open();
    int64_t now = idem_clock_now(g_s);
    MCHECK(now >= M.now, "store clock went back at open: %" PRId64 " < %" PRId64, now, M.now);
    M.now = now;
}

static void mcheck_key(int k)
{
    mkey *m = &M.k[k];
    char key[16];
    mkey_name(key, sizeof key, k);
    idem_completion c;
    memset(&c, 0, sizeof c);
    int rc = idem_get(g_q, key, mkey_len(k), &c);
    MCHECK(rc == IDEM_OK, "get: %s", idem_strerror(rc));
    int eff = meff(m);
    MCHECK(!!c.found == (eff != M_ABSENT), "key %d: found %d, model state %d", k, c.found, eff);
    if (!c.found) return;
    const idem_record *r = &c.record;
    MCHECK(r->state == eff, "key %d: state %d, model %d", k, r->state, eff);
    MCHECK(r->first_seen_ms == m->first_seen,
           "key %d: first_seen %" PRId64 ", model %" PRId64 " (rule 4)", k, r->first_seen_ms,
           m->first_seen);
    if (!m->expiry_moved)
        MCHECK(r->expires_at_ms == m->first_seen + (int64_t)mttl(k), "key %d: expires_at", k);
    MCHECK(r->key_len == mkey_len(k) && memcmp(r->key, key, mkey_len(k)) == 0, "key %d bytes", k);
    if (eff == IDEM_STATE_IN_FLIGHT) {
        MCHECK(r->token == m->token, "key %d: token %" PRId64 ", model %" PRId64, k, r->token,
               m->token);
        MCHECK(r->lease_until_ms == m->lease_until,
               "key %d: lease_until %" PRId64 ", model %" PRId64, k, r->lease_until_ms,
               m->lease_until);
        MCHECK(r->attempts == m->attempts, "key %d: attempts %u, model %u", k, r->attempts,
               m->attempts);
        MCHECK(r->last_grant_ms == m->last_grant, "key %d: last_grant", k);
    }
    if (eff == IDEM_STATE_COMMITTED) {
        size_t n = strlen(m->result);
        MCHECK(r->result_len == n && (n == 0 || memcmp(r->result, m->result, n) == 0),
               "key %d: result differs from \"%.200s\"", k, m->result);
    }
    if (eff == IDEM_STATE_REVIEW && m->note_known) {
        size_t n = strlen(m->note);
        MCHECK(r->note_len == n && memcmp(r->note, m->note, n) == 0, "key %d: note", k);
    }
}

static void mfresh(mkey *m, int fp, int owner, uint64_t lease_ms, int64_t token)
{
    int64_t keep[MGRANTED];
    int nk = m->ngranted;
    memcpy(keep, m->granted, sizeof keep);
    memset(m, 0, sizeof *m);
    memcpy(m->granted, keep, sizeof keep);
    m->ngranted = nk;
    m->state = IDEM_STATE_IN_FLIGHT;
    m->first_seen = M.now;
    m->expires_at = M.now; /* set by the caller from the key's ttl */
    m->lease_until = M.now + (int64_t)lease_ms;
    m->last_grant = M.now;
    m->attempts = 1;
    m->token = token;
    m->fp = fp;
    m->owner = owner;
}

static void mop_claim(int k)
{
    mkey *m = &M.k[k];
    int eff = meff(m);
    static const uint64_t leases[] = {100, 1000, 4000, 20000};
    uint64_t lease = leases[rnd(4)];
    int owner = (int)rnd(3);
    int fp = (int)rnd(3);
    if (eff != M_ABSENT && m->fp == 0)
        fp = 0; /* a repeat never brings the first fingerprint: that case is not specified */
    if (eff == IDEM_STATE_IN_FLIGHT && owner && owner == m->owner && fp && fp != m->fp) fp = m->fp;
    char key[16];
    mkey_name(key, sizeof key, k);
    idem_claim_args a;
    memset(&a, 0, sizeof a);
    a.ttl_ms = mttl(k);
    a.lease_ms = lease;
    a.fp = mfp(fp);
    a.fp_len = a.fp ? (uint32_t)strlen(a.fp) : 0;
    a.owner = mowner(owner);
    a.owner_len = a.owner ? 2 : 0;
    idem_completion c;
    memset(&c, 0, sizeof c);
    int rc = idem_claim(g_q, key, mkey_len(k), &a, &c);
    MCHECK(rc == IDEM_OK, "claim: %s", idem_strerror(rc));
    int conflict = eff != M_ABSENT && fp && m->fp && fp != m->fp;
    const char *on = idem_outcome_name(c.outcome);
    switch (eff) {
    case M_ABSENT:
        MCHECK(c.outcome == IDEM_NEW, "claim of absent key %d: %s", k, on);
        mgrant(m, c.token);
        mfresh(m, fp, owner, lease, c.token);
        m->expires_at = M.now + (int64_t)mttl(k);
        break;
    case IDEM_STATE_IN_FLIGHT:
        if (conflict) {
            MCHECK(c.outcome == IDEM_MISMATCH, "key %d in flight, other content: %s", k, on);
        } else if (M.now < m->lease_until) {
            if (owner && owner == m->owner) {
                MCHECK(c.outcome == IDEM_NEW && c.token == m->token,
                       "key %d: owner repeat: %s token %" PRId64 " (model %" PRId64 ")", k, on,
                       c.token, m->token);
                m->lease_until = M.now + (int64_t)lease;
            } else {
                MCHECK(c.outcome == IDEM_BUSY, "key %d: lease runs: %s", k, on);
                MCHECK(c.lease_left_ms == m->lease_until - M.now,
                       "key %d: lease_left %" PRId64 ", model %" PRId64, k, c.lease_left_ms,
                       m->lease_until - M.now);
            }
        } else if (M.policy == IDEM_LEASE_REVIEW) {
            MCHECK(c.outcome == IDEM_REVIEW, "key %d: lease ran out (review policy): %s", k, on);
            m->state = IDEM_STATE_REVIEW;
            m->finisher = 0;
            m->note_known = 0;
        } else {
            MCHECK(c.outcome == IDEM_RECOVER, "key %d: lease ran out: %s", k, on);
            MCHECK(c.attempts == m->attempts + 1, "key %d: attempts %u, model %u", k, c.attempts,
                   m->attempts + 1);
            MCHECK(c.last_grant_ms == m->last_grant,
                   "key %d: last_grant %" PRId64 ", model %" PRId64, k, c.last_grant_ms,
                   m->last_grant);
            mgrant(m, c.token);
            m->token = c.token;
            m->attempts++;
            m->last_grant = M.now;
            m->lease_until = M.now + (int64_t)lease;
            m->owner = owner;
        }
        break;
    case IDEM_STATE_COMMITTED:
        if (conflict) {
            MCHECK(c.outcome == IDEM_MISMATCH, "key %d committed, other content: %s", k, on);
        } else {
            size_t n = strlen(m->result);
            MCHECK(c.outcome == IDEM_DONE, "key %d committed: %s", k, on);
            MCHECK(c.data_len == n && (n == 0 || memcmp(c.data, m->result, n) == 0),
                   "key %d: done with another result", k);
        }
        break;
    default: /* review */
        if (conflict) {
            MCHECK(c.outcome == IDEM_REVIEW || c.outcome == IDEM_MISMATCH, "key %d review: %s", k,
                   on);
        } else {
            MCHECK(c.outcome == IDEM_REVIEW, "key %d review: %s", k, on);
            if (m->note_known) {
                size_t n = strlen(m->note);
                MCHECK(c.data_len == n && memcmp(c.data, m->note, n) == 0, "key %d: note", k);
            }
        }
    }
}

/* Moves a committed record's expiry when it is finished at or after its expires_at (rule 5). */
static void mfinish(mkey *m, int k)
{
    m->state = IDEM_STATE_COMMITTED;
    if (M.now >= m->expires_at) {
        m->expires_at = M.now + (int64_t)mttl(k);
        m->expiry_moved = 1;
    }
}

/* Owner calls: kind 0 commit, 1 release, 2 hold, 3 extend. */
static void mop_owner(int k, int kind)
{
    mkey *m = &M.k[k];
    int eff = meff(m);
    if (eff == M_ABSENT) m->state = M_ABSENT;
    int64_t tok = mpick_token(m);
    char key[16], res[24], note[24];
    mkey_name(key, sizeof key, k);
    snprintf(res, sizeof res, "res-%d", (int)rnd(3));
    snprintf(note, sizeof note, "hold-%d-%d", k, (int)rnd(2)); /* a repeat may bring another */
    uint64_t lease = 100 + rnd(5000);
    int rc;
    switch (kind) {
    case 0:
        rc = idem_commit(g_q, key, mkey_len(k), tok, res, strlen(res));
        break;
    case 1:
        rc = idem_release(g_q, key, mkey_len(k), tok);
        break;
    case 2:
        rc = idem_hold(g_q, key, mkey_len(k), tok, note, strlen(note));
        break;
    default:
        rc = idem_extend(g_q, key, mkey_len(k), tok, lease);
    }
    static const char *names[] = {"commit", "release", "hold", "extend"};
    const char *nm = names[kind];
    if (eff == M_ABSENT) {
        MCHECK(rc == IDEM_ENOTFOUND, "%s on absent key %d: %s", nm, k, idem_strerror(rc));
        return;
    }
    if (eff == IDEM_STATE_IN_FLIGHT) {
        if (tok != m->token) {
            MCHECK(rc == IDEM_ESTALE, "%s with stale token on key %d: %s", nm, k,
                   idem_strerror(rc));
            return;
        }
        MCHECK(rc == IDEM_OK, "%s by the owner of key %d: %s", nm, k, idem_strerror(rc));
        if (kind == 0) {
            snprintf(m->result, sizeof m->result, "%s", res);
            m->finisher = tok;
            mfinish(m, k);
        } else if (kind == 1) {
            m->state = M_ABSENT;
        } else if (kind == 2) {
            m->state = IDEM_STATE_REVIEW;
            m->finisher = tok;
            snprintf(m->note, sizeof m->note, "%s", note);
            m->note_known = 1;
        } else {
            m->lease_until = M.now + (int64_t)lease;
        }
        return;
    }
    if (eff == IDEM_STATE_COMMITTED && tok == m->finisher && m->finisher) {
        if (kind == 0) {
            int same = strcmp(res, m->result) == 0;
            MCHECK(rc == (same ? IDEM_OK : IDEM_ECONFLICT), "repeated commit (%s) on key %d: %s",
                   same ? "same result" : "other result", k, idem_strerror(rc));
        } else {
            /* Not specified beyond "an error that changes nothing". */
            MCHECK(rc < 0, "%s after commit on key %d answered OK", nm, k);
        }
        return;
    }
    if (eff == IDEM_STATE_REVIEW && kind == 2 && tok == m->finisher && m->finisher) {
        MCHECK(rc == IDEM_OK, "repeated hold on key %d: %s", k, idem_strerror(rc));
        snprintf(m->note, sizeof m->note, "%s", note); /* the last reason a hold gave */
        return;
    }
    MCHECK(rc == IDEM_ESTALE, "%s with a token that is not current on key %d (state %d): %s", nm, k,
           eff, idem_strerror(rc));
}

static void mop_resolve(int k)
{
    mkey *m = &M.k[k];
    int eff = meff(m);
    uint32_t action = 1 + (uint32_t)rnd(3);
    uint32_t flags = rnd(2) ? IDEM_F_FORCE : 0;
    char key[16], res[24];
    mkey_name(key, sizeof key, k);
    snprintf(res, sizeof res, "op-%d", (int)rnd(3));
    int with_result = action == IDEM_RESOLVE_COMMIT && rnd(2);
    idem_op op;
    memset(&op, 0, sizeof op);
    op.kind = IDEM_OP_RESOLVE;
    op.key = key;
    op.key_len = (uint32_t)mkey_len(k);
    op.data = "model";
    op.data_len = 5;
    op.result = with_result ? res : NULL;
    op.result_len = with_result ? (uint32_t)strlen(res) : 0;
    op.action = action;
    op.flags = flags;
    op.actor = "model";
    idem_completion c;
    memset(&c, 0, sizeof c);
    int rc = idem_exec(g_q, &op, &c);
    if (rc == IDEM_OK) rc = c.err;
    if (eff == M_ABSENT) {
        MCHECK(rc == IDEM_ENOTFOUND, "resolve of absent key %d: %s", k, idem_strerror(rc));
        m->state = M_ABSENT;
        return;
    }
    if (eff == IDEM_STATE_COMMITTED) {
        MCHECK(rc == IDEM_ESTATE, "resolve of committed key %d: %s", k, idem_strerror(rc));
        return;
    }
    if (eff == IDEM_STATE_IN_FLIGHT && M.now < m->lease_until && !flags) {
        MCHECK(rc == IDEM_ELEASE, "resolve of key %d with a running lease: %s", k,
               idem_strerror(rc));
        return;
    }
    MCHECK(rc == IDEM_OK, "resolve %u of key %d (state %d): %s", action, k, eff, idem_strerror(rc));
    m->finisher = 0; /* a resolve leaves no owner: every token is stale */
    if (action == IDEM_RESOLVE_RELEASE) {
        m->state = M_ABSENT;
        return;
    }
    if (action == IDEM_RESOLVE_COMMIT)
        snprintf(m->result, sizeof m->result, "%s", with_result ? res : "");
    else if (eff != IDEM_STATE_COMMITTED)
        m->result[0] = 0; /* settle: the current, empty, result */
    mfinish(m, k);
}

static void mop_del(int k)
{
    mkey *m = &M.k[k];
    int eff = meff(m);
    char key[16];
    mkey_name(key, sizeof key, k);
    int rc = idem_del(g_q, key, mkey_len(k), "model");
    if (eff == M_ABSENT) {
        MCHECK(rc == IDEM_ENOTFOUND, "del of absent key %d: %s", k, idem_strerror(rc));
        m->state = M_ABSENT;
    } else if (eff == IDEM_STATE_COMMITTED) {
        MCHECK(rc == IDEM_OK, "del of committed key %d: %s", k, idem_strerror(rc));
        m->state = M_ABSENT;
    } else {
        MCHECK(rc == IDEM_ESTATE, "del of unfinished key %d: %s", k, idem_strerror(rc));
    }
}

static void mop_setnx(int k)
{
    mkey *m = &M.k[k];
    int eff = meff(m);
    int get_old = (int)rnd(2);
    char key[16], val[24];
    mkey_name(key, sizeof key, k);
    snprintf(val, sizeof val, "set-%d", (int)rnd(3));
    idem_completion c;
    memset(&c, 0, sizeof c);
    int rc = idem_set_if_absent(g_q, key, mkey_len(k), val, strlen(val), mttl(k), get_old, &c);
    if (eff == M_ABSENT) {
        MCHECK(rc == IDEM_OK && c.outcome == IDEM_NEW, "set of absent key %d: %s %s", k,
               idem_strerror(rc), idem_outcome_name(c.outcome));
        mfresh(m, 0, 0, 1, 0);
        m->state = IDEM_STATE_COMMITTED;
        m->expires_at = M.now + (int64_t)mttl(k);
        snprintf(m->result, sizeof m->result, "%s", val);
        return;
    }
    if (eff == IDEM_STATE_COMMITTED) {
        MCHECK(rc == IDEM_OK && c.outcome == IDEM_DONE, "set of committed key %d: %s %s", k,
               idem_strerror(rc), idem_outcome_name(c.outcome));
        if (get_old) {
            size_t n = strlen(m->result);
            MCHECK(c.data_len == n && (n == 0 || memcmp(c.data, m->result, n) == 0),
                   "set GET of key %d: another value", k);
        }
        return;
    }
    if (get_old)
        MCHECK(rc == IDEM_ESTATE, "set GET of unfinished key %d: %s", k, idem_strerror(rc));
    else
        MCHECK(rc == IDEM_OK && c.outcome == IDEM_DONE, "set of unfinished key %d: %s %s", k,
               idem_strerror(rc), idem_outcome_name(c.outcome));
}

static void mop_clock(void)
{
    int64_t target = M.now + (int64_t)rnd(3000);
    if (rnd(2)) {
        /* Aim at a boundary of some key: lease_until or expires_at, or 1 ms before. */
        const mkey *m = &M.k[rnd(MK)];
        int eff = meff(m);
        int64_t b = eff == IDEM_STATE_IN_FLIGHT   ? m->lease_until
                    : eff == IDEM_STATE_COMMITTED ? m->expires_at
                                                  : 0;
        b -= (int64_t)rnd(2);
        if (b > M.now) target = b;
    }
    int rc = idem_clock_set(g_s, target);
    MCHECK(rc == IDEM_OK, "clock_set: %s", idem_strerror(rc));
    M.now = target;
    MCHECK(idem_clock_now(g_s) == target, "the test clock is not where it was set");
}

static void model_run(const char *name, int durability, int policy, uint64_t steps)
{
    memset(&M, 0, sizeof M);
    M.seed = tu_seed(name);
    M.rng = M.seed;
    M.policy = policy;
    store_close();
    g_opts.durability = durability;
    g_opts.lease_policy = policy;
    mstore_open();
    for (M.step = 0; M.step < (long)steps; M.step++) {
        int k = (int)rnd(MK);
        uint64_t r = rnd(100);
        if (r < 35)
            mop_claim(k);
        else if (r < 50)
            mop_owner(k, 0);
        else if (r < 55)
            mop_owner(k, 1);
        else if (r < 60)
            mop_owner(k, 2);
        else if (r < 66)
            mop_owner(k, 3);
        else if (r < 70)
            mop_resolve(k);
        else if (r < 73)
            mop_del(k);
        else if (r < 77)
            mop_setnx(k);
        else if (r < 97)
            mop_clock();
        else {
            store_close();
            mstore_open();
            for (int i = 0; i < MK; i++)
                mcheck_key(i);
            continue;
        }
        mcheck_key(k);
    }
    for (int i = 0; i < MK; i++)
        mcheck_key(i);
}

TestSuite(model, .init = setup, .fini = teardown, .timeout = 300);

Test(model, random_sequences_match_the_reference_map)
{
    model_run("model.random_sequences_match_the_reference_map", IDEM_DURABILITY_SYNC,
              IDEM_LEASE_RECOVER, tu_count(1500, 50000));
}

Test(model, random_sequences_match_the_reference_map_without_durability)
{
    model_run("model.random_sequences_match_the_reference_map_without_durability",
              IDEM_DURABILITY_NONE, IDEM_LEASE_RECOVER, tu_count(4000, 200000));
}

Test(model, random_sequences_match_the_reference_map_under_review_policy)
{
    model_run("model.random_sequences_match_the_reference_map_under_review_policy",
              IDEM_DURABILITY_BATCH, IDEM_LEASE_REVIEW, tu_count(2000, 50000));
}
