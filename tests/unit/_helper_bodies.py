"""Rank bodies that tests/unit/test_testing_helper.py runs through ringsync.testing."""

import os
import sys
import time


def world():
    from mpi4py import MPI

    return MPI.COMM_WORLD


def all_ranks_ok(*args):
    """Every rank agrees on the sum of ranks and sees the args it was given."""
    comm = world()
    total = comm.allreduce(comm.Get_rank())
    assert total == sum(range(comm.Get_size())), total
    assert list(args) == ["alpha", "2"], args
    print("body ok on rank %d" % comm.Get_rank())


def rank1_raises():
    """Rank 1 raises while rank 0 waits in a barrier it will never leave on its own."""
    comm = world()
    if comm.Get_rank() == 1:
        raise ValueError("rank 1 failed on purpose")
    comm.Barrier()


def rank0_waits_rank1_sleeps(marker):
    """A hang: rank 0 waits in a barrier that rank 1, asleep, never reaches."""
    comm = world()
    print("hang body with %s" % marker, flush=True)
    if comm.Get_rank() == 0:
        comm.Barrier()
    else:
        time.sleep(3600)


def exits_cleanly():
    """sys.exit(0) counts as success."""
    world().Barrier()
    sys.exit(0)


if __name__ == "__main__":
    # Run as a script target: every rank prints its rank and its arguments.
    print("script rank %d args %s pid %d" % (world().Get_rank(), sys.argv[1:], os.getpid()))
