/* The shared-memory transport (transport_shm.c): same-host peers through rings in shared
 * memory, the others through the transport below it (TCP). Only comm.c, which picks
 * transports, includes this. */
#ifndef RINGSYNC_TRANSPORT_SHM_H
#define RINGSYNC_TRANSPORT_SHM_H

#include "transport.h"

extern const rs_transport_t rs_shm_transport;
/* After TCP has connected: map shared memory with the same-host peers and switch to the
 * shm transport. The host's ranks agree: if any cannot get its segment, all stay on TCP
 * (auto: one warning each on stderr; required: an RS_ERR_SYSTEM error on each). Required
 * also means every peer must be on this host. */
rs_status_t rs_shm_setup(rs_comm_t *comm, int required);

#endif
