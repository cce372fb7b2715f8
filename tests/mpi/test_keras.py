"""Keras 3: model.fit with DistributedOptimizer, callbacks, saving, under several ranks.

The rank code is in tests/mpi/keras_bodies.py (BODY below)."""
import pytest

pytest.importorskip("tensorflow")

from ringsync.testing import assert_mpi_ok  # noqa: E402

pytestmark = pytest.mark.requires_mpirun

BODY = "tests.mpi.keras_bodies:"
ENV = {"RINGSYNC_TIMEOUT_SECONDS": "60", "OMP_NUM_THREADS": "1", "TF_NUM_INTEROP_THREADS": "2",
       "TF_NUM_INTRAOP_THREADS": "1", "TF_CPP_MIN_LOG_LEVEL": "3"}


@pytest.mark.parametrize("dtype,passes,jit", [("float32", "1", "0"), ("float64", "1", "0"),
                                              ("float32", "2", "0"), ("float32", "1", "1")])
def test_fit_matches_one_process(dtype, passes, jit):
    assert_mpi_ok(BODY + "fit_matches_one_process", np=2, timeout=240, env=ENV,
                  args=(dtype, passes, jit))


@pytest.mark.parametrize("np", [1, 2])
def test_callbacks(np):
    assert_mpi_ok(BODY + "callbacks_do_what_their_names_say", np=np, timeout=240, env=ENV)


def test_save_and_load(tmp_path):
    assert_mpi_ok(BODY + "save_and_load_a_wrapped_model", np=2, timeout=240,
                  env=dict(ENV, RINGSYNC_TEST_DIR=str(tmp_path)))


@pytest.mark.parametrize("example", ["keras_digits.py", "tf_gradient_tape_digits.py"])
def test_digits_examples_reach_95_percent(example):
    import os
    path = os.path.join(os.path.dirname(__file__), "..", "..", "examples", example)
    assert_mpi_ok(os.path.abspath(path), np=2, timeout=300, env=ENV, args=("--check",))
