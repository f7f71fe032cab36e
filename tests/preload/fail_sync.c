/*
 * fail_sync.c: a library idemd's tests preload (LD_PRELOAD) to fail or hold the store's flushes
 * at a moment of their choosing. Once the file named by IDEM_TEST_FAIL_SYNC_FILE exists,
 * fdatasync and fsync fail with EIO; while the file named by IDEM_TEST_HOLD_SYNC_FILE exists,
 * they wait (a disk whose flushes take that long) and then are the system's; else they are the
 * system's. It reaches the flushes of both real backends: io_uring's are fdatasync calls too
 * (io_uring.c), not ring requests.
 */
#include <dlfcn.h>
#include <errno.h>
#include <stdlib.h>
#include <unistd.h>

/* Whether the file the environment variable env names exists. */
static int file_named(const char *env)
{
    const char *f = getenv(env);
    return f && access(f, F_OK) == 0;
}

/* EIO while failing, else, once no hold is on, the system's call (found once, in *real). */
static int sync_call(const char *name, int (**real)(int), int fd)
{
    if (file_named("IDEM_TEST_FAIL_SYNC_FILE")) {
        errno = EIO;
        return -1;
    }
    while (file_named("IDEM_TEST_HOLD_SYNC_FILE"))
        usleep(1000);
    if (!*real) *(void **)real = dlsym(RTLD_NEXT, name);
    return (*real)(fd);
}

int fdatasync(int fd)
{
    static int (*real)(int);
    return sync_call("fdatasync", &real, fd);
}

int fsync(int fd)
{
    static int (*real)(int);
    return sync_call("fsync", &real, fd);
}
