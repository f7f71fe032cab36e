/*
 * test_util.c: the shared helpers of src/util.h that the store's behaviour rests on without
 * showing it: arrays grown in mappings of their own (the age heaps), and the latency histograms'
 * buckets.
 */
#include <criterion/criterion.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

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
