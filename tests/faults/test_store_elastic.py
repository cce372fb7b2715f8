"""Elastic recovery without MPI: ranks started by `ringsync run --launcher local
--elastic` meet through the launcher's store, and when one is SIGKILLed the survivors agree
on who is left through the store, rebuild the ring in the same processes, roll back and go
on; with --respawn the launcher starts a replacement, which joins at the next commit.
The rank code is tests/faults/test_elastic.py's (numpy_training, torch_training), so the
survivors are held to the same replay as under ULFM. Losing the store's host (here rank 0,
which serves the store of a job started with env:// variables alone) ends every rank with
an error that says so."""
import glob
import json
import subprocess
import sys


from tests.common.jobs import run_to_deadline
from tests.faults import test_elastic as bodies
from tests.mpi.test_launchers import (ROOT, SECRET, finish_tasks, free_port,
                                      job_environment)

DEADLINE_S = 240


def elastic_job(tmp_path, body, np, *options, **env):
    """`ringsync run --launcher local --elastic -np N` of a body of test_elastic.py;
    (exit status, output, the records the ranks wrote)."""
    code = f"from tests.faults.test_elastic import {body}; {body}()"
    command = [sys.executable, "-m", "ringsync.launch.cli", "run", "--launcher", "local",
               "--elastic", "-np", str(np), *options, sys.executable, "-c", code]
    environ = job_environment(RINGSYNC_TEST_DIR=str(tmp_path), RINGSYNC_TIMEOUT_SECONDS="60",
                              **{k: str(v) for k, v in env.items()})
    status, output = run_to_deadline(command, environ, DEADLINE_S, cwd=ROOT)
    records = [json.load(open(p)) for p in sorted(glob.glob(str(tmp_path / "result-*.json")))]
    return status, output, records


def test_survivors_of_a_kill_mid_allreduce_match_the_replay(tmp_path):
    status, output, records = elastic_job(tmp_path, "numpy_training", 3,
                                          RINGSYNC_TEST_VICTIM=1, RINGSYNC_TEST_KILL_STEP=10)
    assert status == 0, output
    bodies.assert_numpy_run(_Result(status, output), records, 2, lost_at_or_before=10)
    assert "ringsync.elastic: lost rank(s) [1] of 3" in output, output


def test_a_replacement_joins_at_the_next_commit(tmp_path):
    status, output, records = elastic_job(tmp_path, "torch_training", 3, "--respawn",
                                          RINGSYNC_TEST_VICTIM=1, RINGSYNC_TEST_KILL_STEP=6,
                                          RINGSYNC_TEST_AWAIT_JOINER=1)
    assert status == 0, output
    assert sorted(r["original_rank"] for r in records) == [-1, 0, 2], output
    for r in records:
        assert r["params"] == records[0]["params"], "the replacement differs from the survivors"
        assert r["error"] < 1e-10, r["error"]  # against one process replaying the steps
        assert r["size"] == 3 and 2 in r["sizes"] and r["sizes"][-1] == 3, r["sizes"]


def test_losing_the_stores_host_ends_every_rank_with_a_clear_error(tmp_path):
    """Pods started with env:// variables alone; rank 0 serves the store and is killed
    mid-allreduce: the survivors cannot agree without the store, and say so."""
    port = free_port()
    code = "from tests.faults.test_elastic import numpy_training; numpy_training()"

    def variables(rank):
        return {"RANK": str(rank), "WORLD_SIZE": "3", "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port - 1), "RINGSYNC_SECRET": SECRET,
                "RINGSYNC_ELASTIC": "1", "RINGSYNC_TEST_DIR": str(tmp_path),
                "RINGSYNC_TEST_VICTIM": "0", "RINGSYNC_TEST_KILL_STEP": "10",
                "RINGSYNC_TIMEOUT_SECONDS": "60", "RINGSYNC_START_TIMEOUT_SECONDS": "30"}

    tasks = [subprocess.Popen([sys.executable, "-c", code], cwd=ROOT,
                              env=job_environment(**variables(rank)), stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, start_new_session=True)
             for rank in range(3)]
    statuses, output = finish_tasks(tasks, 180)
    assert statuses[0] == -9, output  # the victim, killed
    assert statuses[1] != 0 and statuses[2] != 0, output
    survivors = output.split("--- task 1")[1]
    for task in ("--- task 1", "--- task 2"):
        part = output.split(task)[1].split("--- task")[0]
        assert "lost the store at tcp://" in part, output
    assert not glob.glob(str(tmp_path / "result-*.json")), survivors


class _Result:
    """What test_elastic's checks read of a job's result."""

    def __init__(self, returncode, output):
        self.returncode, self.output = returncode, output

    def report(self):
        return self.output


def test_a_job_that_ends_below_min_np_ends_its_waiting_replacement(tmp_path):
    """Rank 1 of 2 is killed, the launcher starts a replacement, and rank 0 ends the job
    (fewer than --min-np survive): the replacement, which nobody is left to take in, is
    ended by the launcher, and the job's status is the failure's."""
    status, output, records = elastic_job(tmp_path, "numpy_training", 2, "--respawn",
                                          "--min-np", "2", RINGSYNC_TEST_VICTIM=1,
                                          RINGSYNC_TEST_KILL_STEP=2)
    assert status != 0, output
    assert "only 1 rank(s) left after losing rank(s) [1]" in output, output
    assert not records, records
