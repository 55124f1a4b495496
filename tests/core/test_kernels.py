"""The compiled kernels (gradpipe/core/_kernels.c) against the numpy code they replace.

Every case runs the numpy version with the kernels turned off (``native`` set to None where
it is used) and compares: byte planes must be identical, statistics identical but for the
last bits of the float sums. Where the extension was not built these tests skip, saying so;
CI builds it and fails if it could not.
"""

from __future__ import annotations

import os
import subprocess
import sys

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gradpipe.codecs import ByteGroupCodec, _planes
from gradpipe.core import chunk_stats as stats_module
from gradpipe.core.chunk_stats import ChunkStats, chunk_stats
from gradpipe.core.kernels import native

pytestmark = pytest.mark.skipif(
    native is None,
    reason="gradpipe.core._kernels is off: not built (no C compiler) or GRADPIPE_NO_KERNELS set",
)

FLOATS = {
    "float32": np.dtype(np.float32),
    "float64": np.dtype(np.float64),
    "bfloat16": np.dtype(ml_dtypes.bfloat16),
    "float16": np.dtype(np.float16),
}


def _numpy_planes(data: np.ndarray, width: int, move_sign: bool, monkeypatch) -> np.ndarray:
    with monkeypatch.context() as patch:
        patch.setattr(_planes, "native", None)
        return _planes.split_planes(data, width, move_sign=move_sign).copy()


@settings(max_examples=60, deadline=None)
@given(
    width=st.sampled_from([1, 2, 4, 8]),
    count=st.integers(0, 3000),
    seed=st.integers(0, 2**32 - 1),
    move_sign=st.booleans(),
)
def test_split_and_join_match_numpy(width: int, count: int, seed: int, move_sign: bool) -> None:
    move_sign = move_sign and width in (2, 4)
    data = np.random.default_rng(seed).integers(0, 256, count * width, dtype=np.uint8)
    with pytest.MonkeyPatch.context() as patch:
        expected = _numpy_planes(data, width, move_sign, patch)
        back_numpy = np.empty_like(data)
        patch.setattr(_planes, "native", None)
        _planes.join_planes(list(expected), back_numpy, sign_moved=move_sign)
    planes = _planes.split_planes(data, width, move_sign=move_sign)
    np.testing.assert_array_equal(planes, expected)
    back = np.empty_like(data)
    _planes.join_planes(list(planes), back, sign_moved=move_sign)
    np.testing.assert_array_equal(back, data)
    np.testing.assert_array_equal(back_numpy, data)


@pytest.mark.parametrize("name", ["float32", "bfloat16", "float16", "int64", "uint8"])
def test_frames_are_the_same_with_and_without_the_kernels(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Chunks large enough for sampled settings, with a sign worth moving: the same bytes."""
    rng = np.random.default_rng(7)
    dtype = FLOATS.get(name, np.dtype(name))
    values = rng.standard_normal(200_003) * 1e-3
    if dtype.kind in "iu":
        values = rng.integers(0, 50, 200_003)
    array = values.astype(dtype)
    codec = ByteGroupCodec(name)
    frame = bytes(codec.encode(array))
    monkeypatch.setattr(_planes, "native", None)
    assert bytes(codec.encode(array)) == frame
    assert codec.decode(frame).tobytes() == array.tobytes()
    monkeypatch.undo()
    assert codec.decode(frame).tobytes() == array.tobytes()


def _values(name: str, count: int, seed: int, mode: str) -> np.ndarray:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(count) * 3
    if mode == "sparse":
        x[rng.random(count) < 0.95] = 0.0
    elif mode == "special" and count:
        for value, k in ((np.nan, 3), (np.inf, 2), (-np.inf, 2), (-0.0, 3), (0.0, 3)):
            x[rng.integers(0, count, k)] = value
    elif mode == "signed zeros":
        x[:] = np.where(rng.random(count) < 0.5, -0.0, 0.0)
    elif mode == "nan":
        x[:] = np.nan
    elif mode == "huge":  # squares overflow float64 for float64 input
        x *= 1e200 if name == "float64" else 1e3
    elif mode == "subnormal":
        x *= np.finfo(np.float32).smallest_subnormal if name == "float32" else 1e-300
    return x.astype(FLOATS[name])


def _same(got: ChunkStats, expected: ChunkStats) -> None:
    assert (got.count, got.nonzero, got.nan, got.inf) == (
        expected.count,
        expected.nonzero,
        expected.nan,
        expected.inf,
    )
    assert got.min == expected.min
    assert got.max == expected.max
    for a, b in ((got.sum, expected.sum), (got.sumsq, expected.sumsq)):
        if np.isfinite(b):
            assert a == pytest.approx(b, rel=1e-9, abs=1e-300)
        else:
            assert a == b or (np.isnan(a) and np.isnan(b))


@settings(max_examples=120, deadline=None)
@given(
    name=st.sampled_from(sorted(FLOATS)),
    count=st.sampled_from([1, 2, 7, 8, 127, 128, 129, 255, 256, 1000, 4099]),
    seed=st.integers(0, 2**32 - 1),
    mode=st.sampled_from(
        ["dense", "sparse", "special", "signed zeros", "nan", "huge", "subnormal"]
    ),
)
def test_statistics_match_numpy(name: str, count: int, seed: int, mode: str) -> None:
    values = _values(name, count, seed, mode)
    got = chunk_stats(values)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(stats_module, "native", None)
        expected = chunk_stats(values)
    _same(got, expected)


def test_statistics_of_a_chunk_with_special_values_in_every_block() -> None:
    """The kernel sums blocks without infinities or NaN without a branch: mixed blocks too."""
    values = np.random.default_rng(3).standard_normal(128 * 40).astype(np.float32)
    values[::129] = np.nan
    values[5::257] = np.inf
    got = chunk_stats(values)
    finite = values[np.isfinite(values)].astype(np.float64)
    assert got.nan == np.isnan(values).sum() > 30
    assert got.inf == np.isinf(values).sum() > 10
    assert got.max == np.inf
    assert got.min == finite.min()
    assert got.sum == pytest.approx(float(np.sum(finite)), rel=1e-12)
    assert got.sumsq == pytest.approx(float(np.sum(finite * finite)), rel=1e-12)


def test_sums_are_pairwise_accurate() -> None:
    """A million float64 values that a running sum would round badly: within 1e-13 of fsum."""
    import math

    values = np.random.default_rng(0).standard_normal(1_000_003) + 1e6
    got = chunk_stats(values)
    exact = math.fsum(values.tolist())
    assert abs(got.sum - exact) <= 1e-13 * abs(exact)


def test_kernels_refuse_bad_arguments() -> None:
    assert native is not None
    data = np.zeros(12, np.uint8)
    with pytest.raises(ValueError, match="width must be"):
        native.split(data, np.empty_like(data), 3, False)
    with pytest.raises(ValueError, match="sign moves only"):
        native.split(data, np.empty_like(data), 8, True)
    with pytest.raises(ValueError, match="same whole number"):
        native.split(data, np.empty(8, np.uint8), 4, False)
    with pytest.raises(TypeError, match="writable"):
        native.split(data, bytes(12), 4, False)
    with pytest.raises(TypeError, match="contiguous"):
        native.split(np.zeros(24, np.uint8)[::2], np.empty(12, np.uint8), 4, False)
    with pytest.raises(ValueError, match="plane 1 holds"):
        native.join([data[:3], data[:2], data[:3], data[:3]], data, False)
    with pytest.raises(ValueError, match="unknown kind"):
        native.float_stats(data, "x")
    with pytest.raises(ValueError, match="not whole"):
        native.float_stats(data[:6], "f")


def test_unaligned_data_gives_the_same_statistics() -> None:
    assert native is not None
    values = np.random.default_rng(1).standard_normal(1000).astype(np.float32)
    raw = np.zeros(4001, np.uint8)
    raw[1:] = values.view(np.uint8)
    assert native.float_stats(raw[1:], "f") == native.float_stats(values.view(np.uint8), "f")


def test_no_kernels_in_the_environment_turns_them_off() -> None:
    code = "from gradpipe.core.kernels import native; print(native is None)"
    env = {**os.environ, "GRADPIPE_NO_KERNELS": "1"}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "True", out.stderr
