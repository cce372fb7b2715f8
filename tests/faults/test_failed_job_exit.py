"""A failed job never exits 0 (issue 26): ``ringsync run``, with and without --elastic,
exits non-zero naming the failed ranks when a rank raises, when every rank raises, when a
rank calls sys.exit(3) (status 3) and when every rank is SIGKILLed from outside; and it
still exits 0 when elastic survivors finish. Under plain ``mpirun --with-ft ulfm`` the
last rank left alive ends with its own status, so that mpirun fails too.

Each test starts a real job and watches it from outside: the launcher runs in a session
of its own with a deadline, and every assertion shows the launcher's whole output (every
rank's lines, tagged with the rank). Whatever a test started is killed in a ``finally``.
"""
import os
import signal
import subprocess
import sys
import time

import pytest

import ringsync as rs
from ringsync.launch import cli
from ringsync.testing import run_mpi

pytestmark = [
    pytest.mark.requires_mpirun,
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc"),
]

PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(cli.__file__))))  # ringsync/launch/cli.py: three levels down
DEADLINE = 150  # one job's start-up, failure and end on a busy 2-core machine
MODES = {"plain": (), "elastic": ("--elastic",)}

# Each program starts the same way: a ring of two, then the case's own lines.
PROLOGUE = """\
import os, signal, sys, time
import ringsync as rs
rs.init()
rank = rs.rank()
folder = sys.argv[1]
"""
ONE_RANK_RAISES = """\
if rank == 1:
    raise RuntimeError("boom on rank 1")
rs.barrier()  # rank 0: fails too (CommunicationError), once rank 1 is gone
"""
EVERY_RANK_RAISES = """\
raise RuntimeError(f"boom on rank {rank}")
"""
ONE_RANK_EXITS_3 = """\
if rank == 1:
    sys.exit(3)
"""
WAITS_TO_BE_KILLED = """\
with open(os.path.join(folder, f"rank{rank}.pid"), "w") as f:
    f.write(str(os.getpid()))
while True:
    time.sleep(0.05)
"""
A_SURVIVOR_FINISHES = """\
if rank == 1:
    os.kill(os.getpid(), signal.SIGKILL)
try:
    rs.barrier()
except rs.CommunicationError as e:
    print(f"rank {rank} survived the loss of rank 1: {e}", flush=True)
"""


class Job:
    """``ringsync run -np 2 [--elastic] python <program> <folder>``."""

    def __init__(self, tmp_path, mode, body):
        self.folder = tmp_path
        script = tmp_path / "rank.py"
        script.write_text(PROLOGUE + body)
        self.log_path = tmp_path / "launcher.log"
        self.log = open(self.log_path, "w")
        env = dict(os.environ, PYTHONPATH=PACKAGE_ROOT, PYTHONUNBUFFERED="1",
                   RINGSYNC_TIMEOUT_SECONDS="60")
        self.launcher = subprocess.Popen(
            [sys.executable, "-m", "ringsync.launch.cli", "run", *MODES[mode], "-np", "2",
             sys.executable, str(script), str(tmp_path)],
            stdout=self.log, stderr=subprocess.STDOUT, env=env, start_new_session=True)

    def output(self) -> str:
        self.log.flush()
        return "launcher output (every rank's lines):\n" + self.log_path.read_text()

    def wait(self) -> int:
        try:
            return self.launcher.wait(timeout=DEADLINE)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the job did not end within {DEADLINE} s\n{self.output()}")

    def rank_pids(self) -> list:
        """Both ranks' pids, once both have written them."""
        give_up = time.monotonic() + DEADLINE
        paths = [self.folder / f"rank{r}.pid" for r in (0, 1)]
        while not all(p.exists() and p.read_text() for p in paths):
            if time.monotonic() > give_up or self.launcher.poll() is not None:
                pytest.fail(f"both ranks did not start within {DEADLINE} s\n{self.output()}")
            time.sleep(0.05)
        return [int(p.read_text()) for p in paths]

    def clean_up(self):
        if self.launcher.poll() is None:
            os.killpg(self.launcher.pid, signal.SIGKILL)  # (mpirun dies with it: SIGTERM)
            self.launcher.wait()
        self.log.close()


@pytest.fixture
def start_job(tmp_path):
    jobs = []

    def start(mode, body):
        jobs.append(Job(tmp_path, mode, body))
        return jobs[-1]

    try:
        yield start
    finally:
        for job in jobs:
            job.clean_up()


def launcher_says(job) -> str:
    lines = [line for line in job.output().splitlines() if line.startswith("ringsync run: ")]
    return "\n".join(lines)


@pytest.mark.parametrize("mode", sorted(MODES))
def test_one_rank_raising_fails_the_job(start_job, mode):
    job = start_job(mode, ONE_RANK_RAISES)
    status = job.wait()
    assert status != 0, job.output()
    assert "the job failed" in launcher_says(job), job.output()
    assert "rank 1 failed (RuntimeError: boom on rank 1)" in launcher_says(job), job.output()


@pytest.mark.parametrize("mode", sorted(MODES))
def test_every_rank_raising_fails_the_job(start_job, mode):
    job = start_job(mode, EVERY_RANK_RAISES)
    status = job.wait()
    assert status != 0, job.output()
    for rank in (0, 1):
        assert f"rank {rank} failed (RuntimeError: boom on rank {rank})" in launcher_says(job), \
            job.output()


@pytest.mark.parametrize("mode", sorted(MODES))
def test_sys_exit_3_is_the_jobs_status(start_job, mode):
    job = start_job(mode, ONE_RANK_EXITS_3)
    status = job.wait()
    assert status == 3, job.output()
    assert "the job failed (exit status 3)" in launcher_says(job), job.output()


@pytest.mark.parametrize("mode", sorted(MODES))
def test_every_rank_killed_from_outside_fails_the_job(start_job, mode):
    job = start_job(mode, WAITS_TO_BE_KILLED)
    for pid in job.rank_pids():
        os.kill(pid, signal.SIGKILL)
    status = job.wait()
    assert status != 0, job.output()
    for rank in (0, 1):
        assert f"rank {rank} ended without a record" in launcher_says(job), job.output()


def test_elastic_survivors_that_finish_are_a_finished_job(start_job):
    job = start_job("elastic", A_SURVIVOR_FINISHES)
    status = job.wait()
    assert status == 0, job.output()
    assert "rank 0 survived the loss of rank 1" in job.output()
    assert launcher_says(job) == "", job.output()


def test_without_elastic_a_lost_rank_fails_the_job(start_job):
    job = start_job("plain", A_SURVIVOR_FINISHES)
    assert job.wait() != 0, job.output()


# --------------------------------------------------------------------------- plain mpirun


def one_rank_raises_the_other_fails_after_it():
    rs.init()
    if rs.rank() == 1:
        raise RuntimeError("boom on rank 1")
    rs.barrier()  # fails (CommunicationError): rank 0 is then the last rank alive


def test_plain_ulfm_mpirun_fails_through_the_last_ranks_own_exit():
    """No launcher: rank 1 kills itself (rank 0 is alive); rank 0 fails next, sees that
    no other rank is left, and exits with status 1 instead of a signal."""
    result = run_mpi(one_rank_raises_the_other_fails_after_it, np=2, timeout=DEADLINE,
                     mpirun_args=("--with-ft", "ulfm"), env={"RINGSYNC_TIMEOUT_SECONDS": "60"})
    assert not result.timed_out, result.report()
    assert result.returncode != 0, result.report()
    assert "RuntimeError: boom on rank 1" in result.outcomes[1], result.report()
    assert "CommunicationError" in result.outcomes[0], result.report()
