/*
 * io_sim.h: a simulated disk for tests, deterministic from a seed (io_sim.c). Files live in
 * memory keyed by their full path string; the directory of a path is the part before its last
 * '/'. Each file has a current content (what reads and maps see: every reaped write) and a
 * durable content (what survives io_sim_crash). submit only queues; io_wait() performs the
 * queued requests in order, and that is where injected faults show up as completion results.
 * A flush makes durable every write to its file reaped before the flush was submitted, the
 * write it is linked to, and (as a page cache would) any older unsynced write overlapping those.
 * Files opened with IO_O_DIRECT require 4 KiB aligned buffers, offsets and lengths (else the
 * write completes with -EINVAL), so callers that rely on buffered fallback are caught.
 * Maps are private buffers of the mapped length, kept equal to the current content (bytes past
 * the end of the file read as zero) and stable until unmap, however the file grows.
 * Directories are implicit: mkdir only records a name (durable at once) for -EEXIST.
 * Thread-safe: one mutex per simulated disk.
 */
#ifndef IDEM_IO_SIM_H
#define IDEM_IO_SIM_H

#include "io.h"

#include <stddef.h>
#include <stdint.h>

struct io_sim;
int io_sim_create(uint64_t seed, struct io_sim **out);
void io_sim_destroy(struct io_sim *sim);
/* A new backend handle on the simulated disk; io_destroy() on it frees only the handle.
 * After io_sim_crash, files opened through older handles must not be used (calls on them fail
 * with -EIO); open the store again through a new handle. */
struct io *io_sim_io(struct io_sim *sim);
/* Power loss. Every write not yet covered by a flush of its file is, independently at random
 * (from the seed): lost, kept whole, or (IO_SIM_CRASH_TEAR) kept only in part, a random prefix of
 * its 512-byte sectors; with IO_SIM_CRASH_FLIP a kept unsynced write may also get a random bit
 * flipped. IO_SIM_CRASH_LOSE_ALL loses every unsynced write. Creates, renames and unlinks not yet
 * covered by sync_dir of their directory are each kept or undone at random (in order:
 * a later one is kept only if the earlier ones of that directory are).
 * IO_SIM_CRASH_UNDO_DIR undoes every create, rename and unlink not covered by a sync_dir.
 * Unsynced size changes (truncate, allocate) are kept or lost like writes, never torn. A rename
 * belongs to the directory of its destination. Requests queued and not yet reaped are dropped. */
#define IO_SIM_CRASH_TEAR     0x1u
#define IO_SIM_CRASH_FLIP     0x2u
#define IO_SIM_CRASH_LOSE_ALL 0x4u
#define IO_SIM_CRASH_UNDO_DIR 0x8u
void io_sim_crash(struct io_sim *sim, unsigned flags);
/* Faults, counted from the call: the nth (1-based) later write or flush completes with err (a
 * negative errno), a short write completes with about half its bytes written. A failed write
 * changes nothing; a failed flush makes nothing durable; the flush linked to a failed write is
 * not performed. One pending fault of each kind: a later call replaces an earlier one. */
void io_sim_fail_write(struct io_sim *sim, uint64_t nth, int err);
void io_sim_fail_flush(struct io_sim *sim, uint64_t nth, int err);
void io_sim_short_write(struct io_sim *sim, uint64_t nth);
/* The nth (1-based) later write submitted is refused by the submit itself with err (a negative
 * errno), as when the kernel's queue is full: nothing is queued. */
void io_sim_fail_submit(struct io_sim *sim, uint64_t nth, int err);
/* The next open that creates a file whose path ends with suffix fails with err (a negative
 * errno) and creates nothing; NULL disarms it. */
void io_sim_fail_create(struct io_sim *sim, const char *suffix, int err);
/* The next open of any file, there or not, whose path ends with suffix fails with err (a
 * negative errno, such as -EMFILE); NULL disarms it. */
void io_sim_fail_open(struct io_sim *sim, const char *suffix, int err);
/* The first flush of the next file opened whose path ends with suffix fails with err (a
 * negative errno) and makes nothing durable: a fault for one file, whatever other files the
 * flushes between reach; NULL disarms it. */
void io_sim_fail_flush_of(struct io_sim *sim, const char *suffix, int err);
/* Every read of the file at path fails with err (a negative errno) until disarmed (NULL).
 * Returns 0, or -ENOENT if no file is at path. */
int io_sim_fail_reads(struct io_sim *sim, const char *path, int err);
/* While err is nonzero (a negative errno), every allocate fails with it, over space the file
 * already holds too, as XFS and btrfs may on a full disk (they reserve the whole range first);
 * 0 disarms it. */
void io_sim_fail_allocate(struct io_sim *sim, int err);
/* The next sync_dir fails with err (a negative errno, such as -ENOSPC, as btrfs may answer when
 * its commit finds no metadata space) and makes nothing durable; 0 disarms it. */
void io_sim_fail_sync_dir(struct io_sim *sim, int err);
/* Total bytes the disk holds; allocate or a write that grows the files past it: -ENOSPC. 0: no
 * limit. */
void io_sim_set_capacity(struct io_sim *sim, uint64_t bytes);
struct io_sim_counts {
    uint64_t writes, flushes, bytes_written, dir_syncs;
    uint64_t writes_now;         /* write_now calls done (not in writes) */
    uint64_t writes_now_waiting; /* write_now calls blocked by io_sim_hold_writes_now */
    uint64_t data_after_waiting; /* data_after answers held by io_sim_hold_data_after */
    uint64_t used;               /* bytes the files hold now (what the capacity bounds) */
    uint64_t submits;            /* writes submitted (queued or refused) */
    uint64_t abandoned;          /* writes still queued when a live handle was destroyed: their
                                  * buffers could have been freed while the kernel read them */
};
void io_sim_counts(const struct io_sim *sim, struct io_sim_counts *out);
/* Flips bits (xor_mask) of the byte at off of the file's content (durable and current); for
 * corruption tests. Returns 0 or -ENOENT/-EINVAL. */
int io_sim_corrupt(struct io_sim *sim, const char *path, uint64_t off, uint8_t xor_mask);
/* Reads a file's current content (for tests); returns bytes or -ENOENT. */
int64_t io_sim_read_file(struct io_sim *sim, const char *path, void *buf, size_t len);

/* While hold is nonzero, completions are not delivered (waits block): a flush that has been
 * submitted but has not finished, for tests of what may be answered meanwhile. */
void io_sim_hold(struct io_sim *sim, int hold);
/* While hold is nonzero, unlinks block: a delete the kernel takes long over, for tests of who
 * waits for it. */
void io_sim_hold_unlinks(struct io_sim *sim, int hold);
/* While hold is nonzero, write_now calls block before they write: a slow write outside the
 * ring, for tests of who waits for it and what it may overwrite. */
void io_sim_hold_writes_now(struct io_sim *sim, int hold);
/* While hold is nonzero, data_after calls wait after they have looked, before they answer: an
 * answer that is stale by the time it is used. */
void io_sim_hold_data_after(struct io_sim *sim, int hold);
/* While on is nonzero, overwrites_in_place answers 0, as on a copy-on-write file system. */
void io_sim_copy_on_write(struct io_sim *sim, int on);
/* While err is nonzero (a negative errno), every write_now fails with it. */
void io_sim_fail_writes_now(struct io_sim *sim, int err);

#endif /* IDEM_IO_SIM_H */
