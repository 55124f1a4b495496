"""Magnitude histograms agree with exact arithmetic at every edge, for every float dtype.

Two references: exact rational arithmetic on each value (any dtype, small arrays),
and float64 comparisons with edges from ``np.ldexp`` (large arrays of dtypes with
at most 24 significant bits, once the float64 edges are proved to separate those
values exactly as the true, irrational edges do).
"""

from __future__ import annotations

import math
import pickle
from fractions import Fraction

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gradpipe.analytics import histogram_bins
from gradpipe.analytics.histogram_bins import BinLayout, bin_layout, histogram_counts
from gradpipe.errors import InvalidInputError

DTYPES = {
    "float16": np.dtype(np.float16),
    "bfloat16": np.dtype(ml_dtypes.bfloat16),
    "float32": np.dtype(np.float32),
    "float64": np.dtype(np.float64),
}
UINTS = {2: np.uint16, 4: np.uint32, 8: np.uint64}
M_VALUES = [1, 2, 3, 4, 8]


def _magnitude_bins(layout: BinLayout) -> int:
    return layout.size // 2 - 4


def _bin_of_index(layout: BinLayout, index: int, positive: bool) -> int:
    """Layout bin of an edge index (-1: underflow, k: overflow) for one sign."""
    zero = _magnitude_bins(layout) + 4
    return zero + 2 + index if positive else zero - 2 - index


def _exact_bin(x: float, layout: BinLayout) -> int:
    """The bin of ``x``, from exact rational comparisons with ``2**(s/m)``."""
    k = _magnitude_bins(layout)
    if math.isnan(x):
        return 0
    if x == 0:
        return k + 4
    if math.isinf(x):
        return 2 * k + 7 if x > 0 else 1
    m = layout.bins_per_octave
    power = Fraction(abs(x)) ** m
    # The largest s with |x|**m >= 2**s, i.e. |x| >= 2**(s/m).
    s = power.numerator.bit_length() - power.denominator.bit_length()
    if power < Fraction(2) ** s:
        s -= 1
    index = min(max(s - layout.low_exp * m, -1), k)
    return _bin_of_index(layout, index, x > 0)


def _widen(values: np.ndarray) -> np.ndarray:
    with np.errstate(invalid="ignore"):  # signalling NaNs
        return values.astype(np.float64).reshape(-1)


def _exact_counts(values: np.ndarray, layout: BinLayout) -> np.ndarray:
    wide = _widen(values)
    bins = [_exact_bin(float(x), layout) for x in wide]
    return np.bincount(np.array(bins, dtype=np.intp), minlength=layout.size)


def _ldexp_edges(layout: BinLayout) -> np.ndarray:
    m, low, high = layout.bins_per_octave, layout.low_exp, layout.high_exp
    _check_edges_separate_24_bit_values(m)
    significands = np.tile(2.0 ** (np.arange(m) / m), high - low)
    octaves = np.repeat(np.arange(low, high), m)
    return np.append(np.ldexp(significands, octaves), np.ldexp(1.0, high))


def _check_edges_separate_24_bit_values(m: int) -> None:
    """Prove that float64 ``2**(j/m)`` splits 24-bit significands as the true edge does.

    A value with at most 24 significant bits, scaled into [1, 2), is ``c / 2**23``.
    It reaches the float64 edge iff ``c >= ceil(edge * 2**23)``; that ceiling must
    be the smallest c whose ``c**m`` reaches ``2**(j + 23m)``.
    """
    for j in range(1, m):
        c = math.ceil((2.0 ** (j / m)) * 2**23)
        assert (c - 1) ** m < 2 ** (j + 23 * m) <= c**m, (m, j)


def _reference_counts(values: np.ndarray, layout: BinLayout) -> np.ndarray:
    """Counts from float64 comparisons (for dtypes of at most 24 significant bits)."""
    k = _magnitude_bins(layout)
    wide = _widen(values)
    with np.errstate(invalid="ignore"):
        index = np.searchsorted(_ldexp_edges(layout), np.abs(wide), side="right") - 1
        bins = np.where(wide > 0, k + 6 + index, k + 2 - index)
    bins[wide == 0] = k + 4
    bins[wide == np.inf] = 2 * k + 7
    bins[wide == -np.inf] = 1
    bins[np.isnan(wide)] = 0
    return np.bincount(bins, minlength=layout.size)


def _from_bits(patterns: np.ndarray, dtype: np.dtype) -> np.ndarray:
    return patterns.astype(UINTS[dtype.itemsize]).view(dtype)


def _edge_neighbours(dtype: np.dtype, layout: BinLayout) -> np.ndarray:
    """For each edge, both signs of its nearest value and of the patterns just below and above."""
    k = _magnitude_bins(layout)
    with np.errstate(over="ignore"):
        nearest = layout.lower[k + 6 : 2 * k + 7].astype(dtype)
    bits = nearest.view(UINTS[dtype.itemsize])
    sign = bits.dtype.type(1 << (8 * dtype.itemsize - 1))
    patterns = np.concatenate([bits - 1, bits, bits + 1])
    return np.concatenate([patterns, patterns | sign]).view(dtype)


def _specials(dtype: np.dtype) -> np.ndarray:
    """NaNs (quiet, signalling, with payloads, negative), ±inf, ±0, extreme finite values."""
    width = 8 * dtype.itemsize
    mantissa = {"float16": 10, "bfloat16": 7, "float32": 23, "float64": 52}[dtype.name]
    inf = ((1 << (width - 1 - mantissa)) - 1) << mantissa
    quiet = 1 << (mantissa - 1)
    magnitudes = [inf | quiet, inf | 1, inf | quiet | 5, inf | (quiet - 1), inf, 0, 1, quiet]
    magnitudes += [(1 << mantissa) - 1, 1 << mantissa, inf - 1]
    patterns = [p | s for p in magnitudes for s in (0, 1 << (width - 1))]
    return np.array(patterns, dtype=UINTS[dtype.itemsize]).view(dtype)


# The layout.


@pytest.mark.parametrize("m", [1, 2, 3, 4, 8, 16])
def test_layout_is_one_increasing_axis(m: int) -> None:
    layout = bin_layout(m, -32, 16)
    k = 48 * m
    assert layout.size == len(layout.labels) == 2 * k + 8 == layout.lower.size
    assert len(set(layout.labels)) == layout.size
    assert layout.labels[:3] == ("nan", "-inf", "-overflow")
    assert layout.labels[k + 3 : k + 6] == ("-underflow", "zero", "+underflow")
    assert layout.labels[-2:] == ("+overflow", "+inf")
    assert layout.labels[k + 6] == "+2^-32"
    assert layout.labels[3] == ("-2^15" if m == 1 else f"-2^(15+{m - 1}/{m})")
    assert np.isnan(layout.lower[0])
    assert np.isnan(layout.upper[0])
    # Each bin starts where the one before ends, from -inf up to +inf.
    np.testing.assert_array_equal(layout.lower[2:], layout.upper[1:-1])
    assert (layout.lower[1], layout.upper[-1]) == (-np.inf, np.inf)
    for magnitudes in [slice(3, k + 3), slice(k + 6, 2 * k + 6)]:
        assert np.all(layout.lower[magnitudes] < layout.upper[magnitudes])
        assert np.all(np.diff(layout.lower[magnitudes]) > 0)
    assert layout.lower[k + 6] == 2.0**-32
    assert layout.upper[2 * k + 5] == 2.0**16
    assert not layout.lower.flags.writeable


def test_layout_edges_are_the_nearest_float64() -> None:
    layout = bin_layout(3, -1, 2)
    k = _magnitude_bins(layout)
    for index, edge in enumerate(layout.lower[k + 6 : 2 * k + 6]):
        s = 3 * layout.low_exp + index
        below = (Fraction(edge) + Fraction(np.nextafter(edge, 0.0))) / 2
        above = (Fraction(edge) + Fraction(np.nextafter(edge, np.inf))) / 2
        assert below**3 < Fraction(2) ** s < above**3, (index, edge)


@pytest.mark.parametrize(
    ("args", "match"),
    [
        ((0, -32, 16), "bins_per_octave"),
        ((17, -32, 16), "bins_per_octave"),
        ((True, -32, 16), "bins_per_octave"),
        ((2.0, -32, 16), "bins_per_octave"),
        ((2, -32.0, 16), "low_exp"),
        ((2, -32, "16"), "high_exp"),
        ((2, 16, 16), "empty"),
        ((2, -1023, 16), "low_exp"),
        ((2, 0, 1024), "high_exp"),
    ],
)
def test_layout_rejects_bad_parameters(args: tuple[object, ...], match: str) -> None:
    with pytest.raises(InvalidInputError, match=match):
        bin_layout(*args)


def test_layout_round_trips() -> None:
    layout = bin_layout(4, -20, 3)
    assert layout.to_dict() == {"bins_per_octave": 4, "low_exp": -20, "high_exp": 3}
    assert BinLayout.from_dict(layout.to_dict()) == layout
    assert pickle.loads(pickle.dumps(layout)) is layout
    assert BinLayout(4, -20, 3) == layout
    assert layout != bin_layout(4, -20, 4)


# Counting.


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("m", M_VALUES)
@pytest.mark.parametrize("exponents", [(-32, 16), (-27, -13), (-137, 100)])
def test_every_16_bit_pattern(dtype: str, m: int, exponents: tuple[int, int]) -> None:
    layout = bin_layout(m, *exponents)
    values = _from_bits(np.arange(1 << 16), DTYPES[dtype])
    counts = histogram_counts(values, layout)
    assert counts.dtype == np.int64
    np.testing.assert_array_equal(counts, _reference_counts(values, layout))


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("m", M_VALUES)
def test_values_at_and_beside_every_edge(dtype: str, m: int) -> None:
    layout = bin_layout(m)
    values = _edge_neighbours(DTYPES[dtype], layout)
    counts = histogram_counts(values, layout)
    np.testing.assert_array_equal(counts, _exact_counts(values, layout))
    assert counts.sum() == values.size


@pytest.mark.parametrize(
    ("dtype", "exponents"),
    [
        ("float16", (-26, -12)),  # f16 subnormals reach 2**-24: the low edges collapse
        ("bfloat16", (-136, -124)),
        ("float32", (-150, -124)),  # two edges share a top-16-bit prefix: the searched path
        ("float64", (-1022, -1018)),  # float64 subnormals are all underflow
    ],
)
@pytest.mark.parametrize("m", [1, 3, 8])
def test_subnormals(dtype: str, exponents: tuple[int, int], m: int) -> None:
    layout = bin_layout(m, *exponents)
    width = 8 * DTYPES[dtype].itemsize
    rng = np.random.default_rng(m)
    mantissa_bits = {"float16": 10, "bfloat16": 7, "float32": 23, "float64": 52}[dtype]
    subnormals = rng.integers(0, 1 << mantissa_bits, 500, dtype=np.uint64)
    subnormals |= rng.integers(0, 2, 500, dtype=np.uint64) << np.uint64(width - 1)
    values = np.concatenate(
        [_edge_neighbours(DTYPES[dtype], layout), _from_bits(subnormals, DTYPES[dtype])]
    )
    np.testing.assert_array_equal(histogram_counts(values, layout), _exact_counts(values, layout))


def test_float32_deep_subnormal_layout_takes_the_searched_path() -> None:
    # The fast path needs at most one edge per top-16-bit prefix; test_subnormals covers both.
    assert histogram_bins._plan(bin_layout(8, -150, -124), "float32").low_thresholds is None
    assert histogram_bins._plan(bin_layout(16), "float32").low_thresholds is not None


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_special_values(dtype: str) -> None:
    layout = bin_layout()
    values = _specials(DTYPES[dtype])
    counts = dict(zip(layout.labels, histogram_counts(values, layout).tolist(), strict=True))
    assert counts["nan"] == 8  # four NaNs, each with either sign
    assert (counts["-inf"], counts["+inf"], counts["zero"]) == (1, 1, 2)
    np.testing.assert_array_equal(histogram_counts(values, layout), _exact_counts(values, layout))


def test_float16_subnormals_have_their_own_bins() -> None:
    layout = bin_layout(2)
    values = np.array([2.0**-24, -(2.0**-24), 2.0**-23 * 1.5, 65504.0], dtype=np.float16)
    counts = dict(zip(layout.labels, histogram_counts(values, layout).tolist(), strict=True))
    assert {label: n for label, n in counts.items() if n} == {
        "-2^-24": 1,
        "+2^-24": 1,
        "+2^(-23+1/2)": 1,
        "+2^(15+1/2)": 1,
    }


def test_shapes_strides_byte_order_and_read_only() -> None:
    layout = bin_layout(3)
    rng = np.random.default_rng(7)
    values = (rng.standard_normal((6, 7, 8)) * 2.0 ** rng.integers(-40, 20, (6, 7, 8))).astype(
        np.float32
    )
    values.reshape(-1)[:22] = _specials(np.dtype(np.float32))
    expected = _reference_counts(values, layout)
    read_only = values.copy()
    read_only.flags.writeable = False
    for variant in [values, values.transpose(2, 0, 1), values[::2, :, ::3], read_only]:
        np.testing.assert_array_equal(
            histogram_counts(variant, layout), _reference_counts(variant, layout)
        )
    np.testing.assert_array_equal(histogram_counts(values.astype(">f4"), layout), expected)
    np.testing.assert_array_equal(histogram_counts(_widen(values).astype(">f8"), layout), expected)
    assert histogram_counts(np.float32(1.0), layout).sum() == 1


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_many_values_span_several_blocks(dtype: str) -> None:
    layout = bin_layout(4)
    rng = np.random.default_rng(3)
    size = 2 * histogram_bins._BLOCK + 12_345
    # float32 values (as float64 too) have 24 significant bits: the float64 reference holds.
    wide = rng.standard_normal(size) * 2.0 ** rng.integers(-36, 20, size)
    with np.errstate(over="ignore"):
        values = wide.astype(np.float32).astype(DTYPES[dtype])
    counts = histogram_counts(values, layout)
    assert counts.sum() == size
    np.testing.assert_array_equal(counts, _reference_counts(values, layout))


def test_empty_values() -> None:
    layout = bin_layout()
    counts = histogram_counts(np.zeros((3, 0), dtype=np.float32), layout)
    np.testing.assert_array_equal(counts, np.zeros(layout.size, dtype=np.int64))


@pytest.mark.parametrize("dtype", [np.int32, np.uint16, np.bool_, np.complex64])
def test_rejects_values_that_are_not_floats(dtype: type) -> None:
    with pytest.raises(InvalidInputError, match="float16, bfloat16, float32 or float64"):
        histogram_counts(np.zeros(3, dtype=dtype), bin_layout())


_LOWEST = {"float16": -28, "bfloat16": -137, "float32": -152, "float64": -1022}
_HIGHEST = {"float16": 17, "bfloat16": 129, "float32": 129, "float64": 1023}


@settings(max_examples=80, deadline=None)
@given(
    dtype=st.sampled_from(list(DTYPES)),
    m=st.integers(1, 16),
    where=st.floats(0, 1),
    span=st.integers(1, 12),
    seed=st.integers(0, 2**32 - 1),
)
def test_random_values_and_layouts(dtype: str, m: int, where: float, span: int, seed: int) -> None:
    low = _LOWEST[dtype] + round(where * (_HIGHEST[dtype] - 1 - _LOWEST[dtype]))
    layout = bin_layout(m, low, min(low + span, 1023))
    rng = np.random.default_rng(seed)
    # Any bit pattern, and values spread over the layout's range and just beyond it.
    width = 8 * DTYPES[dtype].itemsize
    patterns = rng.integers(0, 1 << width, 40, dtype=np.uint64, endpoint=False)
    exponents = rng.uniform(layout.low_exp - 1, layout.high_exp + 1, 60)
    with np.errstate(over="ignore"):
        spread = (rng.choice([-1.0, 1.0], 60) * 2.0**exponents).astype(DTYPES[dtype])
    values = np.concatenate([_from_bits(patterns, DTYPES[dtype]), spread])
    np.testing.assert_array_equal(histogram_counts(values, layout), _exact_counts(values, layout))
