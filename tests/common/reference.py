"""Inputs that differ by rank and position, and numpy references built from all ranks'
inputs. Every rank can compute every other rank's input, so each checks the full result."""
import zlib

import numpy as np

try:  # bfloat16 comes with ml_dtypes (a TensorFlow / JAX dependency) when installed
    from ml_dtypes import bfloat16
except ImportError:  # pragma: no cover
    bfloat16 = None

INT_DTYPES = ["uint8", "int8", "uint16", "int16", "int32", "int64"]
FLOAT_DTYPES = ["float16", "float32", "float64"] + (["bfloat16"] if bfloat16 else [])
REDUCIBLE = INT_DTYPES + FLOAT_DTYPES
MOVABLE = REDUCIBLE + ["bool"]
OPS = ["Sum", "Average", "Min", "Max", "Product"]
# 0, 1, 2, primes, and sizes not divisible by 2, 3 or 4.
SIZES = [0, 1, 2, 3, 5, 7, 13, 101, 1009]
# Machine epsilon of the type the ring leaves results in, for tolerances.
EPS = {"float16": 2.0**-10, "bfloat16": 2.0**-7, "float32": 2.0**-23, "float64": 2.0**-52}
# Smallest normal numbers: below them a product loses its relative precision (on 32 ranks
# a float16 product of factors near 0.5 underflows to 0 where float64 says 3e-11).
TINY = {"float16": 2.0**-14, "bfloat16": 2.0**-126, "float32": 2.0**-126,
        "float64": 2.0**-1022}
# Largest finite numbers: past them a product is rightly infinite.
HUGE = {"float16": 65504.0, "bfloat16": 3.39e38, "float32": 3.4e38, "float64": 1.79e308}


def dtype_of(name):
    return np.dtype(bfloat16) if name == "bfloat16" else np.dtype(name)


def rank_input(rank, shape, dtype, op="Sum", salt=""):
    """Deterministic data that differs by rank and index. Products use values near 1 so
    floating results stay finite; integers cover negatives and wrap-around."""
    seed = zlib.crc32(f"{rank}/{shape}/{dtype}/{op}/{salt}".encode())
    rng = np.random.default_rng(seed)
    dt = dtype_of(dtype)
    if dtype == "bool":
        return rng.integers(0, 2, size=shape).astype(bool)
    if dtype in INT_DTYPES:
        info = np.iinfo(dt)
        low, high = max(info.min, -10**6), min(info.max, 10**6)
        return rng.integers(low, high, size=shape, endpoint=True).astype(dt)
    if op == "Product":
        return rng.uniform(0.5, 1.5, size=shape).astype(dt)
    return rng.uniform(-4.0, 4.0, size=shape).astype(dt)


def scale(x, factor):
    """What the core does to scale: float16/bfloat16 in float32; integers through float64,
    truncated toward zero."""
    if factor == 1.0:
        return x
    if x.dtype.kind in "iu":
        return (x.astype(np.float64) * factor).astype(x.dtype)
    if x.dtype == np.float64:
        return x * factor
    return (x.astype(np.float32) * np.float32(factor)).astype(x.dtype)


def reduce_exact(inputs, op):
    """Reduce in the inputs' own dtype for integers (wrapping as C does), in float64 for floats."""
    dt = inputs[0].dtype
    work = [x if dt.kind in "iu" else x.astype(np.float64) for x in inputs]
    out = work[0].copy()
    for x in work[1:]:
        if op in ("Sum", "Average"):
            out = out + x
        elif op == "Product":
            out = out * x
        elif op == "Min":
            out = np.minimum(out, x)
        else:
            out = np.maximum(out, x)
    return out


def reference_allreduce(inputs, op, prescale=1.0, postscale=1.0):
    n = len(inputs)
    with np.errstate(over="ignore"):
        out = reduce_exact([scale(x, prescale) for x in inputs], op)
        if out.dtype.kind in "iu":
            if op == "Average":
                wide = out.astype(np.int64)  # -128 has no int8 absolute value
                out = (np.sign(wide) * (np.abs(wide) // n)).astype(out.dtype)
            return scale(out, postscale)
        if op == "Average":
            out = out / n
        return out * postscale


def assert_reduced(got, inputs, op, prescale=1.0, postscale=1.0, what=""):
    ref = reference_allreduce(inputs, op, prescale, postscale)
    assert got.dtype == inputs[0].dtype, f"{what}: dtype {got.dtype} != {inputs[0].dtype}"
    assert got.shape == ref.shape, f"{what}: shape {got.shape} != {ref.shape}"
    if got.dtype.kind in "iu":
        bad = np.flatnonzero(got.reshape(-1) != ref.reshape(-1))
    else:
        # The ring rounds to the result dtype after every step: allow a few ulps of the
        # magnitudes involved.
        eps = EPS[got.dtype.name]
        magnitude = sum(np.abs(scale(x, prescale).astype(np.float64)) for x in inputs)
        if op == "Product":
            magnitude = np.abs(ref)
        tol = 4 * len(inputs) * eps * (np.abs(magnitude * postscale) + np.abs(ref)) + 1e-300
        if op == "Product":
            tol = tol + 4 * len(inputs) * TINY[got.dtype.name] * max(1.0, abs(postscale))
        wrong = np.abs(got.astype(np.float64) - ref) > tol
        if op == "Product":  # overflowed in the dtype, as it must
            # (partial products, in whatever order the ring takes, may pass the limit first)
            wrong &= ~(np.isinf(got) & (np.abs(ref) >= HUGE[got.dtype.name] / 16))
        bad = np.flatnonzero(wrong.reshape(-1))
    if bad.size:
        i = bad[0]
        raise AssertionError(f"{what}: {bad.size} of {got.size} elements differ; first at flat "
                             f"index {i}: got {got.reshape(-1)[i]!r}, expected {ref.reshape(-1)[i]!r}")


def adasum_pair(a, b):
    """Adasum's combination of two float64 vectors: each keeps coefficient 1 when its squared
    norm is below sqrt(DBL_MIN) (a zero vector leaves the other as it is)."""
    floor = np.sqrt(np.finfo(np.float64).tiny)
    dot, aa, bb = float(a @ b), float(a @ a), float(b @ b)
    ca = 1.0 - dot / (2.0 * aa) if aa >= floor else 1.0
    cb = 1.0 - dot / (2.0 * bb) if bb >= floor else 1.0
    return ca * a + cb * b


def reference_adasum(inputs, prescale=1.0, postscale=1.0):
    """Adasum over all ranks' inputs in float64, in the core's tree order: with P the largest
    power of two <= n, rank r >= P is first combined into rank r - P; then pairs (0, 1),
    (2, 3), ..., then pairs of those results, up to one vector."""
    vectors = [scale(x, prescale).astype(np.float64).reshape(-1) for x in inputs]
    p = 1 << (len(vectors).bit_length() - 1)
    for r in range(p, len(vectors)):
        vectors[r - p] = adasum_pair(vectors[r - p], vectors[r])
    vectors = vectors[:p]
    while len(vectors) > 1:
        vectors = [adasum_pair(vectors[i], vectors[i + 1]) for i in range(0, len(vectors), 2)]
    return (vectors[0] * postscale).reshape(inputs[0].shape)
