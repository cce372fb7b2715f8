"""What memory allows: the time of one plain copy of the buffer on every rank at once,
against ringsync's, Open MPI's and gloo's allreduce of it, all in one job.

    mpirun -np 2 python benchmarks/memory_bound.py
    mpirun -np 4 --oversubscribe python benchmarks/memory_bound.py --sizes 16M 64M

Any allreduce must at least read each rank's input and write each rank's output, so it
can be no faster than every rank copying its buffer once at the same time (and a real one
also moves every rank's data to its peers). Printed per size: the concurrent copy's time,
each allreduce's time, and the speed-up over Open MPI and over gloo that a perfect
allreduce taking exactly one copy would have: a target above that is out of reach.
"""
import argparse
import time

import numpy as np
from mpi4py import MPI

import ringsync as rs
from ringsync.bench import _gloo_allreduce, human, parse_size


def seconds_per_call(call, comm, repeat):
    call()
    comm.Barrier()
    start = time.perf_counter()
    for _ in range(repeat):
        call()
    elapsed = (time.perf_counter() - start) / repeat
    return comm.allreduce(elapsed, op=MPI.MAX)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", nargs="+", default=["1M", "16M", "64M"])
    parser.add_argument("--repeat", type=int, default=10)
    args = parser.parse_args()
    comm = MPI.COMM_WORLD
    rs.init()
    gloo = _gloo_allreduce(comm)
    if comm.rank == 0:
        print(f"{comm.size} ranks; times in ms; 'best vs X' = X's time / one copy's time")
        print(f"{'size':>8} | {'copy':>7} {'ringsync':>9} {'MPI':>7} {'gloo':>7} | "
              f"{'best vs MPI':>11} {'best vs gloo':>12}")
    for text in args.sizes:
        size = parse_size(text)
        src = np.full(size // 4, comm.rank + 1.0, dtype=np.float32)
        dst = np.empty_like(src)
        copy = seconds_per_call(lambda: np.copyto(dst, src), comm, args.repeat)
        ring = seconds_per_call(lambda: rs.allreduce_(dst, op=rs.Sum), comm, args.repeat)
        mpi = seconds_per_call(lambda: comm.Allreduce(MPI.IN_PLACE, dst, op=MPI.SUM), comm,
                               args.repeat)
        glo = seconds_per_call(lambda: gloo(dst), comm, args.repeat) if gloo else float("nan")
        if comm.rank == 0:
            print(f"{human(size):>8} | {copy * 1e3:7.2f} {ring * 1e3:9.2f} {mpi * 1e3:7.2f} "
                  f"{glo * 1e3:7.2f} | {mpi / copy:11.2f} {glo / copy:12.2f}", flush=True)
    rs.shutdown()
    if gloo:
        import torch.distributed as dist
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
