"""Bootstrap: choose where to listen, learn the topology, and, through MPI, exchange
addresses (MpiRendezvous) and (elastic jobs) agree on the surviving ranks after a failure.

MPI only carries a few bytes per rank here; the native core's own sockets carry the data.
"""
import fcntl
import ipaddress
import os
import secrets
import signal
import socket
import struct
import sys
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

from .config import log_enabled
from .errors import UsageError
from .rendezvous import FaultTolerance, Rendezvous

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


# --------------------------------------------------------------------------- the MPI rendezvous


class MpiRendezvous(Rendezvous, FaultTolerance):
    """The ranks of an mpi4py intracommunicator meet over MPI (what ringsync.init() uses)."""

    def __init__(self, comm, owned: bool):
        """owned: comm is a duplicate made for us, freed by close()."""
        self._comm, self._owned = comm, owned
        self.rank, self.size = comm.Get_rank(), comm.Get_size()

    @classmethod
    def over(cls, comm=None, own_comm: bool = False) -> "MpiRendezvous":
        """A rendezvous over comm (MPI.COMM_WORLD by default). Our bootstrap traffic never
        mixes with the user's: it runs on a duplicate, unless own_comm says that comm is
        ours alone (elastic recovery hands over the communicator it just built, so that
        revoking that one also interrupts our exchanges)."""
        from mpi4py import MPI
        comm = MPI.COMM_WORLD if comm is None else comm
        if not isinstance(comm, MPI.Intracomm):
            raise UsageError(f"ringsync.init: comm must be an mpi4py intracommunicator, "
                             f"got {type(comm).__name__}")
        return cls(comm, owned=False) if own_comm else cls(comm.Dup(), owned=True)

    def allgather(self, obj):
        return self._comm.allgather(obj)

    def bcast(self, obj, root: int = 0):
        return self._comm.bcast(obj, root=root)

    def close(self) -> None:
        if self._owned:
            self._owned = False
            try:
                self._comm.Free()
            except Exception:  # a communicator with failed ranks: nothing left to free
                pass

    def split(self, ranks):
        from mpi4py import MPI
        ranks = list(ranks)
        member = self.rank in ranks
        sub = self._comm.Split(0 if member else MPI.UNDEFINED,
                               ranks.index(self.rank) if member else 0)
        return MpiRendezvous(sub, owned=True) if member else None

    @property
    def mpi_comm(self):
        return self._comm

    def disconnect(self) -> None:
        """Collective: cut this communicator's ranks apart (MPI_Comm_disconnect), so that
        ranks leaving the job can end without the others."""
        self._comm.Disconnect()
        self._owned = False  # nothing left to free

    def shrink(self):
        survivors, lost = shrink(self._comm)
        return MpiRendezvous(survivors, owned=False), lost

    def spawn(self, count: int, hosts=None):
        return MpiRendezvous(spawn_replacements(self._comm, count, hosts), owned=False)

    def allreduce_min(self, value: int) -> int:
        from mpi4py import MPI
        return self._comm.allreduce(value, op=MPI.MIN)


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


def exit_as_failed(code: int = 1) -> None:
    """End this process at once so that its peers see a failed rank. Under fault
    tolerance that takes a signal (an exit status, even non-zero, reads as an orderly
    end of the whole job there); otherwise the non-zero status makes mpirun end the job.
    Never returns, never waits in MPI_Finalize."""
    sys.stdout.flush()
    sys.stderr.flush()
    if fault_tolerant():
        os.kill(os.getpid(), signal.SIGKILL)
    os._exit(code)


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
