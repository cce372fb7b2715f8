"""Gradient compression on the wire (horovod.tensorflow.Compression): none, fp16 and bf16.
Floating tensors travel as float16 / bfloat16 and come back in their own dtype; other
tensors travel as they are."""
import tensorflow as tf

from ringsync._adapters import Compressor, NoneCompressor, cast_compression

__all__ = ["Compression", "Compressor", "NoneCompressor", "FP16Compressor", "BF16Compressor"]

FP16Compressor, BF16Compressor, Compression = cast_compression(
    __name__, lambda t: t.dtype.is_floating, tf.cast, tf.float16, tf.bfloat16)
