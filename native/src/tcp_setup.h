/* The TCP transport's connections and how they are made (tcp_setup.c): listening, the
 * authenticated handshake with a peer, and the table of sockets it fills. Connections are
 * made to the peers the algorithms need at setup (comm.c says which), and to any other
 * peer on first use: the data path (transport_tcp.c) asks for one with rs_tcp_reach and
 * moves the handshakes on inside its own poll (rs_tcp_links_watch / _advance). */
#ifndef RINGSYNC_TCP_SETUP_H
#define RINGSYNC_TCP_SETUP_H

#include <poll.h>

#include "tcp_socket.h"

/* The table's connect (see rs_transport_t). */
rs_status_t rs_tcp_connect(rs_comm_t *comm, const char **hosts, const int *ports,
                           const unsigned char *eager);
/* *linked: whether `peer` is connected; if not, start connecting to it unless that is
 * under way (dialling it, or it dialling us). The table's reach. */
rs_status_t rs_tcp_reach(rs_comm_t *comm, int peer, int *linked);
/* Add the listening socket and the handshakes in progress to a poll set from pfds[n]
 * (room for rs_tcp_links_room entries); return the new count, and lower *wake to when a
 * handshake's deadline or a redial comes. */
int rs_tcp_links_watch(rs_comm_t *comm, struct pollfd *pfds, int n, double *wake);
int rs_tcp_links_room(const rs_comm_t *comm);
/* After the poll: move on the handshakes whose entries (pfds[first..n)) have events, and
 * those past a deadline. Fails only for a peer that cannot be reached (lost). */
rs_status_t rs_tcp_links_advance(rs_comm_t *comm, const struct pollfd *pfds, int first, int n);
/* Send the abort notice on a connection and shut it down: an urgent byte, then the
 * report, REPORT_BYTES in band after the urgent mark: the rank comm found lost (or -1). */
#define REPORT_BYTES 8
void rs_tcp_send_abort(rs_comm_t *comm, int fd);
int rs_tcp_is_abort_notice(char c);
/* The lost rank a report from peer `from` names, or -1 (none, or not a valid report). */
int rs_tcp_parse_report(const rs_comm_t *comm, const unsigned char *report, int from);
/* Close every socket and free the table (the table's close). */
void rs_tcp_release(rs_comm_t *comm);

#endif
