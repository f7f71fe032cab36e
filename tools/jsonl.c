/*
 * jsonl.c: the JSON that import reads: one flat object per line (what export writes): string,
 * integer, true/false and null values; nested objects and arrays are refused. Strings are
 * decoded (\uXXXX to UTF-8, surrogate pairs joined).
 */
#include <ctype.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ctl.h"

#define JSONL_FIELDS_MAX 64

struct jp {
    const char *p;
    char *err;
    size_t errcap;
};

static void skip_ws(struct jp *j)
{
    while (*j->p == ' ' || *j->p == '\t' || *j->p == '\r' || *j->p == '\n')
        j->p++;
}

static int fail(struct jp *j, const char *what)
{
    snprintf(j->err, j->errcap, "%s", what);
    return -1;
}

static size_t put_utf8(char *o, unsigned cp)
{
    if (cp < 0x80) {
        o[0] = (char)cp;
        return 1;
    }
    if (cp < 0x800) {
        o[0] = (char)(0xc0 | cp >> 6);
        o[1] = (char)(0x80 | (cp & 0x3f));
        return 2;
    }
    if (cp < 0x10000) {
        o[0] = (char)(0xe0 | cp >> 12);
        o[1] = (char)(0x80 | (cp >> 6 & 0x3f));
        o[2] = (char)(0x80 | (cp & 0x3f));
        return 3;
    }
    o[0] = (char)(0xf0 | cp >> 18);
    o[1] = (char)(0x80 | (cp >> 12 & 0x3f));
    o[2] = (char)(0x80 | (cp >> 6 & 0x3f));
    o[3] = (char)(0x80 | (cp & 0x3f));
    return 4;
}

static int hex4(const char *p, unsigned *out)
{
    char tmp[5] = {0};
    for (int i = 0; i < 4; i++) {
        if (!isxdigit((unsigned char)p[i])) return -1;
        tmp[i] = p[i];
    }
    *out = (unsigned)strtoul(tmp, NULL, 16);
    return 0;
}

/* Parses the string at j->p (at its opening quote) into a malloc'd buffer. */
static int parse_string(struct jp *j, char **out, size_t *len)
{
    const char *p = j->p + 1, *q = p;
    /* Decoded, a string is no longer than its text up to the closing quote: that much, not the
     * rest of the line (a line of many strings reserved the line for each). */
    while (*q && *q != '"')
        q += q[0] == '\\' && q[1] ? 2 : 1;
    char *o = malloc((size_t)(q - p) + 1);
    if (!o) return fail(j, "out of memory");
    size_t n = 0;
    while (*p && *p != '"') {
        if (*p != '\\') {
            o[n++] = *p++;
            continue;
        }
        p++;
        unsigned cp, lo;
        switch (*p) {
        case '"':
        case '\\':
        case '/':
            o[n++] = *p;
            break;
        case 'b':
            o[n++] = '\b';
            break;
        case 'f':
            o[n++] = '\f';
            break;
        case 'n':
            o[n++] = '\n';
            break;
        case 'r':
            o[n++] = '\r';
            break;
        case 't':
            o[n++] = '\t';
            break;
        case 'u':
            if (hex4(p + 1, &cp) < 0) goto bad;
            p += 4;
            if (cp >= 0xd800 && cp < 0xdc00 && p[1] == '\\' && p[2] == 'u' &&
                hex4(p + 3, &lo) == 0 && lo >= 0xdc00 && lo < 0xe000) {
                cp = 0x10000 + ((cp - 0xd800) << 10) + (lo - 0xdc00);
                p += 6;
            }
            n += put_utf8(o + n, cp);
            break;
        default:
            goto bad;
        }
        p++;
    }
    if (*p != '"') goto bad;
    o[n] = 0;
    *out = o;
    *len = n;
    j->p = p + 1;
    return 0;
bad:
    free(o);
    return fail(j, "bad string");
}

static int parse_value(struct jp *j, struct jfield *f)
{
    skip_ws(j);
    if (*j->p == '"') return parse_string(j, &f->str, &f->len);
    if (strncmp(j->p, "null", 4) == 0) {
        f->is_null = 1;
        j->p += 4;
        return 0;
    }
    if (strncmp(j->p, "true", 4) == 0 || strncmp(j->p, "false", 5) == 0) {
        f->is_bool = 1;
        f->num = *j->p == 't';
        j->p += f->num ? 4 : 5;
        return 0;
    }
    if (*j->p == '-' || isdigit((unsigned char)*j->p)) {
        char *end;
        errno = 0;
        long long v = strtoll(j->p, &end, 10);
        if (errno || *end == '.' || *end == 'e' || *end == 'E')
            return fail(j, "numbers must be integers in range");
        f->is_num = 1;
        f->num = v;
        j->p = end;
        return 0;
    }
    return fail(j, *j->p == '{' || *j->p == '[' ? "nested values are not supported" : "bad value");
}

int jsonl_parse(const char *line, struct jfield **out, char *err, size_t errcap)
{
    struct jp j = {line, err, errcap};
    err[0] = 0;
    struct jfield *f = calloc(JSONL_FIELDS_MAX, sizeof *f);
    int n = 0;
    if (!f) return fail(&j, "out of memory");
    skip_ws(&j);
    if (*j.p++ != '{') goto bad;
    skip_ws(&j);
    while (*j.p != '}') {
        size_t len;
        if (n == JSONL_FIELDS_MAX || *j.p != '"' || parse_string(&j, &f[n].name, &len) < 0)
            goto bad;
        skip_ws(&j);
        if (*j.p++ != ':' || parse_value(&j, &f[n++]) < 0) goto bad;
        skip_ws(&j);
        if (*j.p == ',') {
            j.p++;
            skip_ws(&j);
        } else if (*j.p != '}') {
            goto bad;
        }
    }
    j.p++;
    skip_ws(&j);
    if (*j.p) goto bad;
    *out = f;
    return n;
bad:
    if (!err[0]) fail(&j, "not a flat JSON object");
    jfields_free(f, n);
    return -1;
}

void jfields_free(struct jfield *f, int n)
{
    for (int i = 0; f && i < n; i++) {
        free(f[i].name);
        free(f[i].str);
    }
    free(f);
}

const struct jfield *jfield_get(const struct jfield *f, int n, const char *name)
{
    for (int i = 0; i < n; i++)
        if (f[i].name && strcmp(f[i].name, name) == 0) return &f[i];
    return NULL;
}
