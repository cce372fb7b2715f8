"""Allreduce across hosts with rate-limited links: ringsync (hierarchical and flat ring)
against Open MPI's own Allreduce and torch gloo over the same links, in one job.

    python benchmarks/hosts_allreduce.py [--hosts 2] [--ranks-per-host 2] [--rate 2gbit]
                                         [--sizes 1M,4M,16M,64M] [--iterations 5]

Needs root (the hosts are network namespaces: ringsync.testing.VirtualHosts; each host's
egress is limited to --rate with tc tbf). The link bound is what every host must send,
2(H-1)/H * S bytes for H hosts and S bytes, at the link rate; efficiency = bound / time.
Ratios are the peer's time / ringsync's (above 1: ringsync is faster). A benchmark, not a
test: nothing asserts on time.
"""
import argparse
import json
import os
import sys
import tempfile
import time

RATES = {"k": 1e3, "m": 1e6, "g": 1e9}
GOAL_EFFICIENCY = 0.95  # of the link bound, from 16 MiB on (2 x 2 hosts)


def rate_bytes_per_second(rate: str) -> float:
    number, unit = rate.lower().rstrip("bit"), rate.lower().rstrip("bit")[-1]
    return float(number[:-1]) * RATES[unit] / 8 if unit in RATES else float(number) / 8


def _timed(call, iterations, comm, MPI):
    call()  # warm up (connections, page faults)
    comm.Barrier()
    start = time.perf_counter()
    for _ in range(iterations):
        call()
    return comm.allreduce((time.perf_counter() - start) / iterations, op=MPI.MAX)


def _ringsync_times(sizes, iterations, comm, MPI, hierarchical):
    import numpy as np

    import ringsync as rs
    os.environ["RINGSYNC_HIERARCHICAL_ALLREDUCE"] = hierarchical
    rs.init()
    times = []
    for size in sizes:
        buf = np.full(size // 4, rs.rank() + 1.0, dtype=np.float32)
        times.append(_timed(lambda: rs.allreduce_(buf, op=rs.Sum, name="bench"), iterations,
                            comm, MPI))
        check = rs.allreduce(np.full(size // 4, rs.rank() + 1.0, np.float32), op=rs.Sum)
        assert np.all(check == sum(range(1, rs.size() + 1))), check[:4]  # and still right
    rs.shutdown()
    return times


def _gloo(comm):
    try:
        import torch
        import torch.distributed as dist
    except ImportError:
        return None
    import socket
    address = socket.gethostbyname(socket.gethostname()) if comm.rank == 0 else None
    address = comm.bcast(os.environ.get("RS_BENCH_ADDRESS0") or address, root=0)
    port = comm.bcast(29517 + os.getpid() % 1000 if comm.rank == 0 else None, root=0)
    os.environ["GLOO_SOCKET_IFNAME"] = "eth0"
    dist.init_process_group("gloo", init_method=f"tcp://{address}:{port}", rank=comm.rank,
                            world_size=comm.size)
    return lambda buf: dist.all_reduce(torch.from_numpy(buf))


def worker(out, sizes, iterations, address0):
    import numpy as np
    from mpi4py import MPI
    comm = MPI.COMM_WORLD
    os.environ["RS_BENCH_ADDRESS0"] = address0
    rows = {"size": sizes}
    for mode in ("on", "off"):
        rows[f"ringsync_{mode}"] = _ringsync_times(sizes, iterations, comm, MPI, mode)
    mpi = []
    for size in sizes:
        buf = np.full(size // 4, comm.rank + 1.0, dtype=np.float32)
        mpi.append(_timed(lambda: comm.Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM), iterations,
                          comm, MPI))
    rows["mpi"] = mpi
    gloo = _gloo(comm)
    rows["gloo"] = [None] * len(sizes)
    if gloo:
        for i, size in enumerate(sizes):
            buf = np.full(size // 4, comm.rank + 1.0, dtype=np.float32)
            rows["gloo"][i] = _timed(lambda: gloo(buf), iterations, comm, MPI)
    if comm.rank == 0:
        with open(out, "w") as f:
            json.dump(rows, f)
    if gloo:
        import torch.distributed as dist
        dist.destroy_process_group()


def report(rows, hosts, rate):
    bound_factor = 2 * (hosts - 1) / hosts / rate_bytes_per_second(rate)
    print(f"allreduce across {hosts} hosts, each host's egress limited to {rate}; times in "
          "ms; eff = link bound / time; ratio = peer time / ringsync (hierarchical) time")
    print(f"{'size':>8} {'bound':>8} {'hier':>8} {'eff':>5} {'flat':>8} {'eff':>5} "
          f"{'mpi':>8} {'eff':>5} {'gloo':>8} {'eff':>5} {'flat/h':>6} {'mpi/h':>6} {'gloo/h':>6}")
    for i, size in enumerate(rows["size"]):
        bound = size * bound_factor
        cells = [f"{size >> 20:>6}Mi", f"{bound * 1e3:8.1f}"]
        for key in ("ringsync_on", "ringsync_off", "mpi", "gloo"):
            t = rows[key][i]
            cells += [f"{t * 1e3:8.1f}", f"{bound / t:5.2f}"] if t else ["       -", "    -"]
        hier = rows["ringsync_on"][i]
        for key in ("ringsync_off", "mpi", "gloo"):
            t = rows[key][i]
            cells.append(f"{t / hier:6.2f}" if t else "     -")
        print(" ".join(cells))
    print("\nGoals (this run):")
    for i, size in enumerate(rows["size"]):
        if size >= 16 << 20:
            eff = size * bound_factor / rows["ringsync_on"][i]
            print(f"  [{'met' if eff >= GOAL_EFFICIENCY else 'NOT met'}] {size >> 20} MiB: "
                  f"hierarchical allreduce >= {GOAL_EFFICIENCY} of the link bound: {eff:.3f}")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hosts", type=int, default=2)
    parser.add_argument("--ranks-per-host", type=int, default=2)
    parser.add_argument("--rate", default="2gbit")
    parser.add_argument("--sizes", default="1M,4M,16M,64M")
    parser.add_argument("--iterations", type=int, default=5)
    parser.add_argument("--worker", nargs=4, metavar=("OUT", "SIZES", "ITERATIONS", "ADDR0"))
    args = parser.parse_args(argv)
    if args.worker:
        out, sizes, iterations, address0 = args.worker
        return worker(out, [int(s) for s in sizes.split(",")], int(iterations), address0)
    from ringsync.bench import parse_size
    from ringsync.testing import VirtualHosts, run_mpi, virtual_hosts_unavailable
    reason = virtual_hosts_unavailable()
    if reason:
        sys.exit(f"hosts_allreduce: {reason}")
    sizes = ",".join(str(parse_size(s)) for s in args.sizes.split(","))
    with VirtualHosts(args.hosts, rate=args.rate) as hosts, \
            tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rows.json")
        result = run_mpi(os.path.abspath(__file__), np=args.hosts * args.ranks_per_host,
                         hosts=hosts, slots=args.ranks_per_host, timeout=1200,
                         env={"OMP_NUM_THREADS": "1", "RINGSYNC_TIMEOUT_SECONDS": "120"},
                         args=("--worker", out, sizes, args.iterations,
                               hosts.address[hosts.names[0]]))
        if not result.ok:
            sys.exit(result.report())
        with open(out) as f:
            report(json.load(f), args.hosts, args.rate)


if __name__ == "__main__":
    main()
