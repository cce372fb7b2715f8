"""One job, two or three frameworks: even ranks train a torch DDP model, odd ranks a Keras
model (with `--frameworks torch keras jax`: rank % 3 picks torch, Keras or JAX), and after
each epoch all of them average their parameters over ringsync's ring.

The model is a float64 softmax regression on scikit-learn's 8x8 digits (one
torch.nn.Linear(64, 10) on the torch ranks, one keras Dense(10) on the Keras ranks), from
the same initial weights everywhere. Every step takes the same global batch on every
rank: the torch ranks share its first part (DDP on a torch.distributed "ringsync" group of
the torch ranks), the Keras ranks the next (hvd.DistributedOptimizer on a process set of
the Keras ranks), the JAX ranks the last (ringsync.jax's DistributedOptimizer around
optax.sgd, on a process set of the JAX ranks, in a jitted step). At the end of each epoch
every rank averages weight and bias with ringsync.allreduce over the whole job and loads
the average back: the frameworks meet on one ring.

    ringsync run -np 4 examples/mixed_ddp_keras.py
    ringsync run -np 4 examples/mixed_ddp_keras.py --check --epochs 2   # exit 1 unless
        # every rank's parameters match a numpy reference of the procedure (rtol 1e-9)
    ringsync run -np 3 examples/mixed_ddp_keras.py --frameworks torch keras jax --batch 60
"""
import argparse
import hashlib
import os
import shutil
import sys
import tempfile

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import numpy as np  # noqa: E402
from sklearn.datasets import load_digits  # noqa: E402
from sklearn.model_selection import train_test_split  # noqa: E402

import ringsync  # noqa: E402

CLASSES, FEATURES = 10, 64
RTOL = 1e-9


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--batch", type=int, default=64, help="global batch size")
    parser.add_argument("--lr", type=float, default=0.5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--frameworks", nargs="+", default=["torch", "keras"],
                        choices=["torch", "keras", "jax"],
                        help="rank r runs frameworks[r %% len(frameworks)]; torch first")
    parser.add_argument("--check", action="store_true",
                        help=f"exit with status 1 unless the parameters match a numpy "
                             f"reference of the whole procedure to rtol {RTOL}")
    return parser.parse_args()


# --- what every rank shares: data, batches, initial weights, the flat layout -------------

def load_data(seed):
    """(x_train, x_test, y_train, y_test): float64 rows of 64 pixels in [0, 1]; the same
    split on every rank."""
    digits = load_digits()
    x = digits.data.astype(np.float64) / 16.0
    return train_test_split(x, digits.target, test_size=0.25, random_state=seed)


def global_batches(n, batch, seed, epoch):
    """The epoch's global batches (index arrays), the same on every rank: a permutation
    seeded by the epoch, the last partial batch dropped."""
    order = np.random.default_rng([seed, epoch]).permutation(n)
    return [order[s * batch:(s + 1) * batch] for s in range(n // batch)]


def my_rows(batch, side, index, count, sides):
    """This rank's rows of a global batch: side s of `sides` takes its s-th part, shared
    equally among the side's `count` ranks."""
    part = len(batch) // sides
    rows = batch[side * part:(side + 1) * part]
    share = part // count
    return rows[index * share:(index + 1) * share]


def initial_weights(seed):
    """(weight (10, 64), bias (10,)) in torch's layout, drawn from a fixed seed so that every
    rank, whatever its framework, starts from the very same numbers."""
    rng = np.random.default_rng(seed)
    return rng.normal(0.0, 0.01, (CLASSES, FEATURES)), rng.normal(0.0, 0.01, CLASSES)


def flat(weight, bias):
    return np.concatenate([weight.ravel(), bias])


def unflat(params):
    return params[:-CLASSES].reshape(CLASSES, FEATURES), params[-CLASSES:]


def digest(params):
    return hashlib.sha256(np.ascontiguousarray(params).tobytes()).hexdigest()[:16]


# --- torch side ------------------------------------------------------------------------

class TorchSide:
    """A DDP softmax regression on a torch.distributed group of the torch ranks."""

    def __init__(self, args, torch_set):
        import torch
        import torch.distributed as dist
        import ringsync.torch.distributed  # noqa: F401  (registers the "ringsync" backend)
        self.torch, self.dist = torch, dist
        torch.set_num_threads(1)  # ranks share the host's cores
        self.store_dir = self._shared_store_dir(torch_set)
        # The job's env:// variables describe all ranks; this group is the torch ranks only,
        # so its rank, size and rendezvous are given explicitly.
        dist.init_process_group("ringsync", init_method=f"file://{self.store_dir}/store",
                                rank=torch_set.rank(), world_size=torch_set.size())
        self.model = torch.nn.parallel.DistributedDataParallel(
            torch.nn.Linear(FEATURES, CLASSES).double())
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=args.lr)

    @staticmethod
    def _shared_store_dir(torch_set):
        """A fresh directory for the group's FileStore, made by rank 0 and sent to the other
        torch ranks over the torch process set (ranks on one host, or a shared disk)."""
        first = torch_set.ranks[0]
        made = tempfile.mkdtemp(prefix="mixed-ddp-keras-") if ringsync.rank() == first else None
        return ringsync.broadcast_object(made, first, name="mixed.store_dir",
                                         process_set=torch_set)

    def train_step(self, x, y):
        torch = self.torch
        self.optimizer.zero_grad()
        logits = self.model(torch.from_numpy(x))
        torch.nn.functional.cross_entropy(logits, torch.from_numpy(y)).backward()
        self.optimizer.step()  # DDP averaged the gradients over the torch ranks

    def params(self):
        layer = self.model.module
        return flat(layer.weight.detach().numpy(), layer.bias.detach().numpy())

    def load(self, params):
        weight, bias = unflat(params)
        with self.torch.no_grad():
            self.model.module.weight.copy_(self.torch.from_numpy(weight))
            self.model.module.bias.copy_(self.torch.from_numpy(bias))

    def accuracy(self, x, y):
        with self.torch.no_grad():
            predicted = self.model.module(self.torch.from_numpy(x)).argmax(dim=1).numpy()
        return float(np.mean(predicted == y))

    def close(self):
        self.dist.destroy_process_group()


# --- Keras side ------------------------------------------------------------------------

class KerasSide:
    """A Keras softmax regression whose gradients average over the Keras process set."""

    def __init__(self, args, keras_set):
        import keras
        import tensorflow as tf
        import ringsync.tensorflow.keras as hvd
        self.tf = tf
        keras.config.set_floatx("float64")
        self.model = keras.Sequential([keras.Input((FEATURES,)), keras.layers.Dense(CLASSES)])
        self.loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
        self.optimizer = hvd.DistributedOptimizer(keras.optimizers.SGD(args.lr),
                                                  process_set=keras_set)

    def train_step(self, x, y):
        variables = self.model.trainable_variables
        with self.tf.GradientTape() as tape:
            loss = self.loss(y, self.model(x, training=True))
        # apply() averages the gradients over the Keras ranks before the SGD step
        self.optimizer.apply(tape.gradient(loss, variables), variables)

    def params(self):
        kernel, bias = self.model.layers[-1].get_weights()
        return flat(kernel.T, bias)  # Keras keeps (64, 10): torch's layout is (10, 64)

    def load(self, params):
        weight, bias = unflat(params)
        self.model.layers[-1].set_weights([weight.T, bias])

    def close(self):
        pass


# --- JAX side --------------------------------------------------------------------------

class JaxSide:
    """A JAX softmax regression in a jitted step: ringsync.jax's DistributedOptimizer
    averages the gradients over the JAX process set (the core's XLA custom call)."""

    def __init__(self, args, jax_set):
        import jax
        jax.config.update("jax_enable_x64", True)
        import jax.numpy as jnp
        import optax
        import ringsync.jax as hvd
        self.jnp = jnp
        tx = hvd.DistributedOptimizer(optax.sgd(args.lr), process_set=jax_set)

        def loss(params, x, y):
            logits = x @ params["weight"].T + params["bias"]
            return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

        @jax.jit
        def step(params, opt_state, x, y):
            updates, opt_state = tx.update(jax.grad(loss)(params, x, y), opt_state, params)
            return optax.apply_updates(params, updates), opt_state

        self.tx, self.step = tx, step
        self.state = None

    def train_step(self, x, y):
        self.state = self.step(*self.state, x, y)

    def params(self):
        p = self.state[0]
        return flat(np.asarray(p["weight"]), np.asarray(p["bias"]))

    def load(self, params):
        weight, bias = unflat(params)
        p = {"weight": self.jnp.asarray(weight), "bias": self.jnp.asarray(bias)}
        self.state = (p, self.tx.init(p))  # (plain SGD keeps no state to lose)

    def close(self):
        pass


SIDES = {"torch": TorchSide, "keras": KerasSide, "jax": JaxSide}


# --- the procedure, and its numpy reference --------------------------------------------

def average_over_job(side, epoch):
    """Every rank's parameters, averaged over the whole job on ringsync's ring, loaded back:
    the one place where torch and Keras ranks meet."""
    side.load(ringsync.allreduce(side.params(), op=ringsync.Average,
                                 name=f"mixed.params.epoch{epoch}"))


def train(side, args, x, y, side_index, index, count):
    for epoch in range(args.epochs):
        for batch in global_batches(len(x), args.batch, args.seed, epoch):
            rows = my_rows(batch, side_index, index, count, len(args.frameworks))
            side.train_step(x[rows], y[rows])
        average_over_job(side, epoch)


def softmax_regression_step(params, x, y, lr):
    """One plain gradient-descent step of mean softmax cross-entropy, in float64."""
    weight, bias = unflat(params)
    logits = x @ weight.T + bias
    p = np.exp(logits - logits.max(axis=1, keepdims=True))
    p /= p.sum(axis=1, keepdims=True)
    p[np.arange(len(y)), y] -= 1.0
    p /= len(y)
    return params - lr * flat(p.T @ x, p.sum(axis=0))


def reference(args, x, y, counts):
    """The procedure as one process per framework side, each on its part of every batch,
    then the job's average (each side weighted by its number of ranks) after each epoch."""
    start = flat(*initial_weights(args.seed))
    sides = [start.copy() for _ in counts]
    for epoch in range(args.epochs):
        for batch in global_batches(len(x), args.batch, args.seed, epoch):
            for s in range(len(counts)):
                rows = my_rows(batch, s, 0, 1, len(counts))
                sides[s] = softmax_regression_step(sides[s], x[rows], y[rows], args.lr)
        mean = sum(c * p for c, p in zip(counts, sides)) / sum(counts)
        sides = [mean.copy() for _ in counts]
    return sides[0]


def check(params, want, label):
    """True when params match the reference; prints this rank's check line either way."""
    if np.allclose(params, want, rtol=RTOL, atol=0.0):
        largest = np.max(np.abs(params - want) / np.maximum(np.abs(want), 1e-300))
        print(f"{label}: check passed, largest relative difference {largest:.2e}", flush=True)
        return True
    bad = np.flatnonzero(~np.isclose(params, want, rtol=RTOL, atol=0.0))
    print(f"{label}: check FAILED, {len(bad)} of {len(want)} parameters differ "
          f"beyond rtol {RTOL}; first ones (index: got, reference):", flush=True)
    for i in bad[:10]:
        print(f"{label}:   {i}: {float(params[i])!r}, {float(want[i])!r}", flush=True)
    return False


# --- the job ---------------------------------------------------------------------------

def make_process_sets(sides):
    """One process set per framework side (side s: the ranks r with r % sides == s): every
    rank registers them all, in this order, as Horovod requires, even the ones it is not
    in."""
    size = ringsync.size()
    return [ringsync.add_process_set(list(range(s, size, sides))) for s in range(sides)]


def exit_on_bad_sizes(args, sets):
    part = args.batch // len(sets)
    if args.batch % len(sets) or any(part % s.size() for s in sets):
        # DDP and the DistributedOptimizers average per-rank means: equal shares keep that
        # the mean over the side's part of the batch
        sys.exit(f"the batch ({args.batch}) must split into {len(sets)} equal parts, each "
                 f"dividing among its side's ranks ({[s.size() for s in sets]})")


def main():
    args = parse_args()
    ringsync.init()
    kinds = args.frameworks
    if ringsync.size() < len(kinds) or kinds[0] != "torch" or len(set(kinds)) != len(kinds):
        sys.exit(f"needs at least {len(kinds)} ranks, and --frameworks starting with torch, "
                 f"each once: rank r runs frameworks[r % {len(kinds)}]")
    sets = make_process_sets(len(kinds))
    exit_on_bad_sizes(args, sets)
    rank = ringsync.rank()
    side_index = rank % len(kinds)
    my_set = sets[side_index]
    side = SIDES[kinds[side_index]](args, my_set)
    side.load(flat(*initial_weights(args.seed)))
    x_train, x_test, y_train, y_test = load_data(args.seed)
    train(side, args, x_train, y_train, side_index, my_set.rank(), my_set.size())
    params = side.params()
    label = f"rank {rank} ({kinds[side_index]})"
    if rank == 0:
        print(f"test accuracy of the averaged model after {args.epochs} epochs on "
              f"{ringsync.size()} ranks: {side.accuracy(x_test, y_test):.4f}", flush=True)
    print(f"{label}: digest {digest(params)}", flush=True)
    passed = not args.check or check(params, reference(args, x_train, y_train,
                                                       [s.size() for s in sets]), label)
    close(side)
    sys.exit(0 if passed else 1)


def close(side):
    """Ends the torch group, then (once no torch rank uses it) removes its FileStore."""
    side.close()
    ringsync.barrier()
    if getattr(side, "store_dir", None) and ringsync.rank() == 0:
        shutil.rmtree(side.store_dir, ignore_errors=True)
    ringsync.shutdown()


if __name__ == "__main__":
    main()
