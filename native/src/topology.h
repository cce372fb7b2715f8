/* Where the ranks sit (topology.c): the rs_topology_t of comm.h, built once from the
 * host names when the communicator connects. */
#ifndef RINGSYNC_TOPOLOGY_H
#define RINGSYNC_TOPOLOGY_H

#include "comm.h"

rs_status_t rs_topology_build(rs_comm_t *comm);
void rs_topology_free(rs_topology_t *t);

#endif
