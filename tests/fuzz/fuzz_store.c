/*
 * fuzz_store.c: the store images and the open-and-check run shared by the file targets (see
 * fuzz_store.h). Images are built once per process through the public API on a simulated disk
 * (src/io_sim.h) with the options of tests/test_recovery.c (64 KiB segments, 4096-byte results,
 * test clock); every case restores one on a fresh simulated disk, so cases do not depend on each
 * other. Salts and hash seeds differ between processes (the store takes them from the clock and
 * /dev/urandom); the file layout, and so what an input does, does not.
 */
#include "fuzz_store.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <xxhash.h>

#include "idem.h"
#include "io_sim.h"
#include "store.h"

#define FZ_KEYS     40
#define FZ_FILE_MAX (4u << 20)
#define FZ_BLOCK    4096u

static struct fz_image images[FZ_IMAGES];
static uint64_t image_lsn_max[FZ_IMAGES]; /* largest LSN of a valid frame in the image */
static int ready;
static uint8_t *scratch; /* FZ_FILE_MAX: file reads and the patched copy */

static uint64_t walk_wal(uint8_t *p, size_t len, size_t lo, size_t hi, int fix, int any);

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

/* ---- Building the images ---- */

static void must(int rc, const char *what)
{
    if (rc != IDEM_OK) die("building images: %s: %ld", what, rc);
}

static void claim_commit(idem_queue *q, int i, size_t result_len)
{
    char key[32];
    static char res[4096];
    key_of(i, key);
    for (size_t j = 0; j < result_len; j++)
        res[j] = (char)('a' + (j / 64 + (size_t)i) % 26);
    idem_claim_args a = {.ttl_ms = 3600000, .lease_ms = 60000, .fp = key, .fp_len = 6};
    idem_completion c;
    must(idem_claim(q, key, strlen(key), &a, &c), "claim");
    if (c.outcome != IDEM_NEW) die("building images: %s not new", key, c.outcome);
    must(idem_commit(q, key, strlen(key), c.token, res, result_len), "commit");
}

/* Keys [from, to) in varied states: committed, unfinished, review, set, deleted, repeated,
 * mismatched, with small and compressible results. */
static void write_ops(idem_store *s, int from, int to)
{
    idem_queue *q;
    must(idem_queue_open(s, 8, &q), "queue");
    for (int i = from; i < to; i++) {
        char key[32];
        key_of(i, key);
        idem_claim_args a = {.ttl_ms = 3600000, .lease_ms = 60000, .fp = key, .fp_len = 6};
        idem_completion c;
        switch (i % 8) {
        case 0:
        case 1:
            claim_commit(q, i, 10 + (size_t)i);
            break;
        case 2: /* left in_flight */
            must(idem_claim(q, key, strlen(key), &a, &c), "claim");
            break;
        case 3: /* review */
            must(idem_claim(q, key, strlen(key), &a, &c), "claim");
            must(idem_hold(q, key, strlen(key), c.token, "check by hand", 13), "hold");
            break;
        case 4:
            must(idem_set_if_absent(q, key, strlen(key), "value", 5, 3600000, 0, &c), "set");
            break;
        case 5: /* committed, then deleted */
            claim_commit(q, i, 20);
            must(idem_del(q, key, strlen(key), "fuzz"), "del");
            break;
        case 6: /* a large compressible result, then a repeat and a mismatch */
            claim_commit(q, i, 3000);
            must(idem_claim(q, key, strlen(key), &a, &c), "repeat");
            a.fp = "other";
            a.fp_len = 5;
            must(idem_claim(q, key, strlen(key), &a, &c), "mismatch");
            break;
        default: /* released, then claimed again */
            must(idem_claim(q, key, strlen(key), &a, &c), "claim");
            must(idem_release(q, key, strlen(key), c.token), "release");
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
        idem_claim_args a = {.ttl_ms = 3600000, .lease_ms = 60000};
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
    for (int i = 0; i < images[kind].n; i++) {
        struct fz_file *f = &images[kind].files[i];
        if (strncmp(f->name, "wal-", 4) == 0) {
            uint64_t m = walk_wal(f->p, f->len, 0, 0, 0, 1);
            if (m > image_lsn_max[kind]) image_lsn_max[kind] = m;
        }
    }
    io_sim_destroy(sim);
}

void fz_init(void)
{
    if (ready) return;
    scratch = malloc(FZ_FILE_MAX);
    if (!scratch) die("%s %ld", "malloc", 0);
    for (int k = 0; k < FZ_IMAGES; k++)
        build(k);
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
 * whose checksum holds (any: of every frame with a plausible length). */
static uint64_t walk_wal(uint8_t *p, size_t len, size_t lo, size_t hi, int fix, int any)
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
    walk_wal(p, len, lo, hi, 1, 0);
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

/* ---- One case ---- */

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

/* Every get answers, a new key can be claimed and committed, close succeeds. */
static void exercise(idem_store *s, const char *when)
{
    idem_queue *q;
    int rc = idem_queue_open(s, 8, &q);
    if (rc != IDEM_OK) die("%s: queue_open %ld", when, rc);
    for (int i = 0; i < FZ_KEYS; i++) {
        char key[32];
        idem_completion c;
        key_of(i, key);
        rc = idem_get(q, key, strlen(key), &c);
        /* A record that fails to decode or decompress may answer IDEM_ECORRUPT (W3). */
        if (rc != IDEM_OK && rc != IDEM_ECORRUPT) die("%s: get answers %ld", when, rc);
        if (rc != IDEM_OK) continue;
        if (c.found && (c.record.key_len != strlen(key) || memcmp(c.record.key, key, 6)))
            die("%s: get of a key returns another key's record (%ld)", when, i);
    }
    /* Compaction walks every sealed segment now, before the claim: what it meets (damage it
     * stops at, or a frame it cannot copy) never makes the store fail. */
    rc = idem_compact(s, 200);
    if (rc == IDEM_EFATAL) die("%s: compaction failed the store (%ld)", when, rc);
    char key[32];
    snprintf(key, sizeof key, "fz-new-%s", when);
    idem_claim_args a = {.ttl_ms = 60000, .lease_ms = 1000};
    idem_completion c;
    rc = idem_claim(q, key, strlen(key), &a, &c);
    if (rc == IDEM_OK && c.outcome == IDEM_NEW)
        rc = idem_commit(q, key, strlen(key), c.token, "r", 1);
    if (rc != IDEM_OK && rc != IDEM_EFULL) die("%s: claim or commit of a new key: %ld", when, rc);
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
        exercise(s, "first");
        /* The store accepted the files and wrote to them: it opens again, or reports the
         * damage it met meanwhile (a record reached only now, through the checkpoint, that
         * fails its checksum or does not decode) as corruption, cleanly. */
        rc = store_open_io(FZ_DIR, &o, io_sim_io(sim), 1, &s);
        if (rc != IDEM_OK)
            check_failure(rc, "reopen");
        else
            exercise(s, "second");
    }
    io_sim_destroy(sim);
}
