"""Rank bodies for the elastic tests (tests/faults/test_elastic.py).

Every process writes one JSON record to RINGSYNC_TEST_DIR when it finishes, so the test
can compare the survivors with each other and with a reference. Faults are injected by
the processes themselves (SIGKILL at a chosen step), chosen by original MPI rank.
"""
import json
import os
import signal
import time

import numpy as np

import ringsync as rs
from ringsync import elastic

STEPS = 24
COMMIT_EVERY = 4
DIM = 5


def original_rank() -> int:
    """The rank this process started with ('spawned' for a replacement)."""
    from mpi4py import MPI
    if MPI.Comm.Get_parent() != MPI.COMM_NULL or os.environ.get("RINGSYNC_TEST_SPAWNED"):
        os.environ["RINGSYNC_TEST_SPAWNED"] = "1"
        return -1
    return MPI.COMM_WORLD.Get_rank()


def die(note: str) -> None:
    """SIGKILL this process, after leaving the time for the test's recovery figure."""
    with open(os.path.join(os.environ["RINGSYNC_TEST_DIR"], "killed-%d" % os.getpid()), "w") as f:
        json.dump({"note": note, "time": time.time()}, f)
    os.kill(os.getpid(), signal.SIGKILL)


def write_record(record: dict) -> None:
    folder = os.environ["RINGSYNC_TEST_DIR"]
    path = os.path.join(folder, "result-%d.json" % os.getpid())
    with open(path + ".partial", "w") as f:
        json.dump(record, f)
    os.replace(path + ".partial", path)


def gradient(step: int, rank: int) -> np.ndarray:
    """Differs by step, rank and position; exact in float64."""
    return (rank + 1) * (step + 1) + np.arange(DIM, dtype=np.float64) * (rank - 2)


def reference(sizes) -> np.ndarray:
    """The parameters after applying step s averaged over sizes[s] ranks, for every s."""
    w = np.zeros(DIM)
    for step, size in enumerate(sizes):
        w -= 0.01 * np.mean([gradient(step, r) for r in range(size)], axis=0)
    return w


class KillableState(elastic.ObjectState):
    """ObjectState whose commit() can kill this rank halfway (after the snapshot)."""

    kill_in_commit = None

    def commit(self):
        super().commit()
        if self.kill_in_commit is not None and self.commit_id == self.kill_in_commit:
            die("in commit %d" % self.commit_id)


def numpy_training(scenario: str = "plain"):
    """SGD on a parameter vector whose gradient is allreduced every step.

    Scenarios: victim = original rank killed at step KILL_STEP (mid-allreduce: it submits
    its gradient first); 'commit' kills it inside commit(); 'second' also kills
    RINGSYNC_TEST_SECOND during the recovery (in a reset callback); 'exception' makes the
    victim raise instead of dying."""
    me = original_rank()
    rs.init()
    victim = int(os.environ.get("RINGSYNC_TEST_VICTIM", "-9"))
    second = int(os.environ.get("RINGSYNC_TEST_SECOND", "-9"))
    kill_step = int(os.environ.get("RINGSYNC_TEST_KILL_STEP", "10"))
    state = KillableState(step=0, w=np.zeros(DIM), sizes=[], restores=[])
    if scenario == "commit" and me == victim:
        state.kill_in_commit = kill_step // COMMIT_EVERY
    steps_run = []
    recovered_at = []

    def on_reset():
        state.restores.append(state.commit_id)
        recovered_at.append(time.time())
        if scenario == "second" and me == second:
            die("during recovery")

    state.register_reset_callbacks([on_reset])

    @elastic.run
    def train(state):
        while state.step < STEPS:
            if me == victim and state.step == kill_step and scenario != "commit":
                if scenario == "exception":
                    raise RuntimeError("a bug on rank %d" % me)
                rs.allreduce_async(gradient(state.step, rs.rank()), name="g.%d" % state.step)
                die("mid-allreduce at step %d" % state.step)
            g = rs.allreduce(gradient(state.step, rs.rank()), op=rs.Average,
                             name="g.%d" % state.step)
            state.w = state.w - 0.01 * g
            state.sizes = state.sizes + [rs.size()]
            state.step += 1
            steps_run.append((state.step, time.time()))
            if state.step % COMMIT_EVERY == 0:
                state.commit()

    train(state)
    write_record({"original_rank": me, "rank": rs.rank(), "size": rs.size(),
                  "w": state.w.tolist(), "reference": reference(state.sizes).tolist(),
                  "sizes": state.sizes, "restores": state.restores,
                  "steps_run": len(steps_run),
                  "first_step_after_recovery": _first_step_after(steps_run, recovered_at)})
    rs.shutdown()


def _first_step_after(steps_run, recovered_at):
    if not recovered_at:
        return None
    after = [t for _, t in steps_run if t > recovered_at[0]]
    return after[0] if after else None
