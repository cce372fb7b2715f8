"""torch.distributed on ringsync: importing this module (``import ringsync.torch`` does)
registers the backend "ringsync" for CPU tensors, so that unchanged torch.distributed code
runs on ringsync's ring:

    import ringsync.torch.distributed  # registers "ringsync"
    dist.init_process_group("ringsync")           # or "cpu:ringsync,cuda:nccl"
    model = DistributedDataParallel(model)

CUDA tensors given to a ringsync group go to an NCCL backend that the group keeps over
the same store, where the machine has CUDA and NCCL (see _devices.py).

torch offers no entry point that registers a process-group backend without an import
(its "torch.backends" entry points are for device extensions), hence the import.

Each group (the world, new_group, new_subgroups, a DeviceMesh dimension) gets its own
ring, built over the store torch hands the backend (TCPStore under torchrun or env://,
FileStore under file://): no MPI needed. Where ringsync.init() already made the job's
communicator over the same ranks (under mpirun, say), the world group uses that one.
"""
import atexit
import weakref
from datetime import timedelta

import torch.distributed as dist

from ringsync._context import default
from ringsync._core import Communicator
from ringsync.config import Config
from ringsync.rendezvous_store import StoreRendezvous

from ._convert import BACKEND
from ._devices import cuda_backend
from ._group import ProcessGroupRingsync
from ._work import RingsyncWork

__all__ = ["BACKEND", "ProcessGroupRingsync", "RingsyncWork", "create_process_group"]


def create_process_group(options, backend_options=None) -> ProcessGroupRingsync:
    """torch's creator (extended API): options carries the group's store, this rank, the
    size, the timeout and the group's world ranks."""
    rank, size = options.group_rank, options.group_size
    timeout = options.timeout if isinstance(options.timeout, timedelta) else \
        timedelta(seconds=float(options.timeout))
    world = list(options.global_ranks_in_group or range(size))
    cuda = cuda_backend(options.store, rank, size, timeout)
    job = default()
    if job is not None and world == list(range(job.size())) and job.size() == size \
            and job.rank() == rank:
        return _live(ProcessGroupRingsync(job, rank, size, timeout, owns_comm=False,
                                          cuda=cuda))
    seconds = timeout.total_seconds()
    config = Config.from_env(timeout_seconds=seconds, start_timeout_seconds=seconds)
    rendezvous = StoreRendezvous(options.store, rank, size, timeout=seconds)
    comm = Communicator(rendezvous=rendezvous, config=config)
    return _live(ProcessGroupRingsync(comm, rank, size, timeout, cuda=cuda))


def _live(group: ProcessGroupRingsync) -> ProcessGroupRingsync:
    _live_groups.add(group)
    return group


# Groups not yet destroyed. A script need not call destroy_process_group(); the groups it
# leaves are shut down at exit (their Completer threads stopped, their rings closed)
# before the interpreter tears torch down under them, which aborted such ranks ("terminate
# called without an active exception") about half the time.
_live_groups = weakref.WeakSet()


@atexit.register
def _shut_down_groups_left() -> None:
    for group in list(_live_groups):
        try:
            group.shutdown()
        except Exception:  # (a group that failed already has nothing left to close)
            pass


def _register() -> None:
    if getattr(dist.Backend, BACKEND.upper(), None) is None:  # (one registration)
        dist.Backend.register_backend(BACKEND, create_process_group, extended_api=True,
                                      devices=["cpu"])


_register()
