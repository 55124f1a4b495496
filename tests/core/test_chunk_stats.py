"""Chunk statistics agree with a plain numpy reference at every density and dtype."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gradpipe.core.chunk_stats import bit_nonzero, chunk_stats, stats_and_bit_nonzero
from gradpipe.core.dtypes import DTYPE_NAMES
from gradpipe.testing.store_suite import special_values


def _reference(array: np.ndarray) -> dict[str, float | int | None]:
    with np.errstate(all="ignore"):
        wide = array.astype(np.float64)
        finite = wide[np.isfinite(wide)]
        seen = wide[~np.isnan(wide)]
        return {
            "nonzero": int(np.count_nonzero(wide)),
            "nan": int(np.isnan(wide).sum()),
            "inf": int(np.isinf(wide).sum()),
            "min": float(seen.min()) if seen.size else None,
            "max": float(seen.max()) if seen.size else None,
            "sum": float(finite.sum()),
            # No partial sum, in any order, exceeds this: when it is finite, neither does
            # the sum overflow whatever order a version adds in.
            "abs_sum": float(np.abs(finite).sum()),
        }


@settings(max_examples=60, deadline=None)
@given(
    dtype=st.sampled_from(DTYPE_NAMES),
    density=st.sampled_from([0.0, 0.001, 0.05, 0.24, 0.26, 0.7, 1.0]),
    seed=st.integers(0, 2**16),
    size=st.integers(1, 3000),
)
def test_stats_match_numpy(dtype: str, density: float, seed: int, size: int) -> None:
    array = special_values(dtype, size, seed)
    array[np.random.default_rng(seed).random(size) >= density] = 0
    stats = chunk_stats(array)
    expected = _reference(array)
    assert stats.count == size
    for key in ("nonzero", "nan", "inf", "min", "max"):
        got, want = getattr(stats, key), expected[key]
        assert got == want or (math.isnan(got) and math.isnan(want)), (key, got, want)
    if math.isfinite(expected["abs_sum"]):
        # Orders differ by at most n·ε·Σ|x| (3000 values: under 1e-12·Σ|x|).
        slack = max(1e-6, expected["abs_sum"] * 1e-12)
        assert math.isclose(stats.sum, expected["sum"], rel_tol=1e-9, abs_tol=slack)


@pytest.mark.parametrize("dtype", ["float32", "int16"])
def test_given_bit_count_is_used_as_is(dtype: str) -> None:
    array = np.zeros(100, dtype)
    array[:3] = 1
    assert chunk_stats(array, bits_nonzero=bit_nonzero(array)).nonzero == 3
    assert chunk_stats(np.zeros(100, dtype)).min == 0.0


@settings(max_examples=80, deadline=None)
@given(
    dtype=st.sampled_from(DTYPE_NAMES),
    density=st.sampled_from([0.0, 0.001, 0.3, 1.0]),
    seed=st.integers(0, 2**16),
    size=st.integers(0, 3000),
)
def test_stats_and_bit_count_in_one_call_match_the_two_calls(
    dtype: str, density: float, seed: int, size: int
) -> None:
    # Writers take both from one call (one pass of the kernel where it takes the chunk).
    array = special_values(dtype, size, seed)
    array[np.random.default_rng(seed).random(size) >= density] = 0
    stats, bits = stats_and_bit_nonzero(array)
    assert bits == bit_nonzero(array)
    # Compared as stored (a float64 sum may overflow to NaN, and NaN != NaN).
    assert stats.to_dict() == chunk_stats(array, bits_nonzero=bits).to_dict()
    assert stats.count == array.size


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16", "float64", "int8"])
def test_one_call_on_zero_chunks(dtype: str) -> None:
    zeros = np.zeros(300, dtype)
    assert stats_and_bit_nonzero(zeros) == (chunk_stats(zeros), 0)
    if dtype != "int8":
        # Negative zeros are zero values but non-zero bits: the chunk needs a block.
        negative = np.full(300, -0.0, dtype)
        stats, bits = stats_and_bit_nonzero(negative)
        assert (bits, stats.nonzero, stats.min, stats.max) == (300, 0, 0.0, 0.0)
        assert math.copysign(1.0, stats.min) == 1.0
    strided = np.arange(600).astype(dtype)[::2]  # not contiguous: the numpy path
    assert stats_and_bit_nonzero(strided) == (chunk_stats(strided), bit_nonzero(strided))
