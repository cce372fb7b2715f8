"""ringsync.testing and its pytest plugin under mpirun: outcomes of every rank, failures
that show all ranks, deadlines, and @pytest.mark.ranks.

What needs no MPI job (targets refused before a start, the launcher retry rule, markers
inside a rank, without mpirun, or malformed) is in tests/unit/test_testing_helper.py."""

import os
import pathlib
import subprocess
import sys
import time
import uuid

import pytest

from ringsync.testing import MISSING, OK, assert_mpi_fails, assert_mpi_ok, run_mpi

pytest_plugins = ["pytester"]  # runs small test files in a pytest of their own
pytestmark = pytest.mark.requires_mpirun


def processes_matching(marker):
    found = subprocess.run(["pgrep", "-f", marker], capture_output=True, text=True)
    return found.stdout.split()


# ---------------------------------------------------------------- rank code for run_mpi

def world():
    from mpi4py import MPI

    return MPI.COMM_WORLD


def all_ranks_ok(*args):
    """Every rank agrees on the sum of ranks and sees the args it was given."""
    comm = world()
    total = comm.allreduce(comm.Get_rank())
    assert total == sum(range(comm.Get_size())), total
    assert list(args) == ["alpha", "2"], args
    print("body ok on rank %d" % comm.Get_rank())


def rank1_raises():
    """Rank 1 raises while rank 0 waits in a barrier it will never leave on its own."""
    comm = world()
    if comm.Get_rank() == 1:
        raise ValueError("rank 1 failed on purpose")
    comm.Barrier()


def rank0_waits_rank1_sleeps(marker):
    """A hang: rank 0 waits in a barrier that rank 1, asleep, never reaches."""
    comm = world()
    print("hang body with %s" % marker, flush=True)
    if comm.Get_rank() == 0:
        comm.Barrier()
    else:
        time.sleep(3600)


def exits_cleanly():
    """sys.exit(0) counts as success."""
    world().Barrier()
    sys.exit(0)


SCRIPT = """\
import sys
from mpi4py import MPI
print("script rank %d args %s" % (MPI.COMM_WORLD.Get_rank(), sys.argv[1:]))
"""


# ---------------------------------------------------------------- run_mpi

def test_good_body_is_ok_on_every_rank():
    result = assert_mpi_ok(all_ranks_ok, np=2, timeout=60, args=("alpha", 2))
    assert result.outcomes == {0: OK, 1: OK}
    assert result.returncode == 0 and not result.timed_out
    assert "body ok on rank 0" in result.output and "body ok on rank 1" in result.output
    assert "[1,1]" in result.output  # lines are tagged with their rank


def test_module_function_name_and_script_targets(tmp_path):
    assert_mpi_ok(__name__ + ":exits_cleanly", np=2, timeout=60)  # and sys.exit(0) is ok
    script = tmp_path / "show_args.py"
    script.write_text(SCRIPT)
    result = assert_mpi_ok(str(script), np=2, timeout=60, args=("x", "--y"))
    for rank in (0, 1):
        assert "script rank %d args ['x', '--y']" % rank in result.output


def test_failing_rank_is_reported_with_its_traceback():
    with pytest.raises(AssertionError) as failure:
        assert_mpi_ok(rank1_raises, np=2, timeout=60)
    message = str(failure.value)
    assert "--- rank 1: FAILED" in message
    assert "Traceback (most recent call last)" in message
    assert "ValueError: rank 1 failed on purpose" in message
    assert "--- rank 0:" in message  # the survivor is listed too
    assert "timed out" not in message.splitlines()[0]  # mpirun ended the job, no deadline


def test_expected_failure_returns_the_result():
    result = assert_mpi_fails(rank1_raises, np=2, timeout=60)
    assert not result.ok and not result.timed_out
    assert "rank 1 failed on purpose" in result.outcomes[1]
    assert result.outcomes[0] in (OK, MISSING)
    with pytest.raises(AssertionError, match="expected a failure"):
        assert_mpi_fails(exits_cleanly, np=2, timeout=60)


def test_hang_times_out_dumps_stacks_and_leaves_no_process():
    marker = "ringsync-hang-" + uuid.uuid4().hex
    result = run_mpi(rank0_waits_rank1_sleeps, np=2, timeout=10, args=(marker,))
    assert result.timed_out and not result.ok
    assert result.outcomes == {0: MISSING, 1: MISSING}
    assert "timed out after 10s" in result.report()
    assert "rank0_waits_rank1_sleeps" in result.output  # the stack dump shows where it hung
    assert processes_matching(marker) == []


# ---------------------------------------------------------------- @pytest.mark.ranks

@pytest.mark.ranks([1, 3])
@pytest.mark.parametrize("value", [("beta", 2, None)])
def test_marker_runs_the_test_on_every_rank(value, tmp_path, rank_count):
    comm = world()
    assert comm.Get_size() == rank_count
    assert value == ("beta", 2, None)  # a tuple stays a tuple
    assert isinstance(tmp_path, pathlib.Path) and tmp_path.is_dir()
    assert comm.allgather(str(tmp_path)) == [str(tmp_path)] * rank_count  # one, shared
    assert os.environ["RINGSYNC_TESTING_RANK"] == "1"


class TestMarkerOnAClass:
    pytestmark = pytest.mark.ranks(2, env={"RINGSYNC_TEST_GREETING": "hello"})

    def test_methods_run_on_a_fresh_instance(self):
        assert isinstance(self, TestMarkerOnAClass)
        assert os.environ["RINGSYNC_TEST_GREETING"] == "hello"
        assert world().Get_size() == 2


# Run by test_marker_reports_failures_deadlines_skips_and_refusals in a pytest of its own.
FAILING_TESTS = """
import os, time
import pytest
from mpi4py import MPI

pytestmark = pytest.mark.ranks(timeout=60, env={"GREETING": "hello", "OTHER": "module"})

@pytest.mark.ranks(2, env={"OTHER": "test"})
def test_defaults_merge():
    assert os.environ["GREETING"] == "hello" and os.environ["OTHER"] == "test"

@pytest.mark.ranks(2)
def test_rank_1_fails():
    if MPI.COMM_WORLD.Get_rank() == 1:
        raise ValueError("rank 1 failed on purpose")
    MPI.COMM_WORLD.Barrier()

@pytest.mark.ranks(2, timeout=5)
def test_rank_1_hangs():
    if MPI.COMM_WORLD.Get_rank() == 1:
        time.sleep(3600)
    MPI.COMM_WORLD.Barrier()

@pytest.mark.ranks(2)
def test_skips_itself():
    pytest.importorskip("no_such_module_for_ringsync")

@pytest.mark.ranks(2)
def test_takes_a_fixture_ranks_cannot_have(monkeypatch):
    pass

def test_without_a_rank_count_runs_here():
    assert "RINGSYNC_TESTING_RANK" not in os.environ
"""


def test_marker_reports_failures_deadlines_skips_and_refusals(pytester):
    pytester.makepyfile(FAILING_TESTS)
    result = pytester.runpytest("-p", "ringsync.pytest_plugin", "-rs")
    result.assert_outcomes(passed=2, failed=3, skipped=1)
    output = result.stdout.str()
    assert "--- rank 1: FAILED" in output
    assert "ValueError: rank 1 failed on purpose" in output
    assert "test_rank_1_fails' on 2 ranks" in output  # the report names the test
    assert "test_rank_1_hangs' on 2 ranks: timed out after 5s" in output
    assert "in test_rank_1_hangs" in output  # rank 1's stack dump shows where it hung
    assert "rank 0: could not import 'no_such_module_for_ringsync'" in output \
        or "rank 1: could not import 'no_such_module_for_ringsync'" in output  # skip reason
    assert "argument 'monkeypatch' (MonkeyPatch) cannot be sent to the ranks" in output
