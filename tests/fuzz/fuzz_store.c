/*
 * fuzz_store.c: the store images, the open-and-check run shared by the file targets (see
 * fuzz_store.h), and the oracle that run checks against. Images are built once per process
 * through the public API on a simulated disk (src/io_sim.h) with the options of
 * tests/test_recovery.c (64 KiB segments, 4096-byte results, test clock); every case restores
 * one on a fresh simulated disk, so cases do not depend on each other. While an image is built,
 * every version of each key is read back (its history) and the largest token handed out is kept;
 * then the image is opened once unpatched (its reference answers, which must match the history)
 * and its files are parsed: the log's frames and complete batches, the frame of each key's last
 * change, the replay position, the named checkpoint's entries. A case judges from the patched
 * bytes which keys must read exactly as the reference, which may fall back to an earlier version
 * or to absence, and which may read anything (see "Judging a patch"), then checks two opens
 * against that. Salts and hash seeds differ between processes (the store takes them from the
 * clock and /dev/urandom), and so, a little, does the layout: compaction and checkpoints run on
 * the flusher thread at moments that vary, so an image may hold a copy or a batch more or less
 * in one process than in another, and an input may hit other bytes. The oracle judges each
 * process's own images.
 */
#include "fuzz_store.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <xxhash.h>

#include "idem.h"
#include "io_sim.h"
#include "record.h"
#include "store.h"

#define FZ_KEYS     40
#define FZ_HIST     8       /* versions kept per key: the most write_ops makes is 5 */
#define FZ_FRESH    FZ_KEYS /* the fresh key of the first open, in the snapshot */
#define FZ_FILE_MAX (4u << 20)
#define FZ_BLOCK    4096u
#define FZ_ENTRIES  4096 /* checkpoint entries parsed, at most (an image's: one per live key) */
#define FZ_TTL      3600000
#define FZ_LEASE    60000

/* A log position: segment sequence and offset in it, ordered as the log is. */
#define POS(seq, off) ((uint64_t)(seq) << 32 | (uint32_t)(off))
#define POS_NONE      UINT64_MAX

/* One answer of idem_get, or one version of a key while its image was built; the variable
 * parts by length and digest. */
struct fz_rec {
    int err; /* IDEM_OK, or IDEM_ECORRUPT (then nothing else is set) */
    int found;
    int state;
    int has_fp, has_mfp;
    uint32_t attempts, owner_len, note_len, result_len;
    int64_t first_seen, expires_at, last_seen, lease_until, token, last_grant, last_mismatch;
    uint64_t seen_count, mismatch_count, version;
    uint8_t fp[IDEM_FP_BYTES], mfp[IDEM_FP_BYTES];
    uint64_t owner_h, note_h, result_h;
};

/* A frame of an image's log whose checksum holds, in log order. */
struct fz_frame {
    uint64_t pos; /* POS(segment, offset) */
    uint32_t len;
    int64_t batch;      /* ordinal of the complete batch it is in; -1: past the log's end */
    uint64_t batch_pos; /* position of that batch's first frame */
    int key;            /* key of ours a RECORD or DELETE frame names; -1 if none */
};

/* A checkpoint entry as stored (16 or 32 bytes) and the key of ours its frame names. */
struct fz_entry {
    uint8_t b[32];
    uint32_t n;
    int key;
};

/* What an image must answer: learnt while it was built, from one unpatched open, and from its
 * files. */
struct fz_expect {
    struct fz_rec ref[FZ_KEYS];           /* the unpatched open's answers */
    struct fz_rec hist[FZ_KEYS][FZ_HIST]; /* every version each key had, absence included */
    int nhist[FZ_KEYS];                   /* 0: the key never existed in the image */
    uint64_t last_pos[FZ_KEYS];           /* frame of the key's last change; POS_NONE: none */
    int64_t token_max;                    /* the largest token the build handed out */
    uint64_t replay_pos;                  /* where recovery starts reading the log */
    char ckpt_name[48];                   /* the checkpoint the superblock names; "" none */
    struct fz_frame *frames;
    size_t nframes;
    int64_t nbatches;
    struct fz_entry *entries; /* the named checkpoint's */
    size_t nentries;
};

enum fz_verdict_kind {
    V_EXACT = 0,  /* reads as the reference (or the read reports corruption) */
    V_PREFIX = 1, /* absent, or one of the versions it had */
    V_ANY = 2,    /* anything: a frame or entry naming it was rewritten behind a valid checksum */
};

struct fz_verdict {
    uint8_t v[FZ_KEYS];
    int forged;      /* bytes were rewritten behind valid checksums (the fix-up bit) */
    int tokens_free; /* the token reservation was rewritten: the image's tokens are no floor */
    const char *why; /* what the patch hit, for messages */
};

static struct fz_image images[FZ_IMAGES];
static struct fz_expect expect[FZ_IMAGES];
static int ready;
static int building;               /* the image write_ops records the history of */
static uint8_t *scratch;           /* FZ_FILE_MAX: file reads and the patched copy */
static uint8_t *batch_bad;         /* per complete batch of a case: touched by the patch */
static struct fz_entry *entry_buf; /* FZ_ENTRIES: a patched checkpoint's entries */
static uint8_t *entry_used;        /* FZ_ENTRIES */

typedef void fz_visit(void *ctx, size_t off, uint32_t flen, int valid);
static uint64_t walk_wal(uint8_t *p, size_t len, size_t lo, size_t hi, int fix, int any,
                         fz_visit *visit, void *ctx);

static void die(const char *fmt, const char *a, long b)
{
    fprintf(stderr, "fuzz_store: ");
    fprintf(stderr, fmt, a, b);
    fprintf(stderr, "\n");
    abort();
}

static void opts(idem_options *o)
{
    idem_options_init(o);
    o->test_clock = 1;
    o->segment_bytes = 64 * 1024;
    o->result_bytes_max = 4096;
}

static void key_of(int i, char *buf)
{
    snprintf(buf, 32, "k-%04d", i);
}

/* The index of a key of ours, -1 for any other bytes. */
static int key_index(const uint8_t *k, uint32_t len)
{
    if (len != 6 || k[0] != 'k' || k[1] != '-') return -1;
    int v = 0;
    for (int j = 2; j < 6; j++) {
        if (k[j] < '0' || k[j] > '9') return -1;
        v = v * 10 + (k[j] - '0');
    }
    return v < FZ_KEYS ? v : -1;
}

static uint32_t get_u32(const uint8_t *p)
{
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

static uint64_t get_u64(const uint8_t *p)
{
    return (uint64_t)get_u32(p) | (uint64_t)get_u32(p + 4) << 32;
}

static void put_u64(uint8_t *p, uint64_t v)
{
    for (int i = 0; i < 8; i++)
        p[i] = (uint8_t)(v >> (8 * i));
}

static void put_u32(uint8_t *p, uint32_t v)
{
    for (int i = 0; i < 4; i++)
        p[i] = (uint8_t)(v >> (8 * i));
}

/* ---- Records as the oracle keeps them ---- */

static uint64_t digest(const void *p, size_t n)
{
    return n ? XXH3_64bits(p, n) : 0;
}

static void rec_take(struct fz_rec *o, int err, const idem_completion *c)
{
    memset(o, 0, sizeof *o);
    o->err = err;
    if (err != IDEM_OK || !c->found) return;
    const idem_record *r = &c->record;
    o->found = 1;
    o->state = r->state;
    o->has_fp = r->has_fp;
    o->has_mfp = r->has_last_mismatch_fp;
    o->attempts = r->attempts;
    o->owner_len = r->owner_len;
    o->note_len = r->note_len;
    o->result_len = r->result_len;
    o->first_seen = r->first_seen_ms;
    o->expires_at = r->expires_at_ms;
    o->last_seen = r->last_seen_ms;
    o->lease_until = r->lease_until_ms;
    o->token = r->token;
    o->last_grant = r->last_grant_ms;
    o->last_mismatch = r->last_mismatch_ms;
    o->seen_count = r->seen_count;
    o->mismatch_count = r->mismatch_count;
    o->version = r->version;
    memcpy(o->fp, r->fp, IDEM_FP_BYTES);
    memcpy(o->mfp, r->last_mismatch_fp, IDEM_FP_BYTES);
    o->owner_h = digest(r->owner, r->owner_len);
    o->note_h = digest(r->note, r->note_len);
    o->result_h = digest(r->result, r->result_len);
}

/* The first field in which a and b differ, NULL if none. Without `all`, the repeat counters
 * (seen_count, last_seen_ms) are left out: a repeat writes no version, so they are kept beside
 * the log (the checkpoint) and an abandoned store loses the repeats since its last one. */
static const char *rec_diff(const struct fz_rec *a, const struct fz_rec *b, int all)
{
#define FZ_SAME(f)                                                                                 \
    if (a->f != b->f) return #f
    FZ_SAME(found);
    if (!a->found) return NULL;
    FZ_SAME(state);
    FZ_SAME(version);
    FZ_SAME(first_seen);
    FZ_SAME(expires_at);
    FZ_SAME(token);
    FZ_SAME(lease_until);
    FZ_SAME(result_len);
    FZ_SAME(result_h);
    FZ_SAME(has_fp);
    if (memcmp(a->fp, b->fp, IDEM_FP_BYTES)) return "fp";
    FZ_SAME(owner_len);
    FZ_SAME(owner_h);
    FZ_SAME(note_len);
    FZ_SAME(note_h);
    FZ_SAME(attempts);
    FZ_SAME(last_grant);
    FZ_SAME(mismatch_count);
    FZ_SAME(last_mismatch);
    FZ_SAME(has_mfp);
    if (memcmp(a->mfp, b->mfp, IDEM_FP_BYTES)) return "last_mismatch_fp";
    if (all) {
        FZ_SAME(seen_count);
        FZ_SAME(last_seen);
    }
    return NULL;
#undef FZ_SAME
}

static void rec_print(const char *what, const struct fz_rec *r)
{
    if (r->err != IDEM_OK) {
        fprintf(stderr, "fuzz_store:   %s: %s\n", what, idem_strerror(r->err));
    } else if (!r->found) {
        fprintf(stderr, "fuzz_store:   %s: absent\n", what);
    } else {
        fprintf(
            stderr,
            "fuzz_store:   %s: state %s version %llu first_seen %lld expires_at %lld token %lld "
            "lease_until %lld result %u bytes (%016llx) seen %llu mismatches %llu\n",
            what, idem_state_name(r->state), (unsigned long long)r->version,
            (long long)r->first_seen, (long long)r->expires_at, (long long)r->token,
            (long long)r->lease_until, r->result_len, (unsigned long long)r->result_h,
            (unsigned long long)r->seen_count, (unsigned long long)r->mismatch_count);
    }
}

/* An answer the store must not give: names the key and what is wrong, and aborts. */
static void violation(const char *when, const char *key, const char *what, const char *why,
                      const struct fz_rec *got, const struct fz_rec *want)
{
    fprintf(stderr, "fuzz_store: %s: key %s: %s (%s)\n", when, key, what, why ? why : "-");
    if (got) rec_print("read", got);
    if (want) rec_print("expected", want);
    abort();
}

/* ---- Building the images ---- */

static void must(int rc, const char *what)
{
    if (rc != IDEM_OK) die("building images: %s: %ld", what, rc);
}

/* Reads key i back into the history of the image being built (a new entry when it was absent
 * before or its version changed; the latest counters otherwise). */
static void note(idem_queue *q, int i)
{
    char key[32];
    idem_completion c;
    key_of(i, key);
    must(idem_get(q, key, strlen(key), &c), "get");
    struct fz_expect *ex = &expect[building];
    struct fz_rec r;
    rec_take(&r, IDEM_OK, &c);
    int n = ex->nhist[i];
    if (n > 0 && ex->hist[i][n - 1].found == r.found && ex->hist[i][n - 1].version == r.version) {
        ex->hist[i][n - 1] = r;
        return;
    }
    if (n == FZ_HIST) die("building images: %s has more than %ld versions", key, FZ_HIST);
    ex->hist[i][ex->nhist[i]++] = r;
}

static void note_token(const idem_completion *c)
{
    if (c->outcome == IDEM_NEW && c->token > expect[building].token_max)
        expect[building].token_max = c->token;
}

static void claim_commit(idem_queue *q, int i, size_t result_len)
{
    char key[32];
    static char res[4096];
    key_of(i, key);
    for (size_t j = 0; j < result_len; j++)
        res[j] = (char)('a' + (j / 64 + (size_t)i) % 26);
    idem_claim_args a = {.ttl_ms = FZ_TTL, .lease_ms = FZ_LEASE, .fp = key, .fp_len = 6};
    idem_completion c;
    must(idem_claim(q, key, strlen(key), &a, &c), "claim");
    if (c.outcome != IDEM_NEW) die("building images: %s not new", key, c.outcome);
    note_token(&c);
    note(q, i);
    must(idem_commit(q, key, strlen(key), c.token, res, result_len), "commit");
    note(q, i);
}

/* Keys [from, to) in varied states: committed, unfinished, review, set, deleted, repeated,
 * mismatched, with small and compressible results. Every change is read back into the history
 * of the image being built (reads write nothing, so the files are as without them). */
static void write_ops(idem_store *s, int from, int to)
{
    idem_queue *q;
    must(idem_queue_open(s, 8, &q), "queue");
    for (int i = from; i < to; i++) {
        char key[32];
        key_of(i, key);
        idem_claim_args a = {.ttl_ms = FZ_TTL, .lease_ms = FZ_LEASE, .fp = key, .fp_len = 6};
        idem_completion c;
        switch (i % 8) {
        case 0:
        case 1:
            claim_commit(q, i, 10 + (size_t)i);
            break;
        case 2: /* left in_flight */
            must(idem_claim(q, key, strlen(key), &a, &c), "claim");
            note_token(&c);
            note(q, i);
            break;
        case 3: /* review */
            must(idem_claim(q, key, strlen(key), &a, &c), "claim");
            note_token(&c);
            note(q, i);
            must(idem_hold(q, key, strlen(key), c.token, "check by hand", 13), "hold");
            note(q, i);
            break;
        case 4:
            must(idem_set_if_absent(q, key, strlen(key), "value", 5, FZ_TTL, 0, &c), "set");
            note(q, i);
            break;
        case 5: /* committed, then deleted */
            claim_commit(q, i, 20);
            must(idem_del(q, key, strlen(key), "fuzz"), "del");
            note(q, i);
            break;
        case 6: /* a large compressible result, then a repeat and a mismatch */
            claim_commit(q, i, 3000);
            must(idem_claim(q, key, strlen(key), &a, &c), "repeat");
            note(q, i);
            a.fp = "other";
            a.fp_len = 5;
            must(idem_claim(q, key, strlen(key), &a, &c), "mismatch");
            note(q, i);
            break;
        default: /* released, then claimed again */
            must(idem_claim(q, key, strlen(key), &a, &c), "claim");
            note_token(&c);
            note(q, i);
            must(idem_release(q, key, strlen(key), c.token), "release");
            note(q, i);
            claim_commit(q, i, 30);
            break;
        }
    }
    idem_queue_close(q);
}

static void add_file(struct fz_image *img, struct io_sim *sim, const char *name)
{
    char path[96];
    snprintf(path, sizeof path, FZ_DIR "/%s", name);
    int64_t n = io_sim_read_file(sim, path, scratch, FZ_FILE_MAX);
    if (n < 0) return;
    if (img->n == FZ_FILES_MAX) die("too many files in %s (%ld)", path, img->n);
    struct fz_file *f = &img->files[img->n++];
    snprintf(f->path, sizeof f->path, "%s", path);
    snprintf(f->name, sizeof f->name, "%s", name);
    f->len = (size_t)n;
    f->p = malloc(f->len ? f->len : 1);
    if (!f->p) die("malloc %s %ld", path, n);
    memcpy(f->p, scratch, f->len);
}

static void capture(struct fz_image *img, struct io_sim *sim)
{
    char name[48];
    add_file(img, sim, "super");
    add_file(img, sim, "audit.log");
    for (unsigned id = 1; id < 64; id++) {
        snprintf(name, sizeof name, "index-%016x.ckpt", id);
        add_file(img, sim, name);
    }
    for (unsigned seq = 1; seq < 64; seq++) {
        snprintf(name, sizeof name, "wal-%016x.log", seq);
        add_file(img, sim, name);
    }
}

static void build(int kind)
{
    struct io_sim *sim;
    idem_store *s;
    idem_options o;
    opts(&o);
    building = kind;
    must(io_sim_create(7, &sim), "io_sim_create");
    must(store_open_io(FZ_DIR, &o, io_sim_io(sim), 1, &s), "open");
    switch (kind) {
    case FZ_IMG_CLEAN:
        write_ops(s, 0, 16);
        must(idem_close(s), "close");
        break;
    case FZ_IMG_REPLAY:
        write_ops(s, 0, 16);
        must(idem_checkpoint(s), "checkpoint");
        write_ops(s, 16, 32);
        store_abandon(s);
        break;
    case FZ_IMG_TORN: {
        write_ops(s, 0, 16);
        must(idem_checkpoint(s), "checkpoint");
        write_ops(s, 16, 24);
        io_sim_fail_flush(sim, 1, -EIO);
        idem_queue *q;
        idem_claim_args a = {.ttl_ms = FZ_TTL, .lease_ms = FZ_LEASE};
        idem_completion c;
        must(idem_queue_open(s, 4, &q), "queue");
        if (idem_claim(q, "lost", 4, &a, &c) != IDEM_EFATAL) die("%s: no EFATAL", "torn", 0);
        idem_queue_close(q);
        store_abandon(s);
        io_sim_crash(sim, IO_SIM_CRASH_TEAR | IO_SIM_CRASH_FLIP);
        break;
    }
    default:
        write_ops(s, 0, FZ_KEYS);
        store_abandon(s);
        break;
    }
    capture(&images[kind], sim);
    io_sim_destroy(sim);
}

/* ---- What the image's files hold ---- */

/* The valid superblock copy with the higher generation, NULL if neither is. */
static const uint8_t *super_newest(const struct fz_file *f)
{
    const uint8_t *best = NULL;
    for (size_t c = 0; f && c < 2 && (c + 1) * FZ_BLOCK <= f->len; c++) {
        const uint8_t *p = f->p + c * FZ_BLOCK;
        if (memcmp(p, "IDEMSUPR", 8) || XXH3_64bits(p, 4088) != get_u64(p + 4088)) continue;
        if (!best || get_u64(p + 16) > get_u64(best + 16)) best = p;
    }
    return best;
}

/* The key of ours a RECORD or DELETE frame names (record.h rec_key, design.md 3.3). */
static int frame_key(const uint8_t *fr, uint32_t flen)
{
    uint32_t type = fr[28] | (uint32_t)fr[29] << 8, plen = flen - 32, klen;
    const uint8_t *p = fr + 32;
    if (type == 1) {
        const uint8_t *k = rec_key(p, plen, &klen);
        return k ? key_index(k, klen) : -1;
    }
    if (type == 2 && plen >= 8) {
        klen = p[0] | (uint32_t)p[1] << 8;
        return 8 + klen <= plen ? key_index(p + 8, klen) : -1;
    }
    return -1;
}

/* Sets the bit of every key of ours whose name occurs in p[0, n). */
static void names_in(const uint8_t *p, size_t n, uint64_t *mask)
{
    for (size_t j = 0; j + 6 <= n; j++) {
        if (p[j] != 'k' || p[j + 1] != '-') continue;
        int i = key_index(p + j, 6);
        if (i >= 0) *mask |= UINT64_C(1) << i;
    }
}

struct collect {
    struct fz_expect *ex;
    const uint8_t *p;
    uint64_t seq;
    size_t cap;
};

static void collect_frame(void *ctx, size_t off, uint32_t flen, int valid)
{
    struct collect *c = ctx;
    struct fz_expect *ex = c->ex;
    if (!valid) return;
    if (ex->nframes == c->cap) {
        c->cap = c->cap ? 2 * c->cap : 256;
        ex->frames = realloc(ex->frames, c->cap * sizeof *ex->frames);
        if (!ex->frames) die("%s %ld", "realloc", 0);
    }
    struct fz_frame *fr = &ex->frames[ex->nframes++];
    fr->pos = POS(c->seq, off);
    fr->len = flen;
    fr->batch = -1;
    fr->batch_pos = fr->pos;
    fr->key = frame_key(c->p + off, flen);
}

/* The image file of segment seq, NULL if none. */
static const struct fz_file *seg_file(const struct fz_image *img, uint64_t seq)
{
    for (int i = 0; i < img->n; i++) {
        const struct fz_file *f = &img->files[i];
        if (strncmp(f->name, "wal-", 4) == 0 && strtoull(f->name + 4, NULL, 16) == seq) return f;
    }
    return NULL;
}

/* The image file holding the segment of a log address (40 bits: slot of 14, offset / 8 of 26). */
static const struct fz_file *addr_file(const struct fz_image *img, uint64_t addr, uint32_t *off)
{
    uint64_t slot = (addr >> 26) & 0x3fff;
    *off = (uint32_t)(addr & ((UINT64_C(1) << 26) - 1)) << 3;
    for (int i = 0; i < img->n; i++) {
        const struct fz_file *f = &img->files[i];
        if (strncmp(f->name, "wal-", 4) == 0 && strtoull(f->name + 4, NULL, 16) % 16384 == slot)
            return f;
    }
    return NULL;
}

/* The key of ours the frame at a log address names (-1 if none); with mask, also every name of
 * ours the frame's bytes hold. */
static int addr_key(const struct fz_image *img, uint64_t addr, uint64_t *mask)
{
    uint32_t off;
    const struct fz_file *f = addr_file(img, addr, &off);
    if (!f || off < FZ_BLOCK || (size_t)off + 32 > f->len) return -1;
    uint32_t flen = get_u32(f->p + off + 24);
    if (flen < 32 || flen > f->len - off) return -1;
    if (mask) names_in(f->p + off, flen, mask);
    return frame_key(f->p + off, flen);
}

/* The entries of a checkpoint in format 2 (design.md 3.5), as the store walks them: chunks from
 * the header block on, each filled exactly by its entries, then the trailer. -1 if it is not
 * such a file or holds more than max entries. */
static long ckpt_entries(const uint8_t *p, size_t len, struct fz_entry *out, size_t max)
{
    if (len < FZ_BLOCK + 32 || memcmp(p, "IDEMCKPT", 8) || get_u32(p + 8) != 2) return -1;
    size_t pos = FZ_BLOCK, n = 0;
    while (pos + 32 <= len && !memcmp(p + pos, "IDEMCCHK", 8)) {
        uint32_t blen = get_u32(p + pos + 12);
        if (blen > len - pos - 32) return -1;
        const uint8_t *body = p + pos + 32;
        uint32_t off = 0;
        while (off + 16 <= blen) {
            uint32_t sz = (get_u32(body + off + 12) & 1) ? 32 : 16;
            if (off + sz > blen || n == max) return -1;
            memcpy(out[n].b, body + off, sz);
            out[n].n = sz;
            out[n].key = -1;
            n++;
            off += sz;
        }
        if (off != blen) return -1;
        pos += 32 + blen;
    }
    if (pos + 32 > len || memcmp(p + pos, "IDEMCEND", 8)) return -1;
    return (long)n;
}

/*
 * Parses an image: the replay position and checkpoint from the superblock in force; every frame
 * whose checksum holds, in log order, up to the log's end (the first break in the LSN sequence:
 * one open wrote each image, so its LSNs run on by one), grouped into complete batches (each
 * closed by its END frame; frames after the last END are past the end, as a torn batch is); the
 * frame of each key's last change; and the entries of the checkpoint with the key each names.
 */
static void analyse(int kind)
{
    struct fz_image *img = &images[kind];
    struct fz_expect *ex = &expect[kind];
    const uint8_t *sb = super_newest(fz_find(img, "super", 0));
    if (!sb) die("%s image %ld: no valid superblock", "analysing", kind);
    uint64_t first = get_u64(sb + 56), ckpt_id = get_u64(sb + 64), rseq = get_u64(sb + 72);
    ex->replay_pos = rseq ? POS(rseq, get_u32(sb + 80)) : POS(first, FZ_BLOCK);
    ex->ckpt_name[0] = 0;
    if (ckpt_id)
        snprintf(ex->ckpt_name, sizeof ex->ckpt_name, "index-%016llx.ckpt",
                 (unsigned long long)ckpt_id);

    struct collect c = {.ex = ex};
    for (int i = 0; i < img->n; i++) {
        struct fz_file *f = &img->files[i];
        if (strncmp(f->name, "wal-", 4)) continue;
        c.p = f->p;
        c.seq = strtoull(f->name + 4, NULL, 16);
        walk_wal(f->p, f->len, 0, 0, 0, 0, collect_frame, &c);
    }
    /* The log: frames in position order (files are captured by sequence) while LSNs run on. */
    size_t end = 0;
    for (uint64_t prev = 0; end < ex->nframes; end++) {
        struct fz_frame *fr = &ex->frames[end];
        uint64_t lsn = get_u64(seg_file(img, fr->pos >> 32)->p + (uint32_t)fr->pos + 8);
        if (end > 0 && lsn != prev + 1) break;
        prev = lsn;
    }
    size_t g0 = 0;
    ex->nbatches = 0;
    for (size_t i = 0; i < end; i++) {
        struct fz_frame *fr = &ex->frames[i];
        const uint8_t *h = seg_file(img, fr->pos >> 32)->p + (uint32_t)fr->pos;
        if ((h[28] | h[29] << 8) != 3) continue; /* not an END */
        for (size_t j = g0; j <= i; j++) {
            ex->frames[j].batch = ex->nbatches;
            ex->frames[j].batch_pos = ex->frames[g0].pos;
        }
        ex->nbatches++;
        g0 = i + 1;
    }
    for (int k = 0; k < FZ_KEYS; k++)
        ex->last_pos[k] = POS_NONE;
    for (size_t i = 0; i < ex->nframes; i++) {
        struct fz_frame *fr = &ex->frames[i];
        if (fr->batch >= 0 && fr->key >= 0) ex->last_pos[fr->key] = fr->pos;
    }

    ex->nentries = 0;
    const struct fz_file *cf = NULL;
    for (int i = 0; i < img->n && ckpt_id; i++) {
        if (!strcmp(img->files[i].name, ex->ckpt_name)) cf = &img->files[i];
    }
    if (ckpt_id && !cf)
        die("%s image %ld: the checkpoint its superblock names is missing", "analysing", kind);
    if (cf) {
        ex->entries = malloc(FZ_ENTRIES * sizeof *ex->entries);
        if (!ex->entries) die("%s %ld", "malloc", 0);
        long n = ckpt_entries(cf->p, cf->len, ex->entries, FZ_ENTRIES);
        if (n < 0) die("%s image %ld: its checkpoint does not parse", "analysing", kind);
        ex->nentries = (size_t)n;
        for (size_t i = 0; i < ex->nentries; i++) {
            ex->entries[i].key = addr_key(img, get_u64(ex->entries[i].b) & 0xffffffffffull, NULL);
            if (ex->entries[i].key < 0)
                die("%s image %ld: a checkpoint entry names no key of ours", "analysing", kind);
        }
    }
}

/* ---- One case: restoring an image ---- */

static void restore(struct io_sim *sim, const struct fz_image *img)
{
    struct io *io = io_sim_io(sim);
    if (io_mkdir(io, FZ_DIR) < 0) die("%s: mkdir %ld", FZ_DIR, 0);
    for (int i = 0; i < img->n; i++) {
        const struct fz_file *f = &img->files[i];
        struct io_file *h;
        int rc = io_open(io, f->path, IO_O_CREATE, &h);
        if (rc == 0 && f->len) rc = io_write_sync(io, h, 0, f->p, f->len, 1);
        if (rc < 0) die("restoring %s: %ld", f->path, rc);
        io_close(io, h);
    }
    if (io_sync_dir(io, FZ_DIR) < 0) die("%s: sync_dir %ld", FZ_DIR, 0);
    io_destroy(io);
}

/* The unpatched image opens and answers every key as the build left it (the repeat counters
 * aside, see rec_diff): these answers are what a case compares with. */
static void reference(int kind)
{
    struct fz_expect *ex = &expect[kind];
    struct io_sim *sim;
    idem_store *s;
    idem_queue *q;
    idem_options o;
    opts(&o);
    if (io_sim_create(1, &sim) != 0) die("%s %ld", "io_sim_create", 0);
    restore(sim, &images[kind]);
    int rc = store_open_io(FZ_DIR, &o, io_sim_io(sim), 1, &s);
    if (rc != IDEM_OK) {
        fprintf(stderr, "fuzz_store: image %d does not open unpatched: %s: %s\n", kind,
                idem_strerror(rc), idem_last_error());
        abort();
    }
    must(idem_queue_open(s, 8, &q), "queue");
    for (int i = 0; i < FZ_KEYS; i++) {
        char key[32];
        idem_completion c;
        key_of(i, key);
        rc = idem_get(q, key, strlen(key), &c);
        if (rc != IDEM_OK) die("unpatched image: get of %s answers %ld", key, rc);
        rec_take(&ex->ref[i], rc, &c);
        struct fz_rec none = {0};
        const struct fz_rec *built = ex->nhist[i] ? &ex->hist[i][ex->nhist[i] - 1] : &none;
        /* The parse of the log agrees with the open: the key's last frame is its version. */
        if (ex->last_pos[i] != POS_NONE) {
            const struct fz_file *f = seg_file(&images[kind], ex->last_pos[i] >> 32);
            const uint8_t *fr = f->p + (uint32_t)ex->last_pos[i];
            struct rec v;
            int del = (fr[28] | fr[29] << 8) == 2;
            if (del ? ex->ref[i].found
                    : rec_decode(fr + 32, get_u32(fr + 24) - 32, &v) < 0 || !ex->ref[i].found ||
                          v.version != ex->ref[i].version)
                die("%s: the parse of the log disagrees with the open of image %ld", key, kind);
        } else if (ex->ref[i].found) {
            die("%s: the parse of the log finds no frame of a key the open of image %ld reads", key,
                kind);
        }
        const char *d = rec_diff(&ex->ref[i], built, 0);
        char what[96];
        snprintf(what, sizeof what, "field %s differs from what the build wrote", d ? d : "");
        if (d) violation("unpatched image", key, what, "no patch", &ex->ref[i], built);
    }
    idem_queue_close(q);
    if (idem_close(s) != IDEM_OK) die("%s image %ld: close failed", "unpatched", kind);
    io_sim_destroy(sim);
}

void fz_init(void)
{
    if (ready) return;
    scratch = malloc(FZ_FILE_MAX);
    entry_buf = malloc(FZ_ENTRIES * sizeof *entry_buf);
    entry_used = malloc(FZ_ENTRIES);
    if (!scratch || !entry_buf || !entry_used) die("%s %ld", "malloc", 0);
    int64_t nb = 0;
    for (int k = 0; k < FZ_IMAGES; k++) {
        build(k);
        analyse(k);
        reference(k);
        if (expect[k].nbatches > nb) nb = expect[k].nbatches;
    }
    batch_bad = malloc((size_t)nb + 1);
    if (!batch_bad) die("%s %ld", "malloc", 0);
    ready = 1;
}

const struct fz_image *fz_image(int kind)
{
    return &images[kind % FZ_IMAGES];
}

const struct fz_file *fz_find(const struct fz_image *img, const char *prefix, unsigned pick)
{
    unsigned count = 0;
    size_t pl = strlen(prefix);
    for (int i = 0; i < img->n; i++)
        count += strncmp(img->files[i].name, prefix, pl) == 0;
    if (count == 0) return NULL;
    pick %= count;
    for (int i = 0; i < img->n; i++) {
        if (strncmp(img->files[i].name, prefix, pl) == 0 && pick-- == 0) return &img->files[i];
    }
    return NULL;
}

int fz_decode(const uint8_t *data, size_t size, struct fz_patch *pt)
{
    if (size < 6) return -1;
    pt->image = data[0] % FZ_IMAGES;
    pt->overwrite = data[1] & 1;
    pt->fix = (data[1] >> 1) & 1;
    pt->pick = data[1] >> 2;
    pt->off = (uint32_t)data[2] | (uint32_t)data[3] << 8 | (uint32_t)data[4] << 16 |
              (uint32_t)data[5] << 24;
    pt->bytes = data + 6;
    pt->n = size - 6 < FZ_PATCH_MAX ? size - 6 : FZ_PATCH_MAX;
    return 0;
}

/* ---- Checksum fix-ups: make the patched bytes pass the checksums, so that the checks behind
 * them are what gets fuzzed. ---- */

static void fix_block(uint8_t *p, size_t len, size_t at)
{
    if (at + FZ_BLOCK <= len) put_u64(p + at + 4088, XXH3_64bits(p + at, 4088));
}

/* Re-checksums a checkpoint after the fuzz bytes (formats in src/super.c): the header; in
 * format 2 every chunk that still has its magic and a length that fits (its entry count made
 * that of its entries when they fill it exactly), and the trailer, with counts of what the chunk
 * walk found when it ends at the trailer; in format 1 the trailer's count and checksum. */
static void fix_ckpt(uint8_t *p, size_t len)
{
    fix_block(p, len, 0);
    if (len < FZ_BLOCK + 32) return;
    if (get_u32(p + 8) == 1) {
        uint64_t n = (len - FZ_BLOCK) / 32;
        while (n > 0 && memcmp(p + FZ_BLOCK + (n - 1) * 32, "IDEMCEND", 8))
            n--;
        if (n == 0) return;
        uint8_t *t = p + FZ_BLOCK + (n - 1) * 32;
        put_u64(t + 8, n - 1);
        put_u64(t + 16, XXH3_64bits(p + FZ_BLOCK, (n - 1) * 32));
        return;
    }
    size_t pos = FZ_BLOCK;
    uint64_t k = 0, entries = 0;
    while (pos + 32 <= len && !memcmp(p + pos, "IDEMCCHK", 8)) {
        uint32_t blen = get_u32(p + pos + 12);
        if (blen > len - pos - 32) break;
        uint8_t *body = p + pos + 32;
        uint32_t n = 0, off = 0;
        while (off + 16 <= blen) {
            off += (get_u32(body + off + 12) & 1) ? 32 : 16;
            n++;
        }
        if (off == blen) put_u32(p + pos + 8, n);
        put_u64(p + pos + 16, XXH3_64bits_withSeed(body, blen, k));
        entries += get_u32(p + pos + 8);
        k++;
        pos += 32 + blen;
    }
    size_t t = len - 32;
    while (t >= FZ_BLOCK && memcmp(p + t, "IDEMCEND", 8))
        t -= 16;
    if (t < FZ_BLOCK) return;
    if (t == pos) {
        put_u64(p + t + 8, entries);
        put_u64(p + t + 16, k);
    }
    put_u64(p + t + 24, XXH3_64bits_withSeed(p + t, 24, get_u64(p + 16)));
}

/* Walks a segment as the recovery scan does (a bad length skips to the next block). With
 * fix, re-checksums every frame that overlaps [lo, hi); returns the largest LSN of a frame
 * whose checksum holds (any: of every frame with a plausible length). visit, if given, is told
 * of every frame with a plausible length, after any fix-up, and whether its checksum holds. */
static uint64_t walk_wal(uint8_t *p, size_t len, size_t lo, size_t hi, int fix, int any,
                         fz_visit *visit, void *ctx)
{
    uint64_t lsn_max = 0;
    if (len < FZ_BLOCK) return 0;
    uint64_t salt = get_u64(p + 24);
    size_t off = FZ_BLOCK;
    while (off + 32 <= len) {
        if (off % FZ_BLOCK && FZ_BLOCK - off % FZ_BLOCK < 32) {
            off = (off + FZ_BLOCK - 1) / FZ_BLOCK * FZ_BLOCK;
            continue;
        }
        uint32_t flen = get_u32(p + off + 24);
        if (flen < 32 || flen % 8 || flen > len - off) {
            off = (off / FZ_BLOCK + 1) * FZ_BLOCK;
            continue;
        }
        uint64_t sum = XXH3_64bits_withSeed(p + off + 8, flen - 8, salt);
        if (fix && off < hi && off + flen > lo) put_u64(p + off, sum);
        if ((any || get_u64(p + off) == sum) && get_u64(p + off + 8) > lsn_max)
            lsn_max = get_u64(p + off + 8);
        if (visit) visit(ctx, off, flen, get_u64(p + off) == sum);
        uint32_t type = p[off + 28] | (uint32_t)p[off + 29] << 8;
        off += flen;
        if (type == 3 || type == 4) /* END, SEGEND: the next frame starts on a block */
            off = (off + FZ_BLOCK - 1) / FZ_BLOCK * FZ_BLOCK;
    }
    return lsn_max;
}

static void fix_wal(uint8_t *p, size_t len, size_t lo, size_t hi)
{
    fix_block(p, len, 0);
    walk_wal(p, len, lo, hi, 1, 0, NULL, NULL);
}

/* ---- Known bugs ---- */

/* Every bug found so far (W1, W2, S1-S6: docs/fuzzing.md) is fixed; new ones found by a long
 * run are listed here, with their crash input in tests/fuzz/crashes/, until they are fixed. */
static const char *known_bug(const struct fz_image *img, const struct fz_file *f, uint8_t *p)
{
    (void)img;
    (void)f;
    (void)p;
    return NULL;
}

/* ---- Judging a patch ---- */

/*
 * What the store may answer for each key, from the bytes the patch changed (after any fix-up);
 * design.md sections 3 and 7 are the ground:
 *
 * - A byte changed without fix-ups fails the checksum of whatever holds it: every byte of a
 *   frame, a segment header, a superblock copy and a checkpoint is under one (a checkpoint's
 *   padding must be zeros; the rest of an END's block is never read). A damaged superblock copy
 * leaves the other, an earlier but whole description of the same log; a damaged checkpoint fails
 * the open; a damaged frame before the replay position fails the reads that reach it (W2) and stops
 * compaction, which then retires nothing. So every key reads as the reference, or the read or the
 * open reports corruption, except where the damage is in the replayed log: the log then ends at the
 * batch before the damaged one, and what lies past the end is a torn tail, dropped, unless a valid
 * frame of a later batch lies there (step 5: every batch starts on a block, so a batch the patch
 * left whole is seen). So if a complete batch after the damaged one is left whole, every key must
 *   still read as the reference (the open must fail); if not, the keys whose last change is in
 *   the damaged batch or after it may read as an earlier version of theirs, or be absent.
 * - With fix-ups a changed frame is valid again and says what the patch made it say: the key it
 *   named, and any key named in its new bytes, may read anything. The batch it is in may end
 *   elsewhere, lose its END or read as a later one, so the keys whose last change is in that
 *   batch or after it may fall back as above. Compaction walks a sealed segment frame by frame up
 *   to its SEGEND, so a rewritten length or SEGEND may hide the live frames behind it from the
 *   walk, and the segment is retired without them: the keys whose last change lies in that
 *   segment after the change may be lost too, before the replay position as well.
 * - A checkpoint entry rewritten behind valid checksums may lose its key, or lead to a frame of
 *   the key that frame names (any version of it): both keys may read anything.
 * - A superblock field rewritten behind a valid checksum that says where the log is or how to read
 *   it (magic, version, features, hash seed, log start, checkpoint id and replay position, LSN,
 *   batch, segment size) may make any key fall back to an earlier version or absence; a
 *   rewritten token reservation lets tokens below the image's be handed out. The other fields
 *   (generation, store id, clock, counts, resume batch, durability, the marks, flags, the unused
 *   rest) change no key: a copy made the newer by its generation is an earlier, whole state of
 *   the same log, and a clock moved on only expires committed records, which every check allows.
 */

struct forged {
    const uint8_t *p;
    size_t lo, hi;
    uint64_t *named;
};

/* A frame the fix-up re-checksummed (it overlaps the patch): every key it names may change. */
static void forged_frame(void *ctx, size_t off, uint32_t flen, int valid)
{
    struct forged *g = ctx;
    (void)valid;
    if (off < g->hi && off + flen > g->lo) names_in(g->p + off, flen, g->named);
}

static void mark(struct fz_verdict *vd, uint64_t keys, int v)
{
    for (int k = 0; k < FZ_KEYS; k++) {
        if ((keys >> k & 1) && vd->v[k] < v) vd->v[k] = (uint8_t)v;
    }
}

static void judge_wal(const struct fz_expect *ex, const struct fz_file *f, uint8_t *q, size_t lo,
                      size_t hi, size_t dlo, int fixed, struct fz_verdict *vd)
{
    uint64_t seq = strtoull(f->name + 4, NULL, 16), s0 = POS(seq, 0), s1 = POS(seq + 1, 0);
    int hdr = dlo < FZ_BLOCK;
    uint64_t p_log = POS_NONE; /* the replayed log may end before it */
    uint64_t p_seg = POS_NONE; /* compaction may not see this segment's frames from here on */
    uint64_t named = 0, fall = 0;
    memset(batch_bad, 0, (size_t)ex->nbatches + 1);
    for (size_t i = 0; i < ex->nframes; i++) {
        const struct fz_frame *fr = &ex->frames[i];
        if (fr->pos < s0 || fr->pos >= s1) continue;
        uint32_t off = (uint32_t)fr->pos;
        int dmg = memcmp(f->p + off, q + off, fr->len) != 0;
        uint64_t start = fr->batch >= 0 ? fr->batch_pos : fr->pos;
        if (fr->batch >= 0 && (dmg || hdr)) batch_bad[fr->batch] = 1;
        if (hdr && fr->batch >= 0 && fr->pos >= ex->replay_pos && start < p_log) p_log = start;
        if (hdr && start < p_seg) p_seg = start;
        if (!dmg) continue;
        if (fr->pos >= ex->replay_pos && start < p_log) p_log = start;
        if (start < p_seg) p_seg = start;
        names_in(f->p + off, fr->len, &named);
    }
    if (fixed) {
        vd->why = "a segment rewritten behind valid checksums";
        uint64_t at = POS(seq, dlo);
        if (at < p_seg) p_seg = at;
        if (at >= ex->replay_pos && at < p_log) p_log = at;
        struct forged g = {.p = q, .lo = lo, .hi = hi, .named = &named};
        walk_wal(q, f->len, lo, hi, 0, 0, forged_frame, &g);
        for (int k = 0; k < FZ_KEYS; k++) {
            uint64_t lp = ex->last_pos[k];
            if (lp != POS_NONE && (lp >= p_log || (lp >= p_seg && lp < s1)))
                fall |= UINT64_C(1) << k;
        }
        mark(vd, fall, V_PREFIX);
        mark(vd, named, V_ANY);
        return;
    }
    if (p_log == POS_NONE) {
        vd->why = "damage outside the replayed log";
        return;
    }
    for (size_t i = 0; i < ex->nframes; i++) {
        const struct fz_frame *fr = &ex->frames[i];
        if (fr->batch >= 0 && fr->batch_pos > p_log && !batch_bad[fr->batch]) {
            vd->why = "damage in the replayed log, with a later batch left whole";
            return;
        }
    }
    vd->why = "damage in the replayed log's last batches";
    for (int k = 0; k < FZ_KEYS; k++) {
        if (ex->last_pos[k] != POS_NONE && ex->last_pos[k] >= p_log) fall |= UINT64_C(1) << k;
    }
    mark(vd, fall, V_PREFIX);
}

static void judge_ckpt(const struct fz_image *img, const struct fz_expect *ex,
                       const struct fz_file *f, const uint8_t *q, int fixed, struct fz_verdict *vd)
{
    if (strcmp(f->name, ex->ckpt_name)) {
        vd->why = "a checkpoint the superblock does not name";
        return;
    }
    vd->why = "the checkpoint, damaged";
    if (!fixed) return;
    vd->why = "the checkpoint rewritten behind valid checksums";
    long n = ckpt_entries(q, f->len, entry_buf, FZ_ENTRIES);
    if (n < 0) {
        memset(vd->v, V_ANY, FZ_KEYS);
        return;
    }
    uint64_t named = 0;
    memset(entry_used, 0, ex->nentries);
    for (long i = 0; i < n; i++) {
        size_t j = 0;
        while (j < ex->nentries && (entry_used[j] || ex->entries[j].n != entry_buf[i].n ||
                                    memcmp(ex->entries[j].b, entry_buf[i].b, entry_buf[i].n)))
            j++;
        if (j < ex->nentries)
            entry_used[j] = 1;
        else /* a new entry: the key its frame names may be found through it */
            addr_key(img, get_u64(entry_buf[i].b) & 0xffffffffffull, &named);
    }
    for (size_t j = 0; j < ex->nentries; j++) {
        if (!entry_used[j]) named |= UINT64_C(1) << ex->entries[j].key; /* lost or changed */
    }
    mark(vd, named, V_ANY);
}

static void judge_super(const struct fz_file *f, const uint8_t *q, int fixed, struct fz_verdict *vd)
{
    vd->why = "a superblock copy, damaged";
    if (!fixed) return;
    vd->why = "a superblock field rewritten behind a valid checksum";
    int moved = 0;
    for (size_t c = 0; c < 2; c++) {
        for (size_t o = 0; o < 4088 && c * FZ_BLOCK + o < f->len; o++) {
            size_t at = c * FZ_BLOCK + o;
            if (f->p[at] == q[at]) continue;
            if (o < 16 || (o >= 40 && o < 48) || (o >= 56 && o < 104))
                moved = 1;
            else if (o >= 48 && o < 56)
                vd->tokens_free = 1;
        }
    }
    if (moved) memset(vd->v, V_PREFIX, FZ_KEYS);
}

/* The verdict on every key for the patched copy q of file f (the patch spans [lo, hi)). */
static void judge(const struct fz_image *img, const struct fz_expect *ex, const struct fz_file *f,
                  uint8_t *q, size_t lo, size_t hi, int fixed, int kind, struct fz_verdict *vd)
{
    memset(vd, 0, sizeof *vd);
    vd->why = "a patch that changes no byte";
    size_t dlo = 0;
    while (dlo < f->len && f->p[dlo] == q[dlo])
        dlo++;
    if (dlo == f->len) return;
    vd->forged = fixed;
    if (kind == FZ_FIX_WAL)
        judge_wal(ex, f, q, lo, hi, dlo, fixed, vd);
    else if (kind == FZ_FIX_CKPT)
        judge_ckpt(img, ex, f, q, fixed, vd);
    else
        judge_super(f, q, fixed, vd);
}

/* ---- One case: the checks ---- */

enum fz_second {
    SECOND_ANY = 0,    /* anything */
    SECOND_SAME = 1,   /* as the first open read it last */
    SECOND_PREFIX = 2, /* as that, or as the verdict allows the first open's reads */
};

struct fz_ctx {
    const struct fz_expect *ex;
    const struct fz_verdict *vd;
    struct fz_rec snap[FZ_KEYS + 1]; /* what the first open read last, before its close */
    int second[FZ_KEYS + 1];         /* what the second open's read must be (enum fz_second) */
    int64_t token_last;              /* every token handed out from now on is above it */
};

static void check_failure(int rc, const char *when)
{
    const char *msg = idem_last_error();
    if (rc != IDEM_ECORRUPT && rc != IDEM_EVERSION) {
        fprintf(stderr, "fuzz_store: %s: open failed with %s (%d), not ECORRUPT/EVERSION: %s\n",
                when, idem_strerror(rc), rc, msg);
        abort();
    }
    if (!msg || !*msg) die("%s: open failed with %ld and no message", when, rc);
}

static void key_name(int i, const char *when, char *buf)
{
    if (i < FZ_KEYS)
        key_of(i, buf);
    else
        snprintf(buf, 32, "fz-new-%s", when);
}

/* Reads key i (FZ_FRESH: the first open's fresh key): the read answers, and a record found is
 * the key's own. */
static void read_one(idem_queue *q, const char *when, int i, struct fz_rec *out)
{
    char key[32];
    idem_completion c;
    key_name(i, "first", key);
    int rc = idem_get(q, key, strlen(key), &c);
    /* A record that fails to decode or decompress may answer IDEM_ECORRUPT (W3). */
    if (rc != IDEM_OK && rc != IDEM_ECORRUPT) die("%s: get answers %ld", when, rc);
    if (rc == IDEM_OK && c.found &&
        (c.record.key_len != strlen(key) || memcmp(c.record.key, key, strlen(key))))
        die("%s: get of a key returns another key's record (%ld)", when, i);
    rec_take(out, rc, &c);
}

static void read_keys(idem_queue *q, const char *when, struct fz_rec *out, int n)
{
    for (int i = 0; i < n; i++)
        read_one(q, when, i, &out[i]);
}

/* A read of key i by the first open, against the unpatched image and the verdict. */
static void check_read(const char *when, int i, const struct fz_rec *r, const struct fz_ctx *x,
                       int64_t now)
{
    const struct fz_expect *ex = x->ex;
    const struct fz_rec *want = &ex->ref[i];
    char key[32], what[96];
    key_of(i, key);
    if (r->err != IDEM_OK || x->vd->v[i] == V_ANY) return;
    if (x->vd->v[i] == V_PREFIX) {
        if (!r->found || !rec_diff(r, want, 0)) return;
        for (int h = 0; h < ex->nhist[i]; h++) {
            if (!rec_diff(r, &ex->hist[i][h], 0)) return;
        }
        violation(when, key, "reads as a version the key never had", x->vd->why, r, want);
    }
    /* Exact; a committed record may have expired meanwhile if the patch moved the clock on. */
    if (!r->found && want->found && want->state == IDEM_STATE_COMMITTED && now >= want->expires_at)
        return;
    const char *d = rec_diff(r, want, 1);
    if (!d) return;
    snprintf(what, sizeof what, "field %s differs from the unpatched image's", d);
    violation(when, key, what, x->vd->why, r, want);
}

/* A read by the second open of a key that must be stable (see stable): as the first open read
 * it last (I5). */
static void check_same(const char *when, const char *key, const struct fz_rec *r,
                       const struct fz_rec *was, int64_t now)
{
    char what[96];
    if (was->err != IDEM_OK) return;
    if (r->err != IDEM_OK)
        violation(when, key, "reads as corrupt where the first open read it whole",
                  "after a clean close", r, was);
    if (!r->found && was->found && was->state == IDEM_STATE_COMMITTED && now >= was->expires_at)
        return;
    const char *d = rec_diff(r, was, 1);
    if (!d) return;
    snprintf(what, sizeof what, "field %s differs from the first open's last read", d);
    violation(when, key, what, "after a clean close", r, was);
}

/* A token handed out: above every token handed out before it (I6). */
static void take_token(const char *when, const char *key, int64_t token, struct fz_ctx *x)
{
    if (token <= x->token_last) {
        fprintf(stderr,
                "fuzz_store: %s: key %s: token %lld handed out, not above %lld (the image's "
                "largest, or one handed out since) (%s)\n",
                when, key, (long long)token, (long long)x->token_last, x->vd->why);
        abort();
    }
    x->token_last = token;
}

static void bad_outcome(const char *when, const char *key, const char *what, int got, int want,
                        const char *why, const struct fz_rec *r)
{
    char m[128];
    snprintf(m, sizeof m, "%s answers %s, not %s", what, idem_outcome_name(got),
             idem_outcome_name(want));
    violation(when, key, m, why, r, NULL);
}

/* Whether key i must read the same at every later look in this case: its verdict is exact, or
 * it may have fallen back only by a cut the store made itself (no rewritten bytes: the store
 * knows where its log ends). With rewritten bytes a key that may fall back may also change
 * under the store's own writes: it appends where it believes the log ends, and a rewritten
 * superblock or frame may have it believe so before frames its index still points to; and a
 * rewritten entry may lead to a segment the first open's compaction retires. Such a key keeps
 * its stale entry, looked at before a new one, even once claimed new and committed: what the
 * store writes next may land where it leads. */
static int stable(const struct fz_ctx *x, int i)
{
    return x->vd->v[i] == V_EXACT || (x->vd->v[i] == V_PREFIX && !x->vd->forged);
}

/* Claims key i, read as cur just before (nothing written since): a key read absent answers new
 * with a token above every one before it, and is committed with its name as the result; a key
 * read committed answers done with the result read (mismatch if it holds another fingerprint).
 * Returns 1 if claimed new and committed, 2 if done, 3 otherwise. */
static int claim_again(idem_queue *q, const char *when, int i, const struct fz_rec *cur,
                       struct fz_ctx *x)
{
    const char *why = x->vd->why;
    char key[32], m[96];
    idem_completion c;
    key_of(i, key);
    uint8_t fp[IDEM_FP_BYTES];
    idem_fingerprint(key, 6, fp);
    int want = !cur->found                                         ? IDEM_NEW
               : cur->has_fp && memcmp(cur->fp, fp, IDEM_FP_BYTES) ? IDEM_MISMATCH
                                                                   : IDEM_DONE;
    idem_claim_args a = {.ttl_ms = FZ_TTL, .lease_ms = FZ_LEASE, .fp = key, .fp_len = 6};
    int rc = idem_claim(q, key, 6, &a, &c);
    /* Corruption is reported, as by a read (the lookup may reach a candidate the read did not
     * need); a new key may find the store full. */
    if (rc == IDEM_ECORRUPT || (rc == IDEM_EFULL && want == IDEM_NEW)) return 3;
    if (rc != IDEM_OK) {
        snprintf(m, sizeof m, "its claim fails with %s", idem_strerror(rc));
        violation(when, key, m, why, cur, NULL);
    }
    if (c.outcome != want)
        bad_outcome(when, key,
                    cur->found ? "the claim of a key read committed"
                               : "the claim of a key read absent",
                    c.outcome, want, why, cur);
    if (want == IDEM_DONE &&
        (c.data_len != cur->result_len || digest(c.data, c.data_len) != cur->result_h))
        violation(when, key, "its claim answers done with another result than it read", why, cur,
                  NULL);
    if (want != IDEM_NEW) return want == IDEM_DONE ? 2 : 3;
    take_token(when, key, c.token, x);
    rc = idem_commit(q, key, 6, c.token, key, 6);
    if (rc != IDEM_OK && rc != IDEM_EFULL) die("%s: commit of a new claim: %ld", when, rc);
    return rc == IDEM_OK ? 1 : 3;
}

/*
 * The first open: every image key reads as the verdict allows; compaction never fails the store;
 * a fresh key is claimed new with a token above every one before it; every image key read absent,
 * or committed, just before, is claimed (claim_again); then every key is read again, as the
 * verdict, the first reads and these claims allow, and kept for the second open. The second
 * open: every key that must be stable, every key claimed new and the first open's fresh key read
 * as the first open read them last; the others as the verdict allows; a fresh key is claimed new
 * above every token before it. Both close cleanly.
 */
static void session(idem_store *s, const char *when, struct fz_ctx *x, int first)
{
    const char *why = x->vd->why;
    idem_queue *q;
    int rc = idem_queue_open(s, 8, &q);
    if (rc != IDEM_OK) die("%s: queue_open %ld", when, rc);
    struct fz_rec r[FZ_KEYS + 1];
    char key[32];
    int64_t now = idem_clock_now(s);
    read_keys(q, when, r, first ? FZ_KEYS : FZ_KEYS + 1);
    for (int i = 0; i < (first ? FZ_KEYS : FZ_KEYS + 1); i++) {
        key_name(i, "first", key);
        if (first)
            check_read(when, i, &r[i], x, now);
        else if (x->second[i] == SECOND_SAME)
            check_same(when, key, &r[i], &x->snap[i], now);
        else if (x->second[i] == SECOND_PREFIX && rec_diff(&r[i], &x->snap[i], 1))
            check_read(when, i, &r[i], x, now);
    }
    /* Compaction walks every sealed segment now, before the claims: what it meets (damage it
     * stops at, or a frame it cannot copy) never makes the store fail. */
    rc = idem_compact(s, 200);
    if (rc == IDEM_EFATAL) die("%s: compaction failed the store (%ld)", when, rc);

    snprintf(key, sizeof key, "fz-new-%s", first ? "first" : "second");
    idem_claim_args a = {.ttl_ms = 60000, .lease_ms = 1000};
    idem_completion c;
    int fresh = 0;
    rc = idem_claim(q, key, strlen(key), &a, &c);
    if (rc == IDEM_OK) {
        if (c.outcome != IDEM_NEW)
            bad_outcome(when, key, "the claim of a key no image holds", c.outcome, IDEM_NEW, why,
                        NULL);
        take_token(when, key, c.token, x);
        rc = idem_commit(q, key, strlen(key), c.token, "r", 1);
        fresh = rc == IDEM_OK;
    }
    if (rc != IDEM_OK && rc != IDEM_EFULL) die("%s: claim or commit of a new key: %ld", when, rc);

    if (first) {
        int claimed[FZ_KEYS] = {0}; /* claim_again's answer; 0: not claimed */
        struct fz_rec cur[FZ_KEYS];
        for (int i = 0; i < FZ_KEYS; i++) {
            key_of(i, key);
            read_one(q, when, i, &cur[i]);
            check_read("first open, after compaction", i, &cur[i], x, now);
            if (stable(x, i) && rec_diff(&cur[i], &r[i], 1))
                violation(when, key, "changed within the open", why, &cur[i], &r[i]);
            if (!x->ex->nhist[i] || cur[i].err != IDEM_OK ||
                (cur[i].found && cur[i].state != IDEM_STATE_COMMITTED))
                continue;
            claimed[i] = claim_again(q, when, i, &cur[i], x);
        }
        read_keys(q, when, x->snap, FZ_KEYS + 1);
        for (int i = 0; i < FZ_KEYS; i++) {
            const struct fz_rec *n = &x->snap[i];
            key_of(i, key);
            x->second[i] = stable(x, i) ? SECOND_SAME
                           : x->vd->v[i] == V_PREFIX && (claimed[i] == 0 || claimed[i] == 2)
                               ? SECOND_PREFIX
                               : SECOND_ANY;
            if (claimed[i] == 1) {
                if (!stable(x, i)) continue;
                if (n->err != IDEM_OK || !n->found || n->state != IDEM_STATE_COMMITTED ||
                    n->result_len != 6 || n->result_h != digest(key, 6))
                    violation(when, key, "claimed new and committed, it reads otherwise", why, n,
                              NULL);
            } else if (claimed[i] == 2 && stable(x, i)) {
                const char *d = rec_diff(n, &cur[i], 0);
                if (d) violation(when, key, "a repeat changed the record", d, n, &cur[i]);
            } else if (claimed[i] != 3) {
                check_read("first open, after its claims", i, n, x, now);
            }
        }
        x->second[FZ_FRESH] = SECOND_SAME;
        const struct fz_rec *n = &x->snap[FZ_FRESH];
        if (fresh && (n->err != IDEM_OK || !n->found || n->state != IDEM_STATE_COMMITTED ||
                      n->result_len != 1 || n->result_h != digest("r", 1)))
            violation(when, "fz-new-first", "committed, it reads otherwise", why, n, NULL);
    }
    idem_queue_close(q);
    rc = idem_close(s);
    if (rc != IDEM_OK) die("%s: close %ld", when, rc);
}

void fz_run(const struct fz_image *img, const struct fz_file *f, const struct fz_patch *pt, int fix)
{
    if (!f || f->len == 0) return;
    memcpy(scratch, f->p, f->len);
    size_t off = pt->off % f->len, n = pt->n;
    if (n > f->len - off) n = f->len - off;
    for (size_t i = 0; i < n; i++)
        scratch[off + i] =
            pt->overwrite ? pt->bytes[i] : (uint8_t)(scratch[off + i] ^ pt->bytes[i]);
    if (pt->fix) {
        if (fix == FZ_FIX_SUPER) {
            fix_block(scratch, f->len, 0);
            fix_block(scratch, f->len, FZ_BLOCK);
        } else if (fix == FZ_FIX_CKPT) {
            fix_ckpt(scratch, f->len);
        } else if (fix == FZ_FIX_WAL) {
            fix_wal(scratch, f->len, off, off + n);
        }
    }

    if (known_bug(img, f, scratch)) return;

    struct fz_verdict vd;
    struct fz_ctx x = {.ex = &expect[img - images], .vd = &vd};
    judge(img, x.ex, f, scratch, off, off + n, pt->fix, fix, &vd);
    x.token_last = vd.tokens_free ? 0 : x.ex->token_max;

    struct io_sim *sim;
    if (io_sim_create(1, &sim) != 0) die("%s %ld", "io_sim_create", 0);
    restore(sim, img);
    for (size_t i = 0; i < f->len; i++) {
        if (scratch[i] != f->p[i] && io_sim_corrupt(sim, f->path, i, scratch[i] ^ f->p[i]) != 0)
            die("io_sim_corrupt %s at %ld", f->path, (long)i);
    }

    idem_options o;
    opts(&o);
    idem_store *s;
    int rc = store_open_io(FZ_DIR, &o, io_sim_io(sim), 1, &s);
    if (rc != IDEM_OK) {
        check_failure(rc, "first open");
    } else {
        session(s, "first", &x, 1);
        /* The store accepted the files and wrote to them: it opens again, or reports the
         * damage it met meanwhile (a record reached only now, through the checkpoint, that
         * fails its checksum or does not decode) as corruption, cleanly. */
        rc = store_open_io(FZ_DIR, &o, io_sim_io(sim), 1, &s);
        if (rc != IDEM_OK)
            check_failure(rc, "reopen");
        else
            session(s, "second", &x, 0);
    }
    io_sim_destroy(sim);
}
