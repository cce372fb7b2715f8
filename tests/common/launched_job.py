"""What every launcher's job runs (tests/mpi/test_launchers.py, tests/hosts/test_pods.py):
``python -m tests.common.launched_job RESULT_DIR [collectives] [torch] [keras]``.

The rank calls ringsync.init() with nothing but what its launcher gave it (mpirun's,
torchrun's, Slurm's or a pod's variables), checks the place it was given, runs the
collective checks of the matrix through the module API, and the torch and Keras
training runs that must match one process; then it writes RESULT_DIR/rank-<r>.json
(rank, size, local and cross places, host), which the test compares across ranks.
"""
import json
import os
import socket
import sys


def place_from_launcher():
    """(rank, local rank) as the launcher's own variables say, where it set them."""
    for rank_name, local_name in (("RANK", "LOCAL_RANK"), ("SLURM_PROCID", "SLURM_LOCALID")):
        if rank_name in os.environ:
            local = os.environ.get(local_name)
            return int(os.environ[rank_name]), None if local is None else int(local)
    return None, None


def world_and_collectives(run_checks: bool) -> dict:
    import ringsync as rs
    from tests.common import collective_checks
    rs.init()
    rank, local = place_from_launcher()
    assert rank is None or rank == rs.rank(), f"launcher says rank {rank}, init {rs.rank()}"
    assert local is None or local == rs.local_rank(), \
        f"launcher says local rank {local}, init {rs.local_rank()}"
    place = {"rank": rs.rank(), "size": rs.size(), "local_rank": rs.local_rank(),
             "local_size": rs.local_size(), "cross_rank": rs.cross_rank(),
             "cross_size": rs.cross_size(), "host": socket.gethostname()}
    if run_checks:
        for check in collective_checks.CHECKS.values():
            check(rs)
    rs.shutdown()
    return place


def main(argv):
    result_dir, parts = argv[0], set(argv[1:])
    place = world_and_collectives("collectives" in parts)
    if "torch" in parts:
        from tests.mpi import torch_bodies
        torch_bodies.training_matches_one_process()
    if "keras" in parts:
        from tests.mpi import keras_bodies
        keras_bodies.fit_matches_one_process()
    path = os.path.join(result_dir, f"rank-{place['rank']}.json")
    with open(path + ".part", "w") as f:
        json.dump(dict(place, parts=sorted(parts)), f)
    os.replace(path + ".part", path)


if __name__ == "__main__":
    main(sys.argv[1:])
