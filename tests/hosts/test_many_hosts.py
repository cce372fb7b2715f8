"""Jobs across several hosts: each host a network namespace of this machine
(ringsync.testing.VirtualHosts: own interface, address, host name; mpirun reaches them
through a launch agent). Needs root and `ip`; skipped elsewhere. The rank code is in
tests/hosts/host_bodies.py."""
import pytest

from ringsync.testing import assert_mpi_ok
from tests.mpi import in_order

pytestmark = pytest.mark.requires_mpirun

BODY = "tests.hosts.host_bodies:"
ENV = {"RINGSYNC_TIMEOUT_SECONDS": "60", "OMP_NUM_THREADS": "1"}


@pytest.mark.parametrize("host_count,ranks_per_host", [(2, 1), (2, 2), (3, 2)])
def test_collectives_across_hosts(virtual_hosts, host_count, ranks_per_host):
    """Every collective of the matrix, and the topology queries, with ranks on
    host_count hosts: the same results as on one host."""
    hosts = virtual_hosts(host_count, rate=None)
    assert_mpi_ok(BODY + "topology_and_collectives", np=host_count * ranks_per_host,
                  hosts=hosts, slots=ranks_per_host, timeout=300, env=ENV,
                  args=(host_count, ranks_per_host))


def test_uneven_hosts_and_transports(virtual_hosts):
    """3 ranks on one host, 1 on another: topology, collectives, and which transport
    carried the bytes to each peer (shm inside the host, TCP between hosts)."""
    hosts = virtual_hosts(2, rate=None)
    assert_mpi_ok(in_order.TARGET, np=4, hosts=hosts, slots=[3, 1], timeout=300, env=ENV,
                  args=in_order.args_for("tests.hosts.host_bodies",
                                         ["topology_and_collectives:2,3", "transports_follow_hosts"]))


@pytest.mark.parametrize("iface", [None, "eth1,eth0", "no-such-nic,eth0"])
def test_address_that_reaches_the_peers(virtual_hosts, iface):
    """Hosts with a second interface that reaches nobody, to which the host names
    resolve: ranks test their candidates and listen where the other hosts reach them;
    RINGSYNC_IFACE may list several interfaces (the usable ones win, in that order)."""
    hosts = virtual_hosts(2, rate=None, extra_interface=True)
    env = dict(ENV, RINGSYNC_START_TIMEOUT_SECONDS="20")
    if iface:
        env["RINGSYNC_IFACE"] = iface
    assert_mpi_ok(BODY + "listens_where_peers_reach", np=4, hosts=hosts, slots=2,
                  timeout=120, env=env, args=(hosts.subnet,))
