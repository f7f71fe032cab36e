/*
 * resp.h: RESP2 requests in, RESP2 replies out. Bytes only: no sockets, no engine.
 *
 * The parser is incremental. It is handed the unconsumed bytes of a connection again and again
 * (the same bytes, plus whatever arrived since) and keeps its position between calls, so it
 * never re-scans a request and never reads past `len`. A request is either:
 *   - an array of bulk strings: `*<argc>\r\n` then argc times `$<len>\r\n<bytes>\r\n`, or
 *   - an inline command: one line of words separated by blanks, ended by `\n` (optionally
 *     `\r\n`), with "double" and 'single' quotes as Redis accepts them.
 *
 * Limits:
 *   - argc above argc_max: the rest of the request is discarded and it is refused (-ERR);
 *     argc above RESP_ARGC_PROTO_MAX closes the connection.
 *   - a bulk longer than the field it fills may hold (asked of the arg_max callback, which sees
 *     the arguments before it) is discarded as it streams in, never buffered, and the request is
 *     then refused; a bulk length above RESP_BULK_PROTO_MAX closes the connection.
 *   - an array request whose bytes in all would pass req_max (when set) is discarded as it
 *     streams in, from the bulk that would pass it on, and refused (-ERR ... request too large).
 *   - an inline line longer than inline_max (RESP_INLINE_MAX) closes the connection.
 * So a caller never holds more of a request not yet answered (what resp_parse left unconsumed
 * when it returns RESP_NEED_MORE) than max(inline_max, RESP_LINE_MAX) bytes outside an array
 * request, nor, with req_max set, max(req_max, RESP_LINE_MAX) + RESP_LINE_MAX inside one (its
 * '*' line is not counted against req_max; fuzz_resp checks both bounds).
 *   - the first line of a connection that looks like HTTP (`POST`, `GET /`, `Host:`) closes it.
 *
 * Invariants: while a request is incomplete the parser consumes nothing, except in discard mode
 * (a refused request keeps none of its bytes); argument pointers of a RESP_REQUEST point into
 * the caller's buffer (inline arguments are unquoted in place) and stay valid until the caller
 * drops the consumed bytes.
 */
#ifndef IDEM_SERVER_RESP_H
#define IDEM_SERVER_RESP_H

#include <stddef.h>
#include <stdint.h>

#define RESP_BULK_PROTO_MAX (4u * 1024u * 1024u) /* a larger bulk length is a protocol error */
#define RESP_ARGC_PROTO_MAX (1024u * 1024u)      /* a larger argc is a protocol error */
#define RESP_INLINE_MAX     (64u * 1024u)        /* longest inline line */
#define RESP_LINE_MAX                                                                              \
    25u                   /* longest '*' or '$' line: the prefix, 22 digits or a sign and 21       \
                             (leading zeros count), CRLF; 24 bytes without its LF */
#define RESP_ARGV_MAX 64u /* arguments kept per request */
#define RESP_ERR_MAX  128u

enum resp_status {
    RESP_NEED_MORE = 0, /* incomplete: call again with more bytes (consumed may be > 0) */
    RESP_REQUEST = 1,   /* a whole request: argc/argv/argl are filled */
    RESP_REFUSED = 2,   /* a whole request was read and discarded: reply `-ERR err` */
    RESP_CLOSE = 3,     /* protocol error or HTTP: reply err if nonempty, then close */
};

typedef struct resp_parser resp_parser;

/*
 * Largest length argument `index` (0-based) may have, given the arguments before it
 * (argv[0..index-1], argl likewise; all present). Return RESP_BULK_PROTO_MAX for no field limit.
 * *field (NULL on entry) may be set to the field's name ("key"), which the refusal then gives.
 */
typedef uint32_t (*resp_arg_max_fn)(void *ctx, const uint8_t *const *argv, const uint32_t *argl,
                                    uint32_t index, const char **field);

struct resp_parser {
    /* configuration */
    uint32_t argc_max; /* <= RESP_ARGV_MAX */
    size_t req_max;    /* bytes a whole array request may take (0: no limit); set after init */
    size_t inline_max; /* longest inline line: RESP_INLINE_MAX from init (the fuzzer lowers it) */
    resp_arg_max_fn arg_max;
    void *arg_max_ctx;
    /* state of the request being parsed */
    int first_line_done; /* the HTTP check is over */
    int in_array;        /* inside a `*` request */
    int discarding;      /* the request is refused; its bytes are dropped as they come */
    int too_many;        /* more arguments than argc_max: refused once the name is read */
    uint32_t argc;       /* announced by the array header */
    uint32_t argi;       /* arguments complete so far */
    int64_t bulk_left;   /* the current bulk's data bytes still awaited (in discard mode, to drop;
                          * its CRLF follows), -1 before its header */
    size_t pos;          /* bytes of the current request scanned so far */
    size_t arg_off[RESP_ARGV_MAX];
    uint32_t arg_len[RESP_ARGV_MAX];
    /* results */
    uint32_t nargs;
    const uint8_t *argv[RESP_ARGV_MAX];
    uint32_t argl[RESP_ARGV_MAX];
    char err[RESP_ERR_MAX];
    /* after RESP_REFUSED: the request's name, when it was read and is at most 64 bytes (else
     * refused_name_len is 0), so that the caller can answer as the command's rules say */
    uint8_t refused_name[64];
    uint32_t refused_name_len;
};

/* Resets p for a new connection. argc_max is capped at RESP_ARGV_MAX; arg_max may be NULL. */
void resp_parser_init(resp_parser *p, uint32_t argc_max, resp_arg_max_fn arg_max, void *ctx);

/*
 * Parses the request at the start of buf[0..len). Sets *consumed to the bytes the caller may
 * drop (the whole request for RESP_REQUEST and RESP_REFUSED; discarded bytes while NEED_MORE).
 * After RESP_REQUEST, p->nargs/argv/argl describe it (argv points into buf, which must stay
 * unmoved until the caller is done with them). After RESP_REFUSED or RESP_CLOSE, p->err holds
 * the message (after RESP_REFUSED, p->refused_name the request's name). buf is written to only by
 * the unquoting of inline arguments.
 */
int resp_parse(resp_parser *p, uint8_t *buf, size_t len, size_t *consumed);

/* ---- Replies: a growable byte buffer with a hard cap ---- */

typedef struct resp_buf {
    uint8_t *data;
    size_t len;
    size_t cap;
    size_t limit; /* appends that would pass it fail and set overflow */
    size_t sent;  /* leading bytes already written out (a connection's output): not counted
                   * against limit, which bounds what the client has not read */
    int overflow;
    int no_memory; /* the overflow was a failed allocation, not the limit */
} resp_buf;

void resp_buf_init(resp_buf *b, size_t limit);
void resp_buf_free(resp_buf *b);
/* Drops the first n bytes. */
void resp_buf_consume(resp_buf *b, size_t n);
/* Appends raw bytes. Returns 0, or -1 (overflow set) past the limit or without memory. */
int resp_buf_append(resp_buf *b, const void *p, size_t n);
/* Appends the text fmt makes, whatever its length. */
int resp_buf_printf(resp_buf *b, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

int resp_simple(resp_buf *b, const char *s); /* +s */
int resp_error(resp_buf *b, const char *s);  /* -s (CR/LF replaced by blanks) */
int resp_errorf(resp_buf *b, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
int resp_integer(resp_buf *b, int64_t v);            /* :v */
int resp_bulk(resp_buf *b, const void *p, size_t n); /* $n bytes */
int resp_bulk_str(resp_buf *b, const char *s);       /* $ of a C string */
int resp_bulk_u64(resp_buf *b, uint64_t v);          /* $ of a decimal number */
int resp_bulk_i64(resp_buf *b, int64_t v);
int resp_nil(resp_buf *b);              /* $-1 */
int resp_array(resp_buf *b, int64_t n); /* *n (-1: nil array) */

#endif /* IDEM_SERVER_RESP_H */
