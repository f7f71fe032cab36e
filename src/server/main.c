/*
 * main.c: idemd's entry: flags (--name value or --name=value), the --config file of `name value`
 * lines (the same names without dashes; `#` starts a comment), --help, the open-files limit, and
 * the hand-over to the event loop (loop.c), after huge pages for malloc's heap (huge_pages.c). Exit
 * codes: 0 clean shutdown, 1 failure, 2 usage.
 */
#include "server.h"
#include "huge_pages.h"

#include <ctype.h>
#include <errno.h>
#include <malloc.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

static const char usage_text[] =
    "usage: idemd [options]\n"
    "idemd serves an idem store over RESP2 (redis-cli and Redis clients work unchanged).\n"
    "\n"
    "Store:\n"
    "  --dir DIR                 store directory (default ./idem-data)\n"
    "  --durability MODE         sync: reply after the flush that covers the change (group\n"
    "                            commit; default); batch: reply at once, flush at least every\n"
    "                            10 ms; none: leave flushing to the OS\n"
    "  --on-lease-expiry P       recover (default): an expired lease goes to the next claimant\n"
    "                            as `recover`; review: it is held for a person\n"
    "  --max-keys N              refuse new claims (-FULL) past N records; never evict\n"
    "  --max-memory BYTES        likewise for the index's memory (suffixes k, m, g)\n"
    "  --max-disk BYTES          likewise for the store's files (log, checkpoints, audit)\n"
    "  --result-max BYTES        largest result or SET value (default 65536, at most 1m)\n"
    "  --test-clock              the store clock stands still; DEBUG CLOCK GET|SET|ADVANCE\n"
    "                            move it (for tests only)\n"
    "Listeners:\n"
    "  --socket PATH             unix socket (default DIR/idemd.sock; empty: none)\n"
    "  --socket-mode MODE        its permissions, octal (default 0600)\n"
    "  --bind ADDR               TCP address, IPv4 or IPv6 (default 127.0.0.1; :: or 0.0.0.0:\n"
    "                            every interface)\n"
    "  --port N                  TCP port (default 7379; 0: no TCP listener)\n"
    "  --metrics-listen ADDR:PORT  Prometheus text endpoint (default off; IPv6 in brackets:\n"
    "                            [::1]:9379)\n"
    "Users (without any, unix socket connections are admin and TCP ones workers):\n"
    "  --user NAME:ROLE:PASSWORD repeatable; ROLE is worker, reader or admin; `AUTH password`\n"
    "                            alone authenticates as the user named default\n"
    "  --users-file FILE         one NAME:ROLE:PASSWORD a line; no permission for group or others\n"
    "Limits:\n"
    "  --max-clients N           connections at once (default 10000)\n"
    "  --pipeline-max N          requests one connection may have outstanding (default 1024)\n"
    "  --client-output-max BYTES unread replies after which a client is closed (default 64m)\n"
    "  --io-budget BYTES         input and output buffers of all clients; past it clients\n"
    "                            with 256k of unread replies stop being read (closed after 2 s\n"
    "                            without reading) and large requests are read a few at a time\n"
    "                            (default 1g, at least 1m)\n"
    "  --idle-timeout-ms MS      close connections idle this long (default 0: never)\n"
    "  --queue-depth N           engine operations in flight (default 8192); at most half\n"
    "                            of them may be claims parked by WAIT\n"
    "Other:\n"
    "  --config FILE             read `name value` lines (the flags above, without --)\n"
    "  --help                    this text\n"
    "  --version                 the version\n"
    "Signals: SIGTERM or SIGINT drain (stop accepting, answer in-flight requests, make\n"
    "everything durable) and exit 0. A fatal store error exits 1.\n";

/* Parses a count of digits alone (strtoull would take blanks, a sign, and wrap a minus). */
static int parse_digits(const char *v, uint64_t *out, char **end)
{
    if (!isdigit((unsigned char)v[0])) return -1;
    errno = 0;
    unsigned long long n = strtoull(v, end, 10);
    if (errno) return -1;
    *out = n;
    return 0;
}

/* A time in milliseconds: digits alone (a suffix would read as powers of 1024: 1m, 1,048,576). */
static int parse_ms(const char *v, uint64_t *out)
{
    char *end;
    return parse_digits(v, out, &end) < 0 || *end != '\0' ? -1 : 0;
}

/* Parses a byte count with an optional k/m/g suffix (powers of 1024). */
static int parse_size(const char *v, uint64_t *out)
{
    char *end;
    uint64_t n;
    if (parse_digits(v, &n, &end) < 0) return -1;
    uint64_t mult = 1;
    if (*end == 'k' || *end == 'K')
        mult = 1024;
    else if (*end == 'm' || *end == 'M')
        mult = 1024 * 1024;
    else if (*end == 'g' || *end == 'G')
        mult = 1024ull * 1024 * 1024;
    if (mult != 1) end++;
    if (*end != '\0' || n > UINT64_MAX / mult) return -1;
    *out = n * mult;
    return 0;
}

static int set_string(char *dst, size_t cap, const char *v)
{
    if (strlen(v) >= cap) return -1;
    strcpy(dst, v);
    return 0;
}

const char *srv_durability_name(int durability)
{
    return durability == IDEM_DURABILITY_SYNC    ? "sync"
           : durability == IDEM_DURABILITY_BATCH ? "batch"
                                                 : "none";
}

const char *srv_lease_policy_name(int policy)
{
    return policy == IDEM_LEASE_REVIEW ? "review" : "recover";
}

static int parse_u32(const char *v, uint32_t min, uint32_t max, uint32_t *out)
{
    uint64_t n;
    if (parse_size(v, &n) < 0 || n < min || n > max) return -1;
    *out = (uint32_t)n;
    return 0;
}

/* An address --bind takes: IPv4, or IPv6 with or without brackets. */
static int bad_addr(const char *v)
{
    struct sockaddr_storage ss;
    socklen_t len;
    return srv_addr_parse(v, 0, &ss, &len) != 0;
}

/* ADDR:PORT of --metrics-listen. */
static int bad_listen(const char *v)
{
    char host[64];
    int port;
    return srv_addr_split(v, host, sizeof host, &port) != 0;
}

static int config_file(srv_config *cfg, const char *path, char *err, size_t err_len);

/* How much of a setting's name an error shows: up to 64 bytes, and not past a ':' or '=' (a
 * user line written wrong, `user=NAME:ROLE:PASSWORD` or the line alone, holds a password). */
static int shown(const char *name)
{
    size_t n = strcspn(name, ":=");
    return n < 64 ? (int)n : 64;
}

/* The value of a yes/no setting (empty: yes, as the flag alone). Returns 0 or 1, or -1. */
static int parse_yes_no(const char *v)
{
    static const char *const yes[] = {"", "yes", "on", "true", "1"};
    static const char *const no[] = {"no", "off", "false", "0"};
    for (size_t i = 0; i < sizeof yes / sizeof yes[0]; i++)
        if (strcmp(v, yes[i]) == 0) return 1;
    for (size_t i = 0; i < sizeof no / sizeof no[0]; i++)
        if (strcmp(v, no[i]) == 0) return 0;
    return -1;
}

/* Applies one setting. Returns 0, or -1 with a message in err. */
static int apply(srv_config *cfg, const char *name, const char *v, char *err, size_t err_len)
{
    int bad = 0;
    uint64_t n = 0;
    if (strcmp(name, "dir") == 0)
        bad = set_string(cfg->dir, sizeof cfg->dir, v);
    else if (strcmp(name, "socket") == 0) {
        bad = set_string(cfg->socket_path, sizeof cfg->socket_path, v);
        cfg->socket_path_set = 1;
    } else if (strcmp(name, "socket-mode") == 0) {
        char *end;
        errno = 0;
        unsigned long mode = strtoul(v, &end, 8);
        bad = !isdigit((unsigned char)*v) || *end != '\0' || errno || mode > 0777;
        cfg->socket_mode = bad ? 0 : (unsigned)mode;
    } else if (strcmp(name, "bind") == 0)
        bad = set_string(cfg->bind_addr, sizeof cfg->bind_addr, v) || bad_addr(v);
    else if (strcmp(name, "port") == 0)
        bad = srv_addr_port(v, 0, &cfg->port);
    else if (strcmp(name, "durability") == 0) {
        cfg->durability = strcmp(v, "sync") == 0    ? IDEM_DURABILITY_SYNC
                          : strcmp(v, "batch") == 0 ? IDEM_DURABILITY_BATCH
                          : strcmp(v, "none") == 0  ? IDEM_DURABILITY_NONE
                                                    : -1;
        bad = cfg->durability < 0;
    } else if (strcmp(name, "on-lease-expiry") == 0) {
        cfg->lease_policy = strcmp(v, "recover") == 0  ? IDEM_LEASE_RECOVER
                            : strcmp(v, "review") == 0 ? IDEM_LEASE_REVIEW
                                                       : -1;
        bad = cfg->lease_policy < 0;
    } else if (strcmp(name, "user") == 0)
        return auth_user_add(cfg, v, err, err_len);
    else if (strcmp(name, "users-file") == 0)
        return auth_users_file(cfg, v, err, err_len);
    else if (strcmp(name, "config") == 0)
        return config_file(cfg, v, err, err_len);
    else if (strcmp(name, "test-clock") == 0) {
        int yes = parse_yes_no(v);
        if (yes < 0) {
            snprintf(err, err_len, "test-clock takes yes or no, not '%s'", v);
            return -1;
        }
        cfg->test_clock = yes;
    } else if (strcmp(name, "max-keys") == 0)
        bad = parse_size(v, &cfg->max_keys);
    else if (strcmp(name, "max-memory") == 0)
        bad = parse_size(v, &cfg->max_memory_bytes);
    else if (strcmp(name, "max-disk") == 0)
        bad = parse_size(v, &cfg->max_disk_bytes);
    else if (strcmp(name, "result-max") == 0)
        bad = parse_u32(v, 1, IDEM_RESULT_BYTES_LIMIT, &cfg->result_bytes_max);
    else if (strcmp(name, "metrics-listen") == 0)
        bad = set_string(cfg->metrics_listen, sizeof cfg->metrics_listen, v) || bad_listen(v);
    else if (strcmp(name, "max-clients") == 0)
        bad = parse_u32(v, 1, 1000000, &cfg->max_clients);
    else if (strcmp(name, "pipeline-max") == 0)
        bad = parse_u32(v, 1, 65536, &cfg->pipeline_max);
    else if (strcmp(name, "queue-depth") == 0)
        bad = parse_u32(v, 256, 65536, &cfg->queue_depth);
    else if (strcmp(name, "client-output-max") == 0)
        bad = parse_size(v, &cfg->client_output_max) || cfg->client_output_max < 65536;
    else if (strcmp(name, "io-budget") == 0)
        bad = parse_size(v, &cfg->io_budget_bytes) || cfg->io_budget_bytes < SRV_IO_BUDGET_MIN;
    else if (strcmp(name, "idle-timeout-ms") == 0)
        bad = parse_ms(v, &n) || n > SRV_IDLE_TIMEOUT_MS_MAX, cfg->idle_timeout_ms = n;
    else {
        snprintf(err, err_len, "unknown setting '%.*s%s' (see --help)", shown(name), name,
                 name[shown(name)] ? "..." : "");
        return -1;
    }
    if (bad) snprintf(err, err_len, "bad value '%s' for %s (see --help)", v, name);
    return bad ? -1 : 0;
}

/* A config file may hold users (passwords): then, as a users file, it must not be accessible by
 * group or others. */
static int config_file(srv_config *cfg, const char *path, char *err, size_t err_len)
{
    char line[2048];
    FILE *f = fopen(path, "r");
    if (!f) {
        snprintf(err, err_len, "cannot open config file %s: %s", path, strerror(errno));
        return -1;
    }
    struct stat st;
    int shared = fstat(fileno(f), &st) != 0 || (st.st_mode & (S_IRWXG | S_IRWXO));
    int lineno = 0, rc = 0;
    char *p;
    while (rc == 0 &&
           (rc = conf_line_next(f, path, line, sizeof line, &lineno, &p, err, err_len)) > 0) {
        rc = 0;
        char *sp = p + strcspn(p, " \t");
        char *val = *sp ? sp + 1 + strspn(sp + 1, " \t") : sp;
        *sp = '\0';
        char why[256];
        if (strchr(p, '=')) {
            /* Not echoed whole: a user line so written holds a password. */
            snprintf(why, sizeof why,
                     "'%.*s...': settings are written `name value` (a blank, not '=')", shown(p),
                     p);
            rc = -1;
        } else if (strcmp(p, "user") == 0 && shared) {
            snprintf(why, sizeof why,
                     "a user line (a password) in a file accessible by group or others: chmod "
                     "600 the file, or move the users to a --users-file");
            rc = -1;
        } else if (strcmp(p, "config") == 0) {
            snprintf(why, sizeof why, "config files do not nest");
            rc = -1;
        } else if (apply(cfg, p, val, why, sizeof why) < 0) {
            rc = -1;
        }
        if (rc < 0) snprintf(err, err_len, "%s:%d: %s", path, lineno, why);
    }
    fclose(f);
    return rc;
}

static void config_defaults(srv_config *c)
{
    memset(c, 0, sizeof *c);
    strcpy(c->dir, "./idem-data");
    c->socket_mode = 0600;
    strcpy(c->bind_addr, "127.0.0.1");
    c->port = 7379;
    c->durability = IDEM_DURABILITY_SYNC;
    c->lease_policy = IDEM_LEASE_RECOVER;
    c->max_clients = 10000;
    c->pipeline_max = 1024;
    c->client_output_max = 64ull << 20;
    c->io_budget_bytes = 1ull << 30;
    c->queue_depth = 8192;
}

/* Parses argv. Returns 0 to run, 1 after --help/--version, 2 on a usage error. */
static int parse_args(srv_config *cfg, int argc, char **argv)
{
    char err[512];
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (strcmp(a, "--help") == 0 || strcmp(a, "-h") == 0) {
            fputs(usage_text, stdout);
            return 1;
        }
        if (strcmp(a, "--version") == 0) {
            printf("idemd %s\n", IDEM_VERSION_STRING);
            return 1;
        }
        if (strcmp(a, "--test-clock") == 0) {
            cfg->test_clock = 1;
            continue;
        }
        if (strncmp(a, "--", 2) != 0) {
            fprintf(stderr, "idemd: unexpected argument '%s' (see --help)\n", a);
            return 2;
        }
        char name[64];
        const char *eq = strchr(a, '='), *val;
        size_t nl = eq ? (size_t)(eq - a - 2) : strlen(a + 2);
        if (nl >= sizeof name) {
            fprintf(stderr, "idemd: unknown option %.80s (see --help)\n", a);
            return 2;
        }
        if (!eq && i + 1 >= argc) {
            fprintf(stderr, "idemd: %s needs a value (see --help)\n", a);
            return 2;
        }
        memcpy(name, a + 2, nl);
        name[nl] = '\0';
        val = eq ? eq + 1 : argv[++i];
        if (apply(cfg, name, val, err, sizeof err) < 0) {
            fprintf(stderr, "idemd: %s\n", err);
            return 2;
        }
    }
    /* A smaller output limit than the largest reply would close a client each time it reads
     * such a record, and its worker would retry for ever. */
    uint64_t reply_max = srv_record_reply_max(cfg);
    if (cfg->client_output_max < reply_max) {
        fprintf(stderr,
                "idemd: --client-output-max %llu is below the largest reply (%llu: --result-max "
                "plus 8 KiB): a client reading a record with a large result would be closed\n",
                (unsigned long long)cfg->client_output_max, (unsigned long long)reply_max);
        return 2;
    }
    if (!cfg->socket_path_set &&
        snprintf(cfg->socket_path, sizeof cfg->socket_path, "%s/idemd.sock", cfg->dir) >=
            (int)sizeof cfg->socket_path) {
        fprintf(stderr,
                "idemd: the socket path %s/idemd.sock is longer than %zu bytes: give a shorter "
                "--socket PATH (or --socket '' for none)\n",
                cfg->dir, sizeof cfg->socket_path - 1);
        return 2;
    }
    return 0;
}

/* Raises the soft open-files limit to max-clients + NOFILE_SPARE where the hard limit allows,
 * and further up to NOFILE_AHEAD more: the store keeps one descriptor open per log segment
 * (a log of 100 GiB has 1,600), which NOFILE_SPARE alone would leave to chance. Where the hard
 * limit does not allow max-clients + NOFILE_SPARE, max-clients is lowered to fit (as Redis
 * does), so that a client past it is told so instead of the server running out of descriptors
 * (srv_accept copes with that too). */
#define NOFILE_SPARE 64     /* descriptors kept for the store's files, listeners and the loop */
#define NOFILE_AHEAD 65536u /* and, where the hard limit allows, this many more */
static void raise_nofile(srv_config *cfg)
{
    struct rlimit rl;
    if (getrlimit(RLIMIT_NOFILE, &rl) != 0) return;
    rlim_t want = (rlim_t)cfg->max_clients + NOFILE_SPARE, ahead = want + NOFILE_AHEAD;
    rlim_t to = rl.rlim_max == RLIM_INFINITY || rl.rlim_max > ahead ? ahead : rl.rlim_max;
    if (rl.rlim_cur < to) {
        rl.rlim_cur = to;
        setrlimit(RLIMIT_NOFILE, &rl);
        getrlimit(RLIMIT_NOFILE, &rl);
    }
    if (rl.rlim_cur < want) {
        uint32_t fit = rl.rlim_cur > 2 * NOFILE_SPARE ? (uint32_t)(rl.rlim_cur - NOFILE_SPARE)
                                                      : (uint32_t)(rl.rlim_cur / 2);
        if (fit == 0) fit = 1;
        srv_log("warn", "nofile_limit",
                "limit=%llu max_clients=%u lowered_to=%u msg=\"the open-files limit is too low for "
                "max-clients; raise the hard limit (ulimit -Hn) to keep it\"",
                (unsigned long long)rl.rlim_cur, cfg->max_clients, fit);
        cfg->max_clients = fit;
    }
}

int main(int argc, char **argv)
{
    huge_pages_reexec(argv);
    /* Blocks over 256 KiB (large replies, reads' results) are mapped and unmapped on their own,
     * so that what a burst took goes back to the system once freed. Left to itself glibc raises
     * this threshold to the largest block freed (up to 32 MiB) and keeps such blocks in its
     * heaps: a single IDEM.SCAN of 8 MB left idemd 10 MB larger for good. A threshold set in
     * GLIBC_TUNABLES is the operator's and is kept. */
    const char *tunables = getenv("GLIBC_TUNABLES");
    if (!tunables || !strstr(tunables, "mmap_threshold")) mallopt(M_MMAP_THRESHOLD, 256 * 1024);
    srv *s = calloc(1, sizeof *s);
    if (!s) return 1;
    config_defaults(&s->cfg);
    int rc = parse_args(&s->cfg, argc, argv);
    if (rc != 0) {
        free(s);
        return rc == 1 ? 0 : 2;
    }
    raise_nofile(&s->cfg);
    srv_log("info", "start",
            "version=%s dir=%s durability=%s on_lease_expiry=%s test_clock=%d users=%d "
            "malloc_hugetlb_tunable=%d",
            IDEM_VERSION_STRING, s->cfg.dir, srv_durability_name(s->cfg.durability),
            srv_lease_policy_name(s->cfg.lease_policy), s->cfg.test_clock, s->cfg.nusers,
            huge_pages_tunable());
    rc = srv_run(s);
    free(s);
    return rc;
}
