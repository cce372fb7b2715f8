"""Shared memory that cannot be had, and segments left by killed ranks (issue item 8).

Each job runs in a private mount namespace whose /dev/shm is a tmpfs of a few MiB, as in a
container (Docker gives 64 MiB). Where the ranks' segments do not fit, init() must notice
at once (reserving the pages, not a SIGBUS later), and the host's ranks must agree: all
fall back to TCP with a warning, or, with RINGSYNC_TRANSPORT=shm, all fail init() with a
message that says why. Segments of dead jobs found in /dev/shm are removed by the next
job; nothing of a job itself is left. Results are checked against numpy references.

Needs root (mount) and unshare; skipped otherwise.

The tests run mpirun inside a private mount namespace and look at the job's output and at
/dev/shm afterwards, so each starts the job with run_mpi; the rank code is the
module-level functions below (collectives_over, forced_shm_fails, split_hosts).
"""
import os
import shutil
import subprocess

import numpy as np
import pytest

import ringsync as rs
import ringsync.testing as testing

from tests.common.reference import assert_reduced, rank_input

pytestmark = pytest.mark.requires_mpirun

# Keeps Open MPI's own shared-memory transport out of the tiny /dev/shm (it would only
# warn and use TCP, but its warning would muddle the output).
MPIRUN_ARGS = ("--mca", "btl", "self,tcp")
JOB_TIMEOUT_S = 150
SETTINGS = {"RINGSYNC_TIMEOUT_SECONDS": "60"}
JOB_ID = "00c0ffee00c0ffee"  # the public job id part of a segment name: any 16 hex digits

# Runs in the new mount namespace: mounts the tmpfs, places the segments the test asks
# for (one held with a shared lock, as a live creator in another pid namespace would),
# runs mpirun without that lock, then lists what /dev/shm holds for the test to check.
WRAPPER_SCRIPT = r'''
mount -t tmpfs -o size="$RS_SHM_SIZE" tmpfs /dev/shm || exit 97
for f in $RS_SHM_PLACE $RS_SHM_LOCKED; do head -c 8192 /dev/zero > "/dev/shm/$f" || exit 98; done
if [ -n "$RS_SHM_LOCKED" ]; then exec 9< "/dev/shm/$RS_SHM_LOCKED" && flock -s 9 || exit 99; fi
"$@" 9<&-
rc=$?
ls -A /dev/shm > "$RS_SHM_LIST"
exit $rc
'''


@pytest.fixture(scope="module")
def private_shm():
    """Skips unless a private tmpfs can be mounted on /dev/shm (root, unshare, mount)."""
    if os.geteuid() != 0:
        pytest.skip("mounting a private /dev/shm needs root")
    for tool in ("unshare", "mount", "flock", "sh"):
        if shutil.which(tool) is None:
            pytest.skip(f"{tool} is not installed")
    probe = subprocess.run(["unshare", "-m", "sh", "-c", "mount -t tmpfs -o size=1m tmpfs /dev/shm"],
                           capture_output=True, text=True, timeout=30)
    if probe.returncode != 0:
        pytest.skip(f"cannot mount a private /dev/shm: {probe.stderr.strip()}")


def run_in_tiny_shm(tmp_path, size, target, np, args=(), env=None, place=(),
                    locked=""):
    """run_mpi with mpirun inside `unshare -m` and a /dev/shm of `size`; returns the
    result and the names /dev/shm held after the job."""
    listing = tmp_path / "dev-shm-after"
    wrapper = ["unshare", "-m", "sh", "-c", WRAPPER_SCRIPT, "sh"]
    result = testing.run_mpi(
        target, np=np, timeout=JOB_TIMEOUT_S, args=args, mpirun_args=MPIRUN_ARGS, wrapper=wrapper,
        env={**SETTINGS, **(env or {}), "RS_SHM_SIZE": size, "RS_SHM_PLACE": " ".join(place),
             "RS_SHM_LOCKED": locked, "RS_SHM_LIST": str(listing)})
    assert not result.timed_out, result.report()
    assert "Bus error" not in result.output and "SIGBUS" not in result.output, result.report()
    assert listing.exists(), "the wrapper did not list /dev/shm\n" + result.report()
    return result, listing.read_text().split()


def ringsync_segments(names):
    return [n for n in names if n.startswith("ringsync-")]


def dead_pid():
    child = subprocess.Popen(["true"])
    child.wait()
    with pytest.raises(ProcessLookupError):
        os.kill(child.pid, 0)
    return child.pid


# --------------------------------------------------------------------------- rank side
# Results are checked against numpy references built from every rank's input.

# Through the lane (one round), beyond it (staged or ring), and past a 2 MiB ring.
SIZES = [1, 1009, 100_003, (1 << 20) + 7]


def _inputs(shape, dtype, op, salt):
    return [rank_input(r, shape, dtype, op, salt) for r in range(rs.size())]


def _check_collectives():
    for n in SIZES:
        for dtype, op in [("float32", "Sum"), ("int64", "Max"), ("float64", "Average")]:
            inputs = _inputs((n,), dtype, op, "shm-limits")
            what = f"allreduce {op} {dtype} n={n} on {rs.size()} ranks"
            assert_reduced(rs.allreduce(inputs[rs.rank()], op=getattr(rs, op), name=what),
                           inputs, op, what=what)
        rows = [(r * 7 + n) % 11 for r in range(rs.size())]
        parts = [rank_input(r, (rows[r], 3), "float64", salt=f"ag{n}") for r in range(rs.size())]
        got = rs.allgather(parts[rs.rank()])
        assert np.array_equal(got, np.concatenate(parts)), f"allgather rows {rows}"
    # More than a 2 MiB ring from each rank: every page of the rings gets touched.
    big = _inputs((600_001,), "float64", "Sum", "big")
    assert np.array_equal(rs.allgather(big[rs.rank()]), np.concatenate(big)), "big allgather"


def collectives_over(transport):
    """init() picks `transport` ("shm" or "tcp"); every collective still gives the
    reference results."""
    rs.init()
    _check_collectives()  # first: where pages cannot be had, this is where SIGBUS would strike
    assert rs._comm().transport == transport, (rs._comm().transport, transport)
    rs.shutdown()


def forced_shm_fails():
    """RINGSYNC_TRANSPORT=shm where the segments do not fit: init() fails on every rank
    with a message that says why and how to avoid it (no SIGBUS, no hang)."""
    try:
        rs.init()
    except rs.RingsyncError as e:
        text = str(e)
        for part in ("RINGSYNC_TRANSPORT=shm, but shared memory", "/dev/shm:", "MiB free",
                     "RINGSYNC_TRANSPORT=tcp avoids it", "cannot reserve"):
            assert part in text, f"{part!r} not in {text!r}"
        print(f"init failed as expected: {text}", flush=True)
    else:
        raise AssertionError(f"init() succeeded over {rs._comm().transport} without room in /dev/shm")
    assert not rs.is_initialized()


def split_hosts(first_host_ranks):
    """Ranks below `first_host_ranks` report host "node-a", the others "node-b" (all on
    this machine, sharing its /dev/shm): same-"host" ranks must get shared memory."""
    import os

    from mpi4py import MPI
    k = int(first_host_ranks)
    os.environ["RINGSYNC_HOST_NAME"] = "node-a" if MPI.COMM_WORLD.rank < k else "node-b"
    rs.init()
    local = k if MPI.COMM_WORLD.rank < k else MPI.COMM_WORLD.size - k
    assert rs.local_size() == local, (rs.local_size(), local)
    _check_collectives()
    expected = "shm" if local > 1 else "tcp"
    assert rs._comm().transport == expected, (rs._comm().transport, expected)
    rs.shutdown()


# --------------------------------------------------------------------------- tests

# Segments: 3.0 MiB each for 2 ranks, 5.0 for 3. In 1 MiB none fits (before reserving,
# ranks died of SIGBUS there); in the others one fits (the first rank to reserve gets
# it), the others' do not: the ranks that had room must follow the ones that had none.
@pytest.mark.parametrize("np,size", [(2, "1m"), (2, "4m"), (3, "8m")])
def test_auto_falls_back_to_tcp_on_every_rank(np, size, private_shm, tmp_path):
    result, after = run_in_tiny_shm(tmp_path, size, collectives_over, np, args=("tcp",))
    assert result.ok, result.report()
    warnings = [line for line in result.output.splitlines()
                if "shared memory unavailable" in line and "using TCP with same-host peers" in line]
    assert len(warnings) == np, "expected one warning per rank\n" + result.report()
    assert any("cannot reserve" in line and "/dev/shm:" in line for line in warnings), warnings
    assert ringsync_segments(after) == [], after


def test_required_shm_fails_init_on_every_rank(private_shm, tmp_path):
    result, after = run_in_tiny_shm(tmp_path, "1m", forced_shm_fails, 2,
                                    env={"RINGSYNC_TRANSPORT": "shm"})
    assert result.ok, result.report()  # each rank checked its own error message
    assert result.output.count("init failed as expected") == 2, result.report()
    assert ringsync_segments(after) == [], after


def test_segments_are_sized_by_local_ranks(private_shm, tmp_path):
    """Ranks 0-1 on "node-a", rank 2 on "node-b", all on this machine: node-a's two
    segments hold one ring each (6.0 MiB together) and fit in 9 MiB, where rings for every
    rank of the world (14 MiB) would not."""
    result, after = run_in_tiny_shm(tmp_path, "9m", split_hosts, 3, args=("2",))
    assert result.ok, result.report()
    assert "shared memory unavailable" not in result.output, result.report()
    assert ringsync_segments(after) == [], after


def test_orphans_of_dead_creators_are_removed(private_shm, tmp_path):
    dead, live = dead_pid(), os.getpid()
    orphan = f"ringsync-{JOB_ID}-0-{dead}"
    kept = [f"ringsync-{JOB_ID}-1-{live}",  # its creator lives (mid-setup, perhaps)
            f"ringsync-{JOB_ID}-2",  # not a name of ours (an older version's)
            "ringsync-notes"]
    locked = f"ringsync-{JOB_ID}-3-{dead}"  # locked: alive in another pid namespace
    result, after = run_in_tiny_shm(tmp_path, "16m", collectives_over, 2,
                                    args=("shm",), place=[orphan] + kept, locked=locked)
    assert result.ok, result.report()
    assert orphan not in after, after
    assert sorted(ringsync_segments(after)) == sorted(kept + [locked]), after
