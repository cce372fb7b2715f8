/* The TCP transport's connections and how they are made (tcp_setup.c): listening, the
 * authenticated handshake with every peer, and the table of sockets it fills. The data
 * path over them (transport_tcp.c) reaches them through the same table. */
#ifndef RINGSYNC_TCP_SETUP_H
#define RINGSYNC_TCP_SETUP_H

#include <poll.h>

#include "transport.h"

/* The connection table, the transport state of a communicator on TCP. */
typedef struct {
    int listen_fd;
    int *fds; /* fds[peer]; -1 for self and unconnected peers */
    int *hung_up; /* a peer that closed while outside an exchange was already reported */
    int *aborted; /* the peer sent an abort notice: it is alive but gave up */
    struct pollfd *pfds;
} rs_tcp_state_t;

static inline rs_tcp_state_t *rs_tcp_state(rs_comm_t *comm) {
    return (rs_tcp_state_t *)comm->transport_state;
}

/* The table's listen and connect (see rs_transport_t). */
rs_status_t rs_tcp_listen(rs_comm_t *comm, const char *bind_host, int *port);
rs_status_t rs_tcp_connect(rs_comm_t *comm, const char **hosts, const int *ports);
/* Close every socket and free the table (the table's close). */
void rs_tcp_release(rs_comm_t *comm);

#endif
