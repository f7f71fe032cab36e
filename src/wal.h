/*
 * wal.h: the write-ahead log, the store's source of truth.
 *
 * The log is a sequence of preallocated segment files DIR/wal-<seq:016x>.log of equal size.
 * Block 0 (4 KiB) of a segment is its header; frames follow, 8-byte aligned:
 *
 *   frame header (32 bytes, little-endian)
 *     0  u64 checksum  XXH3-64 of bytes [8, len) seeded with the segment's salt
 *     8  u64 lsn       strictly increasing over the whole log (+1 within a batch)
 *    16  u64 batch     the flush batch the frame belongs to, increasing
 *    24  u32 len       whole frame, header included, a multiple of 8
 *    28  u16 type      WAL_T_*
 *    30  u16 flags     0
 *   payload (len - 32 bytes)
 *
 * Every flush batch ends with an END frame (payload: i64 store clock ms) and the rest of its last
 * 4 KiB block is left zero: the next batch starts on a fresh block, so no flush rewrites a block
 * that holds acknowledged data. A segment whose room is used up ends with a SEGEND frame (payload:
 * u64 salt of the next segment) and the log goes on at block 1 of the next segment. Where fewer
 * than 32 bytes are left in a block the next frame starts at the next block; a PAD frame fills the
 * rest of a block when a chunk buffer is full, so every chunk starts on a block boundary.
 *
 * Recovery applies only batches whose END frame is present: a batch is acknowledged only after
 * its flush, END included, so a batch without END was never acknowledged and is dropped whole.
 * After a torn tail, the next LSN and batch number start above every valid frame seen, so stale
 * frames left behind can never be taken for new ones. Corruption is a valid frame, after the
 * point where the log stops, from a batch later than the one that was in flight, and a batch
 * completed in a segment whose header is damaged (read with the salt its SEGEND names).
 *
 * Addresses: a frame is named by a 40-bit address, segment slot (seq mod WAL_SEG_SLOTS, 14 bits)
 * and byte offset / 8 (26 bits). Offsets of frames are >= 4096, so no address is 0.
 *
 * Group commit: frames are appended into 4 KiB-aligned chunk buffers under the store's lock;
 * the flusher takes every pending chunk (wal_flush_begin), writes each linked to a flush
 * without the lock (wal_flush_io), and publishes the durable LSN (wal_flush_end). One batch is in
 * flight while the next fills. Frames in flight or pending are read from their chunk; others
 * from the read-only map of their segment.
 */
#ifndef IDEM_WAL_H
#define IDEM_WAL_H

#include <stddef.h>
#include <stdint.h>

#include "idem.h"
#include "io.h"

#define WAL_BLOCK         4096u
#define WAL_FRAME_HDR     32u
#define WAL_SEG_SLOTS     16384u
#define WAL_SEG_BYTES_MAX (512u * 1024u * 1024u)
#define WAL_SEG_BYTES_MIN (64u * 1024u)
/* LSNs and batch numbers stay below this (as the superblock's fields must, super.c): a frame
 * that names one at or above it is no frame of this store, however its checksum reads (one
 * taken would wrap the next open's batch numbers, and its batches would read as stale). */
#define WAL_NUMBER_LIMIT (UINT64_C(1) << 62)
#define WAL_CHUNK_BYTES  (2u << 20)
#define WAL_CHUNKS_MAX   32u
/* A SEGEND frame's payload: u64 salt of the next segment. Stores written before it have none
 * (an empty payload); readers take either. */
#define WAL_SEGEND_PAYLOAD 8u

enum wal_type {
    WAL_T_RECORD = 1, /* a full version of a record (record.h) */
    WAL_T_DELETE = 2, /* key removed: u16 key_len, key */
    WAL_T_END = 3,    /* end of a flush batch: i64 store clock ms */
    WAL_T_SEGEND = 4, /* the rest of this segment is unused: u64 salt of the next (or none) */
    WAL_T_PAD = 5,    /* filler to the end of a block */
};

struct wal;

struct wal_frame {
    uint64_t addr;
    uint64_t lsn;
    uint32_t type;
    const uint8_t *payload;
    uint32_t payload_len;
};

/* Creates the log handle over io in dir; segments are opened by wal_recover or wal_init_new. */
int wal_create(struct io *io, const char *dir, uint32_t seg_bytes, struct wal **out);
void wal_destroy(struct wal *w);

/* A new store: creates the first segment (seq 1). */
int wal_init_new(struct wal *w);

/* Opens and checks segments first_seq.. up to the first absent one (below start_seq, absent ones
 * are passed over). A damaged header past start_seq ends the log: a creation cut short, or rot;
 * the segments after it are opened for wal_recover to tell the two apart by their batches.
 * IDEM_ECORRUPT if one the log needs is missing or damaged; another error of an open fails. */
int wal_open_segments(struct wal *w, uint64_t first_seq, uint64_t start_seq, int read_only);
/* Whether addr names a place inside an open segment (no page is touched). */
int wal_addr_valid(const struct wal *w, uint64_t addr);

/* What recovery knows about the open that wrote the log's last batches (from the superblock
 * it wrote before writing any): the number of its first batch (0: not recorded; the next open
 * numbers its own above it, wal_recover) and whether it
 * flushed every batch before writing the next (sync or batch mode, or not recorded); and clean_lsn,
 * the log's last LSN when that open closed cleanly (0: it did not, or the copy predates the mark).
 * When the replay ends exactly there, nothing past the end was ever written by that open, and
 * the scan past the end (which reads zero-filled space in full) is skipped. */
struct wal_resume {
    uint64_t first_batch;
    int sync;
    uint64_t clean_lsn;
};

/* Whether the run that wrote the log's tail, opened with open_durability (the superblock's:
 * enum idem_durability + 1, 0 unknown), wrote each batch only once the one before it was
 * durable: in sync and in batch mode (each flush is made durable before the next is written;
 * batch mode only answers before the flush), not in none. */
static inline int wal_ordered_batches(uint32_t open_durability)
{
    return open_durability != IDEM_DURABILITY_NONE + 1;
}

/* Whether a valid frame of batch b past the end of the log (last complete batch last) is
 * corruption. With ordered batches (wal_ordered_batches: r->sync), past the end lies at most
 * the batch that was in flight: last + 1, or the open's first batch when none of its batches
 * completed (the numbering skips at an open). In durability none, unflushed batches may reach
 * the disk in any order: nothing past the end is corruption. */
static inline int wal_beyond_is_corrupt(uint64_t b, uint64_t last, const struct wal_resume *r)
{
    if (!r->sync) return 0;
    uint64_t in_flight = r->first_batch > last ? r->first_batch : last + 1;
    return b > in_flight;
}

/* Whether frames past the end in a segment whose header is damaged, read under the salt that
 * the SEGEND of batch segend_batch names (wal_recover), are judged as the rest of the log
 * (wal_beyond_is_corrupt). Only when the open that wrote the log's tail wrote that SEGEND (its
 * batches are numbered from first_batch on): then every frame under that salt is its own. Else
 * they may be older than opens since, which could not read them under the salt the segment had
 * then and numbered their batches below them. */
static inline int wal_named_judged(uint64_t segend_batch, const struct wal_resume *r)
{
    return r->first_batch && segend_batch >= r->first_batch;
}

/*
 * Replays frames from (start_seq, start_off) calling fn for each RECORD and DELETE frame and the
 * END frames of complete batches (fn returns 0 or a negative idem_err to stop). A torn tail is
 * dropped: appends go on where its batch began. A valid frame after a bad one that
 * wal_beyond_is_corrupt calls corruption is reported (IDEM_ECORRUPT, with a message); other
 * valid frames past the end are counted (wal_frames_beyond). Writes nothing. The next batch
 * number is above every one seen and above resume->first_batch; frames that name an LSN or
 * batch at or above WAL_NUMBER_LIMIT are no frames, and a log numbered up to it is refused.
 */
int wal_recover(struct wal *w, uint64_t start_seq, uint32_t start_off, uint64_t prev_lsn,
                uint64_t prev_batch, const struct wal_resume *resume,
                int (*fn)(void *ctx, const struct wal_frame *f), void *ctx);
/* Before wal_recover, after an open that followed no clean close: flushes every open segment
 * from start_seq on and drops its clean cached pages, so that recovery reads what the disk
 * holds. What the last run wrote but did not flush (a kill during a flush, durability none)
 * becomes durable before anything is answered from it; what a failed flush lost (cached, marked
 * clean, on no disk) is read as the disk has it. Returns 0 or -errno (wal_error says which). */
int wal_settle(struct wal *w, uint64_t start_seq);
/* Valid frames recovery found past the end of the log and dropped (unacknowledged writes). */
uint64_t wal_frames_beyond(const struct wal *w);

/* Appends a frame of `type` whose payload is the concatenation of parts. Returns 0 and sets
 * *addr and *lsn, IDEM_EBUSY when every chunk buffer waits for a flush (flush and retry),
 * IDEM_EFULL when the next segment could not be allocated; check wal_room first. */
int wal_append(struct wal *w, uint32_t type, const void *const *parts, const uint32_t *part_lens,
               int nparts, uint64_t *addr, uint64_t *lsn);

/* Ends the current segment now (SEGEND) and goes on in the spare, so that compaction can walk
 * it (a store whose records fit in one segment is never walked otherwise): 1 when it did, 0
 * when the segment holds no frame, IDEM_EBUSY when the spare or a chunk buffer is not ready
 * (try later), or the error the spare's creation met. Mu held, as for an append. */
int wal_roll(struct wal *w);

/* Whether an append of a frame of frame_bytes (payload + 32) can go ahead now: 0, IDEM_EBUSY
 * (wait for the flusher: chunk buffers or the spare segment), or the error that creating the
 * spare segment met (IDEM_EFULL when the disk is full). */
int wal_room(const struct wal *w, uint32_t frame_bytes);
/* Whether a frame of frame_bytes still fits in the current segment, with no roll. */
int wal_cur_fits(const struct wal *w, uint32_t frame_bytes);
/* The flusher keeps one spare segment created ahead of need (file creation, allocation and its
 * header flush happen there, never on a caller's path). Call with no batch in flight. */
int wal_spare_needed(const struct wal *w);
/* Makes the spare segment at once (lock held throughout; at open). */
int wal_spare_create(struct wal *w);
/* The same in three steps, so that its file I/O runs without the store's lock:
 * wal_spare_begin (lock held) names the segment to make (0: none needed, or *rc is an error);
 * wal_spare_make (no lock needed; the caller keeps the ring to itself meanwhile) creates,
 * allocates, writes the header, syncs the directory and maps it, touching no state of w;
 * wal_spare_end (lock held) installs what was made, or records rc, and returns rc. */
struct wal_segment;
struct remover;
uint64_t wal_spare_begin(struct wal *w, int *rc);
int wal_spare_make(struct wal *w, uint64_t seq, struct wal_segment **out);
int wal_spare_end(struct wal *w, struct wal_segment *made, int rc);

/* Zero-fills space ahead of the log from now on (filler.h): the rest of the current segment
 * from the next piece boundary but one, each spare as it is installed; every write of a batch
 * passes filler_fence first. Lock held; call once, after recovery and the first spare; and
 * with NULL before the filler is destroyed (at close, once the flusher is joined: no lock). */
struct filler;
void wal_set_filler(struct wal *w, struct filler *fl);
/* io_overwrites_in_place of the current segment's file (on btrfs it depends on the file). */
int wal_overwrites_in_place(struct wal *w);

/* Starts loading the first bytes of the frame at addr from the segment map (any address is
 * safe: one that names no mapped frame is ignored). */
void wal_prefetch(const struct wal *w, uint64_t addr);
/* Pointer to the frame payload at addr (valid until the next append or flush end); NULL if the
 * address names no readable frame. *payload_len and *lsn are set. */
const uint8_t *wal_payload(struct wal *w, uint64_t addr, uint32_t *payload_len, uint64_t *lsn);
/* The same, checking every frame whatever the scope: it writes nothing, so readers may call it
 * at once (store.h, rw). */
const uint8_t *wal_payload_shared(const struct wal *w, uint64_t addr, uint32_t *payload_len,
                                  uint64_t *lsn);
/* Opens (on) or closes the scope of one operation, run under the store's lock without letting
 * go of it: within it, a frame read twice in a row is checked once. Outside, wal_payload checks
 * every durable frame it reads. */
void wal_check_scope(struct wal *w, int on);

/* Group commit, in three steps. begin (under the store lock): closes the batch with an END frame
 * carrying clock_ms and moves pending chunks in flight; returns the number of chunks (0: nothing
 * to do). io (without the lock, flusher thread only): writes them, each linked to a flush when
 * durable; returns 0 or a negative errno (fatal). end (under the lock): releases the chunks and
 * returns the LSN now durable. */
int wal_flush_begin(struct wal *w, int64_t clock_ms);
int wal_flush_io(struct wal *w, int durable);
uint64_t wal_flush_end(struct wal *w, int durable);
/* Durability none writes batches without flushing them (a sealed segment is flushed all the
 * same): a sync flushes what was written (flusher thread, nothing in flight), the lock let go
 * for the flush. wal_sync_point (lock held) names it: 0 when nothing waits for one, else 1 and
 * *p; wal_sync_io (lock let go; appends may go on, nothing is flushed meanwhile) flushes it and
 * returns 0 or a negative errno (fatal); wal_sync_done (lock held) records it durable. */
struct wal_sync_point {
    struct io_file *f; /* the current segment's file: every write not flushed is in it */
    uint64_t lsn;      /* the last LSN written */
};
int wal_sync_point(struct wal *w, struct wal_sync_point *p);
int wal_sync_io(struct wal *w, const struct wal_sync_point *p);
void wal_sync_done(struct wal *w, const struct wal_sync_point *p);
uint64_t wal_written_lsn(const struct wal *w);

uint64_t wal_last_lsn(const struct wal *w);     /* last LSN appended */
uint64_t wal_durable_lsn(const struct wal *w);  /* last LSN on stable storage */
int wal_pending(const struct wal *w);           /* nonzero: frames wait for a flush */
uint64_t wal_flush_frames(const struct wal *w); /* RECORD/DELETE frames in the batch in flight */
int wal_chunks_free(const struct wal *w);       /* chunk buffers not pending or in flight */
/* Tests: while on, a chunk that needs its buffer finds no memory for it. */
void wal_test_fail_buffers(struct wal *w, int on);
uint64_t wal_buffer_bytes(const struct wal *w); /* chunk buffers allocated, in use or kept */
/* Detaches the chunk buffers on the free list beyond `keep` allocated, the least recently used
 * first, into out[] (room for WAL_CHUNKS_MAX); returns how many. The caller unmaps them with
 * wal_buffers_free, without the store's lock; a later chunk allocates its buffer again. */
int wal_buffers_take(struct wal *w, int keep, void **out);
void wal_buffers_free(void **bufs, int n);
uint64_t wal_bytes(const struct wal *w); /* bytes of all segments */
/* Where the next batch starts: a checkpoint taken now replays from here. */
void wal_position(const struct wal *w, uint64_t *seq, uint32_t *off);
uint64_t wal_first_seq(const struct wal *w);
/* The last segment the open found missing below the replay segment with older ones present
 * (left out of the log, with them), or 0. */
uint64_t wal_gap_seq(const struct wal *w);
uint64_t wal_batch(const struct wal *w);        /* the batch being filled */
int64_t wal_last_clock_ms(const struct wal *w); /* clock of the last END frame replayed */
/* ---- Compaction (compact.c) ---- */
/* Segments the log holds now (the spare not counted). */
uint64_t wal_segments(const struct wal *w);
/* Walks the frames of a sealed, durable segment: from *off (WAL_BLOCK to begin) returns the next
 * RECORD or DELETE frame and advances *off; returns 1 with a frame, 0 at its SEGEND, -1 when a
 * frame before the SEGEND fails its checksum (corruption: the walk must stop). */
int wal_seg_next(struct wal *w, uint64_t seq, uint32_t *off, struct wal_frame *f);
/* A sealed segment to walk without the store's lock: its bytes never change, and it stays mapped
 * until it is retired, which only the flusher does. */
struct wal_seg_view {
    const uint8_t *map;
    uint64_t seq, salt;
    uint32_t seg_bytes;
};
/* The view of sealed segment seq (the lock held). */
void wal_seg_view(struct wal *w, uint64_t seq, struct wal_seg_view *v);
/* wal_seg_next over a view: reads the segment's bytes and nothing else of the log. */
int wal_view_next(const struct wal_seg_view *v, uint32_t *off, struct wal_frame *f);
/* Whether segment seq is sealed (SEGEND written) and every frame of it is durable. */
int wal_seg_durable(const struct wal *w, uint64_t seq, uint64_t durable_lsn);
/* The LSN that recovery ended at: the last frame of the last complete batch. */
uint64_t wal_recovered_lsn(const struct wal *w);
/* The last LSN of the last complete batch on stable storage: wal_durable_lsn once this run has
 * flushed a batch, wal_recovered_lsn before (the durable LSN then counts a torn batch's frames,
 * which the next recovery drops again). */
uint64_t wal_complete_lsn(const struct wal *w);
/* Appends a copy of a frame's payload (compaction). */
int wal_copy(struct wal *w, const struct wal_frame *f, uint64_t *addr, uint64_t *lsn);
/* Retirement of the segments from the first through upto (sealed, at most WAL_RETIRE_MAX), once
 * the caller has made a superblock durable that starts the log after upto. In two parts, so
 * that the file work runs without the store's lock: wal_retire_detach (lock held) takes them
 * out of the log, so that no address in them is served from then on; wal_retire_remove (lock
 * let go, by the one thread that retires) unmaps, closes and deletes them, then syncs the
 * directory once. It touches only what detach set aside and the ring. */
#define WAL_RETIRE_MAX 64
int wal_retire_detach(struct wal *w, uint64_t upto);
/* rm: the segments go to it (remover.h) to be unmapped, closed and deleted; NULL: all of that
 * here, then the directory synced. */
int wal_retire_remove(struct wal *w, struct remover *rm);
/* The path of segment seq's file in dir. */
void wal_seg_path(const char *dir, uint64_t seq, char *buf, size_t cap);
/* The segment holding addr (by slot); 0 if none. */
uint64_t wal_addr_seq(const struct wal *w, uint64_t addr);
/* The offset in its segment of the frame at addr. */
uint32_t wal_addr_off(uint64_t addr);
uint64_t wal_cur_seq(const struct wal *w);

/* Sentence describing the last recovery failure. */
const char *wal_error(const struct wal *w);

#endif /* IDEM_WAL_H */
