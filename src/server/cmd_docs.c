/*
 * cmd_docs.c: COMMAND DOCS: each command's summary, group and arguments, in the shape Redis 7
 * gives them, from which redis-cli builds its HELP and the hints it shows as a command is typed.
 *
 * Invariants: every command of cmd_table has an entry here (test_server checks the two lists
 * against each other); every argument has a name and a type, and those of type oneof or block
 * list their parts in `sub` (redis-cli asserts on a missing type and reads flags as status
 * replies).
 */
#include "cmd.h"

#include <string.h>
#include <strings.h>

#define DOC_OPTIONAL 1u
#define DOC_MULTIPLE 2u

struct doc_arg {
    const char *name;
    const char *type; /* key, string, integer, pure-token, oneof, block */
    const char *token;
    unsigned flags;            /* DOC_* */
    const struct doc_arg *sub; /* oneof, block: the parts, ended by one without a name */
};

struct cmd_doc {
    const char *name;
    const char *summary;
    const char *group;
    const struct doc_arg *args; /* ended by one without a name; NULL: none */
};

/* clang-format off */
#define ARGS(...) ((const struct doc_arg[]){__VA_ARGS__, {0}})
#define KEY         {.name = "key", .type = "key"}
#define STR(n)      {.name = n, .type = "string"}
#define INT(n)      {.name = n, .type = "integer"}
#define PURE(t)     {.name = t, .type = "pure-token", .token = t}
#define OPT_INT(t, n) {.name = n, .type = "integer", .token = t, .flags = DOC_OPTIONAL}
#define OPT_STR(t, n) {.name = n, .type = "string", .token = t, .flags = DOC_OPTIONAL}

static const struct cmd_doc docs[] = {
    {"IDEM.CLAIM", "Reserves a key before a side effect; answers new, busy, done, mismatch, "
                   "recover or review", "idem",
     ARGS(KEY, INT("ttl_ms"), INT("lease_ms"), OPT_STR("FP", "content"), OPT_STR("OWNER", "id"),
          OPT_INT("WAIT", "ms"))},
    {"IDEM.COMMIT", "Records the outcome of a claim, with the claim's token", "idem",
     ARGS(KEY, INT("token"), STR("result"))},
    {"IDEM.RELEASE", "Gives a claimed key back: the next claim gets new", "idem",
     ARGS(KEY, INT("token"))},
    {"IDEM.HOLD", "Sends a claimed key to review, for a person to decide", "idem",
     ARGS(KEY, INT("token"), STR("reason"))},
    {"IDEM.EXTEND", "Runs a claim's lease on from now", "idem",
     ARGS(KEY, INT("token"), INT("lease_ms"))},
    {"IDEM.GET", "Returns the whole record of a key", "idem", ARGS(KEY)},
    {"IDEM.SCAN", "Lists keys by state and age, a page at a time", "idem",
     ARGS(INT("cursor"),
          {.name = "state", .type = "oneof", .token = "STATE", .flags = DOC_OPTIONAL,
           .sub = ARGS(PURE("in_flight"), PURE("committed"), PURE("review"))},
          OPT_INT("OLDER", "ms"), OPT_INT("COUNT", "count"))},
    {"IDEM.STATS", "Returns the store's counters", "idem", NULL},
    {"IDEM.RESOLVE", "Decides an unfinished record (admin; audited)", "idem",
     ARGS(KEY,
          {.name = "action", .type = "oneof",
           .sub = ARGS(PURE("commit"), PURE("release"), PURE("settle"))},
          STR("reason"), OPT_STR("RESULT", "result"), OPT_INT("EXPECT", "version"),
          {.name = "FORCE", .type = "pure-token", .token = "FORCE", .flags = DOC_OPTIONAL})},
    {"IDEM.AUDIT", "Lists entries of the audit trail, newest first", "idem",
     ARGS({.name = "key", .type = "key", .token = "KEY", .flags = DOC_OPTIONAL},
          OPT_INT("COUNT", "count"), OPT_INT("BEFORE", "seq"))},
    {"IDEM.ATTENTION", "Lists the records that wait for a person or a reconciler", "idem",
     ARGS(OPT_INT("OLDER", "ms"), OPT_INT("COUNT", "count"))},
    {"IDEM.BACKUP", "Writes a consistent copy of the store into a new directory (admin)", "idem",
     ARGS(STR("path"))},
    {"SET", "Creates a committed record whose result is the value, if the key is absent (NX and "
            "an expiry required)", "string",
     ARGS(KEY, STR("value"), PURE("NX"),
          {.name = "expiration", .type = "oneof",
           .sub = ARGS({.name = "milliseconds", .type = "integer", .token = "PX"},
                       {.name = "seconds", .type = "integer", .token = "EX"})},
          {.name = "GET", .type = "pure-token", .token = "GET", .flags = DOC_OPTIONAL})},
    {"GET", "Returns the result of a committed record", "string", ARGS(KEY)},
    {"EXISTS", "Counts the keys that have a record", "generic",
     ARGS({.name = "key", .type = "key", .flags = DOC_MULTIPLE})},
    {"PTTL", "Returns the milliseconds until a committed record expires", "generic", ARGS(KEY)},
    {"TTL", "Returns the seconds until a committed record expires", "generic", ARGS(KEY)},
    {"DEL", "Deletes records (admin; audited)", "generic",
     ARGS({.name = "key", .type = "key", .flags = DOC_MULTIPLE})},
    {"DBSIZE", "Returns the number of records", "server", NULL},
    {"PING", "Answers PONG, or the message", "connection",
     ARGS({.name = "message", .type = "string", .flags = DOC_OPTIONAL})},
    {"ECHO", "Answers the message", "connection", ARGS(STR("message"))},
    {"INFO", "Returns information about the server and the store", "server",
     ARGS({.name = "section", .type = "string", .flags = DOC_OPTIONAL | DOC_MULTIPLE})},
    {"AUTH", "Authenticates the connection", "connection",
     ARGS({.name = "username", .type = "string", .flags = DOC_OPTIONAL}, STR("password"))},
    {"HELLO", "Answers with the server's properties (protocol 2 only), authenticating and "
              "naming the connection", "connection",
     ARGS({.name = "protover", .type = "integer", .flags = DOC_OPTIONAL},
          {.name = "auth", .type = "block", .token = "AUTH", .flags = DOC_OPTIONAL,
           .sub = ARGS(STR("username"), STR("password"))},
          OPT_STR("SETNAME", "clientname"))},
    {"CLIENT", "Names the connection or reads its name or id (SETNAME, GETNAME, ID, SETINFO)",
     "connection",
     ARGS(STR("subcommand"),
          {.name = "argument", .type = "string", .flags = DOC_OPTIONAL | DOC_MULTIPLE})},
    {"SELECT", "Selects database 0, the only one", "connection", ARGS(INT("index"))},
    {"COMMAND", "Describes the commands (COUNT, DOCS, INFO)", "server",
     ARGS({.name = "subcommand", .type = "string", .flags = DOC_OPTIONAL},
          {.name = "argument", .type = "string", .flags = DOC_OPTIONAL | DOC_MULTIPLE})},
    {"CONFIG", "Returns the settings that match the patterns (GET only)", "server",
     ARGS(PURE("GET"), {.name = "parameter", .type = "string", .flags = DOC_MULTIPLE})},
    {"QUIT", "Closes the connection once the replies before it are written", "connection", NULL},
    {"DEBUG", "Reads or moves the test clock (with --test-clock; admin)", "server",
     ARGS(PURE("CLOCK"),
          {.name = "action", .type = "oneof",
           .sub = ARGS(PURE("GET"), {.name = "ms", .type = "integer", .token = "SET"},
                       {.name = "ms", .type = "integer", .token = "ADVANCE"})})},
};
/* clang-format on */

static int64_t args_count(const struct doc_arg *a)
{
    int64_t n = 0;
    while (a && a[n].name)
        n++;
    return n;
}

static void doc_args(resp_buf *b, const struct doc_arg *args)
{
    resp_array(b, args_count(args));
    for (const struct doc_arg *a = args; a->name; a++) {
        resp_array(b, 4 + 2 * ((a->token != NULL) + (a->flags != 0) + (a->sub != NULL)));
        resp_bulk_str(b, "name");
        resp_bulk_str(b, a->name);
        resp_bulk_str(b, "type");
        resp_bulk_str(b, a->type);
        if (a->token) {
            resp_bulk_str(b, "token");
            resp_bulk_str(b, a->token);
        }
        if (a->flags) {
            resp_bulk_str(b, "flags");
            resp_array(b, !!(a->flags & DOC_OPTIONAL) + !!(a->flags & DOC_MULTIPLE));
            if (a->flags & DOC_OPTIONAL) resp_simple(b, "optional");
            if (a->flags & DOC_MULTIPLE) resp_simple(b, "multiple");
        }
        if (a->sub) {
            resp_bulk_str(b, "arguments");
            doc_args(b, a->sub);
        }
    }
}

static void doc_entry(resp_buf *b, const struct cmd_doc *d)
{
    char lower[32];
    cmd_name_lower(d->name, lower, sizeof lower);
    resp_bulk_str(b, lower);
    resp_array(b, d->args ? 8 : 6);
    resp_bulk_str(b, "summary");
    resp_bulk_str(b, d->summary);
    resp_bulk_str(b, "since");
    resp_bulk_str(b, "0.1.0");
    resp_bulk_str(b, "group");
    resp_bulk_str(b, d->group);
    if (d->args) {
        resp_bulk_str(b, "arguments");
        doc_args(b, d->args);
    }
}

static const struct cmd_doc *doc_find(const uint8_t *name, uint32_t len)
{
    for (size_t i = 0; i < sizeof docs / sizeof docs[0]; i++)
        if (strlen(docs[i].name) == len && strncasecmp(docs[i].name, (const char *)name, len) == 0)
            return &docs[i];
    return NULL;
}

void cmd_docs_reply(resp_buf *b, const cmd_req *r)
{
    size_t n = sizeof docs / sizeof docs[0];
    if (r->argc <= 2) {
        resp_array(b, 2 * (int64_t)n);
        for (size_t i = 0; i < n; i++)
            doc_entry(b, &docs[i]);
        return;
    }
    /* The commands named, each once per naming, those unknown left out (as Redis does). */
    int64_t found = 0;
    for (uint32_t i = 2; i < r->argc; i++)
        found += doc_find(r->argv[i], r->argl[i]) != NULL;
    resp_array(b, 2 * found);
    for (uint32_t i = 2; i < r->argc; i++) {
        const struct cmd_doc *d = doc_find(r->argv[i], r->argl[i]);
        if (d) doc_entry(b, d);
    }
}
