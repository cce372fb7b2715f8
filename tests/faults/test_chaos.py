"""The chaos runs of benchmarks/chaos.py: how a run is judged (one process, synthetic
records), and a short run of real jobs with faults drawn from fixed seeds (slow)."""
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
from benchmarks import chaos  # noqa: E402


def finished(rank, params=(1.0, 2.0), replay=0.0, checkpoint="ok"):
    return {"outcome": "finished", "rank": rank, "size": 3, "params": [list(params)],
            "replay_error": replay, "checkpoint": checkpoint, "resets": [3]}


def error(text="lost rank 1"):
    return {"outcome": "error", "type": "HostsUpdatedInterrupt", "text": text}


RUN = {"faults": [{"kind": "kill-commit", "rank": 1, "step": 4}], "returncode": 0}


def judge(ends, returncode=0, hung=False, leftovers=(), faults=None):
    run = dict(RUN, returncode=returncode, faults=faults or RUN["faults"])
    return chaos.judge(run, ends, hung, list(leftovers), 4)[0]


def test_a_run_is_finished_only_with_identical_replayed_parameters_and_a_loadable_checkpoint():
    good = {0: finished(0), 2: finished(1), 3: finished(2)}
    assert judge(good) == "finished"
    assert judge({**good, 3: finished(2, params=(1.0, 2.5))}) == "wrong parameters"
    assert judge({**good, 3: finished(2, replay=1e-3)}) == "wrong parameters"
    unloadable = finished(0, checkpoint="the latest checkpoint does not load")
    assert judge({**good, 0: unloadable}) == "wrong parameters"


def test_exit_0_with_a_survivor_missing_or_failed_is_a_failure():
    assert judge({0: finished(0), 2: finished(1)}) == "exit 0 after failure"
    assert judge({0: finished(0), 2: finished(1), 3: error()}) == "exit 0 after failure"


def test_a_non_zero_exit_is_clean_only_if_every_rank_not_struck_raised():
    assert judge({0: error(), 2: error(), 3: error()}, returncode=1) == "clean error"
    assert judge({0: error(), 2: error()}, returncode=1) == "unclean"
    assert judge({0: error(), 2: error(), 3: finished(2)}, returncode=1) == "unclean"
    # A straggler (stop) strikes nobody: every rank must have raised.
    stop = [{"kind": "stop", "rank": 1, "step": 4, "seconds": 1.0}]
    assert judge({0: error(), 2: error(), 3: error()}, returncode=1, faults=stop) == "unclean"


def test_hangs_and_leftovers_are_failures_whatever_the_ranks_wrote():
    good = {0: finished(0), 2: finished(1), 3: finished(2)}
    assert judge(good, hung=True) == "hang"
    assert judge(good, leftovers=["/dev/shm/ringsync-00-1-2 left"]) == "leftovers"


def test_a_seed_draws_the_same_run_every_time():
    args = chaos.parse_args(["--np", "4"])
    assert chaos.draw_run(7, args) == chaos.draw_run(7, args)
    kinds = {chaos.draw_run(seed, args)["kind"] for seed in range(1, 60)}
    assert len(kinds) >= 6, kinds
    for seed in range(1, 60):
        run = chaos.draw_run(seed, args)
        for f in run["faults"]:
            if f["kind"] == "link-flap":  # (a host's link, not a rank's step)
                assert f["host"] == 1 and run["launcher"] == "mpirun", run
            else:
                assert 0 <= f["rank"] < 4 and 1 <= f["step"] <= chaos.STEPS - 1, run


@pytest.mark.requires_mpirun
def test_chaos_runs_end_finished_or_in_a_clean_error(capsys):
    """Three seeds of real elastic jobs (4 ranks, faults inside the step, at a checkpoint
    save, a full /dev/shm, two kills): no hang, no wrong parameters, no exit 0 after a
    failure, nothing left behind."""
    status = chaos.main(["--seeds", "3", "--first-seed", "11", "--timeout-s", "200",
                         "--kinds", "kill-negotiation,kill-checkpoint,shm-full,two-faults"])
    out = capsys.readouterr().out
    assert status == 0, out
    assert "3 runs, 4 ranks each" in out, out
