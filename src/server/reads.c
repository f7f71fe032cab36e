/*
 * reads.c: IDEM.SCAN, IDEM.AUDIT and IDEM.ATTENTION off the event loop. Each is a blocking read
 * of the store (a query of the audit trail reads stretches of audit.log, a scan or the attention
 * list up to 100,000 records); made on the loop, it left every other client unanswered meanwhile.
 * A thread of its own makes them, one at a time in arrival order, with a queue of its own
 * (q_reads), each reply into its read's buffer; the loop, told through reads_fd, copies the reply
 * into the request's place.
 * The store's figures (IDEM.STATS, INFO's idem section, a metrics scrape: READ_STATS) are read
 * the same way on a second line with a thread of its own (READS_STATS): idem_get_stats may
 * filter the age heaps first (34-37 ms after a burst of 262,144 claims, docs/benchmarks.md),
 * and behind a slow query a scrape would wait for it. The loop makes their reply from the
 * figures when they come back, with the server's own counters, which are the loop's; one
 * reading serves every reading waiting on the line, and in sync mode the thread waits
 * (IDEM_OP_SYNC) until every change they count is durable, as DBSIZE does. A
 * metrics connection's reading (metrics_id) holds no reply room and no connection: it comes
 * back to metrics_answer, which drops it if that connection has gone meanwhile.
 *
 * Invariants:
 *   - A connection has at most one read out (read_due): nothing after it is parsed until it is
 *     answered, so the read sees exactly the requests before it, as if made on the loop (the
 *     batch was submitted before it was handed over, srv_flush_ops).
 *   - While a read is out its connection is held open like one the engine owes a completion
 *     (engine_due): its struct lives until the read comes back, even if its socket is closed.
 *     A connection that closes withdraws its read if the thread has not begun it
 *     (srv_reads_cancel, srv_reads_cancel_metrics): reads of clients that are gone make no one
 *     else wait. Each read withdrawn, or not handed over because its client had left
 *     (read_request), counts in reads_withdrawn (IDEM.STATS).
 *     Reads hold no slot of the engine's queue q: engine_room leaves reads_out out.
 *   - A thread touches only the reads on its line's reads_todo and on reads_done (under
 *     reads_mu), the read it is making (the queries': q_reads) and the store; everything else
 *     is the loop's.
 *   - Every read goes to its thread, however many are out: one a connection at most, so they
 *     are bounded by max-clients (and a reading a metrics connection, SRV_METRICS_CONNS, one
 *     withdrawn as its connection closes), and a waiting read holds only its arguments (its reply
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
 *   - Reads are never made on the loop: idemd does not start without these threads.
 * Tests only: with --test-clock, IDEM_TEST_READS_DELAY_MS makes every query wait that long first
 * and IDEM_TEST_STATS_DELAY_MS every reading of the figures (test_delay), so that a test can
 * show the loop answers others meanwhile, and IDEM_TEST_READS_THREAD_FAIL makes the threads'
 * start fail (EAGAIN).
 */
#include <errno.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "server.h"

/* Tests (IDEM_TEST_READS_DELAY_MS, IDEM_TEST_STATS_DELAY_MS under --test-clock): waits ms
 * before a read or a reading; 0 does not wait. */
static void test_delay(uint32_t ms)
{
    if (ms) {
        struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000};
        nanosleep(&ts, NULL);
    }
}

struct line_arg {
    srv *s;
    int line;
};

/* The stats line's turn: one reading of the figures serves every reading waiting on the line
 * (each was handed over after the requests before it were submitted, so the figures read now
 * count them all), and in sync mode they are answered once every change they count is durable
 * (rule 8), as DBSIZE is: one IDEM_OP_SYNC submitted after the reading, which waits for the
 * log's flush alone (idem_sync waits for any flusher I/O under way as well). N scrapes waiting
 * cost one reading and one flush, not N of each one after the other. A store failing meanwhile
 * makes them unsure, and fatal. */
static void stats_read(srv *s, srv_read *batch)
{
    test_delay(s->stats_delay_ms);
    idem_stats st;
    idem_get_stats(s->store, &st);
    int unsure = 0;
    if (s->cfg.durability == IDEM_DURABILITY_SYNC) {
        idem_op op = {.kind = IDEM_OP_SYNC};
        idem_completion c;
        unsure = idem_exec(s->q_stats, &op, &c) != IDEM_OK || c.err != IDEM_OK;
        if (unsure) st.fatal = 1;
    }
    for (srv_read *r = batch; r; r = r->next) {
        r->engine = st;
        r->unsure = unsure;
    }
}

static void *reads_main(void *arg)
{
    srv *s = ((struct line_arg *)arg)->s;
    int line = ((struct line_arg *)arg)->line;
    free(arg);
    pthread_mutex_lock(&s->reads_mu);
    for (;;) {
        while (!s->reads_todo[line] && !s->reads_stop)
            pthread_cond_wait(&s->reads_cond[line], &s->reads_mu);
        if (s->reads_stop) break;
        /* The queries one at a time; the figures' readings all at once (stats_read). */
        srv_read *first = s->reads_todo[line], *last = first;
        if (line == READS_STATS) last = s->reads_todo_tail[line];
        s->reads_todo[line] = last->next;
        if (!s->reads_todo[line]) s->reads_todo_tail[line] = NULL;
        last->next = NULL;
        pthread_mutex_unlock(&s->reads_mu);
        if (line == READS_STATS) {
            stats_read(s, first);
        } else {
            test_delay(s->reads_delay_ms);
            srv_read_run(s->q_reads, &first->a, &first->reply);
        }
        pthread_mutex_lock(&s->reads_mu);
        last->next = s->reads_done;
        s->reads_done = first;
        uint64_t one = 1;
        ssize_t w = write(s->reads_fd, &one, sizeof one);
        (void)w;
    }
    pthread_mutex_unlock(&s->reads_mu);
    return NULL;
}

static int line_start(srv *s, int line)
{
    int rc = pthread_cond_init(&s->reads_cond[line], NULL);
    if (rc != 0) return rc;
    struct line_arg *arg = malloc(sizeof *arg);
    if (!arg) rc = ENOMEM;
    if (arg) *arg = (struct line_arg){s, line};
    if (arg && (rc = pthread_create(&s->reads_thread[line], NULL, reads_main, arg)) != 0) free(arg);
    if (rc != 0) {
        pthread_cond_destroy(&s->reads_cond[line]);
        return rc;
    }
    s->reads_started++;
    return 0;
}

int srv_reads_start(srv *s)
{
    if (idem_queue_open(s->store, 16, &s->q_reads) != IDEM_OK ||
        idem_queue_open(s->store, 1, &s->q_stats) != IDEM_OK)
        return errno ? errno : ENOMEM;
    s->reads_delay_ms = (uint32_t)srv_test_ms(s, "IDEM_TEST_READS_DELAY_MS", 0);
    s->stats_delay_ms = (uint32_t)srv_test_ms(s, "IDEM_TEST_STATS_DELAY_MS", 0);
    if (s->cfg.test_clock && getenv("IDEM_TEST_READS_THREAD_FAIL")) return EAGAIN;
    int rc = pthread_mutex_init(&s->reads_mu, NULL);
    if (rc != 0) return rc;
    s->reads_mu_made = 1;
    for (int line = 0; line < READS_LINES; line++)
        if ((rc = line_start(s, line)) != 0) return rc; /* srv_reads_stop stops those begun */
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

static int line_of(const srv_read *r)
{
    return r->a.kind == READ_STATS ? READS_STATS : READS_QUERIES;
}

/* Puts r at the end of its line, and wakes its thread. */
static void line_append(srv *s, srv_read *r)
{
    int line = line_of(r);
    r->next = NULL;
    pthread_mutex_lock(&s->reads_mu);
    if (s->reads_todo_tail[line])
        s->reads_todo_tail[line]->next = r;
    else
        s->reads_todo[line] = r;
    s->reads_todo_tail[line] = r;
    pthread_cond_signal(&s->reads_cond[line]);
    pthread_mutex_unlock(&s->reads_mu);
}

/* Hands r to its thread, its reply bounded by room. */
static void reads_enqueue(srv *s, srv_conn *c, srv_read *r, uint64_t room)
{
    r->reply.limit = room; /* empty: new, or emptied when it came back */
    r->room = room;
    s->reads_owed += room;
    s->reads_out++;
    c->engine_due++;
    s->engine_due++;
    line_append(s, r);
}

/* A read kept for reuse, or a new one; NULL without memory. */
static srv_read *read_take(srv *s)
{
    srv_read *r = s->reads_free;
    if (!r) return calloc(1, sizeof *r);
    s->reads_free = r->next;
    s->reads_kept--;
    r->metrics_id = 0;
    r->unsure = 0;
    return r;
}

int srv_reads_submit_metrics(srv *s, uint32_t index)
{
    srv_read *r = read_take(s);
    if (!r) return -1;
    r->conn = index;
    r->metrics_id = s->mconns[index].id;
    r->a = (srv_read_args){.kind = READ_STATS};
    r->room = 0; /* its text is the metrics connection's own (metrics_answer) */
    line_append(s, r);
    return 0;
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
    srv_read *r = read_take(s);
    if (!r) return -1;
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

/* r's reply (made by its thread, or from its figures) into b, or the error that says why it
 * could not be made. */
static void read_reply_give(srv *s, srv_conn *c, srv_read *r, resp_buf *b)
{
    if (r->reply.no_memory) {
        srv_log_gated(&s->log_oom, "warn", "out_of_memory", "what=read_reply id=%llu peer=%s",
                      (unsigned long long)c->id, c->peer);
        resp_error(b, "ERR out of memory for the reply: try again");
    } else if (r->reply.overflow) { /* the request asked too much, whatever was read */
        resp_error(b, "ERR the reply would pass --client-output-max (or the memory left under "
                      "load): ask for fewer (a lower COUNT)");
    } else {
        /* A failure stays in b (out's or the slot's), which srv_reply_done hands on in order:
         * past the limit the connection is closed as too slow a reader; without memory the
         * replies before this one are still written. */
        (void)resp_buf_append(b, r->reply.data, r->reply.len);
    }
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
        if (r->metrics_id) {
            metrics_answer(s, r->conn, r->metrics_id, &r->engine);
            read_recycle(s, r);
            continue;
        }
        srv_conn *c = s->conns[r->conn];
        c->read_due = 0;
        c->engine_due--;
        s->engine_due--;
        s->reads_out--;
        s->reads_owed -= r->room;
        if (!c->dead && srv_reply_pending(c, r->seq)) {
            resp_buf *b = srv_reply_buf(c, r->seq);
            if (r->unsure) {
                resp_error(b, "ERR fatal store error: the figures count changes that are not "
                              "durable");
            } else {
                if (r->a.kind == READ_STATS) cmd_stats_reply(s, &r->a, &r->engine, &r->reply);
                read_reply_give(s, c, r, b);
            }
            srv_reply_done(s, c, r->seq);
        }
        read_recycle(s, r);
    }
}

/* Takes the read of connection conn (metrics_id: of that metrics connection; 0, a client's) off
 * its line if its thread has not begun it. Returns it, or NULL. */
static srv_read *todo_withdraw(srv *s, uint32_t conn, uint64_t metrics_id)
{
    srv_read *found = NULL;
    if (!s->reads_mu_made) return NULL; /* nothing was handed over */
    pthread_mutex_lock(&s->reads_mu);
    for (int line = 0; line < READS_LINES && !found; line++) {
        for (srv_read **pp = &s->reads_todo[line], *prev = NULL; *pp;
             prev = *pp, pp = &(*pp)->next) {
            if ((*pp)->conn == conn && (*pp)->metrics_id == metrics_id) {
                found = *pp;
                *pp = found->next;
                if (s->reads_todo_tail[line] == found) s->reads_todo_tail[line] = prev;
                break;
            }
        }
    }
    pthread_mutex_unlock(&s->reads_mu);
    return found;
}

void srv_reads_cancel_metrics(srv *s, uint32_t index)
{
    srv_read *r = todo_withdraw(s, index, s->mconns[index].id);
    if (!r) return;
    s->reads_withdrawn++;
    read_recycle(s, r);
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
    srv_read *found = todo_withdraw(s, c->index, 0);
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
    if (s->reads_mu_made) {
        pthread_mutex_lock(&s->reads_mu);
        s->reads_stop = 1;
        for (int line = 0; line < s->reads_started; line++)
            pthread_cond_signal(&s->reads_cond[line]);
        pthread_mutex_unlock(&s->reads_mu);
        for (int line = 0; line < s->reads_started; line++) {
            pthread_join(s->reads_thread[line], NULL);
            pthread_cond_destroy(&s->reads_cond[line]);
            reads_free_list(s->reads_todo[line]);
            s->reads_todo[line] = s->reads_todo_tail[line] = NULL;
        }
        s->reads_started = 0;
        reads_free_list(s->reads_done);
        s->reads_done = NULL;
        pthread_mutex_destroy(&s->reads_mu);
        s->reads_mu_made = 0;
    }
    reads_free_list(s->reads_free);
    s->reads_free = NULL;
    s->reads_kept = 0;
    if (s->q_reads) idem_queue_close(s->q_reads);
    if (s->q_stats) idem_queue_close(s->q_stats);
    s->q_reads = s->q_stats = NULL;
}
