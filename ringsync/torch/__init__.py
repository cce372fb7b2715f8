"""ringsync for PyTorch: a drop-in for `horovod.torch`.

    import ringsync.torch as hvd
    hvd.init()
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)

CPU tensors are shared with the native core without copies. CUDA tensors work too, staged
through host memory (there is no device-side transport yet): expect the speed of a
device-to-host copy on top of the reduction.
"""
# ruff: noqa: F401
# The names below are the module's API (horovod.torch's), re-exported on purpose.
from ringsync import (Average, Max, Min, Product, ReduceOp, Sum, barrier, cross_rank,
                      cross_size, init, is_initialized, local_rank, local_size, rank, shutdown,
                      size, start_timeline, stop_timeline)
from ringsync import join as _join
from ringsync.errors import (CommunicationError, HorovodInternalError, RingsyncError,
                             UsageError)

from . import elastic
from .compression import Compression
from .functions import (allgather_object, broadcast_object, broadcast_optimizer_state,
                        broadcast_parameters)
from .mpi_ops import (allgather, allgather_async, allreduce, allreduce_, allreduce_async,
                      allreduce_async_, alltoall, alltoall_async, broadcast, broadcast_,
                      broadcast_async, broadcast_async_, grouped_allreduce, grouped_allreduce_,
                      grouped_allreduce_async, grouped_allreduce_async_, poll, reducescatter,
                      reducescatter_async, synchronize)
from .optimizer import DistributedOptimizer
from .sync_batch_norm import SyncBatchNorm


def join(device=-1) -> int:
    """This rank has run out of data: it takes part in the other ranks' allreduces with
    zeros until every rank has joined; returns the last rank to join. (`device` is
    accepted for Horovod compatibility; tensors are staged through host memory.)"""
    return _join()
