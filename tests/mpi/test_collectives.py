"""Every collective x dtype x op on 1, 2, 3 and 4 ranks (one body, several rank counts),
checked against numpy references built from all ranks' inputs."""
import pytest

from ringsync.testing import assert_mpi_ok

pytestmark = pytest.mark.requires_mpirun

BODIES = [
    "allreduce_all",
    "allreduce_large_and_strided",
    "allgather_all",
    "broadcast_all",
    "reducescatter_all",
    "alltoall_all",
    "barrier_orders_ranks",
    "topology_queries",
    "bad_input_then_next_call_works",
    "bad_interface_fails_on_every_rank",
    "allreduce_over_routable_address",
]


@pytest.mark.parametrize("np", [1, 2, 3, 4])
@pytest.mark.parametrize("body", BODIES)
def test_collective(body, np, tmp_path):
    assert_mpi_ok(f"tests.mpi.bodies:{body}", np=np, timeout=180,
                  env={"RINGSYNC_TEST_DIR": str(tmp_path), "RINGSYNC_TIMEOUT_SECONDS": "60"})
