/*
 * store.c: the store's life (open with recovery, close with a checkpoint), the flusher thread
 * that runs group commit and WAIT timers, queues (submit, poll, blocking calls), the store
 * clock, scans, stats, checkpoints and backups. The rules over one key live in ops.c.
 *
 * Invariants: every completion a queue delivers in sync mode depends only on LSNs <=
 * durable_lsn and on a clock that is durable (store_clock_saved: a move of the test clock, the
 * clock that found a key expired); at most one batch is in flight (flushing); after fatal is set no
 * change is applied and no not-yet-durable completion reports success; whoever holds mu holds rw's
 * write side too (store_lock), so repeats answered under its read side (submit_reads) see nothing
 * move.
 */
#include "store.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <sched.h>
#include <stddef.h>
#include <stdarg.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <time.h>
#include <unistd.h>
#include <xxhash.h>

#include "filler.h"
#include "import_mark.h"
#include "remover.h"
#include "util.h"

static __thread char last_error[512];

void store_set_error(const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(last_error, sizeof last_error, fmt, ap);
    va_end(ap);
}

const char *idem_last_error(void)
{
    return last_error;
}

void idem_options_init(idem_options *o)
{
    memset(o, 0, sizeof *o);
}

/* ---- Clock ---- */

static int64_t sys_wall(void *ctx)
{
    (void)ctx;
    return util_realtime_ms();
}

static int64_t sys_mono(void *ctx)
{
    (void)ctx;
    return util_boottime_ms();
}

static int64_t mono_now(idem_store *s)
{
    return s->clock.monotonic_ms(s->clock.ctx);
}

/* Elapsed monotonic time moves the store clock; it follows the wall clock by at most
 * STORE_SLEW_PER_S_MS per second of elapsed time, and never goes back. */
int64_t store_now(idem_store *s)
{
    if (s->opt.test_clock) return s->clk_last_ms;
    if (s->clk_frozen) return s->clk_last_ms; /* one reading serves a whole submitted batch */
    int64_t mono = mono_now(s);
    int64_t est = s->clk_store_ms + (mono - s->clk_mono_ms);
    if (mono - s->clk_mono_ms >= 1000) {
        int64_t diff = s->clock.wall_ms(s->clock.ctx) - est;
        int64_t cap = (mono - s->clk_mono_ms) * STORE_SLEW_PER_S_MS / 1000;
        est += diff > cap ? cap : diff < -cap ? -cap : diff;
        s->clk_store_ms = est;
        s->clk_mono_ms = mono;
    }
    if (est > s->clk_last_ms) s->clk_last_ms = est;
    return s->clk_last_ms;
}

void store_clock_refreeze(idem_store *s)
{
    s->clk_frozen = 0;
    store_now(s);
    s->mono_batch_ms = mono_now(s);
    s->clk_frozen = 1;
}

int64_t idem_clock_now(idem_store *s)
{
    store_lock(s);
    int64_t now = store_now(s);
    store_unlock(s);
    return now;
}

/* The test clock to ms (mu held): never back, never so far that a time plus a ttl overflows.
 * A reopen after a crash starts from the clock of the last END frame or superblock written, so
 * a move is durable once either carries it (store_clock_saved). Until then no completion is
 * delivered where durability is waited for (store_clock_waits): an answer given after the move
 * (a key expired by it) stays true after a crash. The flusher's next batch carries it, or with
 * none coming the superblock (flusher_save_clock). */
static int clock_set_locked(idem_store *s, int64_t ms)
{
    if (ms < s->clk_last_ms || ms > STORE_CLOCK_MS_MAX) return IDEM_EINVAL;
    s->clk_last_ms = ms;
    if (!s->opt.read_only && !s->fatal) { /* failed, the store makes nothing durable again */
        s->clk_save_ms = ms;
        s->clk_wanted = 1;
        pthread_cond_signal(&s->cond_flush);
    }
    ops_wake(s, NULL, 0);
    pthread_cond_broadcast(&s->cond_ready);
    return 0;
}

int store_clock_saved(const idem_store *s)
{
    return s->clk_save_ms <= s->sb.store_clock_ms || s->clk_save_ms <= s->clk_durable_ms;
}

static int flush_asked(idem_store *s);

/* A key answered absent because it expired stays absent after a crash only if the store
 * reopens at a clock at or past its expiry. The store clock reopens at the last clock an END
 * frame or the superblock carries, or at the wall clock if that is later; after the wall clock
 * stepped back, the store clock runs ahead of it, and an idle store writes no END frame. So such
 * an answer makes the clock that expired the key wanted durable, as a move of the test clock is
 * (clock_set_locked): in sync mode no completion is delivered until it is. A failed store saves
 * no clock again: in sync mode the answer is then IDEM_EFATAL (returned), and the clock wanted
 * stays as it was, so answers given before it, and later ones that rest on no new clock, are
 * delivered. */
int store_clock_need(idem_store *s, int64_t ms)
{
    if (ms <= s->sb.store_clock_ms || ms <= s->clk_durable_ms || ms <= s->clk_save_ms) return 0;
    if (s->opt.read_only) return 0;
    if (s->fatal) return s->opt.durability == IDEM_DURABILITY_SYNC ? IDEM_EFATAL : 0;
    s->clk_save_ms = s->clk_last_ms; /* at or past ms: the clock that found the key expired */
    /* Durability none writes it only when asked to make things durable (store_clock_want, or an
     * IDEM_OP_SYNC outstanding: flush_asked): idle, each such run of answers would cost a
     * superblock write and its flush. */
    if (s->opt.durability != IDEM_DURABILITY_NONE || flush_asked(s)) store_clock_want(s);
    return 0;
}

void store_clock_want(idem_store *s)
{
    if (store_clock_saved(s)) return;
    s->clk_wanted = 1;
    pthread_cond_signal(&s->cond_flush);
}

int store_clock_waits(const idem_store *s, const struct qslot *sl)
{
    return !store_clock_saved(s) && (s->opt.durability == IDEM_DURABILITY_SYNC || sl->durable_wait);
}

int idem_clock_set(idem_store *s, int64_t ms)
{
    if (!s->opt.test_clock) return IDEM_ENOTSUP;
    store_lock(s);
    int rc = clock_set_locked(s, ms);
    store_unlock(s);
    return rc;
}

int idem_clock_advance(idem_store *s, int64_t delta_ms)
{
    if (!s->opt.test_clock) return IDEM_ENOTSUP;
    if (delta_ms < 0 || delta_ms > STORE_CLOCK_MS_MAX) return IDEM_EINVAL;
    store_lock(s); /* the reading and the setting as one: two advances add up */
    int rc = clock_set_locked(s, s->clk_last_ms + delta_ms);
    store_unlock(s);
    return rc;
}

/* ---- Tokens ---- */

/* Tokens are reserved ahead by the flusher (reserve_tokens): the superblock says no token below
 * token_reserved may be handed out again, so no crash or durability mode repeats one. Past the
 * reservation: FULL. store_room waits for the flusher's reservation unless it was put off for
 * want of descriptors or memory (superblock_save); then a claim that needs a token is refused
 * as for a full disk, and other changes, repeats and reads go on. */
int store_next_token(idem_store *s, int64_t *out)
{
    if (s->token_next >= IDEM_TOKEN_MAX || (uint64_t)s->token_next >= s->sb.token_reserved)
        return IDEM_EFULL;
    *out = s->token_next++;
    return 0;
}

static uint64_t token_headroom(const idem_store *s)
{
    uint64_t next = (uint64_t)s->token_next;
    return s->sb.token_reserved > next ? s->sb.token_reserved - next : 0;
}

/* Whether the reservation reached the last token: the superblock refuses more, and claims past
 * it answer FULL (store_next_token), so neither the flusher nor an append waits for more. */
static int token_reserved_all(const idem_store *s)
{
    return s->sb.token_reserved >= (uint64_t)IDEM_TOKEN_MAX;
}

static int token_headroom_low(const idem_store *s)
{
    return token_headroom(s) < SUPER_TOKEN_BLOCK / 2 && !token_reserved_all(s);
}

int idem_import_begin(idem_queue *q, int64_t token_next)
{
    if (!q || token_next < 0 || token_next > IDEM_TOKEN_MAX) return IDEM_EINVAL;
    idem_store *s = q->s;
    store_lock(s);
    int rc = store_import_refused(s);
    if (rc == 0) {
        /* Every superblock written from now on carries the new generation (store_super_marks:
         * one the flusher is writing now was taken before it). No token at or above the
         * reservation is handed out (store_next_token): raised to it at least, the flusher
         * reserves above the new floor first, in a superblock that carries both. Waited for
         * here, so that both survive a crash of the import. */
        s->generation_floor = s->sb.store_generation + 1;
        s->sb.store_generation = s->generation_floor;
        if ((int64_t)s->sb.token_reserved > token_next) token_next = (int64_t)s->sb.token_reserved;
        if (token_next > s->token_next) s->token_next = token_next;
        while (!s->fatal && !token_reserved_all(s)) {
            if (!token_headroom_low(s)) {
                if (s->sb.store_generation >= s->generation_floor) break;
                /* The write was taken before the new generation: one more. */
                s->token_next = (int64_t)s->sb.token_reserved;
            }
            pthread_cond_signal(&s->cond_flush);
            store_wait(s, &s->cond_ready);
        }
        if (s->fatal) rc = IDEM_EFATAL;
    }
    store_unlock(s);
    return rc;
}

void store_let_others_in(idem_store *s)
{
    void (*hook)(idem_store *) = s->test_let_go;
    store_unlock(s);
    /* A waiter woken by the unlock needs tens of microseconds to run (more on a VM); a sleep of
     * 1 ns lasts the timer slack, 50 us by default. */
    struct timespec ts = {0, 1};
    nanosleep(&ts, NULL);
    if (hook) hook(s);
    store_lock(s);
}

void store_flusher_unlock(idem_store *s)
{
    s->flushing = 1;
    store_unlock(s);
}

void store_flusher_relock(idem_store *s)
{
    store_lock(s);
    s->flushing = 0;
    pthread_cond_broadcast(&s->cond_ready); /* store_wait_durable waits on flushing */
}

void store_super_marks(idem_store *s, struct super *sb)
{
    sb->audit_len = s->audit_durable_off;
    if (sb->store_generation < s->generation_floor) sb->store_generation = s->generation_floor;
    /* A complete batch on stable storage: recovery reaches it, or lost acknowledged batches. */
    uint64_t lsn = wal_complete_lsn(s->wal);
    if (lsn > sb->log_durable_lsn) sb->log_durable_lsn = lsn;
}

/* Flusher (mu held, no batch in flight): moves the token reservation ahead, and writes the
 * store clock with it. Until the new superblock is durable, tokens come from the old
 * reservation. */
static int reserve_tokens(idem_store *s)
{
    struct super sb = s->sb;
    sb.token_reserved = (uint64_t)s->token_next + SUPER_TOKEN_BLOCK;
    if (sb.token_reserved > (uint64_t)IDEM_TOKEN_MAX) /* after an import near the last token */
        sb.token_reserved = (uint64_t)IDEM_TOKEN_MAX;
    sb.store_clock_ms = s->clk_last_ms;
    store_super_marks(s, &sb);
    store_flusher_unlock(s);
    int rc = super_store(s->io, s->dir, &sb);
    store_flusher_relock(s);
    if (rc == 0) s->sb = sb;
    return rc;
}

/* ---- Completions ---- */

static int slot_ready(const idem_store *s, const struct qslot *sl)
{
    if (sl->state != SLOT_DONE) return 0;
    return (s->opt.durability != IDEM_DURABILITY_SYNC && !sl->durable_wait) ||
           (sl->need_lsn <= s->durable_lsn && !store_clock_waits(s, sl)) ||
           sl->c.err == IDEM_EFATAL;
}

/* Someone waits for a flush that durability batch or none would not make now. */
static int flush_asked(idem_store *s)
{
    /* and a segment ended for a capacity limit, which compaction waits to see durable */
    return s->sync_waiters || __atomic_load_n(&s->sync_ops, __ATOMIC_RELAXED) ||
           s->cap_roll_lsn > s->durable_lsn;
}

/* A durable_wait slot leaves the queue (delivered, or its queue closed). */
static void slot_durable_done(idem_store *s, struct qslot *sl)
{
    if (!sl->durable_wait) return;
    sl->durable_wait = 0;
    __atomic_sub_fetch(&s->sync_ops, 1, __ATOMIC_RELAXED);
}

static void efd_signal(int efd)
{
    uint64_t one = 1;
    if (write(efd, &one, sizeof one) < 0) {
        /* The counter is saturated: the reader has plenty to read already. */
    }
}

/* Wakes whoever waits for the queue's completions: a thread in idem_poll (its condition), and
 * the eventfd if the owner asked for it (idem_queue_fd; blocking callers are spared a write per
 * completion). mu held. */
void queue_signal(struct idem_queue *q)
{
    if (q->polling) pthread_cond_signal(&q->cond);
    if (q->fd_used) efd_signal(q->efd);
}

static void queue_merge_woken(idem_queue *q);

/* Whether the queue has a completion to deliver: the first outstanding one in submission order,
 * as collect_ready delivers them (parked claims are not on that list; answered ones are, once
 * merged). */
static int queue_ready(const idem_store *s, struct idem_queue *q)
{
    queue_merge_woken(q);
    return q->head && slot_ready(s, q->head);
}

/* After the durable LSN moved (or fatal): wake the queues that have a ready completion, and the
 * callers waiting on cond_ready for durability. */
static void notify_ready(idem_store *s)
{
    for (struct idem_queue *q = s->queues; q; q = q->next)
        if (queue_ready(s, q)) queue_signal(q);
    pthread_cond_broadcast(&s->cond_ready);
}

#define WAKE_MAX    64 /* eventfds signalled after mu is let go of; any more, before */
#define WAKE_FANOUT 2  /* polling queues each waker signals: the flusher, then each woken thread */

/* Pins q: its condition may be signalled without mu until wake_unpin (mu held). */
static void wake_pin(idem_store *s, struct idem_queue *q)
{
    __atomic_add_fetch(&q->pins, 1, __ATOMIC_RELAXED);
    __atomic_add_fetch(&s->notifying, 1, __ATOMIC_RELAXED);
}

static void wake_unpin(idem_store *s, struct idem_queue *q)
{
    __atomic_sub_fetch(&s->notifying, 1, __ATOMIC_RELEASE);
    __atomic_sub_fetch(&q->pins, 1, __ATOMIC_RELEASE); /* last: q may be freed right after */
}

static void wake_list_add(idem_store *s, struct idem_queue *q)
{
    if (q->wake_listed) return;
    q->wake_listed = 1;
    q->wake_next = NULL;
    if (s->wake_tail)
        s->wake_tail->wake_next = q;
    else
        s->wake_head = q;
    s->wake_tail = q;
}

static void wake_list_remove(idem_store *s, struct idem_queue *q)
{
    if (!q->wake_listed) return;
    struct idem_queue **pp = &s->wake_head, *prev = NULL;
    while (*pp != q) {
        prev = *pp;
        pp = &(*pp)->wake_next;
    }
    *pp = q->wake_next;
    if (s->wake_tail == q) s->wake_tail = prev;
    q->wake_listed = 0;
}

/* Takes up to WAKE_FANOUT listed queues whose thread still waits in idem_poll, pinned (mu held);
 * the others found on the way leave the list (their thread collects without a signal), and so
 * does self, the caller's own queue (its thread is awake). */
static int wake_take(idem_store *s, const struct idem_queue *self, struct idem_queue **out)
{
    int n = 0;
    while (n < WAKE_FANOUT && s->wake_head) {
        struct idem_queue *q = s->wake_head;
        s->wake_head = q->wake_next;
        if (!s->wake_head) s->wake_tail = NULL;
        q->wake_listed = 0;
        if (!q->polling || q == self) continue;
        wake_pin(s, q);
        out[n++] = q;
    }
    return n;
}

/* Signals what wake_take took, without mu, and unpins it. */
static void wake_signal(idem_store *s, struct idem_queue **qs, int n)
{
    for (int i = 0; i < n; i++) {
        pthread_cond_signal(&qs[i]->cond);
        wake_unpin(s, qs[i]);
    }
}

/* notify_ready for the end of a flush (mu held; let go of and taken again).
 *   - Woken with mu held, each thread woke only to block on mu, which the flusher still held:
 *     two context switches per blocking call instead of one (blocking-64: 86-112 k/s before,
 *     122-152 k/s after, docs/benchmarks.md). So signals go out after mu is released.
 *   - Signalled one by one by the flusher, 40-50 threads blocked in idem_poll cost it about
 *     230 us per flush, as long as the flush itself, and the next flush waited for them. So the
 *     wake is a cascade: polling queues with a ready completion join a list; the flusher signals
 *     WAKE_FANOUT of them, and every thread that leaves idem_poll signals WAKE_FANOUT more
 *     (wake_take skips queues whose thread no longer waits: each signalled thread wakes for
 *     certain and passes the cascade on, so the list always drains).
 *   - Queues read through an eventfd (an event loop) are signalled by the flusher itself.
 * A pinned queue stays open: idem_queue_close waits for its pins. */
static void notify_ready_unlocked(idem_store *s)
{
    struct idem_queue *efd_q[WAKE_MAX], *pass[WAKE_FANOUT];
    int nefd = 0;
    for (struct idem_queue *q = s->queues; q; q = q->next) {
        if (!queue_ready(s, q)) continue;
        if (q->polling) wake_list_add(s, q);
        if (!q->fd_used) continue;
        if (nefd == WAKE_MAX) {
            efd_signal(q->efd);
            continue;
        }
        wake_pin(s, q);
        efd_q[nefd++] = q;
    }
    pthread_cond_broadcast(&s->cond_ready);
    int npass = wake_take(s, NULL, pass);
    if (nefd == 0 && npass == 0) return;
    uint32_t delay_us = s->test_wake_delay_us;
    store_unlock(s);
    if (delay_us) usleep(delay_us);
    for (int i = 0; i < nefd; i++) {
        efd_signal(efd_q[i]->efd);
        wake_unpin(s, efd_q[i]);
    }
    wake_signal(s, pass, npass);
    store_lock(s);
}

/* The store failed: nothing more is durable; pending completions answer EFATAL. err is the
 * failure's -errno, or 0 or -EIO when the layer reporting it knew no more: then the call this
 * thread saw fail last (io_fault_last) names it. */
void store_fail(idem_store *s, int err, const char *during)
{
    if (!s->fatal) {
        const char *call = NULL;
        if ((err == 0 || err == -EIO) && io_fault_last.err) {
            err = io_fault_last.err;
            call = io_fault_last.call;
        }
        if (err == 0) err = -EIO;
        snprintf(s->fatal_why, sizeof s->fatal_why, "%s%s%s: %s", during, call ? ": " : "",
                 call ? call : "", strerror(-err));
        fprintf(stderr, "idem: event=fatal_io_error dir=%s during=\"%s\"%s%s%s error=\"%s\"\n",
                s->dir, during, call ? " call=\"" : "", call ? call : "", call ? "\"" : "",
                strerror(-err));
    }
    __atomic_store_n(&s->fatal, 1, __ATOMIC_RELEASE); /* after fatal_why (idem_fatal_reason) */
    s->st.fatal = 1;
    for (struct idem_queue *q = s->queues; q; q = q->next) {
        for (uint32_t i = 0; i < q->depth; i++) {
            struct qslot *sl = &q->slots[i];
            if (sl->state == SLOT_DONE &&
                (sl->need_lsn > s->durable_lsn || store_clock_waits(s, sl))) {
                sl->c.err = IDEM_EFATAL;
                sl->c.outcome = 0;
            }
        }
    }
    ops_wake(s, NULL, 0); /* parked claims answer EFATAL now, not at their deadline */
    notify_ready(s);
}

/* ---- The flusher ---- */

static int ckpt_run_wanted(idem_store *s, int now);
static int ckpt_run_begin(idem_store *s);
static void ckpt_run_failed(idem_store *s, int rc);
static int superblock_save(idem_store *s, const char *deferred, const char *why);

/* Durability none: a flush someone asked for (a sync) is answered once the superblock records
 * it (store_super_marks), since recovery in that mode takes valid frames past a bad one for
 * unflushed batches and drops them: with the mark, a log that ends before it is reported, not
 * cut. A write of it put off for want of a descriptor answers without it. Flusher, mu held (let
 * go of for the write). Returns -1 once the store is failed. */
static int sync_mark_save(idem_store *s)
{
    if (s->opt.durability != IDEM_DURABILITY_NONE || s->closing) return 0;
    return superblock_save(s, "sync_mark_deferred", "recording a flush in the superblock") < 0 ? -1
                                                                                               : 0;
}

/* The zero-filler's failed write or the remover's failed directory sync (-errno each, one of
 * them set) fails the store, with mu held. The call is theirs, not one this thread saw fail.
 * A later sync of the directory from another descriptor may not report what was lost. */
static void helper_failed(idem_store *s, int fill_err, int rm_err)
{
    io_fault_clear();
    store_fail(s, fill_err ? fill_err : rm_err,
               fill_err ? "zero-filling the log ahead"
                        : "syncing the store directory after deleting retired files");
}

/* Whether the zero-filler or the remover failed (then the store is failed with it, mu held):
 * looked at before a flush is acknowledged and between batches. */
static int helpers_failed(idem_store *s)
{
    int fill_err = s->filler ? filler_error(s->filler) : 0,
        rm_err = s->remover ? remover_error(s->remover) : 0;
    if (!fill_err && !rm_err) return 0;
    helper_failed(s, fill_err, rm_err);
    return 1;
}

static void flush_once(idem_store *s)
{
    int64_t now = store_now(s);
    int n = wal_flush_begin(s->wal, now);
    if (n < 0) {
        store_fail(s, 0, "closing a batch of the log");
        return;
    }
    /* The audit entries of the changes this batch carries (audit.c), written first. */
    size_t audit_bytes = audit_take(s);
    if (n == 0 && audit_bytes == 0) return;
    /* The batch just closed, so the next one starts here: a batch boundary, where a checkpoint
     * in steps may begin. Under steady load something is pending whenever the flusher looks
     * between flushes, so a run that waited for an idle moment might never begin. */
    int begin_rc = 0;
    if (n > 0 && s->ckr.state == CKPT_RUN_IDLE && !s->ckr.by_test && !s->closing &&
        ckpt_run_wanted(s, s->ckr.want_run > s->ckr.installed_run))
        begin_rc = ckpt_run_begin(s); /* a failure is handled once the batch is written */
    s->flushing = 1;
    uint64_t records = wal_flush_frames(s->wal);
    int durable = s->opt.durability != IDEM_DURABILITY_NONE || flush_asked(s) || s->closing;
    store_unlock(s);
    int64_t t0 = util_monotonic_us();
    int audit_rc = audit_write_taken(s);
    int rc = audit_rc < 0 ? audit_rc : n > 0 ? wal_flush_io(s->wal, durable) : 0;
    int64_t us = util_monotonic_us() - t0;
    store_lock(s);
    s->flushing = 0;
    audit_taken_done(s, rc); /* entries of a batch that failed are not shown */
    if (rc < 0) store_fail(s, rc, audit_rc < 0 ? "writing the audit trail" : "writing the log");
    if (begin_rc < 0) ckpt_run_failed(s, begin_rc);
    if (rc < 0 || helpers_failed(s)) return;
    if (n == 0) {
        /* An imported entry, written once every change before it was durable. */
        if (wal_durable_lsn(s->wal) == wal_last_lsn(s->wal)) s->audit_durable_off = s->audit_off;
        notify_ready_unlocked(s); /* an imported entry is kept */
        return;
    }
    uint64_t durable_lsn = wal_flush_end(s->wal, durable);
    if (durable) {
        s->audit_durable_off = s->audit_off; /* the changes of every unit written */
        s->clk_durable_ms = now;             /* the clock its END frame carries */
        if (sync_mark_save(s) < 0) return;
    }
    s->durable_lsn = durable_lsn;
    s->last_flush_mono_ms = mono_now(s);
    s->st.flushes++;
    s->st.flush_records += records;
    s->st.flush_latency_us_sum += (uint64_t)us;
    s->st.flush_latency_us_buckets[util_latency_bucket(
        (uint64_t)us, IDEM_ARRAY_LEN(s->st.flush_latency_us_buckets))]++;
    notify_ready_unlocked(s);
}

/* Whether frames pending now should be flushed at once (else at the batch interval). */
static int flush_wanted(idem_store *s)
{
    if (s->opt.durability == IDEM_DURABILITY_SYNC || flush_asked(s) || s->closing ||
        wal_chunks_free(s->wal) < 4)
        return 1;
    return mono_now(s) - s->last_flush_mono_ms >= STORE_BATCH_FLUSH_MS;
}

/* Durability none: flushes what was written without a flush (nothing pending), with mu let go:
 * an fdatasync of up to a segment of such writes held every caller, repeats too, for as long.
 * Flusher, mu held. Returns 0 or -errno. */
static int sync_written(idem_store *s)
{
    struct wal_sync_point p;
    if (!wal_sync_point(s->wal, &p)) return 0;
    store_flusher_unlock(s);
    int rc = wal_sync_io(s->wal, &p);
    store_flusher_relock(s);
    if (rc == 0) wal_sync_done(s->wal, &p);
    return rc;
}

static int flush_due(idem_store *s)
{
    if (s->fatal) return 0;
    if (s->audit_pend.n && !wal_pending(s->wal)) return 1; /* an imported entry */
    if (!wal_pending(s->wal)) {
        /* Durability none: a caller waits for what was written without a flush. */
        if (flush_asked(s) && s->durable_lsn < wal_written_lsn(s->wal)) {
            int rc = sync_written(s);
            if (rc < 0)
                store_fail(s, rc, "flushing the log");
            else if (!helpers_failed(s) && sync_mark_save(s) == 0)
                s->durable_lsn = wal_durable_lsn(s->wal);
            notify_ready(s);
            /* Appends made while mu was let go found nobody to wake (store_appended). */
            return !s->fatal && wal_pending(s->wal) && flush_wanted(s);
        }
        return 0;
    }
    return flush_wanted(s);
}

/* How long the flusher may sleep: until a batch flush, a WAIT deadline, or a lease end. */
static int64_t flusher_sleep_ms(idem_store *s)
{
    int64_t sleep = 1000;
    int64_t mono = mono_now(s);
    if (wal_pending(s->wal) && !s->fatal)
        sleep = STORE_BATCH_FLUSH_MS - (mono - s->last_flush_mono_ms);
    if (s->waiters && s->wake_next_mono_ms - mono < sleep) sleep = s->wake_next_mono_ms - mono;
    return sleep < 0 ? 0 : sleep;
}

/* Writes the superblock with tokens reserved ahead and the store clock (reserve_tokens). While
 * an open of it finds no file descriptor or memory (nothing written), it is tried again once a
 * second, the first time logged as event=`deferred`. Returns 1 when it was tried (mu was let go;
 * written unless super_failed_mono_ms is set), 0 when it waits for its second, -1 once the
 * store is failed (`why`). */
static int superblock_save(idem_store *s, const char *deferred, const char *why)
{
    int64_t mono = mono_now(s);
    if (s->super_failed_mono_ms && mono - s->super_failed_mono_ms < 1000) return 0;
    int rc = reserve_tokens(s);
    if (rc == IDEM_ENOMEM) {
        if (!s->super_failed_mono_ms)
            fprintf(stderr,
                    "idem: event=%s reason=\"no file descriptor or memory to open the "
                    "superblock\" dir=%s\n",
                    deferred, s->dir);
        s->super_failed_mono_ms = mono;
        io_fault_clear();
        return 1;
    }
    if (rc < 0) {
        store_fail(s, 0, why);
        return -1;
    }
    s->super_failed_mono_ms = 0;
    return 1;
}

/* ---- The disk reserve (disk_reserve.h) ---- */

/* The room checkpoints need beyond what the two kept ones take: one being written with every
 * key's entry at its largest, and the two kept grown to that size (each install deletes the
 * older kept one, which may be smaller, taken with fewer keys: it frees less than the new one
 * takes), and 1 MiB for the file system's own blocks; at least one checkpoint's room. While the
 * reserve is let go, the next segment and the audit trail's growth leave this free. mu held. */
static uint64_t reserve_ckpt_room(const idem_store *s)
{
    uint64_t one = ckpt_bytes_max(index_count(s->ix)),
             kept = s->ckpt_file_bytes[0] + s->ckpt_file_bytes[1];
    return (3 * one > kept + one ? 3 * one - kept : one) + (1u << 20);
}

/* What the reserve holds: the checkpoints' room at its largest (three checkpoints of every key:
 * it depends on the key count alone, so that it does not shrink and grow as checkpoints are
 * installed), RESERVE_SEGS segments and 1 MiB, in whole MiB so that it grows in steps. One
 * segment takes the copies and DELETEs of a walk of one segment (no more than its frames, with
 * their batches' padding); the second the other writes and padding in the same segments
 * meanwhile. With one, a walk of a segment nearly all live, begun at the release, could find its
 * room filled before it ended: nothing walked, no checkpoint to retire anything, and the store
 * FULL for good. Once one segment's walk ends, the quiet rule asks for the checkpoint that
 * retires it (compact_wants_checkpoint), and its room comes back. mu held. */
#define RESERVE_SEGS 2
static uint64_t reserve_want(const idem_store *s)
{
    uint64_t ckpts = 3 * ckpt_bytes_max(index_count(s->ix)) + (1u << 20);
    return IDEM_ALIGN_UP(ckpts + RESERVE_SEGS * (uint64_t)s->opt.segment_bytes, 1u << 20);
}

/* An open or allocation of the reserve failed (rc, -errno; why: what was tried), with mu held
 * or the store not yet started. It is tried again once a second (reserve_maintain), and the
 * first failure of a streak is logged; a file system that cannot allocate ahead keeps none. */
static void reserve_short(idem_store *s, int rc, const char *why)
{
    struct disk_reserve *r = &s->reserve;
    if (rc == -EOPNOTSUPP || rc == -ENOSYS) {
        fprintf(stderr, "idem: event=disk_reserve_off dir=%s error=\"%s: %s\"\n", s->dir, why,
                strerror(-rc));
        disk_reserve_close(r);
        r->off = 1;
        r->released = 0; /* as a store with none: the log's end answers FULL by itself */
    } else if (!r->short_said) {
        fprintf(stderr,
                "idem: event=disk_reserve_short dir=%s want=%llu held=%llu error=\"%s: %s\": "
                "tried again each second\n",
                s->dir, (unsigned long long)reserve_want(s), (unsigned long long)r->held, why,
                strerror(-rc));
        r->short_said = 1;
    }
}

/* The reserve is let go (why: at the log's end, or found so at open): new keys answer FULL.
 * mu held, or the store not yet started. */
static void reserve_released(idem_store *s, const char *why)
{
    s->reserve.released = 1;
    fprintf(stderr,
            "idem: event=disk_reserve_released dir=%s free_bytes=%llu reason=\"%s\": new keys "
            "answer FULL until the reserve (%llu bytes) and a segment more are free\n",
            s->dir, (unsigned long long)disk_free_bytes(s->dir, s->reserve.root_blocks), why,
            (unsigned long long)reserve_want(s));
}

/* At open, before the spare segment: the reserve is made or taken back (not on the simulated
 * disk, nor read-only). */
static void reserve_start(idem_store *s)
{
    int rc = disk_reserve_open(&s->reserve, s->dir);
    if (rc < 0) {
        reserve_short(s, rc, "opening the reserve");
        return;
    }
    /* Found empty, as a release leaves it: taken back only where it and a segment more are free,
     * as reserve_maintain does (the store went on in the reserve's room before, and new keys
     * must not take that room now either). */
    uint64_t want = reserve_want(s);
    if (!s->reserve.made && !s->reserve.held &&
        disk_free_bytes(s->dir, s->reserve.root_blocks) < want + s->opt.segment_bytes) {
        reserve_released(s, "the reserve was let go before and finds no room");
        return;
    }
    rc = disk_reserve_hold(&s->reserve, want);
    if (rc < 0) reserve_short(s, rc, "allocating the reserve");
}

/* Whether the disk has free the checkpoints' room (ckpt_room, reserve_ckpt_room), a segment and
 * bytes more: what the reserve let go must leave for the work that frees the disk, beside the
 * next segment or the audit trail's growth. A file system that tells no free count answers yes. */
static int room_beside_ckpts(const idem_store *s, uint64_t ckpt_room, uint64_t bytes)
{
    uint64_t free_bytes = disk_free_bytes(s->dir, s->reserve.root_blocks);
    return free_bytes == UINT64_MAX || free_bytes >= ckpt_room + s->opt.segment_bytes + bytes;
}

/* Makes the spare segment seq, mu released. A reserve held short of want (it grows once a
 * second, and keys came since) is grown first where the room is free, so that the log does not
 * take the room it needs (let go short, it would give a walk one segment; the keys written into
 * the last segments once less than a segment is free still need more than it holds). While the
 * reserve is let go, the spare is made only where the checkpoints' room (ckpt_room) is left beside
 * it. When the disk refuses it and the log is at its end (cur_full: the current segment cannot take
 * a largest frame), the reserve is let go (*let_go) and the making tried once more: until then the
 * log's own space takes new keys. A reserve left short (no room to grow it) is let go only where it
 * and the free bytes give a segment and the checkpoints' room: else the store answers FULL as one
 * without it did. A new file never allocated yet (still DISK_RESERVE_MAKING) holds nothing and is
 * not let go: as a store without a reserve, which a restart would read it as. */
static int spare_make_kept(idem_store *s, uint64_t seq, uint64_t ckpt_room, uint64_t want,
                           int cur_full, int *let_go, struct wal_segment **made)
{
    struct disk_reserve *r = &s->reserve;
    char path[4096];
    struct stat st;
    wal_seg_path(s->dir, seq, path, sizeof path);
    /* a whole file of seq (made before a restart) is used again, taking no new space */
    int whole = stat(path, &st) == 0 && (uint64_t)st.st_blocks * 512 >= s->opt.segment_bytes;
    if (!whole && r->fd >= 0 && !r->released && r->held < want &&
        disk_free_bytes(s->dir, r->root_blocks) >= want - r->held)
        (void)disk_reserve_hold(r, want); /* short still: reserve_maintain logs it */
    for (;;) {
        int rc = (r->released || *let_go) && !whole && !room_beside_ckpts(s, ckpt_room, 0)
                     ? IDEM_EFULL
                     : wal_spare_make(s->wal, seq, made);
        if (rc != IDEM_EFULL || r->fd < 0 || r->made || r->released || *let_go || !cur_full)
            return rc;
        uint64_t free_bytes = disk_free_bytes(s->dir, r->root_blocks);
        if (free_bytes == UINT64_MAX || r->held + free_bytes < ckpt_room + s->opt.segment_bytes)
            return rc;
        disk_reserve_release(r);
        *let_go = 1;
    }
}

int store_released_room_ok(idem_store *s, uint64_t bytes)
{
    return !s->reserve.released || room_beside_ckpts(s, reserve_ckpt_room(s), bytes);
}

/* Once a second, mu held and let go for the file calls: a reserve let go is taken back once it
 * and a segment more are free; one that an open or allocation left short is tried again, grown
 * as keys come, and cut back once what it holds past the keys' need is over a quarter of that
 * need and over 2 MiB (not sooner: a count near a MiB step would cut and grow it each second). Room
 * cut back goes to the log: keys that come back later grow the reserve only where room is left, as
 * any growth. Returns 1 when mu was released. */
static int reserve_maintain(idem_store *s, int64_t mono)
{
    struct disk_reserve *r = &s->reserve;
    if (r->off || s->test_sim || mono - s->reserve_mono_ms < 1000) return 0;
    s->reserve_mono_ms = mono;
    uint64_t want = reserve_want(s);
    uint64_t slack = want / 4 > (2u << 20) ? want / 4 : (2u << 20);
    if (r->fd >= 0 && !r->released && r->held >= want && r->held <= want + slack) return 0;
    const char *why = "opening the reserve";
    store_flusher_unlock(s);
    int rc = 0, back = 0;
    if (r->fd < 0) rc = disk_reserve_open(r, s->dir);
    if (rc == 0) why = "allocating the reserve";
    if (rc == 0 && r->released)
        back = disk_free_bytes(s->dir, r->root_blocks) >= want + s->opt.segment_bytes;
    if (rc == 0 && (!r->released || back)) rc = disk_reserve_hold(r, want);
    store_flusher_relock(s);
    if (rc < 0) {
        reserve_short(s, rc, why);
    } else if (r->released && back) {
        r->released = 0;
        r->short_said = 0;
        fprintf(stderr,
                "idem: event=disk_reserve_taken dir=%s bytes=%llu: new keys are taken again\n",
                s->dir, (unsigned long long)want);
    } else if (!r->released) {
        r->short_said = 0;
    }
    return 1;
}

/* Between batches (mu held, nothing in flight): the spare segment and token headroom, so
 * callers never do file I/O of their own; the I/O runs with mu released. A failure other than
 * a full disk is fatal. Returns 1 when mu was released meanwhile. */
static int flusher_maintain(idem_store *s)
{
    if (s->fatal) return 0;
    /* A helper's failure (a zero write, the directory's sync after deletes) fails the store
     * also between flushes and while it closes. */
    if (helpers_failed(s)) return 0;
    if (s->closing) return 0;
    int released = 0;
    int64_t mono = mono_now(s);
    if (wal_spare_needed(s->wal) &&
        (!s->spare_failed_mono_ms || mono - s->spare_failed_mono_ms >= 1000)) {
        int rc;
        uint64_t seq = wal_spare_begin(s->wal, &rc);
        struct wal_segment *made = NULL;
        if (seq) {
            uint64_t ckpt_room = reserve_ckpt_room(s), want = reserve_want(s);
            int let_go = 0, cur_full = !wal_cur_fits(s->wal, s->frame_max);
            store_flusher_unlock(s);
            rc = spare_make_kept(s, seq, ckpt_room, want, cur_full, &let_go, &made);
            store_flusher_relock(s);
            if (let_go) reserve_released(s, "the log is at the end of a full disk");
            released = 1;
        }
        rc = wal_spare_end(s->wal, made, rc);
        if (rc == 0) s->seg_max_exp[(wal_cur_seq(s->wal) + 1) % WAL_SEG_SLOTS] = SEG_EXP_EMPTY;
        if (rc == IDEM_EFULL || rc == IDEM_ENOMEM) { /* not the disk failing: tried again */
            if (!s->spare_failed_mono_ms)
                fprintf(stderr,
                        "idem: event=full reason=\"no %s for the next log segment\" dir=%s\n",
                        rc == IDEM_EFULL ? "space" : "file descriptor or memory", s->dir);
            s->spare_failed_mono_ms = mono;
            s->spare_failures += rc == IDEM_EFULL; /* no room, not out of descriptors */
            io_fault_clear();                      /* handled, as ckpt_run_failed's */
        } else if (rc < 0) {
            char what[64];
            snprintf(what, sizeof what, "creating log segment %llu", (unsigned long long)seq);
            store_fail(s, 0, what);
            return 1;
        } else {
            if (s->spare_failed_mono_ms && seq)
                fprintf(stderr,
                        "idem: event=full_over reason=\"the next log segment is made\" "
                        "dir=%s\n",
                        s->dir);
            s->spare_failed_mono_ms = 0;
        }
        pthread_cond_broadcast(&s->cond_ready);
    }
    if (reserve_maintain(s, mono)) released = 1;
    if (token_headroom_low(s)) {
        int rc =
            superblock_save(s, "token_reservation_deferred", "reserving tokens in the superblock");
        if (rc < 0) return 1;
        released |= rc;
        if (rc && !s->super_failed_mono_ms) pthread_cond_broadcast(&s->cond_ready);
    }
    return released;
}

/* A clock wanted durable that no batch carried (a move of the test clock, clock_set_locked, or
 * the clock that found a key expired, store_clock_need) goes to the superblock, once
 * nothing is pending: after compaction's steps in the flusher's round, whose batch would carry
 * it too (a test that holds the disk's completions sees that batch's flush first). Returns 1
 * when it did anything (the round goes on). */
static int flusher_save_clock(idem_store *s)
{
    if (!s->clk_wanted || s->fatal || s->closing || s->abandoned) return 0;
    if (!store_clock_saved(s)) {
        if (wal_pending(s->wal)) return 0;
        int rc =
            superblock_save(s, "clock_save_deferred", "writing the store clock to the superblock");
        if (rc < 0) return 1;
        if (s->super_failed_mono_ms) return 0; /* the answers waiting for it wait 1 s more */
    }
    /* Saved here, or by another write of the superblock this round (a checkpoint's install, the
     * token reservation), which wakes no queue: completions waited for it (store_clock_waits).
     * Not saved if the clock moved again while mu was let go of: the next round writes it. */
    if (store_clock_saved(s)) {
        s->clk_wanted = 0;
        notify_ready(s);
    }
    return 1;
}

/* The audit trail's length goes to the superblock (store_super_marks) once nothing is pending
 * after a flush that made audit units durable: the open tells a unit damaged or lost after it
 * was durable from a torn one only up to the length a superblock holds, and on a quiet store
 * the last write of one could be hours before. Operator calls are rare: one superblock write
 * at the idle moment after them. Returns 1 when it did anything (the round goes on). */
static int flusher_save_audit_len(idem_store *s)
{
    if (s->fatal || s->closing || s->abandoned || s->sb.audit_len >= s->audit_durable_off ||
        wal_pending(s->wal))
        return 0;
    return superblock_save(s, "audit_length_deferred",
                           "writing the audit trail's length to the superblock") > 0;
}

static int checkpoint_at_close(idem_store *s);
static int ckpt_run_step(idem_store *s, int now);

/* Checkpoints and compaction between batches; returns 1 when work was done (loop again). */
static int flusher_compact(idem_store *s)
{
    if (s->fatal || s->closing || s->abandoned) return 0;
    int rc = 0;
    if (!s->ckr.by_test) {
        rc = ckpt_run_step(s, s->ckr.want_run > s->ckr.installed_run);
    } else if (s->ckr.test_step) {
        uint64_t installed = s->st.checkpoints;
        rc = s->ckr.test_rc = ckpt_run_step(s, 1);
        s->ckr.test_installed = s->st.checkpoints > installed;
        s->ckr.test_step = 0;
        pthread_cond_broadcast(&s->cond_ready);
    }
    if (rc < 0) ckpt_run_failed(s, rc);
    if (s->fatal) return 0;
    /* One step per round, flushes going on between steps; while a checkpoint runs, compaction
     * takes every other round, so expiry keeps pace with the log. */
    int ckpt_busy = rc > 0;
    if (ckpt_busy && (s->cmp_turn = !s->cmp_turn) == 0) return 1;
    rc = compact_step(s);
    if (rc < 0) {
        store_fail(s, 0, "compacting the log");
        return 0;
    }
    return rc || ckpt_busy;
}

/* A log idle for STORE_BUFFERS_IDLE_MS gives back the chunk buffers a burst allocated beyond
 * STORE_BUFFERS_KEPT (up to 64 MiB would otherwise stay until close). Under load no flush is
 * that far apart, so buffers are not unmapped and faulted in again and again. Returns 1 when
 * mu was released meanwhile. */
static int flusher_trim_buffers(idem_store *s)
{
    if (s->fatal || wal_pending(s->wal) ||
        wal_buffer_bytes(s->wal) <= STORE_BUFFERS_KEPT * WAL_CHUNK_BYTES ||
        mono_now(s) - s->last_flush_mono_ms < STORE_BUFFERS_IDLE_MS)
        return 0;
    void *bufs[WAL_CHUNKS_MAX];
    int n = wal_buffers_take(s->wal, STORE_BUFFERS_KEPT, bufs);
    if (n == 0) return 0; /* the rest hold a batch that failed: the flusher would spin */
    store_unlock(s);
    wal_buffers_free(bufs, n);
    store_lock(s);
    return 1;
}

static void *flusher_main(void *arg)
{
    idem_store *s = arg;
    store_lock(s);
    for (;;) {
        if (s->abandoned) break;
        io_fault_clear(); /* a failure below is named by the calls of this round (store_fail) */
        /* Under steady load a flush is always due, so checkpoints and compaction take their
         * steps after each flush, one more per STORE_FRAMES_PER_STEP frames flushed: they keep
         * pace with the log, or expired keys would pile up faster than they are swept. Capped
         * at STORE_STEPS_PER_FLUSH more: those frames include compaction's own copies and
         * deletes, and the callers the next flush answers wait for the steps. Idle, one step
         * per round. */
        int flushed = flush_due(s);
        uint64_t steps = 1;
        if (flushed) {
            uint64_t before = s->st.flush_records;
            flush_once(s);
            if (s->abandoned) break;
            uint64_t earned = (s->st.flush_records - before) / STORE_FRAMES_PER_STEP;
            steps += earned < STORE_STEPS_PER_FLUSH ? earned : STORE_STEPS_PER_FLUSH;
        }
        /* After it let go of mu, callers may have appended (and their kick found nobody
         * waiting): look at everything again before sleeping. */
        int maintained = flusher_maintain(s) | compact_learn_horizon(s);
        int stepped = 0;
        while (steps-- > 0 && !s->abandoned && flusher_compact(s)) {
            /* Between steps of a checkpoint or a compaction, let callers at the lock: the
             * mutex is not fair, and the next step would take it straight back. */
            store_unlock(s);
            sched_yield();
            store_lock(s);
            stepped = 1;
        }
        stepped |= flusher_save_clock(s);
        stepped |= flusher_save_audit_len(s);
        /* A step of the age heaps' filtering (ages.c), then callers get the lock again. */
        int tidied = !s->abandoned && !s->fatal && !s->closing && ages_tidy(s);
        if (tidied) {
            void (*hook)(idem_store *) = s->test_after_tidy;
            store_unlock(s);
            sched_yield();
            if (hook) hook(s);
            store_lock(s);
        }
        if (maintained || stepped || flushed) {
            ops_wake_due(s); /* WAIT deadlines and lease ends come under steady writes too */
            continue;
        }
        /* Waiters whose deadline or awaited lease end has come (the others run again when
         * their key changes). A recover or review this makes is flushed at once in sync mode,
         * not after a batch interval. */
        if (s->waiters) {
            uint64_t last = wal_last_lsn(s->wal);
            ops_wake_due(s);
            if (wal_last_lsn(s->wal) != last && flush_wanted(s)) continue;
        }
        /* Done once nothing is pending and nobody waits for what was written to be flushed
         * (durability none: the close itself waits so, and may have come in while mu was let
         * go above). After a fatal error nothing will ever be flushed. */
        if (s->closing && (s->fatal || (!wal_pending(s->wal) && !s->sync_waiters))) break;
        if (tidied) continue; /* the pass goes on: no sleep */
        if (!s->closing && flusher_trim_buffers(s)) continue;
        int64_t ms = flusher_sleep_ms(s);
        if (ms > 0) {
            struct timespec ts;
            clock_gettime(CLOCK_MONOTONIC, &ts);
            ts.tv_sec += ms / 1000;
            ts.tv_nsec += (ms % 1000) * 1000000;
            if (ts.tv_nsec >= 1000000000) {
                ts.tv_sec++;
                ts.tv_nsec -= 1000000000;
            }
            s->flusher_idle = !wal_pending(s->wal);
            store_timedwait(s, &s->cond_flush, &ts);
            s->flusher_idle = 0;
        }
    }
    store_unlock(s);
    return NULL;
}

void store_kick(idem_store *s)
{
    pthread_cond_signal(&s->cond_flush);
}

/* In batch and none modes the flusher, once frames are pending, sleeps until the batch
 * interval: it is woken when it sleeps with nothing pending (the first frames since) and when
 * a flush is wanted at once, not for every call (it would only contend for mu). A call cannot
 * tell from what was pending when it began: it may have waited for room meanwhile, while the
 * flusher flushed everything and went to its idle sleep. After frames were appended, mu held. */
static void store_appended(idem_store *s)
{
    if (!wal_pending(s->wal) || !(s->flusher_idle || flush_wanted(s))) return;
    s->flusher_idle = 0;
    store_kick(s);
}

/* Whether `bytes` of frames can be appended now without waiting: 0, IDEM_EBUSY (wait for the
 * flusher), IDEM_EFULL (no space for the next segment: an append past this one answers FULL). */
static int room_ok_for(idem_store *s, uint32_t bytes)
{
    if (s->ckpt_quiesce) return IDEM_EBUSY; /* a checkpoint is being taken at this log position */
    /* Tokens run low: wait for the flusher's reservation, unless it was put off for want of
     * descriptors or memory. Then changes that need no token go on (the log's room still
     * checked), and a claim past the last token reserved answers FULL (store_next_token),
     * rather than waiting as long as the shortage. */
    if (token_headroom(s) < 64 && !token_reserved_all(s) && !s->super_failed_mono_ms)
        return IDEM_EBUSY;
    return wal_room(s->wal, bytes);
}

int store_room_ok(idem_store *s)
{
    return room_ok_for(s, s->frame_max);
}

int store_room_for(idem_store *s, uint32_t bytes)
{
    int rc = 0;
    while (!s->fatal && (rc = room_ok_for(s, bytes)) == IDEM_EBUSY) {
        s->sync_waiters++;
        pthread_cond_signal(&s->cond_flush);
        store_wait(s, &s->cond_ready);
        s->sync_waiters--;
    }
    return s->fatal ? IDEM_EFATAL : rc;
}

int store_room(idem_store *s)
{
    return store_room_for(s, s->frame_max) == IDEM_EFATAL ? IDEM_EFATAL : 0;
}

/* Waits (mu held) until everything appended so far is durable. */
int store_wait_durable(idem_store *s)
{
    uint64_t target = wal_last_lsn(s->wal);
    s->sync_waiters++;
    /* and for the clock to be durable (store_clock_saved), but in the close, whose checkpoint
     * writes the clock */
    if (!s->closing) store_clock_want(s);
    while (!s->fatal &&
           (s->durable_lsn < target || s->flushing || (!s->closing && !store_clock_saved(s)))) {
        pthread_cond_signal(&s->cond_flush);
        store_wait(s, &s->cond_ready);
    }
    s->sync_waiters--;
    return s->fatal ? IDEM_EFATAL : 0;
}

/* ---- Open and close ---- */

/* A store's superblock is written before its first open ends, and audit.log right after it: a
 * directory with audit.log and no superblock holds a store whose superblock was lost (or a
 * copy cut short). A new store made there would write over its log: refused, named. */
static int store_files_left(struct io *io, const char *dir)
{
    char path[4096];
    snprintf(path, sizeof path, "%s/audit.log", dir);
    struct io_file *f;
    int rc = io_open(io, path, IO_O_RDONLY, &f);
    if (rc == -ENOENT) return 0;
    if (rc == 0) io_close(io, f);
    store_set_error("%s holds a store's files (audit.log) but no superblock (super): not making a "
                    "new store over them; restore a backup, or move the files away",
                    dir);
    return IDEM_ECORRUPT;
}

/* Syncs the directory that holds path (its entry made durable). Returns 0 or -errno. */
static int sync_parent(struct io *io, const char *path)
{
    char parent[4096];
    snprintf(parent, sizeof parent, "%s", path);
    size_t n = strlen(parent);
    while (n > 1 && parent[n - 1] == '/')
        parent[--n] = 0;
    char *slash = strrchr(parent, '/');
    if (!slash)
        snprintf(parent, sizeof parent, ".");
    else if (slash == parent)
        parent[1] = 0;
    else
        *slash = 0;
    return io_sync_dir(io, parent);
}

static int store_init_new(idem_store *s)
{
    struct super *sb = &s->sb;
    memset(sb, 0, sizeof *sb);
    /* The hash seed is secret (keys that collide are worked out from it), and drawn apart from
     * the store id. getrandom needs no device file; without it (a kernel before 3.17 and no
     * /dev/urandom) the values come from clocks and the pid, which can be guessed: said. */
    uint64_t r[3];
    if (getrandom(r, sizeof r, 0) != (ssize_t)sizeof r) {
        FILE *ur = fopen("/dev/urandom", "rb");
        if (!ur || fread(r, sizeof r, 1, ur) != 1) {
            r[0] = XXH3_64bits_withSeed(s->dir, strlen(s->dir), (uint64_t)util_monotonic_us());
            r[1] = XXH3_64bits_withSeed(r, 8, (uint64_t)util_realtime_ms() ^ (uint64_t)getpid());
            r[2] = XXH3_64bits_withSeed(r, 16, (uint64_t)util_monotonic_us());
            fprintf(stderr,
                    "idem: event=weak_hash_seed dir=%s error=\"no random source: the "
                    "hash seed comes from clocks\"\n",
                    s->dir);
        }
        if (ur) fclose(ur);
    }
    memcpy(sb->store_id, r, 16);
    sb->hash_seed = r[2];
    sb->token_reserved = 1;
    sb->wal_first_seq = 1;
    sb->ckpt_seq = 1;
    sb->ckpt_off = WAL_BLOCK;
    sb->seg_bytes = s->opt.segment_bytes;
    sb->created_ms = s->clock.wall_ms(s->clock.ctx);
    sb->store_clock_ms = sb->created_ms;
    sb->store_generation = 1;
    /* The store's name must survive a power loss, whoever made the directory (an installer's
     * mkdir, or an open killed before this sync): only its creator synced it before. A parent
     * this process may not read (mode 0711), or a file system that syncs no directory, is
     * said and left to the file system, as it was before for a directory made by another. */
    int rc = sync_parent(s->io, s->dir);
    if (rc == -EACCES || rc == -EPERM || rc == -EINVAL) {
        fprintf(stderr,
                "idem: event=dir_sync_skipped dir=%s error=\"%s\" reason=\"the directory that "
                "holds the store cannot be synced: its name's durability rests on the file "
                "system\"\n",
                s->dir, strerror(-rc));
        rc = 0;
    }
    if (rc < 0) {
        store_set_error("cannot make the name of %s durable: %s", s->dir, strerror(-rc));
        return UTIL_NO_SPACE(rc) ? IDEM_EFULL : IDEM_EIO;
    }
    rc = wal_init_new(s->wal);
    if (rc < 0) return rc;
    s->seg_max_exp[1] = SEG_EXP_EMPTY;
    return super_store(s->io, s->dir, sb);
}

/* The keys the index is made for at open: max_keys, so that no growth pauses come before it,
 * within half of max_memory_bytes (an index made past the memory limit answered FULL on an
 * empty store) and a quarter of the memory this process may use (the machine's, or its
 * cgroup's limit). */
static uint64_t index_presize_keys(const idem_store *s)
{
    const idem_options *o = &s->opt;
    uint64_t cap = s->memory_avail / 4;
    if (o->max_memory_bytes && (!cap || o->max_memory_bytes / 2 < cap))
        cap = o->max_memory_bytes / 2;
    if (!cap) cap = UINT64_MAX; /* no memory limit, the memory available unknown */
    uint64_t n = o->max_keys;
    while (n && index_presize_bytes(n) > cap)
        n /= 2;
    return n;
}

/* The index is made for the checkpoint's entries at once (their count is checked by then), at
 * about the size growth would have reached, so it hardly grows while they load. The empty one
 * made at open is let go first: both at once could pass the memory the store has (the first is
 * resident, up to half of max_memory_bytes). Without memory for that, the index starts small
 * and grows as usual. */
static int ckpt_sized(void *ctx, uint64_t count)
{
    idem_store *s = ctx;
    if (count <= index_presize_keys(s) || count >= (UINT64_C(1) << 34)) return 0; /* grows */
    IDEM_ASSERT(index_count(s->ix) == 0);
    index_destroy(s->ix);
    s->ix = NULL;
    if (index_create_snug(count, &s->ix) == 0 || index_create(0, &s->ix) == 0) return 0;
    s->ix = NULL;
    return IDEM_ENOMEM;
}

static uint64_t ckpt_entry_hash(const struct ckpt_entry *e)
{
    return (e->addr_tag & ~INDEX_ADDR_MASK) | e->hash_lo;
}

static int ckpt_addr_invalid(const idem_store *s)
{
    uint64_t gap = wal_gap_seq(s->wal);
    char why[160] = "";
    if (gap) {
        char path[4096];
        wal_seg_path(s->dir, gap, path, sizeof path);
        snprintf(why, sizeof why, " (%s is missing: the log starts after it)",
                 strrchr(path, '/') + 1);
    }
    store_set_error("checkpoint %llu names a log address outside the log's segments%s",
                    (unsigned long long)s->sb.ckpt_id, why);
    return IDEM_ECORRUPT;
}

static int ckpt_entry_load(void *ctx, const struct ckpt_entry *e)
{
    idem_store *s = ctx;
    uint64_t h = ckpt_entry_hash(e);
    if (!wal_addr_valid(s->wal, e->addr_tag & INDEX_ADDR_MASK)) return ckpt_addr_invalid(s);
    uint64_t addr = e->addr_tag & INDEX_ADDR_MASK;
    /* A checkpoint taken in steps may list a key twice (moved by a split during its scan):
     * keep the first entry. Only equal hash bits call for a look at the keys. */
    if (super_ckpt_stepped(&s->sb) && index_has_hash(s->ix, h)) {
        if (index_holds(s->ix, h, addr)) return 0;
        uint32_t len;
        uint64_t lsn;
        const uint8_t *p = wal_payload(s->wal, addr, &len, &lsn);
        struct rec r, cur;
        if (!p || rec_decode(p, len, &r) < 0) {
            store_set_error("checkpoint %llu names a record that does not decode",
                            (unsigned long long)s->sb.ckpt_id);
            return IDEM_ECORRUPT;
        }
        if (ops_find(s, r.key, r.key_len, &cur, &lsn)) return 0;
        /* The key's first listing fails its checksum: this one would index it twice. */
        if (s->find_corrupt) {
            store_set_error("checkpoint %llu names a record that fails its checksum",
                            (unsigned long long)s->sb.ckpt_id);
            return IDEM_ECORRUPT;
        }
    }
    struct index_slot *slot = index_insert_ordered(s->ix, h, addr);
    if (!slot) return IDEM_ENOMEM;
    if (e->has_seen & CKPT_UNFINISHED) {
        uint32_t len;
        uint64_t lsn;
        const uint8_t *p = wal_payload(s->wal, index_slot_addr(slot), &len, &lsn);
        struct rec r;
        if (!p || rec_decode(p, len, &r) < 0) {
            store_set_error("checkpoint %llu names a record that does not decode",
                            (unsigned long long)s->sb.ckpt_id);
            return IDEM_ECORRUPT;
        }
        if (ages_room(s, &r) < 0) return IDEM_ENOMEM;
        ages_note(s, &r, h, index_slot_addr(slot));
        ops_slot_mark(slot, &r);
        s->st.keys_with_mismatch += r.mismatch_count > 0;
    }
    /* Repeat counters survive a clean restart through the checkpoint. */
    return (e->has_seen & CKPT_SEEN) ? ops_seen_set(s, slot, e->seen_count, e->last_seen_ms) : 0;
}

/* Most entries: no flags, no repeat counters. Without the duplicate check of a checkpoint taken
 * in steps, each is one ordered insert (the file lists them in index order). */
static int ckpt_plain_load(void *ctx, const uint8_t *run, uint64_t n)
{
    idem_store *s = ctx;
    bool stepped = super_ckpt_stepped(&s->sb);
    struct wal *w = s->wal;
    struct index *ix = s->ix;
    for (uint64_t i = 0; i < n; i++, run += 16) {
        struct ckpt_entry e = {.addr_tag = util_get_u64(run), .hash_lo = util_get_u32(run + 8)};
        if (stepped) {
            int rc = ckpt_entry_load(s, &e);
            if (rc < 0) return rc;
            continue;
        }
        uint64_t addr = e.addr_tag & INDEX_ADDR_MASK;
        if (!wal_addr_valid(w, addr)) return ckpt_addr_invalid(s);
        if (!index_insert_ordered(ix, ckpt_entry_hash(&e), addr)) return IDEM_ENOMEM;
    }
    return 0;
}

static int store_recover(idem_store *s)
{
    char err[512] = "";
    s->live_bytes = s->sb.ckpt_live_bytes;
    s->st.keys_in_flight = s->sb.ckpt_keys_by_state[0];
    s->st.keys_committed = s->sb.ckpt_keys_by_state[1];
    s->st.keys_review = s->sb.ckpt_keys_by_state[2];
    int rc = wal_open_segments(s->wal, s->sb.wal_first_seq, s->sb.ckpt_seq, s->opt.read_only);
    /* The log as the open found it: segments the superblock names before a missing one were
     * retired (or left behind by a retirement), and this open's superblock stops naming them,
     * so that remove_leftovers removes what is left of them. */
    if (rc == 0) s->sb.wal_first_seq = wal_first_seq(s->wal);
    /* After a crash or a failed store, what the last run wrote may be only in the page cache:
     * recovery reads the log from disk (design.md section 7). */
    s->settle_files = !s->opt.read_only && !s->sb.clean_lsn;
    if (rc == 0 && s->settle_files) rc = wal_settle(s->wal, s->sb.ckpt_seq) < 0 ? IDEM_EIO : 0;
    if (rc < 0) {
        store_set_error("%s", wal_error(s->wal));
        return rc;
    }
    if (s->sb.ckpt_id) {
        rc = ckpt_load(s->io, s->dir, s->sb.ckpt_id, ckpt_sized, ckpt_entry_load, ckpt_plain_load,
                       s, err, sizeof err);
        if (rc < 0) {
            if (*err)
                store_set_error("%s", err);
            else if (!last_error[0]) /* ckpt_entry_load says why, except for memory */
                store_set_error("loading checkpoint %llu: %s", (unsigned long long)s->sb.ckpt_id,
                                idem_strerror(rc));
            return rc;
        }
    }
    s->ckpt_file_bytes[0] = s->sb.ckpt_id ? ckpt_file_bytes(s->io, s->dir, s->sb.ckpt_id) : 0;
    s->ckpt_file_bytes[1] =
        s->sb.ckpt_id > 1 ? ckpt_file_bytes(s->io, s->dir, s->sb.ckpt_id - 1) : 0;
    s->replay_counts_lsn = s->sb.ckpt_counts_lsn;
    struct wal_resume resume = {.first_batch = s->sb.resume_batch,
                                .sync = wal_ordered_batches(s->sb.open_durability),
                                .clean_lsn = s->sb.clean_lsn};
    rc = wal_recover(s->wal, s->sb.ckpt_seq, s->sb.ckpt_off, s->sb.ckpt_lsn, s->sb.ckpt_batch,
                     &resume, ops_replay, s);
    if (rc < 0) {
        /* The log's own message, else the replay's (ops_replay names the frame), else rc's. */
        if (*wal_error(s->wal))
            store_set_error("%s", wal_error(s->wal));
        else if (!last_error[0])
            store_set_error("replaying the log of %s: %s", s->dir, idem_strerror(rc));
        return rc;
    }
    /* A checkpoint is installed only once every frame up to its counts LSN is durable, and its
     * entries point up to there: a log that ends before it lost acknowledged batches (a
     * damaged or lost write taken for a torn tail), and the entries would point at space the
     * next appends take. */
    if (wal_recovered_lsn(s->wal) < s->sb.ckpt_counts_lsn) {
        store_set_error("log corrupt in %s: it ends at LSN %llu (segment %llu), before LSN %llu, "
                        "which checkpoint %llu found durable when it was installed",
                        s->dir, (unsigned long long)wal_recovered_lsn(s->wal),
                        (unsigned long long)wal_cur_seq(s->wal),
                        (unsigned long long)s->sb.ckpt_counts_lsn,
                        (unsigned long long)s->sb.ckpt_id);
        return IDEM_ECORRUPT;
    }
    /* Every batch up to the durable mark was complete and durable when the superblock was
     * written: a log that ends before it (a damaged or lost write taken for a torn tail) lost
     * acknowledged batches, where no later batch lies past the end to show it. */
    if (wal_recovered_lsn(s->wal) < s->sb.log_durable_lsn) {
        store_set_error("log corrupt in %s: it ends at LSN %llu (segment %llu), before LSN %llu, "
                        "which the superblock recorded durable",
                        s->dir, (unsigned long long)wal_recovered_lsn(s->wal),
                        (unsigned long long)wal_cur_seq(s->wal),
                        (unsigned long long)s->sb.log_durable_lsn);
        return IDEM_ECORRUPT;
    }
    if (wal_frames_beyond(s->wal))
        fprintf(stderr, "idem: event=recovery_dropped_tail dir=%s frames=%llu reason=\"%s\"\n",
                s->dir, (unsigned long long)wal_frames_beyond(s->wal),
                resume.sync ? "the batch in flight at a crash, or leftovers of earlier ones"
                            : "unflushed batches of an open with durability none, or leftovers");
    s->durable_lsn = wal_last_lsn(s->wal);
    return 0;
}

/* Fills in defaults; returns 0, or IDEM_EINVAL with the option and its bounds named. ram: the
 * memory this process may use (0: unknown). */
static int store_validate_options(idem_options *o, uint64_t ram)
{
    char why[200] = "";
    size_t keys_need = o->max_keys ? index_presize_bytes(o->max_keys) : 0;
    if (o->result_bytes_max == 0) o->result_bytes_max = IDEM_RESULT_BYTES_DEFAULT;
    if (o->segment_bytes == 0) o->segment_bytes = 64u << 20;
    uint64_t rec_max = REC_FIXED_BYTES + IDEM_KEY_BYTES_MAX + IDEM_OWNER_BYTES_MAX +
                       IDEM_NOTE_BYTES_MAX + o->result_bytes_max + 2 * WAL_FRAME_HDR;
    uint64_t seg_min = 4 * WAL_BLOCK + 2 * rec_max;
    if (o->durability < 0 || o->durability > IDEM_DURABILITY_NONE)
        snprintf(why, sizeof why, "durability %d is not sync, batch or none", o->durability);
    else if (o->lease_policy < 0 || o->lease_policy > IDEM_LEASE_REVIEW)
        snprintf(why, sizeof why, "lease_policy %d is not recover or review", o->lease_policy);
    else if (o->io_backend < 0 || o->io_backend > IDEM_IO_THREAD)
        snprintf(why, sizeof why, "io_backend %d is unknown", o->io_backend);
    else if (o->result_bytes_max > IDEM_RESULT_BYTES_LIMIT)
        snprintf(why, sizeof why, "result_bytes_max %u is above %u", o->result_bytes_max,
                 (unsigned)IDEM_RESULT_BYTES_LIMIT);
    else if (o->segment_bytes % WAL_BLOCK || o->segment_bytes > WAL_SEG_BYTES_MAX ||
             o->segment_bytes < seg_min)
        snprintf(why, sizeof why,
                 "segment_bytes %u is not a multiple of %u from %llu to %llu (with "
                 "result_bytes_max %u)",
                 o->segment_bytes, (unsigned)WAL_BLOCK, (unsigned long long)seg_min,
                 (unsigned long long)WAL_SEG_BYTES_MAX, o->result_bytes_max);
    else if (o->max_memory_bytes && o->max_memory_bytes < 2 * index_presize_bytes(0))
        snprintf(why, sizeof why,
                 "max_memory_bytes %llu is less than twice the smallest index (%zu bytes)",
                 (unsigned long long)o->max_memory_bytes, index_presize_bytes(0));
    else if (ram && o->max_memory_bytes > ram)
        snprintf(why, sizeof why,
                 "max_memory_bytes %llu is more than the memory this process may use (%llu, "
                 "the machine's or its cgroup's limit)",
                 (unsigned long long)o->max_memory_bytes, (unsigned long long)ram);
    else if (keys_need == SIZE_MAX)
        snprintf(why, sizeof why, "max_keys %llu is more than the index can hold",
                 (unsigned long long)o->max_keys);
    else if (ram && keys_need > ram)
        snprintf(why, sizeof why,
                 "max_keys %llu needs about %llu bytes of index memory, more than the %llu "
                 "this process may use",
                 (unsigned long long)o->max_keys, (unsigned long long)keys_need,
                 (unsigned long long)ram);
    if (!*why) return 0;
    store_set_error("invalid options: %s", why);
    return IDEM_EINVAL;
}

/* Ends the zero-filler (before the segments it writes are closed) and the remover (the
 * deletes queued: finished), the log let go of the filler first; each one's first error. */
static void helpers_stop(idem_store *s, int *fill_err, int *rm_err)
{
    if (s->wal) wal_set_filler(s->wal, NULL);
    *fill_err = filler_destroy(s->filler);
    *rm_err = remover_destroy(s->remover);
    s->filler = NULL;
    s->remover = NULL;
}

static void store_free(idem_store *s)
{
    int fill_err, rm_err;
    helpers_stop(s, &fill_err, &rm_err);  /* their failures: idem_close's to report */
    if (s->ckr.cw) ckpt_abort(s->ckr.cw); /* a checkpoint in steps, cut short */
    if (s->wal) wal_destroy(s->wal);
    if (s->ix) index_destroy(s->ix);
    audit_close(s);
    disk_reserve_close(&s->reserve);
    if (s->io) io_destroy(s->io);
    lock_release(s->lock_fd);
    pthread_mutex_destroy(&s->mu);
    pthread_rwlock_destroy(&s->rw);
    pthread_mutex_destroy(&s->seen_mu);
    pthread_cond_destroy(&s->cond_ready);
    pthread_cond_destroy(&s->cond_flush);
    for (uint32_t i = 0; i < SEEN_TIERS; i++)
        free(s->seen_tier[i]);
    for (uint32_t i = 1; i < SEEN_CHUNKS_MAX && s->seen_chunk[i]; i++) /* taken in order */
        free(s->seen_chunk[i]);
    free(s->scratch);
    free(s->seg_max_exp);
    compact_free(s);
    ages_free(s);
    waiters_free(s);
    free(s->dir);
    free(s);
}

/* The files remove_leftovers found: segments (kind 0) and checkpoints (kind 1) by number. */
struct leftovers {
    const struct super *sb;
    struct {
        uint64_t n;
        int kind;
    } * v;
    size_t count, cap;
    int nomem;
};

/* Whether name is exactly prefix, 16 hex digits and suffix; *n their value. */
static int name_numbered(const char *name, const char *prefix, const char *suffix, uint64_t *n)
{
    size_t lp = strlen(prefix), ls = strlen(suffix);
    if (strlen(name) != lp + 16 + ls || strncmp(name, prefix, lp) != 0 ||
        strcmp(name + lp + 16, suffix) != 0)
        return 0;
    uint64_t v = 0;
    for (const char *p = name + lp; p < name + lp + 16; p++) {
        int d = *p >= '0' && *p <= '9' ? *p - '0' : *p >= 'a' && *p <= 'f' ? *p - 'a' + 10 : -1;
        if (d < 0) return 0;
        v = v << 4 | (uint64_t)d;
    }
    *n = v;
    return 1;
}

int idem_store_file_name(const char *name)
{
    static const char *const fixed[] = {"super", "super.tmp", "audit.log", DISK_RESERVE_NAME,
                                        DISK_RESERVE_MAKING};
    for (size_t i = 0; i < IDEM_ARRAY_LEN(fixed); i++)
        if (strcmp(name, fixed[i]) == 0) return 1;
    uint64_t n;
    return name_numbered(name, "wal-", ".log", &n) || name_numbered(name, "index-", ".ckpt", &n);
}

static int leftover_seen(const char *name, void *ctx)
{
    struct leftovers *l = ctx;
    uint64_t n;
    int kind;
    if (name_numbered(name, "wal-", ".log", &n) && n < l->sb->wal_first_seq)
        kind = 0;
    else if (name_numbered(name, "index-", ".ckpt", &n) &&
             (n + 1 < l->sb->ckpt_id || n > l->sb->ckpt_id))
        kind = 1;
    else
        return 0;
    if (l->count == l->cap) {
        size_t cap = l->cap ? 2 * l->cap : 16;
        void *v = realloc(l->v, cap * sizeof *l->v);
        if (!v) {
            l->nomem = 1;
            return 1;
        }
        l->v = v;
        l->cap = cap;
    }
    l->v[l->count].n = n;
    l->v[l->count++].kind = kind;
    return 0;
}

/* Removes files a crash or a failed delete left behind, so that they never hold disk space for
 * good: log segments below the first one the superblock names (a retirement cut short between
 * its superblock write and its unlinks, or one of whose unlinks failed; the open's superblock
 * names the first the log holds, after any missing one: store_recover), checkpoints older than
 * the two the superblock copies may name (an install cut short before its unlink), and
 * checkpoints written after the current one but never installed. The directory is listed: a
 * failed delete leaves a file below others that are gone, which a walk down from the files in
 * use would not reach. Called once this open's first superblock copy is durable: neither copy
 * names anything removed here, except segments the other may name before a missing one, which
 * every open skips. */
static void remove_leftovers(idem_store *s)
{
    char path[4096];
    unsigned segs = 0, ckpts = 0;
    struct leftovers l = {.sb = &s->sb};
    int rc = io_list(s->io, s->dir, leftover_seen, &l);
    if (l.nomem) rc = -ENOMEM;
    if (rc < 0)
        fprintf(stderr,
                "idem: event=leftover_not_removed dir=%s error=\"listing the directory: %s\"\n",
                s->dir, strerror(-rc));
    for (size_t i = 0; rc == 0 && i < l.count; i++) { /* one that stays stops none after it */
        if (l.v[i].kind == 0)
            wal_seg_path(s->dir, l.v[i].n, path, sizeof path);
        else
            ckpt_path(s->dir, l.v[i].n, path, sizeof path);
        int del = io_unlink(s->io, path);
        if (del < 0 && del != -ENOENT)
            fprintf(stderr, "idem: event=leftover_not_removed dir=%s file=%s error=\"%s\"\n",
                    s->dir, path, strerror(-del));
        segs += del == 0 && l.v[i].kind == 0;
        ckpts += del == 0 && l.v[i].kind == 1;
    }
    free(l.v);
    if (segs + ckpts == 0) return;
    rc = io_sync_dir(s->io, s->dir);
    fprintf(stderr, "idem: event=leftovers_removed dir=%s segments=%u checkpoints=%u%s\n", s->dir,
            segs, ckpts, rc < 0 ? " dir_sync=failed" : "");
}

static int store_start(idem_store *s)
{
    int64_t start = s->sb.store_clock_ms;
    if (wal_last_clock_ms(s->wal) > start) start = wal_last_clock_ms(s->wal);
    /* The test clock stands still across a reopen too: only a new store reads the wall clock,
     * so no test's outcome depends on how long it ran. */
    int64_t wall = s->clock.wall_ms(s->clock.ctx);
    if (wall > start && (!s->opt.test_clock || start == 0)) start = wall;
    s->clk_store_ms = s->clk_last_ms = start;
    s->clk_mono_ms = mono_now(s);
    s->last_flush_mono_ms = s->clk_mono_ms;
    /* Tokens start above the reservation, and above every token the replay saw (a reservation
     * can never be below those; this guards a damaged superblock), and never at 0. */
    s->token_next = (int64_t)s->sb.token_reserved;
    if (s->token_next <= s->max_token_seen) s->token_next = s->max_token_seen + 1;
    if (s->token_next < 1) s->token_next = 1;
    s->frame_max = (uint32_t)IDEM_ALIGN_UP(WAL_FRAME_HDR + REC_FIXED_BYTES + IDEM_KEY_BYTES_MAX +
                                               IDEM_OWNER_BYTES_MAX + IDEM_NOTE_BYTES_MAX +
                                               s->opt.result_bytes_max,
                                           8);
    int rc = audit_open(s);
    if (rc < 0 || s->opt.read_only) return rc;
    /* Recorded before any batch of this open is written: recovery reads them (wal_resume). */
    s->sb.resume_batch = wal_batch(s->wal);
    s->sb.open_durability = (uint32_t)s->opt.durability + 1;
    s->sb.clean_lsn = 0; /* this open writes past the end the mark names */
    store_lock(s);       /* reserve_tokens lets go of it for its write */
    rc = reserve_tokens(s);
    store_unlock(s);
    if (rc < 0) return rc;
    remove_leftovers(s);
    if (!s->test_sim) reserve_start(s);
    /* A reserve let go before: the flusher makes the spare, where the checkpoints' room is left
     * beside it (spare_make_kept) */
    if (!s->reserve.released) {
        rc = wal_spare_create(s->wal);
        if (rc == IDEM_EFATAL) return rc;
        if (rc == 0) s->seg_max_exp[(wal_cur_seq(s->wal) + 1) % WAL_SEG_SLOTS] = SEG_EXP_EMPTY;
    }
    if (remover_create(s->io, s->dir, &s->remover) < 0) return IDEM_ENOMEM;
    /* Zeros ahead of the log shorten flushes that callers wait for: in sync mode only (batch and
     * none answer before the flush, and the zeros would cost them CPU and disk), and only where
     * a write over written bytes stays in place. On copy on write (btrfs, but for files made
     * NOCOW) the log's write over the zeros takes new space, and failed with ENOSPC on a full
     * disk (fatal for the store) where its write into space only allocated succeeded; elsewhere
     * it is not known. */
    if (s->opt.durability == IDEM_DURABILITY_SYNC && !wal_overwrites_in_place(s->wal)) {
        fprintf(stderr,
                "idem: event=fill_off dir=%s reason=\"the log's file is not known to be written "
                "over in place (files on ext4 and XFS are, and on btrfs files made NOCOW): zeros "
                "written ahead of the log might not keep its space\"\n",
                s->dir);
    } else if (s->opt.durability == IDEM_DURABILITY_SYNC) {
        if (filler_create(s->io, &s->filler) < 0) return IDEM_ENOMEM;
        wal_set_filler(s->wal, s->filler);
    }
    if (index_start_ahead(s->ix) < 0) return IDEM_ENOMEM;
    if (pthread_create(&s->flusher, NULL, flusher_main, s) != 0) return IDEM_ENOMEM;
    s->flusher_started = 1;
    return 0;
}

int store_open_io(const char *dir, const idem_options *o, struct io *io, int simulated,
                  idem_store **out)
{
    last_error[0] = 0;
    /* Room for the longest file name made in it ("/index-<16 hex>.ckpt") in the 4096-byte
     * paths its files are named in: in a longer one the names were cut short, and different
     * segments came out as one file. */
    if (strlen(dir) + 32 >= 4096) {
        io_destroy(io);
        store_set_error("path too long: %s (at most %d bytes)", dir, 4096 - 33);
        return IDEM_EINVAL;
    }
    int64_t t0 = util_monotonic_us();
    idem_store *s = calloc(1, sizeof *s);
    if (!s) {
        io_destroy(io);
        return IDEM_ENOMEM;
    }
    /* Held for microseconds per call, and handed between the callers and the flusher at
     * every flush: spin a little before sleeping, so that a hand-off costs no system call. */
    pthread_mutexattr_t ma;
    pthread_mutexattr_init(&ma);
    pthread_mutexattr_settype(&ma, PTHREAD_MUTEX_ADAPTIVE_NP);
    pthread_mutex_init(&s->mu, &ma);
    /* Writers first: a steady stream of readers must not keep the flusher out. */
    pthread_rwlockattr_t ra;
    pthread_rwlockattr_init(&ra);
    pthread_rwlockattr_setkind_np(&ra, PTHREAD_RWLOCK_PREFER_WRITER_NONRECURSIVE_NP);
    pthread_rwlock_init(&s->rw, &ra);
    pthread_rwlockattr_destroy(&ra);
    /* Held for a few stores (a counter entry taken): spins like mu. */
    pthread_mutex_init(&s->seen_mu, &ma);
    pthread_mutexattr_destroy(&ma);
    util_cond_init_monotonic(&s->cond_ready);
    util_cond_init_monotonic(&s->cond_flush);
    s->lock_fd = -1;
    s->reserve.fd = -1;
    s->io = io;
    s->test_sim = simulated;
    s->opt = o ? *o : (idem_options){0};
    s->clock.wall_ms = s->opt.clock && s->opt.clock->wall_ms ? s->opt.clock->wall_ms : sys_wall;
    s->clock.monotonic_ms =
        s->opt.clock && s->opt.clock->monotonic_ms ? s->opt.clock->monotonic_ms : sys_mono;
    s->clock.ctx = s->opt.clock ? s->opt.clock->ctx : NULL;
    s->opt.clock = NULL;
    s->dir = strdup(dir);
    s->memory_avail = util_memory_bytes(); /* read once: the cgroup's files are files */
    int rc = s->dir ? store_validate_options(&s->opt, s->memory_avail) : IDEM_ENOMEM;
    if (rc < 0) {
        if (!s->dir) store_set_error("out of memory");
        goto fail;
    }
    /* A read-only open makes nothing: not the directory (below, not the lock file either when
     * it cannot be written) nor a store. */
    rc = s->opt.read_only ? -EEXIST : io_mkdir(io, dir); /* its name synced as a store is made */
    if (rc < 0 && rc != -EEXIST) {
        store_set_error("cannot create %s: %s", dir, strerror(-rc));
        rc = s->opt.read_only ? IDEM_EIO : (UTIL_NO_SPACE(rc) ? IDEM_EFULL : IDEM_EIO);
        goto fail;
    }
    if (!simulated) {
        char err[512];
        rc = lock_acquire(dir, s->opt.read_only ? LOCK_AS_READER : LOCK_AS_OWNER, &s->lock_fd, err,
                          sizeof err);
        if (rc < 0) {
            store_set_error("%s", err);
            goto fail;
        }
        if ((rc = import_mark_check(dir, &s->opt)) < 0) goto fail;
    }
    char err[512] = "";
    rc = super_load(io, dir, &s->sb, !s->opt.read_only, err, sizeof err);
    int fresh = rc == IDEM_ENOTFOUND;
    if (rc < 0 && !fresh) {
        store_set_error("%s", err);
        goto fail;
    }
    if (fresh && s->opt.read_only) {
        store_set_error("%s holds no store (read-only open creates nothing)", dir);
        rc = IDEM_ENOTFOUND;
        goto fail;
    }
    if (fresh && (rc = store_files_left(io, dir)) < 0) goto fail;
    if (!fresh) s->opt.segment_bytes = s->sb.seg_bytes;
    /* The log takes two segments from the start (the current one and the one made ahead), and
     * a third as it goes on: a disk limit below three would answer FULL to every new claim
     * from the first, or from the first segment's end, and say nothing at the open. */
    if (s->opt.max_disk_bytes && s->opt.max_disk_bytes < 3 * (uint64_t)s->opt.segment_bytes) {
        store_set_error("invalid options: max_disk_bytes %llu is less than three log segments "
                        "of the store (%llu bytes): every new claim would be FULL",
                        (unsigned long long)s->opt.max_disk_bytes,
                        3 * (unsigned long long)s->opt.segment_bytes);
        rc = IDEM_EINVAL;
        goto fail;
    }
    s->seg_max_exp = malloc(WAL_SEG_SLOTS * sizeof *s->seg_max_exp);
    s->seg_exp = calloc(WAL_SEG_SLOTS, sizeof *s->seg_exp);
    if (!s->seg_max_exp || !s->seg_exp) {
        rc = IDEM_ENOMEM;
        goto fail;
    }
    /* Horizons of segments written before this open are measured when they reach the head. */
    for (uint32_t i = 0; i < WAL_SEG_SLOTS; i++)
        s->seg_max_exp[i] = SEG_EXP_UNKNOWN;
    rc = wal_create(io, dir, s->opt.segment_bytes, &s->wal);
    if (rc == 0) rc = index_create(index_presize_keys(s), &s->ix) < 0 ? IDEM_ENOMEM : 0;
    if (rc < 0) goto fail;
    rc = fresh ? store_init_new(s) : store_recover(s);
    if (rc < 0) {
        if (!*last_error)
            store_set_error("cannot %s store %s: %s", fresh ? "create" : "recover", dir,
                            idem_strerror(rc));
        goto fail;
    }
    io_fault_clear();
    rc = store_start(s);
    if (rc < 0) {
        /* A superblock or segment write that failed here is named by its call (a disk with no
         * block left for a copy-on-write rewrite: "write or its fdatasync: No space ..."). */
        if (!*last_error && io_fault_last.err && (rc == IDEM_EFATAL || rc == IDEM_EIO))
            store_set_error("cannot start store %s: %s: %s", dir, io_fault_last.call,
                            strerror(-io_fault_last.err));
        else if (!*last_error)
            store_set_error("cannot start store %s: %s", dir, idem_strerror(rc));
        goto fail;
    }
    s->st.open_ms = (uint64_t)(util_monotonic_us() - t0) / 1000;
    *out = s;
    return 0;
fail:
    store_free(s);
    return rc;
}

/* A disk limit larger than the file system that holds dir (or its parent, for a store not made
 * yet) can never be reached: refused by name. Returns 0 or IDEM_EINVAL. */
static int disk_limit_check(const char *dir, uint64_t max_disk_bytes)
{
    struct statvfs vfs;
    char parent[PATH_MAX];
    const char *at = dir;
    if (!max_disk_bytes) return 0;
    if (statvfs(at, &vfs) != 0) {
        /* The parent: dir without its last name (and the slashes after it). */
        size_t n = strlen(dir);
        while (n > 1 && dir[n - 1] == '/')
            n--;
        while (n > 0 && dir[n - 1] != '/')
            n--;
        while (n > 1 && dir[n - 1] == '/')
            n--;
        if (n >= sizeof parent) return 0;
        memcpy(parent, n ? dir : ".", n ? n : 1);
        parent[n ? n : 1] = 0;
        at = parent;
        if (statvfs(at, &vfs) != 0) return 0; /* the open names what is wrong with dir */
    }
    uint64_t size = (uint64_t)vfs.f_blocks * vfs.f_frsize;
    if (max_disk_bytes <= size) return 0;
    store_set_error("invalid options: max_disk_bytes %llu is more than the file system of %s "
                    "holds (%llu)",
                    (unsigned long long)max_disk_bytes, at, (unsigned long long)size);
    return IDEM_EINVAL;
}

int idem_open(const char *dir, const idem_options *o, idem_store **out)
{
    if (!dir || !*dir || !out) return IDEM_EINVAL;
    idem_options opt;
    if (o)
        opt = *o;
    else
        idem_options_init(&opt);
    if (disk_limit_check(dir, opt.max_disk_bytes)) return IDEM_EINVAL;
    /* IDEM_IO_BACKEND=thread|io_uring overrides an automatic choice (operators in sandboxes
     * that refuse io_uring quietly; the test suite runs once on each backend). */
    const char *env = opt.io_backend == IDEM_IO_AUTO ? getenv("IDEM_IO_BACKEND") : NULL;
    if (env && *env && strcmp(env, "thread") != 0 && strcmp(env, "io_uring") != 0) {
        /* A misspelt override (the workaround for a sandbox) was taken for none. */
        store_set_error("IDEM_IO_BACKEND=%.64s: not a backend (thread or io_uring)", env);
        return IDEM_EINVAL;
    }
    if (opt.io_backend == IDEM_IO_AUTO && env && strcmp(env, "thread") == 0)
        opt.io_backend = IDEM_IO_THREAD;
    if (opt.io_backend == IDEM_IO_AUTO && env && strcmp(env, "io_uring") == 0)
        opt.io_backend = IDEM_IO_URING;
    struct io *io = NULL;
    int rc = -ENOSYS;
    if (opt.io_backend == IDEM_IO_AUTO || opt.io_backend == IDEM_IO_URING) {
        rc = io_uring_create(256, &io);
        if (rc < 0 && opt.io_backend == IDEM_IO_URING) {
            store_set_error("io_uring refused: %s", strerror(-rc));
            return IDEM_ENOTSUP;
        }
        if (rc < 0)
            fprintf(stderr, "idem: event=io_backend_fallback reason=\"io_uring: %s\"\n",
                    strerror(-rc));
    }
    if (rc < 0) {
        rc = io_thread_create(&io);
        if (rc < 0) return IDEM_ENOMEM;
    }
    return store_open_io(dir, &opt, io, 0, out);
}

int idem_close(idem_store *s)
{
    if (!s) return IDEM_EINVAL;
    store_lock(s);
    /* A backup still copying reads through s->io and needs the flusher to make its start
     * durable: it ends first (no new one starts once closing is set). */
    while (s->backups)
        store_wait(s, &s->cond_ready);
    s->closing = 1;
    ops_wake(s, NULL, 0); /* parked claims answer busy */
    int rc = 0;
    io_fault_clear(); /* a failure below is named by the calls of the close (store_fail) */
    if (!s->opt.read_only && !s->fatal) rc = checkpoint_at_close(s);
    /* A failed open, write or flush of the closing checkpoint is named as any other (a full
     * disk or no descriptor or memory is not: the log holds everything). */
    if ((rc == IDEM_EIO || rc == IDEM_EFATAL) && !s->fatal)
        store_fail(s, 0, "writing the closing checkpoint");
    pthread_cond_signal(&s->cond_flush);
    store_unlock(s);
    if (s->flusher_started) pthread_join(s->flusher, NULL);
    /* The helpers' last writes and syncs (a piece of zeros, the directory after the closing
     * retirement's deletes) fail the close as they would fail the store. */
    int fill_err, rm_err;
    helpers_stop(s, &fill_err, &rm_err);
    if ((fill_err || rm_err) && !s->fatal) {
        store_lock(s);
        helper_failed(s, fill_err, rm_err);
        store_unlock(s);
    }
    while (s->queues)
        idem_queue_close(s->queues);
    if (s->fatal) rc = IDEM_EFATAL;
    store_free(s);
    return rc;
}

void store_abandon(idem_store *s)
{
    store_lock(s);
    s->abandoned = 1;
    pthread_cond_signal(&s->cond_flush);
    store_unlock(s);
    if (s->flusher_started) pthread_join(s->flusher, NULL);
    while (s->queues)
        idem_queue_close(s->queues);
    store_free(s);
}

void idem_cancel_waits(idem_store *s)
{
    store_lock(s);
    s->no_wait = 1;
    ops_wake(s, NULL, 0);
    store_unlock(s);
}

int idem_is_fatal(const idem_store *s)
{
    return __atomic_load_n(&s->fatal, __ATOMIC_RELAXED);
}

const char *idem_fatal_reason(const idem_store *s)
{
    return __atomic_load_n(&s->fatal, __ATOMIC_ACQUIRE) ? s->fatal_why : "";
}

const char *idem_io_backend_name(const idem_store *s)
{
    return s->io->ops->name;
}

/* ---- Queues ---- */

int idem_queue_open(idem_store *s, uint32_t depth, idem_queue **out)
{
    if (!s || !out || depth == 0 || depth > 65536) return IDEM_EINVAL;
    struct idem_queue *q = calloc(1, sizeof *q);
    if (!q) {
        store_set_error("cannot make a queue of depth %u: %s", (unsigned)depth, strerror(ENOMEM));
        errno = ENOMEM;
        return IDEM_ENOMEM;
    }
    q->slots = aligned_alloc(_Alignof(struct qslot), depth * sizeof *q->slots);
    if (q->slots) memset(q->slots, 0, depth * sizeof *q->slots);
    q->ext = calloc(depth, sizeof *q->ext);
    q->returned = calloc(depth, sizeof *q->returned);
    q->free_stack = calloc(depth, sizeof *q->free_stack);
    uint32_t chains = 1;
    while (chains < depth)
        chains <<= 1;
    q->by_user_data = calloc(chains, sizeof *q->by_user_data);
    q->by_user_data_mask = chains - 1;
    q->woken_sort = calloc(depth, sizeof *q->woken_sort);
    /* The caller is told which resource ran out: a process out of descriptors is not out of
     * memory, and its operator looks in another place. */
    int err = 0;
    const char *what = "its arrays";
    q->efd = -1;
    if (!q->slots || !q->ext || !q->returned || !q->free_stack || !q->by_user_data ||
        !q->woken_sort)
        err = ENOMEM;
    else if ((q->efd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC)) < 0)
        err = errno, what = "its eventfd";
    else if ((err = util_cond_init_monotonic(&q->cond)) != 0)
        what = "its condition variable";
    if (err) {
        store_set_error("cannot make a queue of depth %u: %s: %s", (unsigned)depth, what,
                        strerror(err));
        if (q->efd >= 0) close(q->efd);
        free(q->slots);
        free(q->ext);
        free(q->returned);
        free(q->free_stack);
        free(q->by_user_data);
        free(q->woken_sort);
        free(q);
        errno = err;
        return IDEM_ENOMEM;
    }
    q->s = s;
    q->depth = depth;
    for (uint32_t i = 0; i < depth; i++) {
        q->slots[i].ext = &q->ext[i];
        q->ext[i].q = q;
        q->free_stack[q->nfree++] = depth - 1 - i;
    }
    store_lock(s);
    q->next = s->queues;
    if (s->queues) s->queues->prev = q;
    s->queues = q;
    store_unlock(s);
    *out = q;
    return 0;
}

#define FREE_CLEAR(p) (free(p), (p) = NULL)

void idem_queue_trim(idem_queue *q)
{
    FREE_CLEAR(q->scan_keys);
    FREE_CLEAR(q->scan_lens);
    FREE_CLEAR(q->scan_buf);
    q->scan_cap = q->scan_used = q->scan_n = q->scan_max = 0;
    FREE_CLEAR(q->audit);
    FREE_CLEAR(q->audit_mem);
    FREE_CLEAR(q->audit_place);
    FREE_CLEAR(q->audit_read);
    FREE_CLEAR(q->audit_hits);
    q->audit_mem_cap = q->audit_read_cap = 0;
    FREE_CLEAR(q->att_recs);
    FREE_CLEAR(q->att_buf);
    q->att_cap = 0;
}

void idem_queue_close(idem_queue *q)
{
    if (!q) return;
    idem_store *s = q->s;
    store_lock(s);
    wake_list_remove(s, q);
    while (__atomic_load_n(&q->pins, __ATOMIC_ACQUIRE)) { /* a waker is about to signal q */
        store_unlock(s);
        struct timespec pause = {0, 50000}; /* a pin lasts microseconds; sleep, not spin */
        nanosleep(&pause, NULL);
        store_lock(s);
    }
    queue_merge_woken(q);
    for (struct qslot *sl = q->head; sl; sl = sl->lnext)
        slot_durable_done(s, sl);
    for (struct qslot *sl = q->parked_head; sl; sl = sl->lnext) /* drop its parked claims */
        waiters_remove(s, sl);
    ops_seen_return(s, q);
    if (q->prev)
        q->prev->next = q->next;
    else
        s->queues = q->next;
    if (q->next) q->next->prev = q->prev;
    store_unlock(s);
    for (uint32_t i = 0; i < q->depth; i++)
        free(q->slots[i].buf);
    free(q->slots);
    free(q->ext);
    free(q->returned);
    free(q->free_stack);
    free(q->by_user_data);
    free(q->woken_sort);
    idem_queue_trim(q);
    close(q->efd);
    pthread_cond_destroy(&q->cond);
    free(q);
}

int idem_queue_fd(idem_queue *q)
{
    store_lock(q->s);
    if (!q->fd_used) {
        q->fd_used = 1;
        /* Completions may be ready already. Only then: a readable fd with nothing to poll
         * would wake its owner's event loop over and over. */
        if (queue_ready(q->s, q)) queue_signal(q);
    }
    store_unlock(q->s);
    return q->efd;
}

uint32_t idem_queue_pending(const idem_queue *q)
{
    return q->active;
}

void *qslot_reserve(struct qslot *sl, size_t len)
{
    if (sl->buf_used + len > sl->buf_cap) {
        size_t cap = sl->buf_cap ? sl->buf_cap : 256;
        while (cap < sl->buf_used + len)
            cap *= 2;
        if (cap > UINT32_MAX) return NULL;
        uint8_t *n = realloc(sl->buf, cap);
        if (!n) return NULL;
        /* Copies made before would dangle: re-base every pointer into the old buffer. */
        if (n != sl->buf && sl->buf_used) {
            const void **ps[] = {
                &sl->c.data,           &sl->ext->record.key,    &sl->ext->record.owner,
                &sl->ext->record.note, &sl->ext->record.result, &sl->ext->op.key,
                &sl->ext->op.fp,       &sl->ext->op.owner};
            for (size_t i = 0; i < IDEM_ARRAY_LEN(ps); i++) {
                const uint8_t *old = *ps[i];
                if (old >= sl->buf && old < sl->buf + sl->buf_used) *ps[i] = n + (old - sl->buf);
            }
        }
        sl->buf = n;
        sl->buf_cap = (uint32_t)cap;
    }
    return sl->buf + sl->buf_used;
}

const void *qslot_copy(struct qslot *sl, const void *p, size_t len)
{
    if (len == 0) return "";
    void *dst = qslot_reserve(sl, len);
    if (!dst) return NULL;
    memcpy(dst, p, len);
    sl->buf_used += (uint32_t)len;
    return dst;
}

/* A slot keeps a buffer up to QSLOT_BUF_SMALL for its next operation. A larger one (a large
 * result copied out) is kept only up to QSLOT_BUF_KEEP, by at most QSLOT_BIG_KEPT free slots of
 * a queue: a queue's memory does not stay at its largest answers, times its depth (8,192 slots
 * that each once copied a 64 KiB result kept 1 GiB). */
#define QSLOT_BUF_SMALL (4u << 10)
#define QSLOT_BUF_KEEP  (128u << 10)
#define QSLOT_BIG_KEPT  32u

/* A queue's two slot lists (outstanding, parked) are doubly linked through lprev and lnext;
 * these keep head and tail right. after NULL inserts at the head. */
static void slot_list_unlink(struct qslot **head, struct qslot **tail, struct qslot *sl)
{
    if (sl->lprev)
        sl->lprev->lnext = sl->lnext;
    else
        *head = sl->lnext;
    if (sl->lnext)
        sl->lnext->lprev = sl->lprev;
    else
        *tail = sl->lprev;
}

static void slot_list_insert(struct qslot **head, struct qslot **tail, struct qslot *after,
                             struct qslot *sl)
{
    sl->lprev = after;
    sl->lnext = after ? after->lnext : *head;
    if (sl->lnext)
        sl->lnext->lprev = sl;
    else
        *tail = sl;
    if (after)
        after->lnext = sl;
    else
        *head = sl;
}

static struct qslot *slot_take(idem_queue *q)
{
    if (q->nfree == 0) return NULL;
    struct qslot *sl = &q->slots[q->free_stack[--q->nfree]];
    if (sl->buf_cap > QSLOT_BUF_SMALL) q->kept_big--;
    sl->state = SLOT_DONE;
    sl->seq = q->seq_next++;
    sl->need_lsn = 0;
    sl->durable_wait = 0;
    sl->buf_used = 0;
    /* The record part is filled (whole) only when found is set: zero the rest. */
    memset(&sl->c, 0, sizeof sl->c);
    slot_list_insert(&q->head, &q->tail, q->tail, sl); /* outstanding, in submission order */
    q->active++;
    return sl;
}

static uint32_t *by_user_data_chain(const idem_queue *q, uint64_t user_data)
{
    return &q->by_user_data[(user_data * 0x9E3779B97F4A7C15ull >> 32) & q->by_user_data_mask];
}

void queue_park(idem_queue *q, struct qslot *sl)
{
    slot_list_unlink(&q->head, &q->tail, sl);
    slot_list_insert(&q->parked_head, &q->parked_tail, q->parked_tail, sl);
    uint32_t *chain = by_user_data_chain(q, sl->c.user_data);
    sl->ext->park_next = *chain;
    *chain = (uint32_t)(sl - q->slots) + 1;
}

struct qslot *queue_parked_of(const idem_queue *q, uint64_t user_data)
{
    struct qslot *first = NULL;
    for (uint32_t i = *by_user_data_chain(q, user_data); i; i = q->ext[i - 1].park_next) {
        struct qslot *sl = &q->slots[i - 1];
        if (sl->c.user_data == user_data && (!first || sl->seq < first->seq)) first = sl;
    }
    return first;
}

/* Each answered parked claim put back in its place by a walk from the tail passed every one
 * answered since and not yet polled: a server whose parked clients all hung up at once paid
 * N^2/2 steps for their cancels. They wait on the woken list for one merge instead. */
void queue_unpark(idem_queue *q, struct qslot *sl)
{
    slot_list_unlink(&q->parked_head, &q->parked_tail, sl);
    uint32_t *link = by_user_data_chain(q, sl->c.user_data), me = (uint32_t)(sl - q->slots) + 1;
    while (*link != me)
        link = &q->ext[*link - 1].park_next;
    *link = sl->ext->park_next;
    sl->lnext = q->woken;
    q->woken = sl;
}

static int by_seq(const void *a, const void *b)
{
    uint64_t x = (*(struct qslot *const *)a)->seq, y = (*(struct qslot *const *)b)->seq;
    return x < y ? -1 : x > y;
}

/* Puts the woken claims back on the outstanding list in their places by seq: sorted, then one
 * walk from the head (a claim that waited is older than most of what is outstanding). */
static void queue_merge_woken(idem_queue *q)
{
    if (!q->woken) return;
    uint32_t n = 0;
    for (struct qslot *sl = q->woken; sl; sl = sl->lnext)
        q->woken_sort[n++] = sl;
    if (n > 1) qsort(q->woken_sort, n, sizeof *q->woken_sort, by_seq);
    struct qslot *at = q->head;
    for (uint32_t i = 0; i < n; i++) {
        struct qslot *w = q->woken_sort[i];
        while (at && at->seq < w->seq)
            at = at->lnext;
        slot_list_insert(&q->head, &q->tail, at ? at->lprev : q->tail, w);
    }
    q->woken = NULL;
}

static void release_returned(idem_queue *q)
{
    for (uint32_t i = 0; i < q->nreturned; i++) {
        struct qslot *sl = q->returned[i];
        if (sl->buf_cap > QSLOT_BUF_SMALL) {
            if (sl->buf_cap <= QSLOT_BUF_KEEP && q->kept_big < QSLOT_BIG_KEPT) {
                q->kept_big++; /* slot_take counts it out */
            } else {
                free(sl->buf);
                sl->buf = NULL;
                sl->buf_cap = 0;
            }
        }
        sl->state = SLOT_FREE;
        q->free_stack[q->nfree++] = (uint32_t)(sl - q->slots);
    }
    q->nreturned = 0;
}

/* A group of deletes (IDEM_F_WITH_NEXT) being taken by idem_submit. */
struct del_group {
    size_t left; /* its operations not yet taken */
    int err;     /* 0: each delete runs; IDEM_ESTATE: refused (ops_del_group_refuse); any other:
                  * every operation completes with it, and nothing is written */
};

/* Begins the group at ops[at] (mu held): its length and fate in *g. Returns 1, taking nothing,
 * when the queue lacks room for all of it. Room in the log and the audit trail for every delete
 * is made before the lookups (waiting for the flusher if need be), so that no delete of a group
 * that goes ahead fails for want of it. */
static int del_group_begin(idem_store *s, const idem_queue *q, const idem_op *ops, size_t n,
                           size_t at, struct del_group *g)
{
    size_t end = at;
    uint32_t bytes = 0;
    while (end < n && ops[end].kind == IDEM_OP_DEL && (ops[end].flags & IDEM_F_WITH_NEXT))
        end++;
    if (end == n || ops[end].kind != IDEM_OP_DEL) { /* a chain without its last delete */
        g->left = end - at;
        g->err = IDEM_EINVAL;
        return 0;
    }
    g->left = end - at + 1;
    if (q->nfree < g->left) return 1;
    if (g->left > IDEM_DEL_GROUP_MAX) {
        g->err = IDEM_EINVAL;
        return 0;
    }
    for (size_t i = at; i <= end; i++) { /* each one's DELETE frame */
        uint32_t k = ops[i].key_len < IDEM_KEY_BYTES_MAX ? ops[i].key_len : IDEM_KEY_BYTES_MAX;
        bytes += (uint32_t)IDEM_ALIGN_UP(WAL_FRAME_HDR + 8 + k, 8);
    }
    int rc = s->closing ? IDEM_ECLOSED : s->opt.read_only ? IDEM_EREADONLY : 0;
    /* Each append checks its room from the next block boundary (append_reserved), and pads
     * a block's last bytes: two blocks more cover every delete's check. */
    if (rc == 0) rc = store_room_for(s, bytes + 2 * WAL_BLOCK);
    if (rc == 0) rc = audit_reserve_n(s, (uint32_t)g->left);
    if (rc == 0) rc = ops_del_group_check(s, &ops[at], g->left);
    g->err = rc;
    return 0;
}

#define SUBMIT_AHEAD 8   /* operations between a prefetch and its use */
#define READ_RUN_OPS 128 /* claims answered per hold of rw's read side (about 40 us) */
/* idem_exec: after this many claims in a row whose keys the read side did not find committed,
 * it is tried with one claim in EXEC_READ_PROBE only (a power of two). */
#define EXEC_READ_MISSES 8u
#define EXEC_READ_PROBE  32u

/* Operations overlap their cache misses: 2 x SUBMIT_AHEAD ahead the key is hashed and its index
 * slot fetched, SUBMIT_AHEAD ahead the record and the repeat counters that slot names. (Issuing
 * the loads of 8 operations back to back instead was measured slower.) With rw held either way
 * (the slot peeked at is read). */
struct ahead {
    uint64_t hv[2 * SUBMIT_AHEAD];
    int hok[2 * SUBMIT_AHEAD];
    size_t pre; /* operations hashed */
};

/* Prefetches for ops[done]'s successors; returns ops[done]'s hash (NULL: none, see
 * ops_hint_hash). */
static const uint64_t *ahead_step(const idem_store *s, struct ahead *ah, const idem_op *ops,
                                  size_t n, size_t done)
{
    for (; ah->pre < n && ah->pre < done + 2 * SUBMIT_AHEAD; ah->pre++) {
        size_t k = ah->pre % (2 * SUBMIT_AHEAD);
        ah->hok[k] = ops_hint_hash(s, &ops[ah->pre], &ah->hv[k]);
        if (ah->hok[k]) index_prefetch(s->ix, ah->hv[k]);
    }
    size_t a = done + SUBMIT_AHEAD, ka = a % (2 * SUBMIT_AHEAD);
    if (a < ah->pre && ah->hok[ka]) {
        const struct index_slot *hit = index_peek(s->ix, ah->hv[ka]);
        if (hit) ops_prefetch_record(s, hit);
    }
    size_t kd = done % (2 * SUBMIT_AHEAD);
    return ah->hok[kd] ? &ah->hv[kd] : NULL;
}

/* idem_submit with mu held. */
static int submit_locked(idem_queue *q, const idem_op *ops, size_t n)
{
    idem_store *s = q->s;
    size_t done = 0;
    int any_ready = 0;
    store_now(s);
    s->mono_batch_ms = mono_now(s);
    s->clk_frozen = 1;
    struct ahead ah = {.pre = 0};
    struct del_group grp = {0, 0}; /* a group of deletes under way (IDEM_F_WITH_NEXT) */
    int too_big = 0;
    for (; done < n; done++) {
        if (grp.left == 0 && ops[done].kind == IDEM_OP_DEL &&
            (ops[done].flags & IDEM_F_WITH_NEXT) && del_group_begin(s, q, ops, n, done, &grp)) {
            too_big = grp.left > q->depth; /* could never be accepted whole */
            grp.left = 0;
            break;
        }
        const uint64_t *hash = ahead_step(s, &ah, ops, n, done);
        struct qslot *sl = slot_take(q);
        if (!sl) break;
        sl->c.user_data = ops[done].user_data;
        if (grp.left && grp.err == IDEM_ESTATE)
            ops_del_group_refuse(s, sl, &ops[done]);
        else if (grp.left && grp.err)
            sl->c.err = grp.err;
        else
            ops_apply(s, sl, &ops[done], hash, grp.left > 0); /* a group made its room */
        grp.left -= grp.left > 0;
        any_ready |= slot_ready(s, sl);
    }
    s->clk_frozen = 0;
    store_appended(s);
    if (any_ready) queue_signal(q);
    return too_big && done == 0 ? IDEM_EINVAL : (int)done;
}

/* The leading claims of ops that find their key committed, answered under rw's read side (ops.c)
 * in runs of READ_RUN_OPS, so that threads submitting duplicates use every core; stops at the
 * first operation that needs the locked path, or a full queue. Returns how many it took. With
 * only_free, nothing is tried while a writer holds or waits for the lock: a blocking call then
 * waits once, for mu, instead of twice (blocking-64 lost about a fifth without this). */
static size_t submit_reads(idem_queue *q, const idem_op *ops, size_t n, int only_free, int *missed)
{
    idem_store *s = q->s;
    size_t done = 0;
    int any_ready = 0, more = n > 0 && ops[0].kind == IDEM_OP_CLAIM;
    struct ahead ah = {.pre = 0};
    for (int first = 1; more; first = 0) {
        struct read_run run = {.q = q};
        if (!first || !only_free)
            pthread_rwlock_rdlock(&s->rw);
        else if (pthread_rwlock_tryrdlock(&s->rw) != 0)
            break;
        more = ops_read_begin(s, &run);
        for (size_t end = done + READ_RUN_OPS; more && done < n && done < end; done++) {
            struct read_hit hit;
            const uint64_t *hash = ahead_step(s, &ah, ops, n, done);
            int found = ops_read_find(s, &ops[done], hash, &run, &hit);
            struct qslot *sl = found ? slot_take(q) : NULL;
            if (!sl) {
                *missed = !found;
                more = 0;
                break;
            }
            sl->c.user_data = ops[done].user_data;
            ops_read_answer(s, sl, &hit, &run);
            any_ready |= slot_ready(s, sl);
        }
        ops_read_end(s, &run);
        pthread_rwlock_unlock(&s->rw);
        more &= done < n;
    }
    if (any_ready) queue_signal(q);
    return done;
}

int idem_submit(idem_queue *q, const idem_op *ops, size_t n)
{
    if (!q || (!ops && n) || n > IDEM_BATCH_MAX) return IDEM_EINVAL;
    release_returned(q);
    int missed = 0;
    size_t done = submit_reads(q, ops, n, 0, &missed);
    if (done == n) return (int)done;
    store_lock(q->s);
    int rc = submit_locked(q, ops + done, n - done);
    store_unlock(q->s);
    if (rc < 0) return done ? (int)done : rc;
    return (int)done + rc;
}

/* Delivers ready completions in submission order (parked claims are on a list of their own). The
 * walk stops at the first completion that waits for a flush: later ones almost always wait for
 * the same or a later flush, so the cost stays proportional to what is delivered. */
static size_t collect_ready(idem_queue *q, idem_completion *out, size_t max)
{
    idem_store *s = q->s;
    size_t n = 0;
    queue_merge_woken(q);
    struct qslot *sl = q->head;
    while (sl && n < max) {
        struct qslot *next = sl->lnext;
        if (sl->state == SLOT_DONE) {
            if (!slot_ready(s, sl)) break;
            /* The record is filled only when found (idem.h): most completions are 64 bytes. */
            memcpy(&out[n], &sl->c, sizeof sl->c);
            if (sl->c.found) out[n].record = sl->ext->record;
            n++;
            slot_list_unlink(&q->head, &q->tail, sl);
            slot_durable_done(s, sl);
            sl->state = SLOT_RETURNED; /* freed at the next call */
            q->returned[q->nreturned++] = sl;
            q->active--;
        }
        sl = next;
    }
    return n;
}

/* Empties the queue's eventfd (if its owner asked for one): what it signalled is about to be
 * collected. */
static void queue_drain_fd(idem_queue *q)
{
    uint64_t drain;
    if (q->fd_used && read(q->efd, &drain, sizeof drain) < 0) {
        /* nothing signalled */
    }
}

/* idem_poll with mu held; returns with mu held, and the queues to pass the wake cascade on to
 * (notify_ready_unlocked) in pass[0..*npass), to be signalled once mu is let go of. */
static size_t poll_locked(idem_queue *q, idem_completion *out, size_t max, int timeout_ms,
                          struct idem_queue **pass, int *npass)
{
    idem_store *s = q->s;
    size_t n = collect_ready(q, out, max);
    if (n == 0 && timeout_ms != 0 && q->active > 0) {
        struct timespec ts;
        clock_gettime(CLOCK_MONOTONIC, &ts);
        if (timeout_ms > 0) {
            ts.tv_sec += timeout_ms / 1000;
            ts.tv_nsec += (timeout_ms % 1000) * 1000000L;
            if (ts.tv_nsec >= 1000000000L) {
                ts.tv_sec++;
                ts.tv_nsec -= 1000000000L;
            }
        }
        q->polling++;
        pthread_cond_signal(&s->cond_flush);
        while (n == 0) {
            int rc = 0;
            if (timeout_ms > 0)
                rc = store_timedwait(s, &q->cond, &ts);
            else
                store_wait(s, &q->cond);
            n = collect_ready(q, out, max);
            if (rc == ETIMEDOUT) break;
            if (n == 0) { /* woken for nothing: the cascade goes on all the same (mu held:
                           * rare for blocking calls, common for parked WAIT claims) */
                struct idem_queue *more[WAKE_FANOUT];
                int nmore = wake_take(s, q, more);
                wake_signal(s, more, nmore);
            }
        }
        q->polling--;
    }
    *npass = s->wake_head ? wake_take(s, q, pass) : 0;
    return n;
}

int idem_poll(idem_queue *q, idem_completion *out, size_t max, int timeout_ms)
{
    if (!q || (!out && max)) return IDEM_EINVAL;
    if (max == 0) return 0; /* room for nothing: nothing to wait for */
    idem_store *s = q->s;
    release_returned(q);
    queue_drain_fd(q);
    /* What is ready now is collected under rw's read side: threads answering claims without the
     * store's lock (submit_reads) do not stop one another to collect (collect_ready reads the
     * queue and the durable LSN; parked claims are changed with the store's lock). */
    pthread_rwlock_rdlock(&s->rw);
    size_t n = collect_ready(q, out, max);
    pthread_rwlock_unlock(&s->rw);
    if (n > 0) return (int)n;
    struct idem_queue *pass[WAKE_FANOUT];
    int npass;
    store_lock(s);
    n = poll_locked(q, out, max, timeout_ms, pass, &npass);
    store_unlock(s);
    wake_signal(s, pass, npass);
    return (int)n;
}

int idem_exec(idem_queue *q, const idem_op *op, idem_completion *c)
{
    if (!q || !op) return IDEM_EINVAL;
    if (q->active > 0) return IDEM_EBUSY;
    idem_store *s = q->s;
    idem_completion tmp;
    idem_completion *dst = c ? c : &tmp;
    struct idem_queue *pass[WAKE_FANOUT];
    int npass = 0;
    release_returned(q);
    /* A caller whose claims the read side keeps missing (new keys) tries it only now and then
     * (one claim in EXEC_READ_PROBE: other calls, which it never answers, do not count):
     * a try costs a lock, a clock reading and a lookup, all made again on the locked path (the
     * growth case, one thread in durability none, ran about a sixth faster without them). */
    int missed = 0, try_read = op->kind == IDEM_OP_CLAIM &&
                               (q->exec_read_misses < EXEC_READ_MISSES ||
                                (++q->exec_read_skips & (EXEC_READ_PROBE - 1)) == 0);
    if (try_read && submit_reads(q, op, 1, 1, &missed) == 1) {
        q->exec_read_misses = 0;
        /* Answered without the store's lock: collected at once when what it reports is
         * durable (read under rw: the flusher moves the durable LSN with mu). */
        pthread_rwlock_rdlock(&s->rw);
        size_t got = collect_ready(q, dst, 1);
        pthread_rwlock_unlock(&s->rw);
        if (got == 1) {
            queue_drain_fd(q);
            return dst->err;
        }
        store_lock(s);
        poll_locked(q, dst, 1, -1, pass, &npass);
        store_unlock(s);
        wake_signal(s, pass, npass);
        queue_drain_fd(q);
        return dst->err;
    }
    q->exec_read_misses +=
        missed && q->exec_read_misses < EXEC_READ_MISSES; /* a busy lock: no sign */
    /* Submit and wait in one hold of mu: 64 threads making blocking calls contend for it. */
    store_lock(s);
    int rc = submit_locked(q, op, 1);
    size_t n = rc == 1 ? poll_locked(q, dst, 1, -1, pass, &npass) : 0;
    IDEM_ASSERT(rc != 1 || n == 1); /* without a timeout, a wait ends with the completion */
    store_unlock(s);
    wake_signal(s, pass, npass);
    queue_drain_fd(q); /* nothing is left to poll: the eventfd says so too */
    if (rc < 0) return rc;
    if (rc == 0) return IDEM_EBUSY;
    return dst->err;
}

int idem_claim(idem_queue *q, const void *key, size_t key_len, const idem_claim_args *a,
               idem_completion *c)
{
    if (!a) return IDEM_EINVAL;
    idem_op op = {.kind = IDEM_OP_CLAIM,
                  .key = key,
                  .key_len = (uint32_t)key_len,
                  .ttl_ms = a->ttl_ms,
                  .lease_ms = a->lease_ms,
                  .fp = a->fp,
                  .fp_len = a->fp_len,
                  .owner = a->owner,
                  .owner_len = a->owner_len,
                  .wait_ms = a->wait_ms};
    if (key_len > UINT32_MAX) return IDEM_EINVAL;
    return idem_exec(q, &op, c);
}

static int exec_token_op(idem_queue *q, uint32_t kind, const void *key, size_t key_len,
                         int64_t token, const void *data, size_t data_len, uint64_t lease_ms)
{
    if (key_len > UINT32_MAX || data_len > UINT32_MAX) return IDEM_EINVAL;
    idem_op op = {.kind = kind,
                  .key = key,
                  .key_len = (uint32_t)key_len,
                  .token = token,
                  .data = data,
                  .data_len = (uint32_t)data_len,
                  .lease_ms = lease_ms};
    return idem_exec(q, &op, NULL);
}

int idem_commit(idem_queue *q, const void *key, size_t key_len, int64_t token, const void *result,
                size_t result_len)
{
    return exec_token_op(q, IDEM_OP_COMMIT, key, key_len, token, result, result_len, 0);
}

int idem_release(idem_queue *q, const void *key, size_t key_len, int64_t token)
{
    return exec_token_op(q, IDEM_OP_RELEASE, key, key_len, token, NULL, 0, 0);
}

int idem_hold(idem_queue *q, const void *key, size_t key_len, int64_t token, const void *reason,
              size_t reason_len)
{
    return exec_token_op(q, IDEM_OP_HOLD, key, key_len, token, reason, reason_len, 0);
}

int idem_extend(idem_queue *q, const void *key, size_t key_len, int64_t token, uint64_t lease_ms)
{
    return exec_token_op(q, IDEM_OP_EXTEND, key, key_len, token, NULL, 0, lease_ms);
}

int idem_get(idem_queue *q, const void *key, size_t key_len, idem_completion *c)
{
    if (key_len > UINT32_MAX) return IDEM_EINVAL;
    idem_op op = {.kind = IDEM_OP_GET, .key = key, .key_len = (uint32_t)key_len};
    return idem_exec(q, &op, c);
}

int idem_set_if_absent(idem_queue *q, const void *key, size_t key_len, const void *value,
                       size_t value_len, uint64_t ttl_ms, int get_old, idem_completion *c)
{
    if (key_len > UINT32_MAX || value_len > UINT32_MAX) return IDEM_EINVAL;
    idem_op op = {.kind = IDEM_OP_SET_IF_ABSENT,
                  .flags = get_old ? IDEM_F_GET_OLD : 0,
                  .key = key,
                  .key_len = (uint32_t)key_len,
                  .data = value,
                  .data_len = (uint32_t)value_len,
                  .ttl_ms = ttl_ms};
    return idem_exec(q, &op, c);
}

int idem_del(idem_queue *q, const void *key, size_t key_len, const char *actor)
{
    if (key_len > UINT32_MAX) return IDEM_EINVAL;
    idem_op op = {.kind = IDEM_OP_DEL, .key = key, .key_len = (uint32_t)key_len, .actor = actor};
    return idem_exec(q, &op, NULL);
}

int idem_sync(idem_store *s)
{
    if (!s) return IDEM_EINVAL;
    store_lock(s);
    int rc = s->opt.read_only ? 0 : store_wait_durable(s);
    store_unlock(s);
    return rc;
}

/* ---- Scan ---- */

struct scan_ctx {
    idem_store *s;
    idem_queue *q;
    const idem_scan_args *a;
    int64_t now;
    int err;
};

/* Index slots idem_scan visits per hold of mu: a scan of many slots (idemd allows 100000 a call)
 * lets callers in between, as a series of calls with the cursor would. */
#define SCAN_SLOTS_PER_HOLD 256u

static void scan_one(void *ctx, struct index_slot *slot)
{
    struct scan_ctx *sc = ctx;
    uint32_t len;
    uint64_t lsn;
    const uint8_t *p = wal_payload(sc->s->wal, index_slot_addr(slot), &len, &lsn);
    struct rec r;
    if (!p || rec_decode(p, len, &r) < 0) return;
    if (ops_rec_expired(&r, sc->now)) {
        int rc = store_clock_need(sc->s, r.expires_at_ms);
        if (rc < 0) sc->err = rc;
        return;
    }
    if (sc->a->state && r.state != sc->a->state) return;
    if (sc->a->older_ms && sc->now - r.first_seen_ms < sc->a->older_ms) return;
    idem_queue *q = sc->q;
    if (q->scan_n == q->scan_max) {
        size_t m = q->scan_max ? q->scan_max * 2 : 64;
        const void **k = realloc(q->scan_keys, m * sizeof *k);
        uint32_t *l = k ? realloc(q->scan_lens, m * sizeof *l) : NULL;
        if (k) q->scan_keys = k;
        if (!k || !l) {
            sc->err = IDEM_ENOMEM;
            return;
        }
        q->scan_lens = l;
        q->scan_max = m;
    }
    if (q->scan_used + r.key_len > q->scan_cap) {
        size_t cap = q->scan_cap ? q->scan_cap * 2 : 4096;
        while (cap < q->scan_used + r.key_len)
            cap *= 2;
        uint8_t *b = realloc(q->scan_buf, cap);
        if (!b) {
            sc->err = IDEM_ENOMEM;
            return;
        }
        q->scan_buf = b;
        q->scan_cap = cap;
    }
    memcpy(q->scan_buf + q->scan_used, r.key, r.key_len);
    q->scan_keys[q->scan_n] = (const void *)(uintptr_t)q->scan_used; /* rebased below */
    q->scan_lens[q->scan_n++] = r.key_len;
    q->scan_used += r.key_len;
}

/* A scan's cursor is an index position (index_scan: the top 24 bits of a hash, then a bound on
 * its low 32 bits) sealed by a permutation of its 56 bits keyed by the hash seed: a client
 * cannot name positions of its choosing, as a bisection of cursors would give most of a listed
 * key's hash, from which the seed, and then keys made to collide, could be worked out. (The
 * order keys come in still follows their hashes: design.md section 14.) Four rounds of a Feistel
 * network over two 28-bit halves; the sealed value is the permuted one plus 1, so that 0 stays the
 * start and the end. Any value opens to some position, which index_scan takes (restarting its block
 * if it never gave it). */
#define CURSOR_HALF_BITS 28
#define CURSOR_HALF_MASK ((UINT64_C(1) << CURSOR_HALF_BITS) - 1)
#define CURSOR_ROUNDS    4
_Static_assert(2 * CURSOR_HALF_BITS == INDEX_SCAN_CURSOR_BITS, "a cursor is two halves");

static uint64_t cursor_round(const idem_store *s, uint64_t half, uint64_t round)
{
    uint32_t v = (uint32_t)half;
    return XXH3_64bits_withSeed(&v, sizeof v, s->sb.hash_seed + round * 0x9e3779b97f4a7c15ull) &
           CURSOR_HALF_MASK;
}

static uint64_t cursor_seal(const idem_store *s, uint64_t pos)
{
    if (pos == 0) return 0;
    uint64_t l = (pos >> CURSOR_HALF_BITS) & CURSOR_HALF_MASK, r = pos & CURSOR_HALF_MASK;
    for (uint64_t i = 0; i < CURSOR_ROUNDS; i++) {
        uint64_t t = r;
        r = l ^ cursor_round(s, r, i);
        l = t;
    }
    return ((l << CURSOR_HALF_BITS) | r) + 1;
}

static uint64_t cursor_open(const idem_store *s, uint64_t cursor)
{
    if (cursor == 0) return 0;
    uint64_t c = cursor - 1;
    uint64_t l = (c >> CURSOR_HALF_BITS) & CURSOR_HALF_MASK, r = c & CURSOR_HALF_MASK;
    for (uint64_t i = CURSOR_ROUNDS; i-- > 0;) {
        uint64_t t = l;
        l = r ^ cursor_round(s, l, i);
        r = t;
    }
    return (l << CURSOR_HALF_BITS) | r;
}

int idem_scan(idem_queue *q, const idem_scan_args *a, uint64_t *next_cursor, const void ***keys,
              const uint32_t **key_lens, size_t *n)
{
    if (!q || !a || !next_cursor || !keys || !key_lens || !n || a->state < 0 ||
        a->state > IDEM_STATE_REVIEW || a->older_ms < 0)
        return IDEM_EINVAL;
    idem_store *s = q->s;
    q->scan_n = q->scan_used = 0;
    store_lock(s);
    struct scan_ctx sc = {.s = s, .q = q, .a = a, .now = store_now(s)};
    uint64_t cursor = cursor_open(s, a->cursor);
    for (uint32_t left = a->count ? a->count : 100; left > 0 && !sc.err;) {
        uint32_t step = left < SCAN_SLOTS_PER_HOLD ? left : SCAN_SLOTS_PER_HOLD;
        cursor = index_scan(s->ix, cursor, step, scan_one, &sc);
        left -= step;
        if (cursor == 0 || left == 0) break;
        store_let_others_in(s);
    }
    *next_cursor = cursor_seal(s, cursor);
    /* In sync mode what a scan lists, and what it leaves out, is durable (rule 8): a key claimed
     * a moment ago waits for the flush that makes it so, shared with the claim's own, and so
     * does one resolved out of the state scanned, or deleted. */
    if (!sc.err && s->opt.durability == IDEM_DURABILITY_SYNC &&
        (wal_last_lsn(s->wal) > s->durable_lsn || !store_clock_saved(s)))
        sc.err = store_wait_durable(s);
    store_unlock(s);
    if (sc.err) return sc.err;
    for (size_t i = 0; i < q->scan_n; i++)
        q->scan_keys[i] = q->scan_buf + (uintptr_t)q->scan_keys[i];
    *keys = q->scan_keys;
    *key_lens = q->scan_lens;
    *n = q->scan_n;
    return 0;
}

/* ---- Stats ---- */

void store_count_claim(idem_store *s, int outcome)
{
    int64_t sec = (s->clk_frozen ? s->mono_batch_ms : mono_now(s)) / 1000;
    int i = (int)(sec % 60);
    if (s->minute[i].second != sec) {
        s->minute[i].second = sec;
        s->minute[i].claims = s->minute[i].duplicates = 0;
    }
    s->minute[i].claims++;
    s->minute[i].duplicates += outcome != IDEM_NEW;
}

void idem_get_stats(idem_store *s, idem_stats *out)
{
    store_lock(s);
    /* First, as either may let the lock go between steps of filtering its heap; the figures
     * are then all taken in one hold of it. */
    ages_settle(s, AGE_IN_FLIGHT);
    ages_settle(s, AGE_REVIEW);
    *out = s->st;
    out->keys = index_count(s->ix);
    out->store_clock_ms = store_now(s);
    out->clock_skew_ms = out->store_clock_ms - s->clock.wall_ms(s->clock.ctx);
    out->wal_bytes = wal_bytes(s->wal);
    out->disk_bytes = store_disk_bytes(s);
    out->memory_bytes = index_memory_bytes(s->ix) +
                        (uint64_t)s->seen_cap * sizeof(struct seen_info) +
                        wal_buffer_bytes(s->wal) + audit_memory_bytes(s);
    for (int k = 0; k < AGE_KINDS; k++)
        out->memory_bytes += (uint64_t)s->ages[k].cap * sizeof *s->ages[k].v;
    out->max_keys = s->opt.max_keys;
    out->max_memory_bytes = s->opt.max_memory_bytes;
    out->max_disk_bytes = s->opt.max_disk_bytes;
    out->disk_reserve_bytes =
        s->reserve.off || s->test_sim || s->opt.read_only ? 0 : reserve_want(s);
    out->disk_reserve_released = s->reserve.released;
    out->fatal = s->fatal;
    int64_t sec = mono_now(s) / 1000;
    for (int i = 0; i < 60; i++) {
        if (sec - s->minute[i].second < 60) {
            out->claims_last_minute += s->minute[i].claims;
            out->duplicates_last_minute += s->minute[i].duplicates;
        }
    }
    out->oldest_in_flight_ms = ages_oldest(s, AGE_IN_FLIGHT);
    out->oldest_review_ms = ages_oldest(s, AGE_REVIEW);
    if (out->oldest_in_flight_ms)
        out->oldest_in_flight_age_ms = out->store_clock_ms - out->oldest_in_flight_ms;
    if (out->oldest_review_ms)
        out->oldest_review_age_ms = out->store_clock_ms - out->oldest_review_ms;
    out->index_bytes = index_live_bytes(s->ix);
    out->store_generation = s->sb.store_generation;
    out->token_next = s->token_next;
    store_unlock(s);
    uint64_t free_bytes = s->test_sim ? UINT64_MAX : disk_free_bytes(s->dir, 0);
    if (free_bytes != UINT64_MAX) out->disk_free_bytes = free_bytes;
}

uint64_t idem_key_count(idem_store *s)
{
    store_lock(s);
    uint64_t n = index_count(s->ix);
    store_unlock(s);
    return n;
}

uint64_t store_disk_bytes(const idem_store *s)
{
    /* audit_alloc is UINT64_MAX where the file system cannot reserve space (audit.c) */
    uint64_t audit = s->audit_alloc != UINT64_MAX && s->audit_alloc > s->audit_off ? s->audit_alloc
                                                                                   : s->audit_off;
    return wal_bytes(s->wal) + s->ckpt_file_bytes[0] + s->ckpt_file_bytes[1] + audit;
}

/* ---- Checkpoint ---- */

#define CKPT_RUN_STEP 4096 /* index positions per step: tens of microseconds */

struct ckpt_ctx {
    idem_store *s;
    struct ckpt_writer *cw;
    int rc;
};

static void ckpt_one(void *ctx, struct index_slot *slot)
{
    struct ckpt_ctx *cc = ctx;
    if (cc->rc < 0) return;
    struct ckpt_entry e = {.addr_tag = slot->addr_tag, .hash_lo = slot->hash_lo};
    if (slot->aux & SLOT_AUX_APART) e.has_seen |= CKPT_UNFINISHED;
    if (slot->aux & SLOT_AUX_SEEN) {
        struct seen_info *si = store_seen_at(cc->s, (slot->aux & SLOT_AUX_SEEN) - 1);
        e.has_seen |= CKPT_SEEN;
        e.seen_count = si->seen_count;
        e.last_seen_ms = si->last_seen_ms;
    }
    cc->rc = ckpt_add(cc->cw, &e);
}

/* Makes every appended frame durable and returns with mu held and nothing pending or in flight,
 * so that the index is exactly the log up to the current position. Callers' new changes wait
 * meanwhile (store_room sees ckpt_quiesce). Never on the flusher thread: it waits for the
 * flusher (checkpoint_at_close, idem_backup). */
static int quiesce_durable(idem_store *s)
{
    IDEM_ASSERT(!s->flusher_started || !pthread_equal(pthread_self(), s->flusher));
    s->ckpt_quiesce++;
    int rc = 0;
    while (rc == 0 && (wal_pending(s->wal) || s->flushing || s->durable_lsn < wal_last_lsn(s->wal)))
        rc = store_wait_durable(s);
    /* Appends held back by ckpt_quiesce wait on cond_ready (store_room): let them go on. */
    if (--s->ckpt_quiesce == 0) pthread_cond_broadcast(&s->cond_ready);
    return rc;
}

/* Makes sb (a new checkpoint's superblock) durable and current, then deletes the checkpoint
 * before the previous one (the copy not yet overwritten may still name the previous one). On
 * the flusher the write runs with mu released (store_flusher_unlock); the delete is queued
 * (remover.h): deleting a checkpoint of 10 M keys frees 160 MB of cached pages. */
static int ckpt_install(idem_store *s, struct super *sb, int off_lock)
{
    /* The checkpoint's file and its directory entry must be durable before a superblock names
     * it: not after a sync of the directory that failed on another thread. */
    if (helpers_failed(s)) return IDEM_EFATAL;
    io_fault_clear();
    char old_path[4096] = "";
    if (s->sb.ckpt_id > 1) ckpt_path(s->dir, s->sb.ckpt_id - 1, old_path, sizeof old_path);
    sb->store_clock_ms = store_now(s);
    /* The token reservation never goes back, and covers tokens an import set past it (no
     * reserve_tokens may come between an import and the close that writes this). */
    if (sb->token_reserved < s->sb.token_reserved) sb->token_reserved = s->sb.token_reserved;
    if (sb->token_reserved < (uint64_t)s->token_next) sb->token_reserved = (uint64_t)s->token_next;
    store_super_marks(s, sb);
    if (off_lock) store_flusher_unlock(s);
    int rc = super_store(s->io, s->dir, sb);
    if (rc == 0 && *old_path) remover_add(s->remover, old_path); /* no copy names it any more */
    uint64_t bytes = rc == 0 ? ckpt_file_bytes(s->io, s->dir, sb->ckpt_id) : 0;
    if (off_lock) store_flusher_relock(s);
    if (rc < 0) {
        if (rc == IDEM_EFATAL) store_fail(s, 0, "writing the superblock of a checkpoint");
        return rc;
    }
    s->ckpt_file_bytes[1] = s->ckpt_file_bytes[0];
    s->ckpt_file_bytes[0] = bytes;
    s->sb = *sb;
    s->st.checkpoints++;
    if (s->ckr.failed_mono_ms)
        fprintf(stderr, "idem: event=full_over reason=\"a checkpoint is written\" dir=%s\n",
                s->dir);
    s->ckr.failed_mono_ms = 0;
    pthread_cond_broadcast(&s->cond_ready);
    return 0;
}

static void ckpt_run_abort(idem_store *s)
{
    if (s->ckr.cw) ckpt_abort(s->ckr.cw); /* the file is truncated by the next checkpoint */
    s->ckr.cw = NULL;
    s->ckr.state = CKPT_RUN_IDLE;
}

/* The closing checkpoint (idem_close, mu held, closing set): everything appended is made
 * durable first, so the image is exactly the index at the current batch boundary, and nothing
 * is appended after it. A checkpoint the flusher is taking in steps is dropped: this one
 * replaces it. Once installed, the segments walked before it are retired. */
static int checkpoint_at_close(idem_store *s)
{
    IDEM_ASSERT(s->closing);
    /* A backup may be copying checkpoint X; a run in steps may install X+1 meanwhile, and this
     * install would then remove X. quiesce_durable lets go of mu: a backup may start there. */
    int rc;
    do {
        while (s->backups)
            store_wait(s, &s->cond_ready);
        rc = quiesce_durable(s);
        if (rc < 0) return rc;
    } while (s->backups);
    IDEM_ASSERT(!wal_pending(s->wal) && s->durable_lsn == wal_last_lsn(s->wal));
    ckpt_run_abort(s); /* the flusher is not inside a step: flushing is clear */
    uint64_t id = s->sb.ckpt_id + 1;
    struct ckpt_ctx cc = {.s = s};
    rc = ckpt_begin(s->io, s->dir, id, &cc.cw);
    if (rc < 0) return rc;
    uint64_t cursor = 0;
    do {
        cursor = index_scan(s->ix, cursor, 65536, ckpt_one, &cc);
    } while (cursor && cc.rc == 0);
    if (cc.rc < 0) {
        ckpt_abort(cc.cw);
        return cc.rc;
    }
    rc = ckpt_end(cc.cw);
    if (rc < 0) return rc;
    struct super sb = s->sb;
    sb.ckpt_id = id;
    wal_position(s->wal, &sb.ckpt_seq, &sb.ckpt_off);
    sb.ckpt_lsn = sb.ckpt_counts_lsn = wal_last_lsn(s->wal);
    sb.ckpt_flags = 0;
    sb.ckpt_batch = wal_batch(s->wal) - 1;
    sb.ckpt_live_bytes = s->live_bytes;
    sb.ckpt_keys_by_state[0] = s->st.keys_in_flight;
    sb.ckpt_keys_by_state[1] = s->st.keys_committed;
    sb.ckpt_keys_by_state[2] = s->st.keys_review;
    /* Nothing is appended after this checkpoint: the next open need not look past the end of
     * the log (wal_resume). */
    sb.clean_lsn = sb.ckpt_lsn;
    rc = ckpt_install(s, &sb, 0);
    return rc < 0 ? rc : compact_retire_closing(s);
}

/*
 * Checkpoints in steps. The flusher's periodic checkpoint must not hold changes back for the
 * whole scan (a second or more at 10 M keys), so it runs as steps between batches:
 *   begin   at a batch boundary (nothing pending, nothing in flight): the replay position P0,
 *           its LSN and batch are taken, and the file created.
 *   scan    CKPT_RUN_STEP index positions per step with mu held, changes going on between
 *           steps; the buffer is written out with mu released.
 *   end     the log's last LSN L1 and the counts (live bytes, keys by state) are taken with mu
 *           held: they describe exactly the frames up to L1. The file is finished (trailer,
 *           flush, directory sync) with mu released.
 *   install once every frame up to L1 is durable: a superblock naming the file, replay from P0,
 *           counts at L1 (ckpt_counts_lsn = L1).
 * The image is not one moment of the index: an entry is the key's version at the step that saw
 * it, between P0 and L1, and a key moved by a split during the scan may be listed twice (the
 * loader keeps one, ckpt_entry_load). Recovery loads it and replays from P0: a key with frames
 * after P0 ends at its newest frame whichever version the image held, one without had a single
 * version for the whole scan, which the image holds. The counts cannot be summed over such an
 * image, so replay leaves them alone for frames up to L1 (replay_counts_lsn) and applies the
 * frames after L1 to the counts at L1; keys with mismatches are counted from the loaded entries
 * and follow every replayed frame, which telescopes to the right figure from any version.
 * Entries point at frames up to L1 only, all durable before the superblock names the file, in
 * segments that exist: a segment is retired only when the installed checkpoint began after its
 * compaction walk ended, and so did any run active then; from that moment the index points at
 * no frame of it (compact.c retire).
 */
/* now: a run was asked for (idem_checkpoint, store_ckpt_step) even if compaction does not want
 * one yet. */
static int ckpt_run_wanted(idem_store *s, int now)
{
    if (s->backups) return 0;
    if (now) return 1; /* idem_checkpoint asks */
    if (s->ckr.failed_mono_ms && mono_now(s) - s->ckr.failed_mono_ms < 1000) return 0;
    return compact_wants_checkpoint(s);
}

/* Begins a run at the current batch boundary: nothing may be pending (those frames belong to a
 * batch that closes after the replay position); a batch in flight is closed already. */
static int ckpt_run_begin(idem_store *s)
{
    IDEM_ASSERT(s->ckr.state == CKPT_RUN_IDLE && !wal_pending(s->wal));
    s->ckr.id = s->sb.ckpt_id + 1;
    int rc = ckpt_begin(s->io, s->dir, s->ckr.id, &s->ckr.cw);
    if (rc < 0) return rc;
    s->ckr.run = ++s->ckr.runs_started;
    wal_position(s->wal, &s->ckr.seq, &s->ckr.off);
    s->ckr.lsn = wal_last_lsn(s->wal);
    s->ckr.batch = wal_batch(s->wal) - 1;
    s->ckr.cursor = 0;
    s->ckr.state = CKPT_RUN_SCANNING;
    return 0;
}

/* A run failed: fatal for the store on an I/O error; otherwise (no room for the file) the run
 * is dropped and idem_checkpoint told. */
static void ckpt_run_failed(idem_store *s, int rc)
{
    if (rc == IDEM_EFATAL || rc == IDEM_EIO) {
        store_fail(s, 0, "writing a checkpoint");
        return;
    }
    io_fault_clear(); /* handled: a later fatal error of this round must not be named after it */
    s->ckr.failures++;
    s->ckr.last_err = rc;
    s->ckr.want_run = s->ckr.installed_run;
    /* A run refused at its end (a flush or directory sync) has scanned the whole index and
     * written the whole file: the flusher's own runs wait a second after it, as the spare
     * segment's making does, and the first of a streak is logged. */
    if (!s->ckr.failed_mono_ms)
        fprintf(stderr, "idem: event=full reason=\"no %s for a checkpoint\" dir=%s\n",
                rc == IDEM_EFULL ? "space" : "file descriptor or memory", s->dir);
    s->ckr.failed_mono_ms = mono_now(s);
    pthread_cond_broadcast(&s->cond_ready);
}

static int ckpt_run_step(idem_store *s, int now)
{
    if (s->ckr.state == CKPT_RUN_IDLE) {
        if (wal_pending(s->wal) || !ckpt_run_wanted(s, now)) return 0;
        int rc = ckpt_run_begin(s);
        if (rc < 0) return rc;
    }
    if (s->ckr.state == CKPT_RUN_SCANNING) {
        struct ckpt_writer *cw = s->ckr.cw;
        if (ckpt_room(cw) < 2 * CKPT_RUN_STEP) {
            store_flusher_unlock(s);
            int rc = ckpt_write_out(cw);
            store_flusher_relock(s);
            if (rc < 0) {
                ckpt_run_abort(s);
                return rc;
            }
            return 1;
        }
        struct ckpt_ctx cc = {.s = s, .cw = cw};
        s->ckr.cursor = index_scan(s->ix, s->ckr.cursor, CKPT_RUN_STEP, ckpt_one, &cc);
        if (cc.rc < 0) {
            ckpt_run_abort(s);
            return cc.rc;
        }
        if (s->ckr.cursor) return 1;
        s->ckr.end_lsn = wal_last_lsn(s->wal);
        s->ckr.live_bytes = s->live_bytes;
        s->ckr.keys_by_state[0] = s->st.keys_in_flight;
        s->ckr.keys_by_state[1] = s->st.keys_committed;
        s->ckr.keys_by_state[2] = s->st.keys_review;
        s->ckr.cw = NULL;
        s->ckr.state = CKPT_RUN_WRITTEN;
        store_flusher_unlock(s);
        int rc = ckpt_end(cw); /* frees cw */
        store_flusher_relock(s);
        if (rc < 0) s->ckr.state = CKPT_RUN_IDLE;
        return rc < 0 ? rc : 1;
    }
    /* Written: install once everything up to L1 is durable. */
    if (s->durable_lsn < s->ckr.end_lsn) {
        if (wal_pending(s->wal)) return 0; /* the flusher's next flush gets there */
        /* Nothing pending, but written without a flush (durability none): a failed flush of
         * the log is named as such, not as the checkpoint's write (ckpt_run_failed keeps the
         * first reason). */
        int rc = sync_written(s);
        if (rc < 0) {
            store_fail(s, rc, "flushing the log before a checkpoint is installed");
            return IDEM_EFATAL;
        }
        /* Answered as flush_due answers it: not after a helper failed, and with the flush
         * recorded in the superblock first. */
        if (helpers_failed(s) || sync_mark_save(s) < 0) return IDEM_EFATAL;
        s->durable_lsn = wal_durable_lsn(s->wal);
        notify_ready(s);
        if (s->durable_lsn < s->ckr.end_lsn) return IDEM_EFATAL;
    }
    struct super sb = s->sb;
    sb.ckpt_id = s->ckr.id;
    sb.ckpt_seq = s->ckr.seq;
    sb.ckpt_off = s->ckr.off;
    sb.ckpt_lsn = s->ckr.lsn;
    sb.ckpt_batch = s->ckr.batch;
    sb.ckpt_counts_lsn = s->ckr.end_lsn;
    /* Recorded, not inferred from the LSNs: a split under the cursor lists a key twice even
     * when nothing was appended during the scan (an insert whose append failed, disk full). */
    sb.ckpt_flags = SUPER_CKPT_STEPPED;
    sb.ckpt_live_bytes = s->ckr.live_bytes;
    memcpy(sb.ckpt_keys_by_state, s->ckr.keys_by_state, sizeof sb.ckpt_keys_by_state);
    s->ckr.state = CKPT_RUN_IDLE;
    int rc = ckpt_install(s, &sb, 1);
    if (rc == 0) s->ckr.installed_run = s->ckr.run; /* ckpt_install woke the waiters */
    return rc < 0 ? rc : 1;
}

void store_test_wake_delay(idem_store *s, uint32_t us)
{
    store_lock(s);
    s->test_wake_delay_us = us;
    store_unlock(s);
}

uint64_t store_test_queue_buf_bytes(const idem_queue *q)
{
    uint64_t n = 0;
    for (uint32_t i = 0; i < q->depth; i++)
        n += q->slots[i].buf_cap;
    return n;
}

uint32_t store_test_exec_read_misses(const idem_queue *q)
{
    return q->exec_read_misses;
}

uint64_t store_test_reads(idem_store *s)
{
    return __atomic_load_n(&s->reads_answered, __ATOMIC_RELAXED);
}

void store_test_ages_tidy(idem_store *s, int on)
{
    store_lock(s);
    s->test_no_tidy = !on;
    store_unlock(s);
}

int store_ckpt_step(idem_store *s)
{
    store_lock(s);
    s->ckr.by_test = 1;
    s->ckr.test_step = 1;
    s->ckr.test_rc = 0;
    s->ckr.test_installed = 0;
    pthread_cond_signal(&s->cond_flush);
    while (s->ckr.test_step && !s->fatal && !s->closing && !s->abandoned)
        store_wait(s, &s->cond_ready);
    int rc = s->fatal                ? IDEM_EFATAL
             : s->ckr.test_rc < 0    ? s->ckr.test_rc
             : s->ckr.test_installed ? 0
                                     : 1;
    store_unlock(s);
    return rc;
}

/* A checkpoint in steps that starts after this call, taken by the flusher between batches while
 * changes go on: it holds every change made before the call, and nothing waits for it but the
 * caller (counted in sync_waiters, so that a store without sync durability flushes what the
 * run's install waits for). */
int idem_checkpoint(idem_store *s)
{
    if (!s) return IDEM_EINVAL;
    if (s->opt.read_only) return IDEM_EREADONLY;
    store_lock(s);
    uint64_t want = s->ckr.runs_started + 1, failures = s->ckr.failures;
    if (want > s->ckr.want_run) s->ckr.want_run = want;
    s->sync_waiters++;
    pthread_cond_signal(&s->cond_flush);
    while (!s->fatal && !s->closing && s->ckr.installed_run < want && s->ckr.failures == failures)
        store_wait(s, &s->cond_ready);
    s->sync_waiters--;
    int rc = s->fatal                       ? IDEM_EFATAL
             : s->ckr.installed_run >= want ? IDEM_OK
             : s->ckr.failures != failures  ? s->ckr.last_err
                                            : IDEM_EINVAL; /* the store is being closed */
    store_unlock(s);
    return rc;
}

/* ---- Compaction on request ---- */

int idem_compact(idem_store *s, int timeout_ms)
{
    if (!s) return IDEM_EINVAL;
    if (s->opt.read_only) return IDEM_EREADONLY;
    store_lock(s);
    /* Every segment sealed now is walked; the flusher does the work between batches. */
    s->cmp_force_until = wal_cur_seq(s->wal);
    int64_t deadline = mono_now(s) + timeout_ms;
    uint64_t ckpt_failures = s->ckr.failures, spare_failures = 0;
    int rc = 0;
    while (!s->fatal && !s->cmp_disabled && wal_first_seq(s->wal) < s->cmp_force_until) {
        if (timeout_ms >= 0 && mono_now(s) >= deadline) {
            rc = IDEM_EBUSY;
            break;
        }
        /* Segments are retired only under a newer checkpoint: one refused for want of room
         * means none will be until room is made (waiting would end in EBUSY, or never). */
        if (s->ckr.failures != ckpt_failures && s->ckr.last_err == IDEM_EFULL) {
            rc = IDEM_EFULL;
            break;
        }
        /* So does a walk stopped for room with nothing walked left in the log, once an attempt
         * at the next segment begun since has found no room either (one a second; the second
         * failure counted from here began after: that attempt lets the disk reserve go where
         * the log is at its end, and sees the room of files retired before): no checkpoint is
         * asked for, nothing is retired, and without a timeout the call waited for good. */
        if (!compact_stopped_full(s)) {
            spare_failures = 0;
        } else if (!spare_failures) {
            spare_failures = s->spare_failures + 2;
        } else if (s->spare_failures >= spare_failures) {
            rc = IDEM_EFULL;
            break;
        }
        s->sync_waiters++; /* durability none: the walk waits for durable segments */
        pthread_cond_signal(&s->cond_flush);
        struct timespec ts;
        clock_gettime(CLOCK_MONOTONIC, &ts);
        ts.tv_nsec += 20 * 1000000L;
        if (ts.tv_nsec >= 1000000000L) {
            ts.tv_sec++;
            ts.tv_nsec -= 1000000000L;
        }
        store_timedwait(s, &s->cond_ready, &ts);
        s->sync_waiters--;
    }
    if (s->fatal)
        rc = IDEM_EFATAL;
    else if (s->cmp_disabled)
        rc = IDEM_ECORRUPT;
    store_unlock(s);
    return rc;
}

/* ---- Backup ---- */

/* Copies the first len bytes of from (UINT64_MAX: all of it) into the new file to, read through
 * rd and written and flushed through wr, then extends the copy with allocated zeros to size
 * bytes (0: as copied). An absent source copies nothing if it is optional, else it is an
 * error that names it. */
static int copy_file(struct io *rd, struct io *wr, const char *from, const char *to, uint64_t len,
                     uint64_t size, int optional)
{
    struct io_file *in, *out;
    int rc = io_open(rd, from, IO_O_RDONLY, &in);
    if (rc == -ENOENT && optional) return 0;
    if (rc < 0) {
        store_set_error("cannot read %s: %s", from, strerror(-rc));
        return IDEM_EIO;
    }
    rc = io_open(wr, to, IO_O_CREATE | IO_O_EXCL, &out);
    if (rc < 0) {
        store_set_error("cannot create %s: %s", to, strerror(-rc));
        io_close(rd, in);
        return UTIL_NO_SPACE(rc) ? IDEM_EFULL : IDEM_EIO;
    }
    uint8_t *buf = aligned_alloc(4096, 1 << 20);
    uint64_t off = 0;
    rc = buf ? 0 : IDEM_ENOMEM;
    int err = 0; /* the failed call's errno */
    const char *what = "copying";
    while (rc == 0 && off < len) {
        size_t want = len - off < (1 << 20) ? (size_t)(len - off) : (size_t)1 << 20;
        int64_t n = io_read(rd, in, off, buf, want);
        if (n < 0) rc = IDEM_EIO, err = (int)-n, what = "reading";
        if (n == 0 && len != UINT64_MAX) { /* what the copy names as held is not there */
            rc = IDEM_EIO;
            store_set_error("%s ends at %llu bytes, before the %llu the copy holds of it", from,
                            (unsigned long long)off, (unsigned long long)len);
        }
        if (n <= 0) break;
        /* Flushed chunk by chunk: a copy's dirty pages, written back all at once, would hold up
         * the log's flushes on the same disk for as long. */
        int w = io_write_sync(wr, out, off, buf, (size_t)n, 1);
        if (w < 0) rc = UTIL_NO_SPACE(w) ? IDEM_EFULL : IDEM_EIO, err = -w, what = "writing";
        off += (uint64_t)n;
    }
    if (rc == 0 && size > off) {
        int a = io_allocate(wr, out, off, size - off);
        if (a < 0) rc = UTIL_NO_SPACE(a) ? IDEM_EFULL : IDEM_EIO, err = -a, what = "allocating";
    }
    int f = rc == 0 ? io_flush_sync(wr, out) : 0;
    if (f < 0) rc = UTIL_NO_SPACE(f) ? IDEM_EFULL : IDEM_EIO, err = -f, what = "flushing";
    if (rc == IDEM_ENOMEM) store_set_error("out of memory copying %s", from);
    if (rc < 0 && err) store_set_error("%s %s into %s failed: %s", what, from, to, strerror(err));
    free(buf);
    io_close(rd, in);
    io_close(wr, out);
    return rc;
}

/*
 * A copy (backup, restore) is made in "<dest>.partial" and renamed to dest once whole and
 * durable: a copy cut short by a crash or an error never sits under dest, where an open would
 * take it for a store (or make a new one over its files). A failed copy removes its partial
 * directory; one a crash left stays, and the next copy to dest names it and stops.
 */
struct copy_dir {
    char dest[4096], partial[4096];
};

/* Is the directory `inner` (which exists) src itself or inside it? (0 when either cannot be
 * resolved: the copy then fails where it is made.) */
static int dir_within(const char *inner, const char *src)
{
    char a[PATH_MAX], b[PATH_MAX];
    if (!realpath(inner, a) || !realpath(src, b)) return 0;
    size_t n = strlen(b);
    return strncmp(a, b, n) == 0 && (a[n] == '\0' || a[n] == '/' || (n == 1 && b[0] == '/'));
}

/* Creates dir.partial for a copy of src into dest (neither may exist, nor lie within src). */
static int copy_dir_begin(struct io *io, const char *src, const char *dest, struct copy_dir *d)
{
    size_t n = strlen(dest);
    while (n > 1 && dest[n - 1] == '/')
        n--; /* "dir/" names dir: its partial copy is dir.partial */
    /* Room for the longest name made in it ("/index-<16 hex>.ckpt"): a longer path was cut
     * short in the names of the copied files, and a copy of one segment "succeeded" unopenable. */
    const size_t names_max = 32;
    if (n + sizeof ".partial" + names_max > sizeof d->partial) {
        store_set_error("path too long: %s (at most %zu bytes)", dest,
                        sizeof d->partial - sizeof ".partial" - names_max);
        return IDEM_EINVAL;
    }
    memcpy(d->dest, dest, n);
    d->dest[n] = 0;
    memcpy(d->partial, dest, n);
    memcpy(d->partial + n, ".partial", sizeof ".partial");
    if (access(dest, F_OK) == 0) {
        store_set_error("cannot create %s: it exists", dest);
        return IDEM_EINVAL;
    }
    /* A copy kept with what it copies is lost with it. Checked on the directory that would
     * hold the copy, before anything is made there: src is not written to. */
    char parent[sizeof d->partial];
    memcpy(parent, d->partial, sizeof parent);
    char *slash = strrchr(parent, '/');
    if (!slash)
        strcpy(parent, ".");
    else
        slash[slash == parent] = 0; /* "/x" has the parent "/" */
    if (dir_within(parent, src)) {
        store_set_error("cannot copy %s into %s: the copy would lie within the directory it copies",
                        src, dest);
        return IDEM_EINVAL;
    }
    int rc = io_mkdir(io, d->partial);
    if (rc == -EEXIST) {
        store_set_error("%s exists: a copy into %s was cut short there; remove it, then copy "
                        "again",
                        d->partial, dest);
        return IDEM_EINVAL;
    }
    if (rc < 0) {
        store_set_error("cannot create %s: %s", d->partial, strerror(-rc));
        return IDEM_EIO;
    }
    return 0;
}

/* Ends a copy: on success renames the partial directory to dest (never over one that appeared
 * meanwhile) and makes the name durable; on failure (rc < 0) removes the partial directory and
 * what the copy wrote there (it made every file in it). */
static int copy_dir_end(struct io *io, struct copy_dir *d, int rc)
{
    if (rc == 0) {
        if (renameat2(AT_FDCWD, d->partial, AT_FDCWD, d->dest, RENAME_NOREPLACE) != 0) {
            int err = errno;
            store_set_error("cannot rename %s to %s: %s", d->partial, d->dest, strerror(err));
            rc = err == EEXIST ? IDEM_EINVAL : IDEM_EIO;
        } else if (sync_parent(io, d->dest) < 0) {
            store_set_error("cannot make the name %s durable", d->dest);
            return IDEM_EIO;
        } else {
            return 0;
        }
    }
    DIR *dir = opendir(d->partial);
    struct dirent *e;
    while (dir && (e = readdir(dir)) != NULL)
        if (strcmp(e->d_name, ".") && strcmp(e->d_name, "..")) unlinkat(dirfd(dir), e->d_name, 0);
    if (dir) closedir(dir);
    rmdir(d->partial);
    return rc;
}

/* Copies a store's files from src (read through rd) into dest (written through wr): the log from
 * sb's first segment up to the end (end_seq, end_off), the rest of that segment zero, or when
 * end_seq is 0 every segment up to the first absent one at or past the replay segment, from the
 * one after the last absent before it (retired after this superblock copy was written: the log
 * starts after it, and what is left before it is not copied, as the open has it:
 * wal_open_segments); the checkpoint sb names; the audit trail up to audit_len; the import
 * marker if src holds one; then sb, naming the log's first segment, as the copy's superblock,
 * and dest synced. */
static int copy_store(struct io *rd, const char *src, struct io *wr, const char *dest,
                      const struct super *sb, uint64_t end_seq, uint32_t end_off,
                      uint64_t audit_len)
{
    char from[4096], to[4096];
    int rc = 0;
    uint64_t first = sb->wal_first_seq;
    for (uint64_t seq = first; end_seq == 0 && seq < sb->ckpt_seq; seq++) {
        wal_seg_path(src, seq, from, sizeof from);
        if (access(from, F_OK) != 0) first = seq + 1; /* the log starts after it */
    }
    for (uint64_t seq = first; rc == 0 && (end_seq == 0 || seq <= end_seq); seq++) {
        wal_seg_path(src, seq, from, sizeof from);
        wal_seg_path(dest, seq, to, sizeof to);
        if (end_seq == 0 && access(from, F_OK) != 0) break;
        rc = seq != end_seq ? copy_file(rd, wr, from, to, UINT64_MAX, 0, 0)
                            : copy_file(rd, wr, from, to, end_off, sb->seg_bytes, 0);
    }
    if (rc == 0 && sb->ckpt_id) {
        ckpt_path(src, sb->ckpt_id, from, sizeof from);
        ckpt_path(dest, sb->ckpt_id, to, sizeof to);
        rc = copy_file(rd, wr, from, to, UINT64_MAX, 0, 0);
    }
    if (rc == 0) {
        snprintf(from, sizeof from, "%s/audit.log", src);
        snprintf(to, sizeof to, "%s/audit.log", dest);
        rc = copy_file(rd, wr, from, to, audit_len, 0, 1);
    }
    /* The copy of a store that an import cut short is marked as it is, the marker's content
     * naming that import (import_mark.c), before the copy is named: marked after (by idemctl, as
     * before), a crash or a failed mark between left a named copy that opened as a whole store, and
     * keys the import never reached would have answered `new` again. */
    if (rc == 0) rc = import_mark_copy(src, dest);
    if (rc == 0) {
        struct super copy = *sb;
        copy.generation = 0;
        copy.wal_first_seq = first;
        rc = super_store(wr, dest, &copy);
        /* The copy's superblock failed, not the store's: not "the store stopped". */
        if (rc == IDEM_EFATAL) {
            store_set_error("writing the superblock of the copy in %s failed", dest);
            rc = IDEM_EIO;
        }
    }
    if (rc == 0 && io_sync_dir(wr, dest) < 0) {
        store_set_error("syncing the directory of the copy %s failed", dest);
        rc = IDEM_EIO;
    }
    return rc;
}

/*
 * A backup holds changes back only while everything appended is made durable (one flush): then
 * the superblock, the log's end and the audit trail's end are taken together, and the files
 * are copied with mu released while changes go on. Bytes of the log before its end are never
 * rewritten (a batch starts on a fresh block), and while the copy runs no segment is retired
 * and no checkpoint started (s->backups), so the checkpoint the superblock names and the
 * segments from its replay position on stay in place. The copy recovers like the store after a
 * crash at that point: the checkpoint, then the log replayed up to the end.
 */
int idem_backup(idem_store *s, const char *dest_dir)
{
    if (!s || !dest_dir || !*dest_dir) return IDEM_EINVAL;
    struct io *wr; /* the store's ring is the flusher's: the copy writes through its own */
    if (io_thread_create(&wr) < 0) return IDEM_ENOMEM;
    store_lock(s);
    int rc = s->fatal           ? IDEM_EFATAL
             : s->closing       ? IDEM_EINVAL /* a call on a store being closed */
             : s->opt.read_only ? 0
                                : quiesce_durable(s);
    struct super sb = s->sb; /* names the log's first segment, as every open and retirement */
    /* The clock of this moment, which answers given may rest on (a key answered expired), where
     * the last one saved is older: in batch and none modes such answers do not wait for it,
     * and an idle store writes no END frame. The copy opens at it, as it would have reopened. */
    int64_t now = store_now(s);
    if (now > sb.store_clock_ms) sb.store_clock_ms = now;
    uint64_t end_seq;
    uint32_t end_off;
    wal_position(s->wal, &end_seq, &end_off);
    uint64_t audit_len = s->audit_off;
    if (rc == 0) s->backups++;
    store_unlock(s);
    if (rc == 0) {
        struct copy_dir d;
        rc = copy_dir_begin(wr, s->dir, dest_dir, &d);
        if (rc == 0)
            rc = copy_dir_end(
                wr, &d, copy_store(s->io, s->dir, wr, d.partial, &sb, end_seq, end_off, audit_len));
        store_lock(s);
        s->backups--;
        pthread_cond_broadcast(&s->cond_ready);
        store_unlock(s);
    }
    io_destroy(wr);
    return rc;
}

int idem_restore(const char *backup_dir, const char *dest_dir)
{
    if (!backup_dir || !dest_dir || !*backup_dir || !*dest_dir) return IDEM_EINVAL;
    struct io *io;
    if (io_thread_create(&io) < 0) return IDEM_ENOMEM;
    struct super sb;
    char err[512] = "";
    /* A store some process owns changes under the copy: its lock is shared with readers only. */
    int lock_fd = -1;
    int rc = lock_acquire(backup_dir, LOCK_AS_READER, &lock_fd, err, sizeof err);
    if (rc == 0) rc = super_load(io, backup_dir, &sb, 0, err, sizeof err);
    if (rc < 0) {
        store_set_error("%s", rc == IDEM_ENOTFOUND ? "the backup holds no store" : err);
        goto out;
    }
    struct copy_dir d;
    rc = copy_dir_begin(io, backup_dir, dest_dir, &d);
    if (rc < 0) goto out;
    /* A new generation: the copy is another store from here on. */
    sb.store_generation++;
    rc = copy_store(io, backup_dir, io, d.partial, &sb, 0, 0, UINT64_MAX);
    if (rc == 0) { /* named dest only if it is a sound store: a damaged backup is refused */
        idem_verify_report r;
        int vrc = idem_verify(d.partial, &r, NULL, NULL);
        if (vrc != IDEM_OK || r.errors) {
            if (vrc == IDEM_OK)
                store_set_error("the copy of %s fails verification (%llu fault(s)); the first: %s",
                                backup_dir, (unsigned long long)r.errors, r.first_error);
            rc = vrc != IDEM_OK ? vrc : IDEM_ECORRUPT;
        }
    }
    rc = copy_dir_end(io, &d, rc);
out:
    lock_release(lock_fd);
    io_destroy(io);
    return rc;
}

/* ---- Names ---- */

const char *idem_strerror(int err)
{
    switch (err) {
    case IDEM_OK:
        return "ok";
    case IDEM_EINVAL:
        return "invalid argument";
    case IDEM_ENOMEM:
        return "out of memory or file descriptors";
    case IDEM_EIO:
        return "I/O error";
    case IDEM_EFATAL:
        return "store stopped after a failed write or flush; reopen to recover";
    case IDEM_EFULL:
        return "store full: capacity limit or disk full";
    case IDEM_ECORRUPT:
        return "store file corrupt";
    case IDEM_EVERSION:
        return "unknown store format version";
    case IDEM_ELOCKED:
        return "store in use by another process";
    case IDEM_ENOTFOUND:
        return "not found (no such key; at open, no store in the directory)";
    case IDEM_ESTALE:
        return "stale token: not the current owner";
    case IDEM_ECONFLICT:
        return "commit conflicts with the recorded result";
    case IDEM_ECHANGED:
        return "record changed since the expected version";
    case IDEM_ESTATE:
        return "the record's state forbids this call";
    case IDEM_ELEASE:
        return "the lease still runs: force needed";
    case IDEM_EREADONLY:
        return "store opened read-only";
    case IDEM_ECLOSED:
        return "store closing";
    case IDEM_EBUSY:
        return "busy: the queue is full or holds completions, or the call ran out of its time";
    case IDEM_ENOTSUP:
        return "not supported in this configuration";
    default:
        return "unknown error";
    }
}

const char *idem_outcome_name(int outcome)
{
    static const char *const names[] = {"?",        "new",     "busy",  "done",
                                        "mismatch", "recover", "review"};
    return outcome >= 1 && outcome <= 6 ? names[outcome] : "?";
}

const char *idem_state_name(int state)
{
    static const char *const names[] = {"absent", "in_flight", "committed", "review"};
    return state >= 0 && state <= 3 ? names[state] : "?";
}

void idem_fingerprint(const void *content, size_t len, uint8_t out[IDEM_FP_BYTES])
{
    XXH128_hash_t h = XXH3_128bits(content, len);
    XXH128_canonical_t c;
    XXH128_canonicalFromHash(&c, h);
    memcpy(out, c.digest, IDEM_FP_BYTES);
}
