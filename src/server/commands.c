/*
 * commands.c: the command table (each command's handler, limits and the description COMMAND
 * DOCS gives, which cmd_docs.c renders), dispatch (lookup, arity, authentication, role,
 * loading), the parser's field limits, refusals by name, and the connection commands (PING,
 * ECHO, AUTH, HELLO, CLIENT, SELECT, QUIT). The key commands live in cmd_idem.c, the operator
 * ones in cmd_admin.c.
 */
#include "cmd.h"
#include "util.h"

#include <stdarg.h>
#include <stdio.h>
#include <string.h>
#include <strings.h>

/* ---- helpers ---- */

resp_buf *cmd_out(cmd_req *r)
{
    return srv_reply_buf(r->c, r->seq);
}

void cmd_done(cmd_req *r)
{
    srv_reply_done(r->s, r->c, r->seq);
}

void cmd_ok(cmd_req *r)
{
    resp_simple(cmd_out(r), "OK");
    cmd_done(r);
}

void cmd_fail(cmd_req *r, const char *fmt, ...)
{
    char line[400];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(line, sizeof line, fmt, ap);
    va_end(ap);
    resp_error(cmd_out(r), line);
    cmd_done(r);
}

void cmd_int(cmd_req *r, int64_t v)
{
    resp_integer(cmd_out(r), v);
    cmd_done(r);
}

int cmd_is(const cmd_req *r, uint32_t i, const char *word)
{
    size_t n = strlen(word);
    return i < r->argc && r->argl[i] == n && strncasecmp((const char *)r->argv[i], word, n) == 0;
}

int cmd_option(cmd_req *r, uint32_t i, const char *const *names, unsigned n, unsigned *seen,
               const char *usage)
{
    unsigned k = 0;
    if (i + 1 >= r->argc) {
        cmd_fail(r, "ERR syntax error: option without a value");
        return -1;
    }
    while (k < n && !cmd_is(r, i, names[k]))
        k++;
    if (k == n) {
        cmd_fail(r, "ERR syntax error: unknown option (%s)", usage);
        return -1;
    }
    /* An option given twice is refused, not taken last: which one the caller meant is not
     * known (the fingerprint of the other content would answer mismatch later). */
    if (*seen & 1u << k) {
        cmd_fail(r, "ERR syntax error: %s given twice", names[k]);
        return -1;
    }
    *seen |= 1u << k;
    return (int)k;
}

int cmd_u64(const uint8_t *p, uint32_t n, uint64_t *out)
{
    uint64_t v = 0;
    if (n == 0 || n > 20 || (n > 1 && p[0] == '0')) return -1; /* "007" is not one (Redis) */
    for (uint32_t i = 0; i < n; i++) {
        if (p[i] < '0' || p[i] > '9' || v > (UINT64_MAX - 9) / 10) return -1;
        v = v * 10 + (uint64_t)(p[i] - '0');
    }
    *out = v;
    return 0;
}

int cmd_i64(const uint8_t *p, uint32_t n, int64_t *out)
{
    uint64_t v;
    int neg = n > 0 && p[0] == '-';
    if (cmd_u64(p + neg, n - (uint32_t)neg, &v) < 0 || v > (uint64_t)INT64_MAX || (neg && !v))
        return -1;
    *out = neg ? -(int64_t)v : (int64_t)v;
    return 0;
}

int cmd_key_ok(cmd_req *r, uint32_t i)
{
    if (r->argl[i] == 0) {
        cmd_fail(r, "ERR key is empty (1..%u bytes)", IDEM_KEY_BYTES_MAX);
        return -1;
    }
    if (r->argl[i] > IDEM_KEY_BYTES_MAX) {
        cmd_fail(r, "ERR key too long (%u bytes, at most %u)", r->argl[i], IDEM_KEY_BYTES_MAX);
        return -1;
    }
    return 0;
}

/* user@peer, user(client name)@peer once the client named itself; without users the user is
 * the peer's uid on the unix socket (SO_PEERCRED), tcp on TCP. The name's '(', ')' and '@' are
 * written '?': a name of "x)@10.0.0.5" must not read as another peer. A name is cut to
 * ACTOR_NAME_MAX bytes there, so that user and peer always fit in IDEM_ACTOR_BYTES_MAX. */
#define ACTOR_NAME_MAX 120
_Static_assert(SRV_NAME_MAX - 1 + ACTOR_NAME_MAX + sizeof((srv_conn *)0)->peer - 1 + 3 <=
                   IDEM_ACTOR_BYTES_MAX,
               "user(name)@peer fits an audit entry's actor");
const char *cmd_actor(srv_conn *c)
{
    const char *who = c->user[0] ? c->user : "anonymous";
    if (c->name[0]) {
        char name[ACTOR_NAME_MAX + 1];
        size_t i = 0;
        for (; c->name[i] && i + 1 < sizeof name; i++)
            name[i] = strchr("()@", c->name[i]) ? '?' : c->name[i];
        name[i] = '\0';
        snprintf(c->actor, sizeof c->actor, "%s(%s)@%s", who, name, c->peer);
    } else
        snprintf(c->actor, sizeof c->actor, "%s@%s", who, c->peer);
    return c->actor;
}

uint32_t cmd_result_max(const srv *s)
{
    return s->cfg.result_bytes_max ? s->cfg.result_bytes_max : IDEM_RESULT_BYTES_DEFAULT;
}

/* ---- connection commands ---- */

static void cmd_ping(cmd_req *r)
{
    if (r->argc > 2) return cmd_fail(r, "ERR wrong number of arguments for 'ping' command");
    if (r->argc == 2)
        resp_bulk(cmd_out(r), r->argv[1], r->argl[1]);
    else
        resp_simple(cmd_out(r), "PONG");
    cmd_done(r);
}

static void cmd_echo(cmd_req *r)
{
    resp_bulk(cmd_out(r), r->argv[1], r->argl[1]);
    cmd_done(r);
}

static void cmd_quit(cmd_req *r)
{
    r->c->close_after_write = 1;
    cmd_ok(r);
}

static void cmd_select(cmd_req *r)
{
    if (r->argl[1] == 1 && r->argv[1][0] == '0') return cmd_ok(r);
    int64_t n;
    if (cmd_i64(r->argv[1], r->argl[1], &n) < 0)
        return cmd_fail(r, "ERR value is not an integer or out of range");
    cmd_fail(r, "ERR DB index is out of range (idemd has one keyspace: SELECT 0)");
}

/* Authenticates c as user/password. Returns 0, or -1 having answered -WRONGPASS. */
static int authenticate(cmd_req *r, const uint8_t *user, uint32_t user_len, const uint8_t *pw,
                        uint32_t pw_len)
{
    char name[SRV_NAME_MAX];
    int role = ROLE_NONE;
    /* Without users, the user `default` takes any password, as Redis's default user without a
     * password does: a client set up with that user and a password connects. The connection
     * keeps the role its transport gave it. */
    if (r->s->cfg.nusers == 0 && user_len == 7 && memcmp(user, "default", 7) == 0) return 0;
    if (user_len < sizeof name && !memchr(user, 0, user_len)) { /* "a\0x" is not user a */
        memcpy(name, user, user_len);
        name[user_len] = '\0';
        role = auth_check(&r->s->cfg, name, pw, pw_len);
    }
    if (role == ROLE_NONE) {
        r->s->auth_failures++;
        srv_log_gated(&r->s->log_auth, "warn", "auth_failed", "id=%llu peer=%s",
                      (unsigned long long)r->c->id, r->c->peer);
        cmd_fail(r, "WRONGPASS invalid username-password pair or user is disabled.");
        return -1;
    }
    /* Ops queued for this connection name it as their actor (cmd_actor's buffer): they go to
     * the engine before the name changes. */
    srv_flush_ops(r->s);
    int was_none = r->c->role == ROLE_NONE;
    r->c->role = role;
    if (was_none) { /* the full limits from the next request on (this one is parsed) */
        r->c->parser.argc_max = RESP_ARGV_MAX;
        r->c->parser.arg_max = cmd_arg_max;
    }
    memcpy(r->c->user, name, user_len + 1);
    srv_log_gated(&r->s->log_auth_ok, "info", "auth", "id=%llu user=%s role=%s",
                  (unsigned long long)r->c->id, name, auth_role_name(role));
    return 0;
}

static void cmd_auth(cmd_req *r)
{
    if (r->argc > 3) return cmd_fail(r, "ERR syntax error");
    if (r->s->cfg.nusers == 0 && r->argc == 2)
        return cmd_fail(r, "ERR AUTH <password> called without any password configured for "
                           "the default user. Are you sure your configuration is correct?");
    if (r->argc == 2) {
        if (authenticate(r, (const uint8_t *)"default", 7, r->argv[1], r->argl[1]) == 0) cmd_ok(r);
        return;
    }
    if (authenticate(r, r->argv[1], r->argl[1], r->argv[2], r->argl[2]) == 0) cmd_ok(r);
}

static void hello_reply(cmd_req *r)
{
    resp_buf *b = cmd_out(r);
    resp_array(b, 14);
    resp_bulk_str(b, "server");
    resp_bulk_str(b, "idem");
    resp_bulk_str(b, "version");
    resp_bulk_str(b, IDEM_VERSION_STRING);
    resp_bulk_str(b, "proto");
    resp_integer(b, 2);
    resp_bulk_str(b, "id");
    resp_integer(b, (int64_t)r->c->id);
    resp_bulk_str(b, "mode");
    resp_bulk_str(b, "standalone");
    resp_bulk_str(b, "role");
    resp_bulk_str(b, "master");
    resp_bulk_str(b, "modules");
    resp_array(b, 0);
    cmd_done(r);
}

/* Whether a client name may be set: shorter than SRV_CLIENT_NAME_MAX, printable ASCII without
 * spaces (as Redis allows): names reach the logs and the audit trail. */
static int client_name_ok(const uint8_t *p, uint32_t len)
{
    if (len >= SRV_CLIENT_NAME_MAX) return 0;
    for (uint32_t i = 0; i < len; i++)
        if (p[i] < '!' || p[i] > '~') return 0;
    return 1;
}

static void set_client_name(cmd_req *r, const uint8_t *p, uint32_t len)
{
    srv_conn *c = r->c;
    srv_flush_ops(r->s); /* ops queued name the actor as it was (cmd_actor's buffer) */
    memcpy(c->name, p, len);
    c->name[len] = '\0';
}

/* HELLO [2 [AUTH user pass] [SETNAME name]]: every option is checked before any takes effect,
 * and the name is set only once the credentials, if given, are taken. */
static void cmd_hello(cmd_req *r)
{
    uint32_t i = 1, auth = 0, name = 0;
    if (r->argc > 1) {
        /* As Redis: a version that is not a number is a plain error, another number NOPROTO. */
        int64_t version;
        if (cmd_i64(r->argv[1], r->argl[1], &version) < 0)
            return cmd_fail(r, "ERR Protocol version is not an integer or out of range");
        if (version != 2)
            return cmd_fail(r, "NOPROTO sorry, this protocol version is not supported "
                               "(idemd speaks RESP2: HELLO 2)");
        i = 2;
    }
    for (; i < r->argc; i++) {
        if (cmd_is(r, i, "AUTH") && i + 2 < r->argc) {
            auth = i + 1;
            i += 2;
        } else if (cmd_is(r, i, "SETNAME") && i + 1 < r->argc) {
            if (!client_name_ok(r->argv[i + 1], r->argl[i + 1]))
                return cmd_fail(r, "ERR client name too long or holds spaces or special "
                                   "characters");
            name = ++i;
        } else {
            return cmd_fail(r, "ERR syntax error in HELLO option");
        }
    }
    if (auth &&
        authenticate(r, r->argv[auth], r->argl[auth], r->argv[auth + 1], r->argl[auth + 1]) < 0)
        return;
    if (!auth && r->c->role == ROLE_NONE)
        return cmd_fail(r, "NOAUTH HELLO must be called with the client already authenticated, "
                           "otherwise the HELLO <proto> AUTH <user> <pass> option can be used");
    if (name) set_client_name(r, r->argv[name], r->argl[name]);
    hello_reply(r);
}

static void cmd_client(cmd_req *r)
{
    srv_conn *c = r->c;
    if (cmd_is(r, 1, "ID") && r->argc == 2) return cmd_int(r, (int64_t)c->id);
    if (cmd_is(r, 1, "SETNAME") && r->argc == 3) {
        if (!client_name_ok(r->argv[2], r->argl[2]))
            return cmd_fail(r, "ERR client name too long or holds spaces or special characters");
        set_client_name(r, r->argv[2], r->argl[2]);
        return cmd_ok(r);
    }
    if (cmd_is(r, 1, "GETNAME") && r->argc == 2) {
        if (c->name[0])
            resp_bulk_str(cmd_out(r), c->name);
        else
            resp_nil(cmd_out(r));
        return cmd_done(r);
    }
    if (cmd_is(r, 1, "SETINFO") && r->argc == 4) {
        /* As Redis 7.2: the library's name and version, kept nowhere here (clients ignore an
         * error, but one that sends something else is told so). */
        if (!cmd_is(r, 2, "LIB-NAME") && !cmd_is(r, 2, "LIB-VER"))
            return cmd_fail(r, "ERR Unrecognized option for CLIENT SETINFO (LIB-NAME, LIB-VER)");
        if (!client_name_ok(r->argv[3], r->argl[3]))
            return cmd_fail(r, "ERR %s cannot contain spaces, newlines or special characters",
                            cmd_is(r, 2, "LIB-NAME") ? "lib-name" : "lib-ver");
        return cmd_ok(r);
    }
    cmd_fail(r, "ERR unknown CLIENT subcommand or wrong number of arguments (ID, SETNAME, "
                "GETNAME, SETINFO)");
}

/* ---- the table ---- */

/* ---- each command's argument limits (cmd_def.arg_max) ---- */

static int name_is(const uint8_t *p, uint32_t n, const char *word)
{
    return strlen(word) == n && strncasecmp((const char *)p, word, n) == 0;
}

/* A key first (IDEM.RELEASE, IDEM.GET, GET, ...). */
static uint32_t key_args(const srv *s, const uint8_t *const *argv, const uint32_t *argl,
                         uint32_t index, const char **field)
{
    (void)s, (void)argv, (void)argl;
    if (index != 1) return CMD_ARG_MAX_DEFAULT;
    *field = "key";
    return IDEM_KEY_BYTES_MAX;
}

/* Keys only (EXISTS, DEL). */
static uint32_t keys_args(const srv *s, const uint8_t *const *argv, const uint32_t *argl,
                          uint32_t index, const char **field)
{
    (void)s, (void)argv, (void)argl, (void)index;
    *field = "key";
    return IDEM_KEY_BYTES_MAX;
}

/* PING, ECHO: a message as long as a result. */
static uint32_t result_args(const srv *s, const uint8_t *const *argv, const uint32_t *argl,
                            uint32_t index, const char **field)
{
    (void)argv, (void)argl, (void)index;
    *field = "message";
    return cmd_result_max(s);
}

/* IDEM.CLAIM key ttl lease [FP content] [OWNER id] [WAIT ms] */
static uint32_t claim_args(const srv *s, const uint8_t *const *argv, const uint32_t *argl,
                           uint32_t index, const char **field)
{
    /* Numbers and option names: room enough that a wrong one is answered by the handler, which
     * says what is wrong with it, not by its length. */
    static const char *const fixed[] = {NULL, NULL, "ttl_ms", "lease_ms"};
    if (index <= 3) {
        *field = fixed[index];
        return index == 1 ? key_args(s, argv, argl, index, field) : 64;
    }
    const uint8_t *opt = argv[index - 1];
    uint32_t opt_len = argl[index - 1];
    if ((index - 4) % 2 == 0) {
        *field = "option";
        return 64;
    }
    if (name_is(opt, opt_len, "FP")) return RESP_BULK_PROTO_MAX;
    if (name_is(opt, opt_len, "OWNER")) {
        *field = "owner";
        return IDEM_OWNER_BYTES_MAX;
    }
    if (name_is(opt, opt_len, "WAIT")) *field = "WAIT ms";
    return 64;
}

/* IDEM.COMMIT key token result */
static uint32_t commit_args(const srv *s, const uint8_t *const *argv, const uint32_t *argl,
                            uint32_t index, const char **field)
{
    if (index != 3) return key_args(s, argv, argl, index, field);
    *field = "result";
    return cmd_result_max(s);
}

/* SET key value [NX] [PX ms | EX s] [GET] */
static uint32_t set_args(const srv *s, const uint8_t *const *argv, const uint32_t *argl,
                         uint32_t index, const char **field)
{
    if (index != 2) return key_args(s, argv, argl, index, field);
    *field = "value";
    return cmd_result_max(s);
}

/* IDEM.HOLD key token reason */
static uint32_t hold_args(const srv *s, const uint8_t *const *argv, const uint32_t *argl,
                          uint32_t index, const char **field)
{
    if (index != 3) return key_args(s, argv, argl, index, field);
    *field = "reason";
    return IDEM_NOTE_BYTES_MAX;
}

/* The most arguments a valid IDEM.RESOLVE has, its name included: any further one is held to
 * the default limit (the handler refuses the request). */
#define RESOLVE_ARGC_MAX 9

/* IDEM.RESOLVE key action reason [RESULT r] [EXPECT v] [FORCE]: after the reason, option words
 * and their values in turn (FORCE has none), so a value is told by its place: in `EXPECT RESULT
 * x` the x is an option word, held to an option word's limit. */
static uint32_t resolve_args(const srv *s, const uint8_t *const *argv, const uint32_t *argl,
                             uint32_t index, const char **field)
{
    if (index <= 3) return hold_args(s, argv, argl, index, field);
    if (index >= RESOLVE_ARGC_MAX) return CMD_ARG_MAX_DEFAULT;
    uint32_t word = 4; /* the option word at or just before index */
    while (word + 1 < index)
        word += name_is(argv[word], argl[word], "FORCE") ? 1 : 2;
    if (word + 1 != index || !name_is(argv[word], argl[word], "RESULT")) return CMD_ARG_MAX_DEFAULT;
    *field = "result";
    return cmd_result_max(s);
}

/* IDEM.AUDIT [KEY key] [COUNT n] [BEFORE seq]: every option has a value, so values have even
 * places and `COUNT KEY x` has no key. */
static uint32_t audit_args(const srv *s, const uint8_t *const *argv, const uint32_t *argl,
                           uint32_t index, const char **field)
{
    (void)s;
    if (index % 2 || !name_is(argv[index - 1], argl[index - 1], "KEY")) return CMD_ARG_MAX_DEFAULT;
    *field = "key";
    return IDEM_KEY_BYTES_MAX;
}

/* A table entry; the name's length is taken from the literal. Summary, group and arguments are
 * what COMMAND DOCS answers, in the shape Redis 7 gives them: redis-cli builds its HELP and the
 * hints it shows as a command is typed from them, and asserts on an argument without a type. */
/* clang-format off */
#define CMD(nm, ar, ro, fl, fn, am, su, gr, as) {nm, sizeof nm - 1, ar, ro, fl, fn, am, su, gr, as}
#define ARGS(...) ((const struct doc_arg[]){__VA_ARGS__, {0}})
#define KEY         {.name = "key", .type = "key"}
#define KEYS        {.name = "key", .type = "key", .flags = DOC_MULTIPLE}
#define STR(n)      {.name = n, .type = "string"}
#define INT(n)      {.name = n, .type = "integer"}
#define PURE(t)     {.name = t, .type = "pure-token", .token = t}
#define OPT_PURE(t) {.name = t, .type = "pure-token", .token = t, .flags = DOC_OPTIONAL}
#define OPT_INT(t, n) {.name = n, .type = "integer", .token = t, .flags = DOC_OPTIONAL}
#define OPT_STR(t, n) {.name = n, .type = "string", .token = t, .flags = DOC_OPTIONAL}
#define MORE(n)     {.name = n, .type = "string", .flags = DOC_OPTIONAL | DOC_MULTIPLE}
const cmd_def cmd_table[] = {
    CMD("IDEM.CLAIM", -4, ROLES_WORK, CMD_F_WRITE | CMD_F_RESULT, cmd_claim, claim_args,
        "Reserves a key before a side effect; answers new, busy, done, mismatch, recover or "
        "review", "idem",
        ARGS(KEY, INT("ttl_ms"), INT("lease_ms"), OPT_STR("FP", "content"), OPT_STR("OWNER", "id"),
             OPT_INT("WAIT", "ms"))),
    CMD("IDEM.COMMIT", 4, ROLES_WORK, CMD_F_WRITE, cmd_commit, commit_args,
        "Records the outcome of a claim, with the claim's token", "idem",
        ARGS(KEY, INT("token"), STR("result"))),
    CMD("IDEM.RELEASE", 3, ROLES_WORK, CMD_F_WRITE, cmd_release, key_args,
        "Gives a claimed key back: the next claim gets new", "idem", ARGS(KEY, INT("token"))),
    CMD("IDEM.HOLD", 4, ROLES_WORK, CMD_F_WRITE, cmd_hold, hold_args,
        "Sends a claimed key to review, for a person to decide", "idem",
        ARGS(KEY, INT("token"), STR("reason"))),
    CMD("IDEM.EXTEND", 4, ROLES_WORK, CMD_F_WRITE, cmd_extend, key_args,
        "Runs a claim's lease on from now", "idem", ARGS(KEY, INT("token"), INT("lease_ms"))),
    CMD("IDEM.GET", 2, ROLES_ALL, CMD_F_RESULT, cmd_idem_get, key_args,
        "Returns the whole record of a key", "idem", ARGS(KEY)),
    CMD("IDEM.SCAN", -2, ROLES_READ, 0, cmd_scan, NULL,
        "Lists keys by state and age, a page at a time", "idem",
        ARGS(INT("cursor"),
             {.name = "state", .type = "oneof", .token = "STATE", .flags = DOC_OPTIONAL,
              .sub = ARGS(PURE("in_flight"), PURE("committed"), PURE("review"))},
             OPT_INT("OLDER", "ms"), OPT_INT("COUNT", "count"))),
    CMD("IDEM.STATS", 1, ROLES_READ, CMD_F_LONG, cmd_stats, NULL,
        "Returns the store's counters", "idem", NULL),
    CMD("IDEM.RESOLVE", -4, ROLE_ADMIN, CMD_F_WRITE, cmd_resolve, resolve_args,
        "Decides an unfinished record (admin; audited)", "idem",
        ARGS(KEY,
             {.name = "action", .type = "oneof",
              .sub = ARGS(PURE("commit"), PURE("release"), PURE("settle"))},
             STR("reason"), OPT_STR("RESULT", "result"), OPT_INT("EXPECT", "version"),
             OPT_PURE("FORCE"))),
    CMD("IDEM.AUDIT", -1, ROLES_READ, 0, cmd_audit, audit_args,
        "Lists entries of the audit trail, newest first", "idem",
        ARGS({.name = "key", .type = "key", .token = "KEY", .flags = DOC_OPTIONAL},
             OPT_INT("COUNT", "count"), OPT_INT("BEFORE", "seq"))),
    CMD("IDEM.ATTENTION", -1, ROLES_READ, 0, cmd_attention, NULL,
        "Lists the records that wait for a person or a reconciler", "idem",
        ARGS(OPT_INT("OLDER", "ms"), OPT_INT("COUNT", "count"), OPT_PURE("WITHCUT"))),
    CMD("IDEM.BACKUP", 2, ROLE_ADMIN, 0, cmd_backup, NULL,
        "Writes a consistent copy of the store into a new directory (admin)", "idem",
        ARGS(STR("path"))),
    CMD("SET", -3, ROLES_WORK, CMD_F_WRITE | CMD_F_RESULT, cmd_set, set_args,
        "Creates a committed record whose result is the value, if the key is absent (NX and an "
        "expiry required)", "string",
        ARGS(KEY, STR("value"), PURE("NX"),
             {.name = "expiration", .type = "oneof",
              .sub = ARGS({.name = "milliseconds", .type = "integer", .token = "PX"},
                          {.name = "seconds", .type = "integer", .token = "EX"})},
             OPT_PURE("GET"))),
    CMD("GET", 2, ROLES_ALL, CMD_F_RESULT, cmd_get, key_args,
        "Returns the result of a committed record", "string", ARGS(KEY)),
    CMD("EXISTS", -2, ROLES_ALL, 0, cmd_exists, keys_args,
        "Counts the keys that have a record", "generic", ARGS(KEYS)),
    CMD("PTTL", 2, ROLES_ALL, 0, cmd_pttl, key_args,
        "Returns the milliseconds until a committed record expires", "generic", ARGS(KEY)),
    CMD("TTL", 2, ROLES_ALL, 0, cmd_ttl, key_args,
        "Returns the seconds until a committed record expires", "generic", ARGS(KEY)),
    CMD("DEL", -2, ROLE_ADMIN, CMD_F_WRITE, cmd_del, keys_args,
        "Deletes records (admin; audited)", "generic", ARGS(KEYS)),
    CMD("DBSIZE", 1, ROLES_READ, 0, cmd_dbsize, NULL,
        "Returns the number of records", "server", NULL),
    CMD("PING", -1, ROLES_ALL, CMD_F_MESSAGE, cmd_ping, result_args,
        "Answers PONG, or the message", "connection",
        ARGS({.name = "message", .type = "string", .flags = DOC_OPTIONAL})),
    CMD("ECHO", 2, ROLES_ALL, CMD_F_MESSAGE, cmd_echo, result_args,
        "Answers the message", "connection", ARGS(STR("message"))),
    CMD("INFO", -1, ROLES_ALL, CMD_F_LOADING | CMD_F_LONG, cmd_info, NULL,
        "Returns information about the server and the store", "server", ARGS(MORE("section"))),
    CMD("AUTH", -2, ROLES_ALL, CMD_F_NOAUTH | CMD_F_LOADING, cmd_auth, NULL,
        "Authenticates the connection", "connection",
        ARGS({.name = "username", .type = "string", .flags = DOC_OPTIONAL}, STR("password"))),
    CMD("HELLO", -1, ROLES_ALL, CMD_F_NOAUTH | CMD_F_LOADING, cmd_hello, NULL,
        "Answers with the server's properties (protocol 2 only), authenticating and naming the "
        "connection", "connection",
        ARGS({.name = "protover", .type = "integer", .flags = DOC_OPTIONAL},
             {.name = "auth", .type = "block", .token = "AUTH", .flags = DOC_OPTIONAL,
              .sub = ARGS(STR("username"), STR("password"))},
             OPT_STR("SETNAME", "clientname"))),
    CMD("CLIENT", -2, ROLES_ALL, CMD_F_LOADING, cmd_client, NULL,
        "Names the connection or reads its name or id (SETNAME, GETNAME, ID, SETINFO)",
        "connection", ARGS(STR("subcommand"), MORE("argument"))),
    CMD("SELECT", 2, ROLES_ALL, CMD_F_LOADING, cmd_select, NULL,
        "Selects database 0, the only one", "connection", ARGS(INT("index"))),
    CMD("COMMAND", -1, ROLES_ALL, CMD_F_LOADING | CMD_F_LONG, cmd_command, NULL,
        "Describes the commands (COUNT, DOCS, INFO)", "server",
        ARGS({.name = "subcommand", .type = "string", .flags = DOC_OPTIONAL}, MORE("argument"))),
    CMD("CONFIG", -2, ROLES_READ, CMD_F_LOADING | CMD_F_LONG, cmd_config, NULL,
        "Returns the settings that match the patterns (GET only)", "server",
        ARGS(PURE("GET"), {.name = "parameter", .type = "string", .flags = DOC_MULTIPLE})),
    CMD("QUIT", -1, ROLES_ALL, CMD_F_NOAUTH | CMD_F_LOADING, cmd_quit, NULL,
        "Closes the connection once the replies before it are written", "connection", NULL),
    CMD("DEBUG", -2, ROLE_ADMIN, 0, cmd_debug, NULL,
        "Reads or moves the test clock (with --test-clock; admin)", "server",
        ARGS(PURE("CLOCK"),
             {.name = "action", .type = "oneof",
              .sub = ARGS(PURE("GET"), {.name = "ms", .type = "integer", .token = "SET"},
                          {.name = "ms", .type = "integer", .token = "ADVANCE"})})),
};
/* clang-format on */
#undef CMD
#undef ARGS
#undef KEY
#undef KEYS
#undef STR
#undef INT
#undef PURE
#undef OPT_PURE
#undef OPT_INT
#undef OPT_STR
#undef MORE
const size_t cmd_table_len = sizeof cmd_table / sizeof cmd_table[0];

/* Commands refused by name: each would extend, replace or un-expire a record. */
static const struct {
    const char *name;
    const char *why;
} refused[] = {
    {"GETSET", "it would replace a record; records are insert-only (use SET key value NX PX ms "
               "GET)"},
    {"EXPIRE", "records keep the ttl of their first claim; expiry is never extended or changed"},
    {"PEXPIRE", "records keep the ttl of their first claim; expiry is never extended or changed"},
    {"EXPIREAT", "records keep the ttl of their first claim; expiry is never changed"},
    {"PEXPIREAT", "records keep the ttl of their first claim; expiry is never changed"},
    {"PERSIST", "a record that never expires is not allowed; expiry is never removed"},
    {"GETEX", "records keep the ttl of their first claim; expiry is never changed"},
    {"SETEX", "it would replace a record; use SET key value NX EX seconds"},
    {"PSETEX", "it would replace a record; use SET key value NX PX ms"},
    {"GETDEL", "deleting is an audited admin action: use DEL"},
    {"MSET", "it would replace records; use SET key value NX PX ms"},
    {"APPEND", "it would change a recorded result"},
    {"SETRANGE", "it would change a recorded result"},
    {"INCR", "it would change a recorded result"},
    {"INCRBY", "it would change a recorded result"},
    {"INCRBYFLOAT", "it would change a recorded result"},
    {"DECR", "it would change a recorded result"},
    {"DECRBY", "it would change a recorded result"},
    {"SETNX", "a record that never expires is not allowed; use SET key value NX PX ms"},
    {"MSETNX", "a record that never expires is not allowed; use SET key value NX PX ms"},
    {"RENAME", "it would replace a record under another key; records are insert-only"},
    {"RENAMENX", "it would make a record under another key outside a claim"},
    {"COPY", "it would make or replace a record under another key outside a claim"},
    {"MOVE", "there is one database, 0"},
    {"RESTORE", "it would make or replace a record outside a claim"},
    {"UNLINK", "deleting is an audited admin action: use DEL"},
    {"FLUSHDB", "deleting is an audited admin action, key by key: use DEL"},
    {"FLUSHALL", "deleting is an audited admin action, key by key: use DEL"},
};

/* The entry of refused[] named name[0..n), or -1. */
static int refused_index(const uint8_t *name, uint32_t n)
{
    for (size_t i = 0; i < sizeof refused / sizeof refused[0]; i++)
        if (name_is(name, n, refused[i].name)) return (int)i;
    return -1;
}

const cmd_def *cmd_find(const uint8_t *name, uint32_t n)
{
    for (size_t i = 0; i < cmd_table_len; i++)
        if (cmd_table[i].name_len == n &&
            strncasecmp(cmd_table[i].name, (const char *)name, n) == 0)
            return &cmd_table[i];
    return NULL;
}

void cmd_log_operator(cmd_req *r, const char *fmt, ...)
{
    char what[768];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(what, sizeof what, fmt, ap);
    va_end(ap);
    srv_log("info", "operator", "id=%llu req=%u actor=%s %s", (unsigned long long)r->c->id, r->seq,
            cmd_actor(r->c), what);
}

static void unknown_command(cmd_req *r)
{
    char name[48];
    int i = refused_index(r->argv[0], r->argl[0]);
    if (i >= 0) return cmd_fail(r, "ERR %s is refused: %s", refused[i].name, refused[i].why);
    util_printable(name, sizeof name, r->argv[0], r->argl[0]);
    cmd_fail(r, "ERR unknown command '%s'", name);
}

static int roles_allow(const cmd_def *d, int role)
{
    return (d->roles & role) != 0;
}

/* The reply r is owed until it is made: the largest record reply for a command whose reply may
 * carry a result (SET's only with GET; with the longest result served, once one stored under a
 * larger --result-max was), else SRV_REPLY_SMALL (reads raise theirs once their
 * bound is known: srv_reply_owe). */
static uint32_t reply_max(const cmd_req *r, const cmd_def *d)
{
    if (d && (d->flags & CMD_F_MESSAGE))
        return r->argc > 1 && r->argl[1] > SRV_REPLY_SMALL - 32 ? r->argl[1] + 32 : SRV_REPLY_SMALL;
    if (d && (d->flags & CMD_F_LONG)) return SRV_REPLY_LONG;
    if (!d || !(d->flags & CMD_F_RESULT)) return SRV_REPLY_SMALL;
    if (d->fn == cmd_set) {
        uint32_t i = 3;
        while (i < r->argc && !cmd_is(r, i, "GET"))
            i++;
        if (i == r->argc) return SRV_REPLY_SMALL;
    }
    return (uint32_t)srv_record_reply_now(r->s);
}

uint64_t srv_next_reply_max(const srv *s, const uint8_t *in, size_t n)
{
    const uint8_t *p = in, *end = in + n, *name;
    size_t len = 0;
    int bare;                   /* the name alone: no message to repeat */
    if (p < end && *p == '*') { /* *argc CRLF $len CRLF name CRLF */
        const uint8_t *nl = memchr(p, '\n', n);
        if (!nl || end - nl < 2 || nl[1] != '$') return srv_record_reply_now(s);
        bare = nl - p == 3 && p[1] == '1' && p[2] == '\r';
        for (p = nl + 2; p < end && *p >= '0' && *p <= '9' && len <= 64; p++)
            len = len * 10 + (size_t)(*p - '0');
        if (end - p < 2 || p[0] != '\r' || (size_t)(end - p - 2) < len)
            return srv_record_reply_now(s);
        name = p + 2;
    } else { /* inline: the first word */
        for (name = p; p < end && *p != ' ' && *p != '\r' && *p != '\n'; p++)
            len++;
        if (p == end) return srv_record_reply_now(s);
        /* the parser splits words at \r, \t, \v and \f too: bare only before the line's end */
        bare = *p == '\n' || (*p == '\r' && end - p >= 2 && p[1] == '\n');
    }
    const cmd_def *d = len <= 64 ? cmd_find(name, (uint32_t)len) : NULL;
    if (!d || (d->flags & CMD_F_RESULT)) return srv_record_reply_now(s);
    if (d->flags & CMD_F_MESSAGE) return bare ? SRV_REPLY_SMALL : srv_record_reply_now(s);
    return d->flags & CMD_F_LONG ? SRV_REPLY_LONG : SRV_REPLY_SMALL;
}

void cmd_dispatch(srv *s, srv_conn *c, uint32_t seq, uint32_t argc, const uint8_t *const *argv,
                  const uint32_t *argl)
{
    cmd_req r = {s, c, seq, argc, argv, argl};
    const cmd_def *d = cmd_find(argv[0], argl[0]);
    srv_reply_reserve(s, c, seq, reply_max(&r, d));
    if (!d) {
        if (c->role == ROLE_NONE) return cmd_fail(&r, "NOAUTH Authentication required.");
        return unknown_command(&r);
    }
    if (c->role == ROLE_NONE && !(d->flags & CMD_F_NOAUTH))
        return cmd_fail(&r, "NOAUTH Authentication required.");
    char name[32]; /* as Redis names a command in an error: lower case */
    cmd_name_lower(d->name, name, sizeof name);
    if ((d->arity > 0 && argc != (uint32_t)d->arity) ||
        (d->arity < 0 && argc < (uint32_t)-d->arity))
        return cmd_fail(&r, "ERR wrong number of arguments for '%s' command", name);
    if (c->role != ROLE_NONE && !roles_allow(d, c->role))
        return cmd_fail(&r,
                        "NOPERM this user (role %s) has no permissions to run the '%s' "
                        "command",
                        auth_role_name(c->role), name);
    if (s->loading && !(d->flags & CMD_F_LOADING))
        return cmd_fail(&r, "LOADING idemd is recovering the store; try again shortly");
    if (s->draining && (d->flags & CMD_F_WRITE)) return cmd_fail(&r, "ERR server is shutting down");
    d->fn(&r);
}

/* ---- the parser's field limits ---- */

uint32_t cmd_arg_max(void *ctx, const uint8_t *const *argv, const uint32_t *argl, uint32_t index,
                     const char **field)
{
    if (index == 0) {
        *field = "command name";
        return 64;
    }
    const cmd_def *d = cmd_find(argv[0], argl[0]);
    if (d) return d->arg_max ? d->arg_max(ctx, argv, argl, index, field) : CMD_ARG_MAX_DEFAULT;
    /* A command refused by name is answered with why, whatever the length of its values (a
     * length error would hide it); it is never run, so it is held only as any request is. */
    return refused_index(argv[0], argl[0]) >= 0 ? RESP_BULK_PROTO_MAX : CMD_ARG_MAX_DEFAULT;
}

uint32_t cmd_arg_max_unauth(void *ctx, const uint8_t *const *argv, const uint32_t *argl,
                            uint32_t index, const char **field)
{
    uint32_t max = cmd_arg_max(ctx, argv, argl, index, field);
    if (max <= SRV_UNAUTH_ARG_MAX) return max;
    *field = NULL; /* not the field's limit */
    return SRV_UNAUTH_ARG_MAX;
}

const char *cmd_refusal(const srv_conn *c)
{
    const resp_parser *p = &c->parser;
    if (c->role != ROLE_NONE) return p->err;
    const cmd_def *d = p->refused_name_len ? cmd_find(p->refused_name, p->refused_name_len) : NULL;
    return d && (d->flags & CMD_F_NOAUTH) ? p->err : "NOAUTH Authentication required.";
}

void cmd_parser_limits(srv *s, srv_conn *c)
{
    int unauth = c->role == ROLE_NONE;
    resp_parser_init(&c->parser, unauth ? SRV_UNAUTH_ARGC_MAX : RESP_ARGV_MAX,
                     unauth ? cmd_arg_max_unauth : cmd_arg_max, s);
}
