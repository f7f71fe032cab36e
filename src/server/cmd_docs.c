/*
 * cmd_docs.c: COMMAND DOCS: each command's summary, group and arguments (kept with the command
 * in cmd_table), in the shape Redis 7 gives them, from which redis-cli builds its HELP and the
 * hints it shows as a command is typed.
 *
 * Invariants (of the descriptions in cmd_table, commands.c): every argument has a name and a
 * type, and those of type oneof or block list their parts in `sub` (redis-cli asserts on a
 * missing type and reads flags as status replies).
 */
#include "cmd.h"

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

static void doc_entry(resp_buf *b, const cmd_def *d)
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

void cmd_docs_reply(resp_buf *b, const cmd_req *r)
{
    if (r->argc <= 2) {
        resp_array(b, 2 * (int64_t)cmd_table_len);
        for (size_t i = 0; i < cmd_table_len; i++)
            doc_entry(b, &cmd_table[i]);
        return;
    }
    /* The commands named, those unknown left out (as Redis does), each once however often it
     * is named (Redis repeats it): the reply is never longer than the whole table's, which
     * SRV_REPLY_LONG bounds (cmd_dispatch owes COMMAND that). */
    const cmd_def *named[RESP_ARGV_MAX]; /* at most argc - 2, and argc <= RESP_ARGV_MAX */
    uint32_t found = 0;
    for (uint32_t i = 2; i < r->argc; i++) {
        const cmd_def *d = cmd_find(r->argv[i], r->argl[i]);
        uint32_t j = 0;
        while (j < found && named[j] != d)
            j++;
        if (d && j == found) named[found++] = d;
    }
    resp_array(b, 2 * (int64_t)found);
    for (uint32_t i = 0; i < found; i++)
        doc_entry(b, named[i]);
}
