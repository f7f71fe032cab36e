/*
 * metrics.c: the Prometheus text endpoint (--metrics-listen ADDR:PORT). Scrapes are served on
 * the loop thread without blocking it: each connection (SRV_METRICS_CONNS at once) sits in the
 * loop's epoll set; its request head is read to its blank line and ignored (any path answers),
 * or answered anyway once SRV_METRICS_WAIT_MS pass or SRV_METRICS_ASK_MAX bytes come without
 * one; the store's figures are read on the stats line (reads.c: the call may filter the age
 * heaps first), the exposition is made from them on the loop and written as the socket takes
 * it, then the write side is shut and what the peer still sends is read until it closes (a close
 * with unread bytes would reset the connection and could drop the reply's end). One that is still
 * open after SRV_METRICS_MAX_MS is closed. With every slot taken, a new connection takes the
 * slot of the oldest one not answering (silent, even while answered for it, or done):
 * connections that send nothing cannot keep scrapes out. While its figures are read a connection is
 * watched for errors alone: one reset then withdraws its reading; one closed is seen once its reply
 * is written. Counters end in _total; the flush latency (the engine's) and the claim latency (the
 * server's) are histograms over the same power-of-two buckets. Nothing here scans keys.
 */
#include "cmd.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/socket.h>
#include <unistd.h>

/* Each figure's type and help line. A figure not listed is a gauge with a help line naming it
 * (test_server checks that every figure is listed). */
static const struct metric_info {
    const char *name;
    int counter;
    const char *help;
} metric_infos[] = {
    {"keys", 0, "Records in the store (expired ones included until compaction removes them)."},
    {"keys_in_flight", 0, "Records claimed and not yet committed or released."},
    {"keys_committed", 0, "Records committed (expired ones included until compaction)."},
    {"keys_review", 0, "Records held for review: they need a person or a reconciler."},
    {"claims_new", 1, "Claims answered new (the caller acts)."},
    {"claims_busy", 1, "Claims answered busy (another holder's lease runs)."},
    {"claims_done", 1, "Claims answered done (a duplicate of a committed record)."},
    {"claims_mismatch", 1, "Claims answered mismatch (the same key with different content)."},
    {"claims_recover", 1, "Claims answered recover (a lease had run out)."},
    {"claims_review", 1, "Claims answered review (the record is held for review)."},
    {"mismatches", 1, "Mismatches recorded on records."},
    {"recoveries", 1, "Records taken over after their lease ran out."},
    {"conflicting_commits", 1,
     "Commits repeated by the holder with a different result (-CONFLICT): the sender may have "
     "handed out two references for one key."},
    {"index_refusals", 1,
     "New keys answered FULL because the index could not grow (no memory, or keys sharing their "
     "hash bits), every limit unreached."},
    {"expired_total", 1, "Expired records removed by compaction or replaced by a new claim."},
    {"oldest_in_flight_ms", 0, "First-seen store time of the oldest in_flight record (0: none)."},
    {"oldest_review_ms", 0, "First-seen store time of the oldest review record (0: none)."},
    {"oldest_in_flight_age_ms", 0, "Age of the oldest in_flight record in ms (0: none)."},
    {"oldest_review_age_ms", 0, "Age of the oldest review record in ms (0: none)."},
    {"wal_bytes", 0, "Bytes of the log's segment files."},
    {"disk_bytes", 0, "Bytes of the store's files, as --max-disk counts them."},
    {"disk_free_bytes", 0, "Free bytes of the store's file system (0: unknown)."},
    {"disk_reserve_bytes", 0,
     "Bytes the store keeps in its reserve file for compaction and checkpoints on a full disk "
     "(held unless let go or short of room; 0: none is kept)."},
    {"disk_reserve_released", 0,
     "1 while the reserve is let go at the end of a full disk: new keys answer FULL until it and "
     "a segment more are free."},
    {"memory_bytes", 0, "Anonymous memory of the store: index, counters, age heaps, buffers."},
    {"index_bytes", 0, "Bytes of the index's blocks in use, as --max-memory counts them."},
    {"max_keys", 0, "The --max-keys limit (0: none)."},
    {"max_memory_bytes", 0, "The --max-memory limit (0: none)."},
    {"max_disk_bytes", 0, "The --max-disk limit (0: none)."},
    {"flushes", 1, "Group commits written (batches of the log)."},
    {"flush_records", 1, "Records written by group commits."},
    {"keys_with_mismatch", 0, "Records with at least one recorded mismatch."},
    {"claims_last_minute", 0, "Claims in the last minute."},
    {"duplicates_last_minute", 0, "Claims answered from an existing record in the last minute."},
    {"store_generation", 0,
     "The store's generation: 1 when made, one more at each restore and import."},
    {"clock_skew_ms", 0, "Store clock minus wall clock in ms (positive: the store runs ahead)."},
    {"store_clock_ms", 0, "The store clock in ms since the epoch."},
    {"checkpoints", 1, "Checkpoints installed."},
    {"compactions", 1, "Log segments retired by compaction."},
    {"fatal", 0, "1 once a write or flush failed and the store stopped."},
    {"loading", 0, "1 while recovery runs."},
    {"connected_clients", 0, "Client connections open."},
    {"total_connections", 1, "Client connections accepted."},
    {"total_commands", 1, "Commands run."},
    {"rejected_connections", 1, "Connections refused at --max-clients or for want of memory."},
    {"clients_closed_input_stalled", 1, "Clients closed by the I/O budget for input not read."},
    {"clients_closed_output_stalled", 1, "Clients closed by the I/O budget for replies not read."},
    {"reads_withdrawn", 1, "Queries, figures and scrapes not made: their client left."},
    {"claims_released_unheard", 1, "WAIT claims answered new after their client left: released."},
    {"auth_failures", 1,
     "AUTH, or HELLO's AUTH, refused for a wrong name or password (password guessing)."},
    {"metrics_refused", 1,
     "Metrics scrapes closed unanswered: every slot answering, or a newer one took theirs."},
    {"io_buffer_bytes", 0, "Bytes of client buffers, as --io-budget bounds them."},
    {"flush_latency_us", 0, "Group commit latency in microseconds (write and flush)."},
    {"claim_latency_us", 0, "IDEM.CLAIM latency in microseconds, parse to reply (WAIT left out)."},
};

static const struct metric_info *metric_info(const char *name)
{
    for (size_t i = 0; i < sizeof metric_infos / sizeof metric_infos[0]; i++)
        if (strcmp(name, metric_infos[i].name) == 0) return &metric_infos[i];
    return NULL;
}

/* The "# HELP" and "# TYPE" lines of idem_<name><suffix>. */
static void render_head(resp_buf *b, const char *name, const char *suffix, const char *type)
{
    const struct metric_info *mi = metric_info(name);
    if (mi)
        resp_buf_printf(b, "# HELP idem_%s%s %s\n", name, suffix, mi->help);
    else
        resp_buf_printf(b, "# HELP idem_%s%s idem's %s.\n", name, suffix, name);
    resp_buf_printf(b, "# TYPE idem_%s%s %s\n", name, suffix, type);
}

/* Renders idem_<name> as a histogram: bucket i counts values up to 2^(i+4), the last the rest
 * (SRV_LAT_BUCKETS of them); Prometheus wants the buckets cumulative. */
static void render_histogram(resp_buf *b, const char *name, const uint64_t *buckets, uint64_t sum,
                             uint64_t count)
{
    uint64_t cum = 0;
    render_head(b, name, "", "histogram");
    for (int i = 0; i < SRV_LAT_BUCKETS; i++) {
        cum += buckets[i];
        if (i < SRV_LAT_BUCKETS - 1)
            resp_buf_printf(b, "idem_%s_bucket{le=\"%llu\"} %llu\n", name, 1ull << (i + 4),
                            (unsigned long long)cum);
        else
            resp_buf_printf(b, "idem_%s_bucket{le=\"+Inf\"} %llu\n", name, (unsigned long long)cum);
    }
    resp_buf_printf(b, "idem_%s_sum %llu\nidem_%s_count %llu\n", name, (unsigned long long)sum,
                    name, (unsigned long long)count);
}

static void render_histograms(const srv *s, const idem_stats *st, resp_buf *b)
{
    _Static_assert(sizeof st->flush_latency_us_buckets / sizeof st->flush_latency_us_buckets[0] ==
                       SRV_LAT_BUCKETS,
                   "the flush and claim histograms share their buckets");
    render_histogram(b, "flush_latency_us", st->flush_latency_us_buckets, st->flush_latency_us_sum,
                     st->flushes);
    render_histogram(b, "claim_latency_us", s->claim_latency_us_buckets, s->claim_latency_us_sum,
                     s->claim_latencies);
}

/* The exposition of engine, the store's figures (one reading for the whole scrape), and the
 * server's; NULL while the store loads. */
static void metrics_render(const srv *s, const idem_stats *engine, resp_buf *b)
{
    if (!engine) {
        render_head(b, "loading", "", "gauge");
        resp_buf_append(b, "idem_loading 1\n", 15);
        return;
    }
    cmd_stat st[CMD_STATS_MAX];
    int n = cmd_stats_list(s, engine, st);
    for (int i = 0; i < n; i++) {
        if (strncmp(st[i].name, "flush_latency_us_", 17) == 0 ||
            strncmp(st[i].name, "claim_latency_us_", 17) == 0)
            continue; /* rendered as histograms below (their _sum and _count too) */
        const struct metric_info *mi = metric_info(st[i].name);
        int counter = mi && mi->counter;
        const char *suffix = counter && !strstr(st[i].name, "_total") ? "_total" : "";
        render_head(b, st[i].name, suffix, counter ? "counter" : "gauge");
        resp_buf_printf(b, "idem_%s%s %lld\n", st[i].name, suffix, (long long)st[i].value);
    }
    render_histograms(s, engine, b);
}

/* ---- scrape connections: non-blocking, in the loop's epoll set ---- */

static void mconn_close(srv *s, srv_metrics_conn *m)
{
    if (m->answering == MCONN_READING) srv_reads_cancel_metrics(s, (uint32_t)(m - s->mconns));
    epoll_ctl(s->epfd, EPOLL_CTL_DEL, m->fd, NULL);
    close(m->fd);
    m->fd = -1;
    resp_buf_free(&m->out);
}

/* The whole answer is out: shuts the write side and waits for the peer's close
 * (MCONN_DRAINING), so that request bytes left unread do not turn the close into a reset that
 * loses the answer. Closes m on an error. */
static void mconn_answered(srv *s, srv_metrics_conn *m, uint32_t index)
{
    struct epoll_event e = {.events = EPOLLIN | EPOLLRDHUP,
                            .data.u64 = SRV_TAG_METRICS_CONN + index};
    if (shutdown(m->fd, SHUT_WR) != 0 || epoll_ctl(s->epfd, EPOLL_CTL_MOD, m->fd, &e) != 0) {
        mconn_close(s, m);
        return;
    }
    m->answering = MCONN_DRAINING;
}

/* Writes what the socket takes; once the whole reply is out, mconn_answered. Closes m on an
 * error. */
static void mconn_write(srv *s, srv_metrics_conn *m, uint32_t index)
{
    while (m->off < m->out.len) {
        ssize_t w =
            send(m->fd, m->out.data + m->off, m->out.len - m->off, MSG_NOSIGNAL | MSG_DONTWAIT);
        if (w > 0) {
            m->off += (size_t)w;
        } else if (w < 0 && (errno == EAGAIN || errno == EINTR)) {
            return; /* EPOLLOUT brings the rest */
        } else {
            mconn_close(s, m);
            return;
        }
    }
    resp_buf_free(&m->out);
    mconn_answered(s, m, index);
}

/* Reads and drops what the peer sends (64 KiB a wake-up; the rest at the next); closes m at its
 * close or an error. */
static void mconn_drain(srv *s, srv_metrics_conn *m)
{
    char buf[4096];
    for (int i = 0; i < 16; i++) {
        ssize_t got = recv(m->fd, buf, sizeof buf, MSG_DONTWAIT);
        if (got > 0) continue;
        if (got < 0 && (errno == EAGAIN || errno == EINTR)) return;
        mconn_close(s, m);
        return;
    }
}

/* No memory for the reply, or for the reading it needs: 503, and the connection is done (a
 * scrape that read part of the text would take it whole). */
static void mconn_busy(srv *s, srv_metrics_conn *m, uint32_t index)
{
    static const char text[] = "out of memory for the metrics: try again\n";
    char busy[256];
    int n = snprintf(busy, sizeof busy,
                     "HTTP/1.0 503 Service Unavailable\r\nContent-Type: text/plain\r\n"
                     "Content-Length: %zu\r\nConnection: close\r\n\r\n%s",
                     sizeof text - 1, text);
    srv_log_gated(&s->log_oom, "warn", "out_of_memory", "what=metrics");
    ssize_t w = send(m->fd, busy, (size_t)n, MSG_NOSIGNAL | MSG_DONTWAIT);
    (void)w; /* a fresh socket's buffer takes it; else the close says enough */
    mconn_answered(s, m, index);
}

/* Makes the reply from engine (NULL: loading) and starts writing it. */
static void mconn_reply(srv *s, srv_metrics_conn *m, uint32_t index, const idem_stats *engine)
{
    resp_buf body;
    resp_buf_init(&body, 1 << 20);
    metrics_render(s, engine, &body);
    resp_buf_init(&m->out, body.len + 4096); /* the headers, then the body */
    char h[200];
    int k = snprintf(h, sizeof h,
                     "HTTP/1.0 200 OK\r\nContent-Type: text/plain; version=0.0.4\r\n"
                     "Content-Length: %zu\r\nConnection: close\r\n\r\n",
                     body.len);
    resp_buf_append(&m->out, h, (size_t)k);
    resp_buf_append(&m->out, body.data, body.len);
    int cut = body.overflow || m->out.overflow;
    resp_buf_free(&body);
    if (cut) {
        mconn_busy(s, m, index);
        return;
    }
    m->answering = MCONN_WRITING;
    m->off = 0;
    struct epoll_event e = {.events = EPOLLOUT, .data.u64 = SRV_TAG_METRICS_CONN + index};
    epoll_ctl(s->epfd, EPOLL_CTL_MOD, m->fd, &e);
    mconn_write(s, m, index);
}

/* Asked (the request is not looked at: any path answers): the store's figures are read on the
 * stats line (reads.c) and metrics_answer makes the reply; while the store loads there are
 * none, and the reply is made now. Meanwhile the connection is watched for errors alone (what
 * the peer sends, or its close, would wake the loop again and again). */
static void mconn_answer(srv *s, srv_metrics_conn *m, uint32_t index)
{
    if (!s->store || s->loading) {
        mconn_reply(s, m, index, NULL);
        return;
    }
    struct epoll_event e = {.events = 0, .data.u64 = SRV_TAG_METRICS_CONN + index};
    if (srv_reads_submit_metrics(s, index) < 0 || epoll_ctl(s->epfd, EPOLL_CTL_MOD, m->fd, &e)) {
        srv_reads_cancel_metrics(s, index);
        mconn_busy(s, m, index);
        return;
    }
    m->answering = MCONN_READING;
}

void metrics_answer(srv *s, uint32_t index, uint64_t id, const idem_stats *engine)
{
    srv_metrics_conn *m = &s->mconns[index];
    if (m->fd >= 0 && m->id == id && m->answering == MCONN_READING)
        mconn_reply(s, m, index, engine);
}
/* A scrape closed unanswered (why), counted and logged (rate-limited): connections that keep
 * every slot busy keep Prometheus out, and that is said. */
static void metrics_refused(srv *s, const char *why)
{
    s->metrics_refused++;
    srv_log_gated(&s->log_metrics_refused, "warn", "metrics_refused", "reason=\"%s\" refused=%llu",
                  why, (unsigned long long)s->metrics_refused);
}

/* A free slot for a new connection: a free one, else that of the oldest connection that has not
 * asked yet or is done (which is closed). Returns SRV_METRICS_CONNS when every one is answering
 * (its figures being read, or its reply written). */
static uint32_t mconn_slot(srv *s)
{
    uint32_t oldest = SRV_METRICS_CONNS;
    for (uint32_t i = 0; i < SRV_METRICS_CONNS; i++) {
        const srv_metrics_conn *m = &s->mconns[i];
        if (m->fd < 0) return i;
        /* one answered for its silence (metrics_tick) stays one that sent nothing */
        int silent = m->answering == MCONN_READING && !m->asked && !m->tail;
        if ((m->answering == 0 || m->answering == MCONN_DRAINING || silent) &&
            (oldest == SRV_METRICS_CONNS || m->since_ms < s->mconns[oldest].since_ms))
            oldest = i;
    }
    if (oldest == SRV_METRICS_CONNS) return oldest;
    srv_metrics_conn *m = &s->mconns[oldest];
    if (m->answering == 0) /* a scrape that may yet ask: never served */
        metrics_refused(s, "a newer connection took its slot before it asked");
    mconn_close(s, m);
    return oldest;
}

void metrics_init(srv *s)
{
    int64_t wait = srv_test_ms(s, "IDEM_TEST_METRICS_WAIT_MS", -1);
    s->metrics_wait_ms = wait < 0 ? SRV_METRICS_WAIT_MS : wait;
    s->metrics_max_ms = wait < 0 ? SRV_METRICS_MAX_MS : wait + SRV_METRICS_MAX_MS;
}

void metrics_accept(srv *s)
{
    for (int n = 0; n < SRV_METRICS_CONNS; n++) {
        int fd = srv_accept(s, s->metrics_fd, NULL, NULL);
        if (fd < 0) return;
        uint32_t i = mconn_slot(s);
        if (i == SRV_METRICS_CONNS) { /* as many replies as are written at once: refused */
            close(fd);
            metrics_refused(s, "every slot is answering");
            continue;
        }
        srv_metrics_conn *m = &s->mconns[i];
        memset(m, 0, sizeof *m);
        m->fd = fd;
        m->id = ++s->mconn_ids;
        m->since_ms = srv_now_ms();
        struct epoll_event e = {.events = EPOLLIN | EPOLLRDHUP,
                                .data.u64 = SRV_TAG_METRICS_CONN + i};
        if (epoll_ctl(s->epfd, EPOLL_CTL_ADD, fd, &e) != 0) {
            /* The kernel would not watch it (no memory): never served, so closed, and said. */
            srv_log_gated(&s->log_oom, "warn", "out_of_memory", "what=metrics_connection errno=%d",
                          errno);
            close(fd);
            m->fd = -1;
        }
    }
}

/* Whether the request head is complete after p: its blank line ("\r\n\r\n", or "\n\n" from a
 * lax client) was seen, or SRV_METRICS_ASK_MAX bytes came without one. What follows the blank
 * line (a body) is read and dropped while draining. */
static int request_head_ended(srv_metrics_conn *m, const char *p, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        m->tail = m->tail << 8 | (uint8_t)p[i];
        if (m->tail == 0x0d0a0d0a || (m->tail & 0xffff) == 0x0a0a) return 1;
    }
    m->asked += (uint32_t)(n < SRV_METRICS_ASK_MAX ? n : SRV_METRICS_ASK_MAX);
    return m->asked >= SRV_METRICS_ASK_MAX;
}

void metrics_event(srv *s, uint32_t index, uint32_t events)
{
    if (index >= SRV_METRICS_CONNS || s->mconns[index].fd < 0) return;
    srv_metrics_conn *m = &s->mconns[index];
    if (m->answering == MCONN_WRITING) {
        if (events & (EPOLLOUT | EPOLLERR | EPOLLHUP)) mconn_write(s, m, index);
        return;
    }
    if (m->answering == MCONN_DRAINING) {
        mconn_drain(s, m);
        return;
    }
    if (m->answering == MCONN_READING) { /* watched for errors alone (mconn_answer) */
        if (events & (EPOLLERR | EPOLLHUP)) mconn_close(s, m);
        return;
    }
    char req[2048]; /* a bounded part of the request a wake-up (the rest when draining) */
    ssize_t got = recv(m->fd, req, sizeof req, MSG_DONTWAIT);
    if (got > 0) {
        if (request_head_ended(m, req, (size_t)got)) mconn_answer(s, m, index);
    } else if (got == 0 && (m->asked || m->tail)) {
        mconn_answer(s, m, index); /* asked, then shut its side before the blank line */
    } else if (got == 0 || (errno != EAGAIN && errno != EINTR)) {
        mconn_close(s, m); /* gone without asking */
    }
}

void metrics_tick(srv *s, int64_t now_ms)
{
    for (uint32_t i = 0; i < SRV_METRICS_CONNS; i++) {
        srv_metrics_conn *m = &s->mconns[i];
        if (m->fd < 0) continue;
        if (now_ms - m->since_ms >= s->metrics_max_ms)
            mconn_close(s, m); /* a reader too slow for its reply */
        else if (!m->answering && now_ms - m->since_ms >= s->metrics_wait_ms)
            mconn_answer(s, m, i); /* as a blocking server with a read timeout would */
    }
}

void metrics_close_all(srv *s)
{
    for (uint32_t i = 0; i < SRV_METRICS_CONNS; i++)
        if (s->mconns[i].fd >= 0) mconn_close(s, &s->mconns[i]);
}
