"""A job for tests/mpi/test_job_insight.py: one scenario per run (argv[1]), each a few
training-like steps of ringsync's numpy API where one rank misbehaves on purpose.

  slow      rank 1 sleeps in every step: the straggler report must name it on every rank
  skip      rank 2 is in evaluate() while the others allreduce 'grad.fc2.weight': the
            merged hang report must name rank 2, the tensor and evaluate()
  kill      rank 1 kills itself mid-step (after its first gradient of step 3)
  mismatch  rank 1 allreduces 'x' with another shape than ranks 0 and 2
  hang      rank 2 stays in evaluate() until it is ended (the launcher's Ctrl-C)
Each rank prints `RESULT <json>` with what the test checks."""
import glob
import json
import os
import signal
import sys
import time

import numpy as np

import ringsync

STEPS = 12
SLOW_S = 0.04
WAIT_FOR_REPORT_S = 60


def step(rank: int, n: int, names=("grad.fc1.weight", "grad.fc2.weight")):
    handles = [ringsync.allreduce_async(np.arange(64, dtype=np.float32) * (rank + 1) + i,
                                        name=name) for i, name in enumerate(names)]
    return [ringsync.synchronize(h) for h in handles]


def slow():
    rank = ringsync.rank()
    for n in range(STEPS):
        if rank == 1:
            time.sleep(SLOW_S)  # its data loader is slow
        step(rank, n)
    time.sleep(1.5)  # (rank 0's periodic look at stragglers comes meanwhile)
    report = ringsync.straggler_report()
    worst = max(report, key=lambda row: row["mean_ms"])
    return {"worst": worst["rank"], "rounds_last": worst["rounds_last"],
            "others_last": sum(row["rounds_last"] for row in report if row is not worst)}


def evaluate(report_dir: str):
    """Rank 2's detour: back only once its part of the hang report is written."""
    deadline = time.monotonic() + WAIT_FOR_REPORT_S
    while not glob.glob(os.path.join(report_dir, "hang-*-rank-2.json")):
        if time.monotonic() > deadline:
            raise RuntimeError("no hang report came")
        time.sleep(0.05)


def skip():
    rank = ringsync.rank()
    step(rank, 0)
    if rank == 2:
        evaluate(os.environ["RINGSYNC_HANG_REPORT_DIR"])
    total = ringsync.allreduce(np.full(4, rank + 1.0, np.float32), name="grad.fc2.weight",
                               op=ringsync.Sum)
    return {"total": total.tolist()}


def hang():
    rank = ringsync.rank()
    step(rank, 0)
    print(f"STEPPED {rank}", flush=True)
    if rank == 2:
        evaluate("/nonexistent")  # (never back: its report is not looked for there)
    ringsync.allreduce(np.ones(4, np.float32), name="grad.fc2.weight")
    return {}


def kill():
    rank = ringsync.rank()
    for n in range(STEPS):
        if n == 3 and rank == 1:
            ringsync.allreduce_async(np.ones(64, np.float32), name="grad.fc1.weight")
            os.kill(os.getpid(), signal.SIGKILL)
        step(rank, n)
    return {}


def mismatch():
    rank = ringsync.rank()
    step(rank, 0)
    try:
        ringsync.allreduce(np.ones(5 if rank == 1 else 4, np.float32), name="x")
    except ringsync.MismatchError as e:
        return {"error": str(e)}
    return {"error": None}


if __name__ == "__main__":
    ringsync.init()
    result = globals()[sys.argv[1]]()
    print("RESULT " + json.dumps({"rank": ringsync.rank(), **result}), flush=True)
    ringsync.shutdown()
