/* TCP transport: one non-blocking stream socket to each peer this rank exchanges with
 * (the algorithms' partners from setup on, any other peer from its first use). This file
 * is the data path (send, recv, poll, abort notices, telling a lost peer from one that
 * gave up); tcp_setup.c makes the connections, and moves them on inside this poll. A rank
 * learns of a death among peers it has no connection to through those it has: the first
 * to notice aborts, and its abort notice names the lost rank. */
#define _GNU_SOURCE
#include <errno.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
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

/* A rank that aborts after seeing a failure elsewhere sends one urgent (out-of-band) byte
 * on every connection before closing (rs_tcp_send_abort), so that its peers can tell it
 * apart from the rank that really died, and name the right one. */
static int sent_abort_notice(rs_comm_t *comm, int peer) {
    rs_tcp_state_t *st = rs_tcp_state(comm);
    char c = 0;
    /* aborted[] is read by any thread (tcp_peer_state): atomic on both sides. */
    if (!__atomic_load_n(&st->aborted[peer], __ATOMIC_ACQUIRE) &&
        recv(st->fds[peer], &c, 1, MSG_OOB | MSG_DONTWAIT) == 1)
        __atomic_store_n(&st->aborted[peer], rs_tcp_is_abort_notice(c), __ATOMIC_RELEASE);
    return __atomic_load_n(&st->aborted[peer], __ATOMIC_ACQUIRE);
}

static int at_abort_mark(rs_comm_t *comm, int peer, int fd) {
    int at = 0;
    return sent_abort_notice(comm, peer) && ioctl(fd, SIOCATMARK, &at) == 0 && at;
}

/* How long an aborted peer's report (the bytes after its urgent mark) may take to come. */
#define REPORT_WAIT_SECONDS 0.3

/* Read the report that follows an aborted peer's notice: skip the stream up to the urgent
 * mark (what was in flight: the communicator fails anyway), then read REPORT_BYTES. */
static int read_report(rs_comm_t *comm, int peer) {
    int fd = rs_tcp_state(comm)->fds[peer];
    unsigned char report[REPORT_BYTES];
    char skip[4096];
    size_t got = 0;
    double deadline = rs_now() + REPORT_WAIT_SECONDS;
    while (got < sizeof report && rs_now() < deadline) {
        int at_mark = 0;
        if (ioctl(fd, SIOCATMARK, &at_mark) != 0)
            return -1;
        ssize_t r = at_mark || got ? recv(fd, report + got, sizeof report - got, MSG_DONTWAIT)
                                   : recv(fd, skip, sizeof skip, MSG_DONTWAIT);
        if (r == 0 || (r < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR))
            return -1;
        if (r > 0 && (at_mark || got))
            got += (size_t)r;
        else if (r < 0) {
            struct pollfd p = {.fd = fd, .events = POLLIN};
            poll(&p, 1, 10);
        }
    }
    return got == sizeof report ? rs_tcp_parse_report(comm, report, peer) : -1;
}

/* The table's reported_lost: read once, then remembered. */
static int tcp_reported_lost(rs_comm_t *comm, int peer) {
    rs_tcp_state_t *st = rs_tcp_state(comm);
    if (st->fds[peer] < 0 || !sent_abort_notice(comm, peer))
        return -1;
    if (st->reported[peer] == -2)
        st->reported[peer] = read_report(comm, peer);
    return st->reported[peer];
}

static int has_hung_up(int fd) {
    struct pollfd p = {.fd = fd, .events = POLLRDHUP};
    return poll(&p, 1, 0) == 1 && (p.revents & (POLLRDHUP | POLLHUP | POLLERR));
}

static int tcp_peer_state(rs_comm_t *comm, int peer) {
    rs_tcp_state_t *st = rs_tcp_state(comm);
    if (!st)
        return RS_PEER_LOST;
    int fd = rs_tcp_fd(st, peer);
    if (fd < 0)
        return RS_PEER_UP; /* no connection yet: nothing to tell from */
    if (__atomic_load_n(&st->aborted[peer], __ATOMIC_ACQUIRE))
        return RS_PEER_ABORTED; /* latched by the engine thread */
    struct pollfd p = {.fd = fd, .events = POLLRDHUP | POLLPRI};
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
        for (int k = 0; k < st->nconnected; k++) {
            int i = st->connected[k];
            if (i == except || sent_abort_notice(comm, i))
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
    char text[RS_ERROR_LEN];
    if (sent_abort_notice(comm, peer)) {
        int silent = 0, lost = find_lost_peer(comm, peer, &silent);
        if (lost >= 0) {
            rs_note_lost(comm, lost);
            return rs_fail(comm, RS_ERR_COMM, "rank %d: connection to rank %d (host %s) %s; "
                           "rank %d aborted after it", comm->rank, lost,
                           rs_peer_host(comm, lost), silent ? UNANSWERED_TEXT
                           : "was lost (peer process gone?)", peer);
        }
        int reported = tcp_reported_lost(comm, peer);
        if (reported >= 0)
            rs_note_lost(comm, reported);
        rs_peer_gone_text(comm, peer, 1, reported, text, sizeof text);
        return rs_fail(comm, RS_ERR_COMM, "%s", text);
    }
    int fd = rs_tcp_state(comm)->fds[peer];
    if (err == ETIMEDOUT || err == EHOSTUNREACH || (fd >= 0 && unanswered(fd)))
        what = UNANSWERED_TEXT;
    rs_note_lost(comm, peer);
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

static rs_status_t tcp_reach(rs_comm_t *comm, int peer, int *linked) {
    return rs_tcp_reach(comm, peer, linked);
}

static rs_status_t tcp_send(rs_comm_t *comm, int peer, const char *buf, size_t len,
                            size_t *done) {
    int linked;
    RS_CHECK(rs_tcp_reach(comm, peer, &linked));
    if (!linked)
        return RS_OK; /* its connection is on the way: the poll moves it on */
    size_t before = *done;
    rs_status_t st = push(comm, peer, buf, len, done);
    rs_count_sent(comm, RS_VIA_TCP, peer, (int64_t)(*done - before));
    return st;
}

static rs_status_t tcp_recv(rs_comm_t *comm, int peer, char *buf, size_t len, size_t *done) {
    int linked;
    RS_CHECK(rs_tcp_reach(comm, peer, &linked));
    if (!linked)
        return RS_OK;
    int fd = rs_tcp_state(comm)->fds[peer];
    while (*done < len) {
        /* The data sent before an abort notice is read (reads stop at its mark); past the
         * mark come its report's bytes, not data. */
        if (at_abort_mark(comm, peer, fd))
            return peer_error(comm, peer, "aborted", 0);
        ssize_t r;
        RS_RETRY_EINTR(r, recv(fd, buf + *done, len - *done, MSG_DONTWAIT));
        if (r > 0) {
            *done += (size_t)r;
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

/* The poll set: every connected peer (for a hangup or an abort notice, so that a death
 * among them is noticed whatever we wait for), then the waits' extra entries (the wake
 * fd, peers that hung up already), then the handshakes in progress. */
static int watch_peers(rs_comm_t *comm, rs_wait_t *waits, int n, int *wake_at) {
    rs_tcp_state_t *st = rs_tcp_state(comm);
    struct pollfd *pfds = st->pfds;
    int count = 0;
    *wake_at = -1;
    for (int k = 0; k < st->nconnected; k++) {
        int i = st->connected[k];
        if (st->hung_up[i])
            continue;
        st->slot[i] = count;
        pfds[count++] = (struct pollfd){.fd = st->fds[i], .events = POLLRDHUP | POLLPRI};
    }
    for (int k = 0; k < n; k++) {
        int peer = waits[k].peer;
        if (peer != RS_WAKE_PEER && st->fds[peer] < 0)
            continue; /* connecting: its handshake is watched */
        int *at = peer == RS_WAKE_PEER ? wake_at : &st->slot[peer];
        if (*at < 0) {
            *at = count;
            pfds[count++] = (struct pollfd){.fd = peer == RS_WAKE_PEER ? comm->wake_fd
                                                                        : st->fds[peer]};
        }
        struct pollfd *p = &pfds[*at];
        p->events |= (waits[k].want_read ? POLLIN : 0) | (waits[k].want_write ? POLLOUT : 0);
    }
    return count;
}

/* Which waits can progress: their entry's events, or (a peer that was connecting) its
 * connection now exists. Every peer's slot is reset for the next poll. */
static void mark_ready(rs_comm_t *comm, rs_wait_t *waits, int n, int wake_at, int polled) {
    rs_tcp_state_t *st = rs_tcp_state(comm);
    for (int k = 0; k < n; k++) {
        int peer = waits[k].peer;
        int at = peer == RS_WAKE_PEER ? wake_at : peer >= 0 ? st->slot[peer] : -1;
        const struct pollfd *p = at >= 0 ? &st->pfds[at] : NULL;
        waits[k].ready = p ? polled && (p->revents & (p->events | POLLHUP | POLLERR)) != 0
                           : st->fds[peer] >= 0;
    }
}

static void clear_slots(rs_comm_t *comm, rs_wait_t *waits, int n) {
    rs_tcp_state_t *st = rs_tcp_state(comm);
    for (int k = 0; k < st->nconnected; k++)
        st->slot[st->connected[k]] = -1;
    for (int k = 0; k < n; k++)
        if (waits[k].peer >= 0)
            st->slot[waits[k].peer] = -1;
}

/* A connected peer that hung up outside the waits: the first that did not abort, else
 * the first that did (a dead peer is named in preference to one that gave up). */
static int find_hangup(rs_comm_t *comm, int upto) {
    rs_tcp_state_t *st = rs_tcp_state(comm);
    int lost = -1, aborting = -1;
    for (int k = 0; k < st->nconnected; k++) {
        int i = st->connected[k], at = st->slot[i];
        if (at < 0 || at >= upto)
            continue;
        short ev = st->pfds[at].revents;
        if (ev & POLLPRI)
            sent_abort_notice(comm, i); /* latch it before in-band reads pass its mark */
        if (!(ev & (POLLRDHUP | POLLHUP | POLLERR)) || (st->pfds[at].events & (POLLIN | POLLOUT)))
            continue; /* peers in the exchange report errors through send/recv */
        st->hung_up[i] = 1;
        if (sent_abort_notice(comm, i))
            aborting = aborting < 0 ? i : aborting;
        else if (lost < 0)
            lost = i;
    }
    return lost >= 0 ? lost : aborting;
}

static rs_status_t tcp_poll(rs_comm_t *comm, rs_wait_t *waits, int n, int timeout_ms,
                            int *lost_peer) {
    rs_tcp_state_t *st = rs_tcp_state(comm);
    *lost_peer = -1;
    for (int k = 0; k < n; k++) {
        int linked = 1;
        if (waits[k].peer != RS_WAKE_PEER)
            RS_CHECK(rs_tcp_reach(comm, waits[k].peer, &linked));
    }
    int wake_at;
    int peers = watch_peers(comm, waits, n, &wake_at);
    double now = rs_now(), wake = now + timeout_ms / 1000.0;
    int total = rs_tcp_links_watch(comm, st->pfds, peers, &wake);
    int ms = wake <= now ? 0 : (int)((wake - now) * 1000.0) + 1;
    int r = poll(st->pfds, (nfds_t)total, ms < timeout_ms ? ms : timeout_ms);
    rs_status_t status = RS_OK;
    if (r < 0 && errno != EINTR)
        status = rs_fail(comm, RS_ERR_SYSTEM, "poll(): %s", strerror(errno));
    else {
        *lost_peer = r > 0 ? find_hangup(comm, peers) : -1;
        status = rs_tcp_links_advance(comm, st->pfds, peers, r > 0 ? total : peers);
        mark_ready(comm, waits, n, wake_at, r > 0);
    }
    clear_slots(comm, waits, n);
    return status;
}

static void tcp_abort(rs_comm_t *comm) {
    rs_tcp_state_t *st = rs_tcp_state(comm);
    __atomic_store_n(&st->aborting, 1, __ATOMIC_SEQ_CST);
    int n = __atomic_load_n(&st->nconnected, __ATOMIC_SEQ_CST);
    for (int k = 0; k < n; k++)
        rs_tcp_send_abort(comm, rs_tcp_fd(st, st->connected[k]));
}

static void tcp_close(rs_comm_t *comm) { rs_tcp_release(comm); }

/* TCP shares no memory between ranks. */
static void *tcp_shared_area(rs_comm_t *comm, int rank, int area) { return NULL; }

const rs_transport_t rs_tcp_transport = {
    .name = "tcp",
    .listen = rs_tcp_listen,
    .connect = rs_tcp_connect,
    .reach = tcp_reach,
    .send = tcp_send,
    .recv = tcp_recv,
    .poll = tcp_poll,
    .abort = tcp_abort,
    .close = tcp_close,
    .peer_aborted = sent_abort_notice,
    .reported_lost = tcp_reported_lost,
    .peer_state = tcp_peer_state,
    .shared_area = tcp_shared_area,
};

