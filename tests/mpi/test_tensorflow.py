"""The TensorFlow adapter, and jobs mixing frameworks, under several ranks.

The rank code is in tests/mpi/tf_bodies.py (MODULE below) and, for the mixed job,
tests/mpi/mixed_bodies.py, not in this file: importing TensorFlow takes seconds, so the
tests run several bodies one after another in one mpirun job through
tests/mpi/in_order.py."""
import pytest

pytest.importorskip("tensorflow")

from ringsync.testing import assert_mpi_ok  # noqa: E402

from . import in_order  # noqa: E402

pytestmark = pytest.mark.requires_mpirun

MODULE = "tests.mpi.tf_bodies"
ENV = {"RINGSYNC_TIMEOUT_SECONDS": "60", "OMP_NUM_THREADS": "1", "TF_NUM_INTEROP_THREADS": "2",
       "TF_NUM_INTRAOP_THREADS": "1", "TF_CPP_MIN_LOG_LEVEL": "3"}


BODIES = ["collectives_eager_and_in_tf_function", "gradients_through_collectives",
          "sparse_gradients_are_gathered", "broadcast_variables_and_objects"]


@pytest.mark.parametrize("np", [1, 3])
def test_tensorflow(np):
    """Every body, one after another in one job (see tests/mpi/in_order.py)."""
    assert_mpi_ok(in_order.TARGET, np=np, timeout=400, env=ENV,
                  args=in_order.args_for(MODULE, BODIES))


def test_tape_training_matches_one_process():
    assert_mpi_ok(in_order.TARGET, np=2, timeout=400, env=ENV,
                  args=in_order.args_for(MODULE, ["tape_training_matches_one_process"],
                                         [("float64",), ("float32",)]))


def test_torch_tensorflow_and_numpy_ranks_in_one_job():
    pytest.importorskip("torch")
    assert_mpi_ok("tests.mpi.mixed_bodies:mixed_frameworks_agree", np=3, timeout=300, env=ENV)
