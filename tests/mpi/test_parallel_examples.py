"""The model-parallel examples (pipeline with both schedules, tensor, data x pipeline) on
4 ranks, each with --check: each compares its training with one process training the
unsplit model (float64, rtol 1e-10) and exits non-zero where anything differs. They run
one after another in one mpirun job (tests/common/in_order.py: one torch import for all)."""
import pytest

pytest.importorskip("torch")

from ringsync.testing import assert_mpi_ok  # noqa: E402

from tests.common import in_order  # noqa: E402

pytestmark = pytest.mark.requires_mpirun

ENV = {"RINGSYNC_TIMEOUT_SECONDS": "60", "OMP_NUM_THREADS": "1"}
EXAMPLES = ["pipeline_parallel.py --schedule gpipe --check",
            "pipeline_parallel.py --schedule 1f1b --check",
            # two tensor-parallel groups of 2 ranks (process sets), each on its own data
            "tensor_parallel.py --tp-size 2 --check",
            "data_pipeline_parallel.py --check"]


def test_model_parallel_examples_equal_the_unsplit_model():
    assert_mpi_ok(in_order.examples, np=4, timeout=300, env=ENV, args=EXAMPLES)
