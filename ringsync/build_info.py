"""Horovod's build and runtime probes, answered for ringsync.

ringsync has one data path: its own native core (TCP and shared memory). MPI (mpi4py)
only starts the ranks and agrees on survivors; there is no Gloo, NCCL, DDL, oneCCL,
CUDA or ROCm code in it (CUDA tensors are staged through host memory).
"""
from collections import Counter

from ._context import resolve
from .errors import UsageError


def mpi_built() -> bool:
    """Whether MPI can bootstrap the ranks (mpi4py imports)."""
    try:
        import mpi4py  # noqa: F401
    except ImportError:
        return False
    return True


def mpi_enabled() -> bool:
    """Whether the job's ring was bootstrapped over MPI."""
    return resolve().mpi_comm is not None


def mpi_threads_supported() -> bool:
    """Whether MPI runs with MPI_THREAD_MULTIPLE (several threads may call MPI at once)."""
    if resolve().mpi_comm is None:
        raise UsageError("ringsync.mpi_threads_supported: the job was not bootstrapped over MPI")
    from mpi4py import MPI
    return MPI.Query_thread() == MPI.THREAD_MULTIPLE


def gloo_built() -> bool:
    return False


def gloo_enabled() -> bool:
    return False


def nccl_built() -> int:
    """The NCCL version built in, as Horovod reports it (an int): 0, none."""
    return 0


def ddl_built() -> bool:
    return False


def ccl_built() -> bool:
    return False


def cuda_built() -> bool:
    """False: no device-side transport (CUDA tensors work, staged through host memory)."""
    return False


def rocm_built() -> bool:
    return False


def is_homogeneous() -> bool:
    """Whether every host runs the same number of ranks."""
    return len(set(Counter(resolve().host_names).values())) == 1


__all__ = ["mpi_built", "mpi_enabled", "mpi_threads_supported", "gloo_built", "gloo_enabled",
           "nccl_built", "ddl_built", "ccl_built", "cuda_built", "rocm_built",
           "is_homogeneous"]
