/*
 * compact.c: space reclamation and expiry sweeping, in log order.
 *
 * Segments are walked from the oldest, frame by frame, a bounded number per step on the
 * flusher thread: a record the index still points to is copied forward unchanged (first_seen,
 * token, version and all), an expired committed record is removed with a logged DELETE, anything
 * else is dead. Working strictly in log order keeps deletion safe: when a frame is walked, every
 * older version of its key was in a segment walked before, which is retired no later than it.
 *
 * Walked segments wait (up to STORE_CMP_AHEAD of them) and are retired oldest first, superblock
 * first, then the files, once (a) the copies and deletes their walk caused are durable and (b)
 * the installed checkpoint was begun after their walk ended, so neither its image nor a run
 * begun since points at a frame of them, and replay starts after them, and (c) no backup is
 * copying (s->backups: the copy reads the segments from its superblock's on). The next segment is
 * walked meanwhile, so one checkpoint retires every segment walked before it began. A checkpoint
 * (a scan of the whole index) is asked for once STORE_CKPT_RETIRE_BATCH segments wait, or once
 * no walk has ended for STORE_CKPT_QUIET_MS of store time (compact_wants_checkpoint).
 *
 * When: the next segment is walked if the log, less the walked segments, holds more than twice
 * the live bytes (plus slack of STORE_CMP_SLACK_SEGS segments), or every record written to it
 * has passed its expires_at (its records are all expired or unfinished), or half its record
 * bytes have (an eighth while the key or memory limit refuses new keys, when the current
 * segment is ended for a walk too: roll_for_capacity), or half those of it and the sealed segments
 * after it (64 at most) together (the tally of struct seg_exp: a few long-lived records in every
 * segment, counted live with the expired ones, would otherwise keep every walk back for their whole
 * life, and the expired keys in the index and the log with them). The log, less the walked segments
 * waiting for a checkpoint (STORE_CMP_AHEAD at most), thus stays within about 2x the live bytes,
 * and expired keys leave memory as the log turns over (design.md section 9 lists when the bound
 * does not hold).
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "remover.h"
#include "store.h"
#include "util.h"

#define STORE_CMP_FRAMES_PER_STEP 512
/* A step also ends past this many bytes of frames: each is checksummed and maybe copied under
 * the lock, and 512 frames of 1 MiB results held it for 170-200 ms (a helper's probe). */
#define STORE_CMP_BYTES_PER_STEP (1u << 20)
#define STORE_CMP_LOOKAHEAD      8 /* frames prepared at once: their index misses overlap */
#define STORE_CMP_SLACK_SEGS     2
#define STORE_CKPT_RETIRE_BATCH  4    /* walked segments one checkpoint retires under load */
#define STORE_CKPT_QUIET_MS      5000 /* else the walk has stopped this long */

#define HORIZON_STEPS 16              /* compact_learn_horizon reads a segment in this many calls */
#define WALK_WINDOW   STORE_CMP_AHEAD /* segments whose expired bytes together start a walk */
/* A new key refused by the key or memory limit this recently (store time) presses compaction:
 * a walk starts once an eighth of the bytes are expired instead of half, and the current
 * segment is ended for it, at most once a second. (The memory limit refuses only a key whose
 * insert would grow the index: slots that expired keys leave are used again.) */
#define PRESSED_MS      10000
#define PRESSED_ROLL_MS 1000

/* The bucket of an expiry d ms after the tally's t0 (struct seg_exp). */
static int tally_bucket(int64_t d)
{
    if (d <= 0) return 0;
    if (d < SEG_EXP_SUBS) return (int)d;
    int k = 63 - __builtin_clzll((uint64_t)d); /* 2^k <= d < 2^(k+1), k >= 3 */
    if (k >= 3 + SEG_EXP_OCTAVES) return SEG_EXP_BUCKETS - 1;
    return SEG_EXP_SUBS + (k - 3) * SEG_EXP_SUBS + (int)((d >> (k - 3)) & (SEG_EXP_SUBS - 1));
}

/* The offset from t0 at which every expiry in bucket b (not the last) has come. */
static int64_t tally_bucket_done(int b)
{
    if (b < SEG_EXP_SUBS) return b;
    int k = 3 + (b - SEG_EXP_SUBS) / SEG_EXP_SUBS, sub = (b - SEG_EXP_SUBS) % SEG_EXP_SUBS;
    return ((int64_t)(SEG_EXP_SUBS + sub + 1) << (k - 3)) - 1;
}

static void tally_add(struct seg_exp *e, int64_t exp, uint64_t bytes)
{
    e->bytes[exp == INT64_MAX ? SEG_EXP_BUCKETS - 1 : tally_bucket(exp - e->t0)] += bytes;
    e->total += bytes;
}

void compact_tally(idem_store *s, uint64_t seq, int64_t exp, uint64_t bytes)
{
    struct seg_exp **e = &s->seg_exp[seq % WAL_SEG_SLOTS];
    if (!*e) {
        *e = calloc(1, sizeof **e);
        if (!*e) return; /* no tally: the other rules decide for this segment */
        /* The clock now; while an open replays (the clock not started yet), the superblock's:
         * any t0 at or before the frames' writing is right, a later one only less precise. */
        int64_t now = __atomic_load_n(&s->clk_last_ms, __ATOMIC_RELAXED);
        (*e)->t0 = now ? now : s->sb.store_clock_ms;
    }
    tally_add(*e, exp, bytes);
}

/* Adds e's bytes to *total, and those certainly expired at now to *expired. */
static void tally_expired(const struct seg_exp *e, int64_t now, uint64_t *expired, uint64_t *total)
{
    *total += e->total;
    /* Buckets in order of time: the first one not all expired ends the sum (a walk decision is
     * made on every flusher round, over up to 64 segments). */
    for (int b = 0; b < SEG_EXP_BUCKETS - 1 && e->t0 + tally_bucket_done(b) <= now; b++)
        *expired += e->bytes[b];
}

static void tally_forget(idem_store *s, uint64_t seq)
{
    free(s->seg_exp[seq % WAL_SEG_SLOTS]);
    s->seg_exp[seq % WAL_SEG_SLOTS] = NULL;
}

void compact_free(idem_store *s)
{
    for (uint32_t i = 0; s->seg_exp && i < WAL_SEG_SLOTS; i++)
        free(s->seg_exp[i]);
    free(s->seg_exp);
    free(s->hz_tally);
}

/* An unfinished record past its ttl met by the measuring pass: whether it counts as expired
 * depends on whether it is still its key's version, which the index says (with mu held). */
struct hz_unfinished {
    uint64_t addr;
    const void *key; /* in the segment's map, which stays (compact_learn_horizon) */
    uint32_t key_len, bytes;
    int64_t exp;
};
#define HZ_UNFINISHED_MAX 64 /* view_horizon stops early once it has set aside this many */

struct hz_pass {
    int64_t now, max;
    struct seg_exp *tally; /* NULL: none (out of memory) */
    struct hz_unfinished unf[HZ_UNFINISHED_MAX];
    int n_unf;
};

static void hz_count(struct hz_pass *p, int64_t exp, uint64_t bytes)
{
    if (exp > p->max) p->max = exp;
    if (p->tally) tally_add(p->tally, exp, bytes);
}

/* The largest expires_at_ms of the records of a sealed segment, one read-only pass over its
 * frames, no copy, from *off until *off passes `until`: 1 at the segment's end, 0 to go on,
 * -1 at a broken chain (the walk meets it and reports it). Unfinished records past their ttl
 * are left in p->unf for hz_settle. */
static int view_horizon(const struct wal_seg_view *v, uint32_t *off, uint64_t until,
                        struct hz_pass *p)
{
    struct wal_frame f;
    int more = 1;
    while (more == 1 && *off < until && p->n_unf < HZ_UNFINISHED_MAX) {
        more = wal_view_next(v, off, &f);
        if (more != 1 || f.type != WAL_T_RECORD) continue;
        uint64_t bytes = (uint64_t)f.payload_len + WAL_FRAME_HDR;
        struct rec r; /* one that does not decode counts as never expiring: kept, not judged */
        if (rec_decode(f.payload, f.payload_len, &r) < 0) {
            hz_count(p, INT64_MAX, bytes);
        } else if (ops_rec_unfinished_past_ttl(&r, p->now)) {
            p->unf[p->n_unf++] = (struct hz_unfinished){.addr = f.addr,
                                                        .key = r.key,
                                                        .key_len = r.key_len,
                                                        .bytes = (uint32_t)bytes,
                                                        .exp = r.expires_at_ms};
        } else {
            hz_count(p, r.expires_at_ms, bytes);
        }
    }
    return more == 1 ? 0 : more < 0 ? -1 : 1;
}

/* Counts the unfinished records past their ttl that view_horizon met (mu held): one that is
 * still its key's version never expires while unfinished (rule 5) and counts as never expiring,
 * as version_moved counts the copies of such records; a dead version counts by its ttl. Counted
 * by the ttl, a live one made its segment due after every open, and each open copied it again. */
static void hz_settle(idem_store *s, struct hz_pass *p)
{
    for (int i = 0; i < p->n_unf; i++) {
        const struct hz_unfinished *u = &p->unf[i];
        int live = ops_record_live(s, u->key, u->key_len, u->addr);
        hz_count(p, live ? INT64_MAX : u->exp, u->bytes);
    }
    p->n_unf = 0;
}

/* The segment the walk takes next. */
static uint64_t walk_next(idem_store *s)
{
    return s->cmp_walked ? s->cmp_walked + 1 : wal_first_seq(s->wal);
}

/* Whether a new key met the key or memory limit lately (ops.c): the expired records then take
 * places that new keys want, and a walk pays for fewer of them. */
static int capacity_pressed(const idem_store *s, int64_t now)
{
    return s->cap_full_seen && now - s->cap_full_ms < PRESSED_MS;
}

int compact_learn_horizon(idem_store *s)
{
    if (s->fatal || s->closing || s->opt.read_only || s->cmp_disabled || s->cmp_seq) return 0;
    /* The next segment to walk; while a capacity limit presses, the first sealed one not
     * measured yet from it on (one under way first): walk_wanted judges the next together
     * with those after it by their tallies, and measuring the next alone left expired keys
     * behind a segment of live ones unreclaimed after a reopen, until the live ones expired.
     * Unpressed, the segments after it are left unread (a read of each after every open). */
    uint64_t seq = walk_next(s), first = wal_first_seq(s->wal);
    if (s->cap_full_seen && capacity_pressed(s, store_now(s))) {
        if (s->hz_seq > seq && s->seg_max_exp[s->hz_seq % WAL_SEG_SLOTS] == SEG_EXP_UNKNOWN)
            seq = s->hz_seq;
        while (s->seg_max_exp[seq % WAL_SEG_SLOTS] != SEG_EXP_UNKNOWN &&
               seq + 1 < wal_cur_seq(s->wal) && seq + 1 - first < STORE_CMP_AHEAD)
            seq++;
    }
    int64_t *m = &s->seg_max_exp[seq % WAL_SEG_SLOTS];
    if (*m != SEG_EXP_UNKNOWN || seq - wal_first_seq(s->wal) >= STORE_CMP_AHEAD ||
        !wal_seg_durable(s->wal, seq, s->durable_lsn))
        return 0;
    if (s->hz_seq != seq) {
        s->hz_seq = seq;
        s->hz_off = WAL_BLOCK;
        s->hz_max = SEG_EXP_EMPTY;
        if (!s->hz_tally) s->hz_tally = malloc(sizeof *s->hz_tally);
        if (s->hz_tally) {
            memset(s->hz_tally, 0, sizeof *s->hz_tally);
            s->hz_tally->t0 = store_now(s);
        }
    }
    struct wal_seg_view v;
    wal_seg_view(s->wal, seq, &v);
    uint32_t off = s->hz_off;
    struct hz_pass p = {.now = store_now(s), .max = s->hz_max, .tally = s->hz_tally};
    /* The segment stays mapped while mu is let go: segments are retired by the flusher (this
     * thread) and at close (compact_retire_closing, perhaps meanwhile), only those walked, all
     * before this one. The pass's tally is this thread's alone. The records set aside are
     * settled with mu taken again, 64 at a time. */
    uint64_t until = (uint64_t)off + v.seg_bytes / HORIZON_STEPS;
    int done;
    store_unlock(s);
    do {
        done = view_horizon(&v, &off, until, &p);
        if (p.n_unf) {
            store_lock(s);
            hz_settle(s, &p);
            store_unlock(s);
        }
    } while (done == 0 && off < until);
    store_lock(s);
    s->hz_off = off;
    s->hz_max = p.max;
    if (done != 0) {
        *m = done < 0 ? SEG_EXP_EMPTY : p.max;
        s->hz_seq = 0;
        struct seg_exp **e = &s->seg_exp[seq % WAL_SEG_SLOTS];
        if (done > 0 && !*e) { /* the segment's tally is the pass's (none was written since) */
            *e = s->hz_tally;
            s->hz_tally = NULL;
        }
    }
    return 1;
}

/* Whether a walk over `total` record bytes, `expired` of them expired, reclaims enough: at least
 * as much as it copies, or an eighth while the capacity limits press. */
static int expired_enough(uint64_t expired, uint64_t total, int pressed)
{
    return total && (pressed ? expired >= total - total / 8 * 7 : expired >= total - total / 2);
}

/* Whether segment seq, the next after those walked already, should be walked now. */
static int walk_wanted(idem_store *s, uint64_t seq)
{
    uint64_t first = wal_first_seq(s->wal);
    if (seq - first >= STORE_CMP_AHEAD) return 0; /* enough wait for a checkpoint */
    if (!wal_seg_durable(s->wal, seq, s->durable_lsn))
        return 0; /* the segment must be sealed and every frame of it durable */
    if (seq < s->cmp_force_until) return 1; /* idem_compact asked for it */
    /* Walked segments hold nothing live any more: they only wait to be retired. */
    uint64_t seg = s->opt.segment_bytes, walked = (seq - first) * seg;
    if (wal_bytes(s->wal) - walked > 2 * s->live_bytes + STORE_CMP_SLACK_SEGS * seg) return 1;
    /* Not measured yet (written before this open): compact_learn_horizon does, first. */
    int64_t now = store_now(s), horizon = s->seg_max_exp[seq % WAL_SEG_SLOTS];
    if (horizon == SEG_EXP_UNKNOWN) return 0; /* nor by the segments after it */
    if (horizon <= now) return 1;
    /* Half expired: the segment seq, or the sealed segments from it up to some later one
     * together (by their expiry tallies), have at least half their bytes expired, so a walk
     * to there reclaims at least as much as it copies. Long-lived records mixed in (one in
     * ten, or one in three) then hold no expired ones back, nor does a segment of copies of
     * them (walks write those) hold back the segments behind it. Waiting until all but a
     * sixteenth had expired, keys of 1 s mixed one in ten with keys of a day were never swept. */
    uint64_t expired = 0, total = 0;
    int pressed = capacity_pressed(s, now);
    for (uint64_t q = seq; q < seq + WALK_WINDOW && wal_seg_durable(s->wal, q, s->durable_lsn);
         q++) {
        if (!s->seg_exp[q % WAL_SEG_SLOTS]) continue;
        tally_expired(s->seg_exp[q % WAL_SEG_SLOTS], now, &expired, &total);
        if (expired_enough(expired, total, pressed)) return 1;
    }
    return 0;
}

/* Ends the current segment (wal_roll) when a capacity limit presses and the segments from the next
 * one to walk through the current one hold enough expired bytes together (the current one
 * counted: a walk takes only sealed segments), or the current one was written before this open
 * (its tally is not known): else a store whose records fit in one segment never walks them, and
 * at max_keys answers FULL among expired keys for good (nothing new is written to fill the
 * segment), nor does one whose expired keys are in the current segment behind sealed segments
 * of live ones. The walk then goes by walk_wanted. In durability none the end is made durable
 * at the next flush (cap_roll_lsn, flush_asked), or the walk would wait for it. Returns 1 when
 * it rolled. */
static int roll_for_capacity(idem_store *s, uint64_t next)
{
    if (!s->cap_full_seen) return 0; /* no clock read on every round of an unpressed store */
    uint64_t cur = wal_cur_seq(s->wal);
    int64_t now = store_now(s);
    if (!capacity_pressed(s, now) || cur - next >= WALK_WINDOW ||
        cur - wal_first_seq(s->wal) >= STORE_CMP_AHEAD)
        return 0;
    if (s->cap_rolled_seen && now - s->cap_rolled_ms < PRESSED_ROLL_MS) return 0;
    uint64_t expired = 0, total = 0;
    int cur_unknown = 0;
    for (uint64_t q = next; q <= cur; q++) {
        /* A sealed one not durable: in durability none nothing makes it so while new keys are
         * refused (nothing is written), so a flush is asked for (flush_asked); then its turn
         * comes. One not measured yet: its turn comes without a roll. */
        if (q < cur && !wal_seg_durable(s->wal, q, s->durable_lsn)) {
            if (s->cap_roll_lsn < wal_last_lsn(s->wal)) s->cap_roll_lsn = wal_last_lsn(s->wal);
            return 0;
        }
        if (s->seg_max_exp[q % WAL_SEG_SLOTS] == SEG_EXP_UNKNOWN) {
            if (q < cur) return 0;
            cur_unknown = 1; /* the current one, written before this open */
        } else if (s->seg_exp[q % WAL_SEG_SLOTS]) {
            tally_expired(s->seg_exp[q % WAL_SEG_SLOTS], now, &expired, &total);
        }
    }
    if (!cur_unknown && !expired_enough(expired, total, 1)) return 0;
    if (store_room_ok(s) != 0 || wal_roll(s->wal) != 1) return 0; /* tried again later */
    s->cap_rolled_seen = 1;
    s->cap_rolled_ms = now;
    s->cap_roll_lsn = wal_last_lsn(s->wal);
    fprintf(stderr, "idem: event=segment_ended_for_capacity segment=%llu\n",
            (unsigned long long)cur);
    return 1;
}

static uint64_t walk_end_lsn(const idem_store *s, uint64_t seq)
{
    return s->cmp_walked_lsn[seq % STORE_CMP_AHEAD];
}

int compact_stopped_full(idem_store *s)
{
    /* Walked segments still in the log (waiting for a checkpoint, for their retirement, or for
     * a backup to end), and retired files not yet deleted, give their room back by the store's
     * own work. */
    int unretired = s->cmp_walked && s->cmp_walked >= wal_first_seq(s->wal);
    return s->cmp_room_full && s->cmp_seq && !unretired &&
           !(s->remover && remover_pending(s->remover));
}

int compact_wants_checkpoint(idem_store *s)
{
    /* Walked segments wait for a checkpoint begun after their walk ended. A checkpoint scans the
     * whole index, so under load it is asked for once STORE_CKPT_RETIRE_BATCH segments wait
     * (a log that expires as it grows is walked a segment at a time, as each expires); else
     * once no walk has ended for STORE_CKPT_QUIET_MS of store time (the walk has nothing more
     * to do, or cannot go on: no room for the copies), and at once when idem_compact waits,
     * STORE_CMP_AHEAD segments wait or corruption stopped compaction. With a test clock, the
     * quiet time passes only when the test moves the clock. */
    uint64_t first = wal_first_seq(s->wal), waiting = 0;
    for (uint64_t seq = s->cmp_walked; seq >= first && seq > 0; seq--) {
        if (walk_end_lsn(s, seq) <= s->sb.ckpt_lsn) break;
        waiting++;
    }
    if (waiting && (waiting >= STORE_CKPT_RETIRE_BATCH || s->cmp_disabled ||
                    first < s->cmp_force_until || s->cmp_walked - first + 1 >= STORE_CMP_AHEAD ||
                    store_now(s) - s->cmp_walked_ms >= STORE_CKPT_QUIET_MS))
        return 1;
    /* With the disk reserve let go, one that retires nothing only takes room (a larger
     * checkpoint in place of the older kept one) from the walk that frees it; an idem_compact
     * waiting keeps the rule it had (its walk stopped for room ends it through such a checkpoint
     * refused FULL, or through compact_stopped_full). */
    if (s->reserve.released && first >= s->cmp_force_until) return 0;
    return wal_cur_seq(s->wal) - s->sb.ckpt_seq >= STORE_CKPT_EVERY_SEGS;
}

/* Retires the walked segments the installed checkpoint covers, oldest first; off_lock as for
 * the flusher's steps (compact_retire_closing holds mu throughout). */
static int retire(idem_store *s, int off_lock)
{
    if (!s->cmp_walked || s->backups) return 0; /* a backup may be copying them */
    uint64_t first = wal_first_seq(s->wal), upto = 0;
    for (uint64_t seq = first; seq <= s->cmp_walked; seq++) {
        /* The copies and deletes the walk made are durable, the checkpoint was taken after the
         * walk ended (so neither it nor a run started since points into the segment), and
         * replay starts after the segment. */
        uint64_t end = walk_end_lsn(s, seq);
        if (s->durable_lsn < end || s->sb.ckpt_lsn < end || seq >= s->sb.ckpt_seq) break;
        upto = seq;
    }
    if (!upto) return 0;
    if (upto - first >= WAL_RETIRE_MAX) upto = first + WAL_RETIRE_MAX - 1;
    /* The superblock write runs with the lock let go, and the unmaps and deletes on the
     * remover's thread (remover.h): under the lock they held every caller 16-84 ms a
     * retirement (docs/benchmarks.md). Callers cannot reach the segments meanwhile: nothing in
     * the index points into them, the age heaps' entries that still do are checked against the
     * index before any use (ages.c), and a backup waits for the flusher before it takes its copy
     * of the superblock. */
    struct super sb = s->sb;
    sb.wal_first_seq = upto + 1;
    store_super_marks(s, &sb);
    if (off_lock) store_flusher_unlock(s);
    int rc = super_store(s->io, s->dir, &sb);
    if (off_lock) store_flusher_relock(s);
    if (rc == IDEM_ENOMEM) { /* out of descriptors or memory, nothing written: a later step */
        io_fault_clear();
        return 0;
    }
    if (rc < 0) return rc;
    s->sb = sb;
    rc = wal_retire_detach(s->wal, upto);
    if (rc == 0) rc = wal_retire_remove(s->wal, s->remover);
    if (rc < 0) return rc;
    for (uint64_t seq = first; seq <= upto; seq++) {
        s->seg_max_exp[seq % WAL_SEG_SLOTS] = SEG_EXP_UNKNOWN;
        tally_forget(s, seq);
    }
    if (upto == s->cmp_walked) s->cmp_walked = 0;
    s->st.compactions += upto - first + 1;
    pthread_cond_broadcast(&s->cond_ready); /* idem_compact may wait for this */
    return 1;
}

int compact_retire_closing(idem_store *s)
{
    int rc = retire(s, 0);
    /* A failed write, as on the flusher: named, and the store failed. The closing checkpoint is
     * installed whatever the copy written here holds (copies alternate), so the next open
     * replays from it; the segments stay until its walk. */
    if (rc < 0) store_fail(s, 0, "retiring walked segments at close");
    return rc < 0 ? rc : 0;
}

/* A frame read ahead of its turn: prepared (decoded, its index slot prefetched), with where the
 * walk goes on after it. more: 1 a frame, 0 the segment's end, IDEM_ECORRUPT a broken chain or
 * record. */
struct cmp_ahead {
    struct cmp_frame cf;
    uint32_t next;
    int more;
};

static void read_ahead(idem_store *s, uint32_t *off, struct cmp_ahead *a)
{
    a->more = wal_seg_next(s->wal, s->cmp_seq, off, &a->cf.f);
    a->next = *off;
    if (a->more < 0) a->more = IDEM_ECORRUPT;
    if (a->more == 1 && ops_compact_prepare(s, &a->cf) < 0) a->more = IDEM_ECORRUPT;
}

int compact_step(idem_store *s)
{
    if (s->fatal || s->closing || s->opt.read_only) return 0;
    int rc = retire(s, 1); /* segments walked before a corrupt frame stopped compaction, too */
    if (rc > 0) s->cmp_room_full = 0; /* room comes back: the walk's next step looks again */
    if (rc != 0 || s->cmp_disabled) return rc;
    if (!s->cmp_seq) {
        uint64_t next = walk_next(s);
        if (!walk_wanted(s, next)) return roll_for_capacity(s, next);
        s->cmp_seq = next;
        s->cmp_off = WAL_BLOCK;
    }
    int64_t now = store_now(s);
    /* A ring of STORE_CMP_LOOKAHEAD frames: the one compacted and those read ahead of it; those
     * not compacted when the step ends are read again by the next (cmp_off is the first not
     * compacted). */
    struct cmp_ahead ring[STORE_CMP_LOOKAHEAD];
    uint32_t rd = s->cmp_off;
    int head = 0, n = 0, ended = 0;
    uint64_t bytes = 0;
    for (int i = 0; i < STORE_CMP_FRAMES_PER_STEP && bytes < STORE_CMP_BYTES_PER_STEP; i++) {
        for (; n < STORE_CMP_LOOKAHEAD && !ended; n++) {
            struct cmp_ahead *a = &ring[(head + n) % STORE_CMP_LOOKAHEAD];
            read_ahead(s, &rd, a);
            ended = a->more != 1;
        }
        /* No buffer room or segment now: go on at a later step. */
        if ((rc = store_room_ok(s)) != 0) {
            s->cmp_room_full = rc == IDEM_EFULL;
            return i > 0;
        }
        s->cmp_room_full = 0;
        const struct cmp_ahead *a = &ring[head];
        if (a->more == 0) {
            s->cmp_walked = s->cmp_seq;
            s->cmp_walked_lsn[s->cmp_seq % STORE_CMP_AHEAD] = wal_last_lsn(s->wal);
            s->cmp_walked_ms = now;
            s->cmp_seq = 0;
            return 1;
        }
        rc = a->more < 0 ? a->more : ops_compact_frame(s, &a->cf, now);
        /* No room, buffers or memory for the copy now (nothing was appended): a later step. */
        if (rc == IDEM_EBUSY || rc == IDEM_EFULL || rc == IDEM_ENOMEM) {
            s->cmp_room_full = rc == IDEM_EFULL;
            return i > 0;
        }
        if (rc == IDEM_ECORRUPT) {
            /* Reported, never trusted: compaction stops; the store serves on; verify tells. */
            fprintf(stderr, "idem: event=compaction_stopped segment=%llu offset=%u error=\"%s\"\n",
                    (unsigned long long)s->cmp_seq, s->cmp_off, idem_strerror(rc));
            s->cmp_disabled = 1;
            return 0;
        }
        if (rc < 0) return rc;
        bytes += a->next - s->cmp_off;
        s->cmp_off = a->next;
        head = (head + 1) % STORE_CMP_LOOKAHEAD;
        n--;
    }
    return 1;
}
