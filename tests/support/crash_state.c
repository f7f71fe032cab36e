/*
 * crash_state.c: the walk of crash_state.h.
 * Model: a node's durable content (what survives any crash) grows as persistence points take
 * effect; items are the trace's writes, truncates and allocates, each open (issued, not yet
 * durable) until a completed flush covers it or its write fails; covers are computed when the
 * flush (or linked write) is submitted, from the items of its file reaped by then. Names are
 * relative to the store directory; the store directory itself is the name "" in its parent.
 * Invariants: open holds item indexes in issue order; an item is durable at most once, and
 * then applied to its node's durable content; pending directory operations are in trace order
 * and leave the list (in order) when a sync_dir of their directory covers them.
 */
#include "crash_state.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "testutil.h"
#include "util.h"

#define CS_ROOT  "" /* the name of the store directory in its parent */
#define CS_BLOCK 4096u

struct cs_buf {
    uint8_t *p;
    uint64_t len, cap;
};

struct cs_item {
    size_t ev;       /* its event */
    uint64_t length; /* write: bytes that can reach the disk (the completion's count) */
    int reaped;      /* write: its completion was seen (items of resizes: at once) */
    int gone;        /* durable, or failed: no longer open */
};

struct cs_name {
    char *name;
    uint32_t node;
};

struct cs_dir_op {
    size_t ev;
    int in_parent; /* the mkdir of the store directory */
};

struct cs_cover {
    size_t *items;
    size_t n;
};

struct cs_walk {
    const struct io_trace_event *ev;
    size_t count;
    char *store_dir;
    char *parent_dir;
    size_t store_len;
    size_t pos;       /* next event to process */
    int stopped;      /* at a point: ev[pos] takes effect at the next call */
    int ended;        /* the final point was reported */
    int root_durable; /* the store directory exists whatever happens */
    struct cs_buf *nodes;
    uint32_t nnodes;
    struct cs_item *items;
    size_t nitems, items_cap;
    int64_t *item_of_ev;
    struct cs_cover *cover_of_ev;
    size_t *open;
    size_t nopen, open_cap;
    struct cs_name *names; /* the durable namespace */
    size_t nnames, names_cap;
    struct cs_dir_op *pend;
    size_t npend, pend_cap;
};

static void buf_resize(struct cs_buf *b, uint64_t len)
{
    if (len > b->cap) {
        uint64_t cap = b->cap * 2 > len ? b->cap * 2 : len;
        uint8_t *p = realloc(b->p, cap);
        IDEM_ASSERT(p != NULL);
        b->p = p;
        b->cap = cap;
    }
    if (len > b->len) memset(b->p + b->len, 0, len - b->len);
    b->len = len;
}

/* The name of path relative to the store directory: "" for the directory, NULL if outside. */
static const char *cs_rel(const struct cs_walk *w, const char *path)
{
    if (!path || strncmp(path, w->store_dir, w->store_len) != 0) return NULL;
    const char *r = path + w->store_len;
    if (*r == 0) return CS_ROOT;
    if (*r != '/' || strchr(r + 1, '/') || r[1] == 0) return NULL;
    return r + 1;
}

/* ---- creation ---- */

static int cs_check_paths(const struct cs_walk *w)
{
    for (size_t i = 0; i < w->count; i++) {
        const struct io_trace_event *e = &w->ev[i];
        int file_op =
            e->kind == IO_TRACE_CREATE || e->kind == IO_TRACE_RENAME || e->kind == IO_TRACE_UNLINK;
        if (file_op && (!cs_rel(w, e->path) || !*cs_rel(w, e->path))) return -EINVAL;
        if (e->kind == IO_TRACE_RENAME && (!cs_rel(w, e->from) || !*cs_rel(w, e->from)))
            return -EINVAL;
    }
    return 0;
}

int cs_walk_create(const struct io_trace_event *events, size_t count, const char *store_dir,
                   struct cs_walk **out)
{
    struct cs_walk *w = calloc(1, sizeof *w);
    if (!w) return -ENOMEM;
    w->ev = events;
    w->count = count;
    w->store_dir = strdup(store_dir);
    IDEM_ASSERT(w->store_dir != NULL);
    w->store_len = strlen(w->store_dir);
    while (w->store_len > 1 && w->store_dir[w->store_len - 1] == '/')
        w->store_dir[--w->store_len] = 0;
    w->parent_dir = strdup(w->store_dir);
    char *slash = strrchr(w->parent_dir, '/');
    if (slash) *slash = 0;
    w->root_durable = 1;
    uint32_t nodes = 0;
    for (size_t i = 0; i < count; i++) {
        if (events[i].node > nodes) nodes = events[i].node;
        /* A store directory made under the trace is durable only after its parent's sync. */
        if (events[i].kind == IO_TRACE_MKDIR && events[i].res == 0 &&
            strcmp(events[i].path, w->store_dir) == 0)
            w->root_durable = 0;
    }
    w->nnodes = nodes;
    w->nodes = calloc(nodes + 1, sizeof *w->nodes);
    w->item_of_ev = malloc((count + 1) * sizeof *w->item_of_ev);
    w->cover_of_ev = calloc(count + 1, sizeof *w->cover_of_ev);
    IDEM_ASSERT(w->nodes && w->item_of_ev && w->cover_of_ev);
    for (size_t i = 0; i < count; i++)
        w->item_of_ev[i] = -1;
    int rc = cs_check_paths(w);
    if (rc < 0) {
        cs_walk_destroy(w);
        return rc;
    }
    *out = w;
    return 0;
}

void cs_walk_destroy(struct cs_walk *w)
{
    if (!w) return;
    for (uint32_t i = 0; i <= w->nnodes; i++)
        free(w->nodes[i].p);
    for (size_t i = 0; i < w->count; i++)
        free(w->cover_of_ev[i].items);
    for (size_t i = 0; i < w->nnames; i++)
        free(w->names[i].name);
    free(w->nodes);
    free(w->items);
    free(w->item_of_ev);
    free(w->cover_of_ev);
    free(w->open);
    free(w->names);
    free(w->pend);
    free(w->store_dir);
    free(w->parent_dir);
    free(w);
}

/* ---- processing events ---- */

static void item_add(struct cs_walk *w, size_t ev, int reaped)
{
    w->items = tu_grow(w->items, &w->items_cap, w->nitems + 1, sizeof *w->items);
    const struct io_trace_event *e = &w->ev[ev];
    w->items[w->nitems] = (struct cs_item){.ev = ev, .length = e->len, .reaped = reaped};
    w->item_of_ev[ev] = (int64_t)w->nitems;
    w->open = tu_grow(w->open, &w->open_cap, w->nopen + 1, sizeof *w->open);
    w->open[w->nopen++] = w->nitems++;
}

/* Removes gone items from open, keeping issue order. */
static void open_compact(struct cs_walk *w)
{
    size_t k = 0;
    for (size_t i = 0; i < w->nopen; i++)
        if (!w->items[w->open[i]].gone) w->open[k++] = w->open[i];
    w->nopen = k;
}

/* The cover of a flush (or linked write) submitted at ev: the open items of its file that are
 * reaped, and the linked write itself. */
static void cover_make(struct cs_walk *w, size_t ev)
{
    const struct io_trace_event *e = &w->ev[ev];
    struct cs_cover *c = &w->cover_of_ev[ev];
    c->items = malloc((w->nopen + 1) * sizeof *c->items);
    IDEM_ASSERT(c->items != NULL);
    for (size_t i = 0; i < w->nopen; i++) {
        const struct cs_item *it = &w->items[w->open[i]];
        if (w->ev[it->ev].node == e->node && (it->reaped || it->ev == ev))
            c->items[c->n++] = w->open[i];
    }
}

static void item_apply(struct cs_walk *w, struct cs_item *it)
{
    const struct io_trace_event *e = &w->ev[it->ev];
    struct cs_buf *b = &w->nodes[e->node];
    if (e->kind == IO_TRACE_WRITE) {
        if (e->off + it->length > b->len) buf_resize(b, e->off + it->length);
        memcpy(b->p + e->off, e->data, it->length);
    } else if (e->kind == IO_TRACE_TRUNCATE) {
        buf_resize(b, e->off);
    } else if (e->off + e->len > b->len) {
        buf_resize(b, e->off + e->len);
    }
}

static void cover_durable(struct cs_walk *w, size_t ev)
{
    const struct cs_cover *c = &w->cover_of_ev[ev];
    for (size_t i = 0; i < c->n; i++) {
        struct cs_item *it = &w->items[c->items[i]];
        if (it->gone) continue;
        item_apply(w, it);
        it->gone = 1;
    }
    open_compact(w);
}

static size_t name_index(const struct cs_name *v, size_t n, const char *name)
{
    size_t i = 0;
    while (i < n && strcmp(v[i].name, name) != 0)
        i++;
    return i;
}

static void name_drop(struct cs_name *v, size_t *n, size_t i)
{
    free(v[i].name);
    v[i] = v[--*n];
}

/* Applies one directory operation (create, rename, unlink of node) to the namespace v. */
static void names_apply(struct cs_name **v, size_t *n, size_t *cap, enum io_trace_kind kind,
                        uint32_t node, const char *name, const char *from)
{
    if (kind == IO_TRACE_RENAME) {
        size_t i = name_index(*v, *n, from);
        if (i == *n) return; /* its source was never durable here */
        node = (*v)[i].node;
        name_drop(*v, n, i);
        kind = IO_TRACE_CREATE;
    }
    size_t i = name_index(*v, *n, name);
    if (kind == IO_TRACE_UNLINK) {
        if (i < *n) name_drop(*v, n, i);
        return;
    }
    if (i < *n) {
        (*v)[i].node = node;
        return;
    }
    *v = tu_grow(*v, cap, *n + 1, sizeof **v);
    (*v)[*n].name = strdup(name);
    IDEM_ASSERT((*v)[*n].name != NULL);
    (*v)[(*n)++].node = node;
}

/* Applies the pending directory operation op to the namespace v (or to *root). */
static void dir_op_apply(const struct cs_walk *w, const struct cs_dir_op *op, struct cs_name **v,
                         size_t *n, size_t *cap, int *root)
{
    const struct io_trace_event *e = &w->ev[op->ev];
    if (op->in_parent) {
        *root = 1;
        return;
    }
    names_apply(v, n, cap, e->kind, e->node, cs_rel(w, e->path),
                e->from ? cs_rel(w, e->from) : NULL);
}

static void sync_dir_durable(struct cs_walk *w, const char *dir)
{
    int parent = strcmp(dir, w->parent_dir) == 0;
    if (!parent && strcmp(dir, w->store_dir) != 0) return;
    size_t k = 0;
    for (size_t i = 0; i < w->npend; i++) {
        if (w->pend[i].in_parent == parent)
            dir_op_apply(w, &w->pend[i], &w->names, &w->nnames, &w->names_cap, &w->root_durable);
        else
            w->pend[k++] = w->pend[i];
    }
    w->npend = k;
}

static void dir_op_add(struct cs_walk *w, size_t ev, int in_parent)
{
    w->pend = tu_grow(w->pend, &w->pend_cap, w->npend + 1, sizeof *w->pend);
    w->pend[w->npend++] = (struct cs_dir_op){.ev = ev, .in_parent = in_parent};
}

static void write_done(struct cs_walk *w, size_t ev)
{
    const struct io_trace_event *e = &w->ev[ev];
    IDEM_ASSERT(e->ref >= 1 && w->item_of_ev[e->ref - 1] >= 0);
    struct cs_item *it = &w->items[w->item_of_ev[e->ref - 1]];
    it->reaped = 1;
    if (e->res < 0) {
        it->gone = 1; /* a failed write changes nothing (the store turns fatal) */
        open_compact(w);
    } else if ((uint64_t)e->res < it->length) {
        it->length = (uint64_t)e->res;
    }
}

/* Whether ev is a persistence point. */
static int is_point(const struct cs_walk *w, size_t ev)
{
    const struct io_trace_event *e = &w->ev[ev];
    if (e->kind == IO_TRACE_FLUSH_DONE || e->kind == IO_TRACE_SYNC_DIR) return e->res == 0;
    if (e->kind != IO_TRACE_WRITE_DONE || e->res < 0) return 0;
    return (w->ev[e->ref - 1].flags & IO_W_FLUSH) != 0;
}

static void process(struct cs_walk *w, size_t ev)
{
    const struct io_trace_event *e = &w->ev[ev];
    switch (e->kind) {
    case IO_TRACE_CREATE:
        dir_op_add(w, ev, 0);
        break;
    case IO_TRACE_RENAME:
    case IO_TRACE_UNLINK:
        if (e->res == 0) dir_op_add(w, ev, 0);
        break;
    case IO_TRACE_MKDIR:
        if (e->res == 0 && strcmp(e->path, w->store_dir) == 0) dir_op_add(w, ev, 1);
        break;
    case IO_TRACE_WRITE:
        item_add(w, ev, 0);
        if (e->flags & IO_W_FLUSH) cover_make(w, ev);
        break;
    case IO_TRACE_TRUNCATE:
    case IO_TRACE_ALLOCATE:
        if (e->res == 0) item_add(w, ev, 1);
        break;
    case IO_TRACE_FLUSH:
        cover_make(w, ev);
        break;
    case IO_TRACE_WRITE_DONE:
        write_done(w, ev);
        if (is_point(w, ev)) cover_durable(w, e->ref - 1);
        break;
    case IO_TRACE_FLUSH_DONE:
        if (e->res == 0) cover_durable(w, e->ref - 1);
        break;
    case IO_TRACE_SYNC_DIR:
        if (e->res == 0) sync_dir_durable(w, e->path);
        break;
    }
}

int cs_walk_next(struct cs_walk *w, uint64_t *seq)
{
    if (w->stopped) {
        process(w, w->pos++);
        w->stopped = 0;
    }
    while (w->pos < w->count) {
        if (is_point(w, w->pos)) {
            w->stopped = 1;
            *seq = w->ev[w->pos].seq;
            return 1;
        }
        process(w, w->pos++);
    }
    if (w->ended) return 0;
    w->ended = 1;
    *seq = w->count + 1;
    return 1;
}

size_t cs_walk_unsynced(const struct cs_walk *w)
{
    return w->nopen;
}

size_t cs_walk_dir_ops(const struct cs_walk *w)
{
    return w->npend;
}

int cs_walk_is_write(const struct cs_walk *w, size_t i, uint64_t *len)
{
    IDEM_ASSERT(i < w->nopen);
    const struct cs_item *it = &w->items[w->open[i]];
    if (len) *len = it->length;
    return w->ev[it->ev].kind == IO_TRACE_WRITE;
}

/* ---- building a state ---- */

static int dir_clear(const char *dir)
{
    DIR *d = opendir(dir);
    if (!d) return -errno;
    struct dirent *de;
    int rc = 0;
    while ((de = readdir(d)) != NULL) {
        if (strcmp(de->d_name, ".") == 0 || strcmp(de->d_name, "..") == 0) continue;
        if (unlinkat(dirfd(d), de->d_name, 0) != 0) rc = -errno;
    }
    closedir(d);
    return rc;
}

/* Applies the selected open items of node to the file fd, whose size is *size. */
static int apply_open(const struct cs_walk *w, const struct cs_select *sel, uint32_t node, int fd,
                      uint64_t *size)
{
    for (size_t i = 0; i < w->nopen; i++) {
        if (!sel->keep || !sel->keep[i]) continue;
        const struct cs_item *it = &w->items[w->open[i]];
        const struct io_trace_event *e = &w->ev[it->ev];
        if (e->node != node) continue;
        uint64_t len = it->length;
        if ((int64_t)i == sel->torn && sel->torn_bytes < len) len = sel->torn_bytes;
        if (e->kind == IO_TRACE_WRITE) {
            if (len && pwrite(fd, e->data, len, (off_t)e->off) != (ssize_t)len) return -EIO;
            if (e->off + len > *size) *size = e->off + len;
        } else if (e->kind == IO_TRACE_TRUNCATE) {
            if (ftruncate(fd, (off_t)e->off) != 0) return -errno;
            *size = e->off;
        } else if (e->off + e->len > *size) {
            if (ftruncate(fd, (off_t)(e->off + e->len)) != 0) return -errno;
            *size = e->off + e->len;
        }
    }
    return 0;
}

static int buf_zero(const uint8_t *p, uint64_t len)
{
    for (uint64_t i = 0; i < len; i++)
        if (p[i]) return 0;
    return 1;
}

static int file_build(const struct cs_walk *w, const struct cs_select *sel, const char *dir,
                      const struct cs_name *n)
{
    char path[4096];
    snprintf(path, sizeof path, "%s/%s", dir, n->name);
    int fd = open(path, O_CREAT | O_TRUNC | O_WRONLY | O_CLOEXEC, 0600);
    if (fd < 0) return -errno;
    const struct cs_buf *b = &w->nodes[n->node];
    int rc = ftruncate(fd, (off_t)b->len) == 0 ? 0 : -errno;
    /* Blocks of zeros stay holes (they read as zeros): most of a preallocated segment. Each
     * run of other blocks is written at once. */
    for (uint64_t off = 0; rc == 0 && off < b->len;) {
        uint64_t end = off;
        while (end < b->len) {
            uint64_t len = b->len - end < CS_BLOCK ? b->len - end : CS_BLOCK;
            if (buf_zero(b->p + end, len)) break;
            end += len;
        }
        if (end > off && pwrite(fd, b->p + off, end - off, (off_t)off) != (ssize_t)(end - off))
            rc = -EIO;
        off = end < b->len ? end + CS_BLOCK : end; /* past the block of zeros that ended the run */
    }
    uint64_t size = b->len;
    if (rc == 0) rc = apply_open(w, sel, n->node, fd, &size);
    close(fd);
    return rc;
}

int cs_walk_build(struct cs_walk *w, const struct cs_select *sel, const char *dir)
{
    IDEM_ASSERT(sel->dir_ops <= w->npend);
    /* The namespace: durable names, then the selected prefix of pending operations. */
    struct cs_name *v = NULL;
    size_t n = 0, cap = 0;
    v = tu_grow(v, &cap, w->nnames + 1, sizeof *v);
    for (size_t i = 0; i < w->nnames; i++) {
        v[n].name = strdup(w->names[i].name);
        v[n++].node = w->names[i].node;
    }
    int root = w->root_durable;
    for (size_t i = 0; i < sel->dir_ops; i++)
        dir_op_apply(w, &w->pend[i], &v, &n, &cap, &root);
    int rc = 0;
    if (mkdir(dir, 0700) != 0 && errno != EEXIST) rc = -errno;
    if (rc == 0) rc = dir_clear(dir);
    for (size_t i = 0; rc == 0 && root && i < n; i++)
        rc = file_build(w, sel, dir, &v[i]);
    if (rc == 0 && !root && rmdir(dir) != 0) rc = -errno;
    for (size_t i = 0; i < n; i++)
        free(v[i].name);
    free(v);
    return rc;
}
