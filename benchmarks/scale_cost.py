"""What a rank costs as the job grows: N ranks as threads of this one process (the native
core has no globals; each rank has its own communicator, sockets and engine thread).

    python benchmarks/scale_cost.py                 # N = 2 4 8 16 32, over TCP
    python benchmarks/scale_cost.py --sizes 4 8 --iterations 100

Per N it prints:
  setup ms        the slowest rank's Communicator() (listen, rendezvous, connect, engine)
  gather ring/log one 48-byte-per-rank rs_allgatherv on raw communicators (a negotiation
                  round's first exchange with an empty cache), ring (N-1 steps) against
                  the log-round gather (ceil(log2 N) steps); median, microseconds
  round ring/log  one tiny engine allreduce (4 bytes, negotiated from the cache, then one
                  exchange with every peer), RINGSYNC_SMALL_GATHER_BYTES=0 (the ring) against
                  the default (log rounds); median, microseconds
  fds/rank        descriptors each rank adds (/proc/self/fd, after init, / N)
  RSS/rank        resident memory each rank adds (VmRSS after init, / N); thread ranks share
                  the interpreter, so a process per rank adds its ~30 MiB of Python on top
  shm MiB/rank    the shared segment a rank maps where all N ranks share one host
                  (transport_shm.c: a 2 MiB ring per same-host peer + the lane's areas);
                  the host holds N times that
  pending B       engine memory per tensor that some ranks have submitted and others not
                  (engine.h: rs_pending_t + one rs_meta_t and one flag per rank + its name)

On a host with fewer cores than ranks the times measure scheduling as much as the
algorithms: compare the two columns of a row, not rows across machines.
"""
import argparse
import os
import statistics
import sys
import threading
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import ringsync as rs  # noqa: E402
from ringsync._native import ffi, lib  # noqa: E402
from ringsync.config import Config  # noqa: E402
from ringsync.rendezvous import ThreadGroup  # noqa: E402

HOST = b"127.0.0.1"
SECRET = bytes(range(32))

# Struct sizes from native/src (x86-64): rs_meta_t (checked.h): 6 int32 + 2 double + 8
# int64 = 104; rs_pending_t (negotiate.h): 3 pointers, int + pad, int64, double, 2 ints,
# pointer = 72. The ring header (transport_shm.c) is 4 cache lines.
META_BYTES, PENDING_BYTES = 104, 72
RING_BYTES = (1 << 21) + 256
LANE_AREA_BYTES = 2 * ((256 << 10) + 4000 + 1024) + 128  # RS_LANE_AREA_BYTES (transport.h)
LANE_AREAS = 2


def on_threads(fn, size):
    out, errors = [None] * size, []

    def run(r):
        try:
            out[r] = fn(r)
        except BaseException as e:
            errors.append(f"rank {r}: {e!r}")
    threads = [threading.Thread(target=run, args=(r,), daemon=True) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(600)
    if errors or any(t.is_alive() for t in threads):
        raise RuntimeError("; ".join(errors) or "a rank did not finish")
    return out


def fds():
    return len(os.listdir("/proc/self/fd"))


def rss_bytes():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def raw_gather_us(size, iterations, threshold, record=48):
    """Median microseconds of one allgather of `record` bytes per rank, raw comms."""
    comms, ports = [], []
    for r in range(size):
        cptr, port = ffi.new("rs_comm_t **"), ffi.new("int *")
        assert lib.rs_comm_create(r, size, HOST, 60.0, 60.0, cptr, port) == lib.RS_OK
        assert lib.rs_comm_set_transport(cptr[0], lib.RS_TRANSPORT_TCP) == lib.RS_OK
        comms.append(cptr[0])
        ports.append(port[0])
    hosts = [ffi.new("char[]", HOST) for _ in range(size)]
    on_threads(lambda r: lib.rs_comm_connect(comms[r], ffi.new("const char *[]", hosts),
                                             ffi.new("int[]", ports),
                                             ffi.new("const char *[]", hosts), 7, SECRET,
                                             len(SECRET)), size)
    counts = ffi.new("int64_t[]", [record] * size)

    def rank(r):
        lib.rs_comm_set_small_gather(comms[r], threshold)
        mine, out, times = np.full(record, r, np.uint8), np.empty(record * size, np.uint8), []
        for _ in range(iterations):
            t0 = time.perf_counter()
            st = lib.rs_allgatherv(comms[r], ffi.from_buffer(mine), ffi.from_buffer(out),
                                   counts, 1)
            times.append(time.perf_counter() - t0)
            assert st == lib.RS_OK, ffi.string(lib.rs_comm_last_error(comms[r]))
        return statistics.median(times) * 1e6
    try:
        return max(on_threads(rank, size))
    finally:
        for c in comms:
            lib.rs_comm_destroy(c)


def engine_job(size, iterations, small_gather):
    """(setup ms, median us per tiny allreduce, fds per rank, RSS bytes per rank)."""
    group = ThreadGroup(size, timeout=600)
    env = {"RINGSYNC_TRANSPORT": "tcp", "RINGSYNC_SMALL_GATHER_BYTES": str(small_gather)}
    fds_before, rss_before = fds(), rss_bytes()
    barrier = threading.Barrier(size)
    sample = {}

    def rank(r):
        t0 = time.perf_counter()
        comm = rs.Communicator(rendezvous=group.rendezvous(r), config=Config.from_env(env))
        setup = time.perf_counter() - t0
        barrier.wait()
        if r == 0:
            sample["fds"], sample["rss"] = fds(), rss_bytes()
        barrier.wait()
        x, times = np.ones(1, np.float32), []
        for i in range(iterations + 5):
            t0 = time.perf_counter()
            comm.allreduce(x, op=rs.Sum, name="tiny")
            times.append(time.perf_counter() - t0)
        comm.shutdown()
        return setup, statistics.median(times[5:])
    results = on_threads(rank, size)
    return (max(s for s, _ in results) * 1e3, max(t for _, t in results) * 1e6,
            (sample["fds"] - fds_before) / size, (sample["rss"] - rss_before) / size)


def shm_mib(size):
    return ((size - 1) * RING_BYTES + LANE_AREAS * LANE_AREA_BYTES) / 2**20


def pending_bytes(size, name_len=24):
    return PENDING_BYTES + size * (META_BYTES + 1) + name_len + 1


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[2, 4, 8, 16, 32])
    parser.add_argument("--iterations", type=int, default=200)
    args = parser.parse_args()
    print(f"{os.cpu_count()} cores; thread ranks over TCP; times: median of "
          f"{args.iterations}, slowest rank")
    head = ("N", "setup ms", "gather ring us", "gather log us", "round ring us",
            "round log us", "fds/rank", "RSS KiB/rank", "shm MiB/rank", "pending B")
    print("  ".join(f"{h:>14}" for h in head))
    for n in args.sizes:
        ring_gather = raw_gather_us(n, args.iterations, 0)
        log_gather = raw_gather_us(n, args.iterations, 1 << 20)
        _, ring_round, _, _ = engine_job(n, args.iterations, 0)
        setup, log_round, per_fds, per_rss = engine_job(n, args.iterations, 1 << 20)
        row = (n, f"{setup:.0f}", f"{ring_gather:.0f}", f"{log_gather:.0f}",
               f"{ring_round:.0f}", f"{log_round:.0f}", f"{per_fds:.1f}",
               f"{per_rss / 1024:.0f}", f"{shm_mib(n):.1f}", pending_bytes(n))
        print("  ".join(f"{v:>14}" for v in row), flush=True)


if __name__ == "__main__":
    main()
