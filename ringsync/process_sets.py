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

from . import _context
from ._core import Communicator
from .errors import CommunicationError, UsageError


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

    def communicator(self) -> Communicator:
        """The ring this rank runs the set's collectives on, or a clear error (not
        registered, or this rank is not a member)."""
        if self.process_set_id is None:
            raise UsageError(f"ringsync: {self} is not registered (add_process_set, or "
                             f"init(process_sets=[...])), or was removed")
        if self._comm is None:
            raise UsageError(f"ringsync: rank {self._world_rank} is not a member of the "
                             f"process set given: {self}")
        return self._comm

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

    def communicator(self) -> Communicator:
        return _world()

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
    """The process sets of one job (one default communicator), by id.

    Every change is collective over the job, and agreed before anything is built: each
    rank posts what it was asked (the set's ranks, or its membership of the set's MPI
    communicator) with its own objection, if any, in one exchange over the job's
    rendezvous (bounded by the start timeout after init, see MpiRendezvous); then every
    rank accepts the change, or every rank raises the same UsageError. A change refused
    on one rank only must not leave another rank in MPI_Comm_split for good (issue 26)."""

    world: Communicator
    sets: Dict[int, ProcessSet] = dataclasses.field(default_factory=dict)
    # Other ProcessSet objects of the same ranks (init(process_sets=...) called again).
    aliases: Dict[int, List[ProcessSet]] = dataclasses.field(default_factory=dict)
    next_id: int = 1

    def add(self, ps: ProcessSet) -> ProcessSet:
        """Collective over the job: every rank adds the same sets in the same order."""
        proposals = self.world.rendezvous.allgather(self._proposal(ps))
        ranks = self._agreed_ranks(proposals)
        ps.ranks = ranks
        ps._comm = self._build_ring(ranks)
        ps._size, ps._world_rank = len(ranks), self.world.rank()
        ps.process_set_id = self.next_id
        self.sets[self.next_id] = ps
        self.next_id += 1
        return ps

    def _proposal(self, ps: ProcessSet):
        """(this rank's objection or None, the ranks it was given or None for a set of an
        MPI communicator, whether it is in that communicator)."""
        if ps.process_set_id is not None:
            return f"{ps} is registered already", ps.ranks, False
        if ps.ranks is None:
            return None, None, _is_member_of(ps.mpi_comm)
        return self._ranks_problem(ps.ranks), list(ps.ranks), False

    def _agreed_ranks(self, proposals) -> List[int]:
        """The set's ranks, the same on every rank, or the same UsageError on every rank."""
        refused = [f"rank {r}: {text}" for r, (text, _, _) in enumerate(proposals) if text]
        if refused:
            raise UsageError(f"ringsync.add_process_set: refused on rank(s) "
                             f"{[r for r, (text, _, _) in enumerate(proposals) if text]}: "
                             + "; ".join(refused))
        given = [ranks for _, ranks, _ in proposals]
        if all(ranks is None for ranks in given):  # sets of an MPI communicator
            ranks = [r for r, (_, _, member) in enumerate(proposals) if member]
            problem = self._ranks_problem(ranks)
            if problem:
                raise UsageError(f"ringsync.add_process_set: {problem} (the ranks where its "
                                 f"MPI communicator is not MPI.COMM_NULL)")
            return ranks
        for r, ranks in enumerate(given):
            if ranks != given[0]:
                raise UsageError(f"ringsync.add_process_set: every rank must add the same set: "
                                 f"rank 0 gave {_described(given[0])}, rank {r} gave "
                                 f"{_described(ranks)}")
        return given[0]

    def _ranks_problem(self, ranks: List[int]) -> Optional[str]:
        size = self.world.size()
        bad = [r for r in ranks if not 0 <= r < size]
        if bad or not ranks or len(set(ranks)) != len(ranks):
            return (f"ranks {ranks} must be distinct ranks of the job (0..{size - 1}), at "
                    f"least one")
        for other in self.sets.values():
            if other.ranks == ranks:
                # Horovod's rule and words: a set of the same ranks is refused.
                return f"attempted to add a duplicate process set: ranks {ranks} are {other}"
        return None

    def _build_ring(self, ranks: List[int]) -> Optional[Communicator]:
        """The set's ring on its members (None elsewhere). Its members build it together
        and fail together; one more exchange tells the other ranks, so that a set is
        registered on every rank or on none."""
        ring, failure = None, None
        rendezvous = self.world.rendezvous.split(ranks)
        if rendezvous is not None:
            config = dataclasses.replace(self.world.config, timeline="")  # one per job
            try:
                ring = Communicator(rendezvous=rendezvous, config=config, world_ranks=ranks)
            except Exception as e:  # (told to the others, then raised here)
                failure = e
        outcomes = self.world.rendezvous.allgather(
            None if failure is None else (isinstance(failure, UsageError), str(failure)))
        failed = [(r, o) for r, o in enumerate(outcomes) if o]
        if not failed:
            return ring
        if ring is not None:
            ring.abort(f"building process set {ranks} failed on another rank")
        if failure is not None:
            raise failure
        r, (usage, text) = failed[0]
        kind = UsageError if usage else CommunicationError
        raise kind(f"ringsync.add_process_set: building the ring of process set {ranks} "
                   f"failed on rank {r}: {text}")

    def remove(self, ps: ProcessSet) -> bool:
        """Shut the set's ring down (a collective of its members) and forget it; False
        for the global set or a set that is not registered."""
        registered = self._registered_id(ps)
        if registered is None:
            return False
        comm = self._forget(registered, self.sets.pop(registered))
        if comm is not None:
            comm.shutdown()
        return True

    def _registered_id(self, ps: ProcessSet) -> Optional[int]:
        set_id = ps.process_set_id
        if not set_id or set_id not in self.sets:  # (0: the global set stays, as in Horovod)
            return None
        if ps is not self.sets[set_id] and ps not in self.aliases.get(set_id, []):
            return None
        return set_id

    def _forget(self, set_id: int, ps: ProcessSet) -> Optional[Communicator]:
        """Unregister ps and its aliases; returns the ring to close, if this rank has one."""
        for each in [ps] + self.aliases.pop(set_id, []):
            each.process_set_id = None
            comm, each._comm = each._comm, None
        return comm

    def attach_alias(self, ps: ProcessSet, registered: ProcessSet) -> None:
        """ps (another object of the same ranks) shares registered's id and ring."""
        if ps is registered:
            return
        ps.process_set_id, ps.ranks = registered.process_set_id, list(registered.ranks)
        ps._comm, ps._size = registered._comm, registered._size
        ps._world_rank = registered._world_rank
        self.aliases.setdefault(registered.process_set_id, []).append(ps)

    def matching(self, ps: ProcessSet) -> Optional[ProcessSet]:
        """The registered set of ps's ranks (of ps's MPI communicator), or None."""
        for registered in self.sets.values():
            if ps.ranks is not None and registered.ranks == ps.ranks:
                return registered
            if ps.ranks is None and registered.mpi_comm is ps.mpi_comm is not None:
                return registered
        return None

    def close(self, abort: bool = False) -> None:
        """Every set's ring, in id order (the same on every rank: no shutdown waits on a
        set whose members are still shutting down another)."""
        for set_id in sorted(self.sets):
            comm = self._forget(set_id, self.sets.pop(set_id))
            if comm is not None:
                comm.abort("the job's communicator was replaced") if abort else comm.shutdown()


def _is_member_of(mpi_comm) -> bool:
    from mpi4py import MPI
    return mpi_comm is not None and mpi_comm != MPI.COMM_NULL


def _described(ranks) -> str:
    return "a set of an MPI communicator" if ranks is None else f"ranks {ranks}"


def _current_world() -> Optional[Communicator]:
    return _context.default()


def _world() -> Communicator:
    return _context.resolve()


def start_registry(world: Communicator) -> None:
    """A registry with no sets yet, for the job's new ring (elastic recovery's too)."""
    _context.JOB.registry = Registry(world)


def attach(world: Communicator, process_sets=None) -> None:
    """ringsync.init: start the job's registry with the static sets, in order. Where sets
    are given, one exchange first, so that a bad argument on one rank fails init on every
    rank. (None where none are given: a replacement rank's init() must make the same
    exchanges as the survivors' recovery, which registers no sets.)"""
    start_registry(world)
    if process_sets is None or _is_dynamic(process_sets):
        return
    problem = _static_sets_problem(process_sets)
    sets = [] if problem else _static_sets(process_sets)
    posts = world.rendezvous.allgather((problem, len(sets)))
    _raise_unless_same_sets(posts)
    for i, ps in enumerate(sets):
        try:
            _context.JOB.registry.add(ps)
        except UsageError as e:
            raise UsageError(f"ringsync.init: process_sets entry number {i}: {e}") from None


def attach_registered(process_sets) -> None:
    """init() called again while initialised, as Horovod's: the sets given are checked
    and each takes the id and ring of the registered set of the same ranks (a set made
    from an MPI communicator: of that communicator). Nothing is built, so nothing is
    collective; a set that is not registered, or given twice, is a UsageError."""
    problem = _static_sets_problem(process_sets)
    if problem:
        raise UsageError(f"ringsync.init: {problem}")
    registry = _registry_or_raise("init")
    attached = set()
    for i, ps in enumerate(_static_sets(process_sets)):
        registered = registry.matching(ps)
        if registered is None:
            raise UsageError(f"ringsync.init: process_sets entry number {i}, {ps}, is not a "
                             f"registered set; ringsync is initialized already: add it with "
                             f"add_process_set")
        if registered.process_set_id in attached:
            raise UsageError(f"ringsync.init: process_sets entry number {i} is a duplicate: "
                             f"{ps}")
        attached.add(registered.process_set_id)
        registry.attach_alias(ps, registered)


def _static_sets_problem(process_sets) -> Optional[str]:
    """What is wrong with init's process_sets argument, in words, or None."""
    if process_sets is None or _is_dynamic(process_sets):
        return None
    if isinstance(process_sets, (ProcessSet, str)) or not hasattr(process_sets, "__iter__"):
        return f"process_sets must be a list of ProcessSet or 'dynamic', got {process_sets!r}"
    for i, ps in enumerate(process_sets):
        if not isinstance(ps, ProcessSet):
            return f"process_sets entry number {i} is {type(ps).__name__}, not a ProcessSet"
    return None


def _is_dynamic(process_sets) -> bool:
    return isinstance(process_sets, str) and process_sets.lower() == "dynamic"


def _static_sets(process_sets) -> List[ProcessSet]:
    """The sets to register (the global set is always there), in order."""
    if process_sets is None or _is_dynamic(process_sets):
        return []
    return [ps for ps in process_sets if ps is not global_process_set]


def _raise_unless_same_sets(posts) -> None:
    """posts: every rank's (problem with its argument, number of sets)."""
    refused = [f"rank {r}: {problem}" for r, (problem, _) in enumerate(posts) if problem]
    if refused:
        raise UsageError("ringsync.init: " + "; ".join(refused))
    differ = [r for r, (_, count) in enumerate(posts) if count != posts[0][1]]
    if differ:
        r = differ[0]
        raise UsageError(f"ringsync.init: every rank must give the same process sets: rank 0 "
                         f"gave {posts[0][1]} set(s), rank {r} gave {posts[r][1]}")


def detach(abort: bool = False) -> None:
    """Close every set (ringsync.shutdown, or elastic recovery replacing the job's ring)."""
    registry, _context.JOB.registry = _context.JOB.registry, None
    if registry is not None:
        registry.close(abort)


def _registry_or_raise(what: str) -> Registry:
    _world()  # NotInitializedError before init
    registry = _context.JOB.registry
    if registry is None or registry.world is not _current_world():
        raise UsageError(f"ringsync.{what}: the job's communicator has no process sets "
                         f"(it was not made by ringsync.init)")
    return registry


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
    """The ring a collective on ps runs on, or a clear error (ps.communicator())."""
    return ps.communicator()


def by_id(process_set_id: int) -> Optional[ProcessSet]:
    """The registered set with this id (0: the global set), or None."""
    if process_set_id == 0:
        return global_process_set
    return _registry_or_raise("process set lookup").sets.get(process_set_id)
