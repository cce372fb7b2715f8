"""Every collective x dtype x op on 1, 2, 3 and 4 ranks (one body, several rank counts),
over each transport, checked against numpy references built from all ranks' inputs."""
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


@pytest.mark.parametrize("transport", ["shm", "tcp"])
@pytest.mark.parametrize("np", [1, 2, 3, 4])
@pytest.mark.parametrize("body", BODIES)
def test_collective(body, np, transport, tmp_path):
    assert_mpi_ok(f"tests.mpi.bodies:{body}", np=np, timeout=180,
                  env={"RINGSYNC_TEST_DIR": str(tmp_path), "RINGSYNC_TIMEOUT_SECONDS": "60",
                       "RINGSYNC_TRANSPORT": transport})


@pytest.mark.parametrize("np", [2, 3, 4])
def test_mixed_transports_give_the_same_results(np):
    assert_mpi_ok("tests.mpi.bodies:mixed_transports", np=np, timeout=180,
                  env={"RINGSYNC_TIMEOUT_SECONDS": "60"})


def test_forced_shared_memory_across_hosts_is_a_usage_error():
    assert_mpi_ok("tests.mpi.bodies:forced_shm_needs_one_host", np=2, timeout=60)
