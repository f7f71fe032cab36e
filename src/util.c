/*
 * util.c: the always-on assertion handler, the system clock readers and the mapped arrays of
 * util.h.
 */
#include "util.h"

#include <stdio.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

void util_assert_fail(const char *file, int line, const char *expr)
{
    fprintf(stderr, "idem: assertion failed: %s:%d: %s\n", file, line, expr);
    abort();
}

static int64_t clock_ns(clockid_t id)
{
    struct timespec ts;
    clock_gettime(id, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

int64_t util_boottime_ms(void)
{
    return clock_ns(CLOCK_BOOTTIME) / 1000000;
}

int64_t util_realtime_ms(void)
{
    return clock_ns(CLOCK_REALTIME) / 1000000;
}

int64_t util_monotonic_us(void)
{
    return clock_ns(CLOCK_MONOTONIC) / 1000;
}

int64_t util_thread_cpu_us(void)
{
    return clock_ns(CLOCK_THREAD_CPUTIME_ID) / 1000;
}

static size_t map_round(size_t bytes)
{
    size_t page = (size_t)sysconf(_SC_PAGESIZE);
    return (bytes + page - 1) / page * page;
}

void *util_map_grow(void *p, size_t old_bytes, size_t new_bytes)
{
    size_t old_r = p ? map_round(old_bytes) : 0, new_r = map_round(new_bytes);
    if (new_r == 0) return NULL;
    if (p && new_r <= old_r) return p;
    void *q;
    if (!p) {
        q = mmap(NULL, new_r, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        if (q == MAP_FAILED) return NULL;
        (void)madvise(q, new_r, MADV_NOHUGEPAGE); /* a kernel without THP refuses: no matter */
        return q;
    }
    q = mremap(p, old_r, new_r, MREMAP_MAYMOVE); /* the pages move, the flag with them */
    return q == MAP_FAILED ? NULL : q;
}

void util_map_free(void *p, size_t bytes)
{
    if (p) munmap(p, map_round(bytes));
}
