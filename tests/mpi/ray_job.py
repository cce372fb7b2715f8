"""ringsync.ray's test job (tests/mpi/test_launchers.py): a Ray cluster of this process,
``RayExecutor(num_workers=2)``, and on every actor tests/common/launched_job.py's rank
code (init() from the executor's variables, the collective checks, a torch training run
that must match one process). ``python -m tests.mpi.ray_job RESULT_DIR``."""
import sys

import ray

from ringsync.ray import RayExecutor
from tests.common import launched_job


def main(result_dir: str) -> None:
    ray.init(num_cpus=2, include_dashboard=False, object_store_memory=100 << 20,
             log_to_driver=True)
    executor = RayExecutor(RayExecutor.create_settings(timeout_s=120), num_workers=2)
    executor.start()
    try:
        executor.run(launched_job.main, args=([result_dir, "collectives", "torch"],))
    finally:
        executor.shutdown()
        ray.shutdown()


if __name__ == "__main__":
    main(sys.argv[1])
