"""Rank code for the tests across virtual hosts (tests/hosts/test_many_hosts.py)."""
import socket
from collections import Counter

import numpy as np

import ringsync as rs


def _expected_topology(hosts, me):
    """Horovod's meanings, from every rank's host name: local = my host's ranks,
    cross = the ranks with my local rank, one per host that has one."""
    local = [r for r, h in enumerate(hosts) if h == hosts[me]]
    local_rank = local.index(me)
    order = list(dict.fromkeys(hosts))  # hosts in order of their first rank
    peers = [next(r for i, r in enumerate([r for r, h in enumerate(hosts) if h == host])
                  if i == local_rank) for host in order
             if Counter(hosts)[host] > local_rank]
    return local_rank, len(local), peers.index(me), len(peers)


def topology_and_collectives(host_count, ranks_per_host):
    """Ranks really are on different hosts (host names and network namespaces differ),
    the topology queries say so, and every collective of the matrix is right."""
    from mpi4py import MPI
    world = MPI.COMM_WORLD
    hosts = world.allgather(socket.gethostname())
    assert len(set(hosts)) == int(host_count), hosts
    assert max(Counter(hosts).values()) == int(ranks_per_host), hosts
    rs.init()
    me = rs.rank()
    got = (rs.local_rank(), rs.local_size(), rs.cross_rank(), rs.cross_size())
    assert got == _expected_topology(hosts, me), (me, hosts, got)
    # (imported here: its bfloat16 support costs 0.6 s of CPU a rank, which 128 ranks on
    # two cores feel, and collectives_at_scale does without it)
    from tests.common import collective_checks
    for check in collective_checks.CHECKS.values():
        check(rs)
    rs.shutdown()


def transports_follow_hosts():
    """After a large allreduce, bytes to same-host peers went over shared memory and
    bytes to other hosts over TCP, never the other way round; the ring's bytes to the right
    neighbour went the way its host says (3 + 1 ranks: the flat ring)."""
    rs.init()
    me, size = rs.rank(), rs.size()
    data = np.arange(1 << 18, dtype=np.float64) + me
    got = rs.allreduce(data, op=rs.Sum)
    expected = size * np.arange(1 << 18, dtype=np.float64) + sum(range(size))
    np.testing.assert_array_equal(got, expected)
    comm = rs._comm()
    hosts = comm.host_names
    traffic = comm.traffic()
    for peer in range(size):
        if peer == me:
            continue
        if hosts[peer] == hosts[me]:
            assert traffic["tcp"][peer] == 0, (me, peer, traffic)
        else:
            assert traffic["shm"][peer] == 0, (me, peer, traffic)
    right = (me + 1) % size
    assert traffic["tcp" if hosts[right] != hosts[me] else "shm"][right] > 0, (me, traffic)
    rs.shutdown()


def listens_where_peers_reach(subnet):
    """Every rank advertises an address on the network that connects the hosts (the
    host names resolve to another interface that reaches nobody)."""
    import ipaddress
    rs.init()
    addresses = rs._comm()._ring.addresses
    assert all(ipaddress.ip_address(a) in ipaddress.ip_network(subnet) for a in addresses), \
        (addresses, subnet)
    got = rs.allreduce(np.array([rs.rank() + 1.0]), op=rs.Sum)
    assert got[0] == rs.size() * (rs.size() + 1) / 2
    rs.shutdown()


def fails_when_a_link_goes_down(outdir):
    """Allreduces until the test takes one host's link down; every rank must then fail
    with CommunicationError (recorded in outdir), then waits for the others' records
    before leaving (an early exit would make mpirun end the job before they record)."""
    import os
    import time

    from ringsync.testing import write_atomically
    rs.init()
    me, size = rs.rank(), rs.size()
    data = np.arange(1 << 20, dtype=np.float64) + me
    rs.allreduce(data, op=rs.Sum, name="warmup")
    write_atomically(os.path.join(outdir, f"ready{me}"), "")
    start = time.monotonic()
    try:
        while time.monotonic() - start < 120:
            rs.allreduce(data, op=rs.Sum, name="loop")
        text = "no error in 120 s"
    except rs.CommunicationError as e:
        text = f"CommunicationError after {time.monotonic() - start:.1f} s: {e}"
    write_atomically(os.path.join(outdir, f"outcome{me}"), text)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not all(
            os.path.exists(os.path.join(outdir, f"outcome{r}")) for r in range(size)):
        time.sleep(0.1)
    os._exit(0)  # MPI_Finalize would wait for the host that is cut off


def _check_topology(host_count, ranks_per_host):
    from mpi4py import MPI
    hosts = MPI.COMM_WORLD.allgather(socket.gethostname())
    assert len(set(hosts)) == int(host_count), hosts
    assert max(Counter(hosts).values()) == int(ranks_per_host), hosts
    got = (rs.local_rank(), rs.local_size(), rs.cross_rank(), rs.cross_size())
    assert got == _expected_topology(hosts, rs.rank()), (rs.rank(), hosts, got)


def collectives_at_scale(host_count, ranks_per_host):
    """Every collective on many ranks, with references in closed form (the matrix of
    tests/common/collective_checks.py computes every rank's inputs on every rank: O(N^2) work that
    128 ranks on 2 cores cannot afford). Data differ by rank and position; sizes include 0,
    1, a prime, and one large enough for the hierarchical allreduce; the alltoall connects
    every pair on first use."""
    rs.init()
    _check_topology(host_count, ranks_per_host)
    me, n = rs.rank(), rs.size()
    for dtype in (np.int64, np.float32):
        for count in (0, 1, 1009, 300_007):
            index = np.arange(count)
            x = (me * 1000 + index).astype(dtype)
            what = f"{np.dtype(dtype).name} count={count}"
            np.testing.assert_array_equal(rs.allreduce(x, op=rs.Sum),
                                          (n * index + 1000 * n * (n - 1) // 2).astype(dtype),
                                          err_msg="sum " + what)
            np.testing.assert_array_equal(rs.allreduce(x, op=rs.Max),
                                          ((n - 1) * 1000 + index).astype(dtype), "max " + what)
            np.testing.assert_array_equal(rs.allreduce(x, op=rs.Min), index.astype(dtype),
                                          "min " + what)
    mean = rs.allreduce(np.full(1000, me, np.float64), op=rs.Average)
    np.testing.assert_allclose(mean, (n - 1) / 2, rtol=1e-12)
    rows = me % 3 + 1  # ranks contribute different row counts
    got = rs.allgather(np.array([[me, r] for r in range(rows)], dtype=np.int32))
    np.testing.assert_array_equal(got, [[r, i] for r in range(n) for i in range(r % 3 + 1)])
    for root in (0, n // 2 + 1, n - 1):
        x = np.arange(100_003, dtype=np.float64) + root if me == root else np.zeros(100_003)
        np.testing.assert_array_equal(rs.broadcast(x, root_rank=root),
                                      np.arange(100_003, dtype=np.float64) + root)
    total = 3 * n + 2
    got = rs.reducescatter(np.arange(total, dtype=np.int64) + me, op=rs.Sum)
    split = [total // n + (i < total % n) for i in range(n)]
    start = sum(split[:me])
    np.testing.assert_array_equal(got, n * np.arange(start, start + split[me]) + n * (n - 1) // 2)
    splits = [(me + dest) % 3 for dest in range(n)]
    send = np.concatenate([np.full(splits[d], me * 100 + d, np.int64) for d in range(n)])
    got, received = rs.alltoall(send, splits=splits)
    assert list(received) == [(r + me) % 3 for r in range(n)], received
    np.testing.assert_array_equal(got, np.concatenate(
        [np.full((r + me) % 3, r * 100 + me, np.int64) for r in range(n)]))
    rs.barrier()
    traffic = rs._comm().traffic()
    hosts = rs._comm().host_names
    assert all(traffic["tcp"][p] == 0 for p in range(n) if p != me and hosts[p] == hosts[me]), \
        traffic
    rs.shutdown()


def hierarchical_traffic():
    """2 hosts x 2 ranks: a 4 MiB allreduce goes hierarchical (auto, from 1 MiB): each
    rank sends S/2 over TCP (its block of S/L, allreduced across H = 2 hosts: 2(H-1)/H of
    it) and nothing over TCP to its own host; forced off, the flat ring's boundary ranks
    send 1.5 S over TCP and the others none."""
    rs.init()
    me, n = rs.rank(), rs.size()
    comm = rs._comm()
    s = 4 << 20

    def tcp_bytes_of_one_allreduce():
        before = comm.traffic()["tcp"]
        x = np.arange(s // 4, dtype=np.float32) + me
        got = rs.allreduce(x, op=rs.Sum, name="hier.traffic")
        np.testing.assert_array_equal(got, n * np.arange(s // 4, dtype=np.float32) + n * (n - 1) / 2)
        return [a - b for a, b in zip(comm.traffic()["tcp"], before)]

    sent = tcp_bytes_of_one_allreduce()
    hosts = comm.host_names
    assert all(sent[p] == 0 for p in range(n) if hosts[p] == hosts[me]), sent
    assert abs(sum(sent) - s // 2) <= 64 << 10, (me, sent)
    rs.shutdown()
