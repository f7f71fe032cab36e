/*
 * huge_pages.c: malloc's heap on transparent huge pages, for the programs that hold an index
 * (idemd, the benchmarks), which call huge_pages_reexec first thing in main. The library itself
 * never calls it: re-executing a process is its owner's decision.
 */
#include "huge_pages.h"

#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/auxv.h>
#include <unistd.h>

/* Tables read at random (the repeat counters, the index's directory) miss the TLB as well as
 * the cache on 4 KiB pages; the index's segments have an arena of their own on huge pages
 * (index_arena.c), whatever this does. glibc (2.35 and later) backs malloc's heap with
 * transparent huge pages when its tunable glibc.malloc.hugetlb=1 is set, and reads tunables only
 * when a program starts: so the program adds it to GLIBC_TUNABLES and executes itself again, once
 * (IDEM_MALLOC_HUGE=exec marks the second start). Other C libraries and older glibc ignore it.
 * Skipped for a set-user-ID or capability-raised start (glibc drops tunables there) and for a
 * start through the dynamic loader (its program is not this file). IDEM_MALLOC_HUGE=0 leaves
 * the heap alone. Measured with bench/soak.sh (docs/benchmarks.md), when the segments still
 * lived in malloc's heap: 88 k -> 100 k claims/s. */
void huge_pages_reexec(char **argv)
{
    const char *opt = getenv("IDEM_MALLOC_HUGE");
    if (opt && strcmp(opt, "exec") == 0) {
        unsetenv("IDEM_MALLOC_HUGE");
        return;
    }
    if ((opt && strcmp(opt, "0") == 0) || getauxval(AT_SECURE)) return;
    const char *t = getenv("GLIBC_TUNABLES");
    if (t && strstr(t, "glibc.malloc.hugetlb")) return; /* the user chose */
    char exe[PATH_MAX];
    ssize_t n = readlink("/proc/self/exe", exe, sizeof exe - 1);
    if (n <= 0) return; /* no /proc: ordinary pages */
    exe[n] = 0;
    const char *base = strrchr(exe, '/');
    if (strncmp(base ? base + 1 : exe, "ld-", 3) == 0) return;
    char v[1024];
    int len = snprintf(v, sizeof v, "%s%sglibc.malloc.hugetlb=1", t ? t : "", t && *t ? ":" : "");
    if (len < 0 || (size_t)len >= sizeof v) return;
    char *old = t ? strdup(t) : NULL;
    if ((t && !old) || setenv("GLIBC_TUNABLES", v, 1) != 0 ||
        setenv("IDEM_MALLOC_HUGE", "exec", 1) != 0) {
        free(old);
        return;
    }
    execv(exe, argv); /* by its path, so that the process keeps its name */
    unsetenv("IDEM_MALLOC_HUGE");
    if (old)
        setenv("GLIBC_TUNABLES", old, 1);
    else
        unsetenv("GLIBC_TUNABLES");
    free(old);
}

int huge_pages_tunable(void)
{
    const char *t = getenv("GLIBC_TUNABLES");
    return t && strstr(t, "glibc.malloc.hugetlb=1") != NULL;
}
