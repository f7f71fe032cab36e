/*
 * metrics.c: the Prometheus text endpoint (--metrics-listen ADDR:PORT). Each scrape is served on
 * the loop thread: the request is read with a 200 ms timeout and ignored (any path answers), the
 * exposition written, the connection closed. Counters end in _total; the flush latency is a
 * histogram over the engine's power-of-two buckets. Nothing here scans keys.
 */
#include "cmd.h"

#include <stdio.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

static int is_counter(const char *name)
{
    static const char *const counters[] = {
        "claims_new",           "claims_busy",         "claims_done", "claims_mismatch",
        "claims_recover",       "claims_review",       "mismatches",  "recoveries",
        "conflicting_commits",  "expired_total",       "flushes",     "flush_records",
        "flush_latency_us_sum", "checkpoints",         "compactions", "total_connections",
        "total_commands",       "rejected_connections"};
    for (size_t i = 0; i < sizeof counters / sizeof counters[0]; i++)
        if (strcmp(name, counters[i]) == 0) return 1;
    return 0;
}

static void render_histogram(srv *s, resp_buf *b)
{
    idem_stats st;
    char line[160];
    uint64_t cum = 0;
    idem_get_stats(s->store, &st);
    int k = snprintf(line, sizeof line, "# TYPE idem_flush_latency_us histogram\n");
    resp_buf_append(b, line, (size_t)k);
    for (int i = 0; i < 16; i++) {
        cum += st.flush_latency_us_buckets[i];
        if (i < 15)
            k = snprintf(line, sizeof line, "idem_flush_latency_us_bucket{le=\"%llu\"} %llu\n",
                         1ull << (i + 4), (unsigned long long)cum);
        else
            k = snprintf(line, sizeof line, "idem_flush_latency_us_bucket{le=\"+Inf\"} %llu\n",
                         (unsigned long long)cum);
        resp_buf_append(b, line, (size_t)k);
    }
    k = snprintf(line, sizeof line,
                 "idem_flush_latency_us_sum %llu\nidem_flush_latency_us_count %llu\n",
                 (unsigned long long)st.flush_latency_us_sum, (unsigned long long)st.flushes);
    resp_buf_append(b, line, (size_t)k);
}

void metrics_render(srv *s, resp_buf *b)
{
    char line[200];
    int k;
    if (!s->store || s->loading) {
        k = snprintf(line, sizeof line, "# TYPE idem_loading gauge\nidem_loading 1\n");
        resp_buf_append(b, line, (size_t)k);
        return;
    }
    cmd_stat st[64];
    int n = cmd_stats_list(s, st, 64);
    for (int i = 0; i < n; i++) {
        int counter = is_counter(st[i].name);
        const char *suffix = counter && !strstr(st[i].name, "_total") ? "_total" : "";
        k = snprintf(line, sizeof line, "# TYPE idem_%s%s %s\nidem_%s%s %lld\n", st[i].name, suffix,
                     counter ? "counter" : "gauge", st[i].name, suffix, (long long)st[i].value);
        resp_buf_append(b, line, (size_t)k);
    }
    render_histogram(s, b);
}

void metrics_serve(srv *s, int fd)
{
    struct timeval tv = {0, 200000};
    char req[2048];
    resp_buf body, head;
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
    ssize_t got = recv(fd, req, sizeof req, 0);
    (void)got;
    resp_buf_init(&body, 1 << 20);
    resp_buf_init(&head, 4096);
    metrics_render(s, &body);
    char h[200];
    int k = snprintf(h, sizeof h,
                     "HTTP/1.0 200 OK\r\nContent-Type: text/plain; version=0.0.4\r\n"
                     "Content-Length: %zu\r\nConnection: close\r\n\r\n",
                     body.len);
    resp_buf_append(&head, h, (size_t)k);
    resp_buf_append(&head, body.data, body.len);
    size_t off = 0;
    while (off < head.len) {
        ssize_t w = send(fd, head.data + off, head.len - off, MSG_NOSIGNAL);
        if (w <= 0) break;
        off += (size_t)w;
    }
    resp_buf_free(&body);
    resp_buf_free(&head);
    close(fd);
}
