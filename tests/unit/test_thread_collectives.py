"""The collective correctness matrix — every collective x dtype x op x size, on 1 to 4
ranks, over each transport and same-host path — with ranks as threads of this process
(tests/thread_ranks.py), checked against numpy references built from all ranks' inputs.
Also the thread rendezvous itself, and setups that differ by rank (host names, bad
interfaces) which need no processes either. tests/mpi/test_collectives.py keeps what
needs them: the MPI rendezvous and the module-level API."""
import functools
import threading
import time

import numpy as np
import pytest

import ringsync as rs
from ringsync import bootstrap
from ringsync.rendezvous import Rendezvous, ThreadGroup

from tests.common import collective_checks
from tests.common.reference import REDUCIBLE, dtype_of, reduce_exact, scale
from tests.thread_ranks import (PATHS, assert_ok, assert_ranks_ok, rank_config, run_ranks,
                                run_threads)

TIMEOUT = 120  # seconds for one whole run; a hang fails the test with every rank's stack
BASE_ENV = {"RINGSYNC_TIMEOUT_SECONDS": "60"}

ALLREDUCES = ["allreduce_all", "allreduce_large_and_strided", "grouped_and_async_all"]
# Staging changes allreduces only; one rank has no peers to reach.
CASES = ([(check, 1, "shm") for check in collective_checks.CHECKS] +
         [(check, size, path) for check in collective_checks.CHECKS for size in (2, 3, 4)
          for path in ("shm", "tcp", "shm-ring")] +
         [(check, size, "staged") for check in ALLREDUCES for size in (2, 3, 4)] +
         # Past 4 ranks the negotiation and small allgathers take log2(N) rounds (Bruck)
         # whose partners are not ring neighbours: 5 and 7 (no power of two).
         [(check, size, path) for check in ("allgather_all", "out_of_order_submission")
          for size in (5, 7) for path in ("tcp", "shm-ring")] +
         # Past 4 ranks small allreduces take recursive doubling (with a fold for 6), small
         # broadcasts a binomial tree, and on 8 the gathers and the barrier swap with
         # rank ^ 2^k: every root, and connections made on first use.
         [(check, size, "tcp") for check in ("allreduce_all", "broadcast_all",
                                             "barrier_orders_ranks", "alltoall_all")
          for size in (6, 8)])


@pytest.mark.parametrize("check,size,path", CASES)
def test_collective(check, size, path):
    assert_ranks_ok(collective_checks.CHECKS[check], size, timeout=TIMEOUT,
                    env={**BASE_ENV, **PATHS[path]})


def _two_hosts(size):
    """The first half of the ranks report host 'node-a', the rest 'node-b'."""
    half = (size + 1) // 2
    return lambda rank: {"RINGSYNC_HOST_NAME": "node-a" if rank < half else "node-b"}


def _mixed_transports(comm):
    size, half = comm.size(), (comm.size() + 1) // 2
    local = half if comm.rank() < half else size - half
    assert comm.local_size() == local
    assert comm.cross_size() == (2 if comm.local_rank() < size - half else 1)
    assert comm.transport == ("shm" if local > 1 else "tcp"), comm.transport
    for name in ("allreduce_all", "allgather_all", "broadcast_all", "reducescatter_all",
                 "alltoall_all"):
        collective_checks.CHECKS[name](comm)


@pytest.mark.parametrize("size", [2, 3, 4])
def test_mixed_transports_give_the_same_results(size):
    """Same-"host" ranks use shared memory, the two halves TCP: the same results."""
    assert_ranks_ok(_mixed_transports, size, timeout=TIMEOUT,
                    env={**BASE_ENV, "RINGSYNC_TRANSPORT": "auto"}, rank_env=_two_hosts(size))


def _expect_init_error(env, rank_env, error, fragments):
    """Every rank's Communicator() raises `error` with every fragment in its message."""
    def rank_main(rendezvous):
        config = rank_config(env, rank_env, rendezvous.rank)
        with pytest.raises(error) as caught:
            rs.Communicator(rendezvous=rendezvous, config=config).shutdown()
        for fragment in fragments:
            assert fragment in str(caught.value), (fragment, str(caught.value))
    return rank_main


def test_forced_shared_memory_across_hosts_is_a_usage_error():
    assert_ok(run_threads(_expect_init_error(
        {"RINGSYNC_TRANSPORT": "shm"}, _two_hosts(2), rs.RingsyncError,
        ["RINGSYNC_TRANSPORT=shm, but rank"]), 2, TIMEOUT), "forced shm", TIMEOUT)


@pytest.mark.parametrize("size", [1, 3])
def test_bad_interface_fails_on_every_rank(size):
    assert_ok(run_threads(_expect_init_error(
        {"RINGSYNC_IFACE": "no-such-nic0"}, None, rs.UsageError,
        ["RINGSYNC_IFACE='no-such-nic0'"]), size, TIMEOUT), "bad interface", TIMEOUT)


def test_bad_interface_on_one_rank_fails_every_rank_naming_it():
    assert_ok(run_threads(_expect_init_error(
        {}, lambda rank: {"RINGSYNC_IFACE": "no-such-nic0"} if rank == 1 else {},
        rs.UsageError, ["rank 1: RINGSYNC_IFACE='no-such-nic0'"]), 3, TIMEOUT),
        "bad interface on rank 1", TIMEOUT)


def test_settings_that_differ_fail_every_rank_naming_them():
    assert_ok(run_threads(_expect_init_error(
        {}, lambda rank: {"RINGSYNC_FUSION_THRESHOLD": str(1000 + rank)}, rs.UsageError,
        ["RINGSYNC_FUSION_THRESHOLD is 1000 on rank 0 but 1001 on rank 1 (and 1 more ranks)"]),
        3, TIMEOUT), "settings that differ", TIMEOUT)


@pytest.mark.parametrize("size", [2, 3])
def test_allreduce_over_routable_address(size):
    """Listen on and connect to the address other hosts would use, not loopback."""
    address = bootstrap.listen_addresses(None)[1]
    assert_ranks_ok(collective_checks.routable_address_allreduce, size, timeout=TIMEOUT,
                    env={**BASE_ENV, "RINGSYNC_TRANSPORT": "tcp", "RINGSYNC_IFACE": address})


def test_rings_of_one_process_are_independent():
    """Two rings at once in one process, each of its own thread-ranks, do not meet."""
    outcomes = {}

    def ring(tag, size):
        outcomes[tag] = run_ranks(lambda comm: comm.allreduce(
            np.array([comm.rank() + tag], np.float64), op=rs.Sum, name="same.name"), size,
            env=BASE_ENV, timeout=60)

    threads = [threading.Thread(target=ring, args=(tag, n)) for tag, n in ((100, 2), (1000, 3))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    got = {tag: assert_ok(outcomes[tag], f"ring {tag}", 60) for tag in outcomes}
    assert [float(x[0]) for x in got[100]] == [201.0] * 2
    assert [float(x[0]) for x in got[1000]] == [3003.0] * 3


# ------------------------------------------------------- the staged allreduce's chunks

STAGE_CHUNK_BYTES = 256 << 10  # RS_LANE_MAX_BYTES (transport.h): the staged allreduce's chunk
# dtype: (op, prescale, postscale) for each call
STAGED_CASES = {
    "float32": [("Sum", 1.0, 1.0), ("Average", 0.5, 3.0), ("Min", 1.0, 1.0),
                ("Max", 1.0, 1.0), ("Product", 1.0, 1.0)],
    "float64": [("Sum", 1.0, 1.0), ("Product", 1.0, 1.0)],
    "float16": [("Sum", 1.0, 1.0), ("Average", 0.5, 3.0), ("Max", 1.0, 1.0)],
    "bfloat16": [("Sum", 1.0, 1.0), ("Average", 0.5, 3.0)],
    "int32": [("Sum", 1.0, 1.0), ("Average", 1.0, 1.0), ("Min", 1.0, 1.0),
              ("Product", 1.0, 1.0)],
    "uint8": [("Sum", 1.0, 1.0), ("Max", 1.0, 1.0)],
    "int64": [("Sum", 2.0, 1.0)],
}


def _chunk_counts(itemsize):
    """Element counts spanning 1, 2, 2, 3, 3 and 5 chunks, with a short or a full last
    chunk; most are divisible by none of 2, 3 and 4."""
    c = STAGE_CHUNK_BYTES // itemsize
    return [c - 3, c + 1, 2 * c, 2 * c + 5, 3 * c, 4 * c + 7]


@functools.lru_cache(maxsize=None)
def _exact_input(rank, n, dtype, op):
    """Values that differ by rank and position and whose sums and products are exact in
    any order in every dtype (integers wrap alike in any order): integers from -30 to 30,
    or for products powers of two from 1/4 to 4 with either sign (small integers for
    integer dtypes). Read-only: thread-ranks share them."""
    i = np.arange(n, dtype=np.int64)
    if op != "Product":
        values = (rank * 1000 + i * 7) % 61 - 30
    elif dtype_of(dtype).kind in "iu":
        values = (rank + i) % 7 - 3
    else:
        sign = np.where((i + rank) % 3 == 0, -1.0, 1.0)
        values = sign * 2.0 ** ((rank + i * 3) % 5 - 2)
    x = values.astype(dtype_of(dtype))
    x.flags.writeable = False
    return x


def _exact_allreduce(inputs, op, prescale, postscale):
    """The reduction in float64 (exact for _exact_input's values) or in the integer dtype,
    then the core's own rounding: Average divides integers truncating, and scales floats
    by postscale / ranks in one multiply, like the core."""
    ranks, dt = len(inputs), inputs[0].dtype
    with np.errstate(over="ignore"):
        out = reduce_exact([scale(x, prescale) for x in inputs], op).astype(dt)
    factor = postscale
    if op == "Average" and dt.kind in "iu":
        wide = out.astype(np.int64)
        out = (np.sign(wide) * (np.abs(wide) // ranks)).astype(dt)
    elif op == "Average":
        factor = postscale / ranks
    return scale(out, factor)


def _assert_same_bits(got, expected, what):
    assert got.dtype == expected.dtype and got.shape == expected.shape, what
    bits = np.dtype(f"u{got.dtype.itemsize}")
    bad = np.flatnonzero(got.view(bits) != expected.view(bits))
    if bad.size:
        i = bad[0]
        raise AssertionError(f"{what}: {bad.size} of {got.size} elements differ; first at "
                             f"{i}: got {got[i]!r}, expected {expected[i]!r}")


def _staged_chunks_exact(comm):
    """Every rank ends with the exact result at every chunk count, in place and not."""
    me, size = comm.rank(), comm.size()
    for dtype, calls in STAGED_CASES.items():
        if dtype == "bfloat16" and "bfloat16" not in REDUCIBLE:
            continue  # (needs ml_dtypes)
        for n in _chunk_counts(dtype_of(dtype).itemsize):
            for op, pre, post in calls:
                inputs = [_exact_input(r, n, dtype, op) for r in range(size)]
                what = f"staged {dtype} {op} x{pre} x{post} n={n} on {size} ranks"
                expected = _exact_allreduce(inputs, op, pre, post)
                got = comm.allreduce(inputs[me], op=getattr(rs, op), name=what,
                                     prescale_factor=pre, postscale_factor=post)
                _assert_same_bits(got, expected, what)
            mine = inputs[me].copy()
            comm.allreduce_(mine, op=getattr(rs, op), prescale_factor=pre,
                            postscale_factor=post)
            _assert_same_bits(mine, expected, "in-place " + what)


@pytest.mark.parametrize("size", [2, 3, 4])
@pytest.mark.parametrize("path", ["shm", "staged"])
def test_staged_allreduce_is_exact_at_every_chunk_count(path, size):
    """On the lane ("shm": blocking allreduces above the one-round size) and in the
    engine's executor ("staged"), large allreduces go through the staged allreduce, which
    stages chunk k+1 while chunk k finishes."""
    assert_ranks_ok(_staged_chunks_exact, size, timeout=TIMEOUT, env={**BASE_ENV, **PATHS[path]})


def _staged_with_a_joined_rank(comm):
    """Rank 0 runs out of data after 2 steps, the others after 4: its zeros stand in for
    it in staged allreduces of 2, 3 and 5 chunks. After the join every rank is back."""
    me, size = comm.rank(), comm.size()
    c = STAGE_CHUNK_BYTES // 4
    for step in range(2 if me == 0 else 4):
        active = [r for r in range(size) if step < (2 if r == 0 else 4)]
        for n in (c + 1, 2 * c + 5, 4 * c + 7):
            inputs = [_exact_input(r, n, "float32", "Sum") for r in range(size)]
            present = [x if r in active else np.zeros_like(x) for r, x in enumerate(inputs)]
            for op, pre, post in (("Sum", 1.0, 1.0), ("Average", 0.5, 3.0)):
                what = f"join.{step}.{n}.{op}"
                got = comm.allreduce(inputs[me], op=getattr(rs, op), name=what,
                                     prescale_factor=pre, postscale_factor=post)
                _assert_same_bits(got, _exact_allreduce(present, op, pre, post), what)
    assert comm.join() in range(size)
    inputs = [_exact_input(r, 2 * c + 5, "float32", "Sum") for r in range(size)]
    _assert_same_bits(comm.allreduce(inputs[me], op=rs.Sum, name="after.join"),
                      _exact_allreduce(inputs, "Sum", 1.0, 1.0), "after the join")


@pytest.mark.parametrize("size", [2, 3, 4])
@pytest.mark.parametrize("path", ["shm", "staged"])
def test_staged_allreduce_with_a_joined_rank(path, size):
    assert_ranks_ok(_staged_with_a_joined_rank, size, timeout=TIMEOUT,
                    env={**BASE_ENV, **PATHS[path]})


# ------------------------------------------------------------------ the thread rendezvous


def test_thread_group_exchanges_in_rank_order():
    def exchange(rendezvous):
        me = rendezvous.rank
        return [rendezvous.allgather(("round", k, me)) for k in range(3)] + \
            [rendezvous.bcast(f"from {me}", root=2)]

    values = assert_ok(run_threads(exchange, 4, 30), "exchange", 30)
    for got in values:
        assert got[:3] == [[("round", k, r) for r in range(4)] for k in range(3)]
        assert got[3] == "from 2"


def test_thread_group_abort_fails_waiting_ranks():
    group = ThreadGroup(3, timeout=30)
    errors = []

    def wait_for_all(rank):
        try:
            group.rendezvous(rank).allgather(rank)
        except rs.CommunicationError as e:
            errors.append(str(e))

    threads = [threading.Thread(target=wait_for_all, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    group.abort()  # rank 2 gave up
    for t in threads:
        t.join(10)
    assert len(errors) == 2 and all("another rank gave up" in e for e in errors), errors


def test_thread_group_deadline():
    group = ThreadGroup(2, timeout=0.2)
    with pytest.raises(rs.CommunicationError, match="within 0.2 s"):
        group.rendezvous(0).allgather("alone")
    with pytest.raises(rs.CommunicationError):  # the group stays broken for the late rank
        group.rendezvous(1).allgather("late")


def test_a_failing_rank_does_not_hang_the_others():
    """Rank 1 raises before its allreduce: it aborts, and its peers fail promptly."""
    def body(comm):
        if comm.rank() == 1:
            raise RuntimeError("rank 1 fails on purpose")
        comm.allreduce(np.ones(4), name="never.matched")

    outcomes = run_ranks(body, 3, env=BASE_ENV, timeout=60)
    assert "fails on purpose" in outcomes[1].error
    for rank in (0, 2):
        assert outcomes[rank].stack is None, outcomes[rank].stack
        assert "CommunicationError" in outcomes[rank].error, outcomes[rank].error


def _names_differ(comm):
    # Asynchronous calls are matched by name (blocking ones in call order, which would fail
    # at once): each waits for peers that never submit its name.
    comm.synchronize(comm.allreduce_async(np.ones(4), name=f"only.rank{comm.rank()}"))


def test_a_hang_fails_at_the_deadline_showing_where_each_rank_was():
    """Past the deadline every live rank's stack is reported, and the engines are aborted
    so that the threads unwind instead of hanging the test run."""
    outcomes = run_ranks(_names_differ, 2, env={"RINGSYNC_LANE_BYTES": "0"}, timeout=2)
    for o in outcomes:  # both were waiting, and both unwound, failing
        assert "comm.allreduce" in o.stack, o.stack
        assert "CommunicationError" in o.error, o.error
    assert any("deadline passed" in o.error for o in outcomes)
    with pytest.raises(AssertionError, match="still running after 2 s"):
        assert_ok(outcomes, "names that differ", 2)


def test_communicator_takes_a_rendezvous_or_an_mpi_comm_not_both():
    rendezvous = ThreadGroup(1).rendezvous(0)
    assert isinstance(rendezvous, Rendezvous) and rendezvous.mpi_comm is None
    with pytest.raises(rs.UsageError, match="not both"):
        rs.Communicator(object(), rendezvous=rendezvous)
    comm = rs.Communicator(rendezvous)  # in the MPI communicator's place
    try:
        assert (comm.rank(), comm.size(), comm.rendezvous) == (0, 1, rendezvous)
        assert comm.mpi_comm is None
        assert comm.allreduce(np.arange(3.0), op=rs.Sum).tolist() == [0.0, 1.0, 2.0]
    finally:
        comm.shutdown()


def _join_then_blocking_calls(comm, rounds):
    """Each round, rank r makes 1 + (r + round) % size blocking allreduces (on the same-host
    lane), joins, then makes a blocking broadcast; every result is checked."""
    me, size = comm.rank(), comm.size()
    for rnd in range(rounds):
        steps = 1 + (me + rnd) % size
        for step in range(steps):
            out = comm.allreduce(np.full(4, me + 1.0, np.float32), op=rs.Sum,
                                 name=f"grad.{rnd}.{step}")
            active = [r for r in range(size) if step < 1 + (r + rnd) % size]
            assert out.tolist() == [float(sum(r + 1 for r in active))] * 4, (rnd, step, out)
        assert comm.join() in range(size)
        root = rnd % size
        got = comm.broadcast(np.full(3, 10 * rnd + me, np.int32), root, name=f"after.{rnd}")
        assert got.tolist() == [10 * rnd + root] * 3, (rnd, got)


@pytest.mark.parametrize("size", [2, 4])
def test_a_joined_rank_leaves_calls_made_after_the_join_to_its_own_next_call(size):
    """A joined rank serves the others' lane posts with zeros until its join completes; a
    peer whose join completed first may already post its next blocking call. That post is
    not the joined rank's to answer (before the fix it answered 'use the engine' for it
    and the two ranks then waited for each other, one on the lane, one in the engine)."""
    assert_ranks_ok(_join_then_blocking_calls, size, timeout=TIMEOUT, args=(100,),
                    env={**PATHS["shm"], "RINGSYNC_TIMEOUT_SECONDS": "20"})


def _abort_beside_pending_work(comm, rounds, submitted):
    """Rank 0 leaves many allreduces pending (rank 1 never submits them); rank 1 goes
    away once they are all submitted (`submitted`, an event: before, rank 0's engine could
    fail a submission of the lost peer's), so rank 0's engine thread finds a lost peer
    with work pending while rank 0's own thread aborts the ring: the two must not both
    take the negotiation apart."""
    if comm.rank() == 0:
        handles = [comm.allreduce_async(np.ones(2), name=f"never.{i}") for i in range(rounds)]
        submitted.set()
        time.sleep(0.002 * (rounds % 3))
        comm.abort("the test aborts beside pending work")
        return len(handles)
    assert submitted.wait(30), "rank 0 did not submit its allreduces"
    comm.abort("rank 1 leaves")
    return 0


@pytest.mark.parametrize("attempt", range(8))
def test_aborting_while_the_engine_finds_a_lost_peer(attempt):
    """Before the fix, rs_engine_fail freed the negotiator's map from the caller's thread
    while the engine thread iterated it (a segfault seen in elastic recovery)."""
    outcomes = run_ranks(_abort_beside_pending_work, 2, timeout=60,
                         args=(500 + attempt, threading.Event()),
                         env={"RINGSYNC_TRANSPORT": "tcp", "RINGSYNC_TIMEOUT_SECONDS": "30"})
    assert outcomes[0].value == 500 + attempt, outcomes


def _results_are_freed_once_dropped(comm):
    """With the cycle collector off, a result the caller drops is freed at once: the
    handle behind it holds nothing back (it once kept the result alive through its own
    closure until the next gc run)."""
    import gc
    import weakref
    x = np.arange(1000, dtype=np.float64) + 1000 * comm.rank()
    calls = {"allreduce": lambda: comm.allreduce(x, name="freed.allreduce"),
             "allgather": lambda: comm.allgather(x, name="freed.allgather"),
             "reducescatter": lambda: comm.reducescatter(x, name="freed.reducescatter"),
             "async allgather": lambda: comm.synchronize(
                 comm.allgather_async(x, name="freed.async"))}
    gc.disable()
    try:
        for what, call in calls.items():
            alive = weakref.ref(call())
            assert alive() is None, f"{what}: the result outlived its last reference"
    finally:
        gc.enable()


@pytest.mark.parametrize("path", ["shm", "tcp"])
def test_results_are_freed_once_dropped(path):
    assert_ranks_ok(_results_are_freed_once_dropped, 2, timeout=TIMEOUT,
                    env={**BASE_ENV, **PATHS[path]})


def _reused_requests(comm):
    """Allreduces reuse their native request per (dtype, shape, op, scale factors) and only
    swap the buffers (the fast path): results must stay right when shapes, dtypes, ops,
    buffers and names change from call to call, in place or not, blocking or not."""
    rank, size = comm.rank(), comm.size()
    cases = [(np.float32, (7,), rs.Sum), (np.float64, (3, 5), rs.Average),
             (np.int32, (1,), rs.Max), (np.float32, (7,), rs.Min), (np.int64, (0,), rs.Sum),
             (np.float32, (7,), rs.Sum)]
    for round_ in range(3):
        for i, (dtype, shape, op) in enumerate(cases):
            def make(r, i=i, dtype=dtype, shape=shape):
                n = int(np.prod(shape))
                return (np.arange(n).reshape(shape) * (r + 1) + 100 * r + i + round_
                        ).astype(dtype)
            inputs = [make(r) for r in range(size)]
            want = {rs.Sum: sum(inputs), rs.Max: np.maximum.reduce(inputs),
                    rs.Min: np.minimum.reduce(inputs),
                    rs.Average: sum(x.astype(np.float64) for x in inputs) / size}[op]
            name = f"reused.{i % 2}"  # names shared by different shapes and dtypes
            mine = make(rank)
            got = comm.allreduce(mine, op=op, name=name)
            np.testing.assert_allclose(got, want.astype(dtype), rtol=1e-6, err_msg=name)
            assert np.array_equal(mine, make(rank)), "the out-of-place call wrote its input"
            buf = make(rank)
            assert comm.allreduce_(buf, op=op, name=name) is buf
            np.testing.assert_allclose(buf, want.astype(dtype), rtol=1e-6)
            handles = [(comm.allreduce_async_(b, op=op, prescale_factor=2.0, name=f"{name}.{k}"), b)
                       for k, b in enumerate([make(rank), make(rank)])]
            for handle, b in handles:
                assert comm.synchronize(handle) is b
                scaled = want.astype(np.float64) * (2.0 if op in (rs.Sum, rs.Average) else 1.0)
                if op in (rs.Max, rs.Min):
                    scaled = np.maximum.reduce([x * 2 for x in inputs]) if op == rs.Max else \
                        np.minimum.reduce([x * 2 for x in inputs])
                np.testing.assert_allclose(b, scaled.astype(dtype), rtol=1e-6)
    # A disagreement after both ranks' requests were cached still fails on every rank...
    x = np.ones(4, np.float32 if rank == 0 else np.float64)
    comm.allreduce(np.ones(4, np.float64), name="agree")
    comm.allreduce(np.ones(4, np.float32), name="agree")
    with pytest.raises(rs.MismatchError, match="dtype"):
        comm.allreduce(x, name="disagree")
    # ... and the next call works.
    assert comm.allreduce(np.full(2, rank + 1.0), op=rs.Sum, name="after")[0] == \
        size * (size + 1) / 2


def _threads_share_a_communicator(comm):
    """Two threads of each rank submit asynchronous allreduces at once through one
    communicator: each thread's cached requests carry its own buffers."""
    rank, size = comm.rank(), comm.size()
    results = {}

    def submit(thread):
        bufs = [np.full(5 + k % 3, 1000.0 * thread + 10 * k + rank, np.float64)
                for k in range(60)]
        handles = [comm.allreduce_async_(b, op=rs.Sum, name=f"t{thread}.{k}")
                   for k, b in enumerate(bufs)]
        results[thread] = [comm.synchronize(h).copy() for h in handles]

    threads = [threading.Thread(target=submit, args=(t,)) for t in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for thread in (0, 1):
        for k, got in enumerate(results[thread]):
            want = sum(1000.0 * thread + 10 * k + r for r in range(size))
            assert np.all(got == want) and got.size == 5 + k % 3, (thread, k, got)


@pytest.mark.parametrize("size", [2, 3])
@pytest.mark.parametrize("path", ["shm", "tcp"])
def test_reused_allreduce_requests(size, path):
    assert_ranks_ok(_reused_requests, size, timeout=TIMEOUT, env={**BASE_ENV, **PATHS[path]})


@pytest.mark.parametrize("path", ["shm", "tcp"])
def test_threads_share_a_communicator(path):
    assert_ranks_ok(_threads_share_a_communicator, 2, timeout=TIMEOUT,
                    env={**BASE_ENV, **PATHS[path]})
