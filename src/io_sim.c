/*
 * io_sim.c: the simulated disk of io_sim.h.
 * Model: a node is a file's data: cur (the page cache view: every reaped write) and dur (what
 * survives a crash), plus its unsynced changes (writes, truncates, extensions) in order, each
 * tagged with a disk-wide sequence number. Two namespaces map paths to nodes: cur_ns (what
 * open/rename/unlink see) and dur_ns (what survives); dir_ops lists, in order, the creates,
 * renames and unlinks not yet covered by a sync_dir of their directory.
 * A failed flush loses the changes it covered, as Linux after a failed writeback keeps the pages
 * cached, marked clean, and never writes them: they stay in cur until a crash or a drop_cache
 * rebuilds cur from dur and the changes still pending.
 * Invariants: dur + every change applied in order == cur, but for what failed flushes lost
 * (until a crash or drop_cache rebuilds cur);
 * a node's refs count its cur_ns and dur_ns entries, dir ops, open files and maps, and it is
 * freed at 0; used == the sum of cur.len over live nodes; a handle or file whose epoch is
 * older than the disk's is stale (every call -EIO, close and unmap still free); queued requests
 * are counted in their file's inflight until reaped or dropped by a crash; all state is
 * guarded by mu.
 */
#include "io_sim.h"
#include "util.h"

#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define SIM_SECTOR       512u
#define SIM_DIRECT_ALIGN 4096u
#define SIM_QUEUE_MAX    4096u
#define SIM_PATH_MAX     4096u

enum sim_change_kind { SIM_CH_WRITE, SIM_CH_TRUNCATE, SIM_CH_EXTEND };
enum sim_dir_kind { SIM_DIR_CREATE, SIM_DIR_RENAME, SIM_DIR_UNLINK };
enum sim_req_kind { SIM_REQ_WRITE, SIM_REQ_FLUSH };

struct sim_buf {
    uint8_t *p;
    uint64_t len;
    uint64_t cap;
};

/* An unsynced change: a write of data[0, len) at off, a truncate to off, or an extension to at
 * least off + len. */
struct sim_change {
    uint64_t seq;
    enum sim_change_kind kind;
    uint64_t off;
    uint64_t len;
    uint8_t *data;
};

struct sim_node {
    struct sim_node *prev, *next; /* all live nodes, in creation order */
    uint64_t refs;
    struct sim_buf cur;
    struct sim_buf dur;
    struct sim_change *changes;
    size_t changes_count, changes_cap;
    uint64_t kept; /* space reserved up to here (io reserve): growth below it needs no room */
};

struct sim_entry {
    char *path;
    struct sim_node *node;
};

struct sim_ns {
    struct sim_entry *v;
    size_t count, cap;
};

struct sim_dir_op {
    enum sim_dir_kind kind;
    char *dir;  /* directory the op belongs to (of path; of to for a rename) */
    char *path; /* created or unlinked path; rename destination */
    char *from; /* rename source */
    struct sim_node *node;
};

struct sim_map {
    uint8_t *p;
    size_t len;
    struct sim_node *node;
};

struct sim_req {
    enum sim_req_kind kind;
    struct io_file *f;
    uint64_t off;
    const void *buf;
    size_t len;
    unsigned flags;
    uint64_t user_data;
    uint64_t covers_seq; /* changes with seq <= this are covered by a flush */
};

struct sim_io {
    struct io base;
    struct io_sim *sim;
    struct sim_io *prev, *next; /* the disk's handles */
    uint64_t epoch;
    uint64_t head, tail; /* queue ring positions */
    struct sim_req queue[SIM_QUEUE_MAX];
};

struct io_file {
    struct sim_node *node;
    uint64_t epoch;
    unsigned flags;
    uint64_t inflight;
    int fail_flush_err; /* io_sim_fail_flush_of: its next flush's (0: none) */
};

struct io_sim {
    pthread_mutex_t mu;
    pthread_cond_t held_cond; /* io_sim_hold: completions wait while held */
    int held;
    int unlinks_held;    /* io_sim_hold_unlinks: unlinks wait while held (on held_cond) */
    int writes_now_held; /* io_sim_hold_writes_now: writes_now wait while held (held_cond) */
    int writes_now_err;  /* io_sim_fail_writes_now: every write_now fails with it (0: none) */
    int data_after_held; /* io_sim_hold_data_after: answers wait while held (held_cond) */
    int copy_on_write;   /* io_sim_copy_on_write: overwrites_in_place answers 0 */
    uint64_t rng;
    uint64_t epoch;
    uint64_t seq;
    uint64_t capacity;
    uint64_t used;
    struct sim_node *nodes_head, *nodes_tail;
    struct sim_io *handles;
    struct sim_ns cur_ns, dur_ns;
    struct sim_dir_op *dir_ops;
    size_t dir_ops_count, dir_ops_cap;
    char **dirs;
    size_t dirs_count, dirs_cap;
    struct sim_map *maps;
    size_t maps_count, maps_cap;
    struct io_sim_counts counts;
    uint64_t fail_write_at, fail_flush_at, short_write_at, fail_submit_at; /* 0: none */
    int fail_write_err, fail_flush_err, fail_submit_err;
    int fail_sync_dir_err;       /* the next sync_dir's (0: none) */
    char fail_create_suffix[64]; /* "": none */
    int fail_create_err;
    char fail_open_suffix[64];  /* "": none */
    char fail_flush_suffix[64]; /* io_sim_fail_flush_of ("": none) */
    int fail_flush_of_err;
    int fail_open_err;
    int fail_allocate_err;                 /* 0: none */
    const struct sim_node *fail_read_node; /* io_sim_fail_reads: NULL none; compared only */
    int fail_read_err;
};

/* ---- small helpers ---- */

static uint64_t sim_rand(struct io_sim *sim)
{
    uint64_t z = (sim->rng += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

/* Grows an array of elem_size elements to hold at least need; 0 or -ENOMEM. */
static int sim_reserve(void **v, size_t *cap, size_t need, size_t elem_size)
{
    if (need <= *cap) return 0;
    size_t ncap = *cap ? *cap * 2 : 8;
    if (ncap < need) ncap = need;
    void *p = realloc(*v, ncap * elem_size);
    if (!p) return -ENOMEM;
    *v = p;
    *cap = ncap;
    return 0;
}

/* Sets b's length, zero-filling bytes that become visible. */
static int sim_buf_resize(struct sim_buf *b, uint64_t len)
{
    if (len > SIZE_MAX / 2) return -EFBIG;
    if (len > b->cap) {
        uint64_t ncap = b->cap * 2 > len ? b->cap * 2 : len;
        uint8_t *p = realloc(b->p, (size_t)ncap);
        if (!p) return -ENOMEM;
        b->p = p;
        b->cap = ncap;
    }
    if (len > b->len) memset(b->p + b->len, 0, (size_t)(len - b->len));
    b->len = len;
    return 0;
}

static int sim_buf_write(struct sim_buf *b, uint64_t off, const void *data, uint64_t len)
{
    if (len == 0) return 0;
    if (off + len > b->len) {
        int rc = sim_buf_resize(b, off + len);
        if (rc < 0) return rc;
    }
    memcpy(b->p + off, data, (size_t)len);
    return 0;
}

/* The directory of a path (before its last '/'), or of a sync_dir argument; malloc'd. */
static char *sim_dir_of(const char *path, int is_dir)
{
    size_t n = strlen(path);
    if (is_dir) {
        while (n > 0 && path[n - 1] == '/')
            n--;
    } else {
        while (n > 0 && path[n - 1] != '/')
            n--;
        if (n > 0) n--;
    }
    return strndup(path, n);
}

static void sim_lock(const struct io_sim *sim)
{
    int rc = pthread_mutex_lock((pthread_mutex_t *)&sim->mu);
    IDEM_ASSERT(rc == 0);
}

static void sim_unlock(const struct io_sim *sim)
{
    int rc = pthread_mutex_unlock((pthread_mutex_t *)&sim->mu);
    IDEM_ASSERT(rc == 0);
}

/* ---- nodes ---- */

static struct sim_node *sim_node_new(struct io_sim *sim)
{
    struct sim_node *n = calloc(1, sizeof *n);
    if (!n) return NULL;
    n->prev = sim->nodes_tail;
    if (sim->nodes_tail)
        sim->nodes_tail->next = n;
    else
        sim->nodes_head = n;
    sim->nodes_tail = n;
    return n;
}

static void sim_changes_clear(struct sim_node *n)
{
    for (size_t i = 0; i < n->changes_count; i++)
        free(n->changes[i].data);
    n->changes_count = 0;
}

static void sim_node_unref(struct io_sim *sim, struct sim_node *n)
{
    IDEM_ASSERT(n->refs > 0);
    if (--n->refs > 0) return;
    IDEM_ASSERT(sim->used >= n->cur.len);
    sim->used -= n->cur.len;
    if (n->prev)
        n->prev->next = n->next;
    else
        sim->nodes_head = n->next;
    if (n->next)
        n->next->prev = n->prev;
    else
        sim->nodes_tail = n->prev;
    sim_changes_clear(n);
    free(n->changes);
    free(n->cur.p);
    free(n->dur.p);
    free(n);
}

/* Copies cur[off, off+len) into every map of n (zeros past the end of the file). */
static void sim_maps_refresh(struct io_sim *sim, struct sim_node *n, uint64_t off, uint64_t len)
{
    for (size_t i = 0; i < sim->maps_count; i++) {
        struct sim_map *m = &sim->maps[i];
        if (m->node != n || off >= m->len) continue;
        uint64_t end = off + len < m->len ? off + len : m->len;
        uint64_t data_end = end < n->cur.len ? end : n->cur.len;
        if (data_end > off) memcpy(m->p + off, n->cur.p + off, (size_t)(data_end - off));
        uint64_t zero_from = data_end > off ? data_end : off;
        if (end > zero_from) memset(m->p + zero_from, 0, (size_t)(end - zero_from));
    }
}

/* Sets n's current length (capacity checked when growing); the change is logged by callers. */
static int sim_cur_resize(struct io_sim *sim, struct sim_node *n, uint64_t len)
{
    uint64_t old = n->cur.len, from = old > n->kept ? old : n->kept;
    if (len > from && sim->capacity && sim->used + (len - from) > sim->capacity) return -ENOSPC;
    int rc = sim_buf_resize(&n->cur, len);
    if (rc < 0) return rc;
    sim->used = sim->used - old + len;
    return 0;
}

static int sim_change_add(struct sim_node *n, const struct sim_change *c)
{
    int rc = sim_reserve((void **)&n->changes, &n->changes_cap, n->changes_count + 1,
                         sizeof *n->changes);
    if (rc < 0) return rc;
    n->changes[n->changes_count++] = *c;
    return 0;
}

/* Applies the first keep bytes of change c to b. */
static int sim_change_apply(struct sim_buf *b, const struct sim_change *c, uint64_t keep)
{
    switch (c->kind) {
    case SIM_CH_WRITE:
        return keep ? sim_buf_write(b, c->off, c->data, keep) : 0;
    case SIM_CH_TRUNCATE:
        return sim_buf_resize(b, c->off);
    case SIM_CH_EXTEND:
        return c->off + c->len > b->len ? sim_buf_resize(b, c->off + c->len) : 0;
    }
    return -EINVAL;
}

/* ---- namespaces ---- */

static struct sim_entry *sim_ns_find(struct sim_ns *ns, const char *path)
{
    for (size_t i = 0; i < ns->count; i++)
        if (strcmp(ns->v[i].path, path) == 0) return &ns->v[i];
    return NULL;
}

static int sim_ns_set(struct io_sim *sim, struct sim_ns *ns, const char *path, struct sim_node *n)
{
    struct sim_entry *e = sim_ns_find(ns, path);
    if (e) {
        n->refs++;
        sim_node_unref(sim, e->node);
        e->node = n;
        return 0;
    }
    int rc = sim_reserve((void **)&ns->v, &ns->cap, ns->count + 1, sizeof *ns->v);
    if (rc < 0) return rc;
    char *p = strdup(path);
    if (!p) return -ENOMEM;
    ns->v[ns->count].path = p;
    ns->v[ns->count].node = n;
    ns->count++;
    n->refs++;
    return 0;
}

static void sim_ns_remove(struct io_sim *sim, struct sim_ns *ns, struct sim_entry *e)
{
    IDEM_ASSERT(e >= ns->v && e < ns->v + ns->count);
    struct sim_node *n = e->node;
    free(e->path);
    *e = ns->v[--ns->count];
    sim_node_unref(sim, n);
}

static void sim_ns_clear(struct io_sim *sim, struct sim_ns *ns)
{
    while (ns->count > 0)
        sim_ns_remove(sim, ns, &ns->v[ns->count - 1]);
}

/* ---- directory operations ---- */

static int sim_dir_op_add(struct io_sim *sim, enum sim_dir_kind kind, const char *path,
                          const char *from, struct sim_node *n)
{
    int rc = sim_reserve((void **)&sim->dir_ops, &sim->dir_ops_cap, sim->dir_ops_count + 1,
                         sizeof *sim->dir_ops);
    if (rc < 0) return rc;
    struct sim_dir_op op = {.kind = kind, .node = n};
    op.dir = sim_dir_of(path, 0);
    op.path = strdup(path);
    op.from = from ? strdup(from) : NULL;
    if (!op.dir || !op.path || (from && !op.from)) {
        free(op.dir);
        free(op.path);
        free(op.from);
        return -ENOMEM;
    }
    n->refs++;
    sim->dir_ops[sim->dir_ops_count++] = op;
    return 0;
}

/* Makes op durable: applies it to dur_ns. */
static int sim_dir_op_apply(struct io_sim *sim, const struct sim_dir_op *op)
{
    struct sim_entry *e;
    switch (op->kind) {
    case SIM_DIR_CREATE:
        return sim_ns_set(sim, &sim->dur_ns, op->path, op->node);
    case SIM_DIR_RENAME:
        e = sim_ns_find(&sim->dur_ns, op->from);
        if (e && e->node == op->node) sim_ns_remove(sim, &sim->dur_ns, e);
        return sim_ns_set(sim, &sim->dur_ns, op->path, op->node);
    case SIM_DIR_UNLINK:
        e = sim_ns_find(&sim->dur_ns, op->path);
        if (e && e->node == op->node) sim_ns_remove(sim, &sim->dur_ns, e);
        return 0;
    }
    return -EINVAL;
}

static void sim_dir_op_free(struct io_sim *sim, struct sim_dir_op *op)
{
    free(op->dir);
    free(op->path);
    free(op->from);
    sim_node_unref(sim, op->node);
}

/* ---- flush ---- */

static int sim_changes_overlap(const struct sim_change *a, const struct sim_change *b)
{
    if (a->kind != SIM_CH_WRITE || b->kind != SIM_CH_WRITE) return 1;
    /* Writes sharing a page reach the disk together, as from a page cache. */
    uint64_t a_first = a->off / SIM_DIRECT_ALIGN, a_last = (a->off + a->len - 1) / SIM_DIRECT_ALIGN;
    uint64_t b_first = b->off / SIM_DIRECT_ALIGN, b_last = (b->off + b->len - 1) / SIM_DIRECT_ALIGN;
    return a_first <= b_last && b_first <= a_last;
}

/* Makes durable n's changes with seq <= covers_seq or == linked_seq, and the older changes
 * overlapping those (lose: drops them instead, never to be durable); the others stay pending,
 * in order. */
static int sim_flush_node(struct sim_node *n, uint64_t covers_seq, uint64_t linked_seq, int lose)
{
    size_t count = n->changes_count;
    if (count == 0) return 0;
    uint8_t *covered = calloc(count, 1);
    if (!covered) return -ENOMEM;
    for (size_t i = 0; i < count; i++) {
        uint64_t seq = n->changes[i].seq;
        covered[i] = seq <= covers_seq || (linked_seq != 0 && seq == linked_seq);
    }
    /* From the newest down, so coverage spreads through chains of overlaps. */
    for (size_t i = count; i-- > 0;) {
        for (size_t j = 0; j < i && covered[i]; j++)
            if (!covered[j] && sim_changes_overlap(&n->changes[j], &n->changes[i])) covered[j] = 1;
    }
    int rc = 0;
    size_t kept = 0;
    for (size_t i = 0; i < count; i++) {
        struct sim_change *c = &n->changes[i];
        if (covered[i] && rc == 0 && !lose) rc = sim_change_apply(&n->dur, c, c->len);
        if (covered[i] && rc == 0) {
            free(c->data);
            continue;
        }
        n->changes[kept++] = *c;
    }
    n->changes_count = kept;
    free(covered);
    return rc;
}

/* ---- performing queued requests (in io_wait) ---- */

static int sim_direct_misaligned(const struct sim_req *r)
{
    return r->off % SIM_DIRECT_ALIGN != 0 || r->len % SIM_DIRECT_ALIGN != 0 ||
           (uintptr_t)r->buf % SIM_DIRECT_ALIGN != 0;
}

/* Applies a write to the current content and logs it as unsynced; returns bytes or -errno. */
static int64_t sim_write_apply(struct io_sim *sim, struct sim_node *n, uint64_t off,
                               const void *buf, uint64_t len, uint64_t *seq_out)
{
    uint8_t *data = malloc((size_t)len);
    if (!data) return -ENOMEM;
    memcpy(data, buf, (size_t)len);
    int rc = sim_reserve((void **)&n->changes, &n->changes_cap, n->changes_count + 1,
                         sizeof *n->changes);
    if (rc == 0 && off + len > n->cur.len) rc = sim_cur_resize(sim, n, off + len);
    if (rc < 0) {
        free(data);
        return rc;
    }
    memcpy(n->cur.p + off, data, (size_t)len);
    struct sim_change c = {
        .seq = ++sim->seq, .kind = SIM_CH_WRITE, .off = off, .len = len, .data = data};
    rc = sim_change_add(n, &c);
    IDEM_ASSERT(rc == 0); /* reserved above */
    sim_maps_refresh(sim, n, off, len);
    sim->counts.bytes_written += len;
    *seq_out = c.seq;
    return (int64_t)len;
}

static int64_t sim_perform_write(struct io_sim *sim, const struct sim_req *r, uint64_t *seq_out)
{
    const struct io_file *f = r->f;
    uint64_t nth = ++sim->counts.writes;
    *seq_out = 0;
    if (nth == sim->fail_write_at) {
        sim->fail_write_at = 0;
        return sim->fail_write_err;
    }
    if (f->flags & IO_O_RDONLY) return -EBADF;
    if ((f->flags & IO_O_DIRECT) && sim_direct_misaligned(r)) return -EINVAL;
    uint64_t len = r->len;
    if (nth == sim->short_write_at) {
        sim->short_write_at = 0;
        if (len >= 2) len /= 2;
    }
    if (len == 0) return 0;
    return sim_write_apply(sim, f->node, r->off, r->buf, len, seq_out);
}

static int64_t sim_perform_flush(struct io_sim *sim, struct io_file *f, uint64_t covers_seq,
                                 uint64_t linked_seq)
{
    uint64_t nth = ++sim->counts.flushes;
    int err = 0;
    if (nth == sim->fail_flush_at) {
        sim->fail_flush_at = 0;
        err = sim->fail_flush_err;
    } else if (f->fail_flush_err) {
        err = f->fail_flush_err;
        f->fail_flush_err = 0;
    }
    if (err) {
        int rc = sim_flush_node(f->node, covers_seq, linked_seq, 1);
        return rc < 0 ? rc : err;
    }
    return sim_flush_node(f->node, covers_seq, linked_seq, 0);
}

static int64_t sim_perform(struct io_sim *sim, const struct sim_req *r)
{
    if (r->kind == SIM_REQ_FLUSH) return sim_perform_flush(sim, r->f, r->covers_seq, 0);
    uint64_t seq;
    int64_t res = sim_perform_write(sim, r, &seq);
    if (res < 0 || !(r->flags & IO_W_FLUSH)) return res;
    /* The linked flush covers what was reaped before the submit, and this write. */
    int64_t fres = sim_perform_flush(sim, r->f, r->covers_seq, seq);
    return fres < 0 ? fres : res;
}

/* ---- crash ---- */

/* Decides how much of an unsynced change survives: returns 0 (lost) or 1 with *keep bytes. */
static int sim_crash_keep(struct io_sim *sim, const struct sim_change *c, unsigned flags,
                          uint64_t *keep)
{
    *keep = c->len;
    if (flags & IO_SIM_CRASH_LOSE_ALL) return 0;
    uint64_t r = sim_rand(sim) % ((flags & IO_SIM_CRASH_TEAR) && c->kind == SIM_CH_WRITE ? 3 : 2);
    if (r < 2) return (int)r;
    uint64_t first = c->off / SIM_SECTOR, last = (c->off + c->len - 1) / SIM_SECTOR;
    uint64_t sectors = last - first + 1;
    if (sectors < 2) return 0;
    uint64_t k = 1 + sim_rand(sim) % (sectors - 1);
    *keep = (first + k) * SIM_SECTOR - c->off;
    IDEM_ASSERT(*keep > 0 && *keep < c->len);
    return 1;
}

static void sim_crash_node(struct io_sim *sim, struct sim_node *n, unsigned flags)
{
    for (size_t i = 0; i < n->changes_count; i++) {
        struct sim_change *c = &n->changes[i];
        uint64_t keep;
        if (!sim_crash_keep(sim, c, flags, &keep)) continue;
        if (c->kind == SIM_CH_WRITE && (flags & IO_SIM_CRASH_FLIP) && sim_rand(sim) % 2) {
            uint64_t bit = sim_rand(sim) % (keep * 8);
            c->data[bit / 8] ^= (uint8_t)(1u << (bit % 8));
        }
        int rc = sim_change_apply(&n->dur, c, keep);
        IDEM_ASSERT(rc == 0); /* out of memory in the simulator */
    }
    sim_changes_clear(n);
    sim->used = sim->used - n->cur.len;
    n->cur.len = 0;
    int rc = sim_buf_write(&n->cur, 0, n->dur.p, n->dur.len);
    IDEM_ASSERT(rc == 0);
    sim->used += n->cur.len;
}

static int sim_str_in(char *const *v, size_t count, const char *s)
{
    for (size_t i = 0; i < count; i++)
        if (strcmp(v[i], s) == 0) return 1;
    return 0;
}

/* Keeps a random in-order prefix of each directory's unsynced ops; rebuilds cur_ns. */
static void sim_crash_dirs(struct io_sim *sim, unsigned flags)
{
    char **broken = calloc(sim->dir_ops_count + 1, sizeof *broken);
    IDEM_ASSERT(broken != NULL);
    size_t broken_count = 0;
    for (size_t i = 0; i < sim->dir_ops_count; i++) {
        struct sim_dir_op *op = &sim->dir_ops[i];
        int is_broken = sim_str_in(broken, broken_count, op->dir);
        int keep = !(flags & IO_SIM_CRASH_UNDO_DIR) && !is_broken && sim_rand(sim) % 2;
        if (keep) {
            int rc = sim_dir_op_apply(sim, op);
            IDEM_ASSERT(rc == 0);
        } else if (!is_broken) {
            broken[broken_count++] = op->dir;
        }
    }
    free(broken);
    for (size_t i = 0; i < sim->dir_ops_count; i++)
        sim_dir_op_free(sim, &sim->dir_ops[i]);
    sim->dir_ops_count = 0;
    sim_ns_clear(sim, &sim->cur_ns);
    for (size_t i = 0; i < sim->dur_ns.count; i++) {
        int rc = sim_ns_set(sim, &sim->cur_ns, sim->dur_ns.v[i].path, sim->dur_ns.v[i].node);
        IDEM_ASSERT(rc == 0);
    }
}

void io_sim_crash(struct io_sim *sim, unsigned flags)
{
    sim_lock(sim);
    for (struct sim_io *h = sim->handles; h; h = h->next) {
        for (uint64_t i = h->head; i != h->tail; i++)
            h->queue[i % SIM_QUEUE_MAX].f->inflight--;
        h->head = h->tail;
    }
    for (struct sim_node *n = sim->nodes_head; n; n = n->next)
        sim_crash_node(sim, n, flags);
    sim_crash_dirs(sim, flags);
    for (size_t i = 0; i < sim->maps_count; i++)
        sim_maps_refresh(sim, sim->maps[i].node, 0, sim->maps[i].len);
    sim->epoch++;
    sim_unlock(sim);
}

/* ---- the io_ops of a handle ---- */

static struct sim_io *sim_io_of(struct io *io)
{
    return (struct sim_io *)io;
}

/* 1 when the handle (or file) predates the last crash. */
static int sim_stale(const struct sim_io *h, const struct io_file *f)
{
    return h->epoch != h->sim->epoch || (f && f->epoch != h->sim->epoch);
}

static int sim_open_new(struct io_sim *sim, const char *path, struct sim_node **out)
{
    struct sim_node *n = sim_node_new(sim);
    if (!n) return -ENOMEM;
    n->refs = 1; /* the file's */
    int rc = sim_ns_set(sim, &sim->cur_ns, path, n);
    if (rc == 0) {
        rc = sim_dir_op_add(sim, SIM_DIR_CREATE, path, NULL, n);
        if (rc < 0) sim_ns_remove(sim, &sim->cur_ns, sim_ns_find(&sim->cur_ns, path));
    }
    if (rc < 0) {
        sim_node_unref(sim, n);
        return rc;
    }
    *out = n;
    return 0;
}

/* Whether path ends with an armed suffix (then disarmed: it fails once). */
static int sim_suffix_fires(char *suffix, const char *path)
{
    size_t n = strlen(suffix), len = strlen(path);
    if (!n || len < n || strcmp(path + len - n, suffix) != 0) return 0;
    suffix[0] = 0;
    return 1;
}

static int sim_open(struct io *io, const char *path, unsigned flags, struct io_file **out)
{
    struct sim_io *h = sim_io_of(io);
    struct io_sim *sim = h->sim;
    if (!path || !*path || strlen(path) >= SIM_PATH_MAX || !out ||
        (flags & ~(IO_O_CREATE | IO_O_EXCL | IO_O_RDONLY | IO_O_DIRECT | IO_O_DSYNC)))
        return -EINVAL;
    struct io_file *f = calloc(1, sizeof *f);
    if (!f) return -ENOMEM;
    int rc = 0;
    sim_lock(sim);
    struct sim_entry *e = sim_ns_find(&sim->cur_ns, path);
    if (sim_stale(h, NULL))
        rc = -EIO;
    else if (sim_suffix_fires(sim->fail_open_suffix, path))
        rc = sim->fail_open_err;
    else if (e && (flags & IO_O_CREATE) && (flags & IO_O_EXCL))
        rc = -EEXIST;
    else if (!e && sim_str_in(sim->dirs, sim->dirs_count, path))
        rc = -EISDIR;
    else if (!e && !(flags & IO_O_CREATE))
        rc = -ENOENT;
    else if (!e && sim_suffix_fires(sim->fail_create_suffix, path))
        rc = sim->fail_create_err;
    else if (!e)
        rc = sim_open_new(sim, path, &f->node);
    if (rc == 0 && e) {
        f->node = e->node;
        f->node->refs++;
    }
    if (rc == 0 && sim_suffix_fires(sim->fail_flush_suffix, path))
        f->fail_flush_err = sim->fail_flush_of_err;
    f->epoch = sim->epoch;
    sim_unlock(sim);
    if (rc < 0) {
        free(f);
        return rc;
    }
    f->flags = flags;
    *out = f;
    return 0;
}

static void sim_close(struct io *io, struct io_file *f)
{
    struct sim_io *h = sim_io_of(io);
    if (!f) return;
    sim_lock(h->sim);
    IDEM_ASSERT(f->inflight == 0); /* closing a file with requests queued */
    sim_node_unref(h->sim, f->node);
    sim_unlock(h->sim);
    free(f);
}

static int sim_size(struct io *io, struct io_file *f, uint64_t *out)
{
    struct sim_io *h = sim_io_of(io);
    int rc = 0;
    sim_lock(h->sim);
    if (sim_stale(h, f))
        rc = -EIO;
    else
        *out = f->node->cur.len;
    sim_unlock(h->sim);
    return rc;
}

/* Sets the length (truncate) or extends it to at least len (allocate), logged as unsynced. */
static int sim_resize_logged(struct io_sim *sim, struct sim_node *n, enum sim_change_kind kind,
                             uint64_t len)
{
    uint64_t old = n->cur.len;
    if (kind == SIM_CH_EXTEND && len <= old) return 0;
    int rc = sim_reserve((void **)&n->changes, &n->changes_cap, n->changes_count + 1,
                         sizeof *n->changes);
    if (rc == 0) rc = sim_cur_resize(sim, n, len);
    if (rc < 0) return rc;
    struct sim_change c = {.seq = ++sim->seq, .kind = kind, .off = len, .len = 0};
    rc = sim_change_add(n, &c);
    IDEM_ASSERT(rc == 0);
    uint64_t lo = old < len ? old : len, hi = old < len ? len : old;
    sim_maps_refresh(sim, n, lo, hi - lo);
    return 0;
}

static int sim_allocate(struct io *io, struct io_file *f, uint64_t off, uint64_t len)
{
    struct sim_io *h = sim_io_of(io);
    if (off > INT64_MAX || len == 0 || len > INT64_MAX - off) return -EINVAL;
    sim_lock(h->sim);
    int rc = sim_stale(h, f) ? -EIO : (f->flags & IO_O_RDONLY) ? -EBADF : h->sim->fail_allocate_err;
    if (rc == 0) rc = sim_resize_logged(h->sim, f->node, SIM_CH_EXTEND, off + len);
    sim_unlock(h->sim);
    return rc;
}

/* A reservation is checked against the capacity when it is made, and the file may then grow
 * into it whatever the capacity says (the space it holds is not counted in `used`). */
static int sim_reserve_space(struct io *io, struct io_file *f, uint64_t off, uint64_t len)
{
    struct sim_io *h = sim_io_of(io);
    struct io_sim *sim = h->sim;
    if (off > INT64_MAX || len == 0 || len > INT64_MAX - off) return -EINVAL;
    sim_lock(sim);
    struct sim_node *n = f->node;
    int rc = sim_stale(h, f) ? -EIO : (f->flags & IO_O_RDONLY) ? -EBADF : 0;
    uint64_t from = n->cur.len > n->kept ? n->cur.len : n->kept;
    if (rc == 0 && off + len > from && sim->capacity &&
        sim->used + (off + len - from) > sim->capacity)
        rc = -ENOSPC;
    if (rc == 0 && off + len > n->kept) n->kept = off + len;
    sim_unlock(sim);
    return rc;
}

static int sim_truncate(struct io *io, struct io_file *f, uint64_t len)
{
    struct sim_io *h = sim_io_of(io);
    if (len > INT64_MAX) return -EINVAL;
    sim_lock(h->sim);
    int rc = sim_stale(h, f) ? -EIO : (f->flags & IO_O_RDONLY) ? -EINVAL : 0;
    if (rc == 0) rc = sim_resize_logged(h->sim, f->node, SIM_CH_TRUNCATE, len);
    sim_unlock(h->sim);
    return rc;
}

static int64_t sim_read(struct io *io, struct io_file *f, uint64_t off, void *buf, size_t len)
{
    struct sim_io *h = sim_io_of(io);
    int64_t res = 0;
    sim_lock(h->sim);
    const struct sim_buf *b = &f->node->cur;
    if (sim_stale(h, f)) {
        res = -EIO;
    } else if (f->node == h->sim->fail_read_node) {
        res = h->sim->fail_read_err;
    } else if (off < b->len) {
        uint64_t n = b->len - off < len ? b->len - off : len;
        memcpy(buf, b->p + off, (size_t)n);
        res = (int64_t)n;
    }
    sim_unlock(h->sim);
    return res;
}

/* Not counted among the ring's writes (io_sim_fail_write numbers those). With IO_O_DSYNC the
 * write is made durable at once, with the older changes it overlaps (sim_flush_node). */
static int64_t sim_write_now(struct io *io, struct io_file *f, uint64_t off, const void *buf,
                             size_t len)
{
    struct sim_io *h = sim_io_of(io);
    struct io_sim *sim = h->sim;
    if (off > INT64_MAX || len > INT64_MAX - off) return -EINVAL;
    sim_lock(sim);
    sim->counts.writes_now_waiting++;
    while (sim->writes_now_held)
        pthread_cond_wait(&sim->held_cond, &sim->mu);
    sim->counts.writes_now_waiting--;
    int64_t res = sim_stale(h, f) ? -EIO : (f->flags & IO_O_RDONLY) ? -EBADF : sim->writes_now_err;
    uint64_t seq = 0;
    if (res == 0 && len) res = sim_write_apply(sim, f->node, off, buf, len, &seq);
    if (res > 0 && (f->flags & IO_O_DSYNC)) {
        int rc = sim_flush_node(f->node, 0, seq, 0);
        if (rc < 0) res = rc;
    }
    if (res >= 0) sim->counts.writes_now++;
    sim_unlock(sim);
    return res;
}

static int sim_block_zero(const struct sim_buf *b, uint64_t off)
{
    static const uint8_t zeros[SIM_DIRECT_ALIGN];
    uint64_t n = b->len - off < SIM_DIRECT_ALIGN ? b->len - off : SIM_DIRECT_ALIGN;
    return memcmp(b->p + off, zeros, (size_t)n) == 0;
}

/* The simulated disk keeps no allocation apart from writes: it reports its 4 KiB blocks of zeros
 * as holes. They read the same either way, and callers only need to know where data may be. */
static int sim_data_after(struct io *io, struct io_file *f, uint64_t off, uint64_t *data,
                          uint64_t *hole)
{
    struct sim_io *h = sim_io_of(io);
    sim_lock(h->sim);
    if (sim_stale(h, f)) {
        sim_unlock(h->sim);
        return -EIO;
    }
    const struct sim_buf *b = &f->node->cur;
    uint64_t d = off - off % SIM_DIRECT_ALIGN;
    while (d < b->len && sim_block_zero(b, d))
        d += SIM_DIRECT_ALIGN;
    uint64_t e = d;
    while (e < b->len && !sim_block_zero(b, e))
        e += SIM_DIRECT_ALIGN;
    *data = d >= b->len ? UINT64_MAX : d > off ? d : off;
    *hole = e < b->len ? e : b->len;
    h->sim->counts.data_after_waiting++;
    while (h->sim->data_after_held)
        pthread_cond_wait(&h->sim->held_cond, &h->sim->mu);
    h->sim->counts.data_after_waiting--;
    sim_unlock(h->sim);
    return 0;
}

/* Writes over written blocks stay in place unless io_sim_copy_on_write said otherwise. */
static int sim_overwrites_in_place(struct io *io, struct io_file *f)
{
    (void)f;
    struct io_sim *sim = sim_io_of(io)->sim;
    sim_lock(sim);
    int cow = sim->copy_on_write;
    sim_unlock(sim);
    return !cow;
}

static int sim_map(struct io *io, struct io_file *f, size_t len, const void **out)
{
    struct sim_io *h = sim_io_of(io);
    struct io_sim *sim = h->sim;
    if (len == 0 || len > SIZE_MAX - SIM_DIRECT_ALIGN || !out) return -EINVAL;
    uint8_t *p = aligned_alloc(SIM_DIRECT_ALIGN, IDEM_ALIGN_UP(len, SIM_DIRECT_ALIGN));
    if (!p) return -ENOMEM;
    sim_lock(sim);
    int rc = sim_stale(h, f) ? -EIO : 0;
    if (rc == 0)
        rc = sim_reserve((void **)&sim->maps, &sim->maps_cap, sim->maps_count + 1,
                         sizeof *sim->maps);
    if (rc == 0) {
        sim->maps[sim->maps_count++] = (struct sim_map){.p = p, .len = len, .node = f->node};
        f->node->refs++;
        sim_maps_refresh(sim, f->node, 0, len);
    }
    sim_unlock(sim);
    if (rc < 0) {
        free(p);
        return rc;
    }
    *out = p;
    return 0;
}

static void sim_unmap(struct io *io, struct io_file *f, const void *p, size_t len)
{
    struct io_sim *sim = sim_io_of(io)->sim;
    (void)f;
    if (!p) return;
    sim_lock(sim);
    size_t i = 0;
    while (i < sim->maps_count && sim->maps[i].p != p)
        i++;
    IDEM_ASSERT(i < sim->maps_count); /* unmap of a pointer not mapped */
    IDEM_ASSERT(sim->maps[i].len == len);
    struct sim_node *n = sim->maps[i].node;
    free(sim->maps[i].p);
    sim->maps[i] = sim->maps[--sim->maps_count];
    sim_node_unref(sim, n);
    sim_unlock(sim);
}

static int sim_unlink(struct io *io, const char *path)
{
    struct sim_io *h = sim_io_of(io);
    struct io_sim *sim = h->sim;
    sim_lock(sim);
    while (sim->unlinks_held)
        pthread_cond_wait(&sim->held_cond, &sim->mu);
    struct sim_entry *e = sim_ns_find(&sim->cur_ns, path);
    int rc = sim_stale(h, NULL) ? -EIO : !e ? -ENOENT : 0;
    if (rc == 0) rc = sim_dir_op_add(sim, SIM_DIR_UNLINK, path, NULL, e->node);
    if (rc == 0) sim_ns_remove(sim, &sim->cur_ns, e);
    sim_unlock(sim);
    return rc;
}

static int sim_rename(struct io *io, const char *from, const char *to)
{
    struct sim_io *h = sim_io_of(io);
    struct io_sim *sim = h->sim;
    if (!to || !*to || strlen(to) >= SIM_PATH_MAX) return -EINVAL;
    sim_lock(sim);
    struct sim_entry *e = sim_ns_find(&sim->cur_ns, from);
    int rc = sim_stale(h, NULL) ? -EIO : !e ? -ENOENT : 0;
    if (rc == 0 && strcmp(from, to) != 0) {
        struct sim_node *n = e->node;
        rc = sim_dir_op_add(sim, SIM_DIR_RENAME, to, from, n);
        if (rc == 0) rc = sim_ns_set(sim, &sim->cur_ns, to, n);
        /* Looked up again: sim_ns_set may have moved the entries. */
        if (rc == 0) sim_ns_remove(sim, &sim->cur_ns, sim_ns_find(&sim->cur_ns, from));
    }
    sim_unlock(sim);
    return rc;
}

static int sim_list(struct io *io, const char *dir, int (*fn)(const char *name, void *ctx),
                    void *ctx)
{
    struct sim_io *h = sim_io_of(io);
    struct io_sim *sim = h->sim;
    size_t len = strlen(dir);
    sim_lock(sim);
    int rc = sim_stale(h, NULL) ? -EIO : 0;
    for (size_t i = 0; rc == 0 && i < sim->cur_ns.count; i++) {
        const char *p = sim->cur_ns.v[i].path;
        if (strncmp(p, dir, len) == 0 && p[len] == '/' && p[len + 1] && !strchr(p + len + 1, '/') &&
            fn(p + len + 1, ctx))
            break;
    }
    sim_unlock(sim);
    return rc;
}

static int sim_sync_dir(struct io *io, const char *dir)
{
    struct sim_io *h = sim_io_of(io);
    struct io_sim *sim = h->sim;
    char *d = sim_dir_of(dir, 1);
    if (!d) return -ENOMEM;
    sim_lock(sim);
    int rc = sim_stale(h, NULL) ? -EIO : sim->fail_sync_dir_err;
    sim->fail_sync_dir_err = 0;
    if (rc == 0) {
        size_t kept = 0;
        for (size_t i = 0; i < sim->dir_ops_count; i++) {
            struct sim_dir_op *op = &sim->dir_ops[i];
            if (rc == 0 && strcmp(op->dir, d) == 0) rc = sim_dir_op_apply(sim, op);
            if (rc == 0 && strcmp(op->dir, d) == 0) {
                sim_dir_op_free(sim, op);
                continue;
            }
            sim->dir_ops[kept++] = *op;
        }
        sim->dir_ops_count = kept;
        sim->counts.dir_syncs++;
    }
    sim_unlock(sim);
    free(d);
    return rc;
}

/* Rebuilds cur from dur and the changes still pending (the dirty pages stay): what failed
 * flushes lost disappears from reads and maps. */
static int sim_drop_cache(struct io *io, struct io_file *f)
{
    struct sim_io *h = sim_io_of(io);
    struct io_sim *sim = h->sim;
    sim_lock(sim);
    int rc = sim_stale(h, f) ? -EIO : 0;
    struct sim_buf b = {0};
    if (rc == 0) rc = sim_buf_write(&b, 0, f->node->dur.p, f->node->dur.len);
    for (size_t i = 0; rc == 0 && i < f->node->changes_count; i++)
        rc = sim_change_apply(&b, &f->node->changes[i], f->node->changes[i].len);
    if (rc == 0) {
        struct sim_node *n = f->node;
        sim->used = sim->used - n->cur.len + b.len;
        uint64_t old_len = n->cur.len;
        free(n->cur.p);
        n->cur = b;
        sim_maps_refresh(sim, n, 0, old_len > b.len ? old_len : b.len);
    } else {
        free(b.p);
    }
    sim_unlock(sim);
    return rc;
}

static int sim_mkdir(struct io *io, const char *path)
{
    struct sim_io *h = sim_io_of(io);
    struct io_sim *sim = h->sim;
    char *d = sim_dir_of(path, 1);
    if (!d) return -ENOMEM;
    sim_lock(sim);
    int rc = sim_stale(h, NULL) ? -EIO : 0;
    if (rc == 0 && (sim_str_in(sim->dirs, sim->dirs_count, d) || sim_ns_find(&sim->cur_ns, d)))
        rc = -EEXIST;
    if (rc == 0)
        rc = sim_reserve((void **)&sim->dirs, &sim->dirs_cap, sim->dirs_count + 1,
                         sizeof *sim->dirs);
    if (rc == 0) {
        sim->dirs[sim->dirs_count++] = d;
        d = NULL;
    }
    sim_unlock(sim);
    free(d);
    return rc;
}

static int sim_submit(struct sim_io *h, struct sim_req *req)
{
    struct io_sim *sim = h->sim;
    sim_lock(sim);
    int rc = sim_stale(h, req->f) ? -EIO : 0;
    IDEM_ASSERT(h->tail - h->head <= SIM_QUEUE_MAX);
    if (rc == 0 && h->tail - h->head == SIM_QUEUE_MAX) rc = -EAGAIN;
    if (rc == 0 && req->kind == SIM_REQ_WRITE && ++sim->counts.submits == sim->fail_submit_at) {
        sim->fail_submit_at = 0;
        rc = sim->fail_submit_err;
    }
    if (rc == 0) {
        req->covers_seq = sim->seq;
        h->queue[h->tail++ % SIM_QUEUE_MAX] = *req;
        req->f->inflight++;
    }
    sim_unlock(sim);
    return rc;
}

static int sim_submit_write(struct io *io, struct io_file *f, uint64_t off, const void *buf,
                            size_t len, unsigned flags, uint64_t user_data)
{
    if ((flags & ~IO_W_FLUSH) || off > INT64_MAX || len > INT64_MAX - off || (!buf && len > 0))
        return -EINVAL;
    struct sim_req req = {.kind = SIM_REQ_WRITE,
                          .f = f,
                          .off = off,
                          .buf = buf,
                          .len = len,
                          .flags = flags,
                          .user_data = user_data};
    return sim_submit(sim_io_of(io), &req);
}

static int sim_submit_flush(struct io *io, struct io_file *f, uint64_t user_data)
{
    struct sim_req req = {.kind = SIM_REQ_FLUSH, .f = f, .user_data = user_data};
    return sim_submit(sim_io_of(io), &req);
}

static int sim_wait(struct io *io, struct io_completion *out, int max, int min)
{
    struct sim_io *h = sim_io_of(io);
    struct io_sim *sim = h->sim;
    sim_lock(sim);
    /* io_sim_hold: a disk that has not answered yet (min 0 is a poll and returns at once). */
    while (sim->held && min > 0)
        pthread_cond_wait(&sim->held_cond, &sim->mu);
    uint64_t queued = h->tail - h->head;
    int n = 0;
    if (sim_stale(h, NULL))
        n = -EIO;
    else if (max < 0 || min < 0 || min > max || (uint64_t)min > queued || (max > 0 && !out))
        n = -EINVAL;
    /* Bounded by max and by the queue. */
    while (n >= 0 && n < max && h->head != h->tail) {
        struct sim_req *r = &h->queue[h->head++ % SIM_QUEUE_MAX];
        out[n].user_data = r->user_data;
        out[n].res = sim_perform(sim, r);
        r->f->inflight--;
        n++;
    }
    sim_unlock(sim);
    return n;
}

static void sim_io_destroy(struct io *io)
{
    struct sim_io *h = sim_io_of(io);
    struct io_sim *sim = h->sim;
    sim_lock(sim);
    if (!sim_stale(h, NULL))
        for (uint64_t i = h->head; i != h->tail; i++)
            sim->counts.abandoned += h->queue[i % SIM_QUEUE_MAX].kind == SIM_REQ_WRITE;
    for (uint64_t i = h->head; i != h->tail; i++)
        h->queue[i % SIM_QUEUE_MAX].f->inflight--;
    if (h->prev)
        h->prev->next = h->next;
    else
        sim->handles = h->next;
    if (h->next) h->next->prev = h->prev;
    sim_unlock(sim);
    free(h);
}

static const struct io_ops sim_ops = {
    .name = "sim",
    .open = sim_open,
    .close = sim_close,
    .size = sim_size,
    .allocate = sim_allocate,
    .reserve = sim_reserve_space,
    .truncate = sim_truncate,
    .read = sim_read,
    .write_now = sim_write_now,
    .data_after = sim_data_after,
    .overwrites_in_place = sim_overwrites_in_place,
    .map = sim_map,
    .unmap = sim_unmap,
    .unlink = sim_unlink,
    .rename = sim_rename,
    .sync_dir = sim_sync_dir,
    .list = sim_list,
    .mkdir = sim_mkdir,
    .drop_cache = sim_drop_cache,
    .submit_write = sim_submit_write,
    .submit_flush = sim_submit_flush,
    .wait = sim_wait,
    .destroy = sim_io_destroy,
};

/* ---- the test-facing API ---- */

int io_sim_create(uint64_t seed, struct io_sim **out)
{
    if (!out) return -EINVAL;
    struct io_sim *sim = calloc(1, sizeof *sim);
    if (!sim) return -ENOMEM;
    int rc = pthread_mutex_init(&sim->mu, NULL);
    if (rc != 0) {
        free(sim);
        return -rc;
    }
    pthread_cond_init(&sim->held_cond, NULL);
    sim->rng = seed;
    *out = sim;
    return 0;
}

void io_sim_destroy(struct io_sim *sim)
{
    if (!sim) return;
    IDEM_ASSERT(sim->handles == NULL); /* io_destroy every handle first */
    for (size_t i = 0; i < sim->dir_ops_count; i++)
        sim_dir_op_free(sim, &sim->dir_ops[i]);
    sim_ns_clear(sim, &sim->cur_ns);
    sim_ns_clear(sim, &sim->dur_ns);
    for (size_t i = 0; i < sim->maps_count; i++)
        free(sim->maps[i].p);
    /* Nodes still held by unclosed files or maps. */
    while (sim->nodes_head) {
        sim->nodes_head->refs = 1;
        sim_node_unref(sim, sim->nodes_head);
    }
    for (size_t i = 0; i < sim->dirs_count; i++)
        free(sim->dirs[i]);
    free(sim->dirs);
    free(sim->maps);
    free(sim->dir_ops);
    free(sim->cur_ns.v);
    free(sim->dur_ns.v);
    pthread_cond_destroy(&sim->held_cond);
    pthread_mutex_destroy(&sim->mu);
    free(sim);
}

void io_sim_hold(struct io_sim *sim, int hold)
{
    sim_lock(sim);
    sim->held = hold;
    if (!hold) pthread_cond_broadcast(&sim->held_cond);
    sim_unlock(sim);
}

void io_sim_hold_unlinks(struct io_sim *sim, int hold)
{
    sim_lock(sim);
    sim->unlinks_held = hold;
    if (!hold) pthread_cond_broadcast(&sim->held_cond);
    sim_unlock(sim);
}

void io_sim_hold_writes_now(struct io_sim *sim, int hold)
{
    sim_lock(sim);
    sim->writes_now_held = hold;
    if (!hold) pthread_cond_broadcast(&sim->held_cond);
    sim_unlock(sim);
}

void io_sim_copy_on_write(struct io_sim *sim, int on)
{
    sim_lock(sim);
    sim->copy_on_write = on;
    sim_unlock(sim);
}

void io_sim_hold_data_after(struct io_sim *sim, int hold)
{
    sim_lock(sim);
    sim->data_after_held = hold;
    if (!hold) pthread_cond_broadcast(&sim->held_cond);
    sim_unlock(sim);
}

void io_sim_fail_writes_now(struct io_sim *sim, int err)
{
    sim_lock(sim);
    sim->writes_now_err = err;
    sim_unlock(sim);
}

struct io *io_sim_io(struct io_sim *sim)
{
    struct sim_io *h = calloc(1, sizeof *h);
    if (!h) return NULL;
    h->base.ops = &sim_ops;
    h->sim = sim;
    sim_lock(sim);
    h->epoch = sim->epoch;
    h->next = sim->handles;
    if (sim->handles) sim->handles->prev = h;
    sim->handles = h;
    sim_unlock(sim);
    return &h->base;
}

void io_sim_fail_write(struct io_sim *sim, uint64_t nth, int err)
{
    sim_lock(sim);
    sim->fail_write_at = nth ? sim->counts.writes + nth : 0;
    sim->fail_write_err = err;
    sim_unlock(sim);
}

void io_sim_fail_submit(struct io_sim *sim, uint64_t nth, int err)
{
    sim_lock(sim);
    sim->fail_submit_at = nth ? sim->counts.submits + nth : 0;
    sim->fail_submit_err = err;
    sim_unlock(sim);
}

void io_sim_fail_allocate(struct io_sim *sim, int err)
{
    IDEM_ASSERT(err <= 0);
    sim_lock(sim);
    sim->fail_allocate_err = err;
    sim_unlock(sim);
}

int io_sim_fail_reads(struct io_sim *sim, const char *path, int err)
{
    IDEM_ASSERT(!path || err < 0);
    sim_lock(sim);
    struct sim_entry *e = path ? sim_ns_find(&sim->cur_ns, path) : NULL;
    sim->fail_read_node = e ? e->node : NULL;
    sim->fail_read_err = err;
    sim_unlock(sim);
    return path && !e ? -ENOENT : 0;
}

void io_sim_fail_create(struct io_sim *sim, const char *suffix, int err)
{
    IDEM_ASSERT(err < 0 && (!suffix || strlen(suffix) < sizeof sim->fail_create_suffix));
    sim_lock(sim);
    snprintf(sim->fail_create_suffix, sizeof sim->fail_create_suffix, "%s", suffix ? suffix : "");
    sim->fail_create_err = err;
    sim_unlock(sim);
}

void io_sim_fail_open(struct io_sim *sim, const char *suffix, int err)
{
    IDEM_ASSERT(err < 0 && (!suffix || strlen(suffix) < sizeof sim->fail_open_suffix));
    sim_lock(sim);
    snprintf(sim->fail_open_suffix, sizeof sim->fail_open_suffix, "%s", suffix ? suffix : "");
    sim->fail_open_err = err;
    sim_unlock(sim);
}

void io_sim_fail_sync_dir(struct io_sim *sim, int err)
{
    sim_lock(sim);
    sim->fail_sync_dir_err = err;
    sim_unlock(sim);
}

void io_sim_fail_flush(struct io_sim *sim, uint64_t nth, int err)
{
    sim_lock(sim);
    sim->fail_flush_at = nth ? sim->counts.flushes + nth : 0;
    sim->fail_flush_err = err;
    sim_unlock(sim);
}

void io_sim_fail_flush_of(struct io_sim *sim, const char *suffix, int err)
{
    IDEM_ASSERT(err < 0 && (!suffix || strlen(suffix) < sizeof sim->fail_flush_suffix));
    sim_lock(sim);
    snprintf(sim->fail_flush_suffix, sizeof sim->fail_flush_suffix, "%s", suffix ? suffix : "");
    sim->fail_flush_of_err = err;
    sim_unlock(sim);
}

void io_sim_short_write(struct io_sim *sim, uint64_t nth)
{
    sim_lock(sim);
    sim->short_write_at = nth ? sim->counts.writes + nth : 0;
    sim_unlock(sim);
}

void io_sim_set_capacity(struct io_sim *sim, uint64_t bytes)
{
    sim_lock(sim);
    sim->capacity = bytes;
    sim_unlock(sim);
}

void io_sim_counts(const struct io_sim *sim, struct io_sim_counts *out)
{
    sim_lock(sim);
    *out = sim->counts;
    out->used = sim->used;
    sim_unlock(sim);
}

int io_sim_corrupt(struct io_sim *sim, const char *path, uint64_t off, uint8_t xor_mask)
{
    sim_lock(sim);
    struct sim_entry *e = sim_ns_find(&sim->cur_ns, path);
    int rc = !e ? -ENOENT : off >= e->node->cur.len ? -EINVAL : 0;
    if (rc == 0) {
        struct sim_node *n = e->node;
        n->cur.p[off] ^= xor_mask;
        if (off < n->dur.len) n->dur.p[off] ^= xor_mask;
        sim_maps_refresh(sim, n, off, 1);
    }
    sim_unlock(sim);
    return rc;
}

/* Copies min(len, file size) bytes of the current content; returns that count or -ENOENT. */
int64_t io_sim_read_file(struct io_sim *sim, const char *path, void *buf, size_t len)
{
    sim_lock(sim);
    struct sim_entry *e = sim_ns_find(&sim->cur_ns, path);
    int64_t res = -ENOENT;
    if (e) {
        uint64_t n = e->node->cur.len < len ? e->node->cur.len : len;
        if (n > 0) memcpy(buf, e->node->cur.p, (size_t)n);
        res = (int64_t)n;
    }
    sim_unlock(sim);
    return res;
}
