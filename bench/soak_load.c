/*
 * soak_load.c: the paced load of bench/soak.sh in C (hiredis), so that the client's own CPU
 * leaves room for idemd on a 2-core machine. Same options and output as bench/soak_load.py:
 * fresh keys (a random per-run prefix and a counter) at --rate claims a second, in 1-second
 * slices; a slice that ends short is not made up later.
 *   claim-commit  IDEM.CLAIM key ttl lease, then IDEM.COMMIT key token r; the commits of one
 *                 batch travel in the same write as the claims of the next (one round trip).
 *   claim         IDEM.CLAIM only: records stay in_flight (never expire: growth expected).
 *   setnx         SET key v NX PX ttl.
 * One line a second to --log: `t_s sent new other errors`; a summary line on stderr at the end.
 * Exit status 0, or 1 when the connection fails (the summary still says what was done).
 */
#include <hiredis/hiredis.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#define BATCH_MAX 10000

struct opts {
    const char *host, *workload, *log;
    int port, rate, duration, batch;
    long long ttl_ms, lease_ms;
};

struct totals {
    long long sent, new_, other, err;
};

static double mono_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

static void usage(void)
{
    fprintf(stderr, "usage: idem-soak-load --port N [--host H] [--rate N] [--duration S] "
                    "[--ttl-ms MS] [--lease-ms MS] [--workload claim-commit|claim|setnx] "
                    "[--batch N] [--log FILE|-]\n");
    exit(2);
}

static void parse(int argc, char **argv, struct opts *o)
{
    *o = (struct opts){.host = "127.0.0.1",
                       .workload = "claim-commit",
                       .log = "-",
                       .rate = 100000,
                       .duration = 60,
                       .batch = 1000,
                       .ttl_ms = 60000,
                       .lease_ms = 30000};
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!v) usage();
        i++;
        if (!strcmp(a, "--host"))
            o->host = v;
        else if (!strcmp(a, "--port"))
            o->port = atoi(v);
        else if (!strcmp(a, "--rate"))
            o->rate = atoi(v);
        else if (!strcmp(a, "--duration"))
            o->duration = atoi(v);
        else if (!strcmp(a, "--ttl-ms"))
            o->ttl_ms = atoll(v);
        else if (!strcmp(a, "--lease-ms"))
            o->lease_ms = atoll(v);
        else if (!strcmp(a, "--workload"))
            o->workload = v;
        else if (!strcmp(a, "--batch"))
            o->batch = atoi(v);
        else if (!strcmp(a, "--log"))
            o->log = v;
        else
            usage();
    }
    if (o->port <= 0 || o->rate <= 0 || o->duration <= 0 || o->batch <= 0 || o->batch > BATCH_MAX ||
        o->ttl_ms <= 0 || o->lease_ms <= 0 ||
        (strcmp(o->workload, "claim-commit") && strcmp(o->workload, "claim") &&
         strcmp(o->workload, "setnx")))
        usage();
}

/* Reads one reply; returns it, or NULL when the connection failed (c->errstr says why). */
static redisReply *reply(redisContext *c)
{
    void *r = NULL;
    if (redisGetReply(c, &r) != REDIS_OK) return NULL;
    return r;
}

/* The commits pending for keys first.. (tokens[j] 0: that claim was not `new`). */
static int send_commits(redisContext *c, const char *prefix, long long first,
                        const long long *tokens, int n)
{
    int sent = 0;
    for (int j = 0; j < n; j++) {
        if (!tokens[j]) continue;
        redisAppendCommand(c, "IDEM.COMMIT %s%012llx %lld r", prefix, first + j, tokens[j]);
        sent++;
    }
    return sent;
}

int main(int argc, char **argv)
{
    struct opts o;
    parse(argc, argv, &o);
    int commit = !strcmp(o.workload, "claim-commit"), setnx = !strcmp(o.workload, "setnx");
    FILE *log = strcmp(o.log, "-") ? fopen(o.log, "w") : stdout;
    if (!log) {
        perror(o.log);
        return 2;
    }
    setvbuf(log, NULL, _IOLBF, 0);
    redisContext *c = redisConnect(o.host, o.port);
    if (!c || c->err) {
        fprintf(stderr, "soak_load: cannot connect to %s:%d: %s\n", o.host, o.port,
                c ? c->errstr : "out of memory");
        return 1;
    }
    char prefix[32];
    srand48((long)getpid() ^ (long)time(NULL));
    snprintf(prefix, sizeof prefix, "soak:%06lx%06lx:", lrand48() & 0xffffff, lrand48() & 0xffffff);

    static long long tokens[BATCH_MAX];
    long long seq = 0, pend_first = 0;
    int pend_n = 0, failed = 0;
    struct totals t = {0};
    double t0 = mono_s();
    for (int sl = 0; sl < o.duration && !failed; sl++) {
        double end = t0 + sl + 1;
        struct totals s = {0};
        while (s.sent < o.rate && mono_s() < end && !failed) {
            int n = o.batch < o.rate - s.sent ? o.batch : (int)(o.rate - s.sent);
            long long first = seq;
            seq += n;
            int ncommit = pend_n ? send_commits(c, prefix, pend_first, tokens, pend_n) : 0;
            pend_n = 0;
            for (int j = 0; j < n; j++) {
                if (setnx)
                    redisAppendCommand(c, "SET %s%012llx v NX PX %lld", prefix, first + j,
                                       o.ttl_ms);
                else
                    redisAppendCommand(c, "IDEM.CLAIM %s%012llx %lld %lld", prefix, first + j,
                                       o.ttl_ms, o.lease_ms);
            }
            for (int j = 0; j < ncommit && !failed; j++) {
                redisReply *r = reply(c);
                if (!r)
                    failed = 1;
                else if (r->type == REDIS_REPLY_ERROR)
                    s.err++;
                freeReplyObject(r);
            }
            for (int j = 0; j < n && !failed; j++) {
                redisReply *r = reply(c);
                tokens[j] = 0;
                if (!r) {
                    failed = 1;
                    break;
                }
                if (r->type == REDIS_REPLY_ERROR) {
                    s.err++;
                } else if (setnx ? r->type == REDIS_REPLY_STATUS && !strcmp(r->str, "OK")
                                 : r->type == REDIS_REPLY_ARRAY && r->elements == 2 &&
                                       r->element[0]->type == REDIS_REPLY_STRING &&
                                       !strcmp(r->element[0]->str, "new")) {
                    s.new_++;
                    if (!setnx) tokens[j] = r->element[1]->integer;
                } else {
                    s.other++;
                }
                freeReplyObject(r);
            }
            if (commit && !failed) {
                pend_first = first;
                pend_n = n;
            }
            s.sent += n;
        }
        double rest = end - mono_s();
        if (rest > 0 && !failed) usleep((useconds_t)(rest * 1e6));
        t.sent += s.sent;
        t.new_ += s.new_;
        t.other += s.other;
        t.err += s.err;
        fprintf(log, "%d %lld %lld %lld %lld\n", sl + 1, s.sent, s.new_, s.other, s.err);
    }
    /* Commit the last batch, so that nothing is left in_flight. */
    int ncommit = !failed && pend_n ? send_commits(c, prefix, pend_first, tokens, pend_n) : 0;
    for (int j = 0; j < ncommit && !failed; j++) {
        redisReply *r = reply(c);
        if (!r) failed = 1;
        freeReplyObject(r);
    }
    double el = mono_s() - t0;
    if (failed) fprintf(stderr, "soak_load: connection failed: %s\n", c->errstr);
    fprintf(stderr,
            "soak_load: workload=%s sent=%lld new=%lld other=%lld errors=%lld in %.1fs: %.0f "
            "claims/s\n",
            o.workload, t.sent, t.new_, t.other, t.err, el, (double)t.sent / el);
    redisFree(c);
    if (log != stdout) fclose(log);
    return failed;
}
