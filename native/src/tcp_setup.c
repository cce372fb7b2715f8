/* The TCP transport's connections: the authenticated handshake with a peer (a state
 * machine per connection, all in one poll loop), at setup for the peers the algorithms
 * need and later on first use, and the abort notice (tcp_setup.h). The data path over the
 * connections is transport_tcp.c's, which puts these functions in its table: no file
 * above the transports names them. */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include "auth.h"
#include "tcp_setup.h"
#include "util.h"

/* ---- connection setup ----
 *
 * Every pair of ranks that exchanges anything shares one socket. At setup each rank
 * connects to the peers the algorithms need (comm.c's `eager` flags, the same relation on
 * both ends): the higher rank connects, the lower one accepts. Any other pair connects on
 * first use, from whichever end needs it first; when both dial at once, the lower rank's
 * connection wins (it drops the higher one's greeting, and the higher one gives up its
 * own dial when the lower one's greeting comes). Each connection proves, in both directions, that its ends know the job's secret (handed
 * out over MPI only; the job id, by contrast, is public: it names shared segments). The
 * secret itself never crosses the wire:
 *
 *   connector -> acceptor  HELLO      magic, job id, connector's rank, version,
 *                                     acceptor's rank, nonce_c
 *   acceptor -> connector  CHALLENGE  nonce_a, MAC("ringsync-accept", transcript)
 *   connector -> acceptor  PROOF      MAC("ringsync-connect", transcript)
 *   acceptor -> connector  WELCOME    one byte: the connection is registered
 *
 * transcript = version, job id, both ranks, nonce_c, nonce_a; MAC = HMAC-SHA256 keyed with
 * the secret; nonces are fresh random bytes. The connector checks the acceptor's MAC before
 * it answers, so a stray listener at a peer's address is never believed. The acceptor
 * registers a socket as a rank's only once its proof checks out; a recorded HELLO and PROOF
 * replayed later fail, since nonce_a is new each time. The two labels differ, so neither
 * MAC can be reflected back as the other.
 *
 * Both directions run in one poll loop: the peers we dial, and every incoming client at
 * once; after setup, inside the data path's poll (transport_tcp.c). A client's bytes are untrusted until its proof checks out: one that is silent,
 * slow, malformed or unauthenticated is dropped on its own short deadline and logged, and
 * never delays the real peers or gets blamed on a rank. */

#define HELLO_MAGIC 0x52494e4753594e43ULL /* "RINGSYNC" */
#define HELLO_VERSION 3u
#define NONCE_BYTES 16
#define HELLO_BYTES (8 + 8 + 8 + 4 + 4 + NONCE_BYTES)
#define CHALLENGE_BYTES (NONCE_BYTES + RS_SHA256_BYTES)
#define PROOF_BYTES RS_SHA256_BYTES
#define WELCOME_BYTES 1
#define WELCOME 'W'
#define MAX_MESSAGE_BYTES HELLO_BYTES /* the largest of the three */
#define ACCEPT_LABEL "ringsync-accept"
#define CONNECT_LABEL "ringsync-connect"
/* A real peer greets at once and answers within a round trip; a client gets this long. */
#define GREETING_SECONDS 5.0
#define MAX_GREETINGS RS_TCP_MAX_GREETINGS
/* Dropped clients logged per setup: a port scan must not flood stderr. */
#define MAX_DROP_LOGS 16
/* Redialling a peer that is not listening yet (or dropped us): first pause, longest. */
#define REDIAL_FIRST_SECONDS 0.02
#define REDIAL_MAX_SECONDS 0.5

typedef enum {
    DIALING, SEND_HELLO, RECV_CHALLENGE, SEND_PROOF, RECV_WELCOME, /* we connect */
    RECV_HELLO, SEND_CHALLENGE, RECV_PROOF, SEND_WELCOME /* a client connects to us */
} step_t;

/* One connection being set up, in either direction. */
typedef struct {
    int fd;   /* -1: a free incoming slot, or an outgoing one waiting to redial */
    int peer; /* the rank we dial, or the one an incoming client claims (-1 before) */
    step_t step;
    unsigned char msg[MAX_MESSAGE_BYTES]; /* the message this step sends or receives */
    size_t len, done;
    unsigned char nonce_c[NONCE_BYTES], nonce_a[NONCE_BYTES];
    double deadline; /* incoming: dropped then; outgoing without fd: redialled then */
    double since;    /* incoming: accepted at (the oldest goes first) */
    double backoff;  /* outgoing: the next pause before a redial */
    int last_errno;  /* outgoing: why the last attempt failed (0: closed by the peer) */
    int active;      /* outgoing: a dial wanted (fd -1: waiting to redial) */
    char from[INET6_ADDRSTRLEN + 8]; /* incoming: "address:port", for the log */
} shake_t;

/* The handshakes of one communicator, from setup to its release. */
struct rs_links {
    rs_comm_t *comm;
    char **hosts;     /* every rank's address, for dialling it */
    int *ports;
    double deadline;  /* of the setup (eager connections) */
    int lazy;         /* setup is over: a refused dial means the peer is gone */
    int dropped;      /* unknown clients dropped so far */
    shake_t **out;    /* [peer]: our dial to it, allocated on first use and kept */
    int *dialing;     /* the peers whose out[] is active */
    int ndialing;
    shake_t in[MAX_GREETINGS];
    shake_t **owners; /* owners[i]: the connection behind the i-th entry watched (NULL:
                         the listening socket) */
};

static int is_incoming(const shake_t *sh) { return sh->step >= RECV_HELLO; }

static int is_sending(step_t step) {
    return step == SEND_HELLO || step == SEND_PROOF || step == SEND_CHALLENGE ||
           step == SEND_WELCOME;
}

static void start_step(shake_t *sh, step_t step, size_t len) {
    sh->step = step;
    sh->len = len;
    sh->done = 0;
}

static void close_shake(shake_t *sh) {
    if (sh->fd >= 0)
        close(sh->fd);
    sh->fd = -1;
}

/* Explicit little-endian fields: the wire format does not depend on either host. */
static void put64(unsigned char *p, uint64_t v) {
    for (int i = 0; i < 8; i++)
        p[i] = (unsigned char)(v >> (8 * i));
}

static void put32(unsigned char *p, uint32_t v) {
    for (int i = 0; i < 4; i++)
        p[i] = (unsigned char)(v >> (8 * i));
}

static uint64_t get_le(const unsigned char *p, int bytes) {
    uint64_t v = 0;
    for (int i = bytes - 1; i >= 0; i--)
        v = v << 8 | p[i];
    return v;
}

static uint64_t get64(const unsigned char *p) { return get_le(p, 8); }
static uint32_t get32(const unsigned char *p) { return (uint32_t)get_le(p, 4); }

/* The MAC over one handshake. Every field has a fixed size and the label its NUL, so no
 * two different transcripts hash the same bytes. */
static void handshake_mac(const rs_comm_t *comm, const char *label, int connector,
                          int acceptor, const shake_t *sh, unsigned char out[RS_SHA256_BYTES]) {
    unsigned char fields[4 + 8 + 4 + 4];
    put32(fields, HELLO_VERSION);
    put64(fields + 4, comm->job_id);
    put32(fields + 12, (uint32_t)connector);
    put32(fields + 16, (uint32_t)acceptor);
    rs_hmac_t m;
    rs_hmac_init(&m, comm->secret, comm->secret_len);
    rs_hmac_update(&m, label, strlen(label) + 1);
    rs_hmac_update(&m, fields, sizeof fields);
    rs_hmac_update(&m, sh->nonce_c, NONCE_BYTES);
    rs_hmac_update(&m, sh->nonce_a, NONCE_BYTES);
    rs_hmac_final(&m, out);
}

/* One send or recv of the rest of this step's message: send()'s or recv()'s result. */
static ssize_t move_some(shake_t *sh) {
    unsigned char *at = sh->msg + sh->done;
    size_t left = sh->len - sh->done;
    return is_sending(sh->step) ? send(sh->fd, at, left, MSG_NOSIGNAL) : recv(sh->fd, at, left, 0);
}

/* Move what the socket takes or gives now, never past this step's message (the bytes
 * after a PROOF are the peer's first data). 1: message complete; 0: not yet; -1: the
 * connection closed (errno 0) or failed (errno set). */
static int pump(shake_t *sh) {
    while (sh->done < sh->len) {
        ssize_t r;
        RS_RETRY_EINTR(r, move_some(sh));
        if (r > 0) {
            sh->done += (size_t)r;
            continue;
        }
        if (r < 0 && (errno == EAGAIN || errno == EWOULDBLOCK))
            return 0;
        if (r == 0)
            errno = 0;
        return -1;
    }
    return 1;
}

/* Our dial to `peer` is no longer wanted: connected, or the lower rank's dial won. */
static void stop_dialing(rs_links_t *s, int peer) {
    shake_t *sh = s->out[peer];
    if (sh && sh->active) {
        close_shake(sh);
        sh->active = 0;
    }
}

static void register_peer(rs_links_t *s, shake_t *sh) {
    rs_tcp_state_t *st = rs_tcp_state(s->comm);
    int peer = sh->peer, fd = sh->fd;
    sh->fd = -1; /* the socket is the peer's now */
    stop_dialing(s, peer);
    if (st->fds[peer] >= 0) {
        /* Two greetings that claimed one rank both proved it (checked before either was
         * registered): the first keeps the peer, and the list of connected peers stays
         * one entry a peer (it has room for N - 1). */
        close(fd);
        return;
    }
    __atomic_store_n(&st->fds[peer], fd, __ATOMIC_SEQ_CST);
    int n = st->nconnected;
    st->connected[n] = peer;
    __atomic_store_n(&st->nconnected, n + 1, __ATOMIC_SEQ_CST);
    /* An abort from another thread either saw this peer in the list or is seen here. */
    if (__atomic_load_n(&st->aborting, __ATOMIC_SEQ_CST))
        rs_tcp_send_abort(s->comm, fd);
}

/* The abort notice: one urgent byte, then (in band, right after the urgent mark) the
 * rank this rank found lost, so that a peer with no connection to it can name it. */
#define ABORT_NOTICE 'A'
#define REPORT_MAGIC 0x4c534f4cu /* "LOSL" */

void rs_tcp_send_abort(rs_comm_t *comm, int fd) {
    char notice = ABORT_NOTICE;
    unsigned char report[REPORT_BYTES];
    put32(report, REPORT_MAGIC);
    put32(report + 4, (uint32_t)__atomic_load_n(&comm->lost_rank, __ATOMIC_ACQUIRE));
    send(fd, &notice, 1, MSG_OOB | MSG_NOSIGNAL | MSG_DONTWAIT);
    send(fd, report, sizeof report, MSG_NOSIGNAL | MSG_DONTWAIT);
    shutdown(fd, SHUT_RDWR);
}

int rs_tcp_is_abort_notice(char c) { return c == ABORT_NOTICE; }

int rs_tcp_parse_report(const rs_comm_t *comm, const unsigned char *report, int from) {
    int64_t lost = (int32_t)get32(report + 4);
    if (get32(report) != REPORT_MAGIC || lost < 0 || lost >= comm->size || lost == from)
        return -1;
    return (int)lost;
}

/* ---- the peers we dial ---- */

static rs_status_t send_hello(rs_links_t *s, shake_t *sh) {
    rs_comm_t *comm = s->comm;
    if (rs_random_bytes(sh->nonce_c, NONCE_BYTES) != 0)
        return rs_fail(comm, RS_ERR_SYSTEM, "getrandom(): %s", strerror(errno));
    put64(sh->msg, HELLO_MAGIC);
    put64(sh->msg + 8, comm->job_id);
    put64(sh->msg + 16, (uint64_t)(int64_t)comm->rank);
    put32(sh->msg + 24, HELLO_VERSION);
    put32(sh->msg + 28, (uint32_t)sh->peer);
    memcpy(sh->msg + 32, sh->nonce_c, NONCE_BYTES);
    start_step(sh, SEND_HELLO, HELLO_BYTES);
    return RS_OK;
}

/* A peer that resets or closes may have dropped us among too many clients, or for its
 * own dial to us (the lower rank's wins); during setup one that refuses may still be
 * starting: try again shortly. */
static void redial_later(shake_t *sh, int err) {
    close_shake(sh);
    sh->last_errno = err;
    sh->deadline = rs_now() + sh->backoff;
    sh->backoff = sh->backoff * 2 < REDIAL_MAX_SECONDS ? sh->backoff * 2 : REDIAL_MAX_SECONDS;
}

/* After setup every peer listens for the communicator's life: a refusal, or no answer
 * from its host, means it is gone. */
static rs_status_t peer_unreachable(rs_links_t *s, shake_t *sh, int err) {
    char text[RS_ERROR_LEN];
    int p = sh->peer;
    close_shake(sh);
    sh->active = 0;
    rs_note_lost(s->comm, p);
    rs_peer_gone_text(s->comm, p, 0, -1, text, sizeof text);
    return rs_fail(s->comm, RS_ERR_COMM, "%s: connecting to it: %s", text, strerror(err));
}

static rs_status_t dial_failed(rs_links_t *s, shake_t *sh, int err) {
    int gone = err == ECONNREFUSED || err == ETIMEDOUT || err == EHOSTUNREACH ||
               err == ENETUNREACH;
    if (s->lazy && gone)
        return peer_unreachable(s, sh, err);
    if (gone || err == ECONNRESET || err == EAGAIN) {
        redial_later(sh, err);
        return RS_OK;
    }
    close_shake(sh);
    sh->active = 0;
    int p = sh->peer;
    return rs_fail(s->comm, RS_ERR_COMM, "rank %d: cannot connect to rank %d at %s:%d (host "
                   "%s): %s", s->comm->rank, p, s->hosts[p], s->ports[p],
                   rs_peer_host(s->comm, p), strerror(err));
}

static rs_status_t dial(rs_links_t *s, shake_t *sh) {
    rs_comm_t *comm = s->comm;
    int p = sh->peer;
    struct sockaddr_storage ss;
    socklen_t len;
    if (rs_tcp_parse_address(s->hosts[p], s->ports[p], &ss, &len) != 0)
        return rs_fail(comm, RS_ERR_USAGE, "rank %d: cannot parse address '%s' of rank %d",
                       comm->rank, s->hosts[p], p);
    sh->fd = socket(ss.ss_family, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
    if (sh->fd < 0)
        return rs_tcp_fail_socket(comm, "socket() for a connection to a peer", errno);
    rs_tcp_tune_socket(s->comm, sh->fd);
    if (connect(sh->fd, (struct sockaddr *)&ss, len) == 0)
        return send_hello(s, sh);
    if (errno == EINPROGRESS) {
        start_step(sh, DIALING, 0);
        return RS_OK;
    }
    return dial_failed(s, sh, errno);
}

static rs_status_t dial_finished(rs_links_t *s, shake_t *sh) {
    int err = 0;
    socklen_t elen = sizeof err;
    if (getsockopt(sh->fd, SOL_SOCKET, SO_ERROR, &err, &elen) != 0)
        err = errno;
    return err ? dial_failed(s, sh, err) : send_hello(s, sh);
}

/* The next message of a connection we dialled, once the current one is complete. */
static rs_status_t outgoing_next(rs_links_t *s, shake_t *sh) {
    rs_comm_t *comm = s->comm;
    unsigned char expected[RS_SHA256_BYTES];
    int p = sh->peer;
    switch (sh->step) {
    case SEND_HELLO:
        start_step(sh, RECV_CHALLENGE, CHALLENGE_BYTES);
        return RS_OK;
    case RECV_CHALLENGE:
        memcpy(sh->nonce_a, sh->msg, NONCE_BYTES);
        handshake_mac(comm, ACCEPT_LABEL, comm->rank, p, sh, expected);
        if (!rs_equal_secret(expected, sh->msg + NONCE_BYTES, RS_SHA256_BYTES)) {
            close_shake(sh);
            sh->active = 0;
            return rs_fail(comm, RS_ERR_COMM, "rank %d: the listener at %s:%d, where rank %d "
                           "(host %s) should be, did not prove that it knows this job's "
                           "secret (another program on that port?)", comm->rank, s->hosts[p],
                           s->ports[p], p, rs_peer_host(comm, p));
        }
        handshake_mac(comm, CONNECT_LABEL, comm->rank, p, sh, sh->msg);
        start_step(sh, SEND_PROOF, PROOF_BYTES);
        return RS_OK;
    case SEND_PROOF:
        /* The acceptor may still drop us (its deadline, or a flood of clients): the
         * connection counts once it says it registered it. */
        start_step(sh, RECV_WELCOME, WELCOME_BYTES);
        return RS_OK;
    default: /* RECV_WELCOME: the acceptor was authenticated already */
        if (sh->msg[0] != WELCOME) {
            close_shake(sh);
            sh->active = 0;
            return rs_fail(comm, RS_ERR_COMM, "rank %d: rank %d (host %s) answered our proof "
                           "with byte %d, not its welcome", comm->rank, p,
                           rs_peer_host(comm, p), sh->msg[0]);
        }
        register_peer(s, sh);
        return RS_OK;
    }
}

/* ---- setup: clients that connect to us ---- */

static void drop(rs_links_t *s, shake_t *sh, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

/* Close an incoming client that has not proved to be a rank; log it, never fail on it. */
static void drop(rs_links_t *s, shake_t *sh, const char *fmt, ...) {
    if (s->dropped < MAX_DROP_LOGS) {
        char why[256];
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(why, sizeof why, fmt, ap);
        va_end(ap);
        fprintf(stderr, "ringsync: rank %d: dropped a connection from %s: %s\n",
                s->comm->rank, sh->from, why);
    } else if (s->dropped == MAX_DROP_LOGS) {
        fprintf(stderr, "ringsync: rank %d: dropping more connections without logging "
                "them\n", s->comm->rank);
    }
    s->dropped++;
    close_shake(sh);
}

/* Check a HELLO field by field (every byte of it comes from an unknown client) and
 * answer with the challenge; or drop the client. */
static void check_hello(rs_links_t *s, shake_t *sh) {
    rs_comm_t *comm = s->comm;
    const unsigned char *m = sh->msg;
    int64_t rank = (int64_t)get64(m + 16);
    if (get64(m) != HELLO_MAGIC)
        drop(s, sh, "not a ringsync greeting");
    else if (get32(m + 24) != HELLO_VERSION)
        drop(s, sh, "greeting of protocol version %u, not %u", get32(m + 24), HELLO_VERSION);
    else if (get64(m + 8) != comm->job_id)
        drop(s, sh, "greeting for another job");
    else if (get32(m + 28) != (uint32_t)comm->rank)
        drop(s, sh, "greeting meant for rank %u", get32(m + 28));
    else if (rank < 0 || rank == comm->rank || rank >= comm->size)
        drop(s, sh, "claims rank %lld, which is no peer of this one", (long long)rank);
    else if (rs_tcp_state(comm)->fds[rank] >= 0)
        drop(s, sh, "claims rank %lld, which is connected already", (long long)rank);
    else if (rank > comm->rank && s->out[rank] && s->out[rank]->active)
        close_shake(sh); /* both dialled at once: ours, the lower rank's, wins (no log) */
    else if (rs_random_bytes(sh->nonce_a, NONCE_BYTES) != 0)
        drop(s, sh, "getrandom(): %s", strerror(errno));
    else {
        sh->peer = (int)rank;
        if (rank < comm->rank)
            stop_dialing(s, sh->peer); /* the lower rank's dial wins */
        memcpy(sh->nonce_c, m + 32, NONCE_BYTES);
        memcpy(sh->msg, sh->nonce_a, NONCE_BYTES);
        handshake_mac(comm, ACCEPT_LABEL, sh->peer, comm->rank, sh, sh->msg + NONCE_BYTES);
        start_step(sh, SEND_CHALLENGE, CHALLENGE_BYTES);
    }
}

/* Check a PROOF: only now is the client known to be the rank it claims. */
static void check_proof(rs_links_t *s, shake_t *sh) {
    unsigned char expected[RS_SHA256_BYTES];
    handshake_mac(s->comm, CONNECT_LABEL, sh->peer, s->comm->rank, sh, expected);
    if (!rs_equal_secret(expected, sh->msg, PROOF_BYTES))
        drop(s, sh, "claims rank %d but did not prove that it knows the job's secret",
             sh->peer);
    else if (rs_tcp_state(s->comm)->fds[sh->peer] >= 0)
        drop(s, sh, "rank %d is connected already", sh->peer); /* only the first proof wins */
    else {
        sh->msg[0] = WELCOME;
        start_step(sh, SEND_WELCOME, WELCOME_BYTES);
    }
}

/* The next message of an incoming connection, once the current one is complete. */
static void incoming_next(rs_links_t *s, shake_t *sh) {
    if (sh->step == RECV_HELLO)
        check_hello(s, sh);
    else if (sh->step == SEND_CHALLENGE)
        start_step(sh, RECV_PROOF, PROOF_BYTES);
    else if (sh->step == RECV_PROOF)
        check_proof(s, sh);
    else
        register_peer(s, sh); /* SEND_WELCOME: the connector counts it from its welcome */
}

static void describe_address(const struct sockaddr_storage *ss, char *out, size_t len) {
    char host[INET6_ADDRSTRLEN] = "?";
    if (ss->ss_family == AF_INET6) {
        const struct sockaddr_in6 *a6 = (const struct sockaddr_in6 *)ss;
        inet_ntop(AF_INET6, &a6->sin6_addr, host, sizeof host);
        snprintf(out, len, "[%s]:%d", host, ntohs(a6->sin6_port));
        return;
    }
    const struct sockaddr_in *a4 = (const struct sockaddr_in *)ss;
    inet_ntop(AF_INET, &a4->sin_addr, host, sizeof host);
    snprintf(out, len, "%s:%d", host, ntohs(a4->sin_port));
}

/* A slot for a new client: a free one, else the oldest client's. */
/* A client that has not greeted us yet may be evicted by a newer one; one whose greeting
 * checked out is a peer's dial in progress and keeps its slot to its own deadline. */
static int evictable(const shake_t *sh) { return sh->fd < 0 || sh->step == RECV_HELLO; }

static int room_for_clients(const rs_links_t *s) {
    for (int i = 0; i < MAX_GREETINGS; i++)
        if (evictable(&s->in[i]))
            return 1;
    return 0;
}

static shake_t *greeting_slot(rs_links_t *s) {
    shake_t *oldest = NULL;
    for (int i = 0; i < MAX_GREETINGS; i++) {
        if (s->in[i].fd < 0)
            return &s->in[i];
        if (evictable(&s->in[i]) && (!oldest || s->in[i].since < oldest->since))
            oldest = &s->in[i];
    }
    drop(s, oldest, "more than %d greetings in progress at once", MAX_GREETINGS);
    return oldest;
}

static rs_status_t progress_shake(rs_links_t *s, shake_t *sh);

/* Take every waiting client; each gets a slot and its own deadline, and is read at once:
 * a real peer's HELLO is usually there already, and a bad one frees its slot early. */
static rs_status_t accept_clients(rs_links_t *s) {
    int listen_fd = rs_tcp_state(s->comm)->listen_fd;
    /* (every slot busy with peers: the rest wait in the listening socket's backlog) */
    while (room_for_clients(s)) {
        struct sockaddr_storage ss;
        socklen_t len = sizeof ss;
        int fd;
        RS_RETRY_EINTR(fd, accept4(listen_fd, (struct sockaddr *)&ss, &len,
                                   SOCK_CLOEXEC | SOCK_NONBLOCK));
        if (fd < 0 && (errno == EMFILE || errno == ENFILE))
            return rs_tcp_fail_socket(s->comm, "accept() of a higher rank's connection", errno);
        if (fd < 0)
            return RS_OK; /* none left (or a client that gave up: the next poll looks) */
        rs_tcp_tune_socket(s->comm, fd);
        shake_t *sh = greeting_slot(s);
        sh->fd = fd;
        sh->peer = -1;
        sh->since = rs_now();
        sh->deadline = sh->since + GREETING_SECONDS;
        describe_address(&ss, sh->from, sizeof sh->from);
        start_step(sh, RECV_HELLO, HELLO_BYTES);
        RS_CHECK(progress_shake(s, sh));
    }
    return RS_OK;
}

/* ---- the handshakes' loop (setup's, then the data path's) ---- */

/* Move one connection on as far as its socket allows now. */
static rs_status_t progress_shake(rs_links_t *s, shake_t *sh) {
    if (sh->fd >= 0 && sh->step == DIALING)
        RS_CHECK(dial_finished(s, sh));
    while (sh->fd >= 0 && sh->step != DIALING) {
        int r = pump(sh);
        if (r == 0)
            return RS_OK;
        if (r < 0 && !is_incoming(sh)) {
            redial_later(sh, errno);
            return RS_OK;
        }
        if (r < 0) {
            int nothing = sh->step == RECV_HELLO && sh->done == 0;
            drop(s, sh, "%s%s", errno ? strerror(errno) : "closed the connection",
                 nothing ? " before any greeting" : " during the greeting");
            return RS_OK;
        }
        if (is_incoming(sh))
            incoming_next(s, sh);
        else
            RS_CHECK(outgoing_next(s, sh));
    }
    return RS_OK;
}

/* Drop clients past their own deadline; redial peers whose pause is over. */
static rs_status_t handle_deadlines(rs_links_t *s, double now) {
    for (int i = 0; i < MAX_GREETINGS; i++) {
        shake_t *sh = &s->in[i];
        if (sh->fd >= 0 && now >= sh->deadline)
            drop(s, sh, "%s within %.0f s", sh->step == RECV_HELLO && sh->done == 0
                 ? "sent no greeting" : "did not complete the greeting", GREETING_SECONDS);
    }
    for (int k = 0; k < s->ndialing; k++) {
        shake_t *sh = s->out[s->dialing[k]];
        if (sh->active && sh->fd < 0 && now >= sh->deadline)
            RS_CHECK(dial(s, sh));
    }
    return RS_OK;
}

static void watch(rs_links_t *s, struct pollfd *pfds, int first, int *n, int fd, short events,
                  shake_t *owner) {
    pfds[*n] = (struct pollfd){.fd = fd, .events = events};
    s->owners[*n - first] = owner;
    (*n)++;
}

int rs_tcp_links_room(const rs_comm_t *comm) { return 1 + MAX_GREETINGS + comm->size; }

/* The dialling list without the dials that ended (connected, or given up). */
static void compact_dialing(rs_links_t *s) {
    int kept = 0;
    for (int k = 0; k < s->ndialing; k++)
        if (s->out[s->dialing[k]]->active)
            s->dialing[kept++] = s->dialing[k];
    s->ndialing = kept;
}

int rs_tcp_links_watch(rs_comm_t *comm, struct pollfd *pfds, int n, double *wake) {
    rs_links_t *s = rs_tcp_state(comm)->links;
    int first = n;
    if (!s)
        return n;
    if (room_for_clients(s))
        watch(s, pfds, first, &n, rs_tcp_state(comm)->listen_fd, POLLIN, NULL);
    compact_dialing(s);
    for (int k = 0; k < s->ndialing; k++) {
        shake_t *sh = s->out[s->dialing[k]];
        if (sh->fd >= 0)
            watch(s, pfds, first, &n, sh->fd, is_sending(sh->step) || sh->step == DIALING
                  ? POLLOUT : POLLIN, sh);
        else if (sh->deadline < *wake)
            *wake = sh->deadline;
    }
    for (int i = 0; i < MAX_GREETINGS; i++) {
        shake_t *sh = &s->in[i];
        if (sh->fd < 0)
            continue;
        watch(s, pfds, first, &n, sh->fd, is_sending(sh->step) ? POLLOUT : POLLIN, sh);
        if (sh->deadline < *wake)
            *wake = sh->deadline;
    }
    return n;
}

rs_status_t rs_tcp_links_advance(rs_comm_t *comm, const struct pollfd *pfds, int first, int n) {
    rs_links_t *s = rs_tcp_state(comm)->links;
    if (!s)
        return RS_OK;
    /* Connections first, new clients last: accepting may evict a slot watched here. */
    for (int i = first; i < n; i++)
        if (s->owners[i - first] && pfds[i].revents)
            RS_CHECK(progress_shake(s, s->owners[i - first]));
    if (n > first && !s->owners[0] && pfds[first].revents)
        RS_CHECK(accept_clients(s));
    return handle_deadlines(s, rs_now());
}

/* Whether an incoming client that claims to be `peer` is greeting us now. */
static int greeting_from(const rs_links_t *s, int peer) {
    for (int i = 0; i < MAX_GREETINGS; i++)
        if (s->in[i].fd >= 0 && s->in[i].peer == peer)
            return 1;
    return 0;
}

static rs_status_t start_dialing(rs_links_t *s, int peer) {
    if (!s->out[peer]) {
        s->out[peer] = calloc(1, sizeof *s->out[peer]);
        if (!s->out[peer])
            return rs_fail(s->comm, RS_ERR_NOMEM, "out of memory");
        *s->out[peer] = (shake_t){.fd = -1, .peer = peer};
    }
    shake_t *sh = s->out[peer];
    sh->active = 1;
    sh->backoff = REDIAL_FIRST_SECONDS;
    s->dialing[s->ndialing++] = peer; /* (compacted before it could hold a peer twice) */
    compact_dialing(s);
    return dial(s, sh);
}

rs_status_t rs_tcp_reach(rs_comm_t *comm, int peer, int *linked) {
    rs_tcp_state_t *st = rs_tcp_state(comm);
    rs_links_t *s = st->links;
    *linked = st->fds[peer] >= 0;
    if (*linked || !s || (s->out[peer] && s->out[peer]->active) || greeting_from(s, peer))
        return RS_OK;
    return start_dialing(s, peer);
}

/* ---- setup: the eager connections ---- */

static int eager_missing(rs_comm_t *comm, const unsigned char *eager) {
    int missing = 0;
    for (int p = 0; p < comm->size; p++)
        missing += eager[p] && p != comm->rank && rs_tcp_state(comm)->fds[p] < 0;
    return missing;
}

/* The setup deadline passed: name every rank that did not connect, and why. */
static rs_status_t fail_setup_timeout(rs_links_t *s, const unsigned char *eager) {
    rs_comm_t *comm = s->comm;
    char text[RS_ERROR_LEN - 128];
    size_t at = 0;
    text[0] = '\0';
    for (int p = 0; p < comm->size && at < sizeof text; p++) {
        if (!eager[p] || p == comm->rank || rs_tcp_state(comm)->fds[p] >= 0)
            continue;
        const shake_t *sh = s->out[p] && s->out[p]->active ? s->out[p] : NULL;
        const char *why = !sh ? "never connected"
                          : sh->fd >= 0 && sh->step == DIALING ? "did not accept our connection"
                          : sh->fd >= 0 ? "did not answer our greeting"
                          : sh->last_errno ? strerror(sh->last_errno)
                                           : "closed our connections during the greeting";
        at += (size_t)snprintf(text + at, sizeof text - at, "%srank %d (host %s) %s",
                               at ? "; " : "", p, rs_peer_host(comm, p), why);
    }
    return rs_fail(comm, RS_ERR_TIMEOUT, "rank %d: timed out after %.1f s connecting the ring "
                   "(RINGSYNC_START_TIMEOUT_SECONDS=%g): %s%s", comm->rank, comm->setup_seconds,
                   comm->setup_seconds, text, s->dropped ? " (unknown clients were dropped)" : "");
}

/* Dial the eager peers below us and wait until every eager peer is connected (those
 * above dial us); clients that are no eager peer are served too. */
static rs_status_t run_setup(rs_links_t *s, const unsigned char *eager) {
    rs_comm_t *comm = s->comm;
    struct pollfd *pfds = rs_tcp_state(comm)->pfds;
    for (int p = 0; p < comm->rank; p++)
        if (eager[p])
            RS_CHECK(start_dialing(s, p));
    while (eager_missing(comm, eager) > 0) {
        double now = rs_now();
        if (now >= s->deadline)
            return fail_setup_timeout(s, eager);
        double wake = s->deadline;
        int n = rs_tcp_links_watch(comm, pfds, 0, &wake);
        double wait = wake - now < 1.0 ? wake - now : 1.0; /* (any setup timeout fits) */
        int r = poll(pfds, (nfds_t)n, (int)(wait * 1000) + 1);
        if (r < 0 && errno != EINTR)
            return rs_fail(comm, RS_ERR_SYSTEM, "poll(): %s", strerror(errno));
        if (r < 0)
            continue;
        RS_CHECK(rs_tcp_links_advance(comm, pfds, 0, n));
    }
    s->lazy = 1;
    return RS_OK;
}

static void free_links(rs_comm_t *comm, rs_links_t *s) {
    for (int i = 0; i < MAX_GREETINGS; i++)
        close_shake(&s->in[i]);
    for (int p = 0; s->out && p < comm->size; p++)
        if (s->out[p]) {
            close_shake(s->out[p]);
            free(s->out[p]);
        }
    for (int p = 0; s->hosts && p < comm->size; p++)
        free(s->hosts[p]);
    free(s->hosts);
    free(s->ports);
    free(s->out);
    free(s->dialing);
    free(s->owners);
    free(s);
}

static rs_links_t *new_links(rs_comm_t *comm, const char **hosts, const int *ports) {
    size_t n = (size_t)comm->size;
    rs_links_t *s = calloc(1, sizeof *s);
    if (!s)
        return NULL;
    s->comm = comm;
    s->hosts = calloc(n, sizeof *s->hosts);
    s->ports = malloc(n * sizeof *s->ports);
    s->out = calloc(n, sizeof *s->out);
    s->dialing = malloc(n * sizeof *s->dialing);
    s->owners = calloc((size_t)rs_tcp_links_room(comm), sizeof *s->owners);
    for (int i = 0; i < MAX_GREETINGS; i++)
        s->in[i].fd = -1;
    int ok = s->hosts && s->ports && s->out && s->dialing && s->owners;
    for (size_t p = 0; ok && p < n; p++) {
        s->hosts[p] = strdup(hosts[p]);
        s->ports[p] = ports[p];
        ok = s->hosts[p] != NULL;
    }
    if (!ok) {
        free_links(comm, s);
        return NULL;
    }
    s->deadline = rs_now() + comm->setup_seconds;
    return s;
}

rs_status_t rs_tcp_connect(rs_comm_t *comm, const char **hosts, const int *ports,
                           const unsigned char *eager) {
    rs_tcp_state_t *st = rs_tcp_state(comm);
    if (!(st->links = new_links(comm, hosts, ports)))
        return rs_fail(comm, RS_ERR_NOMEM, "out of memory");
    rs_status_t status = run_setup(st->links, eager);
    if (status != RS_OK) { /* what is half done is no peer: close it now */
        free_links(comm, st->links);
        st->links = NULL;
    }
    return status;
}

/* ---- the table's end ---- */

void rs_tcp_release(rs_comm_t *comm) {
    rs_tcp_state_t *st = rs_tcp_state(comm);
    if (!st)
        return;
    for (int i = 0; st->fds && i < comm->size; i++)
        if (st->fds[i] >= 0)
            close(st->fds[i]);
    if (st->listen_fd >= 0)
        close(st->listen_fd);
    if (st->links)
        free_links(comm, st->links);
    free(st->fds);
    free(st->connected);
    free(st->reported);
    free(st->slot);
    free(st->hung_up);
    free(st->aborted);
    free(st->pfds);
    free(st);
    comm->transport_state = NULL;
}
