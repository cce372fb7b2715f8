"""horovod.torch's API, called as a Horovod user calls it (tests/mpi/horovod_torch_bodies.py,
several bodies per job: see tests/common/in_order.py)."""

import pytest

pytest.importorskip("torch")

from ringsync.testing import assert_mpi_ok  # noqa: E402

from tests.common import in_order  # noqa: E402

pytestmark = pytest.mark.requires_mpirun

MODULE = "tests.mpi.horovod_torch_bodies"
ENV = {"RINGSYNC_TIMEOUT_SECONDS": "60", "OMP_NUM_THREADS": "1"}
# Run on 1, 2 and 3 ranks in tests/mpi/test_torch.py::test_torch's jobs (one torch import
# for both modules' bodies).
BODIES = ["argument_rules_and_compression", "sparse_allreduce_and_probes", "more_gradients",
          "optimizer_groups_and_sparse", "adasum_allreduce_and_optimizer",
          "broadcast_optimizer_state_leaves_zero_gradients",
          "named_parameters_as_horovod_takes_them",
          "ranks_outside_the_optimizers_set_keep_their_gradients"]


def test_process_sets_on_four_ranks():
    assert_mpi_ok(in_order.run, np=4, timeout=300, env=ENV,
                  args=in_order.args_for(MODULE, ["process_sets_concurrently"]))


# Horovod's example scripts with only the import changed (pytorch_mnist.py with and without
# Adasum; fp16 compression is covered by argument bodies), in one job with ringsync's own
# PyTorch examples: tests/mpi/test_torch.py::test_pytorch_examples_learn.
HOROVOD_EXAMPLES = ["pytorch_mnist.py --check", "pytorch_mnist.py --check --use-adasum",
                    "pytorch_synthetic_benchmark.py --num-iters 1 --num-batches-per-iter 2 "
                    "--model mlp"]
