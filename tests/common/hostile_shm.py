"""The hostile rank of tests/common/hostile_peer.py on shared memory: it also takes part
in the shared-memory setup of transport_shm.c (two barriers over TCP, each rank sending
hello_t {error, pid}; a segment of its own named after the job, rank and pid; the honest
rank's segment mapped), so that the honest rank talks to it through the rings. Then it
writes forged ring counters.

Run as a child process (python -m tests.common.hostile_shm CASE): a ring read or written
past its end may crash the honest rank, which must fail the test, not pytest. It prints
the honest rank's outcome and exits 0 when that is the error the case expects."""
import mmap
import os
import struct
import sys
import time

import numpy as np

from ringsync import CommunicationError

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
    def hostile(peer):
        shm = ShmRank(peer)
        CASES[case](shm)
        time.sleep(0.5)  # (the honest rank reads the counters, then we close)

    def honest(comm):
        assert comm.transport == "shm", comm.transport
        return comm.allreduce(np.arange(4.0), name="t")

    return hp.run_with_hostile(honest, hostile, size=2, env=ENV, timeout=60)


def main():
    honest, evil = run(sys.argv[1])
    print(f"honest: {honest}\nhostile: {evil}", flush=True)
    o = honest[0]
    ok = isinstance(o.error, CommunicationError) and "shared-memory ring" in str(o.error) \
        and "rank 1" in str(o.error)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
