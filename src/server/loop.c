/*
 * loop.c: idemd's event loop and connections. One thread owns every socket and the engine's
 * asynchronous queue.
 *
 * A loop turn: epoll_wait; accept; read each readable connection and parse its requests (each
 * takes a slot; commands.c either answers it at once or queues engine ops into this turn's
 * batch); idem_submit the batch; idem_poll the completions and format their replies; write.
 * Engine ops point into connections' input buffers, so those are compacted only before the next
 * read, after the batch that referenced them was submitted.
 *
 * Invariants: replies leave a connection in request order (server.h); a connection's struct
 * lives until the engine has delivered every completion it owes it (engine_due), even after its
 * socket is closed; the total of input and output buffers (io_used) is held near the budget
 * (past it, clients are held back: below).
 *
 * Past the budget (buffers plus the replies still owed), each client is held back for what it
 * holds itself, so that slow readers holding the budget starve nobody else:
 *   - a slow reader (SRV_HEAVY_BYTES of replies unread or owed) is neither read nor parsed until
 *     it reads them, and one that has read nothing for SRV_STALL_MS is closed;
 *   - a large request (SRV_IN_HEAVY_BYTES unparsed) needs an admission to be read on: big_slots()
 *     of them at once, the others wait in arrival order (a ticket each), so large requests go
 *     on one after another; while others wait, an admission lasts SRV_STALL_MS, then the
 *     client goes back in line (a client trickling a large request holds no one up for long),
 *     with the input it holds, unless the admission brought in SRV_ADMIT_GOING_BYTES over that
 *     time or more waits in its socket (the loop is the slow side: the admission goes on,
 *     SRV_ADMIT_KEEPS_MAX times at most). Clients holding a large request in part (16 KiB of
 *     it, in a buffer over 32 KiB: admitted before, or read before the budget was passed)
 *     without an admission are counted (big_back_bytes), whatever holds them up; while they
 *     hold more than big_share() only they are admitted, and once those holding it for
 *     SRV_STALL_MS hold more (timed from when they began holding it, or, for one that reads
 *     every reply and waits on no claim, from its last large request parsed whole or, while it
 *     waits for pipeline room, its last reply: big_back_clock), the one that began last is
 *     closed, as a stalled reader is (big_back_enforce). A large buffer holding less is given
 *     back (conn_compact_in);
 *   - a client that may not parse (its pipeline full, a claim parked by WAIT) is read on only
 *     up to SRV_IN_HEAVY_BYTES unparsed and takes no admission (it would hold one in vain);
 *   - everyone else is read and parsed as usual, and a whole request is always parsed (that is
 *     what frees its input).
 * Once the pressure falls to three quarters of the budget, everyone is read again.
 */
#include "server.h"

#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <linux/sockios.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/ioctl.h>
#include <sys/signalfd.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#include "util.h"

#define TAG_UNIX    1u
#define TAG_TCP     2u
#define TAG_SIG     3u
#define TAG_QUEUE   4u
#define TAG_LOAD    5u
#define TAG_METRICS 6u
#define TAG_BACKUP  7u
#define TAG_READS   8u
#define TAG_CONN    16u /* and above: connection index + TAG_CONN */

#define EVENTS_MAX      256
#define ACCEPT_PAUSE_MS 100 /* listeners unwatched after an accept error (srv_accept) */
#define COMPLETIONS_MAX 256
#define DRAIN_WRITE_MS  2000
#define DRAIN_ANSWER_MS 30000 /* a drain answers what is still unanswered after this */

int64_t srv_now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

/* The loop's clock: read twice a turn (when its events come, and before completions become
 * replies), never per request. */
static void clock_tick(srv *s)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    s->now_us = (int64_t)ts.tv_sec * 1000000 + ts.tv_nsec / 1000;
}

/* Watches fd; -1 with errno where the kernel will not (no memory for one more watch). */
static int ep_watch(srv *s, int fd, uint64_t tag, uint32_t events)
{
    struct epoll_event ev = {.events = events, .data.u64 = tag};
    return epoll_ctl(s->epfd, EPOLL_CTL_ADD, fd, &ev);
}

/* ep_watch for what idemd cannot run without (its listeners, signals, queues): a refusal is
 * logged, and fails the start. */
static int ep_add(srv *s, int fd, uint64_t tag, uint32_t events, const char *what)
{
    if (ep_watch(s, fd, tag, events) == 0) return 0;
    srv_log("error", "epoll_add", "what=%s error=\"%s\"", what, strerror(errno));
    return -1;
}

/* ---- connections ---- */

/* Whether c holds more input than a client never admitted can (it took an admission, or was
 * read before the budget was passed). */
static int big_holder(const srv_conn *c)
{
    return c->in_cap > 2 * SRV_IN_HEAVY_BYTES;
}

/* Whether c holds a large request in part (16 KiB of it unparsed: the parser consumes nothing
 * of a request until it is whole) in a buffer larger than big_holder's bound; held, without an
 * admission: whatever holds it up (waiting in line, paused for its replies, unable to parse, or
 * sending nothing more). */
static int big_back_partial(const srv_conn *c)
{
    return c->fd >= 0 && big_holder(c) && c->in_len - c->in_start >= SRV_IN_HEAVY_BYTES;
}

static int big_back_held(const srv_conn *c)
{
    return big_back_partial(c) && !c->big_admitted;
}

/* Keeps c's share of big_back_bytes (see the head of this file) to its state: its whole input
 * buffer while big_back_held, nothing otherwise; and since when it holds its large request in
 * part, admitted or not (an admission that runs out does not make a trickle new). Called at
 * each change of those (conn_update_events, conn_account, the admissions, conn_parse). */
static void big_back_count(srv *s, srv_conn *c)
{
    size_t want = c->fd >= 0 && big_back_held(c) ? c->in_cap : 0; /* closed: nothing */
    s->big_back_bytes = s->big_back_bytes - c->big_back_bytes + want;
    c->big_back_bytes = want;
    if (!big_back_partial(c))
        c->big_back_since_ms = 0;
    else if (!c->big_back_since_ms)
        c->big_back_since_ms = srv_now_ms();
}

static void conn_account(srv *s, srv_conn *c)
{
    /* The slot ring too once a pipeline grew it (up to --pipeline-max entries held behind a
     * WAIT); the small ring every connection keeps is its fixed cost, as the struct is. */
    uint64_t ring = c->slot_cap > SRV_SLOTS_KEEP ? (uint64_t)c->slot_cap * sizeof(srv_slot) : 0;
    uint64_t now = c->in_cap + c->out.cap + c->slot_bytes + ring;
    s->io_used = s->io_used - c->io_bytes + now;
    c->io_bytes = now;
    big_back_count(s, c);
}

static int over_budget(const srv *s);

static void conn_update_events(srv *s, srv_conn *c)
{
    big_back_count(s, c);
    if (c->fd < 0 || c->hung_up) return;
    /* EPOLLRDHUP always: a client that hangs up while it is not read (QUIT, paused, held back)
     * is noticed all the same, so that its claims parked by WAIT are cancelled at once. Not
     * once it half-closed (it would be reported at every turn): a hangup (EPOLLHUP) still is. */
    uint32_t ev = c->peer_eof ? 0 : EPOLLRDHUP;
    /* A connection whose parsing is held back (pipeline full, engine queue full, a claim parked
     * by WAIT, over the budget) is read on only until SRV_IN_HELD_MAX bytes wait unparsed, over
     * the budget SRV_IN_HEAVY_BYTES: then its bytes stay in the socket until it may go on, so
     * no input buffer grows without bound. Such a client needs no admission (budget_check):
     * one would do it no good while it cannot parse, and would keep others waiting. */
    size_t held_max = over_budget(s) ? SRV_IN_HEAVY_BYTES : SRV_IN_HELD_MAX;
    int held_full = c->deferred && (c->in_len - c->in_start >= held_max || c->in_no_room);
    if (!c->paused && !s->draining && !c->close_after_write && !c->in_ended && !held_full)
        ev |= EPOLLIN;
    if (c->out.sent < c->out.len) ev |= EPOLLOUT;
    if (ev == c->epoll_events) return;
    struct epoll_event e = {.events = ev, .data.u64 = TAG_CONN + c->index};
    epoll_ctl(s->epfd, EPOLL_CTL_MOD, c->fd, &e);
    c->epoll_events = ev;
}

static void conn_free(srv *s, srv_conn *c)
{
    s->owed_total -= c->owed; /* replies it was owed will never be made */
    s->short_by -= c->short_by;
    c->owed = c->short_by = 0;
    for (uint32_t i = 0; i < c->slot_cap; i++) {
        resp_buf_free(&c->slots[i].buf);
        free(c->slots[i].wait_key);
    }
    free(c->slots);
    c->slots = NULL;
    c->slot_cap = 0; /* a ring grown past SRV_SLOTS_KEEP is counted: counted out now */
    free(c->in);
    resp_buf_free(&c->out);
    c->in_cap = 0;
    c->slot_bytes = 0;
    conn_account(s, c);
    s->conns[c->index] = NULL;
    s->conns_free[s->nconns_free++] = c->index;
    s->nconns--;
    free(c);
}

/* The op named ud in this turn's batch, not yet handed to the engine; NULL when there is none. */
static idem_op *op_unsubmitted(srv *s, uint64_t ud)
{
    for (uint32_t i = 0; i < s->nops; i++)
        if (s->ops[i].user_data == ud) return &s->ops[i];
    return NULL;
}

/* Claims of c parked by WAIT in the engine complete now (busy), for a client that is gone, each
 * cancelled once (a reset is seen as the peer's end, then closed, in one turn: the second call
 * walked every claim parked on the queue under the store's lock to find none). One still in this
 * turn's batch loses its WAIT there and answers at once, as a
 * claim from a client whose end was seen does (srv_submit_op). The batch is not sent early for
 * it: it may hold a release by another client that would then grant the key to a waiter whose
 * own close comes later in this turn (it did), leaving the key to no one until its lease ran
 * out; for the requests that do send it early, loop_turn sees every end in the turn first. */
static void cancel_waits(srv *s, srv_conn *c)
{
    if (!s->q) return;
    for (uint32_t q = c->head_seq; q != c->tail_seq; q++) {
        srv_slot *sl = srv_slot_of(c, q);
        if (sl->state != SLOT_PENDING || !sl->is_wait || sl->wait_cancelled) continue;
        uint64_t ud = ((uint64_t)c->index << 32) | q;
        idem_op *op = op_unsubmitted(s, ud);
        if (op) {
            op->wait_ms = 0;
            sl->is_wait = 0;
            s->wait_due--;
            c->waits_due--;
        } else {
            (void)idem_cancel_wait(s->q, ud);
            sl->wait_cancelled = 1;
        }
    }
}

/* c's peer ended its side (EPOLLRDHUP, or a read of 0): it may be gone, so its claims parked by
 * WAIT answer busy now, and later ones do not park (srv_submit_op); what it sent before is still
 * read, run and answered. */
static void conn_peer_eof(srv *s, srv_conn *c)
{
    if (c->peer_eof) return;
    c->peer_eof = 1;
    cancel_waits(s, c);
    if (c->head_seq != c->tail_seq || c->out.sent < c->out.len || c->in_len > c->in_start)
        srv_log_gated(&s->log_half_close, "info", "half_close", "id=%llu peer=%s",
                      (unsigned long long)c->id, c->peer); /* not for a plain disconnect */
}

/* Closes c's socket, whatever the reason: its claims parked by WAIT are cancelled (they answer
 * nobody, and must not be granted the key for a client that is gone). */
static void conn_close(srv *s, srv_conn *c, const char *why)
{
    if (c->fd < 0) return;
    cancel_waits(s, c);
    uint32_t seq;
    (void)srv_reads_cancel(s, c, &seq);
    if (c->big_admitted) s->big_admitted--;
    if (c->paused == PAUSE_INPUT) s->big_waiting--;
    s->big_back_bytes -= c->big_back_bytes;
    c->big_back_bytes = 0;
    c->big_admitted = 0;
    c->paused = PAUSE_NONE;
    if (strcmp(why, "input_stalled") == 0) s->closed_input_stalled++;
    if (strcmp(why, "output_stalled") == 0) s->closed_output_stalled++;
    srv_log_gated(&s->log_disconnect, "info", "disconnect", "id=%llu peer=%s reason=%s",
                  (unsigned long long)c->id, c->peer, why);
    epoll_ctl(s->epfd, EPOLL_CTL_DEL, c->fd, NULL);
    close(c->fd);
    c->fd = -1;
    c->dead = 1;
    s->nlive--;
    s->dead[s->ndead++] = c; /* freed by reap_dead once the engine owes it nothing */
}

/* Frees closed connections that the engine owes nothing and no list still holds. */
static void reap_dead(srv *s)
{
    uint32_t keep = 0;
    for (uint32_t i = 0; i < s->ndead; i++) {
        srv_conn *c = s->dead[i];
        if (c->engine_due == 0 && !c->in_dirty && !c->in_held)
            conn_free(s, c);
        else
            s->dead[keep++] = c;
    }
    s->ndead = keep;
}

static void conn_new(srv *s, int fd, int is_unix, const char *peer)
{
    /* A free place in conns (conns_free: a stack, the place freed last on top; taken once the
     * connection is made). */
    int full = s->nconns_free == 0 || s->nlive >= s->cfg.max_clients;
    uint32_t idx = full ? 0 : s->conns_free[s->nconns_free - 1];
    srv_conn *c = full ? NULL : calloc(1, sizeof *c);
    /* Watched first: one the kernel would not watch (no memory for it) would never be served.
     * Logged through the out-of-memory gate (below, SRV_LOG_BURST lines a second at most): a
     * flood of connections must not flood the log. */
    if (c && ep_watch(s, fd, TAG_CONN + (uint64_t)idx, EPOLLIN | EPOLLRDHUP) != 0) {
        free(c);
        c = NULL;
    }
    if (!c) {
        static const char full_msg[] = "-ERR max number of clients reached\r\n";
        static const char oom_msg[] = "-ERR out of memory for a new connection: try again\r\n";
        ssize_t w = full ? write(fd, full_msg, sizeof full_msg - 1)
                         : write(fd, oom_msg, sizeof oom_msg - 1);
        (void)w;
        close(fd);
        s->rejected_connections++;
        if (!full)
            srv_log_gated(&s->log_oom, "warn", "out_of_memory", "what=connection peer=%s", peer);
        return;
    }
    c->id = ++s->next_id;
    c->index = idx;
    c->fd = fd;
    c->is_unix = is_unix;
    c->role = auth_initial_role(&s->cfg, is_unix);
    struct ucred cred;
    socklen_t cred_len = sizeof cred;
    if (s->cfg.nusers) /* named by AUTH */
        c->user[0] = '\0';
    else if (is_unix && getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &cred_len) == 0)
        snprintf(c->user, sizeof c->user, "uid=%u", (unsigned)cred.uid);
    else
        snprintf(c->user, sizeof c->user, "%s", is_unix ? "unix" : "tcp");
    snprintf(c->peer, sizeof c->peer, "%s", peer);
    cmd_parser_limits(s, c);
    /* A whole request must fit the input buffer with a read's room to spare (conn_grow_in):
     * one that would not (several 4 MiB FPs) is refused as it streams in, not a closed socket. */
    c->parser.req_max = SRV_REQ_MAX;
    resp_buf_init(&c->out, s->cfg.client_output_max);
    c->reply_est = SRV_REPLY_SMALL;
    c->last_active_ms = c->accepted_ms = srv_now_ms();
    s->conns[idx] = c;
    s->nconns_free--;
    s->nconns++;
    s->nlive++;
    s->total_connections++;
    c->epoll_events = EPOLLIN | EPOLLRDHUP;
    srv_log_gated(&s->log_connect, "info", "connect", "id=%llu peer=%s role=%s",
                  (unsigned long long)c->id, peer, auth_role_name(c->role));
}

static void listeners_watch(srv *s, int op)
{
    struct epoll_event e = {.events = EPOLLIN};
    int fds[3] = {s->unix_fd, s->tcp_fd, s->metrics_fd};
    uint64_t tags[3] = {TAG_UNIX, TAG_TCP, TAG_METRICS};
    for (int i = 0; i < 3; i++) {
        e.data.u64 = tags[i];
        if (fds[i] >= 0) epoll_ctl(s->epfd, op, fds[i], &e);
    }
}

/* The listeners, unwatched after an accept error, are watched again once the pause is over;
 * a spare descriptor given up and not had back (another took its number) is taken again. */
static void listeners_resume(srv *s, int64_t now)
{
    if (s->spare_fd < 0) s->spare_fd = open("/dev/null", O_RDONLY | O_CLOEXEC);
    if (s->accept_paused_until_ms && now >= s->accept_paused_until_ms) {
        s->accept_paused_until_ms = 0;
        listeners_watch(s, EPOLL_CTL_ADD);
    }
}

/*
 * accept4 on listener lfd. Returns the new connection, or -1 when there is none to take now.
 * A listener is level-triggered: a connection left in its backlog wakes the loop at once, again
 * and again. So out of file descriptors (EMFILE, ENFILE) the spare descriptor is given up to
 * take the connection, which is told that the server is full and closed; after any other error
 * (ENOMEM, ENOBUFS, ...), or when the spare cannot be had back, the listeners are not watched for
 * ACCEPT_PAUSE_MS. All of them, the metrics listener's too: such errors are the system's, not one
 * listener's.
 */
int srv_accept(srv *s, int lfd, struct sockaddr *sa, socklen_t *sl)
{
    for (int tries = 0; tries < 8; tries++) {
        int fd = accept4(lfd, sa, sl, SOCK_NONBLOCK | SOCK_CLOEXEC);
        if (fd >= 0) return fd;
        int e = errno;
        if (e == EAGAIN || e == EWOULDBLOCK) return -1;
        if (e == EINTR || e == ECONNABORTED || e == EPROTO) continue; /* that one is gone */
        if ((e == EMFILE || e == ENFILE) && s->spare_fd >= 0) {
            close(s->spare_fd);
            fd = accept4(lfd, NULL, NULL, SOCK_NONBLOCK | SOCK_CLOEXEC);
            if (fd >= 0) {
                static const char msg[] = "-ERR max number of clients reached (the server is out "
                                          "of file descriptors)\r\n";
                if (lfd != s->metrics_fd) { /* a scraper speaks HTTP: it is only closed */
                    ssize_t w = write(fd, msg, sizeof msg - 1);
                    (void)w;
                }
                close(fd);
                s->rejected_connections++;
            }
            s->spare_fd = open("/dev/null", O_RDONLY | O_CLOEXEC);
            if (s->spare_fd >= 0) { /* the next one on the next wake */
                srv_log_gated(&s->log_accept, "warn", "accept_failed",
                              "error=\"%s\" msg=\"connection refused: out of file descriptors\"",
                              strerror(e));
                return -1;
            }
        }
        srv_log_gated(&s->log_accept, "warn", "accept_failed",
                      "error=\"%s\" msg=\"not accepting for %d ms\"", strerror(e), ACCEPT_PAUSE_MS);
        if (!s->accept_paused_until_ms) listeners_watch(s, EPOLL_CTL_DEL);
        s->accept_paused_until_ms = srv_now_ms() + ACCEPT_PAUSE_MS;
        return -1;
    }
    return -1;
}

/* A TCP peer gone without a FIN or a reset (its host lost power, a firewall forgot the flow)
 * would hold its connection, and a place of --max-clients, for ever under the default
 * --idle-timeout-ms: keepalive probes after SRV_KEEPALIVE_S idle, a third of that apart, three
 * of them, close it within twice that (Redis's tcp-keepalive 300 does the same). A failure
 * leaves the connection without them. */
static void tcp_keepalive(int fd)
{
    int on = 1, idle = SRV_KEEPALIVE_S, intvl = SRV_KEEPALIVE_S / 3, cnt = 3;
    if (setsockopt(fd, SOL_SOCKET, SO_KEEPALIVE, &on, sizeof on) != 0) return;
    setsockopt(fd, IPPROTO_TCP, TCP_KEEPIDLE, &idle, sizeof idle);
    setsockopt(fd, IPPROTO_TCP, TCP_KEEPINTVL, &intvl, sizeof intvl);
    setsockopt(fd, IPPROTO_TCP, TCP_KEEPCNT, &cnt, sizeof cnt);
}

static void accept_all(srv *s, int lfd, int is_unix)
{
    for (int i = 0; i < 64; i++) {
        struct sockaddr_storage ss;
        socklen_t sl = sizeof ss;
        int fd = srv_accept(s, lfd, (struct sockaddr *)&ss, &sl);
        if (fd < 0) return;
        char peer[64] = "unix";
        if (!is_unix) {
            srv_addr_format((const struct sockaddr *)&ss, peer, sizeof peer);
            int one = 1;
            setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
            tcp_keepalive(fd);
        }
        conn_new(s, fd, is_unix, peer);
    }
}

/* ---- the reply FIFO ---- */

/* Takes the next slot for a request. Returns -1 without memory. */
static int slot_alloc(srv_conn *c, uint32_t *seq)
{
    if (c->tail_seq - c->head_seq == c->slot_cap) {
        uint32_t cap = c->slot_cap ? c->slot_cap * 2 : 8;
        srv_slot *ns = calloc(cap, sizeof *ns);
        if (!ns) return -1;
        for (uint32_t q = c->head_seq; q != c->tail_seq; q++)
            ns[q & (cap - 1)] = *srv_slot_of(c, q);
        for (uint32_t i = 0; i < c->slot_cap; i++) { /* free buffers of unused entries */
            uint32_t q = c->head_seq + i;
            if (q - c->head_seq >= c->tail_seq - c->head_seq) {
                c->slot_bytes -= c->slots[i].buf_counted;
                resp_buf_free(&c->slots[i].buf);
            }
        }
        free(c->slots);
        c->slots = ns;
        c->slot_cap = cap;
    }
    *seq = c->tail_seq++;
    srv_slot *sl = srv_slot_of(c, *seq);
    resp_buf keep = sl->buf;
    size_t counted = sl->buf_counted;
    memset(sl, 0, sizeof *sl);
    sl->buf = keep;
    sl->buf_counted = counted;
    sl->buf.len = 0;
    sl->buf.overflow = sl->buf.no_memory = 0;
    sl->buf.limit = c->out.limit;
    sl->state = SLOT_PENDING;
    return 0;
}

int srv_reply_pending(srv_conn *c, uint32_t seq)
{
    return seq - c->head_seq < c->tail_seq - c->head_seq &&
           srv_slot_of(c, seq)->state == SLOT_PENDING;
}

resp_buf *srv_reply_buf(srv_conn *c, uint32_t seq)
{
    /* after out_cut the slot's buffer, which srv_reply_done drops: nothing more is sent */
    return seq == c->head_seq && !c->out_cut ? &c->out : &srv_slot_of(c, seq)->buf;
}

/* The slot's buffer capacity as the budget counts it (c->slot_bytes), after it changed. */
static void slot_recount(srv_conn *c, srv_slot *sl)
{
    c->slot_bytes = c->slot_bytes - sl->buf_counted + sl->buf.cap;
    sl->buf_counted = sl->buf.cap;
}

static uint64_t budget_pressure(const srv *s);

/* A reply is reserved at the largest its command can make, or at the size of the client's
 * large recent replies while what all requests are owed short of their largest stays within
 * SRV_SHORT_DIV of the budget: the replies made past their reservations are bounded, and
 * pipelines of small replies are not held back for results they do not carry. */
void srv_reply_reserve(srv *s, srv_conn *c, uint32_t seq, uint32_t full)
{
    srv_slot *sl = srv_slot_of(c, seq);
    uint32_t est = c->reply_est < full ? (uint32_t)c->reply_est : full;
    sl->owed = full;
    if (est < full && s->short_by + (full - est) <= s->cfg.io_budget_bytes / SRV_SHORT_DIV) {
        sl->owed = est;
        sl->short_by = full - est;
        c->short_by += sl->short_by;
        s->short_by += sl->short_by;
    }
    c->owed += sl->owed;
    s->owed_total += sl->owed;
}

void srv_reply_owe(srv *s, srv_conn *c, uint32_t seq, uint64_t bytes)
{
    srv_slot *sl = srv_slot_of(c, seq);
    uint32_t owe = bytes < UINT32_MAX ? (uint32_t)bytes : UINT32_MAX;
    c->owed = c->owed - sl->owed + owe;
    s->owed_total = s->owed_total - sl->owed + owe;
    sl->owed = owe;
}

uint64_t srv_reply_room(const srv *s, uint64_t want)
{
    uint64_t budget = s->cfg.io_budget_bytes, used = budget_pressure(s);
    uint64_t left = used < budget ? budget - used : 0;
    uint64_t room = left > SRV_OWED_TIGHT ? left : SRV_OWED_TIGHT;
    if (room > s->cfg.client_output_max) room = s->cfg.client_output_max;
    return want < room ? want : room;
}

void srv_reply_done(srv *s, srv_conn *c, uint32_t seq)
{
    srv_slot *sl = srv_slot_of(c, seq);
    sl->state = SLOT_READY;
    c->owed -= sl->owed; /* the reply exists now: io_used and the client's output count it */
    s->owed_total -= sl->owed;
    sl->owed = 0;
    c->short_by -= sl->short_by;
    s->short_by -= sl->short_by;
    sl->short_by = 0;
    slot_recount(c, sl);
    c->slot_ready += sl->buf.len; /* 0 for the head: its reply went to `out` */
    /* Replies waiting in slots are the client's output as much as `out` is: past
     * --client-output-max the connection is closed (conn_write: output_limit). */
    if (c->out.limit && !c->out_cut && c->out.len - c->out.sent + c->slot_ready > c->out.limit)
        c->out.overflow = 1; /* (after a cut, the replies in slots are dropped: not output) */
    while (c->head_seq != c->tail_seq && srv_slot_of(c, c->head_seq)->state == SLOT_READY) {
        srv_slot *h = srv_slot_of(c, c->head_seq);
        c->slot_ready -= h->buf.len;
        /* A reply that did not fit its slot is not sent cut short: the connection is closed
         * (conn_write: output_limit), as when the reply goes to `out` at once. */
        if (c->out_cut) {
            /* after a reply that found no memory: none is sent (they would be taken for it) */
        } else if (h->buf.overflow ||
                   (h->buf.len && resp_buf_append(&c->out, h->buf.data, h->buf.len) < 0)) {
            c->out.overflow = 1;
            c->out.no_memory |= h->buf.no_memory;
        } else if (!c->out.overflow) {
            c->out_whole = c->out.len; /* this reply is whole in out (the head's went there) */
        }
        /* Only small buffers are kept, SRV_SLOT_KEEP bytes of them at most. */
        if (h->buf.cap > SRV_SLOT_KEEP / 4 || c->slot_bytes > SRV_SLOT_KEEP) resp_buf_free(&h->buf);
        slot_recount(c, h);
        h->buf.len = 0;
        h->state = SLOT_FREE;
        c->head_seq++;
    }
    conn_account(s, c); /* the budget sees replies as they collect, not only at the next write */
    if (!c->in_dirty && c->fd >= 0) {
        c->in_dirty = 1;
        s->dirty[s->ndirty++] = c;
    }
}

/* ---- engine batch ---- */

/* The outcome line of an IDEM.RESOLVE (its request's line is cmd_log_operator's). */
static void log_resolve_result(const srv_conn *c, uint32_t seq, int err)
{
    srv_log("info", "operator_result", "id=%llu req=%u cmd=IDEM.RESOLVE err=\"%s\"",
            (unsigned long long)c->id, seq, err ? idem_strerror(err) : "");
}

/* The answer to a request an op of which the engine refused (submit_batch), once none of its
 * ops is due: nothing of it took effect but what those it took did. */
static void queue_refused_answer(srv *s, srv_conn *c, uint32_t seq)
{
    if (c->dead || srv_slot_of(c, seq)->state != SLOT_PENDING) return;
    resp_error(srv_reply_buf(c, seq), "ERR server busy: engine queue full, retry");
    srv_reply_done(s, c, seq);
}

static void unheard_released(srv *s, srv_conn *c, int err, int64_t token);

static void submit_batch(srv *s)
{
    if (s->nops == 0) return;
    uint32_t give = s->nops;
    for (uint32_t i = 0; s->test_refuse_key && i < give; i++) {
        const idem_op *op = &s->ops[i];
        if (op->key_len == strlen(s->test_refuse_key) &&
            memcmp(op->key, s->test_refuse_key, op->key_len) == 0) {
            give = i; /* tests: as if the engine's queue were full from this op on, once */
            s->test_refuse_key = NULL;
        }
    }
    int n = idem_submit(s->q, s->ops, give);
    uint32_t accepted = n < 0 ? 0 : (uint32_t)n;
    for (uint32_t i = accepted; i < s->nops; i++) {
        /* The engine refused the op (queue full): fail the request; nothing changed. */
        uint64_t ud = s->ops[i].user_data;
        srv_conn *c = s->conns[ud >> 32];
        uint32_t seq = (uint32_t)ud;
        c->engine_due--;
        s->engine_due--;
        if (srv_slot_of(c, seq)->is_wait) {
            srv_slot_of(c, seq)->is_wait = 0;
            s->wait_due--;
            c->waits_due--;
        }
        srv_slot *sl = srv_slot_of(c, seq);
        if (sl->kind == RK_RESOLVE && !sl->queue_refused) log_resolve_result(c, seq, IDEM_EBUSY);
        /* The release of a WAIT claim's unheard `new` (submit_unheard), refused: said. */
        if (sl->kind == RK_OWNER && sl->wait_key)
            unheard_released(s, c, IDEM_EBUSY, sl->unheard_token);
        free(sl->wait_key);
        sl->wait_key = NULL;
        sl->remaining--;
        sl->queue_refused = 1;
        if (!sl->err) sl->err = IDEM_EBUSY; /* a DEL's outcome line says so */
        /* Those of its ops the engine took are still due (a request of several keys): it is
         * answered once they complete (complete_one), or its slot could be reused under them. */
        if (sl->remaining == 0) queue_refused_answer(s, c, seq);
    }
    if (n < 0 || accepted < s->nops)
        srv_log("warn", "submit_short", "ops=%u accepted=%d", s->nops, n);
    s->nops = 0;
}

void srv_submit_op(srv *s, srv_conn *c, uint32_t seq, int kind, idem_op *op)
{
    srv_slot_of(c, seq)->kind = (uint8_t)kind;
    if (s->nops >= IDEM_BATCH_MAX) submit_batch(s);
    op->user_data = ((uint64_t)c->index << 32) | seq;
    s->ops[s->nops++] = *op;
    c->engine_due++;
    s->engine_due++;
    srv_slot_of(c, seq)->remaining++;
    if (op->kind == IDEM_OP_CLAIM && op->wait_ms > 0) {
        /* Parked claims hold engine slots: past half the queue, a WAIT answers at once; so does
         * one from a client whose end was seen (it may be gone). */
        if (s->wait_due >= s->cfg.queue_depth / 2 || c->peer_eof) {
            s->ops[s->nops - 1].wait_ms = 0;
        } else {
            srv_slot *sl = srv_slot_of(c, seq);
            sl->is_wait = 1;
            s->wait_due++;
            c->waits_due++;
            /* Without memory for the copy, a `new` nobody hears holds the key for its lease, as
             * it did before (complete_one). At most queue_depth / 2 such copies at once. */
            if (!op->owner_len && (sl->wait_key = malloc(op->key_len)) != NULL) {
                memcpy(sl->wait_key, op->key, op->key_len);
                sl->wait_key_len = (uint16_t)op->key_len;
            }
        }
    }
    /* Claim latency: from this turn's clock; a WAIT's time is mostly its wait, left out. */
    srv_slot_of(c, seq)->timed = kind == RK_CLAIM && !srv_slot_of(c, seq)->is_wait;
    srv_slot_of(c, seq)->parsed_us = s->now_us;
}

/* Counts the latency of a claim answered now (srv.claim_latency_us_*). */
static void claim_latency_add(srv *s, const srv_slot *sl)
{
    uint64_t us = s->now_us > sl->parsed_us ? (uint64_t)(s->now_us - sl->parsed_us) : 0;
    s->claim_latency_us_buckets[util_latency_bucket(us, SRV_LAT_BUCKETS)]++;
    s->claim_latency_us_sum += us;
    s->claim_latencies++;
}

void srv_flush_ops(srv *s)
{
    submit_batch(s);
}

/* ---- reading and parsing ---- */

/* Moves what is unparsed to the start of c's input buffer (no operation may point into it:
 * the batch that referenced it was submitted), and gives back a buffer larger than
 * big_holder's bound that holds less than SRV_IN_HEAVY_BYTES: once a large request is parsed,
 * a client that always leaves a small one in part does not keep SRV_IN_BUF_MAX for good. */
static void conn_compact_in(srv_conn *c)
{
    if (c->in_start > 0) {
        memmove(c->in, c->in + c->in_start, c->in_len - c->in_start);
        c->in_len -= c->in_start;
        c->in_start = 0;
    }
    if (c->in_len == 0 && c->in_cap > 16384) {
        /* Everything was parsed: an idle connection keeps no large buffer against the budget. */
        free(c->in);
        c->in = NULL;
        c->in_cap = 0;
    } else if (big_holder(c) && c->in_len < SRV_IN_HEAVY_BYTES) {
        uint8_t *n = realloc(c->in, 2 * SRV_IN_HEAVY_BYTES);
        if (n) {
            c->in = n;
            c->in_cap = 2 * SRV_IN_HEAVY_BYTES;
        }
    }
}

/* No memory for what c sent (what: input_buffer, reply_slot): logged, and c is closed once the
 * replies it is owed are written (at once if none is: no write would come to close it); it is
 * not read any more (EPOLLIN would spin the loop). Its earlier requests keep their answers. */
static void conn_out_of_memory(srv *s, srv_conn *c, const char *what)
{
    srv_log_gated(&s->log_oom, "warn", "out_of_memory", "what=%s id=%llu peer=%s", what,
                  (unsigned long long)c->id, c->peer);
    if (c->head_seq == c->tail_seq && c->out.sent == c->out.len) {
        conn_close(s, c, "out_of_memory");
    } else {
        c->close_after_write = 1;
        conn_update_events(s, c);
    }
}

/* Makes room in c's input buffer for a read. Returns 0; -1 when a request would pass
 * SRV_IN_BUF_MAX; -2 when the buffer is full and cannot grow for want of memory (without memory
 * a read goes into whatever room is left). */
static int conn_grow_in(srv_conn *c)
{
    conn_compact_in(c);
    size_t room = c->in_cap - c->in_len;
    if (room >= SRV_READ_CHUNK / 4) return 0;
    /* A full-size buffer is read into while it has room: a request of SRV_REQ_MAX bytes leaves
     * SRV_READ_CHUNK / 4 for the length line that tells the parser it is too large. */
    if (c->in_cap >= SRV_IN_BUF_MAX) return room > 0 ? 0 : -1;
    size_t cap = c->in_cap ? c->in_cap * 2 : 16384;
    if (cap > SRV_IN_BUF_MAX) cap = SRV_IN_BUF_MAX;
    uint8_t *n = realloc(c->in, cap);
    if (!n) return room > 0 ? 0 : -2;
    c->in = n;
    c->in_cap = cap;
    return 0;
}

/* Reads what the socket holds (up to the buffer's room). Returns 0, or -1 when nothing was read
 * for want of room: c was closed, is to be closed once its replies are written (no memory to
 * read into), or, holding requests that wait to be parsed, is read again once they are. */
static int conn_read(srv *s, srv_conn *c)
{
    int grown = conn_grow_in(c);
    if (grown == -1) {
        conn_close(s, c, "request_too_large");
        return -1;
    }
    c->in_no_room = 0;
    if (grown == -2 && c->deferred && c->in_len > c->in_start) {
        /* It holds requests that wait to be parsed: it is read again once they are. */
        srv_log_gated(&s->log_oom, "warn", "out_of_memory",
                      "what=input_buffer id=%llu peer=%s held=1", (unsigned long long)c->id,
                      c->peer);
        c->in_no_room = 1;
        conn_update_events(s, c);
        return -1;
    }
    if (grown == -2) {
        conn_out_of_memory(s, c, "input_buffer");
        return -1;
    }
    ssize_t n = read(c->fd, c->in + c->in_len, c->in_cap - c->in_len);
    if (n == 0) {
        /* The end of its input (printf ... | nc -N, or a close: they look the same until a
         * write fails). Nothing more is read; the requests the buffer holds whole are run and
         * answered in order, as Redis answers what it read before the end, and the connection
         * closes once nothing is left to answer (conn_parse_requests). */
        conn_peer_eof(s, c);
        c->in_ended = 1;
        conn_account(s, c); /* conn_grow_in may have resized the buffer */
        conn_update_events(s, c);
        return 0;
    }
    if (n < 0 && errno != EAGAIN && errno != EINTR) {
        /* The peer is gone: conn_close cancels its claims parked by WAIT so nothing waits for
         * it. */
        conn_close(s, c, "read_error");
        return -1;
    }
    if (n > 0) {
        c->in_len += (size_t)n;
        c->in_read += (uint64_t)n;
        c->last_active_ms = srv_now_ms();
    }
    conn_account(s, c);
    return 0;
}

/* ---- the budget (see the head of this file) ---- */

/* What the budget bounds: all buffers, and the replies still owed to requests being answered. */
static uint64_t budget_pressure(const srv *s)
{
    return s->io_used + s->owed_total;
}

static int over_budget(const srv *s)
{
    return budget_pressure(s) > s->cfg.io_budget_bytes;
}

/* Replies made and not yet read by c: in its output buffer, or done behind an earlier one. */
static uint64_t conn_unread(const srv_conn *c)
{
    return c->out.len - c->out.sent + c->slot_ready;
}

/* The replies c has not read yet (in `out` and waiting in slots) and those its outstanding
 * requests will add. */
static uint64_t conn_out_weight(const srv_conn *c)
{
    return conn_unread(c) + c->owed;
}

uint64_t srv_out_room(const srv *s, srv_conn *c, uint32_t seq)
{
    const srv_slot *sl = srv_slot_of(c, seq);
    uint64_t others = conn_out_weight(c) + c->short_by - sl->owed - sl->short_by;
    return others < s->cfg.client_output_max ? s->cfg.client_output_max - others : 0;
}

/* Input not parsed yet: past SRV_IN_HEAVY_BYTES, a large request on its way in, or a pipeline
 * held back (see conn_update_events). */
static size_t conn_in_pending(const srv_conn *c)
{
    return c->in_len - c->in_start;
}

/* Large requests read at once over the budget: a quarter of the budget in whole input buffers,
 * at least one, so that they go on whatever holds the rest. */
static uint32_t big_slots(const srv *s)
{
    uint64_t n = s->cfg.io_budget_bytes / 4 / SRV_IN_BUF_MAX;
    return n == 0 ? 1 : n > UINT32_MAX ? UINT32_MAX : (uint32_t)n;
}

/* What clients back in line (admitted before) may hold together: as much as the admissions. */
static uint64_t big_share(const srv *s)
{
    return (uint64_t)big_slots(s) * SRV_IN_BUF_MAX;
}

/* Since when c counts as holding its large request for big_back_enforce: since it began, or,
 * while it reads nearly every reply it was sent and has no claim parked by WAIT, since the
 * last of these, if later:
 *   - its last large request parsed whole: a client pipelining large requests one after
 *     another, the next begun before the last was parsed, holds "one" as long as it sends, and
 *     was closed as a trickle two seconds in whenever its input waited for an admission;
 *   - while its input waits for pipeline room (deferred), its last reply: it holds its request
 *     because the loop is slow to answer the ones before it (a loaded machine, a sanitizer).
 * Neither holds for one whose replies pile up unread, nor the first for one whose parse waited
 * for replies it left unread since that request (its requests, large or small, are parsed one
 * by one as it reads: a slow reader interleaving requests of 16 KiB held its large one for
 * minutes), nor either for one that waits on a claim (whose replies may come every few
 * seconds, one WAIT after another): it is counted from the start. */
static int64_t big_back_clock(const srv_conn *c)
{
    int64_t t = c->big_back_since_ms;
    if (c->waits_due || conn_unread(c) >= SRV_HEAVY_BYTES) return t;
    if (c->big_request_ms > t && c->read_slow_ms < c->big_request_ms) t = c->big_request_ms;
    if (c->deferred && c->last_reply_ms > t) t = c->last_reply_ms;
    return t;
}

/* Over the budget, clients counted by big_back_count that have held their large request in
 * part for SRV_STALL_MS or longer (big_back_clock; admitted meanwhile or not) hold at most
 * big_share() together: past it the one that began last is closed, and the next, until they
 * fit (a trickle that held an admission and let it run out, as a stalled reader is). A client
 * holding its request for less is left alone: one whose pipeline is full, behind replies it is
 * reading, holds it only that long. Housekeeping. */
static void big_back_enforce(srv *s, int64_t now)
{
    if (!over_budget(s) || s->big_back_bytes <= big_share(s)) return;
    uint64_t held = 0;
    for (uint32_t i = 0; i < s->conns_cap; i++) {
        const srv_conn *c = s->conns[i];
        if (c && c->big_back_bytes && now - big_back_clock(c) >= SRV_STALL_MS)
            held += c->big_back_bytes;
    }
    while (held > big_share(s)) {
        srv_conn *last = NULL;
        for (uint32_t i = 0; i < s->conns_cap; i++) {
            srv_conn *c = s->conns[i];
            if (c && c->big_back_bytes && now - big_back_clock(c) >= SRV_STALL_MS &&
                (!last || c->big_back_since_ms > last->big_back_since_ms))
                last = c;
        }
        if (!last) break; /* not reached: held sums those very clients */
        held -= last->big_back_bytes;
        conn_close(s, last, "input_stalled");
    }
}

/* Whether c may take an admission when one is free: over the budget, not while the clients
 * counted by big_back_count hold more than big_share() (counted for less than SRV_STALL_MS too:
 * else each admission in turn could add SRV_IN_BUF_MAX more before the first could be
 * closed), unless c is one of them: it holds its input already, and its admission frees it. */
static int big_admissible(const srv *s, const srv_conn *c)
{
    return !over_budget(s) || c->big_back_bytes || s->big_back_bytes <= big_share(s);
}

static void conn_pause(srv *s, srv_conn *c, int why)
{
    if (c->paused) return;
    c->paused = why;
    if (why == PAUSE_INPUT) {
        c->big_ticket = ++s->big_tickets;
        s->big_waiting++;
    }
    srv_log_gated(&s->log_budget_pause, "warn", "budget_pause",
                  "id=%llu why=%s out=%llu in=%zu used=%llu", (unsigned long long)c->id,
                  why == PAUSE_INPUT ? "large_request" : "unread_replies",
                  (unsigned long long)conn_out_weight(c), conn_in_pending(c),
                  (unsigned long long)budget_pressure(s));
    conn_update_events(s, c);
}

static void conn_unpause(srv *s, srv_conn *c)
{
    if (c->paused == PAUSE_INPUT) s->big_waiting--;
    c->paused = PAUSE_NONE;
    c->last_active_ms = srv_now_ms(); /* its silence while paused was idemd's (idle timeout) */
    conn_update_events(s, c);
}

static void big_admit(srv *s, srv_conn *c)
{
    if (c->big_admitted) return;
    if (c->paused == PAUSE_INPUT) conn_unpause(s, c);
    c->big_admitted = 1;
    c->big_admitted_ms = srv_now_ms();
    c->big_admitted_read = c->in_read;
    c->big_admit_keeps = 0;
    s->big_admitted++;
    big_back_count(s, c);
}

/* An admitted client gives its admission up once its large request is parsed, or once it
 * cannot parse, or is not read (paused for the replies it leaves unread): its input is then
 * held by conn_update_events, and counted by big_back_count. Kept, the admission held the
 * others' large requests back while the bytes it kept sending piled up in its socket, which
 * the sweep took for a sender going as fast as it is read. */
static void big_release(srv *s, srv_conn *c)
{
    if (!c->big_admitted ||
        (conn_in_pending(c) >= SRV_IN_HEAVY_BYTES && !c->deferred && !c->paused))
        return;
    c->big_admitted = 0;
    s->big_admitted--;
    big_back_count(s, c);
}

/* Before a read: over the budget, a client is held back only for what it holds itself. */
static void budget_check(srv *s, srv_conn *c)
{
    if (c->paused || !over_budget(s)) return;
    if (conn_out_weight(c) >= SRV_HEAVY_BYTES) {
        if (conn_unread(c) >= SRV_HEAVY_BYTES / 2) c->read_slow_ms = srv_now_ms();
        conn_pause(s, c, PAUSE_OUTPUT); /* its requests would only wait unparsed */
        big_release(s, c);              /* not read meanwhile: nor admitted */
    } else if (conn_in_pending(c) >= SRV_IN_HEAVY_BYTES && !c->big_admitted && !c->deferred) {
        if (s->big_waiting == 0 && s->big_admitted < big_slots(s) && big_admissible(s, c))
            big_admit(s, c);
        else
            conn_pause(s, c, PAUSE_INPUT);
    }
}

static int engine_room(const srv *s)
{
    /* engine_due counts the operations not yet submitted (s->ops) with those in q (it counted
     * them twice here: a full queue was never reached, its room only halved turn by turn);
     * also the reads out on the reads thread and a backup: neither holds a slot of q, and slow
     * reads (as many as connections) must not hold claims back. Room is kept for one more
     * request's operations. */
    uint32_t in_q = s->engine_due - s->reads_out - (s->backup_running ? 1u : 0u);
    return in_q + RESP_ARGV_MAX < s->cfg.queue_depth;
}

/* An idle connection keeps no input buffer: with ten thousand of them, 16 KiB each would hold
 * the whole budget. The next read allocates one again. Only when no operation of this turn
 * still points into the buffer (s->nops == 0: called from housekeeping, after a submit). */
static void conn_shed_input(srv *s, srv_conn *c)
{
    const resp_parser *p = &c->parser;
    if (s->nops || c->fd < 0 || !c->in) return;
    if (c->in_start != c->in_len || p->in_array || p->discarding || p->pos) {
        /* A partial request is kept; a large buffer holding little gives the rest back, also
         * while c is not read (conn_compact_in). */
        if (big_holder(c) && c->in_len - c->in_start < SRV_IN_HEAVY_BYTES) {
            conn_compact_in(c);
            conn_account(s, c);
        }
        return;
    }
    free(c->in);
    c->in = NULL;
    c->in_cap = c->in_len = c->in_start = 0;
    conn_account(s, c);
}

/* A connection with nothing outstanding, idle SRV_IDLE_SHED_MS, gives back reply buffers larger
 * than SRV_IDLE_BUF_MAX (its output buffer once all of it was sent, and its slots'), its slots'
 * past SRV_IDLE_SLOT_BYTES in all, and a reply ring grown past SRV_SLOTS_KEEP entries by a burst
 * of pipelined requests (about 110 bytes an entry): one reply of 40 KB left 64 KiB kept for the
 * connection's life, and ten thousand idle connections held most of the budget. The small
 * buffers it keeps answer its next requests, also while no memory is left. */
static void conn_shed_output(srv *s, srv_conn *c, int64_t now)
{
    /* Idle a second: a client of large replies one at a time keeps its buffers meanwhile. */
    if (c->head_seq != c->tail_seq || now - c->last_active_ms < SRV_IDLE_SHED_MS) return;
    int ring = c->slot_cap > SRV_SLOTS_KEEP, shed = ring; /* a ring this large is counted */
    if (c->out.len == 0 && !c->out.overflow && c->out.cap > SRV_IDLE_BUF_MAX) {
        resp_buf_free(&c->out);
        shed = 1;
    }
    for (uint32_t i = 0; i < c->slot_cap && (ring || c->slot_bytes > SRV_IDLE_BUF_MAX); i++) {
        srv_slot *sl = &c->slots[i];
        if (!sl->buf.cap ||
            (!ring && sl->buf.cap <= SRV_IDLE_BUF_MAX && c->slot_bytes <= SRV_IDLE_SLOT_BYTES))
            continue;
        c->slot_bytes -= sl->buf_counted;
        sl->buf_counted = 0;
        resp_buf_free(&sl->buf);
        shed = 1;
    }
    if (ring) {
        free(c->slots);
        c->slots = NULL;
        c->slot_cap = 0; /* slot_alloc makes a small one at the next request */
    }
    if (shed) conn_account(s, c);
}

static int conn_may_parse(srv *s, srv_conn *c)
{
    if (c->tail_seq - c->head_seq >= s->cfg.pipeline_max) return 0;
    if (c->read_due) return 0; /* its read sees nothing after it (reads.c) */
    /* As Redis blocks a client in BLPOP: what follows a claim with WAIT runs once it is
     * answered. Run before, a claim pipelined behind it would get `new` and a lease that runs
     * while its reply waits behind the WAIT, and another worker could recover the key. */
    if (c->waits_due) return 0;
    /* As Redis, a client may pipeline far ahead of reading its replies: they collect in its
     * output, up to --client-output-max (replies still owed count at the largest their
     * commands can make, and a request is parsed only while the rest leaves room for the
     * largest reply its command can make, the first one always: a pipeline is held back, not
     * closed, at that limit). Past half the global budget the allowance shrinks to SRV_OWED_TIGHT,
     * and past the budget to SRV_HEAVY_BYTES. Input never holds parsing back: parsing is what frees
     * it. */
    uint64_t owed = conn_out_weight(c) + c->short_by;
    /* Before AUTH, as its input is: a client without a password that never reads makes idemd
     * hold SRV_UNAUTH_OUT_MAX of -NOAUTH replies, not --client-output-max. */
    if (c->role == ROLE_NONE && owed >= SRV_UNAUTH_OUT_MAX) return 0;
    uint64_t pressure = budget_pressure(s);
    uint64_t limit = s->cfg.client_output_max;
    uint64_t cap = over_budget(s)                          ? SRV_HEAVY_BYTES
                   : pressure > s->cfg.io_budget_bytes / 2 ? SRV_OWED_TIGHT
                                                           : limit;
    if (cap > limit) cap = limit;
    if (owed >= cap) {
        /* Held back by replies made and left unread, not by those still being made: a slow
         * reader, timed from the start in what it holds (big_back_clock). */
        if (conn_unread(c) >= SRV_HEAVY_BYTES / 2) c->read_slow_ms = srv_now_ms();
        return 0;
    }
    /* Room for the next request's reply within the client's limit (a pipeline is held back
     * there, not closed): the first one always. The next command is looked at only within one
     * largest reply of the limit (a record's, or SRV_REPLY_LONG), not at each pipelined
     * request. */
    uint64_t window = srv_record_reply_now(s);
    if (window < SRV_REPLY_LONG) window = SRV_REPLY_LONG;
    if (owed && owed + window > limit &&
        owed + srv_next_reply_max(s, c->in + c->in_start, c->in_len - c->in_start) > limit)
        return 0;
    return engine_room(s);
}

static void conn_refuse(srv *s, srv_conn *c, const char *err)
{
    uint32_t seq;
    if (slot_alloc(c, &seq) < 0) {
        conn_out_of_memory(s, c, "reply_slot");
        return;
    }
    resp_error(srv_reply_buf(c, seq), err);
    srv_reply_done(s, c, seq);
}

static void conn_parse_requests(srv *s, srv_conn *c)
{
    if (c->deferred) {
        c->deferred = 0;
        c->last_active_ms = srv_now_ms(); /* the wait was idemd's (the idle timeout's rule) */
        conn_update_events(s, c);
    }
    while (c->fd >= 0 && !c->close_after_write) {
        if (!conn_may_parse(s, c)) {
            c->deferred = 1;
            conn_update_events(s, c);
            if (!engine_room(s) && !c->in_held) {
                c->in_held = 1; /* retried as soon as completions free engine room */
                s->held[s->nheld++] = c;
            }
            return;
        }
        if (s->nops + RESP_ARGV_MAX > IDEM_BATCH_MAX) submit_batch(s);
        size_t used;
        int r = resp_parse(&c->parser, c->in + c->in_start, c->in_len - c->in_start, &used);
        c->in_start += used;
        if (r == RESP_NEED_MORE && c->in_ended) {
            /* Every whole request it sent is parsed; one cut short by the end is not run, and
             * its bytes (up to a whole input buffer) are let go of now, not at the close. */
            srv_flush_ops(s); /* nothing queued points into the buffer after */
            free(c->in);
            c->in = NULL;
            c->in_cap = c->in_len = c->in_start = 0;
            cmd_parser_limits(s, c);
            conn_account(s, c);
            c->close_after_write = 1;
            if (c->head_seq == c->tail_seq && c->out.sent == c->out.len) conn_close(s, c, "eof");
            return;
        }
        if (r == RESP_NEED_MORE) {
            /* Before AUTH a request begun must end within SRV_UNAUTH_REQUEST_MS (housekeeping):
             * connections that each hold a partial one would add up past the budget. */
            int partial = c->parser.in_array || c->parser.discarding || c->in_len > c->in_start;
            if (!partial)
                c->partial_since_ms = 0;
            else if (!c->partial_since_ms)
                c->partial_since_ms = srv_now_ms();
            return;
        }
        c->partial_since_ms = 0;
        if (used >= SRV_IN_HEAVY_BYTES) c->big_request_ms = srv_now_ms(); /* big_back_clock */
        if (r == RESP_REFUSED) {
            conn_refuse(s, c, cmd_refusal(c));
        } else if (r == RESP_CLOSE) {
            srv_log_gated(&s->log_protocol, "warn", "protocol_error", "id=%llu peer=%s msg=\"%s\"",
                          (unsigned long long)c->id, c->peer, c->parser.err);
            if (c->parser.err[0]) conn_refuse(s, c, c->parser.err);
            c->close_after_write = 1;
            conn_update_events(s, c);
            if (!c->parser.err[0]) conn_close(s, c, "http");
            return;
        } else {
            uint32_t seq;
            if (slot_alloc(c, &seq) < 0) {
                conn_out_of_memory(s, c, "reply_slot");
                return;
            }
            s->total_commands++;
            cmd_dispatch(s, c, seq, c->parser.nargs, c->parser.argv, c->parser.argl);
        }
    }
}

/* Parses what c sent, as far as it may; what c then holds unparsed is counted again
 * (big_back_count). A connection that hung up gets no event for the bytes it sent last: they
 * are read here, as parsing goes on, until its end. */
static void conn_parse(srv *s, srv_conn *c)
{
    conn_parse_requests(s, c);
    while (c->hung_up && c->fd >= 0 && !c->in_ended && !c->deferred && !c->paused &&
           !c->close_after_write && !s->draining) {
        /* Ops queued from the last read point into the input buffer, which the next read may
         * move or free (conn_grow_in): they are submitted first. */
        srv_flush_ops(s);
        size_t had = c->in_len - c->in_start;
        if (conn_read(s, c) < 0) return;
        if (!c->in_ended && c->in_len - c->in_start == had) {
            conn_close(s, c, "hangup"); /* nothing to read, and no event would come */
            return;
        }
        conn_parse_requests(s, c);
    }
    big_back_count(s, c);
}

/* ---- writing ---- */

static void conn_write(srv *s, srv_conn *c)
{
    if (c->fd < 0) return;
    if (c->hung_up) { /* its replies go nowhere: none is too large */
        c->out.sent = c->out.len;
        c->out.overflow = c->out.no_memory = 0;
    }
    if (c->out.overflow && c->out.no_memory) {
        /* A reply found no memory: the whole replies before it are written (the requests they
         * answer took effect), the rest of out is dropped (a reply cut short would be read as
         * the next ones), no later reply is added, and nothing more is read. */
        srv_log_gated(&s->log_oom, "warn", "out_of_memory", "what=reply id=%llu peer=%s",
                      (unsigned long long)c->id, c->peer);
        c->out.len = c->out_whole;
        c->out.overflow = c->out.no_memory = 0;
        c->out_cut = c->close_after_write = 1;
        cancel_waits(s, c); /* a claim parked behind it would get a lease nobody hears of */
    }
    if (c->out.overflow) { /* a reply cut short is not sent: the rest would be read as replies */
        conn_close(s, c, "output_limit");
        return;
    }
    if (c->out.sent < c->out.len && c->out_progress_ms == 0)
        c->out_progress_ms = srv_now_ms(); /* a backlog begins: the stall clock starts */
    while (c->out.sent < c->out.len) {
        ssize_t n = write(c->fd, c->out.data + c->out.sent, c->out.len - c->out.sent);
        if (n > 0) {
            c->out.sent += (size_t)n;
            /* Idle time counts from the last reply too: a WAIT or a backup longer than the
             * idle timeout closed the connection right after its answer. */
            c->last_active_ms = c->out_progress_ms = c->last_reply_ms = srv_now_ms();
        } else if (n < 0 && (errno == EAGAIN || errno == EINTR)) {
            break;
        } else {
            conn_close(s, c, "write_error");
            return;
        }
    }
    if (c->out.sent == c->out.len) {
        c->out.len = c->out.sent = 0;
        c->out_progress_ms = 0;
        if (c->out.cap > 65536) resp_buf_free(&c->out); /* keep idle connections light */
        if (c->close_after_write && c->head_seq == c->tail_seq) {
            conn_close(s, c, c->out_cut ? "out_of_memory" : "closed");
            return;
        }
    } else if (c->out.sent > c->out.len / 2) {
        resp_buf_consume(&c->out, c->out.sent); /* sent is 0 after */
    }
    c->out_whole = c->out.len; /* out holds whole replies between turns */
    conn_account(s, c);
    if (c->paused == PAUSE_OUTPUT && conn_out_weight(c) < SRV_HEAVY_BYTES / 2)
        conn_unpause(s, c); /* it reads its replies: read it again */
    conn_update_events(s, c);
    srv_reads_unpark(s, c); /* its read may have room now */
}

/* Connections held back by the full engine queue go on as soon as there is room again. */
static void retry_held(srv *s)
{
    uint32_t n = s->nheld;
    s->nheld = 0;
    for (uint32_t i = 0; i < n; i++) {
        srv_conn *c = s->held[i];
        c->in_held = 0;
        if (c->fd >= 0 && c->deferred && !s->draining) conn_parse(s, c);
    }
}

/* Writes the connections with new replies, and parses on for those whose output allowance held
 * their requests back. A parse may answer at once and list the connection again: it waits for
 * the next pass (the loop does not sleep meanwhile). One pass used to write and parse one
 * connection again and again while it read fast, listing it each time: the list ran past its
 * end (it holds 2 x conns_cap: each connection at most once among those listed during a pass). */
static void write_dirty(srv *s)
{
    uint32_t n = s->ndirty;
    for (uint32_t i = 0; i < n; i++) {
        srv_conn *c = s->dirty[i];
        c->in_dirty = 0;
        if (c->fd >= 0) conn_write(s, c);
        if (c->fd >= 0 && c->deferred && !s->draining) conn_parse(s, c); /* draining: no more */
    }
    s->ndirty -= n;
    memmove(s->dirty, s->dirty + n, s->ndirty * sizeof *s->dirty);
    reap_dead(s);
}

/* ---- completions ---- */

/* A WAIT claim answered `new` once its connection was closed: no one will read it. It is
 * released with its token, as the side effect certainly did not happen (no one was told to do
 * it), so that the next claim gets `new` at once, not `recover` (or `review`, for a person) once
 * a lease nobody held ran out. Not for a claim with OWNER: that worker may resume it through
 * another connection. The releases are submitted once the round's completions are read
 * (submit_unheard): a batch sent among them would reuse the slots whose bytes they point into.
 * The key stays with the slot until the release completes. */
static void unheard_add(srv *s, srv_conn *c, uint32_t seq, int64_t token)
{
    srv_slot_of(c, seq)->unheard_token = token;
    s->unheard[s->nunheard++] = (struct srv_unheard){.conn = c->index, .seq = seq};
}

static void submit_unheard(srv *s)
{
    for (uint32_t i = 0; i < s->nunheard; i++) {
        srv_conn *c = s->conns[s->unheard[i].conn]; /* dead, kept: its release is due */
        srv_slot *sl = srv_slot_of(c, s->unheard[i].seq);
        idem_op op;
        memset(&op, 0, sizeof op);
        op.kind = IDEM_OP_RELEASE;
        op.key = sl->wait_key;
        op.key_len = sl->wait_key_len;
        op.token = sl->unheard_token;
        srv_submit_op(s, c, s->unheard[i].seq, RK_OWNER, &op);
    }
    s->nunheard = 0;
}

/* The completion of submit_unheard's release of the claim token names. */
static void unheard_released(srv *s, srv_conn *c, int err, int64_t token)
{
    /* Stale or gone: the lease ran out and the key went on. Else (a full queue, a failed store)
     * the key stays held for its lease, as it was before such releases: said. */
    if (err == IDEM_ESTALE || err == IDEM_ENOTFOUND) return;
    if (err != IDEM_OK) {
        srv_log_gated(&s->log_unheard, "warn", "claim_release_failed",
                      "id=%llu peer=%s token=%lld error=\"%s\" msg=\"a WAIT claim's new came after "
                      "its client was gone, and its release failed: the key is held until its "
                      "lease runs out\"",
                      (unsigned long long)c->id, c->peer, (long long)token, idem_strerror(err));
        return;
    }
    s->claims_released_unheard++;
    srv_log_gated(&s->log_unheard, "info", "claim_released",
                  "id=%llu peer=%s token=%lld msg=\"a WAIT claim's new came after its client "
                  "was gone: released\"",
                  (unsigned long long)c->id, c->peer, (long long)token);
}

static void complete_one(srv *s, const idem_completion *cp)
{
    srv_conn *c = s->conns[cp->user_data >> 32];
    uint32_t seq = (uint32_t)cp->user_data;
    if (!c) return;
    c->engine_due--;
    s->engine_due--;
    if (cp->err == IDEM_EFATAL) s->fatal = 1;
    if (cp->err == IDEM_EFULL)
        srv_log_gated(
            &s->log_full, "warn", "full", "id=%llu peer=%s msg=\"%s\"", (unsigned long long)c->id,
            c->peer,
            "a change refused: capacity limit or full disk, or no file descriptor for the "
            "log's next segment or the token reservation, or an index that cannot grow "
            "(index_refusals; nothing was evicted)");
    srv_slot *sl = srv_slot_of(c, seq);
    if (sl->kind == RK_RESOLVE) /* also when its client is gone: the decision took effect */
        log_resolve_result(c, seq, cp->err);
    /* A parked claim gives its share of WAIT back whoever it answers: a closed connection, or
     * a request answered already (drain) count too, or WAIT would stop working for good. */
    if (sl->is_wait) {
        sl->is_wait = 0;
        s->wait_due--;
        c->waits_due--;
    }
    if (sl->wait_key) {
        /* Its client closed (dead), or hung up both ways: a unix peer's close, which leaves
         * the connection open until what it sent is answered, and sends its replies nowhere.
         * The slot of a hung-up one is answered by the release (an +OK that goes nowhere). */
        if (sl->kind == RK_CLAIM && (c->dead || c->hung_up) && cp->err == IDEM_OK &&
            cp->outcome == IDEM_NEW) {
            sl->remaining--;
            unheard_add(s, c, seq, cp->token); /* c is freed after this turn's polls at best */
            return;
        }
        if (sl->kind == RK_OWNER) unheard_released(s, c, cp->err, sl->unheard_token);
        free(sl->wait_key);
        sl->wait_key = NULL;
    }
    if (sl->state != SLOT_PENDING) return; /* answered already (drain) */
    sl->remaining--;
    if (sl->kind == RK_DEL) cmd_del_count(c, sl, cp); /* its outcome line, client gone or not */
    if (sl->queue_refused) {
        if (sl->remaining == 0) queue_refused_answer(s, c, seq);
        return;
    }
    if (c->dead) return;
    resp_buf *rb = srv_reply_buf(c, seq);
    size_t before = rb->len;
    int done = cmd_complete(s, sl, rb, cp);
    /* The estimate follows the largest recent reply: it rises at once and decays slowly. */
    size_t got = rb->len > before ? rb->len - before : 0,
           decayed = c->reply_est - c->reply_est / 16;
    c->reply_est = got > decayed ? got : decayed > SRV_REPLY_SMALL ? decayed : SRV_REPLY_SMALL;
    if (done && sl->timed) claim_latency_add(s, sl);
    if (done) srv_reply_done(s, c, seq);
}

/* Delivers what the engine completed. A readable queue eventfd is drained by idem_poll even
 * when nothing is owed (the queue signals it once when the fd is first asked for): left
 * readable, it would wake every epoll_wait at once and spin the loop. */
static void poll_completions(srv *s)
{
    int drain = s->queue_signalled;
    s->queue_signalled = 0;
    for (int rounds = 0; s->q && (s->engine_due > 0 || drain); rounds++) {
        if (rounds == 64) {
            /* More may be ready (a queue deeper than 64 rounds), and the polls took the
             * queue's signal: the next turn polls again, at once (loop_turn). */
            s->queue_signalled = 1;
            return;
        }
        drain = 0;
        int n = idem_poll(s->q, s->comps, COMPLETIONS_MAX, 0);
        if (n < 0 && n != IDEM_EBUSY) {
            srv_log("error", "poll_failed", "err=\"%s\"", idem_strerror(n));
            if (n == IDEM_EFATAL) s->fatal = 1;
            return;
        }
        if (n <= 0) return;
        for (int i = 0; i < n; i++)
            complete_one(s, &s->comps[i]);
        submit_unheard(s);
        if (n < COMPLETIONS_MAX) return;
    }
}

/* ---- housekeeping: stalled readers, idle input, admissions, deferred, idle ---- */

/* Bytes the client sent that wait in the kernel to be read (SIOCINQ); -1 if unknown. */
static int conn_inq(const srv_conn *c)
{
    int q = 0;
    return ioctl(c->fd, FIONREAD, &q) == 0 ? q : -1;
}

/* Bytes the kernel holds for c that the client has not acknowledged; -1 if unknown. */
static int conn_outq(const srv_conn *c)
{
    int q = 0;
    return ioctl(c->fd, SIOCOUTQ, &q) == 0 ? q : -1;
}

/* Over the budget, a client that holds SRV_STALL_BYTES of unread replies and has read none of
 * them for SRV_STALL_MS is a slow reader: it is closed (every one of them, not only the worst:
 * slow readers must not hold the budget and starve the others). Whether it read is asked of the
 * kernel: the loop sees room only once a third of the socket's buffer is free, so a client that
 * reads slowly makes no write progress for long, but its unacknowledged bytes (SIOCOUTQ)
 * shrink. They are looked at twice: once half a stall period has passed, and half a period
 * later at the earliest. */
static int conn_stalled(srv_conn *c, int64_t now)
{
    if (c->out.len - c->out.sent < SRV_STALL_BYTES || c->out_progress_ms == 0) return 0;
    int64_t idle = now - c->out_progress_ms;
    if (idle < SRV_STALL_MS / 2) return 0;
    if (c->outq_ms <= c->out_progress_ms) { /* half-way: where the kernel's queue stands */
        c->outq_ms = now;
        c->outq_bytes = conn_outq(c);
        return 0;
    }
    if (idle < SRV_STALL_MS || now - c->outq_ms < SRV_STALL_MS / 2) return 0;
    int q = conn_outq(c);
    if (q >= 0 && c->outq_bytes >= 0 && q < c->outq_bytes) { /* it reads, slowly */
        c->out_progress_ms = now;
        return 0;
    }
    return 1;
}

/* The first pass: closes stalled readers, sheds idle input buffers, ends admissions (its request
 * parsed, or held SRV_STALL_MS while others wait). Returns the client that has waited longest
 * for an admission, if any. */
static srv_conn *housekeeping_sweep(srv *s, int64_t now)
{
    int over = over_budget(s);
    srv_conn *first = NULL;
    for (uint32_t i = 0; i < s->conns_cap; i++) {
        srv_conn *c = s->conns[i];
        if (!c || c->fd < 0) continue;
        if (over && conn_stalled(c, now)) {
            conn_close(s, c, "output_stalled");
            continue;
        }
        conn_shed_input(s, c);
        conn_shed_output(s, c, now);
        big_release(s, c);
        /* A client waiting for an admission that no longer needs one: parsing brought its
         * input below the bound, or it cannot parse (its input is held as it is). */
        if (c->paused == PAUSE_INPUT && (c->deferred || conn_in_pending(c) < SRV_IN_HEAVY_BYTES))
            conn_unpause(s, c);
        if (c->big_admitted && s->big_waiting && now - c->big_admitted_ms >= SRV_STALL_MS &&
            c->big_admit_keeps < SRV_ADMIT_KEEPS_MAX &&
            (c->in_read - c->big_admitted_read >= SRV_ADMIT_GOING_BYTES || conn_inq(c) > 0)) {
            /* Sending as fast as it is read (1 MiB in the 2 s, or more waiting in its socket
             * now): kept on. Sent back in line, it held its input beside the next admission's,
             * and past the share one of them was closed. */
            c->big_admit_keeps++;
            c->big_admitted_ms = now;
            c->big_admitted_read = c->in_read;
        } else if (c->big_admitted && s->big_waiting && now - c->big_admitted_ms >= SRV_STALL_MS) {
            c->big_admitted = 0; /* a trickle must not keep the others waiting: back in line */
            s->big_admitted--;
            /* with its input, which stays until its next admission: past the share, each
             * admission in turn would add up to SRV_IN_BUF_MAX more */
            conn_pause(s, c, PAUSE_INPUT); /* (or stays paused for its output) */
            big_back_count(s, c);
        }
        if (c->paused == PAUSE_INPUT && big_admissible(s, c) &&
            (!first || c->big_ticket < first->big_ticket))
            first = c;
    }
    return first;
}

#ifndef NDEBUG
/* Debug builds: big_back_bytes is the sum of the connections' shares, each as big_back_count
 * makes it (a change of state that missed it would let input in line go uncounted). */
static void big_back_verify(const srv *s)
{
    uint64_t sum = 0;
    for (uint32_t i = 0; i < s->conns_cap; i++) {
        const srv_conn *c = s->conns[i];
        if (!c) continue;
        IDEM_DEBUG_ASSERT(c->big_back_bytes == (big_back_held(c) ? c->in_cap : 0));
        sum += c->big_back_bytes;
    }
    IDEM_DEBUG_ASSERT(sum == s->big_back_bytes);
}
#endif

static void housekeeping(srv *s, int64_t now)
{
    metrics_tick(s, now);
    listeners_resume(s, now);
    srv_conn *first = housekeeping_sweep(s, now);
#ifndef NDEBUG
    big_back_verify(s);
#endif
    int unpause_all = budget_pressure(s) <= s->cfg.io_budget_bytes / 4 * 3;
    for (uint32_t i = 0; i < s->conns_cap; i++) {
        srv_conn *c = s->conns[i];
        if (!c || c->fd < 0) continue;
        if (c->paused && unpause_all) conn_unpause(s, c);
        if (c->paused == PAUSE_OUTPUT && conn_out_weight(c) < SRV_HEAVY_BYTES / 2)
            conn_unpause(s, c);
        if (c->deferred && !s->draining) conn_parse(s, c);
        if (c->fd >= 0 && c->role == ROLE_NONE && c->partial_since_ms &&
            now - c->partial_since_ms >= SRV_UNAUTH_REQUEST_MS)
            conn_close(s, c, "unfinished_request_before_auth");
        /* Connections that hold a slot without a password cannot fill --max-clients for good. */
        if (c->fd >= 0 && c->role == ROLE_NONE && now - c->accepted_ms >= s->unauth_ms)
            conn_close(s, c, "auth_timeout");
        /* Not one idemd stopped reading (paused), nor one whose request idemd holds unparsed
         * (deferred: no room in the engine's queue, or for its input): its silence is idemd's;
         * the budget's rules time it. */
        if (c->fd >= 0 && !c->hung_up && !c->paused && !(c->deferred && conn_in_pending(c) > 0) &&
            s->cfg.idle_timeout_ms && c->head_seq == c->tail_seq && c->out.len == 0 &&
            now - c->last_active_ms > (int64_t)s->cfg.idle_timeout_ms)
            conn_close(s, c, "idle_timeout");
    }
    /* After the deferred clients' parses: a whole large request that waited for room, parsed
     * now, is not judged by the time its holder held it. */
    big_back_enforce(s, now);
    /* Admissions in arrival order; the sweep found the oldest, later ones wait a turn each. */
    if (first && first->fd >= 0 && first->paused == PAUSE_INPUT && s->big_admitted < big_slots(s) &&
        big_admissible(s, first))
        big_admit(s, first);
}

/* ---- listeners ---- */

/* Does a live server accept connections on this unix socket path? */
static int unix_in_use(const struct sockaddr_un *a)
{
    int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0) return 0;
    int live = connect(fd, (const struct sockaddr *)a, sizeof *a) == 0;
    close(fd);
    return live;
}

static int listen_unix(srv *s)
{
    struct sockaddr_un a = {.sun_family = AF_UNIX};
    if (strlen(s->cfg.socket_path) >= sizeof a.sun_path) {
        srv_log("error", "listen_failed", "socket=%s msg=\"path too long\"", s->cfg.socket_path);
        return -1;
    }
    strcpy(a.sun_path, s->cfg.socket_path);
    /* The default socket lives in the store directory, which the store may not have made yet. */
    if (mkdir(s->cfg.dir, 0700) != 0 && errno != EEXIST)
        srv_log("warn", "mkdir_failed", "dir=%s error=\"%s\"", s->cfg.dir, strerror(errno));
    int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (fd < 0) {
        srv_log("error", "listen_failed", "socket=%s error=\"%s\"", s->cfg.socket_path,
                strerror(errno));
        return -1;
    }
    if (unix_in_use(&a)) {
        srv_log("error", "listen_failed", "socket=%s msg=\"another server answers there\"",
                s->cfg.socket_path);
        close(fd);
        return -1;
    }
    /* A stale socket of a server that is gone is removed; anything else at the path (a file
     * the flag named by mistake) is not. */
    struct stat st;
    if (lstat(a.sun_path, &st) == 0 && !S_ISSOCK(st.st_mode)) {
        srv_log("error", "listen_failed", "socket=%s msg=\"the path exists and is not a socket\"",
                s->cfg.socket_path);
        close(fd);
        return -1;
    }
    unlink(a.sun_path);
    mode_t old = umask(0777);
    int rc = bind(fd, (struct sockaddr *)&a, sizeof a);
    umask(old);
    if (rc != 0 || chmod(a.sun_path, s->cfg.socket_mode) != 0 || listen(fd, 511) != 0) {
        srv_log("error", "listen_failed", "socket=%s error=\"%s\"", s->cfg.socket_path,
                strerror(errno));
        close(fd);
        return -1;
    }
    s->unix_fd = fd;
    if (ep_add(s, fd, TAG_UNIX, EPOLLIN, "unix_socket") != 0) return -1;
    srv_log("info", "listening", "socket=%s mode=%04o", s->cfg.socket_path, s->cfg.socket_mode);
    return 0;
}

/* Listens on addr:port over TCP, IPv4 or IPv6, and writes the address as logs name it into
 * where (IPv6 in brackets); returns the fd or -1. */
static int listen_tcp_on(const char *addr, int port, char *where, size_t cap)
{
    struct sockaddr_storage a;
    socklen_t alen;
    snprintf(where, cap, "%s:%d", addr, port);
    if (srv_addr_parse(addr, port, &a, &alen) < 0) {
        errno = EINVAL;
        return -1;
    }
    srv_addr_format((const struct sockaddr *)&a, where, cap);
    int fd = socket(a.ss_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0), one = 1, zero = 0;
    if (fd < 0) return -1;
    setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    /* `::` takes IPv4 connections too, whatever the system's default (bindv6only). */
    if (a.ss_family == AF_INET6) setsockopt(fd, IPPROTO_IPV6, IPV6_V6ONLY, &zero, sizeof zero);
    if (bind(fd, (struct sockaddr *)&a, alen) != 0 || listen(fd, 511) != 0) {
        int e = errno; /* for the caller's log line */
        close(fd);
        errno = e;
        return -1;
    }
    return fd;
}

static int listen_all(srv *s)
{
    if (s->cfg.socket_path[0] && listen_unix(s) < 0) return -1;
    if (s->cfg.port > 0) {
        char where[80];
        s->tcp_fd = listen_tcp_on(s->cfg.bind_addr, s->cfg.port, where, sizeof where);
        if (s->tcp_fd < 0) {
            srv_log("error", "listen_failed", "addr=%s error=\"%s\"", where, strerror(errno));
            return -1;
        }
        if (ep_add(s, s->tcp_fd, TAG_TCP, EPOLLIN, "tcp_socket") != 0) return -1;
        srv_log("info", "listening", "addr=%s", where);
    }
    if (s->cfg.metrics_listen[0]) {
        char host[64], where[80]; /* ADDR:PORT, checked when the flag was parsed (main.c) */
        int port = 0;
        if (srv_addr_split(s->cfg.metrics_listen, host, sizeof host, &port) < 0) host[0] = '\0';
        s->metrics_fd = listen_tcp_on(host, port, where, sizeof where);
        if (s->metrics_fd < 0) {
            srv_log("error", "listen_failed", "metrics=%s error=\"%s\"", s->cfg.metrics_listen,
                    strerror(errno));
            return -1;
        }
        metrics_init(s);
        if (ep_add(s, s->metrics_fd, TAG_METRICS, EPOLLIN, "metrics_socket") != 0) return -1;
        srv_log("info", "listening", "metrics=%s", s->cfg.metrics_listen);
    }
    return 0;
}

static void stop_listening(srv *s)
{
    if (s->unix_fd >= 0) {
        close(s->unix_fd);
        unlink(s->cfg.socket_path);
        s->unix_fd = -1;
    }
    if (s->tcp_fd >= 0) {
        close(s->tcp_fd);
        s->tcp_fd = -1;
    }
    if (s->metrics_fd >= 0) {
        close(s->metrics_fd);
        s->metrics_fd = -1;
    }
}

/* ---- loading the store (recovery runs on a thread so that clients get -LOADING) ---- */

static void *load_main(void *arg)
{
    srv *s = arg;
    idem_options o;
    idem_options_init(&o);
    o.durability = s->cfg.durability;
    o.lease_policy = s->cfg.lease_policy;
    o.test_clock = s->cfg.test_clock;
    o.max_keys = s->cfg.max_keys;
    o.max_memory_bytes = s->cfg.max_memory_bytes;
    o.max_disk_bytes = s->cfg.max_disk_bytes;
    o.result_bytes_max = s->cfg.result_bytes_max;
    idem_store *st = NULL;
    s->load_err = idem_open(s->cfg.dir, &o, &st);
    if (s->load_err != IDEM_OK)
        srv_log("error", "open_failed", "dir=%s err=\"%s\" msg=\"%s\"", s->cfg.dir,
                idem_strerror(s->load_err), idem_last_error());
    /* Tests hold the server in -LOADING for a while (with --test-clock only). */
    const char *delay = getenv("IDEM_TEST_LOAD_DELAY_MS");
    if (s->cfg.test_clock && delay) {
        unsigned long ms = strtoul(delay, NULL, 10);
        if (ms > 10000) ms = 10000;
        struct timespec ts = {(time_t)(ms / 1000), (long)(ms % 1000) * 1000000L};
        while (nanosleep(&ts, &ts) != 0 && errno == EINTR) {
        }
    }
    s->loaded = st; /* the loop takes it after the join (load_finish): s->store is the loop's */
    uint64_t one = 1;
    ssize_t w = write(s->load_fd, &one, sizeof one);
    (void)w;
    return NULL;
}

static int load_finish(srv *s)
{
    pthread_join(s->load_thread, NULL);
    s->load_started = 0;
    if (s->load_err != IDEM_OK) return -1;
    s->store = s->loaded;
    if (idem_queue_open(s->store, s->cfg.queue_depth, &s->q) != IDEM_OK) {
        srv_log("error", "queue_open_failed", "depth=%u error=\"%s\"", s->cfg.queue_depth,
                idem_last_error());
        return -1;
    }
    if (ep_add(s, idem_queue_fd(s->q), TAG_QUEUE, EPOLLIN, "queue") != 0) return -1;
    /* Reads made on the loop would leave every other client unanswered meanwhile (reads.c). */
    int rc = srv_reads_start(s);
    if (rc != 0) {
        srv_log("error", "reads_thread_failed",
                "msg=\"could not start the threads that make scans, audit queries and stats "
                "readings\" "
                "error=\"%s\"",
                strerror(rc));
        return -1;
    }
    s->loading = 0;
    idem_stats st;
    idem_get_stats(s->store, &st);
    srv_log("info", "ready",
            "dir=%s backend=%s open_ms=%llu frames_replayed=%llu keys=%llu in_flight=%llu "
            "review=%llu committed=%llu",
            s->cfg.dir, idem_io_backend_name(s->store), (unsigned long long)st.open_ms,
            (unsigned long long)st.frames_replayed, (unsigned long long)st.keys,
            (unsigned long long)st.keys_in_flight, (unsigned long long)st.keys_review,
            (unsigned long long)st.keys_committed);
    return 0;
}

/* ---- shutdown ---- */

/* Answers every request still waiting on the engine with `err` (fatal error or shutdown). */
static void answer_pending(srv *s, int waits_only, const char *err)
{
    for (uint32_t i = 0; i < s->conns_cap; i++) {
        srv_conn *c = s->conns[i];
        if (!c || c->fd < 0) continue;
        for (uint32_t q = c->head_seq; q != c->tail_seq; q++) {
            srv_slot *sl = srv_slot_of(c, q);
            if (sl->state != SLOT_PENDING || (waits_only && !sl->is_wait)) continue;
            resp_buf *b = srv_reply_buf(c, q);
            if (waits_only) {
                resp_array(b, 2);
                resp_bulk_str(b, "busy");
                resp_integer(b, 0);
            } else if (s->backup_running && i == s->backup_conn && q == s->backup_seq) {
                /* A copy still running: waited for after the connections close. */
                resp_error(b, "ERR server is shutting down: the backup goes on until the copy "
                              "ends, and its outcome is logged (event=backup_done or "
                              "event=backup_failed)");
            } else {
                resp_error(b, err);
            }
            srv_reply_done(s, c, q);
        }
    }
}

/* Writes what can be written within ms, for the last replies before exit. */
static void flush_all(srv *s, int ms)
{
    int64_t end = srv_now_ms() + ms;
    write_dirty(s);
    for (;;) {
        int left = 0;
        for (uint32_t i = 0; i < s->conns_cap; i++) {
            srv_conn *c = s->conns[i];
            if (c && c->fd >= 0 && c->out.sent < c->out.len) {
                conn_write(s, c);
                left += c->fd >= 0 && c->out.sent < c->out.len;
            }
        }
        if (!left || srv_now_ms() >= end) return;
        struct timespec ts = {0, 5 * 1000000};
        nanosleep(&ts, NULL);
    }
}

static int shutdown_fatal(srv *s)
{
    srv_log("error", "fatal", "msg=\"the store failed a write or flush; exiting\" reason=\"%s\"",
            s->store ? idem_fatal_reason(s->store) : "");
    s->draining = 1; /* the last writes parse nothing more: a request parsed now went unanswered */
    answer_pending(s, 0,
                   "ERR fatal store error: the outcome of this request is unknown, "
                   "check it after a restart");
    flush_all(s, 500);
    return 1;
}

/* One drain step: returns nonzero when the server may exit. */
static int drain_step(srv *s)
{
    /* Every operation the engine took is answered by it: claims that waited (cancelled at the
     * drain's start) answer busy with the lease they waited on, and one granted just before
     * keeps its grant (answered busy here, its grant would leave a lease no one holds). Only
     * past DRAIN_ANSWER_MS (30 s) are the claims still waiting answered here, and then every
     * other request still unanswered (behind a flush that stalls, or a long read) is told that
     * its outcome is not known, rather than left without a reply at the close. */
    if (s->engine_due > 0) {
        if (srv_now_ms() - s->drain_started_ms < s->drain_answer_ms) return 0;
        char msg[200];
        snprintf(msg, sizeof msg,
                 "ERR server is shutting down and this request had no answer within %lld s: its "
                 "outcome is unknown (made durable at the close if it was carried out)",
                 (long long)((s->drain_answer_ms + 999) / 1000));
        answer_pending(s, 1, NULL);
        answer_pending(s, 0, msg);
    }
    flush_all(s, DRAIN_WRITE_MS);
    return 1;
}

/* ---- the loop ---- */

static void on_signal(srv *s)
{
    struct signalfd_siginfo si;
    while (read(s->sig_fd, &si, sizeof si) == (ssize_t)sizeof si) {
        if (!s->draining) {
            srv_log("info", "draining", "signal=%u", si.ssi_signo);
            s->draining = 1;
            s->drain_started_ms = srv_now_ms();
            /* Claims waiting with WAIT answer busy now, with the lease they were waiting on. */
            if (s->store) idem_cancel_waits(s->store);
            stop_listening(s);
            for (uint32_t i = 0; i < s->conns_cap; i++)
                if (s->conns[i]) conn_update_events(s, s->conns[i]);
        }
    }
}

static void on_conn_event(srv *s, uint32_t idx, uint32_t events)
{
    srv_conn *c = s->conns[idx];
    if (!c || c->fd < 0) return;
    if (events & (EPOLLHUP | EPOLLERR)) {
        /* Gone both ways (a close on the unix socket, a reset on TCP). What it sent before a
         * close is run all the same, as at TCP's end of input, which looks the same (an
         * operator's DEL, or a script piped in, sent just before the close takes effect); its
         * replies go nowhere. It leaves epoll (EPOLLHUP would be reported at every turn), its
         * last bytes are read as parsing goes on (conn_parse), and it is closed once what it
         * sent is answered. A reset, or a client paused for the budget, is closed at once. */
        conn_peer_eof(s, c);
        /* A unix peer that closed with replies unread in its socket is reported with EPOLLERR
         * too, and what it sent can still be read; on TCP, EPOLLERR is a reset. */
        if (((events & EPOLLERR) && !c->is_unix) || c->paused || s->draining ||
            c->close_after_write) {
            conn_close(s, c, "hangup");
            return;
        }
        epoll_ctl(s->epfd, EPOLL_CTL_DEL, c->fd, NULL);
        c->hung_up = 1;
        /* Reads change nothing: one not begun is withdrawn, and later ones are not made
         * (read_request), so that no one waits behind the reads of a client that left. */
        uint32_t seq;
        if (srv_reads_cancel(s, c, &seq)) {
            resp_error(srv_reply_buf(c, seq), "ERR the client left");
            srv_reply_done(s, c, seq);
        }
        conn_write(s, c);                 /* what it was owed goes nowhere */
        if (c->fd >= 0) conn_parse(s, c); /* closes it at its end once it is answered */
        return;
    }
    if (events & EPOLLRDHUP) /* before its last bytes are read: a WAIT claim there must not park */
        conn_peer_eof(s, c);
    if ((events & EPOLLIN) && !c->paused && !s->draining && !c->close_after_write && !c->in_ended) {
        budget_check(s, c);
        if (c->fd >= 0 && !c->paused && conn_read(s, c) == 0) {
            conn_parse(s, c);
            big_release(s, c);
        }
    } else if (events & EPOLLRDHUP) {
        /* Not read now (QUIT, paused, held back): its end is seen all the same (above), and
         * what it sent before the end is read once it may be. */
        conn_update_events(s, c);
    }
    if (c->fd >= 0 && (events & EPOLLOUT)) {
        conn_write(s, c);
        /* It read replies: one held back for its output (its allowance, before AUTH) goes on
         * now, not at the next housekeeping pass. */
        if (c->fd >= 0 && c->deferred && !s->draining) conn_parse(s, c);
    }
}

static int on_event(srv *s, struct epoll_event *e)
{
    uint64_t tag = e->data.u64;
    if (tag >= SRV_TAG_METRICS_CONN) {
        metrics_event(s, (uint32_t)(tag - SRV_TAG_METRICS_CONN), e->events);
    } else if (tag >= TAG_CONN) {
        on_conn_event(s, (uint32_t)(tag - TAG_CONN), e->events);
    } else if (tag == TAG_UNIX || tag == TAG_TCP) {
        if (!s->draining) accept_all(s, tag == TAG_UNIX ? s->unix_fd : s->tcp_fd, tag == TAG_UNIX);
    } else if (tag == TAG_METRICS) {
        if (s->metrics_fd >= 0) metrics_accept(s);
    } else if (tag == TAG_SIG) {
        on_signal(s);
    } else if (tag == TAG_LOAD) {
        uint64_t v;
        ssize_t r = read(s->load_fd, &v, sizeof v);
        (void)r;
        if (load_finish(s) < 0) return -1;
    } else if (tag == TAG_BACKUP) {
        srv_backup_done(s);
    } else if (tag == TAG_READS) {
        srv_reads_done(s);
    } else if (tag == TAG_QUEUE) {
        s->queue_signalled = 1;
    }
    return 0;
}

static int loop_turn(srv *s, int64_t *last_house)
{
    struct epoll_event evs[EVENTS_MAX];
    int timeout = s->ndirty || s->queue_signalled            ? 0
                  : s->draining || s->nops || s->big_waiting ? 10
                                                             : 250;
    int n = epoll_wait(s->epfd, evs, EVENTS_MAX, timeout);
    if (n < 0 && errno != EINTR) {
        srv_log("error", "epoll_wait", "errno=%d", errno);
        return -1;
    }
    clock_tick(s);
    /* Ends first: a client gone in this turn has its WAIT claims cancelled before any request of
     * the turn sends the batch early (a read, DBSIZE, AUTH, ...), whose release by another
     * client would grant it the key (cancel_waits). */
    for (int i = 0; i < n; i++) {
        uint64_t tag = evs[i].data.u64;
        if (tag >= TAG_CONN && tag < SRV_TAG_METRICS_CONN &&
            (evs[i].events & (EPOLLHUP | EPOLLERR | EPOLLRDHUP))) {
            srv_conn *c = s->conns[tag - TAG_CONN];
            if (c && c->fd >= 0) conn_peer_eof(s, c);
        }
    }
    for (int i = 0; i < n; i++)
        if (on_event(s, &evs[i]) < 0) return -1;
    submit_batch(s);
    clock_tick(s);
    poll_completions(s);
    write_dirty(s);
    if (s->nheld && engine_room(s)) retry_held(s);
    submit_batch(s);
    reap_dead(s);
    int64_t now = srv_now_ms();
    if (now - *last_house >= 100 || over_budget(s) || s->big_waiting) {
        *last_house = now;
        housekeeping(s, now);
        submit_batch(s);
    }
    return 0;
}

static int setup_fds(srv *s)
{
    sigset_t set;
    sigemptyset(&set);
    sigaddset(&set, SIGTERM);
    sigaddset(&set, SIGINT);
    sigprocmask(SIG_BLOCK, &set, NULL);
    signal(SIGPIPE, SIG_IGN);
    s->epfd = epoll_create1(EPOLL_CLOEXEC);
    s->sig_fd = signalfd(-1, &set, SFD_NONBLOCK | SFD_CLOEXEC);
    s->load_fd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    s->backup_fd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    s->reads_fd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    if (s->epfd < 0 || s->sig_fd < 0 || s->load_fd < 0 || s->backup_fd < 0 || s->reads_fd < 0) {
        srv_log("error", "start_failed", "what=event_fds error=\"%s\"", strerror(errno));
        return -1;
    }
    s->spare_fd = open("/dev/null", O_RDONLY | O_CLOEXEC);
    if (ep_add(s, s->sig_fd, TAG_SIG, EPOLLIN, "signals") != 0 ||
        ep_add(s, s->load_fd, TAG_LOAD, EPOLLIN, "load") != 0 ||
        ep_add(s, s->backup_fd, TAG_BACKUP, EPOLLIN, "backup") != 0 ||
        ep_add(s, s->reads_fd, TAG_READS, EPOLLIN, "reads") != 0)
        return -1;
    s->conns_cap = s->cfg.max_clients + s->cfg.max_clients / 4 + 16;
    s->conns = calloc(s->conns_cap, sizeof *s->conns);
    s->conns_free = malloc(s->conns_cap * sizeof *s->conns_free);
    for (uint32_t i = 0; s->conns_free && i < s->conns_cap; i++)
        s->conns_free[i] = s->conns_cap - 1 - i; /* the lowest on top */
    s->nconns_free = s->conns_free ? s->conns_cap : 0;
    s->dirty = calloc(2 * (size_t)s->conns_cap, sizeof *s->dirty); /* see write_dirty */
    s->held = calloc(s->conns_cap, sizeof *s->held);
    s->dead = calloc(s->conns_cap, sizeof *s->dead);
    s->ops = calloc(IDEM_BATCH_MAX, sizeof *s->ops);
    s->comps = calloc(COMPLETIONS_MAX, sizeof *s->comps);
    s->unheard = calloc(COMPLETIONS_MAX, sizeof *s->unheard);
    int ok = s->conns && s->conns_free && s->dirty && s->held && s->dead && s->ops && s->comps &&
             s->unheard;
    if (!ok)
        srv_log("error", "start_failed", "what=connection_table max_clients=%u error=\"%s\"",
                s->cfg.max_clients, strerror(ENOMEM));
    return ok ? 0 : -1;
}

static int finish(srv *s, int rc)
{
    stop_listening(s);
    metrics_close_all(s);
    for (uint32_t i = 0; s->conns && i < s->conns_cap; i++)
        if (s->conns[i] && s->conns[i]->fd >= 0) conn_close(s, s->conns[i], "shutdown");
    srv_reads_stop(s); /* before the store closes: it reads the store */
    if (s->q) idem_queue_close(s->q);
    if (s->load_started) { /* stopped while loading: the store it opened is closed below */
        pthread_join(s->load_thread, NULL);
        s->store = s->loaded;
    }
    if (s->backup_running) { /* the store must outlive it; its client is gone, the log tells */
        srv_log("info", "shutdown_waits_for_backup", "dest=\"%s\"", s->backup_dest);
        srv_backup_join(s);
    }
    for (uint32_t i = 0; s->conns && i < s->conns_cap; i++)
        if (s->conns[i]) conn_free(s, s->conns[i]);
    free(s->conns);
    free(s->conns_free);
    free(s->dirty);
    free(s->held);
    free(s->dead);
    free(s->ops);
    free(s->comps);
    free(s->unheard);
    s->conns = NULL;
    int fds[] = {s->epfd, s->sig_fd, s->load_fd, s->backup_fd, s->reads_fd, s->spare_fd};
    for (size_t i = 0; i < sizeof fds / sizeof fds[0]; i++)
        if (fds[i] >= 0) close(fds[i]);
    if (s->store) {
        int err = idem_close(s->store);
        if (err == IDEM_EFULL || err == IDEM_ENOMEM) {
            /* Only the closing checkpoint found no space, or no descriptor or memory: every
             * change is durable in the log, which the next open replays. */
            srv_log("warn", "checkpoint_skipped",
                    "reason=\"%s for the closing checkpoint: the next open replays the log\"",
                    err == IDEM_EFULL ? "no space" : "out of descriptors or memory");
        } else if (err != IDEM_OK) {
            srv_log("error", "close_failed", "err=\"%s\"", idem_strerror(err));
            rc = 1;
        }
    }
    srv_log("info", "exit", "code=%d", rc);
    return rc;
}

int64_t srv_test_ms(const srv *s, const char *name, int64_t dflt)
{
    const char *v = getenv(name);
    if (!s->cfg.test_clock || !v) return dflt;
    unsigned long ms = strtoul(v, NULL, 10);
    return ms < 60000 ? (int64_t)ms : 60000;
}

int srv_run(srv *s)
{
    s->unix_fd = s->tcp_fd = s->metrics_fd = -1;
    for (uint32_t i = 0; i < SRV_METRICS_CONNS; i++)
        s->mconns[i].fd = -1;
    s->epfd = s->sig_fd = s->load_fd = s->backup_fd = s->reads_fd = s->spare_fd = -1;
    s->started_ms = srv_now_ms();
    s->unauth_ms = srv_test_ms(s, "IDEM_TEST_AUTH_WITHIN_MS", SRV_UNAUTH_MS);
    s->drain_answer_ms = srv_test_ms(s, "IDEM_TEST_DRAIN_ANSWER_MS", DRAIN_ANSWER_MS);
    s->test_refuse_key = s->cfg.test_clock ? getenv("IDEM_TEST_SUBMIT_REFUSE") : NULL;
    clock_tick(s);
    if (setup_fds(s) < 0 || listen_all(s) < 0) return finish(s, 1);
    s->loading = 1;
    int err = pthread_create(&s->load_thread, NULL, load_main, s);
    if (err != 0) {
        srv_log("error", "start_failed", "what=load_thread error=\"%s\"", strerror(err));
        return finish(s, 1);
    }
    s->load_started = 1;
    int64_t last_house = srv_now_ms();
    for (;;) {
        if (loop_turn(s, &last_house) < 0) return finish(s, 1);
        if (s->fatal || (s->store && !s->loading && idem_is_fatal(s->store)))
            return finish(s, shutdown_fatal(s));
        if (s->draining && !s->loading && drain_step(s)) return finish(s, 0);
        if (s->draining && s->loading)
            continue; /* recovery finishes first, then the store closes cleanly */
    }
}
