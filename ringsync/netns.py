"""Several hosts on one machine, for tests: each host a Linux network namespace.

A VirtualHosts is N "hosts", each a network namespace with its own interface (`eth0`), an
address from 198.18.0.0/15 (the range set aside for benchmarking networks, never routed
anywhere), a host name of its own, and a link to a bridge whose egress rate can be limited
(`tc tbf`). mpirun launches ranks on them through a small launch agent script (in the place
of ssh) that enters the host's namespace and UTS namespace, so every rank sees its host's
name and network only::

    with VirtualHosts(2, rate="2gbit") as hosts:
        result = run_mpi(body, np=4, hosts=hosts, slots=2)       # ringsync.testing
        # or: ringsync run -np 4 -H hosts.hosts_arg(2) --mpi-args="..." (see mpirun_args)

Everything made is removed by close() (and by the context manager, also when the body
raises), and namespaces left behind by a process that died without closing are removed
the next time hosts are made. Needs root and the `ip`, `tc` and `unshare` commands:
`unavailable()` says what is missing (tests skip with that reason).

No namespace gets a default route: traffic from the hosts can reach the other hosts and
the bridge's own address (where mpirun listens), nothing else.
"""
from __future__ import annotations

import fcntl
import functools
import ipaddress
import os
import re
import shlex
import shutil
import signal
import subprocess
import tempfile
from typing import Dict, List, Optional, Sequence, Union

NAME_PREFIX = "rsh"  # namespace (= host) names: rsh<owner pid>x<instance>h<i>
_NAME = re.compile(r"^rsh(\d+)x(\d+)h(\d+)$")
_LOCK_PATH = "/run/ringsync-netns.lock"
_SUBNETS = ipaddress.ip_network("198.18.0.0/15")
_HOST_BASE = 10  # host i has address .<10 + i> in its /24; the bridge has .1
_instances = 0


def _base36(n: int) -> str:
    digits = "0123456789abcdefghijklmnopqrstuvwxyz"
    text = ""
    while True:
        n, d = divmod(n, 36)
        text = digits[d] + text
        if n == 0:
            return text


def unavailable() -> Optional[str]:
    """Why hosts cannot be made here (None where they can)."""
    if os.name != "posix" or not os.path.isdir("/proc/self/ns"):
        return "network namespaces need Linux"
    if os.geteuid() != 0:
        return "virtual hosts need root (network namespaces, veth links, tc)"
    for tool in ("ip", "tc", "unshare"):
        if shutil.which(tool) is None:
            return f"virtual hosts need the `{tool}` command, which is not on PATH"
    return _probe()


@functools.lru_cache(maxsize=1)
def _probe() -> Optional[str]:
    """Make (and remove) a namespace, a veth pair and a bridge: a container without the
    privileges for them has the commands but cannot use them."""
    name, link = f"{NAME_PREFIX}{os.getpid()}probe", f"rp{_base36(os.getpid())}"
    steps = [["ip", "netns", "add", name],
             ["ip", "link", "add", link, "type", "veth", "peer", "name", link + "p"],
             ["ip", "link", "set", link + "p", "netns", name],
             ["ip", "link", "add", link + "b", "type", "bridge"]]
    try:
        for step in steps:
            done = subprocess.run(step, capture_output=True, text=True)
            if done.returncode != 0:
                return f"cannot make virtual hosts here: `{shlex.join(step)}`: " \
                       f"{done.stderr.strip()}"
        return None
    finally:
        for undo in (["ip", "link", "del", link + "b"], ["ip", "link", "del", link],
                     ["ip", "netns", "del", name]):
            subprocess.run(undo, capture_output=True)


def _run(*command: str, check: bool = True) -> subprocess.CompletedProcess:
    done = subprocess.run(list(command), capture_output=True, text=True)
    if check and done.returncode != 0:
        raise RuntimeError(f"ringsync.netns: `{shlex.join(command)}` failed "
                           f"(exit {done.returncode}): {done.stderr.strip()}")
    return done


def _in(namespace: str, *command: str, check: bool = True) -> subprocess.CompletedProcess:
    return _run("ip", "netns", "exec", namespace, *command, check=check)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def _namespaces() -> List[str]:
    listing = _run("ip", "netns", "list", check=False).stdout
    return [line.split()[0] for line in listing.splitlines() if line.strip()]


def _kill_inside(namespace: str) -> None:
    pids = _run("ip", "netns", "pids", namespace, check=False).stdout.split()
    for pid in pids:
        try:
            os.kill(int(pid), signal.SIGKILL)
        except (ProcessLookupError, ValueError):
            pass


def _remove_namespace(namespace: str) -> None:
    _kill_inside(namespace)
    _run("ip", "netns", "del", namespace, check=False)  # its veth ends go with it
    shutil.rmtree(f"/etc/netns/{namespace}", ignore_errors=True)


def _remove_stale() -> None:
    """Namespaces (and bridges) of owners that died without cleaning up."""
    for namespace in _namespaces():
        match = _NAME.match(namespace)
        if match and not _pid_alive(int(match.group(1))):
            _remove_namespace(namespace)
    links = _run("ip", "-o", "link", "show", "type", "bridge", check=False).stdout
    for found in re.finditer(r"^\d+: (rb([0-9a-z]+)_[0-9a-z]+)[:@]", links, re.M):
        if not _pid_alive(int(found.group(2), 36)):
            _run("ip", "link", "del", found.group(1), check=False)


def _used_subnets() -> set:
    used = set()
    for namespace in [None] + _namespaces():
        command = ["ip", "-4", "-o", "addr", "show"]
        text = (_run(*command, check=False) if namespace is None
                else _in(namespace, *command, check=False)).stdout
        for found in re.finditer(r"inet (\d+\.\d+\.\d+\.\d+)/", text):
            address = ipaddress.ip_address(found.group(1))
            if address in _SUBNETS:
                used.add(ipaddress.ip_network(f"{address}/24", strict=False))
    return used


def _free_subnets(count: int) -> List[ipaddress.IPv4Network]:
    used = _used_subnets()
    free = [net for net in _SUBNETS.subnets(new_prefix=24) if net not in used]
    if len(free) < count:
        raise RuntimeError("ringsync.netns: no free /24 left in 198.18.0.0/15")
    return free[:count]


class VirtualHosts:
    """`count` hosts (network namespaces) on one bridge; see the module's text.

    rate: each host's egress limit (a `tc` rate such as "2gbit"; None: unlimited).
    extra_interface: give every host a second interface (`eth1`) that reaches nobody,
        and make the host name resolve to that one (tests of address selection).
    """

    def __init__(self, count: int = 2, *, rate: Optional[str] = "2gbit",
                 extra_interface: bool = False, burst: str = "256kb"):
        reason = unavailable()
        if reason:
            raise RuntimeError(f"ringsync.netns: {reason}")
        if not 1 <= count <= 200:
            raise ValueError(f"VirtualHosts: count must be 1..200, got {count}")
        global _instances
        _instances += 1
        self.names = [f"{NAME_PREFIX}{os.getpid()}x{_instances}h{i}" for i in range(count)]
        self._tag = f"{_base36(os.getpid())}_{_base36(_instances)}"  # for interface names
        self.rate, self.burst = rate, burst
        self.bridge = f"rb{self._tag}"
        self.address: Dict[str, str] = {}
        self.unreachable_address: Dict[str, str] = {}
        self._workdir = tempfile.mkdtemp(prefix="ringsync-hosts-")
        self.agent = os.path.join(self._workdir, "agent")
        self._made: List[str] = []
        try:
            with open(_LOCK_PATH, "w") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX)  # two makers must not pick one subnet
                _remove_stale()
                subnets = _free_subnets(2 if extra_interface else 1)
                self._make_bridge(subnets[0])
                for i, name in enumerate(self.names):
                    self._make_host(i, name, subnets[0])
                    if extra_interface:
                        self._add_dead_interface(i, name, subnets[1])
            self._write_hosts_files()
            self._write_agent()
        except BaseException:
            self.close()
            raise

    # ---- building ----

    def _make_bridge(self, subnet) -> None:
        self.subnet = str(subnet)
        self.head_address = str(subnet.network_address + 1)
        _run("ip", "link", "add", self.bridge, "type", "bridge")
        self._made.append(self.bridge)
        _run("ip", "addr", "add", f"{self.head_address}/24", "dev", self.bridge)
        _run("ip", "link", "set", self.bridge, "up")

    def _make_host(self, i: int, name: str, subnet) -> None:
        address = str(subnet.network_address + _HOST_BASE + i)
        _run("ip", "netns", "add", name)
        self._made.append(name)
        outside, inside = self._link_names("e", i)
        _run("ip", "link", "add", outside, "type", "veth", "peer", "name", inside)
        _run("ip", "link", "set", inside, "netns", name)
        _run("ip", "link", "set", outside, "master", self.bridge, "up")
        _in(name, "ip", "link", "set", inside, "name", "eth0")
        _in(name, "ip", "addr", "add", f"{address}/24", "dev", "eth0")
        _in(name, "ip", "link", "set", "eth0", "up")
        _in(name, "ip", "link", "set", "lo", "up")
        self.address[name] = address
        if self.rate:
            self.set_rate(name, self.rate)

    def _add_dead_interface(self, i: int, name: str, subnet) -> None:
        """eth1: up, addressed, but its other end is down and on no bridge."""
        address = str(subnet.network_address + _HOST_BASE + i)
        outside, inside = self._link_names("d", i)
        _run("ip", "link", "add", outside, "type", "veth", "peer", "name", inside)
        _run("ip", "link", "set", inside, "netns", name)
        _in(name, "ip", "link", "set", inside, "name", "eth1")
        _in(name, "ip", "addr", "add", f"{address}/24", "dev", "eth1")
        _in(name, "ip", "link", "set", "eth1", "up")
        self.unreachable_address[name] = address

    def _link_names(self, kind: str, i: int):
        # The root-side end, and a temporary name for the end that moves into the host.
        base = f"r{kind}{self._tag}-{i}"
        if len(base) > 14:  # (15 at most, and the inside end adds a letter)
            raise RuntimeError(f"ringsync.netns: interface name {base!r} is too long")
        return base, base + "p"

    def _write_hosts_files(self) -> None:
        """`ip netns exec` shows /etc/netns/<ns>/hosts as /etc/hosts inside the host."""
        lines = ["127.0.0.1 localhost", f"{self.head_address} {self.bridge}"]
        for name in self.names:
            lines.append(f"{self.unreachable_address.get(name, self.address[name])} {name}")
        text = "\n".join(lines) + "\n"
        for name in self.names:
            os.makedirs(f"/etc/netns/{name}", exist_ok=True)
            with open(f"/etc/netns/{name}/hosts", "w") as f:
                f.write(text)

    def _write_agent(self) -> None:
        # mpirun calls the agent as ssh: the host name, then one shell command string.
        allowed = " ".join(self.names)
        script = f"""#!/bin/sh
# ringsync VirtualHosts launch agent: run "$2..." inside virtual host "$1".
host="$1"; shift
case " {allowed} " in *" $host "*) ;; *) echo "agent: unknown host $host" >&2; exit 255;; esac
exec ip netns exec "$host" unshare --uts /bin/sh -c 'hostname "$0" && eval "$*"' "$host" "$@"
"""
        with open(self.agent, "w") as f:
            f.write(script)
        os.chmod(self.agent, 0o755)

    # ---- using ----

    def hosts_arg(self, slots: Union[int, Sequence[int]] = 1) -> str:
        """mpirun's -H value: every host with `slots` slots (or slots[i] for host i)."""
        counts = [slots] * len(self.names) if isinstance(slots, int) else list(slots)
        return ",".join(f"{n}:{c}" for n, c in zip(self.names, counts) if c > 0)

    def mpirun_args(self) -> List[str]:
        """Open MPI options that launch through the agent and keep MPI's own traffic
        (its daemons, and its TCP transport) on the hosts' network."""
        return ["--prtemca", "plm_ssh_agent", self.agent,
                "--prtemca", "oob_tcp_if_include", self.subnet,
                "--mca", "btl_tcp_if_include", self.subnet]

    def run(self, host: str, command: Sequence[str], check: bool = True
            ) -> subprocess.CompletedProcess:
        """Run a command inside host (its network namespace)."""
        self._check_host(host)
        return _in(host, *command, check=check)

    def set_rate(self, host: str, rate: Optional[str]) -> None:
        """Limit host's egress to rate (None: no limit)."""
        self._check_host(host)
        _in(host, "tc", "qdisc", "del", "dev", "eth0", "root", check=False)
        if rate:
            _in(host, "tc", "qdisc", "add", "dev", "eth0", "root", "tbf", "rate", rate,
                "burst", self.burst, "latency", "100ms")

    def link_down(self, host: str) -> None:
        """Cut host off the network (its eth0 goes down); link_up undoes it."""
        self.run(host, ["ip", "link", "set", "eth0", "down"])

    def link_up(self, host: str) -> None:
        self.run(host, ["ip", "link", "set", "eth0", "up"])
        if self.rate:
            self.set_rate(host, self.rate)

    def pids(self, host: str) -> List[int]:
        """Processes running inside host."""
        self._check_host(host)
        return [int(p) for p in _run("ip", "netns", "pids", host, check=False).stdout.split()]

    def _check_host(self, host: str) -> None:
        if host not in self.names:
            raise ValueError(f"VirtualHosts: no host {host!r} (hosts: {self.names})")

    # ---- tearing down ----

    def close(self) -> None:
        """Remove every namespace, link and file made; safe to call twice."""
        for made in reversed(self._made):
            if made == self.bridge:
                _run("ip", "link", "del", made, check=False)
            else:
                _remove_namespace(made)
        self._made = []
        shutil.rmtree(self._workdir, ignore_errors=True)

    def __enter__(self) -> "VirtualHosts":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<VirtualHosts {self.names} on {getattr(self, 'subnet', '?')}>"
