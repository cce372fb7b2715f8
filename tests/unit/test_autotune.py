"""Tune requests and the autotuner, on thread-ranks: every rank ends with the same
settings, applied at the same point, and collectives stay right whatever the settings."""
import csv
import time

import numpy as np
import pytest

import ringsync as rs
from ringsync import autotune
from ringsync.autotune import CANDIDATES, NEVER, Settings, search_plan
from tests.thread_ranks import PATHS, assert_ranks_ok, run_ranks

TIMEOUT = 120
BASE_ENV = {"RINGSYNC_TIMEOUT_SECONDS": "60"}


def _async_allreduces(comm, round_, count=40):
    """Many async allreduces of different sizes (some fuse, some are staged, depending on
    the settings), checked against the sum computed from every rank's input."""
    rank, size = comm.rank(), comm.size()
    sizes = [1 + (k * 37) % 3000 for k in range(count)] + [300_000]
    bufs = [np.arange(n, dtype=np.float32) % 97 + rank * 1000 + k + round_
            for k, n in enumerate(sizes)]
    handles = [comm.allreduce_async_(b, op=rs.Sum, name=f"tune.{k}") for k, b in enumerate(bufs)]
    for k, (h, n) in enumerate(zip(handles, sizes)):
        got = comm.synchronize(h)
        want = sum(np.arange(n, dtype=np.float32) % 97 + r * 1000 + k + round_
                   for r in range(size))
        np.testing.assert_array_equal(got, want, err_msg=f"tensor {k} round {round_}")


def _tune_applies_everywhere(comm):
    start = comm.engine_settings()
    assert start == Settings(64 << 20, 1.0, comm.config.small_allreduce_bytes,
                             comm.config.staged_bytes, comm.overlaps), start
    _async_allreduces(comm, 0)
    for k, settings in enumerate([Settings(4096, 0.0, 1024, 8192, overlap=False),
                                  Settings(0, 2.5, 256 << 10, NEVER),
                                  Settings(1 << 20, 0.5, 16 << 10, 1 << 20)]):
        comm.tune(settings)
        assert comm.engine_settings() == settings and comm.overlaps == settings.overlap
        everyone = comm.allgather(np.array([settings.native()], np.int64), name=f"seen.{k}")
        assert (everyone == everyone[0]).all(), everyone
        _async_allreduces(comm, k + 1)
        assert comm.allreduce(np.full(3, comm.rank() + 1.0), op=rs.Sum, name=f"lane.{k}")[0] \
            == comm.size() * (comm.size() + 1) / 2
    # Ranks that disagree fail the tune on every rank, naming the values; nothing changes.
    before = comm.engine_settings()
    mine = before.but(fusion_threshold=(1 << 20) * (comm.rank() + 1))
    with pytest.raises(rs.MismatchError, match="tune"):
        comm.tune(mine)
    assert comm.engine_settings() == before
    _async_allreduces(comm, 9)


@pytest.mark.parametrize("size", [2, 3])
@pytest.mark.parametrize("path", ["shm", "tcp"])
def test_tune_applies_the_same_settings_on_every_rank(size, path):
    assert_ranks_ok(_tune_applies_everywhere, size, timeout=TIMEOUT,
                    env={**BASE_ENV, **PATHS[path]})


def _autotuned_training(comm, log_path):
    """A training-like loop under autotune. Ranks' step times differ on purpose (the last
    rank is slower in some samples), yet every rank must make the same choices."""
    tuner = autotune.autotuner_for(comm)
    assert tuner is not None
    steps = 0
    while not tuner.done:
        _async_allreduces(comm, steps % 5, count=12)
        if comm.rank() == comm.size() - 1 and steps % 7 == 0:
            time.sleep(0.002)
        autotune.step(comm, overlap_matters=True)
        steps += 1
        assert steps < 500, "autotune never finished"
    chosen = comm.engine_settings()
    assert chosen == tuner.best.settings
    everyone = comm.allgather(np.array([chosen.native()], np.int64), name="chosen")
    assert (everyone == everyone[0]).all(), everyone
    history = [(s.phase, s.settings, s.step_seconds) for s in tuner.samples]
    _async_allreduces(comm, 7)  # still right with the chosen settings
    return history, steps


@pytest.mark.parametrize("size", [2, 3])
def test_autotune_makes_the_same_choices_on_every_rank(size, tmp_path):
    log = tmp_path / "autotune.csv"
    env = {**BASE_ENV, "RINGSYNC_AUTOTUNE": "1", "RINGSYNC_AUTOTUNE_WARMUP_SAMPLES": "1",
           "RINGSYNC_AUTOTUNE_STEPS_PER_SAMPLE": "2", "RINGSYNC_AUTOTUNE_MAX_SAMPLES": "8",
           "RINGSYNC_AUTOTUNE_LOG": str(log)}
    results = assert_ranks_ok(_autotuned_training, size, timeout=TIMEOUT, env=env,
                              args=(str(log),))
    histories = [history for history, _ in results]
    assert all(h == histories[0] for h in histories[1:]), histories
    phases = [phase for phase, _, _ in histories[0]]
    assert phases[0] == "warmup" and phases[1] == "baseline"
    # warm-up, then max_samples (there are more candidates than that), then the start
    # settings and the best timed again where the best was not the start
    searched = [p for p in phases[2:] if p != "confirm"]
    assert len(searched) == 8 - 1 and set(searched) <= set(CANDIDATES), phases
    assert phases[2 + len(searched):] in ([], ["confirm", "confirm"]), phases
    with open(log, newline="") as f:
        rows = list(csv.DictReader(f))
    assert [r["phase"] for r in rows[:-1]] == phases
    assert rows[-1]["phase"] == "chosen" and rows[-1]["why"], rows[-1]


def test_search_plan_tries_every_other_candidate_once():
    start = Settings(64 << 20, 1.0, 16 << 10, 1 << 20)
    plan = search_plan(start, list(CANDIDATES))
    assert len(plan) == len(set(plan))
    for name, values in CANDIDATES.items():
        assert [v for n, v in plan if n == name] == [v for v in values if v != getattr(start, name)]


def test_autotune_setting_must_agree():
    outcomes = run_ranks(lambda comm: None, 2, timeout=60,
                         env=BASE_ENV, rank_env=lambda r: {"RINGSYNC_AUTOTUNE": str(r % 2)})
    assert all(not o.ok for o in outcomes)
    assert all("RINGSYNC_AUTOTUNE" in (o.error or "") for o in outcomes), outcomes
