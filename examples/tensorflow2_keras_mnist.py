"""Horovod's tensorflow2_keras_mnist.py example, with only the import changed
(`import ringsync.tensorflow.keras as hvd`), the MNIST download replaced by scikit-learn's
bundled 8x8 digits (Horovod's model on 8x8 images: it trains
in seconds), and two Keras 3 changes that are not ringsync's: compile() no longer takes
`experimental_run_tf_function`, and checkpoints end in `.keras`. Run with:

    ringsync run -np 2 examples/tensorflow2_keras_mnist.py
    mpirun -np 2 python examples/tensorflow2_keras_mnist.py --check   # exit 1 below 85%
"""
import argparse
import os
import sys
import tempfile

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import tensorflow as tf  # noqa: E402
from sklearn.datasets import load_digits  # noqa: E402

import ringsync.tensorflow.keras as hvd  # noqa: E402

REQUIRED_ACCURACY = 0.85


def load_data():
    """(images, labels) in MNIST's layout (HxWx1 floats in [0, 1], int64 labels), 8x8."""
    digits = load_digits()
    return (tf.constant(digits.images[..., None] / 16.0, tf.float32),
            tf.constant(digits.target, tf.int64))


def main(args):
    # Horovod: initialize Horovod.
    hvd.init()

    # Horovod: pin GPU to be used to process local rank (one GPU per process)
    gpus = tf.config.experimental.list_physical_devices('GPU')
    for gpu in gpus:
        tf.config.experimental.set_memory_growth(gpu, True)
    if gpus:
        tf.config.experimental.set_visible_devices(gpus[hvd.local_rank()], 'GPU')

    images, labels = load_data()
    dataset = tf.data.Dataset.from_tensor_slices((images[:1500], labels[:1500]))
    dataset = dataset.repeat().shuffle(10000, seed=hvd.rank()).batch(args.batch_size)

    mnist_model = tf.keras.Sequential([
        tf.keras.layers.Conv2D(32, [3, 3], activation='relu'),
        tf.keras.layers.Conv2D(64, [3, 3], activation='relu'),
        tf.keras.layers.MaxPooling2D(pool_size=(2, 2)),
        tf.keras.layers.Dropout(0.25),
        tf.keras.layers.Flatten(),
        tf.keras.layers.Dense(128, activation='relu'),
        tf.keras.layers.Dropout(0.5),
        tf.keras.layers.Dense(10, activation='softmax')
    ])

    # Horovod: adjust learning rate based on number of GPUs.
    scaled_lr = 0.001 * hvd.size()
    opt = tf.optimizers.Adam(scaled_lr)

    # Horovod: add Horovod DistributedOptimizer.
    opt = hvd.DistributedOptimizer(
        opt, backward_passes_per_step=1, average_aggregated_gradients=True)

    mnist_model.compile(loss=tf.losses.SparseCategoricalCrossentropy(),
                        optimizer=opt,
                        metrics=['accuracy'])

    callbacks = [
        # Horovod: broadcast initial variable states from rank 0 to all other processes.
        hvd.callbacks.BroadcastGlobalVariablesCallback(0),

        # Horovod: average metrics among workers at the end of every epoch.
        hvd.callbacks.MetricAverageCallback(),

        # Horovod: using `lr = 1.0 * hvd.size()` from the very beginning leads to worse
        # final accuracy. Scale the learning rate `lr = 1.0` ---> `lr = 1.0 * hvd.size()`
        # during the first three epochs.
        hvd.callbacks.LearningRateWarmupCallback(initial_lr=scaled_lr, warmup_epochs=3,
                                                 verbose=1),
    ]

    # Horovod: save checkpoints only on worker 0 to prevent other workers from corrupting them.
    if hvd.rank() == 0:
        folder = tempfile.mkdtemp(prefix="ringsync-mnist-")
        callbacks.append(tf.keras.callbacks.ModelCheckpoint(
            os.path.join(folder, 'checkpoint-{epoch}.keras')))

    # Horovod: write logs on worker 0.
    verbose = 1 if hvd.rank() == 0 else 0

    # Train the model.
    # Horovod: adjust number of steps based on number of GPUs.
    mnist_model.fit(dataset, steps_per_epoch=args.steps // hvd.size(), callbacks=callbacks,
                    epochs=args.epochs, verbose=verbose)

    _, accuracy = mnist_model.evaluate(images[1500:], labels[1500:], verbose=0)
    if hvd.rank() == 0:
        print(f"test accuracy on {hvd.size()} ranks: {accuracy:.4f}")
    return accuracy


if __name__ == '__main__':
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=6)
    parser.add_argument("--steps", type=int, default=120, help="steps per epoch on one rank")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--check", action="store_true",
                        help=f"exit with status 1 if test accuracy < {REQUIRED_ACCURACY}")
    arguments = parser.parse_args()
    result = main(arguments)
    if arguments.check and result < REQUIRED_ACCURACY:
        sys.exit(1)
