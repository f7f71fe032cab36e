/*
 * import_mark.h: the import marker, DIR/IMPORTING (IDEM_IMPORT_MARKER): a store an import
 * writes into in place holds it from before the import's first write until the import finished
 * and the store was closed, so a store that an import cut short is never taken for a whole one.
 * Format and rules in import_mark.c; the public calls (idem_import_mark, idem_import_unmark,
 * idem_import_marked) are in include/idem.h.
 */
#ifndef IDEM_IMPORT_MARK_H
#define IDEM_IMPORT_MARK_H

#include "idem.h"

/* The check of an open, made once the open holds the store's lock (so that an import still
 * running is reported as the owner, not as one cut short). With the marker present: a read-only
 * open goes on, and says so on stderr (event=import_unfinished); an open with o->importing goes
 * on (an import taking the store again); any other open is refused with IDEM_ECORRUPT, and
 * idem_last_error names the file, who began the import, and what to do. Returns 0, that, or
 * IDEM_EIO when the marker's presence cannot be told. Not called on the simulated disk of the
 * tests (which has no lock file either). */
int import_mark_check(const char *dir, const idem_options *o) __attribute__((warn_unused_result));

/* Marks dest, a store's copy made before it is named (backup, restore), as src is marked, with
 * its marker's content (naming the import that was cut short; empty when it cannot be read),
 * durable; src unmarked: nothing. Returns 0, or an error (set in idem_last_error). */
int import_mark_copy(const char *src, const char *dest) __attribute__((warn_unused_result));

#endif
