"""Which world this process belongs to, read from its environment, and the rendezvous that
meets it: an MPI world under mpirun, otherwise a key-value store found through the
variables a launcher sets (torchrun and Kubeflow's PyTorchJob: RANK, WORLD_SIZE,
MASTER_ADDR, MASTER_PORT; Slurm's srun: SLURM_PROCID, SLURM_NTASKS, SLURM_STEP_NODELIST,
SLURM_JOB_ID), or named outright (``ringsync.init(rendezvous=...)`` or
RINGSYNC_RENDEZVOUS: ``mpi``, ``env://``, ``tcp://HOST:PORT``, ``file:///DIR``).

find_world() only reads variables (``ringsync doctor`` shows its answer and why);
open_rendezvous() connects. The store is ringsync's own (ringsync.store: every request
authenticated by the job secret, RINGSYNC_SECRET or RINGSYNC_SECRET_FILE) served by rank 0
or by the launcher; under torchrun without a secret, the store torchrun's agent already
serves (torch's TCPStore) is used instead, as torch.distributed itself does.
"""
import dataclasses
import os
import re
import socket
from datetime import timedelta
from typing import Mapping, Optional

from . import bootstrap
from .config import Config
from .errors import UsageError

ENV_VARIABLES = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
SLURM_VARIABLES = ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_JOB_ID")
MPI_VARIABLES = bootstrap.RANK_VARIABLES + ("OMPI_PARENT_PORT",)
# The settings read before the ring's first exchange (the others travel through it).
WORLD_SETTINGS = ("rendezvous", "store_port", "start_timeout_seconds", "elastic")
JOIN_ENV = "RINGSYNC_ELASTIC_JOIN"  # set by `ringsync run` in a replacement rank
SLURM_PORT_BASE, SLURM_PORT_SPAN = 20000, 30000  # ports derived from SLURM_JOB_ID
SECRET_ADVICE = ("set RINGSYNC_SECRET (at least 16 characters, the same on every rank: a "
                 "Kubernetes Secret, or `export RINGSYNC_SECRET=$(openssl rand -hex 32)` "
                 "before srun) or RINGSYNC_SECRET_FILE")


@dataclasses.dataclass(frozen=True)
class World:
    """Where this process's job meets. kind: "mpi", "single" (this process alone, no
    MPI), "env" (torchrun / PyTorchJob variables), "slurm", "tcp" or "file" (a store
    named outright). store: the store's URL; serve: this rank serves it; torch_store: the
    store is torchrun's agent store (torch's TCPStore); join: a replacement rank that
    joins a running elastic job (rank and size come from the job)."""

    kind: str
    why: str
    rank: int = 0
    size: int = 1
    store: Optional[str] = None
    serve: bool = False
    torch_store: bool = False
    prefix: str = "ringsync"
    join: bool = False

    def describe(self) -> str:
        if self.kind in ("mpi", "single"):
            where = "MPI (mpi4py)" if self.kind == "mpi" else "this process alone (no MPI)"
            return f"{where}: {self.why}"
        who = "a replacement joining the job" if self.join else f"rank {self.rank} of {self.size}"
        store = ("torchrun's store (torch TCPStore) at " if self.torch_store
                 else "ringsync's store at ") + str(self.store)
        served = " (served by this rank)" if self.serve else ""
        return f"a store rendezvous: {who}, {store}{served}: {self.why}"


def find_world(environ: Mapping[str, str] = os.environ, rendezvous: Optional[str] = None
               ) -> World:
    """The world this process would join, and why (nothing is connected)."""
    config = Config.some_from_env(WORLD_SETTINGS, environ)
    choice = rendezvous or config.rendezvous
    if choice:
        return _named_world(choice, environ, config,
                            "ringsync.init(rendezvous=...)" if rendezvous else
                            "RINGSYNC_RENDEZVOUS")
    started_by = [name for name in MPI_VARIABLES if name in environ]
    if started_by:
        return World("mpi", f"{started_by[0]} is set: mpirun started this process")
    if all(name in environ for name in ENV_VARIABLES):
        return _env_world(environ, config, "RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT "
                          "are set" + (" by torchrun" if _under_torchrun(environ) else ""))
    if all(name in environ for name in SLURM_VARIABLES) and "SLURM_STEP_ID" in environ:
        return _slurm_world(environ, config)
    if _mpi4py_installed():
        return World("mpi", "no launcher's variables are set: this process alone, as an MPI "
                     "singleton")
    return World("single", "no launcher's variables are set and mpi4py is not installed")


def _named_world(choice: str, environ, config: Config, source: str) -> World:
    if choice == "mpi":
        return World("mpi", f"{source} is 'mpi'")
    if choice == "env://":
        missing = [name for name in ENV_VARIABLES if name not in environ]
        if missing:
            raise UsageError(f"ringsync.init: {source} is 'env://' but {', '.join(missing)} "
                             f"{'is' if len(missing) == 1 else 'are'} not set")
        return _env_world(environ, config, f"{source} is 'env://'")
    if choice.startswith("tcp://"):
        _host_port(choice[len("tcp://"):], source)
        rank, size = _rank_and_size(environ, source)
        return World("tcp", f"{source} names the store", rank, size, choice,
                     prefix=_prefix(environ), join=_joining(environ))
    if choice.startswith("file://"):
        if not choice.startswith("file:///"):
            raise UsageError(f"ringsync.init: {source} {choice!r}: a file store needs an "
                             "absolute path, file:///DIR")
        rank, size = _rank_and_size(environ, source)
        return World("file", f"{source} names a shared directory", rank, size, choice,
                     prefix=_prefix(environ))
    raise UsageError(f"ringsync.init: {source} {choice!r} is none of 'mpi', 'env://', "
                     "'tcp://HOST:PORT', 'file:///DIR'")


def _env_world(environ, config: Config, why: str) -> World:
    rank, size = _rank_and_size(environ, "RANK/WORLD_SIZE")
    host = environ["MASTER_ADDR"]
    port = _port(environ["MASTER_PORT"], "MASTER_PORT")
    if _under_torchrun(environ) and not _secret_given(environ):
        # torchrun's agent serves a TCPStore at MASTER_ADDR:MASTER_PORT for its workers
        return World("env", why + "; no RINGSYNC_SECRET, so torchrun's own store is used",
                     rank, size, f"tcp://{host}:{port}", torch_store=True,
                     prefix=_prefix(environ))
    # MASTER_PORT itself is torch.distributed's (rank 0's TCPStore under env://)
    store_port = config.store_port or port + 1
    return World("env", why, rank, size, f"tcp://{host}:{store_port}", serve=rank == 0,
                 prefix=_prefix(environ))


def _slurm_world(environ, config: Config) -> World:
    rank, size = _rank_and_size(environ, "SLURM_PROCID/SLURM_NTASKS")
    nodes = environ.get("SLURM_STEP_NODELIST") or environ.get("SLURM_JOB_NODELIST", "")
    if not nodes:
        raise UsageError("ringsync.init: under Slurm, neither SLURM_STEP_NODELIST nor "
                         "SLURM_JOB_NODELIST is set: the store's host is not known")
    job = environ["SLURM_JOB_ID"]
    if not job.isdigit():
        raise UsageError(f"ringsync.init: SLURM_JOB_ID {job!r} is not a number")
    port = config.store_port or SLURM_PORT_BASE + int(job) % SLURM_PORT_SPAN
    return World("slurm", f"SLURM_PROCID and SLURM_NTASKS are set (srun); the store is on "
                 f"the step's first node, port {'RINGSYNC_STORE_PORT' if config.store_port else 'from SLURM_JOB_ID'}",
                 rank, size, f"tcp://{first_host(nodes)}:{port}", serve=rank == 0,
                 prefix=f"ringsync/slurm{job}.{environ.get('SLURM_STEP_ID', '0')}")


def _rank_and_size(environ, source: str):
    """(rank, size) from torchrun's names, else Slurm's; a replacement joining an
    elastic job has none (its place comes from the job)."""
    for rank_name, size_name in (("RANK", "WORLD_SIZE"), ("SLURM_PROCID", "SLURM_NTASKS")):
        if rank_name in environ and size_name in environ:
            rank = _number(environ[rank_name], rank_name)
            size = _number(environ[size_name], size_name)
            if not 0 <= rank < size:
                raise UsageError(f"ringsync.init: {rank_name}={rank} is out of range for "
                                 f"{size_name}={size}")
            return rank, size
    if _joining(environ):
        return 0, 1
    raise UsageError(f"ringsync.init: {source}: this rank's place is not known: set RANK "
                     "and WORLD_SIZE (or run under srun)")


def first_host(nodelist: str) -> str:
    """The first host of a Slurm host list: "node[07-09,12],gpu3" -> "node07"."""
    first = re.match(r"[^,\[]*(\[[^\]]*\][^,\[]*)*", nodelist.strip()).group(0)
    host = re.sub(r"\[([^\]\-,]*)[^\]]*\]", lambda m: m.group(1), first)
    if not host:
        raise UsageError(f"ringsync.init: cannot read a host from the Slurm host list "
                         f"{nodelist!r}")
    return host


def _under_torchrun(environ) -> bool:
    return "TORCHELASTIC_RUN_ID" in environ and \
        environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"


def _prefix(environ) -> str:
    """Keys of one run of the job: a job torchrun restarts meets anew."""
    run = environ.get("TORCHELASTIC_RUN_ID")
    if run is None:
        return "ringsync"
    return f"ringsync/{run}.{environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"


def _secret_given(environ) -> bool:
    return bool(environ.get("RINGSYNC_SECRET") or environ.get("RINGSYNC_SECRET_FILE"))


def _joining(environ) -> bool:
    return environ.get(JOIN_ENV, "") == "1"


def _number(text: str, name: str) -> int:
    if not text.strip().isdigit():
        raise UsageError(f"ringsync.init: {name}={text!r} is not a number")
    return int(text)


def _port(text: str, name: str) -> int:
    port = _number(text, name)
    if not 0 < port < 65536:
        raise UsageError(f"ringsync.init: {name}={port} is not a TCP port")
    return port


def _host_port(text: str, source: str):
    host, _, port = text.rpartition(":")
    if not host:
        raise UsageError(f"ringsync.init: {source} tcp://{text}: expected tcp://HOST:PORT")
    return host.strip("[]"), _port(port, source)


def _mpi4py_installed() -> bool:
    import importlib.util
    return importlib.util.find_spec("mpi4py") is not None


# --------------------------------------------------------------------------- connecting


def open_rendezvous(world: World, environ: Mapping[str, str] = os.environ,
                    config: Optional[Config] = None):
    """The rendezvous of a store world (for "mpi": None, the caller uses MPI)."""
    from .rendezvous import ThreadGroup
    from .rendezvous_store import StoreRendezvous
    if world.kind == "mpi":
        return None
    if world.kind == "single":
        return ThreadGroup(1).rendezvous(0)
    config = config or Config.some_from_env(WORLD_SETTINGS, environ)
    seconds = config.start_timeout_seconds
    if world.torch_store:
        return StoreRendezvous(_torch_store(world.store, world.size, seconds), world.rank,
                               world.size, world.prefix, timeout=seconds)  # (torch closes it)
    from . import store
    secret = store.load_secret(environ)
    if secret is None:
        raise UsageError(f"ringsync.init: {world.describe()}; but the store needs the job's "
                         f"secret: {SECRET_ADVICE}")
    server = _serve(world, secret) if world.serve else None
    client = store.connect(world.store, secret, timeout=seconds, connect_timeout=seconds)
    if world.join:
        return StoreRendezvous.join(client, secret, world.prefix, timeout=seconds)
    return StoreRendezvous(client, world.rank, world.size, world.prefix, timeout=seconds,
                           secret=secret, server=server, owns_store=True,
                           elastic=bool(config.elastic))


def _serve(world: World, secret: bytes):
    """Rank 0's store, on every interface at the world's port: the others reach it at
    MASTER_ADDR (a name that may resolve to any of this host's addresses); every
    request proves the secret."""
    from . import store
    _, port = _host_port(world.store[len("tcp://"):], "the store")
    try:
        return store.StoreServer(secret, "0.0.0.0", port,
                                 served_by=f"rank 0 on {socket.gethostname()}").start()
    except OSError as e:
        raise UsageError(f"ringsync.init: rank 0 cannot serve the store at {world.store}: "
                         f"{e.strerror} (RINGSYNC_STORE_PORT chooses another port)") from None


def _torch_store(url: str, size: int, seconds: float):
    import torch.distributed as dist
    host, port = _host_port(url[len("tcp://"):], "the store")
    return dist.TCPStore(host, port, size, is_master=False,
                         timeout=timedelta(seconds=seconds), wait_for_workers=False)
