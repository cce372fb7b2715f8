"""The PyTorch adapter under several ranks.

The rank code is in tests/mpi/torch_bodies.py (MODULE below), not in this file: importing
torch takes seconds, so the tests run several bodies one after another in one mpirun job
through tests/common/in_order.py."""

import pytest

pytest.importorskip("torch")

from ringsync.testing import assert_mpi_ok  # noqa: E402

from tests.common import in_order  # noqa: E402
from .test_horovod_torch import BODIES as HOROVOD_BODIES  # noqa: E402
from .test_horovod_torch import HOROVOD_EXAMPLES  # noqa: E402
from .test_horovod_torch import MODULE as HOROVOD_MODULE  # noqa: E402

pytestmark = pytest.mark.requires_mpirun

MODULE = "tests.mpi.torch_bodies"
ENV = {"RINGSYNC_TIMEOUT_SECONDS": "60", "OMP_NUM_THREADS": "1"}


BODIES = ["collectives_on_tensors", "gradients_through_collectives",
          "broadcast_makes_ranks_identical", "sync_batch_norm_matches_full_batch",
          "optimizer_misuse_and_state", "join_lets_ranks_with_less_data_stop_early",
          "bucket_views_alias_across_steps"]
# (optimizer, dtype, backward passes per step, compression)
TRAINING = [("sgd", "float64", "1", "none"), ("sgd", "float64", "2", "none"),
            ("adam", "float64", "1", "none"), ("adam", "float64", "2", "none"),
            ("sgd", "float32", "1", "none"), ("adam", "float32", "2", "none"),
            ("sgd", "float32", "1", "fp16"), ("adam", "float32", "1", "fp16"),
            ("sgd", "float32", "2", "bf16"),
            # gradient_as_bucket_view=True: the gradients are views of the reduction buffer
            ("sgd", "float64", "1", "none", "views"), ("adam", "float32", "2", "none", "views")]


# DistributedOptimizer reduces gradients during backward (overlap on) or all at step()
# (off); each rank count runs one of them, whatever the machine's auto choice would be.
OVERLAP = {1: "auto", 2: "off", 3: "on"}


@pytest.mark.parametrize("np", [1, 2, 3])
def test_torch(np):
    """Every body, one after another in one job (see tests/common/in_order.py); with several
    ranks, then DistributedOptimizer on 1/np of each batch against one process, for every
    optimizer x dtype x backward_passes_per_step x compression in TRAINING (gradients
    reduced at step() on 2 ranks, during backward on 3: OVERLAP); then, in the same job
    (one torch import), horovod.torch's API as Horovod users call it
    (tests/mpi/test_horovod_torch.py BODIES)."""
    training = in_order.args_for(MODULE, ["training_matches_one_process"], TRAINING)[1:]
    args = in_order.chain((MODULE, *BODIES, *(training if np > 1 else ())),
                          in_order.args_for(HOROVOD_MODULE, HOROVOD_BODIES))
    assert_mpi_ok(in_order.run, np=np, timeout=500,
                  env={**ENV, "RINGSYNC_OVERLAP": OVERLAP[np]}, args=args)


def test_pytorch_examples_learn():
    """The PyTorch examples with --check, one after another in one job (one torch import):
    pytorch_digits.py (95 % accuracy), zero_digits.py at stage 3 (ShardedModule, the same
    95 %; stages 1 and 2 are ShardedOptimizer alone, covered by tests/mpi/test_sharded.py),
    and Horovod's examples (tests/mpi/test_horovod_torch.py HOROVOD_EXAMPLES)."""
    examples = ["pytorch_digits.py --check", "zero_digits.py --stage 3 --epochs 7 --check",
                *HOROVOD_EXAMPLES]
    assert_mpi_ok(in_order.examples, np=2, timeout=400, env=ENV, args=examples)


@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs a CUDA device")
def test_cuda_tensors():
    from . import torch_bodies  # here, not above: pytest's process needs it for this test only
    assert_mpi_ok(torch_bodies.cuda_tensors_are_staged_through_host, np=2, timeout=180, env=ENV)
