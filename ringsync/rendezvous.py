"""How the ranks of a new ring find each other: the rendezvous.

Building a ring needs only a few collective exchanges of small Python objects before the
native core's own sockets take over: every rank's address, settings and setup errors
(an allgather), the job's keys (a broadcast from rank 0), and whether connecting worked
(an allgather again). A Rendezvous is anything that can do that for a fixed set of ranks.

Two kinds exist:

- rendezvous_mpi.MpiRendezvous: over an mpi4py communicator (what `ringsync.init()`
  uses). It also offers what elastic recovery needs from MPI (see FaultTolerance below).
  rendezvous_mpi.as_rendezvous picks the one a Communicator builds over.
- ThreadRendezvous: ranks that are threads of one Python process, for tests. The native
  core has no process-wide state, so several rings can live in one process; each thread
  builds its own Communicator over its own ThreadRendezvous of one ThreadGroup.
"""
import abc
import threading
from typing import Any, List, Optional, Sequence, Tuple

from .errors import CommunicationError, UsageError


class Rendezvous(abc.ABC):
    """What a Communicator needs from its ranks' meeting point while it builds the ring.

    Every rank calls the exchanges in the same order (as MPI collectives). An exchange that
    cannot complete (a rank died, a deadline passed) raises instead of hanging.
    """

    rank: int
    size: int

    @abc.abstractmethod
    def allgather(self, obj: Any) -> List[Any]:
        """Every rank's obj, in rank order, on every rank."""

    def bcast(self, obj: Any, root: int = 0) -> Any:
        """root's obj on every rank (the others' obj is ignored)."""
        return self.allgather(obj if self.rank == root else None)[root]

    def split(self, ranks: Sequence[int]) -> Optional["Rendezvous"]:
        """A rendezvous of `ranks` (sorted, distinct ranks of this one; their order is the
        new numbering), or None on a rank not among them. Collective: every rank here
        calls it, with the same ranks (a process set is built over one)."""
        raise NotImplementedError(f"{type(self).__name__} cannot be split")

    def limit_exchanges(self, seconds: Optional[float]) -> None:
        """From now on an exchange that not every rank comes to fails after `seconds`
        (None: no limit). A ThreadGroup has its own timeout already."""

    def close(self) -> None:
        """Release what the rendezvous holds; the Communicator calls it when it shuts down."""

    @property
    def mpi_comm(self):
        """The mpi4py communicator underneath, or None where there is none."""
        return None

    def job_keys(self):
        """The ring's job id and secret: rank 0's fresh ones, broadcast (a rendezvous that
        knows a job secret derives the ring's from it instead)."""
        from .bootstrap import JobKeys
        return self.bcast(JobKeys.new() if self.rank == 0 else None, root=0)


class FaultTolerance(abc.ABC):
    """What elastic recovery asks of a rendezvous whose ranks may die: agree on who is left,
    and optionally bring in replacements. MpiRendezvous offers it under ULFM,
    StoreRendezvous over ringsync's store with RINGSYNC_ELASTIC=1."""

    @property
    @abc.abstractmethod
    def recoverable(self) -> bool:
        """Whether the survivors of a lost rank can go on here."""

    @abc.abstractmethod
    def shrink(self) -> Tuple[Rendezvous, List[int]]:
        """Interrupt every rank still exchanging here, agree on the survivors; returns
        (their rendezvous, the ranks of this one that were lost)."""

    @abc.abstractmethod
    def spawn(self, count: int, hosts=None) -> Rendezvous:
        """Start `count` new ranks (hosts: {host: ranks} where to, else the launcher's
        choice); this one's ranks come first in the one returned."""

    @abc.abstractmethod
    def allreduce_min(self, value: int) -> int:
        """The smallest value over all ranks (the newest commit every survivor holds)."""


class ThreadGroup:
    """The meeting point of `size` ranks that are threads of this process.

    Each exchange has a deadline, and abort() fails the ones in progress and to come, so
    that a rank thread that failed before an exchange does not leave the others waiting
    forever. (Not threading.Barrier: its abort() can fail a rank that an exchange had
    already released, replacing the rank's own error with a misleading one.)
    """

    def __init__(self, size: int, timeout: float = 120.0):
        if size < 1:
            raise UsageError(f"ringsync.ThreadGroup: size must be at least 1, got {size}")
        self.size = size
        self.timeout = timeout
        self._cond = threading.Condition()
        self._posts: List[Any] = [None] * size
        self._arrived = 0
        self._round = 0  # exchanges completed
        self._result: List[Any] = []  # the last completed exchange's posts
        self._aborted = False

    def rendezvous(self, rank: int) -> "ThreadRendezvous":
        if not 0 <= rank < self.size:
            raise UsageError(f"ringsync.ThreadGroup: rank {rank} out of range for {self.size}")
        return ThreadRendezvous(self, rank)

    def abort(self) -> None:
        """Fail every exchange in progress or to come (a rank gave up)."""
        with self._cond:
            self._aborted = True
            self._cond.notify_all()

    def _exchange(self, rank: int, obj: Any) -> List[Any]:
        with self._cond:
            self._raise_if_aborted(rank)
            round_ = self._round
            self._posts[rank] = obj
            self._arrived += 1
            if self._arrived == self.size:
                self._complete_round()
            elif not self._cond.wait_for(lambda: self._round != round_ or self._aborted,
                                         self.timeout):
                self._aborted = True  # the late rank must not wait for us either
                self._cond.notify_all()
            if self._round == round_:
                self._raise_if_aborted(rank)
            # The next round cannot complete (and replace _result) before we post again.
            return list(self._result)

    def _complete_round(self) -> None:
        self._result, self._posts = self._posts, [None] * self.size
        self._arrived = 0
        self._round += 1
        self._cond.notify_all()

    def _raise_if_aborted(self, rank: int) -> None:
        if self._aborted:
            raise CommunicationError(
                f"ringsync.init: rank {rank}: the thread group's exchange was abandoned: "
                f"another rank gave up, or not every rank arrived within {self.timeout:g} s")


class ThreadRendezvous(Rendezvous):
    """One rank's view of a ThreadGroup."""

    def __init__(self, group: ThreadGroup, rank: int):
        self.group, self.rank, self.size = group, rank, group.size

    def allgather(self, obj: Any) -> List[Any]:
        return self.group._exchange(self.rank, obj)

    def split(self, ranks: Sequence[int]) -> Optional["ThreadRendezvous"]:
        # The first member makes the new group; one exchange hands it to the others.
        ranks = list(ranks)
        offer = ThreadGroup(len(ranks), self.group.timeout) if self.rank == ranks[0] else None
        group = self.allgather(offer)[ranks[0]]
        return group.rendezvous(ranks.index(self.rank)) if self.rank in ranks else None

    def __repr__(self) -> str:
        return f"<ringsync.ThreadRendezvous rank {self.rank} of {self.size}>"

