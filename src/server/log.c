/*
 * log.c: idemd's log, one `key=value` line per event on stderr:
 *   ts=2026-01-02T03:04:05.678Z level=info event=listening addr=127.0.0.1:7379
 * Values written by callers are already key=value pairs; free text goes in quoted msg="..".
 */
#include "server.h"

#include <stdarg.h>
#include <stdio.h>
#include <time.h>

void srv_log(const char *level, const char *event, const char *fmt, ...)
{
    char line[1024], ts[32];
    struct timespec now;
    struct tm tm;
    clock_gettime(CLOCK_REALTIME, &now);
    gmtime_r(&now.tv_sec, &tm);
    strftime(ts, sizeof ts, "%Y-%m-%dT%H:%M:%S", &tm);
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(line, sizeof line, fmt, ap);
    va_end(ap);
    fprintf(stderr, "ts=%s.%03ldZ level=%s event=%s%s%s\n", ts, now.tv_nsec / 1000000, level, event,
            line[0] ? " " : "", line);
}
