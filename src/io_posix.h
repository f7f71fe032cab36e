/*
 * io_posix.h: the file-system half of the real I/O backends (io_uring.c, io_thread.c): open,
 * close, size, allocate, truncate, read, write_now, data_after (SEEK_DATA), map, unmap, unlink,
 * rename, sync_dir and mkdir over POSIX calls, with the io_ops signatures so both vtables point at
 * them directly. Invariants: a struct io_file of a real backend is always one of these (fd >= 0
 * while open); every failure is returned as -errno at the call that failed, errno is never left for
 * the caller.
 */
#ifndef IDEM_IO_POSIX_H
#define IDEM_IO_POSIX_H

#include "io.h"

struct io_file {
    int fd;
    int direct; /* 1 when O_DIRECT was accepted by the file system */
};

int io_posix_open(struct io *io, const char *path, unsigned flags, struct io_file **out);
void io_posix_close(struct io *io, struct io_file *f);
int io_posix_size(struct io *io, struct io_file *f, uint64_t *out);
int io_posix_allocate(struct io *io, struct io_file *f, uint64_t off, uint64_t len);
int io_posix_truncate(struct io *io, struct io_file *f, uint64_t len);
int64_t io_posix_read(struct io *io, struct io_file *f, uint64_t off, void *buf, size_t len);
int64_t io_posix_write_now(struct io *io, struct io_file *f, uint64_t off, const void *buf,
                           size_t len);
/* pwrite and fdatasync, retried on EINTR: bytes written (maybe short) or 0, else -errno. */
int64_t io_posix_pwrite(int fd, uint64_t off, const void *buf, size_t len);
int64_t io_posix_datasync(int fd);
/* Starts write-back of [off, off + len) without waiting (sync_file_range): a batch of several
 * writes flushed together gets its first writes going to the disk while the rest are copied
 * (a batch of 40 MiB lost a quarter of its rate without). Errors are left to the fdatasync. */
void io_posix_start_writeback(int fd, uint64_t off, uint64_t len);
int io_posix_overwrites_in_place(struct io *io, struct io_file *f);
int io_posix_data_after(struct io *io, struct io_file *f, uint64_t off, uint64_t *data,
                        uint64_t *hole);
int io_posix_map(struct io *io, struct io_file *f, size_t len, const void **out);
void io_posix_unmap(struct io *io, struct io_file *f, const void *p, size_t len);
int io_posix_unlink(struct io *io, const char *path);
int io_posix_rename(struct io *io, const char *from, const char *to);
int io_posix_sync_dir(struct io *io, const char *dir);
int io_posix_list(struct io *io, const char *dir, int (*fn)(const char *name, void *ctx),
                  void *ctx);
int io_posix_drop_cache(struct io *io, struct io_file *f);
int io_posix_reserve(struct io *io, struct io_file *f, uint64_t off, uint64_t len);
int io_posix_mkdir(struct io *io, const char *path);

#endif /* IDEM_IO_POSIX_H */
