/* TCP transport: one non-blocking stream socket to every peer (a full mesh, so that
 * alltoall and barrier need no relays and every rank notices any peer's death). */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "internal.h"

#define HELLO_MAGIC 0x52494e4753594e43ULL /* "RINGSYNC" */

typedef struct {
    int listen_fd;
    int *fds; /* fds[peer]; -1 for self and unconnected peers */
    int *hung_up; /* a peer that closed while outside an exchange was already reported */
    int *aborted; /* the peer sent an abort notice: it is alive but gave up */
    struct pollfd *pfds;
} tcp_state_t;

typedef struct {
    uint64_t magic;
    uint64_t token;
    int64_t rank;
} hello_t;

static tcp_state_t *state_of(rs_comm_t *comm) { return (tcp_state_t *)comm->transport_state; }

static int set_nonblocking(int fd) {
    int flags = fcntl(fd, F_GETFL, 0);
    return flags < 0 ? -1 : fcntl(fd, F_SETFL, flags | O_NONBLOCK);
}

static void tune_socket(int fd) {
    int one = 1;
    /* Small messages (barriers, size exchanges) must not wait for Nagle's timer. */
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
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

static rs_status_t alloc_state(rs_comm_t *comm) {
    tcp_state_t *st = calloc(1, sizeof *st);
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

static rs_status_t tcp_listen(rs_comm_t *comm, const char *bind_host, int *port) {
    RS_CHECK(alloc_state(comm));
    tcp_state_t *st = state_of(comm);
    struct sockaddr_storage ss;
    socklen_t len;
    if (parse_address(bind_host, 0, &ss, &len) != 0)
        return rs_fail(comm, RS_ERR_USAGE, "cannot parse bind address '%s'", bind_host);
    int fd = socket(ss.ss_family, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0)
        return rs_fail(comm, RS_ERR_SYSTEM, "socket(): %s", strerror(errno));
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

/* Wait until fd is ready for `events`, at most until deadline. */
static rs_status_t wait_fd(rs_comm_t *comm, int fd, short events, double deadline,
                           const char *what, int peer) {
    for (;;) {
        double left = deadline - rs_now();
        if (left <= 0)
            return rs_fail(comm, RS_ERR_TIMEOUT, "rank %d: timed out %s rank %d (host %s)",
                           comm->rank, what, peer, rs_peer_host(comm, peer));
        struct pollfd p = {.fd = fd, .events = events};
        int r = poll(&p, 1, (int)(left * 1000) + 1);
        if (r > 0)
            return RS_OK;
        if (r < 0 && errno != EINTR)
            return rs_fail(comm, RS_ERR_SYSTEM, "poll(): %s", strerror(errno));
    }
}

/* Blocking-with-deadline exact transfer, used only during connection setup. */
static rs_status_t transfer_exact(rs_comm_t *comm, int fd, void *buf, size_t len, int sending,
                                  double deadline, int peer) {
    size_t done = 0;
    while (done < len) {
        ssize_t r = sending ? send(fd, (char *)buf + done, len - done, MSG_NOSIGNAL)
                            : recv(fd, (char *)buf + done, len - done, 0);
        if (r > 0) {
            done += (size_t)r;
            continue;
        }
        if (r == 0)
            return rs_fail(comm, RS_ERR_COMM, "rank %d: connection closed during setup "
                           "(peer rank %d)", comm->rank, peer);
        if (errno == EINTR)
            continue;
        if (errno != EAGAIN && errno != EWOULDBLOCK)
            return rs_fail(comm, RS_ERR_COMM, "rank %d: setup with rank %d (host %s): %s",
                           comm->rank, peer, rs_peer_host(comm, peer), strerror(errno));
        RS_CHECK(wait_fd(comm, fd, sending ? POLLOUT : POLLIN, deadline,
                         "exchanging greetings with", peer));
    }
    return RS_OK;
}

static rs_status_t connect_one(rs_comm_t *comm, int peer, const char *host, int port,
                               uint64_t token, double deadline) {
    struct sockaddr_storage ss;
    socklen_t len;
    if (parse_address(host, port, &ss, &len) != 0)
        return rs_fail(comm, RS_ERR_USAGE, "rank %d: cannot parse address '%s' of rank %d",
                       comm->rank, host, peer);
    for (;;) {
        int fd = socket(ss.ss_family, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
        if (fd < 0)
            return rs_fail(comm, RS_ERR_SYSTEM, "socket(): %s", strerror(errno));
        state_of(comm)->fds[peer] = fd;
        tune_socket(fd);
        int r = connect(fd, (struct sockaddr *)&ss, len);
        if (r != 0 && errno == EINPROGRESS) {
            RS_CHECK(wait_fd(comm, fd, POLLOUT, deadline, "connecting to", peer));
            int err = 0;
            socklen_t elen = sizeof err;
            getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &elen);
            r = err ? -1 : 0;
            errno = err;
        }
        if (r == 0) {
            hello_t hello = {HELLO_MAGIC, token, comm->rank};
            return transfer_exact(comm, fd, &hello, sizeof hello, 1, deadline, peer);
        }
        int err = errno;
        close(fd);
        state_of(comm)->fds[peer] = -1;
        if (rs_now() >= deadline || (err != ECONNREFUSED && err != ETIMEDOUT))
            return rs_fail(comm, RS_ERR_COMM, "rank %d: cannot connect to rank %d at %s:%d "
                           "(host %s): %s", comm->rank, peer, host, port,
                           rs_peer_host(comm, peer), strerror(err));
        usleep(20000); /* the peer may still be starting to listen */
    }
}

/* Accept one connection and check its greeting; strays are closed and ignored. */
static rs_status_t accept_one(rs_comm_t *comm, uint64_t token, double deadline) {
    tcp_state_t *st = state_of(comm);
    for (;;) {
        RS_CHECK(wait_fd(comm, st->listen_fd, POLLIN, deadline,
                         "waiting for a connection from a higher", comm->rank + 1));
        int fd = accept4(st->listen_fd, NULL, NULL, SOCK_CLOEXEC | SOCK_NONBLOCK);
        if (fd < 0)
            continue;
        tune_socket(fd);
        hello_t hello;
        if (transfer_exact(comm, fd, &hello, sizeof hello, 0, deadline, -1) != RS_OK ||
            hello.magic != HELLO_MAGIC || hello.token != token || hello.rank <= comm->rank ||
            hello.rank >= comm->size || st->fds[hello.rank] >= 0) {
            close(fd);
            comm->broken = 0; /* a bad stray does not break the communicator */
            continue;
        }
        st->fds[hello.rank] = fd;
        return RS_OK;
    }
}

static rs_status_t tcp_connect(rs_comm_t *comm, const char **hosts, const int *ports) {
    uint64_t token = comm->job_id; /* (placeholder until the challenge-response lands) */
    double deadline = rs_now() + comm->setup_seconds;
    /* Lower ranks accept, higher ranks connect: every pair gets exactly one socket. The
     * listen backlog lets all connects finish before anyone accepts. */
    for (int peer = 0; peer < comm->rank; peer++)
        RS_CHECK(connect_one(comm, peer, hosts[peer], ports[peer], token, deadline));
    for (int n = comm->rank + 1; n < comm->size; n++)
        RS_CHECK(accept_one(comm, token, deadline));
    tcp_state_t *st = state_of(comm);
    close(st->listen_fd);
    st->listen_fd = -1;
    for (int peer = 0; peer < comm->size; peer++)
        if (peer != comm->rank && set_nonblocking(st->fds[peer]) != 0)
            return rs_fail(comm, RS_ERR_SYSTEM, "fcntl(): %s", strerror(errno));
    return RS_OK;
}

/* A rank that aborts after seeing a failure elsewhere sends this one urgent (out-of-band)
 * byte on every connection before closing, so that its peers can tell it apart from the
 * rank that really died and name the right one. The in-band stream is untouched. */
#define ABORT_NOTICE 'A'

static int sent_abort_notice(rs_comm_t *comm, int peer) {
    tcp_state_t *st = state_of(comm);
    char c = 0;
    if (!st->aborted[peer] && recv(st->fds[peer], &c, 1, MSG_OOB | MSG_DONTWAIT) == 1)
        st->aborted[peer] = c == ABORT_NOTICE;
    return st->aborted[peer];
}

static int has_hung_up(int fd) {
    struct pollfd p = {.fd = fd, .events = POLLRDHUP};
    return poll(&p, 1, 0) == 1 && (p.revents & (POLLRDHUP | POLLHUP | POLLERR));
}

int rs_tcp_peer_state(rs_comm_t *comm, int peer) {
    tcp_state_t *st = state_of(comm);
    if (!st || st->fds[peer] < 0)
        return RS_PEER_LOST;
    if (__atomic_load_n(&st->aborted[peer], __ATOMIC_RELAXED))
        return RS_PEER_ABORTED; /* latched by the engine thread */
    struct pollfd p = {.fd = st->fds[peer], .events = POLLRDHUP | POLLPRI};
    if (poll(&p, 1, 0) != 1)
        return RS_PEER_UP;
    if (p.revents & POLLPRI)
        return RS_PEER_ABORTED;
    return p.revents & (POLLRDHUP | POLLHUP | POLLERR) ? RS_PEER_LOST : RS_PEER_UP;
}

/* How long to wait for the dead peer's hangup after an aborting peer's: a killed process's
 * sockets are closed one by one, and a fast survivor may abort before the last one is. */
#define LOST_PEER_WAIT_SECONDS 0.5

/* The first peer, other than `except`, whose connection is gone without an abort notice. */
static int find_lost_peer(rs_comm_t *comm, int except) {
    tcp_state_t *st = state_of(comm);
    double deadline = rs_now() + LOST_PEER_WAIT_SECONDS;
    do {
        for (int i = 0; i < comm->size; i++)
            if (i != comm->rank && i != except && st->fds[i] >= 0 && has_hung_up(st->fds[i]) &&
                !sent_abort_notice(comm, i))
                return i;
        usleep(5000);
    } while (rs_now() < deadline);
    return -1;
}

static rs_status_t peer_error(rs_comm_t *comm, int peer, const char *what) {
    if (sent_abort_notice(comm, peer)) {
        int lost = find_lost_peer(comm, peer);
        if (lost >= 0)
            return rs_fail(comm, RS_ERR_COMM, "rank %d: connection to rank %d (host %s) was "
                           "lost (peer process gone?); rank %d aborted after it", comm->rank,
                           lost, rs_peer_host(comm, lost), peer);
        return rs_fail(comm, RS_ERR_COMM, "rank %d: rank %d (host %s) aborted after a failure "
                       "elsewhere in the job", comm->rank, peer, rs_peer_host(comm, peer));
    }
    return rs_fail(comm, RS_ERR_COMM, "rank %d: connection to rank %d (host %s) %s",
                   comm->rank, peer, rs_peer_host(comm, peer), what);
}

static rs_status_t tcp_send(rs_comm_t *comm, int peer, const char *buf, size_t len,
                            size_t *done) {
    int fd = state_of(comm)->fds[peer];
    while (*done < len) {
        ssize_t r = send(fd, buf + *done, len - *done, MSG_NOSIGNAL | MSG_DONTWAIT);
        if (r > 0) {
            *done += (size_t)r;
            continue;
        }
        if (r < 0 && errno == EINTR)
            continue;
        if (r < 0 && (errno == EAGAIN || errno == EWOULDBLOCK))
            return RS_OK;
        return peer_error(comm, peer, r < 0 ? strerror(errno) : "closed");
    }
    return RS_OK;
}

static rs_status_t tcp_recv(rs_comm_t *comm, int peer, char *buf, size_t len, size_t *done) {
    int fd = state_of(comm)->fds[peer];
    sent_abort_notice(comm, peer); /* the stream may stand at a notice's mark already */
    while (*done < len) {
        ssize_t r = recv(fd, buf + *done, len - *done, MSG_DONTWAIT);
        if (r > 0) {
            *done += (size_t)r;
            /* A short read may have stopped at an abort notice's mark; reading past the
             * mark would discard the notice, so latch it now. */
            if (*done < len)
                sent_abort_notice(comm, peer);
            continue;
        }
        if (r == 0)
            return peer_error(comm, peer, "was closed (peer process gone?)");
        if (errno == EINTR)
            continue;
        if (errno == EAGAIN || errno == EWOULDBLOCK)
            return RS_OK;
        return peer_error(comm, peer, strerror(errno));
    }
    return RS_OK;
}

/* Poll the requested directions, and every other peer for a hangup, so that a rank
 * that died anywhere in the job is noticed by every survivor. */
static rs_status_t tcp_poll(rs_comm_t *comm, rs_wait_t *waits, int n, int timeout_ms,
                            int *lost_peer) {
    tcp_state_t *st = state_of(comm);
    int size = comm->size;
    struct pollfd *pfds = st->pfds; /* one per peer, then the wake fd */
    for (int i = 0; i < size; i++) {
        pfds[i].fd = (i == comm->rank || st->hung_up[i]) ? -1 : st->fds[i];
        pfds[i].events = POLLRDHUP | POLLPRI;
        pfds[i].revents = 0;
    }
    pfds[size] = (struct pollfd){.fd = -1};
    for (int k = 0; k < n; k++) {
        struct pollfd *p = waits[k].peer == RS_WAKE_PEER ? &pfds[size] : &pfds[waits[k].peer];
        p->fd = waits[k].peer == RS_WAKE_PEER ? comm->wake_fd : st->fds[waits[k].peer];
        p->events |= (waits[k].want_read ? POLLIN : 0) | (waits[k].want_write ? POLLOUT : 0);
    }
    int r = poll(pfds, (nfds_t)size + 1, timeout_ms);
    if (r < 0 && errno != EINTR)
        return rs_fail(comm, RS_ERR_SYSTEM, "poll(): %s", strerror(errno));
    for (int k = 0; k < n; k++) {
        struct pollfd *p = waits[k].peer == RS_WAKE_PEER ? &pfds[size] : &pfds[waits[k].peer];
        waits[k].ready = r > 0 && (p->revents & (p->events | POLLHUP | POLLERR)) != 0;
    }
    *lost_peer = -1;
    int aborting_peer = -1;
    for (int i = 0; r > 0 && i < size; i++) {
        short ev = pfds[i].revents;
        if (ev & POLLPRI)
            sent_abort_notice(comm, i); /* latch it before in-band reads pass its mark */
        if (!(ev & (POLLRDHUP | POLLHUP | POLLERR)) || (pfds[i].events & (POLLIN | POLLOUT)))
            continue; /* peers in the exchange report errors through send/recv */
        st->hung_up[i] = 1;
        if (sent_abort_notice(comm, i))
            aborting_peer = aborting_peer < 0 ? i : aborting_peer;
        else if (*lost_peer < 0)
            *lost_peer = i;
    }
    if (*lost_peer < 0)
        *lost_peer = aborting_peer; /* name a dead peer in preference to one that gave up */
    return RS_OK;
}

static void tcp_abort(rs_comm_t *comm) {
    tcp_state_t *st = state_of(comm);
    char notice = ABORT_NOTICE;
    for (int i = 0; i < comm->size; i++) {
        if (st->fds[i] < 0)
            continue;
        send(st->fds[i], &notice, 1, MSG_OOB | MSG_NOSIGNAL | MSG_DONTWAIT);
        shutdown(st->fds[i], SHUT_RDWR);
    }
}

static void tcp_close(rs_comm_t *comm) {
    tcp_state_t *st = state_of(comm);
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

const rs_transport_t rs_tcp_transport = {
    .name = "tcp",
    .listen = tcp_listen,
    .connect = tcp_connect,
    .send = tcp_send,
    .recv = tcp_recv,
    .poll = tcp_poll,
    .abort = tcp_abort,
    .close = tcp_close,
    .peer_aborted = sent_abort_notice,
};
