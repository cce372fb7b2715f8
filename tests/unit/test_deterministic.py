"""RINGSYNC_DETERMINISTIC=1: allreduce and reducescatter fold every element in rank order
(rank 0's prescaled value, then rank 1's, ...; Average's division and the postscale after),
so their bits depend on the inputs and the rank count only. Each configuration below takes
other paths (the lane's posts, the staged allreduce, the engine's one-round and block
exchanges, TCP, fusion or none, shuffled submission orders); every one must give, on every
rank, the bytes of one numpy reference that folds the ranks' inputs in rank order in the
dtype itself, as the C kernels do: so every configuration gives the same bytes. Thread
ranks (tests/thread_ranks.py): a hang fails at the deadline showing every rank."""
import functools
import hashlib
import random
import zlib

import numpy as np
import pytest

import ringsync as rs
from tests.common.reference import dtype_of, scale
from tests.thread_ranks import assert_ok, assert_ranks_ok, rank_config, run_threads

TIMEOUT = 180  # seconds for one whole run
DTYPES = ["float32", "float16", "bfloat16"]
# (op, prescale, postscale): scale factors that round, so that applying them at another
# moment than the rule says would show
VARIANTS = [("Sum", 1.0, 1.0), ("Average", 0.3, 1.7)]
STAGED_BYTES = 1 << 20  # RINGSYNC_STAGED_BYTES' default


def _counts(dtype):
    """Element counts: 1, primes, none divisible by 2, 3, 4 or 5, past the one-round size
    (16 KiB), the staged allreduce's chunk (256 KiB) and its default threshold (1 MiB)."""
    itemsize = dtype_of(dtype).itemsize
    return [1, 13, 1009, 5003, (256 << 10) // itemsize + 7, STAGED_BYTES // itemsize + 11]


CASES = [(dtype, n, variant) for dtype in DTYPES for n in _counts(dtype)
         for variant in range(len(VARIANTS))]

BASE = {"RINGSYNC_TIMEOUT_SECONDS": "60", "RINGSYNC_DETERMINISTIC": "1"}
# Each takes other paths through the core, with other fusion thresholds and cycle times.
CONFIGS = {
    # blocking calls on the lane (posted whole up to 16 KiB, staged above); the engine's
    # async calls fused up to 64 MiB, one round up to 16 KiB, staged from 1 MiB
    "lane": {"RINGSYNC_TRANSPORT": "shm"},
    # every allreduce staged (on the lane and in the engine), fusion up to 4 KiB
    "staged": {"RINGSYNC_TRANSPORT": "shm", "RINGSYNC_SMALL_ALLREDUCE_BYTES": "0",
               "RINGSYNC_STAGED_BYTES": "1", "RINGSYNC_FUSION_THRESHOLD": "4096",
               "RINGSYNC_CYCLE_TIME_MS": "0"},
    # the engine only, no fusion, every allreduce in blocks (no one-round, no staging)
    "blocks": {"RINGSYNC_TRANSPORT": "shm", "RINGSYNC_LANE_BYTES": "0",
               "RINGSYNC_STAGED_BYTES": "0", "RINGSYNC_SMALL_ALLREDUCE_BYTES": "0",
               "RINGSYNC_FUSION_THRESHOLD": "0", "RINGSYNC_CYCLE_TIME_MS": "0"},
    # the engine only, every allreduce in one round, fused up to 64 MiB
    "one-round": {"RINGSYNC_TRANSPORT": "shm", "RINGSYNC_LANE_BYTES": "0",
                  "RINGSYNC_STAGED_BYTES": "0", "RINGSYNC_SMALL_ALLREDUCE_BYTES": str(1 << 30),
                  "RINGSYNC_CYCLE_TIME_MS": "5"},
    # TCP (no lane, no staging), one round up to 4 KiB, fusion up to 4 KiB
    "tcp": {"RINGSYNC_TRANSPORT": "tcp", "RINGSYNC_SMALL_ALLREDUCE_BYTES": "4096",
            "RINGSYNC_FUSION_THRESHOLD": "4096", "RINGSYNC_CYCLE_TIME_MS": "2"},
}


@functools.lru_cache(maxsize=None)
def _input(rank, dtype, n):
    """Values that differ by rank and position, with magnitudes from 2^-8 to 2^8 (so that
    the order of the sums shows in their bits) and either sign. Read-only: the thread
    ranks share them."""
    rng = np.random.default_rng(zlib.crc32(f"{rank}/{dtype}/{n}".encode()))
    values = rng.uniform(1.0, 2.0, n) * 2.0 ** rng.integers(-8, 9, n)
    x = (values * np.where(rng.random(n) < 0.5, -1.0, 1.0)).astype(dtype_of(dtype))
    x.flags.writeable = False
    return x


@functools.lru_cache(maxsize=None)
def _reference(size, dtype, n, variant):
    """The rule, step by step as the kernels take it (native/src/reduce.c): 16-bit floats
    widened to float32 for each operation and rounded back to nearest even; scaling in
    float32 by the factor rounded to float32; Average's factor postscale / size."""
    op, pre, post = VARIANTS[variant]
    dt = dtype_of(dtype)
    acc = scale(_input(0, dtype, n), pre)
    for r in range(1, size):
        acc = (acc.astype(np.float32) + scale(_input(r, dtype, n), pre).astype(np.float32)
               ).astype(dt)
    out = scale(acc, post / size if op == "Average" else post)
    out.flags.writeable = False
    return out


def _my_rows(n, size, rank):
    """Rank `rank`'s part of n rows in reducescatter (the first n % size one larger)."""
    base, extra = divmod(n, size)
    start = rank * base + min(rank, extra)
    return slice(start, start + base + (rank < extra))


def _expected(kind, size, rank, case):
    dtype, n, variant = case
    full = _reference(size, dtype, n, variant)
    return full if kind == "allreduce" else full[_my_rows(n, size, rank)]


def _mismatch(got, expected):
    """None, or where got's bytes differ from expected's, in words."""
    if got.dtype != expected.dtype or got.shape != expected.shape:
        return f"got {got.dtype}{got.shape}, expected {expected.dtype}{expected.shape}"
    bits = np.dtype(f"u{got.dtype.itemsize}")
    bad = np.flatnonzero(got.view(bits) != expected.view(bits))
    if not bad.size:
        return None
    i = bad[0]
    return (f"{bad.size} of {got.size} elements differ; first at {i}: got {got[i]!r}, "
            f"expected {expected[i]!r}")


def _call(comm, kind, blocking, case, name):
    dtype, n, variant = case
    op, pre, post = VARIANTS[variant]
    x = _input(comm.rank(), dtype, n)
    fn = getattr(comm, kind if blocking else kind + "_async")
    return fn(x, op=getattr(rs, op), prescale_factor=pre, postscale_factor=post, name=name)


def _run_all(comm, shuffle_seed):
    """Every case as blocking and as async allreduce and reducescatter; the async ones
    submitted in an order shuffled differently on every rank. [(what, result)]."""
    results = []
    for kind in ("allreduce", "reducescatter"):
        for case in CASES:
            what = f"{kind}.{case}"
            results.append((what, case, kind, _call(comm, kind, True, case, what)))
    order = [(kind, case) for kind in ("allreduce", "reducescatter") for case in CASES]
    random.Random(f"{shuffle_seed}/{comm.rank()}").shuffle(order)
    handles = [(kind, case, _call(comm, kind, False, case, f"async.{kind}.{case}"))
               for kind, case in order]
    for kind, case, handle in handles:
        results.append((f"async {kind}.{case}", case, kind, comm.synchronize(handle)))
    return results


def _check_rank_order(comm, shuffle_seed):
    """Every result has the reference's bytes; returns their digests, by call."""
    problems, digests = [], {}
    for what, case, kind, got in _run_all(comm, shuffle_seed):
        problem = _mismatch(got, _expected(kind, comm.size(), comm.rank(), case))
        if problem:
            problems.append(f"{what}: {problem}")
        digests[what] = hashlib.sha256(got.tobytes()).hexdigest()
    assert not problems, (f"rank {comm.rank()} of {comm.size()}: {len(problems)} results "
                          "differ from the rank-order reference:\n" + "\n".join(problems[:20]))
    return digests


@pytest.mark.parametrize("size", [2, 3, 4, 5])
@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_deterministic_results_are_the_rank_order_fold(config, size):
    """The same reference for every configuration: the same bytes whatever the path."""
    digests = assert_ranks_ok(_check_rank_order, size, timeout=TIMEOUT, args=(config,),
                              env={**BASE, **CONFIGS[config]})
    allreduces = [{k: v for k, v in d.items() if "allreduce" in k} for d in digests]
    assert all(d == allreduces[0] for d in allreduces)  # (follows: the same reference)


def _two_hosts(rank):
    return {"RINGSYNC_HOST_NAME": "node-a" if rank < 2 else "node-b"}


@pytest.mark.parametrize("hierarchical", ["on", "off"])
def test_deterministic_across_hosts_ignores_the_hierarchical_allreduce(hierarchical):
    """2 "hosts" of 2 ranks, where the hierarchical allreduce would otherwise run (on:
    every allreduce): the same rank-order bytes either way."""
    env = {**BASE, "RINGSYNC_TRANSPORT": "auto", "RINGSYNC_HIERARCHICAL_ALLREDUCE": hierarchical,
           "RINGSYNC_HIERARCHICAL_BYTES": "0", "RINGSYNC_SMALL_ALLREDUCE_BYTES": "0"}
    assert_ranks_ok(_check_rank_order, 4, timeout=TIMEOUT, args=("hosts",), env=env,
                    rank_env=_two_hosts)


def _count_differences(comm):
    """How many results of each kind differ from the rank-order reference."""
    counts = {"allreduce": 0, "reducescatter": 0}
    for _, case, kind, got in _run_all(comm, "default"):
        counts[kind] += _mismatch(got, _expected(kind, comm.size(), comm.rank(), case)) is not None
    return counts


@pytest.mark.parametrize("config", ["blocks", "staged"])
def test_the_default_mode_does_not_fold_in_rank_order(config):
    """Without the setting the ring's block b folds from rank b+1 on: on 3 ranks (on 2,
    a + b == b + a) the blocks of ranks 0 and 1 differ from the rank-order reference (rank
    2's fold starts at rank 0), so the checks above can fail. The staged allreduce folds in
    rank order in either mode (the reducescatters there still take the ring)."""
    env = {**BASE, **CONFIGS[config], "RINGSYNC_DETERMINISTIC": "0"}
    counts = assert_ranks_ok(_count_differences, 3, timeout=TIMEOUT, env=env)
    assert [c["reducescatter"] > 0 for c in counts] == [True, True, False], counts
    assert [c["allreduce"] > 0 for c in counts] == [config != "staged"] * 3, counts


def test_ranks_must_agree_on_the_setting():
    """A rank that differs fails init() on every rank, naming the setting."""
    def rank_main(rendezvous):
        config = rank_config(BASE, lambda r: {"RINGSYNC_DETERMINISTIC": str(r % 2)},
                             rendezvous.rank)
        with pytest.raises(rs.UsageError, match="RINGSYNC_DETERMINISTIC is 0 on rank 0 but 1 "
                                                "on rank 1"):
            rs.Communicator(rendezvous=rendezvous, config=config).shutdown()

    assert_ok(run_threads(rank_main, 3, TIMEOUT), "deterministic on rank 1 only", TIMEOUT)
