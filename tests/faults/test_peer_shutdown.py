"""A rank that shuts down (finishes early, or leaves through sys.exit or an exception) while
its peers still wait in collectives with it: the peers' calls fail at once with a
CommunicationError naming it (Horovod's "Horovod has been shut down"), instead of both
sides waiting for each other (its shutdown for them, they for its collective) until a
timeout. Ranks that shut down at different times, with nothing pending, still end
cleanly. The rank code watched from outside lives here (run_mpi)."""
import os
import time

import numpy as np
import pytest

import ringsync as rs
from ringsync.testing import run_mpi

pytestmark = pytest.mark.requires_mpirun

DEADLINE = 90  # no RINGSYNC_TIMEOUT_SECONDS: only the answer to the shutdown ends the wait


def leave_early_while_peer_waits(folder, how):
    """Rank 0 leaves at once (sys.exit(3) or shutdown()); rank 1 waits in a collective
    (`how`) and writes what it got to peer-error."""
    rs.init()
    if rs.rank() == 0:
        rs.shutdown()
        if how != "shutdown":
            # What sys.exit(3) does in a script: ringsync's atexit handler shuts down,
            # then the process exits 3. (Here, inside run_mpi's worker, a SystemExit
            # would count as a failed rank and skip the handler, so both are spelled out.)
            os._exit(3)
        return
    calls = {
        "barrier": rs.barrier,
        "allreduce": lambda: rs.allreduce(np.arange(3.0), name="waits"),
        "async": lambda: rs.synchronize(rs.allreduce_async(np.arange(3.0), name="waits")),
    }
    try:
        calls[how if how in calls else "barrier"]()
    except rs.CommunicationError as exc:
        with open(os.path.join(folder, "peer-error"), "w") as f:
            f.write(str(exc))
        try:  # every later call fails the same way, at once
            rs.allreduce(np.ones(2))
        except rs.CommunicationError as later:
            with open(os.path.join(folder, "later-error"), "w") as f:
                f.write(str(later))
        rs.shutdown()  # returns: the peer's shutdown is over
        return
    raise AssertionError("the collective completed without rank 0")


@pytest.mark.parametrize("how,env", [
    ("barrier", {}), ("allreduce", {"RINGSYNC_TRANSPORT": "tcp"}), ("async", {}),
    ("shutdown", {}),
], ids=["exit-vs-lane-barrier", "exit-vs-engine-allreduce", "exit-vs-async", "shutdown"])
def test_a_rank_that_leaves_fails_its_peers_calls_naming_it(tmp_path, how, env):
    result = run_mpi(leave_early_while_peer_waits, np=2, timeout=DEADLINE,
                     args=(tmp_path, how), env=env)
    assert not result.timed_out, result.report()
    for name in ("peer-error", "later-error"):
        text = (tmp_path / name).read_text()
        assert "rank 0 has shut down" in text, (name, text, result.report())
    if how != "shutdown":
        assert result.returncode != 0, result.report()  # rank 0's exit status 3


def finish_at_different_times():
    """Rank r works r seconds longer than rank 0 before it shuts down: nothing pending,
    so every rank ends cleanly."""
    rs.init()
    got = rs.allreduce(np.full(4, rs.rank() + 1.0), op=rs.Sum)
    assert np.all(got == sum(r + 1 for r in range(rs.size())))
    time.sleep(rs.rank())
    rs.shutdown()


def test_ranks_that_shut_down_at_different_times_end_cleanly():
    result = run_mpi(finish_at_different_times, np=3, timeout=DEADLINE)
    assert result.ok, result.report()
