"""The TensorFlow adapter, and jobs mixing frameworks, under several ranks."""
import pytest

pytest.importorskip("tensorflow")

from ringsync.testing import assert_mpi_ok  # noqa: E402

pytestmark = pytest.mark.requires_mpirun

BODY = "tests.mpi.tf_bodies:"
ENV = {"RINGSYNC_TIMEOUT_SECONDS": "60", "OMP_NUM_THREADS": "1", "TF_NUM_INTEROP_THREADS": "2",
       "TF_NUM_INTRAOP_THREADS": "1", "TF_CPP_MIN_LOG_LEVEL": "3"}


@pytest.mark.parametrize("np", [1, 3])
@pytest.mark.parametrize("body", ["collectives_eager_and_in_tf_function",
                                  "gradients_through_collectives",
                                  "sparse_gradients_are_gathered",
                                  "broadcast_variables_and_objects"])
def test_tensorflow(body, np):
    assert_mpi_ok(BODY + body, np=np, timeout=240, env=ENV)


@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_tape_training_matches_one_process(dtype):
    assert_mpi_ok(BODY + "tape_training_matches_one_process", np=2, timeout=240, env=ENV,
                  args=(dtype,))


def test_torch_tensorflow_and_numpy_ranks_in_one_job():
    pytest.importorskip("torch")
    assert_mpi_ok("tests.mpi.mixed_bodies:mixed_frameworks_agree", np=3, timeout=300, env=ENV)
