"""Keras callbacks for ringsync (horovod.tensorflow.keras.callbacks): start every rank
from the same weights, average metrics over ranks, schedule and warm up the learning rate,
keep the best model."""
import warnings

import keras
import numpy as np
import tensorflow as tf

from ringsync.errors import UsageError
from ringsync.tensorflow.gradients import is_variable, variable_key
from ringsync.tensorflow import Average, allreduce, broadcast_variables, global_process_set, \
    rank, size


def _train_without_xla(model):
    """XLA cannot compile the reduction (a tf.numpy_function into ringsync's core): rebuild the
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
    optimizer state (after the first batch, once the optimizer has made it; Horovod
    broadcasts both there, after the first batch has already moved the weights).
    local_variables: a variable or list of them that keeps each rank's own value.
    device: accepted (tensors are staged through host memory)."""

    def __init__(self, root_rank, device='', local_variables=None,
                 process_set=global_process_set):
        super().__init__()
        self.root_rank, self.device, self.process_set = root_rank, device, process_set
        if local_variables is None:
            local_variables = []
        elif is_variable(local_variables):
            local_variables = [local_variables]
        local_variables = list(local_variables)
        if not all(is_variable(v) for v in local_variables):
            raise UsageError("BroadcastGlobalVariablesCallback: local_variables must be a "
                             "variable or a list of them")
        self._local = {variable_key(v) for v in local_variables}
        self.broadcast_done = False

    def _shared(self, variables):
        return [v for v in variables if variable_key(v) not in self._local]

    def on_train_begin(self, logs=None):
        _train_without_xla(self.model)
        broadcast_variables(self._shared(self.model.variables), self.root_rank,
                            self.process_set)

    def on_train_batch_end(self, batch, logs=None):
        if self.broadcast_done:
            return
        broadcast_variables(self._shared(self.model.variables), self.root_rank,
                            self.process_set)
        broadcast_variables(self.model.optimizer.variables, self.root_rank, self.process_set)
        self.broadcast_done = True


class MetricAverageCallback(keras.callbacks.Callback):
    """Replace each epoch's metrics in `logs` by their average over all ranks, so that every
    rank (and later callbacks: put this one first, before checkpointing on val_loss or
    ReduceLROnPlateau) sees the same numbers. device: accepted."""

    def __init__(self, device='', process_set=global_process_set):
        super().__init__()
        self.device, self.process_set = device, process_set

    def on_epoch_end(self, epoch, logs=None):
        if not logs:
            return
        keys = sorted(k for k, v in logs.items() if np.ndim(v) == 0)
        values = np.array([float(logs[k]) for k in keys], dtype=np.float64)
        averaged = allreduce(tf.constant(values), op=Average, name=f"metrics.epoch{epoch}",
                             process_set=self.process_set).numpy()
        for k, v in zip(keys, averaged):
            logs[k] = float(v)


def _inner(optimizer):
    return getattr(optimizer, "inner_optimizer", optimizer)


def _correct_momentum(optimizer, ratio):
    """Momentum correction (Goyal et al.): when the learning rate changes by `ratio`, the
    velocity accumulated at the old rate is scaled by it too. Horovod scales the momentum
    coefficient for one batch, which Keras 3 compiles into its train step; scaling the
    velocity buffers once is the same update."""
    inner = _inner(optimizer)
    if not getattr(inner, "momentum", 0) or ratio == 1.0:
        return
    for v in getattr(inner, "momentums", None) or []:
        v.assign(v * tf.cast(ratio, v.dtype))


class LearningRateScheduleCallback(keras.callbacks.Callback):
    """lr = initial_lr * multiplier(epoch) from start_epoch until end_epoch (exclusive; None:
    no end). A number c as multiplier means c ** (epoch - start_epoch) (Horovod's
    exponential decay). staircase=True: set at the start of each epoch, with the integer
    epoch; False: at every batch, with a fractional epoch (steps_per_epoch is taken from
    fit() when not given). momentum_correction: see _correct_momentum."""

    def __init__(self, initial_lr, multiplier, start_epoch=0, end_epoch=None, staircase=True,
                 momentum_correction=True, steps_per_epoch=None):
        super().__init__()
        if initial_lr is None:
            raise UsageError("LearningRateScheduleCallback: initial_lr is required")
        self.initial_lr, self.start_epoch, self.end_epoch = initial_lr, start_epoch, end_epoch
        self.staircase, self.momentum_correction = staircase, momentum_correction
        self.steps_per_epoch = steps_per_epoch
        if callable(multiplier):
            self.multiplier = multiplier
        else:
            self.multiplier = lambda epoch: multiplier ** (epoch - start_epoch)
        self.current_epoch = 0

    def on_train_begin(self, logs=None):
        if self.steps_per_epoch is None:
            self.steps_per_epoch = self.params.get("steps")
        if not self.staircase and not self.steps_per_epoch:
            raise UsageError("LearningRateScheduleCallback: staircase=False needs "
                             "steps_per_epoch (fit() did not say how many steps an epoch has)")

    def _active(self, epoch):
        return epoch >= self.start_epoch and (self.end_epoch is None or epoch < self.end_epoch)

    def lr_at(self, epoch):
        return self.initial_lr * self.multiplier(epoch)

    def _set_lr(self, value):
        optimizer = self.model.optimizer
        old = float(optimizer.learning_rate)
        optimizer.learning_rate = float(value)
        if self.momentum_correction and old:
            _correct_momentum(optimizer, float(value) / old)

    def on_epoch_begin(self, epoch, logs=None):
        self.current_epoch = epoch

    def on_train_batch_begin(self, batch, logs=None):
        if self.staircase:
            if batch == 0 and self._active(self.current_epoch):
                self._set_lr(self.lr_at(self.current_epoch))
            return
        epoch = self.current_epoch + batch / self.steps_per_epoch
        if self._active(epoch):
            self._set_lr(self.lr_at(epoch))

    def on_epoch_end(self, epoch, logs=None):
        if logs is not None:
            logs["lr"] = float(self.model.optimizer.learning_rate)


class LearningRateWarmupCallback(LearningRateScheduleCallback):
    """Ramp the learning rate from initial_lr / size() to initial_lr over warmup_epochs,
    batch by batch (the usual recipe when the lr is scaled by the number of ranks)."""

    def __init__(self, initial_lr, warmup_epochs=5, momentum_correction=True,
                 steps_per_epoch=None, verbose=0):
        def multiplier(epoch):
            # Count the batch being started as done, so that the last warmup batch runs at
            # exactly initial_lr (Horovod's convention).
            epoch += 1.0 / self.steps_per_epoch
            return 1.0 / size() * (epoch * (size() - 1) / warmup_epochs + 1)

        super().__init__(initial_lr, multiplier, start_epoch=0, end_epoch=warmup_epochs,
                         staircase=False, momentum_correction=momentum_correction,
                         steps_per_epoch=steps_per_epoch)
        self.verbose = verbose

    def on_epoch_end(self, epoch, logs=None):
        super().on_epoch_end(epoch, logs)
        if self.verbose and rank() == 0 and epoch + 1 == self.end_epoch:
            print(f"\nEpoch {epoch + 1}: finished gradual learning rate warmup to "
                  f"{float(self.model.optimizer.learning_rate):g}.")


class BestModelCheckpoint(keras.callbacks.ModelCheckpoint):
    """keras.callbacks.ModelCheckpoint with save_best_only=True. Horovod's leaves filepath
    to be set later (its Spark estimator does): set `callback.filepath`, or give
    filepath=, before training."""

    def __init__(self, monitor='val_loss', verbose=0, save_weights_only=False, mode='auto',
                 save_freq='epoch', filepath=None):
        placeholder = "best.weights.h5" if save_weights_only else "best.keras"
        super().__init__(filepath=filepath or placeholder, monitor=monitor, verbose=verbose,
                         save_best_only=True, save_weights_only=save_weights_only, mode=mode,
                         save_freq=save_freq)
        self.filepath = filepath

    def on_train_begin(self, logs=None):
        if self.filepath is None:
            raise UsageError("BestModelCheckpoint: set its filepath before training")
        super().on_train_begin(logs)
