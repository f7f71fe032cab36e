/*
 * test_index_arena.c: the index's arena (src/index_arena.c) and the memory layer on it
 * (src/index_mem.c): blocks never overlap and keep their contents, freed space merges and is
 * reused across sizes, the invariants hold after every step of a random run, memory is on a
 * huge-page mapping, faulting memory in ahead leaves contents alone while the owner writes, and
 * a smashed tag stops the process.
 */
#include <criterion/criterion.h>
#include <errno.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "index_arena.h"
#include "index_mem.h"
#include "testutil.h"
#include "util.h"

static uint64_t next_rand(uint64_t *s)
{
    uint64_t z = (*s += 0x9e3779b97f4a7c15ULL);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
}

/* The byte a block with this id holds at offset i. */
static uint8_t pattern(uint64_t id, size_t i)
{
    return (uint8_t)(id * 131 + i * 7 + (i >> 8));
}

static void fill(uint8_t *p, size_t n, uint64_t id)
{
    for (size_t i = 0; i < n; i++)
        p[i] = pattern(id, i);
}

static bool holds(const uint8_t *p, size_t n, uint64_t id)
{
    for (size_t i = 0; i < n; i++)
        if (p[i] != pattern(id, i)) return false;
    return true;
}

/* The sizes the index asks for (index.c's ladder: 16 + 16 * cap), and odd ones. */
static size_t some_size(uint64_t *rs)
{
    static const uint32_t caps[] = {32,  40,  51,  64,  80,  101, 128, 161,
                                    203, 256, 322, 406, 512, 645, 813, 1024};
    uint64_t r = next_rand(rs);
    if (r % 8 == 0) return 1 + (size_t)(r >> 8) % 40000; /* odd sizes, some larger than a class */
    return 16 + 16 * (size_t)caps[(r >> 8) % IDEM_ARRAY_LEN(caps)];
}

Test(index_arena, random_allocs_and_frees_keep_contents_and_invariants, .timeout = 600)
{
    uint64_t seed = tu_seed("index_arena.random_allocs_and_frees_keep_contents_and_invariants");
    uint64_t rs = seed;
    uint64_t steps = tu_count(200000, 5000000);
    enum { LIVE = 4096 };
    static struct {
        uint8_t *p;
        size_t n;
        uint64_t id;
    } live[LIVE];
    size_t nlive = 0;
    struct iarena a;
    iarena_init(&a);
    for (uint64_t step = 0; step < steps; step++) {
        uint64_t r = next_rand(&rs);
        /* Phases that grow, then shrink, the live set, so merging and the top both get used. */
        bool grow = ((step / 20000) % 2 == 0) ? r % 100 < 70 : r % 100 < 30;
        if ((grow && nlive < LIVE) || nlive == 0) {
            size_t n = some_size(&rs);
            uint8_t *p = iarena_alloc(&a, n);
            cr_assert_not_null(p, "step %llu: alloc of %zu failed (seed %llu)",
                               (unsigned long long)step, n, (unsigned long long)seed);
            cr_assert_eq((uintptr_t)p % 16, 0);
            fill(p, n, step);
            live[nlive].p = p;
            live[nlive].n = n;
            live[nlive].id = step;
            nlive++;
        } else {
            size_t k = (size_t)(r >> 16) % nlive;
            cr_assert(holds(live[k].p, live[k].n, live[k].id),
                      "step %llu: block %llu was overwritten (seed %llu)", (unsigned long long)step,
                      (unsigned long long)live[k].id, (unsigned long long)seed);
            iarena_free(&a, live[k].p);
            live[k] = live[--nlive];
        }
        if (step % 997 == 0)
            cr_assert(iarena_check(&a), "step %llu: invariants broken (seed %llu)",
                      (unsigned long long)step, (unsigned long long)seed);
    }
    for (size_t k = 0; k < nlive; k++) {
        cr_assert(holds(live[k].p, live[k].n, live[k].id));
        iarena_free(&a, live[k].p);
    }
    cr_assert(iarena_check(&a));
    cr_assert_eq(a.used_bytes, 0);
    cr_assert_eq(a.free_bytes, 0, "everything freed merges back into the region");
    cr_assert_eq(a.carved_bytes, 0);
    iarena_destroy(&a);
}

/* Growth frees blocks of one size and asks for a larger one: the space of neighbours freed
 * together serves it, and nothing new is carved. */
Test(index_arena, freed_neighbours_merge_and_serve_a_larger_size)
{
    struct iarena a;
    iarena_init(&a);
    enum { N = 64 };
    uint8_t *small[N];
    for (int i = 0; i < N; i++)
        cr_assert_not_null(small[i] = iarena_alloc(&a, 10336)); /* a 645-slot segment */
    uint8_t *guard = iarena_alloc(&a, 64);                      /* keeps them off the top */
    size_t carved = a.carved_bytes;
    for (int i = 0; i < N; i++)
        iarena_free(&a, small[i]);
    cr_assert(iarena_check(&a));
    cr_assert_eq(a.free_bytes, (size_t)N * (10336 + 16), "one free block of all of them");
    for (int i = 0; i < N / 2; i++) {
        uint8_t *big = iarena_alloc(&a, 16400); /* a 1024-slot segment */
        cr_assert_not_null(big);
        cr_assert_geq(big, small[0]);
        cr_assert_lt(big, small[N - 1] + 10336, "block %d came from outside the freed space", i);
    }
    cr_assert_eq(a.carved_bytes, carved, "nothing was carved from the top");
    cr_assert(iarena_check(&a));
    (void)guard;
    iarena_destroy(&a);
}

/* A block freed at the top goes back to the region, and its free neighbour with it. */
Test(index_arena, a_block_freed_at_the_top_goes_back_to_the_region)
{
    struct iarena a;
    iarena_init(&a);
    uint8_t *p = iarena_alloc(&a, 1000);
    size_t after_p = a.carved_bytes;
    uint8_t *q = iarena_alloc(&a, 2000); /* 2000 + 16 bytes, a multiple of 16 */
    uint8_t *r = iarena_alloc(&a, 3000);
    iarena_free(&a, q);
    cr_assert_eq(a.free_bytes, 2000 + 16);
    iarena_free(&a, r);
    cr_assert_eq(a.free_bytes, 0);
    cr_assert_eq(a.carved_bytes, after_p);
    cr_assert(iarena_check(&a));
    uint8_t *again = iarena_alloc(&a, 5000);
    cr_assert_eq(again, q, "the space is carved again from where q began");
    iarena_free(&a, again);
    iarena_free(&a, p);
    cr_assert_eq(a.carved_bytes, 0);
    iarena_destroy(&a);
}

/* With regions of 2 MiB, a second region opens when the first is full; space the first gets
 * back at its top is carved again before any third region opens. */
Test(index_arena, space_an_older_region_gets_back_at_its_top_is_carved_again)
{
    struct iarena a;
    iarena_init(&a);
    a.reserve_bytes = (size_t)2 << 20;
    enum { N = 200 }; /* 200 x 16 KiB: about 1.6 regions */
    uint8_t *b[N];
    for (int i = 0; i < N; i++)
        cr_assert_not_null(b[i] = iarena_alloc(&a, 16384));
    int first_of_second = 0;
    while (first_of_second < N && b[first_of_second] == b[0] + (size_t)first_of_second * 16400)
        first_of_second++;
    cr_assert(first_of_second > 0 && first_of_second < N, "blocks did not span two regions");
    for (int i = first_of_second - 10; i < first_of_second; i++) /* the first region's last ten */
        iarena_free(&a, b[i]);
    cr_assert(iarena_check(&a));
    /* The second region fills; then the first one's top serves, before any third region. */
    uint8_t *second = b[first_of_second] - 16, *first_end = b[first_of_second - 1] + 16384;
    bool reused = false;
    for (int k = 0; k < 200 && !reused; k++) {
        uint8_t *p = iarena_alloc(&a, 16384);
        cr_assert_not_null(p);
        reused = p >= b[0] && p < first_end;
        cr_assert(reused || (p >= second && p < second + ((size_t)2 << 20)),
                  "allocation %d came from a third region", k);
    }
    cr_assert(reused, "the first region's top was never carved again");
    cr_assert(iarena_check(&a));
    iarena_destroy(&a);
}

/* The VmFlags of the mapping that holds p ("" when not found). */
static void vm_flags(const void *p, char *out, size_t cap)
{
    FILE *f = fopen("/proc/self/smaps", "r");
    cr_assert_not_null(f);
    char line[512];
    bool in = false;
    out[0] = 0;
    while (fgets(line, sizeof line, f)) {
        unsigned long lo, hi;
        if (sscanf(line, "%lx-%lx ", &lo, &hi) == 2) {
            in = (uintptr_t)p >= lo && (uintptr_t)p < hi;
        } else if (in && strncmp(line, "VmFlags:", 8) == 0) {
            snprintf(out, cap, "%s", line + 8);
            break;
        }
    }
    fclose(f);
}

/* Memory faulted in ahead is advised onto huge pages, and the blocks carved from it live there. */
Test(index_arena, blocks_faulted_in_ahead_live_on_a_mapping_advised_for_huge_pages)
{
    FILE *thp = fopen("/sys/kernel/mm/transparent_hugepage/enabled", "r");
    if (!thp) cr_skip_test("no transparent huge pages in this kernel");
    fclose(thp);
    struct iarena a;
    iarena_init(&a);
    cr_assert_not_null(iarena_alloc(&a, 64));
    void *p;
    size_t n;
    iarena_populate_plan(&a, (size_t)4 << 20, &p, &n);
    iarena_populate(&a, p, n);
    iarena_populate_done(&a, p, n);
    uint8_t *b = iarena_alloc(&a, 16400);
    cr_assert_not_null(b);
    char flags[512];
    vm_flags(b, flags, sizeof flags);
    cr_assert_not_null(strstr(flags, " hg"), "VmFlags:%s", flags);
    iarena_destroy(&a);
}

/* ---- Faulting in ahead ---- */

struct writer {
    struct iarena *a;
    pthread_mutex_t *lock;
    atomic_int stop;
    int failed;
    uint8_t *blocks[2048];
    size_t n;
};

/* The owner: carves blocks one after another from the range being faulted in, and fills them. */
static void *writer_main(void *arg)
{
    struct writer *w = arg;
    while (!atomic_load(&w->stop) && w->n < IDEM_ARRAY_LEN(w->blocks)) {
        pthread_mutex_lock(w->lock);
        uint8_t *p = iarena_alloc(w->a, 4096);
        pthread_mutex_unlock(w->lock);
        if (!p) {
            w->failed = 1;
            break;
        }
        fill(p, 4096, w->n);
        w->blocks[w->n++] = p;
    }
    return NULL;
}

/* MADV_POPULATE_WRITE faults pages in without writing them: blocks the owner carves and fills
 * from that very range meanwhile keep every byte. */
Test(index_arena, faulting_in_ahead_leaves_what_the_owner_writes_alone, .timeout = 60)
{
    struct iarena a;
    iarena_init(&a);
    pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
    cr_assert_not_null(iarena_alloc(&a, 64)); /* the region exists */
    static struct writer w;
    w.a = &a;
    w.lock = &lock;
    pthread_t t;
    cr_assert_eq(pthread_create(&t, NULL, writer_main, &w), 0);
    for (int round = 0; round < 16; round++) {
        void *p;
        size_t n;
        pthread_mutex_lock(&lock);
        iarena_populate_plan(&a, (size_t)4 << 20, &p, &n);
        pthread_mutex_unlock(&lock);
        iarena_populate(&a, p, n);
        pthread_mutex_lock(&lock);
        iarena_populate_done(&a, p, n);
        pthread_mutex_unlock(&lock);
    }
    atomic_store(&w.stop, 1);
    pthread_join(t, NULL);
    cr_assert_not(w.failed, "an alloc failed");
    for (size_t i = 0; i < w.n; i++)
        cr_assert(holds(w.blocks[i], 4096, i), "block %zu lost bytes", i);
    cr_assert(iarena_check(&a));
    iarena_destroy(&a);
}

Test(index_arena, the_plan_covers_ahead_of_the_top_and_then_asks_for_nothing)
{
    struct iarena a;
    iarena_init(&a);
    void *p;
    size_t n;
    iarena_populate_plan(&a, (size_t)4 << 20, &p, &n);
    cr_assert_eq(n, 0, "no region yet: nothing to fault in");
    cr_assert_not_null(iarena_alloc(&a, 100000));
    cr_assert(iarena_short(&a, (size_t)4 << 20));
    size_t before = iarena_resident_bytes(&a);
    iarena_populate_plan(&a, (size_t)4 << 20, &p, &n);
    cr_assert_geq(n, ((size_t)4 << 20) - 100000);
    iarena_populate(&a, p, n);
    iarena_populate_done(&a, p, n);
    cr_assert_not(iarena_short(&a, (size_t)4 << 20));
    cr_assert_eq(iarena_resident_bytes(&a), before + n);
    iarena_populate_plan(&a, (size_t)4 << 20, &p, &n);
    cr_assert_eq(n, 0, "already resident");
    iarena_destroy(&a);
}

/* imem_alloc zeroes what it hands out, a reused dirty block included, and counts a block carved
 * past the memory faulted in ahead. */
Test(index_arena, imem_blocks_come_zeroed_and_cold_ones_are_counted)
{
    struct index_mem m;
    imem_init(&m);
    const size_t b = 10336;
    uint8_t *p = imem_alloc(&m, b);
    cr_assert_not_null(p);
    cr_assert_eq(imem_misses(&m), 1, "the first block is carved from memory nobody touched");
    uint8_t *guard = imem_alloc(&m, 64);
    memset(p, 0xab, b);
    imem_free(&m, p, b);
    uint8_t *q = imem_alloc(&m, b);
    cr_assert_eq(q, p, "the freed block of that size is reused");
    for (size_t i = 0; i < b; i++)
        cr_assert_eq(q[i], 0, "byte %zu of a reused block is not zero", i);
    cr_assert_eq(m.live_bytes, b + 64);
    cr_assert_geq(imem_bytes(&m), b + 64 + 32);
    imem_free(&m, q, b);
    imem_free(&m, guard, 64);
    cr_assert_eq(m.live_bytes, 0);
    imem_destroy(&m);
}

/* Waits until the thread made imem_ahead bytes resident beyond the arena's top; fails after
 * 10 s with why. */
static void wait_ahead_resident(struct index_mem *m, const char *why)
{
    int64_t start = util_monotonic_us();
    for (;;) {
        pthread_mutex_lock(&m->lock);
        bool shortfall = iarena_short(&m->arena, imem_ahead(m->arena.carved_bytes));
        pthread_mutex_unlock(&m->lock);
        if (!shortfall) return;
        cr_assert_lt(util_monotonic_us() - start, 10000000, "%s", why);
        usleep(1000);
    }
}

/* The thread keeps memory resident ahead by itself, and a block carved meanwhile is not cold. */
Test(index_arena, imem_thread_faults_memory_in_ahead, .timeout = 60)
{
    struct index_mem m;
    imem_init(&m);
    void *first = imem_alloc(&m, 16400);
    cr_assert_eq(imem_start(&m), 0);
    wait_ahead_resident(&m, "nothing faulted in after 10 s");
    uint64_t cold = imem_misses(&m);
    void *more[64];
    for (int i = 0; i < 64; i++)
        cr_assert_not_null(more[i] = imem_alloc(&m, 16400)); /* 1 MiB: within what is ahead */
    cr_assert_eq(imem_misses(&m), cold, "blocks were carved from cold memory");
    for (int i = 0; i < 64; i++)
        imem_free(&m, more[i], 16400);
    imem_free(&m, first, 16400);
    imem_destroy(&m); /* joins the thread */
}

/* Found by a review of the index: one populate refused for memory (a cgroup at its limit for a
 * moment) ended the thread for good, and every growth step after it faulted its memory in under
 * the store's lock. It tries again once memory may be back. */
Test(index_arena, imem_thread_tries_again_after_memory_was_refused, .timeout = 60)
{
    struct index_mem m;
    imem_init(&m);
    void *first = imem_alloc(&m, 16400);
    iarena_test_refuse_populate(&m.arena, ENOMEM, 1);
    cr_assert_eq(imem_start(&m), 0);
    wait_ahead_resident(&m, "nothing faulted in 10 s after one refusal");
    imem_free(&m, first, 16400);
    imem_destroy(&m);
}

/* An overrun into the next block's tag is caught when that block is freed. */
Test(index_arena, a_smashed_tag_aborts_the_free, .signal = SIGABRT)
{
    struct iarena a;
    iarena_init(&a);
    uint8_t *p = iarena_alloc(&a, 1024);
    uint8_t *q = iarena_alloc(&a, 1024);
    memset(p + 1024, 0x5a, 8); /* the first bytes of q's tag */
    iarena_free(&a, q);
}
