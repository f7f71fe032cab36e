/*
 * compact.c: space reclamation and expiry sweeping, in log order.
 *
 * The oldest segment (the head) is walked frame by frame, a bounded number per step on the
 * flusher thread: a record the index still points to is copied forward unchanged (first_seen,
 * token, version and all), an expired committed record is removed with a logged DELETE, anything
 * else is dead. Working strictly from the head keeps deletion safe: when a frame reaches the
 * head, every older version of its key was in a segment already retired.
 *
 * A walked segment is retired (superblock first, then the file) once (a) the copies and deletes
 * it caused are durable and (b) a checkpoint was written after the walk ended, so the image
 * recovery starts from points at no frame of it and replay starts after it.
 *
 * When: the head is compacted if the log holds more than twice the live bytes (plus slack of
 * STORE_CMP_SLACK_SEGS segments), or every record written to the head has passed its
 * expires_at (its records are all expired or unfinished). Disk use thus stays within about 2x
 * the live bytes, and expired keys leave memory as the log turns over.
 */
#include <stdint.h>
#include <stdio.h>

#include "store.h"
#include "util.h"

#define STORE_CMP_FRAMES_PER_STEP 512
#define STORE_CMP_SLACK_SEGS      2
#define STORE_CKPT_EVERY_SEGS     8

/* The largest expires_at_ms of the records in a segment whose horizon is not known (segments
 * written before the last open): one read-only pass over its frames, no copy. */
static int64_t segment_horizon(idem_store *s, uint64_t seq)
{
    int64_t *m = &s->seg_max_exp[seq % WAL_SEG_SLOTS];
    if (*m != SEG_EXP_UNKNOWN) return *m;
    int64_t max = SEG_EXP_EMPTY;
    uint32_t off = WAL_BLOCK;
    struct wal_frame f;
    int more;
    while ((more = wal_seg_next(s->wal, seq, &off, &f)) == 1) {
        if (f.type == WAL_T_RECORD && f.payload_len >= REC_FIXED_BYTES) {
            int64_t exp = (int64_t)util_get_u64(f.payload + 24);
            if (exp > max) max = exp;
        }
    }
    /* A broken chain: let the compaction walk meet it and report it. */
    *m = more < 0 ? SEG_EXP_EMPTY : max;
    return *m;
}

static int head_wanted(idem_store *s, uint64_t head)
{
    if (!wal_seg_durable(s->wal, head, s->durable_lsn))
        return 0; /* the head must be sealed and every frame of it durable */
    if (head < s->cmp_force_until) return 1; /* idem_compact asked for it */
    uint64_t seg = s->opt.segment_bytes;
    if (wal_bytes(s->wal) > 2 * s->live_bytes + STORE_CMP_SLACK_SEGS * seg) return 1;
    return segment_horizon(s, head) <= store_now(s);
}

int compact_wants_checkpoint(const idem_store *s)
{
    if (s->cmp_done && s->sb.ckpt_lsn < s->cmp_done_lsn) return 1;
    return wal_cur_seq(s->wal) - s->sb.ckpt_seq >= STORE_CKPT_EVERY_SEGS;
}

static int retire(idem_store *s)
{
    /* The checkpoint must be younger than the whole walk: an older image may point into this
     * segment at records that were superseded or copied since. */
    if (s->durable_lsn < s->cmp_last_lsn || s->sb.ckpt_lsn < s->cmp_done_lsn ||
        s->cmp_seq >= s->sb.ckpt_seq)
        return 0;
    /* A checkpoint in steps may hold entries into this segment (taken before the copies), and
     * a backup may be copying it. */
    if (s->ckr.state != CKPT_RUN_IDLE || s->backups) return 0;
    struct super sb = s->sb;
    sb.wal_first_seq = s->cmp_seq + 1;
    int rc = super_store(s->io, s->dir, &sb);
    if (rc < 0) return rc;
    s->sb = sb;
    rc = wal_retire(s->wal, s->cmp_seq);
    if (rc < 0) return rc;
    s->seg_max_exp[s->cmp_seq % WAL_SEG_SLOTS] = SEG_EXP_UNKNOWN;
    s->cmp_seq = 0;
    s->cmp_done = 0;
    s->st.compactions++;
    pthread_cond_broadcast(&s->cond_ready); /* idem_compact may wait for this */
    return 1;
}

int compact_step(idem_store *s)
{
    if (s->fatal || s->closing || s->opt.read_only || s->cmp_disabled) return 0;
    if (s->cmp_done) return retire(s);
    if (!s->cmp_seq) {
        uint64_t head = wal_first_seq(s->wal);
        if (!head_wanted(s, head)) return 0;
        s->cmp_seq = head;
        s->cmp_off = WAL_BLOCK;
        s->cmp_last_lsn = 0;
    }
    int64_t now = store_now(s);
    for (int i = 0; i < STORE_CMP_FRAMES_PER_STEP; i++) {
        if (store_room_ok(s) != 0)
            return i > 0; /* no buffer room or segment now: go on at a later step */
        uint32_t off = s->cmp_off;
        struct wal_frame f;
        int more = wal_seg_next(s->wal, s->cmp_seq, &off, &f);
        if (more == 0) {
            s->cmp_done = 1;
            s->cmp_done_lsn = wal_last_lsn(s->wal);
            return 1;
        }
        uint64_t lsn = 0;
        int rc = more < 0 ? IDEM_ECORRUPT : ops_compact_frame(s, &f, now, &lsn);
        if (rc == IDEM_EBUSY || rc == IDEM_EFULL) return i > 0;
        if (rc == IDEM_ECORRUPT) {
            /* Reported, never trusted: compaction stops; the store serves on; verify tells. */
            fprintf(stderr, "idem: event=compaction_stopped segment=%llu offset=%u error=\"%s\"\n",
                    (unsigned long long)s->cmp_seq, s->cmp_off, idem_strerror(rc));
            s->cmp_disabled = 1;
            return 0;
        }
        if (rc < 0) return rc;
        s->cmp_off = off;
        if (lsn) s->cmp_last_lsn = lsn;
    }
    return 1;
}
