"""A failed blocking call never leaves the ranks one call apart: mismatched calls of every
kind (dtype, shape, op, scale, name, root, splits, arguments only one rank's checks refuse)
fail on every rank, whatever the timing, and the correct call after each succeeds on every
rank. Ranks are threads (tests/thread_ranks.py) with random per-rank delays, on each
same-host path: the lane (matched in call order through shared memory) and the engine
over TCP and over shared memory (matched by negotiation). The same stress under mpirun,
with the cores loaded, is tests/faults/test_mismatch_under_load.py."""
import pytest

from tests.common import mismatches
from tests.thread_ranks import PATHS, assert_ranks_ok

TIMEOUT = 300
# A short hard limit: a call left waiting for a peer that moved on fails the test in
# seconds (with every rank's traceback) instead of at the deadline.
ENV = {"RINGSYNC_TIMEOUT_SECONDS": "20"}


def _check_every_rank_failed_each(logs, rounds):
    for rank, log in enumerate(logs):
        assert len(log) == rounds, f"rank {rank} logged {len(log)} of {rounds} failures"
    for i in range(rounds):
        cases = {log[i].split(":")[0] for log in logs}
        assert len(cases) == 1, f"round {i}: the ranks failed different calls: {cases}"


@pytest.mark.parametrize("path,size,rounds", [
    ("shm", 2, 1200), ("tcp", 2, 600), ("shm-ring", 2, 600), ("shm", 3, 300), ("tcp", 3, 300),
])
def test_mismatched_blocking_calls_fail_on_every_rank_and_the_next_call_works(path, size,
                                                                               rounds):
    logs = assert_ranks_ok(mismatches.stress, size, timeout=TIMEOUT,
                           env={**ENV, **PATHS[path]}, args=(rounds, 26))
    _check_every_rank_failed_each(logs, rounds)
