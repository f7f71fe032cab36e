/*
 * io_posix.c: the file-system calls shared by the real backends (see io_posix.h).
 * Invariants: each function maps errno to -errno where the call fails; EINTR is retried; an
 * O_DIRECT open refused with EINVAL falls back to a buffered open of the same file.
 */
#include "io_posix.h"
#include "util.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <linux/btrfs.h>
#include <linux/btrfs_tree.h>
#include <linux/fs.h>
#include <linux/magic.h>
#include <sys/ioctl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/vfs.h>
#include <unistd.h>

/* Largest single read: pread returns at most about 2 GiB anyway. */
#define IO_POSIX_READ_MAX ((size_t)1 << 30)

static int io_posix_open_flags(unsigned flags)
{
    int oflags = O_CLOEXEC;
    oflags |= (flags & IO_O_RDONLY) ? O_RDONLY : O_RDWR;
    if (flags & IO_O_CREATE) oflags |= O_CREAT;
    if ((flags & IO_O_CREATE) && (flags & IO_O_EXCL)) oflags |= O_EXCL;
    if (flags & IO_O_DSYNC) oflags |= O_DSYNC;
    return oflags;
}

static int is_btrfs(int fd)
{
    struct statfs sf;
    return fstatfs(fd, &sf) == 0 && (unsigned long)sf.f_type == BTRFS_SUPER_MAGIC;
}

/* 1 when btrfs keeps a single copy of the data (profile single or RAID0) on every data block
 * group. With two copies or parity (DUP, RAID1*, RAID10, RAID5/6) the store's files stay copy
 * on write: a NOCOW file has no checksums that let btrfs pick or repair the good copy, and its
 * copies written in place may differ after a power loss. */
static int btrfs_data_single(int fd)
{
    struct btrfs_ioctl_space_args probe = {0};
    if (ioctl(fd, BTRFS_IOC_SPACE_INFO, &probe) != 0 || probe.total_spaces == 0 ||
        probe.total_spaces > 64)
        return 0;
    uint64_t n = probe.total_spaces;
    struct btrfs_ioctl_space_args *a = calloc(1, sizeof *a + n * sizeof a->spaces[0]);
    if (!a) return 0;
    a->space_slots = n;
    int single = ioctl(fd, BTRFS_IOC_SPACE_INFO, a) == 0 && a->total_spaces > 0;
    for (uint64_t i = 0; single && i < a->total_spaces && i < n; i++)
        if ((a->spaces[i].flags & BTRFS_BLOCK_GROUP_DATA) &&
            (a->spaces[i].flags & BTRFS_BLOCK_GROUP_PROFILE_MASK & ~BTRFS_BLOCK_GROUP_RAID0))
            single = 0;
    free(a);
    return single;
}

/* On btrfs with one copy of the data, a file the store creates (or empties to reuse) is marked
 * NOCOW (chattr +C): its writes over written bytes then stay in place, as on ext4, so a full
 * disk cannot refuse them (the superblock's copies, the log's space zero-filled ahead of it, a
 * segment made again). btrfs takes the mark only while the file is empty, and keeps no
 * checksums of such data; every byte idem reads back carries its own. Best effort: where it
 * is refused the file stays copy on write, and io_posix_overwrites_in_place says so. */
static void nocow_if_empty(int fd, const char *path)
{
    struct stat st;
    if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode) || st.st_size != 0 || !is_btrfs(fd)) return;
    int attr = 0;
    if (ioctl(fd, FS_IOC_GETFLAGS, &attr) != 0 || (attr & FS_NOCOW_FL) || !btrfs_data_single(fd))
        return;
    attr |= FS_NOCOW_FL;
    if (ioctl(fd, FS_IOC_SETFLAGS, &attr) != 0)
        fprintf(stderr, "idem: event=nocow_refused file=%s error=\"%s\"\n", path ? path : "-",
                strerror(errno));
}

int io_posix_open(struct io *io, const char *path, unsigned flags, struct io_file **out)
{
    (void)io;
    if (!path || !out ||
        (flags & ~(IO_O_CREATE | IO_O_EXCL | IO_O_RDONLY | IO_O_DIRECT | IO_O_DSYNC)))
        return -EINVAL;
    struct io_file *f = malloc(sizeof *f);
    if (!f) return -ENOMEM;
    int oflags = io_posix_open_flags(flags);
    int fd = -1;
    f->direct = 0;
    if (flags & IO_O_DIRECT) {
        fd = open(path, oflags | O_DIRECT, 0600);
        if (fd >= 0)
            f->direct = 1;
        else if (errno != EINVAL)
            goto out_free;
    }
    if (fd < 0) fd = open(path, oflags, 0600);
    if (fd < 0) goto out_free;
    if (flags & IO_O_CREATE) nocow_if_empty(fd, path);
    f->fd = fd;
    *out = f;
    return 0;

out_free : {
    int err = -errno;
    free(f);
    return err;
}
}

void io_posix_close(struct io *io, struct io_file *f)
{
    (void)io;
    if (!f) return;
    IDEM_ASSERT(f->fd >= 0);
    /* close(2) errors cannot be acted on here: durability is decided by fdatasync. */
    (void)close(f->fd);
    f->fd = -1;
    free(f);
}

int io_posix_size(struct io *io, struct io_file *f, uint64_t *out)
{
    (void)io;
    struct stat st;
    if (fstat(f->fd, &st) != 0) return -errno;
    *out = (uint64_t)st.st_size;
    return 0;
}

int io_posix_allocate(struct io *io, struct io_file *f, uint64_t off, uint64_t len)
{
    (void)io;
    if (off > INT64_MAX || len == 0 || len > INT64_MAX - off) return -EINVAL;
    int rc;
    do {
        rc = fallocate(f->fd, 0, (off_t)off, (off_t)len);
    } while (rc != 0 && errno == EINTR);
    return rc == 0 ? 0 : -errno;
}

int io_posix_truncate(struct io *io, struct io_file *f, uint64_t len)
{
    (void)io;
    if (len > INT64_MAX) return -EINVAL;
    int rc;
    do {
        rc = ftruncate(f->fd, (off_t)len);
    } while (rc != 0 && errno == EINTR);
    if (rc != 0) return -errno;
    if (len == 0) nocow_if_empty(f->fd, NULL); /* a leftover file reused from its start */
    return 0;
}

int64_t io_posix_read(struct io *io, struct io_file *f, uint64_t off, void *buf, size_t len)
{
    (void)io;
    if (off > INT64_MAX) return -EINVAL;
    if (len > IO_POSIX_READ_MAX) len = IO_POSIX_READ_MAX;
    size_t done = 0;
    /* Bounded: each round either makes progress, ends at end of file, or fails. */
    while (done < len) {
        ssize_t n = pread(f->fd, (char *)buf + done, len - done, (off_t)(off + done));
        if (n < 0 && errno == EINTR) continue;
        if (n < 0) return done > 0 ? (int64_t)done : -errno;
        if (n == 0) break;
        done += (size_t)n;
    }
    return (int64_t)done;
}

int64_t io_posix_pwrite(int fd, uint64_t off, const void *buf, size_t len)
{
    if (off > INT64_MAX) return -EINVAL;
    ssize_t n;
    do {
        n = pwrite(fd, buf, len, (off_t)off);
    } while (n < 0 && errno == EINTR);
    return n < 0 ? -errno : (int64_t)n;
}

int64_t io_posix_write_now(struct io *io, struct io_file *f, uint64_t off, const void *buf,
                           size_t len)
{
    (void)io;
    return io_posix_pwrite(f->fd, off, buf, len);
}

/* Not retried on EINTR: where a flush can be interrupted (network and FUSE file systems), the
 * interrupted call may already have consumed a write-back error, and a retry would report
 * success over lost data. The failure is fatal for the store, as any failed flush. */
int64_t io_posix_datasync(int fd)
{
    return fdatasync(fd) == 0 ? 0 : -errno;
}

void io_posix_start_writeback(int fd, uint64_t off, uint64_t len)
{
    if (len > 0 && off <= INT64_MAX)
        (void)sync_file_range(fd, (off64_t)off, (off64_t)len, SYNC_FILE_RANGE_WRITE);
}

/* File systems whose SEEK_DATA is known to count what is still only in the page cache (written,
 * not yet flushed) as data: ext4, XFS, btrfs, tmpfs, and overlayfs (which asks the file below).
 * Elsewhere every byte is taken as data: a FUSE file system, for one, is asked without its
 * dirty pages written back first, and OpenZFS 2.2.0-2.2.1 reported holes wrongly. */
static int fs_reports_holes(int fd)
{
    struct statfs sf;
    if (fstatfs(fd, &sf) != 0) return 0;
    switch ((unsigned long)sf.f_type) {
    case EXT4_SUPER_MAGIC:
    case XFS_SUPER_MAGIC:
    case BTRFS_SUPER_MAGIC:
    case TMPFS_MAGIC:
    case OVERLAYFS_SUPER_MAGIC:
        return 1;
    default:
        return 0;
    }
}

/* ext4 and XFS write over written blocks in place. btrfs writes them elsewhere (copy on
 * write) unless the file is NOCOW (nocow_if_empty): measured on a full btrfs, a write over space
 * zero-filled after fallocate failed with ENOSPC, where a write into space only fallocated
 * succeeded. Elsewhere: not known. */
int io_posix_overwrites_in_place(struct io *io, struct io_file *f)
{
    (void)io;
    struct statfs sf;
    if (fstatfs(f->fd, &sf) != 0) return 0;
    if ((unsigned long)sf.f_type == BTRFS_SUPER_MAGIC) {
        int attr = 0;
        return ioctl(f->fd, FS_IOC_GETFLAGS, &attr) == 0 && (attr & FS_NOCOW_FL);
    }
    return (unsigned long)sf.f_type == EXT4_SUPER_MAGIC ||
           (unsigned long)sf.f_type == XFS_SUPER_MAGIC;
}

int io_posix_data_after(struct io *io, struct io_file *f, uint64_t off, uint64_t *data,
                        uint64_t *hole)
{
    (void)io;
    *data = off;
    *hole = UINT64_MAX;
    if (off > INT64_MAX) return -EINVAL;
    if (!fs_reports_holes(f->fd)) return 0;
    off_t d = lseek(f->fd, (off_t)off, SEEK_DATA);
    if (d < 0) {
        /* ENXIO: nothing but holes from off on. Anything else (a file system without
         * SEEK_DATA): every byte may hold data. */
        if (errno == ENXIO) *data = UINT64_MAX;
        return 0;
    }
    off_t h = lseek(f->fd, d, SEEK_HOLE);
    *data = (uint64_t)d;
    if (h > d) *hole = (uint64_t)h;
    return 0;
}

int io_posix_map(struct io *io, struct io_file *f, size_t len, const void **out)
{
    (void)io;
    if (len == 0 || !out) return -EINVAL;
    void *p = mmap(NULL, len, PROT_READ, MAP_SHARED, f->fd, 0);
    if (p == MAP_FAILED) return -errno;
    *out = p;
    return 0;
}

void io_posix_unmap(struct io *io, struct io_file *f, const void *p, size_t len)
{
    (void)io;
    (void)f;
    if (!p) return;
    int rc = munmap((void *)p, len);
    IDEM_ASSERT(rc == 0);
}

int io_posix_unlink(struct io *io, const char *path)
{
    (void)io;
    return unlink(path) == 0 ? 0 : -errno;
}

int io_posix_rename(struct io *io, const char *from, const char *to)
{
    (void)io;
    return rename(from, to) == 0 ? 0 : -errno;
}

int io_posix_sync_dir(struct io *io, const char *dir)
{
    (void)io;
    int fd = open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (fd < 0) return -errno;
    int rc = 0;
    if (fsync(fd) != 0) rc = -errno;
    (void)close(fd);
    return rc;
}

int io_posix_list(struct io *io, const char *dir, int (*fn)(const char *name, void *ctx), void *ctx)
{
    (void)io;
    DIR *d = opendir(dir);
    if (!d) return -errno;
    struct dirent *e;
    errno = 0;
    while ((e = readdir(d)) != NULL) {
        if (strcmp(e->d_name, ".") == 0 || strcmp(e->d_name, "..") == 0) continue;
        if (fn(e->d_name, ctx)) break;
        errno = 0;
    }
    int rc = e == NULL && errno ? -errno : 0;
    (void)closedir(d);
    return rc;
}

int io_posix_reserve(struct io *io, struct io_file *f, uint64_t off, uint64_t len)
{
    (void)io;
    if (off > INT64_MAX || len == 0 || len > INT64_MAX - off) return -EINVAL;
    int rc;
    do {
        rc = fallocate(f->fd, FALLOC_FL_KEEP_SIZE, (off_t)off, (off_t)len);
    } while (rc != 0 && errno == EINTR);
    return rc == 0 ? 0 : -errno;
}

int io_posix_drop_cache(struct io *io, struct io_file *f)
{
    (void)io;
    return -posix_fadvise(f->fd, 0, 0, POSIX_FADV_DONTNEED); /* it returns the error number */
}

int io_posix_mkdir(struct io *io, const char *path)
{
    (void)io;
    return mkdir(path, 0700) == 0 ? 0 : -errno;
}
