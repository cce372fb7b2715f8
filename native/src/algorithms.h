/* What the collective algorithms (algorithms.c) lend the layers above them beyond the
 * public collectives of ringsync.h: the scaling that ends a reduction. */
#ifndef RINGSYNC_ALGORITHMS_H
#define RINGSYNC_ALGORITHMS_H

#include <stddef.h>

#include "comm.h"

/* Average's division and the caller's postscale, after a reduction. */
rs_status_t rs_finish_scale(rs_comm_t *comm, void *buf, size_t count, rs_dtype_t dtype,
                            rs_op_t op, double postscale);
/* rs_scale_local, with a failure (a dtype it cannot scale) recorded on the communicator. */
rs_status_t rs_scale(rs_comm_t *comm, void *buf, size_t count, rs_dtype_t dtype,
                     double factor);

#endif
