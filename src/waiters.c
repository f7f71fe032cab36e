/*
 * waiters.c: the parked WAIT claims (ops.c parks and wakes them). Each parked claim is on two
 * lists: the store's, oldest first, which the walks for deadlines, lease ends and wake-ups of
 * every key go through; and its key hash's bucket, oldest first, which a change of one key goes
 * through, so that a commit among thousands of parked claims re-runs only those of its key.
 *
 * Invariants (mu held): a slot is on both lists or on neither; within a bucket, claims of one
 * key keep the order they parked in (the first to park is the first to run again);
 * wake_next_mono_ms is at or before the moment any parked claim's deadline or lease end can
 * come (waiters_note_due lowers it; a walk of every parked claim sets it anew); nwake_again is
 * at least the number of parked claims with wake_again set (which any wake-up re-runs).
 */
#include <stdlib.h>

#include "store.h"

#define WAITERS_BUCKETS_MIN 64u
/* A lease end is a store clock time, which may jump ahead of the monotonic clock when it slews
 * (store_now): the walks come at least this often while anything is parked. */
#define WAITERS_LOOK_MS_MAX 100

static struct wbucket *bucket_of(const idem_store *s, uint64_t h)
{
    return &s->wbuckets[h & s->wbuckets_mask];
}

static void bucket_append(idem_store *s, struct qslot *sl)
{
    struct wbucket *b = bucket_of(s, sl->ext->whash);
    sl->ext->bnext = NULL;
    sl->ext->bprev = b->tail;
    if (b->tail)
        b->tail->ext->bnext = sl;
    else
        b->head = sl;
    b->tail = sl;
}

/* Doubles the buckets (or makes the first) and puts every parked claim in its new bucket, in
 * park order. Returns 0, or -1 without memory (the old buckets stay). */
static int buckets_grow(idem_store *s)
{
    uint32_t n = s->wbuckets ? (s->wbuckets_mask + 1) * 2 : WAITERS_BUCKETS_MIN;
    struct wbucket *b = calloc(n, sizeof *b);
    if (!b) return -1;
    free(s->wbuckets);
    s->wbuckets = b;
    s->wbuckets_mask = n - 1;
    for (struct qslot *sl = s->waiters; sl; sl = sl->ext->wnext)
        bucket_append(s, sl);
    return 0;
}

int waiters_add(idem_store *s, struct qslot *sl, uint64_t h)
{
    if ((!s->wbuckets || s->nwaiters >= s->wbuckets_mask + 1) && buckets_grow(s) && !s->wbuckets)
        return -1; /* a failed growth keeps longer chains; no buckets at all parks nothing */
    sl->ext->whash = h;
    sl->ext->wnext = NULL;
    sl->ext->wprev = s->waiters_tail;
    if (s->waiters_tail)
        s->waiters_tail->ext->wnext = sl;
    else
        s->waiters = sl;
    s->waiters_tail = sl;
    bucket_append(s, sl);
    s->nwaiters++;
    return 0;
}

void waiters_remove(idem_store *s, struct qslot *sl)
{
    if (sl->ext->wprev)
        sl->ext->wprev->ext->wnext = sl->ext->wnext;
    else
        s->waiters = sl->ext->wnext;
    if (sl->ext->wnext)
        sl->ext->wnext->ext->wprev = sl->ext->wprev;
    else
        s->waiters_tail = sl->ext->wprev;
    struct wbucket *b = bucket_of(s, sl->ext->whash);
    if (sl->ext->bprev)
        sl->ext->bprev->ext->bnext = sl->ext->bnext;
    else
        b->head = sl->ext->bnext;
    if (sl->ext->bnext)
        sl->ext->bnext->ext->bprev = sl->ext->bprev;
    else
        b->tail = sl->ext->bprev;
    sl->ext->wprev = sl->ext->wnext = sl->ext->bprev = sl->ext->bnext = NULL;
    s->nwaiters--;
}

struct qslot *waiters_of_hash(const idem_store *s, uint64_t h)
{
    return s->wbuckets ? bucket_of(s, h)->head : NULL;
}

void waiters_note_due(idem_store *s, const struct qslot *sl, int64_t mono, int64_t now)
{
    int64_t due = sl->ext->deadline_mono_ms;
    if (due > mono + WAITERS_LOOK_MS_MAX) due = mono + WAITERS_LOOK_MS_MAX;
    if (!s->opt.test_clock) {
        /* The store clock runs at most 10% ahead of the monotonic one (STORE_SLEW_PER_S_MS),
         * so the lease end comes no sooner than 10/11 of its store time from now. */
        int64_t left = sl->ext->lease_end_ms - now;
        if (left < due - mono) {
            int64_t at = left > 0 ? mono + left - (left + 10) / 11 : mono;
            if (at < due) due = at;
        }
    }
    if (due <= mono) due = mono + 1; /* a walk ran at mono: the next comes a millisecond on */
    if (due < s->wake_next_mono_ms) s->wake_next_mono_ms = due;
}

void waiters_free(idem_store *s)
{
    free(s->wbuckets);
    s->wbuckets = NULL;
}
