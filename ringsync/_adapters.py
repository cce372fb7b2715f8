"""What the framework adapters share, written once: the rules of the differentiable
collectives, and gradient compression by casting (each framework supplies only how to
read and change a tensor's dtype)."""
import itertools
import warnings
from typing import Optional

from .errors import UsageError
from .ops import ReduceOp


class InstanceNumbers:
    """Numbers for the objects of one kind (optimizers, modules) that name collectives, in
    construction order, counted per process set: an object that only a set's members build
    does not shift the numbers the other ranks give to their next ones."""

    def __init__(self):
        self._counters = {}

    def next(self, process_set) -> int:
        ranks = getattr(process_set, "ranks", None)
        key = tuple(ranks) if ranks is not None else id(process_set)
        return next(self._counters.setdefault(key, itertools.count()))


def checked_on_every_rank(collective: str, name, process_set, check, count=None):
    """check(): an adapter's own checks of a blocking call, made before the call reaches
    its communicator. One that fails here must fail the peers' same call too, instead of
    leaving them waiting for this rank (an op or shape only this rank has wrong): the call
    is refused on the communicator (Communicator.refuse_call), then the error goes on."""
    try:
        return check()
    except (TypeError, ValueError) as exc:
        from ._context import resolve  # (not at import: the core may not be built)
        from .errors import RingsyncError
        try:
            resolve(process_set).refuse_call(collective, name, exc, count)
        except RingsyncError:
            pass  # (not initialised, or not a member: there are no peers to tell)
        raise


def check_differentiable(op, what: str) -> None:
    """Only Sum and Average have a gradient that is itself a reduction."""
    if ReduceOp(op) not in (ReduceOp.SUM, ReduceOp.AVERAGE):
        raise UsageError(f"ringsync.{what}: the gradient of a {ReduceOp(op).name.title()} "
                         "reduction is not defined; use Sum or Average when gradients flow")


def resolve_op(average, op, what: str):
    """Horovod's rule for its two ways to say how to reduce: op (None: Average), or the
    deprecated average= (True: Average, False: Sum), never both."""
    if average is not None:
        if op is not None:
            raise UsageError(f"ringsync.{what}: the op parameter supersedes average; "
                             f"give only one of them")
        warnings.warn("Parameter `average` has been replaced with `op` and will be removed "
                      "in v1.0", DeprecationWarning, stacklevel=3)
        return ReduceOp.AVERAGE if average else ReduceOp.SUM
    return ReduceOp.AVERAGE if op is None else op


def groups_from_num_groups(num_groups, groups):
    """Horovod's deprecated num_groups=: a warning, and the groups it stands for."""
    if num_groups:
        warnings.warn("Parameter `num_groups` has been replaced by `groups` and will be "
                      "removed in v0.23.0.", DeprecationWarning, stacklevel=4)
        return num_groups if groups is None else groups
    return groups


def near_equal_runs(items, count: int):
    """items cut, in order, into `count` runs of nearly equal length (the first ones one
    longer): Horovod's groups=N."""
    from ._requests import even_split
    runs, start = [], 0
    for n in even_split(len(items), count):
        runs.append(list(items[start:start + n]))
        start += n
    return runs


def grad_name(name: Optional[str]) -> Optional[str]:
    """The name of the collective that carries the gradient of collective `name`."""
    return None if name is None else f"{name}.grad"


class Compressor:
    """compress(tensor) -> (tensor to reduce, context); decompress(tensor, context)."""

    @staticmethod
    def compress(tensor):
        return tensor, None

    @staticmethod
    def decompress(tensor, ctx):
        return tensor


class NoneCompressor(Compressor):
    """Tensors travel as they are."""


class CastCompressor(Compressor):
    """Floating-point tensors travel as `wire_dtype` and come back in their own dtype. A
    framework's subclass says how: is_floating(t), dtype_of(t) and cast(t, dtype)."""

    wire_dtype = None

    @classmethod
    def compress(cls, tensor):
        if cls.is_floating(tensor) and cls.dtype_of(tensor) != cls.wire_dtype:
            return cls.cast(tensor, cls.wire_dtype), cls.dtype_of(tensor)
        return tensor, None

    @classmethod
    def decompress(cls, tensor, ctx):
        return tensor if ctx is None else cls.cast(tensor, ctx)

    @staticmethod
    def is_floating(tensor) -> bool:
        raise NotImplementedError

    @staticmethod
    def dtype_of(tensor):
        return tensor.dtype

    @staticmethod
    def cast(tensor, dtype):
        raise NotImplementedError


def cast_compression(module: str, is_floating, cast, fp16_dtype, bf16_dtype):
    """A framework's (FP16Compressor, BF16Compressor, Compression), Horovod's names:
    is_floating(tensor) -> bool and cast(tensor, dtype) are all that differ."""
    base = type("CastCompressor", (CastCompressor,),
                {"is_floating": staticmethod(is_floating), "cast": staticmethod(cast),
                 "__module__": module})
    fp16 = type("FP16Compressor", (base,), {"wire_dtype": fp16_dtype, "__module__": module})
    bf16 = type("BF16Compressor", (base,), {"wire_dtype": bf16_dtype, "__module__": module})
    compression = type("Compression", (), {"none": NoneCompressor, "fp16": fp16, "bf16": bf16,
                                           "__module__": module,
                                           "__doc__": "Horovod's gradient compressions."})
    return fp16, bf16, compression
