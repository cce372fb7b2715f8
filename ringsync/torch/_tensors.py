"""torch tensors in and out of the core, without copies where torch allows it.

CPU tensors that are contiguous are shared with the core through numpy views. Anything
else (CUDA tensors, non-contiguous views) is staged through a contiguous host copy, and
in-place results are copied back when the handle is synchronized.
"""
import numpy as np
import torch

try:
    from ml_dtypes import bfloat16 as _np_bfloat16
except ImportError:  # pragma: no cover - ml_dtypes is a dependency of ringsync[torch]
    _np_bfloat16 = None

from ..errors import UsageError


def to_numpy(t: torch.Tensor, what: str) -> np.ndarray:
    """A numpy view of a CPU, contiguous tensor (the caller stages the others)."""
    if t.dtype == torch.bfloat16:
        if _np_bfloat16 is None:
            raise UsageError(f"ringsync.torch.{what}: bfloat16 tensors need the ml_dtypes package")
        return t.view(torch.int16).numpy().view(_np_bfloat16)
    try:
        return t.numpy()
    except TypeError as e:  # dtypes numpy cannot view (complex32, quantized, ...)
        raise UsageError(f"ringsync.torch.{what}: unsupported tensor dtype {t.dtype}: {e}") from None


def from_numpy(arr: np.ndarray) -> torch.Tensor:
    if _np_bfloat16 is not None and arr.dtype == _np_bfloat16:
        return torch.from_numpy(arr.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(arr)


def host_view(t: torch.Tensor, what: str):
    """(numpy array the core may read and write, tensor behind it). Shares memory with t
    when t is a contiguous CPU tensor; otherwise the array belongs to a host copy."""
    if not isinstance(t, torch.Tensor):
        raise UsageError(f"ringsync.torch.{what}: expected a torch.Tensor, got {type(t).__name__}")
    host = t.detach()
    if host.device.type != "cpu":
        host = host.to("cpu")  # staged: no device-side transport yet
    host = host.contiguous()
    return to_numpy(host, what), host


def shares_memory(host: torch.Tensor, t: torch.Tensor) -> bool:
    return host.device == t.device and host.data_ptr() == t.data_ptr() and host.is_contiguous() \
        and t.is_contiguous()


def result_like(arr: np.ndarray, like: torch.Tensor) -> torch.Tensor:
    """A torch tensor of the core's result, on the device of `like`."""
    out = from_numpy(arr)
    return out if like.device.type == "cpu" else out.to(like.device)
