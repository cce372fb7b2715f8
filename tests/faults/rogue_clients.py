"""Rogue clients of the ranks' listening sockets (issue items 5 and 6), shared by
tests/faults/test_rogue_peers.py (ranks under mpirun) and tests/unit/test_auth.py (one
process).

The rogues speak the wire format of native/src/transport_tcp.c's handshake:

    HELLO      magic, job id, claimed rank, version, acceptor's rank, nonce  (48 bytes)
    CHALLENGE  nonce, MAC                                                     (48 bytes)
    PROOF      MAC                                                            (32 bytes)
    WELCOME    "W": the acceptor registered the connection                     (1 byte)

A rogue knows everything but the job's secret: the job id is public (it names the ranks'
segments in /dev/shm)."""
import os
import socket
import struct
import threading

MAGIC = 0x52494E4753594E43  # "RINGSYNC"
VERSION = 3
HELLO = struct.Struct("<QQqII16s")
CHALLENGE_BYTES = 16 + 32
PROOF_BYTES = 32
WAIT_S = 20.0  # a rogue's socket operations end by then


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
        self.answered = threading.Event()  # set once the answer is sent (or cannot be)
        self.thread = threading.Thread(target=self._run, args=(answer,), daemon=True)
        self.thread.start()

    def _run(self, answer):
        try:
            self.challenge = recv_exact(self.sock, CHALLENGE_BYTES)
            if len(self.challenge) == CHALLENGE_BYTES:
                self.sock.sendall(answer(self.challenge))
                self.answered.set()
                self.kept = self.sock.recv(1) != b""
        except OSError as e:
            self.kept = isinstance(e, TimeoutError)  # still connected, never dropped
        finally:
            self.answered.set()

    def result(self):
        """Whether the acceptor kept the connection, once it sent a challenge."""
        self.thread.join(WAIT_S + 5)
        self.sock.close()
        assert not self.thread.is_alive(), "the impostor is still waiting"
        assert len(self.challenge) == CHALLENGE_BYTES, \
            f"no challenge ({len(self.challenge)} bytes): the HELLO was refused early"
        return self.kept
