"""Allreduce benchmark: ringsync against mpi4py's Allreduce (Open MPI) and, where torch is
installed, torch.distributed on gloo, measured in the same run.

    python -m ringsync.bench [--np 2 4] [--min-size 4K] [--max-size 64M] [--seconds 0.3]
                             [--plot busbw.png] [--deterministic]

The driver starts one mpirun job per rank count; in each job every size is timed for
ringsync and MPI in turn on the same buffer, then (once gloo's process group exists, as it
slows the others while it lives) for gloo, and the table shows time per call (the
median of three timed runs), bus bandwidth (size * 2(N-1)/N / time) and the ratios
(their time / ringsync's time: above 1 means ringsync is faster), and the memory bound: every rank copying the buffer once at
the same time ("copy", what any allreduce must at least do), with ringsync's time over it.
The end of the output checks the figures against the project's speed goals (met or not).
--plot draws bus bandwidth against size (needs matplotlib). --deterministic measures,
instead, RINGSYNC_DETERMINISTIC=1 against the default, each size timed on both in turn.
This is a benchmark, not a test: nothing here asserts on time.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

from . import basics, collectives as rs
from .ops import ReduceOp

UNITS = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def parse_size(text: str) -> int:
    text = text.strip().upper().rstrip("B").rstrip("I")
    if text and text[-1] in UNITS:
        return int(float(text[:-1]) * UNITS[text[-1]])
    return int(text)


def human(n: int) -> str:
    for unit in ("G", "M", "K"):
        if n >= UNITS[unit] and n % UNITS[unit] == 0:
            return f"{n // UNITS[unit]} {unit}iB"
    return f"{n} B"


def sizes_between(low: int, high: int):
    size = low
    while size <= high:
        yield size
        size *= 4


TRIALS = 3  # each figure is the median of this many timed runs (a shared host is noisy)


def _time_calls(call, seconds: float, comm) -> float:
    """Seconds per call: the median over TRIALS runs of the slowest rank's average; the
    iteration count is agreed by all ranks (from rank 0's estimate) so that every rank
    runs the same number."""
    call()  # warm up (connections, page faults)
    start = time.perf_counter()
    call()
    estimate = time.perf_counter() - start
    iterations = comm.bcast(max(3, min(10000, int(seconds / TRIALS / max(estimate, 1e-7)))),
                            root=0)
    trials = []
    for _ in range(TRIALS):
        comm.Barrier()
        start = time.perf_counter()
        for _ in range(iterations):
            call()
        elapsed = (time.perf_counter() - start) / iterations
        trials.append(comm.allreduce(elapsed, op=_mpi().MAX))
    return sorted(trials)[TRIALS // 2]


def _mpi():
    from mpi4py import MPI
    return MPI


def worker(args):
    import numpy as np

    MPI = _mpi()
    comm = MPI.COMM_WORLD
    if args.deterministic:
        rows = deterministic_figures(comm, args)
        if comm.rank == 0:
            with open(args.worker, "w") as f:
                json.dump({"np": comm.size, "deterministic": rows}, f)
        return
    basics.init()
    rows = []
    # (the ops looked up once, for both libraries: an IntEnum member's lookup costs 0.1 us
    # on Python 3.11, a tenth of a 4-byte allreduce, and is not the library's time)
    rs_sum, mpi_sum, in_place = ReduceOp.SUM, MPI.SUM, MPI.IN_PLACE
    for size in sizes_between(args.min_size, args.max_size):
        buf = np.full(size // 4, basics.rank() + 1.0, dtype=np.float32)
        rs_time = _time_calls(lambda: rs.allreduce_(buf, op=rs_sum), args.seconds, comm)
        mpi_time = _time_calls(lambda: comm.Allreduce(in_place, buf, op=mpi_sum),
                               args.seconds, comm)
        copy = np.empty_like(buf)
        copy_time = _time_calls(lambda: np.copyto(copy, buf), args.seconds, comm)
        rows.append({"size": size, "ringsync": rs_time, "mpi": mpi_time, "gloo": None,
                     "copy": copy_time})
    engine = engine_figures(rs, comm, args.seconds)
    engine.update(waiting_cpu(rs, comm))
    engine.update(insight_figures(comm, args.seconds))
    # gloo last: its process group's threads stay for the rest of the job, and measurably
    # slow the others' small messages (about 4 us per call) while they live.
    gloo = _gloo_allreduce(comm)
    for row in rows if gloo else []:
        buf = np.full(row["size"] // 4, basics.rank() + 1.0, dtype=np.float32)
        row["gloo"] = _time_calls(lambda: gloo(buf), args.seconds, comm)
    if basics.rank() == 0:
        with open(args.worker, "w") as f:
            json.dump({"np": basics.size(), "rows": rows, "engine": engine}, f)
    basics.shutdown()
    if gloo:
        import torch.distributed as dist
        dist.destroy_process_group()


def _gloo_allreduce(comm):
    """torch.distributed's allreduce on gloo over loopback, on a numpy buffer (shared with
    a tensor, no copy); None without torch. Rank 0 picks the rendezvous port."""
    try:
        import torch
        import torch.distributed as dist
    except ImportError:
        return None
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = comm.bcast(s.getsockname()[1] if comm.rank == 0 else None, root=0)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=comm.rank,
                            world_size=comm.size)
    return lambda buf: dist.all_reduce(torch.from_numpy(buf))


# What RINGSYNC_DETERMINISTIC=1 is measured on: (label, Config overrides, collective).
# On one host large blocking allreduces are staged through shared memory in either mode;
# without the lane and staging, allreduces take the engine's algorithms, as across hosts.
DETERMINISTIC_CASES = [
    ("allreduce (one host's paths)", {}, "allreduce"),
    ("allreduce (engine: as across hosts)", {"lane_bytes": 0, "staged_bytes": 0}, "allreduce"),
    ("reducescatter", {}, "reducescatter"),
]


def deterministic_figures(comm, args) -> list:
    """Seconds per call (float32 sum) of each case and size, by the default's communicator
    and a deterministic one over the same ranks, timed in turn on the same buffer."""
    import dataclasses

    import numpy as np

    from ._core import Communicator
    from .config import Config

    rows = []
    for label, overrides, kind in DETERMINISTIC_CASES:
        config = dataclasses.replace(Config.from_env(), **overrides)
        rings = [Communicator(comm, config=dataclasses.replace(config, deterministic=mode))
                 for mode in (0, 1)]
        for size in sizes_between(args.min_size, args.max_size):
            buf = np.full(size // 4, comm.rank + 1.0, dtype=np.float32)
            times = [_time_calls(lambda: getattr(ring, kind)(buf, op=ReduceOp.SUM,
                                                            name="bench.det"), args.seconds, comm)
                     for ring in rings]
            rows.append({"case": label, "size": size, "default": times[0],
                         "deterministic": times[1]})
        for ring in rings:
            ring.shutdown()
    return rows


def print_deterministic(result: dict) -> None:
    print(f"\n{result['np']} ranks: RINGSYNC_DETERMINISTIC=1 against the default, float32 "
          "sum (ratio: deterministic time / default time)")
    print(f"{'case':>36} | {'size':>9} | {'default us':>11} {'determ. us':>11} {'ratio':>6}")
    for row in result["deterministic"]:
        print(f"{row['case']:>36} | {human(row['size']):>9} | {row['default'] * 1e6:11.1f} "
              f"{row['deterministic'] * 1e6:11.1f} {row['deterministic'] / row['default']:6.2f}")


FUSED_TENSORS = 200
FUSED_TENSOR_BYTES = 4 << 10


def engine_figures(rs, comm, seconds):
    """What the engine adds: many small asynchronous tensors, submitted one call each or in
    one batch (a grouped call: one native submission), against one allreduce of their
    concatenation; and the latency floor of a lone 4-byte synchronous allreduce."""
    import numpy as np

    MPI = _mpi()
    rs_sum, mpi_sum, in_place = ReduceOp.SUM, MPI.SUM, MPI.IN_PLACE
    smalls = [np.full(FUSED_TENSOR_BYTES // 4, 1.0, np.float32) for _ in range(FUSED_TENSORS)]
    names = [f"bench.small.{i}" for i in range(FUSED_TENSORS)]

    def each():
        handles = [rs.allreduce_async_(t, op=rs_sum, name=n) for t, n in zip(smalls, names)]
        for h in handles:
            rs.synchronize(h)

    def batched():
        rs.synchronize(rs.grouped_allreduce_async_(smalls, op=rs_sum, name="bench.batch"))

    big = np.ones(FUSED_TENSORS * FUSED_TENSOR_BYTES // 4, np.float32)
    tiny = np.ones(1, np.float32)
    return {
        "fused": _time_calls(each, seconds, comm),
        "batched": _time_calls(batched, seconds, comm),
        "concatenated": _time_calls(lambda: rs.allreduce_(big, op=rs_sum, name="bench.big"),
                                    seconds, comm),
        "latency": _time_calls(lambda: rs.allreduce_(tiny, op=rs_sum, name="bench.tiny"),
                               seconds, comm),
        "mpi_latency": _time_calls(lambda: comm.Allreduce(in_place, tiny, op=mpi_sum),
                                   seconds, comm),
    }


STEP_TENSORS = 20  # a small model's gradients, one training step's allreduces
INSIGHT_ROUNDS = 4


def insight_figures(comm, seconds) -> dict:
    """What keeping the flight recorder and the straggler events costs: a step of
    STEP_TENSORS 4 KiB asynchronous allreduces and a 4-byte blocking allreduce on a ring
    that keeps them (the default) and on one that keeps none
    (RINGSYNC_FLIGHT_RECORDER_SIZE=0), both alive, timed in alternation INSIGHT_ROUNDS
    times (the medians: the two differ by less than a shared host's drift)."""
    import dataclasses

    import numpy as np

    from ._core import Communicator
    from .config import Config

    grads = [np.full(1024, 1.0, np.float32) for _ in range(STEP_TENSORS)]
    names = [f"bench.step.{i}" for i in range(STEP_TENSORS)]
    tiny = np.ones(1, np.float32)
    config = Config.from_env()
    rings = {label: Communicator(comm, config=dataclasses.replace(
        config, flight_recorder_size=size)) for label, size in
        (("with", config.flight_recorder_size or 512), ("without", 0))}

    def step(ring):
        handles = [ring.allreduce_async_(g, op=ReduceOp.SUM, name=n) for g, n in zip(grads, names)]
        for h in handles:
            ring.synchronize(h)
    times = {}
    for round_ in range(INSIGHT_ROUNDS):
        for label in (("with", "without") if round_ % 2 else ("without", "with")):
            ring = rings[label]
            times.setdefault(f"step_{label}_records", []).append(
                _time_calls(lambda: step(ring), seconds / 2, comm))
            times.setdefault(f"tiny_{label}_records", []).append(_time_calls(
                lambda: ring.allreduce_(tiny, op=ReduceOp.SUM, name="bench.tiny"),
                seconds / 2, comm))
    for ring in rings.values():
        ring.shutdown()
    return {key: float(np.median(values)) for key, values in times.items()}


WAIT_SECONDS = 2.0


def waiting_cpu(rs, comm) -> dict:
    """CPU used by rank 0 (all its threads) while it waits WAIT_SECONDS in an allreduce
    for the last rank, as a fraction of one core: ringsync's and MPI's."""
    import numpy as np

    MPI = _mpi()
    buf = np.ones(1024, np.float32)
    figures = {}
    for library, call in (("ringsync",
                           lambda: rs.allreduce_(buf, op=ReduceOp.SUM, name="bench.wait")),
                          ("mpi", lambda: comm.Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM))):
        comm.Barrier()
        if basics.rank() == basics.size() - 1:
            time.sleep(WAIT_SECONDS)
        cpu, wall = time.process_time(), time.perf_counter()
        call()
        figures[f"{library}_wait_cpu"] = ((time.process_time() - cpu)
                                          / (time.perf_counter() - wall))
    return figures


def run_job(np_: int, args) -> dict:
    from ringsync.launch import mpirun as launcher

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        worker_args = [sys.executable, "-m", "ringsync.bench", "--worker", out,
                       "--min-size", str(args.min_size), "--max-size", str(args.max_size),
                       "--seconds", str(args.seconds)] + (
                           ["--deterministic"] if args.deterministic else [])
        # Ranks bound to cores where each can have its own (as MPI benchmarks run): left
        # to float, two ranks' spinning waits sometimes share a core, and both libraries'
        # large-message times then swing by 2-3x from run to run.
        binding = "--bind-to core" if np_ <= (os.cpu_count() or 1) else None
        options = launcher.RunOptions(np=np_, program=worker_args, binding_args=binding)
        command = launcher.build_mpirun_command(options)
        subprocess.run(command, check=True)
        with open(out) as f:
            return json.load(f)


def bus_factor(n: int) -> float:
    return 2 * (n - 1) / n if n > 1 else 1.0


def print_table(result: dict) -> None:
    n = result["np"]
    factor = bus_factor(n)
    has_gloo = result["rows"][0].get("gloo") is not None
    print(f"\n{n} ranks: allreduce of float32, sum, in place")
    header = (f"{'size':>9} | {'ringsync us':>11} {'GB/s':>6} | {'MPI us':>9} {'GB/s':>6} | "
              + (f"{'gloo us':>9} {'GB/s':>6} | " if has_gloo else "")
              + f"{'MPI/ringsync':>12}" + (f" {'gloo/ringsync':>13}" if has_gloo else "")
              + f" | {'copy us':>8} {'ringsync/copy':>13}")
    print(header)
    for row in result["rows"]:
        rs_t, mpi_t, size = row["ringsync"], row["mpi"], row["size"]
        line = (f"{human(size):>9} | {rs_t * 1e6:11.1f} {size * factor / rs_t / 1e9:6.2f} | "
                f"{mpi_t * 1e6:9.1f} {size * factor / mpi_t / 1e9:6.2f} | ")
        if has_gloo:
            g = row["gloo"]
            line += f"{g * 1e6:9.1f} {size * factor / g / 1e9:6.2f} | "
        line += f"{mpi_t / rs_t:12.2f}" + (f" {row['gloo'] / rs_t:13.2f}" if has_gloo else "")
        line += f" | {row['copy'] * 1e6:8.1f} {rs_t / row['copy']:13.1f}"
        print(line)


def plot(results, path: str) -> None:
    """Bus bandwidth against size, one panel per rank count, one line per library."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise SystemExit("--plot needs matplotlib: pip install matplotlib") from None
    fig, axes = plt.subplots(1, len(results), figsize=(5.5 * len(results), 4), squeeze=False)
    for ax, result in zip(axes[0], results):
        factor = bus_factor(result["np"])
        sizes = [row["size"] for row in result["rows"]]
        for key, label in (("ringsync", "ringsync"), ("mpi", "Open MPI (mpi4py)"),
                           ("gloo", "torch gloo")):
            if result["rows"][0].get(key) is None:
                continue
            ax.plot(sizes, [row["size"] * factor / row[key] / 1e9 for row in result["rows"]],
                    marker="o", label=label)
        ax.set_xscale("log", base=2)
        ax.set_xticks(sizes, [human(x) for x in sizes], rotation=45)
        ax.set_xlabel("message size")
        ax.set_ylabel("bus bandwidth (GB/s)")
        ax.set_title(f"allreduce, {result['np']} ranks on one host")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    print(f"\nplot written to {path}")


def print_engine(result: dict) -> None:
    e = result["engine"]
    print(f"  {FUSED_TENSORS} x {FUSED_TENSOR_BYTES // 1024} KiB async + synchronize, one call "
          f"each: {e['fused'] * 1e6:.1f} us; in one batch (grouped_allreduce_async_): "
          f"{e['batched'] * 1e6:.1f} us; one allreduce of their concatenation: "
          f"{e['concatenated'] * 1e6:.1f} us; ratios {e['fused'] / e['concatenated']:.2f} "
          f"and {e['batched'] / e['concatenated']:.2f}")
    print(f"  4-byte synchronous allreduce: ringsync {e['latency'] * 1e6:.1f} us, MPI "
          f"{e['mpi_latency'] * 1e6:.1f} us; ringsync/MPI {e['latency'] / e['mpi_latency']:.2f}")
    print(f"  flight recorder and straggler events: a step of {STEP_TENSORS} x 4 KiB async "
          f"allreduces {e['step_with_records'] * 1e6:.1f} us with, "
          f"{e['step_without_records'] * 1e6:.1f} us without (ratio "
          f"{e['step_with_records'] / e['step_without_records']:.2f}); a 4-byte blocking "
          f"allreduce {e['tiny_with_records'] * 1e6:.1f} us with, "
          f"{e['tiny_without_records'] * 1e6:.1f} us without (ratio "
          f"{e['tiny_with_records'] / e['tiny_without_records']:.2f})")
    print(f"  rank 0 waiting {WAIT_SECONDS:g} s in an allreduce for a late rank uses "
          f"{e['ringsync_wait_cpu'] * 100:.1f}% of a core (MPI: {e['mpi_wait_cpu'] * 100:.1f}%)")


def goal_lines(results) -> list:
    """The issue's goals, each with the figure that decides it (met or not)."""
    lines = []
    for result in results:
        n, rows, e = result["np"], {r["size"]: r for r in result["rows"]}, result["engine"]
        ratio = {size: r["mpi"] / r["ringsync"] for size, r in rows.items()}
        if n == 2:
            for size in (4 << 10,):
                if size in rows:
                    lines.append(_goal(f"2 ranks, {human(size)}: ringsync time <= 1.5x MPI's",
                                       rows[size]["ringsync"] / rows[size]["mpi"], "<=", 1.5))
            lines.append(_goal("2 ranks, 4 B: ringsync time <= 1.5x MPI's",
                               e["latency"] / e["mpi_latency"], "<=", 1.5))
            lines.append(_goal(f"2 ranks, {FUSED_TENSORS} x 4 KiB async in one batch <= 3x one "
                               "fused call", e["batched"] / e["concatenated"], "<=", 3.0))
            lines.append(_goal(f"2 ranks, {FUSED_TENSORS} x 4 KiB async, one call each <= 3x "
                               "one fused call", e["fused"] / e["concatenated"], "<=", 3.0))
            if 16 << 20 in rows:
                lines.append(_goal("2 ranks, 16 MiB: MPI/ringsync >= 1.5", ratio[16 << 20],
                                   ">=", 1.5))
        large = [s for s in rows if s >= 256 << 10]
        if large:
            worst = min(large, key=lambda s: ratio[s])
            lines.append(_goal(f"{n} ranks, every size from 256 KiB: MPI/ringsync >= 1.0 "
                               f"(lowest at {human(worst)})", ratio[worst], ">=", 1.0))
        lines.append(_goal(f"{n} ranks, a step with the flight recorder and straggler "
                           f"events <= 1.05x one without", e["step_with_records"]
                           / e["step_without_records"], "<=", 1.05))
        lines.append(_goal(f"{n} ranks, a waiting rank's CPU < 5 % of a core",
                           e["ringsync_wait_cpu"] * 100, "<", 5.0))
        if rows[min(rows)].get("gloo") is not None:
            small = [s for s in rows if s <= 16 << 20]
            worst = min(small, key=lambda s: rows[s]["gloo"] / rows[s]["ringsync"])
            lines.append(_goal(f"{n} ranks, gloo >= 5x slower up to 16 MiB (lowest at "
                               f"{human(worst)})", rows[worst]["gloo"] / rows[worst]["ringsync"],
                               ">=", 5.0))
    return lines


def _goal(what: str, value: float, relation: str, target: float) -> str:
    met = {"<=": value <= target, ">=": value >= target, "<": value < target}[relation]
    return f"  [{'met' if met else 'NOT met'}] {what}: {value:.2f}"


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m ringsync.bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--np", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--min-size", type=parse_size, default=4 << 10)
    parser.add_argument("--max-size", type=parse_size, default=64 << 20)
    parser.add_argument("--seconds", type=float, default=0.3,
                        help="time to spend per size and library (default 0.3)")
    parser.add_argument("--plot", metavar="FILE.png",
                        help="draw bus bandwidth against size for the three (needs matplotlib)")
    parser.add_argument("--deterministic", action="store_true",
                        help="instead: RINGSYNC_DETERMINISTIC=1's cost against the default")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        return worker(args)
    if args.deterministic:
        for np_ in args.np:
            print_deterministic(run_job(np_, args))
        return 0
    print("Bus bandwidth = size * 2(N-1)/N / time; ratio above 1: ringsync is faster.")
    results = []
    for np_ in args.np:
        results.append(run_job(np_, args))
        print_table(results[-1])
        print_engine(results[-1])
    print("\nGoals (this run):")
    print("\n".join(goal_lines(results)))
    if args.plot:
        plot(results, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
