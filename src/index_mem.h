/*
 * index_mem.h: the memory of the hash index's segments: malloc'd blocks, with a few zeroed and
 * resident blocks of each size kept ready, which another thread makes without the owner's lock,
 * so that a growth step under the lock takes no page fault.
 *
 * All functions take the owner's lock except imem_fill_work, which touches only the fill.
 */
#ifndef IDEM_INDEX_MEM_H
#define IDEM_INDEX_MEM_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#define IMEM_SIZES 16 /* block sizes with a ready list (the capacity ladder has 13) */
#define IMEM_READY 16 /* blocks kept ready per size */

struct imem_ready {
    size_t bytes; /* 0: unused entry */
    void *blocks[IMEM_READY];
    uint32_t n;
    bool wanted; /* a block of this size was asked for since the list was last full */
};

struct index_mem {
    struct imem_ready ready[IMEM_SIZES];
    size_t live_bytes;  /* blocks handed out, as requested */
    size_t ready_bytes; /* blocks in ready lists */
    bool fill_failed;   /* a fill ran out of memory: stop filling */
};

/* Returns a zeroed block of `bytes`, or NULL (out of memory). */
void *imem_alloc(struct index_mem *m, size_t bytes);
/* Gives back a block imem_alloc returned for the same bytes. */
void imem_free(struct index_mem *m, void *p, size_t bytes);
/* Gives back a block without keeping it ready (the index is going away). */
void imem_discard(struct index_mem *m, void *p, size_t bytes);
/* Frees the ready blocks (the handed-out ones are the caller's). */
void imem_destroy(struct index_mem *m);
/* Bytes held: handed out and ready. */
size_t imem_bytes(const struct index_mem *m);

/* One fill: n new zeroed, resident blocks of `bytes`. */
struct imem_fill {
    size_t bytes;
    uint32_t n;
    void *blocks[IMEM_READY];
};

/* Whether a ready list runs short; fills *f with what to make. */
bool imem_fill_plan(const struct index_mem *m, struct imem_fill *f);
/* Makes the blocks (malloc, and a write to each page); takes no lock. */
void imem_fill_work(struct imem_fill *f);
/* Puts the blocks made into their ready list (frees what no longer fits). */
void imem_fill_install(struct index_mem *m, struct imem_fill *f);

#endif
