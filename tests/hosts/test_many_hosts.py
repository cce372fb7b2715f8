"""Jobs across several hosts: each host a network namespace of this machine
(ringsync.testing.VirtualHosts: own interface, address, host name; mpirun reaches them
through a launch agent). Needs root and `ip`; skipped elsewhere. The rank code is in
tests/hosts/host_bodies.py."""
import re

import pytest

from ringsync.testing import assert_mpi_ok
from tests.common import in_order

from . import host_bodies as bodies

pytestmark = pytest.mark.requires_mpirun
ENV = {"RINGSYNC_TIMEOUT_SECONDS": "60", "OMP_NUM_THREADS": "1"}


# (2 hosts x 2 ranks runs in the other tests: hierarchical bytes, a link down, a host lost,
# hosts that come and go; 3+1 in the uneven one.)
@pytest.mark.parametrize("host_count,ranks_per_host", [(2, 1), (3, 2)])
def test_collectives_across_hosts(virtual_hosts, host_count, ranks_per_host):
    """Every collective of the matrix, and the topology queries, with ranks on
    host_count hosts: the same results as on one host."""
    hosts = virtual_hosts(host_count, rate=None)
    assert_mpi_ok(bodies.topology_and_collectives, np=host_count * ranks_per_host,
                  hosts=hosts, slots=ranks_per_host, timeout=300, env=ENV,
                  args=(host_count, ranks_per_host))


def test_hierarchical_allreduce_sends_the_link_bound(virtual_hosts):
    """2 hosts of 2 ranks: a large allreduce is hierarchical, and its bytes over TCP are
    what the algorithm says (the link bound per host), none to same-host peers."""
    hosts = virtual_hosts(2, rate=None)
    assert_mpi_ok(bodies.hierarchical_traffic, np=4, hosts=hosts, slots=2, timeout=120,
                  env=ENV)


def test_uneven_hosts_and_transports(virtual_hosts):
    """3 ranks on one host, 1 on another: topology, collectives, and which transport
    carried the bytes to each peer (shm inside the host, TCP between hosts)."""
    hosts = virtual_hosts(2, rate=None)
    assert_mpi_ok(in_order.run, np=4, hosts=hosts, slots=[3, 1], timeout=300, env=ENV,
                  args=in_order.args_for(bodies, ["topology_and_collectives:2,3",
                                                 bodies.transports_follow_hosts]))


@pytest.mark.parametrize("iface", [None, "eth1,eth0", "no-such-nic,eth0"])
def test_address_that_reaches_the_peers(virtual_hosts, iface):
    """Hosts with a second interface that reaches nobody, to which the host names
    resolve: ranks test their candidates and listen where the other hosts reach them;
    RINGSYNC_IFACE may list several interfaces (the usable ones win, in that order)."""
    hosts = virtual_hosts(2, rate=None, extra_interface=True)
    env = dict(ENV, RINGSYNC_START_TIMEOUT_SECONDS="20")
    if iface:
        env["RINGSYNC_IFACE"] = iface
    assert_mpi_ok(bodies.listens_where_peers_reach, np=4, hosts=hosts, slots=2,
                  timeout=120, env=env, args=(hosts.subnet,))


def test_elastic_job_survives_losing_a_whole_host(virtual_hosts, tmp_path):
    """Both ranks of one host SIGKILLed at once, mid-allreduce, under --elastic: the
    other host's ranks recover and finish with identical parameters equal to the
    reference replay of the steps as they ran."""
    from tests.faults import test_elastic as elastic_tests
    hosts = virtual_hosts(2, rate=None)
    result, records = elastic_tests.run_job(
        tmp_path, elastic_tests.numpy_training, 4, args=("plain",), hosts=hosts, slots=2,
        RINGSYNC_TEST_VICTIM="2,3", RINGSYNC_TEST_KILL_STEP=10)
    elastic_tests.assert_numpy_run(result, records, 2, lost_at_or_before=10)
    # Each victim kills itself at step 10: usually one recovery finds both gone; when one
    # dies first, the other may still take part in that recovery and die after it, which
    # makes two (the rank left on that host is rank 2 of 3 then, whichever died first).
    together = "ringsync.elastic: lost rank(s) [2, 3] of 4" in result.output
    one_by_one = re.search(r"lost rank\(s\) \[[23]\] of 4;.*\n(.*\n)*.*lost rank\(s\) "
                           r"\[2\] of 3;", result.output)
    assert together or one_by_one, result.report()


def test_a_link_taken_down_fails_every_rank(virtual_hosts, tmp_path):
    """One host's link goes down in the middle of allreduces: every rank fails with a
    CommunicationError that names ranks of the other host, within the timeout, and
    nothing hangs (the job's deadline would catch it)."""
    import threading
    import time
    from ringsync.testing import run_mpi
    hosts = virtual_hosts(2, rate=None)
    env = dict(ENV, RINGSYNC_TIMEOUT_SECONDS="10")
    box = {}
    job = threading.Thread(target=lambda: box.update(result=run_mpi(
        bodies.fails_when_a_link_goes_down, np=4, hosts=hosts, slots=2, timeout=180,
        env=env, args=(str(tmp_path),))))
    job.start()
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and job.is_alive() and not all(
            (tmp_path / f"ready{r}").exists() for r in range(4)):
        time.sleep(0.1)
    assert all((tmp_path / f"ready{r}").exists() for r in range(4)), "job never got going"
    time.sleep(0.5)
    hosts.link_down(hosts.names[1])
    outcomes = [tmp_path / f"outcome{r}" for r in range(4)]
    while time.monotonic() < deadline + 60 and not all(p.exists() for p in outcomes):
        time.sleep(0.1)
    hosts.link_up(hosts.names[1])  # mpirun's own daemons need it to end the job
    job.join()
    result = box["result"]
    assert not result.timed_out, result.report()
    outcomes = {r: (tmp_path / f"outcome{r}").read_text() if (tmp_path / f"outcome{r}").exists()
                else "no outcome" for r in range(4)}
    for rank, text in outcomes.items():
        assert text.startswith("CommunicationError"), (rank, outcomes, result.report())
        others = (2, 3) if rank < 2 else (0, 1)
        assert any(f"rank {peer}" in text for peer in others), (rank, text)


@pytest.mark.parametrize("host_count,ranks_per_host", [(8, 16)])
def test_128_ranks_on_8_hosts(virtual_hosts, host_count, ranks_per_host):
    """A job of 128 ranks, 16 on each of 8 hosts (oversubscribed: this machine may have 2
    cores): every collective, with references in closed form. Each rank connects to the
    peers its algorithms need (about log2 N), the others on first use (alltoall)."""
    hosts = virtual_hosts(host_count, rate=None)
    assert_mpi_ok(bodies.collectives_at_scale, np=host_count * ranks_per_host,
                  hosts=hosts, slots=ranks_per_host, timeout=900,
                  env=dict(ENV, RINGSYNC_TIMEOUT_SECONDS="300"),
                  args=(host_count, ranks_per_host))


def test_virtual_hosts_are_removed_even_when_the_body_fails(virtual_hosts):
    """A `with` block that raises leaves no namespace, link or file behind; namespaces of
    an owner that died without cleaning up are removed when hosts are next made."""
    import os
    import subprocess
    from ringsync.netns import VirtualHosts

    def namespaces():
        return subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout

    def links():
        return subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout

    with pytest.raises(RuntimeError, match="the body failed"):
        with VirtualHosts(2, rate="1gbit") as hosts:
            made, bridge, agent = list(hosts.names), hosts.bridge, hosts.agent
            assert all(name in namespaces() for name in made)
            raise RuntimeError("the body failed")
    assert not any(name in namespaces() for name in made), namespaces()
    assert bridge not in links() and not os.path.exists(agent)
    assert not any(os.path.exists(f"/etc/netns/{name}") for name in made)
    dead = 4194304 + 1  # above Linux's largest pid: no such owner
    stale = f"rsh{dead}x1h0"
    subprocess.run(["ip", "netns", "add", stale], check=True)
    try:
        virtual_hosts(1, rate=None)
        assert stale not in namespaces()
    finally:
        subprocess.run(["ip", "netns", "del", stale], capture_output=True)


def test_unavailable_says_why(monkeypatch):
    from ringsync import netns
    monkeypatch.setattr(netns.os, "geteuid", lambda: 1000)
    assert "root" in netns.unavailable()
    monkeypatch.setattr(netns.os, "geteuid", lambda: 0)
    monkeypatch.setattr(netns.shutil, "which", lambda tool: None if tool == "tc" else "/x")
    assert "`tc`" in netns.unavailable()


def test_hosts_that_come_and_go(virtual_hosts, tmp_path):
    """Host discovery (Horovod's --host-discovery-script): the job starts on host a with 2
    ranks; when the script adds host b, 2 ranks start there at the next commit (4 ranks,
    the state synced to them, no roll-back); when it drops b again, b's ranks leave and
    the others go on (2 ranks). Parameters end identical and equal to the reference replay
    of the sizes the steps ran at, with no step lost or repeated beyond one commit."""
    from tests.faults import test_elastic as et
    hosts = virtual_hosts(2, rate=None)
    a, b = hosts.names
    offered = tmp_path / "hosts.txt"
    offered.write_text(f"{a}:2\n")
    script = tmp_path / "discover.sh"
    script.write_text(f"#!/bin/sh\ncat {offered}\n")
    script.chmod(0o755)
    result, records = et.run_job(
        tmp_path, et.numpy_training, 2, args=("hosts",), hosts=hosts, slots=2,
        RINGSYNC_ELASTIC_DISCOVERY_SCRIPT=script, RINGSYNC_ELASTIC_DISCOVERY_SECONDS=0,
        RINGSYNC_TEST_HOSTS_FILE=offered, RINGSYNC_TEST_HOSTS_GROWN=f"{a}:2,{b}:2",
        RINGSYNC_TEST_HOSTS_SHRUNK=f"{a}:2")
    assert all(outcome == "ok" for outcome in result.outcomes.values()), result.report()
    # Open MPI 5's mpirun may end such a job with status 137 after ranks it spawned have left
    # (ringsync.elastic._leave says why); PRRTE then says either "NO PATH TO TARGET" or that
    # a process it spawned was killed, whichever it notices first. Any other end is a failure.
    ended_on_leavers = result.returncode == 137 and (
        "NO PATH TO TARGET" in result.output
        or re.search(rf"on node {b} exited on\s+signal 9", result.output))
    assert result.returncode == 0 or ended_on_leavers, result.report()
    assert sorted(r["rank"] for r in records) == [0, 1], result.report()
    sizes = records[0]["sizes"]
    assert sizes == [2] * 8 + [4] * 8 + [2] * 8, (sizes, result.report())
    for r in records:
        assert r["w"] == records[0]["w"] and r["sizes"] == sizes, records
        assert r["w"] == pytest.approx(r["reference"], rel=1e-12, abs=1e-12), r
    assert 0 <= max(r["steps_run"] for r in records) - et.STEPS <= et.COMMIT_EVERY
    assert "hosts changed" in result.output and "leaving the job" in result.output, \
        result.report()
