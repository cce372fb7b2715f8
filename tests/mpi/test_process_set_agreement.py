"""A process-set change refused on one rank only fails on every rank (issue 26): the ranks
agree on the change before any of them enters MPI_Comm_split, so none is left there when
another rank's add_process_set was refused (a duplicate set, a set that leaves the rank
out while the others' includes it, ranks that are not the job's). The cores are loaded by
busy loops that the test starts (and kills in a ``finally``); after each refusal the next
add_process_set works on every rank, with the same id, and its ring reduces correctly.
"""
import os
import subprocess
import sys

import numpy as np
import pytest

import ringsync as rs
from ringsync.testing import run_mpi

pytestmark = pytest.mark.requires_mpirun

DEADLINE = 120  # the job; a refusal must come within the start timeout, far below
START_TIMEOUT = "30"

# What each rank asks for in the refused change, by kind. Both ranks first add set [1],
# which makes [1] a duplicate.
REFUSED_CHANGES = {
    "duplicate": {0: [0], 1: [1]},       # rank 1 alone asks for [1] again
    "not_a_member": {0: [0, 1], 1: [0]},  # rank 1 leaves itself out, rank 0 keeps it in
    "bad_ranks": {0: [0, 1], 1: [0, 7]},  # rank 7 is no rank of a 2-rank job
}
EXPECTED_WORDS = {
    "duplicate": "refused on rank(s) [1]: rank 1: attempted to add a duplicate process set",
    "not_a_member": "every rank must add the same set: rank 0 gave ranks [0, 1], rank 1 "
                    "gave ranks [0]",
    "bad_ranks": "refused on rank(s) [1]: rank 1: ranks [0, 7] must be distinct ranks of "
                 "the job (0..1)",
}


def refused_change_then_next_works(kind):
    rs.init()
    me = rs.rank()
    first = rs.add_process_set([1])
    try:
        rs.add_process_set(REFUSED_CHANGES[kind][me])
    except rs.UsageError as e:
        assert EXPECTED_WORDS[kind] in str(e), f"rank {me}: {e}"
    else:
        raise AssertionError(f"rank {me}: the {kind} change was not refused here")
    # The job goes on in step: the next set has the same id on every rank, and works.
    second = rs.add_process_set([0])
    ids = rs.allgather_object((first.process_set_id, second.process_set_id))
    assert ids == [(1, 2), (1, 2)], f"rank {me}: set ids per rank {ids}"
    for ps in (first, second):
        if ps.included():
            data = np.arange(5, dtype=np.int64) * (me + 3)
            got = rs._comm(ps).allreduce(data, op=rs.Sum, name=f"after.{kind}")
            np.testing.assert_array_equal(got, data)  # a set of one: its own data
    total = rs.allreduce(np.array([me + 1], np.int64), op=rs.Sum, name=f"world.{kind}")
    assert total.tolist() == [3], f"rank {me}: {total}"
    rs.shutdown()


class BusyCores:
    """One busy loop per core, so the ranks run late and at different times."""

    def __enter__(self):
        self.loops = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
                      for _ in range(max(2, len(os.sched_getaffinity(0))))]
        return self

    def __exit__(self, *exc):
        for loop in self.loops:
            loop.kill()
            loop.wait()


@pytest.mark.parametrize("kind", sorted(REFUSED_CHANGES))
def test_a_change_refused_on_one_rank_fails_on_every_rank_under_load(kind):
    with BusyCores():
        result = run_mpi(refused_change_then_next_works, np=2, timeout=DEADLINE,
                         args=(kind,), env={"RINGSYNC_START_TIMEOUT_SECONDS": START_TIMEOUT,
                                            "RINGSYNC_TIMEOUT_SECONDS": "60"})
    assert result.ok, result.report()
