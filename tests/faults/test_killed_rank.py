"""A rank SIGKILLed in the middle of allreduces: under ULFM (which keeps the survivors
running) every survivor raises CommunicationError naming the lost rank, long before the
timeout, and nothing of the job is left running."""
import os
import subprocess

import pytest

from ringsync.testing import run_mpi

pytestmark = pytest.mark.requires_mpirun


def shared_memory_segments():
    return {p for p in os.listdir("/dev/shm") if p.startswith("ringsync-")} \
        if os.path.isdir("/dev/shm") else set()


@pytest.mark.parametrize("victim", [0, 2])
def test_survivors_name_the_killed_rank(victim, tmp_path):
    segments_before = shared_memory_segments()
    marker = f"ringsync-kill-test-{os.getpid()}-{victim}"
    result = run_mpi("tests.mpi.bodies:killed_peer_fails_the_others", np=4, timeout=90,
                     args=(marker,), mpirun_args=("--with-ft", "ulfm"),
                     env={"RINGSYNC_TEST_DIR": str(tmp_path), "RINGSYNC_TEST_VICTIM": str(victim),
                          # Far beyond the test's deadline: only failure detection can pass.
                          "RINGSYNC_TIMEOUT_SECONDS": "600"})
    assert not result.timed_out, result.report()
    survivors = sorted(int(p.name.split("-")[1]) for p in tmp_path.glob("survivor-*"))
    assert survivors == [r for r in range(4) if r != victim], result.report()
    for path in tmp_path.glob("survivor-*"):
        message = path.read_text()
        assert f"connection to rank {victim} (host" in message, message
    leftover = subprocess.run(["pgrep", "-f", marker], capture_output=True, text=True).stdout
    assert not leftover.strip(), f"processes left running: {leftover}"
    # Segments are unlinked once mapped: a killed rank leaves none behind.
    assert shared_memory_segments() <= segments_before


def test_plain_mpirun_ends_the_job_when_a_rank_is_killed(tmp_path):
    """Without ULFM, mpirun itself ends the job: a failure, promptly, and no leftovers."""
    marker = f"ringsync-kill-plain-{os.getpid()}"
    result = run_mpi("tests.mpi.bodies:killed_peer_fails_the_others", np=3, timeout=90,
                     args=(marker,),
                     env={"RINGSYNC_TEST_DIR": str(tmp_path), "RINGSYNC_TEST_VICTIM": "1",
                          "RINGSYNC_TIMEOUT_SECONDS": "600"})
    assert not result.timed_out, result.report()
    assert result.returncode != 0, result.report()
    leftover = subprocess.run(["pgrep", "-f", marker], capture_output=True, text=True).stdout
    assert not leftover.strip(), f"processes left running: {leftover}"


def test_a_slow_peer_times_out_instead_of_hanging():
    from ringsync.testing import assert_mpi_ok
    assert_mpi_ok("tests.mpi.bodies:slow_peer_times_out", np=2, timeout=60)
