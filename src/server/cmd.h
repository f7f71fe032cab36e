/*
 * cmd.h: private to the command modules (commands.c: table, dispatch and connection commands;
 * cmd_idem.c: the key commands that go to the engine; cmd_admin.c: stats, scans, the attention
 * list, audit, backup, DEL, DBSIZE, INFO, CONFIG, COMMAND, DEBUG CLOCK; cmd_docs.c: COMMAND DOCS,
 * from the table's descriptions). A handler answers its request now (reply + done) or queues engine
 * ops with srv_submit_op; it never keeps argv past its return.
 */
#ifndef IDEM_SERVER_CMD_H
#define IDEM_SERVER_CMD_H

#include "server.h"

#define CMD_F_NOAUTH  0x1  /* allowed before AUTH */
#define CMD_F_LOADING 0x2  /* allowed while the store recovers */
#define CMD_F_WRITE   0x4  /* for COMMAND's flags */
#define CMD_F_RESULT  0x8  /* its reply may carry a result or a record (srv_record_reply_max) */
#define CMD_F_MESSAGE 0x10 /* its reply repeats its message, as long as a result (PING, ECHO) */
#define CMD_F_LONG    0x20 /* its reply may pass SRV_REPLY_SMALL, never SRV_REPLY_LONG */

#define ROLES_ALL  (ROLE_WORKER | ROLE_READER | ROLE_ADMIN)
#define ROLES_READ (ROLE_READER | ROLE_ADMIN)
#define ROLES_WORK (ROLE_WORKER | ROLE_ADMIN)

typedef struct cmd_req {
    srv *s;
    srv_conn *c;
    uint32_t seq;
    uint32_t argc;
    const uint8_t *const *argv;
    const uint32_t *argl;
} cmd_req;

typedef void (*cmd_fn)(cmd_req *r);
/* The longest argument `index` (1..) of a request may be, given the arguments before it: the
 * parser discards a longer one as it streams in (resp_arg_max_fn). Names the field in *field
 * where it has a name. */
typedef uint32_t (*cmd_arg_fn)(const srv *s, const uint8_t *const *argv, const uint32_t *argl,
                               uint32_t index, const char **field);

#define DOC_OPTIONAL 1u
#define DOC_MULTIPLE 2u

/* One argument of a command as COMMAND DOCS describes it (cmd_docs.c). */
struct doc_arg {
    const char *name;
    const char *type; /* key, string, integer, pure-token, oneof, block */
    const char *token;
    unsigned flags;            /* DOC_* */
    const struct doc_arg *sub; /* oneof, block: the parts, ended by one without a name */
};

typedef struct cmd_def {
    const char *name;
    uint32_t name_len;
    int arity; /* > 0: exactly; < 0: at least -arity (the name included) */
    int roles;
    int flags;
    cmd_fn fn;
    cmd_arg_fn arg_max; /* NULL: CMD_ARG_MAX_DEFAULT for every argument */
    const char *summary, *group;
    /* Ended by one without a name; NULL: none. A first argument of type key, neither optional
     * nor after a token, makes the command keyed for COMMAND (one key, or all that follow if it
     * is multiple). */
    const struct doc_arg *args;
} cmd_def;

#define CMD_ARG_MAX_DEFAULT 4096 /* reasons, notes and option words, unless a command says */

/* The reply buffer of r, and marking it answered. */
resp_buf *cmd_out(cmd_req *r);
void cmd_done(cmd_req *r);
/* Shorthands that answer at once. */
void cmd_ok(cmd_req *r);
void cmd_fail(cmd_req *r, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
void cmd_int(cmd_req *r, int64_t v);

/* Is argv[i] equal to the word (ASCII case-insensitive)? */
int cmd_is(const cmd_req *r, uint32_t i, const char *word);
/* A command's name in lower case, as COMMAND and COMMAND DOCS list it (cut to size - 1). */
void cmd_name_lower(const char *name, char *out, size_t size);
/* The command named name[0..n) (ASCII case-insensitive), or NULL. */
const cmd_def *cmd_find(const uint8_t *name, uint32_t n);
/* COMMAND DOCS [name ...]: every command's description, or those named (cmd_docs.c). */
void cmd_docs_reply(resp_buf *b, const cmd_req *r);
/* The option named by argv[i], with its value at argv[i + 1]: its index in names[0..n), each
 * allowed once (*seen keeps those given), or -1 once r is answered (no value, an option not in
 * names, which `usage` lists, or one given twice). */
int cmd_option(cmd_req *r, uint32_t i, const char *const *names, unsigned n, unsigned *seen,
               const char *usage);
/* Strict decimal parsing, as Redis's: digits only (cmd_i64: after one '-'), no leading zero,
 * no "-0". Return 0 or -1. */
int cmd_u64(const uint8_t *p, uint32_t n, uint64_t *out);
int cmd_i64(const uint8_t *p, uint32_t n, int64_t *out);
/* Checks a key's length; on failure answers the request and returns -1. */
int cmd_key_ok(cmd_req *r, uint32_t i);
/* The actor recorded in the audit trail for this connection. */
const char *cmd_actor(srv_conn *c);
uint32_t cmd_result_max(const srv *s);
/* Logs an operator decision (IDEM.RESOLVE, DEL) as requested: event=operator, with c's id and
 * the request's number, which its outcome's line (event=operator_result) repeats. */
void cmd_log_operator(cmd_req *r, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

/* The store's and the server's counters, by name (IDEM.STATS, INFO idem, metrics). */
typedef struct cmd_stat {
    const char *name;
    int64_t value;
} cmd_stat;
#define CMD_STATS_MAX 96
/* IDEM.STATS's figures: lists the engine's (one reading, made on the stats line: reads.c) with
 * the server's into out (CMD_STATS_MAX entries). Returns how many. */
int cmd_stats_list(const srv *s, const idem_stats *engine, cmd_stat *out);

/* Handlers, by module. */
void cmd_claim(cmd_req *r);
void cmd_commit(cmd_req *r);
void cmd_release(cmd_req *r);
void cmd_hold(cmd_req *r);
void cmd_extend(cmd_req *r);
void cmd_idem_get(cmd_req *r);
void cmd_resolve(cmd_req *r);
void cmd_set(cmd_req *r);
void cmd_get(cmd_req *r);
void cmd_exists(cmd_req *r);
void cmd_pttl(cmd_req *r);
void cmd_ttl(cmd_req *r);

void cmd_scan(cmd_req *r);
void cmd_stats(cmd_req *r);
void cmd_audit(cmd_req *r);
void cmd_attention(cmd_req *r);
void cmd_backup(cmd_req *r);
/* Writes a record as IDEM.GET answers it (field/value pairs). */
void cmd_reply_record(resp_buf *b, const idem_record *rec);
/* Whether a reply carrying a result of result_len bytes and room bytes more fits
 * --client-output-max (output_max); if not, b gets an error that names the limit it needs. */
int cmd_reply_fits(resp_buf *b, uint32_t result_len, uint32_t room, uint64_t output_max);
void cmd_del(cmd_req *r);
void cmd_dbsize(cmd_req *r);
void cmd_info(cmd_req *r);
void cmd_config(cmd_req *r);
void cmd_command(cmd_req *r);
void cmd_debug(cmd_req *r);

extern const cmd_def cmd_table[];
extern const size_t cmd_table_len;

#endif /* IDEM_SERVER_CMD_H */
