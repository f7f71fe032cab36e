/*
 * store.h: the store handle shared by store.c (open, close, flusher, queues, clock), ops.c (the
 * claim rules over one key) and audit.c (the operator trail). Not part of the public API.
 *
 * Locking: one mutex (mu) guards everything below it; the flusher thread drops it only around
 * the I/O of a batch. Whoever holds mu also holds the write side of rw (store_lock), so that
 * claims of committed keys can be answered under rw's read side alone, by many threads at once
 * (ops_read_*): they change nothing but counters, with atomics (the repeat counters and their
 * table's end, the claim tallies, the clock's last reading), and take freed counter entries or
 * grow the table under seen_mu. Completions become ready when the LSN they depend on
 * (need_lsn) is durable (sync mode) or at once (batch, none); a failed flush makes every
 * not-yet-durable completion answer IDEM_EFATAL and the store refuses all later changes.
 */
#ifndef IDEM_STORE_H
#define IDEM_STORE_H

#include <pthread.h>
#include <stdint.h>

#include "disk_reserve.h"
#include "idem.h"
#include "index.h"
#include "io.h"
#include "record.h"
#include "super.h"
#include "wal.h"

#define STORE_BATCH_FLUSH_MS  10   /* batch mode: flush at least this often */
#define STORE_FRAMES_PER_STEP 128  /* frames flushed that earn compaction one more step */
#define STORE_BUFFERS_IDLE_MS 1000 /* no flush for this long: log buffers are trimmed */
/* Log chunk buffers kept through an idle log: a frame's, and the two held for a flush's END
 * and a SEGEND. */
#define STORE_BUFFERS_KEPT    3
#define STORE_CLOCK_MS_MAX    IDEM_CLOCK_MS_MAX /* as the superblock and log allow */
#define STORE_STEPS_PER_FLUSH 8                 /* at most this many more after one flush */
#define STORE_SLEW_PER_S_MS   100 /* the store clock follows the wall clock by <= 10% */
#define STORE_CMP_AHEAD       64  /* walked segments awaiting retirement, at most */
#define STORE_CKPT_EVERY_SEGS 8   /* a checkpoint at least every this many segments (compact.c) */
#define SEG_EXP_UNKNOWN       INT64_MIN       /* segment expiry horizon not known (compact.c) */
#define SEG_EXP_EMPTY         (INT64_MIN + 1) /* known: no record written there yet */

enum slot_state { SLOT_FREE = 0, SLOT_DONE = 1, SLOT_PARKED = 2, SLOT_RETURNED = 3 };

/* idem_completion up to its record: what every operation answers. */
struct slot_completion {
    uint64_t user_data;
    int err;
    int outcome;
    int64_t token;
    int64_t lease_left_ms;
    uint32_t attempts;
    int64_t last_grant_ms;
    const void *data;
    uint32_t data_len;
    int found;
};
#define SLOT_COMPLETION_SAME(f)                                                                    \
    _Static_assert(offsetof(struct slot_completion, f) == offsetof(idem_completion, f), #f)
SLOT_COMPLETION_SAME(user_data);
SLOT_COMPLETION_SAME(err);
SLOT_COMPLETION_SAME(outcome);
SLOT_COMPLETION_SAME(token);
SLOT_COMPLETION_SAME(lease_left_ms);
SLOT_COMPLETION_SAME(attempts);
SLOT_COMPLETION_SAME(last_grant_ms);
SLOT_COMPLETION_SAME(data);
SLOT_COMPLETION_SAME(data_len);
SLOT_COMPLETION_SAME(found);
_Static_assert(sizeof(struct slot_completion) == offsetof(idem_completion, record),
               "a slot's completion is idem_completion's head");

/* What few operations of a slot use: a get's record, and a parked WAIT claim's state. */
struct qslot_ext {
    struct idem_queue *q;
    idem_record record; /* when c.found */
    /* A parked WAIT claim: its op, with key/fp/owner copied into the slot's buf. */
    idem_op op;
    int64_t deadline_mono_ms;
    int64_t lease_end_ms;        /* store clock: when the lease it waits on runs out */
    uint8_t wait_fp[16];         /* its fingerprint's digest (op.fp points here) */
    int wake_again;              /* a wake-up found no room: the next one of any kind re-runs it */
    uint64_t whash;              /* its key's hash: the waiter bucket it is on (waiters.c) */
    struct qslot *wprev, *wnext; /* the store's parked claims, oldest first */
    struct qslot *bprev, *bnext; /* its bucket's parked claims, oldest first */
    uint32_t park_next;          /* the next parked slot (index + 1, 0: none) of its chain in
                                    the queue's by_user_data table */
};

/* One submitted operation and its completion, owned by a queue. A queue keeps up to 64 Ki in
 * flight, more than the caches hold, so a slot is two cache lines: the fields every operation
 * writes, then its completion; the rest is apart (ext). A claim answered from a committed
 * record writes the slot's two lines and the first of its buffer. */
struct qslot {
    _Alignas(64) int state;
    int durable_wait;  /* IDEM_OP_SYNC without sync durability: counted in s->sync_ops until it
                          is delivered or its queue closed; ready only once need_lsn is durable */
    uint64_t seq;      /* submission order */
    uint64_t need_lsn; /* ready once this LSN is durable */
    struct qslot *lprev, *lnext; /* the queue's outstanding slots, or its parked ones */
    /* Copies owned by the slot (results, notes, keys of a parked claim). */
    uint8_t *buf;
    uint32_t buf_cap;
    uint32_t buf_used;
    struct qslot_ext *ext;
    struct slot_completion c;
};
_Static_assert(sizeof(struct qslot) == 128, "a slot is two cache lines");

struct idem_queue {
    idem_store *s;
    uint32_t depth;
    struct qslot *slots;
    struct qslot_ext *ext; /* slots[i].ext == &ext[i] */
    uint32_t *free_stack;  /* indexes of free slots */
    uint32_t nfree;
    uint32_t kept_big; /* free slots keeping a buffer over QSLOT_BUF_SMALL (store.c) */
    /* Outstanding slots (submitted, not yet polled) in submission order, but for parked WAIT
     * claims: those are on parked_head..parked_tail (in the order they parked) until they
     * complete, and then wait on `woken` (linked through lnext, newest first) until the next
     * look at the list puts them all back in their places by seq in one pass (queue_park,
     * queue_unpark, queue_merge_woken), so that neither a poll nor a flush's end walks
     * thousands of parked claims, nor does each answer of one walk those answered before it. */
    struct qslot *head, *tail;
    struct qslot *parked_head, *parked_tail;
    struct qslot *woken;
    struct qslot **woken_sort; /* depth entries: the merge's scratch */
    /* The parked claims by user_data (idem_cancel_wait): chains of slot index + 1 (0 ends one)
     * through ext[].park_next, by_user_data_mask + 1 of them (a power of two, at least depth),
     * so that a server's cancel of one of thousands parked does not walk them all. */
    uint32_t *by_user_data;
    uint32_t by_user_data_mask;
    uint32_t active; /* outstanding slots, parked ones included */
    uint64_t seq_next;
    int efd;
    int fd_used; /* idem_queue_fd was called: signal efd (mu) */
    /* A thread waits in idem_poll on this queue's own condition (with mu), so that the end of a
     * flush wakes only the queues it has completions for, not every blocked caller. */
    pthread_cond_t cond;
    int polling;
    /* The wake cascade (store.c, notify_ready_unlocked): listed while a flush's end has a
     * completion for this polling queue that nobody has signalled yet; pins count the threads
     * about to signal cond without mu (atomic: let go of without mu), which close waits out. */
    struct idem_queue *wake_next;
    int wake_listed;
    uint32_t pins;
    /* Repeat counter entries this queue's readers took from the table in one go and have not
     * handed out yet: [seen_next, seen_end) (ops.c read_seen_take); freed at close. */
    uint32_t seen_next, seen_end;
    /* idem_exec's claims in a row that the read side did not find committed, and the claims
     * made since it was last tried (store.c, EXEC_READ_MISSES). */
    uint32_t exec_read_misses, exec_read_skips;
    struct idem_queue *next, *prev;
    /* Poll results kept valid until the next call. */
    struct qslot **returned;
    uint32_t nreturned;
    /* Scan and audit results. */
    const void **scan_keys;
    uint32_t *scan_lens;
    uint8_t *scan_buf;
    size_t scan_cap, scan_used, scan_n, scan_max;
    idem_audit_entry *audit;
    char *audit_mem;                 /* their strings */
    struct audit_place *audit_place; /* where each entry's strings lie in audit_mem */
    size_t audit_mem_cap;
    uint8_t *audit_read; /* a stretch of audit.log, and its matching entries */
    const uint8_t **audit_hits;
    size_t audit_read_cap;
    /* Attention view results. */
    idem_record *att_recs;
    uint8_t *att_buf;
    size_t att_cap;
};

/* idem_store.ckr.state: the flusher's checkpoint in steps (store.c). */
#define CKPT_RUN_IDLE     0
#define CKPT_RUN_SCANNING 1
#define CKPT_RUN_WRITTEN  2

struct seen_info {
    int64_t last_seen_ms;
    uint64_t seen_count; /* on a free entry: the next free entry's index + 1 (0: none) */
};

/* The repeat counters live in chunks of SEEN_CHUNK entries (2 MiB, aligned to it: one huge
 * page where malloc's heap is on them) that never move: the table grows by one chunk, not by
 * copying (a doubling by realloc copied 16 MiB under mu in 21 ms). The first chunk's entries
 * come in SEEN_TIERS tiers instead, so that a store with few repeated keys does not take 2 MiB:
 * entries [0, 1 Ki), then [2^k, 2^(k+1)) for k = 10..16, each tier as large as all before it. */
#define SEEN_CHUNK_BITS 17u
#define SEEN_CHUNK      (1u << SEEN_CHUNK_BITS)
#define SEEN_CHUNKS_MAX (0x7fffffffu >> SEEN_CHUNK_BITS) /* index + 1 <= SLOT_AUX_SEEN */
#define SEEN_TIER0_BITS 10u
#define SEEN_TIERS      (SEEN_CHUNK_BITS - SEEN_TIER0_BITS + 1)

/* A version of a key at a log address, with enough of the key's hash bits to find its slot in
 * the index, so that whether the index still points at it is answered without reading the log.
 * 16 bytes: time_hi = (the kind's time in ms + AGE_TIME_BIAS) << 16 | the top 16 bits of the
 * hash's low 32 (the heap orders by time_hi: by time, then by those bits); addr_tag as in
 * index_slot (the log address, the hash's top 24 bits above). Times outside +-2^47 ms (4,460
 * years) are clamped: their order among themselves is lost, nothing else. */
struct age_entry {
    uint64_t time_hi;
    uint64_t addr_tag;
};
#define AGE_TIME_BIAS (INT64_C(1) << 47)

/* Entries beyond twice the records of a kind before its heap is filtered: about 1.2 index
 * checks per push. */
#define AGES_SLACK 16384u
/* Entries a push checks while a filtering pass is under way: about 5 us. */
#define AGES_FILTER_STEP 64u
/* Entries the flusher checks per round (ages_tidy): about 20 us. */
#define AGES_TIDY_STEP 256u
/* Entries a view (stats, the attention list) checks per hold of mu: about 0.3 ms. */
#define AGES_VIEW_STEP 4096u

struct age_heap {
    struct age_entry *v;
    size_t n, cap;
    size_t filter_left; /* a filtering pass under way (ages.c) has v[0, filter_left) to check */
    int filtering;
};

enum age_kind { AGE_IN_FLIGHT = 0, AGE_REVIEW = 1, AGE_MISMATCH = 2, AGE_KINDS = 3 };

/* Audit entries as groups ready to write (audit.c): len bytes at p (block-aligned), the last
 * group open from grp with grp_n entries until closed; n entries in all. */
struct audit_buf {
    uint8_t *p;
    size_t cap, len, grp;
    uint32_t grp_n, n;
};

/* Where an audit entry's strings lie in a queue's results (audit.c): action, actor, key and
 * reason one after the other from off. */
struct audit_place {
    size_t off;
    uint32_t action_len, actor_len, reason_len;
};

/* A place in audit.log (audit.c): the unit that starts at off, its first entry numbered seq,
 * and a filter of the keys of the stretch from there to the next mark (NULL: none made). */
struct audit_mark {
    uint64_t off;
    uint64_t seq;
    uint64_t *filter;
};

/* A log line said at most once per period of elapsed time (the monotonic clock): the first
 * always, then none until the period since the last one said has passed. */
struct log_gate {
    int64_t said_ms;
    int said;
};

static inline int log_gate_open(struct log_gate *g, int64_t mono_ms, int64_t period_ms)
{
    if (g->said && mono_ms - g->said_ms < period_ms) return 0;
    g->said = 1;
    g->said_ms = mono_ms;
    return 1;
}

struct idem_store {
    pthread_mutex_t mu;
    pthread_rwlock_t rw;       /* write side with mu (store_lock); read side: ops_read_* */
    pthread_mutex_t seen_mu;   /* readers taking a freed counter entry or growing the table */
    pthread_cond_t cond_ready; /* durable LSN moved, or a parked claim completed */
    pthread_cond_t cond_flush; /* work for the flusher */
    pthread_t flusher;
    int flusher_started;
    char *dir;
    idem_options opt;
    idem_clock_source clock;
    struct io *io;
    struct remover *remover; /* deletes retired files (NULL when read-only) */
    struct filler *filler;   /* zero-fills log space ahead of the log (NULL when read-only) */
    int lock_fd;
    struct super sb;
    uint64_t generation_floor; /* every superblock written carries at least this generation
                                  (idem_import_begin; 0: none) */
    struct wal *wal;
    struct index *ix;
    uint64_t durable_lsn;
    int fatal;
    char fatal_why[256]; /* what failed, once fatal is set (store_fail) */
    /* This open follows no clean close: the log and audit.log are flushed and their cached
     * pages dropped before they are read (wal_settle, audit_open). */
    int settle_files;
    /* Polling queues with a ready completion, waiting for their signal (the wake cascade). */
    struct idem_queue *wake_head, *wake_tail;
    uint32_t notifying;          /* pins held on all queues (atomic; for tests) */
    uint32_t test_wake_delay_us; /* store_test_wake_delay */
    int test_no_tidy;            /* store_test_ages_tidy */
    int test_ages_no_grow;       /* tests: the age heaps cannot grow (out of memory) */
    /* Tests: called by the flusher after a step of filtering, with mu let go (ages_tidy), and
     * by store_let_others_in while it has let mu go. */
    void (*test_after_tidy)(idem_store *s);
    void (*test_let_go)(idem_store *s);
    int closing;
    int abandoned;    /* store_abandon: the flusher stops at once, nothing more is written */
    int no_wait;      /* idem_cancel_waits: claims answer busy at once */
    int ckpt_quiesce; /* a checkpoint waits for the log to be durable: no new appends */
    /* The flusher's checkpoint taken while changes go on (store.c, "Checkpoints in steps"). */
    struct {
        int state; /* CKPT_RUN_* */
        struct ckpt_writer *cw;
        uint64_t id, cursor;
        uint64_t seq, lsn, batch; /* the replay position: where the scan began */
        uint32_t off;
        uint64_t end_lsn; /* the log's last LSN when the scan ended; the counts are from then */
        uint64_t live_bytes, keys_by_state[3];
        /* Runs are numbered as they start; idem_checkpoint asks for one that starts after its
         * call (want_run) and waits until a run of at least that number is installed. */
        uint64_t run, runs_started, installed_run, want_run;
        uint64_t failures; /* runs that ended in an error that is not fatal (last_err) */
        int last_err;
        /* When the last run refused for space, descriptors or memory ended (0: the last run
         * did not): the flusher begins none of its own for a second after it. */
        int64_t failed_mono_ms;
        int by_test;        /* store_ckpt_step was called: the flusher steps only when asked */
        int test_step;      /* a step asked for and not yet taken */
        int test_rc;        /* what that step returned */
        int test_installed; /* and whether it installed a checkpoint */
    } ckr;
    uint64_t replay_counts_lsn; /* at open: frames up to this LSN leave the counts alone */
    /* Backups copying files with mu released (idem_backup): while any runs, no segment is
     * retired and no checkpoint started, so the files its image names stay in place. */
    int backups;
    int flushing;
    uint32_t frame_max;           /* the largest frame one change can append */
    int64_t spare_failed_mono_ms; /* last failed attempt at the spare segment (disk full) */
    uint64_t spare_failures; /* attempts at the spare segment refused for room (idem_compact) */
    /* Room kept for compaction and checkpoints (disk_reserve.h): let go when the log is at its
     * end on a full disk, looked after once a second (reserve_mono_ms). reserve.released refuses
     * new keys (ops.c, capacity_full). */
    struct disk_reserve reserve;
    int64_t reserve_mono_ms;
    int64_t super_failed_mono_ms; /* last token reservation that found no descriptor or memory */
    int sync_waiters;
    /* The flusher sleeps with nothing pending (up to a second): in batch and none modes the next
     * frame appended must wake it (store_appended in store.c). */
    int flusher_idle;
    int64_t last_flush_mono_ms;
    int64_t token_next;
    int64_t max_token_seen; /* the largest token in a record replayed at open */
    /* Repeat counters of keys claimed again since their last logged version (slot aux). */
    struct seen_info *seen_tier[SEEN_TIERS];       /* entries below SEEN_CHUNK */
    struct seen_info *seen_chunk[SEEN_CHUNKS_MAX]; /* from 1: entries from SEEN_CHUNK on */
    /* Entries allocated, entries ever taken, the first free entry's index + 1 (the list runs
     * through the entries); readers under rw's read side use atomics (read_seen_take). */
    uint32_t seen_cap, seen_used;
    uint32_t seen_free;
    /* Store clock. */
    int64_t clk_store_ms, clk_mono_ms, clk_last_ms; /* clk_last_ms: atomic under rw's read side */
    uint64_t reads_answered; /* claims answered under rw's read side (atomic; store_test_reads) */
    int clk_frozen;          /* inside idem_submit: the clock read at its start serves every op */
    int64_t clk_save_ms;     /* to be made durable: a move of the test clock, store_clock_need */
    int64_t clk_durable_ms;  /* the clock of the last END frame made durable (flush_once) */
    int clk_wanted;          /* clk_save_ms may need the superblock (flusher_save_clock) */
    int64_t mono_batch_ms;   /* the monotonic clock read at the start of that idem_submit */
    int find_corrupt;        /* the last ops_find met a damaged record with the key's hash bits */
    /* The last key hashed in this operation (ops_hash; only inside ops_apply). */
    int hash_cache_on;
    const void *hash_key;
    uint32_t hash_key_len;
    uint64_t hash_value;
    /* Parked WAIT claims, oldest first, and by key hash (waiters.c). */
    struct qslot *waiters, *waiters_tail;
    struct wbucket {
        struct qslot *head, *tail;
    } * wbuckets;
    uint32_t wbuckets_mask; /* buckets - 1 */
    uint32_t nwaiters;
    uint32_t nwake_again;      /* at least the parked claims with wake_again set */
    int64_t wake_due_mono_ms;  /* ops_wake_due's last look (monotonic ms) */
    int64_t wake_next_mono_ms; /* no parked claim is due before this (monotonic ms) */
    uint32_t sync_ops;         /* atomic: outstanding durable_wait slots (the flusher flushes) */
    struct idem_queue *queues;
    /* Audit trail. */
    struct io_file *audit_f;
    uint64_t audit_off;
    /* audit_off as of the last durable flush: units whose changes are durable (in the
     * superblock as audit_len, which audit_open holds the file to). */
    uint64_t audit_durable_off;
    uint64_t audit_alloc; /* audit.log has disk space reserved up to here (audit_reserve_n) */
    /* The trail's map (audit.c): the first unit of each stretch of the file, in file order. */
    struct audit_mark *audit_marks;
    size_t naudit_marks, audit_marks_cap;
    /* Entries of changes not yet in a batch (audit.c), the last numbered audit_pend_seq; and
     * those the flusher took with the batch it writes (audit_out_seq the last). */
    struct audit_buf audit_pend, audit_out;
    uint64_t audit_pend_seq, audit_out_seq;
    uint64_t audit_seq; /* the last entry written (kept in memory unless that ran out) */
    /* Scratch for encoding (compressed results). */
    uint8_t *scratch;
    size_t scratch_cap;
    idem_stats st;
    /* Claims per second of elapsed time over the last minute (ring of 60, by monotonic second). */
    struct {
        int64_t second;
        uint32_t claims, duplicates;
    } minute[60];
    /* Space: bytes of the frames the index points to; per segment slot, the largest
     * expires_at_ms of the frames written there (INT64_MAX: unknown). */
    uint64_t live_bytes;
    /* The sizes of the current checkpoint's file and the one before it, both kept (the disk
     * limit counts them: store_disk_bytes). */
    uint64_t ckpt_file_bytes[2];
    uint64_t memory_avail; /* util_memory_bytes at open: what the memory limits are checked by */
    int64_t *seg_max_exp;  /* SEG_EXP_UNKNOWN: written before this open, not measured yet */
    /* Per segment slot, its record bytes by when they expire (compact.c; NULL: none tallied). */
    struct seg_exp **seg_exp;
    /* Compaction from the oldest segment (compact.c). Segments wal_first_seq..cmp_walked
     * were walked and wait for a checkpoint to be retired; cmp_seq is being walked. */
    uint64_t cmp_seq;                         /* segment being walked, 0: none */
    uint32_t cmp_off;                         /* next frame in it */
    uint64_t cmp_walked;                      /* last walked segment, 0: none */
    uint64_t cmp_walked_lsn[STORE_CMP_AHEAD]; /* by seq % AHEAD: the log's last LSN at walk end */
    int cmp_disabled;                         /* a corrupt frame stopped compaction (reported) */
    int64_t cmp_walked_ms;                    /* store clock when the last walk ended */
    int cmp_turn;                             /* compaction's turn beside a checkpoint run */
    uint64_t cmp_force_until;                 /* idem_compact: walk every segment below this one */
    int cmp_room_full; /* the walk's last step stopped for want of disk room (IDEM_EFULL) */
    /* Store clock of the last new key refused by the key or memory limit (ops.c), and of the
     * last segment ended for that (compact.c); each valid once its _seen is set. cap_roll_lsn:
     * that segment's SEGEND, flushed durable at once (flush_asked) in durability none too. */
    int64_t cap_full_ms, cap_rolled_ms;
    int cap_full_seen, cap_rolled_seen;
    struct log_gate index_refused_said; /* event=full of an index that cannot grow */
    struct log_gate conflict_said;      /* event=conflicting_commit */
    uint64_t cap_roll_lsn;
    /* compact_learn_horizon's pass over segment hz_seq (0: none): up to hz_off, max hz_max. */
    uint64_t hz_seq;
    uint32_t hz_off;
    int64_t hz_max;
    struct seg_exp *hz_tally; /* the pass's tally of hz_seq, kept if the segment has none */
    /* Records that need attention, by kind (ages.c). */
    struct age_heap ages[3];
    int ages_hold;        /* replay with the counts left alone (ops_replay): no filtering */
    uint64_t ages_yields; /* times a stats call let mu go between steps of filtering (tests) */
    int test_sim;         /* the simulated disk: no lock file */
};

/* Opens a store over the given I/O backend (tests pass the simulated disk; the store takes
 * ownership of io and destroys it at close). */
int store_open_io(const char *dir, const idem_options *o, struct io *io, int simulated,
                  idem_store **out);

/* Whether the clock that must be durable (clk_save_ms: a move of the test clock, or the clock
 * that found a key expired, store_clock_need) is (mu or rw held). */
int store_clock_saved(const idem_store *s);
/* An answer holds only while the store clock is at least ms after a crash too (a key found
 * expired at ms): makes the store clock durable (mu held). Returns IDEM_EFATAL when it never
 * can be (a failed store in sync mode): the answer is not given. */
int store_clock_need(idem_store *s, int64_t ms);
/* Has the flusher make clk_save_ms durable, if it is not (mu held). */
void store_clock_want(idem_store *s);
/* Whether sl's completion waits for store_clock_saved (mu or rw held). */
int store_clock_waits(const idem_store *s, const struct qslot *sl);

/* Tests: stops the store as a crash would (no flush, no checkpoint) and frees it. Queues are
 * closed. Use io_sim_crash afterwards to drop what was not flushed. */
void store_abandon(idem_store *s);

/* Tests: has the flusher take the next step of a checkpoint in steps (starting one at the next
 * batch boundary if none runs) and waits for it. From the first call on, the flusher takes
 * steps only when asked (idem_checkpoint would wait for ever: do not mix them). Returns 0 when this
 * step installed the checkpoint, 1 while the run goes on (or has not started yet), or a negative
 * idem_err. */
int store_ckpt_step(idem_store *s);

/* Tests: the end of each flush waits `us` microseconds after letting go of the lock and before
 * it wakes the waiting threads (notify_ready_unlocked), so a test can act in between. */
void store_test_wake_delay(idem_store *s, uint32_t us);
/* Tests: the bytes q's slots hold in their buffers (copies of keys, results, parked claims). */
uint64_t store_test_queue_buf_bytes(const idem_queue *q);
/* Claims answered so far under rw's read side, without the store's lock. */
uint64_t store_test_reads(idem_store *s);
/* Tests: idem_exec's claims in a row that the read side did not find committed (store.c). */
uint32_t store_test_exec_read_misses(const idem_queue *q);
/* Lets mu go (held on entry and on return) long enough for a thread blocked on it to take it:
 * the mutex is not fair, and a thread that unlocks and locks again at once takes it back before
 * a woken waiter runs. */
void store_let_others_in(idem_store *s);
/* Tests: whether the flusher takes steps of the age heaps' filtering (ages_tidy; default on), so
 * that a test can watch what pushes alone do. */
void store_test_ages_tidy(idem_store *s, int on);

/* Tests: walks the whole index; every entry must name a decodable record whose key leads back
 * to it and that its kinds' age heaps hold, the per-state counts must match and the age heaps
 * be in heap order. IDEM_ECORRUPT on any fault. */
int store_check_index(idem_store *s, uint64_t *entries);

/* ---- store.c, for ops.c ---- */
int64_t store_now(idem_store *s);
/* The bytes of the store's files as the disk limit counts them: the log's segments, the two
 * checkpoints kept and audit.log with its reserved space (mu held). */
uint64_t store_disk_bytes(const idem_store *s);
int store_next_token(idem_store *s, int64_t *out);
void store_set_error(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
/* Ensures an append of one record will find buffer room, a segment and a token (may wait for
 * the flusher; look state up afterwards). Returns 0 or IDEM_EFATAL. With the disk full it
 * returns 0 and the append answers IDEM_EFULL, so reads and repeats go on. */
int store_room(idem_store *s);
int store_room_ok(idem_store *s);
/* Whether bytes more of a file beside the log (the audit trail's growth) leave, while the disk
 * reserve is let go, the checkpoints' room and a segment for the walk that frees space (store.c,
 * spare_make_kept): 1 when the reserve is held. mu held. */
int store_released_room_ok(idem_store *s, uint64_t bytes);
/* Waits (mu held, let go of meanwhile) until `bytes` of frames can be appended: 0, IDEM_EFULL
 * or the next segment's error (then the log cannot take them all), or IDEM_EFATAL. */
int store_room_for(idem_store *s, uint32_t bytes);
/* Marks the store failed (a write or flush failed, err a negative errno): nothing more is
 * acknowledged; completions not yet durable answer IDEM_EFATAL. */
void store_fail(idem_store *s, int err, const char *during);
/* The flusher (mu held, nothing in flight) lets go of mu for file I/O of its own: flushing
 * stays set meanwhile, so the ring stays the flusher's and no superblock is written by anyone
 * else (checkpoint_locked waits for it); callers go on applying operations.
 * store_flusher_relock takes mu back. */
/* What a write of an operator's import gets from the store's state: IDEM_EREADONLY,
 * IDEM_ECLOSED, IDEM_EFATAL, or 0 (mu held). */
static inline int store_import_refused(const idem_store *s)
{
    return s->opt.read_only ? IDEM_EREADONLY
           : s->closing     ? IDEM_ECLOSED
           : s->fatal       ? IDEM_EFATAL
                            : 0;
}

/* Sets what every superblock the open store writes carries from the moment (super.h): the audit
 * trail's durable length and the log's durable end (never lowered). mu held. */
void store_super_marks(idem_store *s, struct super *sb);
void store_flusher_unlock(idem_store *s);
void store_flusher_relock(idem_store *s);
void store_kick(idem_store *s);
/* A WAIT claim of q parks: sl leaves the outstanding list for the parked one. mu held. */
void queue_park(idem_queue *q, struct qslot *sl);
/* The parked claim of q with user_data (the first submitted of several), or NULL. mu held. */
struct qslot *queue_parked_of(const idem_queue *q, uint64_t user_data);
/* A parked claim completed: on the queue's woken list, for the next merge. mu held. */
void queue_unpark(idem_queue *q, struct qslot *sl);
/* Waits (mu held, letting it go) until everything appended so far is durable, and with it the
 * audit entries of those changes written. Returns 0 or IDEM_EFATAL. */
int store_wait_durable(idem_store *s);
/* Room for len more bytes at the end of the slot's buffer (not yet counted as used); earlier
 * copies are re-based if the buffer moves. NULL on ENOMEM. */
void *qslot_reserve(struct qslot *sl, size_t len);
/* Copies bytes into the slot's buffer; returns the copy (NULL on ENOMEM). */
const void *qslot_copy(struct qslot *sl, const void *p, size_t len);

/* Counts one claim answer (outcome) in the last-minute ring. */
void store_count_claim(idem_store *s, int outcome);

/* ---- ops.c ---- */
/* Applies op under mu; fills sl->c and sl->need_lsn, or parks the slot (WAIT). */
/* An index slot's aux: the low 31 bits are 1 + the key's entry in the seen table (0: none);
 * the top bit marks a record kept apart for attention (unfinished, or with mismatches), so a
 * checkpoint writes its entries without reading the log. */
#define SLOT_AUX_APART 0x80000000u
#define SLOT_AUX_SEEN  0x7fffffffu
_Static_assert((uint64_t)SEEN_CHUNKS_MAX *SEEN_CHUNK <= SLOT_AUX_SEEN, "seen index + 1 fits");
/* Sets slot's apart bit from r, the record it now points to. */
void ops_slot_mark(struct index_slot *slot, const struct rec *r);

void queue_signal(struct idem_queue *q);
/* Applies op; hash, when given, is its key's hash from ops_hint_hash. room_made: op belongs to
 * a group of deletes whose room in the log and the audit trail was made (del_group_begin): it
 * does not wait for room, nor let go of the lock. */
void ops_apply(idem_store *s, struct qslot *sl, const idem_op *op, const uint64_t *hash,
               int room_made);

/* One hold of rw's read side (ops.c, "Claims of committed keys under rw's read side"): the
 * store clock's reading its claims share, its place in the claims of the last minute, and its
 * tallies, added to the store's counters at its end. */
struct read_run {
    idem_queue *q; /* whose claims: the repeat counter entries it took ahead */
    int64_t now;
    int minute;
    uint64_t done, counted; /* claims answered; those without an error */
};
/* A claim ops_read_find can answer: its key's slot, the version found (pointing into the log:
 * valid while rw is held) and its LSN. */
struct read_hit {
    struct index_slot *slot;
    struct rec r;
    uint64_t lsn;
};
/* With rw's read side held: whether claims can be answered now (0: leave them to the locked
 * path), then whether op is such a claim (filling hit; hash as for ops_apply), its answer, and
 * the run's tallies. */
int ops_read_begin(idem_store *s, struct read_run *run);
int ops_read_find(const idem_store *s, const idem_op *op, const uint64_t *hash,
                  const struct read_run *run, struct read_hit *hit);
void ops_read_answer(idem_store *s, struct qslot *sl, const struct read_hit *hit,
                     struct read_run *run);
void ops_read_end(idem_store *s, const struct read_run *run);
/* A group of deletes (IDEM_F_WITH_NEXT): 0 to go ahead, IDEM_EINVAL if one of the n deletes is
 * invalid, IDEM_ESTATE if one of their records is in_flight or review; and the completion of
 * one of them when the group is refused. mu held. */
int ops_del_group_check(idem_store *s, const idem_op *ops, size_t n);
void ops_del_group_refuse(idem_store *s, struct qslot *sl, const idem_op *op);
/* The hash op's key will be looked up with (0: the key is not valid; no hint). */
int ops_hint_hash(const idem_store *s, const idem_op *op, uint64_t *h);
/* Starts loading what a lookup that finds slot reads: the record's frame and its repeat counters.
 */
void ops_prefetch_record(const idem_store *s, const struct index_slot *slot);
/* Re-runs the parked claims of key (all keys when key == NULL), and those whose deadline or
 * awaited lease end has come: those that no longer get busy, or whose deadline passed,
 * complete. */
void ops_wake(idem_store *s, const void *key, uint32_t key_len);
/* Re-runs the parked claims whose WAIT deadline or awaited lease end has come (mu held), at most
 * once per millisecond: for a flusher that is never idle under steady writes. */
void ops_wake_due(idem_store *s);
/* waiters.c (mu held). Parks sl under its key's hash h: 0, or -1 without memory. */
int waiters_add(idem_store *s, struct qslot *sl, uint64_t h);
void waiters_remove(idem_store *s, struct qslot *sl);
/* The first claim parked in h's bucket (then bnext): those of keys with hash h among them. */
struct qslot *waiters_of_hash(const idem_store *s, uint64_t h);
/* Lowers wake_next_mono_ms to the moment sl's deadline or lease end may come. */
void waiters_note_due(idem_store *s, const struct qslot *sl, int64_t mono, int64_t now);
void waiters_free(idem_store *s);
/* Replay of one log frame into the index (recovery). */
int ops_replay(void *ctx, const struct wal_frame *f);
/* Looks up key; returns the slot and fills *r and *lsn, or NULL: absent, or (find_corrupt set)
 * a damaged record that may be this key's, which callers report as IDEM_ECORRUPT. */
struct index_slot *ops_find(idem_store *s, const void *key, uint32_t key_len, struct rec *r,
                            uint64_t *lsn);
uint64_t ops_hash(idem_store *s, const void *key, uint32_t key_len);
void ops_fill_record(struct qslot *sl, const struct rec *r, struct index_slot *slot, idem_store *s);
/* Whether r expired at now: only a committed record expires (rule 5). */
int ops_rec_expired(const struct rec *r, int64_t now);
/* Whether r is unfinished (in_flight or review) and past its ttl at now. Such a record never
 * expires while unfinished (rule 5): while it is its key's version, the tallies that decide
 * compaction count it as never expiring, or its segment looks due at once and a walk copies it
 * forward again and again. */
static inline int ops_rec_unfinished_past_ttl(const struct rec *r, int64_t now)
{
    return r->state != IDEM_STATE_COMMITTED && r->expires_at_ms <= now;
}
void ops_seen_release(idem_store *s, struct index_slot *slot);
/* Gives the repeat counter entries q took ahead back to the free list (mu held). */
void ops_seen_return(idem_store *s, idem_queue *q);
/* The tier of repeat counter i < SEEN_CHUNK, and where that tier begins. */
static inline uint32_t store_seen_tier(uint32_t i)
{
    return i >> SEEN_TIER0_BITS ? 32u - (uint32_t)__builtin_clz(i) - SEEN_TIER0_BITS : 0;
}
static inline uint32_t store_seen_tier_base(uint32_t t)
{
    return t ? 1u << (t + SEEN_TIER0_BITS - 1) : 0;
}
static inline struct seen_info *store_seen_at(const idem_store *s, uint32_t i)
{
    if (i >= SEEN_CHUNK) return &s->seen_chunk[i >> SEEN_CHUNK_BITS][i & (SEEN_CHUNK - 1)];
    uint32_t t = store_seen_tier(i);
    return &s->seen_tier[t][i - store_seen_tier_base(t)];
}
/* Sets the repeat counters of the key in slot (allocating its seen entry). */
int ops_seen_set(idem_store *s, struct index_slot *slot, uint64_t seen_count, int64_t last_ms);

/* A frame of a walked segment, decoded and its key hashed some frames before its turn, so the
 * cache misses of several index lookups overlap (ops_compact_prepare starts the load). */
struct cmp_frame {
    struct wal_frame f;
    struct rec r; /* records only */
    uint64_t h;   /* the key's hash (records only) */
};
/* Decodes cf->f and prefetches its key's index slot. Returns 0, or IDEM_ECORRUPT. */
int ops_compact_prepare(idem_store *s, struct cmp_frame *cf);
/* Compacts one prepared frame: copies a live record (one the index holds by this address)
 * forward, logs the removal of an expired one, skips a dead one. */
int ops_compact_frame(idem_store *s, const struct cmp_frame *cf, int64_t now);
/* Whether the index holds the record at addr as its key's version (mu held). */
int ops_record_live(idem_store *s, const void *key, uint32_t key_len, uint64_t addr);

/* ---- compact.c (flusher thread, mu held, no batch in flight) ---- */
/* Record bytes of a segment by when they expire, d ms after t0: bucket 0 at or before t0, 1..7
 * at t0 + 1..7 ms, then eight buckets for each power of two 2^k <= d < 2^(k+1) (k from 3 to
 * 38: 2^39 ms is 17 years, past IDEM_TTL_MS_MAX), each an eighth of it wide, the last never
 * (an unfinished record) or later still. A segment is walked once half its bytes have expired, or
 * an eighth while the capacity limits press (compact.c), whatever the few long-lived records among
 * them; a bucket counts as expired once all of it has, at most an eighth of its offset late. (Until
 * the forty-second session the buckets ended at 2^31 ms, 24.8 days: keys of a month never
 * counted as expired.) */
#define SEG_EXP_SUBS    8
#define SEG_EXP_OCTAVES 36
#define SEG_EXP_BUCKETS (SEG_EXP_SUBS + SEG_EXP_SUBS * SEG_EXP_OCTAVES + 1)
_Static_assert((int64_t)IDEM_TTL_MS_MAX < (INT64_C(1) << (3 + SEG_EXP_OCTAVES)),
               "every TTL has an expiry bucket of its own");
struct seg_exp {
    int64_t t0;
    uint64_t total; /* the sum of bytes[] */
    uint64_t bytes[SEG_EXP_BUCKETS];
};
/* Counts a frame of `bytes` expiring at exp, written to segment seq (mu held; any thread). */
void compact_tally(idem_store *s, uint64_t seq, int64_t exp, uint64_t bytes);
/* Frees the tallies (close). */
void compact_free(idem_store *s);
/* One bounded step of space reclamation; returns 1 when it did work, 0 when there was none,
 * or a negative idem_err when a write failed (fatal). */
int compact_step(idem_store *s);
/* Measures the expiry horizon of the segment the walk takes next, when it was written before this
 * open and is not known yet: one pass over its frames, a sixteenth of the segment per call with mu
 * let go meanwhile, so flushes go on between calls. Returns 1 when it read some. */
int compact_learn_horizon(idem_store *s);
/* Whether the flusher should write a checkpoint now (log length since the last one, or walked
 * segments waiting to be retired: see the function). */
int compact_wants_checkpoint(idem_store *s);
/* Whether the walk stopped for want of disk room with no walked segment left in the log (none
 * waits for a checkpoint, its retirement or a backup's end) and no retired file waiting for the
 * remover: nothing the store does frees room then (idem_compact). mu held. */
int compact_stopped_full(idem_store *s);
/* Once the closing checkpoint is installed, retires the walked segments it covers (else the
 * next open, which forgets the walk, walks them again). A superblock of its own, after the
 * checkpoint's, as the flusher's retirements: the older copy, used if the newer one rots,
 * then replays from the checkpoint, past the segments. Mu held throughout. */
int compact_retire_closing(idem_store *s);

/* ---- ages.c ---- */
/* Version r of a key (hash h) was written (or found, at load) at addr: remember it if it
 * belongs to a kind (unfinished, or with mismatches). */
void ages_note(idem_store *s, const struct rec *r, uint64_t h, uint64_t addr);
/* Room in the heaps ages_note would put r's version in, made before the change that writes
 * it: 0, or IDEM_ENOMEM (nothing may change then: a version left out of its heap would be
 * missing from the attention list and the oldest ages until the store is reopened). */
int ages_room(idem_store *s, const struct rec *r);
/* Filters kind's heap if it is past its bound, in steps of AGES_VIEW_STEP with mu let go
 * between them (held on entry and on return, released meanwhile): before ages_oldest. */
void ages_settle(idem_store *s, int kind);
/* The time (first_seen, or last_mismatch for AGE_MISMATCH) of the oldest of kind, 0 if none;
 * mu held throughout (a heap still past its bound is filtered at once). */
int64_t ages_oldest(idem_store *s, int kind);
/* On the flusher, under mu: one step of filtering each heap past its bound (a burst of claims
 * committed since pushes nothing to carry a pass). Returns whether it did work. */
int ages_tidy(idem_store *s);
/* For a view that checks entries in steps, with mu let go between them (idem_attention):
 * ages_copy (mu held) copies kind's entries into v (room for ages_size of them) and returns
 * how many. ages_order (no lock needed) sorts a copy by time and drops repeated entries.
 * ages_entry_addr and ages_entry_hash give an entry's log address and its 40 hash bits
 * (index_slots_like finds the key's slot by them); ages_fits tells whether version r has the
 * kind and the entry's time. */
size_t ages_size(const idem_store *s, int kind);
size_t ages_copy(const idem_store *s, int kind, struct age_entry *v);
void ages_order(struct age_entry *v, size_t *n);
uint64_t ages_entry_addr(const struct age_entry *e);
uint64_t ages_entry_hash(const struct age_entry *e);
int ages_fits(int kind, const struct rec *r, const struct age_entry *e);
/* Whether version r may be of the same record as entry e of kind (the same first_seen; any
 * version for AGE_MISMATCH, whose time moves with each mismatch recorded). */
int ages_same_record(int kind, const struct rec *r, const struct age_entry *e);
/* The entry a version r of kind at addr (key hash h) was pushed as, and the order of a sorted
 * copy (ages_order), for a search in it. */
struct age_entry ages_entry_of(int kind, const struct rec *r, uint64_t h, uint64_t addr);
int ages_entry_cmp(const void *a, const void *b);
/* For the consistency check, under mu: whether every heap is in heap order, and the log
 * addresses a heap holds, sorted (malloc'd, NULL when out of memory or empty). */
bool ages_ordered(const idem_store *s);
uint64_t *ages_sorted_addrs(const idem_store *s, int kind, size_t *n);
void ages_free(idem_store *s);

/* ---- audit.c ---- */
int audit_open(idem_store *s);
void audit_close(idem_store *s);
/* The trail's memory: its map (marks and key filters, about 8 KiB a MiB of trail) and buffers. */
uint64_t audit_memory_bytes(const idem_store *s);
/* Makes room for one entry (an operator call, before its change: audit_append cannot fail
 * after it). Returns 0 or IDEM_ENOMEM. */
int audit_reserve(idem_store *s);
/* The same for n entries (a group of deletes, made before any of them). */
int audit_reserve_n(idem_store *s, uint32_t n);
/* The bytes an entry keeps of a result of full bytes: its first ones, up to
 * IDEM_AUDIT_RESULT_KEPT. */
static inline uint32_t audit_result_kept(uint32_t full)
{
    return full < IDEM_AUDIT_RESULT_KEPT ? full : IDEM_AUDIT_RESULT_KEPT;
}
/* An entry as audit_append takes it (strings NUL-terminated but reason, which is reason_len
 * bytes; with IDEM_AUDIT_RESULT in flags, result holds at least the first
 * audit_result_kept(result_full) bytes of a result of result_full bytes). */
struct audit_in {
    const char *actor, *action;
    const void *key;
    uint32_t key_len;
    const void *reason;
    uint32_t reason_len;
    int state_before, state_after;
    uint64_t version_before, version_after;
    uint32_t flags;
    const void *result;
    uint32_t result_full;
};
/* Adds the entry of a change just appended to the log, to be written before the batch that
 * carries the change. */
void audit_append(idem_store *s, const struct audit_in *e, uint64_t lsn);
/* The flusher, as it closes a batch (mu held): takes the pending entries; returns their bytes. */
size_t audit_take(idem_store *s);
/* Writes and flushes what audit_take took (mu not held; only the flusher calls it). */
int audit_write_taken(idem_store *s);
/* mu held again: rc 0 (the entries and their batch written) keeps the entries in memory;
 * either way the taken ones are done. */
void audit_taken_done(idem_store *s, int rc);
/* The file's units (shared with verify.c). The bytes of the unit whose first block is blk (0:
 * not a unit); the number of entries of a unit of `bytes` bytes; the next entry of a unit from
 * *pos (0 at the start): 1 with *entry set, 0 at the end. Both answer AUDIT_TORN when a
 * checksum fails (a torn or damaged write) and AUDIT_BAD when lengths disagree under a
 * checksum that holds (never torn: corruption). */
#define AUDIT_TORN (-1)
#define AUDIT_BAD  (-2)
uint32_t audit_unit_bytes(const uint8_t *blk);
int audit_unit_valid(const uint8_t *u, uint32_t bytes);
int audit_unit_next(const uint8_t *u, uint32_t bytes, uint32_t *pos, const uint8_t **entry);
/* Whether the unit whose first block is blk is a group (its header's magic). */
bool audit_unit_is_group(const uint8_t *blk);
/* After a unit that ends the trail (torn, or naming changes the log lacks), whether the block
 * blk may start a unit of its own: a group's header may; an entry inside a group that happens
 * to start on a block boundary has the form of a one-entry unit of earlier versions, so one
 * counts only where no group came before it (groups_seen false) and it is zero-padded to the
 * block's end, as those units were. */
bool audit_block_may_start(const uint8_t *blk, bool groups_seen);
/* The length (8 + len) of the entry at p if its lengths agree and it fits in avail, else 0. */
uint32_t audit_entry_bytes(const uint8_t *p, size_t avail);

/* ---- The store's lock (see the top of this file) ---- */

static inline void store_lock(idem_store *s)
{
    pthread_mutex_lock(&s->mu);
    pthread_rwlock_wrlock(&s->rw);
}

static inline void store_unlock(idem_store *s)
{
    pthread_rwlock_unlock(&s->rw);
    pthread_mutex_unlock(&s->mu);
}

/* A submit that waited with the lock let go reads the clock again, and freezes it anew. */
void store_clock_refreeze(idem_store *s);

/* pthread_cond_wait on c with the store's lock: readers may come in while it waits. A clock
 * frozen for a submitted batch (clk_frozen) thaws meanwhile: whoever takes the lock then reads
 * it afresh (a reading as old as the wait would let a commit miss the expiry it crosses). */
static inline void store_wait(idem_store *s, pthread_cond_t *c)
{
    int frozen = s->clk_frozen;
    s->clk_frozen = 0;
    pthread_rwlock_unlock(&s->rw);
    pthread_cond_wait(c, &s->mu);
    pthread_rwlock_wrlock(&s->rw);
    if (frozen) store_clock_refreeze(s);
}

static inline int store_timedwait(idem_store *s, pthread_cond_t *c, const struct timespec *ts)
{
    pthread_rwlock_unlock(&s->rw);
    int rc = pthread_cond_timedwait(c, &s->mu, ts);
    pthread_rwlock_wrlock(&s->rw);
    return rc;
}

#endif
