"""Collectives on torch tensors (Horovod's horovod.torch.mpi_ops names), synchronous,
asynchronous and in place; allreduce, allgather and broadcast are differentiable.

The synchronous calls (and the differentiable ones' forward and backward passes, which
wait too) are blocking calls in the core's sense (_blocking): with every rank on one host
they take the same-host lane, exactly as the numpy API's and eager TensorFlow's do, so
that ranks of different frameworks meet there."""

import numpy as np
import torch

import ringsync as _rs
from ringsync import Average, Handle, Max, Min, Product, ReduceOp, Sum
from ringsync._adapters import check_differentiable, grad_name

from ._tensors import host_view, result_like, shares_memory


def _comm(process_set=None):
    """process_set, in every function here: the Communicator to use (default: the one
    init() made). Horovod's process sets will take this keyword too."""
    return _rs._comm(process_set)


# ---- in place ----

def _in_place(submit, tensor: torch.Tensor, what: str) -> Handle:
    """Run `submit` on a host array of tensor; the handle's result is tensor, updated."""
    arr, host = host_view(tensor, what)
    handle = submit(arr)
    if shares_memory(host, tensor):
        return handle.then(lambda _: tensor)

    def copy_back(_):
        with torch.no_grad():
            tensor.copy_(host)
        return tensor

    return handle.then(copy_back)


def allreduce_async_(tensor, op=Average, prescale_factor=1.0, postscale_factor=1.0, name=None,
                     process_set=None, _blocking=False):
    return _in_place(lambda a: _comm(process_set).allreduce_async_(
        a, op, prescale_factor, postscale_factor, name, _blocking), tensor, "allreduce_async_")


def allreduce_(tensor, op=Average, prescale_factor=1.0, postscale_factor=1.0, name=None,
               process_set=None):
    return synchronize(allreduce_async_(tensor, op, prescale_factor, postscale_factor, name,
                                        process_set, _blocking=True))


def broadcast_async_(tensor, root_rank, name=None, process_set=None, _blocking=False):
    return _in_place(lambda a: _comm(process_set).broadcast_async_(a, root_rank, name, _blocking),
                     tensor, "broadcast_async_")


def broadcast_(tensor, root_rank, name=None, process_set=None):
    return synchronize(broadcast_async_(tensor, root_rank, name, process_set, _blocking=True))


def grouped_allreduce_async_(tensors, op=Average, prescale_factor=1.0, postscale_factor=1.0,
                             name=None, process_set=None):
    views = [host_view(t, "grouped_allreduce_async_") for t in tensors]
    handle = _comm(process_set).grouped_allreduce_async_([a for a, _ in views], op, prescale_factor,
                                              postscale_factor, name)

    def copy_back(_):
        with torch.no_grad():
            for t, (_, host) in zip(tensors, views):
                if not shares_memory(host, t):
                    t.copy_(host)
        return list(tensors)

    return handle.then(copy_back)


def grouped_allreduce_(tensors, op=Average, prescale_factor=1.0, postscale_factor=1.0, name=None,
                       process_set=None):
    return synchronize(grouped_allreduce_async_(tensors, op, prescale_factor, postscale_factor,
                                                name, process_set))


# ---- out of place, asynchronous ----

def _out_of_place(submit, tensor, what):
    arr, _ = host_view(tensor, what)
    return submit(arr).then(lambda result: result_like(result, tensor))


def allreduce_async(tensor, op=Average, prescale_factor=1.0, postscale_factor=1.0, name=None,
                    process_set=None, _blocking=False):
    return _out_of_place(lambda a: _comm(process_set).allreduce_async(
        a, op, prescale_factor, postscale_factor, name, _blocking), tensor, "allreduce_async")


def grouped_allreduce_async(tensors, op=Average, prescale_factor=1.0, postscale_factor=1.0,
                            name=None, process_set=None):
    arrays = [host_view(t, "grouped_allreduce_async")[0] for t in tensors]
    handle = _comm(process_set).grouped_allreduce_async(arrays, op, prescale_factor,
                                                        postscale_factor, name)
    return handle.then(lambda results: [result_like(r, t) for r, t in zip(results, tensors)])


def allgather_async(tensor, name=None, process_set=None, _blocking=False):
    return _out_of_place(lambda a: _comm(process_set).allgather_async(a, name, _blocking),
                         tensor, "allgather_async")


def broadcast_async(tensor, root_rank, name=None, process_set=None, _blocking=False):
    return _out_of_place(lambda a: _comm(process_set).broadcast_async(a, root_rank, name,
                                                                      _blocking),
                         tensor, "broadcast_async")


def reducescatter_async(tensor, op=Average, prescale_factor=1.0, postscale_factor=1.0, name=None,
                        process_set=None, _blocking=False):
    return _out_of_place(lambda a: _comm(process_set).reducescatter_async(
        a, op, prescale_factor, postscale_factor, name, _blocking), tensor, "reducescatter_async")


def alltoall_async(tensor, splits=None, name=None, process_set=None, _blocking=False):
    if isinstance(splits, torch.Tensor):
        splits = splits.detach().cpu().numpy()
    arr, _ = host_view(tensor, "alltoall_async")
    handle = _comm(process_set).alltoall_async(arr, splits, name, _blocking)
    if splits is None:
        return handle.then(lambda out: result_like(out, tensor))
    return handle.then(lambda res: (result_like(res[0], tensor), torch.from_numpy(res[1])))


def poll(handle: Handle) -> bool:
    return _rs.poll(handle)


def synchronize(handle: Handle):
    return _rs.synchronize(handle)


# ---- differentiable collectives ----

class _Allreduce(torch.autograd.Function):
    """d/dx_r of prescale*postscale*reduce(x) is the same reduction of the incoming grads."""

    @staticmethod
    def forward(ctx, tensor, op, prescale, postscale, name, process_set):
        ctx.args = (op, prescale, postscale, name, process_set)
        return synchronize(allreduce_async(tensor, op, prescale, postscale, name, process_set,
                                           _blocking=True))

    @staticmethod
    def backward(ctx, grad):
        op, prescale, postscale, name, process_set = ctx.args
        check_differentiable(op, "torch.allreduce")
        return (synchronize(allreduce_async(grad, op, prescale, postscale, grad_name(name),
                                            process_set)),
                None, None, None, None, None)


class _Allgather(torch.autograd.Function):
    """The gradient of a concatenation: every rank's gradient summed, then this rank's rows."""

    @staticmethod
    def forward(ctx, tensor, name, process_set):
        ctx.rows = tensor.shape[0] if tensor.dim() else 1
        ctx.shape, ctx.name, ctx.process_set = tensor.shape, name, process_set
        return synchronize(allgather_async(tensor, name, process_set, _blocking=True))

    @staticmethod
    def backward(ctx, grad):
        # Rows per rank are exchanged here, not forward, so that forward passes run the
        # same collectives whether or not gradients are wanted (and in any framework).
        comm = _comm(ctx.process_set)
        rows = comm.allgather(np.array([ctx.rows]),
                              None if ctx.name is None else f"{ctx.name}.grad.rows")
        start = int(rows[: comm.rank()].sum())
        summed = synchronize(allreduce_async(grad, Sum, name=grad_name(ctx.name),
                                             process_set=ctx.process_set))
        return summed[start: start + ctx.rows].reshape(ctx.shape), None, None


class _Broadcast(torch.autograd.Function):
    """Only the root's input reaches the outputs: it gets the sum of their gradients."""

    @staticmethod
    def forward(ctx, tensor, root_rank, name, process_set):
        ctx.root, ctx.name, ctx.process_set = root_rank, name, process_set
        return synchronize(broadcast_async(tensor, root_rank, name, process_set, _blocking=True))

    @staticmethod
    def backward(ctx, grad):
        summed = synchronize(allreduce_async(grad, Sum, name=grad_name(ctx.name),
                                             process_set=ctx.process_set))
        mine = _comm(ctx.process_set).rank() == ctx.root
        return (summed if mine else torch.zeros_like(summed)), None, None, None


def allreduce(tensor, op=Average, prescale_factor=1.0, postscale_factor=1.0, name=None,
              process_set=None):
    """A new tensor: tensor reduced over all ranks. Differentiable for Sum and Average."""
    if tensor.requires_grad and torch.is_grad_enabled():
        return _Allreduce.apply(tensor, op, prescale_factor, postscale_factor, name, process_set)
    return synchronize(allreduce_async(tensor, op, prescale_factor, postscale_factor, name,
                                       process_set, _blocking=True))


def grouped_allreduce(tensors, op=Average, prescale_factor=1.0, postscale_factor=1.0, name=None,
                      process_set=None):
    return synchronize(grouped_allreduce_async(tensors, op, prescale_factor, postscale_factor,
                                               name, process_set))


def allgather(tensor, name=None, process_set=None):
    """Every rank's tensor concatenated along the first dimension. Differentiable."""
    if tensor.requires_grad and torch.is_grad_enabled():
        return _Allgather.apply(tensor, name, process_set)
    return synchronize(allgather_async(tensor, name, process_set, _blocking=True))


def broadcast(tensor, root_rank, name=None, process_set=None):
    """A new tensor with root_rank's values. Differentiable."""
    if tensor.requires_grad and torch.is_grad_enabled():
        return _Broadcast.apply(tensor, root_rank, name, process_set)
    return synchronize(broadcast_async(tensor, root_rank, name, process_set, _blocking=True))


def reducescatter(tensor, op=Average, prescale_factor=1.0, postscale_factor=1.0, name=None,
                  process_set=None):
    return synchronize(reducescatter_async(tensor, op, prescale_factor, postscale_factor, name,
                                           process_set, _blocking=True))


def alltoall(tensor, splits=None, name=None, process_set=None):
    return synchronize(alltoall_async(tensor, splits, name, process_set, _blocking=True))


__all__ = [
    "allreduce", "allreduce_", "allreduce_async", "allreduce_async_", "grouped_allreduce",
    "grouped_allreduce_", "grouped_allreduce_async", "grouped_allreduce_async_", "allgather",
    "allgather_async", "broadcast", "broadcast_", "broadcast_async", "broadcast_async_",
    "reducescatter", "reducescatter_async", "alltoall", "alltoall_async", "poll", "synchronize",
    "Average", "Sum", "Min", "Max", "Product",
]
