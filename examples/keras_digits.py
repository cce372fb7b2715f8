"""Data-parallel training of a small CNN on scikit-learn's bundled digits, with Keras 3 fit().

Each rank fits on every size()-th sample of the training set; ringsync's
DistributedOptimizer averages the gradients over all ranks inside the train step, so
every rank takes the same step. Run on 2 ranks with:

    ringsync run -np 2 examples/keras_digits.py
    mpirun -np 2 python examples/keras_digits.py --check   # exit 1 below 95% accuracy
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

import ringsync.tensorflow.keras as hvd

REQUIRED_ACCURACY = 0.95


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=12)
    parser.add_argument("--batch", type=int, default=32,
                        help="global batch size, split across ranks (rounded down to a multiple)")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--warmup-epochs", type=int, default=2,
                        help="epochs over which the learning rate ramps from lr / size() to lr")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--check", action="store_true",
                        help=f"exit with status 1 if test accuracy < {REQUIRED_ACCURACY}")
    return parser.parse_args()


def build_model():
    """Two 3x3 convolutions and a linear head for 8x8 grayscale images (logits out)."""
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


def equal_shard(x, y, n_train, local_batch):
    """This rank's training shard, cut to the same whole number of batches on every rank:
    each step's gradient allreduce needs every rank, so all ranks must take as many steps
    (and, with a fixed batch shape, fit() never retraces on a short last batch)."""
    steps = (n_train // hvd.size()) // local_batch  # the smallest shard decides
    keep = steps * local_batch
    return x[:keep], y[:keep], steps


def test_accuracy(model, x_test, y_test):
    """Accuracy over the whole test set: each rank scores its shard, counts are summed."""
    x_mine, y_mine = my_shard(x_test, y_test)
    predicted = np.argmax(model.predict(x_mine, verbose=0), axis=1)
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
    x_mine, y_mine, steps = equal_shard(x_mine, y_mine, len(x_train), local_batch)

    # Ranks start from different weights (and shuffle differently) ...
    keras.utils.set_random_seed(args.seed + hvd.rank())
    model = build_model()
    optimizer = keras.optimizers.SGD(learning_rate=args.lr, momentum=0.9)
    # XLA cannot compile ringsync's reduction, so the train step is compiled without it.
    model.compile(optimizer=hvd.DistributedOptimizer(optimizer),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"], jit_compile=False)
    callbacks = [
        hvd.BroadcastGlobalVariablesCallback(0),  # ... and rank 0's weights win
        hvd.MetricAverageCallback(),  # logged loss/accuracy: the mean over ranks
        hvd.LearningRateWarmupCallback(args.lr, warmup_epochs=args.warmup_epochs,
                                       verbose=1),
    ]

    start = time.perf_counter()
    model.fit(x_mine, y_mine, batch_size=local_batch, epochs=args.epochs, shuffle=True,
              callbacks=callbacks, verbose=2 if hvd.rank() == 0 else 0)
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
