/*
 * super.c: superblock copies, the directory lock, and checkpoint files (formats in super.h).
 *
 * Checkpoint file: a 4 KiB header block ("IDEMCKPT", u32 format, u32 0, u64 id, then at 4088 an
 * XXH3-64 of [0, 4088)), then 32-byte entries (u64 addr_tag, u32 hash_lo, u32 has_seen,
 * u64 seen_count, i64 last_seen_ms), then a 32-byte trailer ("IDEMCEND", u64 entry count,
 * u64 XXH3-64 of all entry bytes, u64 0). The file is complete only with a valid trailer.
 */
#include "super.h"

#include <sys/mman.h>

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <unistd.h>
#include <xxhash.h>

#include "idem.h"
#include "util.h"

#define SUPER_MAGIC "IDEMSUPR"
#define SUPER_BLOCK 4096u
#define SUPER_CKSUM 4088u
#define CKPT_MAGIC  "IDEMCKPT"
#define CKPT_END    "IDEMCEND"
#define CKPT_ENTRY  32u
#define CKPT_BUF    (1u << 20)

static void super_encode(const struct super *sb, uint8_t *p)
{
    memset(p, 0, SUPER_BLOCK);
    memcpy(p, SUPER_MAGIC, 8);
    util_put_u32(p + 8, SUPER_FORMAT);
    util_put_u32(p + 12, 0);
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
    util_put_u64(p + SUPER_CKSUM, XXH3_64bits(p, SUPER_CKSUM));
}

int super_decode(const uint8_t *p, struct super *sb)
{
    if (memcmp(p, SUPER_MAGIC, 8) || util_get_u64(p + SUPER_CKSUM) != XXH3_64bits(p, SUPER_CKSUM))
        return 0;
    if (util_get_u32(p + 8) != SUPER_FORMAT || util_get_u32(p + 12) != 0) return IDEM_EVERSION;
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
    return 1;
}

int super_load(struct io *io, const char *dir, struct super *sb, char *err, size_t errcap)
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
    /* Fields that address the log are checked before anything trusts them. */
    if (sb->seg_bytes % 4096 || sb->seg_bytes < 64 * 1024 || sb->seg_bytes > 512u * 1024 * 1024 ||
        sb->ckpt_off % 4096 || sb->ckpt_off < 4096 || sb->ckpt_off >= sb->seg_bytes ||
        sb->wal_first_seq == 0 || sb->ckpt_seq < sb->wal_first_seq ||
        sb->wal_first_seq >= (UINT64_C(1) << 62) || sb->ckpt_seq >= (UINT64_C(1) << 62) ||
        sb->ckpt_seq - sb->wal_first_seq >= SUPER_SEGMENTS_MAX ||
        sb->ckpt_lsn >= (UINT64_C(1) << 62) || sb->ckpt_batch >= (UINT64_C(1) << 62) ||
        sb->resume_batch >= (UINT64_C(1) << 62) || sb->open_durability > 3 ||
        sb->ckpt_counts_lsn >= (UINT64_C(1) << 62) ||
        sb->token_reserved > (uint64_t)IDEM_TOKEN_MAX || sb->store_clock_ms < 0 ||
        sb->store_clock_ms >= (INT64_C(1) << 50) || sb->created_ms < 0 ||
        sb->created_ms >= (INT64_C(1) << 50)) {
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
    if (rc < 0) return rc == -ENOSPC ? IDEM_EFULL : IDEM_EIO;
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
    if (rc < 0) return created && (rc == -ENOSPC || rc == -EDQUOT) ? IDEM_EFULL : IDEM_EFATAL;
    return 0;
}

int lock_acquire(const char *dir, char *err, size_t errcap)
{
    char path[4096];
    snprintf(path, sizeof path, "%s/LOCK", dir);
    int fd = open(path, O_RDWR | O_CREAT | O_CLOEXEC, 0600);
    if (fd < 0) {
        snprintf(err, errcap, "cannot open %s: %s", path, strerror(errno));
        return IDEM_EIO;
    }
    if (flock(fd, LOCK_EX | LOCK_NB) < 0) {
        char owner[256] = "";
        ssize_t n = pread(fd, owner, sizeof owner - 1, 0);
        owner[n > 0 ? n : 0] = 0;
        owner[strcspn(owner, "\n")] = 0;
        snprintf(err, errcap, "store %s is in use by another process (%s)", dir,
                 *owner ? owner : "owner unknown");
        close(fd);
        return IDEM_ELOCKED;
    }
    char host[128] = "";
    gethostname(host, sizeof host - 1);
    char line[256];
    int len = snprintf(line, sizeof line, "pid=%d host=%s\n", (int)getpid(), host);
    if (ftruncate(fd, 0) < 0 || pwrite(fd, line, (size_t)len, 0) != len) {
        snprintf(err, errcap, "cannot write %s: %s", path, strerror(errno));
        close(fd);
        return IDEM_EIO;
    }
    return fd;
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
    uint8_t *buf;
    uint32_t used;
    uint64_t off;
    uint64_t count;
    XXH3_state_t *hash;
    int err;
};

void ckpt_path(const char *dir, uint64_t id, char *buf, size_t cap)
{
    snprintf(buf, cap, "%s/index-%016llx.ckpt", dir, (unsigned long long)id);
}

static int ckpt_drain(struct ckpt_writer *cw)
{
    if (cw->err || cw->used == 0) return cw->err;
    uint32_t len = (uint32_t)IDEM_ALIGN_UP(cw->used, 4096);
    memset(cw->buf + cw->used, 0, len - cw->used);
    int rc = io_write_sync(cw->io, cw->f, cw->off, cw->buf, len, 0);
    if (rc < 0) cw->err = rc == -ENOSPC ? IDEM_EFULL : IDEM_EIO;
    cw->off += cw->used; /* a short last piece is rewritten by the next drain */
    if (cw->used % 4096) {
        /* Keep the partial block's bytes at the head of the buffer. */
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
    cw->hash = XXH3_createState();
    if (!cw->buf || !cw->hash) {
        free(cw->buf);
        XXH3_freeState(cw->hash);
        free(cw);
        return IDEM_ENOMEM;
    }
    XXH3_64bits_reset(cw->hash);
    cw->io = io;
    snprintf(cw->dir, sizeof cw->dir, "%s", dir);
    char path[4096];
    ckpt_path(dir, id, path, sizeof path);
    int rc = io_open(io, path, IO_O_CREATE, &cw->f);
    if (rc < 0) {
        free(cw->buf);
        XXH3_freeState(cw->hash);
        free(cw);
        return rc == -ENOSPC ? IDEM_EFULL : IDEM_EIO;
    }
    io_truncate(io, cw->f, 0);
    memset(cw->buf, 0, 4096);
    memcpy(cw->buf, CKPT_MAGIC, 8);
    util_put_u32(cw->buf + 8, SUPER_FORMAT);
    util_put_u64(cw->buf + 16, id);
    util_put_u64(cw->buf + 4088, XXH3_64bits(cw->buf, 4088));
    cw->used = 4096;
    *out = cw;
    return 0;
}

int ckpt_add(struct ckpt_writer *cw, const struct ckpt_entry *e)
{
    if (cw->used + CKPT_ENTRY > CKPT_BUF && ckpt_drain(cw) < 0) return cw->err;
    uint8_t *p = cw->buf + cw->used;
    util_put_u64(p, e->addr_tag);
    util_put_u32(p + 8, e->hash_lo);
    util_put_u32(p + 12, e->has_seen);
    util_put_u64(p + 16, e->seen_count);
    util_put_u64(p + 24, (uint64_t)e->last_seen_ms);
    XXH3_64bits_update(cw->hash, p, CKPT_ENTRY);
    cw->used += CKPT_ENTRY;
    cw->count++;
    return 0;
}

uint32_t ckpt_room(const struct ckpt_writer *cw)
{
    return (CKPT_BUF - cw->used) / CKPT_ENTRY;
}

int ckpt_write_out(struct ckpt_writer *cw)
{
    return ckpt_drain(cw);
}

void ckpt_abort(struct ckpt_writer *cw)
{
    io_close(cw->io, cw->f);
    free(cw->buf);
    XXH3_freeState(cw->hash);
    free(cw);
}

int ckpt_end(struct ckpt_writer *cw)
{
    if (cw->used + CKPT_ENTRY > CKPT_BUF) ckpt_drain(cw);
    uint8_t *p = cw->buf + cw->used;
    memcpy(p, CKPT_END, 8);
    util_put_u64(p + 8, cw->count);
    util_put_u64(p + 16, XXH3_64bits_digest(cw->hash));
    util_put_u64(p + 24, 0);
    cw->used += CKPT_ENTRY;
    int rc = ckpt_drain(cw);
    if (rc == 0 && io_flush_sync(cw->io, cw->f) < 0) rc = IDEM_EFATAL;
    if (rc == 0 && io_sync_dir(cw->io, cw->dir) < 0) rc = IDEM_EFATAL;
    ckpt_abort(cw);
    return rc;
}

#define CKPT_AHEAD 16 /* entries between ahead() and fn() of the same entry */

int ckpt_load(struct io *io, const char *dir, uint64_t id, void (*sized)(void *ctx, uint64_t count),
              int (*fn)(void *ctx, const struct ckpt_entry *e),
              void (*ahead)(void *ctx, uint64_t addr_tag, uint32_t hash_lo), void *ctx, char *err,
              size_t errcap)
{
    char path[4096];
    ckpt_path(dir, id, path, sizeof path);
    struct io_file *f;
    int rc = io_open(io, path, IO_O_RDONLY, &f);
    if (rc < 0) {
        snprintf(err, errcap, "checkpoint %s: %s", path, strerror(-rc));
        return IDEM_ECORRUPT;
    }
    uint64_t size = 0;
    const uint8_t *m = NULL;
    rc = io_size(io, f, &size);
    if (rc == 0 && size >= 4096 + CKPT_ENTRY) rc = io_map(io, f, size, (const void **)&m);
    /* Read front to back once: ask for large reads ahead instead of a fault per window. */
    if (rc == 0 && m) {
        posix_madvise((void *)m, size, POSIX_MADV_SEQUENTIAL);
        posix_madvise((void *)m, size, POSIX_MADV_WILLNEED);
    }
    if (rc < 0 || !m) {
        io_close(io, f);
        snprintf(err, errcap, "checkpoint %s: too short or unreadable", path);
        return IDEM_ECORRUPT;
    }
    rc = 0;
    if (memcmp(m, CKPT_MAGIC, 8) || util_get_u64(m + 4088) != XXH3_64bits(m, 4088) ||
        util_get_u64(m + 16) != id) {
        snprintf(err, errcap, "checkpoint %s: bad header", path);
        rc = IDEM_ECORRUPT;
    }
    uint64_t n = (size - 4096) / CKPT_ENTRY;
    /* The trailer is the last 32-byte record written; the file may end in zero padding. */
    uint64_t count = 0;
    while (rc == 0 && n > 0 && memcmp(m + 4096 + (n - 1) * CKPT_ENTRY, CKPT_END, 8))
        n--;
    if (rc == 0 && n == 0) {
        snprintf(err, errcap, "checkpoint %s: no trailer", path);
        rc = IDEM_ECORRUPT;
    }
    if (rc == 0) {
        const uint8_t *t = m + 4096 + (n - 1) * CKPT_ENTRY;
        count = util_get_u64(t + 8);
        if (count != n - 1 || util_get_u64(t + 16) != XXH3_64bits(m + 4096, count * CKPT_ENTRY)) {
            snprintf(err, errcap, "checkpoint %s: entries fail their checksum", path);
            rc = IDEM_ECORRUPT;
        }
    }
    /* Only a checked count sizes anything (fuzz_checkpoint: a damaged trailer once asked for
     * gigabytes before its checksum was looked at). */
    if (rc == 0 && sized) sized(ctx, count);
    for (uint64_t i = 0; rc == 0 && i < count; i++) {
        if (ahead && i + CKPT_AHEAD < count) {
            const uint8_t *a = m + 4096 + (i + CKPT_AHEAD) * CKPT_ENTRY;
            ahead(ctx, util_get_u64(a), util_get_u32(a + 8));
        }
        const uint8_t *p = m + 4096 + i * CKPT_ENTRY;
        struct ckpt_entry e = {.addr_tag = util_get_u64(p),
                               .hash_lo = util_get_u32(p + 8),
                               .has_seen = util_get_u32(p + 12),
                               .seen_count = util_get_u64(p + 16),
                               .last_seen_ms = (int64_t)util_get_u64(p + 24)};
        rc = fn(ctx, &e);
    }
    io_unmap(io, f, m, size);
    io_close(io, f);
    return rc;
}
