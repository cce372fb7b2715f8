/* Latency-bound collectives in ceil(log2 N) rounds (doubling.c): the small allreduce by
 * recursive doubling, and the small broadcast down a binomial tree. */
#ifndef RINGSYNC_DOUBLING_H
#define RINGSYNC_DOUBLING_H

#include <stddef.h>

#include "comm.h"
#include "reduce.h"

/* Allreduce `count` elements in place by recursive doubling: log2 rounds of whole-buffer
 * swaps among the largest power of two of ranks, the ranks past it folded in before and
 * served after. Every rank ends with the same bits (each pair folds the lower group's
 * partial first). count * elem is checked by the caller. */
rs_status_t rs_doubling_allreduce(rs_comm_t *comm, char *buf, size_t count, size_t elem,
                                  rs_reduce_fn fn);
/* Broadcast `bytes` from root down a binomial tree: ceil(log2 N) rounds, each rank
 * receiving once and sending to at most log2 N children. */
rs_status_t rs_binomial_broadcast(rs_comm_t *comm, void *buf, size_t bytes, int root);

#endif
