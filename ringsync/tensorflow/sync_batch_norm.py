"""SyncBatchNormalization: Keras batch normalization whose training-time statistics are
those of the global batch (every rank's samples), as horovod.tensorflow's."""
import keras
import tensorflow as tf

from ringsync.ops import ReduceOp
from ringsync.errors import UsageError

from .mpi_ops import PS, _name, allreduce


class SyncBatchNormalization(keras.layers.BatchNormalization):
    """keras.layers.BatchNormalization's arguments and weights; in training, the mean and
    variance are taken over the samples of every rank of process_set (one allreduce of
    the per-channel count, sum and sum of squares, so ranks may hold different batch
    sizes), and the moving statistics follow them. Inference is BatchNormalization's."""

    def __init__(self, fused=False, process_set=PS, **kwargs):
        if fused in (True, None):
            raise UsageError("ringsync.tensorflow.SyncBatchNormalization: fused=True is not "
                             "supported (the statistics must be reduced over the ranks)")
        kwargs.setdefault("name", "sync_batch_normalization")
        super().__init__(**kwargs)
        self.process_set = process_set

    def call(self, inputs, training=None, mask=None):
        if not training or not self.trainable:
            return super().call(inputs, training=training, mask=mask)
        if mask is not None:
            raise UsageError(f"ringsync.tensorflow.SyncBatchNormalization '{self.name}': "
                             "masks are not supported")
        x = tf.cast(inputs, self.compute_dtype if self.compute_dtype != "float16" else
                    "float32")
        axes = [a for a in range(len(x.shape)) if a != self.axis % len(x.shape)]
        count = tf.cast(tf.reduce_prod(tf.gather(tf.shape(x), axes)), x.dtype)
        local = tf.stack([tf.ones_like(self.moving_mean, dtype=x.dtype) * count,
                          tf.reduce_sum(x, axes), tf.reduce_sum(tf.square(x), axes)])
        total = allreduce(local, op=ReduceOp.SUM, name=_name(None, "sync_batch_norm"),
                          process_set=self.process_set)
        mean = total[1] / total[0]
        variance = tf.maximum(total[2] / total[0] - tf.square(mean), 0.0)
        self._follow(mean, variance)
        shape = [1] * len(x.shape)
        shape[self.axis % len(x.shape)] = -1
        scale = self.gamma if self.scale else 1.0
        offset = self.beta if self.center else 0.0
        normalized = (x - tf.reshape(mean, shape)) * tf.reshape(
            tf.math.rsqrt(variance + self.epsilon) * scale, shape) + tf.reshape(
            offset * tf.ones_like(mean), shape)
        return tf.cast(normalized, inputs.dtype)

    def _follow(self, mean, variance):
        """The moving statistics move towards the global batch's, as BatchNormalization's
        move towards the local batch's."""
        m = self.momentum
        self.moving_mean.assign(self.moving_mean * m + tf.cast(mean, self.moving_mean.dtype)
                                * (1 - m))
        self.moving_variance.assign(self.moving_variance * m +
                                    tf.cast(variance, self.moving_variance.dtype) * (1 - m))
