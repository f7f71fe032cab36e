/*
 * cmd_idem.c: the key commands that go to the engine (IDEM.CLAIM and the owner calls, IDEM.GET,
 * IDEM.RESOLVE, SET NX, GET, EXISTS, PTTL, TTL) and the replies of their completions.
 *
 * Each handler checks its arguments (answering -ERR at once, changing nothing) and queues one
 * engine op per key; the reply is written by cmd_complete when the engine delivers the
 * completion, which in sync mode means the change is durable.
 */
#include "cmd.h"

#include <stdio.h>
#include <string.h>

#include "util.h"

void cmd_reply_err(resp_buf *b, int err)
{
    switch (err) {
    case IDEM_ESTALE:
        resp_error(b, "STALE token is not the current owner's (the record was committed, "
                      "recovered, resolved, held or re-claimed)");
        break;
    case IDEM_ENOTFOUND:
        resp_error(b, "NOTFOUND no such key (absent, expired or released)");
        break;
    case IDEM_ECONFLICT:
        resp_error(b, "CONFLICT commit repeated with a different result (counted in "
                      "conflicting_commits)");
        break;
    case IDEM_ECHANGED:
        resp_error(b, "CHANGED the record's version is not the one expected; look again");
        break;
    case IDEM_EFULL:
        resp_error(b, "FULL capacity limit or full disk (or no file descriptor or memory for the "
                      "log or its token reservation): nothing was stored or evicted");
        break;
    case IDEM_ESTATE:
        resp_error(b, "ERR the record is in_flight or in review: it has no outcome yet "
                      "(an admin decides with IDEM.RESOLVE)");
        break;
    case IDEM_ELEASE:
        resp_error(b, "ERR the lease still runs: add FORCE to act on a running claim");
        break;
    case IDEM_EFATAL:
        resp_error(b, "ERR fatal store error: the outcome of this request is unknown");
        break;
    case IDEM_ECLOSED:
        resp_error(b, "ERR server is shutting down");
        break;
    case IDEM_EREADONLY:
        resp_error(b, "READONLY the store is open read-only");
        break;
    default:
        resp_errorf(b, "ERR %s", idem_strerror(err));
        break;
    }
}

/* Parses argv[i] as an integer in 1..max; on failure answers -ERR naming `what`. */
static int arg_range(cmd_req *r, uint32_t i, const char *what, uint64_t max, uint64_t *out)
{
    if (cmd_u64(r->argv[i], r->argl[i], out) < 0 || *out == 0 || *out > max) {
        cmd_fail(r, "ERR %s is not a positive integer of at most %llu", what,
                 (unsigned long long)max);
        return -1;
    }
    return 0;
}

static int arg_token(cmd_req *r, uint32_t i, int64_t *token)
{
    if (cmd_i64(r->argv[i], r->argl[i], token) < 0 || *token <= 0) {
        cmd_fail(r, "ERR token is not a positive integer");
        return -1;
    }
    return 0;
}

static void op_key(idem_op *op, uint32_t kind, const cmd_req *r, uint32_t i)
{
    memset(op, 0, sizeof *op);
    op->kind = kind;
    op->key = r->argv[i];
    op->key_len = r->argl[i];
}

/* IDEM.CLAIM key ttl_ms lease_ms [FP bytes] [OWNER id] [WAIT ms] */
void cmd_claim(cmd_req *r)
{
    idem_op op;
    uint64_t v;
    if (cmd_key_ok(r, 1) < 0) return;
    op_key(&op, IDEM_OP_CLAIM, r, 1);
    if (arg_range(r, 2, "ttl_ms", IDEM_TTL_MS_MAX, &op.ttl_ms) < 0 ||
        arg_range(r, 3, "lease_ms", IDEM_LEASE_MS_MAX, &op.lease_ms) < 0)
        return;
    static const char *const opts[] = {"FP", "OWNER", "WAIT"};
    unsigned seen = 0;
    for (uint32_t i = 4; i < r->argc; i += 2) {
        int k = cmd_option(r, i, opts, IDEM_ARRAY_LEN(opts), &seen, "FP, OWNER, WAIT");
        if (k < 0) return;
        if (k == 0) {
            op.fp = r->argv[i + 1];
            op.fp_len = r->argl[i + 1];
        } else if (k == 1) {
            if (r->argl[i + 1] == 0 || r->argl[i + 1] > IDEM_OWNER_BYTES_MAX)
                return cmd_fail(r, "ERR owner id must be 1..%u bytes", IDEM_OWNER_BYTES_MAX);
            op.owner = r->argv[i + 1];
            op.owner_len = r->argl[i + 1];
        } else {
            if (cmd_u64(r->argv[i + 1], r->argl[i + 1], &v) < 0 || v > IDEM_WAIT_MS_MAX)
                return cmd_fail(r, "ERR WAIT ms is not an integer of at most %u", IDEM_WAIT_MS_MAX);
            op.wait_ms = (uint32_t)v;
        }
    }
    srv_submit_op(r->s, r->c, r->seq, RK_CLAIM, &op);
}

/* Shared by the owner calls: key and token. */
static int owner_op(cmd_req *r, uint32_t kind, idem_op *op)
{
    if (cmd_key_ok(r, 1) < 0) return -1;
    op_key(op, kind, r, 1);
    return arg_token(r, 2, &op->token);
}

void cmd_commit(cmd_req *r)
{
    idem_op op;
    if (owner_op(r, IDEM_OP_COMMIT, &op) < 0) return;
    if (r->argl[3] > cmd_result_max(r->s))
        return cmd_fail(r, "ERR result over the limit (%u bytes, at most %u)", r->argl[3],
                        cmd_result_max(r->s));
    op.data = r->argv[3];
    op.data_len = r->argl[3];
    srv_submit_op(r->s, r->c, r->seq, RK_OWNER, &op);
}

void cmd_release(cmd_req *r)
{
    idem_op op;
    if (owner_op(r, IDEM_OP_RELEASE, &op) == 0) srv_submit_op(r->s, r->c, r->seq, RK_OWNER, &op);
}

void cmd_hold(cmd_req *r)
{
    idem_op op;
    if (owner_op(r, IDEM_OP_HOLD, &op) < 0) return;
    if (r->argl[3] > IDEM_NOTE_BYTES_MAX)
        return cmd_fail(r, "ERR reason too long (at most %u bytes)", IDEM_NOTE_BYTES_MAX);
    op.data = r->argv[3];
    op.data_len = r->argl[3];
    srv_submit_op(r->s, r->c, r->seq, RK_OWNER, &op);
}

void cmd_extend(cmd_req *r)
{
    idem_op op;
    if (owner_op(r, IDEM_OP_EXTEND, &op) < 0 ||
        arg_range(r, 3, "lease_ms", IDEM_LEASE_MS_MAX, &op.lease_ms) < 0)
        return;
    srv_submit_op(r->s, r->c, r->seq, RK_OWNER, &op);
}

static void submit_get(cmd_req *r, uint32_t i, int kind)
{
    idem_op op;
    op_key(&op, IDEM_OP_GET, r, i);
    srv_submit_op(r->s, r->c, r->seq, kind, &op);
}

void cmd_idem_get(cmd_req *r)
{
    if (cmd_key_ok(r, 1) == 0) submit_get(r, 1, RK_RECORD);
}

void cmd_get(cmd_req *r)
{
    if (cmd_key_ok(r, 1) == 0) submit_get(r, 1, RK_GET);
}

void cmd_pttl(cmd_req *r)
{
    if (cmd_key_ok(r, 1) == 0) submit_get(r, 1, RK_PTTL);
}

void cmd_ttl(cmd_req *r)
{
    if (cmd_key_ok(r, 1) == 0) submit_get(r, 1, RK_TTL);
}

void cmd_exists(cmd_req *r)
{
    for (uint32_t i = 1; i < r->argc; i++)
        if (cmd_key_ok(r, i) < 0) return;
    for (uint32_t i = 1; i < r->argc; i++)
        submit_get(r, i, RK_EXISTS);
}

/* IDEM.RESOLVE key action reason [RESULT bytes] [EXPECT version] [FORCE] */
void cmd_resolve(cmd_req *r)
{
    idem_op op;
    if (cmd_key_ok(r, 1) < 0) return;
    op_key(&op, IDEM_OP_RESOLVE, r, 1);
    if (cmd_is(r, 2, "commit"))
        op.action = IDEM_RESOLVE_COMMIT;
    else if (cmd_is(r, 2, "release"))
        op.action = IDEM_RESOLVE_RELEASE;
    else if (cmd_is(r, 2, "settle"))
        op.action = IDEM_RESOLVE_SETTLE;
    else
        return cmd_fail(r, "ERR action must be commit, release or settle");
    if (r->argl[3] == 0) return cmd_fail(r, "ERR the reason is empty: the audit trail records why");
    if (r->argl[3] > IDEM_NOTE_BYTES_MAX)
        return cmd_fail(r, "ERR reason too long (at most %u bytes)", IDEM_NOTE_BYTES_MAX);
    if (memchr(r->argv[3], 0, r->argl[3]))
        return cmd_fail(r, "ERR the reason holds a NUL byte (the audit trail keeps text)");
    op.data = r->argv[3];
    op.data_len = r->argl[3];
    for (uint32_t i = 4; i < r->argc; i++) {
        /* Each option once: an operator's decision is not guessed from two of them. */
        if ((cmd_is(r, i, "FORCE") && (op.flags & IDEM_F_FORCE)) ||
            (cmd_is(r, i, "RESULT") && op.result) ||
            (cmd_is(r, i, "EXPECT") && (op.flags & IDEM_F_EXPECT)))
            return cmd_fail(r, "ERR syntax error: %s given twice",
                            cmd_is(r, i, "FORCE")    ? "FORCE"
                            : cmd_is(r, i, "RESULT") ? "RESULT"
                                                     : "EXPECT");
        if (cmd_is(r, i, "FORCE")) {
            op.flags |= IDEM_F_FORCE;
        } else if (cmd_is(r, i, "RESULT") && i + 1 < r->argc) {
            if (op.action != IDEM_RESOLVE_COMMIT)
                return cmd_fail(r, "ERR RESULT goes with commit only (release and settle write "
                                   "no result)");
            if (r->argl[i + 1] > cmd_result_max(r->s))
                return cmd_fail(r, "ERR result over the limit (at most %u bytes)",
                                cmd_result_max(r->s));
            op.result = r->argv[++i];
            op.result_len = r->argl[i];
        } else if (cmd_is(r, i, "EXPECT") && i + 1 < r->argc) {
            if (cmd_u64(r->argv[i + 1], r->argl[i + 1], &op.expect_version) < 0)
                return cmd_fail(r, "ERR EXPECT version is not an integer");
            op.flags |= IDEM_F_EXPECT;
            i++;
        } else if (cmd_is(r, i, "RESULT") || cmd_is(r, i, "EXPECT")) {
            return cmd_fail(r, "ERR syntax error: option without a value");
        } else {
            return cmd_fail(r, "ERR syntax error (RESULT bytes, EXPECT version, FORCE)");
        }
    }
    op.actor = cmd_actor(r->c);
    static const char *const actions[] = {"?", "commit", "release", "settle"};
    char key[80], reason[80], expect[24] = "none";
    util_printable(key, sizeof key, op.key, (uint32_t)op.key_len);
    util_printable(reason, sizeof reason, op.data, op.data_len);
    if (op.flags & IDEM_F_EXPECT)
        snprintf(expect, sizeof expect, "%llu", (unsigned long long)op.expect_version);
    cmd_log_operator(r,
                     "cmd=IDEM.RESOLVE key=\"%s\" key_len=%u action=%s force=%d expect=%s "
                     "result_len=%u reason=\"%s\"",
                     key, op.key_len, actions[op.action & 3], (op.flags & IDEM_F_FORCE) != 0,
                     expect, op.result ? op.result_len : 0, reason);
    srv_submit_op(r->s, r->c, r->seq, RK_RESOLVE, &op);
}

/* Parses SET's options after key and value. Returns 0, or -1 having answered. */
static int set_options(cmd_req *r, uint64_t *ttl_ms, int *nx, int *get)
{
    for (uint32_t i = 3; i < r->argc; i++) {
        uint64_t v;
        if (cmd_is(r, i, "NX")) {
            *nx = 1;
        } else if (cmd_is(r, i, "GET")) {
            *get = 1;
        } else if ((cmd_is(r, i, "PX") || cmd_is(r, i, "EX")) && i + 1 < r->argc) {
            uint64_t mult = cmd_is(r, i, "EX") ? 1000 : 1;
            if (*ttl_ms) {
                cmd_fail(r, "ERR syntax error: one expire time per SET (PX ms or EX s)");
                return -1;
            }
            int64_t sv;
            if (cmd_i64(r->argv[i + 1], r->argl[i + 1], &sv) < 0) { /* as Redis answers it */
                cmd_fail(r, "ERR value is not an integer or out of range");
                return -1;
            }
            v = sv > 0 ? (uint64_t)sv : 0;
            if (v == 0 || v > IDEM_TTL_MS_MAX / mult) {
                cmd_fail(r, "ERR invalid expire time in 'set' command");
                return -1;
            }
            *ttl_ms = v * mult;
            i++;
        } else if (cmd_is(r, i, "XX") || cmd_is(r, i, "KEEPTTL")) {
            cmd_fail(r,
                     "ERR SET %s is refused: records are insert-only and keep the ttl of "
                     "their first write (use SET key value NX PX ms)",
                     cmd_is(r, i, "XX") ? "XX" : "KEEPTTL");
            return -1;
        } else {
            cmd_fail(r, "ERR syntax error (SET key value NX PX ms|EX s [GET])");
            return -1;
        }
    }
    return 0;
}

/* SET key value NX PX ms | EX s [GET], options in any order. */
void cmd_set(cmd_req *r)
{
    uint64_t ttl_ms = 0;
    int nx = 0, get = 0;
    idem_op op;
    if (cmd_key_ok(r, 1) < 0 || set_options(r, &ttl_ms, &nx, &get) < 0) return;
    if (!nx)
        return cmd_fail(r, "ERR SET without NX is refused: it would replace a record; records "
                           "are insert-only (use SET key value NX PX ms)");
    if (!ttl_ms) return cmd_fail(r, "ERR SET needs PX ms or EX s: every record expires");
    if (r->argl[2] > cmd_result_max(r->s))
        return cmd_fail(r, "ERR value over the limit (at most %u bytes)", cmd_result_max(r->s));
    op_key(&op, IDEM_OP_SET_IF_ABSENT, r, 1);
    op.data = r->argv[2];
    op.data_len = r->argl[2];
    op.ttl_ms = ttl_ms;
    op.flags = get ? IDEM_F_GET_OLD : 0;
    srv_submit_op(r->s, r->c, r->seq, get ? RK_SET_GET : RK_SET, &op);
}

/* ---- completions ---- */

static void reply_claim(resp_buf *b, const idem_completion *cp)
{
    switch (cp->outcome) {
    case IDEM_NEW:
    case IDEM_BUSY:
        resp_array(b, 2);
        resp_bulk_str(b, idem_outcome_name(cp->outcome));
        resp_integer(b, cp->outcome == IDEM_NEW ? cp->token : cp->lease_left_ms);
        break;
    case IDEM_DONE:
    case IDEM_REVIEW:
        resp_array(b, 2);
        resp_bulk_str(b, idem_outcome_name(cp->outcome));
        resp_bulk(b, cp->data, cp->data ? cp->data_len : 0);
        break;
    case IDEM_MISMATCH:
        resp_array(b, 1);
        resp_bulk_str(b, "mismatch");
        break;
    case IDEM_RECOVER:
        resp_array(b, 4);
        resp_bulk_str(b, "recover");
        resp_integer(b, cp->token);
        resp_integer(b, cp->attempts);
        resp_integer(b, cp->last_grant_ms);
        break;
    default:
        resp_errorf(b, "ERR engine returned an unknown outcome %d", cp->outcome);
    }
}

static void hex_fp(char out[2 * IDEM_FP_BYTES + 1], const uint8_t *fp)
{
    static const char digits[] = "0123456789abcdef";
    for (unsigned i = 0; i < IDEM_FP_BYTES; i++) {
        out[2 * i] = digits[fp[i] >> 4];
        out[2 * i + 1] = digits[fp[i] & 15];
    }
    out[2 * IDEM_FP_BYTES] = '\0';
}

typedef struct field {
    const char *name;
    const void *v;
    uint32_t n;
    char text[40];
} field;

static void f_bytes(field *f, int *n, const char *name, const void *v, uint32_t len)
{
    f[*n].name = name;
    f[*n].v = v ? v : "";
    f[*n].n = v ? len : 0;
    (*n)++;
}

static void f_num(field *f, int *n, const char *name, int64_t v)
{
    f[*n].name = name;
    f[*n].n = (uint32_t)snprintf(f[*n].text, sizeof f[*n].text, "%lld", (long long)v);
    f[*n].v = f[*n].text;
    (*n)++;
}

static void f_fp(field *f, int *n, const char *name, const uint8_t *fp)
{
    hex_fp(f[*n].text, fp);
    f[*n].name = name;
    f[*n].v = f[*n].text;
    f[*n].n = 2 * IDEM_FP_BYTES;
    (*n)++;
}

uint64_t srv_record_reply_max(const srv_config *cfg)
{
    _Static_assert(IDEM_NOTE_BYTES_MAX + 2 * IDEM_KEY_BYTES_MAX + SRV_RECORD_FRAMING_MAX <=
                       SRV_RECORD_REPLY_ROOM,
                   "a record's reply fits its result and SRV_RECORD_REPLY_ROOM");
    return (uint64_t)(cfg->result_bytes_max ? cfg->result_bytes_max : IDEM_RESULT_BYTES_DEFAULT) +
           SRV_RECORD_REPLY_ROOM;
}

uint64_t srv_record_reply_now(const srv *s)
{
    uint64_t seen = (uint64_t)s->result_seen_max + SRV_RECORD_REPLY_ROOM;
    uint64_t max = srv_record_reply_max(&s->cfg);
    if (seen > max) max = seen;
    return max < s->cfg.client_output_max ? max : s->cfg.client_output_max;
}

/* IDEM.GET: the record as field/value pairs; fields that do not apply are left out (at most 17
 * fields: their names, numbers and framing stay within SRV_RECORD_FRAMING_MAX). */
void cmd_reply_record(resp_buf *b, const idem_record *rec)
{
    field f[24];
    int n = 0;
    f_bytes(f, &n, "key", rec->key, rec->key_len);
    f_bytes(f, &n, "state", idem_state_name(rec->state),
            (uint32_t)strlen(idem_state_name(rec->state)));
    f_num(f, &n, "first_seen_ms", rec->first_seen_ms);
    f_num(f, &n, "expires_at_ms", rec->expires_at_ms);
    f_num(f, &n, "last_seen_ms", rec->last_seen_ms);
    f_num(f, &n, "seen_count", (int64_t)rec->seen_count);
    if (rec->has_fp) f_fp(f, &n, "fingerprint", rec->fp);
    if (rec->state == IDEM_STATE_IN_FLIGHT) {
        f_num(f, &n, "lease_until_ms", rec->lease_until_ms);
        f_num(f, &n, "token", rec->token);
        if (rec->owner) f_bytes(f, &n, "owner", rec->owner, rec->owner_len);
    }
    if (rec->attempts) { /* a SET NX record was never granted to an owner */
        f_num(f, &n, "attempts", rec->attempts);
        f_num(f, &n, "last_grant_ms", rec->last_grant_ms);
    }
    if (rec->state == IDEM_STATE_COMMITTED) f_bytes(f, &n, "result", rec->result, rec->result_len);
    if (rec->note) f_bytes(f, &n, "note", rec->note, rec->note_len);
    f_num(f, &n, "mismatch_count", (int64_t)rec->mismatch_count);
    if (rec->mismatch_count) {
        f_num(f, &n, "last_mismatch_ms", rec->last_mismatch_ms);
        if (rec->has_last_mismatch_fp) f_fp(f, &n, "last_mismatch_fp", rec->last_mismatch_fp);
    }
    f_num(f, &n, "version", (int64_t)rec->version);
    resp_array(b, 2 * n);
    for (int i = 0; i < n; i++) {
        resp_bulk_str(b, f[i].name);
        resp_bulk(b, f[i].v, f[i].n);
    }
}

static void reply_ttl(srv *s, resp_buf *b, const idem_completion *cp, int seconds)
{
    if (!cp->found) return (void)resp_integer(b, -2);
    if (cp->record.state != IDEM_STATE_COMMITTED) return (void)resp_integer(b, -1);
    /* The record was there when it was read: one that expired since answers 0, not -2 (an
     * absence rests on a clock made durable, and this reading of it is not). */
    int64_t left = cp->record.expires_at_ms - idem_clock_now(s->store);
    if (left < 0) left = 0;
    resp_integer(b, seconds ? (left + 500) / 1000 : left);
}

static void reply_set(resp_buf *b, const idem_completion *cp, int get)
{
    if (cp->outcome == IDEM_NEW) {
        if (get)
            resp_nil(b);
        else
            resp_simple(b, "OK");
    } else if (get) {
        resp_bulk(b, cp->data, cp->data ? cp->data_len : 0);
    } else {
        resp_nil(b);
    }
}

/* Counts one key's completion into its DEL; at the last, logs the outcome. Called also when the
 * client has gone, or its request was answered already: the deletes took effect all the same. */
void cmd_del_count(const srv_conn *c, srv_slot *sl, const idem_completion *cp)
{
    sl->keys_done++;
    sl->acc += cp->err == IDEM_OK;
    if (cp->err == IDEM_ESTATE) {
        /* A refused group names its unfinished records (found, with their state): the
         * first of them; a single key refused by the engine comes without its state. */
        if (!sl->refused) sl->refused = sl->keys_done;
        if (cp->found && !sl->refused_state) {
            sl->refused = sl->keys_done;
            sl->refused_state = cp->record.state;
        }
    }
    if (cp->err != IDEM_OK && cp->err != IDEM_ENOTFOUND && !sl->err) sl->err = cp->err;
    if (sl->remaining > 0) return;
    srv_log("info", "operator_result", "id=%llu req=%u cmd=DEL deleted=%lld err=\"%s\"",
            (unsigned long long)c->id, (uint32_t)cp->user_data, (long long)sl->acc,
            sl->err ? idem_strerror(sl->err) : "");
}

/* The length of the result sl's reply carries (0: none). */
static uint32_t reply_result_len(const srv_slot *sl, const idem_completion *cp)
{
    switch (sl->kind) {
    case RK_CLAIM:
        return cp->outcome == IDEM_DONE && cp->data ? cp->data_len : 0;
    case RK_SET_GET:
        return cp->outcome != IDEM_NEW && cp->data ? cp->data_len : 0;
    case RK_RECORD:
    case RK_GET:
        return cp->found && cp->record.result ? cp->record.result_len : 0;
    default:
        return 0;
    }
}

/* The result limit is idemd's, not the store's: a result stored under a larger --result-max
 * can make a reply larger than --client-output-max lets a client hold, and such a reply closed
 * the connection at each read of the record, its worker retrying for ever. It is refused by
 * name instead: room is what the reply holds past its result (SRV_RECORD_REPLY_ROOM for a
 * record's fields, less for a bare result). */
int cmd_reply_fits(resp_buf *b, uint32_t result_len, uint32_t room, uint64_t output_max)
{
    uint64_t need = (uint64_t)result_len + room;
    if (need <= output_max) return 1;
    resp_errorf(b,
                "ERR the record's result is %u bytes, stored under a larger --result-max: its "
                "reply needs --client-output-max %llu or more (it is %llu)",
                result_len, (unsigned long long)need, (unsigned long long)output_max);
    return 0;
}

int cmd_complete(srv *s, srv_slot *sl, resp_buf *b, const idem_completion *cp)
{
    if (sl->kind == RK_COUNT) {
        if (cp->err != IDEM_OK)
            cmd_reply_err(b, cp->err);
        else
            resp_integer(b, sl->acc);
        return 1;
    }
    if (sl->kind == RK_EXISTS) {
        /* A key whose lookup failed is not counted absent: the reply is the error, as GET's. */
        sl->acc += cp->err == IDEM_OK && cp->found;
        if (cp->err != IDEM_OK && !sl->err) sl->err = cp->err;
        if (sl->remaining > 0) return 0;
        if (sl->err)
            cmd_reply_err(b, sl->err);
        else
            resp_integer(b, sl->acc);
        return 1;
    }
    if (sl->kind == RK_DEL) {
        if (sl->remaining > 0) return 0;
        if (sl->err == IDEM_ESTATE) {
            char line[160];
            snprintf(line, sizeof line,
                     "ERR DEL refused: key %u is %s; nothing was deleted (an admin decides with "
                     "IDEM.RESOLVE)",
                     sl->refused,
                     sl->refused_state ? idem_state_name(sl->refused_state)
                                       : "unfinished (in_flight or review)");
            resp_error(b, line);
        } else if (sl->err)
            cmd_reply_err(b, sl->err);
        else
            resp_integer(b, sl->acc);
        return 1;
    }
    if (cp->err == IDEM_ESTATE && sl->kind == RK_RESOLVE) {
        /* The engine's one state error; for a resolve it is the other way round. */
        resp_error(b, "ERR the record is committed: it has its outcome (IDEM.RESOLVE decides "
                      "in_flight and review records)");
        return 1;
    }
    if (cp->err != IDEM_OK) {
        cmd_reply_err(b, cp->err);
        return 1;
    }
    uint32_t result_len = reply_result_len(sl, cp);
    if (!cmd_reply_fits(b, result_len, sl->kind == RK_RECORD ? SRV_RECORD_REPLY_ROOM : 64,
                        s->cfg.client_output_max)) {
        srv_log_gated(&s->log_protocol, "warn", "reply_over_output_limit",
                      "result_len=%u client_output_max=%llu", result_len,
                      (unsigned long long)s->cfg.client_output_max);
        return 1;
    }
    /* Served: later replies are reserved at it (a refused one would raise them past what any
     * client may hold, for every client) */
    if (result_len > s->result_seen_max) s->result_seen_max = result_len;
    switch (sl->kind) {
    case RK_CLAIM:
        reply_claim(b, cp);
        break;
    case RK_OWNER:
    case RK_RESOLVE:
        resp_simple(b, "OK");
        break;
    case RK_RECORD:
        if (cp->found)
            cmd_reply_record(b, &cp->record);
        else
            resp_nil(b);
        break;
    case RK_GET:
        if (cp->found && cp->record.state == IDEM_STATE_COMMITTED)
            resp_bulk(b, cp->record.result, cp->record.result ? cp->record.result_len : 0);
        else
            resp_nil(b);
        break;
    case RK_PTTL:
    case RK_TTL:
        reply_ttl(s, b, cp, sl->kind == RK_TTL);
        break;
    case RK_SET:
    case RK_SET_GET:
        reply_set(b, cp, sl->kind == RK_SET_GET);
        break;
    default:
        resp_error(b, "ERR internal: unknown reply kind");
    }
    return 1;
}
