"""Tensor parallelism (Megatron-style) with ringsync's allreduce over a process set.

The MLP block Y = RowParallel(tanh(ColumnParallel(X))) runs on the ranks of one
tensor-parallel group, each holding a slice of both weight matrices:

  ColumnParallel  the first Linear's output features are split: rank r holds rows
                  r*h..(r+1)*h of its weight (and of its bias) and computes its h
                  columns of the hidden activations. No communication in forward.
  RowParallel     the second Linear's input features are split the same way, so rank r
                  multiplies exactly its hidden columns: each rank gets a partial sum of
                  Y, and one allreduce (Sum) of the partial sums gives Y on every rank.

Backward is the mirror image: the gradient of Y is already on every rank (nothing to do),
while the gradient of X gets a contribution from every rank's columns and is allreduced.
Two small autograd Functions carry these: copy_to_region (forward identity, backward
allreduce) and reduce_from_region (forward allreduce, backward identity).

--tp-size T splits the ranks into groups of T consecutive ranks (default: all ranks),
one ringsync ProcessSet each; each group trains on its own data. Run:
    mpirun -np 4 python examples/tensor_parallel.py --check
    mpirun -np 4 python examples/tensor_parallel.py --tp-size 2 --check

--check: every rank also runs the dense block in one process; outputs, loss, gradients
(of X and of this rank's slices) and the updated parameters after every SGD step must
equal it (float64, rtol 1e-10), else the job exits non-zero.
"""
import argparse
import sys

import torch

import ringsync.torch as hvd

RTOL = 1e-10


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tp-size", type=int, default=0, help="ranks per group (0: all)")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--dim", type=int, default=12, help="model width (X and Y)")
    parser.add_argument("--hidden", type=int, default=32, help="hidden width, split over the group")
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--check", action="store_true",
                        help="compare with the dense block computed in one process")
    return parser.parse_args()


class CopyToRegion(torch.autograd.Function):
    """Enter the tensor-parallel region: every rank uses the whole X, so X's gradient is
    the sum of every rank's contribution."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return hvd.allreduce(grad, op=hvd.Sum, process_set=ctx.group), None


class ReduceFromRegion(torch.autograd.Function):
    """Leave the region: sum the ranks' partial outputs. Each rank's partial output
    reaches the sum with weight 1, so its gradient is the incoming one, unchanged."""

    @staticmethod
    def forward(ctx, partial, group):
        return hvd.allreduce(partial, op=hvd.Sum, process_set=group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class ParallelMLP(torch.nn.Module):
    """This rank's slices of the dense block (fc1: Column-, fc2: Row-parallel)."""

    def __init__(self, dense, group):
        super().__init__()
        self.group = group
        rank, size = group.rank(), group.size()
        h = dense.fc1.out_features // size
        mine = slice(rank * h, (rank + 1) * h)
        with torch.no_grad():  # copies of our slices, so that they are our own leaves
            self.fc1_weight = torch.nn.Parameter(dense.fc1.weight[mine].clone())
            self.fc1_bias = torch.nn.Parameter(dense.fc1.bias[mine].clone())
            self.fc2_weight = torch.nn.Parameter(dense.fc2.weight[:, mine].clone())
            # fc2's bias is whole on every rank and added once, after the sum (added to
            # each partial sum it would count size times).
            self.fc2_bias = torch.nn.Parameter(dense.fc2.bias.clone())
        self.mine = mine

    def forward(self, x):
        x = CopyToRegion.apply(x, self.group)
        hidden = torch.tanh(torch.nn.functional.linear(x, self.fc1_weight, self.fc1_bias))
        partial = torch.nn.functional.linear(hidden, self.fc2_weight)
        return ReduceFromRegion.apply(partial, self.group) + self.fc2_bias

    def dense_slices(self, dense, grads=False):
        """The dense block's tensors (or their gradients) that correspond to ours."""
        pick = (lambda p: p.grad) if grads else (lambda p: p.detach())
        w1, b1, w2, b2 = map(pick, (dense.fc1.weight, dense.fc1.bias, dense.fc2.weight,
                                    dense.fc2.bias))
        return {"fc1_weight": w1[self.mine], "fc1_bias": b1[self.mine],
                "fc2_weight": w2[:, self.mine], "fc2_bias": b2}


class DenseMLP(torch.nn.Module):
    def __init__(self, dim, hidden):
        super().__init__()
        self.fc1, self.fc2 = torch.nn.Linear(dim, hidden), torch.nn.Linear(hidden, dim)

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc1(x)))


def tp_group(tp_size):
    """Groups of tp_size consecutive ranks, one ProcessSet each: every rank registers
    every group, in the same order (add_process_set is a collective of the job)."""
    size = hvd.size()
    if tp_size in (0, size):
        return hvd.global_process_set, 0
    groups = [hvd.add_process_set(list(range(g, g + tp_size))) for g in range(0, size, tp_size)]
    return groups[hvd.rank() // tp_size], hvd.rank() // tp_size


def batch(seed, step, args):
    g = torch.Generator().manual_seed(seed * 1000 + step)
    x = torch.randn(args.batch, args.dim, generator=g, dtype=torch.float64)
    return x.requires_grad_(), torch.randn(args.batch, args.dim, generator=g, dtype=torch.float64)


class Checker:
    """Collects what differs between the tensor-parallel and the dense tensors."""

    def __init__(self, enabled):
        self.enabled, self.found = enabled, []

    def same(self, what, ours, dense):
        if self.enabled and not torch.allclose(ours, dense, rtol=RTOL, atol=0):
            worst = (ours - dense).abs().argmax()
            self.found.append(f"{what}: tensor-parallel {ours.flatten()[worst].item()!r}, "
                              f"dense {dense.flatten()[worst].item()!r}")


def train(args, group, data_seed, check):
    torch.manual_seed(args.seed)  # the same dense block on every rank: we take our slices
    dense = DenseMLP(args.dim, args.hidden).double()
    model = ParallelMLP(dense, group)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr)
    dense_opt = torch.optim.SGD(dense.parameters(), lr=args.lr)
    for step in range(args.steps):
        x, y = batch(data_seed, step, args)
        opt.zero_grad()
        out = model(x)
        loss = torch.nn.functional.mse_loss(out, y)
        loss.backward()
        opt.step()
        if hvd.rank() == 0:
            print(f"step {step}: loss {loss.item():.12f}", flush=True)
        if args.check:  # the same step, dense, on a copy of the same data
            x_dense = x.detach().clone().requires_grad_()
            dense_opt.zero_grad()
            dense_out = dense(x_dense)
            dense_loss = torch.nn.functional.mse_loss(dense_out, y)
            dense_loss.backward()
            check.same(f"step {step} output", out, dense_out)
            check.same(f"step {step} loss", loss, dense_loss)
            check.same(f"step {step} gradient of X", x.grad, x_dense.grad)
            dense_grads = model.dense_slices(dense, grads=True)
            for name, p in model.named_parameters():
                check.same(f"step {step} gradient of {name}", p.grad, dense_grads[name])
            dense_opt.step()
            updated = model.dense_slices(dense)
            for name, p in model.named_parameters():
                check.same(f"step {step} updated {name}", p, updated[name])


def main():
    args = parse_args()
    torch.set_num_threads(1)  # ranks share the host's cores
    hvd.init()
    tp_size = args.tp_size or hvd.size()
    if hvd.size() % tp_size or args.hidden % tp_size:
        sys.exit(f"--tp-size {tp_size} must divide the {hvd.size()} ranks and "
                 f"--hidden {args.hidden}")
    group, group_no = tp_group(tp_size)
    check = Checker(args.check)
    train(args, group, args.seed + group_no, check)  # each group: its own data
    rank = hvd.rank()
    for line in check.found:
        print(f"rank {rank}: DIFFERS: {line}", file=sys.stderr, flush=True)
    failed = int(hvd.allreduce(torch.tensor([len(check.found)]), op=hvd.Sum, name="failed"))
    if args.check and rank == 0 and not failed:
        print(f"check passed: tensor-parallel groups of {tp_size} equal the dense block",
              flush=True)
    hvd.shutdown()
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
