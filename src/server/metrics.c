/*
 * metrics.c: the Prometheus text endpoint (--metrics-listen ADDR:PORT). Each scrape is served on
 * the loop thread: the request is read with a 200 ms timeout and ignored (any path answers), the
 * exposition written, the connection closed. Counters end in _total; the flush latency (the
 * engine's) and the claim latency (the server's) are histograms over the same power-of-two
 * buckets. Nothing here scans keys.
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

/* Renders idem_<name> as a histogram: bucket i counts values under 2^(i+4), the last the rest
 * (SRV_LAT_BUCKETS of them); Prometheus wants the buckets cumulative. */
static void render_histogram(resp_buf *b, const char *name, const uint64_t *buckets, uint64_t sum,
                             uint64_t count)
{
    char line[200];
    uint64_t cum = 0;
    int k = snprintf(line, sizeof line, "# TYPE idem_%s histogram\n", name);
    resp_buf_append(b, line, (size_t)k);
    for (int i = 0; i < SRV_LAT_BUCKETS; i++) {
        cum += buckets[i];
        if (i < SRV_LAT_BUCKETS - 1)
            k = snprintf(line, sizeof line, "idem_%s_bucket{le=\"%llu\"} %llu\n", name,
                         1ull << (i + 4), (unsigned long long)cum);
        else
            k = snprintf(line, sizeof line, "idem_%s_bucket{le=\"+Inf\"} %llu\n", name,
                         (unsigned long long)cum);
        resp_buf_append(b, line, (size_t)k);
    }
    k = snprintf(line, sizeof line, "idem_%s_sum %llu\nidem_%s_count %llu\n", name,
                 (unsigned long long)sum, name, (unsigned long long)count);
    resp_buf_append(b, line, (size_t)k);
}

static void render_histograms(srv *s, resp_buf *b)
{
    idem_stats st;
    idem_get_stats(s->store, &st);
    _Static_assert(sizeof st.flush_latency_us_buckets / sizeof st.flush_latency_us_buckets[0] ==
                       SRV_LAT_BUCKETS,
                   "the flush and claim histograms share their buckets");
    render_histogram(b, "flush_latency_us", st.flush_latency_us_buckets, st.flush_latency_us_sum,
                     st.flushes);
    render_histogram(b, "claim_latency_us", s->claim_latency_us_buckets, s->claim_latency_us_sum,
                     s->claim_latencies);
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
    cmd_stat st[CMD_STATS_MAX];
    int n = cmd_stats_list(s, st, CMD_STATS_MAX);
    for (int i = 0; i < n; i++) {
        if (strncmp(st[i].name, "flush_latency_us_bucket_", 24) == 0 ||
            strncmp(st[i].name, "claim_latency_us_", 17) == 0)
            continue; /* rendered as histograms below */
        int counter = is_counter(st[i].name);
        const char *suffix = counter && !strstr(st[i].name, "_total") ? "_total" : "";
        k = snprintf(line, sizeof line, "# TYPE idem_%s%s %s\nidem_%s%s %lld\n", st[i].name, suffix,
                     counter ? "counter" : "gauge", st[i].name, suffix, (long long)st[i].value);
        resp_buf_append(b, line, (size_t)k);
    }
    render_histograms(s, b);
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
    metrics_render(s, &body);
    resp_buf_init(&head, body.len + 4096); /* the headers, then the body */
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
