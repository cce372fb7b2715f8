"""Jobs started without mpirun: ringsync.init() finds its world from the launcher's
variables alone (ringsync.rendezvous_env) and meets through a store. Each job runs
tests/common/launched_job.py on 2 ranks: the places init() gives, the collective checks
of the matrix through the module API, and a torch and a Keras training run that must
match one process. (Pods in namespace hosts: tests/hosts/test_pods.py.)"""
import json
import os
import signal
import socket
import subprocess
import sys


from tests.common.jobs import run_to_deadline

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
JOB = ["-m", "tests.common.launched_job"]
PARTS = ["collectives", "torch", "keras"]
DEADLINE_S = 400
SECRET = "launcher-test-secret-0123456789"


def job_environment(**extra):
    """The test's environment without any launcher's variables of its own (the suite may
    itself run under one), plus extra."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("OMPI_", "PMIX_", "PMI_", "SLURM_", "TORCHELASTIC_"))
           and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT",
                         "RINGSYNC_RENDEZVOUS", "RINGSYNC_SECRET", "RINGSYNC_SECRET_FILE")}
    env.update(PYTHONPATH=ROOT, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1",
               TF_CPP_MIN_LOG_LEVEL="2", RINGSYNC_TIMEOUT_SECONDS="120")
    env.update(extra)
    return env


def check_places(result_dir, size, output, parts=PARTS, hosts=1):
    """Every rank wrote its place after every part passed: ranks 0..size-1, spread over
    `hosts` hosts of size/hosts ranks each, in rank order, with Horovod's local and cross
    places."""
    places = []
    for rank in range(size):
        path = os.path.join(result_dir, f"rank-{rank}.json")
        assert os.path.exists(path), f"rank {rank} wrote no result; the job's output:\n{output}"
        with open(path) as f:
            places.append(json.load(f))
    per_host = size // hosts
    assert [p["rank"] for p in places] == list(range(size)), places
    assert all(p["size"] == size and p["parts"] == sorted(parts) for p in places), places
    assert len({p["host"] for p in places}) == hosts, places
    assert [(p["local_rank"], p["local_size"], p["cross_rank"], p["cross_size"])
            for p in places] == [(r % per_host, per_host, r // per_host, hosts)
                                 for r in range(size)], places


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_torchrun_without_a_secret_meets_at_torchruns_store(tmp_path):
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc-per-node=2", *JOB, str(tmp_path), *PARTS]
    status, output = run_to_deadline(command, job_environment(), DEADLINE_S, cwd=ROOT)
    assert status == 0, f"torchrun exit status {status}:\n{output}"
    check_places(str(tmp_path), 2, output)


def test_ringsync_run_local_launcher(tmp_path):
    command = [sys.executable, "-m", "ringsync.launch.cli", "run", "--launcher", "local",
               "-np", "2", sys.executable, *JOB, str(tmp_path), *PARTS]
    status, output = run_to_deadline(command, job_environment(), DEADLINE_S, cwd=ROOT)
    assert status == 0, f"ringsync run exit status {status}:\n{output}"
    check_places(str(tmp_path), 2, output)
    assert "[1]<stdout>:" in output or "[1]<stderr>:" in output, output  # tagged by rank


def slurm_variables(rank: int, size: int, job_id: int):
    """What srun sets in each task (those init() reads), all tasks on this host."""
    return {"SLURM_PROCID": str(rank), "SLURM_NTASKS": str(size), "SLURM_LOCALID": str(rank),
            "SLURM_JOB_ID": str(job_id), "SLURM_STEP_ID": "0",
            "SLURM_STEP_NODELIST": "localhost", "SLURM_JOB_NODELIST": "localhost"}


def start_tasks(size, variables, result_dir, parts):
    """size processes started as a process manager would, each with its own variables."""
    return [subprocess.Popen([sys.executable, *JOB, result_dir, *parts], cwd=ROOT,
                             env=job_environment(**variables(rank)), stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True, start_new_session=True)
            for rank in range(size)]


def finish_tasks(tasks, deadline_s=DEADLINE_S):
    """Every task's (status, output); at the deadline every task is killed and the test
    fails showing every output."""
    outputs, statuses = [], []
    for task in tasks:
        try:
            out, _ = task.communicate(timeout=deadline_s)
        except subprocess.TimeoutExpired:
            for t in tasks:
                t.kill()
            out, _ = task.communicate()
        statuses.append(task.returncode)
        outputs.append(out)
    text = "\n".join(f"--- task {i} (status {s}):\n{o}"
                     for i, (s, o) in enumerate(zip(statuses, outputs)))
    return statuses, text


def test_slurm_variables_alone(tmp_path):
    """srun's variables: the store on the step's first node, at a port derived from the
    job id (chosen here to be free), the secret exported before srun."""
    from ringsync.rendezvous_env import SLURM_PORT_BASE
    job_id = free_port() - SLURM_PORT_BASE  # (the derived port is then this free one)
    assert job_id > 0
    tasks = start_tasks(2, lambda r: dict(slurm_variables(r, 2, job_id),
                                          RINGSYNC_SECRET=SECRET), str(tmp_path), PARTS)
    statuses, output = finish_tasks(tasks)
    assert statuses == [0, 0], output
    check_places(str(tmp_path), 2, output)


def test_slurm_without_a_secret_is_refused_on_every_task(tmp_path):
    """No secret, no store: every task says what to set, none waits."""
    tasks = start_tasks(2, lambda r: slurm_variables(r, 2, 4321), str(tmp_path), [])
    statuses, output = finish_tasks(tasks, 120)
    assert all(s != 0 for s in statuses), output
    assert output.count("RINGSYNC_SECRET") >= 2, output
    assert SECRET not in output


def test_ray_actors_as_ranks(tmp_path):
    """ringsync.ray.RayExecutor: 2 actors of a Ray cluster started in the job's process."""
    command = [sys.executable, "-m", "tests.mpi.ray_job", str(tmp_path)]
    status, output = run_to_deadline(command, job_environment(), DEADLINE_S, cwd=ROOT)
    assert status == 0, f"exit status {status}:\n{output}"
    check_places(str(tmp_path), 2, output, parts=["collectives", "torch"])


def test_a_shared_directory_is_enough_to_meet(tmp_path):
    """RINGSYNC_RENDEZVOUS=file:///DIR: no server at all, only a directory both share."""
    meeting = tmp_path / "meeting"
    results = tmp_path / "results"
    results.mkdir()
    tasks = start_tasks(2, lambda r: {"RINGSYNC_RENDEZVOUS": f"file://{meeting}", "RANK": str(r),
                                      "WORLD_SIZE": "2", "RINGSYNC_SECRET": SECRET},
                        str(results), ["collectives"])
    statuses, output = finish_tasks(tasks, 300)
    assert statuses == [0, 0], output
    check_places(str(results), 2, output, parts=["collectives"])
    assert os.stat(meeting).st_mode & 0o077 == 0  # (made for the user alone)


FAILING_RANK = """
import numpy as np
import ringsync as rs
rs.init()
if rs.rank() == 1:
    print("rank 1 fails now", flush=True)
    raise RuntimeError("a bug on rank 1")
rs.allreduce(np.zeros(3) + rs.rank(), name="never")  # (rank 1 is gone: this fails)
"""


def test_local_launcher_names_the_failed_rank_first(tmp_path):
    """A rank's bug ends the job: its status is the job's, and the launcher names it
    first, with its cause, then the ranks its loss failed."""
    command = [sys.executable, "-m", "ringsync.launch.cli", "run", "--launcher", "local",
               "-np", "3", sys.executable, "-c", FAILING_RANK]
    status, output = run_to_deadline(command, job_environment(), 120, cwd=ROOT)
    assert status == 1, output
    assert "[1]<stdout>: rank 1 fails now" in output, output
    assert ("ringsync run: the job failed: rank 1 (on localhost) exited with status 1 "
            "(RuntimeError: a bug on rank 1)") in output, output


SIGNALLED_RANK = """
import signal, sys, time
got = []
signal.signal(signal.SIGUSR1, lambda *a: got.append("usr1"))
signal.signal(signal.SIGTERM, lambda *a: (print("rank got", got + ["term"], flush=True),
                                          sys.exit(0)))
print("ready", flush=True)
while True:
    time.sleep(0.01)
"""


def test_local_launcher_passes_signals_to_every_rank(tmp_path):
    """SIGUSR1, then SIGTERM, to the launcher: every rank gets both, in order."""
    command = [sys.executable, "-m", "ringsync.launch.cli", "run", "--launcher", "local",
               "-np", "2", sys.executable, "-c", SIGNALLED_RANK]
    job = subprocess.Popen(command, cwd=ROOT, env=job_environment(), stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        ready = [job.stdout.readline() for _ in range(2)]
        assert all("ready" in line for line in ready), ready
        job.send_signal(signal.SIGUSR1)
        job.send_signal(signal.SIGTERM)
        output, _ = job.communicate(timeout=60)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
    for rank in (0, 1):
        assert f"[{rank}]<stdout>: rank got ['usr1', 'term']" in output, output


def blocked_signals(pid: int, tid: int) -> int:
    with open(f"/proc/{pid}/task/{tid}/status") as status:
        for line in status:
            if line.startswith("SigBlk:"):
                return int(line.split()[1], 16)
    raise AssertionError(f"no SigBlk for thread {tid} of {pid}")


def test_only_the_launchers_main_thread_takes_its_signals(tmp_path):
    """A signal taken by a pump or store thread can be handled after one sent later (the
    test above once saw SIGTERM reach a rank without the SIGUSR1 sent before it): every
    thread of the launcher but the main one blocks the signals it passes on."""
    command = [sys.executable, "-m", "ringsync.launch.cli", "run", "--launcher", "local",
               "-np", "2", sys.executable, "-c", SIGNALLED_RANK]
    job = subprocess.Popen(command, cwd=ROOT, env=job_environment(), stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        ready = [job.stdout.readline() for _ in range(2)]
        assert all("ready" in line for line in ready), ready
        threads = sorted(int(tid) for tid in os.listdir(f"/proc/{job.pid}/task"))
        masks = {tid: blocked_signals(job.pid, tid) for tid in threads}
        job.send_signal(signal.SIGTERM)
        output, _ = job.communicate(timeout=60)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
    wanted = [signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2]
    bits = sum(1 << (s - 1) for s in wanted)
    assert len(threads) >= 5, (threads, output)  # (4 pumps, the store, the report watch)
    for tid, mask in masks.items():
        if tid == job.pid:
            assert mask & bits == 0, f"the main thread blocks {mask:#x}\n{output}"
        else:
            assert mask & bits == bits, f"thread {tid} blocks only {mask:#x}\n{output}"


def test_a_bad_setting_on_one_task_fails_init_on_every_task(tmp_path):
    """Without MPI too: the bad value travels through the store's first exchange, so no
    task waits for the one that cannot read its settings."""
    from ringsync.rendezvous_env import SLURM_PORT_BASE
    job_id = free_port() - SLURM_PORT_BASE

    def variables(rank):
        bad = {"RINGSYNC_FUSION_THRESHOLD": "lots"} if rank == 1 else {}
        return dict(slurm_variables(rank, 2, job_id), RINGSYNC_SECRET=SECRET, **bad)

    statuses, output = finish_tasks(start_tasks(2, variables, str(tmp_path), []), 120)
    assert all(s != 0 for s in statuses), output
    assert output.count("rank 1: RINGSYNC_FUSION_THRESHOLD='lots' is not a whole number") >= 2, \
        output
