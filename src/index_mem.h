/*
 * index_mem.h: the memory of the hash index's segments: blocks from the index's own arena
 * (index_arena.h: on huge pages, freed space merged and reused), with the arena's next
 * megabytes faulted in ahead by a thread of its own, so that a growth step under the owner's
 * lock takes no page fault.
 *
 * Locks: imem_alloc and imem_free run under the owner's lock (live_bytes is the owner's) and
 * take m->lock for the arena; the thread takes m->lock to plan and to record, never while it
 * faults memory in.
 */
#ifndef IDEM_INDEX_MEM_H
#define IDEM_INDEX_MEM_H

#include <pthread.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "index_arena.h"

struct index_mem {
    pthread_mutex_t lock; /* arena, stop */
    pthread_cond_t cond;  /* the thread waits on it */
    pthread_t thread;
    bool started, stop;
    struct iarena arena;
    size_t live_bytes; /* blocks handed out, as requested (the owner's lock) */
};

void imem_init(struct index_mem *m);
/* Starts the thread that faults memory in ahead; returns 0 or -errno (growth then faults its
 * own memory in, under the owner's lock). */
int imem_start(struct index_mem *m);
/* Returns a zeroed block of `bytes`, or NULL (out of memory). */
void *imem_alloc(struct index_mem *m, size_t bytes);
/* Gives back a block imem_alloc returned for the same bytes. */
void imem_free(struct index_mem *m, void *p, size_t bytes);
/* Stops the thread and unmaps the arena: every block is gone. */
void imem_destroy(struct index_mem *m);
/* Bytes resident: blocks handed out, free space between them, and memory faulted in ahead. */
size_t imem_bytes(struct index_mem *m);
/* How many blocks were carved past the memory faulted in ahead (imem_alloc's memset faulted
 * it in, under the owner's lock). */
uint64_t imem_misses(struct index_mem *m);
/* How far ahead of the arena's top the thread keeps memory resident, for an arena of `carved`
 * bytes: a sixteenth of it, within [1 MiB, 4 MiB], rounded up to the end of a huge page (the
 * least one fault makes resident). */
size_t imem_ahead(size_t carved);

#endif
