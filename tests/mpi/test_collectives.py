"""Every collective x dtype x op on 1, 2, 3 and 4 ranks (one body, several rank counts),
over each transport and same-host path, checked against numpy references built from all
ranks' inputs."""
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


# How same-host ranks move data: the default (shared memory; blocking small allreduces on
# the lane, large allreduces staged through the segments), TCP only, the ring over the
# shared-memory transport (as between hosts), and every allreduce staged.
PATHS = {
    "shm": {"RINGSYNC_TRANSPORT": "shm"},
    "tcp": {"RINGSYNC_TRANSPORT": "tcp"},
    "shm-ring": {"RINGSYNC_TRANSPORT": "shm", "RINGSYNC_LANE_BYTES": "0",
                 "RINGSYNC_STAGED_BYTES": "0"},
    "staged": {"RINGSYNC_TRANSPORT": "shm", "RINGSYNC_LANE_BYTES": "0",
               "RINGSYNC_STAGED_BYTES": "1"},
}
ALLREDUCE_BODIES = ["allreduce_all", "allreduce_large_and_strided"]
CASES = ([(body, np, "shm") for body in BODIES for np in (1, 2, 3, 4)] +
         [(body, np, "tcp") for body in BODIES for np in (2, 4)] +
         [(body, np, "shm-ring") for body in ALLREDUCE_BODIES + ["barrier_orders_ranks"]
          for np in (2, 3)] +
         [(body, np, "staged") for body in ALLREDUCE_BODIES for np in (2, 3, 4)])


@pytest.mark.parametrize("body,np,path", CASES)
def test_collective(body, np, path, tmp_path):
    assert_mpi_ok(f"tests.mpi.bodies:{body}", np=np, timeout=180,
                  env={"RINGSYNC_TEST_DIR": str(tmp_path), "RINGSYNC_TIMEOUT_SECONDS": "60",
                       **PATHS[path]})


@pytest.mark.parametrize("np", [2, 3, 4])
def test_mixed_transports_give_the_same_results(np):
    assert_mpi_ok("tests.mpi.bodies:mixed_transports", np=np, timeout=180,
                  env={"RINGSYNC_TIMEOUT_SECONDS": "60"})


def test_forced_shared_memory_across_hosts_is_a_usage_error():
    assert_mpi_ok("tests.mpi.bodies:forced_shm_needs_one_host", np=2, timeout=60)
