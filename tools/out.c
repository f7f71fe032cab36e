/*
 * out.c: output of idemctl: aligned tables (colour only when asked: on a terminal, without
 * NO_COLOR or --no-color), a small JSON writer, bytes shown safely (keys and results are
 * binary), ISO 8601 times, hex and base64.
 */
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "ctl.h"

struct table {
    int ncols;
    size_t nrows, cap;
    char **cells;       /* nrows * ncols, owned */
    const char **color; /* nrows * ncols escapes, or NULL */
};

struct table *table_new(int ncols)
{
    struct table *t = calloc(1, sizeof *t);
    if (t) t->ncols = ncols;
    return t;
}

void table_add(struct table *t, ...)
{
    if (!t) return;
    if (t->nrows == t->cap) {
        size_t cap = t->cap ? 2 * t->cap : 16;
        char **c = realloc(t->cells, cap * (size_t)t->ncols * sizeof *c);
        if (!c) return;
        t->cells = c;
        const char **k = realloc(t->color, cap * (size_t)t->ncols * sizeof *k);
        if (!k) return;
        t->color = k;
        t->cap = cap;
    }
    va_list ap;
    va_start(ap, t);
    for (int i = 0; i < t->ncols; i++) {
        const char *s = va_arg(ap, const char *);
        t->cells[t->nrows * (size_t)t->ncols + (size_t)i] = strdup(s ? s : "");
        t->color[t->nrows * (size_t)t->ncols + (size_t)i] = NULL;
    }
    va_end(ap);
    t->nrows++;
}

void table_color(struct table *t, int c, const char *esc)
{
    if (t && t->nrows && c < t->ncols)
        t->color[(t->nrows - 1) * (size_t)t->ncols + (size_t)c] = esc;
}

/* Display width of a UTF-8 string (code points). */
static size_t text_width(const char *s)
{
    size_t w = 0;
    for (; *s; s++)
        w += ((unsigned char)*s & 0xc0) != 0x80;
    return w;
}

void table_print(struct table *t, FILE *f, int header, int color)
{
    if (!t) return;
    size_t width[16] = {0};
    for (size_t r = 0; r < t->nrows; r++)
        for (int c = 0; c < t->ncols && c < 16; c++) {
            size_t w = text_width(t->cells[r * (size_t)t->ncols + (size_t)c]);
            if (w > width[c]) width[c] = w;
        }
    for (size_t r = 0; r < t->nrows; r++) {
        int lastc = 0; /* no padding after the last nonempty cell */
        for (int c = 0; c < t->ncols && c < 16; c++)
            if (t->cells[r * (size_t)t->ncols + (size_t)c][0]) lastc = c;
        for (int c = 0; c <= lastc; c++) {
            const char *cell = t->cells[r * (size_t)t->ncols + (size_t)c];
            const char *esc = t->color[r * (size_t)t->ncols + (size_t)c];
            if (header && r == 0 && color) esc = CTL_C_BOLD;
            int last = c == lastc;
            size_t pad = last ? 0 : width[c] - text_width(cell) + 2;
            fprintf(f, "%s%s%s%*s", color && esc ? esc : "", cell, color && esc ? CTL_C_RESET : "",
                    (int)pad, "");
        }
        fputc('\n', f);
    }
}

void table_free(struct table *t)
{
    if (!t) return;
    for (size_t i = 0; i < t->nrows * (size_t)t->ncols; i++)
        free(t->cells[i]);
    free(t->cells);
    free(t->color);
    free(t);
}

const char *col(const struct ctl_opts *o, const char *esc)
{
    return o->color ? esc : "";
}

/* ---- JSON ---- */

void jw_init(struct jw *j, FILE *f)
{
    memset(j, 0, sizeof *j);
    j->f = f;
    j->first[0] = 1;
}

static void jw_sep(struct jw *j)
{
    if (j->after_key) {
        j->after_key = 0;
        return;
    }
    if (!j->first[j->depth]) fputc(',', j->f);
    j->first[j->depth] = 0;
}

static void jw_open(struct jw *j, char c)
{
    jw_sep(j);
    fputc(c, j->f);
    if (j->depth < 31) j->depth++;
    j->first[j->depth] = 1;
}

static void jw_close(struct jw *j, char c)
{
    fputc(c, j->f);
    if (j->depth > 0) j->depth--;
    if (j->depth == 0) j->first[0] = 1; /* a new top-level document (JSON Lines) */
}

void jw_obj(struct jw *j)
{
    jw_open(j, '{');
}
void jw_obj_end(struct jw *j)
{
    jw_close(j, '}');
}
void jw_arr(struct jw *j)
{
    jw_open(j, '[');
}
void jw_arr_end(struct jw *j)
{
    jw_close(j, ']');
}

/* Length of the well-formed UTF-8 sequence at p (n bytes left), or 0: no overlong forms, no
 * surrogates (U+D800..DFFF), nothing above U+10FFFF (RFC 3629), so JSON readers take it. */
static size_t utf8_len(const uint8_t *p, size_t n)
{
    uint8_t c = p[0], lo = 0x80, hi = 0xbf; /* the range of the second byte */
    size_t len = c < 0x80                 ? 1
                 : c >= 0xc2 && c <= 0xdf ? 2
                 : c >= 0xe0 && c <= 0xef ? 3
                 : c >= 0xf0 && c <= 0xf4 ? 4
                                          : 0;
    if (len == 0 || len > n) return 0;
    if (c == 0xe0) lo = 0xa0;
    if (c == 0xed) hi = 0x9f;
    if (c == 0xf0) lo = 0x90;
    if (c == 0xf4) hi = 0x8f;
    if (len > 1 && (p[1] < lo || p[1] > hi)) return 0;
    for (size_t i = 2; i < len; i++)
        if ((p[i] & 0xc0) != 0x80) return 0;
    return len;
}

/* Whether the UTF-8 sequence at p (l bytes, l > 1, well-formed) is a character a terminal acts
 * on rather than shows: a C1 control (U+009B is a CSI), a line or paragraph separator, or a
 * direction mark or override (text that reads other than it is). Keys and results are clients'
 * bytes. */
static int utf8_acts(const uint8_t *p, size_t l, uint32_t *cp)
{
    *cp = l == 2   ? (uint32_t)(p[0] & 0x1f) << 6 | (p[1] & 0x3f)
          : l == 3 ? (uint32_t)(p[0] & 0x0f) << 12 | (uint32_t)(p[1] & 0x3f) << 6 | (p[2] & 0x3f)
                   : 0x10000;
    return (*cp >= 0x80 && *cp <= 0x9f) || *cp == 0x061c || *cp == 0x200e || *cp == 0x200f ||
           (*cp >= 0x2028 && *cp <= 0x202e) || (*cp >= 0x2066 && *cp <= 0x2069);
}

static void jw_raw_string(FILE *f, const uint8_t *p, size_t n)
{
    fputc('"', f);
    for (size_t i = 0; i < n;) {
        size_t l = utf8_len(p + i, n - i);
        uint32_t cp;
        if (l > 1 && utf8_acts(p + i, l, &cp)) { /* the same character, read back as such */
            fprintf(f, "\\u%04x", (unsigned)cp);
            i += l;
            continue;
        }
        if (l > 1) {
            fwrite(p + i, 1, l, f);
            i += l;
            continue;
        }
        uint8_t c = p[i++];
        if (c == '"' || c == '\\')
            fprintf(f, "\\%c", c);
        else if (c == '\n')
            fputs("\\n", f);
        else if (c == '\t')
            fputs("\\t", f);
        else if (c >= 0x80) /* no UTF-8: \u00XX would read as another character */
            fputs("\\ufffd", f);
        else if (c < 0x20 || c == 0x7f)
            fprintf(f, "\\u%04x", c);
        else
            fputc(c, f);
    }
    fputc('"', f);
}

void jw_key(struct jw *j, const char *k)
{
    jw_sep(j);
    jw_raw_string(j->f, (const uint8_t *)k, strlen(k));
    fputc(':', j->f);
    j->after_key = 1;
}

void jw_str(struct jw *j, const char *s)
{
    jw_sep(j);
    jw_raw_string(j->f, (const uint8_t *)s, strlen(s));
}

void jw_bytes(struct jw *j, const void *p, size_t n)
{
    jw_sep(j);
    jw_raw_string(j->f, p, n);
}

void jw_int(struct jw *j, int64_t v)
{
    jw_sep(j);
    fprintf(j->f, "%lld", (long long)v);
}

void jw_uint(struct jw *j, uint64_t v)
{
    jw_sep(j);
    fprintf(j->f, "%llu", (unsigned long long)v);
}

void jw_double(struct jw *j, double v)
{
    jw_sep(j);
    fprintf(j->f, "%.6g", v);
}

void jw_bool(struct jw *j, int v)
{
    jw_sep(j);
    fputs(v ? "true" : "false", j->f);
}

void jw_null(struct jw *j)
{
    jw_sep(j);
    fputs("null", j->f);
}

void jw_kstr(struct jw *j, const char *k, const char *v)
{
    jw_key(j, k);
    if (v)
        jw_str(j, v);
    else
        jw_null(j);
}

void jw_kint(struct jw *j, const char *k, int64_t v)
{
    jw_key(j, k);
    jw_int(j, v);
}

void jw_kuint(struct jw *j, const char *k, uint64_t v)
{
    jw_key(j, k);
    jw_uint(j, v);
}

void jw_kbytes(struct jw *j, const char *k, const void *p, size_t n)
{
    jw_key(j, k);
    if (p)
        jw_bytes(j, p, n);
    else
        jw_null(j);
}

void jw_ktime(struct jw *j, const char *k, int64_t ms)
{
    char name[64], iso[40];
    jw_kint(j, k, ms);
    size_t kl = strlen(k);
    snprintf(name, sizeof name, "%.*s_iso",
             (int)(kl > 3 && strcmp(k + kl - 3, "_ms") == 0 ? kl - 3 : kl), k);
    if (ms) {
        fmt_iso(ms, iso, sizeof iso);
        jw_kstr(j, name, iso);
    } else {
        jw_kstr(j, name, NULL);
    }
}

/* ---- Bytes, times, encodings ---- */

int bytes_are_text(const void *p, size_t n)
{
    const uint8_t *b = p;
    for (size_t i = 0; i < n;) {
        size_t l = utf8_len(b + i, n - i);
        if (l == 0 || (l == 1 && (b[i] < 0x20 || b[i] == 0x7f))) return 0;
        i += l;
    }
    return 1;
}

void bytes_escape(const void *p, size_t n, char *out, size_t cap)
{
    const uint8_t *b = p;
    size_t o = 0;
    for (size_t i = 0; i < n; i++) {
        if (o + 8 >= cap) {
            snprintf(out + (o < cap - 4 ? o : cap - 4), 4, "...");
            return;
        }
        /* A space at either end is escaped too: `read -r` and table columns would lose it. */
        int edge_space = b[i] == ' ' && (i == 0 || i == n - 1);
        if (b[i] >= 0x20 && b[i] < 0x7f && b[i] != '\\' && !edge_space)
            out[o++] = (char)b[i];
        else
            o += (size_t)snprintf(out + o, cap - o, "\\x%02x", b[i]);
    }
    out[o] = 0;
}

void fmt_iso(int64_t ms, char *out, size_t cap)
{
    if (ms == 0) {
        snprintf(out, cap, "-");
        return;
    }
    time_t t = (time_t)(ms / 1000);
    struct tm tm;
    gmtime_r(&t, &tm);
    char buf[32];
    strftime(buf, sizeof buf, "%Y-%m-%dT%H:%M:%S", &tm);
    snprintf(out, cap, "%s.%03dZ", buf, (int)(ms % 1000));
}

void fmt_hex(const uint8_t *p, size_t n, char *out, size_t cap)
{
    size_t o = 0;
    for (size_t i = 0; i < n && o + 3 <= cap; i++)
        o += (size_t)snprintf(out + o, cap - o, "%02x", p[i]);
    out[o < cap ? o : cap - 1] = 0;
}

int hex_digit(char c)
{
    return c >= '0' && c <= '9'   ? c - '0'
           : c >= 'a' && c <= 'f' ? c - 'a' + 10
           : c >= 'A' && c <= 'F' ? c - 'A' + 10
                                  : -1;
}

int parse_hex(const char *s, uint8_t *out, size_t n)
{
    if (strlen(s) != 2 * n) return -1;
    for (size_t i = 0; i < n; i++) { /* hex digits alone: no sign, blank or 0x */
        int hi = hex_digit(s[2 * i]), lo = hex_digit(s[2 * i + 1]);
        if (hi < 0 || lo < 0) return -1;
        out[i] = (uint8_t)(hi << 4 | lo);
    }
    return 0;
}

static const char b64[] = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";

char *base64_encode(const void *p, size_t n)
{
    const uint8_t *b = p;
    char *out = malloc(4 * ((n + 2) / 3) + 1);
    if (!out) return NULL;
    size_t o = 0;
    for (size_t i = 0; i < n; i += 3) {
        uint32_t v = (uint32_t)b[i] << 16 | (i + 1 < n ? (uint32_t)b[i + 1] << 8 : 0) |
                     (i + 2 < n ? b[i + 2] : 0);
        out[o++] = b64[v >> 18 & 63];
        out[o++] = b64[v >> 12 & 63];
        out[o++] = i + 1 < n ? b64[v >> 6 & 63] : '=';
        out[o++] = i + 2 < n ? b64[v & 63] : '=';
    }
    out[o] = 0;
    return out;
}

int base64_decode(const char *s, uint8_t **out, size_t *n)
{
    size_t len = strlen(s);
    if (len % 4) return -1;
    uint8_t *b = malloc(len / 4 * 3 + 1);
    if (!b) return -1;
    size_t o = 0;
    for (size_t i = 0; i < len; i += 4) {
        uint32_t v = 0;
        int pad = 0;
        for (int k = 0; k < 4; k++) {
            const char *c = s[i + k] == '=' ? NULL : strchr(b64, s[i + k]);
            if (s[i + k] == '=' && i + 4 == len && k >= 2)
                pad++;
            else if (!c || !s[i + k] || pad) {
                free(b);
                return -1;
            }
            v = v << 6 | (c ? (uint32_t)(c - b64) : 0);
        }
        b[o++] = (uint8_t)(v >> 16);
        if (pad < 2) b[o++] = (uint8_t)(v >> 8);
        if (pad < 1) b[o++] = (uint8_t)v;
    }
    b[o] = 0; /* room for it: len / 4 * 3 + 1 */
    *out = b;
    *n = o;
    return 0;
}

/* A bytes field: "name" when text, "name_base64" otherwise, null when absent. */
static void jw_kblob(struct jw *j, const char *k, const void *p, size_t n, int present)
{
    if (!present) {
        jw_kstr(j, k, NULL);
        return;
    }
    if (bytes_are_text(p, n)) {
        jw_kbytes(j, k, p ? p : "", n);
        return;
    }
    char name[64];
    snprintf(name, sizeof name, "%s_base64", k);
    char *e = base64_encode(p, n);
    jw_kstr(j, name, e ? e : "");
    free(e);
}

void print_record_fields(struct jw *j, const idem_record *r, int64_t now_ms)
{
    char hex[40];
    jw_kblob(j, "key", r->key, r->key_len, 1);
    jw_kstr(j, "state", idem_state_name(r->state));
    jw_ktime(j, "first_seen_ms", r->first_seen_ms);
    jw_ktime(j, "expires_at_ms", r->expires_at_ms);
    jw_ktime(j, "last_seen_ms", r->last_seen_ms);
    jw_kuint(j, "seen_count", r->seen_count);
    fmt_hex(r->fp, IDEM_FP_BYTES, hex, sizeof hex);
    jw_kstr(j, "fingerprint", r->has_fp ? hex : NULL);
    jw_ktime(j, "lease_until_ms", r->lease_until_ms);
    jw_kint(j, "token", r->token);
    jw_kblob(j, "owner", r->owner, r->owner_len, r->owner != NULL);
    jw_kuint(j, "attempts", r->attempts);
    jw_ktime(j, "last_grant_ms", r->last_grant_ms);
    jw_kblob(j, "result", r->result, r->result_len, r->state == IDEM_STATE_COMMITTED);
    jw_kblob(j, "note", r->note, r->note_len, r->note != NULL);
    jw_kuint(j, "mismatch_count", r->mismatch_count);
    jw_ktime(j, "last_mismatch_ms", r->last_mismatch_ms);
    fmt_hex(r->last_mismatch_fp, IDEM_FP_BYTES, hex, sizeof hex);
    jw_kstr(j, "last_mismatch_fp", r->has_last_mismatch_fp ? hex : NULL);
    jw_kuint(j, "version", r->version);
    if (now_ms) {
        jw_kint(j, "age_ms", r->first_seen_ms ? now_ms - r->first_seen_ms : 0);
        if (r->state == IDEM_STATE_COMMITTED)
            jw_kint(j, "expires_in_ms", r->expires_at_ms - now_ms);
        if (r->state == IDEM_STATE_IN_FLIGHT)
            jw_kint(j, "lease_left_ms", r->lease_until_ms - now_ms);
    }
}

void print_record_json(struct jw *j, const idem_record *r, int64_t now_ms)
{
    jw_obj(j);
    print_record_fields(j, r, now_ms);
    jw_obj_end(j);
}

void jw_kblob_pub(struct jw *j, const char *k, const void *p, size_t n)
{
    jw_kblob(j, k, p, n, 1);
}
