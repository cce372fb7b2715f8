"""Elastic recovery under Open MPI's ULFM: ranks SIGKILLed at chosen points, the
survivors (and replacements) finish with identical state equal to a reference replay
of the steps as they were finally run, and nothing of the job is left running."""
import glob
import json
import os

import pytest

from ringsync.testing import run_mpi
from tests.faults import elastic_bodies as bodies

pytestmark = pytest.mark.requires_mpirun

ULFM = ("--with-ft", "ulfm")
TIMEOUT = 120


def run_job(tmp_path, target, np, args=(), mpirun_args=ULFM, **env):
    marker = f"ringsync-elastic-{os.getpid()}-{tmp_path.name}"
    settings = {"RINGSYNC_TEST_DIR": str(tmp_path), "RINGSYNC_TIMEOUT_SECONDS": "60"}
    settings.update({name: str(value) for name, value in env.items()})
    result = run_mpi(f"tests.faults.elastic_bodies:{target}", np=np, timeout=TIMEOUT,
                     args=tuple(args) + (marker,), mpirun_args=mpirun_args, env=settings)
    assert not result.timed_out, result.report()
    assert not result.leftover_pids, f"processes left running: {result.leftover_pids}\n" + result.report()
    records = [json.load(open(p)) for p in sorted(glob.glob(str(tmp_path / "result-*.json")))]
    return result, records


def assert_survivors_agree(result, records, expected_size):
    assert result.returncode == 0, result.report()
    assert len(records) == expected_size, result.report()
    assert sorted(r["rank"] for r in records) == list(range(expected_size)), records
    assert all(r["size"] == expected_size for r in records), records


def assert_numpy_run(result, records, expected_size, lost_at_or_before):
    assert_survivors_agree(result, records, expected_size)
    for r in records:
        assert r["w"] == records[0]["w"], "parameters differ between survivors"
        assert r["w"] == pytest.approx(r["reference"], rel=1e-12, abs=1e-12), r
        assert r["restores"] == records[0]["restores"], "survivors restored different commits"
        sizes = r["sizes"]
        assert len(sizes) == bodies.STEPS
        changed = sizes.index(expected_size)
        assert changed <= lost_at_or_before and set(sizes[changed:]) == {expected_size}, sizes
    redone = max(r["steps_run"] for r in records) - bodies.STEPS
    assert 0 <= redone <= bodies.COMMIT_EVERY, f"{redone} steps redone"


@pytest.mark.parametrize("np,victim", [(4, 2), (3, 0)])
def test_a_killed_rank_leaves_the_survivors_training(np, victim, tmp_path):
    result, records = run_job(tmp_path, "numpy_training", np, args=("plain",),
                              RINGSYNC_TEST_VICTIM=victim, RINGSYNC_TEST_KILL_STEP=10)
    assert_numpy_run(result, records, np - 1, lost_at_or_before=10)
    assert "ringsync.elastic: lost rank(s) [%d] of %d" % (victim, np) in result.output


def test_a_rank_killed_inside_commit(tmp_path):
    result, records = run_job(tmp_path, "numpy_training", 4, args=("commit",),
                              RINGSYNC_TEST_VICTIM=1, RINGSYNC_TEST_KILL_STEP=12)
    assert_numpy_run(result, records, 3, lost_at_or_before=12)
    assert len(records[0]["restores"]) == 1


def test_a_second_failure_during_recovery(tmp_path):
    result, records = run_job(tmp_path, "numpy_training", 4, args=("second",),
                              RINGSYNC_TEST_VICTIM=1, RINGSYNC_TEST_SECOND=3,
                              RINGSYNC_TEST_KILL_STEP=9)
    assert_numpy_run(result, records, 2, lost_at_or_before=9)
    assert {r["original_rank"] for r in records} == {0, 2}


def test_an_uncaught_exception_is_a_lost_rank(tmp_path):
    result, records = run_job(tmp_path, "numpy_training", 3, args=("exception",),
                              RINGSYNC_TEST_VICTIM=2, RINGSYNC_TEST_KILL_STEP=7)
    assert_numpy_run(result, records, 2, lost_at_or_before=7)
    assert "RuntimeError: a bug on rank 2" in result.outcomes[2], result.report()


def test_below_min_np_the_job_ends_with_a_clear_message(tmp_path):
    result, records = run_job(tmp_path, "numpy_training", 3, args=("plain",),
                              RINGSYNC_TEST_VICTIM=1, RINGSYNC_ELASTIC_MIN_NP=3)
    assert result.returncode != 0, result.report()
    assert records == []
    assert "only 2 rank(s) left after losing rank(s) [1]; the job needs at least 3" in result.output


def test_reset_limit_ends_the_job(tmp_path):
    (tmp_path / "none").mkdir()
    (tmp_path / "one").mkdir()
    result, records = run_job(tmp_path / "none", "numpy_training", 3, args=("plain",),
                              RINGSYNC_TEST_VICTIM=1, RINGSYNC_ELASTIC_RESET_LIMIT=0)
    assert result.returncode == 0 and len(records) == 2, result.report()  # 0: no limit
    result, records = run_job(tmp_path / "one", "numpy_training", 3, args=("second",),
                              RINGSYNC_TEST_VICTIM=1, RINGSYNC_TEST_SECOND=2,
                              RINGSYNC_ELASTIC_RESET_LIMIT=1)
    assert result.returncode != 0 and records == [], result.report()
    assert "reset limit reached (1 recoveries" in result.output, result.report()


def test_without_ulfm_a_lost_rank_ends_the_job(tmp_path):
    result, records = run_job(tmp_path, "numpy_training", 3, args=("plain",), mpirun_args=(),
                              RINGSYNC_TEST_VICTIM=1)
    assert result.returncode != 0, result.report()
    assert records == []


def test_torch_state_after_a_kill_mid_allreduce(tmp_path):
    result, records = run_job(tmp_path, "torch_training", 4, RINGSYNC_TEST_VICTIM=2,
                              RINGSYNC_TEST_KILL_STEP=6)
    assert_survivors_agree(result, records, 3)
    for r in records:
        assert r["params"] == records[0]["params"], "parameters differ between survivors"
        assert r["error"] < 1e-10, r["error"]  # against one process replaying the steps
        assert r["sizes"][:4] == [4] * 4 and set(r["sizes"][4:]) == {3}, r["sizes"]
    redone = records[0]["steps_run"] - bodies.TORCH_STEPS
    assert 0 < redone <= bodies.COMMIT_EVERY


def test_respawn_returns_the_job_to_its_size(tmp_path):
    result, records = run_job(tmp_path, "torch_training", 4, RINGSYNC_TEST_VICTIM=1,
                              RINGSYNC_TEST_KILL_STEP=6, RINGSYNC_ELASTIC_RESPAWN=1)
    assert_survivors_agree(result, records, 4)
    assert sorted(r["original_rank"] for r in records) == [-1, 0, 2, 3]
    for r in records:
        assert r["params"] == records[0]["params"], "the replacement differs from the survivors"
        assert r["error"] < 1e-10, r["error"]
        assert set(r["sizes"]) == {4}, r["sizes"]
    assert "3 survivors + 1 replacement(s) = 4 ranks" in result.output


def test_elastic_sampler_covers_the_epoch_after_a_kill(tmp_path):
    result, records = run_job(tmp_path, "sampler_coverage", 4, RINGSYNC_TEST_VICTIM=2)
    assert_survivors_agree(result, records, 3)
    counts = records[0]["counts"]
    assert all(r["counts"] == counts for r in records)
    assert min(counts) == 1, "a sample was never trained on"
    # Repeats only from padding: at most (ranks - 1) per reshard, two reshards here.
    assert sum(counts) - len(counts) <= 2 * 3, counts


def test_keras_state_after_a_kill(tmp_path):
    result, records = run_job(tmp_path, "keras_training", 3, RINGSYNC_TEST_VICTIM=1,
                              RINGSYNC_TEST_KILL_STEP=6)
    assert_survivors_agree(result, records, 2)
    for r in records:
        assert r["params"] == records[0]["params"], "weights differ between survivors"
        assert r["error"] < 1e-5, r["error"]  # float32, against one process replaying
        assert r["sizes"][:4] == [3] * 4 and set(r["sizes"][4:]) == {2}, r["sizes"]


def test_elastic_torch_example_survives_a_kill():
    example = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "elastic_torch.py")
    result = run_mpi(os.path.abspath(example), np=3, timeout=300, mpirun_args=ULFM,
                     args=("--kill", "1:20", "--check", "--epochs", "8"))
    assert not result.timed_out and not result.leftover_pids, result.report()
    assert result.returncode == 0, result.report()
    assert result.outcomes == {0: "ok", 1: "missing", 2: "ok"}, result.report()
    assert "lost rank(s) [1] of 3; 2 survivors = 2 ranks" in result.output
    assert "test accuracy on 2 ranks" in result.output
