/*
 * index_mem.c: the memory of the hash index's segments (index_mem.h).
 *
 * Why: a growth step rebuilds one segment into a new block under the store's lock. A block cut
 * from memory never touched faults it in on its first write; on transparent huge pages one
 * fault zeroes 2 MiB (100-300 us on the machines measured, up to 4.7 ms in a slow hour). So a
 * thread of its own keeps the next imem_ahead bytes beyond the arena's top resident: it commits
 * them under m->lock and faults them in outside it (MADV_POPULATE_WRITE, which leaves contents
 * alone, so the owner may carve from the range meanwhile). An allocation that leaves less than
 * that ahead wakes it (a wake-up without a waiter costs nothing), and it tops the range up to
 * the next huge page boundary. Blocks reused from the arena's free lists are resident already.
 * A block is zeroed by imem_alloc, outside m->lock (about 1 us for 16 KiB). Before the thread
 * starts (an index loaded at open), memory goes onto huge pages as it is made writable.
 *
 * The thread sleeps until woken, so an idle store wakes nobody; after memory was refused (a
 * cgroup at its limit), until woken or a second has passed, when it tries again.
 */
#include "index_mem.h"

#include <errno.h>
#include <time.h>

#include <string.h>

#include "util.h"

#define AHEAD_MIN ((size_t)1 << 20)
#define AHEAD_MAX ((size_t)4 << 20)

size_t imem_ahead(size_t carved)
{
    size_t n = carved / 16;
    return n < AHEAD_MIN ? AHEAD_MIN : n > AHEAD_MAX ? AHEAD_MAX : n;
}

void imem_init(struct index_mem *m)
{
    memset(m, 0, sizeof(*m));
    pthread_mutex_init(&m->lock, NULL);
    util_cond_init_monotonic(&m->cond); /* the retry's pause (ahead_main) */
    iarena_init(&m->arena);
}

void *imem_alloc(struct index_mem *m, size_t bytes)
{
    pthread_mutex_lock(&m->lock);
    void *p = iarena_alloc(&m->arena, bytes);
    if (m->started && iarena_short(&m->arena, imem_ahead(m->arena.carved_bytes)))
        pthread_cond_signal(&m->cond);
    pthread_mutex_unlock(&m->lock);
    if (!p) return NULL;
    memset(p, 0, bytes);
    m->live_bytes += bytes;
    return p;
}

void imem_free(struct index_mem *m, void *p, size_t bytes)
{
    if (!p) return;
    IDEM_ASSERT(m->live_bytes >= bytes);
    m->live_bytes -= bytes;
    pthread_mutex_lock(&m->lock);
    iarena_free(&m->arena, p);
    pthread_mutex_unlock(&m->lock);
}

size_t imem_bytes(struct index_mem *m)
{
    pthread_mutex_lock(&m->lock);
    size_t n = iarena_resident_bytes(&m->arena);
    pthread_mutex_unlock(&m->lock);
    return n;
}

uint64_t imem_misses(struct index_mem *m)
{
    pthread_mutex_lock(&m->lock);
    uint64_t n = m->arena.cold_carves;
    pthread_mutex_unlock(&m->lock);
    return n;
}

static void *ahead_main(void *arg)
{
    struct index_mem *m = arg;
    pthread_mutex_lock(&m->lock);
    while (!m->stop) {
        void *p;
        size_t n;
        iarena_populate_plan(&m->arena, imem_ahead(m->arena.carved_bytes), &p, &n);
        if (n == 0) {
            pthread_cond_wait(&m->cond, &m->lock);
            continue;
        }
        pthread_mutex_unlock(&m->lock);
        size_t done = iarena_populate(&m->arena, p, n);
        int err = done < n ? errno : 0;
        pthread_mutex_lock(&m->lock);
        iarena_populate_done(&m->arena, p, done);
        if (done == n) continue;
        /* No memory just now (a cgroup at its limit): tried again after a pause, or at the
         * next block carved. Refused otherwise (a kernel before 5.14): the owner faults its
         * own memory in from here on. */
        if (err != ENOMEM && err != EAGAIN && err != EINTR) break;
        struct timespec until;
        clock_gettime(CLOCK_MONOTONIC, &until);
        until.tv_sec += 1;
        if (!m->stop) pthread_cond_timedwait(&m->cond, &m->lock, &until);
    }
    pthread_mutex_unlock(&m->lock);
    return NULL;
}

int imem_start(struct index_mem *m)
{
    IDEM_ASSERT(!m->started);
    int rc = pthread_create(&m->thread, NULL, ahead_main, m);
    if (rc != 0) return -rc;
    pthread_mutex_lock(&m->lock);
    m->started = true;
    m->arena.huge_on_commit = false; /* from here on, only what the thread faults in */
    pthread_cond_signal(&m->cond);
    pthread_mutex_unlock(&m->lock);
    return 0;
}

void imem_destroy(struct index_mem *m)
{
    pthread_mutex_lock(&m->lock);
    bool started = m->started;
    m->stop = true;
    pthread_cond_signal(&m->cond);
    pthread_mutex_unlock(&m->lock);
    if (started) pthread_join(m->thread, NULL);
    iarena_destroy(&m->arena);
    pthread_cond_destroy(&m->cond);
    pthread_mutex_destroy(&m->lock);
    memset(m, 0, sizeof(*m));
}
