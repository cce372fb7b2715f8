"""CUDA tensors on a ringsync group go to NCCL.

torch replaces a group by the ProcessGroup a backend's creator returns, so with
init_process_group("cpu:ringsync,cuda:nccl") it never builds the NCCL half itself: the
ringsync group keeps an NCCL backend over the same store and hands it every collective
whose tensors are on a CUDA device. (NCCL connects at its first collective, so an unused
one costs nothing.)
"""
import functools

import torch
import torch.distributed as dist

# The group's methods whose first argument holds the tensors, and the name the NCCL
# backend gives each where it differs (torch calls some by two names: both are here).
FORWARDED = ["allreduce", "reduce", "allreduce_coalesced", "broadcast", "allgather",
             "all_gather_single", "_allgather_base", "allgather_into_tensor_coalesced",
             "gather", "reduce_scatter", "reduce_scatter_single", "_reduce_scatter_base",
             "reduce_scatter_tensor_coalesced", "scatter", "alltoall_base",
             "all_to_all_single", "alltoall", "send", "recv"]
_NCCL_NAMES = {"all_gather_single": "_allgather_base",
               "reduce_scatter_single": "_reduce_scatter_base",
               "all_to_all_single": "alltoall_base"}


def cuda_backend(store, rank: int, size: int, timeout):
    """An NCCL backend for the group's CUDA tensors, where this machine has both."""
    if not (torch.cuda.is_available() and dist.is_nccl_available()):
        return None
    options = dist.ProcessGroupNCCL.Options()
    options._timeout = timeout
    return dist.ProcessGroupNCCL(dist.PrefixStore("cuda/", store), rank, size, options)


def _first_tensor(value):
    while isinstance(value, (list, tuple)) and value:
        value = value[0]
    return value if isinstance(value, torch.Tensor) else None


def _forwarding(name: str, method):
    target = _NCCL_NAMES.get(name, name)

    @functools.wraps(method)
    def call(self, *args, **kwargs):
        cuda = self.cuda
        if cuda is not None and args:
            first = _first_tensor(args[0])
            if first is not None and first.device.type != "cpu":
                if not hasattr(cuda, target):
                    raise NotImplementedError(f"ringsync backend: {name} on CUDA tensors: "
                                              f"torch's NCCL backend has no {target}")
                return getattr(cuda, target)(*args, **kwargs)
        return method(self, *args, **kwargs)
    return call


def forward_cuda_to_nccl(cls):
    """Class decorator: each FORWARDED method of cls hands tensors that are not on the
    CPU to self.cuda (where there is one; else the method's own checks refuse them)."""
    for name in FORWARDED:
        setattr(cls, name, _forwarding(name, getattr(cls, name)))
    return cls
