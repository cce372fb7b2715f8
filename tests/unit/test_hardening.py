"""Hardening checks that need no MPI: the integer Average kernel at every rank count up to
5000, and which settings ranks must agree on."""
import numpy as np
import pytest

from ringsync._native import ffi, lib
from ringsync.config import AGREED_SETTINGS, Config

CODES = {"uint8": lib.RS_UINT8, "int8": lib.RS_INT8, "uint16": lib.RS_UINT16,
         "int16": lib.RS_INT16, "int32": lib.RS_INT32, "int64": lib.RS_INT64}


def _values(dtype):
    """Extremes, small values of both signs, and a spread in between."""
    info = np.iinfo(dtype)
    low, high = int(info.min), int(info.max)
    spread = np.array([low + (high - low) * k // 60 for k in range(61)], dtype=np.int64)
    picked = [info.min, info.min + 1, -7, -1, 0, 1, 2, 7, info.max - 1, info.max]
    values = np.concatenate([np.array(picked, dtype=np.int64), spread])
    return np.clip(values, info.min, info.max).astype(dtype)


def _truncated_quotient(values, divisor):
    """Division truncated toward zero, exactly, in Python integers."""
    return [(abs(v) // divisor) * (1 if v > 0 else -1) for v in map(int, values)]


@pytest.mark.parametrize("dtype", list(CODES))
def test_integer_average_divides_exactly_at_every_rank_count(dtype):
    values = _values(dtype)
    for divisor in range(1, 5001):
        got = values.copy()
        status = lib.rs_divide_local(ffi.cast("void *", got.ctypes.data), got.size,
                                     CODES[dtype], divisor)
        assert status == lib.RS_OK
        expected = _truncated_quotient(values, divisor)
        if got.tolist() != expected:
            bad = [(int(v), g, e) for v, g, e in zip(values, got.tolist(), expected) if g != e]
            raise AssertionError(f"{dtype} / {divisor}: (value, got, expected) {bad[:5]}")


def test_integer_division_refuses_a_divisor_below_one():
    x = np.ones(3, np.int8)
    assert lib.rs_divide_local(ffi.cast("void *", x.ctypes.data), 3, lib.RS_INT8, 0) == \
        lib.RS_ERR_USAGE


def test_settings_that_change_the_protocol_are_agreed_the_rest_per_rank():
    agreed = Config.from_env({"RINGSYNC_TRANSPORT": "TCP"}).agreed()
    assert set(agreed) == set(AGREED_SETTINGS)
    assert agreed["transport"] == "tcp"
    for per_rank in ("timeout_seconds", "timeline", "spin_us", "lane_spin_us", "iface",
                     "host_name", "stall_check_seconds", "cycle_time_ms"):
        assert per_rank not in agreed
    for wire in ("fusion_threshold", "cache_capacity", "small_allreduce_bytes",
                 "staged_bytes", "lane_bytes", "transport"):
        assert wire in agreed
