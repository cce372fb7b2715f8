"""torch.distributed on the "ringsync" backend against gloo, side by side in one job.

The world group is ringsync's; a second group over the same ranks is gloo's
(`new_group(backend="gloo")`), so every figure compares the two on the same ranks, data
and moment, alternating which goes first. Printed on rank 0:

1. `dist.all_reduce` (SUM, float32, blocking) time per call from 4 B to 64 MiB, and
   gloo's time over ringsync's (above 1: ringsync is faster);
2. the step time of DDP and of FSDP2 (`fully_shard` over a 1-D DeviceMesh of the group)
   on the three models of benchmarks/torch_step_rate.py with each backend, and of one
   process alone (no communication: the compute the step cannot avoid), with each
   backend's overhead (its step minus the single process's) and ringsync's overhead as a
   share of gloo's.

    python -m torch.distributed.run --standalone --nproc-per-node 2 benchmarks/torch_backend.py
    ... benchmarks/torch_backend.py --max-size 4M --steps 10 --models digits-cnn
"""
import argparse
import importlib.util
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel

import ringsync.torch.distributed  # noqa: F401  (registers the "ringsync" backend)

HERE = Path(__file__).resolve().parent


def step_rate_module():
    """benchmarks/torch_step_rate.py's models (benchmarks/ is not a package)."""
    spec = importlib.util.spec_from_file_location("torch_step_rate", HERE / "torch_step_rate.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def parse_size(text):
    units = {"K": 1 << 10, "M": 1 << 20}
    return int(text[:-1]) * units[text[-1]] if text[-1] in units else int(text)


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-size", type=parse_size, default=64 << 20)
    parser.add_argument("--seconds", type=float, default=0.3, help="per size and backend")
    parser.add_argument("--steps", type=int, default=20, help="timed steps per setup")
    parser.add_argument("--rounds", type=int, default=3, help="alternations per setup")
    parser.add_argument("--batch", type=int, default=32, help="per-rank batch")
    parser.add_argument("--models", nargs="*", default=["many-small", "few-large", "digits-cnn"])
    return parser.parse_args()


def timed_calls(call, seconds, group):
    """Median seconds per call over batches of calls lasting about `seconds` in all."""
    call()
    dist.barrier(group=group)
    start = time.perf_counter()
    for _ in range(3):
        call()
    # How many calls make a batch of about seconds / 5: the same count on every rank
    # (each call is a collective), so rank 0's estimate is broadcast.
    count = torch.tensor([int(seconds / 5 / max((time.perf_counter() - start) / 3, 1e-7))])
    dist.broadcast(count, src=dist.get_global_rank(group, 0), group=group)
    per_batch = max(1, int(count.item()))
    trials = []
    for _ in range(5):
        dist.barrier(group=group)
        start = time.perf_counter()
        for _ in range(per_batch):
            call()
        trials.append((time.perf_counter() - start) / per_batch)
    slowest = torch.tensor([statistics.median(trials)], dtype=torch.float64)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=group)
    return slowest.item()


def allreduce_rows(groups, args):
    rows, size = [], 4
    while size <= args.max_size:
        t = torch.ones(size // 4, dtype=torch.float32)
        row = {"size": size}
        for name, group in sorted(groups.items(), key=lambda kv: (size // 4) % 2 == (kv[0] == "gloo")):
            row[name] = timed_calls(lambda g=group: dist.all_reduce(t, group=g), args.seconds, group)
        rows.append(row)
        size *= 4
    return rows


def wrapped(kind, model, group):
    if kind == "DDP":
        return DistributedDataParallel(model, process_group=group)
    mesh = DeviceMesh.from_group(group, "cpu")
    for layer in model.modules():
        if isinstance(layer, (torch.nn.Linear, torch.nn.Conv2d)):
            fully_shard(layer, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def step_seconds(models, name, kind, group, args):
    """Seconds per training step of `kind` (DDP, FSDP2 or single) on the group."""
    build, make_batch = models.MODELS[name]
    torch.manual_seed(0)
    model = build()
    if kind != "single":
        model = wrapped(kind, model, group)
    generator = torch.Generator().manual_seed(dist.get_rank())
    x, target, loss_fn = make_batch(args.batch, generator)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)

    def step():
        optimizer.zero_grad()
        loss_fn(model(x), target).backward()
        optimizer.step()
    for _ in range(3):
        step()
    dist.barrier(group=group)
    start = time.perf_counter()
    for _ in range(args.steps):
        step()
    elapsed = torch.tensor([(time.perf_counter() - start) / args.steps], dtype=torch.float64)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX, group=group)
    return elapsed.item()


def model_rows(groups, args):
    models = step_rate_module()
    rows = []
    for name in args.models:
        row = {"model": name}
        for kind in ("DDP", "FSDP2"):
            for backend in ("ringsync", "gloo"):
                row[(kind, backend)] = []
        row["single"] = []
        for r in range(args.rounds):
            order = ["ringsync", "gloo"] if r % 2 == 0 else ["gloo", "ringsync"]
            for kind in ("DDP", "FSDP2"):
                for backend in order:
                    row[(kind, backend)].append(
                        step_seconds(models, name, kind, groups[backend], args))
            row["single"].append(step_seconds(models, name, "single", groups["gloo"], args))
        rows.append({k: (statistics.median(v) if isinstance(v, list) else v)
                     for k, v in row.items()})
    return rows


def human(size):
    for unit, scale in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if size >= scale:
            return f"{size // scale} {unit}"
    return f"{size} B"


def report(sizes, models, world):
    print(f"\ndist.all_reduce, float32 SUM, {world} ranks (median time per call)")
    print(f"{'size':>8} {'ringsync':>11} {'gloo':>11} {'gloo/ringsync':>14}")
    for row in sizes:
        print(f"{human(row['size']):>8} {row['ringsync'] * 1e6:>9.1f}us {row['gloo'] * 1e6:>9.1f}us "
              f"{row['gloo'] / row['ringsync']:>13.2f}x")
    print(f"\nstep time, {world} ranks (ms; overhead = step - single process)")
    print(f"{'model':>11} {'kind':>6} {'ringsync':>9} {'gloo':>9} {'single':>8} "
          f"{'rs over':>8} {'gloo over':>9} {'rs/gloo over':>12}")
    for row in models:
        for kind in ("DDP", "FSDP2"):
            rs, gl, single = row[(kind, "ringsync")], row[(kind, "gloo")], row["single"]
            rs_over, gl_over = rs - single, gl - single
            share = rs_over / gl_over if gl_over > 0 else float("nan")
            print(f"{row['model']:>11} {kind:>6} {rs * 1e3:>9.2f} {gl * 1e3:>9.2f} "
                  f"{single * 1e3:>8.2f} {rs_over * 1e3:>8.2f} {gl_over * 1e3:>9.2f} "
                  f"{share:>12.2f}")


def main():
    args = parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("ringsync")
    groups = {"ringsync": dist.group.WORLD, "gloo": dist.new_group(backend="gloo")}
    sizes = allreduce_rows(groups, args)
    models = model_rows(groups, args)
    if dist.get_rank() == 0:
        report(sizes, models, dist.get_world_size())
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
