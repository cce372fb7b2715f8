"""Hosts and their slots: how many ranks fit on this host (its cores), on the hosts of a
``-H host[:slots],...`` list, or in an Open MPI hostfile. ``ringsync run`` compares -np
with them to decide on oversubscription (ringsync.launch.mpirun) and ``--verbose``
reports them."""

from __future__ import annotations

import os

from ringsync.errors import LauncherError


def local_slots() -> int:
    """Ranks that fit on this host before Open MPI calls it oversubscribed.

    Open MPI counts physical cores (not hardware threads) that this process may use,
    so count distinct (package, core) pairs among the CPUs in our affinity mask;
    fall back to os.cpu_count() where the topology is not readable.
    """
    try:
        cpus = sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1
    cores = set()
    for cpu in cpus:
        topology = "/sys/devices/system/cpu/cpu%d/topology/" % cpu
        try:
            with open(topology + "physical_package_id") as f:
                package = f.read().strip()
            with open(topology + "core_id") as f:
                core = f.read().strip()
        except OSError:
            return len(cpus) or os.cpu_count() or 1
        cores.add((package, core))
    return max(1, len(cores))


def host_entries(hosts: str) -> list[tuple[str, int]]:
    """(host, slots) of each entry of a ``-H host[:slots],...`` list; a host without
    ``:slots`` has 1, as in Open MPI."""
    entries = []
    for entry in hosts.split(","):
        entry = entry.strip()
        if not entry:
            continue
        name, _, slots = entry.rpartition(":") if ":" in entry else (entry, "", "1")
        if not name or not slots.isdigit():
            raise LauncherError("bad -H entry %r: expected host or host:slots" % entry)
        entries.append((name, int(slots)))
    return entries


def host_list_slots(hosts: str) -> int:
    """Slots in a ``-H host[:slots],...`` list."""
    total = sum(slots for _, slots in host_entries(hosts))
    if total == 0:
        raise LauncherError("-H %r names no hosts" % hosts)
    return total


def hostfile_slots(path: str) -> int:
    """Slots in an Open MPI hostfile (``host slots=N`` lines, ``#`` comments).

    A line without ``slots=`` counts 1: Open MPI would use that host's core count, which
    we cannot know from here, and under-counting only adds a harmless --oversubscribe.
    """
    try:
        with open(path) as f:
            lines = f.read().splitlines()
    except OSError as exc:
        raise LauncherError("cannot read hostfile %s: %s" % (path, exc)) from exc
    total = 0
    for line in lines:
        words = line.split("#", 1)[0].split()
        if not words:
            continue
        slots = [w.split("=", 1)[1] for w in words[1:] if w.startswith("slots=")]
        total += int(slots[0]) if slots and slots[0].isdigit() else 1
    if total == 0:
        raise LauncherError("hostfile %s names no hosts" % path)
    return total


def available_slots(hosts: str | None = None, hostfile: str | None = None) -> int:
    """Slots the job may use: -H wins (it selects among hostfile hosts), then the hostfile, then this host."""
    if hosts:
        return host_list_slots(hosts)
    if hostfile:
        return hostfile_slots(hostfile)
    return local_slots()
