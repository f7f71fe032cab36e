/*
 * backend.c: how idemctl reaches a store. Online: idemd over its unix socket or TCP, with the
 * RESP commands of the contract (IDEM.GET, IDEM.STATS, IDEM.SCAN, IDEM.AUDIT, IDEM.RESOLVE)
 * and IDEM.ATTENTION. Offline: a stopped store directory through include/idem.h, opened
 * read-only for reads, exports and backups (no recovery, no checkpoint: the files are left as
 * they are) and read-write for changes. Only import may make a new store; every other command
 * refuses a directory that holds none. Both produce the same records, stats and audit entries,
 * with their bytes owned by the caller.
 */
#include <errno.h>
#include <pwd.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "ctl.h"

/* ---- Records with owned bytes ---- */

static int record_own(struct ctl_record *out, const idem_record *src)
{
    size_t total = (size_t)src->key_len + src->owner_len + src->result_len + src->note_len + 4;
    out->r = *src;
    out->mem = malloc(total);
    if (!out->mem) return -1;
    char *m = out->mem;
    const struct {
        const void *p;
        uint32_t n;
        const void **dst;
    } parts[] = {{src->key, src->key_len, &out->r.key},
                 {src->owner, src->owner_len, &out->r.owner},
                 {src->result, src->result_len, &out->r.result},
                 {src->note, src->note_len, &out->r.note}};
    for (size_t i = 0; i < 4; i++) {
        if (!parts[i].p) {
            *parts[i].dst = NULL;
            continue;
        }
        memcpy(m, parts[i].p, parts[i].n);
        m[parts[i].n] = 0;
        *parts[i].dst = m;
        m += parts[i].n + 1;
    }
    return 0;
}

void ctl_record_free(struct ctl_record *r)
{
    free(r->mem);
    r->mem = NULL;
}

void ctl_records_free(struct ctl_record *recs, size_t n)
{
    for (size_t i = 0; recs && i < n; i++)
        ctl_record_free(&recs[i]);
    free(recs);
}

void ctl_audit_free(struct ctl_audit *a, size_t n)
{
    for (size_t i = 0; a && i < n; i++)
        free(a[i].mem);
    free(a);
}

static int audit_own(struct ctl_audit *out, const idem_audit_entry *e)
{
    size_t al = strlen(e->actor ? e->actor : ""), acl = strlen(e->action ? e->action : "");
    size_t rl = strlen(e->reason ? e->reason : "");
    out->e = *e;
    uint32_t res = e->flags & IDEM_AUDIT_RESULT && e->result ? e->result_len : 0;
    out->mem = malloc(al + acl + rl + e->key_len + res + 4);
    if (!out->mem) return -1;
    char *m = out->mem;
    memcpy(m, e->actor ? e->actor : "", al + 1);
    out->e.actor = m;
    m += al + 1;
    memcpy(m, e->action ? e->action : "", acl + 1);
    out->e.action = m;
    m += acl + 1;
    memcpy(m, e->reason ? e->reason : "", rl + 1);
    out->e.reason = m;
    m += rl + 1;
    memcpy(m, e->key, e->key_len);
    m[e->key_len] = 0;
    out->e.key = m;
    m += e->key_len + 1;
    if (res) memcpy(m, e->result, res);
    out->e.result = m;
    out->e.result_len = res;
    return 0;
}

/* ---- Connecting ---- */

static int read_password_file(const char *path, char *out, size_t cap)
{
    FILE *f = fopen(path, "r");
    if (!f) {
        ctl_err("cannot read password file %s: %s", path, strerror(errno));
        return -1;
    }
    if (!fgets(out, (int)cap, f)) out[0] = 0;
    fclose(f);
    out[strcspn(out, "\r\n")] = 0;
    return 0;
}

/* Prints an error reply of idemd with what it means for the operator (escaped, as keys are:
 * a reply's bytes do not reach the terminal as they are). */
static void reply_error(const resp_value *v, const char *what)
{
    char m[1024];
    bytes_escape(v->str ? v->str : "", v->str ? v->len : 0, m, sizeof m);
    if (strncmp(m, "NOPERM", 6) == 0)
        ctl_err("%s: idemd refused it for this user's role (%s); read commands need the reader "
                "role, resolve needs admin",
                what, m);
    else if (strncmp(m, "NOAUTH", 6) == 0 || strncmp(m, "WRONGPASS", 9) == 0)
        ctl_err("%s: %s (pass --user and --password or --password-file)", what, m);
    else
        ctl_err("%s: %s", what, m);
}

static int online_auth(struct ctl *c, const struct ctl_opts *o)
{
    const char *env = getenv("IDEMCTL_PASSWORD");
    int env_only = !o->user && !o->password && !o->password_file;
    if (env_only && (!env || !*env)) return 0;
    char pw[1024];
    const char *pass = o->password ? o->password : env;
    if (o->password_file) {
        if (read_password_file(o->password_file, pw, sizeof pw) < 0) return CTL_FAIL;
        pass = pw;
    }
    if (!pass) {
        ctl_err("--user needs --password, --password-file or IDEMCTL_PASSWORD");
        return CTL_FAIL;
    }
    const char *argv[3] = {"AUTH", o->user ? o->user : pass, pass};
    resp_value *v;
    if (resp_command(&c->conn, o->user ? 3 : 2, argv, NULL, &v) < 0) {
        ctl_err("%s", c->conn.err);
        return CTL_FAIL;
    }
    int rc = v->type == RESP_ERROR ? CTL_FAIL : 0;
    /* The variable alone, against an idemd without users (the unix socket is then admin):
     * nothing to authenticate, as redis-cli takes it. */
    if (rc && env_only && v->str && strstr(v->str, "without any password configured"))
        rc = 0;
    else if (rc)
        reply_error(v, "authentication failed");
    resp_free(v);
    return rc;
}

static int online_connect(struct ctl *c, const struct ctl_opts *o)
{
    c->online = 1;
    int rc = o->host || o->port
                 ? resp_connect_tcp(&c->conn, o->host ? o->host : "127.0.0.1",
                                    o->port ? o->port : 7379, o->timeout_ms)
                 : resp_connect_unix(&c->conn, o->socket ? o->socket : CTL_DEFAULT_SOCKET,
                                     o->timeout_ms);
    if (rc < 0) {
        ctl_err("%s (is idemd running? for a stopped store use --dir DIR)", c->conn.err);
        return CTL_FAIL;
    }
    return online_auth(c, o);
}

void ctl_open_error(const char *dir, int rc)
{
    /* Refused for readers alone (inspections that opened it read-only), the engine's sentence
     * says to wait for them: no idemd holds the store then, and --socket would reach none. */
    if (rc == IDEM_ELOCKED && strstr(idem_last_error(), "is being read by another process"))
        ctl_err("%s", idem_last_error());
    else if (rc == IDEM_ELOCKED)
        ctl_err("%s; idemd (or another program) holds the store: stop it, or reach it with "
                "--socket PATH",
                idem_last_error());
    else
        ctl_err("cannot open store %s: %s (%s)", dir, idem_last_error(), idem_strerror(rc));
}

/* Who acts offline, as the audit trail names it: the effective uid and its name (not $USER,
 * which any caller sets), the sudo caller where root runs it by sudo, and the host:
 * offline:uid=0(root),sudo=alice@host. Returns snprintf's count. */
static int offline_actor(char *buf, size_t cap)
{
    char host[128] = "";
    gethostname(host, sizeof host - 1);
    uid_t uid = geteuid();
    const struct passwd *pw = getpwuid(uid);
    const char *sudo = uid == 0 ? getenv("SUDO_USER") : NULL;
    return snprintf(buf, cap, "offline:uid=%u%s%s%s%s%s@%s", (unsigned)uid, pw ? "(" : "",
                    pw ? pw->pw_name : "", pw ? ")" : "", sudo && *sudo ? ",sudo=" : "",
                    sudo && *sudo ? sudo : "", host);
}

static int offline_open(struct ctl *c, const struct ctl_opts *o, int access)
{
    const char *dir = o->dir ? o->dir : CTL_DEFAULT_DIR;
    struct stat st;
    int missing = stat(dir, &st) < 0;
    if (missing || !S_ISDIR(st.st_mode)) {
        ctl_err("%s is not a store directory: %s", dir, strerror(missing ? errno : ENOTDIR));
        return CTL_FAIL;
    }
    /* A writable open would make a new store in a directory without one (a mistyped --dir):
     * only import may. */
    char super[4200];
    snprintf(super, sizeof super, "%s/super", dir);
    if (access != CTL_CREATE && stat(super, &st) < 0) {
        ctl_err("%s holds no store (no superblock file 'super': %s)", dir, strerror(errno));
        return CTL_FAIL;
    }
    int n = offline_actor(c->actor, sizeof c->actor);
    if (access == CTL_WRITE && (n < 0 || (unsigned)n > IDEM_ACTOR_BYTES_MAX)) {
        ctl_err("the audit trail names who acts (%s), here %d bytes, over the limit of %u",
                c->actor, n, (unsigned)IDEM_ACTOR_BYTES_MAX);
        return CTL_FAIL;
    }
    idem_options opt;
    idem_options_init(&opt);
    opt.read_only = access == CTL_READ || access == CTL_OFFLINE_READ;
    /* Only import may take a store that an import cut short (IDEM_IMPORT_MARKER): to finish. */
    opt.importing = access == CTL_CREATE;
    /* An import's records need not each wait for a flush of their own (a store of 10 M keys
     * took 10 M flushes): the marker, or the directory's .partial name, covers a crash part-way,
     * and the close makes everything durable before the import is called done. */
    if (access == CTL_CREATE) opt.durability = IDEM_DURABILITY_BATCH;
    if (o->result_max) opt.result_bytes_max = (uint32_t)o->result_max;
    int rc = idem_open(dir, &opt, &c->s);
    if (rc != IDEM_OK) {
        ctl_open_error(dir, rc);
        return CTL_FAIL;
    }
    if (idem_queue_open(c->s, 8, &c->q) != IDEM_OK) {
        ctl_err("cannot open a queue on %s", dir);
        idem_close(c->s); /* the caller has no store to close (ctl_disconnect is not run) */
        c->s = NULL;
        return CTL_FAIL;
    }
    return 0;
}

int ctl_connect(struct ctl *c, const struct ctl_opts *o, int access)
{
    memset(c, 0, sizeof *c);
    c->conn.fd = -1;
    c->o = o;
    int explicit_online = o->socket || o->host || o->port;
    if (o->dir && explicit_online) {
        ctl_err("give either --dir (a stopped store) or --socket/--host (idemd), not both");
        return CTL_USAGE;
    }
    if (access >= CTL_OFFLINE) {
        if (explicit_online) {
            ctl_err("this command works on a stopped store only: stop idemd and pass --dir DIR");
            return CTL_USAGE;
        }
        return offline_open(c, o, access);
    }
    return o->dir ? offline_open(c, o, access) : online_connect(c, o);
}

static int disconnect(struct ctl *c, int rc, int acked)
{
    if (c->online) resp_close(&c->conn);
    if (c->q) idem_queue_close(c->q);
    if (c->s) {
        int err = idem_close(c->s);
        if (err != IDEM_OK && acked && rc == CTL_OK)
            ctl_err("closing the store: %s (%s); what was done is durable in its log all the "
                    "same, and the next open replays it",
                    idem_strerror(err), idem_last_error());
        else if (err != IDEM_OK) {
            ctl_err("closing the store: %s (%s)", idem_strerror(err), idem_last_error());
            if (rc == CTL_OK) rc = CTL_FAIL;
        }
    }
    memset(c, 0, sizeof *c);
    return rc;
}

int ctl_disconnect(struct ctl *c, int rc)
{
    return disconnect(c, rc, 0);
}

int ctl_disconnect_acked(struct ctl *c, int rc)
{
    return disconnect(c, rc, 1);
}

/* Sends a command; prints and returns CTL_FAIL on I/O failure. Error replies are returned. */
static int call(struct ctl *c, resp_value **out, int argc, const char *const *argv,
                const size_t *argl)
{
    if (resp_command(&c->conn, argc, argv, argl, out) < 0) {
        ctl_err("%s", c->conn.err);
        return CTL_FAIL;
    }
    return 0;
}

/* Like call, but an error reply is printed and fails too. */
static int call_ok(struct ctl *c, resp_value **out, int argc, const char *const *argv,
                   const size_t *argl)
{
    if (call(c, out, argc, argv, argl)) return CTL_FAIL;
    if ((*out)->type == RESP_ERROR) {
        reply_error(*out, argv[0]);
        resp_free(*out);
        *out = NULL;
        return CTL_FAIL;
    }
    return 0;
}

/* ---- Online replies into records ---- */

static int64_t val_i64(const resp_value *v)
{
    if (!v) return 0;
    if (v->type == RESP_INTEGER) return v->integer;
    return v->str ? strtoll(v->str, NULL, 10) : 0;
}

static uint64_t val_u64(const resp_value *v)
{
    if (!v) return 0;
    if (v->type == RESP_INTEGER) return (uint64_t)v->integer;
    return v->str ? strtoull(v->str, NULL, 10) : 0;
}

static int state_of(const char *s)
{
    if (!s) return 0;
    for (int i = IDEM_STATE_IN_FLIGHT; i <= IDEM_STATE_REVIEW; i++)
        if (strcmp(s, idem_state_name(i)) == 0) return i;
    return 0;
}

static void blob(const resp_value *arr, const char *name, const void **p, uint32_t *n)
{
    const resp_value *v = resp_field(arr, name);
    *p = v && v->type == RESP_BULK ? v->str : NULL;
    *n = v && v->type == RESP_BULK ? (uint32_t)v->len : 0;
}

/* An IDEM.GET-style flat field/value array into an owned record. */
static int record_from_flat(const resp_value *a, struct ctl_record *out)
{
    idem_record r;
    memset(&r, 0, sizeof r);
    if (!a || a->type != RESP_ARRAY) return -1;
    blob(a, "key", &r.key, &r.key_len);
    const resp_value *st = resp_field(a, "state");
    r.state = state_of(st ? st->str : NULL);
    if (!r.key || !r.state) return -1;
    r.first_seen_ms = val_i64(resp_field(a, "first_seen_ms"));
    r.expires_at_ms = val_i64(resp_field(a, "expires_at_ms"));
    r.last_seen_ms = val_i64(resp_field(a, "last_seen_ms"));
    r.seen_count = val_u64(resp_field(a, "seen_count"));
    const resp_value *fp = resp_field(a, "fingerprint");
    r.has_fp = fp && fp->str && parse_hex(fp->str, r.fp, IDEM_FP_BYTES) == 0;
    r.lease_until_ms = val_i64(resp_field(a, "lease_until_ms"));
    r.token = val_i64(resp_field(a, "token"));
    blob(a, "owner", &r.owner, &r.owner_len);
    r.attempts = (uint32_t)val_u64(resp_field(a, "attempts"));
    r.last_grant_ms = val_i64(resp_field(a, "last_grant_ms"));
    blob(a, "result", &r.result, &r.result_len);
    blob(a, "note", &r.note, &r.note_len);
    r.mismatch_count = val_u64(resp_field(a, "mismatch_count"));
    r.last_mismatch_ms = val_i64(resp_field(a, "last_mismatch_ms"));
    const resp_value *mfp = resp_field(a, "last_mismatch_fp");
    r.has_last_mismatch_fp =
        mfp && mfp->str && parse_hex(mfp->str, r.last_mismatch_fp, IDEM_FP_BYTES) == 0;
    r.version = val_u64(resp_field(a, "version"));
    return record_own(out, &r);
}

int ctl_get(struct ctl *c, const void *key, size_t klen, struct ctl_record *out, int *found)
{
    memset(out, 0, sizeof *out);
    *found = 0;
    if (!c->online) {
        idem_completion comp;
        int rc = idem_get(c->q, key, klen, &comp);
        if (rc != IDEM_OK) {
            ctl_err("get: %s", idem_strerror(rc));
            return CTL_FAIL;
        }
        *found = comp.found;
        return comp.found && record_own(out, &comp.record) < 0 ? CTL_FAIL : 0;
    }
    const char *argv[2] = {"IDEM.GET", key};
    size_t argl[2] = {8, klen};
    resp_value *v;
    if (call_ok(c, &v, 2, argv, argl)) return CTL_FAIL;
    int rc = 0;
    if (v->type == RESP_ARRAY) {
        *found = 1;
        if (record_from_flat(v, out) < 0) {
            ctl_err("IDEM.GET: idemd sent a record without key or state");
            rc = CTL_FAIL;
        }
    }
    resp_free(v);
    return rc;
}

/* ---- Stats ---- */

#define STAT_U(name)                                                                               \
    {                                                                                              \
#name, offsetof(idem_stats, name), 0                                                       \
    }
#define STAT_I(name)                                                                               \
    {                                                                                              \
#name, offsetof(idem_stats, name), 1                                                       \
    }
#define STAT_INT(name)                                                                             \
    {                                                                                              \
#name, offsetof(idem_stats, name), 2                                                       \
    }

static const struct {
    const char *name;
    size_t off;
    int kind; /* 0 u64, 1 i64, 2 int */
} stat_names[] = {
    STAT_U(keys),
    STAT_U(keys_in_flight),
    STAT_U(keys_committed),
    STAT_U(keys_review),
    STAT_U(claims_new),
    STAT_U(claims_busy),
    STAT_U(claims_done),
    STAT_U(claims_mismatch),
    STAT_U(claims_recover),
    STAT_U(claims_review),
    STAT_U(mismatches),
    STAT_U(recoveries),
    STAT_U(conflicting_commits),
    STAT_U(expired_total),
    STAT_I(oldest_in_flight_ms),
    STAT_I(oldest_review_ms),
    STAT_U(wal_bytes),
    STAT_U(disk_bytes),
    STAT_U(disk_free_bytes),
    STAT_U(memory_bytes),
    STAT_U(index_bytes),
    STAT_U(max_keys),
    STAT_U(max_memory_bytes),
    STAT_U(max_disk_bytes),
    STAT_U(flushes),
    STAT_U(flush_records),
    STAT_U(flush_latency_us_sum),
    STAT_I(clock_skew_ms),
    STAT_I(store_clock_ms),
    STAT_U(checkpoints),
    STAT_U(compactions),
    STAT_INT(fatal),
    STAT_INT(loading),
    STAT_U(store_generation),
    STAT_U(keys_with_mismatch),
    STAT_U(frames_replayed),
    STAT_U(open_ms),
    STAT_U(claims_last_minute),
    STAT_U(duplicates_last_minute),
};

static void stat_set(struct ctl_stats *st, const char *name, int64_t v)
{
    for (size_t i = 0; i < sizeof stat_names / sizeof stat_names[0]; i++) {
        if (strcmp(name, stat_names[i].name) != 0) continue;
        char *p = (char *)&st->s + stat_names[i].off;
        if (stat_names[i].kind == 2)
            *(int *)p = (int)v;
        else
            memcpy(p, &v, 8);
        if (strcmp(name, "keys_with_mismatch") == 0) st->has_keys_with_mismatch = 1;
        if (strcmp(name, "claims_last_minute") == 0) st->has_last_minute = 1;
        return;
    }
    int b;
    if (sscanf(name, "flush_latency_us_bucket_%d", &b) == 1 && b >= 0 && b < 16) {
        st->s.flush_latency_us_buckets[b] = (uint64_t)v;
        st->has_buckets = 1;
    } else if (strcmp(name, "connected_clients") == 0) {
        st->connected_clients = v;
    }
}

static int stats_get(struct ctl *c, struct ctl_stats *st, int loading_ok)
{
    memset(st, 0, sizeof *st);
    st->connected_clients = -1;
    if (!c->online) {
        idem_get_stats(c->s, &st->s);
        st->has_buckets = st->has_keys_with_mismatch = st->has_last_minute = 1;
        return 0;
    }
    const char *argv[1] = {"IDEM.STATS"};
    resp_value *v;
    if (call(c, &v, 1, argv, NULL)) return CTL_FAIL;
    if (loading_ok && v->type == RESP_ERROR && v->str && strncmp(v->str, "LOADING", 7) == 0) {
        st->loading = st->s.loading = 1;
        resp_free(v);
        return 0;
    }
    if (v->type == RESP_ERROR) {
        reply_error(v, argv[0]);
        resp_free(v);
        return CTL_FAIL;
    }
    if (v->type != RESP_ARRAY) { /* not all-zero counts */
        ctl_err("IDEM.STATS: unexpected reply (not a list)");
        resp_free(v);
        return CTL_FAIL;
    }
    for (size_t i = 0; i + 1 < v->n; i += 2)
        if (v->elems[i].str) stat_set(st, v->elems[i].str, val_i64(&v->elems[i + 1]));
    resp_free(v);
    return 0;
}

int ctl_stats(struct ctl *c, struct ctl_stats *st)
{
    return stats_get(c, st, 0);
}

int ctl_stats_or_loading(struct ctl *c, struct ctl_stats *st)
{
    return stats_get(c, st, 1);
}

int ctl_now(struct ctl *c, int64_t *now_ms)
{
    if (!c->online) {
        *now_ms = idem_clock_now(c->s);
        return 0;
    }
    struct ctl_stats st;
    if (ctl_stats(c, &st)) return CTL_FAIL;
    *now_ms = st.s.store_clock_ms;
    return 0;
}

/* ---- Attention, scan, audit ---- */

static int attention_online(struct ctl *c, int64_t older_ms, uint32_t max, struct ctl_record **recs,
                            size_t *n)
{
    char older[32], count[32];
    snprintf(older, sizeof older, "%lld", (long long)older_ms);
    snprintf(count, sizeof count, "%u", max);
    const char *argv[6] = {"IDEM.ATTENTION", "OLDER", older, "COUNT", count, "WITHCUT"};
    resp_value *v;
    if (call(c, &v, 6, argv, NULL)) return CTL_FAIL;
    int said_cut = 1;
    if (v->type == RESP_ERROR && v->str && strstr(v->str, "syntax error")) {
        /* An idemd before WITHCUT: its list may be cut to its reply room without a word. */
        resp_free(v);
        if (call(c, &v, 5, argv, NULL)) return CTL_FAIL;
        said_cut = 0;
    }
    if (v->type == RESP_ERROR) {
        if (v->str && strstr(v->str, "unknown command"))
            ctl_err("this idemd has no IDEM.ATTENTION command yet; stop it and use --dir, or "
                    "upgrade idemd");
        else
            reply_error(v, "IDEM.ATTENTION");
        resp_free(v);
        return CTL_FAIL;
    }
    /* [cut, [records]] (WITHCUT), or the records alone from an idemd before it. */
    const resp_value *list = v;
    if (said_cut && (v->type != RESP_ARRAY || v->n != 2 || v->elems[0].type != RESP_INTEGER ||
                     v->elems[1].type != RESP_ARRAY))
        list = NULL;
    else if (said_cut)
        list = &v->elems[1];
    if (!list || list->type != RESP_ARRAY) { /* not "nothing needs attention" */
        ctl_err("IDEM.ATTENTION: unexpected reply (not a list)");
        resp_free(v);
        return CTL_FAIL;
    }
    c->attention_cut = said_cut && v->elems[0].integer != 0;
    if (c->attention_cut)
        fprintf(stderr, "idemctl: idemd cut the list to fit its reply (--client-output-max, or "
                        "the memory it has left): more may need attention\n");
    int rc = 0;
    *n = 0;
    *recs = calloc(list->n ? list->n : 1, sizeof **recs);
    for (size_t i = 0; *recs && i < list->n && rc == 0; i++) {
        if (record_from_flat(&list->elems[i], &(*recs)[*n]) < 0) {
            ctl_err("IDEM.ATTENTION: entry %zu is not a record", i);
            rc = CTL_FAIL;
        } else {
            (*n)++;
        }
    }
    resp_free(v);
    return *recs ? rc : CTL_FAIL;
}

int ctl_attention(struct ctl *c, int64_t older_ms, uint32_t max, struct ctl_record **recs,
                  size_t *n)
{
    *recs = NULL;
    *n = 0;
    if (c->online) return attention_online(c, older_ms, max, recs, n);
    /* Bounded as idemd bounds its reply (--client-output-max's default): results of up to a
     * result limit each, listed by the thousand, held twice (the queue's and the copies). */
    idem_attention_args a = {.older_ms = older_ms, .max = max, .max_bytes = CTL_ATTENTION_BYTES};
    const idem_record *r;
    size_t k;
    int rc = idem_attention(c->q, &a, &r, &k);
    if (rc != IDEM_OK) {
        ctl_err("attention: %s", idem_strerror(rc));
        return CTL_FAIL;
    }
    *recs = calloc(k ? k : 1, sizeof **recs);
    if (!*recs) return CTL_FAIL;
    uint64_t bytes = 0;
    for (size_t i = 0; i < k; i++) {
        bytes += r[i].key_len + r[i].owner_len + r[i].note_len + r[i].result_len;
        if (record_own(&(*recs)[(*n)++], &r[i]) < 0) return CTL_FAIL;
    }
    c->attention_cut = bytes >= a.max_bytes;
    if (c->attention_cut)
        fprintf(stderr,
                "idemctl: the list ends at %llu MiB of keys, notes and results: more may need "
                "attention\n",
                (unsigned long long)(a.max_bytes >> 20));
    return 0;
}

int ctl_scan_step(struct ctl *c, uint64_t *cursor, int state, int64_t older_ms,
                  void (*fn)(void *ctx, const void *key, size_t klen), void *ctx)
{
    if (!c->online) {
        idem_scan_args a = {.cursor = *cursor, .state = state, .older_ms = older_ms, .count = 1000};
        const void **keys;
        const uint32_t *lens;
        size_t n;
        int rc = idem_scan(c->q, &a, cursor, &keys, &lens, &n);
        if (rc != IDEM_OK) {
            ctl_err("scan: %s", idem_strerror(rc));
            return CTL_FAIL;
        }
        for (size_t i = 0; i < n; i++)
            fn(ctx, keys[i], lens[i]);
        return 0;
    }
    char cur[32], older[32];
    snprintf(cur, sizeof cur, "%llu", (unsigned long long)*cursor);
    snprintf(older, sizeof older, "%lld", (long long)older_ms);
    const char *argv[8] = {"IDEM.SCAN", cur, "COUNT", "1000"};
    int argc = 4;
    if (state) {
        argv[argc++] = "STATE";
        argv[argc++] = idem_state_name(state);
    }
    if (older_ms) {
        argv[argc++] = "OLDER";
        argv[argc++] = older;
    }
    resp_value *v;
    if (call_ok(c, &v, argc, argv, NULL)) return CTL_FAIL;
    if (v->type != RESP_ARRAY || v->n != 2 || v->elems[1].type != RESP_ARRAY) {
        ctl_err("IDEM.SCAN: unexpected reply");
        resp_free(v);
        return CTL_FAIL;
    }
    for (size_t i = 0; i < v->elems[1].n; i++)
        if (v->elems[1].elems[i].type != RESP_BULK) {
            ctl_err("IDEM.SCAN: unexpected reply (a key that is not a bulk string)");
            resp_free(v);
            return CTL_FAIL;
        }
    *cursor = val_u64(&v->elems[0]);
    for (size_t i = 0; i < v->elems[1].n; i++)
        fn(ctx, v->elems[1].elems[i].str, v->elems[1].elems[i].len);
    resp_free(v);
    return 0;
}

static int state_or_absent(const resp_value *v)
{
    return v && v->str ? state_of(v->str) : 0;
}

static int audit_online(struct ctl *c, const void *key, size_t klen, uint32_t count,
                        struct ctl_audit **out, size_t *n)
{
    char cnt[32];
    snprintf(cnt, sizeof cnt, "%u", count);
    const char *argv[5] = {"IDEM.AUDIT", "COUNT", cnt, "KEY", key};
    size_t argl[5] = {10, 5, strlen(cnt), 3, klen};
    resp_value *v;
    if (call_ok(c, &v, key ? 5 : 3, argv, argl)) return CTL_FAIL;
    if (v->type != RESP_ARRAY) { /* not "no decisions recorded" */
        ctl_err("IDEM.AUDIT: unexpected reply (not a list)");
        resp_free(v);
        return CTL_FAIL;
    }
    *out = calloc(v->n ? v->n : 1, sizeof **out);
    for (size_t i = 0; *out && i < v->n; i++) {
        const resp_value *a = &v->elems[i];
        const resp_value *f;
        idem_audit_entry e = {0};
        e.seq = val_u64(resp_field(a, "seq"));
        e.at_ms = val_i64(resp_field(a, "at_ms"));
        e.actor = (f = resp_field(a, "actor")) && f->str ? f->str : "";
        e.action = (f = resp_field(a, "action")) && f->str ? f->str : "";
        e.reason = (f = resp_field(a, "reason")) && f->str ? f->str : "";
        blob(a, "key", &e.key, &e.key_len);
        e.state_before = state_or_absent(resp_field(a, "state_before"));
        e.state_after = state_or_absent(resp_field(a, "state_after"));
        e.version_before = val_u64(resp_field(a, "version_before"));
        e.version_after = val_u64(resp_field(a, "version_after"));
        e.flags = (val_u64(resp_field(a, "forced")) ? IDEM_AUDIT_FORCED : 0) |
                  (val_u64(resp_field(a, "lease_lapsed")) ? IDEM_AUDIT_LEASE_LAPSED : 0);
        if ((f = resp_field(a, "result_len"))) { /* an idemd before them sends none */
            e.flags |= IDEM_AUDIT_RESULT;
            blob(a, "result", &e.result, &e.result_len);
            e.result_full_len = (uint32_t)val_u64(f);
        }
        if (!e.key) e.key = "";
        if (audit_own(&(*out)[*n], &e) < 0) break;
        ++*n;
    }
    int whole = *out && *n == v->n;
    resp_free(v);
    if (!whole) ctl_err("out of memory for the audit entries"); /* not a list cut unseen */
    return whole ? 0 : CTL_FAIL;
}

int ctl_audit(struct ctl *c, const void *key, size_t klen, uint32_t count, struct ctl_audit **out,
              size_t *n)
{
    *out = NULL;
    *n = 0;
    if (c->online) return audit_online(c, key, klen, count, out, n);
    return ctl_audit_page(c, key, klen, 0, count, out, n);
}

int ctl_audit_page(struct ctl *c, const void *key, size_t klen, uint64_t before_seq, uint32_t count,
                   struct ctl_audit **out, size_t *n)
{
    *out = NULL;
    *n = 0;
    const idem_audit_entry *e;
    size_t k;
    int rc = idem_audit_page(c->q, key, klen, before_seq, count, &e, &k);
    if (rc != IDEM_OK) {
        ctl_err("audit: %s", idem_strerror(rc));
        return CTL_FAIL;
    }
    *out = calloc(k ? k : 1, sizeof **out);
    for (size_t i = 0; *out && i < k; i++)
        if (audit_own(&(*out)[(*n)++], &e[i]) < 0) return CTL_FAIL;
    return *out ? 0 : CTL_FAIL;
}

/* ---- Resolve ---- */

static const char *const action_names[] = {NULL, "commit", "release", "settle"};

static int resolve_online(struct ctl *c, const void *key, size_t klen, int action, uint64_t version,
                          int force, char *msg, size_t cap, int *changed)
{
    const struct ctl_opts *o = c->o;
    char ver[32];
    snprintf(ver, sizeof ver, "%llu", (unsigned long long)version);
    const char *argv[10] = {"IDEM.RESOLVE", key, action_names[action], o->reason};
    size_t argl[10] = {12, klen, strlen(action_names[action]), strlen(o->reason)};
    int argc = 4;
    if (o->has_result) {
        argv[argc] = "RESULT";
        argl[argc++] = 6;
        argv[argc] = o->result;
        argl[argc++] = strlen(o->result);
    }
    argv[argc] = "EXPECT";
    argl[argc++] = 6;
    argv[argc] = ver;
    argl[argc++] = strlen(ver);
    if (force) {
        argv[argc] = "FORCE";
        argl[argc++] = 5;
    }
    resp_value *v;
    if (resp_command(&c->conn, argc, argv, argl, &v) < 0) {
        ctl_err("%s: the decision may or may not have taken effect (look with idemctl get and "
                "idemctl audit)",
                c->conn.err);
        return CTL_FAIL;
    }
    int rc = 0;
    if (v->type == RESP_ERROR) {
        *changed = v->str && strncmp(v->str, "CHANGED", 7) == 0;
        bytes_escape(v->str ? v->str : "error", v->str ? v->len : 5, msg, cap);
        rc = CTL_FAIL;
    }
    resp_free(v);
    return rc;
}

int ctl_resolve(struct ctl *c, const void *key, size_t klen, int action, uint64_t version,
                int force, char *msg, size_t cap, int *changed)
{
    *changed = 0;
    if (c->online) return resolve_online(c, key, klen, action, version, force, msg, cap, changed);
    const struct ctl_opts *o = c->o;
    idem_op op = {.kind = IDEM_OP_RESOLVE,
                  .flags = IDEM_F_EXPECT | (force ? IDEM_F_FORCE : 0),
                  .key = key,
                  .key_len = (uint32_t)klen,
                  .data = o->reason,
                  .data_len = (uint32_t)strlen(o->reason),
                  .result = o->has_result ? o->result : NULL,
                  .result_len = o->has_result ? (uint32_t)strlen(o->result) : 0,
                  .action = (uint32_t)action,
                  .expect_version = version,
                  .actor = c->actor};
    idem_completion comp;
    int rc = idem_exec(c->q, &op, &comp);
    if (rc == IDEM_OK) rc = comp.err;
    if (rc == IDEM_OK) return 0;
    *changed = rc == IDEM_ECHANGED;
    snprintf(msg, cap, "%s", idem_strerror(rc));
    return CTL_FAIL;
}

/* ---- Backup ---- */

int ctl_backup(struct ctl *c, const char *dest)
{
    if (!c->online) {
        int err = idem_backup(c->s, dest);
        if (err != IDEM_OK) {
            ctl_err("backup into %s failed: %s (%s)", dest, idem_strerror(err), idem_last_error());
            return CTL_FAIL;
        }
        return CTL_OK;
    }
    /* idemd makes the copy itself, on its host: dest is a path there, absolute (idemd refuses
     * a relative one, which would name a place under its own working directory). On the unix
     * socket idemd runs on this host, and a relative dest is taken from here, as offline; over
     * TCP it may run on another, where this directory means nothing. */
    char abs[4096];
    if (dest[0] != '/' && c->o->host) {
        ctl_err("backup into %s: over --host, DEST is a path on idemd's host: give it absolute",
                dest);
        return CTL_USAGE;
    }
    if (dest[0] != '/') {
        char cwd[4096];
        if (!getcwd(cwd, sizeof cwd) ||
            (size_t)snprintf(abs, sizeof abs, "%s/%s", cwd, dest) >= sizeof abs) {
            ctl_err("backup into %s: cannot make the path absolute", dest);
            return CTL_FAIL;
        }
        dest = abs;
    }
    /* idemd answers once the copy is durable, and goes on copying if nobody waits: a store of
     * gigabytes takes longer than the usual timeout, which would report a failure while the
     * copy carries on. So the answer is waited for up to CTL_TIMEOUT_MAX_MS, unless --timeout
     * says otherwise. */
    if (!c->o->has_timeout) c->conn.timeout_ms = CTL_TIMEOUT_MAX_MS;
    const char *argv[] = {"IDEM.BACKUP", dest};
    resp_value *v = NULL;
    if (call_ok(c, &v, 2, argv, NULL)) return CTL_FAIL;
    resp_free(v);
    return CTL_OK;
}
