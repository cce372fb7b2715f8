"""A hostile authenticated peer (reliability issue, item 2): a rank that completes the
handshake with the job's secret, then sends forged negotiation records, forged
point-to-point entries, truncated and oversized frames, and mutated recordings of valid
frames. Every honest rank must fail with an error naming that rank: no crash, no hang, no
result computed from forged bytes.

The hostile rank is Python (tests/common/hostile_peer.py), the honest ones are thread
ranks with real Communicators over TCP; each case has a deadline. The forged ring counters
and lane posts of same-host ranks are in tests/faults/test_hostile_shm.py. (Strangers
without the secret: tests/faults/test_rogue_peers.py and tests/unit/test_auth.py.)"""
import math
import subprocess
import sys

import numpy as np
import pytest

from ringsync import CommunicationError, CommunicationTimeout, MismatchError

from tests.common import hostile_fuzz
from tests.common import hostile_peer as hp

TIMEOUT_S = 60.0


def _entry(name=b"t", **fields):
    return hp.entry(name, hp.meta(**{"shape": (4,), **fields}))


# name: (the hostile rank's header fields, its payload, what every honest rank's error says)
FORGED_ROUNDS = {
    "header magic": ({"magic": 0xDEAD}, b"", "header magic 0xdead"),
    "cache words": ({"words": 2}, b"", "2 cache words"),
    "round number from the future": ({"round_no": 5}, b"", "round 5"),
    "requests over the limit": ({"payload_bytes": (1 << 30) + 1}, b"",
                                "announced 1073741825 bytes of requests"),
    "requests of length -1": ({"payload_bytes": 2**64 - 1}, b"",
                              "announced 18446744073709551615 bytes"),
    "requests that do not hash": ({"payload_hash": 12345}, _entry(),
                                  "do not hash as announced"),
    "name longer than what follows": ({}, hp.entry(b"t", hp.meta(shape=(4,)), name_len=200),
                                      "a name of 200 bytes with 1 left"),
    "name length 2**32-1": ({}, hp.entry(b"t", hp.meta(shape=(4,)), name_len=2**32 - 1),
                            "a name of 4294967295 bytes"),
    "name with a NUL": ({}, _entry(b"t\0u"), "a name of 3 bytes"),
    "empty name": ({}, _entry(b""), "a name of 0 bytes"),
    "name over the limit": ({}, _entry(b"n" * 4001), "a name of 4001 bytes"),
    "stray bytes": ({}, _entry() + b"xyz", "3 stray bytes after the last entry"),
    "dtype out of range": ({}, _entry(dtype=99), "is not supported by allreduce"),
    "op out of range": ({}, _entry(op=42), "unknown reduction op 42"),
    "kind out of range": ({}, _entry(kind=77), "unknown collective kind 77"),
    "nine dimensions": ({}, _entry(ndim=9), "9 dimensions"),
    "negative dimension": ({}, _entry(shape=(-4,)), "negative dimension -4"),
    "shape that overflows": ({}, _entry(shape=(2**40, 2**40)), "shape overflows"),
    "broadcast root out of range": ({}, _entry(kind="broadcast", root=7),
                                    "root rank 7 is out of range"),
    "scale factor NaN": ({}, _entry(prescale=math.nan), "scale factors must be finite"),
    "tune of the wrong length": ({}, _entry(kind="tune"), "tune carries 1 settings"),
    "refusal of an unknown kind": ({}, hp.entry(b"t", hp.meta(kind="refused", root=99)),
                                   "a refusal of kind 99"),
    "message to itself": ({}, _entry(kind="send", root=2, op=2), "not two distinct ranks"),
    "message from a rank out of range": ({}, _entry(kind="send", root=9, op=0),
                                         "not two distinct ranks"),
    "hang report far ahead": ({"report": (1 << 40) << 8 | 2}, b"", "hang report 1099511627776"),
    "hang report of no reason": ({"report": 1 << 8 | 7}, b"", "for reason 7"),
}


def _allreduce(comm):
    return comm.allreduce(np.arange(4.0) + comm.rank(), name="t")


def _assert_every_honest_rank_names(honest, cls, *fragments):
    for o in honest:
        assert isinstance(o.error, cls), f"rank {o.rank}: expected {cls.__name__}: {o}"
        for fragment in fragments:
            assert fragment in str(o.error), f"rank {o.rank}: {fragment!r} not in: {o.error}"


@pytest.mark.parametrize("case", list(FORGED_ROUNDS))
def test_a_forged_negotiation_record_breaks_every_honest_rank_naming_the_peer(case):
    """Two honest ranks call an allreduce; rank 2 answers their first round with a forged
    record: each honest rank refuses it, names rank 2, and returns nothing."""
    fields, payload, says = FORGED_ROUNDS[case]

    def hostile(peer):
        peer.play_round(hp.round_header(**{"round_no": 0, "payload": payload, **fields}),
                        payload)

    honest, _ = hp.run_with_hostile(_allreduce, hostile, size=3, timeout=TIMEOUT_S)
    _assert_every_honest_rank_names(honest, CommunicationError, "rank 2", says)


@pytest.mark.parametrize("cut", ["header", "requests"])
def test_a_frame_cut_short_breaks_every_honest_rank_naming_the_peer(cut):
    """Rank 2 sends half its record (or announces 200 bytes of requests and sends 50), then
    closes its end: the honest ranks, mid-read, name it instead of waiting."""
    def hostile(peer):
        peer.recv(0, hp.ROUND.size)  # the round began (rank 1 sends us its record later)
        whole = hp.round_header(0, b"x" * 200)
        for p in peer.socks:
            peer.send(p, whole[: hp.ROUND.size // 2] if cut == "header" else whole + b"x" * 50)

    honest, _ = hp.run_with_hostile(_allreduce, hostile, size=3, timeout=TIMEOUT_S)
    _assert_every_honest_rank_names(honest, CommunicationError, "connection to rank 2",
                                    "was closed")


def test_an_announced_gigabyte_of_requests_that_never_comes_fails_at_the_close():
    """The largest payload a round may announce (1 GiB): the honest ranks make room for it
    and wait for it, and fail naming rank 2 when it closes instead of sending it."""
    def hostile(peer):
        peer.play_round(hp.round_header(0, payload_bytes=1 << 30), b"x" * 1000,
                        read_payloads=False)

    honest, _ = hp.run_with_hostile(_allreduce, hostile, size=3, timeout=TIMEOUT_S)
    _assert_every_honest_rank_names(honest, CommunicationError, "connection to rank 2")


# ---------------------------------------------------------------- point-to-point entries

def test_a_forged_message_of_the_wrong_size_fails_the_receive_naming_the_sender():
    """Rank 0 receives 4 doubles from rank 1; the hostile rank 1 announces 5."""
    def honest(comm):
        return comm.recv(np.zeros(4), src=1, name="m")

    def hostile(peer):
        peer.serve(_entry(b"m (1->0)", kind="send", root=1, op=0, shape=(5,)))

    honest_out, _ = hp.run_with_hostile(honest, hostile, size=2, timeout=TIMEOUT_S)
    _assert_every_honest_rank_names(honest_out, MismatchError, "rank 1 sends [5]",
                                    "rank 0 receives into [4]")


def test_a_message_forged_between_two_honest_ranks_fails_both_ends_naming_the_forger():
    """Rank 0 sends its first unnamed message to rank 1; rank 2 posts that very message
    too: both ends refuse it and name rank 2, and no byte of it is taken for data."""
    def honest(comm):
        if comm.rank() == 0:
            return comm.send(np.arange(4.0), dst=1)
        return comm.recv(np.zeros(4), src=0)

    def hostile(peer):
        peer.serve(_entry(b"message #0 (0->1)", kind="send", root=0, op=1))

    honest_out, _ = hp.run_with_hostile(honest, hostile, size=3, timeout=TIMEOUT_S)
    _assert_every_honest_rank_names(honest_out, MismatchError, "rank 2 posted it too")


def test_a_message_under_another_name_times_out_naming_the_silent_sender():
    """Rank 0 waits for message 'm' from rank 1, which posts 'n' instead (a wrong tag is a
    message not sent yet): rank 0 gives up at its timeout naming rank 1, not later."""
    def honest(comm):
        return comm.recv(np.zeros(4), src=1, name="m")

    def hostile(peer):
        peer.serve(_entry(b"n (1->0)", kind="send", root=1, op=0))

    honest_out, _ = hp.run_with_hostile(honest, hostile, size=2, timeout=TIMEOUT_S,
                                        env={"RINGSYNC_TIMEOUT_SECONDS": "2"})
    _assert_every_honest_rank_names(honest_out, CommunicationTimeout, "for ranks [1]")


# ---------------------------------------------------------------- mutated recordings

def test_an_unmutated_replay_of_a_recorded_rank_gives_the_exact_result():
    """The fuzz below is only meaningful if a replay of the recording is a valid rank."""
    frame = hostile_fuzz.record(1)
    assert hostile_fuzz.replay(frame, 1, data_only=False) == "ok"


def _fuzz(seed, frames):
    """The mutated-frame loop in a child process under a deadline: a crash or a hang
    fails this test (with the seed) instead of taking pytest down."""
    try:
        done = subprocess.run([sys.executable, "-m", "tests.common.hostile_fuzz", "--seed",
                               str(seed), "--frames", str(frames)], capture_output=True,
                              text=True, timeout=600)
    except subprocess.TimeoutExpired as e:
        raise AssertionError(f"seed {seed}: the fuzz hung:\n{e.stdout}\n{e.stderr}")
    assert done.returncode == 0, f"seed {seed}: exit {done.returncode}\n{done.stdout}\n" \
                                 f"{done.stderr[-5000:]}"
    assert f"{frames} mutated frames" in done.stdout, done.stdout


def test_a_thousand_mutated_frames_each_fail_naming_the_peer_or_give_the_reference():
    _fuzz(seed=20261, frames=1000)


def test_ten_thousand_mutated_frames_each_fail_naming_the_peer_or_give_the_reference():
    _fuzz(seed=20262, frames=10000)
