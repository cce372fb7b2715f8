"""Collectives on tf.Tensor / tf.Variable with horovod.tensorflow's names, argument order
and defaults, eagerly and inside tf.function, differentiable where Horovod's are.

Eager tensors reach the core through numpy views of their buffers (no copy in); results
come back as new tensors (one copy out). Inside a graph each collective is a
tf.py_function, which TensorFlow runs in the calling process (XLA cannot compile it).

Names. An unnamed collective inside a graph is named when the graph is traced, after
the outermost traced function and the collective's place in it ("tf.allreduce.step.3"):
TensorFlow may run a graph's ops concurrently, in a different order on each rank, so
call order cannot match them; and a name that depends only on the function's own trace
stays the same when one rank retraces it and another does not (after an error, say).

Errors. ringsync's own errors keep their classes and gain TensorFlow's: a mismatch
between ranks is also a tf.errors.FailedPreconditionError, a lost peer also a
tf.errors.UnknownError, bad input also a tf.errors.InvalidArgumentError (eagerly; inside
a graph TensorFlow re-raises them as InvalidArgumentError / UnknownError with ringsync's
message). Either way the next collective works.

process_set, in every function here: a ProcessSet (global_process_set by default) or a
ringsync Communicator. root_rank is a rank of the job, as in Horovod, also in a set.
device_dense / device_sparse / ignore_name_scope are accepted for Horovod's signatures:
tensors are staged through host memory, and names do not depend on name scopes."""
import itertools
import weakref

import numpy as np
import tensorflow as tf

from ringsync import basics
from ringsync import process_sets
from ringsync._context import resolve
from ringsync.ops import ReduceOp
from ringsync._adapters import (check_differentiable, checked_on_every_rank, grad_name,
                                resolve_op)
from ringsync._requests import even_split
from ringsync.errors import CommunicationError, MismatchError, RingsyncError, UsageError
from ringsync.process_sets import global_process_set

from .compression import Compression

PS = global_process_set  # (short, for the signatures below)

# ---------------------------------------------------------------------------- errors

_TF_KIND = ((MismatchError, tf.errors.FailedPreconditionError),
            (CommunicationError, tf.errors.UnknownError),
            (RingsyncError, tf.errors.InvalidArgumentError))
_flavoured = {}  # ringsync error class -> the same class that is also a TensorFlow error


def _tensorflow_error(error: RingsyncError) -> Exception:
    """error, as an exception of its own class that is also TensorFlow's class for it."""
    cls = type(error)
    if cls not in _flavoured:
        tf_cls = next(tf_kind for kind, tf_kind in _TF_KIND if isinstance(error, kind))

        def __init__(self, message):
            tf_cls.__init__(self, None, None, message)

        _flavoured[cls] = type(cls.__name__, (cls, tf_cls),
                               {"__init__": __init__, "__module__": cls.__module__,
                                "__str__": lambda self: self.message})
    return _flavoured[cls](str(error))


# ---------------------------------------------------------------------------- running

_graph_counts = weakref.WeakKeyDictionary()  # outermost traced graph -> collectives named


def _outermost_graph():
    graph = tf.compat.v1.get_default_graph()
    # A traced function's graph has outer_graph; branches and loop bodies are graphs
    # inside it, named with process-wide counters (which differ between ranks).
    while hasattr(getattr(graph, "outer_graph", None), "outer_graph"):
        graph = graph.outer_graph
    return graph


_plain_graphs = weakref.WeakKeyDictionary()  # TF1-style tf.Graph -> its number
_plain_graph_numbers = itertools.count()


def _graph_name(graph) -> str:
    """A traced function's graph is named after the function; a TF1-style tf.Graph (run
    by a tf.compat.v1.Session) has no name, so it is numbered in the order collectives
    are first built in one (the same on every rank that builds its graphs alike)."""
    name = getattr(graph, "name", None)
    if name is not None:
        return name
    if graph not in _plain_graphs:
        _plain_graphs[graph] = next(_plain_graph_numbers)
    return f"graph{_plain_graphs[graph]}"


def _name(name, what):
    """The name a collective travels under: the user's, or (in a graph) its trace name;
    None eagerly, where the core matches unnamed calls by call order."""
    if name is not None or tf.executing_eagerly():
        return name
    graph = _outermost_graph()
    count = _graph_counts.get(graph, 0)
    _graph_counts[graph] = count + 1
    return f"tf.{what}.{_graph_name(graph)}.{count}"


def _host(t) -> np.ndarray:
    return t.numpy() if hasattr(t, "numpy") else np.asarray(t)


def _run(fn, tensors, out_dtypes, what):
    """fn(*numpy arrays, blocking=eager) -> array(s), now (eager: a blocking call, in
    program order) or as a py_function (graph: TensorFlow may run several at once, in any
    order, so the engine matches them by name)."""
    if tf.executing_eagerly():
        try:
            out = fn(*[_host(t) for t in tensors], blocking=True)
        except RingsyncError as error:
            raise _tensorflow_error(error) from error
        return [tf.convert_to_tensor(o) for o in out] if isinstance(out, list) else \
            tf.convert_to_tensor(out)

    def call(*args):
        return fn(*[_host(a) for a in args], blocking=False)

    return in_build_order(lambda: tf.py_function(call, list(tensors), out_dtypes,
                                                 name=f"ringsync_{what}"))


_last_collective = weakref.WeakKeyDictionary()  # TF1-style graph -> its latest collective


def in_build_order(make, chain=None):
    """make() (an op's outputs), run after the collective built before it in the same
    TF1-style graph (chain: a graph -> last op map of the caller's own, for any graph).
    A Session runs independent ops in any order on a few threads: two ranks whose threads
    all wait in different collectives would wait for each other for ever. (tf.function
    runs stateful ops in program order itself.)"""
    if chain is None:
        if tf.inside_function():
            return make()
        chain = _last_collective
    graph = tf.compat.v1.get_default_graph()
    before = chain.get(graph)
    with tf.control_dependencies([before] if before is not None else []):
        out = make()
    chain[graph] = tf.nest.flatten(out)[0].op
    return out


Sum, Average, Adasum = ReduceOp.SUM, ReduceOp.AVERAGE, ReduceOp.ADASUM
Min, Max, Product = ReduceOp.MIN, ReduceOp.MAX, ReduceOp.PRODUCT


def _check_tensors(tensors, what):
    """A clear error for a None among the tensors (a gradient that was not computed),
    which TensorFlow would only call a value it cannot convert. Horovod's tape and
    optimizer pass None gradients through; a collective has nothing to reduce."""
    for i, t in enumerate(tensors):
        if t is None:
            where = f"tensors[{i}]" if len(tensors) > 1 else "tensor"
            raise _tensorflow_error(UsageError(
                f"ringsync.tensorflow.{what}: {where} is None (a gradient that was not "
                f"computed? DistributedGradientTape and DistributedOptimizer pass None "
                f"gradients through)"))
    return tensors


def _collective(method, blocking, process_set, *args):
    """Run one of the Communicator's collectives to completion: the blocking entry point
    (eager calls, which meet other frameworks' on the same-host lane), or the async one
    waited for (inside a graph, where ops may run in any order)."""
    comm = resolve(process_set)
    if blocking:
        return getattr(comm, method)(*args)
    return comm.synchronize(getattr(comm, method + "_async")(*args))


def _rows_shape(t):
    return [None] + t.shape[1:].as_list() if t.shape.rank else [None]


# ---------------------------------------------------------------------------- allreduce

def _allreduce(tensor, op, prescale, postscale, name, process_set):
    """The dense, differentiable allreduce (no compression)."""

    def reduce(t, n):
        y = _run(lambda a, blocking: _collective("allreduce", blocking, process_set, a,
                                                 op, prescale, postscale, n),
                 [t], t.dtype, "allreduce")
        y.set_shape(t.shape)
        return y

    @tf.custom_gradient
    def fn(t):
        def grad(dy):
            check_differentiable(op, "tensorflow.allreduce")
            return reduce(tf.convert_to_tensor(dy), grad_name(name))
        return reduce(t, name), grad

    return fn(tf.convert_to_tensor(tensor))


def _allreduce_sparse(slices, op, prescale, postscale, name, process_set):
    """IndexedSlices, as Horovod reduces them: every rank's values and indices gathered
    (duplicate indices add up when applied); Average divides by the number of ranks."""
    if ReduceOp(op) not in (ReduceOp.SUM, ReduceOp.AVERAGE):
        raise UsageError(f"ringsync.tensorflow.allreduce: tensor '{name}' is IndexedSlices: "
                         f"only Sum and Average are defined for them, got {ReduceOp(op).name} "
                         f"(use sparse_as_dense=True)")
    if prescale != 1.0 or postscale != 1.0:
        raise UsageError(f"ringsync.tensorflow.allreduce: tensor '{name}' is IndexedSlices: "
                         "prescale_factor and postscale_factor apply to dense tensors only")
    values, indices = grouped_allgather([slices.values, slices.indices],
                                        name=None if name is None else f"{name}.slices",
                                        process_set=process_set)
    if ReduceOp(op) == ReduceOp.AVERAGE:
        values = values / tf.cast(resolve(process_set).size(), values.dtype)
    return tf.IndexedSlices(values, indices, dense_shape=slices.dense_shape)


def _check_adasum(op, process_set, what, name, count=None):
    if op != Adasum or process_set in (None, PS):
        return
    error = UsageError(f"ringsync.tensorflow.{what}: Adasum runs on the global process set "
                       "only (as Horovod's)")
    if not tf.executing_eagerly():  # (at trace time: every rank traces alike)
        raise error

    def refuse():
        raise error

    # Eagerly a blocking call: where only this rank asks for Adasum, the peers' call must
    # fail too instead of waiting for this rank.
    checked_on_every_rank(what, name, process_set, refuse, count)


def allreduce(tensor, average=None, device_dense='', device_sparse='',
              compression=Compression.none, op=None, prescale_factor=1.0, postscale_factor=1.0,
              name=None, process_set=PS, ignore_name_scope=False):
    """tensor reduced over the ranks of process_set (op=None: Average). IndexedSlices are
    gathered (see _allreduce_sparse). Differentiable for Sum and Average."""
    op = resolve_op(average, op, "tensorflow.allreduce")
    _check_adasum(op, process_set, "allreduce", name)
    _check_tensors([tensor], "allreduce")
    name = _name(name, "allreduce")
    if isinstance(tensor, tf.IndexedSlices):
        return _allreduce_sparse(tensor, op, prescale_factor, postscale_factor, name,
                                 process_set)
    wire, ctx = compression.compress(tf.convert_to_tensor(tensor))
    reduced = _allreduce(wire, op, prescale_factor, postscale_factor, name, process_set)
    return compression.decompress(reduced, ctx)


def _grouped_allreduce(tensors, op, prescale, postscale, name, process_set):
    """Dense tensors reduced as one unit (one py_function in a graph); differentiable."""

    def reduce(ts, n):
        out = _run(lambda *arrays, blocking: list(_collective(
                       "grouped_allreduce", blocking, process_set, list(arrays), op,
                       prescale, postscale, n)),
                   ts, [t.dtype for t in ts], "grouped_allreduce")
        for y, t in zip(out, ts):
            y.set_shape(t.shape)
        return list(out)

    @tf.custom_gradient
    def fn(*ts):
        def grad(*dys):
            check_differentiable(op, "tensorflow.grouped_allreduce")
            return reduce([tf.convert_to_tensor(d) for d in dys], grad_name(name))
        return reduce(list(ts), name), grad

    return list(fn(*[tf.convert_to_tensor(t) for t in tensors]))


def grouped_allreduce(tensors, average=None, device_dense='', device_sparse='',
                      compression=Compression.none, op=None, prescale_factor=1.0,
                      postscale_factor=1.0, process_set=PS, ignore_name_scope=False, name=None):
    """A list of tensors reduced as one unit: it starts once every rank has submitted all
    of it. IndexedSlices among them are gathered, as allreduce does."""
    op = resolve_op(average, op, "tensorflow.grouped_allreduce")
    tensors = list(tensors)
    _check_adasum(op, process_set, "grouped_allreduce", name, len(tensors))
    tensors = _check_tensors(tensors, "grouped_allreduce")
    if not tensors:
        return []
    name = _name(name, "grouped_allreduce")
    out = list(tensors)
    dense = [i for i, t in enumerate(tensors) if not isinstance(t, tf.IndexedSlices)]
    for i, t in enumerate(tensors):
        if isinstance(t, tf.IndexedSlices):
            out[i] = _allreduce_sparse(t, op, prescale_factor, postscale_factor,
                                       None if name is None else f"{name}.sparse{i}",
                                       process_set)
    if dense:
        wires = [compression.compress(tf.convert_to_tensor(tensors[i])) for i in dense]
        reduced = _grouped_allreduce([w for w, _ in wires], op, prescale_factor,
                                     postscale_factor, name, process_set)
        for i, r, (_, ctx) in zip(dense, reduced, wires):
            out[i] = compression.decompress(r, ctx)
    return out


# ---------------------------------------------------------------------------- allgather

def _one_or_grouped(single, grouped, process_set, *args):
    """A function of numpy arrays running the single-tensor collective for one array (so
    that its name is the same as other frameworks' single calls) or the grouped one."""
    def run(*arrays, blocking):
        if len(arrays) == 1:
            return [_collective(single, blocking, process_set, arrays[0], *args)]
        return list(_collective(grouped, blocking, process_set, list(arrays), *args))
    return run


def _gather(ts, name, process_set):
    out = _run(_one_or_grouped("allgather", "grouped_allgather", process_set, name),
               ts, [t.dtype for t in ts], "allgather")
    for y, t in zip(out, ts):
        y.set_shape(_rows_shape(t))
    return list(out)


def _my_rows_of_mean(dys, ts, name, process_set):
    """The gradient of a concatenation, Horovod's rule: the ranks' upstream gradients
    averaged, then the rows that came from this rank. The rows per rank are exchanged
    here, not in the forward pass, so that forward passes run the same collectives
    whether or not gradients are wanted (and in any framework)."""
    rows = tf.stack([tf.shape(t, out_type=tf.int64)[0] if t.shape.rank
                     else tf.constant(1, tf.int64) for t in ts])
    counts = _gather([rows], None if name is None else f"{name}.rows", process_set)[0]
    counts = tf.reshape(counts, [-1, len(ts)])
    dys = [tf.convert_to_tensor(d) for d in dys]
    means = [_allreduce(dys[0], Average, 1.0, 1.0, name, process_set)] if len(dys) == 1 else \
        _grouped_allreduce(dys, Average, 1.0, 1.0, name, process_set)
    before = tf.reduce_sum(counts[:resolve(process_set).rank()], axis=0)
    return [tf.reshape(m[before[i]:before[i] + rows[i]], tf.shape(t))
            for i, (m, t) in enumerate(zip(means, ts))]


def grouped_allgather(tensors, name=None, ignore_name_scope=False, process_set=PS):
    """Each tensor concatenated over the ranks along its first dimension, as one unit.
    Differentiable."""
    tensors = [tf.convert_to_tensor(t)
               for t in _check_tensors(list(tensors), "grouped_allgather")]
    if not tensors:
        return []
    name = _name(name, "grouped_allgather")

    @tf.custom_gradient
    def fn(*ts):
        def grad(*dys):
            return _my_rows_of_mean(dys, ts, grad_name(name), process_set)
        return _gather(list(ts), name, process_set), grad

    return list(fn(*tensors))


def allgather(tensor, name=None, ignore_name_scope=False, process_set=PS):
    """Every rank's tensor concatenated along the first dimension (ranks may differ in
    it). Differentiable."""
    _check_tensors([tensor], "allgather")
    name = _name(name, "allgather")
    return grouped_allgather([tensor], name, ignore_name_scope, process_set)[0]


# ---------------------------------------------------------------------------- broadcast

def _broadcast(t, root_rank, name, process_set):
    y = _run(lambda a, blocking: _collective("broadcast", blocking, process_set, a,
                                             root_rank, name),
             [t], t.dtype, "broadcast")
    y.set_shape(t.shape)
    return y


def broadcast(tensor, root_rank, name=None, ignore_name_scope=False, process_set=PS):
    """root_rank's tensor on every rank. Differentiable: the root gets the ranks'
    gradients averaged, the others zeros (Horovod's rule)."""
    _check_tensors([tensor], "broadcast")
    name = _name(name, "broadcast")

    @tf.custom_gradient
    def fn(t):
        def grad(dy):
            mean = _allreduce(tf.convert_to_tensor(dy), Average, 1.0, 1.0, grad_name(name),
                              process_set)
            return mean if resolve(process_set).world_rank() == root_rank else mean * 0
        return _broadcast(t, root_rank, name, process_set), grad

    return fn(tf.convert_to_tensor(tensor))


def broadcast_(variables, root_rank, name=None, process_set=PS):
    """root_rank's values assigned to variables (a list, or one variable) on every rank;
    returns their new values."""
    single = isinstance(variables, tf.Variable)
    variables = _check_tensors([variables] if single else list(variables), "broadcast_")
    name = _name(name, "broadcast_")
    values = []
    for i, v in enumerate(variables):
        values.append(assign(v, _broadcast(tf.convert_to_tensor(v), root_rank,
                                           None if name is None else f"{name}.{i}",
                                           process_set)))
    return values[0] if single else values


def assign(variable, value):
    """Assign value to variable; returns its new value, read after the assignment (a
    TF1-style graph has no automatic control dependencies to order the two)."""
    if tf.executing_eagerly() or tf.inside_function():
        variable.assign(value)
        return tf.convert_to_tensor(variable)  # (a Keras 3 Variable has no read_value)
    with tf.control_dependencies([variable.assign(value, read_value=False)]):
        return tf.identity(variable.read_value())


# ---------------------------------------------------------------------------- reducescatter

def _scatter(ts, op, prescale, postscale, name, process_set):
    out = _run(_one_or_grouped("reducescatter", "grouped_reducescatter",
                               process_set, op, prescale, postscale, name),
               ts, [t.dtype for t in ts], "reducescatter")
    for y, t in zip(out, ts):
        y.set_shape(_rows_shape(t))
    return list(out)


def _grouped_reducescatter(tensors, op, prescale, postscale, name, process_set):
    @tf.custom_gradient
    def fn(*ts):
        def grad(*dys):
            # Horovod's rule: scaled as the forward pass scaled (times the number of
            # ranks for Sum), then allgathered.
            check_differentiable(op, "tensorflow.reducescatter")
            scale = prescale * postscale * (resolve(process_set).size() if op == Sum else 1)
            return grouped_allgather([tf.convert_to_tensor(d) * scale for d in dys],
                                     grad_name(name), process_set=process_set)
        return _scatter(list(ts), op, prescale, postscale, name, process_set), grad

    return list(fn(*[tf.convert_to_tensor(t) for t in tensors]))


def reducescatter(tensor, device_dense='', compression=Compression.none, op=Average, name=None,
                  process_set=PS, ignore_name_scope=False, prescale_factor=1.0,
                  postscale_factor=1.0):
    """tensor reduced over the ranks, then split along the first dimension: rank r gets
    its share of the rows (the first ranks one more where they do not divide evenly).
    Differentiable for Sum and Average."""
    _check_tensors([tensor], "reducescatter")
    name = _name(name, "reducescatter")
    wire, ctx = compression.compress(tf.convert_to_tensor(tensor))
    out = _grouped_reducescatter([wire], op, prescale_factor, postscale_factor, name,
                                 process_set)[0]
    return compression.decompress(out, ctx)


def grouped_reducescatter(tensors, device_dense='', compression=Compression.none, op=Average,
                          process_set=PS, prescale_factor=1.0, postscale_factor=1.0, name=None):
    """reducescatter of a list of tensors as one unit."""
    tensors = _check_tensors(list(tensors), "grouped_reducescatter")
    if not tensors:
        return []
    name = _name(name, "grouped_reducescatter")
    wires = [compression.compress(tf.convert_to_tensor(t)) for t in tensors]
    out = _grouped_reducescatter([w for w, _ in wires], op, prescale_factor, postscale_factor,
                                 name, process_set)
    return [compression.decompress(o, ctx) for o, (_, ctx) in zip(out, wires)]


# ---------------------------------------------------------------------------- alltoall

def _even_splits(rows: int, size: int) -> np.ndarray:
    """Rows per rank where they divide evenly, else none (an empty array)."""
    return np.asarray(even_split(rows, size) if rows % size == 0 else [], np.int32)


def _alltoall(t, splits, name, process_set):
    """(rows received, int32 rows received from each rank); splits: int32 per rank."""
    def exchange(a, sp, blocking):
        if sp.size == 0:  # no even split (_even_splits): the core refuses it on every rank
            _collective("alltoall", blocking, process_set, a, None, name)
        out, received = _collective("alltoall", blocking, process_set, a, sp, name)
        return [out, np.asarray(received, dtype=np.int32)]

    y, received = _run(exchange, [t, splits], [t.dtype, tf.int32], "alltoall")
    y.set_shape(_rows_shape(t))
    received.set_shape([None])
    return y, received


def alltoall(tensor, splits=None, name=None, ignore_name_scope=False, process_set=PS):
    """Rows splits[i] go to rank i. With splits, returns (rows received, int32 rows
    received from each rank), as Horovod's; without, only the rows, the first dimension
    split evenly (one that the ranks do not divide fails on every rank, an
    InvalidArgumentError as in Horovod). Differentiable: the gradient travels back the way
    the rows came."""
    x = tf.convert_to_tensor(_check_tensors([tensor], "alltoall")[0])
    name = _name(name, "alltoall")
    given = splits is not None
    if given:
        splits = tf.cast(tf.convert_to_tensor(splits), tf.int32)
    else:
        rows = tf.shape(x)[0] if x.shape.rank else tf.constant(0)
        size = resolve(process_set).size()
        splits = tf.py_function(lambda n: _even_splits(int(n), size), [rows], tf.int32) \
            if not tf.executing_eagerly() else tf.constant(_even_splits(int(rows), size))

    @tf.custom_gradient
    def fn(t):
        y, received = _alltoall(t, splits, name, process_set)

        def grad(dy, _unused=None):
            back, _ = _alltoall(tf.convert_to_tensor(dy), received, grad_name(name),
                                process_set)
            return tf.reshape(back, tf.shape(t))

        return (y, tf.stop_gradient(received)), grad

    out, received = fn(x)
    return (out, received) if given else out


# ---------------------------------------------------------------------------- others

def join():
    """This rank has run out of data: it takes part in the other ranks' allreduces with
    zeros until every rank has joined. Returns the last rank to join (an int32 tensor;
    in a graph, an op that joins when it runs, as Horovod's)."""
    return _query_op(lambda: resolve().join(), "ringsync_join", collective=True)


def barrier(process_set=PS):
    """Returns once every rank of the set has called barrier() (in a graph: an op that
    waits when it runs; run it, as any op of a TF1-style graph)."""
    def wait():
        resolve(process_set).barrier()
        return 0
    out = _query_op(wait, "ringsync_barrier", collective=True)
    return None if tf.executing_eagerly() else out


def _query_op(query, name, collective=False):
    """An int32 op that asks at run time (its value may change with elastic recovery);
    a collective one runs in build order (see in_build_order)."""
    if tf.executing_eagerly():
        return tf.constant(query(), tf.int32)
    def make():
        return tf.py_function(lambda: np.int32(query()), [], tf.int32, name=name)
    return in_build_order(make) if collective else make()


def size_op(process_set_id=0, name=None):
    return _query_op(lambda: _set_by_id(process_set_id).size(), name)


def local_size_op(name=None):
    return _query_op(basics.local_size, name)


def rank_op(name=None):
    return _query_op(basics.rank, name)


def local_rank_op(name=None):
    return _query_op(basics.local_rank, name)


def process_set_included_op(process_set_id=0, name=None):
    return _query_op(lambda: int(bool(_set_by_id(process_set_id).included())), name)


def _set_by_id(process_set_id):
    found = process_sets.by_id(process_set_id)
    if found is None:
        raise UsageError(f"ringsync.tensorflow: no process set with id {process_set_id}")
    return found
