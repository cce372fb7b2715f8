"""Ranks as Ray actors (Horovod's ``horovod.ray.RayExecutor``, which Ray itself dropped):

    from ringsync.ray import RayExecutor

    executor = RayExecutor(RayExecutor.create_settings(timeout_s=60), num_workers=4)
    executor.start()
    results = executor.run(train)        # train() calls hvd.init(); one result per rank
    executor.shutdown()

The driver serves the job's store (ringsync.store, the secret made here and handed to
the actors through Ray, never on a command line); each actor gets RINGSYNC_RENDEZVOUS,
RANK, WORLD_SIZE, LOCAL_RANK and torch.distributed's MASTER_ADDR / MASTER_PORT before the
function runs, so ``ringsync.init()`` (and ``dist.init_process_group``) inside it find the
world as under any other launcher. Needs ``pip install ray``; Ray must be initialised
(``ray.init()``) before start().
"""
import os
import secrets
import socket
from typing import Any, Callable, Dict, List, Optional

from .errors import UsageError
from .store import StoreServer


class _Settings:
    """What create_settings() gives (Horovod's signature): timeout_s bounds init()."""

    def __init__(self, timeout_s: float = 120.0, placement_group_timeout_s: float = 100.0):
        self.timeout_s, self.placement_group_timeout_s = timeout_s, placement_group_timeout_s


class _Worker:
    """One rank: a Ray actor that keeps the job's variables and runs functions."""

    def node(self):
        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        import ray
        return socket.gethostname(), ray.util.get_node_ip_address(), port

    def update_env(self, values: Dict[str, str]) -> None:
        os.environ.update(values)

    def execute(self, fn: Callable, args, kwargs):
        return fn(*args, **kwargs)

    def execute_on(self, fn: Callable):
        return fn(self)


class RayExecutor:
    """num_workers ranks as Ray actors with cpus_per_worker CPUs each (GPUs: use_gpu and
    gpus_per_worker, handed to Ray's scheduling only; ringsync moves host memory)."""

    @staticmethod
    def create_settings(timeout_s: float = 120.0, ssh_identity_file=None, ssh_str=None,
                        placement_group_timeout_s: float = 100.0, nics=None) -> _Settings:
        """Horovod's signature; ssh_identity_file, ssh_str and nics have no use here (the
        actors are Ray's; RINGSYNC_IFACE chooses interfaces)."""
        return _Settings(timeout_s, placement_group_timeout_s)

    def __init__(self, settings: Optional[_Settings] = None, num_workers: Optional[int] = None,
                 cpus_per_worker: float = 1, use_gpu: bool = False,
                 gpus_per_worker: Optional[float] = None):
        if not num_workers or num_workers < 1:
            raise UsageError(f"ringsync.ray.RayExecutor: num_workers must be at least 1, got "
                             f"{num_workers!r}")
        self.settings = settings or _Settings()
        self.num_workers, self.cpus_per_worker = num_workers, cpus_per_worker
        self.gpus_per_worker = (gpus_per_worker or 1) if use_gpu else 0
        self.workers: List[Any] = []
        self._server: Optional[StoreServer] = None

    def start(self) -> None:
        """Start the actors and the store, and give every actor its variables."""
        import ray
        if not ray.is_initialized():
            raise UsageError("ringsync.ray.RayExecutor.start: call ray.init() first")
        secret = secrets.token_hex(32)
        self._server = StoreServer(secret.encode(), "0.0.0.0", 0,
                                   served_by="the Ray driver on " + socket.gethostname())
        self._server.start()
        actor = ray.remote(num_cpus=self.cpus_per_worker, num_gpus=self.gpus_per_worker)(_Worker)
        self.workers = [actor.remote() for _ in range(self.num_workers)]
        nodes = ray.get([w.node.remote() for w in self.workers],
                        timeout=self.settings.placement_group_timeout_s)
        store = "tcp://%s:%d" % (ray.util.get_node_ip_address(), self._server.address[1])
        ray.get([w.update_env.remote(self._variables(rank, nodes, store, secret))
                 for rank, w in enumerate(self.workers)])

    def _variables(self, rank: int, nodes, store: str, secret: str) -> Dict[str, str]:
        hosts = [host for host, _, _ in nodes]
        return {"RINGSYNC_RENDEZVOUS": store, "RINGSYNC_SECRET": secret,
                "RINGSYNC_START_TIMEOUT_SECONDS": str(self.settings.timeout_s),
                "RANK": str(rank), "WORLD_SIZE": str(len(nodes)),
                "LOCAL_RANK": str(hosts[:rank].count(hosts[rank])),
                "LOCAL_WORLD_SIZE": str(hosts.count(hosts[rank])),
                "MASTER_ADDR": nodes[0][1], "MASTER_PORT": str(nodes[0][2])}

    def run_remote(self, fn: Callable, args=None, kwargs=None) -> list:
        """fn(*args, **kwargs) on every rank at once: Ray object refs, in rank order."""
        self._require_started()
        return [w.execute.remote(fn, tuple(args or ()), dict(kwargs or {}))
                for w in self.workers]

    def run(self, fn: Callable, args=None, kwargs=None) -> list:
        """fn(*args, **kwargs) on every rank at once; the results, in rank order."""
        import ray
        return ray.get(self.run_remote(fn, args, kwargs))

    def execute(self, fn: Callable) -> list:
        """fn(worker) on every rank (Horovod's execute)."""
        import ray
        self._require_started()
        return ray.get([w.execute_on.remote(fn) for w in self.workers])

    def execute_single(self, fn: Callable):
        """fn(worker) on rank 0 only."""
        import ray
        self._require_started()
        return ray.get(self.workers[0].execute_on.remote(fn))

    def shutdown(self) -> None:
        import ray
        for worker in self.workers:
            ray.kill(worker)
        self.workers = []
        if self._server is not None:
            self._server.close()
            self._server = None

    def _require_started(self) -> None:
        if not self.workers:
            raise UsageError("ringsync.ray.RayExecutor: call start() first")
