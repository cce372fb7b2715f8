"""Communicator: the collectives of one ring, on numpy arrays (or anything with the buffer
protocol).

Every collective is a request to the engine (a background thread in the native core),
with two entry points, as mpi4py's Allreduce / Iallreduce: the plain calls return the
result (a single blocking tensor may take the same-host lane instead of the engine), the
`_async` calls return a Handle at once, which `synchronize(handle)` waits for. The GIL is
released while the core works (cffi releases it).

The pieces: NativeRing (_ring.py) builds the ring over a rendezvous and owns the native
objects; Submitter (_submit.py) hands requests to the engine and waits for them; this
class turns each collective's arguments into requests.
"""
import itertools
from typing import Optional

import numpy as np

from . import _observe
from ._allreduce import AllreduceCollectives
from ._arrays import describe
from ._grouped import GroupedCollectives
from ._native import ffi, lib
from ._p2p import PointToPoint
from ._requests import (Call, allgather_request, alltoall_request, broadcast_request,
                        even_split, reducescatter_request)
from ._ring import NativeRing
from ._submit import Handle, Submitter, make_request
from ._timeline import Timeline
from .config import Config
from .engine_settings import Settings
from .errors import UsageError
from .ops import ReduceOp, as_op
from .rendezvous import Rendezvous
from .rendezvous_mpi import as_rendezvous

assert [int(o) for o in ReduceOp] == [lib.RS_OP_SUM, lib.RS_OP_AVERAGE, lib.RS_OP_MIN,
                                      lib.RS_OP_MAX, lib.RS_OP_PRODUCT, lib.RS_OP_ADASUM], \
    "ReduceOp != ringsync.h"

__all__ = ["Communicator", "Handle", "as_op", "even_split"]

_REFUSABLE = {"allreduce": lib.RS_KIND_ALLREDUCE, "allgather": lib.RS_KIND_ALLGATHER,
              "broadcast": lib.RS_KIND_BROADCAST, "reducescatter": lib.RS_KIND_REDUCESCATTER,
              "alltoall": lib.RS_KIND_ALLTOALL}


class _Names:
    """Tensor names: the caller's, or generated in call order (the same on every rank as
    long as ranks make their unnamed calls in the same order, as Horovod's do)."""

    def __init__(self, rank: int):
        self._rank, self._auto = rank, itertools.count()

    def __call__(self, name: Optional[str], what: str) -> str:
        if name is None:
            return f"{what}.noname.{next(self._auto)}"
        name = str(name)
        if "\0" in name:  # C would see only the part before it: two names would meet
            raise UsageError(f"ringsync.{what}: tensor name {name!r} contains a NUL character "
                             f"(rank {self._rank})")
        return name


def _span(ranks) -> str:
    return f"0..{len(ranks) - 1}" if ranks == list(range(len(ranks))) else str(ranks)


def _topology(field: str):
    """A method returning this rank's place on its host (local_*) or among hosts (cross_*)."""
    def get(self) -> int:
        return getattr(self.topology, field)
    get.__name__ = field
    return get


class Communicator(AllreduceCollectives, GroupedCollectives, PointToPoint,
                   _observe.JobInsight):
    """A ring of ranks, with its engine, built over a rendezvous: an mpi4py
    intracommunicator (MPI.COMM_WORLD by default) or any ringsync.rendezvous.Rendezvous
    (ranks that are threads of one process, for tests). Several can exist in one process.

    A plain call's requests start without waiting to fuse with later ones, and are
    matched across ranks in call order (as MPI's blocking calls are)."""

    def __init__(self, mpi_comm=None, config: Optional[Config] = None, own_comm: bool = False,
                 rendezvous: Optional[Rendezvous] = None, world_ranks: Optional[list] = None):
        """mpi_comm: an mpi4py intracommunicator (or a Rendezvous in its place).
        own_comm: mpi_comm is ours alone: use it as it is instead of a duplicate, so that
        revoking it also interrupts this constructor's own MPI calls. rendezvous: build
        over this instead of MPI; the Communicator closes it when it shuts down.
        world_ranks: how the job numbers this ring's ranks (a process set's ring): broadcast
        roots and join's result use that numbering, as in Horovod (default: this ring's)."""
        rendezvous = as_rendezvous(mpi_comm, own_comm, rendezvous)
        try:
            self._ring = NativeRing(rendezvous, config)
        except BaseException:
            rendezvous.close()
            raise
        self._rank, self._size = self._ring.rank, self._ring.size
        self.config, self.topology = self._ring.config, self._ring.topology
        self.host_names = self._ring.host_names
        self._submitter = Submitter(self._ring)
        self._submitter.on_failure = self._leave_flight_records
        self._name = _Names(self._rank)
        self.world_ranks = list(world_ranks or range(self._size))
        self._ring_rank = {world: mine for mine, world in enumerate(self.world_ranks)}
        self._timeline = Timeline(self, self._ring)
        if self.config.timeline:
            self.start_timeline(self.config.timeline)
        self._overlaps = self.config.overlap_choice()
        self._tunes = itertools.count()

    # ---- settings ----

    def engine_settings(self) -> Settings:
        """The fusion threshold, cycle time and allreduce crossovers the engine runs with
        now (the configured ones until tune() or autotune changed them)."""
        values = np.zeros(lib.RS_TUNE_COUNT, np.int64)
        lib.rs_engine_settings(self._ring.engine, ffi.cast("int64_t *", values.ctypes.data))
        return Settings.from_native(values, self._overlaps)

    def tune(self, settings: Settings) -> None:
        """Have every rank's engine run with these settings from the same point on (a
        collective: every rank calls it, with the same settings, or every rank gets a
        MismatchError naming both)."""
        self._submitter.run_tune(self, f"ringsync.tune.{next(self._tunes)}", settings.native())
        # (after the tune request, which every rank passed: the same step everywhere)
        self._overlaps = None if settings.overlap is None else bool(settings.overlap)

    @property
    def overlaps(self) -> Optional[bool]:
        """Whether an adapter should reduce gradients during backward, as every rank agreed:
        RINGSYNC_OVERLAP=on/off, or what tune() (autotune) set; None for auto, where the
        adapter applies its own rule (torch: ringsync.torch.optimizer.overlaps)."""
        return self._overlaps

    # ---- lifetime and state ----

    def shutdown(self):
        """Stop the engine and close the ring. Waits (bounded by the timeout) until every
        healthy rank gets here, so that no rank's exit looks like a failure to a peer."""
        if self.closed:
            return
        self._timeline.stop()  # (collective, as shutdown itself)
        self._ring.shutdown()
        self._submitter.orphans.clear()  # the engine's thread is joined: nothing in use
        self._ring.rendezvous.close()

    def abort(self, reason: str = "aborted"):
        """Fail every pending collective here and on every peer and close the ring at once;
        the rendezvous stays open for elastic recovery (rendezvous.FaultTolerance)."""
        self._leave_flight_records_once(f"aborted: {reason}")
        self._ring.abort(reason)
        self._submitter.orphans.clear()
        self._timeline.stop(gather=False)

    @property
    def transport(self) -> str:
        """"shm" when same-host peers are reached through shared memory, else "tcp"."""
        return self._ring.transport

    @property
    def uses_lane(self) -> bool:
        """Whether blocking calls may take the same-host lane (every rank on this host)."""
        return self._ring.lane

    @property
    def mpi_comm(self):
        """The MPI communicator this ring was bootstrapped over (ringsync's own copy), or
        None for a rendezvous without MPI."""
        return self._ring.rendezvous.mpi_comm

    @property
    def rendezvous(self) -> Rendezvous:
        """Where this ring's ranks met (and, for elastic recovery, agree on survivors)."""
        return self._ring.rendezvous

    closed = property(lambda self: self._ring.closed)

    @property
    def broken(self) -> bool:
        """True once the ring has failed (a lost peer, a timeout, an abort)."""
        return self._ring.broken

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._size

    def world_rank(self) -> int:
        """This rank as the job numbers it (rank() for the job's own ring)."""
        return self.world_ranks[self._rank]

    local_rank = _topology("local_rank")
    local_size = _topology("local_size")
    cross_rank = _topology("cross_rank")
    cross_size = _topology("cross_size")

    # ---- handles ----

    def _start(self, call: Call) -> Handle:
        return self._submitter.start(self, call.requests, call.finish, call.what, call.takes)

    def _start_batch(self, arrays, names, op, prescale, postscale, what):
        """A handle for asynchronous in-place allreduces of arrays submitted in one native
        call, or None where the ordinary path must take them (Submitter.start_batch)."""
        return self._submitter.start_batch(self, arrays, names, op, prescale, postscale, what)

    def _run(self, call: Call):
        return self._submitter.run(self, call.requests, call.finish, call.what, call.takes)

    def poll(self, handle: Handle) -> bool:
        """True once every tensor of the handle has completed (then synchronize won't block)."""
        return self._submitter.poll(handle)

    def synchronize(self, handle: Handle):
        """Wait for the handle and return its result; raises the error it failed with."""
        if handle._done:
            return handle._result
        if handle._comm is not self or self.closed:
            raise UsageError(f"ringsync.synchronize: handle {handle!r} does not belong to the "
                             "current (open) communicator")
        return self._submitter.synchronize(handle)

    # ---- refusals ----

    def _checked(self, names, kind: int, blocking: bool, build):
        """build(): a call's own checks and requests. A check that fails here must fail the
        peers' matching call too (see Submitter.refuse): names must be the call's final
        names, made before any check, so that unnamed calls keep their numbers alike on
        every rank."""
        try:
            return build()
        except (TypeError, ValueError) as exc:  # (UsageError is a ValueError)
            self._submitter.refuse(names, kind, exc, blocking)
            raise

    def refuse_call(self, collective: str, name, error: Exception, count=None, blocking=True):
        """An adapter's own check of a blocking call failed here with `error` before the
        call reached this communicator: name it as this communicator would have (so that
        unnamed calls keep their numbers alike on every rank) and refuse it, so that the
        peers' same call fails too instead of waiting (see Submitter.refuse). collective:
        "allreduce", "grouped_allgather", ...; count: a group's number of tensors;
        blocking: the peers make it blocking (matched in call order), not by name."""
        kind = _REFUSABLE[collective.replace("grouped_", "")]
        try:
            first = self._name(name, collective)
        except UsageError:
            return  # (a name no rank can use: every rank refuses it alike)
        names = [first] if count is None else [f"{first}.{i}" for i in range(count)]
        self._submitter.refuse(names, kind, error, blocking=blocking)

    # ---- allgather ----

    def _allgather_call(self, x, name, blocking) -> Call:
        name = self._name(name, "allgather")
        request, finish = self._checked([name], lib.RS_KIND_ALLGATHER, blocking, lambda: (
            allgather_request(x, name, "allgather", blocking)))
        return Call([request], lambda results: finish(results[0]), "allgather", takes=True)

    def allgather(self, x, name=None):
        """Every rank's x concatenated along the first dimension (which may differ by rank;
        a 0-d array counts as one row)."""
        return self._run(self._allgather_call(x, name, True))

    def allgather_async(self, x, name=None) -> Handle:
        """Start an allgather (see allgather)."""
        return self._start(self._allgather_call(x, name, False))

    # ---- broadcast ----

    def _broadcast_call(self, x, root_rank, name, what, blocking) -> Call:
        name = self._name(name, "broadcast")
        request = self._checked([name], lib.RS_KIND_BROADCAST, blocking, lambda: (
            broadcast_request(x, self._root(root_rank, name, what), name, what, blocking)))
        return Call([request], lambda: request.out, what)

    def _root(self, root_rank, name, what) -> int:
        """root_rank (the job's numbering, as Horovod's) as a rank of this ring."""
        root = self._ring_rank.get(root_rank) if isinstance(root_rank, (int, np.integer)) else None
        if root is None:
            raise UsageError(f"ringsync.{what}: root_rank {root_rank!r}{describe(name)} is out "
                             f"of range: not one of this ring's ranks {_span(self.world_ranks)} "
                             f"(rank {self.world_rank()})")
        return root

    def broadcast(self, x, root_rank, name=None):
        """A new array holding root_rank's x on every rank."""
        return self._run(self._broadcast_call(x, root_rank, name, "broadcast", True))

    def broadcast_(self, x, root_rank, name=None):
        """Overwrite x on every rank with root_rank's x, in place; returns x's array."""
        return self._run(self._broadcast_call(x, root_rank, name, "broadcast_", True))

    def broadcast_async(self, x, root_rank, name=None) -> Handle:
        return self._start(self._broadcast_call(x, root_rank, name, "broadcast", False))

    def broadcast_async_(self, x, root_rank, name=None) -> Handle:
        return self._start(self._broadcast_call(x, root_rank, name, "broadcast_", False))

    # ---- reducescatter ----

    def _reducescatter_call(self, x, op, prescale, postscale, name, blocking,
                            what="reducescatter") -> Call:
        name = self._name(name, "reducescatter")
        request, out = self._checked([name], lib.RS_KIND_REDUCESCATTER, blocking, lambda: (
            reducescatter_request(x, as_op(op, what), prescale, postscale, name, what,
                                  blocking, self._rank, self._size)))
        return Call([request], lambda: out, what)

    def reducescatter(self, x, op=ReduceOp.AVERAGE, prescale_factor=1.0, postscale_factor=1.0,
                      name=None):
        """Reduce x over all ranks; rank r gets the r-th slice of the first dimension
        (split as evenly as possible, the first ranks taking one more row)."""
        return self._run(self._reducescatter_call(x, op, prescale_factor, postscale_factor,
                                                  name, True))

    def reducescatter_async(self, x, op=ReduceOp.AVERAGE, prescale_factor=1.0,
                            postscale_factor=1.0, name=None) -> Handle:
        return self._start(self._reducescatter_call(x, op, prescale_factor, postscale_factor,
                                                    name, False))

    def reducescatter_(self, x, op=ReduceOp.AVERAGE, prescale_factor=1.0, postscale_factor=1.0,
                       name=None):
        """reducescatter in place: x (contiguous, writable) is the work space and is
        overwritten; returns this rank's share, a view of x's first rows. For a large
        buffer the caller drops anyway (a ZeRO gradient bucket): no second copy of it."""
        return self._run(self._reducescatter_call(x, op, prescale_factor, postscale_factor,
                                                  name, True, "reducescatter_"))

    def reducescatter_async_(self, x, op=ReduceOp.AVERAGE, prescale_factor=1.0,
                             postscale_factor=1.0, name=None) -> Handle:
        return self._start(self._reducescatter_call(x, op, prescale_factor, postscale_factor,
                                                    name, False, "reducescatter_"))

    # ---- alltoall ----

    def _alltoall_call(self, x, splits, name, blocking) -> Call:
        name = self._name(name, "alltoall")
        request, finish = self._checked([name], lib.RS_KIND_ALLTOALL, blocking, lambda: (
            alltoall_request(x, splits, name, blocking, self._rank, self._size)))
        return Call([request], lambda results: finish(results[0]), "alltoall", takes=True)

    def alltoall(self, x, splits=None, name=None):
        """Send splits[i] rows of x (in rank order) to rank i; returns the rows received,
        in rank order, and — when splits was given, as in Horovod — the number of rows
        received from each rank."""
        return self._run(self._alltoall_call(x, splits, name, True))

    def alltoall_async(self, x, splits=None, name=None) -> Handle:
        return self._start(self._alltoall_call(x, splits, name, False))

    # ---- barrier and timeline ----

    def barrier(self):
        """Returns once every rank has called barrier()."""
        request = make_request("barrier", lib.RS_KIND_BARRIER, self._name(None, "barrier"),
                                np.empty(0, np.uint8), None, blocking=True)
        self._run(Call([request], lambda: None, "barrier"))

    def join(self) -> int:
        """This rank has no more data. Until every rank has joined, it takes part in the
        other ranks' allreduces with zeros (Average still divides by size()); other
        collectives fail while a rank has joined. Returns the last rank to join."""
        request = make_request("join", lib.RS_KIND_JOIN, "ringsync.join",
                                np.empty(0, np.uint8), None, blocking=True)
        return self._run(Call([request], lambda results: self.world_ranks[results[0][1]],
                               "join", takes=True))

    def start_timeline(self, path: str, mark_cycles: bool = False):
        """Record a Chrome-trace timeline (open it in Perfetto) of every tensor's phases on
        every rank, written to ``path`` as one file by rank 0 at stop_timeline() or
        shutdown() (see ringsync/_timeline.py). mark_cycles (or
        RINGSYNC_TIMELINE_MARK_CYCLES=1): mark the start of each negotiation round."""
        self._timeline.start(path, mark_cycles or bool(self.config.timeline_mark_cycles))

    def stop_timeline(self):
        """Collective: every rank stops, and rank 0 writes the file."""
        self._timeline.stop()


def bind_xla_slot(comm: Communicator, slot: int) -> None:
    """Run the XLA custom calls of slot `slot` (ringsync/jax/_xla.py) on comm's engine,
    until it is destroyed (the core then empties the slot)."""
    if comm.closed:
        raise UsageError("ringsync: bind_xla_slot of a closed communicator")
    if lib.rs_xla_bind(slot, comm._ring.engine, comm._ring.c, comm.rank()) != lib.RS_OK:
        raise UsageError(f"ringsync: no XLA slot {slot}")
