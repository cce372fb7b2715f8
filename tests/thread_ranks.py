"""Ranks as threads of this one process: collective tests without mpirun.

    outcomes = run_ranks(body, size=4, env={"RINGSYNC_TRANSPORT": "tcp"})

starts `size` threads; each builds its own Communicator over a ThreadRendezvous with its
own Config (from `env`, plus `rank_env(rank)`; never from os.environ, which all threads
share), runs `body(comm, *args)` and shuts the communicator down. The native core keeps no
process-wide state and releases the GIL while it works, so blocking collectives on several
threads meet as they would in several processes. Bodies must use their `comm` only: the
module-level API (ringsync.init() and friends) has one default communicator per process.

A rank whose body raises aborts its communicator, so its peers fail promptly instead of
waiting for it. A deadline turns a hang into a failure: the report then shows where each
live thread was, and their engines are aborted so that the threads unwind.
"""
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional

from ringsync import Communicator, Config
from ringsync._native import ffi, lib
from ringsync.rendezvous import ThreadGroup

UNWIND_GRACE_S = 10.0  # after the deadline: time for aborted ranks to return

# How same-host ranks move data: the default (shared memory; blocking small allreduces on
# the lane, large allreduces staged through the segments), TCP only, the engine over the
# shared-memory transport (as between hosts; blocking calls negotiated by name), and every
# allreduce staged.
PATHS = {
    "shm": {"RINGSYNC_TRANSPORT": "shm"},
    "tcp": {"RINGSYNC_TRANSPORT": "tcp"},
    "shm-ring": {"RINGSYNC_TRANSPORT": "shm", "RINGSYNC_LANE_BYTES": "0",
                 "RINGSYNC_STAGED_BYTES": "0"},
    "staged": {"RINGSYNC_TRANSPORT": "shm", "RINGSYNC_LANE_BYTES": "0",
               "RINGSYNC_STAGED_BYTES": "1"},
}


@dataclass
class RankOutcome:
    rank: int
    value: Any = None
    error: Optional[str] = None  # the traceback, if the rank raised
    stack: Optional[str] = None  # where the thread was when the deadline passed

    @property
    def ok(self) -> bool:
        return self.error is None and self.stack is None


class _Ranks:
    """Per-rank threads, outcomes and communicators of one run."""

    def __init__(self, size: int, timeout: float):
        self.size, self.timeout = size, timeout
        self.group = ThreadGroup(size, timeout)
        self.outcomes = [RankOutcome(r) for r in range(size)]
        self.comms: List[Optional[Communicator]] = [None] * size
        # Held while a rank closes its communicator: the deadline's abort must not reach
        # an engine that is being freed.
        self.closing = [threading.Lock() for _ in range(size)]

    def run(self, fn: Callable[[int], Any]) -> List[RankOutcome]:
        threads = [threading.Thread(target=self._thread_main, args=(fn, r), daemon=True,
                                    name=f"rank-{r}") for r in range(self.size)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + self.timeout
        for t in threads:
            t.join(max(0.0, deadline - time.monotonic()))
        if any(t.is_alive() for t in threads):
            self._interrupt(threads)
        return self.outcomes

    def _thread_main(self, fn, rank: int) -> None:
        try:
            self.outcomes[rank].value = fn(rank)
        except BaseException:
            self.outcomes[rank].error = traceback.format_exc()
            self.group.abort()  # peers still exchanging setup data must not wait for us

    def adopt(self, rank: int, comm: Communicator) -> None:
        with self.closing[rank]:
            self.comms[rank] = comm

    def close(self, rank: int, how: Callable[[], None]) -> None:
        """Shut down (or abort) rank's communicator, out of the deadline's reach."""
        with self.closing[rank]:
            self.comms[rank] = None
            how()

    def _interrupt(self, threads) -> None:
        """The deadline passed: record where each live thread is, then abort every engine
        still open (safe from any thread) so that the ranks' calls return."""
        frames = sys._current_frames()
        for r, t in enumerate(threads):
            if t.is_alive() and t.ident in frames:
                self.outcomes[r].stack = "".join(traceback.format_stack(frames[t.ident]))
        self.group.abort()
        for r in range(self.size):
            if self.closing[r].acquire(blocking=False):
                try:
                    comm = self.comms[r]
                    engine = comm._ring.engine if comm is not None else ffi.NULL
                    if engine != ffi.NULL:
                        lib.rs_engine_abort(engine, b"the test's deadline passed")
                finally:
                    self.closing[r].release()
        unwound = time.monotonic() + UNWIND_GRACE_S
        for t in threads:
            t.join(max(0.0, unwound - time.monotonic()))


def rank_config(env: Optional[Dict[str, str]], rank_env, rank: int) -> Config:
    environ = dict(env or {})
    environ.update((rank_env(rank) if rank_env else None) or {})
    return Config.from_env(environ=environ)


def run_threads(fn: Callable, size: int, timeout: float = 120.0) -> List[RankOutcome]:
    """fn(rendezvous) on `size` threads, each with its rank's ThreadRendezvous; every rank's
    outcome. For tests of setups that fail: fn builds (and closes) its Communicator itself."""
    ranks = _Ranks(size, timeout)
    return ranks.run(lambda rank: fn(ranks.group.rendezvous(rank)))


def run_ranks(body: Callable, size: int, env: Optional[Dict[str, str]] = None,
              rank_env: Optional[Callable[[int], Dict[str, str]]] = None,
              timeout: float = 120.0, args=()) -> List[RankOutcome]:
    """body(comm, *args) on `size` thread-ranks, each with its own Communicator."""
    ranks = _Ranks(size, timeout)

    def rank_main(rank: int):
        comm = Communicator(rendezvous=ranks.group.rendezvous(rank),
                            config=rank_config(env, rank_env, rank))
        ranks.adopt(rank, comm)
        try:
            value = body(comm, *args)
        except BaseException:
            ranks.close(rank, lambda: comm.abort(f"rank {rank} failed in the test"))
            raise
        ranks.close(rank, comm.shutdown)
        return value

    return ranks.run(rank_main)


def report(outcomes: List[RankOutcome], what: str, timeout: float) -> str:
    lines = [f"{what} on {len(outcomes)} thread-ranks:"]
    for o in outcomes:
        if o.ok:
            lines.append(f"--- rank {o.rank}: ok")
            continue
        if o.stack:
            lines.append(f"--- rank {o.rank}: still running after {timeout:g} s, at\n{o.stack}")
        if o.error:
            lines.append(f"--- rank {o.rank}: FAILED\n{o.error.rstrip()}")
    return "\n".join(lines)


def assert_ok(outcomes: List[RankOutcome], what: str, timeout: float) -> List[Any]:
    if not all(o.ok for o in outcomes):
        raise AssertionError(report(outcomes, what, timeout))
    return [o.value for o in outcomes]


def assert_ranks_ok(body: Callable, size: int, timeout: float = 120.0, **kwargs) -> List[Any]:
    """run_ranks that raises AssertionError (showing every rank) unless every rank
    succeeded; returns every rank's value."""
    outcomes = run_ranks(body, size, timeout=timeout, **kwargs)
    return assert_ok(outcomes, getattr(body, "__name__", repr(body)), timeout)
