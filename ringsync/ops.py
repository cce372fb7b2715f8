"""Reduction operations. Pure Python so that `import ringsync` works (for `ringsync doctor`)
even where the native core is not built; _core checks these against the C header."""
import enum


class ReduceOp(enum.IntEnum):
    SUM = 0
    AVERAGE = 1
    MIN = 2
    MAX = 3
    PRODUCT = 4
    # Adaptive summation (floating point allreduce only): see README "Adasum".
    ADASUM = 5


_OP_CODES = {op: int(op) for op in ReduceOp}


def as_op(op, what: str) -> int:
    """The native code of a reduction op given as a ReduceOp or its number."""
    code = _OP_CODES.get(op)  # the common case, without enum construction
    if code is not None:
        return code
    from .errors import UsageError
    try:
        return int(ReduceOp(op))
    except ValueError:
        raise UsageError(f"ringsync.{what}: unknown reduction op {op!r}; use one of "
                         f"{', '.join(o.name.title() for o in ReduceOp)}") from None
