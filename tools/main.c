/*
 * main.c: idemctl, the operator's tool for idem. Parses options (anywhere on the line, long
 * form, `--name value` or `--name=value`), picks the subcommand, prints help, and maps results
 * to exit codes: 0 ok, 1 failure, 2 usage.
 */
#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "ctl.h"

/* Which options a subcommand takes, beyond the global ones. */
enum {
    O_OLDER = 1 << 0,
    O_STATE = 1 << 1,
    O_COUNT = 1 << 2,
    O_REASON = 1 << 3,
    O_RESULT = 1 << 4,
    O_FORCE = 1 << 5,
    O_INTERVAL = 1 << 6,
    O_WINDOW = 1 << 7,
    O_MINFREE = 1 << 8,
    O_KEY = 1 << 9, /* takes KEY: --key-escaped, --key-base64 */
    O_RESULTMAX = 1 << 10,
    O_EXPECT = 1 << 11,
};

struct subcmd {
    const char *name;
    int (*fn)(const struct ctl_opts *o);
    int pos_min, pos_max;
    unsigned opts;
    const char *usage;
    const char *help;
};

static const struct subcmd cmds[] = {
    {"status", cmd_status, 0, 0, O_OLDER | O_WINDOW | O_MINFREE,
     "status [--older DURATION] [--window DURATION] [--min-free SIZE]",
     "Keys by state, duplicate ratio, oldest in_flight and review ages, mismatches, conflicting\n"
     "commits, capacity, flush latency and disk free, with a verdict: healthy, or attention and\n"
     "why. --older: in_flight age that needs attention (default 15m). --window: the duplicate\n"
     "ratio is measured over this time, between two readings of idemd's figures (default: the\n"
     "store's own count of the last minute; not with --dir).\n"
     "--min-free: disk free below this needs attention (default 1GiB).\n"
     "Exits 0 whatever the verdict: a script reads it (--json: \"verdict\")."},
    {"get", cmd_get, 1, 1, O_KEY, "get KEY [--key-escaped | --key-base64]",
     "The whole record of KEY, times as ISO 8601 and as age or time remaining."},
    {"attention", cmd_attention, 0, 0, O_OLDER | O_COUNT,
     "attention [--older DURATION] [--count N]",
     "Every record that needs a person or a reconciler, most urgent first: review records,\n"
     "in_flight records whose lease ran out (or older than --older), keys with mismatches; each\n"
     "with the suggested next step. Never scans all keys (idemd: IDEM.ATTENTION)."},
    {"resolve", cmd_resolve, 2, 2, O_REASON | O_RESULT | O_FORCE | O_KEY | O_EXPECT | O_RESULTMAX,
     "resolve KEY commit|release|settle --reason TEXT [--result BYTES] [--expect VERSION]\n"
     "        [--force] [--result-max SIZE]",
     "An operator decision (admin role). commit: the target was checked and it happened\n"
     "(--result: the target's reference); release: it did not happen, re-offer the key; settle:\n"
     "close without new action. The decision passes a version (EXPECT): --expect VERSION, the\n"
     "version `get` or `attention` showed when the target was checked; without it, the version\n"
     "resolve reads first. A record at another version is refused, with what it is now. --force\n"
     "is needed while a lease runs. Recorded in the audit trail. --result-max (offline): the\n"
     "store's result limit, as idemd's (default 64KiB)."},
    {"audit", cmd_audit, 0, 1, O_COUNT | O_KEY, "audit [KEY] [--count N]",
     "Operator decisions, newest first: who, when, action, reason, state before and after."},
    {"scan", cmd_scan, 0, 0, O_STATE | O_OLDER | O_COUNT,
     "scan [--state in_flight|committed|review] [--older DURATION] [--count N]",
     "Keys, one per line, for scripts (OLDER counts from first_seen). A key may appear twice\n"
     "while idemd's index grows (SCAN semantics)."},
    {"watch", cmd_watch, 0, 0, O_COUNT | O_INTERVAL, "watch [--count N] [--interval DURATION]",
     "A live view of idemd, one line per refresh (default every 1s): claims/s, duplicates/s,\n"
     "ratio, in_flight count, oldest in_flight age, flush p50/p99. --count: stop after N\n"
     "refreshes. Not with --dir: a stopped store has no traffic (status --dir reads it)."},
    {"verify", cmd_verify, 0, 1, 0, "verify [DIR]",
     "Offline, read-only check of every checksum and invariant of a stopped store (DIR, or\n"
     "--dir): superblock copies, every log frame, the checkpoint, the audit trail, the index.\n"
     "Exit 1 on any fault, and on a store an import was cut short in (it holds IMPORTING).\n"
     "Never modifies the store."},
    {"backup", cmd_backup, 1, 1, 0, "backup DEST [--socket PATH | --dir DIR]",
     "Copies a consistent point-in-time image of the store into the new directory DEST: online,\n"
     "idemd copies its live store (IDEM.BACKUP, admin; DEST is a path on idemd's host; changes\n"
     "are held back for one flush, then go on while it copies; idemctl waits for the copy\n"
     "up to 24 h, or --timeout); offline, the stopped store DIR."},
    {"restore", cmd_restore, 2, 2, 0, "restore BACKUP DEST",
     "Makes DEST (absent) a store from the backup BACKUP, under a new store generation: its\n"
     "tokens are above any the backed-up store handed out before the backup; what that store\n"
     "did after the backup (keys, tokens) is not known to the copy."},
    {"export", cmd_export, 0, 0, 0, "export --dir DIR",
     "JSON Lines on stdout: every field of every record, then the audit trail (oldest first)."},
    {"import", cmd_import, 1, 1, O_FORCE | O_RESULTMAX,
     "import FILE --dir DIR [--force] [--result-max SIZE]",
     "Reads an export (JSON Lines; - for stdin) into the stopped store DIR, made if absent:\n"
     "records as they were (state, times, counters, token; a version not ahead of this log is\n"
     "made the next one: versions only grow), audit entries as they were. For a store no\n"
     "worker uses yet: a store that holds keys or decisions is refused unless --force (import\n"
     "writes over records of the same keys, without audit entries), and is only read then.\n"
     "A DIR that is absent is made as DIR.partial and named DIR once the whole file is in; an\n"
     "export cut short (no end line) is refused. An empty DIR (lost+found aside) keeps its\n"
     "owner and mode: it is written in place, and emptied again if the import fails. A store\n"
     "that exists is written in place. Either holds DIR/IMPORTING until the import has\n"
     "finished: a store an import was cut short in is refused by idemd; run the same import\n"
     "again with --force to finish it.\n"
     "--result-max: the store's result limit, as idemd's (default 64KiB)."},
    {"checkpoint", cmd_checkpoint, 0, 0, 0, "checkpoint --dir DIR",
     "Writes a checkpoint of the stopped store's index, so the next open need not replay the log."},
    {"compact", cmd_compact, 0, 0, 0, "compact --dir DIR",
     "Opens the stopped store and lets it reclaim the space of dead and expired records (bounded\n"
     "by --timeout, default 10s), then checkpoints; prints the log's size before and after."},
};

static const char global_help[] =
    "Where the store is (default: idemd at " CTL_DEFAULT_SOCKET "):\n"
    "  --socket PATH          idemd's unix socket\n"
    "  --host HOST --port N   idemd over TCP (default port 7379; IPv6 as ::1 or [::1])\n"
    "  --user NAME            authenticate (with --password TEXT, --password-file FILE,\n"
    "                         or the IDEMCTL_PASSWORD environment variable; that alone\n"
    "                         authenticates as the user named default)\n"
    "  --dir DIR              a stopped store directory (refused while idemd holds it)\n"
    "Output:\n"
    "  --json                 JSON for scripts (watch and export: JSON Lines)\n"
    "  --color, --no-color    colour (default: on a terminal, unless NO_COLOR is set)\n"
    "Keys (get, resolve, audit): as typed, or with --key-escaped as tables and scan print\n"
    "them (\\xHH for a byte outside printable ASCII, for a backslash and for a space at\n"
    "either end), or with --key-base64 as JSON's key_base64 gives them; 1 to 512 bytes.\n"
    "  --timeout DURATION     how long to wait for idemd (to connect, and for each reply),\n"
    "                         and compact's bound (default 10s, at most 24h)\n"
    "Durations: 250ms, 90s, 15m, 72h, 4d, 1h30m. Sizes: 64KiB, 10MB, 1GiB.\n"
    "Exit codes: 0 ok, 1 failure (or faults found), 2 usage.\n";

void ctl_err(const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    fputs("idemctl: ", stderr);
    vfprintf(stderr, fmt, ap);
    fputc('\n', stderr);
    va_end(ap);
}

static void usage_all(FILE *f)
{
    fprintf(f, "usage: idemctl COMMAND [options]\n\nCommands:\n");
    for (size_t i = 0; i < sizeof cmds / sizeof cmds[0]; i++)
        fprintf(f, "  %s\n", cmds[i].usage);
    fprintf(f, "\n%s\nidemctl COMMAND --help describes a command.\n", global_help);
}

static void usage_cmd(const struct subcmd *c, FILE *f)
{
    fprintf(f, "usage: idemctl %s\n\n%s\n\n%s", c->usage, c->help, global_help);
}

static const struct subcmd *find_cmd(const char *name)
{
    for (size_t i = 0; name && i < sizeof cmds / sizeof cmds[0]; i++)
        if (strcmp(cmds[i].name, name) == 0) return &cmds[i];
    return NULL;
}

/* Option table: name, whether it takes a value, the subcommand bit (0: global). */
static const struct {
    const char *name;
    int has_arg;
    unsigned bit;
} options[] = {
    {"socket", 1, 0},
    {"host", 1, 0},
    {"port", 1, 0},
    {"user", 1, 0},
    {"password", 1, 0},
    {"password-file", 1, 0},
    {"dir", 1, 0},
    {"json", 0, 0},
    {"color", 0, 0},
    {"no-color", 0, 0},
    {"timeout", 1, 0},
    {"help", 0, 0},
    {"older", 1, O_OLDER},
    {"state", 1, O_STATE},
    {"count", 1, O_COUNT},
    {"reason", 1, O_REASON},
    {"result", 1, O_RESULT},
    {"force", 0, O_FORCE},
    {"interval", 1, O_INTERVAL},
    {"window", 1, O_WINDOW},
    {"min-free", 1, O_MINFREE},
    {"result-max", 1, O_RESULTMAX},
    {"expect", 1, O_EXPECT},
    {"key-escaped", 0, O_KEY},
    {"key-base64", 0, O_KEY},
};

_Static_assert(sizeof options / sizeof options[0] <= 64,
               "parse_one keeps the options given in 64 bits");

static int bad_value(const char *name, const char *v, const char *what)
{
    ctl_err("--%s %s: %s", name, v, what);
    return CTL_USAGE;
}

static int set_state(struct ctl_opts *o, const char *v)
{
    for (int s = IDEM_STATE_IN_FLIGHT; s <= IDEM_STATE_REVIEW; s++)
        if (strcmp(v, idem_state_name(s)) == 0) o->state = s;
    return o->state ? 0 : bad_value("state", v, "not in_flight, committed or review");
}

static int set_number(const char *name, const char *v, uint64_t max, const char *what,
                      uint64_t *out)
{
    char *end;
    errno = 0;
    /* Digits alone: strtoull would take a sign or leading blanks, and saturate out of range. */
    unsigned long long n = *v >= '0' && *v <= '9' ? strtoull(v, &end, 10) : 0;
    if (n == 0 || *end || errno == ERANGE || n > max) return bad_value(name, v, what);
    *out = n;
    return 0;
}

/* Applies one option. Returns 0 or CTL_USAGE. */
static int set_option(struct ctl_opts *o, const char *name, const char *v, int *help)
{
    int64_t ms;
    uint64_t n;
    if (!strcmp(name, "socket"))
        o->socket = v;
    else if (!strcmp(name, "host"))
        o->host = v;
    else if (!strcmp(name, "port")) {
        if (set_number(name, v, 65535, "not a port (1 to 65535)", &n)) return CTL_USAGE;
        o->port = (int)n;
    } else if (!strcmp(name, "user"))
        o->user = v;
    else if (!strcmp(name, "password"))
        o->password = v;
    else if (!strcmp(name, "password-file"))
        o->password_file = v;
    else if (!strcmp(name, "dir"))
        o->dir = v;
    else if (!strcmp(name, "json"))
        o->json = 1;
    else if (!strcmp(name, "color"))
        o->color = 1;
    else if (!strcmp(name, "no-color"))
        o->color = 0;
    else if (!strcmp(name, "help"))
        *help = 1;
    else if (!strcmp(name, "state"))
        return set_state(o, v);
    else if (!strcmp(name, "count")) {
        if (set_number(name, v, 1000000, "not a count (1 to 1000000)", &o->count)) return CTL_USAGE;
        o->has_count = 1;
    } else if (!strcmp(name, "reason"))
        o->reason = v;
    else if (!strcmp(name, "result")) {
        o->result = v;
        o->has_result = 1;
    } else if (!strcmp(name, "force"))
        o->force = 1;
    else if (!strcmp(name, "expect")) {
        if (set_number(name, v, UINT64_MAX, "not a record version (as get shows it: 1 or more)",
                       &o->expect_version))
            return CTL_USAGE;
        o->has_expect = 1;
    } else if (!strcmp(name, "key-escaped") || !strcmp(name, "key-base64")) {
        int form = name[4] == 'e' ? CTL_KEY_ESCAPED : CTL_KEY_BASE64;
        if (o->key_form && o->key_form != form) {
            ctl_err("give --key-escaped or --key-base64, not both");
            return CTL_USAGE;
        }
        o->key_form = form;
    } else if (!strcmp(name, "result-max")) {
        if (parse_size(v, &o->result_max) < 0 || o->result_max == 0 ||
            o->result_max > IDEM_RESULT_BYTES_LIMIT)
            return bad_value(name, v, "not a result size the store takes");
    } else if (!strcmp(name, "min-free")) {
        if (parse_size(v, &o->min_free_bytes) < 0)
            return bad_value(name, v, "not a size (e.g. 512MiB, 1GiB)");
        o->has_min_free = 1;
    } else {
        if (parse_duration_ms(v, &ms) < 0)
            return bad_value(name, v,
                             "not a duration (e.g. 90s, 15m, 1h30m, 4d: units in lower case, the "
                             "largest first, each once)");
        if (!strcmp(name, "timeout")) {
            if (ms <= 0 || ms > CTL_TIMEOUT_MAX_MS)
                return bad_value(name, v, "not between 1ms and 24h");
            o->timeout_ms = (int)ms;
            o->has_timeout = 1;
        } else if (!strcmp(name, "older")) {
            o->older_ms = ms;
            o->has_older = 1;
        } else if (!strcmp(name, "interval")) {
            if (ms < 100 || ms > CTL_VIEW_MS_MAX)
                return bad_value(name, v, "not between 100ms and 1h");
            o->interval_ms = ms;
        } else if (!strcmp(name, "window")) {
            if (ms <= 0 || ms > CTL_VIEW_MS_MAX)
                return bad_value(name, v, "not between 1ms and 1h");
            o->window_ms = ms;
        }
    }
    return 0;
}

/* Splits "--name[=value]"; finds the option; takes its value from the next argument. given:
 * the options seen so far, by their place in the table (one given twice is refused: the second
 * would silently win). */
static int parse_one(struct ctl_opts *o, int argc, char **argv, int *i, unsigned *used,
                     uint64_t *given, int *help)
{
    const char *arg = argv[*i] + 2, *eq = strchr(arg, '=');
    size_t nl = eq ? (size_t)(eq - arg) : strlen(arg);
    for (size_t k = 0; k < sizeof options / sizeof options[0]; k++) {
        if (strlen(options[k].name) != nl || strncmp(options[k].name, arg, nl)) continue;
        if (*given >> k & 1) {
            ctl_err("--%s is given twice", options[k].name);
            return CTL_USAGE;
        }
        *given |= 1ull << k;
        const char *v = NULL;
        if (options[k].has_arg) {
            v = eq ? eq + 1 : (*i + 1 < argc ? argv[++*i] : NULL);
            if (!v) {
                ctl_err("--%s needs a value", options[k].name);
                return CTL_USAGE;
            }
            if (!eq && strncmp(v, "--", 2) == 0) { /* an option forgotten its value */
                ctl_err("--%s needs a value, not the option %s (a value that begins with -- is "
                        "given as --%s=%s)",
                        options[k].name, v, options[k].name, v);
                return CTL_USAGE;
            }
        } else if (eq) {
            ctl_err("--%s takes no value", options[k].name);
            return CTL_USAGE;
        }
        *used |= options[k].bit;
        return set_option(o, options[k].name, v, help);
    }
    ctl_err("unknown option %s (idemctl --help lists them)", argv[*i]);
    return CTL_USAGE;
}

static int parse_args(struct ctl_opts *o, int argc, char **argv, const char **cmd, unsigned *used,
                      int *help)
{
    int only_pos = 0;
    uint64_t given = 0;
    for (int i = 1; i < argc; i++) {
        if (!only_pos && strcmp(argv[i], "--") == 0) {
            only_pos = 1;
        } else if (!only_pos && (strcmp(argv[i], "-h") == 0)) {
            *help = 1;
        } else if (!only_pos && strncmp(argv[i], "--", 2) == 0) {
            int rc = parse_one(o, argc, argv, &i, used, &given, help);
            if (rc) return rc;
        } else if (!*cmd) {
            *cmd = argv[i];
        } else if (o->npos < CTL_POS_MAX) {
            o->pos[o->npos++] = argv[i];
        } else {
            ctl_err("too many arguments");
            return CTL_USAGE;
        }
    }
    return 0;
}

/* KEY (pos[0]) as bytes into o->key: as typed, or decoded from the escaped form (bytes_escape's:
 * \xHH, anything else as itself) or from base64. Returns 0 or CTL_USAGE. */
static int key_arg(struct ctl_opts *o)
{
    static uint8_t buf[IDEM_KEY_BYTES_MAX];
    const char *s = o->pos[0];
    size_t n = 0;
    if (o->key_form == CTL_KEY_BASE64) {
        uint8_t *d = NULL;
        if (base64_decode(s, &d, &n) < 0) return bad_value("key-base64", s, "not base64");
        if (n <= IDEM_KEY_BYTES_MAX) memcpy(buf, d, n);
        free(d);
    } else if (o->key_form == CTL_KEY_ESCAPED) {
        for (size_t i = 0; s[i]; n++) {
            uint8_t b = (uint8_t)s[i++];
            if (b == '\\') {
                int hi = s[i] == 'x' ? hex_digit(s[i + 1]) : -1;
                int lo = hi >= 0 ? hex_digit(s[i + 2]) : -1;
                if (lo < 0) return bad_value("key-escaped", s, "a backslash not followed by xHH");
                b = (uint8_t)(hi << 4 | lo);
                i += 3;
            }
            if (n < IDEM_KEY_BYTES_MAX) buf[n] = b;
        }
    } else {
        n = strlen(s);
        if (n <= IDEM_KEY_BYTES_MAX) memcpy(buf, s, n);
    }
    if (n == 0 || n > IDEM_KEY_BYTES_MAX) {
        ctl_err("KEY %s: %zu bytes; a key has 1 to %d", s, n, IDEM_KEY_BYTES_MAX);
        return CTL_USAGE;
    }
    o->key = buf;
    o->key_len = n;
    return 0;
}

int main(int argc, char **argv)
{
    struct ctl_opts o;
    memset(&o, 0, sizeof o);
    o.timeout_ms = 10000;
    o.color = isatty(STDOUT_FILENO) && !getenv("NO_COLOR");
    const char *name = NULL;
    unsigned used = 0;
    int help = 0;
    int rc = parse_args(&o, argc, argv, &name, &used, &help);
    if (rc) return rc;
    if (name && strcmp(name, "help") == 0) {
        name = o.npos ? o.pos[0] : NULL;
        help = 1;
    }
    const struct subcmd *c = find_cmd(name);
    if (!c) {
        if (name) ctl_err("unknown command '%s'", name);
        usage_all(name || !help ? stderr : stdout);
        return name || !help ? CTL_USAGE : CTL_OK;
    }
    if (help) {
        usage_cmd(c, stdout);
        return CTL_OK;
    }
    if (used & ~c->opts) {
        ctl_err("%s does not take one of the options given (idemctl %s --help)", c->name, c->name);
        return CTL_USAGE;
    }
    if (o.npos < c->pos_min || o.npos > c->pos_max) {
        if (o.npos > c->pos_max)
            ctl_err("%s: unexpected argument '%s'%s", c->name, o.pos[c->pos_max],
                    strncmp(o.pos[c->pos_max], "--", 2) == 0 ? " (after --, all are arguments)"
                    : o.pos[c->pos_max][0] == '-'            ? " (options begin with --)"
                                                             : "");
        else
            ctl_err("%s: %s missing", c->name,
                    c->pos_min - o.npos > 1 ? "arguments" : "an argument");
        fprintf(stderr, "usage: idemctl %s\n", c->usage);
        return CTL_USAGE;
    }
    if ((c->opts & O_KEY) && o.npos > 0 && (rc = key_arg(&o)) != 0) return rc;
    rc = c->fn(&o);
    /* Output that did not reach its file (a full disk under an export) is a failure. */
    if (fflush(stdout) != 0 || ferror(stdout)) {
        ctl_err("writing the output: %s", strerror(errno));
        return rc != CTL_OK ? rc : CTL_FAIL;
    }
    return rc;
}
