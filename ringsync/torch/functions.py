"""Helpers for whole models and Python objects: broadcast_parameters,
broadcast_optimizer_state, broadcast_object, allgather_object."""
import io
import pickle
from collections.abc import Mapping

import numpy as np
import torch

import ringsync as _rs
from ringsync.errors import UsageError

from . import mpi_ops


def _named_tensors(params):
    if isinstance(params, Mapping):
        return list(params.items())
    items = list(params)
    if items and isinstance(items[0], tuple):
        return items
    return [(str(i), p) for i, p in enumerate(items)]


def broadcast_parameters(params, root_rank=0, prefix="broadcast.param"):
    """Overwrite params (a state_dict, named_parameters() or a list of tensors) with
    root_rank's values, in place, on every rank."""
    handles = []
    for name, p in _named_tensors(params):
        if not isinstance(p, torch.Tensor):
            raise UsageError(f"broadcast_parameters: '{name}' is a {type(p).__name__}, not a tensor")
        handles.append(mpi_ops.broadcast_async_(p.data if p.requires_grad else p, root_rank,
                                                name=f"{prefix}.{name}"))
    for h in handles:
        mpi_ops.synchronize(h)


def broadcast_object(obj, root_rank=0, name=None):
    """root_rank's obj (any picklable object, tensors included) on every rank."""
    name = name or "broadcast_object"
    if _rs.rank() == root_rank:
        buf = io.BytesIO()
        torch.save(obj, buf)
        payload = np.frombuffer(buf.getvalue(), dtype=np.uint8)
        size = np.array([payload.size], dtype=np.int64)
    else:
        payload, size = None, np.zeros(1, dtype=np.int64)
    size = _rs.broadcast(size, root_rank, name=f"{name}.size")
    if payload is None:
        payload = np.empty(int(size[0]), dtype=np.uint8)
    payload = _rs.broadcast(payload, root_rank, name=f"{name}.data")
    return torch.load(io.BytesIO(payload.tobytes()), weights_only=False)


def allgather_object(obj, name=None):
    """A list with every rank's obj (picklable), in rank order."""
    name = name or "allgather_object"
    payload = np.frombuffer(pickle.dumps(obj), dtype=np.uint8)
    sizes = _rs.allgather(np.array([payload.size], dtype=np.int64), name=f"{name}.sizes")
    data = _rs.allgather(payload, name=f"{name}.data").tobytes()
    out, at = [], 0
    for size in sizes:
        out.append(pickle.loads(data[at: at + int(size)]))
        at += int(size)
    return out


def broadcast_optimizer_state(optimizer, root_rank=0):
    """Make every rank's optimizer state (hyperparameters and buffers such as momentum)
    equal to root_rank's, including ranks whose state is not initialised yet."""
    state = broadcast_object(optimizer.state_dict(), root_rank, name="broadcast.optimizer_state")
    if _rs.rank() != root_rank:
        optimizer.load_state_dict(state)
