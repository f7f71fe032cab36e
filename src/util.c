/*
 * util.c: the always-on assertion handler and the system clock readers of util.h.
 */
#include "util.h"

#include <stdio.h>
#include <stdlib.h>
#include <time.h>

void util_assert_fail(const char *file, int line, const char *expr)
{
    fprintf(stderr, "idem: assertion failed: %s:%d: %s\n", file, line, expr);
    abort();
}

static int64_t clock_ns(clockid_t id)
{
    struct timespec ts;
    clock_gettime(id, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

int64_t util_boottime_ms(void)
{
    return clock_ns(CLOCK_BOOTTIME) / 1000000;
}

int64_t util_realtime_ms(void)
{
    return clock_ns(CLOCK_REALTIME) / 1000000;
}

int64_t util_monotonic_us(void)
{
    return clock_ns(CLOCK_MONOTONIC) / 1000;
}

int64_t util_thread_cpu_us(void)
{
    return clock_ns(CLOCK_THREAD_CPUTIME_ID) / 1000;
}
