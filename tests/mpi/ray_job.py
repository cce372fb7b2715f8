"""ringsync.ray's test job (tests/mpi/test_launchers.py): a Ray cluster of this process,
``RayExecutor(num_workers=2)``, and on every actor tests/common/launched_job.py's rank
code (init() from the executor's variables, the collective checks, a torch training run
that must match one process); then execute() on each actor's executable_cls, made after
the extra variables were set. ``python -m tests.mpi.ray_job RESULT_DIR``."""
import os
import sys

import ray

from ringsync.ray import RayExecutor
from tests.common import launched_job


class Probe:
    """Horovod's executable_cls: made on every actor after its variables are set."""

    def __init__(self, value):
        self.value, self.rank = value, os.environ["RANK"]
        self.tag = os.environ["RINGSYNC_TEST_TAG"]


def main(result_dir: str) -> None:
    ray.init(num_cpus=2, include_dashboard=False, object_store_memory=100 << 20,
             log_to_driver=True)
    executor = RayExecutor(RayExecutor.create_settings(timeout_s=120), num_workers=2)
    executor.start(executable_cls=Probe, executable_args=[7],
                   extra_env_vars={"RINGSYNC_TEST_TAG": "from the driver"})
    try:
        executor.run(launched_job.main, args=([result_dir, "collectives", "torch"],))
        seen = executor.execute(lambda probe: (probe.value, probe.rank, probe.tag))
        assert seen == [(7, "0", "from the driver"), (7, "1", "from the driver")], seen
    finally:
        executor.shutdown()
        ray.shutdown()


if __name__ == "__main__":
    main(sys.argv[1])
