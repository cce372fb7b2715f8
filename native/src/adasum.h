/* The Adasum allreduce (adasum.c). */
#ifndef RINGSYNC_ADASUM_H
#define RINGSYNC_ADASUM_H

#include <stddef.h>

#include "comm.h"

/* Adasum allreduce of `count` elements of buf, in place: RS_ERR_USAGE unless dtype is
 * floating point. Scale factors are the caller's. */
rs_status_t rs_adasum_allreduce(rs_comm_t *comm, void *buf, size_t count, rs_dtype_t dtype);

#endif
