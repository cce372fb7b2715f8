"""The TensorFlow adapter, and jobs mixing frameworks, under several ranks.

The rank code is in tests/mpi/tf_bodies.py (MODULE below) and, for the mixed job,
tests/mpi/mixed_bodies.py, not in this file: importing TensorFlow takes seconds, so the
tests run several bodies one after another in one mpirun job through
tests/common/in_order.py."""
import pytest

pytest.importorskip("tensorflow")

from ringsync.testing import assert_mpi_ok  # noqa: E402

from tests.common import in_order  # noqa: E402

from . import mixed_bodies  # noqa: E402  (numpy alone; its body imports the frameworks)

pytestmark = pytest.mark.requires_mpirun

MODULE = "tests.mpi.tf_bodies"
ENV = {"RINGSYNC_TIMEOUT_SECONDS": "60", "OMP_NUM_THREADS": "1", "TF_NUM_INTEROP_THREADS": "2",
       "TF_NUM_INTRAOP_THREADS": "1", "TF_CPP_MIN_LOG_LEVEL": "3"}


# (tests/mpi/test_horovod_tensorflow.py runs tf_bodies' bodies too, in its jobs)


def test_torch_tensorflow_and_numpy_ranks_in_one_job():
    pytest.importorskip("torch")
    assert_mpi_ok(mixed_bodies.mixed_frameworks_agree, np=3, timeout=300, env=ENV)
