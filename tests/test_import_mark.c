/*
 * test_import_mark.c: the import marker (src/import_mark.c) at open. A store that holds
 * IDEM_IMPORT_MARKER (an import into it was cut short) is refused by every open that may write,
 * with an error that names the file and what to do; a read-only open (an inspection) and an
 * import's own open (idem_options.importing) take it. The import that writes and removes the
 * marker is tested through idemctl (test_idemctl.c).
 */
#include <criterion/criterion.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include "idem.h"
#include "testutil.h"

/* A store in dir that holds the committed key "kept". */
static void store_with_a_key(const char *dir)
{
    idem_store *s;
    idem_queue *q;
    idem_completion c;
    idem_claim_args a = {.ttl_ms = 3600000, .lease_ms = 60000};
    cr_assert_eq(idem_open(dir, NULL, &s), IDEM_OK, "%s", idem_last_error());
    cr_assert_eq(idem_queue_open(s, 4, &q), IDEM_OK);
    cr_assert_eq(idem_claim(q, "kept", 4, &a, &c), IDEM_OK);
    cr_assert_eq(idem_commit(q, "kept", 4, c.token, "r", 1), IDEM_OK);
    idem_queue_close(q);
    cr_assert_eq(idem_close(s), IDEM_OK);
}

static void write_marker(const char *path, const char *text)
{
    FILE *f = fopen(path, "w");
    cr_assert_not_null(f);
    fputs(text, f);
    cr_assert_eq(fclose(f), 0);
}

/* Found by a review of import: an import into a store that existed (one idemd made at its first
 * start) writes in place and left no trace that it ran; killed part-way, it left a store with
 * part of the keys that idemd opened, and redeliveries of the keys not yet imported got `new`. */
Test(import_mark, a_store_that_holds_the_marker_is_refused_at_open_by_name)
{
    char *dir = tu_mkdtemp("marked");
    store_with_a_key(dir);
    char mark[4200];
    snprintf(mark, sizeof mark, "%s/%s", dir, IDEM_IMPORT_MARKER);
    write_marker(mark, "pid=4242 host=importer started_ms=1700000000000\n");

    idem_store *s;
    cr_assert_eq(idem_open(dir, NULL, &s), IDEM_ECORRUPT, "a store an import cut short opened");
    const char *e = idem_last_error();
    cr_assert(strstr(e, mark) && strstr(e, "cut short") && strstr(e, "--force") &&
                  strstr(e, "pid=4242 host=importer"),
              "%s", e);
    /* A marker the crash left empty marks all the same. */
    write_marker(mark, "");
    cr_assert_eq(idem_open(dir, NULL, &s), IDEM_ECORRUPT, "a store an import cut short opened");
    cr_assert(strstr(idem_last_error(), mark), "%s", idem_last_error());

    /* An inspection opens it (and says so on stderr), and finds what is there. */
    idem_options o;
    idem_options_init(&o);
    o.read_only = 1;
    cr_assert_eq(idem_open(dir, &o, &s), IDEM_OK, "%s", idem_last_error());
    idem_queue *q;
    idem_completion g;
    cr_assert_eq(idem_queue_open(s, 4, &q), IDEM_OK);
    cr_assert_eq(idem_get(q, "kept", 4, &g), IDEM_OK);
    cr_assert(g.found && g.record.state == IDEM_STATE_COMMITTED);
    idem_queue_close(q);
    cr_assert_eq(idem_close(s), IDEM_OK);

    /* An import's own open takes it, to finish; no open removes the marker. */
    idem_options_init(&o);
    o.importing = 1;
    cr_assert_eq(idem_open(dir, &o, &s), IDEM_OK, "%s", idem_last_error());
    cr_assert_eq(idem_close(s), IDEM_OK);
    cr_assert_eq(access(mark, F_OK), 0, "the marker went");
    cr_assert_eq(idem_open(dir, NULL, &s), IDEM_ECORRUPT, "a store an import cut short opened");

    cr_assert_eq(unlink(mark), 0);
    cr_assert_eq(idem_open(dir, NULL, &s), IDEM_OK, "%s", idem_last_error());
    cr_assert_eq(idem_close(s), IDEM_OK);
    tu_rmtree(dir);
}

/* A process that holds the store is named as its owner, not taken for an import cut short:
 * the marker of an import that runs is checked only by an open that got the lock. */
Test(import_mark, an_import_that_runs_is_reported_as_the_stores_owner)
{
    char *dir = tu_mkdtemp("marked-held");
    store_with_a_key(dir);
    idem_options o;
    idem_options_init(&o);
    o.importing = 1;
    idem_store *importer, *s;
    cr_assert_eq(idem_open(dir, &o, &importer), IDEM_OK, "%s", idem_last_error());
    char mark[4200];
    snprintf(mark, sizeof mark, "%s/%s", dir, IDEM_IMPORT_MARKER);
    write_marker(mark, "pid=1 host=h started_ms=1\n");
    cr_assert_eq(idem_open(dir, NULL, &s), IDEM_ELOCKED, "%s", idem_last_error());
    cr_assert_eq(idem_close(importer), IDEM_OK);
    cr_assert_eq(idem_open(dir, NULL, &s), IDEM_ECORRUPT, "a store an import cut short opened");
    tu_rmtree(dir);
}

/* Found by a review of import: the import removed its marker under the store's lock taken
 * alone, so an inspection running at that moment (idemctl status, which shares the lock) failed
 * the whole import at its last step and left the store refused. The marker now goes under the
 * lock shared; a process that holds the store to write still keeps it. */
Test(import_mark, the_marker_is_removed_while_an_inspection_runs_and_kept_while_a_writer_holds_it)
{
    char *dir = tu_mkdtemp("unmark");
    store_with_a_key(dir);
    cr_assert_eq(idem_import_mark(dir), IDEM_OK, "%s", idem_last_error());
    idem_options o;
    idem_options_init(&o);
    o.importing = 1;
    idem_store *s;
    cr_assert_eq(idem_open(dir, &o, &s), IDEM_OK, "%s", idem_last_error());
    cr_assert_eq(idem_import_unmark(dir), IDEM_ELOCKED, "the marker of an import that runs went");
    cr_assert_eq(idem_import_marked(dir), 1);
    cr_assert_eq(idem_close(s), IDEM_OK);

    o.read_only = 1;
    cr_assert_eq(idem_open(dir, &o, &s), IDEM_OK, "%s", idem_last_error());
    cr_assert_eq(idem_import_unmark(dir), IDEM_OK, "%s", idem_last_error());
    cr_assert_eq(idem_import_marked(dir), 0);
    cr_assert_eq(idem_close(s), IDEM_OK);
    cr_assert_eq(idem_open(dir, NULL, &s), IDEM_OK, "%s", idem_last_error());
    cr_assert_eq(idem_close(s), IDEM_OK);
    tu_rmtree(dir);
}

/* Found by a review of idemctl: the engine copied a marked store's files but not its marker, and
 * idemctl marked the copy once it was named; a crash between, or a mark refused for space (on
 * the disk a large copy had just filled), left a named copy that opened as a whole store, and
 * keys the import never reached answered `new`. A backup (of the store opened read-only) and a
 * restore (of that backup) now hold the marker as they are named, and refuse an open to write. */
Test(import_mark, a_copy_of_a_marked_store_is_marked_as_it_is_named)
{
    char *dir = tu_mkdtemp("marked-src");
    store_with_a_key(dir);
    cr_assert_eq(idem_import_mark(dir), IDEM_OK, "%s", idem_last_error());
    /* The marker names the import that was cut short; its copies name it too (they were
     * marked afresh, naming the backup's process as that import). */
    static const char line[] = "pid=1 host=the-import started_ms=5\n";
    char mark[4300], got[128];
    snprintf(mark, sizeof mark, "%s/%s", dir, IDEM_IMPORT_MARKER);
    FILE *f = fopen(mark, "w");
    cr_assert_not_null(f);
    fputs(line, f);
    fclose(f);
    char *scratch = tu_mkdtemp("marked-copies");
    char backup[4200], restored[4200];
    snprintf(backup, sizeof backup, "%s/b", scratch);
    snprintf(restored, sizeof restored, "%s/r", scratch);
    idem_options o;
    idem_options_init(&o);
    o.read_only = 1;
    idem_store *s;
    cr_assert_eq(idem_open(dir, &o, &s), IDEM_OK, "%s", idem_last_error());
    cr_assert_eq(idem_backup(s, backup), IDEM_OK, "%s", idem_last_error());
    cr_assert_eq(idem_close(s), IDEM_OK);
    cr_assert_eq(idem_import_marked(backup), 1, "the backup was named without the marker");
    cr_assert_eq(idem_restore(backup, restored), IDEM_OK, "%s", idem_last_error());
    cr_assert_eq(idem_import_marked(restored), 1, "the restored store was named without it");
    snprintf(mark, sizeof mark, "%s/%s", restored, IDEM_IMPORT_MARKER);
    f = fopen(mark, "r");
    cr_assert_not_null(f);
    size_t n = fread(got, 1, sizeof got - 1, f);
    got[n] = 0;
    fclose(f);
    cr_assert_str_eq(got, line, "the copy's marker names another import");
    cr_assert_eq(idem_open(restored, NULL, &s), IDEM_ECORRUPT,
                 "a copy of a store cut short opened");
    cr_assert(strstr(idem_last_error(), mark), "%s", idem_last_error());
    /* An unmarked store's copies hold none. */
    cr_assert_eq(idem_import_unmark(dir), IDEM_OK, "%s", idem_last_error());
    snprintf(backup, sizeof backup, "%s/b2", scratch);
    cr_assert_eq(idem_open(dir, NULL, &s), IDEM_OK, "%s", idem_last_error());
    cr_assert_eq(idem_backup(s, backup), IDEM_OK, "%s", idem_last_error());
    cr_assert_eq(idem_close(s), IDEM_OK);
    cr_assert_eq(idem_import_marked(backup), 0);
    tu_rmtree(scratch);
    tu_rmtree(dir);
}
