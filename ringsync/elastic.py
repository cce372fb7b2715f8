"""Elastic training: when a rank dies, the survivors go on without it (or with a replacement).

    import ringsync.torch as hvd
    hvd.init()
    state = hvd.elastic.TorchState(model, optimizer, epoch=0, batch=0)

    @hvd.elastic.run
    def train(state):
        ...                      # training steps
        state.commit()           # every few steps: the point a failure rolls back to

    train(state)

Launched with ``ringsync run --elastic -np 4 --min-np 2 [--respawn] python train.py``
(Open MPI's ``mpirun --with-ft ulfm``), or without MPI with ``ringsync run --launcher
local|ssh --elastic`` (a store rendezvous, rendezvous_store.py). When a rank dies, the
survivors' next collective raises CommunicationError. run() catches it and each survivor:
aborts the old ring (so every peer fails fast too), agrees on who is left (ULFM's revoke
and shrink, or through the store), optionally takes in replacements, rebuilds the ring,
rolls back to the newest
commit every survivor holds, calls the reset callbacks, syncs the state from the new
rank 0, and calls the training function again. rank() and size() report the new values.
"""
import copy
import functools
import os
import subprocess
import sys
import time
from typing import Callable, Iterable, List

from . import basics as _rs

from . import bootstrap
from .config import Config, log_enabled
from ._context import resolve
from ._core import Communicator
from .errors import CommunicationError, HostsUpdatedInterrupt, StoreLostError, UsageError
from .objects import broadcast_object
from .rendezvous import FaultTolerance


class State:
    """Training state that survives a lost rank: commit() takes a snapshot (a local
    copy, no communication), restore() rolls back to one, sync() makes every rank's live
    state equal to rank 0's. Subclasses say how to snapshot, load and broadcast.

    A subclass written for Horovod's State instead (overriding save(), restore() and
    sync(), perhaps reset(), and calling super().__init__(bcast_object, get_rank)) works
    unchanged: commit() calls its save(), recovery calls its restore() and sync(), and
    on_reset() its reset(). Each rank then rolls back to its own last save, and sync()
    makes rank 0's the state of all (Horovod's semantics)."""

    def __init__(self, bcast_object=None, get_rank=None):
        """bcast_object, get_rank: accepted for Horovod's signature (ringsync's own
        broadcast_object and rank are used; a Horovod-style subclass may call them as
        self._bcast_object / self._rank)."""
        self._reset_callbacks: List[Callable[[], None]] = []
        self._commit_id = 0
        self._bcast_object = bcast_object or broadcast_object
        self._rank = get_rank or _rs.rank
        self._snapshots = {}
        if type(self).snapshot is not State.snapshot:  # (a Horovod-style one saves itself)
            self._snapshots[0] = self.snapshot()

    # ---- what a subclass provides ----

    def snapshot(self):
        """A copy of the live state that later changes to it do not touch."""
        raise NotImplementedError

    def load_snapshot(self, snapshot) -> None:
        """Make the live state equal to a snapshot (which must stay untouched)."""
        raise NotImplementedError

    def broadcast_state(self, root_rank: int) -> None:
        """Overwrite the live state on every rank with root_rank's."""
        raise NotImplementedError

    # ---- the protocol ----

    @property
    def commit_id(self) -> int:
        """How many commits this state has had (the same on every rank after sync())."""
        return self._commit_id

    def register_reset_callbacks(self, callbacks: Iterable[Callable[[], None]]) -> None:
        """Functions called after every recovery, once size() and rank() have their new
        values and before the state is synced (e.g. to rescale the learning rate)."""
        self._reset_callbacks.extend(callbacks)

    def on_reset(self) -> None:
        """After a recovery: reset(), then the reset callbacks, in order."""
        self.reset()
        for callback in self._reset_callbacks:
            callback()

    def reset(self) -> None:
        """Horovod's hook for what must change with the ranks (nothing by default)."""

    def commit(self) -> None:
        """Remember the live state as the point a failure rolls back to."""
        self._commit_id += 1
        self.save()
        self.check_host_updates()

    def save(self) -> None:
        """Horovod's name for what commit() does locally: a snapshot of the live state."""
        self._snapshots[self._commit_id] = self.snapshot()
        # Every training step needs every rank, so no survivor is more than one commit
        # ahead of another: the newest two snapshots are all recovery can ask for.
        self._snapshots.pop(self._commit_id - 2, None)

    def check_host_updates(self) -> None:
        """With host discovery (--host-discovery-script), after every commit: rank 0's
        latest view of the hosts is shared, and where it differs from the job's, every
        rank raises HostsUpdatedInterrupt, which run() answers in order: ranks on a host
        that went away (or past its slots) leave the job, ranks start on new slots, and
        training goes on from this commit's state (no roll-back). Without discovery:
        nothing to check."""
        if not _rs.is_initialized():
            return
        comm = resolve()
        self._admit_replacements(comm)
        if not hasattr(self, "_discovery"):
            self._discovery = HostDiscovery.from_config(comm.config)
        if self._discovery is None:
            return
        wanted = broadcast_object(self._discovery.poll() if comm.rank() == 0 else None, 0,
                                  name="ringsync.elastic.hosts")
        if wanted is None:
            return
        plan = host_plan(comm.host_names, wanted, self._discovery.max_np)
        if plan.leaving or plan.adding:
            raise HostsUpdatedInterrupt(skip_sync=False, hosts=plan.adding,
                                        leaving=plan.leaving)

    def _admit_replacements(self, comm) -> None:
        """Under a store rendezvous: replacement ranks waiting to join (restarted by the
        launcher, or started by a scheduler) join the job now, at this commit, with no
        roll-back, up to RINGSYNC_ELASTIC_MAX_NP."""
        rendezvous = comm.rendezvous
        if not getattr(rendezvous, "recoverable", False) or \
                not hasattr(rendezvous, "joiners_waiting"):
            return
        waiting = broadcast_object(rendezvous.joiners_waiting() if comm.rank() == 0 else 0,
                                   0, name="ringsync.elastic.joiners")
        room = (comm.config.elastic_max_np or float("inf")) - comm.size()
        if waiting and room > 0:
            raise HostsUpdatedInterrupt(skip_sync=False,
                                        hosts={"(replacements)": int(min(waiting, room))})

    def _roll_back(self, commit_id) -> None:
        """Recovery's roll-back: to commit_id (the newest every survivor holds), or, for a
        Horovod-style subclass, through its own restore()."""
        if type(self).restore is not State.restore:
            self.restore()
        else:
            self.restore(commit_id)

    def restore(self, commit_id=None) -> None:
        """Roll the live state back to a commit (the newest by default)."""
        commit_id = self._commit_id if commit_id is None else commit_id
        if commit_id not in self._snapshots:
            raise UsageError(f"ringsync.elastic: commit {commit_id} is not held on rank "
                             f"{_rs.rank() if _rs.is_initialized() else '?'} (it holds "
                             f"{sorted(self._snapshots)})")
        self.load_snapshot(self._snapshots[commit_id])
        self._commit_id = commit_id
        for newer in [c for c in self._snapshots if c > commit_id]:
            del self._snapshots[newer]

    def sync(self) -> None:
        """Every rank takes rank 0's live state and commit count, which also becomes
        everyone's newest commit (a replacement rank has nothing else to roll back to)."""
        self._commit_id = broadcast_object(self._commit_id, 0, name="ringsync.elastic.commit")
        self.broadcast_state(0)
        self._snapshots = {self._commit_id: self.snapshot()}


class HostDiscovery:
    """Rank 0's view of the available hosts: the discovery script's output, {host: slots},
    refreshed at most every `interval` seconds (the last good answer in between, or when
    the script fails: it is logged, never fatal)."""

    def __init__(self, script: str, interval: float, max_np: int = 0, slots_per_host: int = 1):
        self.script, self.interval, self.max_np = script, interval, max_np
        self.slots_per_host = slots_per_host
        self._last, self._when = None, -float("inf")

    @classmethod
    def from_config(cls, config: Config):
        if not config.elastic_discovery_script:
            return None
        return cls(config.elastic_discovery_script, config.elastic_discovery_seconds,
                   config.elastic_max_np, config.elastic_slots_per_host)

    def poll(self):
        if time.monotonic() - self._when < self.interval:
            return self._last
        self._when = time.monotonic()
        try:
            done = subprocess.run([self.script], capture_output=True, text=True, timeout=30)
            if done.returncode != 0:
                raise RuntimeError(f"exit status {done.returncode}: {done.stderr.strip()}")
            self._last = parse_hosts(done.stdout, self.slots_per_host)
        except (OSError, RuntimeError, ValueError, subprocess.TimeoutExpired) as e:
            _log(f"host discovery script {self.script!r} failed ({e}); keeping the last "
                 "list of hosts")
        return self._last


def parse_hosts(text: str, slots_per_host: int = 1) -> dict:
    """`host:slots` (or `host`: slots_per_host slots) per line -> {host: slots}, in order."""
    hosts = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        host, _, slots = line.partition(":")
        count = int(slots) if slots else slots_per_host
        if not host or count < 0:
            raise ValueError(f"bad host line {line!r} (expected host:slots)")
        hosts[host] = hosts.get(host, 0) + count
    return hosts


class HostPlan:
    """What a new list of hosts means for the ranks now: `leaving` (ranks on hosts gone,
    or past their host's slots), `adding` ({host: new ranks}, within max_np)."""

    def __init__(self, leaving, adding):
        self.leaving, self.adding = leaving, adding


def host_plan(host_names, wanted: dict, max_np: int = 0) -> HostPlan:
    seen, leaving = {}, []
    for rank, host in enumerate(host_names):
        seen[host] = seen.get(host, 0) + 1
        if seen[host] > wanted.get(host, 0):
            leaving.append(rank)
    room = (max_np or float("inf")) - (len(host_names) - len(leaving))
    adding = {}
    for host, slots in wanted.items():
        extra = int(min(slots - seen.get(host, 0), room))
        if extra > 0:
            adding[host] = extra
            room -= extra
    return HostPlan(leaving, adding)


def capture(value):
    """A snapshot of one value: its state_dict() when it has one (samplers, LR
    schedulers), else a deep copy."""
    if hasattr(value, "state_dict") and hasattr(value, "load_state_dict"):
        return copy.deepcopy(value.state_dict())
    return copy.deepcopy(value)


def _load_into(owner, name: str, saved) -> None:
    current = getattr(owner, name, None)
    if hasattr(current, "state_dict") and hasattr(current, "load_state_dict"):
        current.load_state_dict(copy.deepcopy(saved))
    else:
        setattr(owner, name, copy.deepcopy(saved))


class ObjectState(State):
    """State made of picklable Python values given as keyword arguments, which become
    attributes: ``state = ObjectState(epoch=0, batch=0)``, then ``state.epoch += 1``.
    Values with state_dict()/load_state_dict() (an ElasticSampler, an LR scheduler) are
    saved and restored through those."""

    def __init__(self, bcast_object=None, get_rank=None, **kwargs):
        """bcast_object, get_rank: accepted for Horovod's ObjectState signature."""
        self._object_names = list(kwargs)
        for name, value in kwargs.items():
            setattr(self, name, value)
        super().__init__(bcast_object, get_rank)

    def snapshot(self):
        return {name: capture(getattr(self, name)) for name in self._object_names}

    def load_snapshot(self, snapshot) -> None:
        for name, saved in snapshot.items():
            _load_into(self, name, saved)

    def broadcast_state(self, root_rank: int) -> None:
        # The keyword values only (ObjectState's own methods, not a subclass's): a
        # subclass broadcasts its model or variables itself, and a sharded one's parts
        # differ by rank.
        values = broadcast_object(ObjectState.snapshot(self), root_rank,
                                  name="ringsync.elastic.objects")
        ObjectState.load_snapshot(self, values)


# --------------------------------------------------------------------------- recovery


def run(func):
    """Decorator for the training function ``func(state, ...)``. Syncs the state, runs
    func, and on a lost rank recovers and runs it again from the restored commit. It
    works on the default communicator (ringsync.init()'s): recovery hands back a new one,
    which becomes the default, so that rank(), size() and every collective use it."""

    @functools.wraps(func)
    def wrapper(state: State, *args, **kwargs):
        comm = resolve()
        recovery = _Recovery(comm.config, comm)
        while True:
            try:
                state.sync()
                return func(state, *args, **kwargs)
            except HostsUpdatedInterrupt as interrupt:
                recovery.resize(interrupt.leaving, interrupt.hosts, install=_rs.install)
                state.on_reset()
            except Exception as error:
                if not _is_rank_failure(error, recovery.comm):
                    raise
                recovery.recover(error, state.commit_id, install=_rs.install)
                state._roll_back(recovery.commit)
                state.on_reset()
                recovery.report()

    return wrapper


def _is_rank_failure(error: BaseException, comm) -> bool:
    """A failure of the ring or of MPI, even where a framework re-raised it as its own
    error type (TensorFlow wraps exceptions raised inside its ops); not the loss of the
    store the job meets through, which no recovery can mend."""
    if isinstance(error, StoreLostError):
        return False
    if isinstance(error, CommunicationError):
        return True
    # Only where MPI is in use already: importing mpi4py.MPI initialises MPI, which in a
    # rank started without mpirun makes a singleton job (its own segments in /dev/shm,
    # left behind if the rank is killed later; seen in benchmarks/chaos.py).
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is not None and isinstance(error, mpi.Exception):
        return True
    return comm is not None and comm.broken


def _leave(rank: int, host_names) -> None:
    """A rank whose host is no longer offered ends here, once the others have split away
    from it. Not through MPI_Finalize: Open MPI's waits for every connected rank (hangs
    while the others go on, as does MPI_Comm_disconnect), and a plain exit without it is
    "improper" and can make mpirun end the whole job. Killed, it is a failure that MPI's
    fault tolerance expects. (Seen with Open MPI 5: when such a rank was started by
    MPI_Comm_spawn, mpirun still ends the job with status 137 and "UNSUPPORTED DAEMON
    ERROR STATE: NO PATH TO TARGET" after the others finish well.)"""
    _log(f"rank {rank} on host {host_names[rank]}: its host is no longer offered (host "
         "discovery); leaving the job")
    bootstrap.exit_as_failed(0)


def _log(text: str, level: str = "warning") -> None:
    """A recovery message on stderr, unless RINGSYNC_LOG_LEVEL is above ``level``."""
    if not log_enabled(level):
        return
    sys.stderr.write(f"ringsync.elastic: {text}\n")
    sys.stderr.flush()


def _end_job(text: str) -> None:
    """An orderly end with a non-zero status, which mpirun takes as the end of the job."""
    _log(text, "error")
    sys.stdout.flush()
    os._exit(1)


def _warn_if_mpi_finalize_will_run():
    import mpi4py
    if mpi4py.rc.finalize is not False:
        _log("mpi4py was imported before ringsync, so MPI_Finalize runs at exit, and after a "
             "lost rank Open MPI's can hang there: import ringsync before mpi4py.MPI")


class _Recovery:
    """One run() call's recoveries of a communicator: `comm` is the newest ring, `commit`
    the commit the state must roll back to after the last recovery."""

    def __init__(self, config: Config, comm):
        self.config = config
        self.comm = comm
        self.resets = 0
        self.target_size = comm.size()
        if config.elastic_max_np:
            self.target_size = min(self.target_size, config.elastic_max_np)
        self.commit = None

    def recover(self, error: BaseException, commit_id: int, install=None):
        """Replace the failed ring by one over the survivors (and replacements), agreed
        through the old ring's rendezvous (rendezvous.FaultTolerance). Returns the new
        Communicator, after handing it to install(comm) (run() makes it the default there,
        before the state's reset callbacks ask for size())."""
        old = self.comm
        self._commit_id = commit_id
        self._old_rank, self._old_size = old.rank(), old.size()
        if not isinstance(old.rendezvous, FaultTolerance) or not old.rendezvous.recoverable:
            raise CommunicationError(
                f"rank {self._old_rank} lost its peers and cannot recover: elastic training "
                f"needs MPI fault tolerance (ringsync run --elastic, or mpirun --with-ft ulfm) "
                f"or a store rendezvous with RINGSYNC_ELASTIC=1 (ringsync run --launcher "
                f"local|ssh --elastic). The failure: {error}") from error
        self._started = time.monotonic()
        _log(f"rank {self._old_rank} of {self._old_size}: {error}; recovering")
        old.abort(f"rank {self._old_rank} is recovering from a failure")
        self._meeting = old.rendezvous
        while True:
            self._count_reset()
            try:
                self.comm = self._rebuild()
                break
            except Exception as again:
                if not _is_rank_failure(again, None):
                    raise
                _log(f"another failure during recovery on rank {self._old_rank}: {again}; "
                     "recovering again")
        if install is not None:
            install(self.comm)
        if self.comm.mpi_comm is not None:
            _warn_if_mpi_finalize_will_run()
        return self.comm

    def resize(self, leaving, adding: dict, install=None):
        """The hosts changed (host discovery): the ranks in `leaving` leave the job, then
        new ranks start on `adding` ({host: count}); nothing failed, so the old ring ends
        in order and the state needs no roll-back. Every rank calls it; a leaving rank
        does not return."""
        started, old_size = time.monotonic(), self.comm.size()
        rendezvous = self.comm.rendezvous
        if not isinstance(rendezvous, FaultTolerance):
            raise UsageError("ringsync.elastic: host discovery needs the MPI rendezvous")
        if leaving:
            staying = [r for r in range(old_size) if r not in set(leaving)]
            rest = rendezvous.split(staying)
            self.comm.shutdown()
            if rest is None:
                _leave(self.comm.rank(), self.comm.host_names)
            rendezvous = rest
        if adding:
            grown = rendezvous.spawn(sum(adding.values()), adding)
            if not leaving:
                self.comm.shutdown()
            rendezvous = grown
        self.comm = Communicator(rendezvous=rendezvous, config=self.config)
        self.target_size = self.comm.size()
        if install is not None:
            install(self.comm)
        if self.comm.rank() == 0:
            _log(f"hosts changed: {len(leaving)} rank(s) left, {sum(adding.values())} "
                 f"started on {adding or 'no new host'}; {old_size} -> {self.comm.size()} "
                 f"ranks; took {time.monotonic() - started:.2f} s")
        return self.comm

    def report(self) -> None:
        if self.comm.rank() == 0:
            size = self.comm.size()
            _log(f"lost rank(s) {self._lost} of {self._old_size}; {size - self._spawned} "
                 "survivors" + (f" + {self._spawned} replacement(s)" if self._spawned else "")
                 + f" = {size} ranks; restored commit {self.commit}; recovery took "
                 f"{time.monotonic() - self._started:.2f} s (reset {self.resets})")

    def _count_reset(self) -> None:
        self.resets += 1
        limit = self.config.elastic_reset_limit
        if limit and self.resets > limit:
            _end_job(f"reset limit reached ({limit} recoveries, RINGSYNC_ELASTIC_RESET_LIMIT): "
                     "ending the job")

    def _rebuild(self):
        """One attempt. self._meeting follows the newest rendezvous made: every survivor
        makes the same ones in the same order, so after another failure they all shrink
        the same one."""
        survivors, self._lost = self._meeting.shrink()
        self._meeting = survivors
        size = survivors.size
        if size < self.config.elastic_min_np:
            _end_job(f"only {size} rank(s) left after losing rank(s) {self._lost}; the job "
                     f"needs at least {self.config.elastic_min_np} (--min-np): ending the job")
        # Roll back to the newest commit every survivor holds.
        self.commit = survivors.allreduce_min(self._commit_id)
        self._spawned = 0
        if self.config.elastic_respawn and size < self.target_size:
            self._meeting = survivors.spawn(self.target_size - size)
            self._spawned = self._meeting.size - size  # (a store admits those waiting)
        return Communicator(rendezvous=self._meeting, config=self.config)
