"""Mutated frames from a hostile authenticated peer, replayed against an honest rank.

1. record(): two honest thread ranks run one grouped allreduce over TCP, rank 1 reaching
   rank 0 through a relay that keeps what rank 1 sends after the handshake (its "frames":
   one negotiation round, then the ring's data). The relay holds both directions until each
   side has sent its first byte, so each side's round carries its whole call: the stream
   does not depend on which rank was faster, and a replay meets an honest rank in the same
   state. Everything after the round (its header says how long it is) is data.
2. mutate(): one seeded mutation of the recording (bit flips, words set to extremes,
   truncation, insertion, deletion, duplication, random bytes, a splice of two recordings).
3. replay(): a fresh honest rank 0 makes the same call while hostile_peer.HostilePeer, as
   rank 1, sends the mutated stream and then closes its end. Allowed outcomes:
   - an error naming rank 1 (CommunicationError; or a mismatch, for well-formed records
     that disagree with rank 0's call, which is what a peer with another program sends);
   - the reference result, exactly;
   - any result, only where the mutation touched nothing but data bytes (a peer's data is
     its own: a changed contribution is indistinguishable from another input).
   Anything else (another error, a result built from forged metadata, a hang, a crash)
   fails: run() runs in a child process (python -m tests.common.hostile_fuzz) under a
   deadline, and prints the seed and the case to reproduce it.
"""
import argparse
import random
import select
import socket
import struct
import sys
import tempfile
import threading
import time

import numpy as np

from ringsync import Communicator, Config, CommunicationError, MismatchError, Sum
from ringsync.bootstrap import PeerInfo
from ringsync.rendezvous import Rendezvous, ThreadGroup

from tests.common import hostile_peer as hp

HANDSHAKE_OUT = 48 + 32  # what a connector sends before its data: HELLO, PROOF
HANDSHAKE_IN = 48 + 1  # what it receives: CHALLENGE, WELCOME
ABORT_REPORT = struct.pack("<Ii", 0x4C534F4C, -1)  # after an abort notice: no lost rank
NAMES = ["fuzz.a", "fuzz.b", "fuzz.c"]
ENV = {"RINGSYNC_TRANSPORT": "tcp", "RINGSYNC_TIMEOUT_SECONDS": "20",
       "RINGSYNC_STALL_CHECK_SECONDS": "0"}


def tensors(rank: int, salt: int):
    """Rank `rank`'s inputs: two dtypes (two fused runs), values differing by rank,
    position and salt."""
    base = 1000 * salt + 10 * rank
    return [np.arange(11, dtype=np.float64) * 0.5 + base,
            (np.arange(5, dtype=np.int32) - 2) * (rank + 3) + base,
            np.arange(12, dtype=np.float32).reshape(3, 4) + base]


def reference(salt: int):
    return [a + b for a, b in zip(tensors(0, salt), tensors(1, salt))]


def call(comm, salt):
    return comm.grouped_allreduce(tensors(comm.rank(), salt), op=Sum, name="fuzz")


# ---------------------------------------------------------------- recording

class Relay:
    """Between rank 1 (the connector) and rank 0's listener: relays the handshake, then
    holds each direction until both sides have sent data, and keeps rank 1's data."""

    def __init__(self):
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.target = None
        self.kept = bytearray()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        self.listener.settimeout(hp.WAIT_S)
        one, _ = self.listener.accept()
        zero = socket.create_connection(self.target, timeout=hp.WAIT_S)
        sent = {one: 0, zero: 0}  # bytes each side has sent
        held = {one: bytearray(), zero: bytearray()}
        other = {one: zero, zero: one}
        handshake = {one: HANDSHAKE_OUT, zero: HANDSHAKE_IN}
        open_ends = {one, zero}
        while open_ends:
            ready, _, _ = select.select(list(open_ends), [], [], hp.WAIT_S)
            if not ready:
                break
            for s in ready:
                chunk = s.recv(1 << 16)
                if not chunk:
                    open_ends.discard(s)
                    try:
                        other[s].shutdown(socket.SHUT_WR)
                    except OSError:  # that end is gone already
                        pass
                    continue
                if s is one:
                    self.kept += chunk[max(0, HANDSHAKE_OUT - sent[s]):]
                sent[s] += len(chunk)
                held[s] += chunk
            both_started = all(sent[s] > handshake[s] for s in sent)
            for s in (one, zero):
                if both_started or sent[s] <= handshake[s]:
                    try:
                        other[s].sendall(held[s])
                    except OSError:
                        open_ends.clear()  # a rank gave up: the recording fails its check
                    held[s].clear()
        one.close()
        zero.close()
        self.listener.close()


class RelayedRendezvous(Rendezvous):
    """Rank 1 of two honest ranks learns the relay's port as rank 0's."""

    def __init__(self, group, rank, relay):
        self.group, self.rank, self.size, self.relay = group, rank, group.size, relay

    def allgather(self, obj):
        posts = self.group._exchange(self.rank, obj)
        if self.rank == 1 and isinstance(posts[0], tuple) and isinstance(posts[0][0], PeerInfo):
            info = posts[0][0]
            self.relay.target = (info.address, info.port)
            self.relay.thread.start()
            posts = [(PeerInfo(info.host_name, "127.0.0.1", self.relay.port),) + posts[0][1:]] \
                + posts[1:]
        return posts


def record(salt: int) -> bytes:
    """What honest rank 1 sends rank 0 after the handshake for call(salt)."""
    relay, group = Relay(), ThreadGroup(2, hp.WAIT_S)
    results = [None, None]
    config = Config.from_env(environ=ENV)

    def rank_main(rank):
        comm = Communicator(rendezvous=RelayedRendezvous(group, rank, relay), config=config)
        try:
            results[rank] = call(comm, salt)
        finally:
            comm.abort("recorded")

    threads = [threading.Thread(target=rank_main, args=(r,), daemon=True) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(hp.WAIT_S)
    relay.thread.join(hp.WAIT_S)
    for got in results:
        assert got is not None, "the recorded job failed"
        for g, want in zip(got, reference(salt)):
            np.testing.assert_array_equal(g, want)
    kept = bytes(relay.kept)
    # comm.abort's notice ends the stream with its report (tcp_setup.c), when it gets there
    return kept[:-len(ABORT_REPORT)] if kept.endswith(ABORT_REPORT) else kept


def data_start(a: bytes, b: bytes) -> int:
    """Where the data bytes begin: after the round's header, cache bits and requests (as
    its header announces). Two recordings of the same call with different data must agree
    up to there."""
    header = hp.ROUND.unpack_from(a)
    end = hp.ROUND.size + 8 * header[1] + header[3]
    assert len(a) == len(b) and a[:end] == b[:end] and a != b, \
        "recordings of one call differ outside its data"
    return end


# ---------------------------------------------------------------- mutations

INTERESTING = [0, 1, 0xFF, 0x7FFFFFFF, 0x80000000, 0xFFFFFFFF, 1 << 30, 1 << 31, 1 << 60,
               (1 << 63) - 1, 1 << 63, (1 << 64) - 1]


def first_change(original: bytes, mutated: bytes) -> int:
    """The first offset where the mutated stream differs (a truncation: its end)."""
    return next((i for i, (x, y) in enumerate(zip(original, mutated)) if x != y),
                min(len(original), len(mutated)))


def mutate(rng: random.Random, frame: bytes, other: bytes, protocol_end: int):
    """(mutated bytes, description). Most mutations land in the
    negotiation (before protocol_end), where the parsing is."""
    data = bytearray(frame)
    at = rng.randrange(protocol_end) if rng.random() < 0.8 else rng.randrange(len(data))
    kind = rng.randrange(9)
    if kind == 0:
        bits = rng.randint(1, 8)
        for _ in range(bits):
            i = min(len(data) - 1, at + rng.randrange(8))
            data[i] ^= 1 << rng.randrange(8)
        return bytes(data), f"flip {bits} bits near {at}"
    if kind == 1:
        width = rng.choice([4, 8])
        at -= at % width
        value = rng.choice(INTERESTING) & ((1 << (8 * width)) - 1)
        data[at:at + width] = value.to_bytes(width, "little")
        return bytes(data), f"set {width} bytes at {at} to {value:#x}"
    if kind == 2:
        return bytes(data[:at]), f"truncate at {at}"
    if kind == 3:
        n = rng.randint(1, 64)
        return bytes(data[:at]) + rng.randbytes(n) + bytes(data[at:]), f"insert {n} at {at}"
    if kind == 4:
        n = rng.randint(1, 64)
        return bytes(data[:at]) + bytes(data[at + n:]), f"delete {n} at {at}"
    if kind == 5:
        n = rng.randint(1, 128)
        return bytes(data[:at + n]) + bytes(data[at:]), f"repeat {n} at {at}"
    if kind == 6:
        n = rng.randint(1, 32)
        data[at:at + n] = rng.randbytes(len(data[at:at + n]))
        return bytes(data), f"random {n} at {at}"
    if kind == 7:
        cut = rng.randrange(len(other))
        return bytes(data[:at]) + other[cut:], f"splice at {at} with the other from {cut}"
    data[at] = rng.randrange(256)
    return bytes(data), f"byte {at} = {data[at]}"


# ---------------------------------------------------------------- replay

class Violation(AssertionError):
    pass


def replay(frame: bytes, salt: int, data_only: bool, timeout: float = 30.0) -> str:
    """One honest rank 0 against the stream; returns what happened ("ok", "error") or
    raises Violation."""
    def hostile(peer):
        peer.recv(0, 1)  # rank 0's round began: it holds its whole call
        peer.send(0, frame)

    honest, evil = hp.run_with_hostile(lambda comm: call(comm, salt), hostile, 2, ENV,
                                       timeout)
    o = honest[0]
    if o.error is not None:
        if isinstance(o.error, (CommunicationError, MismatchError)) and "rank 1" in str(o.error):
            return "error"
        raise Violation(f"rank 0 raised something else: {o.trace}")
    if not data_only:
        for got, want in zip(o.value, reference(salt)):
            if not np.array_equal(got, want):
                raise Violation(f"rank 0 returned {o.value}, not the reference {reference(salt)}")
    return "ok"


def run(seed: int, frames: int, report=print) -> dict:
    # Forged hang report numbers that pass the core's bound make rank 0 write its part of
    # a report: into a directory of this run's, not the shared temporary one.
    with tempfile.TemporaryDirectory(prefix="hostile-fuzz-") as reports:
        ENV["RINGSYNC_HANG_REPORT_DIR"] = reports
        return _run(seed, frames, report)


def _run(seed: int, frames: int, report) -> dict:
    a, b = record(1), record(2)
    protocol_end = data_start(a, b)
    counts = {"ok": 0, "error": 0}
    sanity = replay(a, 1, data_only=False)
    assert sanity == "ok", "an unmutated replay failed"
    rng = random.Random(seed)
    started = time.monotonic()
    for case in range(frames):
        frame, what = mutate(rng, a, b, protocol_end)
        try:
            counts[replay(frame, 1, data_only=first_change(a, frame) >= protocol_end)] += 1
        except Violation as e:
            raise Violation(f"seed {seed}, case {case} ({what}): {e}") from None
    counts["seconds"] = round(time.monotonic() - started, 1)
    counts["negotiation_bytes"], counts["frame_bytes"] = protocol_end, len(a)
    report(f"hostile fuzz: seed {seed}, {frames} mutated frames: {counts}")
    return counts


def main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--seed", type=int, required=True)
    parser.add_argument("--frames", type=int, default=10000)
    args = parser.parse_args(argv)
    print(f"hostile fuzz: seed {args.seed}", flush=True)
    run(args.seed, args.frames)
    sys.stdout.flush()


if __name__ == "__main__":
    main()
