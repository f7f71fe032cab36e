/*
 * super.c: superblock copies, the directory lock, and checkpoint files (formats in super.h and
 * below).
 *
 * Checkpoint file, both formats: a 4 KiB header block ("IDEMCKPT", u32 format, u32 0, u64 id,
 * then at 4088 an XXH3-64 of [0, 4088)), the entries, a 32-byte trailer, then zero padding to a
 * multiple of 4 KiB. The file is complete only with a valid trailer; it is never loaded before
 * a superblock names it, which happens only after it was flushed.
 *
 * Format 2 (written): chunks, each a 32-byte header ("IDEMCCHK", u32 entries (>= 1), u32 body
 * bytes, u64 XXH3-64 of the body seeded with the chunk's number from 0, u64 0) and a body of
 * entries: u64 addr_tag, u32 hash_lo, u32 has_seen (CKPT_* bits, no others), and when CKPT_SEEN
 * is set 16 more bytes: u64 seen_count, i64 last_seen_ms. Chunks follow each other without a
 * gap; each holds what one write-out buffered (at most 1 MiB). Trailer: "IDEMCEND", u64 entry
 * count, u64 chunk count, u64 XXH3-64 of the trailer's first 24 bytes seeded with the id. A
 * loader checks each chunk before it uses its entries, so it can read and load at once.
 *
 * Format 1 (read only, stores written before format 2): 32-byte entries (u64 addr_tag, u32
 * hash_lo, u32 has_seen, u64 seen_count, i64 last_seen_ms), then the trailer "IDEMCEND", u64
 * entry count, u64 XXH3-64 of all entry bytes, u64 0. Its one checksum is checked before any
 * entry is used.
 */
#include "super.h"

#include <sys/mman.h>

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>
#include <xxhash.h>

#include "idem.h"
#include "util.h"

#define SUPER_MAGIC "IDEMSUPR"
#define SUPER_BLOCK 4096u
#define SUPER_CKSUM 4088u
#define CKPT_MAGIC  "IDEMCKPT"
#define CKPT_END    "IDEMCEND"
#define CKPT_CHUNK  "IDEMCCHK"
#define CKPT_ENTRY                                                                                 \
    32u /* format 1's entries, the trailer, format 2's chunk header, its largest entry */
#define CKPT_SLOT   16u        /* format 2's entry without repeat counters */
#define CKPT_BUF    (1u << 20) /* the write-out buffer: a chunk holds at most what it did */
#define CKPT_FORMAT 2u

static void super_encode(const struct super *sb, uint8_t *p)
{
    memset(p, 0, SUPER_BLOCK);
    memcpy(p, SUPER_MAGIC, 8);
    util_put_u32(p + 8, SUPER_FORMAT);
    util_put_u32(p + 12, SUPER_FEATURES_KNOWN);
    util_put_u64(p + 16, sb->generation);
    memcpy(p + 24, sb->store_id, 16);
    util_put_u64(p + 40, sb->hash_seed);
    util_put_u64(p + 48, sb->token_reserved);
    util_put_u64(p + 56, sb->wal_first_seq);
    util_put_u64(p + 64, sb->ckpt_id);
    util_put_u64(p + 72, sb->ckpt_seq);
    util_put_u32(p + 80, sb->ckpt_off);
    util_put_u32(p + 84, sb->seg_bytes);
    util_put_u64(p + 88, sb->ckpt_lsn);
    util_put_u64(p + 96, sb->ckpt_batch);
    util_put_u64(p + 104, (uint64_t)sb->store_clock_ms);
    util_put_u64(p + 112, (uint64_t)sb->created_ms);
    util_put_u64(p + 120, sb->store_generation);
    util_put_u64(p + 128, sb->ckpt_live_bytes);
    for (int i = 0; i < 3; i++)
        util_put_u64(p + 136 + 8 * i, sb->ckpt_keys_by_state[i]);
    util_put_u64(p + 160, sb->resume_batch);
    util_put_u32(p + 168, sb->open_durability);
    util_put_u64(p + 176, sb->ckpt_counts_lsn);
    util_put_u64(p + 184, sb->clean_lsn);
    util_put_u64(p + 192, sb->audit_len);
    util_put_u32(p + 200, sb->ckpt_flags);
    util_put_u64(p + 208, sb->log_durable_lsn);
    util_put_u64(p + SUPER_CKSUM, XXH3_64bits(p, SUPER_CKSUM));
}

int super_decode(const uint8_t *p, struct super *sb)
{
    if (memcmp(p, SUPER_MAGIC, 8) || util_get_u64(p + SUPER_CKSUM) != XXH3_64bits(p, SUPER_CKSUM))
        return 0;
    if (util_get_u32(p + 8) != SUPER_FORMAT || (util_get_u32(p + 12) & ~SUPER_FEATURES_KNOWN))
        return IDEM_EVERSION;
    sb->features = util_get_u32(p + 12);
    sb->generation = util_get_u64(p + 16);
    memcpy(sb->store_id, p + 24, 16);
    sb->hash_seed = util_get_u64(p + 40);
    sb->token_reserved = util_get_u64(p + 48);
    sb->wal_first_seq = util_get_u64(p + 56);
    sb->ckpt_id = util_get_u64(p + 64);
    sb->ckpt_seq = util_get_u64(p + 72);
    sb->ckpt_off = util_get_u32(p + 80);
    sb->seg_bytes = util_get_u32(p + 84);
    sb->ckpt_lsn = util_get_u64(p + 88);
    sb->ckpt_batch = util_get_u64(p + 96);
    sb->store_clock_ms = (int64_t)util_get_u64(p + 104);
    sb->created_ms = (int64_t)util_get_u64(p + 112);
    sb->store_generation = util_get_u64(p + 120);
    sb->ckpt_live_bytes = util_get_u64(p + 128);
    for (int i = 0; i < 3; i++)
        sb->ckpt_keys_by_state[i] = util_get_u64(p + 136 + 8 * i);
    sb->resume_batch = util_get_u64(p + 160);
    sb->open_durability = util_get_u32(p + 168);
    sb->ckpt_counts_lsn = util_get_u64(p + 176);
    sb->clean_lsn = util_get_u64(p + 184);
    sb->audit_len = util_get_u64(p + 192);
    sb->ckpt_flags = util_get_u32(p + 200);
    sb->log_durable_lsn = util_get_u64(p + 208);
    return 1;
}

void super_other_copy_failed(struct super *sb)
{
    sb->clean_lsn = 0;
    if (sb->token_reserved < (uint64_t)IDEM_TOKEN_MAX - SUPER_TOKEN_BLOCK)
        sb->token_reserved += SUPER_TOKEN_BLOCK;
    else
        sb->token_reserved = (uint64_t)IDEM_TOKEN_MAX;
}

int super_load(struct io *io, const char *dir, struct super *sb, int settle, char *err,
               size_t errcap)
{
    char path[4096];
    snprintf(path, sizeof path, "%s/super", dir);
    struct io_file *f;
    int rc = io_open(io, path, IO_O_RDONLY, &f);
    if (rc == -ENOENT) return IDEM_ENOTFOUND;
    if (rc < 0) {
        snprintf(err, errcap, "cannot open %s: %s", path, strerror(-rc));
        return IDEM_EIO;
    }
    if (settle) {
        rc = io_settle(io, f);
        if (rc < 0) {
            io_close(io, f);
            snprintf(err, errcap, "cannot flush %s at open: %s", path, strerror(-rc));
            return IDEM_EIO;
        }
    }
    uint8_t buf[2 * SUPER_BLOCK];
    memset(buf, 0, sizeof buf);
    int64_t n = io_read(io, f, 0, buf, sizeof buf);
    io_close(io, f);
    if (n < 0) {
        snprintf(err, errcap, "cannot read %s: %s", path, strerror((int)-n));
        return IDEM_EIO;
    }
    struct super a, b;
    int va = super_decode(buf, &a), vb = super_decode(buf + SUPER_BLOCK, &b);
    if (va == IDEM_EVERSION || vb == IDEM_EVERSION) {
        snprintf(err, errcap,
                 "%s: format version %u or features %#x unknown to this build (format %u)", path,
                 util_get_u32(buf + (va == IDEM_EVERSION ? 8 : SUPER_BLOCK + 8)),
                 util_get_u32(buf + (va == IDEM_EVERSION ? 12 : SUPER_BLOCK + 12)), SUPER_FORMAT);
        return IDEM_EVERSION;
    }
    if (!va && !vb) {
        snprintf(err, errcap, "%s: both superblock copies fail their checksum", path);
        return IDEM_ECORRUPT;
    }
    *sb = (va && (!vb || a.generation > b.generation)) ? a : b;
    /* A copy that fails its checksum may be a later one that cleared the clean mark (the open
     * after the clean close writes it first): the mark is trusted only when neither failed.
     * It may also be a later one that rotted after it was written, whose reservation of tokens
     * a block further on was used: tokens handed out under it in batches a crash then lost
     * (durability batch or none) start again past that block, not at this copy's reservation.
     * (A torn write of it reserved nothing that was handed out: one block is skipped.) */
    if (!va || !vb) super_other_copy_failed(sb);
    /* Fields that address the log are checked before anything trusts them. */
    if (!super_fields_valid(sb)) {
        snprintf(err, errcap,
                 "%s: superblock fields out of range (segment size %u, replay at %llu:%u, "
                 "lsn %llu, batch %llu, tokens %llu, clock %lld)",
                 path, sb->seg_bytes, (unsigned long long)sb->ckpt_seq, sb->ckpt_off,
                 (unsigned long long)sb->ckpt_lsn, (unsigned long long)sb->ckpt_batch,
                 (unsigned long long)sb->token_reserved, (long long)sb->store_clock_ms);
        return IDEM_ECORRUPT;
    }
    return 0;
}

int super_fields_valid(const struct super *sb)
{
    return !(
        sb->seg_bytes % 4096 || sb->seg_bytes < 64 * 1024 || sb->seg_bytes > 512u * 1024 * 1024 ||
        sb->ckpt_off % 4096 || sb->ckpt_off < 4096 || sb->ckpt_off >= sb->seg_bytes ||
        sb->wal_first_seq == 0 || sb->ckpt_seq < sb->wal_first_seq ||
        sb->wal_first_seq >= (UINT64_C(1) << 62) || sb->ckpt_seq >= (UINT64_C(1) << 62) ||
        sb->ckpt_seq - sb->wal_first_seq >= SUPER_SEGMENTS_MAX ||
        sb->ckpt_lsn >= (UINT64_C(1) << 62) || sb->ckpt_batch >= (UINT64_C(1) << 62) ||
        sb->resume_batch >= (UINT64_C(1) << 62) || sb->open_durability > 3 ||
        sb->ckpt_counts_lsn >= (UINT64_C(1) << 62) || sb->log_durable_lsn >= (UINT64_C(1) << 62) ||
        (sb->ckpt_flags & ~SUPER_CKPT_STEPPED) || sb->token_reserved > (uint64_t)IDEM_TOKEN_MAX ||
        sb->store_clock_ms < 0 || sb->store_clock_ms > IDEM_CLOCK_MS_MAX || sb->created_ms < 0 ||
        sb->created_ms > IDEM_CLOCK_MS_MAX);
}

int super_store(struct io *io, const char *dir, struct super *sb)
{
    char path[4096], tmp[4096];
    snprintf(path, sizeof path, "%s/super", dir);
    snprintf(tmp, sizeof tmp, "%s/super.tmp", dir);
    struct io_file *f;
    int created = 0;
    int rc = io_open(io, path, 0, &f);
    if (rc == -ENOENT) {
        rc = io_open(io, tmp, IO_O_CREATE, &f); /* a leftover of a cut creation is reused */
        if (rc == 0 && io_truncate(io, f, 0) < 0) {
            io_close(io, f);
            rc = -EIO;
        }
        created = 1;
    }
    if (rc < 0) return UTIL_OPEN_ERR(rc);
    uint8_t *blk = aligned_alloc(SUPER_BLOCK, 2 * SUPER_BLOCK);
    if (!blk) {
        io_close(io, f);
        return IDEM_ENOMEM;
    }
    sb->generation++;
    super_encode(sb, blk);
    if (created) {
        /* Both copies valid from the start. */
        memcpy(blk + SUPER_BLOCK, blk, SUPER_BLOCK);
        rc = io_write_sync(io, f, 0, blk, 2 * SUPER_BLOCK, 1);
    } else {
        rc = io_write_sync(io, f, (sb->generation % 2) * SUPER_BLOCK, blk, SUPER_BLOCK, 1);
    }
    free(blk);
    io_close(io, f);
    if (rc == 0 && created) rc = io_rename(io, tmp, path);
    if (rc == 0 && created) rc = io_sync_dir(io, dir);
    /* Only the creation may meet a full disk; a failed rewrite of the file is fatal. */
    if (rc < 0) return created && UTIL_NO_SPACE(rc) ? IDEM_EFULL : IDEM_EFATAL;
    return 0;
}

/* flock of an open lock file fd, shared or alone. Returns 0, or IDEM_ELOCKED with err naming
 * the owner its file names, or the readers that share it (fd is then closed). */
static int lock_take(int fd, const char *dir, int shared, char *err, size_t errcap)
{
    if (flock(fd, (shared ? LOCK_SH : LOCK_EX) | LOCK_NB) == 0) return 0;
    if (!shared && flock(fd, LOCK_SH | LOCK_NB) == 0) { /* readers hold it, no owner */
        snprintf(err, errcap,
                 "store %s is being read by another process (an inspection that opened it "
                 "read-only, such as idemctl status, export or verify): try again once it ends",
                 dir);
        close(fd);
        return IDEM_ELOCKED;
    }
    char owner[256] = "";
    ssize_t n = pread(fd, owner, sizeof owner - 1, 0);
    owner[n > 0 ? n : 0] = 0;
    owner[strcspn(owner, "\n")] = 0;
    snprintf(err, errcap, "store %s is in use by another process (%s)", dir,
             *owner ? owner : "owner unknown");
    close(fd);
    return IDEM_ELOCKED;
}

int lock_acquire(const char *dir, enum lock_mode mode, int *fd_out, char *err, size_t errcap)
{
    char path[4096];
    snprintf(path, sizeof path, "%s/LOCK", dir);
    *fd_out = -1;
    /* Readers share the lock (flock needs only a read-only descriptor), so inspections run
     * side by side and the file keeps naming the last owner; an owner holds it alone. */
    int fd;
    for (int tries = 0;; tries++) {
        fd = mode == LOCK_AS_OWNER    ? open(path, O_RDWR | O_CLOEXEC | O_CREAT, 0600)
             : mode == LOCK_AS_SHARER ? open(path, O_RDONLY | O_CLOEXEC | O_CREAT, 0600)
                                      : open(path, O_RDONLY | O_CLOEXEC);
        if (fd < 0 && mode == LOCK_AS_READER && errno == ENOENT) return 0;
        if (fd < 0) {
            snprintf(err, errcap, "cannot open %s: %s", path, strerror(errno));
            return IDEM_EIO;
        }
        int rc = lock_take(fd, dir, mode != LOCK_AS_OWNER, err, errcap);
        if (rc < 0) return rc;
        /* The file locked must still be the one named LOCK: a holder that removed it before
         * letting go (idemctl emptying a directory after a failed import) leaves a lock on a
         * file no later opener sees, which would then own the store beside this one. */
        struct stat held, named;
        int gone = stat(path, &named) != 0;
        if ((gone && errno != ENOENT) || fstat(fd, &held) != 0) {
            snprintf(err, errcap, "cannot look at %s: %s", path, strerror(errno));
            close(fd);
            return IDEM_EIO;
        }
        if (!gone && held.st_dev == named.st_dev && held.st_ino == named.st_ino) break;
        close(fd);
        if (tries == 8) {
            snprintf(err, errcap, "cannot lock %s: the file was replaced each time it was locked",
                     path);
            return IDEM_EIO;
        }
    }
    if (mode == LOCK_AS_OWNER) {
        char host[128] = "";
        gethostname(host, sizeof host - 1);
        char line[256];
        int len = snprintf(line, sizeof line, "pid=%d host=%s\n", (int)getpid(), host);
        /* Written over the last owner's line, then cut to length: on ext4 a write over the
         * file's block needs no new one, where a cut to 0 first would free it. */
        errno = EIO; /* a short write sets none */
        int wrote = pwrite(fd, line, (size_t)len, 0) == len;
        if (!wrote || ftruncate(fd, len) < 0) {
            int e = errno;
            if (!UTIL_NO_SPACE(-e)) {
                snprintf(err, errcap, "cannot write %s: %s", path, strerror(e));
                close(fd);
                return IDEM_EIO;
            }
            /* The lock is held; the line only names the owner to a second opener (who reads
             * up to the first newline: a tail left by a cut that failed is never read). On a
             * disk with no space left for the line (btrfs writes even a rewrite elsewhere) the
             * store still opens, with the file emptied if it can be, so that a second opener
             * names no owner rather than one gone. */
            if (!wrote) {
                int emptied = ftruncate(fd, 0) == 0;
                fprintf(stderr, "idem: event=lock_owner_unrecorded file=%s error=\"%s\"%s\n", path,
                        strerror(e), emptied ? "" : " stale_owner=1");
            }
        }
    }
    *fd_out = fd;
    return 0;
}

void lock_release(int fd)
{
    if (fd >= 0) close(fd);
}

/* ---- Checkpoints ---- */

struct ckpt_writer {
    struct io *io;
    struct io_file *f;
    char dir[4096];
    uint64_t id;
    uint8_t *buf; /* buf[0] is the file's byte at off */
    uint32_t used;
    uint32_t chunk_at; /* where in buf the open chunk's header is; CKPT_NO_CHUNK: none open */
    uint32_t chunk_entries;
    uint64_t off;
    uint64_t count, chunks;
    int err;
};
#define CKPT_NO_CHUNK UINT32_MAX

void ckpt_path(const char *dir, uint64_t id, char *buf, size_t cap)
{
    snprintf(buf, cap, "%s/index-%016llx.ckpt", dir, (unsigned long long)id);
}

/* Fills in the open chunk's header, if any: its body is complete. */
static void chunk_close(struct ckpt_writer *cw)
{
    if (cw->chunk_at == CKPT_NO_CHUNK) return;
    uint8_t *h = cw->buf + cw->chunk_at;
    uint32_t len = cw->used - cw->chunk_at - CKPT_ENTRY;
    memcpy(h, CKPT_CHUNK, 8);
    util_put_u32(h + 8, cw->chunk_entries);
    util_put_u32(h + 12, len);
    util_put_u64(h + 16, XXH3_64bits_withSeed(h + CKPT_ENTRY, len, cw->chunks));
    util_put_u64(h + 24, 0);
    cw->chunks++;
    cw->chunk_at = CKPT_NO_CHUNK;
    cw->chunk_entries = 0;
}

/* Closes the open chunk and writes the buffer out; a partial last block stays at the head of
 * the buffer and is written again by the next drain. */
static int ckpt_drain(struct ckpt_writer *cw)
{
    chunk_close(cw);
    if (cw->err || cw->used == 0) return cw->err;
    uint32_t len = (uint32_t)IDEM_ALIGN_UP(cw->used, 4096);
    memset(cw->buf + cw->used, 0, len - cw->used);
    int rc = io_write_sync(cw->io, cw->f, cw->off, cw->buf, len, 0);
    if (rc < 0) cw->err = UTIL_NO_SPACE(rc) ? IDEM_EFULL : IDEM_EIO;
    cw->off += cw->used;
    if (cw->used % 4096) {
        uint32_t keep = cw->used % 4096;
        memmove(cw->buf, cw->buf + cw->used - keep, keep);
        cw->off -= keep;
        cw->used = keep;
    } else {
        cw->used = 0;
    }
    return cw->err;
}

int ckpt_begin(struct io *io, const char *dir, uint64_t id, struct ckpt_writer **out)
{
    struct ckpt_writer *cw = calloc(1, sizeof *cw);
    if (!cw) return IDEM_ENOMEM;
    cw->buf = aligned_alloc(4096, CKPT_BUF + 4096);
    if (!cw->buf) {
        free(cw);
        return IDEM_ENOMEM;
    }
    cw->io = io;
    cw->id = id;
    cw->chunk_at = CKPT_NO_CHUNK;
    snprintf(cw->dir, sizeof cw->dir, "%s", dir);
    char path[4096];
    ckpt_path(dir, id, path, sizeof path);
    int rc = io_open(io, path, IO_O_CREATE, &cw->f);
    if (rc >= 0 && io_truncate(io, cw->f, 0) < 0) { /* an older file's bytes would follow */
        io_close(io, cw->f);
        rc = -EIO;
    }
    if (rc < 0) {
        free(cw->buf);
        free(cw);
        return UTIL_OPEN_ERR(rc);
    }
    memset(cw->buf, 0, 4096);
    memcpy(cw->buf, CKPT_MAGIC, 8);
    util_put_u32(cw->buf + 8, CKPT_FORMAT);
    util_put_u64(cw->buf + 16, id);
    util_put_u64(cw->buf + 4088, XXH3_64bits(cw->buf, 4088));
    cw->used = 4096;
    *out = cw;
    return 0;
}

/* Room kept for one more entry at its largest, with a chunk header before it. */
#define CKPT_ADD_MAX (CKPT_ENTRY + 2 * CKPT_SLOT)

int ckpt_add(struct ckpt_writer *cw, const struct ckpt_entry *e)
{
    uint32_t need = (e->has_seen & CKPT_SEEN ? 2 * CKPT_SLOT : CKPT_SLOT) +
                    (cw->chunk_at == CKPT_NO_CHUNK ? CKPT_ENTRY : 0);
    if (cw->used + need > CKPT_BUF && ckpt_drain(cw) < 0) return cw->err;
    if (cw->chunk_at == CKPT_NO_CHUNK) {
        cw->chunk_at = cw->used;
        cw->used += CKPT_ENTRY;
    }
    uint8_t *p = cw->buf + cw->used;
    util_put_u64(p, e->addr_tag);
    util_put_u32(p + 8, e->hash_lo);
    util_put_u32(p + 12, e->has_seen);
    cw->used += CKPT_SLOT;
    if (e->has_seen & CKPT_SEEN) {
        util_put_u64(p + 16, e->seen_count);
        util_put_u64(p + 24, (uint64_t)e->last_seen_ms);
        cw->used += CKPT_SLOT;
    }
    cw->chunk_entries++;
    cw->count++;
    return 0;
}

uint64_t ckpt_bytes_max(uint64_t entries)
{
    /* the header block, the entries, a chunk header for each buffer written out (the store
     * writes it out once less than a quarter is free: store.c, ckpt_run_step; a chunk of fewer
     * bytes than a quarter of the buffer comes only last), the trailer and its padding */
    uint64_t body = entries * 2 * CKPT_SLOT;
    return SUPER_BLOCK + body + (body / (CKPT_BUF / 4) + 1) * CKPT_ENTRY + CKPT_ENTRY + SUPER_BLOCK;
}

uint32_t ckpt_room(const struct ckpt_writer *cw)
{
    uint32_t free_bytes = CKPT_BUF - cw->used; /* a chunk header, then entries at their largest */
    return free_bytes < CKPT_ADD_MAX ? 0 : (free_bytes - CKPT_ENTRY) / (2 * CKPT_SLOT);
}

int ckpt_write_out(struct ckpt_writer *cw)
{
    return ckpt_drain(cw);
}

void ckpt_abort(struct ckpt_writer *cw)
{
    io_close(cw->io, cw->f);
    free(cw->buf);
    free(cw);
}

int ckpt_end(struct ckpt_writer *cw)
{
    if (cw->used + CKPT_ADD_MAX > CKPT_BUF) ckpt_drain(cw);
    chunk_close(cw);
    uint8_t *p = cw->buf + cw->used;
    memcpy(p, CKPT_END, 8);
    util_put_u64(p + 8, cw->count);
    util_put_u64(p + 16, cw->chunks);
    util_put_u64(p + 24, XXH3_64bits_withSeed(p, 24, cw->id));
    cw->used += CKPT_ENTRY;
    int rc = ckpt_drain(cw);
    /* The file is installed only once this returns 0. A flush refused for space (a file system
     * that allocates at writeback) is FULL, as a write is; so is the directory's sync (btrfs
     * may need metadata space for its commit), and out of descriptors or memory for it is
     * ENOMEM: nothing in the log's space failed, and a later checkpoint writes the file anew.
     * Any other failure is fatal. */
    int io_rc = rc == 0 ? io_flush_sync(cw->io, cw->f) : 0;
    if (io_rc < 0) rc = UTIL_NO_SPACE(io_rc) ? IDEM_EFULL : IDEM_EFATAL;
    if (rc == 0 && (io_rc = io_sync_dir(cw->io, cw->dir)) < 0) {
        rc = UTIL_OPEN_ERR(io_rc);
        if (rc == IDEM_EIO) rc = IDEM_EFATAL;
    }
    ckpt_abort(cw);
    return rc;
}

uint64_t ckpt_file_bytes(struct io *io, const char *dir, uint64_t id)
{
    char path[4096];
    struct io_file *f;
    uint64_t size = 0;
    ckpt_path(dir, id, path, sizeof path);
    if (io_open(io, path, IO_O_RDONLY, &f) < 0) return 0;
    if (io_size(io, f, &size) < 0) size = 0;
    io_close(io, f);
    return size;
}

/* ---- Reading ---- */

static int ckpt_bad(char *err, size_t errcap, const char *name, uint64_t off, const char *what)
{
    snprintf(err, errcap, "%s offset %llu: %s", name, (unsigned long long)off, what);
    return IDEM_ECORRUPT;
}

int ckpt_parse_open(const uint8_t *m, uint64_t size, uint64_t id, const char *name,
                    struct ckpt_file *cf, char *err, size_t errcap)
{
    memset(cf, 0, sizeof *cf);
    if (size < 4096 + CKPT_ENTRY) return ckpt_bad(err, errcap, name, 0, "too short");
    if (memcmp(m, CKPT_MAGIC, 8) || util_get_u64(m + 4088) != XXH3_64bits(m, 4088) ||
        util_get_u64(m + 16) != id)
        return ckpt_bad(err, errcap, name, 0, "bad header (magic, checksum or checkpoint id)");
    uint32_t format = util_get_u32(m + 8);
    if ((format != 1 && format != CKPT_FORMAT) || util_get_u32(m + 12) != 0) {
        snprintf(err, errcap, "%s: checkpoint format %u unknown to this build (formats 1 and %u)",
                 name, format, CKPT_FORMAT);
        return IDEM_EVERSION;
    }
    /* The trailer is the last record written; the file may end in zero padding. */
    uint32_t step = format == 1 ? CKPT_ENTRY : CKPT_SLOT;
    uint64_t n = (size - 4096 - CKPT_ENTRY) / step + 1; /* places a trailer could start at */
    while (n > 0 && memcmp(m + 4096 + (n - 1) * step, CKPT_END, 8))
        n--;
    if (n == 0) return ckpt_bad(err, errcap, name, size, "no trailer");
    const uint8_t *t = m + 4096 + (n - 1) * step;
    cf->m = m;
    cf->size = size;
    cf->format = format;
    cf->end = (uint64_t)(t - m);
    cf->count = util_get_u64(t + 8);
    for (uint64_t i = cf->end + CKPT_ENTRY; i < size; i++)
        if (m[i]) return ckpt_bad(err, errcap, name, i, "bytes after the trailer are not zero");
    if (format == 1) {
        if (cf->count != n - 1 || util_get_u64(t + 24) != 0)
            return ckpt_bad(err, errcap, name, cf->end, "the trailer's count is not the file's");
        if (util_get_u64(t + 16) != XXH3_64bits(m + 4096, cf->count * CKPT_ENTRY))
            return ckpt_bad(err, errcap, name, 4096, "the entries fail their checksum");
        cf->chunks = cf->count > 0;
        return 0;
    }
    cf->chunks = util_get_u64(t + 16);
    if (util_get_u64(t + 24) != XXH3_64bits_withSeed(t, 24, id))
        return ckpt_bad(err, errcap, name, cf->end, "the trailer fails its checksum");
    /* Bounded by the length before anything is sized by them: a chunk takes at least 48 bytes
     * (header and one entry), an entry at least 16. */
    uint64_t room = cf->end - 4096;
    if (cf->chunks > room / (CKPT_ENTRY + CKPT_SLOT) || cf->count > room / CKPT_SLOT ||
        cf->chunks > cf->count || (cf->count > 0 && cf->chunks == 0))
        return ckpt_bad(err, errcap, name, cf->end,
                        "the trailer's counts do not fit the file's length");
    return 0;
}

int ckpt_parse_chunk(const struct ckpt_file *cf, struct ckpt_cursor *cur, struct ckpt_chunk *ch,
                     const char *name, char *err, size_t errcap)
{
    if (cur->pos == cf->end) {
        if (cur->k != cf->chunks || cur->entries != cf->count)
            return ckpt_bad(err, errcap, name, cf->end,
                            "the trailer's counts are not those of the chunks before it");
        return 0;
    }
    if (cf->format == 1) {
        /* One run of 32-byte entries, its checksum checked by ckpt_parse_open. */
        *ch = (struct ckpt_chunk){cf->m + 4096, cf->count * CKPT_ENTRY, cf->count};
        cur->pos = cf->end;
        cur->k = 1;
        cur->entries = cf->count;
        return 1;
    }
    char what[160];
    const uint8_t *h = cf->m + cur->pos;
    if (cur->k >= cf->chunks || cf->end - cur->pos < CKPT_ENTRY + CKPT_SLOT ||
        memcmp(h, CKPT_CHUNK, 8) || util_get_u64(h + 24) != 0) {
        snprintf(what, sizeof what, "chunk %llu: no chunk header", (unsigned long long)cur->k);
        return ckpt_bad(err, errcap, name, cur->pos, what);
    }
    uint32_t n = util_get_u32(h + 8), len = util_get_u32(h + 12);
    const uint8_t *body = h + CKPT_ENTRY;
    if (n == 0 || len > cf->end - cur->pos - CKPT_ENTRY ||
        util_get_u64(h + 16) != XXH3_64bits_withSeed(body, len, cur->k)) {
        snprintf(what, sizeof what, "chunk %llu fails its checksum", (unsigned long long)cur->k);
        return ckpt_bad(err, errcap, name, cur->pos, what);
    }
    /* Every entry whole, with known flags, and nothing after the last. */
    uint64_t off = 0;
    uint32_t i = 0;
    /* Four plain entries at a time while they last (most entries are plain). */
    for (; i + 4 <= n && off + 4 * CKPT_SLOT <= len; i += 4, off += 4 * CKPT_SLOT)
        if (util_get_u32(body + off + 12) | util_get_u32(body + off + 28) |
            util_get_u32(body + off + 44) | util_get_u32(body + off + 60))
            break;
    for (; i < n; i++) {
        uint32_t flags = off + CKPT_SLOT <= len ? util_get_u32(body + off + 12) : UINT32_MAX;
        if (flags & ~(CKPT_SEEN | CKPT_UNFINISHED)) {
            off = UINT64_MAX;
            break;
        }
        off += flags & CKPT_SEEN ? 2 * CKPT_SLOT : CKPT_SLOT;
    }
    if (off != len || cf->count - cur->entries < n) {
        snprintf(what, sizeof what, "chunk %llu: its %u entries do not fill its %u bytes",
                 (unsigned long long)cur->k, n, len);
        return ckpt_bad(err, errcap, name, cur->pos, what);
    }
    *ch = (struct ckpt_chunk){body, len, n};
    cur->pos += CKPT_ENTRY + len;
    cur->k++;
    cur->entries += n;
    return 1;
}

uint32_t ckpt_decode(const struct ckpt_file *cf, const uint8_t *p, struct ckpt_entry *e)
{
    e->addr_tag = util_get_u64(p);
    e->hash_lo = util_get_u32(p + 8);
    e->has_seen = util_get_u32(p + 12);
    e->seen_count = 0;
    e->last_seen_ms = 0;
    if (cf->format == 1 || (e->has_seen & CKPT_SEEN)) {
        e->seen_count = util_get_u64(p + 16);
        e->last_seen_ms = (int64_t)util_get_u64(p + 24);
        return CKPT_ENTRY;
    }
    return CKPT_SLOT;
}

/* Passes a checked chunk's entries on: runs of plain 16-byte entries (format 2, no flags) to
 * plain, every other entry decoded to fn. */
static int chunk_apply(const struct ckpt_file *cf, const struct ckpt_chunk *ch,
                       int (*fn)(void *ctx, const struct ckpt_entry *e),
                       int (*plain)(void *ctx, const uint8_t *run, uint64_t n), void *ctx)
{
    const uint8_t *p = ch->body, *end = ch->body + ch->len;
    while (p < end) {
        const uint8_t *run = p;
        if (cf->format != 1)
            while (p < end && util_get_u32(p + 12) == 0)
                p += CKPT_SLOT;
        int rc = p > run ? plain(ctx, run, (uint64_t)(p - run) / CKPT_SLOT) : 0;
        if (rc == 0 && p < end) {
            struct ckpt_entry e;
            p += ckpt_decode(cf, p, &e);
            rc = fn(ctx, &e);
        }
        if (rc < 0) return rc;
    }
    return 0;
}

/* A thread that faults in the checkpoint's map front to back while the loader makes the index:
 * in a new process the kernel must zero the index's memory first (212 MB at 10 M keys), and the
 * disk reads of the file go on meanwhile instead of after. It only reads; the loader faults
 * whatever it gets to first. */
struct ckpt_reader {
    pthread_t thread;
    const uint8_t *m;
    uint64_t from, to;
    int stop; /* atomic */
    int started;
};

static void *ckpt_reader_main(void *arg)
{
    struct ckpt_reader *r = arg;
    uint64_t page = (uint64_t)sysconf(_SC_PAGESIZE), sum = 0;
    for (uint64_t off = r->from; off < r->to; off += page) {
        if ((off & ((1u << 20) - 1)) == 0 && __atomic_load_n(&r->stop, __ATOMIC_RELAXED)) break;
        sum += *(const volatile uint8_t *)(r->m + off);
    }
    return (void *)(uintptr_t)sum;
}

static void ckpt_reader_start(struct ckpt_reader *r, const uint8_t *m, uint64_t from, uint64_t to)
{
    *r = (struct ckpt_reader){.m = m, .from = from, .to = to};
    r->started = pthread_create(&r->thread, NULL, ckpt_reader_main, r) == 0;
}

static void ckpt_reader_stop(struct ckpt_reader *r)
{
    if (!r->started) return;
    __atomic_store_n(&r->stop, 1, __ATOMIC_RELAXED);
    pthread_join(r->thread, NULL);
    r->started = 0;
}

int ckpt_load(struct io *io, const char *dir, uint64_t id, int (*sized)(void *ctx, uint64_t count),
              int (*fn)(void *ctx, const struct ckpt_entry *e),
              int (*plain)(void *ctx, const uint8_t *run, uint64_t n), void *ctx, char *err,
              size_t errcap)
{
    char path[4096], name[4200];
    ckpt_path(dir, id, path, sizeof path);
    snprintf(name, sizeof name, "checkpoint %s", path);
    struct io_file *f;
    int rc = io_open(io, path, IO_O_RDONLY, &f);
    if (rc < 0) {
        snprintf(err, errcap, "%s: %s", name, strerror(-rc));
        return IDEM_ECORRUPT;
    }
    uint64_t size = 0;
    const uint8_t *m = NULL;
    rc = io_size(io, f, &size);
    if (rc == 0 && size >= 4096 + CKPT_ENTRY) rc = io_map(io, f, size, (const void **)&m);
    if (rc < 0 || !m) {
        io_close(io, f);
        snprintf(err, errcap, "%s: too short or unreadable", name);
        return IDEM_ECORRUPT;
    }
    /* Read front to back once, by faults; the kernel reads ahead of them. (Asking for the whole
     * file at once, POSIX_MADV_WILLNEED with POSIX_MADV_SEQUENTIAL, made a cold open slower
     * here: 520 ms against 390, medians of 8.) A second thread faults the file in while the
     * index is made (ckpt_reader). */
    struct ckpt_file cf;
    struct ckpt_reader rd = {0};
    rc = ckpt_parse_open(m, size, id, name, &cf, err, errcap);
    if (rc == 0) ckpt_reader_start(&rd, m, 4096, cf.end);
    /* Only a checked count sizes anything (fuzz_checkpoint: a damaged trailer once asked for
     * gigabytes before its checksum was looked at). */
    if (rc == 0 && sized) rc = sized(ctx, cf.count);
    struct ckpt_cursor cur = {.pos = 4096};
    struct ckpt_chunk ch;
    while (rc == 0 && (rc = ckpt_parse_chunk(&cf, &cur, &ch, name, err, errcap)) == 1)
        rc = chunk_apply(&cf, &ch, fn, plain, ctx);
    ckpt_reader_stop(&rd);
    io_unmap(io, f, m, size);
    io_close(io, f);
    return rc;
}
