/* The TCP transport's connection setup: listening, then the authenticated handshake with
 * every peer (a state machine per connection, all in one poll loop), and the connection
 * table it fills (tcp_setup.h). The data path over the connections is transport_tcp.c's,
 * which puts these functions in its table: no file above the transports names them. */
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

/* Without a timeout, a host that stops answering is given this long (see tune_socket). */
#define UNANSWERED_HOST_SECONDS 120.0

/* A peer whose host or network went away sends no FIN: without help the kernel retries
 * for many minutes and the wait looks like a slow peer. The kernel gives up on data left
 * unacknowledged for half the timeout (TCP_USER_TIMEOUT), and probes an idle connection
 * after a third of it (keepalive: answered by the peer's kernel even when its process is
 * busy, so a slow peer is never mistaken for a lost one, and no timeout is needed). */
static void tune_socket(const rs_comm_t *comm, int fd) {
    int one = 1;
    /* Small messages (barriers, size exchanges) must not wait for Nagle's timer. */
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    double t = comm->timeout_seconds > 0 ? comm->timeout_seconds : UNANSWERED_HOST_SECONDS;
    unsigned user_ms = (unsigned)(t * 500 < 1000 ? 1000 : t * 500 > 3.6e6 ? 3.6e6 : t * 500);
    int idle = (int)(t / 3 < 1 ? 1 : t / 3 > 3600 ? 3600 : t / 3), interval = 1, probes = 3;
    setsockopt(fd, IPPROTO_TCP, TCP_USER_TIMEOUT, &user_ms, sizeof user_ms);
    setsockopt(fd, SOL_SOCKET, SO_KEEPALIVE, &one, sizeof one);
    setsockopt(fd, IPPROTO_TCP, TCP_KEEPIDLE, &idle, sizeof idle);
    setsockopt(fd, IPPROTO_TCP, TCP_KEEPINTVL, &interval, sizeof interval);
    setsockopt(fd, IPPROTO_TCP, TCP_KEEPCNT, &probes, sizeof probes);
}

/* Parse a numeric IPv4/IPv6 address ("" = any IPv4 address). */
static int parse_address(const char *host, int port, struct sockaddr_storage *ss,
                         socklen_t *len) {
    memset(ss, 0, sizeof *ss);
    if (strchr(host, ':')) {
        struct sockaddr_in6 *a6 = (struct sockaddr_in6 *)ss;
        a6->sin6_family = AF_INET6;
        a6->sin6_port = htons((uint16_t)port);
        *len = sizeof *a6;
        return inet_pton(AF_INET6, host, &a6->sin6_addr) == 1 ? 0 : -1;
    }
    struct sockaddr_in *a4 = (struct sockaddr_in *)ss;
    a4->sin_family = AF_INET;
    a4->sin_port = htons((uint16_t)port);
    *len = sizeof *a4;
    if (host[0] == '\0') {
        a4->sin_addr.s_addr = htonl(INADDR_ANY);
        return 0;
    }
    return inet_pton(AF_INET, host, &a4->sin_addr) == 1 ? 0 : -1;
}

static void limit_text(rlim_t v, char *out, size_t cap) {
    if (v == RLIM_INFINITY)
        snprintf(out, cap, "unlimited");
    else
        snprintf(out, cap, "%llu", (unsigned long long)v);
}

/* socket() or accept() failed: out of file descriptors (EMFILE, ENFILE) gets words that
 * name the limit and what a rank of this job needs; anything else, the call and errno. */
static rs_status_t fail_socket(rs_comm_t *comm, const char *call, int err) {
    if (err != EMFILE && err != ENFILE)
        return rs_fail(comm, RS_ERR_SYSTEM, "rank %d: %s: %s", comm->rank, call, strerror(err));
    struct rlimit lim = {RLIM_INFINITY, RLIM_INFINITY};
    getrlimit(RLIMIT_NOFILE, &lim);
    char soft[32], hard[32];
    limit_text(lim.rlim_cur, soft, sizeof soft);
    limit_text(lim.rlim_max, hard, sizeof hard);
    return rs_fail(comm, RS_ERR_SYSTEM, "rank %d: %s: %s: out of file descriptors. In a job of "
                   "%d ranks each keeps a socket to each of its %d peers, plus its own files; "
                   "%s (RLIMIT_NOFILE soft limit %s, hard limit %s). Raise it: ulimit -n "
                   "(ulimit -Hn for the hard limit), LimitNOFILE= under systemd, docker run "
                   "--ulimit nofile=N:N, or /etc/security/limits.conf", comm->rank, call,
                   strerror(err), comm->size, comm->size - 1,
                   err == ENFILE ? "the system's whole file table is full (fs.file-max)"
                                 : "this process may open no more files", soft, hard);
}

static rs_status_t alloc_state(rs_comm_t *comm) {
    rs_tcp_state_t *st = calloc(1, sizeof *st);
    if (!st)
        return rs_fail(comm, RS_ERR_NOMEM, "out of memory");
    comm->transport_state = st;
    st->listen_fd = -1;
    st->fds = malloc((size_t)comm->size * sizeof *st->fds);
    st->hung_up = calloc((size_t)comm->size, sizeof *st->hung_up);
    st->aborted = calloc((size_t)comm->size, sizeof *st->aborted);
    st->pfds = malloc(((size_t)comm->size + 1) * sizeof *st->pfds);
    if (!st->fds || !st->hung_up || !st->aborted || !st->pfds)
        return rs_fail(comm, RS_ERR_NOMEM, "out of memory");
    for (int i = 0; i < comm->size; i++)
        st->fds[i] = -1;
    return RS_OK;
}

rs_status_t rs_tcp_listen(rs_comm_t *comm, const char *bind_host, int *port) {
    RS_CHECK(alloc_state(comm));
    rs_tcp_state_t *st = rs_tcp_state(comm);
    struct sockaddr_storage ss;
    socklen_t len;
    if (parse_address(bind_host, 0, &ss, &len) != 0)
        return rs_fail(comm, RS_ERR_USAGE, "cannot parse bind address '%s'", bind_host);
    /* Non-blocking: setup accepts every waiting client until none is left. */
    int fd = socket(ss.ss_family, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
    if (fd < 0)
        return fail_socket(comm, "socket()", errno);
    st->listen_fd = fd;
    int one = 1;
    setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    if (bind(fd, (struct sockaddr *)&ss, len) != 0)
        return rs_fail(comm, RS_ERR_SYSTEM, "bind(%s): %s", bind_host, strerror(errno));
    /* The backlog holds every peer's connection until we accept it. */
    if (listen(fd, SOMAXCONN) != 0)
        return rs_fail(comm, RS_ERR_SYSTEM, "listen(): %s", strerror(errno));
    if (getsockname(fd, (struct sockaddr *)&ss, &len) != 0)
        return rs_fail(comm, RS_ERR_SYSTEM, "getsockname(): %s", strerror(errno));
    *port = ntohs(ss.ss_family == AF_INET6 ? ((struct sockaddr_in6 *)&ss)->sin6_port
                                           : ((struct sockaddr_in *)&ss)->sin_port);
    return RS_OK;
}

/* ---- connection setup ----
 *
 * Every pair of ranks shares one socket: the higher rank connects, the lower one accepts.
 * Each connection proves, in both directions, that its ends know the job's secret (handed
 * out over MPI only; the job id, by contrast, is public: it names shared segments). The
 * secret itself never crosses the wire:
 *
 *   connector -> acceptor  HELLO      magic, job id, connector's rank, version,
 *                                     acceptor's rank, nonce_c
 *   acceptor -> connector  CHALLENGE  nonce_a, MAC("ringsync-accept", transcript)
 *   connector -> acceptor  PROOF      MAC("ringsync-connect", transcript)
 *
 * transcript = version, job id, both ranks, nonce_c, nonce_a; MAC = HMAC-SHA256 keyed with
 * the secret; nonces are fresh random bytes. The connector checks the acceptor's MAC before
 * it answers, so a stray listener at a peer's address is never believed. The acceptor
 * registers a socket as a rank's only once its proof checks out; a recorded HELLO and PROOF
 * replayed later fail, since nonce_a is new each time. The two labels differ, so neither
 * MAC can be reflected back as the other.
 *
 * Both directions run in one poll loop: the lower ranks we dial, and every incoming client
 * at once. A client's bytes are untrusted until its proof checks out: one that is silent,
 * slow, malformed or unauthenticated is dropped on its own short deadline and logged, and
 * never delays the real peers or gets blamed on a rank. */

#define HELLO_MAGIC 0x52494e4753594e43ULL /* "RINGSYNC" */
#define HELLO_VERSION 2u
#define NONCE_BYTES 16
#define HELLO_BYTES (8 + 8 + 8 + 4 + 4 + NONCE_BYTES)
#define CHALLENGE_BYTES (NONCE_BYTES + RS_SHA256_BYTES)
#define PROOF_BYTES RS_SHA256_BYTES
#define MAX_MESSAGE_BYTES HELLO_BYTES /* the largest of the three */
#define ACCEPT_LABEL "ringsync-accept"
#define CONNECT_LABEL "ringsync-connect"
/* A real peer greets at once and answers within a round trip; a client gets this long. */
#define GREETING_SECONDS 5.0
/* Incoming clients in progress at once; a flood of them evicts the oldest first. */
#define MAX_GREETINGS 64
/* Dropped clients logged per setup: a port scan must not flood stderr. */
#define MAX_DROP_LOGS 16
/* Redialling a peer that is not listening yet (or dropped us): first pause, longest. */
#define REDIAL_FIRST_SECONDS 0.02
#define REDIAL_MAX_SECONDS 0.5

typedef enum {
    DIALING, SEND_HELLO, RECV_CHALLENGE, SEND_PROOF, /* we connect to a lower rank */
    RECV_HELLO, SEND_CHALLENGE, RECV_PROOF           /* a client connects to us */
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
    char from[INET6_ADDRSTRLEN + 8]; /* incoming: "address:port", for the log */
} shake_t;

typedef struct {
    rs_comm_t *comm;
    const char **hosts;
    const int *ports;
    double deadline;  /* of the whole setup */
    int missing;      /* peers not connected yet */
    int dropped;      /* unknown clients dropped so far */
    shake_t *out;     /* [peer] for each lower rank */
    shake_t in[MAX_GREETINGS];
    struct pollfd *pfds; /* the listening socket, then one per connection in progress */
    shake_t **owners;    /* owners[i]: the connection behind pfds[i] (NULL: listening) */
} setup_t;

static int is_incoming(const shake_t *sh) { return sh->step >= RECV_HELLO; }

static int is_sending(step_t step) {
    return step == SEND_HELLO || step == SEND_PROOF || step == SEND_CHALLENGE;
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

static void register_peer(setup_t *s, shake_t *sh) {
    rs_tcp_state(s->comm)->fds[sh->peer] = sh->fd;
    sh->fd = -1; /* the socket is the peer's now */
    s->missing--;
}

/* ---- setup: the lower ranks we dial ---- */

static rs_status_t send_hello(setup_t *s, shake_t *sh) {
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

/* A peer that refuses, resets or closes may still be starting, or may have dropped us
 * among too many clients: try again shortly, until the setup deadline. */
static void redial_later(shake_t *sh, int err) {
    close_shake(sh);
    sh->last_errno = err;
    sh->deadline = rs_now() + sh->backoff;
    sh->backoff = sh->backoff * 2 < REDIAL_MAX_SECONDS ? sh->backoff * 2 : REDIAL_MAX_SECONDS;
}

static rs_status_t dial_failed(setup_t *s, shake_t *sh, int err) {
    if (err == ECONNREFUSED || err == ETIMEDOUT || err == ECONNRESET || err == EAGAIN) {
        redial_later(sh, err);
        return RS_OK;
    }
    close_shake(sh);
    int p = sh->peer;
    return rs_fail(s->comm, RS_ERR_COMM, "rank %d: cannot connect to rank %d at %s:%d (host "
                   "%s): %s", s->comm->rank, p, s->hosts[p], s->ports[p],
                   rs_peer_host(s->comm, p), strerror(err));
}

static rs_status_t dial(setup_t *s, shake_t *sh) {
    rs_comm_t *comm = s->comm;
    int p = sh->peer;
    struct sockaddr_storage ss;
    socklen_t len;
    if (parse_address(s->hosts[p], s->ports[p], &ss, &len) != 0)
        return rs_fail(comm, RS_ERR_USAGE, "rank %d: cannot parse address '%s' of rank %d",
                       comm->rank, s->hosts[p], p);
    sh->fd = socket(ss.ss_family, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
    if (sh->fd < 0)
        return fail_socket(comm, "socket() for a connection to a lower rank", errno);
    tune_socket(s->comm, sh->fd);
    if (connect(sh->fd, (struct sockaddr *)&ss, len) == 0)
        return send_hello(s, sh);
    if (errno == EINPROGRESS) {
        start_step(sh, DIALING, 0);
        return RS_OK;
    }
    return dial_failed(s, sh, errno);
}

static rs_status_t dial_finished(setup_t *s, shake_t *sh) {
    int err = 0;
    socklen_t elen = sizeof err;
    if (getsockopt(sh->fd, SOL_SOCKET, SO_ERROR, &err, &elen) != 0)
        err = errno;
    return err ? dial_failed(s, sh, err) : send_hello(s, sh);
}

/* The next message of a connection we dialled, once the current one is complete. */
static rs_status_t outgoing_next(setup_t *s, shake_t *sh) {
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
            return rs_fail(comm, RS_ERR_COMM, "rank %d: the listener at %s:%d, where rank %d "
                           "(host %s) should be, did not prove that it knows this job's "
                           "secret (another program on that port?)", comm->rank, s->hosts[p],
                           s->ports[p], p, rs_peer_host(comm, p));
        }
        handshake_mac(comm, CONNECT_LABEL, comm->rank, p, sh, sh->msg);
        start_step(sh, SEND_PROOF, PROOF_BYTES);
        return RS_OK;
    default: /* SEND_PROOF: the acceptor is authenticated, and will find us so too */
        register_peer(s, sh);
        return RS_OK;
    }
}

/* ---- setup: clients that connect to us ---- */

static void drop(setup_t *s, shake_t *sh, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

/* Close an incoming client that has not proved to be a rank; log it, never fail on it. */
static void drop(setup_t *s, shake_t *sh, const char *fmt, ...) {
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
static void check_hello(setup_t *s, shake_t *sh) {
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
    else if (rank <= comm->rank || rank >= comm->size)
        drop(s, sh, "claims rank %lld, which does not connect to this one", (long long)rank);
    else if (rs_tcp_state(comm)->fds[rank] >= 0)
        drop(s, sh, "claims rank %lld, which is connected already", (long long)rank);
    else if (rs_random_bytes(sh->nonce_a, NONCE_BYTES) != 0)
        drop(s, sh, "getrandom(): %s", strerror(errno));
    else {
        sh->peer = (int)rank;
        memcpy(sh->nonce_c, m + 32, NONCE_BYTES);
        memcpy(sh->msg, sh->nonce_a, NONCE_BYTES);
        handshake_mac(comm, ACCEPT_LABEL, sh->peer, comm->rank, sh, sh->msg + NONCE_BYTES);
        start_step(sh, SEND_CHALLENGE, CHALLENGE_BYTES);
    }
}

/* Check a PROOF: only now is the client known to be the rank it claims. */
static void check_proof(setup_t *s, shake_t *sh) {
    unsigned char expected[RS_SHA256_BYTES];
    handshake_mac(s->comm, CONNECT_LABEL, sh->peer, s->comm->rank, sh, expected);
    if (!rs_equal_secret(expected, sh->msg, PROOF_BYTES))
        drop(s, sh, "claims rank %d but did not prove that it knows the job's secret",
             sh->peer);
    else if (rs_tcp_state(s->comm)->fds[sh->peer] >= 0)
        drop(s, sh, "rank %d is connected already", sh->peer); /* only the first proof wins */
    else
        register_peer(s, sh);
}

/* The next message of an incoming connection, once the current one is complete. */
static void incoming_next(setup_t *s, shake_t *sh) {
    if (sh->step == RECV_HELLO)
        check_hello(s, sh);
    else if (sh->step == SEND_CHALLENGE)
        start_step(sh, RECV_PROOF, PROOF_BYTES);
    else
        check_proof(s, sh);
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
static shake_t *greeting_slot(setup_t *s) {
    shake_t *oldest = &s->in[0];
    for (int i = 0; i < MAX_GREETINGS; i++) {
        if (s->in[i].fd < 0)
            return &s->in[i];
        if (s->in[i].since < oldest->since)
            oldest = &s->in[i];
    }
    drop(s, oldest, "more than %d greetings in progress at once", MAX_GREETINGS);
    return oldest;
}

static rs_status_t progress_shake(setup_t *s, shake_t *sh);

/* Take every waiting client; each gets a slot and its own deadline, and is read at once:
 * a real peer's HELLO is usually there already, and a bad one frees its slot early. */
static rs_status_t accept_clients(setup_t *s) {
    int listen_fd = rs_tcp_state(s->comm)->listen_fd;
    for (;;) {
        struct sockaddr_storage ss;
        socklen_t len = sizeof ss;
        int fd;
        RS_RETRY_EINTR(fd, accept4(listen_fd, (struct sockaddr *)&ss, &len,
                                   SOCK_CLOEXEC | SOCK_NONBLOCK));
        if (fd < 0 && (errno == EMFILE || errno == ENFILE))
            return fail_socket(s->comm, "accept() of a higher rank's connection", errno);
        if (fd < 0)
            return RS_OK; /* none left (or a client that gave up: the next poll looks) */
        tune_socket(s->comm, fd);
        shake_t *sh = greeting_slot(s);
        sh->fd = fd;
        sh->peer = -1;
        sh->since = rs_now();
        sh->deadline = sh->since + GREETING_SECONDS;
        describe_address(&ss, sh->from, sizeof sh->from);
        start_step(sh, RECV_HELLO, HELLO_BYTES);
        RS_CHECK(progress_shake(s, sh));
    }
}

/* ---- setup: the loop ---- */

/* Move one connection on as far as its socket allows now. */
static rs_status_t progress_shake(setup_t *s, shake_t *sh) {
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

/* Drop clients past their own deadline; redial lower ranks whose pause is over. */
static rs_status_t handle_deadlines(setup_t *s, double now) {
    for (int i = 0; i < MAX_GREETINGS; i++) {
        shake_t *sh = &s->in[i];
        if (sh->fd >= 0 && now >= sh->deadline)
            drop(s, sh, "%s within %.0f s", sh->step == RECV_HELLO && sh->done == 0
                 ? "sent no greeting" : "did not complete the greeting", GREETING_SECONDS);
    }
    for (int p = 0; p < s->comm->rank; p++) {
        shake_t *sh = &s->out[p];
        if (sh->fd < 0 && rs_tcp_state(s->comm)->fds[p] < 0 && now >= sh->deadline)
            RS_CHECK(dial(s, sh));
    }
    return RS_OK;
}

static void watch(setup_t *s, int *n, int fd, short events, shake_t *owner) {
    s->pfds[*n] = (struct pollfd){.fd = fd, .events = events};
    s->owners[*n] = owner;
    (*n)++;
}

/* Fill the poll set; return how many entries, and in *wake when to look again anyway. */
static int poll_set(setup_t *s, double *wake) {
    rs_comm_t *comm = s->comm;
    rs_tcp_state_t *st = rs_tcp_state(comm);
    int n = 0;
    *wake = s->deadline;
    for (int p = comm->rank + 1; p < comm->size; p++)
        if (st->fds[p] < 0) {
            watch(s, &n, st->listen_fd, POLLIN, NULL); /* some higher rank still to come */
            break;
        }
    for (int p = 0; p < comm->rank; p++) {
        shake_t *sh = &s->out[p];
        if (sh->fd >= 0)
            watch(s, &n, sh->fd, is_sending(sh->step) || sh->step == DIALING ? POLLOUT : POLLIN,
                  sh);
        else if (st->fds[p] < 0 && sh->deadline < *wake)
            *wake = sh->deadline;
    }
    for (int i = 0; i < MAX_GREETINGS; i++) {
        shake_t *sh = &s->in[i];
        if (sh->fd < 0)
            continue;
        watch(s, &n, sh->fd, is_sending(sh->step) ? POLLOUT : POLLIN, sh);
        if (sh->deadline < *wake)
            *wake = sh->deadline;
    }
    return n;
}

/* The setup deadline passed: name every rank that did not connect, and why. */
static rs_status_t fail_setup_timeout(setup_t *s) {
    rs_comm_t *comm = s->comm;
    char text[RS_ERROR_LEN - 128];
    size_t at = 0;
    text[0] = '\0';
    for (int p = 0; p < comm->size && at < sizeof text; p++) {
        if (p == comm->rank || rs_tcp_state(comm)->fds[p] >= 0)
            continue;
        const shake_t *sh = p < comm->rank ? &s->out[p] : NULL;
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

static rs_status_t run_setup(setup_t *s) {
    for (int p = 0; p < s->comm->rank; p++)
        RS_CHECK(dial(s, &s->out[p]));
    while (s->missing > 0) {
        double now = rs_now();
        RS_CHECK(handle_deadlines(s, now));
        if (now >= s->deadline)
            return fail_setup_timeout(s);
        double wake;
        int n = poll_set(s, &wake);
        double wait = wake - now < 1.0 ? wake - now : 1.0; /* (any setup timeout fits) */
        int r = poll(s->pfds, (nfds_t)n, (int)(wait * 1000) + 1);
        if (r < 0 && errno != EINTR)
            return rs_fail(s->comm, RS_ERR_SYSTEM, "poll(): %s", strerror(errno));
        /* Connections first, new clients last: accepting may evict a slot polled above. */
        for (int i = 0; r > 0 && i < n; i++)
            if (s->owners[i] && s->pfds[i].revents)
                RS_CHECK(progress_shake(s, s->owners[i]));
        if (r > 0 && n > 0 && !s->owners[0] && s->pfds[0].revents)
            RS_CHECK(accept_clients(s));
    }
    return RS_OK;
}

static setup_t *new_setup(rs_comm_t *comm, const char **hosts, const int *ports) {
    setup_t *s = calloc(1, sizeof *s);
    size_t slots = 1 + (size_t)comm->rank + MAX_GREETINGS;
    if (!s)
        return NULL;
    s->out = calloc((size_t)comm->rank + 1, sizeof *s->out);
    s->pfds = calloc(slots, sizeof *s->pfds);
    s->owners = calloc(slots, sizeof *s->owners);
    s->comm = comm;
    s->hosts = hosts;
    s->ports = ports;
    s->missing = comm->size - 1;
    s->deadline = rs_now() + comm->setup_seconds;
    for (int i = 0; i < MAX_GREETINGS; i++)
        s->in[i].fd = -1;
    for (int p = 0; s->out && p < comm->rank; p++)
        s->out[p] = (shake_t){.fd = -1, .peer = p, .backoff = REDIAL_FIRST_SECONDS};
    return s;
}

/* Close whatever is still half-done (it is no peer) and free the setup. */
static void end_setup(setup_t *s) {
    for (int i = 0; i < MAX_GREETINGS; i++)
        if (s->in[i].fd >= 0)
            drop(s, &s->in[i], "%s before setup finished", s->in[i].step == RECV_HELLO &&
                 s->in[i].done == 0 ? "sent no greeting" : "did not complete the greeting");
    for (int p = 0; s->out && p < s->comm->rank; p++)
        close_shake(&s->out[p]);
    free(s->out);
    free(s->pfds);
    free(s->owners);
    free(s);
}

rs_status_t rs_tcp_connect(rs_comm_t *comm, const char **hosts, const int *ports) {
    rs_tcp_state_t *st = rs_tcp_state(comm);
    setup_t *s = new_setup(comm, hosts, ports);
    if (!s || !s->out || !s->pfds || !s->owners) {
        if (s)
            end_setup(s);
        return rs_fail(comm, RS_ERR_NOMEM, "out of memory");
    }
    rs_status_t status = run_setup(s);
    end_setup(s);
    if (status == RS_OK) {
        close(st->listen_fd); /* later clients are refused by the kernel */
        st->listen_fd = -1;
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
    free(st->fds);
    free(st->hung_up);
    free(st->aborted);
    free(st->pfds);
    free(st);
    comm->transport_state = NULL;
}
