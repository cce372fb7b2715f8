"""A rank SIGKILLed in the middle of allreduces: under ULFM (which keeps the survivors
running) every survivor raises CommunicationError naming the lost rank, long before the
timeout, its pending asynchronous handles fail the same way, and nothing of the job is
left running. A rank that is merely slow times out.

These tests watch the job from outside (which ranks survived, what is left running), so
they start it with run_mpi and look at the result; the rank code is the function they
pass it."""
import os
import signal
import subprocess
import time

import numpy as np
import pytest

import ringsync as rs
from ringsync.testing import run_mpi
from tests.common.leaks import orphaned_segments

pytestmark = pytest.mark.requires_mpirun


def processes_matching(marker):
    return subprocess.run(["pgrep", "-f", marker], capture_output=True, text=True).stdout


def killed_peer_fails_the_others(marker, folder, victim, size=1 << 18):
    """Rank `victim` is SIGKILLed while every rank loops on allreduce; each survivor must
    raise CommunicationError naming the lost rank (not time out) and leave a file
    survivor-<rank> holding the message. `marker` only tags the ranks' command lines."""
    victim = int(victim)
    rs.init()
    data = np.ones(int(size), dtype=np.float32)
    for step in range(100_000):
        if rs.rank() == victim and step == 20:
            os.kill(os.getpid(), signal.SIGKILL)
        try:
            rs.allreduce_(data, op=rs.Average)
        except rs.CommunicationTimeout:
            raise
        except rs.CommunicationError as e:
            assert f"connection to rank {victim} (host" in str(e), str(e)
            with open(os.path.join(folder, f"survivor-{rs.rank()}"), "w") as f:
                f.write(str(e))
            break
    else:
        raise AssertionError("the victim never died")
    # The broken communicator refuses further work with the same kind of error.
    try:
        rs.allreduce_(data)
    except rs.CommunicationError:
        pass
    else:
        raise AssertionError("a broken communicator accepted another collective")
    rs.shutdown()
    os._exit(0)  # skip MPI_Finalize, which would wait for the dead rank


# Far beyond the tests' deadlines: only failure detection can pass them.
NO_TIMEOUT = {"RINGSYNC_TIMEOUT_SECONDS": "600"}


@pytest.mark.parametrize("victim", [0, 2])
def test_survivors_name_the_killed_rank(victim, tmp_path):
    orphans_before = set(orphaned_segments())
    marker = f"ringsync-kill-test-{os.getpid()}-{victim}"
    result = run_mpi(killed_peer_fails_the_others, np=4, timeout=90,
                     args=(marker, tmp_path, victim), mpirun_args=("--with-ft", "ulfm"),
                     env=NO_TIMEOUT)
    assert not result.timed_out, result.report()
    survivors = sorted(int(p.name.split("-")[1]) for p in tmp_path.glob("survivor-*"))
    assert survivors == [r for r in range(4) if r != victim], result.report()
    for path in tmp_path.glob("survivor-*"):
        message = path.read_text()
        assert f"connection to rank {victim} (host" in message, message
    leftover = processes_matching(marker)
    assert not leftover.strip(), f"processes left running: {leftover}"
    # Segments are unlinked once mapped: a killed rank leaves none behind. (Only segments
    # whose maker is gone count: other jobs on this machine may hold live ones.)
    leaked = set(orphaned_segments()) - orphans_before
    assert not leaked, f"segments left in /dev/shm: {sorted(leaked)}"


@pytest.mark.parametrize("size", [1 << 18, 3])
def test_ranks_with_no_connection_to_the_killed_rank_name_it(size, tmp_path):
    """8 ranks over TCP: a rank connects only to the peers its algorithms need (rank 0:
    1, 7 (the ring), 2, 4 (recursive doubling)), so when rank 5 dies, ranks 0, 2, 3 learn
    it from a peer's abort notice, whose report names it: every survivor names rank 5,
    for the ring's allreduce and for the small one (recursive doubling)."""
    victim = 5
    marker = f"ringsync-kill-test-{os.getpid()}-far-{size}"
    result = run_mpi(killed_peer_fails_the_others, np=8, timeout=120,
                     args=(marker, tmp_path, victim, size), mpirun_args=("--with-ft", "ulfm"),
                     env=dict(NO_TIMEOUT, RINGSYNC_TRANSPORT="tcp"))
    assert not result.timed_out, result.report()
    survivors = sorted(int(p.name.split("-")[1]) for p in tmp_path.glob("survivor-*"))
    assert survivors == [r for r in range(8) if r != victim], result.report()
    for path in tmp_path.glob("survivor-*"):
        message = path.read_text()
        assert f"connection to rank {victim} (host" in message, message
    assert not processes_matching(marker).strip()


def killed_peer_fails_jitted_steps(marker, folder, victim):
    """The same, with the allreduce inside a jitted JAX step (the core's XLA custom call):
    every survivor's step fails naming the lost rank, and none hangs."""
    import jax
    import jax.numpy as jnp
    import ringsync.jax as hvd
    victim = int(victim)
    hvd.init()
    step = jax.jit(lambda x: hvd.allreduce(x * 2.0, op=hvd.Sum))
    data = jnp.ones(1 << 16, dtype=jnp.float32)
    for i in range(100_000):
        if hvd.rank() == victim and i == 20:
            os.kill(os.getpid(), signal.SIGKILL)
        try:
            jax.block_until_ready(step(data))
        except Exception as e:  # JAX raises the custom call's failure as its own error
            assert "CommunicationError" in str(e) and f"connection to rank {victim} (host" \
                in str(e), str(e)
            with open(os.path.join(folder, f"survivor-{hvd.rank()}"), "w") as f:
                f.write(str(e))
            break
    else:
        raise AssertionError("the victim never died")
    hvd.shutdown()
    os._exit(0)  # skip MPI_Finalize, which would wait for the dead rank


def test_survivors_jitted_jax_steps_name_the_killed_rank(tmp_path):
    pytest.importorskip("jax")
    marker = f"ringsync-kill-jax-{os.getpid()}"
    result = run_mpi(killed_peer_fails_jitted_steps, np=3, timeout=120,
                     args=(marker, tmp_path, 1), mpirun_args=("--with-ft", "ulfm"),
                     env=dict(NO_TIMEOUT, JAX_PLATFORMS="cpu"))
    assert not result.timed_out, result.report()
    survivors = sorted(int(p.name.split("-")[1]) for p in tmp_path.glob("survivor-*"))
    assert survivors == [0, 2], result.report()
    assert not processes_matching(marker).strip()


def test_plain_mpirun_ends_the_job_when_a_rank_is_killed(tmp_path):
    """Without ULFM, mpirun itself ends the job: a failure, promptly, and no leftovers."""
    marker = f"ringsync-kill-plain-{os.getpid()}"
    result = run_mpi(killed_peer_fails_the_others, np=3, timeout=90,
                     args=(marker, tmp_path, 1), env=NO_TIMEOUT)
    assert not result.timed_out, result.report()
    assert result.returncode != 0, result.report()
    leftover = processes_matching(marker)
    assert not leftover.strip(), f"processes left running: {leftover}"


def killed_peer_fails_pending_handles(marker=""):
    """Rank `victim` dies while every rank has asynchronous allreduces outstanding: each
    survivor's pending handles, and any later one, fail promptly naming the lost rank."""
    victim = int(os.environ.get("RINGSYNC_TEST_VICTIM", "1"))
    folder = os.environ["RINGSYNC_TEST_DIR"]
    rs.init()
    for step in range(5):
        rs.allreduce(np.ones(1000), name=f"warm{step}")
    if rs.rank() == victim:
        os.kill(os.getpid(), signal.SIGKILL)
    failures = 0
    handles = []
    for i in range(20):  # submitting fails too once the engine has noticed
        try:
            handles.append(rs.allreduce_async(np.ones(50_000), name=f"pending{i}"))
        except rs.CommunicationError as e:
            assert f"rank {victim} (host" in str(e), str(e)
            failures += 1
    for h in handles:
        try:
            rs.synchronize(h)
        except rs.CommunicationError as e:
            assert f"rank {victim} (host" in str(e), str(e)
            failures += 1
    assert failures > 0, "every pending handle succeeded without the victim"
    try:
        rs.allreduce(np.ones(3), name="later")
    except rs.CommunicationError:
        pass
    else:
        raise AssertionError("a later handle succeeded after the peer died")
    with open(os.path.join(folder, f"survivor-{rs.rank()}"), "w") as f:
        f.write("ok")
    rs.shutdown()
    os._exit(0)  # skip MPI_Finalize, which would wait for the dead rank


@pytest.mark.parametrize("victim", [0, 1])
def test_killed_rank_fails_pending_handles(victim, tmp_path):
    marker = f"ringsync-engine-kill-{os.getpid()}-{victim}"
    result = run_mpi(killed_peer_fails_pending_handles, np=3, timeout=90,
                     args=(marker,), mpirun_args=("--with-ft", "ulfm"),
                     env={"RINGSYNC_TEST_DIR": str(tmp_path), "RINGSYNC_TEST_VICTIM": str(victim),
                          # Far beyond the deadline: only failure detection can pass.
                          "RINGSYNC_TIMEOUT_SECONDS": "600"})
    assert not result.timed_out, result.report()
    survivors = sorted(int(p.name.split("-")[1]) for p in tmp_path.glob("survivor-*"))
    assert survivors == [r for r in range(3) if r != victim], result.report()
    leftover = processes_matching(marker)
    assert not leftover.strip(), f"processes left running: {leftover}"


@pytest.mark.ranks(2, timeout=60)
def test_a_slow_peer_times_out_instead_of_hanging():
    """Rank 1 arrives long after RINGSYNC_TIMEOUT_SECONDS: rank 0 gives up with a timeout
    naming rank 1, and rank 1 then learns that rank 0 gave up, instead of waiting."""
    os.environ["RINGSYNC_TIMEOUT_SECONDS"] = "1.5"
    rs.init()
    if rs.rank() == 1:
        time.sleep(5)
    try:
        rs.allreduce(np.ones(10))
    except rs.CommunicationTimeout as e:
        assert rs.rank() == 0, f"rank {rs.rank()} timed out: {e}"
        assert "waited" in str(e) and "for ranks [1] to submit it" in str(e), str(e)
    except rs.CommunicationError as e:
        assert rs.rank() == 1, f"rank {rs.rank()}: {e}"
        assert "rank 0 (host" in str(e) and "aborted" in str(e), str(e)
    else:
        raise AssertionError(f"rank {rs.rank()}: allreduce finished despite the timeout")
    rs.shutdown()
