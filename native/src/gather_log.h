/* The allgather in ceil(log2 N) rounds (gather_log.c), and the checked size of a gather. */
#ifndef RINGSYNC_GATHER_LOG_H
#define RINGSYNC_GATHER_LOG_H

#include <stddef.h>
#include <stdint.h>

#include "comm.h"

/* Allgatherv in ceil(log2 N) rounds: the same contract as rs_allgatherv, for any N and
 * any counts; rs_allgatherv picks it for gathers up to small_gather_bytes. */
rs_status_t rs_allgatherv_log(rs_comm_t *comm, const void *sendbuf, void *recvbuf,
                              const int64_t *counts, size_t elem_bytes);
/* The total bytes of an allgather's counts, refusing (RS_ERR_USAGE) a negative count or a
 * total past RS_MAX_BYTES (counts may come from peers). */
rs_status_t rs_gather_total(rs_comm_t *comm, const int64_t *counts, size_t elem_bytes,
                            size_t *total);

#endif
