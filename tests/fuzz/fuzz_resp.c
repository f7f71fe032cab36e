/*
 * fuzz_resp.c: libFuzzer target for the RESP request parser (src/server/resp.c).
 *
 * Input: byte 0 picks argc_max (1..64, its low six bits) and which limits are lowered (its top
 * two bits: req_max to 16..1036 bytes from byte 1, inline_max to 8..518 from byte 2), bytes 1-2
 * seed the piece sizes, byte 3 picks the largest piece (1..256 bytes); the rest is the byte
 * stream of one connection. (The limits' own values, 64 KiB and more, lie past the inputs
 * libFuzzer makes.)
 *
 * The stream is parsed twice, as a server would (drop what is consumed, call again while a
 * request or a refusal comes out, wait for more bytes on NEED_MORE, stop on CLOSE): once handed
 * over whole, once in pieces. The unconsumed bytes always end right before a PROT_NONE page
 * (picohttpparser's test.c), so a read past `len` faults. Checked:
 *   - no crash, no read past the buffer, consumed <= len;
 *   - argv of a request lies inside the consumed bytes; nargs in 1..argc_max;
 *   - the arg_max callback sees index < argc_max and earlier arguments inside the buffer;
 *   - err of a refusal is a nonempty string; the -ERR reply made of it holds no CR or LF;
 *   - what is left unconsumed waiting for more bytes never passes the bounds resp.h states:
 *     max(inline_max, RESP_LINE_MAX) outside an array request and, with req_max set,
 *     max(req_max, RESP_LINE_MAX) + RESP_LINE_MAX inside one, so a connection's memory is
 *     bounded whatever it sends;
 *   - the events (requests with their arguments, refusals and closes with their messages)
 *     of the whole parse equal those of the piecewise parse.
 *
 * Divergences found so far (K1: a first line "POST..." split after its fourth byte; fixed in
 * resp.c looks_like_http, crash input kept in tests/fuzz/crashes/) are checked like any input.
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "resp.h"

#define INPUT_MAX  (256u * 1024u)
#define EVENTS_MAX (1024u * 1024u)

/* The connection buffer: its unconsumed bytes end at `end`, the first byte of a PROT_NONE page. */
struct conn {
    uint8_t *end;
    size_t have;
    size_t cap;
};

/* What the parser said, serialised: one tag byte, then lengths and bytes. */
struct events {
    uint8_t *p;
    size_t len;
    int overflow;
};

struct arg_ctx {
    const uint8_t *buf;
    size_t len;
    uint32_t argc_max;
    size_t req_max, inline_max; /* 0: left as init has them */
};

static uint8_t *region;
static size_t region_bytes;

static void fail(const char *what)
{
    fprintf(stderr, "fuzz_resp: %s\n", what);
    abort();
}

static void setup_region(void)
{
    long page = sysconf(_SC_PAGESIZE);
    size_t data = (INPUT_MAX + (size_t)page - 1) / (size_t)page * (size_t)page;
    uint8_t *m = mmap(NULL, data + 2 * (size_t)page, PROT_READ | PROT_WRITE,
                      MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (m == MAP_FAILED) fail("mmap");
    /* Guard pages before and after the data. */
    if (mprotect(m, (size_t)page, PROT_NONE) || mprotect(m + page + data, (size_t)page, PROT_NONE))
        fail("mprotect");
    region = m + page;
    region_bytes = data;
}

static void conn_init(struct conn *c)
{
    c->end = region + region_bytes;
    c->have = 0;
    c->cap = region_bytes;
}

static uint8_t *conn_data(const struct conn *c)
{
    return c->end - c->have;
}

static void conn_append(struct conn *c, const uint8_t *p, size_t n)
{
    if (c->have + n > c->cap) fail("connection buffer overflow (harness)");
    memmove(c->end - c->have - n, c->end - c->have, c->have);
    memcpy(c->end - n, p, n);
    c->have += n;
}

static void ev_put(struct events *e, const void *p, size_t n)
{
    if (e->overflow || e->len + n > EVENTS_MAX) {
        e->overflow = 1;
        return;
    }
    memcpy(e->p + e->len, p, n);
    e->len += n;
}

static void ev_put_u32(struct events *e, uint32_t v)
{
    ev_put(e, &v, sizeof v);
}

/* Field limits that depend on the arguments before (as the server's command table does). */
static uint32_t arg_max(void *ctx, const uint8_t *const *argv, const uint32_t *argl, uint32_t index,
                        const char **field)
{
    struct arg_ctx *a = ctx;
    if (*field) fail("arg_max's field is not NULL on entry");
    if (index % 2) *field = "field";
    if (index >= a->argc_max) fail("arg_max called past argc_max");
    for (uint32_t i = 0; i < index; i++) {
        if (argv[i] < a->buf || argv[i] + argl[i] > a->buf + a->len)
            fail("arg_max sees an argument outside the buffer");
    }
    if (index == 0) return 64;
    /* Commands of one letter have small fields; others none beyond the protocol's. */
    if (argl[0] == 1) return 8u * index;
    return RESP_BULK_PROTO_MAX;
}

static void check_err(const resp_parser *p, int need_text)
{
    size_t n = strnlen(p->err, sizeof p->err);
    if (n == sizeof p->err) fail("err not terminated");
    if (need_text && n == 0) fail("refusal without a message");
    resp_buf b;
    resp_buf_init(&b, 4096);
    if (resp_error(&b, p->err) == 0) {
        if (b.len < 3 || b.data[0] != '-') fail("error reply malformed");
        for (size_t i = 1; i + 2 < b.len; i++)
            if (b.data[i] == '\r' || b.data[i] == '\n') fail("CR or LF inside an error reply");
    }
    resp_buf_free(&b);
}

/* The most a connection may hold of a request not yet answered (resp.h). */
static size_t held_max(const resp_parser *p)
{
    size_t line = RESP_LINE_MAX;
    if (!p->in_array) return p->inline_max > line ? p->inline_max : line;
    if (!p->req_max) return SIZE_MAX;
    return (p->req_max > line ? p->req_max : line) + line;
}

/* Calls resp_parse until it wants more bytes; logs events. Returns 1 once the connection is
 * closed. */
static int drain(resp_parser *p, struct conn *c, struct arg_ctx *a, struct events *e)
{
    for (int guard = 0; guard < 1000000; guard++) {
        uint8_t *buf = conn_data(c);
        size_t len = c->have, consumed = 0;
        a->buf = buf;
        a->len = len;
        int r = resp_parse(p, buf, len, &consumed);
        if (consumed > len) fail("consumed > len");
        switch (r) {
        case RESP_NEED_MORE:
            c->have -= consumed;
            if (c->have > held_max(p)) fail("bytes held for a request pass the limits");
            return 0;
        case RESP_REQUEST:
            if (p->nargs == 0 || p->nargs > a->argc_max) fail("nargs out of range");
            if (consumed == 0) fail("request consumed nothing");
            ev_put(e, "Q", 1);
            ev_put_u32(e, p->nargs);
            for (uint32_t i = 0; i < p->nargs; i++) {
                if (p->argv[i] < buf || p->argv[i] + p->argl[i] > buf + consumed)
                    fail("argument outside the consumed bytes");
                ev_put_u32(e, p->argl[i]);
                ev_put(e, p->argv[i], p->argl[i]);
            }
            break;
        case RESP_REFUSED:
            check_err(p, 1);
            ev_put(e, "R", 1);
            ev_put(e, p->err, strlen(p->err) + 1);
            break;
        case RESP_CLOSE:
            check_err(p, 0);
            ev_put(e, "C", 1);
            ev_put(e, p->err, strlen(p->err) + 1);
            return 1;
        default:
            fail("unknown status");
        }
        c->have -= consumed;
    }
    fail("parser loops without progress");
    return 1;
}

static uint64_t next_rand(uint64_t *s)
{
    uint64_t z = (*s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

static void parse_stream(const struct arg_ctx *limits, const uint8_t *s, size_t n, uint64_t seed,
                         uint32_t piece_max, struct events *e)
{
    resp_parser p;
    struct conn c;
    uint32_t argc_max = limits->argc_max;
    struct arg_ctx a = *limits;
    resp_parser_init(&p, argc_max, arg_max, &a);
    if (limits->req_max) p.req_max = limits->req_max;
    if (limits->inline_max) p.inline_max = limits->inline_max;
    conn_init(&c);
    size_t off = 0;
    while (off < n) {
        size_t k = piece_max ? 1 + next_rand(&seed) % piece_max : n - off;
        if (k > n - off) k = n - off;
        conn_append(&c, s + off, k);
        off += k;
        if (drain(&p, &c, &a, e)) return;
    }
    ev_put(e, "N", 1); /* ended waiting for more */
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    static struct events whole, pieces;
    if (!region) {
        setup_region();
        whole.p = malloc(EVENTS_MAX);
        pieces.p = malloc(EVENTS_MAX);
        if (!whole.p || !pieces.p) fail("malloc");
    }
    if (size < 4 || size - 4 > INPUT_MAX) return 0;
    struct arg_ctx limits = {.argc_max = 1u + data[0] % RESP_ARGV_MAX};
    if (data[0] & 0x40) limits.req_max = 16u + 4u * data[1];
    if (data[0] & 0x80) limits.inline_max = 8u + 2u * data[2];
    uint64_t seed = (uint64_t)data[1] | (uint64_t)data[2] << 8;
    uint32_t piece_max = 1u + data[3];
    const uint8_t *s = data + 4;
    size_t n = size - 4;

    whole.len = pieces.len = 0;
    whole.overflow = pieces.overflow = 0;
    parse_stream(&limits, s, n, 0, 0, &whole);
    parse_stream(&limits, s, n, seed, piece_max, &pieces);
    if (whole.overflow || pieces.overflow) return 0;
    if (whole.len != pieces.len || memcmp(whole.p, pieces.p, whole.len)) {
        size_t i = 0;
        while (i < whole.len && i < pieces.len && whole.p[i] == pieces.p[i])
            i++;
        fprintf(stderr,
                "fuzz_resp: whole and piecewise parses differ at event byte %zu "
                "(whole %zu bytes, pieces %zu bytes)\n",
                i, whole.len, pieces.len);
        abort();
    }
    return 0;
}
