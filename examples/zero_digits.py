"""pytorch_digits.py's training with ZeRO sharding: each rank keeps only its share of the
optimizer state (stage 1), of the gradients too (stage 2), or of the parameters as well
(stage 3, ShardedModule), and reaches the same accuracy. Run on 2 ranks with:

    ringsync run -np 2 examples/zero_digits.py --stage 2
    mpirun -np 2 python examples/zero_digits.py --stage 3 --check   # exit 1 below 95%
"""
import argparse

import torch

import ringsync.torch as hvd
from pytorch_digits import (REQUIRED_ACCURACY, DigitsNet, exit_unless_accurate, load_data,
                            test_accuracy, train)


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stage", type=int, choices=(1, 2, 3), default=2)
    parser.add_argument("--epochs", type=int, default=12)
    parser.add_argument("--batch", type=int, default=64, help="global batch size")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--check", action="store_true",
                        help=f"exit with status 1 if test accuracy < {REQUIRED_ACCURACY}")
    return parser.parse_args()


def sharded_model_and_optimizer(stage, lr):
    """The model as trained and its ShardedOptimizer. Stage 3 wraps the model: its
    parameters become this rank's slices (ShardedModule starts every rank from rank 0's
    parameters); stages 1 and 2 wrap the optimizer, after rank 0's parameters have been
    broadcast (the shards' master copies are taken from them)."""
    torch.manual_seed(hvd.rank())  # ranks start from different parameters, rank 0's win
    model = DigitsNet()
    if stage == 3:
        model = hvd.ShardedModule(model)
    else:
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    return model, hvd.ShardedOptimizer(optimizer, stage=stage)


def main():
    args = parse_args()
    torch.set_num_threads(1)
    hvd.init()
    x_train, y_train, x_test, y_test = load_data(args.seed)
    model, optimizer = sharded_model_and_optimizer(args.stage, args.lr)
    steps, train_seconds = train(model, optimizer, args, x_train, y_train)
    memory = optimizer.memory()
    accuracy = test_accuracy(model, x_test, y_test)
    is_root = hvd.rank() == 0
    if is_root:
        held = ", ".join(f"{kind} {n / 1024:.1f} KiB" for kind, n in memory.items())
        print(f"stage {args.stage}: trained {args.epochs} epochs x {steps} steps in "
              f"{train_seconds:.1f} s; rank 0 holds {held}")
        print(f"test accuracy on {hvd.size()} ranks: {accuracy:.4f}", flush=True)
    hvd.shutdown()
    exit_unless_accurate(accuracy, args.check, is_root)


if __name__ == "__main__":
    main()
