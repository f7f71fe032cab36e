/*
 * index_arena.h: the address space the hash index's segments live in: regions of anonymous
 * memory the arena maps itself, faulted in ahead onto transparent huge pages, cut into blocks with
 * boundary tags, freed blocks merged with free neighbours and kept in free lists by exact size.
 *
 * Why not malloc: the index is hundreds of megabytes of blocks read at random. On 4 KiB pages
 * nearly every lookup also misses the TLB, which under nested paging costs about as much as the
 * cache miss. glibc puts a thread's allocations in an arena of its own, which its huge-page
 * tunable leaves on 4 KiB pages, and the index's blocks are made by its filling thread
 * (index_mem.c). Here the placement is the arena's own, whatever the program's malloc does.
 *
 * Not thread-safe: the owner (index_mem.c) serialises every call but iarena_populate, which
 * only faults in committed memory beyond the carved top and may run beside the other calls.
 *
 * Invariants
 *   - A region is [base, base + reserved): [0, top) is cut into blocks, every byte in exactly
 *     one; [top, committed) is readable and writable and holds no block; the rest is PROT_NONE.
 *   - Each block starts with a 16-byte tag: its size and its predecessor's size in 16-byte
 *     granules (0 for a region's first block), whether it is handed out, and a check word.
 *   - No two free blocks are adjacent (freeing merges), and no free block ends at top (it goes
 *     back to the region instead). Every free block is in the list of its size, or in the list
 *     of larger blocks, exactly once; a list is non-empty iff its bit in `nonempty` is set.
 */
#ifndef IDEM_INDEX_ARENA_H
#define IDEM_INDEX_ARENA_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#define IARENA_GRAN      16u   /* bytes per granule: the tag, and the unit of every size */
#define IARENA_CLASS_MAX 1040u /* granules: blocks up to this size have a list each */

struct iarena_region;
struct iarena_free;

struct iarena {
    struct iarena_region *regions; /* newest first; blocks are carved from the newest's top */
    struct iarena_free *lists[IARENA_CLASS_MAX + 1]; /* by size in granules; [0], [1] unused */
    struct iarena_free *large;                       /* free blocks above IARENA_CLASS_MAX */
    uint64_t nonempty[(IARENA_CLASS_MAX + 64) / 64];
    size_t reserve_bytes; /* address space the next region asks for */
    size_t free_bytes;    /* in free blocks, tags included */
    size_t used_bytes;    /* in blocks handed out, tags included */
    size_t carved_bytes;  /* the regions' tops, summed: used + free */
    uint64_t cold_carves; /* blocks carved past the memory iarena_populate made resident */
    /* Advise memory onto huge pages as it is made writable: while nothing runs ahead (an index
     * being loaded at open, where a huge page fault holds up no caller). */
    bool huge_on_commit;
    /* Tests (iarena_test_refuse_populate): populate calls still to refuse, and with what. */
    unsigned test_refusals; /* atomic: the thread that faults memory in reads it */
    int test_refuse_err;
};

void iarena_init(struct iarena *a);
/* A block of at least `bytes`, 16-byte aligned, contents undefined; NULL when out of memory. */
void *iarena_alloc(struct iarena *a, size_t bytes);
/* Gives back a block iarena_alloc returned. */
void iarena_free(struct iarena *a, void *p);
/* Unmaps every region: every block is gone. */
void iarena_destroy(struct iarena *a);

/* Resident-ahead upkeep, in two halves so the faults happen outside the owner's lock:
 * iarena_populate_plan (serialised with the other calls) commits address space up to `ahead`
 * bytes beyond the newest region's top and returns in *p, *n the committed range not yet
 * populated (n 0: nothing to do); iarena_populate (any thread, any time) faults it in without
 * changing its contents; iarena_populate_done (serialised) records that it is resident. */
void iarena_populate_plan(struct iarena *a, size_t ahead, void **p, size_t *n);
/* Returns the bytes faulted in from p on; short, errno says why (EINVAL: a kernel without
 * MADV_POPULATE_WRITE; ENOMEM: no memory just now). */
size_t iarena_populate(struct iarena *a, void *p, size_t n);
void iarena_populate_done(struct iarena *a, void *p, size_t n);
/* Tests: the next count calls of iarena_populate on a are refused with err. */
void iarena_test_refuse_populate(struct iarena *a, int err, unsigned count);
/* Whether fewer than `ahead` bytes beyond the newest region's top are known resident. */
bool iarena_short(const struct iarena *a, size_t ahead);
/* Bytes resident or about to be: carved blocks, and what was populated beyond the tops. */
size_t iarena_resident_bytes(const struct iarena *a);
/* Walks every region and list and checks the invariants above; false on the first breach. */
bool iarena_check(const struct iarena *a);

#endif
