/*
 * units.c: durations and sizes with human units, both ways: "90s", "72h", "4d", "1h30m",
 * "250ms" (a bare number other than 0 is refused: the unit is never guessed; parts from the
 * largest unit down, each once, in lower case); "64KiB", "10MB",
 * "1G" (powers of 1024 for KiB/MiB/GiB/TiB and the one-letter forms, of 1000 for KB/MB/GB/TB;
 * a bare number is bytes).
 */
#include <ctype.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <strings.h>

#include "ctl.h"

static const struct {
    const char *name;
    int64_t ms;
} dur_units[] = {
    {"ms", 1},      {"s", 1000},    {"sec", 1000},   {"m", 60000},
    {"min", 60000}, {"h", 3600000}, {"d", 86400000}, {"w", 604800000},
};

/* Durations: parts from the largest unit down, each unit once ("1h30m", not "30m1h" or
 * "1h1h"), in lower case (an upper-case M would read as MiB beside the sizes). */
int parse_duration_ms(const char *s, int64_t *out)
{
    if (!s || !*s) return -1;
    if (strcmp(s, "0") == 0) {
        *out = 0;
        return 0;
    }
    int64_t total = 0, last = INT64_MAX;
    const char *p = s;
    for (int parts = 0; *p; parts++) {
        if (!isdigit((unsigned char)*p) || parts > 8) return -1;
        int64_t v = 0;
        while (isdigit((unsigned char)*p)) {
            if (v > INT64_MAX / 10 - 10) return -1;
            v = v * 10 + (*p++ - '0');
        }
        size_t ul = 0;
        while (isalpha((unsigned char)p[ul]))
            ul++;
        int64_t mult = 0;
        for (size_t i = 0; i < sizeof dur_units / sizeof dur_units[0]; i++)
            if (strlen(dur_units[i].name) == ul && strncmp(p, dur_units[i].name, ul) == 0)
                mult = dur_units[i].ms;
        if (!mult || mult >= last || v > INT64_MAX / mult || total > INT64_MAX - v * mult)
            return -1;
        last = mult;
        total += v * mult;
        p += ul;
    }
    *out = total;
    return 0;
}

int parse_size(const char *s, uint64_t *out)
{
    if (!s || !isdigit((unsigned char)*s)) return -1;
    uint64_t v = 0;
    const char *p = s;
    while (isdigit((unsigned char)*p)) {
        if (v > UINT64_MAX / 10 - 10) return -1;
        v = v * 10 + (uint64_t)(*p++ - '0');
    }
    static const struct {
        const char *name;
        uint64_t mult;
    } units[] = {{"", 1},
                 {"b", 1},
                 {"k", 1ull << 10},
                 {"kib", 1ull << 10},
                 {"kb", 1000},
                 {"m", 1ull << 20},
                 {"mib", 1ull << 20},
                 {"mb", 1000000},
                 {"g", 1ull << 30},
                 {"gib", 1ull << 30},
                 {"gb", 1000000000},
                 {"t", 1ull << 40},
                 {"tib", 1ull << 40},
                 {"tb", 1000000000000ull}};
    for (size_t i = 0; i < sizeof units / sizeof units[0]; i++) {
        if (strcasecmp(p, units[i].name) == 0) {
            if (v > UINT64_MAX / units[i].mult) return -1;
            *out = v * units[i].mult;
            return 0;
        }
    }
    return -1;
}

void fmt_duration(int64_t ms, char *out, size_t cap)
{
    const char *sign = ms < 0 ? "-" : "";
    uint64_t a = ms < 0 ? (uint64_t)(-(ms + 1)) + 1 : (uint64_t)ms;
    uint64_t d = a / 86400000, h = a / 3600000 % 24, m = a / 60000 % 60, s = a / 1000 % 60;
    if (a < 1000)
        snprintf(out, cap, "%s%llums", sign, (unsigned long long)a);
    else if (a < 60000)
        snprintf(out, cap, "%s%llu.%llus", sign, (unsigned long long)s,
                 (unsigned long long)(a % 1000 / 100));
    else if (a < 3600000)
        snprintf(out, cap, "%s%llum%02llus", sign, (unsigned long long)m, (unsigned long long)s);
    else if (a < 86400000)
        snprintf(out, cap, "%s%lluh%02llum", sign, (unsigned long long)h, (unsigned long long)m);
    else
        snprintf(out, cap, "%s%llud%02lluh", sign, (unsigned long long)d, (unsigned long long)h);
}

void fmt_size(uint64_t bytes, char *out, size_t cap)
{
    static const char *const u[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB"};
    double v = (double)bytes;
    int i = 0;
    while (v >= 1024 && i < 5) {
        v /= 1024;
        i++;
    }
    if (i == 0)
        snprintf(out, cap, "%llu B", (unsigned long long)bytes);
    else
        snprintf(out, cap, "%.1f %s", v, u[i]);
}
