/*
 * bench_engine.c: what the idem engine sustains, and what LMDB and SQLite sustain doing the same
 * durable work on the same disk, in one run.
 *
 * Output: one line per case,
 *   bench <case> ops/s=<n> p50_us=<n> p99_us=<n> flushes/s=<n> records/flush=<n> n=<ops>
 *         p999_us=<n> max_us=<n>
 * followed by `capped=1` when the time cap ended the case before its key count, `errors=<n>` when
 * an operation answered something other than what the case expects (the first is printed to
 * stderr), and for the growth case `mem_B/key=<n>` (idem_stats.memory_bytes / keys: the index and
 * every buffer of the store), `anon_B/key=<n>` (the process's resident anonymous memory, RssAnon,
 * after the case less before the store opened, / keys: what the store holds by the kernel's
 * count, the allocator's overheads included), `index_step_max_us=<n>` (the longest single growth
 * step of the index: a segment rebuilt or split, or the directory doubled; max_us is the longest
 * claim, whatever held it up), `index_step_max_cpu_us=<n>` (the longest step's CPU time: without
 * the time the thread waited for a core, which a shared 2-core machine adds to the wall time),
 * `index_steps=<n>` and `index_step_p999_cpu_us=<n>` (the steps, and the CPU time 99.9% of them
 * stayed within) and `index_step_unready=<n>` (blocks carved from memory the index's thread had
 * not faulted in ahead, which the step then faulted in itself: src/index_mem.c). After the
 * growth line, a `# host:` line times a fixed computation of about 20 us the same way, 20,000
 * times: on a virtual machine, time the host takes the core away counts as the thread's CPU
 * time, and this line shows how much of a step's longest time that can be. Lines
 * starting with '#' are context. A last line prints the ratios idem/peer of durable new-key claims.
 * Exit 0 when every case ran without errors, 1 otherwise, 2 on a usage error.
 *
 * Measured how:
 *   - ops/s: operations completed / wall time from the first submit to the last completion.
 *     A claim+commit pair counts as one operation.
 *   - p50/p99/max: from submit to completion. For the blocking cases and growth, per operation
 *     (one idem_claim call). For the batch form (idem_submit/idem_poll, --batch operations per
 *     batch, default 4096, --slots batches in flight on one queue, default 8) and for the
 *     peers, per BATCH: from the submit of its first operation to the completion of its last
 *     (claim+commit: from the claims' submit to the last commit's completion; LMDB/SQLite: one
 *     transaction, begin to durable commit).
 *   - flushes/s, records/flush: deltas of idem_stats.flushes and .flush_records over the case;
 *     for the peers, synced transactions per second and inserts per transaction.
 * Cases (--case NAME runs one):
 *   claim-new-sync        new keys, batch form, IDEM_DURABILITY_SYNC: the headline durable rate.
 *   claim-new-dur-batch   the same in IDEM_DURABILITY_BATCH; claim-new-dur-none in _NONE.
 *   claim-commit-32       claim then commit of each key with a 32 B result, batch form, sync.
 *   claim-commit-4k       the same with 4 KiB results, at most 256 Ki pairs (1 GiB of results).
 *   claim-commit-parked   claim-commit-32 with 10,000 claims parked by WAIT (60 s) on other keys
 *                         the bench holds: what a commit pays for the claims waiting elsewhere.
 *   dup-uniform           claims of existing committed keys (preloaded with SET_IF_ABSENT,
 *                         synced and checkpointed, not timed: the checkpoint the preload's log
 *                         calls for would otherwise run during the case, and a store that only
 *                         answers repeats writes none), keys uniform over all of them; expects
 *                         `done`.
 *   dup-recent            the same over the 128 Ki most recently loaded keys. Both run from
 *                         --dup-threads threads at once (default: the CPUs online, at most 8),
 *                         each with its own queue, its own draw of keys and keys/threads claims:
 *                         such claims are answered without the store's lock, on every core.
 *   growth                one thread, blocking idem_claim of new keys into an empty store with
 *                         IDEM_DURABILITY_NONE, so that max_us is the longest pause of the index
 *                         and buffers, not the disk.
 *   blocking-1            blocking idem_claim of new keys from 1 thread, sync.
 *   blocking-64           the same from 64 threads, each with its own idem_queue (group commit).
 *   lmdb                  mdb_put(MDB_NOOVERWRITE) of the same keys (24 B values), N per write
 *                         transaction, default sync flags: each commit is durable (fdatasync of
 *                         the data, then of the meta page) before it returns. Default flags beat
 *                         MDB_WRITEMAP here; MDB_NOSYNC/NOMETASYNC would not be durable.
 *   sqlite                INSERT OR IGNORE into a WITHOUT ROWID table (16 B key, 24 B value),
 *                         journal_mode=WAL, synchronous=FULL, N per transaction, 256 MiB cache.
 *   N (--peer-batch) defaults to 32768, the operations the batch form keeps in flight (8 x 4096):
 *   both sides then hold the same number of unacknowledged inserts. Peers go faster per insert
 *   with larger N (fewer pages rewritten per key) at the price of latency; at 4096 they were
 *   2-3x slower than at 32768 on 1 Mi keys.
 * Keys: 16 hex bytes, key i = splitmix64(i ^ seed) (bench_util.h): distinct, uniform, fixed seed.
 * Every store and peer database lives in its own directory under --dir (default a temporary
 * directory under /tmp), removed when the case ends. Every case stops at its key count or its
 * time cap, whichever comes first (--quick: 1 Mi keys, 2.5 s per idem case, 10 s per peer;
 * default: 10 Mi keys, 60 s per idem case, 120 s per peer); a stalled engine (no completion for
 * 30 s) ends the case with an error.
 */
#include <errno.h>
#include <getopt.h>
#include <inttypes.h>
#include <limits.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "idem.h"
#include "bench_util.h"
#include "huge_pages.h"
#include "index.h"
#include "store.h" /* the index's longest growth step (growth case) */

#ifdef IDEM_HAVE_PEERS
#include <lmdb.h>
#include <sqlite3.h>
#endif

#define BATCH_OPS          IDEM_BATCH_MAX /* default operations per idem_submit */
#define BATCH_SLOTS        8u             /* default (and most) batches in flight */
#define TTL_MS             (24ull * 3600 * 1000)
#define LEASE_MS           30000ull
#define RECENT_WINDOW      (128u * 1024u)
#define RESULT_SMALL_BYTES 32u
#define PARKED_CLAIMS      10000u /* claim-commit-parked */
#define RESULT_LARGE_BYTES 4096u
#define RESULT_SRC_BYTES   (2u * RESULT_LARGE_BYTES)
#define LARGE_PAIRS_MAX    (256u * 1024u)
#define PEER_VALUE_BYTES   24u
#define STALL_NS           (30ull * 1000000000ull)
#define THREADS_MAX        64u

enum kind { K_NEW, K_CLAIM_COMMIT, K_DUP, K_PRELOAD };

static const char *const case_names[] = {
    "claim-new-sync",  "claim-new-dur-batch", "claim-new-dur-none", "claim-commit-32",
    "claim-commit-4k", "claim-commit-parked", "dup-uniform",        "dup-recent",
    "growth",          "blocking-1",          "blocking-64",        "lmdb",
    "sqlite",
};

struct run {
    uint64_t keys;
    int quick;
    char dir[PATH_MAX];
    int own_dir;
    const char *only;
    double case_s, peer_s, blocking1_s;
    uint32_t batch, slots; /* batch form: operations per submit, batches in flight */
    uint32_t peer_batch;   /* inserts per peer transaction */
    uint32_t dup_threads;  /* threads submitting in the dup cases */
    uint8_t result_src[RESULT_SRC_BYTES];
    double new_sync_ops, lmdb_ops, sqlite_ops; /* ops/s, 0 when not run */
    int failures;
};

struct result {
    const char *name;
    uint64_t ops;
    double seconds;
    bench_hist h;
    uint64_t flushes, flush_records;
    uint64_t errors;
    int capped;
    double mem_bytes_per_key;                         /* < 0: not printed */
    double anon_bytes_per_key;                        /* < 0: not printed */
    int64_t index_step_max_us, index_step_max_cpu_us; /* < 0: not printed */
    uint64_t index_steps, index_step_p999_cpu_us, index_step_unready;
};

/* One queue driven in batches: each slot is a batch going through the steps of its case. */
struct pipe {
    const char *name;
    enum kind kind;
    idem_queue *q;
    uint32_t batch, slots; /* operations per batch, batches in flight */
    idem_op *ops;          /* slots * batch */
    uint8_t *keys;         /* the key bytes each op points at */
    uint64_t *key_number;  /* the key index of each op */
    int64_t *tokens;       /* claim-commit: token of each claimed key */
    idem_completion *comp; /* batch */
    uint32_t stage[BATCH_SLOTS], count[BATCH_SLOTS], submitted[BATCH_SLOTS], left[BATCH_SLOTS];
    uint64_t start_ns[BATCH_SLOTS]; /* submit of the batch's first operation */
    uint32_t starts[BATCH_SLOTS];   /* the step not yet submitted begins a batch */
    uint32_t active;
    int stop;
    uint64_t cursor, limit; /* operations (or keys) handed out, and how many to hand out */
    uint64_t loaded;        /* dup: keys present */
    int recent;             /* dup: draw from the recent window */
    uint64_t rng;
    const uint8_t *result_src;
    uint32_t result_bytes;
    uint64_t ops_done, errors;
    bench_hist h;
};

static int case_selected(const struct run *r, const char *name)
{
    return r->only == NULL || strcmp(r->only, name) == 0;
}

static void print_result(struct run *r, const struct result *res)
{
    double s = res->seconds > 0 ? res->seconds : 1e-9;
    double rpf = res->flushes ? (double)res->flush_records / (double)res->flushes : 0.0;
    printf("bench %s ops/s=%.0f p50_us=%.1f p99_us=%.1f flushes/s=%.0f records/flush=%.1f "
           "n=%" PRIu64 " p999_us=%.1f max_us=%.1f",
           res->name, (double)res->ops / s, bench_hist_us(&res->h, 0.5),
           bench_hist_us(&res->h, 0.99), (double)res->flushes / s, rpf, res->ops,
           bench_hist_us(&res->h, 0.999), (double)res->h.max_ns / 1000.0);
    if (res->capped) printf(" capped=1");
    if (res->errors) {
        printf(" errors=%" PRIu64, res->errors);
        r->failures++;
    }
    if (res->mem_bytes_per_key >= 0) printf(" mem_B/key=%.1f", res->mem_bytes_per_key);
    if (res->anon_bytes_per_key > 0) printf(" anon_B/key=%.1f", res->anon_bytes_per_key);
    if (res->index_step_max_us >= 0)
        printf(" index_step_max_us=%" PRId64 " index_step_max_cpu_us=%" PRId64
               " index_steps=%" PRIu64 " index_step_p999_cpu_us=%" PRIu64
               " index_step_unready=%" PRIu64,
               res->index_step_max_us, res->index_step_max_cpu_us, res->index_steps,
               res->index_step_p999_cpu_us, res->index_step_unready);
    printf("\n");
    fflush(stdout);
}

static void print_case_error(struct run *r, const char *name, const char *what)
{
    printf("bench %s error=%s\n", name, what);
    fflush(stdout);
    r->failures++;
}

static int case_path(const struct run *r, const char *name, char *out, size_t out_len)
{
    int n = snprintf(out, out_len, "%s/%s", r->dir, name);
    return (n > 0 && (size_t)n < out_len) ? 0 : -1;
}

/* Opens a fresh store for one case in <dir>/<name>. */
static int store_open(struct run *r, const char *name, int durability, idem_store **out)
{
    char path[PATH_MAX];
    if (case_path(r, name, path, sizeof(path)) != 0) return -1;
    bench_rm_rf(path);
    if (mkdir(path, 0755) != 0) {
        fprintf(stderr, "bench: mkdir %s: %s\n", path, strerror(errno));
        return -1;
    }
    idem_options o;
    idem_options_init(&o);
    o.durability = durability;
    int rc = idem_open(path, &o, out);
    if (rc != IDEM_OK) {
        fprintf(stderr, "bench: %s: idem_open: %s: %s\n", name, idem_strerror(rc),
                idem_last_error());
        return -1;
    }
    return 0;
}

static void store_close(struct run *r, const char *name, idem_store *s)
{
    char path[PATH_MAX];
    int rc = idem_close(s);
    if (rc != IDEM_OK) {
        fprintf(stderr, "bench: %s: idem_close: %s\n", name, idem_strerror(rc));
        r->failures++;
    }
    if (case_path(r, name, path, sizeof(path)) == 0) bench_rm_rf(path);
}

static void note_error(struct pipe *p, uint64_t key_number, const idem_completion *c,
                       const char *expected)
{
    if (p->errors++ == 0)
        fprintf(stderr, "bench: %s: key %" PRIu64 ": expected %s, got err=%s outcome=%s\n", p->name,
                key_number, expected, idem_strerror(c->err),
                c->outcome ? idem_outcome_name(c->outcome) : "-");
}

static void pipe_close(struct pipe *p)
{
    if (p->q) idem_queue_close(p->q);
    free(p->ops);
    free(p->keys);
    free(p->key_number);
    free(p->tokens);
    free(p->comp);
}

static int pipe_open(struct pipe *p, const struct run *r, idem_store *s, const char *name,
                     enum kind kind)
{
    size_t n = (size_t)r->slots * r->batch;
    memset(p, 0, sizeof(*p));
    p->batch = r->batch;
    p->slots = r->slots;
    p->name = name;
    p->kind = kind;
    p->rng = BENCH_SEED;
    p->ops = calloc(n, sizeof(*p->ops));
    p->keys = calloc(n, BENCH_KEY_BYTES);
    p->key_number = calloc(n, sizeof(*p->key_number));
    p->tokens = calloc(n, sizeof(*p->tokens));
    p->comp = calloc(p->batch, sizeof(*p->comp));
    if (!p->ops || !p->keys || !p->key_number || !p->tokens || !p->comp) {
        pipe_close(p);
        return -1;
    }
    int rc = idem_queue_open(s, (uint32_t)n, &p->q);
    if (rc != IDEM_OK) {
        fprintf(stderr, "bench: %s: idem_queue_open: %s\n", name, idem_strerror(rc));
        p->q = NULL;
        pipe_close(p);
        return -1;
    }
    return 0;
}

/* Fills op j of slot with an operation of `kind` on key number k. */
static void pipe_fill(struct pipe *p, uint32_t slot, uint32_t j, uint32_t kind, uint64_t k)
{
    size_t at = (size_t)slot * p->batch + j;
    idem_op *op = &p->ops[at];
    uint8_t *key = p->keys + at * BENCH_KEY_BYTES;
    memset(op, 0, sizeof(*op));
    op->kind = kind;
    op->user_data = ((uint64_t)slot << 32) | j;
    bench_key(k, key);
    op->key = key;
    op->key_len = BENCH_KEY_BYTES;
    op->ttl_ms = TTL_MS;
    op->lease_ms = LEASE_MS;
    if (kind == IDEM_OP_SET_IF_ABSENT) {
        op->data = p->result_src + (k & (RESULT_SRC_BYTES / 2 - 1));
        op->data_len = p->result_bytes;
    }
    p->key_number[at] = k;
}

/* Turns the claims of slot (all completed) into commits of the same keys. */
static uint32_t pipe_commits(struct pipe *p, uint32_t slot)
{
    uint32_t n = p->count[slot];
    for (uint32_t j = 0; j < n; j++) {
        size_t at = (size_t)slot * p->batch + j;
        idem_op *op = &p->ops[at];
        op->kind = IDEM_OP_COMMIT;
        op->token = p->tokens[at];
        op->data = p->result_src + (p->key_number[at] & (RESULT_SRC_BYTES / 2 - 1));
        op->data_len = p->result_bytes;
    }
    return n;
}

/*
 * The next step of slot: the number of operations filled in, 0 when the slot is finished.
 * *first is set when the step begins a new batch (a new latency sample).
 */
static uint32_t pipe_next(struct pipe *p, uint32_t slot, int *first)
{
    if (p->kind == K_CLAIM_COMMIT && p->stage[slot] == 1) {
        p->stage[slot] = 0;
        *first = 0;
        return pipe_commits(p, slot);
    }
    if (p->stop || p->cursor >= p->limit) return 0;
    uint64_t left = p->limit - p->cursor;
    uint32_t n = left < p->batch ? (uint32_t)left : p->batch;
    uint32_t kind = p->kind == K_PRELOAD ? IDEM_OP_SET_IF_ABSENT : IDEM_OP_CLAIM;
    for (uint32_t j = 0; j < n; j++) {
        uint64_t k = p->cursor + j;
        if (p->kind == K_DUP) {
            uint64_t x = bench_rng(&p->rng);
            uint64_t span = p->recent && p->loaded > RECENT_WINDOW ? RECENT_WINDOW : p->loaded;
            k = p->loaded - 1 - x % span;
        }
        pipe_fill(p, slot, j, kind, k);
    }
    p->cursor += n;
    if (p->kind == K_CLAIM_COMMIT) p->stage[slot] = 1;
    *first = 1;
    return n;
}

/* Checks one completion against what the case expects. */
static void pipe_done(struct pipe *p, uint32_t slot, uint32_t j, const idem_completion *c)
{
    size_t at = (size_t)slot * p->batch + j;
    uint64_t k = p->key_number[at];
    uint32_t kind = p->ops[at].kind;
    if (kind == IDEM_OP_COMMIT) {
        if (c->err != IDEM_OK)
            note_error(p, k, c, "commit ok");
        else
            p->ops_done++;
        return;
    }
    int want = p->kind == K_DUP ? IDEM_DONE : IDEM_NEW;
    if (c->err != IDEM_OK || c->outcome != want) {
        note_error(p, k, c, want == IDEM_DONE ? "done" : "new");
        p->tokens[at] = 0;
        return;
    }
    p->tokens[at] = c->token;
    if (p->kind != K_CLAIM_COMMIT) p->ops_done++;
}

/* Called when slot has nothing outstanding: records its batch latency, starts its next step. */
static void pipe_step(struct pipe *p, uint32_t slot, uint64_t now)
{
    int first = 0;
    uint32_t n = pipe_next(p, slot, &first);
    if (p->count[slot] > 0 && (n == 0 || first)) bench_hist_add(&p->h, now - p->start_ns[slot]);
    p->starts[slot] = (uint32_t)first;
    p->count[slot] = n;
    p->submitted[slot] = 0;
    p->left[slot] = n;
    if (n == 0) p->active--;
}

/* Submits what the slots have not yet had accepted; stops at a full queue. */
static int pipe_submit(struct pipe *p)
{
    for (uint32_t slot = 0; slot < p->slots; slot++) {
        uint32_t todo = p->count[slot] - p->submitted[slot];
        if (todo == 0) continue;
        if (p->starts[slot]) {
            p->start_ns[slot] = bench_now_ns();
            p->starts[slot] = 0;
        }
        const idem_op *ops = &p->ops[(size_t)slot * p->batch + p->submitted[slot]];
        int rc = idem_submit(p->q, ops, todo);
        if (rc < 0) {
            fprintf(stderr, "bench: %s: idem_submit: %s\n", p->name, idem_strerror(rc));
            return rc;
        }
        p->submitted[slot] += (uint32_t)rc;
        if ((uint32_t)rc < todo) break;
    }
    return 0;
}

/* Runs the slots until the limit or the time cap; returns 0 or -1 (engine error or stall). */
static int pipe_run(struct pipe *p, double seconds, uint64_t *elapsed_ns)
{
    uint64_t start = bench_now_ns(), now = start;
    uint64_t deadline = start + (uint64_t)(seconds * 1e9), progress = start;
    p->active = p->slots;
    for (uint32_t slot = 0; slot < p->slots; slot++)
        pipe_step(p, slot, start);
    while (p->active > 0) {
        if (pipe_submit(p) != 0) return -1;
        int n = idem_poll(p->q, p->comp, p->batch, 100);
        if (n < 0) {
            fprintf(stderr, "bench: %s: idem_poll: %s\n", p->name, idem_strerror(n));
            return -1;
        }
        now = bench_now_ns();
        if (now > deadline) p->stop = 1;
        if (n == 0 && now - progress > STALL_NS) {
            fprintf(stderr, "bench: %s: no completion for 30 s, %u ops pending\n", p->name,
                    idem_queue_pending(p->q));
            return -1;
        }
        if (n > 0) progress = now;
        for (int i = 0; i < n; i++) {
            uint32_t slot = (uint32_t)(p->comp[i].user_data >> 32);
            uint32_t j = (uint32_t)p->comp[i].user_data;
            if (slot >= p->slots || j >= p->count[slot] || p->left[slot] == 0) {
                fprintf(stderr, "bench: %s: completion with unknown user_data %" PRIx64 "\n",
                        p->name, p->comp[i].user_data);
                return -1;
            }
            pipe_done(p, slot, j, &p->comp[i]);
            if (--p->left[slot] == 0) pipe_step(p, slot, now);
        }
    }
    *elapsed_ns = now - start;
    return 0;
}

/* Runs one batch-form case on an open store; fills res. */
static int pipe_case(struct run *r, idem_store *s, struct pipe *p, double seconds,
                     struct result *res)
{
    idem_stats before, after;
    uint64_t elapsed_ns = 0;
    idem_get_stats(s, &before);
    int rc = pipe_run(p, seconds, &elapsed_ns);
    idem_get_stats(s, &after);
    memset(res, 0, sizeof(*res));
    res->name = p->name;
    res->ops = p->ops_done;
    res->seconds = (double)elapsed_ns / 1e9;
    res->h = p->h;
    res->flushes = after.flushes - before.flushes;
    res->flush_records = after.flush_records - before.flush_records;
    res->errors = p->errors;
    res->capped = p->cursor < p->limit;
    res->mem_bytes_per_key = -1;
    res->index_step_max_us = -1;
    (void)r;
    return rc;
}

/* Claims n keys of its own (not the cases' keys) and parks a claim with WAIT on each, in a queue
 * of their own: closing it drops them. Returns the queue, or NULL. */
static idem_queue *park_claims(idem_store *s, uint32_t n)
{
    idem_queue *owner, *q;
    if (idem_queue_open(s, 4, &owner) != IDEM_OK) return NULL;
    if (idem_queue_open(s, n + 1, &q) != IDEM_OK) {
        idem_queue_close(owner);
        return NULL;
    }
    char key[32];
    int ok = 1;
    for (uint32_t i = 0; i < n && ok; i++) {
        int len = snprintf(key, sizeof key, "parked-%05u", i);
        idem_claim_args a = {.ttl_ms = 86400000, .lease_ms = 3600000};
        idem_completion c;
        idem_op op = {.kind = IDEM_OP_CLAIM,
                      .key = key,
                      .key_len = (uint32_t)len,
                      .ttl_ms = a.ttl_ms,
                      .lease_ms = a.lease_ms,
                      .wait_ms = IDEM_WAIT_MS_MAX};
        ok = idem_claim(owner, key, (size_t)len, &a, &c) == IDEM_OK && c.outcome == IDEM_NEW &&
             idem_submit(q, &op, 1) == 1;
    }
    idem_queue_close(owner);
    if (ok) return q;
    idem_queue_close(q);
    return NULL;
}

/* claim-new-* and claim-commit-*: one fresh store, one batch-form case, with parked WAIT
 * claims on other keys meanwhile. */
static void case_batch(struct run *r, const char *name, enum kind kind, int durability,
                       uint32_t result_bytes, uint64_t keys, uint32_t parked)
{
    idem_store *s;
    idem_queue *wq = NULL;
    struct pipe *p = malloc(sizeof(*p));
    struct result *res = malloc(sizeof(*res));
    if (!p || !res || store_open(r, name, durability, &s) != 0) {
        print_case_error(r, name, "open");
        goto out_free;
    }
    if (parked && !(wq = park_claims(s, parked))) {
        print_case_error(r, name, "park");
        goto out_close;
    }
    if (pipe_open(p, r, s, name, kind) != 0) {
        print_case_error(r, name, "queue");
        goto out_close;
    }
    p->limit = keys;
    p->result_src = r->result_src;
    p->result_bytes = result_bytes;
    if (pipe_case(r, s, p, r->case_s, res) != 0)
        print_case_error(r, name, "engine");
    else
        print_result(r, res);
    if (kind == K_NEW && durability == IDEM_DURABILITY_SYNC && res->errors == 0)
        r->new_sync_ops = (double)res->ops / (res->seconds > 0 ? res->seconds : 1e-9);
    pipe_close(p);
out_close:
    if (wq) idem_queue_close(wq);
    store_close(r, name, s);
out_free:
    free(p);
    free(res);
}

/* Loads keys 0..keys-1 as committed records (SET_IF_ABSENT, 32 B values), syncs and takes a
 * checkpoint: untimed. */
static int dup_preload(struct run *r, idem_store *s, struct pipe *p, uint64_t *loaded)
{
    struct result res;
    uint64_t t0 = bench_now_ns();
    if (pipe_open(p, r, s, "dup-preload", K_PRELOAD) != 0) return -1;
    p->limit = r->keys;
    p->result_src = r->result_src;
    p->result_bytes = RESULT_SMALL_BYTES;
    int rc = pipe_case(r, s, p, r->case_s * 4, &res);
    *loaded = p->cursor;
    if (rc == 0 && res.errors != 0) rc = -1;
    pipe_close(p);
    if (rc == 0 && idem_sync(s) != IDEM_OK) rc = -1;
    if (rc == 0 && idem_checkpoint(s) != IDEM_OK) rc = -1;
    printf("# dup: preloaded %" PRIu64 " keys in %.1f s (%s)\n", *loaded,
           (double)(bench_now_ns() - t0) / 1e9, rc == 0 ? "ok" : "failed");
    return rc;
}

struct pipe_thread {
    pthread_t tid;
    struct pipe *p;
    double seconds;
    uint64_t elapsed_ns;
    int rc;
};

static void *pipe_thread_main(void *arg)
{
    struct pipe_thread *t = arg;
    t->rc = pipe_run(t->p, t->seconds, &t->elapsed_ns);
    return NULL;
}

/* pipe_case over n pipes, each driven by a thread of its own, at once: ops summed, the time the
 * slowest took, latencies merged. */
static int pipes_case(idem_store *s, struct pipe *ps, uint32_t n, double seconds,
                      struct result *res)
{
    struct pipe_thread th[THREADS_MAX];
    idem_stats before, after;
    int rc = 0;
    uint32_t started = 0;
    idem_get_stats(s, &before);
    for (; started < n; started++) {
        th[started] = (struct pipe_thread){.p = &ps[started], .seconds = seconds};
        if (pthread_create(&th[started].tid, NULL, pipe_thread_main, &th[started]) != 0) {
            rc = -1;
            break;
        }
    }
    memset(res, 0, sizeof(*res));
    res->name = ps[0].name;
    uint64_t elapsed = 0;
    for (uint32_t i = 0; i < started; i++) {
        pthread_join(th[i].tid, NULL);
        if (th[i].rc != 0) rc = -1;
        if (th[i].elapsed_ns > elapsed) elapsed = th[i].elapsed_ns;
        res->ops += ps[i].ops_done;
        res->errors += ps[i].errors;
        res->capped |= ps[i].cursor < ps[i].limit;
        bench_hist_merge(&res->h, &ps[i].h);
    }
    idem_get_stats(s, &after);
    res->seconds = (double)elapsed / 1e9;
    res->flushes = after.flushes - before.flushes;
    res->flush_records = after.flush_records - before.flush_records;
    res->mem_bytes_per_key = -1;
    res->index_step_max_us = -1;
    return rc;
}

/* dup-uniform and dup-recent on one preloaded store, from --dup-threads threads at once, each
 * with its own queue and its own draw of keys. */
static void case_dup(struct run *r)
{
    static const char *const names[2] = {"dup-uniform", "dup-recent"};
    idem_store *s;
    uint64_t loaded = 0;
    uint32_t n = r->dup_threads;
    struct pipe *ps = calloc(n, sizeof(*ps));
    struct result *res = malloc(sizeof(*res));
    if (!ps || !res || store_open(r, "dup", IDEM_DURABILITY_SYNC, &s) != 0) {
        print_case_error(r, "dup-uniform", "open");
        goto out_free;
    }
    if (dup_preload(r, s, &ps[0], &loaded) != 0 || loaded == 0) {
        print_case_error(r, "dup-uniform", "preload");
        goto out_close;
    }
    printf("# dup: %u threads submitting\n", n);
    for (int recent = 0; recent < 2; recent++) {
        if (!case_selected(r, names[recent])) continue;
        uint32_t opened = 0;
        for (; opened < n; opened++) {
            struct pipe *p = &ps[opened];
            if (pipe_open(p, r, s, names[recent], K_DUP) != 0) break;
            p->limit = (r->keys + n - 1) / n;
            p->loaded = loaded;
            p->recent = recent;
            p->rng = BENCH_SEED + opened; /* each thread its own draw */
        }
        if (opened < n)
            print_case_error(r, names[recent], "queue");
        else if (pipes_case(s, ps, n, r->case_s, res) != 0)
            print_case_error(r, names[recent], "engine");
        else
            print_result(r, res);
        for (uint32_t i = 0; i < opened; i++)
            pipe_close(&ps[i]);
    }
out_close:
    store_close(r, "dup", s);
out_free:
    free(ps);
    free(res);
}

/* ---- Blocking calls from threads ---- */

struct blk_shared {
    const char *name;
    idem_store *s;
    atomic_uint_fast64_t next;
    uint64_t limit;
    uint64_t deadline_ns;
    pthread_barrier_t go;
};

struct blk_thread {
    pthread_t tid;
    struct blk_shared *sh;
    bench_hist h;
    uint64_t ops, errors;
    int failed;
};

static void blk_error(struct blk_thread *t, uint64_t k, int rc, int outcome)
{
    if (t->errors++ == 0)
        fprintf(stderr, "bench: %s: key %" PRIu64 ": expected new, got err=%s outcome=%s\n",
                t->sh->name, k, idem_strerror(rc), outcome ? idem_outcome_name(outcome) : "-");
}

static void *blk_main(void *arg)
{
    struct blk_thread *t = arg;
    struct blk_shared *sh = t->sh;
    idem_queue *q = NULL;
    idem_claim_args a = {.ttl_ms = TTL_MS, .lease_ms = LEASE_MS};
    idem_completion c;
    uint8_t key[BENCH_KEY_BYTES];
    if (idem_queue_open(sh->s, 4, &q) != IDEM_OK) t->failed = 1;
    pthread_barrier_wait(&sh->go);
    while (!t->failed) {
        uint64_t k = atomic_fetch_add(&sh->next, 1);
        uint64_t t0 = bench_now_ns();
        if (k >= sh->limit || t0 > sh->deadline_ns) break;
        bench_key(k, key);
        int rc = idem_claim(q, key, sizeof(key), &a, &c);
        bench_hist_add(&t->h, bench_now_ns() - t0);
        if (rc != IDEM_OK || c.outcome != IDEM_NEW)
            blk_error(t, k, rc, rc == IDEM_OK ? c.outcome : 0);
        else
            t->ops++;
        if (rc == IDEM_EFATAL || rc == IDEM_ECLOSED) t->failed = 1;
    }
    if (q) idem_queue_close(q);
    return NULL;
}

/* Starts n threads on sh, waits for them, and sums their figures into res. */
static int blk_run(struct blk_shared *sh, struct blk_thread *t, uint32_t n, double seconds,
                   struct result *res)
{
    uint32_t started = 0;
    int failed = 0;
    pthread_barrier_init(&sh->go, NULL, n + 1);
    sh->deadline_ns = UINT64_MAX;
    for (; started < n; started++) {
        t[started].sh = sh;
        if (pthread_create(&t[started].tid, NULL, blk_main, &t[started]) != 0) break;
    }
    if (started < n) {
        /* The barrier cannot be passed: abort the run (bench only, never the engine). */
        fprintf(stderr, "bench: %s: pthread_create failed\n", sh->name);
        abort();
    }
    uint64_t start = bench_now_ns();
    sh->deadline_ns = start + (uint64_t)(seconds * 1e9);
    pthread_barrier_wait(&sh->go);
    for (uint32_t i = 0; i < n; i++) {
        pthread_join(t[i].tid, NULL);
        bench_hist_merge(&res->h, &t[i].h);
        res->ops += t[i].ops;
        res->errors += t[i].errors;
        failed |= t[i].failed;
    }
    res->seconds = (double)(bench_now_ns() - start) / 1e9;
    res->capped = atomic_load(&sh->next) < sh->limit;
    pthread_barrier_destroy(&sh->go);
    return failed ? -1 : 0;
}

/* The process's resident anonymous memory (RssAnon), in bytes; 0 when unknown. */
static uint64_t rss_anon_bytes(void)
{
    FILE *f = fopen("/proc/self/status", "r");
    if (!f) return 0;
    char line[256];
    unsigned long long kb = 0;
    while (fgets(line, sizeof line, f))
        if (sscanf(line, "RssAnon: %llu kB", &kb) == 1) break;
    fclose(f);
    return (uint64_t)kb * 1024;
}

static int cmp_i64(const void *a, const void *b)
{
    int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
    return (x > y) - (x < y);
}

/* Times a fixed computation (no memory beyond 16 KiB, no system call) HOST_PROBES times by
 * the thread's CPU clock, as the index times its steps, and prints the spread. */
#define HOST_PROBES 20000
static void host_probe(void)
{
    int64_t *d = malloc(HOST_PROBES * sizeof(*d));
    uint64_t *buf = calloc(2048, sizeof(*buf));
    if (!d || !buf) goto out;
    uint64_t x = 1;
    for (uint32_t i = 0; i < HOST_PROBES; i++) {
        int64_t t0 = util_thread_cpu_us();
        for (int k = 0; k < 12000; k++) {
            x = x * 6364136223846793005ull + 1442695040888963407ull;
            buf[x >> 53] += x;
        }
        d[i] = util_thread_cpu_us() - t0;
    }
    qsort(d, HOST_PROBES, sizeof(*d), cmp_i64);
    printf("# host: a fixed computation timed %d times by the thread's CPU clock: p50 %" PRId64
           " us, p99.9 %" PRId64 " us, longest %" PRId64 " us (checksum %" PRIu64 ")\n",
           HOST_PROBES, d[HOST_PROBES / 2], d[HOST_PROBES - HOST_PROBES / 1000], d[HOST_PROBES - 1],
           buf[x >> 53] & 0xff);
out:
    free(d);
    free(buf);
}

/* blocking-1, blocking-64 and growth: new keys through idem_claim from `threads` threads. */
static void case_blocking(struct run *r, const char *name, uint32_t threads, int durability,
                          double seconds)
{
    idem_store *s;
    idem_stats before, after;
    struct blk_shared sh = {.name = name, .limit = r->keys};
    struct blk_thread *t = calloc(threads, sizeof(*t));
    struct result *res = calloc(1, sizeof(*res));
    uint64_t anon0 = rss_anon_bytes();
    if (!t || !res || store_open(r, name, durability, &s) != 0) {
        print_case_error(r, name, "open");
        goto out_free;
    }
    sh.s = s;
    atomic_init(&sh.next, 0);
    res->name = name;
    res->mem_bytes_per_key = -1;
    res->anon_bytes_per_key = -1;
    res->index_step_max_us = -1;
    idem_get_stats(s, &before);
    int rc = blk_run(&sh, t, threads, seconds, res);
    idem_get_stats(s, &after);
    res->flushes = after.flushes - before.flushes;
    res->flush_records = after.flush_records - before.flush_records;
    if (durability == IDEM_DURABILITY_NONE && after.keys > 0) {
        res->mem_bytes_per_key = (double)after.memory_bytes / (double)after.keys;
        uint64_t anon = rss_anon_bytes();
        if (anon0 && anon > anon0)
            res->anon_bytes_per_key = (double)(anon - anon0) / (double)after.keys;
        res->index_step_max_us = (int64_t)index_max_split_us(s->ix);
        res->index_step_max_cpu_us = (int64_t)index_max_split_cpu_us(s->ix);
        res->index_steps = index_splits(s->ix);
        res->index_step_p999_cpu_us = index_split_cpu_quantile_us(s->ix, 999);
        res->index_step_unready = index_cold_blocks(s->ix);
    }
    if (rc != 0)
        print_case_error(r, name, "engine");
    else
        print_result(r, res);
    store_close(r, name, s);
out_free:
    free(t);
    free(res);
}

/* ---- Peers ---- */

#ifdef IDEM_HAVE_PEERS
static void peer_value(uint64_t k, uint8_t v[PEER_VALUE_BYTES])
{
    /* What a claim record holds: state, expiry, token. */
    uint64_t fields[3] = {1, TTL_MS, k + 1};
    memcpy(v, fields, sizeof(fields));
}

/* Inserts one batch in one durable write transaction; returns the inserts or -1. */
static int lmdb_batch(MDB_env *env, MDB_dbi dbi, uint64_t first, uint32_t n, uint64_t *errors)
{
    MDB_txn *txn;
    uint8_t key[BENCH_KEY_BYTES], val[PEER_VALUE_BYTES];
    int rc = mdb_txn_begin(env, NULL, 0, &txn);
    if (rc != 0) {
        fprintf(stderr, "bench: lmdb: mdb_txn_begin: %s\n", mdb_strerror(rc));
        return -1;
    }
    for (uint32_t j = 0; j < n; j++) {
        bench_key(first + j, key);
        peer_value(first + j, val);
        MDB_val mk = {sizeof(key), key}, mv = {sizeof(val), val};
        rc = mdb_put(txn, dbi, &mk, &mv, MDB_NOOVERWRITE);
        if (rc == MDB_KEYEXIST) {
            (*errors)++;
        } else if (rc != 0) {
            fprintf(stderr, "bench: lmdb: mdb_put: %s\n", mdb_strerror(rc));
            mdb_txn_abort(txn);
            return -1;
        }
    }
    rc = mdb_txn_commit(txn);
    if (rc != 0) {
        fprintf(stderr, "bench: lmdb: mdb_txn_commit: %s\n", mdb_strerror(rc));
        return -1;
    }
    return (int)n;
}

static int lmdb_open(const char *path, uint64_t keys, MDB_env **env, MDB_dbi *dbi)
{
    MDB_txn *txn;
    int rc = mdb_env_create(env);
    if (rc != 0) return rc;
    rc = mdb_env_set_mapsize(*env, (size_t)(keys * 256 + (256ull << 20)));
    if (rc == 0) rc = mdb_env_open(*env, path, 0, 0644);
    if (rc == 0) rc = mdb_txn_begin(*env, NULL, 0, &txn);
    if (rc != 0) {
        mdb_env_close(*env);
        return rc;
    }
    rc = mdb_dbi_open(txn, NULL, 0, dbi);
    if (rc == 0)
        rc = mdb_txn_commit(txn);
    else
        mdb_txn_abort(txn);
    if (rc != 0) mdb_env_close(*env);
    return rc;
}

static void case_lmdb(struct run *r)
{
    char path[PATH_MAX];
    MDB_env *env;
    MDB_dbi dbi;
    struct result *res = calloc(1, sizeof(*res));
    if (!res || case_path(r, "lmdb", path, sizeof(path)) != 0 || mkdir(path, 0755) != 0) {
        print_case_error(r, "lmdb", "open");
        free(res);
        return;
    }
    int rc = lmdb_open(path, r->keys, &env, &dbi);
    if (rc != 0) {
        fprintf(stderr, "bench: lmdb: open: %s\n", mdb_strerror(rc));
        print_case_error(r, "lmdb", "open");
        goto out_rm;
    }
    res->name = "lmdb";
    res->mem_bytes_per_key = -1;
    res->index_step_max_us = -1;
    uint64_t start = bench_now_ns(), deadline = start + (uint64_t)(r->peer_s * 1e9), now = start;
    while (res->ops < r->keys && now < deadline) {
        uint64_t left = r->keys - res->ops;
        uint32_t n = left < r->peer_batch ? (uint32_t)left : r->peer_batch;
        int done = lmdb_batch(env, dbi, res->ops, n, &res->errors);
        uint64_t t1 = bench_now_ns();
        if (done < 0) break;
        bench_hist_add(&res->h, t1 - now);
        res->ops += (uint64_t)done;
        res->flushes++;
        now = t1;
    }
    res->flush_records = res->ops;
    res->seconds = (double)(now - start) / 1e9;
    res->capped = res->ops < r->keys;
    print_result(r, res);
    if (res->errors == 0 && res->ops > 0) r->lmdb_ops = (double)res->ops / res->seconds;
    mdb_env_close(env);
out_rm:
    bench_rm_rf(path);
    free(res);
}

static int sqlite_exec(sqlite3 *db, const char *sql)
{
    char *msg = NULL;
    int rc = sqlite3_exec(db, sql, NULL, NULL, &msg);
    if (rc != SQLITE_OK) {
        fprintf(stderr, "bench: sqlite: %s: %s\n", sql, msg ? msg : sqlite3_errstr(rc));
        sqlite3_free(msg);
    }
    return rc;
}

static int sqlite_open(const char *path, sqlite3 **db, sqlite3_stmt **ins)
{
    static const char *const setup[] = {
        "PRAGMA journal_mode=WAL",
        "PRAGMA synchronous=FULL",
        "PRAGMA cache_size=-262144",
        "CREATE TABLE keys(k BLOB PRIMARY KEY, v BLOB NOT NULL) WITHOUT ROWID",
    };
    if (sqlite3_open(path, db) != SQLITE_OK) {
        fprintf(stderr, "bench: sqlite: open: %s\n", sqlite3_errmsg(*db));
        sqlite3_close(*db);
        return -1;
    }
    for (size_t i = 0; i < sizeof(setup) / sizeof(setup[0]); i++)
        if (sqlite_exec(*db, setup[i]) != SQLITE_OK) goto out_close;
    if (sqlite3_prepare_v2(*db, "INSERT OR IGNORE INTO keys(k, v) VALUES(?, ?)", -1, ins, NULL) ==
        SQLITE_OK)
        return 0;
    fprintf(stderr, "bench: sqlite: prepare: %s\n", sqlite3_errmsg(*db));
out_close:
    sqlite3_close(*db);
    return -1;
}

/* Inserts one batch in one transaction; returns the inserts or -1. */
static int sqlite_batch(sqlite3 *db, sqlite3_stmt *ins, uint64_t first, uint32_t n,
                        uint64_t *errors)
{
    uint8_t key[BENCH_KEY_BYTES], val[PEER_VALUE_BYTES];
    if (sqlite_exec(db, "BEGIN") != SQLITE_OK) return -1;
    for (uint32_t j = 0; j < n; j++) {
        bench_key(first + j, key);
        peer_value(first + j, val);
        sqlite3_bind_blob(ins, 1, key, sizeof(key), SQLITE_STATIC);
        sqlite3_bind_blob(ins, 2, val, sizeof(val), SQLITE_STATIC);
        int rc = sqlite3_step(ins);
        sqlite3_reset(ins);
        if (rc != SQLITE_DONE) {
            fprintf(stderr, "bench: sqlite: insert: %s\n", sqlite3_errstr(rc));
            sqlite_exec(db, "ROLLBACK");
            return -1;
        }
        if (sqlite3_changes(db) != 1) (*errors)++;
    }
    if (sqlite_exec(db, "COMMIT") != SQLITE_OK) return -1;
    return (int)n;
}

static void case_sqlite(struct run *r)
{
    char dir[PATH_MAX], path[PATH_MAX + 16];
    sqlite3 *db;
    sqlite3_stmt *ins;
    struct result *res = calloc(1, sizeof(*res));
    if (!res || case_path(r, "sqlite", dir, sizeof(dir)) != 0 || mkdir(dir, 0755) != 0) {
        print_case_error(r, "sqlite", "open");
        free(res);
        return;
    }
    snprintf(path, sizeof(path), "%s/keys.db", dir);
    if (sqlite_open(path, &db, &ins) != 0) {
        print_case_error(r, "sqlite", "open");
        goto out_rm;
    }
    res->name = "sqlite";
    res->mem_bytes_per_key = -1;
    res->index_step_max_us = -1;
    uint64_t start = bench_now_ns(), deadline = start + (uint64_t)(r->peer_s * 1e9), now = start;
    while (res->ops < r->keys && now < deadline) {
        uint64_t left = r->keys - res->ops;
        uint32_t n = left < r->peer_batch ? (uint32_t)left : r->peer_batch;
        int done = sqlite_batch(db, ins, res->ops, n, &res->errors);
        uint64_t t1 = bench_now_ns();
        if (done < 0) break;
        bench_hist_add(&res->h, t1 - now);
        res->ops += (uint64_t)done;
        res->flushes++;
        now = t1;
    }
    res->flush_records = res->ops;
    res->seconds = (double)(now - start) / 1e9;
    res->capped = res->ops < r->keys;
    print_result(r, res);
    if (res->errors == 0 && res->ops > 0) r->sqlite_ops = (double)res->ops / res->seconds;
    sqlite3_finalize(ins);
    sqlite3_close(db);
out_rm:
    bench_rm_rf(dir);
    free(res);
}
#endif /* IDEM_HAVE_PEERS */

static void print_ratios(const struct run *r)
{
    if (r->new_sync_ops <= 0 || (r->lmdb_ops <= 0 && r->sqlite_ops <= 0)) return;
    printf("ratio claim-new-sync/lmdb=");
    if (r->lmdb_ops > 0)
        printf("%.1f", r->new_sync_ops / r->lmdb_ops);
    else
        printf("-");
    printf(" claim-new-sync/sqlite=");
    if (r->sqlite_ops > 0)
        printf("%.1f", r->new_sync_ops / r->sqlite_ops);
    else
        printf("-");
    printf("\n");
}

static void run_cases(struct run *r)
{
    uint64_t large = r->keys < LARGE_PAIRS_MAX ? r->keys : LARGE_PAIRS_MAX;
    if (case_selected(r, "claim-new-sync"))
        case_batch(r, "claim-new-sync", K_NEW, IDEM_DURABILITY_SYNC, 0, r->keys, 0);
    if (case_selected(r, "claim-new-dur-batch"))
        case_batch(r, "claim-new-dur-batch", K_NEW, IDEM_DURABILITY_BATCH, 0, r->keys, 0);
    if (case_selected(r, "claim-new-dur-none"))
        case_batch(r, "claim-new-dur-none", K_NEW, IDEM_DURABILITY_NONE, 0, r->keys, 0);
    if (case_selected(r, "claim-commit-32"))
        case_batch(r, "claim-commit-32", K_CLAIM_COMMIT, IDEM_DURABILITY_SYNC, RESULT_SMALL_BYTES,
                   r->keys, 0);
    if (case_selected(r, "claim-commit-4k"))
        case_batch(r, "claim-commit-4k", K_CLAIM_COMMIT, IDEM_DURABILITY_SYNC, RESULT_LARGE_BYTES,
                   large, 0);
    if (case_selected(r, "claim-commit-parked"))
        case_batch(r, "claim-commit-parked", K_CLAIM_COMMIT, IDEM_DURABILITY_SYNC,
                   RESULT_SMALL_BYTES, r->keys, PARKED_CLAIMS);
    if (case_selected(r, "dup-uniform") || case_selected(r, "dup-recent")) case_dup(r);
    if (case_selected(r, "growth")) {
        case_blocking(r, "growth", 1, IDEM_DURABILITY_NONE, r->case_s);
        host_probe();
    }
    if (case_selected(r, "blocking-1"))
        case_blocking(r, "blocking-1", 1, IDEM_DURABILITY_SYNC, r->blocking1_s);
    if (case_selected(r, "blocking-64"))
        case_blocking(r, "blocking-64", THREADS_MAX, IDEM_DURABILITY_SYNC, r->case_s);
#ifdef IDEM_HAVE_PEERS
    if (case_selected(r, "lmdb")) case_lmdb(r);
    if (case_selected(r, "sqlite")) case_sqlite(r);
#else
    if (case_selected(r, "lmdb") || case_selected(r, "sqlite"))
        printf("# peers skipped: built without LMDB and SQLite (IDEM_HAVE_PEERS)\n");
#endif
    print_ratios(r);
}

static void usage(FILE *f)
{
    fprintf(f, "usage: idem-bench-engine [--quick] [--keys N] [--dir DIR] [--case NAME]\n"
               "                         [--batch N] [--slots N] [--peer-batch N]\n"
               "                         [--dup-threads N]\n"
               "cases:");
    for (size_t i = 0; i < sizeof(case_names) / sizeof(case_names[0]); i++)
        fprintf(f, " %s", case_names[i]);
    fprintf(f, "\n");
}

static int known_case(const char *name)
{
    for (size_t i = 0; i < sizeof(case_names) / sizeof(case_names[0]); i++)
        if (strcmp(case_names[i], name) == 0) return 1;
    return 0;
}

/* Parses a decimal in [min, max]; returns 0 or -1. */
static int parse_u64(const char *text, uint64_t min, uint64_t max, uint64_t *out)
{
    char *end;
    errno = 0;
    unsigned long long v = strtoull(text, &end, 10);
    if (errno || end == text || *end || v < min || v > max) return -1;
    *out = v;
    return 0;
}

/* Parses the command line into r; returns 0, or 2 for a usage error, -1 for --help. */
static int parse_args(struct run *r, int argc, char **argv)
{
    static const struct option longopts[] = {
        {"quick", no_argument, NULL, 'q'},
        {"keys", required_argument, NULL, 'k'},
        {"dir", required_argument, NULL, 'd'},
        {"case", required_argument, NULL, 'c'},
        {"batch", required_argument, NULL, 'B'},
        {"slots", required_argument, NULL, 'S'},
        {"peer-batch", required_argument, NULL, 'P'},
        {"dup-threads", required_argument, NULL, 'T'},
        {"help", no_argument, NULL, 'h'},
        {NULL, 0, NULL, 0},
    };
    long cpus = sysconf(_SC_NPROCESSORS_ONLN);
    uint64_t keys = 0, batch = BATCH_OPS, slots = BATCH_SLOTS, peer_batch = 0;
    uint64_t dup_threads = cpus < 1 ? 1 : cpus > 8 ? 8 : (uint64_t)cpus;
    int opt, bad = 0;
    while (!bad && (opt = getopt_long(argc, argv, "", longopts, NULL)) != -1) {
        if (opt == 'q')
            r->quick = 1;
        else if (opt == 'k')
            bad = parse_u64(optarg, 1, 1ull << 40, &keys);
        else if (opt == 'B')
            bad = parse_u64(optarg, 1, IDEM_BATCH_MAX, &batch);
        else if (opt == 'S')
            bad = parse_u64(optarg, 1, BATCH_SLOTS, &slots);
        else if (opt == 'P')
            bad = parse_u64(optarg, 1, 1u << 20, &peer_batch);
        else if (opt == 'T')
            bad = parse_u64(optarg, 1, 8, &dup_threads);
        else if (opt == 'd')
            bad = snprintf(r->dir, sizeof(r->dir), "%s", optarg) >= (int)sizeof(r->dir);
        else if (opt == 'c' && known_case(optarg))
            r->only = optarg;
        else if (opt == 'h')
            return -1;
        else
            bad = 1;
    }
    if (bad || optind != argc) return 2;
    r->keys = keys ? keys : r->quick ? (1ull << 20) : 10ull * (1ull << 20);
    r->batch = (uint32_t)batch;
    r->slots = (uint32_t)slots;
    r->peer_batch = peer_batch ? (uint32_t)peer_batch : r->batch * r->slots;
    r->dup_threads = (uint32_t)dup_threads;
    r->case_s = r->quick ? 2.5 : 60.0;
    r->blocking1_s = r->quick ? 2.0 : 10.0;
    r->peer_s = r->quick ? 10.0 : 120.0;
    return 0;
}

static int prepare_dir(struct run *r)
{
    if (r->dir[0] == '\0') {
        snprintf(r->dir, sizeof(r->dir), "/tmp/idem-bench-XXXXXX");
        if (mkdtemp(r->dir) == NULL) {
            fprintf(stderr, "bench: mkdtemp: %s\n", strerror(errno));
            return -1;
        }
        r->own_dir = 1;
    } else if (mkdir(r->dir, 0755) != 0 && errno != EEXIST) {
        fprintf(stderr, "bench: mkdir %s: %s\n", r->dir, strerror(errno));
        return -1;
    }
    return 0;
}

int main(int argc, char **argv)
{
    static struct run r;
    huge_pages_reexec(argv); /* as idemd does: the index on huge pages, for idem and the peers */
    int rc = parse_args(&r, argc, argv);
    if (rc != 0) {
        usage(rc < 0 ? stdout : stderr);
        return rc < 0 ? 0 : 2;
    }
    if (prepare_dir(&r) != 0) return 1;
    uint64_t rng = BENCH_SEED;
    for (size_t i = 0; i < sizeof(r.result_src); i++)
        r.result_src[i] = (uint8_t)bench_rng(&rng);
    printf("# idem %s keys=%" PRIu64 " mode=%s batch=%u slots=%u peer_batch=%u case_cap_s=%.1f "
           "peer_cap_s=%.1f malloc_hugetlb=%d\n",
           IDEM_VERSION_STRING, r.keys, r.quick ? "quick" : "full", r.batch, r.slots, r.peer_batch,
           r.case_s, r.peer_s, huge_pages_tunable());
    fflush(stdout);
    run_cases(&r);
    if (r.own_dir) bench_rm_rf(r.dir);
    return r.failures ? 1 : 0;
}
