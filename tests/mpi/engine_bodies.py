"""Engine test bodies (run on every rank under mpirun): asynchronous handles, negotiation
of out-of-order submissions, fusion, the response cache, mismatches, stalls, timeouts,
restart and the timeline."""
import json
import os
import time

import numpy as np

import ringsync as rs

from tests.common import collective_checks
from tests.common.reference import REDUCIBLE, assert_reduced, rank_input


def out_of_order_submission():
    """50 tensors submitted asynchronously in a different order on every rank
    (collective_checks.out_of_order_submission, here through the module-level API)."""
    rs.init()
    collective_checks.out_of_order_submission(rs)
    rs.shutdown()


def fusion_settings_agree():
    """Fusion on, off, and with a threshold smaller than some tensors: same results."""
    threshold = os.environ.get("RINGSYNC_FUSION_THRESHOLD", "default")
    rs.init()
    specs = [(f"f{i}", (n,), "float32") for i, n in enumerate([1, 5000, 100, 300_000, 7, 2])]
    for op in ["Sum", "Average", "Max"]:
        handles = [rs.allreduce_async(rank_input(rs.rank(), s[1], s[2], op, s[0]), op=getattr(rs, op),
                                      name=f"{s[0]}.{op}") for s in specs]
        for s, h in zip(specs, handles):
            inputs = [rank_input(r, s[1], s[2], op, s[0]) for r in range(rs.size())]
            assert_reduced(rs.synchronize(h), inputs, op,
                           what=f"{s} {op} fusion threshold {threshold}")
    # Different scale factors and dtypes in one burst must not be fused together.
    a = rs.allreduce_async(np.full(10, rs.rank() + 1.0), op=rs.Sum, prescale_factor=2.0, name="sa")
    b = rs.allreduce_async(np.full(10, rs.rank() + 1.0), op=rs.Sum, name="sb")
    c = rs.allreduce_async(np.full(10, rs.rank() + 1, dtype=np.int32), op=rs.Sum, name="sc")
    total = rs.size() * (rs.size() + 1) / 2
    assert np.allclose(rs.synchronize(a), 2 * total)
    assert np.allclose(rs.synchronize(b), total)
    assert np.array_equal(rs.synchronize(c), np.full(10, int(total), dtype=np.int32))
    rs.shutdown()


def grouped_and_async_collectives():
    rs.init()
    me, size = rs.rank(), rs.size()
    group = [rank_input(me, (n,), "float64", "Sum", f"g{n}") for n in (3, 0, 1000)]
    handle = rs.grouped_allreduce_async(group, op=rs.Sum, name="grp")
    assert isinstance(rs.poll(handle), bool)
    results = rs.synchronize(handle)
    assert rs.poll(handle)
    for n, got in zip((3, 0, 1000), results):
        assert_reduced(got, [rank_input(r, (n,), "float64", "Sum", f"g{n}") for r in range(size)],
                       "Sum", what=f"grouped n={n}")
    inplace = [x.copy() for x in group]
    rs.grouped_allreduce_(inplace, op=rs.Max)
    for n, got in zip((3, 0, 1000), inplace):
        assert_reduced(got, [rank_input(r, (n,), "float64", "Sum", f"g{n}") for r in range(size)],
                       "Max", what=f"grouped in place n={n}")
    # Every async kind, outstanding together.
    g = rs.allgather_async(np.full((me + 1, 2), me, dtype=np.int32))
    b = rs.broadcast_async(np.arange(4) + me, root_rank=size - 1)
    rsc = rs.reducescatter_async(np.ones((size * 2, 3)) * me, op=rs.Sum)
    a2a = rs.alltoall_async(np.arange(size * 2, dtype=np.int64) + 100 * me)
    x = np.full(6, float(me))
    ar = rs.allreduce_async_(x, op=rs.Sum)
    expected_rows = np.concatenate([np.full((r + 1, 2), r, dtype=np.int32) for r in range(size)])
    assert np.array_equal(rs.synchronize(g), expected_rows)
    assert np.array_equal(rs.synchronize(b), np.arange(4) + size - 1)
    assert np.array_equal(rs.synchronize(rsc), np.full((2, 3), sum(range(size)), dtype=float))
    assert np.array_equal(rs.synchronize(a2a),
                          np.concatenate([np.arange(2 * me, 2 * me + 2) + 100 * r for r in range(size)]))
    assert rs.synchronize(ar) is x and np.all(x == sum(range(size)))
    rs.shutdown()


def _expect_everywhere(fragment, fn, *args, **kwargs):
    try:
        fn(*args, **kwargs)
    except rs.UsageError as e:
        assert fragment in str(e), f"rank {rs.rank()}: expected {fragment!r} in: {e}"
    else:
        raise AssertionError(f"rank {rs.rank()}: no error for {fragment!r}")
    # The next collective still works.
    got = rs.allreduce(np.arange(3.0) + rs.rank(), op=rs.Sum, name="after." + fragment[:20])
    assert np.array_equal(got, np.arange(3.0) * rs.size() + sum(range(rs.size())))


def mismatches_fail_on_every_rank():
    """Each kind of disagreement fails that tensor on every rank with both values named;
    the engine keeps working. The last rank is the odd one out."""
    rs.init()
    me, last = rs.rank(), rs.size() - 1
    odd = me == last
    _expect_everywhere(
        f"Mismatched allreduce tensor shapes for 'grad.fc1.weight': rank 0 sent [17, 4], "
        f"rank {last} sent [18, 4]",
        rs.allreduce, np.zeros((18 if odd else 17, 4)), name="grad.fc1.weight")
    _expect_everywhere(
        f"Mismatched allreduce dtypes for 'w.dtype': rank 0 sent float32, rank {last} sent float64",
        rs.allreduce, np.zeros(3, np.float64 if odd else np.float32), name="w.dtype")
    _expect_everywhere(
        f"Mismatched allreduce reduction ops for 'w.op': rank 0 sent Sum, rank {last} sent Max",
        rs.allreduce, np.zeros(3), op=rs.Max if odd else rs.Sum, name="w.op")
    _expect_everywhere(
        f"Mismatched broadcast root ranks for 'w.root': rank 0 sent 0, rank {last} sent {last}",
        rs.broadcast, np.zeros(3), root_rank=last if odd else 0, name="w.root")
    _expect_everywhere(
        f"Mismatched allreduce scale factors for 'w.scale': rank 0 sent prescale 1 postscale 1, "
        f"rank {last} sent prescale 2 postscale 1",
        rs.allreduce, np.zeros(3), prescale_factor=2.0 if odd else 1.0, name="w.scale")
    _expect_everywhere(
        f"Mismatched operations for 'w.kind': rank 0 sent allreduce, rank {last} sent broadcast",
        (lambda: rs.broadcast(np.zeros(3), 0, name="w.kind")) if odd else
        (lambda: rs.allreduce(np.zeros(3), name="w.kind")))
    _expect_everywhere(
        f"Mismatched alltoall tensor shapes for 'w.a2a': rank 0 sent [{rs.size()}, 2], rank "
        f"{last} sent [{rs.size()}, 3]",
        rs.alltoall, np.zeros((rs.size(), 3 if odd else 2)), name="w.a2a")
    # A cached tensor whose shape changes on one rank: caught too, then it works again.
    for _ in range(2):
        rs.allreduce(np.ones(5), name="cached")
    _expect_everywhere(
        f"Mismatched allreduce tensor shapes for 'cached': rank 0 sent [5], rank {last} sent [6]",
        rs.allreduce, np.ones(6 if odd else 5), name="cached")
    assert np.array_equal(rs.allreduce(np.ones(6), op=rs.Sum, name="cached"), np.full(6, rs.size()))
    assert np.array_equal(rs.allreduce(np.ones(6), op=rs.Sum, name="cached"), np.full(6, rs.size()))
    # Local mistakes fail on the calling rank at submission, before any negotiation. Each
    # rank in turn submits a name twice while the others have not submitted it once (so
    # the first cannot have completed in between, however the ranks are scheduled).
    for turn in range(rs.size()):
        name = f"twice.{turn}"
        if rs.rank() == turn:
            h = rs.allreduce_async(np.ones(2), name=name)
            try:
                rs.allreduce_async(np.ones(2), name=name)
            except rs.UsageError as e:
                assert f"'{name}' is already in flight" in str(e), str(e)
            else:
                raise AssertionError(f"a second '{name}' in flight was accepted")
        rs.allreduce(np.ones(1), name=f"turn.{turn}")
        if rs.rank() != turn:
            h = rs.allreduce_async(np.ones(2), name=name)
        rs.synchronize(h)
    rs.shutdown()


def stalled_tensor_is_reported():
    """Rank 1 submits 'late.tensor' 3 s after the others (stall check 1 s): rank 0 prints
    one report naming it and rank 1; the tensor then completes."""
    rs.init()
    if rs.rank() == 1:
        time.sleep(3)
    got = rs.allreduce(np.ones(4), op=rs.Sum, name="late.tensor")
    assert np.array_equal(got, np.full(4, rs.size()))
    rs.shutdown()


def _expect_communication_error(call, failure_message):
    try:
        call()
    except rs.CommunicationError:
        return
    raise AssertionError(failure_message)


def never_submitted_times_out_everywhere():
    """Rank 1 never submits 'orphan': the ranks that did fail it (the first to time out
    names the missing rank; the others may learn of it first through that rank's abort),
    and rank 1's next collective fails instead of hanging."""
    rs.init()
    if rs.rank() != 1:
        try:
            rs.allreduce(np.ones(4), name="orphan")
        except rs.CommunicationError as e:
            timed_out = isinstance(e, rs.CommunicationTimeout) and "ranks [1] to submit" in str(e)
            assert "'orphan'" in str(e) and (timed_out or "aborted" in str(e)), str(e)
        else:
            raise AssertionError("'orphan' completed without rank 1")
    else:
        time.sleep(4)  # past the others' timeout (1.5 s)
        try:
            rs.allreduce(np.ones(4), name="after")
        except rs.CommunicationError as e:
            assert "aborted" in str(e) or "lost" in str(e) or "closed" in str(e), str(e)
        else:
            raise AssertionError("rank 1's collective succeeded after its peers gave up")
    # Every later call fails at once with the communication error.
    _expect_communication_error(lambda: rs.allreduce(np.ones(1), name="later"),
                                "a broken engine accepted new work")
    rs.shutdown()


def restart_with_a_new_rank_set():
    """Shut the engine down and start it again in the same process, over the world and
    then over half of it (what elastic recovery does after a rank is lost)."""
    from mpi4py import MPI
    world = MPI.COMM_WORLD
    for attempt in range(2):
        rs.init()
        got = rs.allreduce(np.full(3, world.rank + attempt), op=rs.Sum, name="again")
        assert np.array_equal(got, np.full(3, sum(range(world.size)) + attempt * world.size))
        rs.shutdown()
    survivors = world.Split(color=0 if world.rank < max(1, world.size - 1) else 1, key=world.rank)
    rs.init(survivors)
    got = rs.allreduce(np.array([world.rank], dtype=np.int64), op=rs.Sum, name="again")
    members = [r for r in range(world.size)
               if (0 if r < max(1, world.size - 1) else 1) == (0 if world.rank < max(1, world.size - 1) else 1)]
    assert got[0] == sum(members) and rs.size() == len(members), (got, members)
    rs.shutdown()
    survivors.Free()


def timeline_records_each_tensor():
    path = os.path.join(os.environ["RINGSYNC_TEST_DIR"], "timeline-%d.json")
    rs.init()
    rs.start_timeline(path % rs.rank())
    names = [f"tl.{i}" for i in range(5)]
    handles = [rs.allreduce_async(np.ones(100 * (i + 1), np.float32), name=n)
               for i, n in enumerate(names)]
    for h in handles:
        rs.synchronize(h)
    rs.broadcast(np.ones(10), 0, name="tl.bcast")
    rs.stop_timeline()
    with open(path % rs.rank()) as f:
        trace = json.load(f)
    events = trace["traceEvents"]
    tracks = {e["tid"]: e["args"]["name"] for e in events
              if e.get("ph") == "M" and e["name"] == "thread_name"}
    # Horovod's names: tracks <kind>.<name>, phases NEGOTIATE_<KIND> then <KIND>.
    assert sorted(tracks.values()) == sorted([f"allreduce.{n}" for n in names] +
                                             ["broadcast.tl.bcast"]), tracks
    for tid, tensor in tracks.items():
        kind = tensor.split(".")[0].upper()
        phases = [e["name"] for e in events if e.get("ph") == "X" and e["tid"] == tid]
        assert phases[0] == f"NEGOTIATE_{kind}" and kind in phases, (tensor, phases)
        assert all(e["dur"] >= 0 for e in events if e.get("ph") == "X")
    rs.shutdown()


def join_with_uneven_steps():
    """Rank r has 2 + r steps of data: ranks that ran out join, and their zeros stand in
    for them in the others' allreduces. Other collectives fail while a rank has joined."""
    rs.init()
    me, size = rs.rank(), rs.size()
    for step in range(2 + me):
        got = rs.allreduce(np.full(4, me + 1.0), op=rs.Sum, name=f"join.step{step}")
        active = [r for r in range(size) if step < 2 + r]
        assert np.all(got == sum(r + 1 for r in active)), (step, got, active)
        avg = rs.allreduce(np.full(2, me + 1.0), op=rs.Average, name=f"join.avg{step}")
        assert np.allclose(avg, sum(r + 1 for r in active) / size), (step, avg)
    if me == size - 1 and size > 1:
        try:  # every other rank has joined by the time this is negotiated
            rs.broadcast(np.zeros(3), root_rank=me, name="join.bcast")
        except rs.UsageError as e:
            assert "only allreduce works with join" in str(e), str(e)
        else:
            raise AssertionError("a broadcast ran while ranks had joined")
    assert rs.join() == size - 1
    # After the join, every rank is back and everything works.
    assert np.array_equal(rs.allgather(np.array([me])), np.arange(size))
    assert rs.join() in range(size)  # a second join round works too
    rs.shutdown()


def same_host_lane():
    """Blocking calls on the same-host lane: results against the reference for every
    dtype (one round, staged, and above the lane's limit, where the engine runs them),
    async work in flight meanwhile, disagreements failing on every rank, and a joined rank
    taking part with zeros in one-round, staged and engine allreduces."""
    rs.init()
    me, size, last = rs.rank(), rs.size(), rs.size() - 1
    assert rs._comm().uses_lane == (size > 1), "every rank is on this host: the lane must be on"
    limit, one_round = rs._comm().config.lane_bytes, rs._comm().config.small_allreduce_bytes
    for dtype in REDUCIBLE:
        item = np.dtype(dtype).itemsize
        # one round; staged (one chunk, several, not divisible by the ranks); the engine
        for n in (0, 1, 7, one_round // item, one_round // item + 3, 70_001, limit // item,
                  limit // item + 5):
            name = f"lane.{np.dtype(dtype).name}.{n}"
            inputs = [rank_input(r, (n,), dtype, "Sum", name) for r in range(size)]
            assert_reduced(rs.allreduce(inputs[me], op=rs.Sum, name=name), inputs, "Sum", what=name)
    # Average, scale factors, in place; an async allreduce overlapping blocking ones.
    pending = rs.allreduce_async(np.full(50_000, me + 1.0), op=rs.Sum, name="lane.async")
    x = np.arange(5.0) * (me + 1)
    assert rs.allreduce_(x, op=rs.Average, prescale_factor=2.0, postscale_factor=0.5) is x
    assert np.allclose(x, np.arange(5.0) * sum(r + 1 for r in range(size)) / size)
    rs.barrier()
    assert np.all(rs.synchronize(pending) == sum(r + 1 for r in range(size)))
    # Disagreements fail here, on every rank, and the next call works.
    _expect_everywhere(f"Mismatched blocking collectives: rank 0 called allreduce 'lane.a', "
                       f"rank {last} called allreduce 'lane.b'", rs.allreduce, np.ones(3),
                       name="lane.b" if me == last else "lane.a")
    _expect_everywhere(f"Mismatched allreduce tensor shapes for 'lane.size': rank 0 sent [4], "
                       f"rank {last} sent [{limit}]", rs.allreduce,
                       np.ones(limit if me == last else 4), name="lane.size")
    _expect_everywhere(f"rank {last} called barrier 'barrier.noname.", (lambda: rs.barrier())
                       if me == last else (lambda: rs.allreduce(np.ones(2), name="lane.kind")))
    _expect_everywhere(f"Mismatched operations for 'lane.bcast': rank 0 sent allreduce, rank {last} "
                       "sent broadcast", (lambda: rs.broadcast(np.ones(2), 0, name="lane.bcast"))
                       if me == last else (lambda: rs.allreduce(np.ones(2), name="lane.bcast")))
    # Rank 0 runs out of data first: its zeros stand in, small and large.
    steps = 3 if me == 0 else 5
    for step in range(steps):
        for n in (4, 40_000, limit // 8 + 3):
            got = rs.allreduce(np.full(n, me + 1.0), op=rs.Sum, name=f"lane.join.{step}.{n}")
            active = [r for r in range(size) if step < (3 if r == 0 else 5)]
            assert np.all(got == sum(r + 1 for r in active)), (step, n, got[:3], active)
    rs.join()
    rs.shutdown()
