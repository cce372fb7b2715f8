"""Communicator: the Python face of one native ring and its engine.

Every collective is a request to the engine (a background thread in the native core):
the `_async` calls return a Handle at once, `synchronize(handle)` waits for it, and the
plain calls do both. The GIL is released while the core works (cffi releases it).
"""
import collections
import dataclasses
import itertools
import os
import socket
import threading
from typing import Callable, List, Optional, Sequence

import numpy as np

from . import bootstrap
from ._arrays import (as_input, as_output, describe, dtype_code, pointer, wrap_native_result)
from ._native import ffi, lib
from .config import Config
from .errors import CommunicationError, CommunicationTimeout, UsageError
from .ops import ReduceOp
from .rendezvous import Rendezvous, as_rendezvous

assert [int(o) for o in ReduceOp] == [lib.RS_OP_SUM, lib.RS_OP_AVERAGE, lib.RS_OP_MIN,
                                      lib.RS_OP_MAX, lib.RS_OP_PRODUCT], "ReduceOp != ringsync.h"

_STATUS_ERRORS = {
    lib.RS_ERR_USAGE: UsageError,
    lib.RS_ERR_NOMEM: MemoryError,
    lib.RS_ERR_COMM: CommunicationError,
    lib.RS_ERR_TIMEOUT: CommunicationTimeout,
    lib.RS_ERR_SYSTEM: CommunicationError,
}
_TRANSPORT_MODES = {"auto": lib.RS_TRANSPORT_AUTO, "tcp": lib.RS_TRANSPORT_TCP,
                    "shm": lib.RS_TRANSPORT_SHM}
_WAIT_SLICE_SECONDS = 0.2  # waits return this often so that Ctrl-C gets through


_OP_CODES = {op: int(op) for op in ReduceOp}


def as_op(op, what: str) -> int:
    code = _OP_CODES.get(op)  # the common case, without enum construction
    if code is not None:
        return code
    try:
        return int(ReduceOp(op))
    except ValueError:
        raise UsageError(f"ringsync.{what}: unknown reduction op {op!r}; use one of "
                         f"{', '.join(o.name.title() for o in ReduceOp)}") from None


def _cores_per_local_rank(local_size: int) -> float:
    """Cores this rank may count on. A rank bound to one core (Open MPI binds each of two
    ranks to its own core) has that core to itself when the host has a core per rank."""
    host = os.cpu_count() or 1
    own = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else host
    if own == 1 and host >= local_size:
        return 1.0
    return own / local_size


def even_split(n: int, parts: int) -> Sequence[int]:
    """n split into `parts` nearly equal parts, the first n % parts one larger."""
    return [n // parts + (i < n % parts) for i in range(parts)]


class Handle:
    """A submitted collective. poll() says whether it is done; synchronize() returns its
    result (or raises its error). One handle per tensor, or several for a group."""

    __slots__ = ("_comm", "_ids", "_keep", "_finish", "_what", "names", "_result", "_done")

    def __init__(self, comm, ids, keep, finish, what, names):
        self._comm, self._ids, self._keep = comm, ids, keep
        self._finish, self._what, self.names = finish, what, names
        self._result, self._done = None, False

    def __repr__(self):
        return f"<ringsync.Handle {self._what} {self.names}{' done' if self._done else ''}>"

    def __del__(self):
        # Dropped while pending: the engine may still read and write the buffers, so they
        # go to the communicator, which frees them once the engine has finished.
        if not self._done and self._ids and self._comm is not None:
            try:
                self._comm._adopt_orphan(self._ids, self._keep)
            except Exception:  # interpreter shutdown: the engine is stopped by then
                pass

    def then(self, fn: Callable) -> "Handle":
        """Have synchronize() return fn(result) instead (adapters convert results this way)."""
        finish = self._finish
        self._finish = lambda: fn(finish())
        return self


@dataclasses.dataclass
class _Request:
    """One tensor to submit, and what must stay alive until it is done."""
    name: str
    kind: int
    dtype: int
    src: np.ndarray
    out: Optional[np.ndarray]
    op: int = 0
    prescale: float = 1.0
    postscale: float = 1.0
    root: int = 0
    splits: Optional[np.ndarray] = None
    urgent: bool = False


def _fill(s, r: _Request):
    """Fill the native request struct s from r; returns what must stay alive meanwhile."""
    s.kind, s.dtype, s.op, s.root = r.kind, r.dtype, r.op, r.root
    s.prescale, s.postscale, s.urgent = r.prescale, r.postscale, r.urgent
    s.ndim = r.src.ndim
    s.shape[0:r.src.ndim] = r.src.shape
    send = pointer(r.src)
    recv = send if r.out is r.src else (pointer(r.out) if r.out is not None else ffi.NULL)
    s.sendbuf, s.recvbuf = send, recv
    if r.splits is not None:
        s.splits = ffi.cast("int64_t *", pointer(r.splits))
    return send, recv, r


class PreparedAllreduce:
    """See Communicator._prepare_allreduce_: a request built once, submitted many times."""

    __slots__ = ("comm", "name", "name_c", "names", "struct", "ids")

    def __init__(self, comm, name):
        self.comm, self.name = comm, name
        self.name_c = ffi.new("char[]", name.encode())
        self.names = ffi.new("const char *[1]")
        self.struct = ffi.new("rs_request_t *")
        self.ids = ffi.new("int64_t[1]")


class Communicator:
    """A ring of ranks, with its engine, built over a rendezvous: an mpi4py
    intracommunicator (MPI.COMM_WORLD by default) or any ringsync.rendezvous.Rendezvous
    (ranks that are threads of one process, for tests).

    Holds its own native context; several can exist in one process.
    """

    def __init__(self, mpi_comm=None, config: Optional[Config] = None, own_comm: bool = False,
                 rendezvous: Optional[Rendezvous] = None):
        """mpi_comm: an mpi4py intracommunicator (or a Rendezvous in its place).
        own_comm: mpi_comm is ours alone (elastic recovery hands over the communicator it
        just built): use it as it is instead of a duplicate, so that revoking it also
        interrupts this constructor's own MPI calls. rendezvous: build over this instead
        of MPI; the Communicator closes it when it shuts down."""
        self._rendezvous = as_rendezvous(mpi_comm, own_comm, rendezvous)
        self._rank, self._size = self._rendezvous.rank, self._rendezvous.size
        # A bad setting on one rank travels through the first exchange (see _connect):
        # raised here, it would leave the other ranks waiting in the rendezvous.
        self._setup_error = None
        try:
            self.config = config or Config.from_env()
        except UsageError as e:
            self.config, self._setup_error = Config(), ("usage", f"rank {self._rank}: {e}")
        self._c = ffi.NULL
        self._engine = ffi.NULL
        self._lane = False
        self._per_thread = threading.local()
        self._auto_names = itertools.count()
        # (handle ids, buffers) of dropped pending handles. A deque: a handle may be dropped
        # (by the garbage collector, in any thread) while a sweep runs, and its append and
        # popleft are atomic.
        self._orphans = collections.deque()
        try:
            self._connect()
            self._start_engine()
        except BaseException:
            self._destroy_native()
            self._rendezvous.close()
            raise

    # ---- setup and teardown ----

    def _connect(self):
        # Errors travel through the allgather instead of being raised here: a rank that
        # raised before it would leave its peers waiting in the rendezvous forever.
        me, local_error = self._open_listener()
        local_error = self._setup_error or local_error
        peers = self._rendezvous.allgather((me, local_error, self.config.agreed()))
        self._raise_if_any_failed([err for _, err, _ in peers], "setting up the listening socket")
        self._raise_if_settings_differ([settings for _, _, settings in peers])
        infos = [info for info, _, _ in peers]
        self.host_names = [p.host_name for p in infos]
        self.topology = bootstrap.topology(self.host_names, self._rank)
        self._connect_ring(infos)
        lib.rs_comm_set_spin(self._c, self._spin_seconds())
        lib.rs_comm_set_small_allreduce(self._c, self.config.small_allreduce_bytes)

    def _spin_seconds(self) -> float:
        """Spinning pays only where the ranks' threads need not share cores: on 2 cores
        with 2 ranks (4 busy threads), a 20 us spin measured no faster for a 4-byte
        allreduce and made training steps slower."""
        if self.config.spin_us >= 0:
            return min(self.config.spin_us, 1e6) * 1e-6
        return 20e-6 if _cores_per_local_rank(self.topology.local_size) >= 2 else 0.0

    def _lane_spin_seconds(self) -> float:
        """The lane's waits run on the calling thread while the engine thread sleeps: one
        busy thread per rank, so spinning pays where each local rank has a core."""
        if self.config.lane_spin_us >= 0:
            return min(self.config.lane_spin_us, 1e6) * 1e-6
        return 50e-6 if _cores_per_local_rank(self.topology.local_size) >= 1 else 0.0

    def _open_listener(self):
        """(this rank's PeerInfo, an error or None). A rank listens only on the address it
        advertises: stray clients elsewhere never reach it."""
        me = bootstrap.PeerInfo(self.config.host_name or socket.gethostname(), "", 0)
        mode = _TRANSPORT_MODES.get(self.config.transport.lower())
        if mode is None:
            return me, ("usage", f"rank {self._rank}: RINGSYNC_TRANSPORT="
                        f"{self.config.transport!r} is not one of {', '.join(_TRANSPORT_MODES)}")
        try:
            bind_host, advertised = bootstrap.listen_addresses(self.config.iface)
        except UsageError as e:
            return me, ("usage", f"rank {self._rank}: {e}")
        cptr, port = ffi.new("rs_comm_t **"), ffi.new("int *")
        status = lib.rs_comm_create(self._rank, self._size, bind_host.encode(),
                                    self.config.timeout_seconds,
                                    self.config.start_timeout_seconds, cptr, port)
        self._c = cptr[0]
        if status == lib.RS_OK:
            status = lib.rs_comm_set_transport(self._c, mode)
        me = dataclasses.replace(me, address=advertised, port=port[0])
        return me, self._error_text(status, "creating the ring")

    def _connect_ring(self, infos):
        addresses = bootstrap.connect_addresses(infos)
        keys = self._rendezvous.bcast(bootstrap.JobKeys.new() if self._rank == 0 else None, root=0)
        keep = [ffi.new("char[]", s.encode()) for s in addresses + self.host_names]
        hosts, names = keep[: self._size], keep[self._size:]
        status = lib.rs_comm_connect(self._c, ffi.new("const char *[]", hosts),
                                     ffi.new("int[]", [p.port for p in infos]),
                                     ffi.new("const char *[]", names), keys.job_id,
                                     keys.secret, len(keys.secret))
        errors = self._rendezvous.allgather(self._error_text(status, "connecting the ring"))
        self._raise_if_any_failed(errors, "connecting the ring")

    def _start_engine(self):
        cfg = ffi.new("rs_engine_config_t *", {
            "fusion_threshold_bytes": self.config.fusion_threshold,
            "cycle_time_ms": self.config.cycle_time_ms,
            "stall_check_seconds": self.config.stall_check_seconds,
            "cache_capacity": self.config.cache_capacity,
            "lane_spin_seconds": self._lane_spin_seconds(),
            "lane_max_bytes": self.config.lane_bytes,
            "staged_min_bytes": self.config.staged_bytes,
        })
        eptr = ffi.new("rs_engine_t **")
        status = lib.rs_engine_create(self._c, cfg, eptr)
        if status != lib.RS_OK:
            raise CommunicationError(f"ringsync.init: {self._error_text(status, 'starting the engine')[1]}")
        self._engine = eptr[0]
        self._lane = bool(lib.rs_engine_has_lane(self._engine))
        if self.config.timeline:
            self.start_timeline(self.config.timeline)

    def _error_text(self, status, what):
        """None, or (kind, text) for the allgather that tells every rank who failed."""
        if status == lib.RS_OK:
            return None
        detail = ffi.string(lib.rs_comm_last_error(self._c)).decode() if self._c else ""
        kind = "usage" if status == lib.RS_ERR_USAGE else "comm"
        return kind, f"rank {self._rank}: {what} failed (status {status}): {detail}"

    def _raise_if_settings_differ(self, settings):
        """Every rank raises the same error when a setting that changes the wire protocol
        or an algorithm choice differs between ranks (a variable exported on one host only
        would otherwise give wrong sums or a hang)."""
        problems = []
        for key, mine in settings[0].items():
            differ = [(r, s[key]) for r, s in enumerate(settings) if s[key] != mine]
            if differ:
                r, theirs = differ[0]
                problems.append(f"RINGSYNC_{key.upper()} is {mine!r} on rank 0 but {theirs!r} on "
                                f"rank {r}" + (f" (and {len(differ) - 1} more ranks)"
                                               if len(differ) > 1 else ""))
        if problems:
            raise UsageError("ringsync.init: ranks must agree on these settings (export them "
                             "to every rank, e.g. mpirun -x): " + "; ".join(problems))

    def _raise_if_any_failed(self, errors, what):
        """Every rank raises together: a usage error if all failures were bad settings."""
        failed = [e for e in errors if e]
        if failed:
            cls = UsageError if all(kind == "usage" for kind, _ in failed) else CommunicationError
            raise cls(f"ringsync.init: {what} failed: " + "; ".join(text for _, text in failed))

    def _destroy_native(self):
        self._lane = False
        if self._engine != ffi.NULL:
            lib.rs_engine_destroy(self._engine)  # joins its thread: no buffer is in use after
            self._engine = ffi.NULL
        self._orphans.clear()
        if self._c != ffi.NULL:
            lib.rs_comm_destroy(self._c)
            self._c = ffi.NULL

    def shutdown(self):
        """Stop the engine and close the ring. Waits (bounded by the timeout) until every
        healthy rank gets here, so that no rank's exit looks like a failure to a peer."""
        if self._c == ffi.NULL:
            return
        lib.rs_engine_shutdown(self._engine)  # a failure here changes nothing: we close
        self._destroy_native()
        self._rendezvous.close()

    def abort(self, reason: str = "aborted"):
        """Fail every pending collective here and on every peer, and close the ring at
        once (no shutdown handshake). The rendezvous is kept open: elastic recovery
        revokes and shrinks its MPI communicator (see mpi_comm)."""
        if self._c == ffi.NULL:
            return
        lib.rs_engine_abort(self._engine, reason.encode())
        self._destroy_native()

    @property
    def transport(self) -> str:
        """"shm" when same-host peers are reached through shared memory, else "tcp"."""
        return ffi.string(lib.rs_comm_transport_name(self._c)).decode() if self._c else "closed"

    @property
    def mpi_comm(self):
        """The MPI communicator this ring was bootstrapped over (ringsync's own copy), or
        None for a rendezvous without MPI."""
        return self._rendezvous.mpi_comm

    @property
    def rendezvous(self) -> Rendezvous:
        """Where this ring's ranks met (and, for elastic recovery, agree on survivors)."""
        return self._rendezvous

    @property
    def closed(self) -> bool:
        return self._c == ffi.NULL

    @property
    def broken(self) -> bool:
        """True once the ring has failed (a lost peer, a timeout, an abort)."""
        return self._c != ffi.NULL and lib.rs_comm_is_broken(self._c) != 0

    # ---- topology ----

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._size

    def local_rank(self) -> int:
        return self.topology.local_rank

    def local_size(self) -> int:
        return self.topology.local_size

    def cross_rank(self) -> int:
        return self.topology.cross_rank

    def cross_size(self) -> int:
        return self.topology.cross_size

    # ---- handles ----

    def _name(self, name: Optional[str], what: str) -> str:
        """Names given by the caller, or generated in call order (the same on every rank
        as long as ranks make their unnamed calls in the same order, as Horovod's do)."""
        if name is None:
            return f"{what}.noname.{next(self._auto_names)}"
        name = str(name)
        if "\0" in name:  # C would see only the part before it: two names would meet
            raise UsageError(f"ringsync.{what}: tensor name {name!r} contains a NUL character "
                             f"(rank {self._rank})")
        return name

    def _adopt_orphan(self, ids, keep):
        """Keep a dropped pending handle's buffers until the engine is done with them."""
        if self._engine != ffi.NULL:
            self._orphans.append((list(ids), keep))

    def _release_finished_orphans(self):
        """Free what dropped handles held, once the engine has finished with it (checked at
        each submission, so that their number stays bounded by what is still running)."""
        for _ in range(len(self._orphans)):
            ids, keep = self._orphans.popleft()
            if all(lib.rs_engine_poll(self._engine, h) != 0 for h in ids):
                for h in ids:
                    lib.rs_engine_release(self._engine, h)
            else:
                self._orphans.append((ids, keep))

    def _submit(self, requests: List[_Request], finish: Callable, what: str) -> Handle:
        """Hand requests to the engine. A blocking call (one urgent request) tries the
        same-host lane first, which runs allreduces and barriers itself."""
        if self._orphans:
            self._release_finished_orphans()
        if self._lane and len(requests) == 1 and requests[0].urgent and not self.closed:
            if self._run_on_lane(requests[0], what):  # done: synchronize only finishes it
                return Handle(self, [], None, finish, what, [requests[0].name])
        n = len(requests)
        names = [ffi.new("char[]", r.name.encode()) for r in requests]
        structs = ffi.new("rs_request_t[]", n)
        keep = [names] + [_fill(s, r) for s, r in zip(structs, requests)]
        ids = ffi.new("int64_t[]", n)
        status = lib.rs_engine_submit(self._engine, ffi.new("const char *[]", names), structs, n, ids)
        if status != lib.RS_OK:
            self._raise_engine_error(status, what)
        return Handle(self, list(ids), keep, finish, what, [r.name for r in requests])

    def _run_on_lane(self, request: _Request, what: str) -> bool:
        """Post a blocking call on the same-host lane (no engine thread, no negotiation):
        True when the lane ran it; False when every rank found that the engine must (any
        collective but a small allreduce or a barrier): it then runs there, while a
        disagreement between ranks has already failed here."""
        struct = ffi.new("rs_request_t *")
        keep = _fill(struct, request)  # noqa: F841 (the pointers must outlive the call)
        ran = ffi.new("int *")
        status = lib.rs_engine_try_lane(self._engine, request.name.encode(), struct, ran)
        if status != lib.RS_OK:
            self._raise_engine_error(status, what, request.name)
        return bool(ran[0])

    def _request(self, what, kind, name, src, out, *, op=0, prescale=1.0, postscale=1.0,
                 root=0, splits=None, reduces=False, urgent=False) -> _Request:
        if src.ndim > lib.RS_MAX_DIMS:
            raise UsageError(f"ringsync.{what}{describe(name)}: {src.ndim} dimensions; at most "
                             f"{lib.RS_MAX_DIMS} are supported")
        return _Request(name, kind, dtype_code(src, what, name, reduces), src, out, op,
                        float(prescale), float(postscale), root, splits, urgent)

    def poll(self, handle: Handle) -> bool:
        """True once every tensor of the handle has completed (then synchronize won't block)."""
        if handle._done:
            return True
        return all(lib.rs_engine_poll(self._engine, h) == 1 for h in handle._ids)

    def synchronize(self, handle: Handle):
        """Wait for the handle and return its result; raises the error it failed with."""
        if handle._done:
            return handle._result
        if handle._comm is not self or self.closed:
            raise UsageError(f"ringsync.synchronize: handle {handle!r} does not belong to the "
                             "current (open) communicator")
        local = self._per_thread
        if not hasattr(local, "done"):
            local.done = ffi.new("int *")
        done = local.done
        statuses = []
        for h in handle._ids:
            status = lib.rs_engine_wait(self._engine, h, _WAIT_SLICE_SECONDS, done)
            while status == lib.RS_OK and not done[0]:
                status = lib.rs_engine_wait(self._engine, h, _WAIT_SLICE_SECONDS, done)
            statuses.append(status)
        try:
            self._raise_for(handle, statuses)
            handle._result = handle._finish()
        finally:
            for h in handle._ids:
                lib.rs_engine_release(self._engine, h)
            handle._done, handle._keep = True, None
        return handle._result

    def _raise_for(self, handle: Handle, statuses):
        for h, name, status in zip(handle._ids, handle.names, statuses):
            if status != lib.RS_OK:
                detail = ffi.string(lib.rs_engine_handle_error(self._engine, h)).decode()
                if not detail:
                    detail = ffi.string(lib.rs_engine_last_error(self._engine)).decode()
                raise _STATUS_ERRORS.get(status, CommunicationError)(
                    f"ringsync.{handle._what}{describe(name)} failed on rank {self._rank}: {detail}")

    def _take_result(self, handle_id):
        data, rows = ffi.new("void **"), ffi.new("int64_t *")
        splits = np.empty(self._size, dtype=np.int64)
        lib.rs_engine_take_result(self._engine, handle_id, data, rows,
                                  ffi.cast("int64_t *", splits.ctypes.data))
        return data[0], int(rows[0]), splits

    # ---- allreduce ----

    def allreduce_async(self, x, op=ReduceOp.AVERAGE, prescale_factor=1.0, postscale_factor=1.0,
                        name=None, _urgent=False) -> Handle:
        """Start reducing x over all ranks into a new array; synchronize returns it."""
        src = as_input(x, "allreduce", name)
        out = np.empty_like(src)
        return self._allreduce(src, out, op, prescale_factor, postscale_factor, name, "allreduce",
                               _urgent)

    def allreduce_async_(self, x, op=ReduceOp.AVERAGE, prescale_factor=1.0, postscale_factor=1.0,
                         name=None, _urgent=False) -> Handle:
        """Start reducing x in place; synchronize returns x's array."""
        out = as_output(x, "allreduce_", name)
        return self._allreduce(out, out, op, prescale_factor, postscale_factor, name, "allreduce_",
                               _urgent)

    def _allreduce(self, src, out, op, prescale, postscale, name, what, urgent):
        request = self._request(what, lib.RS_KIND_ALLREDUCE, self._name(name, "allreduce"), src,
                                out, op=as_op(op, what), prescale=prescale, postscale=postscale,
                                reduces=True, urgent=urgent)
        return self._submit([request], lambda: out, what)

    # ---- one tensor reduced in place, step after step, under one name ----

    def _prepare_allreduce_(self, name: str, like: np.ndarray, op=ReduceOp.AVERAGE,
                           prescale_factor=1.0, postscale_factor=1.0) -> "PreparedAllreduce":
        """Everything about an in-place allreduce but the memory: _start_prepared(prepared,
        address) then submits it without building a request again (a DistributedOptimizer
        submits every gradient of every step this way). like: an array with the tensor's
        dtype and shape."""
        request = self._request("allreduce_", lib.RS_KIND_ALLREDUCE, str(name), like, like,
                                op=as_op(op, "allreduce_"), prescale=prescale_factor,
                                postscale=postscale_factor, reduces=True)
        prepared = PreparedAllreduce(self, request.name)
        _fill(prepared.struct, request)
        prepared.names[0] = prepared.name_c
        return prepared

    def _start_prepared(self, prepared: "PreparedAllreduce", address: int, keep) -> Handle:
        """Reduce the prepared tensor in place at `address` (keep holds that memory alive
        until the engine is done with it); synchronize returns keep. Private: it takes a raw
        address, which must point at memory of the prepared size that `keep` owns."""
        if prepared.comm is not self or self.closed:
            raise UsageError("ringsync._start_prepared: the allreduce was prepared for another "
                             "(or a closed) communicator")
        if self._orphans:
            self._release_finished_orphans()
        s = prepared.struct
        s.sendbuf = s.recvbuf = ffi.cast("void *", address)
        status = lib.rs_engine_submit(self._engine, prepared.names, s, 1, prepared.ids)
        if status != lib.RS_OK:
            self._raise_engine_error(status, "allreduce_")
        return Handle(self, [prepared.ids[0]], keep, lambda: keep, "allreduce_", [prepared.name])

    def _raise_engine_error(self, status, what, name=None):
        detail = ffi.string(lib.rs_engine_last_error(self._engine)).decode()
        raise _STATUS_ERRORS.get(status, CommunicationError)(
            f"ringsync.{what}{describe(name)} failed on rank {self._rank}: {detail}")

    def allreduce(self, x, op=ReduceOp.AVERAGE, prescale_factor=1.0, postscale_factor=1.0,
                  name=None):
        return self.synchronize(self.allreduce_async(x, op, prescale_factor, postscale_factor,
                                                     name, _urgent=True))

    def allreduce_(self, x, op=ReduceOp.AVERAGE, prescale_factor=1.0, postscale_factor=1.0,
                   name=None):
        return self.synchronize(self.allreduce_async_(x, op, prescale_factor, postscale_factor,
                                                      name, _urgent=True))

    def grouped_allreduce_async(self, tensors, op=ReduceOp.AVERAGE, prescale_factor=1.0,
                                postscale_factor=1.0, name=None, _in_place=False,
                                _urgent=False) -> Handle:
        """Reduce a list of tensors as one unit (negotiated together, fused together)."""
        what = "grouped_allreduce_" if _in_place else "grouped_allreduce"
        base = self._name(name, "grouped_allreduce")
        code = as_op(op, what)
        requests, outs = [], []
        for i, x in enumerate(tensors):
            src = as_output(x, what, f"{base}.{i}") if _in_place else as_input(x, what, f"{base}.{i}")
            out = src if _in_place else np.empty_like(src)
            outs.append(out)
            requests.append(self._request(what, lib.RS_KIND_ALLREDUCE, f"{base}.{i}", src, out,
                                          op=code, prescale=prescale_factor,
                                          postscale=postscale_factor, reduces=True,
                                          urgent=_urgent))
        return self._submit(requests, lambda: outs, what)

    def grouped_allreduce_async_(self, tensors, op=ReduceOp.AVERAGE, prescale_factor=1.0,
                                 postscale_factor=1.0, name=None) -> Handle:
        return self.grouped_allreduce_async(tensors, op, prescale_factor, postscale_factor, name,
                                            _in_place=True)

    def grouped_allreduce(self, tensors, op=ReduceOp.AVERAGE, prescale_factor=1.0,
                          postscale_factor=1.0, name=None):
        return self.synchronize(self.grouped_allreduce_async(
            tensors, op, prescale_factor, postscale_factor, name, _urgent=True))

    def grouped_allreduce_(self, tensors, op=ReduceOp.AVERAGE, prescale_factor=1.0,
                           postscale_factor=1.0, name=None):
        return self.synchronize(self.grouped_allreduce_async(
            tensors, op, prescale_factor, postscale_factor, name, _in_place=True, _urgent=True))

    # ---- allgather ----

    def allgather_async(self, x, name=None, _urgent=False) -> Handle:
        """Start concatenating every rank's x along the first dimension (which may differ
        by rank; a 0-d array counts as one row)."""
        src = as_input(x, "allgather", name)
        src = src.reshape(1) if src.ndim == 0 else src
        request = self._request("allgather", lib.RS_KIND_ALLGATHER, self._name(name, "allgather"),
                                src, None, urgent=_urgent)
        handle = None

        def finish():
            data, rows, _ = self._take_result(handle._ids[0])
            return wrap_native_result(data, rows, src.shape[1:], src.dtype)

        handle = self._submit([request], finish, "allgather")
        return handle

    def allgather(self, x, name=None):
        return self.synchronize(self.allgather_async(x, name, _urgent=True))

    # ---- broadcast ----

    def broadcast_async(self, x, root_rank, name=None, _urgent=False) -> Handle:
        out = np.array(as_input(x, "broadcast", name), copy=True)
        return self._broadcast(out, root_rank, name, "broadcast", _urgent)

    def broadcast_async_(self, x, root_rank, name=None, _urgent=False) -> Handle:
        out = as_output(x, "broadcast_", name)
        return self._broadcast(out, root_rank, name, "broadcast_", _urgent)

    def _broadcast(self, out, root_rank, name, what, urgent):
        if not isinstance(root_rank, (int, np.integer)) or not 0 <= root_rank < self._size:
            raise UsageError(f"ringsync.{what}: root_rank {root_rank!r}{describe(name)} is out "
                             f"of range for {self._size} ranks (rank {self._rank})")
        request = self._request(what, lib.RS_KIND_BROADCAST, self._name(name, "broadcast"), out,
                                out, root=int(root_rank), urgent=urgent)
        return self._submit([request], lambda: out, what)

    def broadcast(self, x, root_rank, name=None):
        """A new array holding root_rank's x on every rank."""
        return self.synchronize(self.broadcast_async(x, root_rank, name, _urgent=True))

    def broadcast_(self, x, root_rank, name=None):
        """Overwrite x on every rank with root_rank's x, in place; returns x's array."""
        return self.synchronize(self.broadcast_async_(x, root_rank, name, _urgent=True))

    # ---- reducescatter ----

    def reducescatter_async(self, x, op=ReduceOp.AVERAGE, prescale_factor=1.0,
                            postscale_factor=1.0, name=None, _urgent=False) -> Handle:
        """Reduce x over all ranks; rank r gets the r-th slice of the first dimension
        (split as evenly as possible, the first ranks taking one more row)."""
        src = as_input(x, "reducescatter", name)
        if src.ndim == 0:
            raise UsageError(f"ringsync.reducescatter{describe(name)}: needs at least one dimension")
        rows = even_split(src.shape[0], self._size)[self._rank]
        out = np.empty((rows,) + src.shape[1:], dtype=src.dtype)
        request = self._request("reducescatter", lib.RS_KIND_REDUCESCATTER,
                                self._name(name, "reducescatter"), src, out,
                                op=as_op(op, "reducescatter"), prescale=prescale_factor,
                                postscale=postscale_factor, reduces=True, urgent=_urgent)
        return self._submit([request], lambda: out, "reducescatter")

    def reducescatter(self, x, op=ReduceOp.AVERAGE, prescale_factor=1.0, postscale_factor=1.0,
                      name=None):
        return self.synchronize(self.reducescatter_async(x, op, prescale_factor,
                                                         postscale_factor, name, _urgent=True))

    # ---- alltoall ----

    def alltoall_async(self, x, splits=None, name=None, _urgent=False) -> Handle:
        """Send splits[i] rows of x (in rank order) to rank i. synchronize returns the rows
        received, in rank order, and — when splits was given, as in Horovod — the number of
        rows received from each rank."""
        src = as_input(x, "alltoall", name)
        if src.ndim == 0:
            raise UsageError(f"ringsync.alltoall{describe(name)}: needs at least one dimension")
        rows = None
        if splits is not None:
            rows = np.ascontiguousarray(np.asarray(splits).reshape(-1), dtype=np.int64)
            if rows.size != self._size:
                raise UsageError(f"ringsync.alltoall{describe(name)}: splits {rows.tolist()} on "
                                 f"rank {self._rank} must have one entry per rank ({self._size})")
        request = self._request("alltoall", lib.RS_KIND_ALLTOALL, self._name(name, "alltoall"),
                                src, None, splits=rows, urgent=_urgent)
        handle = None

        def finish():
            data, received, from_each = self._take_result(handle._ids[0])
            out = wrap_native_result(data, received, src.shape[1:], src.dtype)
            return out if splits is None else (out, from_each)

        handle = self._submit([request], finish, "alltoall")
        return handle

    def alltoall(self, x, splits=None, name=None):
        return self.synchronize(self.alltoall_async(x, splits, name, _urgent=True))

    # ---- barrier and timeline ----

    def barrier(self):
        """Returns once every rank has called barrier()."""
        request = self._request("barrier", lib.RS_KIND_BARRIER, self._name(None, "barrier"),
                                np.empty(0, np.uint8), None, urgent=True)
        self.synchronize(self._submit([request], lambda: None, "barrier"))

    def join(self) -> int:
        """This rank has no more data. Until every rank has joined, it takes part in the
        other ranks' allreduces with zeros (Average still divides by size()); other
        collectives fail while a rank has joined. Returns the last rank to join."""
        request = self._request("join", lib.RS_KIND_JOIN, "ringsync.join",
                                np.empty(0, np.uint8), None, urgent=True)
        handle = None

        def last_rank():
            return self._take_result(handle._ids[0])[1]

        handle = self._submit([request], last_rank, "join")
        return self.synchronize(handle)

    def start_timeline(self, path: str):
        """Write a Chrome-trace timeline (open it in Perfetto) of every tensor's phases."""
        if lib.rs_engine_start_timeline(self._engine, str(path).encode()) != lib.RS_OK:
            detail = ffi.string(lib.rs_engine_last_error(self._engine)).decode()
            raise UsageError(f"ringsync.start_timeline: {detail}")

    def stop_timeline(self):
        lib.rs_engine_stop_timeline(self._engine)
