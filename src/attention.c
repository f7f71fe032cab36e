/*
 * attention.c: idem_attention, the operator's recovery view: review records, in_flight records
 * whose lease ran out (or older than a threshold), and records with recorded mismatches, taken
 * from the attention heaps (ages.c) without a scan of all keys. The heaps are copied under the
 * lock, sorted by time without it, and checked oldest first in steps (the lock let go between
 * them) until max records qualify. An entry names the key's version at one log address; a key
 * written again meanwhile (an extend, a hold, a mismatch recorded again, a compaction copy) is
 * found again by the entry's hash bits in the index, at its current address, and listed in the
 * group being read unless a later group's copy holds its own entry; a set of the keys listed
 * keeps a record from being listed twice. The records are copied into the queue's buffers and
 * stay valid until the next call on the queue.
 */
#include <stdlib.h>
#include <string.h>

#include "store.h"
#include "util.h"

#define ATTENTION_MAX_DEFAULT 1000u
#define ATT_BUF_KEEP          (1u << 20)   /* a larger buffer is not kept for the next call */
#define ATT_STEP_BYTES        (256u << 10) /* records copied under one hold of mu, about */

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

/* The view's groups, in the list's order. */
static const int att_order[] = {AGE_REVIEW, AGE_IN_FLIGHT, AGE_MISMATCH};
#define ATT_GROUPS IDEM_ARRAY_LEN(att_order)

/* Where version r belongs in the view: the index in att_order of its group, or -1. */
static int att_group(const struct rec *r, int64_t now, int64_t older_ms)
{
    if (r->state == IDEM_STATE_REVIEW) return 0;
    if (r->state == IDEM_STATE_IN_FLIGHT &&
        (now >= r->lease_until_ms || (older_ms > 0 && now - r->first_seen_ms >= older_ms)))
        return 1;
    return r->mismatch_count > 0 ? 2 : -1;
}

/* The copies of the heaps, sorted (ages_order), one per group, and what a call asked for. */
struct att_view {
    struct age_entry *v[ATT_GROUPS];
    size_t n[ATT_GROUPS];
    int64_t now, older_ms;
    int err; /* the first of: IDEM_EFATAL, a record left out or listed rests on a clock never
              * made durable; IDEM_ENOMEM, a record had no room for its copy; IDEM_ECORRUPT, a
              * record to list fails its checksum. The walk stops at it. */
};

static void att_fail(struct att_view *av, int err)
{
    if (!av->err) av->err = err;
}

/* Whether the key's current version, at addr, is listed in group g for entry e of that group's
 * heap; fills tmp's record and *h (the key's hash). At the entry's own address the version is
 * the one the entry was pushed for: it is listed if it belongs in g (else its own group lists
 * it). A version written since at another address (moved) is listed here if it is of the same
 * record and belongs in this group or an earlier one, or in a later one whose copy lacks its
 * entry (written while the list runs): it would be missed otherwise. */
static int att_take(idem_store *s, struct att_view *av, struct qslot *tmp, uint64_t addr, int g,
                    const struct age_entry *e, uint64_t *h)
{
    uint32_t len;
    uint64_t lsn;
    const uint8_t *p = wal_payload(s->wal, addr, &len, &lsn);
    struct rec r, cur;
    if (!p || rec_decode(p, len, &r) < 0) {
        /* The index points at the very version the entry was pushed for, and it cannot be
         * read: a record that needs attention, damaged. Reported, not left out (the list said
         * nothing needs attention while idem_get of the key answered IDEM_ECORRUPT). */
        if (addr == ages_entry_addr(e)) att_fail(av, IDEM_ECORRUPT);
        return 0;
    }
    struct index_slot *slot = ops_find(s, r.key, r.key_len, &cur, &lsn);
    if (!slot || index_slot_addr(slot) != addr) return 0; /* another key with those hash bits */
    if (ops_rec_expired(&r, av->now)) {                   /* gone, though no sweep reached it yet */
        if (store_clock_need(s, r.expires_at_ms) < 0) att_fail(av, IDEM_EFATAL);
        return 0;
    }
    int kind = att_order[g], rg = att_group(&r, av->now, av->older_ms);
    if (rg < 0) return 0;
    *h = ops_hash(s, r.key, r.key_len);
    if (addr == ages_entry_addr(e)) {
        if (rg != g || !ages_fits(kind, &r, e)) return 0;
    } else {
        if (!ages_same_record(kind, &r, e)) return 0;
        if (rg > g) {
            struct age_entry own = ages_entry_of(att_order[rg], &r, *h, addr);
            if (bsearch(&own, av->v[rg], av->n[rg], sizeof own, ages_entry_cmp)) return 0;
        }
    }
    /* Listed because its lease ran out: that holds after a crash once the clock is durable. */
    if (rg == 1 && av->now >= r.lease_until_ms && store_clock_need(s, r.lease_until_ms) < 0) {
        att_fail(av, IDEM_EFATAL);
        return 0;
    }
    tmp->buf_used = 0;
    memset(&tmp->c, 0, sizeof tmp->c);
    ops_fill_record(tmp, &r, slot, s);
    if (tmp->c.err == IDEM_ENOMEM)
        att_fail(av, IDEM_ENOMEM); /* the call fails: no record left out */
    return tmp->c.err == 0;
}

/* The keys listed so far, by hash (open addressing; k 0 marks a free place): a record is listed
 * once, whatever versions of it the heaps name. */
struct att_set {
    struct att_seen {
        uint64_t h;
        size_t k; /* 1 + its index in the list */
    } * v;
    size_t mask;
};

/* The free place for a key (hash h) not listed yet, or NULL when it is listed already (the
 * listed records' key bytes are in ab, at the offsets their key fields hold). */
static struct att_seen *att_set_place(const struct att_set *set, const struct att_buf *ab,
                                      const idem_record *out, uint64_t h, const void *key,
                                      uint32_t key_len)
{
    size_t i = (size_t)(h >> 20) & set->mask;
    for (; set->v[i].k; i = (i + 1) & set->mask) {
        const idem_record *o = &out[set->v[i].k - 1];
        if (set->v[i].h == h && o->key_len == key_len &&
            memcmp(ab->b + (uintptr_t)o->key, key, key_len) == 0)
            return NULL;
    }
    return &set->v[i];
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

/* Whether the list takes another record: fewer than max, and its bytes short of max_bytes. */
static int att_room(size_t k, size_t max, const struct att_buf *ab, uint64_t max_bytes)
{
    return k < max && (max_bytes == 0 || ab->used < max_bytes);
}

/* Lists the records of group g, oldest first (by the heap's time; mismatches newest first),
 * while att_room; entries are
 * checked in steps of AGES_VIEW_STEP, with mu let go between steps. Each entry leads to the
 * slots holding its hash bits: the one still at its address, or one at another address that
 * marks its version kept apart (written since: att_take). */
static int att_group_list(idem_store *s, struct att_view *av, int g, struct qslot *tmp,
                          struct att_buf *ab, struct att_set *set, idem_record *out, size_t *k,
                          size_t max, uint64_t max_bytes)
{
    int rc = 0;
    const struct age_entry *v = av->v[g];
    /* Mismatches newest first: committed ones stay listed until they expire (days), and a list
     * cut to COUNT kept the oldest, a new incident never shown. The copy stays in its order for
     * att_take's bsearch; the walk goes from its end. */
    int rev = att_order[g] == AGE_MISMATCH;
    store_lock(s);
    for (size_t i = 0; i < av->n[g] && rc == 0 && !av->err && att_room(*k, max, ab, max_bytes);) {
        if (i > 0) store_let_others_in(s);
        /* A step ends at AGES_VIEW_STEP entries, or once ATT_STEP_BYTES of records are copied
         * (each may hold a result of up to 1 MiB, decoded, copied and faulted in under mu). */
        size_t step_from = ab->used;
        for (size_t end = i + AGES_VIEW_STEP;
             i < av->n[g] && i < end && rc == 0 && !av->err && att_room(*k, max, ab, max_bytes) &&
             ab->used - step_from < ATT_STEP_BYTES;
             i++) {
            const struct age_entry *e = &v[rev ? av->n[g] - 1 - i : i];
            const struct index_slot *like[ATT_LIKE_MAX];
            size_t nl = index_slots_like(s->ix, ages_entry_hash(e), like, ATT_LIKE_MAX);
            for (size_t j = 0; j < nl && rc == 0 && !av->err && att_room(*k, max, ab, max_bytes);
                 j++) {
                uint64_t addr = index_slot_addr(like[j]), h;
                if ((addr != ages_entry_addr(e) && !(like[j]->aux & SLOT_AUX_APART)) ||
                    !att_take(s, av, tmp, addr, g, e, &h))
                    continue;
                struct att_seen *place =
                    att_set_place(set, ab, out, h, tmp->ext->record.key, tmp->ext->record.key_len);
                if (!place) continue; /* listed already */
                out[*k] = tmp->ext->record;
                rc = att_keep(ab, &out[*k]);
                if (rc < 0) break;
                *place = (struct att_seen){h, ++*k};
            }
        }
    }
    store_unlock(s);
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
    struct att_view av = {.older_ms = a->older_ms};
    size_t cap[ATT_GROUPS] = {0};
    int rc = 0;
    /* The heaps are copied at once (16 bytes an entry), then checked in steps. The copies'
     * memory is taken and touched without the lock: first touches fault pages in, about 30 us
     * each on this VM (31 ms under the lock for a heap of 262,144 entries). */
    store_lock(s);
    while (rc == 0) {
        int fits = 1;
        for (size_t g = 0; g < ATT_GROUPS; g++)
            fits &= ages_size(s, att_order[g]) <= cap[g];
        if (fits) break;
        size_t need[ATT_GROUPS];
        for (size_t g = 0; g < ATT_GROUPS; g++)
            need[g] = ages_size(s, att_order[g]);
        store_unlock(s);
        for (size_t g = 0; g < ATT_GROUPS && rc == 0; g++) {
            if (need[g] <= cap[g]) continue;
            size_t c = need[g] + need[g] / 8 + 256; /* room for what is pushed meanwhile */
            free(av.v[g]);
            av.v[g] = malloc(c * sizeof *av.v[g]);
            if (!av.v[g]) {
                cap[g] = 0;
                rc = IDEM_ENOMEM;
                break;
            }
            touch_pages(av.v[g], c * sizeof *av.v[g]);
            cap[g] = c;
        }
        store_lock(s);
    }
    if (rc == 0) {
        av.now = store_now(s);
        for (size_t g = 0; g < ATT_GROUPS; g++)
            av.n[g] = ages_copy(s, att_order[g], av.v[g]);
    }
    store_unlock(s);
    for (size_t g = 0; g < ATT_GROUPS; g++)
        ages_order(av.v[g], &av.n[g]);
    /* Room for twice what can be listed: at most max, and ATT_LIKE_MAX per entry copied. */
    size_t set_cap = 2, most = ATT_LIKE_MAX * (av.n[0] + av.n[1] + av.n[2]);
    if (most > max) most = max;
    while (set_cap < 2 * most)
        set_cap *= 2;
    struct att_set set = {rc == 0 ? calloc(set_cap, sizeof *set.v) : NULL, set_cap - 1};
    if (rc == 0 && !set.v) rc = IDEM_ENOMEM;
    if (q->att_cap > ATT_BUF_KEEP) { /* the last list's records are given up now */
        free(q->att_buf);
        q->att_buf = NULL;
        q->att_cap = 0;
    }
    struct att_buf ab = {q->att_buf, 0, q->att_cap};
    struct qslot_ext tmp_ext = {0};
    struct qslot tmp = {.ext = &tmp_ext};
    size_t k = 0, start[ATT_GROUPS + 1] = {0};
    for (int g = 0; g < (int)ATT_GROUPS; g++) {
        start[g] = k;
        if (k < max && rc == 0)
            rc = att_group_list(s, &av, g, &tmp, &ab, &set, out, &k, max, a->max_bytes);
    }
    if (rc == 0) rc = av.err;
    start[ATT_GROUPS] = k;
    /* Each group by first_seen, once all are listed: the set names records by their place in
     * out, which a sort between groups moved (a later group then listed a record again). */
    for (size_t g = 0; g < ATT_GROUPS; g++)
        qsort(out + start[g], start[g + 1] - start[g], sizeof *out, cmp_first_seen);
    free(set.v);
    for (size_t g = 0; g < ATT_GROUPS; g++)
        free(av.v[g]);
    free(tmp.buf);
    q->att_buf = ab.b;
    q->att_cap = ab.cap;
    /* In sync mode what the list reports, and what it leaves out, is durable (rule 8), as for a
     * scan: it waits for the flush of everything appended before it was read (a record listed
     * may be that new; one left out may have been resolved or deleted a moment ago, even when
     * nothing is listed), and for the clock that left out a record found expired, or found a
     * lease run out (store_clock_need). */
    if (rc == 0 && s->opt.durability == IDEM_DURABILITY_SYNC) {
        store_lock(s);
        if (s->durable_lsn < wal_last_lsn(s->wal) || !store_clock_saved(s))
            rc = store_wait_durable(s);
        store_unlock(s);
    }
    if (rc < 0) return rc;
    att_rebase(&ab, out, k);
    if (k < max) { /* kept until the next call: the records listed, not room for max */
        idem_record *fit = realloc(out, (k ? k : 1) * sizeof *out);
        if (fit) out = q->att_recs = fit;
    }
    *records = out;
    *n = k;
    return 0;
}
