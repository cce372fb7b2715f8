"""Data-parallel training of a small CNN on scikit-learn's bundled digits, with PyTorch.

Each rank trains on every size()-th sample of the training set; ringsync's
DistributedOptimizer averages the gradients over all ranks while backward() runs, so
every rank takes the same step. Run on 2 ranks with:

    ringsync run -np 2 examples/pytorch_digits.py
    mpirun -np 2 python examples/pytorch_digits.py --check   # exit 1 below 95% accuracy
"""
import argparse
import sys
import time

import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

import ringsync.torch as hvd

REQUIRED_ACCURACY = 0.95


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=12)
    parser.add_argument("--batch", type=int, default=64,
                        help="global batch size, split across ranks (rounded down to a multiple)")
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
    """(x_train, y_train, x_test, y_test) as tensors, images shaped (N, 1, 8, 8) in [0, 1].
    The split depends on the seed only, so every rank sees the same split."""
    digits = load_digits()
    x = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
    y = torch.tensor(digits.target, dtype=torch.long)
    x_train, x_test, y_train, y_test = train_test_split(x, y, test_size=0.25, random_state=seed)
    return x_train, y_train, x_test, y_test


def my_shard(*tensors):
    """This rank's part: every size()-th sample, starting at rank()."""
    return [t[hvd.rank()::hvd.size()] for t in tensors]


def steps_per_epoch(n_train, local_batch):
    """The same count on every rank (each allreduce needs every rank): the smallest
    shard holds n_train // size() samples."""
    return (n_train // hvd.size()) // local_batch


def train_epoch(model, optimizer, x, y, local_batch, steps, generator):
    model.train()
    order = torch.randperm(len(x), generator=generator)
    total_loss = 0.0
    for step in range(steps):
        idx = order[step * local_batch:(step + 1) * local_batch]
        optimizer.zero_grad()
        loss = F.cross_entropy(model(x[idx]), y[idx])
        loss.backward()  # starts each gradient's allreduce as soon as it is ready
        optimizer.step()  # waits for the averaged gradients, then steps
        total_loss += loss.item()
    return total_loss / steps


def test_accuracy(model, x_test, y_test):
    """Accuracy over the whole test set: each rank scores its shard, counts are summed."""
    model.eval()
    x_mine, y_mine = my_shard(x_test, y_test)
    with torch.no_grad():
        correct = (model(x_mine).argmax(dim=1) == y_mine).sum()
    counts = torch.tensor([int(correct), len(y_mine)], dtype=torch.int64)
    counts = hvd.allreduce(counts, op=hvd.Sum, name="test.counts")
    return int(counts[0]) / int(counts[1])


def train(model, optimizer, args, x_train, y_train):
    """args.epochs epochs on this rank's shard of the training set, a loss line every 3
    epochs from rank 0; returns (steps per epoch, seconds taken)."""
    local_batch = max(1, args.batch // hvd.size())
    x_mine, y_mine = my_shard(x_train, y_train)
    steps = steps_per_epoch(len(x_train), local_batch)
    generator = torch.Generator().manual_seed(args.seed * 1000 + hvd.rank())
    start = time.perf_counter()
    for epoch in range(args.epochs):
        loss = train_epoch(model, optimizer, x_mine, y_mine, local_batch, steps, generator)
        if hvd.rank() == 0 and ((epoch + 1) % 3 == 0 or epoch + 1 == args.epochs):
            print(f"epoch {epoch + 1}: rank 0 train loss {loss:.4f}", flush=True)
    return steps, time.perf_counter() - start


def exit_unless_accurate(accuracy, check, is_root):
    """With --check, status 1 below REQUIRED_ACCURACY. Every rank knows the summed
    accuracy, so every rank exits with the same status."""
    if check and accuracy < REQUIRED_ACCURACY:
        if is_root:
            print(f"FAILED: accuracy {accuracy:.4f} < {REQUIRED_ACCURACY}", file=sys.stderr)
        sys.exit(1)


def main():
    args = parse_args()
    torch.set_num_threads(1)  # ranks share the host's cores; more threads only contend
    hvd.init()
    # (train() keeps the global batch, and so the learning rate's meaning, as ranks are added)
    x_train, y_train, x_test, y_test = load_data(args.seed)

    torch.manual_seed(args.seed + hvd.rank())  # ranks start from different parameters ...
    model = DigitsNet()
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)  # ... and rank 0's win
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)

    steps, train_seconds = train(model, optimizer, args, x_train, y_train)
    accuracy = test_accuracy(model, x_test, y_test)
    is_root = hvd.rank() == 0  # remembered: rank() needs the ring, which shutdown() closes
    if is_root:
        print(f"trained {args.epochs} epochs x {steps} steps in {train_seconds:.1f} s")
        print(f"test accuracy on {hvd.size()} ranks: {accuracy:.4f}", flush=True)
    hvd.shutdown()
    exit_unless_accurate(accuracy, args.check, is_root)
    return accuracy


if __name__ == "__main__":
    main()
