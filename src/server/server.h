/*
 * server.h: the shared state of idemd: its configuration, the server handle owned by the event
 * loop thread, and connections with their FIFO of outstanding replies.
 *
 * Ownership: one thread (the event loop, loop.c) owns everything here. The engine's changes go
 * through `q` (the asynchronous form: idem_submit / idem_poll); the loop calls the store
 * directly only for calls that wait on nothing (a key count, the clock, cancelling a WAIT). Nothing
 * is shared with other threads except the store handle, which is thread-safe, and what the
 * backup and reads threads are handed (backup.c, reads.c: each names what it shares and how).
 *
 * Reply order: every request takes the next sequence number of its connection and a slot in the
 * connection's ring. Replies leave in sequence order: a reply for the head slot is written to
 * `out` at once, any other waits in its slot's buffer until the slots before it are done. Slot
 * buffers count against the io budget (slot_bytes) and their replies against the client's output
 * (slot_ready) like `out`; once their replies have moved to `out`, a connection keeps at most
 * SRV_SLOT_KEEP bytes of them, and once nothing is outstanding only small ones (conn_shed_output,
 * at the next housekeeping), `out` too.
 */
#ifndef IDEM_SERVER_SERVER_H
#define IDEM_SERVER_SERVER_H

#include <stdint.h>
#include <stdio.h>
#include <sys/socket.h>
#include <pthread.h>
#include <sys/types.h>

#include "idem.h"
#include "resp.h"

#define SRV_USERS_MAX 64
/* An IDEM.GET reply's bytes besides its key, owner, note and result, at most. */
#define SRV_RECORD_FRAMING_MAX  1024
#define SRV_RECORD_REPLY_ROOM   8192u /* a record's reply past its result (srv_record_reply_max) */
#define SRV_NAME_MAX            64
#define SRV_CLIENT_NAME_MAX     256 /* a client name, its NUL included (Redis has no limit) */
#define SRV_PASSWORD_MAX        256
#define SRV_UNAUTH_ARG_MAX      16384u /* bytes of an argument before AUTH (when users are set) */
#define SRV_UNAUTH_ARGC_MAX     16u    /* arguments of a request before AUTH */
#define SRV_UNAUTH_REQUEST_MS   5000   /* a request begun before AUTH must end within this */
#define SRV_UNAUTH_MS           10000  /* with users, a connection must AUTH within this */
#define SRV_UNAUTH_OUT_MAX      16384u /* replies owed or unread before AUTH, past which it waits */
#define SRV_IDLE_TIMEOUT_MS_MAX (1ull << 53) /* far beyond any use, and no overflow in a sum */
#define SRV_IN_BUF_MAX          (2u * RESP_BULK_PROTO_MAX + 65536u) /* a whole request must fit */
#define SRV_READ_CHUNK          65536u
#define SRV_REQ_MAX             (SRV_IN_BUF_MAX - SRV_READ_CHUNK / 4) /* larger requests are refused */
#define SRV_STALL_MS            2000       /* over the io budget, a reader this slow is closed */
#define SRV_IO_BUDGET_MIN       (1u << 20) /* --io-budget at least (0 would switch it off) */
/* An admission (a large request read over the budget) that brought in this much during its
 * last SRV_STALL_MS goes on while others wait: its client sends as fast as the loop reads it
 * (a loop slowed by its load, or a sanitizer), where a trickle goes back in line. */
#define SRV_ADMIT_GOING_BYTES (1u << 20)
/* ... at most this many times over (an 8 MiB request at that rate is whole by then): a client
 * pipelining large requests at that rate does not keep one admission for good. */
#define SRV_ADMIT_KEEPS_MAX 8
#define SRV_HEAVY_BYTES     (256u * 1024) /* over the budget, readers owed this are held back */
/* Over the budget, a client with this much unparsed input (a request begun, or a pipeline it
 * cannot parse yet) needs an admission to be read on: at most twice this in each other
 * client's input buffer (16 KiB, doubled once), however many hold a partial request. */
#define SRV_IN_HEAVY_BYTES    16384u
#define SRV_IN_HELD_MAX       (256u * 1024) /* unparsed input kept for a held-back client */
#define SRV_OWED_TIGHT        (1u << 20)    /* replies a client may be owed under memory pressure */
#define SRV_SLOTS_KEEP        64     /* a slot ring this small is kept while idle, uncounted */
#define SRV_KEEPALIVE_S       300    /* TCP keepalive: idle seconds before the first probe */
#define SRV_REPLY_SMALL       512u   /* owed for a reply without a result (cmd_dispatch) */
#define SRV_REPLY_LONG        32768u /* owed for INFO, COMMAND, CONFIG, IDEM.STATS (cmd_dispatch) */
#define SRV_SHORT_DIV         4u     /* owed short of largest replies: --io-budget / this at most */
#define SRV_READS_DIV         8u     /* reads in line may be owed --io-budget / this */
#define SRV_STALL_BYTES       65536u /* unread replies that make a stalled client a slow reader */
#define SRV_SLOT_KEEP         16384u /* slot buffers kept once their replies left, while busy */
#define SRV_IDLE_BUF_MAX      1024u  /* an idle connection keeps reply buffers this small, */
#define SRV_IDLE_SLOT_BYTES   4096u  /* this many bytes of them in its slots (conn_shed_output) */
#define SRV_IDLE_SHED_MS      1000   /* idle (no request, no reply) this long: it sheds them */
#define SRV_TEST_CLOCK_MS_MAX IDEM_CLOCK_MS_MAX /* DEBUG CLOCK: as far as the store may go */
#define SRV_LAT_BUCKETS       16                /* latency histograms: util_latency_bucket */

#define SRV_METRICS_CONNS    16           /* scrape connections served at once */
#define SRV_METRICS_WAIT_MS  200          /* a scrape without a request is answered after this */
#define SRV_METRICS_MAX_MS   2000         /* a scrape connection open this long is closed */
#define SRV_METRICS_ASK_MAX  8192         /* a request head past this is answered unfinished */
#define SRV_TAG_METRICS_CONN (1ull << 40) /* epoll tag of scrape connection i: this + i */

/* A connection to the metrics endpoint (metrics.c). */
#define MCONN_WRITING  1 /* the reply is made: it is being written */
#define MCONN_DRAINING 2 /* reply out, write side shut: reading until the peer closes */
#define MCONN_READING  3 /* asked: the store's figures are being read (the stats line) */
typedef struct srv_metrics_conn {
    int fd;           /* -1: free */
    int answering;    /* 0: waiting for the request; MCONN_READING, _WRITING, _DRAINING */
    uint64_t id;      /* unique for idemd's life: a reading that comes back finds its own */
    int64_t since_ms; /* accepted then (srv_now_ms) */
    size_t off;       /* bytes of out written */
    uint32_t tail;    /* the request's last four bytes, to see its blank line */
    uint32_t asked;   /* request bytes read so far (capped) */
    resp_buf out;
} srv_metrics_conn;

/* Why a connection is not read (srv_conn.paused). */
enum srv_pause {
    PAUSE_NONE = 0,
    PAUSE_OUTPUT = 1, /* over the budget, it holds SRV_HEAVY_BYTES of replies it has not read */
    PAUSE_INPUT = 2,  /* over the budget, its large request waits for an admission (FIFO) */
};

enum srv_role { ROLE_NONE = 0, ROLE_WORKER = 1, ROLE_READER = 2, ROLE_ADMIN = 4 };

typedef struct srv_user {
    char name[SRV_NAME_MAX];
    char password[SRV_PASSWORD_MAX];
    int role;
} srv_user;

typedef struct srv_config {
    char dir[1024];
    char socket_path[1024]; /* empty: no unix socket */
    int socket_path_set;
    unsigned socket_mode;
    char bind_addr[64];
    int port;
    int durability;   /* enum idem_durability */
    int lease_policy; /* enum idem_lease_policy */
    uint64_t max_keys, max_memory_bytes, max_disk_bytes;
    uint32_t result_bytes_max;
    int test_clock;
    char metrics_listen[128];
    uint32_t max_clients;
    uint32_t pipeline_max;      /* outstanding requests per connection */
    uint64_t client_output_max; /* bytes of replies a client may leave unread */
    uint64_t io_budget_bytes;   /* input and output buffers of all connections together */
    uint64_t idle_timeout_ms;   /* 0: never; at most SRV_IDLE_TIMEOUT_MS_MAX */
    uint32_t queue_depth;
    srv_user users[SRV_USERS_MAX];
    int nusers;
} srv_config;

enum slot_state { SLOT_FREE = 0, SLOT_PENDING = 1, SLOT_READY = 2 };

/* How a completion becomes a reply (commands.c). */
enum reply_kind {
    RK_CLAIM = 1,
    RK_OWNER,  /* commit, release, hold, extend, resolve: +OK or an error */
    RK_RECORD, /* IDEM.GET */
    RK_GET,    /* GET */
    RK_EXISTS, /* EXISTS (several keys add up) */
    RK_PTTL,
    RK_TTL,
    RK_SET,     /* SET NX */
    RK_SET_GET, /* SET NX GET */
    RK_DEL,     /* DEL (several keys add up; the first error wins) */
    RK_RESOLVE, /* IDEM.RESOLVE: as RK_OWNER, and its outcome logged */
    RK_COUNT,   /* DBSIZE in sync mode: acc, read at parse, answered once a sync op completes */
};

typedef struct srv_slot {
    uint8_t state;
    uint8_t kind;
    uint8_t is_wait;
    uint8_t wait_cancelled; /* its parked claim was cancelled (cancel_waits: once) */
    uint16_t wait_key_len;
    uint8_t *wait_key;     /* a WAIT claim without OWNER: its key, to release a `new` nobody hears
                              (complete_one), then kept by that release until it completes */
    int64_t unheard_token; /* the token that release names */
    uint32_t remaining;    /* engine completions still due (EXISTS, DEL with several keys) */
    uint8_t queue_refused; /* an op of it the engine refused (queue full): answered busy once
                              those it took complete, their completions pointing into it */
    int64_t acc;           /* EXISTS: keys found so far; DEL: keys deleted so far */
    int err;               /* DEL: the first error other than not found; EXISTS: the first error */
    uint32_t keys_done;    /* DEL: completions so far (they come in the keys' order) */
    uint32_t refused;      /* DEL: the key (from 1) named in a refusal, 0: none yet */
    int refused_state;     /* its state, when the engine said (0: not known) */
    uint32_t owed;         /* reply bytes reserved for it against the budget until it is made */
    uint32_t short_by;     /* what owed falls short of the largest reply its command can make */
    uint8_t timed;         /* a claim whose latency is measured (not one that waits) */
    int64_t parsed_us;     /* timed: the loop's clock when it was parsed */
    resp_buf buf;          /* the reply, when it cannot go to `out` yet */
    size_t buf_counted;    /* buf.cap as counted in the connection's slot_bytes */
} srv_slot;

typedef struct srv_read srv_read; /* below */

typedef struct srv_conn {
    uint64_t id;
    uint32_t index; /* in srv.conns */
    int fd;         /* -1 once closed (the struct lives on while engine ops are due) */
    int is_unix;
    int role; /* enum srv_role; ROLE_NONE until AUTH when users are configured */
    char user[SRV_NAME_MAX];
    char name[SRV_CLIENT_NAME_MAX];
    char peer[64];
    char actor[IDEM_ACTOR_BYTES_MAX + 1]; /* who acts, for the audit trail: user(name)@peer */
    resp_parser parser;
    uint8_t *in;
    size_t in_len, in_start, in_cap;
    resp_buf out;
    srv_slot *slots; /* ring, slot_cap entries (a power of two) */
    uint32_t slot_cap;
    uint32_t head_seq, tail_seq; /* outstanding requests: [head_seq, tail_seq) */
    uint32_t engine_due;         /* completions the engine still owes this connection */
    int close_after_write;       /* QUIT or a protocol error: close once out is written */
    size_t out_whole;            /* out's bytes up to the end of its last whole reply */
    int out_cut;                 /* a reply found no memory: the whole replies before it are
                                    written, none after it, then the connection is closed */
    int peer_eof;                /* its end was seen (EPOLLRDHUP): WAIT claims answer at once */
    int in_ended;                /* read gave 0: what the buffer holds whole runs, then close */
    int hung_up;                 /* gone both ways (EPOLLHUP): out of epoll, read as parsed on,
                                    replies dropped; closed once what it sent is answered */
    int dead;                    /* closed; freed when engine_due reaches 0 */
    int paused;                  /* reading stopped by the global budget (enum srv_pause) */
    int big_admitted;            /* may read a large request although over the budget */
    int64_t big_admitted_ms;     /* since when (or since it was last kept on: loop.c) */
    uint64_t big_admitted_read;  /* in_read then */
    uint32_t big_admit_keeps;    /* times the admission went on (SRV_ADMIT_KEEPS_MAX) */
    uint64_t in_read;            /* bytes read from the socket, in all */
    uint64_t big_ticket;         /* PAUSE_INPUT: its place in the queue for an admission */
    size_t big_back_bytes;       /* its input, while it holds over 32 KiB unread on (loop.c) */
    int64_t big_back_since_ms;   /* since when it holds a large request in part (loop.c) */
    int64_t big_request_ms;      /* when a large request of it was last parsed whole */
    int64_t read_slow_ms;        /* when its parse last waited for replies it left unread */
    int deferred;                /* unparsed input waits for pipeline room */
    int in_no_room;              /* deferred, its input buffer full and without memory to grow:
                                    not read until it is parsed on */
    int in_held;                 /* on srv.held */
    int in_dirty;                /* on the list of connections to write (loop.c) */
    int read_due;                /* a read is under way on the reads thread, or parked (reads.c):
                                    nothing after it is parsed until it is answered */
    srv_read *read_parked;       /* its read, while the replies before it leave its reply no
                                    room within --client-output-max (reads.c) */
    int64_t partial_since_ms;    /* a request is begun but not whole since then (0: none) */
    uint32_t waits_due;          /* its claims with WAIT the engine has not answered: nothing
                                    after one is parsed until it is (a claim behind it could
                                    be granted a lease that runs out before its reply) */
    uint64_t io_bytes;           /* accounted against the global budget */
    int64_t out_progress_ms;     /* last write progress, or when the backlog began; 0: none */
    int64_t last_reply_ms;       /* last write progress (loop.c big_back_clock) */
    int64_t outq_ms;             /* when outq_bytes was looked at (conn_stalled) */
    int outq_bytes;              /* the kernel's unacknowledged bytes then; -1: unknown */
    uint64_t owed;               /* reply bytes reserved for its requests not yet answered */
    uint64_t short_by;           /* what those fall short of their largest replies (srv.short_by) */
    size_t reply_est;            /* the size of its large recent replies (decays slowly) */
    uint64_t slot_bytes;         /* capacity of its slot buffers (in io_bytes) */
    uint64_t slot_ready;         /* bytes of replies made that wait in slots for those before */
    int64_t last_active_ms;
    int64_t accepted_ms; /* when it connected (srv_now_ms) */
    uint32_t epoll_events;
} srv_conn;

/* The slot of c's request seq. */
static inline srv_slot *srv_slot_of(srv_conn *c, uint32_t seq)
{
    return &c->slots[seq & (c->slot_cap - 1)];
}

/* What IDEM.SCAN, IDEM.AUDIT and IDEM.ATTENTION read (cmd_admin.c parses it, srv_read_run
 * makes the read), and the store's figures that IDEM.STATS, INFO and a metrics scrape report
 * (READ_STATS: idem_get_stats on a line of its own, the reply made on the loop). */
enum srv_read_kind { READ_SCAN = 1, READ_AUDIT = 2, READ_ATTENTION = 3, READ_STATS = 4 };
typedef struct srv_read_args {
    int kind;
    int info_sections;       /* READ_STATS: INFO's sections; 0, IDEM.STATS's reply */
    idem_scan_args scan;     /* READ_SCAN */
    idem_attention_args att; /* READ_ATTENTION */
    uint8_t key[IDEM_KEY_BYTES_MAX];
    uint32_t key_len;      /* READ_AUDIT: 0, every key */
    uint32_t count;        /* READ_AUDIT */
    uint64_t output_max;   /* READ_ATTENTION: --client-output-max (cmd_reply_fits) */
    uint8_t with_cut;      /* READ_ATTENTION: WITHCUT, the reply says whether it was cut */
    uint8_t count_lowered; /* READ_ATTENTION: att.max lowered below COUNT for the reply's room */
    uint64_t before_seq;   /* READ_AUDIT: entries older than this seq (0: from the newest) */
} srv_read_args;

/* A read handed to the reads thread (reads.c). */
typedef struct srv_read {
    struct srv_read *next;
    uint32_t conn, seq; /* the request: connection index and sequence */
    srv_read_args a;
    uint64_t want;  /* the largest reply it can make (read_reply_max) */
    uint64_t room;  /* what its reply may hold, counted in srv.reads_owed until it is back */
    resp_buf reply; /* made by the thread (READ_STATS: by the loop, from engine) */
    /* A metrics scrape's read: its connection's id (conn is its index in srv.mconns); 0 for a
     * client's. It holds no reply room and no engine_due, and is not in reads_out. */
    uint64_t metrics_id;
    idem_stats engine; /* READ_STATS: the store's figures, read on the stats line */
    int unsure;        /* READ_STATS in sync mode: the changes they count could not be made
                          durable (the store failed; engine.fatal is set) */
} srv_read;

/* The reads' lines, a thread each: the queries (scans, the attention list, the audit trail),
 * and the store's figures, which a slow query must not hold up. */
enum { READS_QUERIES = 0, READS_STATS = 1, READS_LINES = 2 };

#define SRV_READS_KEEP 64 /* reads that came back kept for reuse (reads.c) */

#define SRV_LOG_BURST 10 /* lines a second through one log gate */
typedef struct srv_log_gate {
    int64_t second; /* monotonic */
    uint32_t lines; /* let through in that second */
    uint64_t suppressed;
} srv_log_gate;

typedef struct srv {
    srv_config cfg;
    idem_store *store;
    idem_queue *q;
    int epfd, unix_fd, tcp_fd, metrics_fd, sig_fd, load_fd;
    srv_metrics_conn mconns[SRV_METRICS_CONNS];
    int64_t metrics_wait_ms, metrics_max_ms; /* SRV_METRICS_WAIT_MS and _MAX_MS (metrics_init) */
    int loading;
    int draining;
    int fatal;
    int64_t drain_started_ms;
    int64_t drain_answer_ms;     /* DRAIN_ANSWER_MS; tests: IDEM_TEST_DRAIN_ANSWER_MS */
    const char *test_refuse_key; /* tests (IDEM_TEST_SUBMIT_REFUSE=KEY under --test-clock): the
                                    engine's queue refuses the first op of KEY and those after
                                    it in its batch */
    srv_conn **conns;
    uint32_t *conns_free; /* the free places in conns, a stack (the lowest on top at start) */
    uint32_t nconns_free;
    uint32_t conns_cap, nconns, nlive;
    uint64_t next_id;
    uint64_t io_used;
    uint64_t owed_total; /* reply bytes reserved for requests not yet answered, all clients */
    uint64_t short_by;   /* what those fall short of their largest replies: --io-budget /
                            SRV_SHORT_DIV at most */
    uint64_t reads_owed; /* reply bytes the reads handed to the reads thread may make */
    uint32_t engine_due; /* all connections */
    int queue_signalled; /* the engine queue's eventfd was readable this turn: poll drains it */
    uint32_t wait_due;   /* of which claims parked with WAIT */
    idem_op *ops;        /* this turn's batch */
    uint32_t nops;
    idem_completion *comps;
    srv_conn **dirty;
    uint32_t ndirty;
    srv_conn **held; /* connections held back by the full engine queue, to retry at once */
    uint32_t nheld;
    /* Large requests over the budget (loop.c): admitted, waiting, the last ticket handed out. */
    uint32_t big_admitted, big_waiting;
    uint64_t big_tickets;
    uint64_t
        big_back_bytes; /* held by clients with large input not read on (conn.big_back_bytes) */
    int64_t started_ms;
    int64_t now_us; /* the loop's clock (monotonic), read when a turn begins and before replies */
    /* IDEM.CLAIM latency, parsed to reply made (WAIT left out), in SRV_LAT_BUCKETS buckets. */
    uint64_t claim_latency_us_buckets[SRV_LAT_BUCKETS];
    uint64_t claim_latency_us_sum, claim_latencies;
    uint64_t total_connections, total_commands, rejected_connections;
    uint64_t closed_input_stalled, closed_output_stalled; /* closes by the io budget's rules */
    uint32_t result_seen_max; /* the longest result a reply carried (cmd_complete) */
    /* Out of file descriptors, a connection is taken on this one (/dev/null until then), answered
     * and closed, so that the listener does not stay readable (srv_accept). Listeners stop
     * being watched until accept_paused_until_ms after any other accept error. */
    int spare_fd;
    int64_t accept_paused_until_ms;
    srv_log_gate log_accept, log_protocol, log_auth, log_auth_ok, log_full;
    srv_log_gate log_connect, log_disconnect, log_half_close, log_budget_pause, log_oom;
    srv_log_gate log_unheard, log_metrics_refused;
    uint64_t claims_released_unheard; /* WAIT claims' `new` released: nobody heard it */
    uint64_t auth_failures;           /* AUTH (or HELLO's) refused for a name or password */
    uint64_t metrics_refused; /* scrapes closed unanswered: no slot, or one taken before it asked */
    struct srv_unheard {
        uint32_t conn, seq;
    } * unheard; /* releases due once the round's completions are read (submit_unheard) */
    uint32_t nunheard;
    pthread_t load_thread;
    int load_started;
    int load_err;
    idem_store *loaded; /* the load thread's store, written before it signals load_fd */
    srv_conn **dead;
    uint32_t ndead;
    /* IDEM.BACKUP copies on a thread of its own (backup.c), one at a time; backup_fd (an
     * eventfd in the loop's epoll set) says it is done. The request it answers is held open
     * like one the engine owes a completion (engine_due), so its connection lives on. */
    int backup_fd;
    int backup_running;
    pthread_t backup_thread;
    uint32_t backup_conn, backup_seq; /* connection index and request */
    int backup_err;
    char backup_dest[4096];
    char backup_msg[512];
    /* Reads (IDEM.SCAN, IDEM.AUDIT, IDEM.ATTENTION with q_reads; the store's figures) are made
     * off the loop (reads.c), on two lines of a thread each, each in arrival order; reads_fd (an
     * eventfd in the loop's epoll set) says some are done. Their requests are held open like
     * engine completions (engine_due). */
    idem_queue *q_reads;
    idem_queue *q_stats; /* the figures' line: its IDEM_OP_SYNC (reads.c, stats_read) */
    int reads_fd;
    int reads_mu_made; /* reads_mu is made (srv_reads_start) */
    int reads_started; /* lines whose thread runs: the first ones */
    pthread_t reads_thread[READS_LINES];
    pthread_mutex_t reads_mu;
    pthread_cond_t reads_cond[READS_LINES];
    srv_read *reads_todo[READS_LINES], *reads_todo_tail[READS_LINES]; /* reads_mu */
    srv_read *reads_done;                                             /* reads_mu */
    int reads_stop;                                                   /* reads_mu */
    srv_read *reads_free;                                             /* the loop's */
    uint32_t reads_kept;                                              /* on reads_free */
    uint32_t reads_out;       /* handed to the thread, not back */
    uint64_t reads_withdrawn; /* reads not made because their client left (IDEM.STATS) */
    uint32_t reads_delay_ms;  /* tests (--test-clock): each query waits this long first */
    uint32_t stats_delay_ms;  /* tests (--test-clock): each reading of the figures, as much */
    uint64_t mconn_ids;       /* the last metrics connection's id */
    int64_t unauth_ms;        /* SRV_UNAUTH_MS, or IDEM_TEST_AUTH_WITHIN_MS under --test-clock */
} srv;

/* ---- main.c ---- */
/* The settings' names of a durability mode and a lease-expiry policy, as the flags take them. */
const char *srv_durability_name(int durability);
const char *srv_lease_policy_name(int policy);

/* ---- addr.c ---- */
/* An IPv4 or IPv6 address (brackets allowed; not link-local) and a port as a socket address.
 * Returns 0 or -1. */
int srv_addr_parse(const char *addr, int port, struct sockaddr_storage *ss, socklen_t *len)
    __attribute__((warn_unused_result));
/* A port in decimal digits alone, min..65535. Returns 0 or -1. */
int srv_addr_port(const char *v, int min, int *port) __attribute__((warn_unused_result));
/* ADDR:PORT (IPv6 in brackets, port 1..65535) split into host (brackets kept) and port. Returns
 * 0, or -1 when either part is not valid. */
int srv_addr_split(const char *v, char *host, size_t cap, int *port)
    __attribute__((warn_unused_result));
/* A TCP address as `1.2.3.4:5` or `[::1]:5` (an IPv4-mapped one as IPv4; any other family:
 * `unix`). */
void srv_addr_format(const struct sockaddr *sa, char *out, size_t cap);

/* ---- loop.c ---- */
int srv_run(srv *s);
int64_t srv_now_ms(void); /* monotonic, for timers */
/* Tests (with --test-clock only): the ms an environment variable names (at most a minute), or
 * dflt without it. */
int64_t srv_test_ms(const srv *s, const char *name, int64_t dflt);
/* accept4 on a listener that does not spin the loop when it fails (loop.c): the new fd, or -1
 * when there is none to take now. */
int srv_accept(srv *s, int lfd, struct sockaddr *sa, socklen_t *sl);
/* The buffer the reply of request `seq` goes to (out when it is the head, else its slot). */
resp_buf *srv_reply_buf(srv_conn *c, uint32_t seq);
/* The request `seq` is answered (its reply is complete): release its slot in order. */
void srv_reply_done(srv *s, srv_conn *c, uint32_t seq);
/* Reserves the reply of the new request seq against the budget (cmd_dispatch, before anything
 * answers it): `full`, the largest its command can make, or the client's recent reply estimate
 * while what all requests are owed short of their largest stays within --io-budget /
 * SRV_SHORT_DIV. */
void srv_reply_reserve(srv *s, srv_conn *c, uint32_t seq, uint32_t full);
/* Makes what request seq is owed `bytes` (a read, once its bound is known). */
void srv_reply_owe(srv *s, srv_conn *c, uint32_t seq, uint64_t bytes);
/* Room for a reply of up to `want` bytes: want, or less under memory pressure (what is left of
 * the budget, at least SRV_OWED_TIGHT), at most --client-output-max. */
uint64_t srv_reply_room(const srv *s, uint64_t want);
/* What c's replies other than request seq's, unread or owed at their largest, leave of
 * --client-output-max. */
uint64_t srv_out_room(const srv *s, srv_conn *c, uint32_t seq);
/* Queues an engine op for request `seq`, whose completion is formatted as `kind` (enum
 * reply_kind). The op's user_data is set here; its pointers must stay valid until the batch is
 * submitted (they point into the connection's input buffer). */
void srv_submit_op(srv *s, srv_conn *c, uint32_t seq, int kind, idem_op *op);
/* Submits the batch now: before what must see the requests before it (a read handed to the
 * reads thread, a backup, a blocking call), or before their buffers change. */
void srv_flush_ops(srv *s);

/* Whether request `seq` of c still waits for its reply. */
int srv_reply_pending(srv_conn *c, uint32_t seq);

/* ---- backup.c ---- */
/* Starts copying the store into dest for request `seq` of c; the reply comes when the copy is
 * done (srv_backup_done). Returns 0, or -1 with a message in err (one runs already). */
int srv_backup_start(srv *s, srv_conn *c, uint32_t seq, const char *dest, char *err,
                     size_t err_len);
/* The loop saw backup_fd readable: joins the thread and answers the request. */
void srv_backup_done(srv *s);
/* Waits for the copy's thread and logs its outcome (event=backup_done or backup_failed). */
void srv_backup_join(srv *s);

/* ---- reads.c ---- */
/* Starts the reads' threads, the queries' with its own queue (after the store is open).
 * Returns 0, or an errno value (idemd does not start without them). */
int srv_reads_start(srv *s);
/* Hands the read of request `seq` of c, whose reply can be up to `want` bytes, to the thread,
 * or parks it on c while the replies before it leave it too little room (srv_out_room): it is
 * handed over once c has read them (srv_reads_unpark). Returns 0, or -1 without memory for it. */
int srv_reads_submit(srv *s, srv_conn *c, uint32_t seq, const srv_read_args *a, uint64_t want);
/* c wrote replies: its parked read is handed over if its reply has room now (while idemd
 * drains, it is answered with an error instead). */
void srv_reads_unpark(srv *s, srv_conn *c);
/* What a read handed to the reads thread may still be owed: reads waiting in line together are
 * owed at most --io-budget / SRV_READS_DIV (each at least SRV_OWED_TIGHT). */
uint64_t srv_reads_room(const srv *s);
/* The loop saw reads_fd readable: answers the reads that are done. */
void srv_reads_done(srv *s);
/* Hands a reading of the store's figures for metrics connection `index` to the stats line;
 * metrics_answer gets it back. Returns 0, or -1 without memory for it. */
int srv_reads_submit_metrics(srv *s, uint32_t index);
/* Metrics connection `index` closes while its reading is out: withdrawn if not begun (one that
 * is being made comes back to metrics_answer, which drops it), so that the stats line holds a
 * reading a metrics connection at most. */
void srv_reads_cancel_metrics(srv *s, uint32_t index);
/* c is closing, or hung up: its read, if the thread has not begun it, is withdrawn (and counted
 * done). Returns 1 with *seq its request's sequence (the slot is left unanswered), else 0. */
int srv_reads_cancel(srv *s, srv_conn *c, uint32_t *seq);
/* Stops the thread (reads not made are dropped: their connections are closed) and frees all. */
void srv_reads_stop(srv *s);

/* ---- commands.c ---- */
/* Runs one parsed request. The reply is written now (srv_reply_buf + srv_reply_done) or later,
 * when the engine completes the ops it queued. */
void cmd_dispatch(srv *s, srv_conn *c, uint32_t seq, uint32_t argc, const uint8_t *const *argv,
                  const uint32_t *argl);
/* Formats the reply of one engine completion for request slot sl. Returns nonzero when the
 * request is answered. */
int cmd_complete(srv *s, srv_slot *sl, resp_buf *b, const idem_completion *cp);
/* Counts one key's completion into DEL's slot sl; logs the outcome at the last. */
void cmd_del_count(const srv_conn *c, srv_slot *sl, const idem_completion *cp);
/* The parser's field limits (resp_arg_max_fn); ctx is the srv. */
uint32_t cmd_arg_max(void *ctx, const uint8_t *const *argv, const uint32_t *argl, uint32_t index,
                     const char **field);
/* The same, capped at SRV_UNAUTH_ARG_MAX: a connection that must AUTH first cannot make idemd
 * buffer large requests (as Redis caps unauthenticated bulks). */
uint32_t cmd_arg_max_unauth(void *ctx, const uint8_t *const *argv, const uint32_t *argl,
                            uint32_t index, const char **field);
/* Sets up c's parser with the limits of its role (before AUTH: SRV_UNAUTH_*). */
void cmd_parser_limits(srv *s, srv_conn *c);
/* The error reply to a request c's parser refused (RESP_REFUSED): its message, or NOAUTH before
 * AUTH where cmd_dispatch would answer the request so. */
const char *cmd_refusal(const srv_conn *c);
/* Writes the reply of an error code (-STALE, -NOTFOUND, ...). */
void cmd_reply_err(resp_buf *b, int err);
/* Makes a read with the blocking calls of q (one thread at a time per queue) and writes its
 * reply into b (cmd_admin.c). */
void srv_read_run(idem_queue *q, const srv_read_args *a, resp_buf *b);
/* Writes the reply of IDEM.STATS or INFO (a READ_STATS read) from engine, the store's figures
 * read for it, and the server's own (cmd_admin.c; on the loop). */
void cmd_stats_reply(srv *s, const srv_read_args *a, const idem_stats *engine, resp_buf *b);

/* ---- auth.c ---- */
int auth_role_parse(const char *s);
const char *auth_role_name(int role);
/* Parses NAME:ROLE:PASSWORD into cfg->users. Returns 0 or -1 (message in err). */
int auth_user_add(srv_config *cfg, const char *spec, char *err, size_t err_len);
/* The next line of an operator's file (users or config) into line, its end of line off, and
 * *text at its first byte past blanks (and a UTF-8 byte order mark at the file's start): 1; 0
 * at the end of the file; -1 with err naming the line. Blank lines and comments (a '#' first on
 * a line, of any length) are skipped. Refused: a line longer than size - 2 bytes, a control
 * byte but a tab, blanks at the end, and a '#' after a blank (comments take a line of their own:
 * either would be part of a value, a password). */
int conf_line_next(FILE *f, const char *path, char *line, size_t size, int *lineno, char **text,
                   char *err, size_t err_len);
/* Loads a users file (must not be readable by group or others). Returns 0 or -1. */
int auth_users_file(srv_config *cfg, const char *path, char *err, size_t err_len);
/* Checks user/password (its time independent of both); returns the role or ROLE_NONE. */
int auth_check(const srv_config *cfg, const char *user, const uint8_t *pw, uint32_t pw_len);
/* The role of a new connection before any AUTH. */
int auth_initial_role(const srv_config *cfg, int is_unix);

/* ---- log.c ---- */
void srv_log(const char *level, const char *event, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
/* srv_log for events a client can cause at will: at most SRV_LOG_BURST lines a second through
 * one gate; the next line let through after some were left out carries suppressed=N. */
void srv_log_gated(srv_log_gate *g, const char *level, const char *event, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));

/* ---- metrics.c ---- */
/* The reading of the store's figures asked for metrics connection `index` came back: if that
 * connection still waits for it (its id), its reply is made from engine and written. */
void metrics_answer(srv *s, uint32_t index, uint64_t id, const idem_stats *engine);
/* The scrape timers: SRV_METRICS_WAIT_MS and SRV_METRICS_MAX_MS; tests only, with
 * --test-clock, IDEM_TEST_METRICS_WAIT_MS sets the first (the second follows it), so that
 * their bounds on how long a scrape or a PING may take need not sit close to 200 ms. */
void metrics_init(srv *s);
/* The metrics listener is readable: accepts scrape connections into the epoll set. */
void metrics_accept(srv *s);
/* Events of scrape connection `index` (tag SRV_TAG_METRICS_CONN + index). */
void metrics_event(srv *s, uint32_t index, uint32_t events);
/* Answers scrapes that sent no request in time, closes those open too long. */
void metrics_tick(srv *s, int64_t now_ms);
/* Closes every scrape connection (shutdown). */
void metrics_close_all(srv *s);

/* The largest IDEM.GET reply (cmd_idem.c): the largest result, a 4 KiB note, a 512-byte key and
 * owner, and the framing; --client-output-max may not be smaller. */
uint64_t srv_record_reply_max(const srv_config *cfg);
/* The same, or larger once a reply carried a result stored under a larger --result-max, up to
 * --client-output-max: what a reply that may carry a result is reserved at (cmd_idem.c). */
uint64_t srv_record_reply_now(const srv *s);
/* The largest reply the request at the head of in (n bytes) can make, by its command's name:
 * srv_record_reply_now for one that may carry a result or a message (PING without one is small),
 * or whose name is not all in yet, SRV_REPLY_LONG for those flagged long, SRV_REPLY_SMALL for the
 * others (commands.c). */
uint64_t srv_next_reply_max(const srv *s, const uint8_t *in, size_t n);

#endif /* IDEM_SERVER_SERVER_H */
