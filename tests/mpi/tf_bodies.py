"""TensorFlow adapter bodies, run on every rank under mpirun (gradients, sparse gradients
and the tape's arguments: tests/mpi/horovod_tf_bodies.py)."""
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import ringsync.tensorflow as hvd  # noqa: E402

from tests.common.reference import assert_reduced, rank_input  # noqa: E402

TF_DTYPES = ["uint8", "int8", "uint16", "int16", "int32", "int64", "float16", "bfloat16",
             "float32", "float64"]


def _tf(rank, shape, dtype, op="Sum", salt=""):
    return tf.constant(rank_input(rank, shape, dtype, op, salt))


def collectives_eager_and_in_tf_function():
    hvd.init()
    me, size = hvd.rank(), hvd.size()
    for dtype in TF_DTYPES:
        for op in ["Sum", "Average", "Min", "Max", "Product"]:
            shape = (5, 3)
            inputs = [rank_input(r, shape, dtype, op, "tf") for r in range(size)]
            got = hvd.allreduce(_tf(me, shape, dtype, op, "tf"), op=getattr(hvd, op),
                                name=f"eager.{dtype}.{op}")
            assert_reduced(got.numpy(), inputs, op, what=f"tf eager {dtype} {op}")
            var = tf.Variable(_tf(me, shape, dtype, op, "tf"))  # Variables are accepted too
            got = hvd.allreduce(var, op=getattr(hvd, op), prescale_factor=0.5,
                                postscale_factor=2.0, name=f"var.{dtype}.{op}")
            assert_reduced(got.numpy(), inputs, op, 0.5, 2.0, what=f"tf variable {dtype} {op}")

    @tf.function
    def graph(x, rows):
        return (hvd.allreduce(x, op=hvd.Sum), hvd.allgather(rows),
                hvd.broadcast(x, root_rank=size - 1), hvd.reducescatter(
                    tf.tile(tf.reshape(x, [1, -1]), [size * 2, 1]), op=hvd.Sum),
                hvd.alltoall(tf.range(size, dtype=tf.int32) + 10 * me),
                hvd.grouped_allreduce([x, 2.0 * x], op=hvd.Average))

    for step in range(2):  # the second call reuses the traced graph (and the cache)
        x = tf.constant([1.0, 2.0, 3.0]) * (me + 1 + step)
        rows = tf.fill([me + 1, 2], float(me))
        total, gathered, bcast, scattered, exchanged, (avg, avg2) = graph(x, rows)
        scale = sum(r + 1 + step for r in range(size))
        assert np.allclose(total.numpy(), np.array([1.0, 2.0, 3.0]) * scale)
        assert gathered.shape == (sum(r + 1 for r in range(size)), 2)
        assert np.allclose(bcast.numpy(), np.array([1.0, 2.0, 3.0]) * (size + step))
        assert np.allclose(scattered.numpy(), np.tile([1.0, 2.0, 3.0], (2, 1)) * scale)
        assert np.array_equal(exchanged.numpy(), np.arange(size) * 10 + me)
        assert np.allclose(avg.numpy(), np.array([1.0, 2.0, 3.0]) * scale / size)
        assert np.allclose(avg2.numpy(), 2 * avg.numpy())
    hvd.shutdown()


def _model_weights(dtype):
    rng = np.random.default_rng(1234)  # identical start on every rank
    return [tf.Variable(rng.normal(size=(6, 8)).astype(dtype)),
            tf.Variable(np.zeros(8, dtype)), tf.Variable(rng.normal(size=(8, 2)).astype(dtype))]


def _loss(weights, x, y):
    h = tf.tanh(x @ weights[0] + weights[1])
    return tf.reduce_mean((h @ weights[2] - y) ** 2)


def tape_training_matches_one_process(dtype="float64"):
    """N ranks, each on 1/N of every batch, with DistributedGradientTape and a Keras
    optimizer == one process on the whole batch."""
    hvd.init()
    me, size = hvd.rank(), hvd.size()
    rng = np.random.default_rng(7)
    batches = [(rng.normal(size=(4 * size, 6)).astype(dtype),
                rng.normal(size=(4 * size, 2)).astype(dtype)) for _ in range(5)]
    ref, dist = _model_weights(dtype), _model_weights(dtype)
    ref_opt = tf.keras.optimizers.SGD(0.1, momentum=0.9)
    opt = tf.keras.optimizers.SGD(0.1, momentum=0.9)

    @tf.function
    def dist_step(x, y):
        with tf.GradientTape() as tape:
            loss = _loss(dist, x, y)
        grads = hvd.DistributedGradientTape(tape).gradient(loss, dist)
        opt.apply_gradients(zip(grads, dist))

    for x, y in batches:
        with tf.GradientTape() as tape:
            loss = _loss(ref, x, y)
        ref_opt.apply_gradients(zip(tape.gradient(loss, ref), ref))
        dist_step(x[4 * me:4 * me + 4], y[4 * me:4 * me + 4])
    rtol = {"float64": 1e-10, "float32": 1e-5}[dtype]
    for a, b in zip(dist, ref):
        err = np.abs(a.numpy() - b.numpy()).max() / np.abs(b.numpy()).max()
        assert err < rtol, f"{dtype}: off by {err:.2e}"
    hvd.shutdown()


def broadcast_variables_and_objects():
    hvd.init()
    me = hvd.rank()
    vs = [tf.Variable(tf.fill([3], float(me))), tf.Variable(tf.fill([2, 2], me))]
    hvd.broadcast_variables(vs, root_rank=0)
    assert np.all(vs[0].numpy() == 0.0) and np.all(vs[1].numpy() == 0)
    assert hvd.broadcast_object({"from": me}, root_rank=hvd.size() - 1) == {"from": hvd.size() - 1}
    assert hvd.allgather_object(me * 10) == [r * 10 for r in range(hvd.size())]
    hvd.shutdown()


# The gradient reducer's fused path (ringsync/tensorflow/fused.py): shapes include 0, 1,
# scalars and primes; dtypes interleave so that each dtype's buffer gathers tensors from
# all over the list.
FUSED = [((3, 5), "float32"), ((), "float64"), ((0,), "float32"), ((7,), "int32"),
         ((1,), "float32"), ((2, 3, 4), "float64"), ((11,), "bfloat16"), ((13,), "float16"),
         ((5, 1), "int32"), ((4,), "float32")]


def _fused_inputs(rank, op, salt):
    return [rank_input(rank, shape, dtype, op, f"{salt}.{i}")
            for i, (shape, dtype) in enumerate(FUSED)]


def _assert_fused(got, op, salt, size, prescale=1.0, postscale=1.0, what=""):
    every = [_fused_inputs(r, op, salt) for r in range(size)]
    for i, g in enumerate(got):
        assert_reduced(g.numpy(), [inputs[i] for inputs in every], op, prescale, postscale,
                       what=f"{what} tensor {i} {FUSED[i]}")


def gradients_fused_into_one_buffer():
    """fused_allreduce against a numpy reference from every rank's input: mixed dtypes,
    ops, scale factors, eagerly and in a tf.function (twice: the traced graph again), two
    independent calls in one graph; the inputs are left as they were."""
    from ringsync.tensorflow.fused import fused_allreduce
    hvd.init()
    me, size = hvd.rank(), hvd.size()
    for op in ["Sum", "Average", "Min", "Max"]:
        mine = [tf.constant(x) for x in _fused_inputs(me, op, "eager")]
        got = fused_allreduce(mine, f"fused.eager.{op}", getattr(hvd, op))
        _assert_fused(got, op, "eager", size, what=f"eager {op}")
        for t, x in zip(mine, _fused_inputs(me, op, "eager")):  # inputs untouched
            assert np.array_equal(t.numpy().astype(np.float64), x.astype(np.float64))

    @tf.function
    def two_calls(a, b):
        return (fused_allreduce(a, "fused.graph.a", hvd.Sum, 0.5, 2.0),
                fused_allreduce(b, "fused.graph.b", hvd.Average))

    a = [tf.constant(x) for x in _fused_inputs(me, "Sum", "a")]
    b = [tf.constant(x) for x in _fused_inputs(me, "Average", "b")]
    for step in range(2):
        got_a, got_b = two_calls(a, b)
        _assert_fused(got_a, "Sum", "a", size, 0.5, 2.0, what=f"graph a step {step}")
        _assert_fused(got_b, "Average", "b", size, what=f"graph b step {step}")
    # compression: floating tensors travel as float16, come back in their own dtype
    got = fused_allreduce([tf.constant(x) for x in _fused_inputs(me, "Average", "fp16")],
                          "fused.fp16", hvd.Average, compression=hvd.Compression.fp16)
    every = [_fused_inputs(r, "Average", "fp16") for r in range(size)]
    for i, g in enumerate(got):
        want = np.mean([inputs[i].astype(np.float64) for inputs in every], axis=0)
        assert g.dtype == tf.as_dtype(FUSED[i][1]), (i, g.dtype)
        assert np.allclose(g.numpy().astype(np.float64), want, rtol=1e-2, atol=1e-2), i
    _tape_groups_of_mixed_dtypes(me, size)
    hvd.shutdown()


def _tape_groups_of_mixed_dtypes(me, size):
    """A tape inside tf.function: float32 and float64 variables, one explicit group and
    variables in none (each then alone): every gradient is the ranks' mean."""
    dtypes = ["float32", "float64", "float32", "float64", "float32"]
    w = [tf.Variable(np.arange(k + 2, dtype=d) + 1) for k, d in enumerate(dtypes)]

    @tf.function
    def grads(scale):
        with tf.GradientTape() as plain:
            loss = tf.add_n([tf.cast(tf.reduce_sum(v * v), tf.float64) for v in w]) * scale
        tape = hvd.DistributedGradientTape(plain, groups=[[w[0], w[1], w[3]]])
        return tape.gradient(loss, w)

    mean_scale = sum(r + 1 for r in range(size)) / size
    for _ in range(2):
        for k, g in enumerate(grads(tf.constant(float(me + 1), tf.float64))):
            want = 2 * (np.arange(k + 2) + 1) * mean_scale
            assert g.dtype == w[k].dtype and np.allclose(g.numpy(), want, rtol=1e-6), (k, g)


def fused_mismatch_fails_every_rank_then_works():
    """Ranks whose tensors differ in order (the same element count, so the buffers alone
    would match) or in count fail together, eagerly and in a graph, naming the ranks; the
    next call works on every rank."""
    from ringsync.tensorflow.fused import fused_allreduce
    hvd.init()
    me, size = hvd.rank(), hvd.size()
    if size == 1:
        return hvd.shutdown()
    shapes = [(3,), (4,)] if me == 0 else [(4,), (3,)]
    swapped = [tf.ones(s) for s in shapes]
    e = _raises_tf(tf.errors.FailedPreconditionError,
                   lambda: fused_allreduce(swapped, "fused.bad", hvd.Sum))
    assert isinstance(e, hvd.MismatchError) and "ranks [0]" in str(e), e
    good = [tf.ones((3,)), tf.ones((4,))]
    got = fused_allreduce(good, "fused.good", hvd.Sum)
    assert all(np.array_equal(g.numpy(), np.full(g.shape, size)) for g in got)

    @tf.function
    def reduce(ts):
        return fused_allreduce(ts, "fused.graph", hvd.Sum)

    longer = [tf.ones((3 + me,))]
    e = _raises_tf(tf.errors.OpError, lambda: reduce(longer))
    assert "differ between ranks" in str(e) and "ranks [0]" in str(e), e
    for _ in range(2):
        got = reduce([tf.ones((3,))])  # a retrace on the ranks that traced another shape
        assert np.array_equal(got[0].numpy(), np.full(3, size))
    hvd.shutdown()


def _raises_tf(kinds, call):
    try:
        call()
    except kinds as e:
        assert "ringsync" in str(e), e
        return e
    raise AssertionError(f"{call} did not raise {kinds}")
