"""horovod.tensorflow's API as a Horovod user calls it (positional and keyword forms), on
every rank under mpirun: collectives eagerly and in tf.function on every dtype, their
gradients by Horovod's rules, errors that leave the next call working, the tape's and the
optimizers' arguments, process sets, SyncBatchNormalization. References are computed
from every rank's input."""
import os
import warnings

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import ringsync.tensorflow as hvd  # noqa: E402

from tests.common.reference import reference_adasum  # noqa: E402

# The adapter's own bodies, run in the same jobs (one TensorFlow import for all):
from .tf_bodies import (broadcast_variables_and_objects,  # noqa: E402,F401
                        collectives_eager_and_in_tf_function,
                        fused_mismatch_fails_every_rank_then_works,
                        gradients_fused_into_one_buffer, tape_training_matches_one_process)

DTYPES = ["uint8", "int8", "uint16", "int16", "int32", "int64", "float16", "bfloat16",
          "float32", "float64"]


def _x(rank, shape=(3, 2), dtype="float64", salt=0):
    """Differs by rank and position; small integers, exact in every dtype."""
    values = (np.arange(np.prod(shape)).reshape(shape) % 5 + rank + salt) % 7
    return values.astype(np.float64)


def _close(got, want, rtol=1e-6, what=""):
    got = np.asarray(got.numpy() if hasattr(got, "numpy") else got, dtype=np.float64)
    assert got.shape == np.shape(want), f"{what}: shape {got.shape} != {np.shape(want)}"
    assert np.allclose(got, want, rtol=rtol, atol=rtol), f"{what}: {got} != {want}"


def _raises(kinds, call, text=""):
    try:
        call()
    except kinds as e:
        assert text in str(e), f"{text!r} not in {e}"
        return e
    raise AssertionError(f"{call} did not raise {kinds}")


def collectives_as_horovod_calls_them():
    hvd.init()
    me, size = hvd.rank(), hvd.size()
    x = tf.constant(_x(me))
    total = sum(_x(r) for r in range(size))
    # allreduce(tensor, average, device_dense, device_sparse, compression, op, prescale,
    #           postscale, name, process_set, ignore_name_scope)
    _close(hvd.allreduce(x, None, '', '', hvd.Compression.none, hvd.Sum, 2.0, 0.5, "pos.ar",
                         hvd.global_process_set, False), total, what="positional allreduce")
    _close(hvd.allreduce(x), total / size, what="default op is Average")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _close(hvd.allreduce(x, average=False), total, what="average=False")
    assert any(issubclass(w.category, DeprecationWarning) for w in caught)
    _raises(ValueError, lambda: hvd.allreduce(x, average=True, op=hvd.Sum), "supersedes")
    for compression, rtol in ((hvd.Compression.fp16, 1e-3), (hvd.Compression.bf16, 1e-2)):
        got = hvd.allreduce(x, compression=compression, op=hvd.Sum)
        assert got.dtype == tf.float64
        _close(got, total, rtol, what=f"{compression.__name__}")
    for op, reduce in ((hvd.Min, np.minimum.reduce), (hvd.Max, np.maximum.reduce),
                       (hvd.Product, np.multiply.reduce)):
        _close(hvd.allreduce(x, op=op), reduce([_x(r) for r in range(size)]), what=str(op))
    # Adasum, against the core's tree order computed from every rank's input
    _close(hvd.allreduce(tf.constant(_x(me) + 1), op=hvd.Adasum),
           reference_adasum([_x(r) + 1 for r in range(size)]), what="Adasum")
    # grouped_allreduce(tensors, average, device_dense, device_sparse, compression, op,
    #                   prescale, postscale, process_set, ignore_name_scope, name)
    a, b = hvd.grouped_allreduce([x, 2 * x], None, '', '', hvd.Compression.none, hvd.Max,
                                 1.0, 1.0, hvd.global_process_set, False, "pos.gar")
    _close(a, np.maximum.reduce([_x(r) for r in range(size)]))
    _close(b, 2 * np.maximum.reduce([_x(r) for r in range(size)]))
    # allgather(tensor, name, ignore_name_scope, process_set): rows differ by rank
    rows = tf.fill([me + 1, 2], float(me))
    want_rows = np.concatenate([np.full((r + 1, 2), float(r)) for r in range(size)])
    _close(hvd.allgather(rows, "pos.ag", False, hvd.global_process_set), want_rows)
    g1, g2 = hvd.grouped_allgather([rows, tf.constant([me], tf.int32)], name="gag")
    _close(g1, want_rows)
    _close(g2, np.arange(size))
    # broadcast(tensor, root_rank, name, ignore_name_scope, process_set)
    _close(hvd.broadcast(x, size - 1, "pos.bc", False, hvd.global_process_set), _x(size - 1))
    variables = [tf.Variable(_x(me)), tf.Variable([me, me], dtype=tf.int32)]
    values = hvd.broadcast_(variables, 0, "pos.bc_")
    _close(variables[0], _x(0))
    _close(values[1], [0, 0])
    # reducescatter(tensor, device_dense, compression, op, name, process_set,
    #               ignore_name_scope, prescale, postscale): 2*size+1 rows, uneven
    full = tf.constant(_x(me, (2 * size + 1, 2)))
    summed = sum(_x(r, (2 * size + 1, 2)) for r in range(size))
    start = 2 * me + min(me, 1)
    mine = summed[start:start + 2 + (me < 1)]
    _close(hvd.reducescatter(full, '', hvd.Compression.none, hvd.Sum, "pos.rs",
                             hvd.global_process_set, False, 2.0, 1.0), 2 * mine)
    _close(hvd.reducescatter(full), mine / size, what="reducescatter default Average")
    r1, r2 = hvd.grouped_reducescatter([full, 3 * full], '', hvd.Compression.none, hvd.Sum)
    _close(r1, mine)
    _close(r2, 3 * mine)
    # alltoall(tensor, splits, name, ignore_name_scope, process_set)
    splits = list(range(1, size + 1))  # rank me sends r + 1 rows to rank r
    out, received = hvd.alltoall(tf.constant(np.repeat(me, sum(splits)), tf.int64), splits,
                                 "pos.a2a", False, hvd.global_process_set)
    assert received.dtype == tf.int32 and list(received.numpy()) == [me + 1] * size
    assert list(out.numpy()) == [r for r in range(size) for _ in range(me + 1)]
    even = hvd.alltoall(tf.constant(np.arange(2 * size) + 10 * me))
    assert not isinstance(even, tuple)
    assert list(even.numpy()) == [2 * me + k + 10 * r for r in range(size) for k in range(2)]
    # every dtype Horovod moves (bool and the 16-bit integers too)
    for dtype in DTYPES + ["bool"]:
        t = tf.constant(_x(me, (2, 3)) > 2) if dtype == "bool" else \
            tf.cast(tf.constant(_x(me, (2, 3))), dtype)
        want = [(_x(r, (2, 3)) > 2) if dtype == "bool" else _x(r, (2, 3)) for r in range(size)]
        got = hvd.allgather(t)
        assert got.dtype == t.dtype, dtype
        _close(tf.cast(got, tf.float64), np.concatenate(want), what=f"allgather {dtype}")
        _close(tf.cast(hvd.broadcast(t, 0), tf.float64), want[0], what=f"broadcast {dtype}")
        if dtype != "bool":
            _close(tf.cast(hvd.allreduce(t, op=hvd.Sum), tf.float64), sum(want),
                   rtol=1e-2, what=f"allreduce {dtype}")
    # queries, as ops (their value at run time)
    assert int(hvd.size_op()) == size and int(hvd.rank_op()) == me
    assert int(hvd.local_rank_op()) == hvd.local_rank()
    assert int(hvd.local_size_op()) == hvd.local_size()
    assert int(hvd.process_set_included_op(0)) == 1
    assert int(hvd.join()) in range(size)
    hvd.barrier()
    assert hvd.mpi_built() and not hvd.cuda_built() and hvd.nccl_built() == 0
    assert issubclass(hvd.HorovodInternalError, RuntimeError)
    hvd.shutdown()


def collectives_inside_tf_function():
    hvd.init()
    me, size = hvd.rank(), hvd.size()

    @tf.function
    def step(x, rows, full):
        return (hvd.allreduce(x, op=hvd.Sum), hvd.allgather(rows), hvd.broadcast(x, size - 1),
                hvd.reducescatter(full, op=hvd.Sum),
                hvd.alltoall(full, splits=tf.fill([size], 2)),
                hvd.grouped_allreduce([x, 2.0 * x]), hvd.size_op(), hvd.rank_op(),
                hvd.grouped_allgather([rows, x]))

    for call in range(2):  # the second call runs the traced graph again
        x = tf.constant(_x(me, salt=call))
        rows = tf.fill([me + 1, 2], float(me + call))
        full = tf.constant(_x(me, (2 * size, 2), salt=call))
        (total, gathered, bcast, scattered, (exchanged, received), (avg, avg2), size_t,
         rank_t, (g_rows, g_x)) = step(x, rows, full)
        every = [_x(r, salt=call) for r in range(size)]
        _close(total, sum(every))
        _close(gathered, np.concatenate([np.full((r + 1, 2), float(r + call))
                                         for r in range(size)]))
        _close(bcast, every[-1])
        fulls = [_x(r, (2 * size, 2), salt=call) for r in range(size)]
        _close(scattered, sum(fulls)[2 * me:2 * me + 2])
        _close(exchanged, np.concatenate([f[2 * me:2 * me + 2] for f in fulls]))
        assert list(received.numpy()) == [2] * size
        _close(avg, sum(every) / size)
        _close(avg2, 2 * sum(every) / size)
        assert int(size_t) == size and int(rank_t) == me
        _close(g_x, np.concatenate(every))
        assert g_rows.shape[0] == size * (size + 1) // 2
    hvd.shutdown()


def gradients_by_horovods_rules():
    """allreduce: the same reduction of the gradients; allgather and broadcast: the
    ranks' gradients averaged (then this rank's rows / the root's alone); reducescatter:
    scaled (times size for Sum), then allgathered; alltoall: sent back."""
    hvd.init()
    me, size = hvd.rank(), hvd.size()
    weight = float(me + 1)
    mean_weight = sum(range(1, size + 1)) / size

    def grad(fn, value):
        v = tf.Variable(value)
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(fn(v) * weight)
        return tape.gradient(loss, v).numpy()

    x = _x(me)
    _close(grad(lambda v: hvd.allreduce(v, op=hvd.Sum), x), np.full(x.shape, mean_weight * size))
    _close(grad(lambda v: hvd.allreduce(v), x), np.full(x.shape, mean_weight))
    g = grad(lambda v: tf.add_n(hvd.grouped_allreduce([v, 3.0 * v], op=hvd.Sum)), x)
    _close(g, np.full(x.shape, 4 * mean_weight * size))
    rows = np.ones((me + 1, 2))
    _close(grad(lambda v: hvd.allgather(v), rows), np.full(rows.shape, mean_weight))
    g = grad(lambda v: tf.concat([tf.reshape(t, [-1]) for t in hvd.grouped_allgather([v, 2 * v])],
                                 0), rows)
    _close(g, np.full(rows.shape, 3 * mean_weight))
    _close(grad(lambda v: hvd.broadcast(v, size - 1), x),
           np.full(x.shape, mean_weight if me == size - 1 else 0.0))
    full = _x(me, (2 * size, 2))
    owner_weight = np.repeat(np.arange(1.0, size + 1), 2)[:, None] * np.ones((1, 2))
    _close(grad(lambda v: hvd.reducescatter(v, op=hvd.Sum), full), owner_weight * size)
    _close(grad(lambda v: hvd.reducescatter(v, op=hvd.Average, prescale_factor=2.0), full),
           owner_weight * 2)
    # alltoall: rank r's rows sent to rank k come back with rank k's weight
    splits = [1] * size
    g = grad(lambda v: hvd.alltoall(v, splits=splits)[0], np.ones((size, 2)))
    _close(g, np.repeat(np.arange(1, size + 1, dtype=np.float64)[:, None], 2, 1))

    @tf.function
    def graph_grad(v):
        with tf.GradientTape() as tape:
            tape.watch(v)
            loss = tf.reduce_sum(hvd.allgather(v) * weight)
        return tape.gradient(loss, v)

    _close(graph_grad(tf.constant(rows)), np.full(rows.shape, mean_weight))
    try:
        grad(lambda v: hvd.allreduce(v, op=hvd.Max), x)
    except ValueError as e:
        assert "gradient of a Max" in str(e), e
    else:
        raise AssertionError("the gradient of Max was accepted")
    hvd.shutdown()


def errors_leave_the_next_call_working():
    """A mismatch is a TensorFlow error (FailedPrecondition eagerly, InvalidArgument from a
    graph) carrying ringsync's text, on every rank; the next collective works, also after
    one rank retraced a tf.function and the other did not."""
    hvd.init()
    me, size = hvd.rank(), hvd.size()
    if size == 1:
        return hvd.shutdown()
    mismatched = tf.ones([me + 2])
    e = _raises(tf.errors.FailedPreconditionError, lambda: hvd.allreduce(mismatched, name="bad"))
    assert isinstance(e, hvd.MismatchError) and "bad" in str(e) and "shape" in str(e), e
    _close(hvd.allreduce(tf.ones([2]), op=hvd.Sum), np.full(2, size), what="after eager error")
    _raises(tf.errors.InvalidArgumentError, lambda: hvd.allreduce(tf.constant([True])), "dtype")
    _close(hvd.allreduce(tf.ones([2]), op=hvd.Sum), np.full(2, size), what="after bad input")
    # Horovod's test_horovod_alltoall_equal_split_length_error: no splits and rows the
    # ranks do not divide is an InvalidArgumentError, on every rank. Where only rank 1's
    # rows do not divide, rank 1 gets that and the others, in the same call, the
    # mismatch (FailedPrecondition) naming rank 1.
    _raises(tf.errors.InvalidArgumentError, lambda: hvd.alltoall(tf.ones([size + 1])),
            "not divisible")
    rows = tf.ones([size * 2 + (me == 1)])
    _raises(tf.errors.InvalidArgumentError if me == 1 else tf.errors.FailedPreconditionError,
            lambda: hvd.alltoall(rows), "not divisible" if me == 1 else "refused on rank 1")
    _close(hvd.alltoall(tf.fill([size], float(me))), np.arange(size, dtype=np.float64),
           what="alltoall after the refused one")

    @tf.function
    def reduce(t):
        return hvd.allreduce(t, op=hvd.Sum)

    e = _raises(tf.errors.InvalidArgumentError, lambda: reduce(mismatched), "ringsync")
    assert "shape" in str(e), e
    # Rank 0 traced reduce for shape [2]; the others for [3], [4], ...: now every rank
    # calls it with [3] (a retrace on some ranks only) and it must still match.
    _close(reduce(tf.ones([3])), np.full(3, size), what="after a graph error and retrace")
    _close(reduce(tf.ones([3])), np.full(3, size), what="again")
    hvd.shutdown()


def _tape_grads(reducer_kwargs, variables, loss_fn, tape_cls=None):
    tape_cls = tape_cls or hvd.DistributedGradientTape
    with tf.GradientTape() as plain:
        loss = loss_fn()
    tape = tape_cls(plain, **reducer_kwargs)
    return tape, tape.gradient(loss, variables)


def tape_and_optimizer_arguments():
    hvd.init()
    me, size = hvd.rank(), hvd.size()
    w = [tf.Variable(np.ones(3) * (k + 1)) for k in range(4)]
    scale = float(me + 1)
    mean_scale = sum(range(1, size + 1)) / size

    def loss():
        return tf.add_n([tf.reduce_sum(v * v) for v in w]) * scale

    def want(k, factor):  # d/dv (v.v * s) = 2 v s
        return 2 * np.ones(3) * (k + 1) * factor

    # positional: (gradtape, device_dense, device_sparse, compression, sparse_as_dense, op,
    #              gradient_predivide_factor, num_groups, groups, process_set, scale_local)
    with tf.GradientTape() as plain:
        value = loss()
    grads = hvd.DistributedGradientTape(plain, '', '', hvd.Compression.none, False, hvd.Sum,
                                        1.0, 0, None, hvd.global_process_set, True).gradient(
        value, w)
    for k, g in enumerate(grads):
        _close(g, want(k, mean_scale * size), what=f"tape Sum {k}")
    for kwargs in ({"groups": 2}, {"groups": [[w[0], w[3]]]}, {"gradient_predivide_factor": 4.0},
                   {"compression": hvd.Compression.fp16}):
        _, grads = _tape_grads(kwargs, w, loss)
        for k, g in enumerate(grads):
            _close(g, want(k, mean_scale), rtol=1e-3, what=f"tape {kwargs} {k}")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _, grads = _tape_grads({"num_groups": 2}, w, loss)
    assert any("num_groups" in str(c.message) for c in caught)
    _raises(ValueError, lambda: _tape_grads({"op": hvd.Sum, "gradient_predivide_factor": 2.0},
                                            w, loss), "gradient_predivide_factor")
    _raises(ValueError, lambda: _tape_grads({"groups": 0}, w, loss), "groups")
    _raises(ValueError, lambda: _tape_grads({"op": hvd.Max}, w, loss), "Max")
    # local sources: not reduced, divided by size (or not)
    with tf.GradientTape() as plain:
        value = loss()
    tape = hvd.DistributedGradientTape(plain)
    tape.register_local_source(w[1])
    local, shared = tape.get_local_and_global_gradients(value, w)
    assert [v.ref() for v, _ in local] == [w[1].ref()]
    _close(local[0][1], want(1, scale / size), what="local source")
    _close(shared[0][1], want(0, mean_scale), what="shared source")
    layer = keras.layers.Dense(2)
    layer.build((None, 3))
    inputs = tf.constant(np.ones((1, 3)))
    with tf.GradientTape() as plain:
        value = tf.reduce_sum(layer(inputs)) * scale
    tape = hvd.PartialDistributedGradientTape(plain, local_layers=[layer],
                                              scale_local_gradients=False)
    kernel_grad = tape.gradient(value, layer.trainable_weights)[0]
    _close(kernel_grad, np.full((3, 2), scale), what="partial tape keeps the layer local")
    # Adasum on gradients (equal gradients combine to themselves)
    with tf.GradientTape() as plain:
        value = tf.reduce_sum(w[0] * w[0])
    _close(hvd.DistributedGradientTape(plain, op=hvd.Adasum).gradient(value, [w[0]])[0],
           want(0, 1.0), what="Adasum of equal gradients")
    # sparse gradients: gathered, or densified
    table = tf.Variable(tf.ones((size + 2, 3), dtype=tf.float64))
    for sparse_as_dense in (False, True):
        with tf.GradientTape() as plain:
            value = tf.reduce_sum(tf.nn.embedding_lookup(table, [me, size + 1]))
        g = hvd.DistributedGradientTape(plain, sparse_as_dense=sparse_as_dense).gradient(
            value, [table])[0]
        assert isinstance(g, tf.IndexedSlices) != sparse_as_dense
        expected = np.zeros((size + 2, 3))
        expected[:size], expected[size + 1] = 1.0 / size, 1.0
        _close(tf.convert_to_tensor(g), expected, what=f"sparse_as_dense={sparse_as_dense}")
    # horovod.tensorflow.DistributedOptimizer: Keras optimizers, every argument passed on
    opt = hvd.DistributedOptimizer(keras.optimizers.SGD(0.5), op=hvd.Sum,
                                   backward_passes_per_step=2, average_aggregated_gradients=True)
    v = tf.Variable(np.zeros(3))
    for step in range(2):
        opt.apply([tf.constant(np.full(3, scale * (step + 1)))], [v])
    # sum over ranks of the mean of the two passes: sum_r (r+1) * 1.5
    _close(v, -0.5 * 1.5 * mean_scale * size * np.ones(3), what="passes=2 averaged, Sum")
    _raises(ValueError, lambda: hvd.DistributedOptimizer(tf.constant(1.0)), "Keras optimizer")
    _raises(TypeError, lambda: hvd.DistributedOptimizer(keras.optimizers.SGD(0.1),
                                                        no_such_argument=1))
    hvd.shutdown()


def process_sets_in_tensorflow():
    hvd.init()
    me, size = hvd.rank(), hvd.size()
    if size == 1:
        return hvd.shutdown()
    ends = hvd.add_process_set([0, size - 1])
    if ends.included():
        x = tf.constant(_x(me))
        _close(hvd.allreduce(x, op=hvd.Sum, process_set=ends), _x(0) + _x(size - 1))
        _close(hvd.allgather(tf.constant([me]), process_set=ends), [0, size - 1])
        _close(hvd.broadcast(x, size - 1, process_set=ends), _x(size - 1))
        assert int(hvd.size_op(ends.process_set_id)) == 2
        assert int(hvd.process_set_included_op(ends.process_set_id)) == 1

        @tf.function
        def in_graph(t):
            return hvd.allreduce(t, op=hvd.Sum, process_set=ends)

        _close(in_graph(x), _x(0) + _x(size - 1))
        with tf.GradientTape() as plain:
            v = tf.Variable(np.ones(2))
            value = tf.reduce_sum(v) * (me + 1)
        g = hvd.DistributedGradientTape(plain, process_set=ends).gradient(value, [v])[0]
        _close(g, np.full(2, (1 + size) / 2))
    else:
        assert int(hvd.process_set_included_op(ends.process_set_id)) == 0
        _raises(ValueError, lambda: hvd.allreduce(tf.ones(2), process_set=ends), "member")
    assert hvd.remove_process_set(ends)
    hvd.shutdown()


def sync_batch_norm_uses_the_global_batch():
    """SyncBatchNormalization on each rank's part == BatchNormalization on the whole batch
    (forward output, moving statistics and gradients), ranks holding different counts."""
    hvd.init()
    me, size = hvd.rank(), hvd.size()
    rng = np.random.default_rng(3)
    parts = [rng.normal(size=(r + 2, 4)) * (r + 1) for r in range(size)]
    whole = np.concatenate(parts)
    sync = hvd.SyncBatchNormalization(momentum=0.5, dtype="float64")
    plain = keras.layers.BatchNormalization(momentum=0.5, dtype="float64")
    for layer in (sync, plain):
        layer.build((None, 4))
    x = tf.constant(parts[me])
    with tf.GradientTape() as tape:
        y = sync(x, training=True)
        loss = tf.reduce_sum(y * tf.range(4, dtype=tf.float64))
    grads = tape.gradient(loss, sync.trainable_weights)
    start = sum(r + 2 for r in range(me))
    with tf.GradientTape() as tape:
        y_ref = plain(tf.constant(whole), training=True)
        ref_loss = tf.reduce_sum(y_ref * tf.range(4, dtype=tf.float64))
    ref_grads = tape.gradient(ref_loss, plain.trainable_weights)
    _close(y, y_ref.numpy()[start:start + me + 2], rtol=1e-3, what="normalized output")
    _close(sync.moving_mean, plain.moving_mean.numpy(), what="moving mean")
    _close(sync.moving_variance, plain.moving_variance.numpy(), rtol=1e-3,
           what="moving variance")
    summed = [hvd.allreduce(g, op=hvd.Sum) for g in grads]  # each rank's share of the loss
    for g, r in zip(summed, ref_grads):
        _close(g, r.numpy(), rtol=1e-6, what="gradients")
    _close(sync(x, training=False), plain(x, training=False).numpy(), what="inference")
    hvd.shutdown()


def _in_session(build):
    """build() in a fresh TF1-style tf.Graph, its result run by a tf.compat.v1.Session
    (after the graph's variables are initialised), as Horovod's own tests run every op."""
    with tf.Graph().as_default():
        out = build()
        with tf.compat.v1.Session() as session:
            session.run(tf.compat.v1.global_variables_initializer())
            return session.run(out)


def collectives_in_a_tf1_graph_session():
    """Every collective built in a tf.Graph and run by a Session: results against numpy
    references from every rank's input, gradients by Horovod's rules (tf.gradients), the
    variable broadcasts as ops, DistributedGradientTape, join and the query ops."""
    hvd.init()
    me, size = hvd.rank(), hvd.size()
    xs = [_x(r, (2 * size, 3)) for r in range(size)]
    x = lambda: tf.constant(xs[me])  # noqa: E731
    _close(_in_session(lambda: hvd.allreduce(x(), op=hvd.Sum)), sum(xs), what="Sum")
    got = _in_session(lambda: [hvd.allreduce(x(), name="g.avg"), hvd.allreduce(x(), op=hvd.Max)])
    _close(got[0], sum(xs) / size, what="Average")
    _close(got[1], np.max(xs, axis=0), what="Max")
    got = _in_session(lambda: hvd.grouped_allreduce([x(), 2 * x()], op=hvd.Sum))
    _close(got[1], 2 * sum(xs), what="grouped")
    rows = [_x(r, (r + 1, 2)) for r in range(size)]  # ranks differ in their first dimension
    _close(_in_session(lambda: hvd.allgather(tf.constant(rows[me]))), np.concatenate(rows))
    got = _in_session(lambda: hvd.grouped_allgather([tf.constant(rows[me]), x()]))
    _close(got[1], np.concatenate(xs), what="grouped_allgather")
    _close(_in_session(lambda: hvd.broadcast(x(), size - 1)), xs[size - 1], what="broadcast")
    mine = slice(2 * me, 2 * me + 2)
    _close(_in_session(lambda: hvd.reducescatter(x(), op=hvd.Sum)), sum(xs)[mine])
    splits = [(me + r) % 2 + 1 for r in range(size)]  # rows this rank sends to rank r
    sent = [_x(me, (sum(splits), 3), salt=1)]

    def exchange():
        return hvd.alltoall(tf.constant(sent[0]), splits=splits)

    out, received = _in_session(exchange)
    counts = [(r + me) % 2 + 1 for r in range(size)]  # rows rank r sends to this rank
    want = np.concatenate([_x(r, (sum((r + q) % 2 + 1 for q in range(size)), 3), salt=1)
                           [sum((r + q) % 2 + 1 for q in range(me)):][:counts[r]]
                           for r in range(size)])
    _close(out, want, what="alltoall")
    assert list(received) == counts, (received, counts)
    _close(_in_session(lambda: hvd.alltoall(x())), np.concatenate([v[mine] for v in xs]))
    _tf1_gradients_and_variables(me, size, xs)
    hvd.shutdown()


def _tf1_gradients_and_variables(me, size, xs):
    def grads():
        v = tf.Variable(xs[me])
        summed = hvd.allreduce(v * v, op=hvd.Sum)
        gathered = hvd.allgather(v)
        root = hvd.broadcast(v, 0)
        return tf.gradients(tf.reduce_sum(summed) + tf.reduce_sum(gathered ** 2) +
                            tf.reduce_sum(root * (me + 1)), v)[0]

    # d/dv: sum over ranks of 2v (allreduce of ones, times 2v); 2v (the rows' own upstream,
    # the same on every rank, averaged); the root gets the mean of the (r + 1)s.
    want = 2 * size * xs[me] + 2 * xs[me] + (np.mean(np.arange(1, size + 1)) if me == 0 else 0)
    _close(_in_session(grads), want, what="tf.gradients")

    def tape():
        v = tf.Variable(xs[me])
        with tf.GradientTape() as plain:
            loss = tf.reduce_sum(v * v)
        return hvd.DistributedGradientTape(plain).gradient(loss, [v])[0]

    _close(_in_session(tape), 2 * sum(xs) / size, what="DistributedGradientTape")

    with tf.Graph().as_default():  # the variable broadcasts, one session.run each
        a, b = tf.Variable(xs[me]), tf.Variable(xs[me] + 1)
        to_a = hvd.broadcast_variables([a], size - 1)
        to_b = hvd.broadcast_([b], size - 1)
        with tf.compat.v1.Session() as session:
            session.run(tf.compat.v1.global_variables_initializer())
            assert session.run(to_a) is None  # (an op: tf.group)
            _close(session.run(a), xs[size - 1], what="broadcast_variables")
            _close(session.run(to_b)[0], xs[size - 1] + 1, what="broadcast_ (its values)")
            _close(session.run(b), xs[size - 1] + 1, what="broadcast_")

    def every_variable():
        variables = [tf.Variable(xs[me] + k) for k in range(3)]
        with tf.control_dependencies([hvd.broadcast_global_variables(size - 1)]):
            return [tf.identity(v) for v in variables]

    for k, value in enumerate(_in_session(every_variable)):
        _close(value, xs[size - 1] + k, what=f"broadcast_global_variables {k}")
    got = _in_session(lambda: [hvd.size_op(), hvd.rank_op(), hvd.local_rank_op(), hvd.join()])
    assert list(got[:3]) == [size, me, hvd.local_rank()] and got[3] in range(size), got


def none_gradients_pass_through():
    """Horovod's rule: DistributedGradientTape and the Keras DistributedOptimizer pass a
    None gradient (a variable the loss does not use) through and reduce the others; a
    collective given None says so, with ValueError (Horovod's class)."""
    hvd.init()
    me, size = hvd.rank(), hvd.size()
    xs = [_x(r, (2, 2)) for r in range(size)]
    for groups in (None, 2):
        used, unused, other = (tf.Variable(np.ones((2, 2))) for _ in range(3))
        with tf.GradientTape() as plain:
            loss = tf.reduce_sum(used * xs[me]) + tf.reduce_sum(other * 2 * xs[me])
        tape = hvd.DistributedGradientTape(plain, groups=groups)
        g_used, g_unused, g_other = tape.gradient(loss, [used, unused, other])
        assert g_unused is None, g_unused
        _close(g_used, sum(xs) / size, what=f"groups={groups}")
        _close(g_other, 2 * sum(xs) / size, what=f"groups={groups}")
    used, unused = tf.Variable(np.ones((2, 2))), tf.Variable(np.ones((2, 2)))
    opt = hvd.DistributedOptimizer(keras.optimizers.SGD(0.5))
    with warnings.catch_warnings():  # (Keras warns of the variable without a gradient)
        warnings.simplefilter("ignore", UserWarning)
        opt.apply([tf.constant(xs[me]), None], [used, unused])
    _close(used, 1 - 0.5 * sum(xs) / size, what="optimizer")
    _close(unused, np.ones((2, 2)), what="optimizer, None gradient")
    for call, words in [(lambda: hvd.allreduce(None), "allreduce: tensor is None"),
                        (lambda: hvd.grouped_allreduce([tf.ones(1), None]),
                         "grouped_allreduce: tensors[1] is None"),
                        (lambda: hvd.allgather(None), "allgather: tensor is None"),
                        (lambda: hvd.broadcast(None, 0), "broadcast: tensor is None")]:
        e = _raises(ValueError, call, words)
        assert isinstance(e, tf.errors.InvalidArgumentError), type(e).__mro__
    _close(hvd.allreduce(tf.constant(xs[me]), op=hvd.Sum), sum(xs), what="next call")
    hvd.shutdown()


def ranks_outside_the_tapes_set_keep_their_gradients():
    """Horovod's rule: DistributedGradientTape / the Keras DistributedOptimizer given a
    process set this rank is not in leave its gradients as they are; the members average
    among themselves (also through the fused path and tf.function)."""
    hvd.init()
    me, size = hvd.rank(), hvd.size()
    assert callable(hvd.elastic.run) and hvd.elastic.TensorFlowKerasState  # hvd.elastic.*
    assert hvd.elastic.TensorFlowState and hvd.elastic.ObjectState
    if size < 2:  # (every rank is in every set)
        return hvd.shutdown()
    members = hvd.add_process_set(list(range(size - 1)))  # all but the last rank
    group = members.ranks if members.included() else [me]
    xs = [_x(r, (2, 3)) for r in range(size)]
    want = sum(xs[r] for r in group) / len(group)
    v = tf.Variable(np.ones((2, 3)))

    @tf.function
    def traced(x):
        with tf.GradientTape() as plain:
            loss = tf.reduce_sum(v * x)
        return hvd.DistributedGradientTape(plain, process_set=members).gradient(loss, [v])[0]

    with tf.GradientTape() as plain:
        loss = tf.reduce_sum(v * xs[me])
    eager = hvd.DistributedGradientTape(plain, process_set=members).gradient(loss, [v])[0]
    print(f"rank {me} (in the set: {members.included()}): gradient {eager.numpy().tolist()}")
    _close(eager, want, what="tape")
    _close(traced(tf.constant(xs[me])), want, what="tape in tf.function")
    opt = hvd.DistributedOptimizer(keras.optimizers.SGD(1.0), process_set=members)
    opt.apply([tf.constant(xs[me])], [v])
    _close(v, 1 - want, what="Keras DistributedOptimizer")
    assert hvd.remove_process_set(members)
    hvd.shutdown()
