/*
 * fuzz_store.h: what the file targets (fuzz_wal_replay, fuzz_checkpoint, fuzz_superblock) share:
 * store images built once through the API on the simulated disk (with what each must answer),
 * the decoding of a patch from the fuzz input, checksum fix-ups, and the run of one case (restore
 * the image on a fresh simulated disk, corrupt one file with io_sim_corrupt, open, check the
 * answers against the image).
 *
 * Input layout of every file target:
 *   0     image (mod FZ_IMAGES)
 *   1     flags: bit 0 overwrite (else xor), bit 1 fix checksums after patching,
 *                bits 2-7 which file of the kind (segment index, superblock copy, ...)
 *   2..5  u32 little-endian offset (mod the file's length)
 *   6..   patch bytes (at most FZ_PATCH_MAX)
 */
#ifndef IDEM_FUZZ_STORE_H
#define IDEM_FUZZ_STORE_H

#include <stddef.h>
#include <stdint.h>

#define FZ_DIR       "/sim/fz"
#define FZ_FILES_MAX 64
#define FZ_PATCH_MAX 8192u

enum fz_image_kind {
    FZ_IMG_CLEAN = 0,  /* closed: checkpoint at the end, nothing to replay */
    FZ_IMG_REPLAY = 1, /* checkpoint half-way, more batches, abandoned: replay from it */
    FZ_IMG_TORN = 2,   /* as REPLAY, then a batch written but never flushed, torn by a crash */
    FZ_IMG_NOCKPT = 3, /* several segments, no checkpoint, abandoned: replay from the start */
    FZ_IMAGES = 4,
};

struct fz_file {
    char path[96]; /* full simulated path */
    char name[48]; /* base name */
    uint8_t *p;
    size_t len;
};

struct fz_image {
    struct fz_file files[FZ_FILES_MAX];
    int n;
};

struct fz_patch {
    int image;
    int overwrite;
    int fix;
    unsigned pick;
    uint32_t off;
    const uint8_t *bytes;
    size_t n;
};

#define FZ_FIX_NONE  0
#define FZ_FIX_SUPER 1
#define FZ_FIX_CKPT  2
#define FZ_FIX_WAL   3

/* Builds the images (once; later calls return at once). */
void fz_init(void);
const struct fz_image *fz_image(int kind);
/* The pick-th (modulo their count) file of img whose name starts with prefix; NULL if none. */
const struct fz_file *fz_find(const struct fz_image *img, const char *prefix, unsigned pick);
/* Decodes the input header. Returns 0, or -1 if the input is too short. */
int fz_decode(const uint8_t *data, size_t size, struct fz_patch *pt);
/*
 * Applies the patch to a copy of file f (fix-ups of kind `fix` when pt->fix), restores img on a
 * fresh simulated disk, writes the differences with io_sim_corrupt, and checks: the open fails
 * with IDEM_ECORRUPT or IDEM_EVERSION and a message, or the store answers as the image and the
 * patch allow (fuzz_store.c, "Judging a patch"). Each key of the image reads as the unpatched
 * image does; or, where the patch may have cut the log, as one of its earlier versions or absent;
 * or anything, where the patch rewrote a frame or entry naming it behind a valid checksum (a read
 * may always answer IDEM_ECORRUPT). A fresh key, and each key read absent, is claimed new with a
 * token above every token handed out before; each key read committed answers done with its
 * result (mismatch if it holds another fingerprint). Compaction and close succeed; the store
 * opens again (or reports corruption) and reads every key as the first open last read it. Aborts
 * with the key and the field otherwise.
 */
void fz_run(const struct fz_image *img, const struct fz_file *f, const struct fz_patch *pt,
            int fix);

#endif
