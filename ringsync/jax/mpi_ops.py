"""Collectives on JAX arrays with Horovod's names, argument order and defaults, eagerly
and inside `jax.jit` (and `grad`), differentiable where Horovod's torch functions are.

Eager arrays reach the core as numpy views (a CPU array's host buffer); results come back
as new arrays. Traced arrays (inside `jit`, `grad`, `lax.scan`...) become collectives of
the compiled program: allreduce and its grouped and fused forms run as XLA FFI calls of
the native core where it is loaded (ringsync/jax/_xla.py), the others as ordered
`io_callback`s. Either way a program's collectives run in program order, one at a time, on
the thread that runs the program, so ranks that run the same program match them in
order, unnamed, as eager calls are. An eager call first waits for every collective that
earlier dispatched programs still have to run (`jax.effects_barrier`), so the order in
which a rank issues collectives is the order in which they run.

Shapes inside a trace are fixed when it is traced: allgather's first dimension (and
alltoall's splits) must then be the same on every rank, which the call checks at run
time, naming the ranks' values; eagerly they may differ. `vmap` over a collective is
refused: reduce the batched array as a whole instead.

process_set, in every function here: a ProcessSet (global_process_set by default) or a
ringsync Communicator. root_rank is a rank of the job, as in Horovod, also in a set."""
import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import io_callback

from ringsync._adapters import (check_differentiable, checked_on_every_rank, grad_name,
                                resolve_op)
from ringsync._context import resolve
from ringsync.errors import UsageError
from ringsync.ops import ReduceOp
from ringsync.process_sets import global_process_set

from . import _xla
from .compression import Compression

PS = global_process_set  # (short, for the signatures below)
Sum, Average, Adasum = ReduceOp.SUM, ReduceOp.AVERAGE, ReduceOp.ADASUM
Min, Max, Product = ReduceOp.MIN, ReduceOp.MAX, ReduceOp.PRODUCT


# ---------------------------------------------------------------------------- running

def _traced(arrays) -> bool:
    return any(isinstance(a, jax.core.Tracer) for a in arrays)


def _spec(shape, dtype):
    return jax.ShapeDtypeStruct(tuple(shape), jnp.dtype(dtype))


def _exact(out, specs, what):
    """The callback's results as the traced program declared them (a result of another
    shape would be a silently wrong program: say what differs instead)."""
    outs, spec_list = (out, specs) if isinstance(specs, (list, tuple)) else ([out], [specs])
    for o, s in zip(outs, spec_list):
        if tuple(o.shape) != tuple(s.shape):
            raise UsageError(f"ringsync.jax.{what}: inside a traced function the result "
                             f"must have shape {tuple(s.shape)} (fixed when tracing) but "
                             f"the ranks' inputs make it {tuple(o.shape)}: give every rank "
                             f"the same first dimension, or call it eagerly")
    return out


def settle():
    """Wait until the programs dispatched so far have run their collectives, so that an
    eager call comes after them on every rank. A program that failed (a lost peer, a
    mismatch) raises where its results are read; its stale error is no concern here."""
    try:
        jax.effects_barrier()
    except Exception:
        pass


def _run(fn, arrays, specs, what):
    """fn(*numpy arrays) -> numpy array or list of them: now (eager) or, for traced
    arrays, as an ordered callback of the program (specs: the results' shapes)."""
    if _traced(arrays):
        # Ordered among the program's callbacks by JAX; chained after its custom calls
        # (an extra argument the host function drops), as they are to each other.
        after, _ = _xla.CHAIN.take(None)
        after = jnp.zeros(1, jnp.float32) if after is None else after

        def host(*args):
            return _exact(fn(*[np.asarray(a) for a in args[:-1]]), specs, what)

        out = _refusing_vmap(lambda *a: io_callback(host, specs, *a, ordered=True),
                             what)(*arrays, after)
        _xla.CHAIN.give(out if isinstance(out, list) else [out])
        return out
    settle()
    out = fn(*[np.asarray(a) for a in arrays])
    return [jnp.asarray(o) for o in out] if isinstance(out, list) else jnp.asarray(out)


def _refusing_vmap(fn, what):
    """fn, with vmap over it refused in ringsync's words (JAX would say only that an
    ordered callback cannot be batched)."""
    wrapped = jax.custom_batching.custom_vmap(fn)

    @wrapped.def_vmap
    def _rule(axis_size, in_batched, *args):
        raise UsageError(f"ringsync.jax.{what}: vmap over a collective is not supported "
                         f"(each rank would reduce {axis_size} separate arrays in an order "
                         f"the ranks cannot agree on); reduce the batched array as a whole")

    return wrapped


def _comm(process_set):
    return resolve(process_set)


def _arrays(tensors, what):
    out = []
    for i, t in enumerate(tensors):
        if t is None:
            where = f"tensors[{i}]" if len(tensors) > 1 else "tensor"
            raise UsageError(f"ringsync.jax.{what}: {where} is None")
        out.append(t if isinstance(t, (jax.Array, jax.core.Tracer)) else jnp.asarray(t))
    return out


def _differentiable(primal, grad_of, arrays, what):
    """primal(*arrays) as a function whose vjp is grad_of(*cotangents) (a list of arrays
    matching `arrays`); only built where something may differentiate it (traced), and
    refusing vmap. JAX traces primal in a trace of its own: the custom calls in it are
    chained to the caller's trace through an extra argument (see _xla.Chain)."""
    if not _traced(arrays):
        return primal(*arrays)
    after, base = _xla.CHAIN.take(None)
    after = jnp.zeros(1, jnp.float32) if after is None else after

    def linked(link, *xs):
        _xla.CHAIN.link_into(link, base)
        return primal(*xs)

    linked = _refusing_vmap(linked, what)

    @jax.custom_vjp
    def f(link, *xs):
        return linked(link, *xs)

    def fwd(link, *xs):
        out = linked(link, *xs)
        return out, (link.shape, _xla.token_of(out if isinstance(out, list) else [out]))

    def bwd(saved, g):
        # The gradient's collectives come after the forward ones on every rank: they
        # wait for its results, on which their inputs may not depend.
        link_shape, forward = saved
        _xla.CHAIN.link_into(forward, f"{base}.grad")
        return (jnp.zeros(link_shape, jnp.float32), *grad_of(g))

    f.defvjp(fwd, bwd)
    out = f(after, *arrays)
    _xla.CHAIN.give(out if isinstance(out, list) else [out])
    return out


# ---------------------------------------------------------------------------- allreduce

def _reduce_one(x, op, prescale, postscale, name, process_set, kept=False):
    """kept: the call must run even where this rank drops its result (XLA removes a
    custom call whose result nothing uses, which would leave the peers waiting)."""
    if _traced([x]) and _xla.usable(x.dtype, op):
        return _xla.allreduce(x, op, prescale, postscale, name, process_set, kept)
    return _run(lambda a: _comm(process_set).allreduce(a, op, prescale, postscale, name),
                [x], _spec(x.shape, x.dtype), "allreduce")


def _allreduce(x, op, prescale, postscale, name, process_set):
    def grad(g):
        check_differentiable(op, "jax.allreduce")
        return [_reduce_one(g, op, prescale, postscale, grad_name(name), process_set)]

    return _differentiable(lambda t: _reduce_one(t, op, prescale, postscale, name, process_set),
                           grad, [x], "allreduce")


def allreduce(tensor, average=None, name=None, compression=Compression.none, op=None,
              prescale_factor=1.0, postscale_factor=1.0, process_set=PS):
    """A new array: tensor reduced over the set's ranks (op=None: Average; average= is
    Horovod's deprecated spelling). Differentiable for Sum and Average."""
    op = resolve_op(average, op, "jax.allreduce")
    (x,) = _arrays([tensor], "allreduce")
    wire, ctx = compression.compress(x)
    out = _allreduce(wire, op, prescale_factor, postscale_factor, name, process_set)
    return compression.decompress(out, ctx)


FUSE_BELOW_BYTES = 64 << 10  # smaller arrays of a dtype travel concatenated


def concatenated_reduce(xs, op, prescale, postscale, name, process_set):
    """xs reduced with one custom call per dtype: that dtype's arrays below
    FUSE_BELOW_BYTES concatenated into one (inside a jitted program XLA fuses the copy),
    the larger ones as they are (reduced in place, no copy); on the callback path, one
    concatenated array per dtype."""
    groups = {}
    for i, x in enumerate(xs):
        groups.setdefault(jnp.dtype(x.dtype), []).append(i)
    out = [None] * len(xs)
    for dtype, where in groups.items():
        in_place = _traced(xs) and _xla.usable(dtype, op)
        small = [i for i in where if not in_place or xs[i].nbytes < FUSE_BELOW_BYTES]
        large = [i for i in where if i not in small]
        parts = [jnp.concatenate([xs[i].reshape(-1) for i in small])] if small else []
        group_name = None if name is None else f"{name}.{dtype.name}"
        if in_place:
            reduced = _xla.allreduce_many(parts + [xs[i] for i in large], op, prescale,
                                          postscale, group_name, process_set)
        else:
            reduced = [_reduce_one(parts[0], op, prescale, postscale, group_name, process_set)]
        start = 0
        for i in small:
            out[i] = reduced[0][start:start + xs[i].size].reshape(xs[i].shape)
            start += xs[i].size
        for i, r in zip(large, reduced[len(parts):]):
            out[i] = r
    return out


def _grouped_reduce(xs, op, prescale, postscale, name, process_set):
    if _traced(xs) and all(_xla.usable(x.dtype, op) for x in xs):
        return concatenated_reduce(xs, op, prescale, postscale, name, process_set)
    return _run(lambda *a: _comm(process_set).grouped_allreduce(list(a), op, prescale,
                                                                postscale, name),
                xs, [_spec(x.shape, x.dtype) for x in xs], "grouped_allreduce")


def reduce_tree(tensors, op, compression, reduce, what):
    """The leaves of a pytree compressed, reduced together by reduce(list of arrays,
    for_gradient) (differentiable for Sum and Average: the gradient is reduced the same
    way) and decompressed; the same structure back."""
    leaves, tree = jax.tree.flatten(tensors)
    if not leaves:
        return tensors
    pairs = [compression.compress(x) for x in _arrays(leaves, what)]

    def grad(gs):
        check_differentiable(op, f"jax.{what}")
        return reduce(list(gs), True)

    out = _differentiable(lambda *xs: reduce(list(xs), False), grad,
                          [w for w, _ in pairs], what)
    return jax.tree.unflatten(tree, [compression.decompress(o, c)
                                     for o, (_, c) in zip(out, pairs)])


def grouped_allreduce(tensors, average=None, name=None, compression=Compression.none, op=None,
                      prescale_factor=1.0, postscale_factor=1.0, process_set=PS):
    """The leaves of a pytree (a list of arrays, say), each reduced as allreduce would,
    as one unit; returns the same structure. Differentiable for Sum and Average."""
    op = resolve_op(average, op, "jax.grouped_allreduce")

    def reduce(xs, for_gradient):
        return _grouped_reduce(xs, op, prescale_factor, postscale_factor,
                               grad_name(name) if for_gradient else name, process_set)

    return reduce_tree(tensors, op, compression, reduce, "grouped_allreduce")


# ---------------------------------------------------------------------------- allgather

def _gather(x, name, process_set):
    rows = (x.shape[0] if x.ndim else 1) * _comm(process_set).size()
    return _run(lambda a: _comm(process_set).allgather(a, name), [x],
                _spec((rows,) + tuple(x.shape[1:]), x.dtype), "allgather")


def _scatter(x, op, prescale, postscale, name, process_set):
    size = _comm(process_set).size()
    rows = x.shape[0] // size + (1 if _comm(process_set).rank() < x.shape[0] % size else 0)
    return _run(lambda a: _comm(process_set).reducescatter(a, op, prescale, postscale, name),
                [x], _spec((rows,) + tuple(x.shape[1:]), x.dtype), "reducescatter")


def allgather(tensor, name=None, process_set=PS):
    """Every rank's tensor concatenated along the first dimension (which may differ by
    rank when called eagerly). Differentiable: the gradient is this rank's rows of the
    ranks' averaged gradient (a reducescatter)."""
    (x,) = _arrays([tensor], "allgather")
    if x.ndim == 0:
        x = x.reshape(1)

    def grad(g):
        return [_scatter(g, Average, 1.0, 1.0, grad_name(name), process_set).reshape(x.shape)]

    return _differentiable(lambda t: _gather(t, name, process_set), grad, [x], "allgather")


def broadcast(tensor, root_rank, name=None, process_set=PS):
    """A new array with root_rank's values. Differentiable: the root gets the ranks'
    averaged gradient, the others zeros."""
    (x,) = _arrays([tensor], "broadcast")
    comm = _comm(process_set)

    def primal(t):
        return _run(lambda a: comm.broadcast(a, root_rank, name), [t],
                    _spec(t.shape, t.dtype), "broadcast")

    def grad(g):
        mean = _reduce_one(g, Average, 1.0, 1.0, grad_name(name), process_set,
                           kept=comm.world_rank() != root_rank)
        return [mean if comm.world_rank() == root_rank else jnp.zeros_like(mean)]

    return _differentiable(primal, grad, [x], "broadcast")


def _check_scatter(x, op):
    if op not in (Sum, Average):
        shown = ReduceOp(op).name.title() if op in set(ReduceOp) else repr(op)
        raise UsageError(f"ringsync.jax.reducescatter: op must be Sum or Average, not {shown}")
    if x.ndim == 0:
        raise UsageError("ringsync.jax.reducescatter: tensor must have a first dimension "
                         "to scatter (got a 0-d array)")


def reducescatter(tensor, name=None, compression=Compression.none, op=Average, process_set=PS,
                  prescale_factor=1.0, postscale_factor=1.0):
    """This rank's rows of tensor reduced over the set (Sum or Average; the first ranks
    take one row more where the rows do not divide). Differentiable: the gradient is the
    gradients allgathered (scaled as the reduction was)."""
    (x,) = _arrays([tensor], "reducescatter")
    if _traced([x]):  # (at trace time: every rank traces alike)
        _check_scatter(x, op)
    else:  # (eagerly a blocking call: where it fails here, the peers' call must fail too)
        checked_on_every_rank("reducescatter", name, process_set, lambda: _check_scatter(x, op))
    wire, ctx = compression.compress(x)

    def grad(g):
        factor = prescale_factor * postscale_factor * (
            _comm(process_set).size() if op == Sum else 1)
        return [_gather(g * factor if factor != 1 else g, grad_name(name), process_set)]

    out = _differentiable(lambda t: _scatter(t, op, prescale_factor, postscale_factor, name,
                                             process_set), grad, [wire], "reducescatter")
    return compression.decompress(out, ctx)


def alltoall(tensor, splits=None, name=None, process_set=PS):
    """splits[i] rows of tensor go to rank i of the set (None: as even as possible);
    returns the rows received, in rank order, and (when splits is given, as Horovod does)
    how many came from each rank. Eager only when splits differ between ranks."""
    (x,) = _arrays([tensor], "alltoall")
    comm = _comm(process_set)
    if splits is None:
        return _run(lambda a: comm.alltoall(a, None, name), [x],
                    _spec(x.shape, x.dtype), "alltoall")
    sp = np.asarray(splits, dtype=np.int64)

    def exchange(a):
        out, received = comm.alltoall(a, sp, name)
        return [out, np.asarray(received, dtype=np.int64)]

    specs = [_spec(x.shape, x.dtype), _spec((comm.size(),), np.int64)]
    if _traced([x]) and isinstance(splits, jax.core.Tracer):
        raise UsageError("ringsync.jax.alltoall: inside a traced function splits must be "
                         "known when tracing (a list or numpy array, not a traced value)")
    out, received = _run(exchange, [x], specs, "alltoall")
    return out, received


def barrier(process_set=PS):
    """Returns once every rank of the set has called barrier() (eager)."""
    settle()
    _comm(process_set).barrier()


def join():
    """This rank has run out of data: it takes part in the others' allreduces with zeros
    until every rank has joined; returns the last rank to join (eager)."""
    settle()
    return resolve(None).join()
