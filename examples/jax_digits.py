"""A small JAX MLP on scikit-learn's bundled digits, data-parallel with ringsync.jax: optax
Adam wrapped in hvd.DistributedOptimizer inside a jitted train step.

    ringsync run -np 2 python examples/jax_digits.py
    ... examples/jax_digits.py --check          # exit 1 below 95% test accuracy
    ... examples/jax_digits.py --check-reference  # the ranks' parameters against one
                                                  # process on the whole batches (float64)

Each rank takes every size-th row of each global batch; the optimizer averages the
gradients over the ranks, so every rank ends with the parameters one process would reach
on the whole batches.
"""
import argparse
import sys

import jax

jax.config.update("jax_enable_x64", True)  # (float64, for --check-reference's tolerance)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from sklearn.datasets import load_digits  # noqa: E402
from sklearn.model_selection import train_test_split  # noqa: E402

import ringsync.jax as hvd  # noqa: E402

REQUIRED_ACCURACY = 0.95


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=15)
    parser.add_argument("--batch", type=int, default=60, help="global batch size")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--dtype", default="float32", choices=["float32", "float64"])
    parser.add_argument("--check", action="store_true",
                        help=f"exit with status 1 if test accuracy < {REQUIRED_ACCURACY}")
    parser.add_argument("--check-reference", action="store_true",
                        help="compare with one process training on the whole batches")
    return parser.parse_args()


def init_params(key, dtype):
    k1, k2 = jax.random.split(key)
    return {"hidden": {"w": (jax.random.normal(k1, (64, 64)) / 8).astype(dtype),
                       "b": jnp.zeros(64, dtype)},
            "out": {"w": (jax.random.normal(k2, (64, 10)) / 8).astype(dtype),
                    "b": jnp.zeros(10, dtype)}}


def logits(params, x):
    h = jax.nn.relu(x @ params["hidden"]["w"] + params["hidden"]["b"])
    return h @ params["out"]["w"] + params["out"]["b"]


def loss(params, x, y):
    return optax.softmax_cross_entropy_with_integer_labels(logits(params, x), y).mean()


def make_step(tx):
    @jax.jit
    def step(params, opt_state, x, y):
        grads = jax.grad(loss)(params, x, y)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state
    return step


def batches(x, y, batch, epochs, rank=0, size=1):
    """Every global batch of every epoch (shuffled the same way on every rank), this
    rank's strided share of each."""
    order = np.random.default_rng(0)
    for _ in range(epochs):
        perm = order.permutation(len(x))
        for start in range(0, len(x) - batch + 1, batch):
            rows = perm[start:start + batch][rank::size]
            yield x[rows], y[rows]


def train(tx, params, x, y, args, rank=0, size=1):
    step, opt_state = make_step(tx), tx.init(params)
    for bx, by in batches(x, y, args.batch, args.epochs, rank, size):
        params, opt_state = step(params, opt_state, bx, by)
    return params


def main():
    args = parse_args()
    hvd.init()
    if args.batch % hvd.size():
        sys.exit(f"--batch {args.batch} must be a multiple of the {hvd.size()} ranks")
    data = load_digits()
    x_train, x_test, y_train, y_test = train_test_split(
        (data.data / 16.0).astype(args.dtype), data.target.astype(np.int32), test_size=0.25,
        random_state=0)
    # Every rank starts from rank 0's parameters.
    params = hvd.broadcast_parameters(init_params(jax.random.PRNGKey(hvd.rank()), args.dtype),
                                      root_rank=0)
    tx = hvd.DistributedOptimizer(optax.adam(args.lr))
    params = train(tx, params, x_train, y_train, args, hvd.rank(), hvd.size())
    accuracy = float((logits(params, x_test).argmax(1) == y_test).mean())
    if hvd.rank() == 0:
        print(f"test accuracy {accuracy:.4f} on {hvd.size()} ranks", flush=True)
    status = 0
    if args.check and accuracy < REQUIRED_ACCURACY:
        print(f"rank {hvd.rank()}: accuracy {accuracy:.4f} < {REQUIRED_ACCURACY}", flush=True)
        status = 1
    if args.check_reference:
        alone = train(optax.adam(args.lr), init_params(jax.random.PRNGKey(0), args.dtype),
                      x_train, y_train, args)
        error = max(float(jnp.max(jnp.abs(a - b)))
                    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(alone)))
        tolerance = 1e-9 if args.dtype == "float64" else 1e-5
        print(f"rank {hvd.rank()}: largest difference from one process {error:.3g} "
              f"(tolerance {tolerance:g})", flush=True)
        status = status or int(error > tolerance)
    hvd.shutdown()
    sys.exit(status)


if __name__ == "__main__":
    main()
