/*
 * io.h: the one I/O interface of the store, at the ring level (submit writes and flushes, reap
 * completions), plus the few file-system calls the store needs. Three backends implement it:
 *   io_uring.c  writes through io_uring; the flushes they ask for (IO_W_FLUSH) are one
 *               fdatasync per file, called in io_wait() once those writes completed, and the
 *               completion reports both.
 *   io_thread.c pwrite + fdatasync, performed in io_wait() on the caller's (flusher) thread.
 *   io_sim.c    a simulated disk for tests: files in memory, unsynced writes pending until a
 *               flush, crashes that keep a random subset of them (torn, bit-flipped), and
 *               faults injected as completion results (EIO, ENOSPC, short writes).
 *
 * Rules every backend keeps:
 *   - Errors are negative errno values; nothing here sets errno for the caller.
 *   - A completion's res is the byte count of a write (possibly short), 0 for a flush, or -errno.
 *     With IO_W_FLUSH, res is the write's byte count only if the flush succeeded too.
 *   - A flush of a file covers every write to that file whose completion was reaped before the
 *     flush was submitted, and the write it is linked to.
 *   - Create, rename and unlink are durable only after io_sync_dir() of the directory.
 *   - Reads and maps see every write whose completion was reaped (the page cache view).
 *   - One thread at a time submits and reaps (the store's flusher); open, read, map, close,
 *     unlink, rename, sync_dir, allocate and reserve may be called from any thread, and so may
 *     write_now (each handle used by one thread at a time).
 */
#ifndef IDEM_IO_H
#define IDEM_IO_H

#include <errno.h>
#include <stddef.h>
#include <stdint.h>

struct io;
struct io_file;

/* io_open flags */
#define IO_O_CREATE 0x1u  /* create if absent */
#define IO_O_EXCL   0x2u  /* with CREATE: fail with -EEXIST if present */
#define IO_O_RDONLY 0x4u  /* open for reading only */
#define IO_O_DIRECT 0x8u  /* try O_DIRECT for writes (4 KiB aligned buffers, offsets, lengths) */
#define IO_O_DSYNC  0x10u /* every write_now through this handle is durable when it returns */

/* io_submit_write flags */
#define IO_W_FLUSH 0x1u /* follow the write by a flush of the file; one completion for both */

struct io_completion {
    uint64_t user_data;
    int64_t res;
};

struct io_ops {
    const char *name;
    int (*open)(struct io *io, const char *path, unsigned flags, struct io_file **out);
    void (*close)(struct io *io, struct io_file *f);
    int (*size)(struct io *io, struct io_file *f, uint64_t *out);
    /* Reserves [off, off+len) on disk (fallocate): -ENOSPC when the disk is full. */
    int (*allocate)(struct io *io, struct io_file *f, uint64_t off, uint64_t len);
    int (*truncate)(struct io *io, struct io_file *f, uint64_t len);
    /* Reserves disk space for [off, off+len) and leaves the file's size alone (fallocate with
     * FALLOC_FL_KEEP_SIZE): writes there later cannot fail for space. -ENOSPC when the disk is
     * full, -EOPNOTSUPP where the file system cannot. */
    int (*reserve)(struct io *io, struct io_file *f, uint64_t off, uint64_t len);
    /* Synchronous read; returns bytes read (short at end of file) or -errno. */
    int64_t (*read)(struct io *io, struct io_file *f, uint64_t off, void *buf, size_t len);
    /* The first stretch at or after off that may hold data: [*data, *hole). Holes and space
     * allocated but never written read as zeros and are skipped; *data is UINT64_MAX when
     * nothing but those follows. A backend that cannot tell reports [off, UINT64_MAX). */
    int (*data_after)(struct io *io, struct io_file *f, uint64_t off, uint64_t *data,
                      uint64_t *hole);
    /* 1 when a write over bytes of f already written reuses their space (ext4, XFS, a NOCOW file
     * on btrfs: io_posix_open marks the files it creates so), so zeros written over
     * preallocated space keep it the file's; 0 where such a write takes new space and can fail
     * with ENOSPC on a full disk (copy on write: other files on btrfs), or where not known. */
    int (*overwrites_in_place)(struct io *io, struct io_file *f);
    /* Maps [0, len) of the file read-only; *out stays valid until unmap. */
    int (*map)(struct io *io, struct io_file *f, size_t len, const void **out);
    void (*unmap)(struct io *io, struct io_file *f, const void *p, size_t len);
    int (*unlink)(struct io *io, const char *path);
    int (*rename)(struct io *io, const char *from, const char *to);
    int (*sync_dir)(struct io *io, const char *dir);
    /* Calls fn(name, ctx) for each file in directory dir (its name alone; not "." or ".."),
     * until fn returns nonzero. fn must not call the backend. Returns 0 or -errno. */
    int (*list)(struct io *io, const char *dir, int (*fn)(const char *name, void *ctx), void *ctx);
    /* Creates a directory (mode 0700); -EEXIST if present. */
    int (*mkdir)(struct io *io, const char *path);
    /* Makes later reads and maps of f see what the disk holds wherever the cache is clean: drops
     * f's cached pages that are not dirty (POSIX_FADV_DONTNEED; pages this process has read
     * through a map may stay). After a failed writeback Linux keeps the failed pages cached and
     * marked clean, so a read would show data no disk holds: flush, then drop. */
    int (*drop_cache)(struct io *io, struct io_file *f);
    /* Writes buf[0, len) at off at once, outside the ring; returns the bytes written (maybe
     * short) or -errno. Through a handle opened with IO_O_DSYNC that write is durable on return
     * (O_DSYNC: its own data, not the file's other unsynced writes). */
    int64_t (*write_now)(struct io *io, struct io_file *f, uint64_t off, const void *buf,
                         size_t len);
    /* Queues a write of buf[0, len) at off (buf must stay valid until its completion). */
    int (*submit_write)(struct io *io, struct io_file *f, uint64_t off, const void *buf, size_t len,
                        unsigned flags, uint64_t user_data);
    /* Queues a flush (fdatasync) of f. */
    int (*submit_flush)(struct io *io, struct io_file *f, uint64_t user_data);
    /* Reaps up to max completions, waiting until at least min are there (min <= submitted and
     * unreaped). Returns the count or -errno. */
    int (*wait)(struct io *io, struct io_completion *out, int max, int min);
    void (*destroy)(struct io *io);
};

struct io {
    const struct io_ops *ops;
};

/* The last failure on this thread of a call that changes files (which call, -errno; open only
 * when creating or for another reason than a missing file, unlink and mkdir not for a missing or
 * present one), kept so that a failure reported upward only as an I/O error can be named. */
struct io_fault {
    const char *call;
    int err;
};
extern __thread struct io_fault io_fault_last;

static inline void io_fault_clear(void)
{
    io_fault_last.call = NULL;
    io_fault_last.err = 0;
}

static inline int64_t io_noted(const char *call, int64_t rc)
{
    if (rc < 0) {
        io_fault_last.call = call;
        io_fault_last.err = (int)rc;
    }
    return rc;
}

/* Backends. Each returns 0 and *out, or -errno (io_uring: -ENOSYS/-EPERM where refused). */
int io_uring_create(unsigned entries, struct io **out);
int io_thread_create(struct io **out);
/* Tests: the next count submits of an io_uring backend fail with err (-EAGAIN, -EBUSY, ...)
 * without entering the kernel, as the kernel refuses a submit when short of memory. */
void io_uring_test_refuse(struct io *io, int err, uint32_t count);
/* Tests: how many of those refusals are still to come (any thread may ask). */
uint32_t io_uring_test_refusals_left(struct io *io);

/* Convenience wrappers over the vtable. */
static inline int io_open(struct io *io, const char *path, unsigned flags, struct io_file **out)
{
    int rc = io->ops->open(io, path, flags, out);
    return (flags & IO_O_CREATE) || rc != -ENOENT ? (int)io_noted("open", rc) : rc;
}
static inline void io_close(struct io *io, struct io_file *f)
{
    io->ops->close(io, f);
}
static inline int io_size(struct io *io, struct io_file *f, uint64_t *out)
{
    return io->ops->size(io, f, out);
}
static inline int io_allocate(struct io *io, struct io_file *f, uint64_t off, uint64_t len)
{
    return (int)io_noted("fallocate", io->ops->allocate(io, f, off, len));
}
static inline int io_reserve(struct io *io, struct io_file *f, uint64_t off, uint64_t len)
{
    return (int)io_noted("fallocate", io->ops->reserve(io, f, off, len));
}
static inline int io_truncate(struct io *io, struct io_file *f, uint64_t len)
{
    return (int)io_noted("ftruncate", io->ops->truncate(io, f, len));
}
static inline int64_t io_read(struct io *io, struct io_file *f, uint64_t off, void *buf, size_t len)
{
    return io->ops->read(io, f, off, buf, len);
}
static inline int io_data_after(struct io *io, struct io_file *f, uint64_t off, uint64_t *data,
                                uint64_t *hole)
{
    return io->ops->data_after(io, f, off, data, hole);
}
static inline int io_overwrites_in_place(struct io *io, struct io_file *f)
{
    return io->ops->overwrites_in_place(io, f);
}
static inline int io_map(struct io *io, struct io_file *f, size_t len, const void **out)
{
    return (int)io_noted("mmap", io->ops->map(io, f, len, out));
}
static inline void io_unmap(struct io *io, struct io_file *f, const void *p, size_t len)
{
    io->ops->unmap(io, f, p, len);
}
static inline int io_unlink(struct io *io, const char *path)
{
    int rc = io->ops->unlink(io, path);
    return rc != -ENOENT ? (int)io_noted("unlink", rc) : rc;
}
static inline int io_rename(struct io *io, const char *from, const char *to)
{
    return (int)io_noted("rename", io->ops->rename(io, from, to));
}
static inline int io_sync_dir(struct io *io, const char *dir)
{
    return (int)io_noted("fsync of the directory", io->ops->sync_dir(io, dir));
}
static inline int io_list(struct io *io, const char *dir, int (*fn)(const char *name, void *ctx),
                          void *ctx)
{
    return io->ops->list(io, dir, fn, ctx);
}
static inline int io_mkdir(struct io *io, const char *path)
{
    int rc = io->ops->mkdir(io, path);
    return rc != -EEXIST ? (int)io_noted("mkdir", rc) : rc;
}
static inline int io_drop_cache(struct io *io, struct io_file *f)
{
    return (int)io_noted("posix_fadvise", io->ops->drop_cache(io, f));
}
static inline int64_t io_write_now(struct io *io, struct io_file *f, uint64_t off, const void *buf,
                                   size_t len)
{
    return io_noted("write", io->ops->write_now(io, f, off, buf, len));
}
static inline int io_submit_write(struct io *io, struct io_file *f, uint64_t off, const void *buf,
                                  size_t len, unsigned flags, uint64_t user_data)
{
    return (int)io_noted("write", io->ops->submit_write(io, f, off, buf, len, flags, user_data));
}
static inline int io_submit_flush(struct io *io, struct io_file *f, uint64_t user_data)
{
    return (int)io_noted("fdatasync", io->ops->submit_flush(io, f, user_data));
}
static inline int io_wait(struct io *io, struct io_completion *out, int max, int min)
{
    return (int)io_noted("waiting for the ring", io->ops->wait(io, out, max, min));
}
static inline void io_destroy(struct io *io)
{
    io->ops->destroy(io);
}

/* Synchronous helpers built on the ring calls (loop over short writes; any error is returned):
 * write buf at off, then (if flush) flush; used outside the group-commit path. */
int io_write_sync(struct io *io, struct io_file *f, uint64_t off, const void *buf, size_t len,
                  int flush);
int io_flush_sync(struct io *io, struct io_file *f);
/* Flushes f, then drops its clean cached pages: later reads see what the disk holds (an open
 * after a run that did not end cleanly, store.h settle_files). */
int io_settle(struct io *io, struct io_file *f);

#endif /* IDEM_IO_H */
