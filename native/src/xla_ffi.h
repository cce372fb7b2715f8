/* The XLA FFI handler's slots (xla_ffi.c); the public functions are in ringsync.h. */
#ifndef RS_XLA_FFI_H
#define RS_XLA_FFI_H

#define RS_XLA_SLOTS 64 /* process sets that compiled JAX programs may name */

/* Defined by the cffi module (ringsync/jax/_xla.py attaches it): bind `slot` to its
 * process set's current engine; returns 0 when there is none. Takes the GIL. */
int rs_xla_refill(int slot);

#endif
