"""Rogue clients of the ranks' listening sockets (issue items 5 and 6), and the rank-side
bodies that set them loose during init() (run by test_rogue_peers.py under mpirun).

The rogues speak the wire format of native/src/transport_tcp.c's handshake:

    HELLO      magic, job id, claimed rank, version, acceptor's rank, nonce  (48 bytes)
    CHALLENGE  nonce, MAC                                                     (48 bytes)
    PROOF      MAC                                                            (32 bytes)

A rogue knows everything but the job's secret: the job id is public (it names the ranks'
segments in /dev/shm)."""
import os
import socket
import struct
import threading
import time

import numpy as np

import ringsync as rs
from ringsync import bootstrap

MAGIC = 0x52494E4753594E43  # "RINGSYNC"
VERSION = 2
HELLO = struct.Struct("<QQqII16s")
CHALLENGE_BYTES = 16 + 32
PROOF_BYTES = 32
WAIT_S = 20.0  # a rogue's socket operations end by then
INIT_LIMIT_S = 15.0  # init() must finish well before RINGSYNC_START_TIMEOUT_SECONDS


def hello(rank, acceptor=0, job_id=0, version=VERSION, magic=MAGIC):
    return HELLO.pack(magic, job_id, rank, version, acceptor, os.urandom(16))


def recv_exact(sock, n):
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            break
        data += chunk
    return data


def client(address, port, payload=b""):
    """A rogue client: connects, sends payload (if any), then stays silent."""
    s = socket.create_connection((address, port), timeout=WAIT_S)
    if payload:
        s.sendall(payload)
    return s


class Impostor:
    """Greets with `first` (a HELLO), answers the acceptor's challenge with
    answer(challenge) from a thread, then watches whether the acceptor keeps it."""

    def __init__(self, address, port, first, answer):
        self.sock = client(address, port, first)
        self.challenge = b""
        self.kept = None
        self.thread = threading.Thread(target=self._run, args=(answer,), daemon=True)
        self.thread.start()

    def _run(self, answer):
        try:
            self.challenge = recv_exact(self.sock, CHALLENGE_BYTES)
            if len(self.challenge) == CHALLENGE_BYTES:
                self.sock.sendall(answer(self.challenge))
                self.kept = self.sock.recv(1) != b""
        except OSError as e:
            self.kept = isinstance(e, TimeoutError)  # still connected, never dropped

    def result(self):
        """Whether the acceptor kept the connection, once it sent a challenge."""
        self.thread.join(WAIT_S + 5)
        self.sock.close()
        assert not self.thread.is_alive(), "the impostor is still waiting"
        assert len(self.challenge) == CHALLENGE_BYTES, \
            f"no challenge ({len(self.challenge)} bytes): the HELLO was refused early"
        return self.kept


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


def impostors_with_the_job_id_are_rejected():
    """Two impostors that know the public job id greet rank 0 first, one as rank 2 with a
    guessed proof, one as rank 1 answering with rank 0's own MAC (a reflection): both get
    a challenge, neither is taken for a rank; the real ranks connect and the ring works."""
    listeners = {}
    impostors = []
    _when_ports_known(lambda addresses, ports: listeners.update(address=addresses[0],
                                                                  port=ports[0]))
    if _world().rank == 0:
        original_new = bootstrap.JobKeys.new

        def new(cls):
            keys = original_new()
            # Before the broadcast of the keys: no real peer can have dialled yet.
            target = (listeners["address"], listeners["port"])
            impostors.append(Impostor(*target, hello(2, 0, keys.job_id),
                                      lambda challenge: os.urandom(PROOF_BYTES)))
            impostors.append(Impostor(*target, hello(1, 0, keys.job_id),
                                      lambda challenge: challenge[16:]))
            return keys
        bootstrap.JobKeys.new = classmethod(new)
    try:
        _init_and_check("impostors at rank 0")
    finally:
        if _world().rank == 0:
            bootstrap.JobKeys.new = original_new
    for impostor in impostors:
        assert impostor.result() is False, "an impostor's connection was kept"
    rs.shutdown()
