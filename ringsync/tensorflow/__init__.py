"""ringsync for TensorFlow 2: a drop-in for `horovod.tensorflow`.

    import ringsync.tensorflow as hvd
    hvd.init()
    tape = hvd.DistributedGradientTape(tape)          # gradients averaged over the ranks
    hvd.broadcast_variables(model.variables, root_rank=0)

Collectives work on tf.Tensor / tf.Variable, eagerly and inside tf.function, with
gradients (see mpi_ops). The Keras 3 optimizer wrapper and callbacks are in
ringsync.tensorflow.keras.
"""
# ruff: noqa: F401
import types as _types

# The names below are the module's API (horovod.tensorflow's), re-exported on purpose.
from ringsync.basics import (cross_rank, cross_size, init, is_initialized, local_rank,
                             local_size, rank, shutdown, size, start_timeline, stop_timeline,
                             straggler_report, flight_records, request_hang_report)
from ringsync.ops import ReduceOp
from ringsync.process_sets import (ProcessSet, add_process_set, global_process_set,
                                   remove_process_set)
from ringsync._adapters import resolve_op as _resolve_op
from ringsync.build_info import (ccl_built, cuda_built, ddl_built, gloo_built, gloo_enabled,
                                 is_homogeneous, mpi_built, mpi_enabled, mpi_threads_supported,
                                 nccl_built, rocm_built)
from ringsync.errors import (CommunicationError, HorovodInternalError, HostsUpdatedInterrupt,
                             MismatchError, RingsyncError, UsageError)

from .compression import Compression
from .functions import (allgather_object, broadcast_global_variables, broadcast_object,
                        broadcast_object_fn, broadcast_variables)
from .gradients import (DistributedGradientTape, DistributedOptimizer,
                        PartialDistributedGradientTape)
from .mpi_ops import (Adasum, Average, Max, Min, Product, Sum, allgather, allreduce, alltoall, barrier, broadcast, broadcast_,
                      grouped_allgather, grouped_allreduce, grouped_reducescatter, join,
                      local_rank_op, local_size_op, process_set_included_op, rank_op,
                      reducescatter, size_op)
from .sync_batch_norm import SyncBatchNormalization


def handle_average_backwards_compatibility(op, average):
    """Horovod's rule for op= and the deprecated average= (see resolve_op)."""
    return _resolve_op(average, op, "tensorflow.handle_average_backwards_compatibility")


def check_num_rank_power_of_2(num_rank):
    return num_rank != 0 and (num_rank & (num_rank - 1)) == 0


# What `from ringsync.tensorflow import *` gives (ringsync.tensorflow.keras uses it): the
# functions and classes, not the submodules (keras has an `elastic` module of its own).
__all__ = [name for name, value in list(globals().items())
           if not name.startswith("_") and not isinstance(value, _types.ModuleType)]

from . import elastic  # noqa: E402  (hvd.elastic; needs broadcast_variables above)
