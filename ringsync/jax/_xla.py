"""allreduce inside compiled JAX programs as an XLA FFI custom call of the native core
(native/src/xla_ffi.c): no Python runs per call.

The custom call has a side effect, so XLA neither drops nor merges it; XLA:CPU runs a
program's side-effecting calls one after another, in the order of the compiled schedule,
which is the same on every rank that compiled the same program, so ranks match them in
order (blocking calls on the same-host lane, or through the engine across hosts), as
they match eager calls. A call names its process set by a slot number; the handler finds
the slot's engine in a table that this module fills the first time a slot is used after
its communicator changed (init, an elastic recovery), through the cffi callback below,
and that the core empties before destroying an engine.

Set RINGSYNC_JAX_FFI=0 to run every traced collective as an ordered io_callback instead
(benchmarks/jax_step_rate.py compares the two)."""
import os
import threading

import jax
import jax.numpy as jnp
import numpy as np

from ringsync._context import resolve
from ringsync._core import bind_xla_slot
from ringsync._native import ffi, lib
from ringsync.errors import UsageError
from ringsync.ops import ReduceOp

TARGET = "ringsync_allreduce"
_SLOTS = 64  # (RS_XLA_SLOTS in native/src/xla_ffi.h)
_OP_CODES = {ReduceOp.SUM: lib.RS_OP_SUM, ReduceOp.AVERAGE: lib.RS_OP_AVERAGE,
             ReduceOp.MIN: lib.RS_OP_MIN, ReduceOp.MAX: lib.RS_OP_MAX,
             ReduceOp.PRODUCT: lib.RS_OP_PRODUCT}
_DTYPES = {np.dtype(n) for n in ["uint8", "int8", "uint16", "int16", "int32", "int64",
                                  "float16", "float32", "float64"]} | {jnp.dtype(jnp.bfloat16)}


class _Slots:
    """Process set (kept alive here, so that its id stays its own) -> slot number."""

    def __init__(self):
        self.lock = threading.Lock()
        self.by_key = {}      # id(process_set) -> slot
        self.process_sets = []  # slot -> process_set

    def slot(self, process_set) -> int:
        with self.lock:
            found = self.by_key.get(id(process_set))
            if found is None:
                if len(self.process_sets) >= _SLOTS:
                    raise UsageError(f"ringsync.jax: more than {_SLOTS} process sets in "
                                     f"compiled programs")
                found = self.by_key[id(process_set)] = len(self.process_sets)
                self.process_sets.append(process_set)
            return found


SLOTS = _Slots()


@ffi.def_extern(error=0)
def rs_xla_refill(slot):
    """xla_ffi.c found `slot` empty: bind it to its process set's communicator now."""
    try:
        bind_xla_slot(resolve(SLOTS.process_sets[slot]), slot)
        return 1
    except Exception:  # (the handler then fails the call: no communicator)
        return 0


def _register() -> bool:
    if os.environ.get("RINGSYNC_JAX_FFI", "1") == "0":
        return False
    address = int(ffi.cast("uintptr_t", lib.rs_xla_allreduce_handler()))
    jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(address), platform="cpu")
    return True


FFI_AVAILABLE = _register()
ENABLED = FFI_AVAILABLE  # (a benchmark turns it off to time the io_callback path beside it)


def usable(dtype, op) -> bool:
    """Whether a traced allreduce of this dtype and op runs as the custom call (on CPU;
    Adasum and other dtypes take the io_callback)."""
    return ENABLED and jnp.dtype(dtype) in _DTYPES and ReduceOp(op) in _OP_CODES and \
        jax.default_backend() == "cpu"


def allreduce(x, op, prescale, postscale, name, process_set):
    """x reduced over process_set's ranks, as a custom call of the program being traced."""
    if x.ndim > 8:
        x_shape = x.shape
        return allreduce(x.reshape(-1), op, prescale, postscale, name, process_set) \
            .reshape(x_shape)
    call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct(x.shape, x.dtype),
                            has_side_effect=True)
    return call(x, slot=np.int64(SLOTS.slot(process_set)),
                op=np.int64(_OP_CODES[ReduceOp(op)]), prescale=np.float64(prescale),
                postscale=np.float64(postscale), name=name or "jax.allreduce")
