/* Reduction and scaling kernels (reduce.c): element-wise, on local buffers, with no
 * communicator (so they record no words: their callers check dtype and op first, and
 * word what they refuse). The public kernels (rs_reduce_local, rs_scale_local,
 * rs_divide_local, rs_dtype_size) are in ringsync.h. */
#ifndef RINGSYNC_REDUCE_H
#define RINGSYNC_REDUCE_H

#include <stddef.h>

#include "ringsync.h"

/* Average reduces as Sum; the caller scales. */
typedef void (*rs_reduce_fn)(void *inout, const void *in, size_t count);
rs_reduce_fn rs_reduce_kernel(rs_dtype_t dtype, rs_op_t op);
int rs_dtype_valid(int dtype);
int rs_dtype_movable(int dtype); /* valid, or bool (moved, never reduced) */
int rs_dtype_is_integer(rs_dtype_t dtype);
int rs_op_valid(int op);
int rs_dtype_is_float(int dtype);
/* Whether op can reduce dtype (Adasum: floating point only). */
int rs_op_takes_dtype(int op, int dtype);
/* Adasum's arithmetic on one piece of vectors a and b: sums = {dot(a, b), |a|^2, |b|^2}
 * (accumulated in double; float16 / bfloat16 through float); then, with sums over the
 * whole vectors, out = ca*a + cb*b where ca = 1 - dot / (2|a|^2) (1 when |a|^2 is below
 * sqrt(DBL_MIN)) and cb likewise. out may be a or b. RS_ERR_USAGE for other dtypes. */
rs_status_t rs_adasum_dots(const void *a, const void *b, size_t count, rs_dtype_t dtype,
                           double sums[3]);
rs_status_t rs_adasum_combine(void *out, const void *a, const void *b, size_t count,
                              rs_dtype_t dtype, const double sums[3]);

#endif
