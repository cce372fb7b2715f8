/* The TCP transport's connection table and sockets (tcp_socket.c): what the handshakes
 * (tcp_setup.c) and the data path (transport_tcp.c) share. */
#ifndef RINGSYNC_TCP_SOCKET_H
#define RINGSYNC_TCP_SOCKET_H

#include <poll.h>
#include <sys/socket.h>

#include "transport.h"

/* Incoming clients in progress at once; a flood of them evicts the oldest first. */
#define RS_TCP_MAX_GREETINGS 64

typedef struct rs_links rs_links_t; /* the handshakes in progress (tcp_setup.c) */

/* The connection table, the transport state of a communicator on TCP. The engine thread
 * (or, before an engine exists, the creating thread) connects peers; any thread reads
 * fds[] and the connected list (abort, peer_state), so both are stored and read
 * atomically, and a peer once connected stays so until the table is released. */
typedef struct {
    int listen_fd; /* open for the communicator's life: a peer may connect on first use */
    int *fds;      /* fds[peer]; -1 for self and unconnected peers */
    int *connected; /* the connected peers, in the order they connected */
    int nconnected; /* entries of connected[] (appended after the fd is stored) */
    int *hung_up; /* a peer that closed while outside an exchange was already reported */
    int *aborted; /* the peer sent an abort notice: it is alive but gave up */
    int *reported; /* per peer, the rank its abort notice named lost (-1: none, -2: unread) */
    int aborting;  /* this rank has sent its abort notices: later connections get one too */
    struct pollfd *pfds; /* the data path's poll set */
    int *slot;           /* the data path's poll: each peer's entry in pfds, or -1 */
    rs_links_t *links;
} rs_tcp_state_t;

static inline rs_tcp_state_t *rs_tcp_state(rs_comm_t *comm) {
    return (rs_tcp_state_t *)comm->transport_state;
}

/* The socket to `peer`, or -1: from any thread. */
static inline int rs_tcp_fd(rs_tcp_state_t *st, int peer) {
    return __atomic_load_n(&st->fds[peer], __ATOMIC_ACQUIRE);
}

/* The table's listen (see rs_transport_t): allocates the table, then listens. */
rs_status_t rs_tcp_listen(rs_comm_t *comm, const char *bind_host, int *port);
/* The options every connection gets: no Nagle, and how soon a silent host counts as lost. */
void rs_tcp_tune_socket(const rs_comm_t *comm, int fd);
/* A numeric IPv4/IPv6 address ("" = any IPv4 address); 0, or -1 if it does not parse. */
int rs_tcp_parse_address(const char *host, int port, struct sockaddr_storage *ss,
                         socklen_t *len);
/* socket() or accept() failed with err: out of descriptors gets words naming the limits. */
rs_status_t rs_tcp_fail_socket(rs_comm_t *comm, const char *call, int err);

#endif
