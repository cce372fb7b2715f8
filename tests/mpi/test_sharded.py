"""ringsync.torch.ShardedOptimizer (ZeRO stages 1 and 2) and ShardedModule (stage 3):
tests/mpi/sharded_bodies.py, all bodies in one mpirun job per rank count (see
tests/common/in_order.py)."""
import pytest

pytest.importorskip("torch")

from ringsync.testing import assert_mpi_ok  # noqa: E402

from tests.common import in_order  # noqa: E402

pytestmark = pytest.mark.requires_mpirun

MODULE = "tests.mpi.sharded_bodies"
ENV = {"RINGSYNC_TIMEOUT_SECONDS": "60", "OMP_NUM_THREADS": "1"}
BODIES = ["same_as_distributed_optimizer", "bfloat16_parameters", "state_dicts_and_mixed_dtypes", "bad_arguments",
          "on_a_process_set", "reductions_start_during_backward",
          "stage3_same_as_distributed_optimizer", "stage3_details"]


@pytest.mark.parametrize("np", [2, 3])
def test_sharded_optimizer(np):
    assert_mpi_ok(in_order.run, np=np, timeout=120, env=ENV,
                  args=in_order.args_for(MODULE, BODIES))

