/*
 * ages.c: the unfinished records (in_flight, review) by first_seen, so that the age of the
 * oldest of each, and the list of records that need a person, cost no scan of all keys.
 *
 * One min-heap per state of 16-byte entries {first_seen_ms, log address of a version}. Every
 * version written in an unfinished state pushes an entry (claims, recoveries, extends, holds,
 * compaction copies, replay). Entries are checked lazily: one is valid while the index still
 * points the key at that very address and the record there is in the heap's state with that
 * first_seen. Invalid entries are popped when they reach the top, and the heap is rebuilt from
 * its valid entries when it holds more than twice the records in its state (plus slack), so its
 * size stays proportional to the unfinished records.
 */
#include <stdlib.h>
#include <string.h>

#include "store.h"
#include "util.h"

#define AGES_SLACK 1024u

static int entry_valid(idem_store *s, int state, const struct age_entry *e)
{
    if (!wal_addr_valid(s->wal, e->addr))
        return 0;
    uint32_t len;
    uint64_t lsn;
    const uint8_t *p = wal_payload(s->wal, e->addr, &len, &lsn);
    struct rec r, cur;
    if (!p || rec_decode(p, len, &r) < 0 || r.state != state || r.first_seen_ms != e->first_seen_ms)
        return 0;
    struct index_slot *slot = ops_find(s, r.key, r.key_len, &cur, &lsn);
    return slot && index_slot_addr(slot) == e->addr;
}

static void sift_up(struct age_heap *h, size_t i)
{
    while (i > 0) {
        size_t p = (i - 1) / 2;
        if (h->v[p].first_seen_ms <= h->v[i].first_seen_ms)
            break;
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
        if (l < h->n && h->v[l].first_seen_ms < h->v[m].first_seen_ms)
            m = l;
        if (r < h->n && h->v[r].first_seen_ms < h->v[m].first_seen_ms)
            m = r;
        if (m == i)
            return;
        struct age_entry t = h->v[m];
        h->v[m] = h->v[i];
        h->v[i] = t;
        i = m;
    }
}

static uint64_t state_count(const idem_store *s, int state)
{
    return state == IDEM_STATE_IN_FLIGHT ? s->st.keys_in_flight : s->st.keys_review;
}

static void rebuild(idem_store *s, struct age_heap *h, int state)
{
    size_t k = 0;
    for (size_t i = 0; i < h->n; i++)
        if (entry_valid(s, state, &h->v[i]))
            h->v[k++] = h->v[i];
    h->n = k;
    for (size_t i = k / 2 + 1; i-- > 0;)
        sift_down(h, i);
}

void ages_push(idem_store *s, int state, int64_t first_seen_ms, uint64_t addr)
{
    struct age_heap *h = state == IDEM_STATE_IN_FLIGHT ? &s->ages_in_flight : &s->ages_review;
    if (h->n > 2 * state_count(s, state) + AGES_SLACK && !s->ages_rebuilding) {
        s->ages_rebuilding = 1;
        rebuild(s, h, state);
        s->ages_rebuilding = 0;
    }
    if (h->n == h->cap) {
        size_t cap = h->cap ? h->cap * 2 : 256;
        struct age_entry *v = realloc(h->v, cap * sizeof *v);
        if (!v)
            return; /* the age reads high until the next rebuild; nothing else depends on it */
        h->v = v;
        h->cap = cap;
    }
    h->v[h->n] = (struct age_entry){first_seen_ms, addr};
    sift_up(h, h->n++);
}

int64_t ages_oldest(idem_store *s, int state)
{
    struct age_heap *h = state == IDEM_STATE_IN_FLIGHT ? &s->ages_in_flight : &s->ages_review;
    while (h->n > 0 && !entry_valid(s, state, &h->v[0])) {
        h->v[0] = h->v[--h->n];
        sift_down(h, 0);
    }
    return h->n ? h->v[0].first_seen_ms : 0;
}

size_t ages_list(idem_store *s, int state, uint64_t *addrs, size_t max)
{
    struct age_heap *h = state == IDEM_STATE_IN_FLIGHT ? &s->ages_in_flight : &s->ages_review;
    rebuild(s, h, state);
    size_t n = 0;
    for (size_t i = 0; i < h->n && n < max; i++)
        addrs[n++] = h->v[i].addr;
    return n;
}

void ages_free(idem_store *s)
{
    free(s->ages_in_flight.v);
    free(s->ages_review.v);
    memset(&s->ages_in_flight, 0, sizeof s->ages_in_flight);
    memset(&s->ages_review, 0, sizeof s->ages_review);
}
