"""Keras 3: model.fit with DistributedOptimizer, callbacks, saving, and horovod.tensorflow.keras's
API as Horovod users call it, under several ranks.

The rank code is in tests/mpi/keras_bodies.py (MODULE below); the bodies of one rank count
run one after another in one job (tests/common/in_order.py): importing TensorFlow takes seconds."""

import pytest

pytest.importorskip("tensorflow")

from ringsync.testing import assert_mpi_ok  # noqa: E402

from tests.common import in_order  # noqa: E402

pytestmark = pytest.mark.requires_mpirun

MODULE = "tests.mpi.keras_bodies"
ENV = {"RINGSYNC_TIMEOUT_SECONDS": "60", "OMP_NUM_THREADS": "1", "TF_NUM_INTEROP_THREADS": "2",
       "TF_NUM_INTRAOP_THREADS": "1", "TF_CPP_MIN_LOG_LEVEL": "3"}
# (dtype, backward passes per step, jit_compile, average_aggregated_gradients)
# float64 first: it must run before any float32 model in the process (its 1e-10 bound).
FITS = [("float64", "1", "0", "0"), ("float32", "1", "0", "0"), ("float32", "2", "0", "0"),
        ("float32", "2", "0", "1"), ("float32", "1", "1", "0")]


def test_fit_callbacks_saving_and_horovods_keras_api(tmp_path):
    """One job: fit against one process in every variant, then the other bodies."""
    fits = in_order.args_for(MODULE, ["fit_matches_one_process"], FITS)[1:]
    assert_mpi_ok(in_order.run, np=2, timeout=400,
                  env=dict(ENV, RINGSYNC_TEST_DIR=str(tmp_path)),
                  args=(MODULE, *fits, "callbacks_do_what_their_names_say",
                        "save_and_load_a_wrapped_model", "horovod_keras_api"))


def test_horovods_tensorflow2_examples_learn():
    """Horovod's two TensorFlow 2 examples, only the import changed, one after the other in
    one job (one TensorFlow import)."""
    assert_mpi_ok(in_order.examples, np=2, timeout=400, env=ENV,
                  args=["tensorflow2_keras_mnist.py --check", "tensorflow2_mnist.py --check"])
