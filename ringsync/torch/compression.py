"""Gradient compression for the wire: Compression.none, .fp16 and .bf16 (Horovod's names)."""
import torch

from .._adapters import CastCompressor, Compressor, NoneCompressor  # noqa: F401 (public names)


class _TorchCast(CastCompressor):
    is_floating = staticmethod(lambda t: t.dtype.is_floating_point)
    cast = staticmethod(lambda t, dtype: t.to(dtype))


class FP16Compressor(_TorchCast):
    wire_dtype = torch.float16


class BF16Compressor(_TorchCast):
    wire_dtype = torch.bfloat16


class Compression:
    none = NoneCompressor
    fp16 = FP16Compressor
    bf16 = BF16Compressor
