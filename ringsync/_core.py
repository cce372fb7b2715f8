"""Communicator: the collectives of one ring, on numpy arrays (or anything with the buffer
protocol).

Every collective is a request to the engine (a background thread in the native core):
the `_async` calls return a Handle at once, `synchronize(handle)` waits for it, and the
plain calls do both. The GIL is released while the core works (cffi releases it).

The pieces: NativeRing (_ring.py) builds the ring over a rendezvous and owns the native
objects; Submitter (_submit.py) hands requests to the engine and waits for them; this
class turns each collective's arguments into requests.
"""
import itertools
from typing import Optional, Sequence

import numpy as np

from ._arrays import as_input, as_output, describe, wrap_native_result
from ._native import ffi, lib
from ._ring import NativeRing
from ._grouped import GroupedCollectives
from ._submit import Handle, PreparedAllreduce, Submitter, make_request
from ._timeline import Timeline
from .autotune import Autotuner, Settings
from .config import Config
from .errors import UsageError
from .ops import ReduceOp, as_op
from .rendezvous import Rendezvous
from .rendezvous_mpi import as_rendezvous

assert [int(o) for o in ReduceOp] == [lib.RS_OP_SUM, lib.RS_OP_AVERAGE, lib.RS_OP_MIN,
                                      lib.RS_OP_MAX, lib.RS_OP_PRODUCT, lib.RS_OP_ADASUM], \
    "ReduceOp != ringsync.h"

__all__ = ["Communicator", "Handle", "as_op", "even_split"]

_IN_PLACE = object()  # _allreduce's `out` for an in-place call
_REFUSABLE = {"allreduce": lib.RS_KIND_ALLREDUCE, "allgather": lib.RS_KIND_ALLGATHER,
              "broadcast": lib.RS_KIND_BROADCAST, "reducescatter": lib.RS_KIND_REDUCESCATTER,
              "alltoall": lib.RS_KIND_ALLTOALL}


def even_split(n: int, parts: int) -> Sequence[int]:
    """n split into `parts` nearly equal parts, the first n % parts one larger."""
    return [n // parts + (i < n % parts) for i in range(parts)]


def prepare_allreduce_(comm: "Communicator", name: str, like: np.ndarray, op=ReduceOp.AVERAGE,
                       prescale_factor=1.0, postscale_factor=1.0) -> PreparedAllreduce:
    """Everything about an in-place allreduce on comm but the memory: prepared.start(address,
    keep) then submits it without building a request again (a DistributedOptimizer submits
    every gradient of every step this way). like: an array with the tensor's dtype and
    shape."""
    request = make_request("allreduce_", lib.RS_KIND_ALLREDUCE, str(name), like, like,
                           op=as_op(op, "allreduce_"), prescale=prescale_factor,
                           postscale=postscale_factor, reduces=True)
    return PreparedAllreduce(comm, request)


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


class Communicator(GroupedCollectives):
    """A ring of ranks, with its engine, built over a rendezvous: an mpi4py
    intracommunicator (MPI.COMM_WORLD by default) or any ringsync.rendezvous.Rendezvous
    (ranks that are threads of one process, for tests). Several can exist in one process.

    The `_async` methods' private `_blocking=True` says that the caller waits for the
    result at once (the plain calls): the request then starts without waiting to fuse
    with later ones, and a single tensor may take the same-host lane."""

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
        self._name = _Names(self._rank)
        self.world_ranks = list(world_ranks or range(self._size))
        self._ring_rank = {world: mine for mine, world in enumerate(self.world_ranks)}
        self._timeline = Timeline(self)
        if self.config.timeline:
            self.start_timeline(self.config.timeline)
        self._overlaps = self._ring.overlaps()
        self._tunes = itertools.count()
        self.overlap_matters = False  # set by an adapter's autotune_step (see autotune.py)
        self._autotuner = None
        if self.config.autotune:
            self.start_autotune()

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
        self.synchronize(self._submitter.submit_tune(
            self, f"ringsync.tune.{next(self._tunes)}", settings.native()))
        # (after the tune request, which every rank passed: the same step everywhere)
        self._overlaps = bool(settings.overlap)

    def autotune_step(self, overlap_matters: bool = False) -> None:
        """Called by the framework adapters once per training step (every rank alike):
        drives autotune where RINGSYNC_AUTOTUNE=1 (or after start_autotune()), else does
        nothing. overlap_matters: the caller reduces during backward where `overlaps`."""
        if self._autotuner is not None:
            self.overlap_matters = self.overlap_matters or overlap_matters
            self._autotuner.step()

    def start_autotune(self, warmup_samples: Optional[int] = None,
                       steps_per_sample: Optional[int] = None, max_samples: Optional[int] = None,
                       log_path: Optional[str] = None) -> Autotuner:
        """Start tuning from the next autotune_step() on, as RINGSYNC_AUTOTUNE=1 does from
        init() (unset arguments: the RINGSYNC_AUTOTUNE_* settings). Every rank calls it at
        the same step."""
        c = self.config
        self._autotuner = Autotuner(
            self, c.autotune_warmup_samples if warmup_samples is None else warmup_samples,
            steps_per_sample or c.autotune_steps_per_sample,
            max_samples or c.autotune_max_samples, log_path or c.autotune_log)
        return self._autotuner

    @property
    def overlaps(self) -> bool:
        """Whether DistributedOptimizer reduces gradients during backward (RINGSYNC_OVERLAP;
        the same on every rank)."""
        return self._overlaps

    @property
    def autotuner(self) -> Optional[Autotuner]:
        return self._autotuner

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
        self._ring.abort(reason)
        self._submitter.orphans.clear()
        self._timeline.stop(gather=False)

    @property
    def transport(self) -> str:
        """"shm" when same-host peers are reached through shared memory, else "tcp"."""
        return self._ring.transport

    def traffic(self) -> dict:
        """A debug counter: the bytes this rank has sent to each rank during collectives,
        by transport — {"tcp": [to rank 0, 1, ...], "shm": [...]} (shared-memory rings with
        same-host peers). Setup and wake-ups are not counted, nor the same-host lane and
        staged allreduce, which work in shared areas (only with every rank on one host)."""
        return self._ring.traffic()

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

    def _submit(self, requests, finish, what) -> Handle:
        return self._submitter.submit(self, requests, finish, what)

    def _submit_taking(self, requests, finish, what) -> Handle:
        """Requests whose results the native core holds ((data, rows, splits) each):
        synchronize returns finish(their results, in order)."""
        handle = None
        handle = self._submit(requests, lambda: finish(
            [self._submitter.take_result(i) for i in handle._ids]), what)
        return handle

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

    # ---- allreduce ----

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

    def refuse_call(self, collective: str, name, error: Exception, count=None) -> None:
        """An adapter's own check of a blocking call failed here with `error` before the
        call reached this communicator: name it as this communicator would have (so that
        unnamed calls keep their numbers alike on every rank) and refuse it, so that the
        peers' same call fails too instead of waiting (see Submitter.refuse). collective:
        "allreduce", "grouped_allgather", ...; count: a group's number of tensors."""
        kind = _REFUSABLE[collective.replace("grouped_", "")]
        try:
            first = self._name(name, collective)
        except UsageError:
            return  # (a name no rank can use: every rank refuses it alike)
        names = [first] if count is None else [f"{first}.{i}" for i in range(count)]
        self._submitter.refuse(names, kind, error, blocking=True)

    def _allreduce(self, x, out, op, prescale, postscale, name, what, blocking):
        """A Handle; or, for a blocking call the same-host lane ran, the result itself.
        out: None (a new array), _IN_PLACE (x itself) or the caller's output array."""
        name = self._name(name, "allreduce")
        try:  # (inline, not _checked: this is every allreduce's path)
            if out is _IN_PLACE:
                src = out = as_output(x, what, name)
            else:
                src = as_input(x, what, name)
                out = np.empty_like(src) if out is None else self._output_like(src, out, name)
            code, prescale, postscale = as_op(op, what), float(prescale), float(postscale)
        except (TypeError, ValueError) as exc:
            self._submitter.refuse([name], lib.RS_KIND_ALLREDUCE, exc, blocking)
            raise
        return self._submitter.submit_allreduce(self, src, out, name, code, prescale, postscale,
                                                what, blocking)

    @staticmethod
    def _output_like(src, out, name):
        out = as_output(out, "allreduce", name)
        if out.dtype != src.dtype or out.shape != src.shape:
            raise UsageError(f"ringsync.allreduce{describe(name)}: out is {out.dtype} "
                             f"{out.shape}, the input {src.dtype} {src.shape}")
        return out

    def allreduce_async(self, x, op=ReduceOp.AVERAGE, prescale_factor=1.0, postscale_factor=1.0,
                        name=None, _blocking=False) -> Handle:
        """Start reducing x over all ranks into a new array; synchronize returns it."""
        return self._as_handle(self._allreduce(
            x, None, op, prescale_factor, postscale_factor, name, "allreduce", _blocking),
            "allreduce", name)

    def allreduce_async_(self, x, op=ReduceOp.AVERAGE, prescale_factor=1.0, postscale_factor=1.0,
                         name=None, _blocking=False) -> Handle:
        """Start reducing x in place; synchronize returns x's array."""
        return self._as_handle(self._allreduce(
            x, _IN_PLACE, op, prescale_factor, postscale_factor, name, "allreduce_", _blocking),
            "allreduce_", name)

    def _as_handle(self, result, what, name) -> Handle:
        """A handle for what _allreduce returned (a result the lane computed: done)."""
        if type(result) is Handle:
            return result
        return Handle(self, [], None, lambda: result, what, [name])

    def allreduce(self, x, op=ReduceOp.AVERAGE, prescale_factor=1.0, postscale_factor=1.0,
                  name=None):
        return self._wait_unless_done(self._allreduce(
            x, None, op, prescale_factor, postscale_factor, name, "allreduce", True))

    def allreduce_(self, x, op=ReduceOp.AVERAGE, prescale_factor=1.0, postscale_factor=1.0,
                   name=None):
        return self._wait_unless_done(self._allreduce(
            x, _IN_PLACE, op, prescale_factor, postscale_factor, name, "allreduce_", True))

    def allreduce_into(self, x, out, op=ReduceOp.AVERAGE, prescale_factor=1.0,
                       postscale_factor=1.0, name=None):
        """allreduce() into memory the caller gives (out: a writable C-contiguous array of
        x's dtype and shape, not overlapping x); returns out. For adapters that hand the
        result to a framework which adopts only memory it likes (aligned, say)."""
        if out is None or out is _IN_PLACE:
            raise UsageError("ringsync.allreduce_into: out must be an array")
        return self._wait_unless_done(self._allreduce(
            x, out, op, prescale_factor, postscale_factor, name, "allreduce", True))

    def _wait_unless_done(self, result):
        return self.synchronize(result) if type(result) is Handle else result

    # ---- allgather ----

    def allgather_async(self, x, name=None, _blocking=False) -> Handle:
        """Start concatenating every rank's x along the first dimension (which may differ
        by rank; a 0-d array counts as one row)."""
        name = self._name(name, "allgather")
        request, finish = self._checked([name], lib.RS_KIND_ALLGATHER, _blocking,
                                        lambda: self._allgather_request(x, name, "allgather",
                                                                        _blocking))
        return self._submit_taking([request], lambda results: finish(results[0]), "allgather")

    def _allgather_request(self, x, name, what, blocking):
        """The request, and how to turn its result (data, rows, splits) into an array."""
        src = as_input(x, what, name)
        src = src.reshape(1) if src.ndim == 0 else src
        request = make_request(what, lib.RS_KIND_ALLGATHER, name, src, None, blocking=blocking)
        return request, lambda result: wrap_native_result(result[0], result[1], src.shape[1:],
                                                          src.dtype)

    def allgather(self, x, name=None):
        return self.synchronize(self.allgather_async(x, name, _blocking=True))

    # ---- broadcast ----

    def broadcast_async(self, x, root_rank, name=None, _blocking=False) -> Handle:
        return self._broadcast(x, root_rank, name, "broadcast", _blocking)

    def broadcast_async_(self, x, root_rank, name=None, _blocking=False) -> Handle:
        return self._broadcast(x, root_rank, name, "broadcast_", _blocking)

    def _broadcast(self, x, root_rank, name, what, blocking):
        name = self._name(name, "broadcast")
        request = self._checked([name], lib.RS_KIND_BROADCAST, blocking, lambda: (
            self._broadcast_request(x, root_rank, name, what, blocking)))
        return self._submit([request], lambda: request.out, what)

    def _broadcast_request(self, x, root_rank, name, what, blocking):
        root = self._ring_rank.get(root_rank) if isinstance(root_rank, (int, np.integer)) else None
        if root is None:
            raise UsageError(f"ringsync.{what}: root_rank {root_rank!r}{describe(name)} is out "
                             f"of range: not one of this ring's ranks {_span(self.world_ranks)} "
                             f"(rank {self.world_rank()})")
        out = (as_output(x, what, name) if what == "broadcast_"
               else np.array(as_input(x, what, name), copy=True))
        return make_request(what, lib.RS_KIND_BROADCAST, name, out, out, root=root,
                            blocking=blocking)

    def broadcast(self, x, root_rank, name=None):
        """A new array holding root_rank's x on every rank."""
        return self.synchronize(self.broadcast_async(x, root_rank, name, _blocking=True))

    def broadcast_(self, x, root_rank, name=None):
        """Overwrite x on every rank with root_rank's x, in place; returns x's array."""
        return self.synchronize(self.broadcast_async_(x, root_rank, name, _blocking=True))

    # ---- reducescatter ----

    def reducescatter_async(self, x, op=ReduceOp.AVERAGE, prescale_factor=1.0,
                            postscale_factor=1.0, name=None, _blocking=False) -> Handle:
        """Reduce x over all ranks; rank r gets the r-th slice of the first dimension
        (split as evenly as possible, the first ranks taking one more row)."""
        name = self._name(name, "reducescatter")
        request, out = self._checked([name], lib.RS_KIND_REDUCESCATTER, _blocking, lambda: (
            self._reducescatter_request(x, as_op(op, "reducescatter"), prescale_factor,
                                        postscale_factor, name, "reducescatter", _blocking)))
        return self._submit([request], lambda: out, "reducescatter")

    def _reducescatter_request(self, x, code, prescale, postscale, name, what, blocking):
        src = as_input(x, what, name)
        if src.ndim == 0:
            raise UsageError(f"ringsync.{what}{describe(name)}: needs at least one dimension")
        rows = even_split(src.shape[0], self._size)[self._rank]
        out = np.empty((rows,) + src.shape[1:], dtype=src.dtype)
        return make_request(what, lib.RS_KIND_REDUCESCATTER, name, src, out, op=code,
                            prescale=prescale, postscale=postscale, reduces=True,
                            blocking=blocking), out

    def reducescatter(self, x, op=ReduceOp.AVERAGE, prescale_factor=1.0, postscale_factor=1.0,
                      name=None):
        return self.synchronize(self.reducescatter_async(x, op, prescale_factor,
                                                         postscale_factor, name, _blocking=True))

    # ---- alltoall ----

    def alltoall_async(self, x, splits=None, name=None, _blocking=False) -> Handle:
        """Send splits[i] rows of x (in rank order) to rank i. synchronize returns the rows
        received, in rank order, and — when splits was given, as in Horovod — the number of
        rows received from each rank."""
        name = self._name(name, "alltoall")
        request = self._checked([name], lib.RS_KIND_ALLTOALL, _blocking, lambda: (
            self._alltoall_request(x, splits, name, _blocking)))
        src = request.src

        def finish(result):
            data, received, from_each = result
            out = wrap_native_result(data, received, src.shape[1:], src.dtype)
            return out if splits is None else (out, from_each)

        return self._submit_taking([request], lambda results: finish(results[0]), "alltoall")

    def _alltoall_request(self, x, splits, name, blocking):
        src = as_input(x, "alltoall", name)
        if src.ndim == 0:
            raise UsageError(f"ringsync.alltoall{describe(name)}: needs at least one dimension")
        rows = None
        if splits is not None:
            rows = np.ascontiguousarray(np.asarray(splits).reshape(-1), dtype=np.int64)
            if rows.size != self._size:
                raise UsageError(f"ringsync.alltoall{describe(name)}: splits {rows.tolist()} on "
                                 f"rank {self._rank} must have one entry per rank ({self._size})")
        elif src.shape[0] % self._size:
            # Horovod's rule (a ValueError there too): no even split, no silent uneven one.
            raise UsageError(f"ringsync.alltoall{describe(name)}: the first dimension "
                             f"({src.shape[0]}) on rank {self._rank} is not divisible by the "
                             f"{self._size} ranks; pass splits")
        return make_request("alltoall", lib.RS_KIND_ALLTOALL, name, src, None, splits=rows,
                            blocking=blocking)

    def alltoall(self, x, splits=None, name=None):
        return self.synchronize(self.alltoall_async(x, splits, name, _blocking=True))

    # ---- point-to-point ----

    def _peer(self, peer, what: str, role: str, name) -> int:
        if isinstance(peer, bool) or not isinstance(peer, (int, np.integer)) or \
                not 0 <= int(peer) < self._size or int(peer) == self._rank:
            raise UsageError(f"ringsync.{what}: {role} rank {peer!r}{describe(name)} is out of "
                             f"range: not one of this ring's ranks 0..{self._size - 1} other "
                             f"than this rank ({self._rank})")
        return int(peer)

    def _message_name(self, name, what: str) -> str:
        """The caller's name, or "" (unnamed: matched by its place in the pair's order)."""
        return "" if name is None else self._name(name, what)

    def send_async(self, x, dst: int, name=None) -> Handle:
        """Start sending x to rank dst (of this ring: a process set's own numbering).
        synchronize returns None once dst has received it: a send completes only when the
        matching recv_async is posted (synchronous, like MPI_Ssend), so exchanges that
        send and receive at once use the async calls. Unnamed messages between a pair
        match in order (the k-th send from A to B meets the k-th unnamed recv on B from
        A); a named one meets the recv of the same name, in any order. x must not change
        until then."""
        dst = self._peer(dst, "send", "destination", name)
        src = as_input(x, "send", name)
        request = make_request("send", lib.RS_KIND_SEND, self._message_name(name, "send"), src,
                               None, root=dst)
        request.start_now = True  # nothing to fuse with: start the round now
        return self._submit([request], lambda: None, "send")

    def recv_async(self, out, src: int, name=None) -> Handle:
        """Start receiving rank src's message into out (writable, C-contiguous, with the
        sender's dtype and shape: a mismatch fails both ends, naming both). synchronize
        returns out."""
        src_rank = self._peer(src, "recv", "source", name)
        buf = as_output(out, "recv", name)
        request = make_request("recv", lib.RS_KIND_RECV, self._message_name(name, "recv"), buf,
                               buf, root=src_rank)
        request.start_now = True
        return self._submit([request], lambda: buf, "recv")

    def send(self, x, dst: int, name=None) -> None:
        """Send x to rank dst; returns once dst has received it (see send_async)."""
        return self.synchronize(self.send_async(x, dst, name))

    def recv(self, out, src: int, name=None):
        """Receive rank src's message into out; returns out's array."""
        return self.synchronize(self.recv_async(out, src, name))

    # ---- barrier and timeline ----

    def barrier(self):
        """Returns once every rank has called barrier()."""
        request = make_request("barrier", lib.RS_KIND_BARRIER, self._name(None, "barrier"),
                                np.empty(0, np.uint8), None, blocking=True)
        self.synchronize(self._submit([request], lambda: None, "barrier"))

    def join(self) -> int:
        """This rank has no more data. Until every rank has joined, it takes part in the
        other ranks' allreduces with zeros (Average still divides by size()); other
        collectives fail while a rank has joined. Returns the last rank to join."""
        request = make_request("join", lib.RS_KIND_JOIN, "ringsync.join",
                                np.empty(0, np.uint8), None, blocking=True)
        return self.synchronize(self._submit_taking(
            [request], lambda results: self.world_ranks[results[0][1]], "join"))

    def start_timeline(self, path: str, mark_cycles: bool = False):
        """Record a Chrome-trace timeline (open it in Perfetto) of every tensor's phases on
        every rank, written to ``path`` as one file by rank 0 at stop_timeline() or
        shutdown() (see ringsync/_timeline.py). mark_cycles (or
        RINGSYNC_TIMELINE_MARK_CYCLES=1): mark the start of each negotiation round."""
        self._timeline.start(path, mark_cycles or bool(self.config.timeline_mark_cycles))

    def stop_timeline(self):
        """Collective: every rank stops, and rank 0 writes the file."""
        self._timeline.stop()
