"""Keras callbacks for ringsync (horovod.tensorflow.keras.callbacks): start every rank
from the same weights, average metrics over ranks, schedule and warm up the learning rate."""
import numpy as np
import keras
import tensorflow as tf

from ringsync.tensorflow import Average, allreduce, broadcast_variables, rank, size


def _train_without_xla(model):
    """XLA cannot compile the reduction (a tf.py_function into ringsync's core): rebuild the
    train step without it, and say so, rather than let the first step fail."""
    if not getattr(model, "jit_compile", False):
        return
    warnings.warn("ringsync: XLA cannot compile the gradient reduction, so this model is "
                  "trained with jit_compile=False (compile it that way to silence this)",
                  stacklevel=3)
    model.jit_compile = False
    model.make_train_function(force=True)


class BroadcastGlobalVariablesCallback(keras.callbacks.Callback):
    """Make every rank start from root_rank's weights (at the start of training) and
    optimizer state (after the first batch, once the optimizer has created it)."""

    def __init__(self, root_rank=0, process_set=None):
        super().__init__()
        self.root_rank, self.process_set = root_rank, process_set
        self._optimizer_done = False

    def on_train_begin(self, logs=None):
        _train_without_xla(self.model)
        broadcast_variables(self.model.variables, self.root_rank, self.process_set)

    def on_train_batch_end(self, batch, logs=None):
        if self._optimizer_done:
            return
        broadcast_variables(self.model.variables, self.root_rank, self.process_set)
        broadcast_variables(self.model.optimizer.variables, self.root_rank, self.process_set)
        self._optimizer_done = True


class MetricAverageCallback(keras.callbacks.Callback):
    """Replace each epoch's metrics in `logs` by their average over all ranks, so that every
    rank (and later callbacks, e.g. checkpointing on val_loss) sees the same numbers."""

    def __init__(self, process_set=None):
        super().__init__()
        self.process_set = process_set

    def on_epoch_end(self, epoch, logs=None):
        if not logs:
            return
        keys = sorted(k for k, v in logs.items() if np.ndim(v) == 0)
        values = np.array([float(logs[k]) for k in keys], dtype=np.float64)
        averaged = allreduce(tf.constant(values), op=Average, name=f"metrics.epoch{epoch}",
                             process_set=self.process_set).numpy()
        for k, v in zip(keys, averaged):
            logs[k] = float(v)


def _set_lr(model, value):
    model.optimizer.learning_rate = float(value)


class LearningRateScheduleCallback(keras.callbacks.Callback):
    """lr = initial_lr * multiplier(epoch) from start_epoch until end_epoch (a constant
    multiplier works too). staircase=True changes it at epoch starts; otherwise every batch,
    with a fractional epoch (steps_per_epoch is taken from fit() when not given)."""

    def __init__(self, initial_lr, multiplier, start_epoch=0, end_epoch=None, staircase=True,
                 steps_per_epoch=None):
        super().__init__()
        self.initial_lr, self.start_epoch, self.end_epoch = initial_lr, start_epoch, end_epoch
        self.staircase, self.steps_per_epoch = staircase, steps_per_epoch
        self.multiplier = multiplier if callable(multiplier) else (lambda epoch: multiplier)
        self._epoch = 0

    def on_train_begin(self, logs=None):
        if self.steps_per_epoch is None:
            self.steps_per_epoch = self.params.get("steps")

    def _active(self, epoch):
        return epoch >= self.start_epoch and (self.end_epoch is None or epoch < self.end_epoch)

    def lr_at(self, epoch):
        return self.initial_lr * self.multiplier(epoch)

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch = epoch
        if self.staircase and self._active(epoch):
            _set_lr(self.model, self.lr_at(epoch))

    def on_train_batch_begin(self, batch, logs=None):
        if self.staircase or not self.steps_per_epoch:
            return
        epoch = self._epoch + batch / self.steps_per_epoch
        if self._active(epoch):
            _set_lr(self.model, self.lr_at(epoch))


class LearningRateWarmupCallback(LearningRateScheduleCallback):
    """Ramp the learning rate from initial_lr / size() to initial_lr over warmup_epochs,
    batch by batch (the usual recipe when the lr is scaled by the number of ranks)."""

    def __init__(self, initial_lr, warmup_epochs=5, steps_per_epoch=None, verbose=0):
        def multiplier(epoch):
            # Count the batch being started as done, so that the last warmup batch runs at
            # exactly initial_lr (Horovod's convention).
            epoch += 1.0 / self.steps_per_epoch
            return 1.0 / size() * (epoch * (size() - 1) / warmup_epochs + 1)

        super().__init__(initial_lr, multiplier, start_epoch=0, end_epoch=warmup_epochs,
                         staircase=False, steps_per_epoch=steps_per_epoch)
        self.verbose = verbose

    def on_epoch_end(self, epoch, logs=None):
        if self.verbose and rank() == 0 and epoch + 1 == self.end_epoch:
            print(f"\nEpoch {epoch + 1}: finished learning rate warmup to "
                  f"{float(self.model.optimizer.learning_rate):g}.")
