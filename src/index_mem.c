/*
 * index_mem.c: the memory of the hash index's segments (index_mem.h).
 *
 * Why: a growth step rebuilds one segment into a new block under the store's lock. A new block
 * from malloc is often fresh memory, faulted in by the step's first writes; on transparent huge
 * pages one fault zeroes 2 MiB (100-300 us on the machines measured). A probe of 5,335 steps
 * found those that took a fault averaged 36 us, with a tail to 272 us, and the others 19 us,
 * with none above 80 us (docs/benchmarks.md). So each block size the index has asked for keeps
 * blocks ready: malloc'd, zeroed and written once per page by a thread of its own, which the
 * owner's lock never holds up (a thread that needs that lock, such as the store's flusher, gets
 * it only now and then from a caller that calls without pause). A step takes a ready block when
 * there is one, and a freed block refills its list (zeroed, ~1 us for 16 KiB) before it goes
 * back to malloc. Blocks still come from malloc, which reuses freed memory across sizes: growth
 * frees blocks of one size in waves (a uniform hash fills every segment at the same pace) and
 * asks for another, so lists by size alone would hold whole waves of idle blocks.
 *
 * Depth: in a wave one size is asked for twice per split, every 50-200 us for a while. A list
 * that runs dry keeps twice as many blocks (once per fill, up to IMEM_READY_MAX, and up to an
 * eighth of the blocks handed out); one not asked for during a whole IMEM_TRIM_US goes back to
 * IMEM_READY, its extra blocks freed.
 *
 * Invariants
 *   - Every block in a ready list is zeroed and has bytes == its list's size.
 *   - IMEM_READY <= depth <= IMEM_READY_MAX, and n <= IMEM_READY_MAX (n may exceed depth after
 *     a trim that could not take every extra block at once: the next trim takes more).
 *   - ready_bytes is the sum of the ready lists' blocks; live_bytes and live_blocks count those
 *     handed out.
 */
#include "index_mem.h"

#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "util.h"

#define IMEM_TRIM_US 1000000 /* a deep list not asked for this long goes back to IMEM_READY */

/* The ready list of blocks of `bytes` (create: take an unused entry); NULL when none. */
static struct imem_ready *ready_list(struct index_mem *m, size_t bytes, bool create)
{
    struct imem_ready *unused = NULL;
    for (size_t i = 0; i < IMEM_SIZES; i++) {
        if (m->ready[i].bytes == bytes) return &m->ready[i];
        if (!unused && m->ready[i].bytes == 0) unused = &m->ready[i];
    }
    if (!create || !unused) return NULL;
    unused->bytes = bytes;
    unused->depth = IMEM_READY;
    return unused;
}

/* How many blocks r is filled to (m->lock held). */
static uint32_t fill_depth(const struct index_mem *m, const struct imem_ready *r)
{
    uint64_t share = m->live_blocks / 8;
    if (share >= r->depth) return r->depth;
    return share < IMEM_READY ? IMEM_READY : (uint32_t)share;
}

void imem_init(struct index_mem *m)
{
    memset(m, 0, sizeof(*m));
    pthread_mutex_init(&m->lock, NULL);
    pthread_condattr_t ca;
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    pthread_cond_init(&m->cond, &ca);
    pthread_condattr_destroy(&ca);
}

void *imem_alloc(struct index_mem *m, size_t bytes)
{
    void *p = NULL;
    pthread_mutex_lock(&m->lock);
    struct imem_ready *r = ready_list(m, bytes, true);
    m->live_blocks++;
    if (r) {
        if (r->n > 0) {
            p = r->blocks[--r->n];
            m->ready_bytes -= bytes;
        } else if (r->wanted) {
            m->misses++;
            if (!r->dry && r->depth < IMEM_READY_MAX) r->depth *= 2;
            r->dry = true;
        }
        r->wanted = true;
        r->takes++;
        if (m->started && r->n <= fill_depth(m, r) / 2) pthread_cond_signal(&m->cond);
    }
    pthread_mutex_unlock(&m->lock);
    if (!p) {
        p = calloc(1, bytes);
        if (!p) {
            pthread_mutex_lock(&m->lock);
            m->live_blocks--;
            pthread_mutex_unlock(&m->lock);
            return NULL;
        }
    }
    m->live_bytes += bytes;
    return p;
}

void imem_free(struct index_mem *m, void *p, size_t bytes)
{
    if (!p) return;
    IDEM_ASSERT(m->live_bytes >= bytes);
    m->live_bytes -= bytes;
    pthread_mutex_lock(&m->lock);
    m->live_blocks--;
    struct imem_ready *r = ready_list(m, bytes, false);
    bool keep = r && r->n < fill_depth(m, r);
    if (keep) {
        memset(p, 0, bytes);
        r->blocks[r->n++] = p;
        m->ready_bytes += bytes;
    }
    pthread_mutex_unlock(&m->lock);
    if (!keep) free(p);
}

void imem_discard(struct index_mem *m, void *p, size_t bytes)
{
    if (!p) return;
    IDEM_ASSERT(m->live_bytes >= bytes);
    m->live_bytes -= bytes;
    pthread_mutex_lock(&m->lock);
    m->live_blocks--;
    pthread_mutex_unlock(&m->lock);
    free(p);
}

size_t imem_bytes(struct index_mem *m)
{
    pthread_mutex_lock(&m->lock);
    size_t n = m->live_bytes + m->ready_bytes;
    pthread_mutex_unlock(&m->lock);
    return n;
}

uint64_t imem_misses(struct index_mem *m)
{
    pthread_mutex_lock(&m->lock);
    uint64_t n = m->misses;
    pthread_mutex_unlock(&m->lock);
    return n;
}

static bool plan_locked(struct index_mem *m, struct imem_fill *f)
{
    f->n = f->ntrim = 0;
    if (m->fill_failed) return false;
    for (size_t i = 0; i < IMEM_SIZES; i++) {
        const struct imem_ready *r = &m->ready[i];
        uint32_t depth = fill_depth(m, r);
        /* Refill at half: a list is not topped up one block at a time. */
        if (r->bytes == 0 || !r->wanted || r->n > depth / 2) continue;
        f->bytes = r->bytes;
        f->depth = depth;
        f->n = depth - r->n;
        return true;
    }
    return false;
}

bool imem_fill_plan(struct index_mem *m, struct imem_fill *f)
{
    pthread_mutex_lock(&m->lock);
    bool any = plan_locked(m, f);
    pthread_mutex_unlock(&m->lock);
    return any;
}

static bool trim_locked(struct index_mem *m, struct imem_fill *f)
{
    f->n = f->ntrim = 0;
    for (size_t i = 0; i < IMEM_SIZES; i++) {
        struct imem_ready *r = &m->ready[i];
        bool idle = r->takes == r->takes_seen;
        r->takes_seen = r->takes;
        if (r->bytes == 0 || !idle || (r->depth == IMEM_READY && r->n <= IMEM_READY)) continue;
        r->depth = IMEM_READY; /* the wave has passed */
        r->dry = false;
        while (r->n > IMEM_READY && f->ntrim < IMEM_READY_MAX) {
            f->trim[f->ntrim++] = r->blocks[--r->n];
            m->ready_bytes -= r->bytes;
        }
    }
    return f->ntrim > 0;
}

bool imem_fill_trim(struct index_mem *m, struct imem_fill *f)
{
    pthread_mutex_lock(&m->lock);
    bool any = trim_locked(m, f);
    pthread_mutex_unlock(&m->lock);
    return any;
}

void imem_fill_work(struct imem_fill *f)
{
    for (uint32_t k = 0; k < f->ntrim; k++)
        free(f->trim[k]);
    f->ntrim = 0;
    size_t page = (size_t)sysconf(_SC_PAGESIZE);
    for (uint32_t k = 0; k < f->n; k++) {
        volatile uint8_t *p = calloc(1, f->bytes);
        f->blocks[k] = (void *)p;
        if (!p) continue;
        /* calloc skips zeroing fresh pages; this write is what faults them in, here. */
        for (size_t off = 0; off < f->bytes; off += page)
            p[off] = 0;
    }
}

static void install_locked(struct index_mem *m, struct imem_fill *f)
{
    struct imem_ready *r = f->n ? ready_list(m, f->bytes, false) : NULL;
    for (uint32_t k = 0; k < f->n; k++) {
        void *p = f->blocks[k];
        if (!p) {
            m->fill_failed = true; /* out of memory: growth allocates in place, as it would */
            continue;
        }
        if (r && r->n < r->depth) {
            r->blocks[r->n++] = p;
            m->ready_bytes += f->bytes;
        } else {
            free(p);
        }
    }
    if (r) {
        r->dry = false;
        if (r->n >= f->depth) r->wanted = false;
    }
    f->n = 0;
}

void imem_fill_install(struct index_mem *m, struct imem_fill *f)
{
    pthread_mutex_lock(&m->lock);
    install_locked(m, f);
    pthread_mutex_unlock(&m->lock);
}

/* Whether some list holds or may hold more than IMEM_READY blocks (m->lock held). */
static bool any_deep_locked(const struct index_mem *m)
{
    for (size_t i = 0; i < IMEM_SIZES; i++) {
        if (m->ready[i].depth > IMEM_READY || m->ready[i].n > IMEM_READY) return true;
    }
    return false;
}

/* The filling thread: fills lists that run short as soon as it is told, and while some list is
 * deep, trims idle ones once per IMEM_TRIM_US. Otherwise it sleeps until told (an idle store
 * wakes nobody). */
static void *fill_main(void *arg)
{
    struct index_mem *m = arg;
    struct imem_fill f;
    int64_t next_trim = util_monotonic_us() + IMEM_TRIM_US;
    pthread_mutex_lock(&m->lock);
    while (!m->stop) {
        bool work = plan_locked(m, &f);
        if (!work && util_monotonic_us() >= next_trim) {
            next_trim = util_monotonic_us() + IMEM_TRIM_US;
            work = trim_locked(m, &f);
        }
        if (work) {
            pthread_mutex_unlock(&m->lock);
            imem_fill_work(&f);
            pthread_mutex_lock(&m->lock);
            install_locked(m, &f);
            continue;
        }
        if (!any_deep_locked(m)) {
            pthread_cond_wait(&m->cond, &m->lock);
            next_trim = util_monotonic_us() + IMEM_TRIM_US;
            continue;
        }
        struct timespec ts;
        clock_gettime(CLOCK_MONOTONIC, &ts);
        int64_t ns = ts.tv_nsec + (next_trim - util_monotonic_us()) * 1000;
        if (ns > 0) {
            ts.tv_sec += ns / 1000000000;
            ts.tv_nsec = ns % 1000000000;
        }
        pthread_cond_timedwait(&m->cond, &m->lock, &ts);
    }
    pthread_mutex_unlock(&m->lock);
    return NULL;
}

int imem_start(struct index_mem *m)
{
    IDEM_ASSERT(!m->started);
    int rc = pthread_create(&m->thread, NULL, fill_main, m);
    if (rc != 0) return -rc;
    pthread_mutex_lock(&m->lock);
    m->started = true;
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
    for (size_t i = 0; i < IMEM_SIZES; i++) {
        for (uint32_t k = 0; k < m->ready[i].n; k++)
            free(m->ready[i].blocks[k]);
    }
    pthread_cond_destroy(&m->cond);
    pthread_mutex_destroy(&m->lock);
    memset(m, 0, sizeof(*m));
}
