/*
 * test_disk_reserve.c: a store that fills its own file system (a small tmpfs mounted for each
 * test), through the engine's API with the test clock: the reserve (disk_reserve.h) is let go at
 * the log's end, new keys answer FULL while owner calls and reads go on, a restart finds it let
 * go, and once the keys expire the space comes back and new keys are taken without a restart.
 * Mounting needs root (CAP_SYS_ADMIN): elsewhere each test is skipped, and says why.
 */
#include <criterion/criterion.h>

#include <errno.h>
#include <fcntl.h>
#include <sched.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mount.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <sys/wait.h>
#include <unistd.h>

#include "idem.h"
#include "testutil.h"

enum { FS_MIB = 24, DAY_MS = 86400000 };

/* The bytes of each key's result: 4 KiB, but a test may take more (before its first key). */
static size_t result_len = 4096;

/* A fresh directory with a tmpfs of FS_MIB mounted on it, or the test is skipped. */
static char *mount_small(void)
{
    /* In a mount namespace of the test's own where it can have one: a test that fails or times
     * out leaves no mount behind. */
    if (unshare(CLONE_NEWNS) == 0) (void)mount(NULL, "/", NULL, MS_REC | MS_PRIVATE, NULL);
    char *dir = tu_mkdtemp("reserve-fs");
    char opts[64];
    snprintf(opts, sizeof opts, "size=%dm,mode=0700", FS_MIB);
    if (mount("idem-test", dir, "tmpfs", 0, opts) != 0) {
        int err = errno;
        tu_rmtree(dir);
        cr_skip_test("a tmpfs cannot be mounted here (%s): the test needs root", strerror(err));
    }
    return dir;
}

static void unmount_small(char *dir)
{
    cr_assert_eq(umount2(dir, MNT_DETACH), 0, "umount: %s", strerror(errno));
    tu_rmtree(dir);
}

static uint64_t free_bytes(const char *dir)
{
    struct statvfs v;
    cr_assert_eq(statvfs(dir, &v), 0);
    return (uint64_t)v.f_bavail * v.f_frsize;
}

/* Takes all but left bytes of dir's free space with a file of its own (as another program on a
 * shared disk might); returns its path, malloc'd. With no more than left free, makes nothing
 * and returns NULL if may_be_less (the store's flusher may take room meanwhile: a check of the
 * free space just before the call is no promise). */
static char *ballast_leaving(const char *dir, uint64_t left, int may_be_less)
{
    uint64_t room = free_bytes(dir);
    if (may_be_less && room <= left) return NULL;
    cr_assert_gt(room, left);
    char *path = malloc(4200);
    cr_assert(path);
    snprintf(path, 4200, "%s/ballast", dir);
    int fd = open(path, O_CREAT | O_WRONLY | O_CLOEXEC, 0600);
    cr_assert_geq(fd, 0);
    cr_assert_eq(fallocate(fd, 0, 0, (off_t)(room - left)), 0, "%s", strerror(errno));
    close(fd);
    return path;
}

static idem_store *open_small(const char *dir)
{
    idem_options o;
    idem_options_init(&o);
    o.segment_bytes = 1u << 20;
    o.test_clock = 1;
    idem_store *s;
    cr_assert_eq(idem_open(dir, &o, &s), IDEM_OK, "%s", idem_last_error());
    return s;
}

static idem_stats stats_of(idem_store *s)
{
    idem_stats st;
    idem_get_stats(s, &st);
    return st;
}

/* The result key i commits: result_len bytes lz4 cannot shrink, its own for each key. */
static uint8_t *result_of(int i)
{
    return tu_random_bytes(result_len, 1000u + (uint64_t)i);
}

/* Claims key with a ttl of days (and a lease as long, a week at most): its outcome, or -1 for FULL
 * (as either the call or the completion says it). *tok: the token of a new claim. */
static int claim_for(idem_queue *q, const char *key, int days, int64_t *tok)
{
    idem_claim_args a = {.ttl_ms = (uint64_t)days * DAY_MS,
                         .lease_ms = (uint64_t)(days < 7 ? days : 7) * DAY_MS};
    idem_completion c;
    int rc = idem_claim(q, key, strlen(key), &a, &c);
    if (rc == IDEM_OK) rc = c.err;
    if (rc == IDEM_EFULL) return -1;
    cr_assert_eq(rc, IDEM_OK, "claim %s: %s", key, idem_strerror(rc));
    *tok = c.token;
    return c.outcome;
}

/* Claims key with a day's ttl and lease (claim_for). */
static int claim_of(idem_queue *q, const char *key, int64_t *tok)
{
    return claim_for(q, key, 1, tok);
}

/* Commits key; an owner call the log's end answers FULL (before the reserve is let go) is made
 * again, for at most 10 s. */
static void commit_of(idem_store *s, idem_queue *q, const char *key, int64_t tok, const void *r)
{
    int rc = IDEM_EFULL;
    for (int i = 0; i < 1000 && rc == IDEM_EFULL; i++) {
        rc = idem_commit(q, key, strlen(key), tok, r, result_len);
        if (rc == IDEM_EFULL) {
            cr_assert_eq(idem_clock_advance(s, 10), IDEM_OK);
            usleep(10000);
        }
    }
    cr_assert_eq(rc, IDEM_OK, "commit %s: %s", key, idem_strerror(rc));
}

/* key reads back committed with its own result (result_of(seed)). */
static void assert_result(idem_queue *q, const char *key, int seed)
{
    idem_completion c;
    cr_assert_eq(idem_get(q, key, strlen(key), &c), IDEM_OK);
    cr_assert(c.found, "%s is gone", key);
    cr_assert_eq(c.record.state, IDEM_STATE_COMMITTED, "%s", key);
    uint8_t *want = result_of(seed);
    cr_assert(c.record.result_len == result_len && memcmp(c.record.result, want, result_len) == 0,
              "%s holds another result", key);
    free(want);
}

/* Key fill-i reads back committed with its own result. */
static void assert_committed(idem_queue *q, int i)
{
    char key[32];
    snprintf(key, sizeof key, "fill-%d", i);
    assert_result(q, key, i);
}

/* Fills the file system with committed keys until the reserve is let go (new keys answer FULL
 * with disk_reserve_released set). Returns how many keys were committed. */
static int fill_until_released(idem_store *s, idem_queue *q)
{
    int keys = 0;
    for (int fulls = 0; stats_of(s).disk_reserve_released == 0;) {
        cr_assert_lt(fulls, 1000, "%d keys and no release of the reserve after 10 s of FULL", keys);
        char key[32];
        snprintf(key, sizeof key, "fill-%d", keys);
        int64_t tok;
        int out = claim_of(q, key, &tok);
        if (out < 0) { /* the flusher lets the reserve go at its next round */
            fulls++;
            cr_assert_eq(idem_clock_advance(s, 10), IDEM_OK);
            usleep(10000);
            continue;
        }
        cr_assert_eq(out, IDEM_NEW, "%s", key);
        uint8_t *r = result_of(keys);
        commit_of(s, q, key, tok, r);
        free(r);
        keys++;
        cr_assert_lt(keys, FS_MIB * 256, "the file system never filled");
    }
    return keys;
}

/* Passes two days of the store clock, then claims key until it is taken (the clock moving 100 ms
 * each 10 ms between tries): the reserve is taken back once compaction and a checkpoint have
 * freed its room and a segment's. Fails after 3000 tries. */
static void await_taken_after_two_days(idem_store *s, idem_queue *q, const char *key)
{
    cr_assert_eq(idem_clock_advance(s, 2 * (int64_t)DAY_MS), IDEM_OK);
    int64_t tok;
    int out = -1;
    for (int i = 0; i < 3000 && out < 0; i++) {
        out = claim_of(q, key, &tok);
        if (out < 0) {
            cr_assert_eq(idem_clock_advance(s, 100), IDEM_OK);
            usleep(10000);
        }
    }
    cr_assert_eq(out, IDEM_NEW, "still FULL 30 s after the keys of a day expired");
}

/* The first key of the fill has expired; the store closes, `idem_verify` finds it sound, and dir
 * is unmounted. */
static void close_expired_and_sound(idem_store *s, idem_queue *q, char *dir)
{
    idem_completion c;
    cr_assert_eq(idem_get(q, "fill-0", 6, &c), IDEM_OK);
    cr_assert(!c.found, "an expired key came back");
    idem_queue_close(q);
    cr_assert_eq(idem_close(s), IDEM_OK);
    idem_verify_report vr;
    cr_assert_eq(idem_verify(dir, &vr, NULL, NULL), IDEM_OK);
    cr_assert_eq(vr.errors, 0, "%s", vr.first_error);
    unmount_small(dir);
}

/* The whole course: fill, FULL with owner calls going on, restart, expiry, space back, new keys
 * without a restart, and a sound store after. */
Test(disk_reserve, a_store_that_filled_its_disk_takes_new_keys_again_once_they_expire,
     .timeout = 300)
{
    char *dir = mount_small();
    idem_store *s = open_small(dir);
    idem_queue *q;
    cr_assert_eq(idem_queue_open(s, 4, &q), IDEM_OK);
    idem_stats st = stats_of(s);
    cr_assert_eq(st.disk_reserve_bytes, 4u << 20, "%llu",
                 (unsigned long long)st.disk_reserve_bytes);

    /* An owner whose work is under way while the disk fills. */
    int64_t pending_tok;
    cr_assert_eq(claim_of(q, "pending", &pending_tok), IDEM_NEW);
    int keys = fill_until_released(s, q);
    /* (A flush of one key takes whole 4 KiB blocks, and compaction's copies are counted too.) */
    cr_assert_gt(keys, FS_MIB * 64, "only %d keys of %d KiB filled %d MiB", keys,
                 (int)(result_len / 1024), FS_MIB);
    uint64_t free_full = free_bytes(dir);
    cr_assert_lt(free_full, st.disk_reserve_bytes + (1u << 20), "FULL with %llu bytes free",
                 (unsigned long long)free_full);
    /* New keys answer FULL until the reserve is taken back: only once compaction has freed its
     * room and a segment's (and the flusher looks once a second). */
    int64_t tok;
    if (claim_of(q, "new-while-full", &tok) != -1)
        cr_assert_eq(stats_of(s).disk_reserve_released, 0, "a new key while the reserve is let go");
    uint8_t *pending_result = result_of(-1);
    cr_assert_eq(idem_commit(q, "pending", 7, pending_tok, pending_result, result_len), IDEM_OK,
                 "the owner's commit on the full disk");
    cr_assert_eq(claim_of(q, "fill-0", &tok), IDEM_DONE, "a repeat on the full disk");
    assert_committed(q, keys - 1);
    idem_queue_close(q);
    cr_assert_eq(idem_close(s), IDEM_OK, "the close's checkpoint: %s", idem_last_error());

    /* The close's checkpoint let compaction's work go (the fill's claims and padding were dead):
     * the reserve would fit again. Another file takes that room, as one might on a shared disk,
     * and leaves less than the reserve: a restart finds it let go, and new keys still answer
     * FULL. */
    free(ballast_leaving(dir, 5u << 19, 0));
    s = open_small(dir);
    cr_assert_eq(idem_queue_open(s, 4, &q), IDEM_OK);
    cr_assert_eq(stats_of(s).disk_reserve_released, 1, "the restart forgot the release");
    cr_assert_eq(claim_of(q, "new-after-restart", &tok), -1, "a new key took the reserve's room");
    assert_committed(q, 0);
    assert_committed(q, keys - 1);
    idem_completion c;
    cr_assert_eq(idem_get(q, "pending", 7, &c), IDEM_OK);
    cr_assert(c.found && c.record.state == IDEM_STATE_COMMITTED &&
                  c.record.result_len == result_len &&
                  memcmp(c.record.result, pending_result, result_len) == 0,
              "the commit made on the full disk is lost");
    free(pending_result);

    /* Two days on every key has expired: compaction and a checkpoint free the log, the reserve
     * is taken back and a new key is taken, with no restart. */
    await_taken_after_two_days(s, q, "after-expiry");
    st = stats_of(s);
    cr_assert_eq(st.disk_reserve_released, 0);
    cr_assert_eq(st.fatal, 0);
    /* The walks and checkpoints go on after the first retirement gave the reserve back. */
    uint64_t free_back = 0, bound = free_full + (FS_MIB / 3) * (1u << 20);
    for (int i = 0; i < 1000 && (free_back = free_bytes(dir)) < bound; i++) {
        cr_assert_eq(idem_clock_advance(s, 100), IDEM_OK);
        cr_assert_eq(idem_sync(s), IDEM_OK);
        usleep(5000);
    }
    fprintf(stderr, "disk_reserve: %d keys filled %d MiB; free %llu bytes full, %llu after\n", keys,
            FS_MIB, (unsigned long long)free_full, (unsigned long long)free_back);
    cr_assert_geq(free_back, bound, "%llu bytes free, %llu full", (unsigned long long)free_back,
                  (unsigned long long)free_full);
    struct stat fs;
    char path[4200];
    snprintf(path, sizeof path, "%s/reserve", dir);
    cr_assert_eq(stat(path, &fs), 0);
    cr_assert_geq((uint64_t)fs.st_blocks * 512, st.disk_reserve_bytes, "the reserve is not held");

    /* The room is the keys' again: as many as a third of the first fill commit and read back. */
    for (int i = keys; i < keys + keys / 3; i++) {
        char key[32];
        snprintf(key, sizeof key, "fill-%d", i);
        int got = -1;
        for (int t = 0; t < 1000 && got < 0; t++) /* FULL while a spare is made: once a second */
            if ((got = claim_of(q, key, &tok)) < 0) usleep(10000);
        cr_assert_eq(got, IDEM_NEW, "%s", key);
        uint8_t *r = result_of(i);
        commit_of(s, q, key, tok, r);
        free(r);
    }
    for (int i = keys; i < keys + keys / 3; i++)
        assert_committed(q, i);
    close_expired_and_sound(s, q, dir);
}

enum { KEEP = 30, OWED = 12, MONTH = 30, SEED_KEEP = 100000, SEED_OWED = 200000 };

/* A store on a full disk whose oldest segment holds keys of a month (KEEP, their walk copies it
 * whole), with OWED claims of a month still in flight, then keys of a day until the reserve was
 * let go. Results of 48 KiB keep the log near the live bytes (a flush's padding is small beside
 * them), so that no walk starts before the keys of a day expire. */
struct month_store {
    char *dir;
    idem_store *s;
    idem_queue *q;
    int keys; /* of a day */
    int64_t owed_tok[OWED];
};

static void month_store_fill(struct month_store *m)
{
    result_len = 48u << 10;
    m->dir = mount_small();
    m->s = open_small(m->dir);
    cr_assert_eq(idem_queue_open(m->s, 4, &m->q), IDEM_OK);
    char key[32];
    int64_t tok;
    for (int i = 0; i < KEEP; i++) { /* about 1.6 segments */
        snprintf(key, sizeof key, "keep-%d", i);
        cr_assert_eq(claim_for(m->q, key, MONTH, &tok), IDEM_NEW, "%s", key);
        uint8_t *r = result_of(SEED_KEEP + i);
        commit_of(m->s, m->q, key, tok, r);
        free(r);
    }
    for (int i = 0; i < OWED; i++) {
        snprintf(key, sizeof key, "owed-%d", i);
        cr_assert_eq(claim_for(m->q, key, MONTH, &m->owed_tok[i]), IDEM_NEW, "%s", key);
    }
    m->keys = fill_until_released(m->s, m->q);
    /* The release made the next segment in the reserve's room. Another file takes what the disk
     * had free beside the reserve, so that the room left is the reserve's alone, less that
     * segment, whatever the disk's last bytes were. */
    uint64_t left = stats_of(m->s).disk_reserve_bytes - (1u << 20);
    free(ballast_leaving(m->dir, left, 1));
}

/* Two days on, new keys are taken again: the walks ended and freed the expired keys' space.
 * Every key of a month reads back with its result (the owed ones where committed), and the store
 * is sound. */
static void month_store_freed(struct month_store *m, int owed_committed)
{
    await_taken_after_two_days(m->s, m->q, "after-expiry");
    idem_stats st = stats_of(m->s);
    cr_assert_eq(st.disk_reserve_released, 0);
    cr_assert_eq(st.fatal, 0);
    fprintf(stderr, "disk_reserve: %d keys of a day behind %d of a month, %llu bytes free after\n",
            m->keys, KEEP + OWED, (unsigned long long)free_bytes(m->dir));
    char key[32];
    for (int i = 0; i < KEEP; i++) {
        snprintf(key, sizeof key, "keep-%d", i);
        assert_result(m->q, key, SEED_KEEP + i);
    }
    for (int i = 0; owed_committed && i < OWED; i++) {
        snprintf(key, sizeof key, "owed-%d", i);
        assert_result(m->q, key, SEED_OWED + i);
    }
    close_expired_and_sound(m->s, m->q, m->dir);
}

/* The reserve holds two segments beside the checkpoints' room. The walk that starts once the keys
 * of a day expire copies the oldest segment whole, while commits of owners whose work was under
 * way when the disk filled took part of the room first. With one segment (the build before), the
 * copies found that room filled before the walk of that segment ended: no segment walked, no
 * checkpoint retired anything, and every new key answered FULL for good, with all but a few keys
 * expired. */
Test(disk_reserve, a_walk_of_a_segment_all_live_on_a_full_disk_has_room_to_end, .timeout = 300)
{
    struct month_store m;
    month_store_fill(&m);
    for (int i = 0; i < OWED; i++) { /* about 0.6 segments: owner calls on the full disk */
        char key[32];
        snprintf(key, sizeof key, "owed-%d", i);
        uint8_t *r = result_of(SEED_OWED + i);
        commit_of(m.s, m.q, key, m.owed_tok[i], r);
        free(r);
    }
    month_store_freed(&m, 1);
}

/* An operator's deletes on a full disk grow the audit trail only where the room that frees the
 * disk stays beside it: with the reserve let go, the first DEL that would grow the trail answers
 * FULL. Before, it took 2 MiB of that room, the walk of the oldest segment found no second
 * segment, and the store answered FULL for good. */
Test(disk_reserve, deletes_on_a_full_disk_leave_the_room_that_frees_it, .timeout = 300)
{
    struct month_store m;
    month_store_fill(&m);
    int deleted = 0, rc = IDEM_OK;
    for (; deleted < 100 && rc == IDEM_OK; deleted += rc == IDEM_OK) {
        char key[32];
        snprintf(key, sizeof key, "fill-%d", deleted);
        rc = idem_del(m.q, key, strlen(key), "operator");
    }
    cr_assert_eq(rc, IDEM_EFULL, "%d deletes and no FULL: %s", deleted, idem_strerror(rc));
    month_store_freed(&m, 0);
}

/* A new reserve file is named `reserve` only once it is allocated, so that an empty one always
 * means a release: a crash between its making and its allocation leaves `reserve.new`, which the
 * next open takes over. With too little room for the reserve, the store takes new keys (its
 * reserve short); once room comes, the reserve is allocated and named. */
Test(disk_reserve, a_reserve_file_a_crash_left_before_its_allocation_is_not_a_release,
     .timeout = 120)
{
    char *dir = mount_small();
    char path[4200], making[4200];
    snprintf(path, sizeof path, "%s/reserve", dir);
    snprintf(making, sizeof making, "%s/reserve.new", dir);
    idem_store *s = open_small(dir);
    cr_assert_eq(idem_close(s), IDEM_OK);
    struct stat fs;
    cr_assert_eq(stat(path, &fs), 0, "no reserve: %s", strerror(errno));
    cr_assert(stat(making, &fs) < 0 && errno == ENOENT, "the making name is left");

    /* A crash while an open makes the reserve: a child whose file size limit (2 MiB) kills it
     * (SIGXFSZ) at the allocation of the 4 MiB reserve, after the file was made. Before the
     * making name, that left an empty `reserve`, which reads as a release. */
    cr_assert_eq(unlink(path), 0);
    pid_t pid = fork();
    cr_assert_geq(pid, 0);
    if (pid == 0) {
        struct rlimit lim = {.rlim_cur = 2u << 20, .rlim_max = 2u << 20};
        idem_options o;
        idem_options_init(&o);
        o.segment_bytes = 1u << 20;
        o.test_clock = 1;
        idem_store *c;
        _exit(setrlimit(RLIMIT_FSIZE, &lim) == 0 && idem_open(dir, &o, &c) == IDEM_OK ? 0 : 1);
    }
    int status;
    cr_assert_eq(waitpid(pid, &status, 0), pid);
    cr_assert(WIFSIGNALED(status) && WTERMSIG(status) == SIGXFSZ,
              "the child was not stopped at the reserve's allocation: status %#x", status);
    cr_assert(stat(path, &fs) < 0 && errno == ENOENT, "a reserve named without its blocks");
    cr_assert_eq(stat(making, &fs), 0, "the child died before it made the reserve");
    char *ballast = ballast_leaving(dir, 3u << 19, 0);

    s = open_small(dir);
    idem_queue *q;
    cr_assert_eq(idem_queue_open(s, 4, &q), IDEM_OK);
    idem_stats st = stats_of(s);
    cr_assert_eq(st.disk_reserve_released, 0, "a reserve never allocated was taken for a release");
    int64_t tok;
    cr_assert_eq(claim_of(q, "taken", &tok), IDEM_NEW, "a new key with the reserve short");
    cr_assert_eq(idem_commit(q, "taken", 5, tok, "r", 1), IDEM_OK);
    cr_assert(stat(path, &fs) < 0 && errno == ENOENT, "a reserve named without its blocks");

    /* Room comes: the flusher makes the reserve within a second. */
    cr_assert_eq(unlink(ballast), 0);
    free(ballast);
    int held = 0;
    for (int i = 0; i < 500 && !held; i++) {
        cr_assert_eq(idem_clock_advance(s, 100), IDEM_OK);
        usleep(10000);
        held = stat(path, &fs) == 0 && (uint64_t)fs.st_blocks * 512 >= st.disk_reserve_bytes;
    }
    cr_assert(held, "the reserve was not made once room came");
    cr_assert_eq((uint64_t)fs.st_size, st.disk_reserve_bytes);
    cr_assert(stat(making, &fs) < 0 && errno == ENOENT, "the making name is left");
    idem_queue_close(q);
    cr_assert_eq(idem_close(s), IDEM_OK);
    unmount_small(dir);
}

/* Waits (10 ms a step, the store's clock moving 100 ms) until dir's reserve file is bytes long and
 * holds its blocks; fails after 500 steps. */
static void await_reserve(idem_store *s, const char *dir, uint64_t bytes, const char *what)
{
    char path[4200];
    snprintf(path, sizeof path, "%s/reserve", dir);
    struct stat fs;
    int ok = 0;
    for (int i = 0; i < 500 && !ok; i++) {
        ok = stat(path, &fs) == 0 && (uint64_t)fs.st_size == bytes &&
             (uint64_t)fs.st_blocks * 512 >= bytes;
        if (!ok) {
            cr_assert_eq(idem_clock_advance(s, 100), IDEM_OK);
            usleep(10000);
        }
    }
    cr_assert(ok, "%s: the reserve is %lld bytes (%lld allocated), not %llu", what,
              (long long)fs.st_size, (long long)fs.st_blocks * 512, (unsigned long long)bytes);
}

/* Waits (5 ms a step, the store's clock moving 100 ms, for at most 1000) until what the store's
 * keys need of a reserve is below bytes. */
static uint64_t await_need_below(idem_store *s, uint64_t bytes)
{
    uint64_t need = 0;
    for (int i = 0; i < 1000 && (need = stats_of(s).disk_reserve_bytes) >= bytes; i++) {
        cr_assert_eq(idem_clock_advance(s, 100), IDEM_OK);
        cr_assert_eq(idem_sync(s), IDEM_OK); /* a round of the flusher: a step of compaction */
        usleep(5000);
    }
    cr_assert_lt(need, bytes, "the expired keys were not reclaimed: %llu keys left",
                 (unsigned long long)stats_of(s).keys);
    return need;
}

/* The reserve follows the key count: grown as keys come, kept while a few of them leave, and cut
 * back once they are gone to what the keys left need, so that room their checkpoint no longer
 * needs goes back to the log without a restart (it was cut back only at an open). */
Test(disk_reserve, a_reserve_grows_with_the_keys_and_gives_back_what_expired_keys_left,
     .timeout = 120)
{
    enum { STAY = 256, MOST = 256 * 680, FEW = 256 * 120 };
    char *dir = tu_mkdtemp("reserve-follow");
    idem_store *s = open_small(dir);
    idem_queue *q;
    cr_assert_eq(idem_queue_open(s, 256, &q), IDEM_OK);
    uint64_t empty = stats_of(s).disk_reserve_bytes;
    cr_assert_eq(empty, 4u << 20);
    /* In the order they expire in: compaction walks the log from its oldest segment. */
    tu_set_nx(q, "small", 0, FEW, "v", 1, 3600000ull);
    tu_set_nx(q, "small", FEW, MOST, "v", 1, 2 * 3600000ull);
    tu_set_nx(q, "small", FEW + MOST, STAY, "v", 1, 10 * 3600000ull);
    uint64_t grown = stats_of(s).disk_reserve_bytes;
    cr_assert_geq(grown, empty + (uint64_t)(MOST + FEW) * 16, "%llu bytes for %d keys",
                  (unsigned long long)grown, MOST + FEW);
    await_reserve(s, dir, grown, "after the keys came");

    /* The few expire: what the keys need drops by less than a quarter, and the file stays. */
    cr_assert_eq(idem_clock_advance(s, 3600000), IDEM_OK);
    uint64_t need = await_need_below(s, grown);
    cr_assert_geq(stats_of(s).keys, STAY + MOST, "live keys are gone");
    usleep(2500 * 1000); /* two rounds of the flusher's once a second */
    struct stat fs;
    char path[4200];
    snprintf(path, sizeof path, "%s/reserve", dir);
    cr_assert_eq(stat(path, &fs), 0);
    cr_assert_eq((uint64_t)fs.st_size, grown, "cut back from %llu to %lld for %llu",
                 (unsigned long long)grown, (long long)fs.st_size, (unsigned long long)need);
    fprintf(stderr, "disk_reserve: %llu bytes empty, %llu for %d keys, %llu needed for %d\n",
            (unsigned long long)empty, (unsigned long long)grown, STAY + MOST + FEW,
            (unsigned long long)need, STAY + MOST);

    /* The most expire: the file is cut back to what an empty store needs. */
    cr_assert_eq(idem_clock_advance(s, 3600000), IDEM_OK);
    cr_assert_eq(await_need_below(s, empty + 1), empty);
    await_reserve(s, dir, empty, "after the keys expired");
    for (int i = 0; i < STAY; i++) {
        char key[32];
        snprintf(key, sizeof key, "small-%d", FEW + MOST + i);
        idem_completion c;
        cr_assert_eq(idem_get(q, key, strlen(key), &c), IDEM_OK);
        cr_assert(c.found, "%s is gone", key);
    }
    idem_queue_close(q);
    cr_assert_eq(idem_close(s), IDEM_OK);
    tu_rmtree(dir);
}
