"""Point-to-point (Communicator.send / recv and their async forms) with ranks as threads of
this process (tests/thread_ranks.py): every dtype and size over both transports, matching
by name and in order, exchanges that must not deadlock, errors on both ends, a process
set's own numbering, and a lost peer failing a pending receive."""
import threading

import numpy as np
import pytest

import ringsync as rs
from ringsync.process_sets import ProcessSet, Registry, communicator_of

from tests.common.reference import MOVABLE, dtype_of, rank_input
from tests.thread_ranks import PATHS, assert_ranks_ok, run_ranks

TIMEOUT = 60
BASE_ENV = {"RINGSYNC_TIMEOUT_SECONDS": "30"}
TRANSPORTS = ("shm", "tcp")
# 0 elements, 1, odd, and more than 1 MiB (for every dtype, 1 byte wide included).
SIZES = [0, 1, 7, (1 << 20) + 3]


def _env(path):
    return {**BASE_ENV, **PATHS[path]}


def _every_dtype_and_size(comm):
    """A ring: each rank sends each tensor to rank + 1 and receives rank - 1's, checked
    exactly against what that rank sent (data differ by rank, dtype and size)."""
    r, n = comm.rank(), comm.size()
    right, left = (r + 1) % n, (r - 1) % n
    for dtype in MOVABLE:
        for size in SIZES:
            shape = (size,) if size < 8 else (size // 3, 3)  # odd and multi-dimensional
            shape = shape if size != 1 else ()  # a 0-d tensor
            mine = rank_input(r, shape, dtype, salt="p2p")
            out = np.empty(shape, dtype_of(dtype))
            sent = comm.send_async(mine, right, name=f"{dtype}.{size}")
            got = comm.recv(out, left, name=f"{dtype}.{size}")
            comm.synchronize(sent)
            assert got is out
            want = rank_input(left, shape, dtype, salt="p2p")
            assert out.tobytes() == want.tobytes(), (dtype, size)
    return True


def _out_of_order_names_and_many_in_order(comm):
    r = comm.rank()
    count = 40
    if r == 0:
        comm.send(np.full(3, 1.0), 1, name="a")  # rank 1 posts "b" first
        comm.send(np.full(3, 2.0), 1, name="b")
        handles = [comm.send_async(np.array([i, i * i], np.int64), 1) for i in range(count)]
        for h in handles:
            comm.synchronize(h)
        for i in range(count):  # blocking, one at a time, against posted recvs
            comm.send(np.array([i], np.int32), 1)
        return True
    if r == 1:
        b = comm.recv_async(np.empty(3), 0, name="b")
        a = comm.recv_async(np.empty(3), 0, name="a")
        assert comm.synchronize(b).tolist() == [2.0] * 3
        assert comm.synchronize(a).tolist() == [1.0] * 3
        outs = [np.empty(2, np.int64) for _ in range(count)]
        handles = [comm.recv_async(o, 0) for o in outs]
        for i, h in enumerate(handles):
            assert comm.synchronize(h).tolist() == [i, i * i]
        posted = [comm.recv_async(np.empty(1, np.int32), 0) for _ in range(count)]
        assert [comm.synchronize(h)[0] for h in posted] == list(range(count))
        return True
    # The third rank stays out of it, but takes part in collectives meanwhile.
    return True


def _exchange_between_collectives(comm):
    """Both directions at once between every pair, interleaved with collectives, on 4
    ranks: messages and collectives share the streams without mixing."""
    r, n = comm.rank(), comm.size()
    for step in range(5):
        sends = [comm.send_async(np.array([r, p, step], np.int64), p) for p in range(n) if p != r]
        outs = {p: np.empty(3, np.int64) for p in range(n) if p != r}
        recvs = [comm.recv_async(outs[p], p) for p in outs]
        total = comm.allreduce(np.array([r + step], np.int64), op=rs.Sum, name=f"mid.{step}")
        for h in sends + recvs:
            comm.synchronize(h)
        assert total.tolist() == [sum(range(n)) + n * step]
        for p, out in outs.items():
            assert out.tolist() == [p, r, step]
    return True


def _mismatches_fail_both_ends(comm):
    r = comm.rank()
    peer = 1 - r
    cases = [(np.zeros(3, np.float32), np.empty(3, np.int32), "dtypes",
              ["float32", "int32"]),
             (np.zeros((2, 3), np.float32), np.empty((3, 2), np.float32), "shapes",
              ["[2, 3]", "[3, 2]"])]
    for i, (sent, buf, what, values) in enumerate(cases):
        name = f"bad.{i}"
        with pytest.raises(rs.MismatchError) as info:
            if r == 0:
                comm.send(sent, peer, name=name)
            else:
                comm.recv(buf, peer, name=name)
        text = str(info.value)
        assert f"Mismatched send/recv {what}" in text, text
        for fragment in [name, "rank 0", "rank 1"] + values:
            assert fragment in text, (fragment, text)
        # The failed message left the pair working, named and unnamed.
        out = np.empty(2, np.int64)
        if r == 0:
            comm.send(np.array([7, i]), peer, name=name)
            comm.send(np.array([8, i]), peer)
        else:
            assert comm.recv(out, peer, name=name).tolist() == [7, i]
            assert comm.recv(out, peer).tolist() == [8, i]
    return True


# Each check on both transports: (body, ranks).
CHECKS = {
    "every_dtype_and_size_around_a_ring": (_every_dtype_and_size, 3),
    "named_out_of_order_and_unnamed_in_order": (_out_of_order_names_and_many_in_order, 3),
    "all_pairs_exchange_between_collectives": (_exchange_between_collectives, 4),
    "mismatches_fail_both_ends_and_the_next_works": (_mismatches_fail_both_ends, 2),
}


@pytest.mark.parametrize("path", TRANSPORTS)
@pytest.mark.parametrize("check", sorted(CHECKS))
def test_messages(check, path):
    body, size = CHECKS[check]
    assert_ranks_ok(body, size, timeout=TIMEOUT, env=_env(path))


def _bad_arguments_refused(comm):
    r, n = comm.rank(), comm.size()
    peer = 1 - r
    for bad in (-1, n, r, "1", 1.0, True, None):
        with pytest.raises(rs.UsageError, match="out of range"):
            comm.send(np.ones(2), bad)
        with pytest.raises(rs.UsageError, match="out of range"):
            comm.recv_async(np.empty(2), bad, name="x")
    readonly = np.empty(4)
    readonly.flags.writeable = False
    with pytest.raises(rs.UsageError, match="read-only"):
        comm.recv(readonly, peer)
    with pytest.raises(rs.UsageError, match="not C-contiguous"):
        comm.recv(np.empty((4, 4))[:, 1], peer)
    with pytest.raises(rs.UsageError, match="must be a numpy array or a writable buffer"):
        comm.recv([0.0, 0.0], peer)
    # A name in flight twice on one rank is refused; the first still completes (the
    # barrier keeps the first in flight: its recv is posted only after it).
    if r == 0:
        first = comm.send_async(np.array([5.0]), peer, name="twice")
        with pytest.raises(rs.UsageError, match="already in flight"):
            comm.send_async(np.array([6.0]), peer, name="twice")
        comm.barrier()
        comm.synchronize(first)
    else:
        comm.barrier()
        assert comm.recv(np.empty(1), peer, name="twice").tolist() == [5.0]
    # None of the refusals took a place in the pair's order: unnamed still match.
    out = np.empty(1)
    if r == 0:
        comm.send(np.array([9.0]), peer)
    else:
        assert comm.recv(out, peer).tolist() == [9.0]
    return True


def test_bad_peers_and_buffers_are_refused_and_the_next_call_works():
    assert_ranks_ok(_bad_arguments_refused, 2, timeout=TIMEOUT, env=_env("shm"))


def _within_a_process_set(world):
    """Set [0, 2] of 3 world ranks: its ranks are the set's own (0 and 1), and a message
    within it goes between world ranks 0 and 2 while world rank 1 runs its collectives."""
    me = world.rank()
    registry = Registry(world)
    ends = ProcessSet([0, 2])
    registry.add(ends)
    if ends.included():
        comm = communicator_of(ends)
        mine = comm.rank()
        assert mine == (0 if me == 0 else 1) and comm.size() == 2
        with pytest.raises(rs.UsageError, match="out of range"):
            comm.send(np.ones(1), 2)  # world rank 2 is set rank 1: 2 is out of the set
        sent = comm.send_async(np.array([me, 10 * me]), 1 - mine)
        got = comm.recv(np.empty(2, np.int64), 1 - mine)
        comm.synchronize(sent)
        assert got.tolist() == [2 - me, 10 * (2 - me)]
    got = world.allreduce(np.array([me]), op=rs.Sum, name="world.after")
    registry.close()
    return got.tolist() == [3]


@pytest.mark.parametrize("path", TRANSPORTS)
def test_messages_within_a_process_set(path):
    assert all(assert_ranks_ok(_within_a_process_set, 3, timeout=TIMEOUT, env=_env(path)))


def _peer_aborts(comm):
    if comm.rank() == 0:
        comm.barrier()  # rank 1 has posted its recv
        comm.abort("rank 0 gives up")
        return "aborted"
    pending = comm.recv_async(np.empty(4), 0, name="never.sent")
    comm.barrier()
    with pytest.raises(rs.CommunicationError):
        comm.synchronize(pending)
    return "failed"


@pytest.mark.parametrize("path", TRANSPORTS)
def test_an_aborted_peer_fails_a_pending_recv(path):
    outcomes = run_ranks(_peer_aborts, 2, timeout=TIMEOUT, env=_env(path))
    assert [o.value for o in outcomes] == ["aborted", "failed"], [o.error for o in outcomes]


def _peer_raises(comm):
    """A rank that fails (run_ranks aborts its communicator, as a dying process's socket
    closes): the pending send to it fails with CommunicationError."""
    if comm.rank() == 1:
        comm.barrier()
        raise RuntimeError("rank 1 fails on purpose")
    pending = comm.send_async(np.ones(1 << 16), 1, name="never.received")
    comm.barrier()
    with pytest.raises(rs.CommunicationError):
        comm.synchronize(pending)
    return True


def test_a_failed_peer_fails_a_pending_send():
    outcomes = run_ranks(_peer_raises, 2, timeout=TIMEOUT, env=_env("tcp"))
    assert outcomes[0].ok and outcomes[0].value is True, outcomes[0].error
    assert "fails on purpose" in outcomes[1].error


def _torch_messages(comm):
    """ringsync.torch's send / recv (process_set= takes a Communicator too): in place into
    a preallocated tensor, a non-contiguous one included, and differentiable: the sender's
    token receives the gradient of what the receiver computed from the message."""
    import torch
    import ringsync.torch as hvd
    r = comm.rank()
    peer = 1 - r
    if r == 0:
        hvd.send(torch.arange(6, dtype=torch.float32).reshape(2, 3), 1, process_set=comm)
        hvd.synchronize(hvd.send_async(torch.tensor([1, 2, 3]), 1, name="ints", process_set=comm))
        x = torch.tensor([1.0, 2.0, 3.0], requires_grad=True)
        token = hvd.send(x * 2, peer, name="act", process_set=comm)
        torch.autograd.backward([token], [torch.zeros(0)])
        return x.grad.tolist()
    out = torch.empty(3, 2).t()  # non-contiguous: staged through a copy
    assert hvd.recv(out, 0, process_set=comm) is out
    assert out.tolist() == [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]]
    ints = torch.zeros(3, dtype=torch.int64)
    assert hvd.synchronize(hvd.recv_async(ints, 0, name="ints", process_set=comm)) is ints
    assert ints.tolist() == [1, 2, 3]
    y = hvd.recv(torch.empty(3, requires_grad=True), peer, name="act", process_set=comm)
    assert y.tolist() == [2.0, 4.0, 6.0]
    (y * y).sum().backward()  # d/dx of sum((2x)^2) = 8x
    return None


def test_torch_send_recv_and_their_gradients():
    pytest.importorskip("torch")
    got = assert_ranks_ok(_torch_messages, 2, timeout=TIMEOUT, env=_env("shm"))
    assert got[0] == [8.0, 16.0, 24.0]


def _too_many_in_flight(comm):
    """Messages a rank may have in flight are bounded (every rank's negotiator holds each
    until matched): past the limit a send is refused; the posted ones still arrive in
    order, and afterwards the pair works."""
    limit = 4096
    if comm.rank() == 0:
        handles = [comm.send_async(np.array([i], np.int32), 1) for i in range(limit)]
        with pytest.raises(rs.UsageError, match=f"already has {limit} sends and recvs in flight"):
            comm.send_async(np.array([-1], np.int32), 1)
        comm.barrier()
        for h in handles:
            comm.synchronize(h)
        comm.send(np.array([limit], np.int32), 1)
        return True
    comm.barrier()
    out = np.empty(limit + 1, np.int32)
    handles = [comm.recv_async(out[i:i + 1], 0) for i in range(limit)]  # (the most)
    for h in handles:
        comm.synchronize(h)
    comm.recv(out[limit:], 0)
    return out.tolist() == list(range(limit + 1))


def test_messages_in_flight_are_bounded():
    assert all(assert_ranks_ok(_too_many_in_flight, 2, timeout=TIMEOUT, env=_env("shm")))


def _never_sent(comm, failed):
    if comm.rank() == 1:
        with pytest.raises(rs.CommunicationTimeout) as info:
            comm.recv(np.empty(2), 0, name="never")
        failed.set()
        return str(info.value)
    failed.wait(TIMEOUT)  # rank 0 never sends (then its shutdown meets a broken ring)
    return None


def test_an_unmatched_recv_times_out_naming_its_peer():
    outcomes = run_ranks(_never_sent, 2, timeout=TIMEOUT, args=(threading.Event(),),
                         env={**_env("tcp"), "RINGSYNC_TIMEOUT_SECONDS": "1"})
    text = outcomes[1].value
    assert outcomes[1].ok and "'never (0->1)'" in text and "ranks [0]" in text, outcomes[1]
