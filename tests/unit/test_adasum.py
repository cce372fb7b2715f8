"""Adasum (op=ReduceOp.ADASUM) with ranks as threads: results against a numpy reference that
combines the ranks' vectors in the core's tree order, bit-identical on every rank, over
both transports and every same-host path, blocking and asynchronous; integer dtypes and
other collectives refused; joined ranks taking part with zeros."""
import numpy as np
import pytest

import ringsync as rs
from ringsync.ops import ReduceOp

from tests.common.reference import EPS, bfloat16, dtype_of, rank_input, reference_adasum, scale
from tests.thread_ranks import PATHS, assert_ranks_ok

TIMEOUT = 120
BASE_ENV = {"RINGSYNC_TIMEOUT_SECONDS": "60"}
# Paths (tests/thread_ranks.py): on "shm" blocking calls would take the lane, on "staged"
# every allreduce would reduce through the shared segments; Adasum must take neither.
DTYPES = ["float32", "float64", "float16"] + (["bfloat16"] if bfloat16 else [])
ADASUM = ReduceOp.ADASUM


def _lengths(size):
    """1, small primes, a length not divisible by the rank count, and one past the lane."""
    return [1, 2, 3, 7, 4 * size + 1, 1009, 70_001]


def adasum_input(rank, shape, dtype, salt=""):
    """A direction shared by all ranks, weighted differently by each (some opposed), plus
    noise of the rank's own: the pairwise coefficients are far from 1."""
    shared = rank_input(0, shape, "float64", salt=f"adasum-shared{salt}")
    noise = rank_input(rank, shape, "float64", salt=f"adasum{salt}") / 4.0
    weight = ((rank % 3) - 1) * 1.5 + 0.5  # -1, 0.5, 2, -1, ...
    return (weight * shared + noise).astype(dtype_of(dtype))


def _inputs(size, shape, dtype, salt=""):
    return [adasum_input(r, shape, dtype, salt) for r in range(size)]


def assert_adasum(got, inputs, prescale=1.0, postscale=1.0, what=""):
    """Within a few roundings per tree level of the magnitudes involved (the core rounds
    to the tensor's dtype after every level; the reference stays in float64), plus what
    summing the dot products of n elements in another order may change (in float64)."""
    ref = reference_adasum(inputs, prescale, postscale)
    assert got.dtype == inputs[0].dtype and got.shape == ref.shape, (what, got.dtype, got.shape)
    levels = max(1, len(inputs).bit_length())
    magnitude = max(float(np.abs(scale(x, prescale).astype(np.float64)).max()) for x in inputs)
    magnitude = max(magnitude, float(np.abs(ref).max()) / abs(postscale)) * abs(postscale)
    tol = 4 * levels * (EPS[got.dtype.name] + got.size * EPS['float64']) * magnitude + 1e-300
    err = np.abs(got.astype(np.float64) - ref)
    assert err.max() <= tol, f"{what}: off by {err.max():g} (tolerance {tol:g}) at flat " \
                             f"index {int(err.argmax())}: got {got.reshape(-1)[err.argmax()]!r}, " \
                             f"expected {ref.reshape(-1)[err.argmax()]!r}"


def _every_dtype_and_length(comm):
    """Blocking, in place, async and scaled, for every dtype and length; returns every
    result so that the test can compare ranks bit for bit."""
    me, size = comm.rank(), comm.size()
    results = []
    for dtype in DTYPES:
        for n in _lengths(size):
            inputs = _inputs(size, (n,), dtype)
            what = f"adasum {dtype} n={n} on {size} ranks"
            got = comm.allreduce(inputs[me], op=ADASUM, name=what)
            assert_adasum(got, inputs, what=what)
            mine = inputs[me].copy()
            comm.allreduce_(mine, op=ADASUM, name="in place " + what)
            assert_adasum(mine, inputs, what="in place " + what)
            handle = comm.allreduce_async(inputs[me], op=ADASUM, prescale_factor=0.5,
                                          postscale_factor=3.0, name="async " + what)
            scaled = comm.synchronize(handle)
            assert_adasum(scaled, inputs, 0.5, 3.0, what="async scaled " + what)
            results.append(np.concatenate([got.view(np.uint8), mine.view(np.uint8),
                                           scaled.view(np.uint8)]))
    matrix = _inputs(size, (6, 5), "float32", "2d")
    got = comm.allreduce(matrix[me], op=ADASUM, name="adasum 2-d")
    assert_adasum(got, matrix, what="2-d")
    results.append(got.view(np.uint8).reshape(-1))
    return results


def _assert_ranks_agree(per_rank):
    for rank, results in enumerate(per_rank[1:], 1):
        for i, (theirs, ours) in enumerate(zip(results, per_rank[0])):
            assert np.array_equal(theirs, ours), f"rank {rank} differs from rank 0 in result {i}"


@pytest.mark.parametrize("size,path", [(1, "shm")] +
                         [(n, p) for n in (2, 3, 4, 5) for p in ("shm", "tcp")] +
                         [(8, "shm"), (3, "staged"), (4, "staged")])
def test_adasum_matches_the_tree_reference_on_every_rank(size, path):
    per_rank = assert_ranks_ok(_every_dtype_and_length, size, timeout=TIMEOUT,
                               env={**BASE_ENV, **PATHS[path]})
    _assert_ranks_agree(per_rank)


def _grouped_and_concurrent(comm):
    """Tensors submitted together are never fused: each has its own coefficients."""
    me, size = comm.rank(), comm.size()
    group = [_inputs(size, (n,), "float32", f"grp{n}") for n in (1, 5, 33)]
    for got, inputs in zip(comm.grouped_allreduce([g[me] for g in group], op=ADASUM,
                                                  name="adasum.group"), group):
        assert_adasum(got, inputs, what=f"grouped n={inputs[0].size}")
    handles = [comm.allreduce_async(g[me], op=ADASUM, name=f"adasum.async.{i}")
               for i, g in enumerate(group)]
    summed = comm.allreduce(group[0][me], op=rs.Sum, name="sum.between")
    assert np.allclose(summed, np.sum(group[0], axis=0), rtol=1e-5)
    for handle, inputs in zip(reversed(handles), reversed(group)):
        assert_adasum(comm.synchronize(handle), inputs, what="async, finished out of order")


@pytest.mark.parametrize("size,path", [(3, "shm"), (4, "tcp")])
def test_adasum_tensors_submitted_together_are_reduced_one_by_one(size, path):
    assert_ranks_ok(_grouped_and_concurrent, size, timeout=TIMEOUT,
                    env={**BASE_ENV, **PATHS[path]})


def _refusals_then_next_call_works(comm):
    me, size = comm.rank(), comm.size()
    ok = _inputs(size, (9,), "float64", "ok")

    def expect(fragments, fn, *args, **kwargs):
        with pytest.raises(rs.UsageError) as caught:
            fn(*args, **kwargs)
        for fragment in fragments:
            assert fragment in str(caught.value), (fragment, str(caught.value))
        assert_adasum(comm.allreduce(ok[me], op=ADASUM), ok, what="the call after a refusal")

    for dtype in ("int32", "int16", "uint8"):
        expect([f"'grad.{dtype}'", dtype, "Adasum"], comm.allreduce,
               np.ones(4, dtype=dtype), op=ADASUM, name=f"grad.{dtype}")
    expect(["'grad.async'", "int64", "Adasum"], comm.allreduce_async,
           np.ones(4, dtype=np.int64), op=ADASUM, name="grad.async")
    expect(["'rows'", "Adasum", "reducescatter"], comm.reducescatter,
           np.ones((size, 2)), op=ADASUM, name="rows")
    if size > 1:  # ranks that disagree on the op: every rank raises, naming both
        op = ADASUM if me == 0 else rs.Sum
        expect(["Mismatched allreduce reduction ops for 'mixed'", "Adasum", "Sum"],
               comm.allreduce, np.ones(3), op=op, name="mixed")


@pytest.mark.parametrize("size,path", [(1, "shm"), (2, "shm"), (3, "tcp")])
def test_adasum_refuses_integers_and_other_collectives_then_works(size, path):
    assert_ranks_ok(_refusals_then_next_call_works, size, timeout=TIMEOUT,
                    env={**BASE_ENV, **PATHS[path]})


def _joined_ranks_give_zeros(comm):
    """The last rank joins at once; the others' Adasum allreduces see zeros from it (a zero
    vector keeps the other one as it is)."""
    me, size = comm.rank(), comm.size()
    if me == size - 1:
        return comm.join()
    for n in (1, 7, 70_001):
        inputs = _inputs(size, (n,), "float32", "join")
        expected_inputs = inputs[:-1] + [np.zeros_like(inputs[-1])]
        got = comm.allreduce(inputs[me], op=ADASUM, name=f"joined.{n}")
        assert_adasum(got, expected_inputs, what=f"with rank {size - 1} joined, n={n}")
    return comm.join()


@pytest.mark.parametrize("size,path", [(2, "shm"), (3, "shm"), (5, "tcp")])
def test_adasum_with_a_joined_rank(size, path):
    last = assert_ranks_ok(_joined_ranks_give_zeros, size, timeout=TIMEOUT,
                           env={**BASE_ENV, **PATHS[path]})
    assert len(set(last)) == 1


def _torch_tensors(comm):
    """ringsync.torch on this thread-rank's communicator (process_set): float32 and
    bfloat16 tensors, out of place and in place; int16 refused; no gradient through it."""
    torch = pytest.importorskip("torch")
    import ringsync.torch as hvd
    me, size = comm.rank(), comm.size()
    for dtype, torch_dtype in [("float32", torch.float32), ("bfloat16", torch.bfloat16)]:
        if dtype not in DTYPES:
            continue
        inputs = _inputs(size, (3, 5), dtype, "torch")
        mine = torch.from_numpy(inputs[me].astype(np.float32)).to(torch_dtype)
        got = hvd.allreduce(mine, op=ADASUM, name=f"torch.{dtype}", process_set=comm)
        assert got.dtype == torch_dtype and got.shape == mine.shape
        assert_adasum(got.float().numpy().astype(dtype_of(dtype)), inputs, what=f"torch {dtype}")
        assert hvd.allreduce_(mine, op=ADASUM, name=f"torch_.{dtype}", process_set=comm) is mine
        assert torch.equal(mine, got)
    with pytest.raises(rs.UsageError, match="int16.*Adasum"):
        hvd.allreduce(torch.ones(3, dtype=torch.int16), op=ADASUM, name="torch.int16",
                      process_set=comm)
    weights = torch.ones(4, requires_grad=True)
    reduced = hvd.allreduce(weights, op=ADASUM, name="torch.grad", process_set=comm)
    with pytest.raises(rs.UsageError, match="gradient of a Adasum reduction is not defined"):
        reduced.sum().backward()


def test_adasum_through_the_torch_adapter():
    pytest.importorskip("torch")
    assert_ranks_ok(_torch_tensors, 3, timeout=TIMEOUT, env={**BASE_ENV, **PATHS["shm"]})
