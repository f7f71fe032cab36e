/*
 * import_mark.c: the import marker, DIR/IMPORTING (IDEM_IMPORT_MARKER in idem.h).
 *
 * An import into a store that already exists (idemctl import into a store made by idemd's first
 * start, or with --force) writes records one by one, each durable as it goes. A crash part-way
 * leaves a store that holds some of the export and opens like any other: the keys not yet
 * imported would answer `new` again. The marker says that such an import is under way:
 *
 *   - the import creates it (idem_import_mark) after its own open and before its first write,
 *     and makes it durable: the file flushed, then the directory synced;
 *   - it is removed (idem_import_unmark) only after the import read the whole export and
 *     idem_close returned IDEM_OK, under the store's lock taken shared (so an inspection that
 *     runs then does not fail the import), and the directory synced again;
 *   - while it exists, an open is refused (import_mark_check, called by the open once it holds
 *     the lock) unless it is read-only (inspections: reported on stderr) or sets
 *     idem_options.importing (an import taking the store again, to finish).
 *
 * So a crash at any point of an import leaves either the store as it was (before the marker is
 * durable, nothing has been written) or a marked store (from the marker on, until its removal is
 * durable). Content: one line of text, `pid=<pid> host=<host> started_ms=<wall ms>`, for the
 * operator; only the file's presence counts, so a marker cut short by a crash still marks.
 * A marker already present (a re-run) is kept as it is, naming the import that was cut short.
 * A store made in a directory of its own and renamed into place once whole (idemctl import into
 * a new directory) needs no marker: its name is its marker.
 */
#include "import_mark.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "io_posix.h"
#include "store.h"
#include "super.h"
#include "util.h"

#define MARK_LINE_MAX 320u /* the marker's line, as written and as read back */

/* DIR/IMPORTING into buf: 0, or IDEM_EINVAL for a dir too long for it. */
static int mark_path(const char *dir, char *buf, size_t cap)
{
    int n = snprintf(buf, cap, "%s/%s", dir, IDEM_IMPORT_MARKER);
    if (n >= 0 && (size_t)n < cap) return 0;
    store_set_error("directory name too long: %.64s...", dir);
    return IDEM_EINVAL;
}

/* fsync of the directory itself, so that a name made or removed in it survives a power loss
 * (the posix I/O layer's, which needs no ring). 0 or -errno. */
static int mark_sync_dir(const char *dir)
{
    return io_posix_sync_dir(NULL, dir);
}

/* The marker's first line (who began the import), or "no owner recorded". */
static void mark_owner(const char *path, char *buf, size_t cap)
{
    snprintf(buf, cap, "no owner recorded");
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return;
    char line[MARK_LINE_MAX];
    ssize_t n = pread(fd, line, sizeof line - 1, 0);
    close(fd);
    line[n > 0 ? n : 0] = 0;
    line[strcspn(line, "\n")] = 0;
    if (*line) snprintf(buf, cap, "%s", line);
}

int idem_import_marked(const char *dir)
{
    if (!dir || !*dir) return IDEM_EINVAL;
    char path[4096];
    if (mark_path(dir, path, sizeof path) < 0) return IDEM_EINVAL;
    struct stat st;
    if (lstat(path, &st) == 0) return 1;
    if (errno == ENOENT || errno == ENOTDIR) return 0;
    store_set_error("cannot look for %s: %s", path, strerror(errno));
    return IDEM_EIO;
}

/* Creates dir's marker holding line (len bytes), durable: the file flushed, then the directory
 * synced. One there already (a re-run) is kept as it is and synced again. */
static int mark_create(const char *dir, const char *line, size_t len)
{
    char path[4096];
    if (mark_path(dir, path, sizeof path) < 0) return IDEM_EINVAL;
    int e = 0;
    int fd = open(path, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
    if (fd < 0 && errno == EEXIST) {
        /* A re-run: the earlier import's marker stays. Synced again, as the crash that cut
         * the earlier import short may have come before its directory was. */
        int rc = mark_sync_dir(dir);
        if (rc == 0) return IDEM_OK;
        store_set_error("cannot sync %s: %s", dir, strerror(-rc));
        return IDEM_EIO;
    }
    if (fd < 0) {
        e = errno;
        store_set_error("cannot create %s: %s", path, strerror(e));
        return UTIL_NO_SPACE(-e) ? IDEM_EFULL : IDEM_EIO;
    }
    errno = EIO; /* a short write sets none */
    if ((len && write(fd, line, len) != (ssize_t)len) || fsync(fd) < 0) e = errno;
    close(fd);
    if (e == 0) e = -mark_sync_dir(dir);
    if (e != 0) {
        /* The import stops before its first write: no marker is left to refuse a store that
         * holds what it held (if this delete is lost, the marker refuses it: the safe side). */
        unlink(path);
        store_set_error("cannot create %s: %s", path, strerror(e));
        return UTIL_NO_SPACE(-e) ? IDEM_EFULL : IDEM_EIO;
    }
    return IDEM_OK;
}

int idem_import_mark(const char *dir)
{
    if (!dir || !*dir) return IDEM_EINVAL;
    char host[128] = "";
    gethostname(host, sizeof host - 1);
    char line[MARK_LINE_MAX];
    int len = snprintf(line, sizeof line, "pid=%d host=%s started_ms=%lld\n", (int)getpid(), host,
                       (long long)util_realtime_ms());
    if (len < 0 || (size_t)len >= sizeof line) len = (int)strlen(line);
    return mark_create(dir, line, (size_t)len);
}

int import_mark_copy(const char *src, const char *dest)
{
    int marked = idem_import_marked(src); /* any entry of the name marks it (lstat) */
    if (marked <= 0) return marked;
    /* Its content names the import; a marker that is no file to read (a link, a directory)
     * still marks, and its copy is an empty one. */
    char path[4096], line[MARK_LINE_MAX];
    if (mark_path(src, path, sizeof path) < 0) return IDEM_EINVAL;
    int fd = open(path, O_RDONLY | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK);
    ssize_t n = fd < 0 ? -1 : pread(fd, line, sizeof line, 0);
    if (fd >= 0) close(fd);
    return mark_create(dest, line, n > 0 ? (size_t)n : 0);
}

int idem_import_unmark(const char *dir)
{
    if (!dir || !*dir) return IDEM_EINVAL;
    char path[4096], err[512];
    if (mark_path(dir, path, sizeof path) < 0) return IDEM_EINVAL;
    /* Under the lock, shared: the marker of an import that runs now (it holds the lock alone)
     * is never removed by another, and no open that writes starts while it goes; inspections
     * (read-only opens, sharing it) may run. The lock file is made if it is missing (as an
     * open that writes would make it), so that the lock holds then too. */
    int lock_fd;
    int rc = lock_acquire(dir, LOCK_AS_SHARER, &lock_fd, err, sizeof err);
    if (rc < 0) {
        store_set_error("%s", err);
        return rc;
    }
    int e = unlink(path) < 0 && errno != ENOENT ? errno : 0;
    if (e == 0) e = -mark_sync_dir(dir);
    lock_release(lock_fd);
    if (e != 0) {
        store_set_error("cannot remove %s: %s", path, strerror(e));
        return IDEM_EIO;
    }
    return IDEM_OK;
}

int import_mark_check(const char *dir, const idem_options *o)
{
    IDEM_ASSERT(dir != NULL);
    IDEM_ASSERT(o != NULL);
    int marked = idem_import_marked(dir);
    if (marked <= 0 || o->importing) return marked;
    char path[4096], owner[MARK_LINE_MAX];
    if (mark_path(dir, path, sizeof path) < 0) return IDEM_EINVAL;
    mark_owner(path, owner, sizeof owner);
    if (o->read_only) {
        fprintf(stderr,
                "idem: event=import_unfinished file=%s owner=\"%s\" msg=\"an import into this "
                "store was cut short: it may hold only part of the export; opens that write "
                "are refused until the import is run again\"\n",
                path, owner);
        return 0;
    }
    store_set_error("%s: an import into this store was cut short (%s), so it may hold only part of "
                    "the export: run the import again with --force to finish it, or remove the "
                    "file once the store is known to hold what it should",
                    path, owner);
    return IDEM_ECORRUPT;
}
