/*
 * ops.c: the contract's rules over one key: claim (new, busy, done, mismatch, recover, review),
 * the owner calls (commit, release, hold, extend), get, set-if-absent, del and resolve, the
 * parking and waking of WAIT claims, and the replay of log frames into the index.
 *
 * Every change writes a whole new version of the record to the log (record.h) and points the
 * index at it; a release, a resolve-release or a del writes a DELETE frame. Plain repeats are
 * not logged: their counters live in the seen table (slot aux) until the next version folds
 * them in, and in checkpoints. All functions run with the store's lock held (store_lock), but
 * the ops_read_* ones, which hold rw's read side alone (store.h).
 *
 * Durability of answers: each completion carries need_lsn, the newest log position its answer
 * depends on (the version it read or wrote; for answers about an absent key, everything
 * appended so far, since a DELETE may not be durable yet).
 */
#include <lz4.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>
#include <string.h>
#include <xxhash.h>

#include "store.h"
#include "util.h"

#define OPS_KNOWN_FLAGS (IDEM_F_FORCE | IDEM_F_EXPECT | IDEM_F_GET_OLD | IDEM_F_WITH_NEXT)
#define OPS_LZ4_MIN     128u

static uint64_t key_hash(const idem_store *s, const void *key, uint32_t key_len)
{
    return XXH3_64bits_withSeed(key, key_len, s->sb.hash_seed);
}

uint64_t ops_hash(idem_store *s, const void *key, uint32_t key_len)
{
    /* An operation hashes its key for the lookup and again for an insert: the second time is
     * served from here (the same bytes at the same place within one operation). */
    if (s->hash_cache_on && key == s->hash_key && key_len == s->hash_key_len) return s->hash_value;
    s->hash_key = key;
    s->hash_key_len = key_len;
    s->hash_value = key_hash(s, key, key_len);
    return s->hash_value;
}

struct key_ref {
    idem_store *s;
    const void *key;
    uint32_t key_len;
    const uint8_t *payload; /* of the record that matched */
    uint32_t payload_len;
    uint64_t lsn;
    int corrupt; /* a candidate with the key's hash bits could not be read */
    int shared;  /* under rw's read side: wal_payload_shared */
};

static int key_eq(void *ctx, uint64_t addr)
{
    struct key_ref *k = ctx;
    uint32_t len;
    uint64_t lsn;
    const uint8_t *p = k->shared ? wal_payload_shared(k->s->wal, addr, &len, &lsn)
                                 : wal_payload(k->s->wal, addr, &len, &lsn);
    uint32_t klen;
    const uint8_t *key = p ? rec_key(p, len, &klen) : NULL;
    if (!key) {
        /* 56 hash bits match and the frame fails its checksum (or cannot hold a key): it is
         * almost surely this key. Answering "absent" could grant it twice: stop and report. */
        k->corrupt = 1;
        return 1;
    }
    if (klen != k->key_len || memcmp(key, k->key, klen) != 0) return 0;
    k->payload = p;
    k->payload_len = len;
    k->lsn = lsn;
    return 1;
}

/* ops_find, with the LSN of the key's frame as it is (replay: the log's end is not known yet). */
static struct index_slot *find_raw(idem_store *s, const void *key, uint32_t key_len, struct rec *r,
                                   uint64_t *lsn)
{
    struct key_ref k = {s, key, key_len, NULL, 0, 0, 0, 0};
    struct index_slot *slot = index_find(s->ix, ops_hash(s, key, key_len), key_eq, &k);
    s->find_corrupt = k.corrupt || (slot && rec_decode(k.payload, k.payload_len, r) < 0);
    if (!slot || s->find_corrupt) return NULL;
    *lsn = k.lsn;
    return slot;
}

struct index_slot *ops_find(idem_store *s, const void *key, uint32_t key_len, struct rec *r,
                            uint64_t *lsn)
{
    struct index_slot *slot = find_raw(s, key, key_len, r, lsn);
    /* An LSN can never be ahead of the log (guards a wait on a damaged frame). */
    if (slot && *lsn > wal_last_lsn(s->wal)) *lsn = wal_last_lsn(s->wal);
    return slot;
}

int ops_rec_expired(const struct rec *r, int64_t now)
{
    return r->state == IDEM_STATE_COMMITTED && now >= r->expires_at_ms;
}

/* ---- Repeat counters ---- */

static struct seen_info *seen_of(idem_store *s, const struct index_slot *slot)
{
    return slot && (slot->aux & SLOT_AUX_SEEN) ? store_seen_at(s, (slot->aux & SLOT_AUX_SEEN) - 1)
                                               : NULL;
}

void ops_prefetch_record(const idem_store *s, const struct index_slot *slot)
{
    wal_prefetch(s->wal, slot->addr_tag & INDEX_ADDR_MASK);
    /* Readers without the lock set aux by compare-and-swap (a counter taken): read it whole. */
    uint32_t aux = __atomic_load_n(&slot->aux, __ATOMIC_RELAXED);
    if (aux & SLOT_AUX_SEEN) __builtin_prefetch(store_seen_at(s, (aux & SLOT_AUX_SEEN) - 1));
}

void ops_seen_release(idem_store *s, struct index_slot *slot)
{
    if (!(slot->aux & SLOT_AUX_SEEN)) return;
    uint32_t i = (slot->aux & SLOT_AUX_SEEN) - 1;
    store_seen_at(s, i)->seen_count = s->seen_free;
    s->seen_free = i + 1;
    slot->aux &= SLOT_AUX_APART;
}

void ops_seen_return(idem_store *s, idem_queue *q)
{
    for (uint32_t i = q->seen_next; i < q->seen_end; i++) {
        store_seen_at(s, i)->seen_count = s->seen_free;
        s->seen_free = i + 1;
    }
    q->seen_next = q->seen_end = 0;
}

void ops_slot_mark(struct index_slot *slot, const struct rec *r)
{
    int apart = r->state != IDEM_STATE_COMMITTED || r->mismatch_count > 0;
    slot->aux = (slot->aux & SLOT_AUX_SEEN) | (apart ? SLOT_AUX_APART : 0);
}

/* Allocates the next tier or chunk of the repeat counters (store.h). Returns 0, or -1. */
static int seen_grow(idem_store *s)
{
    uint32_t cap = s->seen_cap;
    if (cap < SEEN_CHUNK) {
        uint32_t n = cap ? cap : 1u << SEEN_TIER0_BITS; /* as many as all tiers before */
        struct seen_info *t = malloc(n * sizeof *t);
        if (!t) return -1;
        s->seen_tier[store_seen_tier(cap)] = t;
        __atomic_store_n(&s->seen_cap, cap + n, __ATOMIC_RELEASE); /* after t (read_seen_take) */
        return 0;
    }
    if ((cap >> SEEN_CHUNK_BITS) == SEEN_CHUNKS_MAX) return -1;
    /* Read at random: on a huge page where malloc's heap is (huge_pages.c), which the first
     * entry taken faults in under mu (design.md, known gaps). */
    struct seen_info *c = aligned_alloc(SEEN_CHUNK * sizeof *c, SEEN_CHUNK * sizeof *c);
    if (!c) return -1;
    s->seen_chunk[cap >> SEEN_CHUNK_BITS] = c;
    __atomic_store_n(&s->seen_cap, cap + SEEN_CHUNK, __ATOMIC_RELEASE);
    return 0;
}

int ops_seen_set(idem_store *s, struct index_slot *slot, uint64_t seen_count, int64_t last_ms)
{
    struct seen_info *si = seen_of(s, slot);
    if (!si) { /* a free entry: a freed one first, else off the table's end */
        uint32_t i;
        if (s->seen_free) {
            i = s->seen_free - 1;
            s->seen_free = (uint32_t)store_seen_at(s, i)->seen_count;
        } else {
            if (s->seen_used == s->seen_cap && seen_grow(s) != 0) return IDEM_ENOMEM;
            i = s->seen_used++;
        }
        slot->aux = (slot->aux & SLOT_AUX_APART) | (i + 1);
        si = store_seen_at(s, i);
    }
    si->seen_count = seen_count;
    si->last_seen_ms = last_ms;
    return 0;
}

/* Counts a repeat that writes nothing. Returns 0 or IDEM_ENOMEM (then the count is lost). */
static int seen_bump(idem_store *s, struct index_slot *slot, const struct rec *r, int64_t now)
{
    struct seen_info *si = seen_of(s, slot);
    return ops_seen_set(s, slot, (si ? si->seen_count : r->seen_count) + 1, now);
}

/* ---- Writing versions ---- */

/* What the store counts about the version at addr: its bytes, mismatch count and version. */
struct old_facts {
    uint64_t bytes, mismatch_count, version;
};

static struct old_facts old_facts(idem_store *s, uint64_t addr)
{
    struct old_facts o = {0, 0, 0};
    uint32_t len;
    uint64_t lsn;
    const uint8_t *p = addr ? wal_payload(s->wal, addr, &len, &lsn) : NULL;
    if (p) {
        o.bytes = (uint64_t)len + WAL_FRAME_HDR;
        if (rec_facts(p, len, &o.version, &o.mismatch_count) < 0) o.version = o.mismatch_count = 0;
    }
    return o;
}

/* The key's version moves from old to the frame at new_addr (0: the key is gone): live bytes,
 * keys with mismatches, the expiry horizon of new_addr's segment and the attention heaps
 * follow. r is the new version (NULL when gone), h its key's hash. */
static void version_moved(idem_store *s, const struct old_facts *old, uint64_t new_addr,
                          uint64_t new_bytes, const struct rec *r, uint64_t h)
{
    s->live_bytes -= old->bytes;
    s->st.keys_with_mismatch -= old->mismatch_count > 0;
    if (!r) return;
    s->live_bytes += new_bytes;
    s->st.keys_with_mismatch += r->mismatch_count > 0;
    uint64_t seq = wal_addr_seq(s->wal, new_addr);
    int64_t *m = &s->seg_max_exp[seq % WAL_SEG_SLOTS];
    int64_t exp = ops_rec_unfinished_past_ttl(r, __atomic_load_n(&s->clk_last_ms, __ATOMIC_RELAXED))
                      ? INT64_MAX
                      : r->expires_at_ms;
    /* A segment written before this open (its records replayed, or the open's current one
     * written on) stays unknown until compact_learn_horizon measures all of it: from part of
     * its records it looked expired while records before the open lived on, and a walk copied
     * them. */
    if (*m != SEG_EXP_UNKNOWN) {
        if (exp > *m) *m = exp;
        compact_tally(s, seq, exp, new_bytes);
    }
    ages_note(s, r, h, new_addr);
}

static void state_count(idem_store *s, int state, int delta)
{
    uint64_t *c = state == IDEM_STATE_IN_FLIGHT   ? &s->st.keys_in_flight
                  : state == IDEM_STATE_COMMITTED ? &s->st.keys_committed
                  : state == IDEM_STATE_REVIEW    ? &s->st.keys_review
                                                  : NULL;
    if (c) *c += (uint64_t)(int64_t)delta;
}

/* A new key refused at a limit: compaction is pressed to take expired keys out of the index
 * (compact.c), once a second. */
static void compaction_press(idem_store *s, int64_t now)
{
    if (!s->cap_full_seen || now - s->cap_full_ms >= 1000) store_kick(s);
    s->cap_full_seen = 1;
    s->cap_full_ms = now;
}

/* A new key the index found no room for, every limit unreached: no memory for its next block,
 * or keys sharing 24 bits of their hash filled its deepest segment. Answered FULL (nothing is
 * stored or evicted), counted, and named in the log (once a minute at most). */
static int index_refusal_noted(idem_store *s)
{
    s->st.index_refusals++;
    compaction_press(s, store_now(s));
    if (log_gate_open(&s->index_refused_said, s->clock.monotonic_ms(s->clock.ctx), 60000))
        fprintf(stderr,
                "idem: event=full reason=\"the index cannot grow: no memory for its next block, "
                "or too many keys share their hash bits\" dir=%s refusals=%llu\n",
                s->dir, (unsigned long long)s->st.index_refusals);
    return IDEM_EFULL;
}

/* Writes version r of key (result given raw; compressed here when that saves space). slot is
 * the key's current slot or NULL for a new key. Returns 0 and *lsn, or an error (nothing
 * changed). Slot pointers are invalid afterwards. */
static int write_version(idem_store *s, struct index_slot *slot, int old_state, struct rec *r,
                         const void *key, const void *owner, const void *note, const void *result,
                         uint32_t result_len, uint64_t *lsn)
{
    if (ages_room(s, r) < 0) return IDEM_ENOMEM; /* before anything changes */
    struct seen_info *si = seen_of(s, slot);
    if (si) {
        r->seen_count = si->seen_count;
        r->last_seen_ms = si->last_seen_ms;
    }
    r->flags &= (uint8_t)~REC_F_LZ4;
    r->result_raw_len = result_len;
    r->result_len = result_len;
    const void *stored = result;
    if (result_len >= OPS_LZ4_MIN) {
        int bound = LZ4_compressBound((int)result_len);
        if ((size_t)bound > s->scratch_cap) {
            uint8_t *n = realloc(s->scratch, (size_t)bound);
            if (n) {
                s->scratch = n;
                s->scratch_cap = (size_t)bound;
            }
        }
        if ((size_t)bound <= s->scratch_cap) {
            int c = LZ4_compress_default(result, (char *)s->scratch, (int)result_len, bound);
            if (c > 0 && (uint32_t)c < result_len - result_len / 8) {
                stored = s->scratch;
                r->result_len = (uint32_t)c;
                r->flags |= REC_F_LZ4;
            }
        }
    }
    struct old_facts old = old_facts(s, old_state ? index_slot_addr(slot) : 0);
    /* Versions of a record only grow; an imported version (ahead of this log's LSNs) is kept.
     * For every other change r->version holds the old version, below both bounds. */
    uint64_t v = wal_last_lsn(s->wal) + 1;
    if (old.version >= v) v = old.version + 1;
    if (r->version < v) r->version = v;
    uint8_t head[REC_ENCODE_ROOM];
    uint32_t head_len = rec_encode(r, head);
    const void *parts[5] = {head, key, owner, note, stored};
    uint32_t lens[5] = {head_len, r->key_len, r->owner_len, r->note_len, r->result_len};
    /* The index keeps 56 of the hash's bits, all that inserts and the age heaps use: a key
     * already in the index is not hashed again (the key bytes may be the record's own). */
    uint64_t h = slot ? index_slot_hash_bits(slot) : ops_hash(s, key, r->key_len);
    if (!slot) {
        /* Insert first, so a failed insert leaves nothing in the log. */
        slot = index_insert(s->ix, h, 1, 0);
        if (!slot) return index_refusal_noted(s);
    }
    uint64_t addr;
    int rc = wal_append(s->wal, WAL_T_RECORD, parts, lens, 5, &addr, lsn);
    if (rc < 0) {
        if (old_state == 0) index_remove(s->ix, slot);
        return rc;
    }
    ops_seen_release(s, slot);
    index_slot_set_addr(slot, addr);
    ops_slot_mark(slot, r);
    uint64_t bytes = WAL_FRAME_HDR;
    for (int i = 0; i < 5; i++)
        bytes += lens[i];
    version_moved(s, &old, addr, IDEM_ALIGN_UP(bytes, 8), r, h);
    state_count(s, old_state, -1);
    state_count(s, r->state, +1);
    return 0;
}

static int write_delete(idem_store *s, struct index_slot *slot, int old_state, const void *key,
                        uint32_t key_len, uint64_t *lsn)
{
    uint8_t hdr[8] = {0};
    util_put_u16(hdr, (uint16_t)key_len);
    const void *parts[2] = {hdr, key};
    uint32_t lens[2] = {8, key_len};
    uint64_t addr;
    int rc = wal_append(s->wal, WAL_T_DELETE, parts, lens, 2, &addr, lsn);
    if (rc < 0) return rc;
    struct old_facts old = old_facts(s, index_slot_addr(slot));
    ops_seen_release(s, slot);
    index_remove(s->ix, slot);
    version_moved(s, &old, 0, 0, NULL, 0);
    state_count(s, old_state, -1);
    return 0;
}

/* ---- Filling completions ---- */

static int copy_result(struct qslot *sl, const struct rec *r, const void **out, uint32_t *len)
{
    if (r->result_len == 0) {
        *out = "";
        *len = 0;
        return 0;
    }
    if (!(r->flags & REC_F_LZ4)) {
        *out = qslot_copy(sl, r->result, r->result_len);
        *len = r->result_len;
        return *out ? 0 : IDEM_ENOMEM;
    }
    char *dst = qslot_reserve(sl, r->result_raw_len);
    if (!dst) return IDEM_ENOMEM;
    int n = LZ4_decompress_safe((const char *)r->result, dst, (int)r->result_len,
                                (int)r->result_raw_len);
    if (n < 0 || (uint32_t)n != r->result_raw_len) return IDEM_ECORRUPT;
    sl->buf_used += r->result_raw_len;
    *out = dst;
    *len = r->result_raw_len;
    return 0;
}

void ops_fill_record(struct qslot *sl, const struct rec *r, struct index_slot *slot, idem_store *s)
{
    idem_record *o = &sl->ext->record;
    memset(o, 0, sizeof *o);
    o->key = qslot_copy(sl, r->key, r->key_len);
    o->key_len = r->key_len;
    o->state = r->state;
    o->first_seen_ms = r->first_seen_ms;
    o->expires_at_ms = r->expires_at_ms;
    struct seen_info *si = seen_of(s, slot);
    o->last_seen_ms = si ? si->last_seen_ms : r->last_seen_ms;
    o->seen_count = si ? si->seen_count : r->seen_count;
    o->has_fp = !!(r->flags & REC_F_FP);
    memcpy(o->fp, r->fp, 16);
    if (r->state == IDEM_STATE_IN_FLIGHT) {
        o->lease_until_ms = r->lease_until_ms;
        o->token = r->token;
        if (r->owner_len) {
            o->owner = qslot_copy(sl, r->owner, r->owner_len);
            o->owner_len = r->owner_len;
        }
    }
    o->attempts = r->attempts;
    o->last_grant_ms = r->last_grant_ms;
    int rc = r->state == IDEM_STATE_COMMITTED ? copy_result(sl, r, &o->result, &o->result_len) : 0;
    if (rc < 0) sl->c.err = rc; /* IDEM_ECORRUPT, or IDEM_ENOMEM */
    if (r->note_len) {
        o->note = qslot_copy(sl, r->note, r->note_len);
        o->note_len = r->note_len;
    }
    o->mismatch_count = r->mismatch_count;
    o->last_mismatch_ms = r->last_mismatch_ms;
    o->has_last_mismatch_fp = !!(r->flags & REC_F_MFP);
    memcpy(o->last_mismatch_fp, r->last_mismatch_fp, 16);
    o->version = r->version;
    sl->c.found = 1;
    /* A field with no room for its copy: the record is not handed out with a NULL in its place
     * (a reader would take key_len bytes from it). */
    if (!sl->c.err && (!o->key || (o->owner_len && !o->owner) || (o->note_len && !o->note)))
        sl->c.err = IDEM_ENOMEM;
}

/* ---- Validation ---- */

static int op_valid(const idem_store *s, const idem_op *op)
{
    if (op->flags & ~OPS_KNOWN_FLAGS) return 0;
    if ((op->flags & IDEM_F_WITH_NEXT) && op->kind != IDEM_OP_DEL) return 0;
    if (op->kind != IDEM_OP_SYNC &&
        (!op->key || op->key_len == 0 || op->key_len > IDEM_KEY_BYTES_MAX))
        return 0;
    switch (op->kind) {
    case IDEM_OP_CLAIM:
        return op->ttl_ms >= 1 && op->ttl_ms <= IDEM_TTL_MS_MAX && op->lease_ms >= 1 &&
               op->lease_ms <= IDEM_LEASE_MS_MAX && op->wait_ms <= IDEM_WAIT_MS_MAX &&
               (op->fp || !op->fp_len) && (op->owner || !op->owner_len) &&
               op->owner_len <= IDEM_OWNER_BYTES_MAX;
    case IDEM_OP_COMMIT:
        return op->token > 0 && (op->data || !op->data_len) &&
               op->data_len <= s->opt.result_bytes_max;
    case IDEM_OP_RELEASE:
        return op->token > 0;
    case IDEM_OP_HOLD:
        return op->token > 0 && (op->data || !op->data_len) && op->data_len <= IDEM_NOTE_BYTES_MAX;
    case IDEM_OP_EXTEND:
        return op->token > 0 && op->lease_ms >= 1 && op->lease_ms <= IDEM_LEASE_MS_MAX;
    case IDEM_OP_GET:
    case IDEM_OP_SYNC:
        return 1;
    case IDEM_OP_SET_IF_ABSENT:
        return op->ttl_ms >= 1 && op->ttl_ms <= IDEM_TTL_MS_MAX && (op->data || !op->data_len) &&
               op->data_len <= s->opt.result_bytes_max;
    case IDEM_OP_DEL:
        return !op->actor || strlen(op->actor) <= IDEM_ACTOR_BYTES_MAX;
    case IDEM_OP_RESOLVE: /* the reason goes to the audit trail, which reads it up to a NUL;
                             a result goes with commit only (release and settle write none) */
        return op->action >= IDEM_RESOLVE_COMMIT && op->action <= IDEM_RESOLVE_SETTLE && op->data &&
               op->data_len >= 1 && op->data_len <= IDEM_NOTE_BYTES_MAX &&
               !memchr(op->data, 0, op->data_len) && (op->result || !op->result_len) &&
               (op->action == IDEM_RESOLVE_COMMIT || (!op->result && !op->result_len)) &&
               op->result_len <= s->opt.result_bytes_max &&
               (!op->actor || strlen(op->actor) <= IDEM_ACTOR_BYTES_MAX);
    default:
        return 0;
    }
}

/* ---- Claim ---- */

static int fp_differs(const struct rec *r, const idem_op *op, const uint8_t fp[16])
{
    return op->fp && (r->flags & REC_F_FP) && memcmp(r->fp, fp, 16) != 0;
}

static int owner_same(const struct rec *r, const idem_op *op)
{
    return op->owner && op->owner_len && r->owner_len == op->owner_len &&
           memcmp(r->owner, op->owner, op->owner_len) == 0;
}

/* Whether a new version of key is refused by a capacity limit. One that replaces an expired
 * record (replaces: its slot) adds no key and no index memory: only the disk limit applies to
 * it, so a store full of expired keys still takes their re-issue. The memory limit refuses a new
 * key only when its insert would grow the index past the limit: the index's blocks stay when
 * keys leave, and a slot a removal freed is used again. A new key refused by the key or memory
 * limit presses compaction (compact.c) to take the expired keys out of the index. */
static int memory_full(const struct index *ix, uint64_t h, uint64_t max)
{
    size_t live = index_live_bytes(ix), room = max > live ? (size_t)(max - live) : 0;
    return index_insert_growth(ix, h, room) > room;
}

static int capacity_full(idem_store *s, const struct index_slot *replaces, const void *key,
                         uint32_t key_len, int64_t now)
{
    /* The log reached the end of a full disk, and the room kept for compaction and checkpoints
     * was let go for them (store.c, spare_make_kept). Compaction is not pressed: a walk of a
     * segment an eighth expired would copy the rest into room it cannot give back, and the
     * roll that presses ends the current segment early. */
    if (s->reserve.released) return 1;
    if (s->opt.max_disk_bytes && store_disk_bytes(s) >= s->opt.max_disk_bytes) return 1;
    if (replaces) return 0;
    /* The index's blocks: not the memory its thread faults in ahead of growth, which comes as
     * that thread runs, so the answer does not depend on the thread's timing. */
    if (!(s->opt.max_keys && index_count(s->ix) >= s->opt.max_keys) &&
        !(s->opt.max_memory_bytes &&
          memory_full(s->ix, ops_hash(s, key, key_len), s->opt.max_memory_bytes)))
        return 0;
    compaction_press(s, now);
    return 1;
}

static void claim_new(idem_store *s, struct qslot *sl, const idem_op *op, const uint8_t fp[16],
                      struct index_slot *slot, int old_state, int64_t now)
{
    if (capacity_full(s, slot, op->key, op->key_len, now)) {
        sl->c.err = IDEM_EFULL;
        return;
    }
    struct rec r = {0};
    r.state = IDEM_STATE_IN_FLIGHT;
    r.key_len = (uint16_t)op->key_len;
    r.owner_len = (uint16_t)op->owner_len;
    r.first_seen_ms = r.last_seen_ms = r.last_grant_ms = now;
    r.expires_at_ms = now + (int64_t)op->ttl_ms;
    r.lease_until_ms = now + (int64_t)op->lease_ms;
    r.seen_count = 1;
    r.attempts = 1;
    if (op->fp) {
        r.flags |= REC_F_FP;
        memcpy(r.fp, fp, 16);
    }
    int rc = store_next_token(s, &r.token);
    if (rc == 0) {
        if (slot) ops_seen_release(s, slot); /* an expired record's counters do not carry over */
        rc =
            write_version(s, slot, old_state, &r, op->key, op->owner, NULL, NULL, 0, &sl->need_lsn);
    }
    if (rc < 0) {
        sl->c.err = rc;
        return;
    }
    if (old_state) s->st.expired_total++;
    sl->c.outcome = IDEM_NEW;
    sl->c.token = r.token;
    s->st.claims_new++;
}

static int waiter_of_key(const struct qslot *sl, const void *key, uint32_t key_len)
{
    return sl->ext->op.key_len == key_len && !memcmp(sl->ext->op.key, key, key_len);
}

/* The owner's claim again, made while the claims parked on its key are being re-run, moved the
 * lease's end to lease_until: those re-run before it noted the old end, and would run only at
 * their own deadline. Theirs is set to the new end, and when they are due is noted again. */
static void waiters_lease_moved(idem_store *s, const void *key, uint32_t key_len,
                                int64_t lease_until, int64_t now)
{
    int64_t mono = s->clock.monotonic_ms(s->clock.ctx);
    uint64_t h = key_hash(s, key, key_len);
    for (struct qslot *sl = waiters_of_hash(s, h); sl; sl = sl->ext->bnext) {
        if (sl->ext->whash != h || !waiter_of_key(sl, key, key_len) ||
            sl->ext->lease_end_ms <= lease_until)
            continue;
        sl->ext->lease_end_ms = lease_until;
        waiters_note_due(s, sl, mono, now);
    }
}

/* What a claim does with an unexpired record it finds. The one place that decides: the claim
 * itself (claim_existing) and the check that a parked claim's re-run writes nothing
 * (claim_reads_only) both ask it. A mismatch, a resume and a lease run out write a version. */
enum claim_path { CP_MISMATCH, CP_DONE, CP_REVIEW, CP_RESUME, CP_BUSY, CP_LEASE_OUT };

static enum claim_path claim_path_of(const struct rec *r, const idem_op *op, const uint8_t fp[16],
                                     int64_t now)
{
    if (fp_differs(r, op, fp)) return CP_MISMATCH; /* a review record's answers review */
    if (r->state == IDEM_STATE_COMMITTED) return CP_DONE;
    if (r->state == IDEM_STATE_REVIEW) return CP_REVIEW;
    if (now < r->lease_until_ms) return owner_same(r, op) ? CP_RESUME : CP_BUSY;
    return CP_LEASE_OUT;
}

/* A claim that meets an unfinished or committed record: sl gets the outcome, counted only once
 * its change is made (a claim answered FULL recorded no mismatch and no recovery). */
static void claim_existing(idem_store *s, struct qslot *sl, const idem_op *op, const uint8_t fp[16],
                           struct index_slot *slot, struct rec *r, uint64_t lsn, int64_t now,
                           int waking)
{
    const void *owner = r->owner, *note = r->note;
    int rc = 0;
    sl->need_lsn = lsn;
    enum claim_path path = claim_path_of(r, op, fp, now);
    if (path == CP_MISMATCH) { /* counted in mismatches too, answered mismatch or review */
        /* Rule 3: recorded, nothing else changes. A record in review is answered `review` with
         * its note (the outcome table), the other content recorded all the same: the person who
         * decides it sees that a request of other content came for the key meanwhile. */
        if (r->state == IDEM_STATE_REVIEW) {
            sl->c.data = qslot_copy(sl, r->note, r->note_len);
            sl->c.data_len = r->note_len;
        }
        r->mismatch_count++;
        r->last_mismatch_ms = now;
        memcpy(r->last_mismatch_fp, fp, 16);
        r->flags |= REC_F_MFP;
        if (!waking && seen_bump(s, slot, r, now) < 0) r->seen_count++;
        const void *result = NULL;
        uint32_t result_len = 0;
        if (r->state == IDEM_STATE_COMMITTED) rc = copy_result(sl, r, &result, &result_len);
        if (rc == 0)
            rc = write_version(s, slot, r->state, r, r->key, owner, note, result, result_len,
                               &sl->need_lsn);
        sl->c.outcome = r->state == IDEM_STATE_REVIEW ? IDEM_REVIEW : IDEM_MISMATCH;
        goto out;
    }
    if (path == CP_DONE) {
        if (!waking) seen_bump(s, slot, r, now);
        rc = copy_result(sl, r, &sl->c.data, &sl->c.data_len);
        sl->c.outcome = IDEM_DONE;
        goto out;
    }
    if (path == CP_REVIEW) {
        if (!waking) seen_bump(s, slot, r, now);
        sl->c.data = qslot_copy(sl, r->note, r->note_len);
        sl->c.data_len = r->note_len;
        sl->c.outcome = IDEM_REVIEW;
        goto out;
    }
    if (path == CP_RESUME || path == CP_BUSY) {
        if (path == CP_RESUME) {
            /* The same worker again: resume with the same token, the lease runs on. */
            r->lease_until_ms = now + (int64_t)op->lease_ms;
            if (!waking) seen_bump(s, slot, r, now);
            rc = write_version(s, slot, r->state, r, r->key, owner, note, NULL, 0, &sl->need_lsn);
            sl->c.outcome = IDEM_NEW;
            sl->c.token = r->token;
            if (rc == 0 && !waking) ops_wake(s, op->key, op->key_len); /* the lease moved */
            if (rc == 0 && waking)
                waiters_lease_moved(s, op->key, op->key_len, r->lease_until_ms, now);
            goto out;
        }
        if (!waking) seen_bump(s, slot, r, now);
        sl->c.outcome = IDEM_BUSY;
        sl->c.lease_left_ms = r->lease_until_ms - now;
        goto out;
    }
    /* Rule 6: the lease ran out; the transition is made and logged now. */
    if (!waking) seen_bump(s, slot, r, now);
    if (s->opt.lease_policy == IDEM_LEASE_REVIEW) {
        static const char why[] = "lease expired";
        r->state = IDEM_STATE_REVIEW;
        r->token = 0; /* the old owner's token is stale from here on */
        r->note_len = sizeof why - 1;
        rc = write_version(s, slot, IDEM_STATE_IN_FLIGHT, r, r->key, owner, why, NULL, 0,
                           &sl->need_lsn);
        sl->c.outcome = IDEM_REVIEW;
        sl->c.data = why;
        sl->c.data_len = sizeof why - 1;
        goto out;
    }
    int64_t prev_grant = r->last_grant_ms;
    rc = store_next_token(s, &r->token);
    if (rc < 0) goto out;
    r->attempts++;
    r->last_grant_ms = now;
    r->lease_until_ms = now + (int64_t)op->lease_ms;
    r->owner_len = (uint16_t)op->owner_len;
    rc = write_version(s, slot, r->state, r, r->key, op->owner, note, NULL, 0, &sl->need_lsn);
    sl->c.outcome = IDEM_RECOVER;
    sl->c.token = r->token;
    sl->c.attempts = r->attempts;
    sl->c.last_grant_ms = prev_grant;
out:
    if (rc < 0) {
        sl->c.err = rc;
        sl->c.outcome = 0;
        return; /* counted as nothing: no mismatch or recovery was recorded */
    }
    if (path == CP_MISMATCH) s->st.mismatches++;
    switch (sl->c.outcome) {
    case IDEM_MISMATCH:
        s->st.claims_mismatch++;
        break;
    case IDEM_DONE:
        s->st.claims_done++;
        break;
    case IDEM_REVIEW:
        s->st.claims_review++;
        break;
    case IDEM_NEW:
        s->st.claims_new++;
        break; /* the same owner resumed */
    case IDEM_BUSY:
        if (!waking) s->st.claims_busy++; /* a parked claim's re-runs are not claims */
        break;
    case IDEM_RECOVER:
        s->st.claims_recover++;
        s->st.recoveries++;
        break;
    }
}

/* Returns 1 when the claim should be parked (busy with WAIT). now: the store clock's reading. */
static int op_claim(idem_store *s, struct qslot *sl, const idem_op *op, int waking, int64_t now)
{
    uint8_t fp[16] = {0};
    if (op->fp && waking)
        memcpy(fp, op->fp, 16); /* parked with its digest (park) */
    else if (op->fp)
        idem_fingerprint(op->fp, op->fp_len, fp);
    struct rec r;
    uint64_t lsn;
    struct index_slot *slot = ops_find(s, op->key, op->key_len, &r, &lsn);
    if (!slot && s->find_corrupt) {
        sl->c.err = IDEM_ECORRUPT;
        return 0;
    }
    if (!slot || ops_rec_expired(&r, now)) {
        sl->need_lsn = wal_last_lsn(s->wal);
        claim_new(s, sl, op, fp, slot, slot ? r.state : 0, now);
        return 0;
    }
    /* The record's bytes may move when the log appends: copy what a version rewrite needs. */
    claim_existing(s, sl, op, fp, slot, &r, lsn, now, waking);
    if (sl->c.outcome == IDEM_BUSY && op->wait_ms && !s->closing && !s->no_wait) {
        sl->ext->lease_end_ms = r.lease_until_ms;
        return 1;
    }
    return 0;
}

/* ---- Claims of committed keys under rw's read side ---- */

/* A claim that finds its key committed and unexpired, with no other fingerprint, only counts a
 * repeat and copies the result: many threads answer such claims at once, holding rw's read side
 * (store.h). Nothing is written but the key's repeat counters (atomics; a new entry by an
 * atomic bump of the table's end, or under seen_mu from the free list or a grown table), the
 * store clock's last reading and the claim tallies (atomics, at the run's end).
 * Anything else goes to the locked path, which sees the same store: rw keeps every writer out. */

int ops_read_begin(idem_store *s, struct read_run *run)
{
    run->done = run->counted = 0;
    if (s->fatal || s->closing || s->opt.read_only) return 0;
    int64_t mono = s->clock.monotonic_ms(s->clock.ctx);
    int64_t now = __atomic_load_n(&s->clk_last_ms, __ATOMIC_RELAXED);
    if (!s->opt.test_clock) {
        /* store_now without its step towards the wall clock, which writes: that is left to
         * the locked path, once a second. */
        if (mono - s->clk_mono_ms >= 1000) return 0;
        int64_t est = s->clk_store_ms + (mono - s->clk_mono_ms);
        if (est > now) now = est;
        util_atomic_max_i64(&s->clk_last_ms, now); /* the clock never goes back */
    }
    int64_t sec = mono / 1000;
    run->minute = (int)(sec % 60);
    if (s->minute[run->minute].second != sec) return 0; /* a new second: store_count_claim */
    run->now = now;
    return 1;
}

int ops_read_find(const idem_store *s, const idem_op *op, const uint64_t *hash,
                  const struct read_run *run, struct read_hit *hit)
{
    if (op->kind != IDEM_OP_CLAIM || !op_valid(s, op)) return 0;
    struct key_ref k = {(idem_store *)s, op->key, op->key_len, NULL, 0, 0, 0, 1};
    uint64_t h = hash ? *hash : key_hash(s, op->key, op->key_len);
    hit->slot = index_lookup(s->ix, h, key_eq, &k);
    if (!hit->slot || k.corrupt || rec_decode(k.payload, k.payload_len, &hit->r) < 0) return 0;
    if (hit->r.state != IDEM_STATE_COMMITTED || ops_rec_expired(&hit->r, run->now)) return 0;
    uint8_t fp[16] = {0};
    if (op->fp) idem_fingerprint(op->fp, op->fp_len, fp);
    if (fp_differs(&hit->r, op, fp)) return 0;
    uint64_t last = wal_last_lsn(s->wal);
    hit->lsn = k.lsn <= last ? k.lsn : last;
    return 1;
}

#define SEEN_TAKE 64 /* entries a queue's readers take off the end of the table at once */

/* A free entry of the repeat counters for a reader of q: from those q took ahead; else off the
 * end of the table by an atomic bump while it has room and no freed entry waits, SEEN_TAKE at
 * once (one contended bump per entry cost the uniform repeats of 10 Mi keys a bounce of the
 * counter's line between the cores each); the free list and growth under seen_mu. Returns 0 or
 * IDEM_ENOMEM. */
static int read_seen_take(idem_store *s, idem_queue *q, uint32_t *i)
{
    if (q->seen_next < q->seen_end) {
        *i = q->seen_next++;
        return 0;
    }
    uint32_t used = __atomic_load_n(&s->seen_used, __ATOMIC_RELAXED), cap;
    while (__atomic_load_n(&s->seen_free, __ATOMIC_RELAXED) == 0 &&
           used < (cap = __atomic_load_n(&s->seen_cap, __ATOMIC_ACQUIRE))) {
        uint32_t take = cap - used < SEEN_TAKE ? cap - used : SEEN_TAKE;
        if (__atomic_compare_exchange_n(&s->seen_used, &used, used + take, 1, __ATOMIC_RELAXED,
                                        __ATOMIC_RELAXED)) {
            *i = used;
            q->seen_next = used + 1;
            q->seen_end = used + take;
            return 0;
        }
    }
    int rc = 0;
    pthread_mutex_lock(&s->seen_mu);
    if (s->seen_free) {
        *i = s->seen_free - 1;
        __atomic_store_n(&s->seen_free, (uint32_t)store_seen_at(s, *i)->seen_count,
                         __ATOMIC_RELAXED);
    } else {
        for (used = __atomic_load_n(&s->seen_used, __ATOMIC_RELAXED);;) {
            if (used >= s->seen_cap && seen_grow(s) != 0) {
                rc = IDEM_ENOMEM;
                break;
            }
            if (__atomic_compare_exchange_n(&s->seen_used, &used, used + 1, 1, __ATOMIC_RELAXED,
                                            __ATOMIC_RELAXED)) {
                *i = used;
                break;
            }
        }
    }
    pthread_mutex_unlock(&s->seen_mu);
    return rc;
}

/* seen_bump for a reader. */
static void read_seen_bump(idem_store *s, idem_queue *q, struct index_slot *slot,
                           const struct rec *r, int64_t now)
{
    uint32_t aux = __atomic_load_n(&slot->aux, __ATOMIC_ACQUIRE);
    if (!(aux & SLOT_AUX_SEEN)) {
        uint32_t i;
        if (read_seen_take(s, q, &i) != 0)
            return; /* out of memory: the count is lost (seen_bump) */
        struct seen_info *si = store_seen_at(s, i);
        si->seen_count = r->seen_count + 1;
        si->last_seen_ms = now;
        /* Published filled in (another reader may follow aux at once), unless another reader
         * published an entry for this key first: then that one counts this repeat, and i goes
         * back to the free list. */
        if (__atomic_compare_exchange_n(&slot->aux, &aux, (aux & SLOT_AUX_APART) | (i + 1), 0,
                                        __ATOMIC_RELEASE, __ATOMIC_ACQUIRE))
            return;
        pthread_mutex_lock(&s->seen_mu);
        si->seen_count = s->seen_free;
        __atomic_store_n(&s->seen_free, i + 1, __ATOMIC_RELAXED);
        pthread_mutex_unlock(&s->seen_mu);
    }
    struct seen_info *si = store_seen_at(s, (aux & SLOT_AUX_SEEN) - 1);
    __atomic_fetch_add(&si->seen_count, 1, __ATOMIC_RELAXED);
    util_atomic_max_i64(&si->last_seen_ms, now);
}

void ops_read_answer(idem_store *s, struct qslot *sl, const struct read_hit *hit,
                     struct read_run *run)
{
    read_seen_bump(s, run->q, hit->slot, &hit->r, run->now);
    sl->need_lsn = hit->lsn;
    run->done++;
    int rc = copy_result(sl, &hit->r, &sl->c.data, &sl->c.data_len);
    if (rc < 0) {
        sl->c.err = rc;
        return;
    }
    sl->c.outcome = IDEM_DONE;
    run->counted++;
}

void ops_read_end(idem_store *s, const struct read_run *run)
{
    if (run->done == 0) return;
    __atomic_fetch_add(&s->st.claims_done, run->counted, __ATOMIC_RELAXED); /* answered done */
    __atomic_fetch_add(&s->minute[run->minute].claims, run->counted, __ATOMIC_RELAXED);
    __atomic_fetch_add(&s->minute[run->minute].duplicates, run->counted, __ATOMIC_RELAXED);
    __atomic_fetch_add(&s->reads_answered, run->done, __ATOMIC_RELAXED);
}

/* ---- Owner calls ---- */

/* Looks up the key for an owner call; fills the completion for absent/stale and returns NULL
 * then. */
static struct index_slot *owner_lookup(idem_store *s, struct qslot *sl, const idem_op *op,
                                       struct rec *r, int64_t now)
{
    uint64_t lsn;
    struct index_slot *slot = ops_find(s, op->key, op->key_len, r, &lsn);
    if (!slot || ops_rec_expired(r, now)) {
        sl->need_lsn = wal_last_lsn(s->wal);
        sl->c.err = !slot && s->find_corrupt ? IDEM_ECORRUPT : IDEM_ENOTFOUND;
        if (slot && store_clock_need(s, r->expires_at_ms) < 0) sl->c.err = IDEM_EFATAL;
        return NULL;
    }
    sl->need_lsn = lsn;
    return slot;
}

/* Rule 7: a commit repeated by the owner with another result: the target may have handed out
 * two references for one key. Counted, and the key named in the log (once a second at most:
 * the count says the rest), so an operator can find the record and the target's references. */
static void conflict_noted(idem_store *s, const idem_op *op)
{
    s->st.conflicting_commits++;
    if (!log_gate_open(&s->conflict_said, s->clock.monotonic_ms(s->clock.ctx), 1000)) return;
    char key[96];
    util_printable(key, sizeof key, op->key, op->key_len);
    fprintf(stderr,
            "idem: event=conflicting_commit dir=%s key=\"%s\" key_len=%u token=%lld "
            "conflicting_commits=%llu\n",
            s->dir, key, op->key_len, (long long)op->token,
            (unsigned long long)s->st.conflicting_commits);
}

static void op_commit(idem_store *s, struct qslot *sl, const idem_op *op)
{
    int64_t now = store_now(s);
    struct rec r;
    struct index_slot *slot = owner_lookup(s, sl, op, &r, now);
    if (!slot) return;
    if (r.token != op->token || r.state == IDEM_STATE_REVIEW) {
        sl->c.err = IDEM_ESTALE;
        return;
    }
    if (r.state == IDEM_STATE_COMMITTED) {
        const void *old;
        uint32_t old_len;
        int rc = copy_result(sl, &r, &old, &old_len);
        if (rc == 0 && (old_len != op->data_len || memcmp(old, op->data, old_len) != 0)) {
            rc = IDEM_ECONFLICT;
            conflict_noted(s, op);
        }
        sl->c.err = rc;
        return;
    }
    r.state = IDEM_STATE_COMMITTED;
    r.owner_len = 0;
    r.lease_until_ms = 0;
    if (now >= r.expires_at_ms)
        r.expires_at_ms = now + (r.expires_at_ms - r.first_seen_ms); /* rule 5 */
    sl->c.err = write_version(s, slot, IDEM_STATE_IN_FLIGHT, &r, r.key, NULL, r.note, op->data,
                              op->data_len, &sl->need_lsn);
    if (sl->c.err == 0) ops_wake(s, op->key, op->key_len);
}

/* owner_lookup for calls that need the caller to own a running claim (release, extend). */
static struct index_slot *owner_in_flight(idem_store *s, struct qslot *sl, const idem_op *op,
                                          struct rec *r, int64_t now)
{
    struct index_slot *slot = owner_lookup(s, sl, op, r, now);
    if (slot && (r->token != op->token || r->state != IDEM_STATE_IN_FLIGHT)) {
        sl->c.err = IDEM_ESTALE;
        return NULL;
    }
    return slot;
}

static void op_release(idem_store *s, struct qslot *sl, const idem_op *op)
{
    struct rec r;
    struct index_slot *slot = owner_in_flight(s, sl, op, &r, store_now(s));
    if (!slot) return;
    sl->c.err = write_delete(s, slot, r.state, op->key, op->key_len, &sl->need_lsn);
    if (sl->c.err == 0) ops_wake(s, op->key, op->key_len);
}

static void op_hold(idem_store *s, struct qslot *sl, const idem_op *op)
{
    int64_t now = store_now(s);
    struct rec r;
    struct index_slot *slot = owner_lookup(s, sl, op, &r, now);
    if (!slot) return;
    if (r.token != op->token || r.state == IDEM_STATE_COMMITTED) {
        sl->c.err = IDEM_ESTALE;
        return;
    }
    if (r.state == IDEM_STATE_REVIEW) {
        /* A repeated hold by the holder answers OK. The note is the last reason a hold gave: a
         * new one is recorded (a new version), the same one changes nothing. */
        if (r.note_len == op->data_len &&
            (op->data_len == 0 || memcmp(r.note, op->data, op->data_len) == 0))
            return;
        r.note_len = (uint16_t)op->data_len;
        r.owner_len = 0;
        sl->c.err = write_version(s, slot, IDEM_STATE_REVIEW, &r, r.key, NULL, op->data, NULL, 0,
                                  &sl->need_lsn);
        return;
    }
    r.state = IDEM_STATE_REVIEW;
    r.note_len = (uint16_t)op->data_len;
    r.owner_len = 0;
    sl->c.err = write_version(s, slot, IDEM_STATE_IN_FLIGHT, &r, r.key, NULL, op->data, NULL, 0,
                              &sl->need_lsn);
    if (sl->c.err == 0) ops_wake(s, op->key, op->key_len);
}

static void op_extend(idem_store *s, struct qslot *sl, const idem_op *op)
{
    int64_t now = store_now(s);
    struct rec r;
    struct index_slot *slot = owner_in_flight(s, sl, op, &r, now);
    if (!slot) return;
    r.lease_until_ms = now + (int64_t)op->lease_ms;
    sl->c.err = write_version(s, slot, r.state, &r, r.key, r.owner, r.note, NULL, 0, &sl->need_lsn);
    /* Claims parked on the key wait for the lease's end: it moved (sooner, perhaps). */
    if (sl->c.err == 0) ops_wake(s, op->key, op->key_len);
}

/* ---- Reads, SET NX, DEL, RESOLVE ---- */

static void op_get(idem_store *s, struct qslot *sl, const idem_op *op)
{
    struct rec r;
    uint64_t lsn;
    struct index_slot *slot = ops_find(s, op->key, op->key_len, &r, &lsn);
    if (!slot || ops_rec_expired(&r, store_now(s))) {
        sl->need_lsn = wal_last_lsn(s->wal);
        if (!slot && s->find_corrupt) sl->c.err = IDEM_ECORRUPT;
        if (slot && store_clock_need(s, r.expires_at_ms) < 0) sl->c.err = IDEM_EFATAL;
        return;
    }
    sl->need_lsn = lsn;
    ops_fill_record(sl, &r, slot, s);
}

static void op_set(idem_store *s, struct qslot *sl, const idem_op *op)
{
    int64_t now = store_now(s);
    struct rec r;
    uint64_t lsn;
    struct index_slot *slot = ops_find(s, op->key, op->key_len, &r, &lsn);
    if (!slot && s->find_corrupt) {
        sl->c.err = IDEM_ECORRUPT;
        return;
    }
    if (slot && !ops_rec_expired(&r, now)) {
        sl->need_lsn = lsn;
        if (r.state != IDEM_STATE_COMMITTED) {
            if (op->flags & IDEM_F_GET_OLD)
                sl->c.err = IDEM_ESTATE;
            else
                sl->c.outcome = IDEM_DONE;
            return;
        }
        seen_bump(s, slot, &r, now);
        sl->c.outcome = IDEM_DONE;
        if (op->flags & IDEM_F_GET_OLD)
            sl->c.err = copy_result(sl, &r, &sl->c.data, &sl->c.data_len);
        if (!sl->c.err) s->st.claims_done++; /* not one answered out of memory */
        return;
    }
    if (capacity_full(s, slot, op->key, op->key_len, now)) {
        sl->c.err = IDEM_EFULL;
        return;
    }
    struct rec n = {0};
    n.state = IDEM_STATE_COMMITTED;
    n.key_len = (uint16_t)op->key_len;
    n.first_seen_ms = n.last_seen_ms = now;
    n.expires_at_ms = now + (int64_t)op->ttl_ms;
    n.seen_count = 1;
    if (slot) ops_seen_release(s, slot);
    sl->c.err = write_version(s, slot, slot ? r.state : 0, &n, op->key, NULL, NULL, op->data,
                              op->data_len, &sl->need_lsn);
    if (sl->c.err == 0) {
        sl->c.outcome = IDEM_NEW;
        s->st.claims_new++;
        if (slot) s->st.expired_total++;
    }
}

static const char *actor_of(const idem_op *op)
{
    return op->actor && *op->actor ? op->actor : "unknown";
}

/* The first audit_result_kept(its length) bytes of r's result in head, its whole
 * length in *full: 0, or -1 for an LZ4 result that does not decode (only the bytes kept are
 * decoded, whatever its length). */
static int result_head(const struct rec *r, uint8_t head[IDEM_AUDIT_RESULT_KEPT], uint32_t *full)
{
    int lz4 = (r->flags & REC_F_LZ4) != 0;
    *full = lz4 ? r->result_raw_len : r->result_len;
    uint32_t keep = audit_result_kept(*full);
    if (keep && !lz4) memcpy(head, r->result, keep);
    if (!keep || !lz4) return 0;
    int n = LZ4_decompress_safe_partial((const char *)r->result, (char *)head, (int)r->result_len,
                                        (int)keep, IDEM_AUDIT_RESULT_KEPT);
    return n >= (int)keep ? 0 : -1;
}

/* Operator calls (del, resolve) add an audit entry after their change, in the same hold of the
 * lock (ops_apply made room for it): the flusher writes it before the batch that carries the
 * change (audit.c), so the change is never durable without its entry. */
static void op_del(idem_store *s, struct qslot *sl, const idem_op *op)
{
    int64_t now = store_now(s);
    struct rec r;
    struct index_slot *slot = owner_lookup(s, sl, op, &r, now);
    if (!slot) return;
    if (r.state != IDEM_STATE_COMMITTED) {
        sl->c.err = IDEM_ESTATE;
        return;
    }
    /* The trail keeps the outcome erased (the next claim of the key gets new: the side effect
     * may happen again): its first bytes, read before the change (the log may move them). */
    uint8_t head[IDEM_AUDIT_RESULT_KEPT];
    uint32_t full = 0;
    int kept = result_head(&r, head, &full) == 0;
    struct audit_in e = {.actor = actor_of(op),
                         .action = "del",
                         .key = op->key,
                         .key_len = op->key_len,
                         .reason = "",
                         .state_before = IDEM_STATE_COMMITTED,
                         .version_before = r.version,
                         .flags = kept ? IDEM_AUDIT_RESULT : 0,
                         .result = head,
                         .result_full = kept ? full : 0};
    sl->c.err = write_delete(s, slot, r.state, op->key, op->key_len, &sl->need_lsn);
    if (sl->c.err == 0) audit_append(s, &e, sl->need_lsn);
}

/* The state of op's record if a delete group must not go ahead for it, else 0. */
static int del_blocker(idem_store *s, const idem_op *op)
{
    struct rec r;
    uint64_t lsn;
    if (!ops_find(s, op->key, op->key_len, &r, &lsn)) return 0;
    return r.state == IDEM_STATE_IN_FLIGHT || r.state == IDEM_STATE_REVIEW ? r.state : 0;
}

int ops_del_group_check(idem_store *s, const idem_op *ops, size_t n)
{
    for (size_t i = 0; i < n; i++)
        if (!op_valid(s, &ops[i])) return IDEM_EINVAL;
    for (size_t i = 0; i < n; i++)
        if (del_blocker(s, &ops[i])) return IDEM_ESTATE;
    return 0;
}

void ops_del_group_refuse(idem_store *s, struct qslot *sl, const idem_op *op)
{
    int state = del_blocker(s, op);
    sl->c.err = IDEM_ESTATE;
    sl->c.found = state != 0;
    if (state) {
        memset(&sl->ext->record, 0, sizeof sl->ext->record);
        sl->ext->record.state = state;
    }
    /* The refusal reports a state that may not be durable yet: answered once all is. */
    sl->need_lsn = wal_last_lsn(s->wal);
}

static void op_resolve(idem_store *s, struct qslot *sl, const idem_op *op)
{
    static const char *const names[] = {"", "resolve-commit", "resolve-release", "resolve-settle"};
    int64_t now = store_now(s);
    struct rec r;
    struct index_slot *slot = owner_lookup(s, sl, op, &r, now);
    if (!slot) return;
    if (r.state == IDEM_STATE_COMMITTED) {
        sl->c.err = IDEM_ESTATE;
        return;
    }
    if ((op->flags & IDEM_F_EXPECT) && op->expect_version != r.version) {
        sl->c.err = IDEM_ECHANGED;
        return;
    }
    if (r.state == IDEM_STATE_IN_FLIGHT && now < r.lease_until_ms && !(op->flags & IDEM_F_FORCE)) {
        sl->c.err = IDEM_ELEASE;
        return;
    }
    int before = r.state;
    /* Rule 6: under the review policy a lapsed lease is a review case from its end, the
     * transition made lazily by a claim, a WAIT wake-up or an operator's action: this one. The
     * trail says the decision was made on a record in review (a live in_flight one needed
     * FORCE), the version it was made on the in_flight record's. */
    const int lapsed = before == IDEM_STATE_IN_FLIGHT && now >= r.lease_until_ms;
    int audit_before =
        lapsed && s->opt.lease_policy == IDEM_LEASE_REVIEW ? IDEM_STATE_REVIEW : before;
    /* FORCE only where it was needed; the result a commit records, empty or not. */
    uint32_t flags = op->action == IDEM_RESOLVE_COMMIT ? IDEM_AUDIT_RESULT : 0;
    if (lapsed)
        flags |= IDEM_AUDIT_LEASE_LAPSED;
    else if (before == IDEM_STATE_IN_FLIGHT)
        flags |= IDEM_AUDIT_FORCED;
    struct audit_in e = {.actor = actor_of(op),
                         .action = names[op->action],
                         .key = op->key,
                         .key_len = op->key_len,
                         .reason = op->data,
                         .reason_len = op->data_len,
                         .state_before = audit_before,
                         .state_after =
                             op->action == IDEM_RESOLVE_RELEASE ? 0 : IDEM_STATE_COMMITTED,
                         .version_before = r.version,
                         .flags = flags,
                         .result = op->result,
                         .result_full = op->action == IDEM_RESOLVE_COMMIT ? op->result_len : 0};
    int rc;
    if (op->action == IDEM_RESOLVE_RELEASE) {
        rc = write_delete(s, slot, r.state, op->key, op->key_len, &sl->need_lsn);
    } else {
        r.state = IDEM_STATE_COMMITTED;
        /* An operator's decision leaves no owner: no token is current (0 is never handed
         * out), so every owner call after it is stale. A fresh token here was held by no one,
         * yet one guessed right was taken for the owner's. */
        r.token = 0;
        r.owner_len = 0;
        r.lease_until_ms = 0;
        r.note_len = (uint16_t)op->data_len;
        if (now >= r.expires_at_ms) r.expires_at_ms = now + (r.expires_at_ms - r.first_seen_ms);
        const void *result = op->action == IDEM_RESOLVE_COMMIT ? op->result : NULL;
        uint32_t result_len = op->action == IDEM_RESOLVE_COMMIT ? op->result_len : 0;
        rc = write_version(s, slot, before, &r, r.key, NULL, op->data, result, result_len,
                           &sl->need_lsn);
    }
    if (rc == 0) {
        e.version_after = op->action == IDEM_RESOLVE_RELEASE ? 0 : r.version;
        audit_append(s, &e, sl->need_lsn);
    }
    sl->c.err = rc;
    if (rc == 0) ops_wake(s, op->key, op->key_len);
}

/* ---- Dispatch and WAIT ---- */

/* Keeps a busy claim with WAIT on the waiter list: its key and owner are copied into the slot's
 * buffer, its fingerprint as the 16-byte digest (the content it was made from may be megabytes,
 * which thousands of waiters must not hold). */
static void park(idem_store *s, struct qslot *sl, const idem_op *op)
{
    uint64_t h = ops_hash(s, op->key, op->key_len);
    sl->ext->op = *op;
    sl->ext->op.key = qslot_copy(sl, op->key, op->key_len);
    sl->ext->op.owner = op->owner_len ? qslot_copy(sl, op->owner, op->owner_len) : NULL;
    if (op->fp) {
        idem_fingerprint(op->fp, op->fp_len, sl->ext->wait_fp);
        sl->ext->op.fp = sl->ext->wait_fp;
        sl->ext->op.fp_len = sizeof sl->ext->wait_fp;
    }
    if (!sl->ext->op.key || (op->owner_len && !sl->ext->op.owner) || waiters_add(s, sl, h)) {
        s->st.claims_busy++; /* out of memory: answered busy now, and counted so */
        store_count_claim(s, IDEM_BUSY);
        return;
    }
    int64_t mono = s->clock.monotonic_ms(s->clock.ctx);
    sl->ext->deadline_mono_ms = mono + op->wait_ms;
    sl->state = SLOT_PARKED;
    queue_park(sl->ext->q, sl);
    waiters_note_due(s, sl, mono, store_now(s));
    store_kick(s);
}

int ops_hint_hash(const idem_store *s, const idem_op *op, uint64_t *h)
{
    if (!op->key || op->key_len < 1 || op->key_len > IDEM_KEY_BYTES_MAX) return 0;
    *h = key_hash(s, op->key, op->key_len);
    return 1;
}

void ops_apply(idem_store *s, struct qslot *sl, const idem_op *op, const uint64_t *hash,
               int room_made)
{
    s->hash_key = NULL; /* a new operation: its key bytes may sit where the last one's did */
    if (!op_valid(s, op)) {
        sl->c.err = IDEM_EINVAL;
        return;
    }
    if (op->kind != IDEM_OP_GET && op->kind != IDEM_OP_SYNC) {
        if (s->closing) {
            sl->c.err = IDEM_ECLOSED;
            return;
        }
        if (s->opt.read_only) {
            sl->c.err = IDEM_EREADONLY;
            return;
        }
        /* A group of deletes made room for all its frames and entries at once, and none of it
         * may wait (the lock let go, a key could change between the group's check and its
         * deletes). Operator calls: room for the audit entry before the change (op_del). */
        int rc = room_made ? 0 : store_room(s);
        if (rc == 0 && !room_made && (op->kind == IDEM_OP_DEL || op->kind == IDEM_OP_RESOLVE))
            rc = audit_reserve(s);
        if (rc < 0) {
            sl->c.err = rc;
            return;
        }
    }
    s->hash_cache_on = 1; /* no wait below: key bytes stay put for the operation */
    wal_check_scope(s->wal, 1);
    if (hash) {
        /* Hashed ahead by idem_submit; set only now, after the waits above released mu (another
         * caller's operation may have used the cache meanwhile). */
        s->hash_key = op->key;
        s->hash_key_len = op->key_len;
        s->hash_value = *hash;
    }
    switch (op->kind) {
    case IDEM_OP_CLAIM:
        if (op_claim(s, sl, op, 0, store_now(s))) {
            s->st.claims_busy--; /* not answered yet: counted by its outcome (waiter_done) */
            park(s, sl, op);
        } else if (sl->c.err == 0) {
            store_count_claim(s, sl->c.outcome);
        }
        break;
    case IDEM_OP_COMMIT:
        op_commit(s, sl, op);
        break;
    case IDEM_OP_RELEASE:
        op_release(s, sl, op);
        break;
    case IDEM_OP_HOLD:
        op_hold(s, sl, op);
        break;
    case IDEM_OP_EXTEND:
        op_extend(s, sl, op);
        break;
    case IDEM_OP_GET:
        op_get(s, sl, op);
        break;
    case IDEM_OP_SET_IF_ABSENT:
        op_set(s, sl, op);
        if (sl->c.err == 0) store_count_claim(s, sl->c.outcome);
        break;
    case IDEM_OP_DEL:
        op_del(s, sl, op);
        break;
    case IDEM_OP_RESOLVE:
        op_resolve(s, sl, op);
        break;
    case IDEM_OP_SYNC:
        sl->need_lsn = wal_last_lsn(s->wal);
        /* Durable in every mode: batch and none flush for it (flush_asked), and the clock an
         * answer before it rests on is made durable (store_clock_need). */
        if (s->opt.durability != IDEM_DURABILITY_SYNC &&
            (sl->need_lsn > s->durable_lsn || !store_clock_saved(s))) {
            store_clock_want(s);
            sl->durable_wait = 1;
            __atomic_add_fetch(&s->sync_ops, 1, __ATOMIC_RELAXED);
            store_kick(s);
        }
        break;
    }
    s->hash_cache_on = 0;
    s->hash_key = NULL;
    wal_check_scope(s->wal, 0);
    if (s->fatal && (sl->need_lsn > s->durable_lsn || store_clock_waits(s, sl))) {
        sl->c.err = IDEM_EFATAL;
        sl->c.outcome = 0;
    }
}

/* A parked claim answers busy without running again: the lease it waits on, as it stands. */
static void answer_busy(idem_store *s, struct qslot *sl)
{
    struct rec r;
    uint64_t lsn;
    struct index_slot *slot = ops_find(s, sl->ext->op.key, sl->ext->op.key_len, &r, &lsn);
    int64_t now = store_now(s);
    sl->c.outcome = IDEM_BUSY;
    sl->c.lease_left_ms = slot && r.lease_until_ms > now ? r.lease_until_ms - now : 0;
    sl->need_lsn = slot ? lsn : wal_last_lsn(s->wal);
}

/* Whether a parked claim's re-run would write nothing: its key committed (with its fingerprint
 * or none), in review, or leased to another owner; or a corrupt record that answers an error.
 * Such a re-run needs no room in the log, if it runs at the same reading of the clock (a lease
 * or a ttl may end at the next). Anything else (a new key, a recovery, a lease expiry
 * that review records, a mismatch, the same owner's resume) writes a version. */
static int claim_reads_only(idem_store *s, const idem_op *op, int64_t now)
{
    struct rec r;
    uint64_t lsn;
    struct index_slot *slot = ops_find(s, op->key, op->key_len, &r, &lsn);
    if (!slot) return s->find_corrupt;
    if (ops_rec_expired(&r, now)) return 0;
    enum claim_path path = claim_path_of(&r, op, op->fp, now); /* parked with its digest (park) */
    return path == CP_DONE || path == CP_REVIEW || path == CP_BUSY;
}

/* Re-runs one parked claim; returns 1 when it completed (and must leave the waiter list). A
 * cancelled claim (deadline 0: its caller is gone) answers busy and is never granted. A re-run
 * that would write waits for room in the log, up to its deadline; one that writes nothing (the
 * key committed while the log was full) answers without it. */
static int wake_one(idem_store *s, struct qslot *sl, int64_t mono)
{
    uint32_t keep = sl->buf_used;
    uint64_t ud = sl->c.user_data;
    memset(&sl->c, 0, sizeof sl->c);
    sl->c.user_data = ud;
    sl->ext->wake_again = 0;
    if (s->fatal) {
        sl->c.err = IDEM_EFATAL;
        return 1;
    }
    if (sl->ext->deadline_mono_ms == 0 || s->closing || s->no_wait) {
        answer_busy(s, sl);
        return 1;
    }
    int64_t now = store_now(s);
    if (store_room_ok(s) == IDEM_EBUSY && !claim_reads_only(s, &sl->ext->op, now)) {
        if (mono >= sl->ext->deadline_mono_ms) {
            answer_busy(s, sl);
            return 1;
        }
        sl->ext->wake_again = 1; /* no buffer room now: again at the next wake-up of any kind */
        return 0;
    }
    sl->buf_used = keep;
    int park_again = op_claim(s, sl, &sl->ext->op, 1, now);
    if (park_again && mono < sl->ext->deadline_mono_ms) return 0;
    return 1;
}

/* Takes a completed claim off the waiter list. A claim is counted once, by the outcome it is
 * answered with: the re-run that answered it counted any other (claim_existing, claim_new). */
static void waiter_done(idem_store *s, struct qslot *sl)
{
    if (sl->c.err == 0) {
        if (sl->c.outcome == IDEM_BUSY) s->st.claims_busy++;
        store_count_claim(s, sl->c.outcome);
    }
    waiters_remove(s, sl);
    sl->state = SLOT_DONE;
    queue_unpark(sl->ext->q, sl);
    queue_signal(sl->ext->q);
    pthread_cond_broadcast(&s->cond_ready);
}

/* Re-runs one parked claim: off the list once it completes, else its next due time noted. */
static void wake_try(idem_store *s, struct qslot *sl, int64_t mono, int64_t now)
{
    if (wake_one(s, sl, mono)) {
        waiter_done(s, sl);
        return;
    }
    s->nwake_again += sl->ext->wake_again;
    waiters_note_due(s, sl, mono, now);
}

int idem_cancel_wait(idem_queue *q, uint64_t user_data)
{
    if (!q) return IDEM_EINVAL;
    idem_store *s = q->s;
    store_lock(s);
    int rc = IDEM_ENOTFOUND;
    struct qslot *w = queue_parked_of(q, user_data);
    if (w) {
        /* Answered now, alone: the other waiters do not run again for it. */
        w->ext->deadline_mono_ms = 0;
        wake_one(s, w, 0);
        waiter_done(s, w);
        rc = IDEM_OK;
    }
    store_unlock(s);
    return rc;
}

/* Re-runs the parked claims of key (every one with all). A change of one key re-runs only the
 * claims in its hash's bucket; any other wake-up walks every parked claim, re-running those
 * whose deadline or awaited lease end has come, and sets when the next one is due. */
static void wake_parked(idem_store *s, const void *key, uint32_t key_len, int all)
{
    if (!s->waiters) return; /* nothing parked: nothing to re-run or append */
    int64_t mono = s->clock.monotonic_ms(s->clock.ctx), now = store_now(s);
    if (key && !all && !s->closing && !s->no_wait && !s->nwake_again) {
        uint64_t h = key_hash(s, key, key_len);
        for (struct qslot *sl = waiters_of_hash(s, h), *next; sl; sl = next) {
            next = sl->ext->bnext;
            if (sl->ext->whash == h && waiter_of_key(sl, key, key_len)) wake_try(s, sl, mono, now);
        }
    } else {
        s->wake_next_mono_ms = INT64_MAX;
        s->nwake_again = 0;
        for (struct qslot *sl = s->waiters, *next; sl; sl = next) {
            next = sl->ext->wnext;
            int match = all || (key && waiter_of_key(sl, key, key_len));
            int due = mono >= sl->ext->deadline_mono_ms ||
                      (!s->opt.test_clock && now >= sl->ext->lease_end_ms) || sl->ext->wake_again;
            if (match || due || s->closing || s->no_wait)
                wake_try(s, sl, mono, now);
            else
                waiters_note_due(s, sl, mono, now);
        }
    }
    if (wal_pending(s->wal)) store_kick(s);
}

void ops_wake(idem_store *s, const void *key, uint32_t key_len)
{
    wake_parked(s, key, key_len, key == NULL);
}

void ops_wake_due(idem_store *s)
{
    int64_t mono = s->clock.monotonic_ms(s->clock.ctx);
    if (!s->waiters || mono == s->wake_due_mono_ms) return;
    if (mono < s->wake_next_mono_ms && !s->nwake_again) return; /* nothing can be due yet */
    s->wake_due_mono_ms = mono;
    wake_parked(s, NULL, 0, 0);
}

/* ---- Recovery ---- */

static int replay_frame(idem_store *s, const struct wal_frame *f);

int ops_replay(void *ctx, const struct wal_frame *f)
{
    idem_store *s = ctx;
    if (f->type == WAL_T_END) return 0;
    if (f->lsn > s->replay_counts_lsn) return replay_frame(s, f);
    /* The checkpoint's counts already include this frame (a checkpoint taken in steps, see
     * store.c): the index follows it, the live bytes and keys by state do not. The counts are
     * then not the index's, so the age heaps, which trust them, filter nothing meanwhile. */
    uint64_t live = s->live_bytes,
             k[3] = {s->st.keys_in_flight, s->st.keys_committed, s->st.keys_review};
    s->ages_hold = 1;
    int rc = replay_frame(s, f);
    s->ages_hold = 0;
    s->live_bytes = live;
    s->st.keys_in_flight = k[0];
    s->st.keys_committed = k[1];
    s->st.keys_review = k[2];
    return rc;
}

/* A frame whose checksum holds but whose content does not make sense, named by where it is. */
static int replay_bad_frame(idem_store *s, const struct wal_frame *f, const char *what)
{
    store_set_error("log corrupt in %s: the %s frame of LSN %llu at segment %llu offset %u %s",
                    s->dir, f->type == WAL_T_RECORD ? "RECORD" : "DELETE",
                    (unsigned long long)f->lsn, (unsigned long long)wal_addr_seq(s->wal, f->addr),
                    wal_addr_off(f->addr), what);
    return IDEM_ECORRUPT;
}

static int replay_frame(idem_store *s, const struct wal_frame *f)
{
    s->st.frames_replayed++;
    const uint8_t *key;
    uint32_t key_len;
    int state = 0;
    struct rec rr;
    if (f->type == WAL_T_RECORD) {
        if (rec_decode(f->payload, f->payload_len, &rr) < 0)
            return replay_bad_frame(s, f, "holds a record that does not decode");
        key = rr.key;
        key_len = rr.key_len;
        state = rr.state;
        if (rr.token > s->max_token_seen) s->max_token_seen = rr.token;
    } else {
        if (f->payload_len < 8) return replay_bad_frame(s, f, "is too short for a key");
        key_len = util_get_u16(f->payload);
        key = f->payload + 8;
        if (key_len == 0 || 8 + key_len > f->payload_len)
            return replay_bad_frame(s, f, "names a key length its payload does not hold");
    }
    struct rec cur;
    uint64_t lsn;
    struct index_slot *slot = find_raw(s, key, key_len, &cur, &lsn);
    if (!slot && s->find_corrupt) {
        store_set_error("a record the checkpoint points to fails its checksum (key of the frame "
                        "at log address %llu)",
                        (unsigned long long)f->addr);
        return IDEM_ECORRUPT;
    }
    /* A checkpoint taken in steps holds each key as the scan found it, maybe a version after
     * this frame, with its repeat counters: the frame is older news, and replaying it would
     * point the key back and drop the counters the checkpoint kept. */
    if (slot && lsn >= f->lsn) return 0;
    if (f->type == WAL_T_RECORD && ages_room(s, &rr) < 0) return IDEM_ENOMEM; /* nothing changed */
    if (slot) state_count(s, cur.state, -1);
    struct old_facts old = old_facts(s, slot ? index_slot_addr(slot) : 0);
    if (f->type == WAL_T_DELETE) {
        if (slot) {
            ops_seen_release(s, slot);
            index_remove(s->ix, slot);
            version_moved(s, &old, 0, 0, NULL, 0);
        }
        return 0;
    }
    if (!slot) {
        slot = index_insert(s->ix, ops_hash(s, key, key_len), f->addr, 0);
        if (!slot) return IDEM_ENOMEM;
    } else {
        /* A compaction copy keeps the version it copies, and the counters a checkpoint took
         * for it (its frame holds those of the version's writing). */
        if (cur.version != rr.version) ops_seen_release(s, slot);
        index_slot_set_addr(slot, f->addr);
    }
    ops_slot_mark(slot, &rr);
    version_moved(s, &old, f->addr, (uint64_t)f->payload_len + WAL_FRAME_HDR, &rr,
                  ops_hash(s, key, key_len));
    state_count(s, state, +1);
    return 0;
}

/* ---- Compaction ---- */

int ops_compact_prepare(idem_store *s, struct cmp_frame *cf)
{
    if (cf->f.type != WAL_T_RECORD) return 0;
    if (rec_decode(cf->f.payload, cf->f.payload_len, &cf->r) < 0) return IDEM_ECORRUPT;
    cf->h = key_hash(s, cf->r.key, cf->r.key_len);
    index_prefetch(s->ix, cf->h);
    return 0;
}

int ops_record_live(idem_store *s, const void *key, uint32_t key_len, uint64_t addr)
{
    return index_find_addr(s->ix, key_hash(s, key, key_len), addr) != NULL;
}

int ops_compact_frame(idem_store *s, const struct cmp_frame *cf, int64_t now)
{
    const struct wal_frame *f = &cf->f;
    const struct rec *r = &cf->r;
    uint64_t lsn, h = cf->h;
    if (f->type != WAL_T_RECORD)
        return 0; /* DELETE frames in the oldest segment describe nothing older that survives */
    /* Live iff the index holds this very address: no key to compare, nothing else to read. */
    struct index_slot *slot = index_find_addr(s->ix, h, f->addr);
    if (!slot) return 0; /* superseded or deleted: dead */
    if (ops_rec_expired(r, now)) {
        int rc = write_delete(s, slot, r->state, r->key, r->key_len, &lsn);
        if (rc == 0) s->st.expired_total++;
        return rc;
    }
    if (ages_room(s, r) < 0) return IDEM_ENOMEM; /* tried again at a later step */
    uint64_t addr;
    int rc = wal_copy(s->wal, f, &addr, &lsn);
    /* Too large to append again: this store never wrote such a frame (damage behind a valid
     * checksum, found by fuzzing). Corruption stops compaction; it must not fail the store. */
    if (rc == IDEM_EINVAL) return IDEM_ECORRUPT;
    if (rc < 0) return rc;
    struct old_facts old = old_facts(s, f->addr);
    index_slot_set_addr(slot, addr);
    ops_slot_mark(slot, r);
    version_moved(s, &old, addr, (uint64_t)f->payload_len + WAL_FRAME_HDR, r, h);
    return 0;
}

/* ---- Import ---- */

/* A time a record can hold: the store clock's range (first_seen_ms past 0: no store clock is
 * 0). Outside it, rule 5's extension (now + expires_at - first_seen) and the ages overflow. */
static int import_time_ok(int64_t ms)
{
    return ms >= 0 && ms <= IDEM_CLOCK_MS_MAX;
}

/* The field of an imported record out of its range (NULL: none), which the refusal names. */
static const char *import_invalid(const idem_store *s, const idem_record *in)
{
    if (in->first_seen_ms <= 0 || !import_time_ok(in->first_seen_ms)) return "first_seen_ms";
    if (!import_time_ok(in->expires_at_ms) || in->expires_at_ms < in->first_seen_ms)
        return "expires_at_ms";
    if (!import_time_ok(in->last_seen_ms)) return "last_seen_ms";
    if (!import_time_ok(in->lease_until_ms)) return "lease_until_ms";
    if (!import_time_ok(in->last_grant_ms)) return "last_grant_ms";
    if (!import_time_ok(in->last_mismatch_ms)) return "last_mismatch_ms";
    if (!in->key || in->key_len < 1 || in->key_len > IDEM_KEY_BYTES_MAX) return "key";
    if (in->state < IDEM_STATE_IN_FLIGHT || in->state > IDEM_STATE_REVIEW) return "state";
    if (in->owner_len > IDEM_OWNER_BYTES_MAX || (!in->owner && in->owner_len)) return "owner";
    if (in->note_len > IDEM_NOTE_BYTES_MAX || (!in->note && in->note_len)) return "note";
    if (in->result_len > s->opt.result_bytes_max || (!in->result && in->result_len))
        return "result";
    /* An in_flight record's holder proves itself with its token: one never handed out (0)
     * would fence no one. */
    if (in->token < (in->state == IDEM_STATE_IN_FLIGHT) || in->token >= IDEM_TOKEN_MAX)
        return "token";
    return NULL;
}

int idem_import_record(idem_queue *q, const idem_record *in)
{
    if (!q || !in) return IDEM_EINVAL;
    idem_store *s = q->s;
    const char *bad = import_invalid(s, in);
    if (bad) {
        store_set_error("import: field %s out of its range", bad);
        return IDEM_EINVAL;
    }
    struct rec r = {0};
    r.state = (uint8_t)in->state;
    r.key_len = (uint16_t)in->key_len;
    r.owner_len = in->state == IDEM_STATE_IN_FLIGHT ? (uint16_t)in->owner_len : 0;
    r.note_len = (uint16_t)in->note_len;
    r.first_seen_ms = in->first_seen_ms;
    r.expires_at_ms = in->expires_at_ms;
    r.last_seen_ms = in->last_seen_ms;
    r.seen_count = in->seen_count;
    r.lease_until_ms = in->lease_until_ms;
    r.token = in->token;
    r.last_grant_ms = in->last_grant_ms;
    r.attempts = in->attempts;
    r.mismatch_count = in->mismatch_count;
    r.last_mismatch_ms = in->last_mismatch_ms;
    r.version = in->version;
    if (in->has_fp) {
        r.flags |= REC_F_FP;
        memcpy(r.fp, in->fp, 16);
    }
    if (in->has_last_mismatch_fp) {
        r.flags |= REC_F_MFP;
        memcpy(r.last_mismatch_fp, in->last_mismatch_fp, 16);
    }
    store_lock(s);
    int rc = store_import_refused(s);
    if (rc == 0) rc = store_room(s);
    uint64_t lsn = 0;
    if (rc == 0) {
        struct rec cur;
        uint64_t cur_lsn;
        struct index_slot *slot = ops_find(s, in->key, in->key_len, &cur, &cur_lsn);
        if (!slot && s->find_corrupt) rc = IDEM_ECORRUPT;
        if (slot) ops_seen_release(s, slot);
        if (rc == 0)
            rc = write_version(s, slot, slot ? cur.state : 0, &r, in->key,
                               r.owner_len ? in->owner : NULL, in->note,
                               in->state == IDEM_STATE_COMMITTED ? in->result : NULL,
                               in->state == IDEM_STATE_COMMITTED ? in->result_len : 0, &lsn);
    }
    /* Tokens handed out from now on are above every imported one. */
    if (rc == 0 && in->token >= s->token_next) s->token_next = in->token + 1;
    if (rc == 0) store_kick(s);
    store_unlock(s);
    /* Durable before it returns in sync mode, as every call; in batch and none as theirs. */
    return rc == 0 && s->opt.durability == IDEM_DURABILITY_SYNC ? idem_sync(s) : rc;
}

/* ---- Consistency check (tests, verify) ---- */

struct check_ctx {
    idem_store *s;
    uint64_t entries, faults;
    uint64_t by_state[4];
    uint64_t *ages[AGE_KINDS]; /* the heaps' addresses, sorted */
    size_t ages_n[AGE_KINDS];
};

/* Whether the heap of kind holds an entry for the version at addr. */
static bool check_aged(const struct check_ctx *cc, int kind, uint64_t addr)
{
    const uint64_t *v = cc->ages[kind];
    size_t lo = 0, hi = cc->ages_n[kind];
    while (lo < hi) {
        size_t mid = lo + (hi - lo) / 2;
        if (v[mid] < addr)
            lo = mid + 1;
        else
            hi = mid;
    }
    return lo < cc->ages_n[kind] && v[lo] == addr;
}

static void check_one(void *ctx, struct index_slot *slot)
{
    struct check_ctx *cc = ctx;
    cc->entries++;
    uint32_t len;
    uint64_t lsn;
    struct rec r, again;
    const uint8_t *p = wal_payload(cc->s->wal, index_slot_addr(slot), &len, &lsn);
    if (!p || rec_decode(p, len, &r) < 0) {
        cc->faults++;
        return;
    }
    cc->by_state[r.state]++;
    /* The apart bit agrees with the record (checkpoints rely on it). */
    int apart = r.state != IDEM_STATE_COMMITTED || r.mismatch_count > 0;
    if (!(slot->aux & SLOT_AUX_APART) != !apart) cc->faults++;
    /* The key must lead back to this very slot: no duplicate, no stray entry. */
    if (ops_find(cc->s, r.key, r.key_len, &again, &lsn) != slot) cc->faults++;
    /* Its kinds' heaps hold the version: filtering never dropped a current entry. */
    uint64_t addr = index_slot_addr(slot);
    if ((r.state == IDEM_STATE_IN_FLIGHT && !check_aged(cc, AGE_IN_FLIGHT, addr)) ||
        (r.state == IDEM_STATE_REVIEW && !check_aged(cc, AGE_REVIEW, addr)) ||
        (r.mismatch_count > 0 && !check_aged(cc, AGE_MISMATCH, addr)))
        cc->faults++;
}

int store_check_index(idem_store *s, uint64_t *entries)
{
    struct check_ctx cc = {.s = s};
    store_lock(s);
    for (int k = 0; k < AGE_KINDS; k++)
        cc.ages[k] = ages_sorted_addrs(s, k, &cc.ages_n[k]);
    if (!ages_ordered(s)) cc.faults++;
    uint64_t cursor = 0;
    do {
        cursor = index_scan(s->ix, cursor, 65536, check_one, &cc);
    } while (cursor);
    if (cc.entries != index_count(s->ix) ||
        cc.by_state[IDEM_STATE_IN_FLIGHT] != s->st.keys_in_flight ||
        cc.by_state[IDEM_STATE_COMMITTED] != s->st.keys_committed ||
        cc.by_state[IDEM_STATE_REVIEW] != s->st.keys_review)
        cc.faults++;
    store_unlock(s);
    for (int k = 0; k < AGE_KINDS; k++)
        free(cc.ages[k]);
    if (entries) *entries = cc.entries;
    return cc.faults ? IDEM_ECORRUPT : 0;
}
