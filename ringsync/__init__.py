"""ringsync: Horovod-style data-parallel collectives over a native ring, bootstrapped by MPI.

The module-level functions use one default Communicator made by init() (the job's state
lives in ringsync/_context.py); everything also works on explicit ringsync.Communicator
objects. This module only hands names on.
"""
from .config import Config
from .errors import (CommunicationError, CommunicationTimeout, HorovodInternalError,
                     HostsUpdatedInterrupt, MismatchError, NotInitializedError, RingsyncError,
                     StoreLostError, UsageError)
from .ops import ReduceOp

__version__ = "0.1.0"

Sum = ReduceOp.SUM
Average = ReduceOp.AVERAGE
Min = ReduceOp.MIN
Max = ReduceOp.MAX
Product = ReduceOp.PRODUCT
Adasum = ReduceOp.ADASUM

try:
    # (basics first: under MPI fault tolerance it must act before mpi4py.MPI is imported)
    from .basics import (cross_rank, cross_size, init, is_initialized, local_rank,
                         local_size, rank, shutdown, size, start_timeline, stop_timeline,
                         straggler_report, flight_records, request_hang_report)
    from ._core import Communicator, Handle
    from ._context import resolve as _comm  # (the communicator a call runs on; for tests)
    from .collectives import (allgather, allgather_async, allreduce, allreduce_,
                              allreduce_async, allreduce_async_, alltoall, alltoall_async,
                              barrier, broadcast, broadcast_, broadcast_async,
                              broadcast_async_, grouped_allreduce, grouped_allreduce_,
                              grouped_allreduce_async, grouped_allreduce_async_, join, poll,
                              recv, recv_async, reducescatter, reducescatter_, reducescatter_async,
                              reducescatter_async_, send,
                              send_async, synchronize)
    from .objects import allgather_object, broadcast_object
    from .process_sets import (ProcessSet, add_process_set, global_process_set,
                               remove_process_set)
except ImportError as _e:  # only where the native core was not built
    from ._unbuilt import unbuilt as _unbuilt
    Communicator = init = _unbuilt(_e)
    Handle = None

__all__ = [
    "init", "shutdown", "is_initialized", "rank", "size", "local_rank", "local_size",
    "cross_rank", "cross_size", "allreduce", "allreduce_", "allreduce_async",
    "allreduce_async_", "grouped_allreduce", "grouped_allreduce_", "grouped_allreduce_async",
    "grouped_allreduce_async_", "allgather", "allgather_async", "broadcast", "broadcast_",
    "broadcast_async", "broadcast_async_", "reducescatter", "reducescatter_", "reducescatter_async",
    "reducescatter_async_", "alltoall",
    "alltoall_async", "send", "send_async", "recv", "recv_async", "barrier", "join", "poll",
    "broadcast_object", "allgather_object",
    "synchronize", "start_timeline", "stop_timeline", "straggler_report", "flight_records",
    "request_hang_report", "ProcessSet", "global_process_set",
    "add_process_set", "remove_process_set",
    "Handle", "Sum", "Average", "Min", "Max", "Adasum",
    "Product", "ReduceOp", "Communicator", "Config", "RingsyncError", "UsageError",
    "NotInitializedError", "MismatchError", "CommunicationError", "CommunicationTimeout", "HorovodInternalError",
    "HostsUpdatedInterrupt", "StoreLostError",
]
