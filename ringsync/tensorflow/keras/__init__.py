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
variables, iterations and learning rate it exposes as its own (it is defined in
ringsync.tensorflow.gradients, and is this module's as far as Keras and pickle can tell).
"""
import keras
import tensorflow as tf

from ringsync.tensorflow import *  # noqa: F401,F403  (the ringsync.tensorflow API, as horovod's)
from ringsync.tensorflow import Average, Compression, global_process_set
from ringsync.tensorflow import allgather as _allgather
from ringsync.tensorflow import allreduce as _allreduce
from ringsync.tensorflow import broadcast as _broadcast
from ringsync.tensorflow import reducescatter as _reducescatter
# (the optimizer wrapper lives with the gradient rules it shares with the tapes, so that
# ringsync.tensorflow.DistributedOptimizer reaches it without importing this module)
from ringsync.tensorflow.gradients import KerasDistributedOptimizer as DistributedOptimizer
from ringsync.tensorflow.gradients import keras_layers

PS = global_process_set


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
    for layer in keras_layers(local_layers, "keras.PartialDistributedOptimizer"):
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
