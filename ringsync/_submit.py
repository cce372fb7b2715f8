"""Requests to the native engine, and the handles that wait for them.

A Submitter is the Python face of one native engine: it hands requests over (or runs a
blocking one on the same-host lane), keeps what each request's memory needs alive until
the engine is done with it, and turns statuses into exceptions. It knows nothing about
collectives' arguments: Communicator builds the requests.
"""
import collections
import dataclasses
import threading
from typing import Callable, List, Optional

import numpy as np

from ._arrays import describe, dtype_code, pointer
from ._native import ffi, lib
from .errors import STATUS_CODES, MismatchError, UsageError, error_class

assert all(getattr(lib, name) == code for name, code in STATUS_CODES.items()), \
    "errors.STATUS_CODES != ringsync.h"
_WAIT_SLICE_SECONDS = 0.2  # waits return this often so that Ctrl-C gets through


def native_text(c_string) -> str:
    """An error text of the core. It quotes names cut to a number of bytes ('%.64s'),
    which may end inside a character: decoded strictly, such a name would raise a
    UnicodeDecodeError in place of the error."""
    return ffi.string(c_string).decode("utf-8", "replace")


def _is_p2p(kind: int) -> bool:
    """Messages are named per pair of ranks by the core: one name may go to two peers."""
    return kind in (lib.RS_KIND_SEND, lib.RS_KIND_RECV)


class Handle:
    """A submitted collective. poll() says whether it is done; synchronize() returns its
    result (or raises its error). One handle per tensor, or several for a group."""

    __slots__ = ("_comm", "_ids", "_keep", "_finish", "_what", "names", "_result", "_done")

    def __init__(self, comm, ids, keep, finish, what, names):
        """comm: the Communicator (synchronize finds it here); ids: engine handles (none
        when the lane already ran the call)."""
        self._comm, self._ids, self._keep = comm, ids, keep
        self._finish, self._what, self.names = finish, what, names
        self._result, self._done = None, False

    def __repr__(self):
        return f"<ringsync.Handle {self._what} {self.names}{' done' if self._done else ''}>"

    def __del__(self):
        # Dropped while pending: the engine may still read and write the buffers, so they
        # go to the submitter, which frees them once the engine has finished.
        if not self._done and self._ids and self._comm is not None:
            try:
                self._comm._submitter.adopt_orphan(self._ids, self._keep, self.names)
            except Exception:  # interpreter shutdown: the engine is stopped by then
                pass

    def then(self, fn: Callable) -> "Handle":
        """Have synchronize() return fn(result) instead (adapters convert results this way)."""
        finish = self._finish
        self._finish = lambda: fn(finish())
        return self


@dataclasses.dataclass
class Request:
    """One tensor to submit, and what must stay alive until it is done.

    start_now: a caller waits for it at once, so the engine must not hold it back to fuse
    it with later ones. try_lane: it may run on the same-host lane (a blocking call of one
    tensor) instead of going to the engine."""
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
    start_now: bool = False
    try_lane: bool = False


def make_request(what, kind, name, src, out, *, op=0, prescale=1.0, postscale=1.0, root=0,
                 splits=None, reduces=False, blocking=False) -> Request:
    """A Request after the checks every kind shares. blocking: the caller waits for the
    result right away (it then starts at once and may take the lane)."""
    if src.ndim > lib.RS_MAX_DIMS:
        raise UsageError(f"ringsync.{what}{describe(name)}: {src.ndim} dimensions; at most "
                         f"{lib.RS_MAX_DIMS} are supported")
    return Request(name, kind, dtype_code(src, what, name, reduces), src, out, op,
                   float(prescale), float(postscale), root, splits, start_now=blocking,
                   try_lane=blocking)


def fill_fields(s, r: Request):
    """Fill the native request struct s from r, all but the buffers."""
    s.kind, s.dtype, s.op, s.root = r.kind, r.dtype, r.op, r.root
    s.prescale, s.postscale, s.start_now = r.prescale, r.postscale, r.start_now
    s.blocking = r.try_lane  # (a blocking call: matched in call order, see ringsync.h)
    s.ndim = r.src.ndim
    s.shape[0:r.src.ndim] = r.src.shape


def fill_struct(s, r: Request):
    """Fill the native request struct s from r; returns what must stay alive meanwhile."""
    fill_fields(s, r)
    send = pointer(r.src)
    recv = send if r.out is r.src else (pointer(r.out) if r.out is not None else ffi.NULL)
    s.sendbuf, s.recvbuf = send, recv
    if r.splits is not None:
        s.splits = ffi.cast("int64_t *", pointer(r.splits))
    return send, recv, r


class PreparedAllreduce:
    """An in-place allreduce of one named tensor (its dtype, shape, op and scale factors) on
    one communicator, made once (Communicator.prepare_allreduce_) and started many times
    on new memory: a DistributedOptimizer starts every gradient of every step this way.
    Its native request comes from the submitter's request cache, as every allreduce's."""

    __slots__ = ("comm", "submitter", "name", "key", "like")

    def __init__(self, comm, submitter, name: str, like: np.ndarray, key):
        self.comm, self.submitter, self.name, self.key, self.like = comm, submitter, name, key, like

    def start(self, address: int, keep) -> Handle:
        """Reduce the tensor in place at `address`, memory of the prepared dtype and shape
        that `keep` owns and holds alive until the engine is done with it; synchronize
        returns keep."""
        if self.comm.closed:
            raise UsageError("ringsync: the allreduce was prepared for a communicator that is "
                             "closed now")
        return self.submitter.start_prepared(self.comm, self, address, keep)


_CACHE_LIMIT = 4096  # entries per thread; past it the cache starts over


class _RequestCache(threading.local):
    """The one cache of native allreduce requests: a calling thread's, one per (dtype,
    shape, op, scale factors, blocking), reused with new buffers, and each name's C string.
    An allreduce then costs two cffi calls instead of building a Request (a backward pass
    of hundreds of small gradients, or a 4-byte allreduce, is dominated by that Python
    work). Per thread: a struct carries the buffers of the call being submitted (the engine
    copies it at submission)."""

    def __init__(self):
        self.structs, self.names = {}, {}
        self.ran = ffi.new("int *")  # the lane's answer (this thread's calls only)

    def struct(self, key, src, name, what):
        """The request for key (built from src, an array like the tensor, on first use)."""
        found = self.structs.get(key)
        if found is None:
            if len(self.structs) >= _CACHE_LIMIT:
                self.structs.clear()
            found = self.structs[key] = _allreduce_struct(src, name, what, *key[2:])
        return found

    def name(self, name: str):
        """(the name as C string, a one-entry array of it, its bytes)."""
        found = self.names.get(name)
        if found is None:
            if len(self.names) >= _CACHE_LIMIT:
                self.names.clear()
            data = name.encode()
            c_name = ffi.new("char[]", data)
            found = self.names[name] = (c_name, ffi.new("const char *[1]", [c_name]), data)
        return found


def _allreduce_struct(src, name, what, op, prescale, postscale, blocking):
    """The native request of an allreduce like src's (checked as make_request checks every
    request); the buffers are filled in at each call."""
    request = make_request(what, lib.RS_KIND_ALLREDUCE, name, src, src, op=op,
                           prescale=prescale, postscale=postscale, reduces=True,
                           blocking=blocking)
    struct = ffi.new("rs_request_t *")
    fill_fields(struct, request)  # (the buffers: at each call)
    return struct


class Submitter:
    """Submits requests to a NativeRing's engine and waits for them. Two entry points, as
    mpi4py's Allreduce / Iallreduce: run() returns a blocking call's result (trying the
    same-host lane first), start() returns a Handle at once."""

    def __init__(self, ring):
        self.ring = ring
        self._cache = _RequestCache()
        # (handle ids, buffers) of dropped pending handles. A deque: a handle may be dropped
        # (by the garbage collector, in any thread) while a sweep runs, and its append and
        # popleft are atomic.
        self.orphans = collections.deque()
        # Called with each error a collective ends in (not a local refusal), before it is
        # raised: the Communicator leaves its flight records there.
        self.on_failure = None
        # Names of collectives submitted and not yet synchronized (or dropped and released).
        # The engine forgets a name once its collective completes, but a rank must not
        # reuse it before synchronize: where the first had completed on one rank only, the
        # engine would accept the second there alone, to wait for peers that refused it.
        self.unsynchronized = set()

    # ---- the two entry points ----

    def start(self, comm, requests: List[Request], finish: Callable, what: str,
              takes: bool = False) -> Handle:
        """Hand requests to the engine; synchronize(handle) returns finish(), or, where the
        native core holds the results (takes: allgather, alltoall, join), finish(their
        (data, rows, splits), in order)."""
        if self.orphans:
            self.release_finished_orphans()
        self._refuse_if_closed(what)
        n = len(requests)
        claimed = self._claim([r.name for r in requests if not _is_p2p(r.kind)], what)
        names = [ffi.new("char[]", r.name.encode()) for r in requests]
        structs = ffi.new("rs_request_t[]", n)
        keep = [names] + [fill_struct(s, r) for s, r in zip(structs, requests)]
        ids = ffi.new("int64_t[]", n)
        status = lib.rs_engine_submit(self.ring.engine, ffi.new("const char *[]", names),
                                      structs, n, ids)
        if status != lib.RS_OK:
            self.unsynchronized.difference_update(claimed)
            self.raise_engine_error(status, what)
        self._remember_in_place_allreduces(requests, structs)
        ids = list(ids)
        done = (lambda: finish([self.take_result(i) for i in ids])) if takes else finish
        return Handle(comm, ids, keep, done, what, [r.name for r in requests])

    def _remember_in_place_allreduces(self, requests, structs) -> None:
        """Asynchronous in-place allreduces of numpy arrays: the native entry takes calls
        like these from now on (start_batch)."""
        entry = self.ring.entry
        if entry is None:
            return
        for struct, r in zip(structs, requests):
            if r.kind == lib.RS_KIND_ALLREDUCE and r.out is r.src and not r.try_lane:
                entry.remember(r.src, r.op, r.prescale, r.postscale,
                               int(ffi.cast("uintptr_t", ffi.addressof(struct))))

    def start_batch(self, comm, arrays: list, names: list, op, prescale, postscale,
                    what: str, single: bool = False) -> Optional[Handle]:
        """start() of asynchronous in-place allreduces of numpy arrays (a group, one tensor
        each) through the native entry: one call submits them all. None where the entry
        cannot take them (an array unlike any the ordinary path has checked and
        remembered, say): nothing is submitted then, and the ordinary path does it all.
        single: one tensor, whose handle returns its array (not a list)."""
        entry = self.ring.entry
        if entry is None or not self.unsynchronized.isdisjoint(names):
            return None  # (the ordinary path says which name is in flight)
        if self.orphans:
            self.release_finished_orphans()
        ids = entry.start_group(arrays, names, op, prescale, postscale)
        if ids is None:
            return None
        if type(ids) is int:
            self.raise_engine_error(ids, what)
        self.unsynchronized.update(names)
        if single:
            x = arrays[0]
            return Handle(comm, ids, x, lambda: x, what, names)
        arrays = list(arrays)  # (the caller's list may change; the handle returns this one)
        return Handle(comm, ids, arrays, lambda: arrays, what, names)

    def run(self, comm, requests: List[Request], finish: Callable, what: str,
            takes: bool = False):
        """A blocking call's result: on the same-host lane where it can run there (one
        allreduce or barrier), else through the engine, waited for here."""
        if (len(requests) == 1 and requests[0].try_lane and self.ring.lane
                and not self.ring.closed and self._run_on_lane(requests[0], what)):
            return finish()
        return self.synchronize(self.start(comm, requests, finish, what, takes))

    def start_allreduce(self, comm, src: np.ndarray, out: np.ndarray, name: str, op: int,
                        prescale: float, postscale: float, what: str) -> Handle:
        """start() for an allreduce of src into out (arrays checked as input and output),
        through the request cache (its lookups inlined: every gradient hook comes here)."""
        if self.orphans:
            self.release_finished_orphans()
        struct = self._cache.structs.get((src.dtype, src.shape, op, prescale, postscale, False))
        if struct is None:
            struct = self._cached_struct(src, name, op, prescale, postscale, what, False)
        handle = self._submit_struct(comm, struct, src, out, name, what)
        if out is src and self.ring.entry is not None:  # (start_batch takes the next ones)
            self.ring.entry.remember(src, op, prescale, postscale,
                                     int(ffi.cast("uintptr_t", struct)))
        return handle

    def run_allreduce(self, comm, src: np.ndarray, out: np.ndarray, name: str, op: int,
                      prescale: float, postscale: float, what: str, lane: bool = True):
        """run() for an allreduce of src into out, through the request cache: returns out.
        (Every blocking allreduce the lane's native entry did not take comes here: the
        cache lookups are inlined.) lane=False: the call was posted on the lane already,
        and every rank found that the engine must run it."""
        if self.orphans:
            self.release_finished_orphans()
        cache = self._cache
        struct = cache.structs.get((src.dtype, src.shape, op, prescale, postscale, True))
        if struct is None:
            struct = self._cached_struct(src, name, op, prescale, postscale, what, True)
        if lane and self.ring.lane and not self.ring.closed:
            # (the native entry takes calls like this one from now on)
            self.ring.entry.remember(src, op, prescale, postscale,
                                     int(ffi.cast("uintptr_t", struct)))
            struct.sendbuf = ffi.from_buffer(src)
            struct.recvbuf = struct.sendbuf if out is src else ffi.from_buffer(out)
            names = cache.names.get(name) or cache.name(name)
            ran = cache.ran
            status = lib.rs_engine_try_lane(self.ring.engine, names[2], struct, ran)
            if status != lib.RS_OK:
                self.raise_engine_error(status, what, name, MismatchError)
            if ran[0]:
                return out
        return self.synchronize(self._submit_struct(comm, struct, src, out, name, what))

    def prepare_allreduce_(self, comm, name: str, like: np.ndarray, op: int, prescale: float,
                           postscale: float) -> PreparedAllreduce:
        """An in-place allreduce of tensors like `like`, named `name`, checked now."""
        like = np.broadcast_to(np.zeros((), like.dtype), like.shape)  # (no hold on its memory)
        key = (like.dtype, like.shape, op, float(prescale), float(postscale), False)
        self._cache.struct(key, like, name, "allreduce_")  # (its checks fail here, not later)
        return PreparedAllreduce(comm, self, name, like, key)

    def start_prepared(self, comm, prepared: PreparedAllreduce, address: int, keep) -> Handle:
        """Start a prepared in-place allreduce of the memory at `address` (kept alive by
        `keep`, which synchronize returns)."""
        if self.orphans:
            self.release_finished_orphans()
        s = self._cache.struct(prepared.key, prepared.like, prepared.name, "allreduce_")
        s.sendbuf = s.recvbuf = ffi.cast("void *", address)
        ids = ffi.new("int64_t[1]")
        claimed = self._claim((prepared.name,), "allreduce_")
        status = lib.rs_engine_submit(self.ring.engine, self._cache.name(prepared.name)[1], s,
                                      1, ids)
        if status != lib.RS_OK:
            self.unsynchronized.difference_update(claimed)
            self.raise_engine_error(status, "allreduce_")
        return Handle(comm, [ids[0]], keep, lambda: keep, "allreduce_", [prepared.name])

    def _cached_struct(self, src, name, op, prescale, postscale, what, blocking):
        if self.orphans:
            self.release_finished_orphans()
        key = (src.dtype, src.shape, op, prescale, postscale, blocking)
        try:
            return self._cache.struct(key, src, name, what)
        except UsageError as exc:
            self.refuse([name], lib.RS_KIND_ALLREDUCE, exc, blocking)
            raise

    def _submit_struct(self, comm, struct, src, out, name, what) -> Handle:
        self._refuse_if_closed(what)
        send = ffi.from_buffer(src)
        recv = send if out is src else ffi.from_buffer(out)
        struct.sendbuf, struct.recvbuf = send, recv
        cache = self._cache
        c_name, c_names, _ = cache.names.get(name) or cache.name(name)
        ids = ffi.new("int64_t[1]")
        claimed = self._claim((name,), what)
        status = lib.rs_engine_submit(self.ring.engine, c_names, struct, 1, ids)
        if status != lib.RS_OK:
            self.unsynchronized.difference_update(claimed)
            self.raise_engine_error(status, what)
        return Handle(comm, [ids[0]], (send, recv, c_name), lambda: out, what, [name])

    def _refuse_if_closed(self, what: str) -> None:
        """A call on a communicator that has been shut down (its engine is freed)."""
        if self.ring.closed:
            raise UsageError(f"ringsync.{what}: the communicator has been shut down")

    def _claim(self, names, what: str):
        """names, marked as submitted until synchronized; a UsageError (before anything is
        submitted) for one that still is."""
        for name in names:
            if name in self.unsynchronized:
                raise UsageError(f"ringsync.{what}: tensor '{name}' is already in flight on "
                                 f"rank {self.ring.rank}; synchronize it before submitting "
                                 "the name again")
        self.unsynchronized.update(names)
        return names

    def refuse(self, names, kind: int, error: Exception, blocking: bool) -> None:
        """A call failed its own checks here (error): make the peers' matching call fail
        too, naming this rank, instead of leaving it to wait for this rank, or (blocking,
        on the same-host lane) to be matched against this rank's next call. A blocking
        call of one tensor keeps its place in the call order, waiting until every rank has
        made that call; others are refused by name in the background."""
        if self.ring.closed:
            return
        single = blocking and len(names) == 1  # (a blocking group is matched by name)
        reason = str(error).encode("utf-8", "replace")
        for name in names:
            lib.rs_engine_refuse(self.ring.engine, name.encode(), kind, reason, int(single))

    def run_tune(self, comm, name: str, values) -> None:
        """A tune request (RS_KIND_TUNE), waited for: the settings travel as its shape."""
        self._refuse_if_closed("tune")
        struct = ffi.new("rs_request_t *")
        struct.kind, struct.start_now, struct.ndim = lib.RS_KIND_TUNE, 1, len(values)
        struct.shape[0:len(values)] = values
        c_name = ffi.new("char[]", name.encode())
        ids = ffi.new("int64_t[1]")
        status = lib.rs_engine_submit(self.ring.engine, ffi.new("const char *[1]", [c_name]),
                                      struct, 1, ids)
        if status != lib.RS_OK:
            self.raise_engine_error(status, "tune", name)
        self.synchronize(Handle(comm, [ids[0]], (struct, c_name), lambda: None, "tune", [name]))

    def _run_on_lane(self, request: Request, what: str) -> bool:
        """Post a blocking call on the same-host lane (no engine thread, no negotiation):
        True when the lane ran it; False when every rank found that the engine must (any
        collective but a small allreduce or a barrier): it then runs there, while a
        disagreement between ranks has already failed here."""
        struct = ffi.new("rs_request_t *")
        keep = fill_struct(struct, request)  # noqa: F841 (the pointers must outlive the call)
        ran = ffi.new("int *")
        status = lib.rs_engine_try_lane(self.ring.engine, request.name.encode(), struct, ran)
        if status != lib.RS_OK:  # (a usage error here: the ranks' posts disagreed, mostly)
            self.raise_engine_error(status, what, request.name, MismatchError)
        return bool(ran[0])

    # ---- dropped handles ----

    def adopt_orphan(self, ids, keep, names=()):
        """Keep a dropped pending handle's buffers (and its names) until the engine is done
        with them."""
        if self.ring.engine != ffi.NULL:
            self.orphans.append((list(ids), (keep, names)))
        else:
            self.unsynchronized.difference_update(names)

    def release_finished_orphans(self):
        """Free what dropped handles held, once the engine has finished with it (checked at
        each submission, so that their number stays bounded by what is still running)."""
        engine = self.ring.engine
        for _ in range(len(self.orphans)):
            ids, keep = self.orphans.popleft()
            if all(lib.rs_engine_poll(engine, h) != 0 for h in ids):
                for h in ids:
                    lib.rs_engine_release(engine, h)
                self.unsynchronized.difference_update(keep[1])
            else:
                self.orphans.append((ids, keep))

    # ---- waiting ----

    def poll(self, handle: Handle) -> bool:
        if handle._done:
            return True
        return all(lib.rs_engine_poll(self.ring.engine, h) == 1 for h in handle._ids)

    def synchronize(self, handle: Handle):
        entry, ids = self.ring.entry, handle._ids
        statuses = entry.wait(ids, _WAIT_SLICE_SECONDS)  # (None: every one succeeded)
        try:
            if statuses is not None:
                self._raise_for(handle, statuses)
            handle._result = handle._finish()
        finally:
            entry.release(ids)
            self.unsynchronized.difference_update(handle.names)
            # (dropping _finish breaks the cycle through closures that name the handle, so
            # the result is freed as soon as the caller lets go of it, not at the next gc)
            handle._done, handle._keep, handle._finish = True, None, None
        return handle._result

    def take_result(self, handle_id):
        """(data, rows, rows from each rank) of an allgather, alltoall or join."""
        data, rows = ffi.new("void **"), ffi.new("int64_t *")
        splits = np.empty(self.ring.size, dtype=np.int64)
        lib.rs_engine_take_result(self.ring.engine, handle_id, data, rows,
                                  ffi.cast("int64_t *", splits.ctypes.data))
        return data[0], int(rows[0]), splits

    # ---- errors ----

    def _raise_for(self, handle: Handle, statuses):
        for h, name, status in zip(handle._ids, handle.names, statuses):
            if status != lib.RS_OK:
                detail = native_text(lib.rs_engine_handle_error(self.ring.engine, h))
                if not detail:
                    detail = native_text(lib.rs_engine_last_error(self.ring.engine))
                # A usage error found after submission is one the ranks found together.
                raise self._noted(error_class(status, MismatchError)(
                    f"ringsync.{handle._what}{describe(name)} failed on rank "
                    f"{self.ring.rank}: {detail}"))

    def raise_engine_error(self, status, what, name=None, usage_kind=UsageError):
        detail = native_text(lib.rs_engine_last_error(self.ring.engine))
        raise self._noted(error_class(status, usage_kind)(
            f"ringsync.{what}{describe(name)} failed on rank {self.ring.rank}: {detail}"))

    def _noted(self, error: Exception) -> Exception:
        """error, once on_failure has seen it (a refusal of this rank's own arguments,
        a plain UsageError, tells nothing about the job)."""
        if self.on_failure is not None and type(error) is not UsageError:
            try:
                self.on_failure(error)
            except Exception:  # (a full disk must not hide the error itself)
                pass
        return error
