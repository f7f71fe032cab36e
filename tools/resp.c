/*
 * resp.c: the RESP2 client of idemctl: sockets, request encoding, and an iterative reply
 * parser (no recursion: a counter decides completeness, an explicit stack builds the tree).
 */
#include "resp.h"

#include <errno.h>
#include <netdb.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

static int64_t mono_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

static void conn_init(resp_conn *c, int timeout_ms)
{
    memset(c, 0, sizeof *c);
    c->fd = -1;
    c->timeout_ms = timeout_ms > 0 ? timeout_ms : 10000;
}

/* A non-blocking socket connected to sa by the deadline (mono_ms): -1 with errno set (ETIMEDOUT
 * past it). A unix socket whose listen queue is full answers EAGAIN at once, and is tried again
 * every 10 ms; a TCP connect in progress is waited for. The socket stays non-blocking: every send
 * and receive waits in poll within the command's deadline. */
static int connect_within(resp_conn *c, int family, int proto, const struct sockaddr *sa,
                          socklen_t len, int64_t deadline)
{
    c->fd = socket(family, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, proto);
    if (c->fd < 0) return -1;
    int e;
    for (;;) {
        if (connect(c->fd, sa, len) == 0) return 0;
        e = errno;
        if (e == EAGAIN) {
            if (deadline - mono_ms() <= 0) {
                e = ETIMEDOUT;
                break;
            }
            struct timespec ts = {0, 10 * 1000000};
            nanosleep(&ts, NULL);
            continue;
        }
        if (e != EINPROGRESS && e != EINTR) break; /* EINTR: the connect goes on, as EINPROGRESS */
        struct pollfd p = {.fd = c->fd, .events = POLLOUT};
        int n;
        do {
            int64_t left = deadline - mono_ms();
            n = left > 0 ? poll(&p, 1, (int)left) : 0;
        } while (n < 0 && errno == EINTR);
        int soerr = 0;
        socklen_t sl = sizeof soerr;
        if (n == 0)
            e = ETIMEDOUT;
        else if (n < 0 || getsockopt(c->fd, SOL_SOCKET, SO_ERROR, &soerr, &sl) < 0)
            e = errno;
        else if (soerr == 0)
            return 0;
        else
            e = soerr;
        break;
    }
    close(c->fd);
    c->fd = -1;
    errno = e;
    return -1;
}

int resp_connect_unix(resp_conn *c, const char *path, int timeout_ms)
{
    conn_init(c, timeout_ms);
    struct sockaddr_un sa = {.sun_family = AF_UNIX};
    if (strlen(path) >= sizeof sa.sun_path) {
        snprintf(c->err, sizeof c->err, "socket path %s is too long", path);
        return -1;
    }
    strcpy(sa.sun_path, path);
    if (connect_within(c, AF_UNIX, 0, (struct sockaddr *)&sa, sizeof sa,
                       mono_ms() + c->timeout_ms) < 0) {
        snprintf(c->err, sizeof c->err, "cannot connect to idemd at %s: %s", path, strerror(errno));
        resp_close(c);
        return -1;
    }
    return 0;
}

int resp_connect_tcp(resp_conn *c, const char *host, int port, int timeout_ms)
{
    conn_init(c, timeout_ms);
    char ports[16], name[256];
    snprintf(ports, sizeof ports, "%d", port);
    /* An IPv6 address in brackets, as idemd's --bind takes it; named so in errors. */
    size_t n = strlen(host);
    if (n >= 2 && host[0] == '[' && host[n - 1] == ']')
        snprintf(name, sizeof name, "%.*s", (int)(n - 2), host + 1);
    else
        snprintf(name, sizeof name, "%s", host);
    const char *lb = strchr(name, ':') ? "[" : "", *rb = *lb ? "]" : "";
    struct addrinfo hints = {.ai_socktype = SOCK_STREAM}, *res = NULL;
    int rc = getaddrinfo(name, ports, &hints, &res);
    if (rc != 0) {
        snprintf(c->err, sizeof c->err, "cannot resolve %s: %s", host, gai_strerror(rc));
        return -1;
    }
    int saved = 0;
    int64_t deadline = mono_ms() + c->timeout_ms; /* for every address together */
    for (struct addrinfo *a = res; a && c->fd < 0; a = a->ai_next)
        if (connect_within(c, a->ai_family, a->ai_protocol, a->ai_addr, a->ai_addrlen, deadline) <
            0)
            saved = errno;
    freeaddrinfo(res);
    if (c->fd < 0) {
        snprintf(c->err, sizeof c->err, "cannot connect to idemd at %s%.200s%s:%d: %s", lb, name,
                 rb, port, strerror(saved ? saved : errno));
        return -1;
    }
    return 0;
}

void resp_close(resp_conn *c)
{
    if (c->fd >= 0) close(c->fd);
    c->fd = -1;
    free(c->buf);
    c->buf = NULL;
    c->len = c->cap = 0;
}

/* Waits for events on c within the current command's deadline: an idemd that answers a byte at a
 * time cannot hold idemctl past --timeout. */
static int wait_fd(resp_conn *c, short events)
{
    struct pollfd p = {.fd = c->fd, .events = events};
    int n;
    do {
        int64_t left = c->deadline_ms - mono_ms();
        n = left > 0 ? poll(&p, 1, (int)left) : 0;
    } while (n < 0 && errno == EINTR);
    if (n == 0) {
        snprintf(c->err, sizeof c->err, "idemd did not answer within %d ms", c->timeout_ms);
        return -1;
    }
    if (n < 0) {
        snprintf(c->err, sizeof c->err, "poll: %s", strerror(errno));
        return -1;
    }
    return 0;
}

static int send_all(resp_conn *c, const char *p, size_t n)
{
    while (n > 0) {
        if (wait_fd(c, POLLOUT) < 0) return -1;
        ssize_t k = send(c->fd, p, n, MSG_NOSIGNAL);
        if (k < 0 && (errno == EINTR || errno == EAGAIN)) continue;
        if (k < 0) {
            snprintf(c->err, sizeof c->err, "write to idemd: %s", strerror(errno));
            return -1;
        }
        p += k;
        n -= (size_t)k;
    }
    return 0;
}

/* Encodes the request as an array of bulk strings. */
static int send_command(resp_conn *c, int argc, const char *const *argv, const size_t *argl)
{
    size_t total = 32;
    for (int i = 0; i < argc; i++)
        total += 32 + (argl ? argl[i] : strlen(argv[i]));
    char *out = malloc(total);
    if (!out) {
        snprintf(c->err, sizeof c->err, "out of memory");
        return -1;
    }
    size_t n = (size_t)snprintf(out, total, "*%d\r\n", argc);
    for (int i = 0; i < argc; i++) {
        size_t l = argl ? argl[i] : strlen(argv[i]);
        n += (size_t)snprintf(out + n, total - n, "$%zu\r\n", l);
        memcpy(out + n, argv[i], l);
        n += l;
        memcpy(out + n, "\r\n", 2);
        n += 2;
    }
    int rc = send_all(c, out, n);
    free(out);
    return rc;
}

/* ---- Parsing ---- */

/* Reads the line at buf[*pos]: sets *line and *line_len (without CRLF), advances *pos.
 * 1: a line, 0: incomplete, -1: malformed. */
static int take_line(const char *buf, size_t len, size_t *pos, const char **line, size_t *line_len)
{
    const char *start = buf + *pos;
    const char *nl = memchr(start, '\n', len - *pos);
    if (!nl) return len - *pos > 65536 ? -1 : 0;
    if (nl == start || nl[-1] != '\r') return -1;
    *line = start;
    *line_len = (size_t)(nl - start) - 1;
    *pos = (size_t)(nl - buf) + 1;
    return 1;
}

static int parse_int(const char *p, size_t n, int64_t *out)
{
    if (n == 0 || n > 20) return -1;
    char tmp[24];
    memcpy(tmp, p, n);
    tmp[n] = 0;
    char *end;
    errno = 0;
    long long v = strtoll(tmp, &end, 10);
    if (errno || *end) return -1;
    *out = v;
    return 0;
}

/* One value's header at *pos: fills v (strings copied). 1 done, 0 incomplete, -1 malformed.
 * Arrays get their element count in v->n and elems allocated (not yet filled). */
static int take_value(const char *buf, size_t len, size_t *pos, resp_value *v, int build)
{
    const char *line;
    size_t ll;
    int rc = take_line(buf, len, pos, &line, &ll);
    if (rc <= 0) return rc;
    memset(v, 0, sizeof *v);
    int64_t n = 0;
    switch (line[0]) {
    case '+':
    case '-':
        v->type = line[0] == '+' ? RESP_SIMPLE : RESP_ERROR;
        v->len = ll - 1;
        /* Copied whole, as a bulk string is: a NUL inside must not leave len past the copy. */
        if (build && !(v->str = malloc(ll))) return -1;
        if (build) {
            memcpy(v->str, line + 1, ll - 1);
            v->str[ll - 1] = 0;
        }
        return 1;
    case ':':
        v->type = RESP_INTEGER;
        return parse_int(line + 1, ll - 1, &v->integer) < 0 ? -1 : 1;
    case '$':
        if (parse_int(line + 1, ll - 1, &n) < 0 || n < -1 || n > (int64_t)RESP_REPLY_BYTES_MAX)
            return -1;
        if (n == -1) {
            v->type = RESP_NIL;
            return 1;
        }
        if (len - *pos < (size_t)n + 2) return 0;
        if (buf[*pos + (size_t)n] != '\r' || buf[*pos + (size_t)n + 1] != '\n') return -1;
        v->type = RESP_BULK;
        v->len = (size_t)n;
        if (build && !(v->str = malloc((size_t)n + 1))) return -1;
        if (build) {
            memcpy(v->str, buf + *pos, (size_t)n);
            v->str[n] = 0;
        }
        *pos += (size_t)n + 2;
        return 1;
    case '*':
        if (parse_int(line + 1, ll - 1, &n) < 0 || n < -1 || n > 1 << 24) return -1;
        v->type = n == -1 ? RESP_NIL : RESP_ARRAY;
        v->n = n > 0 ? (size_t)n : 0;
        if (build && v->n && !(v->elems = calloc(v->n, sizeof *v->elems))) return -1;
        return 1;
    default:
        return -1;
    }
}

/* Whether a whole reply is in buf: a count of values still to read (*need), no stack. Goes on
 * from *pos, where the values before were found whole, and leaves *pos at the first value not
 * yet whole: a reply arriving in pieces is looked through once, not once per piece (a list of
 * 64 MiB came in a few hundred pieces). */
static int reply_scan(const char *buf, size_t len, size_t *pos, size_t *need, size_t *nodes)
{
    while (*need > 0) {
        size_t at = *pos;
        resp_value v;
        int rc = take_value(buf, len, pos, &v, 0);
        if (rc <= 0) {
            *pos = at;
            return rc;
        }
        /* Each value becomes a node of the tree: bounded as the bytes are. */
        if (++*nodes > RESP_REPLY_NODES_MAX) return -1;
        *need += v.n;
        --*need;
    }
    return 1;
}

struct build_frame {
    resp_value *arr;
    size_t next;
};

int resp_parse(const char *buf, size_t len, resp_value **out, size_t *used)
{
    size_t end = 0, need = 1, nodes = 0;
    int rc = reply_scan(buf, len, &end, &need, &nodes);
    if (rc <= 0) return rc;
    resp_value *root = calloc(1, sizeof *root);
    struct build_frame stack[RESP_DEPTH_MAX];
    int depth = 0;
    size_t pos = 0;
    resp_value *cur = root;
    while (root && cur) {
        if (take_value(buf, end, &pos, cur, 1) != 1) goto fail;
        if (cur->type == RESP_ARRAY && cur->n > 0) {
            if (depth == RESP_DEPTH_MAX) goto fail;
            stack[depth++] = (struct build_frame){cur, 0};
        }
        cur = NULL;
        while (depth > 0 && !cur) {
            struct build_frame *f = &stack[depth - 1];
            if (f->next < f->arr->n)
                cur = &f->arr->elems[f->next++];
            else
                depth--;
        }
    }
    if (!root) return -1;
    *out = root;
    *used = end;
    return 1;
fail:
    resp_free(root);
    return -1;
}

void resp_free(resp_value *v)
{
    if (!v) return;
    /* Breadth-first list of every node, then freed in reverse: children before the element
     * arrays that hold them. */
    size_t cap = 16, n = 0;
    resp_value **all = malloc(cap * sizeof *all);
    if (!all) return;
    all[n++] = v;
    for (size_t i = 0; i < n; i++) {
        for (size_t k = 0; k < all[i]->n; k++) {
            if (n == cap) {
                resp_value **w = realloc(all, 2 * cap * sizeof *w);
                if (!w) goto out; /* leaks on allocation failure rather than corrupt */
                all = w;
                cap *= 2;
            }
            all[n++] = &all[i]->elems[k];
        }
    }
    for (size_t i = n; i > 0; i--) {
        free(all[i - 1]->str);
        free(all[i - 1]->elems);
    }
    free(v);
out:
    free(all);
}

const resp_value *resp_field(const resp_value *arr, const char *name)
{
    if (!arr || arr->type != RESP_ARRAY) return NULL;
    size_t nl = strlen(name);
    for (size_t i = 0; i + 1 < arr->n; i += 2) {
        const resp_value *k = &arr->elems[i];
        if ((k->type == RESP_BULK || k->type == RESP_SIMPLE) && k->len == nl &&
            memcmp(k->str, name, nl) == 0)
            return &arr->elems[i + 1];
    }
    return NULL;
}

/* Reads until a whole reply is buffered; returns it and drops its bytes from the buffer. */
static int read_reply(resp_conn *c, resp_value **out)
{
    size_t scanned = 0, need = 1, nodes = 0; /* reply_scan's place in the reply */
    for (;;) {
        size_t used = 0;
        int rc = c->len ? reply_scan(c->buf, c->len, &scanned, &need, &nodes) : 0;
        if (rc == 1) rc = resp_parse(c->buf, c->len, out, &used);
        if (rc < 0) {
            snprintf(c->err, sizeof c->err,
                     "idemd sent a malformed reply (or one of more than %u "
                     "values)",
                     RESP_REPLY_NODES_MAX);
            return -1;
        }
        if (rc == 1) {
            memmove(c->buf, c->buf + used, c->len - used);
            c->len -= used;
            return 0;
        }
        if (c->cap - c->len < 65536) {
            size_t cap = c->cap ? 2 * c->cap : 131072;
            char *b = cap <= RESP_REPLY_BYTES_MAX ? realloc(c->buf, cap) : NULL;
            if (!b) {
                snprintf(c->err, sizeof c->err, "reply larger than %u bytes", RESP_REPLY_BYTES_MAX);
                return -1;
            }
            c->buf = b;
            c->cap = cap;
        }
        if (wait_fd(c, POLLIN) < 0) return -1;
        ssize_t k = recv(c->fd, c->buf + c->len, c->cap - c->len, 0);
        if (k < 0 && (errno == EINTR || errno == EAGAIN)) continue;
        if (k <= 0) {
            snprintf(c->err, sizeof c->err, "idemd closed the connection%s%s", k < 0 ? ": " : "",
                     k < 0 ? strerror(errno) : "");
            return -1;
        }
        c->len += (size_t)k;
    }
}

int resp_command(resp_conn *c, int argc, const char *const *argv, const size_t *argl,
                 resp_value **out)
{
    *out = NULL;
    if (c->fd < 0) {
        snprintf(c->err, sizeof c->err, "not connected");
        return -1;
    }
    if (argc < 1 || argc > RESP_ARGS_MAX) {
        snprintf(c->err, sizeof c->err, "bad argument count %d", argc);
        return -1;
    }
    c->deadline_ms = mono_ms() + c->timeout_ms;
    if (send_command(c, argc, argv, argl) < 0) return -1;
    return read_reply(c, out);
}
