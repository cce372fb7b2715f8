"""ringsync.testing and its pytest plugin, in one process: what needs no MPI job. A
target the ranks could not import is refused before mpirun starts; only a launcher that
failed to start is retried; @pytest.mark.ranks runs a test in place inside a rank, skips
without mpirun, and refuses malformed markers.

The tests that start jobs under mpirun are in tests/mpi/test_testing_helper.py."""

import os

import pytest

from ringsync import pytest_plugin
from ringsync.testing import MISSING, OK, run_mpi

pytest_plugins = ["pytester"]  # runs small test files in a pytest of their own


# ---------------------------------------------------------------- run_mpi

def test_a_function_that_ranks_cannot_import_is_refused():
    def nested():
        pass

    with pytest.raises(ValueError, match="top level of an importable module"):
        run_mpi(nested, np=1)


def test_only_a_launcher_that_failed_to_start_is_retried():
    from ringsync.testing import MPIResult, _launcher_failed

    def result(returncode, output, outcomes, timed_out=False):
        return MPIResult("t:f", 2, ["mpirun"], returncode, output, outcomes, timed_out, 10)

    pmix = "The PMIx server's listener thread failed to start. We cannot\ncontinue."
    assert _launcher_failed(result(213, pmix, {0: MISSING, 1: MISSING}))
    assert not _launcher_failed(result(213, pmix, {0: OK, 1: MISSING}))  # a rank ran
    assert not _launcher_failed(result(1, "Traceback ...", {0: MISSING, 1: MISSING}))
    assert not _launcher_failed(result(0, pmix, {0: OK, 1: OK}))


# ---------------------------------------------------------------- @pytest.mark.ranks

RANKS_TEST = """
import os
import pytest

@pytest.mark.ranks([2, 4])
def test_here():
    assert os.getpid() == %d
"""


def test_marker_does_nothing_inside_a_rank(pytester, monkeypatch):
    """Under `mpirun -np 4 pytest` the test runs in place, on the ranks mpirun started."""
    monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "4")
    pytester.makepyfile(RANKS_TEST % os.getpid())
    result = pytester.runpytest("-p", "ringsync.pytest_plugin", "-v")
    result.assert_outcomes(passed=2)
    result.stdout.fnmatch_lines(["*test_here?np2? PASSED*", "*test_here?np4? PASSED*"])


def test_marker_skips_without_mpirun(pytester, monkeypatch):
    monkeypatch.setattr(pytest_plugin, "mpirun_path", lambda: None)
    pytester.makepyfile(RANKS_TEST % -1)
    result = pytester.runpytest("-p", "ringsync.pytest_plugin", "-rs")
    result.assert_outcomes(skipped=2)
    result.stdout.fnmatch_lines(["*no mpirun installed*"])


@pytest.mark.parametrize("marker", ["ranks(0)", "ranks([])", "ranks(2, np=3)"])
def test_bad_markers_are_errors(pytester, marker):
    pytester.makepyfile("import pytest\n@pytest.mark.%s\ndef test_x():\n    pass\n" % marker)
    result = pytester.runpytest("-p", "ringsync.pytest_plugin")
    result.stdout.fnmatch_lines(["*ERROR collecting*", "@pytest.mark.ranks: *"])
    assert "Traceback" not in result.stdout.str() and result.ret != 0
