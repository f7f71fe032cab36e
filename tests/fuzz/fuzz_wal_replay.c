/*
 * fuzz_wal_replay.c: libFuzzer target for log replay (src/wal.c wal_open_segments and
 * wal_recover, src/ops.c ops_replay). A store image (fuzz_store.h) gets fuzz bytes over part of
 * one of its segment files wal-*.log (flags bits 2-7 pick the segment; with the fix-up bit the
 * segment header and every frame the patch touches are re-checksummed with the segment's salt,
 * so frame lengths, types, LSNs, batches and record payloads are fuzzed behind valid checksums),
 * then the store is opened: it fails with IDEM_ECORRUPT/IDEM_EVERSION and a message, or it
 * answers as fz_run requires (no acknowledged record lost or altered unless the patch allows it).
 * Never a crash, a hang or an assertion.
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
    fz_run(img, fz_find(img, "wal-", pt.pick), &pt, FZ_FIX_WAL);
    return 0;
}
