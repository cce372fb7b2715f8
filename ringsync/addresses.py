"""Which address a rank listens on and advertises, when its host has several.

A rank listens on one address only (a listener is a door for any client that reaches it).
With one candidate address per host, or every rank on one host, that is the routable
address (bootstrap.routable_ipv4) or RINGSYNC_IFACE's. Where hosts have several interfaces
and the host name may resolve to one that the other hosts cannot reach (a management
network, a container bridge), the ranks test instead: the first rank of every host opens a
probe listener on each of its candidates, the first rank of every other host tries to
connect to each, and each host takes the first candidate, in its own order of preference,
that every other host reached. Two exchanges through the rendezvous, only in that case.
"""
from __future__ import annotations

import errno
import fcntl
import select
import socket
import struct
import time
from typing import Dict, List, Optional, Sequence, Tuple

from . import bootstrap
from .errors import UsageError

PROBE_SECONDS = 2.0  # an address that accepts no connection within this is unreachable
_SIOCGIFFLAGS = 0x8913
_IFF_UP, _IFF_LOOPBACK = 0x1, 0x8


def _interface_flags(name: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        packed = fcntl.ioctl(s.fileno(), _SIOCGIFFLAGS, struct.pack("256s", name[:15].encode()))
    return struct.unpack_from("H", packed, 16)[0]


def interface_addresses() -> List[Tuple[str, str]]:
    """(interface, IPv4 address) of every interface that is up, not loopback, addressed."""
    found = []
    for _, name in socket.if_nameindex():
        try:
            if _interface_flags(name) & (_IFF_UP | _IFF_LOOPBACK) != _IFF_UP:
                continue
            found.append((name, bootstrap.interface_ipv4(name)))
        except (OSError, UsageError):
            continue  # no IPv4 address, or gone meanwhile
    return found


def candidates(iface: Optional[str]) -> List[str]:
    """This host's addresses in order of preference. RINGSYNC_IFACE may list several
    interfaces or addresses (comma-separated); those present here count, in that order."""
    if iface:
        entries = [e.strip() for e in iface.split(",") if e.strip()]
        found, missing = [], []
        for entry in entries:
            try:
                found.append(entry if bootstrap.is_ip(entry) else bootstrap.interface_ipv4(entry))
            except UsageError as e:
                missing.append(str(e))
        if not found:
            raise UsageError("; ".join(missing) if len(entries) == 1 else
                             f"RINGSYNC_IFACE={iface!r}: none of these interfaces has an IPv4 "
                             f"address here ({'; '.join(missing)})")
        return list(dict.fromkeys(found))
    preferred = bootstrap.routable_ipv4()
    others = [address for _, address in interface_addresses()]
    return list(dict.fromkeys([preferred] + others))


def _open_probes(addresses: Sequence[str]) -> List[socket.socket]:
    probes = []
    for address in addresses:
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            s.bind((address, 0))
            s.listen(64)  # never accepted: the kernel completes the handshake itself
        except OSError:
            s.close()
            s = None
        probes.append(s)
    return probes


def _reachable(targets: Sequence[Tuple[str, int]]) -> List[bool]:
    """Which (address, port) accept a TCP connection within PROBE_SECONDS, tried at once."""
    result = [False] * len(targets)
    pending: Dict[socket.socket, int] = {}
    for i, (address, port) in enumerate(targets):
        if not port:
            continue
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        s.setblocking(False)
        if s.connect_ex((address, port)) in (0, errno.EINPROGRESS):
            pending[s] = i
        else:
            s.close()
    deadline = time.monotonic() + PROBE_SECONDS
    while pending and time.monotonic() < deadline:
        _, writable, _ = select.select([], list(pending), [], deadline - time.monotonic())
        for s in writable:
            i = pending.pop(s)
            result[i] = s.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR) == 0
            s.close()
    for s in pending:
        s.close()
    return result


def _first_ranks(host_names: Sequence[str]) -> Dict[str, int]:
    first: Dict[str, int] = {}
    for rank, host in enumerate(host_names):
        first.setdefault(host, rank)
    return first


def choose(rendezvous, host_name: str, iface: Optional[str]) -> Tuple[Optional[str], object]:
    """(this rank's address, None), or (None, (kind, text)) where this rank has none.
    Collective: every rank calls it, and a rank whose setting is bad still takes part in
    the exchanges (its error then travels with the ring's first exchange)."""
    rank = rendezvous.rank
    try:
        mine, error = candidates(iface), None
    except UsageError as e:
        mine, error = [], ("usage", f"rank {rank}: {e}")
    probes = _open_probes(mine) if len(mine) > 1 else []
    try:
        ports = [p.getsockname()[1] if p else 0 for p in probes]
        posts = rendezvous.allgather((host_name, mine, ports))
        hosts = [post[0] for post in posts]
        index = 0
        if len(set(hosts)) > 1 and any(len(post[1]) > 1 for post in posts):
            index = _agree_on_index(rendezvous, posts)
    finally:
        for p in probes:
            if p:
                p.close()
    if error:
        return None, error
    return (mine[index] if index < len(mine) else mine[0]), None


def _agree_on_index(rendezvous, posts) -> int:
    """The candidate index this rank's host uses: the first that the first rank of every
    other host could connect to (0 where none was)."""
    hosts = [post[0] for post in posts]
    first = _first_ranks(hosts)
    me = rendezvous.rank
    reached = {}
    if first[hosts[me]] == me:  # one prober per host: its ranks share its network
        for host, leader in first.items():
            if host != hosts[me]:
                _, addresses, ports = posts[leader]
                reached[host] = _reachable(list(zip(addresses, ports)) if ports
                                           else [(addresses[0], 0)])
    views = rendezvous.allgather(reached)
    my_host = hosts[me]
    options = len(posts[first[my_host]][1])
    for i in range(options):
        if all(_reached(views[r], my_host, i) for host, r in first.items() if host != my_host):
            return i
    return 0


def _reached(view, host: str, i: int) -> bool:
    return host in view and i < len(view[host]) and view[host][i]

