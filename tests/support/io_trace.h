/*
 * io_trace.h: a recording I/O backend for crash-state tests. It wraps a real backend (io_uring
 * or thread) and forwards every call to it unchanged, recording in one ordered trace every
 * change that can reach the disk: file creates (an open with IO_O_CREATE of a path the trace
 * does not know), writes with their bytes, their completions, flushes and their completions,
 * truncates, allocations, renames, unlinks, mkdirs and directory syncs. Reads and maps pass
 * through unrecorded.
 *
 * Files are numbered (node, from 1) in creation order; the trace keeps its own view of the
 * namespace (path -> node), so it must start on an empty directory whose files are all made
 * through it. A rename moves a node to another path; an unlink removes the path.
 *
 * Event order is the order in which the calls took effect: submits, file-system calls and
 * directory syncs are recorded under the trace's mutex around the inner call; a completion is
 * recorded when io_wait returns it (its reap). Each event has a sequence number (seq, from 1);
 * io_trace_now() is the seq the next event will get, so a test can place its own marks
 * (acknowledgements) between events.
 *
 * Coverage, by the rules of io.h: a flush of a file covers every write to that file whose
 * completion was reaped before the flush was submitted (here: a WRITE_DONE event with a lower
 * seq than the FLUSH event), every earlier truncate and allocate of the file, and, for a write
 * submitted with IO_W_FLUSH, the write itself. It takes effect at its completion (FLUSH_DONE,
 * or the WRITE_DONE of a linked write) if that succeeded. Create, rename and unlink take effect
 * at the end of a sync_dir of their directory (of the destination for a rename) that was called
 * after them.
 *
 * Thread-safe: one mutex per trace. A buffer that changes between a write's submit and its
 * reap is counted (io_trace_buffer_changes): the bytes the disk got are then not known.
 */
#ifndef IDEM_IO_TRACE_H
#define IDEM_IO_TRACE_H

#include <stddef.h>
#include <stdint.h>

#include "io.h"

enum io_trace_kind {
    IO_TRACE_CREATE = 1, /* node, path */
    IO_TRACE_WRITE,      /* node, off, len, data, flags (IO_W_FLUSH) */
    IO_TRACE_WRITE_DONE, /* node, ref (the WRITE), res */
    IO_TRACE_FLUSH,      /* node */
    IO_TRACE_FLUSH_DONE, /* node, ref (the FLUSH), res */
    IO_TRACE_TRUNCATE,   /* node, off = the new length, res */
    IO_TRACE_ALLOCATE,   /* node, [off, off + len), res */
    IO_TRACE_RENAME,     /* node (moved), path (destination), from, res */
    IO_TRACE_UNLINK,     /* node (removed), path, res */
    IO_TRACE_MKDIR,      /* path, res */
    IO_TRACE_SYNC_DIR,   /* path (the directory, without trailing '/'), res; recorded at its
                            return, covering the directory operations recorded before it */
};

struct io_trace_event {
    uint64_t seq;
    enum io_trace_kind kind;
    uint32_t node;
    unsigned flags;
    uint64_t off, len;
    uint64_t ref;
    int64_t res;
    const uint8_t *data;
    const char *path;
    const char *from;
};

struct io_trace;

int io_trace_create(struct io_trace **out);
void io_trace_destroy(struct io_trace *t);
/* A backend handle that forwards to inner and records into t. io_destroy() on it destroys inner
 * and the handle, never the trace; several handles may record into one trace in turn (a store
 * closed and opened again). NULL on ENOMEM (inner is then destroyed). */
struct io *io_trace_wrap(struct io_trace *t, struct io *inner);
/* The seq the next event will get. */
uint64_t io_trace_now(struct io_trace *t);
/* The events recorded so far; valid until the trace is destroyed (no call records meanwhile). */
size_t io_trace_count(const struct io_trace *t);
const struct io_trace_event *io_trace_events(const struct io_trace *t);
/* Writes whose buffer changed between submit and reap (a caller bug). */
uint64_t io_trace_buffer_changes(const struct io_trace *t);

#endif /* IDEM_IO_TRACE_H */
