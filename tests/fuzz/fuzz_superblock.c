/*
 * fuzz_superblock.c: libFuzzer target for the superblock (src/super.c super_load, and what
 * src/store.c and src/wal.c do with its fields: log start, checkpoint position, segment size,
 * token reservation, store clock). A store image (fuzz_store.h) gets fuzz bytes over part of its
 * two 4 KiB copies in `super`; with the fix-up bit both copies are re-checksummed, so every field
 * is fuzzed behind a valid checksum. Then the store is opened: it fails with
 * IDEM_ECORRUPT/IDEM_EVERSION and a message, or it answers as fz_run requires.
 */
#include <stddef.h>
#include <stdint.h>

#include "fuzz_store.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    struct fz_patch pt;
    fz_init();
    if (fz_decode(data, size, &pt) < 0) return 0;
    const struct fz_image *img = fz_image(pt.image);
    fz_run(img, fz_find(img, "super", 0), &pt, FZ_FIX_SUPER);
    return 0;
}
