/*
 * test_resp.c: the RESP2 request parser and reply writers of idemd (src/server/resp.c), bytes
 * only. Every request is placed so that its last byte is the last byte of a mapped page followed
 * by a PROT_NONE page: a read past the input faults.
 */
#include "../src/server/resp.c"

#include <criterion/criterion.h>
#include <sys/mman.h>
#include <unistd.h>

#include "testutil.h"
#include "util.h"

/* ---- guarded buffers ---- */

typedef struct guarded {
    uint8_t *map;
    size_t map_len;
    uint8_t *data; /* data + len == the guard page */
    size_t len;
} guarded;

static guarded guard_copy(const void *src, size_t len)
{
    guarded g;
    size_t page = (size_t)sysconf(_SC_PAGESIZE);
    size_t data_pages = (len + page - 1) / page;
    if (data_pages == 0) data_pages = 1;
    g.map_len = (data_pages + 1) * page;
    g.map = mmap(NULL, g.map_len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    cr_assert(g.map != MAP_FAILED);
    cr_assert(mprotect(g.map + data_pages * page, page, PROT_NONE) == 0);
    g.data = g.map + data_pages * page - len;
    g.len = len;
    if (len) memcpy(g.data, src, len);
    return g;
}

static void guard_free(guarded *g)
{
    munmap(g->map, g->map_len);
}

/* Field limits like idemd's: argument 1 at most 16 bytes, others free; GET names it "key". */
static uint32_t test_arg_max(void *ctx, const uint8_t *const *argv, const uint32_t *argl,
                             uint32_t index, const char **field)
{
    (void)ctx;
    if (index == 1 && argl[0] == 3 && memcmp(argv[0], "GET", 3) == 0) *field = "key";
    return index == 1 ? 16 : RESP_BULK_PROTO_MAX;
}

static resp_parser parser(void)
{
    resp_parser p;
    resp_parser_init(&p, 8, test_arg_max, NULL);
    return p;
}

/* Parses bytes once, from a guarded copy. */
static int parse_once(resp_parser *p, const char *s, size_t len, size_t *consumed)
{
    guarded g = guard_copy(s, len);
    int r = resp_parse(p, g.data, g.len, consumed);
    /* argv points into g: copy what the caller checks before unmapping */
    static uint8_t keep[RESP_ARGV_MAX][64];
    for (uint32_t i = 0; r == RESP_REQUEST && i < p->nargs; i++) {
        cr_assert(p->argl[i] < 64);
        memcpy(keep[i], p->argv[i], p->argl[i]);
        p->argv[i] = keep[i];
    }
    guard_free(&g);
    return r;
}

static void expect_args(const resp_parser *p, int n, const char *const *want)
{
    cr_assert_eq(p->nargs, (uint32_t)n);
    for (int i = 0; i < n; i++) {
        cr_assert_eq(p->argl[i], strlen(want[i]), "arg %d length", i);
        cr_assert(memcmp(p->argv[i], want[i], p->argl[i]) == 0, "arg %d", i);
    }
}

/* ---- whole requests and truncations ---- */

static const char *const valid[] = {
    "*1\r\n$4\r\nPING\r\n",
    "*3\r\n$3\r\nSET\r\n$1\r\nk\r\n$0\r\n\r\n",
    "*2\r\n$4\r\nECHO\r\n$12\r\nhello\r\nworld\r\n",
    "PING\r\n",
    "PING\n",
    "ECHO \"a b\\x41\\n\" 'c\\'d'\r\n",
};
static const int valid_argc[] = {1, 3, 2, 1, 1, 3};

Test(resp, every_truncation_needs_more_and_the_whole_parses)
{
    for (size_t v = 0; v < IDEM_ARRAY_LEN(valid); v++) {
        size_t n = strlen(valid[v]);
        for (size_t k = 0; k < n; k++) {
            resp_parser p = parser();
            size_t consumed = 99;
            int r = parse_once(&p, valid[v], k, &consumed);
            cr_assert_eq(r, RESP_NEED_MORE, "request %zu cut at %zu", v, k);
            cr_assert_eq(consumed, 0);
        }
        resp_parser p = parser();
        size_t consumed;
        cr_assert_eq(parse_once(&p, valid[v], n, &consumed), RESP_REQUEST, "request %zu", v);
        cr_assert_eq(consumed, n);
        cr_assert_eq(p.nargs, (uint32_t)valid_argc[v]);
    }
}

/* Feeds the bytes one at a time the way idemd does (dropping what is consumed) and returns the
 * statuses seen other than NEED_MORE. */
static uint32_t last_nargs;

static int feed_bytewise(resp_parser *p, const char *s, size_t n, int *out, int out_max)
{
    uint8_t buf[4096];
    size_t have = 0;
    int k = 0;
    for (size_t i = 0; i < n; i++) {
        buf[have++] = (uint8_t)s[i];
        for (;;) {
            guarded g = guard_copy(buf, have);
            size_t consumed = 0;
            int r = resp_parse(p, g.data, g.len, &consumed);
            guard_free(&g);
            cr_assert(consumed <= have);
            memmove(buf, buf + consumed, have - consumed);
            have -= consumed;
            if (r == RESP_NEED_MORE) break;
            cr_assert(k < out_max);
            out[k++] = r;
            if (r == RESP_REQUEST) last_nargs = p->nargs;
            if (r == RESP_CLOSE) return k;
        }
    }
    cr_assert_eq(have, 0, "bytes left over");
    return k;
}

Test(resp, bytewise_feeding_keeps_state_between_calls)
{
    for (size_t v = 0; v < IDEM_ARRAY_LEN(valid); v++) {
        resp_parser p = parser();
        int st[4];
        int k = feed_bytewise(&p, valid[v], strlen(valid[v]), st, 4);
        cr_assert_eq(k, 1);
        cr_assert_eq(st[0], RESP_REQUEST);
        cr_assert_eq(last_nargs, (uint32_t)valid_argc[v]);
    }
}

Test(resp, inline_quotes_are_unescaped)
{
    resp_parser p = parser();
    size_t c;
    cr_assert_eq(parse_once(&p, valid[5], strlen(valid[5]), &c), RESP_REQUEST);
    const char *want[] = {"ECHO", "a bA\n", "c'd"};
    expect_args(&p, 3, want);
}

Test(resp, binary_bulk_with_crlf_inside)
{
    resp_parser p = parser();
    size_t c;
    cr_assert_eq(parse_once(&p, valid[2], strlen(valid[2]), &c), RESP_REQUEST);
    const char *want[] = {"ECHO", "hello\r\nworld"};
    expect_args(&p, 2, want);
}

Test(resp, pipelined_requests_come_out_in_order)
{
    const char *in = "*1\r\n$4\r\nPING\r\nECHO x\r\n\r\n*0\r\n*2\r\n$3\r\nGET\r\n$1\r\nk\r\n";
    guarded g = guard_copy(in, strlen(in));
    resp_parser p = parser();
    size_t off = 0, c;
    const char *names[] = {"PING", "ECHO", "GET"};
    for (int i = 0; i < 3; i++) {
        cr_assert_eq(resp_parse(&p, g.data + off, g.len - off, &c), RESP_REQUEST, "req %d", i);
        cr_assert(p.argl[0] == strlen(names[i]) && memcmp(p.argv[0], names[i], p.argl[0]) == 0);
        off += c;
    }
    cr_assert_eq(resp_parse(&p, g.data + off, g.len - off, &c), RESP_NEED_MORE);
    cr_assert_eq(off, g.len);
    guard_free(&g);
}

/* ---- malformed input ---- */

Test(resp, malformed_framing_closes)
{
    const char *bad[] = {
        "*x\r\n",        "*1\r\n:5\r\n",      "*1\r\n$-1\r\n",   "*1\r\n$3\r\nabcXY",
        "*1\r\n$3x\r\n", "*1\n$3\r\nabc\r\n", "*3000000\r\n",    "*1\r\n$99999999999\r\n",
        "*1\r\n$\r\n",   "ECHO \"abc\r\n",    "ECHO \"a\"b\r\n", "*12345678901234567890123\r\n",
    };
    for (size_t i = 0; i < IDEM_ARRAY_LEN(bad); i++) {
        resp_parser p = parser();
        size_t c;
        cr_assert_eq(parse_once(&p, bad[i], strlen(bad[i]), &c), RESP_CLOSE, "input %zu", i);
        cr_assert(p.err[0] != '\0', "input %zu has a message", i);
    }
}

Test(resp, bulk_over_protocol_limit_closes)
{
    char s[64];
    snprintf(s, sizeof s, "*2\r\n$3\r\nSET\r\n$%u\r\n", RESP_BULK_PROTO_MAX + 1);
    resp_parser p = parser();
    size_t c;
    cr_assert_eq(parse_once(&p, s, strlen(s), &c), RESP_CLOSE);
}

Test(resp, random_garbage_never_crashes_or_overreads)
{
    uint64_t seed = tu_seed("resp.random_garbage"), st = seed;
    const char alphabet[] = "*$\r\n0123456789-abc \"'\\x";
    for (int round = 0; round < 2000; round++) {
        char s[96];
        size_t n = tu_rand(&st) % sizeof s;
        for (size_t i = 0; i < n; i++)
            s[i] = (tu_rand(&st) & 1) ? (char)tu_rand(&st)
                                      : alphabet[tu_rand(&st) % (sizeof alphabet - 1)];
        resp_parser p = parser();
        guarded g = guard_copy(s, n);
        size_t off = 0, c;
        for (int steps = 0; steps < 100; steps++) {
            int r = resp_parse(&p, g.data + off, g.len - off, &c);
            cr_assert(c <= g.len - off, "seed %llu", (unsigned long long)seed);
            off += c;
            if (r == RESP_NEED_MORE || r == RESP_CLOSE) break;
            cr_assert(r == RESP_REQUEST || r == RESP_REFUSED);
        }
        guard_free(&g);
    }
}

/* ---- limits ---- */

Test(resp, too_many_arguments_is_refused_and_the_next_request_parses)
{
    char s[512] = "*10\r\n";
    for (int i = 0; i < 10; i++)
        strcat(s, "$1\r\nx\r\n");
    strcat(s, "PING\r\n");
    resp_parser p = parser();
    int st[4];
    int k = feed_bytewise(&p, s, strlen(s), st, 4);
    cr_assert_eq(k, 2);
    cr_assert_eq(st[0], RESP_REFUSED);
    cr_assert_eq(st[1], RESP_REQUEST);
    cr_assert_str_eq(p.err, "ERR x: too many arguments (10, at most 8)",
                     "the refusal names the command, even when it came a byte at a time");

    resp_parser q = parser();
    size_t c;
    const char *big = "*10\r\n$1\r\nx\r\n$1\r\nx\r\n$1\r\nx\r\n$1\r\nx\r\n$1\r\nx\r\n$1\r\nx\r\n"
                      "$1\r\nx\r\n$1\r\nx\r\n$1\r\nx\r\n$1\r\nx\r\n";
    cr_assert_eq(parse_once(&q, big, strlen(big), &c), RESP_REFUSED);
    cr_assert_str_eq(q.err, "ERR x: too many arguments (10, at most 8)");
    cr_assert_eq(c, strlen(big));
}

Test(resp, oversized_field_is_discarded_while_streaming)
{
    /* argument 1 may hold 16 bytes; send 100000 in chunks and check nothing is kept */
    resp_parser p = parser();
    const char *head = "*3\r\n$3\r\nGET\r\n$100000\r\n";
    uint8_t chunk[4096];
    size_t consumed;
    int r = parse_once(&p, head, strlen(head), &consumed);
    cr_assert_eq(r, RESP_NEED_MORE);
    cr_assert_eq(consumed, strlen(head), "a refused request keeps no bytes");
    memset(chunk, 'z', sizeof chunk);
    size_t left = 100000;
    while (left > 0) {
        size_t n = left < sizeof chunk ? left : sizeof chunk;
        guarded g = guard_copy(chunk, n);
        cr_assert_eq(resp_parse(&p, g.data, g.len, &consumed), RESP_NEED_MORE);
        cr_assert_eq(consumed, n);
        guard_free(&g);
        left -= n;
    }
    const char *tail = "\r\n$1\r\nv\r\nPING\r\n";
    guarded g = guard_copy(tail, strlen(tail));
    cr_assert_eq(resp_parse(&p, g.data, g.len, &consumed), RESP_REFUSED);
    cr_assert(strstr(p.err, "GET: key (argument 2) is too long (100000 bytes, at most 16)"), "%s",
              p.err);
    size_t off = consumed;
    cr_assert_eq(resp_parse(&p, g.data + off, g.len - off, &consumed), RESP_REQUEST);
    cr_assert_eq(p.argl[0], 4);
    guard_free(&g);
}

Test(resp, oversized_inline_field_is_refused)
{
    resp_parser p = parser();
    size_t c;
    const char *s = "GET 0123456789abcdefXYZ\r\n";
    cr_assert_eq(parse_once(&p, s, strlen(s), &c), RESP_REFUSED);
    cr_assert_str_eq(p.err, "ERR GET: key (argument 2) is too long (19 bytes, at most 16)");
    cr_assert_eq(c, strlen(s));
    /* A field without a name is named by its place. */
    s = "SET 0123456789abcdefXYZ v\r\n";
    cr_assert_eq(parse_once(&p, s, strlen(s), &c), RESP_REFUSED);
    cr_assert_str_eq(p.err, "ERR SET: argument 2 is too long (19 bytes, at most 16)");
}

/* A refusal keeps the request's name (idemd answers one before AUTH by it), and one refused
 * before its name was read keeps none, not the name of the request refused before it. */
Test(resp, a_refusal_keeps_its_request_name_and_a_nameless_one_none)
{
    resp_parser p = parser();
    size_t c;
    const char *s = "*2\r\n$3\r\nGET\r\n$20\r\n01234567890123456789\r\n";
    cr_assert_eq(parse_once(&p, s, strlen(s), &c), RESP_REFUSED);
    cr_assert_eq(p.refused_name_len, 3);
    cr_assert(memcmp(p.refused_name, "GET", 3) == 0);
    p.req_max = 64; /* the next request passes it with its first bulk: no name read */
    char big[160];
    int n = snprintf(big, sizeof big, "*1\r\n$100\r\n%0100d\r\n", 7);
    cr_assert_eq(parse_once(&p, big, (size_t)n, &c), RESP_REFUSED);
    cr_assert(strstr(p.err, "request too large"), "%s", p.err);
    cr_assert_eq(p.refused_name_len, 0);
    s = "SET 0123456789abcdefXYZ v\r\n"; /* inline */
    cr_assert_eq(parse_once(&p, s, strlen(s), &c), RESP_REFUSED);
    cr_assert_eq(p.refused_name_len, 3);
    cr_assert(memcmp(p.refused_name, "SET", 3) == 0);
    /* a name past 64 bytes is not kept */
    n = snprintf(big, sizeof big, "*9\r\n$65\r\n%065d\r\n", 1);
    p.req_max = 0;
    cr_assert_eq(parse_once(&p, big, (size_t)n, &c), RESP_NEED_MORE); /* 9 > argc_max 8 */
    const char *rest = "$1\r\na\r\n$1\r\na\r\n$1\r\na\r\n$1\r\na\r\n$1\r\na\r\n$1\r\na\r\n"
                       "$1\r\na\r\n$1\r\na\r\n";
    cr_assert_eq(parse_once(&p, rest, strlen(rest), &c), RESP_REFUSED);
    cr_assert(strstr(p.err, "too many arguments"), "%s", p.err);
    cr_assert_eq(p.refused_name_len, 0);
}

Test(resp, inline_line_over_limit_closes)
{
    size_t n = RESP_INLINE_MAX + 10;
    char *s = malloc(n);
    memset(s, 'a', n);
    resp_parser p = parser();
    size_t c;
    guarded g = guard_copy(s, n);
    cr_assert_eq(resp_parse(&p, g.data, g.len, &c), RESP_CLOSE);
    guard_free(&g);
    free(s);
}

Test(resp, inline_argument_count_is_limited)
{
    resp_parser p = parser();
    size_t c;
    const char *s = "a b c d e f g h i j\r\nPING\r\n";
    cr_assert_eq(parse_once(&p, s, strlen(s), &c), RESP_REFUSED);
    cr_assert_str_eq(p.err, "ERR a: too many arguments (10, at most 8)"); /* as in RESP */
}

Test(resp, empty_lines_are_skipped)
{
    resp_parser p = parser();
    size_t c;
    cr_assert_eq(parse_once(&p, "\r\n\n   \r\nPING\r\n", 14, &c), RESP_REQUEST);
    cr_assert_eq(c, 14);
}

/* ---- HTTP on the first line ---- */

Test(resp, http_first_line_closes)
{
    const char *http[] = {"POST / HTTP/1.1\r\n",
                          "GET / HTTP/1.1\r\n",
                          "Host: 127.0.0.1\r\n",
                          "POST /api",
                          "GET /x",
                          "host: a"};
    for (size_t i = 0; i < IDEM_ARRAY_LEN(http); i++) {
        resp_parser p = parser();
        size_t c;
        cr_assert_eq(parse_once(&p, http[i], strlen(http[i]), &c), RESP_CLOSE, "%s", http[i]);
    }
}

Test(resp, only_the_first_line_is_checked_for_http)
{
    resp_parser p = parser();
    size_t c;
    cr_assert_eq(parse_once(&p, "GET k\r\n", 7, &c), RESP_REQUEST);
    cr_assert_eq(parse_once(&p, "GET /k\r\n", 8, &c), RESP_REQUEST);
    resp_parser q = parser();
    cr_assert_eq(parse_once(&q, "*1\r\n$4\r\nPING\r\n", 14, &c), RESP_REQUEST);
    cr_assert_eq(parse_once(&q, "POST /\r\n", 8, &c), RESP_REQUEST);
}

/* ---- replies ---- */

Test(resp, reply_writers_emit_resp2)
{
    resp_buf b;
    resp_buf_init(&b, 1 << 20);
    resp_simple(&b, "OK");
    resp_error(&b, "ERR bad\r\nthing");
    resp_integer(&b, -42);
    resp_bulk(&b, "a\r\nb", 4);
    resp_nil(&b);
    resp_array(&b, 2);
    resp_bulk_u64(&b, 18446744073709551615ull);
    resp_bulk_str(&b, "");
    const char *want = "+OK\r\n-ERR bad  thing\r\n:-42\r\n$4\r\na\r\nb\r\n$-1\r\n*2\r\n"
                       "$20\r\n18446744073709551615\r\n$0\r\n\r\n";
    cr_assert_eq(b.len, strlen(want));
    cr_assert(memcmp(b.data, want, b.len) == 0);
    resp_buf_consume(&b, 5);
    cr_assert(memcmp(b.data, "-ERR", 4) == 0);
    resp_buf_free(&b);
}

Test(resp, integers_at_their_limits)
{
    resp_buf b;
    resp_buf_init(&b, 1 << 20);
    resp_integer(&b, 0);
    resp_integer(&b, INT64_MIN);
    resp_integer(&b, INT64_MAX);
    resp_bulk_i64(&b, -1);
    resp_array(&b, 10);
    const char *want = ":0\r\n:-9223372036854775808\r\n:9223372036854775807\r\n$2\r\n-1\r\n"
                       "*10\r\n";
    cr_assert_eq(b.len, strlen(want), "%.*s", (int)b.len, b.data);
    cr_assert(memcmp(b.data, want, b.len) == 0);
    resp_buf_free(&b);
}

Test(resp, reply_buffer_limit_is_enforced)
{
    resp_buf b;
    resp_buf_init(&b, 16);
    cr_assert_eq(resp_simple(&b, "OK"), 0);
    cr_assert_eq(resp_bulk(&b, "0123456789abcdef", 16), -1);
    cr_assert(b.overflow);
    resp_buf_free(&b);
}
