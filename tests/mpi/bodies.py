"""Test bodies run on every rank under mpirun (through ringsync.testing). Each body checks
its results against a numpy reference computed from every rank's input."""
import os
import signal
import time

import numpy as np

import ringsync as rs

from .reference import (MOVABLE, OPS, REDUCIBLE, SIZES, assert_reduced,
                        rank_input)


def _op(name):
    return getattr(rs, name)


def _inputs(shape, dtype, op="Sum", salt=""):
    return [rank_input(r, shape, dtype, op, salt) for r in range(rs.size())]


def _shape_for(n, dtype):
    # Mix 1-D and 2-D shapes; 2-D when n splits into 3 columns.
    return (n // 3, 3) if n % 3 == 0 and n and dtype in ("int32", "float32") else (n,)


def allreduce_all():
    rs.init()
    for dtype in REDUCIBLE:
        for op in OPS:
            for n in SIZES:
                shape = _shape_for(n, dtype)
                inputs = _inputs(shape, dtype, op)
                what = f"allreduce {dtype} {op} shape {shape} on {rs.size()} ranks"
                got = rs.allreduce(inputs[rs.rank()], op=_op(op), name=what)
                assert_reduced(got, inputs, op, what=what)
                mine = inputs[rs.rank()].copy()
                returned = rs.allreduce_(mine, op=_op(op))
                assert returned is mine or np.shares_memory(returned, mine)
                assert_reduced(mine, inputs, op, what="in-place " + what)
                scaled = rs.allreduce(inputs[rs.rank()], op=_op(op), prescale_factor=0.5,
                                      postscale_factor=3.0)
                assert_reduced(scaled, inputs, op, 0.5, 3.0, what="scaled " + what)
    rs.shutdown()


def allreduce_large_and_strided():
    """Buffers large enough to be split into many segments and partial socket reads,
    and inputs that are non-contiguous views or plain buffers."""
    rs.init()
    for dtype in ["float32", "float64", "int64", "float16"]:
        for n in [1 << 20, (1 << 20) + 7]:
            inputs = _inputs((n,), dtype, "Sum", "large")
            got = rs.allreduce(inputs[rs.rank()], op=rs.Sum)
            assert_reduced(got, inputs, "Sum", what=f"large allreduce {dtype} n={n}")
    base = _inputs((40, 6), "float64", "Sum", "strided")
    got = rs.allreduce(base[rs.rank()][::2, 1::2], op=rs.Average)  # a strided view
    assert_reduced(got, [b[::2, 1::2].copy() for b in base], "Average", what="strided input")
    scalar = rs.allreduce(np.float64(rs.rank()), op=rs.Sum)  # 0-d in, 0-d out
    assert scalar.shape == () and scalar == sum(range(rs.size())), scalar
    buf = bytearray(rank_input(rs.rank(), (17,), "uint8").tobytes())
    rs.allreduce_(buf, op=rs.Max)  # an in-place buffer-protocol object
    assert_reduced(np.frombuffer(bytes(buf), np.uint8), _inputs((17,), "uint8"), "Max",
                   what="bytearray")
    rs.shutdown()


def allgather_all():
    rs.init()
    for dtype in MOVABLE:
        for trailing in [(), (3,), (2, 2)]:
            for base in [0, 1, 2, 5]:
                rows = [(r * 3 + base) % 5 for r in range(rs.size())]  # differ by rank, some 0
                inputs = [rank_input(r, (rows[r],) + trailing, dtype, salt="ag")
                          for r in range(rs.size())]
                got = rs.allgather(inputs[rs.rank()])
                expected = np.concatenate(inputs, axis=0)
                assert got.dtype == expected.dtype and got.shape == expected.shape, \
                    (dtype, trailing, rows, got.shape, expected.shape)
                assert np.array_equal(got.view(np.uint8), expected.view(np.uint8)), \
                    f"allgather {dtype} rows {rows} trailing {trailing}"
    big = [rank_input(r, (100_000 + r,), "float64", salt="agbig") for r in range(rs.size())]
    assert np.array_equal(rs.allgather(big[rs.rank()]), np.concatenate(big))
    scalar = rs.allgather(np.float32(rs.rank() * 1.5))  # 0-d becomes one row per rank
    assert np.array_equal(scalar, np.arange(rs.size(), dtype=np.float32) * 1.5)
    rs.shutdown()


def broadcast_all():
    rs.init()
    for dtype in MOVABLE:
        for n in SIZES + [300_001]:
            for root in range(rs.size()):
                inputs = _inputs((n,), dtype, salt=f"bc{root}")
                got = rs.broadcast(inputs[rs.rank()], root_rank=root)
                assert np.array_equal(got.view(np.uint8), inputs[root].view(np.uint8)), \
                    f"broadcast {dtype} n={n} root={root}"
                mine = inputs[rs.rank()].copy()
                rs.broadcast_(mine, root)
                assert np.array_equal(mine.view(np.uint8), inputs[root].view(np.uint8)), \
                    f"broadcast_ {dtype} n={n} root={root}"
    rs.shutdown()


def reducescatter_all():
    rs.init()
    size = rs.size()
    for dtype in REDUCIBLE:
        for op in OPS:
            for rows in [0, 1, 2, 7, 13, 2 * size + 1]:
                for trailing in [(), (3,)]:
                    inputs = _inputs((rows,) + trailing, dtype, op, "rs")
                    what = f"reducescatter {dtype} {op} rows={rows} trailing={trailing}"
                    got = rs.reducescatter(inputs[rs.rank()], op=_op(op))
                    split = [rows // size + (i < rows % size) for i in range(size)]
                    start = sum(split[: rs.rank()])
                    mine = [x[start:start + split[rs.rank()]] for x in inputs]
                    assert_reduced(got, mine, op, what=what)
    inputs = _inputs((size * 2 + 1, 2), "float64", "Sum", "rs-scaled")
    got = rs.reducescatter(inputs[rs.rank()], op=rs.Sum, prescale_factor=2.0,
                           postscale_factor=0.25)
    split = [(size * 2 + 1) // size + (i < (size * 2 + 1) % size) for i in range(size)]
    start = sum(split[: rs.rank()])
    assert_reduced(got, [x[start:start + split[rs.rank()]] for x in inputs], "Sum", 2.0, 0.25,
                   what="scaled reducescatter")
    rs.shutdown()


def _splits(sender, size, salt):
    return [(sender * 7 + dest * 3 + salt) % 4 for dest in range(size)]  # zeros included


def alltoall_all():
    rs.init()
    size, me = rs.size(), rs.rank()
    for dtype in MOVABLE:
        for trailing in [(), (2, 3)]:
            for salt in range(3):
                splits = [_splits(r, size, salt) for r in range(size)]
                inputs = [rank_input(r, (sum(splits[r]),) + trailing, dtype, salt=f"a2a{salt}")
                          for r in range(size)]
                got, received = rs.alltoall(inputs[me], splits=splits[me])
                pieces = []
                for r in range(size):
                    start = sum(splits[r][:me])
                    pieces.append(inputs[r][start:start + splits[r][me]])
                expected = np.concatenate(pieces, axis=0)
                assert list(received) == [splits[r][me] for r in range(size)]
                assert got.shape == expected.shape, (got.shape, expected.shape)
                assert np.array_equal(got.view(np.uint8), expected.view(np.uint8)), \
                    f"alltoall {dtype} trailing {trailing} splits {splits}"
    even = [np.arange(size * 2, dtype=np.int32) + 100 * r for r in range(size)]
    got = rs.alltoall(even[me])  # no splits: an even split, and the output alone
    assert np.array_equal(got, np.concatenate([e[2 * me:2 * me + 2] for e in even]))
    rs.shutdown()


def barrier_orders_ranks():
    """No rank leaves the barrier before every rank has entered it: each rank leaves a
    marker file before entering, and checks everyone's marker after leaving."""
    rs.init()
    folder = os.environ["RINGSYNC_TEST_DIR"]
    for round_ in range(5):
        time.sleep(0.05 * ((rs.rank() + round_) % rs.size()))  # enter at different times
        open(os.path.join(folder, f"r{round_}-{rs.rank()}"), "w").close()
        rs.barrier()
        missing = [r for r in range(rs.size())
                   if not os.path.exists(os.path.join(folder, f"r{round_}-{r}"))]
        assert not missing, f"round {round_}: left the barrier before ranks {missing} entered"
    rs.shutdown()


def topology_queries():
    rs.init()
    from mpi4py import MPI
    assert rs.is_initialized()
    assert (rs.rank(), rs.size()) == (MPI.COMM_WORLD.rank, MPI.COMM_WORLD.size)
    # Every rank runs on this one host here.
    assert (rs.local_rank(), rs.local_size()) == (rs.rank(), rs.size())
    assert (rs.cross_rank(), rs.cross_size()) == (0, 1)
    rs.shutdown()
    assert not rs.is_initialized()
    # A sub-communicator works too, and init can follow a shutdown.
    sub = MPI.COMM_WORLD.Split(color=rs_color(), key=0)
    rs.init(sub)
    assert rs.size() == sub.size and rs.rank() == sub.rank
    got = rs.allreduce(np.array([MPI.COMM_WORLD.rank], dtype=np.int64), op=rs.Sum)
    members = [r for r in range(MPI.COMM_WORLD.size) if r % 2 == MPI.COMM_WORLD.rank % 2]
    assert got[0] == sum(members), (got, members)
    rs.shutdown()
    sub.Free()


def rs_color():
    from mpi4py import MPI
    return MPI.COMM_WORLD.rank % 2


def bad_input_then_next_call_works():
    """Every bad call raises a clear UsageError on the calling rank and leaves the ring usable."""
    rs.init()
    me, size = rs.rank(), rs.size()
    ok = np.arange(4.0) + me

    def expect(fragment, fn, *args, **kwargs):
        try:
            fn(*args, **kwargs)
        except rs.UsageError as e:
            assert fragment in str(e), f"expected {fragment!r} in {e}"
        else:
            raise AssertionError(f"no UsageError for {fragment!r}")
        got = rs.allreduce(ok, op=rs.Sum)  # the next collective still works
        assert np.array_equal(got, np.arange(4.0) * size + sum(range(size)))

    expect("object", rs.allreduce, np.array([1, "a"], dtype=object))
    expect("complex128", rs.allreduce, np.ones(3, dtype=np.complex128))
    expect("bool", rs.allreduce, np.ones(3, dtype=bool))
    expect("read-only", rs.allreduce_, np.frombuffer(b"12345678", dtype=np.uint8))
    expect("not C-contiguous", rs.allreduce_, np.zeros((4, 4))[:, 1])
    expect("out of range", rs.broadcast, ok, root_rank=size)
    expect("out of range", rs.broadcast_, ok.copy(), root_rank=-1)
    expect("unknown reduction op", rs.allreduce, ok, op=42)
    expect("splits", rs.alltoall, np.zeros(3), splits=[1] * (size + 1))
    if size > 1:
        expect("not divisible", rs.alltoall, np.zeros(size * 2 + 1))
        # A mismatch across ranks: every rank raises, naming the ranks and both values.
        trailing = (3,) if me == size - 1 else (2,)
        expect(f"Mismatched allgather tensor shapes for 'grad.w': rank 0 sent [2, 2], rank "
               f"{size - 1} sent [2, 3] (only the first dimension may differ)",
               rs.allgather, np.zeros((2,) + trailing), name="grad.w")
    rs.shutdown()
    try:
        rs.allreduce(ok)
    except rs.NotInitializedError as e:
        assert "init()" in str(e)
    else:
        raise AssertionError("allreduce after shutdown did not raise")


def killed_peer_fails_the_others(marker=""):
    """Rank `victim` is SIGKILLed while every rank loops on allreduce; each survivor must
    raise CommunicationError naming the lost rank (not time out)."""
    rs.init()
    victim = int(os.environ.get("RINGSYNC_TEST_VICTIM", "1"))
    folder = os.environ["RINGSYNC_TEST_DIR"]
    data = np.ones(1 << 18, dtype=np.float32)
    for step in range(100_000):
        if rs.rank() == victim and step == 20:
            os.kill(os.getpid(), signal.SIGKILL)
        try:
            rs.allreduce_(data, op=rs.Average)
        except rs.CommunicationTimeout:
            raise
        except rs.CommunicationError as e:
            assert f"connection to rank {victim} (host" in str(e), str(e)
            with open(os.path.join(folder, f"survivor-{rs.rank()}"), "w") as f:
                f.write(str(e))
            break
    else:
        raise AssertionError("the victim never died")
    # The broken communicator refuses further work with the same kind of error.
    try:
        rs.allreduce_(data)
    except rs.CommunicationError:
        pass
    else:
        raise AssertionError("a broken communicator accepted another collective")
    rs.shutdown()
    os._exit(0)  # skip MPI_Finalize, which would wait for the dead rank


def slow_peer_times_out():
    """Rank 1 arrives long after RINGSYNC_TIMEOUT_SECONDS: rank 0 gives up with a timeout
    naming rank 1, and rank 1 then learns that rank 0 gave up, instead of waiting."""
    os.environ["RINGSYNC_TIMEOUT_SECONDS"] = "1.5"
    rs.init()
    if rs.rank() == 1:
        time.sleep(5)
    try:
        rs.allreduce(np.ones(10))
    except rs.CommunicationTimeout as e:
        assert rs.rank() == 0, f"rank {rs.rank()} timed out: {e}"
        assert "waited" in str(e) and "for ranks [1] to submit it" in str(e), str(e)
    except rs.CommunicationError as e:
        assert rs.rank() == 1, f"rank {rs.rank()}: {e}"
        assert "rank 0 (host" in str(e) and "aborted" in str(e), str(e)
    else:
        raise AssertionError(f"rank {rs.rank()}: allreduce finished despite the timeout")
    rs.shutdown()


def bad_interface_fails_on_every_rank():
    os.environ["RINGSYNC_IFACE"] = "no-such-nic0"
    try:
        rs.init()
    except rs.UsageError as e:
        assert "RINGSYNC_IFACE='no-such-nic0'" in str(e), str(e)
    else:
        raise AssertionError("init succeeded with a bad RINGSYNC_IFACE")
    assert not rs.is_initialized()


def allreduce_over_routable_address():
    """Listen on and connect to the address other hosts would use, not loopback."""
    from ringsync import bootstrap
    address = bootstrap.listen_addresses(None)[1]
    os.environ["RINGSYNC_IFACE"] = address
    rs.init()
    inputs = _inputs((1001,), "float64", "Sum", "routable")
    assert_reduced(rs.allreduce(inputs[rs.rank()], op=rs.Sum), inputs, "Sum",
                   what=f"allreduce over {address}")
    rs.shutdown()


def mixed_transports():
    """The first half of the ranks report host 'node-a', the rest 'node-b': same-"host"
    ranks use shared memory, the two halves TCP, and every collective gives the same
    results as on one transport."""
    from mpi4py import MPI
    world = MPI.COMM_WORLD
    half = (world.size + 1) // 2
    os.environ["RINGSYNC_HOST_NAME"] = "node-a" if world.rank < half else "node-b"
    os.environ["RINGSYNC_TRANSPORT"] = "auto"
    rs.init()
    local = half if world.rank < half else world.size - half
    assert rs.local_size() == local
    assert rs.cross_size() == (2 if rs.local_rank() < world.size - half else 1)
    assert rs._default.transport == ("shm" if local > 1 else "tcp"), rs._default.transport
    rs.shutdown()
    for body in (allreduce_all, allgather_all, broadcast_all, reducescatter_all, alltoall_all):
        body()  # each starts with init() (same settings) and ends with shutdown()


def forced_shm_needs_one_host():
    """RINGSYNC_TRANSPORT=shm with ranks on two "hosts" fails on every rank, naming them."""
    from mpi4py import MPI
    os.environ["RINGSYNC_HOST_NAME"] = f"node-{MPI.COMM_WORLD.rank % 2}"
    os.environ["RINGSYNC_TRANSPORT"] = "shm"
    try:
        rs.init()
    except rs.RingsyncError as e:
        assert "RINGSYNC_TRANSPORT=shm, but rank" in str(e), str(e)
    else:
        raise AssertionError("init() accepted shm across hosts")
