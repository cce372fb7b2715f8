"""Data x pipeline parallelism with ringsync process sets (2 x 2 on 4 ranks).

The ranks form a grid: 2 pipelines (data-parallel replicas) of 2 stages each.

    pipeline 0 = ranks {0, 1}     stage 0 replicas = ranks {0, 2}
    pipeline 1 = ranks {2, 3}     stage 1 replicas = ranks {1, 3}

Each row and each column is a ringsync ProcessSet. Within a pipeline, activations go
forward and gradients come back with the differentiable hvd.send / hvd.recv (GPipe
schedule: every microbatch forward, then every microbatch backward), addressed by rank
within the pipeline's set. Each pipeline trains on its own half of the batch; after
backward, a stage's gradients are averaged over its column (the replicas of that stage)
by DistributedOptimizer(process_set=column), so both replicas take the same step: the
step of one model trained on the whole batch.

Run:
    mpirun -np 4 python examples/data_pipeline_parallel.py --check

--check: every rank also trains the unsplit model in one process on the union of both
pipelines' data (mean loss); the loss of every step and each stage's final parameters must
equal it (float64, rtol 1e-10), else the job exits non-zero.
"""
import argparse
import copy
import sys

import torch

import ringsync.torch as hvd
from pipeline_parallel import parameter_differences

LAYERS, WIDTH = 4, 16
RTOL = 1e-10


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stages", type=int, default=2, help="stages per pipeline")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--batch", type=int, default=8, help="samples per pipeline per step")
    parser.add_argument("--microbatches", type=int, default=2)
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--check", action="store_true",
                        help="compare with the unsplit model trained on all the data")
    return parser.parse_args()


def full_model(seed):
    torch.manual_seed(seed)  # the same on every rank: each stage is a slice of it
    layers = []
    for _ in range(LAYERS):
        layers += [torch.nn.Linear(WIDTH, WIDTH), torch.nn.Tanh()]
    return torch.nn.Sequential(*layers).double()


def stage_of(model, stage, stages):
    per = 2 * LAYERS // stages
    return copy.deepcopy(model[stage * per:(stage + 1) * per])


def make_grid(stages):
    """(my pipeline's set, my stage's data-parallel set, pipeline no., stage no.).
    Registering a set is a collective of the whole job: every rank adds every set, in
    the same order, also the sets it is not a member of."""
    size, rank = hvd.size(), hvd.rank()
    pipelines = size // stages
    rows = [hvd.add_process_set([p * stages + s for s in range(stages)]) for p in range(pipelines)]
    cols = [hvd.add_process_set([p * stages + s for p in range(pipelines)]) for s in range(stages)]
    pipe, stage = divmod(rank, stages)
    return rows[pipe], cols[stage], pipe, stage


def whole_batch(seed, step, size):
    """Every pipeline's data of one step, concatenated; pipeline p uses its p-th part."""
    g = torch.Generator().manual_seed(seed * 1000 + step)
    x = torch.randn(size, WIDTH, generator=g, dtype=torch.float64)
    return x, torch.rand(size, WIDTH, generator=g, dtype=torch.float64) * 2 - 1


def gpipe_step(layers, pipe_set, stage, stages, inputs, targets):
    """Forward and backward of one batch (a list of microbatches) through the pipeline;
    returns the pipeline's loss on its last stage (None elsewhere)."""
    first, last, n = stage == 0, stage == stages - 1, len(inputs)
    ends = []  # per microbatch: what backward starts from (the loss, or the send's token)
    for i in range(n):
        if first:
            x = inputs[i]
        else:  # a template that requires grad (its shape and dtype: the activations')
            # makes recv part of the graph: its backward sends the gradient to stage - 1
            template = torch.empty(len(inputs[i]), WIDTH, dtype=torch.float64,
                                   requires_grad=True)
            x = hvd.recv(template, src=stage - 1, name=f"mb{i}", process_set=pipe_set)
        out = layers(x)
        if last:  # the batch's loss is the mean of the microbatches' losses
            ends.append(torch.nn.functional.mse_loss(out, targets[i]) / n)
        else:  # the token's backward receives this output's gradient from stage + 1
            ends.append(hvd.send(out, dst=stage + 1, name=f"mb{i}", process_set=pipe_set))
    # One backward per microbatch, in the same order on every stage: the gradient messages
    # are sent (and received) in that order, each one waiting for the peer's.
    for end in ends:
        torch.autograd.backward([end], None if last else [torch.zeros(0, dtype=end.dtype)])
    return sum(loss.item() for loss in ends) if last else None


def train(args, layers, pipe_set, dp_set, pipe, stage):
    opt = torch.optim.SGD(layers.parameters(), lr=args.lr)
    # Averages each gradient over the stage's replicas once all microbatches added to it
    # (one backward pass each): the mean over both pipelines' data.
    opt = hvd.DistributedOptimizer(opt, named_parameters=layers.named_parameters(),
                                   backward_passes_per_step=args.microbatches,
                                   process_set=dp_set)
    micro, losses = args.batch // args.microbatches, []
    for step in range(args.steps):
        x, y = whole_batch(args.seed, step, args.batch * dp_set.size())
        mine = slice(pipe * args.batch, (pipe + 1) * args.batch)
        opt.zero_grad()
        loss = gpipe_step(layers, pipe_set, stage, args.stages,
                          x[mine].split(micro), y[mine].split(micro))
        opt.step()
        if loss is not None:  # the last stages: the mean of the pipelines' losses
            loss = hvd.allreduce(torch.tensor(loss, dtype=torch.float64), op=hvd.Average,
                                 name=f"loss{step}", process_set=dp_set).item()
            losses.append(loss)
            if pipe == 0:
                print(f"step {step}: loss {loss:.12f}", flush=True)
    return losses


def differences(args, layers, stage, losses, replicas):
    """What differs from the unsplit model trained on all the data (empty: nothing)."""
    model = full_model(args.seed)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr)
    found = []
    for step in range(args.steps):
        x, y = whole_batch(args.seed, step, args.batch * replicas)
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        if losses and abs(losses[step] - loss.item()) > RTOL * abs(loss.item()):
            found.append(f"step {step} loss: data x pipeline {losses[step]!r}, "
                         f"unsplit {loss.item()!r}")
    return found + parameter_differences("data x pipeline", stage, layers,
                                         stage_of(model, stage, args.stages))


def main():
    args = parse_args()
    torch.set_num_threads(1)  # ranks share the host's cores
    hvd.init()
    if hvd.size() % args.stages or (2 * LAYERS) % (2 * args.stages) \
            or args.batch % args.microbatches:
        sys.exit(f"--stages {args.stages} must divide {hvd.size()} ranks and {LAYERS} "
                 f"layers, --microbatches {args.microbatches} the batch {args.batch}")
    pipe_set, dp_set, pipe, stage = make_grid(args.stages)
    layers = stage_of(full_model(args.seed), stage, args.stages)
    losses = train(args, layers, pipe_set, dp_set, pipe, stage)
    rank, failed = hvd.rank(), 0
    if args.check:
        found = differences(args, layers, stage, losses, dp_set.size())
        for line in found:
            print(f"rank {rank}: DIFFERS: {line}", file=sys.stderr, flush=True)
        failed = int(hvd.allreduce(torch.tensor([len(found)]), op=hvd.Sum, name="failed"))
        if rank == 0 and not failed:
            print(f"check passed: {dp_set.size()} pipelines x {args.stages} stages equal the "
                  f"unsplit model on all the data", flush=True)
    hvd.shutdown()
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
