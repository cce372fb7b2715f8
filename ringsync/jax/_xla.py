"""allreduce inside compiled JAX programs as an XLA FFI custom call of the native core
(native/src/xla_ffi.c): no Python runs per call.

Order. Ranks match the calls in the order they run them (blocking calls, on the same-host
lane or through the engine), so every rank must run a program's calls in one order. XLA
runs independent operations of a program concurrently, in any order, unless something
orders them: here each call takes a slice of the previous call's result (in the same
trace) as an extra operand it does not read, so the calls of a trace form a chain that
XLA must follow (`Chain`). The alternative, declaring the calls side-effecting, would
order them too, but JAX then dispatches the whole program through its slow path (about
12 us per argument of the jitted function, measured: 3 ms per step for 256 parameters);
RINGSYNC_JAX_ORDERED=1 chooses it anyway. Calls in different traces (a nested jitted
function, a loop body) are not chained to each other: unnamed ones get names from their
place in their trace, and the handler refuses to run two calls of one process set at
once (which only an unordered pair can cause), so such a pair fails loudly rather than
meeting the wrong peer.

A call names its process set by a slot number; the handler finds
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
from jax.extend.core import get_opaque_trace_state

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


def token_of(results):
    """What a call waiting for `results` takes as an operand: a first element of each (a
    dependency, not a copy)."""
    return jnp.concatenate([r.reshape(-1)[:1].astype(jnp.float32) for r in results])


class _Link:
    """One trace's chain: the operand its next call waits for, and its calls so far."""

    def __init__(self, state):
        self.state, self.after, self.count, self.base = state, None, 0, None


class Chain(threading.local):
    """For each trace being built on this thread (the few newest), its last custom call,
    as the operand the next call of the same trace waits for, and how many calls it has
    (the names of unnamed calls). A trace JAX builds inside another (a custom_vjp's, a
    loop body's) has its own chain, unless the caller hands it a link (link_into)."""

    KEPT = 16  # traces remembered (nested ones are few; old ones are finished)

    def __init__(self):
        self.links = []

    def _here(self) -> _Link:
        state = get_opaque_trace_state()
        for link in self.links:
            if link.state == state:
                return link
        self.links = [_Link(state)] + self.links[:self.KEPT - 1]
        return self.links[0]

    def take(self, name):
        """(the operand to wait for or None, the call's name) for a call in this trace."""
        here = self._here()
        if name is None:
            name = f"{here.base}.{here.count}" if here.base else f"jax.{here.count}"
        here.count += 1
        return here.after, name

    def give(self, results):
        """results (arrays) come from this trace's newest call: the next one waits for
        them."""
        self._here().after = token_of(results)

    def link_into(self, after, base):
        """Inside a trace built for one call site (a custom_vjp's primal, or its gradient
        in the backward pass): its calls wait for `after` too (an argument of the trace,
        or what the forward pass saved) and are named after `base`."""
        here = self._here()
        here.after = after if here.after is None else jnp.concatenate([here.after, after])
        here.base, here.count = base, 0


CHAIN = Chain()
ORDERED = os.environ.get("RINGSYNC_JAX_ORDERED", "0") == "1"


def allreduce(x, op, prescale, postscale, name, process_set, kept=False):
    """x reduced over process_set's ranks, as a custom call of the program being traced,
    after the trace's previous call. kept: declared side-effecting, so that XLA keeps it
    even if nothing uses its result (a rank that drops it must still take part)."""
    return allreduce_many([x], op, prescale, postscale, name, process_set, kept)[0]


def allreduce_many(xs, op, prescale, postscale, name, process_set, kept=False):
    """Each of xs reduced over process_set's ranks, one after another, by one custom call
    (after the trace's previous call), each result in its operand's memory where XLA can
    give it (input_output_aliases: no copy out)."""
    shapes = [x.shape for x in xs]
    xs = [x.reshape(-1) if x.ndim > 8 else x for x in xs]
    after, name = CHAIN.take(name)
    call = jax.ffi.ffi_call(TARGET, [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in xs],
                            has_side_effect=ORDERED or kept,
                            input_output_aliases={i: i for i in range(len(xs))})
    operands = list(xs) if after is None else list(xs) + [after]
    out = call(*operands, slot=np.int64(SLOTS.slot(process_set)),
               op=np.int64(_OP_CODES[ReduceOp(op)]), prescale=np.float64(prescale),
               postscale=np.float64(postscale), name=name)
    CHAIN.give(out)
    return [o.reshape(shape) for o, shape in zip(out, shapes)]
