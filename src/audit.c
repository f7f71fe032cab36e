/*
 * audit.c: the operator trail (contract rule 9): who, when, which action, why, the state and
 * version before and after. Kept in DIR/audit.log only: memory holds a map of the file (a mark
 * per AUDIT_STRETCH of it, with a filter of the keys in that stretch), and idem_audit reads the
 * stretches it needs, newest first, checking every unit again as it reads; a query by key skips
 * the stretches whose filter rules the key out.
 *
 * Entries are written in groups, by the flusher: an operator call appends its change to the log
 * and its entry to the pending groups (audit_append, after audit_reserve made room, so that it
 * cannot fail once the change is made). When the flusher closes a batch of the log it takes the
 * pending groups under the same hold of the lock (audit_take): they hold the entries of exactly
 * the changes in that batch. It writes and flushes them (audit_write_taken), and only then the
 * batch, so an entry is durable before its change can be, and callers never wait for the ring
 * (a DEL of many keys, or many DELs in one submission, share one write and one flush).
 *
 * File: a sequence of units, each starting on a 4 KiB block, written once and never rewritten
 * (no block holding an acknowledged entry is written again). Little-endian.
 *   Entry (the unit of earlier versions, one per block, zero-padded; inside a group, padded
 *   to 8 bytes): 0 u64 XXH3-64 of [8, 8 + len), 8 u32 len, 12 u32 flags (IDEM_AUDIT_*; 0
 *   before SUPER_FEAT_AUDIT_FLAGS), 16 u64 seq, 24 i64 at_ms, 32 u64 lsn of the change,
 *   40 u8 state before, 41 u8 state after, 42 u16 key_len, 44 u16 actor_len, 46 u16 reason_len,
 *   48 u64 version before, 56 u64 version after, 64 u8 action_len, then action, actor, key,
 *   reason; with IDEM_AUDIT_RESULT then u32 the result's whole length and its first
 *   min(that, IDEM_AUDIT_RESULT_KEPT) bytes.
 *   Group (SUPER_FEAT_AUDIT_GROUPS): 0 u64 XXH3-64 of [8, group_len), 8 u32 group_len,
 *   12 u32 AUDIT_GROUP_MAGIC, 16 u32 count, 20 u32 0, then `count` entries from offset 24;
 *   group_len ends with the last entry's padding; zeros fill the last block.
 * A unit that fails its checksum, or holds an entry whose change (lsn) did not reach the
 * recovered log, ends the trail at open: it and what follows are cut off, unless a later unit
 * names changes in the recovered log (then the first was damaged after it was written: the open
 * reports corruption). A later unit starts on a block that could start one
 * (audit_block_may_start): an entry of a group may start on a block boundary in the form of a
 * one-entry unit. A group is kept or dropped whole; its changes are all in one batch of the
 * log, which recovery also keeps or drops whole. Imported entries name no change to come: they
 * get groups of their own (idem_import_audit_n: as many as fit one), written after every
 * pending one.
 */
#include <errno.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <xxhash.h>

#include "store.h"
#include "util.h"

#define AUDIT_BLOCK       4096u
#define AUDIT_HDR         65u
#define AUDIT_GROUP_HDR   24u
#define AUDIT_GROUP_MAGIC 0x47445541u /* "AUDG" */
/* A group holds entries up to this many bytes (one entry more if the first is larger); a group
 * read back may be at most AUDIT_GROUP_MAX. */
#define AUDIT_GROUP_BYTES (256u * 1024)
/* The largest entry: header, action, actor, key, reason and a result at their limits. */
#define AUDIT_ENTRY_MAX                                                                            \
    (AUDIT_HDR + IDEM_ACTION_BYTES_MAX + IDEM_ACTOR_BYTES_MAX + IDEM_KEY_BYTES_MAX + 4 +           \
     IDEM_AUDIT_RESULT_KEPT + IDEM_NOTE_BYTES_MAX + 8)
#define AUDIT_GROUP_MAX                                                                            \
    IDEM_ALIGN_UP(AUDIT_GROUP_BYTES + AUDIT_ENTRY_MAX + AUDIT_BLOCK, AUDIT_BLOCK)
/* Disk space for audit.log is reserved ahead of its groups in steps of this many bytes
 * (audit_reserve_n), the file's size left alone. */
#define AUDIT_ROOM_STEP (1024u * 1024)
/* A mark is kept for the first unit at or past this many bytes after the last mark: a query
 * that reads a stretch reads about this much of the file, and the map takes a mark (24 bytes)
 * and a filter (AUDIT_FILTER_BITS / 8 bytes) per this much. */
#define AUDIT_STRETCH (1024u * 1024)
/* Bits of a stretch's key filter (8 KiB), AUDIT_FILTER_K of them set per key: with the 256
 * entries of a stretch of one-entry groups, about one stretch in 600,000 is read for nothing;
 * with about 10,000 entries of 100 bytes, one in 20. */
#define AUDIT_FILTER_BITS (64u * 1024)
/* An entry buffer larger than this is given back once written. */
#define AUDIT_BUF_KEEP (64u * 1024)
#define AUDIT_FILTER_K 3

/* The bits of key in a stretch's filter. */
static void filter_bits(const void *key, uint32_t len, uint32_t bit[AUDIT_FILTER_K])
{
    uint64_t h = XXH3_64bits(key, len);
    uint32_t a = (uint32_t)h, b = (uint32_t)(h >> 32) | 1;
    for (uint32_t i = 0; i < AUDIT_FILTER_K; i++)
        bit[i] = (a + i * b) % AUDIT_FILTER_BITS;
}

/* Whether a stretch with filter f may hold entries of the key with those bits. */
static bool filter_may(const uint64_t *f, const uint32_t bit[AUDIT_FILTER_K])
{
    for (uint32_t i = 0; f && i < AUDIT_FILTER_K; i++)
        if (!(f[bit[i] / 64] >> (bit[i] % 64) & 1)) return false;
    return true;
}

/* The entry's whole length (8 + len) if its lengths agree and it fits in avail bytes; else 0. */
uint32_t audit_entry_bytes(const uint8_t *p, size_t avail)
{
    if (avail < AUDIT_HDR) return 0;
    uint32_t len = util_get_u32(p + 8), flags = util_get_u32(p + 12);
    uint32_t klen = util_get_u16(p + 42), alen = util_get_u16(p + 44), rlen = util_get_u16(p + 46),
             aclen = p[64];
    uint32_t fixed = AUDIT_HDR + klen + alen + rlen + aclen; /* where a result's tail starts */
    if (len + 8 > avail || (flags & ~IDEM_AUDIT_FLAGS_KNOWN) || fixed > len + 8) return 0;
    uint32_t tail = 0;
    if (flags & IDEM_AUDIT_RESULT) {
        if (fixed + 4 > len + 8) return 0;
        uint32_t full = util_get_u32(p + fixed);
        tail = 4 + audit_result_kept(full);
    }
    return fixed + tail == len + 8 ? len + 8 : 0;
}

uint32_t audit_unit_bytes(const uint8_t *blk)
{
    if (!audit_unit_is_group(blk)) return AUDIT_BLOCK;
    uint32_t glen = util_get_u32(blk + 8);
    if (glen < AUDIT_GROUP_HDR + AUDIT_HDR || glen > AUDIT_GROUP_MAX) return 0;
    return (uint32_t)IDEM_ALIGN_UP(glen, AUDIT_BLOCK);
}

bool audit_unit_is_group(const uint8_t *blk)
{
    return util_get_u32(blk + 12) == AUDIT_GROUP_MAGIC;
}

bool audit_block_may_start(const uint8_t *blk, bool groups_seen)
{
    if (audit_unit_is_group(blk)) return true;
    uint32_t len = util_get_u32(blk + 8);
    if (groups_seen || len > AUDIT_BLOCK - 8) return false;
    for (uint32_t i = 8 + len; i < AUDIT_BLOCK; i++)
        if (blk[i]) return false;
    return true;
}

/* Whether the checksum at p is that of the len bytes from p + 8. */
static bool sum_ok(const uint8_t *p, uint32_t len)
{
    return util_get_u64(p) == XXH3_64bits(p + 8, len);
}

int audit_unit_next(const uint8_t *u, uint32_t bytes, uint32_t *pos, const uint8_t **entry)
{
    if (!audit_unit_is_group(u)) { /* one entry per block */
        if (*pos) return 0;
        uint32_t len = util_get_u32(u + 8);
        if (len > bytes - 8 || !sum_ok(u, len)) return AUDIT_TORN;
        if (!audit_entry_bytes(u, bytes)) return AUDIT_BAD;
        *entry = u;
        *pos = bytes;
        return 1;
    }
    uint32_t glen = util_get_u32(u + 8);
    if (*pos == 0) {
        if (glen < AUDIT_GROUP_HDR + AUDIT_HDR || glen > bytes || !sum_ok(u, glen - 8))
            return AUDIT_TORN;
        if (util_get_u32(u + 16) == 0 || util_get_u32(u + 20) != 0) return AUDIT_BAD;
        *pos = AUDIT_GROUP_HDR;
    }
    if (*pos >= glen) return 0;
    uint32_t n = audit_entry_bytes(u + *pos, glen - *pos);
    if (!n || !sum_ok(u + *pos, n - 8)) return AUDIT_BAD; /* the group's checksum holds */
    *entry = u + *pos;
    *pos += (uint32_t)IDEM_ALIGN_UP(n, 8);
    return 1;
}

/* Whether a unit walked to its end (audit_unit_next returned 0 after n entries, at pos) holds
 * what its header says. */
static bool unit_end_ok(const uint8_t *u, uint32_t pos, int n)
{
    return !audit_unit_is_group(u) ||
           ((uint32_t)n == util_get_u32(u + 16) && pos == util_get_u32(u + 8));
}

int audit_unit_valid(const uint8_t *u, uint32_t bytes)
{
    uint32_t pos = 0;
    const uint8_t *e;
    int n = 0, rc;
    while ((rc = audit_unit_next(u, bytes, &pos, &e)) == 1)
        n++;
    if (rc < 0) return rc;
    return unit_end_ok(u, pos, n) ? n : AUDIT_BAD;
}

/* Notes unit u, at off in the file, in the map if it starts a stretch. Units are noted in file
 * order, the first (at offset 0) always, in the room audit_open made. Without memory for a
 * later mark the stretch before it goes on: a query reads more, and misses nothing. */
static void audit_mark(idem_store *s, uint64_t off, const uint8_t *u)
{
    size_t n = s->naudit_marks;
    if (n && off < s->audit_marks[n - 1].off + AUDIT_STRETCH) return;
    /* The unit's first entry: after the group header, or the unit itself (one entry). */
    const uint8_t *e = audit_unit_is_group(u) ? u + AUDIT_GROUP_HDR : u;
    uint64_t seq = util_get_u64(e + 16);
    if (n == s->audit_marks_cap) {
        size_t cap = n ? 2 * n : 16;
        struct audit_mark *m = realloc(s->audit_marks, cap * sizeof *m);
        if (!m) return;
        s->audit_marks = m;
        s->audit_marks_cap = cap;
    }
    /* Without memory for its filter, the stretch is read by every query by key. */
    uint64_t *filter = calloc(AUDIT_FILTER_BITS / 64, sizeof *filter);
    s->audit_marks[s->naudit_marks++] =
        (struct audit_mark){.off = off, .seq = seq, .filter = filter};
}

/* Adds the keys of unit u, bytes long (checked at open, or written by this process), to the
 * filter of its stretch: the last mark's. */
static void audit_filter_add(idem_store *s, const uint8_t *u, uint32_t bytes)
{
    uint64_t *f = s->naudit_marks ? s->audit_marks[s->naudit_marks - 1].filter : NULL;
    int group = audit_unit_is_group(u);
    uint32_t pos = group ? AUDIT_GROUP_HDR : 0, end = group ? util_get_u32(u + 8) : bytes, n;
    while (f && pos < end && (n = audit_entry_bytes(u + pos, end - pos)) != 0) {
        const uint8_t *e = u + pos;
        uint32_t bit[AUDIT_FILTER_K];
        filter_bits(e + AUDIT_HDR + e[64] + util_get_u16(e + 44), util_get_u16(e + 42), bit);
        for (uint32_t i = 0; i < AUDIT_FILTER_K; i++)
            f[bit[i] / 64] |= UINT64_C(1) << (bit[i] % 64);
        if (!group) break; /* one entry */
        pos += (uint32_t)IDEM_ALIGN_UP(n, 8);
    }
}

/* Reads the unit at off into u (AUDIT_GROUP_MAX bytes): its entry count (> 0) with its bytes,
 * the smallest and largest LSN its entries name and its last entry's seq; 0 at the end of the
 * file; AUDIT_TORN, AUDIT_BAD (audit_unit_next); IDEM_EIO if the read fails. */
static int read_unit(idem_store *s, uint64_t off, uint8_t *u, uint32_t *bytes, uint64_t *lsn_min,
                     uint64_t *lsn_max, uint64_t *seq_last)
{
    int64_t n = io_read(s->io, s->audit_f, off, u, AUDIT_BLOCK);
    if (n < 0) return IDEM_EIO;
    if (n == 0) return 0;
    if (n < AUDIT_BLOCK || !(*bytes = audit_unit_bytes(u))) return AUDIT_TORN;
    if (*bytes > AUDIT_BLOCK) {
        n = io_read(s->io, s->audit_f, off + AUDIT_BLOCK, u + AUDIT_BLOCK, *bytes - AUDIT_BLOCK);
        if (n < 0) return IDEM_EIO;
        if (n != (int64_t)(*bytes - AUDIT_BLOCK)) return AUDIT_TORN;
    }
    int k = audit_unit_valid(u, *bytes);
    if (k <= 0) return k < 0 ? k : AUDIT_TORN;
    *lsn_min = UINT64_MAX;
    *lsn_max = 0;
    uint32_t pos = 0;
    const uint8_t *e;
    while (audit_unit_next(u, *bytes, &pos, &e) == 1) {
        uint64_t lsn = util_get_u64(e + 32);
        *lsn_min = lsn < *lsn_min ? lsn : *lsn_min;
        *lsn_max = lsn > *lsn_max ? lsn : *lsn_max;
        *seq_last = util_get_u64(e + 16);
    }
    return k;
}

/* The trail ends at `end`, short of what the superblock recorded of it (sb.audit_len, whole
 * units whose changes were durable): entries were lost (a file deleted, or cut), not torn. */
static int audit_missing(idem_store *s, const char *path, uint64_t end)
{
    store_set_error("%s: the audit trail ends at %llu bytes, but %llu bytes of it were durable "
                    "when the superblock was written (a file removed or cut short): %s",
                    path, (unsigned long long)end, (unsigned long long)s->sb.audit_len,
                    idem_strerror(IDEM_ECORRUPT));
    return IDEM_ECORRUPT;
}

int audit_open(idem_store *s)
{
    char path[4096];
    snprintf(path, sizeof path, "%s/audit.log", s->dir);
    int rc;
    if (s->opt.read_only) {
        rc = io_open(s->io, path, IO_O_RDONLY, &s->audit_f);
        if (rc == -ENOENT && s->sb.audit_len) return audit_missing(s, path, 0);
        if (rc == -ENOENT) return 0; /* no operator decision yet */
    } else if (s->sb.audit_len) {    /* a trail was durable: it is never made anew */
        rc = io_open(s->io, path, 0, &s->audit_f);
        if (rc == -ENOENT) return audit_missing(s, path, 0);
        if (rc == 0 && s->settle_files) rc = io_settle(s->io, s->audit_f); /* store.h */
    } else {
        rc = io_open(s->io, path, IO_O_CREATE | IO_O_EXCL, &s->audit_f);
        if (rc == 0)
            rc = io_sync_dir(s->io, s->dir); /* a new file: its name must survive power loss */
        else if (rc == -EEXIST)
            rc = io_open(s->io, path, 0, &s->audit_f);
        if (rc == 0 && s->settle_files) rc = io_settle(s->io, s->audit_f); /* store.h */
    }
    if (rc < 0) {
        store_set_error("cannot open %s: %s", path, strerror(-rc));
        return IDEM_EIO;
    }
    /* Room for the first mark: the map always starts at the trail's first unit. */
    s->audit_marks = malloc(16 * sizeof *s->audit_marks);
    uint8_t *u = malloc(AUDIT_GROUP_MAX);
    if (!u || !s->audit_marks) {
        free(u);
        return IDEM_ENOMEM;
    }
    s->audit_marks_cap = 16;
    uint64_t last = wal_recovered_lsn(s->wal), lsn_min, lsn_max, seq_last = 0, size = 0;
    uint32_t bytes;
    uint64_t off = 0;
    bool groups =
        false; /* a group came before: no one-entry unit follows (audit_block_may_start) */
    for (;;) {
        int n = read_unit(s, off, u, &bytes, &lsn_min, &lsn_max, &seq_last);
        if (n == AUDIT_BAD) {
            /* Its checksum holds, so no torn write made it: never trusted, never cut off. */
            store_set_error("%s: entry at offset %llu: %s", path, (unsigned long long)off,
                            idem_strerror(IDEM_ECORRUPT));
            rc = IDEM_ECORRUPT;
            break;
        }
        if (n == IDEM_EIO) {
            store_set_error("%s: cannot read at offset %llu", path, (unsigned long long)off);
            rc = IDEM_EIO;
            break;
        }
        if (n > 0 && lsn_max <= last) {
            groups |= audit_unit_is_group(u);
            s->audit_seq = seq_last;
            audit_mark(s, off, u);
            audit_filter_add(s, u, bytes);
            off += bytes;
            s->audit_off = off;
            continue;
        }
        if (n == 0) break; /* the end */
        /* A torn tail, or entries whose changes never reached the log (written just before a
         * crash): the trail ends here, and what follows is cut off so it cannot come back once
         * the log's LSNs grow past it. Units are written in order, each flushed before the
         * next batch: nothing after such a unit names a change in the recovered log, so one
         * that does means this unit was damaged later (corruption, never cut off). The search
         * takes no entry inside a group for a unit (an import's entries name changes in the
         * log: a torn import read as damage kept the store from opening); it starts at the
         * next block, this unit's length being no more trusted than the rest of it. */
        s->audit_off = off;
        int err = io_size(s->io, s->audit_f, &size);
        if (err < 0) {
            store_set_error("%s: cannot read its size: %s", path, strerror(-err));
            rc = IDEM_EIO;
            break;
        }
        groups |= audit_unit_is_group(u);
        for (uint64_t o = off + AUDIT_BLOCK; rc == 0 && o < size;) {
            int k = read_unit(s, o, u, &bytes, &lsn_min, &lsn_max, &seq_last);
            if (k == IDEM_EIO) {
                store_set_error("%s: cannot read at offset %llu", path, (unsigned long long)o);
                rc = IDEM_EIO;
            }
            if (k > 0 && !audit_block_may_start(u, groups)) k = AUDIT_TORN;
            if (k > 0 && lsn_min <= last) {
                store_set_error("%s: the entries at offset %llu are damaged, and the entries at "
                                "offset %llu after them name changes in the log: %s",
                                path, (unsigned long long)off, (unsigned long long)o,
                                idem_strerror(IDEM_ECORRUPT));
                rc = IDEM_ECORRUPT;
            }
            o += k > 0 ? bytes : AUDIT_BLOCK;
        }
        if (rc == 0 && off < s->sb.audit_len) rc = audit_missing(s, path, off);
        if (rc == 0 && !s->opt.read_only && size > off &&
            ((err = io_truncate(s->io, s->audit_f, off)) < 0 ||
             (err = io_flush_sync(s->io, s->audit_f)) < 0)) {
            store_set_error("%s: cannot cut off the torn entries at offset %llu: %s", path,
                            (unsigned long long)off, strerror(-err));
            rc = IDEM_EIO;
        }
        break;
    }
    if (rc == 0 && s->audit_off < s->sb.audit_len) rc = audit_missing(s, path, s->audit_off);
    s->audit_durable_off = s->audit_off;
    free(u);
    s->audit_alloc = s->audit_off; /* reserved space is not known: reserved again as needed */
    return rc < 0 ? rc : 0;
}

void audit_close(idem_store *s)
{
    for (size_t i = 0; i < s->naudit_marks; i++)
        free(s->audit_marks[i].filter);
    free(s->audit_marks);
    s->audit_marks = NULL;
    s->naudit_marks = s->audit_marks_cap = 0;
    for (int i = 0; i < 2; i++) {
        struct audit_buf *b = i ? &s->audit_out : &s->audit_pend;
        free(b->p);
        memset(b, 0, sizeof *b);
    }
    if (s->audit_f) io_close(s->io, s->audit_f);
    s->audit_f = NULL;
}

/* The sequence number of the next entry: one above the last pending or written. */
static uint64_t audit_next_seq(const idem_store *s)
{
    if (s->audit_pend.n) return s->audit_pend_seq + 1;
    if (s->audit_out.n) return s->audit_out_seq + 1;
    return s->audit_seq + 1;
}

int audit_reserve(idem_store *s)
{
    return audit_reserve_n(s, 1);
}

int audit_reserve_n(idem_store *s, uint32_t n)
{
    struct audit_buf *b = &s->audit_pend;
    /* Each entry, the padding that closes the group before it, and a new group's header. */
    size_t need = b->len + (size_t)n * (AUDIT_ENTRY_MAX + AUDIT_BLOCK + AUDIT_GROUP_HDR);
    /* Disk space first: the flusher writes the groups into space allocated here, so that a
     * full disk answers this call FULL, before any change, instead of failing the store when
     * the group is written. Rare (once per AUDIT_ROOM_STEP of trail), and cheap: an fallocate
     * under mu, on an operator's call. */
    uint64_t end = s->audit_off + s->audit_out.len + need;
    if (end > s->audit_alloc) {
        uint64_t to = IDEM_ALIGN_UP(end + AUDIT_ROOM_STEP, AUDIT_ROOM_STEP);
        /* nor, with the disk reserve let go, the room that frees space (disk_reserve.h) */
        if (!store_released_room_ok(s, to - s->audit_alloc)) return IDEM_EFULL;
        int rc = io_reserve(s->io, s->audit_f, s->audit_alloc, to - s->audit_alloc);
        if (UTIL_NO_SPACE(rc)) return IDEM_EFULL;
        if (rc < 0 && rc != -EOPNOTSUPP) return IDEM_EIO;
        /* A file system that cannot reserve: the trail grows as it is written, as it did. */
        s->audit_alloc = rc == 0 ? to : UINT64_MAX;
    }
    if (need <= b->cap) return 0;
    size_t cap = IDEM_ALIGN_UP(need > 2 * b->cap ? need : 2 * b->cap, AUDIT_BLOCK);
    uint8_t *p = aligned_alloc(AUDIT_BLOCK, cap);
    if (!p) return IDEM_ENOMEM;
    if (b->len) memcpy(p, b->p, b->len);
    free(b->p);
    b->p = p;
    b->cap = cap;
    return 0;
}

/* Ends the open group of b: its header, and zeros to the next block. */
static void group_close(struct audit_buf *b)
{
    if (!b->grp_n) return;
    uint8_t *g = b->p + b->grp;
    uint32_t glen = (uint32_t)(b->len - b->grp);
    size_t end = IDEM_ALIGN_UP(b->len, AUDIT_BLOCK);
    memset(b->p + b->len, 0, end - b->len);
    util_put_u32(g + 8, glen);
    util_put_u32(g + 12, AUDIT_GROUP_MAGIC);
    util_put_u32(g + 16, b->grp_n);
    util_put_u32(g + 20, 0);
    util_put_u64(g, XXH3_64bits(g + 8, glen - 8));
    b->len = end;
    b->grp_n = 0;
}

/* The entry's len field: its bytes after the checksum. */
static uint32_t entry_len(const struct audit_in *e)
{
    return AUDIT_HDR - 8 + (uint32_t)strlen(e->action) + (uint32_t)strlen(e->actor) + e->key_len +
           e->reason_len +
           (e->flags & IDEM_AUDIT_RESULT ? 4 + audit_result_kept(e->result_full) : 0);
}

/* The bytes an entry takes in its group. */
static uint32_t entry_padded(const struct audit_in *e)
{
    return (uint32_t)IDEM_ALIGN_UP(entry_len(e) + 8, 8);
}

/* Adds one entry to the pending groups, after audit_reserve. */
static void audit_put(idem_store *s, const struct audit_in *e, uint64_t lsn, uint64_t seq,
                      int64_t at_ms)
{
    struct audit_buf *b = &s->audit_pend;
    uint32_t alen = (uint32_t)strlen(e->actor), aclen = (uint32_t)strlen(e->action);
    uint32_t len = entry_len(e);
    uint32_t padded = entry_padded(e);
    IDEM_ASSERT(len + 8 <= AUDIT_ENTRY_MAX);
    IDEM_ASSERT(seq >=
                audit_next_seq(s)); /* seqs grow along the file: idem_audit_page skips by them */
    if (b->grp_n && b->len - b->grp + padded > AUDIT_GROUP_BYTES) group_close(b);
    if (!b->grp_n) {
        b->grp = b->len;
        b->len += AUDIT_GROUP_HDR;
    }
    IDEM_ASSERT(b->len + padded <= b->cap);
    uint8_t *p = b->p + b->len;
    memset(p, 0, padded);
    util_put_u32(p + 8, len);
    util_put_u32(p + 12, e->flags);
    util_put_u64(p + 16, seq);
    util_put_u64(p + 24, (uint64_t)at_ms);
    util_put_u64(p + 32, lsn);
    p[40] = (uint8_t)e->state_before;
    p[41] = (uint8_t)e->state_after;
    util_put_u16(p + 42, (uint16_t)e->key_len);
    util_put_u16(p + 44, (uint16_t)alen);
    util_put_u16(p + 46, (uint16_t)e->reason_len);
    util_put_u64(p + 48, e->version_before);
    util_put_u64(p + 56, e->version_after);
    p[64] = (uint8_t)aclen;
    uint8_t *v = p + AUDIT_HDR;
    memcpy(v, e->action, aclen);
    memcpy(v + aclen, e->actor, alen);
    memcpy(v + aclen + alen, e->key, e->key_len);
    v += aclen + alen + e->key_len;
    if (e->reason_len) memcpy(v, e->reason, e->reason_len);
    v += e->reason_len;
    if (e->flags & IDEM_AUDIT_RESULT) {
        util_put_u32(v, e->result_full);
        if (audit_result_kept(e->result_full))
            memcpy(v + 4, e->result, audit_result_kept(e->result_full));
    }
    util_put_u64(p, XXH3_64bits(p + 8, len));
    b->len += padded;
    b->grp_n++;
    b->n++;
    s->audit_pend_seq = seq;
}

void audit_append(idem_store *s, const struct audit_in *e, uint64_t lsn)
{
    audit_put(s, e, lsn, audit_next_seq(s), store_now(s));
}

size_t audit_take(idem_store *s)
{
    IDEM_ASSERT(s->audit_out.len == 0);
    group_close(&s->audit_pend);
    struct audit_buf t = s->audit_out;
    s->audit_out = s->audit_pend;
    s->audit_out_seq = s->audit_pend_seq;
    s->audit_pend = t;
    if (!s->audit_out.len && s->audit_out.cap > AUDIT_BUF_KEEP) { /* a group refused whole */
        free(s->audit_out.p);
        s->audit_out.p = NULL;
        s->audit_out.cap = 0;
    }
    return s->audit_out.len;
}

int audit_write_taken(idem_store *s)
{
    if (!s->audit_out.len) return 0;
    return io_write_sync(s->io, s->audit_f, s->audit_off, s->audit_out.p, s->audit_out.len, 1);
}

void audit_taken_done(idem_store *s, int rc)
{
    struct audit_buf *b = &s->audit_out;
    for (size_t off = 0; rc == 0 && off < b->len;) {
        uint8_t *u = b->p + off;
        uint32_t bytes = audit_unit_bytes(u);
        audit_mark(s, s->audit_off + off, u);
        audit_filter_add(s, u, bytes);
        off += bytes;
    }
    if (rc == 0 && b->len) {
        s->audit_off += b->len;
        s->audit_seq = s->audit_out_seq;
    }
    b->len = 0;
    b->n = 0;
    /* A large group's room (a DEL of 64 keys reserves about 600 KB) is not kept for good. */
    if (b->cap > AUDIT_BUF_KEEP) {
        free(b->p);
        b->p = NULL;
        b->cap = 0;
    }
}

uint64_t audit_memory_bytes(const idem_store *s)
{
    return (uint64_t)s->audit_marks_cap * sizeof *s->audit_marks +
           (uint64_t)s->naudit_marks * (AUDIT_FILTER_BITS / 8) + s->audit_pend.cap +
           s->audit_out.cap;
}

/* Whether e may be imported; if not, idem_last_error names the field. */
const char *idem_audit_entry_invalid(const idem_audit_entry *e)
{
    if (!e->actor || strlen(e->actor) > IDEM_ACTOR_BYTES_MAX) return "actor";
    if (!e->action || strlen(e->action) > IDEM_ACTION_BYTES_MAX) return "action";
    if (!e->key || e->key_len == 0 || e->key_len > IDEM_KEY_BYTES_MAX) return "key";
    if (e->reason && strlen(e->reason) > IDEM_NOTE_BYTES_MAX) return "reason";
    if (e->seq > (uint64_t)INT64_MAX) return "seq"; /* room for later seqs to grow */
    if (e->state_before < 0 || e->state_before > IDEM_STATE_REVIEW) return "state_before";
    if (e->state_after < 0 || e->state_after > IDEM_STATE_REVIEW) return "state_after";
    if (e->flags & ~IDEM_AUDIT_FLAGS_KNOWN) return "flags";
    if (!(e->flags & IDEM_AUDIT_RESULT))
        return e->result_len || e->result_full_len ? "result" : NULL;
    if (e->result_len != audit_result_kept(e->result_full_len) || (e->result_len && !e->result))
        return "result";
    return NULL;
}

static int import_entry_valid(const idem_audit_entry *e)
{
    const char *bad = idem_audit_entry_invalid(e);
    if (bad)
        store_set_error("audit entry: field %s missing or past its limit (actor %u bytes, action "
                        "%u, key 1 to %u, reason %u, seq 2^63-1, states 0 to 3, flags 0x%x, a "
                        "result's first %u bytes of its whole length)",
                        bad, (unsigned)IDEM_ACTOR_BYTES_MAX, (unsigned)IDEM_ACTION_BYTES_MAX,
                        (unsigned)IDEM_KEY_BYTES_MAX, (unsigned)IDEM_NOTE_BYTES_MAX,
                        (unsigned)IDEM_AUDIT_FLAGS_KNOWN, (unsigned)IDEM_AUDIT_RESULT_KEPT);
    return !bad;
}

/* An entry to import as audit_put takes it. */
static struct audit_in audit_in_of(const idem_audit_entry *e)
{
    const char *reason = e->reason ? e->reason : "";
    return (struct audit_in){.actor = e->actor,
                             .action = e->action,
                             .key = e->key,
                             .key_len = e->key_len,
                             .reason = reason,
                             .reason_len = (uint32_t)strlen(reason),
                             .state_before = e->state_before,
                             .state_after = e->state_after,
                             .version_before = e->version_before,
                             .version_after = e->version_after,
                             .flags = e->flags,
                             .result = e->result,
                             .result_full = e->result_full_len};
}

int idem_import_audit_n(idem_queue *q, const idem_audit_entry *e, size_t n)
{
    if (!q || (n && !e) || n > IDEM_IMPORT_AUDIT_MAX) return IDEM_EINVAL;
    for (size_t i = 0; i < n; i++)
        if (!import_entry_valid(&e[i])) return IDEM_EINVAL;
    idem_store *s = q->s;
    store_lock(s);
    int rc = store_import_refused(s);
    /* The entries name no change in a batch to come: they go in a group of their own, after every
     * pending group is written and every batch written is durable (in durability none too: a
     * group before them whose batch a power loss took is cut off at open, and theirs after it
     * would then read as damage). Their LSN is that of the last complete batch on disk, which
     * every later recovery reaches (one past it, such as a torn batch's, would have the entries
     * cut off at the next open). One group a write, each waited for: a torn group is cut off at
     * open only where no whole unit follows it, and a later group of imported entries, whose LSN
     * is durable, would make the open report the torn one as damage. */
    for (size_t i = 0; rc == 0 && i < n;) {
        while (rc == 0 &&
               (s->audit_pend.n || s->audit_out.n || s->durable_lsn < wal_last_lsn(s->wal))) {
            if (s->durable_lsn < wal_last_lsn(s->wal)) {
                rc = store_wait_durable(s);
                continue;
            }
            /* Groups only (another thread's import): store_wait_durable would not wait for
             * them, and this loop held mu while the flusher waited for it to write them. */
            s->sync_waiters++;
            pthread_cond_signal(&s->cond_flush);
            store_wait(s, &s->cond_ready);
            s->sync_waiters--;
            rc = s->fatal ? IDEM_EFATAL : 0;
        }
        if (rc == 0) rc = audit_reserve_n(s, (uint32_t)(n - i));
        if (rc != 0) break;
        struct audit_buf *b = &s->audit_pend;
        uint64_t seq = 0;
        for (size_t first = i; i < n; i++) {
            struct audit_in in = audit_in_of(&e[i]);
            if (i > first && b->len - b->grp + entry_padded(&in) > AUDIT_GROUP_BYTES) break;
            uint64_t next = audit_next_seq(s);
            seq = e[i].seq >= next ? e[i].seq : next;
            audit_put(s, &in, wal_complete_lsn(s->wal), seq, e[i].at_ms);
        }
        group_close(&s->audit_pend);
        /* The flusher writes it (flush_due): wait until it has. */
        while (!s->fatal && s->audit_seq < seq) {
            pthread_cond_signal(&s->cond_flush);
            store_wait(s, &s->cond_ready);
        }
        rc = s->fatal ? IDEM_EFATAL : 0;
    }
    store_unlock(s);
    return rc;
}

int idem_import_audit(idem_queue *q, const idem_audit_entry *e)
{
    return e ? idem_import_audit_n(q, e, 1) : IDEM_EINVAL;
}

int idem_audit(idem_queue *q, const void *key, size_t key_len, uint32_t count,
               const idem_audit_entry **entries, size_t *n)
{
    return idem_audit_page(q, key, key_len, 0, count, entries, n);
}

/* Copies entry p into q's results as out[k]: its strings go to q->audit_mem at *used, and
 * where is kept in q->audit_place[k] (the pointers are set once every entry is in, as
 * audit_mem may move). */
static int copy_entry(idem_queue *q, const uint8_t *p, size_t k, size_t *used)
{
    uint32_t klen = util_get_u16(p + 42), alen = util_get_u16(p + 44), rlen = util_get_u16(p + 46),
             aclen = p[64], flags = util_get_u32(p + 12);
    const uint8_t *tail = p + AUDIT_HDR + aclen + alen + klen + rlen; /* checked: entry_bytes */
    uint32_t full = flags & IDEM_AUDIT_RESULT ? util_get_u32(tail) : 0,
             kept = audit_result_kept(full);
    size_t need = (size_t)aclen + 1 + alen + 1 + klen + rlen + 1 + kept;
    if (*used + need > q->audit_mem_cap) {
        size_t cap = q->audit_mem_cap ? 2 * q->audit_mem_cap : 4096;
        while (cap < *used + need)
            cap *= 2;
        char *m = realloc(q->audit_mem, cap);
        if (!m) return IDEM_ENOMEM;
        q->audit_mem = m;
        q->audit_mem_cap = cap;
    }
    char *m = q->audit_mem + *used;
    const uint8_t *v = p + AUDIT_HDR;
    memcpy(m, v, aclen);
    m[aclen] = 0;
    memcpy(m + aclen + 1, v + aclen, alen);
    m[aclen + 1 + alen] = 0;
    memcpy(m + aclen + alen + 2, v + aclen + alen, klen);
    memcpy(m + aclen + alen + 2 + klen, v + aclen + alen + klen, rlen);
    m[aclen + alen + 2 + klen + rlen] = 0;
    if (kept) memcpy(m + aclen + alen + 2 + klen + rlen + 1, tail + 4, kept);
    q->audit_place[k] = (struct audit_place){
        .off = *used, .action_len = aclen, .actor_len = alen, .reason_len = rlen};
    q->audit[k] = (idem_audit_entry){.seq = util_get_u64(p + 16),
                                     .at_ms = (int64_t)util_get_u64(p + 24),
                                     .key_len = klen,
                                     .state_before = p[40],
                                     .state_after = p[41],
                                     .version_before = util_get_u64(p + 48),
                                     .version_after = util_get_u64(p + 56),
                                     .flags = flags,
                                     .result_len = kept,
                                     .result_full_len = full};
    *used += need;
    return 0;
}

/* Reads [from, to) of audit.log (whole units) and appends to q's results, newest first, its
 * entries older than before_seq (0: all) and of key (NULL: all), until there are count.
 * Returns 0, IDEM_EIO, IDEM_ENOMEM, or IDEM_ECORRUPT (a unit that no longer checks out). */
static int read_stretch(idem_queue *q, uint64_t from, uint64_t to, const void *key, size_t key_len,
                        uint64_t before_seq, uint32_t count, size_t *k, size_t *used)
{
    idem_store *s = q->s;
    size_t len = (size_t)(to - from);
    if (len > q->audit_read_cap) { /* kept for the queue's next reads, until idem_queue_trim */
        free(q->audit_read);
        free(q->audit_hits);
        q->audit_read = malloc(len);
        q->audit_hits = malloc((len / AUDIT_HDR + 1) * sizeof *q->audit_hits);
        q->audit_read_cap = q->audit_read && q->audit_hits ? len : 0;
        if (!q->audit_read_cap) return IDEM_ENOMEM;
    }
    uint8_t *buf = q->audit_read;
    const uint8_t **hit = q->audit_hits;
    int rc = 0;
    int64_t got = io_read(s->io, s->audit_f, from, buf, len);
    if (got != (int64_t)len) {
        /* Everything below the written length was written: a short read means the file
         * shrank under the store. */
        rc = got < 0 ? IDEM_EIO : IDEM_ECORRUPT;
        store_set_error("%s/audit.log: cannot read %zu bytes at offset %llu (%s): %s", s->dir, len,
                        (unsigned long long)from,
                        got < 0 ? strerror((int)-got) : "the file is shorter than its entries",
                        idem_strerror(rc));
    }
    size_t nhit = 0;
    for (size_t off = 0; rc == 0 && off < len;) {
        uint32_t bytes = audit_unit_bytes(buf + off), pos = 0;
        const uint8_t *e;
        int next = 0, entries = 0;
        if (bytes != 0 && bytes <= len - off) {
            while ((next = audit_unit_next(buf + off, bytes, &pos, &e)) == 1) {
                entries++;
                if (before_seq && util_get_u64(e + 16) >= before_seq) continue;
                if (key && (util_get_u16(e + 42) != key_len ||
                            memcmp(e + AUDIT_HDR + e[64] + util_get_u16(e + 44), key, key_len)))
                    continue;
                hit[nhit++] = e;
            }
        }
        if (bytes == 0 || bytes > len - off || next < 0 || entries == 0 ||
            !unit_end_ok(buf + off, pos, entries)) {
            store_set_error("%s/audit.log: the unit at offset %llu no longer checks out: %s",
                            s->dir, (unsigned long long)(from + off), idem_strerror(IDEM_ECORRUPT));
            rc = IDEM_ECORRUPT;
        }
        off += bytes;
    }
    for (size_t i = nhit; rc == 0 && i > 0 && *k < count; i--) {
        rc = copy_entry(q, hit[i - 1], *k, used);
        *k += rc == 0;
    }
    return rc;
}

int idem_audit_page(idem_queue *q, const void *key, size_t key_len, uint64_t before_seq,
                    uint32_t count, const idem_audit_entry **entries, size_t *n)
{
    if (!q || !entries || !n || (key && (key_len == 0 || key_len > IDEM_KEY_BYTES_MAX)))
        return IDEM_EINVAL;
    idem_store *s = q->s;
    if (count == 0 || count > 10000) count = count ? 10000 : 100;
    idem_audit_entry *out = realloc(q->audit, count * sizeof *out);
    if (out) q->audit = out;
    struct audit_place *place = out ? realloc(q->audit_place, count * sizeof *place) : NULL;
    if (!place) return IDEM_ENOMEM;
    q->audit_place = place;
    size_t k = 0, used = 0;
    int rc = 0;
    store_lock(s);
    /* Entries of changes not yet written (durability batch or none) are shown once they are:
     * the caller sees the entries of every operator call it made. (A failed store writes
     * nothing more: what it kept is shown.) */
    if (s->audit_pend.n || s->audit_out.n) (void)store_wait_durable(s);
    uint64_t end = s->audit_off;
    size_t nmarks = s->naudit_marks;
    store_unlock(s);
    /* Stretches newest first. What is below `end` is written and never rewritten, so it is read
     * without the lock; the map only grows, so its first nmarks marks stay as they are (read
     * under the lock: the array may move). */
    uint32_t bit[AUDIT_FILTER_K];
    if (key) filter_bits(key, (uint32_t)key_len, bit);
    for (size_t i = nmarks; rc == 0 && i > 0 && k < count; i--) {
        store_lock(s);
        struct audit_mark m = s->audit_marks[i - 1];
        uint64_t to = i < nmarks ? s->audit_marks[i].off : end;
        bool may = !key || filter_may(m.filter, bit); /* its bits are set under the lock */
        store_unlock(s);
        if (!may) continue;
        if (before_seq && m.seq >= before_seq) continue; /* seqs grow along the file */
        rc = read_stretch(q, m.off, to, key, key_len, before_seq, count, &k, &used);
    }
    if (q->audit_read_cap > 2 * AUDIT_STRETCH + AUDIT_GROUP_MAX) { /* a stretch without marks */
        free(q->audit_read);
        free(q->audit_hits);
        q->audit_read = NULL;
        q->audit_hits = NULL;
        q->audit_read_cap = 0;
    }
    if (rc < 0) return rc;
    for (size_t i = 0; i < k; i++) {
        char *m = q->audit_mem + place[i].off;
        out[i].action = m;
        out[i].actor = m + place[i].action_len + 1;
        out[i].key = m + place[i].action_len + place[i].actor_len + 2;
        out[i].reason = (const char *)out[i].key + out[i].key_len;
        out[i].result =
            out[i].flags & IDEM_AUDIT_RESULT ? out[i].reason + place[i].reason_len + 1 : NULL;
    }
    *entries = out;
    *n = k;
    return 0;
}
