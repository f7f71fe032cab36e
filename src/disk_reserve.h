/*
 * disk_reserve.h: room held on the store's file system for the work that frees space.
 *
 * Space comes back only through compaction and retirement: a walk writes copies and DELETEs
 * into the log, and its segments are deleted only under a checkpoint begun after it, which is a
 * new file. On a file system the log has filled, neither could start, and a store whose keys had
 * all expired answered FULL for good. So the store holds a file, `reserve`, allocated to the size
 * that work needs (store.c, reserve_want: three checkpoints at their largest, two segments,
 * 1 MiB). When
 * the log reaches the end of its last segment and the next cannot be made for want of space, the
 * file is let go: new keys answer FULL from then on (as they would have without it), the next
 * segment is made only where the checkpoints' room is left beside it, and owner calls, compaction
 * and checkpoints go on in that room and free what they can. Once the reserve and a segment more
 * are free again the file is taken back and new keys are taken. An open or allocation that finds
 * no room leaves the reserve short (new keys are taken, as before it existed) and is tried again
 * each second; but an open that finds the file empty, as a release leaves it, and no room to
 * allocate it, and a segment more, keeps it let go (reserve_start). Of the two segments, one is
 * for a walk's copies of one segment, the other for other writes meanwhile: a bound, not a proof
 * (design.md sections 16 and 21).
 *
 * The file's content is never read: its blocks are what it is for. It is not synced but at its
 * release (blocks a truncate freed are reused only once the file system commits), and a crash
 * leaves it as it was; a store that finds no file makes one, named `reserve` only once it is
 * allocated. Not thread-safe: the store calls it from its open and from the flusher.
 */
#ifndef IDEM_DISK_RESERVE_H
#define IDEM_DISK_RESERVE_H

#include <stdint.h>

struct disk_reserve {
    int fd;          /* the reserve file; -1: not open (yet, or off) */
    int off;         /* none is kept for good: the file system cannot allocate ahead */
    int released;    /* let go at the log's end on a full disk: new keys answer FULL */
    int short_said;  /* a failed open or allocation was logged (cleared by one that works) */
    int root_blocks; /* the process may use blocks a file system keeps for root (ext4: 5%) */
    int made;        /* the last open made the file (as DISK_RESERVE_MAKING), not yet allocated */
    uint64_t held;   /* bytes allocated to the file */
    const char *dir; /* the store's directory (the open's; it outlives the reserve) */
};

#define DISK_RESERVE_NAME   "reserve"
#define DISK_RESERVE_MAKING "reserve.new" /* a new file until its first allocation */

/* Opens or makes dir's reserve file (held: its size; made: it was not there). Returns 0 or
 * -errno (r->fd -1). An empty file found is one let go before. */
int disk_reserve_open(struct disk_reserve *r, const char *dir);
/* Allocates the file to exactly bytes (shrinks it when larger), and names a file the open made
 * `reserve`. Returns 0 or -errno: then the file holds what it held before (a made one keeps its
 * making name until a hold succeeds), and -EOPNOTSUPP or -ENOSYS means it never can. */
int disk_reserve_hold(struct disk_reserve *r, uint64_t bytes);
/* Frees the file's blocks and syncs its file system, so that they can be handed out at once. */
void disk_reserve_release(struct disk_reserve *r);
/* Closes the file; one made and never allocated (still DISK_RESERVE_MAKING) is deleted. */
void disk_reserve_close(struct disk_reserve *r);
/* The bytes free to this process on dir's file system (with the blocks kept for root where it
 * may use them: root_blocks); UINT64_MAX when it cannot be read. */
uint64_t disk_free_bytes(const char *dir, int root_blocks);

#endif
