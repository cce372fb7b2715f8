"""Elastic recovery time: from a SIGKILLed rank to the survivors' next completed step.

Runs the PyTorch elastic test body (torch_training in tests/faults/test_elastic.py:
TorchState, DistributedOptimizer, a kill while the victim's gradient reductions are in
flight) on N ranks under `mpirun --with-ft ulfm`, with and without --respawn, a few
times each:

    python benchmarks/elastic_recovery.py            # from the repository root
    python benchmarks/elastic_recovery.py --np 4 --repeat 5

Reported per mode: the time from the kill (stamped by the victim just before it kills
itself) to the first training step completed after recovery (the slowest survivor),
and the recovery itself as the new rank 0 logs it (abort, shrink, spawn, rebuild).
"""
import argparse
import glob
import json
import os
import re
import statistics
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from ringsync.testing import run_mpi  # noqa: E402

LOGGED = re.compile(r"recovery took ([0-9.]+) s")


def one_run(np: int, respawn: bool):
    with tempfile.TemporaryDirectory(prefix="ringsync-recovery-") as folder:
        env = {"RINGSYNC_TEST_DIR": folder, "RINGSYNC_TEST_VICTIM": "1",
               "RINGSYNC_TEST_KILL_STEP": "6", "RINGSYNC_ELASTIC_RESPAWN": "1" if respawn else "0"}
        result = run_mpi("tests.faults.test_elastic:torch_training", np=np, timeout=180,
                         env=env, mpirun_args=("--with-ft", "ulfm"))
        if result.returncode != 0 or result.timed_out:
            raise SystemExit(result.report())
        killed = [json.load(open(p))["time"] for p in glob.glob(os.path.join(folder, "killed-*"))]
        records = [json.load(open(p)) for p in glob.glob(os.path.join(folder, "result-*.json"))]
        survivors = [r for r in records if r["original_rank"] >= 0]
        next_step = max(r["first_step_after_recovery"] for r in survivors)
        logged = float(LOGGED.search(result.output).group(1))
        return next_step - killed[0], logged, len(records)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--np", type=int, default=4)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    print(f"{args.np} ranks, rank 1 killed mid-allreduce at step 6; median of {args.repeat} runs")
    print(f"{'mode':<12} {'kill -> next step (s)':>22} {'logged recovery (s)':>20} {'final size':>11}")
    for respawn in (False, True):
        runs = [one_run(args.np, respawn) for _ in range(args.repeat)]
        total = statistics.median(r[0] for r in runs)
        logged = statistics.median(r[1] for r in runs)
        print(f"{'--respawn' if respawn else 'shrink':<12} {total:>22.3f} {logged:>20.3f} "
              f"{runs[0][2]:>11}")


if __name__ == "__main__":
    main()
