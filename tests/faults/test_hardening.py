"""Careless and hostile input from the Python side never corrupts memory, returns wrong
numbers or stalls the job (issue: hardening): dropped handles, settings that differ by
rank, sizes that overflow, bad names and scale factors, a planted timeline symlink, one
rank running out of memory mid-collective. Each test reproduces the bad input.

Every test runs on several ranks (@pytest.mark.ranks): its body is what each rank does."""
import gc
import os
import time
import resource

import numpy as np
import pytest

import ringsync as rs

from tests.common.reference import assert_reduced, rank_input

# Defaults for every test here; a test's own marker adds the rank count.
pytestmark = pytest.mark.ranks(timeout=120, env={"RINGSYNC_TIMEOUT_SECONDS": "60"})

BIG = 16 << 20  # float32 elements: 64 MiB per array


def _expect(cls, fragment, fn, *args, **kwargs):
    try:
        fn(*args, **kwargs)
    except cls as e:
        assert fragment in str(e), f"rank {rs.rank()}: expected {fragment!r} in: {e}"
        return e
    raise AssertionError(f"rank {rs.rank()}: no {cls.__name__} for {fragment!r}")


def _next_call_works(tag):
    inputs = [rank_input(r, (1000,), "float64", "Sum", tag) for r in range(rs.size())]
    assert_reduced(rs.allreduce(inputs[rs.rank()], op=rs.Sum, name=tag), inputs, "Sum", what=tag)


def _world_rank():
    from mpi4py import MPI
    return MPI.COMM_WORLD.Get_rank()


# ---------------------------------------------------------------- dropped handles

@pytest.mark.ranks(2, timeout=240)
@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_dropped_handles_keep_their_buffers(transport):
    """Rank 1 drops its pending handles (64 MiB in and out) at once and reuses the memory;
    every rank's results and rank 1's new arrays must stay right."""
    os.environ["RINGSYNC_TRANSPORT"] = transport  # read by init()
    rs.init()
    assert rs._comm().transport == transport
    me, size = rs.rank(), rs.size()
    for step in range(3):
        inputs = [rank_input(r, (BIG,), "float32", "Sum", f"d{step}") for r in range(size)]
        handle = rs.allreduce_async(inputs[me], op=rs.Sum, name=f"dropped.{step}")
        if me == 1:
            del inputs, handle  # nothing of ours refers to the buffers any more
            gc.collect()
            fresh = [np.full(BIG, 7.0, np.float32) for _ in range(3)]  # likely the same pages
        else:
            assert_reduced(rs.synchronize(handle), inputs, "Sum", what=f"kept handle {step}")
        _next_call_works(f"after.{step}")
        if me == 1:
            for a in fresh:
                assert np.all(a == 7.0), f"step {step}: an array reused after a dropped handle " \
                                         "was overwritten"
    # In place, with a strided numpy view staged through a copy.
    base = np.arange(2 * 1000, dtype=np.float64).reshape(1000, 2) + me
    handle = rs.allreduce_async(base[:, 0], op=rs.Sum, name="strided")
    del handle
    _next_call_works("after.strided")
    # Submissions free what finished dropped handles held (the calls above did); the last
    # one may still be running on the engine (blocking calls pass it on the lane), so the
    # same sweep is repeated here, locally, until the engine has finished it.
    submitter = rs._comm()._submitter
    deadline = time.monotonic() + 30
    while submitter.orphans and time.monotonic() < deadline:
        submitter.release_finished_orphans()
        time.sleep(0.05)
    assert len(submitter.orphans) == 0, \
        f"rank {me}: {len(submitter.orphans)} dropped handles still held"
    rs.shutdown()


@pytest.mark.ranks(2, timeout=240)
def test_dropped_torch_handles_keep_their_host_copies():
    torch = pytest.importorskip("torch")

    import ringsync.torch as hvd
    hvd.init()
    me, size = hvd.rank(), hvd.size()
    for step in range(2):
        arrays = [rank_input(r, (BIG // 2, 2), "float32", "Sum", f"t{step}") for r in range(size)]
        inputs = [torch.from_numpy(a.copy()) for a in arrays]
        # A transposed view is not contiguous: the adapter stages it through a host copy.
        handle = hvd.allreduce_async_(inputs[me].t(), op=hvd.Sum, name=f"torch.dropped.{step}")
        if me == 1:
            del handle
            gc.collect()
            fresh = [torch.full((BIG,), 3.0) for _ in range(3)]
        else:
            got = hvd.synchronize(handle).t().numpy()
            assert_reduced(got, arrays, "Sum", what=f"torch step {step}")
        _next_call_works(f"torch.after.{step}")
        if me == 1:
            assert all(bool(torch.all(f == 3.0)) for f in fresh), "staged copy reused too early"
    hvd.shutdown()


# ---------------------------------------------------------------- settings

@pytest.mark.ranks(3)
@pytest.mark.parametrize("variable,value", [
    ("FUSION_THRESHOLD", "4096"), ("CACHE_CAPACITY", "16"), ("SMALL_ALLREDUCE_BYTES", "0"),
    ("STAGED_BYTES", "0"), ("TRANSPORT", "tcp"), ("LANE_BYTES", "0"),
])
def test_ranks_with_different_settings_fail_init(variable, value):
    """Rank 1 alone has RINGSYNC_<variable>=value: init() fails on every rank naming it;
    with the setting removed, the next init() works."""
    if _world_rank() == 1:
        os.environ["RINGSYNC_" + variable] = value
    e = _expect(rs.UsageError, f"RINGSYNC_{variable} is", rs.init)
    assert "on rank 1" in str(e) and repr(value) in str(e).replace('"', "'") or \
        value in str(e), str(e)
    os.environ.pop("RINGSYNC_" + variable, None)
    rs.init()
    _next_call_works("settings")
    rs.shutdown()


@pytest.mark.ranks(3)
def test_a_bad_setting_on_one_rank_fails_init_everywhere():
    """Rank 2 alone has an unreadable setting: every rank's init() fails naming it (none
    waits for rank 2 in the rendezvous); without it, the next init() works."""
    if _world_rank() == 2:
        os.environ["RINGSYNC_FUSION_THRESHOLD"] = "lots"
    _expect(rs.UsageError, "rank 2: RINGSYNC_FUSION_THRESHOLD='lots' is not a whole number",
            rs.init)
    os.environ.pop("RINGSYNC_FUSION_THRESHOLD", None)
    rs.init()
    _next_call_works("bad setting")
    rs.shutdown()


@pytest.mark.ranks(2)
def test_per_rank_settings_may_differ():
    me = _world_rank()
    os.environ["RINGSYNC_SPIN_US"] = str(me * 7)
    os.environ["RINGSYNC_STALL_CHECK_SECONDS"] = str(30 + me)
    rs.init()
    _next_call_works("per-rank")
    rs.shutdown()


# ---------------------------------------------------------------- sizes, names, factors

def _raw_submit(kind, dtype, shape, buffer, splits=None):
    """Submit a request straight to the engine (a 1-byte buffer, whatever the shape claims)."""
    from ringsync._native import ffi, lib
    engine = rs._comm()._ring.engine
    req = ffi.new("rs_request_t *")
    req.kind, req.dtype, req.ndim, req.start_now = kind, dtype, len(shape), 1
    req.shape[0:len(shape)] = list(shape)
    req.sendbuf = req.recvbuf = ffi.from_buffer(buffer)
    keep = None
    if splits is not None:
        keep = ffi.new("int64_t[]", splits)
        req.splits = keep
    name = ffi.new("char[]", f"raw.{kind}.{shape}".encode())
    ids = ffi.new("int64_t[1]")
    status = lib.rs_engine_submit(engine, ffi.new("const char *[1]", [name]), req, 1, ids)
    if status != lib.RS_OK:
        return status, ffi.string(lib.rs_engine_last_error(engine)).decode()
    done = ffi.new("int *")
    while not done[0]:
        status = lib.rs_engine_wait(engine, ids[0], 1.0, done)
    text = ffi.string(lib.rs_engine_handle_error(engine, ids[0])).decode()
    lib.rs_engine_release(engine, ids[0])
    return status, text


@pytest.mark.ranks([1, 2, 3])
def test_overflowing_sizes_are_usage_errors():
    from ringsync._native import lib
    rs.init()
    size = rs.size()
    one = np.zeros(1, np.uint8)
    # alltoall splits whose int64 sum wraps, on a 0-row tensor: refused before any copy.
    _expect(rs.UsageError, "overflow", rs.alltoall, np.zeros((0, 4), np.float32),
            splits=[2**62] * size)
    _next_call_works("splits")
    status, text = _raw_submit(lib.RS_KIND_ALLTOALL, lib.RS_UINT8, [0], one,
                               splits=[2**62] * size)
    assert status == lib.RS_ERR_USAGE and "overflow" in text, (status, text)
    # rows * row elements beyond what any buffer can hold.
    status, text = _raw_submit(lib.RS_KIND_ALLREDUCE, lib.RS_FLOAT32, [2**40, 2**40], one)
    assert status == lib.RS_ERR_USAGE and "overflows" in text, (status, text)
    status, text = _raw_submit(lib.RS_KIND_ALLREDUCE, lib.RS_INT64, [2**59], one)
    assert status == lib.RS_ERR_USAGE and "more than" in text, (status, text)
    _next_call_works("shape")
    if size > 1:
        # Each rank's rows fit; their sum does not: every rank fails alike, nothing is copied.
        status, text = _raw_submit(lib.RS_KIND_ALLGATHER, lib.RS_UINT8, [2**60 - 1], one)
        assert status == lib.RS_ERR_USAGE and "add up to more than" in text, (status, text)
    _next_call_works("gather")
    rs.shutdown()


@pytest.mark.ranks([1, 2])
def test_bad_names_and_scale_factors():
    rs.init()
    x = np.arange(5.0)
    _expect(rs.UsageError, "NUL", rs.allreduce, x, name="grad\0w")
    _next_call_works("nul")
    _expect(rs.UsageError, "1 to 4000 characters", rs.allreduce, x, name="n" * 4001)
    _next_call_works("long")
    for bad in (float("nan"), float("inf")):
        _expect(rs.UsageError, "scale factors must be finite", rs.allreduce, x,
                prescale_factor=bad)
        _expect(rs.UsageError, "scale factors must be finite", rs.allreduce_async, x,
                postscale_factor=bad)
        _next_call_works(f"scale.{bad}")
    # Long names that differ only near the end are different tensors on every path.
    name = "layer." * 600 + ("a" if rs.rank() == 0 else "b")
    if rs.size() > 1:
        e = _expect(rs.UsageError, "Mismatched", rs.allreduce, x, name=name)
        assert name[-50:] in str(e) or "blocking" in str(e), str(e)
    _next_call_works("long names")
    rs.shutdown()


@pytest.mark.ranks(2)
def test_timeline_refuses_a_planted_symlink(tmp_path):
    rs.init()
    target = tmp_path / f"victim-{rs.rank()}.txt"
    target.write_text("precious")
    link = tmp_path / f"timeline-{rs.rank()}.json"
    os.symlink(target, link)
    _expect(rs.UsageError, "symbolic link", rs.start_timeline, str(link))
    assert target.read_text() == "precious"
    ok = tmp_path / f"real-{rs.rank()}.json"
    rs.start_timeline(str(ok))
    _next_call_works("timeline")
    rs.stop_timeline()
    assert ok.stat().st_size > 0
    rs.shutdown()


# ---------------------------------------------------------------- a rank out of memory

@pytest.mark.ranks(3, timeout=180)
@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_one_rank_out_of_memory_breaks_the_ring_everywhere(transport):
    """The victim (rank 1) cannot allocate the fusion buffer mid-collective: every rank
    must get a CommunicationError (never a result), and nothing hangs."""
    victim = 1
    os.environ["RINGSYNC_TRANSPORT"] = transport  # read by init()
    rs.init()
    assert rs._comm().transport == transport
    me, size = rs.rank(), rs.size()
    n = 8 << 20  # two float32 tensors of 32 MiB: a 64 MiB fusion buffer
    inputs = [[rank_input(r, (n,), "float32", "Sum", f"oom{i}") for r in range(size)]
              for i in range(2)]
    mine = [inputs[i][me].copy() for i in range(2)]
    _next_call_works("warm-up")
    if me == victim:
        with open("/proc/self/status") as f:
            vm = next(int(line.split()[1]) for line in f if line.startswith("VmSize:")) * 1024
        resource.setrlimit(resource.RLIMIT_AS, (vm + (24 << 20), resource.RLIM_INFINITY))
    # A group always fuses: the victim must allocate the 64 MiB fusion buffer mid-collective.
    handle = rs.grouped_allreduce_async_(mine, op=rs.Sum, name="oom")
    failures, results = [], []
    try:
        results = list(enumerate(rs.synchronize(handle)))
    except rs.CommunicationError as e:
        failures.append(str(e))
    if me == victim:
        # Lifted before the results are checked: the check needs memory of its own.
        resource.setrlimit(resource.RLIMIT_AS, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
    for i, got in results:
        # A result is acceptable only if it is right (the victim's limit might not bite).
        assert_reduced(got, inputs[i], "Sum", what=f"oom tensor {i}")
    assert failures, f"rank {me}: the victim's allocation failure was not reported"
    if me == victim:
        assert any("out of memory" in f or "cannot allocate" in f for f in failures), failures
    # The ring is broken everywhere: the next call fails too, promptly. (The marker's
    # check that every rank finished ok shows that every rank got this far.)
    _expect(rs.CommunicationError, "", rs.allreduce, np.ones(3))
    rs._comm().abort("test over")
