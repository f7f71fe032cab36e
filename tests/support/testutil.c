/*
 * testutil.c: see testutil.h.
 */
#include "testutil.h"

#include <criterion/criterion.h>

#include <ftw.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "idem.h"

char *tu_mkdtemp(const char *tag)
{
    const char *base = getenv("TMPDIR");
    char buf[512];
    snprintf(buf, sizeof buf, "%s/idem-%s-XXXXXX", base && *base ? base : "/tmp", tag);
    if (!mkdtemp(buf)) return NULL;
    return strdup(buf);
}

static int rm_one(const char *path, const struct stat *sb, int type, struct FTW *ftw)
{
    (void)sb;
    (void)type;
    (void)ftw;
    remove(path);
    return 0;
}

void tu_rmtree(char *path)
{
    if (!path) return;
    nftw(path, rm_one, 16, FTW_DEPTH | FTW_PHYS);
    free(path);
}

uint64_t tu_seed(const char *test_name)
{
    const char *env = getenv("IDEM_SEED");
    uint64_t seed;
    if (env && *env) {
        seed = strtoull(env, NULL, 0);
    } else {
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        seed = (uint64_t)ts.tv_sec * 1000000007u ^ (uint64_t)ts.tv_nsec ^ (uint64_t)getpid();
    }
    fprintf(stderr, "%s: seed %llu (replay with IDEM_SEED=%llu)\n", test_name,
            (unsigned long long)seed, (unsigned long long)seed);
    return seed;
}

uint64_t tu_rand(uint64_t *state)
{
    uint64_t z = (*state += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

uint8_t *tu_random_bytes(size_t n, uint64_t seed)
{
    uint8_t *p = malloc(n ? n : 1);
    if (!p) abort();
    for (size_t i = 0; i < n; i += 8) {
        uint64_t r = tu_rand(&seed);
        memcpy(p + i, &r, n - i < 8 ? n - i : 8);
    }
    return p;
}

void *tu_grow(void *v, size_t *cap, size_t need, size_t elem)
{
    if (need <= *cap) return v;
    size_t n = *cap ? *cap * 2 : 64;
    while (n < need)
        n *= 2;
    void *p = realloc(v, n * elem);
    if (!p) abort();
    *cap = n;
    return p;
}

uint64_t tu_count(uint64_t ci_count, uint64_t long_count)
{
    const char *env = getenv("IDEM_LONG");
    return env && *env == '1' ? long_count : ci_count;
}

void tu_set_nx(struct idem_queue *q, const char *prefix, int base, int keys, const void *val,
               uint32_t len, uint64_t ttl_ms)
{
    static char keyv[256][48];
    static idem_op ops[256];
    static idem_completion out[256];
    for (int at = base; at < base + keys; at += 256) {
        memset(ops, 0, sizeof ops);
        for (int i = 0; i < 256; i++) {
            snprintf(keyv[i], sizeof keyv[i], "%s-%d", prefix, at + i);
            ops[i] = (idem_op){.kind = IDEM_OP_SET_IF_ABSENT,
                               .user_data = (uint64_t)i,
                               .key = keyv[i],
                               .key_len = (uint32_t)strlen(keyv[i]),
                               .ttl_ms = ttl_ms,
                               .data = val,
                               .data_len = len};
        }
        cr_assert_eq(idem_submit(q, ops, 256), 256, "submit of 256 operations");
        for (int got = 0; got < 256;) {
            int n = idem_poll(q, out, 256, 30000);
            cr_assert_gt(n, 0, "no completion within 30 s");
            for (int i = 0; i < n; i++)
                cr_assert(out[i].err == IDEM_OK && out[i].outcome == IDEM_NEW, "%s: %s",
                          keyv[out[i].user_data], idem_strerror(out[i].err));
            got += n;
        }
    }
}

void tu_fill_incompressible(struct idem_queue *q, int keys)
{
    static char val[4096];
    uint64_t rng = 42;
    for (size_t i = 0; i < sizeof val; i++)
        val[i] = (char)tu_rand(&rng);
    tu_set_nx(q, "fill", 0, keys, val, sizeof val, 3600000);
}

void tu_audit_entries_across_blocks(struct idem_audit_entry *out)
{
    static char long_reason[4000];
    memset(long_reason, 'r', sizeof long_reason - 1);
    static const char *const keys[3] = {"k0", "k1", "k2"};
    for (int i = 0; i < 3; i++)
        out[i] = (idem_audit_entry){.at_ms = 5 + i,
                                    .actor = "ops",
                                    .action = "del",
                                    .key = keys[i],
                                    .key_len = 2,
                                    .reason = i == 1 ? "r" : long_reason};
}
