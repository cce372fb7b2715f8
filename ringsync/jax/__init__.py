"""ringsync for JAX: Horovod's names on JAX arrays, eagerly and inside `jax.jit`.

    import ringsync.jax as hvd
    hvd.init()
    params = hvd.broadcast_parameters(params, root_rank=0)
    tx = hvd.DistributedOptimizer(optax.adam(1e-3 * hvd.size()))

Importing this module imports JAX; nothing else in ringsync does.
"""
# ruff: noqa: F401
# The names below are the module's API (Horovod's names), re-exported on purpose.
from ringsync.basics import (cross_rank, cross_size, init, is_initialized, local_rank,
                             local_size, rank, shutdown, size, start_timeline, stop_timeline,
                             straggler_report, flight_records, request_hang_report)
from ringsync.errors import (CommunicationError, HorovodInternalError, HostsUpdatedInterrupt,
                             MismatchError, RingsyncError, UsageError)
from ringsync.ops import ReduceOp
from ringsync.process_sets import (ProcessSet, add_process_set, global_process_set,
                                   remove_process_set)

from .compression import Compression
from .mpi_ops import (Adasum, Average, Max, Min, Product, Sum, allgather, allreduce, alltoall,
                      barrier, broadcast, grouped_allreduce, join, reducescatter)
from .functions import allgather_object, broadcast_object, broadcast_parameters
from .optimizer import DistributedOptimizer, fused_allreduce
from . import elastic  # (hvd.elastic)
