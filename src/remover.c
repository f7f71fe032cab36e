/*
 * remover.c: the file deleting thread of remover.h.
 *
 * Invariants (under mu)
 *   - queue holds the paths not yet taken by the thread, oldest first; busy is set while the
 *     thread deletes one or syncs the directory with mu released.
 *   - dirty: a file was deleted since the last directory sync.
 *   - err: the first directory sync that failed for the disk, kept (a later sync may succeed
 *     over entries lost); retrying: one refused for descriptors, memory or space waits.
 *   - drained (queue empty, not busy, not dirty) is broadcast on cond.
 */
#include "remover.h"

#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "idem.h"
#include "io.h"
#include "util.h"

struct rm_item {
    struct rm_item *next;
    struct io_file *f; /* NULL: the file is not open */
    const void *map;
    size_t map_len;
    char path[];
};

struct remover {
    struct io *io;
    char *dir;
    pthread_mutex_t mu;
    pthread_cond_t cond;
    pthread_t thread;
    int started, stop, busy, dirty, err, retrying;
    struct rm_item *head, *tail;
};

int remover_create(struct io *io, const char *dir, struct remover **out)
{
    struct remover *r = calloc(1, sizeof *r);
    if (!r || !(r->dir = strdup(dir))) {
        free(r);
        return IDEM_ENOMEM;
    }
    r->io = io;
    pthread_mutex_init(&r->mu, NULL);
    util_cond_init_monotonic(&r->cond); /* the retry's second is elapsed time */
    *out = r;
    return 0;
}

/* Unmaps and closes the file if it is open, then deletes it, with mu let go (held on entry and
 * on return). */
static void delete_one(struct remover *r, const char *path, struct io_file *f, const void *map,
                       size_t map_len)
{
    pthread_mutex_unlock(&r->mu);
    if (f && map) io_unmap(r->io, f, map, map_len);
    if (f) io_close(r->io, f);
    int rc = io_unlink(r->io, path);
    if (rc < 0 && rc != -ENOENT)
        fprintf(stderr, "idem: event=delete_failed dir=%s file=%s error=\"%s\"\n", r->dir, path,
                strerror(-rc));
    pthread_mutex_lock(&r->mu);
    if (rc == 0) r->dirty = 1;
}

/* Syncs the directory once files were deleted (mu held; let go meanwhile). A sync refused for
 * descriptors, memory or space (the directory's open, or btrfs's commit without room for its
 * metadata: not the disk failing, as the flusher's own directory syncs have it) is tried again
 * a second later on the thread (may_wait), at the next delete otherwise, and given up at stop
 * (the next open removes what a crash brings back: remove_leftovers). Any other failure is kept
 * for remover_error: the store fails with it. */
static void sync_dir(struct remover *r, int may_wait)
{
    r->dirty = 0;
    pthread_mutex_unlock(&r->mu);
    int rc = io_sync_dir(r->io, r->dir);
    pthread_mutex_lock(&r->mu);
    if (rc == 0) {
        r->retrying = 0;
    } else if (UTIL_OPEN_ERR(rc) != IDEM_EIO) {
        if (!r->retrying)
            fprintf(stderr,
                    "idem: event=delete_failed dir=%s error=\"directory sync: %s\": tried "
                    "again each second\n",
                    r->dir, strerror(-rc));
        r->retrying = 1;
        r->dirty = !r->stop;
        struct timespec until;
        clock_gettime(CLOCK_MONOTONIC, &until);
        until.tv_sec += 1;
        /* The whole second (a delete queued meanwhile, or a spurious wakeup, does not end it),
         * unless the remover stops. */
        while (may_wait && !r->stop && pthread_cond_timedwait(&r->cond, &r->mu, &until) == 0)
            ;
    } else if (!r->err) {
        r->err = rc;
    }
}

static void *remover_main(void *arg)
{
    struct remover *r = arg;
    pthread_mutex_lock(&r->mu);
    for (;;) {
        struct rm_item *it = r->head;
        if (it) {
            r->head = it->next;
            if (!r->head) r->tail = NULL;
            r->busy = 1;
            delete_one(r, it->path, it->f, it->map, it->map_len);
            free(it);
        } else if (r->dirty) {
            r->busy = 1;
            sync_dir(r, 1);
        } else {
            r->busy = 0;
            pthread_cond_broadcast(&r->cond); /* drained */
            if (r->stop) break;
            pthread_cond_wait(&r->cond, &r->mu);
        }
    }
    pthread_mutex_unlock(&r->mu);
    return NULL;
}

void remover_add_open(struct remover *r, const char *path, struct io_file *f, const void *map,
                      size_t map_len)
{
    size_t len = strlen(path) + 1;
    struct rm_item *it = malloc(sizeof *it + len);
    pthread_mutex_lock(&r->mu);
    if (it && !r->started && !r->stop)
        r->started = pthread_create(&r->thread, NULL, remover_main, r) == 0;
    if (!it || !r->started) { /* no memory or no thread: here, at once */
        free(it);
        delete_one(r, path, f, map, map_len);
        if (r->dirty) sync_dir(r, 0);
        pthread_mutex_unlock(&r->mu);
        return;
    }
    *it = (struct rm_item){.f = f, .map = map, .map_len = map_len};
    memcpy(it->path, path, len);
    if (r->tail)
        r->tail->next = it;
    else
        r->head = it;
    r->tail = it;
    pthread_cond_broadcast(&r->cond);
    pthread_mutex_unlock(&r->mu);
}

void remover_add(struct remover *r, const char *path)
{
    remover_add_open(r, path, NULL, NULL, 0);
}

int remover_pending(struct remover *r)
{
    pthread_mutex_lock(&r->mu);
    int pending = r->head || (r->busy && !r->retrying); /* deleted: only their sync waits */
    pthread_mutex_unlock(&r->mu);
    return pending;
}

void remover_drain(struct remover *r)
{
    pthread_mutex_lock(&r->mu);
    while (r->started && (r->head || r->busy || r->dirty))
        pthread_cond_wait(&r->cond, &r->mu);
    pthread_mutex_unlock(&r->mu);
}

int remover_error(struct remover *r)
{
    pthread_mutex_lock(&r->mu);
    int err = r->err;
    pthread_mutex_unlock(&r->mu);
    return err;
}

int remover_destroy(struct remover *r)
{
    if (!r) return 0;
    pthread_mutex_lock(&r->mu);
    r->stop = 1;
    pthread_cond_broadcast(&r->cond);
    int started = r->started;
    pthread_mutex_unlock(&r->mu);
    if (started) pthread_join(r->thread, NULL);
    int err = r->err;
    pthread_mutex_destroy(&r->mu);
    pthread_cond_destroy(&r->cond);
    free(r->dir);
    free(r);
    return err;
}
