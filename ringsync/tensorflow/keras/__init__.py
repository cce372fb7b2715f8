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

import keras
import tensorflow as tf

from ringsync.errors import UsageError

from ringsync.tensorflow import (Average, Compression, ReduceOp, _reduce_gradients,  # noqa: F401
                                 allreduce, broadcast_variables, init, rank, shutdown, size)
from ringsync.tensorflow import *  # noqa: F401,F403  (the ringsync.tensorflow API, as horovod's)


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


from .callbacks import (BroadcastGlobalVariablesCallback, LearningRateScheduleCallback,  # noqa: E402,F401
                        LearningRateWarmupCallback, MetricAverageCallback)
from . import callbacks, elastic  # noqa: E402,F401
