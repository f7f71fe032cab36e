/*
 * index_arena.c: the hash index's own address space (index_arena.h).
 *
 * Blocks are carved from the top of the newest region, or taken from a free list: the list of
 * exactly the size asked for when it has one (a growth wave asks for a few ladder sizes over and
 * over), else the smallest larger one, split. A freed block merges with free neighbours, so the
 * space of blocks of one size serves later requests of another (growth frees one size in waves
 * and asks for the next). Regions are reserved as address space (PROT_NONE) aligned to 2 MiB and
 * made writable in steps; the range iarena_populate faults in ahead of the top is advised
 * MADV_HUGEPAGE first, and so is all that is made writable while huge_on_commit holds. Memory is
 * never given back before iarena_destroy (the index never shrinks: index.c).
 *
 * Under AddressSanitizer the payloads of free blocks and the space beyond a region's top are
 * poisoned, so a read of a freed segment is reported; tags stay readable and carry a check word,
 * so an overrun into the next block's tag is caught when that block is freed or merged.
 */
#include "index_arena.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#include "util.h"

#if defined(__SANITIZE_ADDRESS__)
#define IARENA_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define IARENA_ASAN 1
#endif
#endif
#ifdef IARENA_ASAN
#include <sanitizer/asan_interface.h>
#define POISON(p, n)   ASAN_POISON_MEMORY_REGION((p), (n))
#define UNPOISON(p, n) ASAN_UNPOISON_MEMORY_REGION((p), (n))
#else
#define POISON(p, n)   ((void)(p), (void)(n))
#define UNPOISON(p, n) ((void)(p), (void)(n))
#endif

#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23 /* Linux 5.14 */
#endif

#define HUGE_BYTES    ((size_t)2 << 20)
#define COMMIT_STEP   ((size_t)4 << 20)  /* address space made writable at a time */
#define RESERVE_FIRST ((size_t)4 << 30)  /* a region's address space, halved while refused */
#define RESERVE_MAX   ((size_t)32 << 30) /* sizes stay within 32 bits of granules */
#define MIN_BLOCK     2u                 /* granules: a tag and a free block's two links */
#define TAG_CHECK     0x1dea7a9u

struct iarena_region {
    uint8_t *base; /* HUGE_BYTES-aligned */
    size_t reserved, committed, top;
    size_t populated; /* bytes from base made resident by iarena_populate */
    uint32_t last;    /* size of the block that ends at top, 0 when top is 0 */
    struct iarena_region *next;
};

struct tag {
    uint32_t size; /* granules, this tag included */
    uint32_t prev; /* the preceding block's size, 0 for a region's first */
    uint32_t used;
    uint32_t check;
};

struct iarena_free {
    struct tag t;
    struct iarena_free *fnext, *fprev;
};

_Static_assert(sizeof(struct tag) == IARENA_GRAN, "a tag is one granule");
_Static_assert(sizeof(struct iarena_free) <= MIN_BLOCK * IARENA_GRAN, "a free block's links fit");

static void tag_set(struct tag *t, uint32_t size, uint32_t prev, uint32_t used)
{
    UNPOISON(t, sizeof *t);
    t->size = size;
    t->prev = prev;
    t->used = used;
    t->check = TAG_CHECK ^ size ^ (prev << 7) ^ used;
}

static bool tag_ok(const struct tag *t)
{
    return t->check == (TAG_CHECK ^ t->size ^ (t->prev << 7) ^ t->used) && t->size >= MIN_BLOCK &&
           t->used <= 1;
}

static struct tag *tag_at(const struct iarena_region *r, size_t off)
{
    return (struct tag *)(r->base + off);
}

static size_t tag_off(const struct iarena_region *r, const struct tag *t)
{
    return (size_t)((const uint8_t *)t - r->base);
}

static struct iarena_region *region_of(const struct iarena *a, const void *p)
{
    for (struct iarena_region *r = a->regions; r; r = r->next) {
        if ((const uint8_t *)p >= r->base && (const uint8_t *)p < r->base + r->top) return r;
    }
    return NULL;
}

/* ---- Free lists ---- */

static struct iarena_free **list_head(struct iarena *a, uint32_t size)
{
    return size <= IARENA_CLASS_MAX ? &a->lists[size] : &a->large;
}

static void list_insert(struct iarena *a, struct iarena_free *f)
{
    uint32_t size = f->t.size;
    struct iarena_free **head = list_head(a, size);
    UNPOISON(f, sizeof *f);
    f->fprev = NULL;
    f->fnext = *head;
    if (*head) (*head)->fprev = f;
    *head = f;
    if (size <= IARENA_CLASS_MAX) a->nonempty[size / 64] |= UINT64_C(1) << (size % 64);
    a->free_bytes += (size_t)size * IARENA_GRAN;
    POISON((uint8_t *)f + sizeof *f, (size_t)size * IARENA_GRAN - sizeof *f);
}

static void list_unlink(struct iarena *a, struct iarena_free *f)
{
    uint32_t size = f->t.size;
    struct iarena_free **head = list_head(a, size);
    if (f->fprev)
        f->fprev->fnext = f->fnext;
    else
        *head = f->fnext;
    if (f->fnext) f->fnext->fprev = f->fprev;
    if (size <= IARENA_CLASS_MAX && !*head) a->nonempty[size / 64] &= ~(UINT64_C(1) << (size % 64));
    a->free_bytes -= (size_t)size * IARENA_GRAN;
}

/* The smallest size >= g with a non-empty list, or 0. */
static uint32_t first_nonempty(const struct iarena *a, uint32_t g)
{
    for (uint32_t w = g / 64; w < IDEM_ARRAY_LEN(a->nonempty); w++) {
        uint64_t bits = a->nonempty[w];
        if (w == g / 64) bits &= ~UINT64_C(0) << (g % 64);
        if (bits) return w * 64 + (uint32_t)__builtin_ctzll(bits);
    }
    return 0;
}

/* Tells the block after t (or the region's top) t's size. */
static void next_learns_size(struct iarena_region *r, const struct tag *t)
{
    size_t end = tag_off(r, t) + (size_t)t->size * IARENA_GRAN;
    if (end == r->top) {
        r->last = t->size;
        return;
    }
    struct tag *n = tag_at(r, end);
    IDEM_ASSERT(tag_ok(n));
    tag_set(n, n->size, t->size, n->used);
}

/* ---- Regions ---- */

static bool commit(struct iarena *a, struct iarena_region *r, size_t upto)
{
    if (upto <= r->committed) return true;
    size_t to = IDEM_ALIGN_UP(upto, COMMIT_STEP);
    if (to > r->reserved) to = r->reserved;
    uint8_t *p = r->base + r->committed;
    size_t n = to - r->committed;
    if (mprotect(p, n, PROT_READ | PROT_WRITE) != 0) return false;
    if (a->huge_on_commit) (void)madvise(p, n, MADV_HUGEPAGE);
    POISON(p, n);
    r->committed = to;
    return true;
}

static struct iarena_region *region_new(struct iarena *a, size_t need)
{
    size_t want = a->reserve_bytes;
    size_t least = IDEM_ALIGN_UP(need, HUGE_BYTES);
    if (want < least) want = least;
    if (want > RESERVE_MAX) return NULL;
    uint8_t *map;
    for (;;) {
        map = mmap(NULL, want + HUGE_BYTES, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE,
                   -1, 0);
        if (map != MAP_FAILED) break;
        if (want / 2 < least || want / 2 < HUGE_BYTES) return NULL;
        want /= 2; /* an address-space limit: ask for less */
    }
    uint8_t *base = (uint8_t *)IDEM_ALIGN_UP((uintptr_t)map, HUGE_BYTES);
    if (base > map) munmap(map, (size_t)(base - map));
    size_t tail = (size_t)(map + want + HUGE_BYTES - (base + want));
    if (tail) munmap(base + want, tail);
    struct iarena_region *r = calloc(1, sizeof *r);
    if (!r) {
        munmap(base, want);
        return NULL;
    }
    r->base = base;
    r->reserved = want;
    r->next = a->regions;
    a->regions = r;
    a->reserve_bytes = want;
    return r;
}

/* A used block of g granules from the newest region's top. */
static struct tag *carve(struct iarena *a, uint32_t g)
{
    size_t bytes = (size_t)g * IARENA_GRAN;
    struct iarena_region *r = a->regions;
    while (r && r->reserved - r->top < bytes) /* an older region's top may have room again */
        r = r->next;
    if (!r) r = region_new(a, bytes);
    if (!r || !commit(a, r, r->top + bytes)) return NULL;
    struct tag *t = tag_at(r, r->top);
    if (r->top + bytes > r->populated) a->cold_carves++;
    UNPOISON(t, bytes);
    tag_set(t, g, r->last, 1);
    r->last = g;
    r->top += bytes;
    a->carved_bytes += bytes;
    return t;
}

/* A used block of g granules from the free lists, or NULL. */
static struct tag *take_free(struct iarena *a, uint32_t g)
{
    struct iarena_free *f = NULL;
    uint32_t c = g <= IARENA_CLASS_MAX ? first_nonempty(a, g) : 0;
    if (c) f = a->lists[c];
    for (struct iarena_free *l = c ? NULL : a->large; l && !f; l = l->fnext)
        if (l->t.size >= g) f = l;
    if (!f) return NULL;
    list_unlink(a, f);
    struct tag *t = &f->t;
    struct iarena_region *r = region_of(a, t);
    IDEM_ASSERT(r);
    uint32_t left = t->size - g;
    UNPOISON(t, (size_t)t->size * IARENA_GRAN);
    if (left >= MIN_BLOCK) {
        struct tag *rest = (struct tag *)((uint8_t *)t + (size_t)g * IARENA_GRAN);
        tag_set(t, g, t->prev, 1);
        tag_set(rest, left, g, 0);
        next_learns_size(r, rest);
        list_insert(a, (struct iarena_free *)rest);
    } else {
        tag_set(t, t->size, t->prev, 1);
    }
    return t;
}

/* ---- The interface ---- */

void iarena_init(struct iarena *a)
{
    memset(a, 0, sizeof *a);
    a->reserve_bytes = RESERVE_FIRST;
    a->huge_on_commit = true;
}

void *iarena_alloc(struct iarena *a, size_t bytes)
{
    if (bytes == 0 || bytes > RESERVE_MAX / 2) return NULL;
    size_t g = 1 + (bytes + IARENA_GRAN - 1) / IARENA_GRAN;
    if (g < MIN_BLOCK) g = MIN_BLOCK;
    struct tag *t = take_free(a, (uint32_t)g);
    if (!t) t = carve(a, (uint32_t)g);
    if (!t) return NULL;
    a->used_bytes += (size_t)t->size * IARENA_GRAN;
    return (uint8_t *)t + IARENA_GRAN;
}

void iarena_free(struct iarena *a, void *p)
{
    if (!p) return;
    struct tag *t = (struct tag *)((uint8_t *)p - IARENA_GRAN);
    struct iarena_region *r = region_of(a, t);
    IDEM_ASSERT(r && tag_ok(t) && t->used);
    a->used_bytes -= (size_t)t->size * IARENA_GRAN;
    uint32_t size = t->size, prev = t->prev;
    size_t end = tag_off(r, t) + (size_t)size * IARENA_GRAN;
    if (end < r->top) { /* merge the next block when free */
        struct tag *n = tag_at(r, end);
        IDEM_ASSERT(tag_ok(n) && n->prev == size);
        if (!n->used) {
            list_unlink(a, (struct iarena_free *)n);
            size += n->size;
        }
    }
    if (prev) { /* and the previous one */
        struct tag *pt = (struct tag *)((uint8_t *)t - (size_t)prev * IARENA_GRAN);
        IDEM_ASSERT(tag_ok(pt) && pt->size == prev);
        if (!pt->used) {
            list_unlink(a, (struct iarena_free *)pt);
            size += pt->size;
            prev = pt->prev;
            t = pt;
        }
    }
    end = tag_off(r, t) + (size_t)size * IARENA_GRAN;
    if (end == r->top) { /* the region takes it back */
        r->top = tag_off(r, t);
        r->last = prev;
        a->carved_bytes -= (size_t)size * IARENA_GRAN;
        POISON(t, (size_t)size * IARENA_GRAN);
        return;
    }
    tag_set(t, size, prev, 0);
    next_learns_size(r, t);
    list_insert(a, (struct iarena_free *)t);
}

void iarena_destroy(struct iarena *a)
{
    struct iarena_region *r = a->regions;
    while (r) {
        struct iarena_region *next = r->next;
        UNPOISON(r->base, r->committed);
        munmap(r->base, r->reserved);
        free(r);
        r = next;
    }
    iarena_init(a);
}

/* Where the resident range should end: `ahead` past top, on a huge page boundary. */
static size_t ahead_target(const struct iarena_region *r, size_t ahead)
{
    size_t to = IDEM_ALIGN_UP(r->top + ahead, HUGE_BYTES);
    return to > r->reserved ? r->reserved : to;
}

bool iarena_short(const struct iarena *a, size_t ahead)
{
    const struct iarena_region *r = a->regions;
    return r && r->populated < ahead_target(r, ahead);
}

void iarena_populate_plan(struct iarena *a, size_t ahead, void **p, size_t *n)
{
    *p = NULL;
    *n = 0;
    struct iarena_region *r = a->regions;
    if (!r) return;
    size_t to = ahead_target(r, ahead);
    size_t from = r->populated > r->top ? r->populated : r->top;
    if (from >= to || !commit(a, r, to)) return;
    *p = r->base + from;
    *n = to - from;
}

void iarena_test_refuse_populate(struct iarena *a, int err, unsigned count)
{
    a->test_refuse_err = err;
    __atomic_store_n(&a->test_refusals, count, __ATOMIC_RELEASE);
}

size_t iarena_populate(struct iarena *a, void *p, size_t n)
{
    unsigned left = __atomic_load_n(&a->test_refusals, __ATOMIC_ACQUIRE);
    if (left > 0) { /* only the thread that faults memory in calls it: no other decrement */
        __atomic_store_n(&a->test_refusals, left - 1, __ATOMIC_RELEASE);
        errno = a->test_refuse_err;
        return 0;
    }
    /* Faults the pages in, writable, leaving their contents alone: the owner may be writing
     * blocks carved from this range meanwhile. An older kernel refuses (EINVAL): the pages are
     * then faulted in by their first use. */
    if (n == 0) return 0;
    uintptr_t from = (uintptr_t)p & ~(uintptr_t)4095, to = IDEM_ALIGN_UP((uintptr_t)p + n, 4096);
    /* One huge page per call: the process's memory map stays locked for one fault at a time.
     * Only memory faulted in here is advised onto huge pages: a huge page may need the kernel to
     * compact memory first (milliseconds on a fragmented machine), which this thread can afford
     * and the owner, holding its lock, cannot. What the owner reaches first is faulted in 4 KiB
     * at a time. A kernel without THP refuses the advice: 4 KiB pages then. */
    while (from < to) {
        uintptr_t end = IDEM_ALIGN_UP(from + 1, HUGE_BYTES);
        if (end > to) end = to;
        (void)madvise((void *)from, end - from, MADV_HUGEPAGE);
        if (madvise((void *)from, end - from, MADV_POPULATE_WRITE) != 0) {
            /* Refused (a kernel before 5.14) or out of memory: take the advice back, so that the
             * owner faults this piece in 4 KiB at a time, and report only what was done. */
            int err = errno;
            (void)madvise((void *)from, end - from, MADV_NOHUGEPAGE);
            errno = err;
            return from > (uintptr_t)p ? (size_t)(from - (uintptr_t)p) : 0;
        }
        from = end;
    }
    return n;
}

void iarena_populate_done(struct iarena *a, void *p, size_t n)
{
    for (struct iarena_region *r = a->regions; r; r = r->next) {
        if ((uint8_t *)p < r->base || (uint8_t *)p >= r->base + r->reserved) continue;
        size_t end = (size_t)((uint8_t *)p - r->base) + n;
        if (end > r->populated) r->populated = end;
        return;
    }
}

size_t iarena_resident_bytes(const struct iarena *a)
{
    size_t n = a->carved_bytes;
    for (const struct iarena_region *r = a->regions; r; r = r->next)
        if (r->populated > r->top) n += r->populated - r->top;
    return n;
}

/* Whether f is in the list of its size. */
static bool listed(struct iarena *a, const struct iarena_free *f)
{
    for (const struct iarena_free *l = *list_head(a, f->t.size); l; l = l->fnext)
        if (l == f) return true;
    return false;
}

bool iarena_check(const struct iarena *ac)
{
    struct iarena *a = (struct iarena *)ac; /* list_head wants it writable; nothing changes */
    size_t used = 0, free_b = 0, carved = 0, nfree = 0;
    for (const struct iarena_region *r = a->regions; r; r = r->next) {
        if (r->top > r->committed || r->committed > r->reserved) return false;
        uint32_t prev = 0;
        bool prev_free = false;
        for (size_t off = 0; off < r->top;) {
            const struct tag *t = tag_at(r, off);
            if (!tag_ok(t) || t->prev != prev) return false;
            size_t bytes = (size_t)t->size * IARENA_GRAN;
            if (off + bytes > r->top) return false;
            if (t->used) {
                used += bytes;
            } else {
                if (prev_free || off + bytes == r->top) return false; /* unmerged */
                if (!listed(a, (const struct iarena_free *)t)) return false;
                free_b += bytes;
                nfree++;
            }
            prev_free = !t->used;
            prev = t->size;
            off += bytes;
        }
        if (prev != r->last) return false;
        carved += r->top;
    }
    size_t nlisted = 0;
    for (uint32_t s = 0; s <= IARENA_CLASS_MAX; s++) {
        bool bit = (a->nonempty[s / 64] >> (s % 64)) & 1;
        if (bit != (a->lists[s] != NULL) || (s < MIN_BLOCK && bit)) return false;
        for (const struct iarena_free *l = a->lists[s]; l; l = l->fnext, nlisted++)
            if (l->t.size != s || l->t.used) return false;
    }
    for (const struct iarena_free *l = a->large; l; l = l->fnext, nlisted++)
        if (l->t.size <= IARENA_CLASS_MAX || l->t.used) return false;
    return nlisted == nfree && used == a->used_bytes && free_b == a->free_bytes &&
           carved == a->carved_bytes;
}
