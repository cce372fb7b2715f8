"""Peak memory per rank and step time: plain data parallel against ZeRO stages 1, 2, 3, for
ringsync and for torch on gloo (DistributedDataParallel, ZeroRedundancyOptimizer, FSDP2's
fully_shard), on the same ranks, model, batches and starting parameters, in one mpirun job.

    mpirun -np 2 python benchmarks/sharded_memory.py
    mpirun -np 2 python benchmarks/sharded_memory.py --width 1024 --depth 4 --steps 3

Memory is measured, not counted: before each configuration the process returns freed
memory to the system (malloc_trim; glibc's mmap threshold is fixed at 64 KiB so large
tensors are mapped and unmapped), its resident size is the baseline, the model is built,
wrapped and stepped twice (optimizer state exists), the kernel's peak-RSS mark is reset
(/proc/self/clear_refs), and the timed steps run. "peak" is the peak resident size during
the timed steps minus the baseline: parameters, gradients, optimizer state, activations,
communication buffers and transient copies, everything the configuration needs in steady
state. (Building a stage-3 model whole before sharding it is outside the window; so are
the buffers a library keeps once it has run — ringsync's fusion and shared-memory buffers,
gloo's — as one untimed warm-up run of each library comes first.) Each
rank reports its own; the table shows the largest over ranks, and the median step time
of the slowest rank. Ratios are to plain data parallel with ringsync
(DistributedOptimizer).
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


def model_of(width, depth):
    torch.manual_seed(0)
    layers = []
    for _ in range(depth):
        layers += [torch.nn.Linear(width, width), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers, torch.nn.Linear(width, 16))


def adam(params):
    return torch.optim.Adam(params, lr=1e-4)


# ---- the configurations: each returns (model as trained, optimizer) ----

def ringsync_dp(model):
    return model, hvd.DistributedOptimizer(adam(model.parameters()), model.named_parameters())


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


CONFIGS = {
    "ringsync DistributedOptimizer": ringsync_dp,
    "ringsync ShardedOptimizer stage 1": ringsync_stage(1),
    "ringsync ShardedOptimizer stage 2": ringsync_stage(2),
    "ringsync ShardedModule stage 3": ringsync_stage(3),
    "torch DDP (gloo)": torch_ddp,
    "torch ZeroRedundancyOptimizer (gloo)": torch_zero,
    "torch FSDP2 fully_shard (gloo)": torch_fsdp2,
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
    times = []
    for x in batches[2:]:
        start = time.perf_counter()
        step(model, opt, x)
        times.append(time.perf_counter() - start)
    peak = peak_resident_bytes() - base
    del model, opt, batches
    return {"peak": peak, "time": sorted(times)[len(times) // 2]}


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
    for name, make in CONFIGS.items():
        try:
            results[name] = measure(make, args, libc)
        except Exception as e:  # (a peer that does not run on CPU: say why, go on)
            results[name] = {"error": f"{type(e).__name__}: {str(e)[:100]}"}
        hvd.barrier()
    everyone = hvd.allgather_object(results, name="sharded_memory.results")
    if hvd.rank() == 0:
        report(everyone, args)
    import torch.distributed as dist
    dist.destroy_process_group()
    hvd.shutdown()


def report(everyone, args):
    n = sum(p.numel() for p in model_of(args.width, args.depth).parameters())
    print(f"{len(everyone)} ranks; {n / 1e6:.1f} M float32 parameters "
          f"({n * 4 / 2 ** 20:.0f} MiB; with Adam, data parallel keeps about "
          f"{n * 16 / 2 ** 20:.0f} MiB), batch {args.batch}, {args.steps} timed steps")
    print(f"{'':38s} {'peak MiB/rank':>14s} {'ratio':>6s} {'step ms':>8s} {'ratio':>6s}")
    base = everyone[0]["ringsync DistributedOptimizer"]
    base_peak = max(r["ringsync DistributedOptimizer"]["peak"] for r in everyone)
    base_time = max(r["ringsync DistributedOptimizer"]["time"] for r in everyone)
    assert "error" not in base
    for name in CONFIGS:
        errors = [r[name]["error"] for r in everyone if "error" in r[name]]
        if errors:
            print(f"{name:38s} did not run: {errors[0]}")
            continue
        peak = max(r[name]["peak"] for r in everyone)
        took = max(r[name]["time"] for r in everyone)
        print(f"{name:38s} {peak / 2 ** 20:14.0f} {peak / base_peak:6.2f} "
              f"{took * 1e3:8.1f} {took / base_time:6.2f}")


if __name__ == "__main__":
    main()
