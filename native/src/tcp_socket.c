/* The TCP transport's sockets: the connection table's allocation, listening, the options
 * every connection gets, and the words for running out of descriptors (tcp_socket.h).
 * tcp_setup.c makes the connections, transport_tcp.c moves bytes over them. */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include "tcp_socket.h"
#include "util.h"

/* Without a timeout, a host that stops answering is given this long (see tune_socket). */
#define UNANSWERED_HOST_SECONDS 120.0

/* A peer whose host or network went away sends no FIN: without help the kernel retries
 * for many minutes and the wait looks like a slow peer. The kernel gives up on data left
 * unacknowledged for half the timeout (TCP_USER_TIMEOUT), and probes an idle connection
 * after a third of it (keepalive: answered by the peer's kernel even when its process is
 * busy, so a slow peer is never mistaken for a lost one, and no timeout is needed). */
void rs_tcp_tune_socket(const rs_comm_t *comm, int fd) {
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
int rs_tcp_parse_address(const char *host, int port, struct sockaddr_storage *ss,
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
rs_status_t rs_tcp_fail_socket(rs_comm_t *comm, const char *call, int err) {
    if (err != EMFILE && err != ENFILE)
        return rs_fail(comm, RS_ERR_SYSTEM, "rank %d: %s: %s", comm->rank, call, strerror(err));
    struct rlimit lim = {RLIM_INFINITY, RLIM_INFINITY};
    getrlimit(RLIMIT_NOFILE, &lim);
    char soft[32], hard[32];
    limit_text(lim.rlim_cur, soft, sizeof soft);
    limit_text(lim.rlim_max, hard, sizeof hard);
    return rs_fail(comm, RS_ERR_SYSTEM, "rank %d: %s: %s: out of file descriptors. In a job of "
                   "%d ranks each keeps a socket to each peer it exchanges with (up to %d), plus its "
                   "own files; "
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
    size_t n = (size_t)comm->size;
    st->listen_fd = -1;
    st->fds = malloc(n * sizeof *st->fds);
    st->connected = malloc(n * sizeof *st->connected);
    st->hung_up = calloc(n, sizeof *st->hung_up);
    st->aborted = calloc(n, sizeof *st->aborted);
    st->reported = malloc(n * sizeof *st->reported);
    st->slot = malloc(n * sizeof *st->slot);
    /* the connected peers, the wake fd, waits on peers that hung up, the handshakes */
    st->pfds = malloc((2 * n + 1 + (size_t)(1 + RS_TCP_MAX_GREETINGS + comm->size)) * sizeof *st->pfds);
    if (!st->fds || !st->connected || !st->hung_up || !st->aborted || !st->reported ||
        !st->slot || !st->pfds)
        return rs_fail(comm, RS_ERR_NOMEM, "out of memory");
    for (size_t i = 0; i < n; i++) {
        st->fds[i] = -1;
        st->reported[i] = -2;
        st->slot[i] = -1;
    }
    return RS_OK;
}

rs_status_t rs_tcp_listen(rs_comm_t *comm, const char *bind_host, int *port) {
    RS_CHECK(alloc_state(comm));
    rs_tcp_state_t *st = rs_tcp_state(comm);
    struct sockaddr_storage ss;
    socklen_t len;
    if (rs_tcp_parse_address(bind_host, 0, &ss, &len) != 0)
        return rs_fail(comm, RS_ERR_USAGE, "cannot parse bind address '%s'", bind_host);
    /* Non-blocking: setup accepts every waiting client until none is left. */
    int fd = socket(ss.ss_family, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
    if (fd < 0)
        return rs_tcp_fail_socket(comm, "socket()", errno);
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
