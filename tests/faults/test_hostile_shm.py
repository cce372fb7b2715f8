"""A hostile authenticated peer on shared memory (reliability issue, item 2): the rings
between same-host ranks keep their counters in shared memory, which the peer writes. A
hostile rank 1 (tests/common/hostile_shm.py: it joins the shared-memory setup itself)
claims that its ring to rank 0 holds 2**40 bytes while rank 0 waits for 8 MiB, or that it
took 2**40 bytes of rank 0's ring before rank 0 sent any. Rank 0 must refuse the counters
naming rank 1, not copy past the ring (which read 6 MiB of other memory, or would crash).
Each case runs in a child process, so that a crash fails the test, not pytest.

The same rank also forges its posts on the same-host lane (native/src/lane.c), where rank
0's blocking allreduces meet it in shared memory: metadata no honest rank posts, flags no
honest rank posts, and sequence or `reduced` words no honest rank can hold while rank 0
waits break the communicator (CommunicationError naming rank 1, not a timeout); well-formed
metadata or a name that disagrees with rank 0's is a MismatchError naming rank 1, after which
rank 0's next call (answered honestly) gives the exact sum; the post's size field is never
read (rank 0 sizes everything from its own metadata), so forging it changes nothing. All the
lane cases run in one child process (tests/common/hostile_shm.py lane), each a job of its
own with a deadline; the tests below judge what rank 0 got in each."""
import json
import subprocess
import sys

import numpy as np
import pytest

from tests.common import hostile_shm as hs


@pytest.mark.parametrize("case", ["head", "tail"])
def test_forged_ring_counters_break_the_honest_rank_naming_the_peer(case):
    try:
        done = subprocess.run([sys.executable, "-m", "tests.common.hostile_shm", case],
                              capture_output=True, text=True, timeout=120)
    except subprocess.TimeoutExpired as e:
        raise AssertionError(f"{case}: hung:\n{e.stdout}\n{e.stderr}")
    assert done.returncode == 0, f"{case}: exit {done.returncode}\n{done.stdout[-5000:]}\n" \
                                 f"{done.stderr[-3000:]}"


# case: what rank 0's CommunicationError says (after "rank 1")
BROKEN = {
    "dtype out of range": "malformed post on the shared-memory lane from rank 1 (dtype unknown",
    "op out of range": "from rank 1 (unknown reduction op 42)",
    "kind out of range": "from rank 1 (unknown collective kind 77)",
    "nine dimensions": "from rank 1 (9 dimensions",
    "ndim -1": "from rank 1 (-1 dimensions",
    "negative dimension": "from rank 1 (negative dimension -5",
    "shape over 2**60 bytes": "from rank 1 (288230376151711744 elements of float64 are more",
    "shape that overflows": "from rank 1 (shape overflows",
    "scale factor NaN": "from rank 1 (scale factors must be finite",
    "refusal of an unknown kind": "from rank 1 (a refusal of kind 99",
    "flags 16": "from rank 1 (flags 16)",
    "flags -1": "from rank 1 (flags -1)",
    "sequence from the future": "rank 1's sequence word on the shared-memory lane says "
                                "operation 3 where this rank waits for operation 1",
    "sequence of the other slot": "rank 1's sequence word on the shared-memory lane says "
                                  "operation 2 where",
    "sequence 2**64-1": "says operation 18446744073709551615 where",
    "staged, reduced word from the future": "rank 1's reduced word on the shared-memory lane "
                                            "says operation 4 where this rank waits for "
                                            "operation 2",
    "staged, reduced word of the other slot": "rank 1's reduced word on the shared-memory lane "
                                              "says operation 3 where",
}

# case: what rank 0's MismatchError says (the forged post is well formed, but not rank 0's)
MISMATCHED = {
    "shape larger than the segment": "rank 0 sent [5], rank 1 sent [1099511627776]",
    "dtype float32": "rank 0 sent float64, rank 1 sent float32",
    "op Max": "rank 0 sent Sum, rank 1 sent Max",
    "name without a NUL": "rank 1 called allreduce '" + "t" * 100,
    "name hash forged": "rank 0 called allreduce 't', rank 1 called allreduce 't'",
    # (bytes that are not UTF-8, quoted as U+FFFD)
    "name not UTF-8": "rank 1 called allreduce 't\ufffdt\ufffd",
    "refusal without a NUL": "was refused on rank 1: " + "\ufffd" * 100,
}

# Forged fields that rank 0 never reads, and the honest staged protocol (the control for the
# forged `reduced` words): the exact sum of both ranks' inputs
EXACT = ["size field 2**64-1", "size field larger than the segment", "staged, played honestly"]


@pytest.fixture(scope="module")
def lane_outcomes():
    """Every lane case, run in one child process: rank 0's outcome per case."""
    try:
        done = subprocess.run([sys.executable, "-m", "tests.common.hostile_shm", "lane"],
                              capture_output=True, text=True, timeout=600)
    except subprocess.TimeoutExpired as e:
        raise AssertionError(f"the lane cases hung:\n{e.stdout}\n{e.stderr}")
    outcomes = {}
    for line in done.stdout.splitlines():
        outcome = json.loads(line)
        outcomes[outcome["case"]] = outcome
    return outcomes, f"exit {done.returncode}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"


def _outcome(lane_outcomes, case):
    outcomes, output = lane_outcomes
    assert case in outcomes, f"{case}: no outcome (a crash?): {output}"
    assert "hung" not in outcomes[case], outcomes[case]["hung"]
    return outcomes[case]


def test_every_lane_case_is_judged():
    assert {*BROKEN, *MISMATCHED, *EXACT} == set(hs.LANE_CASES)


@pytest.mark.parametrize("case", BROKEN)
def test_forged_lane_post_breaks_the_honest_rank_naming_the_peer(lane_outcomes, case):
    o = _outcome(lane_outcomes, case)
    # (exactly CommunicationError: a CommunicationTimeout would mean rank 0 waited it out)
    assert o.get("error") == "CommunicationError", o
    assert BROKEN[case] in o["text"], o["text"]
    assert "the communicator is broken" in o["text"], o["text"]


@pytest.mark.parametrize("case", MISMATCHED)
def test_disagreeing_lane_post_is_a_mismatch_and_the_next_call_works(lane_outcomes, case):
    o = _outcome(lane_outcomes, case)
    assert o.get("mismatch") and MISMATCHED[case] in o["mismatch"], o
    np.testing.assert_array_equal(o["second"], hs.honest_input(1) + hs.hostile_input(1))


@pytest.mark.parametrize("case", EXACT)
def test_lane_post_fields_never_read_leave_the_sum_exact(lane_outcomes, case):
    o = _outcome(lane_outcomes, case)
    assert o.get("mismatch") is None and o.get("error") is None, o
    np.testing.assert_array_equal(o["first"], hs.honest_input(0) + hs.hostile_input(0))
