/*
 * io_uring.c: the io_uring backend. Writes and flushes are queued as SQEs and submitted lazily:
 * by io_wait(), or by a submit that finds the SQ full. A write with IO_W_FLUSH is a write SQE
 * linked (IOSQE_IO_LINK) to an IORING_FSYNC_DATASYNC fsync of the same file; both CQEs land in
 * one request slot and the caller sees one completion: the write's count if the fsync succeeded,
 * else the first error. A short write breaks the link (the fsync is cancelled): the fsync is then
 * submitted again on its own, and the short count is reported once it succeeds, so -ECANCELED
 * is never taken for a flush. File-system calls are io_posix.c.
 * Invariants: CQE user_data = slot index << 1 | (1 for the fsync half of a pair); a slot is
 * busy from submit until its completion is handed out; busy slots <= sq entries, each at most
 * two CQEs, so the CQ (2 x sq entries) never overflows.
 */
#include "io_posix.h"
#include "util.h"

#include <errno.h>
#include <liburing.h>
#include <stdlib.h>

/* Largest single write; a longer one completes short and the caller continues. */
#define IOU_WRITE_MAX ((size_t)1 << 30)

enum iou_kind { IOU_WRITE, IOU_FLUSH, IOU_LINKED };

struct iou_slot {
    uint64_t user_data;
    int64_t write_res;
    int64_t flush_res;
    int fd;
    uint8_t kind;
    uint8_t cqes_pending; /* CQEs still to come for this slot */
    uint8_t flush_retried;
};

struct iou {
    struct io base;
    struct io_uring ring;
    uint32_t slots_count;
    uint32_t free_count; /* free_list[0, free_count) are free slot indexes */
    uint32_t *free_list;
    struct iou_slot *slots;
};

static struct iou *iou_of(struct io *io)
{
    return (struct iou *)io;
}

static uint32_t iou_busy(const struct iou *u)
{
    return u->slots_count - u->free_count;
}

/* Returns n free SQEs' worth of room, submitting what is queued if the SQ is full. */
static int iou_sq_reserve(struct iou *u, unsigned n)
{
    if (io_uring_sq_space_left(&u->ring) >= n) return 0;
    int rc;
    do {
        rc = io_uring_submit(&u->ring);
    } while (rc == -EINTR);
    if (rc < 0) return rc;
    return io_uring_sq_space_left(&u->ring) >= n ? 0 : -EAGAIN;
}

static struct io_uring_sqe *iou_sqe_take(struct iou *u)
{
    struct io_uring_sqe *sqe = io_uring_get_sqe(&u->ring);
    IDEM_ASSERT(sqe != NULL); /* iou_sq_reserve made room */
    return sqe;
}

static uint32_t iou_slot_take(struct iou *u, uint8_t kind, int fd, uint64_t user_data)
{
    IDEM_ASSERT(u->free_count > 0);
    uint32_t idx = u->free_list[--u->free_count];
    struct iou_slot *s = &u->slots[idx];
    IDEM_ASSERT(s->cqes_pending == 0);
    s->user_data = user_data;
    s->write_res = 0;
    s->flush_res = 0;
    s->fd = fd;
    s->kind = kind;
    s->cqes_pending = kind == IOU_LINKED ? 2 : 1;
    s->flush_retried = 0;
    return idx;
}

static void iou_slot_put(struct iou *u, uint32_t idx)
{
    IDEM_ASSERT(u->free_count < u->slots_count);
    IDEM_ASSERT(u->slots[idx].cqes_pending == 0);
    u->free_list[u->free_count++] = idx;
}

static void iou_prep_flush(struct io_uring_sqe *sqe, int fd, uint32_t idx)
{
    io_uring_prep_fsync(sqe, fd, IORING_FSYNC_DATASYNC);
    io_uring_sqe_set_data64(sqe, ((uint64_t)idx << 1) | 1u);
}

static int iou_submit_write(struct io *io, struct io_file *f, uint64_t off, const void *buf,
                            size_t len, unsigned flags, uint64_t user_data)
{
    struct iou *u = iou_of(io);
    if ((flags & ~IO_W_FLUSH) || off > INT64_MAX || (!buf && len > 0)) return -EINVAL;
    if (u->free_count == 0) return -EAGAIN;
    const int linked = (flags & IO_W_FLUSH) != 0;
    int rc = iou_sq_reserve(u, linked ? 2 : 1);
    if (rc < 0) return rc;
    if (len > IOU_WRITE_MAX) len = IOU_WRITE_MAX;
    uint32_t idx = iou_slot_take(u, linked ? IOU_LINKED : IOU_WRITE, f->fd, user_data);
    struct io_uring_sqe *sqe = iou_sqe_take(u);
    io_uring_prep_write(sqe, f->fd, buf, (unsigned)len, off);
    io_uring_sqe_set_data64(sqe, (uint64_t)idx << 1);
    if (linked) {
        sqe->flags |= IOSQE_IO_LINK;
        iou_prep_flush(iou_sqe_take(u), f->fd, idx);
    }
    return 0;
}

static int iou_submit_flush(struct io *io, struct io_file *f, uint64_t user_data)
{
    struct iou *u = iou_of(io);
    if (u->free_count == 0) return -EAGAIN;
    int rc = iou_sq_reserve(u, 1);
    if (rc < 0) return rc;
    uint32_t idx = iou_slot_take(u, IOU_FLUSH, f->fd, user_data);
    iou_prep_flush(iou_sqe_take(u), f->fd, idx);
    return 0;
}

/*
 * Settles a slot whose CQEs have all arrived. Returns 1 and *res when the caller's completion
 * is ready, 0 when a cancelled fsync was submitted again (the slot stays busy).
 */
static int iou_slot_settle(struct iou *u, uint32_t idx, int64_t *res)
{
    struct iou_slot *s = &u->slots[idx];
    if (s->kind == IOU_WRITE) {
        *res = s->write_res;
    } else if (s->kind == IOU_FLUSH) {
        *res = s->flush_res;
    } else if (s->write_res < 0) {
        *res = s->write_res;
    } else if (s->flush_res == 0) {
        *res = s->write_res;
    } else if (s->flush_res == -ECANCELED && !s->flush_retried) {
        /* A short write broke the link: the data written still needs its fsync. */
        int rc = iou_sq_reserve(u, 1);
        if (rc == 0) {
            s->flush_retried = 1;
            s->cqes_pending = 1;
            iou_prep_flush(iou_sqe_take(u), s->fd, idx);
            return 0;
        }
        *res = rc;
    } else {
        *res = s->flush_res;
    }
    return 1;
}

/* Accounts one CQE; returns 1 with *c filled when it completes a caller's request. */
static int iou_reap_one(struct iou *u, const struct io_uring_cqe *cqe, struct io_completion *c)
{
    uint64_t tag = io_uring_cqe_get_data64(cqe);
    uint32_t idx = (uint32_t)(tag >> 1);
    IDEM_ASSERT(idx < u->slots_count);
    struct iou_slot *s = &u->slots[idx];
    IDEM_ASSERT(s->cqes_pending > 0);
    if ((tag & 1u) || s->kind == IOU_FLUSH)
        s->flush_res = cqe->res;
    else
        s->write_res = cqe->res;
    if (--s->cqes_pending > 0) return 0;
    int64_t res;
    if (!iou_slot_settle(u, idx, &res)) return 0;
    c->user_data = s->user_data;
    c->res = res;
    iou_slot_put(u, idx);
    return 1;
}

static int iou_submit_queued(struct iou *u)
{
    int rc = 0;
    if (io_uring_sq_ready(&u->ring) == 0) return 0;
    do {
        rc = io_uring_submit(&u->ring);
    } while (rc == -EINTR);
    return rc < 0 ? rc : 0;
}

static int iou_wait(struct io *io, struct io_completion *out, int max, int min)
{
    struct iou *u = iou_of(io);
    if (max < 0 || min < 0 || min > max || (uint32_t)min > iou_busy(u) || (max > 0 && !out))
        return -EINVAL;
    int rc = iou_submit_queued(u);
    if (rc < 0) return rc;
    int n = 0;
    /* Bounded: every round reaps a CQE or blocks for one; busy slots bound the CQEs. */
    while (n < max) {
        struct io_uring_cqe *cqe;
        rc = io_uring_peek_cqe(&u->ring, &cqe);
        if (rc == -EAGAIN) {
            if (n >= min) break;
            rc = io_uring_submit_and_wait(&u->ring, 1);
            if (rc == -EINTR) continue;
            if (rc < 0) return n > 0 ? n : rc;
            continue;
        }
        if (rc < 0) return n > 0 ? n : rc;
        n += iou_reap_one(u, cqe, &out[n]);
        io_uring_cqe_seen(&u->ring, cqe);
    }
    /* A retried fsync queued while reaping must not wait for the next call. */
    rc = iou_submit_queued(u);
    if (rc < 0 && n == 0) return rc;
    return n;
}

static void iou_destroy(struct io *io)
{
    struct iou *u = iou_of(io);
    struct io_completion c;
    /* Drain, so no request still reads a caller's buffer after destroy. */
    while (iou_busy(u) > 0) {
        if (iou_wait(io, &c, 1, 1) < 0) break;
    }
    io_uring_queue_exit(&u->ring);
    free(u->free_list);
    free(u->slots);
    free(u);
}

static const struct io_ops iou_ops = {
    .name = "io_uring",
    .open = io_posix_open,
    .close = io_posix_close,
    .size = io_posix_size,
    .allocate = io_posix_allocate,
    .truncate = io_posix_truncate,
    .read = io_posix_read,
    .write_now = io_posix_write_now,
    .data_after = io_posix_data_after,
    .map = io_posix_map,
    .unmap = io_posix_unmap,
    .unlink = io_posix_unlink,
    .rename = io_posix_rename,
    .sync_dir = io_posix_sync_dir,
    .mkdir = io_posix_mkdir,
    .submit_write = iou_submit_write,
    .submit_flush = iou_submit_flush,
    .wait = iou_wait,
    .destroy = iou_destroy,
};

int io_uring_create(unsigned entries, struct io **out)
{
    if (!out || entries == 0 || entries > 32768) return -EINVAL;
    struct iou *u = calloc(1, sizeof *u);
    if (!u) return -ENOMEM;
    int rc = io_uring_queue_init(entries, &u->ring, 0);
    if (rc < 0) goto out_free;
    u->slots_count = u->ring.sq.ring_entries;
    u->slots = calloc(u->slots_count, sizeof *u->slots);
    u->free_list = calloc(u->slots_count, sizeof *u->free_list);
    if (!u->slots || !u->free_list) {
        rc = -ENOMEM;
        goto out_exit;
    }
    /* Free list popped from the end: slot 0 is taken first. */
    for (uint32_t i = 0; i < u->slots_count; i++)
        u->free_list[i] = u->slots_count - 1 - i;
    u->free_count = u->slots_count;
    u->base.ops = &iou_ops;
    *out = &u->base;
    return 0;

out_exit:
    free(u->free_list);
    free(u->slots);
    io_uring_queue_exit(&u->ring);
out_free:
    free(u);
    return rc;
}
