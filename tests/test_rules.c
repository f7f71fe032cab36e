/*
 * test_rules.c: behavioural tests of the public API (include/idem.h) for every rule of the
 * contract: insert-if-absent, repeats and mismatches, first_seen, exact expiry, leases and
 * recovery, fencing, owner calls, OWNER repeats, versions and tokens, operator resolve and del
 * with their audit trail, SET NX, bad arguments, persistence across close and reopen, read-only
 * opens, the directory lock, scans and stats.
 *
 * Every store is opened with the test clock (it stands still; idem_clock_set moves it) on a
 * temporary directory that .fini removes. Times are written relative to t0, the store clock at
 * open: at(ms) sets the clock to t0 + ms. Tests never sleep.
 */
#include <criterion/criterion.h>
#include <pthread.h>

#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <malloc.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>
#include <xxhash.h>

#include "idem.h"
#include "store.h"
#include "testutil.h"

#define TTL   60000u /* default ttl of the tests, ms */
#define LEASE 5000u  /* default lease of the tests, ms */

static char *g_dir;
static idem_options g_opts;
static idem_store *g_s;
static idem_queue *g_q;
static int64_t t0;

/* A monotonic clock that moves only when a test moves it. */
static _Atomic int64_t g_mono_ms = 1000000;

static int64_t test_mono_ms(void *ctx)
{
    (void)ctx;
    return atomic_load(&g_mono_ms);
}

static const idem_clock_source g_mono_clock = {.monotonic_ms = test_mono_ms};

static void store_open(void)
{
    int rc = idem_open(g_dir, &g_opts, &g_s);
    cr_assert_eq(rc, IDEM_OK, "idem_open: %s (%s)", idem_strerror(rc), idem_last_error());
    rc = idem_queue_open(g_s, 64, &g_q);
    cr_assert_eq(rc, IDEM_OK, "idem_queue_open: %s", idem_strerror(rc));
}

static void store_close(void)
{
    if (g_q) idem_queue_close(g_q);
    g_q = NULL;
    if (g_s) {
        int rc = idem_close(g_s);
        g_s = NULL;
        cr_assert_eq(rc, IDEM_OK, "idem_close: %s", idem_strerror(rc));
    }
}

/* Closes the store and removes it: the next store_open makes a new one. */
static void store_gone(void)
{
    store_close();
    tu_rmtree(g_dir);
    g_dir = tu_mkdtemp("rules");
    cr_assert_not_null(g_dir);
}

static void reopen(void)
{
    store_close();
    store_open();
}

static void setup_with(int policy)
{
    g_dir = tu_mkdtemp("rules");
    cr_assert_not_null(g_dir);
    idem_options_init(&g_opts);
    g_opts.test_clock = 1;
    g_opts.lease_policy = policy;
    store_open();
    t0 = idem_clock_now(g_s);
    cr_assert_gt(t0, 0);
}

static void setup(void)
{
    setup_with(IDEM_LEASE_RECOVER);
}

static void setup_review_policy(void)
{
    setup_with(IDEM_LEASE_REVIEW);
}

static void teardown(void)
{
    if (g_q) idem_queue_close(g_q);
    g_q = NULL;
    if (g_s) (void)idem_close(g_s);
    g_s = NULL;
    tu_rmtree(g_dir);
    g_dir = NULL;
}

/* Sets the store clock to t0 + rel_ms. */
static void at(int64_t rel_ms)
{
    int rc = idem_clock_set(g_s, t0 + rel_ms);
    cr_assert_eq(rc, IDEM_OK, "idem_clock_set(t0+%" PRId64 "): %s", rel_ms, idem_strerror(rc));
    cr_assert_eq(idem_clock_now(g_s), t0 + rel_ms);
}

static size_t slen(const char *s)
{
    return s ? strlen(s) : 0;
}

static int claim_rc(const void *key, size_t key_len, uint64_t ttl_ms, uint64_t lease_ms,
                    const char *fp, const char *owner, idem_completion *c)
{
    idem_claim_args a;
    memset(&a, 0, sizeof a);
    a.ttl_ms = ttl_ms;
    a.lease_ms = lease_ms;
    a.fp = fp;
    a.fp_len = (uint32_t)slen(fp);
    a.owner = owner;
    a.owner_len = (uint32_t)slen(owner);
    memset(c, 0, sizeof *c);
    return idem_claim(g_q, key, key_len, &a, c);
}

static idem_completion claim_bin(const void *key, size_t key_len, uint64_t ttl_ms,
                                 uint64_t lease_ms, const char *fp, const char *owner)
{
    idem_completion c;
    int rc = claim_rc(key, key_len, ttl_ms, lease_ms, fp, owner, &c);
    cr_assert_eq(rc, IDEM_OK, "idem_claim: %s", idem_strerror(rc));
    return c;
}

static idem_completion claim_full(const char *key, uint64_t ttl_ms, uint64_t lease_ms,
                                  const char *fp, const char *owner)
{
    return claim_bin(key, strlen(key), ttl_ms, lease_ms, fp, owner);
}

static idem_completion claim(const char *key)
{
    return claim_full(key, TTL, LEASE, NULL, NULL);
}

static idem_completion claim_fp(const char *key, const char *fp)
{
    return claim_full(key, TTL, LEASE, fp, NULL);
}

static idem_completion claim_owner(const char *key, const char *owner)
{
    return claim_full(key, TTL, LEASE, NULL, owner);
}

#define expect_outcome(c, o)                                                                       \
    cr_assert_eq((c).outcome, (o), "outcome %s (%d), expected %s", idem_outcome_name((c).outcome), \
                 (c).outcome, idem_outcome_name(o))

#define expect_rc(expr, want)                                                                      \
    do {                                                                                           \
        int rc_ = (expr);                                                                          \
        cr_assert_eq(rc_, (want), "%s: %s (%d), expected %s", #expr, idem_strerror(rc_), rc_,      \
                     idem_strerror(want));                                                         \
    } while (0)

#define expect_data(c, str)                                                                        \
    do {                                                                                           \
        const char *s_ = (str);                                                                    \
        cr_assert_eq((c).data_len, strlen(s_), "data_len %u, expected %zu", (c).data_len,          \
                     strlen(s_));                                                                  \
        cr_assert(strlen(s_) == 0 || memcmp((c).data, s_, strlen(s_)) == 0,                        \
                  "data differs from \"%s\"", s_);                                                 \
    } while (0)

static int64_t claim_new(const char *key)
{
    idem_completion c = claim(key);
    expect_outcome(c, IDEM_NEW);
    cr_assert_gt(c.token, 0);
    return c.token;
}

static int commit(const char *key, int64_t token, const char *result)
{
    return idem_commit(g_q, key, strlen(key), token, result, slen(result));
}

static int release(const char *key, int64_t token)
{
    return idem_release(g_q, key, strlen(key), token);
}

static int hold(const char *key, int64_t token, const char *reason)
{
    return idem_hold(g_q, key, strlen(key), token, reason, slen(reason));
}

static int extend(const char *key, int64_t token, uint64_t lease_ms)
{
    return idem_extend(g_q, key, strlen(key), token, lease_ms);
}

/* The record of key; its bytes stay valid until the next call on g_q. */
static idem_record get_bin(const void *key, size_t key_len)
{
    idem_completion c;
    memset(&c, 0, sizeof c);
    int rc = idem_get(g_q, key, key_len, &c);
    cr_assert_eq(rc, IDEM_OK, "idem_get: %s", idem_strerror(rc));
    cr_assert(c.found, "record of \"%.*s\" not found", (int)key_len, (const char *)key);
    return c.record;
}

static idem_record get(const char *key)
{
    return get_bin(key, strlen(key));
}

static int found(const char *key)
{
    idem_completion c;
    memset(&c, 0, sizeof c);
    int rc = idem_get(g_q, key, strlen(key), &c);
    cr_assert_eq(rc, IDEM_OK, "idem_get: %s", idem_strerror(rc));
    return c.found;
}

#define expect_result(r, str)                                                                      \
    do {                                                                                           \
        const char *s_ = (str);                                                                    \
        cr_assert_eq((r).result_len, strlen(s_), "result_len %u, expected %zu", (r).result_len,    \
                     strlen(s_));                                                                  \
        cr_assert(strlen(s_) == 0 || memcmp((r).result, s_, strlen(s_)) == 0,                      \
                  "result differs from \"%s\"", s_);                                               \
    } while (0)

#define expect_note(r, str)                                                                        \
    do {                                                                                           \
        const char *s_ = (str);                                                                    \
        cr_assert_eq((r).note_len, strlen(s_), "note_len %u, expected %zu", (r).note_len,          \
                     strlen(s_));                                                                  \
        cr_assert(memcmp((r).note, s_, strlen(s_)) == 0, "note differs from \"%s\"", s_);          \
    } while (0)

static void commit_ok(const char *key, int64_t token, const char *result)
{
    expect_rc(commit(key, token, result), IDEM_OK);
}

/* A committed record for key at the current clock, with content fp (may be NULL). */
static int64_t make_committed(const char *key, const char *fp, const char *result)
{
    idem_completion c = claim_fp(key, fp);
    expect_outcome(c, IDEM_NEW);
    commit_ok(key, c.token, result);
    return c.token;
}

static int resolve_full(const char *key, uint32_t action, const char *reason, const char *result,
                        uint32_t flags, uint64_t expect_version, const char *actor)
{
    idem_op op;
    idem_completion c;
    memset(&op, 0, sizeof op);
    memset(&c, 0, sizeof c);
    op.kind = IDEM_OP_RESOLVE;
    op.key = key;
    op.key_len = (uint32_t)strlen(key);
    op.data = reason;
    op.data_len = (uint32_t)slen(reason);
    op.result = result;
    op.result_len = (uint32_t)slen(result);
    op.action = action;
    op.flags = flags;
    op.expect_version = expect_version;
    op.actor = actor;
    int rc = idem_exec(g_q, &op, &c);
    return rc != IDEM_OK ? rc : c.err;
}

static int resolve(const char *key, uint32_t action, const char *reason, uint32_t flags)
{
    return resolve_full(key, action, reason, NULL, flags, 0, "alice");
}

static idem_stats stats(void)
{
    idem_stats st;
    memset(&st, 0, sizeof st);
    idem_get_stats(g_s, &st);
    cr_assert_eq(idem_key_count(g_s), st.keys, "idem_key_count and idem_stats.keys differ");
    return st;
}

static void fp_of(const char *content, uint8_t out[IDEM_FP_BYTES])
{
    idem_fingerprint(content, strlen(content), out);
}

/* ------------------------------------------------------------------------------------------ */
/* Rule 1: insert-if-absent. */

TestSuite(claim, .init = setup, .fini = teardown);

Test(claim, absent_key_is_new_with_a_positive_token_below_the_limit)
{
    idem_completion c = claim("order-1");
    expect_outcome(c, IDEM_NEW);
    cr_assert_gt(c.token, 0);
    cr_assert_lt(c.token, IDEM_TOKEN_MAX);
}

Test(claim, new_record_has_first_seen_expiry_lease_and_one_attempt)
{
    at(10);
    int64_t tok = claim_full("order-1", TTL, LEASE, "body", "w1").token;
    idem_record r = get("order-1");
    cr_assert_eq(r.state, IDEM_STATE_IN_FLIGHT);
    cr_assert_eq(r.first_seen_ms, t0 + 10);
    cr_assert_eq(r.expires_at_ms, t0 + 10 + TTL);
    cr_assert_eq(r.last_seen_ms, t0 + 10);
    cr_assert_eq(r.seen_count, 1);
    cr_assert_eq(r.lease_until_ms, t0 + 10 + LEASE);
    cr_assert_eq(r.token, tok);
    cr_assert_eq(r.attempts, 1);
    cr_assert_eq(r.last_grant_ms, t0 + 10);
    cr_assert_eq(r.owner_len, 2);
    cr_assert(memcmp(r.owner, "w1", 2) == 0);
    cr_assert(r.has_fp);
    /* XXH3-128 of "body", unseeded, canonical order: a known answer, not the library's own. */
    static const uint8_t want[IDEM_FP_BYTES] = {0x17, 0x7a, 0xef, 0xcc, 0xff, 0xa6, 0xf7, 0x4a,
                                                0xcb, 0xf1, 0xc4, 0x97, 0xea, 0xc7, 0x6e, 0x10};
    cr_assert(memcmp(r.fp, want, IDEM_FP_BYTES) == 0, "stored fingerprint is not XXH3-128(body)");
    cr_assert_eq(r.mismatch_count, 0);
    cr_assert_eq(r.last_mismatch_ms, 0);
    cr_assert_eq(r.key_len, 7);
    cr_assert(memcmp(r.key, "order-1", 7) == 0);
}

Test(claim, second_claim_while_lease_runs_is_busy_with_exact_lease_left)
{
    claim_new("k");
    at(1234);
    idem_completion c = claim("k");
    expect_outcome(c, IDEM_BUSY);
    cr_assert_eq(c.lease_left_ms, (int64_t)LEASE - 1234);
}

Test(claim, busy_repeat_counts_seen_but_keeps_owner_and_token)
{
    int64_t tok = claim_new("k");
    at(100);
    expect_outcome(claim("k"), IDEM_BUSY);
    idem_record r = get("k");
    cr_assert_eq(r.seen_count, 2);
    cr_assert_eq(r.last_seen_ms, t0 + 100);
    cr_assert_eq(r.first_seen_ms, t0);
    cr_assert_eq(r.token, tok);
    cr_assert_eq(r.lease_until_ms, t0 + LEASE);
    cr_assert_eq(r.attempts, 1);
}

Test(claim, missing_key_get_is_not_found)
{
    cr_assert_not(found("nothing"));
}

/* ------------------------------------------------------------------------------------------ */
/* Rule 2: a repeat with the same content returns the stored outcome. */

TestSuite(repeat, .init = setup, .fini = teardown);

Test(repeat, committed_key_with_same_content_is_done_with_result)
{
    make_committed("k", "body", "invoice-17");
    at(10);
    idem_completion c = claim_fp("k", "body");
    expect_outcome(c, IDEM_DONE);
    expect_data(c, "invoice-17");
}

Test(repeat, repeat_creates_nothing)
{
    make_committed("k", NULL, "r");
    idem_stats before = stats();
    for (int i = 0; i < 5; i++)
        expect_outcome(claim("k"), IDEM_DONE);
    idem_stats after = stats();
    cr_assert_eq(after.keys, before.keys);
    cr_assert_eq(after.keys_committed, before.keys_committed);
    cr_assert_eq(after.claims_new, before.claims_new);
    cr_assert_eq(after.claims_done, before.claims_done + 5);
}

Test(repeat, committed_empty_result_is_done_with_empty_data)
{
    make_committed("k", NULL, "");
    idem_completion c = claim("k");
    expect_outcome(c, IDEM_DONE);
    cr_assert_eq(c.data_len, 0);
}

Test(repeat, binary_result_is_returned_byte_for_byte)
{
    uint8_t res[300];
    for (size_t i = 0; i < sizeof res; i++)
        res[i] = (uint8_t)(i * 7);
    int64_t tok = claim_new("k");
    expect_rc(idem_commit(g_q, "k", 1, tok, res, sizeof res), IDEM_OK);
    idem_completion c = claim("k");
    expect_outcome(c, IDEM_DONE);
    cr_assert_eq(c.data_len, sizeof res);
    cr_assert(memcmp(c.data, res, sizeof res) == 0);
}

/* ------------------------------------------------------------------------------------------ */
/* Rule 3: a repeat with different content is a mismatch, recorded, and changes nothing else. */

TestSuite(mismatch, .init = setup, .fini = teardown);

Test(mismatch, different_fp_on_committed_is_mismatch)
{
    make_committed("k", "body-A", "res");
    idem_completion c = claim_fp("k", "body-B");
    expect_outcome(c, IDEM_MISMATCH);
}

Test(mismatch, mismatch_is_recorded_with_time_and_fingerprint)
{
    make_committed("k", "body-A", "res");
    at(700);
    expect_outcome(claim_fp("k", "body-B"), IDEM_MISMATCH);
    idem_record r = get("k");
    cr_assert_eq(r.mismatch_count, 1);
    cr_assert_eq(r.last_mismatch_ms, t0 + 700);
    cr_assert(r.has_last_mismatch_fp);
    uint8_t fb[IDEM_FP_BYTES];
    fp_of("body-B", fb);
    cr_assert(memcmp(r.last_mismatch_fp, fb, IDEM_FP_BYTES) == 0);
    at(900);
    expect_outcome(claim_fp("k", "body-C"), IDEM_MISMATCH);
    r = get("k");
    cr_assert_eq(r.mismatch_count, 2);
    cr_assert_eq(r.last_mismatch_ms, t0 + 900);
    fp_of("body-C", fb);
    cr_assert(memcmp(r.last_mismatch_fp, fb, IDEM_FP_BYTES) == 0);
}

Test(mismatch, mismatch_leaves_state_result_fingerprint_and_first_seen_unchanged)
{
    make_committed("k", "body-A", "res");
    at(500);
    expect_outcome(claim_fp("k", "body-B"), IDEM_MISMATCH);
    idem_record r = get("k");
    cr_assert_eq(r.state, IDEM_STATE_COMMITTED);
    expect_result(r, "res");
    cr_assert_eq(r.first_seen_ms, t0);
    cr_assert_eq(r.expires_at_ms, t0 + TTL);
    uint8_t fa[IDEM_FP_BYTES];
    fp_of("body-A", fa);
    cr_assert(r.has_fp);
    cr_assert(memcmp(r.fp, fa, IDEM_FP_BYTES) == 0, "the mismatching content overwrote the fp");
    /* The original content still gets its result. */
    idem_completion c = claim_fp("k", "body-A");
    expect_outcome(c, IDEM_DONE);
    expect_data(c, "res");
}

Test(mismatch, different_fp_against_in_flight_with_running_lease_is_mismatch)
{
    idem_completion c = claim_fp("k", "body-A");
    expect_outcome(c, IDEM_NEW);
    at(10);
    expect_outcome(claim_fp("k", "body-B"), IDEM_MISMATCH);
    idem_record r = get("k");
    cr_assert_eq(r.state, IDEM_STATE_IN_FLIGHT);
    cr_assert_eq(r.token, c.token);
    cr_assert_eq(r.mismatch_count, 1);
    cr_assert_eq(r.last_mismatch_ms, t0 + 10);
    cr_assert_eq(r.lease_until_ms, t0 + LEASE);
    /* The owner is unaffected. */
    commit_ok("k", c.token, "res");
}

Test(mismatch, different_fp_after_lease_ran_out_is_mismatch_not_recover)
{
    idem_completion c = claim_fp("k", "body-A");
    at(LEASE + 1000);
    expect_outcome(claim_fp("k", "body-B"), IDEM_MISMATCH);
    idem_record r = get("k");
    cr_assert_eq(r.state, IDEM_STATE_IN_FLIGHT);
    cr_assert_eq(r.token, c.token);
    cr_assert_eq(r.attempts, 1);
    cr_assert_eq(r.mismatch_count, 1);
    /* The claim with the original content then recovers. */
    idem_completion rc = claim_fp("k", "body-A");
    expect_outcome(rc, IDEM_RECOVER);
}

Test(mismatch, repeat_without_fp_is_not_compared)
{
    make_committed("k", "body-A", "res");
    idem_completion c = claim("k");
    expect_outcome(c, IDEM_DONE);
    expect_data(c, "res");
    cr_assert_eq(get("k").mismatch_count, 0);
}

Test(mismatch, repeat_with_fp_against_a_record_without_fp_is_not_compared)
{
    make_committed("k", NULL, "res");
    idem_completion c = claim_fp("k", "body-B");
    expect_outcome(c, IDEM_DONE);
    expect_data(c, "res");
    cr_assert_eq(get("k").mismatch_count, 0);
}

Test(mismatch, claim_without_fp_against_in_flight_with_fp_is_busy)
{
    claim_fp("k", "body-A");
    expect_outcome(claim("k"), IDEM_BUSY);
    cr_assert_eq(get("k").mismatch_count, 0);
}

Test(mismatch, same_fp_is_done_and_not_counted)
{
    make_committed("k", "body-A", "res");
    expect_outcome(claim_fp("k", "body-A"), IDEM_DONE);
    cr_assert_eq(get("k").mismatch_count, 0);
    cr_assert_eq(get("k").last_mismatch_ms, 0);
}

Test(mismatch, mismatch_is_counted_in_stats)
{
    make_committed("k", "body-A", "res");
    idem_stats b = stats();
    expect_outcome(claim_fp("k", "body-B"), IDEM_MISMATCH);
    idem_stats a = stats();
    cr_assert_eq(a.claims_mismatch, b.claims_mismatch + 1);
    cr_assert_eq(a.mismatches, b.mismatches + 1);
}

/* ------------------------------------------------------------------------------------------ */
/* Rule 4: first seen is never refreshed; repeats do not extend expiry. */

TestSuite(first_seen, .init = setup, .fini = teardown);

Test(first_seen, repeats_never_change_first_seen_or_expires_at)
{
    make_committed("k", NULL, "r");
    for (int i = 1; i <= 5; i++) {
        at(i * 1000);
        expect_outcome(claim("k"), IDEM_DONE);
    }
    idem_record r = get("k");
    cr_assert_eq(r.first_seen_ms, t0);
    cr_assert_eq(r.expires_at_ms, t0 + TTL);
    cr_assert_eq(r.seen_count, 6);
    cr_assert_eq(r.last_seen_ms, t0 + 5000);
}

Test(first_seen, sender_resending_cannot_keep_its_key_alive)
{
    make_committed("k", NULL, "r");
    for (int64_t t = 1000; t < TTL; t += 1000) {
        at(t);
        expect_outcome(claim("k"), IDEM_DONE);
    }
    at(TTL);
    expect_outcome(claim("k"), IDEM_NEW);
}

Test(first_seen, repeat_with_longer_ttl_does_not_extend_expiry)
{
    make_committed("k", NULL, "r");
    at(100);
    expect_outcome(claim_full("k", TTL * 10, LEASE, NULL, NULL), IDEM_DONE);
    cr_assert_eq(get("k").expires_at_ms, t0 + TTL);
    at(TTL);
    expect_outcome(claim("k"), IDEM_NEW);
}

Test(first_seen, recover_and_commit_keep_first_seen)
{
    claim_new("k");
    at(LEASE);
    idem_completion c = claim("k");
    expect_outcome(c, IDEM_RECOVER);
    at(LEASE + 10);
    commit_ok("k", c.token, "r");
    idem_record r = get("k");
    cr_assert_eq(r.first_seen_ms, t0);
    cr_assert_eq(r.expires_at_ms, t0 + TTL);
}

/* ------------------------------------------------------------------------------------------ */
/* Rule 5: expiry is exact, and only finished records expire. */

TestSuite(expiry, .init = setup, .fini = teardown);

Test(expiry, committed_key_at_expires_at_minus_1_is_a_repeat)
{
    make_committed("k", NULL, "r");
    at(TTL - 1);
    idem_completion c = claim("k");
    expect_outcome(c, IDEM_DONE);
    expect_data(c, "r");
}

Test(expiry, committed_key_at_expires_at_is_new_with_fresh_first_seen)
{
    int64_t old = make_committed("k", NULL, "r");
    at(TTL);
    idem_completion c = claim("k");
    expect_outcome(c, IDEM_NEW);
    cr_assert_gt(c.token, old);
    idem_record r = get("k");
    cr_assert_eq(r.state, IDEM_STATE_IN_FLIGHT);
    cr_assert_eq(r.first_seen_ms, t0 + TTL);
    cr_assert_eq(r.expires_at_ms, t0 + 2 * (int64_t)TTL);
    cr_assert_eq(r.seen_count, 1);
    cr_assert_eq(r.attempts, 1);
    cr_assert_eq(r.result_len, 0);
}

/* A claim through idem_submit, which waits for the read side of the lock (idem_claim only tries
 * it: a flusher finishing its round would send the claim down the locked path). */
static idem_completion claim_submitted(const char *key)
{
    idem_op op = {.kind = IDEM_OP_CLAIM,
                  .key = key,
                  .key_len = (uint32_t)strlen(key),
                  .ttl_ms = TTL,
                  .lease_ms = LEASE};
    idem_completion c;
    cr_assert_eq(idem_submit(g_q, &op, 1), 1);
    cr_assert_eq(idem_poll(g_q, &c, 1, 10000), 1);
    return c;
}

/* Claims of committed keys are answered under the read side of the store's lock (store.h, rw),
 * with a clock reading of their own: the boundary is the same there. The monotonic clock is
 * frozen: a reader leaves the first claim of a new second to the locked path (ops_read_begin). */
Test(expiry, the_boundary_holds_for_claims_answered_without_the_lock)
{
    store_close();
    g_opts.clock = &g_mono_clock;
    store_open();
    make_committed("k", NULL, "r");
    uint64_t reads = store_test_reads(g_s);
    at(TTL - 1);
    idem_completion c = claim_submitted("k");
    expect_outcome(c, IDEM_DONE);
    expect_data(c, "r");
    cr_assert_eq(store_test_reads(g_s), reads + 1, "the repeat was not answered by a reader");
    at(TTL);
    c = claim_submitted("k");
    expect_outcome(c, IDEM_NEW);
    cr_assert_eq(store_test_reads(g_s), reads + 1, "a reader answered a claim of an expired key");
    cr_assert_eq(get("k").first_seen_ms, t0 + TTL);
}

/* A blocking caller whose claims keep missing the read side (new keys) tries it only once in a
 * while (store.c, EXEC_READ_MISSES): repeats meanwhile are answered on the locked path, the
 * same, and calls other than claims do not bring the next try nearer; once a try finds its key
 * committed, the caller tries the read side at every claim again. (A try that finds the lock
 * taken, by the flusher say, counts for nothing: the test follows the count, not the tries.) */
Test(expiry, blocking_repeats_after_new_keys_go_back_to_the_read_side)
{
    store_close();
    g_opts.clock = &g_mono_clock;
    store_open();
    make_committed("k", NULL, "r");
    for (int i = 0; i < 1000 && store_test_exec_read_misses(g_q) < 8; i++) {
        char key[16];
        snprintf(key, sizeof key, "new-%d", i);
        expect_outcome(claim(key), IDEM_NEW);
    }
    cr_assert_eq(store_test_exec_read_misses(g_q), 8, "new keys' claims were not counted");
    uint64_t reads = store_test_reads(g_s);
    int locked = 0;
    for (; locked < 1000 && store_test_reads(g_s) == reads; locked++) {
        idem_completion c = claim("k");
        expect_outcome(c, IDEM_DONE);
        expect_data(c, "r");
        cr_assert_eq(get("k").state, IDEM_STATE_COMMITTED); /* a call that is not a claim */
    }
    cr_assert_geq(locked, 32, "a repeat went to the read side before its try came round");
    cr_assert_lt(locked, 1000, "the read side was never tried again");
    cr_assert_eq(store_test_exec_read_misses(g_q), 0,
                 "a repeat answered by a reader left the count");
    for (int i = 0; i < 4; i++)
        expect_outcome(claim("k"), IDEM_DONE);
    cr_assert_eq(store_test_exec_read_misses(g_q), 0);
}

Test(expiry, committed_key_at_expires_at_is_absent_to_get)
{
    make_committed("k", NULL, "r");
    at(TTL - 1);
    cr_assert(found("k"));
    at(TTL);
    cr_assert_not(found("k"));
}

Test(expiry, expired_record_is_absent_to_owner_calls)
{
    int64_t tok = make_committed("k", NULL, "r");
    at(TTL);
    expect_rc(commit("k", tok, "r"), IDEM_ENOTFOUND);
}

Test(expiry, expiry_counts_from_the_ttl_of_each_key)
{
    make_committed("short", NULL, "r");
    idem_completion c = claim_full("long", 3 * TTL, LEASE, NULL, NULL);
    commit_ok("long", c.token, "r");
    at(TTL);
    expect_outcome(claim("short"), IDEM_NEW);
    expect_outcome(claim("long"), IDEM_DONE);
    at(3 * TTL - 1);
    expect_outcome(claim("long"), IDEM_DONE);
    at(3 * TTL);
    expect_outcome(claim("long"), IDEM_NEW);
}

Test(expiry, in_flight_record_never_expires)
{
    idem_completion c = claim_full("k", 1000, 100000, NULL, NULL);
    at(50000);
    idem_completion b = claim_full("k", 1000, 100000, NULL, NULL);
    expect_outcome(b, IDEM_BUSY);
    cr_assert_eq(b.lease_left_ms, 50000);
    cr_assert(found("k"));
    cr_assert_eq(get("k").first_seen_ms, t0);
    /* The owner's commit still lands (and the outcome then lives one more ttl). */
    commit_ok("k", c.token, "r");
    expect_outcome(claim_full("k", 1000, 1000, NULL, NULL), IDEM_DONE);
}

Test(expiry, in_flight_with_lease_run_out_past_expiry_is_recover_not_new)
{
    idem_completion c = claim_full("k", 1000, 500, NULL, NULL);
    at(10 * 1000);
    idem_completion r = claim_full("k", 1000, 500, NULL, NULL);
    expect_outcome(r, IDEM_RECOVER);
    cr_assert_eq(r.attempts, 2);
    cr_assert_eq(r.last_grant_ms, t0);
    cr_assert_gt(r.token, c.token);
    cr_assert_eq(get("k").first_seen_ms, t0);
}

Test(expiry, review_record_never_expires)
{
    idem_completion c = claim_full("k", 1000, 500, NULL, NULL);
    expect_rc(hold("k", c.token, "unsure"), IDEM_OK);
    at(100 * 1000);
    idem_completion r = claim_full("k", 1000, 500, NULL, NULL);
    expect_outcome(r, IDEM_REVIEW);
    expect_data(r, "unsure");
    cr_assert(found("k"));
}

Test(expiry, commit_at_expires_at_keeps_outcome_one_more_ttl)
{
    idem_completion c = claim_full("k", 1000, 5000, NULL, NULL);
    at(1000);
    commit_ok("k", c.token, "r");
    at(1999);
    idem_completion d = claim_full("k", 1000, 5000, NULL, NULL);
    expect_outcome(d, IDEM_DONE);
    expect_data(d, "r");
    at(2000);
    expect_outcome(claim_full("k", 1000, 5000, NULL, NULL), IDEM_NEW);
}

Test(expiry, commit_after_expires_at_keeps_outcome_one_more_ttl_from_commit)
{
    idem_completion c = claim_full("k", 1000, 5000, NULL, NULL);
    at(3500);
    commit_ok("k", c.token, "r");
    cr_assert_eq(get("k").first_seen_ms, t0);
    at(4499);
    expect_outcome(claim_full("k", 1000, 5000, NULL, NULL), IDEM_DONE);
    at(4500);
    expect_outcome(claim_full("k", 1000, 5000, NULL, NULL), IDEM_NEW);
}

Test(expiry, commit_before_expires_at_expires_at_the_original_time)
{
    idem_completion c = claim_full("k", 1000, 5000, NULL, NULL);
    at(999);
    commit_ok("k", c.token, "r");
    at(1000);
    expect_outcome(claim_full("k", 1000, 5000, NULL, NULL), IDEM_NEW);
}

Test(expiry, recovered_commit_after_expiry_keeps_outcome_one_more_ttl)
{
    claim_full("k", 1000, 500, NULL, NULL);
    at(5000);
    idem_completion r = claim_full("k", 1000, 500, NULL, NULL);
    expect_outcome(r, IDEM_RECOVER);
    at(5100);
    commit_ok("k", r.token, "r");
    at(6099);
    expect_outcome(claim_full("k", 1000, 500, NULL, NULL), IDEM_DONE);
    at(6100);
    expect_outcome(claim_full("k", 1000, 500, NULL, NULL), IDEM_NEW);
}

Test(expiry, resolve_after_expires_at_keeps_outcome_one_more_ttl)
{
    idem_completion c = claim_full("k", 1000, 500, NULL, NULL);
    expect_rc(hold("k", c.token, "check"), IDEM_OK);
    at(7000);
    expect_rc(resolve_full("k", IDEM_RESOLVE_COMMIT, "checked", "inv-9", 0, 0, "alice"), IDEM_OK);
    at(7999);
    idem_completion d = claim_full("k", 1000, 500, NULL, NULL);
    expect_outcome(d, IDEM_DONE);
    expect_data(d, "inv-9");
    at(8000);
    expect_outcome(claim_full("k", 1000, 500, NULL, NULL), IDEM_NEW);
}

Test(expiry, expired_records_are_counted)
{
    make_committed("a", NULL, "r");
    make_committed("b", NULL, "r");
    at(TTL);
    expect_outcome(claim("a"), IDEM_NEW);
    expect_outcome(claim("b"), IDEM_NEW);
    cr_assert_eq(stats().expired_total, 2);
}

/* ------------------------------------------------------------------------------------------ */
/* Rule 6: a lease that runs out is not a fresh start. */

TestSuite(lease, .init = setup, .fini = teardown);

Test(lease, claim_at_lease_until_minus_1_is_busy_with_1ms_left)
{
    claim_new("k");
    at(LEASE - 1);
    idem_completion c = claim("k");
    expect_outcome(c, IDEM_BUSY);
    cr_assert_eq(c.lease_left_ms, 1);
}

Test(lease, claim_at_lease_until_is_recover_with_attempts_2_and_last_grant_of_expired_attempt)
{
    at(20);
    int64_t tok = claim_new("k");
    at(20 + LEASE);
    idem_completion c = claim("k");
    expect_outcome(c, IDEM_RECOVER);
    cr_assert_gt(c.token, tok);
    cr_assert_eq(c.attempts, 2);
    cr_assert_eq(c.last_grant_ms, t0 + 20);
}

Test(lease, recover_grants_a_new_lease_from_now)
{
    claim_new("k");
    at(LEASE + 100);
    idem_completion c = claim_full("k", TTL, 2000, NULL, "w2");
    expect_outcome(c, IDEM_RECOVER);
    idem_record r = get("k");
    cr_assert_eq(r.state, IDEM_STATE_IN_FLIGHT);
    cr_assert_eq(r.token, c.token);
    cr_assert_eq(r.attempts, 2);
    cr_assert_eq(r.last_grant_ms, t0 + LEASE + 100);
    cr_assert_eq(r.lease_until_ms, t0 + LEASE + 100 + 2000);
    cr_assert_eq(r.first_seen_ms, t0);
    cr_assert_eq(r.owner_len, 2);
    cr_assert(memcmp(r.owner, "w2", 2) == 0);
    at(LEASE + 100 + 1999);
    idem_completion b = claim("k");
    expect_outcome(b, IDEM_BUSY);
    cr_assert_eq(b.lease_left_ms, 1);
}

Test(lease, second_recover_reports_the_grant_of_the_first_recovery)
{
    claim_new("k");
    at(LEASE);
    idem_completion r1 = claim("k");
    expect_outcome(r1, IDEM_RECOVER);
    at(2 * LEASE);
    idem_completion r2 = claim("k");
    expect_outcome(r2, IDEM_RECOVER);
    cr_assert_eq(r2.attempts, 3);
    cr_assert_eq(r2.last_grant_ms, t0 + LEASE);
    cr_assert_gt(r2.token, r1.token);
}

Test(lease, recoveries_are_counted)
{
    claim_new("k");
    idem_stats b = stats();
    at(LEASE);
    expect_outcome(claim("k"), IDEM_RECOVER);
    idem_stats a = stats();
    cr_assert_eq(a.recoveries, b.recoveries + 1);
    cr_assert_eq(a.claims_recover, b.claims_recover + 1);
}

Test(lease, old_owner_may_commit_after_lease_ran_out_before_any_claim)
{
    int64_t tok = claim_new("k");
    at(LEASE + 5000);
    commit_ok("k", tok, "late");
    idem_completion c = claim("k");
    expect_outcome(c, IDEM_DONE);
    expect_data(c, "late");
    cr_assert_eq(get("k").attempts, 1);
}

Test(lease, old_owner_may_release_after_lease_ran_out_before_any_claim)
{
    int64_t tok = claim_new("k");
    at(LEASE + 5000);
    expect_rc(release("k", tok), IDEM_OK);
    idem_completion c = claim("k");
    expect_outcome(c, IDEM_NEW);
    cr_assert_eq(get("k").attempts, 1);
}

Test(lease, old_owner_may_hold_after_lease_ran_out_before_any_claim)
{
    int64_t tok = claim_new("k");
    at(LEASE + 5000);
    expect_rc(hold("k", tok, "unsure"), IDEM_OK);
    idem_completion c = claim("k");
    expect_outcome(c, IDEM_REVIEW);
    expect_data(c, "unsure");
}

Test(lease, old_owner_may_extend_after_lease_ran_out_before_any_claim)
{
    int64_t tok = claim_new("k");
    at(LEASE + 5000);
    expect_rc(extend("k", tok, 3000), IDEM_OK);
    at(LEASE + 5000 + 2999);
    idem_completion c = claim("k");
    expect_outcome(c, IDEM_BUSY);
    cr_assert_eq(c.lease_left_ms, 1);
}

Test(lease, extend_runs_the_lease_on_from_now)
{
    int64_t tok = claim_new("k");
    at(800);
    expect_rc(extend("k", tok, 1000), IDEM_OK);
    cr_assert_eq(get("k").lease_until_ms, t0 + 1800);
    at(1799);
    idem_completion b = claim("k");
    expect_outcome(b, IDEM_BUSY);
    cr_assert_eq(b.lease_left_ms, 1);
    at(1800);
    expect_outcome(claim("k"), IDEM_RECOVER);
}

Test(lease, extend_may_shorten_the_lease)
{
    int64_t tok = claim_new("k");
    at(100);
    expect_rc(extend("k", tok, 50), IDEM_OK);
    at(150);
    expect_outcome(claim("k"), IDEM_RECOVER);
}

Test(lease, extend_does_not_change_first_seen_or_expiry)
{
    int64_t tok = claim_new("k");
    at(100);
    expect_rc(extend("k", tok, TTL * 2), IDEM_OK);
    idem_record r = get("k");
    cr_assert_eq(r.first_seen_ms, t0);
    cr_assert_eq(r.expires_at_ms, t0 + TTL);
    cr_assert_eq(r.attempts, 1);
    cr_assert_eq(r.token, tok);
}

Test(lease, recovering_owner_with_new_token_can_commit)
{
    int64_t tok = claim_new("k");
    at(LEASE);
    idem_completion c = claim("k");
    expect_outcome(c, IDEM_RECOVER);
    commit_ok("k", c.token, "after-lookup");
    expect_rc(commit("k", tok, "after-lookup"), IDEM_ESTALE);
    idem_completion d = claim("k");
    expect_outcome(d, IDEM_DONE);
    expect_data(d, "after-lookup");
}

TestSuite(review_policy, .init = setup_review_policy, .fini = teardown);

Test(review_policy, expired_lease_turns_into_review)
{
    int64_t tok = claim_new("k");
    at(LEASE - 1);
    expect_outcome(claim("k"), IDEM_BUSY);
    at(LEASE);
    idem_completion c = claim("k");
    expect_outcome(c, IDEM_REVIEW);
    idem_record r = get("k");
    cr_assert_eq(r.state, IDEM_STATE_REVIEW);
    cr_assert_eq(r.first_seen_ms, t0);
    /* The old token is stale after the transition. */
    expect_rc(commit("k", tok, "late"), IDEM_ESTALE);
    cr_assert_eq(get("k").state, IDEM_STATE_REVIEW);
    expect_outcome(claim("k"), IDEM_REVIEW);
}

Test(review_policy, old_token_is_stale_for_every_owner_call_after_the_transition)
{
    int64_t tok = claim_new("k");
    at(LEASE);
    expect_outcome(claim("k"), IDEM_REVIEW);
    uint64_t v = get("k").version;
    expect_rc(hold("k", tok, "mine"), IDEM_ESTALE);
    expect_rc(extend("k", tok, 1000), IDEM_ESTALE);
    expect_rc(release("k", tok), IDEM_ESTALE);
    expect_rc(commit("k", tok, "r"), IDEM_ESTALE);
    idem_record r = get("k");
    cr_assert_eq(r.state, IDEM_STATE_REVIEW);
    cr_assert_eq(r.version, v);
}

Test(review_policy, old_owner_may_commit_before_the_transition)
{
    int64_t tok = claim_new("k");
    at(LEASE + 100);
    commit_ok("k", tok, "r");
    expect_outcome(claim("k"), IDEM_DONE);
}

Test(review_policy, review_from_expired_lease_never_expires_and_resolves)
{
    claim_new("k");
    at(LEASE);
    expect_outcome(claim("k"), IDEM_REVIEW);
    at(10 * TTL);
    expect_outcome(claim("k"), IDEM_REVIEW);
    expect_rc(resolve("k", IDEM_RESOLVE_RELEASE, "target shows nothing", 0), IDEM_OK);
    expect_outcome(claim("k"), IDEM_NEW);
}

Test(review_policy, review_transitions_are_counted_as_review_claims)
{
    claim_new("k");
    at(LEASE);
    idem_stats b = stats();
    expect_outcome(claim("k"), IDEM_REVIEW);
    idem_stats a = stats();
    cr_assert_eq(a.claims_review, b.claims_review + 1);
    cr_assert_eq(a.claims_recover, b.claims_recover);
    cr_assert_eq(a.keys_review, b.keys_review + 1);
    cr_assert_eq(a.keys_in_flight + 1, b.keys_in_flight);
}

/* Rule 6's transition is made lazily by an operator's action too: found by a review of the
 * claim rules, a decision on a lapsed lease under this policy was recorded as made on an
 * in_flight record, like one on a live lease (which needs FORCE). */
Test(review_policy, an_operator_action_on_a_lapsed_lease_is_recorded_as_on_review)
{
    claim_new("k");
    uint64_t v = get("k").version;
    at(LEASE); /* lapsed; no claim came */
    expect_rc(resolve("k", IDEM_RESOLVE_SETTLE, "checked the target", 0), IDEM_OK);
    claim_new("j");
    at(LEASE + 1); /* j's lease runs: FORCE, and the record is in_flight */
    expect_rc(resolve("j", IDEM_RESOLVE_RELEASE, "checked", IDEM_F_FORCE), IDEM_OK);
    const idem_audit_entry *e;
    size_t n = 0;
    expect_rc(idem_audit(g_q, "k", 1, 10, &e, &n), IDEM_OK);
    cr_assert_eq(n, 1);
    cr_assert_eq(e[0].state_before, IDEM_STATE_REVIEW, "recorded as made on state %d",
                 e[0].state_before);
    cr_assert_eq(e[0].version_before, v);
    cr_assert_eq(e[0].state_after, IDEM_STATE_COMMITTED);
    expect_rc(idem_audit(g_q, "j", 1, 10, &e, &n), IDEM_OK);
    cr_assert_eq(n, 1);
    cr_assert_eq(e[0].state_before, IDEM_STATE_IN_FLIGHT);
}

/* ------------------------------------------------------------------------------------------ */
/* Rule 7: only the owner finishes; owner calls are idempotent. */

TestSuite(fencing, .init = setup, .fini = teardown);

Test(fencing, stale_token_after_recover_gets_estale_and_changes_nothing)
{
    int64_t old = claim_new("k");
    at(LEASE);
    idem_completion c = claim("k");
    expect_outcome(c, IDEM_RECOVER);
    idem_record r = get("k");
    uint64_t v = r.version;
    int64_t lease_until = r.lease_until_ms;
    expect_rc(commit("k", old, "late"), IDEM_ESTALE);
    expect_rc(extend("k", old, 100000), IDEM_ESTALE);
    expect_rc(hold("k", old, "late"), IDEM_ESTALE);
    expect_rc(release("k", old), IDEM_ESTALE);
    r = get("k");
    cr_assert_eq(r.state, IDEM_STATE_IN_FLIGHT);
    cr_assert_eq(r.token, c.token);
    cr_assert_eq(r.version, v);
    cr_assert_eq(r.lease_until_ms, lease_until);
    cr_assert_eq(r.result_len, 0);
    cr_assert_eq(r.note_len, 0);
    commit_ok("k", c.token, "r");
}

Test(fencing, token_never_granted_is_stale)
{
    int64_t tok = claim_new("k");
    expect_rc(commit("k", tok + 1000, "x"), IDEM_ESTALE);
    expect_rc(commit("k", tok + 1, "x"), IDEM_ESTALE);
    cr_assert_eq(get("k").state, IDEM_STATE_IN_FLIGHT);
}

Test(fencing, stale_token_on_committed_record_is_estale)
{
    int64_t old = claim_new("k");
    at(LEASE);
    idem_completion c = claim("k");
    commit_ok("k", c.token, "r");
    expect_rc(commit("k", old, "r"), IDEM_ESTALE);
    expect_result(get("k"), "r");
}

Test(fencing, commit_repeated_with_same_result_is_ok)
{
    int64_t tok = claim_new("k");
    commit_ok("k", tok, "inv-1");
    uint64_t v = get("k").version;
    at(100);
    commit_ok("k", tok, "inv-1");
    idem_record r = get("k");
    expect_result(r, "inv-1");
    cr_assert_eq(r.version, v);
}

Test(fencing, commit_repeated_with_different_result_is_conflict_and_counted)
{
    int64_t tok = claim_new("k");
    commit_ok("k", tok, "inv-1");
    idem_stats b = stats();
    expect_rc(commit("k", tok, "inv-2"), IDEM_ECONFLICT);
    idem_stats a = stats();
    cr_assert_eq(a.conflicting_commits, b.conflicting_commits + 1);
    idem_completion c = claim("k");
    expect_outcome(c, IDEM_DONE);
    expect_data(c, "inv-1");
}

Test(fencing, release_deletes_the_record_and_next_claim_is_new)
{
    int64_t tok = claim_new("k");
    at(10);
    expect_rc(release("k", tok), IDEM_OK);
    cr_assert_not(found("k"));
    at(20);
    idem_completion c = claim("k");
    expect_outcome(c, IDEM_NEW);
    cr_assert_gt(c.token, tok);
    idem_record r = get("k");
    cr_assert_eq(r.first_seen_ms, t0 + 20);
    cr_assert_eq(r.seen_count, 1);
    cr_assert_eq(r.attempts, 1);
}

Test(fencing, owner_calls_on_absent_key_are_notfound)
{
    expect_rc(release("nope", 1), IDEM_ENOTFOUND);
    expect_rc(commit("nope", 1, "r"), IDEM_ENOTFOUND);
    expect_rc(hold("nope", 1, "why"), IDEM_ENOTFOUND);
    expect_rc(extend("nope", 1, 1000), IDEM_ENOTFOUND);
    cr_assert_not(found("nope"));
}

Test(fencing, release_repeated_is_notfound)
{
    int64_t tok = claim_new("k");
    expect_rc(release("k", tok), IDEM_OK);
    expect_rc(release("k", tok), IDEM_ENOTFOUND);
    expect_rc(commit("k", tok, "r"), IDEM_ENOTFOUND);
}

Test(fencing, hold_turns_in_flight_into_review_with_note)
{
    int64_t tok = claim_new("k");
    at(30);
    expect_rc(hold("k", tok, "gateway timed out"), IDEM_OK);
    idem_record r = get("k");
    cr_assert_eq(r.state, IDEM_STATE_REVIEW);
    expect_note(r, "gateway timed out");
    cr_assert_eq(r.first_seen_ms, t0);
    idem_completion c = claim("k");
    expect_outcome(c, IDEM_REVIEW);
    expect_data(c, "gateway timed out");
}

Test(fencing, holder_token_is_stale_after_hold_but_repeated_hold_is_ok)
{
    int64_t tok = claim_new("k");
    expect_rc(hold("k", tok, "unsure"), IDEM_OK);
    uint64_t v = get("k").version;
    expect_rc(commit("k", tok, "r"), IDEM_ESTALE);
    expect_rc(extend("k", tok, 1000), IDEM_ESTALE);
    expect_rc(release("k", tok), IDEM_ESTALE);
    expect_rc(hold("k", tok, "unsure"), IDEM_OK);
    idem_record r = get("k");
    cr_assert_eq(r.state, IDEM_STATE_REVIEW);
    cr_assert_eq(r.version, v);
    expect_note(r, "unsure");
}

/* The note is the last reason a hold gave: the holder's repeated hold with a new reason records
 * it, as a new version (it answered OK and kept the first); the same reason changes nothing. The
 * record stays in review, and the token stale for everything else. */
Test(fencing, a_repeated_hold_with_a_new_reason_records_it)
{
    int64_t tok = claim_new("k");
    expect_rc(hold("k", tok, "unsure"), IDEM_OK);
    uint64_t v = get("k").version;
    expect_rc(hold("k", tok, "the gateway answered 502 twice"), IDEM_OK);
    idem_record r = get("k");
    cr_assert_eq(r.state, IDEM_STATE_REVIEW);
    cr_assert_gt(r.version, v, "a new note without a new version");
    expect_note(r, "the gateway answered 502 twice");
    expect_data(claim("k"), "the gateway answered 502 twice");
    v = r.version;
    expect_rc(hold("k", tok, "the gateway answered 502 twice"), IDEM_OK);
    cr_assert_eq(get("k").version, v);
    expect_rc(commit("k", tok, "r"), IDEM_ESTALE);
    reopen();
    expect_note(get("k"), "the gateway answered 502 twice");
}

Test(fencing, hold_with_an_earlier_owners_token_on_a_review_record_is_estale)
{
    int64_t t1 = claim_new("k");
    at(LEASE);
    idem_completion r = claim("k");
    expect_outcome(r, IDEM_RECOVER);
    expect_rc(hold("k", r.token, "unsure"), IDEM_OK);
    expect_rc(hold("k", t1, "mine"), IDEM_ESTALE);
    expect_note(get("k"), "unsure");
}

Test(fencing, review_record_claims_never_grant_ownership)
{
    int64_t tok = claim_new("k");
    expect_rc(hold("k", tok, "unsure"), IDEM_OK);
    at(LEASE * 3);
    for (int i = 0; i < 3; i++)
        expect_outcome(claim("k"), IDEM_REVIEW);
    cr_assert_eq(get("k").attempts, 1);
}

/* ------------------------------------------------------------------------------------------ */
/* OWNER: a worker whose reply was lost resumes its own claim. */

TestSuite(owner, .init = setup, .fini = teardown);

Test(owner, same_owner_repeat_while_lease_runs_gets_same_token_as_new)
{
    idem_completion a = claim_owner("k", "worker-7");
    expect_outcome(a, IDEM_NEW);
    at(100);
    idem_completion b = claim_owner("k", "worker-7");
    expect_outcome(b, IDEM_NEW);
    cr_assert_eq(b.token, a.token);
    idem_record r = get("k");
    cr_assert_eq(r.attempts, 1);
    cr_assert_eq(r.first_seen_ms, t0);
    commit_ok("k", a.token, "r");
}

Test(owner, same_owner_repeat_runs_the_lease_on_from_now)
{
    claim_owner("k", "worker-7");
    at(LEASE - 1);
    expect_outcome(claim_owner("k", "worker-7"), IDEM_NEW);
    cr_assert_eq(get("k").lease_until_ms, t0 + LEASE - 1 + LEASE);
    at(LEASE + 100);
    idem_completion b = claim_owner("k", "worker-8");
    expect_outcome(b, IDEM_BUSY);
    cr_assert_eq(b.lease_left_ms, LEASE - 1 - 100);
}

Test(owner, another_owner_gets_busy)
{
    claim_owner("k", "worker-7");
    at(10);
    idem_completion b = claim_owner("k", "worker-8");
    expect_outcome(b, IDEM_BUSY);
    cr_assert_eq(b.lease_left_ms, LEASE - 10);
}

Test(owner, claim_without_owner_gets_busy)
{
    claim_owner("k", "worker-7");
    expect_outcome(claim("k"), IDEM_BUSY);
}

Test(owner, owner_ids_are_compared_in_full)
{
    claim_owner("k", "worker-7");
    expect_outcome(claim_owner("k", "worker-70"), IDEM_BUSY);
    expect_outcome(claim_owner("k", "worker-"), IDEM_BUSY);
}

Test(owner, same_owner_after_lease_ran_out_gets_recover)
{
    idem_completion a = claim_owner("k", "worker-7");
    at(LEASE);
    idem_completion b = claim_owner("k", "worker-7");
    expect_outcome(b, IDEM_RECOVER);
    cr_assert_gt(b.token, a.token);
    cr_assert_eq(b.attempts, 2);
    cr_assert_eq(b.last_grant_ms, t0);
}

Test(owner, same_owner_repeat_on_committed_is_done)
{
    idem_completion a = claim_owner("k", "worker-7");
    commit_ok("k", a.token, "r");
    idem_completion b = claim_owner("k", "worker-7");
    expect_outcome(b, IDEM_DONE);
    expect_data(b, "r");
}

/* ------------------------------------------------------------------------------------------ */
/* Versions and tokens. */

TestSuite(version, .init = setup, .fini = teardown);

Test(version, changes_on_every_logged_change_and_never_on_a_plain_repeat)
{
    idem_completion a = claim_fp("k", "body");
    uint64_t v1 = get("k").version;
    at(10);
    expect_outcome(claim_fp("k", "body"), IDEM_BUSY);
    cr_assert_eq(get("k").version, v1, "a busy repeat changed the version");
    expect_rc(extend("k", a.token, LEASE), IDEM_OK);
    uint64_t v2 = get("k").version;
    cr_assert_neq(v2, v1, "extend did not change the version");
    expect_outcome(claim_fp("k", "other"), IDEM_MISMATCH);
    uint64_t v3 = get("k").version;
    cr_assert_neq(v3, v2, "a recorded mismatch did not change the version");
    commit_ok("k", a.token, "r");
    uint64_t v4 = get("k").version;
    cr_assert_neq(v4, v3, "commit did not change the version");
    at(20);
    expect_outcome(claim_fp("k", "body"), IDEM_DONE);
    expect_outcome(claim("k"), IDEM_DONE);
    cr_assert_eq(get("k").version, v4, "a done repeat changed the version");
    expect_outcome(claim_fp("k", "other"), IDEM_MISMATCH);
    cr_assert_neq(get("k").version, v4, "a mismatch on committed did not change the version");
}

Test(version, changes_on_recover_and_hold)
{
    claim_new("k");
    uint64_t v1 = get("k").version;
    at(LEASE);
    idem_completion r = claim("k");
    expect_outcome(r, IDEM_RECOVER);
    uint64_t v2 = get("k").version;
    cr_assert_neq(v2, v1);
    expect_rc(hold("k", r.token, "why"), IDEM_OK);
    uint64_t v3 = get("k").version;
    cr_assert_neq(v3, v2);
    expect_outcome(claim("k"), IDEM_REVIEW);
    cr_assert_eq(get("k").version, v3);
}

Test(version, a_new_lifetime_gets_a_different_version)
{
    int64_t tok = claim_new("k");
    uint64_t v1 = get("k").version;
    expect_rc(release("k", tok), IDEM_OK);
    claim_new("k");
    cr_assert_neq(get("k").version, v1);
}

Test(version, tokens_strictly_increase_across_keys_and_lifetimes)
{
    int64_t last = 0;
    char key[32];
    int news = 0;
    for (int i = 0; i < 50; i++) {
        snprintf(key, sizeof key, "k%d", i % 7);
        idem_completion c = claim(key);
        if (c.outcome == IDEM_NEW) {
            cr_assert_gt(c.token, last, "token %" PRId64 " after %" PRId64, c.token, last);
            last = c.token;
            news++;
            if (i % 2)
                expect_rc(release(key, c.token), IDEM_OK);
            else
                commit_ok(key, c.token, "r");
        }
        if (i % 10 == 9) {
            at((i + 1) * 20000);
        }
    }
    /* Each round of ten: seven keys new, then k(i-7) again: done after a commit (even i), new
     * after a release (odd i). */
    cr_assert_eq(news, 5 * 8, "%d claims were new", news);
}

static void tokens_never_repeat_across_reopen(int durability)
{
    store_close();
    g_opts.durability = durability;
    store_open();
    int64_t last = 0;
    char key[32];
    for (int round = 0; round < 4; round++) {
        for (int i = 0; i < 10; i++) {
            snprintf(key, sizeof key, "r%d-%d", round, i);
            idem_completion c = claim(key);
            expect_outcome(c, IDEM_NEW);
            cr_assert_gt(c.token, last, "round %d: token %" PRId64 " after %" PRId64, round,
                         c.token, last);
            last = c.token;
            if (i % 3 == 0) expect_rc(release(key, c.token), IDEM_OK);
        }
        reopen();
    }
}

Test(version, tokens_never_repeat_across_close_and_reopen)
{
    tokens_never_repeat_across_reopen(IDEM_DURABILITY_SYNC);
}

Test(version, tokens_never_repeat_across_close_and_reopen_in_batch_mode)
{
    tokens_never_repeat_across_reopen(IDEM_DURABILITY_BATCH);
}

Test(version, tokens_never_repeat_across_close_and_reopen_without_durability)
{
    tokens_never_repeat_across_reopen(IDEM_DURABILITY_NONE);
}

/* ------------------------------------------------------------------------------------------ */
/* Operator resolve (rule 9 for its audit trail). */

TestSuite(resolve, .init = setup, .fini = teardown);

static int64_t make_review(const char *key, const char *note)
{
    int64_t tok = claim_new(key);
    expect_rc(hold(key, tok, note), IDEM_OK);
    return tok;
}

/* An entry longer than a 4 KiB block (the longest key, actor and reason) is written and kept;
 * earlier versions refused it only after the change was made, leaving it unaudited. */
Test(resolve, a_decision_with_the_longest_key_actor_and_reason_is_audited)
{
    static char key[IDEM_KEY_BYTES_MAX + 1], reason[IDEM_NOTE_BYTES_MAX + 1],
        actor[IDEM_ACTOR_BYTES_MAX + 1];
    memset(key, 'k', IDEM_KEY_BYTES_MAX);
    memset(reason, 'r', IDEM_NOTE_BYTES_MAX);
    memset(actor, 'a', IDEM_ACTOR_BYTES_MAX);
    make_review(key, "unsure");
    expect_rc(resolve_full(key, IDEM_RESOLVE_COMMIT, reason, "done", 0, 0, actor), IDEM_OK);
    cr_assert_eq(get(key).state, IDEM_STATE_COMMITTED);
    for (int round = 0; round < 2; round++) {
        const idem_audit_entry *e;
        size_t n = 0;
        expect_rc(idem_audit(g_q, key, IDEM_KEY_BYTES_MAX, 10, &e, &n), IDEM_OK);
        cr_assert_eq(n, 1, "round %d: %zu entries", round, n);
        cr_assert_str_eq(e[0].reason, reason);
        cr_assert_str_eq(e[0].actor, actor);
        cr_assert_str_eq(e[0].action, "resolve-commit");
        reopen();
    }
}

Test(resolve, commit_on_review_commits_with_the_given_result)
{
    make_review("k", "unsure");
    expect_rc(resolve_full("k", IDEM_RESOLVE_COMMIT, "ledger shows it", "inv-3", 0, 0, "alice"),
              IDEM_OK);
    idem_record r = get("k");
    cr_assert_eq(r.state, IDEM_STATE_COMMITTED);
    expect_result(r, "inv-3");
    cr_assert_eq(r.first_seen_ms, t0);
    idem_completion c = claim("k");
    expect_outcome(c, IDEM_DONE);
    expect_data(c, "inv-3");
}

Test(resolve, commit_without_result_commits_an_empty_result)
{
    make_review("k", "unsure");
    expect_rc(resolve("k", IDEM_RESOLVE_COMMIT, "it happened", 0), IDEM_OK);
    idem_completion c = claim("k");
    expect_outcome(c, IDEM_DONE);
    cr_assert_eq(c.data_len, 0);
}

Test(resolve, release_on_review_deletes_and_reoffers)
{
    int64_t tok = make_review("k", "unsure");
    expect_rc(resolve("k", IDEM_RESOLVE_RELEASE, "never reached the bank", 0), IDEM_OK);
    cr_assert_not(found("k"));
    idem_completion c = claim("k");
    expect_outcome(c, IDEM_NEW);
    cr_assert_gt(c.token, tok);
}

Test(resolve, settle_on_review_commits_with_the_current_empty_result)
{
    make_review("k", "unsure");
    expect_rc(resolve("k", IDEM_RESOLVE_SETTLE, "close it", 0), IDEM_OK);
    idem_record r = get("k");
    cr_assert_eq(r.state, IDEM_STATE_COMMITTED);
    cr_assert_eq(r.result_len, 0);
    expect_outcome(claim("k"), IDEM_DONE);
}

Test(resolve, resolve_records_the_reason_as_note)
{
    make_review("k", "unsure");
    expect_rc(resolve("k", IDEM_RESOLVE_SETTLE, "closed by ops", 0), IDEM_OK);
    expect_note(get("k"), "closed by ops");
}

Test(resolve, refused_on_committed_with_estate)
{
    make_committed("k", NULL, "r");
    uint64_t v = get("k").version;
    expect_rc(resolve("k", IDEM_RESOLVE_RELEASE, "x", IDEM_F_FORCE), IDEM_ESTATE);
    expect_rc(resolve("k", IDEM_RESOLVE_COMMIT, "x", 0), IDEM_ESTATE);
    expect_rc(resolve("k", IDEM_RESOLVE_SETTLE, "x", 0), IDEM_ESTATE);
    idem_record r = get("k");
    cr_assert_eq(r.state, IDEM_STATE_COMMITTED);
    expect_result(r, "r");
    cr_assert_eq(r.version, v);
}

Test(resolve, on_absent_key_is_notfound)
{
    expect_rc(resolve("nope", IDEM_RESOLVE_RELEASE, "x", IDEM_F_FORCE), IDEM_ENOTFOUND);
    cr_assert_not(found("nope"));
}

Test(resolve, running_lease_needs_force)
{
    int64_t tok = claim_new("k");
    uint64_t v = get("k").version;
    at(LEASE - 1);
    expect_rc(resolve("k", IDEM_RESOLVE_COMMIT, "x", 0), IDEM_ELEASE);
    idem_record r = get("k");
    cr_assert_eq(r.state, IDEM_STATE_IN_FLIGHT);
    cr_assert_eq(r.version, v);
    cr_assert_eq(r.token, tok);
    expect_rc(resolve("k", IDEM_RESOLVE_COMMIT, "x", IDEM_F_FORCE), IDEM_OK);
    cr_assert_eq(get("k").state, IDEM_STATE_COMMITTED);
}

/* A resolve leaves no owner. The token after the claim's (what the next grant would take) is
 * stale as much as the claim's own: with a fresh token kept in the record, that guess was taken
 * for the owner's, and a commit with another result answered CONFLICT (and was counted). */
Test(resolve, leaves_no_token_current)
{
    int64_t tok = claim_new("k");
    expect_rc(resolve("k", IDEM_RESOLVE_COMMIT, "x", IDEM_F_FORCE), IDEM_OK);
    for (int64_t t = tok; t <= tok + 2; t++)
        expect_rc(commit("k", t, "other"), IDEM_ESTALE);
    cr_assert_eq(stats().conflicting_commits, 0);
}

Test(resolve, expired_lease_needs_no_force)
{
    claim_new("k");
    at(LEASE);
    expect_rc(resolve("k", IDEM_RESOLVE_SETTLE, "x", 0), IDEM_OK);
    cr_assert_eq(get("k").state, IDEM_STATE_COMMITTED);
}

Test(resolve, release_of_in_flight_with_force_deletes)
{
    claim_new("k");
    expect_rc(resolve("k", IDEM_RESOLVE_RELEASE, "stuck worker", IDEM_F_FORCE), IDEM_OK);
    cr_assert_not(found("k"));
    expect_outcome(claim("k"), IDEM_NEW);
}

Test(resolve, wrong_expected_version_is_echanged_and_changes_nothing)
{
    make_review("k", "unsure");
    uint64_t v = get("k").version;
    expect_rc(resolve_full("k", IDEM_RESOLVE_COMMIT, "x", "r", IDEM_F_EXPECT, v + 1, "alice"),
              IDEM_ECHANGED);
    expect_rc(resolve_full("k", IDEM_RESOLVE_COMMIT, "x", "r", IDEM_F_EXPECT, v - 1, "alice"),
              IDEM_ECHANGED);
    idem_record r = get("k");
    cr_assert_eq(r.state, IDEM_STATE_REVIEW);
    cr_assert_eq(r.version, v);
    expect_rc(resolve_full("k", IDEM_RESOLVE_COMMIT, "x", "r", IDEM_F_EXPECT, v, "alice"), IDEM_OK);
    cr_assert_eq(get("k").state, IDEM_STATE_COMMITTED);
}

Test(resolve, version_seen_before_a_change_is_echanged)
{
    idem_completion a = claim_fp("k", "body");
    uint64_t seen = get("k").version;
    expect_rc(extend("k", a.token, LEASE), IDEM_OK);
    at(LEASE * 2);
    expect_rc(resolve_full("k", IDEM_RESOLVE_RELEASE, "x", NULL, IDEM_F_EXPECT, seen, "alice"),
              IDEM_ECHANGED);
    cr_assert(found("k"));
}

Test(resolve, every_resolve_bumps_the_token_so_the_old_owner_is_stale)
{
    int64_t tok = claim_new("k");
    expect_rc(resolve("k", IDEM_RESOLVE_SETTLE, "x", IDEM_F_FORCE), IDEM_OK);
    expect_rc(commit("k", tok, ""), IDEM_ESTALE);
    expect_rc(hold("k", tok, "x"), IDEM_ESTALE);
    cr_assert_eq(get("k").state, IDEM_STATE_COMMITTED);

    int64_t t2 = claim_new("k2");
    at(LEASE);
    expect_rc(resolve_full("k2", IDEM_RESOLVE_COMMIT, "x", "inv", 0, 0, "bob"), IDEM_OK);
    expect_rc(commit("k2", t2, "inv"), IDEM_ESTALE);

    int64_t t3 = claim_new("k3");
    expect_rc(resolve("k3", IDEM_RESOLVE_RELEASE, "x", IDEM_F_FORCE), IDEM_OK);
    expect_rc(commit("k3", t3, "r"), IDEM_ENOTFOUND);
    int64_t t4 = claim_new("k3");
    cr_assert_gt(t4, t3);
}

/* Found by a review of the claim rules: the trail said neither that a decision overrode a
 * running lease (FORCE) nor which outcome it recorded, nor which one a DEL erased (the next
 * claim of the key gets new: the side effect may happen again). Once the key is gone the trail
 * is all that is left of the decision. Kept across a reopen, read back from the file. */
Test(resolve, the_audit_keeps_force_a_lapsed_lease_and_the_result)
{
    claim_new("f"); /* its lease runs: FORCE needed */
    expect_rc(
        resolve_full("f", IDEM_RESOLVE_COMMIT, "bank says paid", "inv-9", IDEM_F_FORCE, 0, "alice"),
        IDEM_OK);
    claim_new("l");
    char big[1000];
    for (size_t i = 0; i < sizeof big - 1; i++)
        big[i] = (char)('a' + i % 26);
    big[sizeof big - 1] = 0;
    at(LEASE); /* l's lease ran out; FORCE given all the same is not recorded as needed */
    expect_rc(resolve_full("l", IDEM_RESOLVE_COMMIT, "checked", big, IDEM_F_FORCE, 0, "bob"),
              IDEM_OK);
    make_committed("d", NULL, "ch_3R2b");
    expect_rc(idem_del(g_q, "d", 1, "carol"), IDEM_OK);
    make_review("r", "unsure");
    expect_rc(resolve("r", IDEM_RESOLVE_RELEASE, "nothing there", 0), IDEM_OK);
    for (int pass = 0; pass < 2; pass++) {
        const idem_audit_entry *e;
        size_t n = 0;
        expect_rc(idem_audit(g_q, NULL, 0, 10, &e, &n), IDEM_OK);
        cr_assert_eq(n, 4);
        /* newest first: r, d, l, f */
        cr_assert_eq(e[0].flags, 0, "a release of a review record: %#x", e[0].flags);
        cr_assert_null(e[0].result);
        cr_assert_str_eq(e[1].action, "del");
        cr_assert_eq(e[1].flags, IDEM_AUDIT_RESULT);
        cr_assert_eq(e[1].result_len, 7);
        cr_assert_eq(e[1].result_full_len, 7);
        cr_assert_eq(memcmp(e[1].result, "ch_3R2b", 7), 0);
        cr_assert_eq(e[2].flags, IDEM_AUDIT_LEASE_LAPSED | IDEM_AUDIT_RESULT, "%#x", e[2].flags);
        cr_assert_eq(e[2].state_before, IDEM_STATE_IN_FLIGHT);
        cr_assert_eq(e[2].result_full_len, sizeof big - 1);
        cr_assert_eq(e[2].result_len, IDEM_AUDIT_RESULT_KEPT);
        cr_assert_eq(memcmp(e[2].result, big, IDEM_AUDIT_RESULT_KEPT), 0);
        cr_assert_eq(e[3].flags, IDEM_AUDIT_FORCED | IDEM_AUDIT_RESULT, "%#x", e[3].flags);
        cr_assert_eq(e[3].result_len, 5);
        cr_assert_eq(memcmp(e[3].result, "inv-9", 5), 0);
        cr_assert_str_eq(e[3].reason, "bank says paid");
        if (pass == 0) reopen();
    }
}

/* A DEL of a result stored compressed keeps its first bytes decoded, and only those are: the
 * whole result (up to the store's limit) was decoded under the lock to keep 256 bytes. */
Test(del, the_audit_keeps_the_head_of_a_compressed_result_erased)
{
    static char big[3000];
    memset(big, 'z', sizeof big - 1);
    make_committed("z", NULL, big);
    expect_rc(idem_del(g_q, "z", 1, "carol"), IDEM_OK);
    const idem_audit_entry *e;
    size_t n = 0;
    expect_rc(idem_audit(g_q, "z", 1, 10, &e, &n), IDEM_OK);
    cr_assert_eq(n, 1);
    cr_assert_eq(e[0].flags, IDEM_AUDIT_RESULT);
    cr_assert_eq(e[0].result_full_len, sizeof big - 1);
    cr_assert_eq(e[0].result_len, IDEM_AUDIT_RESULT_KEPT);
    cr_assert_eq(memcmp(e[0].result, big, IDEM_AUDIT_RESULT_KEPT), 0);
}

Test(resolve, every_resolve_appears_in_the_audit_newest_first)
{
    make_review("a", "n1");
    at(100);
    expect_rc(resolve_full("a", IDEM_RESOLVE_COMMIT, "bank says paid", "inv", 0, 0, "alice"),
              IDEM_OK);
    make_review("b", "n2");
    uint64_t vb = get("b").version;
    at(200);
    expect_rc(resolve_full("b", IDEM_RESOLVE_RELEASE, "bank says no", NULL, 0, 0, "bob"), IDEM_OK);
    claim_new("c");
    uint64_t vc = get("c").version;
    at(300);
    expect_rc(resolve_full("c", IDEM_RESOLVE_SETTLE, "leave it", NULL, IDEM_F_FORCE, 0, "carol"),
              IDEM_OK);
    uint64_t vc2 = get("c").version;

    const idem_audit_entry *e;
    size_t n = 0;
    expect_rc(idem_audit(g_q, NULL, 0, 10, &e, &n), IDEM_OK);
    cr_assert_eq(n, 3);
    cr_assert_str_eq(e[0].actor, "carol");
    cr_assert_str_eq(e[0].action, "resolve-settle");
    cr_assert_str_eq(e[0].reason, "leave it");
    cr_assert_eq(e[0].key_len, 1);
    cr_assert(memcmp(e[0].key, "c", 1) == 0);
    cr_assert_eq(e[0].at_ms, t0 + 300);
    cr_assert_eq(e[0].state_before, IDEM_STATE_IN_FLIGHT);
    cr_assert_eq(e[0].state_after, IDEM_STATE_COMMITTED);
    cr_assert_eq(e[0].version_before, vc);
    cr_assert_eq(e[0].version_after, vc2);

    cr_assert_str_eq(e[1].actor, "bob");
    cr_assert_str_eq(e[1].action, "resolve-release");
    cr_assert_str_eq(e[1].reason, "bank says no");
    cr_assert_eq(e[1].at_ms, t0 + 200);
    cr_assert_eq(e[1].state_before, IDEM_STATE_REVIEW);
    cr_assert_eq(e[1].state_after, 0);
    cr_assert_eq(e[1].version_before, vb);

    cr_assert_str_eq(e[2].actor, "alice");
    cr_assert_str_eq(e[2].action, "resolve-commit");
    cr_assert_str_eq(e[2].reason, "bank says paid");
    cr_assert_eq(e[2].state_before, IDEM_STATE_REVIEW);
    cr_assert_eq(e[2].state_after, IDEM_STATE_COMMITTED);
    cr_assert_eq(e[2].at_ms, t0 + 100);

    cr_assert_gt(e[0].seq, e[1].seq);
    cr_assert_gt(e[1].seq, e[2].seq);
}

Test(resolve, audit_filters_by_key_and_count)
{
    make_review("a", "n");
    expect_rc(resolve("a", IDEM_RESOLVE_RELEASE, "first", 0), IDEM_OK);
    make_review("b", "n");
    expect_rc(resolve("b", IDEM_RESOLVE_SETTLE, "other", 0), IDEM_OK);
    make_review("a", "n");
    expect_rc(resolve("a", IDEM_RESOLVE_SETTLE, "second", 0), IDEM_OK);

    const idem_audit_entry *e;
    size_t n = 0;
    expect_rc(idem_audit(g_q, "a", 1, 10, &e, &n), IDEM_OK);
    cr_assert_eq(n, 2);
    cr_assert_str_eq(e[0].reason, "second");
    cr_assert_str_eq(e[1].reason, "first");
    expect_rc(idem_audit(g_q, NULL, 0, 1, &e, &n), IDEM_OK);
    cr_assert_eq(n, 1);
    cr_assert_str_eq(e[0].reason, "second");
}

Test(resolve, refused_resolves_are_not_audited_as_done)
{
    make_committed("k", NULL, "r");
    expect_rc(resolve("k", IDEM_RESOLVE_RELEASE, "x", 0), IDEM_ESTATE);
    const idem_audit_entry *e;
    size_t n = 0;
    expect_rc(idem_audit(g_q, "k", 1, 10, &e, &n), IDEM_OK);
    cr_assert_eq(n, 0, "a refused resolve left %zu audit entries", n);
}

/* ------------------------------------------------------------------------------------------ */
/* DEL (admin). */

TestSuite(del, .init = setup, .fini = teardown);

Test(del, refused_on_in_flight_with_estate)
{
    int64_t tok = claim_new("k");
    expect_rc(idem_del(g_q, "k", 1, "alice"), IDEM_ESTATE);
    idem_record r = get("k");
    cr_assert_eq(r.state, IDEM_STATE_IN_FLIGHT);
    cr_assert_eq(r.token, tok);
}

Test(del, refused_on_review_with_estate)
{
    make_review("k", "unsure");
    expect_rc(idem_del(g_q, "k", 1, "alice"), IDEM_ESTATE);
    cr_assert_eq(get("k").state, IDEM_STATE_REVIEW);
}

Test(del, deletes_committed_and_is_audited)
{
    make_committed("k", NULL, "r");
    uint64_t v = get("k").version;
    at(50);
    expect_rc(idem_del(g_q, "k", 1, "alice"), IDEM_OK);
    cr_assert_not(found("k"));
    expect_outcome(claim("k"), IDEM_NEW);

    const idem_audit_entry *e;
    size_t n = 0;
    expect_rc(idem_audit(g_q, "k", 1, 10, &e, &n), IDEM_OK);
    cr_assert_eq(n, 1);
    cr_assert_str_eq(e[0].action, "del");
    cr_assert_str_eq(e[0].actor, "alice");
    cr_assert_eq(e[0].state_before, IDEM_STATE_COMMITTED);
    cr_assert_eq(e[0].state_after, 0);
    cr_assert_eq(e[0].version_before, v);
    cr_assert_eq(e[0].at_ms, t0 + 50);
}

static void operator_calls_between_changes(int durability)
{
    store_close();
    g_opts.durability = durability;
    store_open();
    char key[32];
    for (int i = 0; i < 300; i++) {
        snprintf(key, sizeof key, "k%d", i);
        int64_t tok = claim_new(key);
        if (i % 2) {
            commit_ok(key, tok, "r");
            expect_rc(idem_del(g_q, key, strlen(key), "alice"), IDEM_OK);
        } else {
            expect_rc(resolve(key, IDEM_RESOLVE_SETTLE, "x", IDEM_F_FORCE), IDEM_OK);
        }
    }
    const idem_audit_entry *e;
    size_t n = 0;
    expect_rc(idem_audit(g_q, NULL, 0, 1000, &e, &n), IDEM_OK);
    cr_assert_eq(n, 300);
    reopen();
    expect_rc(idem_audit(g_q, NULL, 0, 1000, &e, &n), IDEM_OK);
    cr_assert_eq(n, 300, "%zu audit entries after reopen, expected 300", n);
}

Test(del, operator_calls_between_changes_in_sync_mode)
{
    operator_calls_between_changes(IDEM_DURABILITY_SYNC);
}

Test(del, operator_calls_between_changes_in_batch_mode)
{
    operator_calls_between_changes(IDEM_DURABILITY_BATCH);
}

Test(del, operator_calls_between_changes_without_durability)
{
    operator_calls_between_changes(IDEM_DURABILITY_NONE);
}

Test(del, absent_key_is_notfound)
{
    expect_rc(idem_del(g_q, "nope", 4, "alice"), IDEM_ENOTFOUND);
}

/* Deletes of keys[0..n) as one group (IDEM_F_WITH_NEXT on all but the last, or on all when
 * unterminated), submitted at once; their completions in out[], in order. */
static void del_group(const char *const *keys, int n, int unterminated, idem_completion *out)
{
    idem_op ops[8];
    cr_assert_leq(n, 8);
    for (int i = 0; i < n; i++)
        ops[i] = (idem_op){.kind = IDEM_OP_DEL,
                           .flags = i < n - 1 || unterminated ? IDEM_F_WITH_NEXT : 0,
                           .user_data = (uint64_t)i,
                           .key = keys[i],
                           .key_len = (uint32_t)strlen(keys[i]),
                           .actor = "alice"};
    cr_assert_eq(idem_submit(g_q, ops, (size_t)n), n);
    for (int got = 0; got < n;) {
        int k = idem_poll(g_q, out + got, (size_t)(n - got), 10000);
        cr_assert_gt(k, 0, "idem_poll: %d", k);
        got += k;
    }
    for (int i = 0; i < n; i++)
        cr_assert_eq(out[i].user_data, (uint64_t)i);
}

static size_t audit_count(void)
{
    const idem_audit_entry *e;
    size_t n = 0;
    expect_rc(idem_audit(g_q, NULL, 0, 1000, &e, &n), IDEM_OK);
    return n;
}

/* Found by a review of the audit trail: the room a group reserves for its entries (about 600 KB
 * for 64 deletes) stayed with the store for good. Now a buffer past 64 KiB is given back once
 * written (and memory_bytes counts the trail's buffers and map, which it left out). */
Test(del, the_room_a_large_group_reserves_for_its_audit_entries_is_given_back)
{
    static char keys[IDEM_DEL_GROUP_MAX][16];
    static idem_op ops[IDEM_DEL_GROUP_MAX];
    for (uint32_t i = 0; i < IDEM_DEL_GROUP_MAX; i++) {
        snprintf(keys[i], sizeof keys[i], "g%u", i);
        make_committed(keys[i], NULL, "r");
        ops[i] = (idem_op){.kind = IDEM_OP_DEL,
                           .flags = i < IDEM_DEL_GROUP_MAX - 1 ? IDEM_F_WITH_NEXT : 0,
                           .key = keys[i],
                           .key_len = (uint32_t)strlen(keys[i]),
                           .actor = "alice"};
    }
    idem_queue *q;
    expect_rc(idem_queue_open(g_s, 2 * IDEM_DEL_GROUP_MAX, &q), IDEM_OK);
    cr_assert_eq(idem_submit(q, ops, IDEM_DEL_GROUP_MAX), IDEM_DEL_GROUP_MAX);
    static idem_completion out[IDEM_DEL_GROUP_MAX];
    for (int got = 0; got < (int)IDEM_DEL_GROUP_MAX;) {
        int k = idem_poll(q, out + got, IDEM_DEL_GROUP_MAX - (size_t)got, 10000);
        cr_assert_gt(k, 0);
        got += k;
    }
    for (uint32_t i = 0; i < IDEM_DEL_GROUP_MAX; i++)
        cr_assert_eq(out[i].err, IDEM_OK, "delete %u: %s", i, idem_strerror(out[i].err));
    idem_queue_close(q);
    expect_rc(idem_sync(g_s), IDEM_OK);
    store_lock(g_s);
    size_t kept = g_s->audit_pend.cap + g_s->audit_out.cap;
    store_unlock(g_s);
    cr_assert_leq(kept, 2 * 64 * 1024, "%zu bytes of audit buffers kept", kept);
}

/* DEL k1 k2 k3 as idemd sends it: none is deleted if any is unfinished, and the completions say
 * which (in_flight, then review). */
Test(del, a_group_with_an_unfinished_record_deletes_none_and_names_it)
{
    make_committed("a", NULL, "r");
    claim_new("b");
    make_committed("c", NULL, "r");
    const char *keys[3] = {"a", "b", "c"};
    idem_completion c[3];
    for (int round = 0; round < 2; round++) {
        del_group(keys, 3, 0, c);
        for (int i = 0; i < 3; i++)
            cr_assert_eq(c[i].err, IDEM_ESTATE, "round %d, key %s: %s", round, keys[i],
                         idem_strerror(c[i].err));
        cr_assert_eq(c[0].found, 0);
        cr_assert_eq(c[2].found, 0);
        cr_assert_eq(c[1].found, 1);
        cr_assert_eq(c[1].record.state, round == 0 ? IDEM_STATE_IN_FLIGHT : IDEM_STATE_REVIEW);
        cr_assert(found("a") && found("b") && found("c"), "a refused group deleted something");
        cr_assert_eq(audit_count(), 0);
        if (round == 0) expect_rc(hold("b", get("b").token, "look"), IDEM_OK);
    }
}

Test(del, a_group_of_finished_records_deletes_them_all)
{
    make_committed("a", NULL, "r");
    make_committed("c", NULL, "r");
    const char *keys[3] = {"a", "absent", "c"};
    idem_completion c[3];
    del_group(keys, 3, 0, c);
    cr_assert_eq(c[0].err, IDEM_OK, "%s", idem_strerror(c[0].err));
    cr_assert_eq(c[1].err, IDEM_ENOTFOUND);
    cr_assert_eq(c[2].err, IDEM_OK);
    cr_assert(!found("a") && !found("c"));
    cr_assert_eq(audit_count(), 2);
}

/* A chain of IDEM_F_WITH_NEXT that no delete without the flag ends is refused whole; so is one
 * ended by another kind of operation, which itself runs as usual. */
Test(del, a_group_without_its_last_delete_is_invalid)
{
    make_committed("a", NULL, "r");
    make_committed("b", NULL, "r");
    const char *keys[2] = {"a", "b"};
    idem_completion c[2];
    del_group(keys, 2, 1, c);
    cr_assert_eq(c[0].err, IDEM_EINVAL);
    cr_assert_eq(c[1].err, IDEM_EINVAL);
    idem_op ops[2] = {{.kind = IDEM_OP_DEL, .flags = IDEM_F_WITH_NEXT, .key = "a", .key_len = 1},
                      {.kind = IDEM_OP_GET, .key = "b", .key_len = 1, .user_data = 1}};
    cr_assert_eq(idem_submit(g_q, ops, 2), 2);
    for (int got = 0; got < 2;) {
        int k = idem_poll(g_q, c + got, (size_t)(2 - got), 10000);
        cr_assert_gt(k, 0);
        got += k;
    }
    cr_assert_eq(c[0].err, IDEM_EINVAL);
    cr_assert_eq(c[1].err, IDEM_OK);
    cr_assert_eq(c[1].found, 1);
    cr_assert(found("a") && found("b"));
}

/* A group with an invalid delete in it, or of more than IDEM_DEL_GROUP_MAX deletes, deletes
 * nothing. */
Test(del, a_group_with_an_invalid_delete_or_too_many_deletes_nothing)
{
    make_committed("a", NULL, "r");
    make_committed("b", NULL, "r");
    static char long_key[IDEM_KEY_BYTES_MAX + 2];
    memset(long_key, 'k', IDEM_KEY_BYTES_MAX + 1); /* one byte too long */
    const char *keys[3] = {"a", long_key, "b"};
    idem_completion c[3];
    del_group(keys, 3, 0, c);
    for (int i = 0; i < 3; i++)
        cr_assert_eq(c[i].err, IDEM_EINVAL, "delete %d: %s", i, idem_strerror(c[i].err));
    cr_assert(found("a") && found("b"));
    static idem_op ops[IDEM_DEL_GROUP_MAX + 1];
    for (uint32_t i = 0; i <= IDEM_DEL_GROUP_MAX; i++)
        ops[i] = (idem_op){.kind = IDEM_OP_DEL,
                           .flags = i < IDEM_DEL_GROUP_MAX ? IDEM_F_WITH_NEXT : 0,
                           .key = i % 2 ? "a" : "b",
                           .key_len = 1};
    idem_queue *q;
    expect_rc(idem_queue_open(g_s, 2 * IDEM_DEL_GROUP_MAX, &q), IDEM_OK);
    cr_assert_eq(idem_submit(q, ops, IDEM_DEL_GROUP_MAX + 1), IDEM_DEL_GROUP_MAX + 1);
    static idem_completion out[IDEM_DEL_GROUP_MAX + 1];
    for (int got = 0; got < (int)IDEM_DEL_GROUP_MAX + 1;) {
        int k = idem_poll(q, out + got, IDEM_DEL_GROUP_MAX + 1 - (size_t)got, 10000);
        cr_assert_gt(k, 0);
        got += k;
    }
    idem_queue_close(q);
    for (uint32_t i = 0; i <= IDEM_DEL_GROUP_MAX; i++)
        cr_assert_eq(out[i].err, IDEM_EINVAL, "delete %u: %s", i, idem_strerror(out[i].err));
    cr_assert(found("a") && found("b"));
}

/* A group goes into the queue whole: not while the queue lacks room for all of it, never if
 * it is larger than the queue. */
Test(del, a_group_is_accepted_whole_or_not_at_all)
{
    idem_queue *q;
    expect_rc(idem_queue_open(g_s, 4, &q), IDEM_OK);
    make_committed("a", NULL, "r");
    make_committed("b", NULL, "r");
    make_committed("c", NULL, "r");
    idem_op sync[2] = {{.kind = IDEM_OP_SYNC, .user_data = 10},
                       {.kind = IDEM_OP_SYNC, .user_data = 11}};
    idem_op grp[3];
    const char *keys[3] = {"a", "b", "c"};
    for (int i = 0; i < 3; i++)
        grp[i] = (idem_op){.kind = IDEM_OP_DEL,
                           .flags = i < 2 ? IDEM_F_WITH_NEXT : 0,
                           .key = keys[i],
                           .key_len = 1,
                           .user_data = (uint64_t)i};
    cr_assert_eq(idem_submit(q, sync, 2), 2);
    cr_assert_eq(idem_submit(q, grp, 3), 0, "a group of 3 in a queue with room for 2");
    idem_completion c[4];
    for (int got = 0; got < 2;) {
        int k = idem_poll(q, c + got, (size_t)(2 - got), 10000);
        cr_assert_gt(k, 0);
        got += k;
    }
    cr_assert_eq(idem_submit(q, grp, 3), 3);
    for (int got = 0; got < 3;) {
        int k = idem_poll(q, c + got, (size_t)(3 - got), 10000);
        cr_assert_gt(k, 0);
        got += k;
    }
    for (int i = 0; i < 3; i++)
        cr_assert_eq(c[i].err, IDEM_OK);
    idem_op big[5];
    for (int i = 0; i < 5; i++)
        big[i] = (idem_op){
            .kind = IDEM_OP_DEL, .flags = i < 4 ? IDEM_F_WITH_NEXT : 0, .key = "zz", .key_len = 2};
    cr_assert_eq(idem_submit(q, big, 5), IDEM_EINVAL, "a group of 5 in a queue of 4");
    idem_queue_close(q);
}

static uint64_t audit_file_bytes(void)
{
    char path[4096];
    struct stat st;
    snprintf(path, sizeof path, "%s/audit.log", g_dir);
    cr_assert_eq(stat(path, &st), 0, "%s", path);
    return (uint64_t)st.st_size;
}

/* The trail, newest first: n entries of action "del" by "alice" of keys k-(n-1) .. k-0. */
static void expect_del_trail(int n)
{
    const idem_audit_entry *e;
    size_t got = 0;
    expect_rc(idem_audit(g_q, NULL, 0, 1000, &e, &got), IDEM_OK);
    cr_assert_eq(got, (size_t)n, "%zu audit entries, expected %d", got, n);
    for (int i = 0; i < n; i++) {
        char key[32];
        int len = snprintf(key, sizeof key, "k-%d", n - 1 - i);
        cr_assert_eq(e[i].key_len, (uint32_t)len);
        cr_assert(!memcmp(e[i].key, key, (size_t)len), "entry %d names the wrong key", i);
        cr_assert_str_eq(e[i].action, "del");
        cr_assert_str_eq(e[i].actor, "alice");
        if (i) cr_assert_eq(e[i].seq + 1, e[i - 1].seq);
    }
}

/* The entries of the deletes of one submission (a DEL of several keys) are written together:
 * one write of one 4 KiB block for 40 of them (88 bytes each with the result erased), not 40
 * blocks and 40 flushes. */
Test(del, deletes_of_one_submission_share_one_audit_write)
{
    enum { N = 40 };
    char keys[N][32];
    idem_op ops[N];
    memset(ops, 0, sizeof ops);
    for (int i = 0; i < N; i++) {
        snprintf(keys[i], sizeof keys[i], "k-%d", i);
        make_committed(keys[i], NULL, "r");
        ops[i] = (idem_op){.kind = IDEM_OP_DEL,
                           .user_data = (uint64_t)i,
                           .key = keys[i],
                           .key_len = (uint32_t)strlen(keys[i]),
                           .actor = "alice"};
    }
    cr_assert_eq(idem_submit(g_q, ops, N), N);
    idem_completion c[N];
    for (int done = 0; done < N;) {
        int n = idem_poll(g_q, c, N, 5000);
        cr_assert_gt(n, 0, "idem_poll: %d", n);
        for (int i = 0; i < n; i++)
            cr_assert_eq(c[i].err, IDEM_OK, "delete %llu: %s", (unsigned long long)c[i].user_data,
                         idem_strerror(c[i].err));
        done += n;
    }
    for (int i = 0; i < N; i++)
        cr_assert_not(found(keys[i]));
    cr_assert_eq(audit_file_bytes(), 4096);
    expect_del_trail(N);
    reopen();
    expect_del_trail(N);
}

/* Earlier versions wrote one entry per 4 KiB block; such a trail is read, and new entries
 * follow it. */
static void put_le(uint8_t *p, uint64_t v, int bytes)
{
    for (int i = 0; i < bytes; i++)
        p[i] = (uint8_t)(v >> (8 * i));
}

static void legacy_block(uint8_t b[4096], uint64_t seq, const char *key, uint64_t lsn)
{
    const char *action = "del", *actor = "alice";
    uint32_t klen = (uint32_t)strlen(key), alen = 5, aclen = 3;
    uint32_t len = 65 - 8 + aclen + alen + klen;
    memset(b, 0, 4096);
    put_le(b + 8, len, 4);
    put_le(b + 16, seq, 8);
    put_le(b + 24, (uint64_t)t0, 8);
    put_le(b + 32, lsn, 8);
    b[40] = IDEM_STATE_COMMITTED;
    put_le(b + 42, klen, 2);
    put_le(b + 44, alen, 2);
    put_le(b + 48, 1, 8);
    b[64] = (uint8_t)aclen;
    memcpy(b + 65, action, aclen);
    memcpy(b + 65 + aclen, actor, alen);
    memcpy(b + 65 + aclen + alen, key, klen);
    put_le(b, XXH3_64bits(b + 8, len), 8);
}

Test(reopen, a_trail_of_one_entry_per_block_from_earlier_versions_is_read)
{
    make_committed("k-2", NULL, "r"); /* the log holds LSN 1 and more */
    store_close();
    char path[4096];
    snprintf(path, sizeof path, "%s/audit.log", g_dir);
    FILE *f = fopen(path, "wb");
    cr_assert_not_null(f);
    uint8_t b[4096];
    legacy_block(b, 1, "k-0", 1);
    cr_assert_eq(fwrite(b, 1, sizeof b, f), sizeof b);
    legacy_block(b, 2, "k-1", 1);
    cr_assert_eq(fwrite(b, 1, sizeof b, f), sizeof b);
    cr_assert_eq(fclose(f), 0);
    store_open();
    expect_del_trail(2);
    expect_rc(idem_del(g_q, "k-2", 3, "alice"), IDEM_OK);
    expect_del_trail(3);
    cr_assert_eq(audit_file_bytes(), 3 * 4096);
    reopen();
    expect_del_trail(3);
    store_close();
    idem_verify_report r;
    expect_rc(idem_verify(g_dir, &r, NULL, NULL), IDEM_OK);
    cr_assert_eq(r.errors, 0, "%s", r.first_error);
    cr_assert_eq(r.audit_entries, 3);
}

/* ------------------------------------------------------------------------------------------ */
/* The trail is read from audit.log: memory holds one mark per stretch (1 MiB) of the file. */

#define LONG_TRAIL 1200

static size_t trail_reason_len(int i)
{
    return 2000 + (size_t)(i * 37) % 2000;
}

/* LONG_TRAIL settled claims t-0 .. t-1199, each with a reason of 2,000-3,999 bytes that starts
 * "why-<i>:": several MiB of trail. Durability none: the flusher writes the groups as it goes,
 * many entries each. */
static void long_trail_make(void)
{
    store_close();
    g_opts.durability = IDEM_DURABILITY_NONE;
    store_open();
    static char reason[4096];
    for (int i = 0; i < LONG_TRAIL; i++) {
        char key[32];
        snprintf(key, sizeof key, "t-%d", i);
        size_t len = trail_reason_len(i);
        memset(reason, 'a' + i % 26, len);
        reason[len] = 0;
        int head = snprintf(reason, len, "why-%d:", i);
        reason[head] = ':';
        claim_new(key);
        expect_rc(resolve(key, IDEM_RESOLVE_SETTLE, reason, IDEM_F_FORCE), IDEM_OK);
    }
}

/* Entry e is the resolve of t-<i>, whole. */
static void expect_trail_entry(const idem_audit_entry *e, int i)
{
    char key[32], head[32];
    int len = snprintf(key, sizeof key, "t-%d", i);
    snprintf(head, sizeof head, "why-%d:", i);
    cr_assert_eq(e->key_len, (uint32_t)len, "entry of t-%d: key length %u", i, e->key_len);
    cr_assert(!memcmp(e->key, key, (size_t)len), "entry of t-%d names another key", i);
    cr_assert(!strncmp(e->reason, head, strlen(head)), "entry of t-%d: reason %.12s", i, e->reason);
    cr_assert_eq(strlen(e->reason), trail_reason_len(i), "entry of t-%d: reason of %zu bytes", i,
                 strlen(e->reason));
    cr_assert_eq(e->reason[trail_reason_len(i) - 1], 'a' + i % 26);
    cr_assert_str_eq(e->action, "resolve-settle");
    cr_assert_str_eq(e->actor, "alice");
    cr_assert_eq(e->state_before, IDEM_STATE_IN_FLIGHT);
    cr_assert_eq(e->state_after, IDEM_STATE_COMMITTED);
}

static void long_trail_check(void)
{
    const idem_audit_entry *e;
    size_t n = 0;
    expect_rc(idem_audit(g_q, NULL, 0, 10000, &e, &n), IDEM_OK);
    cr_assert_eq(n, LONG_TRAIL, "%zu entries, expected %d", n, LONG_TRAIL);
    for (size_t i = 0; i < n; i++) {
        expect_trail_entry(&e[i], LONG_TRAIL - 1 - (int)i);
        if (i)
            cr_assert_eq(e[i].seq + 1, e[i - 1].seq, "seq %" PRIu64 " after %" PRIu64, e[i].seq,
                         e[i - 1].seq);
    }
    /* By pages of 97, across the stretches' boundaries. */
    uint64_t before = 0;
    size_t total = 0;
    for (;;) {
        expect_rc(idem_audit_page(g_q, NULL, 0, before, 97, &e, &n), IDEM_OK);
        if (n == 0) break;
        for (size_t i = 0; i < n; i++)
            expect_trail_entry(&e[i], LONG_TRAIL - 1 - (int)(total + i));
        total += n;
        before = e[n - 1].seq;
        cr_assert_leq(total, LONG_TRAIL);
    }
    cr_assert_eq(total, LONG_TRAIL, "the pages held %zu entries", total);
    /* By key: one in the oldest stretch, one in the newest. */
    expect_rc(idem_audit(g_q, "t-3", 3, 10, &e, &n), IDEM_OK);
    cr_assert_eq(n, 1);
    expect_trail_entry(&e[0], 3);
    expect_rc(idem_audit(g_q, "t-1198", 6, 10, &e, &n), IDEM_OK);
    cr_assert_eq(n, 1);
    expect_trail_entry(&e[0], 1198);
    /* What memory holds: a mark per MiB of the file. */
    uint64_t size = audit_file_bytes();
    cr_assert_geq(size, UINT64_C(3) << 20, "a trail of %" PRIu64 " bytes", size);
    cr_assert(g_s->naudit_marks >= 3 && g_s->naudit_marks <= size / (1u << 20) + 1,
              "%zu marks for %" PRIu64 " bytes", g_s->naudit_marks, size);
}

TestSuite(audit, .init = setup, .fini = teardown);

Test(audit, a_trail_of_several_megabytes_comes_back_whole_newest_first_by_pages_and_by_key)
{
    long_trail_make();
    long_trail_check();
    reopen();
    long_trail_check();
}

/* A unit damaged after the open is reported when a query reaches it, never served; a query
 * that stops in a newer stretch does not read it. */
Test(audit, a_unit_damaged_after_the_open_is_reported_when_a_query_reaches_it)
{
    long_trail_make();
    reopen();
    char path[4096];
    snprintf(path, sizeof path, "%s/audit.log", g_dir);
    FILE *f = fopen(path, "r+b");
    cr_assert_not_null(f);
    cr_assert_eq(fseek(f, 100, SEEK_SET), 0);
    int c = fgetc(f);
    cr_assert_eq(fseek(f, 100, SEEK_SET), 0);
    fputc(c ^ 0x20, f);
    cr_assert_eq(fclose(f), 0);
    const idem_audit_entry *e;
    size_t n = 0;
    expect_rc(idem_audit(g_q, NULL, 0, 10, &e, &n), IDEM_OK);
    cr_assert_eq(n, 10);
    expect_trail_entry(&e[0], LONG_TRAIL - 1);
    expect_rc(idem_audit(g_q, NULL, 0, 10000, &e, &n), IDEM_ECORRUPT);
    cr_assert(strstr(idem_last_error(), "no longer checks out"), "%s", idem_last_error());
    expect_rc(idem_audit(g_q, "t-0", 3, 10, &e, &n), IDEM_ECORRUPT);
    /* A query by key reads only the stretches whose key filter may hold the key: this one's
     * only entry is in the newest stretch, and the damaged one is not read. */
    expect_rc(idem_audit(g_q, "t-1199", 6, 10, &e, &n), IDEM_OK);
    cr_assert_eq(n, 1);
    expect_trail_entry(&e[0], 1199);
    expect_rc(idem_audit(g_q, "never-resolved", 14, 10, &e, &n), IDEM_OK);
    cr_assert_eq(n, 0);
}

/* Imported entries keep their seq, and later entries follow it; a seq with no room left to
 * grow is refused (the pages of the trail rely on seqs growing along the file). */
Test(audit, imported_seqs_are_kept_and_later_entries_follow_them)
{
    idem_audit_entry in = {.seq = 1000,
                           .at_ms = 5,
                           .actor = "import",
                           .action = "del",
                           .key = "imp",
                           .key_len = 3,
                           .reason = "carried over"};
    expect_rc(idem_import_audit(g_q, &in), IDEM_OK);
    claim_new("r1");
    expect_rc(resolve("r1", IDEM_RESOLVE_SETTLE, "one", IDEM_F_FORCE), IDEM_OK);
    in.seq = UINT64_MAX;
    expect_rc(idem_import_audit(g_q, &in), IDEM_EINVAL);
    /* A state out of range was kept as its low byte (-1 read back as 255, 256 as absent), and
     * verify then found the store faulty. */
    in.seq = 1001;
    const int bad_states[] = {-1, 4, 256};
    for (int i = 0; i < 6; i++) {
        idem_audit_entry b = in;
        *(i < 3 ? &b.state_before : &b.state_after) = bad_states[i % 3];
        expect_rc(idem_import_audit(g_q, &b), IDEM_EINVAL);
        cr_assert_str_eq(idem_audit_entry_invalid(&b), i < 3 ? "state_before" : "state_after");
    }
    in.seq = (uint64_t)INT64_MAX;
    expect_rc(idem_import_audit(g_q, &in), IDEM_OK);
    claim_new("r2");
    expect_rc(resolve("r2", IDEM_RESOLVE_SETTLE, "two", IDEM_F_FORCE), IDEM_OK);
    const uint64_t want[4] = {(uint64_t)INT64_MAX + 1, (uint64_t)INT64_MAX, 1001, 1000};
    for (int pass = 0; pass < 2; pass++) {
        const idem_audit_entry *e;
        size_t n = 0;
        expect_rc(idem_audit(g_q, NULL, 0, 10, &e, &n), IDEM_OK);
        cr_assert_eq(n, 4);
        for (int i = 0; i < 4; i++)
            cr_assert_eq(e[i].seq, want[i], "entry %d: seq %" PRIu64, i, e[i].seq);
        cr_assert_str_eq(e[1].reason, "carried over");
        expect_rc(idem_audit_page(g_q, NULL, 0, want[0], 10, &e, &n), IDEM_OK);
        cr_assert_eq(n, 3);
        cr_assert_eq(e[0].seq, want[1]);
        expect_rc(idem_audit_page(g_q, "imp", 3, 0, 10, &e, &n), IDEM_OK);
        cr_assert_eq(n, 2);
        cr_assert_eq(e[0].seq, want[1]);
        cr_assert_eq(e[1].seq, want[3]);
        expect_rc(idem_audit_page(g_q, "imp", 3, want[1], 10, &e, &n), IDEM_OK);
        cr_assert_eq(n, 1, "key and before_seq together");
        cr_assert_eq(e[0].seq, 1000);
        expect_rc(idem_audit_page(g_q, "imp", 3, 1000, 10, &e, &n), IDEM_OK);
        cr_assert_eq(n, 0);
        reopen();
    }
}

/* Entries imported together share the trail's blocks and keep their order and seqs (one at a
 * time, each took a 4 KiB block); one out of range refuses them all, with nothing written. */
Test(audit, entries_imported_together_share_blocks_and_keep_their_seqs)
{
    static idem_audit_entry in[IDEM_IMPORT_AUDIT_MAX];
    static char keys[IDEM_IMPORT_AUDIT_MAX][16];
    for (uint32_t i = 0; i < IDEM_IMPORT_AUDIT_MAX; i++) {
        snprintf(keys[i], sizeof keys[i], "imp-%u", i);
        in[i] = (idem_audit_entry){.seq = 10 + 2 * (uint64_t)i, /* gaps kept */
                                   .at_ms = 5 + i,
                                   .actor = "import",
                                   .action = "del",
                                   .key = keys[i],
                                   .key_len = (uint32_t)strlen(keys[i]),
                                   .reason = "carried over"};
    }
    uint64_t before = audit_file_bytes();
    in[7].seq = UINT64_MAX;
    expect_rc(idem_import_audit_n(g_q, in, IDEM_IMPORT_AUDIT_MAX), IDEM_EINVAL);
    in[7].seq = 10 + 2 * 7;
    expect_rc(idem_import_audit_n(g_q, in, IDEM_IMPORT_AUDIT_MAX + 1), IDEM_EINVAL);
    const idem_audit_entry *e;
    size_t n = 0;
    expect_rc(idem_audit(g_q, NULL, 0, 10, &e, &n), IDEM_OK);
    cr_assert_eq(n, 0, "a refused group wrote %zu entries", n);
    expect_rc(idem_import_audit_n(g_q, in, IDEM_IMPORT_AUDIT_MAX), IDEM_OK);
    uint64_t grew = audit_file_bytes() - before;
    cr_assert_leq(grew, 64 * 1024, "%u entries took %llu bytes", IDEM_IMPORT_AUDIT_MAX,
                  (unsigned long long)grew);
    for (int pass = 0; pass < 2; pass++) {
        expect_rc(idem_audit(g_q, NULL, 0, 1000, &e, &n), IDEM_OK);
        cr_assert_eq(n, IDEM_IMPORT_AUDIT_MAX);
        for (uint32_t i = 0; i < IDEM_IMPORT_AUDIT_MAX; i++) {
            const idem_audit_entry *x = &e[IDEM_IMPORT_AUDIT_MAX - 1 - i]; /* newest first */
            cr_assert_eq(x->seq, 10 + 2 * (uint64_t)i);
            cr_assert_eq(x->at_ms, 5 + (int64_t)i);
            cr_assert(x->key_len == strlen(keys[i]) && !memcmp(x->key, keys[i], x->key_len));
            cr_assert_str_eq(x->reason, "carried over");
        }
        reopen();
    }
    /* Entries of 4 KiB reasons fill more than a group (256 KiB): one group a write, each waited
     * for (a whole group written behind a torn one of imported entries reads as damage). */
    static char reason[4001];
    memset(reason, 'r', 4000);
    for (uint32_t i = 0; i < 100; i++) {
        in[i].seq = 10000 + i;
        in[i].reason = reason;
    }
    expect_rc(idem_import_audit_n(g_q, in, 100), IDEM_OK);
    for (int pass = 0; pass < 2; pass++) {
        expect_rc(idem_audit(g_q, NULL, 0, 100, &e, &n), IDEM_OK);
        cr_assert_eq(n, 100);
        for (uint32_t i = 0; i < 100; i++) {
            cr_assert_eq(e[99 - i].seq, 10000 + (uint64_t)i);
            cr_assert_eq(strlen(e[99 - i].reason), 4000);
        }
        reopen();
    }
}

struct importer {
    int id;
    int rc;
};

static void *import_rounds(void *arg)
{
    struct importer *im = arg;
    idem_queue *q;
    im->rc = idem_queue_open(g_s, 8, &q);
    char keys[16][40];
    idem_audit_entry in[16];
    for (int round = 0; round < 20 && im->rc == IDEM_OK; round++) {
        for (int i = 0; i < 16; i++) {
            snprintf(keys[i], sizeof keys[i], "t%d-%d-%d", im->id, round, i);
            in[i] = (idem_audit_entry){.at_ms = 1,
                                       .actor = "import",
                                       .action = "del",
                                       .key = keys[i],
                                       .key_len = (uint32_t)strlen(keys[i]),
                                       .reason = "r"};
        }
        im->rc = idem_import_audit_n(q, in, 16);
    }
    if (q) idem_queue_close(q);
    return NULL;
}

/* Two threads importing at once: one found the other's group pending with the log durable, and
 * waited for it holding the lock the flusher needed to write it (the store hung). */
Test(audit, two_threads_import_audit_entries_at_once, .timeout = 60)
{
    pthread_t th[2];
    struct importer im[2] = {{.id = 0}, {.id = 1}};
    for (int i = 0; i < 2; i++)
        cr_assert_eq(pthread_create(&th[i], NULL, import_rounds, &im[i]), 0);
    for (int i = 0; i < 2; i++) {
        pthread_join(th[i], NULL);
        cr_assert_eq(im[i].rc, IDEM_OK, "importer %d: %s", i, idem_strerror(im[i].rc));
    }
    const idem_audit_entry *e;
    size_t n = 0;
    expect_rc(idem_audit(g_q, NULL, 0, 1000, &e, &n), IDEM_OK);
    cr_assert_eq(n, 2 * 20 * 16);
    for (size_t i = 1; i < n; i++)
        cr_assert_lt(e[i].seq, e[i - 1].seq, "seqs grow along the trail");
}

/* A trail that shrank under the open store (its entries written, then cut off by someone
 * else) answers corruption, named, never a shorter trail. */
Test(audit, a_trail_cut_short_under_the_store_is_reported)
{
    for (int i = 0; i < 3; i++) {
        char key[16];
        snprintf(key, sizeof key, "cut-%d", i);
        claim_new(key);
        expect_rc(resolve(key, IDEM_RESOLVE_SETTLE, "r", IDEM_F_FORCE), IDEM_OK);
    }
    uint64_t size = audit_file_bytes();
    cr_assert_geq(size, 3 * 4096, "each operator call in its own 4 KiB group");
    char path[4096];
    snprintf(path, sizeof path, "%s/audit.log", g_dir);
    cr_assert_eq(truncate(path, 4096), 0);
    const idem_audit_entry *e;
    size_t n = 0;
    expect_rc(idem_audit(g_q, NULL, 0, 10, &e, &n), IDEM_ECORRUPT);
    cr_assert(strstr(idem_last_error(), "shorter"), "%s", idem_last_error());
}

/* ------------------------------------------------------------------------------------------ */
/* SET NX: committed records whose result is the value, in the claims' keyspace. */

TestSuite(set_if_absent, .init = setup, .fini = teardown);

static idem_completion setnx(const char *key, const char *value, uint64_t ttl_ms, int get_old,
                             int want_rc)
{
    idem_completion c;
    memset(&c, 0, sizeof c);
    int rc = idem_set_if_absent(g_q, key, strlen(key), value, strlen(value), ttl_ms, get_old, &c);
    cr_assert_eq(rc, want_rc, "idem_set_if_absent: %s, expected %s", idem_strerror(rc),
                 idem_strerror(want_rc));
    return c;
}

Test(set_if_absent, new_key_is_new_and_committed_with_the_value)
{
    idem_completion c = setnx("k", "v1", TTL, 0, IDEM_OK);
    expect_outcome(c, IDEM_NEW);
    idem_record r = get("k");
    cr_assert_eq(r.state, IDEM_STATE_COMMITTED);
    expect_result(r, "v1");
    cr_assert_eq(r.first_seen_ms, t0);
    cr_assert_eq(r.expires_at_ms, t0 + TTL);
}

Test(set_if_absent, existing_key_is_done_and_keeps_its_value)
{
    setnx("k", "v1", TTL, 0, IDEM_OK);
    at(10);
    idem_completion c = setnx("k", "v2", TTL, 0, IDEM_OK);
    expect_outcome(c, IDEM_DONE);
    expect_result(get("k"), "v1");
    cr_assert_eq(get("k").first_seen_ms, t0);
}

Test(set_if_absent, get_old_returns_the_existing_value)
{
    setnx("k", "v1", TTL, 0, IDEM_OK);
    idem_completion c = setnx("k", "v2", TTL, 1, IDEM_OK);
    expect_outcome(c, IDEM_DONE);
    expect_data(c, "v1");
}

Test(set_if_absent, get_old_on_absent_key_sets_it)
{
    idem_completion c = setnx("k", "v1", TTL, 1, IDEM_OK);
    expect_outcome(c, IDEM_NEW);
    expect_result(get("k"), "v1");
}

Test(set_if_absent, get_old_on_unfinished_record_is_estate)
{
    int64_t tok = claim_new("k");
    setnx("k", "v", TTL, 1, IDEM_ESTATE);
    make_review("k2", "n");
    setnx("k2", "v", TTL, 1, IDEM_ESTATE);
    idem_record r = get("k");
    cr_assert_eq(r.state, IDEM_STATE_IN_FLIGHT);
    cr_assert_eq(r.token, tok);
}

Test(set_if_absent, without_get_old_an_unfinished_record_is_done_and_unchanged)
{
    int64_t tok = claim_new("k");
    expect_outcome(setnx("k", "v", TTL, 0, IDEM_OK), IDEM_DONE);
    idem_record r = get("k");
    cr_assert_eq(r.state, IDEM_STATE_IN_FLIGHT);
    cr_assert_eq(r.token, tok);
    cr_assert_eq(r.result_len, 0);
    commit_ok("k", tok, "r");
}

Test(set_if_absent, claim_of_a_set_key_is_done_with_the_value)
{
    setnx("k", "v1", TTL, 0, IDEM_OK);
    idem_completion c = claim("k");
    expect_outcome(c, IDEM_DONE);
    expect_data(c, "v1");
}

Test(set_if_absent, set_on_a_claimed_and_committed_key_returns_its_result)
{
    make_committed("k", NULL, "inv-1");
    idem_completion c = setnx("k", "v", TTL, 1, IDEM_OK);
    expect_outcome(c, IDEM_DONE);
    expect_data(c, "inv-1");
}

Test(set_if_absent, value_expires_exactly_at_ttl)
{
    setnx("k", "v1", 1000, 0, IDEM_OK);
    at(999);
    expect_outcome(setnx("k", "v2", 1000, 0, IDEM_OK), IDEM_DONE);
    at(1000);
    expect_outcome(setnx("k", "v2", 1000, 0, IDEM_OK), IDEM_NEW);
    expect_result(get("k"), "v2");
}

Test(set_if_absent, set_keys_can_be_deleted)
{
    setnx("k", "v1", TTL, 0, IDEM_OK);
    expect_rc(idem_del(g_q, "k", 1, "alice"), IDEM_OK);
    expect_outcome(setnx("k", "v2", TTL, 0, IDEM_OK), IDEM_NEW);
}

/* ------------------------------------------------------------------------------------------ */
/* Keys: binary-safe, compared in full. */

TestSuite(keys, .init = setup, .fini = teardown);

Test(keys, binary_keys_with_nul_bytes_are_distinct)
{
    const char k1[] = {'a', 0, 'b'};
    const char k2[] = {'a', 0, 'c'};
    const char k3[] = {'a', 0};
    const char k4[] = {'a'};
    idem_completion c1 = claim_bin(k1, 3, TTL, LEASE, NULL, NULL);
    idem_completion c2 = claim_bin(k2, 3, TTL, LEASE, NULL, NULL);
    idem_completion c3 = claim_bin(k3, 2, TTL, LEASE, NULL, NULL);
    idem_completion c4 = claim_bin(k4, 1, TTL, LEASE, NULL, NULL);
    expect_outcome(c1, IDEM_NEW);
    expect_outcome(c2, IDEM_NEW);
    expect_outcome(c3, IDEM_NEW);
    expect_outcome(c4, IDEM_NEW);
    expect_rc(idem_commit(g_q, k1, 3, c1.token, "one", 3), IDEM_OK);
    expect_rc(idem_commit(g_q, k3, 2, c3.token, "three", 5), IDEM_OK);
    idem_completion d = claim_bin(k1, 3, TTL, LEASE, NULL, NULL);
    expect_outcome(d, IDEM_DONE);
    expect_data(d, "one");
    d = claim_bin(k3, 2, TTL, LEASE, NULL, NULL);
    expect_outcome(d, IDEM_DONE);
    expect_data(d, "three");
    expect_outcome(claim_bin(k2, 3, TTL, LEASE, NULL, NULL), IDEM_BUSY);
    idem_record r = get_bin(k1, 3);
    cr_assert_eq(r.key_len, 3);
    cr_assert(memcmp(r.key, k1, 3) == 0);
}

Test(keys, keys_sharing_a_prefix_are_distinct)
{
    make_committed("abc", NULL, "1");
    make_committed("abcd", NULL, "2");
    expect_outcome(claim("ab"), IDEM_NEW);
    idem_completion c = claim("abc");
    expect_outcome(c, IDEM_DONE);
    expect_data(c, "1");
    c = claim("abcd");
    expect_outcome(c, IDEM_DONE);
    expect_data(c, "2");
}

Test(keys, key_of_512_bytes_with_every_byte_value_is_accepted)
{
    uint8_t k[IDEM_KEY_BYTES_MAX];
    for (size_t i = 0; i < sizeof k; i++)
        k[i] = (uint8_t)(i & 0xff);
    uint8_t k2[IDEM_KEY_BYTES_MAX];
    memcpy(k2, k, sizeof k);
    k2[IDEM_KEY_BYTES_MAX - 1] ^= 1; /* differs in the last byte only */
    idem_completion c = claim_bin(k, sizeof k, TTL, LEASE, NULL, NULL);
    expect_outcome(c, IDEM_NEW);
    expect_rc(idem_commit(g_q, k, sizeof k, c.token, "r", 1), IDEM_OK);
    expect_outcome(claim_bin(k2, sizeof k2, TTL, LEASE, NULL, NULL), IDEM_NEW);
    expect_outcome(claim_bin(k, sizeof k, TTL, LEASE, NULL, NULL), IDEM_DONE);
    idem_record r = get_bin(k, sizeof k);
    cr_assert_eq(r.key_len, IDEM_KEY_BYTES_MAX);
    cr_assert(memcmp(r.key, k, sizeof k) == 0);
}

Test(keys, many_keys_are_all_distinct)
{
    char key[32];
    for (int i = 0; i < 500; i++) {
        snprintf(key, sizeof key, "key-%d", i);
        idem_completion c = claim(key);
        expect_outcome(c, IDEM_NEW);
        char res[32];
        snprintf(res, sizeof res, "res-%d", i);
        expect_rc(idem_commit(g_q, key, strlen(key), c.token, res, strlen(res)), IDEM_OK);
    }
    for (int i = 0; i < 500; i++) {
        snprintf(key, sizeof key, "key-%d", i);
        char res[32];
        snprintf(res, sizeof res, "res-%d", i);
        idem_completion c = claim(key);
        expect_outcome(c, IDEM_DONE);
        expect_data(c, res);
    }
    cr_assert_eq(stats().keys_committed, 500);
}

/* ------------------------------------------------------------------------------------------ */
/* Bad arguments give IDEM_EINVAL and change nothing. */

TestSuite(args, .init = setup, .fini = teardown);

/* A backup's destination must leave room for the names of the files made in it: a path 20-30
 * bytes short of PATH_MAX had them cut short, and a copy of one segment "succeeded" without the
 * files it needs. Refused before anything is made; one that leaves room is taken. */
Test(args, a_backup_destination_too_long_for_its_files_names_is_refused)
{
    claim_new("k");
    char parent[4200], dest[4200], cmd[4400];
    int n = snprintf(parent, sizeof parent, "%s-b", g_dir);
    while (n < 4000) /* directories of 100 bytes each, made */
        n += snprintf(parent + n, sizeof parent - (size_t)n, "/%099d", 0);
    snprintf(cmd, sizeof cmd, "mkdir -p '%s'", parent);
    cr_assert_eq(system(cmd), 0);
    memcpy(dest, parent, (size_t)n);
    dest[n] = '/';
    memset(dest + n + 1, 'd', 4070 - (size_t)n - 1);
    dest[4070] = 0;
    expect_rc(idem_backup(g_s, dest), IDEM_EINVAL);
    cr_assert(strstr(idem_last_error(), "path too long"), "%s", idem_last_error());
    snprintf(cmd, sizeof cmd, "%s.partial", dest);
    cr_assert(access(dest, F_OK) != 0 && access(cmd, F_OK) != 0, "a refused backup made a copy");
    memcpy(dest + n, "/ok", 4);
    expect_rc(idem_backup(g_s, dest), IDEM_OK);
    idem_verify_report r;
    expect_rc(idem_verify(dest, &r, NULL, NULL), IDEM_OK);
    cr_assert_eq(r.errors, 0, "%s", r.first_error);
    snprintf(cmd, sizeof cmd, "rm -rf '%s-b'", g_dir);
    cr_assert_eq(system(cmd), 0);
}

static int exec_rc(const idem_op *op)
{
    idem_completion c;
    memset(&c, 0, sizeof c);
    int rc = idem_exec(g_q, op, &c);
    return rc != IDEM_OK ? rc : c.err;
}

Test(args, empty_key_is_einval)
{
    idem_completion c;
    expect_rc(claim_rc("", 0, TTL, LEASE, NULL, NULL, &c), IDEM_EINVAL);
    cr_assert_eq(stats().keys, 0);
    cr_assert_eq(stats().claims_new, 0);
}

Test(args, key_of_513_bytes_is_einval_and_creates_nothing)
{
    char k[IDEM_KEY_BYTES_MAX + 1];
    memset(k, 'x', sizeof k);
    idem_completion c;
    expect_rc(claim_rc(k, sizeof k, TTL, LEASE, NULL, NULL, &c), IDEM_EINVAL);
    expect_rc(idem_set_if_absent(g_q, k, sizeof k, "v", 1, TTL, 0, &c), IDEM_EINVAL);
    cr_assert_eq(stats().keys, 0);
    /* Its first 512 bytes are not claimed either. */
    expect_outcome(claim_bin(k, IDEM_KEY_BYTES_MAX, TTL, LEASE, NULL, NULL), IDEM_NEW);
}

Test(args, ttl_zero_or_over_the_maximum_is_einval)
{
    idem_completion c;
    expect_rc(claim_rc("k", 1, 0, LEASE, NULL, NULL, &c), IDEM_EINVAL);
    expect_rc(claim_rc("k", 1, IDEM_TTL_MS_MAX + 1, LEASE, NULL, NULL, &c), IDEM_EINVAL);
    expect_rc(idem_set_if_absent(g_q, "k", 1, "v", 1, 0, 0, &c), IDEM_EINVAL);
    cr_assert_not(found("k"));
    cr_assert_eq(stats().keys, 0);
}

Test(args, lease_zero_or_over_the_maximum_is_einval)
{
    idem_completion c;
    expect_rc(claim_rc("k", 1, TTL, 0, NULL, NULL, &c), IDEM_EINVAL);
    expect_rc(claim_rc("k", 1, TTL, IDEM_LEASE_MS_MAX + 1, NULL, NULL, &c), IDEM_EINVAL);
    cr_assert_not(found("k"));
    int64_t tok = claim_new("k");
    uint64_t v = get("k").version;
    expect_rc(extend("k", tok, 0), IDEM_EINVAL);
    expect_rc(extend("k", tok, IDEM_LEASE_MS_MAX + 1), IDEM_EINVAL);
    cr_assert_eq(get("k").version, v);
    cr_assert_eq(get("k").lease_until_ms, t0 + LEASE);
}

Test(args, wait_over_the_maximum_is_einval)
{
    idem_claim_args a;
    memset(&a, 0, sizeof a);
    a.ttl_ms = TTL;
    a.lease_ms = LEASE;
    a.wait_ms = IDEM_WAIT_MS_MAX + 1;
    idem_completion c;
    expect_rc(idem_claim(g_q, "k", 1, &a, &c), IDEM_EINVAL);
    cr_assert_not(found("k"));
}

Test(args, owner_over_the_limit_is_einval)
{
    char owner[IDEM_OWNER_BYTES_MAX + 2];
    memset(owner, 'o', sizeof owner);
    owner[IDEM_OWNER_BYTES_MAX + 1] = 0;
    idem_completion c;
    expect_rc(claim_rc("k", 1, TTL, LEASE, NULL, owner, &c), IDEM_EINVAL);
    cr_assert_not(found("k"));
}

Test(args, result_over_the_limit_is_einval_and_changes_nothing)
{
    size_t n = IDEM_RESULT_BYTES_DEFAULT + 1;
    char *big = malloc(n);
    cr_assert_not_null(big);
    memset(big, 'r', n);
    int64_t tok = claim_new("k");
    uint64_t v = get("k").version;
    expect_rc(idem_commit(g_q, "k", 1, tok, big, n), IDEM_EINVAL);
    idem_record r = get("k");
    cr_assert_eq(r.state, IDEM_STATE_IN_FLIGHT);
    cr_assert_eq(r.version, v);
    idem_completion c;
    expect_rc(idem_set_if_absent(g_q, "s", 1, big, n, TTL, 0, &c), IDEM_EINVAL);
    cr_assert_not(found("s"));
    /* Exactly the limit is accepted. */
    expect_rc(idem_commit(g_q, "k", 1, tok, big, n - 1), IDEM_OK);
    c = claim("k");
    expect_outcome(c, IDEM_DONE);
    cr_assert_eq(c.data_len, n - 1);
    free(big);
}

Test(args, note_over_the_limit_is_einval)
{
    char note[IDEM_NOTE_BYTES_MAX + 1];
    memset(note, 'n', sizeof note);
    int64_t tok = claim_new("k");
    expect_rc(idem_hold(g_q, "k", 1, tok, note, sizeof note), IDEM_EINVAL);
    cr_assert_eq(get("k").state, IDEM_STATE_IN_FLIGHT);
}

Test(args, unknown_flag_bits_are_einval)
{
    idem_op op;
    memset(&op, 0, sizeof op);
    op.kind = IDEM_OP_CLAIM;
    op.key = "k";
    op.key_len = 1;
    op.ttl_ms = TTL;
    op.lease_ms = LEASE;
    op.flags = 0x80000000u;
    cr_assert_eq(exec_rc(&op), IDEM_EINVAL);
    op.flags = 0x100u;
    cr_assert_eq(exec_rc(&op), IDEM_EINVAL);
    cr_assert_not(found("k"));
    op.flags = 0;
    cr_assert_eq(exec_rc(&op), IDEM_OK, "the same op without the flag bits is accepted");
    cr_assert(found("k"));
}

Test(args, unknown_op_kind_is_einval)
{
    idem_op op;
    memset(&op, 0, sizeof op);
    op.kind = 99;
    op.key = "k";
    op.key_len = 1;
    op.ttl_ms = TTL;
    op.lease_ms = LEASE;
    cr_assert_eq(exec_rc(&op), IDEM_EINVAL);
    cr_assert_eq(stats().keys, 0);
}

Test(args, unknown_resolve_action_is_einval)
{
    make_review("k", "n");
    uint64_t v = get("k").version;
    expect_rc(resolve("k", 0, "x", 0), IDEM_EINVAL);
    expect_rc(resolve("k", 4, "x", 0), IDEM_EINVAL);
    /* A reason is audited as text: one holding a NUL would come back cut short. */
    idem_op op;
    idem_completion c;
    memset(&op, 0, sizeof op);
    op.kind = IDEM_OP_RESOLVE;
    op.key = "k";
    op.key_len = 1;
    op.data = "a\0b";
    op.data_len = 3;
    op.action = IDEM_RESOLVE_RELEASE;
    int rc = idem_exec(g_q, &op, &c);
    expect_rc(rc != IDEM_OK ? rc : c.err, IDEM_EINVAL);
    /* Rule 9: every decision records why; an empty reason was taken. */
    expect_rc(resolve("k", IDEM_RESOLVE_RELEASE, "", 0), IDEM_EINVAL);
    /* Release and settle write no result: one given to them was dropped without a word. */
    expect_rc(resolve_full("k", IDEM_RESOLVE_SETTLE, "x", "inv", 0, 0, "alice"), IDEM_EINVAL);
    expect_rc(resolve_full("k", IDEM_RESOLVE_RELEASE, "x", "inv", 0, 0, "alice"), IDEM_EINVAL);
    idem_record r = get("k");
    cr_assert_eq(r.state, IDEM_STATE_REVIEW);
    cr_assert_eq(r.version, v);
}

Test(args, submit_over_the_batch_limit_is_einval)
{
    static idem_op ops[IDEM_BATCH_MAX + 1];
    int rc = idem_submit(g_q, ops, IDEM_BATCH_MAX + 1);
    cr_assert_eq(rc, IDEM_EINVAL);
    cr_assert_eq(idem_queue_pending(g_q), 0);
}

Test(args, smaller_result_limit_from_options_is_enforced)
{
    store_close();
    g_opts.result_bytes_max = 100;
    store_open();
    char big[101];
    memset(big, 'r', sizeof big);
    int64_t tok = claim_new("k");
    expect_rc(idem_commit(g_q, "k", 1, tok, big, 101), IDEM_EINVAL);
    expect_rc(idem_commit(g_q, "k", 1, tok, big, 100), IDEM_OK);
}

Test(args, test_clock_cannot_step_back)
{
    at(1000);
    cr_assert_eq(idem_clock_set(g_s, t0 + 999), IDEM_EINVAL);
    cr_assert_eq(idem_clock_now(g_s), t0 + 1000);
    cr_assert_eq(idem_clock_advance(g_s, -1), IDEM_EINVAL);
    cr_assert_eq(idem_clock_now(g_s), t0 + 1000);
    cr_assert_eq(idem_clock_advance(g_s, 5), IDEM_OK);
    cr_assert_eq(idem_clock_now(g_s), t0 + 1005);
}

/* ------------------------------------------------------------------------------------------ */
/* Everything survives close and reopen. */

TestSuite(reopen, .init = setup, .fini = teardown);

/* The test clock goes as far as the store's files take, and no further: a store whose clock
 * was moved to the bound reopens with it (past 2^50 the superblock used to be refused as
 * corrupt), and a step past the bound is refused. */
Test(reopen, a_test_clock_at_its_bound_reopens)
{
    expect_rc(idem_clock_set(g_s, IDEM_CLOCK_MS_MAX + 1), IDEM_EINVAL);
    expect_rc(idem_clock_set(g_s, IDEM_CLOCK_MS_MAX - 2 * (int64_t)TTL), IDEM_OK);
    t0 = idem_clock_now(g_s);
    make_committed("k", NULL, "r");
    reopen();
    cr_assert_eq(idem_clock_now(g_s), t0);
    idem_record r = get("k");
    cr_assert_eq(r.state, IDEM_STATE_COMMITTED);
    expect_rc(idem_clock_set(g_s, IDEM_CLOCK_MS_MAX), IDEM_OK);
    expect_rc(idem_clock_advance(g_s, 1), IDEM_EINVAL);
    reopen();
    cr_assert_eq(idem_clock_now(g_s), IDEM_CLOCK_MS_MAX);
}

Test(reopen, committed_record_keeps_every_field)
{
    make_committed("k", "body", "inv-1");
    at(10);
    expect_outcome(claim_fp("k", "other"), IDEM_MISMATCH);
    idem_record r = get("k");
    uint64_t v = r.version;
    reopen();
    r = get("k");
    cr_assert_eq(r.state, IDEM_STATE_COMMITTED);
    cr_assert_eq(r.first_seen_ms, t0);
    cr_assert_eq(r.expires_at_ms, t0 + TTL);
    expect_result(r, "inv-1");
    cr_assert_eq(r.version, v);
    cr_assert_eq(r.mismatch_count, 1);
    cr_assert_eq(r.last_mismatch_ms, t0 + 10);
    uint8_t fp[IDEM_FP_BYTES];
    fp_of("body", fp);
    cr_assert(r.has_fp);
    cr_assert(memcmp(r.fp, fp, IDEM_FP_BYTES) == 0);
    fp_of("other", fp);
    cr_assert(memcmp(r.last_mismatch_fp, fp, IDEM_FP_BYTES) == 0);
    idem_completion c = claim_fp("k", "body");
    expect_outcome(c, IDEM_DONE);
    expect_data(c, "inv-1");
    expect_outcome(claim_fp("k", "other"), IDEM_MISMATCH);
}

Test(reopen, in_flight_record_keeps_token_lease_owner_and_the_owner_can_commit)
{
    idem_completion a = claim_full("k", TTL, 3600000, NULL, "worker-1");
    idem_record r = get("k");
    uint64_t v = r.version;
    reopen();
    r = get("k");
    cr_assert_eq(r.state, IDEM_STATE_IN_FLIGHT);
    cr_assert_eq(r.token, a.token);
    cr_assert_eq(r.first_seen_ms, t0);
    cr_assert_eq(r.lease_until_ms, t0 + 3600000);
    cr_assert_eq(r.attempts, 1);
    cr_assert_eq(r.last_grant_ms, t0);
    cr_assert_eq(r.version, v);
    cr_assert_eq(r.owner_len, 8);
    cr_assert(memcmp(r.owner, "worker-1", 8) == 0);
    expect_outcome(claim_owner("k", "worker-2"), IDEM_BUSY);
    idem_completion same = claim_full("k", TTL, 3600000, NULL, "worker-1");
    expect_outcome(same, IDEM_NEW);
    cr_assert_eq(same.token, a.token);
    commit_ok("k", a.token, "r");
    reopen();
    expect_outcome(claim("k"), IDEM_DONE);
}

Test(reopen, owner_calls_after_plain_repeats_and_a_reopen_work)
{
    int64_t tok = claim_new("k");
    make_committed("d", NULL, "r");
    expect_outcome(claim("k"), IDEM_BUSY);
    expect_outcome(claim("d"), IDEM_DONE);
    reopen();
    expect_outcome(claim("k"), IDEM_BUSY);
    expect_outcome(claim("d"), IDEM_DONE);
    commit_ok("k", tok, "r");
    expect_rc(idem_del(g_q, "d", 1, "alice"), IDEM_OK);
    expect_outcome(claim("k"), IDEM_DONE);
    expect_outcome(claim("d"), IDEM_NEW);
    idem_record r = get("k");
    cr_assert_eq(r.seen_count, 4, "new, busy, busy after the reopen, done: %llu",
                 (unsigned long long)r.seen_count);
    cr_assert_eq(r.first_seen_ms, t0);
}

Test(reopen, review_record_keeps_its_note)
{
    int64_t tok = make_review("k", "call the bank");
    reopen();
    idem_record r = get("k");
    cr_assert_eq(r.state, IDEM_STATE_REVIEW);
    expect_note(r, "call the bank");
    idem_completion c = claim("k");
    expect_outcome(c, IDEM_REVIEW);
    expect_data(c, "call the bank");
    expect_rc(commit("k", tok, "r"), IDEM_ESTALE);
}

Test(reopen, released_record_stays_absent)
{
    int64_t tok = claim_new("k");
    expect_rc(release("k", tok), IDEM_OK);
    reopen();
    cr_assert_not(found("k"));
    idem_completion c = claim("k");
    expect_outcome(c, IDEM_NEW);
    cr_assert_gt(c.token, tok);
}

Test(reopen, expiry_boundary_holds_after_reopen)
{
    idem_completion c = claim_full("k", 3600000, LEASE, NULL, NULL);
    commit_ok("k", c.token, "r");
    reopen();
    int64_t exp = get("k").expires_at_ms;
    cr_assert_eq(exp, t0 + 3600000);
    cr_assert_leq(idem_clock_now(g_s), exp - 1);
    expect_rc(idem_clock_set(g_s, exp - 1), IDEM_OK);
    expect_outcome(claim("k"), IDEM_DONE);
    expect_rc(idem_clock_set(g_s, exp), IDEM_OK);
    idem_completion n = claim("k");
    expect_outcome(n, IDEM_NEW);
    cr_assert_gt(n.token, c.token);
    cr_assert_eq(get("k").first_seen_ms, exp);
}

Test(reopen, lease_boundary_holds_after_reopen)
{
    idem_completion c = claim_full("k", TTL, 3600000, NULL, NULL);
    reopen();
    int64_t until = get("k").lease_until_ms;
    cr_assert_eq(until, t0 + 3600000);
    expect_rc(idem_clock_set(g_s, until - 1), IDEM_OK);
    idem_completion b = claim("k");
    expect_outcome(b, IDEM_BUSY);
    cr_assert_eq(b.lease_left_ms, 1);
    expect_rc(idem_clock_set(g_s, until), IDEM_OK);
    idem_completion r = claim("k");
    expect_outcome(r, IDEM_RECOVER);
    cr_assert_eq(r.attempts, 2);
    cr_assert_eq(r.last_grant_ms, t0);
    cr_assert_gt(r.token, c.token);
    /* Unfinished records do not expire, after a restart either. */
    cr_assert_gt(until, get("k").expires_at_ms);
}

Test(reopen, recovered_record_keeps_attempts_and_fencing)
{
    int64_t old = claim_new("k");
    at(LEASE);
    idem_completion r = claim("k");
    expect_outcome(r, IDEM_RECOVER);
    reopen();
    idem_record rec = get("k");
    cr_assert_eq(rec.attempts, 2);
    cr_assert_eq(rec.token, r.token);
    cr_assert_eq(rec.last_grant_ms, t0 + LEASE);
    expect_rc(commit("k", old, "late"), IDEM_ESTALE);
    commit_ok("k", r.token, "ok");
}

Test(reopen, commit_after_expiry_keeps_its_extra_ttl_after_reopen)
{
    idem_completion c = claim_full("k", 1000, 3600000, NULL, NULL);
    at(5000);
    commit_ok("k", c.token, "r");
    reopen();
    cr_assert_eq(idem_clock_now(g_s), t0 + 5000, "the test clock stands still across a reopen");
    expect_rc(idem_clock_set(g_s, t0 + 5999), IDEM_OK);
    expect_outcome(claim_full("k", 1000, LEASE, NULL, NULL), IDEM_DONE);
    expect_rc(idem_clock_set(g_s, t0 + 6000), IDEM_OK);
    expect_outcome(claim_full("k", 1000, LEASE, NULL, NULL), IDEM_NEW);
}

Test(reopen, audit_trail_survives_and_outlives_the_key)
{
    make_review("k", "n");
    expect_rc(resolve("k", IDEM_RESOLVE_COMMIT, "checked", 0), IDEM_OK);
    expect_rc(idem_del(g_q, "k", 1, "bob"), IDEM_OK);
    reopen();
    cr_assert_not(found("k"));
    const idem_audit_entry *e;
    size_t n = 0;
    expect_rc(idem_audit(g_q, "k", 1, 10, &e, &n), IDEM_OK);
    cr_assert_eq(n, 2, "%zu audit entries after reopen, expected 2", n);
    cr_assert_str_eq(e[0].action, "del");
    cr_assert_str_eq(e[0].actor, "bob");
    cr_assert_str_eq(e[1].action, "resolve-commit");
    cr_assert_str_eq(e[1].actor, "alice");
    cr_assert_str_eq(e[1].reason, "checked");
}

Test(reopen, set_if_absent_value_survives)
{
    idem_completion c;
    expect_rc(idem_set_if_absent(g_q, "k", 1, "v", 1, TTL, 0, &c), IDEM_OK);
    reopen();
    expect_rc(idem_set_if_absent(g_q, "k", 1, "w", 1, TTL, 1, &c), IDEM_OK);
    expect_outcome(c, IDEM_DONE);
    expect_data(c, "v");
}

Test(reopen, binary_and_prefix_keys_survive_distinct)
{
    const char k1[] = {'a', 0, 'b'};
    const char k2[] = {'a', 0};
    idem_completion c1 = claim_bin(k1, 3, TTL, LEASE, NULL, NULL);
    idem_completion c2 = claim_bin(k2, 2, TTL, LEASE, NULL, NULL);
    expect_rc(idem_commit(g_q, k1, 3, c1.token, "one", 3), IDEM_OK);
    expect_rc(idem_commit(g_q, k2, 2, c2.token, "two", 3), IDEM_OK);
    reopen();
    idem_completion d = claim_bin(k1, 3, TTL, LEASE, NULL, NULL);
    expect_outcome(d, IDEM_DONE);
    expect_data(d, "one");
    d = claim_bin(k2, 2, TTL, LEASE, NULL, NULL);
    expect_outcome(d, IDEM_DONE);
    expect_data(d, "two");
}

Test(reopen, test_clock_does_not_go_back_at_reopen)
{
    at(3600000);
    make_committed("k", NULL, "r");
    reopen();
    cr_assert_geq(idem_clock_now(g_s), t0 + 3600000);
}

Test(reopen, stats_by_state_are_rebuilt)
{
    claim_new("a");
    make_committed("b", NULL, "r");
    make_review("c", "n");
    reopen();
    idem_stats st = stats();
    cr_assert_eq(st.keys, 3);
    cr_assert_eq(st.keys_in_flight, 1, "keys_in_flight %llu after reopen",
                 (unsigned long long)st.keys_in_flight);
    cr_assert_eq(st.keys_committed, 1);
    cr_assert_eq(st.keys_review, 1);
    cr_assert_eq(st.oldest_in_flight_ms, t0);
    cr_assert_eq(st.oldest_review_ms, t0);
}

Test(reopen, checkpoint_then_more_changes_survive)
{
    make_committed("a", NULL, "1");
    expect_rc(idem_checkpoint(g_s), IDEM_OK);
    make_committed("b", NULL, "2");
    int64_t tok = claim_new("c");
    reopen();
    expect_outcome(claim("a"), IDEM_DONE);
    expect_outcome(claim("b"), IDEM_DONE);
    cr_assert_eq(get("c").token, tok);
}

/* ------------------------------------------------------------------------------------------ */
/* read-only opens and the directory lock. */

TestSuite(open, .init = setup, .fini = teardown);

Test(open, read_only_refuses_every_change_with_ereadonly)
{
    int64_t tok = claim_new("inflight");
    make_committed("done", NULL, "r");
    store_close();
    g_opts.read_only = 1;
    store_open();
    idem_completion c;
    expect_rc(claim_rc("new", 3, TTL, LEASE, NULL, NULL, &c), IDEM_EREADONLY);
    expect_rc(commit("inflight", tok, "r"), IDEM_EREADONLY);
    expect_rc(release("inflight", tok), IDEM_EREADONLY);
    expect_rc(hold("inflight", tok, "x"), IDEM_EREADONLY);
    expect_rc(extend("inflight", tok, 1000), IDEM_EREADONLY);
    expect_rc(idem_set_if_absent(g_q, "new", 3, "v", 1, TTL, 0, &c), IDEM_EREADONLY);
    expect_rc(idem_del(g_q, "done", 4, "alice"), IDEM_EREADONLY);
    const char *keys[2] = {"done", "inflight"};
    idem_completion g[2];
    del_group(keys, 2, 0, g); /* answered at once, not left waiting for room in the log */
    cr_assert_eq(g[0].err, IDEM_EREADONLY, "%s", idem_strerror(g[0].err));
    cr_assert_eq(g[1].err, IDEM_EREADONLY, "%s", idem_strerror(g[1].err));
    expect_rc(resolve("inflight", IDEM_RESOLVE_RELEASE, "x", IDEM_F_FORCE), IDEM_EREADONLY);
    /* Reads work. */
    idem_record r = get("done");
    expect_result(r, "r");
    cr_assert_eq(get("inflight").state, IDEM_STATE_IN_FLIGHT);
    store_close();
    g_opts.read_only = 0;
    store_open();
    cr_assert_not(found("new"));
    cr_assert_eq(get("inflight").state, IDEM_STATE_IN_FLIGHT);
    cr_assert(found("done"));
    commit_ok("inflight", tok, "r");
}

/* Runs in a child: tries to open dir and reports the result code and message on fd. */
static void child_try_open(const char *dir, int wait_fd, int report_fd)
{
    char b;
    if (wait_fd >= 0 && read(wait_fd, &b, 1) != 1) _exit(3);
    idem_options o;
    idem_options_init(&o);
    o.test_clock = 1;
    idem_store *s = NULL;
    int rc = idem_open(dir, &o, &s);
    char msg[600];
    int len = snprintf(msg, sizeof msg, "%d %s", rc, rc == IDEM_OK ? "" : idem_last_error());
    if (write(report_fd, msg, (size_t)len) != len) _exit(4);
    _exit(rc == IDEM_OK ? 0 : 1); /* a successful open is left to the process exit */
}

static int read_report(int fd, char *msg, size_t cap)
{
    size_t got = 0;
    ssize_t n;
    while (got + 1 < cap && (n = read(fd, msg + got, cap - 1 - got)) > 0)
        got += (size_t)n;
    msg[got] = 0;
    cr_assert_gt(got, 0, "no report from the child");
    return atoi(msg);
}

Test(open, second_open_in_another_process_is_elocked_and_names_the_pid, .timeout = 60)
{
    int rep[2];
    cr_assert_eq(pipe(rep), 0);
    pid_t pid = fork();
    cr_assert_geq(pid, 0);
    if (pid == 0) {
        close(rep[0]);
        child_try_open(g_dir, -1, rep[1]);
    }
    close(rep[1]);
    char msg[700];
    int rc = read_report(rep[0], msg, sizeof msg);
    close(rep[0]);
    int status = 0;
    waitpid(pid, &status, 0);
    cr_assert_eq(rc, IDEM_ELOCKED, "child open: %s", msg);
    char pidstr[32];
    snprintf(pidstr, sizeof pidstr, "%d", (int)getpid());
    cr_assert_not_null(strstr(msg, pidstr), "idem_last_error does not name pid %s: %s", pidstr,
                       msg);
    /* The owner is unaffected. */
    claim_new("k");
}

Test(open, lock_is_released_by_close_and_by_the_death_of_its_owner, .timeout = 60)
{
    store_close();
    /* After close another process may open it. */
    int rep[2];
    cr_assert_eq(pipe(rep), 0);
    pid_t pid = fork();
    cr_assert_geq(pid, 0);
    if (pid == 0) {
        close(rep[0]);
        child_try_open(g_dir, -1, rep[1]);
    }
    close(rep[1]);
    char msg[700];
    int rc = read_report(rep[0], msg, sizeof msg);
    close(rep[0]);
    int status = 0;
    waitpid(pid, &status, 0);
    cr_assert_eq(rc, IDEM_OK, "open after close: %s", msg);
    /* That child died holding the store open: the lock died with it. */
    int orc = idem_open(g_dir, &g_opts, &g_s);
    cr_assert_eq(orc, IDEM_OK, "open after the owner died: %s (%s)", idem_strerror(orc),
                 idem_last_error());
    expect_rc(idem_queue_open(g_s, 8, &g_q), IDEM_OK);
}

/* Found by a review of import: a directory path with no room left for the names of the files
 * made in it (4096-byte paths) cut those names short, and different segments came out as one
 * file. Such a path is refused by name. */
Test(open, a_directory_path_with_no_room_for_its_file_names_is_refused)
{
    static char path[4100];
    int n = snprintf(path, sizeof path, "%s/", g_dir);
    memset(path + n, 'd', 4070 - (size_t)n);
    path[4070] = 0;
    idem_store *s;
    expect_rc(idem_open(path, NULL, &s), IDEM_EINVAL);
    cr_assert(strstr(idem_last_error(), "path too long"), "%s", idem_last_error());
}

/* A process out of descriptors is told so, not that memory ran out: idemd logs this cause. */
Test(open, a_queue_without_a_descriptor_for_its_eventfd_names_the_cause)
{
    int lowest = open("/dev/null", O_RDONLY | O_CLOEXEC);
    cr_assert_geq(lowest, 0);
    close(lowest);
    struct rlimit was, now;
    cr_assert_eq(getrlimit(RLIMIT_NOFILE, &was), 0);
    now = was;
    now.rlim_cur = (rlim_t)lowest; /* every descriptor below it is open */
    cr_assert_eq(setrlimit(RLIMIT_NOFILE, &now), 0);
    idem_queue *q = NULL;
    errno = 0;
    int rc = idem_queue_open(g_s, 8, &q);
    int e = errno;
    cr_assert_eq(setrlimit(RLIMIT_NOFILE, &was), 0);
    expect_rc(rc, IDEM_ENOMEM);
    cr_assert_null(q);
    cr_assert_eq(e, EMFILE, "errno %d (%s)", e, strerror(e));
    cr_assert(strstr(idem_last_error(), "eventfd") && strstr(idem_last_error(), strerror(EMFILE)),
              "%s", idem_last_error());
    /* With descriptors again, a queue opens and works. */
    expect_rc(idem_queue_open(g_s, 8, &q), IDEM_OK);
    idem_queue_close(q);
    expect_outcome(claim("after"), IDEM_NEW);
}

Test(open, clock_control_needs_the_test_clock)
{
    store_close();
    g_opts.test_clock = 0;
    store_open();
    int64_t now = idem_clock_now(g_s);
    cr_assert_eq(idem_clock_set(g_s, now + 100000), IDEM_ENOTSUP);
    cr_assert_eq(idem_clock_advance(g_s, 100000), IDEM_ENOTSUP);
    cr_assert_lt(idem_clock_now(g_s), now + 100000);
}

Test(open, test_clock_stands_still)
{
    int64_t a = idem_clock_now(g_s);
    make_committed("k", NULL, "r");
    for (int i = 0; i < 100; i++)
        expect_outcome(claim("k"), IDEM_DONE);
    cr_assert_eq(idem_clock_now(g_s), a);
    cr_assert_eq(get("k").last_seen_ms, a);
}

/* ------------------------------------------------------------------------------------------ */
/* Scans. */

TestSuite(scan, .init = setup, .fini = teardown);

/* Collects the keys of a full scan into a bitmask over names "k0".."k63". */
static uint64_t scan_mask(int state, int64_t older_ms, uint32_t count)
{
    uint64_t mask = 0, cursor = 0;
    int steps = 0;
    do {
        idem_scan_args a;
        memset(&a, 0, sizeof a);
        a.cursor = cursor;
        a.state = state;
        a.older_ms = older_ms;
        a.count = count;
        const void **keys;
        const uint32_t *lens;
        size_t n = 0;
        expect_rc(idem_scan(g_q, &a, &cursor, &keys, &lens, &n), IDEM_OK);
        for (size_t i = 0; i < n; i++) {
            char name[16];
            cr_assert(lens[i] > 1 && lens[i] < sizeof name);
            memcpy(name, keys[i], lens[i]);
            name[lens[i]] = 0;
            cr_assert_eq(name[0], 'k', "unexpected key %s", name);
            int idx = atoi(name + 1);
            cr_assert(idx >= 0 && idx < 64);
            mask |= 1ull << idx;
        }
        cr_assert_lt(++steps, 100000, "scan does not end");
    } while (cursor != 0);
    return mask;
}

static void key_name(char *buf, size_t cap, int i)
{
    snprintf(buf, cap, "k%d", i);
}

Test(scan, scan_by_state_returns_exactly_the_keys_in_that_state)
{
    uint64_t inflight = 0, committed = 0, review = 0;
    char key[16];
    for (int i = 0; i < 30; i++) {
        key_name(key, sizeof key, i);
        int64_t tok = claim_new(key);
        switch (i % 3) {
        case 0:
            inflight |= 1ull << i;
            break;
        case 1:
            commit_ok(key, tok, "r");
            committed |= 1ull << i;
            break;
        default:
            expect_rc(hold(key, tok, "n"), IDEM_OK);
            review |= 1ull << i;
        }
    }
    cr_assert_eq(scan_mask(IDEM_STATE_IN_FLIGHT, 0, 0), inflight);
    cr_assert_eq(scan_mask(IDEM_STATE_COMMITTED, 0, 0), committed);
    cr_assert_eq(scan_mask(IDEM_STATE_REVIEW, 0, 0), review);
    cr_assert_eq(scan_mask(0, 0, 0), inflight | committed | review);
    cr_assert_eq(scan_mask(0, 0, 3), inflight | committed | review, "small count steps");
}

Test(scan, scan_by_age_counts_from_first_seen)
{
    char key[16];
    for (int i = 0; i < 10; i++) {
        at(i * 1000);
        key_name(key, sizeof key, i);
        claim_new(key);
    }
    at(20000);
    /* now - first_seen >= 15000: first_seen <= 5000: keys 0..5. */
    cr_assert_eq(scan_mask(0, 15000, 0), 0x3full);
    cr_assert_eq(scan_mask(IDEM_STATE_IN_FLIGHT, 19001, 0), 0x1ull);
    cr_assert_eq(scan_mask(0, 20001, 0), 0);
    /* Repeats do not make a key younger. */
    key_name(key, sizeof key, 0);
    expect_outcome(claim(key), IDEM_RECOVER);
    cr_assert_eq(scan_mask(0, 15000, 0), 0x3full);
}

Test(scan, expired_and_released_keys_are_not_returned)
{
    char key[16];
    key_name(key, sizeof key, 0);
    make_committed(key, NULL, "r");
    key_name(key, sizeof key, 1);
    int64_t tok = claim_new(key);
    expect_rc(release(key, tok), IDEM_OK);
    key_name(key, sizeof key, 2);
    idem_completion c = claim_full(key, 2 * TTL, LEASE, NULL, NULL);
    commit_ok(key, c.token, "r");
    at(TTL);
    cr_assert_eq(scan_mask(0, 0, 0), 0x4ull);
}

/* Found by the forty-third session's review of the index: a cursor was the raw index position
 * (the top bits of a key's hash, then a bound on its low bits), so a client could bisect
 * cursors to learn a listed key's hash, and from that the store's hash seed. A cursor is now
 * sealed: in no order a client can read, and a scan by them still lists every key. */
Test(scan, cursor_values_are_sealed_and_a_scan_by_them_lists_every_key)
{
    char key[16];
    uint64_t all = 0;
    for (int i = 0; i < 60; i++) {
        key_name(key, sizeof key, i);
        make_committed(key, NULL, "r");
        all |= 1ull << i;
    }
    cr_assert_eq(scan_mask(0, 0, 1), all, "a scan a slot at a time lists every key");
    uint64_t cursor = 0, prev = 0;
    int steps = 0, descents = 0;
    do {
        idem_scan_args a;
        memset(&a, 0, sizeof a);
        a.cursor = cursor;
        a.count = 1;
        const void **keys;
        const uint32_t *lens;
        size_t n = 0;
        expect_rc(idem_scan(g_q, &a, &cursor, &keys, &lens, &n), IDEM_OK);
        descents += cursor != 0 && cursor < prev;
        prev = cursor;
        cr_assert_lt(++steps, 100000, "scan does not end");
    } while (cursor != 0);
    cr_assert_gt(steps, 20);
    cr_assert_gt(descents, 0, "%d cursors, each past the one before: positions in the index",
                 steps);
}

/* Keys of 400 bytes, numbered: "n<i>" then 'x' up to the length. */
static void long_key(char *buf, int i)
{
    memset(buf, 'x', 400);
    buf[snprintf(buf, 400, "n%d", i)] = 'x';
    buf[400] = '\0';
}

/* One call of idem_scan over every slot: how many keys it lists, each checked to be one of
 * the n long keys, none twice. */
static size_t scan_long_keys_once(int n)
{
    idem_scan_args a;
    memset(&a, 0, sizeof a);
    a.count = UINT32_MAX;
    const void **keys;
    const uint32_t *lens;
    size_t got = 0;
    uint64_t cursor = 0;
    expect_rc(idem_scan(g_q, &a, &cursor, &keys, &lens, &got), IDEM_OK);
    cr_assert_eq(cursor, 0, "one call visits every slot");
    uint8_t *seen = calloc((size_t)n, 1);
    cr_assert_not_null(seen);
    for (size_t i = 0; i < got; i++) {
        char want[401];
        const char *k = keys[i];
        cr_assert_eq(lens[i], 400);
        int idx = atoi(k + 1);
        cr_assert(k[0] == 'n' && idx >= 0 && idx < n, "unexpected key %.20s", k);
        long_key(want, idx);
        cr_assert(memcmp(k, want, 400) == 0 && !seen[idx], "key n%d wrong or listed twice", idx);
        seen[idx] = 1;
    }
    free(seen);
    return got;
}

static size_t heap_in_use(void)
{
    struct mallinfo2 m = mallinfo2();
    return m.uordblks + m.hblkhd;
}

/* A queue keeps what its largest scan's results took, for its next scan; idem_queue_trim gives
 * it back, and the queue scans as before after it. */
Test(scan, a_trimmed_queue_gives_back_a_large_scans_memory, .timeout = 60)
{
    store_close();
    g_opts.durability = IDEM_DURABILITY_NONE;
    store_open();
    enum { N = 20000 };
    char key[401];
    for (int i = 0; i < N; i++) {
        long_key(key, i);
        idem_completion c = claim(key);
        expect_outcome(c, IDEM_NEW);
    }
    size_t before = heap_in_use();
    cr_assert_eq(scan_long_keys_once(N), N);
    size_t kept = heap_in_use();
    idem_queue_trim(g_q);
    size_t after = heap_in_use();
    cr_assert_eq(scan_long_keys_once(N), N, "the queue scans after a trim");
    idem_queue_trim(g_q);
    idem_queue_trim(g_q);    /* twice in a row is harmless */
#ifndef __SANITIZE_ADDRESS__ /* ASan's allocator does not report to mallinfo2 */
    cr_assert_geq(kept, before + (size_t)N * 400, "the scan's keys are kept: %zu -> %zu", before,
                  kept);
    cr_assert_leq(after, before + 65536, "after a trim %zu bytes in use, %zu before the scan",
                  after, before);
#else
    (void)before, (void)kept, (void)after;
#endif
}

/* ------------------------------------------------------------------------------------------ */
/* Durability modes: when the flusher writes. */

TestSuite(durability, .init = setup, .fini = teardown, .timeout = 30);

/* Milliseconds until the store's flush count passes `before` (fails after 5 s). */
static int64_t ms_until_flush_after(uint64_t before)
{
    int64_t start = util_monotonic_us();
    while (stats().flushes <= before) {
        cr_assert_lt(util_monotonic_us() - start, 5000000, "no flush in 5 s");
        usleep(500);
    }
    return (util_monotonic_us() - start) / 1000;
}

/* In batch mode a caller does not wake the flusher for every change, only for the first one
 * pending or once the interval has passed. A change made just after a flush is the first
 * pending while the interval has not passed, and the flusher, finding nothing pending after
 * its flush, sleeps up to a second: it must be woken, or the change waits that second. The
 * bound, 800 ms, leaves a slow disk room and still tells the two apart. */
Test(durability, batch_mode_flushes_a_change_made_just_after_a_flush_within_the_interval)
{
    store_close();
    g_opts.durability = IDEM_DURABILITY_BATCH;
    store_open();
    uint64_t f0 = stats().flushes;
    claim_new("first");
    ms_until_flush_after(f0);
    for (int round = 0; round < 5; round++) {
        char key[32];
        snprintf(key, sizeof key, "just-after-%d", round);
        f0 = stats().flushes;
        claim_new(key);
        int64_t ms = ms_until_flush_after(f0);
        cr_assert_lt(ms, 800,
                     "round %d: the change waited %" PRId64 " ms for its flush (interval %d ms)",
                     round, ms, STORE_BATCH_FLUSH_MS);
    }
}

/* Under steady changes, batch mode flushes every STORE_BATCH_FLUSH_MS (10 ms): what a crash
 * can take back is that much. The test asks for a tenth of that cadence, for a loaded machine
 * whose flushes may take tens of ms: a flusher that waited 100 ms or more between flushes (or
 * slept its idle second) fails it. */
Test(durability, batch_mode_flushes_steady_changes_every_interval)
{
    store_close();
    g_opts.durability = IDEM_DURABILITY_BATCH;
    store_open();
    uint64_t f0 = stats().flushes;
    int64_t start = util_monotonic_us();
    char key[32];
    for (int i = 0; util_monotonic_us() - start < 1000000; i++) {
        snprintf(key, sizeof key, "steady-%d", i);
        claim_new(key);
        usleep(200);
    }
    uint64_t flushes = stats().flushes - f0;
    cr_assert_geq(flushes, 1000 / (10 * STORE_BATCH_FLUSH_MS),
                  "%llu flushes in 1 s of steady changes (interval %d ms)",
                  (unsigned long long)flushes, STORE_BATCH_FLUSH_MS);
}

/* A call that runs out of chunk buffers waits for room, the flusher flushes everything and,
 * finding nothing pending, goes to its idle sleep; what the call appends after its wait is then
 * the first pending frames, though frames were pending when it began. They must not wait for
 * that sleep (a second) either. */
Test(durability, batch_mode_flushes_what_a_call_appended_after_it_waited_for_room, .timeout = 60)
{
    store_close();
    g_opts.durability = IDEM_DURABILITY_BATCH;
    g_opts.result_bytes_max = IDEM_RESULT_BYTES_LIMIT;
    store_open();
    static char val[IDEM_RESULT_BYTES_LIMIT];
    uint64_t rng = 7;
    for (size_t i = 0; i < sizeof val; i++)
        val[i] = (char)tu_rand(&rng); /* incompressible: about 1 MiB per frame */
    enum { BIG = 62 };                /* more than the 64 MiB of chunk buffers hold, less 3 */
    static idem_op ops[BIG + 1];
    static char keys[BIG + 1][32];
    for (int i = 0; i <= BIG; i++) {
        snprintf(keys[i], sizeof keys[i], "big-%d", i);
        ops[i] = (idem_op){.kind = IDEM_OP_SET_IF_ABSENT,
                           .user_data = (uint64_t)i,
                           .key = keys[i],
                           .key_len = (uint32_t)strlen(keys[i]),
                           .ttl_ms = TTL,
                           .data = val,
                           .data_len = i < BIG ? (uint32_t)sizeof val : 1}; /* the last is small */
    }
    uint64_t f0 = stats().flushes;
    claim_new("first");
    ms_until_flush_after(f0);
    claim_new("pending-when-the-call-begins");
    uint64_t f1 = stats().flushes;
    cr_assert_eq(idem_submit(g_q, ops, BIG + 1), BIG + 1);
    uint64_t f2 = stats().flushes;
    cr_assert_gt(f2, f1, "the call did not wait for room: nothing was flushed meanwhile");
    static idem_completion out[BIG + 1];
    for (int got = 0; got < BIG + 1;) {
        int n = idem_poll(g_q, out, BIG + 1, 30000);
        cr_assert_gt(n, 0, "no completion within 30 s");
        for (int i = 0; i < n; i++)
            cr_assert_eq(out[i].err, IDEM_OK, "%s: %s", keys[out[i].user_data],
                         idem_strerror(out[i].err));
        got += n;
    }
    int64_t ms = ms_until_flush_after(f2);
    cr_assert_lt(ms, 800, "what the call appended after its wait waited %" PRId64 " ms for a flush",
                 ms);
}

/* ------------------------------------------------------------------------------------------ */
/* Stats. */

TestSuite(stats, .init = setup, .fini = teardown);

Test(stats, counters_by_outcome_and_keys_by_state)
{
    idem_stats b = stats();
    int64_t t1 = claim_new("a");                       /* new */
    expect_outcome(claim("a"), IDEM_BUSY);             /* busy */
    commit_ok("a", t1, "r");                           /* */
    expect_outcome(claim("a"), IDEM_DONE);             /* done */
    expect_outcome(claim("a"), IDEM_DONE);             /* done */
    make_committed("m", "x", "r");                     /* new */
    expect_outcome(claim_fp("m", "y"), IDEM_MISMATCH); /* mismatch */
    claim_new("l");                                    /* new */
    at(LEASE);
    idem_completion rc = claim("l"); /* recover */
    expect_outcome(rc, IDEM_RECOVER);
    expect_rc(hold("l", rc.token, "n"), IDEM_OK);
    expect_outcome(claim("l"), IDEM_REVIEW); /* review */
    claim_new("f");                          /* new, in flight */
    idem_stats a = stats();
    cr_assert_eq(a.claims_new - b.claims_new, 4);
    cr_assert_eq(a.claims_busy - b.claims_busy, 1);
    cr_assert_eq(a.claims_done - b.claims_done, 2);
    cr_assert_eq(a.claims_mismatch - b.claims_mismatch, 1);
    cr_assert_eq(a.claims_recover - b.claims_recover, 1);
    cr_assert_eq(a.claims_review - b.claims_review, 1);
    cr_assert_eq(a.keys, 4);
    cr_assert_eq(a.keys_in_flight, 1);
    cr_assert_eq(a.keys_committed, 2);
    cr_assert_eq(a.keys_review, 1);
    cr_assert_eq(a.oldest_in_flight_ms, t0 + LEASE, "oldest_in_flight_ms %" PRId64 ", t0 %" PRId64,
                 a.oldest_in_flight_ms, t0);
    cr_assert_eq(a.oldest_review_ms, t0);
    cr_assert_eq(a.store_clock_ms, t0 + LEASE);
    /* Their ages, on the store clock: the contract asks for ages, and a timestamp left an
     * alert to subtract from a clock of its own (56 years when there was none). */
    cr_assert_eq(a.oldest_in_flight_age_ms, 0);
    cr_assert_eq(a.oldest_review_age_ms, LEASE);
    at(LEASE + 250);
    a = stats();
    cr_assert_eq(a.oldest_in_flight_age_ms, 250);
    cr_assert_eq(a.oldest_review_age_ms, LEASE + 250);
}

Test(stats, last_minute_counts_claims_and_duplicates)
{
    idem_stats b = stats();
    int64_t t = claim_new("a");            /* new */
    expect_outcome(claim("a"), IDEM_BUSY); /* duplicate */
    commit_ok("a", t, "r");
    expect_outcome(claim("a"), IDEM_DONE); /* duplicate */
    idem_completion c;
    expect_rc(idem_set_if_absent(g_q, "s", 1, "v", 1, 60000, 0, &c), IDEM_OK); /* new */
    expect_rc(idem_set_if_absent(g_q, "s", 1, "v", 1, 60000, 0, &c), IDEM_OK); /* duplicate */
    idem_stats a = stats();
    cr_assert_eq(a.claims_last_minute - b.claims_last_minute, 5);
    cr_assert_eq(a.duplicates_last_minute - b.duplicates_last_minute, 3);
}

/* With records left in flight, claims committed one by one leave stale age entries behind: the
 * heap is filtered in steps of AGES_FILTER_STEP entries per push (a whole heap at once was about
 * 1 ms under the lock), it stays within its bound plus one pass's pushes, the passes remove what
 * is stale and keep every record still in flight (store_check_index). */
Test(stats, the_age_heap_is_filtered_a_step_at_a_time)
{
    g_opts.durability = IDEM_DURABILITY_NONE;
    reopen();
    store_test_ages_tidy(g_s, 0); /* pushes alone */
    int64_t t_old = idem_clock_now(g_s);
    int64_t old = claim_new("old");
    at(1000);
    size_t in_flight = 1, prev = 0, low_after_peak = SIZE_MAX, peak = 0, peak_bound = 0;
    char key[32];
    for (int i = 0; i < 3 * (int)AGES_SLACK; i++) {
        snprintf(key, sizeof key, "k%d", i);
        int64_t tok = claim_new(key);
        if (i % 1000 == 7)
            in_flight++; /* stays in flight */
        else
            commit_ok(key, tok, "r");
        size_t bound = 2 * in_flight + AGES_SLACK, pass = bound / AGES_FILTER_STEP + 2;
        store_lock(g_s);
        size_t n = g_s->ages[AGE_IN_FLIGHT].n;
        store_unlock(g_s);
        cr_assert_leq(prev, n + AGES_FILTER_STEP, "claim %d: %zu age entries, then %zu", i, prev,
                      n);
        cr_assert_leq(n, bound + pass, "claim %d: %zu age entries", i, n);
        if (n > peak) {
            peak = n;
            peak_bound = bound;
        }
        if (peak > peak_bound && n < low_after_peak) low_after_peak = n;
        prev = n;
        if (i % 4099 == 0) cr_assert_eq(store_check_index(g_s, NULL), IDEM_OK, "claim %d", i);
    }
    cr_assert_eq(store_check_index(g_s, NULL), IDEM_OK);
    cr_assert_gt(peak, peak_bound, "no pass began (peak %zu)", peak);
    cr_assert_lt(low_after_peak, 1000, "a pass left %zu entries", low_after_peak);
    idem_stats a = stats();
    cr_assert_eq(a.keys_in_flight, in_flight);
    cr_assert_eq(a.oldest_in_flight_ms, t_old);
    commit_ok("old", old, "r");
    cr_assert_eq(stats().oldest_in_flight_ms, t0 + 1000);
}

/* Commits push no age entries: after a burst of claims committed but one, the flusher filters
 * the heap in steps between its rounds, with no stats call and no further claim, until it is
 * within its bound (entries committed after the pass went by stay until the next pass), so the
 * stats call has no heap to filter at once. */
Test(stats, the_flusher_filters_the_age_heap_after_a_committed_burst)
{
    g_opts.durability = IDEM_DURABILITY_NONE;
    reopen();
    static int64_t tokens[40000];
    char key[32];
    int64_t t_claims = idem_clock_now(g_s);
    for (int i = 0; i < 40000; i++) {
        snprintf(key, sizeof key, "k%d", i);
        tokens[i] = claim_new(key);
    }
    for (int i = 0; i < 40000; i++) {
        snprintf(key, sizeof key, "k%d", i);
        if (i != 777) commit_ok(key, tokens[i], "r");
    }
    const size_t bound = 2 * 1 + AGES_SLACK;
    size_t left = SIZE_MAX;
    for (int ms = 0; ms < 20000 && left > bound; ms++) {
        store_lock(g_s);
        left = g_s->ages[AGE_IN_FLIGHT].n;
        store_unlock(g_s);
        if (left > bound) usleep(1000);
    }
    cr_assert_leq(left, bound, "%zu age entries kept for 1 record in flight", left);
    cr_assert_eq(store_check_index(g_s, NULL), IDEM_OK);
    cr_assert_eq(stats().oldest_in_flight_ms, t_claims);
}

/* Closing while the flusher filters an age heap, in durability none: the flusher lets the lock
 * go after each step of filtering, and a close that came in then (and waits for the written
 * batches to be flushed) made it leave at once, with nothing flushed: the close waited forever.
 * The hook holds the flusher in that gap until the close waits. */
static atomic_int g_flusher_held, g_tidy_steps;

static void hold_flusher_until_the_close_waits(idem_store *s)
{
    /* The third step: a round that flushed nothing (the first may have flushed, and a round
     * that flushed goes round again at once). */
    if (atomic_fetch_add(&g_tidy_steps, 1) < 2) return;
    s->test_after_tidy = NULL; /* read by the flusher with mu held: it runs once */
    atomic_store(&g_flusher_held, 1);
    for (int i = 0; i < 20000; i++) {
        store_lock(s);
        int waiting = s->closing && s->sync_waiters > 0;
        store_unlock(s);
        if (waiting) return;
        usleep(500);
    }
}

Test(stats, a_close_while_the_flusher_filters_finds_it_there, .timeout = 60)
{
    g_opts.durability = IDEM_DURABILITY_NONE;
    reopen();
    static int64_t tokens[24000];
    char key[32];
    for (int i = 0; i < 24000; i++) {
        snprintf(key, sizeof key, "k%d", i);
        tokens[i] = claim_new(key);
    }
    store_test_ages_tidy(g_s, 0);
    for (int i = 1; i < 24000; i++) { /* the heap is past its bound */
        snprintf(key, sizeof key, "k%d", i);
        commit_ok(key, tokens[i], "r");
    }
    int pending = 1; /* until the flusher has written every batch (not flushed: none) */
    for (int ms = 0; ms < 10000 && pending; ms++) {
        store_lock(g_s);
        pending = wal_pending(g_s->wal);
        store_unlock(g_s);
        if (pending) usleep(1000);
    }
    cr_assert(!pending);
    store_lock(g_s);
    g_s->test_after_tidy = hold_flusher_until_the_close_waits;
    g_s->test_no_tidy = 0; /* the flusher filters, at the latest when its idle second ends */
    store_unlock(g_s);
    for (int ms = 0; ms < 10000 && !atomic_load(&g_flusher_held); ms++)
        usleep(1000);
    cr_assert(atomic_load(&g_flusher_held), "the flusher took no step of filtering");
    idem_queue_close(g_q);
    g_q = NULL;
    cr_assert_eq(idem_close(g_s), IDEM_OK);
    g_s = NULL;
    store_open();
    cr_assert_eq(get("k0").state, IDEM_STATE_IN_FLIGHT);
    cr_assert_eq(get("k23999").state, IDEM_STATE_COMMITTED);
}

/* A burst of 40,000 claims pushes its age entries while they are all in flight (no rebuild);
 * once all but one are committed, the first stats call filters the heap (in steps, letting the
 * lock go between them), before it looks for the oldest: the one left
 * is the oldest, and the heap keeps no stale entry behind it (popping from the top alone would
 * stop at it and keep the ~20,000 stale entries of its time). */
Test(stats, the_first_stats_after_a_committed_burst_keeps_only_what_is_in_flight)
{
    g_opts.durability = IDEM_DURABILITY_NONE;
    reopen();
    store_test_ages_tidy(g_s, 0); /* the stats call filters, not the flusher */
    static int64_t tokens[40000];
    char key[32];
    for (int i = 0; i < 40000; i++) {
        if (i == 20000) at(1000);
        snprintf(key, sizeof key, "k%d", i);
        tokens[i] = claim_new(key);
    }
    for (int i = 0; i < 40000; i++) {
        snprintf(key, sizeof key, "k%d", i);
        if (i != 30000) commit_ok(key, tokens[i], "r");
    }
    store_lock(g_s);
    uint64_t yields = g_s->ages_yields;
    store_unlock(g_s);
    idem_stats a = stats();
    cr_assert_eq(a.keys_in_flight, 1);
    cr_assert_eq(a.oldest_in_flight_ms, t0 + 1000, "oldest_in_flight_ms %" PRId64,
                 a.oldest_in_flight_ms);
    store_lock(g_s);
    yields = g_s->ages_yields - yields;
    store_unlock(g_s);
    /* 40,000 entries in steps of 4,096: the lock was let go between them. */
    cr_assert_geq(yields, 40000 / AGES_VIEW_STEP - 1, "the lock was let go %" PRIu64 " times",
                  yields);
    store_lock(g_s);
    size_t left = g_s->ages[AGE_IN_FLIGHT].n;
    store_unlock(g_s);
    cr_assert_lt(left, 100, "%zu age entries kept for 1 record in flight", left);
    commit_ok("k30000", tokens[30000], "r");
    cr_assert_eq(stats().oldest_in_flight_ms, 0);
}

/* Room for repeat counters (entries allocated). */
static uint32_t seen_room(void)
{
    store_lock(g_s);
    uint32_t cap = g_s->seen_cap;
    store_unlock(g_s);
    return cap;
}

/* The first repeated key takes a table of 1,024 repeat counters (16 KiB), not a chunk of 2 MiB:
 * a small store keeps a small table, and the table grows as keys are repeated. (Counted in
 * memory_bytes too, but that also moves with the log's buffers, taken as batches need them.) */
Test(stats, a_few_repeated_keys_take_a_small_table_of_counters)
{
    g_opts.durability = IDEM_DURABILITY_NONE;
    reopen();
    make_committed("a", NULL, "r");
    cr_assert_eq(seen_room(), 0);
    expect_outcome(claim("a"), IDEM_DONE);
    cr_assert_eq(seen_room(), 1024, "room for %u repeat counters", seen_room());
    char key[32];
    for (int i = 0; i < 1500; i++) {
        snprintf(key, sizeof key, "k%d", i);
        make_committed(key, NULL, "r");
        expect_outcome(claim(key), IDEM_DONE);
    }
    cr_assert_eq(seen_room(), 2048, "room for %u repeat counters", seen_room());
    expect_outcome(claim("a"), IDEM_DONE);
    cr_assert_eq(get("a").seen_count, 3);
    cr_assert_eq(get("k1499").seen_count, 2);
}

/* The log's chunk buffers are allocated as a burst needs them and kept until close: between
 * flushes, with none pending, they are still the process's memory and count in memory_bytes. */
Test(stats, memory_counts_the_log_buffers_kept_between_flushes)
{
    claim_new("a"); /* sync: its chunk is flushed and released before the claim returns */
    idem_stats a = stats();
    store_lock(g_s);
    uint64_t index_bytes = index_memory_bytes(g_s->ix);
    store_unlock(g_s);
    cr_assert_geq(a.memory_bytes, index_bytes + WAL_CHUNK_BYTES,
                  "memory_bytes %" PRIu64 ", index %" PRIu64, a.memory_bytes, index_bytes);
}

static uint64_t log_buffer_bytes(void)
{
    store_lock(g_s);
    uint64_t b = wal_buffer_bytes(g_s->wal);
    store_unlock(g_s);
    return b;
}

/* Sets `n` keys "<prefix>-i" to values of `len` bytes that do not compress, in one submit, so
 * their frames fill chunk buffers before the flusher can take any; checks every answer. */
static void set_burst(idem_queue *q, const char *prefix, int n, uint32_t len, uint8_t *vals)
{
    static char keys[IDEM_BATCH_MAX][32];
    static idem_op ops[IDEM_BATCH_MAX];
    static idem_completion out[IDEM_BATCH_MAX];
    for (int i = 0; i < n; i++) {
        snprintf(keys[i], sizeof keys[i], "%s-%d", prefix, i);
        ops[i] = (idem_op){.kind = IDEM_OP_SET_IF_ABSENT,
                           .user_data = (uint64_t)i,
                           .key = keys[i],
                           .key_len = (uint32_t)strlen(keys[i]),
                           .ttl_ms = 3600000,
                           .data = vals + (size_t)i * len,
                           .data_len = len};
    }
    cr_assert_eq(idem_submit(q, ops, (size_t)n), n);
    for (int got = 0; got < n;) {
        int k = idem_poll(q, out, IDEM_BATCH_MAX, 30000);
        cr_assert_gt(k, 0, "no completion within 30 s");
        for (int i = 0; i < k; i++) {
            cr_assert_eq(out[i].err, IDEM_OK, "%s", idem_strerror(out[i].err));
            cr_assert_eq(out[i].outcome, IDEM_NEW);
        }
        got += k;
    }
}

/* A burst's log chunk buffers go back once no flush came for STORE_BUFFERS_IDLE_MS of elapsed
 * time, all but STORE_BUFFERS_KEPT; what the burst wrote is read back whole, and a later burst
 * allocates buffers again. */
Test(stats, an_idle_log_gives_back_the_buffers_of_a_burst, .timeout = 60)
{
    store_close();
    g_opts.clock = &g_mono_clock;
    store_open();
    enum { N = 2048, LEN = 4000 };
    uint8_t *vals = tu_random_bytes((size_t)N * LEN, 7); /* nothing for lz4 to save */
    idem_queue *q;
    cr_assert_eq(idem_queue_open(g_s, IDEM_BATCH_MAX, &q), IDEM_OK);
    set_burst(q, "burst", N, LEN, vals);
    uint64_t kept = (uint64_t)STORE_BUFFERS_KEPT * WAL_CHUNK_BYTES;
    uint64_t before = log_buffer_bytes();
    cr_assert_geq(before, kept + WAL_CHUNK_BYTES, "the burst took %" PRIu64 " bytes of buffers",
                  before);
    uint64_t mem_before = stats().memory_bytes;
    atomic_fetch_add(&g_mono_ms, STORE_BUFFERS_IDLE_MS);
    for (int i = 0; i < 500 && log_buffer_bytes() > kept; i++) /* the flusher's idle sleep */
        usleep(10000);
    cr_assert_eq(log_buffer_bytes(), kept);
    cr_assert_eq(stats().memory_bytes, mem_before - (before - kept));
    /* The buffers kept hold the next batch, its END's and a SEGEND's included: a claim after
     * the idle second maps none (a guard of the pairing of STORE_BUFFERS_KEPT with the chunks
     * a frame holds back: with two kept, every such claim mapped one, refused for memory where
     * mapping failed). */
    store_lock(g_s);
    wal_test_fail_buffers(g_s->wal, 1);
    store_unlock(g_s);
    expect_outcome(claim("after-idle"), IDEM_NEW);
    store_lock(g_s);
    wal_test_fail_buffers(g_s->wal, 0);
    store_unlock(g_s);
    cr_assert_eq(log_buffer_bytes(), kept);
    idem_completion c;
    for (int i = 0; i < N; i += 7) {
        char key[32];
        snprintf(key, sizeof key, "burst-%d", i);
        cr_assert_eq(idem_get(q, key, strlen(key), &c), IDEM_OK);
        cr_assert(c.found);
        cr_assert_eq(c.record.result_len, LEN);
        cr_assert_eq(memcmp(c.record.result, vals + (size_t)i * LEN, LEN), 0, "%s", key);
    }
    set_burst(q, "again", N, LEN, vals);
    cr_assert_geq(log_buffer_bytes(), kept + WAL_CHUNK_BYTES);
    idem_queue_close(q);
    free(vals);
}

/* Whether key is among the records of an attention list. */
static int attention_has(const idem_record *recs, size_t n, const char *key)
{
    for (size_t i = 0; i < n; i++)
        if (recs[i].key_len == strlen(key) && memcmp(recs[i].key, key, recs[i].key_len) == 0)
            return 1;
    return 0;
}

/* An in_flight record whose lease ran out is listed however many in_flight records with
 * running leases come before it in the attention heap: the list is not cut to its first
 * entries before they are checked (the newest claim sits at the heap's end). */
Test(stats, attention_finds_a_lapsed_lease_behind_many_running_ones)
{
    char key[32];
    for (int i = 0; i < 3000; i++) {
        snprintf(key, sizeof key, "k%d", i);
        expect_outcome(claim_full(key, TTL, 3600000, NULL, NULL), IDEM_NEW);
    }
    at(10);
    expect_outcome(claim_full("short", TTL, 1000, NULL, NULL), IDEM_NEW);
    at(2000);
    idem_attention_args aa = {.max = 10};
    const idem_record *recs;
    size_t n = 0;
    expect_rc(idem_attention(g_q, &aa, &recs, &n), IDEM_OK);
    cr_assert_eq(n, 1, "%zu records listed", n);
    cr_assert(attention_has(recs, n, "short"));
    cr_assert_eq(recs[0].first_seen_ms, t0 + 10);
    /* Kept until the next call: the records listed, not room for max (100,000 records of
     * 192 bytes were held for one listed). */
    aa.max = 100000;
    expect_rc(idem_attention(g_q, &aa, &recs, &n), IDEM_OK);
    cr_assert_eq(n, 1, "%zu records listed", n);
    cr_assert_eq(recs[0].first_seen_ms, t0 + 10);
    cr_assert_lt(malloc_usable_size((void *)recs), 65536, "%zu bytes kept for one record",
                 malloc_usable_size((void *)recs));
}

/* A committed record with mismatches is listed until it expires, not until a sweep reaches it:
 * at expires_at it is absent (rule 5), from the list too, while a get says so. */
Test(stats, attention_leaves_out_a_mismatched_record_once_it_expired)
{
    make_committed("k", "body-A", "res");
    at(10);
    expect_outcome(claim_fp("k", "body-B"), IDEM_MISMATCH);
    idem_attention_args aa = {.max = 10};
    const idem_record *recs;
    size_t n = 0;
    at(TTL - 1);
    expect_rc(idem_attention(g_q, &aa, &recs, &n), IDEM_OK);
    cr_assert_eq(n, 1, "%zu records listed one ms before the expiry", n);
    cr_assert(attention_has(recs, n, "k"));
    cr_assert_eq(recs[0].mismatch_count, 1);
    at(TTL);
    expect_rc(idem_attention(g_q, &aa, &recs, &n), IDEM_OK);
    cr_assert_eq(n, 0, "%zu records listed at the expiry", n);
    idem_completion c;
    expect_rc(idem_get(g_q, "k", 1, &c), IDEM_OK);
    cr_assert_not(c.found);
}

/* With more records needing attention than max, the list holds the oldest of them, in order:
 * every other record's lease ran out, and the first 100 of those are listed. */
Test(stats, attention_cut_to_max_keeps_the_oldest)
{
    char key[32];
    for (int i = 0; i < 3000; i++) {
        at(i);
        snprintf(key, sizeof key, "k%d", i);
        expect_outcome(claim_full(key, TTL, i % 2 ? 3600000 : 1000, NULL, NULL), IDEM_NEW);
    }
    at(3000 + 1000);
    idem_attention_args aa = {.max = 100};
    const idem_record *recs;
    size_t n = 0;
    expect_rc(idem_attention(g_q, &aa, &recs, &n), IDEM_OK);
    cr_assert_eq(n, 100, "%zu records listed", n);
    for (size_t i = 0; i < n; i++) {
        snprintf(key, sizeof key, "k%zu", 2 * i);
        cr_assert_eq(recs[i].first_seen_ms, t0 + 2 * (int64_t)i, "record %zu", i);
        cr_assert(recs[i].key_len == strlen(key) && memcmp(recs[i].key, key, strlen(key)) == 0,
                  "record %zu is not %s", i, key);
    }
}

/* A list whose records hold large results ends once their bytes reach max_bytes, the record
 * that reaches it listed, mismatches the latest first (the oldest until the fifty-ninth
 * session): IDEM.ATTENTION COUNT 100000 over records with 64 KiB results copied them all
 * (6 GiB) before idemd refused the reply for its size. The buffer of a large list is not kept
 * past the next call. */
Test(stats, attention_cut_to_its_byte_limit_keeps_the_latest_mismatches)
{
    enum { N = 10, LEN = 10000 };
    char *val = malloc(LEN + 1), key[32];
    cr_assert_not_null(val);
    memset(val, 'v', LEN);
    val[LEN] = 0;
    for (int i = 0; i < N; i++) {
        at(i);
        snprintf(key, sizeof key, "big%d", i);
        make_committed(key, "A", val);
        expect_outcome(claim_fp(key, "B"), IDEM_MISMATCH);
    }
    free(val);
    idem_attention_args aa = {.max = 100, .max_bytes = 25000};
    const idem_record *recs;
    size_t n = 0;
    expect_rc(idem_attention(g_q, &aa, &recs, &n), IDEM_OK);
    cr_assert_eq(n, 3, "%zu records listed", n);
    for (size_t i = 0; i < n; i++) { /* big7, big8, big9, by first_seen */
        snprintf(key, sizeof key, "big%zu", N - 3 + i);
        cr_assert(attention_has(recs + i, 1, key), "record %zu is not %s", i, key);
        cr_assert_eq(recs[i].result_len, LEN);
    }
    aa.max_bytes = 0;
    expect_rc(idem_attention(g_q, &aa, &recs, &n), IDEM_OK);
    cr_assert_eq(n, N, "%zu records listed without a byte limit", n);
    for (size_t i = 0; i < n; i++)
        cr_assert_eq(((const char *)recs[i].result)[LEN - 1], 'v');
}

/* What the hook below writes while an attention list has let the lock go between steps. */
static idem_queue *g_q2;
static int64_t g_ext_token, g_held_token;

static void rewrite_two_records(idem_store *s)
{
    store_lock(s);
    s->test_let_go = NULL; /* once */
    store_unlock(s);
    expect_rc(idem_extend(g_q2, "ext", 3, g_ext_token, 60000), IDEM_OK);
    expect_rc(idem_hold(g_q2, "held", 4, g_held_token, "why", 3), IDEM_OK); /* to review */
    idem_claim_args a = {.ttl_ms = TTL, .lease_ms = LEASE, .fp = "fp3", .fp_len = 3};
    idem_completion c;
    expect_rc(idem_claim(g_q2, "mm", 2, &a, &c), IDEM_OK);
    expect_outcome(c, IDEM_MISMATCH);
}

/* A record that needs attention throughout an attention list is listed even when it is written
 * again while the list lets the lock go between its steps: its version moves to another log
 * address, away from the entry the list copied (an extend of a record in flight past the age
 * asked for, a mismatch recorded again), or to another group than its entry's (a hold moves a
 * record in flight to review, whose group was listed already). Each would go unlisted. Each
 * record is listed once, also one whose older version's entry leads to it as well. */
Test(stats, attention_lists_records_rewritten_while_it_runs)
{
    make_committed("mm", "fp1", "r");
    expect_outcome(claim_fp("mm", "fp2"), IDEM_MISMATCH);
    char key[32];
    for (int i = 0; i < (int)AGES_VIEW_STEP + 1000; i++) {
        snprintf(key, sizeof key, "k%d", i);
        claim_new(key);
    }
    at(10);
    g_ext_token = claim_new("ext"); /* the newest: checked after the first step */
    g_held_token = claim_new("held");
    /* Extended before the list: its heap holds the entries of both versions, one stale. */
    expect_rc(extend("twice", claim_new("twice"), 60000), IDEM_OK);
    at(2000);
    expect_rc(idem_queue_open(g_s, 4, &g_q2), IDEM_OK);
    store_lock(g_s);
    g_s->test_let_go = rewrite_two_records;
    store_unlock(g_s);
    idem_attention_args aa = {.older_ms = 1000, .max = 100000};
    const idem_record *recs;
    size_t n = 0;
    expect_rc(idem_attention(g_q, &aa, &recs, &n), IDEM_OK);
    idem_queue_close(g_q2);
    cr_assert_null(g_s->test_let_go, "the list never let the lock go");
    cr_assert_eq(n, AGES_VIEW_STEP + 1000 + 4, "%zu records listed", n);
    cr_assert(attention_has(recs, n, "ext"), "the extended record is missing");
    cr_assert(attention_has(recs, n, "held"), "the record held (now in review) is missing");
    cr_assert(attention_has(recs, n, "mm"), "the record mismatched again is missing");
    for (size_t i = 0; i < n; i++)
        if (recs[i].key_len == 2 && memcmp(recs[i].key, "mm", 2) == 0)
            cr_assert_eq(recs[i].mismatch_count, 2);
}

static atomic_int g_let_go_calls;

static void count_let_go(idem_store *s)
{
    (void)s;
    atomic_fetch_add(&g_let_go_calls, 1);
}

/* Found by a review of the attention list: its steps were counted in entries alone (4,096), so
 * 40 committed records with mismatches and 60,000-byte results (2.4 MB) were decoded, copied
 * and faulted in under one hold of the lock, every claim waiting meanwhile (1000 records of
 * 1 MiB results, the library's default count, would be 1 GiB). A step ends at 256 KiB too. */
Test(stats, attention_lets_the_lock_go_between_large_records)
{
    enum { N = 40, LEN = 60000 };
    char *val = malloc(LEN + 1), key[32];
    cr_assert_not_null(val);
    uint64_t x = 7;
    for (int i = 0; i < LEN; i++) {
        x = x * 6364136223846793005ull + 1442695040888963407ull;
        val[i] = (char)('!' + (x >> 33) % 90); /* printable, poorly compressible */
    }
    val[LEN] = 0;
    for (int i = 0; i < N; i++) {
        snprintf(key, sizeof key, "big%d", i);
        make_committed(key, "A", val);
        expect_outcome(claim_fp(key, "B"), IDEM_MISMATCH);
    }
    free(val);
    atomic_store(&g_let_go_calls, 0);
    store_lock(g_s);
    g_s->test_let_go = count_let_go;
    store_unlock(g_s);
    idem_attention_args aa = {.max = 100000}; /* no byte limit: the library's default */
    const idem_record *recs;
    size_t n = 0;
    expect_rc(idem_attention(g_q, &aa, &recs, &n), IDEM_OK);
    store_lock(g_s);
    g_s->test_let_go = NULL;
    store_unlock(g_s);
    cr_assert_eq(n, N);
    for (size_t i = 0; i < n; i++)
        cr_assert_eq(recs[i].result_len, LEN);
    /* 2.4 MB in steps of five records (256 KiB and the record that passes it): 7 let-goes */
    cr_assert_geq(atomic_load(&g_let_go_calls), 6, "the lock was let go %d times for %d bytes",
                  atomic_load(&g_let_go_calls), N * LEN);
}

/* Found by a review of the attention list: cut to COUNT, it kept the oldest mismatches, and
 * committed records with mismatches stay listed until they expire (days), so a new incident
 * never showed (idemctl called the list the most urgent, latest first). */
Test(stats, attention_cut_in_the_mismatch_group_keeps_the_latest_incident)
{
    char key[32];
    for (int i = 0; i < 3; i++) {
        at(10 * i);
        snprintf(key, sizeof key, "m%d", i);
        make_committed(key, "A", "r");
        expect_outcome(claim_fp(key, "B"), IDEM_MISMATCH);
    }
    idem_attention_args aa = {.max = 2};
    const idem_record *recs;
    size_t n = 0;
    expect_rc(idem_attention(g_q, &aa, &recs, &n), IDEM_OK);
    cr_assert_eq(n, 2);
    cr_assert(attention_has(recs, n, "m2"), "the latest mismatch was cut");
    cr_assert(attention_has(recs, n, "m1"));
}

Test(stats, empty_store_has_no_oldest_records)
{
    idem_stats a = stats();
    cr_assert_eq(a.keys, 0);
    cr_assert_eq(a.oldest_in_flight_ms, 0);
    cr_assert_eq(a.oldest_review_ms, 0);
    cr_assert_eq(a.oldest_in_flight_age_ms, 0);
    cr_assert_eq(a.oldest_review_age_ms, 0);
    cr_assert_eq(a.fatal, 0);
}

Test(stats, release_and_del_lower_the_key_counts)
{
    int64_t tok = claim_new("a");
    make_committed("b", NULL, "r");
    expect_rc(release("a", tok), IDEM_OK);
    expect_rc(idem_del(g_q, "b", 1, "alice"), IDEM_OK);
    idem_stats a = stats();
    cr_assert_eq(a.keys, 0);
    cr_assert_eq(a.keys_in_flight, 0);
    cr_assert_eq(a.keys_committed, 0);
}

/* ---- Capacity limits: FULL for new claims, nothing evicted ---- */

static void setup_capacity(void)
{
    g_dir = tu_mkdtemp("rules");
    cr_assert_not_null(g_dir);
    idem_options_init(&g_opts);
    g_opts.test_clock = 1;
    g_opts.max_keys = 100;
    store_open();
}

TestSuite(capacity, .init = setup_capacity, .fini = teardown);

Test(capacity, past_max_keys_a_new_claim_is_full_and_every_key_stays)
{
    char key[32];
    int64_t tok[100];
    for (int i = 0; i < 100; i++) {
        snprintf(key, sizeof key, "cap-%03d", i);
        idem_completion c = claim(key);
        expect_outcome(c, IDEM_NEW);
        tok[i] = c.token;
    }
    idem_completion c;
    cr_assert_eq(claim_rc("cap-new", 7, TTL, LEASE, NULL, NULL, &c), IDEM_EFULL);
    cr_assert_eq(claim_rc("cap-new", 7, TTL, LEASE, NULL, NULL, &c), IDEM_EFULL);
    /* Repeats and owner calls go on; nothing was evicted. */
    for (int i = 0; i < 100; i++) {
        snprintf(key, sizeof key, "cap-%03d", i);
        expect_outcome(claim(key), IDEM_BUSY);
    }
    snprintf(key, sizeof key, "cap-%03d", 7);
    commit_ok(key, tok[7], "r7");
    expect_outcome(claim(key), IDEM_DONE);
    /* A release frees a place: the next new key fits, and only one. */
    snprintf(key, sizeof key, "cap-%03d", 8);
    expect_rc(idem_release(g_q, key, strlen(key), tok[8]), IDEM_OK);
    expect_outcome(claim("cap-new"), IDEM_NEW);
    cr_assert_eq(claim_rc("cap-other", 9, TTL, LEASE, NULL, NULL, &c), IDEM_EFULL);
    reopen(); /* the limit is an option, the records are the store's */
    cr_assert_eq(claim_rc("cap-other", 9, TTL, LEASE, NULL, NULL, &c), IDEM_EFULL);
    expect_outcome(claim("cap-new"), IDEM_BUSY);
}

static void setup_no_sync(void)
{
    g_dir = tu_mkdtemp("rules");
    cr_assert_not_null(g_dir);
    idem_options_init(&g_opts);
    g_opts.test_clock = 1;
    g_opts.durability = IDEM_DURABILITY_NONE; /* thousands of keys, one flush each else */
    store_open();
}

/* Found by a review of the index: a new key the index found no room for (no memory for its
 * next block, or keys sharing 24 bits of their hash) was answered FULL with every limit
 * unreached, nothing counted or logged, and compaction not pressed to take expired keys out. */
Test(index_room, a_new_key_the_index_cannot_grow_for_is_full_counted_and_presses_compaction,
     .init = setup_no_sync, .fini = teardown)
{
    store_lock(g_s);
    index_test_refuse_rebuilds(g_s->ix, 1);
    store_unlock(g_s);
    char key[32];
    int rc = IDEM_OK, held = 0;
    idem_completion c;
    for (; held < 1000000 && rc == IDEM_OK; held++) {
        snprintf(key, sizeof key, "grow-%07d", held);
        rc = claim_rc(key, strlen(key), TTL, LEASE, NULL, NULL, &c);
    }
    held--; /* the last one was refused */
    cr_assert_eq(rc, IDEM_EFULL, "%s", idem_strerror(rc));
    idem_stats st = stats();
    cr_assert_eq(st.index_refusals, 1);
    cr_assert_eq(st.keys, (uint64_t)held);
    pthread_mutex_lock(&g_s->mu);
    int pressed = g_s->cap_full_seen;
    pthread_mutex_unlock(&g_s->mu);
    cr_assert(pressed, "compaction was not pressed to take expired keys out");
    expect_outcome(claim("grow-0000000"), IDEM_BUSY); /* repeats go on */
    cr_assert_eq(claim_rc(key, strlen(key), TTL, LEASE, NULL, NULL, &c), IDEM_EFULL);
    cr_assert_eq(stats().index_refusals, 2);
    store_lock(g_s);
    index_test_refuse_rebuilds(g_s->ix, 0); /* memory back */
    store_unlock(g_s);
    expect_outcome(claim(key), IDEM_NEW);
    cr_assert_eq(stats().index_refusals, 2);
    cr_assert_eq(stats().keys, (uint64_t)held + 1);
}

/* Claims key, a new one, until it is answered new: each FULL is a try more while compaction
 * takes expired keys out of the index on its own. Fails after 5 s. */
static void claim_new_once_room_is_made(const char *key)
{
    idem_completion c;
    for (int tries = 1;; tries++) {
        int rc = claim_rc(key, strlen(key), TTL, LEASE, NULL, NULL, &c);
        if (rc == IDEM_OK) {
            expect_outcome(c, IDEM_NEW);
            return;
        }
        cr_assert_eq(rc, IDEM_EFULL, "%s: %s", key, idem_strerror(rc));
        cr_assert_lt(tries, 500, "%s still FULL after 5 s among expired keys", key);
        usleep(10000);
    }
}

/* Waits up to 5 s for the store to hold `keys` keys. */
static void keys_become(uint64_t keys)
{
    idem_stats st;
    for (int i = 0;; i++) {
        idem_get_stats(g_s, &st);
        if (st.keys == keys) return;
        cr_assert_lt(i, 500, "%" PRIu64 " keys, not %" PRIu64, st.keys, keys);
        usleep(10000);
    }
}

/* Claims n keys named prefix-NNN, each answered new at once: the store has room for them. */
static void new_keys_fit(const char *prefix, int n)
{
    char key[32];
    for (int i = 0; i < n; i++) {
        snprintf(key, sizeof key, "%s-%03d", prefix, i);
        expect_outcome(claim(key), IDEM_NEW);
    }
}

/* From t0 on (set to now), 100 keys cap-000 .. cap-099 committed: the store's key limit. */
static void fill_with_committed_keys(void)
{
    char key[32];
    t0 = idem_clock_now(g_s);
    for (int i = 0; i < 100; i++) {
        snprintf(key, sizeof key, "cap-%03d", i);
        make_committed(key, NULL, "r");
    }
}

/* A store at its key limit whose keys have expired takes their re-issue at once: the new version
 * replaces the expired record (absent by rule 5) and adds no key. A key it does not hold waits
 * for compaction to take the expired records out of the index: its FULL presses compaction,
 * which ends the segment they are in (the only one: nothing else would ever end it, since
 * nothing new is written) and walks it. */
static void expired_keys_make_room_for_new_ones(void)
{
    fill_with_committed_keys();
    idem_completion c;
    cr_assert_eq(claim_rc("cap-new", 7, TTL, LEASE, NULL, NULL, &c), IDEM_EFULL);
    at(TTL);
    idem_completion again = claim_full("cap-000", TTL, TTL, NULL, NULL);
    expect_outcome(again, IDEM_NEW);
    expect_rc(idem_set_if_absent(g_q, "cap-001", 7, "v", 1, TTL, 0, &c), IDEM_OK);
    expect_outcome(c, IDEM_NEW);
    /* A segment's expiry tally has buckets an eighth of their offset wide: an expired bucket
     * counts once all of it has expired. */
    at(TTL + TTL / 8);
    claim_new_once_room_is_made("cap-new");
    keys_become(3);
    /* The re-issued keys kept their new versions; the other expired ones are gone. */
    expect_outcome(claim("cap-000"), IDEM_BUSY);
    cr_assert_eq(get("cap-000").token, again.token);
    expect_outcome(claim("cap-001"), IDEM_DONE);
    cr_assert(!found("cap-002"));
    new_keys_fit("fit", 97);
    cr_assert_eq(claim_rc("past", 4, TTL, LEASE, NULL, NULL, &c), IDEM_EFULL);
    reopen();
    keys_become(100);
    expect_outcome(claim("cap-001"), IDEM_DONE);
}

Test(capacity, at_max_keys_expired_keys_make_room_for_new_ones)
{
    expired_keys_make_room_for_new_ones();
}

/* Found by a review of compaction: a segment's expiry tally put every expiry more than 2^31 ms
 * (24.8 days) after the segment's first write in its last bucket, "later or never", which never
 * counts as expired. Keys of a month at the key limit then answered FULL among expired keys for
 * good, and under no limit such keys stayed in memory until the segment's last key expired.
 * The tally now reaches past the longest TTL; keys of nine years are counted as theirs. */
static void keys_of_a_ttl_make_room_once_expired(uint64_t ttl)
{
    char key[32];
    t0 = idem_clock_now(g_s);
    for (int i = 0; i < 100; i++) {
        snprintf(key, sizeof key, "long-%03d", i);
        idem_completion c = claim_full(key, ttl, LEASE, NULL, NULL);
        expect_outcome(c, IDEM_NEW);
        commit_ok(key, c.token, "r");
    }
    idem_completion c;
    cr_assert_eq(claim_rc("cap-new", 7, TTL, LEASE, NULL, NULL, &c), IDEM_EFULL);
    at((int64_t)(ttl - ttl / 16));
    cr_assert_eq(claim_rc("cap-new", 7, TTL, LEASE, NULL, NULL, &c), IDEM_EFULL,
                 "room before the keys expired");
    at((int64_t)(ttl + ttl / 8));
    claim_new_once_room_is_made("cap-new");
    keys_become(1);
}

Test(capacity, at_max_keys_keys_of_a_month_make_room_once_expired)
{
    keys_of_a_ttl_make_room_once_expired(30ull * 86400000);
}

Test(capacity, at_max_keys_keys_of_nine_years_make_room_once_expired)
{
    keys_of_a_ttl_make_room_once_expired(9ull * 365 * 86400000);
}

/* In durability none the segment ended for the walk is flushed durable at once: nothing else
 * would make it so, and a walk waits for it. */
Test(capacity, at_max_keys_expired_keys_make_room_in_durability_none)
{
    store_close();
    g_opts.durability = IDEM_DURABILITY_NONE;
    store_open();
    expired_keys_make_room_for_new_ones();
}

/* The expired keys in the current segment, behind a sealed one of live keys: the segments from
 * the next to walk through the current one are judged together, and the current one is ended
 * for the walk. */
static void expired_keys_behind_a_segment_of_live_ones_make_room(int durability, int reopened)
{
    store_gone(); /* a new store: the segment size is set when a store is made */
    g_opts.segment_bytes = 1 << 20;
    g_opts.durability = durability;
    store_open();
    t0 = idem_clock_now(g_s);
    static char result[16384]; /* that lz4 cannot shrink */
    uint64_t rng = 7;
    for (size_t k = 0; k + 1 < sizeof result; k++)
        result[k] = (char)('a' + tu_rand(&rng) % 26);
    char key[32];
    int i = 0;
    for (; wal_cur_seq(g_s->wal) == 1; i++) { /* long-lived keys until the segment ends */
        cr_assert_lt(i, 90, "the first segment never ended");
        snprintf(key, sizeof key, "long-%03d", i);
        commit_ok(key, claim_new(key), result);
    }
    for (; i < 100; i++) {
        snprintf(key, sizeof key, "short-%03d", i);
        idem_completion c = claim_full(key, 1000, LEASE, NULL, NULL);
        expect_outcome(c, IDEM_NEW);
        commit_ok(key, c.token, result);
    }
    if (reopened) reopen(); /* no segment's expiry is known: each is measured first */
    idem_completion c;
    cr_assert_eq(claim_rc("cap-new", 7, TTL, LEASE, NULL, NULL, &c), IDEM_EFULL);
    at(1000 + 1000 / 8);
    claim_new_once_room_is_made("cap-new");
    snprintf(key, sizeof key, "long-%03d", 0);
    expect_outcome(claim(key), IDEM_DONE);
}

Test(capacity, expired_keys_behind_a_segment_of_live_ones_make_room)
{
    expired_keys_behind_a_segment_of_live_ones_make_room(IDEM_DURABILITY_SYNC, 0);
}

/* The same after a reopen: the next segment to walk is measured (live), and the one after it
 * too, though it is not the next (only the next was: the expired keys behind it were never
 * reclaimed until the live ones expired, a gap named in the thirty-ninth session's note). */
Test(capacity, after_a_reopen_expired_keys_behind_a_segment_of_live_ones_make_room)
{
    expired_keys_behind_a_segment_of_live_ones_make_room(IDEM_DURABILITY_SYNC, 1);
}

/* In durability none the sealed segment of live keys is made durable for the walk: nothing
 * else would, as nothing is written while new keys are refused. */
Test(capacity, expired_keys_behind_a_segment_of_live_ones_make_room_in_durability_none)
{
    expired_keys_behind_a_segment_of_live_ones_make_room(IDEM_DURABILITY_NONE, 0);
}

/* After a reopen the segment the expired keys are in is current, and its expiry unknown until
 * measured: the limit's press still ends it and has it walked. */
Test(capacity, after_a_reopen_expired_keys_still_make_room_at_max_keys)
{
    fill_with_committed_keys();
    reopen();
    at(TTL + TTL / 8);
    claim_new_once_room_is_made("cap-new");
    keys_become(1);
    new_keys_fit("fit", 99);
}

/* At the key limit, expired keys a fifth of the store are reclaimed: a walk that copies four
 * live records for each expired one pays when new keys are refused (without that press, a
 * walk waits for half the bytes to have expired). */
Test(capacity, at_max_keys_a_fifth_expired_make_room)
{
    char key[32];
    t0 = idem_clock_now(g_s);
    for (int i = 0; i < 100; i++) {
        snprintf(key, sizeof key, "cap-%03d", i);
        idem_completion c = claim_full(key, i % 5 ? TTL : 1000, LEASE, NULL, NULL);
        expect_outcome(c, IDEM_NEW);
        commit_ok(key, c.token, "r");
    }
    at(1000 + 1000 / 8);
    claim_new_once_room_is_made("cap-new");
    keys_become(81);
    new_keys_fit("fit", 19);
    for (int i = 1; i < 100; i += 5) {
        snprintf(key, sizeof key, "cap-%03d", i);
        expect_outcome(claim(key), IDEM_DONE);
    }
}

/* A claim whose record the age heaps have no room for (their growth out of memory) is refused
 * before anything changes: kept out of its heap, the record was missing from the attention list
 * and the oldest ages until the store was reopened (a review record could stay unlisted). */
Test(capacity, a_claim_the_age_heaps_cannot_hold_is_refused_and_nothing_goes_unlisted)
{
    store_close();
    g_opts.max_keys = 0;
    store_open();
    t0 = idem_clock_now(g_s);
    char key[32];
    int n = 0;
    for (;; n++) {
        store_lock(g_s);
        int full = g_s->ages[AGE_IN_FLIGHT].n == g_s->ages[AGE_IN_FLIGHT].cap && n > 0;
        g_s->test_ages_no_grow = full;
        store_unlock(g_s);
        if (full) break;
        cr_assert_lt(n, 100000, "the in_flight heap never filled");
        snprintf(key, sizeof key, "held-%05d", n);
        claim_new(key);
    }
    idem_completion c;
    cr_assert_eq(claim_rc("one-more", 8, TTL, LEASE, NULL, NULL, &c), IDEM_ENOMEM);
    cr_assert(!found("one-more"));
    store_lock(g_s);
    g_s->test_ages_no_grow = 0;
    store_unlock(g_s);
    claim_new("one-more");
    at(LEASE); /* every lease has run out: each record needs attention */
    idem_attention_args aa = {.max = 100000};
    const idem_record *recs;
    size_t listed;
    expect_rc(idem_attention(g_q, &aa, &recs, &listed), IDEM_OK);
    cr_assert_eq(listed, (size_t)n + 1);
    int seen = 0;
    for (size_t i = 0; i < listed; i++)
        seen |= recs[i].key_len == 8 && memcmp(recs[i].key, "one-more", 8) == 0;
    cr_assert(seen, "one-more is not listed");
}

/* Claims new keys mem-0000000, mem-0000001, ... (each answered new) until the store answers
 * FULL; returns how many it took. */
static int claim_new_until_full(const char *limit)
{
    char key[32];
    idem_completion c;
    for (int n = 0;; n++) {
        cr_assert_lt(n, 1000000, "no FULL from a memory limit of %s", limit);
        snprintf(key, sizeof key, "mem-%07d", n);
        int rc = claim_rc(key, strlen(key), TTL, LEASE, NULL, NULL, &c);
        if (rc == IDEM_EFULL) return n;
        cr_assert_eq(rc, IDEM_OK, "%s", idem_strerror(rc));
        expect_outcome(c, IDEM_NEW);
    }
}

Test(capacity, past_max_memory_a_new_claim_is_full_whatever_the_index_faulted_in_ahead)
{
    store_close();
    g_opts.max_keys = 0;
    g_opts.max_memory_bytes = 256 * 1024;
    store_open();
    int n = claim_new_until_full("256 KiB");
    char key[32];
    idem_completion c;
    cr_assert_gt(n, 1000, "only %d keys in 256 KiB of index", n);
    /* The index's thread may fault memory in ahead of growth at any time: the answer for the
     * key refused (its insert would grow the index) stays FULL. */
    char refused[32];
    snprintf(refused, sizeof refused, "mem-%07d", n);
    for (int round = 0; round < 20; round++) {
        expect_rc(idem_sync(g_s), IDEM_OK);
        usleep(1000);
        cr_assert_eq(claim_rc(refused, strlen(refused), TTL, LEASE, NULL, NULL, &c), IDEM_EFULL);
    }
    for (int i = 0; i < n; i += 97) {
        snprintf(key, sizeof key, "mem-%07d", i);
        expect_outcome(claim(key), IDEM_BUSY);
    }
    /* The limit holds: the last insert let in did not take the index past it (a split, and a
     * doubling of the directory with it, used to be let in below the limit and end above). */
    idem_stats st;
    idem_get_stats(g_s, &st);
    cr_assert_leq(st.index_bytes, g_opts.max_memory_bytes, "index %llu bytes, limit %llu",
                  (unsigned long long)st.index_bytes, (unsigned long long)g_opts.max_memory_bytes);
}

/* The index's blocks stay when keys leave, and the memory limit counts them: it refuses only a
 * new key whose insert would grow the index. Once keys are deleted, new ones take their slots;
 * the store at its memory limit used to refuse every new key until a restart. */
Test(capacity, at_max_memory_deleted_keys_make_room_for_new_ones)
{
    store_close();
    g_opts.max_keys = 0;
    g_opts.max_memory_bytes = 256 * 1024;
    store_open();
    char key[32];
    idem_completion c;
    int n = 0;
    for (;; n++) { /* committed keys until the limit */
        cr_assert_lt(n, 1000000, "no FULL from a memory limit");
        snprintf(key, sizeof key, "old-%07d", n);
        int rc = idem_set_if_absent(g_q, key, strlen(key), "v", 1, TTL, 0, &c);
        if (rc == IDEM_EFULL) break;
        cr_assert_eq(rc, IDEM_OK, "%s", idem_strerror(rc));
    }
    cr_assert_gt(n, 1000);
    idem_stats st;
    idem_get_stats(g_s, &st);
    uint64_t index_bytes = st.index_bytes;
    for (int i = 0; i < n; i++) {
        snprintf(key, sizeof key, "old-%07d", i);
        expect_rc(idem_del(g_q, key, strlen(key), "test"), IDEM_OK);
    }
    int fit = 0; /* new keys in the slots the deletes freed (hashed anew, they fill the
                  * segments unevenly: not quite as many) */
    for (;; fit++) {
        snprintf(key, sizeof key, "new-%07d", fit);
        int rc = claim_rc(key, strlen(key), TTL, LEASE, NULL, NULL, &c);
        if (rc == IDEM_EFULL) break;
        cr_assert_eq(rc, IDEM_OK, "new key %d: %s", fit, idem_strerror(rc));
        expect_outcome(c, IDEM_NEW);
    }
    cr_assert_geq(fit, n / 2, "%d new keys fit where %d were deleted", fit, n);
    idem_get_stats(g_s, &st);
    cr_assert_leq(st.index_bytes, index_bytes + 64 * 1024, "the index grew from %llu to %llu",
                  (unsigned long long)index_bytes, (unsigned long long)st.index_bytes);
}

/* The bytes of the checkpoint files in dir (index-*.ckpt). */
static uint64_t ckpt_files_bytes(const char *dir)
{
    char cmd[4200];
    snprintf(cmd, sizeof cmd, "cat '%s'/index-*.ckpt 2>/dev/null | wc -c", dir);
    FILE *p = popen(cmd, "r");
    cr_assert_not_null(p);
    unsigned long long n = 0;
    cr_assert_eq(fscanf(p, "%llu", &n), 1);
    pclose(p);
    return n;
}

/* The disk limit counts every file of the store, not only the log: a store whose log was under
 * --max-disk took new keys while its checkpoints (two kept, 16-32 bytes a key each) lay past
 * it. disk_bytes is the log's segments plus the checkpoint files found in the directory. */
Test(capacity, past_max_disk_counting_the_checkpoints_a_new_claim_is_full)
{
    store_gone(); /* a new store of small segments, so that a limit short of the checkpoints
                   * is still past the three segments the open asks for */
    g_opts.segment_bytes = 64 * 1024;
    g_opts.result_bytes_max = 4096; /* which segments this small must hold two of */
    g_opts.max_keys = 0;
    /* Written in few batches: a flush a claim would pad the log past twice its live bytes, and
     * compaction would shrink it under the limit set below. */
    g_opts.durability = IDEM_DURABILITY_NONE;
    store_open();
    char key[32];
    int64_t tok[3];
    for (int i = 0; i < 3000; i++) {
        snprintf(key, sizeof key, "disk-%05d", i);
        idem_completion c = claim(key);
        expect_outcome(c, IDEM_NEW);
        if (i < 3) tok[i] = c.token;
    }
    g_opts.durability = IDEM_DURABILITY_SYNC;
    reopen(); /* the close writes a checkpoint; the one before it is kept */
    idem_stats st;
    idem_get_stats(g_s, &st);
    uint64_t ckpts = ckpt_files_bytes(g_dir);
    cr_assert_gt(ckpts, 3000 * 16, "checkpoint files of %llu bytes for 3000 keys",
                 (unsigned long long)ckpts);
    cr_assert_eq(st.disk_bytes, st.wal_bytes + ckpts,
                 "disk_bytes %llu = log %llu + checkpoints %llu", (unsigned long long)st.disk_bytes,
                 (unsigned long long)st.wal_bytes, (unsigned long long)ckpts);
    /* A limit past the log but short of the log and the checkpoints. */
    store_close();
    g_opts.max_disk_bytes = st.wal_bytes + ckpts / 2;
    store_open();
    idem_get_stats(g_s, &st);
    cr_assert_eq(st.disk_bytes, st.wal_bytes + ckpt_files_bytes(g_dir));
    cr_assert_lt(st.wal_bytes, g_opts.max_disk_bytes);
    idem_completion c;
    cr_assert_eq(claim_rc("disk-new", 8, TTL, LEASE, NULL, NULL, &c), IDEM_EFULL);
    /* Repeats and owner calls go on; nothing was evicted. */
    expect_outcome(claim("disk-00000"), IDEM_BUSY);
    expect_outcome(claim("disk-02999"), IDEM_BUSY);
    commit_ok("disk-00001", tok[1], "r1");
    expect_outcome(claim("disk-00001"), IDEM_DONE);
    cr_assert_eq(claim_rc("disk-new", 8, TTL, LEASE, NULL, NULL, &c), IDEM_EFULL);
    /* A limit past them all takes new keys again. */
    store_close();
    g_opts.max_disk_bytes = 0;
    store_open();
    expect_outcome(claim("disk-new"), IDEM_NEW);
}

/* The index is made for max_keys at open, within the memory limit: with a key limit whose
 * index would pass max_memory_bytes, an empty store answered FULL to its first claim (the
 * index, made for 10 M keys, held 256 MiB of its 256 MiB before any key came). Both limits
 * hold: the keys stop at the memory limit. */
Test(capacity, a_key_limit_past_the_memory_limit_leaves_an_empty_store_room)
{
    store_close();
    g_opts.max_keys = 10000000;
    g_opts.max_memory_bytes = 1 << 20;
    store_open();
    int n = claim_new_until_full("1 MiB");
    cr_assert_gt(n, 10000, "only %d keys under a memory limit of 1 MiB", n);
    idem_stats st;
    idem_get_stats(g_s, &st);
    cr_assert_eq(st.keys, (uint64_t)n);
    /* What the limit counts is shown, and stops within a segment's rebuild of the limit, not
     * past it; memory_bytes (everything) passes it. */
    cr_assert_leq(st.index_bytes, st.max_memory_bytes, "%llu index bytes past the limit %llu",
                  (unsigned long long)st.index_bytes, (unsigned long long)st.max_memory_bytes);
    cr_assert_gt(st.index_bytes + 64 * 1024, st.max_memory_bytes, "FULL at %llu of %llu",
                 (unsigned long long)st.index_bytes, (unsigned long long)st.max_memory_bytes);
    cr_assert_gt(st.memory_bytes, st.index_bytes);
}

/* Limits no machine can meet are refused at open, by name (contract: "checked against RAM and
 * disk at open"); a key limit past what the index can address made the open fail with "out of
 * memory" and no word of why, and the others were taken. */
Test(capacity, limits_past_the_machines_memory_are_refused_by_name)
{
    store_close();
    idem_store *s = NULL;
    static const struct {
        uint64_t keys, memory;
        const char *named;
    } bad[] = {
        {100000000000ull, 0, "max_keys 100000000000 is more than the index can hold"},
        {UINT64_MAX, 0, "max_keys 18446744073709551615 is more than the index can hold"},
        {0, 4, "max_memory_bytes 4 is less than twice the smallest index"},
        {10000000000ull, 0, "max_keys 10000000000 needs about"},
        {0, UINT64_C(1) << 50,
         "max_memory_bytes 1125899906842624 is more than the memory this process may use"},
        {0, 0, "max_disk_bytes 1152921504606846976 is more than the file system of"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        g_opts.max_keys = bad[i].keys;
        g_opts.max_memory_bytes = bad[i].memory;
        g_opts.max_disk_bytes = bad[i].keys || bad[i].memory ? 0 : UINT64_C(1) << 60;
        cr_assert_eq(idem_open(g_dir, &g_opts, &s), IDEM_EINVAL, "limit %zu opened", i);
        cr_assert(strstr(idem_last_error(), bad[i].named), "limit %zu: \"%s\"", i,
                  idem_last_error());
    }
    g_opts.max_keys = 100;
    g_opts.max_memory_bytes = 0;
    g_opts.max_disk_bytes = 0;
    store_open();
}

/* The log takes two segments from the start and a third as it goes on: a disk limit below three
 * answered FULL to every new claim of a store that opened without a word (64 MiB segments: 100
 * MB from the first claim on). Refused at the open, by name, with the store's own segment size
 * (set when it was made, whatever the options ask later); three segments open and take keys. */
Test(capacity, a_disk_limit_below_three_log_segments_is_refused_by_name)
{
    store_gone();
    g_opts.max_keys = 0;
    g_opts.segment_bytes = 1 << 20;
    store_open(); /* the store is made with 1 MiB segments */
    store_close();
    idem_store *s = NULL;
    g_opts.segment_bytes = 0; /* the default (64 MiB) asked for: the store keeps its own */
    g_opts.max_disk_bytes = 3 * (1 << 20) - 1;
    cr_assert_eq(idem_open(g_dir, &g_opts, &s), IDEM_EINVAL);
    cr_assert(strstr(idem_last_error(), "max_disk_bytes 3145727 is less than three log segments "
                                        "of the store (3145728 bytes)"),
              "\"%s\"", idem_last_error());
    g_opts.max_disk_bytes = 3 * (1 << 20);
    store_open();
    char key[32];
    for (int i = 0; i < 100; i++) {
        snprintf(key, sizeof key, "floor-%03d", i);
        expect_outcome(claim(key), IDEM_NEW);
    }
    g_opts.max_disk_bytes = 0;
}

/* ---- Behaviour a mutation of the code showed untested (twenty-first session) ---- */

Test(repeat, a_repeat_on_a_review_record_counts_and_changes_nothing_else)
{
    make_review("k", "look");
    uint64_t v = get("k").version;
    at(100);
    idem_completion c = claim("k");
    expect_outcome(c, IDEM_REVIEW);
    idem_record r = get("k");
    cr_assert_eq(r.seen_count, 2);
    cr_assert_eq(r.last_seen_ms, t0 + 100);
    cr_assert_eq(r.version, v);
}

Test(set_if_absent, a_repeat_counts_as_seen_and_keeps_the_first_value)
{
    expect_outcome(setnx("k", "v1", TTL, 0, IDEM_OK), IDEM_NEW);
    at(50);
    idem_completion c = setnx("k", "v2", TTL, 0, IDEM_OK);
    expect_outcome(c, IDEM_DONE);
    idem_record r = get("k");
    cr_assert_eq(r.seen_count, 2);
    cr_assert_eq(r.last_seen_ms, t0 + 50);
    expect_result(r, "v1");
}

Test(lease, the_claim_that_recovers_counts_as_seen)
{
    claim_new("k");
    at(LEASE);
    expect_outcome(claim("k"), IDEM_RECOVER);
    idem_record r = get("k");
    cr_assert_eq(r.seen_count, 2);
    cr_assert_eq(r.last_seen_ms, t0 + LEASE);
}

Test(review_policy, the_claim_that_finds_the_lease_expired_counts_as_seen)
{
    claim_new("k");
    at(LEASE);
    expect_outcome(claim("k"), IDEM_REVIEW);
    idem_record r = get("k");
    cr_assert_eq(r.seen_count, 2);
    cr_assert_eq(r.last_seen_ms, t0 + LEASE);
}

/* Rule 3 for a record in review: answered `review` with its note (the outcome table), and the
 * other content recorded on the record as any mismatch is (found by a review of the claim rules:
 * it recorded nothing, so the person deciding the review never saw that a request of other
 * content had come for the key). Its note, state and result stay. */
Test(mismatch, different_fp_on_a_review_record_answers_review_and_is_recorded)
{
    idem_completion a = claim_fp("k", "body-A");
    expect_rc(hold("k", a.token, "unsure"), IDEM_OK);
    uint64_t v = get("k").version;
    at(10);
    idem_stats b = stats();
    idem_completion c = claim_fp("k", "body-B");
    idem_stats after = stats();
    expect_outcome(c, IDEM_REVIEW);
    expect_data(c, "unsure");
    idem_record r = get("k");
    cr_assert_eq(r.state, IDEM_STATE_REVIEW);
    cr_assert_eq(r.mismatch_count, 1, "the other content was not recorded");
    cr_assert_eq(r.last_mismatch_ms, t0 + 10);
    cr_assert(r.has_last_mismatch_fp);
    cr_assert_gt(r.version, v);
    cr_assert_eq(r.note_len, 6);
    cr_assert_eq(memcmp(r.note, "unsure", 6), 0);
    cr_assert_eq(after.mismatches, b.mismatches + 1);
    cr_assert_eq(after.claims_review, b.claims_review + 1);
    cr_assert_eq(after.claims_mismatch, b.claims_mismatch);
    /* The same content again is a plain repeat: answered review, nothing more recorded. */
    expect_outcome(claim_fp("k", "body-A"), IDEM_REVIEW);
    cr_assert_eq(get("k").mismatch_count, 1);
}

Test(expiry, a_resolve_exactly_at_expires_at_keeps_the_outcome_one_more_ttl)
{
    make_review("k", "look");
    at(TTL);
    expect_rc(resolve_full("k", IDEM_RESOLVE_COMMIT, "checked", "inv-1", 0, 0, "alice"), IDEM_OK);
    cr_assert_eq(get("k").expires_at_ms, t0 + 2 * (int64_t)TTL);
    at(2 * (int64_t)TTL - 1);
    idem_completion c = claim("k");
    expect_outcome(c, IDEM_DONE);
    expect_data(c, "inv-1");
    at(2 * (int64_t)TTL);
    expect_outcome(claim("k"), IDEM_NEW);
}

Test(expiry, a_new_lifetime_after_expiry_starts_its_own_repeat_counters)
{
    make_committed("k", NULL, "r");
    at(10);
    expect_outcome(claim("k"), IDEM_DONE);
    at(TTL);
    expect_outcome(claim("k"), IDEM_NEW);
    idem_record r = get("k");
    cr_assert_eq(r.seen_count, 1);
    cr_assert_eq(r.last_seen_ms, t0 + TTL);
}

Test(version, an_import_moves_tokens_above_the_imported_ones)
{
    idem_record in;
    memset(&in, 0, sizeof in);
    in.key = "imp";
    in.key_len = 3;
    in.state = IDEM_STATE_IN_FLIGHT;
    in.first_seen_ms = in.last_seen_ms = in.last_grant_ms = t0;
    in.expires_at_ms = t0 + TTL;
    in.lease_until_ms = t0 + 1;
    in.seen_count = 1;
    in.attempts = 1;
    in.token = 1000;
    expect_rc(idem_import_record(g_q, &in), IDEM_OK);
    cr_assert_gt(claim_new("other"), 1000);
    at(1);
    idem_completion c = claim("imp");
    expect_outcome(c, IDEM_RECOVER);
    cr_assert_gt(c.token, 1000);
    expect_rc(commit("imp", 1000, "x"), IDEM_ESTALE);
}

/* An imported record's times are held to the store clock's range: far ones made rule 5's
 * extension (now + expires_at - first_seen) overflow, and a first_seen of 0 read as "none" in
 * the oldest ages. */
Test(version, an_import_with_times_out_of_the_clocks_range_is_refused)
{
    idem_record in;
    memset(&in, 0, sizeof in);
    in.key = "imp";
    in.key_len = 3;
    in.state = IDEM_STATE_IN_FLIGHT;
    in.seen_count = in.attempts = 1;
    in.token = 5;
    int64_t *times[] = {&in.first_seen_ms,  &in.expires_at_ms, &in.last_seen_ms,
                        &in.lease_until_ms, &in.last_grant_ms, &in.last_mismatch_ms};
    for (size_t i = 0; i < sizeof times / sizeof *times; i++) {
        in.first_seen_ms = in.last_seen_ms = in.last_grant_ms = t0;
        in.expires_at_ms = t0 + TTL;
        in.lease_until_ms = t0 + LEASE;
        in.last_mismatch_ms = 0;
        *times[i] = i == 1 ? INT64_MAX - 1 : -1;
        expect_rc(idem_import_record(g_q, &in), IDEM_EINVAL);
    }
    in.last_mismatch_ms = 0;
    in.first_seen_ms = 0;
    in.expires_at_ms = TTL;
    expect_rc(idem_import_record(g_q, &in), IDEM_EINVAL);
    cr_assert(!found("imp"));
    in.first_seen_ms = t0;
    in.expires_at_ms = t0 + TTL;
    expect_rc(idem_import_record(g_q, &in), IDEM_OK);
}

/* Imports the committed record "imp" with token; returns the token. */
static int64_t import_committed(int64_t token)
{
    idem_record in;
    memset(&in, 0, sizeof in);
    in.key = "imp";
    in.key_len = 3;
    in.state = IDEM_STATE_COMMITTED;
    in.first_seen_ms = in.last_seen_ms = in.last_grant_ms = t0;
    in.expires_at_ms = t0 + TTL;
    in.seen_count = 1;
    in.attempts = 1;
    in.token = token;
    expect_rc(idem_import_record(g_q, &in), IDEM_OK);
    return token;
}

/* A token imported within a reservation block of the last one: the flusher reserved tokens
 * past IDEM_TOKEN_MAX, and the superblock it wrote was refused at the next open as out of
 * range (a helper's review). The reservation stops at the last token; claims past it answer
 * FULL. */
Test(version, an_import_near_the_last_token_leaves_a_store_that_opens)
{
    import_committed(IDEM_TOKEN_MAX - 2);
    cr_assert_eq(claim_new("last"), IDEM_TOKEN_MAX - 1); /* the flusher reserves meanwhile */
    expect_rc(idem_sync(g_s), IDEM_OK);
    reopen();
    idem_completion c;
    int rc = claim_rc("past", 4, TTL, LEASE, NULL, NULL, &c);
    cr_assert_eq(rc, IDEM_EFULL, "%s", idem_strerror(rc));
}

/* A token imported far above the reservation, then a close at once (no flusher round between):
 * the close's checkpoint records a reservation above it, so tokens after the reopen are too. */
Test(version, an_imported_token_is_never_handed_out_again_after_a_close)
{
    int64_t imported = import_committed(1ll << 40);
    reopen();
    int64_t tok = claim_new("after");
    cr_assert_gt(tok, imported, "token %lld handed out again after the import of %lld",
                 (long long)tok, (long long)imported);
}
