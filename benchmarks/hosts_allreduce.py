"""Allreduce across hosts with rate-limited links: ringsync (hierarchical and flat ring)
against Open MPI's own Allreduce and torch gloo over the same links, in one job; and
ringsync's allgather and reducescatter (hierarchical and flat ring; gloo's allgather).

    python benchmarks/hosts_allreduce.py [--hosts 2] [--ranks-per-host 2] [--rate 2gbit]
                                         [--sizes 1M,4M,16M,64M] [--iterations 5]

Needs root (the hosts are network namespaces: ringsync.testing.VirtualHosts; each host's
egress is limited to --rate with tc tbf). The link bound is what every host must send,
2(H-1)/H * S bytes for H hosts and S bytes (allgather and reducescatter: (H-1)/H * S), at
the link rate; efficiency = bound / time.
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
    """{collective: [seconds per call, by size]}: allreduce of S bytes, allgather of S
    bytes gathered (S/N from each rank), reducescatter of S bytes in (S/N out)."""
    import numpy as np

    import ringsync as rs
    os.environ["RINGSYNC_HIERARCHICAL_ALLREDUCE"] = hierarchical
    rs.init()
    n, me = rs.size(), rs.rank()
    times = {"allreduce": [], "allgather": [], "reducescatter": []}
    for size in sizes:
        buf = np.full(size // 4, me + 1.0, dtype=np.float32)
        times["allreduce"].append(_timed(lambda: rs.allreduce_(buf, op=rs.Sum, name="bench"),
                                         iterations, comm, MPI))
        check = rs.allreduce(np.full(size // 4, me + 1.0, np.float32), op=rs.Sum)
        assert np.all(check == sum(range(1, n + 1))), check[:4]  # and still right
        block = np.full(size // 4 // n, me + 1.0, dtype=np.float32)
        times["allgather"].append(_timed(lambda: rs.allgather(block, name="bench_ag"),
                                         iterations, comm, MPI))
        gathered = rs.allgather(block)
        assert np.array_equal(gathered, np.repeat(np.arange(1.0, n + 1), block.size)), gathered
        times["reducescatter"].append(_timed(
            lambda: rs.reducescatter(buf, op=rs.Sum, name="bench_rs"), iterations, comm, MPI))
        mine = rs.reducescatter(np.full(size // 4, me + 1.0, np.float32), op=rs.Sum)
        assert np.all(mine == sum(range(1, n + 1))), mine[:4]
    rs.shutdown()
    return times


def _gloo(comm):
    try:
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
    return dist


def _gloo_times(dist, sizes, iterations, comm, MPI):
    """gloo's allreduce and allgather (into a preallocated tensor) by size; gloo has no
    reducescatter."""
    import torch
    times = {"allreduce": [], "allgather": []}
    for size in sizes:
        buf = torch.full((size // 4,), comm.rank + 1.0)
        times["allreduce"].append(_timed(lambda: dist.all_reduce(buf), iterations, comm, MPI))
        block = torch.full((size // 4 // comm.size,), comm.rank + 1.0)
        out = torch.empty(block.numel() * comm.size)
        times["allgather"].append(_timed(lambda: dist.all_gather_into_tensor(out, block),
                                         iterations, comm, MPI))
    return times


def worker(out, sizes, iterations, address0):
    import numpy as np
    from mpi4py import MPI
    comm = MPI.COMM_WORLD
    os.environ["RS_BENCH_ADDRESS0"] = address0
    rows = {"size": sizes}
    for mode in ("on", "off"):
        times = _ringsync_times(sizes, iterations, comm, MPI, mode)
        rows[f"ringsync_{mode}"] = times.pop("allreduce")
        for collective, by_size in times.items():
            rows[f"{collective}_ringsync_{mode}"] = by_size
    mpi = []
    for size in sizes:
        buf = np.full(size // 4, comm.rank + 1.0, dtype=np.float32)
        mpi.append(_timed(lambda: comm.Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM), iterations,
                          comm, MPI))
    rows["mpi"] = mpi
    dist = _gloo(comm)
    rows["gloo"] = rows["allgather_gloo"] = [None] * len(sizes)
    if dist:
        times = _gloo_times(dist, sizes, iterations, comm, MPI)
        rows["gloo"], rows["allgather_gloo"] = times["allreduce"], times["allgather"]
    if comm.rank == 0:
        with open(out, "w") as f:
            json.dump(rows, f)
    if dist:
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
    report_gathers(rows, hosts, rate)
    print("\nGoals (this run):")
    for i, size in enumerate(rows["size"]):
        if size < 16 << 20:
            continue
        effs = [("allreduce", size * bound_factor / rows["ringsync_on"][i])]
        effs += [(c, size * bound_factor / 2 / rows[f"{c}_ringsync_on"][i])
                 for c in ("allgather", "reducescatter")]
        for collective, eff in effs:
            print(f"  [{'met' if eff >= GOAL_EFFICIENCY else 'NOT met'}] {size >> 20} MiB: "
                  f"hierarchical {collective} >= {GOAL_EFFICIENCY} of the link bound: "
                  f"{eff:.3f}")


def report_gathers(rows, hosts, rate):
    """Allgather (S bytes gathered) and reducescatter (S bytes in): the link bound is what
    every host must send, (H-1)/H * S."""
    bound_factor = (hosts - 1) / hosts / rate_bytes_per_second(rate)
    print(f"\nallgather and reducescatter across {hosts} hosts; S = bytes gathered (allgather) "
          "or reduced (reducescatter); times in ms; eff = link bound / time")
    print(f"{'size':>8} {'bound':>8} {'ag hier':>8} {'eff':>5} {'ag flat':>8} {'eff':>5} "
          f"{'ag gloo':>8} {'eff':>5} {'rs hier':>8} {'eff':>5} {'rs flat':>8} {'eff':>5} "
          f"{'flat/h':>6} {'gloo/h':>6} {'flat/h':>6}")
    keys = ("allgather_ringsync_on", "allgather_ringsync_off", "allgather_gloo",
            "reducescatter_ringsync_on", "reducescatter_ringsync_off")
    for i, size in enumerate(rows["size"]):
        bound = size * bound_factor
        cells = [f"{size >> 20:>6}Mi", f"{bound * 1e3:8.1f}"]
        for key in keys:
            t = rows[key][i]
            cells += [f"{t * 1e3:8.1f}", f"{bound / t:5.2f}"] if t else ["       -", "    -"]
        for peer, hier in ((keys[1], keys[0]), (keys[2], keys[0]), (keys[4], keys[3])):
            t = rows[peer][i]
            cells.append(f"{t / rows[hier][i]:6.2f}" if t else "     -")
        print(" ".join(cells))


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
