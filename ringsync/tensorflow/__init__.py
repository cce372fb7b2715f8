"""ringsync for TensorFlow 2: collectives on tf.Tensor / tf.Variable, in eager mode and
inside tf.function, with gradients; DistributedGradientTape; broadcast_variables.

Eager tensors reach the core through numpy views of their buffers (no copy in); results
come back as new tensors (one copy out). Inside tf.function each collective is a
tf.py_function, which TensorFlow runs in the calling process; XLA cannot compile it (see
the README). The Keras 3 optimizer wrapper and callbacks are in ringsync.tensorflow.keras.
"""
import itertools
import zlib

import numpy as np
import tensorflow as tf

import ringsync as _rs
from ringsync import (Average, Max, Min, Product, ReduceOp, Sum, barrier, cross_rank,
                      cross_size, init, is_initialized, join, local_rank, local_size, rank,
                      shutdown, size, start_timeline, stop_timeline)
from ringsync.errors import (CommunicationError, HorovodInternalError, HostsUpdatedInterrupt,
                             RingsyncError, UsageError)
from ringsync._adapters import CastCompressor, NoneCompressor, check_differentiable, grad_name
from ringsync.objects import allgather_object, broadcast_object

_trace_names = itertools.count()  # names fixed when a graph is traced (see _name)


def _name(name, what):
    """Inside a graph, ops may run concurrently in any order, so call-order names would
    differ between ranks; name them when traced instead (tracing order is the same)."""
    if name is not None or tf.executing_eagerly():
        return name
    return f"tf.{what}.{next(_trace_names)}"


def _host(t) -> np.ndarray:
    return t.numpy() if hasattr(t, "numpy") else np.asarray(t)


def _run(fn, tensors, out_dtypes, what):
    """Run fn(*numpy arrays, blocking=eager) -> array(s) now (eager) or as a py_function
    (graph); see _collective."""
    if tf.executing_eagerly():
        out = fn(*[_host(t) for t in tensors], blocking=True)
        return [tf.convert_to_tensor(o) for o in out] if isinstance(out, list) else \
            tf.convert_to_tensor(out)

    def call(*args):
        return fn(*[_host(a) for a in args], blocking=False)

    return tf.py_function(call, list(tensors), out_dtypes, name=f"ringsync_{what}")


def _collective(method, blocking, process_set, *args):
    """Run one of the Communicator's _async methods to completion. blocking: the call was
    made eagerly, in program order, so it is a blocking call like the numpy API's (on one
    host it takes the same-host lane). Inside a graph TensorFlow may run several
    py_functions at once, in a different order on each rank: those go to the engine, which
    matches them by name. process_set, in every function here: the Communicator to use
    (default: the one init() made)."""
    comm = _rs._comm(process_set)
    return comm.synchronize(getattr(comm, method)(*args, _blocking=blocking))


def allreduce(tensor, op=Average, prescale_factor=1.0, postscale_factor=1.0, name=None,
              process_set=None):
    """tensor reduced over all ranks. Differentiable for Sum and Average."""
    x = tf.convert_to_tensor(tensor)
    name = _name(name, "allreduce")

    def reduce(t, n):
        y = _run(lambda a, blocking: _collective("allreduce_async", blocking, process_set, a, op,
                                                 prescale_factor, postscale_factor, n), [t],
                 t.dtype, "allreduce")
        y.set_shape(t.shape)
        return y

    @tf.custom_gradient
    def fn(t):
        def grad(dy):
            check_differentiable(op, "tensorflow.allreduce")
            return reduce(tf.convert_to_tensor(dy), grad_name(name))
        return reduce(t, name), grad

    return fn(x)


def grouped_allreduce(tensors, op=Average, prescale_factor=1.0, postscale_factor=1.0, name=None,
                      process_set=None):
    """A list of tensors reduced as one unit (one py_function inside a graph)."""
    xs = [tf.convert_to_tensor(t) for t in tensors]
    if not xs:
        return []
    name = _name(name, "grouped_allreduce")
    out = _run(lambda *arrays, blocking: list(_collective(
                   "grouped_allreduce_async", blocking, process_set, list(arrays), op,
                   prescale_factor, postscale_factor, name)),
               xs, [x.dtype for x in xs], "grouped_allreduce")
    for y, x in zip(out, xs):
        y.set_shape(x.shape)
    return list(out)


def allgather(tensor, name=None, process_set=None):
    """Every rank's tensor concatenated along the first dimension. Differentiable."""
    x = tf.convert_to_tensor(tensor)
    name = _name(name, "allgather")

    def gather(t, n):
        y = _run(lambda a, blocking: _collective("allgather_async", blocking, process_set, a, n),
                 [t], t.dtype, "allgather")
        y.set_shape([None] + t.shape[1:].as_list() if t.shape.rank else [None])
        return y

    @tf.custom_gradient
    def fn(t):
        def grad(dy):
            # Rows per rank are exchanged here, not in the forward pass, so that ranks of
            # other frameworks (or without gradients) run the same collectives forward.
            rows = tf.shape(t, out_type=tf.int64)[0] if t.shape.rank else tf.constant(1, tf.int64)
            counts = gather(tf.reshape(rows, [1]), None if name is None else f"{name}.grad.rows")
            summed = allreduce(tf.convert_to_tensor(dy), Sum, name=grad_name(name),
                               process_set=process_set)
            start = tf.reduce_sum(counts[:_rs._comm(process_set).rank()])
            return tf.reshape(summed[start:start + rows], tf.shape(t))

        return gather(t, name), grad

    return fn(x)


def broadcast(tensor, root_rank, name=None, process_set=None):
    """root_rank's tensor on every rank. Differentiable (the root gets the summed gradient)."""
    x = tf.convert_to_tensor(tensor)
    name = _name(name, "broadcast")

    @tf.custom_gradient
    def fn(t):
        y = _run(lambda a, blocking: _collective("broadcast_async", blocking, process_set, a,
                                                 root_rank, name),
                 [t], t.dtype, "broadcast")
        y.set_shape(t.shape)

        def grad(dy):
            summed = allreduce(tf.convert_to_tensor(dy), Sum, name=grad_name(name),
                               process_set=process_set)
            mine = _rs._comm(process_set).rank() == root_rank
            return summed if mine else tf.zeros_like(summed)

        return y, grad

    return fn(x)


def reducescatter(tensor, op=Average, prescale_factor=1.0, postscale_factor=1.0, name=None,
                  process_set=None):
    x = tf.convert_to_tensor(tensor)
    name = _name(name, "reducescatter")
    y = _run(lambda a, blocking: _collective("reducescatter_async", blocking, process_set, a, op,
                                             prescale_factor, postscale_factor, name), [x],
             x.dtype, "reducescatter")
    y.set_shape([None] + x.shape[1:].as_list())
    return y


def alltoall(tensor, splits=None, name=None, process_set=None):
    """Rows splits[i] go to rank i; returns the received rows (and, with splits, how many
    came from each rank)."""
    x = tf.convert_to_tensor(tensor)
    name = _name(name, "alltoall")
    if splits is None:
        y = _run(lambda a, blocking: _collective("alltoall_async", blocking, process_set, a, None,
                                                 name), [x],
                 x.dtype, "alltoall")
        y.set_shape([None] + x.shape[1:].as_list())
        return y
    s = tf.convert_to_tensor(splits, dtype=tf.int64)
    y, received = _run(lambda a, sp, blocking: list(_collective("alltoall_async", blocking,
                                                                process_set, a, sp, name)),
                       [x, s], [x.dtype, tf.int64], "alltoall")
    y.set_shape([None] + x.shape[1:].as_list())
    received.set_shape([None])
    return y, received


def broadcast_variables(variables, root_rank=0, process_set=None):
    """Assign root_rank's values to every variable, on every rank."""
    for i, v in enumerate(variables):
        v.assign(broadcast(v, root_rank, name=f"broadcast.var.{i}.{v.name}",
                           process_set=process_set))


class _TensorFlowCast(CastCompressor):
    is_floating = staticmethod(lambda t: t.dtype.is_floating)
    cast = staticmethod(tf.cast)


class Compression:
    """Gradient compression on the wire: none, fp16 and bf16 (floating gradients travel as
    float16 / bfloat16 and come back in their own dtype)."""

    none = NoneCompressor

    class fp16(_TensorFlowCast):
        wire_dtype = tf.float16

    class bf16(_TensorFlowCast):
        wire_dtype = tf.bfloat16


def _reduce_gradients(grads, compression, op, predivide, sparse_as_dense, name, process_set=None):
    """Dense gradients reduced as one group; IndexedSlices gathered (or densified)."""
    scale = dict(prescale_factor=1.0 / predivide, postscale_factor=predivide) \
        if ReduceOp(op) == ReduceOp.AVERAGE else {}
    dense, slots, out = [], [], list(grads)
    for i, g in enumerate(grads):
        if g is None:
            continue
        if isinstance(g, tf.IndexedSlices) and not sparse_as_dense:
            out[i] = _reduce_sparse(g, op, f"{name}.{i}", process_set)
            continue
        g = tf.convert_to_tensor(g)
        wire, ctx = compression.compress(g)
        dense.append((wire, ctx))
        slots.append(i)
    reduced = grouped_allreduce([w for w, _ in dense], op=op, name=name,
                                process_set=process_set, **scale)
    for i, (r, (_, ctx)) in zip(slots, zip(reduced, dense)):
        out[i] = compression.decompress(r, ctx)
    return out


def _reduce_sparse(g, op, name, process_set=None):
    """Sparse gradients: every rank's rows, gathered (duplicates add up when applied)."""
    values = allgather(g.values, name=f"{name}.values", process_set=process_set)
    indices = allgather(g.indices, name=f"{name}.indices", process_set=process_set)
    if ReduceOp(op) == ReduceOp.AVERAGE:
        values = values / tf.cast(_rs._comm(process_set).size(), values.dtype)
    return tf.IndexedSlices(values, indices, dense_shape=g.dense_shape)


def _gradients_name(sources) -> str:
    """The same on every rank for the same variables, however many tapes each process
    made before (a rank that replaced a lost one has made fewer), and the same every
    step, so that the negotiation cache recognises it."""
    described = ";".join(f"{getattr(s, 'name', '?')}{tuple(s.shape)}"
                         for s in tf.nest.flatten(sources))
    return f"tape.grads.{zlib.crc32(described.encode()):08x}"


class DistributedGradientTape:
    """Wraps a tf.GradientTape: gradient() returns gradients averaged over all ranks."""

    def __init__(self, tape, compression=Compression.none, op=Average,
                 gradient_predivide_factor=1.0, sparse_as_dense=False, process_set=None):
        if gradient_predivide_factor != 1.0 and ReduceOp(op) != ReduceOp.AVERAGE:
            raise UsageError("gradient_predivide_factor only applies to op=Average")
        self._tape = tape
        self._compression, self._op = compression, op
        self._predivide, self._sparse_as_dense = gradient_predivide_factor, sparse_as_dense
        self._process_set = process_set

    def __getattr__(self, attr):  # watch(), stop_recording(), ... are the tape's own
        return getattr(self._tape, attr)

    def gradient(self, target, sources, output_gradients=None, **kwargs):
        grads = self._tape.gradient(target, sources, output_gradients, **kwargs)
        flat = tf.nest.flatten(grads)
        reduced = _reduce_gradients(flat, self._compression, self._op, self._predivide,
                                    self._sparse_as_dense, _gradients_name(sources),
                                    self._process_set)
        return tf.nest.pack_sequence_as(grads, reduced)


__all__ = [
    "init", "shutdown", "is_initialized", "rank", "size", "local_rank", "local_size",
    "cross_rank", "cross_size", "barrier", "join", "start_timeline", "stop_timeline",
    "allreduce", "grouped_allreduce", "allgather", "broadcast", "reducescatter", "alltoall",
    "broadcast_variables", "broadcast_object", "allgather_object", "DistributedGradientTape",
    "Compression", "Average", "Sum", "Min", "Max", "Product", "ReduceOp", "RingsyncError",
    "UsageError", "CommunicationError", "HorovodInternalError", "HostsUpdatedInterrupt",
]


from . import elastic  # noqa: E402,F401  (hvd.elastic; needs broadcast_variables above)
