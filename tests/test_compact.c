/*
 * test_compact.c: space is reclaimed in log order and nothing live is lost doing it. Expired
 * committed records leave the index and the disk; live ones are copied forward with first_seen,
 * token, version and result intact, through crashes at any point of a compaction.
 */
#include <criterion/criterion.h>
#include <errno.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include "idem.h"
#include "io_sim.h"
#include "remover.h"
#include "store.h"
#include "testutil.h"
#include "util.h"

#define SIM_DIR "/sim/store"

static idem_store *open_sim_mode(struct io_sim *sim, uint32_t segment_bytes,
                                 enum idem_durability durability)
{
    idem_options o;
    idem_options_init(&o);
    o.test_clock = 1;
    o.segment_bytes = segment_bytes;
    o.result_bytes_max = 4096;
    o.durability = durability;
    idem_store *s = NULL;
    cr_assert_eq(store_open_io(SIM_DIR, &o, io_sim_io(sim), 1, &s), IDEM_OK, "%s",
                 idem_last_error());
    return s;
}

static idem_store *open_sim_seg(struct io_sim *sim, uint32_t segment_bytes)
{
    return open_sim_mode(sim, segment_bytes, IDEM_DURABILITY_SYNC);
}

static idem_store *open_sim(struct io_sim *sim)
{
    return open_sim_seg(sim, 64 * 1024);
}

/* Lets the flusher run its compaction steps until the log is at most max_segments long. */
static void settle(idem_store *s, uint64_t max_bytes)
{
    idem_stats st;
    for (int i = 0; i < 500; i++) {
        cr_assert_eq(idem_sync(s), IDEM_OK);
        idem_get_stats(s, &st);
        if (st.wal_bytes <= max_bytes) return;
        usleep(2000);
    }
    cr_assert_fail("log still %llu bytes (bound %llu, live keys %llu)",
                   (unsigned long long)st.wal_bytes, (unsigned long long)max_bytes,
                   (unsigned long long)st.keys);
}

static void claim_commit(idem_queue *q, const char *key, uint64_t ttl_ms, int64_t *token)
{
    idem_claim_args a = {.ttl_ms = ttl_ms, .lease_ms = 1000};
    idem_completion c;
    cr_assert_eq(idem_claim(q, key, strlen(key), &a, &c), IDEM_OK);
    cr_assert_eq(c.outcome, IDEM_NEW);
    *token = c.token;
    char res[64];
    snprintf(res, sizeof res, "result-of-%s", key);
    cr_assert_eq(idem_commit(q, key, strlen(key), c.token, res, strlen(res)), IDEM_OK);
}

struct kept {
    char key[32];
    int64_t token, first_seen;
    uint64_t version;
};

static void check_kept(idem_store *s, idem_queue *q, const struct kept *k, int n)
{
    cr_assert_eq(store_check_index(s, NULL), IDEM_OK, "index inconsistent");
    for (int i = 0; i < n; i++) {
        idem_completion c;
        cr_assert_eq(idem_get(q, k[i].key, strlen(k[i].key), &c), IDEM_OK);
        cr_assert(c.found, "%s lost", k[i].key);
        cr_assert_eq(c.record.state, IDEM_STATE_COMMITTED);
        cr_assert_eq(c.record.first_seen_ms, k[i].first_seen);
        cr_assert_eq(c.record.version, k[i].version, "%s: version moved by a copy", k[i].key);
        char res[64];
        snprintf(res, sizeof res, "result-of-%s", k[i].key);
        cr_assert_eq(c.record.result_len, strlen(res));
        cr_assert(!memcmp(c.record.result, res, strlen(res)));
    }
}

/* Claims and commits n long-lived keys named prefix-i and notes what must survive of them. */
static void make_kept(idem_queue *q, struct kept *k, int n, const char *prefix)
{
    for (int i = 0; i < n; i++) {
        snprintf(k[i].key, sizeof k[i].key, "%s-%d", prefix, i);
        claim_commit(q, k[i].key, 86400000, &k[i].token);
        idem_completion c;
        cr_assert_eq(idem_get(q, k[i].key, strlen(k[i].key), &c), IDEM_OK);
        k[i].first_seen = c.record.first_seen_ms;
        k[i].version = c.record.version;
    }
}

/* Rounds of 50 keys with a 1 s ttl, the clock 2 s on after each: every round expires. */
static void short_lived_rounds(idem_store *s, idem_queue *q, int rounds)
{
    for (int round = 0; round < rounds; round++) {
        for (int i = 0; i < 50; i++) {
            char key[32];
            int64_t t;
            snprintf(key, sizeof key, "short-%d-%d", round, i);
            claim_commit(q, key, 1000, &t);
        }
        cr_assert_eq(idem_clock_advance(s, 2000), IDEM_OK);
    }
}

/* After an open every kept key is whole and short-0-0, expired before, is not back. Closes the
 * store and destroys the simulated disk. */
static void reopen_and_check(struct io_sim *sim, const struct kept *kept, int n)
{
    idem_store *s = open_sim(sim);
    idem_queue *q;
    cr_assert_eq(idem_queue_open(s, 4, &q), IDEM_OK);
    check_kept(s, q, kept, n);
    idem_completion c;
    cr_assert_eq(idem_get(q, "short-0-0", 9, &c), IDEM_OK);
    cr_assert(!c.found, "an expired key came back");
    idem_queue_close(q);
    cr_assert_eq(idem_close(s), IDEM_OK);
    io_sim_destroy(sim);
}

/* Power lost (torn writes), then reopen_and_check. */
static void crash_and_check(struct io_sim *sim, idem_store *s, idem_queue *q,
                            const struct kept *kept, int n)
{
    idem_queue_close(q);
    store_abandon(s);
    io_sim_crash(sim, IO_SIM_CRASH_TEAR);
    reopen_and_check(sim, kept, n);
}

Test(compact, expired_keys_leave_memory_and_disk_live_ones_survive_intact, .timeout = 120)
{
    struct io_sim *sim;
    cr_assert_eq(io_sim_create(7, &sim), 0);
    idem_store *s = open_sim(sim);
    idem_queue *q;
    cr_assert_eq(idem_queue_open(s, 4, &q), IDEM_OK);
    /* Long-lived keys, written first: they sit in the oldest segments. */
    struct kept kept[20];
    make_kept(q, kept, 20, "long");
    /* Many rounds of short-lived keys that expire. */
    short_lived_rounds(s, q, 40);
    /* 2000 committed keys went through; 20 are alive. The log shrinks to a few segments. */
    settle(s, 8 * 64 * 1024);
    idem_stats st;
    idem_get_stats(s, &st);
    cr_assert_gt(st.compactions, 0);
    cr_assert_gt(st.expired_total, 0);
    cr_assert_lt(st.keys, 400, "expired keys stay in the index: %llu", (unsigned long long)st.keys);
    check_kept(s, q, kept, 20);
    /* A crash after compaction: the same. */
    crash_and_check(sim, s, q, kept, 20);
}

Test(compact, crashes_during_compaction_lose_nothing, .timeout = 300)
{
    uint64_t base = tu_seed("compact::crashes");
    uint64_t n = tu_count(40, 5000);
    uint64_t compactions = 0;
    for (uint64_t it = 0; it < n; it++) {
        uint64_t rng = base + it;
        struct io_sim *sim;
        cr_assert_eq(io_sim_create(base + it, &sim), 0);
        idem_store *s = open_sim(sim);
        idem_queue *q;
        cr_assert_eq(idem_queue_open(s, 4, &q), IDEM_OK);
        struct kept kept[10];
        make_kept(q, kept, 10, "keep");
        /* Churn, then fail the device at a random point while compaction runs. */
        io_sim_fail_flush(sim, 20 + tu_rand(&rng) % 200, -EIO);
        for (int round = 0; round < 30 && !idem_is_fatal(s); round++) {
            for (int i = 0; i < 30 && !idem_is_fatal(s); i++) {
                char key[32];
                snprintf(key, sizeof key, "churn-%d-%d", round, i);
                idem_claim_args a = {.ttl_ms = 500, .lease_ms = 1000};
                idem_completion c;
                if (idem_claim(q, key, strlen(key), &a, &c) == IDEM_OK)
                    idem_commit(q, key, strlen(key), c.token, "r", 1);
            }
            idem_clock_advance(s, 1000);
        }
        idem_stats st;
        idem_get_stats(s, &st);
        compactions += st.compactions;
        idem_queue_close(q);
        store_abandon(s);
        io_sim_crash(sim, IO_SIM_CRASH_TEAR | IO_SIM_CRASH_FLIP);
        s = open_sim(sim);
        cr_assert_eq(idem_queue_open(s, 4, &q), IDEM_OK);
        check_kept(s, q, kept, 10);
        idem_queue_close(q);
        cr_assert_eq(idem_close(s), IDEM_OK);
        io_sim_destroy(sim);
    }
    cr_assert_gt(compactions, n, "the crashes rarely met a compaction (%llu in %llu runs)",
                 (unsigned long long)compactions, (unsigned long long)n);
}

Test(compact, compact_on_request_retires_every_sealed_segment, .timeout = 60)
{
    struct io_sim *sim;
    cr_assert_eq(io_sim_create(11, &sim), 0);
    idem_store *s = open_sim(sim);
    idem_queue *q;
    cr_assert_eq(idem_queue_open(s, 4, &q), IDEM_OK);
    /* Counted from the open: the flusher may walk and retire some segments by itself meanwhile
     * (it does once the log holds more than twice the live bytes), and sometimes all of them
     * before the request; the request's promise is that none sealed at the call is left. */
    idem_stats before, after;
    idem_get_stats(s, &before);
    struct kept kept[200];
    make_kept(q, kept, 200, "k");
    cr_assert_eq(idem_compact(s, 20000), IDEM_OK);
    idem_get_stats(s, &after);
    /* What is left: the segment the copies went to (perhaps its successor) and the spare. */
    cr_assert_leq(after.wal_bytes, 3 * 64 * 1024, "log %llu bytes after compaction",
                  (unsigned long long)after.wal_bytes);
    cr_assert_gt(after.compactions, before.compactions);
    check_kept(s, q, kept, 200);
    idem_queue_close(q);
    cr_assert_eq(idem_close(s), IDEM_OK);
    s = open_sim(sim);
    cr_assert_eq(idem_queue_open(s, 4, &q), IDEM_OK);
    check_kept(s, q, kept, 200);
    idem_queue_close(q);
    cr_assert_eq(idem_close(s), IDEM_OK);
    io_sim_destroy(sim);
}

/* Bytes lz4 cannot shrink, from seed. */
static void noise(uint8_t *v, size_t len, uint64_t seed)
{
    uint64_t x = seed * 0x9e3779b97f4a7c15ull + 1;
    for (size_t i = 0; i < len; i++) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        v[i] = (uint8_t)x;
    }
}

/* n keys big-i of 3,000 bytes each: set (one frame each, all live, 16 to a 64 KiB segment), or
 * checked whole. */
static void big_keys(idem_queue *q, int n, int set)
{
    for (int i = 0; i < n; i++) {
        char key[32];
        uint8_t v[3000];
        snprintf(key, sizeof key, "big-%d", i);
        noise(v, sizeof v, (uint64_t)i);
        idem_completion c;
        if (set) {
            cr_assert_eq(idem_set_if_absent(q, key, strlen(key), v, sizeof v, 86400000, 0, &c),
                         IDEM_OK);
            cr_assert_eq(c.err, IDEM_OK);
            continue;
        }
        cr_assert_eq(idem_get(q, key, strlen(key), &c), IDEM_OK);
        cr_assert(c.found, "%s lost", key);
        cr_assert_eq(c.record.result_len, sizeof v, "%s", key);
        cr_assert(!memcmp(c.record.result, v, sizeof v), "%s changed", key);
    }
}

/* Sets keys prefix-i of len incompressible bytes until the disk answers FULL (at most n). */
static void fill_until_full(idem_queue *q, const char *prefix, size_t len, int n)
{
    static uint8_t v[3000];
    cr_assert_leq(len, sizeof v);
    for (int i = 0; i < n; i++) {
        char key[32];
        snprintf(key, sizeof key, "%s-%d", prefix, i);
        noise(v, len, 1000 + (uint64_t)i);
        idem_completion c;
        int rc = idem_set_if_absent(q, key, strlen(key), v, len, 86400000, 0, &c);
        if (rc == IDEM_EFULL || (rc == IDEM_OK && c.err == IDEM_EFULL)) return;
        cr_assert(rc == IDEM_OK && c.err == IDEM_OK, "fill %s: %s", key,
                  idem_strerror(rc ? rc : c.err));
    }
    cr_assert_fail("the disk never filled with %s", prefix);
}

/* A walk idem_compact asks for that stops for want of disk room at the oldest segment (all live:
 * nothing walked waits for a checkpoint), the log grown fewer than STORE_CKPT_EVERY_SEGS segments
 * since the last checkpoint, answers FULL: no checkpoint was asked for, nothing was retired, and
 * without a timeout the call waited for good. Once room is made, the same call compacts every
 * sealed segment. */
Test(compact, compact_on_request_on_a_full_disk_answers_full_then_goes_on, .timeout = 60)
{
    struct io_sim *sim;
    cr_assert_eq(io_sim_create(12, &sim), 0);
    idem_store *s = open_sim(sim);
    idem_queue *q;
    cr_assert_eq(idem_queue_open(s, 4, &q), IDEM_OK);
    big_keys(q, 40, 1);
    struct io_sim_counts n;
    io_sim_counts(sim, &n);
    io_sim_set_capacity(sim, n.used); /* no new segment; the current one and its spare fill */
    /* Filled with live keys as large, so that the log stays within twice the live bytes and no
     * walk starts by itself. */
    fill_until_full(q, "fill", 3000, 100);
    store_lock(s);
    uint64_t since = wal_cur_seq(s->wal) - s->sb.ckpt_seq;
    store_unlock(s);
    cr_assert_lt(since, STORE_CKPT_EVERY_SEGS, "%llu segments since the last checkpoint",
                 (unsigned long long)since);
    cr_assert_eq(idem_compact(s, 10000), IDEM_EFULL);
    cr_assert_eq(idem_compact(s, -1), IDEM_EFULL);
    cr_assert(!idem_is_fatal(s));
    big_keys(q, 40, 0);
    io_sim_set_capacity(sim, 0);
    cr_assert_eq(idem_compact(s, 20000), IDEM_OK);
    big_keys(q, 40, 0);
    idem_queue_close(q);
    cr_assert_eq(idem_close(s), IDEM_OK);
    s = open_sim(sim);
    cr_assert_eq(idem_queue_open(s, 4, &q), IDEM_OK);
    big_keys(q, 40, 0);
    idem_queue_close(q);
    cr_assert_eq(idem_close(s), IDEM_OK);
    io_sim_destroy(sim);
}

/* The claim's answer on a full disk: FULL, or an outcome. */
static int claim_on(idem_queue *q, const char *key, const char *fp, idem_completion *c)
{
    idem_claim_args a = {.ttl_ms = 86400000, .lease_ms = 1000, .fp = fp, .fp_len = 1};
    int rc = idem_claim(q, key, strlen(key), &a, c);
    return rc ? rc : c->err ? c->err : c->outcome;
}

/* Found by a review of the lease rules: a claim that met a record counted its outcome before
 * the write that records it, so one answered FULL counted as a mismatch or a recovery that
 * no record shows (an alert on either fired through a disk-full incident, once a retry). */
Test(compact, claims_refused_for_room_count_no_mismatch_or_recovery, .timeout = 60)
{
    struct io_sim *sim;
    cr_assert_eq(io_sim_create(13, &sim), 0);
    idem_store *s = open_sim(sim);
    idem_queue *q;
    cr_assert_eq(idem_queue_open(s, 4, &q), IDEM_OK);
    idem_completion c;
    char lapsed[401]; /* a long key: its recovery's record is larger than the last fills */
    memset(lapsed, 'r', sizeof lapsed - 1);
    lapsed[sizeof lapsed - 1] = 0;
    cr_assert_eq(claim_on(q, "m", "a", &c), IDEM_NEW);
    uint8_t result[3000];
    noise(result, sizeof result, 7);
    cr_assert_eq(idem_commit(q, "m", 1, c.token, result, sizeof result), IDEM_OK);
    cr_assert_eq(claim_on(q, lapsed, "a", &c), IDEM_NEW);
    big_keys(q, 40, 1);
    struct io_sim_counts n;
    io_sim_counts(sim, &n);
    io_sim_set_capacity(sim, n.used);
    fill_until_full(q, "fill", 3000, 100);
    fill_until_full(q, "small", 300, 100);
    fill_until_full(q, "tiny", 1, 1000);
    cr_assert_eq(idem_clock_advance(s, 2000), IDEM_OK); /* the lapsed key's lease runs out */
    idem_stats before, after;
    idem_get_stats(s, &before);
    for (int i = 0; i < 3; i++) {
        cr_assert_eq(claim_on(q, "m", "b", &c), IDEM_EFULL, "a mismatch recorded on a full disk");
        cr_assert_eq(claim_on(q, lapsed, "a", &c), IDEM_EFULL, "a recovery made on a full disk");
    }
    idem_get_stats(s, &after);
    cr_assert_eq(after.mismatches, before.mismatches);
    cr_assert_eq(after.claims_mismatch, before.claims_mismatch);
    cr_assert_eq(after.recoveries, before.recoveries);
    cr_assert_eq(after.claims_recover, before.claims_recover);
    cr_assert_eq(idem_get(q, "m", 1, &c), IDEM_OK);
    cr_assert_eq(c.record.mismatch_count, 0);
    cr_assert_eq(idem_get(q, lapsed, strlen(lapsed), &c), IDEM_OK);
    cr_assert_eq(c.record.attempts, 1);
    /* Room again: each counted once, as recorded. */
    io_sim_set_capacity(sim, 0);
    int rc;
    for (int tries = 0; (rc = claim_on(q, "m", "b", &c)) == IDEM_EFULL && tries < 500; tries++)
        usleep(10000); /* the next segment is made in the background */
    cr_assert_eq(rc, IDEM_MISMATCH, "%d", rc);
    cr_assert_eq(claim_on(q, lapsed, "a", &c), IDEM_RECOVER);
    idem_get_stats(s, &after);
    cr_assert_eq(after.mismatches, before.mismatches + 1);
    cr_assert_eq(after.claims_mismatch, before.claims_mismatch + 1);
    cr_assert_eq(after.recoveries, before.recoveries + 1);
    cr_assert_eq(after.claims_recover, before.claims_recover + 1);
    idem_queue_close(q);
    cr_assert_eq(idem_close(s), IDEM_OK);
    io_sim_destroy(sim);
}

/* Out of descriptors when the superblock is opened to retire segments (or to install the
 * checkpoint they wait for): nothing was written, so the store goes on and retires them at a
 * later step. It used to fail the store, and idemd exited, although nothing had changed. */
Test(compact, a_retirement_out_of_descriptors_is_tried_again, .timeout = 60)
{
    struct io_sim *sim;
    cr_assert_eq(io_sim_create(12, &sim), 0);
    idem_store *s = open_sim(sim);
    idem_queue *q;
    cr_assert_eq(idem_queue_open(s, 4, &q), IDEM_OK);
    static const char *const prefix[] = {"k", "m", "n", "o"};
    struct kept kept[4][200];
    make_kept(q, kept[0], 200, prefix[0]);
    /* Counted from the open: the flusher may retire segments by itself before the request (the
     * failed open then meets whichever superblock write comes next: a checkpoint's install, a
     * retirement or the store clock's save). The request's promise is that no segment sealed at
     * the call is left. */
    idem_stats first, after;
    idem_get_stats(s, &first);
    for (int round = 0; round < 3; round++) {
        io_sim_fail_open(sim, "/super", round == 2 ? -ENOMEM : -EMFILE);
        int rc = idem_compact(s, 20000);
        cr_assert_eq(rc, IDEM_OK, "round %d: %s", round, idem_strerror(rc));
        idem_get_stats(s, &after);
        cr_assert_eq(after.fatal, 0);
        cr_assert_leq(after.wal_bytes, 3 * 64 * 1024, "round %d: log %llu bytes after compaction",
                      round, (unsigned long long)after.wal_bytes);
        make_kept(q, kept[round + 1], 200, prefix[round + 1]);
    }
    cr_assert_gt(after.compactions, first.compactions, "nothing retired");
    for (int k = 0; k < 4; k++)
        check_kept(s, q, kept[k], 200);
    idem_queue_close(q);
    cr_assert_eq(idem_close(s), IDEM_OK);
    s = open_sim(sim);
    cr_assert_eq(idem_queue_open(s, 4, &q), IDEM_OK);
    for (int k = 0; k < 4; k++)
        check_kept(s, q, kept[k], 200);
    idem_queue_close(q);
    cr_assert_eq(idem_close(s), IDEM_OK);
    io_sim_destroy(sim);
}

/* Rule 5: unfinished records never expire, so compaction copies them forward however long ago
 * their ttl ran out: an in_flight and a review record, their segments compacted away. */
static void check_unfinished(idem_queue *q, int64_t fly_token, const char *when)
{
    idem_completion c;
    cr_assert_eq(idem_get(q, "fly", 3, &c), IDEM_OK);
    cr_assert(c.found && c.record.state == IDEM_STATE_IN_FLIGHT && c.record.token == fly_token,
              "the in_flight record past its ttl was lost %s", when);
    cr_assert_eq(idem_get(q, "rev", 3, &c), IDEM_OK);
    cr_assert(c.found && c.record.state == IDEM_STATE_REVIEW,
              "the review record past its ttl was lost %s", when);
}

Test(compact, unfinished_records_past_their_ttl_survive_compaction, .timeout = 60)
{
    struct io_sim *sim;
    cr_assert_eq(io_sim_create(12, &sim), 0);
    idem_store *s = open_sim(sim);
    idem_queue *q;
    cr_assert_eq(idem_queue_open(s, 4, &q), IDEM_OK);
    idem_claim_args a = {.ttl_ms = 1000, .lease_ms = 3600000};
    idem_completion c;
    cr_assert_eq(idem_claim(q, "fly", 3, &a, &c), IDEM_OK);
    cr_assert_eq(c.outcome, IDEM_NEW);
    int64_t fly = c.token;
    cr_assert_eq(idem_claim(q, "rev", 3, &a, &c), IDEM_OK);
    cr_assert_eq(idem_hold(q, "rev", 3, c.token, "check", 5), IDEM_OK);
    idem_stats before, after;
    idem_get_stats(s, &before);
    short_lived_rounds(s, q, 20); /* 40 s on: both ttls long past, their segment sealed */
    cr_assert_eq(idem_compact(s, 20000), IDEM_OK);
    idem_get_stats(s, &after);
    cr_assert_gt(after.compactions, before.compactions);
    check_unfinished(q, fly, "by compaction");
    idem_queue_close(q);
    cr_assert_eq(idem_close(s), IDEM_OK);
    s = open_sim(sim);
    cr_assert_eq(idem_queue_open(s, 4, &q), IDEM_OK);
    check_unfinished(q, fly, "after a reopen");
    idem_queue_close(q);
    cr_assert_eq(idem_close(s), IDEM_OK);
    io_sim_destroy(sim);
}

/* Segments walked (compact.c) and waiting for a checkpoint to be retired. */
static uint64_t walked_waiting(idem_store *s)
{
    store_lock(s);
    uint64_t n = s->cmp_walked ? s->cmp_walked - wal_first_seq(s->wal) + 1 : 0;
    store_unlock(s);
    return n;
}

static void run_checkpoint_to_the_end(idem_store *s)
{
    int rc, steps = 0;
    while ((rc = store_ckpt_step(s)) == 1)
        cr_assert_lt(++steps, 1000, "the checkpoint never ends");
    cr_assert_eq(rc, 0, "checkpoint step: %s", idem_strerror(rc));
}

/* Takes checkpoints (the flusher takes none by itself from here) until compaction has walked
 * and retired all it wanted to: nothing is being walked or waits for retirement. */
static void quiesce_compaction(idem_store *s)
{
    for (int i = 0; i < 100; i++) {
        run_checkpoint_to_the_end(s);
        cr_assert_eq(idem_sync(s), IDEM_OK);
        usleep(2000);
        store_lock(s);
        int idle = !s->cmp_seq && !s->cmp_walked;
        store_unlock(s);
        if (idle) return;
    }
    cr_assert_fail("compaction never came to rest");
}

/* Compaction walks on while it waits for a checkpoint: a run begun before the walks retires
 * nothing (its image may point into them), the next one retires every walked segment at once,
 * and a crash after that loses no live key and brings back no expired one. */
Test(compact, one_checkpoint_retires_every_segment_walked_before_it, .timeout = 60)
{
    struct io_sim *sim;
    cr_assert_eq(io_sim_create(13, &sim), 0);
    idem_store *s = open_sim(sim);
    idem_queue *q;
    cr_assert_eq(idem_queue_open(s, 4, &q), IDEM_OK);
    struct kept kept[20];
    make_kept(q, kept, 20, "long");
    /* The space rule walks these first segments; let it finish. */
    quiesce_compaction(s);
    idem_stats st;
    idem_get_stats(s, &st);
    uint64_t retired = st.compactions;
    /* Begin a run and scan: its replay position and entries predate everything below. */
    cr_assert_eq(store_ckpt_step(s), 1, "a run in one step: the test needs it unfinished");
    store_lock(s);
    int began = s->ckr.state != CKPT_RUN_IDLE;
    store_unlock(s);
    cr_assert(began, "no run began");
    short_lived_rounds(s, q, 30);
    uint64_t walked = 0;
    for (int i = 0; i < 500 && (walked = walked_waiting(s)) < 4; i++) {
        cr_assert_eq(idem_sync(s), IDEM_OK);
        usleep(2000);
    }
    cr_assert_geq(walked, 4, "compaction stopped walking after %llu segments",
                  (unsigned long long)walked);
    idem_get_stats(s, &st);
    cr_assert_eq(st.compactions, retired, "a segment retired with no checkpoint after its walk");
    cr_assert_gt(st.expired_total, 0);

    /* The run begun before the walks installs: nothing may be retired on its strength. */
    run_checkpoint_to_the_end(s);
    for (int i = 0; i < 20; i++) {
        cr_assert_eq(idem_sync(s), IDEM_OK);
        usleep(1000);
    }
    idem_get_stats(s, &st);
    cr_assert_eq(st.compactions, retired, "retired on a checkpoint begun before the walk");
    uint64_t segments_before = st.wal_bytes / (64 * 1024);

    /* One run begun after the walks retires all of them. */
    walked = walked_waiting(s);
    uint64_t checkpoints = st.checkpoints;
    run_checkpoint_to_the_end(s);
    for (int i = 0; i < 500; i++) {
        idem_get_stats(s, &st);
        if (st.compactions >= retired + walked) break;
        cr_assert_eq(idem_sync(s), IDEM_OK);
        usleep(2000);
    }
    cr_assert_eq(st.checkpoints, checkpoints + 1);
    cr_assert_geq(st.compactions - retired, walked,
                  "one checkpoint retired %llu of %llu walked segments",
                  (unsigned long long)(st.compactions - retired), (unsigned long long)walked);
    cr_assert_lt(st.wal_bytes / (64 * 1024), segments_before);
    check_kept(s, q, kept, 20);

    /* Power lost: live keys whole, expired ones gone. */
    crash_and_check(sim, s, q, kept, 20);
}

/* Found by the forty-second session's review: segments walked before a clean close, which the
 * closing checkpoint covers, stayed on disk; the next open forgot the walk and walked them
 * again. Once the closing checkpoint is installed they are retired, with a superblock write of
 * their own after the checkpoint's, and the next open starts the log after them. */
Test(compact, segments_walked_before_a_clean_close_are_retired_by_it, .timeout = 60)
{
    struct io_sim *sim;
    cr_assert_eq(io_sim_create(17, &sim), 0);
    idem_store *s = open_sim(sim);
    idem_queue *q;
    cr_assert_eq(idem_queue_open(s, 4, &q), IDEM_OK);
    struct kept kept[20];
    make_kept(q, kept, 20, "long");
    quiesce_compaction(s); /* from here the flusher takes no checkpoint by itself */
    short_lived_rounds(s, q, 30);
    uint64_t walked = 0;
    for (int i = 0; i < 500 && (walked = walked_waiting(s)) < 2; i++) {
        cr_assert_eq(idem_sync(s), IDEM_OK);
        usleep(2000);
    }
    cr_assert_geq(walked, 2, "compaction walked %llu segments", (unsigned long long)walked);
    store_lock(s);
    uint64_t first = wal_first_seq(s->wal), upto = s->cmp_walked;
    store_unlock(s);
    idem_queue_close(q);
    cr_assert_eq(idem_close(s), IDEM_OK);
    for (uint64_t seq = first; seq <= upto; seq++) {
        char path[128];
        uint8_t b;
        wal_seg_path(SIM_DIR, seq, path, sizeof path);
        cr_assert_lt(io_sim_read_file(sim, path, &b, 1), 0,
                     "segment %llu, walked before the close, is still there",
                     (unsigned long long)seq);
    }
    s = open_sim(sim);
    store_lock(s);
    uint64_t first_now = wal_first_seq(s->wal);
    store_unlock(s);
    cr_assert_gt(first_now, upto, "the log starts at segment %llu, walked before the close",
                 (unsigned long long)first_now);
    cr_assert_eq(idem_close(s), IDEM_OK);
    reopen_and_check(sim, kept, 20);
}

/* Found by the forty-second session's review: in durability none a sealed segment is flushed
 * whole, but counted durable only after the next sync of the log (a checkpoint or idem_sync),
 * so an idle store in that mode walked none of its expired segments until one came. */
Test(compact, in_durability_none_a_sealed_segment_is_walked_without_a_sync, .timeout = 60)
{
    struct io_sim *sim;
    cr_assert_eq(io_sim_create(19, &sim), 0);
    idem_store *s = open_sim_mode(sim, 64 * 1024, IDEM_DURABILITY_NONE);
    idem_queue *q;
    cr_assert_eq(idem_queue_open(s, 4, &q), IDEM_OK);
    quiesce_compaction(s); /* from here the flusher takes no checkpoint by itself */
    /* Keys that expire, then the end of their segment, with no sync after it (a move of the
     * clock makes the log durable: it comes before). */
    short_lived_rounds(s, q, 1);
    store_lock(s);
    uint64_t sealed = wal_cur_seq(s->wal); /* the segment the roll below ends */
    store_unlock(s);
    int rolled = 0;
    for (int i = 0; i < 1000 && rolled != 1; i++) {
        store_lock(s);
        rolled = wal_roll(s->wal);
        store_unlock(s);
        if (rolled != 1) usleep(2000); /* the spare segment is being made */
    }
    cr_assert_eq(rolled, 1, "the segment was not ended: %s", idem_strerror(rolled));
    /* That segment itself: one sealed before it, while the keys were written, may have been
     * made durable by the move of the clock. */
    uint64_t walked = 0;
    for (int i = 0; i < 1000 && walked < sealed; i++) {
        store_lock(s);
        walked = s->cmp_walked;
        store_unlock(s);
        if (walked < sealed) usleep(2000);
    }
    cr_assert_geq(walked, sealed, "segment %llu was not walked (the walk is at %llu)",
                  (unsigned long long)sealed, (unsigned long long)walked);
    idem_queue_close(q);
    cr_assert_eq(idem_close(s), IDEM_OK);
    io_sim_destroy(sim);
}

/* Submits keys [first, first + n) as SET NX with a 1 s ttl (key names in names[]). */
/* The value the tests below store: a record of about 180 bytes, against about 56 for the DELETE
 * frame that expiry writes for it, so walking expired segments fills a fraction of one. */
#define PACE_VALUE                                                                                 \
    "pace-value-0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef"  \
    "0123456789abcdef01"
#define PACE_VALUE_LEN ((uint32_t)sizeof PACE_VALUE - 1)

static void submit_window(idem_queue *q, char (*names)[24], idem_op *ops, int first, int n)
{
    for (int i = 0; i < n; i++) {
        snprintf(names[i], sizeof names[i], "pace-%d", first + i);
        ops[i] = (idem_op){.kind = IDEM_OP_SET_IF_ABSENT,
                           .key = names[i],
                           .key_len = (uint32_t)strlen(names[i]),
                           .ttl_ms = 1000,
                           .data = PACE_VALUE,
                           .data_len = PACE_VALUE_LEN};
    }
    cr_assert_eq(idem_submit(q, ops, (size_t)n), n);
}

static void reap_window(idem_queue *q, int n)
{
    idem_completion c[64];
    for (int got = 0; got < n;) {
        int k = idem_poll(q, c, (size_t)(n - got < 64 ? n - got : 64), -1);
        cr_assert_gt(k, 0, "poll: %s", k < 0 ? idem_strerror(k) : "nothing");
        for (int i = 0; i < k; i++)
            cr_assert_eq(c[i].err, IDEM_OK, "%s", idem_strerror(c[i].err));
        got += k;
    }
}

/* Found by the soak (100 k claims/s, 60 s ttl): compaction stepped only when no flush was due,
 * and under steady load one always was, so expired keys piled up far faster than they were
 * swept. Here the next window of writes is always submitted before the last one is answered,
 * so the log never idles; the clock moves on 1.5 s per 2,000 keys, and the live set must stay
 * near the keys of the last ttl instead of growing with all keys ever written. */
Test(compact, expiry_keeps_pace_with_a_log_that_never_idles, .timeout = 120)
{
    struct io_sim *sim;
    cr_assert_eq(io_sim_create(17, &sim), 0);
    idem_store *s = open_sim_seg(sim, 1024 * 1024); /* a segment spans several flushes */
    idem_queue *q;
    cr_assert_eq(idem_queue_open(s, 1024, &q), IDEM_OK);
    enum { W = 250, PER_ROUND = 2000, ROUNDS = 60 };
    static char names[2][W][24];
    static idem_op ops[2][W];
    uint64_t most = 0;
    int next = 0, cur = 0;
    submit_window(q, names[cur], ops[cur], next, W);
    next += W;
    for (int round = 0; round < ROUNDS; round++) {
        for (int w = 0; w < PER_ROUND / W; w++) {
            submit_window(q, names[!cur], ops[!cur], next, W); /* before the last is answered */
            next += W;
            reap_window(q, W);
            cur = !cur;
        }
        cr_assert_eq(idem_clock_advance(s, 1500), IDEM_OK);
        idem_stats st;
        idem_get_stats(s, &st);
        if (round >= 10 && st.keys > most) most = st.keys;
    }
    reap_window(q, W);
    idem_stats st;
    idem_get_stats(s, &st);
    cr_assert_lt(most, 6 * PER_ROUND,
                 "expiry fell behind a busy log: up to %llu keys live, %llu expired of %d",
                 (unsigned long long)most, (unsigned long long)st.expired_total, next);
    idem_queue_close(q);
    cr_assert_eq(idem_close(s), IDEM_OK);
    io_sim_destroy(sim);
}

/* SET NX keys, 2,000 a round in windows of 250, the clock 1.5 s on per round: one key in
 * long_every lives a day, the others a second. The short-lived keys still indexed after round
 * 20 stay below brief_max; the long-lived ones were copied forward whole. */
static void mixed_ttls(int long_every, uint64_t brief_max)
{
    struct io_sim *sim;
    cr_assert_eq(io_sim_create(18, &sim), 0);
    idem_store *s = open_sim_seg(sim, 1024 * 1024);
    idem_queue *q;
    cr_assert_eq(idem_queue_open(s, 1024, &q), IDEM_OK);
    enum { W = 250, PER_ROUND = 2000, ROUNDS = 60 };
    static char names[W][24];
    static idem_op ops[W];
    uint64_t most = 0;
    int next = 0, longs = 0;
    for (int round = 0; round < ROUNDS; round++) {
        for (int w = 0; w < PER_ROUND / W; w++, next += W) {
            for (int i = 0; i < W; i++) {
                int lng = (next + i) % long_every == 0;
                longs += lng;
                snprintf(names[i], sizeof names[i], "%s-%d", lng ? "long" : "pace", next + i);
                ops[i] = (idem_op){.kind = IDEM_OP_SET_IF_ABSENT,
                                   .key = names[i],
                                   .key_len = (uint32_t)strlen(names[i]),
                                   .ttl_ms = lng ? 86400000 : 1000,
                                   .data = PACE_VALUE,
                                   .data_len = PACE_VALUE_LEN};
            }
            cr_assert_eq(idem_submit(q, ops, W), W);
            reap_window(q, W);
        }
        cr_assert_eq(idem_clock_advance(s, 1500), IDEM_OK);
        idem_stats st;
        idem_get_stats(s, &st);
        uint64_t brief = st.keys - (uint64_t)longs; /* short-lived keys still indexed */
        if (round >= 20 && brief > most) most = brief;
    }
    idem_stats st;
    idem_get_stats(s, &st);
    cr_assert_lt(most, brief_max,
                 "one key in %d long-lived: up to %llu short-lived keys kept, %llu expired of %d",
                 long_every, (unsigned long long)most, (unsigned long long)st.expired_total, next);
    for (int i = 0; i < next; i += 17 * long_every) {
        char key[32];
        snprintf(key, sizeof key, "long-%d", i);
        idem_completion c;
        cr_assert_eq(idem_get(q, key, strlen(key), &c), IDEM_OK);
        cr_assert(c.found && c.record.result_len == PACE_VALUE_LEN, "%s lost", key);
    }
    cr_assert_eq(store_check_index(s, NULL), IDEM_OK);
    idem_queue_close(q);
    cr_assert_eq(idem_close(s), IDEM_OK);
    io_sim_destroy(sim);
}

/* A long-lived key among every window of short-lived ones: every segment holds a record that
 * outlives the others by a day. Waiting for all of a segment's records to expire (or for the
 * log to pass twice the live bytes, expired keys counted live) let the expired keys pile up for
 * the day (120,480 keys and none expired). */
Test(compact, a_few_long_lived_keys_do_not_keep_the_expired_ones, .timeout = 120)
{
    mixed_ttls(251, 6 * 2000);
}

/* One key in ten long-lived. A segment was walked only once all but a sixteenth of its bytes
 * had expired, and walks go in log order: none qualified, and nothing expired left the index
 * (96,000 of 120,000 keys stayed; at max_keys new claims got FULL among 25,000 expired keys).
 * Now a segment is walked once half its bytes have expired, or the segments from it on have
 * half theirs expired together (the copies of long-lived records gather in segments that would
 * otherwise hold the walk back). */
Test(compact, a_tenth_of_long_lived_keys_does_not_keep_the_expired_ones, .timeout = 120)
{
    mixed_ttls(10, 12 * 2000); /* 17,425 under ASan, whose flusher walks slower; 84,000 before */
}

/* Claims fly-0 .. fly-(n-1), 200 to a batch, with a 1 s ttl and a lease of a week, keeping
 * their tokens in tokens[] (unless NULL). */
#define FLY_BATCH 200
static void claim_flying(idem_queue *q, int n, int64_t *tokens)
{
    static char names[FLY_BATCH][24];
    static idem_op ops[FLY_BATCH];
    idem_completion c[FLY_BATCH];
    for (int first = 0; first < n; first += FLY_BATCH) {
        int k = n - first < FLY_BATCH ? n - first : FLY_BATCH;
        for (int i = 0; i < k; i++) {
            snprintf(names[i], sizeof names[i], "fly-%d", first + i);
            ops[i] = (idem_op){.kind = IDEM_OP_CLAIM,
                               .user_data = (uint64_t)(first + i),
                               .key = names[i],
                               .key_len = (uint32_t)strlen(names[i]),
                               .ttl_ms = 1000,
                               .lease_ms = 7 * 86400000ull};
        }
        cr_assert_eq(idem_submit(q, ops, (size_t)k), k);
        for (int got = 0; got < k;) {
            int r = idem_poll(q, c, (size_t)(k - got), -1);
            cr_assert_gt(r, 0, "poll: %s", r < 0 ? idem_strerror(r) : "nothing");
            for (int i = 0; i < r; i++) {
                cr_assert(c[i].err == IDEM_OK && c[i].outcome == IDEM_NEW, "%s",
                          idem_strerror(c[i].err));
                if (tokens) tokens[c[i].user_data] = c[i].token;
            }
            got += r;
        }
    }
}

/* In_flight claims past their ttl never expire (rule 5), but their copies were tallied by the
 * ttl: the segment a walk copied them into was due at once, and the store copied them from
 * segment to segment for ever with no client calls (4,500 segments retired in 1.5 s). */
Test(compact, unfinished_records_past_their_ttl_are_not_copied_for_ever, .timeout = 60)
{
    struct io_sim *sim;
    cr_assert_eq(io_sim_create(3, &sim), 0);
    idem_store *s = open_sim_seg(sim, 64 * 1024);
    idem_queue *q;
    cr_assert_eq(idem_queue_open(s, 256, &q), IDEM_OK);
    claim_flying(q, 3000, NULL);
    cr_assert_eq(idem_clock_advance(s, 2000), IDEM_OK); /* past every ttl; leases run a week */
    cr_assert_eq(idem_sync(s), IDEM_OK);
    usleep(1500 * 1000); /* the walks the clock step made due */
    idem_stats a, b;
    idem_get_stats(s, &a);
    usleep(1000 * 1000); /* no calls at all */
    idem_get_stats(s, &b);
    cr_assert_leq(b.compactions - a.compactions, 8,
                  "an idle store went on compacting: %llu segments in 1 s (%llu before)",
                  (unsigned long long)(b.compactions - a.compactions),
                  (unsigned long long)a.compactions);
    cr_assert_eq(b.keys, 3000);
    idem_completion c;
    cr_assert_eq(idem_get(q, "fly-7", 5, &c), IDEM_OK);
    cr_assert(c.found && c.record.state == IDEM_STATE_IN_FLIGHT);
    idem_queue_close(q);
    cr_assert_eq(idem_close(s), IDEM_OK);
    io_sim_destroy(sim);
}

static void set_keys(idem_queue *q, const char *prefix, int n, uint64_t ttl_ms);

/* Runs the flusher's rounds (a sync each) until segment seq, the first of the log, has been
 * measured and then until it is walked or `rounds` more have passed; returns its horizon
 * (expires_at_ms of its latest record, SEG_EXP_UNKNOWN once it is retired) and sets *walked to
 * the last segment walked (0: none). */
static int64_t measure_first_segment(idem_store *s, uint64_t seq, int rounds, uint64_t *walked)
{
    int64_t horizon = SEG_EXP_UNKNOWN;
    for (int i = 0; i < 1000 + rounds; i++) {
        cr_assert_eq(idem_sync(s), IDEM_OK);
        usleep(2000);
        store_lock(s);
        int retired = wal_first_seq(s->wal) > seq; /* walked, and retired by a checkpoint */
        horizon = retired ? SEG_EXP_UNKNOWN : s->seg_max_exp[seq % WAL_SEG_SLOTS];
        *walked = retired && s->cmp_walked < seq ? seq : s->cmp_walked;
        store_unlock(s);
        if (retired) return horizon;
        if (horizon == SEG_EXP_UNKNOWN) continue;
        if (*walked >= seq || --rounds == 0) break;
    }
    cr_assert_neq(horizon, SEG_EXP_UNKNOWN, "segment %llu was never measured",
                  (unsigned long long)seq);
    return horizon;
}

/* Closes s after moving its clock past every ttl of the keys written, with compaction stopped
 * first: the next open measures the oldest segment with every ttl passed already (else the
 * measure may come before the clock moves, and rightly count the records by their ttls). */
static void close_past_the_ttls(idem_store *s)
{
    store_lock(s);
    s->cmp_disabled = 1;
    store_unlock(s);
    cr_assert_eq(idem_clock_advance(s, 2000), IDEM_OK); /* leases run a week */
    cr_assert_eq(idem_close(s), IDEM_OK);
}

/* Found by the forty-second session's review: after a reopen, the pass that measures a segment
 * written before the open (compact_learn_horizon) tallied an in_flight record past its ttl by
 * that ttl, so its segment was due and a walk copied such records once more after every open.
 * Here the oldest segment holds nothing else, and must not be walked. */
Test(compact, unfinished_records_past_their_ttl_are_not_copied_again_after_a_reopen, .timeout = 60)
{
    struct io_sim *sim;
    cr_assert_eq(io_sim_create(37, &sim), 0);
    /* Segments of 256 KiB: a sixteenth of one holds more records than are set aside at once. */
    idem_store *s = open_sim_seg(sim, 256 * 1024);
    idem_queue *q;
    cr_assert_eq(idem_queue_open(s, 256, &q), IDEM_OK);
    claim_flying(q, 8000, NULL);
    store_lock(s);
    uint64_t first = wal_first_seq(s->wal), cur = wal_cur_seq(s->wal);
    store_unlock(s);
    cr_assert_gt(cur, first + 1, "the claims fill less than two segments");
    idem_queue_close(q);
    close_past_the_ttls(s);
    s = open_sim_seg(sim, 256 * 1024);
    uint64_t walked;
    int64_t horizon = measure_first_segment(s, first, 100, &walked);
    cr_assert_eq(horizon, INT64_MAX, "measured as expiring at %lld", (long long)horizon);
    cr_assert_eq(walked, 0, "segment %llu, only in_flight records, was walked",
                 (unsigned long long)walked);
    cr_assert_eq(idem_queue_open(s, 4, &q), IDEM_OK);
    idem_completion c;
    cr_assert_eq(idem_get(q, "fly-7", 5, &c), IDEM_OK);
    cr_assert(c.found && c.record.state == IDEM_STATE_IN_FLIGHT);
    idem_queue_close(q);
    cr_assert_eq(idem_close(s), IDEM_OK);
    io_sim_destroy(sim);
}

/* The other side of the test above: an in_flight version past its ttl that a commit has since
 * replaced is dead, and counts as expired. Three quarters of the oldest segment are such
 * versions, and it is walked. */
Test(compact, replaced_in_flight_versions_count_as_expired_after_a_reopen, .timeout = 60)
{
    struct io_sim *sim;
    cr_assert_eq(io_sim_create(41, &sim), 0);
    idem_store *s = open_sim(sim);
    idem_queue *q;
    cr_assert_eq(idem_queue_open(s, 256, &q), IDEM_OK);
    static int64_t tokens[3000];
    claim_flying(q, 3000, tokens);
    store_lock(s);
    uint64_t first = wal_first_seq(s->wal);
    store_unlock(s);
    /* Hour-long keys after them keep the log under twice the live bytes (the commits below add
     * the dead versions), so only the measure of the oldest segment can start its walk; the
     * commits go in batches, as one a batch would pad the log to a block each. */
    set_keys(q, "hour", 3000, 3600000);
    static char names[FLY_BATCH][24];
    static idem_op ops[FLY_BATCH];
    for (int i = 0, k = 0; i < 3000; i++) {
        if (i % 4 != 3) {
            snprintf(names[k], sizeof names[k], "fly-%d", i);
            ops[k] = (idem_op){.kind = IDEM_OP_COMMIT,
                               .key = names[k],
                               .key_len = (uint32_t)strlen(names[k]),
                               .token = tokens[i],
                               .data = "done",
                               .data_len = 4};
            k++;
        }
        if (k == FLY_BATCH || (i == 2999 && k)) {
            cr_assert_eq(idem_submit(q, ops, (size_t)k), k);
            reap_window(q, k);
            k = 0;
        }
    }
    store_lock(s);
    uint64_t walked_before = s->cmp_walked;
    store_unlock(s);
    cr_assert_eq(walked_before, 0, "segment %llu was walked before the reopen",
                 (unsigned long long)walked_before);
    idem_queue_close(q);
    close_past_the_ttls(s);
    s = open_sim(sim);
    uint64_t walked;
    int64_t horizon = measure_first_segment(s, first, 500, &walked);
    cr_assert_geq(walked, first,
                  "segment %llu, three quarters replaced versions, was not walked (horizon %lld)",
                  (unsigned long long)first, (long long)horizon);
    cr_assert_eq(idem_queue_open(s, 4, &q), IDEM_OK);
    idem_completion c;
    cr_assert_eq(idem_get(q, "fly-3", 5, &c), IDEM_OK);
    cr_assert(c.found && c.record.state == IDEM_STATE_IN_FLIGHT && c.record.token == tokens[3]);
    idem_queue_close(q);
    cr_assert_eq(idem_close(s), IDEM_OK);
    io_sim_destroy(sim);
}

static uint64_t cur_seq(idem_store *s)
{
    store_lock(s);
    uint64_t seq = wal_cur_seq(s->wal);
    store_unlock(s);
    return seq;
}

/* SET NX keys with a 1 s ttl, 200 to a batch, from *next on, until `sealed` more segments are
 * sealed. */
static void fill_segments(idem_queue *q, idem_store *s, int *next, uint64_t sealed)
{
    static char names[200][24];
    static idem_op ops[200];
    uint64_t until = cur_seq(s) + sealed;
    while (cur_seq(s) < until) {
        cr_assert_lt(*next, 1000000, "the log does not grow");
        submit_window(q, names, ops, *next, 200);
        reap_window(q, 200);
        *next += 200;
    }
    cr_assert_eq(idem_sync(s), IDEM_OK);
}

/* Syncs until walked + retired segments reach n and no walk is under way, and that stays so for
 * 10 rounds of the flusher (compaction wants no more walks). */
static void until_walk_stops(idem_store *s, uint64_t retired_before, uint64_t n)
{
    uint64_t last = 0;
    int still = 0;
    for (int i = 0; i < 1000; i++) {
        cr_assert_eq(idem_sync(s), IDEM_OK);
        usleep(2000);
        idem_stats st;
        idem_get_stats(s, &st);
        store_lock(s);
        uint64_t walked = s->cmp_walked ? s->cmp_walked - wal_first_seq(s->wal) + 1 : 0;
        int walking = s->cmp_seq != 0;
        store_unlock(s);
        uint64_t done = st.compactions - retired_before + walked;
        still = !walking && done >= n && done == last ? still + 1 : 0;
        last = done;
        if (still >= 10) return;
    }
    cr_assert_fail("compaction never walked %llu segments and stopped", (unsigned long long)n);
}

/* A checkpoint scans the whole index, so under load it is taken once 4 walked segments wait
 * (STORE_CKPT_RETIRE_BATCH), not after every walk; fewer wait until the walk has stopped for
 * 5 s of store time (STORE_CKPT_QUIET_MS). Found by the soak: a checkpoint per segment took a
 * tenth of the CPU at 100 k claims/s. */
Test(compact, walked_segments_wait_for_a_batch_or_a_quiet_log, .timeout = 60)
{
    struct io_sim *sim;
    cr_assert_eq(io_sim_create(19, &sim), 0);
    idem_store *s = open_sim(sim);
    idem_queue *q;
    cr_assert_eq(idem_queue_open(s, 256, &q), IDEM_OK);
    int next = 0;

    /* Two segments expire and are walked: they wait, with no checkpoint, while time stands. */
    fill_segments(q, s, &next, 2);
    idem_stats st;
    idem_get_stats(s, &st);
    uint64_t c0 = st.checkpoints, r0 = st.compactions;
    cr_assert_eq(idem_clock_advance(s, 2000), IDEM_OK);
    until_walk_stops(s, r0, 2);
    for (int i = 0; i < 20; i++) {
        cr_assert_eq(idem_sync(s), IDEM_OK);
        usleep(1000);
    }
    idem_get_stats(s, &st);
    cr_assert_gt(st.expired_total, 0);
    cr_assert_eq(st.checkpoints, c0, "a checkpoint taken for fewer than 4 walked segments");
    cr_assert_eq(st.compactions, r0);
    cr_assert_eq(walked_waiting(s), 2);

    /* The walk has stopped for 5 s: one checkpoint retires both. */
    cr_assert_eq(idem_clock_advance(s, 5000), IDEM_OK);
    for (int i = 0; i < 500 && st.compactions < r0 + 2; i++) {
        cr_assert_eq(idem_sync(s), IDEM_OK);
        usleep(2000);
        idem_get_stats(s, &st);
    }
    cr_assert_eq(st.compactions, r0 + 2, "walked segments never retired on a quiet log");
    cr_assert_eq(st.checkpoints, c0 + 1);

    /* Six segments or more (with the deletes) expire together: while time stands, each
     * checkpoint retires four or more; fewer than four are left waiting. */
    fill_segments(q, s, &next, 6);
    idem_get_stats(s, &st);
    uint64_t c1 = st.checkpoints, r1 = st.compactions;
    cr_assert_eq(idem_clock_advance(s, 2000), IDEM_OK);
    until_walk_stops(s, r1, 6);
    idem_get_stats(s, &st);
    uint64_t ckpts = st.checkpoints - c1, retired = st.compactions - r1,
             waiting = walked_waiting(s);
    cr_assert_geq(ckpts, 1, "no checkpoint while %llu segments waited",
                  (unsigned long long)waiting);
    cr_assert_geq(retired, 4 * ckpts, "%llu checkpoints retired only %llu segments",
                  (unsigned long long)ckpts, (unsigned long long)retired);
    cr_assert_lt(
        waiting, 4,
        "%llu walked segments wait (%llu checkpoints, %llu retired, log at %llu, first %llu)",
        (unsigned long long)waiting, (unsigned long long)ckpts, (unsigned long long)retired,
        (unsigned long long)cur_seq(s), (unsigned long long)wal_first_seq(s->wal));

    /* Nothing was lost on the way: a crash keeps no expired key either. */
    crash_and_check(sim, s, q, NULL, 0);
}

static int compaction_stopped(idem_store *s)
{
    store_lock(s);
    int stopped = s->cmp_disabled;
    store_unlock(s);
    return stopped;
}

/* Compaction that meets a damaged frame stops there and says so (the store serves on, verify
 * tells more), and the segments it walked before that are still retired: a checkpoint is asked
 * for at once, though time stands still and fewer than 4 wait. */
Test(compact, segments_walked_before_a_corrupt_frame_are_still_retired, .timeout = 60)
{
    struct io_sim *sim;
    cr_assert_eq(io_sim_create(23, &sim), 0);
    idem_store *s = open_sim(sim);
    idem_queue *q;
    cr_assert_eq(idem_queue_open(s, 256, &q), IDEM_OK);
    int next = 0;
    uint64_t first = cur_seq(s);
    fill_segments(q, s, &next, 4);
    idem_stats st;
    idem_get_stats(s, &st);
    uint64_t r0 = st.compactions;
    char path[64];
    snprintf(path, sizeof path, SIM_DIR "/wal-%016llx.log", (unsigned long long)(first + 2));
    cr_assert_eq(io_sim_corrupt(sim, path, 4096 + 64, 0x10), 0); /* its first frame */
    cr_assert_eq(idem_clock_advance(s, 2000), IDEM_OK);
    for (int i = 0; i < 1000 && !(compaction_stopped(s) && st.compactions >= r0 + 2); i++) {
        cr_assert_eq(idem_sync(s), IDEM_OK);
        usleep(2000);
        idem_get_stats(s, &st);
    }
    cr_assert(compaction_stopped(s), "compaction walked over a damaged frame");
    cr_assert_eq(st.compactions, r0 + 2, "%llu of the 2 segments walked before it retired",
                 (unsigned long long)(st.compactions - r0));
    cr_assert_eq(idem_compact(s, 1000), IDEM_ECORRUPT);
    idem_completion c;
    idem_claim_args a = {.ttl_ms = 60000, .lease_ms = 1000};
    cr_assert_eq(idem_claim(q, "after", 5, &a, &c), IDEM_OK, "the store stopped serving");
    cr_assert_eq(c.outcome, IDEM_NEW);
    idem_queue_close(q);
    cr_assert_eq(idem_close(s), IDEM_OK);
    io_sim_destroy(sim);
}

/* Segments written before an open have no known expiry horizon: the flusher measures the next
 * one to walk with the store's lock let go (compact_learn_horizon), then walks it once all its
 * records have expired. SET NX writes one version per key, so the log stays under twice the
 * live bytes and expiry alone can start the walk. */
static void set_keys(idem_queue *q, const char *prefix, int n, uint64_t ttl_ms)
{
    /* Submitted 64 at a time: batches of one key each would pad the log to a block per key. */
    static char keys[64][32];
    idem_op ops[64];
    idem_completion c[64];
    for (int i = 0; i < n; i += 64) {
        int k = n - i < 64 ? n - i : 64;
        for (int j = 0; j < k; j++) {
            snprintf(keys[j], sizeof keys[j], "%s-%d", prefix, i + j);
            ops[j] = (idem_op){.kind = IDEM_OP_SET_IF_ABSENT,
                               .key = keys[j],
                               .key_len = (uint32_t)strlen(keys[j]),
                               .data = PACE_VALUE,
                               .data_len = PACE_VALUE_LEN,
                               .ttl_ms = ttl_ms};
        }
        cr_assert_eq(idem_submit(q, ops, (size_t)k), k);
        for (int got = 0; got < k;) {
            int r = idem_poll(q, c + got, (size_t)(k - got), 10000);
            cr_assert_gt(r, 0);
            got += r;
        }
        for (int j = 0; j < k; j++)
            cr_assert_eq(c[j].err, IDEM_OK);
    }
}

/* Every 7th of the keys prefix-0 .. prefix-(n-1) is still there. */
static void check_keys(idem_queue *q, const char *prefix, int n)
{
    for (int i = 0; i < n; i += 7) {
        char key[32];
        snprintf(key, sizeof key, "%s-%d", prefix, i);
        idem_completion c;
        cr_assert_eq(idem_get(q, key, strlen(key), &c), IDEM_OK);
        cr_assert(c.found, "%s lost", key);
    }
}

/* A store on sim whose log spans several segments of hour-long keys hour-0 .. hour-2399. */
static idem_store *open_with_segments(struct io_sim *sim, idem_queue **q)
{
    idem_store *s = open_sim(sim);
    cr_assert_eq(idem_queue_open(s, 64, q), IDEM_OK);
    set_keys(*q, "hour", 2400, 3600000);
    return s;
}

Test(compact, a_segment_from_before_the_open_is_walked_once_its_records_expire, .timeout = 60)
{
    struct io_sim *sim;
    cr_assert_eq(io_sim_create(29, &sim), 0);
    idem_store *s = open_sim(sim);
    idem_queue *q;
    cr_assert_eq(idem_queue_open(s, 64, &q), IDEM_OK);
    set_keys(q, "minute", 800, 60000); /* the oldest segments */
    set_keys(q, "hour", 1600, 3600000);
    idem_queue_close(q);
    cr_assert_eq(idem_close(s), IDEM_OK);
    s = open_sim(sim);
    idem_stats st;
    idem_get_stats(s, &st);
    cr_assert_eq(st.compactions, 0);
    uint64_t before = st.wal_bytes;
    cr_assert_eq(idem_clock_advance(s, 120000), IDEM_OK);
    for (int i = 0; i < 500 && st.compactions == 0; i++) {
        cr_assert_eq(idem_sync(s), IDEM_OK);
        if (i % 50 == 49) cr_assert_eq(idem_checkpoint(s), IDEM_OK); /* retires what was walked */
        usleep(2000);
        idem_get_stats(s, &st);
    }
    cr_assert_gt(st.compactions, 0, "no segment retired (log %llu bytes, %llu keys)",
                 (unsigned long long)st.wal_bytes, (unsigned long long)st.keys);
    cr_assert_gt(st.expired_total, 0);
    cr_assert_lt(st.wal_bytes, before);
    cr_assert_eq(idem_queue_open(s, 4, &q), IDEM_OK);
    check_keys(q, "hour", 1600);
    idem_queue_close(q);
    cr_assert_eq(idem_close(s), IDEM_OK);
    io_sim_destroy(sim);
}

static void log_position(idem_store *s, uint64_t *seq, uint32_t *off)
{
    store_lock(s);
    wal_position(s->wal, seq, off);
    store_unlock(s);
}

/* The segment current at an open, written on after it: its expiry horizon was taken from the
 * records written after the open alone. Short-lived keys written then (hour-long ones after them)
 * expire, and the segment looked all expired although the hour-long keys written before the open
 * (most of it) live on: a walk copied them all. Now the segment is measured whole first, and not
 * walked. */
Test(compact, the_segment_current_at_an_open_is_judged_by_all_its_records, .timeout = 60)
{
    struct io_sim *sim;
    cr_assert_eq(io_sim_create(31, &sim), 0);
    idem_store *s = open_sim(sim);
    idem_queue *q;
    cr_assert_eq(idem_queue_open(s, 64, &q), IDEM_OK);
    uint64_t seq;
    uint32_t off;
    int hours = 0;
    do { /* hour-long keys over three quarters of the first segment */
        char prefix[16];
        snprintf(prefix, sizeof prefix, "hour%d", hours++);
        set_keys(q, prefix, 64, 3600000);
        log_position(s, &seq, &off);
    } while (seq == 1 && off < 48 * 1024);
    cr_assert_eq(seq, 1, "the hour-long keys passed the first segment");
    idem_queue_close(q);
    cr_assert_eq(idem_close(s), IDEM_OK);
    s = open_sim(sim);
    cr_assert_eq(idem_queue_open(s, 64, &q), IDEM_OK);
    for (int i = 0; cur_seq(s) < 2; i++) { /* 1 s keys: the rest of it */
        char prefix[16];
        snprintf(prefix, sizeof prefix, "sec%d", i);
        set_keys(q, prefix, 64, 1000);
    }
    int lates = 0;
    while (cur_seq(s) < 3) { /* hour-long keys after it: no window of expired segments */
        char prefix[16];
        snprintf(prefix, sizeof prefix, "late%d", lates++);
        set_keys(q, prefix, 64, 3600000);
    }
    cr_assert_eq(idem_sync(s), IDEM_OK);
    uint64_t seq0;
    uint32_t off0;
    log_position(s, &seq0, &off0);
    cr_assert_eq(idem_clock_advance(s, 5000), IDEM_OK);
    for (int i = 0; i < 100; i++) { /* the flusher's rounds: measuring, perhaps walking */
        cr_assert_eq(idem_sync(s), IDEM_OK);
        usleep(5000);
    }
    log_position(s, &seq, &off);
    cr_assert(seq == seq0 && off == off0,
              "the log grew from %llu:%u to %llu:%u: the hour-long keys were copied",
              (unsigned long long)seq0, off0, (unsigned long long)seq, off);
    for (int h = 0; h < hours; h++) {
        char prefix[16];
        snprintf(prefix, sizeof prefix, "hour%d", h);
        check_keys(q, prefix, 64);
    }
    idem_queue_close(q);
    cr_assert_eq(idem_close(s), IDEM_OK);
    io_sim_destroy(sim);
}

static int sim_has(struct io_sim *sim, const char *path)
{
    char b;
    return io_sim_read_file(sim, path, &b, 0) >= 0;
}

/* Out of descriptors when making the next log segment: new writes answer FULL until the
 * flusher, trying again every second, makes it; nothing is lost, the store is not failed (it
 * was: idemd exited, EMFILE taken for the disk failing). */
Test(compact, a_segment_made_out_of_descriptors_answers_full_then_goes_on, .timeout = 60)
{
    struct io_sim *sim;
    cr_assert_eq(io_sim_create(13, &sim), 0);
    idem_store *s = open_sim(sim);
    idem_queue *q;
    cr_assert_eq(idem_queue_open(s, 4, &q), IDEM_OK);
    char third[128];
    snprintf(third, sizeof third, "/wal-%016llx.log", 3ull);
    io_sim_fail_open(sim, third, -EMFILE);
    int full = 0, done = 0;
    int64_t t0 = util_monotonic_us();
    for (int i = 0; done < 2000 && util_monotonic_us() - t0 < 20 * 1000000; i++) {
        char key[32];
        snprintf(key, sizeof key, "seg-%d", i);
        idem_claim_args a = {.ttl_ms = 86400000, .lease_ms = 1000};
        idem_completion c;
        int rc = idem_claim(q, key, strlen(key), &a, &c);
        if (rc == IDEM_EFULL || (rc == IDEM_OK && c.err == IDEM_EFULL)) {
            full++;
            usleep(1000);
            continue;
        }
        cr_assert_eq(rc, IDEM_OK, "%s", idem_strerror(rc));
        cr_assert_eq(c.err, IDEM_OK, "claim %d: %s", i, idem_strerror(c.err));
        cr_assert_eq(c.outcome, IDEM_NEW);
        done++;
    }
    idem_stats st;
    idem_get_stats(s, &st);
    cr_assert_eq(st.fatal, 0);
    cr_assert_eq(done, 2000, "%d claims in 20 s", done);
    cr_assert_gt(full, 0, "the failed open of segment 3 was never met");
    cr_assert_geq(cur_seq(s), 3, "the log never reached segment 3");
    cr_assert_eq(st.keys, 2000);
    idem_queue_close(q);
    cr_assert_eq(idem_close(s), IDEM_OK);
    io_sim_destroy(sim);
}

/* Out of descriptors when the store clock is written to the superblock (a move of the test
 * clock that no batch carries): nothing was written, so it is written a second later, and the
 * answers waiting for it come then; the store is not failed (it was). */
Test(compact, a_clock_save_out_of_descriptors_is_tried_again, .timeout = 60)
{
    struct io_sim *sim;
    cr_assert_eq(io_sim_create(14, &sim), 0);
    idem_store *s = open_sim(sim);
    idem_queue *q;
    cr_assert_eq(idem_queue_open(s, 4, &q), IDEM_OK);
    int64_t tok;
    claim_commit(q, "short", 1000, &tok);
    cr_assert_eq(idem_sync(s), IDEM_OK);
    io_sim_fail_open(sim, "/super", -EMFILE);
    cr_assert_eq(idem_clock_advance(s, 1000), IDEM_OK);
    /* The key is expired now; in sync mode its absence is answered once the clock that
     * expired it is durable. */
    idem_completion c;
    int64_t t0 = util_monotonic_us();
    cr_assert_eq(idem_get(q, "short", 5, &c), IDEM_OK);
    cr_assert_eq(c.err, IDEM_OK, "%s", idem_strerror(c.err));
    cr_assert(!c.found, "an expired key was answered found");
    cr_assert_lt(util_monotonic_us() - t0, 5 * 1000000, "the clock was not written again");
    idem_stats st;
    idem_get_stats(s, &st);
    cr_assert_eq(st.fatal, 0);
    idem_queue_close(q);
    cr_assert_eq(idem_close(s), IDEM_OK);
    io_sim_destroy(sim);
}

/* Out of descriptors when the flusher reserves tokens ahead (an import took the next token far
 * past the reservation): a claim that needs a token answers FULL at once, not after a wait as
 * long as the shortage; repeats, reads and changes that need no token go on; a second later the
 * reservation is made and claims are granted again, with tokens above every one handed out or
 * imported, also after a reopen. */
Test(compact, a_token_reservation_out_of_descriptors_answers_full_until_it_is_made, .timeout = 60)
{
    struct io_sim *sim;
    cr_assert_eq(io_sim_create(15, &sim), 0);
    idem_store *s = open_sim(sim);
    idem_queue *q;
    cr_assert_eq(idem_queue_open(s, 4, &q), IDEM_OK);
    int64_t before, gone, pair[2];
    claim_commit(q, "before", 3600000, &before);
    claim_commit(q, "gone", 3600000, &gone);
    claim_commit(q, "pair-0", 3600000, &pair[0]);
    claim_commit(q, "pair-1", 3600000, &pair[1]);
    idem_claim_args a = {.ttl_ms = 3600000, .lease_ms = 60000};
    idem_completion c;
    cr_assert_eq(idem_claim(q, "held", 4, &a, &c), IDEM_OK);
    cr_assert_eq(c.outcome, IDEM_NEW);
    int64_t held = c.token;
    cr_assert_eq(idem_sync(s), IDEM_OK);
    const int64_t imported = 1ll << 40;
    idem_record in;
    memset(&in, 0, sizeof in);
    in.key = "imp";
    in.key_len = 3;
    in.state = IDEM_STATE_COMMITTED;
    in.first_seen_ms = in.last_seen_ms = in.last_grant_ms = idem_clock_now(s);
    in.expires_at_ms = in.first_seen_ms + 3600000;
    in.seen_count = 1;
    in.attempts = 1;
    in.token = imported;
    io_sim_fail_open(sim, "/super", -EMFILE);
    cr_assert_eq(idem_import_record(q, &in), IDEM_OK);
    int64_t t0 = util_monotonic_us();
    int rc = idem_claim(q, "new", 3, &a, &c);
    cr_assert_eq(rc, IDEM_EFULL, "a claim without a token reserved: %s", idem_strerror(rc));
    cr_assert_lt(util_monotonic_us() - t0, 500 * 1000, "FULL came after a wait");
    cr_assert_eq(idem_claim(q, "before", 6, &a, &c), IDEM_OK);
    cr_assert_eq(c.outcome, IDEM_DONE);
    cr_assert(c.data_len == 16 && memcmp(c.data, "result-of-before", 16) == 0);
    cr_assert_eq(idem_get(q, "before", 6, &c), IDEM_OK);
    cr_assert(c.found && c.record.state == IDEM_STATE_COMMITTED);
    cr_assert_eq(idem_get(q, "imp", 3, &c), IDEM_OK);
    cr_assert(c.found && c.record.state == IDEM_STATE_COMMITTED);
    /* Changes that need no token go on: an owner's commit, an operator's delete (which took
     * FULL, or went ahead without the log's room checked, before the forty-ninth session). */
    rc = idem_commit(q, "held", 4, held, "r", 1);
    cr_assert_eq(rc, IDEM_OK, "a commit while the reservation waits: %s", idem_strerror(rc));
    rc = idem_del(q, "gone", 4, "test");
    cr_assert_eq(rc, IDEM_OK, "a delete while the reservation waits: %s", idem_strerror(rc));
    cr_assert_eq(idem_get(q, "gone", 4, &c), IDEM_OK);
    cr_assert(!c.found);
    idem_op group[2] = {
        {.kind = IDEM_OP_DEL,
         .flags = IDEM_F_WITH_NEXT,
         .key = "pair-0",
         .key_len = 6,
         .actor = "test"},
        {.kind = IDEM_OP_DEL, .key = "pair-1", .key_len = 6, .actor = "test"},
    };
    cr_assert_eq(idem_submit(q, group, 2), 2);
    idem_completion gc[2];
    for (int got = 0; got < 2;) {
        int k = idem_poll(q, gc + got, (size_t)(2 - got), 10000);
        cr_assert_gt(k, 0, "the group's deletes were not answered");
        got += k;
    }
    for (int i = 0; i < 2; i++)
        cr_assert_eq(gc[i].err, IDEM_OK, "a group delete while the reservation waits: %s",
                     idem_strerror(gc[i].err));
    idem_stats st;
    idem_get_stats(s, &st);
    cr_assert_eq(st.fatal, 0);
    /* The flusher tries again a second (of the store's monotonic clock) later. */
    cr_assert_eq(idem_clock_advance(s, 1000), IDEM_OK);
    for (int i = 0;; i++) {
        rc = idem_claim(q, "new", 3, &a, &c);
        if (rc != IDEM_EFULL) break;
        cr_assert_lt(i, 2500, "still FULL 5 s after the reservation could be made");
        usleep(2000);
    }
    cr_assert_eq(rc, IDEM_OK, "%s", idem_strerror(rc));
    cr_assert_eq(c.outcome, IDEM_NEW);
    cr_assert_gt(c.token, before);
    cr_assert_gt(c.token, gone);
    cr_assert_gt(c.token, imported, "token %lld not above the imported %lld", (long long)c.token,
                 (long long)imported);
    int64_t granted = c.token;
    idem_queue_close(q);
    cr_assert_eq(idem_close(s), IDEM_OK);
    s = open_sim(sim);
    cr_assert_eq(idem_queue_open(s, 4, &q), IDEM_OK);
    cr_assert_eq(idem_claim(q, "after", 5, &a, &c), IDEM_OK);
    cr_assert_eq(c.outcome, IDEM_NEW);
    cr_assert_gt(c.token, granted);
    cr_assert_eq(idem_get(q, "held", 4, &c), IDEM_OK);
    cr_assert(c.found && c.record.state == IDEM_STATE_COMMITTED && c.record.result_len == 1);
    cr_assert_eq(idem_get(q, "gone", 4, &c), IDEM_OK);
    cr_assert(!c.found, "a delete made while the reservation waited came back");
    cr_assert_eq(idem_get(q, "pair-1", 6, &c), IDEM_OK);
    cr_assert(!c.found, "a group delete made while the reservation waited came back");
    idem_queue_close(q);
    cr_assert_eq(idem_close(s), IDEM_OK);
    io_sim_destroy(sim);
}

/* Puts a file of 4 KiB at path on the simulated disk, durably, as a crash would leave one. */
static void sim_put(struct io_sim *sim, const char *path)
{
    struct io *io = io_sim_io(sim);
    struct io_file *f;
    static uint8_t junk[4096];
    cr_assert_eq(io_open(io, path, IO_O_CREATE, &f), 0);
    cr_assert_eq(io_write_sync(io, f, 0, junk, sizeof junk, 1), 0);
    io_close(io, f);
    cr_assert_eq(io_sync_dir(io, SIM_DIR), 0);
    io_destroy(io);
}

Test(compact, files_a_crash_or_a_failed_delete_left_behind_are_removed_at_the_next_open,
     .timeout = 60)
{
    struct io_sim *sim;
    cr_assert_eq(io_sim_create(31, &sim), 0);
    idem_queue *q;
    idem_store *s = open_with_segments(sim, &q);
    cr_assert_eq(idem_compact(s, 20000), IDEM_OK); /* copies them forward, retires them */
    idem_queue_close(q);
    cr_assert_eq(idem_close(s), IDEM_OK);
    struct io *io = io_sim_io(sim);
    struct super sb;
    char err[256];
    cr_assert_eq(super_load(io, SIM_DIR, &sb, 0, err, sizeof err), 0, "%s", err);
    io_destroy(io);
    cr_assert_gt(sb.wal_first_seq, 5, "too few segments retired to leave three behind");
    cr_assert_gt(sb.ckpt_id, 5);
    /* A retirement and a checkpoint install cut short by a crash, and a checkpoint never
     * installed, as they would leave the directory; and a segment and a checkpoint whose delete
     * failed, below others that are gone (a walk down from the files in use stopped at the
     * first absent name and never removed them). */
    char first[256], seg[2][256], ck_old[2][256], ck_prev[256], ck_cur[256], ck_next[256];
    char seg_gap[256], ck_gap[256];
    snprintf(seg_gap, sizeof seg_gap, SIM_DIR "/wal-%016llx.log",
             (unsigned long long)(sb.wal_first_seq - 4));
    ckpt_path(SIM_DIR, sb.ckpt_id - 5, ck_gap, sizeof ck_gap);
    sim_put(sim, seg_gap);
    sim_put(sim, ck_gap);
    snprintf(first, sizeof first, SIM_DIR "/wal-%016llx.log", (unsigned long long)sb.wal_first_seq);
    for (int i = 0; i < 2; i++) {
        snprintf(seg[i], sizeof seg[i], SIM_DIR "/wal-%016llx.log",
                 (unsigned long long)(sb.wal_first_seq - 1 - i));
        ckpt_path(SIM_DIR, sb.ckpt_id - 2 - i, ck_old[i], sizeof ck_old[i]);
        sim_put(sim, seg[i]);
        sim_put(sim, ck_old[i]);
    }
    ckpt_path(SIM_DIR, sb.ckpt_id - 1, ck_prev, sizeof ck_prev);
    ckpt_path(SIM_DIR, sb.ckpt_id, ck_cur, sizeof ck_cur);
    ckpt_path(SIM_DIR, sb.ckpt_id + 1, ck_next, sizeof ck_next);
    sim_put(sim, ck_next);
    int had_prev = sim_has(sim, ck_prev);
    s = open_sim(sim);
    for (int i = 0; i < 2; i++) {
        cr_assert(!sim_has(sim, seg[i]), "%s left behind", seg[i]);
        cr_assert(!sim_has(sim, ck_old[i]), "%s left behind", ck_old[i]);
    }
    cr_assert(!sim_has(sim, ck_next), "%s left behind", ck_next);
    cr_assert(!sim_has(sim, seg_gap), "%s (below a gap) left behind", seg_gap);
    cr_assert(!sim_has(sim, ck_gap), "%s (below a gap) left behind", ck_gap);
    /* What either superblock copy may name stays. */
    cr_assert(sim_has(sim, first));
    cr_assert(sim_has(sim, ck_cur));
    cr_assert_eq(sim_has(sim, ck_prev), had_prev);
    cr_assert_eq(idem_queue_open(s, 4, &q), IDEM_OK);
    check_keys(q, "hour", 2400);
    idem_queue_close(q);
    cr_assert_eq(idem_close(s), IDEM_OK);
    s = open_sim(sim); /* and the store opens again as it was */
    cr_assert_eq(idem_close(s), IDEM_OK);
    io_sim_destroy(sim);
}

Test(compact, a_delete_that_hangs_holds_up_no_acknowledgement, .timeout = 60)
{
    struct io_sim *sim;
    cr_assert_eq(io_sim_create(37, &sim), 0);
    idem_queue *q;
    idem_store *s = open_with_segments(sim, &q);
    store_lock(s);
    uint64_t first = s->sb.wal_first_seq;
    store_unlock(s);
    char seg[256];
    snprintf(seg, sizeof seg, SIM_DIR "/wal-%016llx.log", (unsigned long long)first);
    /* Deleting a segment's file can take the kernel many milliseconds; here it takes until the
     * test lets it go. The retirement and every acknowledgement after it must not wait. */
    io_sim_hold_unlinks(sim, 1);
    cr_assert_eq(idem_compact(s, 20000), IDEM_OK);
    for (int i = 0; i < 20; i++) {
        char key[32];
        int64_t token;
        snprintf(key, sizeof key, "after-%d", i);
        claim_commit(q, key, 3600000, &token);
    }
    store_lock(s);
    cr_assert_gt(s->sb.wal_first_seq, first, "nothing retired");
    store_unlock(s);
    cr_assert(sim_has(sim, seg), "the delete did not wait: the test proves nothing");
    io_sim_hold_unlinks(sim, 0);
    remover_drain(s->remover);
    cr_assert(!sim_has(sim, seg), "%s not deleted", seg);
    idem_queue_close(q);
    cr_assert_eq(idem_close(s), IDEM_OK);
    io_sim_destroy(sim);
}

/* Found by a review of compaction: the remover's failed sync of the directory after its deletes
 * was logged and nothing more. A later sync of the directory, from a fresh descriptor, may not
 * report what was lost (the error is seen once), so the store went on acknowledging. */
/* A store whose compaction retired segments, their deletes held (io_sim_hold_unlinks). */
static idem_store *retired_with_deletes_held(struct io_sim *sim, idem_queue **q)
{
    idem_store *s = open_with_segments(sim, q);
    store_lock(s);
    uint64_t first = s->sb.wal_first_seq;
    store_unlock(s);
    io_sim_hold_unlinks(sim, 1);
    cr_assert_eq(idem_compact(s, 20000), IDEM_OK);
    store_lock(s);
    cr_assert_gt(s->sb.wal_first_seq, first, "nothing retired");
    store_unlock(s);
    return s;
}

Test(compact, a_failed_directory_sync_after_deletes_fails_the_store, .timeout = 60)
{
    struct io_sim *sim;
    cr_assert_eq(io_sim_create(41, &sim), 0);
    idem_queue *q;
    idem_store *s = retired_with_deletes_held(sim, &q);
    io_sim_fail_sync_dir(sim, -EIO); /* the remover's, once its deletes are let go */
    io_sim_hold_unlinks(sim, 0);
    remover_drain(s->remover);
    cr_assert_eq(remover_error(s->remover), -EIO, "another sync of the directory took the fault");
    idem_claim_args a = {.ttl_ms = 3600000, .lease_ms = 1000};
    idem_completion c = {0};
    for (int i = 0; i < 500 && !idem_is_fatal(s); i++) {
        char key[32];
        snprintf(key, sizeof key, "after-%d", i);
        if (idem_claim(q, key, strlen(key), &a, &c) != IDEM_OK) break;
        usleep(2000);
    }
    cr_assert(idem_is_fatal(s), "the store went on after a failed directory sync");
    cr_assert(strstr(idem_fatal_reason(s), "after deleting retired files"), "reason: %s",
              idem_fatal_reason(s));
    cr_assert_eq(idem_claim(q, "later", 5, &a, &c), IDEM_EFATAL);
    idem_queue_close(q);
    cr_assert_eq(idem_close(s), IDEM_EFATAL);
    io_sim_destroy(sim);
}

/* A directory sync refused for space (btrfs, a commit without room for its metadata) is not the
 * disk failing: the remover tries it again a second later, as the flusher's own syncs are. */
Test(compact, a_directory_sync_after_deletes_refused_for_space_is_tried_again, .timeout = 60)
{
    struct io_sim *sim;
    cr_assert_eq(io_sim_create(43, &sim), 0);
    idem_queue *q;
    idem_store *s = retired_with_deletes_held(sim, &q);
    struct io_sim_counts before, after;
    io_sim_counts(sim, &before);
    io_sim_fail_sync_dir(sim, -ENOSPC);
    int64_t let_go_us = util_monotonic_us();
    io_sim_hold_unlinks(sim, 0);
    /* The files are deleted: their room is free while the sync waits (idem_compact waited for
     * ever on a full disk when the wait counted as files pending). */
    int pending = 1;
    for (int i = 0; i < 90 && (pending = remover_pending(s->remover)); i++)
        usleep(10 * 1000);
    cr_assert(!pending, "the deletes counted as pending while their directory sync waited");
    remover_drain(s->remover); /* returns once a sync succeeded */
    /* The remover's sync took the refusal (the fault is one-shot, any caller's): it waited its
     * second before the next. */
    cr_assert_geq(util_monotonic_us() - let_go_us, 900 * 1000,
                  "the remover did not wait: another sync of the directory took the refusal");
    io_sim_counts(sim, &after);
    cr_assert_geq(after.dir_syncs, before.dir_syncs + 1, "no sync made after the refused one");
    cr_assert_eq(remover_error(s->remover), 0);
    cr_assert(!idem_is_fatal(s), "%s", idem_fatal_reason(s));
    idem_claim_args a = {.ttl_ms = 3600000, .lease_ms = 1000};
    idem_completion c = {0};
    cr_assert_eq(idem_claim(q, "after", 5, &a, &c), IDEM_OK);
    cr_assert_eq(c.outcome, IDEM_NEW);
    idem_queue_close(q);
    cr_assert_eq(idem_close(s), IDEM_OK);
    io_sim_destroy(sim);
}

/* Claims key (committed) again n times: repeats, counted in memory, not logged. */
static void repeat_claims(idem_queue *q, const char *key, int n)
{
    idem_claim_args a = {.ttl_ms = 86400000, .lease_ms = 1000};
    idem_completion c;
    for (int i = 0; i < n; i++) {
        cr_assert_eq(idem_claim(q, key, strlen(key), &a, &c), IDEM_OK);
        cr_assert_eq(c.outcome, IDEM_DONE);
    }
}

static uint64_t seen_count(idem_queue *q, const char *key)
{
    idem_completion c;
    cr_assert_eq(idem_get(q, key, strlen(key), &c), IDEM_OK);
    cr_assert(c.found, "%s lost", key);
    return c.record.seen_count;
}

/* A compaction copy is the version it copies, and its frame holds the repeat counters of that
 * version's writing. A checkpoint taken after the repeats holds their counts; replay after a
 * crash met the copy past the checkpoint's position and took the counts of its frame (1 here,
 * not 6). Replay of a copy of the version the key has keeps the counters. */
Test(compact, a_copy_keeps_the_repeat_counters_of_its_version_after_a_crash, .timeout = 60)
{
    struct io_sim *sim;
    cr_assert_eq(io_sim_create(31, &sim), 0);
    idem_store *s = open_sim(sim);
    idem_queue *q;
    cr_assert_eq(idem_queue_open(s, 256, &q), IDEM_OK);
    struct kept kept[1];
    make_kept(q, kept, 1, "counted"); /* in the first segment, among keys that expire */
    int next = 0;
    fill_segments(q, s, &next, 2);
    repeat_claims(q, kept[0].key, 5);
    uint64_t seen = seen_count(q, kept[0].key);
    cr_assert_eq(seen, 6);
    run_checkpoint_to_the_end(s); /* holds the counts; the flusher takes no more by itself */
    cr_assert_eq(idem_clock_advance(s, 2000), IDEM_OK);
    for (int i = 0; i < 1000 && walked_waiting(s) == 0; i++) {
        cr_assert_eq(idem_sync(s), IDEM_OK);
        usleep(2000);
    }
    cr_assert_gt(walked_waiting(s), 0, "the first segment was never walked");
    cr_assert_eq(idem_sync(s), IDEM_OK); /* the copy is durable */
    idem_stats st;
    idem_get_stats(s, &st);
    cr_assert_eq(st.compactions, 0, "a walked segment was retired (no checkpoint was asked)");
    cr_assert_eq(seen_count(q, kept[0].key), seen, "the copy changed the counters in memory");
    idem_queue_close(q);
    store_abandon(s);
    io_sim_crash(sim, 0);
    s = open_sim(sim);
    cr_assert_eq(idem_queue_open(s, 4, &q), IDEM_OK);
    check_kept(s, q, kept, 1);
    uint64_t after = seen_count(q, kept[0].key);
    cr_assert_eq(after, seen, "seen_count %llu after the crash, %llu in the checkpoint",
                 (unsigned long long)after, (unsigned long long)seen);
    idem_queue_close(q);
    cr_assert_eq(idem_close(s), IDEM_OK);
    io_sim_destroy(sim);
}

/* One step of compaction runs under the store's lock, checksumming each frame it walks and
 * copying the live ones: 512 frames of 1 MiB results held the lock for 170-200 ms. A step
 * ends once it has walked 1 MiB of frames. Here a 4 MiB segment of 256 KiB results expires
 * whole; with completions held, the flusher stops at the flush of what the first step wrote,
 * and the walk stands where that step left it: past 1 MiB, short of 1 MiB and a record more.
 * The first step walked the whole segment (about 15 records). */
Test(compact, a_step_ends_after_a_mebibyte_of_frames, .timeout = 60)
{
    enum { VALUE = 256 << 10, SEG = 4 << 20 };
    struct io_sim *sim;
    cr_assert_eq(io_sim_create(37, &sim), 0);
    idem_options o;
    idem_options_init(&o);
    o.test_clock = 1;
    o.segment_bytes = SEG;
    o.result_bytes_max = VALUE;
    idem_store *s = NULL;
    cr_assert_eq(store_open_io(SIM_DIR, &o, io_sim_io(sim), 1, &s), IDEM_OK, "%s",
                 idem_last_error());
    idem_queue *q;
    cr_assert_eq(idem_queue_open(s, 4, &q), IDEM_OK);
    uint8_t *value = tu_random_bytes(VALUE, 37); /* nothing for lz4 to save */
    uint64_t first = cur_seq(s);
    for (int i = 0; cur_seq(s) < first + 2; i++) { /* the first segment sealed, and the next */
        cr_assert_lt(i, 100, "the log does not grow");
        char key[32];
        snprintf(key, sizeof key, "big-%d", i);
        idem_completion c;
        cr_assert_eq(idem_set_if_absent(q, key, strlen(key), value, VALUE, 1000, 0, &c), IDEM_OK);
    }
    free(value);
    cr_assert_eq(idem_sync(s), IDEM_OK);
    int spare = 0; /* made before completions are held: its header is written and waited for */
    for (int i = 0; i < 5000 && !spare; i++) {
        store_lock(s);
        spare = !wal_spare_needed(s->wal);
        if (!spare) store_kick(s);
        store_unlock(s);
        if (!spare) usleep(1000);
    }
    cr_assert(spare, "the spare segment was never made");
    io_sim_hold(sim, 1);
    cr_assert_eq(idem_clock_advance(s, 2000), IDEM_OK); /* every record expired */
    store_lock(s);
    store_kick(s); /* not after the idle flusher's second of sleep */
    store_unlock(s);
    int flushing = 0;
    for (int i = 0; i < 5000 && !flushing; i++) {
        usleep(1000);
        store_lock(s);
        flushing = s->flushing;
        store_unlock(s);
    }
    store_lock(s);
    uint64_t seq = s->cmp_seq, walked = s->cmp_walked;
    uint32_t off = s->cmp_off;
    store_unlock(s);
    io_sim_hold(sim, 0);
    cr_assert(flushing, "the flusher never flushed what compaction wrote");
    cr_assert_eq(walked, 0, "the first step walked segment %llu whole (%u bytes)",
                 (unsigned long long)walked, SEG);
    cr_assert_eq(seq, first, "the walk is in segment %llu", (unsigned long long)seq);
    cr_assert_geq(off - 4096, 1u << 20, "the step ended after %u bytes", off - 4096);
    cr_assert_leq(off - 4096, (1u << 20) + VALUE + 8192, "the step ended after %u bytes",
                  off - 4096);
    idem_queue_close(q);
    cr_assert_eq(idem_close(s), IDEM_OK);
    io_sim_destroy(sim);
}

/* The options of open_sim_seg, for a store on the real disk. */
static void disk_options(idem_options *o)
{
    idem_options_init(o);
    o->test_clock = 1;
    o->segment_bytes = 64 * 1024;
    o->result_bytes_max = 4096;
}

/* Opens (real disk) the store in dir with small segments and checks every kept key in it. */
static void expect_kept_in(const char *dir, const struct kept *kept, int n)
{
    idem_options o;
    disk_options(&o);
    idem_store *s;
    cr_assert_eq(idem_open(dir, &o, &s), IDEM_OK, "%s: %s", dir, idem_last_error());
    idem_queue *q;
    cr_assert_eq(idem_queue_open(s, 4, &q), IDEM_OK);
    check_kept(s, q, kept, n);
    idem_queue_close(q);
    cr_assert_eq(idem_close(s), IDEM_OK);
    idem_verify_report r;
    cr_assert_eq(idem_verify(dir, &r, NULL, NULL), IDEM_OK);
    cr_assert_eq(r.errors, 0, "%s: %s", dir, r.first_error);
}

/* Opens (real disk) the store in dir with small segments, and a queue on it. */
static void open_on_disk(const char *dir, idem_options *o, idem_store **s, idem_queue **q)
{
    cr_assert_not_null(dir);
    disk_options(o);
    cr_assert_eq(idem_open(dir, o, s), IDEM_OK, "%s", idem_last_error());
    cr_assert_eq(idem_queue_open(*s, 4, q), IDEM_OK);
}

/* Writes the store's superblock again naming seq as the log's first segment; returns the one it
 * named. */
static uint64_t super_name_first_segment(const char *dir, uint64_t seq)
{
    struct io *io;
    cr_assert_eq(io_thread_create(&io), 0);
    struct super sb;
    char err[512];
    cr_assert_eq(super_load(io, dir, &sb, 0, err, sizeof err), 0, "%s", err);
    uint64_t was = sb.wal_first_seq;
    sb.wal_first_seq = seq;
    cr_assert_eq(super_store(io, dir, &sb), 0);
    io_destroy(io);
    return was;
}

/* Found by a review of backup and restore: a superblock may name segments a retirement removed
 * (the open read the older copy, written before the retirement; or the files were removed by
 * hand), and the open skips them. A backup of such a store failed ("cannot read .../wal-...log")
 * until the next retirement, and a restore of it copied no segment at all and failed its check.
 * Both now copy from the first segment there is, and name it in the copy's superblock. */
Test(compact, a_store_whose_superblock_names_retired_segments_is_backed_up_and_restored,
     .timeout = 60)
{
    char *dir = tu_mkdtemp("retired");
    idem_options o;
    idem_store *s;
    idem_queue *q;
    open_on_disk(dir, &o, &s, &q);
    static struct kept kept[200];
    make_kept(q, kept, 200, "k");
    cr_assert_eq(idem_compact(s, 20000), IDEM_OK);
    idem_queue_close(q);
    cr_assert_eq(idem_close(s), IDEM_OK);
    /* The superblock as the copy written before the retirement has it: the log from segment 1. */
    cr_assert_gt(super_name_first_segment(dir, 1), 1, "nothing was retired");
    expect_kept_in(dir, kept, 200);

    char dest[600], restored[600], cmd[1300];
    snprintf(dest, sizeof dest, "%s-backup", dir);
    snprintf(restored, sizeof restored, "%s-restored", dir);
    super_name_first_segment(dir, 1); /* the open above wrote the first there is */
    cr_assert_eq(idem_open(dir, &o, &s), IDEM_OK, "%s", idem_last_error());
    cr_assert_eq(idem_backup(s, dest), IDEM_OK, "%s", idem_last_error());
    cr_assert_eq(idem_close(s), IDEM_OK);
    expect_kept_in(dest, kept, 200);
    /* The stopped store itself, restored, its superblock naming segment 1. */
    super_name_first_segment(dir, 1);
    cr_assert_eq(idem_restore(dir, restored), IDEM_OK, "%s", idem_last_error());
    expect_kept_in(restored, kept, 200);
    snprintf(cmd, sizeof cmd, "rm -rf '%s' '%s'", dest, restored);
    cr_assert_eq(system(cmd), 0);
    tu_rmtree(dir);
}

/* The bytes of DIR/name, or NULL when there is no such file; *len set. */
static uint8_t *file_bytes(const char *dir, const char *name, size_t *len)
{
    char path[600];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    FILE *f = fopen(path, "rb");
    if (!f) return NULL;
    static uint8_t buf[64 * 1024];
    *len = fread(buf, 1, sizeof buf, f);
    fclose(f);
    return buf;
}

static void file_put(const char *dir, const char *name, const uint8_t *b, size_t len)
{
    char path[600];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    FILE *f = fopen(path, "wb");
    cr_assert_not_null(f, "%s", path);
    cr_assert_eq(fwrite(b, 1, len, f), len);
    cr_assert_eq(fclose(f), 0);
}

/* Found by a review of recovery: a segment left behind before a missing one (a retirement's
 * unlinks reaching the disk out of order, then a crash; or a file put back by hand) is out of
 * the log. But the open went on naming it in its superblock, so it was never removed; a restore
 * copied it; and when its header was damaged the open refused the store, which verify passed.
 * Now the open's superblock names the first segment the log holds and the stray goes, a restore
 * leaves it, and a damaged one is no reason to refuse. */
Test(compact, a_segment_left_before_a_missing_one_is_removed_never_copied_never_read, .timeout = 60)
{
    char *dir = tu_mkdtemp("stray");
    idem_options o;
    idem_store *s;
    idem_queue *q;
    open_on_disk(dir, &o, &s, &q);
    const char *seg1 = "wal-0000000000000001.log";
    static uint8_t stray[64 * 1024];
    size_t len = 0;
    uint8_t *b = file_bytes(dir, seg1, &len);
    cr_assert(b && len == sizeof stray, "segment 1: %zu bytes", len);
    memcpy(stray, b, len);
    static struct kept kept[200];
    make_kept(q, kept, 200, "k");
    cr_assert_eq(idem_compact(s, 20000), IDEM_OK);
    idem_queue_close(q);
    cr_assert_eq(idem_close(s), IDEM_OK);
    cr_assert_null(file_bytes(dir, "wal-0000000000000002.log", &len), "segment 2 not retired");
    /* Segment 1 back, before the missing 2, and the superblock naming it. */
    file_put(dir, seg1, stray, sizeof stray);
    uint64_t first = super_name_first_segment(dir, 1);
    cr_assert_gt(first, 2);

    char restored[600], cmd[700];
    snprintf(restored, sizeof restored, "%s-restored", dir);
    cr_assert_eq(idem_restore(dir, restored), IDEM_OK, "%s", idem_last_error());
    cr_assert_null(file_bytes(restored, seg1, &len), "the restore copied the stray segment");
    expect_kept_in(restored, kept, 200);

    /* Its header damaged: the open does not read it, as verify does not. */
    stray[20] ^= 0x40;
    file_put(dir, seg1, stray, sizeof stray);
    expect_kept_in(dir, kept, 200);
    cr_assert_null(file_bytes(dir, seg1, &len), "the open left the stray segment");
    cr_assert_eq(super_name_first_segment(dir, first), first,
                 "the superblock does not name the log's first segment");
    expect_kept_in(dir, kept, 200);

    /* A damaged segment the log holds is still refused by both. */
    char name[64];
    snprintf(name, sizeof name, "wal-%016llx.log", (unsigned long long)first);
    uint8_t *f = file_bytes(dir, name, &len);
    cr_assert(f && len == sizeof stray, "%s", name);
    memcpy(stray, f, len);
    stray[20] ^= 0x40;
    file_put(dir, name, stray, sizeof stray);
    cr_assert_eq(idem_open(dir, &o, &s), IDEM_ECORRUPT, "a damaged segment was passed over");
    idem_verify_report r;
    cr_assert_eq(idem_verify(dir, &r, NULL, NULL), IDEM_OK);
    cr_assert_gt(r.errors, 0, "verify passed a damaged segment");
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", restored);
    cr_assert_eq(system(cmd), 0);
    tu_rmtree(dir);
}
