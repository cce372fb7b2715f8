"""Communicator: the Python face of one native ring communicator.

Arrays go in through numpy (anything with the buffer protocol works); the native core
does the moving and reducing with the GIL released (cffi releases it on every call).
"""
import dataclasses
import socket
from typing import Optional, Sequence

import numpy as np

from . import bootstrap
from .config import Config
from .errors import CommunicationError, CommunicationTimeout, UsageError

from ._native import ffi, lib
from .ops import ReduceOp

assert [int(o) for o in ReduceOp] == [lib.RS_OP_SUM, lib.RS_OP_AVERAGE, lib.RS_OP_MIN,
                                      lib.RS_OP_MAX, lib.RS_OP_PRODUCT], "ReduceOp != ringsync.h"


# dtype name -> native code, for the collectives that reduce.
_REDUCIBLE = {
    "uint8": lib.RS_UINT8,
    "int8": lib.RS_INT8,
    "int32": lib.RS_INT32,
    "int64": lib.RS_INT64,
    "float16": lib.RS_FLOAT16,
    "bfloat16": lib.RS_BFLOAT16,
    "float32": lib.RS_FLOAT32,
    "float64": lib.RS_FLOAT64,
}
# Collectives that only move bytes also take bool; the index is a dtype code for checks.
_MOVABLE = list(_REDUCIBLE) + ["bool"]

_STATUS_ERRORS = {
    lib.RS_ERR_USAGE: UsageError,
    lib.RS_ERR_NOMEM: MemoryError,
    lib.RS_ERR_COMM: CommunicationError,
    lib.RS_ERR_TIMEOUT: CommunicationTimeout,
    lib.RS_ERR_SYSTEM: CommunicationError,
}


def _describe(name: Optional[str]) -> str:
    return f" for tensor '{name}'" if name else ""


def _for_name(name: Optional[str]) -> str:
    return f" for '{name}'" if name else ""


def _buffer_array(x) -> Optional[np.ndarray]:
    """x as an array without a copy (arrays as they are, buffers through memoryview),
    or None when x exposes no buffer."""
    if isinstance(x, np.ndarray):
        return x
    try:
        return np.asarray(memoryview(x))
    except TypeError:
        return None


def _reject_objects(arr: np.ndarray, what: str, name: Optional[str]) -> np.ndarray:
    if arr.dtype.hasobject:
        raise UsageError(f"ringsync.{what}: object arrays are not supported{_describe(name)}")
    return arr


def as_input(x, what: str, name: Optional[str]) -> np.ndarray:
    """A C-contiguous array view of x (copied only if it is not contiguous)."""
    arr = _buffer_array(x)
    arr = np.asarray(x) if arr is None else arr
    return np.ascontiguousarray(_reject_objects(arr, what, name))


def as_output(x, what: str, name: Optional[str]) -> np.ndarray:
    """The array an in-place call writes to: it must be writable and C-contiguous."""
    arr = _buffer_array(x)
    if arr is None:
        raise UsageError(f"ringsync.{what}: in-place output{_describe(name)} must be a numpy "
                         f"array or a writable buffer, got {type(x).__name__}")
    _reject_objects(arr, what, name)
    if not arr.flags.writeable:
        raise UsageError(f"ringsync.{what}: output{_describe(name)} is read-only")
    if not arr.flags.c_contiguous:
        raise UsageError(f"ringsync.{what}: output{_describe(name)} is not C-contiguous "
                         f"(shape {arr.shape}, strides {arr.strides}); pass "
                         "np.ascontiguousarray(x) and copy back, or use the out-of-place call")
    return arr


def reducible_dtype(arr: np.ndarray, what: str, name: Optional[str]) -> int:
    code = _REDUCIBLE.get(arr.dtype.name)
    if code is None:
        raise UsageError(f"ringsync.{what}: unsupported dtype {arr.dtype.name}{_describe(name)}; "
                         f"supported: {', '.join(_REDUCIBLE)}")
    return code


def movable_dtype(arr: np.ndarray, what: str, name: Optional[str]) -> int:
    if arr.dtype.name not in _MOVABLE:
        raise UsageError(f"ringsync.{what}: unsupported dtype {arr.dtype.name}{_describe(name)}; "
                         f"supported: {', '.join(_MOVABLE)}")
    return _MOVABLE.index(arr.dtype.name)


def as_op(op, what: str) -> int:
    try:
        return int(ReduceOp(op))
    except ValueError:
        raise UsageError(f"ringsync.{what}: unknown reduction op {op!r}; use one of "
                         f"{', '.join(o.name.title() for o in ReduceOp)}") from None


def pointer(arr: np.ndarray):
    return ffi.cast("void *", arr.ctypes.data)


def int64_array(values) -> np.ndarray:
    return np.ascontiguousarray(values, dtype=np.int64)


class Communicator:
    """A ring of ranks built over an mpi4py intracommunicator.

    Holds its own native context; several can exist in one process.
    """

    def __init__(self, mpi_comm=None, config: Optional[Config] = None):
        from mpi4py import MPI

        mpi_comm = MPI.COMM_WORLD if mpi_comm is None else mpi_comm
        if not isinstance(mpi_comm, MPI.Intracomm):
            raise UsageError(f"ringsync.init: comm must be an mpi4py intracommunicator, "
                             f"got {type(mpi_comm).__name__}")
        self.config = config or Config.from_env()
        self._mpi = mpi_comm.Dup()  # our bootstrap traffic never mixes with the user's
        self._rank, self._size = self._mpi.Get_rank(), self._mpi.Get_size()
        self._c = ffi.NULL
        try:
            self._connect()
        except BaseException:
            self._destroy_native()
            self._mpi.Free()
            raise

    # ---- setup and teardown ----

    def _connect(self):
        # Errors travel through the allgather instead of being raised here: a rank that
        # raised before it would leave its peers waiting in MPI forever.
        me, local_error, bound_all = self._open_listener()
        peers = self._mpi.allgather((me, local_error))
        self._raise_if_any_failed([err for _, err in peers], "setting up the listening socket")
        infos = [info for info, _ in peers]
        self.host_names = [p.host_name for p in infos]
        self.topology = bootstrap.topology(self.host_names, self._rank)
        self._connect_ring(infos, me.host_name, bound_all)

    def _open_listener(self):
        """(this rank's PeerInfo, an error text or None, whether it listens on all interfaces)."""
        me = bootstrap.PeerInfo(socket.gethostname(), "", 0, bootstrap.new_token())
        try:
            bind_host, advertised = bootstrap.listen_addresses(self.config.iface)
        except UsageError as e:
            return me, ("usage", f"rank {self._rank}: {e}"), False
        cptr, port = ffi.new("rs_comm_t **"), ffi.new("int *")
        status = lib.rs_comm_create(self._rank, self._size, bind_host.encode(),
                                    self.config.timeout_seconds, cptr, port)
        self._c = cptr[0]
        me = dataclasses.replace(me, address=advertised, port=port[0])
        return me, self._error_text(status, "creating the ring"), bind_host == ""

    def _connect_ring(self, infos, my_host, bound_all):
        addresses = bootstrap.connect_addresses(infos, my_host, bound_all)
        keep = [ffi.new("char[]", s.encode()) for s in addresses + self.host_names]
        hosts, names = keep[: self._size], keep[self._size:]
        status = lib.rs_comm_connect(self._c, ffi.new("const char *[]", hosts),
                                     ffi.new("int[]", [p.port for p in infos]),
                                     ffi.new("const char *[]", names), infos[0].token)
        errors = self._mpi.allgather(self._error_text(status, "connecting the ring"))
        self._raise_if_any_failed(errors, "connecting the ring")

    def _error_text(self, status, what):
        """None, or (kind, text) for the allgather that tells every rank who failed."""
        if status == lib.RS_OK:
            return None
        detail = ffi.string(lib.rs_comm_last_error(self._c)).decode() if self._c else ""
        kind = "usage" if status == lib.RS_ERR_USAGE else "comm"
        return kind, f"rank {self._rank}: {what} failed (status {status}): {detail}"

    def _raise_if_any_failed(self, errors, what):
        """Every rank raises together: a usage error if all failures were bad settings."""
        failed = [e for e in errors if e]
        if failed:
            cls = UsageError if all(kind == "usage" for kind, _ in failed) else CommunicationError
            raise cls(f"ringsync.init: {what} failed: " + "; ".join(text for _, text in failed))

    def _destroy_native(self):
        if self._c != ffi.NULL:
            lib.rs_comm_destroy(self._c)
            self._c = ffi.NULL

    def shutdown(self):
        """Close the ring. Waits (bounded by the timeout) until every healthy rank gets
        here, so that no rank's exit looks like a failure to a peer still finishing."""
        if self._c == ffi.NULL:
            return
        if not lib.rs_comm_is_broken(self._c):
            lib.rs_barrier(self._c)  # best effort: a failure here changes nothing
        self._destroy_native()
        self._mpi.Free()

    def abort(self):
        """Break every connection now so that peers see this rank as failed."""
        if self._c != ffi.NULL:
            lib.rs_comm_abort(self._c)

    @property
    def closed(self) -> bool:
        return self._c == ffi.NULL

    def _check(self, status, what: str, name: Optional[str] = None):
        if status == lib.RS_OK:
            return
        detail = ffi.string(lib.rs_comm_last_error(self._c)).decode()
        raise _STATUS_ERRORS.get(status, CommunicationError)(
            f"ringsync.{what}{_describe(name)} failed on rank {self._rank}: {detail}")

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

    # ---- collectives ----

    def allreduce_(self, x, op=ReduceOp.AVERAGE, prescale_factor=1.0, postscale_factor=1.0,
                   name=None):
        """Reduce x over all ranks, in place; returns x's array."""
        out = as_output(x, "allreduce_", name)
        self._allreduce(out, out, op, prescale_factor, postscale_factor, name, "allreduce_")
        return out

    def allreduce(self, x, op=ReduceOp.AVERAGE, prescale_factor=1.0, postscale_factor=1.0,
                  name=None):
        """Reduce x over all ranks into a new array of the same shape and dtype."""
        src = as_input(x, "allreduce", name)
        out = np.empty_like(src)
        return self._allreduce(src, out, op, prescale_factor, postscale_factor, name, "allreduce")

    def _allreduce(self, src, out, op, prescale, postscale, name, what):
        dtype = reducible_dtype(src, what, name)
        code = as_op(op, what)
        self._check(lib.rs_allreduce(self._c, pointer(src), pointer(out), src.size, dtype, code,
                                     float(prescale), float(postscale)), what, name)
        return out

    def allgather(self, x, name=None):
        """Concatenate every rank's x along the first dimension, which may differ by rank."""
        src = as_input(x, "allgather", name)
        if src.ndim == 0:
            src = src.reshape(1)
        rows = self._check_same_layout(src, "allgather", name)
        out = np.empty((int(rows.sum()),) + src.shape[1:], dtype=src.dtype)
        row_elems = int(np.prod(src.shape[1:], dtype=np.int64))
        counts = int64_array(rows * row_elems)
        self._check(lib.rs_allgatherv(self._c, pointer(src), pointer(out),
                                      ffi.cast("int64_t *", counts.ctypes.data), src.itemsize),
                    "allgather", name)
        return out

    _LAYOUT_DIMS = 8

    def _gather_records(self, record: np.ndarray, what: str) -> np.ndarray:
        """Every rank's fixed-size int64 record, in rank order."""
        table = np.empty((self._size, record.size), dtype=np.int64)
        counts = int64_array([record.size] * self._size)
        self._check(lib.rs_allgatherv(self._c, pointer(record), pointer(table),
                                      ffi.cast("int64_t *", counts.ctypes.data), 8), what)
        return table

    def _check_same_layout(self, src: np.ndarray, what: str, name) -> np.ndarray:
        """Check that every rank passes the same dtype and trailing shape; return each
        rank's first dimension. Every rank sees the same table, so all raise together."""
        trailing = src.shape[1:]
        if len(trailing) > self._LAYOUT_DIMS:
            raise UsageError(f"ringsync.{what}: at most {self._LAYOUT_DIMS + 1} dimensions")
        record = int64_array([src.shape[0], movable_dtype(src, what, name), len(trailing)]
                             + list(trailing) + [-1] * (self._LAYOUT_DIMS - len(trailing)))
        table = self._gather_records(record, what)
        for r in range(self._size):
            if not np.array_equal(table[r, 1:], table[0, 1:]):
                raise UsageError(
                    f"Mismatched {what} tensors{_for_name(name)}: rank 0 sent "
                    f"{_layout_text(table[0])}, rank {r} sent {_layout_text(table[r])}")
        return table[:, 0]

    def broadcast_(self, x, root_rank, name=None):
        """Overwrite x on every rank with root_rank's x, in place; returns x's array."""
        out = as_output(x, "broadcast_", name)
        return self._broadcast(out, root_rank, name, "broadcast_")

    def broadcast(self, x, root_rank, name=None):
        """A new array holding root_rank's x on every rank."""
        out = np.array(as_input(x, "broadcast", name), copy=True)
        return self._broadcast(out, root_rank, name, "broadcast")

    def _broadcast(self, out, root_rank, name, what):
        movable_dtype(out, what, name)
        if not isinstance(root_rank, (int, np.integer)) or not 0 <= root_rank < self._size:
            raise UsageError(f"ringsync.{what}: root_rank {root_rank!r}{_describe(name)} is out "
                             f"of range for {self._size} ranks (rank {self._rank})")
        self._check(lib.rs_broadcast(self._c, pointer(out), out.nbytes, int(root_rank)), what, name)
        return out

    def reducescatter(self, x, op=ReduceOp.AVERAGE, prescale_factor=1.0, postscale_factor=1.0,
                      name=None):
        """Reduce x over all ranks and give rank r the r-th slice of the first dimension
        (split as evenly as possible, the first ranks taking one more row)."""
        src = as_input(x, "reducescatter", name)
        if src.ndim == 0:
            raise UsageError(f"ringsync.reducescatter{_describe(name)}: needs at least one dimension")
        dtype = reducible_dtype(src, "reducescatter", name)
        code = as_op(op, "reducescatter")
        rows = even_split(src.shape[0], self._size)
        row_elems = int(np.prod(src.shape[1:], dtype=np.int64))
        out = np.empty((rows[self._rank],) + src.shape[1:], dtype=src.dtype)
        counts = int64_array(np.asarray(rows) * row_elems)
        self._check(lib.rs_reducescatter(self._c, pointer(src), pointer(out),
                                         ffi.cast("int64_t *", counts.ctypes.data), dtype, code,
                                         float(prescale_factor), float(postscale_factor)),
                    "reducescatter", name)
        return out

    def alltoall(self, x, splits=None, name=None):
        """Send splits[i] rows of x (in rank order) to rank i and receive every rank's rows
        for this rank, concatenated in rank order. Returns (output, received_splits)
        when splits is given, as Horovod does; otherwise the output only."""
        src = as_input(x, "alltoall", name)
        if src.ndim == 0:
            raise UsageError(f"ringsync.alltoall{_describe(name)}: needs at least one dimension")
        send_rows = self._alltoall_splits(src, splits, name)
        row_bytes = int(np.prod(src.shape[1:], dtype=np.int64)) * src.itemsize
        recv_rows = self._exchange_splits(src, send_rows, row_bytes, name)
        out = np.empty((int(recv_rows.sum()),) + src.shape[1:], dtype=src.dtype)
        send_bytes, recv_bytes = send_rows * row_bytes, recv_rows * row_bytes
        self._check(lib.rs_alltoallv(self._c, pointer(src),
                                     ffi.cast("int64_t *", send_bytes.ctypes.data), pointer(out),
                                     ffi.cast("int64_t *", recv_bytes.ctypes.data)),
                    "alltoall", name)
        return out if splits is None else (out, recv_rows)

    def _alltoall_splits(self, src, splits, name) -> np.ndarray:
        if splits is None:
            if src.shape[0] % self._size:
                raise UsageError(f"ringsync.alltoall{_describe(name)}: first dimension "
                                 f"{src.shape[0]} is not divisible by {self._size} ranks; "
                                 "pass splits=")
            return int64_array([src.shape[0] // self._size] * self._size)
        rows = int64_array(np.asarray(splits).reshape(-1))
        if rows.size != self._size or (rows < 0).any() or rows.sum() != src.shape[0]:
            raise UsageError(f"ringsync.alltoall{_describe(name)}: splits {rows.tolist()} on rank "
                             f"{self._rank} must be {self._size} non-negative numbers summing "
                             f"to the first dimension {src.shape[0]}")
        return rows

    def _exchange_splits(self, src, send_rows, row_bytes, name) -> np.ndarray:
        """Tell each rank how many rows it gets from us; check dtypes and row sizes agree."""
        mine = [movable_dtype(src, "alltoall", name), row_bytes]
        records = int64_array([[rows] + mine for rows in send_rows])
        got = np.empty_like(records)
        per_peer = int64_array([records.shape[1] * 8] * self._size)
        self._check(lib.rs_alltoallv(self._c, pointer(records),
                                     ffi.cast("int64_t *", per_peer.ctypes.data), pointer(got),
                                     ffi.cast("int64_t *", per_peer.ctypes.data)),
                    "alltoall", name)
        for r in range(self._size):
            if list(got[r, 1:]) != mine:
                raise UsageError(
                    f"Mismatched alltoall tensors{_for_name(name)}: rank {self._rank} sent "
                    f"dtype {_MOVABLE[mine[0]]} with {mine[1]} bytes per row, rank {r} sent "
                    f"dtype {_MOVABLE[got[r, 1]]} with {got[r, 2]} bytes per row")
        return np.ascontiguousarray(got[:, 0])

    def barrier(self):
        self._check(lib.rs_barrier(self._c), "barrier")


def even_split(n: int, parts: int) -> Sequence[int]:
    """n split into `parts` nearly equal parts, the first n % parts one larger."""
    return [n // parts + (i < n % parts) for i in range(parts)]


def _layout_text(record: np.ndarray) -> str:
    ndim = int(record[2])
    trailing = [int(d) for d in record[3:3 + ndim]]
    return f"dtype {_MOVABLE[int(record[1])]} with rows of shape {trailing}"
