"""init() and process sets as Horovod's (issue 26, part 4): a set of an existing set's
ranks is refused with Horovod's ValueError; an init whose process sets are refused leaves
ringsync not initialised on every rank, so the next init builds the ring and its sets; an
init while initialised attaches the sets given to the registered ones; and init() starts
MPI itself when mpi4py was told not to (mpi4py.rc.initialize = False)."""
import subprocess
import sys

import numpy as np
import pytest

import ringsync as rs
from ringsync import testing

pytestmark = pytest.mark.requires_mpirun

DEADLINE = 120


def _reduces_over(ps, tag):
    """An allreduce on ps from each member, with data that differs by rank."""
    if not ps.included():
        return
    me = rs.rank()
    got = rs._comm(ps).allreduce(np.arange(6, dtype=np.int64) * (me + 1), op=rs.Sum,
                                 name=f"check.{tag}")
    want = sum(np.arange(6, dtype=np.int64) * (r + 1) for r in ps.ranks)
    np.testing.assert_array_equal(got, want)


@pytest.mark.ranks(2, timeout=DEADLINE)
def test_a_set_of_an_existing_sets_ranks_is_refused_as_in_horovod():
    rs.init()
    both = rs.add_process_set([1, 0])
    for again in ([0, 1], rs.ProcessSet([1, 0])):
        # Horovod: ValueError("Attempted to add a duplicate process set: ...")
        with pytest.raises(ValueError, match="attempted to add a duplicate process set"):
            rs.add_process_set(again)
    assert rs.add_process_set([1]).process_set_id == both.process_set_id + 1
    _reduces_over(both, "both")
    rs.shutdown()


@pytest.mark.ranks(2, timeout=DEADLINE)
def test_a_failed_init_leaves_ringsync_uninitialized_and_the_next_one_attaches_the_sets():
    with pytest.raises(rs.UsageError, match="entry number 1: .*duplicate process set"):
        rs.init(process_sets=[rs.ProcessSet([0]), rs.ProcessSet([0])])
    assert not rs.is_initialized()
    low, high = rs.ProcessSet([0]), rs.ProcessSet([1])
    rs.init(process_sets=[low, high])
    assert (low.process_set_id, high.process_set_id) == (1, 2)
    _reduces_over(low, "low")
    # Called again while initialised: Horovod attaches the sets given to the registered
    # ones of the same ranks (and refuses unknown or repeated ones).
    again = rs.ProcessSet([1])
    rs.init(process_sets=[again, rs.global_process_set])
    assert again.process_set_id == high.process_set_id and again.size() == 1
    _reduces_over(again, "again")
    with pytest.raises(rs.UsageError, match="is not a registered set"):
        rs.init(process_sets=[rs.ProcessSet([0, 1])])
    with pytest.raises(rs.UsageError, match="entry number 1 is a duplicate"):
        rs.init(process_sets=[rs.ProcessSet([0]), rs.ProcessSet([0])])
    assert rs.remove_process_set(again) and high.process_set_id is None
    rs.shutdown()


MPI_LEFT_TO_RINGSYNC = """\
import mpi4py
mpi4py.rc.initialize = False  # the user's choice: ringsync.init() must start MPI
import numpy as np
import ringsync as rs
from mpi4py import MPI
assert not MPI.Is_initialized()
rs.init()
me = rs.rank()
got = rs.allreduce(np.full(3, me + 1, np.int64), op=rs.Sum)
multiple = MPI.Query_thread() == MPI.THREAD_MULTIPLE  # (mpi4py.rc.thread_level's default)
print(f"rank {me} of {rs.size()}: {got.tolist()}, THREAD_MULTIPLE: {multiple}", flush=True)
rs.shutdown()
"""


def test_init_starts_mpi_when_mpi4py_was_told_not_to(tmp_path):
    script = tmp_path / "rank.py"
    script.write_text(MPI_LEFT_TO_RINGSYNC)
    command = testing.mpirun_command(2, [], [sys.executable, str(script)])
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=DEADLINE,
                              env=testing.child_environment("", {}), start_new_session=True)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"the job did not end within {DEADLINE} s:\n{e.stdout}\n{e.stderr}")
    output = f"command: {command}\nexit status {done.returncode}\n{done.stdout}{done.stderr}"
    # (a clean exit also says that MPI was finalized: Open MPI fails a job whose rank
    # exits without MPI_Finalize after MPI_Init)
    assert done.returncode == 0, output
    for rank in (0, 1):
        assert f"rank {rank} of 2: [3, 3, 3], THREAD_MULTIPLE: True" in done.stdout, output
