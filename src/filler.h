/*
 * filler.h: writes zeros over log space the log has not reached yet, on a thread of its own.
 *
 * Segments are allocated with fallocate, which leaves unwritten extents: the first flush into
 * each block of them must also commit the journal that marks it written, and costs about half
 * as much again as a flush into space written before (docs/benchmarks.md, tenth session). The
 * filler writes zeros ahead of the log, durably (O_DSYNC, in pieces through a handle of its own),
 * so that the log's flushes find written space. The content does not change: allocated space
 * reads as zeros before and after, and recovery never trusts a byte without its frame checksum.
 * Only space that io_data_after reports unwritten is filled: a segment filled in an earlier run
 * is passed over, and so is everything on a file system that cannot tell. The store makes no
 * filler where writes over written bytes are not known to stay in place (store.c).
 *
 * The one rule: a piece of zeros never lands on bytes the log has written. The log's writes go
 * up a segment and so do a job's pieces. Before the flusher writes segment seq below end, it
 * calls filler_fence: a job on seq whose next piece starts below end is cancelled, and the
 * fence returns only when that job's piece in progress (if any) has completed. Every piece
 * below a job's position has completed, so a later write of the log there lands after it.
 * A failed zero write is an I/O error like any other: filler_error reports it, and the store
 * stops (nothing acknowledged depends on the space, but the disk is failing).
 */
#ifndef IDEM_FILLER_H
#define IDEM_FILLER_H

#include <stdint.h>

struct io;
struct filler;

/* Zeros are written in pieces of this size: the longest a fence waits is one piece's write. */
#define FILLER_PIECE (1u << 20)
/* A log that fills segments faster than this (bytes a second) gets no more spares filled
 * (wal.c seg_roll): its flushes are large, and the zeros would cost it disk bandwidth. */
#define FILLER_RATE_MAX (64u << 20)

int filler_create(struct io *io, struct filler **out);
/* Cancels the jobs, waits for the piece in progress, and frees the filler. Returns the first
 * failed write (-errno, as filler_error), that piece's too, or 0. */
int filler_destroy(struct filler *fl);
/* Queues zero-filling [from, to) of the file at path, which holds log segment seq (from and
 * to multiples of 4 KiB). Jobs run in the order queued; a full queue drops the job (returns
 * IDEM_EBUSY: it only costs speed). */
int filler_add(struct filler *fl, uint64_t seq, const char *path, uint64_t from, uint64_t to);
/* Before the log writes segment seq anywhere below end (see the rule above). */
void filler_fence(struct filler *fl, uint64_t seq, uint64_t end);
/* The first error a zero write met (-errno), or 0. */
int filler_error(struct filler *fl);
/* Fences that waited for a piece in progress (for tests). */
uint64_t filler_fence_waits(struct filler *fl);
/* Whether no job is queued or running (for tests). */
int filler_idle(struct filler *fl);

#endif /* IDEM_FILLER_H */
