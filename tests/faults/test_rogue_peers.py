"""Strangers at the ranks' listening sockets during init() (issue items 5 and 6).

Port scanners, half greetings and garbage reach every rank's listener before the real
peers: init() must neither wait for them (until RINGSYNC_START_TIMEOUT_SECONDS) nor blame
a healthy rank; each is dropped and logged. Impostors that know the public job id but not
the job's secret greet rank 0 as ranks that have not connected yet: they must be refused
and the real ranks connected. Every job checks an allreduce against the exact sum.

The tests read what the ranks logged from the job's output, so each starts the job with
run_mpi; the rank code is the module-level function it passes, placed before it. The
rogues themselves (and their wire format) are in tests/faults/rogue_clients.py, shared
with the one-process tests of the handshake itself (replay, reflection, wrong secret,
rogue listener) in tests/unit/test_auth.py."""
import os
import re
import tempfile
import threading
import time

import numpy as np
import pytest

import ringsync as rs
from ringsync import bootstrap
from ringsync.testing import assert_mpi_ok

from .rogue_clients import HELLO, PROOF_BYTES, WAIT_S, Impostor, client, hello

pytestmark = pytest.mark.requires_mpirun

INIT_LIMIT_S = 15.0  # init() must finish well before RINGSYNC_START_TIMEOUT_SECONDS
SETTINGS = {
    # Far above the bound the bodies check (INIT_LIMIT_S): a setup that waits on a rogue
    # until this timeout fails the test.
    "RINGSYNC_START_TIMEOUT_SECONDS": "30",
    "RINGSYNC_TIMEOUT_SECONDS": "30",
}
JOB_TIMEOUT_S = 90


def dropped(output, rank):
    return re.findall(rf"ringsync: rank {rank}: dropped a connection from [\d.]+:\d+: (.*)",
                      output)


# --------------------------------------------------------------------------- rank side

def _world():
    from mpi4py import MPI
    return MPI.COMM_WORLD


def _when_ports_known(callback):
    """Call callback(addresses, ports) on this rank during init(), once every rank listens
    and before any rank dials: init() passes the listeners to connect_addresses before
    rank 0 broadcasts the job's keys, which every rank needs to dial. The barrier makes
    every rank's rogues arrive before any real peer."""
    original = bootstrap.connect_addresses

    def hooked(peers, *args, **kwargs):
        callback([p.address for p in peers], [p.port for p in peers])
        _world().Barrier()
        bootstrap.connect_addresses = original
        return original(peers, *args, **kwargs)
    bootstrap.connect_addresses = hooked


def _init_and_check(what):
    t0 = time.monotonic()
    rs.init()
    took = time.monotonic() - t0
    assert took < INIT_LIMIT_S, f"rank {rs.rank()}: init() took {took:.1f} s ({what})"
    data = np.arange(1000, dtype=np.float64) * (rs.rank() + 1)
    got = rs.allreduce(data, op=rs.Sum, name="after rogues")
    expected = np.arange(1000, dtype=np.float64) * sum(range(1, rs.size() + 1))
    np.testing.assert_array_equal(got, expected, err_msg=f"rank {rs.rank()}: {what}")


def rogue_clients_do_not_stall_init():
    """Port scanners and garbage at every rank's listener before the real peers: init()
    finishes promptly, the ring is right, and the rogues are dropped and logged."""
    rogues = []

    def connect_rogues(addresses, ports):
        me = _world().rank
        target = (addresses[me], ports[me])
        rogues.extend(client(*target) for _ in range(3))  # connect, then silence
        rogues.append(client(*target, hello(me + 1, me)[:20]))  # half a greeting
        rogues.append(client(*target, os.urandom(HELLO.size)))  # garbage
        rogues.append(client(*target, hello(me + 1, me, job_id=12345)))  # a guessed job id
        client(*target).close()  # a scanner that connects and leaves
    _when_ports_known(connect_rogues)
    try:
        _init_and_check("rogue clients at every listener")
    finally:
        for s in rogues:
            s.close()
    rs.shutdown()


@pytest.mark.parametrize("np,transport", [(3, "auto"), (2, "tcp")])
def test_rogue_clients_neither_stall_nor_fail_init(np, transport):
    result = assert_mpi_ok(rogue_clients_do_not_stall_init, np=np,
                           timeout=JOB_TIMEOUT_S,
                           env={**SETTINGS, "RINGSYNC_TRANSPORT": transport})
    # Every rank but the highest accepts, so reads (and drops) its rogues.
    for rank in range(np - 1):
        reasons = dropped(result.output, rank)
        assert "not a ringsync greeting" in reasons, result.report()
        assert "greeting for another job" in reasons, result.report()
        assert any("before any greeting" in why for why in reasons), result.report()
    assert "timed out" not in result.output, result.report()


def _answered_marker(job_id) -> str:
    return os.path.join(tempfile.gettempdir(), f"ringsync-impostors-answered-{job_id:x}")


def _mark_when_answered(impostors, job_id):
    """Rank 0: once both impostors have answered their challenges, say so in a file the
    other ranks wait for before they dial (rank 0 itself is inside the native connect)."""
    def mark():
        for impostor in impostors:
            impostor.answered.wait(WAIT_S)
        open(_answered_marker(job_id), "w").close()
    threading.Thread(target=mark, daemon=True).start()


def _dial_after_the_impostors(original_job_keys):
    """Ranks 1 and 2: the keys, then a wait for rank 0's impostors to have answered. Were
    the real ranks to connect first, setup would end with an impostor's proof unread
    ("did not complete the greeting before setup finished"; seen once under load)."""
    def job_keys(self):
        keys = original_job_keys(self)
        marker = _answered_marker(keys.job_id)
        deadline = time.monotonic() + WAIT_S
        while not os.path.exists(marker) and time.monotonic() < deadline:
            time.sleep(0.01)
        return keys
    return job_keys


def impostors_with_the_job_id_are_rejected():
    """Two impostors that know the public job id greet rank 0 first, one as rank 2 with a
    guessed proof, one as rank 1 answering with rank 0's own MAC (a reflection): both get
    a challenge, neither is taken for a rank; the real ranks connect (once both impostors
    have answered) and the ring works."""
    from ringsync.rendezvous import Rendezvous
    listeners = {}
    impostors = []
    _when_ports_known(lambda addresses, ports: listeners.update(address=addresses[0],
                                                                  port=ports[0]))
    original_new, original_job_keys = bootstrap.JobKeys.new, Rendezvous.job_keys
    if _world().rank == 0:
        def new(cls):
            keys = original_new()
            # Before the broadcast of the keys: no real peer can have dialled yet.
            target = (listeners["address"], listeners["port"])
            impostors.append(Impostor(*target, hello(2, 0, keys.job_id),
                                      lambda challenge: os.urandom(PROOF_BYTES)))
            impostors.append(Impostor(*target, hello(1, 0, keys.job_id),
                                      lambda challenge: challenge[16:]))
            for impostor in impostors:
                impostor.job_id = keys.job_id
            _mark_when_answered(impostors, keys.job_id)
            return keys
        bootstrap.JobKeys.new = classmethod(new)
    else:
        Rendezvous.job_keys = _dial_after_the_impostors(original_job_keys)
    try:
        _init_and_check("impostors at rank 0")
    finally:
        bootstrap.JobKeys.new, Rendezvous.job_keys = original_new, original_job_keys
    _world().Barrier()  # (every rank has seen the marker)
    if impostors:
        os.remove(_answered_marker(impostors[0].job_id))
    for impostor in impostors:
        assert impostor.result() is False, "an impostor's connection was kept"
    rs.shutdown()


@pytest.mark.parametrize("transport", ["auto", "tcp"])
def test_impostors_without_the_secret_are_refused(transport):
    result = assert_mpi_ok(impostors_with_the_job_id_are_rejected, np=3, timeout=JOB_TIMEOUT_S,
                           env={**SETTINGS, "RINGSYNC_TRANSPORT": transport})
    reasons = dropped(result.output, 0)
    for rank in (1, 2):
        assert f"claims rank {rank} but did not prove that it knows the job's secret" in \
            reasons, result.report()


@pytest.mark.ranks(2, timeout=90)
def test_a_rank_announcing_a_bad_length_in_a_rendezvous_exchange_is_refused():
    """The bounded MPI allgather of the rendezvous sizes its buffer from every rank's
    announced length. Rank 1 announces -1, then 2 GiB, by hand; rank 0's exchange refuses
    it naming rank 1 before it sizes anything from it (and without waiting for the bytes
    that will never come)."""
    import array
    from mpi4py import MPI

    comm = MPI.COMM_WORLD.Dup()
    try:
        for lie in (-1, 2 << 30):
            if comm.Get_rank() == 1:
                sizes = array.array("q", [0, 0])
                bootstrap.wait_until(comm.Iallgather([array.array("q", [lie]), MPI.INT64_T],
                                                     [sizes, MPI.INT64_T]), time.monotonic() + 30)
            else:
                with pytest.raises(rs.UsageError, match=f"rank 1 announced {lie} bytes"):
                    bootstrap.bounded_allgather(comm, "rank 0's", time.monotonic() + 30)
        real = bootstrap.bounded_allgather(comm, {"rank": comm.Get_rank()}, time.monotonic() + 30)
        assert real == [{"rank": 0}, {"rank": 1}]
    finally:
        comm.Free()
