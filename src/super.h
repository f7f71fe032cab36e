/*
 * super.h: the superblock, the lock file and the index checkpoint: the small files that say
 * where the log starts and what the store is.
 *
 * DIR/super holds two 4 KiB copies of the superblock, written alternately (copy generation % 2)
 * and flushed; open takes the valid copy with the higher generation, so a torn write of one copy
 * leaves the other. Layout of a copy (little-endian):
 *    0 u8[8] "IDEMSUPR"      8 u32 format version     12 u32 incompatible features (bits below)
 *   16 u64 generation       24 u8[16] store id        40 u64 hash seed (secret)
 *   48 u64 token_reserved (tokens below it may have been handed out; the next open starts there)
 *   56 u64 wal_first_seq    64 u64 checkpoint id (0: none)
 *   72 u64 checkpoint replay segment   80 u32 checkpoint replay offset   84 u32 segment bytes
 *   88 u64 checkpoint lsn   96 u64 checkpoint batch   104 i64 store clock ms
 *  112 i64 created ms      120 u64 store generation (bumped by restore and import)
 *  128 u64 live bytes at the checkpoint (frames the index points to)
 *  136 u64[3] keys in_flight, committed, review at the checkpoint
 *  160 u64 resume batch: the number of the first batch written after the open that wrote this
 *      copy (0: not recorded; recovery then expects last complete batch + 1 after the end)
 *  168 u32 durability of that open + 1 (0: not recorded, taken as sync)
 *  176 u64 counts lsn: live bytes and key counts above are those after every frame up to this
 *      LSN (0 or the checkpoint lsn: a checkpoint taken with changes held; above it: one taken
 *      while changes went on, whose image mixes versions up to this LSN, see store.c)
 *  184 u64 clean lsn: the log's last LSN when the open that wrote this copy closed cleanly
 *      (0: it had not; every open that may write clears it in its first copy). Older builds
 *      leave it 0, and zero it when they write.
 *  192 u64 audit length: audit.log holds at least this many bytes of whole units (0: none)
 *  200 u32 checkpoint flags (SUPER_CKPT_*)
 *  208 u64 durable lsn: every batch up to this LSN was complete and durable when this copy was
 *      written (the end of the log the open recovered, or a later flush); a log that ends
 *      before it lost acknowledged batches. Older builds leave it 0, and zero it when they write.
 * 4088 u64 XXH3-64 of bytes [0, 4088)
 *
 * DIR/index-<id:016x>.ckpt is an image of the index at a batch boundary (formats in super.c).
 * DIR/LOCK is held with flock by the owning process and names its pid and host.
 */
#ifndef IDEM_SUPER_H
#define IDEM_SUPER_H

#include <stddef.h>
#include <stdint.h>

#include "io.h"

#define SUPER_FORMAT 1u
/* Incompatible features: a build that does not know a bit set in a copy refuses the store.
 * SUPER_FEAT_CKPT_CHUNKS: checkpoints may be in format 2 (chunks, each with its checksum); every
 * copy written since that format exists sets it. */
#define SUPER_FEAT_CKPT_CHUNKS 0x1u
/* SUPER_FEAT_AUDIT_GROUPS: audit.log may hold groups of entries (audit.c), which a build that
 * reads one entry per block would take for damage. */
#define SUPER_FEAT_AUDIT_GROUPS 0x2u
/* SUPER_FEAT_COMPACT_RECORDS: the log may hold records in the compact form (record.h), which a
 * build that knows only the fixed form would take for damage. */
#define SUPER_FEAT_COMPACT_RECORDS 0x4u
/* SUPER_FEAT_AUDIT_FLAGS: audit entries may carry flags and a result (audit.c), which a build
 * that reads the flags' word as zero would take for damage. */
#define SUPER_FEAT_AUDIT_FLAGS 0x8u
#define SUPER_FEATURES_KNOWN                                                                       \
    (SUPER_FEAT_CKPT_CHUNKS | SUPER_FEAT_AUDIT_GROUPS | SUPER_FEAT_COMPACT_RECORDS |               \
     SUPER_FEAT_AUDIT_FLAGS)
/* The log never holds more segments than this (wal.h WAL_SEG_SLOTS). */
#define SUPER_SEGMENTS_MAX 16384u
/* Tokens one superblock write reserves ahead (store.c reserve_tokens): a copy's token_reserved
 * is at most this much above the copy before it, unless an import raised the next token. */
#define SUPER_TOKEN_BLOCK (1u << 20)

struct super {
    uint32_t features; /* as read; every copy written sets SUPER_FEATURES_KNOWN */
    uint64_t generation;
    uint8_t store_id[16];
    uint64_t hash_seed;
    uint64_t token_reserved;
    uint64_t wal_first_seq;
    uint64_t ckpt_id;
    uint64_t ckpt_seq;
    uint32_t ckpt_off;
    uint32_t seg_bytes;
    uint64_t ckpt_lsn;
    uint64_t ckpt_batch;
    int64_t store_clock_ms;
    int64_t created_ms;
    uint64_t store_generation;
    uint64_t ckpt_live_bytes;
    uint64_t ckpt_keys_by_state[3];
    uint64_t resume_batch;
    uint32_t open_durability; /* enum idem_durability + 1; 0: not recorded */
    uint64_t ckpt_counts_lsn;
    uint64_t clean_lsn;  /* 0: not closed cleanly since the last open that could write */
    uint64_t audit_len;  /* audit.log holds at least this many bytes of whole units (0: none) */
    uint32_t ckpt_flags; /* SUPER_CKPT_* */
    uint64_t log_durable_lsn; /* 0: not recorded */
};

/* The checkpoint was taken in steps: a key moved across the scan's cursor by an index split is
 * listed twice. Recorded since the twenty-seventh session; older copies leave it 0, and for
 * them a checkpoint whose counts LSN is past its LSN was taken in steps (super_ckpt_stepped). */
#define SUPER_CKPT_STEPPED 0x1u

/* Whether every field that addresses the log, counts or tokens is in range (super_load checks it
 * before anything trusts them; idem_verify too). */
int super_fields_valid(const struct super *sb);

/* Whether the loader must look for keys the checkpoint lists twice. */
static inline int super_ckpt_stepped(const struct super *sb)
{
    return (sb->ckpt_flags & SUPER_CKPT_STEPPED) || sb->ckpt_counts_lsn > sb->ckpt_lsn;
}

/* Decodes one 4 KiB copy: 1 when valid (sb filled), 0 when it fails its checksum or magic,
 * IDEM_EVERSION when valid but of an unknown format or features. */
int super_decode(const uint8_t *p, struct super *sb);
/* What the newest valid copy sb is taken for when the other copy fails its checksum (the reasons
 * are at its call in super_load): not clean, and its token reservation a block further on.
 * verify reads the copies itself and calls it too. */
void super_other_copy_failed(struct super *sb);
/* Loads the newest valid copy. IDEM_ENOTFOUND: no superblock file (a new store);
 * IDEM_ECORRUPT: neither copy valid; IDEM_EVERSION: unknown format or features. err gets a
 * sentence on failure. settle: first flush the file and drop its cached pages, so that a copy
 * whose write failed in an earlier run (cached, on no disk) is not read (io.h, drop_cache);
 * IDEM_EIO if that fails. */
int super_load(struct io *io, const char *dir, struct super *sb, int settle, char *err,
               size_t errcap);
/* Writes sb with generation+1 into the other copy and flushes it. A new file is written as
 * super.tmp, flushed, renamed to super and the directory synced, so super never exists without
 * a valid copy (a power loss keeping its name but not its data would leave a store that never
 * opens again). */
int super_store(struct io *io, const char *dir, struct super *sb);

/* How a process takes DIR/LOCK (flock, nonblocking). */
enum lock_mode {
    LOCK_AS_OWNER,  /* alone; the file made if missing, the owner's pid and host written in */
    LOCK_AS_READER, /* shared with other readers and sharers, through a read-only descriptor;
                     * never made (no lock file: *fd_out -1, no process owned the store since
                     * it was made or copied) nor written */
    LOCK_AS_SHARER, /* as a reader, but the file made if missing, so that the lock holds: the
                     * removal of an import's marker, which no owner may start during */
};
/* Returns 0 with *fd_out set, or IDEM_ELOCKED with err naming the owner (or the readers), or
 * IDEM_EIO. */
int lock_acquire(const char *dir, enum lock_mode mode, int *fd_out, char *err, size_t errcap);
void lock_release(int fd);

/* ckpt_entry.has_seen bits */
#define CKPT_SEEN       0x1u /* seen_count and last_seen_ms hold the repeat counters */
#define CKPT_UNFINISHED 0x2u /* the record is in_flight or review */

/* One entry of a checkpoint: an index slot and the repeat counters of its key. */
struct ckpt_entry {
    uint64_t addr_tag;
    uint32_t hash_lo;
    uint32_t has_seen; /* CKPT_* bits */
    uint64_t seen_count;
    int64_t last_seen_ms;
};

struct ckpt_writer;
int ckpt_begin(struct io *io, const char *dir, uint64_t id, struct ckpt_writer **out);
int ckpt_add(struct ckpt_writer *cw, const struct ckpt_entry *e);
/* Entries ckpt_add takes before it must write its buffer out (it would then do I/O itself). */
uint32_t ckpt_room(const struct ckpt_writer *cw);
/* Writes the buffered entries out (no flush). Only the writer's owner calls it; no lock needed. */
int ckpt_write_out(struct ckpt_writer *cw);
/* Writes the trailer, flushes the file and syncs the directory; frees cw either way. */
int ckpt_end(struct ckpt_writer *cw);
void ckpt_abort(struct ckpt_writer *cw);
/* The largest file a checkpoint of this many entries can be (every entry with its counters). */
uint64_t ckpt_bytes_max(uint64_t entries);
/* The size of checkpoint id's file: 0 when there is none. */
uint64_t ckpt_file_bytes(struct io *io, const char *dir, uint64_t id);

/* A checkpoint file in memory whose header and trailer have been checked (ckpt_parse_open). */
struct ckpt_file {
    const uint8_t *m;
    uint64_t size;
    uint32_t format; /* 1 or 2 */
    uint64_t count;  /* entries, per the trailer */
    uint64_t chunks; /* per the trailer (format 1: one) */
    uint64_t end;    /* offset of the trailer */
};
/* A run of entries whose checksum has been checked. */
struct ckpt_chunk {
    const uint8_t *body;
    uint64_t len, entries;
};
/* Where ckpt_parse_chunk is: the file offset (4096 at first), chunks and entries passed. */
struct ckpt_cursor {
    uint64_t pos, k, entries;
};
/* Checks the header (magic, checksum, id, a known format) and the trailer; format 1 also gets
 * its one checksum over all entries checked here. 0, or IDEM_ECORRUPT / IDEM_EVERSION with err
 * naming the file part (name) and offset. */
int ckpt_parse_open(const uint8_t *m, uint64_t size, uint64_t id, const char *name,
                    struct ckpt_file *cf, char *err, size_t errcap);
/* The chunk at the cursor: checks its checksum and that its entries decode to exactly its
 * length, and advances the cursor. 1 with ch filled, 0 after the last one (every count of the
 * trailer matched), or IDEM_ECORRUPT with err. Format 1 is one chunk, checked already. */
int ckpt_parse_chunk(const struct ckpt_file *cf, struct ckpt_cursor *cur, struct ckpt_chunk *ch,
                     const char *name, char *err, size_t errcap);
/* Decodes the entry at p inside a checked chunk; returns its length in bytes. */
uint32_t ckpt_decode(const struct ckpt_file *cf, const uint8_t *p, struct ckpt_entry *e);

/* Reads checkpoint id, passing each entry on only after the checksum that covers it held (in
 * format 2 chunk by chunk, so the disk reads ahead while earlier chunks load). sized (if not
 * NULL) is called first with the entry count from the trailer (checked, and bounded by the
 * file's length), so a loader can size its table (its error ends the load); then, in file order,
 * plain with each run of n plain entries (format 2, 16 bytes each, flags 0: u64 addr_tag, u32
 * hash_lo, u32 0) and fn with every other entry, decoded. A file that fails a check part-way leaves
 * the entries before it passed on: the caller discards what it built. */
int ckpt_load(struct io *io, const char *dir, uint64_t id, int (*sized)(void *ctx, uint64_t count),
              int (*fn)(void *ctx, const struct ckpt_entry *e),
              int (*plain)(void *ctx, const uint8_t *run, uint64_t n), void *ctx, char *err,
              size_t errcap);
void ckpt_path(const char *dir, uint64_t id, char *buf, size_t cap);

#endif
