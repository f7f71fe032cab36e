/*
 * util.c: the always-on assertion handler, the system clock readers, the memory limit reader,
 * bytes made printable for logs, and the mapped arrays of util.h.
 */
#include "util.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
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

int util_cond_init_monotonic(pthread_cond_t *c)
{
    pthread_condattr_t ca;
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    int rc = pthread_cond_init(c, &ca);
    pthread_condattr_destroy(&ca);
    return rc;
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

/* The limit in the file at path (a cgroup's memory.max or memory.limit_in_bytes), or
 * UINT64_MAX for none: no such file, "max", v1's "unlimited" (about 2^63), or not a number. */
static uint64_t cgroup_limit_at(const char *path)
{
    FILE *f = fopen(path, "r");
    if (!f) return UINT64_MAX;
    char line[64];
    char *end = NULL;
    unsigned long long v = 0;
    if (fgets(line, sizeof line, f) && line[0] >= '0' && line[0] <= '9')
        v = strtoull(line, &end, 10);
    fclose(f);
    if (!end || (*end && *end != '\n') || v == 0 || v >= (UINT64_C(1) << 62)) return UINT64_MAX;
    return v;
}

/* The least limit in file `name` of the cgroup at rel (a path from /proc/self/cgroup) and of
 * every cgroup above it, under mount. Going up also finds the limit of a container whose own
 * cgroup is mounted as the root while /proc/self/cgroup names its path on the host. In v1 a
 * cgroup whose memory.use_hierarchy is 0 does not count its children against its limit: the
 * walk ends there. */
static uint64_t cgroup_limit_up(const char *mount, const char *rel, const char *name, int v1)
{
    char path[4096];
    int k = snprintf(path, sizeof path, "%s%s", mount, rel);
    if (k < 0 || (size_t)k >= sizeof path) return UINT64_MAX;
    uint64_t least = UINT64_MAX;
    size_t len = (size_t)k, floor = strlen(mount);
    for (int own = 1;; own = 0) {
        while (len > floor && path[len - 1] == '/')
            len--;
        char file[4200];
        if (v1 && !own) {
            snprintf(file, sizeof file, "%.*s/memory.use_hierarchy", (int)len, path);
            FILE *h = fopen(file, "r");
            int flat = h && fgetc(h) == '0';
            if (h) fclose(h);
            if (flat) return least;
        }
        snprintf(file, sizeof file, "%.*s/%s", (int)len, path, name);
        uint64_t v = cgroup_limit_at(file);
        if (v < least) least = v;
        if (len <= floor) return least;
        while (len > floor && path[len - 1] != '/')
            len--;
    }
}

uint64_t util_cgroup_memory_limit(const char *proc_cgroup, const char *cgroup_root)
{
    FILE *f = fopen(proc_cgroup, "r");
    if (!f) return 0;
    uint64_t least = UINT64_MAX;
    char line[4096], mount[4096];
    while (fgets(line, sizeof line, f)) {
        line[strcspn(line, "\n")] = 0;
        char *ctl = strchr(line, ':'), *rel = ctl ? strchr(ctl + 1, ':') : NULL;
        if (!rel) continue;
        *ctl++ = 0; /* line: the hierarchy's number, ctl: its controllers, rel: the path */
        *rel++ = 0;
        uint64_t v = UINT64_MAX;
        if (strcmp(line, "0") == 0 && *ctl == 0) { /* v2: at the root, or beside v1 (hybrid) */
            v = cgroup_limit_up(cgroup_root, rel, "memory.max", 0);
            snprintf(mount, sizeof mount, "%s/unified", cgroup_root);
            uint64_t u = cgroup_limit_up(mount, rel, "memory.max", 0);
            if (u < v) v = u;
        } else {
            char *save = NULL;
            for (char *c = strtok_r(ctl, ",", &save); c; c = strtok_r(NULL, ",", &save))
                if (strcmp(c, "memory") == 0) { /* v1's memory controller */
                    snprintf(mount, sizeof mount, "%s/memory", cgroup_root);
                    v = cgroup_limit_up(mount, rel, "memory.limit_in_bytes", 1);
                }
        }
        if (v < least) least = v;
    }
    fclose(f);
    return least == UINT64_MAX ? 0 : least;
}

uint64_t util_memory_bytes(void)
{
    long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGE_SIZE);
    uint64_t ram = pages > 0 && page > 0 ? (uint64_t)pages * (uint64_t)page : 0;
    uint64_t cg = util_cgroup_memory_limit("/proc/self/cgroup", "/sys/fs/cgroup");
    return cg && (!ram || cg < ram) ? cg : ram;
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

void util_printable(char *dst, size_t cap, const void *p, size_t n)
{
    const uint8_t *b = p;
    size_t k = 0;
    for (size_t i = 0; i < n && k + 1 < cap; i++)
        dst[k++] = b[i] >= 0x20 && b[i] < 0x7f && b[i] != '\'' && b[i] != '"' && b[i] != '\\'
                       ? (char)b[i]
                       : '?';
    if (cap) dst[k] = '\0';
}
