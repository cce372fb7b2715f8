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
