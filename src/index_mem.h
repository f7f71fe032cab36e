/*
 * index_mem.h: the memory of the hash index's segments: malloc'd blocks, with zeroed and
 * resident blocks of each size kept ready, which a thread of its own makes without the owner's
 * lock, so that a growth step under the lock takes no page fault.
 *
 * Locks: imem_alloc, imem_free and imem_discard run under the owner's lock (live_bytes is the
 * owner's); every function that touches the ready lists also takes m->lock, which the filling
 * thread takes to plan and to install, never while it makes blocks.
 */
#ifndef IDEM_INDEX_MEM_H
#define IDEM_INDEX_MEM_H

#include <pthread.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#define IMEM_SIZES     16 /* block sizes with a ready list (the capacity ladder has 13) */
#define IMEM_READY     16 /* blocks kept ready per size, at least */
#define IMEM_READY_MAX 64 /* ... and at most, while growth steps come in a wave */

struct imem_ready {
    size_t bytes; /* 0: unused entry */
    void *blocks[IMEM_READY_MAX];
    uint32_t n;
    uint32_t depth;      /* blocks to keep ready: IMEM_READY, doubled when a step found none */
    uint64_t takes;      /* blocks asked for, ever */
    uint64_t takes_seen; /* takes at the last trim */
    bool wanted;         /* a block of this size was asked for since the list was last full */
    bool dry;            /* it ran dry since its last fill (depth doubled once for that) */
};

struct index_mem {
    pthread_mutex_t lock; /* the ready lists, ready_bytes, live_blocks, stop */
    pthread_cond_t cond;  /* the filling thread waits on it */
    pthread_t thread;
    bool started, stop;
    bool fill_failed; /* a fill ran out of memory: stop filling */
    struct imem_ready ready[IMEM_SIZES];
    size_t live_bytes;    /* blocks handed out, as requested (the owner's lock) */
    size_t ready_bytes;   /* blocks in ready lists */
    uint64_t live_blocks; /* blocks handed out */
    uint64_t misses;      /* blocks asked for of a size wanted before, with none ready */
};

void imem_init(struct index_mem *m);
/* Starts the filling thread; returns 0 or -errno (growth then allocates in place). */
int imem_start(struct index_mem *m);
/* Returns a zeroed block of `bytes`, or NULL (out of memory). */
void *imem_alloc(struct index_mem *m, size_t bytes);
/* Gives back a block imem_alloc returned for the same bytes. */
void imem_free(struct index_mem *m, void *p, size_t bytes);
/* Gives back a block without keeping it ready (the index is going away). */
void imem_discard(struct index_mem *m, void *p, size_t bytes);
/* Stops the filling thread and frees the ready blocks (the handed-out ones are the caller's). */
void imem_destroy(struct index_mem *m);
/* Bytes held: handed out and ready. */
size_t imem_bytes(struct index_mem *m);
/* How many blocks imem_alloc found none ready for, of a size asked for before. */
uint64_t imem_misses(struct index_mem *m);

/* One fill: free the trimmed blocks, then make n new zeroed, resident blocks of `bytes`. */
struct imem_fill {
    size_t bytes;
    uint32_t depth; /* the list is full at this many */
    uint32_t n, ntrim;
    void *blocks[IMEM_READY_MAX];
    void *trim[IMEM_READY_MAX];
};

/* The filling thread's steps, open to tests: whether a ready list runs short (fills *f with
 * what to make); moving the extra blocks of one deep list not asked for since the last trim to
 * f->trim; freeing and making blocks (no lock); putting the blocks made into their list. */
bool imem_fill_plan(struct index_mem *m, struct imem_fill *f);
bool imem_fill_trim(struct index_mem *m, struct imem_fill *f);
void imem_fill_work(struct imem_fill *f);
void imem_fill_install(struct index_mem *m, struct imem_fill *f);

#endif
