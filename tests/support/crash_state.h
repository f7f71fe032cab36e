/*
 * crash_state.h: crash states of a recorded trace (io_trace.h), rebuilt as real directories.
 *
 * A walk goes through the trace's persistence points in order. A persistence point is an event
 * after which more is guaranteed durable: the successful completion of a flush, of a write
 * linked to a flush, or the return of a successful sync_dir. The walk stops just before each
 * such event takes effect (and once more after the last event): a crash at that moment leaves
 *   - the durable state: every write, truncate and allocate covered by a flush that completed
 *     before (io.h's rule: writes reaped before the flush was submitted, and its linked write),
 *     applied in the order they were issued, and the namespace made by every create, rename and
 *     unlink of the store directory that a completed sync_dir covered;
 *   - plus any subset of the unsynced changes: the writes, truncates and allocates issued before
 *     that moment and not yet durable (numbered 0..n-1 in issue order), a write possibly torn
 *     to a prefix of its 512-byte sectors, and a prefix of the pending directory operations.
 * The directory of the store must have existed before the trace started, or its mkdir is a
 * directory operation of its parent (durable only after a sync_dir of the parent).
 */
#ifndef IDEM_CRASH_STATE_H
#define IDEM_CRASH_STATE_H

#include <stddef.h>
#include <stdint.h>

#include "io_trace.h"

struct cs_walk;

/* A walk over events[0, count) (io_trace_events) of a store kept in store_dir (the path the
 * traced store was opened with). 0 or -errno (-EINVAL: a path outside store_dir). */
int cs_walk_create(const struct io_trace_event *events, size_t count, const char *store_dir,
                   struct cs_walk **out);
void cs_walk_destroy(struct cs_walk *w);
/* Moves to the next crash point: 1 and *seq (the seq of the persistence event about to take
 * effect; count + 1 for the end of the trace), or 0 when the trace is done. */
int cs_walk_next(struct cs_walk *w, uint64_t *seq);
/* At the current point: the number of unsynced changes, and of pending directory operations. */
size_t cs_walk_unsynced(const struct cs_walk *w);
size_t cs_walk_dir_ops(const struct cs_walk *w);
/* Whether unsynced change i is a write (only writes can be torn), and its length in bytes. */
int cs_walk_is_write(const struct cs_walk *w, size_t i, uint64_t *len);

struct cs_select {
    const uint8_t *keep; /* keep[i] != 0: unsynced change i reached the disk (NULL: none) */
    size_t dir_ops;      /* the first dir_ops pending directory operations took effect */
    int64_t torn;        /* an unsynced write kept only in part, or -1 */
    uint64_t torn_bytes; /* its bytes that reached the disk (a multiple of 512, below its length) */
};

/* Writes the crash state sel of the current point into dir (created if needed; everything in
 * it is replaced; it is removed when the state holds no store directory). 0 or -errno. */
int cs_walk_build(struct cs_walk *w, const struct cs_select *sel, const char *dir);

#endif /* IDEM_CRASH_STATE_H */
