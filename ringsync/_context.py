"""The job's state, in one place: the default communicator that init() made, the job's
process-set registry, and each communicator's autotuner (as torch.distributed keeps its
`_World` below the package face).

Everything that needs the job's communicator imports this module and calls resolve();
nothing imports the package face (ringsync/__init__.py) for it. Every collective also
works on an explicit Communicator or ProcessSet: resolve() is where the two meet.
"""
import weakref
from typing import Optional

from ._core import Communicator
from .errors import NotInitializedError, UsageError


class _Job:
    """What one process knows of its job. One instance (JOB); a class, so that the state
    is named in one place rather than spread over module globals."""

    def __init__(self):
        self.default: Optional[Communicator] = None
        self.registry = None  # process_sets.Registry of the default communicator, or None
        self.autotuners = weakref.WeakKeyDictionary()  # Communicator -> autotune.Autotuner


JOB = _Job()


def default() -> Optional[Communicator]:
    """The job's communicator, or None before init() and after shutdown()."""
    comm = JOB.default
    return comm if comm is not None and not comm.closed else None


def resolve(process_set=None) -> Communicator:
    """The communicator a call runs on: `process_set` when given (a ProcessSet, or a
    Communicator: whatever takes one takes the other), else the job's default one."""
    if process_set is None:
        comm = JOB.default  # (default(), inline: every collective comes here)
        if comm is None or comm.closed:
            raise NotInitializedError("ringsync has not been initialized; call ringsync.init() "
                                      "first")
        return comm
    if isinstance(process_set, Communicator):
        if process_set.closed:
            raise UsageError("ringsync: process_set is a closed communicator")
        return process_set
    communicator = getattr(process_set, "communicator", None)
    if communicator is None or not callable(communicator):
        raise UsageError(f"ringsync: process_set must be a ringsync.ProcessSet or "
                         f"Communicator, got {type(process_set).__name__}")
    return communicator()


def owner(handle) -> Communicator:
    """The communicator a handle came from (which may not be the default)."""
    comm = getattr(handle, "_comm", None)
    if not isinstance(comm, Communicator):
        raise UsageError(f"ringsync: {handle!r} is not a ringsync Handle")
    return comm
