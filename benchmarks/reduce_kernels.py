"""How close the element-wise sum kernels come to memory speed, in one process.

    python benchmarks/reduce_kernels.py [--size 16M] [--repeat 20]

For float32, float16 and bfloat16: the sum kernel (`rs_reduce_local`, inout += in) and a
plain copy (`np.copyto`) of a buffer of the same size, each timed best of --repeat. Both
are printed as GB/s of memory traffic: the kernel reads inout and in and writes inout
(3 x size), the copy reads one buffer and writes another (2 x size). The ratio is the
kernel's GB/s over the copy's: near 1, the kernel runs at memory speed. This is a
benchmark, not a test: nothing here asserts on time.
"""
import argparse
import time

import numpy as np

from ringsync._native import ffi, lib
from ringsync.bench import human, parse_size

DTYPES = {"float32": (np.float32, lib.RS_FLOAT32), "float16": (np.float16, lib.RS_FLOAT16),
          "bfloat16": (np.uint16, lib.RS_BFLOAT16)}


def inputs(name, count, rng):
    """Two buffers of ordinary values (no NaNs, no infinities); bfloat16 as its raw bits."""
    values = rng.uniform(-4.0, 4.0, size=(2, count)).astype(np.float32)
    if name == "bfloat16":  # the top half of a float32 is a (truncated) bfloat16
        return [v.view(np.uint16)[1::2].copy() for v in values]
    return [v.astype(DTYPES[name][0]) for v in values]


def best_seconds(call, repeat):
    call()  # page faults, caches
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        call()
        best = min(best, time.perf_counter() - start)
    return best


def measure(name, size, repeat, rng):
    inout, other = inputs(name, size // 2 if name != "float32" else size // 4, rng)
    code = DTYPES[name][1]
    a, b = ffi.cast("void *", inout.ctypes.data), ffi.cast("void *", other.ctypes.data)

    def reduce():
        # Summing the same buffer again and again keeps the values finite enough: the
        # kernel's speed does not depend on them (no NaN or subnormal slow paths in F16C).
        assert lib.rs_reduce_local(a, b, inout.size, code, lib.RS_OP_SUM) == lib.RS_OK

    target = np.empty_like(inout)
    kernel = best_seconds(reduce, repeat)
    copy = best_seconds(lambda: np.copyto(target, other), repeat)
    return 3 * size / kernel / 1e9, 2 * size / copy / 1e9


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="16M", help="bytes per buffer (default 16M)")
    parser.add_argument("--repeat", type=int, default=20)
    args = parser.parse_args()
    size = parse_size(args.size)
    rng = np.random.default_rng(0)
    print(f"sum kernel vs np.copyto, {human(size)} buffers, best of {args.repeat}; "
          "GB/s of memory traffic (kernel 3 x size, copy 2 x size)")
    print(f"{'dtype':>9} | {'kernel GB/s':>11} {'copy GB/s':>9} | {'kernel/copy':>11}")
    for name in DTYPES:
        kernel, copy = measure(name, size, args.repeat, rng)
        print(f"{name:>9} | {kernel:11.2f} {copy:9.2f} | {kernel / copy:11.2f}", flush=True)


if __name__ == "__main__":
    main()
