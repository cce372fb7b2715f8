"""The float16 and bfloat16 kernels bit for bit against numpy references: every bit
pattern through the conversions both ways, and sum/min/max/product and scaling over
lengths that exercise the vector bodies (8 or 16 elements a step) and the scalar tails.

The kernels widen to float32, operate once, and round back to nearest even, so the
references do exactly that with numpy's float32 arithmetic. NaN results must be NaNs of
the kernels' one form (float16: sign | 0x7e00; bfloat16: the top half made quiet); their
other bits are left open (C does not fix which of two NaN operands an addition passes on).
"""
import numpy as np
import pytest

from ringsync._native import ffi, lib

LENGTHS = [0, 1, 7, 8, 15, 16, 17, 1000, 4099]
OPS = {"Sum": lib.RS_OP_SUM, "Min": lib.RS_OP_MIN, "Max": lib.RS_OP_MAX,
       "Product": lib.RS_OP_PRODUCT}
ALL_BITS = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)


# ---- the two formats as raw uint16 bits, and float32 references ----

def f16_widen(bits):
    return bits.view(np.float16).astype(np.float32)


def f16_narrow(values):
    """numpy rounds float32 to float16 to nearest even (subnormals and overflow too)."""
    with np.errstate(over="ignore"):
        return values.astype(np.float16).view(np.uint16)


def bf16_widen(bits):
    return (bits.astype(np.uint32) << 16).view(np.float32)


def bf16_narrow(values):
    """Round to nearest even on the bits: keep the top half, add one when the dropped half
    is above one half, or exactly one half and the kept half is odd."""
    x = values.astype(np.float32).view(np.uint32)
    top, dropped = x >> 16, x & 0xFFFF
    up = (dropped > 0x8000) | ((dropped == 0x8000) & (top & 1 == 1))
    return (top + up).astype(np.uint16)  # (a carry into the exponent is right: it rounds up)


FORMATS = {"float16": (lib.RS_FLOAT16, f16_widen, f16_narrow),
           "bfloat16": (lib.RS_BFLOAT16, bf16_widen, bf16_narrow)}


def is_nan(dtype, bits):
    return np.isnan(FORMATS[dtype][1](bits))


def canonical_nan(dtype, bits):
    """The NaN the kernels make of a float32 NaN whose top 16 bits are `bits`' pattern."""
    if dtype == "float16":
        return (bits & 0x8000) | 0x7E00
    return bits | 0x0040


def assert_same_bits(dtype, got, expected, what):
    """Bit for bit where the reference is a number; a NaN of the kernels' form where not."""
    nan = is_nan(dtype, expected)
    wrong = np.flatnonzero((~nan & (got != expected)) | (nan & ~is_nan(dtype, got)))
    # float16 NaNs are all sign | 0x7e00; bfloat16 NaNs keep their top bits, made quiet
    form = (got & 0x7FFF) == 0x7E00 if dtype == "float16" else (got & 0x0040) != 0
    wrong = np.union1d(wrong, np.flatnonzero(nan & ~form))
    assert wrong.size == 0, (
        f"{what}: {wrong.size} of {got.size} differ, e.g. (index, got, expected) " +
        ", ".join(f"({i}, {got[i]:#06x}, {expected[i]:#06x})" for i in wrong[:5]))


# ---- calling the kernels ----

def ptr(array):
    return ffi.cast("void *", array.ctypes.data)


def reduce_native(dtype, op, a, b):
    got = a.copy()
    assert lib.rs_reduce_local(ptr(got), ptr(b), got.size, FORMATS[dtype][0], OPS[op]) == \
        lib.RS_OK
    return got


def scale_native(dtype, bits, factor):
    got = bits.copy()
    assert lib.rs_scale_local(ptr(got), got.size, FORMATS[dtype][0], factor) == lib.RS_OK
    return got


def reduce_reference(dtype, op, a, b):
    _, widen, narrow = FORMATS[dtype]
    x, y = widen(a), widen(b)
    with np.errstate(all="ignore"):
        if op == "Sum":
            out = x + y
        elif op == "Product":
            out = x * y
        elif op == "Min":  # the kernels' b < a ? b : a (a NaN in b loses, a -0 does not win)
            out = np.where(y < x, y, x)
        else:
            out = np.where(y > x, y, x)
    return narrow(out)


def scale_reference(dtype, bits, factor):
    _, widen, narrow = FORMATS[dtype]
    with np.errstate(all="ignore"):
        return narrow(widen(bits) * np.float32(factor))


# ---- inputs ----

SPECIALS = {  # zeros, infinities, NaNs (quiet and signalling), extremes, subnormals
    "float16": [0x0000, 0x8000, 0x7C00, 0xFC00, 0x7E00, 0xFE00, 0x7C01, 0x7D55, 0x7BFF,
                0xFBFF, 0x0001, 0x8001, 0x03FF, 0x0400, 0x3C00, 0x3C01, 0x7800],
    "bfloat16": [0x0000, 0x8000, 0x7F80, 0xFF80, 0x7FC0, 0xFFC0, 0x7F81, 0x7FA5, 0x7F7F,
                 0xFF7F, 0x0001, 0x8001, 0x007F, 0x0080, 0x3F80, 0x3F81, 0x7F00],
}


def random_bits(dtype, n, seed):
    """Ordinary values (so that sums round), any bit pattern, and the special values,
    mixed at random positions."""
    rng = np.random.default_rng(seed)
    ordinary = FORMATS[dtype][2](rng.uniform(-8.0, 8.0, n).astype(np.float32))
    anything = rng.integers(0, 1 << 16, n).astype(np.uint16)
    special = rng.choice(np.array(SPECIALS[dtype], dtype=np.uint16), n)
    kind = rng.integers(0, 10, n)
    return np.where(kind < 7, ordinary, np.where(kind < 9, anything, special)).astype(np.uint16)


# ---- the conversions, every bit pattern ----

@pytest.mark.parametrize("dtype", list(FORMATS))
def test_every_bit_pattern_round_trips_through_float32(dtype):
    """Scaling by 1 widens and narrows: numbers come back unchanged, NaNs as the one form."""
    got = scale_native(dtype, ALL_BITS, 1.0)
    nan = is_nan(dtype, ALL_BITS)
    assert np.array_equal(got[~nan], ALL_BITS[~nan])
    assert np.array_equal(got[nan], canonical_nan(dtype, ALL_BITS[nan]))


@pytest.mark.parametrize("dtype", list(FORMATS))
@pytest.mark.parametrize("factor", [0.5, 1.5, 1 / 3, 1 / 7, 2.0**-10, 1000.0, 65504.0, -3.0,
                                    2.0**100, 2.0**-100])
def test_every_bit_pattern_scales_like_numpy(dtype, factor):
    """Rounding to nearest even, subnormal results, overflow to infinity, underflow to
    zero, for every input pattern (1/3 and 1/7 are Average's divide paths)."""
    got = scale_native(dtype, ALL_BITS, factor)
    assert_same_bits(dtype, got, scale_reference(dtype, ALL_BITS, factor),
                     f"{dtype} * {factor}")


@pytest.mark.parametrize("dtype", list(FORMATS))
@pytest.mark.parametrize("op", list(OPS))
def test_every_bit_pattern_against_many_partners(dtype, op):
    """Every pattern as inout, against shuffled partners that are every pattern too: the
    float32 results cover all of float32's rounding cases into the narrow format."""
    rng = np.random.default_rng(7)
    for turn in range(4):
        partners = rng.permutation(ALL_BITS) if turn else ALL_BITS[::-1].copy()
        got = reduce_native(dtype, op, ALL_BITS, partners)
        assert_same_bits(dtype, got, reduce_reference(dtype, op, ALL_BITS, partners),
                         f"{dtype} {op} turn {turn}")


# ---- bodies and tails ----

@pytest.mark.parametrize("dtype", list(FORMATS))
@pytest.mark.parametrize("op", list(OPS))
@pytest.mark.parametrize("n", LENGTHS)
def test_kernel_matches_numpy_at_every_length(dtype, op, n):
    a, b = random_bits(dtype, n, seed=n), random_bits(dtype, n, seed=n + 10**6)
    got = reduce_native(dtype, op, a, b)
    assert_same_bits(dtype, got, reduce_reference(dtype, op, a, b), f"{dtype} {op} n={n}")


@pytest.mark.parametrize("dtype", list(FORMATS))
@pytest.mark.parametrize("n", LENGTHS)
def test_scale_matches_numpy_at_every_length(dtype, n):
    bits = random_bits(dtype, n, seed=3 * n)
    for factor in (0.25, 1 / 3, 3.5):
        assert_same_bits(dtype, scale_native(dtype, bits, factor),
                         scale_reference(dtype, bits, factor), f"{dtype} * {factor} n={n}")


@pytest.mark.parametrize("dtype", list(FORMATS))
def test_kernel_leaves_bytes_outside_the_count_alone_and_takes_unaligned_buffers(dtype):
    """Inout and in start one element (2 bytes) into their arrays; the element after the
    count keeps its bits."""
    n = 1000
    a, b = random_bits(dtype, n + 2, seed=11), random_bits(dtype, n + 2, seed=12)
    got = a.copy()
    assert lib.rs_reduce_local(ffi.cast("void *", got[1:].ctypes.data), ptr(b[1:]), n,
                               FORMATS[dtype][0], lib.RS_OP_SUM) == lib.RS_OK
    assert got[0] == a[0] and got[n + 1] == a[n + 1]
    assert_same_bits(dtype, got[1:n + 1], reduce_reference(dtype, "Sum", a[1:n + 1],
                                                           b[1:n + 1]), f"{dtype} unaligned")
