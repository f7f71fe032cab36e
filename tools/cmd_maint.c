/*
 * cmd_maint.c: maintenance: verify (read-only, with a progress bar on a terminal), backup
 * (online through idemd's IDEM.BACKUP, or of a stopped store opened read-only), restore,
 * export (JSON Lines, read-only), import (into a new or empty store), checkpoint and compact.
 * All but backup work on a stopped store directory through include/idem.h.
 *
 * An import into a store that exists is written in place, so it marks the store
 * (IDEM_IMPORT_MARKER) before its first write and removes the marker only once the whole export
 * is in and the store closed: a crash part-way leaves a store that idemd refuses. verify reports
 * the marker as a fault; backup --dir and restore carry it to the copy.
 */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <ftw.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "ctl.h"

#define EXPORT_AUDIT_PAGE 10000u
/* 1: a header, records, audit entries. 2: and an end line with their counts, which import
 * requires (a file cut short is refused, not taken for the whole store). The header of format 2
 * may carry the store's token_next, above every token it handed out (idem_import_begin);
 * exports before it have none, and an older idemctl reads the format still (a way back). */
#define EXPORT_FORMAT 2

/* Offline commands refuse idemd's flags and default the directory. */
static int offline_opts(const struct ctl_opts *o, struct ctl_opts *out, const char *what)
{
    if (o->socket || o->host || o->port) {
        ctl_err("%s works on a stopped store only: stop idemd and pass --dir DIR", what);
        return CTL_USAGE;
    }
    *out = *o;
    if (!out->dir) out->dir = CTL_DEFAULT_DIR;
    return 0;
}

/* ---- verify ---- */

struct bar {
    int on;
    int last_pct;
};

static void bar_progress(void *ctx, uint64_t done, uint64_t total)
{
    struct bar *b = ctx;
    int pct = total ? (int)(done * 100 / total) : 100;
    if (!b->on || pct == b->last_pct) return;
    b->last_pct = pct;
    char fill[41];
    int k = pct * 40 / 100;
    memset(fill, '#', (size_t)k);
    memset(fill + k, '.', (size_t)(40 - k));
    fill[40] = 0;
    fprintf(stderr, "\rverifying [%s] %3d%%", fill, pct);
    fflush(stderr);
}

/* What an operator is told of a store that an import cut short (IDEM_IMPORT_MARKER). */
static void import_marked_say(const char *dir)
{
    ctl_err("%s holds %s: an import into it was cut short, and it may hold only part of the "
            "export; idemd refuses it until the import is run again with --force (or the file is "
            "removed once the store is known to hold what it should)",
            dir, IDEM_IMPORT_MARKER);
}

static void verify_print(const char *dir, const idem_verify_report *r, int marked,
                         const struct ctl_opts *o)
{
    if (o->json) {
        struct jw j;
        jw_init(&j, stdout);
        jw_obj(&j);
        jw_kstr(&j, "dir", dir);
        jw_kstr(&j, "verdict", r->errors ? "faults" : "sound");
        jw_kuint(&j, "errors", r->errors);
        jw_kstr(&j, "first_error", r->errors ? r->first_error : NULL);
        jw_kuint(&j, "segments", r->segments);
        jw_kuint(&j, "frames", r->frames);
        jw_kuint(&j, "records", r->records);
        jw_kuint(&j, "checkpoint_entries", r->checkpoint_entries);
        jw_kuint(&j, "audit_entries", r->audit_entries);
        jw_kuint(&j, "index_entries", r->index_entries);
        jw_key(&j, "import_unfinished");
        jw_bool(&j, marked);
        jw_obj_end(&j);
        fputc('\n', stdout);
        return;
    }
    printf("%s: %llu segments, %llu frames, %llu records, %llu checkpoint entries, %llu audit "
           "entries, %llu keys in the index\n",
           dir, (unsigned long long)r->segments, (unsigned long long)r->frames,
           (unsigned long long)r->records, (unsigned long long)r->checkpoint_entries,
           (unsigned long long)r->audit_entries, (unsigned long long)r->index_entries);
    if (r->errors)
        printf("%s%llu fault(s)%s; the first: %s\n", col(o, CTL_C_RED),
               (unsigned long long)r->errors, col(o, CTL_C_RESET), r->first_error);
    else
        printf("%ssound%s: every checksum and invariant holds\n", col(o, CTL_C_GREEN),
               col(o, CTL_C_RESET));
    if (marked)
        printf("%simport unfinished%s: %s/%s says an import into the store was cut short\n",
               col(o, CTL_C_RED), col(o, CTL_C_RESET), dir, IDEM_IMPORT_MARKER);
}

int cmd_verify(const struct ctl_opts *o)
{
    struct ctl_opts oo;
    int rc = offline_opts(o, &oo, "verify");
    if (rc) return rc;
    const char *dir = o->npos ? o->pos[0] : oo.dir;
    struct bar b = {.on = isatty(STDERR_FILENO) && !o->json, .last_pct = -1};
    idem_verify_report r;
    rc = idem_verify(dir, &r, bar_progress, &b);
    if (b.on && b.last_pct >= 0) fputc('\n', stderr);
    if (rc == IDEM_ELOCKED) {
        ctl_open_error(dir, rc);
        return CTL_FAIL;
    }
    if (rc != IDEM_OK) {
        ctl_err("verify %s: %s (%s)", dir, idem_last_error(), idem_strerror(rc));
        return CTL_FAIL;
    }
    /* A store an import cut short checks out, yet holds only part of an export: a fault. */
    int marked = idem_import_marked(dir);
    if (marked < 0) {
        ctl_err("verify %s: %s", dir, idem_last_error());
        return CTL_FAIL;
    }
    verify_print(dir, &r, marked, o);
    if (marked) import_marked_say(dir);
    return r.errors || marked ? CTL_FAIL : CTL_OK;
}

/* ---- backup, restore, checkpoint ---- */

/* dest, a copy of the store in src that an import cut short, was marked as its source is (the
 * engine's copy makes the marker before it names the copy): said. */
static void copy_marked(const char *src, const char *dest)
{
    import_marked_say(src);
    ctl_err("the copy %s is marked the same way (%s)", dest, IDEM_IMPORT_MARKER);
}

int cmd_backup(const struct ctl_opts *o)
{
    /* Online (--socket, --host): idemd copies its live store; offline: the stopped store. */
    struct ctl c;
    int rc = ctl_connect(&c, o, CTL_READ); /* offline: the files as they are, nothing repaired */
    if (rc) return rc;
    /* The copy of a store that an import cut short is marked too, or it would open as a whole
     * store: the engine makes the marker in it before naming it. */
    int marked = c.online ? 0 : idem_import_marked(o->dir);
    if (marked < 0) {
        ctl_err("backup of %s: %s", o->dir, idem_last_error());
        return ctl_disconnect(&c, CTL_FAIL);
    }
    rc = ctl_disconnect(&c, ctl_backup(&c, o->pos[0]));
    if (rc) return rc;
    if (marked) copy_marked(o->dir, o->pos[0]);
    if (o->json)
        printf("{\"backup\":\"ok\"}\n");
    else
        printf("backed up into %s\n", o->pos[0]);
    return CTL_OK;
}

int cmd_restore(const struct ctl_opts *o)
{
    if (o->socket || o->host || o->port || o->dir) {
        ctl_err("restore takes BACKUP and DEST only");
        return CTL_USAGE;
    }
    int marked = idem_import_marked(o->pos[0]);
    if (marked < 0) {
        ctl_err("restore of %s: %s", o->pos[0], idem_last_error());
        return CTL_FAIL;
    }
    int err = idem_restore(o->pos[0], o->pos[1]);
    if (err != IDEM_OK) {
        ctl_err("restore of %s into %s failed: %s (%s)", o->pos[0], o->pos[1], idem_strerror(err),
                idem_last_error());
        return CTL_FAIL;
    }
    if (marked) copy_marked(o->pos[0], o->pos[1]);
    if (o->json)
        printf("{\"restore\":\"ok\"}\n");
    else
        printf("restored %s into %s (a new store generation)\n", o->pos[0], o->pos[1]);
    return CTL_OK;
}

int cmd_checkpoint(const struct ctl_opts *o)
{
    struct ctl_opts oo;
    int rc = offline_opts(o, &oo, "checkpoint");
    if (rc) return rc;
    struct ctl c;
    rc = ctl_connect(&c, &oo, CTL_OFFLINE);
    if (rc) return rc;
    int err = idem_checkpoint(c.s);
    if (err != IDEM_OK) ctl_err("checkpoint of %s failed: %s", oo.dir, idem_strerror(err));
    if (ctl_disconnect(&c, err == IDEM_OK ? CTL_OK : CTL_FAIL)) return CTL_FAIL;
    printf(o->json ? "{\"checkpoint\":\"ok\"}\n" : "checkpoint written\n");
    return CTL_OK;
}

int cmd_compact(const struct ctl_opts *o)
{
    struct ctl_opts oo;
    int rc = offline_opts(o, &oo, "compact");
    if (rc) return rc;
    struct ctl c;
    rc = ctl_connect(&c, &oo, CTL_OFFLINE);
    if (rc) return rc;
    idem_stats before, cur;
    idem_get_stats(c.s, &before);
    /* Every sealed segment is walked and retired, within --timeout. */
    int err = idem_compact(c.s, (int)o->timeout_ms);
    int quiet = err == IDEM_OK ? 5 : 0;
    if (err != IDEM_OK && err != IDEM_EBUSY) {
        ctl_err("compaction failed: %s", idem_strerror(err));
        return ctl_disconnect(&c, CTL_FAIL);
    }
    err = idem_checkpoint(c.s);
    idem_get_stats(c.s, &cur);
    if (err != IDEM_OK) ctl_err("checkpoint after compaction failed: %s", idem_strerror(err));
    if (ctl_disconnect(&c, err == IDEM_OK ? CTL_OK : CTL_FAIL)) return CTL_FAIL;
    char a[32], b[32];
    fmt_size(before.wal_bytes, a, sizeof a);
    fmt_size(cur.wal_bytes, b, sizeof b);
    if (o->json)
        printf("{\"wal_bytes_before\":%llu,\"wal_bytes_after\":%llu,\"segments_retired\":%llu,"
               "\"settled\":%s}\n",
               (unsigned long long)before.wal_bytes, (unsigned long long)cur.wal_bytes,
               (unsigned long long)(cur.compactions - before.compactions),
               quiet >= 5 ? "true" : "false");
    else
        printf("log %s -> %s, %llu segment(s) retired%s\n", a, b,
               (unsigned long long)(cur.compactions - before.compactions),
               quiet >= 5 ? "" : " (stopped at --timeout; run again to go on)");
    return CTL_OK;
}

/* ---- export ---- */

struct keylist {
    char **keys;
    size_t *lens;
    size_t n, cap;
    int oom;
};

static void keylist_add(void *ctx, const void *key, size_t klen)
{
    struct keylist *k = ctx;
    if (k->n == k->cap) {
        size_t cap = k->cap ? 2 * k->cap : 1024;
        char **nk = realloc(k->keys, cap * sizeof *nk);
        size_t *nl = nk ? realloc(k->lens, cap * sizeof *nl) : NULL;
        if (nk) k->keys = nk;
        if (!nk || !nl) {
            k->oom = 1;
            return;
        }
        k->lens = nl;
        k->cap = cap;
    }
    k->keys[k->n] = malloc(klen ? klen : 1);
    if (!k->keys[k->n]) {
        k->oom = 1;
        return;
    }
    memcpy(k->keys[k->n], key, klen);
    k->lens[k->n++] = klen;
}

/* Frees the keys held; the arrays stay for the next step. */
static void keylist_clear(struct keylist *k)
{
    for (size_t i = 0; i < k->n; i++)
        free(k->keys[i]);
    k->n = 0;
}

static void keylist_free(struct keylist *k)
{
    keylist_clear(k);
    free(k->keys);
    free(k->lens);
}

static void export_audit_line(struct jw *j, const idem_audit_entry *e)
{
    jw_obj(j);
    jw_kstr(j, "type", "audit");
    jw_kuint(j, "seq", e->seq);
    jw_ktime(j, "at_ms", e->at_ms);
    /* Names and reasons are bytes: those that are not text go as "actor_base64" and
     * "reason_base64", so that an import gives the same bytes back. */
    jw_kblob_pub(j, "actor", e->actor, strlen(e->actor));
    jw_kstr(j, "action", e->action);
    jw_kblob_pub(j, "key", e->key, e->key_len);
    jw_kblob_pub(j, "reason", e->reason, strlen(e->reason));
    jw_kint(j, "state_before", e->state_before);
    jw_kint(j, "state_after", e->state_after);
    jw_kuint(j, "version_before", e->version_before);
    jw_kuint(j, "version_after", e->version_after);
    jw_kuint(j, "flags", e->flags);
    if (e->flags & IDEM_AUDIT_RESULT) {
        jw_kblob_pub(j, "result", e->result, e->result_len);
        jw_kuint(j, "result_len", e->result_full_len);
    }
    jw_obj_end(j);
    fputc('\n', j->f);
}

/* The whole trail, written oldest first (import appends) though it is read a page at a time from
 * the newest: each page's lines go, oldest first, to a temporary file as the page is read, and
 * the pages are then copied out from the last spooled (the oldest) to the first. Memory holds
 * one page; the trail (never trimmed: a million decisions took some 300 MB) was held whole.
 * Adds the entries to *naud. 0, or prints why and returns CTL_FAIL. */
static int export_audit(struct ctl *c, uint64_t *naud)
{
    FILE *spool = tmpfile();
    if (!spool) {
        ctl_err("cannot make a temporary file for the audit trail: %s", strerror(errno));
        return CTL_FAIL;
    }
    struct jw js;
    jw_init(&js, spool);
    off_t *starts = NULL; /* where each page's lines begin in the spool, newest page first */
    size_t npages = 0;
    uint64_t before = 0;
    int rc = 0;
    for (;;) {
        struct ctl_audit *a = NULL;
        size_t n = 0;
        rc = ctl_audit_page(c, NULL, 0, before, EXPORT_AUDIT_PAGE, &a, &n);
        off_t *grown = rc == 0 && n ? realloc(starts, (npages + 1) * sizeof *starts) : starts;
        if (rc == 0 && n && !grown) {
            ctl_err("out of memory for the audit trail");
            rc = CTL_FAIL;
        }
        if (rc != 0 || n == 0) {
            ctl_audit_free(a, n);
            break;
        }
        starts = grown;
        starts[npages++] = ftello(spool);
        for (size_t i = n; i > 0; i--)
            export_audit_line(&js, &a[i - 1].e);
        *naud += n;
        before = a[n - 1].e.seq;
        ctl_audit_free(a, n);
    }
    off_t end = ftello(spool);
    if (rc == 0 && (fflush(spool) != 0 || ferror(spool) || end < 0)) {
        ctl_err("writing the audit trail to a temporary file: %s", strerror(errno));
        rc = CTL_FAIL;
    }
    static char buf[1 << 16];
    for (size_t p = npages; rc == 0 && p > 0; p--) {
        off_t from = starts[p - 1], to = p == npages ? end : starts[p];
        if (fseeko(spool, from, SEEK_SET) != 0) rc = CTL_FAIL;
        for (off_t left = to - from; rc == 0 && left > 0;) {
            size_t got = fread(buf, 1, left < (off_t)sizeof buf ? (size_t)left : sizeof buf, spool);
            if (got == 0 || fwrite(buf, 1, got, stdout) != got) rc = CTL_FAIL;
            left -= (off_t)got;
        }
        if (rc != 0)
            ctl_err("copying the audit trail from its temporary file: %s", strerror(errno));
    }
    free(starts);
    fclose(spool);
    return rc;
}

/* Every record, then the audit trail. A scan step's keys are copied (the reads of their records
 * reuse the queue's memory they are in), read and written before the next step: memory holds one
 * step's keys, not every key of the store (about 60 bytes a key, 0.6 GB for 10 M). */
static int export_run(struct ctl *c)
{
    struct keylist k = {0};
    uint64_t cursor = 0;
    int rc = 0;
    struct jw j;
    jw_init(&j, stdout);
    jw_obj(&j);
    jw_kstr(&j, "type", "export");
    jw_kint(&j, "format", EXPORT_FORMAT);
    jw_kstr(&j, "idem_version", IDEM_VERSION_STRING);
    idem_stats st;
    idem_get_stats(c->s, &st);
    jw_kint(&j, "token_next", st.token_next);
    jw_obj_end(&j);
    fputc('\n', stdout);
    uint64_t nrec = 0, naud = 0;
    do {
        rc = ctl_scan_step(c, &cursor, 0, 0, keylist_add, &k);
        for (size_t i = 0; rc == 0 && !k.oom && i < k.n; i++) {
            struct ctl_record r;
            int found = 0;
            rc = ctl_get(c, k.keys[i], k.lens[i], &r, &found);
            if (rc == 0 && found) {
                nrec++;
                jw_obj(&j);
                jw_kstr(&j, "type", "record");
                print_record_fields(&j, &r.r, 0);
                jw_obj_end(&j);
                fputc('\n', stdout);
                ctl_record_free(&r);
            }
        }
        keylist_clear(&k);
    } while (rc == 0 && cursor != 0 && !k.oom);
    if (rc == 0 && !k.oom) rc = export_audit(c, &naud);
    if (k.oom) {
        ctl_err("out of memory listing the keys");
        rc = CTL_FAIL;
    }
    if (rc == 0) { /* the end line: an import of a file cut short finds it missing */
        jw_obj(&j);
        jw_kstr(&j, "type", "end");
        jw_kuint(&j, "records", nrec);
        jw_kuint(&j, "audit_entries", naud);
        jw_obj_end(&j);
        fputc('\n', stdout);
    }
    keylist_free(&k);
    return rc;
}

int cmd_export(const struct ctl_opts *o)
{
    struct ctl_opts oo;
    int rc = offline_opts(o, &oo, "export");
    if (rc) return rc;
    struct ctl c;
    rc = ctl_connect(&c, &oo, CTL_OFFLINE_READ);
    if (rc) return rc;
    /* An export of a store an import cut short would look whole, and a store imported from it
     * in a new directory would be unmarked with part of the keys: refused. Looked for with the
     * store open (its lock held), so that no import marks it between the look and the export. */
    int marked = idem_import_marked(oo.dir);
    if (marked != 0) {
        if (marked < 0)
            ctl_err("export of %s: %s", oo.dir, idem_last_error());
        else
            import_marked_say(oo.dir);
        return ctl_disconnect(&c, CTL_FAIL);
    }
    return ctl_disconnect(&c, export_run(&c));
}

/* ---- import ---- */

struct line {
    const struct jfield *f;
    int n;
    uint8_t *owned[8]; /* decoded base64 fields */
    int nowned;
    const char *err;
};

static int64_t num(struct line *l, const char *name)
{
    const struct jfield *f = jfield_get(l->f, l->n, name);
    if (f && !f->is_num && !f->is_null) l->err = name;
    return f && f->is_num ? f->num : 0;
}

/* A number field that must lie in lo..hi: one outside is the line's error, not cut to fit. */
static int64_t num_in(struct line *l, const char *name, int64_t lo, int64_t hi)
{
    int64_t v = num(l, name);
    if (v < lo || v > hi) l->err = name;
    return v;
}

/* A bytes field: "name" (text) or "name_base64"; *present 0 when null or absent. */
static const void *bytes(struct line *l, const char *name, uint32_t *len, int *present)
{
    char b64name[64];
    snprintf(b64name, sizeof b64name, "%s_base64", name);
    const struct jfield *f = jfield_get(l->f, l->n, name);
    const struct jfield *b = jfield_get(l->f, l->n, b64name);
    *present = 0;
    *len = 0;
    /* A value of another type (a number, an object) is the line's error, not an empty field. */
    if ((f && !f->str && !f->is_null) || (b && !b->str && !b->is_null)) {
        l->err = name;
        return NULL;
    }
    if (f && f->str) {
        *present = 1;
        *len = (uint32_t)f->len;
        return f->str;
    }
    if (b && b->str && l->nowned < 8) {
        uint8_t *d;
        size_t n;
        if (strlen(b->str) != b->len || base64_decode(b->str, &d, &n) < 0) {
            l->err = name;
            return NULL;
        }
        l->owned[l->nowned++] = d;
        *present = 1;
        *len = (uint32_t)n;
        return d;
    }
    return NULL;
}

static int hexfield(struct line *l, const char *name, uint8_t *out)
{
    const struct jfield *f = jfield_get(l->f, l->n, name);
    if (f && !f->str && !f->is_null) l->err = name;
    if (!f || !f->str) return 0;
    if (strlen(f->str) != f->len || parse_hex(f->str, out, IDEM_FP_BYTES) < 0) {
        l->err = name;
        return 0;
    }
    return 1;
}

static void line_record(struct line *l, idem_record *r)
{
    int p;
    memset(r, 0, sizeof *r);
    r->key = bytes(l, "key", &r->key_len, &p);
    const struct jfield *st = jfield_get(l->f, l->n, "state");
    for (int s = IDEM_STATE_IN_FLIGHT; st && st->str && s <= IDEM_STATE_REVIEW; s++)
        if (strcmp(st->str, idem_state_name(s)) == 0) r->state = s;
    if (!r->key || !r->state) l->err = !r->key ? "key" : "state";
    r->first_seen_ms = num(l, "first_seen_ms");
    r->expires_at_ms = num(l, "expires_at_ms");
    r->last_seen_ms = num(l, "last_seen_ms");
    r->seen_count = (uint64_t)num_in(l, "seen_count", 0, INT64_MAX);
    r->has_fp = hexfield(l, "fingerprint", r->fp);
    r->lease_until_ms = num(l, "lease_until_ms");
    r->token = num(l, "token");
    r->owner = bytes(l, "owner", &r->owner_len, &p);
    r->attempts = (uint32_t)num_in(l, "attempts", 0, UINT32_MAX);
    r->last_grant_ms = num(l, "last_grant_ms");
    r->result = bytes(l, "result", &r->result_len, &p);
    r->note = bytes(l, "note", &r->note_len, &p);
    r->mismatch_count = (uint64_t)num_in(l, "mismatch_count", 0, INT64_MAX);
    r->last_mismatch_ms = num(l, "last_mismatch_ms");
    r->has_last_mismatch_fp = hexfield(l, "last_mismatch_fp", r->last_mismatch_fp);
    r->version = (uint64_t)num_in(l, "version", 0, INT64_MAX);
}

static void line_audit(struct line *l, idem_audit_entry *e)
{
    int p;
    const struct jfield *f;
    memset(e, 0, sizeof *e);
    e->seq = (uint64_t)num_in(l, "seq", 0, INT64_MAX);
    e->at_ms = num(l, "at_ms");
    uint32_t len;
    e->actor = bytes(l, "actor", &len, &p); /* base64_decode ends what it decodes with a NUL */
    if (e->actor && memchr(e->actor, 0, len)) l->err = "actor"; /* the store reads to a NUL */
    if (!e->actor) e->actor = "";
    f = jfield_get(l->f, l->n, "action");
    e->action = f && f->str ? f->str : NULL;
    if (f && f->str && strlen(f->str) != f->len) l->err = "action";
    e->reason = bytes(l, "reason", &len, &p);
    if (e->reason && memchr(e->reason, 0, len)) l->err = "reason";
    if (!e->reason) e->reason = "";
    e->key = bytes(l, "key", &e->key_len, &p);
    e->state_before = (int)num_in(l, "state_before", 0, IDEM_STATE_REVIEW);
    e->state_after = (int)num_in(l, "state_after", 0, IDEM_STATE_REVIEW);
    e->version_before = (uint64_t)num_in(l, "version_before", 0, INT64_MAX);
    e->version_after = (uint64_t)num_in(l, "version_after", 0, INT64_MAX);
    e->flags = (uint32_t)num_in(l, "flags", 0, IDEM_AUDIT_FLAGS_KNOWN); /* none before them */
    e->result = bytes(l, "result", &e->result_len, &p);
    e->result_full_len = (uint32_t)num_in(l, "result_len", 0, UINT32_MAX);
    /* The store's limits, checked here by line: a batch of entries goes to the store 256 at a
     * time (audit_flush), and a bad file held that many copies of 7 MiB lines before it said. */
    const char *bad = idem_audit_entry_invalid(e);
    if (bad && !l->err) l->err = bad;
    if (!e->action) e->action = "";
}

/* What import has read of an export so far. */
struct import_state {
    int64_t format;     /* the header's; 0 before it */
    int64_t token_next; /* the header's (format 3 on), 0 before */
    int ended;          /* the end line was read */
    uint64_t nrec, naud;
    uint32_t result_max; /* the store's result limit, to name it when a result passes it */
    int rerun;           /* the store held IDEM_IMPORT_MARKER: an import cut short, run again */
    uint64_t naud_in;    /* audit entries of naud the cut-short import had written already */
    uint64_t writes;     /* records and audit entries handed to the store (some may be in) */
    /* Audit entries read and not yet handed over (audit_flush): imported together, they share
     * the trail's blocks and one flush. Each entry's strings and key are a copy (e_mem[i]). */
    idem_audit_entry e[IDEM_IMPORT_AUDIT_MAX];
    char *e_mem[IDEM_IMPORT_AUDIT_MAX];
    uint64_t e_no[IDEM_IMPORT_AUDIT_MAX]; /* their lines */
    size_t ne;
};

/* Keeps a copy of e (its strings point into the line) to be imported with the next ones. */
static int audit_keep(struct import_state *st, const idem_audit_entry *e, uint64_t no)
{
    size_t la = strlen(e->actor) + 1, lc = strlen(e->action) + 1, lr = strlen(e->reason) + 1;
    char *m = malloc(la + lc + lr + e->key_len + e->result_len);
    if (!m) return -1;
    idem_audit_entry *k = &st->e[st->ne];
    *k = *e;
    k->actor = memcpy(m, e->actor, la);
    k->action = memcpy(m + la, e->action, lc);
    k->reason = memcpy(m + la + lc, e->reason, lr);
    k->key = memcpy(m + la + lc + lr, e->key, e->key_len);
    k->result =
        e->result_len ? memcpy(m + la + lc + lr + e->key_len, e->result, e->result_len) : NULL;
    st->e_mem[st->ne] = m;
    st->e_no[st->ne++] = no;
    return 0;
}

static void audit_drop(struct import_state *st)
{
    for (size_t i = 0; i < st->ne; i++)
        free(st->e_mem[i]);
    st->ne = 0;
}

/* Imports the entries kept: 0, or prints why and returns CTL_FAIL. An entry the store refuses
 * (IDEM_EINVAL: nothing of the group was written) is found by importing them one at a time, so
 * that its line is named. */
static int audit_flush(struct ctl *c, const char *file, struct import_state *st)
{
    if (!st->ne) return 0;
    int rc = idem_import_audit_n(c->q, st->e, st->ne), alone = rc == IDEM_EINVAL;
    size_t done = rc == IDEM_OK ? st->ne : 0;
    for (; alone && done < st->ne; done++)
        if ((rc = idem_import_audit(c->q, &st->e[done])) != IDEM_OK) break;
    st->naud += done;
    if (rc != IDEM_OK && alone)
        ctl_err("%s:%llu: %s", file, (unsigned long long)st->e_no[done],
                rc == IDEM_EINVAL && *idem_last_error() ? idem_last_error() : idem_strerror(rc));
    else if (rc != IDEM_OK)
        ctl_err("%s:%llu-%llu: %s", file, (unsigned long long)st->e_no[0],
                (unsigned long long)st->e_no[st->ne - 1], idem_strerror(rc));
    audit_drop(st);
    return rc == IDEM_OK ? 0 : CTL_FAIL;
}

/* A re-run of an import cut short: whether the trail holds e as that import wrote it. An entry
 * keeps its seq when the trail had none as high (a store that held no decisions before the
 * import), so the entry of that seq is compared whole. 1, 0, or a negative idem_err. */
static int audit_in_already(struct ctl *c, const idem_audit_entry *e)
{
    const idem_audit_entry *a = NULL;
    size_t n = 0;
    int rc = idem_audit_page(c->q, NULL, 0, e->seq + 1, 1, &a, &n); /* the newest seq <= e's */
    if (rc != IDEM_OK) return rc;
    if (n != 1 || a->seq != e->seq || a->at_ms != e->at_ms || a->key_len != e->key_len) return 0;
    return !strcmp(a->actor, e->actor) && !strcmp(a->action, e->action) &&
           !strcmp(a->reason, e->reason) && !memcmp(a->key, e->key, e->key_len) &&
           a->state_before == e->state_before && a->state_after == e->state_after &&
           a->version_before == e->version_before && a->version_after == e->version_after &&
           a->flags == e->flags && a->result_full_len == e->result_full_len &&
           a->result_len == e->result_len &&
           (!a->result_len || !memcmp(a->result, e->result, a->result_len));
}

/* The header and the end line: 0, or prints why and returns CTL_FAIL. */
static int import_frame_line(const char *file, uint64_t no, const struct jfield *f, int n,
                             const char *type, struct import_state *st)
{
    const struct jfield *x;
    if (strcmp(type, "export") == 0) {
        x = jfield_get(f, n, "format");
        st->format = x && x->is_num ? x->num : 0;
        if (no != 1 || st->format < 1 || st->format > EXPORT_FORMAT) {
            ctl_err("%s:%llu: %s", file, (unsigned long long)no,
                    no != 1 ? "a second header" : "an export format this idemctl does not know");
            return CTL_FAIL;
        }
        x = jfield_get(f, n, "token_next");
        if (x && (!x->is_num || x->num < 1 || x->num > IDEM_TOKEN_MAX)) {
            ctl_err("%s:%llu: the header's field token_next is not a number in 1..%lld", file,
                    (unsigned long long)no, (long long)IDEM_TOKEN_MAX);
            return CTL_FAIL;
        }
        st->token_next = x ? x->num : 0;
        return 0;
    }
    const struct jfield *r = jfield_get(f, n, "records"), *a = jfield_get(f, n, "audit_entries");
    if (!r || !r->is_num || !a || !a->is_num || (uint64_t)r->num != st->nrec ||
        (uint64_t)a->num != st->naud) {
        ctl_err("%s:%llu: the end line counts %lld records and %lld audit entries, the file "
                "holds %llu and %llu",
                file, (unsigned long long)no, r && r->is_num ? (long long)r->num : -1LL,
                a && a->is_num ? (long long)a->num : -1LL, (unsigned long long)st->nrec,
                (unsigned long long)st->naud);
        return CTL_FAIL;
    }
    st->ended = 1;
    return 0;
}

/* One line: 0 imported (or skipped), else prints why and returns CTL_FAIL. */
static int import_line(struct ctl *c, const char *file, uint64_t no, const char *text,
                       struct import_state *ist)
{
    char err[128];
    struct jfield *f;
    int n = jsonl_parse(text, &f, err, sizeof err);
    if (n < 0) {
        ctl_err("%s:%llu: %s", file, (unsigned long long)no, err);
        return CTL_FAIL;
    }
    struct line l = {.f = f, .n = n};
    const struct jfield *type = jfield_get(f, n, "type");
    int rc = IDEM_OK;
    /* Audit entries kept go in before any other line: a record, or the end line's counts. */
    if (!(type && type->str && strcmp(type->str, "audit") == 0) && audit_flush(c, file, ist)) {
        jfields_free(f, n);
        return CTL_FAIL;
    }
    if (ist->ended || (no > 1 && !ist->format)) {
        ctl_err("%s:%llu: %s", file, (unsigned long long)no,
                ist->ended ? "a line after the end line" : "the file does not begin with a header");
        jfields_free(f, n);
        return CTL_FAIL;
    }
    if (type && type->str && (!strcmp(type->str, "export") || !strcmp(type->str, "end"))) {
        int header = !strcmp(type->str, "export");
        int frc = import_frame_line(file, no, f, n, type->str, ist);
        jfields_free(f, n);
        if (frc == 0 && header) {
            rc = idem_import_begin(c->q, ist->token_next);
            if (rc != IDEM_OK) {
                ctl_err("%s:%llu: beginning the import: %s", file, (unsigned long long)no,
                        idem_strerror(rc));
                return CTL_FAIL;
            }
        }
        return frc;
    }
    if (!ist->format) {
        ctl_err("%s:%llu: the file does not begin with a header", file, (unsigned long long)no);
        jfields_free(f, n);
        return CTL_FAIL;
    }
    uint64_t *nrec = &ist->nrec, *naud = &ist->naud;
    int said = 0; /* the error was printed with more than its code */
    if (type && type->str && strcmp(type->str, "record") == 0) {
        idem_record r;
        line_record(&l, &r);
        ist->writes += !l.err;
        rc = l.err ? IDEM_EINVAL : idem_import_record(c->q, &r);
        if (rc == IDEM_EINVAL && !l.err && r.result_len > ist->result_max) {
            ctl_err("%s:%llu: field result: %u bytes, over the store's limit of %u (import "
                    "--result-max, as idemd's)",
                    file, (unsigned long long)no, r.result_len, ist->result_max);
            said = 1;
        }
        *nrec += rc == IDEM_OK;
    } else if (type && type->str && strcmp(type->str, "audit") == 0) {
        idem_audit_entry e;
        line_audit(&l, &e);
        int in = !l.err && ist->rerun ? audit_in_already(c, &e) : 0;
        ist->naud_in += in > 0;
        ist->writes += !l.err && !in;
        rc = l.err ? IDEM_EINVAL : in < 0 ? in : IDEM_OK;
        *naud += in > 0 && rc == IDEM_OK;
        if (rc == IDEM_OK && !in && audit_keep(ist, &e, no) < 0) rc = IDEM_ENOMEM;
        if (rc == IDEM_OK && ist->ne == IDEM_IMPORT_AUDIT_MAX && audit_flush(c, file, ist)) {
            said = 1; /* named by audit_flush */
            rc = IDEM_EIO;
        }
    } else {
        l.err = "type";
        rc = IDEM_EINVAL;
    }
    if (rc == IDEM_EINVAL && !l.err && !said && *idem_last_error()) {
        ctl_err("%s:%llu: %s", file, (unsigned long long)no, idem_last_error()); /* names it */
        said = 1;
    }
    if (rc != IDEM_OK && !said)
        ctl_err("%s:%llu: %s%s%s", file, (unsigned long long)no, idem_strerror(rc),
                l.err ? ": field " : "", l.err ? l.err : "");
    for (int i = 0; i < l.nowned; i++)
        free(l.owned[i]);
    jfields_free(f, n);
    return rc == IDEM_OK ? 0 : CTL_FAIL;
}

/* The longest line an export holds: a result at IDEM_RESULT_BYTES_LIMIT written as text with
 * every byte escaped (6 characters), and the rest of the record. */
#define IMPORT_LINE_MAX (6u * IDEM_RESULT_BYTES_LIMIT + (1u << 20))

/* Reads one line into *buf (grown as needed, up to IMPORT_LINE_MAX): 1 with *len set, 0 at the
 * end of the file, -1 for a line longer than that (read no further), -2 for a read error or
 * out of memory (errno says which). */
static int read_line(FILE *in, char **buf, size_t *cap, size_t *len)
{
    size_t n = 0;
    for (int c; (c = getc_unlocked(in)) != EOF;) {
        if (n + 2 > *cap) {
            if (*cap >= IMPORT_LINE_MAX) return -1;
            size_t grown = *cap ? 2 * *cap : 4096;
            if (grown > IMPORT_LINE_MAX) grown = IMPORT_LINE_MAX;
            char *b = realloc(*buf, grown);
            if (!b) return -2;
            *buf = b;
            *cap = grown;
        }
        (*buf)[n++] = (char)c;
        if (c == '\n') break;
    }
    if (ferror(in)) return -2;
    if (n == 0) return 0;
    (*buf)[n] = 0;
    *len = n;
    return 1;
}

/* An entry of a directory that an import takes as empty: a new file system's lost+found is left
 * where it is. */
static int entry_ignored(const char *name)
{
    return !strcmp(name, ".") || !strcmp(name, "..") || !strcmp(name, "lost+found");
}

/* Whether path is a directory with no entries (but lost+found). */
static int dir_empty(const char *path)
{
    DIR *d = opendir(path);
    if (!d) return 0;
    int empty = 1;
    for (struct dirent *de; empty && (de = readdir(d));)
        empty = entry_ignored(de->d_name);
    closedir(d);
    return empty;
}

/* Import writes records as they were, over any record of the same key, and no audit entry for
 * that: into a store that holds keys or decisions it would roll them back unseen. Such a store
 * takes an import only with --force. */
/* Whether the store c has opened holds no key and no operator decision: 1, 0, or -1 when its
 * audit trail could not be read (the error in *err). */
static int store_empty_n(struct ctl *c, uint64_t *keys, size_t *decisions, int *err)
{
    idem_stats st;
    const idem_audit_entry *e = NULL;
    idem_get_stats(c->s, &st);
    *keys = st.keys;
    *decisions = 0;
    *err = idem_audit(c->q, NULL, 0, 1, &e, decisions);
    if (*err != IDEM_OK) return -1;
    return st.keys == 0 && *decisions == 0;
}

static int store_empty(struct ctl *c)
{
    uint64_t keys;
    size_t n;
    int err;
    return store_empty_n(c, &keys, &n, &err);
}

static int import_target_empty(struct ctl *c, const char *dir, int marked)
{
    uint64_t keys;
    size_t n;
    int err, empty = store_empty_n(c, &keys, &n, &err);
    if (empty < 0) {
        ctl_err("cannot read %s: %s", dir, idem_strerror(err));
        return CTL_FAIL;
    }
    if (empty) return 0;
    if (marked) {
        ctl_err("%s holds %s and %llu keys%s: an import into it was cut short; run the import "
                "again with --force to finish it (it writes over the records of the same keys)",
                dir, IDEM_IMPORT_MARKER, (unsigned long long)keys,
                n ? " and operator decisions" : "");
        return CTL_FAIL;
    }
    ctl_err("%s already holds %llu keys%s: import writes over records without an audit entry; "
            "import into a new directory, or pass --force",
            dir, (unsigned long long)keys, n ? " and operator decisions" : "");
    return CTL_FAIL;
}

/* Removes what an import cut short left in its partial directory (import made it all). */
static int rm_one(const char *path, const struct stat *st, int flag, struct FTW *ftw)
{
    (void)st;
    (void)flag;
    (void)ftw;
    return remove(path) < 0 ? -1 : 0;
}

/* Syncs directory dir: the names made or removed in it are durable. 0, or -1 with errno. */
static int dir_synced(const char *dir)
{
    int fd = open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    int rc = fd >= 0 && fsync(fd) == 0 ? 0 : -1;
    if (fd >= 0) {
        int e = errno;
        close(fd);
        errno = e;
    }
    return rc;
}

/* Removes dir/name and makes that durable. */
static int unlink_synced(const char *dir, const char *name)
{
    char path[8200];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    if (unlink(path) < 0 && errno != ENOENT) return -1;
    return dir_synced(dir);
}

/* Empties a directory that was empty before an import into it failed, the store closed, of the
 * files the import made: the store's own names, each a file (nothing else is removed: what
 * someone put there meanwhile stays, and is named in *kept, "" if none). The directory itself
 * stays, with its owner and mode. The store's lock is taken again for it (an idemd started
 * meanwhile is refused, and one that holds it keeps its store), and the marker goes only after
 * every store file, so that no part of an export is ever left unmarked. Returns 0, or -1 with
 * errno (the marker stays). */
static int dir_clear(const char *dir, char *kept, size_t kept_cap)
{
    char lock[8200];
    *kept = 0;
    snprintf(lock, sizeof lock, "%s/LOCK", dir);
    int lfd = open(lock, O_RDWR | O_CLOEXEC | O_NOFOLLOW);
    if (lfd < 0) return -1;
    if (flock(lfd, LOCK_EX | LOCK_NB) < 0) {
        close(lfd);
        return -1;
    }
    DIR *d = opendir(dir);
    int rc = d ? 0 : -1, e = d ? 0 : errno;
    for (struct dirent *de; d && (de = readdir(d));) {
        if (entry_ignored(de->d_name) || !strcmp(de->d_name, "LOCK") ||
            !strcmp(de->d_name, IDEM_IMPORT_MARKER))
            continue;
        if (!idem_store_file_name(de->d_name)) {
            if (!*kept) bytes_escape(de->d_name, strlen(de->d_name), kept, kept_cap);
            continue;
        }
        if (unlinkat(dirfd(d), de->d_name, 0) != 0 && errno != ENOENT) {
            rc = -1;
            e = errno;
        }
    }
    if (d) closedir(d);
    if (rc == 0) rc = dir_synced(dir); /* the store's files gone for good before the marker */
    if (rc == 0) rc = unlink_synced(dir, IDEM_IMPORT_MARKER);
    if (rc == 0) rc = unlink_synced(dir, "LOCK");
    if (rc != 0 && e == 0) e = errno;
    close(lfd);
    errno = e;
    return rc;
}

/* Without --force, a store that exists is looked at read-only first: an import it refuses
 * writes nothing into it (an open to write runs recovery, and a checkpoint at its close). */
static int import_look_first(const struct ctl_opts *oo, const char *dest)
{
    int marked = idem_import_marked(dest);
    if (marked < 0) {
        ctl_err("cannot import into %s: %s", dest, idem_last_error());
        return CTL_FAIL;
    }
    if (marked) {
        ctl_err("%s holds %s: an import into it was cut short; run the import again with --force "
                "to finish it (it writes over the records of the same keys)",
                dest, IDEM_IMPORT_MARKER);
        return CTL_FAIL;
    }
    struct ctl c;
    int rc = ctl_connect(&c, oo, CTL_OFFLINE_READ);
    if (rc == 0) rc = import_target_empty(&c, dest, 0);
    if (c.s) rc = ctl_disconnect(&c, rc);
    return rc;
}

/* Marks the store in dir, opened for an import in place, before the import's first write
 * (marked: it holds the marker of an import cut short already, which stays as it is). */
static int import_mark(struct import_state *ist, const char *dir, int marked)
{
    int err = idem_import_mark(dir);
    if (err != IDEM_OK) {
        ctl_err("cannot mark %s for the import: %s (%s)", dir, idem_last_error(),
                idem_strerror(err));
        return CTL_FAIL;
    }
    ist->rerun = marked;
    return 0;
}

/* After an import in place, the store closed: the marker goes once the whole export is in and
 * the close succeeded (rc 0), or when this run found no marker and handed nothing to the store
 * (it holds what it held). Otherwise it stays, and the store is refused until an import
 * finishes. Returns rc, or CTL_FAIL if the marker could not be removed. */
static int import_unmark(const char *dir, int rc, const struct import_state *ist)
{
    if (rc != 0 && (ist->rerun || ist->writes)) {
        ctl_err("%s keeps its marker %s: idemd refuses the store until an import into it "
                "finishes; import the whole export again with --force (or remove the store and "
                "import into a new directory)",
                dir, IDEM_IMPORT_MARKER);
        return rc;
    }
    int err = idem_import_unmark(dir);
    if (err == IDEM_OK) return rc;
    ctl_err("cannot remove the marker %s/%s: %s (%s)%s", dir, IDEM_IMPORT_MARKER, idem_last_error(),
            idem_strerror(err), rc == 0 ? "; the import is whole: remove the file" : "");
    return CTL_FAIL;
}

/* What an import finds at dest: nothing (absent), an empty directory, or a store; anything else
 * is refused, and nothing is made there. */
static int import_dest_look(const char *dest, int *absent, int *empty_dir)
{
    struct stat st;
    *absent = stat(dest, &st) < 0;
    *empty_dir = 0;
    if (*absent) {
        if (errno == ENOENT) return 0;
        ctl_err("cannot import into %s: %s", dest, strerror(errno));
        return CTL_FAIL;
    }
    if (!S_ISDIR(st.st_mode)) {
        ctl_err("cannot import into %s: not a directory", dest);
        return CTL_FAIL;
    }
    if ((*empty_dir = dir_empty(dest))) return 0;
    char super[4200];
    snprintf(super, sizeof super, "%s/super", dest);
    if (stat(super, &st) == 0) return 0;
    /* Files but no store (a mistyped --dir): a store is made in no such place. */
    ctl_err("%s holds files but no store (no superblock file 'super'): give a new or empty "
            "directory, or a store's",
            dest);
    return CTL_FAIL;
}

/* Into a directory that does not exist, the store is made in DIR.partial and renamed to DIR
 * once the whole file is in and the store is closed: DIR never holds an import cut short. An
 * existing directory (empty, or a store with --force) is written in place, marked
 * (IDEM_IMPORT_MARKER) from before the first write until the store is closed after the last;
 * one that was empty (a mount point, a directory made for the service's user) keeps its inode,
 * owner and mode, and is emptied again if the import fails. */
int cmd_import(const struct ctl_opts *o)
{
    struct ctl_opts oo;
    int rc = offline_opts(o, &oo, "import");
    if (rc) return rc;
    const char *file = o->pos[0];
    char dest[4096], partial[4200];
    if (strlen(oo.dir) >= sizeof dest - sizeof ".partial") { /* cut, it could name another */
        ctl_err("--dir is longer than %zu bytes", sizeof dest - sizeof ".partial" - 1);
        return CTL_USAGE;
    }
    snprintf(dest, sizeof dest, "%s", oo.dir);
    for (size_t n = strlen(dest); n > 1 && dest[n - 1] == '/'; n--)
        dest[n - 1] = 0;
    snprintf(partial, sizeof partial, "%s.partial", dest);
    /* A DIR that is absent is made as DIR.partial: a file found bad part-way leaves nothing.
     * Into an empty directory or a store that exists (empty, or holding keys with --force),
     * records are written as they are read. */
    int absent, empty_dir;
    if (import_dest_look(dest, &absent, &empty_dir) != 0) return CTL_FAIL;
    int staged = absent;
    FILE *in = strcmp(file, "-") == 0 ? stdin : fopen(file, "r");
    if (!in) {
        ctl_err("cannot read %s: %s", file, strerror(errno));
        return CTL_FAIL;
    }
    if (staged && mkdir(partial, 0700) < 0) {
        if (errno == EEXIST)
            ctl_err("%s exists: an import into %s was cut short there; remove it, then import "
                    "again",
                    partial, dest);
        else
            ctl_err("cannot create %s: %s", partial, strerror(errno));
        if (in != stdin) fclose(in);
        return CTL_FAIL;
    }
    if (staged) oo.dir = partial;
    struct ctl c = {0}; /* ctl_connect is not run when the look first refuses */
    struct import_state ist = {.result_max = o->result_max ? (uint32_t)o->result_max
                                                           : IDEM_RESULT_BYTES_DEFAULT};
    rc = !staged && !empty_dir && !o->force ? import_look_first(&oo, dest) : 0;
    if (rc == 0) rc = ctl_connect(&c, &oo, CTL_CREATE);
    /* In place, from here on the store is open: its lock is held. Into an empty directory the
     * store is this run's own if the open found it empty: only such a store is taken out again
     * when the import fails (one made there meanwhile, by idemd or another import, is not). */
    int marked = rc == 0 && !staged ? idem_import_marked(dest) : 0, marking = 0;
    int own = rc == 0 && empty_dir && marked == 0 && store_empty(&c) == 1;
    if (marked < 0) {
        ctl_err("cannot import into %s: %s", dest, idem_last_error());
        rc = CTL_FAIL;
    }
    if (rc == 0 && !o->force) rc = import_target_empty(&c, oo.dir, marked);
    if (rc == 0 && !staged) {
        rc = import_mark(&ist, dest, marked);
        marking = rc == 0;
    }
    char *text = NULL;
    size_t cap = 0;
    uint64_t no = 0;
    for (size_t len; rc == 0;) {
        int got = read_line(in, &text, &cap, &len);
        if (got == 0) break;
        no++;
        if (got == -1) {
            ctl_err("%s:%llu: a line longer than %u bytes: no export writes one", file,
                    (unsigned long long)no, IMPORT_LINE_MAX);
            rc = CTL_FAIL;
        } else if (got == -2) {
            ctl_err("cannot read %s: %s", file, strerror(errno));
            rc = CTL_FAIL;
        } else if (memchr(text, 0, len)) {
            ctl_err("%s:%llu: a NUL byte in the line: not JSON", file, (unsigned long long)no);
            rc = CTL_FAIL;
        } else if (text[strspn(text, " \t\r\n")] != 0) {
            rc = import_line(&c, file, no, text, &ist);
        }
    }
    if (rc == 0 && ist.ne) rc = audit_flush(&c, file, &ist); /* an export of format 1 ends so */
    audit_drop(&ist);
    if (rc == 0 && !ist.format) {
        ctl_err("%s: no export header (an empty file?)", file);
        rc = CTL_FAIL;
    }
    if (rc == 0 && ist.format >= 2 && !ist.ended) {
        ctl_err("%s: the export ends without its end line: it was cut short (%llu records and "
                "%llu audit entries read), and is not imported",
                file, (unsigned long long)ist.nrec, (unsigned long long)ist.naud);
        rc = CTL_FAIL;
    }
    free(text);
    if (in != stdin) fclose(in);
    if (c.s || c.online) rc = ctl_disconnect(&c, rc);
    if (staged && rc == 0 && renameat2(AT_FDCWD, partial, AT_FDCWD, dest, RENAME_NOREPLACE) < 0) {
        ctl_err("cannot rename %s to %s: %s", partial, dest, strerror(errno));
        rc = CTL_FAIL;
    }
    if (staged && rc == 0) { /* the name, durable */
        char parent[4096];
        snprintf(parent, sizeof parent, "%s", dest);
        char *slash = strrchr(parent, '/');
        if (!slash)
            snprintf(parent, sizeof parent, ".");
        else
            slash[slash == parent] = 0;
        int fd = open(parent, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
        if (fd < 0 || fsync(fd) < 0) {
            ctl_err("the store is in place at %s, but the sync of its directory %s failed: %s; "
                    "its name may not survive a power loss (sync the file system before "
                    "relying on it; a second import into it is refused, as it holds keys)",
                    dest, parent, strerror(errno));
            rc = CTL_FAIL;
        }
        if (fd >= 0) close(fd);
    }
    if (staged && rc != 0) nftw(partial, rm_one, 16, FTW_DEPTH | FTW_PHYS);
    if (own && marking && rc != 0) {
        char kept[256];
        if (dir_clear(dest, kept, sizeof kept) != 0)
            ctl_err("cannot empty %s again after the failed import: %s; it keeps its marker %s "
                    "(idemd refuses it): remove what it holds but lost+found",
                    dest, strerror(errno), IDEM_IMPORT_MARKER);
        else if (*kept)
            ctl_err("%s was emptied of the import's files; %s, which the import did not make, "
                    "was left in place",
                    dest, kept);
        marking = 0;
    } else if (!staged && rc != 0 && ist.nrec + ist.naud > 0)
        ctl_err("%llu records and %llu audit entries read before that were written into the "
                "store %s, which existed (it is written in place), and stay there",
                (unsigned long long)ist.nrec, (unsigned long long)ist.naud, dest);
    if (marking) rc = import_unmark(dest, rc, &ist);
    if (rc == 0 && o->json)
        printf("{\"records\":%llu,\"audit_entries\":%llu}\n", (unsigned long long)ist.nrec,
               (unsigned long long)ist.naud);
    else if (rc == 0)
        printf("imported %llu records and %llu audit entries%s\n", (unsigned long long)ist.nrec,
               (unsigned long long)ist.naud,
               ist.naud_in ? " (some audit entries were in already, from the import cut short)"
                           : "");
    return rc;
}
