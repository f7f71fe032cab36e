/*
 * test_idemctl.c: build/idemctl run as a program ($IDEM_BUILD_DIR): usage errors and exit
 * codes; offline commands on a temporary store written through the API (status, get,
 * attention, resolve, audit, scan, verify, export/import, backup/restore, checkpoint,
 * compact, the refusal while another process holds the store), checked through --json; and
 * online commands against build/idemd started with --test-clock on its unix socket (skipped,
 * with the reason, when build/idemd is missing).
 */
#include <criterion/criterion.h>
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdarg.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "idem.h"
#include "testutil.h"

static char *dir;     /* the store */
static char *scratch; /* outputs, backups, exports */
static char out[1 << 16], err[1 << 16];

static void setup(void)
{
    dir = tu_mkdtemp("ctl-store");
    scratch = tu_mkdtemp("ctl-scratch");
}

static void teardown(void)
{
    tu_rmtree(dir);
    tu_rmtree(scratch);
}

static const char *build_dir(void)
{
    const char *b = getenv("IDEM_BUILD_DIR");
    return b ? b : ".";
}

static void slurp(const char *path, char *buf, size_t cap)
{
    FILE *f = fopen(path, "r");
    size_t n = f ? fread(buf, 1, cap - 1, f) : 0;
    buf[n] = 0;
    if (f) fclose(f);
}

/* Runs idemctl with args (a shell fragment); stdout in out, stderr in err; the exit code. */
static int ctl(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static int ctl(const char *fmt, ...)
{
    char args[12288], cmd[24576], o[4200], e[4200];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(args, sizeof args, fmt, ap);
    va_end(ap);
    snprintf(o, sizeof o, "%s/out", scratch);
    snprintf(e, sizeof e, "%s/err", scratch);
    snprintf(cmd, sizeof cmd, "timeout 60 %s/idemctl %s >%s 2>%s", build_dir(), args, o, e);
    int st = system(cmd);
    slurp(o, out, sizeof out);
    slurp(e, err, sizeof err);
    return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
}

static void claim(idem_queue *q, const char *key, uint64_t lease_ms, const char *fp,
                  idem_completion *c)
{
    idem_claim_args a = {
        .ttl_ms = 3600000, .lease_ms = lease_ms, .fp = fp, .fp_len = (uint32_t)strlen(fp)};
    cr_assert_eq(idem_claim(q, key, strlen(key), &a, c), IDEM_OK);
}

/* A claim of key in the stopped store, opened for it. */
static idem_completion claim_in_store(const char *key, uint64_t lease_ms, const char *fp)
{
    idem_store *s;
    idem_queue *q;
    idem_completion c;
    cr_assert_eq(idem_open(dir, NULL, &s), IDEM_OK, "%s", idem_last_error());
    cr_assert_eq(idem_queue_open(s, 8, &q), IDEM_OK);
    claim(q, key, lease_ms, fp, &c);
    idem_queue_close(q);
    cr_assert_eq(idem_close(s), IDEM_OK);
    return c;
}

/* order-0..9 committed ("inv-N"), late-1 in_flight with a lease that runs out at once,
 * live-1 in_flight with a long lease, held-1 in review, order-1 with a mismatch. */
static void write_store(void)
{
    idem_store *s;
    idem_queue *q;
    idem_completion c;
    idem_options o;
    idem_options_init(&o);
    o.segment_bytes = 1u << 20;
    cr_assert_eq(idem_open(dir, &o, &s), IDEM_OK, "%s", idem_last_error());
    cr_assert_eq(idem_queue_open(s, 8, &q), IDEM_OK);
    for (int i = 0; i < 10; i++) {
        char key[32], res[32];
        snprintf(key, sizeof key, "order-%d", i);
        snprintf(res, sizeof res, "inv-%d", i);
        claim(q, key, 60000, key, &c);
        cr_assert_eq(idem_commit(q, key, strlen(key), c.token, res, strlen(res)), IDEM_OK);
    }
    claim(q, "late-1", 1, "late-1", &c);
    claim(q, "live-1", 3600000, "live-1", &c);
    claim(q, "held-1", 60000, "held-1", &c);
    cr_assert_eq(idem_hold(q, "held-1", 6, c.token, "target timed out", 16), IDEM_OK);
    claim(q, "order-1", 60000, "different content", &c);
    cr_assert_eq(c.outcome, IDEM_MISMATCH);
    idem_queue_close(q);
    cr_assert_eq(idem_close(s), IDEM_OK);
    usleep(20000); /* late-1's lease (1 ms) has run out */
}

Test(idemctl, usage_errors_exit_2, .init = setup, .fini = teardown)
{
    cr_assert_eq(ctl("--help"), 0);
    cr_assert(strstr(out, "attention"), "%s", out);
    cr_assert_eq(ctl("resolve --help"), 0);
    cr_assert(strstr(out, "--reason"));
    cr_assert_eq(ctl("bogus"), 2);
    cr_assert_eq(ctl("%s", ""), 2);
    cr_assert_eq(ctl("get --dir %s", dir), 2);
    cr_assert_eq(ctl("status --older 5 --dir %s", dir), 2);
    cr_assert(strstr(err, "duration"), "%s", err);
    /* A duration's parts run from the largest unit down, each once, in lower case: 1h1h, 30s1h
     * and 1M (a minute, or a MiB?) were taken. */
    static const char *const odd[] = {"1h1h", "30s1h", "1M", "1H", "90S"};
    for (size_t i = 0; i < sizeof odd / sizeof odd[0]; i++) {
        cr_assert_eq(ctl("status --older %s --dir %s", odd[i], dir), 2, "--older %s", odd[i]);
        cr_assert(strstr(err, "not a duration"), "%s", err);
    }
    cr_assert_eq(ctl("status --older 1h30m --dir %s/none", dir), 1, "%s", err);
    /* A stopped store has no traffic to watch or measure; the view held it meanwhile, and idemd
     * could not start. */
    cr_assert_eq(ctl("watch --count 1 --dir %s", dir), 2);
    cr_assert(strstr(err, "use status --dir"), "%s", err);
    cr_assert_eq(ctl("status --window 250ms --dir %s", dir), 2);
    cr_assert(strstr(err, "has none"), "%s", err);
    /* An option given twice is refused (the second won, unseen); so are a view's interval of
     * 0 (taken as 1s) and windows past an hour (status --window 4w slept four weeks). */
    cr_assert_eq(ctl("status --dir %s --dir %s/none", dir, dir), 2);
    cr_assert(strstr(err, "--dir is given twice"), "%s", err);
    cr_assert_eq(ctl("watch --interval 0 --dir %s", dir), 2);
    cr_assert(strstr(err, "not between 100ms and 1h"), "%s", err);
    cr_assert_eq(ctl("status --window 4w --dir %s", dir), 2);
    cr_assert(strstr(err, "not between 1ms and 1h"), "%s", err);
    cr_assert_eq(ctl("resolve k release --expect 0 --reason r --dir %s", dir), 2);
    cr_assert(strstr(err, "not a record version"), "%s", err);
    /* A stray argument is named, not only the usage line printed. */
    cr_assert_eq(ctl("status -x --dir %s", dir), 2);
    cr_assert(strstr(err, "unexpected argument '-x' (options begin with --)"), "%s", err);
    cr_assert_eq(ctl("get"), 2);
    cr_assert(strstr(err, "get: an argument missing") && strstr(err, "usage: idemctl get"), "%s",
              err);
    cr_assert_eq(ctl("scan --state done --dir %s", dir), 2);
    cr_assert_eq(ctl("get k --force --dir %s", dir), 2);
    cr_assert_eq(ctl("resolve k commit --dir %s", dir), 2);
    cr_assert(strstr(err, "--reason"), "%s", err);
    cr_assert_eq(ctl("resolve k undo --reason x --dir %s", dir), 2);
    cr_assert_eq(ctl("get k --dir %s --socket /nonexistent", dir), 2);
    /* Numbers are digits alone, in range: no sign, blank or saturation. */
    cr_assert_eq(ctl("attention --count ' 5' --dir %s", dir), 2);
    cr_assert_eq(ctl("attention --count +5 --dir %s", dir), 2);
    cr_assert_eq(ctl("resolve k release --reason x --expect 99999999999999999999 --dir %s", dir),
                 2);
    cr_assert(strstr(err, "not a record version"), "%s", err);
}

Test(idemctl, status_offline_reports_attention, .init = setup, .fini = teardown)
{
    write_store();
    cr_assert_eq(ctl("status --dir %s --json", dir), 0, "%s", err);
    cr_assert(strstr(out, "\"verdict\":\"attention\""), "%s", out);
    cr_assert(strstr(out, "\"keys_review\":1"), "%s", out);
    cr_assert(strstr(out, "\"keys_in_flight\":2"), "%s", out);
    cr_assert(strstr(out, "\"index_bytes\":") && !strstr(out, "\"index_bytes\":0,"),
              "--max-memory counts the index: %s", out);
    cr_assert(strstr(out, "\"leases_run_out\":1,"), "late-1's lease ran out: %s", out);
    cr_assert_eq(ctl("status --dir %s", dir), 0);
    cr_assert(strstr(out, "attention: "), "%s", out);
    cr_assert(strstr(out, "held for review"), "%s", out);
    cr_assert(strstr(out, "1 in_flight record(s) whose lease ran out"), "%s", out);
}

/* Opens the store in dir with a queue, in durability none: a test's fill, made durable by the
 * close. */
static void open_to_fill(idem_store **s, idem_queue **q)
{
    idem_options opt;
    idem_options_init(&opt);
    opt.durability = IDEM_DURABILITY_NONE;
    cr_assert_eq(idem_open(dir, &opt, s), IDEM_OK, "%s", idem_last_error());
    cr_assert_eq(idem_queue_open(*s, 8, q), IDEM_OK);
}

/* Offline, the attention list is bounded as idemd's reply is: records with recorded mismatches
 * keep their results (64 KiB each here) until they expire, and 1,100 of them took 70 MB,
 * held twice (the queue's and idemctl's copies), where a --count of 100,000 could take GBs. The
 * list ends at 64 MiB, and says so. */
Test(idemctl, an_offline_attention_list_is_bounded_in_bytes, .init = setup, .fini = teardown)
{
    idem_store *s;
    idem_queue *q;
    idem_completion c;
    open_to_fill(&s, &q);
    static uint8_t v[IDEM_RESULT_BYTES_DEFAULT];
    uint64_t x = 88172645463325252ull;
    for (int i = 0; i < 1100; i++) {
        char key[32];
        snprintf(key, sizeof key, "big-%d", i);
        for (size_t j = 0; j < sizeof v; j++) { /* bytes lz4 cannot shrink */
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            v[j] = (uint8_t)x;
        }
        claim(q, key, 60000, "a", &c);
        cr_assert_eq(c.outcome, IDEM_NEW);
        cr_assert_eq(idem_commit(q, key, strlen(key), c.token, v, sizeof v), IDEM_OK);
        claim(q, key, 60000, "b", &c);
        cr_assert_eq(c.outcome, IDEM_MISMATCH);
    }
    cr_assert_eq(idem_sync(s), IDEM_OK);
    idem_queue_close(q);
    cr_assert_eq(idem_close(s), IDEM_OK);
    cr_assert_eq(ctl("attention --count 5000 --dir %s", dir), 0, "%s", err);
    cr_assert(strstr(err, "the list ends at 64 MiB"), "%s", err);
    cr_assert(strstr(out, "big-"), "%.200s", out);
}

/* A lease that ran out is a worker that died or hung with its key: not healthy, though nothing
 * else is amiss (status said "healthy" while attention listed the record). */
Test(idemctl, status_counts_leases_that_ran_out, .init = setup, .fini = teardown)
{
    idem_store *s;
    idem_queue *q;
    idem_completion c;
    cr_assert_eq(idem_open(dir, NULL, &s), IDEM_OK, "%s", idem_last_error());
    cr_assert_eq(idem_queue_open(s, 8, &q), IDEM_OK);
    claim(q, "live-1", 3600000, "live-1", &c);
    idem_queue_close(q);
    cr_assert_eq(idem_close(s), IDEM_OK);
    cr_assert_eq(ctl("status --dir %s --json", dir), 0, "%s", err);
    cr_assert(strstr(out, "\"verdict\":\"healthy\"") && strstr(out, "\"leases_run_out\":0,"),
              "a running lease: %s", out);
    cr_assert_eq(idem_open(dir, NULL, &s), IDEM_OK, "%s", idem_last_error());
    cr_assert_eq(idem_queue_open(s, 8, &q), IDEM_OK);
    claim(q, "late-1", 1, "late-1", &c);
    claim(q, "late-2", 1, "late-2", &c);
    idem_queue_close(q);
    cr_assert_eq(idem_close(s), IDEM_OK);
    usleep(20000); /* their leases (1 ms) have run out */
    cr_assert_eq(ctl("status --dir %s --json", dir), 0, "%s", err);
    cr_assert(strstr(out, "\"verdict\":\"attention\"") && strstr(out, "\"leases_run_out\":2,") &&
                  strstr(out, "2 in_flight record(s) whose lease ran out"),
              "%s", out);
}

Test(idemctl, get_shows_the_whole_record, .init = setup, .fini = teardown)
{
    write_store();
    cr_assert_eq(ctl("get order-1 --dir %s --json", dir), 0, "%s", err);
    cr_assert(strstr(out, "\"state\":\"committed\""), "%s", out);
    cr_assert(strstr(out, "\"result\":\"inv-1\""), "%s", out);
    cr_assert(strstr(out, "\"mismatch_count\":1"), "%s", out);
    cr_assert(strstr(out, "\"first_seen_iso\":\""), "%s", out);
    cr_assert(strstr(out, "\"expires_in_ms\":"), "%s", out);
    cr_assert_eq(ctl("get order-1 --dir %s", dir), 0);
    cr_assert(strstr(out, "inv-1") && strstr(out, "ago"), "%s", out);
    cr_assert_eq(ctl("get nope --dir %s", dir), 1);
    cr_assert(strstr(err, "no record"), "%s", err);
}

Test(idemctl, attention_lists_what_needs_a_person_by_urgency, .init = setup, .fini = teardown)
{
    write_store();
    cr_assert_eq(ctl("attention --dir %s --json", dir), 0, "%s", err);
    char *held = strstr(out, "\"key\":\"held-1\""), *late = strstr(out, "\"key\":\"late-1\"");
    char *mis = strstr(out, "\"key\":\"order-1\"");
    cr_assert(held && late && mis, "%s", out);
    cr_assert(held < late && late < mis, "not by urgency: %s", out);
    cr_assert_null(strstr(out, "\"key\":\"live-1\""), "a running lease is not listed: %s", out);
    cr_assert(strstr(out, "fix the source"), "%s", out);
    cr_assert(strstr(out, "check the target by key"), "%s", out);
    cr_assert_eq(ctl("attention --older 1ms --dir %s --json", dir), 0);
    cr_assert(strstr(out, "\"key\":\"live-1\""), "--older lists long in_flight: %s", out);
    cr_assert_eq(ctl("attention --dir %s", dir), 0);
    cr_assert(strstr(out, "NEXT STEP") && strstr(out, "held-1"), "%s", out);
    cr_assert_null(strstr(err, "more may need attention"), "%s", err);
    /* A list cut to --count says so (on stderr: the list stays as scripts read it). */
    cr_assert_eq(ctl("attention --count 2 --dir %s --json", dir), 0);
    cr_assert(strstr(out, "\"key\":\"held-1\"") && !strstr(out, "\"key\":\"order-1\""), "%s", out);
    cr_assert(strstr(err, "the 2 most urgent records are listed: more may need attention"), "%s",
              err);
    /* An in_flight record listed for a mismatch while its lease runs is a mismatch, not a long
     * in_flight one to resolve with --force under a working holder. */
    claim_in_store("live-2", 3600000, "live-2");
    cr_assert_eq(claim_in_store("live-2", 3600000, "other content").outcome, IDEM_MISMATCH);
    cr_assert_eq(ctl("attention --dir %s --json", dir), 0, "%s", err);
    char *live = strstr(out, "\"key\":\"live-2\"");
    cr_assert(live, "%s", out);
    char *row = live;
    while (row > out && strncmp(row, "{\"why\"", strlen("{\"why\"")) != 0)
        row--;
    cr_assert(strncmp(row, "{\"why\":\"mismatch\"", strlen("{\"why\":\"mismatch\"")) == 0, "%.300s",
              row);
    char *fix = strstr(row, "fix the source");
    cr_assert(strstr(row, "a worker holds the key") && !strstr(row, "--force") && fix && fix < live,
              "%.400s", row);
}

Test(idemctl, resolve_is_checked_and_audited, .init = setup, .fini = teardown)
{
    write_store();
    cr_assert_eq(ctl("resolve order-2 settle --reason x --dir %s", dir), 1);
    cr_assert(strstr(err, "already committed"), "%s", err);
    cr_assert_eq(ctl("resolve live-1 release --reason x --dir %s", dir), 1);
    cr_assert(strstr(err, "--force"), "%s", err);
    static char reason[4098];
    memset(reason, 'r', 4097);
    cr_assert_eq(ctl("resolve held-1 release --reason %s --dir %s", reason, dir), 2);
    cr_assert(strstr(err, "--reason is 4097 bytes, over the limit of 4096"), "%s", err);
    cr_assert_eq(ctl("resolve held-1 commit --reason 'target shows INV-9' --result INV-9 --dir "
                     "%s --json",
                     dir),
                 0, "%s", err);
    cr_assert(strstr(out, "\"after\":{") && strstr(out, "\"result\":\"INV-9\""), "%s", out);
    /* Who acts is the effective uid and its name, not $USER (anyone sets it). */
    setenv("USER", "mallory", 1);
    cr_assert_eq(ctl("resolve late-1 release --reason 'not charged' --dir %s", dir), 0, "%s", err);
    unsetenv("USER");
    cr_assert(strstr(out, "released"), "%s", out);
    cr_assert_eq(ctl("resolve live-1 settle --force --reason stuck --dir %s", dir), 0, "%s", err);
    cr_assert_eq(ctl("audit --dir %s --json", dir), 0, "%s", err);
    char *a = strstr(out, "resolve-settle"), *b = strstr(out, "resolve-release");
    char *c = strstr(out, "resolve-commit");
    cr_assert(a && b && c && a < b && b < c, "newest first: %s", out);
    char actor[64];
    snprintf(actor, sizeof actor, "\"actor\":\"offline:uid=%u(", (unsigned)geteuid());
    cr_assert(strstr(out, "target shows INV-9") && strstr(out, actor), "%s", out);
    cr_assert(!strstr(out, "mallory"), "the audit named $USER: %s", out);
    cr_assert_eq(ctl("audit held-1 --dir %s", dir), 0);
    cr_assert(strstr(out, "review v") && !strstr(out, "late-1"), "%s", out);
    cr_assert(!strstr(err, "older ones may exist"), "%s", err);
    /* A list cut to --count says so (older entries went unseen without a word). */
    cr_assert_eq(ctl("audit --count 2 --dir %s --json", dir), 0, "%s", err);
    cr_assert(strstr(out, "resolve-settle") && !strstr(out, "resolve-commit"), "%s", out);
    cr_assert(strstr(err, "the newest 2 entries are listed: older ones may exist"), "%s", err);
    /* A released record is absent, with no version to show. */
    cr_assert_eq(ctl("audit late-1 --dir %s", dir), 0);
    cr_assert(strstr(out, "-> absent ") && !strstr(out, "absent v"), "%s", out);
}

/* The result limit is idemd's setting (--result-max), not kept in the store: offline it is
 * given as --result-max; a decision's result longer than the default 64 KiB used to be
 * refused as "invalid argument" whatever the store's idemd took. */
Test(idemctl, resolve_offline_takes_a_result_over_the_default_limit, .init = setup,
     .fini = teardown)
{
    write_store();
    char path[4200];
    snprintf(path, sizeof path, "%s/big-result", scratch);
    FILE *f = fopen(path, "w");
    cr_assert_not_null(f);
    for (int i = 0; i < 100 * 1024; i++)
        fputc('a' + i % 26, f);
    fclose(f);
    cr_assert_eq(ctl("resolve held-1 commit --reason 'target shows it' --result \"$(cat %s)\" "
                     "--dir %s",
                     path, dir),
                 2, "over the default limit without --result-max");
    cr_assert(strstr(err, "102400 bytes, over the store's result limit of 65536 (--result-max"),
              "%s", err);
    cr_assert_eq(ctl("resolve held-1 commit --reason 'target shows it' --result \"$(cat %s)\" "
                     "--result-max 128k --dir %s",
                     path, dir),
                 0, "%s", err);
    idem_store *s;
    idem_queue *q;
    idem_completion g;
    cr_assert_eq(idem_open(dir, NULL, &s), IDEM_OK, "%s", idem_last_error());
    cr_assert_eq(idem_queue_open(s, 8, &q), IDEM_OK);
    cr_assert_eq(idem_get(q, "held-1", 6, &g), IDEM_OK);
    cr_assert(g.found && g.record.state == IDEM_STATE_COMMITTED);
    cr_assert_eq(g.record.result_len, 100 * 1024);
    cr_assert_eq(((const char *)g.record.result)[100 * 1024 - 1], 'a' + (100 * 1024 - 1) % 26);
    idem_queue_close(q);
    cr_assert_eq(idem_close(s), IDEM_OK);
}

/* resolve --expect acts only on the version the operator checked the target for: a record
 * that moved on since (late-1 recovered by a reconciler, its version bumped) is refused, with
 * what it is now, and nothing is done; at the version it is at, the decision goes through. */
static unsigned long long version_shown(const char *key)
{
    cr_assert_eq(ctl("get %s --dir %s --json", key, dir), 0, "%s", err);
    const char *v = strstr(out, "\"version\":");
    cr_assert_not_null(v, "%s", out);
    return strtoull(v + 10, NULL, 10);
}

Test(idemctl, resolve_expect_acts_only_on_the_version_checked, .init = setup, .fini = teardown)
{
    write_store();
    unsigned long long shown = version_shown("late-1");
    cr_assert_eq(claim_in_store("late-1", 60000, "late-1").outcome, IDEM_RECOVER);
    cr_assert_eq(ctl("resolve late-1 release --expect %llu --force --reason 'checked at v%llu' "
                     "--dir %s",
                     shown, shown, dir),
                 1, "a decision on an old version went through");
    cr_assert(strstr(err, "not ") && strstr(err, "(--expect)") && strstr(err, "nothing was done") &&
                  strstr(err, "It is now in_flight"),
              "%s", err);
    cr_assert_eq(ctl("audit late-1 --dir %s --json", dir), 0, "%s", err);
    cr_assert_null(strstr(out, "checked at v"), "%s", out);
    unsigned long long now = version_shown("late-1");
    cr_assert_gt(now, shown);
    cr_assert_eq(ctl("resolve late-1 release --expect %llu --force --reason 'not charged' --dir %s",
                     now, dir),
                 0, "%s", err);
    cr_assert_eq(ctl("audit late-1 --dir %s --json", dir), 0, "%s", err);
    cr_assert(strstr(out, "not charged"), "%s", out);
    cr_assert_eq(ctl("resolve held-1 release --expect 0 --reason x --dir %s", dir), 2);
}

/* Resolves held-1 (release) offline as root run by sudo from user (SUDO_USER, which the audit
 * names beside the uid); returns idemctl's exit code. Skips the test unless run as root. */
static int resolve_held_as(const char *user)
{
    if (geteuid() != 0) cr_skip_test("the sudo caller is named only where root runs idemctl");
    cr_assert_eq(setenv("SUDO_USER", user, 1), 0);
    int rc = ctl("resolve held-1 release --reason checked --dir %s", dir);
    unsetenv("SUDO_USER");
    return rc;
}

/* The audit table escapes who acted as it does keys and reasons: an actor comes from a name a
 * client or sudo's caller gave, and a control byte in it would reach the operator's terminal. */
Test(idemctl, audit_escapes_the_actor, .init = setup, .fini = teardown)
{
    write_store();
    cr_assert_eq(resolve_held_as("eve\x1b[2J"), 0, "%s", err);
    cr_assert_eq(ctl("audit --dir %s", dir), 0, "%s", err);
    cr_assert_null(strchr(out, '\x1b'), "a raw escape byte in the table: %s", out);
    cr_assert(strstr(out, "offline:uid=0(root),sudo=eve\\x1b[2J@"), "%s", out);
}

/* An offline actor over the audit trail's limit is named before the store is opened; it was
 * refused as "invalid argument". */
Test(idemctl, an_offline_actor_over_the_limit_is_named, .init = setup, .fini = teardown)
{
    write_store();
    char longer[301];
    memset(longer, 'u', 300);
    longer[300] = 0;
    cr_assert_eq(resolve_held_as(longer), 1);
    cr_assert(strstr(err, "over the limit of 256") && strstr(err, "sudo=uuu"), "%s", err);
    cr_assert_eq(ctl("get held-1 --dir %s --json", dir), 0, "%s", err);
    cr_assert(strstr(out, "\"state\":\"review\""), "nothing was done: %s", out);
}

Test(idemctl, scan_lists_keys_for_scripts, .init = setup, .fini = teardown)
{
    write_store();
    cr_assert_eq(ctl("scan --state in_flight --dir %s", dir), 0, "%s", err);
    cr_assert(strstr(out, "late-1\n") && strstr(out, "live-1\n") && !strstr(out, "order-"), "%s",
              out);
    cr_assert_eq(ctl("scan --dir %s --json", dir), 0);
    cr_assert(out[0] == '[' && strstr(out, "\"order-9\""), "%s", out);
}

Test(idemctl, verify_finds_a_flipped_bit_and_changes_nothing, .init = setup, .fini = teardown)
{
    write_store();
    cr_assert_eq(ctl("verify %s", dir), 0, "%s%s", out, err);
    cr_assert(strstr(out, "sound"), "%s", out);
    char path[4096];
    snprintf(path, sizeof path, "%s/super", dir);
    FILE *f = fopen(path, "r+b");
    cr_assert_not_null(f);
    fseek(f, 30, SEEK_SET);
    int ch = fgetc(f);
    fseek(f, 30, SEEK_SET);
    fputc(ch ^ 4, f);
    fclose(f);
    cr_assert_eq(ctl("verify --dir %s --json", dir), 1);
    cr_assert(strstr(out, "\"verdict\":\"faults\"") && strstr(out, "super"), "%s", out);
    cr_assert_eq(ctl("verify %s --socket x", dir), 2);
}

static int in_scratch(const char *rel);

Test(idemctl, store_held_by_a_process_is_refused, .init = setup, .fini = teardown)
{
    write_store();
    idem_store *s;
    cr_assert_eq(idem_open(dir, NULL, &s), IDEM_OK);
    cr_assert_eq(ctl("status --dir %s", dir), 1);
    cr_assert(strstr(err, "pid=") && strstr(err, "host="), "%s", err);
    cr_assert_eq(ctl("verify %s", dir), 1);
    cr_assert(strstr(err, "pid="), "%s", err);
    cr_assert_eq(ctl("restore %s %s/r", dir, scratch), 1,
                 "a copy of a store that changes under it");
    cr_assert(strstr(err, "pid="), "%s", err);
    cr_assert(!in_scratch("r") && !in_scratch("r.partial"));
    cr_assert_eq(idem_close(s), IDEM_OK);
}

/* Inspections share the lock and leave the lock file as it is (it names the last owner); a
 * writer waits for them to end, and is told that readers hold the store. */
Test(idemctl, inspections_share_the_store_and_a_writer_waits_for_them, .init = setup,
     .fini = teardown)
{
    write_store();
    char path[4200], before[512], after[512];
    snprintf(path, sizeof path, "%s/LOCK", dir);
    slurp(path, before, sizeof before);
    idem_options o;
    idem_options_init(&o);
    o.read_only = 1;
    idem_store *s;
    cr_assert_eq(idem_open(dir, &o, &s), IDEM_OK, "%s", idem_last_error());
    cr_assert_eq(ctl("status --dir %s", dir), 0, "a second inspection: %s", err);
    cr_assert_eq(ctl("verify %s", dir), 0, "verify beside an inspection: %s", err);
    cr_assert_eq(ctl("resolve held-1 release --reason r --dir %s", dir), 1);
    cr_assert(strstr(err, "being read by another process"), "%s", err);
    cr_assert(!strstr(err, "idemd"), "no idemd holds it: %s", err);
    cr_assert_eq(idem_close(s), IDEM_OK);
    slurp(path, after, sizeof after);
    cr_assert_str_eq(after, before, "an inspection rewrote the lock file");
    cr_assert_eq(ctl("resolve held-1 release --reason r --dir %s", dir), 0, "%s", err);
}

/* A backup that fails verification is not restored: nothing is left at dest. */
Test(idemctl, a_damaged_backup_is_not_restored, .init = setup, .fini = teardown)
{
    write_store();
    cr_assert_eq(ctl("backup %s/b --dir %s", scratch, dir), 0, "%s", err);
    char p[8600];
    snprintf(p, sizeof p,
             "f=$(ls %s/b/index-*.ckpt) && printf '\\377' | dd of=$f bs=1 seek=4200 "
             "conv=notrunc status=none",
             scratch); /* a byte of the checkpoint's first chunk */
    cr_assert_eq(system(p), 0);
    cr_assert_eq(ctl("restore %s/b %s/r", scratch, scratch), 1, "a damaged backup was restored");
    cr_assert(strstr(err, "fails verification"), "%s", err);
    cr_assert(!in_scratch("r") && !in_scratch("r.partial"));
}

/* idemctl export of the store into scratch/exp.jsonl (the export also stays in out). */
static void export_to_file(void)
{
    cr_assert_eq(ctl("export --dir %s", dir), 0, "%s", err);
    char path[4200];
    snprintf(path, sizeof path, "%s/exp.jsonl", scratch);
    FILE *f = fopen(path, "w");
    cr_assert_not_null(f);
    fputs(out, f);
    fclose(f);
}

/* Found by a review of idemctl: JSON output wrote every well-formed UTF-8 character raw, the
 * C1 controls and direction overrides among them: a client's key holding U+009B (a CSI) then
 * drove the terminal of an operator running export. They are written as JSON's
 * escapes, which read back as the same bytes. */
Test(idemctl, json_output_escapes_characters_a_terminal_acts_on, .init = setup, .fini = teardown)
{
    static const char key[] = "k\xc2\x9b"
                              "2J\xe2\x80\xae"
                              "gnp.exe\xe2\x81\xa6";
    idem_store *s;
    idem_queue *q;
    idem_completion c;
    cr_assert_eq(idem_open(dir, NULL, &s), IDEM_OK, "%s", idem_last_error());
    cr_assert_eq(idem_queue_open(s, 8, &q), IDEM_OK);
    claim(q, key, 60000, "fp", &c);
    cr_assert_eq(idem_commit(q, key, sizeof key - 1, c.token, "r\xc2\x85", 3), IDEM_OK);
    idem_queue_close(q);
    cr_assert_eq(idem_close(s), IDEM_OK);
    export_to_file();
    cr_assert(strstr(out, "\\u009b2J\\u202egnp.exe\\u2066") && strstr(out, "\"r\\u0085\""), "%s",
              out);
    cr_assert(!strstr(out, "\xc2\x9b") && !strstr(out, "\xe2\x80\xae") && !strstr(out, "\xc2\x85"),
              "raw bytes in the export");
    char to[4200];
    snprintf(to, sizeof to, "%s/copy", scratch);
    cr_assert_eq(ctl("import %s/exp.jsonl --dir %s", scratch, to), 0, "%s", err);
    cr_assert_eq(idem_open(to, NULL, &s), IDEM_OK, "%s", idem_last_error());
    cr_assert_eq(idem_queue_open(s, 8, &q), IDEM_OK);
    cr_assert_eq(idem_get(q, key, sizeof key - 1, &c), IDEM_OK);
    cr_assert(c.found && c.record.result_len == 3 && memcmp(c.record.result, "r\xc2\x85", 3) == 0,
              "the key or its result came back changed");
    idem_queue_close(q);
    cr_assert_eq(idem_close(s), IDEM_OK);
}

Test(idemctl, export_import_round_trip, .init = setup, .fini = teardown)
{
    write_store();
    cr_assert_eq(ctl("resolve held-1 release --reason checked --dir %s", dir), 0, "%s", err);
    export_to_file();
    cr_assert(strstr(out, "\"type\":\"record\"") && strstr(out, "\"type\":\"audit\""), "%s", out);
    cr_assert_eq(ctl("import %s/exp.jsonl --dir %s/copy", scratch, scratch), 0, "%s", err);
    cr_assert(strstr(out, "imported 12 records and 1 audit entries"), "%s", out);
    cr_assert_eq(ctl("get order-1 --dir %s/copy --json", scratch), 0, "%s", err);
    cr_assert(strstr(out, "\"result\":\"inv-1\"") && strstr(out, "\"mismatch_count\":1"), "%s",
              out);
    cr_assert_eq(ctl("audit --dir %s/copy --json", scratch), 0);
    cr_assert(strstr(out, "resolve-release"), "%s", out);
    cr_assert_eq(ctl("import %s/nope.jsonl --dir %s/copy", scratch, scratch), 1);
}

/* An entry's flags and result (found by a review of the claim rules: the trail kept neither FORCE
 * nor the outcome recorded) are shown by audit, and an export carries them to an import. */
Test(idemctl, audit_flags_and_results_are_shown_exported_and_imported, .init = setup,
     .fini = teardown)
{
    write_store();
    cr_assert_eq(ctl("resolve live-1 commit --force --result INV-9 --reason paid --dir %s", dir), 0,
                 "%s", err);
    char big[301];
    memset(big, 'x', 300);
    big[300] = 0;
    cr_assert_eq(ctl("resolve late-1 commit --result %s --reason seen --dir %s", big, dir), 0, "%s",
                 err);
    cr_assert_eq(ctl("audit --dir %s", dir), 0, "%s", err);
    cr_assert(strstr(out, "resolve-commit (forced)") && strstr(out, "\"INV-9\""), "%s", out);
    cr_assert(strstr(out, "resolve-commit (lease ran out)") && strstr(out, "...\" (300 bytes)"),
              "%s", out);
    export_to_file();
    cr_assert(strstr(out, "\"flags\":5,\"result\":\"INV-9\",\"result_len\":5"), "%s", out);
    cr_assert_eq(ctl("import %s/exp.jsonl --dir %s/copy", scratch, scratch), 0, "%s", err);
    cr_assert_eq(ctl("audit --dir %s/copy --json", scratch), 0, "%s", err);
    cr_assert(strstr(out, "\"forced\":true,\"lease_lapsed\":false,\"result\":\"INV-9\""), "%s",
              out);
    cr_assert(strstr(out, "\"forced\":false,\"lease_lapsed\":true"), "%s", out);
    cr_assert(strstr(out, "\"result_len\":300"), "%s", out);
    /* Flags this build does not know, or a result whose lengths disagree, are refused by line. */
    char path[4200];
    snprintf(path, sizeof path, "%s/bad.jsonl", scratch);
    const char *bad[] = {"\"flags\":8", "\"flags\":4,\"result\":\"ab\",\"result_len\":3",
                         "\"flags\":0,\"result\":\"ab\",\"result_len\":2"};
    const char *field[] = {"field flags", "field result", "field result"};
    for (int i = 0; i < 3; i++) {
        FILE *f = fopen(path, "w");
        cr_assert_not_null(f);
        fprintf(f,
                "{\"type\":\"export\",\"format\":2,\"token_next\":9}\n"
                "{\"type\":\"audit\",\"seq\":1,\"at_ms\":5,\"actor\":\"a\",\"action\":"
                "\"del\",\"key\":\"k\",\"reason\":\"\",%s}\n"
                "{\"type\":\"end\",\"records\":0,\"audit_entries\":1}\n",
                bad[i]);
        fclose(f);
        cr_assert_eq(ctl("import %s --dir %s/bad%d", path, scratch, i), 1, "%s", bad[i]);
        cr_assert(strstr(err, ":2:") && strstr(err, field[i]), "%s: %s", bad[i], err);
    }
}

/* Found by a review of export and import: an export carried only the tokens live records hold,
 * so the imported store handed out again, from its first claim, tokens the source store had
 * given to keys since released: a worker still holding one (its lease run out, the key released
 * by an operator) could commit over the next worker's claim. The export now carries the store's
 * token_next, and the import's store hands out tokens above it; the import also counts in the
 * store's generation, as documented. */
Test(idemctl, an_import_never_hands_out_a_token_the_source_store_handed_out, .init = setup,
     .fini = teardown)
{
    /* Each open reserves a block of tokens ahead: after a few opens the source's claim gets a
     * token far above the imported record's, and above what the store the import makes reserves
     * at its own reopen. */
    claim_in_store("charge-a", 60000, "x");
    for (int i = 0; i < 3; i++) {
        idem_store *s0;
        cr_assert_eq(idem_open(dir, NULL, &s0), IDEM_OK, "%s", idem_last_error());
        cr_assert_eq(idem_close(s0), IDEM_OK);
    }
    idem_completion first = claim_in_store("charge-1", 60000, "x");
    cr_assert_eq(first.outcome, IDEM_NEW);
    cr_assert_eq(ctl("resolve charge-1 release --reason stalled --force --dir %s", dir), 0, "%s",
                 err);
    export_to_file();
    cr_assert_eq(ctl("import %s/exp.jsonl --dir %s/copy", scratch, scratch), 0, "%s", err);
    char copy[4200];
    snprintf(copy, sizeof copy, "%s/copy", scratch);
    idem_store *s;
    idem_queue *q;
    idem_completion c;
    cr_assert_eq(idem_open(copy, NULL, &s), IDEM_OK, "%s", idem_last_error());
    cr_assert_eq(idem_queue_open(s, 8, &q), IDEM_OK);
    claim(q, "charge-1", 60000, "x", &c);
    cr_assert_eq(c.outcome, IDEM_NEW);
    cr_assert_gt(c.token, first.token, "token %lld handed out again", (long long)c.token);
    idem_stats st;
    idem_get_stats(s, &st);
    cr_assert_eq(st.store_generation, 2);
    idem_queue_close(q);
    cr_assert_eq(idem_close(s), IDEM_OK);
    /* A field that is not a token is refused by name; an export from before it is imported. */
    char cmd[9000];
    snprintf(cmd, sizeof cmd,
             "sed 's/\"token_next\":[0-9]*/\"token_next\":-3/' %s/exp.jsonl > %s/bad.jsonl",
             scratch, scratch);
    cr_assert_eq(system(cmd), 0);
    cr_assert_eq(ctl("import %s/bad.jsonl --dir %s/copy-2", scratch, scratch), 1);
    cr_assert(strstr(err, "token_next"), "%s", err);
    snprintf(cmd, sizeof cmd, "sed 's/,\"token_next\":[0-9]*//' %s/exp.jsonl > %s/old.jsonl",
             scratch, scratch);
    cr_assert_eq(system(cmd), 0);
    cr_assert_eq(ctl("import %s/old.jsonl --dir %s/copy-3", scratch, scratch), 0, "%s", err);
}

/* A number outside its field's range is a bad line, not cut to fit: attempts 2^32 + 1 was
 * imported as 1, a state of 2^32 + 2 as 2. So is a field of the wrong type (a review found a
 * numeric result imported as an empty one, a numeric fingerprint dropped, so that a repeat with
 * other content answered done, not mismatch), and a field the store refuses is named (it said
 * only "invalid argument"): a first_seen of 0, an in_flight record without a token. */
Test(idemctl, import_refuses_a_number_out_of_its_fields_range, .init = setup, .fini = teardown)
{
    write_store();
    cr_assert_eq(ctl("resolve held-1 release --reason checked --dir %s", dir), 0, "%s", err);
    export_to_file();
    static const char *const edits[] = {
        "s/\"attempts\":[0-9]*/\"attempts\":4294967297/",
        "s/\"state_after\":[0-9]*/\"state_after\":4294967298/",
        "s/\"seen_count\":[0-9]*/\"seen_count\":-1/",
        "s/\"fingerprint\":\"[0-9a-f]*\"/\"fingerprint\":\"-1-1-1-1-1-1-1-1-1-1-1-1-1-1-1-1\"/",
        "s/\"result\":\"inv-1\"/\"result\":123/",
        "s/\"fingerprint\":\"[0-9a-f]*\"/\"fingerprint\":7/",
        "s/\"first_seen_ms\":[0-9]*/\"first_seen_ms\":0/",
        "/\"state\":\"in_flight\"/s/\"token\":[0-9]*/\"token\":0/",
        "s/\"action\":\"[^\"]*\"/\"action\":3/"};
    static const char *const names[] = {"attempts",      "state_after", "seen_count",
                                        "fingerprint",   "result",      "fingerprint",
                                        "first_seen_ms", "field token", "action"};
    for (size_t i = 0; i < sizeof edits / sizeof edits[0]; i++) {
        char cmd[9000];
        snprintf(cmd, sizeof cmd, "sed '%s' %s/exp.jsonl > %s/bad.jsonl", edits[i], scratch,
                 scratch);
        cr_assert_eq(system(cmd), 0);
        cr_assert_eq(ctl("import %s/bad.jsonl --dir %s/copy-%zu", scratch, scratch, i), 1, "%s",
                     names[i]);
        cr_assert(strstr(err, names[i]), "%s: %s", names[i], err);
    }
}

/* Found by a review of idemctl: an audit entry's field lengths were checked by the store only
 * when entries went to it, 256 at a time, so a bad file held that many copies of lines of up to
 * 7 MiB first (1.5 GiB), and a line after them that was bad in another way was refused first.
 * Each line is checked as it is read: refused by its number and field. */
Test(idemctl, import_refuses_an_audit_entry_past_its_limits_at_its_line, .init = setup,
     .fini = teardown)
{
    write_store();
    cr_assert_eq(ctl("resolve held-1 release --reason checked --dir %s", dir), 0, "%s", err);
    export_to_file();
    static char long_reason[IDEM_NOTE_BYTES_MAX + 2], long_actor[IDEM_ACTOR_BYTES_MAX + 2];
    memset(long_reason, 'r', sizeof long_reason - 1);
    memset(long_actor, 'a', sizeof long_actor - 1);
    char edit[3][IDEM_NOTE_BYTES_MAX + 200];
    snprintf(edit[0], sizeof edit[0], "s/\"reason\":\"checked\"/\"reason\":\"%s\"/", long_reason);
    snprintf(edit[1], sizeof edit[1],
             "/\"type\":\"audit\"/s/\"actor\":\"[^\"]*\"/\"actor\":\"%s\"/", long_actor);
    snprintf(edit[2], sizeof edit[2], "/\"type\":\"audit\"/s/\"key\":\"[^\"]*\"/\"key\":\"\"/");
    static const char *const names[] = {"field reason", "field actor", "field key"};
    for (int i = 0; i < 3; i++) {
        static char cmd[sizeof edit[0] + 2 * 4200 + 200];
        char want[64];
        int n = snprintf(cmd, sizeof cmd, "sed '%s' %s/exp.jsonl > %s/bad.jsonl", edit[i], scratch,
                         scratch);
        cr_assert(n > 0 && (size_t)n < sizeof cmd);
        cr_assert_eq(system(cmd), 0);
        /* the number of the (first) audit line */
        snprintf(cmd, sizeof cmd,
                 "grep -n '\"type\":\"audit\"' %s/bad.jsonl | head -1 | cut -d: -f1", scratch);
        FILE *p = popen(cmd, "r");
        cr_assert_not_null(p);
        int line = 0;
        cr_assert_eq(fscanf(p, "%d", &line), 1);
        pclose(p);
        /* A broken line after it: read before the store saw the entry, it was the one named. */
        snprintf(cmd, sizeof cmd, "sed -i '%da {broken' %s/bad.jsonl", line, scratch);
        cr_assert_eq(system(cmd), 0);
        snprintf(want, sizeof want, "bad.jsonl:%d: ", line);
        cr_assert_eq(ctl("import %s/bad.jsonl --dir %s/copy-%d", scratch, scratch, i), 1, "%s",
                     names[i]);
        cr_assert(strstr(err, want) && strstr(err, names[i]), "%s at %s: %s", names[i], want, err);
    }
}

/* Found by a review of import: a line had no bound (read whole, and each string in it reserved
 * the rest of the line), so one huge line took memory without limit. A line longer than any
 * export writes is refused by number, and nothing is imported. */
Test(idemctl, an_import_line_longer_than_any_export_writes_is_refused, .init = setup,
     .fini = teardown)
{
    char path[4200];
    snprintf(path, sizeof path, "%s/big.jsonl", scratch);
    FILE *f = fopen(path, "w");
    cr_assert_not_null(f);
    fputs("{\"type\":\"export\",\"format\":2}\n{\"type\":\"record\",\"key\":\"", f);
    for (int i = 0; i < 8 << 20; i++)
        fputc('a', f);
    fputs("\"}\n", f);
    fclose(f);
    cr_assert_eq(ctl("import %s --dir %s/copy", path, scratch), 1);
    cr_assert(strstr(err, "big.jsonl:2") && strstr(err, "longer than"), "%s", err);
    cr_assert_neq(access(path, F_OK), -1);
    char copy[4200];
    snprintf(copy, sizeof copy, "%s/copy", scratch);
    cr_assert_eq(access(copy, F_OK), -1, "a refused import left a store");
}

/* JSON output is strict UTF-8: a key holding an encoded surrogate (not UTF-8, though it has
 * its shape) goes as key_base64, not raw. A reason that is not text goes as reason_base64 and an
 * import gives the same bytes back (it used to come back as the code points of its bytes). */
Test(idemctl, json_is_strict_utf8_and_an_import_keeps_a_reasons_bytes, .init = setup,
     .fini = teardown)
{
    static const char key[9] = {'s', 'u', 'r', (char)0xed, (char)0xa0, (char)0x80, 'k', 'e', 'y'};
    idem_store *s;
    idem_queue *q;
    idem_completion c;
    cr_assert_eq(idem_open(dir, NULL, &s), IDEM_OK, "%s", idem_last_error());
    cr_assert_eq(idem_queue_open(s, 8, &q), IDEM_OK);
    idem_claim_args a = {.ttl_ms = 3600000, .lease_ms = 1};
    cr_assert_eq(idem_claim(q, key, sizeof key, &a, &c), IDEM_OK);
    idem_queue_close(q);
    cr_assert_eq(idem_close(s), IDEM_OK);
    usleep(20000); /* the lease has run out: resolve needs no --force */
    cr_assert_eq(ctl("scan --dir %s --json", dir), 0, "%s", err);
    cr_assert(strstr(out, "{\"key_base64\":\"c3Vy7aCAa2V5\"}"), "%s", out);
    cr_assert_eq(ctl("resolve c3Vy7aCAa2V5 release --key-base64 --reason \"$(printf 'r\\377')\" "
                     "--dir %s --json",
                     dir),
                 0, "%s", err);
    cr_assert(strstr(out, "\"reason_base64\":\"cv8=\""), "resolve's own report: %s", out);
    cr_assert_eq(ctl("audit --dir %s --json", dir), 0, "%s", err);
    /* As \u00ff a reader would take the reason for other bytes (c3 bf). */
    cr_assert(strstr(out, "\"reason_base64\":\"cv8=\""), "%s", out);
    export_to_file();
    cr_assert(strstr(out, "\"reason_base64\":\"cv8=\""), "%s", out);
    cr_assert_eq(ctl("import %s/exp.jsonl --dir %s/copy", scratch, scratch), 0, "%s", err);
    cr_assert_eq(ctl("export --dir %s/copy", scratch), 0, "%s", err);
    cr_assert(strstr(out, "\"reason_base64\":\"cv8=\""), "the reason's bytes changed: %s", out);
}

/* An export that could not be written (a full disk) fails; options that would take the next
 * option as their value, and a second --state, are usage errors. */
Test(idemctl, output_lost_and_options_misread_are_errors, .init = setup, .fini = teardown)
{
    write_store();
    char cmd[16384], e[4200];
    snprintf(e, sizeof e, "%s/err", scratch);
    snprintf(cmd, sizeof cmd, "timeout 60 %s/idemctl export --dir %s >/dev/full 2>%s", build_dir(),
             dir, e);
    int st = system(cmd);
    slurp(e, err, sizeof err);
    cr_assert(WIFEXITED(st) && WEXITSTATUS(st) == 1, "an export to a full disk: status %d", st);
    cr_assert(strstr(err, "writing the output"), "%s", err);
    cr_assert_eq(ctl("resolve held-1 release --reason --force --dir %s", dir), 2);
    cr_assert(strstr(err, "--reason needs a value"), "%s", err);
    cr_assert_eq(ctl("resolve held-1 release --reason=--force --dir %s", dir), 0, "%s", err);
    cr_assert_eq(ctl("scan --state committed --state bogus --dir %s", dir), 2);
    cr_assert(strstr(err, "--state is given twice"), "%s", err);
}

Test(idemctl, backup_restore_checkpoint_compact, .init = setup, .fini = teardown)
{
    write_store();
    cr_assert_eq(ctl("backup %s/b --dir %s", scratch, dir), 0, "%s", err);
    /* Online backup asks idemd; with nobody at the socket it fails and says why. */
    cr_assert_eq(ctl("backup %s/b2 --socket %s/no-such.sock", scratch, scratch), 1);
    cr_assert(strstr(err, "no-such.sock"), "%s", err);
    cr_assert_eq(ctl("restore %s/b %s/r", scratch, scratch), 0, "%s", err);
    cr_assert_eq(ctl("get order-3 --dir %s/r --json", scratch), 0, "%s", err);
    cr_assert(strstr(out, "inv-3"), "%s", out);
    cr_assert_eq(ctl("checkpoint --dir %s", dir), 0, "%s", err);
    cr_assert_eq(ctl("compact --dir %s --timeout 2s --json", dir), 0, "%s", err);
    cr_assert(strstr(out, "wal_bytes_after"), "%s", out);
    cr_assert_eq(ctl("verify %s", dir), 0, "%s", out);
}

/* Whether scratch/rel exists. */
static int in_scratch(const char *rel)
{
    char p[1024];
    snprintf(p, sizeof p, "%s/%s", scratch, rel);
    return access(p, F_OK) == 0;
}

/* A backup or restore is made in "<dest>.partial" and renamed to dest once whole: dest never
 * holds a copy cut short, a failed copy leaves nothing, and one a crash left is named. */
Test(idemctl, a_copy_is_made_aside_and_named_only_when_whole, .init = setup, .fini = teardown)
{
    write_store();
    cr_assert_eq(ctl("backup %s/b/ --dir %s", scratch, dir), 0, "%s", err);
    cr_assert(in_scratch("b/super"));
    cr_assert(!in_scratch("b.partial"));
    cr_assert_eq(ctl("backup %s/b --dir %s", scratch, dir), 1, "over an existing copy");
    cr_assert(strstr(err, "exists"), "%s", err);

    char p[1024];
    snprintf(p, sizeof p, "%s/c.partial", scratch);
    cr_assert_eq(mkdir(p, 0700), 0);
    cr_assert_eq(ctl("backup %s/c --dir %s", scratch, dir), 1, "a crash's leftover");
    cr_assert(strstr(err, "c.partial exists") && strstr(err, "cut short"), "%s", err);
    cr_assert(!in_scratch("c"));

    /* A copy inside what it copies would be lost with it: refused, with nothing made there
     * (the store's directory is not written: it used to get inner.partial for a moment). */
    struct stat before, after;
    cr_assert_eq(stat(dir, &before), 0);
    usleep(20000);
    cr_assert_eq(ctl("backup %s/inner --dir %s", dir, dir), 1, "into the store's own directory");
    cr_assert(strstr(err, "within the directory it copies"), "%s", err);
    snprintf(p, sizeof p, "%s/inner.partial", dir);
    cr_assert(access(p, F_OK) != 0, "the refused copy left %s", p);
    cr_assert_eq(stat(dir, &after), 0);
    cr_assert(before.st_mtim.tv_sec == after.st_mtim.tv_sec &&
                  before.st_mtim.tv_nsec == after.st_mtim.tv_nsec,
              "the refused copy wrote into the store's directory");
    cr_assert_eq(ctl("restore %s/b %s/b/r", scratch, scratch), 1,
                 "into the backup's own directory");
    cr_assert(strstr(err, "within the directory it copies"), "%s", err);

    cr_assert_eq(ctl("restore %s/b %s/r", scratch, scratch), 0, "%s", err);
    cr_assert(in_scratch("r/super") && !in_scratch("r.partial"));
    /* A backup without its checkpoint cannot be restored: the copy fails and leaves nothing. */
    snprintf(p, sizeof p, "rm %s/b/index-*.ckpt", scratch);
    cr_assert_eq(system(p), 0);
    cr_assert_eq(ctl("restore %s/b %s/r2", scratch, scratch), 1);
    cr_assert(strstr(err, "index-"), "%s", err);
    cr_assert(!in_scratch("r2") && !in_scratch("r2.partial"));
}

/* A store left by a process that did not close it: write_store's records, one decision, and a
 * last claim; then _exit without idem_close (no checkpoint, no clean mark). */
static void write_crashed_store(void)
{
    write_store();
    pid_t pid = fork();
    cr_assert(pid >= 0);
    if (pid == 0) {
        idem_store *s;
        idem_queue *q;
        idem_completion c;
        if (idem_open(dir, NULL, &s) != IDEM_OK || idem_queue_open(s, 8, &q) != IDEM_OK) _exit(3);
        idem_op op = {.kind = IDEM_OP_RESOLVE,
                      .flags = IDEM_F_FORCE,
                      .key = "live-1",
                      .key_len = 6,
                      .data = "checked",
                      .data_len = 7,
                      .action = IDEM_RESOLVE_RELEASE,
                      .actor = "test"};
        if (idem_exec(q, &op, &c) != IDEM_OK || c.err != IDEM_OK) _exit(4);
        idem_claim_args a = {.ttl_ms = 3600000, .lease_ms = 60000};
        if (idem_claim(q, "after-1", 7, &a, &c) != IDEM_OK || c.outcome != IDEM_NEW) _exit(5);
        _exit(0);
    }
    int st = 0;
    cr_assert_eq(waitpid(pid, &st, 0), pid);
    cr_assert(WIFEXITED(st) && WEXITSTATUS(st) == 0, "the writer exited %d", WEXITSTATUS(st));
}

/* Every file of d but LOCK (its owner line is rewritten by each opener): name, size, mtime and
 * a checksum of its bytes, one line each, into buf. */
static void dir_fingerprint(const char *d, char *buf, size_t cap)
{
    char cmd[4400];
    snprintf(cmd, sizeof cmd,
             "cd %s && for f in $(ls | grep -v '^LOCK$' | sort); do "
             "printf '%%s %%s ' $f \"$(stat -c '%%s %%Y.%%y' $f)\"; cksum < $f; done",
             d);
    FILE *p = popen(cmd, "r");
    cr_assert_not_null(p);
    size_t n = fread(buf, 1, cap - 1, p);
    buf[n] = 0;
    cr_assert_eq(pclose(p), 0);
    cr_assert(n > 0, "no files in %s", d);
}

/* Inspections of a stopped store (status, get, scan, attention, audit, export, backup) open it
 * read-only: after a crash they run no recovery, write no checkpoint and cut nothing off; the
 * first writable open does that. A backup taken so still holds every acknowledged change. */
Test(idemctl, inspections_leave_a_crashed_store_as_it_is, .init = setup, .fini = teardown)
{
    write_crashed_store();
    static char before[8192], after[8192];
    dir_fingerprint(dir, before, sizeof before);
    cr_assert_eq(ctl("status --dir %s --json", dir), 0, "%s", err);
    cr_assert_eq(ctl("get after-1 --dir %s --json", dir), 0, "%s", err);
    cr_assert_eq(ctl("scan --dir %s", dir), 0, "%s", err);
    cr_assert_eq(ctl("attention --dir %s", dir), 0, "%s", err);
    cr_assert_eq(ctl("audit --dir %s --json", dir), 0, "%s", err);
    cr_assert(strstr(out, "resolve-release") && strstr(out, "live-1"), "%s", out);
    cr_assert_eq(ctl("export --dir %s", dir), 0, "%s", err);
    cr_assert(strstr(out, "\"after-1\"") && strstr(out, "\"type\":\"audit\""), "%s", out);
    cr_assert_eq(ctl("backup %s/b --dir %s", scratch, dir), 0, "%s", err);
    dir_fingerprint(dir, after, sizeof after);
    cr_assert_str_eq(after, before, "an inspection changed the store");

    cr_assert_eq(ctl("restore %s/b %s/r", scratch, scratch), 0, "%s", err);
    cr_assert_eq(ctl("get after-1 --dir %s/r --json", scratch), 0, "%s", err);
    cr_assert(strstr(out, "\"state\":\"in_flight\""), "%s", out);
    cr_assert_eq(ctl("get live-1 --dir %s/r", scratch), 1, "released before the crash");
    cr_assert_eq(ctl("audit live-1 --dir %s/r --json", scratch), 0, "%s", err);
    cr_assert(strstr(out, "resolve-release"), "%s", out);
}

/* Only import makes a store. Any other command given a directory without one (a mistyped
 * --dir) says so and creates nothing there. */
Test(idemctl, a_directory_without_a_store_is_refused_and_left_empty, .init = setup,
     .fini = teardown)
{
    char empty[4200];
    snprintf(empty, sizeof empty, "%s/empty", scratch);
    cr_assert_eq(mkdir(empty, 0700), 0);
    char backup[4200];
    snprintf(backup, sizeof backup, "backup %s/b", scratch);
    const char *const cmds[] = {
        "status", "get k",   "scan",       "attention", "audit",
        "export", "compact", "checkpoint", backup,      "resolve k release --reason checked"};
    for (size_t i = 0; i < sizeof cmds / sizeof cmds[0]; i++) {
        cr_assert_eq(ctl("%s --dir %s", cmds[i], empty), 1, "%s: %s", cmds[i], err);
        cr_assert(strstr(err, "holds no store"), "%s: %s", cmds[i], err);
    }
    char cmd[4400], listing[256] = "";
    snprintf(cmd, sizeof cmd, "ls -A %s", empty);
    FILE *p = popen(cmd, "r");
    size_t n = fread(listing, 1, sizeof listing - 1, p);
    listing[n] = 0;
    pclose(p);
    cr_assert_str_eq(listing, "", "files made in a directory without a store: %s", listing);
    snprintf(backup, sizeof backup, "%s/b", scratch);
    struct stat st;
    cr_assert(stat(backup, &st) < 0, "no backup of nothing");

    cr_assert_eq(ctl("get k --dir /etc/passwd"), 1);
    cr_assert(strstr(err, "Not a directory"), "%s", err);
}

/* import writes records over those of the same keys, without audit entries: a store that holds
 * keys takes it only with --force. */
/* A --dir that holds files but no store (a mistyped one) gets no store made among them. */
Test(idemctl, import_into_a_directory_of_other_files_is_refused, .init = setup, .fini = teardown)
{
    write_store();
    export_to_file();
    char cmd[8800];
    snprintf(cmd, sizeof cmd, "mkdir -p %s/app && echo data > %s/app/notes.txt", scratch, scratch);
    cr_assert_eq(system(cmd), 0);
    cr_assert_eq(ctl("import %s/exp.jsonl --dir %s/app", scratch, scratch), 1);
    cr_assert(strstr(err, "holds files but no store"), "%s", err);
    snprintf(cmd, sizeof cmd, "test \"$(ls %s/app)\" = notes.txt", scratch);
    cr_assert_eq(system(cmd), 0, "files were made beside notes.txt");
}

Test(idemctl, import_into_a_store_that_holds_keys_needs_force, .init = setup, .fini = teardown)
{
    write_store();
    export_to_file();
    char path[4200];
    snprintf(path, sizeof path, "%s/exp.jsonl", scratch);
    /* The store moves on after the export: order-2 is deleted, then claimed anew. */
    idem_store *s;
    idem_queue *q;
    idem_completion c;
    cr_assert_eq(idem_open(dir, NULL, &s), IDEM_OK, "%s", idem_last_error());
    cr_assert_eq(idem_queue_open(s, 8, &q), IDEM_OK);
    cr_assert_eq(idem_del(q, "order-2", 7, "test"), IDEM_OK);
    claim(q, "order-2", 60000, "again", &c);
    cr_assert_eq(c.outcome, IDEM_NEW);
    idem_queue_close(q);
    cr_assert_eq(idem_close(s), IDEM_OK);

    char sums[8600], before[8192], after[8192];
    snprintf(sums, sizeof sums, "cd %s && find . -type f | sort | xargs md5sum > %s/sums", dir,
             scratch);
    cr_assert_eq(system(sums), 0);
    snprintf(path, sizeof path, "%s/sums", scratch);
    slurp(path, before, sizeof before);
    snprintf(path, sizeof path, "%s/exp.jsonl", scratch);
    cr_assert_eq(ctl("import %s --dir %s", path, dir), 1);
    cr_assert(strstr(err, "already holds 13 keys") && strstr(err, "--force"), "%s", err);
    /* A refused import looked at the store read-only: not a byte of it changed (it used to open
     * it to write, which ran recovery and a checkpoint at its close). */
    cr_assert_eq(system(sums), 0);
    snprintf(path, sizeof path, "%s/sums", scratch);
    slurp(path, after, sizeof after);
    cr_assert_str_eq(after, before, "a refused import changed the store");
    snprintf(path, sizeof path, "%s/exp.jsonl", scratch);
    char mark[4200];
    snprintf(mark, sizeof mark, "%s/%s", dir, IDEM_IMPORT_MARKER);
    cr_assert(access(mark, F_OK) < 0, "a refused import left its marker");
    cr_assert_eq(ctl("get order-2 --dir %s --json", dir), 0, "%s", err);
    cr_assert(strstr(out, "\"state\":\"in_flight\""), "the record is the live one: %s", out);
    /* A file that is no export, refused before anything was written, leaves no marker either. */
    char junk[4200];
    snprintf(junk, sizeof junk, "echo '{\"type\":\"record\"}' > %s/junk.jsonl", scratch);
    cr_assert_eq(system(junk), 0);
    cr_assert_eq(ctl("import %s/junk.jsonl --dir %s --force", scratch, dir), 1);
    cr_assert(strstr(err, "header"), "%s", err);
    cr_assert(access(mark, F_OK) < 0, "an import that wrote nothing left its marker");
    cr_assert_eq(ctl("import %s --dir %s --force", path, dir), 0, "%s", err);
    cr_assert(access(mark, F_OK) < 0, "a finished import left its marker");
    cr_assert_eq(ctl("get order-2 --dir %s --json", dir), 0, "%s", err);
    cr_assert(strstr(out, "\"result\":\"inv-2\""), "forced: the exported record: %s", out);
}

/* An export ends with a line that counts what it holds: one cut short (here at a line's end,
 * where nothing else shows it) is refused, and the new store is made aside and removed, so no
 * directory that looks like a store is left. A result over the store's limit is named, and
 * --result-max lets it in. */
Test(idemctl, an_export_cut_short_is_not_imported, .init = setup, .fini = teardown)
{
    write_store();
    export_to_file();
    cr_assert(strstr(out, "{\"type\":\"end\",\"records\":13,\"audit_entries\":0}\n"), "%s", out);
    char cmd[9000];
    snprintf(cmd, sizeof cmd, "head -n 6 %s/exp.jsonl > %s/cut.jsonl", scratch, scratch);
    cr_assert_eq(system(cmd), 0);
    cr_assert_eq(ctl("import %s/cut.jsonl --dir %s/im", scratch, scratch), 1,
                 "a cut export went in");
    cr_assert(strstr(err, "cut short"), "%s", err);
    cr_assert(!in_scratch("im") && !in_scratch("im.partial"));
    cr_assert_eq(ctl("import %s/exp.jsonl --dir %s/im", scratch, scratch), 0, "%s", err);
    cr_assert(in_scratch("im/super") && !in_scratch("im.partial"));
    /* An empty directory made for the store is staged the same way: a cut export leaves it
     * empty, and a whole one fills it. */
    char empty[4200];
    snprintf(empty, sizeof empty, "%s/made", scratch);
    cr_assert_eq(mkdir(empty, 0700), 0);
    cr_assert_eq(ctl("import %s/cut.jsonl --dir %s", scratch, empty), 1, "a cut export went in");
    cr_assert(strstr(err, "cut short"), "%s", err);
    cr_assert(in_scratch("made") && !in_scratch("made/super") && !in_scratch("made.partial"));
    cr_assert_eq(ctl("import %s/exp.jsonl --dir %s", scratch, empty), 0, "%s", err);
    cr_assert(in_scratch("made/super") && !in_scratch("made.partial"));
    cr_assert(strstr(out, "imported 13 records"), "%s", out);
    /* Into a store that holds keys (--force), what was written before the cut stays: said so.
     * The store stays marked as an import cut short, so no writer opens it until an import of
     * the whole export finishes. */
    cr_assert_eq(ctl("import %s/cut.jsonl --dir %s --force", scratch, empty), 1);
    cr_assert(strstr(err, "cut short") && strstr(err, "stay there"), "%s", err);
    cr_assert(strstr(err, IDEM_IMPORT_MARKER), "%s", err);
    cr_assert(in_scratch("made/" IDEM_IMPORT_MARKER));
    cr_assert_eq(ctl("checkpoint --dir %s", empty), 1, "a store an import cut short was opened");
    cr_assert(strstr(err, IDEM_IMPORT_MARKER), "%s", err);
    cr_assert_eq(ctl("import %s/exp.jsonl --dir %s --force", scratch, empty), 0, "%s", err);
    cr_assert(!in_scratch("made/" IDEM_IMPORT_MARKER));
    cr_assert_eq(ctl("checkpoint --dir %s", empty), 0, "%s", err);

    idem_store *s;
    idem_queue *q;
    idem_completion c;
    idem_options o;
    idem_options_init(&o);
    o.result_bytes_max = 100000;
    char big[70000];
    memset(big, 'r', sizeof big);
    char d2[4200];
    snprintf(d2, sizeof d2, "%s/big", scratch);
    cr_assert_eq(idem_open(d2, &o, &s), IDEM_OK, "%s", idem_last_error());
    cr_assert_eq(idem_queue_open(s, 8, &q), IDEM_OK);
    claim(q, "large", 60000, "large", &c);
    cr_assert_eq(idem_commit(q, "large", 5, c.token, big, sizeof big), IDEM_OK);
    idem_queue_close(q);
    cr_assert_eq(idem_close(s), IDEM_OK);
    snprintf(cmd, sizeof cmd, "timeout 60 %s/idemctl export --dir %s > %s/big.jsonl", build_dir(),
             d2, scratch);
    cr_assert_eq(system(cmd), 0);
    cr_assert_eq(ctl("import %s/big.jsonl --dir %s/im2", scratch, scratch), 1);
    cr_assert(strstr(err, "field result: 70000 bytes, over the store's limit of 65536"), "%s", err);
    cr_assert(!in_scratch("im2") && !in_scratch("im2.partial"));
    cr_assert_eq(ctl("import %s/big.jsonl --dir %s/im2 --result-max 128KiB", scratch, scratch), 0,
                 "%s", err);
}

/* An import into an empty directory writes in place: the directory keeps its inode, owner and
 * mode (a mount point, or one made for the service's user), and a new file system's lost+found
 * stays. It used to build the store beside it and rename it over the directory: the owner and
 * mode were lost, and a mount point could not be replaced at all. A failed import empties the
 * directory again. */
Test(idemctl, import_into_an_empty_directory_keeps_the_directory, .init = setup, .fini = teardown)
{
    write_store();
    export_to_file();
    char d[4200], cmd[9000];
    snprintf(d, sizeof d, "%s/svc", scratch);
    cr_assert_eq(mkdir(d, 0750), 0);
    snprintf(cmd, sizeof cmd, "%s/lost+found", d);
    cr_assert_eq(mkdir(cmd, 0700), 0);
    cr_assert_eq(chown(d, 65534, 65534), 0, "%s", strerror(errno));
    struct stat was, now;
    cr_assert_eq(stat(d, &was), 0);
    snprintf(cmd, sizeof cmd, "head -n 6 %s/exp.jsonl > %s/cut.jsonl", scratch, scratch);
    cr_assert_eq(system(cmd), 0);
    cr_assert_eq(ctl("import %s/cut.jsonl --dir %s", scratch, d), 1, "a cut export went in");
    cr_assert(strstr(err, "cut short"), "%s", err);
    snprintf(cmd, sizeof cmd, "test \"$(ls -A %s)\" = lost+found", d);
    cr_assert_eq(system(cmd), 0, "a failed import left files in the directory");
    cr_assert_eq(ctl("import %s/exp.jsonl --dir %s", scratch, d), 0, "%s", err);
    cr_assert(strstr(out, "imported 13 records"), "%s", out);
    cr_assert_eq(stat(d, &now), 0);
    cr_assert(now.st_ino == was.st_ino && now.st_uid == 65534 && now.st_gid == 65534 &&
                  (now.st_mode & 07777) == 0750,
              "the directory was replaced: inode %lu (was %lu), owner %u:%u, mode %o",
              (unsigned long)now.st_ino, (unsigned long)was.st_ino, (unsigned)now.st_uid,
              (unsigned)now.st_gid, (unsigned)(now.st_mode & 07777));
    cr_assert(in_scratch("svc/lost+found") && in_scratch("svc/super") &&
              !in_scratch("svc.partial") && !in_scratch("svc/" IDEM_IMPORT_MARKER));
    cr_assert_eq(ctl("get order-2 --dir %s --json", d), 0, "%s", err);
    cr_assert(strstr(out, "\"result\":\"inv-2\""), "%s", out);
    /* Something that is not a directory is named so. */
    snprintf(cmd, sizeof cmd, "%s/exp.jsonl", scratch);
    cr_assert_eq(ctl("import %s --dir %s", cmd, cmd), 1);
    cr_assert(strstr(err, "not a directory"), "%s", err);
}

/* ---- The import marker: an import in place, killed part-way ---- */

static char export_text[1 << 16]; /* export_with_decisions' export */

/* The store of write_store with two operator decisions, exported to scratch/exp.jsonl (and
 * export_text): a header, 12 records (held-1 was released), 2 audit entries, the end line. */
static void export_with_decisions(void)
{
    write_store();
    cr_assert_eq(ctl("resolve held-1 release --reason checked --dir %s", dir), 0, "%s", err);
    cr_assert_eq(ctl("resolve late-1 commit --reason found --dir %s", dir), 0, "%s", err);
    export_to_file();
    snprintf(export_text, sizeof export_text, "%s", out);
    cr_assert(strstr(export_text, "{\"type\":\"end\",\"records\":12,\"audit_entries\":2}"), "%s",
              export_text);
}

/* The bytes of text's first n lines. */
static size_t lines_len(const char *text, int n)
{
    const char *p = text;
    for (int i = 0; i < n; i++) {
        p = strchr(p, '\n');
        cr_assert_not_null(p, "fewer than %d lines", n);
        p++;
    }
    return (size_t)(p - text);
}

/* A store made and left empty in scratch/rel, as idemd's first start leaves it. */
static const char *empty_store(const char *rel)
{
    static char path[4200];
    snprintf(path, sizeof path, "%s/%s", scratch, rel);
    idem_store *s;
    cr_assert_eq(idem_open(path, NULL, &s), IDEM_OK, "%s", idem_last_error());
    cr_assert_eq(idem_close(s), IDEM_OK);
    return path;
}

static int marked(const char *store)
{
    char p[4300];
    snprintf(p, sizeof p, "%s/%s", store, IDEM_IMPORT_MARKER);
    return access(p, F_OK) == 0;
}

/* idemctl import reading a FIFO that the test feeds: it imports each line it is given and then
 * waits for more, so a kill lands after the line the test chose. */
struct feed {
    pid_t pid;
    int fd; /* the FIFO's write end */
    char fifo[PATH_MAX];
};

static void feed_start(struct feed *f, const char *target, int force)
{
    char path[4200], bin[4200], o[4200], e[4200];
    snprintf(path, sizeof path, "%s/feed.fifo", scratch);
    unlink(path);
    cr_assert_eq(mkfifo(path, 0600), 0);
    cr_assert_not_null(realpath(path, f->fifo)); /* as /proc names it */
    snprintf(bin, sizeof bin, "%s/idemctl", build_dir());
    snprintf(o, sizeof o, "%s/out", scratch);
    snprintf(e, sizeof e, "%s/err", scratch);
    f->pid = fork();
    cr_assert_geq(f->pid, 0);
    if (f->pid == 0) {
        if (!freopen(o, "w", stdout) || !freopen(e, "w", stderr)) _exit(127);
        execl(bin, "idemctl", "import", f->fifo, "--dir", target, force ? "--force" : (char *)NULL,
              (char *)NULL);
        _exit(127);
    }
    /* Opened once idemctl opens its end (a writer alone gets ENXIO without blocking). */
    for (int i = 0; i < 3000; i++) {
        f->fd = open(f->fifo, O_WRONLY | O_NONBLOCK | O_CLOEXEC);
        if (f->fd >= 0) break;
        int st;
        cr_assert_eq(waitpid(f->pid, &st, WNOHANG), 0, "idemctl ended before it read");
        usleep(10000);
    }
    cr_assert_geq(f->fd, 0, "idemctl never opened %s", f->fifo);
    cr_assert_eq(fcntl(f->fd, F_SETFL, 0), 0);
}

static void feed_write(struct feed *f, const char *p, size_t n)
{
    while (n > 0) {
        ssize_t w = write(f->fd, p, n);
        cr_assert_gt(w, 0, "write to the FIFO: %s", strerror(errno));
        p += w;
        n -= (size_t)w;
    }
}

/* Waits until idemctl has imported every whole line written so far: the FIFO is empty, and
 * after that its main thread sleeps in a read of the FIFO. stdio reads again only once its
 * buffer is used up, and each record or audit entry is durable before the import reads on; a
 * read that took the last bytes returns with them without sleeping, and /proc shows the
 * syscall of a sleeping thread only ("running" otherwise), so that read is a later one. */
static void feed_wait_reading(struct feed *f)
{
    for (int i = 0; i < 6000; i++) {
        int st, queued = -1;
        if (waitpid(f->pid, &st, WNOHANG) != 0) {
            char e[4200];
            snprintf(e, sizeof e, "%s/err", scratch);
            slurp(e, err, sizeof err);
            cr_assert_fail("idemctl ended while it was fed: %s", err);
        }
        cr_assert_eq(ioctl(f->fd, FIONREAD, &queued), 0, "FIONREAD: %s", strerror(errno));
        char path[64], link[PATH_MAX];
        long nr = -1;
        unsigned long fd = 0;
        snprintf(path, sizeof path, "/proc/%d/syscall", (int)f->pid);
        FILE *p = queued == 0 ? fopen(path, "r") : NULL;
        if (queued == 0 && !p) cr_skip_test("%s cannot be read here: %s", path, strerror(errno));
        if (p && fscanf(p, "%ld 0x%lx", &nr, &fd) != 2) nr = -1;
        if (p) fclose(p);
        if (nr == SYS_read) {
            snprintf(path, sizeof path, "/proc/%d/fd/%lu", (int)f->pid, fd);
            ssize_t n = readlink(path, link, sizeof link - 1);
            link[n > 0 ? n : 0] = 0;
            if (strcmp(link, f->fifo) == 0) return;
        }
        usleep(5000);
    }
    cr_assert_fail("idemctl never came to wait for more of the export");
}

/* kill -9 of the import, as an OOM kill or a power loss cuts it short. */
static void feed_kill(struct feed *f)
{
    int st;
    cr_assert_eq(kill(f->pid, SIGKILL), 0);
    cr_assert_eq(waitpid(f->pid, &st, 0), f->pid);
    cr_assert(WIFSIGNALED(st) && WTERMSIG(st) == SIGKILL, "idemctl ended on its own");
    close(f->fd);
    unlink(f->fifo);
}

/* The end of the FIFO: idemctl's exit code, its output in out and err. */
static int feed_end(struct feed *f)
{
    int st;
    close(f->fd);
    cr_assert_eq(waitpid(f->pid, &st, 0), f->pid);
    unlink(f->fifo);
    char o[4200], e[4200];
    snprintf(o, sizeof o, "%s/out", scratch);
    snprintf(e, sizeof e, "%s/err", scratch);
    slurp(o, out, sizeof out);
    slurp(e, err, sizeof err);
    return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
}

/* Found by a review of idemctl: a failed import into an empty directory emptied it of
 * everything, recursively, also of what someone put there while the import ran (a config file,
 * a directory of certificates). Only the store's own files are removed now. */
Test(idemctl, a_failed_import_leaves_what_it_did_not_make, .init = setup, .fini = teardown)
{
    export_with_decisions();
    char d[4200], p[4300];
    snprintf(d, sizeof d, "%s/svc", scratch);
    cr_assert_eq(mkdir(d, 0750), 0);
    struct feed f;
    feed_start(&f, d, 0);
    feed_write(&f, export_text, lines_len(export_text, 3)); /* the header and two records */
    feed_wait_reading(&f);
    cr_assert(in_scratch("svc/super") && marked(d), "the import is not writing in place");
    snprintf(p, sizeof p, "%s/idemd.conf", d);
    FILE *c = fopen(p, "w");
    cr_assert_not_null(c);
    fputs("port 7379\n", c);
    fclose(c);
    snprintf(p, sizeof p, "%s/tls", d);
    cr_assert_eq(mkdir(p, 0700), 0);
    snprintf(p, sizeof p, "%s/tls/key.pem", d);
    c = fopen(p, "w");
    cr_assert_not_null(c);
    fclose(c);
    cr_assert_eq(feed_end(&f), 1, "an export without its end line went in");
    cr_assert(strstr(err, "cut short"), "%s", err);
    cr_assert(in_scratch("svc/idemd.conf") && in_scratch("svc/tls/key.pem"),
              "the failed import removed files it did not make");
    cr_assert(strstr(err, "left in place"), "%s", err);
    cr_assert(!in_scratch("svc/super") && !in_scratch("svc/audit.log") &&
                  !in_scratch("svc/wal-0000000000000001.log") && !marked(d),
              "the import's files stayed");
}

/* idemd, started on store, exits at once with an error that names the marker. */
static void idemd_refuses(const char *store)
{
    char bin[4200], cmd[16384], log[4200];
    snprintf(bin, sizeof bin, "%s/idemd", build_dir());
    if (access(bin, X_OK) != 0) {
        cr_log_warn("build/idemd is missing: its refusal is not checked");
        return;
    }
    snprintf(log, sizeof log, "%s/idemd.log", scratch);
    snprintf(cmd, sizeof cmd, "timeout 30 %s --dir %s --socket %s/refused.sock --port 0 >%s 2>&1",
             bin, store, scratch, log);
    int st = system(cmd);
    slurp(log, err, sizeof err);
    cr_assert(WIFEXITED(st) && WEXITSTATUS(st) != 0 && WEXITSTATUS(st) != 124,
              "idemd ran on a store an import cut short (status %d): %s", st, err);
    cr_assert(strstr(err, IDEM_IMPORT_MARKER), "%s", err);
}

/* Found by a review of import: into a store that existed (here one idemd made at its first start
 * and left empty) import writes in place, and nothing recorded that it ran. Killed part-way (an
 * OOM kill, kill -9, a power loss), it left a store with part of the export that idemd opened as
 * a whole one: redeliveries of the keys not yet imported got `new`, and their side effects ran
 * twice. The store is now marked before the first record is written; every open that writes
 * refuses it, by name, idemd's included; inspections still read it. */
Test(idemctl, an_import_killed_part_way_leaves_a_store_no_writer_opens, .init = setup,
     .fini = teardown)
{
    export_with_decisions();
    const char *target = empty_store("target");
    struct feed f;
    feed_start(&f, target, 0);
    feed_write(&f, export_text, lines_len(export_text, 7)); /* the header and 6 records */
    feed_wait_reading(&f);
    feed_kill(&f);

    /* The import writes in batch mode: the records a flush took before the kill are in (each
     * waited for a flush of its own before), and the store is marked whatever they are. */
    idem_store *s;
    cr_assert_eq(idem_open(target, NULL, &s), IDEM_ECORRUPT,
                 "a store that holds part of an import was opened");
    cr_assert(strstr(idem_last_error(), IDEM_IMPORT_MARKER) &&
                  strstr(idem_last_error(), "cut short") && strstr(idem_last_error(), "--force"),
              "%s", idem_last_error());
    idemd_refuses(target);
    cr_assert_eq(ctl("resolve order-1 settle --reason x --dir %s", target), 1);
    cr_assert(strstr(err, IDEM_IMPORT_MARKER), "%s", err);
    cr_assert_eq(ctl("status --dir %s", target), 0, "an inspection was refused: %s", err);
}

/* The marker is durable before the first record is written and removed only once the whole
 * export is in and the store closed: while the import runs the store holds it; after, it does
 * not, and the store opens with every record. */
Test(idemctl, an_import_in_place_marks_the_store_until_it_has_finished, .init = setup,
     .fini = teardown)
{
    export_with_decisions();
    const char *target = empty_store("target");
    struct feed f;
    feed_start(&f, target, 0);
    size_t part = lines_len(export_text, 2); /* the header and one record */
    feed_write(&f, export_text, part);
    feed_wait_reading(&f);
    cr_assert(marked(target), "no marker while the import ran");
    feed_write(&f, export_text + part, strlen(export_text) - part);
    cr_assert_eq(feed_end(&f), 0, "%s", err);
    cr_assert(strstr(out, "imported 12 records and 2 audit entries"), "%s", out);
    cr_assert(!marked(target), "the marker outlived the import");
    idem_store *s;
    idem_queue *q;
    idem_completion c;
    cr_assert_eq(idem_open(target, NULL, &s), IDEM_OK, "%s", idem_last_error());
    cr_assert_eq(idem_queue_open(s, 8, &q), IDEM_OK);
    cr_assert_eq(idem_get(q, "order-9", 7, &c), IDEM_OK);
    cr_assert(c.found && c.record.state == IDEM_STATE_COMMITTED);
    idem_stats st;
    idem_get_stats(s, &st);
    cr_assert_eq(st.keys, 12);
    idem_queue_close(q);
    cr_assert_eq(idem_close(s), IDEM_OK);
}

/* An export writes the trail oldest first though it reads it a page (10,000 entries) at a time
 * from the newest, through a temporary file: memory holds one page (the whole trail was held,
 * and a trail is never trimmed). 25,000 entries come out in order, each once, and counted. */
Test(idemctl, an_export_writes_a_long_trail_oldest_first, .init = setup, .fini = teardown)
{
    idem_store *s;
    idem_queue *q;
    open_to_fill(&s, &q);
    static char keys[250][16];
    idem_audit_entry in[250];
    for (int call = 0; call < 100; call++) {
        for (int i = 0; i < 250; i++) {
            snprintf(keys[i], sizeof keys[i], "k-%d", call * 250 + i);
            in[i] = (idem_audit_entry){.seq = (uint64_t)(call * 250 + i + 1),
                                       .at_ms = 1,
                                       .actor = "alice",
                                       .action = "del",
                                       .key = keys[i],
                                       .key_len = (uint32_t)strlen(keys[i]),
                                       .reason = "old"};
        }
        cr_assert_eq(idem_import_audit_n(q, in, 250), IDEM_OK, "%s", idem_last_error());
    }
    idem_queue_close(q);
    cr_assert_eq(idem_close(s), IDEM_OK);
    cr_assert_eq(ctl("export --dir %s", dir), 0, "%s", err);
    char path[4200];
    snprintf(path, sizeof path, "%s/out", scratch);
    FILE *f = fopen(path, "r");
    cr_assert_not_null(f);
    static char line[4096];
    long long want = 1, ended = 0;
    while (fgets(line, sizeof line, f)) {
        long long seq;
        if (sscanf(line, "{\"type\":\"audit\",\"seq\":%lld,", &seq) == 1) {
            cr_assert_eq(seq, want, "entry %lld comes where %lld was due", seq, want);
            want++;
        }
        if (strstr(line, "{\"type\":\"end\",\"records\":0,\"audit_entries\":25000}")) ended = 1;
    }
    fclose(f);
    cr_assert_eq(want - 1, 25000, "%lld entries", want - 1);
    cr_assert(ended, "no end line counting 25,000 entries");
}

/* An export's audit entries are imported 256 at a time: they share the trail's blocks (one at a
 * time, each took a 4 KiB block and a flush: the trail came back about 35 times larger), in
 * their order, with their seqs. */
Test(idemctl, an_import_writes_the_audit_entries_together, .init = setup, .fini = teardown)
{
    char path[4200], log[4300];
    snprintf(path, sizeof path, "%s/many.jsonl", scratch);
    FILE *f = fopen(path, "w");
    cr_assert_not_null(f);
    enum { ENTRIES = 600 };
    fprintf(f, "{\"type\":\"export\",\"format\":2,\"token_next\":1}\n");
    for (int i = 1; i <= ENTRIES; i++)
        fprintf(f,
                "{\"type\":\"audit\",\"seq\":%d,\"at_ms\":%d,\"actor\":\"alice\",\"action\":"
                "\"del\",\"key\":\"k-%d\",\"reason\":\"moved\",\"state_before\":2,"
                "\"state_after\":0,\"version_before\":%d,\"version_after\":0}\n",
                i, 1000 + i, i, i);
    fprintf(f, "{\"type\":\"end\",\"records\":0,\"audit_entries\":%d}\n", ENTRIES);
    cr_assert_eq(fclose(f), 0);
    cr_assert_eq(ctl("import %s --dir %s/many", path, scratch), 0, "%s", err);
    cr_assert(strstr(out, "imported 0 records and 600 audit entries"), "%s", out);
    snprintf(log, sizeof log, "%s/many/audit.log", scratch);
    struct stat st;
    cr_assert_eq(stat(log, &st), 0);
    cr_assert_leq(st.st_size, 128 * 1024, "%d entries took %lld bytes", ENTRIES,
                  (long long)st.st_size);
    cr_assert_eq(ctl("audit --count 2 --dir %s/many --json", scratch), 0, "%s", err);
    char *a = strstr(out, "\"seq\":600,"), *b = strstr(out, "\"seq\":599,");
    cr_assert(a && b && a < b && strstr(a, "\"key\":\"k-600\""), "%s", out);
    cr_assert_eq(ctl("audit k-1 --dir %s/many --json", scratch), 0, "%s", err);
    cr_assert(strstr(out, "\"seq\":1,\"at_ms\":1001,") && strstr(out, "\"version_before\":1,"),
              "%s", out);
    cr_assert_eq(ctl("verify %s/many", scratch), 0, "%s", err);
    /* An entry the store refuses (an actor past 256 bytes) is named by its line, and the import
     * fails: the entries beside it are not dropped unseen. */
    f = fopen(path, "w");
    cr_assert_not_null(f);
    fprintf(f, "{\"type\":\"export\",\"format\":2,\"token_next\":1}\n");
    for (int i = 1; i <= 3; i++)
        fprintf(
            f,
            "{\"type\":\"audit\",\"seq\":%d,\"at_ms\":1,\"actor\":\"%s\",\"action\":"
            "\"del\",\"key\":\"k\",\"reason\":\"\",\"state_before\":2,\"state_after\":0,"
            "\"version_before\":1,\"version_after\":0}\n",
            i,
            i == 2
                ? "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa"
                  "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa"
                  "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa"
                  "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa"
                : "alice");
    fprintf(f, "{\"type\":\"end\",\"records\":0,\"audit_entries\":3}\n");
    cr_assert_eq(fclose(f), 0);
    cr_assert_eq(ctl("import %s --dir %s/bad", path, scratch), 1, "%s", out);
    cr_assert(strstr(err, "many.jsonl:3: ") && strstr(err, "field actor"), "%s", err);
}

/* An import cut short is finished by running it again with --force (refused without it, saying
 * why), however often it was cut: its records are written over, and the audit entries the runs
 * before had written are not written twice. */
Test(idemctl, an_import_cut_short_is_finished_by_running_it_again, .init = setup, .fini = teardown)
{
    export_with_decisions();
    cr_assert_eq(ctl("audit --dir %s --json", dir), 0, "%s", err);
    static char audit_src[1 << 16];
    snprintf(audit_src, sizeof audit_src, "%s", out);
    const char *target = empty_store("target");
    struct feed f;
    feed_start(&f, target, 0);
    feed_write(&f, export_text, lines_len(export_text, 7)); /* among the records */
    feed_wait_reading(&f);
    feed_kill(&f);
    cr_assert_eq(ctl("import %s/exp.jsonl --dir %s", scratch, target), 1);
    cr_assert(strstr(err, IDEM_IMPORT_MARKER) && strstr(err, "cut short") && strstr(err, "--force"),
              "%s", err);

    feed_start(&f, target, 1);
    feed_write(&f, export_text, lines_len(export_text, 14)); /* and the first audit entry */
    feed_wait_reading(&f);
    feed_kill(&f);
    cr_assert(marked(target), "the marker went with a run cut short");
    idem_store *s;
    cr_assert_eq(idem_open(target, NULL, &s), IDEM_ECORRUPT,
                 "a store that holds part of an import was opened");

    cr_assert_eq(ctl("import %s/exp.jsonl --dir %s --force", scratch, target), 0, "%s", err);
    cr_assert(strstr(out, "imported 12 records and 2 audit entries"), "%s", out);
    cr_assert(!marked(target), "the marker outlived the import");
    cr_assert_eq(ctl("audit --dir %s --json", target), 0, "%s", err);
    cr_assert_str_eq(out, audit_src, "the trail is not the exported one");
    cr_assert_eq(ctl("get order-1 --dir %s --json", target), 0, "%s", err);
    cr_assert(strstr(out, "\"result\":\"inv-1\"") && strstr(out, "\"mismatch_count\":1"), "%s",
              out);
    cr_assert_eq(idem_open(target, NULL, &s), IDEM_OK, "%s", idem_last_error());
    idem_stats st;
    idem_get_stats(s, &st);
    cr_assert_eq(st.keys, 12);
    cr_assert_eq(idem_close(s), IDEM_OK);
}

/* Inspections open a store an import cut short and say so; verify counts the marker as a fault;
 * backup --dir and restore carry it to the copy, which would otherwise open as a whole store. */
Test(idemctl, inspections_report_the_import_marker_and_copies_keep_it, .init = setup,
     .fini = teardown)
{
    write_store();
    char mark[4200];
    snprintf(mark, sizeof mark, "%s/%s", dir, IDEM_IMPORT_MARKER);
    FILE *m = fopen(mark, "w");
    cr_assert_not_null(m);
    fclose(m);
    cr_assert_eq(ctl("status --dir %s", dir), 0, "%s", err);
    cr_assert(strstr(err, "import_unfinished"), "%s", err);
    cr_assert_eq(ctl("verify %s", dir), 1, "%s", out);
    cr_assert(strstr(out, "sound") && strstr(out, "import unfinished"), "%s", out);
    cr_assert(strstr(err, "--force"), "%s", err);
    cr_assert_eq(ctl("verify %s --json", dir), 1, "%s", out);
    cr_assert(strstr(out, "\"import_unfinished\":true"), "%s", out);
    cr_assert_eq(ctl("backup %s/b --dir %s", scratch, dir), 0, "%s", err);
    cr_assert(in_scratch("b/" IDEM_IMPORT_MARKER), "the backup lost the marker");
    cr_assert_eq(ctl("restore %s/b %s/r", scratch, scratch), 0, "%s", err);
    cr_assert(in_scratch("r/" IDEM_IMPORT_MARKER), "the restored store lost the marker");
    char r[4200];
    snprintf(r, sizeof r, "%s/r", scratch);
    idem_store *s;
    cr_assert_eq(idem_open(r, NULL, &s), IDEM_ECORRUPT, "a copy of a marked store opened");
    /* An export would look whole, and a store imported from it elsewhere would be unmarked. */
    cr_assert_eq(ctl("export --dir %s", dir), 1, "%s", err);
    cr_assert(strstr(err, IDEM_IMPORT_MARKER), "%s", err);
    cr_assert_eq(out[0], 0, "an export of a marked store was written: %.80s", out);

    cr_assert_eq(unlink(mark), 0);
    cr_assert_eq(ctl("verify %s --json", dir), 0, "%s", out);
    cr_assert(strstr(out, "\"import_unfinished\":false"), "%s", out);
}

/* Keys printed in tables and by scan can be given back: a long key is printed whole (tables
 * cut it at 128 characters), and a space at either end is escaped (`read -r` drops it). */
Test(idemctl, printed_keys_are_whole_and_keep_their_edge_spaces, .init = setup, .fini = teardown)
{
    char long_key[301];
    memset(long_key, 'L', 300);
    long_key[300] = 0;
    idem_store *s;
    idem_queue *q;
    idem_completion c;
    cr_assert_eq(idem_open(dir, NULL, &s), IDEM_OK, "%s", idem_last_error());
    cr_assert_eq(idem_queue_open(s, 8, &q), IDEM_OK);
    claim(q, long_key, 1, "x", &c);
    claim(q, "  sp  ", 1, "x", &c);
    idem_queue_close(q);
    cr_assert_eq(idem_close(s), IDEM_OK);
    usleep(20000); /* both leases have run out: they need attention */
    cr_assert_eq(ctl("attention --dir %s", dir), 0, "%s", err);
    cr_assert(strstr(out, long_key) && !strstr(out, "LLL..."), "%s", out);
    cr_assert_eq(ctl("scan --dir %s", dir), 0, "%s", err);
    cr_assert(strstr(out, "\\x20 sp \\x20\n"), "%s", out);
    char cmd[8200];
    snprintf(cmd, sizeof cmd,
             "%s/idemctl scan --dir %s | while read -r k; do %s/idemctl get --key-escaped \"$k\" "
             "--dir %s >/dev/null || exit 1; done",
             build_dir(), dir, build_dir(), dir);
    cr_assert_eq(system(cmd), 0, "a key printed by scan was not found again");
}

Test(idemctl, out_of_range_timeout_and_count_are_usage_errors, .init = setup, .fini = teardown)
{
    write_store();
    cr_assert_eq(ctl("compact --dir %s --timeout 25h", dir), 2);
    cr_assert(strstr(err, "--timeout 25h") && strstr(err, "24h"), "%s", err);
    cr_assert_eq(ctl("status --dir %s --timeout 0ms", dir), 2);
    cr_assert_eq(ctl("compact --dir %s --timeout 2h --json", dir), 0, "%s", err);
    cr_assert(strstr(out, "\"settled\":true"), "%s", out);
    cr_assert_eq(ctl("audit --dir %s --count 10001", dir), 2);
    cr_assert(strstr(err, "at most 10000"), "%s", err);
    cr_assert_eq(ctl("audit --dir %s --count 10000", dir), 0, "%s", err);
    cr_assert_eq(ctl("attention --dir %s --count 100001", dir), 2);
    cr_assert(strstr(err, "at most 100000"), "%s", err);
}

/* A key of any bytes is reached in the forms idemctl prints it: escaped (tables and scan) with
 * --key-escaped, key_base64 (JSON) with --key-base64. JSON never passes such a key off as a
 * string. */
Test(idemctl, binary_keys_are_reached_in_the_forms_printed, .init = setup, .fini = teardown)
{
    static const char key[7] = {'b', 'i', 'n', 0, (char)0xe9, '\\', 'k'};
    idem_store *s;
    idem_queue *q;
    idem_completion c;
    cr_assert_eq(idem_open(dir, NULL, &s), IDEM_OK, "%s", idem_last_error());
    cr_assert_eq(idem_queue_open(s, 8, &q), IDEM_OK);
    idem_claim_args a = {.ttl_ms = 3600000, .lease_ms = 1};
    cr_assert_eq(idem_claim(q, key, sizeof key, &a, &c), IDEM_OK);
    claim(q, "text-1", 60000, "t", &c);
    idem_queue_close(q);
    cr_assert_eq(idem_close(s), IDEM_OK);
    usleep(20000); /* the lease has run out: resolve needs no --force */

    cr_assert_eq(ctl("scan --dir %s", dir), 0, "%s", err);
    cr_assert(strstr(out, "bin\\x00\\xe9\\x5ck\n") && strstr(out, "text-1\n"), "%s", out);
    cr_assert_eq(ctl("scan --dir %s --json", dir), 0, "%s", err);
    cr_assert(strstr(out, "{\"key_base64\":\"YmluAOlcaw==\"}") && strstr(out, "\"text-1\""), "%s",
              out);
    cr_assert_eq(ctl("get 'bin\\x00\\xe9\\x5ck' --key-escaped --dir %s --json", dir), 0, "%s", err);
    cr_assert(strstr(out, "\"key_base64\":\"YmluAOlcaw==\""), "%s", out);
    cr_assert_eq(ctl("get YmluAOlcaw== --key-base64 --dir %s --json", dir), 0, "%s", err);
    cr_assert(strstr(out, "\"state\":\"in_flight\""), "%s", out);
    cr_assert_eq(ctl("get 'bin\\x00\\xe9\\x5ck' --dir %s", dir), 1, "typed as is: another key");
    cr_assert_eq(ctl("resolve YmluAOlcaw== release --key-base64 --reason checked --dir %s", dir), 0,
                 "%s", err);
    cr_assert_eq(ctl("audit 'bin\\x00\\xe9\\x5ck' --key-escaped --dir %s --json", dir), 0, "%s",
                 err);
    cr_assert(strstr(out, "\"key_base64\":\"YmluAOlcaw==\"") && strstr(out, "resolve-release"),
              "%s", out);
    cr_assert_eq(ctl("get YmluAOlcaw== --key-base64 --dir %s", dir), 1, "released");
    /* Messages name a key in the escaped form, whatever form it was given in. */
    cr_assert(strstr(err, "bin\\x00\\xe9\\x5ck: no record"), "%s", err);
    cr_assert_eq(ctl("resolve YmluAOlcaw== commit --key-base64 --reason r --dir %s", dir), 1);
    cr_assert(strstr(err, "bin\\x00\\xe9\\x5ck: no record"), "%s", err);
    cr_assert_eq(ctl("get \"$(printf 'a\\033[2Jb')\" --dir %s", dir), 1);
    cr_assert(strstr(err, "a\\x1b[2Jb: no record") && !strchr(err, 0x1b), "%s", err);

    cr_assert_eq(ctl("get 'a\\q' --key-escaped --dir %s", dir), 2);
    cr_assert(strstr(err, "xHH"), "%s", err);
    cr_assert_eq(ctl("get 'a\\x4' --key-escaped --dir %s", dir), 2);
    cr_assert_eq(ctl("get '***' --key-base64 --dir %s", dir), 2);
    cr_assert(strstr(err, "not base64"), "%s", err);
    cr_assert_eq(ctl("get k --key-escaped --key-base64 --dir %s", dir), 2);
    cr_assert_eq(ctl("get '' --dir %s", dir), 2);
    cr_assert(strstr(err, "1 to 512"), "%s", err);
    cr_assert_eq(ctl("scan --key-escaped --dir %s", dir), 2, "scan takes no KEY");
}

/* ---- Online, against build/idemd ---- */

static pid_t idemd_pid;

static int sock_cmd(const char *line, char *reply, size_t cap)
{
    struct sockaddr_un sa = {.sun_family = AF_UNIX};
    if (strlen(dir) + 12 >= sizeof sa.sun_path) return -1;
    strcpy(sa.sun_path, dir);
    strcat(sa.sun_path, "/idemd.sock");
    int fd = socket(AF_UNIX, SOCK_STREAM, 0);
    if (fd < 0 || connect(fd, (struct sockaddr *)&sa, sizeof sa) < 0) {
        if (fd >= 0) close(fd);
        return -1;
    }
    cr_assert_eq(write(fd, line, strlen(line)), (ssize_t)strlen(line));
    ssize_t n = read(fd, reply, cap - 1);
    reply[n > 0 ? n : 0] = 0;
    close(fd);
    return 0;
}

static void start_idemd_with(const char *user);
static void stop_idemd(void);
static int load_delay_ms; /* start_idemd holds idemd in -LOADING so long, and returns then */
static const char *idemd_extra[3]; /* more of idemd's flags, NULL-terminated */

static void start_idemd(void)
{
    start_idemd_with(NULL);
}

/* With user (NAME:ROLE:PASSWORD), idemd has that one user and every connection must AUTH. */
static void start_idemd_with(const char *user)
{
    char bin[4200];
    snprintf(bin, sizeof bin, "%s/idemd", build_dir());
    if (access(bin, X_OK) != 0) cr_skip_test("build/idemd is missing: the online tests need it");
    idemd_pid = fork();
    cr_assert_geq(idemd_pid, 0);
    if (idemd_pid == 0) {
        freopen("/dev/null", "w", stderr);
        if (load_delay_ms) {
            char ms[16];
            snprintf(ms, sizeof ms, "%d", load_delay_ms);
            setenv("IDEM_TEST_LOAD_DELAY_MS", ms, 1);
        }
        const char *argv[12] = {"idemd", "--dir", dir, "--test-clock", "--port", "0"};
        int k = 6;
        if (user) {
            argv[k++] = "--user";
            argv[k++] = user;
        }
        for (int i = 0; idemd_extra[i]; i++)
            argv[k++] = idemd_extra[i];
        execv(bin, (char *const *)argv);
        _exit(127);
    }
    char reply[256];
    for (int i = 0; i < 200; i++) {
        if (sock_cmd("IDEM.GET none\r\n", reply, sizeof reply) == 0 &&
            !strstr(reply, "LOADING") == !load_delay_ms)
            return;
        usleep(20000);
    }
    cr_assert_fail("idemd did not start");
}

/* idemd cuts the attention list to fit its reply: status counted the leases run out in a list
 * cut so (27 of 40 with a 128 KiB limit) as all of them, and attention listed it as whole. */
Test(idemctl_online, a_list_idemd_cut_for_its_reply_is_said_cut, .init = setup, .fini = stop_idemd)
{
    idemd_extra[0] = "--client-output-max";
    idemd_extra[1] = "131072";
    start_idemd();
    idemd_extra[0] = idemd_extra[1] = NULL;
    char reply[512], line[128], sock[4200];
    snprintf(sock, sizeof sock, "--socket %s/idemd.sock", dir);
    for (int i = 0; i < 40; i++) {
        snprintf(line, sizeof line, "IDEM.CLAIM lapsed-%02d 3600000 1000\r\n", i);
        cr_assert_eq(sock_cmd(line, reply, sizeof reply), 0);
        cr_assert(strstr(reply, "new"), "%s", reply);
    }
    cr_assert_eq(sock_cmd("DEBUG CLOCK ADVANCE 5000\r\n", reply, sizeof reply), 0);
    cr_assert_eq(ctl("status %s", sock), 0, "%s", err);
    cr_assert(strstr(out, "at least 27 in_flight record(s) whose lease ran out"), "%s", out);
    cr_assert(strstr(err, "idemd cut the list to fit its reply"), "%s", err);
    cr_assert_eq(ctl("attention %s", sock), 0, "%s", err);
    cr_assert(strstr(err, "idemd cut the list to fit its reply") &&
                  strstr(err, "more may need attention"),
              "%s", err);
    cr_assert_eq(ctl("attention --count 20 %s", sock), 0, "%s", err);
    cr_assert_null(strstr(err, "idemd cut the list"), "%s", err); /* cut to --count: said so */
    cr_assert(strstr(err, "the 20 most urgent records are listed"), "%s", err);
}

/* An idemd that has not opened its store yet gets a verdict from status, not a failure. */
Test(idemctl_online, status_while_idemd_recovers_says_so, .init = setup, .fini = stop_idemd)
{
    load_delay_ms = 8000; /* room for three idemctl runs on a loaded machine */
    start_idemd();        /* returns while it answers -LOADING */
    load_delay_ms = 0;
    char sock[4200];
    snprintf(sock, sizeof sock, "--socket %s/idemd.sock", dir);
    cr_assert_eq(ctl("status %s", sock), 0, "%s", err);
    cr_assert(strstr(out, "attention") && strstr(out, "recovery is running") &&
                  strstr(out, "LOADING") && !strstr(out, "disk free"),
              "%s", out);
    cr_assert_eq(ctl("status %s --json", sock), 0, "%s", err);
    cr_assert(strstr(out, "\"verdict\":\"attention\"") && strstr(out, "\"loading\":1") &&
                  !strstr(out, "\"keys\""),
              "%s", out);
    cr_assert_eq(ctl("watch --count 1 %s", sock), 1, "watch has nothing to show yet");
    cr_assert(strstr(err, "LOADING"), "%s", err);
    char reply[256];
    for (int i = 0; i < 1000 && (sock_cmd("IDEM.GET none\r\n", reply, sizeof reply) != 0 ||
                                 strstr(reply, "LOADING"));
         i++)
        usleep(20000);
    cr_assert_eq(ctl("status %s --json", sock), 0, "%s", err);
    cr_assert(strstr(out, "\"loading\":0") && strstr(out, "\"keys\":0") &&
                  !strstr(out, "recovery is running"),
              "%s", out);
}

static void stop_idemd(void)
{
    if (idemd_pid > 0) {
        kill(idemd_pid, SIGTERM);
        waitpid(idemd_pid, NULL, 0);
    }
    idemd_pid = 0;
    teardown();
}

Test(idemctl_online, views_resolve_and_audit_over_the_socket, .init = setup, .fini = stop_idemd)
{
    start_idemd();
    char reply[512], sock[4200];
    snprintf(sock, sizeof sock, "--socket %s/idemd.sock", dir);
    cr_assert_eq(sock_cmd("IDEM.CLAIM pay-1 3600000 1000\r\n", reply, sizeof reply), 0);
    cr_assert(strstr(reply, "new"), "%s", reply);
    cr_assert_eq(sock_cmd("IDEM.CLAIM pay-2 3600000 1000\r\n", reply, sizeof reply), 0);
    cr_assert_eq(ctl("get pay-1 %s --json", sock), 0, "%s", err);
    cr_assert(strstr(out, "\"state\":\"in_flight\"") && strstr(out, "\"lease_left_ms\":"), "%s",
              out);
    cr_assert_eq(ctl("status %s --json --window 100ms", sock), 0, "%s", err);
    cr_assert(strstr(out, "\"keys_in_flight\":2"), "%s", out);
    cr_assert_eq(ctl("resolve pay-1 release --reason x %s", sock), 1, "lease runs");
    cr_assert(strstr(err, "--force"), "%s", err);
    cr_assert_eq(sock_cmd("DEBUG CLOCK ADVANCE 5000\r\n", reply, sizeof reply), 0);
    cr_assert_eq(ctl("resolve pay-1 release --reason 'not charged' %s", sock), 0, "%s", err);
    cr_assert_eq(ctl("resolve pay-2 commit --reason 'charged' --result ch_9 %s --json", sock), 0,
                 "%s", err);
    cr_assert(strstr(out, "\"result\":\"ch_9\""), "%s", out);
    cr_assert_eq(ctl("audit %s --json", sock), 0, "%s", err);
    cr_assert(strstr(out, "resolve-commit") && strstr(out, "resolve-release"), "%s", out);
    cr_assert_eq(ctl("scan --state committed %s", sock), 0, "%s", err);
    cr_assert(strstr(out, "pay-2"), "%s", out);
    cr_assert_eq(ctl("watch --count 2 --interval 100ms %s --json", sock), 0, "%s", err);
    cr_assert(strstr(out, "claims_per_s") && strchr(strchr(out, '\n') + 1, '\n'), "%s", out);
    /* Output that cannot be written ends a watch at its first line (it ran on, unseen, until
     * killed). */
    char cmd[16384], e[4200];
    snprintf(e, sizeof e, "%s/err", scratch);
    snprintf(cmd, sizeof cmd, "timeout 20 %s/idemctl watch %s --interval 100ms >/dev/full 2>%s",
             build_dir(), sock, e);
    int st = system(cmd);
    slurp(e, err, sizeof err);
    cr_assert(WIFEXITED(st) && WEXITSTATUS(st) == 1, "a watch to a full disk: status %d", st);
    cr_assert(strstr(err, "writing the output"), "%s", err);
    cr_assert_eq(sock_cmd("IDEM.CLAIM pay-3 3600000 1000\r\n", reply, sizeof reply), 0);
    cr_assert_eq(sock_cmd("DEBUG CLOCK ADVANCE 1000\r\n", reply, sizeof reply), 0);
    cr_assert_eq(ctl("attention %s --json", sock), 0, "%s", err);
    cr_assert(strstr(out, "\"key\":\"pay-3\"") && !strstr(out, "pay-1") && !strstr(out, "pay-2"),
              "%s", out);
    cr_assert_eq(ctl("status --dir %s", dir), 1, "idemd holds the store");
    cr_assert(strstr(err, "pid="), "%s", err);
}

/* A writer that claims and commits keys one by one over the socket, noting which were
 * acknowledged before a given moment. */
struct writer {
    atomic_int stop;
    atomic_int acked;         /* keys 0..acked-1 are acknowledged (claim and commit) */
    atomic_int before_backup; /* acked when the backup started */
};

static void *writer_main(void *arg)
{
    struct writer *w = arg;
    char line[128], reply[256];
    for (int i = 0; !atomic_load(&w->stop) && i < 100000; i++) {
        snprintf(line, sizeof line, "IDEM.CLAIM live-%d 3600000 60000\r\n", i);
        if (sock_cmd(line, reply, sizeof reply) != 0 || !strstr(reply, "new")) break;
        long long tok = 0;
        char *p = strstr(reply, ":");
        if (p) tok = atoll(p + 1);
        snprintf(line, sizeof line, "IDEM.COMMIT live-%d %lld r%d\r\n", i, tok, i);
        if (sock_cmd(line, reply, sizeof reply) != 0 || !strstr(reply, "OK")) break;
        atomic_store(&w->acked, i + 1);
    }
    return NULL;
}

Test(idemctl_online, backup_under_load_restores_every_acknowledged_key, .init = setup,
     .fini = stop_idemd, .timeout = 120)
{
    start_idemd();
    struct writer w = {0};
    pthread_t t;
    cr_assert_eq(pthread_create(&t, NULL, writer_main, &w), 0);
    while (atomic_load(&w.acked) < 50)
        usleep(1000);
    char sock[4200], backup[4200], restored[4200];
    snprintf(sock, sizeof sock, "--socket %s/idemd.sock", dir);
    snprintf(backup, sizeof backup, "%s/backup", scratch);
    snprintf(restored, sizeof restored, "%s/restored", scratch);
    atomic_store(&w.before_backup, atomic_load(&w.acked));
    int rc = ctl("backup %s %s", backup, sock);
    usleep(100000); /* the load goes on after the copy */
    atomic_store(&w.stop, 1);
    pthread_join(t, NULL);
    cr_assert_eq(rc, 0, "%s", err);
    cr_assert_eq(ctl("restore %s %s", backup, restored), 0, "%s", err);
    cr_assert_eq(ctl("verify %s", restored), 0, "%s%s", out, err);
    idem_store *s;
    cr_assert_eq(idem_open(restored, NULL, &s), IDEM_OK, "%s", idem_last_error());
    idem_queue *q;
    cr_assert_eq(idem_queue_open(s, 4, &q), IDEM_OK);
    int n = atomic_load(&w.before_backup);
    for (int i = 0; i < n; i++) {
        char key[32], res[32];
        snprintf(key, sizeof key, "live-%d", i);
        snprintf(res, sizeof res, "r%d", i);
        idem_completion c;
        cr_assert_eq(idem_get(q, key, strlen(key), &c), IDEM_OK);
        cr_assert(c.found, "%s, acknowledged before the backup, is not in it", key);
        cr_assert_eq(c.record.state, IDEM_STATE_COMMITTED);
        cr_assert(c.record.result_len == strlen(res) && !memcmp(c.record.result, res, strlen(res)));
    }
    idem_stats st;
    idem_get_stats(s, &st);
    cr_assert_eq(st.store_generation, 2, "a restore starts a new generation");
    idem_queue_close(q);
    cr_assert_eq(idem_close(s), IDEM_OK);
}

/* A store of about 64 MiB of incompressible values, written offline before idemd starts. */
static void prefill(int keys)
{
    idem_store *s;
    cr_assert_eq(idem_open(dir, NULL, &s), IDEM_OK, "%s", idem_last_error());
    idem_queue *q;
    cr_assert_eq(idem_queue_open(s, 256, &q), IDEM_OK);
    tu_fill_incompressible(q, keys);
    idem_queue_close(q);
    cr_assert_eq(idem_close(s), IDEM_OK);
}

static int64_t now_us(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000 + ts.tv_nsec / 1000;
}

/* IDEM.BACKUP copies on a thread of its own: idemd goes on answering other clients meanwhile
 * (it used to answer nobody until the copy was done). */
Test(idemctl_online, backup_does_not_stop_the_server, .init = setup, .fini = stop_idemd,
     .timeout = 120)
{
    prefill(16384);
    start_idemd();
    struct writer w = {0};
    pthread_t t;
    cr_assert_eq(pthread_create(&t, NULL, writer_main, &w), 0);
    while (atomic_load(&w.acked) < 20)
        usleep(1000);
    char sock[4200], backup[4200];
    snprintf(sock, sizeof sock, "--socket %s/idemd.sock", dir);
    snprintf(backup, sizeof backup, "%s/backup", scratch);
    int before = atomic_load(&w.acked);
    int64_t t0 = now_us();
    int rc = ctl("backup %s %s", backup, sock);
    int64_t t1 = now_us();
    int during = atomic_load(&w.acked) - before;
    atomic_store(&w.stop, 1);
    pthread_join(t, NULL);
    cr_assert_eq(rc, 0, "%s", err);
    /* Each claim and commit is a connection of its own: slower than the engine's callers. */
    cr_assert_geq(during, 5, "%d keys claimed and committed during a backup of %lld us", during,
                  (long long)(t1 - t0));
    cr_assert_eq(ctl("verify %s", backup), 0, "%s%s", out, err);
    /* A second backup into the same place is refused by name, and idemd goes on. */
    cr_assert_eq(ctl("backup %s %s", backup, sock), 1);
    cr_assert(strstr(err, "backup into"), "%s", err);
    /* A relative DEST is idemctl's, as offline (idemd would have taken it under its own
     * working directory). */
    char cmd[16384];
    snprintf(cmd, sizeof cmd, "cd %s && timeout 60 %s/idemctl backup rel %s >/dev/null 2>&1",
             scratch, build_dir(), sock);
    cr_assert_eq(system(cmd), 0);
    cr_assert(in_scratch("rel/super"), "the copy is not where idemctl ran");
}

/* IDEMCTL_PASSWORD alone authenticates as the user named default; against an idemd without
 * users it is not needed and does no harm. */
Test(idemctl_online, the_password_variable_alone_authenticates, .init = setup, .fini = stop_idemd)
{
    start_idemd_with("default:admin:sekrit"); /* NOAUTH says nothing of LOADING: wait below */
    char sock[4200];
    snprintf(sock, sizeof sock, "--socket %s/idemd.sock", dir);
    cr_assert_eq(setenv("IDEMCTL_PASSWORD", "sekrit", 1), 0);
    int rc = 1;
    for (int i = 0; i < 500 && (rc = ctl("status %s --json", sock)) != 0 && strstr(err, "LOADING");
         i++)
        usleep(20 * 1000);
    cr_assert_eq(rc, 0, "%s", err);
    cr_assert(strstr(out, "\"verdict\""), "%s", out);
    unsetenv("IDEMCTL_PASSWORD");
    cr_assert_eq(ctl("get k %s", sock), 1);
    cr_assert(strstr(err, "NOAUTH"), "%s", err);
    cr_assert_eq(ctl("status %s --json", sock), 1);
    cr_assert_eq(setenv("IDEMCTL_PASSWORD", "wrong", 1), 0);
    cr_assert_eq(ctl("status %s", sock), 1);
    cr_assert(strstr(err, "authentication failed"), "%s", err);
    kill(idemd_pid, SIGTERM);
    waitpid(idemd_pid, NULL, 0);
    start_idemd();
    cr_assert_eq(ctl("status %s --json", sock), 0, "no users: the variable is not needed: %s", err);
    unsetenv("IDEMCTL_PASSWORD");
}

Test(idemctl_online, connection_failure_is_reported, .init = setup, .fini = teardown)
{
    cr_assert_eq(ctl("status --socket %s/none.sock", dir), 1);
    cr_assert(strstr(err, "cannot connect"), "%s", err);
}

/* A server that answers one byte of a never-ending bulk string every 100 ms, for 6 s. */
static void *trickle_main(void *arg)
{
    int lfd = *(int *)arg;
    int fd = accept(lfd, NULL, NULL);
    if (fd < 0) return NULL;
    char req[4096];
    (void)!read(fd, req, sizeof req);
    (void)!send(fd, "$1000000\r\n", 10, MSG_NOSIGNAL);
    for (int i = 0; i < 60 && send(fd, "x", 1, MSG_NOSIGNAL) == 1; i++)
        usleep(100 * 1000);
    close(fd);
    return NULL;
}

/* --timeout bounds a whole reply, not each wait for a byte. */
Test(idemctl_online, a_reply_that_trickles_in_is_cut_off_at_the_timeout, .init = setup,
     .fini = teardown)
{
    char path[4200];
    snprintf(path, sizeof path, "%s/trickle.sock", scratch);
    int lfd = socket(AF_UNIX, SOCK_STREAM, 0);
    struct sockaddr_un a = {.sun_family = AF_UNIX};
    cr_assert(strlen(path) < sizeof a.sun_path);
    memcpy(a.sun_path, path, strlen(path) + 1);
    cr_assert_eq(bind(lfd, (struct sockaddr *)&a, sizeof a), 0);
    cr_assert_eq(listen(lfd, 4), 0);
    pthread_t t;
    cr_assert_eq(pthread_create(&t, NULL, trickle_main, &lfd), 0);
    int64_t t0 = now_us();
    cr_assert_eq(ctl("get k --socket %s --timeout 1s", path), 1);
    int64_t took_ms = (now_us() - t0) / 1000;
    cr_assert(strstr(err, "did not answer within 1000 ms"), "%s", err);
    cr_assert_lt(took_ms, 4000, "idemctl waited %lld ms", (long long)took_ms);
    pthread_join(t, NULL);
    close(lfd);
}

/* A stand-in for idemd on a unix socket: every request it reads is answered "+OK". */
/* A unix socket listening at path (bound anew). */
static int unix_listener(const char *path, int backlog)
{
    struct sockaddr_un sa = {.sun_family = AF_UNIX};
    cr_assert_lt(strlen(path), sizeof sa.sun_path);
    strcpy(sa.sun_path, path);
    int fd = socket(AF_UNIX, SOCK_STREAM, 0);
    cr_assert_geq(fd, 0);
    cr_assert_eq(bind(fd, (struct sockaddr *)&sa, sizeof sa), 0, "%s", strerror(errno));
    cr_assert_eq(listen(fd, backlog), 0);
    return fd;
}

struct ok_server {
    int fd;
    char path[200];
    pthread_t t;
    const char *reply; /* NULL: +OK */
    size_t reply_len;
    const char *stats_reply; /* to IDEM.STATS, when set */
};

static void *ok_server_main(void *arg)
{
    struct ok_server *o = arg;
    for (;;) {
        int c = accept(o->fd, NULL, NULL);
        if (c < 0) return NULL;
        char buf[4096];
        ssize_t got;
        while ((got = read(c, buf, sizeof buf - 1)) > 0) {
            buf[got] = 0;
            const char *r = o->reply ? o->reply : "+OK\r\n";
            size_t n = o->reply ? o->reply_len : 5;
            if (o->stats_reply && strstr(buf, "IDEM.STATS")) { /* one request a read, here */
                r = o->stats_reply;
                n = strlen(r);
            }
            if (send(c, r, n, MSG_NOSIGNAL) != (ssize_t)n) break; /* idemctl may have left */
        }
        close(c);
    }
}

/* --timeout bounds the connect too: a wedged idemd whose listen queue is full held idemctl in
 * connect(2) for good (on a unix socket; about 2 min for TCP to an address that drops SYNs). */
Test(idemctl, a_connect_to_a_full_listen_queue_ends_at_the_timeout, .init = setup, .fini = teardown)
{
    char path[200];
    snprintf(path, sizeof path, "%s/full.sock", scratch);
    int l = unix_listener(path, 0);
    struct sockaddr_un sa = {.sun_family = AF_UNIX};
    strcpy(sa.sun_path, path);
    int held[4], nheld = 0; /* fill the queue: never accepted */
    for (; nheld < 4; nheld++) {
        held[nheld] = socket(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK, 0);
        if (connect(held[nheld], (struct sockaddr *)&sa, sizeof sa) < 0) {
            cr_assert_eq(errno, EAGAIN, "%s", strerror(errno));
            close(held[nheld]);
            break;
        }
    }
    cr_assert_gt(nheld, 0);
    int64_t t0 = now_us();
    cr_assert_eq(ctl("status --socket %s --timeout 1s", path), 1, "%s", out);
    int64_t took = (now_us() - t0) / 1000;
    cr_assert(strstr(err, "cannot connect") && strstr(err, "timed out"), "%s", err);
    cr_assert_lt(took, 10000, "took %lld ms", (long long)took);
    for (int i = 0; i < nheld; i++)
        close(held[i]);
    close(l);
}

/* An idemd that answers a list with something else (+OK) is an error, not an empty list:
 * attention said "nothing needs attention", audit "no decisions recorded", and exited 0. */
Test(idemctl, a_reply_that_is_not_a_list_is_an_error, .init = setup, .fini = teardown)
{
    struct ok_server o = {0};
    snprintf(o.path, sizeof o.path, "%s/ok.sock", scratch);
    o.fd = unix_listener(o.path, 4);
    cr_assert_eq(pthread_create(&o.t, NULL, ok_server_main, &o), 0);
    cr_assert_eq(ctl("attention --socket %s", o.path), 1, "%s", out);
    cr_assert(strstr(err, "IDEM.ATTENTION: unexpected reply"), "%s", err);
    cr_assert_eq(ctl("audit --socket %s", o.path), 1, "%s", out);
    cr_assert(strstr(err, "IDEM.AUDIT: unexpected reply"), "%s", err);
    /* A scan whose key comes as a simple string with a NUL in it: its length was kept past
     * the copy (which stopped at the NUL), and the key printed from beyond it. */
    static char nul_key[600];
    int n = snprintf(nul_key, sizeof nul_key, "*2\r\n$1\r\n0\r\n*1\r\n+");
    memset(nul_key + n, 'A', 500);
    nul_key[n] = 0;
    memcpy(nul_key + n + 500, "\r\n", 2);
    o.reply = nul_key;
    o.reply_len = (size_t)n + 502;
    cr_assert_eq(ctl("scan --socket %s", o.path), 1, "%s", out);
    cr_assert(strstr(err, "IDEM.SCAN: unexpected reply"), "%s", err);
    /* A reply of more values than any idemctl asks for (7 M of 4 bytes, 28 MB): its tree took
     * 48 bytes a value, 12 times the bytes' bound. */
    size_t many = 7u << 20;
    char *big = malloc(16 + 4 * many);
    cr_assert(big);
    n = snprintf(big, 16, "*%zu\r\n", many);
    for (size_t i = 0; i < many; i++)
        memcpy(big + n + 4 * i, ":0\r\n", 4);
    o.stats_reply = NULL;
    o.reply = big;
    o.reply_len = (size_t)n + 4 * many;
    cr_assert_eq(ctl("scan --socket %s", o.path), 1, "%s", out);
    cr_assert(strstr(err, "more than 6291456 values"), "%s", err);
    shutdown(o.fd, SHUT_RDWR);
    close(o.fd);
    pthread_join(o.t, NULL);
    free(big);
}

/* A fake idemd for one connection: it answers its i-th request with replies[i] and closes the
 * connection at the first NULL. idemctl sends a request and waits for its reply: one a read. */
struct script_server {
    int fd;
    char path[200];
    pthread_t t;
    const char *replies[8];
    char got[8][512]; /* the requests read (their first bytes), in turn */
    int rc;           /* idemctl's exit status */
};

static void *script_server_main(void *arg)
{
    struct script_server *o = arg;
    int c = accept(o->fd, NULL, NULL);
    if (c < 0) return NULL;
    char buf[4096];
    ssize_t n;
    for (int i = 0; i < 8 && o->replies[i] && (n = read(c, buf, sizeof buf)) > 0; i++) {
        size_t keep = (size_t)n < sizeof o->got[i] - 1 ? (size_t)n : sizeof o->got[i] - 1;
        memcpy(o->got[i], buf, keep);
        o->got[i][keep] = 0;
        if (send(c, o->replies[i], strlen(o->replies[i]), MSG_NOSIGNAL) < 0) break;
    }
    close(c);
    return NULL;
}

static void script_server_run(struct script_server *o, const char *cmd)
{
    snprintf(o->path, sizeof o->path, "%s/script.sock", scratch);
    unlink(o->path);
    o->fd = unix_listener(o->path, 4);
    cr_assert_eq(pthread_create(&o->t, NULL, script_server_main, o), 0);
    o->rc = ctl("%s --socket %s", cmd, o->path);
    shutdown(o->fd, SHUT_RDWR);
    close(o->fd);
    pthread_join(o->t, NULL);
}

/* An error reply's bytes reached the terminal as they were (keys and actors are escaped
 * everywhere else): an escape sequence in it was the terminal's to act on. */
Test(idemctl, an_error_reply_reaches_the_terminal_escaped, .init = setup, .fini = teardown)
{
    struct script_server o = {.replies = {"-ERR boom\x1b[2J\r\n", NULL}};
    script_server_run(&o, "attention");
    cr_assert(strstr(err, "IDEM.ATTENTION: ERR boom\\x1b[2J"), "%s", err);
    cr_assert_null(strchr(err, '\x1b'), "%s", err);
}

/* idemd says whether it cut the attention list to its reply room (WITHCUT); one before that
 * is told by fewer review records listed than the store holds. Either is said once. */
Test(idemctl, an_attention_list_cut_by_idemd_is_said_cut, .init = setup, .fini = teardown)
{
    /* An attention list shorter than the store's review records, from an idemd before WITHCUT
     * (which cut it to its reply room without a word): idemctl says more may need attention. */
    struct script_server old = {
        .replies = {"-ERR syntax error: option without a value\r\n", "*0\r\n",
                    "*4\r\n$11\r\nkeys_review\r\n:3\r\n$14\r\nstore_clock_ms\r\n:1000\r\n", NULL}};
    script_server_run(&old, "attention");
    cr_assert_eq(old.rc, 0, "out: %s err: %s", out, err);
    cr_assert(strstr(old.got[0], "IDEM.ATTENTION") && strstr(old.got[0], "WITHCUT"), "%s",
              old.got[0]);
    cr_assert(strstr(old.got[1], "IDEM.ATTENTION") && !strstr(old.got[1], "WITHCUT"),
              "the request to an idemd before WITHCUT: %s", old.got[1]);
    cr_assert(strstr(err, "the store holds 3 in review") && strstr(err, "more may need attention"),
              "out: %s err: %s", out, err);
    /* An idemd that says it cut the list, once, not twice. */
    struct script_server cut = {.replies = {"*2\r\n:1\r\n*0\r\n",
                                            "*4\r\n$11\r\nkeys_review\r\n:3\r\n$14\r\n"
                                            "store_clock_ms\r\n:1000\r\n",
                                            NULL}};
    script_server_run(&cut, "attention");
    cr_assert_eq(cut.rc, 0, "out: %s err: %s", out, err);
    cr_assert(strstr(err, "idemd cut the list to fit its reply"), "out: %s err: %s", out, err);
    cr_assert_null(strstr(err, "the store holds 3 in review"), "%s", err);
}

#define FLAT_REVIEW_V5                                                                             \
    "*6\r\n$3\r\nkey\r\n$1\r\nk\r\n$5\r\nstate\r\n$6\r\nreview\r\n$7\r\nversion\r\n:5\r\n"
#define FLAT_IN_FLIGHT_V7                                                                          \
    "*6\r\n$3\r\nkey\r\n$1\r\nk\r\n$5\r\nstate\r\n$9\r\nin_flight\r\n$7\r\nversion\r\n:7\r\n"
#define STATS_CLOCK "*2\r\n$14\r\nstore_clock_ms\r\n:1000\r\n"

/* resolve reports the decision the store took, not a read after it: a read that failed printed
 * nothing and exited 0 (the operator, seeing an error, decided again), and a worker's claim
 * between the decision and the read was shown as the decision's outcome. */
Test(idemctl, resolve_reports_the_decision_not_a_read_after_it, .init = setup, .fini = teardown)
{
    /* The read after the decision fails: idemd closes the connection. */
    struct script_server o = {.replies = {FLAT_REVIEW_V5, STATS_CLOCK, "+OK\r\n", NULL}};
    script_server_run(&o, "resolve k release --reason 'no charge'");
    cr_assert(strstr(out, "k: review (version 5) -> released, the next claim gets new; recorded"),
              "out: %s err: %s", out, err);
    cr_assert(strstr(err, "the decision was recorded; reading the record after it failed"), "%s",
              err);
    /* A worker claimed the key in between: the release is reported, and the claim as a change. */
    struct script_server o2 = {
        .replies = {FLAT_REVIEW_V5, STATS_CLOCK, "+OK\r\n", FLAT_IN_FLIGHT_V7, NULL}};
    script_server_run(&o2, "resolve k release --reason 'no charge'");
    cr_assert(strstr(out, "k: review (version 5) -> released"), "out: %s err: %s", out, err);
    cr_assert(strstr(out, "k changed since: it is now in_flight (version 7)"), "%s", out);
    cr_assert_null(strstr(out, "-> in_flight"), "%s", out);
    struct script_server o3 = {
        .replies = {FLAT_REVIEW_V5, STATS_CLOCK, "+OK\r\n", FLAT_IN_FLIGHT_V7, NULL}};
    script_server_run(&o3, "resolve k release --reason 'no charge' --json");
    cr_assert(strstr(out, "\"decided\":\"absent\""), "%s", out);
    cr_assert(strstr(out, "\"after\":{"), "%s", out);
}

/* scan --json closed its list after a scan cut short (exit 1), so a pipeline that does not look
 * at the exit status read part of the keys as all of them. */
Test(idemctl, a_scan_cut_short_leaves_its_json_list_open, .init = setup, .fini = teardown)
{
    struct script_server o = {.replies = {"*2\r\n$1\r\n7\r\n*1\r\n$1\r\na\r\n", NULL}};
    script_server_run(&o, "scan --json");
    cr_assert(strstr(out, "\"a\""), "out: %s err: %s", out, err);
    cr_assert_null(strchr(out, ']'), "%s", out);
}

/* --result-max is the offline stand-in for idemd's limit: online it was taken and ignored. */
Test(idemctl, result_max_online_is_a_usage_error, .init = setup, .fini = teardown)
{
    cr_assert_eq(
        ctl("resolve k commit --result x --result-max 1 --reason r --socket %s/none.sock", scratch),
        2, "%s", err);
    cr_assert(strstr(err, "--result-max goes with --dir"), "%s", err);
}

/* The highest checkpoint id a store directory holds (0: none). */
static unsigned long long ckpt_id_max(const char *d)
{
    DIR *dp = opendir(d);
    cr_assert(dp);
    unsigned long long max = 0, id;
    const struct dirent *e;
    while ((e = readdir(dp)))
        if (sscanf(e->d_name, "index-%16llx.ckpt", &id) == 1 && id > max) max = id;
    closedir(dp);
    return max;
}

/* An offline resolve is acknowledged once its decision is in the log (durability sync): a
 * checkpoint at close that then fails left the decision made and exited 1, and a script that
 * ran it again was refused (the record was gone). */
Test(idemctl, an_offline_decision_stands_when_the_close_after_it_fails, .init = setup,
     .fini = teardown)
{
    write_store();
    char path[4300];
    snprintf(path, sizeof path, "%s/index-%016llx.ckpt", dir, ckpt_id_max(dir) + 1);
    cr_assert_eq(mkdir(path, 0700), 0, "%s", strerror(errno)); /* the next checkpoint fails */
    cr_assert_eq(ctl("resolve held-1 release --reason 'no charge' --dir %s", dir), 0,
                 "out: %s err: %s", out, err);
    cr_assert(strstr(out, "held-1: review (version"), "%s", out);
    cr_assert(strstr(err, "closing the store") && strstr(err, "durable in its log"), "%s", err);
    cr_assert_eq(rmdir(path), 0);
    cr_assert_eq(ctl("get held-1 --dir %s", dir), 1, "out: %s err: %s", out, err);
    cr_assert(strstr(err, "no record") || strstr(out, "no record"), "out: %s err: %s", out, err);
}
