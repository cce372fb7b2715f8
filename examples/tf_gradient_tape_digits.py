"""Data-parallel training of a small CNN on scikit-learn's bundled digits, with TensorFlow 2
and a custom training loop.

Each rank trains on every size()-th sample of the training set; ringsync's
DistributedGradientTape averages the gradients over all ranks inside the tf.function
step, so every rank takes the same step. Run on 2 ranks with:

    ringsync run -np 2 examples/tf_gradient_tape_digits.py
    mpirun -np 2 python examples/tf_gradient_tape_digits.py --check   # exit 1 below 95% accuracy
"""
import argparse
import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")  # before TensorFlow loads: no C++ chatter

import keras
import numpy as np
import tensorflow as tf
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

import ringsync.tensorflow as hvd

REQUIRED_ACCURACY = 0.95


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=12)
    parser.add_argument("--batch", type=int, default=32,
                        help="global batch size, split across ranks (rounded down to a multiple)")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--check", action="store_true",
                        help=f"exit with status 1 if test accuracy < {REQUIRED_ACCURACY}")
    return parser.parse_args()


def build_model():
    """Two 3x3 convolutions and a linear head for 8x8 grayscale images (logits out).
    keras.Input builds it at once, so its variables exist before the first step."""
    return keras.Sequential([
        keras.Input(shape=(8, 8, 1)),
        keras.layers.Conv2D(16, 3, padding="same", activation="relu"),
        keras.layers.Conv2D(32, 3, padding="same", activation="relu"),
        keras.layers.MaxPooling2D(2),  # 8x8 -> 4x4
        keras.layers.Flatten(),
        keras.layers.Dense(10),
    ])


def load_data(seed):
    """(x_train, y_train, x_test, y_test) as numpy arrays, images shaped (N, 8, 8, 1) in
    [0, 1]. The split depends on the seed only, so every rank sees the same split."""
    digits = load_digits()
    x = (digits.images[..., np.newaxis] / 16.0).astype(np.float32)
    y = digits.target.astype(np.int64)
    x_train, x_test, y_train, y_test = train_test_split(x, y, test_size=0.25, random_state=seed)
    return x_train, y_train, x_test, y_test


def my_shard(*arrays):
    """This rank's part: every size()-th sample, starting at rank()."""
    return [a[hvd.rank()::hvd.size()] for a in arrays]


def steps_per_epoch(n_train, local_batch):
    """The same count on every rank (each allreduce needs every rank): the smallest
    shard holds n_train // size() samples."""
    return (n_train // hvd.size()) // local_batch


def make_train_step(model, optimizer):
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    # Batches all have one shape, so this is traced once: the reduction's name (fixed at
    # tracing) is then the same on every rank and every step. No jit_compile: XLA cannot
    # compile ringsync's reduction (a tf.py_function).
    @tf.function
    def train_step(x, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        tape = hvd.DistributedGradientTape(tape)  # gradient() averages over all ranks
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    return train_step


def train_epoch(train_step, optimizer, x, y, local_batch, steps, rng, first_epoch):
    order = rng.permutation(len(x))
    total_loss = 0.0
    for step in range(steps):
        idx = order[step * local_batch:(step + 1) * local_batch]
        total_loss += float(train_step(tf.constant(x[idx]), tf.constant(y[idx])))
        if first_epoch and step == 0:
            # The optimizer creates its variables (momentum, ...) in the first step; make
            # every rank's state rank 0's, as one must after restoring a checkpoint on
            # rank 0 only.
            hvd.broadcast_variables(optimizer.variables, root_rank=0)
    return total_loss / steps


def test_accuracy(model, x_test, y_test):
    """Accuracy over the whole test set: each rank scores its shard, counts are summed."""
    x_mine, y_mine = my_shard(x_test, y_test)
    predicted = np.argmax(model(x_mine, training=False).numpy(), axis=1)
    counts = tf.constant([np.sum(predicted == y_mine), len(y_mine)], dtype=tf.int64)
    counts = hvd.allreduce(counts, op=hvd.Sum, name="test.counts").numpy()
    return int(counts[0]) / int(counts[1])


def main():
    args = parse_args()
    # Ranks share the host's cores; more threads per rank only contend.
    tf.config.threading.set_intra_op_parallelism_threads(1)
    hvd.init()
    # The global batch (and so the learning rate's meaning) stays put as ranks are added.
    local_batch = max(1, args.batch // hvd.size())

    x_train, y_train, x_test, y_test = load_data(args.seed)
    x_mine, y_mine = my_shard(x_train, y_train)

    keras.utils.set_random_seed(args.seed + hvd.rank())  # ranks start from different weights ...
    model = build_model()
    hvd.broadcast_variables(model.variables, root_rank=0)  # ... and rank 0's win
    optimizer = keras.optimizers.SGD(learning_rate=args.lr, momentum=0.9)
    train_step = make_train_step(model, optimizer)

    steps = steps_per_epoch(len(x_train), local_batch)
    rng = np.random.default_rng(args.seed * 1000 + hvd.rank())
    start = time.perf_counter()
    for epoch in range(args.epochs):
        loss = train_epoch(train_step, optimizer, x_mine, y_mine, local_batch, steps, rng,
                           first_epoch=epoch == 0)
        if hvd.rank() == 0 and ((epoch + 1) % 3 == 0 or epoch + 1 == args.epochs):
            print(f"epoch {epoch + 1}: rank 0 train loss {loss:.4f}", flush=True)
    train_seconds = time.perf_counter() - start

    accuracy = test_accuracy(model, x_test, y_test)
    is_root = hvd.rank() == 0  # remembered: rank() needs the ring, which shutdown() closes
    if is_root:
        print(f"trained {args.epochs} epochs x {steps} steps in {train_seconds:.1f} s")
        print(f"test accuracy on {hvd.size()} ranks: {accuracy:.4f}", flush=True)
    hvd.shutdown()
    # Every rank knows the summed accuracy, so every rank exits with the same status.
    if args.check and accuracy < REQUIRED_ACCURACY:
        if is_root:
            print(f"FAILED: accuracy {accuracy:.4f} < {REQUIRED_ACCURACY}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
