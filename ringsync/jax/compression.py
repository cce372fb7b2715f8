"""Gradient compression for the wire: Compression.none, .fp16 and .bf16 (Horovod's names).
Floating arrays travel as float16 / bfloat16 and come back in their own dtype; other
arrays travel as they are."""
import jax.numpy as jnp

from .._adapters import Compressor, NoneCompressor, cast_compression  # noqa: F401 (public)

FP16Compressor, BF16Compressor, Compression = cast_compression(
    __name__, lambda x: jnp.issubdtype(x.dtype, jnp.floating), lambda x, dtype: x.astype(dtype),
    jnp.float16, jnp.bfloat16)
