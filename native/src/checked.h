/* Sizes from users and peers, checked before use: a product or sum that would overflow
 * is refused, never wrapped. Everything here is pure arithmetic (no state, no I/O). */
#ifndef RINGSYNC_CHECKED_H
#define RINGSYNC_CHECKED_H

#include <stddef.h>
#include <stdint.h>

#include "status.h"

/* The largest tensor or total the core handles: every byte count fits int64_t, so sums of
 * a few of them and signed offsets cannot overflow either. */
#define RS_MAX_BYTES ((int64_t)1 << 60)
#define RS_MAX_NAME_LEN 4000 /* longest tensor name (bytes, without the NUL) */

/* *out = a * b or a + b; 0 on success, -1 when the result would exceed RS_MAX_BYTES or
 * an operand is negative. */
int rs_mul_checked(int64_t a, int64_t b, int64_t *out);
int rs_add_checked(int64_t a, int64_t b, int64_t *out);

/* What every rank must agree on for a tensor (allgather / alltoall: all but shape[0]). */
typedef struct {
    int32_t kind;
    int32_t dtype;
    int32_t op;
    int32_t root;
    int32_t ndim;
    int32_t reserved;
    double prescale;
    double postscale;
    int64_t shape[RS_MAX_DIMS];
} rs_meta_t;

/* RS_OK when m is well formed for a communicator of `size` ranks (a known kind, a dtype
 * and op it supports, a root in range, finite scale factors, at most RS_MAX_DIMS
 * dimensions, none negative, at most RS_MAX_BYTES in all); else RS_ERR_USAGE, with the
 * reason in *why (the caller's record: it words the error for its context). On success
 * *elements and *bytes (either may be NULL) receive the tensor's sizes. */
rs_status_t rs_meta_check(const rs_meta_t *m, int size, rs_error_t *why, int64_t *elements,
                          int64_t *bytes);

/* The metadata that stands for a refused call of `kind` (RS_KIND_REFUSED; see ringsync.h):
 * the same on every rank that refuses it. */
rs_meta_t rs_refusal_meta(int kind);

#endif
