"""Weights over the whole float64 range, and results that do not fit: against exact rationals.

Issue 18, item 2: weights that are positive and finite but extreme made the
products ``w_i * x_i`` or the total weight underflow or overflow, so FedAvg
returned a wrong average with no error, and ``sum`` stored infinities. Here
every result is checked against the exact weighted mean (``fractions.Fraction``)
within the bound the module docstring of :mod:`gradpipe.aggregation.reduce`
states, or must be a refusal that says the result does not fit.
"""

from __future__ import annotations

import math
import sys
import warnings
from fractions import Fraction

import ml_dtypes
import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from gradpipe.aggregation.inputs import parse_weight_text, parse_weights
from gradpipe.aggregation.privacy import apply_scale
from gradpipe.aggregation.reduce import combine, finish, partial_of, reduce_peers, weight_shift
from gradpipe.aggregation.robust import bulyan_combine, median, trimmed_mean
from gradpipe.errors import InvalidInputError

DBL_MAX = sys.float_info.max
TINY = 5e-324  # the smallest positive float64 (a subnormal)

#: Positive finite float64 weights, every binade as likely as another, subnormals included.
weights_st = st.one_of(
    st.floats(min_value=TINY, max_value=DBL_MAX),
    st.builds(math.ldexp, st.floats(0.5, 1.0, exclude_max=True), st.integers(-1073, 1023)).filter(
        lambda w: w > 0
    ),
)


def _values(dtype: np.dtype) -> st.SearchStrategy[float]:
    width = {2: 16, 4: 32, 8: 64}[dtype.itemsize]
    return st.floats(allow_nan=False, allow_infinity=False, width=width)


def _exact(chunks: list[np.ndarray], weights: list[float], divide: bool) -> list[Fraction]:
    total = sum(Fraction(w) for w in weights) if divide else Fraction(1)
    return [
        sum(Fraction(w) * Fraction(float(c[j])) for c, w in zip(chunks, weights, strict=True))
        / total
        for j in range(chunks[0].size)
    ]


def _check(
    result: np.ndarray | InvalidInputError,
    chunks: list[np.ndarray],
    weights: list[float],
    divide: bool,
) -> None:
    """Within the documented bound of the exact value, or refused because it does not fit."""
    n = len(chunks)
    dtype = chunks[0].dtype
    largest = Fraction(float(np.finfo(dtype).max))
    d = sum(Fraction(w) for w in weights) if divide else Fraction(1)
    exact = _exact(chunks, weights, divide)
    bounds = []
    for j in range(chunks[0].size):
        magnitude = sum(
            Fraction(w) * abs(Fraction(float(c[j]))) for c, w in zip(chunks, weights, strict=True)
        )
        accumulation = (4 * (n - 1).bit_length() + 4) * Fraction(1, 2**53) * magnitude / d
        underflow = n * n * Fraction(1, 2**1073) * Fraction(max(weights)) / d
        bounds.append((magnitude / d, accumulation + underflow))
    if isinstance(result, InvalidInputError):
        # A refusal only where the value, or the float64 sum of the scaled terms, may not fit.
        assert "beyond" in str(result) or "overflows" in str(result), str(result)
        assert any(
            abs(e) + b >= largest or m * (1 + Fraction(1, 2**40)) >= Fraction(DBL_MAX)
            for e, (m, b) in zip(exact, bounds, strict=True)
        ), f"refused a result that fits: {result}"
        return
    assert result.dtype == dtype
    assert np.isfinite(result).all(), result
    for j, (e, (_, bound)) in enumerate(zip(exact, bounds, strict=True)):
        got = Fraction(float(result.reshape(-1)[j]))
        ulp = _ulp(max(abs(e), abs(got)), dtype)
        assert abs(got - e) <= bound + ulp, (j, float(got), float(e))


def _ulp(x: Fraction, dtype: np.dtype) -> Fraction:
    """The larger gap of ``dtype`` around ``x`` (at most its largest finite value)."""
    v = np.asarray(min(float(x), float(np.finfo(dtype).max)), dtype=dtype)
    with np.errstate(over="ignore"):  # above the largest value: no gap
        below = v - np.nextafter(v, np.zeros((), dtype))
        above = np.nextafter(v, np.asarray(np.inf, dtype)) - v
    gaps = [g for g in (below, above) if np.isfinite(g)]
    return Fraction(float(max(gaps)))


def _reduce(
    chunks: list[np.ndarray], weights: list[float], method: str
) -> np.ndarray | InvalidInputError:
    try:
        return reduce_peers(chunks, method=method, weights=weights)
    except InvalidInputError as exc:
        return exc


@st.composite
def _steps(draw: st.DrawFn) -> tuple[list[np.ndarray], list[float]]:
    dtype = np.dtype(draw(st.sampled_from(["float16", "float32", "float64"])))
    n = draw(st.integers(1, 9))
    size = draw(st.integers(1, 3))
    values = st.lists(_values(dtype), min_size=size, max_size=size)
    chunks = [np.array(draw(values), dtype=dtype) for _ in range(n)]
    weights = draw(st.lists(weights_st, min_size=n, max_size=n))
    return chunks, weights


@settings(max_examples=400, deadline=None)
@given(step=_steps(), method=st.sampled_from(["fedavg", "weighted-mean", "sum"]))
@example(
    step=([np.array([0.3, 1.0], np.float32), np.array([0.5, 2.0], np.float32)], [TINY, TINY]),
    method="fedavg",
)  # was [0.0, 1.5]: both products underflowed
@example(
    step=([np.array([0.3, 1.0], np.float32), np.array([0.5, 2.0], np.float32)], [1e-320, TINY]),
    method="fedavg",
)  # was 0.29975: 1e-320 * 0.3 lost its bits
@example(
    step=([np.array([0.3, 1.0], np.float32), np.array([0.5, 2.0], np.float32)], [1e308, 1e308]),
    method="fedavg",
)  # was refused: the total weight overflowed
@example(
    step=([np.array([1.0], np.float64), np.array([1e300], np.float64)], [1e300, 1e-20]),
    method="fedavg",
)  # peer 1's share 1e-320 underflowed to a subnormal: 1e-20 lost most of its bits
@example(
    step=([np.array([6e4], np.float16), np.array([6e4], np.float16)], [1.0, 1.0]),
    method="sum",
)  # was [inf], stored with exit 0: now refused
def test_weighted_reductions_match_exact_rationals_over_the_whole_float64_range(
    step: tuple[list[np.ndarray], list[float]], method: str
) -> None:
    chunks, weights = step
    result = _reduce(chunks, weights, method)
    _check(result, chunks, weights, divide=method != "sum")


@settings(max_examples=150, deadline=None)
@given(step=_steps(), method=st.sampled_from(["fedavg", "sum"]), group=st.integers(1, 4))
def test_every_tree_of_partials_gives_the_bits_of_the_one_call_reduction(
    step: tuple[list[np.ndarray], list[float]], method: str, group: int
) -> None:
    """The graph reduces groups of peers with the step's weight_shift: the same bits."""
    chunks, weights = step
    shift = weight_shift(weights)
    parts = [
        partial_of(chunks[i : i + group], first=i, weights=weights[i : i + group], shift=shift)
        for i in range(0, len(chunks), group)
    ]
    whole = _reduce(chunks, weights, method)
    state = combine(parts) if len(parts) > 1 else parts[0]
    if isinstance(whole, InvalidInputError):  # refused either way
        with pytest.raises(InvalidInputError, match="element"):
            finish(state, method=method)
        return
    assert finish(state, method=method).tobytes() == whole.tobytes()


@settings(max_examples=100, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    n=st.integers(1, 12),
    shift=st.integers(-60, 60),
    scaled=st.booleans(),
)
def test_a_power_of_two_shift_changes_no_bit_for_ordinary_weights(
    seed: int, n: int, shift: int, scaled: bool
) -> None:
    """Existing aggregates (and their ids) keep their bits: num_examples-like weights and
    clipping factors, float32 updates, every shift of the weights gives the unshifted bits."""
    rng = np.random.default_rng(seed)
    chunks = [(rng.standard_normal(64) * 10.0 ** rng.uniform(-3, 2)).astype(np.float32)]
    chunks += [(rng.standard_normal(64) * 10.0 ** rng.uniform(-3, 2)).astype(np.float32)]
    chunks = (chunks * n)[:n]
    weights = [float(w) for w in rng.integers(1, 100_000, n)]
    scales = [float(s) for s in rng.uniform(0.01, 1.0, n)] if scaled else None
    for method in ("fedavg", "sum"):
        plain = finish(partial_of(chunks, weights=weights, scales=scales), method=method)
        shifted = partial_of(chunks, weights=weights, scales=scales, shift=shift)
        assert finish(shifted, method=method).tobytes() == plain.tobytes()
        one_call = reduce_peers(chunks, method=method, weights=weights, scales=scales)
        assert one_call.tobytes() == plain.tobytes()


@given(exponent=st.integers(-1074, 1023), n=st.integers(1, 9), seed=st.integers(0, 1000))
@settings(max_examples=100, deadline=None)
def test_equal_weights_of_any_magnitude_give_the_mean_bit_for_bit(
    exponent: int, n: int, seed: int
) -> None:
    rng = np.random.default_rng(seed)
    chunks = [rng.standard_normal(16).astype(np.float32) for _ in range(n)]
    weights = [math.ldexp(1.0, exponent)] * n
    mean = reduce_peers(chunks, method="mean")
    assert reduce_peers(chunks, method="fedavg", weights=weights).tobytes() == mean.tobytes()


def test_a_weight_far_below_the_others_still_counts() -> None:
    """A share below float64's normal range (1e-320 of the total) keeps its 53 bits."""
    chunks = [np.array([0.0]), np.array([1e300])]
    weights = [1e300, 1e-20]
    out = reduce_peers(chunks, method="fedavg", weights=weights)
    exact = Fraction(weights[1]) * Fraction(1e300) / (Fraction(weights[0]) + Fraction(weights[1]))
    assert abs(Fraction(float(out[0])) - exact) <= 4 * Fraction(math.ulp(float(exact)))


def test_weight_shift_bounds_the_total_weight() -> None:
    assert weight_shift([1.0]) == -1
    assert weight_shift([1.0] * 8) == -4
    assert weight_shift([TINY, 3.0]) == -3
    for weights in ([DBL_MAX] * 9, [TINY] * 3, [TINY, DBL_MAX], [3.0, 7.0, 1e-300]):
        shifted = [Fraction(math.ldexp(w, weight_shift(weights))) for w in weights]
        assert sum(shifted) < 1
        assert max(shifted) >= Fraction(1, 4 * len(weights))
    with pytest.raises(InvalidInputError, match="weight"):
        weight_shift([1.0, 0.0])


def test_partials_of_different_shifts_do_not_combine() -> None:
    chunks = [np.ones(2, np.float32)] * 2
    left = partial_of(chunks[:1], weights=[1.0], shift=-1)
    right = partial_of(chunks[1:], first=1, weights=[1.0], shift=0)
    with pytest.raises(InvalidInputError, match="weight_shift"):
        combine([left, right])
    with pytest.raises(InvalidInputError, match="weight shift"):
        partial_of(chunks, shift=1.5)  # type: ignore[arg-type]
    with pytest.raises(InvalidInputError, match="overflows float64; pass weight_shift"):
        partial_of(chunks, weights=[1e300, 1.0], shift=100)


# --- results that do not fit the output dtype -----------------------------------------


@pytest.mark.parametrize(
    ("dtype", "value"),
    [
        (np.float16, 40000.0),
        (np.float32, 2e38),
        (ml_dtypes.bfloat16, 2e38),
    ],
)
def test_a_sum_beyond_the_dtype_is_refused_naming_step_tensor_and_element(
    dtype: type, value: float
) -> None:
    chunks = [np.array([1.0, value, -1.0], dtype=dtype) for _ in range(3)]
    with pytest.raises(InvalidInputError) as caught:
        reduce_peers(chunks, method="sum", step=4, tensor="w")
    message = str(caught.value)
    assert message.startswith("step 4, tensor 'w': element 1 of the result")
    assert f"beyond {np.dtype(dtype)}" in message
    # the mean of the same updates fits, and is the value
    assert float(reduce_peers(chunks, method="mean")[1]) == float(np.asarray(value, dtype))


def test_a_float64_sum_that_overflows_float64_is_refused() -> None:
    chunks = [np.array([DBL_MAX, 1.0])] * 2
    with pytest.raises(InvalidInputError, match=r"element 0 of the result is inf"):
        reduce_peers(chunks, method="sum")
    assert reduce_peers(chunks, method="mean").tolist() == [DBL_MAX, 1.0]  # was refused
    # the tree path (a graph's partials, combined then finished) refuses it too
    parts = [partial_of([c], first=i, shift=weight_shift([1.0, 1.0])) for i, c in enumerate(chunks)]
    with pytest.raises(InvalidInputError, match="inf"):
        finish(parts, method="sum")


def test_dp_noise_that_does_not_fit_is_refused() -> None:
    parts = [partial_of([np.zeros(3, np.float32)] * 2)]
    noise = np.array([0.0, 1e39, 0.0])
    with pytest.raises(InvalidInputError, match=r"element 1 of the result is 1e\+39"):
        finish(parts, method="dp-fedavg", noise=noise)


def test_every_other_rounding_refuses_a_result_that_does_not_fit() -> None:
    """Median, trimmed mean, Bulyan and aggregate clipping round through the same check."""
    chunks = [np.array([1.0, 1e300]) for _ in range(7)]
    for compute in (
        lambda: median(chunks, dtype="float32", tensor="w"),
        lambda: trimmed_mean(chunks, 0.1, dtype="float32", tensor="w"),
        lambda: bulyan_combine(chunks, 1, dtype="float32", tensor="w"),
        lambda: apply_scale(np.array([1.0, 1e300]), 0.5, dtype="float32"),
    ):
        with pytest.raises(InvalidInputError, match=r"element 1 of the result is .*float32"):
            compute()
    assert median([c[:1] for c in chunks], dtype="float32").tolist() == [1.0]


def test_valid_results_near_the_largest_value_raise_no_overflow_warning() -> None:
    """Finite results whose sum passes the range are checked without a numpy warning."""
    chunks = [np.full(4, 3e38, np.float32)] * 3
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert median(chunks, dtype="float32").tolist() == [np.float32(3e38)] * 4
        assert trimmed_mean(chunks, 0.0, dtype="float32").tolist() == [np.float32(3e38)] * 4


@pytest.mark.parametrize("text", ["NaN", "sNaN", "-nan", "snan", "Infinity", "abc", ""])
def test_weights_written_as_text_that_are_no_number_are_refused(text: str) -> None:
    with pytest.raises(InvalidInputError, match="num_examples"):
        parse_weights([parse_weight_text(text, what="num_examples")])
