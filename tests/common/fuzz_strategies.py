"""Hypothesis strategies for fuzzing ringsync's collectives (tests/unit/test_fuzz_api.py):
a Case holds one call's parameters, drawn once and made alike by every rank (shape,
dtype, op, root, splits, name, scale factors, process set), while the data differ by rank
and position (derived from the case's seed and the rank). Beside the strategies: each
rank's input, the numpy reference of a valid call, and the problems an invalid call must
name (expected_problems), so that the test knows which of the two outcomes is right.
"""
import dataclasses
import zlib
from typing import Optional, Tuple

import numpy as np
from hypothesis import strategies as st

from .reference import (EPS, INT_DTYPES, REDUCIBLE, dtype_of, reference_adasum,
                        reference_allreduce)

MOVABLE = REDUCIBLE + ["bool"]
FLOAT_DTYPES = [d for d in REDUCIBLE if d not in INT_DTYPES]
OPS = ["Sum", "Average", "Min", "Max", "Product", "Adasum"]
MAX_NAME_BYTES = 4000  # RS_MAX_NAME_LEN (native/src/checked.h)

# The numpy API's calls, by the family that decides their rules.
# (duplicate_in_flight: two async allreduces of one name, see test_fuzz_api.py)
REDUCING = {"allreduce", "allreduce_", "allreduce_async", "allreduce_async_", "allreduce_into",
            "grouped_allreduce", "grouped_allreduce_", "reducescatter", "duplicate_in_flight"}
IN_PLACE = {"allreduce_", "allreduce_async_", "grouped_allreduce_", "broadcast_"}
NUMPY_CALLS = sorted(REDUCING | {"allgather", "allgather_async", "broadcast", "broadcast_",
                                 "broadcast_async", "alltoall"})
# What each framework adapter offers here (Horovod's names).
FRAMEWORK_CALLS = {
    "torch": ["allreduce", "allreduce_", "allreduce_async", "grouped_allreduce", "allgather",
              "broadcast", "broadcast_", "reducescatter", "alltoall"],
    "tf": ["allreduce", "grouped_allreduce", "allgather", "broadcast", "broadcast_",
           "reducescatter", "alltoall"],
    "jax": ["allreduce", "grouped_allreduce", "allgather", "broadcast", "reducescatter",
            "alltoall"],
}
# How an input is laid out in memory: views that are not C-contiguous, negative and zero
# strides, read-only memory, plain buffers; "alias"/"overlap": allreduce_into's output is
# the input itself / overlaps it shifted by one element.
NUMPY_LAYOUTS = ["contiguous", "strided", "huge_stride", "transposed", "reversed",
                 "fortran", "readonly", "broadcast", "memoryview", "scalar"]
ALIASES = ["separate", "alias", "overlap"]
TORCH_LAYOUTS = ["contiguous", "strided", "transposed", "requires_grad", "expanded"]
TF_LAYOUTS = ["constant", "variable"]
# Scale factors: for integers only those that keep small values in range and exact (a
# factor past an integer's range is undefined in C); floats also take extremes and
# non-finite values (refused, naming them).
INT_FACTORS = [1.0, 0.0, 0.5, 1.5, -1.0]
FLOAT_FACTORS = [1.0, 0.0, -0.0, 0.5, -2.0, 3.0, 1e-3, 1e30, float("nan"), float("inf"),
                 -float("inf")]


@dataclasses.dataclass(frozen=True)
class Odd:
    """One rank's call differs from the others' in one field."""
    rank: int
    field: str  # "dtype", "shape", "op", "root", "prescale"
    value: object


@dataclasses.dataclass(frozen=True)
class Case:
    size: int  # ranks of the pool
    path: str  # how the ranks move data (tests/thread_ranks.PATHS)
    api: str  # "numpy", "torch", "tf", "jax"
    call: str
    dtype: str
    shapes: Tuple[tuple, ...]  # each rank's shape (allgather and alltoall rows may differ)
    group: int  # grouped calls: how many tensors
    layout: str
    alias: str
    op: str
    prescale: float
    postscale: float
    root: int
    splits: Optional[Tuple[tuple, ...]]  # alltoall: each rank's splits
    name: Optional[str]
    in_set: bool  # on the pool's process set instead of the world
    seed: int
    odd: Optional[Odd] = None

    def __repr__(self) -> str:  # (names of 4000 bytes would drown the report)
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        if self.name is not None and len(self.name) > 40:
            fields["name"] = f"{self.name[:8]!r} * {len(self.name)} chars"
        return "Case(" + ", ".join(f"{k}={v!r}" if k != "name" or not isinstance(v, str)
                                   or "chars" not in v else f"{k}={v}"
                                   for k, v in fields.items()) + ")"

    def shape_of(self, rank: int) -> tuple:
        if self.odd is not None and self.odd.rank == rank and self.odd.field == "shape":
            return self.odd.value
        return self.shapes[rank]

    def dtype_of(self, rank: int) -> str:
        if self.odd is not None and self.odd.rank == rank and self.odd.field == "dtype":
            return self.odd.value
        return self.dtype

    def field_of(self, rank: int, field: str):
        if self.odd is not None and self.odd.rank == rank and self.odd.field == field:
            return self.odd.value
        return getattr(self, field)


# ------------------------------------------------------------------------------ data


def rank_input(case: Case, rank: int, index: int = 0) -> np.ndarray:
    """Rank's input (tensor `index` of a group): small values that differ by rank and
    position, exact in every float dtype (multiples of 1/8), so that sums and products of
    a few ranks stay exact and integers never overflow."""
    dtype, shape = case.dtype_of(rank), tensor_shapes(case, rank)[index]
    seed = zlib.crc32(f"{case.seed}/{rank}/{index}/{dtype}/{shape}".encode())
    rng = np.random.default_rng(seed)
    if dtype == "bool":
        values = rng.integers(0, 2, size=shape).astype(bool)
    elif dtype in INT_DTYPES:
        low = 0 if dtype.startswith("u") else -2
        values = rng.integers(low, 2, size=shape, endpoint=True).astype(dtype)
    else:
        low, high = (4, 12) if case.op == "Product" else (-16, 16)
        values = rng.integers(low, high, size=shape, endpoint=True) / 8.0
    if case.layout == "expanded" and values.ndim and values.shape[0]:
        values = np.broadcast_to(values[:1], values.shape)  # (rows alike: a stride-0 view)
    return np.array(values, dtype_of(dtype))  # (0-d: an array, not a numpy scalar)


def tensor_shapes(case: Case, rank: int) -> list:
    """The shape of each tensor rank passes (a group's differ: tensor i has a dimension
    of i more)."""
    shape = case.shape_of(rank)
    if not case.call.startswith("grouped"):
        return [shape]
    return [shape] + [shape + (i,) for i in range(1, case.group)]


def members(case: Case, set_ranks) -> list:
    """The ranks that take part in the call (the set's, or every rank)."""
    return list(set_ranks) if case.in_set else list(range(case.size))


def numpy_layout(x: np.ndarray, layout: str):
    """x's values in the memory layout asked for (a view that is not C-contiguous, a
    read-only array, a buffer...)."""
    if layout == "strided" and x.ndim:
        base = np.zeros((x.shape[0] * 2,) + x.shape[1:], x.dtype)
        base[::2] = x
        return base[::2]
    if layout == "huge_stride" and x.ndim:
        base = np.zeros((x.shape[0], 512) + x.shape[1:], x.dtype)
        base[:, 7] = x
        return base[:, 7]
    if layout == "transposed" and x.ndim >= 2:
        return np.ascontiguousarray(x.T).T
    if layout == "reversed" and x.ndim:
        return np.ascontiguousarray(x[::-1])[::-1]
    if layout == "fortran" and x.ndim >= 2:
        return np.asfortranarray(x)
    if layout == "readonly":
        x = x.copy()
        x.flags.writeable = False
        return x
    if layout == "broadcast" and x.ndim and x.size:  # stride 0 along a new axis
        return np.broadcast_to(x[np.newaxis], (3,) + x.shape)[1]
    if layout == "scalar" and x.ndim == 0:  # a numpy scalar: immutable
        return x[()]
    if layout == "memoryview" and x.dtype.kind != "V":  # (bfloat16 has no buffer format)
        return memoryview(x.copy())
    return x.copy()



# ------------------------------------------------------------------------------ strategies


def _name_text():
    return st.text(alphabet=st.characters(blacklist_categories=("Cs",)), min_size=1,
                   max_size=12)


@st.composite
def names(draw):
    """None (the core numbers the call), short unicode, the empty name, names around the
    core's limit in bytes (of 1- and 3-byte characters), and names with a NUL."""
    kind = draw(st.sampled_from(["none", "none", "short", "short", "empty", "long", "nul"]))
    if kind == "none":
        return None
    if kind == "short":
        return "fz." + draw(_name_text()).replace("\0", "")
    if kind == "empty":
        return ""
    if kind == "nul":
        return "fz." + draw(_name_text()) + "\0x"
    char = draw(st.sampled_from(["n", "é", "€", "名"]))
    target = MAX_NAME_BYTES + draw(st.integers(-8, 8))
    return char * max(1, target // len(char.encode()))


def _rows(draw, size, call, ndim_min):
    """Each rank's shape: the same, except allgather's and alltoall's first dimension."""
    trailing = tuple(draw(st.lists(st.sampled_from([1, 2, 3, 0]), min_size=0, max_size=2)))
    first = draw(st.sampled_from([0, 1, 2, 3, 5, 6, 7, 12, 13]))
    if call.startswith("allgather"):
        firsts = draw(st.lists(st.sampled_from([0, 1, 2, 5]), min_size=size, max_size=size))
        return tuple((f,) + trailing for f in firsts)
    if ndim_min == 0 and draw(st.integers(0, 5)) == 0:
        return ((),) * size  # 0-d
    if draw(st.integers(0, 7)) == 0:
        first = draw(st.sampled_from([101, 257, 1031]))  # larger, prime
    return ((first,) + trailing,) * size


def _splits(draw, case_rows, size):
    """alltoall splits: None, or each rank's (valid or not: sum, length, sign)."""
    if draw(st.booleans()):
        return None
    out = []
    for rows in case_rows:
        n = rows[0] if rows else 0
        cuts = sorted(draw(st.lists(st.integers(0, n), min_size=size - 1, max_size=size - 1)))
        valid = [b - a for a, b in zip([0] + cuts, cuts + [n])]
        out.append(tuple(valid))
    flaw = draw(st.sampled_from(["none"] * 6 + ["sum", "length", "negative"]))
    if flaw != "none":  # every rank alike, so that each rank's own check refuses it
        fix = {"sum": lambda s: s[:-1] + (s[-1] + 1,), "length": lambda s: s + (0,),
               "negative": lambda s: (-1,) + s[1:-1] + (s[-1] + 1 + s[0],)}[flaw]
        out = [fix(s) for s in out]
    return tuple(out)


def _factor(draw, dtype, call):
    if call not in REDUCING:
        return 1.0
    pool = INT_FACTORS if dtype in INT_DTYPES or dtype == "bool" else FLOAT_FACTORS
    return draw(st.sampled_from([1.0, 1.0] + pool))


def _odd(draw, size, call, shapes, dtype, op, root):
    """Sometimes one rank makes the call differently in one field."""
    if call == "duplicate_in_flight" or draw(st.integers(0, 5)):
        return None
    fields = ["dtype", "shape"]
    if call in REDUCING:
        fields += ["op", "prescale"]
    if call.startswith("broadcast"):
        fields.append("root")
    field = draw(st.sampled_from(fields))
    rank = draw(st.integers(0, size - 1))
    if field == "dtype":
        value = draw(st.sampled_from([d for d in MOVABLE if d != dtype and "64" not in d]))
    elif field == "shape":
        shape = shapes[rank]
        value = shape + (2,) if shape else (1, 2)  # (a different row shape too)
    elif field == "op":
        value = draw(st.sampled_from([o for o in OPS[:5] if o != op]))
    elif field == "prescale":
        value = 2.0
    else:
        value = (root + 1) % size
    return Odd(rank, field, value)


@st.composite
def cases(draw, pools, api="numpy"):
    """A Case for one of `pools` ((size, path) pairs) through `api`."""
    size, path = draw(st.sampled_from(pools))
    call = draw(st.sampled_from(NUMPY_CALLS if api == "numpy" else FRAMEWORK_CALLS[api]))
    # (JAX without x64, as by default, makes 64-bit arrays 32-bit ones)
    dtype = draw(st.sampled_from([d for d in MOVABLE if api != "jax" or "64" not in d]))
    op = draw(st.sampled_from(OPS)) if call in REDUCING else "Sum"
    ndim_min = 1 if call in ("reducescatter", "alltoall") and draw(st.integers(0, 5)) else 0
    shapes = _rows(draw, size, call, ndim_min)
    layouts = {"numpy": NUMPY_LAYOUTS, "torch": TORCH_LAYOUTS, "tf": TF_LAYOUTS,
               "jax": ["array"]}[api]
    layout = draw(st.sampled_from(layouts))
    alias = draw(st.sampled_from(ALIASES)) if call == "allreduce_into" else "separate"
    root = draw(st.sampled_from(list(range(size)) * 3 + [size, -1, 10**6]))
    splits = _splits(draw, shapes, size) if call == "alltoall" else None
    in_set = draw(st.integers(0, 5)) == 0
    case = Case(size=size, path=path, api=api, call=call, dtype=dtype, shapes=shapes,
                group=draw(st.integers(1, 3)), layout=layout, alias=alias, op=op,
                prescale=_factor(draw, dtype, call), postscale=_factor(draw, dtype, call),
                root=root if call.startswith("broadcast") else 0, splits=splits,
                name=draw(_name_text().map(lambda t: "fz.dup." + t.replace("\0", ""))
                          if call == "duplicate_in_flight" else names()), in_set=in_set, seed=draw(st.integers(0, 2**16)))
    if not in_set:
        case = dataclasses.replace(case, odd=_odd(draw, size, call, shapes, dtype, op, root))
    return case


# ------------------------------------------------------------------------------ oracle


def _name_bytes(case: Case) -> int:
    name = case.name or ""
    suffix = 2 if case.call.startswith("grouped") else 0  # ("base.0")
    return len(name.encode("utf-8", "surrogatepass")) + suffix


def expected_problems(case: Case, rank: int, set_ranks):
    """None when the call is valid on this rank; else the problems its error may name
    (each a list of fragments, all of which must appear in the message: the checks may
    come in any order, so any of the problems found will do)."""
    problems = []
    if case.in_set and rank not in set_ranks:
        problems.append(["not a member"])
    if case.odd is not None:  # every rank fails, and the message names the tensor
        problems.append([case.name] if case.name and "\0" not in case.name else [])
    name = case.name
    if name is not None and "\0" in name:
        problems.append(["NUL"])
    elif name is not None and (_name_bytes(case) > MAX_NAME_BYTES or _name_bytes(case) == 0):
        problems.append(["tensor name", str(MAX_NAME_BYTES)])
    dtype, call, op = case.dtype_of(rank), case.call, case.field_of(rank, "op")
    if call in REDUCING and dtype == "bool":
        problems.append(["bool"])
    if call in REDUCING and op == "Adasum":
        if call == "reducescatter":
            problems.append(["Adasum", "only for allreduce"])
        elif dtype in INT_DTYPES:
            problems.append(["Adasum", dtype])
    if call in REDUCING and not all(np.isfinite([case.prescale, case.postscale])):
        problems.append(["finite"])
    writes_input = call in IN_PLACE or (call == "allreduce_into" and case.alias == "alias")
    if writes_input and case.api == "numpy":
        for shape in tensor_shapes(case, rank):
            laid = numpy_layout(np.zeros(shape, dtype_of(dtype)), case.layout)
            if isinstance(laid, np.generic):
                problems.append(["numpy scalar"])
            laid = np.asarray(laid)
            if not laid.flags.writeable:
                problems.append(["read-only"])
            if not laid.flags.c_contiguous:
                problems.append(["C-contiguous"])
    if call.startswith("broadcast") and case.root not in members(case, set_ranks):
        problems.append(["root", str(case.root)])
    shape = case.shape_of(rank)
    if call in ("reducescatter", "alltoall") and not shape:
        problems += [["at least one dimension"], ["0-d"]]
    if call == "alltoall" and shape:
        n = len(members(case, set_ranks))
        if case.splits is None and shape[0] % n:
            problems.append(["divisible"])
        splits = case.splits[rank] if case.splits else None
        if splits is not None and len(splits) != n:
            problems.append(["one entry per rank"])
        elif splits is not None and min(splits) < 0:
            problems.append(["negative"])
        elif splits is not None and sum(splits) != shape[0]:
            problems.append(["sum"])
    if case.alias == "overlap" and int(np.prod(case.shape_of(rank))) > 1:
        problems.append(["overlap"])
    differentiable = case.api == "torch" and case.layout == "requires_grad" and \
        dtype in FLOAT_DTYPES and call in ("allreduce", "grouped_allreduce", "reducescatter")
    if differentiable and op not in ("Sum", "Average"):  # (Horovod's rule)
        problems.append(["gradient", op])
    if case.api == "tf" and op == "Adasum":  # (here always a communicator given)
        problems.append(["Adasum", "global process set"])
    if case.api == "jax" and call == "reducescatter" and op not in ("Sum", "Average"):
        problems.append(["Sum or Average", op])  # (only ringsync.jax says so)
    return problems or None


def reference(case: Case, rank: int, inputs, index: int = 0):
    """The result rank must get from a valid call, given every member's input (by rank)."""
    call, ranks = case.call, sorted(inputs)
    xs = [inputs[r] for r in ranks]
    if call.startswith("allgather"):
        return np.concatenate([x.reshape(1) if x.ndim == 0 else x for x in xs])
    if call.startswith("broadcast"):
        return inputs[case.root]
    if call == "alltoall":
        me = ranks.index(rank)
        parts = []
        for r, x in zip(ranks, xs):
            split = case.splits[r] if case.splits else [x.shape[0] // len(ranks)] * len(ranks)
            start = sum(split[:me])
            parts.append(x[start:start + split[me]])
        return np.concatenate(parts)
    if case.op == "Adasum":
        return reference_adasum(xs, case.prescale, case.postscale)
    full = reference_allreduce(xs, case.op, case.prescale, case.postscale)
    return full[_my_rows(case, rank, ranks, xs[0])]


def _my_rows(case: Case, rank: int, ranks, x):
    """The part of an allreduce's result that is rank's: reducescatter's rows, or all."""
    if case.call != "reducescatter":
        return ...
    rows = x.shape[0]
    counts = [rows // len(ranks) + (i < rows % len(ranks)) for i in range(len(ranks))]
    me = ranks.index(rank)
    return slice(sum(counts[:me]), sum(counts[:me + 1]))


def _tolerance(case: Case, xs, dtype) -> np.ndarray:
    """A few ulps of the result dtype, of the magnitudes involved."""
    eps = EPS.get(dtype.name, 0.0)
    scaled = [np.abs(x.astype(np.float64)) * abs(case.prescale) for x in xs]
    magnitude = sum(scaled) if case.op != "Product" else np.prod(
        [np.maximum(s, 1.0) for s in scaled], axis=0)
    if case.op == "Adasum":
        eps = 16 * eps  # (its coefficients are rounded to the dtype too)
    return 4 * len(xs) * eps * (magnitude * abs(case.postscale) + 1.0)


def mismatch(case: Case, rank: int, got: np.ndarray, inputs, index: int = 0) -> Optional[str]:
    """None when got is rank's right result of the valid call, else what differs."""
    want = reference(case, rank, inputs, index)
    dtype = inputs[rank].dtype  # (reductions of floats are referenced in float64)
    if got.dtype != dtype or got.shape != want.shape:
        return f"got {got.dtype} {got.shape}, expected {dtype} {want.shape}"
    if got.dtype.kind in "iub" or case.call.startswith(("allgather", "broadcast", "alltoall")):
        same = _same_bits(got, want.astype(dtype))
        return None if same else f"got {got.tolist()}, expected {want.tolist()}"
    g, w = got.astype(np.float64), want.astype(np.float64)
    with np.errstate(over="ignore"):  # (past the dtype's range the result is rightly inf)
        in_dtype = want.astype(dtype).astype(np.float64)
    w = np.where(np.isinf(in_dtype), in_dtype, w)
    ranks = sorted(inputs)
    xs = [inputs[r] for r in ranks]
    with np.errstate(invalid="ignore", over="ignore"):
        tolerance = _tolerance(case, xs, got.dtype)[_my_rows(case, rank, ranks, xs[0])]
        close = (g == w) | (np.isnan(g) & np.isnan(w)) | (np.abs(g - w) <= tolerance)
    bad = np.flatnonzero(~close.reshape(-1))
    if bad.size:
        i = bad[0]
        return (f"{bad.size} of {got.size} elements differ; first at flat index {i}: got "
                f"{g.reshape(-1)[i]!r}, expected {w.reshape(-1)[i]!r}")
    return None


def _same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    """Moved data (allgather, broadcast, alltoall) must arrive bit for bit."""
    return a.shape == b.shape and a.tobytes() == np.ascontiguousarray(b).tobytes()
