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
from ringsync.basics import (cross_rank, cross_size, init, is_initialized, local_rank,
                             local_size, rank, shutdown, size, start_timeline, stop_timeline,
                             straggler_report, flight_records, request_hang_report)
from ringsync.build_info import (ccl_built, cuda_built, ddl_built, gloo_built, gloo_enabled,
                                 is_homogeneous, mpi_built, mpi_enabled, mpi_threads_supported,
                                 nccl_built, rocm_built)
from ringsync.ops import ReduceOp
from ringsync.process_sets import (ProcessSet, add_process_set, global_process_set,
                                   remove_process_set)
from ringsync.errors import (CommunicationError, HorovodInternalError, HostsUpdatedInterrupt,
                             MismatchError, RingsyncError, UsageError)

from . import distributed, elastic  # (distributed: registers the "ringsync" backend)
from .compression import Compression
from .functions import (allgather_object, broadcast_object, broadcast_optimizer_state,
                        broadcast_parameters)
from .mpi_ops import (Adasum, Average, Max, Min, Product, Sum, allgather, allgather_async, allreduce, allreduce_, allreduce_async,
                      allreduce_async_, alltoall, alltoall_async, barrier, broadcast,
                      broadcast_, broadcast_async, broadcast_async_, grouped_allgather,
                      grouped_allgather_async, grouped_allreduce, grouped_allreduce_,
                      grouped_allreduce_async, grouped_allreduce_async_, grouped_reducescatter,
                      grouped_reducescatter_async, join, poll, reducescatter,
                      reducescatter_async, recv, recv_async, send, send_async,
                      sparse_allreduce_async, synchronize)
from .optimizer import DistributedOptimizer
from .sharded import ShardedOptimizer
from .sharded_module import ShardedModule
from .sync_batch_norm import SyncBatchNorm
