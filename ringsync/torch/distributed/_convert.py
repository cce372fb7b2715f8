"""torch's tensors and reduction ops as the ringsync core takes them.

A tensor goes to the core as a numpy array sharing its memory when it is a contiguous CPU
tensor, else through a contiguous copy that is copied back once the collective is done.
bool travels as uint8 and complex as pairs of reals (where the op allows it). torch's
ReduceOp maps onto the core's ops; the bitwise ones, which the core has not, are reduced
here from every rank's contribution (an allgather), so that they still give torch's
answer.
"""
import numpy as np
import torch
import torch.distributed as dist

from ringsync.errors import UsageError
from ringsync.ops import ReduceOp

from .._tensors import to_numpy

BACKEND = "ringsync"
_RED = dist.ReduceOp.RedOpType
_PLAIN = {_RED.SUM: ReduceOp.SUM, _RED.AVG: ReduceOp.AVERAGE, _RED.PRODUCT: ReduceOp.PRODUCT,
          _RED.MIN: ReduceOp.MIN, _RED.MAX: ReduceOp.MAX}
# On bool, torch's gloo reduces SUM as "any" and PRODUCT as "all": max and min of 0/1.
_ON_BOOL = {_RED.SUM: ReduceOp.MAX, _RED.PRODUCT: ReduceOp.MIN, _RED.MIN: ReduceOp.MIN,
            _RED.MAX: ReduceOp.MAX}
BITWISE = {_RED.BAND: np.bitwise_and, _RED.BOR: np.bitwise_or, _RED.BXOR: np.bitwise_xor}


class Staged:
    """A tensor as the core sees it: `array` (shares `host`'s memory) and, for a tensor
    that could not be shared, how to copy the result back."""

    __slots__ = ("tensor", "host", "array")

    def __init__(self, tensor: torch.Tensor, what: str):
        if not isinstance(tensor, torch.Tensor):
            raise UsageError(f"{BACKEND} backend: {what} expects tensors, got "
                             f"{type(tensor).__name__}")
        if tensor.device.type != "cpu":
            raise UsageError(f"{BACKEND} backend: {what} got a tensor on {tensor.device}; "
                             f"ringsync carries CPU tensors, and hands CUDA tensors to "
                             f"NCCL only where torch has CUDA and NCCL")
        self.tensor = tensor
        self.host = tensor.detach()
        if not self.host.is_contiguous():
            self.host = self.host.contiguous()
        self.array = array_of(self.host, what)

    def copy_back(self) -> torch.Tensor:
        if self.host.data_ptr() != self.tensor.data_ptr() or not self.tensor.is_contiguous():
            with torch.no_grad():
                self.tensor.copy_(self.host)
        return self.tensor

    def fill(self, flat: np.ndarray) -> torch.Tensor:
        """Write flat (the core's result, host's elements in order) into the tensor."""
        np.copyto(self.array.reshape(-1), flat.reshape(-1), casting="no")
        return self.copy_back()


def array_of(host: torch.Tensor, what: str) -> np.ndarray:
    """A numpy view of a contiguous CPU tensor: bool as uint8, complex as float pairs."""
    if host.dtype == torch.bool:
        return host.view(torch.uint8).numpy()
    if host.is_complex():
        return to_numpy(torch.view_as_real(host), what)
    return to_numpy(host, what)


def reduction(op, tensor: torch.Tensor, what: str):
    """(ringsync ReduceOp or None for a bitwise op, prescale factor) of torch's op."""
    kind = getattr(op, "op", op)  # (a ReduceOp object, as torch passes; or its RedOpType)
    if kind in BITWISE:
        if tensor.is_floating_point() or tensor.is_complex():
            raise UsageError(f"{BACKEND} backend: {what} with {kind.name} needs an integer or "
                             f"bool tensor, got {tensor.dtype}")
        return None, 1.0
    if kind == _RED.PREMUL_SUM:
        return _plain(_RED.SUM, tensor, what), premul_factor(op)
    return _plain(kind, tensor, what), 1.0


def _plain(kind, tensor, what):
    if tensor.dtype == torch.bool:
        mapped = _ON_BOOL.get(kind)
    elif tensor.is_complex():
        mapped = _PLAIN.get(kind) if kind in (_RED.SUM, _RED.AVG) else None
    else:
        mapped = _PLAIN.get(kind)
    if mapped is None:
        raise UsageError(f"{BACKEND} backend: {what}: reduction {getattr(kind, 'name', kind)} "
                         f"is not defined for {tensor.dtype} tensors")
    return mapped


def premul_factor(op) -> float:
    factor = getattr(op, "factor", None)
    if factor is None:
        raise UsageError(f"{BACKEND} backend: PREMUL_SUM without a factor")
    if isinstance(factor, torch.Tensor):
        if factor.numel() != 1:
            raise UsageError(f"{BACKEND} backend: PREMUL_SUM's factor must be one number, "
                             f"got a tensor of shape {tuple(factor.shape)}")
        factor = factor.item()
    return float(factor)


def reduce_bitwise(kind, gathered: np.ndarray, size: int) -> np.ndarray:
    """Every rank's contribution (stacked along the first dimension, rank order) reduced
    with a bitwise op."""
    return BITWISE[kind].reduce(gathered.reshape(size, -1), axis=0)
