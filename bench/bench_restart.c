/*
 * bench_restart.c: how long a store of N keys takes to open after a clean shutdown and after a
 * crash, and how long the operator's attention view takes on it (it must not scan the keys).
 *
 * Builds a store of N committed keys (default 10 M) plus 100 in_flight records whose lease ran
 * out and 10 review records, through the batch form; closes it (clean: a checkpoint); reopens
 * it in a new process, as a restart does, and times the open and idem_attention. Then the same
 * after a crash: the store is reopened, 1 % more keys are written, and the process abandons it
 * without closing (a child killed with SIGKILL), so the next open replays the log since the
 * last checkpoint. With --cold, the page
 * cache is dropped (sync, then 3 > /proc/sys/vm/drop_caches: root only; the run stops if that
 * fails) before each timed open, so the open reads everything from the disk; without it the
 * cache is warm. With --pause S, each timed open waits S seconds first: on a VM that hands
 * freed memory back to its host (free page reporting, after about 2 s), the new process's
 * memory then costs more to fault in, as after a restart that did not follow at once (at 10 M
 * keys, after a crash, 600-930 ms against 260-265 without the pause, before the checkpoint was
 * read on a second thread: docs/benchmarks.md, tenth session). One line per figure:
 *   bench restart-clean keys=K cache=warm|cold close_ms=.. open_ms=.. read_MB=.. attention_ms=..
 *                       listed=..   (close_ms: the close before, which writes the checkpoint)
 *   bench restart-crash keys=K cache=warm|cold open_ms=.. read_MB=.. frames_replayed=..
 * (keys: what the opened store holds)
 * (read_MB: what the open made the disk read, from /proc/self/io)
 * Usage: idem-bench-restart [--keys N] [--dir DIR] [--cold] [--pause S]
 */
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "huge_pages.h"
#include "idem.h"

static double now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e3 + ts.tv_nsec / 1e6;
}

static void die(const char *what, int rc)
{
    fprintf(stderr, "bench_restart: %s: %s (%s)\n", what, idem_strerror(rc), idem_last_error());
    exit(1);
}

/* Claims (and commits, unless leave_open) keys [from, to) through batches. */
static void write_keys(idem_store *s, uint64_t from, uint64_t to, int leave_open, uint64_t lease)
{
    idem_queue *q;
    int rc = idem_queue_open(s, 8192, &q);
    if (rc) die("queue", rc);
    enum { B = 4096 };
    static idem_op ops[B];
    static char keys[B][24];
    static idem_completion comps[B];
    for (uint64_t base = from; base < to; base += B) {
        uint32_t n = (uint32_t)(to - base < B ? to - base : B);
        for (uint32_t i = 0; i < n; i++) {
            int len =
                snprintf(keys[i], sizeof keys[i], "key-%010llu", (unsigned long long)(base + i));
            ops[i] = (idem_op){.key = keys[i], .key_len = (uint32_t)len, .ttl_ms = 86400000};
            if (leave_open) {
                ops[i].kind = IDEM_OP_CLAIM;
                ops[i].lease_ms = lease;
            } else {
                ops[i].kind = IDEM_OP_SET_IF_ABSENT;
                ops[i].data = "invoice";
                ops[i].data_len = 7;
            }
        }
        uint32_t sent = 0, got = 0;
        while (got < n) {
            if (sent < n) {
                int k = idem_submit(q, ops + sent, n - sent);
                if (k < 0) die("submit", k);
                sent += (uint32_t)k;
            }
            int m = idem_poll(q, comps, B, -1);
            if (m < 0) die("poll", m);
            for (int i = 0; i < m; i++)
                if (comps[i].err) die("write", comps[i].err);
            got += (uint32_t)m;
        }
    }
    idem_queue_close(q);
}

/* Bytes this process has caused to be read from the disk so far (/proc/self/io), or 0. */
static unsigned long long disk_read_bytes(void)
{
    FILE *f = fopen("/proc/self/io", "r");
    char line[128];
    unsigned long long v = 0;
    while (f && fgets(line, sizeof line, f))
        if (sscanf(line, "read_bytes: %llu", &v) == 1) break;
    if (f) fclose(f);
    return v;
}

/* Drops the page cache (clean pages, dentries, inodes) so the next open reads from disk. */
static void drop_caches(void)
{
    sync();
    FILE *f = fopen("/proc/sys/vm/drop_caches", "w");
    if (!f || fputs("3\n", f) == EOF || fclose(f) != 0) {
        fprintf(stderr, "bench_restart: --cold needs root (writing /proc/sys/vm/drop_caches "
                        "failed)\n");
        exit(1);
    }
}

/* Opens dir, times the open and, after a clean shutdown, the attention view; prints the line.
 * Runs in a process of its own (timed_open). */
static int open_child(const char *dir, const char *what, int cold, const char *close_ms)
{
    idem_options o;
    idem_options_init(&o);
    idem_store *s;
    unsigned long long rb = disk_read_bytes();
    double t0 = now_ms();
    int rc = idem_open(dir, &o, &s);
    if (rc) die("reopen", rc);
    double t1 = now_ms();
    rb = disk_read_bytes() - rb;
    idem_stats st;
    idem_get_stats(s, &st);
    const char *cache = cold ? "cold" : "warm";
    if (!strcmp(what, "clean")) {
        idem_queue *q;
        if ((rc = idem_queue_open(s, 4, &q))) die("queue", rc);
        idem_attention_args a = {.max = 100000};
        const idem_record *recs;
        size_t n;
        double t2 = now_ms();
        if ((rc = idem_attention(q, &a, &recs, &n))) die("attention", rc);
        double t3 = now_ms();
        printf("bench restart-clean keys=%llu cache=%s close_ms=%s open_ms=%.1f read_MB=%.1f "
               "attention_ms=%.2f listed=%zu\n",
               (unsigned long long)st.keys, cache, close_ms, t1 - t0, rb / 1e6, t3 - t2, n);
        idem_queue_close(q);
    } else {
        printf("bench restart-crash keys=%llu cache=%s open_ms=%.1f read_MB=%.1f "
               "frames_replayed=%llu\n",
               (unsigned long long)st.keys, cache, t1 - t0, rb / 1e6,
               (unsigned long long)st.frames_replayed);
    }
    fflush(stdout);
    return idem_close(s) ? 1 : 0;
}

/* The timed open runs in a new process, as a restart does: its heap is memory the kernel (and,
 * on a VM, the host) must hand over and zero, not the pages the closed store has just freed.
 * At 10 M keys a read-only open by a new process, 3 s after the caches were dropped, took
 * 700-780 ms, where opening in the closing process had measured 210-240 ms (docs/benchmarks.md,
 * tenth session). */
static void timed_open(const char *dir, const char *what, int cold, double close_ms, int pause_s)
{
    char self[4096], ms[32];
    ssize_t len = readlink("/proc/self/exe", self, sizeof self - 1);
    if (len <= 0) {
        perror("bench_restart: /proc/self/exe");
        exit(1);
    }
    self[len] = 0;
    snprintf(ms, sizeof ms, "%.1f", close_ms);
    if (cold) drop_caches();
    if (pause_s > 0) sleep((unsigned)pause_s);
    fflush(stdout);
    pid_t pid = fork();
    if (pid == 0) {
        execl(self, self, "--open", dir, what, ms, cold ? "--cold" : NULL, (char *)NULL);
        _exit(127);
    }
    int status;
    if (pid < 0 || waitpid(pid, &status, 0) != pid || !WIFEXITED(status) ||
        WEXITSTATUS(status) != 0) {
        fprintf(stderr, "bench_restart: the timed open (%s) failed\n", what);
        exit(1);
    }
}

int main(int argc, char **argv)
{
    huge_pages_reexec(argv); /* as idemd does: the index it loads on huge pages */
    if (argc >= 5 && !strcmp(argv[1], "--open"))
        return open_child(argv[2], argv[3], argc > 5 && !strcmp(argv[5], "--cold"), argv[4]);
    int cold = 0, pause_s = 0;
    uint64_t keys = 10000000;
    char dir[4096] = "";
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--keys") && i + 1 < argc)
            keys = strtoull(argv[++i], NULL, 0);
        else if (!strcmp(argv[i], "--dir") && i + 1 < argc)
            snprintf(dir, sizeof dir, "%s", argv[++i]);
        else if (!strcmp(argv[i], "--cold"))
            cold = 1;
        else if (!strcmp(argv[i], "--pause") && i + 1 < argc)
            pause_s = atoi(argv[++i]);
        else {
            fprintf(stderr,
                    "usage: idem-bench-restart [--keys N] [--dir DIR] [--cold] [--pause S]\n");
            return 2;
        }
    }
    int own_dir = !*dir;
    if (own_dir) {
        snprintf(dir, sizeof dir, "/tmp/idem-bench-restart-XXXXXX");
        if (!mkdtemp(dir)) return 1;
        rmdir(dir);
    }
    idem_store *s;
    idem_options o;
    idem_options_init(&o);
    int rc = idem_open(dir, &o, &s);
    if (rc) die("open", rc);
    write_keys(s, 0, keys, 0, 0);
    write_keys(s, keys, keys + 100, 1, 1); /* leases of 1 ms: run out at once */
    write_keys(s, keys + 100, keys + 110, 1, 60000);
    idem_queue *q;
    if ((rc = idem_queue_open(s, 4, &q))) die("queue", rc);
    for (uint64_t k = keys + 100; k < keys + 110; k++) {
        char key[24];
        idem_completion c;
        int len = snprintf(key, sizeof key, "key-%010llu", (unsigned long long)k);
        if ((rc = idem_get(q, key, (size_t)len, &c)) || !c.found) die("get", rc);
        if ((rc = idem_hold(q, key, (size_t)len, c.record.token, "target timed out", 16)))
            die("hold", rc);
    }
    idem_queue_close(q);
    usleep(5000);
    double tc = now_ms();
    if ((rc = idem_close(s))) die("close", rc);
    double close_ms = now_ms() - tc; /* a checkpoint of every key, with changes held */

    timed_open(dir, "clean", cold, close_ms, pause_s);

    /* A crash: a child writes 1 % more keys and is killed without closing. */
    fflush(stdout);
    pid_t pid = fork();
    if (pid == 0) {
        idem_store *c;
        if (idem_open(dir, &o, &c)) _exit(3);
        write_keys(c, keys + 110, keys + 110 + keys / 100, 0, 0);
        idem_sync(c);
        kill(getpid(), SIGKILL);
    }
    waitpid(pid, NULL, 0);
    timed_open(dir, "crash", cold, 0, pause_s);
    if (own_dir) {
        char cmd[4200];
        snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
        if (system(cmd) != 0) fprintf(stderr, "bench_restart: could not remove %s\n", dir);
    }
    return 0;
}
