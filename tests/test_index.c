/*
 * test_index.c: the hash index of src/index.h against a simple model: insert/find/remove with
 * top-bit and full-hash collisions, growth to ~1 M entries, removal of everything, scans across
 * splits, slot contents through splits, eq behaviour and the hard limit.
 */
#include <criterion/criterion.h>
#include <signal.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "index.h"
#include "testutil.h"
#include "util.h"

/* eq context: the address the caller's key lives at (addresses identify keys in these tests). */
static int eq_addr(void *ctx, uint64_t addr)
{
    return addr == *(const uint64_t *)ctx;
}

static int eq_never(void *ctx, uint64_t addr)
{
    (void)addr;
    (*(int *)ctx)++;
    return 0;
}

static struct index_slot *find_addr(struct index *ix, uint64_t h, uint64_t addr)
{
    return index_find(ix, h, eq_addr, &addr);
}

static uint64_t mix(uint64_t x)
{
    uint64_t s = x;
    return tu_rand(&s);
}

/* Key k's hash: 60% random, 25% sharing the top 18 bits (deep local depth), 15% in groups of 4
 * keys with the same full 64-bit hash (eq decides). */
static uint64_t model_hash(uint64_t seed, uint64_t k)
{
    uint64_t r = mix(seed ^ (k * 0x9e3779b97f4a7c15ull));
    uint64_t cls = mix(seed + k / 4) % 100;
    if (cls < 60) return r;
    if (cls < 85) return (UINT64_C(0x2b3c5) << 46) | (r & ((UINT64_C(1) << 46) - 1));
    return mix(seed ^ 0x5555 ^ ((k / 4) << 20)) | 1;
}

struct model_key {
    uint64_t h;
    uint32_t aux;
    bool present;
};

static void model_check_all(struct index *ix, const struct model_key *keys, uint64_t n,
                            uint64_t present, uint64_t seed)
{
    cr_assert(index_check(ix), "index invariants (seed %llu)", (unsigned long long)seed);
    cr_assert_eq(index_count(ix), present, "count %llu != model %llu (seed %llu)",
                 (unsigned long long)index_count(ix), (unsigned long long)present,
                 (unsigned long long)seed);
    for (uint64_t k = 0; k < n; k++) {
        struct index_slot *s = find_addr(ix, keys[k].h, k + 1);
        if (!keys[k].present) {
            cr_assert_null(s, "key %llu found after removal (seed %llu)", (unsigned long long)k,
                           (unsigned long long)seed);
            continue;
        }
        cr_assert_not_null(s, "key %llu lost (seed %llu)", (unsigned long long)k,
                           (unsigned long long)seed);
        cr_assert_eq(index_slot_addr(s), k + 1);
        cr_assert_eq(s->aux, keys[k].aux, "aux of key %llu (seed %llu)", (unsigned long long)k,
                     (unsigned long long)seed);
        cr_assert_eq(index_slot_hash_bits(s), keys[k].h & ~(UINT64_C(0xff) << 32));
    }
    /* index_holds ignores the hash's low 16 bits (the age heaps do not keep them). */
    for (uint64_t k = 0; k < n; k++) {
        uint64_t h = keys[k].h ^ (mix(seed + k) & 0xffff);
        cr_assert_eq(index_holds(ix, h, k + 1), keys[k].present,
                     "index_holds of key %llu (seed %llu)", (unsigned long long)k,
                     (unsigned long long)seed);
        cr_assert_eq(index_holds(ix, h, n + 1 + k), 0);
    }
}

/* What a doubling of the directory in steps went through, watched after every operation:
 * operations while one was under way, growth steps that moved entries and left some, doublings
 * that growth steps finished (a next doubling finishing one does not count). */
struct dir_watch {
    uint64_t doubling, progress, finished;
    size_t last;
};

static void dir_watch(struct dir_watch *w, const struct index *ix)
{
    size_t unmoved = index_dir_unmoved(ix);
    w->doubling += unmoved > 0;
    if (unmoved < w->last) {
        if (unmoved > 0)
            w->progress++;
        else
            w->finished++;
    }
    w->last = unmoved;
}

/* Random inserts, finds, aux updates and removals against the model, on model_hash's clustered
 * hashes or on uniform ones; move_step 0 keeps the index's own step for moving directory
 * entries while it doubles. */
static struct dir_watch random_ops(const char *name, size_t move_step, bool uniform)
{
    uint64_t seed = tu_seed(name);
    uint64_t rng = seed;
    uint64_t n = 20000;
    uint64_t ops = tu_count(200000, 5000000);
    struct model_key *keys = calloc(n, sizeof(*keys));
    cr_assert_not_null(keys);
    for (uint64_t k = 0; k < n; k++)
        keys[k].h = uniform ? mix(seed ^ (k * 0x9e3779b97f4a7c15ull)) : model_hash(seed, k);
    struct index *ix;
    cr_assert_eq(index_create(0, &ix), 0);
    if (move_step) index_set_dir_move_step(ix, move_step);
    uint64_t present = 0;
    struct dir_watch w = {0};
    for (uint64_t op = 0; op < ops; op++) {
        dir_watch(&w, ix);
        uint64_t k = tu_rand(&rng) % n;
        struct model_key *m = &keys[k];
        struct index_slot *s = find_addr(ix, m->h, k + 1);
        uint32_t r = (uint32_t)tu_rand(&rng);
        if (!m->present) {
            cr_assert_null(s, "op %llu: absent key %llu found (seed %llu)", (unsigned long long)op,
                           (unsigned long long)k, (unsigned long long)seed);
            if (r % 4 == 0) continue; /* lookups of absent keys only */
            cr_assert_not_null(index_insert(ix, m->h, k + 1, r));
            m->aux = r;
            m->present = true;
            present++;
            continue;
        }
        cr_assert_not_null(s, "op %llu: key %llu lost (seed %llu)", (unsigned long long)op,
                           (unsigned long long)k, (unsigned long long)seed);
        cr_assert_eq(s->aux, m->aux, "op %llu: aux (seed %llu)", (unsigned long long)op,
                     (unsigned long long)seed);
        if (r % 3 == 0) {
            s->aux = r;
            m->aux = r;
        } else if (r % 3 == 1 && (op / 50000) % 2 == 0) {
            index_remove(ix, s);
            m->present = false;
            present--;
        } else if (r % 3 == 1) {
            /* In alternate phases remove less, so the population swings. */
            if (r % 9 == 1) {
                index_remove(ix, s);
                m->present = false;
                present--;
            }
        }
        if (op % 50000 == 0 || (move_step && index_dir_unmoved(ix) && op % 997 == 0))
            model_check_all(ix, keys, n, present, seed);
    }
    model_check_all(ix, keys, n, present, seed);
    index_destroy(ix);
    free(keys);
    return w;
}

Test(index, random_ops_match_model)
{
    random_ops("index.random_ops_match_model", 0, false);
}

static void expect_steps(struct dir_watch w, const char *what, bool finished_by_steps)
{
    fprintf(stderr,
            "index: %s: %llu ops while doubling, %llu steps moved entries, %llu doublings "
            "finished by steps\n",
            what, (unsigned long long)w.doubling, (unsigned long long)w.progress,
            (unsigned long long)w.finished);
    cr_assert_gt(w.doubling, 100, "%s: doublings spanned %llu operations", what,
                 (unsigned long long)w.doubling);
    cr_assert_gt(w.progress, 10, "%s: growth steps moved directory entries %llu times", what,
                 (unsigned long long)w.progress);
    if (finished_by_steps) cr_assert_gt(w.finished, 0, "%s: no doubling finished by steps", what);
}

/* Doublings that take many growth steps: lookups, inserts, removals, grows and splits (and a
 * next doubling, which finishes the one under way) meet old entries not moved yet. The clustered
 * hashes reach depth 21, where the next doubling mostly comes before growth steps finish one;
 * on uniform hashes growth steps finish them. */
Test(index, random_ops_match_model_while_the_directory_doubles_in_steps)
{
    expect_steps(random_ops("index.random_ops_doubling_in_steps_of_1", 1, false),
                 "clustered, step 1", false);
    expect_steps(random_ops("index.random_ops_doubling_in_steps_of_3", 3, false),
                 "clustered, step 3", false);
    expect_steps(random_ops("index.random_ops_doubling_uniform_step_1", 1, true), "uniform, step 1",
                 true);
}

Test(index, growth_to_1m_keeps_every_entry)
{
    uint64_t n = tu_count(1000000, 10000000);
    uint64_t seed = tu_seed("index.growth_to_1m_keeps_every_entry");
    struct index *ix;
    cr_assert_eq(index_create(0, &ix), 0);
    index_set_dir_move_step(ix, 16); /* doublings from 32 entries on span growth steps */
    /* splitmix64 is a bijection: distinct inputs give distinct hashes. */
    struct dir_watch w = {0};
    for (uint64_t i = 0; i < n; i++) {
        cr_assert_not_null(index_insert(ix, mix(seed + i), i + 1, (uint32_t)(i * 7)));
        dir_watch(&w, ix);
    }
    cr_assert_eq(index_count(ix), n);
    cr_assert(index_check(ix));
    expect_steps(w, "growth", true);
    for (uint64_t i = 0; i < n; i++) {
        struct index_slot *s = find_addr(ix, mix(seed + i), i + 1);
        cr_assert_not_null(s, "entry %llu lost (seed %llu)", (unsigned long long)i,
                           (unsigned long long)seed);
        cr_assert_eq(s->aux, (uint32_t)(i * 7));
    }
    double bytes_per_key = (double)index_live_bytes(ix) / (double)n;
    double held_per_key = (double)index_memory_bytes(ix) / (double)n;
    fprintf(stderr,
            "index: %llu keys: %.2f B/key of slots, %.2f held, max split pause %llu us, "
            "%llu steps, 99.9%% within %llu us of CPU\n",
            (unsigned long long)n, bytes_per_key, held_per_key,
            (unsigned long long)index_max_split_us(ix), (unsigned long long)index_splits(ix),
            (unsigned long long)index_split_cpu_quantile_us(ix, 999));
    /* Every split adds a segment; grows and doublings are steps too. */
    cr_expect_geq(index_splits(ix), index_segments(ix) - 1);
    cr_expect_leq(index_split_cpu_quantile_us(ix, 500), index_split_cpu_quantile_us(ix, 999));
    cr_expect_leq(bytes_per_key, 24.5);
    cr_expect_leq(held_per_key, 30.0);
    index_destroy(ix);
}

/* index_insert_growth (with no room: exact) says what an insert adds to index_live_bytes, which a
 * memory limit is held to (ops.c): exactly, for a grow and for a split (with the directory it
 * doubles), unless the rebuild's step of a doubling under way ends it (the old directory freed:
 * less). It used to count each half of a split as large as the segment it replaces, refusing keys
 * up to about 12 KiB early. Removals leave freed slots the next inserts take (0 added). */
Test(index, insert_growth_is_what_the_insert_adds)
{
    uint64_t n = tu_count(300000, 2000000);
    uint64_t seed = tu_seed("index.insert_growth_is_what_the_insert_adds");
    struct index *ix;
    cr_assert_eq(index_create(0, &ix), 0);
    index_set_dir_move_step(ix, 64);
    uint64_t grows = 0, splits = 0, doublings = 0, less = 0;
    for (uint64_t i = 0; i < n; i++) {
        uint64_t h = mix(seed + i);
        size_t g = index_insert_growth(ix, h, 0), before = index_live_bytes(ix);
        /* with room for it, a bound from above may be given without counting */
        cr_assert_geq(index_insert_growth(ix, h, SIZE_MAX), g);
        uint64_t segs = index_segments(ix);
        int doubling = index_dir_unmoved(ix) > 0;
        cr_assert_not_null(index_insert(ix, h, i + 1, 0));
        size_t after = index_live_bytes(ix);
        uint64_t new_segs = index_segments(ix) - segs;
        cr_assert(new_segs <= 1, "a second split at insert %llu (seed %llu)", (unsigned long long)i,
                  (unsigned long long)seed);
        if (after - before == g) {
            grows += g && !new_segs;
            splits += new_segs;
            doublings += new_segs && index_dir_unmoved(ix) > 0 && !doubling;
        } else {
            cr_assert(doubling && after < before + g,
                      "insert %llu added %zu bytes, %zu said (seed %llu)", (unsigned long long)i,
                      after - before, g, (unsigned long long)seed);
            less++;
        }
        if (i % 5 == 4) { /* a removal: its slot is taken again, with nothing added */
            struct index_slot *s = find_addr(ix, mix(seed + i - 2), i - 1);
            cr_assert_not_null(s);
            index_remove(ix, s);
            uint64_t h2 = mix(seed + i - 2);
            cr_assert_eq(index_insert_growth(ix, h2, 0), 0);
            before = index_live_bytes(ix);
            cr_assert_not_null(index_insert(ix, h2, i - 1, 0));
            cr_assert_eq(index_live_bytes(ix), before);
        }
    }
    fprintf(stderr,
            "index: %llu inserts: %llu grows and %llu splits (%llu doubling) as said, "
            "%llu less (a doubling ended)\n",
            (unsigned long long)n, (unsigned long long)grows, (unsigned long long)splits,
            (unsigned long long)doublings, (unsigned long long)less);
    cr_assert_gt(splits, 100);
    cr_assert_gt(doublings, 3);
    cr_assert_gt(grows, 1000);
    cr_assert(index_check(ix));
    index_destroy(ix);
}

Test(index, removing_everything_leaves_count_zero_and_memory_bounded)
{
    uint64_t n = 200000;
    uint64_t seed = tu_seed("index.removing_everything");
    struct index *ix;
    cr_assert_eq(index_create(0, &ix), 0);
    for (uint64_t i = 0; i < n; i++)
        cr_assert_not_null(index_insert(ix, mix(seed + i), i + 1, 0));
    size_t peak = index_memory_bytes(ix);
    for (uint64_t i = 0; i < n; i++) {
        struct index_slot *s = find_addr(ix, mix(seed + i), i + 1);
        cr_assert_not_null(s);
        index_remove(ix, s);
        cr_assert_null(find_addr(ix, mix(seed + i), i + 1));
        if (i == n / 2) cr_assert(index_check(ix));
    }
    cr_assert(index_check(ix));
    cr_assert_eq(index_count(ix), 0);
    cr_assert_leq(index_memory_bytes(ix), peak);
    /* The same population fits again without growing. */
    for (uint64_t i = 0; i < n; i++)
        cr_assert_not_null(index_insert(ix, mix(seed + i), i + 1, 0));
    cr_assert_eq(index_count(ix), n);
    cr_assert_leq(index_memory_bytes(ix), peak);
    index_destroy(ix);
}

struct scan_state {
    uint8_t *seen; /* per address */
    uint64_t n_addr;
    uint64_t visits;
};

static void scan_mark(void *ctx, struct index_slot *slot)
{
    struct scan_state *st = ctx;
    uint64_t addr = index_slot_addr(slot);
    cr_assert(addr >= 1 && addr <= st->n_addr);
    st->seen[addr - 1] = 1;
    st->visits++;
}

Test(index, scan_visits_every_entry_across_splits)
{
    uint64_t seed = tu_seed("index.scan_visits_every_entry_across_splits");
    uint64_t initial = 50000, extra = 150000;
    struct index *ix;
    cr_assert_eq(index_create(0, &ix), 0);
    index_set_dir_move_step(ix, 2); /* scans meet doublings under way */
    for (uint64_t i = 0; i < initial; i++)
        cr_assert_not_null(index_insert(ix, model_hash(seed, i), i + 1, 0));
    struct scan_state st = {.seen = calloc(initial + extra, 1), .n_addr = initial + extra};
    uint64_t next = initial, cursor = 0, calls = 0, removed = 0;
    uint64_t rng = seed;
    do {
        cursor = index_scan(ix, cursor, 1 + (uint32_t)(tu_rand(&rng) % 64), scan_mark, &st);
        calls++;
        /* Between calls: inserts (splits, grows, doublings) and removals of added entries. */
        for (int j = 0; j < 40 && next < initial + extra; j++, next++)
            cr_assert_not_null(index_insert(ix, model_hash(seed, next), next + 1, 0));
        if (next > initial + removed + 10 && tu_rand(&rng) % 2 == 0) {
            uint64_t k = initial + removed++;
            struct index_slot *s = find_addr(ix, model_hash(seed, k), k + 1);
            cr_assert_not_null(s);
            index_remove(ix, s);
        }
        cr_assert_lt(calls, 10000000, "scan does not end");
    } while (cursor != 0);
    for (uint64_t i = 0; i < initial; i++)
        cr_assert(st.seen[i], "entry %llu not visited (seed %llu)", (unsigned long long)i,
                  (unsigned long long)seed);
    fprintf(stderr, "index scan: %llu calls, %llu visits of %llu initial entries, %llu grown\n",
            (unsigned long long)calls, (unsigned long long)st.visits, (unsigned long long)initial,
            (unsigned long long)(next - initial));
    /* A scan without concurrent change visits each entry exactly once. */
    struct scan_state st2 = {.seen = calloc(initial + extra, 1), .n_addr = initial + extra};
    cursor = 0;
    do {
        cursor = index_scan(ix, cursor, 97, scan_mark, &st2);
    } while (cursor != 0);
    cr_assert_eq(st2.visits, index_count(ix));
    free(st.seen);
    free(st2.seen);
    index_destroy(ix);
}

static void scan_rewrite(void *ctx, struct index_slot *slot)
{
    (void)ctx;
    uint64_t addr = index_slot_addr(slot);
    index_slot_set_addr(slot, addr + 1000000);
    slot->aux = (uint32_t)(addr ^ 0xabcdef);
}

Test(index, addr_and_aux_survive_splits)
{
    uint64_t seed = tu_seed("index.addr_and_aux_survive_splits");
    uint64_t n = 20000, more = 100000;
    struct index *ix;
    cr_assert_eq(index_create(0, &ix), 0);
    for (uint64_t i = 0; i < n; i++)
        cr_assert_not_null(index_insert(ix, model_hash(seed, i), i + 1, 0));
    /* fn may change addr and aux; every entry is rewritten once by a scan without changes. */
    uint64_t cursor = 0;
    do {
        cursor = index_scan(ix, cursor, 1000, scan_rewrite, NULL);
    } while (cursor != 0);
    for (uint64_t i = n; i < n + more; i++)
        cr_assert_not_null(index_insert(ix, model_hash(seed, i + 5000000), i + 1, 0));
    for (uint64_t i = 0; i < n; i++) {
        struct index_slot *s = find_addr(ix, model_hash(seed, i), i + 1 + 1000000);
        cr_assert_not_null(s, "entry %llu lost (seed %llu)", (unsigned long long)i,
                           (unsigned long long)seed);
        cr_assert_eq(s->aux, (uint32_t)((i + 1) ^ 0xabcdef));
    }
    index_destroy(ix);
}

Test(index, eq_decides_between_equal_hashes)
{
    struct index *ix;
    cr_assert_eq(index_create(0, &ix), 0);
    uint64_t h = 0x0123456789abcdefull;
    cr_assert_not_null(index_insert(ix, h, 1, 11));
    cr_assert_not_null(index_insert(ix, h, 2, 22));
    cr_assert_not_null(index_insert(ix, h, 3, 33));
    int calls = 0;
    cr_assert_null(index_find(ix, h, eq_never, &calls));
    cr_assert_eq(calls, 3, "eq is called for each stored-hash match");
    /* Different stored bits: eq is never called. */
    calls = 0;
    cr_assert_null(index_find(ix, h ^ 1, eq_never, &calls));
    cr_assert_null(index_find(ix, h ^ (UINT64_C(1) << 63), eq_never, &calls));
    cr_assert_eq(calls, 0);
    /* Bits 32..39 are not stored: a hash differing only there reaches eq, which decides. */
    calls = 0;
    cr_assert_null(index_find(ix, h ^ (UINT64_C(1) << 35), eq_never, &calls));
    cr_assert_eq(calls, 3);
    struct index_slot *s = find_addr(ix, h, 2);
    cr_assert_not_null(s);
    cr_assert_eq(s->aux, 22);
    index_remove(ix, s);
    cr_assert_null(find_addr(ix, h, 2));
    cr_assert_eq(find_addr(ix, h, 1)->aux, 11);
    cr_assert_eq(find_addr(ix, h, 3)->aux, 33);
    cr_assert_eq(index_count(ix), 2);
    index_destroy(ix);
}

Test(index, presized_index_does_not_grow)
{
    uint64_t seed = tu_seed("index.presized_index_does_not_grow");
    uint64_t n = 100000;
    struct index *ix;
    cr_assert_eq(index_create(n, &ix), 0);
    size_t before = index_memory_bytes(ix);
    for (uint64_t i = 0; i < n; i++)
        cr_assert_not_null(index_insert(ix, mix(seed + i), i + 1, 0));
    cr_assert_eq(index_memory_bytes(ix), before);
    cr_assert_eq(index_max_split_us(ix), 0);
    cr_assert_eq(index_splits(ix), 0);
    cr_assert_eq(index_split_cpu_quantile_us(ix, 999), 0);
    index_destroy(ix);
}

/* index_create_snug (a checkpoint's load): at 10 M keys about what growth reaches, 21 B/key
 * against index_create's 27; the few segments that overflow grow, and every key is found. */
Test(index, snug_index_is_smaller_and_holds_every_key)
{
    uint64_t seed = tu_seed("index.snug_index_is_smaller_and_holds_every_key");
    uint64_t n = 10000000;
    struct index *snug, *roomy;
    cr_assert_eq(index_create_snug(n, &snug), 0);
    cr_assert_eq(index_create(n, &roomy), 0);
    size_t before = index_memory_bytes(snug);
    cr_assert_lt(before, n * 22, "snug: %zu bytes for %llu keys", before, (unsigned long long)n);
    cr_assert_gt(index_memory_bytes(roomy), n * 26);
    index_destroy(roomy);
    for (uint64_t i = 0; i < n; i++)
        cr_assert_not_null(index_insert(snug, mix(seed + i), i + 1, 0));
    cr_assert_eq(index_count(snug), n);
    size_t after = index_memory_bytes(snug);
    cr_assert_lt(after - before, before / 100, "grew from %zu to %zu bytes", before, after);
    for (uint64_t i = 0; i < n; i += 7)
        cr_assert_not_null(find_addr(snug, mix(seed + i), i + 1), "key %llu lost",
                           (unsigned long long)i);
    index_destroy(snug);
}

Test(index, insert_of_address_zero_aborts, .signal = SIGABRT)
{
    struct index *ix;
    cr_assert_eq(index_create(0, &ix), 0);
    (void)index_insert(ix, 42, 0, 0);
}

/* Keys sharing all 24 directory bits drive one segment to local depth 24 (a 128 MiB directory):
 * it then fills to its hard limit and insert returns NULL. Long tier only for the memory. */
Test(index, same_top24_bits_fill_to_hard_limit_then_null)
{
    if (tu_count(0, 1) == 0) cr_skip_test("needs a 2^24-entry directory; run with IDEM_LONG=1");
    uint64_t seed = tu_seed("index.same_top24_bits_fill_to_hard_limit_then_null");
    struct index *ix;
    cr_assert_eq(index_create(0, &ix), 0);
    uint64_t i = 0;
    for (; i < 10000; i++) {
        uint64_t h = (UINT64_C(0xa5a5a5) << 40) | (mix(seed + i) >> 24);
        if (!index_insert(ix, h, i + 1, 0)) break;
    }
    cr_assert_lt(i, 10000);
    cr_assert_gt(i, 900); /* hard limit 15/16 of 1024 slots */
    cr_assert_eq(index_count(ix), i);
    for (uint64_t j = 0; j < i; j++)
        cr_assert_not_null(
            find_addr(ix, (UINT64_C(0xa5a5a5) << 40) | (mix(seed + j) >> 24), j + 1));
    index_destroy(ix);
}

/* Growth with the arena's thread faulting memory in ahead meanwhile, as in a store: the index
 * keeps every entry. Slots stay within 24 B/key; with the free space between blocks and what is
 * resident ahead, the index holds less than 30. (That blocks carved from memory the thread made
 * resident take no fault is index_arena/imem_thread_faults_memory_in_ahead: here the thread's
 * pace depends on what else the machine runs.) */
Test(index, growth_while_memory_is_faulted_in_ahead_keeps_every_entry, .timeout = 60)
{
    uint64_t n = 1000000;
    uint64_t seed = tu_seed("index.growth_while_memory_is_faulted_in_ahead_keeps_every_entry");
    struct index *ix;
    cr_assert_eq(index_create(0, &ix), 0);
    cr_assert_eq(index_start_ahead(ix), 0);
    for (uint64_t i = 0; i < n; i++)
        cr_assert_not_null(index_insert(ix, mix(seed + i), i + 1, 0));
    cr_assert(index_check(ix));
    for (uint64_t i = 0; i < n; i++)
        cr_assert_not_null(find_addr(ix, mix(seed + i), i + 1), "entry %llu lost (seed %llu)",
                           (unsigned long long)i, (unsigned long long)seed);
    double live = (double)index_live_bytes(ix) / (double)n;
    double held = (double)index_memory_bytes(ix) / (double)n;
    cr_expect_leq(live, 24.0, "%.2f B/key of slots", live);
    cr_expect_leq(held, 30.0, "%.2f B/key held", held);
    index_destroy(ix); /* stops the thread */
}

/* index_peek is a hint and looks 32 slots from the home; index_has_hash (the checkpoint loader's
 * duplicate check) must look along the whole run. */
Test(index, has_hash_finds_an_entry_past_where_peek_stops)
{
    struct index *ix;
    cr_assert_eq(index_create(0, &ix), 0);
    /* One home for all: the same top 24 bits and the same top bits of hash_lo. */
    const uint64_t base = UINT64_C(0x5a5a5a0000000000) | UINT64_C(0x7f000000);
    for (uint64_t i = 0; i < 40; i++)
        cr_assert_not_null(index_insert(ix, base | (i + 1), i + 1, 0));
    uint64_t last = base | 40;
    cr_assert(index_has_hash(ix, last));
    cr_assert_null(index_peek(ix, last), "the 40th entry of a run is past the hint's reach");
    cr_assert_not_null(index_peek(ix, base | 1));
    cr_assert_not_null(index_peek(ix, base | 32));
    cr_assert_not(index_has_hash(ix, base | 41));
    index_destroy(ix);
}

/* index_insert_ordered is index_insert for entries listed in index order (a checkpoint): the
 * same result in any order. Orders: sorted as a checkpoint lists them (top bits, then hash_lo),
 * sorted with neighbours swapped, random; with removals in between (which clear what a segment
 * remembers of its run) and ordinary inserts. */
static int by_index_order(const void *a, const void *b)
{
    const struct model_key *x = a, *y = b;
    uint64_t kx = (x->h & ~(UINT64_C(0xffffffffff))) | (uint32_t)x->h;
    uint64_t ky = (y->h & ~(UINT64_C(0xffffffffff))) | (uint32_t)y->h;
    return kx < ky ? -1 : kx > ky;
}

Test(index, ordered_inserts_in_any_order_keep_every_entry)
{
    uint64_t seed = tu_seed("index.ordered_inserts_in_any_order_keep_every_entry");
    for (int order = 0; order < 4; order++) {
        /* model_hash puts a quarter of the keys under one 18-bit prefix: 64 deepest segments
         * hold ~55,000 entries, so that order stays at random_ops_match_model's 20,000 keys. */
        uint64_t n = order == 3 ? 20000 : tu_count(60000, 1000000);
        uint64_t rng = seed + (uint64_t)order;
        struct model_key *keys = calloc(n, sizeof(*keys));
        cr_assert_not_null(keys);
        for (uint64_t k = 0; k < n; k++)
            keys[k].h = order == 3 ? model_hash(seed, k) : mix(seed ^ (k * 0x9e37ull));
        if (order <= 1) qsort(keys, n, sizeof(*keys), by_index_order);
        if (order == 1) /* homes a little out of order, as a checkpoint's scan lists them */
            for (uint64_t k = 0; k + 1 < n; k += 1 + tu_rand(&rng) % 3) {
                struct model_key t = keys[k];
                keys[k] = keys[k + 1];
                keys[k + 1] = t;
            }
        struct index *ix;
        cr_assert_eq(order == 2 ? index_create(0, &ix) : index_create_snug(n, &ix), 0);
        uint64_t present = 0;
        for (uint64_t k = 0; k < n; k++) {
            uint32_t r = (uint32_t)tu_rand(&rng);
            if (order >= 2 && r % 16 == 0) {
                cr_assert_not_null(index_insert(ix, keys[k].h, k + 1, 0));
            } else {
                cr_assert_not_null(index_insert_ordered(ix, keys[k].h, k + 1));
            }
            keys[k].present = true;
            present++;
            if (order >= 2 && r % 7 == 0 && k > 0) { /* remove an earlier key */
                uint64_t j = tu_rand(&rng) % k;
                if (keys[j].present) {
                    struct index_slot *s = find_addr(ix, keys[j].h, j + 1);
                    cr_assert_not_null(s, "order %d: key %llu lost (seed %llu)", order,
                                       (unsigned long long)j, (unsigned long long)seed);
                    index_remove(ix, s);
                    keys[j].present = false;
                    present--;
                }
            }
        }
        model_check_all(ix, keys, n, present, seed);
        index_destroy(ix);
        free(keys);
    }
}

/* A segment remembers the run of used slots its ordered inserts made, so the next one probes
 * from the run's end. A removal inside the run opens a slot (backward shift moves the hole to
 * the run's end): the next ordered insert must take it, or lookups would stop there first. */
Test(index, an_ordered_insert_after_a_removal_takes_the_freed_slot)
{
    struct index *ix;
    cr_assert_eq(index_create(0, &ix), 0);
    /* One segment, one home for all. */
    const uint64_t base = UINT64_C(0x3c3c3c0000000000) | UINT64_C(0x40000000);
    for (uint64_t i = 1; i <= 4; i++)
        cr_assert_not_null(index_insert_ordered(ix, base | i, i));
    index_remove(ix, find_addr(ix, base | 2, 2));
    cr_assert_not_null(index_insert_ordered(ix, base | 5, 5));
    cr_assert(index_check(ix));
    for (uint64_t i = 1; i <= 5; i++) {
        if (i == 2) continue;
        cr_assert_not_null(find_addr(ix, base | i, i), "entry %llu lost", (unsigned long long)i);
    }
    index_destroy(ix);
}
