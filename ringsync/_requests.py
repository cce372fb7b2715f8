"""What a collective's arguments become before they reach the engine: checked buffers and
requests (Request, from _submit.py), bundled with how to finish the call into a Call.

The functions here need nothing of a communicator but the numbers they are given (this
rank, the ring's size, a resolved root), so Communicator and its grouped calls share them.
"""
from typing import Callable, List, NamedTuple, Sequence

import numpy as np

from ._arrays import as_input, as_output, describe, wrap_native_result
from ._native import lib
from ._submit import Request, make_request
from .errors import UsageError

IN_PLACE = object()  # an allreduce's `out` for an in-place call


class Call(NamedTuple):
    """A collective's requests and how to finish it, ready for the blocking entry point
    (Submitter.run) or the asynchronous one (Submitter.start). takes: finish receives the
    results the native core holds (allgather, alltoall, join)."""
    requests: List[Request]
    finish: Callable
    what: str
    takes: bool = False


def even_split(n: int, parts: int) -> Sequence[int]:
    """n split into `parts` nearly equal parts, the first n % parts one larger."""
    return [n // parts + (i < n % parts) for i in range(parts)]


def allreduce_buffers(x, out, what, name):
    """(src, out) of an allreduce of x, checked. out: None (a new array), IN_PLACE (x
    itself) or the caller's output array."""
    if out is IN_PLACE:
        src = as_output(x, what, name)
        return src, src
    src = as_input(x, what, name)
    return src, (np.empty_like(src) if out is None else output_like(src, out, name))


def output_like(src, out, name):
    """The caller's output array for an allreduce of src, checked."""
    out = as_output(out, "allreduce", name)
    if out.dtype != src.dtype or out.shape != src.shape:
        raise UsageError(f"ringsync.allreduce{describe(name)}: out is {out.dtype} "
                         f"{out.shape}, the input {src.dtype} {src.shape}")
    # The ring writes out while it still reads the input: memory they share must be all
    # of both (an in-place reduction), not a part (that would read what it wrote).
    if out is not src and np.may_share_memory(src, out) and \
            out.ctypes.data != src.ctypes.data:
        raise UsageError(f"ringsync.allreduce{describe(name)}: out overlaps the input "
                         "without being the same memory; pass separate arrays, or the input "
                         "itself for an in-place result")
    return out


def allgather_request(x, name, what, blocking):
    """The request, and how to turn its result (data, rows, splits) into an array."""
    src = as_input(x, what, name)
    src = src.reshape(1) if src.ndim == 0 else src
    request = make_request(what, lib.RS_KIND_ALLGATHER, name, src, None, blocking=blocking)
    return request, lambda result: wrap_native_result(result[0], result[1], src.shape[1:],
                                                      src.dtype)


def broadcast_request(x, root, name, what, blocking):
    """root: the root's rank on this ring (already resolved from the caller's numbering).
    broadcast_ overwrites x itself; broadcast works in a copy."""
    out = (as_output(x, what, name) if what == "broadcast_"
           else np.array(as_input(x, what, name), copy=True))
    return make_request(what, lib.RS_KIND_BROADCAST, name, out, out, root=root,
                        blocking=blocking)


def reducescatter_request(x, code, prescale, postscale, name, what, blocking, rank, size):
    """The request and the output array: this rank's share of the first dimension.
    reducescatter_ (in place) works in x itself: the share is a view of x's first rows."""
    in_place = what.endswith("_")
    src = as_output(x, what, name) if in_place else as_input(x, what, name)
    if src.ndim == 0:
        raise UsageError(f"ringsync.{what}{describe(name)}: needs at least one dimension")
    rows = even_split(src.shape[0], size)[rank]
    out = src if in_place else np.empty((rows,) + src.shape[1:], dtype=src.dtype)
    return make_request(what, lib.RS_KIND_REDUCESCATTER, name, src, out, op=code,
                        prescale=prescale, postscale=postscale, reduces=True,
                        blocking=blocking), out[:rows]


def alltoall_request(x, splits, name, blocking, rank, size):
    """The request, and how to turn its result (data, rows, rows from each rank) into the
    call's: the rows received, and with splits (as in Horovod) the rows from each rank."""
    src = as_input(x, "alltoall", name)
    if src.ndim == 0:
        raise UsageError(f"ringsync.alltoall{describe(name)}: needs at least one dimension")
    rows = None
    if splits is not None:
        rows = np.ascontiguousarray(np.asarray(splits).reshape(-1), dtype=np.int64)
        if rows.size != size:
            raise UsageError(f"ringsync.alltoall{describe(name)}: splits {rows.tolist()} on "
                             f"rank {rank} must have one entry per rank ({size})")
    elif src.shape[0] % size:
        # Horovod's rule (a ValueError there too): no even split, no silent uneven one.
        raise UsageError(f"ringsync.alltoall{describe(name)}: the first dimension "
                         f"({src.shape[0]}) on rank {rank} is not divisible by the "
                         f"{size} ranks; pass splits")
    request = make_request("alltoall", lib.RS_KIND_ALLTOALL, name, src, None, splits=rows,
                           blocking=blocking)

    def finish(result):
        data, received, from_each = result
        out = wrap_native_result(data, received, src.shape[1:], src.dtype)
        return out if splits is None else (out, from_each)

    return request, finish
