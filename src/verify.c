/*
 * verify.c: idem_verify, the offline, read-only check of a whole store directory.
 *
 * Every file is opened O_RDONLY and mapped read-only; the lock file is flocked through a
 * read-only descriptor (never created or written), so the store stays byte-identical. What is
 * checked, against the formats in super.h, wal.h, record.h and audit.c:
 *   super       both 4 KiB copies: magic, checksum, format, features, the alternation of copies,
 *               and that they describe the same store;
 *   wal-*.log   from the superblock's first segment on: each header, then every frame the log
 *               holds, in order, with its checksum, LSN and batch chaining, zeroed block tails,
 *               type, and every RECORD frame decoded (lengths, state, flags, lz4 result, token
 *               below the superblock's reservation). The log may end in a torn batch only after
 *               the checkpoint's replay position (never acknowledged); before it, a bad frame is
 *               damage. Past the end, a valid frame of a later batch is corruption (as recovery
 *               judges it), and a file shorter than a segment that a SEGEND names is damage;
 *   index-*.ckpt the current checkpoint: header, entries and trailer checksums, zero padding,
 *               and every entry naming a durable RECORD frame of a key with its hash;
 *   audit.log   every unit (an entry block, or a group of entries): checksums, lengths, zero
 *               padding, sequence;
 *   the index   rebuilt from the checkpoint and the frames after its position, as recovery does:
 *               each entry names a decodable record of its key, no key twice, and the
 *               superblock's key counts match the checkpoint.
 * The first fault is described in the report; all are counted.
 */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <lz4.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>
#include <xxhash.h>

#include "idem.h"
#include "record.h"
#include "store.h"
#include "super.h"
#include "util.h"
#include "wal.h"

/* Format details private to super.c, wal.c and audit.c (documented in their file heads). */
#define V_SUPER_BLOCK    4096u
#define V_WAL_FORMAT     1u
#define V_WAL_OFF_BITS   26u
#define V_CKPT_ENTRY_MIN 16u /* a checkpoint entry at its smallest (format 2) */
#define V_AUDIT_BLOCK    4096u
#define V_PROGRESS_STEP  (4u << 20)

struct vfile {
    int fd;
    const uint8_t *map;
    uint64_t size;
    size_t map_len; /* size, or a segment's size for a short segment's zero-filled copy */
};

struct vseg {
    uint64_t seq;
    struct vfile f;
    uint64_t salt;
    int ok; /* header valid */
    /* The file is shorter than a segment (f.map a copy of a segment's size), its header whole
     * otherwise: salt is the header's, for the scan past the end alone (walk_beyond). */
    int short_whole;
};

struct vpos {
    uint64_t seq;
    uint32_t off;
};

/* A RECORD or DELETE frame of a complete batch, in log order. */
struct vframe {
    uint64_t addr;
    uint32_t type;
    int after_ckpt;
};

/* Index rebuilt by the check: full key hash -> address (UINT64_MAX: removed). */
struct ventry {
    uint64_t h;
    uint64_t addr;
};

struct vctx {
    const char *dir;
    idem_verify_report *r;
    void (*progress)(void *ctx, uint64_t done, uint64_t total);
    void *pctx;
    uint64_t done, total, next_report;
    uint64_t seg_total; /* bytes of segments the progress counts */
    uint64_t ckpt_bytes;
    uint64_t older_ckpt_id; /* the checkpoint the older superblock copy names, kept for it */
    struct super sb;
    struct vseg *segs; /* sb.wal_first_seq + i */
    size_t nsegs;
    struct vframe *frames;
    size_t nframes, frames_cap, frames_done; /* frames_done: of complete batches */
    uint64_t *fset; /* addresses of durable RECORD frames (open addressing, 0: empty) */
    size_t fset_cap;
    struct ventry *ix;
    size_t ix_cap, ix_used;
    uint64_t ckpt_states[3];
    uint64_t log_last_lsn; /* the last LSN of the log's last complete batch (verify_log) */
    uint64_t damaged_seq;  /* the first segment past the replay one with a damaged header */
    uint64_t salt_named;   /* damaged_seq, once a SEGEND named its salt (read on: damaged_read) */
    uint64_t salt_named_batch; /* the batch of that SEGEND */
};

static void fault(struct vctx *v, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

static void fault(struct vctx *v, const char *fmt, ...)
{
    if (v->r->errors++ == 0) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(v->r->first_error, sizeof v->r->first_error, fmt, ap);
        va_end(ap);
    }
}

static void advance(struct vctx *v, uint64_t bytes)
{
    v->done += bytes;
    if (v->progress && (v->done >= v->next_report || v->done >= v->total)) {
        v->progress(v->pctx, v->done > v->total ? v->total : v->done, v->total);
        v->next_report = v->done + V_PROGRESS_STEP;
    }
}

/* Maps path read-only. 0, IDEM_ENOTFOUND (absent), or IDEM_EIO. An empty file maps to NULL. */
static int vfile_open(const char *path, struct vfile *f)
{
    memset(f, 0, sizeof *f);
    f->fd = open(path, O_RDONLY | O_CLOEXEC);
    if (f->fd < 0) return errno == ENOENT ? IDEM_ENOTFOUND : IDEM_EIO;
    struct stat st;
    if (fstat(f->fd, &st) < 0) {
        close(f->fd);
        return IDEM_EIO;
    }
    f->size = (uint64_t)st.st_size;
    if (f->size) {
        void *m = mmap(NULL, f->size, PROT_READ, MAP_PRIVATE, f->fd, 0);
        if (m == MAP_FAILED) {
            close(f->fd);
            return IDEM_EIO;
        }
        f->map = m;
        f->map_len = f->size;
    }
    return 0;
}

/* Makes f's map a zero-filled copy of `bytes` (> f->size), so reads up to `bytes` stay inside it
 * (a map of a file faults past its end). Returns 0 or IDEM_ENOMEM. */
static int vfile_widen(struct vfile *f, size_t bytes)
{
    uint8_t *m = util_map_grow(NULL, 0, bytes);
    if (!m) return IDEM_ENOMEM;
    if (f->map) {
        memcpy(m, f->map, f->size);
        munmap((void *)f->map, f->map_len);
    }
    f->map = m;
    f->map_len = bytes;
    return 0;
}

static void vfile_close(struct vfile *f)
{
    if (f->map && f->map_len > f->size)
        util_map_free((void *)f->map, f->map_len);
    else if (f->map)
        munmap((void *)f->map, f->map_len);
    if (f->fd >= 0) close(f->fd);
    memset(f, 0, sizeof *f);
    f->fd = -1;
}

static int all_zero(const uint8_t *p, size_t n)
{
    for (size_t i = 0; i < n; i++)
        if (p[i]) return 0;
    return 1;
}

/* ---- Superblock ---- */

/* 1: valid (sb filled); 0: fails its checksum or magic; -1: valid but unknown format. */
static int super_copy_decode(const uint8_t *p, struct super *sb)
{
    int rc = super_decode(p, sb);
    return rc == IDEM_EVERSION ? -1 : rc;
}

static int super_fields_ok(struct vctx *v, const struct super *sb)
{
    if (sb->seg_bytes % WAL_BLOCK || sb->seg_bytes < WAL_SEG_BYTES_MIN ||
        sb->seg_bytes > WAL_SEG_BYTES_MAX) {
        fault(v, "super: segment size %u is not valid", sb->seg_bytes);
        return 0;
    }
    if (sb->ckpt_flags & ~SUPER_CKPT_STEPPED) {
        fault(v, "super: checkpoint flags %#x hold an unknown bit", sb->ckpt_flags);
        return 0;
    }
    if (sb->wal_first_seq == 0 || sb->ckpt_seq < sb->wal_first_seq || sb->ckpt_off < WAL_BLOCK ||
        sb->ckpt_off % WAL_BLOCK || sb->ckpt_off >= sb->seg_bytes) {
        fault(v, "super: log start %llu or checkpoint position %llu:%u is not valid",
              (unsigned long long)sb->wal_first_seq, (unsigned long long)sb->ckpt_seq,
              sb->ckpt_off);
        return 0;
    }
    if (!super_fields_valid(sb)) { /* what the open refuses, as it does */
        fault(v,
              "super: fields out of range (log start %llu, replay at %llu, lsn %llu, batch %llu, "
              "counts lsn %llu, tokens %llu, clock %lld, created %lld, durability %u)",
              (unsigned long long)sb->wal_first_seq, (unsigned long long)sb->ckpt_seq,
              (unsigned long long)sb->ckpt_lsn, (unsigned long long)sb->ckpt_batch,
              (unsigned long long)sb->ckpt_counts_lsn, (unsigned long long)sb->token_reserved,
              (long long)sb->store_clock_ms, (long long)sb->created_ms, sb->open_durability);
        return 0;
    }
    return 1;
}

/* Checks both copies; fills v->sb from the newest valid one. IDEM_ECORRUPT when none is. */
static int verify_super(struct vctx *v)
{
    char path[4096];
    snprintf(path, sizeof path, "%s/super", v->dir);
    struct vfile f;
    int rc = vfile_open(path, &f);
    if (rc == IDEM_ENOTFOUND) {
        store_set_error("%s holds no store (no superblock file)", v->dir);
        return IDEM_ENOTFOUND;
    }
    if (rc < 0) {
        store_set_error("cannot read %s: %s", path, strerror(errno));
        return rc;
    }
    struct super c[2];
    int ok[2] = {0, 0};
    for (int i = 0; i < 2; i++) {
        if (f.size < (uint64_t)(i + 1) * V_SUPER_BLOCK) {
            fault(v, "super: file is %llu bytes, copy %d is missing", (unsigned long long)f.size,
                  i);
            continue;
        }
        ok[i] = super_copy_decode(f.map + i * V_SUPER_BLOCK, &c[i]);
        if (ok[i] == 0)
            fault(v, "super: copy %d (offset %u) fails its checksum", i, i * V_SUPER_BLOCK);
        else if (ok[i] < 0)
            fault(v, "super: copy %d has an unknown format version or features", i);
        else if (c[i].generation % 2 != (uint64_t)i && c[i].generation != 1)
            fault(v, "super: copy %d holds generation %llu, written to the wrong copy", i,
                  (unsigned long long)c[i].generation);
    }
    if (f.size > 2 * V_SUPER_BLOCK)
        fault(v, "super: %llu unexpected bytes after the two copies",
              (unsigned long long)(f.size - 2 * V_SUPER_BLOCK));
    vfile_close(&f);
    if (ok[0] == 1 && ok[1] == 1 &&
        (memcmp(c[0].store_id, c[1].store_id, 16) || c[0].hash_seed != c[1].hash_seed))
        fault(v, "super: the two copies describe different stores");
    if (ok[0] != 1 && ok[1] != 1) {
        store_set_error("%s: no valid superblock copy", path);
        return IDEM_ECORRUPT;
    }
    int pick = ok[0] == 1 && (ok[1] != 1 || c[0].generation > c[1].generation) ? 0 : 1;
    v->sb = c[pick];
    if (ok[!pick] == 1 && c[!pick].ckpt_id != v->sb.ckpt_id) v->older_ckpt_id = c[!pick].ckpt_id;
    /* As the open takes it: records may hold tokens the failed copy reserved. */
    if (ok[!pick] != 1) super_other_copy_failed(&v->sb);
    return super_fields_ok(v, &v->sb) ? 0 : IDEM_ECORRUPT;
}

/* ---- Segments ---- */

static void seg_name(char *buf, size_t cap, uint64_t seq)
{
    snprintf(buf, cap, "wal-%016llx.log", (unsigned long long)seq);
}

/* Does s's first block hold a whole header of its segment? */
static int seg_header_whole(const struct vctx *v, const struct vseg *s)
{
    const uint8_t *h = s->f.map;
    return s->f.size >= WAL_BLOCK && !memcmp(h, "IDEMWAL1", 8) &&
           util_get_u64(h + 4088) == XXH3_64bits(h, 4088) && util_get_u32(h + 8) == V_WAL_FORMAT &&
           util_get_u32(h + 12) == v->sb.seg_bytes && util_get_u64(h + 16) == s->seq;
}

/* Does s have a whole header and size (seg_header_check finds nothing)? */
static int seg_header_sound(const struct vctx *v, const struct vseg *s)
{
    return s->f.size >= v->sb.seg_bytes && seg_header_whole(v, s);
}

static void seg_header_check(struct vctx *v, struct vseg *s)
{
    char name[64];
    seg_name(name, sizeof name, s->seq);
    const uint8_t *h = s->f.map;
    if (s->f.size < v->sb.seg_bytes) {
        fault(v, "%s: %llu bytes, shorter than the segment size %u", name,
              (unsigned long long)s->f.size, v->sb.seg_bytes);
        return;
    }
    if (memcmp(h, "IDEMWAL1", 8) || util_get_u64(h + 4088) != XXH3_64bits(h, 4088)) {
        fault(v, "%s: segment header (offset 0) fails its checksum", name);
        return;
    }
    if (util_get_u32(h + 8) != V_WAL_FORMAT || util_get_u32(h + 12) != v->sb.seg_bytes ||
        util_get_u64(h + 16) != s->seq) {
        fault(v, "%s: header names format %u, size %u, sequence %llu", name, util_get_u32(h + 8),
              util_get_u32(h + 12), (unsigned long long)util_get_u64(h + 16));
        return;
    }
    s->salt = util_get_u64(h + 24);
    s->ok = 1;
}

/* Opens the segments from the first one on, as long as they exist. One absent before the replay
 * segment was retired after this superblock copy was written: the log starts after it, as the
 * open has it (wal_open_segments). */
static int verify_open_segments(struct vctx *v)
{
    size_t cap = 0;
    for (uint64_t seq = v->sb.wal_first_seq; v->nsegs < WAL_SEG_SLOTS; seq++) {
        char path[4096], name[64];
        seg_name(name, sizeof name, seq);
        snprintf(path, sizeof path, "%s/%s", v->dir, name);
        struct vfile f;
        int rc = vfile_open(path, &f);
        if (rc == IDEM_ENOTFOUND && seq < v->sb.ckpt_seq) {
            while (v->nsegs)
                vfile_close(&v->segs[--v->nsegs].f);
            v->seg_total = 0;
            v->sb.wal_first_seq = seq + 1;
            continue;
        }
        if (rc == IDEM_ENOTFOUND) break;
        if (rc < 0) {
            store_set_error("cannot read %s: %s", path, strerror(errno));
            return rc;
        }
        if (v->nsegs == cap) {
            cap = cap ? 2 * cap : 16;
            struct vseg *n = realloc(v->segs, cap * sizeof *n);
            if (!n) {
                vfile_close(&f);
                return IDEM_ENOMEM;
            }
            v->segs = n;
        }
        if (f.size < v->sb.seg_bytes && vfile_widen(&f, v->sb.seg_bytes) < 0) {
            vfile_close(&f);
            return IDEM_ENOMEM;
        }
        struct vseg *s = &v->segs[v->nsegs++];
        memset(s, 0, sizeof *s);
        s->seq = seq;
        s->f = f;
        v->seg_total += f.size < v->sb.seg_bytes ? f.size : v->sb.seg_bytes;
    }
    return 0;
}

static struct vseg *seg_get(struct vctx *v, uint64_t seq)
{
    if (seq < v->sb.wal_first_seq || seq - v->sb.wal_first_seq >= v->nsegs) return NULL;
    struct vseg *s = &v->segs[seq - v->sb.wal_first_seq];
    return s->ok ? s : NULL;
}

static uint64_t addr_of(uint64_t seq, uint32_t off)
{
    return ((seq % WAL_SEG_SLOTS) << V_WAL_OFF_BITS) | (off >> 3);
}

/* The frame at a log address, if it lies in an open segment. */
static const uint8_t *frame_at(struct vctx *v, uint64_t addr, uint32_t *len)
{
    uint64_t slot = addr >> V_WAL_OFF_BITS;
    uint32_t off = (uint32_t)(addr & ((1u << V_WAL_OFF_BITS) - 1)) << 3;
    uint64_t first = v->sb.wal_first_seq;
    uint64_t seq = first + (slot + WAL_SEG_SLOTS - first % WAL_SEG_SLOTS) % WAL_SEG_SLOTS;
    struct vseg *s = seg_get(v, seq);
    if (!s || slot >= WAL_SEG_SLOTS || off < WAL_BLOCK || off + WAL_FRAME_HDR > v->sb.seg_bytes)
        return NULL;
    *len = util_get_u32(s->f.map + off + 24);
    if (*len < WAL_FRAME_HDR || *len > v->sb.seg_bytes - off) return NULL;
    return s->f.map + off;
}

static uint32_t frame_valid(const struct vctx *v, const struct vseg *s, uint32_t off)
{
    if (off + WAL_FRAME_HDR > v->sb.seg_bytes) return 0;
    const uint8_t *f = s->f.map + off;
    uint32_t len = util_get_u32(f + 24);
    if (len < WAL_FRAME_HDR || len % 8 || len > v->sb.seg_bytes - off) return 0;
    if (util_get_u64(f) != XXH3_64bits_withSeed(f + 8, len - 8, s->salt)) return 0;
    if (util_get_u64(f + 8) >= WAL_NUMBER_LIMIT || util_get_u64(f + 16) >= WAL_NUMBER_LIMIT)
        return 0; /* as the log's own reader */
    return len;
}

/* ---- Records ---- */

static int record_result_ok(const struct rec *r)
{
    if (!(r->flags & REC_F_LZ4)) return r->result_raw_len == r->result_len;
    if (r->result_raw_len > IDEM_RESULT_BYTES_LIMIT || r->result_len == 0) return 0;
    char *buf = malloc(r->result_raw_len ? r->result_raw_len : 1);
    if (!buf) return 1; /* cannot tell; not a fault of the store */
    int n = LZ4_decompress_safe((const char *)r->result, buf, (int)r->result_len,
                                (int)r->result_raw_len);
    free(buf);
    return n >= 0 && (uint32_t)n == r->result_raw_len;
}

/* Why a RECORD payload is not a sound record, or NULL. */
static const char *record_problem(const struct vctx *v, const uint8_t *p, uint32_t len,
                                  struct rec *r)
{
    if (rec_decode(p, len, r) < 0) return "does not decode (lengths or state out of range)";
    if (r->key_len > IDEM_KEY_BYTES_MAX || r->owner_len > IDEM_OWNER_BYTES_MAX ||
        r->note_len > IDEM_NOTE_BYTES_MAX || r->result_len > IDEM_RESULT_BYTES_LIMIT)
        return "has a field longer than its limit";
    if (r->flags & ~(REC_F_FP | REC_F_MFP | REC_F_LZ4)) return "has unknown flag bits";
    if (!record_result_ok(r)) return "has a result that does not decompress to its length";
    if (r->expires_at_ms < r->first_seen_ms) return "expires before it was first seen";
    if (r->state == IDEM_STATE_IN_FLIGHT && (r->token <= 0 || r->token > IDEM_TOKEN_MAX))
        return "is in_flight without a valid token";
    if (r->token > 0 && (uint64_t)r->token >= v->sb.token_reserved)
        return "holds a token at or above the superblock's reservation (it could repeat)";
    return NULL;
}

static const char *frame_content_problem(const struct vctx *v, uint32_t type, const uint8_t *f,
                                         uint32_t len)
{
    const uint8_t *p = f + WAL_FRAME_HDR;
    uint32_t plen = len - WAL_FRAME_HDR;
    struct rec r;
    if (util_get_u16(f + 30) != 0) return "has unknown frame flags";
    switch (type) {
    case WAL_T_RECORD:
        return record_problem(v, p, plen, &r);
    case WAL_T_DELETE: {
        uint32_t klen = plen >= 8 ? util_get_u16(p) : 0;
        if (klen == 0 || klen > IDEM_KEY_BYTES_MAX || 8 + klen > plen)
            return "is a DELETE whose key does not fit";
        return NULL;
    }
    case WAL_T_END:
        return plen >= 8 ? NULL : "is an END frame without its clock";
    case WAL_T_SEGEND:
        return plen == 0 || plen == WAL_SEGEND_PAYLOAD ? NULL
                                                       : "is a SEGEND frame of unknown length";
    case WAL_T_PAD:
        return NULL;
    default:
        return "has an unknown type";
    }
}

/* ---- The log walk ---- */

struct walk {
    struct vpos p, batch_start;
    uint64_t cur_lsn, last_lsn, last_batch, batch_no;
    int started, in_batch, ckpt_reached;
    int pad_bad; /* nonzero bytes in a block tail of the batch being read */
    struct vpos pad_pos;
};

static int vpos_cmp(struct vpos a, struct vpos b)
{
    if (a.seq != b.seq) return a.seq < b.seq ? -1 : 1;
    return a.off < b.off ? -1 : a.off > b.off;
}

static int frames_push(struct vctx *v, uint64_t addr, uint32_t type, int after_ckpt)
{
    if (v->nframes == v->frames_cap) {
        size_t cap = v->frames_cap ? 2 * v->frames_cap : 1024;
        struct vframe *n = realloc(v->frames, cap * sizeof *n);
        if (!n) return IDEM_ENOMEM;
        v->frames = n;
        v->frames_cap = cap;
    }
    v->frames[v->nframes++] = (struct vframe){addr, type, after_ckpt};
    return 0;
}

/* Zero bytes [from, to) of a segment, else remembered as a fault of the current batch. */
static void pad_check(struct walk *w, const struct vseg *s, uint32_t from, uint32_t to)
{
    if (to > from && !w->pad_bad && !all_zero(s->f.map + from, to - from)) {
        w->pad_bad = 1;
        w->pad_pos = (struct vpos){s->seq, from};
    }
}

/* Moves w->p past the frame of type/len at w->p, checking the block tail it skips. */
static void walk_step(struct vctx *v, struct walk *w, const struct vseg *s, uint32_t type,
                      uint32_t len)
{
    uint32_t next = w->p.off + len;
    uint32_t tail = (uint32_t)IDEM_ALIGN_UP(next, WAL_BLOCK);
    if (tail > v->sb.seg_bytes) tail = v->sb.seg_bytes;
    if (type == WAL_T_SEGEND) {
        pad_check(w, s, next, tail);
        /* As recovery (wal_recover): a SEGEND names a file that exists. */
        char name[64], path[4200];
        seg_name(name, sizeof name, w->p.seq + 1);
        snprintf(path, sizeof path, "%s/%s", v->dir, name);
        if (access(path, F_OK) != 0)
            fault(v, "%s is missing, but the SEGEND of segment %llu (offset %u) names it", name,
                  (unsigned long long)w->p.seq, w->p.off);
        w->p = (struct vpos){w->p.seq + 1, WAL_BLOCK};
        return;
    }
    if (type == WAL_T_END || (next % WAL_BLOCK && WAL_BLOCK - next % WAL_BLOCK < WAL_FRAME_HDR)) {
        pad_check(w, s, next, tail);
        next = tail;
    }
    w->p.off = next;
}

static const char walk_stale[] = "a stale frame (LSN or batch not above the log's)";

/* Whether the frames from p form a complete batch: valid frames of one batch with consecutive
 * LSNs, through its END. */
static int batch_completes_at(struct vctx *v, struct vpos p)
{
    uint64_t prev = 0, batch = 0;
    for (int n = 0;; n++) {
        const struct vseg *s = seg_get(v, p.seq);
        if (!s || p.off + WAL_FRAME_HDR > v->sb.seg_bytes) return 0;
        uint32_t len = frame_valid(v, s, p.off);
        if (!len) return 0;
        const uint8_t *f = s->f.map + p.off;
        uint64_t lsn = util_get_u64(f + 8), b = util_get_u64(f + 16);
        uint32_t type = util_get_u16(f + 28);
        if (n && (lsn != prev + 1 || b != batch)) return 0;
        prev = lsn;
        batch = b;
        if (type == WAL_T_END) return 1;
        if (type == WAL_T_SEGEND) {
            p = (struct vpos){p.seq + 1, WAL_BLOCK};
            continue;
        }
        uint32_t next = p.off + len;
        if (next % WAL_BLOCK && WAL_BLOCK - next % WAL_BLOCK < WAL_FRAME_HDR)
            next = (uint32_t)IDEM_ALIGN_UP(next, WAL_BLOCK);
        p.off = next;
    }
}

/* Why the frame at w->p does not continue the log (NULL: it does); *len is its length. */
static const char *walk_frame_ok(struct vctx *v, struct walk *w, uint32_t *len)
{
    const struct vseg *s = seg_get(v, w->p.seq);
    if (!s) return "its segment is missing or has a damaged header";
    if (w->p.off + WAL_FRAME_HDR > v->sb.seg_bytes) return "the segment ends without a SEGEND";
    *len = frame_valid(v, s, w->p.off);
    if (!*len)
        return all_zero(s->f.map + w->p.off, WAL_FRAME_HDR) ? "no frame was written there"
                                                            : "the frame fails its checksum";
    const uint8_t *f = s->f.map + w->p.off;
    uint64_t lsn = util_get_u64(f + 8), batch = util_get_u64(f + 16);
    if (!w->started) {
        w->started = 1;
        w->cur_lsn = w->last_lsn = lsn - 1;
        w->last_batch = batch - 1;
    }
    if (lsn <= w->cur_lsn || batch <= w->last_batch) return walk_stale;
    if (w->in_batch && (lsn != w->cur_lsn + 1 || batch != w->batch_no))
        return "a gap in the LSNs of a batch";
    return NULL;
}

/* As recovery (wal.c, damaged_install): a SEGEND that names the salt of the next segment, whose
 * header is damaged, lets the walk read on there; a batch completed there is a fault. */
static void damaged_read(struct vctx *v, uint64_t seq, const uint8_t *segend, uint32_t len,
                         uint64_t batch)
{
    if (seq != v->damaged_seq || v->salt_named || seq - v->sb.wal_first_seq >= v->nsegs) return;
    struct vseg *s = &v->segs[seq - v->sb.wal_first_seq];
    if (s->ok) return;
    if (s->f.size < v->sb.seg_bytes) {
        /* As recovery: the log rolls only into a segment made whole, and none is ever cut. */
        fault(v,
              "wal-%016llx.log: %llu bytes, shorter than the segment size %u, but the SEGEND of "
              "segment %llu names it: the file was cut after the log reached it",
              (unsigned long long)seq, (unsigned long long)s->f.size, v->sb.seg_bytes,
              (unsigned long long)seq - 1);
        return;
    }
    if (len < WAL_FRAME_HDR + WAL_SEGEND_PAYLOAD) return;
    s->salt = util_get_u64(segend + WAL_FRAME_HDR);
    s->ok = 1;
    v->salt_named = seq;
    v->salt_named_batch = batch;
}

/* Takes in the valid frame at w->p. */
static int walk_take(struct vctx *v, struct walk *w, uint32_t len, struct vpos ckpt)
{
    const struct vseg *s = seg_get(v, w->p.seq);
    const uint8_t *f = s->f.map + w->p.off;
    uint32_t type = util_get_u16(f + 28);
    char name[64];
    seg_name(name, sizeof name, s->seq);
    if (!w->in_batch) {
        w->in_batch = 1;
        w->batch_no = util_get_u64(f + 16);
        w->pad_bad = 0;
    }
    w->cur_lsn = util_get_u64(f + 8);
    v->r->frames++;
    const char *why = frame_content_problem(v, type, f, len);
    if (why)
        fault(v, "%s offset %u: frame (LSN %llu) %s", name, w->p.off,
              (unsigned long long)w->cur_lsn, why);
    if (type == WAL_T_PAD && (w->p.off + len) % WAL_BLOCK)
        fault(v, "%s offset %u: PAD frame does not end a block", name, w->p.off);
    if (type == WAL_T_RECORD || type == WAL_T_DELETE) {
        int rc = frames_push(v, addr_of(s->seq, w->p.off), type, vpos_cmp(w->p, ckpt) >= 0);
        if (rc < 0) return rc;
    }
    if (type == WAL_T_SEGEND) damaged_read(v, s->seq + 1, f, len, w->batch_no);
    if (type == WAL_T_END && v->salt_named && s->seq >= v->salt_named)
        fault(v,
              "wal-%016llx.log: the header is damaged, but its frames, read with the salt the "
              "SEGEND before it names, complete batch %llu (offset %u): the header was whole "
              "when they were written",
              (unsigned long long)v->salt_named, (unsigned long long)w->batch_no, w->p.off);
    struct vpos before = w->p;
    walk_step(v, w, s, type, len);
    advance(v, w->p.seq == before.seq ? w->p.off - before.off : v->sb.seg_bytes - before.off);
    if (type == WAL_T_END) {
        if (w->pad_bad)
            fault(v, "wal-%016llx.log offset %u: nonzero bytes where a block must be zero",
                  (unsigned long long)w->pad_pos.seq, w->pad_pos.off);
        w->last_lsn = w->cur_lsn;
        w->last_batch = w->batch_no;
        w->in_batch = 0;
        w->batch_start = w->p;
        v->frames_done = v->nframes;
    }
    return 0;
}

/* As recovery does (wal_beyond_is_corrupt): a valid frame past the end of the log from a later
 * batch than the one that may have been in flight is corruption. */
static void walk_beyond(struct vctx *v, const struct walk *w)
{
    uint64_t end = v->sb.wal_first_seq + v->nsegs; /* past the last segment file */
    for (uint64_t seq = w->batch_start.seq; seq < end; seq++) {
        const struct vseg *s = seg_get(v, seq);
        if (!s && (!v->damaged_seq || seq < v->damaged_seq)) break;
        if (!s && v->segs[seq - v->sb.wal_first_seq].short_whole)
            s = &v->segs[seq - v->sb.wal_first_seq]; /* read with its own header's salt */
        if (!s) continue; /* a damaged header: the segments after it are read all the same */
        /* From where the log stops (a frame of a later batch may lie there itself), as
         * recovery reads it. */
        uint32_t off = seq == w->batch_start.seq ? w->batch_start.off : WAL_BLOCK;
        for (; off + WAL_FRAME_HDR <= v->sb.seg_bytes; off += WAL_BLOCK) {
            if (!frame_valid(v, s, off)) continue;
            uint64_t batch = util_get_u64(s->f.map + off + 16);
            struct wal_resume resume = {.first_batch = v->sb.resume_batch,
                                        .sync = wal_ordered_batches(v->sb.open_durability)};
            /* As recovery (scan_beyond): frames under a salt a SEGEND named are judged only
             * when the open that wrote the tail wrote that SEGEND; opens since may have
             * numbered their batches below them. */
            int judged = seq != v->salt_named || wal_named_judged(v->salt_named_batch, &resume);
            if (judged && wal_beyond_is_corrupt(batch, w->last_batch, &resume)) {
                char name[64];
                seg_name(name, sizeof name, seq);
                fault(v,
                      "%s offset %u: a valid frame of batch %llu lies after the end of the log "
                      "(segment %llu offset %u, last complete batch %llu)%s",
                      name, off, (unsigned long long)batch, (unsigned long long)w->batch_start.seq,
                      w->batch_start.off, (unsigned long long)w->last_batch,
                      v->damaged_seq && seq > v->damaged_seq
                          ? ", behind a segment whose header is damaged"
                      : seq == v->salt_named ? ", in a segment whose header is damaged"
                                             : "");
                return;
            }
        }
    }
}

static void walk_checkpoint_mark(struct vctx *v, struct walk *w, struct vpos ckpt)
{
    if (w->in_batch || w->ckpt_reached || vpos_cmp(w->p, ckpt) != 0) return;
    w->ckpt_reached = 1;
    /* The batch number and the LSN may have skipped a torn batch's since (never reused: a
     * checkpoint with nothing appended after a torn tail records the LSNs its frames took). */
    if (w->started && (w->last_lsn > v->sb.ckpt_lsn || w->last_batch > v->sb.ckpt_batch))
        fault(v,
              "super: the checkpoint position follows LSN %llu of batch %llu, the log has LSN "
              "%llu of batch %llu there",
              (unsigned long long)v->sb.ckpt_lsn, (unsigned long long)v->sb.ckpt_batch,
              (unsigned long long)w->last_lsn, (unsigned long long)w->last_batch);
    /* As recovery, which reads on from here above the checkpoint's LSN and batch. */
    if (!w->started || w->last_lsn < v->sb.ckpt_lsn) w->cur_lsn = w->last_lsn = v->sb.ckpt_lsn;
    if (!w->started || w->last_batch < v->sb.ckpt_batch) w->last_batch = v->sb.ckpt_batch;
    w->started = 1;
}

static int verify_log(struct vctx *v)
{
    /* As recovery (wal_open_segments): the log is read from the checkpoint's replay segment,
     * which must exist (a store that never wrote a checkpoint has its first one there). */
    if (v->sb.ckpt_seq < v->sb.wal_first_seq || v->sb.ckpt_seq - v->sb.wal_first_seq >= v->nsegs)
        fault(v, "wal-%016llx.log is missing: the checkpoint's replay position is in it",
              (unsigned long long)v->sb.ckpt_seq);
    for (size_t i = 0; i < v->nsegs; i++) {
        /* As recovery (wal_open_segments): past the replay segment, a damaged header may be a
         * creation cut short by a crash; the segments after it are read for later batches
         * (walk_beyond). After a clean close, see below. */
        if (v->segs[i].seq > v->sb.ckpt_seq && !seg_header_sound(v, &v->segs[i])) {
            if (!v->damaged_seq) v->damaged_seq = v->segs[i].seq;
            if (v->segs[i].seq == v->damaged_seq && seg_header_whole(v, &v->segs[i])) {
                /* Short: read past the end of the log with its header's salt, as recovery does. */
                v->segs[i].salt = util_get_u64(v->segs[i].f.map + 24);
                v->segs[i].short_whole = 1;
            }
            continue;
        }
        seg_header_check(v, &v->segs[i]);
    }
    struct vpos ckpt = {v->sb.ckpt_seq, v->sb.ckpt_off};
    struct walk w = {.p = {v->sb.wal_first_seq, WAL_BLOCK}};
    w.batch_start = w.p;
    uint64_t done0 = v->done;
    const char *stop = NULL;
    for (;;) {
        walk_checkpoint_mark(v, &w, ckpt);
        uint32_t len = 0;
        stop = walk_frame_ok(v, &w, &len);
        if (stop) break;
        int rc = walk_take(v, &w, len, ckpt);
        if (rc < 0) return rc;
    }
    v->nframes = v->frames_done; /* a batch without END was never acknowledged */
    if (vpos_cmp(w.batch_start, ckpt) < 0)
        fault(v,
              "wal-%016llx.log offset %u: %s, but the log must reach the checkpoint's replay "
              "position (segment %llu offset %u)",
              (unsigned long long)w.p.seq, w.p.off, stop, (unsigned long long)ckpt.seq, ckpt.off);
    else if (!w.ckpt_reached)
        fault(v, "super: the checkpoint position (segment %llu offset %u) is not a batch boundary",
              (unsigned long long)ckpt.seq, ckpt.off);
    /* The checkpoint's LSN may lie above the log's at its position only past a torn batch,
     * which never completes: a complete batch there that recovery, reading on above that LSN,
     * would drop means a checkpoint that overstates where the log is. */
    if (stop == walk_stale && vpos_cmp(w.batch_start, ckpt) == 0 && vpos_cmp(w.p, ckpt) == 0 &&
        batch_completes_at(v, ckpt))
        fault(v,
              "wal-%016llx.log offset %u: a complete batch at the checkpoint's position has "
              "LSNs at or below the checkpoint's (%llu): recovery would drop it",
              (unsigned long long)ckpt.seq, ckpt.off, (unsigned long long)v->sb.ckpt_lsn);
    /* As recovery: after a clean close that the log's end matches, nothing past it is read. */
    int clean = v->sb.clean_lsn && w.last_lsn == v->sb.clean_lsn && w.cur_lsn == w.last_lsn;
    if (!clean) walk_beyond(v, &w);
    /* A run that closed cleanly made its spare whole (re-created over any a crash cut short):
     * damage there is rot. One further on may be left from a crash before that run. */
    if (v->damaged_seq && v->sb.clean_lsn && v->damaged_seq <= w.batch_start.seq + 1)
        seg_header_check(v, &v->segs[v->damaged_seq - v->sb.wal_first_seq]);
    v->log_last_lsn = w.started && w.last_lsn > v->sb.ckpt_lsn ? w.last_lsn : v->sb.ckpt_lsn;
    if (v->log_last_lsn < v->sb.ckpt_counts_lsn) /* as the open (store.c) */
        fault(v,
              "the log ends at LSN %llu (segment %llu offset %u), before LSN %llu, which "
              "checkpoint %llu found durable when it was installed",
              (unsigned long long)v->log_last_lsn, (unsigned long long)w.batch_start.seq,
              w.batch_start.off, (unsigned long long)v->sb.ckpt_counts_lsn,
              (unsigned long long)v->sb.ckpt_id);
    else if (v->log_last_lsn < v->sb.log_durable_lsn) /* as the open (store.c) */
        fault(v,
              "the log ends at LSN %llu (segment %llu offset %u), before LSN %llu, which the "
              "superblock recorded durable",
              (unsigned long long)v->log_last_lsn, (unsigned long long)w.batch_start.seq,
              w.batch_start.off, (unsigned long long)v->sb.log_durable_lsn);
    uint64_t walked = v->done - done0;
    if (walked < v->seg_total) advance(v, v->seg_total - walked);
    return 0;
}

/* ---- Durable record frames, and the index rebuilt from checkpoint and log ---- */

static size_t pow2_at_least(size_t n)
{
    size_t c = 16;
    while (c < n)
        c *= 2;
    return c;
}

static int fset_build(struct vctx *v)
{
    v->fset_cap = pow2_at_least(2 * v->nframes + 1);
    v->fset = calloc(v->fset_cap, sizeof *v->fset);
    if (!v->fset) return IDEM_ENOMEM;
    for (size_t i = 0; i < v->nframes; i++) {
        if (v->frames[i].type != WAL_T_RECORD) continue;
        v->r->records++;
        size_t k = XXH3_64bits(&v->frames[i].addr, 8) & (v->fset_cap - 1);
        while (v->fset[k] && v->fset[k] != v->frames[i].addr)
            k = (k + 1) & (v->fset_cap - 1);
        v->fset[k] = v->frames[i].addr;
    }
    return 0;
}

static int fset_has(const struct vctx *v, uint64_t addr)
{
    if (!addr) return 0;
    size_t k = XXH3_64bits(&addr, 8) & (v->fset_cap - 1);
    for (; v->fset[k]; k = (k + 1) & (v->fset_cap - 1))
        if (v->fset[k] == addr) return 1;
    return 0;
}

/* Key of the RECORD frame at addr (checked durable and decodable before it is indexed). */
static const uint8_t *key_at(struct vctx *v, uint64_t addr, uint32_t *klen)
{
    uint32_t len;
    const uint8_t *f = frame_at(v, addr, &len);
    if (!f || len < WAL_FRAME_HDR) return NULL;
    return rec_key(f + WAL_FRAME_HDR, len - WAL_FRAME_HDR, klen);
}

static struct ventry *ix_find(struct vctx *v, uint64_t h, const uint8_t *key, uint32_t klen,
                              struct ventry **free_out)
{
    *free_out = NULL;
    for (size_t k = h & (v->ix_cap - 1);; k = (k + 1) & (v->ix_cap - 1)) {
        struct ventry *e = &v->ix[k];
        if (e->addr == 0) {
            if (!*free_out) *free_out = e;
            return NULL;
        }
        if (e->addr == UINT64_MAX) {
            if (!*free_out) *free_out = e;
            continue;
        }
        uint32_t elen;
        const uint8_t *ekey = e->h == h ? key_at(v, e->addr, &elen) : NULL;
        if (ekey && elen == klen && memcmp(ekey, key, klen) == 0) return e;
    }
}

/* Points key at addr; returns 1 if the key was there already. */
static int ix_put(struct vctx *v, uint64_t h, const uint8_t *key, uint32_t klen, uint64_t addr)
{
    struct ventry *slot, *e = ix_find(v, h, key, klen, &slot);
    if (e) {
        e->addr = addr;
        return 1;
    }
    *slot = (struct ventry){h, addr};
    v->ix_used++;
    return 0;
}

static int ix_has(struct vctx *v, uint64_t h, const uint8_t *key, uint32_t klen)
{
    struct ventry *slot;
    return ix_find(v, h, key, klen, &slot) != NULL;
}

static void ix_del(struct vctx *v, uint64_t h, const uint8_t *key, uint32_t klen)
{
    struct ventry *slot, *e = ix_find(v, h, key, klen, &slot);
    if (e) {
        e->addr = UINT64_MAX;
        v->ix_used--;
    }
}

static uint64_t key_hash(const struct vctx *v, const void *key, uint32_t klen)
{
    return XXH3_64bits_withSeed(key, klen, v->sb.hash_seed);
}

/* ---- Checkpoint ---- */

static void ckpt_entry_check(struct vctx *v, const char *name, uint64_t i,
                             const struct ckpt_entry *e)
{
    uint64_t tag = e->addr_tag, addr = tag & INDEX_ADDR_MASK;
    uint32_t hash_lo = e->hash_lo, bits = e->has_seen;
    uint32_t len;
    const uint8_t *f = fset_has(v, addr) ? frame_at(v, addr, &len) : NULL;
    struct rec r;
    if (!f || rec_decode(f + WAL_FRAME_HDR, len - WAL_FRAME_HDR, &r) < 0) {
        fault(v, "%s: entry %llu names log address %#llx, which holds no durable record", name,
              (unsigned long long)i, (unsigned long long)addr);
        return;
    }
    uint64_t h = key_hash(v, r.key, r.key_len);
    if ((h & ~INDEX_ADDR_MASK) != (tag & ~INDEX_ADDR_MASK) || (uint32_t)h != hash_lo)
        fault(v, "%s: entry %llu: its hash is not the hash of the record's key", name,
              (unsigned long long)i);
    /* CKPT_UNFINISHED marks the records kept apart for attention: unfinished or mismatched. */
    int apart = r.state != IDEM_STATE_COMMITTED || r.mismatch_count > 0;
    if ((bits & ~(CKPT_SEEN | CKPT_UNFINISHED)) || !(bits & CKPT_UNFINISHED) != !apart)
        fault(v, "%s: entry %llu: flags %#x do not match the record (%s, %llu mismatches)", name,
              (unsigned long long)i, bits, idem_state_name(r.state),
              (unsigned long long)r.mismatch_count);
    v->ckpt_states[r.state - 1]++;
    /* A checkpoint taken in steps (super_ckpt_stepped) may list a key twice: recovery keeps
     * the first entry and replays from the checkpoint's position. */
    int stepped = super_ckpt_stepped(&v->sb);
    if (stepped && ix_has(v, h, r.key, r.key_len)) return;
    if (ix_put(v, h, r.key, r.key_len, addr))
        fault(v, "%s: entry %llu: the key is in the checkpoint twice", name, (unsigned long long)i);
    v->r->checkpoint_entries++;
}

/* Header, trailer and every chunk's checksum (super.c's parser, which recovery uses), then,
 * with entries, every entry against the log. Returns the entries, or -1 after a fault. */
static int64_t ckpt_entries_check(struct vctx *v, const char *name, const struct vfile *f,
                                  uint64_t id, int entries)
{
    if (f->size % 4096) {
        fault(v, "%s: %llu bytes is not a whole checkpoint", name, (unsigned long long)f->size);
        return -1;
    }
    char err[512];
    struct ckpt_file cf;
    if (ckpt_parse_open(f->map, f->size, id, name, &cf, err, sizeof err) < 0) {
        fault(v, "%s", err);
        return -1;
    }
    struct ckpt_cursor cur = {.pos = 4096};
    struct ckpt_chunk ch;
    uint64_t i = 0;
    int rc;
    while ((rc = ckpt_parse_chunk(&cf, &cur, &ch, name, err, sizeof err)) == 1) {
        for (const uint8_t *p = ch.body; p < ch.body + ch.len; i++) {
            struct ckpt_entry e;
            p += ckpt_decode(&cf, p, &e);
            if (entries) ckpt_entry_check(v, name, i, &e);
        }
    }
    if (rc < 0) {
        fault(v, "%s", err);
        return -1;
    }
    return (int64_t)i;
}

static int verify_checkpoint(struct vctx *v)
{
    if (!v->sb.ckpt_id) return 0;
    char path[4096], name[64];
    snprintf(name, sizeof name, "index-%016llx.ckpt", (unsigned long long)v->sb.ckpt_id);
    snprintf(path, sizeof path, "%s/%s", v->dir, name);
    struct vfile f;
    int rc = vfile_open(path, &f);
    if (rc == IDEM_ENOTFOUND) {
        fault(v, "%s: missing (the superblock names checkpoint %llu)", name,
              (unsigned long long)v->sb.ckpt_id);
        return 0;
    }
    if (rc < 0) {
        store_set_error("cannot read %s: %s", path, strerror(errno));
        return rc;
    }
    int64_t count = ckpt_entries_check(v, name, &f, v->sb.ckpt_id, 1);
    /* Counts match the entries only for a checkpoint taken with changes held; one taken in
     * steps holds the counts at its end (ckpt_counts_lsn), over a mixed image. */
    int stepped = super_ckpt_stepped(&v->sb);
    for (int i = 0; count >= 0 && !stepped && i < 3; i++) {
        if (v->ckpt_states[i] != v->sb.ckpt_keys_by_state[i])
            fault(v, "super: %llu %s keys at the checkpoint, %s holds %llu",
                  (unsigned long long)v->sb.ckpt_keys_by_state[i], idem_state_name(i + 1), name,
                  (unsigned long long)v->ckpt_states[i]);
    }
    advance(v, f.size);
    vfile_close(&f);
    return 0;
}

/* The previous checkpoint, kept while the older superblock copy names it: its checksums
 * (its entries may name frames compacted since; recovery would only use it with that copy). */
static int verify_older_checkpoint(struct vctx *v)
{
    if (!v->older_ckpt_id) return 0;
    char path[4096], name[64];
    snprintf(name, sizeof name, "index-%016llx.ckpt", (unsigned long long)v->older_ckpt_id);
    snprintf(path, sizeof path, "%s/%s", v->dir, name);
    struct vfile f;
    int rc = vfile_open(path, &f);
    if (rc == IDEM_ENOTFOUND) return 0;
    if (rc < 0) {
        store_set_error("cannot read %s: %s", path, strerror(errno));
        return rc;
    }
    ckpt_entries_check(v, name, &f, v->older_ckpt_id, 0);
    advance(v, f.size);
    vfile_close(&f);
    return 0;
}

/* Applies the frames after the checkpoint position, then checks every entry. */
static void verify_index(struct vctx *v)
{
    for (size_t i = 0; i < v->nframes; i++) {
        const struct vframe *fr = &v->frames[i];
        uint32_t len;
        const uint8_t *f = fr->after_ckpt ? frame_at(v, fr->addr, &len) : NULL;
        if (!f) continue;
        const uint8_t *p = f + WAL_FRAME_HDR;
        struct rec r;
        if (fr->type == WAL_T_RECORD && rec_decode(p, len - WAL_FRAME_HDR, &r) == 0)
            ix_put(v, key_hash(v, r.key, r.key_len), r.key, r.key_len, fr->addr);
        else if (fr->type == WAL_T_DELETE && len >= WAL_FRAME_HDR + 8 + util_get_u16(p))
            ix_del(v, key_hash(v, p + 8, util_get_u16(p)), p + 8, util_get_u16(p));
    }
    for (size_t k = 0; k < v->ix_cap; k++) {
        const struct ventry *e = &v->ix[k];
        if (e->addr == 0 || e->addr == UINT64_MAX) continue;
        uint32_t klen;
        const uint8_t *key = key_at(v, e->addr, &klen);
        if (!key || key_hash(v, key, klen) != e->h)
            fault(v, "index: the entry for log address %#llx names no record of its key",
                  (unsigned long long)e->addr);
        v->r->index_entries++;
    }
}

/* ---- Audit trail ---- */

/* One entry (checked by audit_unit_next: checksum, lengths) at offset off: key, states and
 * sequence. */
static void audit_entry_check(struct vctx *v, const uint8_t *e, uint64_t off, uint64_t *prev_seq)
{
    uint32_t klen = util_get_u16(e + 42);
    if (klen == 0 || klen > IDEM_KEY_BYTES_MAX || e[40] > IDEM_STATE_REVIEW ||
        e[41] > IDEM_STATE_REVIEW) {
        fault(v, "audit.log offset %llu: entry key length or states are not valid",
              (unsigned long long)off);
        return;
    }
    uint64_t seq = util_get_u64(e + 16);
    if (seq <= *prev_seq)
        fault(v, "audit.log offset %llu: sequence %llu does not follow %llu",
              (unsigned long long)off, (unsigned long long)seq, (unsigned long long)*prev_seq);
    *prev_seq = seq;
    v->r->audit_entries++;
}

/* Every unit of audit.log (audit.c): a block of one entry, or a group of entries over whole
 * blocks, zeros after the last entry. */
static int verify_audit(struct vctx *v)
{
    char path[4096];
    snprintf(path, sizeof path, "%s/audit.log", v->dir);
    struct vfile f;
    int rc = vfile_open(path, &f);
    if (rc == IDEM_ENOTFOUND && v->sb.audit_len)
        fault(v,
              "audit.log is missing, but %llu bytes of it were durable when the superblock "
              "was written",
              (unsigned long long)v->sb.audit_len);
    if (rc == IDEM_ENOTFOUND) return 0;
    if (rc < 0) {
        store_set_error("cannot read %s: %s", path, strerror(errno));
        return rc;
    }
    if (f.size % V_AUDIT_BLOCK)
        fault(v, "audit.log: %llu bytes is not a whole number of entry blocks",
              (unsigned long long)f.size);
    /* After a crash, as audit_open: a unit that is torn, or names a change past the log, ends
     * the trail (the open cuts it off); a later unit naming a change in the log means it was
     * damaged after it was written. After a clean close no write was cut short: any damage is. */
    int crashed = !v->sb.clean_lsn;
    uint64_t prev_seq = 0, empty_at = UINT64_MAX, trail_end = UINT64_MAX, whole_end = 0;
    bool groups = false; /* as audit_open's: a group came before */
    for (uint64_t off = 0; off + V_AUDIT_BLOCK <= f.size;) {
        const uint8_t *u = f.map + off;
        uint32_t bytes = audit_unit_bytes(u);
        if (bytes == 0 || bytes > f.size - off) bytes = V_AUDIT_BLOCK;
        if (all_zero(u, V_AUDIT_BLOCK)) {
            /* After a crash, a block a torn write lost (it reads as zeros) ends the trail, as
             * for the open, which reads it as a torn unit: the blocks after it are judged as
             * after one (an entry of its group on the next block is no unit of its own). */
            if (crashed && trail_end == UINT64_MAX) trail_end = off;
            empty_at = empty_at == UINT64_MAX ? off : empty_at;
            off += V_AUDIT_BLOCK;
            continue;
        }
        if (trail_end != UINT64_MAX && !audit_block_may_start(u, groups)) {
            off += V_AUDIT_BLOCK; /* inside a group: no unit of its own */
            continue;
        }
        int n = audit_unit_valid(u, bytes);
        if (n == AUDIT_TORN && crashed) {
            if (trail_end == UINT64_MAX) { /* as audit_open: the unit that ends the trail */
                trail_end = off;
                groups |= audit_unit_is_group(u);
            }
            off += V_AUDIT_BLOCK;
            continue;
        }
        if (n <= 0) {
            fault(v, "audit.log offset %llu: entry fails its checksum or lengths",
                  (unsigned long long)off);
            off += V_AUDIT_BLOCK;
            continue;
        }
        uint64_t lsn_min = UINT64_MAX, lsn_max = 0;
        uint32_t at = 0;
        const uint8_t *le;
        while (audit_unit_next(u, bytes, &at, &le) == 1) {
            uint64_t lsn = util_get_u64(le + 32);
            lsn_min = lsn < lsn_min ? lsn : lsn_min;
            lsn_max = lsn > lsn_max ? lsn : lsn_max;
        }
        if (crashed && (trail_end != UINT64_MAX || lsn_max > v->log_last_lsn)) {
            if (trail_end == UINT64_MAX) { /* entries of changes that never reached the log */
                trail_end = off;
                groups |= audit_unit_is_group(u);
            } else if (lsn_min <= v->log_last_lsn)
                fault(v,
                      "audit.log offset %llu: the entries there are damaged, and those at offset "
                      "%llu after them name changes in the log",
                      (unsigned long long)trail_end, (unsigned long long)off);
            off += bytes;
            continue;
        }
        groups |= audit_unit_is_group(u);
        if (empty_at != UINT64_MAX)
            fault(v, "audit.log offset %llu: an empty block before the entry at %llu",
                  (unsigned long long)empty_at, (unsigned long long)off);
        empty_at = UINT64_MAX;
        uint32_t pos = 0, end = 0;
        const uint8_t *e;
        while (audit_unit_next(u, bytes, &pos, &e) == 1) {
            audit_entry_check(v, e, off + (uint64_t)(e - u), &prev_seq);
            end = (uint32_t)(e - u) + audit_entry_bytes(e, bytes - (uint32_t)(e - u));
        }
        if (!all_zero(u + end, bytes - end))
            fault(v, "audit.log offset %llu: nonzero bytes after the entry",
                  (unsigned long long)(off + end));
        off += bytes;
        whole_end = off;
    }
    /* Units whose changes were durable when the superblock was written (audit_open). */
    if (whole_end < v->sb.audit_len)
        fault(v,
              "audit.log: the trail's whole units end at %llu bytes, but %llu bytes of it were "
              "durable when the superblock was written",
              (unsigned long long)whole_end, (unsigned long long)v->sb.audit_len);
    advance(v, f.size);
    vfile_close(&f);
    return 0;
}

/* ---- Entry point ---- */

static uint64_t file_size(const char *dir, const char *name)
{
    char path[4096];
    struct stat st;
    snprintf(path, sizeof path, "%s/%s", dir, name);
    return stat(path, &st) == 0 ? (uint64_t)st.st_size : 0;
}

static int verify_run(struct vctx *v)
{
    int rc = verify_super(v);
    if (rc == IDEM_ECORRUPT)
        return 0; /* counted as a fault: nothing else can be read without a superblock */
    if (rc == 0) rc = verify_open_segments(v);
    if (rc < 0) return rc;
    char name[64];
    snprintf(name, sizeof name, "index-%016llx.ckpt", (unsigned long long)v->sb.ckpt_id);
    v->ckpt_bytes = v->sb.ckpt_id ? file_size(v->dir, name) : 0;
    v->total = v->seg_total + v->ckpt_bytes + file_size(v->dir, "audit.log");
    if (v->older_ckpt_id) {
        snprintf(name, sizeof name, "index-%016llx.ckpt", (unsigned long long)v->older_ckpt_id);
        v->total += file_size(v->dir, name);
    }
    v->r->segments = v->nsegs;
    rc = verify_log(v);
    if (rc == 0) rc = fset_build(v);
    if (rc < 0) return rc;
    v->ix_cap = pow2_at_least(2 * (v->nframes + v->ckpt_bytes / V_CKPT_ENTRY_MIN) + 1);
    if (v->ix_cap > ((size_t)1 << 40) / sizeof *v->ix) return IDEM_ENOMEM;
    v->ix = calloc(v->ix_cap, sizeof *v->ix);
    if (!v->ix) return IDEM_ENOMEM;
    rc = verify_checkpoint(v);
    if (rc == 0) rc = verify_older_checkpoint(v);
    if (rc < 0) return rc;
    verify_index(v);
    return verify_audit(v);
}

int idem_verify(const char *dir, idem_verify_report *r,
                void (*progress)(void *ctx, uint64_t done, uint64_t total), void *ctx)
{
    if (!dir || !*dir || !r) return IDEM_EINVAL;
    memset(r, 0, sizeof *r);
    struct stat st;
    if (stat(dir, &st) < 0 || !S_ISDIR(st.st_mode)) {
        store_set_error("%s is not a directory", dir);
        return IDEM_EIO;
    }
    int lock_fd; /* shared, so that no process takes the store to write meanwhile */
    int rc = lock_acquire(dir, LOCK_AS_READER, &lock_fd, r->first_error, sizeof r->first_error);
    if (rc < 0) {
        store_set_error("%s", r->first_error);
        return rc;
    }
    struct vctx v = {.dir = dir, .r = r, .progress = progress, .pctx = ctx};
    rc = verify_run(&v);
    if (rc == 0 && progress) progress(ctx, v.total, v.total);
    for (size_t i = 0; i < v.nsegs; i++)
        vfile_close(&v.segs[i].f);
    free(v.segs);
    free(v.frames);
    free(v.fset);
    free(v.ix);
    if (lock_fd >= 0) close(lock_fd);
    return rc;
}
