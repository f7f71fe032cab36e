/*
 * mkstore.c: creates an empty idem store with a chosen WAL segment size, for tests that need
 * small segments (idemd has no flag for it; a store keeps the segment size it was created with,
 * so idemd started on this directory uses it). Usage: mkstore DIR SEGMENT_BYTES
 * Built by CMake as idem-mkstore (with the build's flags: sanitizers included).
 */
#include <stdio.h>
#include <stdlib.h>

#include "idem.h"

int main(int argc, char **argv)
{
    if (argc != 3) {
        fprintf(stderr, "usage: mkstore DIR SEGMENT_BYTES\n");
        return 2;
    }
    idem_options o;
    idem_options_init(&o);
    o.segment_bytes = (uint32_t)strtoul(argv[2], NULL, 0);
    idem_store *s = NULL;
    int rc = idem_open(argv[1], &o, &s);
    if (rc != IDEM_OK) {
        fprintf(stderr, "mkstore: %s: %s\n", idem_strerror(rc), idem_last_error());
        return 1;
    }
    rc = idem_close(s);
    if (rc != IDEM_OK) {
        fprintf(stderr, "mkstore: close: %s\n", idem_strerror(rc));
        return 1;
    }
    return 0;
}
