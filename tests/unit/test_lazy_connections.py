"""Connections to the peers the algorithms need: at setup a rank connects to its ring
neighbours and its log-round partners (recursive doubling: rank ^ 2^k), and the small
collectives (allreduce by recursive doubling, the negotiation's allgather, the barrier,
the tree broadcast from rank 0) use only those; any other peer is connected on first use
(alltoall, a broadcast from another root), from whichever end needs it first. Thread
ranks over TCP in one process, so the process's sockets are every rank's."""
import os
import threading

import numpy as np

import ringsync as rs

from tests.thread_ranks import assert_ranks_ok

RANKS = 16
# Ranks 0..15: each has 5 partners (r^1, r^2, r^4, r^8 and the other ring neighbour), so
# the job holds 16 listening sockets and both ends of 16 * 5 / 2 connections.
SETUP_SOCKETS = RANKS + RANKS * 5
FULL_MESH_SOCKETS = RANKS + RANKS * (RANKS - 1)
ENV = {"RINGSYNC_TRANSPORT": "tcp", "RINGSYNC_TIMEOUT_SECONDS": "60"}


def sockets():
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            count += os.readlink(f"/proc/self/fd/{fd}").startswith("socket:")
        except OSError:  # closed meanwhile
            pass
    return count


def test_setup_and_small_collectives_keep_log_partners_and_others_connect_on_use():
    before = sockets()
    counts = {}
    meet = threading.Barrier(RANKS)

    def count(comm, phase):
        comm.barrier()
        meet.wait(60)
        if comm.rank() == 0:
            counts[phase] = sockets() - before
        meet.wait(60)

    def body(comm):
        me, n = comm.rank(), comm.size()
        count(comm, "setup")
        index = np.arange(7, dtype=np.int64)
        for step in range(5):
            got = comm.allreduce(me * 1000 + index + step, op=rs.Sum, name=f"small{step}")
            np.testing.assert_array_equal(got, n * (index + step) + 1000 * n * (n - 1) // 2)
        got = comm.allgather(np.full((me % 3 + 1, 2), me, np.int32))
        np.testing.assert_array_equal(got[:, 0], np.repeat(np.arange(n), np.arange(n) % 3 + 1))
        x = np.arange(100, dtype=np.float64) + 0.5 if me == 0 else np.zeros(100)
        np.testing.assert_array_equal(comm.broadcast(x, root_rank=0),
                                      np.arange(100, dtype=np.float64) + 0.5)
        count(comm, "small collectives")
        x = np.arange(100, dtype=np.float64) + 5 if me == 5 else np.zeros(100)
        np.testing.assert_array_equal(comm.broadcast(x, root_rank=5),
                                      np.arange(100, dtype=np.float64) + 5)
        sent = np.arange(n, dtype=np.int64) * 100 + me
        np.testing.assert_array_equal(comm.alltoall(sent), np.arange(n) * 1 + me * 100)
        count(comm, "alltoall")

    assert_ranks_ok(body, RANKS, env=ENV, timeout=240)
    assert counts["setup"] == SETUP_SOCKETS, counts
    assert counts["small collectives"] == SETUP_SOCKETS, counts
    assert counts["alltoall"] == FULL_MESH_SOCKETS, counts
