/*
 * filler.c: the zero-filling thread of filler.h.
 *
 * Invariants (under mu)
 *   - jobs[0, njobs) are queued in order; jobs[0] is the one the thread works on when running.
 *   - a job's pos is where its next piece starts; every piece in [from, pos) has completed.
 *   - in_piece: the thread writes [jobs[0].pos, +FILLER_PIECE) with mu released; pos moves on
 *     only after that write returned, and no piece starts once the job is cancelled.
 *   - a cancelled job is removed by the thread (jobs[0] while running) or at once (others).
 */
#include "filler.h"

#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#include "idem.h"
#include "io.h"
#include "util.h"

#define FILLER_JOBS 4
#define FILL_ALIGN  4096u /* the log's block: pieces start and end on it */

struct fill_job {
    uint64_t seq, pos, to;
    int cancelled;
    char *path;
};

struct filler {
    struct io *io;
    pthread_mutex_t mu;
    pthread_cond_t cond;
    pthread_t thread;
    int started, stop, running, in_piece, err;
    struct fill_job jobs[FILLER_JOBS];
    int njobs;
    uint64_t fence_waits;
    const uint8_t *zeros;
};

static void job_drop(struct filler *fl, int i)
{
    free(fl->jobs[i].path);
    memmove(&fl->jobs[i], &fl->jobs[i + 1], (size_t)(fl->njobs - i - 1) * sizeof fl->jobs[0]);
    fl->njobs--;
}

/* Moves jobs[0]'s position past space that may hold data already (written before: a segment
 * filled in an earlier run, the end of one written past by a crashed run; or a file system that
 * cannot tell), or sets *hole_end to the end of the unwritten stretch at its position. mu held
 * on entry and on return, let go in between. */
static void find_hole(struct filler *fl, struct io_file *f, struct fill_job *j, uint64_t *hole_end)
{
    uint64_t off = j->pos, data, hole;
    pthread_mutex_unlock(&fl->mu);
    int rc = io_data_after(fl->io, f, off, &data, &hole);
    pthread_mutex_lock(&fl->mu);
    if (rc < 0 || data <= off) {
        /* Data at off: skip to where the data ends (nothing is written, so the fence rule
         * holds for the space passed over). */
        uint64_t next = rc < 0 || hole >= j->to ? j->to : IDEM_ALIGN_UP(hole, FILL_ALIGN);
        j->pos = next > off ? next : j->to;
        return;
    }
    uint64_t end = data >= j->to ? j->to : data - data % FILL_ALIGN;
    if (end <= off)
        j->pos = j->to; /* cannot happen with aligned holes: give up on the job */
    else
        *hole_end = end;
}

/* Fills jobs[0] (mu held on entry and on return; let go during each write). */
static void job_run(struct filler *fl)
{
    struct fill_job *j = &fl->jobs[0];
    char *path = j->path;
    fl->running = 1;
    pthread_mutex_unlock(&fl->mu);
    struct io_file *f = NULL;
    int rc = io_open(fl->io, path, IO_O_DSYNC, &f);
    int in_place = f && io_overwrites_in_place(fl->io, f); /* fstatfs, ioctl: not under mu */
    pthread_mutex_lock(&fl->mu);
    if (rc < 0) {
        /* Not the disk failing (gone already, out of descriptors or memory): only speed is
         * lost, so the job is skipped. */
        if (rc != -ENOENT)
            fprintf(stderr, "idem: event=fill_skipped file=%s error=\"%s\"\n", path, strerror(-rc));
        rc = 0;
    } else if (!in_place) {
        /* The store starts a filler only where its log's writes stay in place, but a segment
         * file made before (by an earlier build on btrfs, before files were made NOCOW) may
         * not: the log's writes over its zeros would take new space, and fail on a full disk. */
        fprintf(stderr,
                "idem: event=fill_skipped file=%s reason=\"this file is not known to be written "
                "over in place\"\n",
                path);
        j->pos = j->to;
    }
    uint64_t hole_end = 0; /* [pos, hole_end): never written, to be filled */
    while (f && rc == 0 && !j->cancelled && !fl->stop && j->pos < j->to) {
        uint64_t off = j->pos;
        if (off >= hole_end) {
            /* mu was let go: the job may be cancelled by now, so the loop looks again. */
            find_hole(fl, f, j, &hole_end);
            continue;
        }
        uint64_t left = hole_end - off;
        size_t len = left < FILLER_PIECE ? (size_t)left : FILLER_PIECE;
        fl->in_piece = 1;
        pthread_mutex_unlock(&fl->mu);
        int64_t n = io_write_now(fl->io, f, off, fl->zeros, len);
        pthread_mutex_lock(&fl->mu);
        fl->in_piece = 0;
        if (n < 0) {
            rc = (int)n;
        } else {
            /* A short write leaves a partial piece: the next one starts where it stopped. */
            uint64_t whole = (uint64_t)n & ~(uint64_t)(FILL_ALIGN - 1);
            j->pos = off + whole;
            if (whole == 0) rc = -EIO; /* no progress: the disk refuses */
        }
        pthread_cond_broadcast(&fl->cond);
    }
    if (UTIL_NO_SPACE(rc)) {
        /* No room to make the allocated space written (its extents' metadata, a quota): a
         * write refused so wrote nothing, the space stays allocated, and the log writes into
         * it as it would without zeros. Only speed is lost, where any other failed write means
         * a failing disk. (Should write-back, the O_DSYNC half, meet it instead, the kernel
         * reports it to the log's next flush of the file as well, and the store stops there,
         * as it did here before.) */
        fprintf(stderr, "idem: event=fill_skipped file=%s offset=%llu error=\"%s\"\n", path,
                (unsigned long long)j->pos, strerror(-rc));
        rc = 0;
    }
    if (rc < 0 && !fl->err) {
        fl->err = rc;
        fprintf(stderr, "idem: event=fill_failed file=%s offset=%llu error=\"%s\"\n", path,
                (unsigned long long)j->pos, strerror(-rc));
    }
    if (f) {
        pthread_mutex_unlock(&fl->mu);
        io_close(fl->io, f);
        pthread_mutex_lock(&fl->mu);
    }
    fl->running = 0;
    job_drop(fl, 0);
    pthread_cond_broadcast(&fl->cond);
}

static void *filler_main(void *arg)
{
    struct filler *fl = arg;
    pthread_mutex_lock(&fl->mu);
    for (;;) {
        while (!fl->stop && fl->njobs == 0)
            pthread_cond_wait(&fl->cond, &fl->mu);
        if (fl->stop) break;
        if (fl->err) { /* the store stops: fill nothing more */
            job_drop(fl, 0);
            continue;
        }
        job_run(fl);
    }
    pthread_mutex_unlock(&fl->mu);
    return NULL;
}

int filler_create(struct io *io, struct filler **out)
{
    struct filler *fl = calloc(1, sizeof *fl);
    if (!fl) return IDEM_ENOMEM;
    /* Zeros that cost no memory: a read-only anonymous map is the kernel's zero page. */
    void *z = mmap(NULL, FILLER_PIECE, PROT_READ, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (z == MAP_FAILED) {
        free(fl);
        return IDEM_ENOMEM;
    }
    fl->zeros = z;
    fl->io = io;
    pthread_mutex_init(&fl->mu, NULL);
    pthread_cond_init(&fl->cond, NULL);
    if (pthread_create(&fl->thread, NULL, filler_main, fl) != 0) {
        filler_destroy(fl);
        return IDEM_ENOMEM;
    }
    fl->started = 1;
    *out = fl;
    return 0;
}

int filler_destroy(struct filler *fl)
{
    if (!fl) return 0;
    pthread_mutex_lock(&fl->mu);
    fl->stop = 1;
    pthread_cond_broadcast(&fl->cond);
    pthread_mutex_unlock(&fl->mu);
    if (fl->started) pthread_join(fl->thread, NULL);
    while (fl->njobs)
        job_drop(fl, 0);
    int err = fl->err;
    pthread_mutex_destroy(&fl->mu);
    pthread_cond_destroy(&fl->cond);
    munmap((void *)fl->zeros, FILLER_PIECE);
    free(fl);
    return err;
}

int filler_add(struct filler *fl, uint64_t seq, const char *path, uint64_t from, uint64_t to)
{
    IDEM_ASSERT(from % FILL_ALIGN == 0 && to % FILL_ALIGN == 0);
    if (from >= to) return 0;
    char *copy = strdup(path);
    if (!copy) return IDEM_ENOMEM;
    pthread_mutex_lock(&fl->mu);
    int rc = 0;
    if (fl->njobs == FILLER_JOBS) {
        rc = IDEM_EBUSY;
        free(copy);
    } else {
        fl->jobs[fl->njobs++] = (struct fill_job){.seq = seq, .pos = from, .to = to, .path = copy};
        pthread_cond_broadcast(&fl->cond);
    }
    pthread_mutex_unlock(&fl->mu);
    return rc;
}

void filler_fence(struct filler *fl, uint64_t seq, uint64_t end)
{
    pthread_mutex_lock(&fl->mu);
    for (int i = 0; i < fl->njobs; i++) {
        struct fill_job *j = &fl->jobs[i];
        if (j->seq != seq || j->cancelled || end <= j->pos) continue;
        j->cancelled = 1;
        if (i > 0 || !fl->running) {
            job_drop(fl, i--);
            continue;
        }
        if (!fl->in_piece) continue;
        fl->fence_waits++;
        while (fl->in_piece)
            pthread_cond_wait(&fl->cond, &fl->mu);
        i = -1; /* the thread may have dropped the job meanwhile: the list moved */
    }
    pthread_mutex_unlock(&fl->mu);
}

int filler_error(struct filler *fl)
{
    pthread_mutex_lock(&fl->mu);
    int err = fl->err;
    pthread_mutex_unlock(&fl->mu);
    return err;
}

int filler_idle(struct filler *fl)
{
    pthread_mutex_lock(&fl->mu);
    int idle = fl->njobs == 0 && !fl->running;
    pthread_mutex_unlock(&fl->mu);
    return idle;
}

uint64_t filler_fence_waits(struct filler *fl)
{
    pthread_mutex_lock(&fl->mu);
    uint64_t n = fl->fence_waits;
    pthread_mutex_unlock(&fl->mu);
    return n;
}
