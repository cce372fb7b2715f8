"""ringsync.checkpoint: tests/mpi/checkpoint_bodies.py under mpirun, saved on one rank
count and loaded on others."""
import os

import pytest

pytest.importorskip("torch")

from ringsync.testing import assert_mpi_fails, assert_mpi_ok  # noqa: E402

from tests.common import in_order  # noqa: E402

pytestmark = pytest.mark.requires_mpirun

MODULE = "tests.mpi.checkpoint_bodies"
ENV = {"RINGSYNC_TIMEOUT_SECONDS": "60", "OMP_NUM_THREADS": "1"}


def _run(np, *calls, fails=False):
    check = assert_mpi_fails if fails else assert_mpi_ok
    return check(in_order.run, np=np, timeout=180, env=ENV, args=(MODULE, *calls))


def test_saved_on_4_ranks_loads_on_2_and_3_and_survives_a_kill_mid_save(tmp_path):
    """Every config (DistributedOptimizer, ZeRO stages 1, 2, 3) saved after 3 steps on 4
    ranks, loaded on 2 and on 3, trains on to step 6 exactly as an uninterrupted run.
    On 2 ranks, a part damaged so that only rank 1 notices makes both ranks raise the same
    CheckpointError, and the previous generation then loads on both; a rank is then
    SIGKILLed in the middle of a save: the job fails, and on 3 ranks the checkpoint before
    that save loads and trains on exactly; damaged checkpoints are refused on every rank.
    (Three jobs, not six: each costs seconds of torch imports.)"""
    killed = tmp_path / "killed"
    _run(4, f"save_after:{tmp_path},3")
    result = _run(2, f"resume:{tmp_path},6", f"damage_one_rank_sees:{tmp_path / 'one'}",
                  f"save_then_die_saving:{killed},3", fails=True)
    started = result.output.count(f"--- {MODULE}.save_then_die_saving(")
    assert started == 2, result.report()  # (so both ranks passed the bodies before it)
    half_written = [f for f in os.listdir(killed / "gen-2") if ".tmp-" in f]
    assert half_written, os.listdir(killed / "gen-2")  # the kill did land mid-save
    _run(3, f"resume:{tmp_path},6", f"load_the_survivor:{killed},5",
         f"damaged_checkpoints:{tmp_path / 'damaged'}")
