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

    def __init__(self, timeout_s: float = 30, placement_group_timeout_s: float = 100):
        self.timeout_s, self.placement_group_timeout_s = timeout_s, placement_group_timeout_s


class _Worker:
    """One rank: a Ray actor that keeps the job's variables, an optional executable (an
    instance of the executable_cls given to start()), and runs functions."""

    def __init__(self):
        self.executable = None

    def node(self):
        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        import ray
        return socket.gethostname(), ray.util.get_node_ip_address(), port

    def update_env(self, values: Dict[str, str]) -> None:
        os.environ.update(values)

    def start_executable(self, cls, args, kwargs) -> None:
        if cls is not None:
            self.executable = cls(*args, **kwargs)

    def execute(self, fn: Callable, args, kwargs):
        return fn(*args, **kwargs)

    def execute_on(self, fn: Callable):
        return fn(self.executable if self.executable is not None else self)


class RayExecutor:
    """num_workers ranks (or num_hosts x num_workers_per_host) as Ray actors with
    cpus_per_worker CPUs each (GPUs: use_gpu and gpus_per_worker, handed to Ray's
    scheduling only; ringsync moves host memory). Horovod's signature; its elastic
    arguments (min_workers, ...) are refused: ElasticRayExecutor is not built here."""

    @staticmethod
    def create_settings(timeout_s: float = 30, ssh_identity_file=None, ssh_str=None,
                        placement_group_timeout_s: float = 100, nics=None) -> _Settings:
        """Horovod's signature; ssh_identity_file, ssh_str and nics have no use here (the
        actors are Ray's; RINGSYNC_IFACE chooses interfaces)."""
        return _Settings(timeout_s, placement_group_timeout_s)

    def __init__(self, settings, num_workers: Optional[int] = None,
                 num_hosts: Optional[int] = None, num_workers_per_host: int = 1,
                 cpus_per_worker: float = 1, use_gpu: bool = False,
                 gpus_per_worker: Optional[float] = None,
                 use_current_placement_group: bool = True, min_workers: Optional[int] = None,
                 max_workers: Optional[int] = None, reset_limit: Optional[int] = None,
                 cooldown_range=None, elastic_timeout: int = 600,
                 override_discovery: bool = True):
        if min_workers is not None or max_workers is not None:
            raise UsageError("ringsync.ray.RayExecutor: min_workers / max_workers (Horovod's "
                             "elastic Ray executor) are not supported; give num_workers")
        if num_workers is None and num_hosts is not None:
            num_workers = num_hosts * num_workers_per_host
        if not num_workers or num_workers < 1:
            raise UsageError(f"ringsync.ray.RayExecutor: num_workers (or num_hosts x "
                             f"num_workers_per_host) must be at least 1, got {num_workers!r}")
        self.settings = settings or _Settings()
        self.num_workers, self.cpus_per_worker = num_workers, cpus_per_worker
        self.gpus_per_worker = (gpus_per_worker or 1) if use_gpu else 0
        self.workers: List[Any] = []
        self._server: Optional[StoreServer] = None

    def start(self, executable_cls: Optional[type] = None, executable_args=None,
              executable_kwargs=None, extra_env_vars: Optional[Dict[str, str]] = None) -> None:
        """Start the actors and the store, give every actor its variables (and
        extra_env_vars), then make each its executable_cls(*args, **kwargs), which
        execute() hands to its function."""
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
                        timeout=getattr(self.settings, "placement_group_timeout_s", 100))
        store = "tcp://%s:%d" % (ray.util.get_node_ip_address(), self._server.address[1])
        ray.get([w.update_env.remote(dict(self._variables(rank, nodes, store, secret),
                                          **(extra_env_vars or {})))
                 for rank, w in enumerate(self.workers)])
        ray.get([w.start_executable.remote(executable_cls, list(executable_args or []),
                                           dict(executable_kwargs or {}))
                 for w in self.workers])

    def _variables(self, rank: int, nodes, store: str, secret: str) -> Dict[str, str]:
        hosts = [host for host, _, _ in nodes]
        return {"RINGSYNC_RENDEZVOUS": store, "RINGSYNC_SECRET": secret,
                "RINGSYNC_START_TIMEOUT_SECONDS": str(getattr(self.settings, "timeout_s", 30)),
                "RANK": str(rank), "WORLD_SIZE": str(len(nodes)),
                "LOCAL_RANK": str(hosts[:rank].count(hosts[rank])),
                "LOCAL_WORLD_SIZE": str(hosts.count(hosts[rank])),
                "MASTER_ADDR": nodes[0][1], "MASTER_PORT": str(nodes[0][2])}

    def run_remote(self, fn: Callable, args=None, kwargs=None) -> list:
        """fn(*args, **kwargs) on every rank at once: Ray object refs, in rank order."""
        self._require_started()
        return [w.execute.remote(fn, tuple(args or ()), dict(kwargs or {}))
                for w in self.workers]

    def run(self, fn: Callable, args=None, kwargs=None, callbacks=None) -> list:
        """fn(*args, **kwargs) on every rank at once; the results, in rank order."""
        import ray
        _refuse_callbacks(callbacks)
        return ray.get(self.run_remote(fn, args, kwargs))

    def execute(self, fn: Callable, callbacks=None) -> list:
        """fn(executable) on every rank (the worker itself without an executable_cls)."""
        import ray
        _refuse_callbacks(callbacks)
        self._require_started()
        return ray.get([w.execute_on.remote(fn) for w in self.workers])

    def execute_single(self, fn: Callable):
        """fn(executable) on rank 0 only."""
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


def _refuse_callbacks(callbacks) -> None:
    """Horovod's callbacks receive what rank 0 logs through its Ray logger, which
    ringsync does not have: refused rather than silently never called."""
    if callbacks:
        raise UsageError("ringsync.ray.RayExecutor: callbacks are not supported (the actors' "
                         "output reaches the driver through Ray's own log forwarding)")
