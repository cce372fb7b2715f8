"""The allgather in ceil(log2 N) rounds (native/src/gather_log.c) on raw communicators,
one per thread of this process (the native calls release the GIL): every rank count from
1 to 13 that matters (1, 2, powers of two, primes, one past a power of two), per-rank
counts with zeros and large ones, data that differs by rank, compared byte for byte with
the concatenation; over TCP and over shared memory. And the sizes it refuses."""
import threading

import numpy as np
import pytest

from ringsync._native import ffi, lib

HOST = "127.0.0.1"
SECRET = bytes(range(32))
WAIT_S = 120
MODES = {"tcp": lib.RS_TRANSPORT_TCP, "shm": lib.RS_TRANSPORT_SHM}
ALWAYS_LOG, NEVER_LOG = 1 << 62, 0  # small_gather_bytes: every gather / none


def on_threads(fn, size):
    """fn(rank) on `size` threads at once; their results, or the first exception."""
    results, errors = [None] * size, []

    def run(r):
        try:
            results[r] = fn(r)
        except BaseException as e:  # reported below, naming the rank
            errors.append((r, e))
    threads = [threading.Thread(target=run, args=(r,), daemon=True) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(WAIT_S)
    assert not any(t.is_alive() for t in threads), "a rank did not return"
    if errors:
        raise AssertionError(f"rank {errors[0][0]}: {errors[0][1]!r}") from errors[0][1]
    return results


def last_error(c):
    return ffi.string(lib.rs_comm_last_error(c)).decode()


class Ring:
    """`size` connected communicators in this process."""

    def __init__(self, size, mode):
        self.size, self.comms, ports = size, [], []
        for r in range(size):
            cptr, port = ffi.new("rs_comm_t **"), ffi.new("int *")
            assert lib.rs_comm_create(r, size, HOST.encode(), 60.0, 60.0, cptr, port) == 0
            self.comms.append(cptr[0])
            ports.append(port[0])
            assert lib.rs_comm_set_transport(cptr[0], MODES[mode]) == lib.RS_OK
        hosts = [ffi.new("char[]", HOST.encode()) for _ in range(size)]

        def connect(r):
            st = lib.rs_comm_connect(self.comms[r], ffi.new("const char *[]", hosts),
                                     ffi.new("int[]", ports), ffi.new("const char *[]", hosts),
                                     0xFEED, SECRET, len(SECRET))
            assert st == lib.RS_OK, last_error(self.comms[r])
        on_threads(connect, size)
        assert all(ffi.string(lib.rs_comm_transport_name(c)).decode() ==
                   (mode if size > 1 else "tcp") for c in self.comms)

    def allgather(self, parts, small_gather_bytes):
        """Every rank gathers `parts` (one numpy array per rank, same dtype)."""
        counts = [p.size for p in parts]
        total = sum(counts)

        def gather(r):
            lib.rs_comm_set_small_gather(self.comms[r], small_gather_bytes)
            out = np.full(total, 0xAB, parts[0].dtype)  # no byte of it is right by chance
            st = lib.rs_allgatherv(self.comms[r], ffi.from_buffer(parts[r]),
                                   ffi.from_buffer(out), ffi.new("int64_t[]", counts),
                                   parts[0].itemsize)
            assert st == lib.RS_OK, last_error(self.comms[r])
            return out
        return on_threads(gather, self.size)

    def close(self):
        for c in self.comms:
            lib.rs_comm_destroy(c)


def _counts(size, case):
    if case == "zeros":  # some ranks send nothing, the last rank too
        return [0 if r % 3 == 0 or r == size - 1 else r + 1 for r in range(size)]
    if case == "all_zero":
        return [0] * size
    if case == "large":  # hundreds of KiB per rank, uneven, one rank empty
        return [0 if r == 1 else 50_000 + 7919 * r for r in range(size)]
    return [(r * 5 + 3) % 11 for r in range(size)]  # "uneven": small, differing


def _parts(counts, dtype):
    """Rank r's part: r * 1000 + index (wrapping in small dtypes): differs by rank and
    position."""
    return [((r * 1000 + np.arange(n)) % (1 << 31)).astype(dtype) for r, n in enumerate(counts)]


@pytest.fixture(scope="module", params=["tcp", "shm"])
def mode(request):
    return request.param


@pytest.mark.parametrize("size", [1, 2, 3, 5, 7, 8, 13])
def test_log_rounds_gather_every_rank_in_order(size, mode):
    ring = Ring(size, mode)
    try:
        for case in ("uneven", "zeros", "all_zero", "large"):
            for dtype in (np.uint8, np.float64):
                parts = _parts(_counts(size, case), dtype)
                expected = np.concatenate(parts).view(np.uint8)
                for how, threshold in (("log rounds", ALWAYS_LOG), ("ring", NEVER_LOG)):
                    for r, got in enumerate(ring.allgather(parts, threshold)):
                        assert np.array_equal(got.view(np.uint8), expected), \
                            (size, mode, case, dtype, how, r)
    finally:
        ring.close()


@pytest.mark.parametrize("counts,elem,fragment", [
    ([1, -1, 1], 8, "negative count -1 for rank 1"),
    ([1, 1 << 58, 1 << 58], 8, "makes the total overflow"),
    ([1, 1, 1], 1 << 61, "element of"),
])
def test_sizes_that_overflow_are_refused_before_anything_moves(counts, elem, fragment):
    """Counts may come from peers: a negative one, or a total past 2^60 bytes, fails on
    every rank alike as a usage error, and the next gather still works."""
    ring = Ring(3, "tcp")
    try:
        def bad(r):
            buf = np.zeros(8, np.uint8)
            st = lib.rs_allgatherv(ring.comms[r], ffi.from_buffer(buf), ffi.from_buffer(buf),
                                   ffi.new("int64_t[]", counts), elem)
            return st, last_error(ring.comms[r]), lib.rs_comm_is_broken(ring.comms[r])
        for st, text, broken in on_threads(bad, 3):
            assert st == lib.RS_ERR_USAGE and fragment in text and not broken, (st, text)
        parts = _parts([2, 3, 4], np.int32)
        for got in ring.allgather(parts, ALWAYS_LOG):
            assert np.array_equal(got, np.concatenate(parts))
    finally:
        ring.close()
