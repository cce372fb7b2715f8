"""The native entry of an engine's hot calls (native/python/fastcall.c, ring.entry).

A blocking allreduce of an exact numpy array on the same-host lane goes from
Communicator.allreduce_ / allreduce straight to C once the ordinary path has checked and
remembered a request like it; so does a batch of asynchronous in-place allreduces
(grouped_allreduce_async_: one native submission), and every handle is waited for and
released there. These tests check that the entry is taken (its `taken` counter), that what
it computes is what the ordinary path computes (references from every rank's input), and
that whatever it cannot take, or takes and fails, ends as the ordinary path ends: the same
exceptions, the ranks still matched, the next call working.
"""
import threading

import numpy as np
import pytest

import ringsync as rs
from ringsync.errors import MismatchError, UsageError

from tests.common.reference import assert_reduced, rank_input
from tests.thread_ranks import assert_ranks_ok

TIMEOUT = 120
ENV = {"RINGSYNC_TIMEOUT_SECONDS": "60", "RINGSYNC_TRANSPORT": "shm"}
SHAPES = [(), (1,), (7,), (3, 5), (1024,)]
CASES = [("float32", "Sum", 1.0, 1.0), ("float64", "Average", 0.5, 3.0),
         ("int32", "Max", 1.0, 1.0), ("int64", "Min", 1.0, 1.0), ("float16", "Sum", 1.0, 2.0),
         ("uint8", "Product", 1.0, 1.0), ("float32", "Average", 2, 1)]


def _taken(comm) -> int:
    return comm._ring.entry.taken


def _matrix(comm):
    """Each case three times with new data (the first call remembers the request, the
    others take the native entry), in place and into a new array."""
    me, size = comm.rank(), comm.size()
    before = _taken(comm)
    calls = 0
    for dtype, op, pre, post in CASES:
        for shape in SHAPES:
            for round_ in range(3):
                salt = f"{shape}/{pre}/{post}/{round_}"
                inputs = [rank_input(r, shape, dtype, op, salt) for r in range(size)]
                what = f"{dtype} {op} {shape} pre {pre} post {post} round {round_}"
                mine = inputs[me].copy()
                got = comm.allreduce_(mine, op=getattr(rs, op), prescale_factor=pre,
                                      postscale_factor=post, name=f"fast.{dtype}.{op}.{shape}")
                assert got is mine, what
                assert_reduced(got, inputs, op, pre, post, "in place: " + what)
                new = comm.allreduce(inputs[me], op=getattr(rs, op), prescale_factor=pre,
                                     postscale_factor=post)  # (generated names)
                assert new is not inputs[me]
                assert_reduced(new, inputs, op, pre, post, "new array: " + what)
                np.testing.assert_array_equal(inputs[me], rank_input(me, shape, dtype, op, salt))
                calls += 2
    taken = _taken(comm) - before
    # Every call after a case's first one in each form takes the entry.
    assert taken >= calls - 2 * len(CASES) * len(SHAPES), (taken, calls)
    return taken


@pytest.mark.parametrize("size", [2, 3])
def test_the_native_entry_reduces_as_the_reference(size):
    assert_ranks_ok(_matrix, size, timeout=TIMEOUT, env=ENV)


def _not_taken(comm):
    """Calls the entry leaves to the ordinary path, which still gets them right."""
    me, size = comm.rank(), comm.size()
    base = np.arange(12, dtype=np.float32) * (me + 1)
    expected = np.arange(12, dtype=np.float32) * sum(range(1, size + 1))
    for _ in range(2):  # (a first call remembers: the second would be taken if it could)
        before = _taken(comm)
        strided = np.array(base.reshape(3, 4).T)  # F-ordered copy: not C-contiguous
        assert not strided.flags.c_contiguous
        np.testing.assert_array_equal(comm.allreduce(strided, op=rs.Sum),
                                      expected.reshape(3, 4).T)
        sub = base.view(np.ndarray).view(type("Sub", (np.ndarray,), {}))
        np.testing.assert_array_equal(comm.allreduce(sub, op=rs.Sum), expected)
        np.testing.assert_array_equal(comm.allreduce(list(base), op=rs.Sum), expected)
        x = base.copy()
        comm.allreduce_(x, op=rs.Sum, prescale_factor=np.float32(1.0), name=7)  # (not str)
        np.testing.assert_array_equal(x, expected)
        assert _taken(comm) == before


def test_calls_it_cannot_take_go_the_ordinary_way():
    assert_ranks_ok(_not_taken, 2, timeout=TIMEOUT, env=ENV)


def _refusals_match(comm):
    """A bad call the ordinary path refuses (read-only output, a NUL in the name) after
    the entry has taken calls like it: the same error as ever, on the rank that made it,
    and the peers' matching call fails naming it; the next call works everywhere."""
    me, size = comm.rank(), comm.size()
    x = np.full(4, me + 1.0, np.float32)
    for _ in range(2):
        comm.allreduce_(x.copy(), op=rs.Sum, name="warm")
    assert _taken(comm) >= 1
    for bad in ("readonly", "nul"):
        y = np.full(4, me + 1.0, np.float32)
        name = "bad.call"
        if me == 1 and bad == "readonly":
            y.setflags(write=False)
        if me == 1 and bad == "nul":
            name = "bad\0call"
        with pytest.raises(UsageError if me == 1 else MismatchError) as info:
            comm.allreduce_(y, op=rs.Sum, name=name)
        if me != 1:
            assert "rank 1" in str(info.value), str(info.value)
        z = np.full(4, me + 1.0, np.float32)
        before = _taken(comm)
        comm.allreduce_(z, op=rs.Sum, name="after")
        np.testing.assert_array_equal(z, np.full(4, sum(range(1, size + 1)), np.float32))
        assert _taken(comm) == before + 1


def test_a_refused_call_fails_on_every_rank_and_the_next_is_taken():
    assert_ranks_ok(_refusals_match, 2, timeout=TIMEOUT, env=ENV)


def _mismatch(comm):
    """Ranks disagree on a call that each rank's entry takes (shapes, then ops): every rank
    gets a MismatchError naming both values, and the next call works."""
    me, size = comm.rank(), comm.size()
    for _ in range(2):  # (remember both shapes and both ops on every rank)
        for n in (4, 5):
            for op in (rs.Sum, rs.Max):
                comm.allreduce_(np.ones(n, np.float32), op=op, name=f"warm.{n}")
    before = _taken(comm)
    with pytest.raises(MismatchError) as info:
        comm.allreduce_(np.ones(4 + me, np.float32), op=rs.Sum, name="shapes")
    assert "[4]" in str(info.value) and "[5]" in str(info.value), str(info.value)
    with pytest.raises(MismatchError) as info:
        comm.allreduce_(np.ones(4, np.float32), op=rs.Sum if me == 0 else rs.Max, name="ops")
    assert "sum" in str(info.value).lower() and "max" in str(info.value).lower()
    assert _taken(comm) == before + 2  # (both failed calls were the entry's)
    x = np.full(3, me + 2.0)
    comm.allreduce_(x, op=rs.Sum, name="after")
    np.testing.assert_array_equal(x, np.full(3, sum(r + 2.0 for r in range(size))))


def test_a_mismatch_through_the_entry_fails_every_rank_and_the_next_call_works():
    assert_ranks_ok(_mismatch, 2, timeout=TIMEOUT, env=ENV)


def _handed_to_engine(comm):
    """The lane posts only headers for tensors above RINGSYNC_LANE_BYTES: every rank finds
    that the engine must run the call, and the entry's call goes there (once)."""
    me, size = comm.rank(), comm.size()
    for round_ in range(3):
        inputs = [rank_input(r, (40,), "float64", "Sum", round_) for r in range(size)]
        mine = inputs[me].copy()
        before = _taken(comm)
        comm.allreduce_(mine, op=rs.Sum, name="big")
        assert_reduced(mine, inputs, "Sum", what=f"round {round_}")
        if round_:
            assert _taken(comm) == before + 1


def test_a_call_the_engine_must_run_goes_there_once():
    assert_ranks_ok(_handed_to_engine, 2, timeout=TIMEOUT,
                    env={**ENV, "RINGSYNC_LANE_BYTES": "64"})


def _threads(comm):
    """Two threads of each rank on two communicators (process sets of the same ranks)
    take the entry at once; each sees only its own results."""
    me, size = comm.rank(), comm.size()
    second = rs.Communicator(rendezvous=comm.rendezvous.split(list(range(size))),
                             config=comm.config)
    rings, errors = [comm, second], []

    def work(ring, salt):
        try:
            for i in range(200):
                inputs = [rank_input(r, (5,), "int64", "Sum", f"{salt}/{i}") for r in range(size)]
                mine = inputs[me].copy()
                ring.allreduce_(mine, op=rs.Sum, name=f"t.{salt}")
                assert_reduced(mine, inputs, "Sum", what=f"{salt} {i}")
        except BaseException as exc:  # pragma: no cover (reported below)
            errors.append(exc)
    threads = [threading.Thread(target=work, args=(ring, k)) for k, ring in enumerate(rings)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    second.shutdown()
    if errors:
        raise errors[0]
    assert all(ring is second or _taken(ring) >= 199 for ring in rings)


def test_two_threads_on_two_communicators_take_the_entry_at_once():
    assert_ranks_ok(_threads, 2, timeout=TIMEOUT, env=ENV)


def _closed(comm):
    """After shutdown the entry is gone: a call raises as the ordinary path does."""
    x = np.ones(2, np.float32)
    comm.allreduce_(x, op=rs.Sum, name="x")
    comm.allreduce_(x, op=rs.Sum, name="x")
    lane = comm._ring.entry
    comm.shutdown()
    assert comm._ring.entry is None
    assert lane.run(x, x, rs.Sum, 1.0, 1.0, "x") is None
    with pytest.raises(UsageError):
        comm.allreduce_(x, op=rs.Sum, name="x")


def test_after_shutdown_the_entry_takes_nothing():
    assert_ranks_ok(_closed, 2, timeout=TIMEOUT, env=ENV)


# ---------------------------------------------------------------- batches (async, grouped)

BATCH_SHAPES = [(1,), (0,), (7,), (3, 5), (1024,), ()]


def _batches(comm):
    """Batches of every dtype case, three rounds each with new data: the first goes the
    ordinary way and remembers the requests, the others take the entry (all n tensors in
    one submission); two batches in flight at once complete independently."""
    me, size = comm.rank(), comm.size()
    before, expected_taken = _taken(comm), 0
    for dtype, op, pre, post in CASES:
        for round_ in range(3):
            salt = f"batch/{pre}/{post}/{round_}"
            inputs = [[rank_input(r, shape, dtype, op, f"{salt}/{i}")
                       for i, shape in enumerate(BATCH_SHAPES)] for r in range(size)]
            mine = [x.copy() for x in inputs[me]]
            plus = [[np.array(x + 1, dtype=x.dtype) for x in inputs[r]] for r in range(size)]
            other = [x.copy() for x in plus[me]]
            first = comm.grouped_allreduce_async_(mine, op=getattr(rs, op), prescale_factor=pre,
                                                  postscale_factor=post, name=f"b.{dtype}.{op}")
            second = comm.grouped_allreduce_async_(other, op=getattr(rs, op),
                                                   name=f"b2.{dtype}.{op}")
            got = comm.synchronize(first)
            assert all(g is m for g, m in zip(got, mine))
            for i, g in enumerate(got):
                assert_reduced(g, [inputs[r][i] for r in range(size)], op, pre, post,
                               f"{dtype} {op} round {round_} tensor {i}")
            for i, g in enumerate(comm.synchronize(second)):
                assert_reduced(g, [plus[r][i] for r in range(size)], op,
                               what=f"second batch {dtype} {op} round {round_} tensor {i}")
            if round_:
                expected_taken += 2 * len(BATCH_SHAPES)
    # (at least: a second batch like the first in round 0 is taken at once)
    assert expected_taken <= _taken(comm) - before <= 3 * expected_taken // 2, \
        (_taken(comm) - before, expected_taken)


@pytest.mark.parametrize("size", [2, 3])
def test_a_batch_goes_in_one_submission_and_reduces_as_the_reference(size):
    assert_ranks_ok(_batches, size, timeout=TIMEOUT, env=ENV)


def _batch_mismatch(comm):
    """Rank 1's tensor 2 of a batch has another shape: every rank's synchronize raises a
    MismatchError naming that tensor and both shapes; the other tensors still complete,
    and the next batch works."""
    me, size = comm.rank(), comm.size()
    shapes = [(4,), (5,), (6,), (7,)]
    for _ in range(2):  # (remember every shape on every rank)
        for extra in (0, 1):
            comm.synchronize(comm.grouped_allreduce_async_(
                [np.ones((n[0] + extra,), np.float32) for n in shapes], op=rs.Sum, name="w"))
    before = _taken(comm)
    bad = [np.ones(s, np.float32) for s in shapes]
    if me == 1:
        bad[2] = np.ones(7, np.float32)
    handle = comm.grouped_allreduce_async_(bad, op=rs.Sum, name="m")
    assert _taken(comm) == before + len(shapes)
    with pytest.raises(MismatchError) as info:
        comm.synchronize(handle)
    assert "m.2" in str(info.value) and "[6]" in str(info.value) and "[7]" in str(info.value)
    xs = [np.full(s, me + 1.0, np.float32) for s in shapes]
    comm.synchronize(comm.grouped_allreduce_async_(xs, op=rs.Sum, name="w"))
    for x in xs:
        np.testing.assert_array_equal(x, np.full(x.shape, sum(range(1, size + 1)), np.float32))


def test_a_mismatch_in_a_batch_fails_every_rank_naming_the_tensor():
    assert_ranks_ok(_batch_mismatch, 2, timeout=TIMEOUT, env=ENV)


def _batch_in_flight_and_dropped(comm):
    """A batch's names are in flight until synchronized: submitting it again first is a
    UsageError (from the ordinary path, which names the tensor) and changes nothing; a
    batch whose handle is dropped keeps its arrays until the engine is done with them."""
    me, size = comm.rank(), comm.size()
    xs = [np.full(3, me + 1.0) for _ in range(4)]
    for _ in range(2):
        comm.synchronize(comm.grouped_allreduce_async_([x.copy() for x in xs], op=rs.Sum,
                                                       name="f"))
    handle = comm.grouped_allreduce_async_(xs, op=rs.Sum, name="f")
    with pytest.raises(UsageError, match="f.0' is already in flight"):
        comm.grouped_allreduce_async_([x.copy() for x in xs], op=rs.Sum, name="f")
    comm.synchronize(handle)
    total = sum(range(1, size + 1))
    for x in xs:
        np.testing.assert_array_equal(x, np.full(3, float(total)))
    dropped = [np.full(1000, me + 1.0) for _ in range(8)]
    comm.grouped_allreduce_async_(dropped, op=rs.Sum, name="d")
    comm.grouped_allreduce_async_(dropped, op=rs.Sum, name="d2")  # (drops the first handle)
    del dropped
    import gc
    gc.collect()
    ys = [np.full(2, me + 1.0) for _ in range(3)]
    comm.synchronize(comm.grouped_allreduce_async_(ys, op=rs.Sum, name="after"))
    for y in ys:
        np.testing.assert_array_equal(y, np.full(2, float(total)))


def test_a_batch_in_flight_and_a_dropped_batch():
    assert_ranks_ok(_batch_in_flight_and_dropped, 2, timeout=TIMEOUT, env=ENV)


def _unnamed_forms_match(comm):
    """Unnamed calls are named in call order alike whichever form a rank uses (in place,
    into a new array, asynchronous), so ranks that mix the forms (adapters of different
    frameworks on one ring) still meet."""
    me, size = comm.rank(), comm.size()
    total = float(sum(range(1, size + 1)))
    for round_ in range(3):  # (the first remembers; the others take the entry)
        x = np.full(3, me + 1.0)
        if me == 0:
            comm.allreduce_(x, op=rs.Sum)
        else:
            x = comm.allreduce(x, op=rs.Sum)
        np.testing.assert_array_equal(x, np.full(3, total), f"round {round_}")
        y = np.full(2, me + 1.0)
        if me == 0:
            comm.synchronize(comm.allreduce_async_(y, op=rs.Sum))
        else:
            y = comm.synchronize(comm.allreduce_async(y, op=rs.Sum))
        np.testing.assert_array_equal(y, np.full(2, total), f"round {round_}")


def test_unnamed_calls_match_across_their_forms():
    assert_ranks_ok(_unnamed_forms_match, 2, timeout=TIMEOUT, env=ENV)
