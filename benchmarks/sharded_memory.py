"""Memory per rank and step time: DistributedOptimizer against ShardedOptimizer stages 1
and 2, on the same ranks, model, batches and starting parameters, in one mpirun job.

    mpirun -np 2 python benchmarks/sharded_memory.py
    mpirun -np 3 --oversubscribe python benchmarks/sharded_memory.py --width 512 --steps 20

Printed on rank 0: each rank's bytes of parameters, gradients and optimizer state after a
step (before zero_grad), as ShardedOptimizer.memory() counts them (distinct storages; for
DistributedOptimizer the same count over its parameters, p.grad and the wrapped optimizer's
state), then each kind and the step time as a ratio to DistributedOptimizer's.
"""
import argparse
import time

import torch

import ringsync.torch as hvd
from ringsync.torch.sharded import _held

KINDS = ("parameters", "gradients", "optimizer_state")


def model_of(width, depth):
    torch.manual_seed(0)
    layers = []
    for _ in range(depth):
        layers += [torch.nn.Linear(width, width + 1), torch.nn.ReLU()]
        width += 1
    return torch.nn.Sequential(*layers, torch.nn.Linear(width, 1))


def plain_memory(model, opt):
    params = list(model.parameters())
    state = [v for st in opt.state.values() for v in st.values() if torch.is_tensor(v)]
    return {"parameters": _held(params), "gradients": _held([p.grad for p in params]),
            "optimizer_state": _held(state)}


def run(make, args):
    model = model_of(args.width, args.depth)
    opt = make(model)
    g = torch.Generator().manual_seed(hvd.rank())
    times = []
    for step in range(args.steps + 2):
        x = torch.randn(args.batch, args.width, generator=g)
        opt.zero_grad()
        start = time.perf_counter()
        model(x).square().mean().backward()
        opt.step()
        if step >= 2:  # (warm-up: the first steps create state and prepare requests)
            times.append(time.perf_counter() - start)
    mem = opt.memory() if isinstance(opt, hvd.ShardedOptimizer) else plain_memory(model, opt)
    return mem, sorted(times)[len(times) // 2]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--width", type=int, default=384)
    parser.add_argument("--depth", type=int, default=6)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()
    hvd.init()
    adam = lambda m: torch.optim.Adam(m.parameters(), lr=1e-3)  # noqa: E731
    named = {
        "DistributedOptimizer": lambda m: hvd.DistributedOptimizer(adam(m), m.named_parameters()),
        "ShardedOptimizer stage 1": lambda m: hvd.ShardedOptimizer(adam(m), stage=1),
        "ShardedOptimizer stage 2": lambda m: hvd.ShardedOptimizer(adam(m), stage=2),
    }
    results = {name: run(make, args) for name, make in named.items()}
    everyone = hvd.allgather_object(results, name="sharded_memory.results")
    if hvd.rank() == 0:
        n = sum(p.numel() for p in model_of(args.width, args.depth).parameters())
        print(f"{hvd.size()} ranks, {n} float32 parameters, Adam; MiB per rank "
              "(parameters / gradients / optimizer state), median step ms")
        base_mem, base_time = results["DistributedOptimizer"]
        for name in named:
            for r, per_rank in enumerate(everyone):
                mem, took = per_rank[name]
                mib = " / ".join(f"{mem[k] / 2 ** 20:6.2f}" for k in KINDS)
                print(f"  {name:26s} rank {r}: {mib}   {took * 1e3:7.2f} ms")
            mem, took = results[name]
            ratios = "  ".join(f"{k} {mem[k] / base_mem[k]:.2f}" for k in KINDS)
            ratios += f"  total {sum(mem.values()) / sum(base_mem.values()):.2f}"
            print(f"  {name:26s} rank 0 vs DistributedOptimizer: {ratios}  "
                  f"step time {took / base_time:.2f}")
    hvd.shutdown()


if __name__ == "__main__":
    main()
