"""Mismatched blocking collectives, shared by the thread-rank stress test
(tests/unit/test_mismatch_stress.py) and the one under mpirun with loaded cores
(tests/faults/test_mismatch_under_load.py).

Each case is one blocking call that rank 1 makes differently from the others: a different
dtype, shape, op, scale, name, root, or splits; or arguments that only rank 1's own checks
refuse (a root out of range, splits that do not add up, rows that do not divide). Every
rank must fail that call, and the correct call that follows must then succeed on every
rank with the right result: the ranks are still matched call for call.
"""
import random
import time

import numpy as np

import ringsync as rs
from ringsync.errors import CommunicationError, UsageError


def cases(comm):
    """name -> the call this rank makes (rank 1 is the odd one out)."""
    n, odd = comm.size(), comm.rank() == 1
    f32 = np.arange(6, dtype=np.float32) + comm.rank()
    rows = np.arange(2 * n, dtype=np.float64)
    return {
        "dtype": lambda: comm.allreduce(f32.astype(np.int32) if odd else f32),
        "shape": lambda: comm.allreduce(f32[:5] if odd else f32),
        "op": lambda: comm.allreduce(f32, op=rs.Max if odd else rs.Sum),
        "scale": lambda: comm.allreduce(f32, prescale_factor=2.0 if odd else 1.0),
        "name": lambda: comm.allreduce(f32, name="odd" if odd else "even"),
        "large_shape": lambda: comm.allreduce(np.zeros(300_001 if odd else 300_000, np.float32)),
        "root": lambda: comm.broadcast(f32, 1 if odd else 0),
        "root_out_of_range": lambda: comm.broadcast(f32, n + 5 if odd else 0),
        "broadcast_dtype": lambda: comm.broadcast(f32.astype(np.float64) if odd else f32, 0),
        "splits_sum": lambda: comm.alltoall(rows, splits=[1] * n if odd else [2] * n),
        "splits_length": lambda: comm.alltoall(rows, splits=[2] * (n + 1) if odd else [2] * n),
        "rows_indivisible": lambda: comm.alltoall(rows[:2 * n - 1] if odd else rows),
        "alltoall_dtype": lambda: comm.alltoall(rows.astype(np.int32) if odd else rows),
        "alltoall_shape": lambda: comm.alltoall(np.zeros((2 * n, 3 if odd else 2))),
        "allgather_shape": lambda: comm.allgather(np.zeros((2, 3 if odd else 2))),
        "reducescatter_shape": lambda: comm.reducescatter(np.zeros((2 * n, 3 if odd else 2))),
        "reducescatter_op": lambda: comm.reducescatter(rows, op=rs.Min if odd else rs.Sum),
    }


def torch_cases(hvd):
    """The same through ringsync.torch, as a Horovod user calls it (its own checks and
    conversions come first)."""
    import torch
    n, odd = hvd.size(), hvd.rank() == 1
    f32 = torch.arange(6, dtype=torch.float32) + hvd.rank()
    rows = torch.arange(2 * n, dtype=torch.float64)
    return {
        "dtype": lambda: hvd.allreduce(f32.int() if odd else f32),
        "shape": lambda: hvd.allreduce(f32[:5] if odd else f32),
        "op": lambda: hvd.allreduce(f32, op=hvd.Max if odd else hvd.Sum),
        "name": lambda: hvd.allreduce(f32, name="odd" if odd else "even"),
        "root": lambda: hvd.broadcast(f32, 1 if odd else 0),
        "root_out_of_range": lambda: hvd.broadcast(f32, n + 5 if odd else 0),
        "splits_sum": lambda: hvd.alltoall(rows, torch.tensor([1] * n if odd else [2] * n)),
        "rows_indivisible": lambda: hvd.alltoall(rows[:2 * n - 1] if odd else rows),
        "alltoall_dtype": lambda: hvd.alltoall(rows.int() if odd else rows),
        "allgather_shape": lambda: hvd.allgather(torch.zeros(2, 3 if odd else 2)),
        "reducescatter_shape": lambda: hvd.reducescatter(torch.zeros(2 * n, 3 if odd else 2)),
        # ringsync.torch's own checks, before the core sees the call
        "none_tensor": lambda: hvd.broadcast(None if odd else f32, 0),
        "unknown_op": lambda: hvd.allreduce(f32, op=99 if odd else hvd.Sum),
        "group_with_none": lambda: hvd.grouped_allreduce([f32, None if odd else f32]),
    }


class TorchRanks:
    """ringsync.torch's module-level API where stress wants a communicator."""

    def __init__(self):
        import ringsync.torch as hvd
        hvd.init()
        self.hvd, self.cases = hvd, torch_cases
        self.rank, self.size = hvd.rank, hvd.size

    def allreduce(self, x, op):
        import torch
        return self.hvd.allreduce(torch.from_numpy(x), op=op).numpy()

    def broadcast(self, x, root):
        import torch
        return self.hvd.broadcast(torch.from_numpy(x), root).numpy()

    def allgather(self, x):
        import torch
        return self.hvd.allgather(torch.from_numpy(x)).numpy()


CASES = sorted(cases(type("Probe", (), {"size": lambda s: 2, "rank": lambda s: 0})()))


def correct_call(comm, i: int):
    """A collective every rank makes alike, checked against every rank's input."""
    n, r = comm.size(), comm.rank()
    if i % 3 == 0:
        got = comm.allreduce(np.arange(5, dtype=np.float64) * (r + 1) + i, op=rs.Sum)
        want = sum(np.arange(5, dtype=np.float64) * (q + 1) + i for q in range(n))
    elif i % 3 == 1:
        got = comm.broadcast(np.full(3, 10 * r + i, dtype=np.int64), i % n)
        want = np.full(3, 10 * (i % n) + i, dtype=np.int64)
    else:
        got = comm.allgather(np.full(r + 1, r * 100 + i, dtype=np.int32))
        want = np.concatenate([np.full(q + 1, q * 100 + i, dtype=np.int32) for q in range(n)])
    if not np.array_equal(got, want):
        raise AssertionError(f"rank {r}: correct call {i} returned {got}, expected {want}")


def stress(comm, rounds: int, seed: int, max_delay: float = 0.002):
    """`rounds` mismatched calls, each followed by a correct one; per-rank random delays
    before each. Returns one line per mismatched call: its case and what this rank got."""
    make = getattr(comm, "cases", cases)  # (TorchRanks: ringsync.torch's own)
    table = make(getattr(comm, "hvd", comm))
    names = sorted(table)
    order = random.Random(seed)  # the same sequence of cases on every rank
    delays = random.Random(seed * 1000 + comm.rank())
    log = []
    for i in range(rounds):
        case = names[order.randrange(len(names))]
        time.sleep(delays.random() * max_delay)
        try:
            make(getattr(comm, "hvd", comm))[case]()
        except CommunicationError as exc:  # the ring broke: the ranks were not kept matched
            raise AssertionError(f"rank {comm.rank()}: case {case} (round {i}) broke the "
                                 f"communicator: {exc}") from exc
        except UsageError as exc:
            log.append(f"{i} {case}: {type(exc).__name__}: {str(exc)[:200]}")
        else:
            raise AssertionError(f"rank {comm.rank()}: case {case} (round {i}) succeeded")
        time.sleep(delays.random() * max_delay)
        correct_call(comm, i)
    return log
