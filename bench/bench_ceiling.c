/*
 * bench_ceiling.c: the machine's ceiling for durable blocking calls, with no engine in the way.
 *
 * N threads each append a record of B bytes to a shared buffer and sleep until a flush covers
 * it; one flusher thread writes what was appended (pwrite of the pages it touched, into a file
 * zero-filled beforehand, as the engine's log is) and calls fdatasync, then wakes the batch's
 * callers. That is group commit at its cheapest: a spinning lock held for a copy, one futex
 * word per caller (a wake-up never leads into a lock), and wake-ups spread as the engine
 * spreads them (the flusher wakes two callers, each caller two more). Whatever this program
 * reaches, no store built from blocking calls on this machine can beat, so it says how far
 * `idem-bench-engine --case blocking-64` is from the machine rather than from a better design.
 *
 * One line per run:
 *   bench ceiling threads=N ops/s=.. flushes/s=.. records/flush=.. cpu_us/op=.. switches/op=..
 * Usage: idem-bench-ceiling [--threads N] [--record B] [--seconds S] [--dir DIR]
 */
#include <fcntl.h>
#include <linux/futex.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "bench_util.h"

#define FILE_BYTES  (64u << 20)
#define PAGE        4096u
#define THREADS_MAX 1024u

typedef struct caller {
    _Atomic uint32_t done; /* futex word: set to 1 by the flush that covers the record */
    struct caller *kid[2]; /* the callers this one wakes once woken, set by the flusher */
} caller;

static struct {
    atomic_flag lock;
    uint8_t *buf; /* records appended since the last flush began */
    size_t used;
    caller *batch[THREADS_MAX]; /* callers of the batch being filled */
    unsigned waiting;
    _Atomic uint32_t kick; /* futex word of the flusher: bumped when a batch starts */
    _Atomic int stop;
    _Atomic unsigned live; /* workers not yet returned: the flusher outlives them all */
    int fd;
    size_t record;
    uint64_t flushes, records;
} g;

static void futex_wait(_Atomic uint32_t *w, uint32_t v)
{
    syscall(SYS_futex, w, FUTEX_WAIT_PRIVATE, v, NULL, NULL, 0);
}

static void futex_wake(_Atomic uint32_t *w)
{
    syscall(SYS_futex, w, FUTEX_WAKE_PRIVATE, 1, NULL, NULL, 0);
}

static void spin_lock(void)
{
    while (atomic_flag_test_and_set_explicit(&g.lock, memory_order_acquire))
        __builtin_ia32_pause();
}

static void spin_unlock(void)
{
    atomic_flag_clear_explicit(&g.lock, memory_order_release);
}

static void wake(caller *c)
{
    if (!c) return;
    atomic_store_explicit(&c->done, 1, memory_order_release);
    futex_wake(&c->done);
}

static void *flusher(void *arg)
{
    (void)arg;
    uint8_t *page = aligned_alloc(PAGE, FILE_BYTES / 16);
    caller **batch = malloc(THREADS_MAX * sizeof *batch);
    size_t off = 0; /* log end */
    for (;;) {
        uint32_t k = atomic_load(&g.kick);
        spin_lock();
        if (!g.waiting) {
            spin_unlock();
            if (atomic_load(&g.stop) && atomic_load(&g.live) == 0) break;
            futex_wait(&g.kick, k);
            continue;
        }
        unsigned callers = g.waiting;
        memcpy(batch, g.batch, callers * sizeof *batch);
        g.waiting = 0;
        size_t n = g.used;
        size_t start = off & ~(size_t)(PAGE - 1);
        size_t lead = off - start;
        memcpy(page + lead, g.buf, n);
        g.used = 0;
        spin_unlock();
        size_t len = (lead + n + PAGE - 1) & ~(size_t)(PAGE - 1);
        if (start + len > FILE_BYTES) start = lead = off = 0;
        if (pwrite(g.fd, page, len, (off_t)start) != (ssize_t)len || fdatasync(g.fd) != 0) {
            perror("bench ceiling: write");
            exit(1);
        }
        off += n;
        /* Keep the partial last page for the next batch's write. */
        memmove(page, page + ((lead + n) & ~(size_t)(PAGE - 1)), PAGE);
        g.flushes++;
        g.records += n / g.record;
        /* The wake-up tree: the flusher wakes callers 0 and 1, caller i wakes 2i+2 and 2i+3. */
        for (unsigned i = 0; i < callers; i++)
            for (unsigned j = 0; j < 2; j++)
                batch[i]->kid[j] = 2 * i + 2 + j < callers ? batch[2 * i + 2 + j] : NULL;
        wake(batch[0]);
        wake(callers > 1 ? batch[1] : NULL);
    }
    free(batch);
    free(page);
    return NULL;
}

static void *worker(void *arg)
{
    (void)arg;
    uint8_t rec[PAGE];
    memset(rec, 0x5a, sizeof rec);
    caller c;
    while (!atomic_load_explicit(&g.stop, memory_order_relaxed)) {
        atomic_store_explicit(&c.done, 0, memory_order_relaxed);
        spin_lock();
        memcpy(g.buf + g.used, rec, g.record);
        g.used += g.record;
        int first = g.waiting == 0;
        g.batch[g.waiting++] = &c;
        spin_unlock();
        if (first) {
            atomic_fetch_add(&g.kick, 1);
            futex_wake(&g.kick);
        }
        while (!atomic_load_explicit(&c.done, memory_order_acquire))
            futex_wait(&c.done, 0);
        caller *k0 = c.kid[0], *k1 = c.kid[1];
        wake(k0);
        wake(k1);
    }
    atomic_fetch_sub(&g.live, 1);
    atomic_fetch_add(&g.kick, 1);
    futex_wake(&g.kick);
    return NULL;
}

int main(int argc, char **argv)
{
    unsigned threads = 64;
    double seconds = 2.5;
    const char *dir = "/tmp";
    g.record = 90;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--threads") && i + 1 < argc)
            threads = (unsigned)atoi(argv[++i]);
        else if (!strcmp(argv[i], "--record") && i + 1 < argc)
            g.record = (size_t)atoi(argv[++i]);
        else if (!strcmp(argv[i], "--seconds") && i + 1 < argc)
            seconds = atof(argv[++i]);
        else if (!strcmp(argv[i], "--dir") && i + 1 < argc)
            dir = argv[++i];
        else {
            fprintf(
                stderr,
                "usage: idem-bench-ceiling [--threads N] [--record B] [--seconds S] [--dir DIR]\n");
            return 2;
        }
    }
    if (threads < 1 || threads > THREADS_MAX || g.record < 1 || g.record > PAGE) {
        fprintf(stderr, "bench ceiling: threads 1..%u, record 1..%u bytes\n", THREADS_MAX, PAGE);
        return 2;
    }
    char path[4096];
    snprintf(path, sizeof path, "%s/idem-ceiling.%d", dir, (int)getpid());
    g.fd = open(path, O_RDWR | O_CREAT | O_TRUNC, 0600);
    if (g.fd < 0) {
        perror(path);
        return 1;
    }
    unlink(path);
    /* Zero-fill the file so that flushes overwrite written blocks, as the engine's log does. */
    uint8_t *zero = calloc(1, 1u << 20);
    for (size_t o = 0; o < FILE_BYTES; o += 1u << 20)
        if (pwrite(g.fd, zero, 1u << 20, (off_t)o) != 1 << 20) {
            perror("bench ceiling: fill");
            return 1;
        }
    free(zero);
    if (fdatasync(g.fd) != 0) {
        perror("bench ceiling: fill");
        return 1;
    }
    g.buf = malloc((size_t)threads * g.record);
    pthread_t fl, *ws = calloc(threads, sizeof *ws);
    struct rusage r0, r1;
    getrusage(RUSAGE_SELF, &r0);
    uint64_t t0 = bench_now_ns();
    atomic_store(&g.live, threads);
    pthread_create(&fl, NULL, flusher, NULL);
    for (unsigned i = 0; i < threads; i++)
        pthread_create(&ws[i], NULL, worker, NULL);
    usleep((useconds_t)(seconds * 1e6));
    atomic_store(&g.stop, 1);
    for (unsigned i = 0; i < threads; i++)
        pthread_join(ws[i], NULL);
    pthread_join(fl, NULL);
    double secs = (double)(bench_now_ns() - t0) / 1e9;
    getrusage(RUSAGE_SELF, &r1);
    double cpu_us = (double)(r1.ru_utime.tv_sec - r0.ru_utime.tv_sec + r1.ru_stime.tv_sec -
                             r0.ru_stime.tv_sec) *
                        1e6 +
                    (double)(r1.ru_utime.tv_usec - r0.ru_utime.tv_usec + r1.ru_stime.tv_usec -
                             r0.ru_stime.tv_usec);
    double sw = (double)(r1.ru_nvcsw - r0.ru_nvcsw + r1.ru_nivcsw - r0.ru_nivcsw);
    double n = (double)g.records;
    printf("bench ceiling threads=%u ops/s=%.0f flushes/s=%.0f records/flush=%.1f cpu_us/op=%.1f "
           "switches/op=%.2f\n",
           threads, n / secs, (double)g.flushes / secs, g.flushes ? n / (double)g.flushes : 0.0,
           n ? cpu_us / n : 0.0, n ? sw / n : 0.0);
    free(ws);
    free(g.buf);
    close(g.fd);
    return 0;
}
