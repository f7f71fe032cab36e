/*
 * index.c: the in-memory hash index of index.h (hash -> log address), extendible hashing.
 *
 * Layout
 *   - Directory: 2^global_depth entries {segment pointer, capacity}, indexed by the top
 * global_depth bits of the 64-bit hash (global_depth <= INDEX_DEPTH_MAX = 24, the hash bits kept in
 * addr_tag). A segment of local depth ld covers the 2^(global_depth - ld) consecutive directory
 * entries that share its top-ld-bit prefix; every one points to it.
 *   - Doubling in steps: copying the whole directory at once took 175-250 us at 10 Mi keys (16 Ki
 *     entries, most of it faulting in the new array), and twice that per further doubling. So a
 *     doubling only allocates the new array and keeps the old one (old_dir): old entry i stands
 *     for new entries 2i and 2i+1 until it is moved, which copies it into both and clears its
 *     seg. Every growth step moves the next dir_move_step old entries, and a step that rewrites
 *     directory entries first moves the old ones it covers. Entries below dir_ready are all moved;
 *     at or above it, a lookup reads the old entry unless that one was moved (dir_at). Only
 *     growth moves entries: an index that stops growing keeps the old array (half the
 *     directory's size) until it grows again.
 *   - Segment: one block (index_mem.c), a 16-byte header then cap slots (struct index_slot). Linear
 *     probing, wrapping at cap. A slot is empty iff addr_tag == 0 (addresses are never 0).
 *     An entry's home position is fastrange(hash_lo, cap) = hash_lo * cap >> 32, so the home
 *     comes from bits stored in the slot (backward-shift deletion and rebuilds need no key) and
 *     is monotonic in hash_lo (the scan walks hash_lo ranges, see index_scan).
 *
 * Capacity ladder (why segments are not all one size)
 *   With a uniform hash every segment fills at the same rate, so with fixed-size segments that
 *   split at load L the whole index swings between load L and L/2 (16/0.425 = 38 B/key just
 *   after a wave of splits). Instead a segment's capacity climbs a ladder of steps of 2^(1/3)
 *   (..., 0.63, 0.79, 1.0 x SEG_CAP_MAX): at load LOAD_MAX (85%) a segment below SEG_CAP_MAX is
 *   rebuilt one step larger (load falls to ~67.5%), and a segment at SEG_CAP_MAX splits into two
 *   halves of 0.63 x SEG_CAP_MAX (load ~67.5% each). Load thus stays within ~67.5%..85%:
 *   <= 23.7 B/key plus per-segment overhead. Each rebuild rehashes one segment only (a bounded
 *   pause); the old block is freed right after, so there is no 2x memory spike.
 *
 * Invariants
 *   - 0 <= local_depth <= global_depth <= 24; every entry of a segment has the segment's prefix.
 *   - count < cap: at least one empty slot, so every probe loop ends within cap steps.
 *   - count <= limit(cap) (85%) except at local depth 24 and SEG_CAP_MAX, which cannot split:
 *     there inserts go on up to the hard limit (15/16 of cap), after which index_insert returns
 *     NULL. With a per-store secret hash seed, ~960 keys sharing 24 top hash bits do not occur.
 *   - Linear probing without tombstones: between an entry's home and its slot no slot is empty.
 *   - A segment's run (index_insert_ordered), when set, names positions that are all in use.
 *   - Segments never shrink or merge: memory stays at the high-water mark after removals.
 */
#include "index.h"

#include <errno.h>
#include <math.h>
#include <stdbool.h>
#include <stdlib.h>

#include "index_mem.h"
#include "util.h"

#define INDEX_DEPTH_MAX 24
#ifndef SEG_CAP_MAX
#define SEG_CAP_MAX 1024 /* slots (16 KiB): a split rehashes <= 870 entries */
#endif
#define SEG_CAP_MIN     64
#define LOAD_MAX_PCT    85 /* grow or split above this load */
#define LOAD_AFTER_PCT  68 /* a rebuild picks the smallest ladder step at or below this load */
#define HARD_LIMIT(cap) ((cap) - (cap) / 16)
#define TAG_MASK        (~INDEX_ADDR_MASK)
#define PEEK_PROBES     32   /* index_peek looks no further: at 85% load, 8 missed 1 entry in 5 */
#define DIR_MOVE_STEP   2048 /* old directory entries moved per growth step: 64 KiB of new */
#define SPLIT_HIST_US   256  /* growth steps' CPU times, in 1 us buckets; the last is 255 or more */

_Static_assert(sizeof(struct index_slot) == 16, "index_slot is 16 bytes");
_Static_assert((SEG_CAP_MAX & (SEG_CAP_MAX - 1)) == 0, "SEG_CAP_MAX is a power of two");
_Static_assert(SEG_CAP_MAX <= 65536, "index_holds finds a home from 16 of hash_lo's bits");
_Static_assert(2 * SEG_CAP_MAX <= 65536, "a run's end (< 2 cap) fits in 16 bits");
_Static_assert(64 - INDEX_ADDR_BITS == INDEX_DEPTH_MAX, "tag bits are the directory bits");
_Static_assert(INDEX_DEPTH_MAX + 32 == INDEX_SCAN_CURSOR_BITS, "a cursor: prefix, then hash_lo");

struct index_seg {
    uint32_t cap;   /* slots */
    uint32_t count; /* used slots */
    uint32_t local_depth;
    /* 0, or RUN(home, end): every position from home to end (counted on past cap, not wrapped)
     * is in use, so index_insert_ordered of an entry whose home lies in it probes from end + 1.
     * Inserts keep that true; index_remove clears it. */
    uint32_t run;
    struct index_slot slots[];
};
#define RUN(home, end) ((uint32_t)(end) << 16 | ((home) + 1))
#define RUN_HOME(run)  (((run)&0xffffu) - 1)
#define RUN_END(run)   ((run) >> 16)
#define RUN_BEHIND     64 /* an ordered insert this far behind the run starts a new one */
_Static_assert(sizeof(struct index_seg) == 16, "segment header keeps slots 16-aligned");

/* A directory entry carries the segment's capacity so a lookup's first miss is the slot itself,
 * not the segment header. */
struct index_dirent {
    struct index_seg *seg;
    uint64_t cap;
};

struct index {
    struct index_dirent *dir; /* 2^global_depth entries (malloc); see dir_at */
    uint32_t global_depth;
    /* While the directory doubles: the previous one (2^(global_depth - 1) entries, NULL
     * otherwise), and the prefix of dir in use: dir[0, dir_ready) is valid; above it, old entry
     * pos / 2 is, unless it was moved (its seg is NULL). dir_ready = 2^global_depth otherwise. */
    struct index_dirent *old_dir;
    size_t dir_ready;
    size_t dir_move_step;
    uint64_t count;
    uint64_t seg_count;
    uint64_t max_split_us, max_split_cpu_us;
    uint64_t splits;
    uint32_t split_cpu_hist[SPLIT_HIST_US];
    struct index_mem mem; /* the segments */
    /* Where the last lookup that found nothing stopped: the empty slot an insert of that hash
     * takes, while nothing has changed since (gen counts inserts, removals and rebuilds). A
     * claim of a new key looks up and then inserts the same hash: the insert probes no more. */
    uint64_t gen;
    struct {
        uint64_t h, gen;
        struct index_slot *slot;
    } miss;
    int test_refuse_rebuilds; /* index_test_refuse_rebuilds */
};

static inline uint32_t seg_home(uint32_t hash_lo, uint32_t cap)
{
    return (uint32_t)(((uint64_t)hash_lo * cap) >> 32);
}

static inline uint32_t seg_limit(uint32_t cap)
{
    return (uint32_t)((uint64_t)cap * LOAD_MAX_PCT / 100);
}

static inline size_t seg_bytes(uint32_t cap)
{
    return sizeof(struct index_seg) + (size_t)cap * sizeof(struct index_slot);
}

/* The top 24 bits of a hash, as kept in addr_tag. */
static inline uint32_t hash_top24(uint64_t h)
{
    return (uint32_t)(h >> INDEX_ADDR_BITS);
}

static inline size_t dir_pos(const struct index *ix, uint32_t top24)
{
    return (size_t)(top24 >> (INDEX_DEPTH_MAX - ix->global_depth));
}

/* The directory entry at pos (of 2^global_depth), wherever a doubling in steps keeps it. */
static inline const struct index_dirent *dir_at(const struct index *ix, size_t pos)
{
    if (__builtin_expect(pos < ix->dir_ready, 1)) return &ix->dir[pos];
    const struct index_dirent *o = &ix->old_dir[pos >> 1];
    return o->seg ? o : &ix->dir[pos];
}

static inline const struct index_dirent *dir_of(const struct index *ix, uint32_t top24)
{
    return dir_at(ix, dir_pos(ix, top24));
}

static size_t dir_bytes(const struct index *ix);

/* Ladder step k (0 = SEG_CAP_MAX): SEG_CAP_MAX * 2^(-k/3), rounded. */
static uint32_t ladder_cap(uint32_t k)
{
    static const uint32_t frac_1024[3] = {1024, 813, 645};
    return (uint32_t)(((uint64_t)(SEG_CAP_MAX >> (k / 3)) * frac_1024[k % 3]) / 1024);
}

/* The capacity a segment rebuilt with n entries gets: the smallest ladder step holding n at
 * <= LOAD_AFTER_PCT, within [SEG_CAP_MIN, SEG_CAP_MAX]. */
static uint32_t seg_cap_for(uint64_t n)
{
    uint32_t best = SEG_CAP_MAX;
    for (uint32_t k = 0; k < 64; k++) {
        uint32_t c = ladder_cap(k);
        if (c < SEG_CAP_MIN || n * 100 > (uint64_t)c * LOAD_AFTER_PCT) break;
        best = c;
    }
    return best;
}

static struct index_seg *seg_new(struct index *ix, uint32_t cap, uint32_t local_depth)
{
    IDEM_ASSERT(cap >= SEG_CAP_MIN / 2 && cap <= SEG_CAP_MAX);
    struct index_seg *seg = imem_alloc(&ix->mem, seg_bytes(cap));
    if (!seg) return NULL;
    seg->cap = cap;
    seg->local_depth = local_depth;
    seg->run = 0;
    ix->seg_count++;
    return seg;
}

static void seg_free(struct index *ix, struct index_seg *seg)
{
    ix->seg_count--;
    imem_free(&ix->mem, seg, seg_bytes(seg->cap));
}

/* Places a slot's contents at the first empty position from `from` (its home, or a position
 * with every slot from the home up to it in use); returns that position. */
static inline uint32_t seg_place_at(struct index_seg *seg, const struct index_slot *src,
                                    uint32_t from)
{
    IDEM_ASSERT(seg->count + 1 < seg->cap && from < seg->cap);
    uint32_t i = from;
    for (uint32_t n = 0; n < seg->cap; n++) {
        if (seg->slots[i].addr_tag == 0) {
            seg->slots[i] = *src;
            seg->count++;
            return i;
        }
        if (++i == seg->cap) i = 0;
    }
    IDEM_ASSERT(!"segment full");
    return 0;
}

/* Places a slot's contents at the first empty position from its home; returns that slot. */
static struct index_slot *seg_place(struct index_seg *seg, const struct index_slot *src)
{
    return &seg->slots[seg_place_at(seg, src, seg_home(src->hash_lo, seg->cap))];
}

/* O(cap): count matches, prefixes match, no empty slot between an entry's home and its slot. */
static bool seg_check(const struct index_seg *seg, uint32_t prefix)
{
    uint32_t used = 0;
    for (uint32_t i = 0; i < seg->cap; i++) {
        const struct index_slot *s = &seg->slots[i];
        if (s->addr_tag == 0) continue;
        used++;
        uint32_t top = hash_top24(s->addr_tag);
        if (seg->local_depth > 0 && (top >> (INDEX_DEPTH_MAX - seg->local_depth)) != prefix)
            return false;
        for (uint32_t j = seg_home(s->hash_lo, seg->cap); j != i; j = (j + 1) % seg->cap) {
            if (seg->slots[j].addr_tag == 0) return false;
        }
    }
    if (seg->run) { /* a run lies inside one lap, every position of it in use */
        uint32_t home = RUN_HOME(seg->run), end = RUN_END(seg->run);
        if (home >= seg->cap || end < home || end - home >= seg->cap) return false;
        for (uint32_t j = home; j <= end; j++)
            if (seg->slots[j % seg->cap].addr_tag == 0) return false;
    }
    return used == seg->count && used < seg->cap;
}

/* Moves old directory entry i into the two new entries it stands for, unless it was moved. */
static void dir_move(struct index *ix, size_t i)
{
    struct index_dirent *o = &ix->old_dir[i];
    if (!o->seg) return;
    ix->dir[2 * i] = ix->dir[2 * i + 1] = *o;
    o->seg = NULL;
}

/* Moves the next `step` old entries of a doubling under way; frees the old directory when none
 * is left. */
static void dir_move_some(struct index *ix, size_t step)
{
    size_t old_n = (size_t)1 << (ix->global_depth - 1);
    size_t i = ix->dir_ready / 2;
    size_t end = old_n - i > step ? i + step : old_n;
    for (; i < end; i++)
        dir_move(ix, i);
    ix->dir_ready = 2 * end;
    if (end == old_n) {
        free(ix->old_dir);
        ix->old_dir = NULL;
    }
}

/* Points dir[first, first + n) at seg, moving the old entries the range covers first. */
static void dir_set(struct index *ix, size_t first, size_t n, struct index_seg *seg)
{
    if (ix->old_dir && first + n > ix->dir_ready) {
        for (size_t i = first / 2; i <= (first + n - 1) / 2; i++)
            if (2 * i >= ix->dir_ready) dir_move(ix, i);
    }
    for (size_t i = 0; i < n; i++)
        ix->dir[first + i] = (struct index_dirent){.seg = seg, .cap = seg->cap};
}

/* Starts doubling the directory (a doubling still under way is finished first: it had fewer
 * growth steps than it has steps of entries to move, which uniform hashes make rare). The new
 * array is filled as entries move (dir_at). Returns 0 or -ENOMEM (nothing changed). */
static int dir_double(struct index *ix)
{
    IDEM_ASSERT(ix->global_depth < INDEX_DEPTH_MAX);
    size_t old_n = (size_t)1 << ix->global_depth;
    struct index_dirent *dir = malloc(2 * old_n * sizeof(*dir));
    if (!dir) return -ENOMEM;
    if (ix->old_dir) dir_move_some(ix, SIZE_MAX);
    ix->old_dir = ix->dir;
    ix->dir = dir;
    ix->dir_ready = 0;
    ix->global_depth++;
    return 0;
}

/* Rebuilds seg one ladder step larger, in place in the directory. Returns 0 or -ENOMEM. */
static int seg_grow(struct index *ix, struct index_seg *seg, uint32_t top24)
{
    uint32_t cap = seg_cap_for(seg->count + 1);
    if (cap <= seg->cap) cap = seg->cap + 1;
    struct index_seg *nseg = seg_new(ix, cap, seg->local_depth);
    if (!nseg) return -ENOMEM;
    for (uint32_t i = 0; i < seg->cap; i++) {
        if (seg->slots[i].addr_tag != 0) seg_place(nseg, &seg->slots[i]);
    }
    IDEM_ASSERT(nseg->count == seg->count);
    uint32_t shift = ix->global_depth - seg->local_depth;
    size_t first = (dir_pos(ix, top24) >> shift) << shift;
    IDEM_ASSERT(dir_at(ix, first)->seg == seg &&
                dir_at(ix, first + ((size_t)1 << shift) - 1)->seg == seg);
    dir_set(ix, first, (size_t)1 << shift, nseg);
    seg_free(ix, seg);
    IDEM_DEBUG_ASSERT(seg_check(nseg, (uint32_t)((uint64_t)top24 >> (24 - nseg->local_depth))));
    return 0;
}

/* The entries of seg whose hash has the bit at bit_shift (within top24) set: those a split puts
 * in its upper half. */
static uint32_t seg_count_high(const struct index_seg *seg, uint32_t bit_shift)
{
    uint32_t n = 0;
    for (uint32_t i = 0; i < seg->cap; i++) {
        const struct index_slot *s = &seg->slots[i];
        if (s->addr_tag != 0) n += (hash_top24(s->addr_tag) >> bit_shift) & 1;
    }
    return n;
}

/* Splits seg (local depth < 24) into two halves on the next hash bit. Returns 0 or -ENOMEM. */
static int seg_split(struct index *ix, struct index_seg *seg, uint32_t top24)
{
    IDEM_ASSERT(seg->local_depth < INDEX_DEPTH_MAX);
    if (seg->local_depth == ix->global_depth && dir_double(ix) != 0) return -ENOMEM;
    uint32_t bit_shift = INDEX_DEPTH_MAX - 1 - seg->local_depth; /* within top24 */
    uint32_t n1 = seg_count_high(seg, bit_shift);
    struct index_seg *half[2];
    half[0] = seg_new(ix, seg_cap_for(seg->count - n1), seg->local_depth + 1);
    half[1] = seg_new(ix, seg_cap_for(n1), seg->local_depth + 1);
    if (!half[0] || !half[1]) {
        for (int k = 0; k < 2; k++) {
            if (half[k]) seg_free(ix, half[k]);
        }
        return -ENOMEM;
    }
    for (uint32_t i = 0; i < seg->cap; i++) {
        const struct index_slot *s = &seg->slots[i];
        if (s->addr_tag != 0) seg_place(half[(hash_top24(s->addr_tag) >> bit_shift) & 1], s);
    }
    IDEM_ASSERT(half[0]->count + half[1]->count == seg->count);
    uint32_t shift = ix->global_depth - seg->local_depth;
    size_t first = (dir_pos(ix, top24) >> shift) << shift;
    size_t n = (size_t)1 << shift;
    IDEM_ASSERT(dir_at(ix, first)->seg == seg && dir_at(ix, first + n - 1)->seg == seg);
    dir_set(ix, first, n / 2, half[0]);
    dir_set(ix, first + n / 2, n / 2, half[1]);
    seg_free(ix, seg);
    IDEM_DEBUG_ASSERT(seg_check(half[0], (top24 >> bit_shift) & ~UINT32_C(1)));
    IDEM_DEBUG_ASSERT(seg_check(half[1], (top24 >> bit_shift) | 1));
    return 0;
}

/* Makes room for one more entry in the segment of top24: grows or splits (bounded: each split
 * deepens by one, at most 24 splits plus grows). Returns the segment, or NULL if full or out of
 * memory. */
static struct index_seg *seg_make_room_slow(struct index *ix, uint32_t top24)
{
    for (uint32_t round = 0; round < 2 * INDEX_DEPTH_MAX + 64; round++) {
        struct index_seg *seg = dir_of(ix, top24)->seg;
        if (seg->count + 1 <= seg_limit(seg->cap)) return seg;
        if (seg->cap == SEG_CAP_MAX && seg->local_depth == INDEX_DEPTH_MAX)
            return seg->count + 1 <= HARD_LIMIT(seg->cap) ? seg : NULL;
        if (ix->test_refuse_rebuilds) return NULL;
        int64_t t0_us = util_monotonic_us(), c0_us = util_thread_cpu_us();
        ix->gen++; /* slots move */
        if (ix->old_dir) dir_move_some(ix, ix->dir_move_step);
        int rc = seg->cap < SEG_CAP_MAX ? seg_grow(ix, seg, top24) : seg_split(ix, seg, top24);
        uint64_t pause_us = (uint64_t)(util_monotonic_us() - t0_us);
        uint64_t cpu_us = (uint64_t)(util_thread_cpu_us() - c0_us);
        if (pause_us > ix->max_split_us) ix->max_split_us = pause_us;
        if (cpu_us > ix->max_split_cpu_us) ix->max_split_cpu_us = cpu_us;
        ix->splits++;
        ix->split_cpu_hist[cpu_us < SPLIT_HIST_US ? cpu_us : SPLIT_HIST_US - 1]++;
        if (rc != 0) return NULL;
    }
    IDEM_ASSERT(!"seg_make_room did not converge");
    return NULL;
}

void index_test_refuse_rebuilds(struct index *ix, int on)
{
    ix->test_refuse_rebuilds = on;
}

/* The segment for top24 with room for one more entry (growing or splitting it if need be), or
 * NULL (see index_insert). */
static inline struct index_seg *seg_make_room(struct index *ix, uint32_t top24)
{
    struct index_seg *seg = dir_of(ix, top24)->seg;
    return seg->count + 1 <= seg_limit(seg->cap) ? seg : seg_make_room_slow(ix, top24);
}

size_t index_insert_growth(const struct index *ix, uint64_t h, size_t room)
{
    uint32_t top24 = hash_top24(h);
    const struct index_seg *seg = dir_of(ix, top24)->seg;
    if (seg->count + 1 <= seg_limit(seg->cap)) return 0;
    if (seg->cap == SEG_CAP_MAX && seg->local_depth == INDEX_DEPTH_MAX) return 0; /* no rebuild */
    if (seg->cap < SEG_CAP_MAX) { /* seg_grow: the next step's block, the old one freed */
        uint32_t cap = seg_cap_for(seg->count + 1);
        if (cap <= seg->cap) cap = seg->cap + 1;
        return seg_bytes(cap) - seg_bytes(seg->cap);
    }
    /* seg_split: the halves' blocks as it sizes them (their entries counted as it counts
     * them), the old block freed, and a directory doubled when the segment spans one entry: 2n
     * new entries beside the n old ones until they are moved (a doubling under way is finished
     * first, freeing its old half). Each half is at most the block it leaves: where that bound
     * is within room, the entries are not counted. */
    size_t dir = 0;
    if (seg->local_depth == ix->global_depth)
        dir = 3 * ((size_t)1 << ix->global_depth) * sizeof(*ix->dir) - dir_bytes(ix);
    if (seg_bytes(seg->cap) + dir <= room) return seg_bytes(seg->cap) + dir;
    uint32_t bit_shift = INDEX_DEPTH_MAX - 1 - seg->local_depth;
    uint32_t n1 = seg_count_high(seg, bit_shift);
    uint32_t cap0 = seg_cap_for(seg->count - n1), cap1 = seg_cap_for(n1);
    size_t bytes = seg_bytes(cap0) + seg_bytes(cap1) - seg_bytes(seg->cap) + dir;
    /* seg_cap_for leaves a half room for the key (at most 68% full, where a rebuild comes past
     * 85%) unless it is at SEG_CAP_MAX: a half that took almost all the entries is split again,
     * which is not counted (uniform hashes make it vanishingly rare: the function is then no
     * bound). */
    return bytes;
}

/* Presizing: the fewest segments (2^depth) whose expected share, plus `sigmas` standard
 * deviations (binomial, ~sqrt(share)) for the luckiest of them, stays under the load limit of
 * one ladder step; then the smallest such step. With 5, inserting expected_keys uniform hashes
 * rebuilds nothing, at some memory cost (up to ~28 B/key at expected_keys); with 3, about one
 * segment in 1000 grows once, and the index takes about what growth would have made. False if
 * even 2^24 full segments could not hold expected_keys. */
static bool presize(uint64_t expected_keys, uint32_t sigmas, uint32_t *depth, uint32_t *cap)
{
    if (expected_keys >= (UINT64_C(1) << 62)) return false; /* and no sum below overflows */
    for (uint32_t d = 0; d <= INDEX_DEPTH_MAX; d++) {
        uint64_t share = (expected_keys >> d) + 1;
        uint64_t need = share + sigmas * (uint64_t)sqrt((double)share) + 1;
        if (need > seg_limit(SEG_CAP_MAX)) continue;
        *depth = d;
        *cap = SEG_CAP_MAX;
        for (uint32_t k = 1; k < 64 && ladder_cap(k) >= SEG_CAP_MIN; k++) {
            if (seg_limit(ladder_cap(k)) < need) break;
            *cap = ladder_cap(k);
        }
        return true;
    }
    return false;
}

static int create_sized(uint64_t expected_keys, uint32_t sigmas, struct index **out)
{
    *out = NULL;
    uint32_t depth, cap;
    if (!presize(expected_keys, sigmas, &depth, &cap)) return -ENOMEM;
    struct index *ix = calloc(1, sizeof(*ix));
    if (!ix) return -ENOMEM;
    imem_init(&ix->mem);
    size_t n = (size_t)1 << depth;
    ix->dir = calloc(n, sizeof(*ix->dir));
    if (!ix->dir) goto out_free_segs;
    ix->global_depth = depth;
    ix->dir_ready = n;
    ix->dir_move_step = DIR_MOVE_STEP;
    for (size_t i = 0; i < n; i++) {
        ix->dir[i] = (struct index_dirent){.seg = seg_new(ix, cap, depth), .cap = cap};
        if (!ix->dir[i].seg) goto out_free_segs;
    }
    *out = ix;
    return 0;

out_free_segs:
    imem_destroy(&ix->mem); /* and every segment with it */
    free(ix->dir);
    free(ix);
    return -ENOMEM;
}

size_t index_presize_bytes(uint64_t expected_keys)
{
    uint32_t depth, cap;
    if (!presize(expected_keys, 5, &depth, &cap)) return SIZE_MAX;
    return ((size_t)1 << depth) * (seg_bytes(cap) + sizeof(struct index_dirent)) +
           sizeof(struct index);
}

int index_create(uint64_t expected_keys, struct index **out)
{
    return create_sized(expected_keys, 5, out);
}

int index_create_snug(uint64_t expected_keys, struct index **out)
{
    return create_sized(expected_keys, 3, out);
}

void index_destroy(struct index *ix)
{
    if (!ix) return;
    imem_destroy(&ix->mem); /* and every segment with it */
    free(ix->dir);
    free(ix->old_dir);
    free(ix);
}

/* The slot of h's key (eq says which candidate it is), or NULL; *empty is the empty slot that
 * ended the walk (NULL when none did). */
static struct index_slot *walk_find(const struct index *ix, uint64_t h,
                                    int (*eq)(void *ctx, uint64_t addr), void *ctx,
                                    struct index_slot **empty)
{
    const struct index_dirent *de = dir_of(ix, hash_top24(h));
    struct index_slot *slots = de->seg->slots;
    uint32_t cap = (uint32_t)de->cap;
    uint64_t tag = h & TAG_MASK;
    uint32_t lo = (uint32_t)h;
    uint32_t i = seg_home(lo, cap);
    *empty = NULL;
    for (uint32_t n = 0; n < cap; n++) {
        struct index_slot *s = &slots[i];
        if (s->addr_tag == 0) {
            *empty = s;
            return NULL;
        }
        if (s->hash_lo == lo && (s->addr_tag & TAG_MASK) == tag &&
            eq(ctx, s->addr_tag & INDEX_ADDR_MASK))
            return s;
        if (++i == cap) i = 0;
    }
    return NULL;
}

struct index_slot *index_find(struct index *ix, uint64_t h, int (*eq)(void *ctx, uint64_t addr),
                              void *ctx)
{
    struct index_slot *empty;
    struct index_slot *s = walk_find(ix, h, eq, ctx, &empty);
    if (empty) {
        ix->miss.h = h;
        ix->miss.gen = ix->gen;
        ix->miss.slot = empty;
    }
    return s;
}

struct index_slot *index_lookup(const struct index *ix, uint64_t h,
                                int (*eq)(void *ctx, uint64_t addr), void *ctx)
{
    struct index_slot *empty;
    return walk_find(ix, h, eq, ctx, &empty);
}

void index_prefetch(const struct index *ix, uint64_t h)
{
    const struct index_dirent *de = dir_of(ix, hash_top24(h));
    __builtin_prefetch(&de->seg->slots[seg_home((uint32_t)h, (uint32_t)de->cap)]);
}

/* The first slot from h's home, within `probes` positions, whose stored hash bits equal h's. */
static const struct index_slot *first_with_hash(const struct index *ix, uint64_t h, uint32_t probes)
{
    const struct index_dirent *de = dir_of(ix, hash_top24(h));
    const struct index_slot *slots = de->seg->slots;
    uint32_t cap = (uint32_t)de->cap;
    uint32_t i = seg_home((uint32_t)h, cap);
    for (uint32_t n = 0; n < cap && n < probes; n++) {
        const struct index_slot *s = &slots[i];
        if (s->addr_tag == 0) return NULL;
        if (s->hash_lo == (uint32_t)h && (s->addr_tag & TAG_MASK) == (h & TAG_MASK)) return s;
        if (++i == cap) i = 0;
    }
    return NULL;
}

const struct index_slot *index_peek(const struct index *ix, uint64_t h)
{
    return first_with_hash(ix, h, PEEK_PROBES);
}

bool index_has_hash(const struct index *ix, uint64_t h)
{
    return first_with_hash(ix, h, UINT32_MAX) != NULL;
}

struct index_slot *index_find_addr(struct index *ix, uint64_t h, uint64_t addr)
{
    const struct index_dirent *de = dir_of(ix, hash_top24(h));
    struct index_slot *slots = de->seg->slots;
    uint32_t cap = (uint32_t)de->cap;
    uint64_t want = (h & TAG_MASK) | addr;
    uint32_t i = seg_home((uint32_t)h, cap);
    for (uint32_t n = 0; n < cap; n++) {
        struct index_slot *s = &slots[i];
        if (s->addr_tag == 0) return NULL;
        if (s->addr_tag == want && s->hash_lo == (uint32_t)h) return s;
        if (++i == cap) i = 0;
    }
    return NULL;
}

/* The slots whose stored hash bits match h's top 24 and the top 16 of its low 32 (h's low 16
 * bits unknown, as in an age-heap entry). Without them the home is known to within one:
 * lo * cap >> 32 moves by less than one when lo's low 16 bits change, as cap <= 2^16. The run
 * starts at the lower candidate or, when that slot is empty, at the next. */
struct like_walk {
    const struct index_slot *slots;
    uint64_t tag;
    uint32_t cap, i, left, lo_top;
};

static void like_begin(const struct index *ix, uint64_t h, struct like_walk *w)
{
    const struct index_dirent *de = dir_of(ix, hash_top24(h));
    w->slots = de->seg->slots;
    w->tag = h & TAG_MASK;
    w->cap = (uint32_t)de->cap;
    w->lo_top = (uint32_t)h >> 16;
    w->i = seg_home(w->lo_top << 16, w->cap);
    w->left = w->cap;
    if (w->slots[w->i].addr_tag == 0 && ++w->i == w->cap) w->left = 0;
}

static const struct index_slot *like_next(struct like_walk *w)
{
    while (w->left) {
        const struct index_slot *s = &w->slots[w->i];
        if (s->addr_tag == 0) break;
        w->left--;
        if (++w->i == w->cap) w->i = 0;
        if ((s->addr_tag & TAG_MASK) == w->tag && s->hash_lo >> 16 == w->lo_top) return s;
    }
    w->left = 0;
    return NULL;
}

int index_holds(const struct index *ix, uint64_t h, uint64_t addr)
{
    struct like_walk w;
    like_begin(ix, h, &w);
    for (const struct index_slot *s; (s = like_next(&w));)
        if ((s->addr_tag & INDEX_ADDR_MASK) == addr) return 1;
    return 0;
}

size_t index_slots_like(const struct index *ix, uint64_t h, const struct index_slot **out,
                        size_t max)
{
    struct like_walk w;
    like_begin(ix, h, &w);
    size_t n = 0;
    for (const struct index_slot *s; n < max && (s = like_next(&w));)
        out[n++] = s;
    return n;
}

struct index_slot *index_insert(struct index *ix, uint64_t h, uint64_t addr, uint32_t aux)
{
    IDEM_ASSERT(addr != 0 && addr <= INDEX_ADDR_MASK);
    struct index_seg *seg = seg_make_room(ix, hash_top24(h));
    if (!seg) return NULL;
    struct index_slot s = {.addr_tag = (h & TAG_MASK) | addr, .hash_lo = (uint32_t)h, .aux = aux};
    struct index_slot *slot;
    if (ix->miss.slot && ix->miss.h == h && ix->miss.gen == ix->gen) {
        /* seg_make_room rebuilt nothing (gen): the slot is still the first empty one. */
        IDEM_ASSERT(ix->miss.slot->addr_tag == 0);
        slot = ix->miss.slot;
        *slot = s;
        seg->count++;
    } else {
        slot = seg_place(seg, &s);
    }
    ix->gen++; /* the remembered slot, if any, is taken or stale */
    ix->count++;
    return slot;
}

struct index_slot *index_insert_ordered(struct index *ix, uint64_t h, uint64_t addr)
{
    IDEM_ASSERT(addr != 0 && addr <= INDEX_ADDR_MASK);
    struct index_seg *seg = seg_make_room(ix, hash_top24(h));
    if (!seg) return NULL;
    struct index_slot s = {.addr_tag = (h & TAG_MASK) | addr, .hash_lo = (uint32_t)h};
    uint32_t cap = seg->cap, home = seg_home(s.hash_lo, cap);
    /* Positions are counted from the run's first home without wrapping (its end may pass cap). */
    uint32_t run_home = RUN_HOME(seg->run), run_end = RUN_END(seg->run);
    uint32_t from = home;
    bool joins = false;
    if (seg->run && home + RUN_BEHIND >= run_home && home <= run_end + 1) {
        /* [run_home, run_end] is in use: an entry a little behind the run (homes come a little
         * out of order) takes an empty slot before it, else the first one after it. */
        while (from < run_home && seg->slots[from].addr_tag != 0)
            from++;
        joins = from >= run_home;
        if (joins) from = run_end + 1;
    }
    uint32_t start = from >= cap ? from - cap : from;
    uint32_t at = seg_place_at(seg, &s, start);
    /* Where it went, unwrapped: at or after `from`, before from + cap. */
    uint32_t end = from + (at >= start ? at - start : at + cap - start);
    if (joins) {
        seg->run = RUN(home < run_home ? home : run_home, end); /* [home, run_home) was in use */
    } else if (!seg->run || home > run_end + 1 || home + RUN_BEHIND < run_home) {
        seg->run = RUN(home, end); /* the first run, or the next sweep over the segment */
    }
    ix->gen++; /* the remembered slot of index_find, if any, is taken or stale */
    ix->count++;
    return &seg->slots[at];
}

void index_remove(struct index *ix, struct index_slot *slot)
{
    IDEM_ASSERT(slot->addr_tag != 0);
    struct index_seg *seg = dir_of(ix, hash_top24(slot->addr_tag))->seg;
    IDEM_ASSERT(slot >= seg->slots && slot < seg->slots + seg->cap);
    uint32_t cap = seg->cap;
    uint32_t hole = (uint32_t)(slot - seg->slots);
    uint32_t j = hole;
    /* Backward shift: pull each following entry of the run into the hole unless its home lies
     * cyclically in (hole, j], which would put it before its home. */
    for (uint32_t n = 1; n < cap; n++) {
        if (++j == cap) j = 0;
        struct index_slot *s = &seg->slots[j];
        if (s->addr_tag == 0) break;
        uint32_t home = seg_home(s->hash_lo, cap);
        uint32_t dist_home = j >= home ? j - home : j + cap - home;
        uint32_t dist_hole = j >= hole ? j - hole : j + cap - hole;
        if (dist_home >= dist_hole) {
            seg->slots[hole] = *s;
            hole = j;
        }
    }
    seg->slots[hole] = (struct index_slot){0};
    seg->run = 0;
    ix->gen++;
    IDEM_ASSERT(seg->count > 0 && ix->count > 0);
    seg->count--;
    ix->count--;
}

bool index_check(const struct index *ix)
{
    size_t n = (size_t)1 << ix->global_depth;
    uint64_t count = 0;
    if (ix->old_dir ? ix->dir_ready >= n || ix->dir_ready % 2 : ix->dir_ready != n) return false;
    for (size_t i = 0; ix->old_dir && i < ix->dir_ready / 2; i++)
        if (ix->old_dir[i].seg) return false; /* below dir_ready every old entry was moved */
    for (size_t i = 0; i < n;) {
        const struct index_seg *seg = dir_at(ix, i)->seg;
        uint32_t shift = ix->global_depth - seg->local_depth;
        for (size_t j = i; j < i + ((size_t)1 << shift); j++)
            if (dir_at(ix, j)->seg != seg || dir_at(ix, j)->cap != seg->cap) return false;
        if (!seg_check(seg, (uint32_t)(i >> shift))) return false;
        count += seg->count;
        i += (size_t)1 << shift;
    }
    return count == ix->count;
}

uint64_t index_count(const struct index *ix)
{
    return ix->count;
}

uint64_t index_segments(const struct index *ix)
{
    return ix->seg_count;
}

/* The directory's bytes, with the old one while a doubling is under way. */
static size_t dir_bytes(const struct index *ix)
{
    size_t n = (size_t)1 << ix->global_depth;
    return (n + (ix->old_dir ? n / 2 : 0)) * sizeof(*ix->dir);
}

size_t index_memory_bytes(struct index *ix)
{
    return imem_bytes(&ix->mem) + dir_bytes(ix) + sizeof(*ix);
}

size_t index_live_bytes(const struct index *ix)
{
    return ix->mem.live_bytes + dir_bytes(ix) + sizeof(*ix);
}

void index_set_dir_move_step(struct index *ix, size_t entries)
{
    ix->dir_move_step = entries > 0 ? entries : 1;
}

size_t index_dir_unmoved(const struct index *ix)
{
    return ix->old_dir ? ((size_t)1 << (ix->global_depth - 1)) - ix->dir_ready / 2 : 0;
}

int index_start_ahead(struct index *ix)
{
    return imem_start(&ix->mem);
}

uint64_t index_max_split_us(const struct index *ix)
{
    return ix->max_split_us;
}

uint64_t index_max_split_cpu_us(const struct index *ix)
{
    return ix->max_split_cpu_us;
}

uint64_t index_splits(const struct index *ix)
{
    return ix->splits;
}

uint64_t index_split_cpu_quantile_us(const struct index *ix, uint32_t per_mille)
{
    uint64_t want = (ix->splits * per_mille + 999) / 1000, seen = 0;
    for (uint32_t us = 0; us < SPLIT_HIST_US; us++) {
        seen += ix->split_cpu_hist[us];
        if (seen >= want && seen > 0) return us;
    }
    return 0;
}

uint64_t index_cold_blocks(struct index *ix)
{
    return imem_misses(&ix->mem);
}

/* Visits the entries of seg whose hash_lo lies in [lo_begin, lo_end): their homes lie in
 * [home(lo_begin), home(lo_end - 1)] (fastrange is monotonic) and each sits in the occupied run
 * that starts at or before its slot, so scanning that range then on to the next empty slot
 * finds all of them. Returns the number of positions looked at (>= 1). */
static uint32_t scan_seg(struct index_seg *seg, uint64_t lo_begin, uint64_t lo_end,
                         void (*fn)(void *ctx, struct index_slot *slot), void *ctx)
{
    IDEM_ASSERT(lo_begin < lo_end && lo_end <= (UINT64_C(1) << 32));
    uint32_t p0 = seg_home((uint32_t)lo_begin, seg->cap);
    uint32_t p1 = seg_home((uint32_t)(lo_end - 1), seg->cap);
    uint32_t i = p0;
    uint32_t n = 0;
    for (; n < seg->cap; n++) {
        struct index_slot *s = &seg->slots[i];
        if (s->addr_tag == 0 && n > p1 - p0) break;
        if (s->addr_tag != 0 && s->hash_lo >= lo_begin && s->hash_lo < lo_end) fn(ctx, s);
        if (++i == seg->cap) i = 0;
    }
    return n > 0 ? n : 1;
}

/*
 * Cursor encoding: bits 32..55 hold prefix, a 24-bit top-hash prefix; bits 0..31 hold lo, a
 * hash_lo value. Meaning: every entry with top24 < prefix has been visited, and so has every
 * entry whose top24 lies in the block of prefix's segment at the time and whose hash_lo < lo.
 * prefix is always the first prefix of its segment's block: blocks only ever split (a split
 * refines a block into two consecutive halves; directory doubling changes no block), so the
 * block holding prefix still starts at prefix, and the statement stays true across splits and
 * doublings. Walking prefixes in increasing order is the order that splitting refines (the
 * directory is indexed by top bits, so this is Redis dictScan's reverse-binary order read
 * through a bit reversal). Within a segment, hash_lo ranges survive rebuilds because homes are
 * recomputed from hash_lo. Entries in the other half of a block split mid-scan may be visited
 * twice. 0 is the start and the end.
 */
uint64_t index_scan(struct index *ix, uint64_t cursor, uint32_t max_slots,
                    void (*fn)(void *ctx, struct index_slot *slot), void *ctx)
{
    uint64_t prefix = cursor >> 32;
    uint64_t lo = cursor & UINT32_MAX;
    uint64_t budget = max_slots > 0 ? max_slots : 1;
    if (prefix >= (UINT64_C(1) << INDEX_DEPTH_MAX))
        return 0; /* not a cursor this function returned */
    while (budget > 0) {
        struct index_seg *seg = dir_of(ix, (uint32_t)prefix)->seg;
        uint32_t block = UINT32_C(1) << (INDEX_DEPTH_MAX - seg->local_depth);
        if ((prefix & (block - 1)) != 0) {
            /* Only a cursor not from this function: restart its block (revisits, misses none). */
            prefix &= ~(uint64_t)(block - 1);
            lo = 0;
        }
        uint64_t width = (budget << 32) / seg->cap;
        uint64_t lo_end = lo + (width > 0 ? width : 1);
        if (lo_end > (UINT64_C(1) << 32)) lo_end = UINT64_C(1) << 32;
        uint32_t seen = scan_seg(seg, lo, lo_end, fn, ctx);
        budget = seen < budget ? budget - seen : 0;
        if (lo_end < (UINT64_C(1) << 32)) {
            lo = lo_end;
            continue;
        }
        prefix = (prefix | (block - 1)) + 1;
        lo = 0;
        if (prefix == (UINT64_C(1) << INDEX_DEPTH_MAX)) return 0;
    }
    return (prefix << 32) | lo;
}
