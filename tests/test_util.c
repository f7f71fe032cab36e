/*
 * test_util.c: the shared helpers of src/util.h that the store's behaviour rests on without
 * showing it: arrays grown in mappings of their own (the age heaps), the latency histograms'
 * buckets, and the memory limit of a container (cgroups) that the limits are checked against.
 */
#include <criterion/criterion.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "util.h"

/* The VmFlags line of /proc/self/smaps for the mapping that holds p, or "" when none does. */
static void vm_flags_of(const void *p, char *out, size_t out_len)
{
    FILE *f = fopen("/proc/self/smaps", "r");
    cr_assert_not_null(f);
    char line[512];
    int inside = 0;
    out[0] = 0;
    while (fgets(line, sizeof line, f)) {
        unsigned long lo, hi;
        if (sscanf(line, "%lx-%lx ", &lo, &hi) == 2 && strchr(line, '-') < strchr(line, ' ')) {
            inside = (uintptr_t)p >= lo && (uintptr_t)p < hi;
            continue;
        }
        if (inside && strncmp(line, "VmFlags:", 8) == 0) {
            size_t len = strlen(line + 8);
            if (len >= out_len) len = out_len - 1;
            memcpy(out, line + 8, len);
            out[len] = 0;
            break;
        }
    }
    fclose(f);
}

Test(util, a_mapped_array_keeps_its_contents_as_it_grows_and_stays_off_huge_pages)
{
    size_t bytes = 100;
    uint64_t *a = util_map_grow(NULL, 0, bytes);
    cr_assert_not_null(a);
    size_t n = bytes / sizeof *a;
    for (size_t i = 0; i < n; i++)
        a[i] = i * 2654435761u;
    /* 1.5x at a time past several huge pages' worth, as the age heaps grow. */
    while (bytes < (size_t)12 << 20) {
        size_t more = bytes + bytes / 2;
        uint64_t *b = util_map_grow(a, bytes, more);
        cr_assert_not_null(b, "growing %zu -> %zu bytes", bytes, more);
        for (size_t i = 0; i < n; i++)
            cr_assert_eq(b[i], i * 2654435761u, "entry %zu lost growing to %zu bytes", i, more);
        size_t m = more / sizeof *b;
        for (size_t i = n; i < m; i++)
            b[i] = i * 2654435761u;
        a = b;
        n = m;
        bytes = more;
    }
    cr_assert_eq(util_map_grow(a, bytes, bytes - 1), a, "a smaller size keeps the array");
    char flags[256];
    vm_flags_of(a + n - 1, flags, sizeof flags);
    cr_assert_neq(flags[0], 0, "no mapping holds the array");
    cr_assert_not_null(strstr(flags, " nh"), "the array may take huge pages: VmFlags:%s", flags);
    util_map_free(a, bytes);
}

/* Prometheus reads a bucket's le as "at most": a latency of exactly 16 us belongs in le="16".
 * It was counted in le="32" (bounds were exclusive). */
Test(util, a_latency_on_a_bucket_bound_is_counted_in_that_bucket)
{
    static const struct {
        uint64_t us;
        int bucket;
    } cases[] = {{0, 0},          {16, 0},        {17, 1},
                 {32, 1},         {33, 2},        {64, 2},
                 {65, 3},         {1u << 18, 14}, {(1u << 18) + 1, 15},
                 {UINT64_MAX, 15}};
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++)
        cr_assert_eq(util_latency_bucket(cases[i].us, 16), cases[i].bucket, "%llu us: bucket %d",
                     (unsigned long long)cases[i].us, util_latency_bucket(cases[i].us, 16));
}

/* Writes text to root/rel, making its directories. */
static void put_file(const char *root, const char *rel, const char *text)
{
    char path[512];
    snprintf(path, sizeof path, "%s/%s", root, rel);
    for (char *p = path + strlen(root) + 1; (p = strchr(p, '/')); p++) {
        *p = 0;
        mkdir(path, 0700);
        *p = '/';
    }
    FILE *f = fopen(path, "w");
    cr_assert_not_null(f, "%s", path);
    fputs(text, f);
    fclose(f);
}

/* In a container the machine's memory is not what the process may use: a memory limit of 1 GiB
 * on a 24 GiB host let max_memory_bytes of 8 GiB through the open's check. The limit is the
 * least of the process's cgroup and those above it (in v1, those that count their children),
 * in cgroup v1 or v2. */
Test(util, a_cgroup_memory_limit_is_found_above_the_process_in_v1_and_v2)
{
    char root[] = "/tmp/idem-test-cgroup-XXXXXX", proc[600];
    cr_assert_not_null(mkdtemp(root));
    snprintf(proc, sizeof proc, "%s/proc-cgroup", root);

    /* v1, hybrid: no limit on the process's own cgroup, 1 GiB on its parent. */
    put_file(root, "proc-cgroup", "9:name=systemd:/\n4:memory:/api/x1\n1:cpu:/\n0::/\n");
    put_file(root, "memory/api/x1/memory.limit_in_bytes", "9223372036854771712\n");
    put_file(root, "memory/api/memory.limit_in_bytes", "1073741824\n");
    put_file(root, "memory/memory.limit_in_bytes", "9223372036854771712\n");
    cr_assert_eq(util_cgroup_memory_limit(proc, root), UINT64_C(1) << 30);
    /* A v1 parent that does not count its children (use_hierarchy 0) limits nothing below it. */
    put_file(root, "memory/api/memory.use_hierarchy", "0\n");
    cr_assert_eq(util_cgroup_memory_limit(proc, root), 0);
    put_file(root, "memory/api/memory.use_hierarchy", "1\n");
    cr_assert_eq(util_cgroup_memory_limit(proc, root), UINT64_C(1) << 30);

    /* v2 beside it (unified), tighter: the least of both. */
    put_file(root, "proc-cgroup", "4:memory:/api/x1\n0::/svc/idem\n");
    put_file(root, "unified/svc/idem/memory.max", "max\n");
    put_file(root, "unified/svc/memory.max", "536870912\n");
    cr_assert_eq(util_cgroup_memory_limit(proc, root), UINT64_C(1) << 29);

    /* v2 alone, in a container whose own cgroup is the mount's root while /proc names the
     * host's path (no cgroup namespace): the limit at the root is found by going up. */
    put_file(root, "proc-cgroup", "0::/docker/abc\n");
    put_file(root, "memory.max", "268435456\n");
    cr_assert_eq(util_cgroup_memory_limit(proc, root), UINT64_C(1) << 28);

    /* No limit anywhere, or a file that holds no number: none (0). */
    put_file(root, "memory.max", "max\n");
    put_file(root, "unified/svc/memory.max", "12k\n");
    put_file(root, "proc-cgroup", "0::/svc/idem\n");
    cr_assert_eq(util_cgroup_memory_limit(proc, root), 0);
    snprintf(proc, sizeof proc, "%s/no-such-file", root);
    cr_assert_eq(util_cgroup_memory_limit(proc, root), 0);

    char cmd[600];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", root);
    cr_assert_eq(system(cmd), 0);

    /* What the store reads: never more than the machine has. */
    uint64_t mem = util_memory_bytes();
    cr_assert(mem > 0 &&
              mem <= (uint64_t)sysconf(_SC_PHYS_PAGES) * (uint64_t)sysconf(_SC_PAGE_SIZE));
}
