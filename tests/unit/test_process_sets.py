"""Process sets as rings of their own, with ranks as threads (tests/thread_ranks.py): each
thread's Registry splits its world communicator as ringsync.init() and add_process_set()
do. The module-level API under mpirun: tests/mpi/test_process_set_agreement.py (a change
refused on one rank fails on every rank), tests/mpi/test_init_and_process_sets.py (init's
sets, Horovod's rules) and the adapters' bodies (process_set= on each collective)."""
import os
import threading

import numpy as np
import pytest

import ringsync as rs
from ringsync.process_sets import ProcessSet, Registry, communicator_of

from tests.thread_ranks import assert_ranks_ok

TIMEOUT = 120
PATHS = {"shm": {"RINGSYNC_TRANSPORT": "shm"}, "tcp": {"RINGSYNC_TRANSPORT": "tcp"}}


def _data(world_rank, n, salt):
    return (np.arange(n, dtype=np.float64) * (world_rank + 1) + salt).astype(np.float32)


def _collectives_on(ps, world_rank, salt):
    """allreduce, broadcast (root given as a global rank), allgather, reducescatter and
    barrier on ps, checked against references built from every member's input."""
    comm = communicator_of(ps)
    n = 7 + salt
    got = comm.allreduce(_data(world_rank, n, salt), op=rs.Sum, name=f"ps.sum.{salt}")
    want = sum(_data(r, n, salt) for r in ps.ranks)
    np.testing.assert_allclose(got, want, rtol=1e-6)
    avg = comm.allreduce(_data(world_rank, n, salt), name=f"ps.avg.{salt}")
    np.testing.assert_allclose(avg, want / len(ps.ranks), rtol=1e-6)
    root = ps.ranks[-1]
    got = comm.broadcast(_data(world_rank, n, salt), root, name=f"ps.bcast.{salt}")
    np.testing.assert_array_equal(got, _data(root, n, salt))
    rows = np.full((ps.rank() + 1, 2), world_rank, np.int32)
    got = comm.allgather(rows, name=f"ps.gather.{salt}")
    want = np.concatenate([np.full((i + 1, 2), r, np.int32) for i, r in enumerate(ps.ranks)])
    np.testing.assert_array_equal(got, want)
    comm.barrier()


def _two_disjoint_sets_and_one_overlapping(world):
    me = world.rank()
    registry = Registry(world)
    low, high = ProcessSet([1, 0]), ProcessSet([2, 3])
    odd = ProcessSet([1, 2, 3])
    for ps in (low, high, odd):
        registry.add(ps)
    assert [low.process_set_id, high.process_set_id, odd.process_set_id] == [1, 2, 3]
    assert low.ranks == [0, 1] and low.size() == 2 and high.size() == 2
    mine = low if me < 2 else high
    assert mine.included() and not (high if me < 2 else low).included()
    assert mine.rank() == me % 2
    with pytest.raises(rs.UsageError, match=f"rank {me} is not a member"):
        communicator_of(high if me < 2 else low)
    # The two disjoint sets run at the same time, many calls each, on their own rings.
    for salt in range(20):
        _collectives_on(mine, me, salt)
    if odd.included():
        _collectives_on(odd, me, 100)
        with pytest.raises(rs.UsageError, match="out of range: not one of this ring.s ranks"):
            communicator_of(odd).broadcast(np.ones(2), 0, name="root.outside")
        _collectives_on(odd, me, 101)  # the failed call left the ring working
    # The world still works beside its sets.
    got = world.allreduce(np.array([me + 1.0]), op=rs.Sum, name="world.after")
    assert got.tolist() == [float(sum(range(1, world.size() + 1)))]
    comms = [communicator_of(ps) for ps in (low, high, odd) if ps.included()]
    assert registry.remove(mine) and mine.process_set_id is None and mine.size() is None
    assert not registry.remove(mine)  # a second time: nothing left to remove
    registry.close()
    assert all(c.closed for c in comms)
    assert odd.process_set_id is None
    with pytest.raises(rs.UsageError, match="not registered"):
        communicator_of(odd)
    return me


@pytest.mark.parametrize("path", sorted(PATHS))
def test_disjoint_sets_run_at_once_and_removal_closes_their_rings(path):
    fds_before = len(os.listdir("/proc/self/fd"))
    threads_before = threading.active_count()
    assert_ranks_ok(_two_disjoint_sets_and_one_overlapping, 4, timeout=TIMEOUT,
                    env={**PATHS[path], "RINGSYNC_TIMEOUT_SECONDS": "60"})
    # Every ring (the world's and the sets') released its sockets, segments and threads.
    assert len(os.listdir("/proc/self/fd")) <= fds_before
    assert threading.active_count() <= threads_before


def _bad_sets(world):
    registry = Registry(world)
    with pytest.raises(rs.UsageError, match="must be distinct ranks of the job"):
        registry.add(ProcessSet([0, world.size()]))
    with pytest.raises(rs.UsageError, match="must be distinct ranks"):
        registry.add(ProcessSet([1, 1]))
    with pytest.raises(rs.UsageError, match="ranks must be ints"):
        ProcessSet([0, "1"])
    with pytest.raises(rs.UsageError, match="a list of ranks or an mpi4py communicator"):
        ProcessSet(3)
    first = registry.add(ProcessSet([0, 2]))
    with pytest.raises(rs.UsageError, match="duplicate process set"):
        registry.add(ProcessSet([2, 0]))
    with pytest.raises(rs.UsageError, match="registered already"):
        registry.add(first)
    # After the refusals every rank still agrees on the next set and its id.
    second = registry.add(ProcessSet([1, 2]))
    assert second.process_set_id == 2
    if second.included():
        _collectives_on(second, world.rank(), 3)
    registry.close()


def test_bad_sets_are_refused_on_every_rank_and_the_next_one_works():
    assert_ranks_ok(_bad_sets, 3, timeout=TIMEOUT, env={"RINGSYNC_TIMEOUT_SECONDS": "60"})


def _sets_across_hosts(world):
    """Ranks 0, 1 report host node-a and 2, 3 node-b: a set inside a host (shared memory)
    and one across the hosts (TCP between them) both work, at the same time."""
    me = world.rank()
    registry = Registry(world)
    inside, across = ProcessSet([0, 1]), ProcessSet([1, 2])
    registry.add(inside)
    registry.add(across)
    if inside.included():
        assert communicator_of(inside).local_size() == 2
        assert communicator_of(inside).transport == "shm"
    if across.included():
        comm = communicator_of(across)
        assert (comm.local_size(), comm.cross_size()) == (1, 2)
    for salt in range(5):
        for ps in (inside, across):
            if ps.included():
                _collectives_on(ps, me, salt)
    registry.close()


def test_sets_inside_a_host_and_across_hosts():
    assert_ranks_ok(_sets_across_hosts, 4, timeout=TIMEOUT,
                    env={"RINGSYNC_TIMEOUT_SECONDS": "60"},
                    rank_env=lambda r: {"RINGSYNC_HOST_NAME": "node-a" if r < 2 else "node-b"})
