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
#include "store.h"
#include "testutil.h"

#define SIM_DIR "/sim/store"

static idem_store *open_sim(struct io_sim *sim)
{
    idem_options o;
    idem_options_init(&o);
    o.test_clock = 1;
    o.segment_bytes = 64 * 1024;
    o.result_bytes_max = 4096;
    idem_store *s = NULL;
    cr_assert_eq(store_open_io(SIM_DIR, &o, io_sim_io(sim), 1, &s), IDEM_OK, "%s",
                 idem_last_error());
    return s;
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

Test(compact, expired_keys_leave_memory_and_disk_live_ones_survive_intact, .timeout = 120)
{
    struct io_sim *sim;
    cr_assert_eq(io_sim_create(7, &sim), 0);
    idem_store *s = open_sim(sim);
    idem_queue *q;
    cr_assert_eq(idem_queue_open(s, 4, &q), IDEM_OK);
    /* Long-lived keys, written first: they sit in the oldest segments. */
    struct kept kept[20];
    for (int i = 0; i < 20; i++) {
        snprintf(kept[i].key, sizeof kept[i].key, "long-%d", i);
        claim_commit(q, kept[i].key, 86400000, &kept[i].token);
        idem_completion c;
        cr_assert_eq(idem_get(q, kept[i].key, strlen(kept[i].key), &c), IDEM_OK);
        kept[i].first_seen = c.record.first_seen_ms;
        kept[i].version = c.record.version;
    }
    /* Many rounds of short-lived keys that expire. */
    for (int round = 0; round < 40; round++) {
        for (int i = 0; i < 50; i++) {
            char key[32];
            int64_t t;
            snprintf(key, sizeof key, "short-%d-%d", round, i);
            claim_commit(q, key, 1000, &t);
        }
        cr_assert_eq(idem_clock_advance(s, 2000), IDEM_OK);
    }
    /* 2000 committed keys went through; 20 are alive. The log shrinks to a few segments. */
    settle(s, 8 * 64 * 1024);
    idem_stats st;
    idem_get_stats(s, &st);
    cr_assert_gt(st.compactions, 0);
    cr_assert_gt(st.expired_total, 0);
    cr_assert_lt(st.keys, 400, "expired keys stay in the index: %llu", (unsigned long long)st.keys);
    check_kept(s, q, kept, 20);
    /* A crash after compaction: the same. */
    idem_queue_close(q);
    store_abandon(s);
    io_sim_crash(sim, IO_SIM_CRASH_TEAR);
    s = open_sim(sim);
    cr_assert_eq(idem_queue_open(s, 4, &q), IDEM_OK);
    check_kept(s, q, kept, 20);
    idem_completion c;
    cr_assert_eq(idem_get(q, "short-0-0", 9, &c), IDEM_OK);
    cr_assert(!c.found, "an expired key came back");
    idem_queue_close(q);
    cr_assert_eq(idem_close(s), IDEM_OK);
    io_sim_destroy(sim);
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
        for (int i = 0; i < 10; i++) {
            snprintf(kept[i].key, sizeof kept[i].key, "keep-%d", i);
            claim_commit(q, kept[i].key, 86400000, &kept[i].token);
            idem_completion c;
            cr_assert_eq(idem_get(q, kept[i].key, strlen(kept[i].key), &c), IDEM_OK);
            kept[i].first_seen = c.record.first_seen_ms;
            kept[i].version = c.record.version;
        }
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
    struct kept kept[200];
    for (int i = 0; i < 200; i++) {
        snprintf(kept[i].key, sizeof kept[i].key, "k-%d", i);
        claim_commit(q, kept[i].key, 86400000, &kept[i].token);
        idem_completion c;
        cr_assert_eq(idem_get(q, kept[i].key, strlen(kept[i].key), &c), IDEM_OK);
        kept[i].first_seen = c.record.first_seen_ms;
        kept[i].version = c.record.version;
    }
    idem_stats before, after;
    idem_get_stats(s, &before);
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
