"""The model-parallel examples (pipeline, tensor, data x pipeline) on 4 ranks, each
with --check: each compares its training with one process training the unsplit model
(float64, rtol 1e-10) and exits non-zero where anything differs."""
import os

import pytest

pytest.importorskip("torch")

from ringsync.testing import assert_mpi_ok  # noqa: E402

pytestmark = pytest.mark.requires_mpirun

EXAMPLES = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", "examples"))
ENV = {"RINGSYNC_TIMEOUT_SECONDS": "60", "OMP_NUM_THREADS": "1"}


def run_example(name, *args):
    assert_mpi_ok(os.path.join(EXAMPLES, name), np=4, timeout=300, env=ENV,
                  args=(*args, "--check"))


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_pipeline_parallel_equals_unsplit_model(schedule):
    run_example("pipeline_parallel.py", "--schedule", schedule)


def test_tensor_parallel_equals_dense_block():
    """Two tensor-parallel groups of 2 ranks (process sets), each on its own data."""
    run_example("tensor_parallel.py", "--tp-size", "2")


def test_data_pipeline_parallel_equals_one_process_on_all_data():
    run_example("data_pipeline_parallel.py")
