"""Ranks of one job using different frameworks: rank % 4 == 0 reduces torch tensors,
1 TensorFlow tensors, 2 numpy arrays, 3 JAX arrays (its allreduces inside jax.jit: the
core's XLA custom call), under the same names; every rank gets the same bytes."""
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import numpy as np  # noqa: E402

from tests.common.reference import assert_reduced, rank_input  # noqa: E402


def _framework(rank):
    return ["torch", "tensorflow", "numpy", "jax"][rank % 4]


def _jax_rank():
    import jax
    jax.config.update("jax_enable_x64", True)
    import jax.numpy as jnp
    import ringsync.jax as hvd

    class Jitted:  # hvd's names, with allreduce compiled into a jitted function
        allgather, broadcast = hvd.allgather, hvd.broadcast
        Sum, Average, Max = hvd.Sum, hvd.Average, hvd.Max

        @staticmethod
        def allreduce(x, op, name):
            return jax.jit(lambda t: hvd.allreduce(t, op=op, name=name))(x)

    return Jitted, jnp.asarray, np.asarray


def mixed_frameworks_agree():
    import ringsync
    ringsync.init()
    me, size = ringsync.rank(), ringsync.size()
    kind = _framework(me)
    if kind == "torch":
        import torch
        import ringsync.torch as hvd
        to, back = torch.from_numpy, lambda t: t.numpy()
    elif kind == "tensorflow":
        import tensorflow as tf
        import ringsync.tensorflow as hvd
        to, back = tf.constant, lambda t: t.numpy()
    elif kind == "jax":
        hvd, to, back = _jax_rank()
    else:
        hvd, to, back = ringsync, (lambda a: a), (lambda a: a)
    for dtype in ["float32", "float64", "int32"]:
        for op in ["Sum", "Average", "Max"]:
            inputs = [rank_input(r, (33, 2), dtype, op, "mixed") for r in range(size)]
            got = back(hvd.allreduce(to(inputs[me]), op=getattr(hvd, op), name=f"mix.{dtype}.{op}"))
            assert_reduced(got, inputs, op, what=f"{kind} rank {me}: {dtype} {op}")
            # Every rank holds the very same bytes, whatever its framework.
            assert np.array_equal(ringsync.broadcast(got, 0, name=f"mix.check.{dtype}.{op}"), got)
    parts = [np.full((r + 1, 2), r, np.float32) for r in range(size)]
    assert np.array_equal(back(hvd.allgather(to(parts[me]), name="mix.gather")), np.concatenate(parts))
    assert np.array_equal(back(hvd.broadcast(to(parts[me][:1]), size - 1, name="mix.bcast")),
                          parts[size - 1][:1])
    ringsync.shutdown()
