"""The JAX adapter under several ranks (rank code: tests/mpi/jax_bodies.py, several bodies
per job through tests/common/in_order.py: importing JAX takes a second)."""
import os
import sys
from pathlib import Path

import pytest

pytest.importorskip("jax")
pytest.importorskip("optax")

from ringsync.testing import assert_mpi_ok  # noqa: E402

from tests.common import in_order  # noqa: E402
from tests.common.jobs import run_to_deadline  # noqa: E402

pytestmark = pytest.mark.requires_mpirun

MODULE = "tests.mpi.jax_bodies"
ENV = {"RINGSYNC_TIMEOUT_SECONDS": "60", "OMP_NUM_THREADS": "1", "JAX_PLATFORMS": "cpu",
       "XLA_FLAGS": "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1"}


# (1 and 2 ranks: 3 ranks' uneven splits are the core's, covered by the numpy and torch
# matrices; a JAX job of 3 ranks cost the full suite 50 s on 2 cores)
@pytest.mark.parametrize("np", [1, 2])
def test_collectives_gradients_training_errors_and_checkpoints(np, tmp_path):
    """One job per rank count (each rank imports JAX once): the collective matrix eager
    and jitted, Horovod's gradient rules, training against one process, errors that leave
    the next step working, and checkpoints of pytrees."""
    matrix = in_order.args_for(MODULE, ["collective_matrix"], [("eager",), ("jit",)])
    rest = in_order.args_for(MODULE, ["gradients_by_horovods_rules",
                                      "errors_leave_the_next_step_working",
                                      "training_matches_one_process:float64",
                                      "training_matches_one_process:float32",
                                      f"checkpoints_of_pytrees:{tmp_path}"])
    assert_mpi_ok(in_order.run, np=np, timeout=600, env=ENV, args=in_order.chain(matrix, rest))


def test_jitted_collective_matrix_through_python_callbacks():
    """RINGSYNC_JAX_FFI=0: every traced collective an ordered io_callback."""
    assert_mpi_ok(in_order.run, np=2, timeout=400, env=dict(ENV, RINGSYNC_JAX_FFI="0"),
                  args=in_order.args_for(MODULE, ["collective_matrix"], [("jit",)]))


def test_unordered_collectives_pair_up_with_xlas_own_threads():
    env = {k: v for k, v in ENV.items() if k != "XLA_FLAGS"}
    assert_mpi_ok(in_order.run, np=2, timeout=300, env=env,
                  args=in_order.args_for(MODULE, ["independent_collectives_pair_up",
                                                  "chained_in_program_order",
                                                  "unordered_programs_fail_loudly"]))


def test_the_example_matches_one_process_under_ringsync_run():
    """examples/jax_digits.py on 2 ranks under `ringsync run`: at least 95% test accuracy
    and, in float64, the parameters one process reaches on the whole batches (to 1e-9);
    in float32 to 1e-5 after 3 epochs (Adam's division by sqrt(v) + 1e-8 lets float32
    round-off grow past that over the full run, on one process against another too)."""
    pytest.importorskip("sklearn")
    root = Path(__file__).resolve().parents[2]
    launcher = [sys.executable, "-m", "ringsync.launch.cli", "run", "-np", "2",
                "examples/jax_digits.py"]
    env = dict(os.environ, **ENV)
    for args, expected in [(["--dtype", "float64", "--check", "--check-reference"],
                            "(tolerance 1e-09)"),
                           (["--epochs", "3", "--check-reference"], "(tolerance 1e-05)")]:
        status, output = run_to_deadline(launcher + args, env, 300, cwd=root)
        assert status == 0, f"{args}: exit status {status}; every rank's output:\n{output}"
        assert output.count(expected) == 2, output


def test_jax_ranks_join_torch_tensorflow_and_numpy_ranks():
    """Rank 3 reduces JAX arrays inside jax.jit, ranks 0-2 torch, TensorFlow and numpy
    ones, under the same names, on one ring: every rank ends with the same bytes."""
    pytest.importorskip("torch")
    pytest.importorskip("tensorflow")
    from . import mixed_bodies
    assert_mpi_ok(mixed_bodies.mixed_frameworks_agree, np=4, timeout=300,
                  env=dict(ENV, TF_CPP_MIN_LOG_LEVEL="3", TF_NUM_INTEROP_THREADS="2",
                           TF_NUM_INTRAOP_THREADS="1"))
