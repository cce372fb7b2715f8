"""What this process holds, counted before and after many cycles of building and tearing
down rings, to tell a leak from a steady state (tests/unit/test_leaks.py,
benchmarks/leaks.py).

    before = ResourceSnapshot.take()
    ...                                    # 1,000 init/shutdown cycles
    after = ResourceSnapshot.take()
    problems = after.leaks_since(before, rss_slack_mib=64)

Counted: open file descriptors (all, and by kind: sockets, shared-memory segments, other),
threads (Python's threading.enumerate(), and the kernel's /proc/self/task, which also sees
the native engines' threads), ringsync's shared-memory segments (named
``ringsync-<job>-<rank>-<pid>`` by native/src/transport_shm.c: still in /dev/shm with this
pid, and still mapped in this process, which an unlinked segment stays until munmap), and
resident memory (VmRSS). Linux only (/proc).

The loops measured: init_shutdown_cycles (thread-rank communicators built, used and shut
down) and elastic_recoveries (ElasticJob: thread ranks over ringsync's store that lose a
rank and recover, again and again).
"""
import gc
import os
import re
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from typing import Dict, List

import numpy as np

from ringsync import Communicator, Config, ReduceOp
from ringsync.elastic import _Recovery
from ringsync.errors import CommunicationError
from ringsync.rendezvous_store import StoreRendezvous
from ringsync.store import StoreClient, StoreServer
from tests.thread_ranks import PATHS, assert_ranks_ok

SHM_DIR = "/dev/shm"
SEGMENT = re.compile(r"ringsync-[0-9a-f]{16}-\d+-(\d+)")  # transport_shm.c segment_name


def fd_kinds() -> Dict[str, int]:
    """Open descriptors of this process by what they point at."""
    kinds: Dict[str, int] = {}
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue  # (the descriptor listdir itself used, closed by now)
        kind = _fd_kind(target)
        kinds[kind] = kinds.get(kind, 0) + 1
    return kinds


def _fd_kind(target: str) -> str:
    if target.startswith("socket:"):
        return "socket"
    if target.startswith(SHM_DIR + "/"):
        return "shm"
    if target.startswith("pipe:"):
        return "pipe"
    if target.startswith("anon_inode:"):
        return "anon_inode"  # eventfd, epoll, timerfd
    return "file"


def segment_files(pid: int) -> List[str]:
    """ringsync segments in /dev/shm whose name says `pid` made them."""
    try:
        names = os.listdir(SHM_DIR)
    except OSError:
        return []
    return sorted(n for n in names if (m := SEGMENT.fullmatch(n)) and int(m.group(1)) == pid)


def orphaned_segments() -> List[str]:
    """ringsync segments in /dev/shm whose maker is no longer running: leaked. (A segment
    of a live process may belong to another job on this machine, still in use.)"""
    try:
        names = os.listdir(SHM_DIR)
    except OSError:
        return []
    return sorted(n for n in names
                  if (m := SEGMENT.fullmatch(n)) and not _running(int(m.group(1))))


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # (another user's process: running)
    return True


def mapped_segments() -> int:
    """Distinct ringsync segments mapped into this process (unlinked ones included)."""
    seen = set()
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split(maxsplit=5)  # address perms offset dev inode [path]
            path = fields[5].strip() if len(fields) == 6 else ""
            name = os.path.basename(path.replace(" (deleted)", ""))
            if path.startswith(SHM_DIR + "/") and SEGMENT.fullmatch(name):
                seen.add(name)
    return len(seen)


def rss_mib() -> float:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024.0
    return 0.0


@dataclass
class ResourceSnapshot:
    fds: int
    fd_kinds: Dict[str, int]
    python_threads: int
    native_threads: int  # every thread of the process (/proc/self/task)
    thread_names: List[str]
    shm_files: List[str]
    shm_mapped: int
    rss_mib: float

    @classmethod
    def take(cls) -> "ResourceSnapshot":
        gc.collect()  # (what only a cycle holds would otherwise count as kept)
        kinds = fd_kinds()
        threads = threading.enumerate()
        return cls(fds=sum(kinds.values()), fd_kinds=kinds, python_threads=len(threads),
                   native_threads=len(os.listdir("/proc/self/task")),
                   thread_names=sorted(t.name for t in threads),
                   shm_files=segment_files(os.getpid()), shm_mapped=mapped_segments(),
                   rss_mib=rss_mib())

    @classmethod
    def settled(cls, baseline: "ResourceSnapshot", wait_s: float = 10.0,
                rss_slack_mib: float = 64.0) -> "ResourceSnapshot":
        """A snapshot taken once nothing is over `baseline`, or after wait_s: threads
        that were told to end (a store connection's, once its client left) may still be
        on their way out, and a leak is what stays."""
        deadline = time.monotonic() + wait_s
        while True:
            now = cls.take()
            if not now.leaks_since(baseline, rss_slack_mib) or time.monotonic() >= deadline:
                return now
            time.sleep(0.05)

    def leaks_since(self, before: "ResourceSnapshot", rss_slack_mib: float = 64.0,
                    slack: int = 0) -> List[str]:
        """What grew since `before`, in words (empty: nothing leaked). Counts may grow by
        `slack`; resident memory by rss_slack_mib."""
        problems = []
        for what in ("fds", "python_threads", "native_threads", "shm_mapped"):
            was, now = getattr(before, what), getattr(self, what)
            if now > was + slack:
                problems.append(f"{what}: {was} -> {now}")
        if problems and self.fds > before.fds:
            problems.append(f"descriptors by kind: {before.fd_kinds} -> {self.fd_kinds}")
        if self.thread_names != before.thread_names and self.python_threads > before.python_threads:
            problems.append(f"threads: {_grown(before.thread_names, self.thread_names)} more")
        if set(self.shm_files) - set(before.shm_files):
            problems.append(f"segments left in {SHM_DIR}: "
                            f"{sorted(set(self.shm_files) - set(before.shm_files))}")
        if self.rss_mib > before.rss_mib + rss_slack_mib:
            problems.append(f"resident memory: {before.rss_mib:.1f} -> {self.rss_mib:.1f} MiB "
                            f"(more than {rss_slack_mib:g} MiB more)")
        return problems

    def row(self) -> Dict[str, object]:
        """The figures, for a table."""
        return {"fds": self.fds, "sockets": self.fd_kinds.get("socket", 0),
                "threads": self.python_threads, "tasks": self.native_threads,
                "shm mapped": self.shm_mapped, "shm files": len(self.shm_files),
                "RSS MiB": round(self.rss_mib, 1)}


def _grown(before: List[str], after: List[str]) -> Dict[str, int]:
    """Thread names (their text up to a number) and how many more of each."""
    def counts(names):
        out: Dict[str, int] = {}
        for name in names:
            key = re.sub(r"\d+", "N", name)
            out[key] = out.get(key, 0) + 1
        return out
    old, new = counts(before), counts(after)
    return {k: n - old.get(k, 0) for k, n in new.items() if n > old.get(k, 0)}


# --------------------------------------------------------------------------- the loops

# Every way same-host thread ranks move data (tests/thread_ranks.py PATHS): the lane and
# staged segments, TCP alone, the engine over the shared-memory rings.
CYCLE_PATHS = ("shm", "tcp", "shm-ring", "staged")
RING_ENV = {"RINGSYNC_TIMEOUT_SECONDS": "60"}


def checked_allreduce(comm, cycle: int, n: int = 1000, name: str = "leaks.step") -> None:
    """One blocking allreduce of data that differs by rank, position and cycle, compared
    with the sum of every rank's input."""
    base = np.arange(n, dtype=np.int64)
    got = comm.allreduce(base * (comm.rank() + 1) + cycle, op=ReduceOp.SUM, name=name)
    want = sum(base * (r + 1) + cycle for r in range(comm.size()))
    if not np.array_equal(got, want):
        bad = int(np.flatnonzero(got != want)[0])
        raise AssertionError(f"rank {comm.rank()} cycle {cycle}: element {bad} is {got[bad]}, "
                             f"not {want[bad]}")


def one_cycle_body(comm, cycle: int) -> str:
    """A rank's life in one init/shutdown cycle: a blocking allreduce (the same-host lane
    where there is one) and an asynchronous one (always through the engine's thread)."""
    checked_allreduce(comm, cycle)
    x = np.full(33, comm.rank() + 1 + cycle, dtype=np.float64)
    total = comm.synchronize(comm.allreduce_async(x, op=ReduceOp.SUM, name="leaks.async"))
    want = sum(r + 1 + cycle for r in range(comm.size()))
    if not np.array_equal(total, np.full(33, want, dtype=np.float64)):
        raise AssertionError(f"rank {comm.rank()} cycle {cycle}: async sum {total[:3]}..., "
                             f"not {want}")
    return comm.transport


def init_shutdown_cycles(count: int, first: int = 0, size: int = 2,
                         paths=CYCLE_PATHS) -> None:
    """`count` cycles of `size` thread-rank communicators built, used and shut down, each
    cycle over the next of `paths`."""
    for cycle in range(first, first + count):
        path = paths[cycle % len(paths)]
        assert_ranks_ok(one_cycle_body, size, timeout=120, env={**RING_ENV, **PATHS[path]},
                        args=(cycle,))


# Elastic recovery in one process, as `ringsync run --launcher local --elastic --respawn`
# does it across processes: the ranks meet through ringsync's own store (served here, as
# the launcher serves it), each over a connection of its own, whose end is how the others
# learn that a rank died.
ELASTIC_SECRET = b"ringsync-leak-test-job-secret-0123"
ELASTIC_ENV = {"RINGSYNC_ELASTIC": "1", "RINGSYNC_ELASTIC_RESPAWN": "1",
               "RINGSYNC_TIMEOUT_SECONDS": "30", "RINGSYNC_START_TIMEOUT_SECONDS": "30"}
STORE_TIMEOUT_S = 30.0


class ElasticJob:
    """`size` thread ranks that lose a rank `recoveries` times and recover each time.

    Cycle c: every rank allreduces (checked); then rank c % size starts its replacement
    (a thread that registers in the store, as a rank the launcher restarts), waits until
    it is registered, and dies: its ring is freed without an abort notice and its store
    connection closed, which is what the kernel does to a killed process (its sockets
    close; its liveness key in the store drops). The survivors' next allreduce fails with
    CommunicationError, and they recover as ringsync.elastic.run does
    (_Recovery.recover): abort the old ring, agree on the survivors through the store,
    admit the waiting replacement, build a new ring of `size` in the same threads.
    The replacement learns the cycle from the new rank 0."""

    def __init__(self, server, recoveries: int, size: int = 3):
        self.server, self.recoveries, self.size = server, recoveries, size
        self.config = Config.from_env(ELASTIC_ENV)
        self.errors: List[str] = []
        self.recovered = 0  # recoveries completed, over every survivor
        self.keys_seen: List[int] = []  # keys in the store at each cycle's start (rank 0)
        self._threads: List[threading.Thread] = []
        self._lock = threading.Lock()

    def run(self, deadline_s: float = 300.0) -> None:
        """Run to the end; AssertionError with every failure (and where every live thread
        was, if the deadline passed)."""
        for rank in range(self.size):
            self._start(self._founder, rank)
        deadline = time.monotonic() + deadline_s
        while time.monotonic() < deadline:
            with self._lock:
                alive = [t for t in self._threads if t.is_alive()]
            if not alive:
                break
            alive[0].join(min(1.0, max(0.0, deadline - time.monotonic())))
        else:
            self.errors.append("the deadline passed; live threads:\n" + self._stacks())
            self.server.close()  # (every store wait fails; the rings time out)
        if self.errors:
            raise AssertionError("\n".join(self.errors))

    def _stacks(self) -> str:
        frames = sys._current_frames()
        with self._lock:
            alive = [t for t in self._threads if t.is_alive()]
        return "\n".join(f"--- {t.name}\n" + "".join(traceback.format_stack(frames[t.ident]))
                         for t in alive if t.ident in frames)

    def _start(self, target, *args) -> None:
        with self._lock:
            name = f"elastic-rank-{len(self._threads)}"
            thread = threading.Thread(target=self._guarded, args=(target, *args), daemon=True,
                                      name=name)
            self._threads.append(thread)
        thread.start()

    def _guarded(self, target, *args) -> None:
        try:
            target(*args)
        except BaseException:
            self.errors.append(f"--- {threading.current_thread().name}: FAILED\n"
                               + traceback.format_exc())

    def _client(self):
        host, port = self.server.address
        return StoreClient(host, port, ELASTIC_SECRET, timeout=STORE_TIMEOUT_S)

    def _founder(self, rank: int) -> None:
        client = self._client()
        rendezvous = StoreRendezvous(client, rank, self.size, timeout=STORE_TIMEOUT_S,
                                     secret=ELASTIC_SECRET, owns_store=True, elastic=True)
        self._live(Communicator(rendezvous=rendezvous, config=self.config), client, 0)

    def _replacement(self) -> None:
        client = self._client()
        rendezvous = StoreRendezvous.join(client, ELASTIC_SECRET, timeout=STORE_TIMEOUT_S)
        self._live(Communicator(rendezvous=rendezvous, config=self.config), client, -1)

    def _live(self, comm, client, cycle: int) -> None:
        recovery = _Recovery(self.config, comm)
        while True:
            cycle = _rank0s_cycle(comm, cycle)
            if comm.rank() == 0:
                self.keys_seen.append(len(passing_keys(store_keys(self.server))))
            try:
                checked_allreduce(comm, cycle)
                if cycle == self.recoveries:
                    comm.shutdown()
                    return
                if comm.rank() == cycle % self.size:
                    return self._die(comm, client)
                checked_allreduce(comm, cycle, name="leaks.lost")  # the victim never comes
                raise AssertionError(f"rank {comm.rank()} cycle {cycle}: an allreduce without "
                                     f"the dead rank succeeded")
            except CommunicationError as lost:
                comm = recovery.recover(lost, commit_id=0)
                cycle += 1
                with self._lock:
                    self.recovered += 1

    def _die(self, comm, client) -> None:
        rendezvous = comm.rendezvous
        self._start(self._replacement)
        deadline = time.monotonic() + STORE_TIMEOUT_S
        while rendezvous.joiners_waiting() == 0:  # (else the survivors would not wait for it)
            if time.monotonic() > deadline:
                raise AssertionError("the replacement never registered in the store")
            time.sleep(0.002)
        comm._ring.destroy()  # no abort notice: the peers see their sockets close
        client.close()


def _rank0s_cycle(comm, cycle: int) -> int:
    """Every rank takes rank 0's cycle (a replacement knows none yet)."""
    mine = np.array([cycle], dtype=np.int64)
    return int(comm.broadcast(mine, 0, name="leaks.cycle")[0])


def store_keys(server) -> List[str]:
    """The keys a StoreServer holds now (its table is private: this is a test's look)."""
    with server._table._changed:
        return sorted(server._table._values)


# What a store must keep for good: each recovery's decision on the survivors (a rank
# that comes late to it must still learn that it was left out) and the count of
# replacements (rendezvous_store.py).
_KEPT = re.compile(r".*/shrink/decision|.*/join/(count|taken)")


def passing_keys(keys: List[str]) -> List[str]:
    """The keys that are not kept for good: per-generation and per-exchange ones."""
    return [k for k in keys if not _KEPT.fullmatch(k)]


def elastic_recoveries(count: int, size: int = 3) -> Dict[str, object]:
    """A job of `size` thread ranks that recovers `count` times: how many recoveries the
    survivors made, the keys the store held at each cycle's start (those not kept for
    good) and at the end (all of them)."""
    with StoreServer(ELASTIC_SECRET) as server:
        job = ElasticJob(server, count, size)
        job.run()
        _wait_until_clients_left(server)  # (their held keys go as the server sees them go)
        return {"recovered": job.recovered, "keys_seen": job.keys_seen,
                "store_keys": store_keys(server)}


def _wait_until_clients_left(server, wait_s: float = 10.0) -> None:
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        with server._lock:
            if not server._connections:
                return
        time.sleep(0.01)
