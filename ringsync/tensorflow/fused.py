"""The gradient reduction of DistributedGradientTape and the Keras DistributedOptimizer:
many dense tensors, one host round trip per step.

TensorFlow flattens the tensors of each dtype into one contiguous buffer (tf.concat, in
the graph, at memory speed); a single tf.numpy_function hands the buffers to the core,
which reduces each with one blocking allreduce (on the same-host lane when every rank is
on this host) into fresh aligned memory that TensorFlow then adopts without a copy; and
TensorFlow splits the result back (tf.split + reshape). The per-tensor work happens once,
when the graph is traced; a step runs one Python call whatever the number of tensors.

Names. The buffer of dtype D of a call named `name` travels as `name.D`. The core sees
one buffer, so it can only compare element counts: before the buffers move, every rank
posts a fingerprint of its tensors' dtypes and shapes (a tiny allreduce), so ranks whose
tensors differ fail together with a message naming them, and the next call works.

Order. The lane matches blocking calls in call order, and TensorFlow may run independent
ops in any order: the fused calls of one graph therefore run in trace order (each waits
for the one traced before it), which is the same on every rank.

Adasum (whose coefficients belong to each tensor) and tensors whose shapes are known only
when the graph runs keep the per-tensor grouped allreduce; IndexedSlices are gathered, as
allreduce does."""
import sys
import weakref
import zlib

import numpy as np
import tensorflow as tf

from ringsync import autotune
from ringsync.ops import ReduceOp
from ringsync._adapters import check_differentiable, grad_name
from ringsync._context import resolve
from ringsync.errors import MismatchError, RingsyncError

from .compression import Compression
from .mpi_ops import (PS, _allreduce_sparse, _grouped_allreduce, _tensorflow_error,
                      in_build_order)

_ALIGN = 64  # TensorFlow adopts a returned array without a copy when it is this aligned
_last_fused = weakref.WeakKeyDictionary()  # graph -> its latest fused op (see Order)
_POOL = 3  # result arrays kept per buffer name for reuse (see _free_output)
_outputs = {}  # buffer name -> result arrays TensorFlow may still hold


def fused_allreduce(tensors, name, op, prescale_factor=1.0, postscale_factor=1.0,
                    process_set=PS, compression=Compression.none):
    """tensors reduced over process_set as one unit (None stays None). name: the same on
    every rank (the gradient reducer's)."""
    prescale, postscale = prescale_factor, postscale_factor
    out = list(tensors)
    dense = []
    for i, t in enumerate(tensors):
        if isinstance(t, tf.IndexedSlices):
            out[i] = _allreduce_sparse(t, op, prescale, postscale, f"{name}.sparse{i}",
                                       process_set)
        elif t is not None:
            dense.append(i)
    if not dense:
        return out
    wires = [compression.compress(tf.convert_to_tensor(out[i])) for i in dense]
    ts = [w for w, _ in wires]
    if all(t.shape.is_fully_defined() for t in ts):
        reduced = _differentiable(ts, op, prescale, postscale, name, process_set)
    else:  # sizes known only at run time: no static split
        reduced = _grouped_allreduce(ts, op, prescale, postscale, name, process_set)
    for i, r, (_, ctx) in zip(dense, reduced, wires):
        out[i] = compression.decompress(r, ctx)
    return out


def _differentiable(ts, op, prescale, postscale, name, process_set):
    """The fused reduction with the gradient of a grouped allreduce (Horovod's rule: the
    same reduction of the incoming gradients)."""

    @tf.custom_gradient
    def fn(*xs):
        def grad(*dys):
            check_differentiable(op, "tensorflow.grouped_allreduce")
            dys = [tf.convert_to_tensor(d) for d in dys]
            return _fused(dys, op, prescale, postscale, grad_name(name), process_set)
        return _fused(list(xs), op, prescale, postscale, name, process_set), grad

    return list(fn(*ts))


def _fused(ts, op, prescale, postscale, name, process_set):
    """ts (dense, static shapes) reduced: one buffer per dtype, one host round trip."""
    buckets = {}  # dtype -> indices into ts, dtypes in order of first appearance
    for i, t in enumerate(ts):
        buckets.setdefault(t.dtype, []).append(i)
    flats = [_flatten([ts[i] for i in idx]) for idx in buckets.values()]
    layout = [(t.dtype.name, tuple(t.shape.as_list())) for t in ts]
    reduce = _buffers_reducer(process_set, name, layout, op, prescale, postscale,
                              [f"{name}.{dtype.name}" for dtype in buckets])
    reduced = _call(reduce, flats)
    out = [None] * len(ts)
    for idx, buffer in zip(buckets.values(), reduced):
        parts = tf.split(buffer, [ts[i].shape.num_elements() for i in idx]) \
            if len(idx) > 1 else [buffer]
        for i, part in zip(idx, parts):
            out[i] = tf.reshape(part, ts[i].shape)
    return out


def _flatten(ts):
    flat = [tf.reshape(t, [-1]) for t in ts]
    return flat[0] if len(flat) == 1 else tf.concat(flat, 0)


def _call(reduce, flats):
    """reduce(*numpy buffers) -> reduced buffers: now (eagerly) or as one numpy_function
    that runs after the graph's previous one (see Order)."""
    if tf.executing_eagerly():
        return [tf.convert_to_tensor(r) for r in reduce(*[f.numpy() for f in flats])]
    # (in a tf.function, after the function's previous fused call; in a TF1-style graph,
    # after its previous collective of any kind)
    out = in_build_order(lambda: tf.numpy_function(
        reduce, flats, [f.dtype for f in flats], stateful=True,
        name="ringsync_fused_allreduce"), _last_fused if tf.inside_function() else None)
    for y, f in zip(out, flats):
        y.set_shape(f.shape)
    return out


def _buffers_reducer(process_set, name, layout, op, prescale, postscale, names):
    """The step's host function: check that every rank reduces the same layout, then
    reduce each buffer with one blocking allreduce."""
    fingerprint = zlib.crc32(repr(layout).encode())

    def reduce(*buffers):
        try:
            comm = resolve(process_set)  # (at run time: elastic recovery may replace it)
            _check_layout(comm, name, fingerprint, layout)
            reduced = [_reduced(comm, b, op, prescale, postscale, n)
                       for b, n in zip(buffers, names)]
            autotune.step(comm)  # (RINGSYNC_AUTOTUNE=1 only: a reduction is a step)
            return reduced
        except RingsyncError as error:
            raise _tensorflow_error(error) from error

    return reduce


def _check_layout(comm, name, fingerprint, layout):
    """Every rank learns every rank's fingerprint (each adds its own at its index)."""
    every = np.zeros(comm.size(), np.int64)
    every[comm.rank()] = fingerprint
    comm.allreduce_(every, op=ReduceOp.SUM, name=f"{name}.layout")
    if (every == fingerprint).all():
        return
    kinds = {}
    for rank, f in enumerate(every.tolist()):
        kinds.setdefault(f, []).append(rank)
    ranks = "; ".join(f"ranks {v} have layout {k:08x}" for k, v in kinds.items())
    raise MismatchError(
        f"ringsync.tensorflow: the {len(layout)} tensors reduced together as '{name}' "
        f"differ between ranks in number, order, dtype or shape ({ranks}); this rank "
        f"({comm.rank()}, layout {fingerprint:08x}) has (dtype, shape): {layout}")


def _reduced(comm, buffer, op, prescale, postscale, name):
    """buffer reduced into memory TensorFlow does not hold (buffer may be TensorFlow's: it
    is only read)."""
    out = _free_output(name, buffer)
    # (allreduce() allocates its own result, which TensorFlow would copy: unaligned)
    return comm.allreduce_into(buffer, out, op, prescale, postscale, name)


def _free_output(name, like):
    """An aligned array like `like` that nothing but this module refers to: one handed to
    TensorFlow at an earlier step and released since (TensorFlow keeps a reference to
    every array it adopts until its tensor is gone), or a new one. Reusing them spares a
    fresh buffer's page faults at every step, which cost more than the reduction itself."""
    pool = _outputs.setdefault(name, [])
    for out in pool:
        # references: the pool's, the loop's, getrefcount's argument
        if sys.getrefcount(out) <= 3 and out.shape == like.shape and out.dtype == like.dtype:
            return out
    out = _aligned_empty(like)
    pool.append(out)
    del pool[:-_POOL]  # (older ones go with TensorFlow's last reference to them)
    return out


def _aligned_empty(like):
    raw = np.empty(like.nbytes + _ALIGN, np.uint8)
    start = -raw.ctypes.data % _ALIGN
    return raw[start:start + like.nbytes].view(like.dtype)
