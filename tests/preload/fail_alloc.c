/*
 * fail_alloc.c: a library idemd's tests preload (LD_PRELOAD) to refuse its memory at a moment of
 * their choosing. While the file named by IDEM_TEST_FAIL_ALLOC_FILE exists, malloc, calloc,
 * realloc (to a new size), posix_memalign and aligned_alloc fail with ENOMEM in every thread;
 * before and after, they are the system's. The file is looked for at most once a millisecond.
 *
 * The system's functions are found with dlsym when the library is loaded (before the program's
 * threads), and dlsym may itself allocate: calls made while they are being found are served from
 * a small static arena, whose blocks free ignores (aligned ones fail then).
 */
#include <dlfcn.h>
#include <errno.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

static void *(*real_malloc)(size_t);
static void *(*real_calloc)(size_t, size_t);
static void *(*real_realloc)(void *, size_t);
static void (*real_free)(void *);
static int (*real_posix_memalign)(void **, size_t, size_t);
static void *(*real_aligned_alloc)(size_t, size_t);

static _Alignas(16) unsigned char boot[8192];
static size_t boot_used;
static __thread int resolving;

static void *boot_alloc(size_t n)
{
    n = (n + 15) & ~(size_t)15;
    if (n > sizeof boot - boot_used) return NULL;
    void *p = boot + boot_used;
    boot_used += n;
    return p; /* static storage: already zero */
}

static int in_boot(const void *p)
{
    return (const unsigned char *)p >= boot && (const unsigned char *)p < boot + sizeof boot;
}

__attribute__((constructor)) static void resolve(void)
{
    if (real_free || resolving) return;
    resolving = 1;
    real_malloc = (void *(*)(size_t))dlsym(RTLD_NEXT, "malloc");
    real_calloc = (void *(*)(size_t, size_t))dlsym(RTLD_NEXT, "calloc");
    real_realloc = (void *(*)(void *, size_t))dlsym(RTLD_NEXT, "realloc");
    real_posix_memalign = (int (*)(void **, size_t, size_t))dlsym(RTLD_NEXT, "posix_memalign");
    real_aligned_alloc = (void *(*)(size_t, size_t))dlsym(RTLD_NEXT, "aligned_alloc");
    real_free = (void (*)(void *))dlsym(RTLD_NEXT, "free");
    resolving = 0;
}

/* Whether allocations fail now: the trigger file exists (looked at once a millisecond; errno
 * is left as it was). */
static int failing(void)
{
    int saved = errno;
    static _Atomic int64_t next_look_ns;
    static _Atomic int state;
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC_COARSE, &ts);
    int64_t now = (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
    if (now >= next_look_ns) {
        const char *f = getenv("IDEM_TEST_FAIL_ALLOC_FILE");
        state = f && access(f, F_OK) == 0;
        next_look_ns = now + 1000000;
    }
    errno = saved;
    return state;
}

void *malloc(size_t n)
{
    if (resolving) return boot_alloc(n);
    resolve();
    if (failing()) {
        errno = ENOMEM;
        return NULL;
    }
    return real_malloc(n);
}

void *calloc(size_t k, size_t n)
{
    if (resolving) return n && k > SIZE_MAX / n ? NULL : boot_alloc(k * n);
    resolve();
    if (failing()) {
        errno = ENOMEM;
        return NULL;
    }
    return real_calloc(k, n);
}

void *realloc(void *p, size_t n)
{
    if (resolving && !in_boot(p)) return p ? NULL : boot_alloc(n);
    resolve();
    if (in_boot(p)) { /* copied out: its size is not kept, so up to n or the arena's end */
        size_t room = (size_t)(boot + sizeof boot - (unsigned char *)p);
        void *q = malloc(n);
        if (q) memcpy(q, p, n < room ? n : room);
        return q;
    }
    if (n && failing()) {
        errno = ENOMEM;
        return NULL;
    }
    return real_realloc(p, n);
}

void free(void *p)
{
    if (!p || in_boot(p) || resolving) return;
    resolve();
    real_free(p);
}

int posix_memalign(void **out, size_t align, size_t n)
{
    if (resolving) return ENOMEM;
    resolve();
    if (failing()) return ENOMEM;
    return real_posix_memalign(out, align, n);
}

void *aligned_alloc(size_t align, size_t n)
{
    if (resolving) return NULL;
    resolve();
    if (failing()) {
        errno = ENOMEM;
        return NULL;
    }
    return real_aligned_alloc(align, n);
}
