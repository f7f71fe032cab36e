/*
 * audit.c: the operator trail (contract rule 9): who, when, which action, why, the state and
 * version before and after. Kept in DIR/audit.log, one entry per 4 KiB block (operator actions
 * are rare; no block holding an acknowledged entry is rewritten), flushed before the change it
 * describes is acknowledged. Entries are also kept in memory for idem_audit.
 *
 * Entry block (little-endian): 0 u64 XXH3-64 of [8, 8 + len), 8 u32 len, 12 u32 0, 16 u64 seq,
 * 24 i64 at_ms, 32 u64 lsn of the change, 40 u8 state before, 41 u8 state after,
 * 42 u16 key_len, 44 u16 actor_len, 46 u16 reason_len, 48 u64 version before,
 * 56 u64 version after, 64 u8 action_len, then action, actor, key, reason.
 * An entry whose change (lsn) did not reach the recovered log is dropped at open.
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <xxhash.h>

#include "store.h"
#include "util.h"

#define AUDIT_BLOCK 4096u
#define AUDIT_HDR   65u

static int audit_keep(idem_store *s, const uint8_t *p)
{
    uint32_t klen = util_get_u16(p + 42), alen = util_get_u16(p + 44), rlen = util_get_u16(p + 46),
             aclen = p[64];
    if (AUDIT_HDR - 8 + klen + alen + rlen + aclen != util_get_u32(p + 8)) return IDEM_ECORRUPT;
    if (s->naudit == s->audit_cap) {
        size_t cap = s->audit_cap ? s->audit_cap * 2 : 64;
        struct audit_rec *n = realloc(s->audit, cap * sizeof *n);
        if (!n) return IDEM_ENOMEM;
        s->audit = n;
        s->audit_cap = cap;
    }
    struct audit_rec *a = &s->audit[s->naudit];
    memset(a, 0, sizeof *a);
    a->mem = malloc(aclen + 1 + alen + 1 + klen + rlen + 1);
    if (!a->mem) return IDEM_ENOMEM;
    const uint8_t *v = p + AUDIT_HDR;
    char *m = a->mem;
    memcpy(m, v, aclen);
    m[aclen] = 0;
    a->e.action = m;
    m += aclen + 1;
    v += aclen;
    memcpy(m, v, alen);
    m[alen] = 0;
    a->e.actor = m;
    m += alen + 1;
    v += alen;
    memcpy(m, v, klen);
    a->e.key = m;
    a->e.key_len = klen;
    m += klen;
    v += klen;
    memcpy(m, v, rlen);
    m[rlen] = 0;
    a->e.reason = m;
    a->e.seq = util_get_u64(p + 16);
    a->e.at_ms = (int64_t)util_get_u64(p + 24);
    a->lsn = util_get_u64(p + 32);
    a->e.state_before = p[40];
    a->e.state_after = p[41];
    a->e.version_before = util_get_u64(p + 48);
    a->e.version_after = util_get_u64(p + 56);
    s->naudit++;
    return 0;
}

int audit_open(idem_store *s)
{
    char path[4096];
    snprintf(path, sizeof path, "%s/audit.log", s->dir);
    int rc;
    if (s->opt.read_only) {
        rc = io_open(s->io, path, IO_O_RDONLY, &s->audit_f);
        if (rc == -ENOENT) return 0; /* no operator decision yet */
    } else {
        rc = io_open(s->io, path, IO_O_CREATE | IO_O_EXCL, &s->audit_f);
        if (rc == 0)
            rc = io_sync_dir(s->io, s->dir); /* a new file: its name must survive power loss */
        else if (rc == -EEXIST)
            rc = io_open(s->io, path, 0, &s->audit_f);
    }
    if (rc < 0) {
        store_set_error("cannot open %s: %s", path, strerror(-rc));
        return IDEM_EIO;
    }
    uint8_t *blk = malloc(AUDIT_BLOCK);
    if (!blk) return IDEM_ENOMEM;
    uint64_t last = wal_recovered_lsn(s->wal);
    for (uint64_t off = 0;; off += AUDIT_BLOCK) {
        int64_t n = io_read(s->io, s->audit_f, off, blk, AUDIT_BLOCK);
        uint32_t len = n == AUDIT_BLOCK ? util_get_u32(blk + 8) : 0;
        int valid = len >= AUDIT_HDR - 8 && len <= AUDIT_BLOCK - 8 &&
                    util_get_u64(blk) == XXH3_64bits(blk + 8, len);
        if (valid && util_get_u64(blk + 32) <= last) {
            rc = audit_keep(s, blk);
            if (rc < 0) {
                store_set_error("%s: entry at offset %llu: %s", path, (unsigned long long)off,
                                idem_strerror(rc));
                break;
            }
            s->audit_off = off + AUDIT_BLOCK;
            continue;
        }
        /* A torn tail, or an entry whose change never reached the log (written just before a
         * crash): the trail ends here, and what follows is cut off so it cannot come back once
         * the log's LSNs grow past it. */
        s->audit_off = off;
        uint64_t size = 0;
        if (!s->opt.read_only && io_size(s->io, s->audit_f, &size) == 0 && size > off &&
            (io_truncate(s->io, s->audit_f, off) < 0 || io_flush_sync(s->io, s->audit_f) < 0))
            rc = IDEM_EIO;
        break;
    }
    free(blk);
    return rc < 0 ? rc : 0;
}

void audit_close(idem_store *s)
{
    for (size_t i = 0; i < s->naudit; i++)
        free(s->audit[i].mem);
    free(s->audit);
    s->audit = NULL;
    s->naudit = 0;
    if (s->audit_f) io_close(s->io, s->audit_f);
    s->audit_f = NULL;
}

static int audit_write(idem_store *s, const char *actor, const char *action, const void *key,
                       uint32_t key_len, const void *reason, uint32_t reason_len, int state_before,
                       int state_after, uint64_t version_before, uint64_t version_after,
                       uint64_t lsn, uint64_t seq, int64_t at_ms)
{
    uint32_t alen = (uint32_t)strlen(actor), aclen = (uint32_t)strlen(action);
    uint32_t len = AUDIT_HDR - 8 + aclen + alen + key_len + reason_len;
    if (len + 8 > AUDIT_BLOCK) return IDEM_EINVAL;
    uint8_t *blk = aligned_alloc(AUDIT_BLOCK, AUDIT_BLOCK);
    if (!blk) return IDEM_ENOMEM;
    /* The ring must be idle for a synchronous write. Operator calls quiesced before their change
     * already (ops.c op_del), so this does not release the lock between change and entry. */
    store_quiesce(s);
    memset(blk, 0, AUDIT_BLOCK);
    util_put_u32(blk + 8, len);
    util_put_u64(blk + 16, seq);
    util_put_u64(blk + 24, (uint64_t)at_ms);
    util_put_u64(blk + 32, lsn);
    blk[40] = (uint8_t)state_before;
    blk[41] = (uint8_t)state_after;
    util_put_u16(blk + 42, (uint16_t)key_len);
    util_put_u16(blk + 44, (uint16_t)alen);
    util_put_u16(blk + 46, (uint16_t)reason_len);
    util_put_u64(blk + 48, version_before);
    util_put_u64(blk + 56, version_after);
    blk[64] = (uint8_t)aclen;
    uint8_t *v = blk + AUDIT_HDR;
    memcpy(v, action, aclen);
    memcpy(v + aclen, actor, alen);
    memcpy(v + aclen + alen, key, key_len);
    if (reason_len) memcpy(v + aclen + alen + key_len, reason, reason_len);
    util_put_u64(blk, XXH3_64bits(blk + 8, len));
    int rc = io_write_sync(s->io, s->audit_f, s->audit_off, blk, AUDIT_BLOCK, 1);
    if (rc < 0) {
        free(blk);
        store_fail(s, rc);
        return IDEM_EFATAL;
    }
    s->audit_off += AUDIT_BLOCK;
    rc = audit_keep(s, blk);
    free(blk);
    return rc;
}

int audit_append(idem_store *s, const char *actor, const char *action, const void *key,
                 uint32_t key_len, const void *reason, uint32_t reason_len, int state_before,
                 int state_after, uint64_t version_before, uint64_t version_after, uint64_t lsn)
{
    uint64_t seq = s->naudit ? s->audit[s->naudit - 1].e.seq + 1 : 1;
    return audit_write(s, actor, action, key, key_len, reason, reason_len, state_before,
                       state_after, version_before, version_after, lsn, seq, store_now(s));
}

int idem_import_audit(idem_queue *q, const idem_audit_entry *e)
{
    if (!q || !e || !e->actor || !e->action || !e->key || e->key_len == 0 ||
        e->key_len > IDEM_KEY_BYTES_MAX || strlen(e->actor) > IDEM_ACTOR_BYTES_MAX ||
        strlen(e->action) > 255 || (e->reason && strlen(e->reason) > IDEM_NOTE_BYTES_MAX))
        return IDEM_EINVAL;
    idem_store *s = q->s;
    pthread_mutex_lock(&s->mu);
    int rc = s->opt.read_only ? IDEM_EREADONLY : s->fatal ? IDEM_EFATAL : 0;
    if (rc == 0) {
        uint64_t last = s->naudit ? s->audit[s->naudit - 1].e.seq : 0;
        rc = audit_write(s, e->actor, e->action, e->key, e->key_len, e->reason,
                         e->reason ? (uint32_t)strlen(e->reason) : 0, e->state_before,
                         e->state_after, e->version_before, e->version_after,
                         wal_durable_lsn(s->wal), e->seq > last ? e->seq : last + 1, e->at_ms);
    }
    pthread_mutex_unlock(&s->mu);
    return rc;
}

int idem_audit(idem_queue *q, const void *key, size_t key_len, uint32_t count,
               const idem_audit_entry **entries, size_t *n)
{
    return idem_audit_page(q, key, key_len, 0, count, entries, n);
}

int idem_audit_page(idem_queue *q, const void *key, size_t key_len, uint64_t before_seq,
                    uint32_t count, const idem_audit_entry **entries, size_t *n)
{
    if (!q || !entries || !n || (key && (key_len == 0 || key_len > IDEM_KEY_BYTES_MAX)))
        return IDEM_EINVAL;
    idem_store *s = q->s;
    if (count == 0 || count > 10000) count = count ? 10000 : 100;
    idem_audit_entry *out = realloc(q->audit, count * sizeof *out);
    if (!out) return IDEM_ENOMEM;
    q->audit = out;
    size_t k = 0;
    pthread_mutex_lock(&s->mu);
    for (size_t i = s->naudit; i > 0 && k < count; i--) {
        const idem_audit_entry *e = &s->audit[i - 1].e;
        if (before_seq && e->seq >= before_seq) continue;
        if (key && (e->key_len != key_len || memcmp(e->key, key, key_len))) continue;
        out[k++] = *e; /* strings live as long as the store */
    }
    pthread_mutex_unlock(&s->mu);
    *entries = out;
    *n = k;
    return 0;
}
