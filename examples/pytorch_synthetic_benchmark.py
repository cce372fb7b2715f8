"""A Horovod-style synthetic benchmark (as Horovod's pytorch_synthetic_benchmark.py is
written: the same flags and output), with only the import changed. torchvision's models
are not assumed to be installed: --model picks a small built-in CNN or MLP instead.

    ringsync run -np 2 examples/pytorch_synthetic_benchmark.py --num-iters 5
"""
import argparse
import timeit

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.optim as optim

import ringsync.torch as hvd

parser = argparse.ArgumentParser(description="PyTorch Synthetic Benchmark (Horovod style)",
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
parser.add_argument("--fp16-allreduce", action="store_true", default=False,
                    help="use fp16 compression during allreduce")
parser.add_argument("--model", type=str, default="cnn", choices=["cnn", "mlp"],
                    help="model to benchmark")
parser.add_argument("--batch-size", type=int, default=32, help="input batch size")
parser.add_argument("--num-warmup-batches", type=int, default=3,
                    help="number of warm-up batches that don't count towards benchmark")
parser.add_argument("--num-batches-per-iter", type=int, default=5,
                    help="number of batches per benchmark iteration")
parser.add_argument("--num-iters", type=int, default=5, help="number of benchmark iterations")
parser.add_argument("--no-cuda", action="store_true", default=False, help="disables CUDA")
parser.add_argument("--use-adasum", action="store_true", default=False,
                    help="use adasum algorithm to do reduction")


class SmallCNN(nn.Module):
    """Four conv layers and a classifier on 64x64 RGB images (about 1.2 M parameters)."""

    def __init__(self, classes=100):
        super().__init__()
        self.convs = nn.ModuleList([nn.Conv2d(3, 32, 3, padding=1), nn.Conv2d(32, 64, 3, padding=1),
                                    nn.Conv2d(64, 128, 3, padding=1),
                                    nn.Conv2d(128, 128, 3, padding=1)])
        self.fc = nn.Linear(128 * 4 * 4, 512)
        self.head = nn.Linear(512, classes)

    def forward(self, x):
        for conv in self.convs:
            x = F.max_pool2d(F.relu(conv(x)), 2)
        return self.head(F.relu(self.fc(x.flatten(1))))


def make_model(name):
    if name == "mlp":
        return nn.Sequential(nn.Flatten(), nn.Linear(3 * 64 * 64, 1024), nn.ReLU(),
                             nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 100))
    return SmallCNN()


def main():
    args = parser.parse_args()
    args.cuda = not args.no_cuda and torch.cuda.is_available()
    hvd.init()
    if args.cuda:
        torch.cuda.set_device(hvd.local_rank())
    torch.set_num_threads(1)
    torch.manual_seed(0)

    model = make_model(args.model)
    if args.cuda:
        model.cuda()
    lr_scaler = 1 if args.use_adasum else hvd.size()
    optimizer = optim.SGD(model.parameters(), lr=0.01 * lr_scaler)
    compression = hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                         compression=compression,
                                         op=hvd.Adasum if args.use_adasum else hvd.Average)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)

    data = torch.randn(args.batch_size, 3, 64, 64)
    target = torch.LongTensor(args.batch_size).random_() % 100
    if args.cuda:
        data, target = data.cuda(), target.cuda()

    def benchmark_step():
        optimizer.zero_grad()
        loss = F.cross_entropy(model(data), target)
        loss.backward()
        optimizer.step()

    def log(s, nl=True):
        if hvd.rank() == 0:
            print(s, end="\n" if nl else "", flush=True)

    device = "GPU" if args.cuda else "CPU"
    log(f"Model: {args.model}")
    log(f"Batch size: {args.batch_size}")
    log(f"Number of {device}s: {hvd.size()}")
    log("Running warmup...")
    timeit.timeit(benchmark_step, number=args.num_warmup_batches)
    log("Running benchmark...")
    img_secs = []
    for x in range(args.num_iters):
        elapsed = timeit.timeit(benchmark_step, number=args.num_batches_per_iter)
        img_sec = args.batch_size * args.num_batches_per_iter / elapsed
        log(f"Iter #{x}: {img_sec:.1f} img/sec per {device}")
        img_secs.append(img_sec)
    img_sec_mean, img_sec_conf = np.mean(img_secs), 1.96 * np.std(img_secs)
    log(f"Img/sec per {device}: {img_sec_mean:.1f} +-{img_sec_conf:.1f}")
    log(f"Total img/sec on {hvd.size()} {device}(s): {hvd.size() * img_sec_mean:.1f} "
        f"+-{hvd.size() * img_sec_conf:.1f}")
    hvd.shutdown()


if __name__ == "__main__":
    main()
