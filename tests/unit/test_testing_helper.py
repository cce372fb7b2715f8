"""ringsync.testing: outcomes of every rank, failures that show all ranks, deadlines."""

import os
import subprocess
import uuid

import pytest

from ringsync.testing import MISSING, OK, assert_mpi_fails, assert_mpi_ok, run_mpi

pytestmark = pytest.mark.requires_mpirun

BODIES = "tests.unit._helper_bodies"
SCRIPT = os.path.join(os.path.dirname(__file__), "_helper_bodies.py")


def processes_matching(marker):
    found = subprocess.run(["pgrep", "-f", marker], capture_output=True, text=True)
    return found.stdout.split()


def test_good_body_is_ok_on_every_rank():
    result = assert_mpi_ok(BODIES + ":all_ranks_ok", np=2, timeout=60, args=("alpha", 2))
    assert result.outcomes == {0: OK, 1: OK}
    assert result.returncode == 0 and not result.timed_out
    assert "body ok on rank 0" in result.output and "body ok on rank 1" in result.output
    assert "[1,1]" in result.output  # lines are tagged with their rank


def test_script_target_and_sys_exit_zero():
    result = assert_mpi_ok(SCRIPT, np=2, timeout=60, args=("x", "--y"))
    for rank in (0, 1):
        assert "script rank %d args ['x', '--y']" % rank in result.output
    assert_mpi_ok(BODIES + ":exits_cleanly", np=2, timeout=60)


def test_failing_rank_is_reported_with_its_traceback():
    with pytest.raises(AssertionError) as failure:
        assert_mpi_ok(BODIES + ":rank1_raises", np=2, timeout=60)
    message = str(failure.value)
    assert "--- rank 1: FAILED" in message
    assert "Traceback (most recent call last)" in message
    assert "ValueError: rank 1 failed on purpose" in message
    assert "--- rank 0:" in message  # the survivor is listed too
    assert "timed out" not in message.splitlines()[0]  # mpirun ended the job, no deadline


def test_expected_failure_returns_the_result():
    result = assert_mpi_fails(BODIES + ":rank1_raises", np=2, timeout=60)
    assert not result.ok and not result.timed_out
    assert "rank 1 failed on purpose" in result.outcomes[1]
    assert result.outcomes[0] in (OK, MISSING)
    with pytest.raises(AssertionError, match="expected a failure"):
        assert_mpi_fails(BODIES + ":exits_cleanly", np=2, timeout=60)


def test_hang_times_out_dumps_stacks_and_leaves_no_process():
    marker = "ringsync-hang-" + uuid.uuid4().hex
    result = run_mpi(BODIES + ":rank0_waits_rank1_sleeps", np=2, timeout=10, args=(marker,))
    assert result.timed_out and not result.ok
    assert result.outcomes == {0: MISSING, 1: MISSING}
    assert "timed out after 10s" in result.report()
    assert "rank0_waits_rank1_sleeps" in result.output  # the stack dump shows where it hung
    assert processes_matching(marker) == []


def test_only_a_launcher_that_failed_to_start_is_retried():
    from ringsync.testing import MPIResult, _launcher_failed

    def result(returncode, output, outcomes, timed_out=False):
        return MPIResult("t:f", 2, ["mpirun"], returncode, output, outcomes, timed_out, 10)

    pmix = "The PMIx server's listener thread failed to start. We cannot\ncontinue."
    assert _launcher_failed(result(213, pmix, {0: MISSING, 1: MISSING}))
    assert not _launcher_failed(result(213, pmix, {0: OK, 1: MISSING}))  # a rank ran
    assert not _launcher_failed(result(1, "Traceback ...", {0: MISSING, 1: MISSING}))
    assert not _launcher_failed(result(0, pmix, {0: OK, 1: OK}))
