"""horovod.tensorflow's API, called as a Horovod user calls it (tests/mpi/horovod_tf_bodies.py,
which also runs tests/mpi/tf_bodies.py's bodies), several bodies per job: importing
TensorFlow takes seconds (see tests/common/in_order.py)."""
import pytest

pytest.importorskip("tensorflow")

from ringsync.testing import assert_mpi_ok  # noqa: E402

from tests.common import in_order  # noqa: E402

pytestmark = pytest.mark.requires_mpirun

MODULE = "tests.mpi.horovod_tf_bodies"
ENV = {"RINGSYNC_TIMEOUT_SECONDS": "60", "OMP_NUM_THREADS": "1", "TF_NUM_INTEROP_THREADS": "2",
       "TF_NUM_INTRAOP_THREADS": "1", "TF_CPP_MIN_LOG_LEVEL": "3"}
BODIES = ["collectives_eager_and_in_tf_function", "broadcast_variables_and_objects",
          "tape_training_matches_one_process", "collectives_as_horovod_calls_them", "collectives_inside_tf_function",
          "gradients_by_horovods_rules", "errors_leave_the_next_call_working",
          "tape_and_optimizer_arguments", "process_sets_in_tensorflow",
          "sync_batch_norm_uses_the_global_batch", "gradients_fused_into_one_buffer",
          "fused_mismatch_fails_every_rank_then_works", "collectives_in_a_tf1_graph_session",
          "none_gradients_pass_through", "ranks_outside_the_tapes_set_keep_their_gradients"]


@pytest.mark.parametrize("np", [1, 3])
def test_horovod_tensorflow_api(np):
    assert_mpi_ok(in_order.run, np=np, timeout=400, env=ENV,
                  args=in_order.args_for(MODULE, BODIES))
