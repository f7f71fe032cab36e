/*
 * ages.c: the records that need attention, kept apart so that the age of the oldest unfinished
 * record and the operator's attention list cost no scan of all keys: in_flight and review
 * records ordered by first_seen, and records with recorded mismatches by last_mismatch_ms.
 *
 * One min-heap per kind of 16-byte entries {time, log address of a version, 40 of the key's
 * hash bits} (struct age_entry). Every version written that belongs to a kind pushes an entry
 * (claims, recoveries, extends, holds, recorded mismatches, compaction copies, replay, checkpoint
 * load). Entries are checked lazily: one is valid while the index still points the key at that very
 * address and the record there still belongs to the kind with that time. Invalid entries are popped
 * when they reach the top, and a heap is rebuilt from its valid entries when it holds more than
 * twice the records of its kind (plus slack), so its size stays proportional to those records.
 *
 * On the write path that happens in steps: a heap past the bound starts a filtering pass, and
 * each push carries it AGES_FILTER_STEP entries further, removing the invalid ones as a heap
 * removes any element (the last one moved into the hole and sifted), so the heap stays a heap
 * between steps and no push pays for the whole heap (a rebuild at once took about 1 ms every
 * 18,000 claims with 1,000 in flight). The pass walks from the end, where removals are cheap.
 * Commits push nothing, so the flusher also takes steps between its rounds (ages_tidy): a burst of
 * claims committed since is filtered before a stats call finds it. A stats call that finds a heap
 * past its bound all the same carries the pass itself, AGES_VIEW_STEP entries per hold of the lock
 * (ages_settle). Filtering checks only the index: an entry stays while a slot with its hash bits
 * holds its address (a record never changes at its address, so it still has its kind and time).
 * That reads no log. The top of a heap and the entries of the attention list (a sorted copy of the
 * heaps, checked in steps by attention.c) are checked in full, record and key, before anything is
 * reported: a log address reused by a later segment for another record is never reported for the
 * old one.
 */
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>

#include "store.h"
#include "util.h"

/* Entries ahead whose index slot a rebuild fetches while it checks the current one. */
#define AGES_AHEAD 16

/* The entry's time_hi for a time t and hash h: ordered as t, with hash bits in the low 16. */
static uint64_t time_key(int64_t t, uint64_t h)
{
    if (t < -AGE_TIME_BIAS) t = -AGE_TIME_BIAS;
    if (t > AGE_TIME_BIAS - 1) t = AGE_TIME_BIAS - 1;
    return (uint64_t)(t + AGE_TIME_BIAS) << 16 | ((uint32_t)h >> 16);
}

static int64_t entry_time(const struct age_entry *e)
{
    return (int64_t)(e->time_hi >> 16) - AGE_TIME_BIAS;
}

/* The hash bits kept: the top 24 and the top 16 of the low 32 (index_holds ignores the rest). */
static uint64_t entry_hash(const struct age_entry *e)
{
    return (e->addr_tag & ~INDEX_ADDR_MASK) | (uint32_t)(e->time_hi & 0xffff) << 16;
}

static int64_t kind_time(const struct rec *r, int kind)
{
    return kind == AGE_MISMATCH ? r->last_mismatch_ms : r->first_seen_ms;
}

static int kind_has(const struct rec *r, int kind)
{
    switch (kind) {
    case AGE_IN_FLIGHT:
        return r->state == IDEM_STATE_IN_FLIGHT;
    case AGE_REVIEW:
        return r->state == IDEM_STATE_REVIEW;
    default:
        return r->mismatch_count > 0;
    }
}

static uint64_t entry_addr(const struct age_entry *e)
{
    return e->addr_tag & INDEX_ADDR_MASK;
}

/* Whether e was made for time t (its hash bits aside). */
static int entry_at(const struct age_entry *e, int64_t t)
{
    return time_key(t, 0) == (e->time_hi & ~UINT64_C(0xffff));
}

int ages_fits(int kind, const struct rec *r, const struct age_entry *e)
{
    return kind_has(r, kind) && entry_at(e, kind_time(r, kind));
}

int ages_same_record(int kind, const struct rec *r, const struct age_entry *e)
{
    return kind == AGE_MISMATCH || entry_at(e, r->first_seen_ms);
}

struct age_entry ages_entry_of(int kind, const struct rec *r, uint64_t h, uint64_t addr)
{
    return (struct age_entry){time_key(kind_time(r, kind), h), (h & ~INDEX_ADDR_MASK) | addr};
}

/* The full check: the record at the address has the kind and time, and its key leads there. */
static int entry_valid(idem_store *s, int kind, const struct age_entry *e)
{
    if (!wal_addr_valid(s->wal, entry_addr(e))) return 0;
    uint32_t len;
    uint64_t lsn;
    const uint8_t *p = wal_payload(s->wal, entry_addr(e), &len, &lsn);
    struct rec r, cur;
    if (!p || rec_decode(p, len, &r) < 0 || !ages_fits(kind, &r, e)) return 0;
    struct index_slot *slot = ops_find(s, r.key, r.key_len, &cur, &lsn);
    return slot && index_slot_addr(slot) == entry_addr(e);
}

/* The write path's check: the index still holds the address under the key's hash bits. */
static int entry_indexed(idem_store *s, int kind, const struct age_entry *e)
{
    (void)kind;
    return index_holds(s->ix, entry_hash(e), entry_addr(e));
}

/* entry_valid, after the index's answer: an entry the index no longer holds is stale without
 * reading the log (entry_valid implies entry_indexed), ~5x faster per stale entry. */
static int entry_current(idem_store *s, int kind, const struct age_entry *e)
{
    return entry_indexed(s, kind, e) && entry_valid(s, kind, e);
}

static void sift_up(struct age_heap *h, size_t i)
{
    while (i > 0) {
        size_t p = (i - 1) / 2;
        if (h->v[p].time_hi <= h->v[i].time_hi) break;
        struct age_entry t = h->v[p];
        h->v[p] = h->v[i];
        h->v[i] = t;
        i = p;
    }
}

static void sift_down(struct age_heap *h, size_t i)
{
    for (;;) {
        size_t l = 2 * i + 1, r = l + 1, m = i;
        if (l < h->n && h->v[l].time_hi < h->v[m].time_hi) m = l;
        if (r < h->n && h->v[r].time_hi < h->v[m].time_hi) m = r;
        if (m == i) return;
        struct age_entry t = h->v[m];
        h->v[m] = h->v[i];
        h->v[i] = t;
        i = m;
    }
}

/* Removes v[i], keeping the heap order: the last entry takes its place and sifts. Returns
 * whether it sifted up, so that v[i] now holds an entry from above i. */
static bool remove_at(struct age_heap *h, size_t i)
{
    h->v[i] = h->v[--h->n];
    if (i == h->n) return false;
    if (i > 0 && h->v[i].time_hi < h->v[(i - 1) / 2].time_hi) {
        sift_up(h, i);
        return true;
    }
    sift_down(h, i);
    return false;
}

static uint64_t kind_count(const idem_store *s, int kind)
{
    return kind == AGE_IN_FLIGHT ? s->st.keys_in_flight
           : kind == AGE_REVIEW  ? s->st.keys_review
                                 : s->st.keys_with_mismatch;
}

static void rebuild(idem_store *s, struct age_heap *h, int kind,
                    int (*keep)(idem_store *s, int kind, const struct age_entry *e))
{
    size_t k = 0;
    /* No unfinished record of the kind left (a burst of claims, all finished since): no entry
     * can be valid. Those counts are exact (store_check_index recounts them in the tests). */
    bool none = kind != AGE_MISMATCH && kind_count(s, kind) == 0;
    for (size_t i = 0; i < h->n && !none; i++) {
        if (i + AGES_AHEAD < h->n) index_prefetch(s->ix, entry_hash(&h->v[i + AGES_AHEAD]));
        if (keep(s, kind, &h->v[i])) h->v[k++] = h->v[i];
    }
    h->n = k;
    h->filtering = 0;
    for (size_t i = k / 2 + 1; i-- > 0;)
        sift_down(h, i);
}

/* Carries a filtering pass `budget` entries further (entry_indexed). The pass walks from the
 * end down: half of a heap's entries are leaves, where the last entry moved into a hole sifts
 * nowhere (it is the newest, as a rule), and a hole higher up sifts down a short way. Entries
 * above filter_left were checked, except one that a push or a pop sifted up past the pass
 * since (at most one each): it waits for the next pass. No valid entry is removed. */
static void filter_step(idem_store *s, struct age_heap *h, int kind, size_t budget)
{
    if (kind != AGE_MISMATCH && kind_count(s, kind) == 0) {
        h->n = 0; /* as in rebuild: no entry can be valid */
        h->filtering = 0;
        return;
    }
    size_t left = h->filter_left < h->n ? h->filter_left : h->n;
    for (size_t k = 1; k <= AGES_AHEAD && k <= left; k++) /* the step's first misses overlap */
        index_prefetch(s->ix, entry_hash(&h->v[left - k]));
    for (; budget > 0 && left > 0; budget--) {
        size_t i = left - 1;
        if (i >= AGES_AHEAD) index_prefetch(s->ix, entry_hash(&h->v[i - AGES_AHEAD]));
        if (entry_indexed(s, kind, &h->v[i]) || !remove_at(h, i)) left = i;
    }
    h->filter_left = left;
    if (left == 0) h->filtering = 0;
}

/* One step of filtering, starting a pass if the heap is past its bound. Returns whether it
 * did work. */
static int filter_if_due(idem_store *s, int kind, size_t budget)
{
    struct age_heap *h = &s->ages[kind];
    if (s->ages_hold) return 0;
    if (!h->filtering && h->n > 2 * kind_count(s, kind) + AGES_SLACK) {
        h->filtering = 1;
        h->filter_left = h->n;
    }
    if (!h->filtering) return 0;
    filter_step(s, h, kind, budget);
    return 1;
}

int ages_tidy(idem_store *s)
{
    if (s->test_no_tidy) return 0;
    int worked = 0;
    for (int k = 0; k < AGE_KINDS; k++)
        worked |= filter_if_due(s, k, AGES_TIDY_STEP);
    return worked;
}

/* Room for one more entry: 0, or -1 when the heap cannot grow. */
static int heap_grow(const idem_store *s, struct age_heap *h)
{
    if (h->n < h->cap) return 0;
    if (s->test_ages_no_grow) return -1;
    size_t cap = h->cap ? h->cap + h->cap / 2 : 256; /* 1.5x: at most a third unused */
    struct age_entry *v = util_map_grow(h->v, h->cap * sizeof *v, cap * sizeof *v);
    if (!v) return -1;
    h->v = v;
    h->cap = cap;
    return 0;
}

static void heap_push(idem_store *s, int kind, int64_t t, uint64_t hash, uint64_t addr)
{
    struct age_heap *h = &s->ages[kind];
    filter_if_due(s, kind, AGES_FILTER_STEP);
    /* ages_room made room before the change; filtering only removes entries. */
    if (heap_grow(s, h) < 0) return;
    h->v[h->n] = (struct age_entry){time_key(t, hash), (hash & ~INDEX_ADDR_MASK) | addr};
    sift_up(h, h->n++);
}

int ages_room(idem_store *s, const struct rec *r)
{
    if (r->state == IDEM_STATE_IN_FLIGHT && heap_grow(s, &s->ages[AGE_IN_FLIGHT]) < 0)
        return IDEM_ENOMEM;
    if (r->state == IDEM_STATE_REVIEW && heap_grow(s, &s->ages[AGE_REVIEW]) < 0) return IDEM_ENOMEM;
    if (r->mismatch_count > 0 && heap_grow(s, &s->ages[AGE_MISMATCH]) < 0) return IDEM_ENOMEM;
    return 0;
}

void ages_note(idem_store *s, const struct rec *r, uint64_t h, uint64_t addr)
{
    if (r->state == IDEM_STATE_IN_FLIGHT)
        heap_push(s, AGE_IN_FLIGHT, r->first_seen_ms, h, addr);
    else if (r->state == IDEM_STATE_REVIEW)
        heap_push(s, AGE_REVIEW, r->first_seen_ms, h, addr);
    if (r->mismatch_count > 0) heap_push(s, AGE_MISMATCH, r->last_mismatch_ms, h, addr);
}

void ages_settle(idem_store *s, int kind)
{
    struct age_heap *h = &s->ages[kind];
    /* A heap of mostly stale entries (a burst of claims, all committed since) is filtered rather
     * than popped entry by entry, each pop a walk down the heap: after 262,144 claims and their
     * commits the first stats call took 145 ms that way (docs/benchmarks.md). The pass goes in
     * steps, letting others have the lock between them; the rounds are bounded (pushes racing
     * the pass), and ages_oldest filters what is left past the bound then at once. */
    size_t rounds = h->n / AGES_VIEW_STEP + 2;
    while (rounds-- > 0 && filter_if_due(s, kind, AGES_VIEW_STEP) && h->filtering) {
        s->ages_yields++;
        store_let_others_in(s);
    }
}

int64_t ages_oldest(idem_store *s, int kind)
{
    struct age_heap *h = &s->ages[kind];
    if (h->n > 2 * kind_count(s, kind) + AGES_SLACK) rebuild(s, h, kind, entry_indexed);
    while (h->n > 0 && !entry_current(s, kind, &h->v[0])) {
        h->v[0] = h->v[--h->n];
        sift_down(h, 0);
    }
    return h->n ? entry_time(&h->v[0]) : 0;
}

size_t ages_size(const idem_store *s, int kind)
{
    return s->ages[kind].n;
}

size_t ages_copy(const idem_store *s, int kind, struct age_entry *v)
{
    const struct age_heap *h = &s->ages[kind];
    if (h->n) memcpy(v, h->v, h->n * sizeof *v);
    return h->n;
}

int ages_entry_cmp(const void *a, const void *b)
{
    const struct age_entry *x = a, *y = b;
    if (x->time_hi != y->time_hi) return x->time_hi < y->time_hi ? -1 : 1;
    return x->addr_tag < y->addr_tag ? -1 : x->addr_tag > y->addr_tag;
}

void ages_order(struct age_entry *v, size_t *n)
{
    if (*n < 2) return;
    qsort(v, *n, sizeof *v, ages_entry_cmp);
    size_t k = 1;
    for (size_t i = 1; i < *n; i++)
        if (ages_entry_cmp(&v[i], &v[k - 1]) != 0) v[k++] = v[i];
    *n = k;
}

uint64_t ages_entry_addr(const struct age_entry *e)
{
    return entry_addr(e);
}

uint64_t ages_entry_hash(const struct age_entry *e)
{
    return entry_hash(e);
}

bool ages_ordered(const idem_store *s)
{
    for (int k = 0; k < AGE_KINDS; k++) {
        const struct age_heap *h = &s->ages[k];
        for (size_t i = 1; i < h->n; i++)
            if (h->v[i].time_hi < h->v[(i - 1) / 2].time_hi) return false;
    }
    return true;
}

static int addr_cmp(const void *a, const void *b)
{
    uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
    return x < y ? -1 : x > y;
}

uint64_t *ages_sorted_addrs(const idem_store *s, int kind, size_t *n)
{
    const struct age_heap *h = &s->ages[kind];
    *n = 0;
    uint64_t *v = h->n ? malloc(h->n * sizeof *v) : NULL;
    if (!v) return NULL;
    for (size_t i = 0; i < h->n; i++)
        v[i] = entry_addr(&h->v[i]);
    qsort(v, h->n, sizeof *v, addr_cmp);
    *n = h->n;
    return v;
}

void ages_free(idem_store *s)
{
    for (int k = 0; k < AGE_KINDS; k++) {
        util_map_free(s->ages[k].v, s->ages[k].cap * sizeof *s->ages[k].v);
        memset(&s->ages[k], 0, sizeof s->ages[k]);
    }
}
