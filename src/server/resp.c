/*
 * resp.c: the RESP2 request parser and reply writers (see resp.h for the contract).
 *
 * Parser state between calls: `pos` is how far into the current request the parser has read;
 * for an array request, `argi` arguments are complete and `bulk_left` >= 0 means the header of
 * the next bulk was read and its data is awaited. Nothing is consumed before a request is whole,
 * except in discard mode, where every byte read is consumed at once and `pos` restarts at 0.
 */
#include "resp.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

enum { LINE_OK = 0, LINE_NEED = 1, LINE_BAD = 2 };
enum { PARSE_SKIP = 100 }; /* an empty request was consumed: go on with the next */

static void reset_request(resp_parser *p)
{
    p->in_array = 0;
    p->discarding = 0;
    p->too_many = 0;
    p->argc = 0;
    p->argi = 0;
    p->bulk_left = -1;
    p->pos = 0;
}

void resp_parser_init(resp_parser *p, uint32_t argc_max, resp_arg_max_fn arg_max, void *ctx)
{
    memset(p, 0, sizeof *p);
    p->argc_max = argc_max == 0 || argc_max > RESP_ARGV_MAX ? RESP_ARGV_MAX : argc_max;
    p->arg_max = arg_max;
    p->arg_max_ctx = ctx;
    p->inline_max = RESP_INLINE_MAX;
    reset_request(p);
}

/* Reads `<prefix><integer>\r\n` at buf[pos]. On LINE_OK sets *v and *next (after the CRLF). */
static int read_number_line(const uint8_t *buf, size_t len, size_t pos, char prefix, int64_t *v,
                            size_t *next)
{
    size_t i = pos + 1, end = pos + RESP_LINE_MAX - 1; /* a CR at end - 1 at the latest */
    int neg = 0, digits = 0;
    int64_t n = 0;
    if (buf[pos] != (uint8_t)prefix) return LINE_BAD;
    if (i < len && buf[i] == '-') {
        neg = 1;
        i++;
    }
    for (; i < len && i < end && buf[i] >= '0' && buf[i] <= '9'; i++) {
        if (n > (INT64_MAX - 9) / 10) return LINE_BAD;
        n = n * 10 + (buf[i] - '0');
        digits++;
    }
    if (i >= end) return LINE_BAD;
    if (i + 2 > len) return i + 1 == len && buf[i] != '\r' ? LINE_BAD : LINE_NEED;
    if (digits == 0 || buf[i] != '\r' || buf[i + 1] != '\n') return LINE_BAD;
    *v = neg ? -n : n;
    *next = i + 2;
    return LINE_OK;
}

static int fail(resp_parser *p, int status, const char *msg)
{
    snprintf(p->err, sizeof p->err, "%s", msg);
    reset_request(p);
    return status;
}

/* p->err = "ERR <name>: why", with the command's name (when short) made printable; the name
 * itself is kept in p->refused_name. */
static void refusal(resp_parser *p, const uint8_t *cmd, size_t cmd_len, const char *why)
{
    p->refused_name_len = cmd && cmd_len <= sizeof p->refused_name ? (uint32_t)cmd_len : 0;
    if (p->refused_name_len) memcpy(p->refused_name, cmd, cmd_len);
    char name[32] = "";
    if (cmd && cmd_len < sizeof name) {
        memcpy(name, cmd, cmd_len);
        name[cmd_len] = '\0';
        for (char *c = name; *c; c++)
            if (*c < 0x20 || *c > 0x7e) *c = '?';
    }
    snprintf(p->err, sizeof p->err, "ERR %s%s%s", name, name[0] ? ": " : "", why);
}

/* The request is refused: from now on its bytes are dropped as they are read. */
static void start_discard(resp_parser *p, const uint8_t *buf, const char *why)
{
    refusal(p, p->argi > 0 ? buf + p->arg_off[0] : NULL, p->argi > 0 ? p->arg_len[0] : 0, why);
    p->discarding = 1;
}

static void fill_argv(resp_parser *p, const uint8_t *buf, uint32_t n)
{
    for (uint32_t i = 0; i < n; i++) {
        p->argv[i] = buf + p->arg_off[i];
        p->argl[i] = p->arg_len[i];
    }
}

/* "key (argument 2) is too long (600 bytes, at most 512)"; index is 0-based. */
static void too_long(char *why, size_t size, const char *field, uint32_t index, uint64_t len,
                     uint32_t max)
{
    snprintf(why, size, "%s%sargument %u%s is too long (%llu bytes, at most %u)",
             field ? field : "", field ? " (" : "", index + 1, field ? ")" : "",
             (unsigned long long)len, max);
}

/* The bulk header of argument argi was read (the request's bytes up to its data: `upto`): check
 * it against its field's limit and the whole request against req_max. */
static int check_bulk(resp_parser *p, const uint8_t *buf, int64_t n, size_t upto)
{
    char why[96];
    uint32_t max = RESP_BULK_PROTO_MAX;
    if (n < 0 || n > (int64_t)RESP_BULK_PROTO_MAX)
        return fail(p, RESP_CLOSE, "ERR Protocol error: invalid bulk length");
    if (p->discarding) return RESP_NEED_MORE;
    if (p->req_max && upto + (size_t)n + 2 > p->req_max) {
        snprintf(why, sizeof why, "request too large (its arguments pass %zu bytes in all)",
                 p->req_max);
        start_discard(p, buf, why);
        return RESP_NEED_MORE;
    }
    const char *field = NULL;
    if (p->arg_max) {
        fill_argv(p, buf, p->argi);
        max = p->arg_max(p->arg_max_ctx, p->argv, p->argl, p->argi, &field);
    }
    if (n > (int64_t)max) {
        too_long(why, sizeof why, field, p->argi, (uint64_t)n, max);
        start_discard(p, buf, why);
    }
    return RESP_NEED_MORE;
}

/* Reads the data of the current bulk (p->bulk_left bytes, then CRLF). */
static int read_bulk(resp_parser *p, const uint8_t *buf, size_t len)
{
    size_t n = (size_t)p->bulk_left;
    if (p->discarding) {
        size_t avail = len - p->pos, take = avail < n ? avail : n;
        p->pos += take;
        p->bulk_left -= (int64_t)take;
        if (p->bulk_left > 0) return RESP_NEED_MORE;
    } else {
        if (len - p->pos < n + 2) return RESP_NEED_MORE;
        p->arg_off[p->argi] = p->pos;
        p->arg_len[p->argi] = (uint32_t)n;
        p->pos += n;
    }
    if (len - p->pos < 2) return RESP_NEED_MORE;
    if (buf[p->pos] != '\r' || buf[p->pos + 1] != '\n')
        return fail(p, RESP_CLOSE, "ERR Protocol error: bulk string not ended by CRLF");
    p->pos += 2;
    p->bulk_left = -1;
    p->argi++;
    return RESP_REQUEST;
}

static int parse_array(resp_parser *p, uint8_t *buf, size_t len, size_t *consumed)
{
    int64_t n;
    size_t next;
    while (p->argi < p->argc) {
        if (p->bulk_left < 0) {
            if (p->pos >= len) goto need;
            int r = read_number_line(buf, len, p->pos, '$', &n, &next);
            if (r == LINE_NEED) goto need;
            if (r == LINE_BAD)
                return fail(p, RESP_CLOSE, "ERR Protocol error: expected a bulk string");
            if (check_bulk(p, buf, n, next) == RESP_CLOSE) return RESP_CLOSE;
            p->pos = next;
            p->bulk_left = n;
        }
        int r = read_bulk(p, buf, len);
        if (r == RESP_CLOSE) return RESP_CLOSE;
        if (r == RESP_NEED_MORE) goto need;
        if (p->too_many && !p->discarding) { /* the command's name is read: refuse by it */
            char why[80];
            snprintf(why, sizeof why, "too many arguments (%u, at most %u)", p->argc, p->argc_max);
            start_discard(p, buf, why);
        }
    }
    *consumed += p->pos;
    if (p->discarding) {
        reset_request(p);
        return RESP_REFUSED;
    }
    fill_argv(p, buf, p->argc);
    p->nargs = p->argc;
    reset_request(p);
    return RESP_REQUEST;
need:
    if (p->discarding) {
        *consumed += p->pos;
        p->pos = 0;
    }
    return RESP_NEED_MORE;
}

static int start_array(resp_parser *p, uint8_t *buf, size_t len, size_t *consumed)
{
    int64_t n;
    size_t next;
    int r = read_number_line(buf, len, 0, '*', &n, &next);
    if (r == LINE_NEED) return RESP_NEED_MORE;
    if (r == LINE_BAD || n > (int64_t)RESP_ARGC_PROTO_MAX)
        return fail(p, RESP_CLOSE, "ERR Protocol error: invalid multibulk length");
    p->first_line_done = 1;
    if (n <= 0) { /* an empty request: Redis skips it */
        *consumed += next;
        return PARSE_SKIP;
    }
    p->in_array = 1;
    p->argc = (uint32_t)n;
    p->argi = 0;
    p->bulk_left = -1;
    p->pos = next;
    p->too_many = n > (int64_t)p->argc_max; /* refused after its first argument, the name */
    return parse_array(p, buf, len, consumed);
}

/* Does the start of a connection's first line look like an HTTP request? */
/* complete: s[0, n) is the whole first line; otherwise more may follow, and a bare "POST" is
 * not yet decided ("POSTX" is a command like any other). */
static int looks_like_http(const uint8_t *s, size_t n, int complete)
{
    if (n >= 4 && memcmp(s, "POST", 4) == 0 &&
        ((n == 4 && complete) || (n > 4 && (s[4] == ' ' || s[4] == '\r'))))
        return 1;
    if (n >= 5 && memcmp(s, "GET /", 5) == 0) return 1;
    return n >= 5 && strncasecmp((const char *)s, "host:", 5) == 0;
}

static int is_blank(uint8_t c)
{
    return c == ' ' || c == '\t' || c == '\r' || c == '\n' || c == '\v' || c == '\f';
}

static int hex_val(uint8_t c)
{
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
}

/* Unquotes one "double-quoted" word at s[*i] into out (in place, out <= s + *i). */
static int unquote_double(uint8_t *s, size_t n, size_t *i, uint8_t **out)
{
    size_t j = *i + 1;
    uint8_t *o = *out;
    for (; j < n && s[j] != '"'; j++) {
        if (s[j] != '\\' || j + 1 >= n) {
            *o++ = s[j];
            continue;
        }
        uint8_t c = s[++j];
        if (c == 'x' && j + 2 < n && hex_val(s[j + 1]) >= 0 && hex_val(s[j + 2]) >= 0) {
            *o++ = (uint8_t)(hex_val(s[j + 1]) * 16 + hex_val(s[j + 2]));
            j += 2;
            continue;
        }
        *o++ = c == 'n'   ? '\n'
               : c == 'r' ? '\r'
               : c == 't' ? '\t'
               : c == 'b' ? '\b'
               : c == 'a' ? '\a'
                          : c;
    }
    if (j >= n || (j + 1 < n && !is_blank(s[j + 1]))) return -1;
    *i = j + 1;
    *out = o;
    return 0;
}

/* Unquotes one 'single-quoted' word (only \' is an escape). */
static int unquote_single(uint8_t *s, size_t n, size_t *i, uint8_t **out)
{
    size_t j = *i + 1;
    uint8_t *o = *out;
    for (; j < n && s[j] != '\''; j++) {
        if (s[j] == '\\' && j + 1 < n && s[j + 1] == '\'') j++;
        *o++ = s[j];
    }
    if (j >= n || (j + 1 < n && !is_blank(s[j + 1]))) return -1;
    *i = j + 1;
    *out = o;
    return 0;
}

/* Splits line s[0..n) into words in place, the first p->argc_max into p->argv. Returns the count
 * of all of them, or -1 on bad quotes. */
static int split_inline(resp_parser *p, uint8_t *s, size_t n)
{
    size_t i = 0;
    uint32_t argc = 0;
    while (i < n) {
        while (i < n && is_blank(s[i]))
            i++;
        if (i >= n) break;
        uint8_t *start = s + i, *o = s + i;
        if (s[i] == '"' || s[i] == '\'') {
            int r = s[i] == '"' ? unquote_double(s, n, &i, &o) : unquote_single(s, n, &i, &o);
            if (r < 0) return -1;
        } else {
            while (i < n && !is_blank(s[i]))
                *o++ = s[i++];
        }
        if (argc < p->argc_max) { /* past it the words are only counted, for the refusal */
            p->argv[argc] = start;
            p->argl[argc] = (uint32_t)(o - start);
        }
        argc++;
    }
    return (int)argc;
}

/* Checks each inline argument against its field's limit; fills p->err on a refusal. */
static int check_inline_limits(resp_parser *p, uint32_t argc)
{
    for (uint32_t i = 0; p->arg_max && i < argc; i++) {
        const char *field = NULL;
        uint32_t max = p->arg_max(p->arg_max_ctx, p->argv, p->argl, i, &field);
        if (p->argl[i] > max) {
            char why[96];
            too_long(why, sizeof why, field, i, p->argl[i], max);
            refusal(p, i > 0 ? p->argv[0] : NULL, i > 0 ? p->argl[0] : 0, why);
            return -1;
        }
    }
    return 0;
}

static int parse_inline(resp_parser *p, uint8_t *buf, size_t len, size_t *consumed)
{
    const uint8_t *nl = memchr(buf + p->pos, '\n', len - p->pos);
    if (!nl) {
        if (!p->first_line_done && looks_like_http(buf, len, 0)) return fail(p, RESP_CLOSE, "");
        if (len > p->inline_max)
            return fail(p, RESP_CLOSE, "ERR Protocol error: too big inline request");
        p->pos = len;
        return RESP_NEED_MORE;
    }
    size_t line = (size_t)(nl - buf);
    if (!p->first_line_done && looks_like_http(buf, line, 1)) return fail(p, RESP_CLOSE, "");
    if (line > p->inline_max)
        return fail(p, RESP_CLOSE, "ERR Protocol error: too big inline request");
    p->first_line_done = 1;
    int argc = split_inline(p, buf, line);
    if (argc == -1) return fail(p, RESP_CLOSE, "ERR Protocol error: unbalanced quotes in request");
    *consumed += line + 1;
    reset_request(p);
    if ((uint32_t)argc > p->argc_max) {
        char why[64];
        snprintf(why, sizeof why, "too many arguments (%d, at most %u)", argc, p->argc_max);
        refusal(p, p->argv[0], p->argl[0], why);
        return RESP_REFUSED;
    }
    if (argc == 0) return PARSE_SKIP; /* an empty line: skipped */
    if (check_inline_limits(p, (uint32_t)argc) < 0) return RESP_REFUSED;
    p->nargs = (uint32_t)argc;
    return RESP_REQUEST;
}

int resp_parse(resp_parser *p, uint8_t *buf, size_t len, size_t *consumed)
{
    *consumed = 0;
    p->nargs = 0;
    for (;;) {
        uint8_t *b = buf + *consumed;
        size_t n = len - *consumed;
        int r;
        if (p->in_array)
            r = parse_array(p, b, n, consumed);
        else if (n == 0)
            return RESP_NEED_MORE;
        else if (b[0] == '*')
            r = start_array(p, b, n, consumed);
        else
            r = parse_inline(p, b, n, consumed);
        if (r != PARSE_SKIP) return r;
    }
}

/* ---- Replies ---- */

void resp_buf_init(resp_buf *b, size_t limit)
{
    memset(b, 0, sizeof *b);
    b->limit = limit;
}

void resp_buf_free(resp_buf *b)
{
    free(b->data);
    b->data = NULL;
    b->len = b->cap = b->sent = 0;
}

void resp_buf_consume(resp_buf *b, size_t n)
{
    b->sent = n < b->sent ? b->sent - n : 0;
    if (n >= b->len) {
        b->len = 0;
        return;
    }
    memmove(b->data, b->data + n, b->len - n);
    b->len -= n;
}

int resp_buf_append(resp_buf *b, const void *p, size_t n)
{
    if (b->overflow || n > b->limit || b->len - b->sent > b->limit - n) {
        b->overflow = 1;
        return -1;
    }
    if (b->len + n > b->cap) {
        size_t cap = b->cap ? b->cap : 256;
        while (cap < b->len + n)
            cap *= 2;
        uint8_t *d = realloc(b->data, cap);
        if (!d) {
            b->overflow = b->no_memory = 1;
            return -1;
        }
        b->data = d;
        b->cap = cap;
    }
    if (n) memcpy(b->data + b->len, p, n);
    b->len += n;
    return 0;
}

int resp_buf_printf(resp_buf *b, const char *fmt, ...)
{
    if (b->overflow) return -1; /* as resp_buf_append: nothing more once a part was refused */
    char line[512];
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(line, sizeof line, fmt, ap);
    va_end(ap);
    if (n < 0) {
        b->overflow = 1;
        return -1;
    }
    if ((size_t)n < sizeof line) return resp_buf_append(b, line, (size_t)n);
    char *whole = malloc((size_t)n + 1); /* longer than the line: made whole, never cut */
    if (!whole) {
        b->overflow = b->no_memory = 1;
        return -1;
    }
    va_start(ap, fmt);
    vsnprintf(whole, (size_t)n + 1, fmt, ap);
    va_end(ap);
    int rc = resp_buf_append(b, whole, (size_t)n);
    free(whole);
    return rc;
}

static int append_line(resp_buf *b, char type, const char *s, size_t n)
{
    char head = type;
    if (resp_buf_append(b, &head, 1) < 0 || resp_buf_append(b, s, n) < 0) return -1;
    return resp_buf_append(b, "\r\n", 2);
}

int resp_simple(resp_buf *b, const char *s)
{
    return append_line(b, '+', s, strlen(s));
}

int resp_error(resp_buf *b, const char *s)
{
    char line[512];
    size_t n = strlen(s);
    if (n >= sizeof line) n = sizeof line - 1;
    for (size_t i = 0; i < n; i++)
        line[i] = s[i] == '\r' || s[i] == '\n' ? ' ' : s[i];
    return append_line(b, '-', line, n);
}

int resp_errorf(resp_buf *b, const char *fmt, ...)
{
    char line[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(line, sizeof line, fmt, ap);
    va_end(ap);
    return resp_error(b, line);
}

/* Decimal digits of v into s (at least 21 bytes); returns the length. Replies carry numbers in
 * every answer: formatting them without printf is a measurable share of idemd's time. */
static int fmt_u64(char *s, uint64_t v)
{
    char t[20];
    int n = 0;
    do {
        t[n++] = (char)('0' + v % 10);
        v /= 10;
    } while (v);
    for (int i = 0; i < n; i++)
        s[i] = t[n - 1 - i];
    return n;
}

static int fmt_i64(char *s, int64_t v)
{
    if (v >= 0) return fmt_u64(s, (uint64_t)v);
    s[0] = '-';
    return 1 + fmt_u64(s + 1, (uint64_t)0 - (uint64_t)v);
}

int resp_integer(resp_buf *b, int64_t v)
{
    char s[24];
    int n = fmt_i64(s, v);
    return append_line(b, ':', s, (size_t)n);
}

int resp_bulk(resp_buf *b, const void *p, size_t n)
{
    char s[24];
    int k = fmt_u64(s, n);
    if (append_line(b, '$', s, (size_t)k) < 0 || resp_buf_append(b, p, n) < 0) return -1;
    return resp_buf_append(b, "\r\n", 2);
}

int resp_bulk_str(resp_buf *b, const char *s)
{
    return resp_bulk(b, s, strlen(s));
}

int resp_bulk_u64(resp_buf *b, uint64_t v)
{
    char s[24];
    int n = fmt_u64(s, v);
    return resp_bulk(b, s, (size_t)n);
}

int resp_bulk_i64(resp_buf *b, int64_t v)
{
    char s[24];
    int n = fmt_i64(s, v);
    return resp_bulk(b, s, (size_t)n);
}

int resp_nil(resp_buf *b)
{
    return resp_buf_append(b, "$-1\r\n", 5);
}

int resp_array(resp_buf *b, int64_t n)
{
    char s[24];
    int k = fmt_i64(s, n);
    return append_line(b, '*', s, (size_t)k);
}
