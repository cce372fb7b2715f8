"""The ringsync command starting real jobs under mpirun: every rank runs, the program's
exit status comes back, Ctrl-C (SIGINT) ends the ranks, and doctor reports the MPI.

The command's one-process tests (mpirun command building with a pretend MPI, signals
passed on to a stand-in for mpirun) are in tests/unit/launch/."""

import json
import os
import re
import signal
import subprocess
import sys
import uuid

import pytest

from ringsync.launch import cli

pytestmark = pytest.mark.requires_mpirun

PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(cli.__file__))))  # ringsync/launch/cli.py: three levels down


def run_cli(*argv, env=None, **kwargs):
    env = env or dict(os.environ, PYTHONPATH=PACKAGE_ROOT, PYTHONUNBUFFERED="1")
    return subprocess.run([sys.executable, "-m", "ringsync.launch.cli", *argv],
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
        [sys.executable, "-m", "ringsync.launch.cli", "run", "-np", "2", str(script), marker],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        assert job.stdout.readline().strip().endswith("ready")  # (tagged with its rank)
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
    for word in ("ringsync", "native core", "mpi4py", "ULFM", "MPI library", "torch",
                 "tensorflow"):
        assert word in finished.stdout
    # No framework start-up chatter (TensorFlow's oneDNN / absl / CUDA lines).
    noise = [line for line in (finished.stdout + finished.stderr).splitlines()
             if any(word in line.lower() for word in ("onednn", "absl", "cuda"))]
    assert noise == []


# Each rank: its settings and one variable of the launcher's environment, then four
# asynchronous allreduces (the engine's negotiation rounds: timeline spans and cycles).
HOROVODRUN_STYLE_RANK = """
import json, os
import numpy as np
import ringsync as rs
from ringsync.config import Config
config = Config.from_env()
rs.init()
print(json.dumps({"rank": rs.rank(), "fusion_threshold": config.fusion_threshold,
                  "cycle_time_ms": config.cycle_time_ms, "cache_capacity": config.cache_capacity,
                  "log_level": config.log_level, "from_launcher": os.environ.get("FROM_LAUNCHER")}))
handles = [rs.allreduce_async(np.full(1000, rs.rank(), np.float32), name=f"hvd.{i}")
           for i in range(4)]
for h in handles:
    rs.synchronize(h)
rs.shutdown()  # writes the timeline
"""


def test_horovodrun_options_reach_the_ranks(tmp_path):
    """One 3-rank job through `ringsync run` with horovodrun's options: the launcher's
    environment (a HOROVOD_* alias included) and the options' settings reach every rank,
    output lines are tagged with the rank, --output-filename keeps each rank's output, and
    --timeline-filename gives one file with every rank's tensors."""
    np_ = 3
    script, timeline, out = tmp_path / "rank.py", tmp_path / "trace.json", tmp_path / "out"
    script.write_text(HOROVODRUN_STYLE_RANK)
    finished = run_cli("run", "-np", str(np_), "--fusion-threshold-mb", "2", "--cycle-time-ms",
                       "3", "--log-level", "INFO", "--timeline-filename", str(timeline),
                       "--timeline-mark-cycles", "--output-filename", str(out), str(script),
                       env=dict(os.environ, PYTHONPATH=PACKAGE_ROOT, PYTHONUNBUFFERED="1",
                                FROM_LAUNCHER="yes", HOROVOD_CACHE_CAPACITY="77"))
    assert finished.returncode == 0, finished.stdout + finished.stderr
    reports = {}
    for line in finished.stdout.splitlines():
        match = re.match(r"\[\d+,(\d+)\]<stdout>: (\{.*)", line)
        assert match, f"untagged output line {line!r}"
        reports[int(match.group(1))] = json.loads(match.group(2))
    assert sorted(reports) == list(range(np_))
    for rank, report in reports.items():
        assert report == {"rank": rank, "fusion_threshold": 2 << 20, "cycle_time_ms": 3.0,
                          "cache_capacity": 77, "log_level": "info", "from_launcher": "yes"}
        kept = json.loads((out / f"rank.{rank}" / "stdout").read_text())
        assert kept == report
    assert f"timeline of {np_} ranks written to {timeline}" in finished.stderr
    with open(timeline) as f:
        events = json.load(f)["traceEvents"]
    for rank in range(np_):
        tracks = {e["tid"]: e["args"]["name"] for e in events
                  if e["pid"] == rank and e["name"] == "thread_name"}
        assert sorted(tracks.values()) == [f"allreduce.hvd.{i}" for i in range(4)], (rank, tracks)
        spans = [e for e in events if e["pid"] == rank and e["ph"] == "X"]
        assert {e["args"]["tensor"] for e in spans} == set(tracks.values())
        assert {"NEGOTIATE_ALLREDUCE", "ALLREDUCE"} <= {e["name"] for e in spans}, rank
        assert any(e["name"] == "CYCLE_START" for e in events if e["pid"] == rank), rank
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "rank.py", "trace.json"]
