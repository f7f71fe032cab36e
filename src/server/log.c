/*
 * log.c: idemd's log, one `key=value` line per event on stderr:
 *   ts=2026-01-02T03:04:05.678Z level=info event=listening addr=127.0.0.1:7379
 * Values written by callers are already key=value pairs; free text goes in quoted msg="..".
 * Events a client can cause at will go through a gate (srv_log_gated): at most SRV_LOG_BURST lines
 * of one kind a second, the first line let through after others were left out saying how many
 * (suppressed=N), so that a flood of bad clients cannot fill the disk with the log.
 */
#include "server.h"

#include <stdarg.h>
#include <stdio.h>
#include <time.h>

/* One line: ts, level, event, then the caller's pairs and the extra ones (NULL: none). */
static void log_line(const char *level, const char *event, const char *extra, const char *fmt,
                     va_list ap)
{
    char line[1024], ts[32];
    struct timespec now;
    struct tm tm;
    clock_gettime(CLOCK_REALTIME, &now);
    gmtime_r(&now.tv_sec, &tm);
    strftime(ts, sizeof ts, "%Y-%m-%dT%H:%M:%S", &tm);
    vsnprintf(line, sizeof line, fmt, ap);
    fprintf(stderr, "ts=%s.%03ldZ level=%s event=%s%s%s%s%s\n", ts, now.tv_nsec / 1000000, level,
            event, line[0] ? " " : "", line, extra ? " " : "", extra ? extra : "");
}

void srv_log(const char *level, const char *event, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    log_line(level, event, NULL, fmt, ap);
    va_end(ap);
}

void srv_log_gated(srv_log_gate *g, const char *level, const char *event, const char *fmt, ...)
{
    struct timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now);
    if (now.tv_sec != g->second) {
        g->second = now.tv_sec;
        g->lines = 0;
    }
    if (g->lines >= SRV_LOG_BURST) {
        g->suppressed++;
        return;
    }
    g->lines++;
    char extra[48];
    snprintf(extra, sizeof extra, "suppressed=%llu", (unsigned long long)g->suppressed);
    va_list ap;
    va_start(ap, fmt);
    log_line(level, event, g->suppressed ? extra : NULL, fmt, ap);
    va_end(ap);
    g->suppressed = 0;
}
