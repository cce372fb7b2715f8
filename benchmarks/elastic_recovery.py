"""Elastic recovery time: from a SIGKILLed rank to the survivors' next completed step, with
Open MPI's ULFM and without MPI (a store rendezvous), in one run.

Runs the PyTorch elastic test body (torch_training in tests/faults/test_elastic.py:
TorchState, DistributedOptimizer, a kill while the victim's gradient reductions are in
flight) on N ranks, with and without --respawn, a few times each, started by
`mpirun --with-ft ulfm` and by `ringsync run --launcher local --elastic`:

    python benchmarks/elastic_recovery.py            # from the repository root
    python benchmarks/elastic_recovery.py --np 4 --repeat 5

Reported per mode: the time from the kill (stamped by the victim just before it kills
itself) to the first training step completed after recovery (the slowest survivor),
and the recovery itself as the new rank 0 logs it (abort, agreement on the survivors,
spawn or admission, rebuild). Under ULFM a replacement is spawned inside the recovery;
through the store it is started by the launcher and joins at a later commit, so the
survivors do not wait for it.
"""
import argparse
import glob
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from ringsync.testing import run_mpi  # noqa: E402

LOGGED = re.compile(r"recovery took ([0-9.]+) s")


def run_ulfm(np: int, respawn: bool, env: dict) -> str:
    env = dict(env, RINGSYNC_ELASTIC_RESPAWN="1" if respawn else "0")
    result = run_mpi("tests.faults.test_elastic:torch_training", np=np, timeout=180,
                     env=env, mpirun_args=("--with-ft", "ulfm"))
    if result.returncode != 0 or result.timed_out:
        raise SystemExit(result.report())
    return result.output


def run_store(np: int, respawn: bool, env: dict) -> str:
    command = [sys.executable, "-m", "ringsync.launch.cli", "run", "--launcher", "local",
               "--elastic", "-np", str(np)] + (["--respawn"] if respawn else []) + [
        sys.executable, "-c",
        "from tests.faults.test_elastic import torch_training; torch_training()"]
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    done = subprocess.run(command, env=dict(os.environ, PYTHONPATH=root, **env), cwd=root,
                          capture_output=True, text=True, timeout=180)
    if done.returncode != 0:
        raise SystemExit(done.stdout + done.stderr)
    return done.stdout + done.stderr


def one_run(np: int, respawn: bool, launch, extra: dict):
    with tempfile.TemporaryDirectory(prefix="ringsync-recovery-") as folder:
        env = {"RINGSYNC_TEST_DIR": folder, "RINGSYNC_TEST_VICTIM": "1",
               "RINGSYNC_TEST_KILL_STEP": "6", "OMP_NUM_THREADS": "1",
               "RINGSYNC_TIMEOUT_SECONDS": "60", **extra}
        output = launch(np, respawn, env)
        killed = [json.load(open(p))["time"] for p in glob.glob(os.path.join(folder, "killed-*"))]
        records = [json.load(open(p)) for p in glob.glob(os.path.join(folder, "result-*.json"))]
        survivors = [r for r in records if r["original_rank"] >= 0]
        next_step = max(r["first_step_after_recovery"] for r in survivors)
        logged = float(LOGGED.search(output).group(1))
        return next_step - killed[0], logged, len(records)


# (name, how the job starts, --respawn, variables). Through the store a replacement joins
# at a commit once it has started, while the survivors go on: "held" makes rank 0 wait
# for it after the loss (tests/faults/test_elastic.py _await_replacement), which gives the
# figure ULFM's --respawn gives, where the survivors wait inside the recovery.
MODES = [("ulfm shrink", run_ulfm, False, {}), ("ulfm --respawn", run_ulfm, True, {}),
         ("store shrink", run_store, False, {}),
         ("store --respawn", run_store, True, {}),
         ("store --respawn, held", run_store, True, {"RINGSYNC_TEST_AWAIT_JOINER": "1"})]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--np", type=int, default=4)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    print(f"{args.np} ranks, rank 1 killed mid-allreduce at step 6; median of {args.repeat} runs")
    print(f"{'mode':<26} {'kill -> next step (s)':>22} {'logged recovery (s)':>20} "
          f"{'records':>8}")
    for mode, launch, respawn, extra in MODES:
        runs = [one_run(args.np, respawn, launch, extra) for _ in range(args.repeat)]
        total = statistics.median(r[0] for r in runs)
        logged = statistics.median(r[1] for r in runs)
        print(f"{mode:<26} {total:>22.3f} {logged:>20.3f} {runs[0][2]:>8}", flush=True)


if __name__ == "__main__":
    main()
