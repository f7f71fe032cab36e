/*
 * resp.h: a small RESP2 client for idemctl (idem ships without hiredis): connect over a unix
 * socket or TCP, authenticate, send a command as an array of bulk strings, read one reply
 * (simple string, error, integer, bulk, nil, arrays nested to RESP_DEPTH_MAX).
 *
 * Replies are trees of resp_value owned by the caller (resp_free). Strings are NUL-terminated
 * copies (bulk strings may hold NUL bytes too: use len). Every read and write is bounded by the
 * connection's timeout; a reply is bounded by RESP_REPLY_BYTES_MAX.
 */
#ifndef IDEMCTL_RESP_H
#define IDEMCTL_RESP_H

#include <stddef.h>
#include <stdint.h>

#define RESP_DEPTH_MAX       32
#define RESP_REPLY_BYTES_MAX (256u << 20)
/* Values in one reply, at most (an attention list of 100,000 records, the largest idemctl asks
 * for, is up to 3.5 M): its tree (48 bytes a value) stays near the bytes' bound, where 4-byte
 * values (":0\r\n") made 12 times theirs. */
#define RESP_REPLY_NODES_MAX (6u << 20)
#define RESP_ARGS_MAX        64

enum resp_type {
    RESP_SIMPLE = 1,
    RESP_ERROR = 2,
    RESP_INTEGER = 3,
    RESP_BULK = 4,
    RESP_NIL = 5,
    RESP_ARRAY = 6,
};

typedef struct resp_value {
    int type;
    int64_t integer; /* RESP_INTEGER */
    char *str;       /* RESP_SIMPLE, RESP_ERROR, RESP_BULK: NUL-terminated */
    size_t len;
    struct resp_value *elems; /* RESP_ARRAY */
    size_t n;
} resp_value;

typedef struct resp_conn {
    int fd;
    int timeout_ms;      /* for each command, from its send to its whole reply */
    int64_t deadline_ms; /* the current command's (monotonic clock) */
    char *buf;
    size_t len, cap;
    char err[256]; /* the last failure, as a sentence */
} resp_conn;

/* Connect. Return 0, or -1 with c->err set. */
int resp_connect_unix(resp_conn *c, const char *path, int timeout_ms);
int resp_connect_tcp(resp_conn *c, const char *host, int port, int timeout_ms);
void resp_close(resp_conn *c);

/* Sends argv[0..argc) (argl[i] bytes each; argl NULL: strlen) and reads the reply into *out.
 * Returns 0 (the reply may be an error reply), or -1 on an I/O or protocol failure (c->err). */
int resp_command(resp_conn *c, int argc, const char *const *argv, const size_t *argl,
                 resp_value **out);

/* Parses one reply from buf[0, len). Returns 1 and sets *out and *used, 0 if incomplete, -1
 * on malformed input. Exposed for tests of the parser. */
int resp_parse(const char *buf, size_t len, resp_value **out, size_t *used);

void resp_free(resp_value *v);

/* For flat field/value arrays (IDEM.GET, IDEM.STATS, IDEM.AUDIT entries): the value after the
 * field named name, or NULL. */
const resp_value *resp_field(const resp_value *arr, const char *name);

#endif
