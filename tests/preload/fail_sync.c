/*
 * fail_sync.c: a library idemd's tests preload (LD_PRELOAD) to fail the store's flushes at a
 * moment of their choosing. Once the file named by IDEM_TEST_FAIL_SYNC_FILE exists, fdatasync
 * and fsync fail with EIO; before, they are the system's. It reaches the thread backend's
 * flushes (IDEM_IO_BACKEND=thread), not io_uring's, which make no such call.
 */
#include <dlfcn.h>
#include <errno.h>
#include <stdlib.h>
#include <unistd.h>

static int failing(void)
{
    const char *f = getenv("IDEM_TEST_FAIL_SYNC_FILE");
    return f && access(f, F_OK) == 0;
}

/* EIO while failing, else the system's call (found once, in *real). */
static int sync_call(const char *name, int (**real)(int), int fd)
{
    if (failing()) {
        errno = EIO;
        return -1;
    }
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
