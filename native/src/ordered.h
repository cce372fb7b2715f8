/* Reductions in rank order (ordered.c): every element of the result is
 * x_0 (+) x_1 (+) ... (+) x_{N-1}, folded left to right in that order, whatever the buffer's
 * size and however it is cut into blocks. The one-round allreduce of small buffers, and
 * the deterministic mode's (RINGSYNC_DETERMINISTIC) allreduce and reduce-scatter. */
#ifndef RINGSYNC_ORDERED_H
#define RINGSYNC_ORDERED_H

#include <stddef.h>

#include "comm.h"
#include "reduce.h"
#include "ring.h" /* rs_blocks_t */

/* In place, in one round: rank p is sent block p of every rank's buf (all transfers at
 * once), and folds the size copies of its block in rank order, as they arrive, into block
 * `rank` of buf. The blocks must not overlap. */
rs_status_t rs_ordered_reduce_scatter(rs_comm_t *comm, char *buf, const rs_blocks_t *b,
                                      size_t elem, rs_reduce_fn fn);
/* In place, in one round: every rank's whole buffer to every peer, each rank folding all
 * of them (latency: one exchange; N-1 times the bytes received). */
rs_status_t rs_ordered_one_round(rs_comm_t *comm, char *buf, size_t count, size_t elem,
                                 rs_reduce_fn fn);
/* In place: buf in even blocks, reduce-scattered in one round, then ring-allgathered. Each
 * rank sends (N-1)/N of the buffer twice, as around the ring. */
rs_status_t rs_ordered_allreduce(rs_comm_t *comm, char *buf, size_t count, size_t elem,
                                 rs_reduce_fn fn);

#endif
