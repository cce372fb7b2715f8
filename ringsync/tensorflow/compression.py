"""Gradient compression on the wire (horovod.tensorflow.Compression): none, fp16 and bf16.
Floating tensors travel as float16 / bfloat16 and come back in their own dtype; other
tensors travel as they are."""
import tensorflow as tf

from ringsync._adapters import CastCompressor, Compressor, NoneCompressor

__all__ = ["Compression", "Compressor", "NoneCompressor", "FP16Compressor", "BF16Compressor"]


class _TensorFlowCast(CastCompressor):
    is_floating = staticmethod(lambda t: t.dtype.is_floating)
    cast = staticmethod(tf.cast)


class FP16Compressor(_TensorFlowCast):
    wire_dtype = tf.float16


class BF16Compressor(_TensorFlowCast):
    wire_dtype = tf.bfloat16


class Compression:
    none = NoneCompressor
    fp16 = FP16Compressor
    bf16 = BF16Compressor
