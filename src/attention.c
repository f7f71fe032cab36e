/*
 * attention.c: idem_attention, the operator's recovery view: review records, in_flight records
 * whose lease ran out (or older than a threshold), and records with recorded mismatches, taken
 * from the attention heaps (ages.c) without a scan of all keys. The heaps are copied under the
 * lock, sorted by time without it, and checked oldest first in steps (the lock let go between
 * them) until max records qualify. An entry names the key's version at one log address; a key
 * rewritten meanwhile (an extend, a hold, a mismatch recorded again, a compaction copy) is found
 * again by the entry's hash bits in the index, at its current address, so a record that needs
 * attention throughout the call is listed whatever was written to it; a set of the addresses
 * listed keeps it from being listed twice. The records are copied into the queue's buffers and
 * stay valid until the next call on the queue.
 */
#include <stdlib.h>
#include <string.h>

#include "store.h"
#include "util.h"

#define ATTENTION_MAX_DEFAULT 1000u

/* Bytes of the records returned by the last call, as offsets until the end (pointers after). */
struct att_buf {
    uint8_t *b;
    size_t used, cap;
};

static int64_t att_put(struct att_buf *ab, const void *p, size_t len)
{
    if (ab->used + len > ab->cap) {
        size_t cap = ab->cap ? ab->cap : 4096;
        while (cap < ab->used + len)
            cap *= 2;
        uint8_t *n = realloc(ab->b, cap);
        if (!n) return -1;
        ab->b = n;
        ab->cap = cap;
    }
    if (len) memcpy(ab->b + ab->used, p, len);
    ab->used += len;
    return (int64_t)(ab->used - len);
}

/* Copies rec's variable bytes into ab, keeping offsets in the pointer fields. */
static int att_keep(struct att_buf *ab, idem_record *rec)
{
    const void **ps[] = {&rec->key, &rec->owner, &rec->note, &rec->result};
    uint32_t lens[] = {rec->key_len, rec->owner_len, rec->note_len, rec->result_len};
    for (size_t i = 0; i < IDEM_ARRAY_LEN(ps); i++) {
        if (!*ps[i]) {
            *ps[i] = (const void *)(uintptr_t)-1;
            continue;
        }
        int64_t off = att_put(ab, *ps[i], lens[i]);
        if (off < 0) return IDEM_ENOMEM;
        *ps[i] = (const void *)(uintptr_t)off;
    }
    return 0;
}

static void att_rebase(struct att_buf *ab, idem_record *recs, size_t n)
{
    for (size_t k = 0; k < n; k++) {
        const void **ps[] = {&recs[k].key, &recs[k].owner, &recs[k].note, &recs[k].result};
        for (size_t i = 0; i < IDEM_ARRAY_LEN(ps); i++) {
            uintptr_t off = (uintptr_t)*ps[i];
            *ps[i] = off == (uintptr_t)-1 ? NULL : ab->b + off;
        }
    }
}

/* Whether the key's current version, at addr, belongs in the view as kind for entry e (its
 * time too, but for mismatches, whose time moves with each one recorded); fills tmp's record. */
static int att_take(idem_store *s, struct qslot *tmp, uint64_t addr, int kind,
                    const struct age_entry *e, int64_t now, int64_t older_ms)
{
    uint32_t len;
    uint64_t lsn;
    const uint8_t *p = wal_payload(s->wal, addr, &len, &lsn);
    struct rec r, cur;
    if (!p || rec_decode(p, len, &r) < 0) return 0;
    struct index_slot *slot = ops_find(s, r.key, r.key_len, &cur, &lsn);
    if (!slot || index_slot_addr(slot) != addr) return 0; /* another key with those hash bits */
    if (kind == AGE_MISMATCH ? r.mismatch_count == 0 : !ages_fits(kind, &r, e)) return 0;
    int stuck = r.state == IDEM_STATE_IN_FLIGHT &&
                (now >= r.lease_until_ms || (older_ms > 0 && now - r.first_seen_ms >= older_ms));
    if (kind == AGE_IN_FLIGHT && !stuck) return 0;
    if (kind == AGE_MISMATCH && (r.state == IDEM_STATE_REVIEW || stuck))
        return 0; /* listed under its state already */
    tmp->buf_used = 0;
    memset(&tmp->c, 0, sizeof tmp->c);
    ops_fill_record(tmp, &r, slot, s);
    return tmp->c.err == 0;
}

/* The log addresses listed so far: an open-addressing set (0 marks a free place). */
struct att_set {
    uint64_t *v;
    size_t mask;
};

/* Adds addr; returns 0 when it was there already. */
static int att_set_add(struct att_set *set, uint64_t addr)
{
    size_t i = (size_t)(addr * UINT64_C(0x9e3779b97f4a7c15) >> 20) & set->mask;
    for (; set->v[i]; i = (i + 1) & set->mask)
        if (set->v[i] == addr) return 0;
    set->v[i] = addr;
    return 1;
}

static int cmp_first_seen(const void *a, const void *b)
{
    const idem_record *x = a, *y = b;
    return (x->first_seen_ms > y->first_seen_ms) - (x->first_seen_ms < y->first_seen_ms);
}

/* Faults in a new buffer's pages, a write to each (a memset of zeros may become a calloc,
 * which writes nothing to fresh pages), so that a copy into it under the lock faults none. */
static void touch_pages(void *p, size_t bytes)
{
    for (size_t b = 0; b < bytes; b += 4096)
        ((volatile uint8_t *)p)[b] = 0;
}

/* How many slots with an entry's hash bits are looked at: one, as a rule. */
#define ATT_LIKE_MAX 4

/* Lists the records of kind that belong in the view, oldest first (by the heap's time), until
 * max; entries are checked in steps of AGES_VIEW_STEP, with mu let go between steps. An entry
 * whose address the index no longer holds leads to the key's slot by its hash bits: a version
 * written since, at another address, is looked at if its slot marks it kept apart. */
static int att_kind(idem_store *s, int kind, struct age_entry *v, size_t nv, int64_t now,
                    int64_t older_ms, struct qslot *tmp, struct att_buf *ab, struct att_set *set,
                    idem_record *out, size_t *k, size_t max)
{
    int rc = 0;
    pthread_mutex_lock(&s->mu);
    for (size_t i = 0; i < nv && *k < max && rc == 0;) {
        if (i > 0) store_let_others_in(s);
        for (size_t end = i + AGES_VIEW_STEP; i < nv && i < end && *k < max && rc == 0; i++) {
            const struct index_slot *like[ATT_LIKE_MAX];
            size_t nl = index_slots_like(s->ix, ages_entry_hash(&v[i]), like, ATT_LIKE_MAX);
            for (size_t j = 0; j < nl && *k < max && rc == 0; j++) {
                uint64_t addr = index_slot_addr(like[j]);
                if ((addr != ages_entry_addr(&v[i]) && !(like[j]->aux & SLOT_AUX_APART)) ||
                    !att_take(s, tmp, addr, kind, &v[i], now, older_ms))
                    continue;
                if (!att_set_add(set, addr)) continue; /* listed already */
                out[*k] = tmp->c.record;
                rc = att_keep(ab, &out[*k]);
                (*k)++;
            }
        }
    }
    pthread_mutex_unlock(&s->mu);
    return rc;
}

int idem_attention(idem_queue *q, const idem_attention_args *a, const idem_record **records,
                   size_t *n)
{
    if (!q || !a || !records || !n || a->older_ms < 0) return IDEM_EINVAL;
    idem_store *s = q->s;
    size_t max = a->max ? a->max : ATTENTION_MAX_DEFAULT;
    idem_record *out = realloc(q->att_recs, max * sizeof *out);
    if (!out) return IDEM_ENOMEM;
    q->att_recs = out;
    static const int order[] = {AGE_REVIEW, AGE_IN_FLIGHT, AGE_MISMATCH};
    struct age_entry *v[IDEM_ARRAY_LEN(order)] = {NULL};
    size_t nv[IDEM_ARRAY_LEN(order)] = {0}, cap[IDEM_ARRAY_LEN(order)] = {0};
    int rc = 0;
    int64_t now = 0;
    /* The heaps are copied at once (16 bytes an entry), then checked in steps. The copies'
     * memory is taken and touched without the lock: first touches fault pages in, about 30 us
     * each on this VM (31 ms under the lock for a heap of 262,144 entries). */
    pthread_mutex_lock(&s->mu);
    while (rc == 0) {
        int fits = 1;
        for (size_t o = 0; o < IDEM_ARRAY_LEN(order); o++)
            fits &= ages_size(s, order[o]) <= cap[o];
        if (fits) break;
        size_t need[IDEM_ARRAY_LEN(order)];
        for (size_t o = 0; o < IDEM_ARRAY_LEN(order); o++)
            need[o] = ages_size(s, order[o]);
        pthread_mutex_unlock(&s->mu);
        for (size_t o = 0; o < IDEM_ARRAY_LEN(order) && rc == 0; o++) {
            if (need[o] <= cap[o]) continue;
            size_t c = need[o] + need[o] / 8 + 256; /* room for what is pushed meanwhile */
            free(v[o]);
            v[o] = malloc(c * sizeof *v[o]);
            if (!v[o]) {
                cap[o] = 0;
                rc = IDEM_ENOMEM;
                break;
            }
            touch_pages(v[o], c * sizeof *v[o]);
            cap[o] = c;
        }
        pthread_mutex_lock(&s->mu);
    }
    if (rc == 0) {
        now = store_now(s);
        for (size_t o = 0; o < IDEM_ARRAY_LEN(order); o++)
            nv[o] = ages_copy(s, order[o], v[o]);
    }
    pthread_mutex_unlock(&s->mu);
    /* Room for twice what can be listed: at most max, and ATT_LIKE_MAX per entry copied. */
    size_t set_cap = 2, most = ATT_LIKE_MAX * (nv[0] + nv[1] + nv[2]);
    if (most > max) most = max;
    while (set_cap < 2 * most)
        set_cap *= 2;
    struct att_set set = {rc == 0 ? calloc(set_cap, sizeof *set.v) : NULL, set_cap - 1};
    if (rc == 0 && !set.v) rc = IDEM_ENOMEM;
    struct att_buf ab = {q->att_buf, 0, q->att_cap};
    struct qslot tmp = {0};
    size_t k = 0;
    for (size_t o = 0; o < IDEM_ARRAY_LEN(order) && k < max && rc == 0; o++) {
        size_t start = k;
        ages_order(v[o], &nv[o]);
        rc = att_kind(s, order[o], v[o], nv[o], now, a->older_ms, &tmp, &ab, &set, out, &k, max);
        qsort(out + start, k - start, sizeof *out, cmp_first_seen);
    }
    free(set.v);
    for (size_t o = 0; o < IDEM_ARRAY_LEN(order); o++)
        free(v[o]);
    free(tmp.buf);
    q->att_buf = ab.b;
    q->att_cap = ab.cap;
    if (rc < 0) return rc;
    att_rebase(&ab, out, k);
    *records = out;
    *n = k;
    return 0;
}
