/*
 * test_verify.c: idem_verify, the offline check of a store directory: a sound store written
 * through the API has no fault; a bit flipped in any file of the store (superblock, a log
 * segment, the checkpoint, the audit trail) is found and the file named; the store is
 * byte-identical after a check; a store held by a process is refused (IDEM_ELOCKED).
 */
#include <criterion/criterion.h>
#include <dirent.h>
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>
#include <xxhash.h>

#include "idem.h"
#include "testutil.h"

static char *dir;

static void setup(void)
{
    dir = tu_mkdtemp("verify");
}

static void teardown(void)
{
    tu_rmtree(dir);
}

static void claim_commit(idem_queue *q, const char *key, const char *result)
{
    idem_claim_args a = {
        .ttl_ms = 3600000, .lease_ms = 60000, .fp = key, .fp_len = (uint32_t)strlen(key)};
    idem_completion c;
    cr_assert_eq(idem_claim(q, key, strlen(key), &a, &c), IDEM_OK);
    cr_assert_eq(c.outcome, IDEM_NEW);
    if (result)
        cr_assert_eq(idem_commit(q, key, strlen(key), c.token, result, strlen(result)), IDEM_OK);
}

/* A store with committed, in_flight, review and deleted records, a resolve and a del in the
 * audit trail, a compressible result, and a checkpoint (close writes one). */
static void write_store(void)
{
    idem_store *s;
    idem_queue *q;
    idem_options o;
    idem_options_init(&o);
    o.segment_bytes = 1u << 20;
    cr_assert_eq(idem_open(dir, &o, &s), IDEM_OK, "%s", idem_last_error());
    cr_assert_eq(idem_queue_open(s, 16, &q), IDEM_OK);
    char key[64], big[8192];
    memset(big, 'x', sizeof big - 1);
    big[sizeof big - 1] = 0;
    for (int i = 0; i < 200; i++) {
        snprintf(key, sizeof key, "order-%d", i);
        claim_commit(q, key, i == 7 ? big : "inv-1");
    }
    claim_commit(q, "pending-1", NULL);
    claim_commit(q, "held-1", NULL);
    idem_completion c;
    cr_assert_eq(idem_get(q, "held-1", 6, &c), IDEM_OK);
    cr_assert_eq(idem_hold(q, "held-1", 6, c.record.token, "timeout", 7), IDEM_OK);
    claim_commit(q, "held-2", NULL);
    cr_assert_eq(idem_get(q, "held-2", 6, &c), IDEM_OK);
    cr_assert_eq(idem_hold(q, "held-2", 6, c.record.token, "timeout", 7), IDEM_OK);
    idem_op op = {.kind = IDEM_OP_RESOLVE,
                  .key = "held-2",
                  .key_len = 6,
                  .data = "checked",
                  .data_len = 7,
                  .action = IDEM_RESOLVE_COMMIT,
                  .actor = "test"};
    cr_assert_eq(idem_exec(q, &op, &c), IDEM_OK);
    cr_assert_eq(c.err, IDEM_OK);
    cr_assert_eq(idem_del(q, "order-3", 7, "test"), IDEM_OK);
    idem_queue_close(q);
    cr_assert_eq(idem_close(s), IDEM_OK);
}

/* The first (first: 1) or last file whose name starts with prefix, in name order. */
static const char *file_named(const char *prefix, int first)
{
    static char name[2][256];
    struct dirent **list;
    int n = scandir(dir, &list, NULL, alphasort);
    name[first][0] = 0;
    for (int i = 0; i < n; i++) {
        if (strncmp(list[i]->d_name, prefix, strlen(prefix)) == 0 && (!first || !name[first][0]))
            snprintf(name[first], sizeof name[first], "%s", list[i]->d_name);
        free(list[i]);
    }
    free(list);
    cr_assert(name[first][0], "no file %s*", prefix);
    return name[first];
}

struct snap {
    char name[256];
    uint8_t *data;
    size_t len;
};

static size_t read_all(const char *path, uint8_t **out)
{
    FILE *f = fopen(path, "rb");
    cr_assert_not_null(f, "%s", path);
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    *out = malloc((size_t)n + 1);
    cr_assert_eq(fread(*out, 1, (size_t)n, f), (size_t)n);
    fclose(f);
    return (size_t)n;
}

/* Every regular file of the store, sorted by name. */
static size_t snapshot(struct snap *out, size_t max)
{
    struct dirent **list;
    int n = scandir(dir, &list, NULL, alphasort);
    cr_assert_geq(n, 0);
    size_t k = 0;
    for (int i = 0; i < n; i++) {
        char path[4096];
        struct stat st;
        snprintf(path, sizeof path, "%s/%s", dir, list[i]->d_name);
        if (stat(path, &st) == 0 && S_ISREG(st.st_mode) && k < max) {
            snprintf(out[k].name, sizeof out[k].name, "%s", list[i]->d_name);
            out[k].len = read_all(path, &out[k].data);
            k++;
        }
        free(list[i]);
    }
    free(list);
    return k;
}

static void flip_bit(const char *name, uint64_t off, int bit)
{
    char path[4096];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    FILE *f = fopen(path, "r+b");
    cr_assert_not_null(f, "%s", path);
    fseek(f, (long)off, SEEK_SET);
    int c = fgetc(f);
    cr_assert_neq(c, EOF, "%s offset %llu", name, (unsigned long long)off);
    fseek(f, (long)off, SEEK_SET);
    fputc(c ^ (1 << bit), f);
    fclose(f);
}

static idem_verify_report verify_ok(void)
{
    idem_verify_report r;
    cr_assert_eq(idem_verify(dir, &r, NULL, NULL), IDEM_OK, "%s", idem_last_error());
    return r;
}

/* Flips one bit, expects a fault naming the file, and flips it back. */
static void expect_found(const char *name, uint64_t off, int bit)
{
    flip_bit(name, off, bit);
    idem_verify_report r = verify_ok();
    cr_expect_gt(r.errors, 0, "bit %d at %s offset %llu not found", bit, name,
                 (unsigned long long)off);
    if (r.errors)
        cr_expect_not_null(strstr(r.first_error, name), "first error does not name %s: %s", name,
                           r.first_error);
    flip_bit(name, off, bit);
}

static void progress_count(void *ctx, uint64_t done, uint64_t total)
{
    cr_assert_leq(done, total);
    (*(int *)ctx)++;
}

Test(verify, sound_store_has_no_fault, .init = setup, .fini = teardown)
{
    write_store();
    int calls = 0;
    idem_verify_report r;
    cr_assert_eq(idem_verify(dir, &r, progress_count, &calls), IDEM_OK);
    cr_assert_eq(r.errors, 0, "%s", r.first_error);
    cr_assert_geq(r.segments, 1);
    cr_assert_geq(r.records, 203);
    cr_assert_eq(r.index_entries, 202, "index entries %llu", (unsigned long long)r.index_entries);
    cr_assert_eq(r.checkpoint_entries, 202);
    cr_assert_eq(r.audit_entries, 2);
    cr_assert_gt(calls, 0);
}

Test(verify, store_is_byte_identical_after_verify, .init = setup, .fini = teardown)
{
    write_store();
    static struct snap before[64], after[64];
    size_t nb = snapshot(before, 64);
    flip_bit("audit.log", 100, 3); /* a fault makes verify walk its reporting paths too */
    flip_bit("audit.log", 100, 3);
    verify_ok();
    size_t na = snapshot(after, 64);
    cr_assert_eq(nb, na);
    for (size_t i = 0; i < nb; i++) {
        cr_assert_str_eq(before[i].name, after[i].name);
        cr_assert_eq(before[i].len, after[i].len, "%s", before[i].name);
        cr_assert(memcmp(before[i].data, after[i].data, before[i].len) == 0, "%s changed",
                  before[i].name);
        free(before[i].data);
        free(after[i].data);
    }
}

Test(verify, flipped_bit_in_superblock_is_found, .init = setup, .fini = teardown)
{
    write_store();
    expect_found("super", 17, 0);        /* copy 0 */
    expect_found("super", 4096 + 50, 5); /* copy 1 */
    expect_found("super", 4090, 7);      /* a checksum */
    cr_assert_eq(verify_ok().errors, 0);
}

/* Sets the u64 at offset at of both superblock copies, with their checksums. */
static void super_set_u64(int at, uint64_t v)
{
    char path[4200];
    snprintf(path, sizeof path, "%s/super", dir);
    uint8_t *b;
    size_t n = read_all(path, &b);
    cr_assert_geq(n, 8192);
    for (int copy = 0; copy < 2; copy++) {
        uint8_t *p = b + 4096 * copy;
        memcpy(p + at, &v, 8);
        uint64_t sum = XXH3_64bits(p, 4088);
        memcpy(p + 4088, &sum, 8);
    }
    FILE *f = fopen(path, "r+b");
    cr_assert_not_null(f);
    cr_assert_eq(fwrite(b, 1, n, f), n);
    fclose(f);
    free(b);
}

/* A superblock whose checksum holds but whose store clock is past the clock's range (only a
 * writer's bug makes one): the open refuses it, and verify says so too (it passed it). */
Test(verify, a_superblock_field_out_of_range_is_found_as_the_open_finds_it, .init = setup,
     .fini = teardown)
{
    write_store();
    super_set_u64(104, UINT64_C(1) << 50); /* the store clock */
    idem_store *s;
    cr_assert_eq(idem_open(dir, NULL, &s), IDEM_ECORRUPT);
    idem_verify_report r = verify_ok();
    cr_assert_gt(r.errors, 0, "verify passed a superblock the open refuses");
    cr_assert(strstr(r.first_error, "out of range"), "%s", r.first_error);
}

/* Found by a review of verify: when one superblock copy fails its checksum, the open moves the
 * other's token reservation a block on (records may hold tokens the failed copy reserved), and
 * verify did not: besides the rotted copy it called every record with such a token corrupt. */
Test(verify, a_rotted_superblock_copy_moves_the_token_reservation_as_the_open_does, .init = setup,
     .fini = teardown)
{
    write_store();
    /* Both copies reserve tokens up to 100: half the records hold tokens above it. */
    super_set_u64(48, 100);
    cr_assert_gt(verify_ok().errors, 0, "records above the reservation passed");
    flip_bit("super", 4096 + 300, 2);
    idem_verify_report r = verify_ok();
    cr_assert_eq(r.errors, 1, "%llu faults, the first: %s", (unsigned long long)r.errors,
                 r.first_error);
    cr_assert(strstr(r.first_error, "checksum"), "%s", r.first_error);
    idem_store *s;
    cr_assert_eq(idem_open(dir, NULL, &s), IDEM_OK, "%s", idem_last_error());
    cr_assert_eq(idem_close(s), IDEM_OK);
}

/* Offset of the last nonzero byte of a file: the end of what the log holds. */
static uint64_t used_end(const char *name)
{
    char path[4096];
    uint8_t *d;
    snprintf(path, sizeof path, "%s/%s", dir, name);
    size_t n = read_all(path, &d);
    while (n > 0 && d[n - 1] == 0)
        n--;
    free(d);
    return n;
}

Test(verify, flipped_bit_in_a_segment_is_found, .init = setup, .fini = teardown)
{
    write_store();
    const char *seg = file_named("wal-", 1);
    uint64_t end = used_end(seg);
    cr_assert_gt(end, 8192);
    expect_found(seg, 20, 1);         /* header */
    expect_found(seg, 4096 + 3, 2);   /* checksum of the first frame */
    expect_found(seg, 4096 + 200, 4); /* payload of the first frame */
    expect_found(seg, end - 1, 0);    /* the last byte written */
    uint64_t seed = tu_seed("flipped_bit_in_a_segment_is_found");
    for (int i = 0; i < 24; i++) {
        uint64_t off = tu_rand(&seed) % end;
        expect_found(seg, off, (int)(tu_rand(&seed) % 8));
    }
    expect_found(file_named("wal-", 0), 40, 6); /* the spare segment's header */
    cr_assert_eq(verify_ok().errors, 0);
}

Test(verify, flipped_bit_in_the_checkpoint_is_found, .init = setup, .fini = teardown)
{
    write_store();
    const char *ck = file_named("index-", 0); /* the newest */
    char path[4096];
    struct stat st;
    snprintf(path, sizeof path, "%s/%s", dir, ck);
    cr_assert_eq(stat(path, &st), 0);
    expect_found(ck, 9, 0);               /* header */
    expect_found(ck, 4096 + 1, 3);        /* first entry */
    expect_found(ck, 4096 + 32 * 100, 7); /* an entry in the middle */
    uint64_t end = used_end(ck);
    expect_found(ck, end - 20, 1);                 /* the trailer */
    expect_found(ck, (uint64_t)st.st_size - 1, 0); /* zero padding after it */
    const char *older = file_named("index-", 1);
    if (strcmp(older, ck) != 0)
        expect_found(older, 4096 + 1, 3); /* kept for the older superblock copy */
    cr_assert_eq(verify_ok().errors, 0);
}

Test(verify, flipped_bit_in_the_audit_trail_is_found, .init = setup, .fini = teardown)
{
    write_store();
    expect_found("audit.log", 0, 0);              /* the group's checksum */
    expect_found("audit.log", 16, 1);             /* its entry count */
    expect_found("audit.log", 24 + 24, 2);        /* the entry's at_ms */
    expect_found("audit.log", 4096 + 24 + 70, 5); /* second group: its entry's text */
    expect_found("audit.log", 4096 + 4000, 1);    /* its padding */
    cr_assert_eq(verify_ok().errors, 0);
}

static uint32_t get_u32le(const uint8_t *p)
{
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

/* Sets the checksum at p, that of the len bytes from p + 8. */
static void reseal(uint8_t *p, uint32_t len)
{
    uint64_t sum = XXH3_64bits(p + 8, len);
    for (int i = 0; i < 8; i++)
        p[i] = (uint8_t)(sum >> (8 * i));
}

/* Rewrites the first audit entry (at offset 24 of the first group) with its key length one
 * longer, and the entry's and the group's checksums to match: the lengths no longer add up to
 * the entry's length, which no checksum can catch. */
static void audit_entry_with_inconsistent_lengths(void)
{
    char path[4096];
    snprintf(path, sizeof path, "%s/audit.log", dir);
    FILE *f = fopen(path, "r+b");
    cr_assert_not_null(f, "%s", path);
    uint8_t b[4096];
    cr_assert_eq(fread(b, 1, sizeof b, f), sizeof b);
    cr_assert_eq(get_u32le(b + 12), 0x47445541u, "the first unit is a group");
    b[24 + 42]++;                          /* key_len, u16 little-endian */
    reseal(b + 24, get_u32le(b + 24 + 8)); /* an entry's length leaves out its checksum */
    reseal(b, get_u32le(b + 8) - 8);       /* a group's includes it */
    fseek(f, 0, SEEK_SET);
    cr_assert_eq(fwrite(b, 1, sizeof b, f), sizeof b);
    fclose(f);
}

/* Regression: audit entries whose field lengths disagreed with their length were kept (the
 * checksum holds, so only the length check stops them). Open refuses the store and names the
 * file and the entry's offset; verify reports it. */
Test(verify, audit_entry_whose_lengths_disagree_is_corruption, .init = setup, .fini = teardown)
{
    write_store();
    audit_entry_with_inconsistent_lengths();
    idem_store *s;
    cr_assert_eq(idem_open(dir, NULL, &s), IDEM_ECORRUPT);
    cr_assert_not_null(strstr(idem_last_error(), "audit.log"), "%s", idem_last_error());
    cr_assert_not_null(strstr(idem_last_error(), "offset 0"), "%s", idem_last_error());
    idem_verify_report r = verify_ok();
    cr_assert_gt(r.errors, 0);
    cr_assert_not_null(strstr(r.first_error, "audit.log offset 0"), "%s", r.first_error);
}

/* Rewrites the u32 at off of audit.log. */
static void audit_put_u32(uint64_t off, uint32_t v)
{
    char path[4096];
    snprintf(path, sizeof path, "%s/audit.log", dir);
    FILE *f = fopen(path, "r+b");
    cr_assert_not_null(f, "%s", path);
    uint8_t b[4] = {(uint8_t)v, (uint8_t)(v >> 8), (uint8_t)(v >> 16), (uint8_t)(v >> 24)};
    fseek(f, (long)off, SEEK_SET);
    cr_assert_eq(fwrite(b, 1, 4, f), 4);
    fclose(f);
}

/* The first of the two groups (the resolve's) is damaged and the second (the delete's) is
 * sound: the damage is corruption, not a torn tail. The open fails naming it, the trail is
 * left as it was, and verify reports it. A group length no write produces (too short, far
 * beyond a group, just under the largest) is such damage too, and reading it overruns
 * nothing (the Asan build checks). */
Test(verify, a_damaged_audit_group_before_a_sound_one_is_corruption, .init = setup,
     .fini = teardown)
{
    write_store();
    char path[4096];
    snprintf(path, sizeof path, "%s/audit.log", dir);
    struct stat st;
    cr_assert_eq(stat(path, &st), 0);
    cr_assert_eq(st.st_size, 2 * 4096, "two groups: the resolve's, then the delete's");
    const uint32_t glens[] = {0, 7, 88, 274000, 274432 - 1, 0xffffffffu};
    for (size_t i = 0; i <= sizeof glens / sizeof glens[0]; i++) {
        uint8_t keep[4];
        FILE *f = fopen(path, "rb");
        cr_assert_eq(fseek(f, 8, SEEK_SET), 0);
        cr_assert_eq(fread(keep, 1, 4, f), 4);
        fclose(f);
        if (i < sizeof glens / sizeof glens[0])
            audit_put_u32(8, glens[i]);
        else
            flip_bit("audit.log", 24 + 70, 3); /* the entry's text */
        idem_store *s;
        cr_assert_eq(idem_open(dir, NULL, &s), IDEM_ECORRUPT, "case %zu", i);
        cr_assert_not_null(strstr(idem_last_error(), "audit.log"), "%s", idem_last_error());
        cr_assert_not_null(strstr(idem_last_error(), "damaged"), "%s", idem_last_error());
        cr_assert_eq(stat(path, &st), 0);
        cr_assert_eq(st.st_size, 2 * 4096, "case %zu: the trail was cut", i);
        idem_verify_report r = verify_ok();
        cr_assert_gt(r.errors, 0, "case %zu", i);
        cr_assert_not_null(strstr(r.first_error, "audit.log offset 0"), "%s", r.first_error);
        if (i < sizeof glens / sizeof glens[0])
            audit_put_u32(8, (uint32_t)keep[0] | (uint32_t)keep[1] << 8 | (uint32_t)keep[2] << 16 |
                                 (uint32_t)keep[3] << 24);
        else
            flip_bit("audit.log", 24 + 70, 3);
    }
    cr_assert_eq(verify_ok().errors, 0);
}

/* Damage to the last group after it was durable is not a torn write: the superblock records
 * how much of the trail was durable, so the open refuses the store instead of cutting the group
 * off (it used to), and verify reports it. A trail that is gone, or cut at a block boundary
 * (which no torn write leaves either), is refused the same way. */
Test(verify, a_durable_audit_group_damaged_or_lost_is_corruption, .init = setup, .fini = teardown)
{
    write_store();
    char path[4096];
    snprintf(path, sizeof path, "%s/audit.log", dir);
    struct stat st;
    cr_assert_eq(stat(path, &st), 0);
    cr_assert_eq(st.st_size, 2 * 4096);
    flip_bit("audit.log", 4096 + 24 + 70, 3);
    idem_store *s;
    cr_assert_eq(idem_open(dir, NULL, &s), IDEM_ECORRUPT, "the damaged group was cut off");
    cr_assert(strstr(idem_last_error(), "audit.log") && strstr(idem_last_error(), "were durable"),
              "%s", idem_last_error());
    cr_assert_eq(stat(path, &st), 0);
    cr_assert_eq(st.st_size, 2 * 4096, "the refused open cut the trail");
    idem_verify_report r = verify_ok();
    cr_assert_gt(r.errors, 0);
    flip_bit("audit.log", 4096 + 24 + 70, 3);
    cr_assert_eq(verify_ok().errors, 0);
    cr_assert_eq(truncate(path, 4096), 0);
    cr_assert_eq(idem_open(dir, NULL, &s), IDEM_ECORRUPT, "a trail cut at a block boundary");
    cr_assert_gt(verify_ok().errors, 0);
    cr_assert_eq(unlink(path), 0);
    cr_assert_eq(idem_open(dir, NULL, &s), IDEM_ECORRUPT, "a trail that is gone");
    r = verify_ok();
    cr_assert_gt(r.errors, 0);
    cr_assert(strstr(r.first_error, "audit.log is missing"), "%s", r.first_error);
    cr_assert(access(path, F_OK) != 0, "the refused open made a new trail");
}

/* A child imports three audit entries into a new store (one group of three blocks, its second
 * entry starting on the second block) and exits without a close. */
static void import_group_and_crash(void)
{
    pid_t pid = fork();
    cr_assert_geq(pid, 0);
    if (pid == 0) {
        idem_store *s;
        idem_queue *q;
        if (idem_open(dir, NULL, &s) != IDEM_OK || idem_queue_open(s, 4, &q) != IDEM_OK) _exit(2);
        claim_commit(q, "order-1", "inv");
        idem_audit_entry in[3];
        tu_audit_entries_across_blocks(in);
        if (idem_import_audit_n(q, in, 3) != IDEM_OK) _exit(3);
        _exit(0);
    }
    int st;
    cr_assert_eq(waitpid(pid, &st, 0), pid);
    cr_assert(WIFEXITED(st) && WEXITSTATUS(st) == 0, "writer status %d", st);
}

/* An entry inside a group that starts on a block boundary has the form of a one-entry unit of
 * earlier versions, and its checksum holds: past a torn group the open searched the blocks for
 * later units, took that entry for one naming a change in the log, and refused the store as
 * damaged (verify reported it so), where the group is only a torn tail: cut off. The torn group
 * here is a second import of the same entries, written after the first and torn by a power
 * loss: its third block damaged; its header's magic too; its first block lost (zeros, which
 * verify took for an empty block before the entry on the next one). */
Test(verify, a_torn_import_whose_entry_starts_a_block_is_a_torn_tail, .init = setup,
     .fini = teardown)
{
    for (int tear = 0; tear < 3; tear++) {
        import_group_and_crash();
        char path[4096];
        snprintf(path, sizeof path, "%s/audit.log", dir);
        uint8_t *group;
        cr_assert_eq(read_all(path, &group), 3 * 4096, "one group of three blocks");
        FILE *f = fopen(path, "ab");
        cr_assert_not_null(f);
        cr_assert_eq(fwrite(group, 1, 3 * 4096, f), 3 * 4096);
        cr_assert_eq(fclose(f), 0);
        free(group);
        flip_bit("audit.log", 3 * 4096 + 2 * 4096 + 20, 0);     /* the third entry's reason */
        if (tear == 1) flip_bit("audit.log", 3 * 4096 + 12, 0); /* the header's magic */
        if (tear == 2) {
            static const uint8_t zeros[4096];
            f = fopen(path, "r+b");
            cr_assert_not_null(f);
            cr_assert_eq(fseek(f, 3 * 4096, SEEK_SET), 0);
            cr_assert_eq(fwrite(zeros, 1, sizeof zeros, f), sizeof zeros);
            cr_assert_eq(fclose(f), 0);
        }
        idem_verify_report r = verify_ok();
        cr_assert_eq(r.errors, 0, "tear %d: %s", tear, r.first_error);
        idem_store *s;
        cr_assert_eq(idem_open(dir, NULL, &s), IDEM_OK, "tear %d: %s", tear, idem_last_error());
        idem_queue *q;
        cr_assert_eq(idem_queue_open(s, 4, &q), IDEM_OK);
        const idem_audit_entry *e;
        size_t n = 0;
        cr_assert_eq(idem_audit(q, NULL, 0, 10, &e, &n), IDEM_OK);
        cr_assert_eq(n, 3, "tear %d: %zu entries, not the first import's three", tear, n);
        idem_queue_close(q);
        cr_assert_eq(idem_close(s), IDEM_OK);
        struct stat st;
        cr_assert_eq(stat(path, &st), 0);
        cr_assert_eq(st.st_size, 3 * 4096, "tear %d: the torn group was not cut off", tear);
        cr_assert_eq(verify_ok().errors, 0);
        tu_rmtree(dir);
        dir = tu_mkdtemp("verify");
    }
}

/* libidem's mmap (the symbol "mmap": this file is built with _FILE_OFFSET_BITS=64, where the
 * name stands for mmap64), interposed for this binary: while guard_maps is set, every read-only
 * private map of a file (as verify makes) is placed right before a PROT_NONE page, so a read
 * past its end faults instead of reading whatever mapping the kernel put next. guarded counts
 * them. The guard page outlives the munmap of the map (a page a map, in the test's process
 * only). Other maps pass through. */
static int guard_maps, guarded;

void *test_mmap(void *addr, size_t len, int prot, int flags, int fd, off_t off) __asm__("mmap");
void *test_mmap(void *addr, size_t len, int prot, int flags, int fd, off_t off)
{
    static void *(*real)(void *, size_t, int, int, int, off_t);
    if (!real) *(void **)&real = dlsym(RTLD_NEXT, "mmap");
    if (!guard_maps || addr || prot != PROT_READ || flags != MAP_PRIVATE || fd < 0 || off != 0)
        return real(addr, len, prot, flags, fd, off);
    size_t page = (size_t)sysconf(_SC_PAGESIZE), span = (len + page - 1) / page * page;
    void *r = real(NULL, span + page, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (r == MAP_FAILED) return r;
    void *m = real(r, len, prot, flags | MAP_FIXED, fd, off);
    if (m == MAP_FAILED)
        munmap(r, span + page);
    else
        guarded++;
    return m;
}

/* The last segment file that holds frames, and where the log ends in it: the block after the
 * last nonzero byte (each batch ends its last block with zeros). */
static uint64_t log_end(char *name, size_t cap)
{
    struct dirent **list;
    int n = scandir(dir, &list, NULL, alphasort);
    uint64_t end = 0;
    name[0] = 0;
    for (int i = 0; i < n; i++) {
        uint64_t used;
        if (!strncmp(list[i]->d_name, "wal-", 4) && (used = used_end(list[i]->d_name)) > 4096) {
            snprintf(name, cap, "%s", list[i]->d_name);
            end = (used + 4095) / 4096 * 4096;
        }
        free(list[i]);
    }
    free(list);
    cr_assert(name[0], "no segment holds a frame");
    return end;
}

/* A valid frame that ends at the segment's last byte, with no SEGEND before it (no writer makes
 * one; damage or a crafted file can): the walk then stands at the segment's end, where verify
 * read a frame header's 32 bytes past the segment's map to tell "no frame" from "a damaged one"
 * (a crash where the next page is not mapped, else a read of another mapping). Here a PAD frame
 * of a later batch runs from the log's end to the segment's, and the segment's map is followed
 * by an inaccessible page: verify walks to the frame and stops there. */
Test(verify, a_frame_that_ends_at_the_segments_last_byte_is_read_in_bounds, .init = setup,
     .fini = teardown, .timeout = 30)
{
    write_store();
    idem_verify_report r0 = verify_ok();
    cr_assert_eq(r0.errors, 0, "%s", r0.first_error);
    char name[256], path[4096];
    uint64_t end = log_end(name, sizeof name);
    snprintf(path, sizeof path, "%s/%s", dir, name);
    uint8_t *seg;
    size_t size = read_all(path, &seg);
    cr_assert_eq(size, 1u << 20, "segment of %zu bytes", size);
    cr_assert_lt(end, size, "the log fills its segment");
    uint32_t len = (uint32_t)(size - end);
    uint8_t *f = seg + end;
    memset(f, 0, len);
    uint64_t lsn = 1ull << 40, batch = 1ull << 40; /* above the log's: not stale */
    memcpy(f + 8, &lsn, 8);
    memcpy(f + 16, &batch, 8);
    memcpy(f + 24, &len, 4);
    uint16_t type = 5; /* WAL_T_PAD */
    memcpy(f + 28, &type, 2);
    uint64_t salt, sum;
    memcpy(&salt, seg + 24, 8);
    sum = XXH3_64bits_withSeed(f + 8, len - 8, salt);
    memcpy(f, &sum, 8);
    FILE *out = fopen(path, "r+b");
    cr_assert_not_null(out);
    cr_assert_eq(fseek(out, (long)end, SEEK_SET), 0);
    cr_assert_eq(fwrite(f, 1, len, out), len);
    cr_assert_eq(fclose(out), 0);
    free(seg);
    guard_maps = 1;
    idem_verify_report r;
    int rc = idem_verify(dir, &r, NULL, NULL);
    guard_maps = 0;
    cr_assert_eq(rc, IDEM_OK, "%s", idem_last_error());
    cr_assert_gt(guarded, 1, "verify's maps were not guarded");
    cr_assert_eq(r.frames, r0.frames + 1, "the walk did not reach the frame (%s offset %llu)", name,
                 (unsigned long long)end);
}

Test(verify, store_in_use_is_refused, .init = setup, .fini = teardown)
{
    write_store();
    idem_store *s;
    cr_assert_eq(idem_open(dir, NULL, &s), IDEM_OK);
    idem_verify_report r;
    cr_assert_eq(idem_verify(dir, &r, NULL, NULL), IDEM_ELOCKED);
    cr_assert_not_null(strstr(idem_last_error(), "pid="), "%s", idem_last_error());
    cr_assert_eq(idem_close(s), IDEM_OK);
    cr_assert_eq(verify_ok().errors, 0);
}

Test(verify, directory_without_a_store_is_an_error, .init = setup, .fini = teardown)
{
    idem_verify_report r;
    cr_assert_eq(idem_verify(dir, &r, NULL, NULL), IDEM_ENOTFOUND);
    cr_assert_eq(idem_verify(NULL, &r, NULL, NULL), IDEM_EINVAL);
}

Test(verify, golden_store_of_format_1_is_sound, .init = setup, .fini = teardown)
{
    const char *src = getenv("IDEM_SOURCE_DIR");
    if (!src) cr_skip_test("IDEM_SOURCE_DIR is not set (run through ctest)");
    const char *files[] = {"audit.log", "index-0000000000000001.ckpt", "super",
                           "wal-0000000000000001.log", "wal-0000000000000002.log"};
    for (size_t i = 0; i < sizeof files / sizeof files[0]; i++) {
        char from[4096], to[4096];
        uint8_t *d;
        snprintf(from, sizeof from, "%s/tests/fixtures/golden-v1/%s", src, files[i]);
        snprintf(to, sizeof to, "%s/%s", dir, files[i]);
        size_t n = read_all(from, &d);
        FILE *f = fopen(to, "wb");
        cr_assert_not_null(f);
        cr_assert_eq(fwrite(d, 1, n, f), n);
        fclose(f);
        free(d);
    }
    idem_verify_report r = verify_ok();
    cr_assert_eq(r.errors, 0, "%s", r.first_error);
    cr_assert_gt(r.index_entries, 0);
}

/* A writer process makes `pairs` claim+commit pairs in a store with 1 MiB segments (two batches,
 * one block each, a pair: about 127 pairs a segment, so 150 reach segment 2, well before the
 * store would checkpoint on its own), waits for the spare segment 2, and exits without closing:
 * a crash, no checkpoint at close. */
static void write_pairs_and_crash(int pairs)
{
    pid_t pid = fork();
    cr_assert_geq(pid, 0);
    if (pid == 0) {
        idem_store *s;
        idem_queue *q;
        idem_options o;
        idem_options_init(&o);
        o.segment_bytes = 1u << 20;
        if (idem_open(dir, &o, &s) != IDEM_OK || idem_queue_open(s, 4, &q) != IDEM_OK) _exit(2);
        for (int i = 0; i < pairs; i++) {
            char key[32];
            idem_claim_args a = {.ttl_ms = 3600000, .lease_ms = 60000};
            idem_completion c;
            snprintf(key, sizeof key, "order-%d", i);
            if (idem_claim(q, key, strlen(key), &a, &c) != IDEM_OK || c.outcome != IDEM_NEW ||
                idem_commit(q, key, strlen(key), c.token, "inv", 3) != IDEM_OK)
                _exit(3);
        }
        char spare[4096];
        snprintf(spare, sizeof spare, "%s/wal-0000000000000002.log", dir);
        for (int i = 0; i < 1000 && access(spare, F_OK) != 0; i++)
            usleep(2000); /* the spare, made after the first flushes */
        _exit(0);
    }
    int st;
    cr_assert_eq(waitpid(pid, &st, 0), pid);
    cr_assert(WIFEXITED(st) && WEXITSTATUS(st) == 0, "writer status %d", st);
}

/* A store whose replay position is still in its first segment (no checkpoint since it was made,
 * after a crash; or closed with nothing written) loses that segment: the open refuses it ("log
 * segment 1 is missing"), and verify found nothing (its walk stopped at the missing segment,
 * at the replay position itself), so a restore took such a copy for sound. */
Test(verify, a_missing_replay_segment_is_found, .init = setup, .fini = teardown)
{
    for (int closed = 0; closed < 2; closed++) {
        if (closed) {
            idem_store *s;
            cr_assert_eq(idem_open(dir, NULL, &s), IDEM_OK, "%s", idem_last_error());
            cr_assert_eq(idem_close(s), IDEM_OK);
        } else {
            write_pairs_and_crash(5);
        }
        cr_assert_eq(verify_ok().errors, 0, "%s", verify_ok().first_error);
        char path[4096];
        snprintf(path, sizeof path, "%s/wal-0000000000000001.log", dir);
        cr_assert_eq(unlink(path), 0);
        idem_verify_report r = verify_ok();
        cr_assert_gt(r.errors, 0, "closed %d: the missing segment was not found", closed);
        cr_assert(strstr(r.first_error, "wal-0000000000000001.log is missing"), "%s",
                  r.first_error);
        idem_store *s;
        cr_assert_eq(idem_open(dir, NULL, &s), IDEM_ECORRUPT, "closed %d", closed);
        tu_rmtree(dir);
        dir = tu_mkdtemp("verify");
    }
}

/* The header of the segment the log was writing last rots after a crash (no clean close, so the
 * checkpoint's replay segment is the one before it). The SEGEND before it names its salt: verify
 * reads on, finds batches completed there, and reports the header, as recovery refuses the open.
 * Before, the walk stopped at the SEGEND and found nothing wrong. */
Test(verify, a_rotted_header_of_the_segment_written_last_is_found, .init = setup, .fini = teardown)
{
    write_pairs_and_crash(150);
    cr_assert_gt(used_end("wal-0000000000000002.log"), 2 * 4096, "the log did not reach segment 2");
    cr_assert_eq(verify_ok().errors, 0, "%s", verify_ok().first_error);
    flip_bit("wal-0000000000000002.log", 100, 0);
    idem_verify_report r = verify_ok();
    cr_assert_gt(r.errors, 0, "the rotted header was not found");
    cr_assert(strstr(r.first_error, "wal-0000000000000002.log") &&
                  strstr(r.first_error, "header is damaged"),
              "%s", r.first_error);
    idem_store *s;
    cr_assert_eq(idem_open(dir, NULL, &s), IDEM_ECORRUPT);
    flip_bit("wal-0000000000000002.log", 100, 0);
    cr_assert_eq(verify_ok().errors, 0);
}

/* An open of the store in a child that exits without closing: the open recovers the log and
 * writes its superblock, and nothing more. */
static void reopen_and_crash(void)
{
    pid_t pid = fork();
    cr_assert_geq(pid, 0);
    if (pid == 0) {
        idem_store *s;
        _exit(idem_open(dir, NULL, &s) == IDEM_OK ? 0 : 2);
    }
    int st;
    cr_assert_eq(waitpid(pid, &st, 0), pid);
    cr_assert(WIFEXITED(st) && WEXITSTATUS(st) == 0, "reopen status %d", st);
}

/* As recovery finds them (test_recovery, rotted_header_and_first_frames): the header of the
 * segment written last and its first frame rot together, and the batches after them lie past
 * the end of the log the SEGEND before them ends. Written by the open that wrote that SEGEND,
 * they are found past the end; recovered by an open since, the log ends before the durable mark
 * that open's superblock carries. Before, verify found nothing. */
Test(verify, a_rotted_header_and_first_frames_of_the_last_segment_are_found, .init = setup,
     .fini = teardown)
{
    for (int reopened = 0; reopened < 2; reopened++) {
        write_pairs_and_crash(150);
        if (reopened) reopen_and_crash();
        cr_assert_gt(used_end("wal-0000000000000002.log"), 3 * 4096,
                     "the log did not reach "
                     "segment 2");
        cr_assert_eq(verify_ok().errors, 0, "%s", verify_ok().first_error);
        flip_bit("wal-0000000000000002.log", 100, 0);
        flip_bit("wal-0000000000000002.log", 4096 + 12, 0);
        idem_verify_report r = verify_ok();
        cr_assert_gt(r.errors, 0, "the lost batches were not found (run %d)", reopened);
        const char *want = reopened ? "which the superblock recorded durable"
                                    : "in a segment whose header is damaged";
        cr_assert(strstr(r.first_error, want), "%s", r.first_error);
        idem_store *s;
        cr_assert_eq(idem_open(dir, NULL, &s), IDEM_ECORRUPT);
        tu_rmtree(dir);
        dir = tu_mkdtemp("verify");
    }
}

/* Found by a review: after a torn tail the next LSN starts above the torn batch's frames, and a
 * close with nothing appended records that LSN in its checkpoint, past the last complete batch
 * at the checkpoint's position. Recovery reads on from it; verify took it for a checkpoint that
 * disagrees with the log, so a healthy store failed verify (and a backup of it, restore). */
Test(verify, a_checkpoint_after_a_torn_tail_with_nothing_appended_is_sound, .init = setup,
     .fini = teardown)
{
    write_pairs_and_crash(150);
    uint64_t end = used_end("wal-0000000000000002.log");
    cr_assert_gt(end, 2 * 4096, "the log did not reach segment 2");
    /* The last batch's END (after its RECORD, at the block's start): the batch is torn, and
     * its RECORD's LSN is taken by no complete batch. */
    char path[4200];
    snprintf(path, sizeof path, "%s/wal-0000000000000002.log", dir);
    uint8_t *d;
    size_t n = read_all(path, &d);
    uint64_t block = (end - 1) / 4096 * 4096;
    cr_assert_lt(block + 32, n);
    uint32_t len;
    memcpy(&len, d + block + 24, 4);
    free(d);
    cr_assert(len >= 32 && len < 4096 - 32, "frame length %u", len);
    flip_bit("wal-0000000000000002.log", block + len + 12, 0);
    idem_store *s;
    cr_assert_eq(idem_open(dir, NULL, &s), IDEM_OK, "%s", idem_last_error());
    cr_assert_eq(idem_close(s), IDEM_OK);
    idem_verify_report r = verify_ok();
    cr_assert_eq(r.errors, 0, "%s", r.first_error);
    cr_assert_eq(idem_open(dir, NULL, &s), IDEM_OK, "%s", idem_last_error());
    cr_assert_eq(idem_close(s), IDEM_OK);
}

/* What the rule above must not let through (found by a review of it): a checkpoint LSN above
 * the log's at its position over complete batches, which recovery, reading on above that LSN,
 * drops. Only a torn batch, which never completes, may lie there. */
Test(verify, a_checkpoint_lsn_above_complete_batches_at_its_position_is_found, .init = setup,
     .fini = teardown)
{
    write_pairs_and_crash(20); /* no checkpoint yet: its position is the log's first block */
    cr_assert_eq(verify_ok().errors, 0, "%s", verify_ok().first_error);
    super_set_u64(88, 6); /* the checkpoint's LSN, over the first batches' */
    idem_verify_report r = verify_ok();
    cr_assert_gt(r.errors, 0, "verify passed a checkpoint LSN over complete batches");
    cr_assert(strstr(r.first_error, "complete batch at the checkpoint's position"), "%s",
              r.first_error);
}

/* The log's segment 2, cut shorter than a segment after the log reached it (no segment is ever
 * cut: the log rolls only into one made whole), is found, as recovery finds it; before the log
 * reached it (a spare whose making a crash cut short), it is not a fault. With the SEGEND of
 * segment 1 damaged too, so that the log ends before it, the later batches the cut segment still
 * holds are found past the end, read with its header's salt. */
Test(verify, a_segment_cut_after_the_log_reached_it_is_found, .init = setup, .fini = teardown)
{
    for (int run = 0; run < 3; run++) {
        int reached = run > 0, segend = run == 2;
        write_pairs_and_crash(reached ? 150 : 20);
        char path[4096];
        snprintf(path, sizeof path, "%s/wal-0000000000000002.log", dir);
        cr_assert_eq(access(path, F_OK), 0, "no segment 2");
        cr_assert_eq(used_end("wal-0000000000000002.log") > 2 * 4096, reached);
        cr_assert_eq(verify_ok().errors, 0, "%s", verify_ok().first_error);
        cr_assert_eq(truncate(path, (segend ? 16 : 3) * 4096), 0);
        idem_store *s;
        if (segend) {
            uint64_t end = used_end("wal-0000000000000001.log");
            flip_bit("wal-0000000000000001.log", (end - 1) / 4096 * 4096 + 12, 0);
            idem_verify_report r = verify_ok();
            cr_assert_gt(r.errors, 0, "the later batches were not found");
            cr_assert(strstr(r.first_error, "wal-0000000000000002.log") &&
                          strstr(r.first_error, "after the end of the log"),
                      "%s", r.first_error);
            cr_assert_eq(idem_open(dir, NULL, &s), IDEM_ECORRUPT);
            cr_assert(strstr(idem_last_error(), "after the log stops"), "%s", idem_last_error());
        } else if (reached) {
            idem_verify_report r = verify_ok();
            cr_assert_gt(r.errors, 0, "the cut segment was not found");
            cr_assert(strstr(r.first_error, "wal-0000000000000002.log") &&
                          strstr(r.first_error, "shorter than the segment size") &&
                          strstr(r.first_error, "SEGEND"),
                      "%s", r.first_error);
            cr_assert_eq(idem_open(dir, NULL, &s), IDEM_ECORRUPT);
        } else {
            idem_verify_report r = verify_ok();
            cr_assert_eq(r.errors, 0, "%s", r.first_error);
            cr_assert_eq(idem_open(dir, NULL, &s), IDEM_OK, "%s", idem_last_error());
            cr_assert_eq(idem_close(s), IDEM_OK);
        }
        tu_rmtree(dir);
        dir = tu_mkdtemp("verify");
    }
}
