"""ringsync for Keras 3 (TensorFlow backend): DistributedOptimizer and callbacks.

    import ringsync.tensorflow.keras as hvd
    hvd.init()
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.Adam(1e-3)), loss=...)
    model.fit(x, y, callbacks=[hvd.BroadcastGlobalVariablesCallback(0),
                               hvd.MetricAverageCallback()])

DistributedOptimizer wraps any Keras 3 optimizer by composition, through public API only:
it averages the gradients over all ranks and hands them to the wrapped optimizer, whose
variables, iterations and learning rate it exposes as its own.
"""
import itertools
import warnings

import numpy as np
import keras
import tensorflow as tf

from ringsync.errors import UsageError

from . import (Average, Compression, ReduceOp, _reduce_gradients, allreduce,  # noqa: F401
               broadcast_variables, init, rank, shutdown, size)
from . import *  # noqa: F401,F403  (the whole ringsync.tensorflow API, as horovod.tensorflow.keras)
from . import elastic  # noqa: F401  (hvd.elastic.TensorFlowKerasState, hvd.elastic.run)


_instances = itertools.count()  # wrappers made in this process, in order (the same on all ranks)


@keras.saving.register_keras_serializable(package="ringsync")
class DistributedOptimizer(keras.optimizers.Optimizer):
    def __init__(self, optimizer, compression=Compression.none, backward_passes_per_step=1,
                 op=Average, gradient_predivide_factor=1.0, sparse_as_dense=False, name=None,
                 process_set=None, **kwargs):
        """process_set: the Communicator whose ranks average the gradients (default: the
        one init() made). A live object: get_config() leaves it out."""
        if isinstance(optimizer, dict):  # from_config
            optimizer = keras.optimizers.deserialize(optimizer)
        if not isinstance(optimizer, keras.optimizers.Optimizer):
            raise UsageError(f"DistributedOptimizer wraps a keras.optimizers.Optimizer, got "
                             f"{type(optimizer).__name__}")
        if backward_passes_per_step < 1:
            raise UsageError(f"backward_passes_per_step must be at least 1, got "
                             f"{backward_passes_per_step}")
        # The base class needs a learning rate; the wrapped optimizer's is the one used.
        super().__init__(learning_rate=0.0, name=name or f"Distributed{optimizer.name}")
        self._inner = optimizer
        self._compression = compression
        self._passes = int(backward_passes_per_step)
        self._op = op
        self._predivide = float(gradient_predivide_factor)
        self._sparse_as_dense = sparse_as_dense
        self._process_set = process_set
        self._accumulators = None
        # Tensor names must agree across ranks; Keras's auto-names (sgd, sgd_1, ...) count
        # every optimizer the process made, so count only these wrappers instead.
        self._reduce_name = f"keras.opt{next(_instances)}.grads"

    # ---- the wrapped optimizer's state, exposed as ours ----

    @property
    def inner_optimizer(self):
        return self._inner

    @property
    def learning_rate(self):
        return self._inner.learning_rate

    @learning_rate.setter
    def learning_rate(self, value):
        if hasattr(self, "_inner"):
            self._inner.learning_rate = value
        else:  # during the base class's __init__
            keras.optimizers.Optimizer.learning_rate.fset(self, value)

    @property
    def iterations(self):
        return self._inner.iterations

    @property
    def variables(self):
        return self._inner.variables

    def build(self, var_list):
        self._inner.build(var_list)
        if self._passes > 1 and self._accumulators is None:
            self._accumulators = [tf.Variable(tf.zeros_like(v), trainable=False,
                                              name=f"ringsync_accumulator_{i}")
                                  for i, v in enumerate(var_list)]
            self._pass_count = tf.Variable(0, dtype=tf.int64, trainable=False,
                                           name="ringsync_pass_count")
        self.built = True

    def save_own_variables(self, store):
        self._inner.save_own_variables(store)

    def load_own_variables(self, store):
        self._inner.load_own_variables(store)

    def get_config(self):
        return {"optimizer": keras.optimizers.serialize(self._inner),
                "backward_passes_per_step": self._passes, "op": int(ReduceOp(self._op)),
                "gradient_predivide_factor": self._predivide,
                "sparse_as_dense": self._sparse_as_dense, "name": self.name}

    @classmethod
    def from_config(cls, config, custom_objects=None):
        return cls(**config)

    # ---- applying ----

    def apply_gradients(self, grads_and_vars):
        grads, variables = zip(*list(grads_and_vars))
        return self.apply(list(grads), list(variables))

    def apply(self, grads, trainable_variables=None):
        variables = list(trainable_variables) if trainable_variables is not None else None
        if not self._inner.built:
            self.build(variables)
        if self._passes == 1:
            return self._inner.apply(self._reduce(list(grads)), variables)
        return self._accumulate_then_apply(list(grads), variables)

    def _reduce(self, grads):
        return _reduce_gradients(grads, self._compression, self._op, self._predivide,
                                 self._sparse_as_dense, self._reduce_name, self._process_set)

    def _accumulate_then_apply(self, grads, variables):
        """Sum gradients locally for backward_passes_per_step calls, then reduce and apply
        once (the other calls change no weight)."""
        if self._accumulators is None:
            self.build(variables)
        for acc, g in zip(self._accumulators, grads):
            if g is not None:
                acc.assign_add(tf.convert_to_tensor(g))
        self._pass_count.assign_add(1)

        def reduce_and_apply():
            reduced = self._reduce([tf.identity(a) for a in self._accumulators])
            self._inner.apply(reduced, variables)
            for acc in self._accumulators:
                acc.assign(tf.zeros_like(acc))
            return tf.constant(True)

        return tf.cond(self._pass_count % self._passes == 0, reduce_and_apply,
                       lambda: tf.constant(False))


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
