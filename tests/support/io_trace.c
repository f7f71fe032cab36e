/*
 * io_trace.c: the recording backend of io_trace.h.
 * Invariants: events are appended in seq order (seq == index + 1) under mu; every request
 * submitted through a handle and not yet reaped holds one entry of that handle's request table
 * (inner user_data = its index), which maps the completion back to the caller's user_data and
 * to the submit event; the namespace (path -> node) reflects every create, rename and unlink
 * that succeeded through any handle of the trace.
 */
#include "io_trace.h"

#include <errno.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "testutil.h"
#include "util.h"

struct trace_name {
    char *path;
    uint32_t node;
};

struct io_trace {
    pthread_mutex_t mu;
    struct io_trace_event *ev;
    size_t count, cap;
    struct trace_name *names;
    size_t nnames, names_cap;
    uint32_t nodes; /* nodes created so far */
    uint64_t buffer_changes;
};

/* A request submitted and not yet reaped. */
struct trace_req {
    int used;
    uint64_t user_data;
    uint64_t submit_seq;
    const void *buf; /* write: the caller's buffer, compared with the copy at reap */
    size_t len;
    uint32_t node;
};

struct trace_io {
    struct io base;
    struct io_trace *t;
    struct io *inner;
    struct trace_req *reqs;
    size_t nreqs, reqs_cap;
};

struct io_file {
    struct io_file *inner;
    uint32_t node;
};

static struct trace_io *trace_io_of(struct io *io)
{
    return (struct trace_io *)io;
}

static void trace_lock(struct io_trace *t)
{
    int rc = pthread_mutex_lock(&t->mu);
    IDEM_ASSERT(rc == 0);
}

static void trace_unlock(struct io_trace *t)
{
    int rc = pthread_mutex_unlock(&t->mu);
    IDEM_ASSERT(rc == 0);
}

/* Appends an event (mu held); strings and data are copied. Aborts on ENOMEM: a trace with a
 * hole would make every later crash state wrong. */
static struct io_trace_event *trace_add(struct io_trace *t, const struct io_trace_event *e)
{
    t->ev = tu_grow(t->ev, &t->cap, t->count + 1, sizeof *t->ev);
    struct io_trace_event *d = &t->ev[t->count++];
    *d = *e;
    d->seq = t->count;
    d->path = e->path ? strdup(e->path) : NULL;
    d->from = e->from ? strdup(e->from) : NULL;
    IDEM_ASSERT(!e->path || d->path);
    IDEM_ASSERT(!e->from || d->from);
    if (e->data) {
        uint8_t *p = malloc(e->len ? e->len : 1);
        IDEM_ASSERT(p != NULL);
        memcpy(p, e->data, e->len);
        d->data = p;
    }
    return d;
}

static struct trace_name *name_find(struct io_trace *t, const char *path)
{
    for (size_t i = 0; i < t->nnames; i++)
        if (strcmp(t->names[i].path, path) == 0) return &t->names[i];
    return NULL;
}

static void name_remove(struct io_trace *t, struct trace_name *n)
{
    free(n->path);
    *n = t->names[--t->nnames];
}

static void name_set(struct io_trace *t, const char *path, uint32_t node)
{
    struct trace_name *n = name_find(t, path);
    if (n) {
        n->node = node;
        return;
    }
    t->names = tu_grow(t->names, &t->names_cap, t->nnames + 1, sizeof *t->names);
    t->names[t->nnames].path = strdup(path);
    IDEM_ASSERT(t->names[t->nnames].path != NULL);
    t->names[t->nnames++].node = node;
}

/* ---- file-system calls ---- */

static int trace_open(struct io *io, const char *path, unsigned flags, struct io_file **out)
{
    struct trace_io *h = trace_io_of(io);
    struct io_trace *t = h->t;
    struct io_file *f = calloc(1, sizeof *f);
    if (!f) return -ENOMEM;
    trace_lock(t);
    int rc = h->inner->ops->open(h->inner, path, flags, &f->inner);
    if (rc == 0) {
        struct trace_name *n = name_find(t, path);
        if (n) {
            f->node = n->node;
        } else {
            /* Not made through the trace: only a create may bring a new name. */
            IDEM_ASSERT(flags & IO_O_CREATE);
            f->node = ++t->nodes;
            name_set(t, path, f->node);
            struct io_trace_event e = {.kind = IO_TRACE_CREATE, .node = f->node, .path = path};
            trace_add(t, &e);
        }
    }
    trace_unlock(t);
    if (rc < 0) {
        free(f);
        return rc;
    }
    *out = f;
    return 0;
}

static void trace_close(struct io *io, struct io_file *f)
{
    struct trace_io *h = trace_io_of(io);
    if (!f) return;
    h->inner->ops->close(h->inner, f->inner);
    free(f);
}

static int trace_size(struct io *io, struct io_file *f, uint64_t *out)
{
    struct trace_io *h = trace_io_of(io);
    return h->inner->ops->size(h->inner, f->inner, out);
}

static int trace_resize(struct io *io, struct io_file *f, enum io_trace_kind kind, uint64_t off,
                        uint64_t len)
{
    struct trace_io *h = trace_io_of(io);
    trace_lock(h->t);
    int rc = kind == IO_TRACE_TRUNCATE ? h->inner->ops->truncate(h->inner, f->inner, off)
                                       : h->inner->ops->allocate(h->inner, f->inner, off, len);
    struct io_trace_event e = {.kind = kind, .node = f->node, .off = off, .len = len, .res = rc};
    trace_add(h->t, &e);
    trace_unlock(h->t);
    return rc;
}

static int trace_allocate(struct io *io, struct io_file *f, uint64_t off, uint64_t len)
{
    return trace_resize(io, f, IO_TRACE_ALLOCATE, off, len);
}

static int trace_truncate(struct io *io, struct io_file *f, uint64_t len)
{
    return trace_resize(io, f, IO_TRACE_TRUNCATE, len, 0);
}

static int64_t trace_read(struct io *io, struct io_file *f, uint64_t off, void *buf, size_t len)
{
    struct trace_io *h = trace_io_of(io);
    return h->inner->ops->read(h->inner, f->inner, off, buf, len);
}

/* Not recorded: the only caller is the filler, which writes zeros where data_after reports a
 * hole (space that reads as zeros already) and never where the log has written (its fence), so
 * a crash state without these writes has the same content as one with them. */
static int64_t trace_write_now(struct io *io, struct io_file *f, uint64_t off, const void *buf,
                               size_t len)
{
    struct trace_io *h = trace_io_of(io);
    return h->inner->ops->write_now(h->inner, f->inner, off, buf, len);
}

static int trace_data_after(struct io *io, struct io_file *f, uint64_t off, uint64_t *data,
                            uint64_t *hole)
{
    struct trace_io *h = trace_io_of(io);
    return h->inner->ops->data_after(h->inner, f->inner, off, data, hole);
}

static int trace_overwrites_in_place(struct io *io, struct io_file *f)
{
    struct trace_io *h = trace_io_of(io);
    return h->inner->ops->overwrites_in_place(h->inner, f->inner);
}

/* Not recorded: the file's size and content stay as they are. */
static int trace_reserve(struct io *io, struct io_file *f, uint64_t off, uint64_t len)
{
    struct trace_io *h = trace_io_of(io);
    return h->inner->ops->reserve(h->inner, f->inner, off, len);
}

/* Not recorded: it changes what reads see, never what a crash leaves. */
static int trace_drop_cache(struct io *io, struct io_file *f)
{
    struct trace_io *h = trace_io_of(io);
    return h->inner->ops->drop_cache(h->inner, f->inner);
}

static int trace_map(struct io *io, struct io_file *f, size_t len, const void **out)
{
    struct trace_io *h = trace_io_of(io);
    return h->inner->ops->map(h->inner, f->inner, len, out);
}

static void trace_unmap(struct io *io, struct io_file *f, const void *p, size_t len)
{
    struct trace_io *h = trace_io_of(io);
    h->inner->ops->unmap(h->inner, f->inner, p, len);
}

static int trace_unlink(struct io *io, const char *path)
{
    struct trace_io *h = trace_io_of(io);
    struct io_trace *t = h->t;
    trace_lock(t);
    int rc = h->inner->ops->unlink(h->inner, path);
    struct trace_name *n = name_find(t, path);
    struct io_trace_event e = {.kind = IO_TRACE_UNLINK, .path = path, .res = rc};
    if (n) e.node = n->node;
    if (rc == 0 && n) name_remove(t, n);
    trace_add(t, &e);
    trace_unlock(t);
    return rc;
}

static int trace_rename(struct io *io, const char *from, const char *to)
{
    struct trace_io *h = trace_io_of(io);
    struct io_trace *t = h->t;
    trace_lock(t);
    int rc = h->inner->ops->rename(h->inner, from, to);
    struct trace_name *n = name_find(t, from);
    struct io_trace_event e = {.kind = IO_TRACE_RENAME, .path = to, .from = from, .res = rc};
    if (n) e.node = n->node;
    if (rc == 0 && n && strcmp(from, to) != 0) {
        uint32_t node = n->node;
        name_remove(t, n);
        name_set(t, to, node);
    }
    trace_add(t, &e);
    trace_unlock(t);
    return rc;
}

/* mkdir and sync_dir: the call and its event under the trace's mutex. */
static int trace_dir_call(struct io *io, enum io_trace_kind kind, const char *path)
{
    struct trace_io *h = trace_io_of(io);
    char *p = strdup(path);
    IDEM_ASSERT(p != NULL);
    size_t n = strlen(p);
    while (kind == IO_TRACE_SYNC_DIR && n > 1 && p[n - 1] == '/')
        p[--n] = 0;
    trace_lock(h->t);
    int rc = kind == IO_TRACE_MKDIR ? h->inner->ops->mkdir(h->inner, path)
                                    : h->inner->ops->sync_dir(h->inner, path);
    struct io_trace_event e = {.kind = kind, .path = p, .res = rc};
    trace_add(h->t, &e);
    trace_unlock(h->t);
    free(p);
    return rc;
}

static int trace_sync_dir(struct io *io, const char *dir)
{
    return trace_dir_call(io, IO_TRACE_SYNC_DIR, dir);
}

/* A read of the directory: no event (it changes nothing a crash could keep). */
static int trace_list(struct io *io, const char *dir, int (*fn)(const char *name, void *ctx),
                      void *ctx)
{
    struct trace_io *h = trace_io_of(io);
    return h->inner->ops->list(h->inner, dir, fn, ctx);
}

static int trace_mkdir(struct io *io, const char *path)
{
    return trace_dir_call(io, IO_TRACE_MKDIR, path);
}

/* ---- the ring ---- */

/* A free entry of the request table (mu held); its index is the inner user_data. */
static size_t req_take(struct trace_io *h)
{
    for (size_t i = 0; i < h->nreqs; i++)
        if (!h->reqs[i].used) return i;
    h->reqs = tu_grow(h->reqs, &h->reqs_cap, h->nreqs + 1, sizeof *h->reqs);
    h->reqs[h->nreqs].used = 0;
    return h->nreqs++;
}

static int trace_submit_write(struct io *io, struct io_file *f, uint64_t off, const void *buf,
                              size_t len, unsigned flags, uint64_t user_data)
{
    struct trace_io *h = trace_io_of(io);
    trace_lock(h->t);
    size_t i = req_take(h);
    int rc = h->inner->ops->submit_write(h->inner, f->inner, off, buf, len, flags, i);
    if (rc == 0) {
        struct io_trace_event e = {.kind = IO_TRACE_WRITE,
                                   .node = f->node,
                                   .flags = flags,
                                   .off = off,
                                   .len = len,
                                   .data = buf};
        const struct io_trace_event *d = trace_add(h->t, &e);
        h->reqs[i] = (struct trace_req){
            .used = 1, .user_data = user_data, .submit_seq = d->seq, .buf = buf, .len = len};
        h->reqs[i].node = f->node;
    }
    trace_unlock(h->t);
    return rc;
}

static int trace_submit_flush(struct io *io, struct io_file *f, uint64_t user_data)
{
    struct trace_io *h = trace_io_of(io);
    trace_lock(h->t);
    size_t i = req_take(h);
    int rc = h->inner->ops->submit_flush(h->inner, f->inner, i);
    if (rc == 0) {
        struct io_trace_event e = {.kind = IO_TRACE_FLUSH, .node = f->node};
        const struct io_trace_event *d = trace_add(h->t, &e);
        h->reqs[i] = (struct trace_req){.used = 1, .user_data = user_data, .submit_seq = d->seq};
        h->reqs[i].node = f->node;
    }
    trace_unlock(h->t);
    return rc;
}

static int trace_wait(struct io *io, struct io_completion *out, int max, int min)
{
    struct trace_io *h = trace_io_of(io);
    struct io_trace *t = h->t;
    int n = h->inner->ops->wait(h->inner, out, max, min);
    if (n <= 0) return n;
    trace_lock(t);
    for (int k = 0; k < n; k++) {
        IDEM_ASSERT(out[k].user_data < h->nreqs && h->reqs[out[k].user_data].used);
        struct trace_req *r = &h->reqs[out[k].user_data];
        const struct io_trace_event *sub = &t->ev[r->submit_seq - 1];
        struct io_trace_event e = {.node = r->node, .ref = r->submit_seq, .res = out[k].res};
        e.kind = sub->kind == IO_TRACE_WRITE ? IO_TRACE_WRITE_DONE : IO_TRACE_FLUSH_DONE;
        if (sub->kind == IO_TRACE_WRITE && memcmp(r->buf, sub->data, r->len) != 0)
            t->buffer_changes++;
        trace_add(t, &e);
        out[k].user_data = r->user_data;
        r->used = 0;
    }
    trace_unlock(t);
    return n;
}

static void trace_io_destroy(struct io *io)
{
    struct trace_io *h = trace_io_of(io);
    h->inner->ops->destroy(h->inner);
    free(h->reqs);
    free(h);
}

static const struct io_ops trace_ops = {
    .name = "trace",
    .open = trace_open,
    .close = trace_close,
    .size = trace_size,
    .allocate = trace_allocate,
    .reserve = trace_reserve,
    .truncate = trace_truncate,
    .read = trace_read,
    .write_now = trace_write_now,
    .data_after = trace_data_after,
    .overwrites_in_place = trace_overwrites_in_place,
    .map = trace_map,
    .unmap = trace_unmap,
    .unlink = trace_unlink,
    .rename = trace_rename,
    .sync_dir = trace_sync_dir,
    .list = trace_list,
    .mkdir = trace_mkdir,
    .drop_cache = trace_drop_cache,
    .submit_write = trace_submit_write,
    .submit_flush = trace_submit_flush,
    .wait = trace_wait,
    .destroy = trace_io_destroy,
};

/* ---- the trace ---- */

int io_trace_create(struct io_trace **out)
{
    struct io_trace *t = calloc(1, sizeof *t);
    if (!t) return -ENOMEM;
    pthread_mutex_init(&t->mu, NULL);
    *out = t;
    return 0;
}

void io_trace_destroy(struct io_trace *t)
{
    if (!t) return;
    for (size_t i = 0; i < t->count; i++) {
        free((void *)t->ev[i].data);
        free((void *)t->ev[i].path);
        free((void *)t->ev[i].from);
    }
    for (size_t i = 0; i < t->nnames; i++)
        free(t->names[i].path);
    free(t->names);
    free(t->ev);
    pthread_mutex_destroy(&t->mu);
    free(t);
}

struct io *io_trace_wrap(struct io_trace *t, struct io *inner)
{
    struct trace_io *h = calloc(1, sizeof *h);
    if (!h) {
        inner->ops->destroy(inner);
        return NULL;
    }
    h->base.ops = &trace_ops;
    h->t = t;
    h->inner = inner;
    return &h->base;
}

uint64_t io_trace_now(struct io_trace *t)
{
    trace_lock(t);
    uint64_t seq = t->count + 1;
    trace_unlock(t);
    return seq;
}

size_t io_trace_count(const struct io_trace *t)
{
    return t->count;
}

const struct io_trace_event *io_trace_events(const struct io_trace *t)
{
    return t->ev;
}

uint64_t io_trace_buffer_changes(const struct io_trace *t)
{
    return t->buffer_changes;
}
