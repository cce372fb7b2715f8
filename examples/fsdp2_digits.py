"""PyTorch FSDP2 (`fully_shard`) on scikit-learn's bundled digits, on the "ringsync" backend:
each rank holds a shard of every parameter; forward gathers them, backward reduce-scatters
the gradients. Its only differences from the gloo version are the backend string and the
import that registers the backend.

    python -m torch.distributed.run --standalone --nproc-per-node 2 examples/fsdp2_digits.py
    ... examples/fsdp2_digits.py --backend gloo --check   # exit 1 below 95% test accuracy
"""
import argparse
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch.distributed.fsdp import fully_shard

import ringsync.torch.distributed  # noqa: F401  (registers the "ringsync" backend)

REQUIRED_ACCURACY = 0.95


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="ringsync")
    parser.add_argument("--epochs", type=int, default=12)
    parser.add_argument("--batch", type=int, default=64, help="global batch size")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--check", action="store_true",
                        help=f"exit with status 1 if test accuracy < {REQUIRED_ACCURACY}")
    return parser.parse_args()


class DigitsNet(torch.nn.Module):
    """Two 3x3 convolutions and a linear head for 8x8 grayscale images."""

    def __init__(self):
        super().__init__()
        self.conv1 = torch.nn.Conv2d(1, 16, 3, padding=1)
        self.conv2 = torch.nn.Conv2d(16, 32, 3, padding=1)
        self.head = torch.nn.Linear(32 * 4 * 4, 10)

    def forward(self, x):
        x = F.relu(self.conv1(x))
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)  # 8x8 -> 4x4
        return self.head(x.flatten(1))


def load_data(seed):
    """(x_train, y_train, x_test, y_test), images (N, 1, 8, 8) in [0, 1]; the same split
    on every rank."""
    digits = load_digits()
    x = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
    y = torch.tensor(digits.target, dtype=torch.long)
    x_train, x_test, y_train, y_test = train_test_split(x, y, test_size=0.25, random_state=seed)
    return x_train, y_train, x_test, y_test


def train(model, optimizer, args, x, y):
    rank, size = dist.get_rank(), dist.get_world_size()
    x, y = x[rank::size], y[rank::size]
    local_batch = max(1, args.batch // size)
    steps = (len(x) - (size - 1)) // local_batch  # the smallest shard's count, on every rank
    generator = torch.Generator().manual_seed(args.seed * 1000 + rank)
    start = time.perf_counter()
    for epoch in range(args.epochs):
        model.train()
        order = torch.randperm(len(x), generator=generator)
        for step in range(steps):
            idx = order[step * local_batch:(step + 1) * local_batch]
            optimizer.zero_grad()
            loss = F.cross_entropy(model(x[idx]), y[idx])
            loss.backward()  # FSDP2 reduce-scatters each layer's gradients
            optimizer.step()
        if rank == 0 and ((epoch + 1) % 3 == 0 or epoch + 1 == args.epochs):
            print(f"epoch {epoch + 1}: rank 0 train loss {loss.item():.4f}", flush=True)
    return steps, time.perf_counter() - start


def test_accuracy(model, x, y):
    rank, size = dist.get_rank(), dist.get_world_size()
    model.eval()
    with torch.no_grad():
        correct = (model(x[rank::size]).argmax(dim=1) == y[rank::size]).sum()
    counts = torch.tensor([int(correct), len(y[rank::size])], dtype=torch.int64)
    dist.all_reduce(counts)
    return int(counts[0]) / int(counts[1])


def main():
    args = parse_args()
    torch.set_num_threads(1)  # ranks share the host's cores
    dist.init_process_group(args.backend)
    x_train, y_train, x_test, y_test = load_data(args.seed)
    torch.manual_seed(args.seed)  # the same initial parameters on every rank, then sharded
    model = DigitsNet()
    for layer in (model.conv1, model.conv2, model.head):
        fully_shard(layer)
    fully_shard(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    steps, seconds = train(model, optimizer, args, x_train, y_train)
    accuracy = test_accuracy(model, x_test, y_test)
    if dist.get_rank() == 0:
        print(f"trained {args.epochs} epochs x {steps} steps in {seconds:.1f} s "
              f"({args.backend})")
        print(f"test accuracy on {dist.get_world_size()} ranks: {accuracy:.4f}", flush=True)
    dist.destroy_process_group()
    if args.check and accuracy < REQUIRED_ACCURACY:
        print(f"FAILED: accuracy {accuracy:.4f} < {REQUIRED_ACCURACY}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
