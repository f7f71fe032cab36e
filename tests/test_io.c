/*
 * test_io.c: behaviour of the I/O backends of io.h. The IO_TEST cases run over all three
 * backends (sim, thread, uring; uring is skipped with the reason when io_uring_create is
 * refused); the sim cases test the simulated disk's crash model, fault injection, capacity and
 * determinism. Each test owns its backend (and, for the real ones, a temp dir) via .init/.fini.
 */
#include <criterion/criterion.h>

#include "io.h"
#include "io_sim.h"
#include "testutil.h"

#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>

#define BLOCK 4096u

struct fixture {
    const char *kind; /* "sim", "thread", "uring" */
    struct io_sim *sim;
    struct io *io;
    char *dir;
    int uring_rc;
};

static struct fixture fx;

static void setup_sim(void)
{
    memset(&fx, 0, sizeof fx);
    fx.kind = "sim";
    cr_assert_eq(io_sim_create(42, &fx.sim), 0);
    fx.io = io_sim_io(fx.sim);
    cr_assert_not_null(fx.io);
    fx.dir = strdup("/sim/db");
    cr_assert_eq(io_mkdir(fx.io, fx.dir), 0);
}

static void setup_thread(void)
{
    memset(&fx, 0, sizeof fx);
    fx.kind = "thread";
    fx.dir = tu_mkdtemp("io");
    cr_assert_not_null(fx.dir);
    cr_assert_eq(io_thread_create(&fx.io), 0);
}

static void setup_uring(void)
{
    memset(&fx, 0, sizeof fx);
    fx.kind = "uring";
    fx.dir = tu_mkdtemp("io");
    cr_assert_not_null(fx.dir);
    fx.uring_rc = io_uring_create(64, &fx.io);
    if (fx.uring_rc < 0) fx.io = NULL;
}

static void teardown(void)
{
    if (fx.io) io_destroy(fx.io);
    if (fx.sim) io_sim_destroy(fx.sim);
    if (strcmp(fx.kind, "sim") == 0)
        free(fx.dir);
    else
        tu_rmtree(fx.dir);
}

static void need_uring(void)
{
    if (!fx.io) cr_skip_test("io_uring refused by this system: %s", strerror(-fx.uring_rc));
}

#define IO_TEST(name)                                                                              \
    static void check_##name(void);                                                                \
    Test(sim, name, .init = setup_sim, .fini = teardown)                                           \
    {                                                                                              \
        check_##name();                                                                            \
    }                                                                                              \
    Test(thread, name, .init = setup_thread, .fini = teardown)                                     \
    {                                                                                              \
        check_##name();                                                                            \
    }                                                                                              \
    Test(uring, name, .init = setup_uring, .fini = teardown)                                       \
    {                                                                                              \
        need_uring();                                                                              \
        check_##name();                                                                            \
    }                                                                                              \
    static void check_##name(void)

static const char *path_in(char *buf, size_t size, const char *name)
{
    snprintf(buf, size, "%s/%s", fx.dir, name);
    return buf;
}

static struct io_file *open_new(const char *name)
{
    char p[512];
    struct io_file *f = NULL;
    int rc = io_open(fx.io, path_in(p, sizeof p, name), IO_O_CREATE, &f);
    cr_assert_eq(rc, 0, "open %s: %d", name, rc);
    return f;
}

static void fill(uint8_t *buf, size_t len, uint8_t seed)
{
    for (size_t i = 0; i < len; i++)
        buf[i] = (uint8_t)(seed + i * 7 + (i >> 9));
}

/* Reaps exactly n completions (bounded rounds). */
static void reap(struct io_completion *out, int n)
{
    int got = 0;
    for (int round = 0; round < 1000 && got < n; round++) {
        int rc = io_wait(fx.io, out + got, n - got, 1);
        cr_assert_geq(rc, 0, "wait: %d", rc);
        got += rc;
    }
    cr_assert_eq(got, n);
}

static int64_t write_one(struct io_file *f, uint64_t off, const void *buf, size_t len,
                         unsigned flags)
{
    struct io_completion c;
    cr_assert_eq(io_submit_write(fx.io, f, off, buf, len, flags, 77), 0);
    reap(&c, 1);
    cr_assert_eq(c.user_data, 77);
    return c.res;
}

/* ---- behaviour every backend shares ---- */

IO_TEST(write_flush_then_read_back)
{
    static uint8_t data[2 * BLOCK], back[2 * BLOCK];
    char p[512];
    fill(data, sizeof data, 1);
    struct io_file *f = open_new("a");
    cr_assert_eq(io_write_sync(fx.io, f, 0, data, sizeof data, 1), 0);
    uint64_t size = 0;
    cr_assert_eq(io_size(fx.io, f, &size), 0);
    cr_assert_eq(size, sizeof data);
    io_close(fx.io, f);
    cr_assert_eq(io_open(fx.io, path_in(p, sizeof p, "a"), IO_O_RDONLY, &f), 0);
    cr_assert_eq(io_read(fx.io, f, 0, back, sizeof back), (int64_t)sizeof back);
    cr_assert_arr_eq(back, data, sizeof data);
    cr_assert_eq(io_read(fx.io, f, BLOCK, back, sizeof back), (int64_t)BLOCK, "short at eof");
    cr_assert_eq(io_read(fx.io, f, 3 * BLOCK, back, sizeof back), 0);
    io_close(fx.io, f);
}

IO_TEST(linked_write_flush_yields_one_completion_each)
{
    static uint8_t data[4][BLOCK];
    struct io_completion c[8];
    struct io_file *f = open_new("a");
    for (int i = 0; i < 4; i++) {
        fill(data[i], BLOCK, (uint8_t)i);
        cr_assert_eq(io_submit_write(fx.io, f, (uint64_t)i * BLOCK, data[i], BLOCK, IO_W_FLUSH,
                                     100 + (uint64_t)i),
                     0);
    }
    cr_assert_eq(io_submit_flush(fx.io, f, 7), 0);
    reap(c, 5);
    int seen[5] = {0};
    for (int i = 0; i < 5; i++) {
        if (c[i].user_data == 7) {
            cr_assert_eq(c[i].res, 0);
            seen[4]++;
            continue;
        }
        cr_assert(c[i].user_data >= 100 && c[i].user_data < 104, "user_data %llu",
                  (unsigned long long)c[i].user_data);
        cr_assert_eq(c[i].res, BLOCK);
        seen[c[i].user_data - 100]++;
    }
    for (int i = 0; i < 5; i++)
        cr_assert_eq(seen[i], 1, "request %d completed %d times", i, seen[i]);
    cr_assert_eq(io_wait(fx.io, c, 8, 0), 0, "no further completions");
    if (fx.sim) {
        struct io_sim_counts n;
        io_sim_counts(fx.sim, &n);
        cr_assert_eq(n.writes, 4);
        cr_assert_eq(n.flushes, 5);
        cr_assert_eq(n.bytes_written, 4 * BLOCK);
    }
    io_close(fx.io, f);
}

IO_TEST(wait_for_more_than_in_flight_is_einval)
{
    struct io_completion c[2];
    cr_assert_eq(io_wait(fx.io, c, 2, 1), -EINVAL);
    cr_assert_eq(io_wait(fx.io, c, 2, 0), 0);
}

/* Real backends: RLIMIT_FSIZE cuts a write crossing it short; the sim injects one. */
static void arrange_short_write(uint64_t limit)
{
    if (fx.sim) {
        io_sim_short_write(fx.sim, 1);
        return;
    }
    struct rlimit rl;
    cr_assert_eq(getrlimit(RLIMIT_FSIZE, &rl), 0);
    rl.rlim_cur = limit;
    signal(SIGXFSZ, SIG_IGN);
    cr_assert_eq(setrlimit(RLIMIT_FSIZE, &rl), 0);
}

static void undo_short_write(void)
{
    struct rlimit rl;
    if (fx.sim) return;
    cr_assert_eq(getrlimit(RLIMIT_FSIZE, &rl), 0);
    rl.rlim_cur = rl.rlim_max;
    cr_assert_eq(setrlimit(RLIMIT_FSIZE, &rl), 0);
}

IO_TEST(short_write_reported_then_continued)
{
    static uint8_t data[2 * BLOCK], back[2 * BLOCK];
    fill(data, sizeof data, 3);
    struct io_file *f = open_new("a");
    cr_assert_eq(io_write_sync(fx.io, f, 0, data, BLOCK, 1), 0);
    arrange_short_write(BLOCK + BLOCK / 2);
    int64_t res = write_one(f, BLOCK, data + BLOCK, BLOCK, IO_W_FLUSH);
    undo_short_write();
    cr_assert_eq(res, BLOCK / 2, "short linked write reports its count: %lld", (long long)res);
    res = write_one(f, BLOCK + BLOCK / 2, data + BLOCK + BLOCK / 2, BLOCK / 2, IO_W_FLUSH);
    cr_assert_eq(res, BLOCK / 2);
    cr_assert_eq(io_read(fx.io, f, 0, back, sizeof back), (int64_t)sizeof back);
    cr_assert_arr_eq(back, data, sizeof data);
    io_close(fx.io, f);
}

IO_TEST(map_sees_later_writes_and_growth)
{
    static uint8_t a[BLOCK], b[BLOCK];
    memset(a, 'a', sizeof a);
    memset(b, 'b', sizeof b);
    struct io_file *f = open_new("a");
    cr_assert_eq(io_write_sync(fx.io, f, 0, a, BLOCK, 0), 0);
    const uint8_t *m = NULL;
    cr_assert_eq(io_map(fx.io, f, 2 * BLOCK, (const void **)&m), 0);
    cr_assert_eq(m[0], 'a');
    cr_assert_eq(m[BLOCK - 1], 'a');
    cr_assert_eq(io_write_sync(fx.io, f, BLOCK, b, BLOCK, 0), 0);
    cr_assert_eq(m[BLOCK], 'b', "map sees the file grow");
    cr_assert_eq(io_write_sync(fx.io, f, 0, b, 1, 1), 0);
    cr_assert_eq(m[0], 'b', "map sees an overwrite");
    io_unmap(fx.io, f, m, 2 * BLOCK);
    io_close(fx.io, f);
}

IO_TEST(rename_unlink_mkdir_and_open_errors)
{
    char pa[512], pb[512], pd[512];
    uint8_t x = 'x', back = 0;
    struct io_file *f = open_new("a");
    cr_assert_eq(io_write_sync(fx.io, f, 0, &x, 1, 1), 0);
    io_close(fx.io, f);
    path_in(pa, sizeof pa, "a");
    path_in(pb, sizeof pb, "b");
    cr_assert_eq(io_open(fx.io, pa, IO_O_CREATE | IO_O_EXCL, &f), -EEXIST);
    cr_assert_eq(io_rename(fx.io, pa, pb), 0);
    cr_assert_eq(io_sync_dir(fx.io, fx.dir), 0);
    cr_assert_eq(io_open(fx.io, pa, 0, &f), -ENOENT);
    cr_assert_eq(io_open(fx.io, pb, IO_O_RDONLY, &f), 0);
    cr_assert_eq(io_read(fx.io, f, 0, &back, 1), 1);
    cr_assert_eq(back, 'x');
    io_close(fx.io, f);
    cr_assert_eq(io_unlink(fx.io, pb), 0);
    cr_assert_eq(io_unlink(fx.io, pb), -ENOENT);
    cr_assert_eq(io_rename(fx.io, pa, pb), -ENOENT);
    cr_assert_eq(io_open(fx.io, pb, 0, &f), -ENOENT);
    cr_assert_eq(io_mkdir(fx.io, path_in(pd, sizeof pd, "sub")), 0);
    cr_assert_eq(io_mkdir(fx.io, pd), -EEXIST);
}

IO_TEST(allocate_extends_with_zeros)
{
    static uint8_t back[4 * BLOCK], zero[4 * BLOCK];
    struct io_file *f = open_new("a");
    cr_assert_eq(io_allocate(fx.io, f, 0, 4 * BLOCK), 0);
    uint64_t size = 0;
    cr_assert_eq(io_size(fx.io, f, &size), 0);
    cr_assert_eq(size, 4 * BLOCK);
    memset(back, 0xff, sizeof back);
    cr_assert_eq(io_read(fx.io, f, 0, back, sizeof back), (int64_t)sizeof back);
    cr_assert_arr_eq(back, zero, sizeof back);
    cr_assert_eq(io_truncate(fx.io, f, BLOCK), 0);
    cr_assert_eq(io_size(fx.io, f, &size), 0);
    cr_assert_eq(size, BLOCK);
    io_close(fx.io, f);
}

IO_TEST(direct_open_writes_aligned_blocks)
{
    char p[512];
    struct io_file *f = NULL;
    uint8_t *data = aligned_alloc(BLOCK, 2 * BLOCK);
    uint8_t *back = aligned_alloc(BLOCK, 2 * BLOCK);
    cr_assert(data && back);
    fill(data, 2 * BLOCK, 9);
    cr_assert_eq(io_open(fx.io, path_in(p, sizeof p, "d"), IO_O_CREATE | IO_O_DIRECT, &f), 0);
    cr_assert_eq(io_write_sync(fx.io, f, 0, data, 2 * BLOCK, 1), 0);
    cr_assert_eq(io_read(fx.io, f, 0, back, 2 * BLOCK), 2 * BLOCK);
    cr_assert_arr_eq(back, data, 2 * BLOCK);
    io_close(fx.io, f);
    free(data);
    free(back);
}
