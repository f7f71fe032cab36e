/*
 * testutil.h: helpers shared by the test binaries: temporary store directories that are removed
 * afterwards, and seeds that are printed so a failing randomised test can be replayed.
 */
#ifndef IDEM_TESTUTIL_H
#define IDEM_TESTUTIL_H

#include <stddef.h>
#include <stdint.h>

/* Creates a fresh empty directory under $TMPDIR (or /tmp) and returns its path (static storage
 * per call site is not needed: the string is malloc'd). */
char *tu_mkdtemp(const char *tag);
/* Removes a directory tree (rm -rf); ignores errors. Frees path. */
void tu_rmtree(char *path);
/* A seed from $IDEM_SEED if set, else from the clock; printed to stderr with the test's name. */
uint64_t tu_seed(const char *test_name);
/* splitmix64: a small deterministic generator for randomised tests. */
uint64_t tu_rand(uint64_t *state);
/* Reduced counts for the CI tier; $IDEM_LONG=1 selects the long-tier count. */
uint64_t tu_count(uint64_t ci_count, uint64_t long_count);
/* n bytes from tu_rand seeded with seed (nothing for lz4 to save), malloc'd; aborts on ENOMEM. */
uint8_t *tu_random_bytes(size_t n, uint64_t seed);
/* Grows the array v of *cap elements of elem bytes to hold at least need (doubling); returns it.
 * Aborts on ENOMEM (a test cannot go on without its record). */
void *tu_grow(void *v, size_t *cap, size_t need, size_t elem);

/* SET NX of keys <prefix>-<base> .. <prefix>-<base+keys-1> (keys a multiple of 256) to the
 * value val (len bytes) with ttl_ms, through q (depth >= 256), 256 at a time. Asserts each sets
 * its key. */
struct idem_queue;
void tu_set_nx(struct idem_queue *q, const char *prefix, int base, int keys, const void *val,
               uint32_t len, uint64_t ttl_ms);
/* tu_set_nx of keys fill-0 .. fill-(keys-1) to the same 4 KiB of incompressible bytes for an
 * hour: a log of keys x 4 KiB. */
void tu_fill_incompressible(struct idem_queue *q, int keys);
/* Three audit entries (actor "ops", action "del", keys k0..k2) an import writes as one group of
 * three 4 KiB blocks whose second entry starts on the second block (65 bytes of header, "del",
 * "ops", a key of 2 and a reason of 3999: 4072, after the group's header of 24), the third
 * right after it (4176); the group ends at 8248. out holds three. */
struct idem_audit_entry;
void tu_audit_entries_across_blocks(struct idem_audit_entry *out);

#endif
