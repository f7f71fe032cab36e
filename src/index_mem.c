/*
 * index_mem.c: the memory of the hash index's segments (index_mem.h).
 *
 * Why: a growth step rebuilds one segment into a new block under the store's lock. A new block
 * from malloc is often fresh memory, faulted in by the step's first writes; on transparent huge
 * pages one fault zeroes 2 MiB (100-300 us on the machines measured). A probe of 5,335 steps
 * found those that took a fault averaged 36 us, with a tail to 272 us, and the others 19 us,
 * with none above 80 us (docs/benchmarks.md). So each block size the index has asked for keeps
 * IMEM_READY blocks ready: malloc'd, zeroed and written once per page by the store's flusher
 * thread without the lock (imem_fill_*). A step takes a ready block when there is one, and a
 * freed block refills its list (zeroed under the lock, ~1 us for 16 KiB) before it goes back to
 * malloc. Blocks still come from malloc, which reuses freed memory across sizes: growth frees
 * blocks of one size in waves (a uniform hash fills every segment at the same pace) and asks
 * for another, so lists by size alone would hold whole waves of idle blocks.
 *
 * Invariants
 *   - Every block in a ready list is zeroed and has bytes == its list's size.
 *   - ready_bytes is the sum of the ready lists' blocks; live_bytes of those handed out.
 */
#include "index_mem.h"

#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "util.h"

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
    return unused;
}

void *imem_alloc(struct index_mem *m, size_t bytes)
{
    struct imem_ready *r = ready_list(m, bytes, true);
    void *p;
    if (r && r->n > 0) {
        p = r->blocks[--r->n];
        m->ready_bytes -= bytes;
    } else {
        p = calloc(1, bytes);
        if (!p) return NULL;
    }
    if (r) r->wanted = true;
    m->live_bytes += bytes;
    return p;
}

void imem_free(struct index_mem *m, void *p, size_t bytes)
{
    if (!p) return;
    IDEM_ASSERT(m->live_bytes >= bytes);
    m->live_bytes -= bytes;
    struct imem_ready *r = ready_list(m, bytes, false);
    if (r && r->n < IMEM_READY) {
        memset(p, 0, bytes);
        r->blocks[r->n++] = p;
        m->ready_bytes += bytes;
        return;
    }
    free(p);
}

void imem_discard(struct index_mem *m, void *p, size_t bytes)
{
    if (!p) return;
    IDEM_ASSERT(m->live_bytes >= bytes);
    m->live_bytes -= bytes;
    free(p);
}

void imem_destroy(struct index_mem *m)
{
    for (size_t i = 0; i < IMEM_SIZES; i++) {
        for (uint32_t k = 0; k < m->ready[i].n; k++)
            free(m->ready[i].blocks[k]);
    }
    memset(m, 0, sizeof(*m));
}

size_t imem_bytes(const struct index_mem *m)
{
    return m->live_bytes + m->ready_bytes;
}

bool imem_fill_plan(const struct index_mem *m, struct imem_fill *f)
{
    f->n = 0;
    if (m->fill_failed) return false;
    for (size_t i = 0; i < IMEM_SIZES; i++) {
        const struct imem_ready *r = &m->ready[i];
        /* Refill at half: a list is not topped up one block at a time. */
        if (r->bytes == 0 || !r->wanted || r->n > IMEM_READY / 2) continue;
        f->bytes = r->bytes;
        f->n = IMEM_READY - r->n;
        return true;
    }
    return false;
}

void imem_fill_work(struct imem_fill *f)
{
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

void imem_fill_install(struct index_mem *m, struct imem_fill *f)
{
    struct imem_ready *r = ready_list(m, f->bytes, false);
    for (uint32_t k = 0; k < f->n; k++) {
        void *p = f->blocks[k];
        if (!p) {
            m->fill_failed = true; /* out of memory: growth allocates in place, as it would */
            continue;
        }
        if (r && r->n < IMEM_READY) {
            r->blocks[r->n++] = p;
            m->ready_bytes += f->bytes;
        } else {
            free(p);
        }
    }
    if (r && r->n == IMEM_READY) r->wanted = false;
    f->n = 0;
}
