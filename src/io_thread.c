/*
 * io_thread.c: the fallback backend where io_uring is refused. submit_write and submit_flush
 * only queue requests; io_wait() performs them in submission order on the calling (flusher)
 * thread: each write with one pwrite (a short count is reported as is, the caller continues),
 * then one fdatasync per file for every write with IO_W_FLUSH and every flush of the round
 * (performed after all of the round's writes: a later fdatasync covers more). File-system calls
 * are io_posix.c.
 * Invariants: the queue is a ring of IO_THREAD_QUEUE_MAX requests allocated at create
 * (submit beyond it: -EAGAIN); head <= tail, tail - head <= IO_THREAD_QUEUE_MAX; a round takes
 * requests in submission order, so a flush covers every write submitted before it.
 */
#include "io_posix.h"
#include "util.h"

#include <errno.h>
#include <stdlib.h>

#define IO_THREAD_QUEUE_MAX 1024u

enum io_thread_kind { IO_THREAD_WRITE, IO_THREAD_FLUSH };

struct io_thread_req {
    enum io_thread_kind kind;
    int fd;
    unsigned flags;
    uint64_t off;
    const void *buf;
    size_t len;
    uint64_t user_data;
};

struct io_thread {
    struct io base;
    uint64_t head; /* next request to perform */
    uint64_t tail; /* next free position */
    struct io_thread_req queue[IO_THREAD_QUEUE_MAX];
};

_Static_assert((IO_THREAD_QUEUE_MAX & (IO_THREAD_QUEUE_MAX - 1)) == 0, "power of two");

static struct io_thread *io_thread_of(struct io *io)
{
    return (struct io_thread *)io;
}

static int io_thread_push(struct io_thread *t, const struct io_thread_req *req)
{
    IDEM_ASSERT(t->tail - t->head <= IO_THREAD_QUEUE_MAX);
    if (t->tail - t->head == IO_THREAD_QUEUE_MAX) return -EAGAIN;
    t->queue[t->tail % IO_THREAD_QUEUE_MAX] = *req;
    t->tail++;
    return 0;
}

static int io_thread_submit_write(struct io *io, struct io_file *f, uint64_t off, const void *buf,
                                  size_t len, unsigned flags, uint64_t user_data)
{
    if ((flags & ~IO_W_FLUSH) || off > INT64_MAX || (!buf && len > 0)) return -EINVAL;
    struct io_thread_req req = {
        .kind = IO_THREAD_WRITE,
        .fd = f->fd,
        .flags = flags,
        .off = off,
        .buf = buf,
        .len = len,
        .user_data = user_data,
    };
    return io_thread_push(io_thread_of(io), &req);
}

static int io_thread_submit_flush(struct io *io, struct io_file *f, uint64_t user_data)
{
    struct io_thread_req req = {.kind = IO_THREAD_FLUSH, .fd = f->fd, .user_data = user_data};
    return io_thread_push(io_thread_of(io), &req);
}

static int io_thread_wants_flush(const struct io_thread_req *req)
{
    return req->kind == IO_THREAD_FLUSH || (req->flags & IO_W_FLUSH);
}

static int io_thread_wait(struct io *io, struct io_completion *out, int max, int min)
{
    struct io_thread *t = io_thread_of(io);
    uint64_t queued = t->tail - t->head;
    if (max < 0 || min < 0 || min > max || (uint64_t)min > queued || (max > 0 && !out))
        return -EINVAL;
    int n = 0;
    /* The round: up to max requests, bounded by the queue length. Writes first. */
    while (n < max && t->head + (uint64_t)n != t->tail) {
        const struct io_thread_req *req = &t->queue[(t->head + (uint64_t)n) % IO_THREAD_QUEUE_MAX];
        out[n].user_data = req->user_data;
        out[n].res = req->kind == IO_THREAD_WRITE
                         ? io_posix_pwrite(req->fd, req->off, req->buf, req->len)
                         : 0;
        if ((req->flags & IO_W_FLUSH) && out[n].res > 0 && n + 1 < max &&
            t->head + (uint64_t)n + 1 != t->tail) /* more of the round to come */
            io_posix_start_writeback(req->fd, req->off, (uint64_t)out[n].res);
        n++;
    }
    /* Then one fdatasync per file that a request of the round wants flushed. */
    for (int i = 0; i < n; i++) {
        const struct io_thread_req *req = &t->queue[(t->head + (uint64_t)i) % IO_THREAD_QUEUE_MAX];
        if (!io_thread_wants_flush(req)) continue;
        int done = 0;
        for (int j = 0; j < i && !done; j++) {
            const struct io_thread_req *o =
                &t->queue[(t->head + (uint64_t)j) % IO_THREAD_QUEUE_MAX];
            done = io_thread_wants_flush(o) && o->fd == req->fd;
        }
        if (done) continue;
        int64_t rc = io_posix_datasync(req->fd);
        for (int j = i; j < n && rc < 0; j++) {
            const struct io_thread_req *o =
                &t->queue[(t->head + (uint64_t)j) % IO_THREAD_QUEUE_MAX];
            if (io_thread_wants_flush(o) && o->fd == req->fd && out[j].res >= 0) out[j].res = rc;
        }
    }
    t->head += (uint64_t)n;
    IDEM_ASSERT(n >= min);
    return n;
}

static void io_thread_destroy(struct io *io)
{
    free(io_thread_of(io));
}

static const struct io_ops io_thread_ops = {
    .name = "thread",
    .open = io_posix_open,
    .close = io_posix_close,
    .size = io_posix_size,
    .allocate = io_posix_allocate,
    .reserve = io_posix_reserve,
    .truncate = io_posix_truncate,
    .read = io_posix_read,
    .write_now = io_posix_write_now,
    .data_after = io_posix_data_after,
    .overwrites_in_place = io_posix_overwrites_in_place,
    .map = io_posix_map,
    .unmap = io_posix_unmap,
    .unlink = io_posix_unlink,
    .rename = io_posix_rename,
    .sync_dir = io_posix_sync_dir,
    .list = io_posix_list,
    .drop_cache = io_posix_drop_cache,
    .mkdir = io_posix_mkdir,
    .submit_write = io_thread_submit_write,
    .submit_flush = io_thread_submit_flush,
    .wait = io_thread_wait,
    .destroy = io_thread_destroy,
};

int io_thread_create(struct io **out)
{
    if (!out) return -EINVAL;
    struct io_thread *t = calloc(1, sizeof *t);
    if (!t) return -ENOMEM;
    t->base.ops = &io_thread_ops;
    *out = &t->base;
    return 0;
}
