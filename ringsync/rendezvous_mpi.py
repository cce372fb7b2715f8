"""The MPI rendezvous: the ranks of an mpi4py communicator meet over MPI (what
`ringsync.init()` uses), through bootstrap's bounded exchanges; under ULFM it also offers
what elastic recovery needs (rendezvous.FaultTolerance). And as_rendezvous: what a
Communicator builds over (a rendezvous given, else this one over MPI.COMM_WORLD).

mpi4py is imported only where MPI is used: building a ring over a ThreadRendezvous never
loads it."""
import math
import time
from typing import Optional

from .bootstrap import (DeadlinePassed, bounded_allgather, bounded_bcast, bounded_min,
                        fault_tolerant, shrink, spawn_replacements, wait_until)
from .errors import CommunicationTimeout, UsageError
from .rendezvous import FaultTolerance, Rendezvous


class MpiRendezvous(Rendezvous, FaultTolerance):
    """The ranks of an mpi4py intracommunicator meet over MPI (what ringsync.init() uses).

    timeout: seconds any one exchange may wait for the other ranks (None: no limit, as
    while init() waits for ranks that start late). After init every exchange has one,
    the start timeout (limit_exchanges): a rank that left a collective call, or never
    came to it, must not leave the others in MPI forever (issue 26)."""

    def __init__(self, comm, owned: bool, timeout: Optional[float] = None):
        """owned: comm is a duplicate made for us, freed by close()."""
        self._comm, self._owned = comm, owned
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        self.timeout = timeout
        # An exchange that timed out: its request (and the buffers MPI may still write)
        # kept alive; a later exchange here would pair with a late rank's old one.
        self._stuck = None

    @classmethod
    def over(cls, comm=None, own_comm: bool = False) -> "MpiRendezvous":
        """A rendezvous over comm (MPI.COMM_WORLD by default). Our bootstrap traffic never
        mixes with the user's: it runs on a duplicate, unless own_comm says that comm is
        ours alone (elastic recovery hands over the communicator it just built, so that
        revoking that one also interrupts our exchanges)."""
        from mpi4py import MPI
        comm = MPI.COMM_WORLD if comm is None else comm
        if not isinstance(comm, MPI.Intracomm):
            raise UsageError(f"ringsync.init: comm must be an mpi4py intracommunicator, "
                             f"got {type(comm).__name__}")
        return cls(comm, owned=False) if own_comm else cls(comm.Dup(), owned=True)

    def limit_exchanges(self, seconds: Optional[float]) -> None:
        """From now on every exchange fails after `seconds` without every rank."""
        self.timeout = seconds

    # Every exchange is a nonblocking MPI collective, also without a timeout: MPI never
    # matches a blocking collective with a nonblocking one, and ranks of one communicator
    # may differ in whether they have a timeout yet (a replacement rank in its init()).

    def allgather(self, obj):
        return self._bounded("allgather", lambda deadline: bounded_allgather(
            self._comm, obj, deadline))

    def bcast(self, obj, root: int = 0):
        return self._bounded("broadcast", lambda deadline: bounded_bcast(
            self._comm, obj, root, deadline))

    def barrier(self) -> None:
        """Wait for every rank (within the timeout, when there is one)."""
        self._bounded("barrier", lambda deadline: wait_until(
            self._comm.Ibarrier(), deadline))

    def _bounded(self, what: str, exchange):
        if self._stuck is not None:
            raise CommunicationTimeout(
                f"ringsync: rank {self.rank}: the MPI communicator of this ring is unusable: "
                f"an earlier exchange timed out ({self._stuck[0]})")
        try:
            return exchange(math.inf if self.timeout is None
                            else time.monotonic() + self.timeout)
        except DeadlinePassed as late:
            text = (f"rank {self.rank}: not every one of the {self.size} ranks came to the "
                    f"{what} within {self.timeout:g} s (RINGSYNC_START_TIMEOUT_SECONDS): every "
                    f"rank must make the same ringsync calls in the same order")
            self._stuck = (text, late.kept)
            raise CommunicationTimeout(f"ringsync: {text}") from None

    def close(self) -> None:
        if self._owned:
            self._owned = False
            try:
                self._comm.Free()
            except Exception:  # a communicator with failed ranks: nothing left to free
                pass

    def split(self, ranks):
        """Every rank must call it with the same ranks (process_sets agrees on them first).
        MPI has no nonblocking Comm_split: a bounded barrier first, so that Comm_split
        starts only once every rank is there, and never waits long."""
        from mpi4py import MPI
        ranks = list(ranks)
        member = self.rank in ranks
        self.barrier()
        sub = self._comm.Split(0 if member else MPI.UNDEFINED,
                               ranks.index(self.rank) if member else 0)
        return MpiRendezvous(sub, owned=True, timeout=self.timeout) if member else None

    @property
    def mpi_comm(self):
        return self._comm

    def disconnect(self) -> None:
        """Collective: cut this communicator's ranks apart (MPI_Comm_disconnect), so that
        ranks leaving the job can end without the others. (A bounded barrier first, as
        before split.)"""
        self.barrier()
        self._comm.Disconnect()
        self._owned = False  # nothing left to free

    @property
    def recoverable(self) -> bool:
        return fault_tolerant()

    def shrink(self):
        survivors, lost = shrink(self._comm)
        return MpiRendezvous(survivors, owned=False, timeout=self.timeout), lost

    def spawn(self, count: int, hosts=None):
        # Unbounded: MPI has no nonblocking spawn; mpirun fails it if a process cannot start.
        return MpiRendezvous(spawn_replacements(self._comm, count, hosts), owned=False,
                             timeout=self.timeout)

    def allreduce_min(self, value: int) -> int:
        return self._bounded("agreement on a commit", lambda deadline: bounded_min(
            self._comm, value, deadline))


def as_rendezvous(comm=None, own_comm: bool = False, rendezvous: Optional[Rendezvous] = None
                  ) -> Rendezvous:
    """The rendezvous a Communicator builds over: the one given, or one over the mpi4py
    communicator given (MPI.COMM_WORLD by default)."""
    if isinstance(comm, Rendezvous):  # given in the MPI communicator's place
        comm, rendezvous = (None, comm) if rendezvous is None else (comm, rendezvous)
    if rendezvous is None:
        return MpiRendezvous.over(comm, own_comm)
    if comm is not None:
        raise UsageError("ringsync.Communicator: give an MPI communicator or a rendezvous, "
                         "not both")
    return rendezvous
