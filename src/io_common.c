/*
 * io_common.c: io_write_sync and io_flush_sync of io.h, built on the ring calls of any backend.
 * Invariants: they are called by the one submitting thread with nothing else in flight on the
 * ring, so the single completion reaped is their own (asserted by its user_data); a short
 * write is continued from where it stopped, a write that makes no progress is -EIO.
 */
#include "io.h"
#include "util.h"

#include <errno.h>

__thread struct io_fault io_fault_last;

/* user_data of the synchronous helpers' requests. */
#define IO_SYNC_TAG UINT64_C(0x10c0ffee5c)

static int64_t io_sync_complete(struct io *io)
{
    struct io_completion c;
    int n = io_wait(io, &c, 1, 1);
    if (n < 0) return n;
    IDEM_ASSERT(n == 1);
    IDEM_ASSERT(c.user_data == IO_SYNC_TAG);
    return c.res;
}

int io_write_sync(struct io *io, struct io_file *f, uint64_t off, const void *buf, size_t len,
                  int flush)
{
    const unsigned wflags = flush ? IO_W_FLUSH : 0;
    size_t done = 0;
    if (len == 0) return flush ? io_flush_sync(io, f) : 0;
    /* Bounded by len: every round writes at least one byte or returns. */
    while (done < len) {
        int rc = io_submit_write(io, f, off + done, (const char *)buf + done, len - done, wflags,
                                 IO_SYNC_TAG);
        if (rc < 0) return rc;
        int64_t res = io_sync_complete(io);
        if (res < 0) return (int)io_noted(flush ? "write or its fdatasync" : "write", res);
        if (res == 0) return (int)io_noted("write (no progress)", -EIO);
        IDEM_ASSERT((uint64_t)res <= len - done);
        done += (size_t)res;
    }
    return 0;
}

int io_flush_sync(struct io *io, struct io_file *f)
{
    int rc = io_submit_flush(io, f, IO_SYNC_TAG);
    if (rc < 0) return rc;
    int64_t res = io_sync_complete(io);
    return res < 0 ? (int)io_noted("fdatasync", res) : 0;
}

int io_settle(struct io *io, struct io_file *f)
{
    int rc = io_flush_sync(io, f);
    return rc < 0 ? rc : io_drop_cache(io, f);
}
