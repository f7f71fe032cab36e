/*
 * fail_epoll.c: a library idemd's tests preload (LD_PRELOAD) to have the kernel refuse to watch
 * descriptors at a moment of their choosing: while the file named by IDEM_TEST_FAIL_EPOLL_FILE
 * exists, epoll_ctl's EPOLL_CTL_ADD fails with ENOMEM (the kernel's answer when it has no memory
 * for one more watch); other operations, and every call before and after, are the system's.
 */
#include <dlfcn.h>
#include <errno.h>
#include <stdlib.h>
#include <sys/epoll.h>
#include <unistd.h>

int epoll_ctl(int epfd, int op, int fd, struct epoll_event *ev)
{
    static int (*real)(int, int, int, struct epoll_event *);
    const char *f = getenv("IDEM_TEST_FAIL_EPOLL_FILE");
    if (op == EPOLL_CTL_ADD && f && access(f, F_OK) == 0) {
        errno = ENOMEM;
        return -1;
    }
    if (!real) *(void **)&real = dlsym(RTLD_NEXT, "epoll_ctl");
    return real(epfd, op, fd, ev);
}
