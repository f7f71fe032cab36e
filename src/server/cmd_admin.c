/*
 * cmd_admin.c: operator and introspection commands: IDEM.STATS, IDEM.SCAN, IDEM.AUDIT,
 * IDEM.ATTENTION, IDEM.BACKUP, DEL, DBSIZE, INFO, CONFIG GET, COMMAND, DEBUG CLOCK.
 *
 * Scans, the attention list and the audit trail are reads made by the reads' queries thread
 * (reads.c), after the pending batch is submitted so that they see every earlier request;
 * srv_read_run makes one and writes its reply. IDEM.STATS and INFO's idem section read the
 * store's figures the same way, on the stats thread, and cmd_stats_reply writes the reply.
 * DEL of several keys goes to the engine as one group of deletes, which deletes none if any is
 * unfinished.
 */
#include "cmd.h"
#include "util.h"

#include <fnmatch.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

int cmd_stats_list(const srv *s, const idem_stats *engine, cmd_stat *out)
{
    const idem_stats *st = engine;
    int n = 0;
#define STAT(name_, v_)                                                                            \
    do {                                                                                           \
        if (n < CMD_STATS_MAX) {                                                                   \
            out[n].name = name_;                                                                   \
            out[n].value = (int64_t)(v_);                                                          \
            n++;                                                                                   \
        }                                                                                          \
    } while (0)
    STAT("keys", st->keys);
    STAT("keys_in_flight", st->keys_in_flight);
    STAT("keys_committed", st->keys_committed);
    STAT("keys_review", st->keys_review);
    STAT("claims_new", st->claims_new);
    STAT("claims_busy", st->claims_busy);
    STAT("claims_done", st->claims_done);
    STAT("claims_mismatch", st->claims_mismatch);
    STAT("claims_recover", st->claims_recover);
    STAT("claims_review", st->claims_review);
    STAT("mismatches", st->mismatches);
    STAT("recoveries", st->recoveries);
    STAT("conflicting_commits", st->conflicting_commits);
    STAT("index_refusals", st->index_refusals);
    STAT("expired_total", st->expired_total);
    STAT("oldest_in_flight_ms", st->oldest_in_flight_ms);
    STAT("oldest_review_ms", st->oldest_review_ms);
    STAT("oldest_in_flight_age_ms", st->oldest_in_flight_age_ms);
    STAT("oldest_review_age_ms", st->oldest_review_age_ms);
    STAT("wal_bytes", st->wal_bytes);
    STAT("disk_bytes", st->disk_bytes);
    STAT("disk_free_bytes", st->disk_free_bytes);
    STAT("disk_reserve_bytes", st->disk_reserve_bytes);
    STAT("disk_reserve_released", st->disk_reserve_released);
    STAT("memory_bytes", st->memory_bytes);
    STAT("index_bytes", st->index_bytes);
    STAT("max_keys", st->max_keys);
    STAT("max_memory_bytes", st->max_memory_bytes);
    STAT("max_disk_bytes", st->max_disk_bytes);
    STAT("flushes", st->flushes);
    STAT("flush_records", st->flush_records);
    STAT("flush_latency_us_sum", st->flush_latency_us_sum);
    static const char *const buckets[16] = {
        "flush_latency_us_bucket_0",  "flush_latency_us_bucket_1",  "flush_latency_us_bucket_2",
        "flush_latency_us_bucket_3",  "flush_latency_us_bucket_4",  "flush_latency_us_bucket_5",
        "flush_latency_us_bucket_6",  "flush_latency_us_bucket_7",  "flush_latency_us_bucket_8",
        "flush_latency_us_bucket_9",  "flush_latency_us_bucket_10", "flush_latency_us_bucket_11",
        "flush_latency_us_bucket_12", "flush_latency_us_bucket_13", "flush_latency_us_bucket_14",
        "flush_latency_us_bucket_15"};
    for (int i = 0; i < 16; i++) /* bucket i: flushes of at most 2^(i+4) us; the last: the rest */
        STAT(buckets[i], st->flush_latency_us_buckets[i]);
    STAT("keys_with_mismatch", st->keys_with_mismatch);
    STAT("claims_last_minute", st->claims_last_minute);
    STAT("duplicates_last_minute", st->duplicates_last_minute);
    STAT("store_generation", st->store_generation);
    STAT("clock_skew_ms", st->clock_skew_ms);
    STAT("store_clock_ms", st->store_clock_ms);
    STAT("checkpoints", st->checkpoints);
    STAT("compactions", st->compactions);
    STAT("fatal", st->fatal);
    STAT("loading", st->loading);
    STAT("connected_clients", s->nlive);
    STAT("total_connections", s->total_connections);
    STAT("total_commands", s->total_commands);
    STAT("rejected_connections", s->rejected_connections);
    STAT("clients_closed_input_stalled", s->closed_input_stalled);
    STAT("clients_closed_output_stalled", s->closed_output_stalled);
    STAT("reads_withdrawn", s->reads_withdrawn);
    STAT("claims_released_unheard", s->claims_released_unheard);
    STAT("auth_failures", s->auth_failures);
    STAT("metrics_refused", s->metrics_refused);
    STAT("io_buffer_bytes", s->io_used);
    STAT("claim_latency_us_count", s->claim_latencies);
    STAT("claim_latency_us_sum", s->claim_latency_us_sum);
    static const char *const claim_buckets[SRV_LAT_BUCKETS] = {
        "claim_latency_us_bucket_0",  "claim_latency_us_bucket_1",  "claim_latency_us_bucket_2",
        "claim_latency_us_bucket_3",  "claim_latency_us_bucket_4",  "claim_latency_us_bucket_5",
        "claim_latency_us_bucket_6",  "claim_latency_us_bucket_7",  "claim_latency_us_bucket_8",
        "claim_latency_us_bucket_9",  "claim_latency_us_bucket_10", "claim_latency_us_bucket_11",
        "claim_latency_us_bucket_12", "claim_latency_us_bucket_13", "claim_latency_us_bucket_14",
        "claim_latency_us_bucket_15"};
    for (int i = 0; i < SRV_LAT_BUCKETS; i++) /* as the flush buckets; IDEM.CLAIM, WAIT left out */
        STAT(claim_buckets[i], s->claim_latency_us_buckets[i]);
#undef STAT
    return n;
}

static void read_request(cmd_req *r, const srv_read_args *a);

/* IDEM.STATS: the store's figures are read on the stats line (reads.c), off the loop: the call
 * may filter the age heaps first (idem.h), and a scan or an audit query may be under way on
 * the queries' line. cmd_stats_reply makes the reply when they come back. */
void cmd_stats(cmd_req *r)
{
    srv_read_args a = {.kind = READ_STATS};
    read_request(r, &a);
}

static void stats_array(const srv *s, const idem_stats *engine, resp_buf *b)
{
    cmd_stat st[CMD_STATS_MAX];
    int n = cmd_stats_list(s, engine, st);
    resp_array(b, 2 * n);
    for (int i = 0; i < n; i++) {
        resp_bulk_str(b, st[i].name);
        resp_integer(b, st[i].value);
    }
}

/* The count covers every request before it (this client's pipelined writes too: the batch goes
 * first), and in sync mode it is answered once every change it counts is durable (rule 8). */
void cmd_dbsize(cmd_req *r)
{
    srv_flush_ops(r->s);
    /* The count alone: the whole stats call may filter the age heaps first, with the loop
     * waiting (idem.h). */
    uint64_t keys = idem_key_count(r->s->store);
    if (r->s->cfg.durability != IDEM_DURABILITY_SYNC) return cmd_int(r, (int64_t)keys);
    idem_op op = {.kind = IDEM_OP_SYNC};
    srv_submit_op(r->s, r->c, r->seq, RK_COUNT, &op);
    srv_slot_of(r->c, r->seq)->acc = (int64_t)keys;
}

static int state_parse(cmd_req *r, uint32_t i)
{
    if (cmd_is(r, i, "in_flight")) return IDEM_STATE_IN_FLIGHT;
    if (cmd_is(r, i, "committed")) return IDEM_STATE_COMMITTED;
    if (cmd_is(r, i, "review")) return IDEM_STATE_REVIEW;
    return 0;
}

/* The largest an audit entry's reply can be: its key, reason, actor and result at their
 * limits, the action, nine numbers and fourteen field names, with their framing. */
#define AUDIT_ENTRY_REPLY_MAX                                                                      \
    (IDEM_KEY_BYTES_MAX + IDEM_NOTE_BYTES_MAX + IDEM_ACTOR_BYTES_MAX + IDEM_AUDIT_RESULT_KEPT +    \
     1024)

/* The largest reply read a can make. */
static uint64_t read_reply_max(const srv *s, const srv_read_args *a)
{
    switch (a->kind) {
    case READ_STATS: /* IDEM.STATS or INFO: some 8 KiB of text, owed as every long reply */
        return SRV_REPLY_LONG;
    case READ_SCAN: /* the cursor, then a key per slot visited at most */
        return 64 + (uint64_t)(a->scan.count ? a->scan.count : 100) * (IDEM_KEY_BYTES_MAX + 16);
    case READ_AUDIT:
        return 64 + (uint64_t)a->count * AUDIT_ENTRY_REPLY_MAX;
    default: /* its records' bytes, the last one's whole reply past them, and their framing */
        return 64 + a->att.max_bytes + srv_record_reply_now(s) +
               (uint64_t)a->att.max * SRV_RECORD_FRAMING_MAX;
    }
}

/* Hands the read to the reads thread (reads.c). The batch goes first, so that the read sees
 * every earlier request. The reply is owed at its largest, or at the room memory pressure leaves,
 * which then bounds it (a larger one is refused by name). A read waits until the replies before
 * it, left unread, leave it that room within --client-output-max: appended to them, its reply
 * closed the connection. */
static void read_request(cmd_req *r, const srv_read_args *a)
{
    if (r->c->hung_up) { /* no one reads the reply */
        r->s->reads_withdrawn++;
        return cmd_fail(r, "ERR the client left");
    }
    srv_flush_ops(r->s);
    uint64_t most = read_reply_max(r->s, a);
    if (srv_reads_submit(r->s, r->c, r->seq, a, most) < 0) {
        srv_log_gated(&r->s->log_oom, "warn", "out_of_memory", "what=read id=%llu peer=%s",
                      (unsigned long long)r->c->id, r->c->peer);
        cmd_fail(r, "ERR out of memory for the read: try again");
    }
}

/* IDEM.SCAN cursor [STATE s] [OLDER ms] [COUNT n] */
void cmd_scan(cmd_req *r)
{
    srv_read_args a = {.kind = READ_SCAN};
    uint64_t v;
    if (cmd_u64(r->argv[1], r->argl[1], &a.scan.cursor) < 0)
        return cmd_fail(r, "ERR invalid cursor");
    static const char *const opts[] = {"STATE", "OLDER", "COUNT"};
    unsigned seen = 0;
    for (uint32_t i = 2; i < r->argc; i += 2) {
        int k = cmd_option(r, i, opts, IDEM_ARRAY_LEN(opts), &seen, "STATE, OLDER, COUNT");
        if (k < 0) return;
        if (k == 0 && (a.scan.state = state_parse(r, i + 1)) != 0) continue;
        if (k == 1 && cmd_u64(r->argv[i + 1], r->argl[i + 1], &v) == 0 && v <= INT64_MAX) {
            a.scan.older_ms = (int64_t)v;
            continue;
        }
        if (k == 2 && cmd_u64(r->argv[i + 1], r->argl[i + 1], &v) == 0 && v > 0 && v <= 100000) {
            a.scan.count = (uint32_t)v;
            continue;
        }
        return cmd_fail(r, "ERR syntax error (STATE in_flight|committed|review, OLDER ms, "
                           "COUNT 1..100000)");
    }
    read_request(r, &a);
}

static void scan_reply(idem_queue *q, const idem_scan_args *a, resp_buf *b)
{
    uint64_t next = 0;
    const void **keys = NULL;
    const uint32_t *lens = NULL;
    size_t n = 0;
    int err = idem_scan(q, a, &next, &keys, &lens, &n);
    if (err != IDEM_OK) return cmd_reply_err(b, err);
    resp_array(b, 2);
    resp_bulk_u64(b, next);
    resp_array(b, (int64_t)n);
    for (size_t i = 0; i < n; i++)
        resp_bulk(b, keys[i], lens[i]);
}

static void audit_entry(resp_buf *b, const idem_audit_entry *e)
{
    int result = (e->flags & IDEM_AUDIT_RESULT) != 0;
    resp_array(b, result ? 28 : 24);
    resp_bulk_str(b, "seq");
    resp_bulk_u64(b, e->seq);
    resp_bulk_str(b, "at_ms");
    resp_bulk_i64(b, e->at_ms);
    resp_bulk_str(b, "actor");
    resp_bulk_str(b, e->actor ? e->actor : "");
    resp_bulk_str(b, "action");
    resp_bulk_str(b, e->action ? e->action : "");
    resp_bulk_str(b, "key");
    resp_bulk(b, e->key ? e->key : "", e->key ? e->key_len : 0);
    resp_bulk_str(b, "reason");
    resp_bulk_str(b, e->reason ? e->reason : "");
    resp_bulk_str(b, "state_before");
    resp_bulk_str(b, e->state_before ? idem_state_name(e->state_before) : "absent");
    resp_bulk_str(b, "state_after");
    resp_bulk_str(b, e->state_after ? idem_state_name(e->state_after) : "absent");
    resp_bulk_str(b, "version_before");
    resp_bulk_u64(b, e->version_before);
    resp_bulk_str(b, "version_after");
    resp_bulk_u64(b, e->version_after);
    resp_bulk_str(b, "forced");
    resp_bulk_u64(b, (e->flags & IDEM_AUDIT_FORCED) != 0);
    resp_bulk_str(b, "lease_lapsed");
    resp_bulk_u64(b, (e->flags & IDEM_AUDIT_LEASE_LAPSED) != 0);
    if (result) { /* the result a resolve commit recorded, or a DEL erased: its first bytes */
        resp_bulk_str(b, "result");
        resp_bulk(b, e->result_len ? e->result : "", e->result_len);
        resp_bulk_str(b, "result_len");
        resp_bulk_u64(b, e->result_full_len);
    }
}

/* IDEM.AUDIT [KEY key] [COUNT n] [BEFORE seq]: BEFORE pages back through the whole trail (the
 * last entry's seq of one page gives the next). */
void cmd_audit(cmd_req *r)
{
    srv_read_args a = {.kind = READ_AUDIT};
    uint64_t count = 10;
    static const char *const opts[] = {"KEY", "COUNT", "BEFORE"};
    unsigned seen = 0;
    for (uint32_t i = 1; i < r->argc; i += 2) {
        int k = cmd_option(r, i, opts, IDEM_ARRAY_LEN(opts), &seen, "KEY, COUNT, BEFORE");
        if (k < 0) return;
        if (k == 0) {
            if (cmd_key_ok(r, i + 1) < 0) return;
            memcpy(a.key, r->argv[i + 1], r->argl[i + 1]);
            a.key_len = r->argl[i + 1];
        } else if (k == 1 && cmd_u64(r->argv[i + 1], r->argl[i + 1], &count) == 0 && count > 0 &&
                   count <= 10000) {
        } else if (k == 2 && cmd_u64(r->argv[i + 1], r->argl[i + 1], &a.before_seq) == 0 &&
                   a.before_seq > 0) {
        } else {
            return cmd_fail(r, "ERR syntax error (KEY key, COUNT 1..10000, BEFORE seq)");
        }
    }
    a.count = (uint32_t)count;
    read_request(r, &a);
}

static void audit_reply(idem_queue *q, const srv_read_args *a, resp_buf *b)
{
    const idem_audit_entry *e = NULL;
    size_t n = 0;
    int err =
        idem_audit_page(q, a->key_len ? a->key : NULL, a->key_len, a->before_seq, a->count, &e, &n);
    if (err != IDEM_OK) return cmd_reply_err(b, err);
    resp_array(b, (int64_t)n);
    for (size_t i = 0; i < n; i++)
        audit_entry(b, &e[i]);
}

/* IDEM.ATTENTION [OLDER ms] [COUNT n] [WITHCUT]: the records that need a person or a reconciler
 * (review, in_flight past its lease or older than ms, recorded mismatches), each as IDEM.GET's
 * array, at most n, cut to fit the room its reply has (below). With WITHCUT the reply is
 * [cut, [records]], cut 1 when that room cut the list: more may need attention. Costs no scan
 * of all keys. */
void cmd_attention(cmd_req *r)
{
    uint64_t older = 0, count = 1000;
    static const char *const opts[] = {"OLDER", "COUNT"};
    unsigned seen = 0;
    int with_cut = 0;
    for (uint32_t i = 1; i < r->argc;) {
        if (cmd_is(r, i, "WITHCUT")) { /* a flag: no value follows */
            if (with_cut) return cmd_fail(r, "ERR syntax error: WITHCUT given twice");
            with_cut = 1;
            i += 1;
            continue;
        }
        int k = cmd_option(r, i, opts, IDEM_ARRAY_LEN(opts), &seen, "OLDER, COUNT, WITHCUT");
        if (k < 0) return;
        const uint8_t *v = r->argv[i + 1];
        uint32_t vl = r->argl[i + 1];
        i += 2;
        if (k == 0 && cmd_u64(v, vl, &older) == 0 && older <= IDEM_TTL_MS_MAX) {
        } else if (k == 1 && cmd_u64(v, vl, &count) == 0 && count > 0 && count <= 100000) {
        } else {
            return cmd_fail(r, "ERR syntax error (OLDER ms of at most %llu, COUNT 1..100000)",
                            (unsigned long long)IDEM_TTL_MS_MAX);
        }
    }
    /* The list is cut to fit the room its reply has (--client-output-max, or less under
     * memory pressure: srv_reply_room, srv_reads_room), not refused after all was copied.
     * Past one record's largest reply and the array's header, half the room goes to the
     * records' bytes (the last one listed may pass it by a largest reply) and half to their
     * framing. */
    uint64_t avail = srv_reply_room(r->s, srv_reads_room(r->s)),
             rec = srv_record_reply_now(r->s) + 64;
    uint64_t room = avail > rec ? (avail - rec) / 2 : 0;
    const uint64_t asked = count;
    if (count > room / SRV_RECORD_FRAMING_MAX) count = room / SRV_RECORD_FRAMING_MAX;
    srv_read_args a = {.kind = READ_ATTENTION,
                       .att = {.older_ms = (int64_t)older,
                               .max = count ? (uint32_t)count : 1,
                               .max_bytes = room ? room : 1},
                       .output_max = r->s->cfg.client_output_max,
                       .with_cut = (uint8_t)with_cut,
                       .count_lowered = count < asked};
    read_request(r, &a);
}

/* A record listed with a result stored under a larger --result-max than its reply may hold is
 * refused by name (cmd_reply_fits), as its IDEM.GET is: a lower COUNT would not help. */
static void attention_reply(idem_queue *q, const srv_read_args *a, resp_buf *b)
{
    const idem_record *recs = NULL;
    size_t n = 0;
    int err = idem_attention(q, &a->att, &recs, &n);
    if (err != IDEM_OK) return cmd_reply_err(b, err);
    for (size_t i = 0; i < n; i++)
        if (recs[i].result &&
            !cmd_reply_fits(b, recs[i].result_len, SRV_RECORD_REPLY_ROOM + 64, a->output_max))
            return;
    if (a->with_cut) {
        /* Cut for the room: the records allowed by it, or the bytes (the engine's measure)
         * that ended the list. A list cut to COUNT is not: the caller knows its COUNT. */
        uint64_t bytes = 0;
        for (size_t i = 0; i < n; i++)
            bytes += (uint64_t)recs[i].key_len + recs[i].owner_len + recs[i].note_len +
                     recs[i].result_len;
        resp_array(b, 2);
        resp_integer(b, (a->count_lowered && n >= a->att.max) || bytes >= a->att.max_bytes);
    }
    resp_array(b, (int64_t)n);
    for (size_t i = 0; i < n; i++)
        cmd_reply_record(b, &recs[i]);
}

void srv_read_run(idem_queue *q, const srv_read_args *a, resp_buf *b)
{
    switch (a->kind) {
    case READ_SCAN:
        scan_reply(q, &a->scan, b);
        break;
    case READ_AUDIT:
        audit_reply(q, a, b);
        break;
    default:
        attention_reply(q, a, b);
    }
    idem_queue_trim(q); /* the reply holds it all now; a large read's results are not kept */
}

/* IDEM.BACKUP dest: a consistent point-in-time copy of the live store into the new directory
 * dest (a path on idemd's host). Admin only. The copy runs on a thread of its own (backup.c):
 * the store holds changes back for one flush, the loop goes on serving, and the reply comes
 * when the copy is durable. */
void cmd_backup(cmd_req *r)
{
    char dest[4096], err[600];
    if (r->argl[1] == 0 || r->argl[1] >= sizeof dest || memchr(r->argv[1], 0, r->argl[1]))
        return cmd_fail(r, "ERR backup destination must be a path of 1..4095 bytes");
    if (r->argv[1][0] != '/') /* relative to idemd's working directory, not the client's */
        return cmd_fail(r, "ERR backup destination must be an absolute path (on idemd's host)");
    for (uint32_t i = 0; i < r->argl[1]; i++) { /* the path goes into log lines and replies */
        uint8_t ch = r->argv[1][i];
        if (ch < 0x20 || ch == 0x7f || ch == '"' || ch == '\\')
            return cmd_fail(r, "ERR backup destination holds a control character, a quote or a "
                               "backslash (idemd logs it)");
    }
    memcpy(dest, r->argv[1], r->argl[1]);
    dest[r->argl[1]] = 0;
    srv_flush_ops(r->s); /* the copy holds every request before this one */
    srv_log("info", "backup", "dest=\"%s\" id=%llu", dest, (unsigned long long)r->c->id);
    if (srv_backup_start(r->s, r->c, r->seq, dest, err, sizeof err) < 0)
        return cmd_fail(r, "%s", err);
}

/* DEL key [key ...]: none is deleted if any is in_flight or review. The engine decides that
 * with the deletes, as one group (IDEM_F_WITH_NEXT) that goes into a single idem_submit whole
 * (the parse loop submits the batch before a request whose arguments might not fit in it, and
 * keeps engine room for them): the loop never waits for a lookup. One key needs no group: the
 * engine refuses an unfinished record itself. The engine writes the deletes' audit entries
 * together, and the reply waits for the flush that makes them durable. */
void cmd_del(cmd_req *r)
{
    for (uint32_t i = 1; i < r->argc; i++)
        if (cmd_key_ok(r, i) < 0) return;
    char key[80];
    util_printable(key, sizeof key, r->argv[1], r->argl[1]);
    cmd_log_operator(r, "cmd=DEL keys=%u key=\"%s\" key_len=%u", r->argc - 1, key, r->argl[1]);
    for (uint32_t i = 1; i < r->argc; i++) {
        idem_op op = {.kind = IDEM_OP_DEL,
                      .flags = i < r->argc - 1 ? IDEM_F_WITH_NEXT : 0,
                      .key = r->argv[i],
                      .key_len = r->argl[i],
                      .actor = cmd_actor(r->c)};
        srv_submit_op(r->s, r->c, r->seq, RK_DEL, &op);
    }
}

/* ---- INFO ---- */

enum { INFO_SERVER = 1, INFO_CLIENTS = 2, INFO_PERSISTENCE = 4, INFO_IDEM = 8, INFO_ALL = 15 };

/* INFO's text; engine (the store's figures) only with the idem section, when not loading. */
static void info_text(const srv *s, resp_buf *t, int sections, const idem_stats *engine)
{
    int64_t up = (srv_now_ms() - s->started_ms) / 1000;
    if (sections & INFO_SERVER) {
        resp_buf_printf(
            t, "# Server\r\nidem_version:%s\r\nredis_version:7.0.0\r\nredis_mode:standalone\r\n",
            IDEM_VERSION_STRING);
        resp_buf_printf(t, "process_id:%d\r\ntcp_port:%d\r\nuptime_in_seconds:%lld\r\n",
                        (int)getpid(), s->cfg.port, (long long)up);
        resp_buf_printf(t, "io_backend:%s\r\n\r\n",
                        s->store && !s->loading ? idem_io_backend_name(s->store) : "unknown");
    }
    if (sections & INFO_CLIENTS)
        resp_buf_printf(t, "# Clients\r\nconnected_clients:%u\r\nmaxclients:%u\r\n\r\n", s->nlive,
                        s->cfg.max_clients);
    if (sections & INFO_PERSISTENCE) {
        resp_buf_printf(t, "# Persistence\r\nloading:%d\r\ndurability:%s\r\n\r\n",
                        s->loading ? 1 : 0, srv_durability_name(s->cfg.durability));
    }
    if (engine) {
        cmd_stat st[CMD_STATS_MAX];
        int n = cmd_stats_list(s, engine, st);
        resp_buf_printf(t, "# Idem\r\n");
        for (int i = 0; i < n; i++)
            resp_buf_printf(t, "%s:%lld\r\n", st[i].name, (long long)st[i].value);
    }
}

static void info_reply(srv *s, int sections, const idem_stats *engine, resp_buf *b)
{
    resp_buf t;
    resp_buf_init(&t, 1 << 20);
    info_text(s, &t, sections, engine);
    if (t.overflow) { /* no memory for the text (it is far below its limit): not a part of it */
        resp_buf_free(&t);
        srv_log_gated(&s->log_oom, "warn", "out_of_memory", "what=info");
        resp_error(b, "ERR out of memory for the INFO reply: try again");
        return;
    }
    resp_bulk(b, t.data ? (const void *)t.data : "", t.len);
    resp_buf_free(&t);
}

/* INFO [section ...]: every section named (as Redis 7), all of them without a name; a name it
 * does not know adds nothing. */
void cmd_info(cmd_req *r)
{
    static const struct {
        const char *name;
        int sections;
    } names[] = {
        {"server", INFO_SERVER}, {"clients", INFO_CLIENTS}, {"persistence", INFO_PERSISTENCE},
        {"idem", INFO_IDEM},     {"all", INFO_ALL},         {"everything", INFO_ALL},
        {"default", INFO_ALL}};
    int sections = r->argc > 1 ? 0 : INFO_ALL;
    for (uint32_t i = 1; i < r->argc; i++)
        for (size_t k = 0; k < sizeof names / sizeof names[0]; k++)
            if (cmd_is(r, i, names[k].name)) sections |= names[k].sections;
    if ((sections & INFO_IDEM) && !r->s->loading) { /* the figures first, as IDEM.STATS */
        srv_read_args a = {.kind = READ_STATS, .info_sections = sections};
        return read_request(r, &a);
    }
    info_reply(r->s, sections, NULL, cmd_out(r));
    cmd_done(r);
}

void cmd_stats_reply(srv *s, const srv_read_args *a, const idem_stats *engine, resp_buf *b)
{
    if (a->info_sections)
        info_reply(s, a->info_sections, engine, b);
    else
        stats_array(s, engine, b);
}

/* ---- CONFIG GET ---- */

void cmd_config(cmd_req *r)
{
    const srv_config *c = &r->s->cfg;
    char pattern[128], v[11][1040];
    if (!cmd_is(r, 1, "GET") || r->argc < 3)
        return cmd_fail(r, "ERR only CONFIG GET pattern [pattern ...] is supported; settings are "
                           "flags of idemd (restart to change them)");
    for (uint32_t i = 2; i < r->argc; i++)
        if (r->argl[i] >= sizeof pattern || memchr(r->argv[i], 0, r->argl[i]))
            return cmd_fail(r, "ERR CONFIG GET pattern must be 0..%zu bytes without a NUL byte",
                            sizeof pattern - 1);
    const char *names[] = {"dir",        "port",       "bind",           "maxclients",
                           "timeout",    "save",       "appendonly",     "databases",
                           "durability", "unixsocket", "on-lease-expiry"};
    snprintf(v[0], sizeof v[0], "%s", c->dir);
    snprintf(v[1], sizeof v[1], "%d", c->port);
    snprintf(v[2], sizeof v[2], "%s", c->bind_addr);
    snprintf(v[3], sizeof v[3], "%u", c->max_clients);
    /* Redis's timeout is in seconds, 0 for never: a timeout under a second is not never. */
    snprintf(v[4], sizeof v[4], "%llu", (unsigned long long)((c->idle_timeout_ms + 999) / 1000));
    snprintf(v[5], sizeof v[5], "%s", "");
    snprintf(v[6], sizeof v[6], "%s", "yes");
    snprintf(v[7], sizeof v[7], "%s", "1");
    snprintf(v[8], sizeof v[8], "%s", srv_durability_name(c->durability));
    snprintf(v[9], sizeof v[9], "%s", c->socket_path);
    snprintf(v[10], sizeof v[10], "%s", srv_lease_policy_name(c->lease_policy));
    /* Several patterns, as Redis 7 takes: each setting once, whichever patterns match it. */
    size_t n = sizeof names / sizeof names[0];
    int hit[sizeof names / sizeof names[0]] = {0}, matched = 0;
    for (uint32_t k = 2; k < r->argc; k++) {
        memcpy(pattern, r->argv[k], r->argl[k]);
        pattern[r->argl[k]] = '\0';
        for (size_t i = 0; i < n; i++)
            hit[i] |= fnmatch(pattern, names[i], FNM_CASEFOLD) == 0;
    }
    for (size_t i = 0; i < n; i++)
        matched += hit[i];
    resp_buf *b = cmd_out(r);
    resp_array(b, 2 * matched);
    for (size_t i = 0; i < n; i++) {
        if (hit[i]) {
            resp_bulk_str(b, names[i]);
            resp_bulk_str(b, v[i]);
        }
    }
    cmd_done(r);
}

/* ---- COMMAND ---- */

void cmd_name_lower(const char *name, char *out, size_t size)
{
    size_t k = 0;
    for (; name[k] && k + 1 < size; k++)
        out[k] = (char)(name[k] >= 'A' && name[k] <= 'Z' ? name[k] + 32 : name[k]);
    out[k] = '\0';
}

static void command_entry(resp_buf *b, const cmd_def *d)
{
    char lower[32];
    cmd_name_lower(d->name, lower, sizeof lower);
    const struct doc_arg *first = d->args;
    int keyed =
        first && strcmp(first->type, "key") == 0 && !first->token && !(first->flags & DOC_OPTIONAL);
    int multi = keyed && (first->flags & DOC_MULTIPLE);
    resp_array(b, 6);
    resp_bulk_str(b, lower);
    resp_integer(b, d->arity);
    resp_array(b, 1);
    resp_simple(b, d->flags & CMD_F_WRITE ? "write" : "readonly");
    resp_integer(b, keyed ? 1 : 0);
    resp_integer(b, keyed ? (multi ? -1 : 1) : 0);
    resp_integer(b, keyed ? 1 : 0);
}

void cmd_command(cmd_req *r)
{
    resp_buf *b = cmd_out(r);
    /* COMMAND, and COMMAND INFO without names (Redis 7 answers it so): every command. */
    if (r->argc == 1 || (r->argc == 2 && cmd_is(r, 1, "INFO"))) {
        resp_array(b, (int64_t)cmd_table_len);
        for (size_t i = 0; i < cmd_table_len; i++)
            command_entry(b, &cmd_table[i]);
    } else if (cmd_is(r, 1, "COUNT")) {
        if (r->argc == 2)
            resp_integer(b, (int64_t)cmd_table_len);
        else
            resp_error(b, "ERR wrong number of arguments for 'command|count' command");
    } else if (cmd_is(r, 1, "DOCS")) {
        cmd_docs_reply(b, r);
    } else if (cmd_is(r, 1, "INFO")) {
        resp_array(b, r->argc - 2);
        for (uint32_t i = 2; i < r->argc; i++) {
            const cmd_def *d = cmd_find(r->argv[i], r->argl[i]);
            if (d)
                command_entry(b, d);
            else
                resp_array(b, -1);
        }
    } else {
        resp_error(b, "ERR unknown COMMAND subcommand (COUNT, DOCS, INFO)");
    }
    cmd_done(r);
}

/* ---- DEBUG CLOCK GET | SET ms | ADVANCE ms ---- */

_Static_assert(SRV_TEST_CLOCK_MS_MAX <=
                   INT64_MAX - 2 * (int64_t)IDEM_TTL_MS_MAX - 2 * (int64_t)IDEM_LEASE_MS_MAX,
               "a clock at the bound plus ttls and leases must not overflow");

void cmd_debug(cmd_req *r)
{
    srv *s = r->s;
    int64_t v = 0;
    if (!cmd_is(r, 1, "CLOCK") || r->argc < 3)
        return cmd_fail(r, "ERR only DEBUG CLOCK GET|SET ms|ADVANCE ms is supported");
    if (!s->cfg.test_clock)
        return cmd_fail(r, "ERR DEBUG CLOCK needs idemd started with --test-clock");
    srv_flush_ops(s);
    if (cmd_is(r, 2, "GET") && r->argc == 3) return cmd_int(r, idem_clock_now(s->store));
    if (r->argc != 4 || cmd_i64(r->argv[3], r->argl[3], &v) < 0)
        return cmd_fail(r, "ERR DEBUG CLOCK SET|ADVANCE takes an integer of ms");
    int err;
    int64_t now = idem_clock_now(s->store);
    int set = cmd_is(r, 2, "SET");
    if (!set && !cmd_is(r, 2, "ADVANCE"))
        return cmd_fail(r, "ERR DEBUG CLOCK GET|SET ms|ADVANCE ms");
    /* The store's times are signed 64-bit ms: past the bound, now + a ttl could overflow. */
    if ((set && v > SRV_TEST_CLOCK_MS_MAX) || (!set && v > SRV_TEST_CLOCK_MS_MAX - now))
        return cmd_fail(r,
                        "ERR DEBUG CLOCK: the test clock may not pass %lld ms (so that the "
                        "clock plus the largest ttl and lease cannot overflow)",
                        (long long)SRV_TEST_CLOCK_MS_MAX);
    if (set)
        err = idem_clock_set(s->store, v);
    else
        err = v < 0 ? IDEM_EINVAL : idem_clock_advance(s->store, v);
    if (err == IDEM_EINVAL) return cmd_fail(r, "ERR the test clock only moves forward");
    if (err != IDEM_OK) {
        cmd_reply_err(cmd_out(r), err);
        return cmd_done(r);
    }
    cmd_int(r, idem_clock_now(s->store));
}
