"""Training steps per second: ringsync's DistributedOptimizer against PyTorch DDP (gloo).

Both run in the same mpirun job, on the same ranks, models, batches and starting
parameters, one after the other, alternating which goes first. A single process (no
communication, the same per-rank batch) gives the compute-only baseline.

    mpirun -np 2 python benchmarks/torch_step_rate.py
    mpirun -np 4 --oversubscribe python benchmarks/torch_step_rate.py --steps 20
    mpirun -np 2 python benchmarks/torch_step_rate.py --models many-small --batch 64

Printed on rank 0, per model: ringsync steps/s, DDP steps/s, their ratio (above 1:
ringsync is faster), and ringsync's step time over the single process's step time (the
cost of data parallelism; 1.00 would be free). A second table puts the cost in
milliseconds per step: each library's overhead (its step minus the single process's),
ringsync's overhead as a share of DDP's, and against the copy-and-reduce bound of the
step's gradient bytes, measured in the same run: every rank at once copies its gradients
into a buffer, adds a buffer of the same size to it and copies the sum back (three
memory-speed passes, what any data-parallel step must at least do on one host).
A third compares ringsync with its default settings and with the settings autotune chose
(ringsync.autotune.start, as RINGSYNC_AUTOTUNE=1 does, with --tune-steps steps per
sample), timed in alternation after the tuning, and shows the choice.
"""
import argparse
import copy
import functools
import importlib.util
import os
import socket
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from mpi4py import MPI

import ringsync.torch as hvd
from ringsync import autotune

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "pytorch_digits.py"


# ---- models and their data ----

def many_small():
    """40 x Linear(256, 256): 80 small parameter tensors (fusion matters)."""
    layers = []
    for _ in range(40):
        layers += [torch.nn.Linear(256, 256), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers)


def few_large():
    """3 x Linear(2048, 2048): 6 tensors, 50 MB of gradients (bandwidth matters)."""
    return torch.nn.Sequential(torch.nn.Linear(2048, 2048), torch.nn.ReLU(),
                               torch.nn.Linear(2048, 2048), torch.nn.ReLU(),
                               torch.nn.Linear(2048, 2048))


@functools.cache
def digits_example():
    """examples/pytorch_digits.py as a module (examples/ is not a package); loaded once."""
    spec = importlib.util.spec_from_file_location("pytorch_digits", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def digits_cnn():
    """The network of examples/pytorch_digits.py (small: latency matters)."""
    return digits_example().DigitsNet()


def regression_batch(width):
    def make(batch, generator):
        return (torch.randn(batch, width, generator=generator),
                torch.randn(batch, width, generator=generator), F.mse_loss)
    return make


def digits_batch(batch, generator):
    return (torch.rand(batch, 1, 8, 8, generator=generator),
            torch.randint(0, 10, (batch,), generator=generator), F.cross_entropy)


MODELS = {  # name -> (builder, batch maker)
    "many-small": (many_small, regression_batch(256)),
    "few-large": (few_large, regression_batch(2048)),
    "digits-cnn": (digits_cnn, digits_batch),
}


# ---- setup ----

def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30, help="timed steps per configuration")
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps before them")
    parser.add_argument("--batch", type=int, default=32, help="samples per rank per step")
    parser.add_argument("--rounds", type=int, default=2,
                        help="times each library runs per model (orders alternate)")
    parser.add_argument("--tune-steps", type=int, default=5,
                        help="autotune: steps per sample (the autotuned column)")
    parser.add_argument("--tune-samples", type=int, default=20,
                        help="autotune: most samples after one warm-up sample")
    parser.add_argument("--models", nargs="+", default=list(MODELS),
                        help=f"any of {', '.join(MODELS)} (space or comma separated)")
    args = parser.parse_args()
    args.models = [m for arg in args.models for m in arg.split(",") if m]
    unknown = [m for m in args.models if m not in MODELS]
    if unknown:
        parser.error(f"unknown models {unknown}; choose from {list(MODELS)}")
    return args


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_torch_distributed(comm):
    """gloo over loopback (one host), rendezvous at a port that rank 0 picked."""
    port = comm.bcast(free_port() if comm.rank == 0 else None, root=0)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # ringsync's same-host peers use lo too
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}",
                             rank=comm.rank, world_size=comm.size)


def fresh_model(name, initial_state):
    """A new copy of the model holding initial_state (identical on every rank)."""
    model = MODELS[name][0]()
    model.load_state_dict(initial_state)
    return model


def make_step(model, optimizer, batch):
    x, target, loss_fn = batch

    def step():
        optimizer.zero_grad()
        loss_fn(model(x), target).backward()
        optimizer.step()
    return step


# ---- the three configurations; each returns the model it trained ----

def ringsync_step(name, initial_state, batch, lr, views=False):
    model = fresh_model(name, initial_state)
    optimizer = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=lr),
        # prefixed: the models' parameter names overlap ("0.weight") with other shapes
        named_parameters=[(f"{name}.{n}", p) for n, p in model.named_parameters()],
        gradient_as_bucket_view=views)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    return model, make_step(model, optimizer, batch)


def ringsync_views_step(name, initial_state, batch, lr):
    """gradient_as_bucket_view=True: the gradients are views of the reduction buffer."""
    return ringsync_step(name, initial_state, batch, lr, views=True)


def ddp_step(name, initial_state, batch, lr):
    model = fresh_model(name, initial_state)
    ddp = torch.nn.parallel.DistributedDataParallel(model)  # broadcasts rank 0's state
    optimizer = torch.optim.SGD(ddp.parameters(), lr=lr)
    return model, make_step(ddp, optimizer, batch)


def single_step(name, initial_state, batch, lr):
    model = fresh_model(name, initial_state)
    return model, make_step(model, torch.optim.SGD(model.parameters(), lr=lr), batch)


SETUPS = {"ringsync": ringsync_step, "views": ringsync_views_step, "DDP": ddp_step,
          "single": single_step}
TIMED = ["ringsync", "views", "DDP"]  # timed in turn, the order rotating by round


# ---- timing ----

def run_steps(step, count):
    for _ in range(count):
        step()


def time_together(comm, step, args):
    """Seconds for args.steps steps on all ranks (the slowest rank's time)."""
    run_steps(step, args.warmup)
    comm.Barrier()
    start = time.perf_counter()
    run_steps(step, args.steps)
    comm.Barrier()
    return comm.allreduce(time.perf_counter() - start, op=MPI.MAX)


def wait_without_spinning(comm):
    """A barrier that sleeps: Open MPI's Barrier spins, which would take a core from the
    rank that is timing the single process."""
    request = comm.Ibarrier()
    while not request.Test():
        time.sleep(0.005)


def time_single(comm, step, args):
    """Seconds for args.steps steps of rank 0 alone, while the other ranks sleep."""
    seconds = None
    if comm.rank == 0:
        run_steps(step, args.warmup)
        start = time.perf_counter()
        run_steps(step, args.steps)
        seconds = time.perf_counter() - start
    wait_without_spinning(comm)
    return comm.bcast(seconds, root=0)


def copy_and_reduce_seconds(comm, nbytes, repeat=20):
    """The bound: every rank at once copies nbytes of float32 gradients into a buffer,
    adds another buffer of that size to it, and copies the sum back (median of repeat)."""
    grads = torch.rand(nbytes // 4)
    fused, peer = torch.empty_like(grads), torch.rand(nbytes // 4)
    times = []
    for _ in range(repeat + 2):
        comm.Barrier()
        start = time.perf_counter()
        fused.copy_(grads)
        fused.add_(peer)
        grads.copy_(fused)
        times.append(comm.allreduce(time.perf_counter() - start, op=MPI.MAX))
    return sorted(times[2:])[repeat // 2]


def ranks_agree(comm, model):
    """True when every rank holds bit-identical parameters (both libraries should keep
    them so; a difference means the gradients were not averaged the same everywhere)."""
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    mine = flat.double().sum().item(), flat.abs().double().sum().item()
    return len(set(comm.allgather(mine))) == 1


def benchmark_model(comm, name, index, args, lr=1e-3):
    """{setup: steps/s}, timing ringsync and DDP args.rounds times each, alternating."""
    builder, batch_maker = MODELS[name]
    torch.manual_seed(0)  # the same initial parameters on every rank and in every setup
    initial_state = copy.deepcopy(builder().state_dict())
    data_seed = torch.Generator().manual_seed(1000 + comm.rank)  # each rank its own batch
    batch = batch_maker(args.batch, data_seed)

    seconds = dict.fromkeys(TIMED, 0.0)
    for round_ in range(args.rounds):
        shift = (index + round_) % len(TIMED)
        for setup in TIMED[shift:] + TIMED[:shift]:
            model, step = SETUPS[setup](name, initial_state, batch, lr)
            seconds[setup] += time_together(comm, step, args)
            if not ranks_agree(comm, model):
                raise RuntimeError(f"{setup} left ranks with different parameters for {name}")
    _, step = single_step(name, initial_state, batch, lr)
    rates = {s: args.rounds * args.steps / t for s, t in seconds.items()}
    rates["single"] = args.steps / time_single(comm, step, args)
    rates["default"], rates["autotuned"], rates["chosen"] = autotuned_rate(
        comm, name, initial_state, batch, lr, args)
    rates["bound"] = 1.0 / copy_and_reduce_seconds(comm, 4 * describe(name)[1])
    # every rank stepping alone at the same time: what sharing the host costs, no reduction
    rates["together"] = args.steps / time_together(comm, step, args)
    return rates


def autotuned_rate(comm, name, initial_state, batch, lr, args):
    """(steps/s with the defaults, steps/s with what autotune chose, the choice): autotune
    runs first (as RINGSYNC_AUTOTUNE=1 does, with shorter samples); then the same model
    is timed with the defaults and with the choice in alternation, args.rounds times each,
    so that both figures come from the same stretch of the run."""
    ring = hvd.global_process_set.communicator()
    defaults = ring.engine_settings()
    tuner = autotune.start(ring, warmup_samples=1, steps_per_sample=args.tune_steps,
                                max_samples=args.tune_samples)
    model, step = ringsync_step(name, initial_state, batch, lr)
    while not tuner.done:
        step()
    chosen = ring.engine_settings()
    seconds = {"default": 0.0, "chosen": 0.0}
    for round_ in range(args.rounds):
        for which in (["default", "chosen"] if round_ % 2 == 0 else ["chosen", "default"]):
            ring.tune(defaults if which == "default" else chosen)
            seconds[which] += time_together(comm, step, args)
    ring.tune(defaults)
    steps = args.rounds * args.steps
    return steps / seconds["default"], steps / seconds["chosen"], chosen


def describe(name):
    params = list(MODELS[name][0]().parameters())
    return len(params), sum(p.numel() for p in params)


def print_table(comm, args, results):
    print(f"ringsync DistributedOptimizer vs torch DDP (gloo): {comm.size} ranks, batch "
          f"{args.batch} per rank, {args.steps} timed steps after {args.warmup} warmup, "
          f"{args.rounds} rounds each; SGD, 1 torch thread per rank")
    header = (f"{'model':<11} {'tensors':>7} {'params':>8} {'ringsync steps/s':>16} "
              f"{'DDP steps/s':>11} {'ringsync/DDP':>12} {'ringsync step/1-process step':>28}")
    print(header)
    print("-" * len(header))
    for name, rates in results.items():
        tensors, params = describe(name)
        print(f"{name:<11} {tensors:>7} {params / 1e6:>7.2f}M {rates['ringsync']:>16.1f} "
              f"{rates['DDP']:>11.1f} {rates['ringsync'] / rates['DDP']:>12.2f} "
              f"{rates['single'] / rates['ringsync']:>28.2f}")
    singles = ", ".join(f"{n} {r['single']:.1f}" for n, r in results.items())
    print(f"(1-process steps/s: {singles})", flush=True)
    print()
    header = (f"{'model':<11} {'grad MB':>7} {'1-process ms':>12} {'no-comm +ms':>11} "
              f"{'ringsync +ms':>12} {'views +ms':>9} {'DDP +ms':>8} {'ringsync/DDP':>12} "
              f"{'views/DDP':>9} {'bound ms':>8} {'ringsync/bound':>14} {'views/bound':>11}")
    print(header)
    print("-" * len(header))
    goals = []
    for name, rates in results.items():
        ms = {k: 1e3 / v for k, v in rates.items() if k != "chosen"}
        extra = {k: ms[k] - ms["single"] for k in TIMED}
        print(f"{name:<11} {4 * describe(name)[1] / 1e6:>7.1f} {ms['single']:>12.2f} "
              f"{ms['together'] - ms['single']:>11.2f} {extra['ringsync']:>12.2f} "
              f"{extra['views']:>9.2f} {extra['DDP']:>8.2f} "
              f"{extra['ringsync'] / extra['DDP']:>12.2f} {extra['views'] / extra['DDP']:>9.2f} "
              f"{ms['bound']:>8.2f} {extra['ringsync'] / ms['bound']:>14.2f} "
              f"{extra['views'] / ms['bound']:>11.2f}")
        for mode in ("ringsync", "views"):
            goals.append(goal(f"{name}, {mode}: +ms / DDP's +ms <= 0.33",
                              extra[mode] / extra["DDP"], 0.33))
            if 4 * describe(name)[1] >= 1 << 20:  # (the bound of a tiny model is noise)
                goals.append(goal(f"{name}, {mode}: +ms / bound <= 1.5",
                                  extra[mode] / ms["bound"], 1.5))
    print("(+ms: a step's time beyond the single process's; no-comm: every rank stepping alone "
          "at once, no reduction;\n views: DistributedOptimizer(gradient_as_bucket_view=True))",
          flush=True)
    print("\nGoals (this run):\n" + "\n".join(goals), flush=True)
    print()
    print(f"{'model':<11} {'default steps/s':>15} {'autotuned steps/s':>17} "
          f"{'autotuned/default':>17}  chosen")
    for name, rates in results.items():
        c = rates["chosen"]
        print(f"{name:<11} {rates['default']:>15.1f} {rates['autotuned']:>17.1f} "
              f"{rates['autotuned'] / rates['default']:>17.2f}  overlap {'on' if c.overlap else 'off'}"
              f", fusion {c.fusion_threshold >> 20} MiB, cycle {c.cycle_time_ms:g} ms, one-round "
              f"<= {c.small_allreduce_bytes >> 10} KiB, staged >= "
              f"{'never' if c.staged_bytes >= 1 << 60 else f'{c.staged_bytes >> 10} KiB'}")
    print("(goal: autotuned >= default)", flush=True)


def goal(what, value, at_most):
    return f"  [{'met' if value <= at_most else 'NOT met'}] {what}: {value:.2f}"


def main():
    args = parse_args()
    torch.set_num_threads(1)  # the ranks share the host's cores
    comm = MPI.COMM_WORLD
    hvd.init(comm)
    init_torch_distributed(comm)
    results = {name: benchmark_model(comm, name, i, args) for i, name in enumerate(args.models)}
    if comm.rank == 0:
        print_table(comm, args, results)
    hvd.shutdown()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
