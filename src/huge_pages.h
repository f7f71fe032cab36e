/*
 * huge_pages.h: see huge_pages.c.
 */
#ifndef IDEM_HUGE_PAGES_H
#define IDEM_HUGE_PAGES_H

/* Executes the program again, once, with glibc.malloc.hugetlb=1 added to GLIBC_TUNABLES (unless
 * IDEM_MALLOC_HUGE=0, the user set that tunable, or the start is privileged); returns when it does
 * not, with the environment as it found it (in the second start, without IDEM_MALLOC_HUGE=exec).
 * argv: main's, NULL-terminated. */
void huge_pages_reexec(char **argv);

/* Whether GLIBC_TUNABLES asks for it (what the start of idemd and the benchmarks report). */
int huge_pages_tunable(void);

#endif
