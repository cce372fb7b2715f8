"""Helpers for whole models and Python objects: broadcast_parameters,
broadcast_optimizer_state, broadcast_object, allgather_object."""
from collections.abc import Mapping

import torch

from ringsync._context import resolve
from ringsync.errors import UsageError
from ringsync.process_sets import global_process_set
from ringsync.objects import allgather_object, broadcast_object  # noqa: F401 (re-exported)

from . import mpi_ops


def _named_tensors(params):
    if isinstance(params, Mapping):
        return list(params.items())
    items = list(params)
    if items and isinstance(items[0], tuple):
        return items
    return [(str(i), p) for i, p in enumerate(items)]


def broadcast_parameters(params, root_rank=0, prefix="broadcast.param",
                         process_set=global_process_set):
    """Overwrite params (a state_dict, named_parameters() or a list of tensors) with
    root_rank's values, in place, on every rank (of process_set: a ProcessSet or
    Communicator; default: the job's)."""
    handles = []
    for name, p in _named_tensors(params):
        if not isinstance(p, torch.Tensor):
            raise UsageError(f"broadcast_parameters: '{name}' is a {type(p).__name__}, not a tensor")
        handles.append(mpi_ops.broadcast_async_(p.data if p.requires_grad else p, root_rank,
                                                name=f"{prefix}.{name}",
                                                process_set=process_set))
    for h in handles:
        mpi_ops.synchronize(h)


def broadcast_optimizer_state(optimizer, root_rank=0, model=None, process_set=global_process_set):
    """Make every rank's optimizer state (hyperparameters and buffers such as momentum)
    equal to root_rank's, including ranks whose state is not initialised yet. (`model`
    is accepted for Horovod's signature: the whole state_dict travels, so no step is
    needed to create state first.) As in Horovod, where this rank's optimizer has no state
    yet, its trainable parameters are left with zero gradients."""
    if isinstance(optimizer, torch.optim.LBFGS):
        raise UsageError("broadcast_optimizer_state: cannot broadcast torch.optim.LBFGS state")
    if not optimizer.state_dict()["state"]:
        _zero_gradients(optimizer)
    state = broadcast_object(optimizer.state_dict(), root_rank, name="broadcast.optimizer_state",
                             process_set=process_set)
    if resolve(process_set).world_rank() != root_rank:
        optimizer.load_state_dict(state)


def _zero_gradients(optimizer):
    """Horovod's broadcast_optimizer_state gives a fresh optimizer's trainable parameters
    zero gradients (it steps on them to create the state): code written for it may go on
    to use p.grad (broadcast it, clip it), so they are left the same here."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.requires_grad:
                p.grad = torch.zeros_like(p)
