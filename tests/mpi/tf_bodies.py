"""TensorFlow adapter bodies, run on every rank under mpirun (gradients, sparse gradients
and the tape's arguments: tests/mpi/horovod_tf_bodies.py)."""
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import ringsync.tensorflow as hvd  # noqa: E402

from .reference import assert_reduced, rank_input  # noqa: E402

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
