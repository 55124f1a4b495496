"""Delta math: XOR and integer deltas are bit-exact for every dtype; the sparse one says if not."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gradpipe.codecs.ops.delta import (
    apply_int_delta,
    apply_sparse_delta,
    apply_xor_delta,
    int_delta,
    sparse_delta,
    xor_delta,
)
from gradpipe.core.dtypes import DTYPE_NAMES, parse_dtype
from gradpipe.errors import InvalidInputError
from gradpipe.testing.store_suite import special_values


@pytest.mark.parametrize("dtype", DTYPE_NAMES)
def test_xor_and_int_deltas_round_trip_every_dtype_bit_exact(dtype: str) -> None:
    base = special_values(dtype, 3000, seed=1)
    target = special_values(dtype, 3000, seed=2)
    for encode, apply in ((xor_delta, apply_xor_delta), (int_delta, apply_int_delta)):
        back = apply(encode(target, base), base)
        assert back.dtype == base.dtype
        assert back.tobytes() == target.tobytes()


def test_unchanged_values_give_zero_words() -> None:
    base = np.random.default_rng(0).standard_normal(1000).astype(np.float32)
    target = base.copy()
    target[::10] += np.float32(1e-3)
    delta = xor_delta(target, base)
    assert np.count_nonzero(delta) == np.count_nonzero(target != base)
    assert not np.any(int_delta(base, base))


@settings(max_examples=200, deadline=None)
@given(
    st.sampled_from(["float32", "float16", "bfloat16", "float64", "int8", "uint64"]),
    st.binary(min_size=16, max_size=16),
    st.binary(min_size=16, max_size=16),
)
def test_any_bit_patterns_round_trip(dtype: str, a: bytes, b: bytes) -> None:
    kind = parse_dtype(dtype)
    target = np.frombuffer(a, dtype=kind)
    base = np.frombuffer(b, dtype=kind)
    assert apply_xor_delta(xor_delta(target, base), base).tobytes() == a
    assert apply_int_delta(int_delta(target, base), base).tobytes() == a


def test_float32_subtraction_loses_what_the_float64_sparse_delta_keeps() -> None:
    # The seed's `target - base` delta in float32: (2**-26 - 1) + 1 rounds to 0.
    base = np.array([1.0, 2.0], np.float32)
    target = np.array([2.0**-26, 2.0], np.float32)
    seed_way = (target - base) + base
    assert seed_way[0] == 0.0 != target[0]
    # Differences of float32 values taken in float64 are exact, and so is this delta.
    delta = sparse_delta(target, base, threshold=0.0)
    assert delta.exact
    assert delta.max_abs_error == 0.0
    assert apply_sparse_delta(delta, base).tobytes() == target.tobytes()
    assert apply_xor_delta(xor_delta(target, base), base).tobytes() == target.tobytes()


def test_sparse_delta_threshold_drops_small_changes_and_records_the_error() -> None:
    rng = np.random.default_rng(3)
    base = rng.standard_normal(1000).astype(np.float64)
    target = base + rng.standard_normal(1000) * 1e-3
    target[:10] += 1.0
    delta = sparse_delta(target, base, threshold=0.1)
    assert set(delta.indices.tolist()) == set(range(10))
    back = apply_sparse_delta(delta, base)
    assert not delta.exact
    assert 0 < delta.max_abs_error <= 0.1
    assert np.abs(back - target).max() == pytest.approx(delta.max_abs_error)
    # On float64 chunks even threshold 0 rounds: the result says so, honestly.
    full = sparse_delta(target, base, threshold=0.0)
    back = apply_sparse_delta(full, base)
    assert full.exact == (back.tobytes() == target.tobytes())
    assert not full.exact
    assert 0 < full.max_abs_error < 1e-15


def test_deltas_refuse_mismatched_chunks() -> None:
    with pytest.raises(InvalidInputError, match="one dtype and size"):
        xor_delta(np.zeros(3, np.float32), np.zeros(4, np.float32))
    with pytest.raises(InvalidInputError, match="one dtype and size"):
        int_delta(np.zeros(3, np.float32), np.zeros(3, np.float64))
    with pytest.raises(InvalidInputError, match="for floats"):
        sparse_delta(np.zeros(3, np.int32), np.zeros(3, np.int32))
    with pytest.raises(InvalidInputError, match="threshold"):
        sparse_delta(np.zeros(3), np.zeros(3), threshold=-1.0)
