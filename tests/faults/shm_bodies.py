"""Rank-side bodies for test_shm_limits: jobs whose /dev/shm is a tiny private tmpfs.
Results are checked against numpy references built from every rank's input."""
import numpy as np

import ringsync as rs

from tests.mpi.reference import assert_reduced, rank_input

# Through the lane (one round), beyond it (staged or ring), and past a 2 MiB ring.
SIZES = [1, 1009, 100_003, (1 << 20) + 7]


def _inputs(shape, dtype, op, salt):
    return [rank_input(r, shape, dtype, op, salt) for r in range(rs.size())]


def _check_collectives():
    for n in SIZES:
        for dtype, op in [("float32", "Sum"), ("int64", "Max"), ("float64", "Average")]:
            inputs = _inputs((n,), dtype, op, "shm-limits")
            what = f"allreduce {op} {dtype} n={n} on {rs.size()} ranks"
            assert_reduced(rs.allreduce(inputs[rs.rank()], op=getattr(rs, op), name=what),
                           inputs, op, what=what)
        rows = [(r * 7 + n) % 11 for r in range(rs.size())]
        parts = [rank_input(r, (rows[r], 3), "float64", salt=f"ag{n}") for r in range(rs.size())]
        got = rs.allgather(parts[rs.rank()])
        assert np.array_equal(got, np.concatenate(parts)), f"allgather rows {rows}"
    # More than a 2 MiB ring from each rank: every page of the rings gets touched.
    big = _inputs((600_001,), "float64", "Sum", "big")
    assert np.array_equal(rs.allgather(big[rs.rank()]), np.concatenate(big)), "big allgather"


def collectives_over(transport):
    """init() picks `transport` ("shm" or "tcp"); every collective still gives the
    reference results."""
    rs.init()
    _check_collectives()  # first: where pages cannot be had, this is where SIGBUS would strike
    assert rs._default.transport == transport, (rs._default.transport, transport)
    rs.shutdown()


def forced_shm_fails():
    """RINGSYNC_TRANSPORT=shm where the segments do not fit: init() fails on every rank
    with a message that says why and how to avoid it (no SIGBUS, no hang)."""
    try:
        rs.init()
    except rs.RingsyncError as e:
        text = str(e)
        for part in ("RINGSYNC_TRANSPORT=shm, but shared memory", "/dev/shm:", "MiB free",
                     "RINGSYNC_TRANSPORT=tcp avoids it", "cannot reserve"):
            assert part in text, f"{part!r} not in {text!r}"
        print(f"init failed as expected: {text}", flush=True)
    else:
        raise AssertionError(f"init() succeeded over {rs._default.transport} without room in /dev/shm")
    assert not rs.is_initialized()


def split_hosts(first_host_ranks):
    """Ranks below `first_host_ranks` report host "node-a", the others "node-b" (all on
    this machine, sharing its /dev/shm): same-"host" ranks must get shared memory."""
    import os

    from mpi4py import MPI
    k = int(first_host_ranks)
    os.environ["RINGSYNC_HOST_NAME"] = "node-a" if MPI.COMM_WORLD.rank < k else "node-b"
    rs.init()
    local = k if MPI.COMM_WORLD.rank < k else MPI.COMM_WORLD.size - k
    assert rs.local_size() == local, (rs.local_size(), local)
    _check_collectives()
    expected = "shm" if local > 1 else "tcp"
    assert rs._default.transport == expected, (rs._default.transport, expected)
    rs.shutdown()
