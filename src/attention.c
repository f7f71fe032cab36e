/*
 * attention.c: idem_attention, the operator's recovery view: review records, in_flight records
 * whose lease ran out (or older than a threshold), and records with recorded mismatches, taken
 * from the attention heaps (ages.c) without a scan of all keys. The records are copied into the
 * queue's buffers and stay valid until the next call on the queue.
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

/* Whether the record at addr belongs in the view; fills the slot's record. */
static int att_take(idem_store *s, struct qslot *tmp, uint64_t addr, int kind, int64_t now,
                    int64_t older_ms)
{
    uint32_t len;
    uint64_t lsn;
    const uint8_t *p = wal_payload(s->wal, addr, &len, &lsn);
    struct rec r, cur;
    if (!p || rec_decode(p, len, &r) < 0) return 0;
    struct index_slot *slot = ops_find(s, r.key, r.key_len, &cur, &lsn);
    if (!slot || index_slot_addr(slot) != addr) return 0;
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

static int cmp_first_seen(const void *a, const void *b)
{
    const idem_record *x = a, *y = b;
    return (x->first_seen_ms > y->first_seen_ms) - (x->first_seen_ms < y->first_seen_ms);
}

int idem_attention(idem_queue *q, const idem_attention_args *a, const idem_record **records,
                   size_t *n)
{
    if (!q || !a || !records || !n || a->older_ms < 0) return IDEM_EINVAL;
    idem_store *s = q->s;
    size_t max = a->max ? a->max : ATTENTION_MAX_DEFAULT;
    idem_record *out = realloc(q->att_recs, max * sizeof *out);
    uint64_t *addrs = malloc(max * sizeof *addrs);
    if (!out || !addrs) {
        if (out) q->att_recs = out;
        free(addrs);
        return IDEM_ENOMEM;
    }
    q->att_recs = out;
    struct att_buf ab = {q->att_buf, 0, q->att_cap};
    struct qslot tmp = {0};
    size_t k = 0;
    int rc = 0;
    pthread_mutex_lock(&s->mu);
    int64_t now = store_now(s);
    static const int order[] = {AGE_REVIEW, AGE_IN_FLIGHT, AGE_MISMATCH};
    for (size_t o = 0; o < IDEM_ARRAY_LEN(order) && k < max && rc == 0; o++) {
        size_t start = k;
        size_t m = ages_list(s, order[o], addrs, max - k);
        for (size_t i = 0; i < m && k < max && rc == 0; i++) {
            if (!att_take(s, &tmp, addrs[i], order[o], now, a->older_ms)) continue;
            out[k] = tmp.c.record;
            rc = att_keep(&ab, &out[k]);
            k++;
        }
        qsort(out + start, k - start, sizeof *out, cmp_first_seen);
    }
    pthread_mutex_unlock(&s->mu);
    free(tmp.buf);
    free(addrs);
    q->att_buf = ab.b;
    q->att_cap = ab.cap;
    if (rc < 0) return rc;
    att_rebase(&ab, out, k);
    *records = out;
    *n = k;
    return 0;
}
