"""One-process checks: errors before init, the reduction kernels against numpy, settings,
and the topology arithmetic."""
import numpy as np
import pytest

import ringsync as rs
from ringsync import bootstrap
from ringsync._core import even_split
from ringsync._native import ffi, lib
from ringsync.config import Config

from tests.common.reference import (FLOAT_DTYPES, INT_DTYPES, OPS, assert_reduced, dtype_of,
                                 rank_input)


@pytest.mark.parametrize("call", [
    lambda: rs.rank(), lambda: rs.size(), lambda: rs.local_rank(),
    lambda: rs.allreduce(np.ones(2)), lambda: rs.allgather(np.ones(2)),
    lambda: rs.broadcast(np.ones(2), 0), lambda: rs.barrier(),
])
def test_calls_before_init_raise_a_usage_error(call):
    assert not rs.is_initialized()
    with pytest.raises(rs.NotInitializedError, match=r"init\(\)"):
        call()


def test_error_kinds_are_distinct():
    assert issubclass(rs.UsageError, rs.RingsyncError)
    assert issubclass(rs.CommunicationError, rs.RingsyncError)
    assert not issubclass(rs.CommunicationError, rs.UsageError)
    assert issubclass(rs.CommunicationTimeout, rs.CommunicationError)


def _native_code(dtype):
    return getattr(lib, "RS_" + dtype.upper())


@pytest.mark.parametrize("dtype", INT_DTYPES + FLOAT_DTYPES)
@pytest.mark.parametrize("op", OPS)
def test_reduction_kernels_match_numpy(dtype, op):
    a, b = (rank_input(r, (257,), dtype, op, "kernel") for r in range(2))
    got = a.copy()
    assert lib.rs_reduce_local(ffi.cast("void *", got.ctypes.data),
                               ffi.cast("void *", b.ctypes.data), got.size,
                               _native_code(dtype), int(getattr(rs, op))) == lib.RS_OK
    if op == "Average":  # the kernel sums; the collective divides afterwards
        op = "Sum"
    assert_reduced(got, [a, b], op, what=f"kernel {dtype} {op}")


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_precision_rounding_matches_numpy(dtype):
    """Scaling by 1 round-trips every bit pattern through float32 like numpy's casts do."""
    try:
        dt = dtype_of(dtype)
    except TypeError:
        pytest.skip("ml_dtypes not installed")
    bits = np.arange(1 << 16, dtype=np.uint16)
    values = bits.view(dt)
    finite = np.isfinite(values.astype(np.float32))
    with np.errstate(all="ignore"):
        expected = (values.astype(np.float32) * np.float32(1.5)).astype(dt)
    got = values.copy()
    assert lib.rs_scale_local(ffi.cast("void *", got.ctypes.data), got.size,
                              _native_code(dtype), 1.5) == lib.RS_OK
    exp_bits, got_bits = expected.view(np.uint16), got.view(np.uint16)
    mismatch = np.flatnonzero(finite & (exp_bits != got_bits))
    assert mismatch.size == 0, f"{mismatch.size} differ, e.g. {bits[mismatch[:5]]}"


def test_config_reads_environment_once():
    cfg = Config.from_env({"RINGSYNC_TIMEOUT_SECONDS": "12.5", "RINGSYNC_IFACE": "lo"})
    assert cfg.timeout_seconds == 12.5 and cfg.iface == "lo"
    assert Config.from_env({}).timeout_seconds == 0  # no hard limit: stall warnings only
    assert Config.from_env({"RINGSYNC_TIMEOUT_SECONDS": "0"}).timeout_seconds == 0
    assert Config.from_env({}, timeout_seconds=3).timeout_seconds == 3
    with pytest.raises(rs.UsageError, match="RINGSYNC_TIMEOUT_SECONDS"):
        Config.from_env({"RINGSYNC_TIMEOUT_SECONDS": "soon"})
    with pytest.raises(rs.UsageError, match="RINGSYNC_TIMEOUT_SECONDS='nan' must be zero"):
        Config.from_env({"RINGSYNC_TIMEOUT_SECONDS": "nan"})
    with pytest.raises(rs.UsageError, match="positive"):
        Config.from_env({"RINGSYNC_START_TIMEOUT_SECONDS": "0"})


def test_topology_follows_horovod():
    hosts = ["a", "a", "b", "b", "b", "c"]
    topo = [bootstrap.topology(hosts, r) for r in range(len(hosts))]
    assert [t.local_rank for t in topo] == [0, 1, 0, 1, 2, 0]
    assert [t.local_size for t in topo] == [2, 2, 3, 3, 3, 1]
    assert [t.cross_rank for t in topo] == [0, 0, 1, 1, 0, 2]
    assert [t.cross_size for t in topo] == [3, 2, 3, 2, 1, 3]


def test_listen_addresses():
    import socket
    # Only where peers reach this rank, never every interface: bind what is advertised.
    bind, advertised = bootstrap.listen_addresses(None)
    assert bind == advertised and bind not in ("", "0.0.0.0"), (bind, advertised)
    with socket.socket() as s:
        s.bind((bind, 0))  # an address of this host
    assert bootstrap.listen_addresses("127.0.0.1") == ("127.0.0.1", "127.0.0.1")
    assert bootstrap.listen_addresses("lo") == ("127.0.0.1", "127.0.0.1")
    with pytest.raises(rs.UsageError, match="no-such-iface"):
        bootstrap.listen_addresses("no-such-iface")
    # Same-host peers too are reached where they listen, not over loopback.
    peers = [bootstrap.PeerInfo("h1", "10.0.0.1", 1), bootstrap.PeerInfo("h2", "10.0.0.2", 2)]
    assert bootstrap.connect_addresses(peers) == ["10.0.0.1", "10.0.0.2"]


def test_even_split():
    assert even_split(7, 3) == [3, 2, 2]
    assert even_split(2, 4) == [1, 1, 0, 0]
    assert sum(even_split(1009, 4)) == 1009


def test_engine_settings_parse():
    cfg = Config.from_env({"RINGSYNC_FUSION_THRESHOLD": "0", "RINGSYNC_CYCLE_TIME_MS": "2.5",
                           "RINGSYNC_STALL_CHECK_SECONDS": "0", "RINGSYNC_CACHE_CAPACITY": "16",
                           "RINGSYNC_TIMELINE": "/tmp/t.json"})
    assert (cfg.fusion_threshold, cfg.cycle_time_ms, cfg.stall_check_seconds,
            cfg.cache_capacity, cfg.timeline) == (0, 2.5, 0.0, 16, "/tmp/t.json")
    assert Config.from_env({}).fusion_threshold == 64 << 20
    with pytest.raises(rs.UsageError, match="RINGSYNC_FUSION_THRESHOLD='1.5' is not a whole number"):
        Config.from_env({"RINGSYNC_FUSION_THRESHOLD": "1.5"})
    with pytest.raises(rs.UsageError, match="RINGSYNC_CYCLE_TIME_MS"):
        Config.from_env({"RINGSYNC_CYCLE_TIME_MS": "-1"})


def test_import_ringsync_leaves_mpi_alone_until_asked():
    """`import ringsync` must not load mpi4py.MPI: under fault tolerance ringsync first
    sets mpi4py.rc.finalize = False (which mpi4py reads when MPI is loaded), and that
    only works if MPI is loaded afterwards. Checked in a fresh interpreter, under the
    environment mpirun --with-ft ulfm gives its ranks."""
    import subprocess
    import sys
    code = ("import sys, ringsync, ringsync.torch, mpi4py\n"
            "assert 'mpi4py.MPI' not in sys.modules, 'import ringsync loaded mpi4py.MPI'\n"
            "assert mpi4py.rc.finalize is False, mpi4py.rc.finalize\n")
    env = {**__import__("os").environ, "OMPI_MCA_mpi_ft_enable": "1"}
    env.pop("OMPI_PARENT_PORT", None)
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
