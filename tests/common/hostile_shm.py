"""The hostile rank of tests/common/hostile_peer.py on shared memory: it also takes part
in the shared-memory setup of transport_shm.c (two barriers over TCP, each rank sending
hello_t {error, pid}; a segment of its own named after the job, rank and pid; the honest
rank's segment mapped), so that the honest rank talks to it through the rings. Then it
writes forged ring counters, or (LaneRank) forged posts on the same-host lane of lane.c.

Run as a child process (python -m tests.common.hostile_shm CASE): a ring read or written
past its end may crash the honest rank, which must fail the test, not pytest. It prints
the honest rank's outcome and exits 0 when that is the error the case expects. The lane
cases (python -m tests.common.hostile_shm lane [CASE ...]) print rank 0's outcome of each
as a line of JSON, for tests/faults/test_hostile_shm.py to judge."""
import json
import mmap
import os
import struct
import sys
import threading
import time

import numpy as np

from ringsync import CommunicationError, MismatchError, Sum

from tests.common import hostile_peer as hp

RING_BYTES = 1 << 21
RING_T = 256 + RING_BYTES  # ring_header_t, then the data
HEAD, TAIL, CONSUMER_SLEEPING, DATA = 0, 64, 128, 256
LANE_AREA_BYTES = 2 * ((256 << 10) + 4000 + 1024) + 128  # RS_LANE_AREA_BYTES
HELLO = struct.Struct("<ii")  # hello_t
ENV = {"RINGSYNC_TRANSPORT": "shm", "RINGSYNC_LANE_BYTES": "0", "RINGSYNC_STAGED_BYTES": "0"}


def segment_path(job_id, rank, pid):
    return f"/dev/shm/ringsync-{job_id:016x}-{rank}-{pid}"


class ShmRank:
    """Rank 1 of 2 on shared memory. `mine`: its segment (the ring rank 0 writes to it at
    slot 0); `theirs`: rank 0's (the ring it writes to rank 0 at slot 0)."""

    def __init__(self, peer: hp.HostilePeer):
        assert peer.size == 2, "the rings' slots here are those of two ranks"
        self.peer, size = peer, RING_T + 2 * LANE_AREA_BYTES
        path = segment_path(peer.keys.job_id, 1, os.getpid())
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        os.posix_fallocate(fd, 0, size)
        self.mine = mmap.mmap(fd, size)
        os.close(fd)
        their_pid = self._barrier()
        fd = os.open(segment_path(peer.keys.job_id, 0, their_pid), os.O_RDWR)
        self.theirs = mmap.mmap(fd, size)
        os.close(fd)
        self._barrier()
        os.unlink(path)  # both mapped: as the honest ranks do

    def _barrier(self) -> int:
        self.peer.send(0, HELLO.pack(0, os.getpid()))
        error, pid = HELLO.unpack(self.peer.recv(0, HELLO.size))
        assert error == 0, f"rank 0 could not set up shared memory: errno {error}"
        return pid

    @staticmethod
    def word(m, at) -> int:
        return struct.unpack_from("<Q", m, at)[0]

    @staticmethod
    def set_word(m, at, value) -> None:
        struct.pack_into("<Q", m, at, value & (2**64 - 1))

    def read(self, n: int, seconds: float = hp.WAIT_S) -> bytes:
        """n bytes rank 0 sent us through our ring."""
        deadline = time.monotonic() + seconds
        while self.word(self.mine, HEAD) - self.word(self.mine, TAIL) < n:
            assert time.monotonic() < deadline, "rank 0 sent nothing through the ring"
            time.sleep(0.001)
        tail = self.word(self.mine, TAIL)
        at = DATA + tail % RING_BYTES
        data = self.mine[at:at + n]  # (no wrap: the tests read the ring's first bytes)
        self.set_word(self.mine, TAIL, tail + n)
        return data

    def write(self, data: bytes) -> None:
        head = self.word(self.theirs, HEAD)
        at = DATA + head % RING_BYTES
        self.theirs[at:at + len(data)] = data
        self.set_word(self.theirs, HEAD, head + len(data))
        self.ring()

    def ring(self) -> None:
        """The doorbell: one byte on the socket, which a sleeping rank 0 waits on."""
        struct.pack_into("<i", self.theirs, CONSUMER_SLEEPING, 0)
        self.peer.send(0, b"D")


def _head_far_ahead(shm: ShmRank) -> None:
    """Rank 0 waits for 8 MiB of requests that our header announced; our ring's head then
    claims 2**40 bytes are there, four times the ring's 2 MiB and more."""
    shm.read(hp.ROUND.size)
    shm.write(hp.round_header(0, payload_bytes=8 << 20))
    shm.set_word(shm.theirs, HEAD, shm.word(shm.theirs, TAIL) + (1 << 40))
    shm.ring()


def _tail_far_ahead(shm: ShmRank) -> None:
    """Before rank 0 sends anything, the ring it sends us through says we took 2**40 bytes
    of it: room for more than the ring holds."""
    shm.set_word(shm.mine, TAIL, 1 << 40)
    shm.ring()


CASES = {"head": _head_far_ahead, "tail": _tail_far_ahead}


def run(case: str):
    done = threading.Event()

    def hostile(peer):
        shm = ShmRank(peer)
        CASES[case](shm)
        # Closing before the honest rank has read the counters would end its call with "was
        # closed" instead (seen once under load after a fixed half-second wait).
        done.wait(DONE_WAIT_S)

    def honest(comm):
        try:
            assert comm.transport == "shm", comm.transport
            return comm.allreduce(np.arange(4.0), name="t")
        finally:
            done.set()

    return hp.run_with_hostile(honest, hostile, size=2, env=ENV, timeout=60)


# ---------------------------------------------------------------- the same-host lane

# lane.c: area 0 of a segment follows its rings (one, with two ranks); an area_t holds the
# futex words, then post_t posts[2], a post for operation seq in posts[seq & 1].
LANE_AT = RING_T
POSTS_AT = 128
POST_BYTES = 266432  # sizeof(post_t): its headers, name[4001], data[256 KiB] at 64 bytes
SEQ, REDUCED, NAME_HASH, FLAGS_AT, META_AT, NAME_AT, DATA_AT = 0, 64, 128, 136, 152, 256, 4288
HEADER = struct.Struct("<QiIQ")  # name_hash, flags, epoch, bytes
NAME_FIELD = 4001
POST_DATA, POST_USE_ENGINE, POST_STAGED, POST_REFUSED = 1, 2, 4, 8
N = 5  # elements of each honest call: a prime, so that the staged slices are uneven
LANE_ENV = {"RINGSYNC_TRANSPORT": "shm", "RINGSYNC_TIMEOUT_SECONDS": "20"}
# Five float64s are 40 bytes: over 8, the lane stages them (one chunk, two slices)
STAGED_ENV = {**LANE_ENV, "RINGSYNC_SMALL_ALLREDUCE_BYTES": "8"}
DONE_WAIT_S = 20.0  # the hostile rank stays (its sockets open) until the honest one is done


def honest_input(call: int) -> np.ndarray:
    return np.arange(N) * 1.5 + 1.0 + 10.0 * call


def hostile_input(call: int) -> np.ndarray:
    return 100.0 - 2.0 * np.arange(N) - 7.0 * call


class Meta:
    """rs_meta_t's fields, to forge one at a time."""
    FIELDS = ("kind", "dtype", "op", "root", "ndim", "reserved", "prescale", "postscale")

    def __init__(self, raw: bytes):
        values = hp.META.unpack(raw)
        self.__dict__.update(zip(self.FIELDS, values))
        self.shape = list(values[len(self.FIELDS):])

    def pack(self) -> bytes:
        return hp.META.pack(*(getattr(self, f) for f in self.FIELDS), *self.shape)


class LaneRank:
    """Rank 1's side of the lane on ShmRank's mappings: it reads rank 0's posts (in `theirs`)
    and writes its own (in `mine`), the sequence word last, as lane.c does. It never wakes a
    sleeping rank 0: that one looks again every few milliseconds anyway."""

    def __init__(self, shm: ShmRank):
        self.shm = shm

    @staticmethod
    def at(seq: int) -> int:
        return LANE_AT + POSTS_AT + (seq & 1) * POST_BYTES

    def rank0_posted(self, seq: int) -> bool:
        return ShmRank.word(self.shm.theirs, self.at(seq) + SEQ) == seq

    def rank0_meta(self, seq: int, seconds: float = hp.WAIT_S) -> Meta:
        """The metadata of rank 0's post for operation seq, once it is there."""
        deadline = time.monotonic() + seconds
        while not self.rank0_posted(seq):
            assert time.monotonic() < deadline, f"rank 0 never posted operation {seq}"
            time.sleep(0.001)
        at = self.at(seq) + META_AT
        return Meta(self.shm.theirs[at:at + hp.META.size])

    def rank0_data(self, seq: int) -> np.ndarray:
        at = self.at(seq) + DATA_AT
        return np.frombuffer(self.shm.theirs[at:at + 8 * N], dtype=np.float64)

    def post(self, seq: int, meta: Meta, name: bytes, flags=POST_DATA, data: bytes = b"",
             name_field=None, name_hash=None, size_field=None, seq_word=None) -> None:
        """Our post for operation seq; name_field: the whole field (no NUL added)."""
        m, at = self.shm.mine, self.at(seq)
        field = name + b"\0" if name_field is None else name_field
        assert len(field) <= NAME_FIELD
        HEADER.pack_into(m, at + NAME_HASH, hp.fnv1a(name) if name_hash is None else name_hash,
                         flags, 0, len(data) if size_field is None else size_field)
        m[at + META_AT:at + META_AT + hp.META.size] = meta.pack()
        m[at + NAME_AT:at + NAME_AT + len(field)] = field
        m[at + DATA_AT:at + DATA_AT + len(data)] = data
        ShmRank.set_word(m, at + SEQ, seq if seq_word is None else seq_word)

    def set_reduced(self, seq: int, value: int) -> None:
        ShmRank.set_word(self.shm.mine, self.at(seq) + REDUCED, value)

    def answer(self, seq: int, name: bytes, call: int) -> None:
        """Rank 0's call `seq` as an honest rank makes it, with hostile_input(call)."""
        self.post(seq, self.rank0_meta(seq), name, data=hostile_input(call).tobytes())

    def serve_until(self, done, seq: int) -> None:
        """Answer rank 0's calls from operation seq on (named u, v, ...) until it is done."""
        deadline = time.monotonic() + DONE_WAIT_S
        while not done.is_set() and time.monotonic() < deadline:
            if self.rank0_posted(seq):
                self.answer(seq, bytes([ord("t") + seq - 1]), seq - 1)
                seq += 1
            time.sleep(0.001)


def _forged_post(seq_word=None, flags=POST_DATA, name=b"t", **forged):
    """A case: our post for rank 0's first call, with `forged` fields (Meta's: forged in
    the metadata; name_field, name_hash, size_field: the post's own). A case returns the
    next operation it leaves to serve_until."""
    post_fields = {k: forged.pop(k) for k in ("name_field", "name_hash", "size_field")
                   if k in forged}

    def play(lane: LaneRank) -> None:
        meta = lane.rank0_meta(1)
        for field, value in forged.items():
            setattr(meta, field, value)
        data = b"" if flags == POST_REFUSED else hostile_input(0).tobytes()
        lane.post(1, meta, name, flags=flags, data=forged_data.get(flags, data),
                  seq_word=seq_word, **post_fields)
        return 2
    return play


forged_data = {POST_REFUSED: b"\xff" * 1000}  # a refusal's reason: no NUL, not UTF-8


def _refusal(root):
    return _forged_post(flags=POST_REFUSED, kind=hp.KIND["refused"], root=root, ndim=0,
                        shape=[0] * hp.MAX_DIMS)


def _staged(forged_reduced=None):
    """A case on the staged path: our header, then the one chunk (our slice is elements
    3 and 4: rs_even_part of 5 in 2), then our slice reduced, or a forged `reduced` word."""
    def play(lane: LaneRank) -> None:
        meta = lane.rank0_meta(1)
        lane.post(1, meta, b"t", flags=POST_STAGED)
        chunk = lane.rank0_meta(2)  # (rank 0 staged our slice: its elements 3 and 4)
        lane.post(2, chunk, b"", data=hostile_input(0).tobytes(), name_hash=0)
        if forged_reduced is not None:
            lane.set_reduced(2, forged_reduced)
            return 3
        ours = hostile_input(0)[3:] + lane.rank0_data(2)[3:]
        at = lane.at(2) + DATA_AT + 3 * 8
        lane.shm.mine[at:at + ours.nbytes] = ours.tobytes()
        lane.set_reduced(2, 2)
        return 3
    return play


# name: (what the hostile rank 1 does, the honest rank's settings)
LANE_CASES = {
    # the metadata, malformed
    "dtype out of range": _forged_post(dtype=99),
    "op out of range": _forged_post(op=42),
    "kind out of range": _forged_post(kind=77),
    "nine dimensions": _forged_post(ndim=9),
    "ndim -1": _forged_post(ndim=-1),
    "negative dimension": _forged_post(shape=[-5] + [0] * 7),
    "shape over 2**60 bytes": _forged_post(shape=[1 << 58] + [0] * 7),
    "shape that overflows": _forged_post(ndim=3, shape=[1 << 31] * 3 + [0] * 5),
    "scale factor NaN": _forged_post(prescale=float("nan")),
    "refusal of an unknown kind": _refusal(99),
    # the metadata, well formed but not rank 0's
    "shape larger than the segment": _forged_post(shape=[1 << 40] + [0] * 7),
    "dtype float32": _forged_post(dtype=6),
    "op Max": _forged_post(op=3),
    # the post's own fields
    "flags 16": _forged_post(flags=16),
    "flags -1": _forged_post(flags=-1),
    "refusal without a NUL": _refusal(0),
    "name without a NUL": _forged_post(name=b"t" * NAME_FIELD, name_field=b"t" * NAME_FIELD),
    "name not UTF-8": _forged_post(name=b"t\xff", name_field=b"t\xff" * 2000 + b"t"),
    "name hash forged": _forged_post(name_hash=12345),
    "size field 2**64-1": _forged_post(size_field=2**64 - 1),
    "size field larger than the segment": _forged_post(size_field=1 << 40),
    # the sequence words
    "sequence from the future": _forged_post(seq_word=3),
    "sequence of the other slot": _forged_post(seq_word=2),
    "sequence 2**64-1": _forged_post(seq_word=2**64 - 1),
    "staged, played honestly": _staged(),
    "staged, reduced word from the future": _staged(forged_reduced=4),
    "staged, reduced word of the other slot": _staged(forged_reduced=3),
}


def run_lane_case(case: str):
    """Rank 0 allreduces honest_input(0) as 't' (sum) against the hostile rank 1 of `case`;
    after a MismatchError it calls again ('u'), which rank 1 answers honestly. Returns
    rank 0's outcome: its value is (result of 't' or its MismatchError, result of 'u')."""
    done = threading.Event()
    env = STAGED_ENV if case.startswith("staged") else LANE_ENV

    def hostile(peer):
        lane = LaneRank(ShmRank(peer))
        lane.serve_until(done, LANE_CASES[case](lane))

    def honest(comm):
        try:
            assert comm.transport == "shm", comm.transport
            try:
                first = comm.allreduce(honest_input(0), op=Sum, name="t")
            except MismatchError as e:
                return e, comm.allreduce(honest_input(1), op=Sum, name="u")
            return first, None
        finally:
            done.set()

    honest_outcomes, _ = hp.run_with_hostile(honest, hostile, size=2, env=env, timeout=45)
    return honest_outcomes[0]


def lane_report(case: str) -> dict:
    """What rank 0 got in `case`, as JSON: the error's class and text, or the results."""
    try:
        o = run_lane_case(case)
    except AssertionError as e:  # (a rank still running at the deadline)
        return {"case": case, "hung": str(e)}
    if o.error is not None:
        return {"case": case, "error": type(o.error).__name__, "text": str(o.error),
                "trace": o.trace}
    first, second = o.value
    return {"case": case, "mismatch": None if isinstance(first, np.ndarray) else str(first),
            "first": None if first is None or not isinstance(first, np.ndarray)
            else first.tolist(), "second": None if second is None else second.tolist()}


def main_lane(cases):
    for case in cases or LANE_CASES:
        print(json.dumps(lane_report(case)), flush=True)


def main():
    if sys.argv[1] == "lane":
        return main_lane(sys.argv[2:])
    honest, evil = run(sys.argv[1])
    print(f"honest: {honest}\nhostile: {evil}", flush=True)
    o = honest[0]
    ok = isinstance(o.error, CommunicationError) and "shared-memory ring" in str(o.error) \
        and "rank 1" in str(o.error)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()

