"""Bootstrap: choose where to listen, learn the topology, exchange a few bytes through MPI
within a deadline (the bounded exchanges MpiRendezvous, in rendezvous_mpi.py, is made of),
and (elastic jobs) agree on the surviving ranks after a failure; the job's status records
and MPI's own start and end.

MPI only carries a few bytes per rank here; the native core's own sockets carry the data.
"""
import array
import atexit
import fcntl
import ipaddress
import json
import os
import pickle
import secrets
import signal
import socket
import struct
import sys
import time
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

from .config import log_enabled
from .errors import UsageError

_SIOCGIFADDR = 0x8915  # Linux ioctl: the IPv4 address of a named interface


@dataclass(frozen=True)
class PeerInfo:
    host_name: str
    address: str
    port: int


@dataclass(frozen=True)
class JobKeys:
    """Made by rank 0 and handed to the others over MPI only. job_id is public (it names
    shared segments); connections prove that they know `secret`, which never crosses the
    ring's own sockets."""
    job_id: int
    secret: bytes

    @classmethod
    def new(cls) -> "JobKeys":
        return cls(secrets.randbits(63), secrets.token_bytes(32))


@dataclass(frozen=True)
class Topology:
    local_rank: int
    local_size: int
    cross_rank: int
    cross_size: int


def is_ip(text: str) -> bool:
    try:
        ipaddress.ip_address(text)
        return True
    except ValueError:
        return False


def interface_ipv4(name: str) -> str:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            packed = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, struct.pack("256s", name[:15].encode()))
        except OSError as e:
            raise UsageError(f"RINGSYNC_IFACE={name!r}: no IPv4 address on that interface ({e})") from None
    return socket.inet_ntoa(packed[20:24])


def is_local(address: str) -> bool:
    """Whether this host owns the address (a name can resolve to one it does not)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((address, 0))
        return True
    except OSError:
        return False


def routable_ipv4() -> str:
    """An address of this host that other hosts can reach: the host name's, unless it
    resolves only to loopback or to an address not on this host, then the source address
    of the default route (a UDP connect sends nothing); loopback if there is neither."""
    try:
        infos = socket.getaddrinfo(socket.gethostname(), None, socket.AF_INET)
        for info in infos:
            addr = info[4][0]
            if not ipaddress.ip_address(addr).is_loopback and is_local(addr):
                return addr
    except OSError:
        pass
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(("192.0.2.1", 9))  # TEST-NET-1: never contacted, only routed
            return s.getsockname()[0]
    except OSError:
        return "127.0.0.1"


def listen_addresses(iface) -> Tuple[str, str]:
    """(address to bind, address to advertise): the same one. A rank listens only where
    its peers reach it (RINGSYNC_IFACE's address, else the routable one), not on every
    interface: a listener is a door for any client that can reach it."""
    if iface:
        address = iface if is_ip(iface) else interface_ipv4(iface)
    else:
        address = routable_ipv4()
    return address, address


def connect_addresses(peers: Sequence[PeerInfo]) -> List[str]:
    """Where to reach each peer: the address it advertised and listens on, also for peers
    on this host (the address is local, so the kernel keeps that traffic on loopback)."""
    return [p.address for p in peers]


# Files a rank holds beyond one socket per peer: its listening socket, the engine's pipe,
# shared-memory segments while they are set up, clients still greeting it during setup (at
# most 64, native/src/transport_tcp.c), and room for the program's own files.
FD_MARGIN = 128
_fd_warnings_printed = set()  # each warning once per process (thread ranks share one)


def _open_fds() -> int:
    try:
        return len(os.listdir("/proc/self/fd"))
    except OSError:
        return 0


def fds_needed(size: int) -> int:
    """File descriptors a rank of a `size`-rank job needs: those open now, a socket to
    each peer (every rank keeps one to every other) and FD_MARGIN."""
    return _open_fds() + max(size - 1, 0) + FD_MARGIN


def raise_fd_limit(size: int, rank: int, stream=None) -> Optional[str]:
    """Raise the soft RLIMIT_NOFILE to the hard limit where the soft one is below what a
    rank of a `size`-rank job needs (the common soft default, 1024, ends a job of about
    1000 ranks with "too many open files"). Where even the hard limit is too low, raise it
    that far and return a warning, printed on `stream` (stderr) once per process; else
    None. Connecting then fails naming the limit if files do run out."""
    try:
        import resource
    except ImportError:  # not a POSIX system: nothing to raise
        return None
    needed = fds_needed(size)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    infinity = resource.RLIM_INFINITY
    if soft == infinity or soft >= needed:
        return None
    for target in ([hard] if hard != infinity else []) + [max(needed, 1 << 16), needed]:
        if hard != infinity and target > hard:
            continue
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
            break
        except (ValueError, OSError):  # above fs.nr_open, or not allowed
            continue
    if soft >= needed:
        return None
    warning = (f"ringsync: rank {rank}: a job of {size} ranks needs about {needed} open files "
               f"per rank (a socket to each peer, plus {FD_MARGIN} and the {_open_fds()} open "
               f"now), but RLIMIT_NOFILE allows {soft} (hard limit "
               f"{'unlimited' if hard == infinity else hard}); init() may fail with \"too many "
               f"open files\". Raise the hard limit: ulimit -Hn, LimitNOFILE= (systemd), "
               f"docker run --ulimit nofile=N:N, or /etc/security/limits.conf")
    key = (size, soft, hard)
    if key not in _fd_warnings_printed and log_enabled("warning"):
        _fd_warnings_printed.add(key)
        print(warning, file=stream or sys.stderr, flush=True)
    return warning


def topology(host_names: Sequence[str], rank: int) -> Topology:
    """Horovod's meaning: local = ranks on my host; cross = ranks with my local rank."""
    local_ranks = []
    seen = {}
    for name in host_names:
        local_ranks.append(seen.get(name, 0))
        seen[name] = local_ranks[-1] + 1
    mine = local_ranks[rank]
    same_local = [r for r, lr in enumerate(local_ranks) if lr == mine]
    return Topology(
        local_rank=mine,
        local_size=seen[host_names[rank]],
        cross_rank=same_local.index(rank),
        cross_size=len(same_local),
    )


# --------------------------------------------------------------------------- bounded exchanges
# Nonblocking MPI collectives polled against a deadline. MPI cannot cancel a collective:
# on a timeout, DeadlinePassed carries the request and its buffers, which the rendezvous
# then holds
# (MPI may still write into them when a late rank arrives).


class DeadlinePassed(Exception):
    """An exchange's deadline passed; `kept`: what MPI may still write into."""

    def __init__(self, kept):
        super().__init__("deadline passed")
        self.kept = kept


def wait_until(request, deadline: float, *buffers) -> None:
    """Poll request until it completes; DeadlinePassed (holding it and buffers)
    past deadline."""
    pause = 1e-4
    while not request.Test():
        if time.monotonic() >= deadline:
            raise DeadlinePassed((request,) + buffers)
        time.sleep(pause)
        pause = min(pause * 2, 5e-3)  # a quick exchange stays quick; a slow one costs little


def _offsets(sizes) -> List[int]:
    offsets, total = [], 0
    for size in sizes:
        offsets.append(total)
        total += size
    return offsets


MAX_EXCHANGE_BYTES = 1 << 30  # what one rank may send in one rendezvous exchange


def _check_sizes(sizes, what: str, ranks=None) -> None:
    """The lengths the ranks announced (sizes[i] by ranks[i], all by default), before any
    buffer is sized from them."""
    for rank, size in zip(ranks or range(len(sizes)), sizes):
        if not 0 <= size <= MAX_EXCHANGE_BYTES:
            raise UsageError(f"ringsync: rendezvous {what}: rank {rank} announced {size} bytes "
                             f"(at most {MAX_EXCHANGE_BYTES})")


def bounded_allgather(comm, obj, deadline: float):
    """Every rank's obj (pickled), in rank order: lengths, then the bytes."""
    from mpi4py import MPI
    payload = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    mine, sizes = array.array("q", [len(payload)]), array.array("q", [0] * comm.Get_size())
    wait_until(comm.Iallgather([mine, MPI.INT64_T], [sizes, MPI.INT64_T]), deadline,
               mine, sizes)
    _check_sizes(sizes, "allgather")
    offsets = _offsets(sizes)
    gathered = bytearray(sum(sizes))
    wait_until(comm.Iallgatherv([payload, MPI.BYTE],
                                [gathered, (list(sizes), offsets), MPI.BYTE]),
               deadline, payload, gathered)
    return [pickle.loads(gathered[o:o + n]) for o, n in zip(offsets, sizes)]


def bounded_bcast(comm, obj, root: int, deadline: float):
    """root's obj on every rank: its length, then its bytes."""
    from mpi4py import MPI
    payload = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL) if comm.Get_rank() == root \
        else b""
    size = array.array("q", [len(payload)])
    wait_until(comm.Ibcast([size, MPI.INT64_T], root=root), deadline, size)
    _check_sizes(size, "broadcast", ranks=[root])
    data = bytearray(payload) if comm.Get_rank() == root else bytearray(size[0])
    wait_until(comm.Ibcast([data, MPI.BYTE], root=root), deadline, data)
    return pickle.loads(bytes(data))


def bounded_min(comm, value: int, deadline: float) -> int:
    from mpi4py import MPI
    mine, smallest = array.array("q", [value]), array.array("q", [0])
    wait_until(comm.Iallreduce([mine, MPI.INT64_T], [smallest, MPI.INT64_T], op=MPI.MIN),
               deadline, mine, smallest)
    return smallest[0]


# --------------------------------------------------------------------------- fault tolerance
# MPI agrees on membership after a failure (ULFM: Revoke, Shrink, Spawn, Merge); the ring
# itself is then rebuilt over the communicator these return.


def fault_tolerant(environ=os.environ) -> bool:
    """Whether MPI keeps the survivors running when a rank dies (Open MPI: mpirun
    --with-ft ulfm, which `ringsync run --elastic` adds). RINGSYNC_MPI_FT=1 asserts it
    for another MPI with ULFM."""
    flags = (environ.get("OMPI_MCA_mpi_ft_enable", ""), environ.get("RINGSYNC_MPI_FT", ""))
    return any(flag.lower() in ("1", "true", "yes") for flag in flags)


def spawned_by_mpi(environ=os.environ) -> bool:
    """Whether MPI_Comm_spawn started this process (Open MPI tells it where its parent
    listens), known before MPI is initialised."""
    return "OMPI_PARENT_PORT" in environ


def exit_as_failed(code: int = 1, cause: Optional[str] = None, comms=(),
                   wait: Optional[float] = None) -> None:
    """End this process at once so that its peers see a failed rank (code 0: a rank that
    leaves a job that goes on). Never returns, never waits in MPI_Finalize.

    The launcher's status directory gets a record first (the launcher names the failed
    ranks from it). Without fault tolerance the non-zero status makes mpirun end the job.
    Under it, any exit status ends the whole job (Open MPI 5, measured: a rank's exit 3
    ends the others, mpirun exits 3) while a rank killed by a signal is a lost rank that
    the others recover from, and mpirun then reports success once no rank is left; so a
    failing rank kills itself, unless it is the last one alive (every other rank of
    COMM_WORLD, and of `comms`, known to have failed, within `wait` seconds: by default
    LAST_RANK_WAIT_S): then its status is the job's."""
    record_job_event("failed" if code else "left", code=code, cause=cause)
    sys.stdout.flush()
    sys.stderr.flush()
    wait = LAST_RANK_WAIT_S if wait is None else wait
    if fault_tolerant() and not (code and last_rank_alive(comms, wait)):
        os.kill(os.getpid(), signal.SIGKILL)
    os._exit(code)


# How long a failing rank waits to learn that the others have failed too: a rank that
# fails because a peer died hears of that death from MPI a little after its socket broke
# (measured: 50-100 ms on an idle host).
LAST_RANK_WAIT_S = 0.5


def last_rank_alive(comms=(), wait: float = LAST_RANK_WAIT_S) -> bool:
    """Under ULFM: whether every other rank this process shares COMM_WORLD (not for a
    replacement, whose world is its own spawn) and each of `comms` with has failed, as
    MPI sees it within `wait` seconds. False where MPI cannot tell (not initialised,
    no ULFM)."""
    mpi = sys.modules.get("mpi4py.MPI")
    try:
        if mpi is None or not mpi.Is_initialized() or mpi.Is_finalized():
            return False
        watched = [c for c in comms if c is not None and c != mpi.COMM_NULL]
        if not spawned_by_mpi():
            watched.append(mpi.COMM_WORLD)
        give_up = time.monotonic() + wait
        while not all(_others_failed(mpi, comm) for comm in watched):
            if time.monotonic() >= give_up:
                return False
            time.sleep(0.01)
        return bool(watched)
    except Exception:  # (no ULFM in this MPI, a freed communicator): it cannot tell
        return False


def _others_failed(mpi, comm) -> bool:
    try:
        comm.Iprobe(mpi.ANY_SOURCE, mpi.ANY_TAG)  # lets MPI take in failure notices
    except mpi.Exception:
        pass  # (a failure pending: what we are looking for)
    failed = comm.Get_failed()
    try:
        return failed.Get_size() >= comm.Get_size() - 1
    finally:
        failed.Free()


# --------------------------------------------------------------------------- the job's status
# `ringsync run` gives the ranks a directory (JOB_STATUS_DIR_ENV) where each rank leaves a
# few JSON records: "started" at init(), then one of "failed" (exit_as_failed), "left"
# (a rank leaving a job that goes on) or "finished" (its shutdown, or the interpreter's
# exit). Once mpirun is done, the launcher reads them (launcher.job_status): under MPI
# fault tolerance mpirun's own status cannot tell a failed job from one that finished.

JOB_STATUS_DIR_ENV = "RINGSYNC_JOB_STATUS_DIR"
RANK_VARIABLES = ("OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK")
CAUSE_LIMIT = 300  # characters of a failure's cause kept in its record


def launch_rank(environ=os.environ) -> Optional[int]:
    """This process's rank as its launcher started it (known before MPI is initialised)."""
    for name in RANK_VARIABLES + ("RANK", "SLURM_PROCID"):  # (mpirun's, then the others')
        if environ.get(name, "").isdigit():
            return int(environ[name])
    return None


def record_job_event(kind: str, code: Optional[int] = None, cause: Optional[str] = None,
                     environ=os.environ) -> None:
    """Leave `kind` in the launcher's status directory, if it gave one and it exists on
    this host (a rank on another host writes nothing: the directory is the launcher's).
    Never raises: a record is worth less than the rank's own way out."""
    directory = environ.get(JOB_STATUS_DIR_ENV)
    if not directory or not os.path.isdir(directory):
        return
    record = {"kind": kind, "pid": os.getpid(), "host": socket.gethostname(),
              "rank": launch_rank(environ), "spawned": spawned_by_mpi(environ),
              "time_ns": time.time_ns(), "code": code,
              "cause": None if cause is None else cause[:CAUSE_LIMIT]}
    name = f"{record['host']}-{record['pid']}.{kind}.json"
    try:
        partial = os.path.join(directory, "." + name)
        with open(partial, "w") as f:
            json.dump(record, f)
        os.replace(partial, os.path.join(directory, name))  # the launcher never reads half
    except OSError:
        pass


_finish_recorded_at_exit = False


def record_start() -> None:
    """init(): this rank started (a rank that leaves no end record was killed), and it
    records its finish when the interpreter exits in order."""
    global _finish_recorded_at_exit
    record_job_event("started")
    if not _finish_recorded_at_exit:
        _finish_recorded_at_exit = True
        atexit.register(record_job_event, "finished")


# --------------------------------------------------------------------------- MPI itself


_THREAD_LEVELS = ("single", "funneled", "serialized", "multiple")


def ensure_mpi_initialized() -> bool:
    """Initialise MPI where mpi4py was told not to (mpi4py.rc.initialize = False), as
    Horovod does, at the thread level mpi4py.rc asks for; then MPI is finalized at exit
    (before mpi4py's own exit handlers, after ringsync's shutdown, which init() registers
    later), except under fault tolerance, where MPI_Finalize can hang (see ringsync's
    _skip_mpi_finalize_under_fault_tolerance). Returns whether it initialised MPI."""
    import mpi4py
    from mpi4py import MPI
    if MPI.Is_finalized():
        raise UsageError("ringsync.init: MPI has been finalized already (MPI.Finalize() was "
                         "called); MPI cannot start again in this process")
    if MPI.Is_initialized():
        return False
    level = str(getattr(mpi4py.rc, "thread_level", "multiple")).lower()
    if level not in _THREAD_LEVELS:
        level = "multiple"
    MPI.Init_thread(getattr(MPI, "THREAD_" + level.upper()))
    if not fault_tolerant() and getattr(mpi4py.rc, "finalize", None) is not False:
        atexit.register(_finalize_mpi)
    return True


def _finalize_mpi() -> None:
    from mpi4py import MPI
    if MPI.Is_initialized() and not MPI.Is_finalized():
        MPI.Finalize()


def _errors_return(comm):
    from mpi4py import MPI
    comm.Set_errhandler(MPI.ERRORS_RETURN)  # failures become exceptions, not aborts
    return comm


def replacement_world():
    """In a rank that survivors started with Spawn to replace a lost one: the
    communicator it shares with them (they merged theirs first, so they keep ranks
    0..k-1). None in every other process."""
    from mpi4py import MPI
    parent = MPI.Comm.Get_parent()
    if parent == MPI.COMM_NULL:
        return None
    world = _errors_return(parent.Merge(high=True))
    parent.Disconnect()  # Get_parent() is null from now on: a later init() won't merge again
    return world


def shrink(comm):
    """Revoke comm (interrupting every rank still using it) and agree on who is left.
    Returns (survivors' communicator, ranks of comm that were lost)."""
    from mpi4py import MPI
    try:
        comm.Revoke()
    except MPI.Exception:
        pass  # already revoked by a peer
    survivors = _errors_return(comm.Shrink())
    kept = MPI.Group.Translate_ranks(survivors.Get_group(), list(range(survivors.Get_size())),
                                     comm.Get_group())
    return survivors, sorted(set(range(comm.Get_size())) - set(kept))


def spawn_replacements(comm, count: int, hosts=None):
    """Start `count` new ranks running this program, with comm's ranks first in the
    merged communicator returned; hosts ({host: ranks}, adding up to count) says where,
    else mpirun chooses."""
    from mpi4py import MPI
    argv = list(getattr(sys, "orig_argv", [sys.executable] + sys.argv))
    places = list((hosts or {None: count}).items())
    infos = []
    for host, ranks in places:
        infos.append(MPI.Info.Create())
        infos[-1].Set("map_by", ":OVERSUBSCRIBE")  # they may land where lost ranks ran
        if host is not None:
            infos[-1].Set("host", f"{host}:{ranks}")
    inter = comm.Spawn_multiple([sys.executable] * len(places), [argv[1:]] * len(places),
                                [n for _, n in places], infos, root=0)
    for info in infos:
        info.Free()
    world = _errors_return(inter.Merge(high=False))
    inter.Disconnect()
    return world
