"""Peak memory per rank and step time: plain data parallel against ZeRO stages 1, 2, 3, for
ringsync and for torch on gloo (DistributedDataParallel, ZeroRedundancyOptimizer, FSDP2's
fully_shard), on the same ranks, model, batches and starting parameters, in one mpirun job.

    mpirun -np 2 python benchmarks/sharded_memory.py
    mpirun -np 2 python benchmarks/sharded_memory.py --width 1024 --depth 4 --steps 3
    mpirun -np 4 --oversubscribe python benchmarks/sharded_memory.py   # (4 ranks, fewer cores)
    mpirun -np 2 python benchmarks/sharded_memory.py --trace   # (where each peak happens)

Memory is measured, not counted: before each configuration the process returns freed
memory to the system (malloc_trim; glibc's mmap threshold is fixed at 64 KiB so large
tensors are mapped and unmapped), its resident size is the baseline, the model is built,
wrapped and stepped twice (optimizer state exists), the kernel's peak-RSS mark is reset
(/proc/self/clear_refs), and the timed steps run. "peak" is the peak resident size during
the timed steps minus the baseline: parameters, gradients, optimizer state, activations,
communication buffers and transient copies, everything the configuration needs in steady
state. (Building a stage-3 model whole before sharding it is outside the window; so are
the buffers a library keeps once it has run — ringsync's fusion and shared-memory buffers,
gloo's — as one untimed warm-up run of each library comes first.) Each rank reports its own;
the table shows the largest over ranks, and the median step time of the slowest rank.
Ratios are to plain data parallel with ringsync (the first row, DistributedOptimizer).

"bound MiB" is ZeRO's accounting for fp32 Adam, P parameter bytes on N ranks (parameters
P, gradients P, Adam's moments 2P): plain data parallel 4P; stage 1 (moments sharded)
(2 + 2/N)P; stage 2 (and gradients) (1 + 3/N)P; stage 3 (and parameters) 4P/N. It leaves
out activations, buffers and transient copies: "measured/bound" above 1 is what a
configuration spends beyond its state. Stage 3's second line, "with working set", adds two
units gathered whole (the one running and the next) and one unit's whole gradient, a unit
being the largest Linear (weight and bias).

--trace cuts each timed step in phases (zero_grad, forward, backward, step) and prints,
per configuration, each phase's peak above the baseline (the mark reset at its start, so
it includes the resident size then) and its resident size at its end: where the peak
happens. (Reading /proc between phases costs a little: step times differ from a plain run.)
"""
import argparse
import ctypes
import gc
import os
import time

import torch

import ringsync.torch as hvd

M_MMAP_THRESHOLD = -3  # (glibc's mallopt parameter numbers)
M_TRIM_THRESHOLD = -1
MiB = 2 ** 20


def model_of(width, depth):
    torch.manual_seed(0)
    layers = []
    for _ in range(depth):
        layers += [torch.nn.Linear(width, width), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers, torch.nn.Linear(width, 16))


def parameter_bytes(module):
    return sum(p.numel() * p.element_size() for p in module.parameters())


def largest_unit_bytes(model):
    """A stage-3 unit's bytes: the largest Linear's weight and bias (each Linear is one)."""
    return max(parameter_bytes(m) for m in model.modules() if isinstance(m, torch.nn.Linear))


def adam(params):
    return torch.optim.Adam(params, lr=1e-4)


# ---- the configurations: each returns (model as trained, optimizer) ----

def ringsync_dp(model):
    return model, hvd.DistributedOptimizer(adam(model.parameters()), model.named_parameters())


def ringsync_dp_bucket_view(model):
    # (gradients are views of the buffer they are reduced in: no copy in and out at step())
    return model, hvd.DistributedOptimizer(adam(model.parameters()), model.named_parameters(),
                                           gradient_as_bucket_view=True)


def ringsync_stage(stage):
    def make(model):
        if stage == 3:
            model = hvd.ShardedModule(model, broadcast_from_first_rank=False)
            return model, hvd.ShardedOptimizer(adam(model.parameters()), stage=3)
        return model, hvd.ShardedOptimizer(adam(model.parameters()), stage=stage)
    return make


def torch_ddp(model):
    from torch.nn.parallel import DistributedDataParallel
    return DistributedDataParallel(model), adam(model.parameters())


def torch_zero(model):
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel
    ddp = DistributedDataParallel(model)
    return ddp, ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.Adam,
                                        lr=1e-4)


def torch_fsdp2(model):
    from torch.distributed.fsdp import fully_shard
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    return model, adam(model.parameters())


# ---- ZeRO's accounting for fp32 Adam: P parameter bytes, N ranks ----

def replicated(P, N):  # parameters, gradients and both moments on every rank
    return 4 * P


def stage1(P, N):  # the moments sharded
    return (2 + 2 / N) * P


def stage2(P, N):  # and the gradients
    return (1 + 3 / N) * P


def stage3(P, N):  # and the parameters
    return 4 * P / N


def stage3_working_set(P, N, unit):
    # (two units gathered at once — the one running and the next — and one unit's whole
    # gradient before it is reduce-scattered)
    return stage3(P, N) + 2 * unit + unit


PLAIN = "ringsync DistributedOptimizer"
STAGE1 = "ringsync ShardedOptimizer stage 1"
STAGE2 = "ringsync ShardedOptimizer stage 2"
STAGE3 = "ringsync ShardedModule stage 3"
FSDP2 = "torch FSDP2 fully_shard (gloo)"

CONFIGS = {  # name -> (make, bound(P, N), working-set bound(P, N, unit) or None)
    PLAIN: (ringsync_dp, replicated, None),
    "ringsync DistributedOptimizer, gradient_as_bucket_view": (
        ringsync_dp_bucket_view, replicated, None),
    STAGE1: (ringsync_stage(1), stage1, None),
    STAGE2: (ringsync_stage(2), stage2, None),
    STAGE3: (ringsync_stage(3), stage3, stage3_working_set),
    "torch DDP (gloo)": (torch_ddp, replicated, None),
    "torch ZeroRedundancyOptimizer (gloo)": (torch_zero, stage1, None),
    FSDP2: (torch_fsdp2, stage3, stage3_working_set),
}


# ---- measuring ----

def resident_bytes():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak_resident_bytes():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def reset_peak():
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def settle(libc):
    gc.collect()
    libc.malloc_trim(0)


def step(model, opt, x):
    opt.zero_grad()
    model(x).square().mean().backward()
    opt.step()


PHASES = ("zero_grad", "forward", "backward", "step")


def traced_step(model, opt, x, base):
    """step(), phase by phase: {phase: (peak, resident at its end)}, both above base."""
    marks = {}

    def phase(name, run):
        reset_peak()  # (the mark drops to the resident size now: the phase's own peak)
        out = run()
        marks[name] = (peak_resident_bytes() - base, resident_bytes() - base)
        return out
    phase("zero_grad", opt.zero_grad)
    loss = phase("forward", lambda: model(x).square().mean())
    phase("backward", loss.backward)
    phase("step", opt.step)
    return marks


def measure(make, args, libc):
    settle(libc)
    base = resident_bytes()
    model, opt = make(model_of(args.width, args.depth))
    g = torch.Generator().manual_seed(hvd.rank())
    batches = [torch.randn(args.batch, args.width, generator=g) for _ in range(args.steps + 2)]
    for x in batches[:2]:  # (the optimizer state appears at the first step)
        step(model, opt, x)
    settle(libc)
    reset_peak()
    times, traces = [], []
    for x in batches[2:]:
        start = time.perf_counter()
        if args.trace:
            traces.append(traced_step(model, opt, x, base))
        else:
            step(model, opt, x)
        times.append(time.perf_counter() - start)
    result = {"time": sorted(times)[len(times) // 2]}
    if args.trace:  # (the phases cover the step, and each reset the mark: their largest)
        result["phases"] = {ph: tuple(max(t[ph][i] for t in traces) for i in (0, 1))
                            for ph in PHASES}
        result["peak"] = max(peak for peak, _ in result["phases"].values())
    else:
        result["peak"] = peak_resident_bytes() - base
    del model, opt, batches
    return result


def measure_commit(stage, redundancy, args, libc):
    """An elastic TorchState's commit() over a stepped stage-2 or stage-3 model: its median
    time, the bytes of one snapshot (this rank's part, the neighbour's copy), counted, and
    the resident growth once two snapshots are held (a commit keeps the newest two)."""
    settle(libc)
    base = resident_bytes()
    model = model_of(args.width, args.depth)
    if stage == 3:
        model = hvd.ShardedModule(model, broadcast_from_first_rank=False)
    opt = hvd.ShardedOptimizer(adam(model.parameters()), stage=stage, redundancy=redundancy)
    x = torch.randn(args.batch, args.width)
    for _ in range(2):
        step(model, opt, x)
    settle(libc)
    before = resident_bytes()
    state = hvd.elastic.TorchState(model, opt, step=0)
    times = []
    for _ in range(3):
        start = time.perf_counter()
        state.commit()
        times.append(time.perf_counter() - start)
    settle(libc)
    snap = state._snapshots[state.commit_id]["sharded"]
    result = {"time": sorted(times)[1], "held": resident_bytes() - before,
              "own": _part_bytes(snap["own"]), "copy": _part_bytes(snap["left"] or {}),
              "peak": resident_bytes() - base}
    del model, opt, state, snap
    return result


def _part_bytes(part):
    pieces = [p["tensor"] for entries in part.get("pieces", {}).values() for p in entries]
    return sum(t.numel() * t.element_size() for t in pieces)


def start_torch_distributed():
    """gloo beside ringsync: rank 0 picks the port, everyone learns it from ringsync."""
    import socket

    import torch.distributed as dist
    port = None
    if hvd.rank() == 0:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
    port = hvd.broadcast_object(port, 0, name="sharded_memory.port")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=hvd.rank(), world_size=hvd.size())


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--depth", type=int, default=6)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--trace", action="store_true",
                        help="each phase's peak and resident size, to see where peaks happen")
    args = parser.parse_args()
    torch.set_num_threads(1)
    libc = ctypes.CDLL("libc.so.6")
    libc.mallopt(M_MMAP_THRESHOLD, 64 * 1024)
    libc.mallopt(M_TRIM_THRESHOLD, 64 * 1024)
    hvd.init()
    start_torch_distributed()
    for make in (ringsync_dp, torch_ddp):  # (warm-up: buffers each library keeps)
        measure(make, args, libc)
    results = {}
    for name, (make, _, _) in CONFIGS.items():
        try:
            results[name] = measure(make, args, libc)
        except Exception as e:  # (a peer that does not run on CPU: say why, go on)
            results[name] = {"error": f"{type(e).__name__}: {str(e)[:100]}"}
        hvd.barrier()
    for stage in (2, 3):
        for redundancy in (0, 1):
            results[f"commit {stage} {redundancy}"] = measure_commit(stage, redundancy, args,
                                                                     libc)
    everyone = hvd.allgather_object(results, name="sharded_memory.results")
    if hvd.rank() == 0:
        report(everyone, args)
    import torch.distributed as dist
    dist.destroy_process_group()
    hvd.shutdown()


# ---- reporting (rank 0) ----

def worst(everyone, name, key):
    """The largest over ranks of a configuration's key; None where it did not run."""
    if any("error" in r[name] for r in everyone):
        return None
    return max(r[name][key] for r in everyone)


def report(everyone, args):
    model = model_of(args.width, args.depth)
    N, P, unit = len(everyone), parameter_bytes(model), largest_unit_bytes(model)
    print(f"N = {N} ranks; P = {P / MiB:.1f} MiB of float32 parameters "
          f"({P // 4 / 1e6:.1f} M; with Adam, data parallel keeps about {4 * P / MiB:.0f} "
          f"MiB), largest unit {unit / MiB:.1f} MiB, batch {args.batch}, "
          f"{args.steps} timed steps")
    w = max(len(name) for name in CONFIGS)
    print(f"{'':{w}s} {'peak MiB/rank':>14s} {'bound MiB':>10s} {'measured/bound':>15s} "
          f"{'ratio':>6s} {'step ms':>8s} {'ratio':>6s}")
    base_peak, base_time = worst(everyone, PLAIN, "peak"), worst(everyone, PLAIN, "time")
    assert base_peak is not None, everyone[0][PLAIN]
    for name, (_, bound, working_set) in CONFIGS.items():
        peak, took = worst(everyone, name, "peak"), worst(everyone, name, "time")
        if peak is None:
            error = next(r[name]["error"] for r in everyone if "error" in r[name])
            print(f"{name:{w}s} did not run: {error}")
            continue
        b = bound(P, N)
        print(f"{name:{w}s} {peak / MiB:14.1f} {b / MiB:10.1f} {peak / b:15.2f} "
              f"{peak / base_peak:6.2f} {took * 1e3:8.1f} {took / base_time:6.2f}")
        if working_set is not None:
            b = working_set(P, N, unit)
            print(f"{'  bound with working set (4P/N + 3 units)':{w}s} {'':14s} "
                  f"{b / MiB:10.1f} {peak / b:15.2f}")
    report_goals(everyone, P)
    report_commits(everyone)
    if args.trace:
        report_phases(everyone)


def report_goals(everyone, P):
    def ratio(a, b):
        a, b = worst(everyone, a, "time"), worst(everyone, b, "time")
        return "n/a" if a is None or b is None else f"{a / b:.2f}"

    print(f"step time: stage 3 / plain {ratio(STAGE3, PLAIN)}, "
          f"stage 3 / FSDP2 {ratio(STAGE3, FSDP2)}")
    one, two = worst(everyone, STAGE1, "peak"), worst(everyone, STAGE2, "peak")
    saved = "n/a" if one is None or two is None else f"{(one - two) / MiB:.1f} MiB"
    accounted = (1 - 1 / len(everyone)) * P  # (stage 1's bound less stage 2's: P/2 at N = 2)
    print(f"stage 1 peak - stage 2 peak: {saved}, beside half the gradient bytes P/2 = "
          f"{P / 2 / MiB:.1f} MiB (accounting: (1 - 1/N)P = {accounted / MiB:.1f} MiB)")


def report_commits(everyone):
    print("elastic TorchState.commit() (largest over ranks): ms; one snapshot's sharded "
          "bytes, own part + neighbour's copy; resident growth with two snapshots held")
    for stage in (2, 3):
        for redundancy in (0, 1):
            rows = [r[f"commit {stage} {redundancy}"] for r in everyone]
            print(f"  stage {stage}, redundancy={redundancy}: "
                  f"{max(r['time'] for r in rows) * 1e3:7.1f} ms, "
                  f"{max(r['own'] for r in rows) / MiB:6.1f} + "
                  f"{max(r['copy'] for r in rows) / MiB:6.1f} MiB, "
                  f"held {max(r['held'] for r in rows) / MiB:6.1f} MiB")


def report_phases(everyone):
    print("phases of the timed steps (peak above baseline: largest over ranks and steps; "
          "resident at the phase's end: largest)")
    for name in (name for name in CONFIGS if worst(everyone, name, "peak") is not None):
        print(name)
        for ph in PHASES:
            peak = max(r[name]["phases"][ph][0] for r in everyone)
            end = max(r[name]["phases"][ph][1] for r in everyone)
            print(f"  {ph:10s} peak {peak / MiB:8.1f} MiB   resident at end {end / MiB:8.1f} MiB")


if __name__ == "__main__":
    main()
