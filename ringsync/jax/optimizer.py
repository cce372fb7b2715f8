"""ringsync.jax.DistributedOptimizer: an optax GradientTransformation that averages the
gradients over the ranks, then applies the user's transformation.

The whole gradient pytree travels as one buffer per dtype: the leaves of a dtype are
concatenated (inside a jitted step XLA fuses that copy), reduced in one call, and cut
back. Leaves of a dtype that the compression changes travel in the wire dtype."""
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from ringsync.errors import UsageError
from ringsync.ops import ReduceOp

from .compression import Compression
from .mpi_ops import PS, Average, concatenated_reduce, reduce_tree


def fused_allreduce(tree, op=Average, prescale_factor=1.0, postscale_factor=1.0,
                    compression=Compression.none, process_set=PS):
    """Every leaf of a pytree reduced over the ranks with one allreduce per dtype (the
    leaves of a dtype concatenated); returns the same structure. Differentiable for Sum
    and Average."""
    return reduce_tree(tree, op, compression,
                       lambda xs, _: concatenated_reduce(xs, op, prescale_factor,
                                                         postscale_factor, None, process_set),
                       "fused_allreduce")


def DistributedOptimizer(optimizer, compression=Compression.none, backward_passes_per_step=1,
                         op=Average, gradient_predivide_factor=1.0, process_set=PS):
    """optimizer (an optax.GradientTransformation) with its updates first reduced over
    the set's ranks (Average by default; Sum, or Adasum on the eager path). The result is
    an optax.GradientTransformation, usable inside a jitted step and under
    optax.MultiSteps.

    backward_passes_per_step=k: gradients of k calls are accumulated locally and their
    mean (as optax.MultiSteps takes it, but in the gradients' own dtype) is reduced and
    applied on every k-th call; the others return zero updates.
    gradient_predivide_factor=f (Average only): gradients are divided by f before the
    sum and by size/f after it, as in Horovod."""
    if backward_passes_per_step < 1:
        raise UsageError(f"ringsync.jax.DistributedOptimizer: backward_passes_per_step must "
                         f"be at least 1, not {backward_passes_per_step}")
    op = ReduceOp(op)
    if gradient_predivide_factor != 1.0 and op != Average:
        raise UsageError("ringsync.jax.DistributedOptimizer: gradient_predivide_factor "
                         "needs op=Average")
    prescale, postscale = 1.0 / gradient_predivide_factor, gradient_predivide_factor

    def update(updates, state, params=None, **extra):
        reduced = fused_allreduce(updates, op, prescale, postscale, compression, process_set)
        return optimizer.update(reduced, state, params, **extra)

    tx = optax.GradientTransformation(optimizer.init, update)
    return tx if backward_passes_per_step == 1 else _every_k(tx, backward_passes_per_step)


class AccumulationState(NamedTuple):
    inner: Any     # the wrapped transformation's state
    sums: Any      # the gradients of the calls since the last update, summed
    calls: Any     # how many (an int32 scalar)


def _every_k(tx, k):
    """tx applied to the mean of every k calls' gradients (accumulated in their own
    dtype: optax.MultiSteps keeps float32 by default); zero updates in between. Every
    rank takes the same branch at the same call, so the reduction inside tx runs on all
    of them together."""

    def init(params):
        return AccumulationState(tx.init(params), jax.tree.map(jnp.zeros_like, params),
                                 jnp.zeros([], jnp.int32))

    def update(updates, state, params=None, **extra):
        sums = jax.tree.map(lambda s, g: s + g.astype(s.dtype), state.sums, updates)
        calls = state.calls + 1

        def apply(_):
            mean = jax.tree.map(lambda s, g: (s / k).astype(g.dtype), sums, updates)
            out, inner = tx.update(mean, state.inner, params, **extra)
            return out, AccumulationState(inner, jax.tree.map(jnp.zeros_like, sums),
                                          jnp.zeros([], jnp.int32))

        def hold(_):
            shapes = jax.eval_shape(lambda: tx.update(updates, state.inner, params, **extra)[0])
            zeros = jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), shapes)
            return zeros, AccumulationState(state.inner, sums, calls)

        return jax.lax.cond(calls == k, apply, hold, None)

    return optax.GradientTransformation(init, update)
