/*
 * util.h: assertions, little-endian codecs and small helpers shared by every module.
 * IDEM_ASSERT is always on (O(1) checks whose breach corrupts data); IDEM_DEBUG_ASSERT is gone
 * under NDEBUG (O(n) checks). Neither is ever used on bytes from the network or the disk.
 */
#ifndef IDEM_UTIL_H
#define IDEM_UTIL_H

#include <errno.h>
#include <pthread.h>
#include <stdint.h>
#include <string.h>

void util_assert_fail(const char *file, int line, const char *expr) __attribute__((noreturn));

#define IDEM_ASSERT(x)                                                                             \
    do {                                                                                           \
        if (__builtin_expect(!(x), 0)) util_assert_fail(__FILE__, __LINE__, #x);                   \
    } while (0)

#ifdef NDEBUG
#define IDEM_DEBUG_ASSERT(x) ((void)0)
#else
#define IDEM_DEBUG_ASSERT(x) IDEM_ASSERT(x)
#endif

#define IDEM_ARRAY_LEN(a)   (sizeof(a) / sizeof((a)[0]))
#define IDEM_ALIGN_UP(x, a) (((x) + ((a)-1)) & ~((uint64_t)(a)-1))

/* A call's -errno that means no space (the disk, or a quota): FULL, not an I/O error. */
#define UTIL_NO_SPACE(rc) ((rc) == -ENOSPC || (rc) == -EDQUOT)
/* What a failed open's -errno means: FULL (no space), ENOMEM (out of descriptors or memory: not
 * the disk, and nothing was written, so the caller may try again later), else EIO. */
#define UTIL_OPEN_ERR(rc)                                                                          \
    (UTIL_NO_SPACE(rc)                                       ? IDEM_EFULL                          \
     : (rc) == -EMFILE || (rc) == -ENFILE || (rc) == -ENOMEM ? IDEM_ENOMEM                         \
                                                             : IDEM_EIO)

/* Little-endian codecs: one load or store on little-endian hosts (the compiler turns the
 * memcpy into a move), a byte swap on big-endian ones. */
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
#define UTIL_LE16(x) __builtin_bswap16(x)
#define UTIL_LE32(x) __builtin_bswap32(x)
#define UTIL_LE64(x) __builtin_bswap64(x)
#else
#define UTIL_LE16(x) (x)
#define UTIL_LE32(x) (x)
#define UTIL_LE64(x) (x)
#endif

static inline void util_put_u16(uint8_t *p, uint16_t v)
{
    v = UTIL_LE16(v);
    memcpy(p, &v, sizeof v);
}
static inline void util_put_u32(uint8_t *p, uint32_t v)
{
    v = UTIL_LE32(v);
    memcpy(p, &v, sizeof v);
}
static inline void util_put_u64(uint8_t *p, uint64_t v)
{
    v = UTIL_LE64(v);
    memcpy(p, &v, sizeof v);
}
static inline uint16_t util_get_u16(const uint8_t *p)
{
    uint16_t v;
    memcpy(&v, p, sizeof v);
    return UTIL_LE16(v);
}
static inline uint32_t util_get_u32(const uint8_t *p)
{
    uint32_t v;
    memcpy(&v, p, sizeof v);
    return UTIL_LE32(v);
}
static inline uint64_t util_get_u64(const uint8_t *p)
{
    uint64_t v;
    memcpy(&v, p, sizeof v);
    return UTIL_LE64(v);
}

/* *p = max(*p, v), atomically (relaxed: a counter, not a guard for other memory). */
static inline void util_atomic_max_i64(int64_t *p, int64_t v)
{
    int64_t cur = __atomic_load_n(p, __ATOMIC_RELAXED);
    while (cur < v &&
           !__atomic_compare_exchange_n(p, &cur, v, 1, __ATOMIC_RELAXED, __ATOMIC_RELAXED)) {
    }
}

/* The bucket of a latency histogram of `buckets` buckets for us microseconds: bucket i holds
 * latencies up to 2^(i+4) us (Prometheus's le: bounds are inclusive), the last the rest. */
static inline int util_latency_bucket(uint64_t us, int buckets)
{
    int b = 0;
    while (b < buckets - 1 && us > (UINT64_C(1) << (b + 4)))
        b++;
    return b;
}

/* Monotonic (CLOCK_BOOTTIME) and wall (CLOCK_REALTIME) time of the system, in ms and us. */
int64_t util_boottime_ms(void);
int64_t util_realtime_ms(void);
int64_t util_monotonic_us(void);
/* Inits c so that its timed waits count elapsed time (CLOCK_MONOTONIC), whatever the wall
 * clock does. Returns pthread_cond_init's result. */
int util_cond_init_monotonic(pthread_cond_t *c);
/* CPU time the calling thread has used, in us (a pause without the time it was preempted). */
int64_t util_thread_cpu_us(void);

/* The memory this process may use, in bytes: the machine's, or less where a cgroup limits it
 * (a container's memory limit); 0 when unknown. */
uint64_t util_memory_bytes(void);
/* The least memory limit of the cgroups that proc_cgroup (the format of /proc/self/cgroup)
 * names and of the cgroups above them, v1 (memory.limit_in_bytes) and v2 (memory.max, at the
 * root or under "unified"), read under cgroup_root (/sys/fs/cgroup but for tests). 0: none. */
uint64_t util_cgroup_memory_limit(const char *proc_cgroup, const char *cgroup_root);

/* An array that grows under a lock, in a mapping of its own on 4 KiB pages. With malloc's heap
 * on transparent huge pages (huge_pages.c) the first write past each 2 MiB of a growing array
 * faults in a whole huge page, zeroed there and then: 4.7 ms on the machine measured, under the
 * store's lock, against about 2 us for each of the 512 small pages that take its place. For
 * arrays written at their end (the age heaps). util_map_grow makes (p NULL, old_bytes 0) or
 * grows the array to new_bytes, keeping its contents; it returns the new address, or NULL with
 * p unchanged. */
void *util_map_grow(void *p, size_t old_bytes, size_t new_bytes);
void util_map_free(void *p, size_t bytes);

/* p[0..n) for a log line or an error: at most cap - 1 bytes, the unprintable, quotes and
 * backslashes as '?'. */
void util_printable(char *dst, size_t cap, const void *p, size_t n);

#endif /* IDEM_UTIL_H */
