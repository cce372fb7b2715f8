"""Rings built over a key-value store (ringsync.rendezvous_store.StoreRendezvous), with
ranks as threads of this process over one torch.distributed.HashStore (as torchrun's
TCPStore, in memory): no MPI anywhere."""
import threading
import time
from datetime import timedelta

import numpy as np
import pytest

from ringsync import Communicator, Config, ReduceOp
from ringsync.errors import CommunicationTimeout
from ringsync.rendezvous_store import StoreRendezvous

dist = pytest.importorskip("torch.distributed")

DEADLINE_S = 60


def on_threads(size, body, store=None):
    """body(rank, store) on `size` threads; every rank's value or traceback."""
    store = store or dist.HashStore()
    store.set_timeout(timedelta(seconds=DEADLINE_S))
    results, errors = [None] * size, [None] * size

    def run(rank):
        try:
            results[rank] = body(rank, store)
        except BaseException as exc:  # (reported below, for every rank)
            errors[rank] = f"{type(exc).__name__}: {exc}"

    threads = [threading.Thread(target=run, args=(r,), daemon=True) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(DEADLINE_S + 30)
    assert not any(t.is_alive() for t in threads), f"ranks still running; errors {errors}"
    return results, errors


@pytest.mark.parametrize("size", [1, 2, 3])
def test_allgather_and_bcast_over_a_store(size):
    def body(rank, store):
        rv = StoreRendezvous(store, rank, size)
        first = rv.allgather({"rank": rank, "data": list(range(rank + 1))})
        second = rv.allgather(rank * 10)  # a second round does not see the first's posts
        root = rv.bcast(f"from {rank}", root=size - 1)
        return first, second, root

    results, errors = on_threads(size, body)
    assert errors == [None] * size, errors
    expect = ([{"rank": r, "data": list(range(r + 1))} for r in range(size)],
              [r * 10 for r in range(size)], f"from {size - 1}")
    assert results == [expect] * size


def test_rounds_leave_no_keys_behind():
    store = dist.HashStore()

    def body(rank, store):
        rv = StoreRendezvous(store, rank, 2, prefix="t")
        for i in range(5):
            rv.allgather((rank, i))
        return True

    _, errors = on_threads(2, body, store)
    assert errors == [None, None], errors
    assert store.num_keys() == 0


def test_a_ring_over_a_store_reduces_like_numpy():
    size = 3
    inputs = [np.arange(1000, dtype=np.float64) * (r + 1) + r for r in range(size)]
    config = Config.from_env({"RINGSYNC_TRANSPORT": "tcp"})

    def body(rank, store):
        comm = Communicator(rendezvous=StoreRendezvous(store, rank, size), config=config)
        try:
            total = comm.allreduce(inputs[rank], op=ReduceOp.SUM)
            gathered = comm.allgather(np.array([rank], np.int64))
            return total, gathered
        finally:
            comm.shutdown()

    results, errors = on_threads(size, body)
    assert errors == [None] * size, errors
    for total, gathered in results:
        np.testing.assert_array_equal(total, sum(inputs))
        np.testing.assert_array_equal(gathered, np.arange(size))


def test_split_gives_members_their_own_numbering():
    def body(rank, store):
        rv = StoreRendezvous(store, rank, 4)
        sub = rv.split([1, 3])
        if sub is None:
            return None
        return sub.rank, sub.size, sub.allgather(rank)

    results, errors = on_threads(4, body)
    assert errors == [None] * 4, errors
    assert results == [None, (0, 2, [1, 3]), None, (1, 2, [1, 3])]


def test_a_rank_that_never_comes_is_named():
    def body(rank, store):
        rv = StoreRendezvous(store, rank, 3, timeout=1.0)
        if rank == 2:
            return None  # never posts
        return rv.allgather(rank)

    _, errors = on_threads(3, body)
    for rank in (0, 1):
        assert errors[rank] and CommunicationTimeout.__name__ in errors[rank], errors
        assert "rank(s) [2] of 3" in errors[rank], errors[rank]


def test_out_of_range_rank_and_split_are_refused():
    store = dist.HashStore()
    with pytest.raises(ValueError, match="rank 3 is out of range for size 3"):
        StoreRendezvous(store, 3, 3)
    with pytest.raises(ValueError, match=r"cannot split ranks \[0, 5\]"):
        StoreRendezvous(store, 0, 3).split([0, 5])


# ---- elastic agreement over ringsync's own store: each thread rank its own connection


SECRET = b"store-rendezvous-test-secret"


def elastic_ranks(server, size, timeout=30.0):
    """size elastic rendezvous over server, each over a connection of its own (a rank's
    liveness is its connection)."""
    from ringsync.store import StoreClient
    host, port = server.address
    return [StoreRendezvous(StoreClient(host, port, SECRET, timeout=timeout), rank, size,
                            timeout=timeout, secret=SECRET, owns_store=True, elastic=True)
            for rank in range(size)]


def on_each(rendezvous, body):
    results, errors = [None] * len(rendezvous), [None] * len(rendezvous)

    def run(i):
        try:
            results[i] = body(i, rendezvous[i])
        except BaseException as exc:  # (reported below, for every rank)
            errors[i] = f"{type(exc).__name__}: {exc}"

    threads = [threading.Thread(target=run, args=(i,), daemon=True)
               for i in range(len(rendezvous))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(DEADLINE_S)
    assert not any(t.is_alive() for t in threads), f"ranks still running; errors {errors}"
    return results, errors


def test_survivors_agree_without_waiting_for_a_dead_rank():
    """Rank 1 of 4 dies (its connection ends): the others agree on [0, 2, 3] as soon as
    they have all arrived, and their next generation exchanges as 3 ranks."""
    from ringsync.store import StoreServer
    with StoreServer(SECRET) as server:
        # (the agreement's own timeout is past the test's deadline: waiting for rank 1
        # until then would fail the test)
        ranks = elastic_ranks(server, 4, timeout=4 * DEADLINE_S)
        ranks[1]._store.close()
        survivors = [ranks[0], ranks[2], ranks[3]]

        def body(_, rv):
            new, lost = rv.shrink()
            return new.rank, new.size, lost, new.allgather(rv.rank), new.generation

        results, errors = on_each(survivors, body)
        assert errors == [None] * 3, errors
        assert results == [(0, 3, [1], [0, 2, 3], 1), (1, 3, [1], [0, 2, 3], 1),
                           (2, 3, [1], [0, 2, 3], 1)]


def test_a_rank_arriving_after_the_decision_is_left_out_and_told():
    from ringsync.errors import CommunicationError, RingsyncError
    from ringsync.store import StoreServer
    with StoreServer(SECRET) as server:
        ranks = elastic_ranks(server, 3, timeout=0.5)  # rank 2 arrives after the deadline
        results, errors = on_each(ranks[:2], lambda _, rv: rv.shrink()[1])
        assert errors == [None, None] and results == [[2], [2]], errors
        with pytest.raises(RingsyncError, match="after the others had agreed") as caught:
            ranks[2].shrink()
        assert not isinstance(caught.value, CommunicationError)  # (no recovery retries it)


def test_a_replacement_joins_with_the_next_rank_and_generation():
    from ringsync.store import StoreClient, StoreServer
    with StoreServer(SECRET) as server:
        ranks = elastic_ranks(server, 2, timeout=DEADLINE_S)
        host, port = server.address
        joined = {}

        def join():
            client = StoreClient(host, port, SECRET, timeout=DEADLINE_S)
            joined["rv"] = StoreRendezvous.join(client, SECRET, timeout=DEADLINE_S)

        joiner = threading.Thread(target=join, daemon=True)
        joiner.start()
        deadline = time.monotonic() + DEADLINE_S
        while ranks[0].joiners_waiting() == 0:
            assert time.monotonic() < deadline, "the replacement never registered"
            time.sleep(0.01)
        grown, errors = on_each(ranks, lambda _, rv: rv.spawn(4))
        joiner.join(DEADLINE_S)
        assert errors == [None, None], errors
        everyone = grown + [joined["rv"]]
        assert [(rv.rank, rv.size, rv.generation) for rv in everyone] == \
            [(0, 3, 1), (1, 3, 1), (2, 3, 1)]
        posts, errors = on_each(everyone, lambda i, rv: rv.allgather(f"rank {rv.rank}"))
        assert errors == [None] * 3 and posts == [["rank 0", "rank 1", "rank 2"]] * 3
        assert ranks[0].joiners_waiting() == 0


def test_a_replacement_that_comes_after_the_end_leaves_quietly():
    from ringsync.rendezvous_store import JobFinished
    from ringsync.store import StoreClient, StoreServer
    with StoreServer(SECRET) as server:
        ranks = elastic_ranks(server, 1)
        ranks[0].finish()
        late = StoreClient(*server.address, SECRET)
        with pytest.raises(JobFinished, match="finished before this replacement") as caught:
            StoreRendezvous.join(late, SECRET)
        assert caught.value.code == 0
