"""The job's lifetime, as Horovod's basics: init() builds the default communicator and the
process-set registry (kept in _context), shutdown() closes them, and the queries
(rank, size, ...) read them. Elastic recovery hands its rebuilt ring to install().

Importing this module also arranges, under MPI fault tolerance, that mpi4py skips
MPI_Finalize (see _skip_mpi_finalize_under_fault_tolerance): it must come before the
first import of mpi4py.MPI, so the package face imports it first.
"""
import atexit
import os
import sys
import traceback

from . import _observe, bootstrap, rendezvous_env
from . import process_sets as sets  # (init's argument has the module's name, as Horovod's)
from ._context import JOB, default, resolve
from ._core import Communicator
from .errors import CommunicationError, UsageError
from .rendezvous import Rendezvous


def _skip_mpi_finalize_under_fault_tolerance():
    """Open MPI 5's MPI_Finalize can wait forever once a rank of the job has died, even
    after Revoke and Shrink (seen here in about 1 run of 6 with plain mpi4py). Under
    fault tolerance a process may end without it: mpirun then reports each process's
    own exit status. mpi4py reads this option when mpi4py.MPI is first imported, so
    it only takes effect when ringsync is imported first. A replacement rank started by
    Spawn is a job of its own, which must finalize: it does (its job lost nobody)."""
    if (bootstrap.fault_tolerant() and "mpi4py.MPI" not in sys.modules
            and not bootstrap.spawned_by_mpi()):
        try:
            import mpi4py
        except ImportError:
            return
        mpi4py.rc.finalize = False


_skip_mpi_finalize_under_fault_tolerance()


def init(comm=None, process_sets=None, rendezvous=None):
    """Build the ring over `comm` (an mpi4py intracommunicator) and the process sets given
    (a list of ProcessSet, each a ring of its own; "dynamic" is accepted: sets can always
    be added later).

    Without comm the ring is built over the world this process was started in
    (rendezvous_env.find_world): MPI.COMM_WORLD under mpirun (in a replacement rank that
    elastic recovery spawned, the communicator shared with the survivors), else a store
    found through torchrun's / PyTorchJob's or Slurm's variables. rendezvous names it
    outright, as RINGSYNC_RENDEZVOUS does: "mpi", "env://", "tcp://HOST:PORT",
    "file:///DIR", or a ringsync.rendezvous.Rendezvous.

    As Horovod's: MPI is initialised here if mpi4py was told not to do it
    (mpi4py.rc.initialize = False); an init that fails (bad process sets) leaves ringsync
    not initialised, on every rank; called again while initialised it builds nothing,
    but the process sets given are checked and attached to the registered sets of the
    same ranks."""
    if default() is not None:
        sets.attach_registered(process_sets)
        return
    if isinstance(comm, (list, tuple, range)):
        raise UsageError("ringsync.init: comm as a list of ranks is not supported; pass an "
                         "mpi4py communicator, or use a ProcessSet for a subset of ranks")
    if comm is not None and rendezvous is not None:
        raise UsageError("ringsync.init: give comm or rendezvous, not both")
    own, meeting = False, rendezvous if isinstance(rendezvous, Rendezvous) else None
    if comm is None and meeting is None:
        comm, own, meeting = _meeting_point(rendezvous_env.find_world(os.environ, rendezvous))
    bootstrap.record_start()
    start(comm, own, rendezvous=meeting)
    try:
        sets.attach(JOB.default, process_sets)
    except BaseException:
        shutdown()  # (every rank got the same refusal: the sets were agreed on)
        raise


def _meeting_point(world):
    """(MPI communicator, whether it is ours alone, rendezvous) for the world found: MPI's
    (a replacement rank's is the one it shares with the survivors), or a store's."""
    if world.kind == "mpi":
        bootstrap.ensure_mpi_initialized()
        comm = bootstrap.replacement_world()
        return comm, comm is not None, None
    try:
        return None, world.join, rendezvous_env.open_rendezvous(world)
    except SystemExit as finished:  # (a replacement that came after the job's end)
        print(finished, file=sys.stderr, flush=True)
        raise


def start(comm, own_comm: bool, survivor: bool = False, rendezvous=None) -> Communicator:
    """Make the default Communicator (over comm, or the rendezvous given). A replacement
    rank (own_comm) that cannot build it dies as a failed rank, so that the others recover
    again rather than wait for it; a survivor of a failure (elastic recovery) gets the
    error and recovers again."""
    JOB.default = None
    try:
        JOB.default = Communicator(comm, own_comm=own_comm, rendezvous=rendezvous)
    except Exception as e:
        if not own_comm or survivor:
            raise
        traceback.print_exc()
        bootstrap.exit_as_failed(cause=f"{type(e).__name__}: {e}")
    _limit_mpi_waits(JOB.default)
    if JOB.default.size() > 1:
        _install_die_hard_excepthook()
        _observe.install_report_signal(request_hang_report)
        if JOB.default.config.flight_recorder_dir:
            _observe.TerminationRecords(_leave_flight_records).install()
    atexit.unregister(shutdown)  # once, however often the ring is rebuilt
    atexit.register(shutdown)
    return JOB.default


def _limit_mpi_waits(comm: Communicator) -> None:
    """From now on no exchange over the job's MPI communicator waits longer than the
    start timeout for a rank that left the call, or never came to it."""
    comm.rendezvous.limit_exchanges(comm.config.start_timeout_seconds)


def shutdown():
    if JOB.default is not None:
        finish = getattr(JOB.default.rendezvous, "finish", None)
        if finish is not None and JOB.default.rank() == 0:
            finish()  # (a store's replacements still waiting to join give up)
        sets.detach()
        JOB.default.shutdown()
        JOB.default = None
        bootstrap.record_job_event("finished")


def is_initialized() -> bool:
    return default() is not None


def install(comm: Communicator):
    """Make comm the default communicator (elastic recovery hands its new ring here). The
    old ring's process sets lost ranks with it: they are closed; the job adds them again."""
    sets.detach(abort=True)
    JOB.default = comm
    _limit_mpi_waits(comm)
    sets.start_registry(comm)


def _install_die_hard_excepthook():
    """An uncaught exception must end this rank at once: left to the interpreter, it would
    sit in MPI_Finalize while the peers wait for it forever. mpirun sees the non-zero exit
    and ends the job (under MPI fault tolerance the rank is killed instead, so that
    elastic survivors recover without it, unless no other rank is left: see
    bootstrap.exit_as_failed); peers see the broken connection."""
    previous = sys.excepthook
    if getattr(previous, "_ringsync_die_hard", False):
        return

    def die_hard(exc_type, exc, tb):
        comms = []
        try:
            comm = JOB.default
            rank = comm.rank() if comm is not None else "?"
            comms = [comm.mpi_comm] if comm is not None else []
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
    return resolve().rank()


def size() -> int:
    return resolve().size()


def local_rank() -> int:
    return resolve().local_rank()


def local_size() -> int:
    return resolve().local_size()


def cross_rank() -> int:
    return resolve().cross_rank()


def cross_size() -> int:
    return resolve().cross_size()


def _leave_flight_records(why: str) -> None:
    """The job's ring's flight records, where RINGSYNC_FLIGHT_RECORDER_DIR says."""
    comm = default()
    if comm is not None:
        comm._leave_flight_records(why)


def straggler_report(last=200, process_set=None):
    """Per rank, how long it kept the others waiting per negotiation round over the last
    `last` rounds that ran collectives (mean_ms, p50_ms, p95_ms, rounds_last, rounds, host):
    see Communicator.straggler_report."""
    return resolve(process_set).straggler_report(last)


def flight_records(process_set=None):
    """This rank's last collectives, oldest first: see Communicator.flight_records."""
    return resolve(process_set).flight_records()


def request_hang_report():
    """Ask every rank of the job for its part of a hang report, as SIGUSR1 does (parts go
    to RINGSYNC_HANG_REPORT_DIR; rank 0 or `ringsync run` prints the merged table)."""
    comm = default()
    if comm is not None:
        comm.request_hang_report()


def start_timeline(file_path, mark_cycles=False):
    """Record a Chrome-trace JSON timeline of every rank's tensors (open it in Perfetto),
    written as one file to rank 0's file_path at stop_timeline() or shutdown(). Call it on
    every rank, as stop_timeline(). mark_cycles: mark the start of each negotiation round
    (instant events named CYCLE_START)."""
    resolve().start_timeline(file_path, mark_cycles)


def stop_timeline():
    """Collective: every rank calls it; rank 0 writes the timeline file."""
    resolve().stop_timeline()
