"""A Horovod-style PyTorch training script, written the way Horovod's pytorch_mnist.py
example is (argument names, DistributedSampler, metric averaging, --use-adasum,
--fp16-allreduce), with only the import changed: `import ringsync.torch as hvd`.

MNIST would need a download; this trains on scikit-learn's bundled 8x8 digits instead,
upsampled to MNIST's 28x28, so it runs anywhere. Run with:

    ringsync run -np 2 examples/pytorch_mnist.py
    ringsync run -np 2 examples/pytorch_mnist.py --use-adasum
    mpirun -np 2 python examples/pytorch_mnist.py --check   # exit 1 below 90% accuracy
"""
import argparse
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.optim as optim
import torch.utils.data.distributed
from sklearn.datasets import load_digits

import ringsync.torch as hvd

REQUIRED_ACCURACY = 0.90

parser = argparse.ArgumentParser(description="PyTorch digits example (Horovod style)")
parser.add_argument("--batch-size", type=int, default=32, help="input batch size per rank")
parser.add_argument("--test-batch-size", type=int, default=200, help="test batch size")
parser.add_argument("--epochs", type=int, default=8, help="number of epochs to train")
parser.add_argument("--lr", type=float, default=0.02, help="learning rate (one rank)")
parser.add_argument("--momentum", type=float, default=0.5, help="SGD momentum")
parser.add_argument("--no-cuda", action="store_true", default=False, help="disables CUDA")
parser.add_argument("--seed", type=int, default=42, help="random seed")
parser.add_argument("--log-interval", type=int, default=10,
                    help="batches to wait before logging training status")
parser.add_argument("--fp16-allreduce", action="store_true", default=False,
                    help="use fp16 compression during allreduce")
parser.add_argument("--use-adasum", action="store_true", default=False,
                    help="use adasum algorithm to do reduction")
parser.add_argument("--gradient-predivide-factor", type=float, default=1.0,
                    help="apply gradient predivide factor in optimizer (default: 1.0)")
parser.add_argument("--check", action="store_true",
                    help=f"exit with status 1 if test accuracy < {REQUIRED_ACCURACY}")


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 10, kernel_size=5)
        self.conv2 = nn.Conv2d(10, 20, kernel_size=5)
        self.conv2_drop = nn.Dropout2d()
        self.fc1 = nn.Linear(320, 50)
        self.fc2 = nn.Linear(50, 10)

    def forward(self, x):
        x = F.relu(F.max_pool2d(self.conv1(x), 2))
        x = F.relu(F.max_pool2d(self.conv2_drop(self.conv2(x)), 2))
        x = x.view(-1, 320)
        x = F.relu(self.fc1(x))
        x = F.dropout(x, training=self.training)
        return F.log_softmax(self.fc2(x), dim=1)


def digits_datasets():
    """Bundled 8x8 digits, upsampled to 28x28 and normalised; 1500 train, the rest test."""
    digits = load_digits()
    images = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
    images = F.interpolate(images, size=(28, 28), mode="bilinear", align_corners=False)
    images = (images - images.mean()) / images.std()
    labels = torch.tensor(digits.target, dtype=torch.int64)
    generator = torch.Generator().manual_seed(0)
    order = torch.randperm(len(labels), generator=generator)
    train, test = order[:1500], order[1500:]
    return (torch.utils.data.TensorDataset(images[train], labels[train]),
            torch.utils.data.TensorDataset(images[test], labels[test]))


def metric_average(val, name):
    tensor = torch.tensor(val)
    avg_tensor = hvd.allreduce(tensor, name=name)
    return avg_tensor.item()


def train(epoch, model, optimizer, train_loader, train_sampler, args):
    model.train()
    train_sampler.set_epoch(epoch)  # a different shuffle each epoch, the same on all ranks
    for batch_idx, (data, target) in enumerate(train_loader):
        optimizer.zero_grad()
        loss = F.nll_loss(model(data), target)
        loss.backward()
        optimizer.step()
        if batch_idx % args.log_interval == 0 and hvd.rank() == 0:
            print(f"Train Epoch: {epoch} [{batch_idx * len(data)}/{len(train_sampler)} "
                  f"({100.0 * batch_idx / len(train_loader):.0f}%)]\tLoss: {loss.item():.6f}")


def test(model, test_loader, test_sampler):
    model.eval()
    test_loss, test_accuracy = 0.0, 0.0
    with torch.no_grad():
        for data, target in test_loader:
            output = model(data)
            test_loss += F.nll_loss(output, target, reduction="sum").item()
            pred = output.data.max(1, keepdim=True)[1]
            test_accuracy += pred.eq(target.data.view_as(pred)).float().sum().item()
    test_loss /= len(test_sampler)
    test_accuracy /= len(test_sampler)
    test_loss = metric_average(test_loss, "avg_loss")
    test_accuracy = metric_average(test_accuracy, "avg_accuracy")
    if hvd.rank() == 0:
        print(f"\nTest set: Average loss: {test_loss:.4f}, Accuracy: {100.0 * test_accuracy:.2f}%\n")
    return test_accuracy


def main():
    args = parser.parse_args()
    hvd.init()
    torch.manual_seed(args.seed)
    torch.set_num_threads(1)

    train_dataset, test_dataset = digits_datasets()
    train_sampler = torch.utils.data.distributed.DistributedSampler(
        train_dataset, num_replicas=hvd.size(), rank=hvd.rank())
    train_loader = torch.utils.data.DataLoader(train_dataset, batch_size=args.batch_size,
                                               sampler=train_sampler)
    test_sampler = torch.utils.data.distributed.DistributedSampler(
        test_dataset, num_replicas=hvd.size(), rank=hvd.rank())
    test_loader = torch.utils.data.DataLoader(test_dataset, batch_size=args.test_batch_size,
                                              sampler=test_sampler)

    model = Net()
    # Adasum needs no learning-rate scaling; averaging scales it by the number of ranks.
    lr_scaler = 1 if args.use_adasum else hvd.size()
    optimizer = optim.SGD(model.parameters(), lr=args.lr * lr_scaler, momentum=args.momentum)

    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)

    compression = hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none
    optimizer = hvd.DistributedOptimizer(optimizer,
                                         named_parameters=model.named_parameters(),
                                         compression=compression,
                                         op=hvd.Adasum if args.use_adasum else hvd.Average,
                                         gradient_predivide_factor=args.gradient_predivide_factor)

    accuracy = 0.0
    for epoch in range(1, args.epochs + 1):
        train(epoch, model, optimizer, train_loader, train_sampler, args)
        accuracy = test(model, test_loader, test_sampler)
    hvd.shutdown()
    if args.check and accuracy < REQUIRED_ACCURACY:
        print(f"accuracy {accuracy:.3f} is below {REQUIRED_ACCURACY}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
