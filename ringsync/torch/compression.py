"""Gradient compression for the wire: Compression.none, .fp16 and .bf16 (Horovod's names)."""
import torch

from .._adapters import Compressor, NoneCompressor, cast_compression  # noqa: F401 (public)

FP16Compressor, BF16Compressor, Compression = cast_compression(
    __name__, lambda t: t.dtype.is_floating_point, lambda t, dtype: t.to(dtype),
    torch.float16, torch.bfloat16)
