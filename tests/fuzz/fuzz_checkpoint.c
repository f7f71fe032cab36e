/*
 * fuzz_checkpoint.c: libFuzzer target for checkpoint loading (src/super.c ckpt_load, src/store.c
 * ckpt_entry_load, the index inserts it makes). A store image (fuzz_store.h) gets fuzz bytes
 * over part of its index-*.ckpt file; with the fix-up bit the header checksum, every chunk's
 * entry count and checksum, and the trailer's counts and checksum are recomputed (fix_ckpt), so
 * entries (addresses, hash bits, flags, repeat counters) and the chunk structure are fuzzed
 * behind valid checksums. Then the store is opened: it fails with IDEM_ECORRUPT/IDEM_EVERSION and a
 * message, or it answers as fz_run requires. Images without a checkpoint (the
 * no-checkpoint one) fall back to the clean image.
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
    const struct fz_file *f = fz_find(img, "index-", pt.pick);
    if (!f) {
        img = fz_image(FZ_IMG_CLEAN);
        f = fz_find(img, "index-", pt.pick);
    }
    fz_run(img, f, &pt, FZ_FIX_CKPT);
    return 0;
}
