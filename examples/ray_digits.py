"""examples/pytorch_digits.py with its ranks as Ray actors (ringsync.ray.RayExecutor): the
same training script, unchanged, started on N actors of a Ray cluster instead of by mpirun.

    python examples/ray_digits.py --num-workers 2            # a Ray cluster of this host
    python examples/ray_digits.py --num-workers 2 --check    # exit 1 below 95% accuracy
    python examples/ray_digits.py --address auto ...         # a running Ray cluster
"""
import argparse
import os
import sys

import ray

from ringsync.ray import RayExecutor

EXAMPLES = os.path.dirname(os.path.abspath(__file__))


def train_on_this_rank(examples_dir: str, argv: list) -> float:
    """On every actor: pytorch_digits.main() as if started with argv; its test accuracy."""
    sys.path.insert(0, examples_dir)
    import pytorch_digits
    sys.argv = ["pytorch_digits.py"] + argv
    return pytorch_digits.main()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-workers", type=int, default=2)
    parser.add_argument("--address", default=None, help="ray.init's address (default: start "
                                                        "a cluster of this host)")
    args, script_args = parser.parse_known_args()
    if args.address:
        ray.init(address=args.address)
    else:
        ray.init(num_cpus=args.num_workers, include_dashboard=False,
                 object_store_memory=100 << 20)
    executor = RayExecutor(RayExecutor.create_settings(timeout_s=120),
                           num_workers=args.num_workers)
    executor.start()
    try:
        accuracies = executor.run(train_on_this_rank, args=(EXAMPLES, script_args))
        # (the actors' own lines reach this console later, if at all, through Ray's logs)
        print(f"test accuracy on {args.num_workers} Ray actors: "
              + ", ".join(f"{a:.4f}" for a in accuracies), flush=True)
    except ray.exceptions.RayError as error:  # (a rank raised, or exited: --check)
        print(error, file=sys.stderr)
        sys.exit(1)
    finally:
        executor.shutdown()
        ray.shutdown()


if __name__ == "__main__":
    main()
