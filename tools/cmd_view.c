/*
 * cmd_view.c: the read-only views of idemctl: status (counters and a verdict), watch (rates,
 * refreshed), get (one record) and scan (keys for scripts).
 */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "ctl.h"

#define STATUS_OLDER_DEFAULT_MS (15 * 60 * 1000)
#define STATUS_MIN_FREE_DEFAULT (1ull << 30)
#define STATUS_FLUSH_P99_US     100000u
#define STATUS_CAPACITY_PCT     90u
/* Leases that ran out are counted from the attention list up to this many, and only where the
 * review records listed ahead of them are no more than this (they make the verdict already),
 * and the in_flight records no more than STATUS_LEASES_IN_FLIGHT_MAX (the list looks through
 * them all: status stays a cheap call). */
#define STATUS_LEASES_LISTED        1000u
#define STATUS_LEASES_IN_FLIGHT_MAX 100000u

static void sleep_ms(int64_t ms)
{
    struct timespec ts = {ms / 1000, (ms % 1000) * 1000000};
    while (nanosleep(&ts, &ts) != 0) {
    }
}

static int64_t mono_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

static uint64_t claims_total(const idem_stats *s)
{
    return s->claims_new + s->claims_busy + s->claims_done + s->claims_mismatch +
           s->claims_recover + s->claims_review;
}

/* Upper bound (us) of the q-quantile of the latency histogram a - b; 0 if empty. */
static uint64_t flush_quantile_us(const idem_stats *a, const idem_stats *b, double q)
{
    uint64_t total = 0, cum = 0;
    for (int i = 0; i < 16; i++)
        total += a->flush_latency_us_buckets[i] - (b ? b->flush_latency_us_buckets[i] : 0);
    if (total == 0) return 0;
    for (int i = 0; i < 16; i++) {
        cum += a->flush_latency_us_buckets[i] - (b ? b->flush_latency_us_buckets[i] : 0);
        if ((double)cum >= q * (double)total) return 1ull << (i + 4);
    }
    return 1ull << 20;
}

static void fmt_us(uint64_t us, char *out, size_t cap)
{
    if (us == 0)
        snprintf(out, cap, "-");
    else if (us < 1000)
        snprintf(out, cap, "<%lluus", (unsigned long long)us);
    else
        snprintf(out, cap, "<%.1fms", (double)us / 1000);
}

/* ---- status ---- */

struct status {
    struct ctl_stats st;
    int64_t now_ms, window_ms;
    uint64_t w_claims, w_dups;
    uint64_t p50_us, p99_us, mean_us;
    int64_t leases_out; /* in_flight records whose lease ran out (-1: not counted) */
    int leases_more;    /* leases_out is a lower bound: the list was cut */
    int leases_unread;  /* not counted: the attention list could not be read (said on stderr) */
    char reasons[1024];
};

static void reason_add(struct status *s, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));

static void reason_add(struct status *s, const char *fmt, ...)
{
    size_t n = strlen(s->reasons);
    if (n && n + 3 < sizeof s->reasons) {
        strcat(s->reasons, "; ");
        n += 2;
    }
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(s->reasons + n, sizeof s->reasons - n, fmt, ap);
    va_end(ap);
}

static unsigned pct(uint64_t used, uint64_t max)
{
    return max ? (unsigned)(used * 100 / max) : 0;
}

static void status_verdict(struct status *s, const struct ctl_opts *o)
{
    const idem_stats *t = &s->st.s;
    char d[32], z[32];
    int64_t older = o->has_older ? o->older_ms : STATUS_OLDER_DEFAULT_MS;
    uint64_t min_free = o->has_min_free ? o->min_free_bytes : STATUS_MIN_FREE_DEFAULT;
    if (t->fatal)
        reason_add(s, "the store stopped after a failed write (fatal): restart idemd, then verify");
    if (t->loading) { /* nothing else is known: the counts are all 0 until then */
        reason_add(s, "recovery is running");
        return;
    }
    if (t->keys_review)
        reason_add(s, "%llu record(s) held for review", (unsigned long long)t->keys_review);
    if (s->leases_out > 0)
        reason_add(s, "%s%lld in_flight record(s) whose lease ran out (idemctl attention)",
                   s->leases_more ? "at least " : "", (long long)s->leases_out);
    if (t->oldest_in_flight_ms && s->now_ms - t->oldest_in_flight_ms >= older) {
        fmt_duration(s->now_ms - t->oldest_in_flight_ms, d, sizeof d);
        reason_add(s, "an in_flight record is %s old", d);
    }
    uint64_t mis = s->st.has_keys_with_mismatch ? t->keys_with_mismatch : t->mismatches;
    if (mis)
        reason_add(s, "%llu %s", (unsigned long long)mis,
                   s->st.has_keys_with_mismatch ? "key(s) with mismatches"
                                                : "mismatch(es) recorded");
    if (t->conflicting_commits)
        reason_add(s, "%llu conflicting commit(s)", (unsigned long long)t->conflicting_commits);
    if (t->max_keys && pct(t->keys, t->max_keys) >= STATUS_CAPACITY_PCT)
        reason_add(s, "keys at %u%% of the limit", pct(t->keys, t->max_keys));
    /* --max-memory limits the index (index_bytes), not all the store's memory */
    if (t->max_memory_bytes && pct(t->index_bytes, t->max_memory_bytes) >= STATUS_CAPACITY_PCT)
        reason_add(s, "index memory at %u%% of the limit",
                   pct(t->index_bytes, t->max_memory_bytes));
    if (t->max_disk_bytes && pct(t->disk_bytes, t->max_disk_bytes) >= STATUS_CAPACITY_PCT)
        reason_add(s, "disk use at %u%% of the limit", pct(t->disk_bytes, t->max_disk_bytes));
    if (t->disk_free_bytes < min_free) { /* 0: a full disk (or a size it could not read) */
        fmt_size(t->disk_free_bytes, z, sizeof z);
        reason_add(s, "disk free is %s", z);
    }
    if (s->p99_us >= STATUS_FLUSH_P99_US) {
        fmt_us(s->p99_us, d, sizeof d);
        reason_add(s, "flush p99 %s", d);
    }
}

/* Counts the in_flight records whose lease ran out: a worker died or hung with the key, and its
 * redelivery waits for a recover (none comes if the sender gave up). Found through the
 * attention list (no scan of all keys), which puts the review records first. */
static void status_leases(struct ctl *c, struct status *s)
{
    const idem_stats *t = &s->st.s;
    s->leases_out = -1;
    if (t->keys_in_flight == 0) {
        s->leases_out = 0;
        return;
    }
    if (t->keys_review > STATUS_LEASES_LISTED || t->keys_in_flight > STATUS_LEASES_IN_FLIGHT_MAX)
        return;
    struct ctl_record *recs = NULL;
    size_t n = 0;
    uint32_t max = (uint32_t)t->keys_review + STATUS_LEASES_LISTED;
    /* Not counted where the list cannot be had (an idemd without IDEM.ATTENTION: said on
     * stderr); the rest of the verdict stands. */
    int rc = ctl_attention(c, 0, max, &recs, &n);
    int64_t out = 0;
    uint64_t review = 0;
    for (size_t i = 0; i < n; i++) {
        out += ctl_lease_ran_out(&recs[i].r, t->store_clock_ms);
        review += recs[i].r.state == IDEM_STATE_REVIEW;
        ctl_record_free(&recs[i]);
    }
    free(recs);
    if (rc) {
        s->leases_unread = 1;
        return;
    }
    /* A list cut (to max, or by idemd to its reply room: fewer review records than counted,
     * which come first; offline, to CTL_ATTENTION_BYTES) gives a lower bound, and a 0 then says
     * nothing. */
    s->leases_more = n >= max || review < t->keys_review || c->attention_cut;
    if (out > 0 || !s->leases_more) s->leases_out = out;
}

static int status_collect(struct ctl *c, const struct ctl_opts *o, struct status *s)
{
    memset(s, 0, sizeof *s);
    struct ctl_stats first;
    if (ctl_stats_or_loading(c, &first)) return CTL_FAIL;
    if (first.loading) { /* a verdict, without counts: idemd has none yet */
        s->st = first;
        status_verdict(s, o);
        return 0;
    }
    /* The store counts the last minute itself; --window measures a window of one's own. */
    if (!o->window_ms && first.has_last_minute) {
        s->st = first;
        s->w_claims = first.s.claims_last_minute;
        s->w_dups = first.s.duplicates_last_minute;
        s->window_ms = 60000;
        s->now_ms = first.s.store_clock_ms;
        if (s->st.has_buckets) {
            s->p50_us = flush_quantile_us(&first.s, NULL, 0.5);
            s->p99_us = flush_quantile_us(&first.s, NULL, 0.99);
        }
        s->mean_us = first.s.flushes ? first.s.flush_latency_us_sum / first.s.flushes : 0;
        status_leases(c, s);
        status_verdict(s, o);
        return 0;
    }
    s->window_ms = o->window_ms ? o->window_ms : c->online ? 1000 : 0;
    if (s->window_ms) sleep_ms(s->window_ms);
    if (s->window_ms && ctl_stats(c, &s->st)) return CTL_FAIL;
    if (!s->window_ms) s->st = first;
    const idem_stats *t = &s->st.s, *b = s->window_ms ? &first.s : NULL;
    s->w_claims = claims_total(t) - (b ? claims_total(b) : 0);
    s->w_dups = s->w_claims - (t->claims_new - (b ? b->claims_new : 0));
    s->now_ms = t->store_clock_ms;
    if (s->st.has_buckets) {
        s->p50_us = flush_quantile_us(t, NULL, 0.5);
        s->p99_us = flush_quantile_us(t, NULL, 0.99);
    }
    s->mean_us = t->flushes ? t->flush_latency_us_sum / t->flushes : 0;
    status_leases(c, s);
    status_verdict(s, o);
    return 0;
}

static void status_json(const struct status *s)
{
    const idem_stats *t = &s->st.s;
    struct jw j;
    jw_init(&j, stdout);
    jw_obj(&j);
    jw_kstr(&j, "verdict", s->reasons[0] ? "attention" : "healthy");
    jw_kstr(&j, "reasons", s->reasons[0] ? s->reasons : NULL);
    jw_kint(&j, "loading", t->loading);
    if (s->st.loading) { /* nothing else is known */
        jw_obj_end(&j);
        fputc('\n', stdout);
        return;
    }
    jw_kuint(&j, "keys", t->keys);
    jw_kuint(&j, "keys_in_flight", t->keys_in_flight);
    jw_kuint(&j, "keys_committed", t->keys_committed);
    jw_kuint(&j, "keys_review", t->keys_review);
    jw_kuint(&j, "window_ms", (uint64_t)s->window_ms);
    jw_kuint(&j, "window_claims", s->w_claims);
    jw_kuint(&j, "window_duplicates", s->w_dups);
    jw_key(&j, "duplicate_ratio");
    if (s->w_claims)
        jw_double(&j, (double)s->w_dups / (double)s->w_claims);
    else
        jw_null(&j);
    jw_kint(&j, "oldest_in_flight_age_ms",
            t->oldest_in_flight_ms ? s->now_ms - t->oldest_in_flight_ms : 0);
    jw_kint(&j, "oldest_review_age_ms", t->oldest_review_ms ? s->now_ms - t->oldest_review_ms : 0);
    jw_key(&j, "leases_run_out"); /* null: not counted */
    if (s->leases_out >= 0)
        jw_int(&j, s->leases_out);
    else
        jw_null(&j);
    jw_kuint(&j, "mismatches", t->mismatches);
    if (s->st.has_keys_with_mismatch) jw_kuint(&j, "keys_with_mismatch", t->keys_with_mismatch);
    jw_kuint(&j, "conflicting_commits", t->conflicting_commits);
    jw_kuint(&j, "max_keys", t->max_keys);
    jw_kuint(&j, "memory_bytes", t->memory_bytes);
    jw_kuint(&j, "index_bytes", t->index_bytes);
    jw_kuint(&j, "max_memory_bytes", t->max_memory_bytes);
    jw_kuint(&j, "disk_bytes", t->disk_bytes);
    jw_kuint(&j, "max_disk_bytes", t->max_disk_bytes);
    jw_kuint(&j, "disk_free_bytes", t->disk_free_bytes);
    jw_kuint(&j, "wal_bytes", t->wal_bytes);
    jw_kuint(&j, "flushes", t->flushes);
    jw_kuint(&j, "flush_mean_us", s->mean_us);
    jw_kuint(&j, "flush_p50_us", s->p50_us);
    jw_kuint(&j, "flush_p99_us", s->p99_us);
    jw_kint(&j, "clock_skew_ms", t->clock_skew_ms);
    jw_ktime(&j, "store_clock_ms", t->store_clock_ms);
    jw_kint(&j, "fatal", t->fatal);
    jw_obj_end(&j);
    fputc('\n', stdout);
}

static void row_age(struct table *tb, const char *name, int64_t since_ms, int64_t now_ms)
{
    char d[32] = "-", iso[64] = "";
    if (since_ms) {
        fmt_duration(now_ms - since_ms, d, sizeof d);
        char tmp[40];
        fmt_iso(since_ms, tmp, sizeof tmp);
        snprintf(iso, sizeof iso, "first seen %s", tmp);
    }
    table_add(tb, name, d, iso);
}

static void row_cap(struct table *tb, const char *name, uint64_t used, uint64_t max, int bytes)
{
    char u[32], m[64] = "no limit";
    if (bytes)
        fmt_size(used, u, sizeof u);
    else
        snprintf(u, sizeof u, "%llu", (unsigned long long)used);
    if (max) {
        char mm[32];
        if (bytes)
            fmt_size(max, mm, sizeof mm);
        else
            snprintf(mm, sizeof mm, "%llu", (unsigned long long)max);
        snprintf(m, sizeof m, "%u%% of %s", pct(used, max), mm);
    }
    table_add(tb, name, u, m);
}

static void status_human(const struct status *s, const struct ctl_opts *o)
{
    const idem_stats *t = &s->st.s;
    char a[32], b[32], c[160];
    if (s->reasons[0])
        printf("%sattention%s: %s\n", col(o, CTL_C_YELLOW), col(o, CTL_C_RESET), s->reasons);
    else
        printf("%shealthy%s\n", col(o, CTL_C_GREEN), col(o, CTL_C_RESET));
    if (s->st.loading) {
        printf("idemd answers -LOADING: its counts come once the store is open\n");
        return;
    }
    struct table *tb = table_new(3);
    snprintf(a, sizeof a, "%llu", (unsigned long long)t->keys);
    snprintf(c, sizeof c, "in_flight %llu, committed %llu, review %llu",
             (unsigned long long)t->keys_in_flight, (unsigned long long)t->keys_committed,
             (unsigned long long)t->keys_review);
    table_add(tb, "keys", a, c);
    if (s->w_claims)
        snprintf(a, sizeof a, "%.1f%%", 100.0 * (double)s->w_dups / (double)s->w_claims);
    else
        snprintf(a, sizeof a, "-");
    fmt_duration(s->window_ms, b, sizeof b);
    snprintf(c, sizeof c, "%llu of %llu claims %s%s", (unsigned long long)s->w_dups,
             (unsigned long long)s->w_claims, s->window_ms ? "in the last " : "since open",
             s->window_ms ? b : "");
    table_add(tb, "duplicate ratio", a, c);
    row_age(tb, "oldest in_flight", t->oldest_in_flight_ms, s->now_ms);
    row_age(tb, "oldest review", t->oldest_review_ms, s->now_ms);
    if (s->leases_out >= 0)
        snprintf(a, sizeof a, "%s%lld", s->leases_more ? ">= " : "", (long long)s->leases_out);
    else
        snprintf(a, sizeof a, "-");
    table_add(tb, "leases run out", a,
              s->leases_out >= 0
                  ? "in_flight: the next claim recovers (or, by policy, reviews) the key"
              : s->leases_unread ? "not counted: the attention list could not be read"
                                 : "not counted (many records in flight or in review)");
    snprintf(a, sizeof a, "%llu", (unsigned long long)t->mismatches);
    snprintf(c, sizeof c, s->st.has_keys_with_mismatch ? "%llu keys" : "recorded since open",
             (unsigned long long)t->keys_with_mismatch);
    table_add(tb, "mismatches", a, c);
    snprintf(a, sizeof a, "%llu", (unsigned long long)t->conflicting_commits);
    table_add(tb, "conflicting commits", a, "a target may have given two references for one key");
    row_cap(tb, "capacity: keys", t->keys, t->max_keys, 0);
    row_cap(tb, "capacity: index memory", t->index_bytes, t->max_memory_bytes, 1);
    row_cap(tb, "capacity: disk", t->disk_bytes, t->max_disk_bytes, 1);
    fmt_size(t->disk_free_bytes, a, sizeof a);
    table_add(tb, "disk free", a, "");
    fmt_us(s->p50_us, a, sizeof a);
    fmt_us(s->p99_us, b, sizeof b);
    snprintf(c, sizeof c, "p50 %s, p99 %s, %llu flushes", a, b, (unsigned long long)t->flushes);
    snprintf(a, sizeof a, "%lluus mean", (unsigned long long)s->mean_us);
    table_add(tb, "flush latency", a, s->st.has_buckets ? c : "percentiles not reported by idemd");
    table_print(tb, stdout, 0, o->color);
    table_free(tb);
}

int cmd_status(const struct ctl_opts *o)
{
    if (o->dir && o->window_ms) { /* as watch: nothing to measure, and the store held meanwhile */
        ctl_err("--window measures idemd's traffic, and a stopped store (--dir) has none");
        return CTL_USAGE;
    }
    struct ctl c;
    int rc = ctl_connect(&c, o, CTL_READ);
    if (rc) return rc;
    struct status s;
    rc = status_collect(&c, o, &s);
    if (rc == 0) {
        if (o->json)
            status_json(&s);
        else
            status_human(&s, o);
    }
    rc = ctl_disconnect(&c, rc);
    return rc;
}

/* ---- watch ---- */

/* One line of the watch; CTL_FAIL when it did not reach stdout. */
static int watch_line(const struct ctl_opts *o, const idem_stats *cur, const idem_stats *prev,
                      int64_t dt_ms, int has_buckets, int n)
{
    double secs = dt_ms > 0 ? (double)dt_ms / 1000.0 : 1.0;
    uint64_t claims = claims_total(cur) - claims_total(prev);
    uint64_t dups = claims - (cur->claims_new - prev->claims_new);
    int64_t age = cur->oldest_in_flight_ms ? cur->store_clock_ms - cur->oldest_in_flight_ms : 0;
    uint64_t p50 = has_buckets ? flush_quantile_us(cur, prev, 0.5) : 0;
    uint64_t p99 = has_buckets ? flush_quantile_us(cur, prev, 0.99) : 0;
    if (o->json) {
        struct jw j;
        jw_init(&j, stdout);
        jw_obj(&j);
        jw_ktime(&j, "store_clock_ms", cur->store_clock_ms);
        jw_key(&j, "claims_per_s");
        jw_double(&j, (double)claims / secs);
        jw_key(&j, "duplicates_per_s");
        jw_double(&j, (double)dups / secs);
        jw_key(&j, "duplicate_ratio");
        if (claims)
            jw_double(&j, (double)dups / (double)claims);
        else
            jw_null(&j);
        jw_kuint(&j, "in_flight", cur->keys_in_flight);
        jw_kint(&j, "oldest_in_flight_age_ms", age);
        jw_kuint(&j, "flush_p50_us", p50);
        jw_kuint(&j, "flush_p99_us", p99);
        jw_obj_end(&j);
        fputc('\n', stdout);
        return fflush(stdout) != 0 || ferror(stdout) ? CTL_FAIL : 0;
    }
    if (n % 20 == 0)
        printf("%s%-24s %10s %10s %7s %9s %12s %10s %10s%s\n", col(o, CTL_C_BOLD), "time",
               "claims/s", "dups/s", "ratio", "in_flight", "oldest", "flush p50", "flush p99",
               col(o, CTL_C_RESET));
    char t[40], a[32], r[16], f50[24], f99[24];
    fmt_iso(cur->store_clock_ms, t, sizeof t);
    if (age)
        fmt_duration(age, a, sizeof a);
    else
        snprintf(a, sizeof a, "-");
    if (claims)
        snprintf(r, sizeof r, "%.1f%%", 100.0 * (double)dups / (double)claims);
    else
        snprintf(r, sizeof r, "-");
    fmt_us(p50, f50, sizeof f50);
    fmt_us(p99, f99, sizeof f99);
    printf("%-24s %10.1f %10.1f %7s %9llu %12s %10s %10s\n", t, (double)claims / secs,
           (double)dups / secs, r, (unsigned long long)cur->keys_in_flight, a, f50, f99);
    return fflush(stdout) != 0 || ferror(stdout) ? CTL_FAIL : 0;
}

int cmd_watch(const struct ctl_opts *o)
{
    /* A stopped store has no traffic to show, and the watch held it (a shared lock) for as
     * long as it ran: idemd could not start meanwhile. */
    if (o->dir) {
        ctl_err("watch shows idemd's traffic, and a stopped store (--dir) has none: use "
                "status --dir");
        return CTL_USAGE;
    }
    struct ctl c;
    int rc = ctl_connect(&c, o, CTL_READ);
    if (rc) return rc;
    int64_t interval = o->interval_ms ? o->interval_ms : 1000;
    struct ctl_stats prev, cur;
    rc = ctl_stats(&c, &prev);
    int64_t t0 = mono_ms();
    for (uint64_t n = 0; rc == 0 && (!o->has_count || n < o->count); n++) {
        sleep_ms(interval);
        rc = ctl_stats(&c, &cur);
        if (rc) break;
        int64_t t1 = mono_ms();
        /* Output that does not reach its file ends the watch (main names the error): it ran
         * on unseen, for ever. */
        rc = watch_line(o, &cur.s, &prev.s, t1 - t0, cur.has_buckets, (int)n);
        prev = cur;
        t0 = t1;
    }
    rc = ctl_disconnect(&c, rc);
    return rc;
}

/* ---- get ---- */

static void row_time(struct table *tb, const char *name, int64_t ms, int64_t now, int future)
{
    char iso[40], d[32], rel[48] = "";
    fmt_iso(ms, iso, sizeof iso);
    if (ms) {
        int ahead = future && ms > now;
        fmt_duration(ahead ? ms - now : now - ms, d, sizeof d);
        snprintf(rel, sizeof rel, ahead ? "in %s" : future ? "passed %s ago" : "%s ago", d);
    }
    table_add(tb, name, iso, rel);
}

/* A key or an owner whole; a result or a note cut with "..." past that (--json has it whole). */
static void row_bytes(struct table *tb, const char *name, const void *p, size_t n)
{
    char esc[CTL_KEY_TEXT_CAP], len[32];
    bytes_escape(p, n, esc, sizeof esc);
    snprintf(len, sizeof len, "%zu bytes", n);
    table_add(tb, name, esc, len);
}

static void record_human(const idem_record *r, int64_t now, const struct ctl_opts *o)
{
    struct table *tb = table_new(3);
    char v[64];
    row_bytes(tb, "key", r->key, r->key_len);
    table_add(tb, "state", idem_state_name(r->state), "");
    table_color(tb, 1, r->state == IDEM_STATE_COMMITTED ? CTL_C_GREEN : CTL_C_YELLOW);
    row_time(tb, "first_seen", r->first_seen_ms, now, 0);
    if (r->state == IDEM_STATE_COMMITTED)
        row_time(tb, "expires_at", r->expires_at_ms, now, 1);
    else
        table_add(tb, "expires_at", "-", "never while unfinished");
    row_time(tb, "last_seen", r->last_seen_ms, now, 0);
    snprintf(v, sizeof v, "%llu", (unsigned long long)r->seen_count);
    table_add(tb, "seen_count", v, "claims in all");
    fmt_hex(r->fp, IDEM_FP_BYTES, v, sizeof v);
    table_add(tb, "fingerprint", r->has_fp ? v : "-", "");
    if (r->state == IDEM_STATE_IN_FLIGHT) {
        row_time(tb, "lease_until", r->lease_until_ms, now, 1);
        snprintf(v, sizeof v, "%lld", (long long)r->token);
        table_add(tb, "token", v, "");
        if (r->owner) row_bytes(tb, "owner", r->owner, r->owner_len);
    }
    snprintf(v, sizeof v, "%u", r->attempts);
    table_add(tb, "attempts", v, "grants of ownership");
    row_time(tb, "last_grant", r->last_grant_ms, now, 0);
    if (r->state == IDEM_STATE_COMMITTED)
        row_bytes(tb, "result", r->result ? r->result : "", r->result_len);
    if (r->note) row_bytes(tb, "note", r->note, r->note_len);
    snprintf(v, sizeof v, "%llu", (unsigned long long)r->mismatch_count);
    table_add(tb, "mismatch_count", v, r->mismatch_count ? "repeats with different content" : "");
    if (r->mismatch_count) {
        table_color(tb, 1, CTL_C_RED);
        row_time(tb, "last_mismatch", r->last_mismatch_ms, now, 0);
        fmt_hex(r->last_mismatch_fp, IDEM_FP_BYTES, v, sizeof v);
        table_add(tb, "last_mismatch_fp", r->has_last_mismatch_fp ? v : "-", "");
    }
    snprintf(v, sizeof v, "%llu", (unsigned long long)r->version);
    table_add(tb, "version", v, "pass it back to act on what you saw");
    table_print(tb, stdout, 0, o->color);
    table_free(tb);
}

int cmd_get(const struct ctl_opts *o)
{
    struct ctl c;
    int rc = ctl_connect(&c, o, CTL_READ);
    if (rc) return rc;
    struct ctl_record r;
    int found = 0;
    int64_t now = 0;
    rc = ctl_get(&c, o->key, o->key_len, &r, &found);
    if (rc == 0) rc = ctl_now(&c, &now);
    rc = ctl_disconnect(&c, rc);
    if (rc) {
        if (found) ctl_record_free(&r);
        return rc;
    }
    if (!found) {
        char shown[CTL_KEY_TEXT_CAP];
        bytes_escape(o->key, o->key_len, shown, sizeof shown);
        if (o->json) printf("null\n");
        ctl_err("%s: no record (absent, or expired)", shown);
        return CTL_FAIL;
    }
    if (o->json) {
        struct jw j;
        jw_init(&j, stdout);
        print_record_json(&j, &r.r, now);
        fputc('\n', stdout);
    } else {
        record_human(&r.r, now, o);
    }
    ctl_record_free(&r);
    return CTL_OK;
}

/* ---- scan ---- */

struct scan_out {
    const struct ctl_opts *o;
    struct jw j;
    uint64_t n;
};

static void scan_key(void *ctx, const void *key, size_t klen)
{
    struct scan_out *s = ctx;
    if (s->o->has_count && s->n >= s->o->count) return;
    s->n++;
    if (s->o->json) {
        /* A key that is not text has no JSON string: {"key_base64": ...} in its place. */
        if (bytes_are_text(key, klen)) {
            jw_bytes(&s->j, key, klen);
        } else {
            jw_obj(&s->j);
            jw_kblob_pub(&s->j, "key", key, klen);
            jw_obj_end(&s->j);
        }
        fputc('\n', stdout);
        return;
    }
    char esc[IDEM_KEY_BYTES_MAX * 4 + 8];
    bytes_escape(key, klen, esc, sizeof esc);
    puts(esc);
}

int cmd_scan(const struct ctl_opts *o)
{
    struct ctl c;
    int rc = ctl_connect(&c, o, CTL_READ);
    if (rc) return rc;
    struct scan_out s = {.o = o};
    jw_init(&s.j, stdout);
    if (o->json) jw_arr(&s.j);
    uint64_t cursor = 0;
    do
        rc = ctl_scan_step(&c, &cursor, o->state, o->has_older ? o->older_ms : 0, scan_key, &s);
    while (rc == 0 && cursor != 0 && !(o->has_count && s.n >= o->count));
    if (o->json && rc == 0) { /* a scan cut short leaves the list open: not taken as whole */
        jw_arr_end(&s.j);
        fputc('\n', stdout);
    }
    rc = ctl_disconnect(&c, rc);
    return rc;
}
