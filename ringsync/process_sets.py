"""Process sets, as in Horovod: collectives over a subset of the job's ranks.

    even = ringsync.add_process_set([0, 2])          # every rank calls it, in the same order
    if even.included():
        ringsync.allreduce(x, process_set=even)      # ranks 0 and 2 only
    ringsync.remove_process_set(even)

Each set is a ring of its own: a Communicator over the set's members, built by splitting
the job's rendezvous (MPI's Comm_split under mpirun), with its own engine thread, sockets
and same-host segments. Collectives of different sets therefore run concurrently and
never wait for each other; removing a set shuts its ring down and releases all of that.
Ranks are numbered as in the job ("global" ranks) wherever a caller names one (a set's
`ranks`, broadcast roots, join's result), while `ps.rank()` is the rank within the set.

The sets of a job live with the job's default communicator: ringsync.init() registers
the ones it is given, ringsync.shutdown() closes them all.
"""
import dataclasses
import sys
from typing import Dict, List, Optional, Sequence, Union

from ._core import Communicator
from .errors import UsageError


class ProcessSet:
    """A set of the job's ranks that run collectives together.

    Made from a list of global ranks, or from an mpi4py communicator (ranks where it is
    MPI.COMM_NULL are not members); registered by ringsync.init(process_sets=[...]) or
    ringsync.add_process_set(), which give it a process_set_id.
    """

    def __init__(self, ranks_or_comm: Union[Sequence[int], object]):
        self.process_set_id: Optional[int] = None
        self.ranks: Optional[List[int]] = None
        self.mpi_comm = None
        self._comm: Optional[Communicator] = None  # this rank's ring of the set, if a member
        self._size: Optional[int] = None
        self._world_rank: Optional[int] = None  # this rank in the job, once registered
        if _is_mpi_comm(ranks_or_comm):
            self.mpi_comm = ranks_or_comm
            return
        try:
            ranks = list(ranks_or_comm)
        except TypeError:
            raise UsageError(f"ringsync.ProcessSet: expected a list of ranks or an mpi4py "
                             f"communicator, got {type(ranks_or_comm).__name__}") from None
        if any(isinstance(r, bool) or not isinstance(r, int) for r in ranks):
            raise UsageError(f"ringsync.ProcessSet: ranks must be ints, got {ranks!r}")
        self.ranks = sorted(ranks)

    def size(self) -> Optional[int]:
        """How many ranks the set has (None until it is registered)."""
        return None if self.process_set_id is None else self._size

    def rank(self) -> Optional[int]:
        """This rank's place in the set (None until it is registered); UsageError on a
        rank that is not a member."""
        if self.process_set_id is None:
            return None
        if self._comm is None:
            raise UsageError(f"ringsync: rank {self._world_rank} is not a member of {self}")
        return self._comm.rank()

    def included(self) -> Optional[bool]:
        """Whether this rank is a member (None while the ranks are not known yet)."""
        if self.ranks is None:
            return None
        rank = _world().rank() if self._world_rank is None else self._world_rank
        return rank in self.ranks

    def __repr__(self) -> str:
        return (f"ProcessSet(process_set_id={self.process_set_id}, ranks={self.ranks}, "
                f"mpi_comm={self.mpi_comm})")

    __str__ = __repr__


def _is_mpi_comm(obj) -> bool:
    # Only where mpi4py.MPI is loaded already (then obj may be one of its communicators):
    # importing it here, at `import ringsync`, would come before the fault-tolerance setup
    # that must precede it (ringsync/__init__.py, _skip_mpi_finalize_under_fault_tolerance).
    mpi = sys.modules.get("mpi4py.MPI")
    return mpi is not None and isinstance(obj, mpi.Comm)


class _GlobalProcessSet(ProcessSet):
    """Every rank of the job: the default communicator."""

    def __init__(self):
        super().__init__([])
        self.process_set_id = 0

    def size(self) -> int:
        return _world().size()

    def rank(self) -> int:
        return _world().rank()

    def included(self) -> bool:
        _world()
        return True

    @property
    def ranks(self):
        world = _current_world()
        return [] if world is None else list(range(world.size()))

    @ranks.setter
    def ranks(self, value):  # (ProcessSet.__init__ sets it; the job decides)
        pass


global_process_set = _GlobalProcessSet()


@dataclasses.dataclass
class Registry:
    """The process sets of one job (one default communicator), by id."""

    world: Communicator
    sets: Dict[int, ProcessSet] = dataclasses.field(default_factory=dict)
    next_id: int = 1

    def add(self, ps: ProcessSet) -> ProcessSet:
        """Collective over the job: every rank adds the same sets in the same order."""
        if ps.process_set_id is not None:
            raise UsageError(f"ringsync.add_process_set: {ps} is registered already")
        if ps.ranks is None:
            ps.ranks = self._members_of(ps.mpi_comm)
        self._check_ranks(ps)
        rendezvous = self.world.rendezvous.split(ps.ranks)
        if rendezvous is not None:
            config = dataclasses.replace(self.world.config, timeline="")  # one per job
            ps._comm = Communicator(rendezvous=rendezvous, config=config,
                                    world_ranks=ps.ranks)
        ps._size, ps._world_rank = len(ps.ranks), self.world.rank()
        ps.process_set_id = self.next_id
        self.sets[self.next_id] = ps
        self.next_id += 1
        return ps

    def _members_of(self, mpi_comm) -> List[int]:
        from mpi4py import MPI
        member = mpi_comm is not None and mpi_comm != MPI.COMM_NULL
        return [r for r, m in enumerate(self.world.rendezvous.allgather(member)) if m]

    def _check_ranks(self, ps: ProcessSet) -> None:
        size = self.world.size()
        bad = [r for r in ps.ranks if not 0 <= r < size]
        if bad or not ps.ranks or len(set(ps.ranks)) != len(ps.ranks):
            raise UsageError(f"ringsync.add_process_set: ranks {ps.ranks} must be distinct "
                             f"ranks of the job (0..{size - 1}), at least one")
        for other in self.sets.values():
            if other.ranks == ps.ranks:
                raise UsageError(f"ringsync.add_process_set: attempted to add a duplicate "
                                 f"process set: {ps} has the ranks of {other}")

    def remove(self, ps: ProcessSet) -> bool:
        """Shut the set's ring down (a collective of its members) and forget it."""
        if ps.process_set_id is None or ps.process_set_id == 0:
            return False
        if self.sets.get(ps.process_set_id) is not ps:
            return False
        del self.sets[ps.process_set_id]
        ps.process_set_id = None
        comm, ps._comm = ps._comm, None
        if comm is not None:
            comm.shutdown()
        return True

    def close(self, abort: bool = False) -> None:
        """Every set's ring, in id order (the same on every rank: no shutdown waits on a
        set whose members are still shutting down another)."""
        for set_id in sorted(self.sets):
            ps = self.sets.pop(set_id)
            ps.process_set_id = None
            comm, ps._comm = ps._comm, None
            if comm is not None:
                comm.abort("the job's communicator was replaced") if abort else comm.shutdown()


_registry: Optional[Registry] = None


def _current_world() -> Optional[Communicator]:
    from . import _default_or_none
    return _default_or_none()


def _world() -> Communicator:
    from . import _comm
    return _comm()


def attach(world: Communicator, process_sets=None) -> None:
    """Start the job's registry (ringsync.init) with the static sets, in order."""
    global _registry
    _registry = Registry(world)
    if process_sets is None or process_sets == "dynamic":
        return
    if isinstance(process_sets, ProcessSet) or isinstance(process_sets, str):
        raise UsageError(f"ringsync.init: process_sets must be a list of ProcessSet or "
                         f"'dynamic', got {process_sets!r}")
    for i, ps in enumerate(process_sets):
        if not isinstance(ps, ProcessSet):
            raise UsageError(f"ringsync.init: process_sets entry number {i} is "
                             f"{type(ps).__name__}, not a ProcessSet")
        if ps is global_process_set:
            continue
        _registry.add(ps)


def detach(abort: bool = False) -> None:
    """Close every set (ringsync.shutdown, or elastic recovery replacing the job's ring)."""
    global _registry
    registry, _registry = _registry, None
    if registry is not None:
        registry.close(abort)


def _registry_or_raise(what: str) -> Registry:
    _world()  # NotInitializedError before init
    if _registry is None or _registry.world is not _current_world():
        raise UsageError(f"ringsync.{what}: the job's communicator has no process sets "
                         f"(it was not made by ringsync.init)")
    return _registry


def add_process_set(process_set: Union[ProcessSet, Sequence[int]]) -> ProcessSet:
    """Register a set at run time: every rank calls it, with the same sets in the same
    order. Returns the ProcessSet (made from the ranks when a list is given)."""
    ps = process_set if isinstance(process_set, ProcessSet) else ProcessSet(process_set)
    return _registry_or_raise("add_process_set").add(ps)


def remove_process_set(process_set: ProcessSet) -> bool:
    """Unregister a set and release its ring; False for the global set or one that is
    not registered."""
    return _registry_or_raise("remove_process_set").remove(process_set)


def communicator_of(ps: ProcessSet) -> Communicator:
    """The ring a collective on ps runs on, or a clear error."""
    if ps.process_set_id == 0:
        return _world()
    if ps.process_set_id is None:
        raise UsageError(f"ringsync: {ps} is not registered (add_process_set, or "
                         f"init(process_sets=[...])), or was removed")
    if ps._comm is None:
        raise UsageError(f"ringsync: rank {ps._world_rank} is not a member of the process "
                         f"set given: {ps}")
    return ps._comm


def by_id(process_set_id: int) -> Optional[ProcessSet]:
    """The registered set with this id (0: the global set), or None."""
    if process_set_id == 0:
        return global_process_set
    return _registry_or_raise("process set lookup").sets.get(process_set_id)
