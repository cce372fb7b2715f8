"""Careless and hostile input from the Python side never corrupts memory, returns wrong
numbers or stalls the job (issue: hardening). Each test reproduces the bad input."""
import pytest

from ringsync.testing import assert_mpi_ok, run_mpi

pytestmark = pytest.mark.requires_mpirun

BODY = "tests.faults.hardening_bodies:"
ENV = {"RINGSYNC_TIMEOUT_SECONDS": "60"}


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_dropped_handles_keep_their_buffers(transport):
    assert_mpi_ok(BODY + "dropped_handles_keep_their_buffers", np=2, timeout=240,
                  env={**ENV, "RINGSYNC_TRANSPORT": transport})


def test_dropped_torch_handles_keep_their_host_copies():
    pytest.importorskip("torch")
    assert_mpi_ok(BODY + "dropped_torch_handles_keep_their_host_copies", np=2, timeout=240,
                  env=ENV)


@pytest.mark.parametrize("variable,value", [
    ("FUSION_THRESHOLD", "4096"), ("CACHE_CAPACITY", "16"), ("SMALL_ALLREDUCE_BYTES", "0"),
    ("STAGED_BYTES", "0"), ("TRANSPORT", "tcp"), ("LANE_BYTES", "0"),
])
def test_ranks_with_different_settings_fail_init(variable, value):
    assert_mpi_ok(BODY + "differing_setting_fails_init_everywhere", np=3, timeout=120,
                  args=(variable, value), env=ENV)


def test_per_rank_settings_may_differ():
    assert_mpi_ok(BODY + "per_rank_settings_may_differ", np=2, timeout=120, env=ENV)


@pytest.mark.parametrize("np", [1, 2, 3])
def test_overflowing_sizes_are_usage_errors(np):
    assert_mpi_ok(BODY + "overflowing_sizes_are_usage_errors", np=np, timeout=120, env=ENV)


@pytest.mark.parametrize("np", [1, 2])
def test_bad_names_and_scale_factors(np):
    assert_mpi_ok(BODY + "bad_names_and_scale_factors_are_usage_errors", np=np, timeout=120,
                  env=ENV)


def test_timeline_refuses_a_planted_symlink(tmp_path):
    assert_mpi_ok(BODY + "timeline_refuses_a_planted_symlink", np=2, timeout=120,
                  args=(str(tmp_path),), env=ENV)


@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_one_rank_out_of_memory_breaks_the_ring_everywhere(transport, tmp_path):
    result = run_mpi(BODY + "one_rank_out_of_memory_breaks_the_ring", np=3, timeout=180,
                     args=("1",), env={**ENV, "RINGSYNC_TRANSPORT": transport,
                                       "RINGSYNC_TEST_DIR": str(tmp_path)})
    assert not result.timed_out, result.report()
    reported = sorted(int(p.name.split("-")[1]) for p in tmp_path.glob("reported-*"))
    assert reported == [0, 1, 2], result.report()
