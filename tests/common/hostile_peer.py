"""A hostile authenticated peer: a rank of a real job, played in Python, that knows the
job's secret, passes the handshake and then writes whatever bytes a test gives it.

The honest ranks are thread ranks of this process (real Communicators); the hostile one is
the highest rank, so it dials every honest rank and none dials it. The honest ranks meet
through HonestRendezvous: an exchange among themselves, to which the hostile rank's post is
added. It copies rank 0's posts (the same host, the same settings), advertises a port
nobody dials, and reads the job's keys from rank 0's broadcast: it is "given the secret".

Wire formats spoken here (all little-endian, the layouts of native/src):
  handshake  tcp_setup.c: HELLO, CHALLENGE, PROOF, WELCOME (tests/faults/rogue_clients.py)
  round      negotiate.c round_header_t: magic, cache words, round, payload bytes, payload
             hash (FNV-1a), blocking seq, blocking hash, report; then cache bits
  entry      negotiate.c entry_header_t: name length, reserved, rs_meta_t; then the name
"""
import hashlib
import hmac
import os
import socket
import struct
import threading
import time
import traceback
from typing import Callable, Dict, List, Optional

from ringsync import Communicator, Config
from ringsync.bootstrap import JobKeys, PeerInfo
from ringsync.rendezvous import Rendezvous, ThreadGroup

from tests.faults.rogue_clients import HELLO, MAGIC, VERSION, recv_exact

CHALLENGE_BYTES = 16 + 32
ACCEPT_LABEL, CONNECT_LABEL = b"ringsync-accept", b"ringsync-connect"
WELCOME = b"W"  # the acceptor's last word: the connection is registered

ROUND = struct.Struct("<IIQQQQQQ")  # round_header_t
ROUND_MAGIC = 0x52534E47
MAX_DIMS = 8
META = struct.Struct(f"<iiiiiidd{MAX_DIMS}q")  # rs_meta_t
ENTRY = struct.Struct("<II")  # entry_header_t before its rs_meta_t
KIND = {"allreduce": 0, "allgather": 1, "broadcast": 2, "barrier": 5, "join": 6, "send": 7,
        "tune": 9, "refused": 10}
FLOAT64, OP_SUM = 7, 0
WAIT_S = 30.0  # a hostile socket operation ends by then


def fnv1a(data: bytes) -> int:
    h = 1469598103934665603
    for b in data:
        h = ((h ^ b) * 1099511628211) & 0xFFFFFFFFFFFFFFFF
    return h


def meta(kind="allreduce", dtype=FLOAT64, op=OP_SUM, root=0, shape=(), prescale=1.0,
         postscale=1.0, ndim=None, reserved=0) -> bytes:
    dims = list(shape) + [0] * (MAX_DIMS - len(shape))
    return META.pack(KIND.get(kind, kind) if isinstance(kind, str) else kind, dtype, op, root,
                     len(shape) if ndim is None else ndim, reserved, prescale, postscale, *dims)


def entry(name: bytes, meta_bytes: bytes, name_len=None) -> bytes:
    """One uncached request of a round's payload."""
    return ENTRY.pack(len(name) if name_len is None else name_len, 0) + meta_bytes + name


def round_header(round_no: int, payload: bytes = b"", words: int = 0, payload_bytes=None,
                 payload_hash=None, blocking=(0, 0), report=0, magic=ROUND_MAGIC) -> bytes:
    return ROUND.pack(magic, words, round_no, len(payload) if payload_bytes is None
                      else payload_bytes, fnv1a(payload) if payload_hash is None else payload_hash,
                      blocking[0], blocking[1], report) + b"\0" * (8 * words)


def blocking_word(seq: int, name: str):
    """What a rank waiting in its seq-th blocking call `name` reports in its round header."""
    return seq, fnv1a(name.encode())


# ---------------------------------------------------------------- the handshake

def _mac(keys: JobKeys, label: bytes, connector: int, acceptor: int, nonce_c: bytes,
         nonce_a: bytes) -> bytes:
    fields = struct.pack("<IQII", VERSION, keys.job_id, connector, acceptor)
    return hmac.new(keys.secret, label + b"\0" + fields + nonce_c + nonce_a,
                    hashlib.sha256).digest()


def dial(address: str, port: int, keys: JobKeys, me: int, peer: int) -> socket.socket:
    """Connect to rank `peer` as rank `me` and prove it as tcp_setup.c's connector does
    (checking the acceptor's proof first). Returns the authenticated socket."""
    s = socket.create_connection((address, port), timeout=WAIT_S)
    nonce_c = os.urandom(16)
    s.sendall(HELLO.pack(MAGIC, keys.job_id, me, VERSION, peer, nonce_c))
    challenge = recv_exact(s, CHALLENGE_BYTES)
    nonce_a = challenge[:16]
    if challenge[16:] != _mac(keys, ACCEPT_LABEL, me, peer, nonce_c, nonce_a):
        s.close()
        raise AssertionError(f"rank {peer} did not prove the job's secret to the hostile rank")
    s.sendall(_mac(keys, CONNECT_LABEL, me, peer, nonce_c, nonce_a))
    if recv_exact(s, 1) != WELCOME:
        raise AssertionError(f"rank {peer} did not welcome the hostile rank")
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return s


# ---------------------------------------------------------------- the hostile rank

class HostilePeer:
    """The highest rank of a job of `size`: it takes part in the honest ranks' rendezvous
    (see HonestRendezvous), then connect() gives it one authenticated socket per honest
    rank, on which it writes what it likes."""

    def __init__(self, size: int):
        self.size, self.rank = size, size - 1
        self.keys: Optional[JobKeys] = None
        self.peers: Optional[List[PeerInfo]] = None
        self.socks: Dict[int, socket.socket] = {}
        self._known = threading.Event()
        self._lock = threading.Lock()

    def post(self, honest_posts: list):
        """What this rank posts to an exchange, given the honest ranks' posts (every honest
        rank calls it with the same posts). It learns the listeners and the keys."""
        first = honest_posts[0]
        with self._lock:
            if isinstance(first, JobKeys):
                self.keys = first
            elif isinstance(first, tuple) and first and isinstance(first[0], PeerInfo):
                self.peers = [p[0] for p in honest_posts]
                return (PeerInfo(first[0].host_name, first[0].address, 1), None, first[2])
            elif isinstance(first, tuple) and len(first) == 2 and first[0] in ("usage", "comm"):
                return None  # a setup error of rank 0's, not ours
            if self.keys is not None and self.peers is not None:
                self._known.set()
        return first

    def connect(self, timeout: float = WAIT_S) -> Dict[int, socket.socket]:
        if not self._known.wait(timeout):
            raise AssertionError("the honest ranks never broadcast the job's keys")
        for peer, info in enumerate(self.peers):
            self.socks[peer] = dial(info.address, info.port, self.keys, self.rank, peer)
        return self.socks

    def recv(self, peer: int, n: int) -> bytes:
        data = recv_exact(self.socks[peer], n)
        if len(data) != n:
            raise EOFError(f"rank {peer} closed after {len(data)} of {n} bytes")
        return data

    def send(self, peer: int, data: bytes) -> None:
        self.socks[peer].sendall(data)

    def play_round(self, header: bytes, payload: bytes = b"", words: int = 0,
                   read_payloads: bool = True):
        """Take part in one negotiation round: once rank 0 has begun it, send `header`
        (its cache bits included) to every honest rank and read theirs, then exchange the
        requests if any rank announced some (this rank sends `payload`, whatever its header
        said; read_payloads=False: without waiting for theirs, which a rank relays only
        once it has ours). With at most three ranks, the core's log-round allgather moves each record
        straight from its owner to every other rank (rank 0's first step sends to the
        highest rank, whose first step sends to the one below), so this is the order a
        real rank keeps. Returns the honest ranks' headers (ROUND's fields) and payloads."""
        record = ROUND.size + 8 * words
        theirs = {0: self.recv(0, record)}
        for p in self.socks:
            self.send(p, header)
        theirs.update((p, self.recv(p, record)) for p in self.socks if p != 0)
        theirs = {p: ROUND.unpack(r[:ROUND.size]) for p, r in theirs.items()}
        if ROUND.unpack_from(header)[3] == 0 and not any(h[3] for h in theirs.values()):
            return theirs, {}
        for p in self.socks:
            self.send(p, payload)
        if not read_payloads:
            return theirs, {}
        return theirs, {p: self.recv(p, theirs[p][3]) for p in self.socks}

    def serve(self, first_payload: bytes, words: int = 0, **first_header) -> None:
        """Answer rounds until the honest ranks hang up: the first with `first_payload`
        (header fields from first_header), the later ones empty, as a rank that has
        posted its requests and waits."""
        round_no, payload = 0, first_payload
        try:
            while True:
                fields = first_header if round_no == 0 else {}
                self.play_round(round_header(round_no, payload, words, **fields), payload,
                                words)
                round_no, payload = round_no + 1, b""
        except (EOFError, OSError):
            return  # the honest ranks failed (or finished) and closed

    def finish(self, seconds: float = WAIT_S) -> None:
        """Stop writing (FIN, never a reset: the honest rank reads all that was sent) and
        read until every honest rank has closed its end, so no honest rank ever waits for
        bytes that will not come."""
        for s in self.socks.values():
            try:
                s.shutdown(socket.SHUT_WR)
            except OSError:
                pass
        deadline = time.monotonic() + seconds
        for s in self.socks.values():
            drain(s, deadline)
            s.close()


def drain(s: socket.socket, deadline: float) -> bytes:
    """Everything s delivers until its peer closes it (or the deadline)."""
    got = []
    while True:
        s.settimeout(max(0.01, deadline - time.monotonic()))
        try:
            chunk = s.recv(1 << 16)
        except (socket.timeout, ConnectionError):
            break
        if not chunk:
            break
        got.append(chunk)
    return b"".join(got)


class HonestRendezvous(Rendezvous):
    """An honest rank's view of a job whose last rank is `hostile`: the honest ranks'
    ThreadGroup exchange, plus the hostile rank's post."""

    def __init__(self, group: ThreadGroup, rank: int, hostile: HostilePeer):
        self.group, self.rank, self.size, self.hostile = group, rank, hostile.size, hostile

    def allgather(self, obj):
        posts = self.group._exchange(self.rank, obj)
        return posts + [self.hostile.post(posts)]


# ---------------------------------------------------------------- a job with a hostile rank

class Outcome:
    def __init__(self, rank):
        self.rank, self.value, self.error, self.trace = rank, None, None, None

    def __repr__(self):
        return f"rank {self.rank}: " + (f"returned {self.value!r}" if self.error is None else
                                        f"raised {self.trace}")


def run_with_hostile(honest_body: Callable, hostile_body: Callable, size: int = 2,
                     env: Optional[dict] = None, timeout: float = 60.0):
    """honest_body(comm) on ranks 0..size-2 (threads, real Communicators over TCP by
    default) and hostile_body(peer) for rank size-1, once connected. Every honest rank
    aborts its communicator at the end (a shutdown would wait for the hostile rank).
    Returns (honest outcomes, hostile outcome); a thread still running at the deadline
    raises AssertionError with the outcomes so far."""
    hostile = HostilePeer(size)
    group = ThreadGroup(size - 1, timeout)
    config = Config.from_env(environ={"RINGSYNC_TRANSPORT": "tcp",
                                      "RINGSYNC_TIMEOUT_SECONDS": "20", **(env or {})})
    outcomes = [Outcome(r) for r in range(size)]

    def honest(rank):
        comm = Communicator(rendezvous=HonestRendezvous(group, rank, hostile), config=config)
        try:
            outcomes[rank].value = honest_body(comm)
        finally:
            comm.abort("the test is over")

    def evil(rank):
        hostile.connect(timeout)
        try:
            outcomes[rank].value = hostile_body(hostile)
        finally:
            hostile.finish()

    threads = [threading.Thread(target=_catching, args=(honest if r < size - 1 else evil, r,
                                                        outcomes[r], group), daemon=True)
               for r in range(size)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + timeout
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    if any(t.is_alive() for t in threads):
        group.abort()
        raise AssertionError(f"still running after {timeout:g} s: {outcomes}")
    return outcomes[:-1], outcomes[-1]


def _catching(fn, rank, outcome, group):
    try:
        fn(rank)
    except BaseException as e:  # (recorded for the test to judge)
        outcome.error, outcome.trace = e, traceback.format_exc()
        group.abort()
