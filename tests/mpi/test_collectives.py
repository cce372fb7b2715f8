"""Collectives under mpirun: what needs processes. The correctness matrix (every collective
x dtype x op x size x rank count x transport) runs with ranks as threads of one process in
tests/unit/test_thread_collectives.py; here the same checks run once more through the
module-level API over the MPI rendezvous, next to the topology MPI reports and a setup
error travelling through MPI. Each test function runs on every rank."""
import numpy as np
import pytest

import ringsync as rs

from tests.common import collective_checks

ENV = {"RINGSYNC_TIMEOUT_SECONDS": "60"}


@pytest.mark.ranks([2, 3], timeout=300, env=ENV)
def test_every_check_through_the_module_api():
    """rs.init() over MPI.COMM_WORLD, then every check of the matrix on the default path;
    after shutdown() the module refuses calls again."""
    rs.init()
    for check in collective_checks.CHECKS.values():
        check(rs)
    rs.shutdown()
    with pytest.raises(rs.NotInitializedError, match=r"init\(\)"):
        rs.allreduce(np.ones(2))


@pytest.mark.ranks(3, timeout=120, env=ENV)
def test_point_to_point_through_the_module_api():
    """send / recv over the MPI rendezvous: a ring exchange on the world, then a message
    inside a process set, whose ranks are the set's own."""
    rs.init()
    r, n = rs.rank(), rs.size()
    sent = rs.send_async(np.full(5, r, np.int32), (r + 1) % n)
    got = rs.recv(np.empty(5, np.int32), (r - 1) % n)
    rs.synchronize(sent)
    assert got.tolist() == [(r - 1) % n] * 5
    ends = rs.add_process_set([0, 2])
    if ends.included():
        mine = ends.rank()
        if mine == 0:
            rs.send(np.arange(3.0), 1, name="in.set", process_set=ends)
        else:
            out = rs.recv(np.empty(3), 0, name="in.set", process_set=ends)
            assert out.tolist() == [0.0, 1.0, 2.0]
    rs.remove_process_set(ends)
    rs.shutdown()


@pytest.mark.ranks([3, 4], env=ENV)
def test_topology_queries():
    from mpi4py import MPI
    world = MPI.COMM_WORLD
    rs.init()
    assert rs.is_initialized()
    assert (rs.rank(), rs.size()) == (world.rank, world.size)
    # Every rank runs on this one host here.
    assert (rs.local_rank(), rs.local_size()) == (rs.rank(), rs.size())
    assert (rs.cross_rank(), rs.cross_size()) == (0, 1)
    rs.shutdown()
    assert not rs.is_initialized()
    # A sub-communicator works too, and init can follow a shutdown.
    sub = world.Split(color=world.rank % 2, key=0)
    rs.init(sub)
    assert rs.size() == sub.size and rs.rank() == sub.rank
    got = rs.allreduce(np.array([world.rank], dtype=np.int64), op=rs.Sum)
    members = [r for r in range(world.size) if r % 2 == world.rank % 2]
    assert got[0] == sum(members), (got, members)
    rs.shutdown()
    sub.Free()


@pytest.mark.ranks(2, timeout=60, env={"RINGSYNC_IFACE": "no-such-nic0"})
def test_bad_interface_fails_on_every_rank():
    """A setup error on every rank travels through the MPI rendezvous: all ranks raise it."""
    with pytest.raises(rs.UsageError, match="RINGSYNC_IFACE='no-such-nic0'"):
        rs.init()
    assert not rs.is_initialized()
