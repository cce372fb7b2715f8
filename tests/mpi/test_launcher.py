"""The ringsync command starting real jobs under mpirun: every rank runs, the program's
exit status comes back, Ctrl-C (SIGINT) ends the ranks, and doctor reports the MPI.

The command's one-process tests (mpirun command building with a pretend MPI, signals
passed on to a stand-in for mpirun) are in tests/unit/test_launcher.py."""

import os
import signal
import subprocess
import sys
import uuid

import pytest

from ringsync import launcher

pytestmark = pytest.mark.requires_mpirun

PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(launcher.__file__)))


def run_cli(*argv, **kwargs):
    env = dict(os.environ, PYTHONPATH=PACKAGE_ROOT, PYTHONUNBUFFERED="1")
    return subprocess.run([sys.executable, "-m", "ringsync.launcher", *argv],
                          capture_output=True, text=True, env=env, timeout=120, **kwargs)


def test_run_starts_every_rank(tmp_path):
    script = tmp_path / "show_rank.py"
    script.write_text("from mpi4py import MPI\nprint('hello from rank', MPI.COMM_WORLD.Get_rank())\n")
    finished = run_cli("run", "-np", "2", str(script))
    assert finished.returncode == 0, finished.stderr
    assert "hello from rank 0" in finished.stdout
    assert "hello from rank 1" in finished.stdout


def test_run_returns_the_program_exit_status(tmp_path):
    script = tmp_path / "fail.py"
    script.write_text("import sys\nsys.exit(3)\n")
    assert run_cli("run", "-np", "1", str(script)).returncode == 3


def test_sigint_reaches_the_ranks(tmp_path):
    marker = "ringsync-sigint-" + uuid.uuid4().hex
    script = tmp_path / "sleeper.py"
    script.write_text("import time\nprint('ready', flush=True)\ntime.sleep(3600)\n")
    env = dict(os.environ, PYTHONPATH=PACKAGE_ROOT, PYTHONUNBUFFERED="1")
    job = subprocess.Popen(
        [sys.executable, "-m", "ringsync.launcher", "run", "-np", "2", str(script), marker],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        assert job.stdout.readline().strip() == "ready"
        job.send_signal(signal.SIGINT)
        job.wait(timeout=60)
    finally:
        if job.poll() is None:
            job.kill()
            job.wait()
    assert job.returncode != 0
    leftovers = subprocess.run(["pgrep", "-f", marker], capture_output=True, text=True)
    assert leftovers.stdout.split() == []


def test_doctor_reports_mpi_and_ulfm():
    finished = run_cli("doctor")
    assert finished.returncode == 0, finished.stderr
    for word in ("ringsync", "native core", "mpi4py", "ULFM", "MPI library", "torch"):
        assert word in finished.stdout
