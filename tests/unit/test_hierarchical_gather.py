"""The hierarchical allgather and reducescatter (native/src/hierarchical.c) on simulated
hosts, as tests/unit/test_hierarchical.py does for allreduce: thread ranks reporting host
names, so same-"host" ranks talk over shared memory and the others over TCP.

Results are compared with numpy references built from every rank's input (allgather
exactly; reducescatter within the reduction's rounding); Communicator.traffic() proves
which algorithm ran: out of each host the hierarchical ones send (H-1)/H of the data, the
link bound, and the flat ring more."""
import numpy as np
import pytest

import ringsync as rs

from tests.common.reference import assert_reduced, rank_input
from tests.thread_ranks import assert_ranks_ok
from tests.unit.test_hierarchical import (BASE_ENV, LAYOUTS, SLACK, TIMEOUT,
                                          _assert_same_host_bytes_on_shm, _host_tcp, _hosts)

COLUMNS = 3


def _gather_rows(pattern, rank, size):
    """Rows of each rank's allgather input: blocks of different sizes, some empty."""
    return {
        "even": 40009,
        "uneven": (rank * 7919 + 13) % 30011 if rank != 1 else 0,
        "tiny": rank % 2,
        "empty": 0,
    }[pattern]


GATHER_CASES = [(dtype, pattern) for dtype in ("int8", "int32", "float16", "float64")
                for pattern in ("even", "uneven", "tiny", "empty")]


def _gather_input(rank, size, dtype, pattern):
    return rank_input(rank, (_gather_rows(pattern, rank, size), COLUMNS), dtype, "Sum", "ag")


def _allgather_matrix(comm):
    me, size = comm.rank(), comm.size()
    for dtype, pattern in GATHER_CASES:
        inputs = [_gather_input(r, size, dtype, pattern) for r in range(size)]
        what = f"allgather {dtype} {pattern} on {size} ranks"
        got = comm.allgather(inputs[me], name=what)
        want = np.concatenate(inputs)
        assert got.dtype == want.dtype and got.shape == want.shape, (what, got.shape, want.shape)
        differ = np.flatnonzero(got.reshape(-1).view(np.uint8) != want.reshape(-1).view(np.uint8))
        assert differ.size == 0, f"rank {me}: {what}: {differ.size} bytes differ, first at {differ[0]}"


REDUCE_CASES = [(dtype, op, rows) for dtype in ("int32", "float32", "float64", "float16")
                for op in ("Sum", "Average", "Min", "Max", "Product")
                for rows in (0, 1, 7, 100003)]


def _reducescatter_matrix(comm):
    me, size = comm.rank(), comm.size()
    for dtype, op, rows in REDUCE_CASES:
        inputs = [rank_input(r, (rows, 5), dtype, op, "rs") for r in range(size)]
        pre, post = (0.5, 3.0) if op in ("Sum", "Average") and rows == 7 else (1.0, 1.0)
        what = f"reducescatter {dtype} {op} rows={rows} scale={pre},{post} on {size} ranks"
        got = comm.reducescatter(inputs[me], op=getattr(rs, op), prescale_factor=pre,
                                 postscale_factor=post, name=what)
        # rank r takes the r-th of the even split, the first ranks one row more
        mine = [np.array_split(x, size)[me] for x in inputs]
        assert_reduced(got, mine, op, pre, post, what=f"rank {me}: {what}")
        work = inputs[me].copy()  # in place: the input is the work space
        got = comm.reducescatter_(work, op=getattr(rs, op), prescale_factor=pre,
                                  postscale_factor=post, name=f"in place {what}")
        assert_reduced(got, mine, op, pre, post, what=f"rank {me}: in place {what}")


@pytest.mark.parametrize("layout", ["2x2", "3x2", "2x3"])
def test_hierarchical_allgather_and_reducescatter_are_right_on_every_layout(layout):
    env = {**BASE_ENV, "RINGSYNC_HIERARCHICAL_ALLREDUCE": "on"}

    def body(comm):
        _allgather_matrix(comm)
        _reducescatter_matrix(comm)

    assert_ranks_ok(body, len(LAYOUTS[layout]), timeout=TIMEOUT, env=env,
                    rank_env=_hosts(layout))


# ---------------------------------------------------------------- which bytes went where

ROWS = 1 << 18  # float32 x 4 columns: each rank's block is 4 MiB, S = 16 MiB on 4 ranks


def _traffic(comm, collective):
    """This rank's bytes sent per peer (TCP, shm) by one large allgather or reducescatter
    of S bytes (the gathered result, or the reducescatter's input)."""
    size = comm.size()
    rows = ROWS if collective == "allgather" else ROWS * size
    x = np.full((rows, 4), comm.rank() + 1, dtype=np.float32)
    before = comm.traffic()
    if collective == "allgather":
        got = comm.allgather(x, name="traffic")
        want = np.repeat(np.arange(1, size + 1, dtype=np.float32), ROWS)
        assert np.array_equal(got[:, 0], want)
    else:
        got = comm.reducescatter(x, op=rs.Sum, name="traffic")
        assert got.shape == (ROWS, 4) and np.all(got == sum(range(1, size + 1)))
    after = comm.traffic()
    return {via: np.subtract(after[via], before[via]) for via in ("tcp", "shm")}


def _run_traffic(collective, mode):
    env = {**BASE_ENV, "RINGSYNC_HIERARCHICAL_ALLREDUCE": mode}
    return assert_ranks_ok(_traffic, 4, timeout=TIMEOUT, env=env, rank_env=_hosts("2x2"),
                           args=(collective,))


@pytest.mark.parametrize("collective", ["allgather", "reducescatter"])
def test_hierarchical_sends_the_link_bound_out_of_each_host_and_the_ring_more(collective):
    """2 hosts x 2 ranks, S bytes, blocks of S/4. Hierarchical: each rank sends its cross
    peer one block over TCP (so (H-1)/H * S = S/2 leaves each host, the bound) and its host
    peer one block per host over shared memory; the flat ring sends (N-1)/N * S = 3S/4 out
    of each host through the one rank whose right neighbour is on the other host. auto
    goes hierarchical at S (from RINGSYNC_HIERARCHICAL_BYTES, 1 MiB)."""
    hosts, s = LAYOUTS["2x2"], 4 * 4 * ROWS * 4
    cross_peer, host_peer = {0: 2, 1: 3, 2: 0, 3: 1}, {0: 1, 1: 0, 2: 3, 3: 2}
    for mode in ("on", "auto"):
        hier = _run_traffic(collective, mode)
        for r, t in enumerate(hier):
            assert abs(int(t["tcp"][cross_peer[r]]) - s // 4) <= SLACK, (mode, r, t)
            assert int(t["tcp"].sum() - t["tcp"][cross_peer[r]]) <= SLACK, (mode, r, t)
            assert abs(int(t["shm"][host_peer[r]]) - s // 2) <= SLACK, (mode, r, t)
        _assert_same_host_bytes_on_shm(hier, hosts)
        for host in "ab":
            assert abs(_host_tcp(hier, hosts, host) - s // 2) <= 2 * SLACK, (mode, hier)
    flat = _run_traffic(collective, "off")
    for host in "ab":
        assert abs(_host_tcp(flat, hosts, host) - 3 * s // 4) <= 2 * SLACK, flat
