/*
 * io_uring.c: the io_uring backend. Writes are queued as SQEs and submitted lazily: by io_wait(),
 * or by a submit that finds the SQ full. Flushes are not ring requests: an fsync SQE always runs
 * on an io-wq worker, and the hop there and back cost 80-90 us per flush on this machine (a
 * durable 4 KiB append: 235-274 us at the median against 150 us for pwrite + fdatasync on one
 * thread; docs/benchmarks.md, eleventh session). So io_wait() performs them itself, with
 * fdatasync, once every write in flight that asked for one (IO_W_FLUSH) has completed: one
 * fdatasync per file covers all of them, and each such write is reported with its count (short
 * or not) only if that fdatasync succeeded, else with its error. A flush request (submit_flush)
 * joins the next round of fdatasyncs. Writes of up to IOU_INLINE_MAX are not ring requests
 * either: the submitting thread makes them with pwrite, and they complete like a reaped CQE.
 * File-system calls are io_posix.c. A submit the kernel refuses for a moment (EAGAIN, EBUSY)
 * is tried again for up to 2 s (iou_enter): it consumed no SQE, so nothing is written twice.
 * One refused for good kills the ring (iou_die): a failed wait is told only once the writes the
 * kernel took have completed, since the caller then frees their buffers (iou_settle_dead).
 * Invariants: CQE user_data = slot index; a slot is busy from submit until its completion is
 * handed out; busy slots <= sq entries, each at most one CQE, so the CQ (2 x sq entries) never
 * overflows. A busy slot is in exactly one of: in flight (cqes_pending), due (awaiting the next
 * fdatasync round: due[0, ndue)), ready (res set: ready[0, nready)).
 */
#include "io_posix.h"
#include "util.h"

#include <errno.h>
#include <fcntl.h>
#include <liburing.h>
#include <stdlib.h>
#include <time.h>
#include <unistd.h>

/* Largest single write; a longer one completes short and the caller continues. */
#define IOU_WRITE_MAX ((size_t)1 << 30)
/* Writes up to this size are made with pwrite by the submitting thread, not queued: a buffered
 * write to ext4 is always handed to an io-wq worker, and for the few KiB of a small batch the
 * hop there and back (a wake, two context switches) costs more than the copy itself. */
#define IOU_INLINE_MAX ((size_t)64 << 10)

struct iou_slot {
    uint64_t user_data;
    int64_t res;
    uint64_t off; /* the write's offset (its length is res) */
    int fd;
    uint8_t flush; /* a flush follows: the write's (IO_W_FLUSH), or the request itself */
    uint8_t cqes_pending;
};

struct iou {
    struct io base;
    struct io_uring ring;
    uint32_t slots_count;
    uint32_t free_count; /* free_list[0, free_count) are free slot indexes */
    uint32_t *free_list;
    struct iou_slot *slots;
    uint32_t *due, *ready; /* slot indexes, slots_count each */
    uint32_t ndue, nready;
    uint32_t flush_writes_inflight; /* IO_W_FLUSH writes whose CQE has not come */
    uint32_t cqes_inflight;         /* ring writes whose CQE has not come (taken or queued) */
    int refuse_err;                 /* tests: the next refuse_count submits fail with this, */
    uint32_t refuse_count;          /* the kernel not entered (io_uring_test_refuse) */
    /* A submit failed for good (iou_enter): its writes were answered with this error, so none
     * may run later from a buffer the caller freed or to a descriptor reused since. Every SQE
     * the kernel had not taken became a no-op, the writes it had taken are waited for before
     * the failure is told (iou_settle_dead), flushes due are not made (their files may be closed by
     * then), and new requests are refused with it. The first such error is kept. */
    int dead;
    time_t settle_until; /* CLOCK_MONOTONIC seconds: iou_settle_dead waits no longer, in all */
};

static struct iou *iou_of(struct io *io)
{
    return (struct iou *)io;
}

static uint32_t iou_busy(const struct iou *u)
{
    return u->slots_count - u->free_count;
}

static void iou_reap_one(struct iou *u, const struct io_uring_cqe *cqe);

/* How long, in all, the writes the kernel took are waited for once the ring died. */
#define IOU_SETTLE_S 30

/* After a submit failed for good: every SQE queued and not yet taken by the kernel becomes a
 * no-op with the same user_data (its completion then reads no buffer and writes no file), and
 * the backend refuses new requests with err. */
static void iou_die(struct iou *u, int err)
{
    struct io_uring_sq *sq = &u->ring.sq;
    unsigned head = io_uring_smp_load_acquire(sq->khead), tail = *sq->ktail;
    for (unsigned k = head; k != tail; k++) { /* published to the kernel, not yet taken */
        struct io_uring_sqe *sqe = &sq->sqes[sq->array[k & sq->ring_mask]];
        uint64_t ud = sqe->user_data;
        io_uring_prep_nop(sqe);
        sqe->user_data = ud;
    }
    for (unsigned k = sq->sqe_head; k != sq->sqe_tail; k++) { /* not yet published */
        struct io_uring_sqe *sqe = &sq->sqes[k & sq->ring_mask];
        uint64_t ud = sqe->user_data;
        io_uring_prep_nop(sqe);
        sqe->user_data = ud;
    }
    if (!u->dead) {
        struct timespec now;
        clock_gettime(CLOCK_MONOTONIC, &now);
        u->dead = err;
        u->settle_until = now.tv_sec + IOU_SETTLE_S;
    }
}

/* Accounts every CQE there is; returns how many. */
static int iou_reap_all(struct iou *u)
{
    struct io_uring_cqe *cqe;
    int n = 0;
    for (; io_uring_peek_cqe(&u->ring, &cqe) == 0; n++) {
        iou_reap_one(u, cqe);
        io_uring_cqe_seen(&u->ring, cqe);
    }
    return n;
}

/*
 * io_uring_submit, or io_uring_submit_and_wait for wait_nr CQEs, through the kernel's transient
 * refusals: EINTR at once; EAGAIN (no memory for a request just now) and EBUSY (completions to
 * reap first) after reaping and a pause, for about IOU_REFUSED_MS in all. A refused submit
 * consumed no SQE, so trying again writes nothing twice: it is not the retry of a failed write,
 * which stays fatal (the WAL rule). Returns what the submit returned, or the refusal that lasted.
 */
#define IOU_REFUSED_MS 2000
static int iou_enter(struct iou *u, unsigned wait_nr)
{
    for (int64_t waited_us = 0, pause_us = 50;;) {
        int rc;
        uint32_t refusals = __atomic_load_n(&u->refuse_count, __ATOMIC_ACQUIRE);
        if (refusals > 0) { /* atomic: a test's other thread watches it */
            __atomic_store_n(&u->refuse_count, refusals - 1, __ATOMIC_RELEASE);
            rc = u->refuse_err;
        } else {
            rc = wait_nr ? io_uring_submit_and_wait(&u->ring, wait_nr) : io_uring_submit(&u->ring);
        }
        if (rc == -EINTR) continue;
        if (rc < 0 && ((rc != -EAGAIN && rc != -EBUSY) || waited_us >= IOU_REFUSED_MS * 1000)) {
            iou_die(u, rc);
            return rc;
        }
        if (rc >= 0) return rc;
        if (iou_reap_all(u) > 0 && wait_nr) return 0; /* what the wait was for came */
        struct timespec ts = {0, (long)pause_us * 1000};
        nanosleep(&ts, NULL);
        waited_us += pause_us;
        if (pause_us < 10000) pause_us *= 2;
    }
}

/* Returns with room for one SQE, submitting what is queued if the SQ is full. */
static int iou_sq_reserve(struct iou *u)
{
    if (io_uring_sq_space_left(&u->ring) >= 1) return 0;
    int rc = iou_enter(u, 0);
    if (rc < 0) return rc;
    return io_uring_sq_space_left(&u->ring) >= 1 ? 0 : -EAGAIN;
}

static uint32_t iou_slot_take(struct iou *u, int fd, int flush, uint64_t user_data)
{
    IDEM_ASSERT(u->free_count > 0);
    uint32_t idx = u->free_list[--u->free_count];
    struct iou_slot *s = &u->slots[idx];
    IDEM_ASSERT(s->cqes_pending == 0);
    *s = (struct iou_slot){.user_data = user_data, .fd = fd, .flush = (uint8_t)flush};
    return idx;
}

static void iou_account(struct iou *u, uint32_t idx, int64_t res);

static int iou_submit_write(struct io *io, struct io_file *f, uint64_t off, const void *buf,
                            size_t len, unsigned flags, uint64_t user_data)
{
    struct iou *u = iou_of(io);
    if ((flags & ~IO_W_FLUSH) || off > INT64_MAX || (!buf && len > 0)) return -EINVAL;
    if (u->dead) return u->dead;
    if (u->free_count == 0) return -EAGAIN;
    const int flush = (flags & IO_W_FLUSH) != 0;
    if (len <= IOU_INLINE_MAX) {
        uint32_t idx = iou_slot_take(u, f->fd, flush, user_data);
        u->slots[idx].off = off;
        iou_account(u, idx, io_posix_pwrite(f->fd, off, buf, len));
        return 0;
    }
    int rc = iou_sq_reserve(u);
    if (rc < 0) return rc;
    if (len > IOU_WRITE_MAX) len = IOU_WRITE_MAX;
    uint32_t idx = iou_slot_take(u, f->fd, flush, user_data);
    u->slots[idx].cqes_pending = 1;
    u->slots[idx].off = off;
    u->cqes_inflight++;
    u->flush_writes_inflight += (uint32_t)flush;
    struct io_uring_sqe *sqe = io_uring_get_sqe(&u->ring);
    IDEM_ASSERT(sqe != NULL); /* iou_sq_reserve made room */
    io_uring_prep_write(sqe, f->fd, buf, (unsigned)len, off);
    io_uring_sqe_set_data64(sqe, idx);
    return 0;
}

static int iou_submit_flush(struct io *io, struct io_file *f, uint64_t user_data)
{
    struct iou *u = iou_of(io);
    if (u->dead) return u->dead;
    if (u->free_count == 0) return -EAGAIN;
    u->due[u->ndue++] = iou_slot_take(u, f->fd, 1, user_data);
    return 0;
}

/* A write's result: ready, or due when a flush must follow. */
static void iou_account(struct iou *u, uint32_t idx, int64_t res)
{
    struct iou_slot *s = &u->slots[idx];
    s->res = res;
    if (s->flush && s->res >= 0) {
        if (u->flush_writes_inflight > 0) /* more of the batch to come */
            io_posix_start_writeback(s->fd, s->off, (uint64_t)s->res);
        u->due[u->ndue++] = idx;
    } else {
        u->ready[u->nready++] = idx;
    }
}

/* Accounts one CQE. */
static void iou_reap_one(struct iou *u, const struct io_uring_cqe *cqe)
{
    uint32_t idx = (uint32_t)io_uring_cqe_get_data64(cqe);
    IDEM_ASSERT(idx < u->slots_count);
    struct iou_slot *s = &u->slots[idx];
    IDEM_ASSERT(s->cqes_pending == 1);
    s->cqes_pending = 0;
    u->cqes_inflight--;
    if (s->flush) u->flush_writes_inflight--;
    /* After iou_die a write may complete as the no-op it became: never as a success. */
    iou_account(u, idx, u->dead && cqe->res >= 0 ? u->dead : cqe->res);
}

/* One fdatasync per file among the due slots; each becomes ready with its write's count (or 0
 * for a flush request) if its file's fdatasync succeeded, else with that error. On a dead ring
 * none is made: each becomes ready with the ring's error. */
static void iou_flush_due(struct iou *u)
{
    for (uint32_t i = 0; i < u->ndue; i++) {
        struct iou_slot *s = &u->slots[u->due[i]];
        int done = 0;
        if (u->dead) {
            s->res = u->dead;
            continue;
        }
        for (uint32_t j = 0; j < i && !done; j++)
            done = u->slots[u->due[j]].fd == s->fd;
        if (done) continue;
        int64_t err = io_posix_datasync(s->fd);
        for (uint32_t j = i; j < u->ndue; j++) {
            struct iou_slot *t = &u->slots[u->due[j]];
            if (t->fd == s->fd && err < 0) t->res = err;
        }
    }
    for (uint32_t i = 0; i < u->ndue; i++)
        u->ready[u->nready++] = u->due[i];
    u->ndue = 0;
}

/* A wait that failed for good (the ring is dead): before the caller is told, and frees the
 * buffers or closes the files of its writes, the writes the kernel took are waited for (a wait
 * submits nothing: the no-ops still queued stay queued). Their completions are handed out by
 * later waits, with the ring's error. The waits are bounded, IOU_SETTLE_S from the ring's death
 * in all (a device that hangs must not keep a failed store from saying so); with EXT_ARG
 * (Linux 5.11) the timed wait submits nothing. Should it be refused or run out, those
 * writes may read their buffers after the caller freed them: what they write lands past every
 * durable mark, in files already failed, where checksums reject it (a kernel request holds its
 * file, so a descriptor reused meanwhile is not written). */
static void iou_settle_dead(struct iou *u)
{
    IDEM_ASSERT(u->dead);
    struct timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now);
    while (u->cqes_inflight > io_uring_sq_ready(&u->ring) && now.tv_sec < u->settle_until) {
        struct io_uring_cqe *cqe;
        struct __kernel_timespec left = {.tv_sec = u->settle_until - now.tv_sec};
        int rc = io_uring_wait_cqe_timeout(&u->ring, &cqe, &left);
        clock_gettime(CLOCK_MONOTONIC, &now);
        if (rc == -EINTR) continue;
        if (rc < 0) break; /* refused, or the time ran out (-ETIME) */
        iou_reap_all(u);
    }
}

static int iou_submit_queued(struct iou *u)
{
    if (io_uring_sq_ready(&u->ring) == 0) return 0;
    int rc = iou_enter(u, 0);
    return rc < 0 ? rc : 0;
}

static int iou_wait(struct io *io, struct io_completion *out, int max, int min)
{
    struct iou *u = iou_of(io);
    if (max < 0 || min < 0 || min > max || (uint32_t)min > iou_busy(u) || (max > 0 && !out))
        return -EINVAL;
    int rc = iou_submit_queued(u);
    if (rc < 0) {
        iou_settle_dead(u);
        return rc;
    }
    int n = 0;
    /* Bounded: every round hands out, reaps, flushes, or blocks for a CQE; busy slots bound
     * the CQEs and the flushes. */
    for (;;) {
        while (n < max && u->nready > 0) {
            uint32_t idx = u->ready[--u->nready];
            out[n].user_data = u->slots[idx].user_data;
            out[n].res = u->slots[idx].res;
            u->free_list[u->free_count++] = idx;
            n++;
        }
        if (n >= max) break;
        int reaped = iou_reap_all(u) > 0;
        /* The writes that asked for a flush complete first, so one fdatasync covers them. */
        if (u->ndue > 0 && u->flush_writes_inflight == 0) {
            iou_flush_due(u);
            continue;
        }
        if (reaped || u->nready > 0) continue;
        if (n >= min) break;
        rc = iou_enter(u, 1);
        if (rc < 0) {
            iou_settle_dead(u);
            return n > 0 ? n : rc;
        }
    }
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
    free(u->due);
    free(u->ready);
    free(u);
}

static const struct io_ops iou_ops = {
    .name = "io_uring",
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
    .submit_write = iou_submit_write,
    .submit_flush = iou_submit_flush,
    .wait = iou_wait,
    .destroy = iou_destroy,
};

/* Writes one byte into a pipe of its own through the ring (no file of the system's needed, as
 * /dev/null in a bare chroot): 0 once it went round whole, else why not. */
static int iou_probe_write(struct iou *u)
{
    static const char byte = 0;
    int fds[2];
    if (pipe2(fds, O_CLOEXEC) < 0) return -errno;
    struct io_uring_sqe *sqe = io_uring_get_sqe(&u->ring);
    struct io_uring_cqe *cqe;
    int rc = -EAGAIN;
    if (sqe) {
        io_uring_prep_write(sqe, fds[1], &byte, 1, 0);
        rc = io_uring_submit_and_wait(&u->ring, 1);
        if (rc >= 0) rc = io_uring_peek_cqe(&u->ring, &cqe);
        if (rc == 0) {
            rc = cqe->res == 1 ? 0 : cqe->res < 0 ? cqe->res : -EIO;
            io_uring_cqe_seen(&u->ring, cqe);
        }
    }
    close(fds[0]);
    close(fds[1]);
    return rc;
}

int io_uring_create(unsigned entries, struct io **out)
{
    if (!out || entries == 0 || entries > 32768) return -EINVAL;
    struct iou *u = calloc(1, sizeof *u);
    if (!u) return -ENOMEM;
    int rc = io_uring_queue_init(entries, &u->ring, 0);
    if (rc < 0) goto out_free;
    /* A ring may be made where entering it is refused (a seccomp or LSM policy that lets
     * io_uring_setup through), or take requests but not writes (IORING_OP_WRITE came in Linux
     * 5.6; a ring restricted to some opcodes, a sandbox's partial io_uring): one real write must
     * go round, or the caller falls back to the thread backend now, not fails the store at the
     * first write too large to make directly. */
    rc = iou_probe_write(u);
    if (rc < 0) goto out_ring;
    u->slots_count = u->ring.sq.ring_entries;
    u->slots = calloc(u->slots_count, sizeof *u->slots);
    u->free_list = calloc(u->slots_count, sizeof *u->free_list);
    u->due = calloc(u->slots_count, sizeof *u->due);
    u->ready = calloc(u->slots_count, sizeof *u->ready);
    if (!u->slots || !u->free_list || !u->due || !u->ready) {
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
    free(u->due);
    free(u->ready);
out_ring:
    io_uring_queue_exit(&u->ring);
out_free:
    free(u);
    return rc;
}

void io_uring_test_refuse(struct io *io, int err, uint32_t count)
{
    struct iou *u = iou_of(io);
    u->refuse_err = err;
    __atomic_store_n(&u->refuse_count, count, __ATOMIC_RELEASE);
}

uint32_t io_uring_test_refusals_left(struct io *io)
{
    return __atomic_load_n(&iou_of(io)->refuse_count, __ATOMIC_ACQUIRE);
}
