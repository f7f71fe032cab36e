/*
 * cmd_ops.c: the recovery work of an operator: attention (what needs a person, most urgent
 * first, with the next step in plain words), resolve (a decision on what was seen: the version
 * shown is passed back, so a record that changed meanwhile is refused) and audit (decisions,
 * newest first).
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ctl.h"

#define ATTENTION_MAX_DEFAULT 1000u
#define ATTENTION_MAX_LIMIT   100000u /* IDEM.ATTENTION's COUNT */
#define AUDIT_COUNT_DEFAULT   100u
#define AUDIT_COUNT_LIMIT     10000u /* IDEM.AUDIT's COUNT, and idem_audit's */

/* --count past what the store answers: a usage error, not a quietly shorter list. */
static int count_over(const struct ctl_opts *o, const char *cmd, uint64_t limit)
{
    if (!o->has_count || o->count <= limit) return 0;
    ctl_err("--count %llu: %s lists at most %llu", (unsigned long long)o->count, cmd,
            (unsigned long long)limit);
    return 1;
}

enum why {
    WHY_REVIEW = 0,   /* held for a person */
    WHY_EXPIRED = 1,  /* in_flight, lease ran out */
    WHY_OLD = 2,      /* in_flight, older than --older, lease runs */
    WHY_MISMATCH = 3, /* repeats with different content */
};

static const char *const why_names[] = {"review", "lease ran out", "long in_flight", "mismatch"};

struct item {
    const idem_record *r;
    enum why why;
};

/* Why idemd listed r, by its rule (attention.c): an in_flight record whose lease runs is listed
 * as long in_flight only when older than --older (older_ms > 0); else it was listed for a
 * mismatch, and a worker holds it. */
static enum why why_of(const idem_record *r, int64_t now, int64_t older_ms)
{
    if (r->state == IDEM_STATE_REVIEW) return WHY_REVIEW;
    if (ctl_lease_ran_out(r, now)) return WHY_EXPIRED;
    if (r->state == IDEM_STATE_IN_FLIGHT && older_ms > 0 && now - r->first_seen_ms >= older_ms)
        return WHY_OLD;
    return WHY_MISMATCH;
}

/* Most urgent first: review, then expired leases, then long in_flight (oldest first each),
 * then mismatches (latest first). */
static int item_cmp(const void *a, const void *b)
{
    const struct item *x = a, *y = b;
    if (x->why != y->why) return x->why < y->why ? -1 : 1;
    int64_t kx = x->why == WHY_MISMATCH ? -x->r->last_mismatch_ms : x->r->first_seen_ms;
    int64_t ky = y->why == WHY_MISMATCH ? -y->r->last_mismatch_ms : y->r->first_seen_ms;
    return kx < ky ? -1 : kx > ky;
}

static void next_step(const struct item *it, int64_t now, char *out, size_t cap)
{
    const idem_record *r = it->r;
    char d[32];
    const char *fix = r->mismatch_count ? "fix the source (repeats came with different "
                                          "content); then "
                                        : "";
    switch (it->why) {
    case WHY_REVIEW:
        snprintf(out, cap,
                 "%scheck the target by key, then resolve commit (it happened) or release (it "
                 "did not); settle closes it without new action",
                 fix);
        break;
    case WHY_EXPIRED:
        fmt_duration(now - r->lease_until_ms, d, sizeof d);
        snprintf(out, cap,
                 "%sthe lease ran out %s ago: check the target by key, then resolve commit (it "
                 "happened) or release (it did not)",
                 fix, d);
        break;
    case WHY_OLD:
        fmt_duration(r->lease_until_ms - now, d, sizeof d);
        snprintf(out, cap,
                 "%sstill leased for %s: wait, or check the target by key and resolve with "
                 "--force",
                 fix, d);
        break;
    case WHY_MISMATCH:
        if (r->state == IDEM_STATE_IN_FLIGHT) {
            fmt_duration(r->lease_until_ms - now, d, sizeof d);
            snprintf(out, cap,
                     "fix the source (mismatch): repeats came with different content; a worker "
                     "holds the key (leased for %s): nothing to resolve",
                     d);
        } else {
            snprintf(out, cap,
                     "fix the source (mismatch): repeats came with different content; the "
                     "stored outcome stands, nothing to resolve");
        }
        break;
    }
}

static void attention_json(const struct item *it, size_t n, int64_t now)
{
    struct jw j;
    char step[512];
    jw_init(&j, stdout);
    jw_arr(&j);
    for (size_t i = 0; i < n; i++) {
        fputc('\n', stdout);
        jw_obj(&j);
        jw_kstr(&j, "why", why_names[it[i].why]);
        next_step(&it[i], now, step, sizeof step);
        jw_kstr(&j, "next_step", step);
        jw_key(&j, "record");
        print_record_json(&j, it[i].r, now);
        jw_obj_end(&j);
    }
    jw_arr_end(&j);
    fputc('\n', stdout);
}

static void attention_human(const struct item *it, size_t n, int64_t now, const struct ctl_opts *o)
{
    if (n == 0) {
        printf("nothing needs attention\n");
        return;
    }
    struct table *tb = table_new(9);
    table_add(tb, "KEY", "STATE", "WHY", "FIRST SEEN", "LAST GRANT", "ATTEMPTS", "RESULT/NOTE",
              "VERSION", "NEXT STEP");
    for (size_t i = 0; i < n; i++) {
        const idem_record *r = it[i].r;
        /* The whole key: one cut short could not be given back to get or resolve. */
        char key[CTL_KEY_TEXT_CAP], fs[64], lg[64], att[16], ref[96], ver[24], step[512], d[32];
        bytes_escape(r->key, r->key_len, key, sizeof key);
        fmt_duration(now - r->first_seen_ms, d, sizeof d);
        snprintf(fs, sizeof fs, "%s ago", d);
        fmt_duration(now - r->last_grant_ms, d, sizeof d);
        snprintf(lg, sizeof lg, r->last_grant_ms ? "%s ago" : "-", d);
        snprintf(att, sizeof att, "%u", r->attempts);
        ref[0] = 0;
        if (r->result && r->result_len) bytes_escape(r->result, r->result_len, ref, 48);
        if (r->note && r->note_len) {
            size_t k = strlen(ref);
            snprintf(ref + k, sizeof ref - k, "%snote: ", k ? "; " : "");
            k = strlen(ref);
            bytes_escape(r->note, r->note_len, ref + k, sizeof ref - k);
        }
        snprintf(ver, sizeof ver, "%llu", (unsigned long long)r->version);
        next_step(&it[i], now, step, sizeof step);
        table_add(tb, key, idem_state_name(r->state), why_names[it[i].why], fs, lg, att,
                  ref[0] ? ref : "-", ver, step);
        table_color(tb, 2, it[i].why == WHY_MISMATCH ? CTL_C_RED : CTL_C_YELLOW);
    }
    table_print(tb, stdout, 1, o->color);
    table_free(tb);
}

int cmd_attention(const struct ctl_opts *o)
{
    if (count_over(o, "attention", ATTENTION_MAX_LIMIT)) return CTL_USAGE;
    struct ctl c;
    int rc = ctl_connect(&c, o, CTL_READ);
    if (rc) return rc;
    struct ctl_record *recs = NULL;
    size_t n = 0;
    int64_t now = 0;
    uint32_t max = o->has_count ? (uint32_t)o->count : ATTENTION_MAX_DEFAULT;
    rc = ctl_attention(&c, o->has_older ? o->older_ms : 0, max, &recs, &n);
    const int cut = c.attention_cut; /* said on stderr already */
    struct ctl_stats st;
    if (rc == 0) rc = ctl_stats(&c, &st);
    if (rc == 0) now = st.s.store_clock_ms;
    rc = ctl_disconnect(&c, rc);
    struct item *it = rc == 0 ? calloc(n ? n : 1, sizeof *it) : NULL;
    if (rc == 0 && !it) rc = CTL_FAIL;
    if (it) {
        for (size_t i = 0; i < n; i++)
            it[i] =
                (struct item){&recs[i].r, why_of(&recs[i].r, now, o->has_older ? o->older_ms : 0)};
        qsort(it, n, sizeof *it, item_cmp);
        if (o->json)
            attention_json(it, n, now);
        else
            attention_human(it, n, now, o);
        /* The list was cut to max, the most urgent kept: say so (on stderr, so the list on
         * stdout stays what it is for scripts). An idemd before WITHCUT also cuts it to its
         * reply room without a word: every review record is listed (they never expire), so
         * fewer of them than the store counts means a cut (or records made since). Keys with
         * mismatches are counted expired too until compaction takes them out: no measure. */
        uint64_t review = 0;
        for (size_t i = 0; i < n; i++)
            review += recs[i].r.state == IDEM_STATE_REVIEW;
        if (n >= max)
            fprintf(stderr,
                    "idemctl: the %zu most urgent records are listed: more may need attention "
                    "(--count, at most %u)\n",
                    n, (unsigned)ATTENTION_MAX_LIMIT);
        else if (!cut && review < st.s.keys_review)
            fprintf(stderr,
                    "idemctl: %zu records are listed, but the store holds %llu in review (%llu "
                    "listed): the list was cut short (idemd's reply room, or 64 MiB of records "
                    "offline), or they came since; "
                    "more may need attention\n",
                    n, (unsigned long long)st.s.keys_review, (unsigned long long)review);
    }
    free(it);
    ctl_records_free(recs, n);
    return rc;
}

/* ---- resolve ---- */

static int action_of(const char *s)
{
    if (strcmp(s, "commit") == 0) return IDEM_RESOLVE_COMMIT;
    if (strcmp(s, "release") == 0) return IDEM_RESOLVE_RELEASE;
    if (strcmp(s, "settle") == 0) return IDEM_RESOLVE_SETTLE;
    return 0;
}

/* Prints each field that differs between what the operator saw and what is there now. */
static void print_changes(const idem_record *a, const idem_record *b, int found)
{
    if (!found) {
        fprintf(stderr, "  the record is gone (released, deleted or expired)\n");
        return;
    }
    char x[64], y[64];
    if (a->state != b->state)
        fprintf(stderr, "  state: %s -> %s\n", idem_state_name(a->state),
                idem_state_name(b->state));
    if (a->version != b->version)
        fprintf(stderr, "  version: %llu -> %llu\n", (unsigned long long)a->version,
                (unsigned long long)b->version);
    if (a->token != b->token)
        fprintf(stderr, "  token: %lld -> %lld (a new owner)\n", (long long)a->token,
                (long long)b->token);
    if (a->attempts != b->attempts)
        fprintf(stderr, "  attempts: %u -> %u\n", a->attempts, b->attempts);
    if (a->lease_until_ms != b->lease_until_ms) {
        fmt_iso(a->lease_until_ms, x, sizeof x);
        fmt_iso(b->lease_until_ms, y, sizeof y);
        fprintf(stderr, "  lease_until: %s -> %s\n", x, y);
    }
    if (a->mismatch_count != b->mismatch_count)
        fprintf(stderr, "  mismatch_count: %llu -> %llu\n", (unsigned long long)a->mismatch_count,
                (unsigned long long)b->mismatch_count);
    if (a->note_len != b->note_len || (a->note_len && memcmp(a->note, b->note, a->note_len))) {
        char n[256];
        bytes_escape(b->note ? b->note : "", b->note_len, n, sizeof n);
        fprintf(stderr, "  note: now \"%s\"\n", n);
    }
    if (b->result_len && (a->result_len != b->result_len ||
                          memcmp(a->result ? a->result : "", b->result, b->result_len))) {
        char n[256];
        bytes_escape(b->result, b->result_len, n, sizeof n);
        fprintf(stderr, "  result: now \"%s\"\n", n);
    }
}

/* Refusals decided from the record shown, before anything is sent. */
static int resolve_precheck(const struct ctl_opts *o, const char *key, const idem_record *r,
                            int64_t now)
{
    char d[32];
    if (r->state == IDEM_STATE_COMMITTED) {
        ctl_err("%s is already committed (version %llu): resolve acts on in_flight and review "
                "records",
                key, (unsigned long long)r->version);
        return CTL_FAIL;
    }
    if (r->state == IDEM_STATE_IN_FLIGHT && r->lease_until_ms > now && !o->force) {
        fmt_duration(r->lease_until_ms - now, d, sizeof d);
        ctl_err("%s is in_flight and its lease runs %s more: a worker may still finish it; "
                "pass --force once you have checked the target",
                key, d);
        return CTL_FAIL;
    }
    return 0;
}

/* Reports a decision the store took: from the decision itself (release leaves no record, commit
 * and settle a committed one), with what a read after it found, `after` (NULL: that read failed,
 * and was said). A worker may have claimed the key in between: that is shown as a change since. */
static void resolve_report(const struct ctl_opts *o, int action, const idem_record *before,
                           const struct ctl_record *after, int found, int64_t now)
{
    int decided = action == IDEM_RESOLVE_RELEASE ? 0 : IDEM_STATE_COMMITTED;
    int moved = after && (found ? after->r.state : 0) != decided;
    if (o->json) {
        struct jw j;
        jw_init(&j, stdout);
        jw_obj(&j);
        jw_kstr(&j, "action", o->pos[1]);
        jw_kblob_pub(&j, "reason", o->reason, strlen(o->reason)); /* any bytes, as audit's */
        jw_key(&j, "before");
        print_record_json(&j, before, now);
        jw_kstr(&j, "decided", decided ? idem_state_name(decided) : "absent");
        if (after) { /* the record as read after the decision */
            jw_key(&j, "after");
            if (found)
                print_record_json(&j, &after->r, now);
            else
                jw_null(&j);
        }
        jw_obj_end(&j);
        fputc('\n', stdout);
        return;
    }
    char key[CTL_KEY_TEXT_CAP];
    bytes_escape(before->key, before->key_len, key, sizeof key);
    printf("%s: %s (version %llu) -> ", key, idem_state_name(before->state),
           (unsigned long long)before->version);
    if (!decided)
        printf("released, the next claim gets new");
    else if (after && !moved)
        printf("committed (version %llu) by %s", (unsigned long long)after->r.version, o->pos[1]);
    else
        printf("committed by %s", o->pos[1]);
    printf("; recorded in the audit trail\n");
    if (moved && found)
        printf("%s changed since: it is now %s (version %llu)\n", key,
               idem_state_name(after->r.state), (unsigned long long)after->r.version);
    else if (moved)
        printf("%s changed since: it is now absent\n", key);
}

static int resolve_run(struct ctl *c, const struct ctl_opts *o, int action)
{
    const uint8_t *key = o->key;
    size_t klen = o->key_len;
    char shown[CTL_KEY_TEXT_CAP];
    bytes_escape(key, klen, shown, sizeof shown);
    struct ctl_record seen, now_rec;
    int found = 0, changed = 0;
    int64_t now = 0;
    if (ctl_get(c, key, klen, &seen, &found)) return CTL_FAIL;
    if (ctl_now(c, &now)) {
        if (found) ctl_record_free(&seen);
        return CTL_FAIL;
    }
    if (!found) {
        ctl_err("%s: no record (absent, or expired): nothing to resolve", shown);
        return CTL_FAIL;
    }
    char msg[512] = "";
    int rc = 0;
    if (o->has_expect && seen.r.version != o->expect_version) {
        /* The decision was made on another version: nothing is sent. */
        ctl_err("%s is at version %llu, not %llu (--expect): it changed since that version was "
                "shown; nothing was done. It is now %s; read it again (idemctl get) and decide "
                "on what is there",
                shown, (unsigned long long)seen.r.version, (unsigned long long)o->expect_version,
                idem_state_name(seen.r.state));
        rc = CTL_FAIL;
    }
    if (rc == 0) rc = resolve_precheck(o, shown, &seen.r, now);
    if (rc == 0)
        rc = ctl_resolve(c, key, klen, action, seen.r.version, o->force, msg, sizeof msg, &changed);
    if (rc && changed) {
        ctl_err("%s changed since it was read (version %llu): %s; nothing was done. What "
                "changed:",
                shown, (unsigned long long)seen.r.version, msg);
        if (ctl_get(c, key, klen, &now_rec, &found) == 0) {
            print_changes(&seen.r, &now_rec.r, found);
            ctl_record_free(&now_rec);
        }
    } else if (rc && msg[0]) {
        if (strstr(msg, "NOPERM"))
            ctl_err("resolve needs the admin role: %s", msg);
        else
            ctl_err("resolve %s %s refused: %s", shown, o->pos[1], msg);
    }
    if (rc == 0) {
        /* The decision is recorded: reported whether or not the read after it is answered. */
        int read = ctl_get(c, key, klen, &now_rec, &found) == 0;
        if (!read)
            ctl_err("%s: the decision was recorded; reading the record after it failed", shown);
        resolve_report(o, action, &seen.r, read ? &now_rec : NULL, found, now);
        ctl_record_free(&now_rec); /* zeroed by ctl_get, whatever it returned */
    }
    ctl_record_free(&seen);
    return rc;
}

int cmd_resolve(const struct ctl_opts *o)
{
    int action = action_of(o->pos[1]);
    if (!action) {
        ctl_err("resolve: action %s is not commit, release or settle", o->pos[1]);
        return CTL_USAGE;
    }
    if (!o->reason || !*o->reason) {
        ctl_err("resolve needs --reason TEXT: why, for the audit trail");
        return CTL_USAGE;
    }
    if (strlen(o->reason) > IDEM_NOTE_BYTES_MAX) {
        ctl_err("--reason is %zu bytes, over the limit of %u", strlen(o->reason),
                (unsigned)IDEM_NOTE_BYTES_MAX);
        return CTL_USAGE;
    }
    if (o->has_result && action != IDEM_RESOLVE_COMMIT) {
        ctl_err("--result goes with commit only");
        return CTL_USAGE;
    }
    /* The store's result limit is idemd's --result-max, not kept in the store: offline it is
     * given as --result-max (a larger result would be a record idemd answers past what it
     * reserves for a reply). */
    uint64_t limit = o->result_max ? o->result_max : IDEM_RESULT_BYTES_DEFAULT;
    if (o->has_result && o->dir && strlen(o->result) > limit) {
        ctl_err("--result is %zu bytes, over the store's result limit of %llu (--result-max, as "
                "idemd's)",
                strlen(o->result), (unsigned long long)limit);
        return CTL_USAGE;
    }
    if (o->result_max && !o->dir) {
        ctl_err("--result-max goes with --dir: online the limit is idemd's --result-max");
        return CTL_USAGE;
    }
    struct ctl c;
    int rc = ctl_connect(&c, o, CTL_WRITE);
    if (rc) return rc;
    return ctl_disconnect_acked(&c, resolve_run(&c, o, action));
}

/* ---- audit ---- */

static const char *state_or_absent(int s)
{
    return s ? idem_state_name(s) : "absent";
}

/* A state and its version as the audit table shows them: an absent record has no version. */
static void state_at(int s, uint64_t version, char *buf, size_t cap)
{
    if (s == 0)
        snprintf(buf, cap, "absent");
    else
        snprintf(buf, cap, "%s v%llu", state_or_absent(s), (unsigned long long)version);
}

static void audit_json(const struct ctl_audit *a, size_t n)
{
    struct jw j;
    jw_init(&j, stdout);
    jw_arr(&j);
    for (size_t i = 0; i < n; i++) {
        const idem_audit_entry *e = &a[i].e;
        fputc('\n', stdout);
        jw_obj(&j);
        jw_kuint(&j, "seq", e->seq);
        jw_ktime(&j, "at_ms", e->at_ms);
        /* Names and reasons are bytes: those that are not text go as "actor_base64" and
         * "reason_base64" (as \u00XX a reader would take them for other bytes). */
        jw_kblob_pub(&j, "actor", e->actor, strlen(e->actor));
        jw_kstr(&j, "action", e->action);
        jw_kblob_pub(&j, "key", e->key, e->key_len);
        jw_kblob_pub(&j, "reason", e->reason, strlen(e->reason));
        jw_kstr(&j, "state_before", state_or_absent(e->state_before));
        jw_kstr(&j, "state_after", state_or_absent(e->state_after));
        jw_kuint(&j, "version_before", e->version_before);
        jw_kuint(&j, "version_after", e->version_after);
        jw_key(&j, "forced");
        jw_bool(&j, (e->flags & IDEM_AUDIT_FORCED) != 0);
        jw_key(&j, "lease_lapsed");
        jw_bool(&j, (e->flags & IDEM_AUDIT_LEASE_LAPSED) != 0);
        if (e->flags & IDEM_AUDIT_RESULT) { /* its first bytes, and its whole length */
            jw_kblob_pub(&j, "result", e->result, e->result_len);
            jw_kuint(&j, "result_len", e->result_full_len);
        }
        jw_obj_end(&j);
    }
    jw_arr_end(&j);
    fputc('\n', stdout);
}

static void audit_human(const struct ctl_audit *a, size_t n, const struct ctl_opts *o)
{
    if (n == 0) {
        printf("no decisions recorded\n");
        return;
    }
    struct table *tb = table_new(8);
    table_add(tb, "SEQ", "WHEN", "WHO", "ACTION", "KEY", "BEFORE -> AFTER", "RESULT", "REASON");
    for (size_t i = 0; i < n; i++) {
        const idem_audit_entry *e = &a[i].e;
        char seq[24], when[40], key[CTL_KEY_TEXT_CAP], ch[104], reason[256], who[320], what[120];
        char before[48], after[48], res[4 * IDEM_AUDIT_RESULT_KEPT + 48];
        snprintf(seq, sizeof seq, "%llu", (unsigned long long)e->seq);
        fmt_iso(e->at_ms, when, sizeof when);
        bytes_escape(e->key, e->key_len, key, sizeof key);
        state_at(e->state_before, e->version_before, before, sizeof before);
        state_at(e->state_after, e->version_after, after, sizeof after);
        snprintf(ch, sizeof ch, "%s -> %s", before, after);
        bytes_escape(e->reason, strlen(e->reason), reason, sizeof reason);
        /* Escaped as the key and reason are: an actor comes from a name a client or $USER
         * gave, and control bytes would reach the terminal. */
        bytes_escape(e->actor, strlen(e->actor), who, sizeof who);
        bytes_escape(e->action, strlen(e->action), what, sizeof what);
        size_t wl = strlen(what);
        if (e->flags & IDEM_AUDIT_FORCED) snprintf(what + wl, sizeof what - wl, " (forced)");
        if (e->flags & IDEM_AUDIT_LEASE_LAPSED)
            snprintf(what + wl, sizeof what - wl, " (lease ran out)");
        /* The result a commit recorded or a DEL erased: "" for an empty one, - for none. */
        snprintf(res, sizeof res, "-");
        if (e->flags & IDEM_AUDIT_RESULT) {
            res[0] = '"';
            bytes_escape(e->result, e->result_len, res + 1, sizeof res - 32);
            size_t rl = strlen(res);
            if (e->result_full_len > e->result_len)
                snprintf(res + rl, sizeof res - rl, "...\" (%u bytes)", e->result_full_len);
            else
                snprintf(res + rl, sizeof res - rl, "\"");
        }
        table_add(tb, seq, when, who, what, key, ch, res, reason);
    }
    table_print(tb, stdout, 1, o->color);
    table_free(tb);
}

int cmd_audit(const struct ctl_opts *o)
{
    if (count_over(o, "audit", AUDIT_COUNT_LIMIT)) return CTL_USAGE;
    struct ctl c;
    int rc = ctl_connect(&c, o, CTL_READ);
    if (rc) return rc;
    struct ctl_audit *a = NULL;
    size_t n = 0;
    uint32_t count = o->has_count ? (uint32_t)o->count : AUDIT_COUNT_DEFAULT;
    rc = ctl_audit(&c, o->key, o->key_len, count, &a, &n);
    rc = ctl_disconnect(&c, rc);
    if (rc == 0) {
        if (o->json)
            audit_json(a, n);
        else
            audit_human(a, n, o);
        /* Said on stderr, as attention's cut: older entries went unseen without a word. */
        if (n >= count)
            fprintf(stderr,
                    "idemctl: the newest %zu entries are listed: older ones may exist (--count, "
                    "at most %u)\n",
                    n, (unsigned)AUDIT_COUNT_LIMIT);
    }
    ctl_audit_free(a, n);
    return rc;
}
