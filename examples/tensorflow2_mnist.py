"""Horovod's tensorflow2_mnist.py example (a GradientTape loop), with only the import
changed (`import ringsync.tensorflow as hvd`), the MNIST download replaced by
scikit-learn's bundled 8x8 digits (Horovod's model on 8x8 images: it trains
in seconds), and one Keras 3 change that is not ringsync's: an optimizer's `variables` is
a list, no longer a method. Run with:

    ringsync run -np 2 examples/tensorflow2_mnist.py
    mpirun -np 2 python examples/tensorflow2_mnist.py --check   # exit 1 below 85%
"""
import argparse
import os
import sys
import tempfile

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import tensorflow as tf  # noqa: E402
from sklearn.datasets import load_digits  # noqa: E402

import ringsync.tensorflow as hvd  # noqa: E402

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
    loss = tf.losses.SparseCategoricalCrossentropy()

    # Horovod: adjust learning rate based on number of GPUs.
    opt = tf.optimizers.Adam(0.001 * hvd.size())

    checkpoint_dir = os.path.join(tempfile.mkdtemp(prefix="ringsync-mnist-"), 'checkpoints')
    checkpoint = tf.train.Checkpoint(model=mnist_model, optimizer=opt)

    @tf.function
    def training_step(images, labels, first_batch):
        with tf.GradientTape() as tape:
            probs = mnist_model(images, training=True)
            loss_value = loss(labels, probs)

        # Horovod: add Horovod Distributed GradientTape.
        tape = hvd.DistributedGradientTape(tape)

        grads = tape.gradient(loss_value, mnist_model.trainable_variables)
        opt.apply_gradients(zip(grads, mnist_model.trainable_variables))

        # Horovod: broadcast initial variable states from rank 0 to all other processes.
        # This is necessary to ensure consistent initialization of all workers when
        # training is started with random weights or restored from a checkpoint.
        #
        # Note: broadcast should be done after the first gradient step to ensure optimizer
        # initialization.
        if first_batch:
            hvd.broadcast_variables(mnist_model.variables, root_rank=0)
            hvd.broadcast_variables(opt.variables, root_rank=0)

        return loss_value

    # Horovod: adjust number of steps based on number of GPUs.
    for batch, (images_, labels_) in enumerate(dataset.take(args.steps // hvd.size())):
        loss_value = training_step(images_, labels_, batch == 0)

        if batch % 10 == 0 and hvd.local_rank() == 0:
            print('Step #%d\tLoss: %.6f' % (batch, loss_value))

    # Horovod: save checkpoints only on worker 0 to prevent other workers from
    # corrupting it.
    if hvd.rank() == 0:
        checkpoint.save(checkpoint_dir)

    predictions = tf.argmax(mnist_model(images[1500:], training=False), axis=1)
    accuracy = float(tf.reduce_mean(tf.cast(predictions == labels[1500:], tf.float32)))
    # Every rank must hold the same weights: a rank that drifted would show here.
    accuracies = hvd.allgather_object(accuracy)
    if hvd.rank() == 0:
        print(f"test accuracy on {hvd.size()} ranks: {accuracy:.4f} (every rank: {accuracies})")
    return min(accuracies) if len(set(accuracies)) == 1 else -1.0


if __name__ == '__main__':
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=600, help="steps on one rank")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--check", action="store_true",
                        help=f"exit with status 1 if test accuracy < {REQUIRED_ACCURACY}")
    arguments = parser.parse_args()
    result = main(arguments)
    if arguments.check and result < REQUIRED_ACCURACY:
        sys.exit(1)
