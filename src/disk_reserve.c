/*
 * disk_reserve.c: the reserve file that keeps room for compaction and checkpoints on a full
 * disk (disk_reserve.h says why and when it is let go). Invariants: the file's first held bytes
 * are allocated; a failed allocation leaves it as it was, a release empty; a file is named
 * `reserve` only once it was allocated, so an empty one was let go.
 */
#include "disk_reserve.h"

#include <errno.h>
#include <fcntl.h>
#include <linux/capability.h>
#include <linux/magic.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/statfs.h>
#include <sys/statvfs.h>
#include <sys/syscall.h>
#include <unistd.h>

/* Whether the file system lets this process into the blocks it keeps for root, so that the log
 * of a store run as root fills those too and the free bytes that count for it are f_bfree, not
 * f_bavail: ext2/3/4 do for CAP_SYS_RESOURCE and for the user they are kept for (root unless
 * tune2fs changed it). Elsewhere f_bfree may count space no file can use (btrfs). */
static int may_use_root_blocks(const char *dir)
{
    struct statfs fs;
    if (statfs(dir, &fs) != 0 || fs.f_type != EXT4_SUPER_MAGIC) return 0;
    /* The kernel asks for the capability, or root's uid, in the first user namespace: not
     * what root in a namespace of its own (a rootless container) has. */
    char map[128] = "";
    FILE *f = fopen("/proc/self/uid_map", "re");
    int first_ns = f && fgets(map, sizeof map, f) && strstr(map, " 4294967295") != NULL;
    if (f) fclose(f);
    unsigned a = 1, b = 1;
    if (!first_ns || sscanf(map, "%u %u", &a, &b) != 2 || a != 0 || b != 0) return 0;
    if (geteuid() == 0) return 1;
    struct __user_cap_header_struct h = {.version = _LINUX_CAPABILITY_VERSION_3, .pid = 0};
    struct __user_cap_data_struct d[2];
    if (syscall(SYS_capget, &h, d) != 0) return 0;
    return (d[CAP_SYS_RESOURCE / 32].effective >> (CAP_SYS_RESOURCE % 32)) & 1;
}

/* The path of dir's file name; 0, or -ENAMETOOLONG. */
static int reserve_path(const char *dir, const char *name, char path[4096])
{
    return snprintf(path, 4096, "%s/%s", dir, name) < 4096 ? 0 : -ENAMETOOLONG;
}

int disk_reserve_open(struct disk_reserve *r, const char *dir)
{
    char path[4096];
    r->fd = -1;
    r->dir = dir;
    r->root_blocks = may_use_root_blocks(dir);
    if (reserve_path(dir, DISK_RESERVE_NAME, path) < 0) return -ENAMETOOLONG;
    int fd = open(path, O_RDWR | O_CLOEXEC);
    r->made = fd < 0 && errno == ENOENT;
    /* A new file is allocated under another name, and named once it is (disk_reserve_hold): an
     * empty `reserve` always means a release, also after a crash between the two. A file of
     * that other name a crash left is taken over and cut to nothing. */
    if (r->made) {
        if (reserve_path(dir, DISK_RESERVE_MAKING, path) < 0) return -ENAMETOOLONG;
        fd = open(path, O_RDWR | O_CREAT | O_TRUNC | O_NOFOLLOW | O_CLOEXEC, 0600);
    }
    struct stat st;
    if (fd < 0 || fstat(fd, &st) != 0) {
        int err = errno;
        if (fd >= 0) close(fd);
        if (fd >= 0 && r->made) unlink(path);
        return -err;
    }
    r->fd = fd;
    /* allocated by the hold that gave it that size, unless a copy made it sparse */
    uint64_t blocks = (uint64_t)st.st_blocks * 512;
    r->held = blocks < (uint64_t)st.st_size ? blocks : (uint64_t)st.st_size;
    return 0;
}

int disk_reserve_hold(struct disk_reserve *r, uint64_t bytes)
{
    if (r->held > bytes && ftruncate(r->fd, (off_t)bytes) == 0) r->held = bytes;
    if (r->held == bytes) return 0;
    struct stat st;
    off_t size = fstat(r->fd, &st) == 0 ? st.st_size : (off_t)r->held;
    int rc;
    while ((rc = fallocate(r->fd, 0, 0, (off_t)bytes)) != 0 && errno == EINTR) {
    }
    char from[4096], to[4096];
    if (rc == 0 && r->made) { /* the open made both paths before */
        (void)reserve_path(r->dir, DISK_RESERVE_MAKING, from);
        (void)reserve_path(r->dir, DISK_RESERVE_NAME, to);
        /* The allocation is made durable before the name: a crash must not leave an empty
         * `reserve` (a release) where none was let go, as a file system that does not commit
         * a rename after the allocation before it could. On failure the file keeps the
         * making name: given back, tried again. */
        if (fsync(r->fd) != 0 || rename(from, to) != 0) {
            int err = errno;
            int cut = ftruncate(r->fd, size);
            (void)cut;
            return -err;
        }
    }
    if (rc == 0) {
        r->held = bytes;
        r->made = 0; /* allocated and named: an empty file found later was let go */
        return 0;
    }
    int err = errno;
    /* A refused allocation may have kept part of the range: what it added is given back. */
    int cut = ftruncate(r->fd, size);
    (void)cut; /* else the file keeps it, counted as not held */
    return -err;
}

void disk_reserve_release(struct disk_reserve *r)
{
    r->held = 0;
    /* The blocks a truncate frees are handed out again only once the file system commits: the
     * journal on ext4, the transaction on btrfs (which an fsync does not commit, and which may
     * wait up to 30 s), so the whole file system is synced. A failure leaves blocks held that
     * the next hold allocates over, and costs nothing else. */
    if (ftruncate(r->fd, 0) == 0) syncfs(r->fd);
}

void disk_reserve_close(struct disk_reserve *r)
{
    char path[4096];
    if (r->fd >= 0 && r->made && reserve_path(r->dir, DISK_RESERVE_MAKING, path) == 0)
        unlink(path); /* never allocated: it holds nothing, and the next open makes it again */
    if (r->fd >= 0) close(r->fd);
    r->fd = -1;
}

uint64_t disk_free_bytes(const char *dir, int root_blocks)
{
    struct statvfs vfs;
    if (statvfs(dir, &vfs) != 0) return UINT64_MAX;
    return (uint64_t)(root_blocks ? vfs.f_bfree : vfs.f_bavail) * vfs.f_frsize;
}
