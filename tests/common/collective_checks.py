"""Collective checks, run on every rank, each against numpy references built from every
rank's input.

A check takes a `comm`: anything with the module API's method names — a
ringsync.Communicator (ranks as threads of one process: tests/unit/test_thread_collectives.py)
or the ringsync module itself after init() (ranks under mpirun: tests/mpi/test_collectives.py).
"""
import functools
import random
import time

import numpy as np

import ringsync as rs

from .reference import (MOVABLE, OPS, REDUCIBLE, SIZES, assert_reduced,
                        rank_input)


def _op(name):
    return getattr(rs, name)


@functools.lru_cache(maxsize=32)
def _input(rank, shape, dtype, op, salt):
    """rank_input, computed once per process: thread-ranks share every rank's inputs
    (read-only, so that no rank can change another's)."""
    x = rank_input(rank, shape, dtype, op, salt)
    x.flags.writeable = False
    return x


def _inputs(comm, shape, dtype, op="Sum", salt=""):
    return [_input(r, tuple(shape), dtype, op, salt) for r in range(comm.size())]


def _shape_for(n, dtype):
    # Mix 1-D and 2-D shapes; 2-D when n splits into 3 columns.
    return (n // 3, 3) if n % 3 == 0 and n and dtype in ("int32", "float32") else (n,)


def _slice_of(rows, size, rank):
    """reducescatter's rows for `rank`: split evenly, the first ranks one row more."""
    split = [rows // size + (i < rows % size) for i in range(size)]
    start = sum(split[:rank])
    return slice(start, start + split[rank])


# ============================================================== checks on a `comm`


def allreduce_all(comm):
    """Every dtype x op x size: out of place, in place, and with scale factors."""
    me = comm.rank()
    for dtype in REDUCIBLE:
        for op in OPS:
            for n in SIZES:
                shape = _shape_for(n, dtype)
                inputs = _inputs(comm, shape, dtype, op)
                what = f"allreduce {dtype} {op} shape {shape} on {comm.size()} ranks"
                got = comm.allreduce(inputs[me], op=_op(op), name=what)
                assert_reduced(got, inputs, op, what=what)
                mine = inputs[me].copy()
                returned = comm.allreduce_(mine, op=_op(op))
                assert returned is mine or np.shares_memory(returned, mine)
                assert_reduced(mine, inputs, op, what="in-place " + what)
                scaled = comm.allreduce(inputs[me], op=_op(op), prescale_factor=0.5,
                                        postscale_factor=3.0)
                assert_reduced(scaled, inputs, op, 0.5, 3.0, what="scaled " + what)


def allreduce_large_and_strided(comm):
    """Buffers large enough to be split into many segments and partial socket reads,
    and inputs that are non-contiguous views or plain buffers."""
    me, size = comm.rank(), comm.size()
    for dtype in ["float32", "float64", "int64", "float16"]:
        for n in [1 << 20, (1 << 20) + 7]:
            inputs = _inputs(comm, (n,), dtype, "Sum", "large")
            got = comm.allreduce(inputs[me], op=rs.Sum)
            assert_reduced(got, inputs, "Sum", what=f"large allreduce {dtype} n={n}")
    base = _inputs(comm, (40, 6), "float64", "Sum", "strided")
    got = comm.allreduce(base[me][::2, 1::2], op=rs.Average)  # a strided view
    assert_reduced(got, [b[::2, 1::2].copy() for b in base], "Average", what="strided input")
    scalar = comm.allreduce(np.float64(me), op=rs.Sum)  # 0-d in, 0-d out
    assert scalar.shape == () and scalar == sum(range(size)), scalar
    buf = bytearray(rank_input(me, (17,), "uint8").tobytes())
    comm.allreduce_(buf, op=rs.Max)  # an in-place buffer-protocol object
    assert_reduced(np.frombuffer(bytes(buf), np.uint8), _inputs(comm, (17,), "uint8"), "Max",
                   what="bytearray")


def grouped_and_async_all(comm):
    """Grouped allreduces (out of place and in place, blocking and not) and the _async
    form of every collective, several in flight at once, finished out of order."""
    me, size = comm.rank(), comm.size()
    for dtype in REDUCIBLE:
        for op in OPS:
            group = [_inputs(comm, (n,), dtype, op, f"grp{n}") for n in (0, 1, 7, 1009)]
            what = f"grouped {dtype} {op} on {size} ranks"
            for got, inputs in zip(comm.grouped_allreduce([g[me] for g in group], op=_op(op),
                                                          name=what), group):
                assert_reduced(got, inputs, op, what=what)
            mine = [g[me].copy() for g in group]
            comm.grouped_allreduce_(mine, op=_op(op), prescale_factor=2.0, postscale_factor=0.5)
            for got, inputs in zip(mine, group):
                assert_reduced(got, inputs, op, 2.0, 0.5, what="in-place scaled " + what)
            handle = comm.grouped_allreduce_async([g[me] for g in group], op=_op(op))
            for got, inputs in zip(comm.synchronize(handle), group):
                assert_reduced(got, inputs, op, what="async " + what)
    _async_collectives(comm, me, size)


def _async_collectives(comm, me, size):
    reduced = _inputs(comm, (101, 2), "float32", "Sum", "async-ar")
    in_place = reduced[me].copy()
    rows = [_input(r, (r + 1, 3), "int32", "Sum", "async-ag") for r in range(size)]
    sent = _inputs(comm, (size * 3, 2), "float64", "Sum", "async-a2a")
    handles = {
        "allreduce": comm.allreduce_async(reduced[me], op=rs.Sum, name="async.ar"),
        "allreduce_": comm.allreduce_async_(in_place, op=rs.Sum, name="async.ar_"),
        "allgather": comm.allgather_async(rows[me], name="async.ag"),
        "broadcast": comm.broadcast_async(reduced[me], size - 1, name="async.bc"),
        "reducescatter": comm.reducescatter_async(reduced[me], op=rs.Max, name="async.rs"),
        "alltoall": comm.alltoall_async(sent[me], name="async.a2a"),
    }
    done = {what: comm.synchronize(handles[what]) for what in reversed(list(handles))}
    assert_reduced(done["allreduce"], reduced, "Sum", what="allreduce_async")
    assert_reduced(in_place, reduced, "Sum", what="allreduce_async_")
    assert np.array_equal(done["allgather"], np.concatenate(rows)), "allgather_async"
    assert np.array_equal(done["broadcast"], reduced[size - 1]), "broadcast_async"
    assert_reduced(done["reducescatter"], [x[_slice_of(101, size, me)] for x in reduced], "Max",
                   what="reducescatter_async")
    expected = np.concatenate([x[3 * me:3 * me + 3] for x in sent])
    assert np.array_equal(done["alltoall"], expected), "alltoall_async"
    assert all(comm.poll(h) for h in handles.values())


def allgather_all(comm):
    me, size = comm.rank(), comm.size()
    for dtype in MOVABLE:
        for trailing in [(), (3,), (2, 2)]:
            for base in [0, 1, 2, 5]:
                rows = [(r * 3 + base) % 5 for r in range(size)]  # differ by rank, some 0
                inputs = [_input(r, (rows[r],) + trailing, dtype, "Sum", "ag")
                          for r in range(size)]
                got = comm.allgather(inputs[me])
                expected = np.concatenate(inputs, axis=0)
                assert got.dtype == expected.dtype and got.shape == expected.shape, \
                    (dtype, trailing, rows, got.shape, expected.shape)
                assert np.array_equal(got.view(np.uint8), expected.view(np.uint8)), \
                    f"allgather {dtype} rows {rows} trailing {trailing}"
    big = [_input(r, (100_000 + r,), "float64", "Sum", "agbig") for r in range(size)]
    assert np.array_equal(comm.allgather(big[me]), np.concatenate(big))
    scalar = comm.allgather(np.float32(me * 1.5))  # 0-d becomes one row per rank
    assert np.array_equal(scalar, np.arange(size, dtype=np.float32) * 1.5)


def _tensor_specs(count, seed=7):
    """The same list of (name, shape, dtype) on every rank: mixed sizes and dtypes."""
    rng = random.Random(seed)
    specs = []
    for i in range(count):
        n = rng.choice([0, 1, 3, 17, 256, 1000, 4099, 70_000])
        specs.append((f"t{i:02d}", (n,) if i % 3 else (n, 2), rng.choice(REDUCIBLE)))
    return specs


def out_of_order_submission(comm):
    """50 tensors submitted asynchronously in a different order on every rank (and waited
    for in yet another) give the same results as one synchronous call each, in order: the
    ranks' negotiation agrees on one order. Later steps negotiate through the cache."""
    me, specs = comm.rank(), _tensor_specs(50)
    for step in range(3):
        order = list(range(len(specs)))
        random.Random(me * 100 + step).shuffle(order)
        handles = {i: comm.allreduce_async(_inputs(comm, *specs[i][1:], "Sum",
                                                   str(step) + specs[i][0])[me],
                                           op=rs.Sum, name=specs[i][0]) for i in order}
        for i in random.Random(me + 17).sample(order, len(order)):
            assert_reduced(comm.synchronize(handles[i]),
                           _inputs(comm, *specs[i][1:], "Sum", str(step) + specs[i][0]),
                           "Sum", what=f"step {step} async {specs[i]}")
    for name, shape, dtype in specs:  # the same tensors, one synchronous call each
        inputs = _inputs(comm, shape, dtype, "Sum", "sync" + name)
        assert_reduced(comm.allreduce(inputs[me], op=rs.Sum, name=name), inputs, "Sum",
                       what=f"sync {name}")


def broadcast_all(comm):
    me = comm.rank()
    for dtype in MOVABLE:
        for n in SIZES + [300_001]:
            for root in range(comm.size()):
                inputs = _inputs(comm, (n,), dtype, salt=f"bc{root}")
                got = comm.broadcast(inputs[me], root_rank=root)
                assert np.array_equal(got.view(np.uint8), inputs[root].view(np.uint8)), \
                    f"broadcast {dtype} n={n} root={root}"
                mine = inputs[me].copy()
                comm.broadcast_(mine, root)
                assert np.array_equal(mine.view(np.uint8), inputs[root].view(np.uint8)), \
                    f"broadcast_ {dtype} n={n} root={root}"


def reducescatter_all(comm):
    me, size = comm.rank(), comm.size()
    for dtype in REDUCIBLE:
        for op in OPS:
            for rows in [0, 1, 2, 7, 13, 2 * size + 1]:
                for trailing in [(), (3,)]:
                    inputs = _inputs(comm, (rows,) + trailing, dtype, op, "rs")
                    what = f"reducescatter {dtype} {op} rows={rows} trailing={trailing}"
                    got = comm.reducescatter(inputs[me], op=_op(op))
                    mine = [x[_slice_of(rows, size, me)] for x in inputs]
                    assert_reduced(got, mine, op, what=what)
                    _check_in_place_reducescatter(comm, inputs[me], mine, op, what)
    rows = size * 2 + 1
    inputs = _inputs(comm, (rows, 2), "float64", "Sum", "rs-scaled")
    got = comm.reducescatter(inputs[me], op=rs.Sum, prescale_factor=2.0, postscale_factor=0.25)
    assert_reduced(got, [x[_slice_of(rows, size, me)] for x in inputs], "Sum", 2.0, 0.25,
                   what="scaled reducescatter")


def _check_in_place_reducescatter(comm, x, mine, op, what):
    """reducescatter_ works in x itself: the share is x's first rows, and equals the
    out-of-place result."""
    work = x.copy()
    got = comm.reducescatter_(work, op=_op(op))
    assert got.shape[0] == mine[0].shape[0] and \
        (got.size == 0 or got.ctypes.data == work.ctypes.data), f"{what}: not x's first rows"
    assert_reduced(got, mine, op, what=f"in place {what}")


def _splits(sender, size, salt):
    return [(sender * 7 + dest * 3 + salt) % 4 for dest in range(size)]  # zeros included


def alltoall_all(comm):
    size, me = comm.size(), comm.rank()
    for dtype in MOVABLE:
        for trailing in [(), (2, 3)]:
            for salt in range(3):
                splits = [_splits(r, size, salt) for r in range(size)]
                inputs = [_input(r, (sum(splits[r]),) + trailing, dtype, "Sum", f"a2a{salt}")
                          for r in range(size)]
                got, received = comm.alltoall(inputs[me], splits=splits[me])
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
    got = comm.alltoall(even[me])  # no splits: an even split, and the output alone
    assert np.array_equal(got, np.concatenate([e[2 * me:2 * me + 2] for e in even]))


def barrier_orders_ranks(comm):
    """No rank leaves the barrier before every rank has entered it: ranks enter at
    different times, then compare when each entered and left (CLOCK_MONOTONIC is one
    clock for every process and thread of a host)."""
    me, size = comm.rank(), comm.size()
    for round_ in range(5):
        time.sleep(0.05 * ((me + round_) % size))  # enter at different times
        entered = time.monotonic()
        comm.barrier()
        left = time.monotonic()
        times = comm.allgather(np.array([[entered, left]]))
        last_in = int(np.argmax(times[:, 0]))
        assert left >= times[last_in, 0], \
            f"round {round_}: left the barrier before rank {last_in} entered"


def bad_input_then_next_call_works(comm):
    """Every bad call raises a clear UsageError on the calling rank and leaves the ring usable."""
    me, size = comm.rank(), comm.size()
    ok = np.arange(4.0) + me

    def expect(fragment, fn, *args, **kwargs):
        try:
            fn(*args, **kwargs)
        except rs.UsageError as e:
            assert fragment in str(e), f"expected {fragment!r} in {e}"
        else:
            raise AssertionError(f"no UsageError for {fragment!r}")
        got = comm.allreduce(ok, op=rs.Sum)  # the next collective still works
        assert np.array_equal(got, np.arange(4.0) * size + sum(range(size)))

    expect("object", comm.allreduce, np.array([1, "a"], dtype=object))
    expect("complex128", comm.allreduce, np.ones(3, dtype=np.complex128))
    expect("bool", comm.allreduce, np.ones(3, dtype=bool))
    expect("read-only", comm.allreduce_, np.frombuffer(b"12345678", dtype=np.uint8))
    expect("not C-contiguous", comm.allreduce_, np.zeros((4, 4))[:, 1])
    expect("out of range", comm.broadcast, ok, root_rank=size)
    expect("out of range", comm.broadcast_, ok.copy(), root_rank=-1)
    expect("unknown reduction op", comm.allreduce, ok, op=42)
    expect("splits", comm.alltoall, np.zeros(3), splits=[1] * (size + 1))
    if size > 1:
        expect("not divisible", comm.alltoall, np.zeros(size * 2 + 1))
        # A mismatch across ranks: every rank raises, naming the ranks and both values.
        trailing = (3,) if me == size - 1 else (2,)
        expect(f"Mismatched allgather tensor shapes for 'grad.w': rank 0 sent [2, 2], rank "
               f"{size - 1} sent [2, 3] (only the first dimension may differ)",
               comm.allgather, np.zeros((2,) + trailing), name="grad.w")


def routable_address_allreduce(comm):
    inputs = _inputs(comm, (1001,), "float64", "Sum", "routable")
    assert_reduced(comm.allreduce(inputs[comm.rank()], op=rs.Sum), inputs, "Sum",
                   what=f"allreduce over {comm.config.iface}")


# Every check a matrix runs, by name.
CHECKS = {f.__name__: f for f in (
    allreduce_all, allreduce_large_and_strided, grouped_and_async_all, allgather_all,
    broadcast_all, reducescatter_all, alltoall_all, barrier_orders_ranks,
    bad_input_then_next_call_works, out_of_order_submission)}
