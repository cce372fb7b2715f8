/* Where the ranks sit (topology.c): the rs_topology_t of comm.h, built once from the
 * host names when the communicator connects. */
#ifndef RINGSYNC_TOPOLOGY_H
#define RINGSYNC_TOPOLOGY_H

#include "comm.h"

rs_status_t rs_topology_build(rs_comm_t *comm);
void rs_topology_free(rs_topology_t *t);
/* Flag (flags[peer] = 1) the peers this rank's algorithms exchange with whatever the
 * data: connected at setup, the others on first use. Symmetric: each of my partners
 * flags me. After rs_topology_build. */
rs_status_t rs_topology_partners(rs_comm_t *comm, unsigned char *flags);

#endif
