/* The TCP transport (transport_tcp.c, its connections made by tcp_setup.c). Only comm.c,
 * which picks transports, includes this. */
#ifndef RINGSYNC_TRANSPORT_TCP_H
#define RINGSYNC_TRANSPORT_TCP_H

#include "transport.h"

extern const rs_transport_t rs_tcp_transport;

#endif
