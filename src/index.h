/*
 * index.h: the in-memory hash index: key hash -> log address of the key's newest record.
 *
 * Extendible hashing over small open-addressing segments (linear probing, backward-shift
 * deletion, no tombstones). The directory is indexed by the top bits of the 64-bit hash; a
 * segment that reaches its load limit splits in two (one segment rehashed: a bounded pause,
 * no 2x memory spike); the directory doubles when a split needs it (pointers only).
 *
 * The index never sees keys: it stores 56 bits of each hash and calls back the caller's
 * comparison for candidates, so keys are always compared in full by the caller.
 *
 * Slot pointers returned by find/insert stay valid only until the next insert or remove.
 * Threads: the store serialises every call that changes the index, and index_find (which notes
 * where a miss stopped) with them; index_lookup, index_peek, index_prefetch and index_has_hash
 * change nothing, and run side by side under the store's read lock.
 */
#ifndef IDEM_INDEX_H
#define IDEM_INDEX_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "index_mem.h"

#define INDEX_ADDR_BITS 40
#define INDEX_ADDR_MASK ((UINT64_C(1) << INDEX_ADDR_BITS) - 1)

/* 16 bytes. addr_tag: low 40 bits the log address (never 0 in a used slot), high 24 bits the
 * hash's top 24 bits. hash_lo: the hash's low 32 bits. aux: the caller's (moved with the slot). */
struct index_slot {
    uint64_t addr_tag;
    uint32_t hash_lo;
    uint32_t aux;
};

struct index;

/* Creates an index sized for about expected_keys (0: small) that inserting that many keys
 * grows no further. Returns 0 or -ENOMEM. */
int index_create(uint64_t expected_keys, struct index **out);
/* The same at about the size growth would have reached: inserting expected_keys grows about one
 * segment in 1000 once (a checkpoint's load: 21 instead of 27 bytes per key at 10 M keys). */
int index_create_snug(uint64_t expected_keys, struct index **out);
/* The memory index_create(expected_keys) takes at once (SIZE_MAX: more than it can). */
size_t index_presize_bytes(uint64_t expected_keys);
void index_destroy(struct index *ix);

/* Returns the slot with hash h for which eq(ctx, addr) returns nonzero, or NULL. eq is called
 * only for slots whose stored hash bits equal h's. */
struct index_slot *index_find(struct index *ix, uint64_t h, int (*eq)(void *ctx, uint64_t addr),
                              void *ctx);
/* The same without remembering where a missing key would go (index_find does, for the insert
 * that follows): it writes nothing, so readers may call it at once (store.h, rw). */
struct index_slot *index_lookup(const struct index *ix, uint64_t h,
                                int (*eq)(void *ctx, uint64_t addr), void *ctx);

/* Hints for a lookup of h a few operations ahead, so batches overlap their cache misses:
 * index_prefetch starts loading h's home slot; index_peek returns the first slot among the
 * home and the 31 after it whose stored hash bits equal h's (NULL: none, or further on),
 * comparing no key. Both only read; an answer made stale by later inserts costs one wasted
 * prefetch. */
void index_prefetch(const struct index *ix, uint64_t h);
const struct index_slot *index_peek(const struct index *ix, uint64_t h);
/* Whether any slot holds h's stored hash bits (comparing no key). */
bool index_has_hash(const struct index *ix, uint64_t h);

/* The slot with h's stored hash bits that holds addr, or NULL (no key compared: an address
 * names one version of one key). */
struct index_slot *index_find_addr(struct index *ix, uint64_t h, uint64_t addr);
/* Whether a slot holds addr under h's stored hash bits, h's low 16 bits not compared (the age
 * heaps keep 40 of the 56 bits). */
int index_holds(const struct index *ix, uint64_t h, uint64_t addr);
/* The slots (at most max, into out) whose stored hash bits match h's top 24 and the top 16 of
 * its low 32 (as index_holds): a key's slot among them, if the key is there. Returns how many. */
size_t index_slots_like(const struct index *ix, uint64_t h, const struct index_slot **out,
                        size_t max);

/* Adds an entry; the caller has checked the key is absent. addr: 1..INDEX_ADDR_MASK. Returns
 * the slot, or NULL when memory for a split cannot be had or a segment at the deepest local
 * depth (24) is full: no entry was added then (rebuilds made on the way stay, as they would
 * have been made for it). */
struct index_slot *index_insert(struct index *ix, uint64_t h, uint64_t addr, uint32_t aux);
/* Tests: while on, an insert that needs a rebuild (a grow or a split) fails as for memory. */
void index_test_refuse_rebuilds(struct index *ix, int on);
/* The bytes index_live_bytes rises by when hash h is inserted: 0 when its segment has room
 * (the insert uses a slot that is there, one a removal may have freed); else what the rebuild
 * of its segment, and the doubling of the directory a split may need, add (less, where the
 * rebuild's step of a doubling under way ends it and frees the old directory). Not counted: a
 * split whose half is still full splits again (rare: uniform hashes). A split's exact figure
 * reads the segment's entries (at most 1024 slots): where a bound from above (each half as
 * large as the segment) is within room, that bound is returned instead. */
size_t index_insert_growth(const struct index *ix, uint64_t h, size_t room);
/* index_insert (aux 0) for entries that arrive in ascending order of position within their
 * segment, as a checkpoint lists them: each insert starts probing where the run of slots it
 * joins ends, instead of at its home (sorted inserts into linear probing otherwise walk the
 * whole run each time: ~8 probes at 75% load). Correct in any order; faster in that one. */
struct index_slot *index_insert_ordered(struct index *ix, uint64_t h, uint64_t addr);

/* Removes the entry in slot (from find or insert, still valid). */
void index_remove(struct index *ix, struct index_slot *slot);

static inline uint64_t index_slot_addr(const struct index_slot *s)
{
    return s->addr_tag & INDEX_ADDR_MASK;
}
static inline void index_slot_set_addr(struct index_slot *s, uint64_t addr)
{
    s->addr_tag = (s->addr_tag & ~INDEX_ADDR_MASK) | addr;
}
/* The full 64-bit hash can not be recovered; these are the 56 bits kept. */
static inline uint64_t index_slot_hash_bits(const struct index_slot *s)
{
    return (s->addr_tag & ~INDEX_ADDR_MASK) | s->hash_lo;
}

/* O(entries): every segment's count, prefix and probe runs, and the total. For tests. */
bool index_check(const struct index *ix);
uint64_t index_count(const struct index *ix);
/* Starts the thread that faults memory in ahead of growth (index_mem.h); 0 or -errno. An index
 * whose thread never started faults its own memory in (the store does not open then). */
int index_start_ahead(struct index *ix);
/* Segments (each split adds one). */
uint64_t index_segments(const struct index *ix);
/* Anonymous memory held (segments, the free space between them, memory faulted in ahead of
 * growth, directory), in bytes. */
size_t index_memory_bytes(struct index *ix);
/* The blocks handed out and the directory: without the free space and the memory faulted in
 * ahead (index_mem.h), which come and go. */
size_t index_live_bytes(const struct index *ix);
/* The longest growth pause so far (segment grow, split or directory doubling), in
 * microseconds (for the growth benchmark): wall time, and the CPU time of the thread (without
 * the time the thread waited for a core; on a virtual machine, time the host took the core
 * away may still count as the thread's). */
uint64_t index_max_split_us(const struct index *ix);
uint64_t index_max_split_cpu_us(const struct index *ix);
/* Growth steps so far, and the CPU time that per_mille of them stayed within, in whole
 * microseconds (255 stands for 255 or more). */
uint64_t index_splits(const struct index *ix);
uint64_t index_split_cpu_quantile_us(const struct index *ix, uint32_t per_mille);
/* Blocks carved past the memory faulted in ahead (index_mem.h): their page faults were taken
 * under the owner's lock. */
uint64_t index_cold_blocks(struct index *ix);
/* Old directory entries a growth step moves while the directory doubles (default 2048); for
 * tests, which make doublings span many steps with a small one. */
void index_set_dir_move_step(struct index *ix, size_t entries);
/* Old directory entries a doubling under way has yet to move past (0: none under way). */
size_t index_dir_unmoved(const struct index *ix);

/*
 * Cursor iteration, Redis SCAN style: visits the slots of about max_slots positions starting at
 * cursor (0 to begin), calling fn for every used slot, and returns the next cursor (0: done).
 * Every entry present for the whole scan is visited at least once, even across splits and
 * directory doublings; an entry may be visited twice. fn must not insert or remove; it may
 * change the slot's addr and aux.
 */
uint64_t index_scan(struct index *ix, uint64_t cursor, uint32_t max_slots,
                    void (*fn)(void *ctx, struct index_slot *slot), void *ctx);
#define INDEX_SCAN_CURSOR_BITS 56 /* the cursors index_scan returns are below 2^56 */

#endif /* IDEM_INDEX_H */
