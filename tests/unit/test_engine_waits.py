"""Waits without wake-ups: while a calling thread is blocked waiting for the engine
(rs_engine_wait: synchronize, a blocking call the engine runs), that thread's core is idle,
so the engine's shared-memory waits for its peers spin for the lane's spin time
(RINGSYNC_LANE_SPIN_US) before they sleep, and an exchange costs no wake-up.
rs_comm_callers_waiting counts the blocked callers; these tests show that it follows a
caller into its wait and out of it (done, failed), and that collectives stay right while
the engine spins. Thread ranks (tests/thread_ranks.py), all on one host (shared memory)."""
import threading

import numpy as np

import ringsync as rs
from ringsync._native import lib

from tests.common.reference import assert_reduced, rank_input
from tests.thread_ranks import assert_ranks_ok

TIMEOUT = 120  # seconds for one whole run; a hang fails with every rank's stack
DEADLINE = 60  # seconds any one condition may take to come true
# Spin long (2 ms), so that the engine spins through every exchange of these tests.
ENV = {"RINGSYNC_TIMEOUT_SECONDS": "60", "RINGSYNC_LANE_SPIN_US": "2000"}


def _callers_waiting(comm):
    return lib.rs_comm_callers_waiting(comm._ring.c)


def _wait_until(condition, what):
    event = threading.Event()
    for _ in range(DEADLINE * 1000):
        if condition():
            return
        event.wait(0.001)
    raise AssertionError(f"not within {DEADLINE} s: {what}")


def test_a_caller_blocked_in_synchronize_is_counted_until_its_wait_ends():
    """Rank 0 synchronizes a handle whose peer has not submitted yet; a watcher thread sees
    the count reach 1, and only then does rank 1 submit. Afterwards the count is 0 again,
    on every rank, also after a wait that failed (a shape mismatch)."""
    blocked = threading.Event()

    def body(comm):
        me, n = comm.rank(), comm.size()
        inputs = [rank_input(r, (1000,), "float32", "Sum", "late") for r in range(n)]
        if me == 0:
            handle = comm.allreduce_async(inputs[me], op=rs.Sum, name="late")
            watcher = threading.Thread(target=lambda: (
                _wait_until(lambda: _callers_waiting(comm) == 1, "rank 0's caller counted"),
                blocked.set()))
            watcher.start()
            got = comm.synchronize(handle)
            watcher.join()
        else:
            assert blocked.wait(DEADLINE), "rank 0's blocked caller was never counted"
            got = comm.synchronize(comm.allreduce_async(inputs[me], op=rs.Sum, name="late"))
        assert_reduced(got, inputs, "Sum", what=f"rank {me}: late")
        assert _callers_waiting(comm) == 0
        # a wait that fails: every rank's call is refused, and nobody stays counted
        shape = (4,) if me == 0 else (5,)
        handle = comm.allreduce_async(np.ones(shape, np.float32), name="mismatch")
        try:
            comm.synchronize(handle)
        except rs.UsageError as e:
            assert "mismatch" in str(e) or "shape" in str(e), str(e)
        else:
            raise AssertionError(f"rank {me}: the mismatched allreduce did not fail")
        assert _callers_waiting(comm) == 0
        return True

    assert_ranks_ok(body, 2, timeout=TIMEOUT, env=ENV)


def test_batches_are_right_while_the_engine_spins_for_waiting_callers():
    """Rounds of 40 asynchronous allreduces of several dtypes, ops and shapes, submitted
    in one batch and synchronized, on 3 ranks: every result against numpy's."""
    cases = [(dtype, op, shape) for dtype in ("float32", "int32", "float64")
             for op in ("Sum", "Max") for shape in [(1,), (7,), (1000,), (3, 33)]]

    def body(comm):
        me, n = comm.rank(), comm.size()
        for round_ in range(5):
            batch = []
            for i, (dtype, op, shape) in enumerate(cases * 2):
                inputs = [rank_input(r, shape, dtype, op, f"{round_}.{i}") for r in range(n)]
                batch.append((inputs, op, f"r{round_}.t{i}"))
            handles = [comm.allreduce_async(inputs[me], op=getattr(rs, op), name=name)
                       for inputs, op, name in batch]
            for handle, (inputs, op, name) in zip(handles, batch):
                assert_reduced(comm.synchronize(handle), inputs, op, what=f"rank {me}: {name}")
        assert _callers_waiting(comm) == 0
        return True

    assert_ranks_ok(body, 3, timeout=TIMEOUT, env=ENV)
