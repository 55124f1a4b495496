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


def _gradient_like(count: int, dtype: np.dtype) -> np.ndarray:
    """Products of two uniforms (splitmix64 bits): a peaked spread of exponents, random signs."""
    z = np.arange(1, count + 1, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    z ^= z >> np.uint64(31)
    a = (z >> np.uint64(32)).astype(np.float64) / 2**32 - 0.5
    b = (z & np.uint64(0xFFFFFFFF)).astype(np.float64) / 2**32 - 0.5
    return (a * b * 1e-3).astype(dtype)


@pytest.mark.parametrize("name", ["float32", "bfloat16", "float16", "int64"])
@pytest.mark.parametrize("count", [5_000, 65_536, 65_537, 200_003])
def test_frames_are_the_same_with_and_without_the_kernels(
    name: str, count: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Chunks below and above the sampled size: the same bytes, the sign moved where it can."""
    dtype = FLOATS.get(name, np.dtype(name))
    if dtype.kind in "iu":
        array = (np.arange(count) % 50).astype(dtype)
    else:
        array = _gradient_like(count, dtype)
    codec = ByteGroupCodec(name)
    frame = bytes(codec.encode(array))
    if name in ("float32", "bfloat16"):
        assert frame[6] & 1  # _FLAG_SIGN_MOVED: the kernels' sign move was exercised
    monkeypatch.setattr(_planes, "native", None)
    assert bytes(codec.encode(array)) == frame
    assert codec.decode(frame).tobytes() == array.tobytes()
    monkeypatch.undo()
    assert codec.decode(frame).tobytes() == array.tobytes()


@pytest.mark.parametrize("name", ["float32", "bfloat16", "float16", "int64"])
@pytest.mark.parametrize("count", [100, 65_536, 65_537, 200_003])
def test_settings_from_the_sample_are_those_from_the_whole_planes(name: str, count: int) -> None:
    """encode plans on the planes of the sample's elements (then splits once); planning on
    the whole chunk's planes, as encode did before, takes the same samples: same settings."""
    from gradpipe.codecs.bytegroup import _sample_words

    dtype = FLOATS.get(name, np.dtype(name))
    array = _gradient_like(count, dtype) if dtype.kind == "f" else np.arange(count).astype(dtype)
    data = array.view(np.uint8)
    codec = ByteGroupCodec(name)
    width = dtype.itemsize
    sample = _sample_words(data, width)
    whole_flags, whole_settings, _ = codec._plan(_planes.split_planes(data, width), sample)
    flags, settings, _ = codec._plan(_planes.split_planes(sample, width), sample)
    assert (flags, settings) == (whole_flags, whole_settings)


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
    elif mode == "subnormal":  # below each dtype's smallest normal number
        x *= {"float32": 1e-40, "bfloat16": 1e-40, "float16": 1e-6, "float64": 1e-310}[name]
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
    """1.0 and a million 1e-16: a running sum stays at 1.0 (off by 1e-10), pairwise sums keep
    all but the few small values that share the first lane with the 1.0."""
    values = np.full(1_000_000, 1e-16)
    values[0] = 1.0
    got = chunk_stats(values)
    exact = 1.0 + 999_999e-16
    assert abs(got.sum - exact) <= 1e-14


@pytest.mark.parametrize("name", sorted(FLOATS))
@pytest.mark.parametrize(
    "values", [[-0.0] * 300, [-0.0, 1.0, 2.0, 3.0], [1.0, -0.0] * 128, [-1.0, 0.0, -0.0] * 50]
)
def test_a_zero_in_the_range_is_positive_zero(name: str, values: list[float]) -> None:
    """-0.0 and 0.0 are the same number; the record (and so the tensor id) must not depend
    on which one a reduction happened to return."""
    array = np.array(values).astype(FLOATS[name])
    for use_kernels in (True, False):
        with pytest.MonkeyPatch.context() as patch:
            if not use_kernels:
                patch.setattr(stats_module, "native", None)
            stats = chunk_stats(array)
        for bound in (stats.min, stats.max):
            assert bound is not None
            if bound == 0.0:
                assert not np.signbit(bound), (use_kernels, stats)


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
    with pytest.raises(ValueError, match="width must be"):
        native.join([data[:4]] * 3, data, False)
    with pytest.raises(ValueError, match="width must be"):
        native.join([data[:1]] * 12, data, False)
    with pytest.raises(ValueError, match="not whole"):
        native.join([data[:5]] * 2, data[:11], False)
    with pytest.raises(ValueError, match="sign moves only"):
        native.join([np.zeros(1, np.uint8)] * 8, np.zeros(8, np.uint8), True)
    with pytest.raises(TypeError, match="contiguous"):
        native.join([np.zeros(12, np.uint8)[::2]] * 2, np.empty(12, np.uint8), False)
    with pytest.raises(ValueError, match="unknown kind"):
        native.float_stats(data, "x")
    with pytest.raises(ValueError, match="not whole"):
        native.float_stats(data[:6], "f")


def test_unaligned_data_gives_the_same_planes_and_statistics() -> None:
    assert native is not None
    values = np.random.default_rng(1).standard_normal(1000).astype(np.float32)
    raw = np.zeros(4001, np.uint8)
    raw[1:] = values.view(np.uint8)
    assert native.float_stats(raw[1:], "f") == native.float_stats(values.view(np.uint8), "f")
    aligned, shifted = np.empty(4000, np.uint8), np.zeros(4001, np.uint8)
    native.split(values.view(np.uint8), aligned, 4, True)
    native.split(raw[1:], shifted[1:], 4, True)
    np.testing.assert_array_equal(aligned, shifted[1:])
    back = np.zeros(4001, np.uint8)
    native.join([shifted[1 + 1000 * k : 1 + 1000 * (k + 1)] for k in range(4)], back[1:], True)
    np.testing.assert_array_equal(back[1:], values.view(np.uint8))


def test_no_kernels_in_the_environment_turns_them_off() -> None:
    code = "from gradpipe.core.kernels import native; print(native is None)"
    env = {**os.environ, "GRADPIPE_NO_KERNELS": "1"}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "True", out.stderr


def _documented_sums(values: np.ndarray) -> tuple[float, float]:
    """The kernel's float32 and bfloat16 summation order, in Python: 8 lanes per full block
    of 128 finite values (one lane for a block with a NaN or an infinity, or the last, short
    one), the lanes added in order, the blocks' sums added pairwise by a binary counter."""
    partials: dict[str, list[float]] = {"sum": [0.0] * 64, "sumsq": [0.0] * 64}
    wide = values.astype(np.float64).tolist()
    for number, start in enumerate(range(0, len(wide), 128)):
        block = wide[start : start + 128]
        lanes = 8 if len(block) == 128 and all(np.isfinite(block)) else 1
        for key, square in (("sum", False), ("sumsq", True)):
            lane_sums = [0.0] * 8
            for i, value in enumerate(block):
                if np.isfinite(value):
                    lane_sums[i % lanes] += value * value if square else value
            total = 0.0
            for lane_sum in lane_sums:
                total += lane_sum
            level, n = 0, number
            while n & 1:
                total += partials[key][level]
                partials[key][level] = 0.0
                n >>= 1
                level += 1
            partials[key][level] = total
    result = []
    for key in ("sum", "sumsq"):
        total = 0.0
        for partial in partials[key]:
            total += partial
        result.append(total)
    return result[0], result[1]


@pytest.mark.parametrize("name", ["float32", "bfloat16"])
@pytest.mark.parametrize("count", [128 * 37, 128 * 37 + 50, 1000])
def test_sums_follow_the_documented_order_bit_for_bit(name: str, count: int) -> None:
    """The order is fixed whatever vector width the compiler used (the machine may run the
    AVX2 or AVX-512 clone): reassociated or fused sums would differ in their last bits."""
    rng = np.random.default_rng(count)
    values = (rng.standard_normal(count) * 1e3).astype(FLOATS[name])
    values[7] = np.inf  # one block takes the value-by-value path
    got = chunk_stats(values)
    assert (got.sum, got.sumsq) == _documented_sums(values)


# --- the aggregation forest ------------------------------------------------------------------


class _CountingForest:
    """The compiled module, counting the forest calls that ran to the end (returned None)."""

    def __init__(self) -> None:
        self.calls = 0

    def forest(self, *args):
        failed = native.forest(*args)
        self.calls += failed is None
        return failed


def _both_ways(run, *, compiled: bool = False):
    """``run()`` with the compiled forest, then with numpy's: (result, error) of each.

    With ``compiled``, also asserts that the first run, unless it was refused, called the
    compiled forest.
    """
    from gradpipe.aggregation import kernel

    counting = _CountingForest()
    outcomes = []
    for native_module in (counting, None):
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(kernel, "native", native_module)
            try:
                outcomes.append((run(), None))
            except Exception as exc:  # the two must fail alike
                outcomes.append((None, f"{type(exc).__name__}: {exc}"))
    assert counting.calls > 0 or not compiled or outcomes[0][1] is not None
    return outcomes


def _same_outcomes(outcomes) -> None:
    (got, got_error), (want, want_error) = outcomes
    assert got_error == want_error
    if want_error is None:
        if isinstance(want, list):
            assert [a.tobytes() for a in got] == [a.tobytes() for a in want]
        else:
            assert got.dtype == want.dtype
            assert got.tobytes() == want.tobytes()


@settings(max_examples=80, deadline=None)
@given(
    n=st.integers(1, 17),
    size=st.sampled_from([0, 1, 7, 2047, 2048, 2049, 5000, 32768 + 3]),
    dtype=st.sampled_from(["float32", "float64", "float16", "bfloat16"]),
    method=st.sampled_from(["sum", "mean", "weighted-mean", "fedavg"]),
    tiny=st.booleans(),
    group=st.sampled_from([1, 2, 3, 4, 8]),
    noise=st.booleans(),
    seed=st.integers(0, 2**32 - 1),
)
def test_the_compiled_forest_gives_numpys_bits(
    n: int, size: int, dtype: str, method: str, tiny: bool, group: int, noise: bool, seed: int
) -> None:
    """Whole reductions, groups of peers finished as a list and combined: the same bits, with
    weights so small that their coefficients carry an exponent, noise, every result dtype."""
    from gradpipe.aggregation.reduce import combine, finish, partial_of, reduce_peers

    rng = np.random.default_rng(seed)
    scales = 10.0 ** rng.uniform(-3, 3, size=n)
    chunks = [(rng.standard_normal(size) * s).astype(FLOATS[dtype]) for s in scales]
    weights = [float(w) for w in rng.integers(1, 1000, n)]
    if tiny:
        weights = [w * 2.0**-1070 for w in weights]  # subnormal weights: terms scaled by 2**e
    factors = [float(s) for s in rng.uniform(0.01, 1.0, n)]
    if method in ("sum", "mean"):  # unweighted: weights would be refused
        weights = None
    compiled = dtype in ("float32", "float64") and size > 0
    _same_outcomes(
        _both_ways(
            lambda: reduce_peers(chunks, method=method, weights=weights, scales=factors),
            compiled=compiled,
        )
    )

    added = rng.standard_normal(size) if noise else None

    def grouped():
        parts = [
            partial_of(
                chunks[i : i + group],
                first=i,
                weights=None if weights is None else weights[i : i + group],
                scales=factors[i : i + group],
            )
            for i in range(0, n, group)
        ]
        return [
            *[b.total.reshape(-1) for part in parts for b in part.blocks],
            finish(parts, method=method, peers=n, noise=added),
            finish(combine(parts), method=method, peers=n, dtype="float64"),
        ]

    _same_outcomes(_both_ways(grouped, compiled=compiled))


@pytest.mark.parametrize("where", [0, 2047, 2048, 5000])
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_the_compiled_forest_refuses_what_numpy_refuses(where: int, bad: float) -> None:
    """A NaN or an infinity in a peer, a float64 sum that overflows, a float32 result past
    float32's range: the same error, naming the same element, from both."""
    from gradpipe.aggregation.reduce import finish, partial_of, reduce_peers

    chunks = [np.ones(6000, np.float32) for _ in range(5)]
    chunks[3] = chunks[3].copy()
    chunks[3][where] = bad
    outcomes = _both_ways(lambda: reduce_peers(chunks, peers=list("abcde")))
    assert outcomes[0][1] is not None
    assert "peer 'd'" in outcomes[0][1]
    _same_outcomes(outcomes)
    _same_outcomes(_both_ways(lambda: partial_of(chunks, names=list("abcde"))))
    huge = [np.full(6000, 1e308) for _ in range(2)]
    _same_outcomes(_both_ways(lambda: partial_of(huge)))
    past = [np.ones(6000, np.float32) for _ in range(3)]
    for peer in (1, 2):  # 6e38 in float64, past float32's 3.4e38
        past[peer] = past[peer].copy()
        past[peer][where] = 3e38
    outcomes = _both_ways(lambda: reduce_peers(past, method="sum"))
    assert outcomes[0][1] is not None
    assert f"element {where} " in outcomes[0][1]
    _same_outcomes(outcomes)
    parts = [partial_of(past)]
    _same_outcomes(_both_ways(lambda: finish(parts, method="sum", noise=np.full(6000, np.nan))))


def test_the_forest_kernel_refuses_bad_arguments() -> None:
    """Inconsistent programs are a ValueError or TypeError, never a crash or a stray write."""
    data = np.ones(10, np.float32)
    out = np.empty(10, np.float32)
    good = ((0, 0, -1, 0, 2.0, 0),)
    finish = (out, "f", None, 0, None)
    assert native.forest(good, (data,), "f", 10, 1, (), (0,), finish, True) is None
    assert out.tolist() == [2.0] * 10
    bad_calls = [
        (((0, 5, -1, 0, 2.0, 0),), (data,), "f", 10, 1, (), (0,), None, True),  # no buffer 5
        (((0, 0, -2, 0, 2.0, 0),), (data,), "f", 10, 1, (), (0,), None, True),  # no input 1
        (((1, 0, -1, 0, 0.0, 0),), (data,), "f", 10, 1, (), (0,), None, True),  # float32 copy
        (((2, 0, -1, 0, 0.0, 0),), (data,), "f", 10, 1, (), (0,), None, True),  # float32 add
        (((9, 0, -1, 0, 0.0, 0),), (data,), "f", 10, 1, (), (0,), None, True),  # no such op
        (((0, 0, -1, 0),), (data,), "f", 10, 1, (), (0,), None, True),  # short op
        (good, (data,), "f", 11, 1, (), (0,), None, True),  # the input is 10 values
        (good, (data,), "e", 10, 1, (), (0,), None, True),  # float16
        (good, (data,), "ff", 10, 1, (), (0,), None, True),  # kinds and inputs differ
        (good, (data,), "f", 10, 1, (), (0,), (out, "e", None, 0, None), True),
        (good, (data,), "f", 10, 1, (), (0,), (np.empty(9, np.float32), "f", None, 0, None), True),
        (good, (data,), "f", 10, 1, (), (0,), (out, "f", None, 0, np.ones(20, np.float32)), True),
        (good, (data,), "f", 10, 1, (), (0,), (out, "d", None, 0, None), True),  # float32 out
        (good, (data,), "f", 10, 1, (), (0,), [out, "f", None, 0, None], True),  # not a tuple
        (good, (np.ones(5, np.float64),), "f", 10, 1, (), (0,), None, True),  # float64 as 'f'
        (good, (np.ones(10, np.int32),), "f", 10, 1, (), (0,), None, True),  # int32 as 'f'
        (good, (data,), "f", 10, 1, (), (-1,), None, True),  # a float32 result block
        (good, (data,), "f", 10, 1, (np.empty(20, np.float32),), (0,), None, True),
        (good, (data[::2],), "f", 5, 1, (), (0,), None, True),  # not contiguous
        (good, (np.frombuffer(bytes(41), np.float32, 10, 1),), "f", 10, 1, (), (0,), None, True),
        (good, (np.ones(1),), "d", 2**61 + 1, 1, (), (0,), None, True),  # 8 * size wraps to 8
        (((2**40, 0, -1, 0, 2.0, 0),), (data,), "f", 10, 1, (), (0,), None, True),  # code
        (((0, 0, -1, 0, 2.0, 2**33),), (data,), "f", 10, 1, (), (0,), None, True),  # exponent
        ((("0", 0, -1, 0, 2.0, 0),), (data,), "f", 10, 1, (), (0,), None, True),  # not an int
        (((0, 0, -1, 0, "2", 0),), (data,), "f", 10, 1, (), (0,), None, True),  # not a float
    ]
    for args in bad_calls:
        with pytest.raises((ValueError, TypeError, OverflowError)):
            native.forest(*args)


def test_float32_and_float64_reductions_run_compiled(monkeypatch) -> None:
    """The compiled forest is what runs for float32 and float64 peers, and not for float16."""
    from gradpipe.aggregation import kernel
    from gradpipe.aggregation.reduce import partial_of, reduce_peers

    answers: list[object] = []

    class Counting:
        def forest(self, *args):
            answers.append(native.forest(*args))
            return answers[-1]

    monkeypatch.setattr(kernel, "native", Counting())
    chunks = [np.arange(3000, dtype=np.float32) + i for i in range(3)]
    reduce_peers(chunks)
    reduce_peers([c.astype(np.float64) for c in chunks], method="sum")
    partial_of(chunks)
    assert answers == [None, None, None]
    reduce_peers([c.astype(np.float16) for c in chunks])
    assert len(answers) == 3
