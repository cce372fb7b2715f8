/* TCP transport: one non-blocking stream socket to every peer (a full mesh, so that
 * alltoall and barrier need no relays and every rank notices any peer's death). This file
 * is the data path (send, recv, poll, abort notices, telling a lost peer from one that
 * gave up); tcp_setup.c makes the connections. */
#define _GNU_SOURCE
#include <errno.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "tcp_setup.h"
#include "transport_tcp.h"
#include "util.h"

/* Whether the peer's host has stopped answering: data or keepalive probes outstanding
 * without acknowledgement, or the kernel gave up on the connection already (the timeouts
 * that tcp_setup.c's tune_socket gave every socket). */
static int unanswered(int fd) {
    struct tcp_info ti;
    socklen_t len = sizeof ti;
    if (getsockopt(fd, IPPROTO_TCP, TCP_INFO, &ti, &len) != 0)
        return 0;
    /* (one retransmission may be congestion; two timeouts in a row without an ACK are not;
     * CLOSE_WAIT: the peer's FIN came, so its host answers: a closed peer, not a lost host) */
    return (ti.tcpi_state != TCP_ESTABLISHED && ti.tcpi_state != TCP_CLOSE_WAIT) ||
           ti.tcpi_retransmits >= 2 || ti.tcpi_probes > 0;
}

/* A rank that aborts after seeing a failure elsewhere sends this one urgent (out-of-band)
 * byte on every connection before closing, so that its peers can tell it apart from the
 * rank that really died and name the right one. The in-band stream is untouched. */
#define ABORT_NOTICE 'A'

static int sent_abort_notice(rs_comm_t *comm, int peer) {
    rs_tcp_state_t *st = rs_tcp_state(comm);
    char c = 0;
    /* aborted[] is read by any thread (tcp_peer_state): atomic on both sides. */
    if (!__atomic_load_n(&st->aborted[peer], __ATOMIC_ACQUIRE) &&
        recv(st->fds[peer], &c, 1, MSG_OOB | MSG_DONTWAIT) == 1)
        __atomic_store_n(&st->aborted[peer], c == ABORT_NOTICE, __ATOMIC_RELEASE);
    return __atomic_load_n(&st->aborted[peer], __ATOMIC_ACQUIRE);
}

static int has_hung_up(int fd) {
    struct pollfd p = {.fd = fd, .events = POLLRDHUP};
    return poll(&p, 1, 0) == 1 && (p.revents & (POLLRDHUP | POLLHUP | POLLERR));
}

static int tcp_peer_state(rs_comm_t *comm, int peer) {
    rs_tcp_state_t *st = rs_tcp_state(comm);
    if (!st || st->fds[peer] < 0)
        return RS_PEER_LOST;
    if (__atomic_load_n(&st->aborted[peer], __ATOMIC_ACQUIRE))
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

/* The first peer, other than `except`, whose connection is gone without an abort notice,
 * or (with *silent set) whose host stopped answering. */
static int find_lost_peer(rs_comm_t *comm, int except, int *silent) {
    rs_tcp_state_t *st = rs_tcp_state(comm);
    double deadline = rs_now() + LOST_PEER_WAIT_SECONDS;
    do {
        for (int i = 0; i < comm->size; i++) {
            if (i == comm->rank || i == except || st->fds[i] < 0 || sent_abort_notice(comm, i))
                continue;
            *silent = unanswered(st->fds[i]);
            if (*silent || has_hung_up(st->fds[i]))
                return i;
        }
        usleep(5000);
    } while (rs_now() < deadline);
    return -1;
}

static const char *UNANSWERED_TEXT = "does not answer: no acknowledgement from its host "
                                     "(host or network down?)";

/* err: the errno of the failed call (0: the peer closed). */
static rs_status_t peer_error(rs_comm_t *comm, int peer, const char *what, int err) {
    if (sent_abort_notice(comm, peer)) {
        int silent = 0, lost = find_lost_peer(comm, peer, &silent);
        if (lost >= 0)
            return rs_fail(comm, RS_ERR_COMM, "rank %d: connection to rank %d (host %s) %s; "
                           "rank %d aborted after it", comm->rank, lost,
                           rs_peer_host(comm, lost), silent ? UNANSWERED_TEXT
                           : "was lost (peer process gone?)", peer);
        char text[RS_ERROR_LEN];
        rs_peer_gone_text(comm, peer, 1, text, sizeof text);
        return rs_fail(comm, RS_ERR_COMM, "%s", text);
    }
    int fd = rs_tcp_state(comm)->fds[peer];
    if (err == ETIMEDOUT || err == EHOSTUNREACH || (fd >= 0 && unanswered(fd)))
        what = UNANSWERED_TEXT;
    return rs_fail(comm, RS_ERR_COMM, "rank %d: connection to rank %d (host %s) %s",
                   comm->rank, peer, rs_peer_host(comm, peer), what);
}

static rs_status_t push(rs_comm_t *comm, int peer, const char *buf, size_t len, size_t *done) {
    int fd = rs_tcp_state(comm)->fds[peer];
    while (*done < len) {
        ssize_t r;
        RS_RETRY_EINTR(r, send(fd, buf + *done, len - *done, MSG_NOSIGNAL | MSG_DONTWAIT));
        if (r > 0) {
            *done += (size_t)r;
            continue;
        }
        if (r < 0 && (errno == EAGAIN || errno == EWOULDBLOCK))
            return RS_OK;
        return peer_error(comm, peer, r < 0 ? strerror(errno) : "closed", r < 0 ? errno : 0);
    }
    return RS_OK;
}

static rs_status_t tcp_send(rs_comm_t *comm, int peer, const char *buf, size_t len,
                            size_t *done) {
    size_t before = *done;
    rs_status_t st = push(comm, peer, buf, len, done);
    rs_count_sent(comm, RS_VIA_TCP, peer, (int64_t)(*done - before));
    return st;
}

static rs_status_t tcp_recv(rs_comm_t *comm, int peer, char *buf, size_t len, size_t *done) {
    int fd = rs_tcp_state(comm)->fds[peer];
    sent_abort_notice(comm, peer); /* the stream may stand at a notice's mark already */
    while (*done < len) {
        ssize_t r;
        RS_RETRY_EINTR(r, recv(fd, buf + *done, len - *done, MSG_DONTWAIT));
        if (r > 0) {
            *done += (size_t)r;
            /* A short read may have stopped at an abort notice's mark; reading past the
             * mark would discard the notice, so latch it now. */
            if (*done < len)
                sent_abort_notice(comm, peer);
            continue;
        }
        if (r == 0)
            return peer_error(comm, peer, "was closed (peer process gone?)", 0);
        if (errno == EAGAIN || errno == EWOULDBLOCK)
            return RS_OK;
        return peer_error(comm, peer, strerror(errno), errno);
    }
    return RS_OK;
}

/* Poll the requested directions, and every other peer for a hangup, so that a rank
 * that died anywhere in the job is noticed by every survivor. */
static rs_status_t tcp_poll(rs_comm_t *comm, rs_wait_t *waits, int n, int timeout_ms,
                            int *lost_peer) {
    rs_tcp_state_t *st = rs_tcp_state(comm);
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
    rs_tcp_state_t *st = rs_tcp_state(comm);
    char notice = ABORT_NOTICE;
    for (int i = 0; i < comm->size; i++) {
        if (st->fds[i] < 0)
            continue;
        send(st->fds[i], &notice, 1, MSG_OOB | MSG_NOSIGNAL | MSG_DONTWAIT);
        shutdown(st->fds[i], SHUT_RDWR);
    }
}

static void tcp_close(rs_comm_t *comm) { rs_tcp_release(comm); }

/* TCP shares no memory between ranks. */
static void *tcp_shared_area(rs_comm_t *comm, int rank, int area) { return NULL; }

const rs_transport_t rs_tcp_transport = {
    .name = "tcp",
    .listen = rs_tcp_listen,
    .connect = rs_tcp_connect,
    .send = tcp_send,
    .recv = tcp_recv,
    .poll = tcp_poll,
    .abort = tcp_abort,
    .close = tcp_close,
    .peer_aborted = sent_abort_notice,
    .peer_state = tcp_peer_state,
    .shared_area = tcp_shared_area,
};

