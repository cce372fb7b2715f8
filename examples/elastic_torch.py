"""Elastic data-parallel training on scikit-learn's bundled digits: survives a lost rank.

The model, optimizer, epoch and data sampler live in a TorchState, committed every few
batches. When a rank dies, the survivors roll back to the last commit, reshard what is
left of the epoch over themselves (ElasticSampler), rescale the learning rate, and go on.
`--kill RANK:STEP` makes that rank SIGKILL itself at that step, to watch it happen:

    ringsync run --elastic -np 4 --min-np 2 examples/elastic_torch.py --kill 2:30
    ringsync run --elastic --respawn -np 4 examples/elastic_torch.py --kill 2:30
    mpirun --with-ft ulfm -np 3 python examples/elastic_torch.py --kill 1:20 --check
"""
import argparse
import os
import signal
import sys
import time

import torch
import torch.nn.functional as F

import ringsync.torch as hvd

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from pytorch_digits import DigitsNet, load_data, test_accuracy  # noqa: E402

REQUIRED_ACCURACY = 0.95


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--batch", type=int, default=16, help="batch size per rank")
    parser.add_argument("--lr", type=float, default=0.0125,
                        help="learning rate per rank (the step uses lr x size())")
    parser.add_argument("--commit-every", type=int, default=10, help="batches between commits")
    parser.add_argument("--kill", metavar="RANK:STEP",
                        help="the rank with this original rank SIGKILLs itself at this step")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--check", action="store_true",
                        help=f"exit with status 1 if test accuracy < {REQUIRED_ACCURACY}")
    return parser.parse_args()


def kill_plan(text):
    """(original rank, step) of the simulated failure, or (None, None)."""
    if not text:
        return None, None
    rank, step = text.split(":")
    return int(rank), int(step)


def main():
    args = parse_args()
    torch.set_num_threads(1)
    from mpi4py import MPI
    replacement = MPI.Comm.Get_parent() != MPI.COMM_NULL  # started by --respawn
    hvd.init()
    original_rank = None if replacement else hvd.rank()
    victim, kill_step = kill_plan(args.kill)
    x_train, y_train, x_test, y_test = load_data(args.seed)
    dataset = torch.utils.data.TensorDataset(x_train, y_train)

    torch.manual_seed(args.seed + hvd.rank())  # sync() makes rank 0's parameters everyone's
    model = DigitsNet()
    optimizer = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=args.lr * hvd.size(), momentum=0.9),
        named_parameters=model.named_parameters())
    sampler = hvd.elastic.ElasticSampler(dataset, shuffle=True, seed=args.seed)
    state = hvd.elastic.TorchState(model, optimizer, sampler=sampler, epoch=0, step=0)

    def rescale_learning_rate():
        for group in optimizer.param_groups:
            group["lr"] = args.lr * hvd.size()
        if hvd.rank() == 0:
            print(f"reset: {hvd.size()} ranks now, back at step {state.step}", flush=True)

    state.register_reset_callbacks([rescale_learning_rate])

    @hvd.elastic.run
    def train(state):
        while state.epoch < args.epochs:
            state.sampler.set_epoch(state.epoch)
            loader = torch.utils.data.DataLoader(dataset, batch_size=args.batch,
                                                 sampler=state.sampler)
            model.train()
            for batch_idx, (x, y) in enumerate(loader):  # what is left of the epoch
                if original_rank == victim and state.step == kill_step:
                    print(f"rank {original_rank}: simulated failure at step {state.step}",
                          flush=True)
                    os.kill(os.getpid(), signal.SIGKILL)
                optimizer.zero_grad()
                F.cross_entropy(model(x), y).backward()
                optimizer.step()
                state.step += 1
                state.sampler.record_batch(batch_idx, args.batch)
                if batch_idx % args.commit_every == args.commit_every - 1:
                    state.commit()
            state.epoch += 1
            state.sampler.set_epoch(state.epoch)
            state.commit()
            if hvd.rank() == 0:
                print(f"epoch {state.epoch} done on {hvd.size()} ranks", flush=True)

    start = time.perf_counter()
    train(state)
    accuracy = test_accuracy(model, x_test, y_test)
    is_root = hvd.rank() == 0
    if is_root:
        print(f"trained {state.step} steps in {time.perf_counter() - start:.1f} s; "
              f"test accuracy on {hvd.size()} ranks: {accuracy:.4f}", flush=True)
    hvd.shutdown()
    if args.check and accuracy < REQUIRED_ACCURACY:
        if is_root:
            print(f"FAILED: accuracy {accuracy:.4f} < {REQUIRED_ACCURACY}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
