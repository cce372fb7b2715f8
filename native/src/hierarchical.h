/* The hierarchical allreduce (hierarchical.c), over the topology's groups. */
#ifndef RINGSYNC_HIERARCHICAL_H
#define RINGSYNC_HIERARCHICAL_H

#include <stddef.h>

#include "comm.h"
#include "reduce.h"

/* Whether an allreduce of `bytes` goes hierarchical: the topology fits, and the mode is
 * on, or auto with bytes at least hierarchical_min_bytes. */
int rs_hierarchical_chosen(const rs_comm_t *comm, size_t bytes);
/* In place, over the topology's groups (only where topology.hierarchical). */
rs_status_t rs_hierarchical_allreduce(rs_comm_t *comm, char *buf, size_t count, size_t elem,
                                      rs_reduce_fn fn);

#endif
