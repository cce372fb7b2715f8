"""Mismatched blocking collectives under mpirun while a second job keeps every core busy:
each fails on every rank and the correct call after it succeeds on every rank (the cases
and the checks: tests/common/mismatches.py; the thread-rank version with more rounds and
every same-host path is tests/unit/test_mismatch_stress.py). Load made the ranks drift
one call apart before a refusal took the call's place on every rank."""
import os
import subprocess
import sys

import pytest

import ringsync as rs
from ringsync.testing import run_mpi
from tests.common import mismatches

pytestmark = pytest.mark.requires_mpirun

BUSY_LOOP = "while True: pass"


def stress_and_log(folder, rounds, path_env):
    """Every rank: the stress over MPI.COMM_WORLD, its log written to rank-<r>.log."""
    os.environ.update(dict(item.split("=", 1) for item in path_env.split(",") if "=" in item))
    comm = mismatches.TorchRanks() if path_env == "torch" else rs.Communicator()
    log = mismatches.stress(comm, int(rounds), seed=2600)
    with open(os.path.join(folder, f"rank-{comm.rank()}.log"), "w") as f:
        f.write("\n".join(log))
    rs.shutdown() if path_env == "torch" else comm.shutdown()


def start_load(count):
    return [subprocess.Popen([sys.executable, "-c", BUSY_LOOP]) for _ in range(count)]


@pytest.mark.parametrize("path_env", ["", "RINGSYNC_TRANSPORT=tcp", "torch"],
                         ids=["lane", "engine", "ringsync.torch"])
def test_mismatches_under_load_keep_the_ranks_matched(tmp_path, path_env):
    rounds = 1000
    load = start_load(os.cpu_count() or 2)
    try:
        result = run_mpi(stress_and_log, np=2, timeout=300,
                         args=(tmp_path, rounds, path_env),
                         env={"RINGSYNC_TIMEOUT_SECONDS": "60"})
    finally:
        for process in load:
            process.kill()
            process.wait()
    assert result.ok, result.report()
    logs = [(tmp_path / f"rank-{r}.log").read_text().splitlines() for r in range(2)]
    assert len(logs[0]) == len(logs[1]) == rounds, result.report()
    for i, (a, b) in enumerate(zip(*logs)):
        assert a.split(":")[0] == b.split(":")[0], f"round {i}: {a!r} vs {b!r}"
