"""A job of two or three frameworks through `ringsync run`: examples/mixed_ddp_keras.py
trains a torch DDP model on the even ranks and a Keras model on the odd ones (or, with
--frameworks torch keras jax, rank % 3 picks torch, Keras or a jitted JAX step), averaging
them over the job's ring after each epoch, and every rank checks the result against a
numpy reference of the whole procedure (--check).

(tests/mpi/test_tensorflow.py has the collectives of torch, TensorFlow and numpy ranks in
one job; this is training.)"""
import re
import sys

import pytest

from tests.common.jobs import run_to_deadline

from .test_launcher import PACKAGE_ROOT, launcher_env

pytestmark = pytest.mark.requires_mpirun

DEADLINE_S = 300  # four ranks importing torch or TensorFlow on two cores


def run_mixed_example(ranks, *options):
    command = [sys.executable, "-m", "ringsync.launch.cli", "run", "-np", str(ranks),
               "examples/mixed_ddp_keras.py", *options]
    env = launcher_env(OMP_NUM_THREADS="1", TF_CPP_MIN_LOG_LEVEL="3")
    return run_to_deadline(command, env, DEADLINE_S, cwd=PACKAGE_ROOT)


def per_rank(pattern, output):
    """{rank: the pattern's first group} for each rank's line matching it."""
    return {int(rank): value for rank, value in
            re.findall(r"rank (\d+) \((?:torch|keras|jax)\): " + pattern, output)}


@pytest.mark.parametrize("ranks,frameworks", [(2, ["torch", "keras"]), (4, ["torch", "keras"]),
                                              (3, ["torch", "keras", "jax"])],
                         ids=["2-torch-keras", "4-torch-keras", "3-torch-keras-jax"])
def test_torch_and_keras_ranks_train_one_model_over_one_ring(ranks, frameworks):
    pytest.importorskip("torch")
    pytest.importorskip("tensorflow")
    pytest.importorskip("sklearn")
    if "jax" in frameworks:
        pytest.importorskip("jax")
        pytest.importorskip("optax")
    status, output = run_mixed_example(ranks, "--check", "--epochs", "2", "--batch", "60",
                                       "--frameworks", *frameworks)
    assert status == 0, f"exit status {status}; every rank's output:\n{output}"
    checked = per_rank(r"(check passed)", output)
    assert sorted(checked) == list(range(ranks)), f"check lines missing:\n{output}"
    digests = per_rank(r"digest ([0-9a-f]{16})", output)
    assert sorted(digests) == list(range(ranks)), f"digest lines missing:\n{output}"
    assert len(set(digests.values())) == 1, f"ranks ended apart: {digests}\n{output}"
