/*
 * ctl.h: what the files of idemctl share: parsed options, the connection to a store (idemd
 * over RESP, or a stopped store directory through include/idem.h), the records, stats and
 * audit entries both paths produce, and the output helpers (tables, colour, JSON, units).
 *
 *   main.c      options, subcommand table, help texts, exit codes
 *   backend.c   online (resp.c) and offline (idem.h) access behind one set of calls
 *   out.c       aligned tables, colour on a terminal, JSON writer, byte escaping, times
 *   units.c     durations and sizes with human units
 *   cmd_view.c  status, watch, get, scan
 *   cmd_ops.c   attention, resolve, audit
 *   cmd_maint.c verify, backup, restore, export, import, checkpoint, compact
 *   jsonl.c     the flat JSON objects that import reads
 */
#ifndef IDEMCTL_CTL_H
#define IDEMCTL_CTL_H

#include <stdint.h>
#include <stdio.h>

#include "idem.h"
#include "resp.h"

#define CTL_OK    0
#define CTL_FAIL  1
#define CTL_USAGE 2

#define CTL_DEFAULT_SOCKET "./idem-data/idemd.sock"
#define CTL_DEFAULT_DIR    "./idem-data"
#define CTL_POS_MAX        8
#define CTL_TIMEOUT_MAX_MS (24 * 3600 * 1000)
#define CTL_VIEW_MS_MAX    (3600 * 1000) /* --interval and --window at most an hour */
/* Offline, the attention list ends once its records' bytes reach this (ctl_attention). */
#define CTL_ATTENTION_BYTES (64ull << 20)

struct ctl_opts {
    const char *socket, *host, *user, *password, *password_file, *dir;
    int port;
    int json, color, timeout_ms;
    int has_timeout; /* --timeout given (else online backup waits as long as the copy takes) */
    /* Subcommand options. */
    int64_t older_ms;
    int has_older;
    int state; /* enum idem_state, 0: any */
    uint64_t count;
    int has_count;
    const char *reason, *result;
    int has_result, force;
    uint64_t expect_version; /* resolve --expect: the version the decision was made on */
    int has_expect;
    int64_t interval_ms, window_ms;
    uint64_t min_free_bytes;
    int has_min_free;
    uint64_t result_max; /* import, offline resolve: the store's result limit (0: the default) */
    const char *pos[CTL_POS_MAX];
    int npos;
    /* get, resolve, audit: KEY as bytes (pos[0] as typed, or decoded by --key-escaped or
     * --key-base64); NULL when no KEY was given. */
    const uint8_t *key;
    size_t key_len;
    int key_form; /* 0: as typed; CTL_KEY_ESCAPED; CTL_KEY_BASE64 */
};
#define CTL_KEY_ESCAPED 1
#define CTL_KEY_BASE64  2

/* Where a command needs to reach the store. */
enum ctl_access {
    CTL_READ = 1,         /* online, or offline read-only */
    CTL_WRITE = 2,        /* online, or offline read-write */
    CTL_OFFLINE = 3,      /* offline only, read-write */
    CTL_OFFLINE_READ = 4, /* offline only, read-only */
    CTL_CREATE = 5,       /* offline only, read-write; a directory without a store gets one,
                             and a store an import cut short opens (import only) */
};

struct ctl {
    const struct ctl_opts *o;
    int online;
    resp_conn conn;
    idem_store *s;
    idem_queue *q;
    char actor[320];   /* offline decisions: who acts */
    int attention_cut; /* the last ctl_attention was cut to its room (idemd's reply, or
                          CTL_ATTENTION_BYTES offline): more may need attention */
};

/* A record with its bytes owned (ctl_record_free). */
struct ctl_record {
    idem_record r;
    char *mem;
};

struct ctl_stats {
    idem_stats s;
    int has_buckets;            /* flush latency histogram known */
    int has_keys_with_mismatch; /* otherwise the mismatches counter is what is known */
    int has_last_minute;        /* claims_last_minute and duplicates_last_minute known */
    int64_t connected_clients;  /* -1 offline */
    int loading;                /* idemd answered -LOADING (ctl_stats_or_loading): nothing else
                                   is known */
};

/* An audit entry with its strings owned (ctl_audit_free). */
struct ctl_audit {
    idem_audit_entry e;
    char *mem;
};

/* ---- backend.c ---- */
/* Reaches the store for a command. Prints the reason and returns CTL_FAIL on failure. */
int ctl_connect(struct ctl *c, const struct ctl_opts *o, int access);
/* Closes what ctl_connect opened. Returns rc, or CTL_FAIL when rc is CTL_OK and closing the
 * store failed (a change not made durable: the command must not exit 0). */
int ctl_disconnect(struct ctl *c, int rc);
/* The same for a command whose change the store acknowledged (offline stores open in durability
 * sync: it is in the log): a failure closing the store after it is said, and rc is kept. */
int ctl_disconnect_acked(struct ctl *c, int rc);
int ctl_get(struct ctl *c, const void *key, size_t klen, struct ctl_record *out, int *found);
void ctl_record_free(struct ctl_record *r);
int ctl_stats(struct ctl *c, struct ctl_stats *st);
/* As ctl_stats, but an idemd still recovering the store is an answer: st->loading. */
int ctl_stats_or_loading(struct ctl *c, struct ctl_stats *st);
/* Store clock now (ms). */
int ctl_now(struct ctl *c, int64_t *now_ms);
/* An in_flight record whose lease ran out (rule 6): its worker died or hung with the key. The
 * one rule for the attention list's reasons (attention) and status's count (status). */
static inline int ctl_lease_ran_out(const idem_record *r, int64_t now)
{
    return r->state == IDEM_STATE_IN_FLIGHT && r->lease_until_ms <= now;
}
int ctl_attention(struct ctl *c, int64_t older_ms, uint32_t max, struct ctl_record **recs,
                  size_t *n);
void ctl_records_free(struct ctl_record *recs, size_t n);
/* One scan step: calls fn for every key; *cursor 0 on return when done. */
int ctl_scan_step(struct ctl *c, uint64_t *cursor, int state, int64_t older_ms,
                  void (*fn)(void *ctx, const void *key, size_t klen), void *ctx);
/* A consistent copy of the store (live through idemd, or stopped) into the new directory dest. */
int ctl_backup(struct ctl *c, const char *dest);
int ctl_audit(struct ctl *c, const void *key, size_t klen, uint32_t count, struct ctl_audit **out,
              size_t *n);
/* Offline: the audit entries (of key, when not NULL) older than before_seq (0: the newest),
 * newest first. */
int ctl_audit_page(struct ctl *c, const void *key, size_t klen, uint64_t before_seq, uint32_t count,
                   struct ctl_audit **out, size_t *n);
void ctl_audit_free(struct ctl_audit *a, size_t n);
/* Resolve with EXPECT version. Returns 0, or CTL_FAIL with msg set (changed: *changed = 1). */
int ctl_resolve(struct ctl *c, const void *key, size_t klen, int action, uint64_t version,
                int force, char *msg, size_t msgcap, int *changed);
/* Offline stores: prints the open failure (pid and host when another process holds it). */
void ctl_open_error(const char *dir, int rc);

/* ---- out.c ---- */
struct table;
struct table *table_new(int ncols);
void table_add(struct table *t, ...); /* ncols strings (NULL: empty) */
/* Colour of the last row's cell col (a CTL_C_* escape or NULL). */
void table_color(struct table *t, int col, const char *esc);
void table_print(struct table *t, FILE *f, int header, int color);
void table_free(struct table *t);

#define CTL_C_RED    "\033[31m"
#define CTL_C_GREEN  "\033[32m"
#define CTL_C_YELLOW "\033[33m"
#define CTL_C_BOLD   "\033[1m"
#define CTL_C_RESET  "\033[0m"

/* Colour helpers: the escape when colour is on, "" otherwise. */
const char *col(const struct ctl_opts *o, const char *esc);

/* JSON writer on stdout: objects, arrays and values with commas placed for the caller. */
struct jw {
    FILE *f;
    int depth;
    int first[32];
    int after_key;
};
void jw_init(struct jw *j, FILE *f);
void jw_obj(struct jw *j);
void jw_obj_end(struct jw *j);
void jw_arr(struct jw *j);
void jw_arr_end(struct jw *j);
void jw_key(struct jw *j, const char *k);
void jw_str(struct jw *j, const char *s);
void jw_bytes(struct jw *j, const void *p,
              size_t n); /* JSON string (bytes as \u00XX if not UTF-8) */
void jw_int(struct jw *j, int64_t v);
void jw_uint(struct jw *j, uint64_t v);
void jw_double(struct jw *j, double v);
void jw_bool(struct jw *j, int v);
void jw_null(struct jw *j);
/* key + value shorthands */
void jw_kstr(struct jw *j, const char *k, const char *v);
void jw_kint(struct jw *j, const char *k, int64_t v);
void jw_kuint(struct jw *j, const char *k, uint64_t v);
void jw_kbytes(struct jw *j, const char *k, const void *p, size_t n);
void jw_ktime(struct jw *j, const char *k, int64_t ms); /* ms and ISO 8601 (null for 0) */
/* Whether bytes are printable UTF-8 without control characters. */
int bytes_are_text(const void *p, size_t n);
/* Bytes for a terminal: printable kept (but a space at either end), others as \xHH; truncated
 * with "..." only when cap is too small (CTL_KEY_TEXT_CAP holds any key). */
void bytes_escape(const void *p, size_t n, char *out, size_t cap);
/* Room for any key in the escaped form, whole: messages name a key this way, so a key
 * of control bytes never reaches the terminal raw and the text can be given back with
 * --key-escaped. */
#define CTL_KEY_TEXT_CAP (4 * IDEM_KEY_BYTES_MAX + 16)
/* ISO 8601 UTC with milliseconds ("-" for 0). */
void fmt_iso(int64_t ms, char *out, size_t cap);
/* 16 bytes as 32 hex digits. */
void fmt_hex(const uint8_t *p, size_t n, char *out, size_t cap);
/* The value of hex digit c, or -1. */
int hex_digit(char c);
/* Exactly 2n hex digits into out[n]: 0, or -1. */
int parse_hex(const char *s, uint8_t *out, size_t n);
/* Base64 for bytes that are not text (export). */
char *base64_encode(const void *p, size_t n);
int base64_decode(const char *s, uint8_t **out, size_t *n);
/* A record as JSON: every field, times also as ISO 8601; with now_ms, ages and time left.
 * Bytes that are not text go to "<field>_base64". fields: without the braces. */
void print_record_json(struct jw *j, const idem_record *r, int64_t now_ms);
void print_record_fields(struct jw *j, const idem_record *r, int64_t now_ms);
/* A bytes field as "k" (text) or "k_base64". */
void jw_kblob_pub(struct jw *j, const char *k, const void *p, size_t n);

/* ---- units.c ---- */
/* "90s", "72h", "4d", "1h30m", "250ms"; bare 0. Returns 0 or -1. */
int parse_duration_ms(const char *s, int64_t *out);
/* "64KiB", "10MB", "1G", bare bytes. */
int parse_size(const char *s, uint64_t *out);
/* "3h12m", "45s", "2d4h", "850ms"; negative durations keep the sign. */
void fmt_duration(int64_t ms, char *out, size_t cap);
void fmt_size(uint64_t bytes, char *out, size_t cap);

/* ---- commands ---- */
int cmd_status(const struct ctl_opts *o);
int cmd_watch(const struct ctl_opts *o);
int cmd_get(const struct ctl_opts *o);
int cmd_scan(const struct ctl_opts *o);
int cmd_attention(const struct ctl_opts *o);
int cmd_resolve(const struct ctl_opts *o);
int cmd_audit(const struct ctl_opts *o);
int cmd_verify(const struct ctl_opts *o);
int cmd_backup(const struct ctl_opts *o);
int cmd_restore(const struct ctl_opts *o);
int cmd_export(const struct ctl_opts *o);
int cmd_import(const struct ctl_opts *o);
int cmd_checkpoint(const struct ctl_opts *o);
int cmd_compact(const struct ctl_opts *o);

/* Prints "idemctl: " + message to stderr. */
void ctl_err(const char *fmt, ...) __attribute__((format(printf, 1, 2)));

/* ---- jsonl.c: one flat JSON object (strings, numbers, true/false/null) ---- */
struct jfield {
    char *name;
    char *str; /* string value (decoded), or NULL */
    size_t len;
    int is_num, is_null, is_bool;
    int64_t num;
};
/* Parses line into fields; returns the count, or -1 with err set. Free with jfields_free. */
int jsonl_parse(const char *line, struct jfield **out, char *err, size_t errcap);
void jfields_free(struct jfield *f, int n);
const struct jfield *jfield_get(const struct jfield *f, int n, const char *name);

#endif
