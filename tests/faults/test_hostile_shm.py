"""A hostile authenticated peer on shared memory (reliability issue, item 2): the rings
between same-host ranks keep their counters in shared memory, which the peer writes. A
hostile rank 1 (tests/common/hostile_shm.py: it joins the shared-memory setup itself)
claims that its ring to rank 0 holds 2**40 bytes while rank 0 waits for 8 MiB, or that it
took 2**40 bytes of rank 0's ring before rank 0 sent any. Rank 0 must refuse the counters
naming rank 1, not copy past the ring (which read 6 MiB of other memory, or would crash).
Each case runs in a child process, so that a crash fails the test, not pytest."""
import subprocess
import sys

import pytest


@pytest.mark.parametrize("case", ["head", "tail"])
def test_forged_ring_counters_break_the_honest_rank_naming_the_peer(case):
    try:
        done = subprocess.run([sys.executable, "-m", "tests.common.hostile_shm", case],
                              capture_output=True, text=True, timeout=120)
    except subprocess.TimeoutExpired as e:
        raise AssertionError(f"{case}: hung:\n{e.stdout}\n{e.stderr}")
    assert done.returncode == 0, f"{case}: exit {done.returncode}\n{done.stdout[-5000:]}\n" \
                                 f"{done.stderr[-3000:]}"
