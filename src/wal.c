/*
 * wal.c: segments, frames, chunk buffers, group-commit I/O and recovery of the write-ahead log.
 * The format and the recovery rule are described in wal.h; docs/design.md gives the argument.
 *
 * Segment header (block 0 of every segment file, little-endian):
 *    0 u8[8] magic "IDEMWAL1"   8 u32 format version   12 u32 segment bytes
 *   16 u64 seq                 24 u64 salt (seed of the frame checksums, new at every create)
 * 4088 u64 XXH3-64 of bytes [0, 4088)
 *
 * Invariants: chunks start on a block boundary; pending chunks are contiguous in log order;
 * at most one batch is in flight; lsn_durable <= lsn_last; a segment file is made whole (its
 * whole length allocated, then its header flushed) before the log rolls into it, and is never
 * cut, so recovery takes a SEGEND before a shorter file for corruption.
 */
#include "wal.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>
#include <xxhash.h>

#include "filler.h"
#include "idem.h"
#include "remover.h"
#include "util.h"

#define WAL_MAGIC         "IDEMWAL1"
#define WAL_FORMAT        1u
#define WAL_OFF_BITS      26u
#define WAL_SEG_HDR_CKSUM 4088u

struct wal_segment {
    uint64_t seq; /* 0: slot unused */
    /* LSN of its SEGEND frame once sealed in this run, until a flush makes the whole segment
     * durable (0: durable, or not sealed yet) */
    uint64_t end_lsn;
    struct io_file *f;
    const uint8_t *map;
    uint64_t salt;
    /* The damaged segment only (wal_open_segments): its file is shorter than a segment, and map
     * is a zero-filled copy of what it holds (file_bytes), freed rather than unmapped. */
    uint64_t file_bytes;
    int copied;
};

struct wal_chunk {
    uint8_t *buf;
    uint64_t seq;
    uint32_t off; /* block-aligned offset in the segment */
    uint32_t len; /* bytes used */
    uint32_t cap;
    uint64_t last_lsn;
};

struct wal {
    struct io *io;
    struct filler *filler; /* NULL: no zero-filling ahead of the log (read-only, or not yet) */
    char *dir;
    uint32_t seg_bytes;
    struct wal_segment *segs; /* WAL_SEG_SLOTS, by seq % WAL_SEG_SLOTS */
    /* Segments taken out of the log and not yet deleted (wal_retire_detach, _remove). */
    struct wal_segment retired[WAL_RETIRE_MAX];
    uint32_t nretired;
    uint64_t first_seq;
    uint64_t cur_seq;
    uint32_t cur_off;
    int spare_ready;          /* segment cur_seq + 1 is created and waits */
    uint64_t cur_since_us;    /* when the log rolled into cur_seq, or the filler began */
    int fill_spare;           /* the log's last segment went slowly enough to zero-fill a spare */
    uint64_t frames_pending;  /* RECORD and DELETE frames in pending chunks */
    uint64_t frames_inflight; /* ... in the batch in flight */
    int spare_err;            /* the last attempt to create it failed with this (IDEM_EFULL, ...) */
    uint64_t frames_beyond;   /* valid frames recovery dropped past the end of the log */
    /* At open: the first segment past the replay segment whose header is damaged (0: none),
     * and the last segment opened past it (wal_open_segments). Recovery only scans those. */
    uint64_t damaged_seq, beyond_last_seq;
    /* At open: the last segment found missing below the replay segment with older segments
     * present (0: none); those older ones are no longer part of the log (wal_open_segments). */
    uint64_t gap_seq;
    /* The damaged segment's file, mapped (copied when shorter than a segment) but not in segs
     * (seq 0: none, or unreadable): installed by recovery when the SEGEND before it names its
     * salt (wal_recover). */
    struct wal_segment damaged;
    uint64_t named_seq;   /* damaged_seq, once installed with the salt a SEGEND names */
    uint64_t named_batch; /* the batch of that SEGEND */
    uint64_t lsn_last;
    uint64_t lsn_written;         /* written, maybe not flushed (durability none) */
    uint64_t lsn_recovered;       /* last LSN of the last complete batch at recovery */
    uint64_t lsn_durable_at_open; /* lsn_durable after recovery (past a torn batch's frames) */
    uint64_t lsn_durable;
    uint64_t batch;
    int64_t last_clock_ms;
    struct wal_chunk chunks[WAL_CHUNKS_MAX];
    int pend[WAL_CHUNKS_MAX]; /* chunk indexes being filled, in log order */
    int npend;
    int infl[WAL_CHUNKS_MAX]; /* chunk indexes of the batch in flight */
    int ninfl;
    uint64_t infl_cur_seq; /* cur_seq when the batch in flight was taken (wal_flush_io reads it
                              without the lock; a roll may change cur_seq meanwhile) */
    int io_lost; /* the ring failed with writes of the batch in flight: their buffers are kept */
    int free_list[WAL_CHUNKS_MAX];
    int nfree;
    int nbufs;             /* chunk buffers allocated (lazily; kept until idle, wal_buffers_take) */
    int test_fail_buffers; /* wal_test_fail_buffers */
    /* Within one operation (wal_check_scope), the last frame read from a map whose checksum
     * was checked: an update reads the version it replaces twice (lookup, then the bytes it
     * frees), and frames never change once written. Nothing outside an operation uses it. */
    int check_scope;
    uint64_t checked_seq;
    uint32_t checked_off;
    char err[256];
};

static uint32_t frame_valid(const struct wal *w, const struct wal_segment *s, uint32_t off);
static uint32_t frame_valid_in(const uint8_t *map, uint64_t salt, uint32_t seg_bytes, uint32_t off);

static struct wal_segment *seg_of(struct wal *w, uint64_t seq)
{
    struct wal_segment *s = &w->segs[seq % WAL_SEG_SLOTS];
    return seq != 0 && s->seq == seq ? s : NULL;
}

void wal_seg_path(const char *dir, uint64_t seq, char *buf, size_t cap)
{
    snprintf(buf, cap, "%s/wal-%016llx.log", dir, (unsigned long long)seq);
}

static uint64_t addr_make(uint64_t seq, uint32_t off)
{
    return ((seq % WAL_SEG_SLOTS) << WAL_OFF_BITS) | (off >> 3);
}

static inline uint32_t addr_off(uint64_t addr)
{
    return (uint32_t)(addr & ((UINT64_C(1) << WAL_OFF_BITS) - 1)) << 3;
}

int wal_create(struct io *io, const char *dir, uint32_t seg_bytes, struct wal **out)
{
    if (seg_bytes % WAL_BLOCK || seg_bytes < WAL_SEG_BYTES_MIN || seg_bytes > WAL_SEG_BYTES_MAX)
        return IDEM_EINVAL;
    struct wal *w = calloc(1, sizeof *w);
    if (!w) return IDEM_ENOMEM;
    w->segs = calloc(WAL_SEG_SLOTS, sizeof *w->segs);
    w->dir = strdup(dir);
    if (!w->segs || !w->dir) {
        free(w->segs);
        free(w->dir);
        free(w);
        return IDEM_ENOMEM;
    }
    w->io = io;
    w->seg_bytes = seg_bytes;
    w->fill_spare = 1; /* until a segment was timed (seg_roll) */
    for (int i = (int)WAL_CHUNKS_MAX - 1; i >= 0; i--)
        w->free_list[w->nfree++] = i;
    *out = w;
    return 0;
}

static void seg_close(struct wal *w, struct wal_segment *s)
{
    if (s->map && s->copied)
        util_map_free((void *)s->map, w->seg_bytes);
    else if (s->map)
        io_unmap(w->io, s->f, s->map, w->seg_bytes);
    if (s->f) io_close(w->io, s->f);
    memset(s, 0, sizeof *s);
}

void wal_destroy(struct wal *w)
{
    if (!w) return;
    for (uint32_t i = 0; i < WAL_SEG_SLOTS; i++)
        if (w->segs[i].seq) seg_close(w, &w->segs[i]);
    for (uint32_t i = 0; i < w->nretired; i++)
        seg_close(w, &w->retired[i]);
    if (w->damaged.seq) seg_close(w, &w->damaged);
    for (uint32_t i = 0; i < WAL_CHUNKS_MAX; i++) {
        int in_flight = 0;
        for (int k = 0; k < w->ninfl && w->io_lost; k++)
            in_flight |= w->infl[k] == (int)i;
        if (!in_flight) util_map_free(w->chunks[i].buf, WAL_CHUNK_BYTES); /* else left mapped */
    }
    free(w->segs);
    free(w->dir);
    free(w);
}

static uint64_t frame_checksum(uint64_t salt, const uint8_t *frame, uint32_t len)
{
    return XXH3_64bits_withSeed(frame + 8, len - 8, salt);
}

/* Creates (or re-creates, with a new salt) segment seq's file into *out: allocate, header,
 * flush, dir sync; without touching w's state (the store's lock may be released meanwhile; the
 * caller keeps the ring to itself). A file made again is allocated again too (a sparse copy of a
 * store has holes a log write could find no space for). When the allocation or the header is
 * refused for space (IDEM_EFULL; XFS and btrfs can refuse on a full disk even space the file
 * holds, and a copy-on-write file its header's overwrite), the making is tried again later, and
 * a file that was whole before it stays as it was: a SEGEND may name it, and recovery takes a
 * SEGEND before a file shorter than a segment for corruption. A file that was not whole goes:
 * the log rolls only into a segment made whole, so no SEGEND names it, and left behind by a
 * clean close it would read as a spare rotted (idemctl verify). */
static int seg_make(struct wal *w, uint64_t seq, struct wal_segment *out)
{
    char path[4096];
    wal_seg_path(w->dir, seq, path, sizeof path);
    struct wal_segment s = {.seq = seq};
    uint64_t size = 0;
    int rc = io_open(w->io, path, IO_O_CREATE, &s.f);
    if (rc < 0) return UTIL_OPEN_ERR(rc);
    if (io_size(w->io, s.f, &size) < 0) {
        io_close(w->io, s.f);
        return IDEM_EIO;
    }
    rc = io_allocate(w->io, s.f, 0, w->seg_bytes);
    if (rc < 0) {
        io_close(w->io, s.f);
        if (size < w->seg_bytes) io_unlink(w->io, path);
        return UTIL_NO_SPACE(rc) ? IDEM_EFULL : IDEM_EIO;
    }
    uint8_t *hdr = aligned_alloc(WAL_BLOCK, WAL_BLOCK);
    if (!hdr) {
        io_close(w->io, s.f);
        return IDEM_ENOMEM;
    }
    memset(hdr, 0, WAL_BLOCK);
    s.salt = XXH3_64bits_withSeed(&seq, sizeof seq, (uint64_t)util_monotonic_us()) ^
             (uint64_t)util_realtime_ms() * 0x9e3779b97f4a7c15ull;
    memcpy(hdr, WAL_MAGIC, 8);
    util_put_u32(hdr + 8, WAL_FORMAT);
    util_put_u32(hdr + 12, w->seg_bytes);
    util_put_u64(hdr + 16, seq);
    util_put_u64(hdr + 24, s.salt);
    util_put_u64(hdr + WAL_SEG_HDR_CKSUM, XXH3_64bits(hdr, WAL_SEG_HDR_CKSUM));
    rc = io_write_sync(w->io, s.f, 0, hdr, WAL_BLOCK, 1);
    free(hdr);
    if (UTIL_NO_SPACE(rc)) {
        io_close(w->io, s.f);
        if (size < w->seg_bytes) io_unlink(w->io, path);
        return IDEM_EFULL;
    }
    if (rc < 0) {
        io_close(w->io, s.f);
        return IDEM_EFATAL;
    }
    rc = io_sync_dir(w->io, w->dir);
    if (rc == 0) rc = io_map(w->io, s.f, w->seg_bytes, (const void **)&s.map);
    if (rc < 0) {
        io_close(w->io, s.f);
        /* Out of descriptors (the directory's open) or memory (the map), or no space for the
         * directory's sync (btrfs may need metadata space for it): not a failed write into
         * the log's space, and the file is whole, so making it again later takes it as it is
         * (and syncs the directory again). */
        int why = UTIL_OPEN_ERR(rc);
        return why == IDEM_ENOMEM || why == IDEM_EFULL ? why : IDEM_EFATAL;
    }
    *out = s;
    return 0;
}

static int seg_create(struct wal *w, uint64_t seq)
{
    if (w->segs[seq % WAL_SEG_SLOTS].seq) return IDEM_EFULL; /* every slot holds a live segment */
    struct wal_segment s;
    int rc = seg_make(w, seq, &s);
    if (rc == 0) w->segs[seq % WAL_SEG_SLOTS] = s;
    return rc;
}

int wal_init_new(struct wal *w)
{
    int rc = seg_create(w, 1);
    if (rc < 0) return rc;
    w->first_seq = w->cur_seq = 1;
    w->cur_off = WAL_BLOCK;
    w->batch = 1;
    return 0;
}

/* ---- Appending ---- */

/* Whether no frame may start at off: within a block's last WAL_FRAME_HDR - 1 bytes, where its
 * header would cross into the next block. The writer pads past them, and replay and walks skip
 * them, by this one rule. */
static inline int frame_start_barred(uint32_t off)
{
    return off % WAL_BLOCK && WAL_BLOCK - off % WAL_BLOCK < WAL_FRAME_HDR;
}

static struct wal_chunk *chunk_tail(struct wal *w)
{
    return w->npend ? &w->chunks[w->pend[w->npend - 1]] : NULL;
}

/* The next n free chunks that chunk_new hands out have their buffers (each a mapping of its
 * own: small pages, and unmapped when trimmed): 0, or IDEM_ENOMEM. */
static int chunks_ready(struct wal *w, int n)
{
    for (int k = 1; k <= n && k <= w->nfree; k++) {
        struct wal_chunk *c = &w->chunks[w->free_list[w->nfree - k]];
        if (c->buf) continue;
        c->buf = w->test_fail_buffers ? NULL : util_map_grow(NULL, 0, WAL_CHUNK_BYTES);
        if (!c->buf) return IDEM_ENOMEM;
        w->nbufs++;
    }
    return 0;
}

void wal_test_fail_buffers(struct wal *w, int on)
{
    w->test_fail_buffers = on;
}

static struct wal_chunk *chunk_new(struct wal *w)
{
    if (w->nfree == 0 || chunks_ready(w, 1) < 0) return NULL;
    int i = w->free_list[w->nfree - 1];
    struct wal_chunk *c = &w->chunks[i];
    w->nfree--;
    IDEM_ASSERT(w->cur_off % WAL_BLOCK == 0);
    c->seq = w->cur_seq;
    c->off = w->cur_off;
    c->len = 0;
    c->cap =
        w->seg_bytes - w->cur_off < WAL_CHUNK_BYTES ? w->seg_bytes - w->cur_off : WAL_CHUNK_BYTES;
    c->last_lsn = 0;
    w->pend[w->npend++] = i;
    return c;
}

/* Writes one frame into c at its end; the caller checked the room. */
static void frame_put(struct wal *w, struct wal_chunk *c, uint32_t type, const void *const *parts,
                      const uint32_t *lens, int nparts, uint32_t flen, uint64_t *addr)
{
    uint8_t *f = c->buf + c->len;
    util_put_u64(f + 8, ++w->lsn_last);
    util_put_u64(f + 16, w->batch);
    util_put_u32(f + 24, flen);
    util_put_u16(f + 28, (uint16_t)type);
    util_put_u16(f + 30, 0);
    uint32_t pos = WAL_FRAME_HDR;
    for (int i = 0; i < nparts; i++) {
        if (lens[i]) memcpy(f + pos, parts[i], lens[i]);
        pos += lens[i];
    }
    memset(f + pos, 0, flen - pos);
    util_put_u64(f, frame_checksum(seg_of(w, c->seq)->salt, f, flen));
    *addr = addr_make(c->seq, c->off + c->len);
    c->len += flen;
    c->last_lsn = w->lsn_last;
    w->cur_off = c->off + c->len;
    if (frame_start_barred(w->cur_off)) {
        uint32_t gap = WAL_BLOCK - w->cur_off % WAL_BLOCK;
        memset(c->buf + c->len, 0, gap);
        c->len += gap;
        w->cur_off += gap;
    }
}

/* Fills the rest of the tail chunk's last block so a new chunk can start on the next block:
 * with a PAD frame inside a batch (the scan reads through it), with zeros after an END or a
 * SEGEND frame (the scan jumps to the next block or segment there, and a PAD would take an
 * LSN the scan never sees). */
static void chunk_close_block(struct wal *w, struct wal_chunk *c, int pad_frame)
{
    uint32_t gap = (WAL_BLOCK - w->cur_off % WAL_BLOCK) % WAL_BLOCK;
    if (pad_frame && gap >= WAL_FRAME_HDR) {
        uint64_t addr;
        frame_put(w, c, WAL_T_PAD, NULL, NULL, 0, gap, &addr);
    } else if (gap) {
        memset(c->buf + c->len, 0, gap);
        c->len += gap;
        w->cur_off += gap;
    }
}

static int append_frame(struct wal *w, uint32_t type, const void *const *parts,
                        const uint32_t *lens, int nparts, uint32_t flen, uint64_t *addr,
                        int reserve)
{
    struct wal_chunk *c = chunk_tail(w);
    if (c && c->seq == w->cur_seq && c->len + flen <= c->cap) goto put;
    /* Keep `reserve` free chunks, with their buffers, for a flush's END frame and a roll's
     * SEGEND: a flush that found no memory for its END would fail the store. The frame is
     * refused for memory instead, before anything is appended. */
    if (w->nfree <= reserve) return IDEM_EBUSY;
    if (chunks_ready(w, 1 + reserve) < 0) return IDEM_ENOMEM;
    if (c && c->seq == w->cur_seq) chunk_close_block(w, c, 1);
    c = chunk_new(w);
    if (!c) return IDEM_ENOMEM;
    if (flen > c->cap) return IDEM_EINVAL;
put:
    frame_put(w, c, type, parts, lens, nparts, flen, addr);
    return 0;
}

/* Room kept at the end of a segment so that a batch's END frame (after block padding) and a
 * SEGEND always fit. */
#define WAL_TAIL_RESERVE (2 * WAL_BLOCK)

/* Ends the current segment with SEGEND and goes on in the spare segment. The SEGEND names the
 * spare's salt: should the spare's header rot later, recovery can still read its frames, and
 * tell acknowledged batches there from a torn tail (wal_recover). */
static int seg_roll(struct wal *w, int reserve)
{
    if (!w->spare_ready) return w->spare_err ? w->spare_err : IDEM_EBUSY;
    uint64_t addr;
    uint8_t salt[WAL_SEGEND_PAYLOAD];
    util_put_u64(salt, seg_of(w, w->cur_seq + 1)->salt);
    const void *parts[1] = {salt};
    const uint32_t lens[1] = {sizeof salt};
    int rc = append_frame(w, WAL_T_SEGEND, parts, lens, 1, WAL_FRAME_HDR + WAL_SEGEND_PAYLOAD,
                          &addr, reserve);
    if (rc < 0) return rc;
    seg_of(w, w->cur_seq)->end_lsn = w->lsn_last;
    chunk_close_block(w, chunk_tail(w), 0); /* the chunk ends on a block boundary */
    w->spare_ready = 0;
    w->cur_seq++;
    w->cur_off = WAL_BLOCK;
    /* Zero-filling pays where flushes are small and latency counts. A log that fills segments
     * faster than FILLER_RATE_MAX writes large batches, whose flushes gain little from it,
     * and whose throughput the second write of every byte would cut. */
    uint64_t now = (uint64_t)util_monotonic_us();
    w->fill_spare = (now - w->cur_since_us) * (FILLER_RATE_MAX / 1000000u) >= w->seg_bytes;
    w->cur_since_us = now;
    return 0;
}

int wal_roll(struct wal *w)
{
    if (w->cur_off == WAL_BLOCK) return 0; /* an empty segment holds nothing to reclaim */
    int rc = seg_roll(w, 2);
    return rc < 0 ? rc : 1;
}

static int append_reserved(struct wal *w, uint32_t type, const void *const *parts,
                           const uint32_t *lens, int nparts, uint64_t *addr, uint64_t *lsn,
                           int reserve)
{
    uint64_t plen = 0;
    for (int i = 0; i < nparts; i++)
        plen += lens[i];
    uint32_t flen = (uint32_t)IDEM_ALIGN_UP(WAL_FRAME_HDR + plen, 8);
    if (flen + WAL_TAIL_RESERVE + WAL_BLOCK > w->seg_bytes || flen > WAL_CHUNK_BYTES)
        return IDEM_EINVAL;
    /* END frames use the reserved tail; other frames roll to the next segment first. */
    if (type != WAL_T_END &&
        IDEM_ALIGN_UP(w->cur_off, WAL_BLOCK) + flen + WAL_TAIL_RESERVE > w->seg_bytes) {
        int rc = seg_roll(w, reserve);
        if (rc < 0) return rc;
    }
    int rc = append_frame(w, type, parts, lens, nparts, flen, addr, reserve);
    if (rc == 0) *lsn = w->lsn_last;
    return rc;
}

int wal_cur_fits(const struct wal *w, uint32_t frame_bytes)
{
    return IDEM_ALIGN_UP(w->cur_off, WAL_BLOCK) + frame_bytes + WAL_FRAME_HDR + WAL_TAIL_RESERVE <=
           w->seg_bytes;
}

int wal_room(const struct wal *w, uint32_t frame_bytes)
{
    int rolls = !wal_cur_fits(w, frame_bytes);
    /* Two chunks stay free for a flush's END and SEGEND (append_frame's reserve); a frame may
     * take one more, and a roll may take one for its SEGEND before it. */
    if (w->nfree < (rolls ? 4 : 3)) return IDEM_EBUSY;
    if (!rolls || w->spare_ready) return 0;
    return w->spare_err ? w->spare_err : IDEM_EBUSY;
}

/* Queues zero-filling of segment seq from `from` on (a full queue only costs speed). */
static void fill_segment(struct wal *w, uint64_t seq, uint64_t from)
{
    if (!w->filler || from >= w->seg_bytes) return;
    char path[4096];
    wal_seg_path(w->dir, seq, path, sizeof path);
    (void)filler_add(w->filler, seq, path, from, w->seg_bytes);
}

int wal_overwrites_in_place(struct wal *w)
{
    return io_overwrites_in_place(w->io, seg_of(w, w->cur_seq)->f);
}

void wal_set_filler(struct wal *w, struct filler *fl)
{
    w->filler = fl;
    if (!fl) return;
    /* The segment current at open is timed from now: it started before, so it looks faster
     * than it is, and a fast log is not filled for one more segment. */
    w->cur_since_us = (uint64_t)util_monotonic_us();
    /* The current segment from FILLER_PIECE past the next piece boundary: the log reaches the
     * first bytes before the filler would, and a fence would cancel the job there. */
    fill_segment(w, w->cur_seq, IDEM_ALIGN_UP((uint64_t)w->cur_off, FILLER_PIECE) + FILLER_PIECE);
    if (w->spare_ready) fill_segment(w, w->cur_seq + 1, WAL_BLOCK);
}

int wal_spare_needed(const struct wal *w)
{
    return !w->spare_ready;
}

uint64_t wal_spare_begin(struct wal *w, int *rc)
{
    uint64_t seq = w->cur_seq + 1;
    *rc = 0;
    if (w->spare_ready) return 0;
    if (w->segs[seq % WAL_SEG_SLOTS].seq) {
        *rc = IDEM_EFULL; /* every slot holds a live segment */
        return 0;
    }
    return seq;
}

int wal_spare_make(struct wal *w, uint64_t seq, struct wal_segment **out)
{
    *out = malloc(sizeof **out);
    if (!*out) return IDEM_ENOMEM;
    int rc = seg_make(w, seq, *out);
    if (rc < 0) {
        free(*out);
        *out = NULL;
    }
    return rc;
}

int wal_spare_end(struct wal *w, struct wal_segment *made, int rc)
{
    if (made) {
        IDEM_ASSERT(rc == 0 && made->seq == w->cur_seq + 1 && !w->spare_ready &&
                    !w->segs[made->seq % WAL_SEG_SLOTS].seq);
        w->segs[made->seq % WAL_SEG_SLOTS] = *made;
        w->spare_ready = 1;
        free(made);
        if (w->fill_spare) fill_segment(w, w->cur_seq + 1, WAL_BLOCK);
    }
    if (rc == 0 && !w->spare_ready) return 0; /* nothing was needed */
    /* Out of descriptors or memory answers new writes FULL as no space does (not waiting for
     * a retry that may be long in coming); the flusher tries again every second. */
    w->spare_err = rc == IDEM_EFULL || rc == IDEM_ENOMEM ? IDEM_EFULL : 0;
    return rc;
}

int wal_spare_create(struct wal *w)
{
    int rc;
    uint64_t seq = wal_spare_begin(w, &rc);
    struct wal_segment *made = NULL;
    if (seq) rc = wal_spare_make(w, seq, &made);
    return wal_spare_end(w, made, rc);
}

int wal_append(struct wal *w, uint32_t type, const void *const *parts, const uint32_t *part_lens,
               int nparts, uint64_t *addr, uint64_t *lsn)
{
    IDEM_ASSERT(type == WAL_T_RECORD || type == WAL_T_DELETE);
    int rc = append_reserved(w, type, parts, part_lens, nparts, addr, lsn, 2);
    w->frames_pending += rc == 0;
    return rc;
}

void wal_prefetch(const struct wal *w, uint64_t addr)
{
    uint32_t slot = (uint32_t)(addr >> WAL_OFF_BITS);
    uint32_t off = addr_off(addr);
    if (slot >= WAL_SEG_SLOTS || w->segs[slot].seq == 0 || !w->segs[slot].map) return;
    if (off < WAL_BLOCK || off + 256 > w->seg_bytes) return;
    const uint8_t *f = w->segs[slot].map + off;
    /* The header, the record's fixed part and a short key: what a lookup reads. */
    for (int i = 0; i < 256; i += 64)
        __builtin_prefetch(f + i);
}

/* wal_payload; scope, when not NULL, is w with its check scope on (frames checked there are
 * remembered in it). */
static const uint8_t *payload_at(const struct wal *w, uint64_t addr, uint32_t *payload_len,
                                 uint64_t *lsn, struct wal *scope)
{
    uint32_t slot = (uint32_t)(addr >> WAL_OFF_BITS);
    uint32_t off = addr_off(addr);
    if (slot >= WAL_SEG_SLOTS || w->segs[slot].seq == 0) return NULL;
    const struct wal_segment *s = &w->segs[slot];
    const uint8_t *f = NULL;
    /* Chunks hold the newest frames, in log order: anything before the oldest one is read
     * from the segment's map without looking at them. */
    const struct wal_chunk *oldest = w->ninfl   ? &w->chunks[w->infl[0]]
                                     : w->npend ? &w->chunks[w->pend[0]]
                                                : NULL;
    if (!oldest || s->seq < oldest->seq || (s->seq == oldest->seq && off < oldest->off)) goto map;
    for (int i = 0; i < w->npend + w->ninfl && !f; i++) {
        int ci = i < w->npend ? w->pend[i] : w->infl[i - w->npend];
        const struct wal_chunk *c = &w->chunks[ci];
        if (c->seq == s->seq && off >= c->off && off < c->off + c->len) f = c->buf + (off - c->off);
    }
    if (!f) {
    map:
        /* Durable frames were read from disk at some point: their checksum is checked on
         * every read (within one operation, once per frame), so damage after recovery is
         * reported, never served. */
        if (!scope || s->seq != scope->checked_seq || off != scope->checked_off) {
            if (off < WAL_BLOCK || off + WAL_FRAME_HDR > w->seg_bytes || !frame_valid(w, s, off))
                return NULL;
            if (scope) {
                scope->checked_seq = s->seq;
                scope->checked_off = off;
            }
        }
        f = s->map + off;
    }
    uint32_t len = util_get_u32(f + 24);
    if (len < WAL_FRAME_HDR || len > w->seg_bytes - off) return NULL;
    *payload_len = len - WAL_FRAME_HDR;
    *lsn = util_get_u64(f + 8);
    return f + WAL_FRAME_HDR;
}

const uint8_t *wal_payload(struct wal *w, uint64_t addr, uint32_t *payload_len, uint64_t *lsn)
{
    return payload_at(w, addr, payload_len, lsn, w->check_scope ? w : NULL);
}

const uint8_t *wal_payload_shared(const struct wal *w, uint64_t addr, uint32_t *payload_len,
                                  uint64_t *lsn)
{
    return payload_at(w, addr, payload_len, lsn, NULL);
}

void wal_check_scope(struct wal *w, int on)
{
    w->check_scope = on;
    w->checked_seq = 0;
}

/* ---- Group commit ---- */

int wal_flush_begin(struct wal *w, int64_t clock_ms)
{
    if (w->npend == 0 || w->ninfl) return 0;
    uint8_t clock[8];
    util_put_u64(clock, (uint64_t)clock_ms);
    const void *parts[1] = {clock};
    uint32_t lens[1] = {8};
    uint64_t addr, lsn;
    int rc = append_reserved(w, WAL_T_END, parts, lens, 1, &addr, &lsn, 0);
    if (rc < 0) return rc;
    chunk_close_block(w, chunk_tail(w), 0);
    for (int i = 0; i < w->npend; i++)
        w->infl[i] = w->pend[i];
    w->ninfl = w->npend;
    w->infl_cur_seq = w->cur_seq;
    w->npend = 0;
    w->batch++;
    w->frames_inflight = w->frames_pending;
    w->frames_pending = 0;
    return w->ninfl;
}

int wal_flush_io(struct wal *w, int durable)
{
    int submitted = 0, rc = 0;
    uint8_t flushed[WAL_CHUNKS_MAX]; /* each write's flags had IO_W_FLUSH: names a failure */
    for (; submitted < w->ninfl; submitted++) {
        struct wal_chunk *c = &w->chunks[w->infl[submitted]];
        struct wal_segment *s = seg_of(w, c->seq);
        IDEM_ASSERT(s && c->len % WAL_BLOCK == 0);
        if (w->filler) filler_fence(w->filler, c->seq, (uint64_t)c->off + c->len);
        /* Without durability (mode none) a segment is still flushed once it is sealed. */
        unsigned flags = durable || c->seq < w->infl_cur_seq ? IO_W_FLUSH : 0;
        flushed[submitted] = flags != 0;
        rc = io_submit_write(w->io, s->f, c->off, c->buf, c->len, flags, (uint64_t)submitted);
        if (rc < 0) break;
    }
    /* Every write submitted is reaped, even after a refused submit: the kernel reads its buffer
     * until it completes, and a failed store frees the buffers at close. */
    int left = submitted;
    int nshort = 0;
    struct {
        int chunk;
        uint32_t done;
    } shorts[WAL_CHUNKS_MAX];
    while (left > 0) {
        struct io_completion cqe[WAL_CHUNKS_MAX];
        int n = io_wait(w->io, cqe, WAL_CHUNKS_MAX, 1);
        if (n < 0) {
            w->io_lost = 1; /* what is still in flight is unknown: wal_destroy keeps its buffers */
            return n;
        }
        for (int k = 0; k < n; k++) {
            left--;
            int i = (int)cqe[k].user_data;
            struct wal_chunk *c = &w->chunks[w->infl[i]];
            if (cqe[k].res < 0) { /* named for store_fail, as io_write_sync does */
                if (rc == 0)
                    rc = (int)io_noted(flushed[i] ? "write or its fdatasync" : "write", cqe[k].res);
            } else if ((uint64_t)cqe[k].res < c->len) {
                shorts[nshort].chunk = i;
                shorts[nshort++].done = (uint32_t)cqe[k].res;
            }
        }
    }
    /* A short write: the rest is written (and flushed again) once nothing else is in flight,
     * since io_write_sync reaps the one completion it waits for. */
    for (int k = 0; k < nshort && rc == 0; k++) {
        struct wal_chunk *c = &w->chunks[w->infl[shorts[k].chunk]];
        uint32_t done = shorts[k].done & ~(WAL_BLOCK - 1);
        rc = io_write_sync(w->io, seg_of(w, c->seq)->f, c->off + done, c->buf + done, c->len - done,
                           durable || c->seq < w->infl_cur_seq);
    }
    return rc;
}

uint64_t wal_flush_end(struct wal *w, int durable)
{
    for (int i = 0; i < w->ninfl; i++) {
        struct wal_chunk *c = &w->chunks[w->infl[i]];
        if (c->last_lsn > w->lsn_written) w->lsn_written = c->last_lsn;
        /* Flushed, as every write to a sealed segment is (wal_flush_io): in durability none
         * too, the segment is durable whole (its earlier writes were done before), and
         * compaction may walk it without waiting for a sync of the log. */
        if (c->seq < w->infl_cur_seq) seg_of(w, c->seq)->end_lsn = 0;
        w->free_list[w->nfree++] = w->infl[i];
    }
    w->ninfl = 0;
    if (durable) w->lsn_durable = w->lsn_written;
    return w->lsn_durable;
}

int wal_sync_point(struct wal *w, struct wal_sync_point *p)
{
    if (w->lsn_durable == w->lsn_written) return 0;
    /* A roll leaves the end of the segment before it pending, and the flush of that batch
     * flushes the whole file: with nothing pending, what is not flushed is in this one. */
    p->f = seg_of(w, w->cur_seq)->f;
    p->lsn = w->lsn_written;
    return 1;
}

int wal_sync_io(struct wal *w, const struct wal_sync_point *p)
{
    /* The segment stays open: only segments before the current one are retired. */
    return io_flush_sync(w->io, p->f);
}

void wal_sync_done(struct wal *w, const struct wal_sync_point *p)
{
    if (p->lsn > w->lsn_durable) w->lsn_durable = p->lsn;
}

uint64_t wal_written_lsn(const struct wal *w)
{
    return w->lsn_written;
}

uint64_t wal_last_lsn(const struct wal *w)
{
    return w->lsn_last;
}
uint64_t wal_durable_lsn(const struct wal *w)
{
    return w->lsn_durable;
}
uint64_t wal_flush_frames(const struct wal *w)
{
    return w->frames_inflight;
}

int wal_pending(const struct wal *w)
{
    return w->npend > 0;
}
int wal_chunks_free(const struct wal *w)
{
    return w->nfree;
}
int wal_buffers_take(struct wal *w, int keep, void **out)
{
    int n = 0;
    for (int i = 0; i < w->nfree && w->nbufs > keep; i++) { /* the bottom: least recently used */
        struct wal_chunk *c = &w->chunks[w->free_list[i]];
        if (!c->buf) continue;
        out[n++] = c->buf;
        c->buf = NULL;
        w->nbufs--;
    }
    return n;
}
void wal_buffers_free(void **bufs, int n)
{
    for (int i = 0; i < n; i++)
        util_map_free(bufs[i], WAL_CHUNK_BYTES);
}
uint64_t wal_buffer_bytes(const struct wal *w)
{
    return (uint64_t)w->nbufs * WAL_CHUNK_BYTES;
}
uint64_t wal_bytes(const struct wal *w)
{
    return (w->cur_seq - w->first_seq + 1 + (uint64_t)w->spare_ready) * (uint64_t)w->seg_bytes;
}

uint64_t wal_segments(const struct wal *w)
{
    return w->cur_seq - w->first_seq + 1;
}

uint64_t wal_cur_seq(const struct wal *w)
{
    return w->cur_seq;
}

uint64_t wal_addr_seq(const struct wal *w, uint64_t addr)
{
    return w->segs[(addr >> WAL_OFF_BITS) % WAL_SEG_SLOTS].seq;
}

uint32_t wal_addr_off(uint64_t addr)
{
    return addr_off(addr);
}

void wal_seg_view(struct wal *w, uint64_t seq, struct wal_seg_view *v)
{
    struct wal_segment *s = seg_of(w, seq);
    IDEM_ASSERT(s && seq < w->cur_seq);
    *v = (struct wal_seg_view){
        .map = s->map, .seq = seq, .salt = s->salt, .seg_bytes = w->seg_bytes};
}

int wal_seg_next(struct wal *w, uint64_t seq, uint32_t *off, struct wal_frame *f)
{
    struct wal_seg_view v;
    wal_seg_view(w, seq, &v);
    return wal_view_next(&v, off, f);
}

int wal_view_next(const struct wal_seg_view *v, uint32_t *off, struct wal_frame *f)
{
    while (*off + WAL_FRAME_HDR <= v->seg_bytes) {
        uint32_t o = *off;
        if (frame_start_barred(o)) {
            *off = (uint32_t)IDEM_ALIGN_UP(o, WAL_BLOCK);
            continue;
        }
        uint32_t len = frame_valid_in(v->map, v->salt, v->seg_bytes, o);
        if (!len) return -1; /* a sealed segment's frames run unbroken to its SEGEND */
        const uint8_t *p = v->map + o;
        uint32_t type = util_get_u16(p + 28);
        if (type == WAL_T_SEGEND) return 0;
        *off = o + len;
        if (type == WAL_T_END) *off = (uint32_t)IDEM_ALIGN_UP(*off, WAL_BLOCK);
        if (type == WAL_T_RECORD || type == WAL_T_DELETE) {
            f->addr = addr_make(v->seq, o);
            f->lsn = util_get_u64(p + 8);
            f->type = type;
            f->payload = p + WAL_FRAME_HDR;
            f->payload_len = len - WAL_FRAME_HDR;
            return 1;
        }
    }
    return -1;
}

int wal_seg_durable(const struct wal *w, uint64_t seq, uint64_t durable_lsn)
{
    const struct wal_segment *s = &w->segs[seq % WAL_SEG_SLOTS];
    return s->seq == seq && seq < w->cur_seq && s->end_lsn <= durable_lsn;
}

uint64_t wal_recovered_lsn(const struct wal *w)
{
    return w->lsn_recovered;
}

uint64_t wal_complete_lsn(const struct wal *w)
{
    return w->lsn_durable == w->lsn_durable_at_open ? w->lsn_recovered : w->lsn_durable;
}

int wal_copy(struct wal *w, const struct wal_frame *f, uint64_t *addr, uint64_t *lsn)
{
    const void *parts[1] = {f->payload};
    uint32_t lens[1] = {f->payload_len};
    int rc = append_reserved(w, f->type, parts, lens, 1, addr, lsn, 2);
    w->frames_pending += rc == 0;
    return rc;
}

int wal_retire_detach(struct wal *w, uint64_t upto)
{
    if (upto < w->first_seq || upto >= w->cur_seq || w->nretired ||
        upto - w->first_seq >= WAL_RETIRE_MAX)
        return IDEM_EINVAL;
    while (w->first_seq <= upto) {
        struct wal_segment *s = seg_of(w, w->first_seq);
        if (!s) return IDEM_EINVAL;
        w->retired[w->nretired++] = *s;
        memset(s, 0, sizeof *s);
        w->first_seq++;
    }
    return 0;
}

int wal_retire_remove(struct wal *w, struct remover *rm)
{
    int rc = 0;
    for (uint32_t i = 0; i < w->nretired; i++) {
        struct wal_segment *s = &w->retired[i];
        char path[4096];
        wal_seg_path(w->dir, s->seq, path, sizeof path);
        if (rm) {
            remover_add_open(rm, path, s->f, s->map, w->seg_bytes);
            memset(s, 0, sizeof *s);
            continue;
        }
        seg_close(w, s);
        if (rc == 0) rc = io_unlink(w->io, path);
    }
    w->nretired = 0;
    if (!rm && rc == 0) rc = io_sync_dir(w->io, w->dir);
    return rc < 0 ? IDEM_EIO : 0;
}
void wal_position(const struct wal *w, uint64_t *seq, uint32_t *off)
{
    *seq = w->cur_seq;
    *off = w->cur_off;
}
uint64_t wal_first_seq(const struct wal *w)
{
    return w->first_seq;
}
uint64_t wal_gap_seq(const struct wal *w)
{
    return w->gap_seq;
}
uint64_t wal_batch(const struct wal *w)
{
    return w->batch;
}
int64_t wal_last_clock_ms(const struct wal *w)
{
    return w->last_clock_ms;
}
const char *wal_error(const struct wal *w)
{
    return w->err;
}

/* ---- Recovery ---- */

/* Does block h hold a whole header of segment seq? Sets *salt when it does. */
static int seg_header_whole(const struct wal *w, const uint8_t *h, uint64_t seq, uint64_t *salt)
{
    if (memcmp(h, WAL_MAGIC, 8) ||
        util_get_u64(h + WAL_SEG_HDR_CKSUM) != XXH3_64bits(h, WAL_SEG_HDR_CKSUM) ||
        util_get_u32(h + 8) != WAL_FORMAT || util_get_u32(h + 12) != w->seg_bytes ||
        util_get_u64(h + 16) != seq)
        return 0;
    *salt = util_get_u64(h + 24);
    return 1;
}

/* Opens and checks segment seq. Returns 0, IDEM_ENOTFOUND if absent, IDEM_ECORRUPT if its
 * header is bad. */
static int seg_open(struct wal *w, uint64_t seq, int read_only)
{
    char path[4096];
    wal_seg_path(w->dir, seq, path, sizeof path);
    struct wal_segment s = {.seq = seq};
    int rc = io_open(w->io, path, read_only ? IO_O_RDONLY : 0, &s.f);
    if (rc == -ENOENT) return IDEM_ENOTFOUND;
    if (rc < 0) return IDEM_EIO;
    uint64_t size = 0;
    if (io_size(w->io, s.f, &size) < 0 || size < w->seg_bytes) {
        io_close(w->io, s.f);
        return IDEM_ECORRUPT;
    }
    /* The header is read, not faulted in through the map: a fault reads the disk's whole
     * read-around window (megabytes) for one block. */
    uint8_t *h = aligned_alloc(WAL_BLOCK, WAL_BLOCK);
    if (!h) {
        io_close(w->io, s.f);
        return IDEM_ENOMEM;
    }
    int64_t n = io_read(w->io, s.f, 0, h, WAL_BLOCK);
    rc = n < 0 ? IDEM_EIO : 0;
    if (rc == 0 && (n != WAL_BLOCK || !seg_header_whole(w, h, seq, &s.salt))) rc = IDEM_ECORRUPT;
    free(h);
    if (rc == 0 && io_map(w->io, s.f, w->seg_bytes, (const void **)&s.map) < 0) rc = IDEM_EIO;
    if (rc < 0) {
        seg_close(w, &s);
        return rc;
    }
    if (w->segs[seq % WAL_SEG_SLOTS].seq) {
        seg_close(w, &s);
        return IDEM_ECORRUPT;
    }
    w->segs[seq % WAL_SEG_SLOTS] = s;
    return 0;
}

/* A file shorter than a segment cannot be mapped whole (a read past its end faults): copies
 * what it holds into zeroed memory of a segment's size (again after wal_settle, which may drop
 * what the first copy read), and takes the salt of a whole header. Returns 0 or < 0. */
static int seg_copy_short(struct wal *w, struct wal_segment *s)
{
    uint8_t *m = (uint8_t *)s->map;
    if (!m && !(m = util_map_grow(NULL, 0, w->seg_bytes))) return IDEM_ENOMEM;
    s->map = m;
    s->copied = 1;
    s->salt = 0;
    memset(m, 0, s->file_bytes);
    for (uint64_t at = 0; at < s->file_bytes;) {
        int64_t n = io_read(w->io, s->f, at, m + at, (size_t)(s->file_bytes - at));
        if (n < 0) return IDEM_EIO;
        if (n == 0) break; /* the file got shorter meanwhile: the rest reads as zeros */
        at += (uint64_t)n;
    }
    uint64_t salt;
    if (s->file_bytes >= WAL_BLOCK && seg_header_whole(w, m, s->seq, &salt)) s->salt = salt;
    return 0;
}

/* Opens segment seq for a damaged header past the replay segment, or a file shorter than a
 * segment, mapped or copied (seg_copy_short) without trusting its header: salt 0 until recovery
 * learns it, but a short file's whole header gives its own. Returns 0 with *out filled, or < 0. */
static int seg_open_raw(struct wal *w, uint64_t seq, int read_only, struct wal_segment *out)
{
    char path[4096];
    wal_seg_path(w->dir, seq, path, sizeof path);
    struct wal_segment s = {.seq = seq};
    if (io_open(w->io, path, read_only ? IO_O_RDONLY : 0, &s.f) < 0) return IDEM_EIO;
    int rc = io_size(w->io, s.f, &s.file_bytes) < 0 ? IDEM_EIO : 0;
    if (rc == 0 && s.file_bytes < w->seg_bytes)
        rc = seg_copy_short(w, &s);
    else if (rc == 0 && io_map(w->io, s.f, w->seg_bytes, (const void **)&s.map) < 0) {
        rc = IDEM_EIO;
    }
    if (rc < 0) {
        seg_close(w, &s);
        return rc;
    }
    *out = s;
    return 0;
}

/* A valid frame at off of a segment's map: checksum, bounds. Returns its length or 0. */
static uint32_t frame_valid_in(const uint8_t *map, uint64_t salt, uint32_t seg_bytes, uint32_t off)
{
    if (off + WAL_FRAME_HDR > seg_bytes) return 0;
    const uint8_t *f = map + off;
    uint32_t len = util_get_u32(f + 24);
    if (len < WAL_FRAME_HDR || len % 8 || len > seg_bytes - off) return 0;
    if (util_get_u64(f) != frame_checksum(salt, f, len)) return 0;
    if (util_get_u64(f + 8) >= WAL_NUMBER_LIMIT || util_get_u64(f + 16) >= WAL_NUMBER_LIMIT)
        return 0;
    return len;
}

static uint32_t frame_valid(const struct wal *w, const struct wal_segment *s, uint32_t off)
{
    return frame_valid_in(s->map, s->salt, w->seg_bytes, off);
}

struct scan_pos {
    uint64_t seq;
    uint32_t off;
};

/* Steps to the next frame position after a frame of length len at p (type t). Returns 0, or
 * IDEM_ENOTFOUND at a SEGEND whose next segment is missing. */
static int scan_step(struct wal *w, struct scan_pos *p, uint32_t type, uint32_t len)
{
    if (type == WAL_T_SEGEND) {
        if (!seg_of(w, p->seq + 1)) return IDEM_ENOTFOUND;
        p->seq++;
        p->off = WAL_BLOCK;
        return 0;
    }
    p->off += len;
    if (type == WAL_T_END || frame_start_barred(p->off))
        p->off = (uint32_t)IDEM_ALIGN_UP(p->off, WAL_BLOCK);
    return 0;
}

/* Replays the frames of one batch from start to its END (already validated). */
static int replay_batch(struct wal *w, struct scan_pos start, uint64_t end_lsn,
                        int (*fn)(void *ctx, const struct wal_frame *f), void *ctx)
{
    struct scan_pos p = start;
    for (;;) {
        struct wal_segment *s = seg_of(w, p.seq);
        const uint8_t *f = s->map + p.off;
        uint32_t len = util_get_u32(f + 24);
        uint32_t type = util_get_u16(f + 28);
        struct wal_frame fr = {.addr = addr_make(p.seq, p.off),
                               .lsn = util_get_u64(f + 8),
                               .type = type,
                               .payload = f + WAL_FRAME_HDR,
                               .payload_len = len - WAL_FRAME_HDR};
        if (type == WAL_T_RECORD || type == WAL_T_DELETE || type == WAL_T_END) {
            int rc = fn(ctx, &fr);
            if (rc < 0) return rc;
        }
        if (fr.lsn == end_lsn) return 0;
        if (scan_step(w, &p, type, len) < 0) return IDEM_ECORRUPT;
    }
}

/* Recovery reads the log front to back from the replay position (and at random, to compare
 * keys). With the default advice a fault reads the window around it (8 MiB here, half of it
 * before the position, and past the end of the log space never written, which the kernel
 * zeroes): ~20 ms of a cold open after a clean shutdown for a few frames read. So recovery maps
 * the segments with random-access advice (a fault reads its page) and asks for the stretch it
 * is about to read, RECOVER_READ_STEP at a time and only where the file holds data. */
#define RECOVER_READ_STEP (4u << 20)

struct read_ahead {
    uint64_t seq;   /* asked for in this segment ... */
    uint32_t until; /* ... up to here */
};

/* Where the file of segment s may hold data from off on (io_data_after); a backend that fails
 * to tell: everything. */
static void seg_data_after(struct wal *w, const struct wal_segment *s, uint64_t off, uint64_t *data,
                           uint64_t *hole)
{
    if (io_data_after(w->io, s->f, off, data, hole) < 0) {
        *data = off;
        *hole = UINT64_MAX;
    }
}

static void segs_advise(struct wal *w, uint64_t seq, int advice)
{
    for (struct wal_segment *s; (s = seg_of(w, seq)); seq++)
        posix_madvise((void *)s->map, w->seg_bytes, advice);
}

/* Asks for the log from p on, when the last request does not reach RECOVER_READ_STEP / 2 past
 * it. */
static void read_ahead(struct wal *w, struct read_ahead *ra, struct scan_pos p)
{
    if (p.seq == ra->seq && (uint64_t)p.off + RECOVER_READ_STEP / 2 <= ra->until) return;
    struct wal_segment *s = seg_of(w, p.seq);
    if (!s) return;
    uint64_t page = (uint64_t)sysconf(_SC_PAGESIZE); /* madvise wants page-aligned addresses */
    uint64_t from = p.off - p.off % page, to = from + RECOVER_READ_STEP, data, hole;
    seg_data_after(w, s, from, &data, &hole);
    if (data > from) from = data - data % page;
    if (hole < to) to = hole;
    if (to > w->seg_bytes) to = w->seg_bytes;
    if (from < to) posix_madvise((void *)(s->map + from), to - from, POSIX_MADV_WILLNEED);
    ra->seq = p.seq;
    ra->until = (uint32_t)(to > p.off + RECOVER_READ_STEP / 2 ? to : p.off + RECOVER_READ_STEP);
}

/* After the log stopped at p: looks at every block start beyond it for valid frames. Returns
 * IDEM_ECORRUPT if one belongs to a batch after the one in flight; raises max_lsn, max_batch. */
static int scan_beyond(struct wal *w, struct scan_pos p, uint64_t last_batch,
                       const struct wal_resume *resume, struct read_ahead *ra, uint64_t *max_lsn,
                       uint64_t *max_batch)
{
    for (uint64_t seq = p.seq; seg_of(w, seq) || seq < w->beyond_last_seq || seq == w->damaged.seq;
         seq++) {
        struct wal_segment *s = seg_of(w, seq);
        /* A damaged segment is read when a short file's whole header gives its salt. */
        if (!s && seq == w->damaged.seq && w->damaged.salt) s = &w->damaged;
        if (!s) continue; /* the damaged header; the segments after it are read all the same */
        /* The stop position is a block start (the end of a complete batch); it may itself
         * hold a valid frame of the batch that was in flight. */
        uint32_t off = seq == p.seq ? p.off : WAL_BLOCK;
        uint64_t data = 0, hole = 0; /* [data, hole): may hold data; the rest reads as zeros */
        for (; off + WAL_FRAME_HDR <= w->seg_bytes; off += WAL_BLOCK) {
            if (off >= hole) {
                /* Skips the preallocated space never written (a zero block holds no frame)
                 * instead of reading it: up to two segments' worth at every open. */
                seg_data_after(w, s, off, &data, &hole);
                if (data >= w->seg_bytes) break;
                if (data > off) off = (uint32_t)(data - data % WAL_BLOCK);
            }
            read_ahead(w, ra, (struct scan_pos){seq, off});
            if (!frame_valid(w, s, off)) continue;
            uint64_t lsn = util_get_u64(s->map + off + 8);
            uint64_t batch = util_get_u64(s->map + off + 16);
            /* Frames under a salt a SEGEND named may be older than opens since, which could
             * not read them and so numbered their batches below them (damaged_install). */
            int judged = seq != w->named_seq || wal_named_judged(w->named_batch, resume);
            if (judged && wal_beyond_is_corrupt(batch, last_batch, resume)) {
                if (w->damaged_seq && (seq > w->damaged_seq || seq == w->named_seq))
                    snprintf(w->err, sizeof w->err,
                             "log corrupt: the header of segment %llu is damaged, and segment "
                             "%llu holds a frame of batch %llu at offset %u (the log stops at "
                             "segment %llu offset %u, last complete batch %llu)",
                             (unsigned long long)w->damaged_seq, (unsigned long long)seq,
                             (unsigned long long)batch, off, (unsigned long long)p.seq, p.off,
                             (unsigned long long)last_batch);
                else
                    snprintf(w->err, sizeof w->err,
                             "log corrupt: segment %llu offset %u: frame of batch %llu after the "
                             "log stops at segment %llu offset %u (last complete batch %llu)",
                             (unsigned long long)seq, off, (unsigned long long)batch,
                             (unsigned long long)p.seq, p.off, (unsigned long long)last_batch);
                return IDEM_ECORRUPT;
            }
            if (lsn > *max_lsn) *max_lsn = lsn;
            if (batch > *max_batch) *max_batch = batch;
            w->frames_beyond++;
        }
    }
    return 0;
}

uint64_t wal_frames_beyond(const struct wal *w)
{
    return w->frames_beyond;
}

int wal_open_segments(struct wal *w, uint64_t first_seq, uint64_t start_seq, int read_only)
{
    w->first_seq = first_seq;
    uint64_t seq = first_seq, bad_seq = 0;
    for (;; seq++) {
        int rc = seg_open(w, seq, read_only);
        if (rc == IDEM_ECORRUPT && seq < start_seq) {
            /* Refused below, unless a missing segment after it takes it out of the log: one a
             * retirement left behind is not read, whatever its state (as verify has it). */
            if (!bad_seq) bad_seq = seq;
            continue;
        }
        if (rc == IDEM_ENOTFOUND && seq < start_seq) {
            /* Retired after this superblock copy was written. Retirement removes the oldest
             * first, so segments found before the missing one are older still and out of the
             * log too (its removals may reach the disk in another order): a checkpoint entry
             * into one is refused at this open, not at the first open after the next
             * retirement's superblock stopped naming them. */
            for (uint64_t q = w->first_seq; q < seq; q++) {
                struct wal_segment *old = seg_of(w, q);
                if (!old) continue;
                seg_close(w, old);
                w->gap_seq = seq;
            }
            if (bad_seq) w->gap_seq = seq;
            bad_seq = 0;
            w->first_seq = seq + 1;
            continue;
        }
        if (rc == IDEM_ENOTFOUND) break;
        if (rc == IDEM_ECORRUPT && seq > start_seq) {
            /* A segment whose creation was cut short (the log cannot reach it), or one whose
             * header rotted after it was written: then the segments after it hold batches
             * acknowledged later. Those with whole headers are opened for the scan past the
             * end of the log (scan_beyond), which tells the two apart by their batches. */
            w->damaged_seq = seq;
            rc = seg_open_raw(w, seq, read_only, &w->damaged);
            if (rc < 0) {
                /* Unread, a SEGEND naming it would end the log there without a word. */
                snprintf(w->err, sizeof w->err, "log segment %llu (damaged or short): %s",
                         (unsigned long long)seq, idem_strerror(rc));
                return rc;
            }
            /* Each of them is opened or known absent: one left unopened (no descriptor or
             * memory just now) would hide its batches, and the damage would be taken for a
             * torn tail. Another damaged or short one is passed over as this one is. */
            for (int brc; (brc = seg_open(w, ++seq, read_only)) != IDEM_ENOTFOUND;) {
                if (brc == 0) {
                    w->beyond_last_seq = seq;
                } else if (brc != IDEM_ECORRUPT) {
                    snprintf(w->err, sizeof w->err,
                             "log segment %llu (read past damaged segment %llu): %s",
                             (unsigned long long)seq, (unsigned long long)w->damaged_seq,
                             idem_strerror(brc));
                    return brc;
                }
            }
            break;
        }
        if (rc < 0) {
            snprintf(w->err, sizeof w->err, "log segment %llu: %s", (unsigned long long)seq,
                     idem_strerror(rc));
            return rc;
        }
    }
    if (bad_seq) {
        snprintf(w->err, sizeof w->err, "log segment %llu: %s", (unsigned long long)bad_seq,
                 idem_strerror(IDEM_ECORRUPT));
        return IDEM_ECORRUPT;
    }
    if (!seg_of(w, start_seq)) {
        snprintf(w->err, sizeof w->err, "log segment %llu is missing",
                 (unsigned long long)start_seq);
        return IDEM_ECORRUPT;
    }
    /* Segments before the replay start hold only records the checkpoint points to; one that is
     * missing is caught when a checkpoint entry points into it (wal_addr_valid). */
    return 0;
}

int wal_settle(struct wal *w, uint64_t start_seq)
{
    for (uint64_t q = start_seq; seg_of(w, q) || q < w->beyond_last_seq || q == w->damaged.seq;
         q++) {
        struct wal_segment *s = seg_of(w, q);
        if (!s && q == w->damaged.seq) s = &w->damaged;
        if (!s) continue; /* a damaged header (wal_open_segments) */
        int rc = io_settle(w->io, s->f);
        int copy = rc == 0 && s->copied ? seg_copy_short(w, s) : 0;
        if (copy < 0) {
            snprintf(w->err, sizeof w->err,
                     "log segment %llu: reading the file, shorter than a segment, again: %s",
                     (unsigned long long)q, idem_strerror(copy));
            return -EIO;
        }
        if (rc < 0) {
            snprintf(w->err, sizeof w->err,
                     "log segment %llu: flushing what the last run wrote: %s",
                     (unsigned long long)q, strerror(-rc));
            return rc;
        }
    }
    return 0;
}

int wal_addr_valid(const struct wal *w, uint64_t addr)
{
    uint32_t slot = (uint32_t)(addr >> WAL_OFF_BITS);
    uint32_t off = addr_off(addr);
    /* Segments past a damaged header are open only for recovery's scan past the end. */
    return slot < WAL_SEG_SLOTS && w->segs[slot].seq != 0 &&
           (!w->damaged_seq || w->segs[slot].seq < w->damaged_seq) && off >= WAL_BLOCK &&
           off + WAL_FRAME_HDR <= w->seg_bytes;
}

/* At a SEGEND whose next segment, seq, has the damaged header: the SEGEND names that segment's
 * salt (stores written before it did not), so its frames can be read. Were the header a creation
 * cut short, no SEGEND could name it: the log rolls only into a spare whose header is durable.
 * Left over from a batch torn across the boundary, it names the salt of a segment that an open
 * later found past the end and re-created (seg_make writes a new header over the old file). That
 * open read the segment under this salt, after wal_settle, and found the batch incomplete; a
 * re-creation writes only the header, so no batch completes there later. So recovery reads on,
 * and a batch completed there is corruption: the header rotted after it was written (before,
 * such batches were dropped as a torn tail). Frames of later batches may lie there under this
 * salt (durability batch and none write unflushed batches in any order), and opens since, which
 * read the segment under a newer salt, numbered their batches without them: so scan_beyond lets
 * them raise the numbering, and calls them corruption only when the open that wrote the log's
 * tail wrote this SEGEND (wal_named_judged): a header and first frames damaged together would
 * else drop every batch acknowledged there as a torn tail. batch: the SEGEND's. */
static int damaged_install(struct wal *w, uint64_t seq, const uint8_t *segend, uint32_t len,
                           uint64_t batch)
{
    if (seq != w->damaged_seq || w->damaged.seq != seq) return 0;
    if (w->damaged.copied) {
        snprintf(w->err, sizeof w->err,
                 "log corrupt: segment %llu is %llu bytes, shorter than a segment (%u), but the "
                 "log reached it (the SEGEND of segment %llu names it): the file was cut after "
                 "it was made whole",
                 (unsigned long long)seq, (unsigned long long)w->damaged.file_bytes, w->seg_bytes,
                 (unsigned long long)seq - 1);
        return IDEM_ECORRUPT;
    }
    if (len < WAL_FRAME_HDR + WAL_SEGEND_PAYLOAD || w->segs[seq % WAL_SEG_SLOTS].seq) return 0;
    w->damaged.salt = util_get_u64(segend + WAL_FRAME_HDR);
    w->segs[seq % WAL_SEG_SLOTS] = w->damaged;
    w->named_seq = seq;
    w->named_batch = batch;
    memset(&w->damaged, 0, sizeof w->damaged);
    posix_madvise((void *)w->segs[seq % WAL_SEG_SLOTS].map, w->seg_bytes, POSIX_MADV_RANDOM);
    return 0;
}

int wal_recover(struct wal *w, uint64_t start_seq, uint32_t start_off, uint64_t prev_lsn,
                uint64_t prev_batch, const struct wal_resume *resume,
                int (*fn)(void *ctx, const struct wal_frame *f), void *ctx)
{
    struct scan_pos p = {start_seq, start_off}, batch_start = p;
    uint64_t last_lsn = prev_lsn, last_batch = prev_batch; /* of the last complete batch */
    uint64_t cur_lsn = prev_lsn, cur_batch = prev_batch;
    struct read_ahead ra = {0};
    segs_advise(w, start_seq, POSIX_MADV_RANDOM);
    for (;;) {
        read_ahead(w, &ra, p);
        struct wal_segment *s = seg_of(w, p.seq);
        uint32_t len = frame_valid(w, s, p.off);
        if (!len) break;
        const uint8_t *f = s->map + p.off;
        uint64_t lsn = util_get_u64(f + 8), batch = util_get_u64(f + 16);
        uint32_t type = util_get_u16(f + 28);
        if (lsn <= cur_lsn || batch <= last_batch ||
            (cur_lsn != last_lsn && (lsn != cur_lsn + 1 || batch != cur_batch)))
            break; /* a stale frame, or a gap inside a batch */
        cur_lsn = lsn;
        cur_batch = batch;
        if (type == WAL_T_END && w->damaged_seq && p.seq >= w->damaged_seq) {
            snprintf(w->err, sizeof w->err,
                     "log corrupt: the header of segment %llu is damaged, but its frames, read "
                     "with the salt the SEGEND before it names, complete batch %llu at segment "
                     "%llu offset %u",
                     (unsigned long long)w->damaged_seq, (unsigned long long)batch,
                     (unsigned long long)p.seq, p.off);
            segs_advise(w, start_seq, POSIX_MADV_NORMAL);
            return IDEM_ECORRUPT;
        }
        if (type == WAL_T_END) {
            int rc = replay_batch(w, batch_start, lsn, fn, ctx);
            if (rc < 0) {
                segs_advise(w, start_seq, POSIX_MADV_NORMAL);
                return rc;
            }
            last_lsn = lsn;
            last_batch = batch;
            /* The clock an END frame carries (a frame too short for one carries none). */
            int64_t clock = len >= WAL_FRAME_HDR + 8 ? (int64_t)util_get_u64(f + WAL_FRAME_HDR) : 0;
            if (clock > 0 && clock <= IDEM_CLOCK_MS_MAX) w->last_clock_ms = clock;
        }
        if (type == WAL_T_SEGEND) {
            int rc = damaged_install(w, p.seq + 1, f, len, batch);
            if (rc < 0) {
                segs_advise(w, start_seq, POSIX_MADV_NORMAL);
                return rc;
            }
        }
        if (scan_step(w, &p, type, len) < 0) { /* a SEGEND whose next segment is not open */
            /* A damaged header that no salt in the SEGEND lets be read (earlier versions): a
             * creation cut short, as before. */
            if (w->damaged_seq == p.seq + 1) break;
            /* A missing file: the log rolls only into a segment whose file was made whole and
             * its directory entry synced, and only a prefix of the log is ever removed, so a
             * SEGEND names a file that exists. Ending the log here would drop every batch
             * written after it. */
            snprintf(w->err, sizeof w->err,
                     "log corrupt: wal-%016llx.log is missing or could not be opened, but the "
                     "SEGEND of segment %llu (offset %u) names it",
                     (unsigned long long)(p.seq + 1), (unsigned long long)p.seq, p.off);
            segs_advise(w, start_seq, POSIX_MADV_NORMAL);
            return IDEM_ECORRUPT;
        }
        if (type == WAL_T_END) batch_start = p;
    }
    /* The log ends at the end of the last complete batch. */
    uint64_t max_lsn = last_lsn, max_batch = last_batch;
    int clean = resume->clean_lsn && last_lsn == resume->clean_lsn && cur_lsn == last_lsn;
    int rc = clean ? 0 : scan_beyond(w, batch_start, last_batch, resume, &ra, &max_lsn, &max_batch);
    segs_advise(w, start_seq, POSIX_MADV_NORMAL); /* the open store's reads: the default */
    if (rc < 0) return rc;
    if (cur_lsn > max_lsn) max_lsn = cur_lsn;
    w->lsn_last = w->lsn_written = w->lsn_durable = w->lsn_durable_at_open = max_lsn;
    w->lsn_recovered = last_lsn;
    /* At least two above the last complete batch: the torn batch's number is never reused. Nor
     * is the first batch of the open that wrote the tail, which it may have written unseen (a
     * tear that kept no block where one of its frames starts): frames of two runs' torn batches
     * numbered alike could read as one batch. */
    w->batch = (max_batch > last_batch + 1 ? max_batch : last_batch + 1) + 1;
    if (resume->first_batch >= w->batch) w->batch = resume->first_batch + 1;
    if (w->batch >= WAL_NUMBER_LIMIT || w->lsn_last + 1 >= WAL_NUMBER_LIMIT) {
        snprintf(w->err, sizeof w->err,
                 "log corrupt: the next batch (%llu) or LSN (%llu) reaches 2^62, which no "
                 "store numbers up to",
                 (unsigned long long)w->batch, (unsigned long long)w->lsn_last + 1);
        return IDEM_ECORRUPT;
    }
    w->cur_seq = batch_start.seq;
    w->cur_off = batch_start.off;
    /* Segments past the end are stale; they are re-created (new salt) when the log gets there. */
    for (uint64_t q = w->cur_seq + 1; seg_of(w, q) || q < w->beyond_last_seq; q++)
        if (seg_of(w, q)) seg_close(w, seg_of(w, q));
    if (w->damaged.seq) seg_close(w, &w->damaged);
    w->damaged_seq = w->beyond_last_seq = w->named_seq = w->named_batch = 0;
    return 0;
}
