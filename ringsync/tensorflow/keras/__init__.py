"""ringsync for Keras 3 (TensorFlow backend), a drop-in for `horovod.tensorflow.keras`:
DistributedOptimizer, callbacks (also as the `callbacks` module), elastic training
(`elastic`), load_model, and collectives on values.

    import ringsync.tensorflow.keras as hvd
    hvd.init()
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.Adam(1e-3)), loss=...)
    model.fit(x, y, callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0),
                               hvd.callbacks.MetricAverageCallback()])

DistributedOptimizer wraps any Keras 3 optimizer by composition, through public API only:
it averages the gradients over all ranks and hands them to the wrapped optimizer, whose
variables, iterations and learning rate it exposes as its own.
"""
import itertools

import keras
import tensorflow as tf

from ringsync import ReduceOp
from ringsync.errors import UsageError
from ringsync.tensorflow import *  # noqa: F401,F403  (the ringsync.tensorflow API, as horovod's)
from ringsync.tensorflow import Average, Compression, global_process_set
from ringsync.tensorflow import allgather as _allgather
from ringsync.tensorflow import allreduce as _allreduce
from ringsync.tensorflow import broadcast as _broadcast
from ringsync.tensorflow import reducescatter as _reducescatter
from ringsync.tensorflow.gradients import GradientReducer, _layers

PS = global_process_set
_instances = itertools.count()  # wrappers made in this process, in order (the same on all ranks)
_COMPRESSIONS = {"none": Compression.none, "fp16": Compression.fp16, "bf16": Compression.bf16}


def _compression_name(compression) -> str:
    for key, value in _COMPRESSIONS.items():
        if compression is value:
            return key
    return "custom"  # (a user's own Compressor: not saved with the model)


@keras.saving.register_keras_serializable(package="ringsync")
class DistributedOptimizer(keras.optimizers.Optimizer):
    """Horovod's arguments, each honoured:

    compression: how gradients travel (Compression.none / fp16 / bf16, or your own).
    sparse_as_dense: IndexedSlices gradients (embeddings) densified before the reduction
        instead of gathered.
    gradient_predivide_factor f: op=Average only; gradients are divided by f before the
        sum and by size/f after it.
    op: Average (default), Sum or Adasum (of the gradients, as Horovod's tape does).
    backward_passes_per_step k: gradients summed locally over k calls, then reduced and
        applied once (the other calls change no weight); average_aggregated_gradients
        divides that sum by k.
    num_groups / groups: gradients reduced in groups (an int: that many runs of nearly
        equal length; lists of variables: those groups); default: all in one group.
    process_set: the ranks that average (a ProcessSet).
    scale_local_gradients: gradients of variables registered with register_local_var
        stay on their rank, divided by the set's size (unless False).
    device_dense, device_sparse: accepted; tensors are staged through host memory.
    """

    def __init__(self, optimizer, name=None, device_dense='', device_sparse='',
                 compression=Compression.none, sparse_as_dense=False,
                 gradient_predivide_factor=1.0, op=Average, backward_passes_per_step=1,
                 average_aggregated_gradients=False, num_groups=0, groups=None,
                 process_set=PS, scale_local_gradients=True):
        if isinstance(optimizer, dict):  # from_config
            optimizer = keras.optimizers.deserialize(optimizer)
        if not isinstance(optimizer, keras.optimizers.Optimizer):
            raise UsageError(f"DistributedOptimizer wraps a keras.optimizers.Optimizer, got "
                             f"{type(optimizer).__name__}")
        if isinstance(compression, str):  # from_config
            compression = _COMPRESSIONS[compression]
        if isinstance(backward_passes_per_step, bool) or \
                not isinstance(backward_passes_per_step, int) or backward_passes_per_step < 1:
            raise UsageError(f"DistributedOptimizer: backward_passes_per_step must be an int "
                             f"of at least 1, got {backward_passes_per_step!r}")
        if average_aggregated_gradients and ReduceOp(op) == ReduceOp.ADASUM:
            raise UsageError("DistributedOptimizer: average_aggregated_gradients does not "
                             "apply to op=Adasum")
        # The base class needs a learning rate; the wrapped optimizer's is the one used.
        super().__init__(learning_rate=0.0, name=name or f"Distributed{optimizer.name}")
        self._inner = optimizer
        self._reducer = GradientReducer(compression, op, gradient_predivide_factor,
                                        sparse_as_dense, num_groups, groups, process_set,
                                        scale_local_gradients, "keras.DistributedOptimizer")
        self._passes = backward_passes_per_step
        self._average_aggregated = bool(average_aggregated_gradients)
        self._accumulators = None
        # Tensor names must agree across ranks; Keras's auto-names (sgd, sgd_1, ...) count
        # every optimizer the process made, so count only these wrappers instead.
        self._reduce_name = f"keras.opt{next(_instances)}.grads"

    @property
    def _compression(self):
        return self._reducer.compression

    def register_local_var(self, var):
        """var's gradient stays on this rank (model parallelism for that variable)."""
        self._reducer.register_local(var)

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
        r = self._reducer
        return {"optimizer": keras.optimizers.serialize(self._inner), "name": self.name,
                "compression": _compression_name(self._compression),
                "sparse_as_dense": r.sparse_as_dense, "gradient_predivide_factor": r.predivide,
                "op": int(r.op), "backward_passes_per_step": self._passes,
                "average_aggregated_gradients": self._average_aggregated,
                "groups": r.groups if isinstance(r.groups, int) else None,
                "scale_local_gradients": r.scale_local}
        # (process_set, variable groups and local variables are live objects: left out)

    @classmethod
    def from_config(cls, config, custom_objects=None):
        config = dict(config)
        if config.get("compression") == "custom":
            config["compression"] = Compression.none
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
            return self._inner.apply(self._reduce(list(grads), variables), variables)
        return self._accumulate_then_apply(list(grads), variables)

    def _reduce(self, grads, variables):
        return self._reducer.reduce(grads, variables, self._reduce_name)

    def _accumulate_then_apply(self, grads, variables):
        """Sum gradients locally for backward_passes_per_step calls, then reduce (the sum,
        or its mean with average_aggregated_gradients) and apply once; the other calls
        change no weight."""
        if self._accumulators is None:
            self.build(variables)
        for acc, g in zip(self._accumulators, grads):
            if g is not None:
                acc.assign_add(tf.convert_to_tensor(g))
        self._pass_count.assign_add(1)

        def reduce_and_apply():
            summed = [tf.identity(a) for a in self._accumulators]
            if self._average_aggregated:
                summed = [s / tf.cast(self._passes, s.dtype) for s in summed]
            self._inner.apply(self._reduce(summed, variables), variables)
            for acc in self._accumulators:
                acc.assign(tf.zeros_like(acc))
            return tf.constant(True)

        return tf.cond(self._pass_count % self._passes == 0, reduce_and_apply,
                       lambda: tf.constant(False))


def PartialDistributedOptimizer(optimizer, name=None, device_dense='', device_sparse='',  # noqa: N802
                                compression=Compression.none, sparse_as_dense=False,
                                gradient_predivide_factor=1.0, op=Average, groups=None,
                                process_set=PS, local_layers=None, scale_local_gradients=True):
    """A DistributedOptimizer whose local_layers' trainable weights keep their own
    gradients (model parallelism for those layers, data parallelism for the rest)."""
    wrapped = DistributedOptimizer(optimizer, name=name, device_dense=device_dense,
                                   device_sparse=device_sparse, compression=compression,
                                   sparse_as_dense=sparse_as_dense,
                                   gradient_predivide_factor=gradient_predivide_factor, op=op,
                                   groups=groups, process_set=process_set,
                                   scale_local_gradients=scale_local_gradients)
    for layer in _layers(local_layers, "keras.PartialDistributedOptimizer"):
        for weight in layer.trainable_weights:
            wrapped.register_local_var(weight)
    return wrapped


# ---- collectives on values (horovod.tensorflow.keras's: the global process set) ----

def allreduce(value, name=None, average=None, prescale_factor=1.0, postscale_factor=1.0,
              op=None, compression=Compression.none):
    """value (a tensor, array or number) reduced over all ranks (op=None: Average)."""
    return _allreduce(tf.constant(value), average=average, compression=compression, op=op,
                      prescale_factor=prescale_factor, postscale_factor=postscale_factor,
                      name=name)


def allgather(value, name=None):
    return _allgather(tf.constant(value), name=name)


def broadcast(value, root_rank, name=None):
    return _broadcast(tf.constant(value), root_rank, name=name)


def reducescatter(value, name=None, op=Average):
    return _reducescatter(tf.constant(value), op=op, name=name)


def broadcast_global_variables(root_rank):
    """Keras 3 has no global variables collection (TensorFlow 1's): a RuntimeError, as
    Horovod's in eager mode."""
    raise RuntimeError("ringsync.tensorflow.keras.broadcast_global_variables: Keras 3 has no "
                     "global variables; use BroadcastGlobalVariablesCallback(root_rank) with "
                     "fit(), or broadcast_variables(model.variables, root_rank)")


def load_model(filepath, custom_optimizers=None, custom_objects=None,
               compression=Compression.none):
    """keras.models.load_model, with the model's optimizer wrapped in DistributedOptimizer
    (with this compression): a model saved with one loads wrapped as it was saved; one
    saved with a plain Keras optimizer (e.g. by a single-process run) is wrapped after
    loading. custom_optimizers: your optimizer classes, needed to deserialize them."""
    objects = {cls.__name__: cls for cls in (custom_optimizers or [])}
    objects.update(custom_objects or {})
    model = keras.models.load_model(filepath, custom_objects=objects)
    optimizer = getattr(model, "optimizer", None)
    if optimizer is None:
        return model
    if isinstance(optimizer, DistributedOptimizer):
        optimizer._reducer.compression = compression
    else:
        model.optimizer = DistributedOptimizer(optimizer, compression=compression)
    return model


from .callbacks import (BestModelCheckpoint, BroadcastGlobalVariablesCallback,  # noqa: E402,F401
                        LearningRateScheduleCallback, LearningRateWarmupCallback,
                        MetricAverageCallback)
from . import callbacks, elastic  # noqa: E402,F401
