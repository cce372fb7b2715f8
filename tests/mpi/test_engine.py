"""The engine under several ranks: negotiation, fusion, errors, stalls, timeouts, restart
and the timeline. (A rank killed with handles pending: tests/faults/test_killed_rank.py.)

The rank code is in tests/mpi/engine_bodies.py (its functions are handed to run_mpi);
test_engine runs several of those bodies one after another in one mpirun job through
tests/common/in_order.py."""
import json

import pytest

from ringsync.testing import assert_mpi_ok

from tests.common import in_order

from . import engine_bodies as bodies

pytestmark = pytest.mark.requires_mpirun


@pytest.mark.parametrize("np", [1, 2, 3, 4])
def test_engine(np):
    """These bodies one after another in one job (see tests/common/in_order.py)."""
    calls = [bodies.out_of_order_submission, bodies.grouped_and_async_collectives,
             bodies.restart_with_a_new_rank_set, bodies.join_with_uneven_steps]
    assert_mpi_ok(in_order.run, np=np, timeout=300, env={"RINGSYNC_TIMEOUT_SECONDS": "60"},
                  args=in_order.args_for(bodies, calls))


@pytest.mark.parametrize("np", [2, 4])
def test_same_host_lane(np):
    assert_mpi_ok(bodies.same_host_lane, np=np, timeout=180,
                  env={"RINGSYNC_TIMEOUT_SECONDS": "60", "RINGSYNC_TRANSPORT": "shm",
                       "RINGSYNC_LANE_BYTES": str(1 << 20)})


@pytest.mark.parametrize("np", [2, 3])
def test_every_mismatch_fails_on_every_rank(np):
    assert_mpi_ok(bodies.mismatches_fail_on_every_rank, np=np, timeout=120,
                  env={"RINGSYNC_TIMEOUT_SECONDS": "60"})


@pytest.mark.parametrize("threshold", ["0", "4096", "67108864"])
def test_fusion_threshold_does_not_change_results(threshold):
    assert_mpi_ok(bodies.fusion_settings_agree, np=3, timeout=120,
                  env={"RINGSYNC_FUSION_THRESHOLD": threshold, "RINGSYNC_TIMEOUT_SECONDS": "60"})


def test_stall_is_reported_once_naming_the_missing_rank():
    result = assert_mpi_ok(bodies.stalled_tensor_is_reported, np=3, timeout=60,
                           env={"RINGSYNC_STALL_CHECK_SECONDS": "1"})
    reports = [line for line in result.output.splitlines() if "ringsync: stall:" in line]
    assert len(reports) == 1, result.report()
    assert "'late.tensor'" in reports[0] and "ranks [0, 2]" in reports[0], reports
    assert "ranks [1] have not submitted it" in reports[0], reports


def test_a_tensor_one_rank_never_submits_times_out():
    assert_mpi_ok(bodies.never_submitted_times_out_everywhere, np=3, timeout=60,
                  env={"RINGSYNC_TIMEOUT_SECONDS": "1.5"})


@pytest.mark.parametrize("np", [1, 3])
def test_timeline_is_chrome_trace_json(np, tmp_path):
    assert_mpi_ok(bodies.timeline_records_each_tensor, np=np, timeout=60,
                  env={"RINGSYNC_TEST_DIR": str(tmp_path)})
    for rank in range(np):
        with open(tmp_path / f"timeline-{rank}.json") as f:
            assert json.load(f)["traceEvents"]


def test_timeline_from_the_environment(tmp_path):
    path = tmp_path / "env-timeline.json"
    code = ("import ringsync as rs, numpy as np; rs.init(); "
            "[rs.allreduce(np.ones(8), name='env.t') for _ in range(3)]; rs.shutdown()")
    script = tmp_path / "tl.py"
    script.write_text(code)
    assert_mpi_ok(str(script), np=1, timeout=60, env={"RINGSYNC_TIMELINE": str(path)})
    events = json.loads(path.read_text())["traceEvents"]
    assert [e["name"] for e in events if e.get("ph") == "X"].count("ALLREDUCE") == 3
    assert {e["args"]["tensor"] for e in events if e.get("ph") == "X"} == {"allreduce.env.t"}
