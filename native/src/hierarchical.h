/* The hierarchical collectives (hierarchical.c), over the topology's groups. */
#ifndef RINGSYNC_HIERARCHICAL_H
#define RINGSYNC_HIERARCHICAL_H

#include <stddef.h>

#include "comm.h"
#include "reduce.h"
#include "ring.h"

/* Whether a collective of `bytes` goes hierarchical: the topology fits, and the mode is
 * on, or auto with bytes at least hierarchical_min_bytes. */
int rs_hierarchical_chosen(const rs_comm_t *comm, size_t bytes);
/* In place, over the topology's groups (only where topology.hierarchical). */
rs_status_t rs_hierarchical_allreduce(rs_comm_t *comm, char *buf, size_t count, size_t elem,
                                      rs_reduce_fn fn);
/* In place: `all` holds every rank's block of buf (bytes and offsets, multiples of
 * `unit`), this rank's already there; afterwards buf holds every rank's. */
rs_status_t rs_hierarchical_allgatherv(rs_comm_t *comm, char *buf, const rs_blocks_t *all,
                                       size_t unit);
/* Afterwards this rank's block of buf (in `all`) holds the reduction of that block over
 * every rank; the others hold partial sums. The input is src (each part copied into buf
 * as the pipeline reaches it), or buf itself where src is NULL. */
rs_status_t rs_hierarchical_reduce_scatter(rs_comm_t *comm, const char *src, char *buf,
                                           const rs_blocks_t *all, size_t elem,
                                           rs_reduce_fn fn);

#endif
