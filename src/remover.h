/*
 * remover.h: deletes files that nothing names any more on a thread of its own, so that freeing
 * their pages never holds up the thread that retired them. Deleting a 64 MiB log segment took
 * 15-18 ms here (the kernel drops its cached pages), a checkpoint of 10 M keys about twice that:
 * on the flusher that was a stall of every acknowledgement.
 *
 * A file is given to it only once no open can need it (a checkpoint neither superblock copy
 * names; a segment the newest durable copy starts the log past, which the older copy's range
 * may still include: an open skips it once missing, wal_open_segments), so a delete that a
 * crash cuts short leaves a file the next open removes (store.c, remove_leftovers). The directory
 * is synced once the queue runs dry. A failed delete is reported, never fatal: the file is a
 * leftover. A directory sync that failed for the disk is kept for the store to fail with
 * (remover_error): what the directory's later syncs report cannot be trusted after it; one
 * refused for descriptors, memory or space is tried again. Thread-safe.
 */
#ifndef IDEM_REMOVER_H
#define IDEM_REMOVER_H

#include <stddef.h>

struct io;
struct io_file;
struct remover;

/* A remover for files of dir, deleted through io (which must be safe to call from another
 * thread for unlink and sync_dir). Its thread starts with the first file. Returns 0 or
 * IDEM_ENOMEM. */
int remover_create(struct io *io, const char *dir, struct remover **out);
/* Queues path for deletion; deletes it on the calling thread if it cannot be queued. */
void remover_add(struct remover *r, const char *path);
/* The same for a file still open, and perhaps mapped (map NULL: not): the map is unmapped and
 * the file closed first (0.6-1 ms for a 64 MiB segment), on the remover's thread too. */
void remover_add_open(struct remover *r, const char *path, struct io_file *f, const void *map,
                      size_t map_len);
/* Whether files are queued or being deleted (their room is not free yet); not while only a
 * directory sync refused for descriptors, memory or space waits to be tried again. */
int remover_pending(struct remover *r);
/* Waits until every file queued so far is deleted and the directory synced (a sync refused for
 * descriptors, memory or space: until one succeeds). */
void remover_drain(struct remover *r);
/* The first directory sync that failed for the disk (-errno), or 0. */
int remover_error(struct remover *r);
/* Drains, stops the thread and frees r (NULL: nothing); a sync refused for descriptors, memory
 * or space is tried once more, then given up (the next open removes what a crash brings
 * back). Returns remover_error's answer. */
int remover_destroy(struct remover *r);

#endif
