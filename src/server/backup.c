/*
 * backup.c: IDEM.BACKUP without stopping the event loop. idem_backup holds the store back for
 * one flush and then copies for as long as the files take; run on the loop's thread it would
 * leave every client unanswered meanwhile. So it runs on a thread of its own, one backup at a
 * time, and the loop answers the request when the thread says it is done (backup_fd).
 *
 * Invariants: while backup_running, the request's connection has engine_due raised by one (it
 * is not freed, and a drain waits for it like for an engine completion); only the backup
 * thread writes backup_err and backup_msg, and the loop reads them after joining it.
 */
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include "server.h"

static void *backup_main(void *arg)
{
    srv *s = arg;
    s->backup_err = idem_backup(s->store, s->backup_dest);
    if (s->backup_err != IDEM_OK)
        snprintf(s->backup_msg, sizeof s->backup_msg, "%s", idem_last_error());
    uint64_t one = 1;
    ssize_t w = write(s->backup_fd, &one, sizeof one);
    (void)w;
    return NULL;
}

int srv_backup_start(srv *s, srv_conn *c, uint32_t seq, const char *dest, char *err, size_t err_len)
{
    if (s->backup_running) {
        snprintf(err, err_len, "ERR a backup is running already (into %s)", s->backup_dest);
        return -1;
    }
    snprintf(s->backup_dest, sizeof s->backup_dest, "%s", dest);
    s->backup_msg[0] = 0;
    s->backup_conn = c->index;
    s->backup_seq = seq;
    int rc = pthread_create(&s->backup_thread, NULL, backup_main, s);
    if (rc != 0) {
        snprintf(err, err_len, "ERR backup into %s failed: cannot start its thread: %s", dest,
                 strerror(rc));
        return -1;
    }
    s->backup_running = 1;
    c->engine_due++;
    s->engine_due++;
    return 0;
}

void srv_backup_join(srv *s)
{
    pthread_join(s->backup_thread, NULL);
    s->backup_running = 0;
    if (s->backup_err == IDEM_OK)
        srv_log("info", "backup_done", "dest=\"%s\"", s->backup_dest);
    else
        srv_log("error", "backup_failed", "dest=\"%s\" err=\"%s\" msg=\"%s\"", s->backup_dest,
                idem_strerror(s->backup_err), s->backup_msg);
}

void srv_backup_done(srv *s)
{
    uint64_t v;
    ssize_t r = read(s->backup_fd, &v, sizeof v);
    (void)r;
    if (!s->backup_running) return;
    srv_backup_join(s);
    srv_conn *c = s->conns[s->backup_conn];
    c->engine_due--;
    s->engine_due--;
    if (c->dead || !srv_reply_pending(c, s->backup_seq)) return;
    resp_buf *b = srv_reply_buf(c, s->backup_seq);
    if (s->backup_err == IDEM_OK) {
        resp_simple(b, "OK");
    } else {
        char line[sizeof s->backup_dest + sizeof s->backup_msg + 64];
        snprintf(line, sizeof line, "ERR backup into %s failed: %s (%s)", s->backup_dest,
                 idem_strerror(s->backup_err), s->backup_msg);
        resp_error(b, line);
    }
    srv_reply_done(s, c, s->backup_seq);
}
