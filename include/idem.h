/*
 * idem.h: the public interface of the idem store, an embedded, durable idempotency key store.
 *
 * A store is a directory owned by one process. Callers reserve a business key before a side
 * effect (idem_claim), record the outcome (idem_commit), and every later copy of the request is
 * answered from that record. docs/design.md describes the engine; docs/api.md walks through use.
 *
 * Handles:
 *   idem_store  one open store. Thread-safe: any number of threads may use it at once.
 *   idem_queue  one caller's channel into the store: the blocking calls and the asynchronous
 *               form (idem_submit / idem_poll) both go through a queue. A queue is used by one
 *               thread at a time; open one per thread. Bytes a queue returns (results, notes,
 *               keys, records) stay valid until the next call on that queue.
 *
 * Durability: with IDEM_DURABILITY_SYNC (the default) no call returns, and no completion is
 * delivered, before the change it reports, and every state its answer depends on, is on stable
 * storage. Concurrent callers share group commits.
 *
 * Errors are negative `enum idem_err` values; claim outcomes are results, not errors.
 * Times are store-clock milliseconds since the Unix epoch unless a name says otherwise.
 */
#ifndef IDEM_H
#define IDEM_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define IDEM_VERSION_STRING "0.1.0"

/* Limits. Arguments outside them answer IDEM_EINVAL. */
#define IDEM_KEY_BYTES_MAX        512u
#define IDEM_OWNER_BYTES_MAX      256u
#define IDEM_NOTE_BYTES_MAX       4096u
#define IDEM_ACTOR_BYTES_MAX      256u
#define IDEM_ACTION_BYTES_MAX     255u
#define IDEM_RESULT_BYTES_DEFAULT (64u * 1024u)
#define IDEM_RESULT_BYTES_LIMIT   (1024u * 1024u)
#define IDEM_TTL_MS_MAX           (3650ull * 24 * 3600 * 1000) /* ten years */
#define IDEM_LEASE_MS_MAX         (7ull * 24 * 3600 * 1000)    /* one week */
#define IDEM_WAIT_MS_MAX          60000u
#define IDEM_FP_BYTES             16u   /* XXH3-128 digest of the content passed */
#define IDEM_BATCH_MAX            4096u /* operations accepted by one idem_submit */
#define IDEM_DEL_GROUP_MAX        64u   /* deletes in one group (IDEM_F_WITH_NEXT) */
#define IDEM_TOKEN_MAX            ((int64_t)1 << 62)

typedef struct idem_store idem_store;
typedef struct idem_queue idem_queue;

enum idem_err {
    IDEM_OK = 0,
    IDEM_EINVAL = -1,     /* bad argument or unknown flag bit */
    IDEM_ENOMEM = -2,     /* allocation failed (memory, or file descriptors) */
    IDEM_EIO = -3,        /* an I/O call failed outside the write path (open, read, create) */
    IDEM_EFATAL = -4,     /* a write or flush failed: the store acknowledges nothing more */
    IDEM_EFULL = -5,      /* a capacity limit or a full disk: nothing was changed or evicted */
    IDEM_ECORRUPT = -6,   /* a checksum or invariant failed on a file of the store; any call that
                             reads a record answers this when the record fails its checksum; an
                             open answers it for a store an import was cut short in (it holds
                             IDEM_IMPORT_MARKER: see idem_import_mark) */
    IDEM_EVERSION = -7,   /* the store's format version or features are unknown to this build */
    IDEM_ELOCKED = -8,    /* another process owns the directory (see idem_last_error) */
    IDEM_ENOTFOUND = -9,  /* owner or operator call on an absent key */
    IDEM_ESTALE = -10,    /* the token is not the current owner's */
    IDEM_ECONFLICT = -11, /* commit repeated with a different result (counted) */
    IDEM_ECHANGED = -12,  /* resolve: the record's version is not the expected one */
    IDEM_ESTATE = -13,    /* the record's state forbids the call (e.g. DEL of an in_flight) */
    IDEM_ELEASE = -14,    /* resolve of an in_flight record whose lease runs, without FORCE */
    IDEM_EREADONLY = -15, /* the store was opened read-only */
    IDEM_ECLOSED = -16,   /* the store is closing: waiting claims answer busy, new calls this */
    IDEM_EBUSY = -17,     /* the queue is full, or holds completions a blocking call would mix */
    IDEM_ENOTSUP = -18,   /* not available in this configuration (e.g. clock control) */
};

/* A static, human-readable description of an idem_err value. Never NULL. */
const char *idem_strerror(int err);

/* Claim outcomes (contract: "Claim outcomes"). */
enum idem_outcome {
    IDEM_NEW = 1,      /* key absent or expired: you own it; act, then commit */
    IDEM_BUSY = 2,     /* another owner's lease runs: lease_left_ms */
    IDEM_DONE = 3,     /* committed with the same content: data holds the result */
    IDEM_MISMATCH = 4, /* different content: recorded, route to a person */
    IDEM_RECOVER = 5,  /* the earlier owner's lease ran out: look the target up, then finish */
    IDEM_REVIEW = 6,   /* held for a person: data holds the note */
};

enum idem_state {
    IDEM_STATE_IN_FLIGHT = 1,
    IDEM_STATE_COMMITTED = 2,
    IDEM_STATE_REVIEW = 3,
};

enum idem_durability {
    IDEM_DURABILITY_SYNC = 0,  /* reply after the flush that covers it (group commit) */
    IDEM_DURABILITY_BATCH = 1, /* reply at once; flush at least every 10 ms */
    IDEM_DURABILITY_NONE = 2,  /* reply at once; flushing is left to the OS */
};

enum idem_lease_policy {
    IDEM_LEASE_RECOVER = 0, /* an expired lease becomes `recover` for the next claimant */
    IDEM_LEASE_REVIEW = 1,  /* an expired lease becomes `review` */
};

enum idem_io_backend {
    IDEM_IO_AUTO = 0,   /* io_uring where the kernel allows it, else the thread backend */
    IDEM_IO_URING = 1,  /* io_uring: large writes on the ring, then one fdatasync once all of a
                         * batch's have completed (small ones written directly) */
    IDEM_IO_THREAD = 2, /* pwrite + fdatasync on the store's flusher thread */
};

/* Optional clock sources. Tests inject them; NULL members mean the system's clocks. They are
 * called from the store's threads and the callers', several at once: they must be thread-safe. */
typedef struct idem_clock_source {
    int64_t (*wall_ms)(void *ctx);      /* CLOCK_REALTIME in ms since the epoch */
    int64_t (*monotonic_ms)(void *ctx); /* CLOCK_BOOTTIME in ms: elapsed time, never steps */
    void *ctx;
} idem_clock_source;

typedef struct idem_options {
    int durability;            /* enum idem_durability */
    int lease_policy;          /* enum idem_lease_policy */
    int io_backend;            /* enum idem_io_backend; with IDEM_IO_AUTO the environment
                                  variable IDEM_IO_BACKEND=thread|io_uring decides */
    int read_only;             /* nonzero: inspection: no recovery, no changes, no new file */
    int test_clock;            /* nonzero: the store clock stands still, also across a reopen
                                  (only a new store starts at the wall clock); idem_clock_set */
    uint64_t max_keys;         /* 0: no limit beyond memory */
    uint64_t max_memory_bytes; /* 0: no limit; the index's memory (segments and directory) */
    uint64_t max_disk_bytes;   /* 0: no limit; bytes of the store's files (stats disk_bytes);
                                  at least three of the store's log segments */
    uint32_t result_bytes_max; /* 0: IDEM_RESULT_BYTES_DEFAULT; at most IDEM_RESULT_BYTES_LIMIT */
    uint32_t segment_bytes;    /* 0: 64 MiB; WAL segment size, a multiple of 4096, >= 1 MiB */
    const idem_clock_source *clock; /* NULL: system clocks; copied at open */
    int importing; /* nonzero: an import's open: a store that holds IDEM_IMPORT_MARKER (an
                      import into it was cut short) is opened, to import into it again; without
                      it such a store is refused (IDEM_ECORRUPT) unless read_only */
} idem_options;

/* Fills *o with the defaults (sync, recover, auto backend, no limits). */
void idem_options_init(idem_options *o);

/*
 * Opens (creating if absent) the store in directory `dir`, running recovery.
 * Returns IDEM_OK and sets *out, or: IDEM_EINVAL, IDEM_ELOCKED (another process owns it; the
 * message from idem_last_error names its pid and host), IDEM_ECORRUPT (also for a store that
 * holds IDEM_IMPORT_MARKER, unless o->read_only, which opens it and says so on stderr, or
 * o->importing), IDEM_EVERSION, IDEM_EIO, IDEM_ENOMEM, IDEM_EFULL (no space to create the
 * store).
 * On failure, idem_last_error() (thread-local) describes the cause in a sentence.
 */
int idem_open(const char *dir, const idem_options *o, idem_store **out)
    __attribute__((warn_unused_result));

/* Makes everything durable, writes a checkpoint (unless read-only or fatal), frees the store and
 * every queue still open on it: no call may be in progress on the store or its queues, and none
 * may use them afterwards (idem_queue_close included). To stop callers blocked in a WAIT,
 * idem_cancel_waits answers them busy; close once they have returned. Returns IDEM_OK;
 * IDEM_EFATAL if the store had failed, or failed in the close (a failed write or flush of the
 * closing checkpoint, or of the zero-filler's or the remover's last work: named on stderr,
 * event=fatal_io_error); or the closing checkpoint's IDEM_EFULL or IDEM_ENOMEM (no space, no
 * descriptor or memory: what was acknowledged is in the log all the same). */
int idem_close(idem_store *s);

/* The last open or I/O failure of this thread, as a sentence. Never NULL. */
const char *idem_last_error(void);

/* Nonzero when a failed write or flush has stopped the store. Thread-safe. */
int idem_is_fatal(const idem_store *s);
/* Why it stopped: what the store was doing, the call that failed and its error, e.g.
 * "creating log segment 7: fallocate: No space left on device"; "" while it runs. Thread-safe. */
const char *idem_fatal_reason(const idem_store *s);

/* Name of the I/O backend in use ("io_uring" or "thread"). */
const char *idem_io_backend_name(const idem_store *s);

/* ---- The record ---- */

typedef struct idem_record {
    const void *key;
    uint32_t key_len;
    int state;             /* enum idem_state */
    int64_t first_seen_ms; /* never changed by a repeat */
    int64_t expires_at_ms; /* first_seen_ms + ttl (see contract rule 5) */
    int64_t last_seen_ms;
    uint64_t seen_count; /* claims in all, the first included */
    int has_fp;
    uint8_t fp[IDEM_FP_BYTES]; /* XXH3-128 of the content, big-endian digest bytes */
    int64_t lease_until_ms;    /* in_flight only */
    int64_t token;             /* in_flight only: current owner's fencing token */
    const void *owner;         /* in_flight only, may be NULL */
    uint32_t owner_len;
    uint32_t attempts; /* grants of ownership: 1 + recoveries */
    int64_t last_grant_ms;
    const void *result; /* committed only */
    uint32_t result_len;
    const void *note; /* last hold or operator reason, may be NULL */
    uint32_t note_len;
    uint64_t mismatch_count;
    int64_t last_mismatch_ms; /* 0 when mismatch_count is 0 */
    uint8_t last_mismatch_fp[IDEM_FP_BYTES];
    int has_last_mismatch_fp;
    uint64_t version; /* changes on every logged change of the record */
} idem_record;

/* ---- Operations (the asynchronous form, and the arguments of the blocking calls) ---- */

enum idem_op_kind {
    IDEM_OP_CLAIM = 1,
    IDEM_OP_COMMIT = 2,
    IDEM_OP_RELEASE = 3,
    IDEM_OP_HOLD = 4,
    IDEM_OP_EXTEND = 5,
    IDEM_OP_GET = 6,
    IDEM_OP_SET_IF_ABSENT = 7, /* SET NX: a committed record whose result is the value */
    IDEM_OP_DEL = 8,     /* deletes a committed record (refused on unfinished: ESTATE); audited */
    IDEM_OP_RESOLVE = 9, /* operator decision; audited */
    IDEM_OP_SYNC = 10,   /* completes once everything submitted before it is durable */
};

enum idem_resolve_action {
    IDEM_RESOLVE_COMMIT = 1,  /* the target was checked: it happened (result optional) */
    IDEM_RESOLVE_RELEASE = 2, /* the target was checked: it did not happen; re-offer */
    IDEM_RESOLVE_SETTLE = 3,  /* close with no new action: committed with the current result */
};

/* idem_op.flags */
#define IDEM_F_FORCE   0x1u /* resolve: act on an in_flight record whose lease runs */
#define IDEM_F_EXPECT  0x2u /* resolve: refuse with IDEM_ECHANGED unless version matches */
#define IDEM_F_GET_OLD 0x4u /* set_if_absent: on an existing committed key, return its value */
/* del: this delete and the next operation, a delete too, are one group: a run of deletes with
 * the flag, ended by one without it, in one idem_submit, at most IDEM_DEL_GROUP_MAX. Either
 * every record of the group that exists is deleted, or, if any of them is in_flight or review,
 * none is: then every operation of the group completes with IDEM_ESTATE, and those whose
 * record is unfinished also with found = 1 and record.state (the rest of record is zero).
 * Room in the log and the audit trail for the whole group is made first: if the disk is full
 * every operation completes with IDEM_EFULL, and nothing is deleted. idem_submit accepts a
 * group whole or not at all. The check and the deletes happen under one hold of the store's
 * lock, unless a delete must wait for the flusher to free a buffer of the log (then another
 * thread's changes may come between them; an event loop that alone writes to the store, as
 * idemd's does, is unaffected). A chain that no delete without the flag ends, a group larger
 * than IDEM_DEL_GROUP_MAX, or one with an invalid delete completes with IDEM_EINVAL. */
#define IDEM_F_WITH_NEXT 0x8u

typedef struct idem_op {
    uint32_t kind;      /* enum idem_op_kind */
    uint32_t flags;     /* IDEM_F_* */
    uint64_t user_data; /* returned untouched in the completion */
    const void *key;
    uint32_t key_len;  /* 1..IDEM_KEY_BYTES_MAX */
    uint64_t ttl_ms;   /* claim, set_if_absent: 1..IDEM_TTL_MS_MAX */
    uint64_t lease_ms; /* claim, extend: 1..IDEM_LEASE_MS_MAX */
    uint32_t wait_ms;  /* claim: block a busy answer up to this long, <= IDEM_WAIT_MS_MAX */
    int64_t token;     /* commit, release, hold, extend */
    const void *fp;    /* claim: content bytes (hashed with XXH3-128), or NULL */
    uint32_t fp_len;
    const void *owner; /* claim: the worker's stable id, or NULL */
    uint32_t owner_len;
    const void *data; /* commit/resolve result, set_if_absent value, hold/resolve reason */
    uint32_t data_len;
    const void *result; /* resolve with IDEM_RESOLVE_COMMIT only: the result (data is then the
                         * reason: required, and without a NUL byte, as the audit trail keeps
                         * it as text; IDEM_EINVAL otherwise, and for a result given to release
                         * or settle, which write none) */
    uint32_t result_len;
    uint32_t action;         /* resolve: enum idem_resolve_action */
    uint64_t expect_version; /* resolve with IDEM_F_EXPECT */
    const char *actor;       /* resolve, del: who acts, for the audit trail (NUL-terminated) */
} idem_op;

typedef struct idem_completion {
    uint64_t user_data;
    int err;               /* IDEM_OK or a negative idem_err */
    int outcome;           /* claim: enum idem_outcome; set_if_absent: IDEM_NEW or IDEM_DONE */
    int64_t token;         /* new, recover */
    int64_t lease_left_ms; /* busy */
    uint32_t attempts;     /* recover */
    int64_t last_grant_ms; /* recover: grant time of the attempt whose lease ran out */
    const void *data;      /* done: result; review: note; set_if_absent+GET_OLD: old value */
    uint32_t data_len;
    int found;          /* get: nonzero when the record exists (then `record` is filled) */
    idem_record record; /* get */
} idem_completion;

/* Opens a queue of `depth` outstanding operations (1..65536). Returns IDEM_OK, IDEM_EINVAL, or
 * IDEM_ENOMEM with errno set by the call that failed (ENOMEM; EMFILE or ENFILE from the queue's
 * eventfd, or another of its errors; one of pthread_cond_init's) and idem_last_error saying
 * which in a sentence. */
int idem_queue_open(idem_store *s, uint32_t depth, idem_queue **out)
    __attribute__((warn_unused_result));
/* Frees the queue; outstanding operations still take effect but are not reported. */
void idem_queue_close(idem_queue *q);
/* Frees what q keeps for the results of idem_scan, idem_audit and idem_attention (a call on q:
 * those results are invalid after). q keeps it between calls so that the next read reuses it,
 * as much as the largest read made; a caller that made a large one can give it back. */
void idem_queue_trim(idem_queue *q);

/* A file descriptor that is readable while completions are ready to poll (an eventfd), for
 * event loops. Reading it is idem_poll's job, and one wake-up may stand for many completions:
 * after one, poll until idem_poll returns fewer than it was asked for. Until the first call the
 * queue keeps no eventfd signalled, so blocking callers pay no system call for it; the first
 * call signals it only if completions are ready already. */
int idem_queue_fd(idem_queue *q);

/*
 * Applies `n` operations in order (atomically each; the batch is not a transaction, except for
 * a group of deletes, IDEM_F_WITH_NEXT) and queues their completions. Returns the number
 * accepted (fewer than n when the queue is full, or before a group that does not fit), or a
 * negative idem_err (IDEM_EINVAL for n > IDEM_BATCH_MAX, or a first group of more operations
 * than the queue's depth). Invalid operations are accepted and complete with err set. Makes no
 * I/O of its own, but may wait for the flusher's: while the log's buffers are full, for token
 * headroom, and while a backup or close makes the log durable.
 */
int idem_submit(idem_queue *q, const idem_op *ops, size_t n) __attribute__((warn_unused_result));

/*
 * Moves up to `max` completions that are ready (durable, in sync mode) into out[], in
 * submission order per key. Waits up to timeout_ms (-1: forever, 0: not at all) for the first.
 * Returns the count (0 on timeout) or a negative idem_err. Bytes referenced by the completions
 * stay valid until the next call on this queue.
 */
int idem_poll(idem_queue *q, idem_completion *out, size_t max, int timeout_ms);

/* Operations submitted and not yet polled. */
uint32_t idem_queue_pending(const idem_queue *q);

/* ---- Blocking calls: one operation, through a queue with nothing pending ---- */

typedef struct idem_claim_args {
    uint64_t ttl_ms;
    uint64_t lease_ms;
    const void *fp; /* optional content bytes */
    uint32_t fp_len;
    const void *owner; /* optional owner id */
    uint32_t owner_len;
    uint32_t wait_ms; /* block a busy answer up to this long */
} idem_claim_args;

/* Claim outcomes are in c->outcome; the return value is IDEM_OK or an error
 * (IDEM_EINVAL, IDEM_EFULL, IDEM_EFATAL, IDEM_EREADONLY, IDEM_EBUSY). */
int idem_claim(idem_queue *q, const void *key, size_t key_len, const idem_claim_args *a,
               idem_completion *c);
/* IDEM_OK (also for a repeat with the same result), IDEM_ESTALE, IDEM_ECONFLICT,
 * IDEM_ENOTFOUND, or a store error. */
int idem_commit(idem_queue *q, const void *key, size_t key_len, int64_t token, const void *result,
                size_t result_len);
int idem_release(idem_queue *q, const void *key, size_t key_len, int64_t token);
int idem_hold(idem_queue *q, const void *key, size_t key_len, int64_t token, const void *reason,
              size_t reason_len);
int idem_extend(idem_queue *q, const void *key, size_t key_len, int64_t token, uint64_t lease_ms);
/* c->found tells whether the record exists; c->record holds it. */
int idem_get(idem_queue *q, const void *key, size_t key_len, idem_completion *c);
/* SET NX: c->outcome is IDEM_NEW (set) or IDEM_DONE (exists; with get_old, c->data holds the
 * value). An unfinished record answers IDEM_ESTATE with get_old, IDEM_DONE without. */
int idem_set_if_absent(idem_queue *q, const void *key, size_t key_len, const void *value,
                       size_t value_len, uint64_t ttl_ms, int get_old, idem_completion *c);
/* Deletes a committed record: IDEM_OK, IDEM_ENOTFOUND, IDEM_ESTATE (unfinished). Audited. */
int idem_del(idem_queue *q, const void *key, size_t key_len, const char *actor);
/* Executes one op (any kind) and waits for its completion. */
int idem_exec(idem_queue *q, const idem_op *op, idem_completion *c);
/* For a server's shutdown: every parked WAIT claim completes now with busy (and the lease left),
 * and later claims no longer wait. Poll the queues to collect them, then close. */
void idem_cancel_waits(idem_store *s);
/* A claim of q parked by WAIT, named by its user_data, completes now with busy (for a server
 * whose client went away); of several with one user_data, the first submitted. IDEM_OK, or
 * IDEM_ENOTFOUND if no such claim waits. Its cost does not grow with the claims parked. */
int idem_cancel_wait(idem_queue *q, uint64_t user_data);
/* Returns when everything acknowledged so far is durable (all modes). */
int idem_sync(idem_store *s);

/* ---- Scans, audit, stats ---- */

typedef struct idem_scan_args {
    uint64_t cursor;  /* 0 to start; the returned next_cursor to go on; 0 returned: done. A
                       * cursor is opaque: sealed with the store's secret (so that no position
                       * can be chosen), and valid only for the store that returned it */
    int state;        /* 0: any, else enum idem_state */
    int64_t older_ms; /* 0: any, else only records with now - first_seen_ms >= older_ms */
    uint32_t count;   /* slots to visit per call (a hint, like Redis SCAN), 0: 100 */
} idem_scan_args;

/* Keys of one scan step: keys[i], key_lens[i] for i < n, valid until the next call on q.
 * Like Redis SCAN: every key present for the whole scan is returned at least once. In sync mode
 * it returns once everything written before it read is durable, what it lists and what it
 * leaves out alike (so a failed store, whose last writes never will be, answers IDEM_EFATAL;
 * idem_attention likewise). */
int idem_scan(idem_queue *q, const idem_scan_args *a, uint64_t *next_cursor, const void ***keys,
              const uint32_t **key_lens, size_t *n);

/* An audit entry's flags (idem_audit_entry.flags). */
/* A resolve with FORCE: the record's lease still ran. */
#define IDEM_AUDIT_FORCED 0x1u
/* A resolve of an in_flight record whose lease had run out. */
#define IDEM_AUDIT_LEASE_LAPSED 0x2u
/* result_* hold the result a resolve commit recorded, or a del erased. */
#define IDEM_AUDIT_RESULT      0x4u
#define IDEM_AUDIT_FLAGS_KNOWN 0x7u
/* The bytes of a result an audit entry keeps (its first ones; result_full_len says the rest). */
#define IDEM_AUDIT_RESULT_KEPT 256u

typedef struct idem_audit_entry {
    uint64_t seq;
    int64_t at_ms;
    const char *actor;  /* NUL-terminated */
    const char *action; /* "resolve-commit", "resolve-release", "resolve-settle", "del" */
    const void *key;
    uint32_t key_len;
    const char *reason; /* NUL-terminated */
    int state_before;   /* enum idem_state, 0 for absent */
    int state_after;
    uint64_t version_before;
    uint64_t version_after;
    uint32_t flags;           /* IDEM_AUDIT_*; 0 in entries written before the flags were */
    const void *result;       /* with IDEM_AUDIT_RESULT: the result's first result_len bytes */
    uint32_t result_len;      /* min(result_full_len, IDEM_AUDIT_RESULT_KEPT) */
    uint32_t result_full_len; /* the whole result's length */
} idem_audit_entry;

/* The newest `count` audit entries (of `key` when key != NULL), newest first, in *entries
 * (valid until the next call on q). */
int idem_audit(idem_queue *q, const void *key, size_t key_len, uint32_t count,
               const idem_audit_entry **entries, size_t *n);
/* The same, for entries older than before_seq (0: from the newest): page through the whole
 * trail by passing the last entry's seq. */
int idem_audit_page(idem_queue *q, const void *key, size_t key_len, uint64_t before_seq,
                    uint32_t count, const idem_audit_entry **entries, size_t *n);

typedef struct idem_stats {
    uint64_t keys; /* records in the index, expired ones not yet swept included */
    uint64_t keys_in_flight, keys_review;
    uint64_t keys_committed; /* expired ones not yet swept included, as in keys */
    /* Claims by outcome. A claim that waits (WAIT) counts once, by the outcome it is answered
     * with (busy at its deadline or when cancelled); not as it parks, nor its re-runs. */
    uint64_t claims_new, claims_busy, claims_done, claims_mismatch, claims_recover, claims_review;
    uint64_t mismatches; /* mismatches recorded */
    uint64_t recoveries;
    uint64_t conflicting_commits;
    uint64_t expired_total;      /* records reclaimed by expiry */
    int64_t oldest_in_flight_ms; /* first_seen of the oldest in_flight record, 0 if none */
    int64_t oldest_review_ms;
    uint64_t wal_bytes;  /* bytes of live WAL segments */
    uint64_t disk_bytes; /* what max_disk_bytes counts: the log's segments, the two checkpoints
                            kept (16-32 bytes a key each) and audit.log with the space reserved
                            for it; not the superblock and lock files (a few KiB), nor a
                            checkpoint while it is written (one more, until it is installed
                            and the oldest goes) */
    uint64_t disk_free_bytes;
    uint64_t disk_reserve_bytes; /* room kept for compaction and checkpoints on a full disk, a
                                    file of its own, not in disk_bytes: held unless let go or
                                    short of room (logged); 0: none is kept (read-only, no
                                    fallocate) */
    int disk_reserve_released;   /* let go at the end of a full disk: new keys answer FULL
                                    until disk_reserve_bytes and a segment more are free */
    uint64_t memory_bytes;       /* anonymous memory: index, repeat counters, age heaps, the audit
                                    trail's map (about 8 KiB a MiB of trail), buffers (the
                                    limit, max_memory_bytes, counts index_bytes only) */
    uint64_t max_keys, max_memory_bytes, max_disk_bytes;
    uint64_t flushes;
    uint64_t flush_records; /* records covered by all flushes (batch size = / flushes) */
    uint64_t flush_latency_us_sum;
    uint64_t flush_latency_us_buckets[16]; /* bucket i: latency <= 2^(i+4) us; last: the rest */
    int64_t clock_skew_ms;                 /* store clock - wall clock */
    int64_t store_clock_ms;
    uint64_t checkpoints;
    uint64_t compactions;
    int fatal;
    int loading;
    uint64_t store_generation;   /* 1 at creation; bumped by every restore and import */
    int64_t token_next;          /* every token handed out so far is below it (an export
                                    carries it: idem_import_begin) */
    uint64_t keys_with_mismatch; /* records whose mismatch_count > 0 (expired ones not yet
                                    swept included) */
    uint64_t frames_replayed;    /* at the last open */
    uint64_t claims_last_minute; /* claims (and SET NX) answered in the last 60 s of elapsed time */
    uint64_t duplicates_last_minute; /* of which not `new`: the duplicate ratio's numerator */
    uint64_t open_ms;                /* how long the last open took */
    /* The age of the oldest in_flight and review records (store clock - first_seen; 0 if
     * none): what an alert compares with a bound, with no clock of its own to subtract. */
    int64_t oldest_in_flight_age_ms, oldest_review_age_ms;
    uint64_t index_bytes; /* the index's blocks in use: what max_memory_bytes limits (part of
                             memory_bytes) */
    /* New keys answered IDEM_EFULL because the index could not grow (no memory for its next
     * block, or a segment at the deepest split full: keys sharing 24 bits of their hash), with
     * every limit unreached: an event=full line names it. */
    uint64_t index_refusals;
} idem_stats;

/* Counters in O(1): no scan of keys. Thread-safe. After a burst of claims it first filters the
 * age heaps of records finished since (in steps, letting other callers in between): a call may
 * then take tens of milliseconds (docs/benchmarks.md). */
void idem_get_stats(idem_store *s, idem_stats *out);
/* The number of keys held (idem_stats.keys), at once: no filtering of the age heaps. For a
 * caller that needs only the count (DBSIZE) on a path that must not wait. Thread-safe. */
uint64_t idem_key_count(idem_store *s);

/* ---- Operator views ---- */

typedef struct idem_attention_args {
    int64_t older_ms;   /* also list in_flight records older than this (first_seen) while their
                           lease runs; 0: only those whose lease ran out */
    uint32_t max;       /* at most this many records (0: 1000) */
    uint64_t max_bytes; /* the list ends once its records' keys, owners, notes and results
                           hold this many bytes, the record that reaches it listed (0: no
                           limit): a list of records with large results stays bounded */
} idem_attention_args;

/*
 * The records that need a person or a reconciler: every review record, every in_flight record
 * whose lease ran out (or older than a->older_ms), and every record with a recorded mismatch.
 * Costs no scan of all keys (the store keeps the unfinished and the mismatched records apart).
 * records[i] for i < n stay valid until the next call on q; order: review first, then in_flight
 * by first_seen, then mismatches. Cut to max, the list keeps the first groups and, within a
 * group, the oldest records (by first_seen; mismatches the latest, by their last mismatch: a
 * new incident is not hidden behind committed ones listed until they expire); so is a list cut
 * to max_bytes. The store's
 * lock is taken in steps meanwhile, so other callers are not held up for the whole list; a
 * record whose state changes during the call is listed once, possibly in the group being read
 * when it changed. In sync mode the call returns once what it lists is durable (as idem_scan).
 * IDEM_ECORRUPT when a record it would list fails its checksum (as idem_get of its key): it is
 * not left out of a list that succeeds; idem_verify names it.
 */
int idem_attention(idem_queue *q, const idem_attention_args *a, const idem_record **records,
                   size_t *n);

typedef struct idem_verify_report {
    uint64_t segments, frames, records, checkpoint_entries, audit_entries, index_entries;
    uint64_t errors;       /* faults found (0: the store is sound) */
    char first_error[512]; /* what and where, for the first fault */
} idem_verify_report;

/*
 * Offline, read-only check of every checksum and invariant of the store in dir (idemd must not
 * be running: IDEM_ELOCKED otherwise): superblock copies, every frame of every segment, the
 * checkpoint, the audit trail, and that the index rebuilt from them names decodable records.
 * Never writes. progress (may be NULL) is called now and then with bytes done and total.
 * Returns IDEM_OK when the checks ran (see r->errors), or an error that stopped them.
 */
int idem_verify(const char *dir, idem_verify_report *r,
                void (*progress)(void *ctx, uint64_t done, uint64_t total), void *ctx);

/* ---- Import and restore ---- */

/*
 * Begins an import from an export: the store's generation goes one up (written with its next
 * superblock), and tokens handed out from now on are at least token_next, the source store's
 * (an export carries it: every token that store handed out is below it; 0 when not known), so
 * that no token the source gave out, even to a key since released or deleted, is given out
 * again. Returns once a reservation that covers token_next is durable: IDEM_OK, IDEM_EINVAL
 * (token_next out of 0..IDEM_TOKEN_MAX), or a store error. An import into a store that existed
 * before it marks the store first (idem_import_mark, below), so that a crash part-way leaves a
 * store that idem_open refuses.
 */
int idem_import_begin(idem_queue *q, int64_t token_next);
/*
 * Writes a record as given (state, first_seen, expiry, counters and token kept; the version kept
 * when it is ahead of this store's log, else made the next one, since versions only grow; the
 * record replaces any record of the key). For import from an export: admin use only, on a
 * store no worker uses yet. Tokens handed out later are above every imported token. Returns
 * IDEM_OK, IDEM_EINVAL (a field out of range), or a store error.
 */
int idem_import_record(idem_queue *q, const idem_record *r);
/* Appends an audit entry as given (seq and times kept; a seq at or below the trail's last one
 * becomes the next one). IDEM_EINVAL for a seq above INT64_MAX: later entries must have room to
 * number on from it. Returns once the entry is durable. */
int idem_import_audit(idem_queue *q, const idem_audit_entry *e);
/* The same for n entries in order (at most IDEM_IMPORT_AUDIT_MAX), written together: they share
 * the trail's blocks, a flush for each 256 KiB group (one at a time, each took a 4 KiB block and
 * a flush of its own). IDEM_EINVAL, with nothing written, if any entry is out of range. */
#define IDEM_IMPORT_AUDIT_MAX 256u
int idem_import_audit_n(idem_queue *q, const idem_audit_entry *e, size_t n);
/* The field of e that idem_import_audit refuses ("actor", "action", "key", "reason", "seq",
 * "state_before", "state_after", "flags" or "result": missing, past its limit or out of range,
 * or a result whose lengths disagree), NULL when it takes e. Strings are read to their first
 * NUL. */
const char *idem_audit_entry_invalid(const idem_audit_entry *e);
/*
 * The import marker: a file of this name in a store's directory says that an import into the
 * store began and has not finished, so the store may hold only part of an export. idem_open
 * refuses such a store (IDEM_ECORRUPT, idem_last_error naming the file and what to do) unless it
 * is opened read-only or with idem_options.importing. A store made by the import in a directory
 * of its own, and given its name only once whole, needs none.
 */
#define IDEM_IMPORT_MARKER "IMPORTING"
/*
 * Creates dir/IDEM_IMPORT_MARKER (one line naming the process, its host and the time) and makes
 * it durable with its directory. Call it with the store open for the import (its lock held) and
 * before the first idem_import_begin, idem_import_record or idem_import_audit: from then on a
 * crash leaves a store that open refuses. A marker already there (an import cut short, run
 * again) is kept as it is. Returns IDEM_OK, IDEM_EINVAL, IDEM_EFULL or IDEM_EIO (nothing is left
 * then); idem_last_error says why. Thread-safe.
 */
int idem_import_mark(const char *dir) __attribute__((warn_unused_result));
/*
 * Removes dir/IDEM_IMPORT_MARKER and makes that durable: call it once the import has read the
 * whole export and idem_close returned IDEM_OK. Takes the store's lock for it, shared with
 * read-only opens (inspections): IDEM_ELOCKED while a process holds the store to write. Returns
 * IDEM_OK (also when there was no marker), IDEM_EINVAL or IDEM_EIO. Thread-safe.
 */
int idem_import_unmark(const char *dir) __attribute__((warn_unused_result));
/* 1 when dir holds IDEM_IMPORT_MARKER, 0 when not, IDEM_EINVAL or IDEM_EIO when that cannot be
 * told (idem_last_error says why). Thread-safe. */
int idem_import_marked(const char *dir);
/* 1 when name (a directory entry's) is one of the files a store makes in its directory (log
 * segments, checkpoints, the superblock, the audit trail, the disk reserve; LOCK and
 * IDEM_IMPORT_MARKER aside), else 0: what a failed import into an empty directory removes. */
int idem_store_file_name(const char *name);
/* Makes dest_dir (absent) a copy of the backup in backup_dir, under a new store generation:
 * the restored store hands out tokens above every token the backup's store could have handed
 * out before the backup was taken, and reports the generation in its stats. As idem_backup, it
 * copies into "<dest_dir>.partial" and renames that to dest_dir once the copy is durable and
 * passes idem_verify (IDEM_ECORRUPT, naming the first fault, for a damaged backup). A backup_dir
 * that a process holds open for writing is refused (IDEM_ELOCKED). A backup that holds
 * IDEM_IMPORT_MARKER gives dest_dir one too, made before dest_dir is named. */
int idem_restore(const char *backup_dir, const char *dest_dir);

/* ---- Maintenance ---- */

/* Writes a checkpoint of the index so that the next open need not replay the log: one taken in
 * steps by the store's flusher while changes go on, starting after this call (so it holds every
 * change made before it). Returns once it is installed: IDEM_OK, IDEM_EREADONLY, IDEM_EFATAL,
 * IDEM_EFULL (no room for the file), or IDEM_EINVAL if the store is closed meanwhile. */
int idem_checkpoint(idem_store *s);
/* Compacts every sealed segment now (live records copied forward, expired ones dropped, the
 * segments retired) and returns when that is done (IDEM_OK) or timeout_ms passed (IDEM_EBUSY
 * then; the work goes on in the background; a negative timeout_ms waits without bound), or
 * IDEM_EFULL once a checkpoint the retirement needs finds no room, or the walk has stopped for
 * want of room with nothing walked left to retire (the work goes on once room is made),
 * IDEM_ECORRUPT if a damaged frame stopped compaction, IDEM_EFATAL. */
int idem_compact(idem_store *s, int timeout_ms);
/* Copies a consistent point-in-time image of the live store into the new directory dest. The
 * copy is made in "<dest>.partial" (which must not exist either) and renamed to dest once it is
 * whole and durable: dest never holds a copy cut short. A copy that fails removes its partial
 * directory; one cut short by a crash leaves it, and a later copy to dest refuses, naming it.
 * A marked store (IDEM_IMPORT_MARKER; open read-only) gives dest the marker too, made before
 * dest is named. */
int idem_backup(idem_store *s, const char *dest_dir);

/* ---- The store clock ---- */

/* The store clock now (ms since the epoch). Thread-safe. */
int64_t idem_clock_now(idem_store *s);
/* The store clock's bound (ms since the epoch, about the year 37600): the superblock and the
 * log refuse a clock past it as corrupt, so the test clock is never moved past it. */
#define IDEM_CLOCK_MS_MAX ((INT64_C(1) << 50) - 1)
/* Test clock only (IDEM_ENOTSUP otherwise): move the clock forward to ms (a step back, or past
 * IDEM_CLOCK_MS_MAX, answers IDEM_EINVAL), or by delta_ms >= 0. Due lease wake-ups fire. The
 * move is made durable by the next batch or a superblock write, and in sync mode no completion
 * is delivered until then (idem_sync waits for it too): an answer given after it (a key it
 * expired) stays true after a crash. */
int idem_clock_set(idem_store *s, int64_t ms);
int idem_clock_advance(idem_store *s, int64_t delta_ms);

/* ---- Helpers ---- */

/* The XXH3-128 digest the store keeps for content bytes, as 16 big-endian bytes. */
void idem_fingerprint(const void *content, size_t len, uint8_t out[IDEM_FP_BYTES]);

const char *idem_outcome_name(int outcome); /* "new", "busy", ... */
const char *idem_state_name(int state);     /* "in_flight", "committed", "review" */

#ifdef __cplusplus
}
#endif

#endif /* IDEM_H */
