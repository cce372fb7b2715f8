"""The ringsync command starting real jobs under mpirun: every rank runs, the program's
exit status comes back, Ctrl-C (SIGINT) ends the ranks, doctor reports the MPI, and each
rank gets torch.distributed's env:// variables (ringsync.launch.rank_env), so that a
plain DDP script runs as under torchrun.

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

from ringsync.errors import LauncherError
from ringsync.launch import cli, rank_env
from tests.common.jobs import run_to_deadline

pytestmark = pytest.mark.requires_mpirun

PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(cli.__file__))))  # ringsync/launch/cli.py: three levels down


DEADLINE_S = 300  # a job whose ranks import torch: seconds each, on two cores

# torch.distributed's env:// variables, as torchrun sets them.
TORCH_ENV_NAMES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                   "MASTER_PORT")


def launcher_env(**extra):
    """The launcher tests' environment, less any env:// variable of this process (it
    would reach the ranks and win over the launcher's)."""
    env = {name: value for name, value in os.environ.items() if name not in TORCH_ENV_NAMES}
    return dict(env, PYTHONPATH=PACKAGE_ROOT, PYTHONUNBUFFERED="1", **extra)


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


OPEN_MPI_RANK = {"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "4",
                 "OMPI_COMM_WORLD_LOCAL_RANK": "1", "OMPI_COMM_WORLD_LOCAL_SIZE": "2"}
HYDRA_RANK = {"PMI_RANK": "3", "PMI_SIZE": "4", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "2"}
MASTER = {"MASTER_ADDR": "node1", "MASTER_PORT": "29400"}


@pytest.mark.parametrize("mpi_variables", [OPEN_MPI_RANK, HYDRA_RANK],
                         ids=["openmpi", "hydra"])
def test_rank_env_maps_the_mpi_launchers_variables(mpi_variables):
    expected = {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
                **MASTER}
    assert rank_env.rank_variables(mpi_variables, MASTER) == expected
    # A RANK handed down from the launcher's environment would be every rank's: the MPI
    # launcher's per-rank value replaces it; the user's MASTER_PORT is kept.
    user_set = dict(mpi_variables, RANK="0", MASTER_PORT="1234")
    assert rank_env.rank_variables(user_set, MASTER) == {
        name: value for name, value in expected.items() if name != "MASTER_PORT"}
    # A variable this MPI launcher lacks is named.
    lacking = {name: value for name, value in mpi_variables.items()
               if not name.endswith(("LOCAL_SIZE", "LOCALNRANKS"))}
    with pytest.raises(LauncherError, match=r"(OMPI_COMM_WORLD_LOCAL_SIZE|MPI_LOCALNRANKS) "
                                            r"is not set, so this rank's LOCAL_WORLD_SIZE"):
        rank_env.rank_variables(lacking, MASTER)
    with pytest.raises(LauncherError, match="neither OMPI_COMM_WORLD_RANK .* nor PMI_RANK"):
        rank_env.rank_variables({}, MASTER)
    # The program's own words, "--" included, are never the wrapper's.
    assert rank_env.parse_arguments(
        ["--master-addr=node1", "--master-port=29400", "--", "prog", "--master-addr=x", "--"]
    ) == (MASTER, ["prog", "--master-addr=x", "--"])


def run_rank_env(*argv, env):
    """`python -m ringsync.launch.rank_env ARGV` as one rank would run it: (the process,
    its stdout, its stderr)."""
    job = subprocess.Popen([sys.executable, "-m", "ringsync.launch.rank_env", *argv],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                           env=dict(launcher_env(), **env))
    try:
        out, err = job.communicate(timeout=60)
    finally:
        if job.poll() is None:
            job.kill()
            job.wait()
    return job, out, err


def test_rank_env_execs_the_program_or_says_what_is_missing():
    """The program replaces the wrapper (the same PID, its own exit status), with the
    variables set; a missing MPI variable is one line naming it, not a traceback."""
    show = ("import json, os, sys\n"
            "print(json.dumps(dict({n: os.environ.get(n) for n in %r}, pid=os.getpid())))\n"
            "sys.exit(7)\n" % (TORCH_ENV_NAMES,))
    job, out, err = run_rank_env("--master-addr=node1", "--master-port=29400", "--",
                                 sys.executable, "-c", show, env=OPEN_MPI_RANK)
    assert job.returncode == 7, out + err
    assert json.loads(out) == {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1",
                               "LOCAL_WORLD_SIZE": "2", **MASTER, "pid": job.pid}
    lacking = {name: value for name, value in HYDRA_RANK.items() if name != "MPI_LOCALRANKID"}
    job, out, err = run_rank_env("--", sys.executable, "-c", "pass", env=lacking)
    assert job.returncode == 1, out + err
    assert err.strip() == ("ringsync.launch.rank_env: MPI_LOCALRANKID is not set, so this "
                           "rank's LOCAL_RANK is not known; set LOCAL_RANK yourself"), err
    job, out, err = run_rank_env("--", "no-such-program-ringsync", env=OPEN_MPI_RANK)
    assert job.returncode == 127 and "cannot run 'no-such-program-ringsync'" in err, err


def tagged_reports(stdout: str) -> dict:
    """{rank: the JSON object it printed} from `ringsync run`'s rank-tagged output."""
    reports = {}
    for line in stdout.splitlines():
        match = re.match(r"\[\d+,(\d+)\]<stdout>: (\{.*)", line)
        assert match, f"untagged output line {line!r}"
        reports[int(match.group(1))] = json.loads(match.group(2))
    return reports


def test_each_rank_gets_torchs_env_variables():
    """As torchrun's: each rank its own RANK and LOCAL_RANK, the sizes, and one
    MASTER_ADDR:MASTER_PORT (this host, all ranks being local) for them all; the program
    is any executable (here the interpreter itself, not a .py file)."""
    show = "import json, os; print(json.dumps({n: os.environ.get(n) for n in %r}))" % (
        TORCH_ENV_NAMES,)
    finished = run_cli("run", "-np", "2", sys.executable, "-c", show, env=launcher_env())
    output = finished.stdout + finished.stderr
    assert finished.returncode == 0, output
    reports = tagged_reports(finished.stdout)
    assert sorted(reports) == [0, 1], output
    port = reports[0]["MASTER_PORT"]
    assert port and port.isdigit(), output
    for rank, report in reports.items():
        assert report == {"RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": str(rank),
                          "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
                          "MASTER_PORT": port}, output


def test_a_plain_ddp_script_runs_under_ringsync_run_as_under_torchrun():
    """examples/ddp_digits.py, not a word changed (init_process_group's env://), trains
    under `ringsync run` to the very accuracy it reaches under torchrun: the launchers
    give it the same ranks, and on 2 ranks a sum has one order."""
    pytest.importorskip("torch")
    pytest.importorskip("sklearn")
    example = ["examples/ddp_digits.py", "--check"]
    launchers = {
        "ringsync run": [sys.executable, "-m", "ringsync.launch.cli", "run", "-np", "2"],
        "torchrun": [sys.executable, "-m", "torch.distributed.run", "--standalone",
                     "--nproc-per-node", "2"],
    }
    accuracy = {}
    for name, launcher in launchers.items():
        status, output = run_to_deadline(launcher + example, launcher_env(OMP_NUM_THREADS="1"),
                                         DEADLINE_S, cwd=PACKAGE_ROOT)
        assert status == 0, f"{name}: exit status {status}; every rank's output:\n{output}"
        found = re.search(r"test accuracy on 2 ranks: ([0-9.]+)", output)
        assert found, f"{name}: no accuracy printed; every rank's output:\n{output}"
        accuracy[name] = found.group(1)
    assert accuracy["ringsync run"] == accuracy["torchrun"], accuracy
