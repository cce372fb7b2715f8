"""The PyTorch adapter under several ranks."""
import os

import pytest

pytest.importorskip("torch")

from ringsync.testing import assert_mpi_ok  # noqa: E402

pytestmark = pytest.mark.requires_mpirun

BODY = "tests.mpi.torch_bodies:"
ENV = {"RINGSYNC_TIMEOUT_SECONDS": "60", "OMP_NUM_THREADS": "1"}


@pytest.mark.parametrize("np", [1, 2, 3])
@pytest.mark.parametrize("body", ["collectives_on_tensors", "gradients_through_collectives",
                                  "broadcast_makes_ranks_identical",
                                  "sync_batch_norm_matches_full_batch",
                                  "optimizer_misuse_and_state",
                                  "join_lets_ranks_with_less_data_stop_early"])
def test_torch(body, np):
    assert_mpi_ok(BODY + body, np=np, timeout=180, env=ENV)


@pytest.mark.parametrize("kind,dtype,passes,compression", [
    ("sgd", "float64", "1", "none"),
    ("sgd", "float64", "2", "none"),
    ("adam", "float64", "1", "none"),
    ("adam", "float64", "2", "none"),
    ("sgd", "float32", "1", "none"),
    ("adam", "float32", "2", "none"),
    ("sgd", "float32", "1", "fp16"),
    ("adam", "float32", "1", "fp16"),
    ("sgd", "float32", "2", "bf16"),
])
@pytest.mark.parametrize("np", [2, 3])
def test_training_matches_one_process(np, kind, dtype, passes, compression):
    assert_mpi_ok(BODY + "training_matches_one_process", np=np, timeout=180, env=ENV,
                  args=(kind, dtype, passes, compression))


def test_pytorch_digits_example_reaches_95_percent():
    example = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "pytorch_digits.py")
    assert_mpi_ok(os.path.abspath(example), np=2, timeout=300, env=ENV, args=("--check",))


@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs a CUDA device")
def test_cuda_tensors():
    assert_mpi_ok(BODY + "cuda_tensors_are_staged_through_host", np=2, timeout=180, env=ENV)
