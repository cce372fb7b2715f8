"""ringsync: Horovod-style data-parallel collectives over a native ring, bootstrapped by MPI.

The module-level functions use one default Communicator made by init(); everything also
works on explicit ringsync.Communicator objects.
"""
import atexit
import sys
import traceback

from .config import Config
from .errors import (CommunicationError, CommunicationTimeout, HorovodInternalError,
                     HostsUpdatedInterrupt, MismatchError, NotInitializedError, RingsyncError,
                     UsageError)

__version__ = "0.1.0"

from .ops import ReduceOp

try:
    from ._core import Communicator, Handle
    from . import process_sets as _process_sets
    from .process_sets import (ProcessSet, add_process_set, global_process_set,
                               remove_process_set)
except ImportError as _e:  # only where the native core was not built
    _NATIVE_IMPORT_ERROR = _e

    def Communicator(*args, **kwargs):  # noqa: N802 - stands in for the class
        raise ImportError(
            "ringsync's native core (ringsync._native) is not built; install the package with "
            "`pip install .` (or `pip install -e .`) so that cffi compiles native/"
        ) from _NATIVE_IMPORT_ERROR

    Handle = None

Sum = ReduceOp.SUM
Average = ReduceOp.AVERAGE
Min = ReduceOp.MIN
Max = ReduceOp.MAX
Product = ReduceOp.PRODUCT
Adasum = ReduceOp.ADASUM

_default = None  # the Communicator behind the module-level API


def _skip_mpi_finalize_under_fault_tolerance():
    """Open MPI 5's MPI_Finalize can wait forever once a rank of the job has died, even
    after Revoke and Shrink (seen here in about 1 run of 6 with plain mpi4py). Under
    fault tolerance a process may end without it: mpirun then reports each process's
    own exit status. mpi4py reads this option when mpi4py.MPI is first imported, so
    it only takes effect when ringsync is imported first. A replacement rank started by
    Spawn is a job of its own, which must finalize: it does (its job lost nobody)."""
    from . import bootstrap
    if (bootstrap.fault_tolerant() and "mpi4py.MPI" not in sys.modules
            and not bootstrap.spawned_by_mpi()):
        try:
            import mpi4py
        except ImportError:
            return
        mpi4py.rc.finalize = False


_skip_mpi_finalize_under_fault_tolerance()


def init(comm=None, process_sets=None):
    """Build the ring over `comm` (an mpi4py intracommunicator; MPI.COMM_WORLD by default)
    and the process sets given (a list of ProcessSet, each a ring of its own; "dynamic" is
    accepted: sets can always be added later). In a replacement rank started by elastic
    recovery (--respawn), the default is the communicator shared with the survivors.

    As Horovod's: MPI is initialised here if mpi4py was told not to do it
    (mpi4py.rc.initialize = False); an init that fails (bad process sets) leaves ringsync
    not initialised, on every rank; called again while initialised it builds nothing,
    but the process sets given are checked and attached to the registered sets of the
    same ranks."""
    if _default is not None and not _default.closed:
        _process_sets.attach_registered(process_sets)
        return
    from . import bootstrap
    own = False
    if comm is None:
        bootstrap.ensure_mpi_initialized()
        comm = bootstrap.replacement_world()
        own = comm is not None
    elif isinstance(comm, (list, tuple, range)):
        raise UsageError("ringsync.init: comm as a list of ranks is not supported; pass an "
                         "mpi4py communicator, or use a ProcessSet for a subset of ranks")
    bootstrap.record_start()
    _start(comm, own)
    try:
        _process_sets.attach(_default, process_sets)
    except BaseException:
        shutdown()  # (every rank got the same refusal: the sets were agreed on)
        raise


def _start(comm, own_comm: bool, survivor: bool = False):
    """Make the default Communicator. A replacement rank (own_comm) that cannot build it
    dies as a failed rank, so that the others recover again rather than wait for it; a
    survivor of a failure (elastic recovery) gets the error and recovers again."""
    global _default
    _default = None
    try:
        _default = Communicator(comm, own_comm=own_comm)
    except Exception as e:
        if not own_comm or survivor:
            raise
        from . import bootstrap
        traceback.print_exc()
        bootstrap.exit_as_failed(cause=f"{type(e).__name__}: {e}")
    _limit_mpi_waits(_default)
    if _default.size() > 1:
        _install_die_hard_excepthook()
    atexit.unregister(shutdown)  # once, however often the ring is rebuilt
    atexit.register(shutdown)


def _limit_mpi_waits(comm: Communicator) -> None:
    """From now on no exchange over the job's MPI communicator waits longer than the
    start timeout for a rank that left the call, or never came to it."""
    comm.rendezvous.limit_exchanges(comm.config.start_timeout_seconds)


def shutdown():
    global _default
    if _default is not None:
        from . import bootstrap
        _process_sets.detach()
        _default.shutdown()
        _default = None
        bootstrap.record_job_event("finished")


def is_initialized() -> bool:
    return _default is not None and not _default.closed


def _comm(process_set=None) -> Communicator:
    """The communicator a call runs on: `process_set` when given (a ProcessSet, or a
    Communicator; the adapters' functions all take one), else the default one that
    init() made."""
    if isinstance(process_set, ProcessSet):
        return _process_sets.communicator_of(process_set)
    if process_set is not None:
        if not isinstance(process_set, Communicator):
            raise UsageError(f"ringsync: process_set must be a ringsync.ProcessSet or "
                             f"Communicator, got {type(process_set).__name__}")
        if process_set.closed:
            raise UsageError("ringsync: process_set is a closed communicator")
        return process_set
    if _default is None or _default.closed:
        raise NotInitializedError("ringsync has not been initialized; call ringsync.init() first")
    return _default


def _default_or_none():
    return _default if _default is not None and not _default.closed else None


def _install(comm: Communicator):
    """Make comm the default communicator (elastic recovery hands its new ring here). The
    old ring's process sets lost ranks with it: they are closed; the job adds them again."""
    global _default
    _process_sets.detach(abort=True)
    _default = comm
    _limit_mpi_waits(comm)
    _process_sets.start_registry(comm)


def _install_die_hard_excepthook():
    """An uncaught exception must end this rank at once: left to the interpreter, it would
    sit in MPI_Finalize while the peers wait for it forever. mpirun sees the non-zero exit
    and ends the job (under MPI fault tolerance the rank is killed instead, so that
    elastic survivors recover without it, unless no other rank is left: see
    bootstrap.exit_as_failed); peers see the broken connection."""
    from . import bootstrap
    previous = sys.excepthook
    if getattr(previous, "_ringsync_die_hard", False):
        return

    def die_hard(exc_type, exc, tb):
        comms = []
        try:
            rank = _default.rank() if _default is not None else "?"
            comms = [_default.mpi_comm] if _default is not None else []
            sys.stderr.write(f"ringsync: uncaught exception on rank {rank}; exiting this rank\n")
            traceback.print_exception(exc_type, exc, tb)
        finally:
            # Waiting to hear that the others are gone pays only where a peer's loss is
            # what failed this rank; a rank's own bug ends it at once.
            wait = None if issubclass(exc_type, CommunicationError) else 0.0
            bootstrap.exit_as_failed(cause=f"{exc_type.__name__}: {exc}", comms=comms,
                                     wait=wait)

    die_hard._ringsync_die_hard = True
    sys.excepthook = die_hard


def rank() -> int:
    return _comm().rank()


def size() -> int:
    return _comm().size()


def local_rank() -> int:
    return _comm().local_rank()


def local_size() -> int:
    return _comm().local_size()


def cross_rank() -> int:
    return _comm().cross_rank()


def cross_size() -> int:
    return _comm().cross_size()


def allreduce(tensor, op=Average, prescale_factor=1.0, postscale_factor=1.0, name=None):
    return _comm().allreduce(tensor, op, prescale_factor, postscale_factor, name)


def allreduce_(tensor, op=Average, prescale_factor=1.0, postscale_factor=1.0, name=None):
    return _comm().allreduce_(tensor, op, prescale_factor, postscale_factor, name)


def allreduce_async(tensor, op=Average, prescale_factor=1.0, postscale_factor=1.0, name=None):
    return _comm().allreduce_async(tensor, op, prescale_factor, postscale_factor, name)


def allreduce_async_(tensor, op=Average, prescale_factor=1.0, postscale_factor=1.0, name=None):
    return _comm().allreduce_async_(tensor, op, prescale_factor, postscale_factor, name)


def grouped_allreduce(tensors, op=Average, prescale_factor=1.0, postscale_factor=1.0, name=None):
    return _comm().grouped_allreduce(tensors, op, prescale_factor, postscale_factor, name)


def grouped_allreduce_(tensors, op=Average, prescale_factor=1.0, postscale_factor=1.0, name=None):
    return _comm().grouped_allreduce_(tensors, op, prescale_factor, postscale_factor, name)


def grouped_allreduce_async(tensors, op=Average, prescale_factor=1.0, postscale_factor=1.0,
                            name=None):
    return _comm().grouped_allreduce_async(tensors, op, prescale_factor, postscale_factor, name)


def grouped_allreduce_async_(tensors, op=Average, prescale_factor=1.0, postscale_factor=1.0,
                             name=None):
    return _comm().grouped_allreduce_async_(tensors, op, prescale_factor, postscale_factor, name)


def allgather(tensor, name=None):
    return _comm().allgather(tensor, name)


def allgather_async(tensor, name=None):
    return _comm().allgather_async(tensor, name)


def broadcast(tensor, root_rank, name=None):
    return _comm().broadcast(tensor, root_rank, name)


def broadcast_(tensor, root_rank, name=None):
    return _comm().broadcast_(tensor, root_rank, name)


def broadcast_async(tensor, root_rank, name=None):
    return _comm().broadcast_async(tensor, root_rank, name)


def broadcast_async_(tensor, root_rank, name=None):
    return _comm().broadcast_async_(tensor, root_rank, name)


def reducescatter(tensor, op=Average, prescale_factor=1.0, postscale_factor=1.0, name=None):
    return _comm().reducescatter(tensor, op, prescale_factor, postscale_factor, name)


def reducescatter_async(tensor, op=Average, prescale_factor=1.0, postscale_factor=1.0, name=None):
    return _comm().reducescatter_async(tensor, op, prescale_factor, postscale_factor, name)


def alltoall(tensor, splits=None, name=None):
    return _comm().alltoall(tensor, splits, name)


def alltoall_async(tensor, splits=None, name=None):
    return _comm().alltoall_async(tensor, splits, name)


def send(tensor, dst, name=None, process_set=None):
    """Send tensor to rank dst (of process_set, when given); returns once dst received it."""
    return _comm(process_set).send(tensor, dst, name)


def send_async(tensor, dst, name=None, process_set=None):
    return _comm(process_set).send_async(tensor, dst, name)


def recv(tensor, src, name=None, process_set=None):
    """Receive rank src's message into tensor (preallocated: the sender's dtype and shape)."""
    return _comm(process_set).recv(tensor, src, name)


def recv_async(tensor, src, name=None, process_set=None):
    return _comm(process_set).recv_async(tensor, src, name)


def barrier(process_set=None):
    _comm(process_set).barrier()


from .objects import allgather_object, broadcast_object  # noqa: E402


def join() -> int:
    """Declare that this rank has no more data; returns the last rank to join (Horovod)."""
    return _comm().join()


def poll(handle) -> bool:
    """True once the handle's collective has completed."""
    return _owner(handle).poll(handle)


def synchronize(handle):
    """Wait for an async handle; returns its result or raises its error."""
    return _owner(handle).synchronize(handle)


def _owner(handle) -> Communicator:
    """The communicator a handle came from (which may not be the default)."""
    comm = getattr(handle, "_comm", None)
    if not isinstance(comm, Communicator):
        raise UsageError(f"ringsync: {handle!r} is not a ringsync Handle")
    return comm


def start_timeline(file_path, mark_cycles=False):
    """Record a Chrome-trace JSON timeline of every rank's tensors (open it in Perfetto),
    written as one file to rank 0's file_path at stop_timeline() or shutdown(). Call it on
    every rank, as stop_timeline(). mark_cycles: mark the start of each negotiation round
    (instant events named CYCLE_START)."""
    _comm().start_timeline(file_path, mark_cycles)


def stop_timeline():
    """Collective: every rank calls it; rank 0 writes the timeline file."""
    _comm().stop_timeline()


__all__ = [
    "init", "shutdown", "is_initialized", "rank", "size", "local_rank", "local_size",
    "cross_rank", "cross_size", "allreduce", "allreduce_", "allreduce_async",
    "allreduce_async_", "grouped_allreduce", "grouped_allreduce_", "grouped_allreduce_async",
    "grouped_allreduce_async_", "allgather", "allgather_async", "broadcast", "broadcast_",
    "broadcast_async", "broadcast_async_", "reducescatter", "reducescatter_async", "alltoall",
    "alltoall_async", "send", "send_async", "recv", "recv_async", "barrier", "join", "poll",
    "broadcast_object", "allgather_object",
    "synchronize", "start_timeline", "stop_timeline", "ProcessSet", "global_process_set",
    "add_process_set", "remove_process_set",
    "Handle", "Sum", "Average", "Min", "Max", "Adasum",
    "Product", "ReduceOp", "Communicator", "Config", "RingsyncError", "UsageError",
    "NotInitializedError", "MismatchError", "CommunicationError", "CommunicationTimeout", "HorovodInternalError",
    "HostsUpdatedInterrupt",
]
