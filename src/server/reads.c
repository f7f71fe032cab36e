/*
 * reads.c: IDEM.SCAN, IDEM.AUDIT and IDEM.ATTENTION off the event loop. Each is a blocking read
 * of the store (a query of the audit trail reads stretches of audit.log, a scan or the attention
 * list up to 100,000 records); made on the loop, it left every other client unanswered meanwhile.
 * A thread of its own makes them, one at a time in arrival order, with a queue of its own
 * (q_reads), each reply into its read's buffer; the loop, told through reads_fd, copies the reply
 * into the request's place.
 *
 * Invariants:
 *   - A connection has at most one read out (read_due): nothing after it is parsed until it is
 *     answered, so the read sees exactly the requests before it, as if made on the loop (the
 *     batch was submitted before it was handed over, srv_flush_ops).
 *   - While a read is out its connection is held open like one the engine owes a completion
 *     (engine_due): its struct lives until the read comes back, even if its socket is closed.
 *     A connection that closes withdraws its read if the thread has not begun it
 *     (srv_reads_cancel): reads of clients that are gone make no one else wait. Each read
 *     withdrawn, or not handed over because its client had left (read_request), counts in
 *     reads_withdrawn (IDEM.STATS).
 *     Reads hold no slot of the engine's queue q: engine_room leaves reads_out out.
 *   - The thread touches only the reads on reads_todo and reads_done (under reads_mu), the read
 *     it is making, q_reads and the store; everything else is the loop's.
 *   - Every read goes to the thread, however many are out: one a connection at most, so they
 *     are bounded by max-clients, and a waiting read holds only its arguments (its reply
 *     buffer is made when its turn comes). Made on the loop past 64 out, as they were, 65
 *     connections with a slow query each stalled everyone. Memory: one reply at a time is being
 *     made; at most SRV_READS_KEEP reads that came back are kept for reuse (reads_free).
 *   - A read whose reply, at its largest, would not fit what the client's earlier replies, unread
 *     or owed, leave of --client-output-max is parked on its connection (read_parked, still
 *     read_due) and handed over once the client has read enough of them (srv_reads_unpark, at
 *     each write): appended to them, its reply closed the connection (output_limit). A parked
 *     read holds no slot of the thread's line (reads_owed, reads_out) and no engine_due, and is
 *     owed SRV_REPLY_SMALL (its room is owed when it is handed over); a connection that closes
 *     or hangs up withdraws it as it would a read not begun. Nothing after it is parsed, and a
 *     client that reads nothing is timed as any slow reader, so it waits for that client alone.
 *   - Reads are never made on the loop: idemd does not start without this thread.
 * Tests only: with --test-clock, IDEM_TEST_READS_DELAY_MS makes every read wait that long first
 * (reads_test_delay), so that a test can show the loop answers others meanwhile, and
 * IDEM_TEST_READS_THREAD_FAIL makes the thread's start fail (EAGAIN).
 */
#include <errno.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "server.h"

/* Tests (IDEM_TEST_READS_DELAY_MS under --test-clock): waits that long before a read. */
static void reads_test_delay(const srv *s)
{
    if (s->reads_delay_ms) {
        struct timespec ts = {s->reads_delay_ms / 1000, (long)(s->reads_delay_ms % 1000) * 1000000};
        nanosleep(&ts, NULL);
    }
}

static void *reads_main(void *arg)
{
    srv *s = arg;
    pthread_mutex_lock(&s->reads_mu);
    for (;;) {
        while (!s->reads_todo && !s->reads_stop)
            pthread_cond_wait(&s->reads_cond, &s->reads_mu);
        if (s->reads_stop) break;
        srv_read *r = s->reads_todo;
        s->reads_todo = r->next;
        if (!s->reads_todo) s->reads_todo_tail = NULL;
        pthread_mutex_unlock(&s->reads_mu);
        reads_test_delay(s);
        srv_read_run(s->q_reads, &r->a, &r->reply);
        pthread_mutex_lock(&s->reads_mu);
        r->next = s->reads_done;
        s->reads_done = r;
        uint64_t one = 1;
        ssize_t w = write(s->reads_fd, &one, sizeof one);
        (void)w;
    }
    pthread_mutex_unlock(&s->reads_mu);
    return NULL;
}

int srv_reads_start(srv *s)
{
    if (idem_queue_open(s->store, 16, &s->q_reads) != IDEM_OK) return errno ? errno : ENOMEM;
    const char *delay = getenv("IDEM_TEST_READS_DELAY_MS");
    if (s->cfg.test_clock && delay) {
        unsigned long ms = strtoul(delay, NULL, 10);
        s->reads_delay_ms = ms < 60000 ? (uint32_t)ms : 60000;
    }
    if (s->cfg.test_clock && getenv("IDEM_TEST_READS_THREAD_FAIL")) return EAGAIN;
    int rc = pthread_mutex_init(&s->reads_mu, NULL);
    if (rc != 0) return rc;
    if ((rc = pthread_cond_init(&s->reads_cond, NULL)) != 0) {
        pthread_mutex_destroy(&s->reads_mu);
        return rc;
    }
    if ((rc = pthread_create(&s->reads_thread, NULL, reads_main, s)) != 0) {
        pthread_cond_destroy(&s->reads_cond);
        pthread_mutex_destroy(&s->reads_mu);
        return rc;
    }
    s->reads_started = 1;
    return 0;
}

/* A read that came back (or was withdrawn) is kept for reuse, SRV_READS_KEEP at most. */
static void read_recycle(srv *s, srv_read *r)
{
    if (s->reads_kept >= SRV_READS_KEEP) {
        resp_buf_free(&r->reply);
        free(r);
        return;
    }
    if (r->reply.cap > 65536) resp_buf_free(&r->reply);
    r->reply.len = 0;
    r->reply.overflow = r->reply.no_memory = 0;
    r->next = s->reads_free;
    s->reads_free = r;
    s->reads_kept++;
}

/* Hands r to the thread, its reply bounded by room. */
static void reads_enqueue(srv *s, srv_conn *c, srv_read *r, uint64_t room)
{
    r->reply.limit = room; /* empty: new, or emptied when it came back */
    r->room = room;
    s->reads_owed += room;
    r->next = NULL;
    s->reads_out++;
    c->engine_due++;
    s->engine_due++;
    pthread_mutex_lock(&s->reads_mu);
    if (s->reads_todo_tail)
        s->reads_todo_tail->next = r;
    else
        s->reads_todo = r;
    s->reads_todo_tail = r;
    pthread_cond_signal(&s->reads_cond);
    pthread_mutex_unlock(&s->reads_mu);
}

/* The room r's reply may have now (srv_reply_room, srv_reads_room), or 0 while the replies
 * before it leave it less of --client-output-max (srv_out_room). */
static uint64_t read_room_now(srv *s, srv_conn *c, const srv_read *r)
{
    uint64_t line = srv_reads_room(s);
    uint64_t room = srv_reply_room(s, r->want < line ? r->want : line);
    return room <= srv_out_room(s, c, r->seq) ? room : 0;
}

int srv_reads_submit(srv *s, srv_conn *c, uint32_t seq, const srv_read_args *a, uint64_t want)
{
    srv_read *r = s->reads_free;
    if (r) {
        s->reads_free = r->next;
        s->reads_kept--;
    } else {
        r = calloc(1, sizeof *r);
        if (!r) return -1;
    }
    r->conn = c->index;
    r->seq = seq;
    r->a = *a;
    r->want = want;
    c->read_due = 1;
    uint64_t room = read_room_now(s, c, r);
    if (room == 0) {
        /* Owed little while parked: reads parked on many connections would each owe their
         * largest reply outside the reads' share of the budget (srv_reads_room). */
        srv_reply_owe(s, c, seq, SRV_REPLY_SMALL);
        c->read_parked = r;
        return 0;
    }
    srv_reply_owe(s, c, seq, room);
    reads_enqueue(s, c, r, room);
    return 0;
}

/* Takes c's parked read off its connection, never handed over, and keeps it for reuse; returns
 * the seq of its reply. */
static uint32_t parked_drop(srv *s, srv_conn *c)
{
    srv_read *r = c->read_parked;
    uint32_t seq = r->seq;
    c->read_parked = NULL;
    c->read_due = 0;
    read_recycle(s, r);
    return seq;
}

void srv_reads_unpark(srv *s, srv_conn *c)
{
    srv_read *r = c->read_parked;
    if (!r || c->fd < 0) return;
    if (!srv_reply_pending(c, r->seq)) { /* answered already (a fatal store error) */
        parked_drop(s, c);
        return;
    }
    if (s->draining) { /* nothing new is begun; the client hears why */
        uint32_t seq = parked_drop(s, c);
        resp_error(srv_reply_buf(c, seq), "ERR server is shutting down");
        srv_reply_done(s, c, seq);
        return;
    }
    uint64_t room = read_room_now(s, c, r);
    if (room == 0) return;
    c->read_parked = NULL;
    srv_reply_owe(s, c, r->seq, room);
    reads_enqueue(s, c, r, room);
}

uint64_t srv_reads_room(const srv *s)
{
    uint64_t budget = s->cfg.io_budget_bytes;
    uint64_t cap = budget / SRV_READS_DIV, left = cap > s->reads_owed ? cap - s->reads_owed : 0;
    return left > SRV_OWED_TIGHT ? left : SRV_OWED_TIGHT;
}

void srv_reads_done(srv *s)
{
    uint64_t v;
    ssize_t n = read(s->reads_fd, &v, sizeof v);
    (void)n;
    pthread_mutex_lock(&s->reads_mu);
    srv_read *done = s->reads_done;
    s->reads_done = NULL;
    pthread_mutex_unlock(&s->reads_mu);
    while (done) {
        srv_read *r = done;
        done = r->next;
        srv_conn *c = s->conns[r->conn];
        c->read_due = 0;
        c->engine_due--;
        s->engine_due--;
        s->reads_out--;
        s->reads_owed -= r->room;
        if (!c->dead && srv_reply_pending(c, r->seq)) {
            resp_buf *b = srv_reply_buf(c, r->seq);
            if (r->reply.no_memory) {
                srv_log_gated(&s->log_oom, "warn", "out_of_memory",
                              "what=read_reply id=%llu peer=%s", (unsigned long long)c->id,
                              c->peer);
                resp_error(b, "ERR out of memory for the reply: try again");
            } else if (r->reply.overflow) { /* the request asked too much, whatever was read */
                resp_error(b, "ERR the reply would pass --client-output-max (or the memory left "
                              "under load): ask for fewer "
                              "(a lower COUNT)");
            } else {
                /* A failure stays in b (out's or the slot's), which srv_reply_done hands on in
                 * order: past the limit the connection is closed as too slow a reader; without
                 * memory the replies before this one are still written. */
                (void)resp_buf_append(b, r->reply.data, r->reply.len);
            }
            srv_reply_done(s, c, r->seq);
        }
        read_recycle(s, r);
    }
}

int srv_reads_cancel(srv *s, srv_conn *c, uint32_t *seq)
{
    if (c->read_parked) { /* never handed over */
        /* not pending if a fatal error answered it */
        int pending = srv_reply_pending(c, c->read_parked->seq);
        s->reads_withdrawn += (uint64_t)pending;
        *seq = parked_drop(s, c);
        return pending;
    }
    if (!c->read_due) return 0;
    srv_read *found = NULL;
    pthread_mutex_lock(&s->reads_mu);
    for (srv_read **pp = &s->reads_todo, *prev = NULL; *pp; prev = *pp, pp = &(*pp)->next) {
        if ((*pp)->conn == c->index) {
            found = *pp;
            *pp = found->next;
            if (s->reads_todo_tail == found) s->reads_todo_tail = prev;
            break;
        }
    }
    pthread_mutex_unlock(&s->reads_mu);
    if (!found) return 0; /* being made: it comes back, and its reply is dropped */
    c->read_due = 0;
    c->engine_due--;
    s->engine_due--;
    s->reads_out--;
    s->reads_owed -= found->room;
    s->reads_withdrawn++;
    *seq = found->seq;
    read_recycle(s, found);
    return 1;
}

static void reads_free_list(srv_read *r)
{
    while (r) {
        srv_read *next = r->next;
        resp_buf_free(&r->reply);
        free(r);
        r = next;
    }
}

void srv_reads_stop(srv *s)
{
    if (s->reads_started) {
        pthread_mutex_lock(&s->reads_mu);
        s->reads_stop = 1;
        pthread_cond_signal(&s->reads_cond);
        pthread_mutex_unlock(&s->reads_mu);
        pthread_join(s->reads_thread, NULL);
        s->reads_started = 0;
        reads_free_list(s->reads_todo);
        reads_free_list(s->reads_done);
        s->reads_todo = s->reads_todo_tail = s->reads_done = NULL;
        pthread_cond_destroy(&s->reads_cond);
        pthread_mutex_destroy(&s->reads_mu);
    }
    reads_free_list(s->reads_free);
    s->reads_free = NULL;
    s->reads_kept = 0;
    if (s->q_reads) idem_queue_close(s->q_reads);
    s->q_reads = NULL;
}
