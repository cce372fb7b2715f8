"""horovod.torch's API, called as a Horovod user calls it (tests/mpi/horovod_torch_bodies.py,
several bodies per job: see tests/mpi/in_order.py)."""
import os

import pytest

pytest.importorskip("torch")

from ringsync.testing import assert_mpi_ok  # noqa: E402

from . import in_order  # noqa: E402

pytestmark = pytest.mark.requires_mpirun

MODULE = "tests.mpi.horovod_torch_bodies"
ENV = {"RINGSYNC_TIMEOUT_SECONDS": "60", "OMP_NUM_THREADS": "1"}
BODIES = ["argument_rules_and_compression", "sparse_allreduce_and_probes", "more_gradients",
          "optimizer_groups_and_sparse", "adasum_allreduce_and_optimizer"]


@pytest.mark.parametrize("np", [1, 2, 3])
def test_horovod_torch_api(np):
    assert_mpi_ok(in_order.TARGET, np=np, timeout=400, env=ENV,
                  args=in_order.args_for(MODULE, BODIES))


def test_process_sets_on_four_ranks():
    assert_mpi_ok(in_order.TARGET, np=4, timeout=300, env=ENV,
                  args=in_order.args_for(MODULE, ["process_sets_concurrently"]))


def _example(name):
    here = os.path.dirname(os.path.abspath(__file__))
    return os.path.join(here, "..", "..", "examples", name)


@pytest.mark.parametrize("flags", [(), ("--use-adasum",)])  # (fp16: argument bodies)
def test_horovod_style_mnist_example_learns(flags):
    """examples/pytorch_mnist.py: Horovod's example script with only the import changed."""
    assert_mpi_ok(_example("pytorch_mnist.py"), np=2, timeout=300, env=ENV,
                  args=("--check", *flags))


def test_horovod_style_synthetic_benchmark_runs():
    assert_mpi_ok(_example("pytorch_synthetic_benchmark.py"), np=2, timeout=300, env=ENV,
                  args=("--num-iters", "1", "--num-batches-per-iter", "2", "--model", "mlp"))
