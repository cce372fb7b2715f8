"""Arrays in and out of the native core: numpy, or anything with the buffer protocol."""
from typing import Optional

import numpy as np

from ._native import ffi, lib
from .errors import UsageError

# dtype name -> native code. Reductions take all but bool, which is only moved.
DTYPE_CODES = {
    "uint8": lib.RS_UINT8,
    "int8": lib.RS_INT8,
    "uint16": lib.RS_UINT16,
    "int16": lib.RS_INT16,
    "int32": lib.RS_INT32,
    "int64": lib.RS_INT64,
    "float16": lib.RS_FLOAT16,
    "bfloat16": lib.RS_BFLOAT16,
    "float32": lib.RS_FLOAT32,
    "float64": lib.RS_FLOAT64,
    "bool": lib.RS_BOOL,
}
REDUCIBLE = [name for name in DTYPE_CODES if name != "bool"]
# The same, keyed by dtype object: dtype.name builds a new string on every call (slow).
_CODE_BY_DTYPE = {np.dtype(name): code for name, code in DTYPE_CODES.items() if name != "bfloat16"}


def describe(name: Optional[str]) -> str:
    return f" for tensor '{name}'" if name else ""


def _buffer_array(x) -> Optional[np.ndarray]:
    """x as an array without a copy (arrays as they are, buffers through memoryview),
    or None when x exposes no buffer."""
    if isinstance(x, np.ndarray):
        return x
    if isinstance(x, np.generic):  # a numpy scalar: 0-d, not the 1-d its memoryview gives
        return np.asarray(x)
    try:
        return np.asarray(memoryview(x))
    except TypeError:
        return None


def _reject_objects(arr: np.ndarray, what: str, name: Optional[str]) -> np.ndarray:
    if arr.dtype.hasobject:
        raise UsageError(f"ringsync.{what}: object arrays are not supported{describe(name)}")
    return arr


def as_input(x, what: str, name: Optional[str]) -> np.ndarray:
    """A C-contiguous array view of x (copied only if it is not contiguous)."""
    arr = _buffer_array(x)
    arr = np.asarray(x) if arr is None else arr
    arr = _reject_objects(arr, what, name)
    # (np.ascontiguousarray would turn a 0-d array into a 1-d one)
    return arr if arr.flags.c_contiguous else arr.copy(order="C")


def as_output(x, what: str, name: Optional[str]) -> np.ndarray:
    """The array an in-place call writes to: it must be writable and C-contiguous."""
    if isinstance(x, np.generic):  # (its array would be a copy: the result would be lost)
        raise UsageError(f"ringsync.{what}: in-place output{describe(name)} is a numpy scalar "
                         f"({type(x).__name__}), which cannot be changed; pass a 0-d array "
                         "(np.asarray(x)) or use the out-of-place call")
    arr = _buffer_array(x)
    if arr is None:
        raise UsageError(f"ringsync.{what}: in-place output{describe(name)} must be a numpy "
                         f"array or a writable buffer, got {type(x).__name__}")
    _reject_objects(arr, what, name)
    if not arr.flags.writeable:
        raise UsageError(f"ringsync.{what}: output{describe(name)} is read-only")
    if not arr.flags.c_contiguous:
        raise UsageError(f"ringsync.{what}: output{describe(name)} is not C-contiguous "
                         f"(shape {arr.shape}, strides {arr.strides}); pass "
                         "np.ascontiguousarray(x) and copy back, or use the out-of-place call")
    return arr


def dtype_code(arr: np.ndarray, what: str, name: Optional[str], reduces: bool) -> int:
    code = _CODE_BY_DTYPE.get(arr.dtype)
    if code is None and arr.dtype.name == "bfloat16":  # ml_dtypes' type, once seen
        code = _CODE_BY_DTYPE[arr.dtype] = lib.RS_BFLOAT16
    if code is None or (reduces and code == lib.RS_BOOL):
        allowed = REDUCIBLE if reduces else list(DTYPE_CODES)
        raise UsageError(f"ringsync.{what}: unsupported dtype {arr.dtype.name}{describe(name)}; "
                         f"supported: {', '.join(allowed)}")
    return code


def pointer(arr: np.ndarray):
    """The array's memory for the core; the returned object keeps the array alive."""
    return ffi.from_buffer(arr)


def wrap_native_result(data, rows: int, row_shape, dtype) -> np.ndarray:
    """An array over memory the core allocated; freed with it when the array goes away."""
    owned = ffi.gc(data, lib.rs_free)
    nbytes = rows * int(np.prod(row_shape, dtype=np.int64)) * np.dtype(dtype).itemsize
    flat = np.frombuffer(ffi.buffer(owned, nbytes), dtype=dtype)
    return flat.reshape((rows,) + tuple(row_shape))
