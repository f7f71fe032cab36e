/*
 * bench_util.h: helpers shared by the benchmarks: the monotonic clock, deterministic keys, a
 * log-linear latency histogram, and removal of a benchmark's scratch directory.
 *
 * Keys: key i is the 16 lowercase hex digits of splitmix64(i ^ BENCH_SEED). splitmix64 is a
 * bijection on 64-bit values, so keys 0..n-1 are distinct, spread uniformly over the hash space,
 * and the same in every run. Every program takes its random numbers from bench_rng seeded with
 * BENCH_SEED, so a run is repeatable up to the machine's timing.
 *
 * Histogram: values in nanoseconds; below 32 ns one bucket per value, above that 32 buckets per
 * power of two (relative error under 3.2%). The exact maximum is kept beside the buckets.
 */
#ifndef BENCH_UTIL_H
#define BENCH_UTIL_H

#include <errno.h>
#include <ftw.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#define BENCH_SEED      0x1de3b3c5ull
#define BENCH_KEY_BYTES 16u

#define HIST_SUB_BITS 5u
#define HIST_SUB      (1u << HIST_SUB_BITS)
#define HIST_BUCKETS  (HIST_SUB * (64u - HIST_SUB_BITS + 1u))

typedef struct bench_hist {
    uint64_t count[HIST_BUCKETS];
    uint64_t n;
    uint64_t max_ns;
} bench_hist;

static inline uint64_t bench_now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static inline uint64_t bench_splitmix64(uint64_t x)
{
    x += 0x9e3779b97f4a7c15ull;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
    return x ^ (x >> 31);
}

/* xorshift64*: the random source for key choice; state must not be 0. */
static inline uint64_t bench_rng(uint64_t *state)
{
    uint64_t x = *state;
    x ^= x >> 12;
    x ^= x << 25;
    x ^= x >> 27;
    *state = x;
    return x * 0x2545f4914f6cdd1dull;
}

/* Writes key i (BENCH_KEY_BYTES bytes, not NUL-terminated) to out. */
static inline void bench_key(uint64_t i, uint8_t out[BENCH_KEY_BYTES])
{
    static const char hex[] = "0123456789abcdef";
    uint64_t h = bench_splitmix64(i ^ BENCH_SEED);
    for (unsigned d = 0; d < BENCH_KEY_BYTES; d++)
        out[d] = (uint8_t)hex[(h >> (60 - 4 * d)) & 0xf];
}

static inline uint32_t bench_hist_index(uint64_t v)
{
    if (v < HIST_SUB) return (uint32_t)v;
    unsigned e = 63u - (unsigned)__builtin_clzll(v);
    unsigned shift = e - HIST_SUB_BITS;
    return (shift + 1u) * HIST_SUB + (uint32_t)((v >> shift) & (HIST_SUB - 1u));
}

/* The middle of bucket idx, in ns. */
static inline double bench_hist_value(uint32_t idx)
{
    if (idx < HIST_SUB) return idx;
    unsigned shift = idx / HIST_SUB - 1u;
    uint64_t low = (uint64_t)(HIST_SUB + idx % HIST_SUB) << shift;
    return (double)low + (double)(1ull << shift) / 2.0;
}

static inline void bench_hist_add(bench_hist *h, uint64_t ns)
{
    h->count[bench_hist_index(ns)]++;
    h->n++;
    if (ns > h->max_ns) h->max_ns = ns;
}

static inline void bench_hist_merge(bench_hist *into, const bench_hist *from)
{
    for (uint32_t i = 0; i < HIST_BUCKETS; i++)
        into->count[i] += from->count[i];
    into->n += from->n;
    if (from->max_ns > into->max_ns) into->max_ns = from->max_ns;
}

/* The p-quantile (0 < p <= 1) in microseconds; 0 for an empty histogram. */
static inline double bench_hist_us(const bench_hist *h, double p)
{
    if (h->n == 0) return 0.0;
    uint64_t rank = (uint64_t)(p * (double)h->n + 0.999999);
    if (rank == 0) rank = 1;
    uint64_t seen = 0;
    for (uint32_t i = 0; i < HIST_BUCKETS; i++) {
        seen += h->count[i];
        if (seen >= rank) {
            double v = bench_hist_value(i);
            if (v > (double)h->max_ns) v = (double)h->max_ns;
            return v / 1000.0;
        }
    }
    return (double)h->max_ns / 1000.0;
}

static inline int bench_rm_one(const char *path, const struct stat *st, int type, struct FTW *ftw)
{
    (void)st;
    (void)ftw;
    int rc = (type == FTW_DP) ? rmdir(path) : unlink(path);
    if (rc != 0) fprintf(stderr, "bench: cannot remove %s: %s\n", path, strerror(errno));
    return 0;
}

/* Removes path and everything under it; an absent path is not an error. */
static inline void bench_rm_rf(const char *path)
{
    struct stat st;
    if (lstat(path, &st) != 0) return;
    nftw(path, bench_rm_one, 16, FTW_DEPTH | FTW_PHYS);
}

#endif /* BENCH_UTIL_H */
