"""Collectives on torch tensors with horovod.torch's names, argument order and defaults:
synchronous, asynchronous and in place, single and grouped; the synchronous out-of-place
forms are differentiable as Horovod's are.

The synchronous calls (and the differentiable ones' forward and backward passes, which
wait too) are blocking calls in the core's sense (the plain entry points): with every rank on one host
they take the same-host lane, exactly as the numpy API's and eager TensorFlow's do, so
that ranks of different frameworks meet there.

process_set, in every function here: a ProcessSet (global_process_set by default) or a
ringsync Communicator. root_rank is a rank of the job, as in Horovod, also in a set."""

import numpy as np
import torch

from ringsync._adapters import check_differentiable, grad_name, resolve_op
from ringsync._context import owner, resolve
from ringsync._core import Handle
from ringsync._requests import even_split
from ringsync.errors import RingsyncError, UsageError
from ringsync.ops import ReduceOp
from ringsync.process_sets import global_process_set

from ._tensors import host_view, result_like, shares_memory
from .compression import Compression

Sum, Average, Adasum = ReduceOp.SUM, ReduceOp.AVERAGE, ReduceOp.ADASUM
Min, Max, Product = ReduceOp.MIN, ReduceOp.MAX, ReduceOp.PRODUCT
PS = global_process_set  # (short, for the signatures below)


def _run_or_start(comm, method: str, blocking: bool, args, finish):
    """The two entry points: blocking, comm.<method>(*args)'s result converted by finish;
    else the Handle of the method's _async form, whose result finish converts."""
    if blocking:
        return finish(getattr(comm, method)(*args))
    start = method[:-1] + "_async_" if method.endswith("_") else method + "_async"
    return getattr(comm, start)(*args).then(finish)


# ---- in place ----

def _copied_back(tensor: torch.Tensor, host):
    """A finish for an in-place call on host (tensor's host array): tensor, updated."""
    if shares_memory(host, tensor):
        return lambda _: tensor

    def copy_back(_):
        with torch.no_grad():
            tensor.copy_(host)
        return tensor

    return copy_back


def _in_place(tensor, what, method, blocking, *args):
    arr, host = host_view(tensor, what)
    comm, *rest = args
    return _run_or_start(comm, method, blocking, (arr, *rest), _copied_back(tensor, host))


def _allreduce_in_place(tensor, average, name, op, prescale, postscale, process_set, blocking):
    op = resolve_op(average, op, "torch.allreduce_async_")
    return _in_place(tensor, "allreduce_async_", "allreduce_", blocking, resolve(process_set), op,
                     prescale, postscale, name)


def allreduce_async_(tensor, average=None, name=None, op=None, prescale_factor=1.0,
                     postscale_factor=1.0, process_set=PS):
    return _allreduce_in_place(tensor, average, name, op, prescale_factor, postscale_factor,
                               process_set, False)


def allreduce_(tensor, average=None, name=None, op=None, prescale_factor=1.0,
               postscale_factor=1.0, process_set=PS):
    return _allreduce_in_place(tensor, average, name, op, prescale_factor, postscale_factor,
                               process_set, True)


def broadcast_async_(tensor, root_rank, name=None, process_set=PS):
    return _in_place(tensor, "broadcast_async_", "broadcast_", False, resolve(process_set),
                     root_rank, name)


def broadcast_(tensor, root_rank, name=None, process_set=PS):
    return _in_place(tensor, "broadcast_async_", "broadcast_", True, resolve(process_set),
                     root_rank, name)


def _grouped_allreduce_in_place(tensors, average, name, op, prescale, postscale, process_set,
                                blocking):
    op = resolve_op(average, op, "torch.grouped_allreduce_async_")
    views = [host_view(t, "grouped_allreduce_async_") for t in tensors]

    def copy_back(_):
        with torch.no_grad():
            for t, (_, host) in zip(tensors, views):
                if not shares_memory(host, t):
                    t.copy_(host)
        return list(tensors)

    return _run_or_start(resolve(process_set), "grouped_allreduce_", blocking,
                         ([a for a, _ in views], op, prescale, postscale, name), copy_back)


def grouped_allreduce_async_(tensors, average=None, name=None, op=None, prescale_factor=1.0,
                             postscale_factor=1.0, process_set=PS):
    return _grouped_allreduce_in_place(tensors, average, name, op, prescale_factor,
                                       postscale_factor, process_set, False)


def grouped_allreduce_(tensors, average=None, name=None, op=None, prescale_factor=1.0,
                       postscale_factor=1.0, process_set=PS):
    return _grouped_allreduce_in_place(tensors, average, name, op, prescale_factor,
                                       postscale_factor, process_set, True)


# ---- out of place ----
# Each private function below runs blocking (returns the result) or asynchronously
# (returns a Handle); the public _async functions are the latter, and the plain
# collectives further down call the former.

def _out_of_place(tensor, what, method, blocking, comm, *args):
    arr, _ = host_view(tensor, what)
    return _run_or_start(comm, method, blocking, (arr, *args),
                         lambda result: result_like(result, tensor))


def _each_like(tensors):
    return lambda results: [result_like(r, t) for r, t in zip(results, tensors)]


def _grouped_out_of_place(tensors, what, method, blocking, comm, *args):
    arrays = [host_view(t, what)[0] for t in tensors]
    return _run_or_start(comm, method, blocking, (arrays, *args), _each_like(tensors))


def _allreduce(tensor, name, op, prescale, postscale, process_set, blocking):
    return _out_of_place(tensor, "allreduce_async", "allreduce", blocking, resolve(process_set),
                         op, prescale, postscale, name)


def allreduce_async(tensor, average=None, name=None, op=None, prescale_factor=1.0,
                    postscale_factor=1.0, process_set=PS):
    op = resolve_op(average, op, "torch.allreduce_async")
    return _allreduce(tensor, name, op, prescale_factor, postscale_factor, process_set, False)


def _grouped_allreduce(tensors, name, op, prescale, postscale, process_set, blocking):
    return _grouped_out_of_place(tensors, "grouped_allreduce_async", "grouped_allreduce",
                                 blocking, resolve(process_set), op, prescale, postscale, name)


def grouped_allreduce_async(tensors, average=None, name=None, op=None, prescale_factor=1.0,
                            postscale_factor=1.0, process_set=PS):
    op = resolve_op(average, op, "torch.grouped_allreduce_async")
    return _grouped_allreduce(tensors, name, op, prescale_factor, postscale_factor,
                              process_set, False)


def _allgather(tensor, name, process_set, blocking):
    return _out_of_place(tensor, "allgather_async", "allgather", blocking, resolve(process_set),
                         name)


def allgather_async(tensor, name=None, process_set=PS):
    return _allgather(tensor, name, process_set, False)


def _grouped_allgather(tensors, name, process_set, blocking):
    return _grouped_out_of_place(tensors, "grouped_allgather_async", "grouped_allgather",
                                 blocking, resolve(process_set), name)


def grouped_allgather_async(tensors, name=None, process_set=PS):
    return _grouped_allgather(tensors, name, process_set, False)


def _broadcast(tensor, root_rank, name, process_set, blocking):
    return _out_of_place(tensor, "broadcast_async", "broadcast", blocking, resolve(process_set),
                         root_rank, name)


def broadcast_async(tensor, root_rank, name=None, process_set=PS):
    return _broadcast(tensor, root_rank, name, process_set, False)


def _reducescatter(tensor, name, op, process_set, prescale, postscale, blocking):
    return _out_of_place(tensor, "reducescatter_async", "reducescatter", blocking,
                         resolve(process_set), op, prescale, postscale, name)


def reducescatter_async(tensor, name=None, op=Average, process_set=PS, prescale_factor=1.0,
                        postscale_factor=1.0):
    return _reducescatter(tensor, name, op, process_set, prescale_factor, postscale_factor,
                          False)


def reducescatter_async_(tensor, name=None, op=Average, process_set=PS, prescale_factor=1.0,
                         postscale_factor=1.0):
    """reducescatter in place: tensor is the work space and is overwritten (no second copy
    of a large buffer); synchronize returns this rank's share, a view of tensor's first
    rows (of a host copy's, for a tensor the core cannot share memory with)."""
    arr, host = host_view(tensor, "reducescatter_async_")
    same = shares_memory(host, tensor)
    return _run_or_start(resolve(process_set), "reducescatter_", False,
                         (arr, op, prescale_factor, postscale_factor, name),
                         lambda share: tensor[:share.shape[0]] if same
                         else result_like(share, tensor))


def _grouped_reducescatter(tensors, name, op, process_set, prescale, postscale, blocking):
    return _grouped_out_of_place(tensors, "grouped_reducescatter_async",
                                 "grouped_reducescatter", blocking, resolve(process_set), op,
                                 prescale, postscale, name)


def grouped_reducescatter_async(tensors, name=None, op=Average, process_set=PS,
                                prescale_factor=1.0, postscale_factor=1.0):
    return _grouped_reducescatter(tensors, name, op, process_set, prescale_factor,
                                  postscale_factor, False)


def _alltoall(tensor, splits, name, process_set, blocking):
    """(output, rows received from each rank), as Horovod's alltoall_async gives.
    splits=None: the rows split evenly (a first dimension not divisible by the ranks is
    refused on every rank, a ValueError as in Horovod)."""
    comm = resolve(process_set)
    if isinstance(splits, torch.Tensor):
        splits = splits.detach().cpu().numpy()
    arr, _ = host_view(tensor, "alltoall_async")
    if splits is None and arr.ndim and arr.shape[0] % comm.size() == 0:
        # (even splits, so that the counts received come back; any other first dimension
        # goes on without splits, and the core refuses it on every rank, as Horovod does)
        splits = even_split(arr.shape[0], comm.size())
    return _run_or_start(comm, "alltoall", blocking, (arr, splits, name), lambda res: (
        result_like(res[0], tensor), torch.from_numpy(np.asarray(res[1], dtype=np.int32))))


def alltoall_async(tensor, splits=None, name=None, process_set=PS):
    """synchronize returns (output, rows received from each rank), as Horovod's does."""
    return _alltoall(tensor, splits, name, process_set, False)


def sparse_allreduce_async(tensor, name, op, process_set=PS):
    """Allreduce of a sparse COO tensor: every rank's indices and values are allgathered
    (so the result holds every rank's entries, uncoalesced: duplicates add up when it is
    coalesced or used); Average divides the values by the number of ranks. Returns a
    function that waits and returns the result (not a handle), as Horovod's does."""
    if not tensor.is_sparse:
        raise UsageError(f"ringsync.torch.sparse_allreduce_async: tensor '{name}' is not sparse")
    ReduceOp(op)  # (raises on unknown ops)
    if op not in (Average, Sum):
        raise UsageError(f"ringsync.torch.sparse_allreduce_async: tensor '{name}': only Sum "
                         f"and Average are defined for sparse tensors, got {ReduceOp(op).name}")
    comm = resolve(process_set)
    indices = allgather_async(tensor._indices().transpose(0, 1).contiguous(),
                              f"{name}.indices", process_set)
    values = allgather_async(tensor._values().contiguous(), f"{name}.values", process_set)

    def wait():
        gathered_values = synchronize(values)
        gathered_indices = synchronize(indices)
        if op == Average:
            gathered_values = gathered_values / comm.size()
        return torch.sparse_coo_tensor(gathered_indices.transpose(0, 1), gathered_values,
                                       tensor.size(), dtype=tensor.dtype)

    return wait


def poll(handle: Handle) -> bool:
    return owner(handle).poll(handle)


def synchronize(handle: Handle):
    return owner(handle).synchronize(handle)


def barrier(process_set=PS):
    """Returns once every rank of the set has called barrier()."""
    resolve(process_set).barrier()


# ---- point-to-point ----
# dst and src are ranks of the process set (its own numbering, 0..size-1), unlike the
# collectives' root_rank: a message names the set's ranks as Communicator.send does.

def send_async(tensor, dst, name=None, process_set=PS) -> Handle:
    """Start sending tensor to rank dst; synchronize returns None once dst received it.
    Unnamed messages between a pair match in order, named ones by name."""
    arr, _ = host_view(tensor, "send_async")  # (the handle keeps a host copy alive)
    return resolve(process_set).send_async(arr, dst, name)


def recv_async(tensor, src, name=None, process_set=PS) -> Handle:
    """Start receiving rank src's message into tensor (the sender's dtype and shape);
    synchronize returns tensor."""
    return _in_place(tensor, "recv_async", "recv", False, resolve(process_set), src, name)


def send(tensor, dst, name=None, process_set=PS):
    """Send tensor to rank dst; returns once dst has received it. Differentiable: where
    tensor requires grad, returns a token (an empty tensor in the graph); backward through
    it receives the gradient dst's recv sends back and gives it to tensor. Include the
    token in what you call backward on, with a zero gradient (it is not a scalar):
    torch.autograd.backward([loss, token], [None, torch.zeros(0)]). Else None."""
    if torch.is_grad_enabled() and tensor.requires_grad:
        return _Send.apply(tensor, dst, name, process_set)
    synchronize(send_async(tensor, dst, name, process_set))
    return None


def recv(tensor, src, name=None, process_set=PS):
    """Receive rank src's message into tensor and return it. Differentiable: where tensor
    requires grad (it is then a template, left as it is), returns a new tensor in the
    graph holding the message; backward sends its gradient back to src (the sender's
    token receives it)."""
    if torch.is_grad_enabled() and tensor.requires_grad:
        return _Recv.apply(tensor, src, name, process_set)
    return synchronize(recv_async(tensor, src, name, process_set))


class _Send(torch.autograd.Function):
    """The gradient of a send is a receive of the gradient (from the receiver)."""

    @staticmethod
    def forward(ctx, tensor, dst, name, process_set):
        ctx.args = (dst, name, process_set)
        ctx.like = torch.empty_like(tensor)
        synchronize(send_async(tensor, dst, name, process_set))
        return tensor.new_zeros(0)

    @staticmethod
    def backward(ctx, _token_grad):
        dst, name, process_set = ctx.args
        grad = synchronize(recv_async(ctx.like, dst, grad_name(name), process_set))
        return grad, None, None, None


class _Recv(torch.autograd.Function):
    """The gradient of a receive is sent back to the sender."""

    @staticmethod
    def forward(ctx, template, src, name, process_set):
        ctx.args = (src, name, process_set)
        with torch.no_grad():
            out = torch.empty_like(template)
        return synchronize(recv_async(out, src, name, process_set))

    @staticmethod
    def backward(ctx, grad):
        src, name, process_set = ctx.args
        synchronize(send_async(grad.contiguous(), src, grad_name(name), process_set))
        return None, None, None, None


def join(device=-1) -> int:
    """This rank has run out of data: it takes part in the other ranks' allreduces with
    zeros until every rank has joined; returns the last rank to join. (`device` is
    accepted for Horovod compatibility; tensors are staged through host memory.)"""
    return resolve(None).join()


# ---- differentiable collectives ----
# Horovod's rules: the gradient of a collective is a collective of the gradients; where a
# rank's input reaches other ranks' outputs (allgather, broadcast), the gradient averages
# the ranks' upstream gradients, so that a learning rate means what it means on one rank.

class _Allreduce(torch.autograd.Function):
    """d/dx_r of prescale*postscale*reduce(x) is the same reduction of the incoming grads."""

    @staticmethod
    def forward(ctx, tensor, op, prescale, postscale, name, process_set):
        ctx.args = (op, prescale, postscale, name, process_set)
        return _allreduce(tensor, name, op, prescale, postscale, process_set, True)

    @staticmethod
    def backward(ctx, grad):
        op, prescale, postscale, name, process_set = ctx.args
        check_differentiable(op, "torch.allreduce")
        return (synchronize(allreduce_async(grad, None, grad_name(name), op, prescale, postscale,
                                            process_set)),
                None, None, None, None, None)


class _GroupedAllreduce(torch.autograd.Function):

    @staticmethod
    def forward(ctx, op, prescale, postscale, name, process_set, *tensors):
        ctx.args = (op, prescale, postscale, name, process_set)
        return tuple(_grouped_allreduce(list(tensors), name, op, prescale, postscale,
                                       process_set, True))

    @staticmethod
    def backward(ctx, *grads):
        op, prescale, postscale, name, process_set = ctx.args
        check_differentiable(op, "torch.grouped_allreduce")
        summed = synchronize(grouped_allreduce_async(list(grads), None, grad_name(name), op,
                                                     prescale, postscale, process_set))
        return (None, None, None, None, None, *summed)


def _my_rows_of_mean(grad, rows, name, process_set):
    """The rows of the ranks-averaged grad that came from this rank's input."""
    comm = resolve(process_set)
    counts = comm.allgather(np.array([rows]), None if name is None else f"{name}.rows")
    start = int(counts[: comm.rank()].sum())
    return grad[start: start + rows]


class _Allgather(torch.autograd.Function):
    """The gradient of a concatenation: the ranks' upstream gradients averaged, then this
    rank's rows of it (Horovod's rule)."""

    @staticmethod
    def forward(ctx, tensor, name, process_set):
        ctx.rows = tensor.shape[0] if tensor.dim() else 1
        ctx.shape, ctx.name, ctx.process_set = tensor.shape, name, process_set
        return _allgather(tensor, name, process_set, True)

    @staticmethod
    def backward(ctx, grad):
        # Rows per rank are exchanged here, not forward, so that forward passes run the
        # same collectives whether or not gradients are wanted (and in any framework).
        mean = synchronize(allreduce_async(grad, name=grad_name(ctx.name), op=Average,
                                           process_set=ctx.process_set))
        mine = _my_rows_of_mean(mean, ctx.rows, grad_name(ctx.name), ctx.process_set)
        return mine.reshape(ctx.shape), None, None


class _GroupedAllgather(torch.autograd.Function):

    @staticmethod
    def forward(ctx, name, process_set, *tensors):
        ctx.rows = [t.shape[0] if t.dim() else 1 for t in tensors]
        ctx.shapes, ctx.name, ctx.process_set = [t.shape for t in tensors], name, process_set
        return tuple(_grouped_allgather(list(tensors), name, process_set, True))

    @staticmethod
    def backward(ctx, *grads):
        means = synchronize(grouped_allreduce_async(list(grads), name=grad_name(ctx.name),
                                                    op=Average, process_set=ctx.process_set))
        mine = [_my_rows_of_mean(m, rows, f"{grad_name(ctx.name)}.{i}", ctx.process_set)
                .reshape(shape)
                for i, (m, rows, shape) in enumerate(zip(means, ctx.rows, ctx.shapes))]
        return (None, None, *mine)


class _Broadcast(torch.autograd.Function):
    """Only the root's input reaches the outputs: it gets the ranks' gradients averaged."""

    @staticmethod
    def forward(ctx, tensor, root_rank, name, process_set):
        ctx.root, ctx.name, ctx.process_set = root_rank, name, process_set
        return _broadcast(tensor, root_rank, name, process_set, True)

    @staticmethod
    def backward(ctx, grad):
        mean = synchronize(allreduce_async(grad, name=grad_name(ctx.name), op=Average,
                                           process_set=ctx.process_set))
        comm = resolve(ctx.process_set)
        mine = comm.world_rank() == ctx.root
        return (mean if mine else torch.zeros_like(mean)), None, None, None


class _Alltoall(torch.autograd.Function):
    """Each received row's gradient goes back to the rank it came from."""

    @staticmethod
    def forward(ctx, tensor, splits, name, process_set):
        out, received = _alltoall(tensor, splits, name, process_set, True)
        ctx.received, ctx.name, ctx.process_set = received, name, process_set
        ctx.mark_non_differentiable(received)
        return out, received

    @staticmethod
    def backward(ctx, grad, _received_grad):
        back, _ = synchronize(alltoall_async(grad.contiguous(), ctx.received,
                                             grad_name(ctx.name), ctx.process_set))
        return back, None, None, None


class _Reducescatter(torch.autograd.Function):
    """Horovod's rule: the incoming gradient scaled as the forward pass scaled (times the
    number of ranks for Sum), then allgathered."""

    @staticmethod
    def forward(ctx, tensor, op, prescale, postscale, name, process_set):
        check_differentiable(op, "torch.reducescatter")
        ctx.args = (op, prescale, postscale, name, process_set)
        return _reducescatter(tensor, name, op, process_set, prescale, postscale, True)

    @staticmethod
    def backward(ctx, grad):
        op, prescale, postscale, name, process_set = ctx.args
        return (synchronize(allgather_async(_reducescatter_grad_scale(grad, op, prescale,
                                                                      postscale, process_set),
                                            grad_name(name), process_set)),
                None, None, None, None, None)


class _GroupedReducescatter(torch.autograd.Function):

    @staticmethod
    def forward(ctx, op, prescale, postscale, name, process_set, *tensors):
        check_differentiable(op, "torch.grouped_reducescatter")
        ctx.args = (op, prescale, postscale, name, process_set)
        return tuple(_grouped_reducescatter(list(tensors), name, op, process_set, prescale,
                                           postscale, True))

    @staticmethod
    def backward(ctx, *grads):
        op, prescale, postscale, name, process_set = ctx.args
        scaled = [_reducescatter_grad_scale(g, op, prescale, postscale, process_set)
                  for g in grads]
        return (None, None, None, None, None,
                *synchronize(grouped_allgather_async(scaled, grad_name(name), process_set)))


def _reducescatter_grad_scale(grad, op, prescale, postscale, process_set):
    factor = prescale * postscale * (resolve(process_set).size() if op == Sum else 1)
    return grad * factor if factor != 1 else grad


def _wants_grad(tensors) -> bool:
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def _check_tensors(tensors, what):
    """A clear error for what is not a tensor (a parameter's grad that is still None,
    say), before anything reads tensor attributes from it."""
    for i, t in enumerate(tensors):
        if not isinstance(t, torch.Tensor):
            where = f"tensors[{i}]" if len(tensors) > 1 else "tensor"
            raise UsageError(f"ringsync.torch.{what}: {where} is {type(t).__name__}, not a "
                             f"torch.Tensor" + (" (a gradient not computed yet?)"
                                                if t is None else ""))
    return tensors


def _checked(what, name, process_set, check, count=None):
    """check(): a blocking call's own checks here (before the core names the call). One
    that fails must fail the peers' same call too, instead of leaving them waiting for
    this rank (a gradient that is None on one rank only, say): the call is refused on the
    communicator (Communicator.refuse_call), then the error goes on."""
    try:
        return check()
    except (TypeError, ValueError) as exc:
        try:
            resolve(process_set).refuse_call(what, name, exc, count)
        except RingsyncError:
            pass  # (not initialised: there are no peers to tell)
        raise


def _compressed(compression, tensors):
    pairs = [compression.compress(t) for t in tensors]
    return [t for t, _ in pairs], [c for _, c in pairs]


def allreduce(tensor, average=None, name=None, compression=Compression.none, op=None,
              prescale_factor=1.0, postscale_factor=1.0, process_set=PS):
    """A new tensor: tensor reduced over the set's ranks (op=None: Average; average= is
    Horovod's deprecated spelling). Differentiable for Sum and Average."""
    op = _checked("allreduce", name, process_set, lambda: (
        _check_tensors([tensor], "allreduce"), resolve_op(average, op, "torch.allreduce"))[1])
    (wire,), (ctx,) = _compressed(compression, [tensor])
    if _wants_grad([wire]):
        out = _Allreduce.apply(wire, op, prescale_factor, postscale_factor, name, process_set)
    else:
        out = _allreduce(wire, name, op, prescale_factor, postscale_factor, process_set, True)
    return compression.decompress(out, ctx)


def grouped_allreduce(tensors, average=None, name=None, compression=Compression.none, op=None,
                      prescale_factor=1.0, postscale_factor=1.0, process_set=PS):
    """A list of new tensors, reduced as one unit. Differentiable for Sum and Average."""
    tensors = list(tensors)
    op = _checked("grouped_allreduce", name, process_set, lambda: (
        _check_tensors(tensors, "grouped_allreduce"),
        resolve_op(average, op, "torch.grouped_allreduce"))[1], len(tensors))
    wires, ctxs = _compressed(compression, tensors)
    if _wants_grad(wires):
        outs = _GroupedAllreduce.apply(op, prescale_factor, postscale_factor, name, process_set,
                                       *wires)
    else:
        outs = _grouped_allreduce(wires, name, op, prescale_factor, postscale_factor,
                                  process_set, True)
    return [compression.decompress(o, c) for o, c in zip(outs, ctxs)]


def allgather(tensor, name=None, process_set=PS):
    """Every rank's tensor concatenated along the first dimension. Differentiable."""
    _checked("allgather", name, process_set, lambda: _check_tensors([tensor], "allgather"))
    if _wants_grad([tensor]):
        return _Allgather.apply(tensor, name, process_set)
    return _allgather(tensor, name, process_set, True)


def grouped_allgather(tensors, name=None, process_set=PS):
    """allgather of each tensor, as one unit. Differentiable."""
    tensors = list(tensors)
    _checked("grouped_allgather", name, process_set, lambda: _check_tensors(tensors, "grouped_allgather"),
             len(tensors))
    if _wants_grad(tensors):
        return list(_GroupedAllgather.apply(name, process_set, *tensors))
    return _grouped_allgather(tensors, name, process_set, True)


def broadcast(tensor, root_rank, name=None, process_set=PS):
    """A new tensor with root_rank's values. Differentiable."""
    _checked("broadcast", name, process_set, lambda: _check_tensors([tensor], "broadcast"))
    if _wants_grad([tensor]):
        return _Broadcast.apply(tensor, root_rank, name, process_set)
    return _broadcast(tensor, root_rank, name, process_set, True)


def reducescatter(tensor, name=None, compression=Compression.none, op=Average, process_set=PS,
                  prescale_factor=1.0, postscale_factor=1.0):
    """This rank's rows of tensor reduced over the set (Sum or Average). Differentiable."""
    _checked("reducescatter", name, process_set, lambda: _check_tensors([tensor], "reducescatter"))
    (wire,), (ctx,) = _compressed(compression, [tensor])
    if _wants_grad([wire]):
        out = _Reducescatter.apply(wire, op, prescale_factor, postscale_factor, name,
                                   process_set)
    else:
        out = _reducescatter(wire, name, op, process_set, prescale_factor, postscale_factor,
                             True)
    return compression.decompress(out, ctx)


def grouped_reducescatter(tensors, name=None, compression=Compression.none, op=Average,
                          process_set=PS, prescale_factor=1.0, postscale_factor=1.0):
    """reducescatter of each tensor, as one unit. Differentiable."""
    tensors = list(tensors)
    _checked("grouped_reducescatter", name, process_set, lambda: _check_tensors(tensors, "grouped_reducescatter"),
             len(tensors))
    wires, ctxs = _compressed(compression, tensors)
    if _wants_grad(wires):
        outs = _GroupedReducescatter.apply(op, prescale_factor, postscale_factor, name,
                                           process_set, *wires)
    else:
        outs = _grouped_reducescatter(wires, name, op, process_set, prescale_factor,
                                      postscale_factor, True)
    return [compression.decompress(o, c) for o, c in zip(outs, ctxs)]


def alltoall(tensor, splits=None, name=None, process_set=PS):
    """splits[i] rows of tensor go to rank i of the set; returns the rows received, in rank
    order, and (when splits is given) how many came from each rank. Differentiable."""
    _checked("alltoall", name, process_set, lambda: _check_tensors([tensor], "alltoall"))
    if _wants_grad([tensor]):
        out, received = _Alltoall.apply(tensor, splits, name, process_set)
    else:
        out, received = _alltoall(tensor, splits, name, process_set, True)
    return out if splits is None else (out, received)


__all__ = [
    "allreduce", "allreduce_", "allreduce_async", "allreduce_async_", "grouped_allreduce",
    "grouped_allreduce_", "grouped_allreduce_async", "grouped_allreduce_async_",
    "sparse_allreduce_async", "allgather", "allgather_async", "grouped_allgather",
    "grouped_allgather_async", "broadcast", "broadcast_", "broadcast_async", "broadcast_async_",
    "reducescatter", "reducescatter_async", "grouped_reducescatter",
    "grouped_reducescatter_async", "alltoall", "alltoall_async", "send", "send_async", "recv",
    "recv_async", "barrier", "join", "poll",
    "synchronize", "Average", "Sum", "Min", "Max", "Product", "Adasum",
]
