"""Fidelity figures against numpy, merging, non-finite values, bound usage, error feedback."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from gradpipe.core.lossy import ErrorBound, measure_error
from gradpipe.errors import InvalidInputError
from gradpipe.evaluation.fidelity import Fidelity, bound_usage, measure_fidelity, simulate_feedback

# Gradient-like magnitudes: squares of values below 1e-154 underflow in float64 sums
# (numpy's norm rescales; float32 data squared never gets there).
magnitude = st.floats(1e-30, 1e6)
finite = st.one_of(st.just(0.0), magnitude, magnitude.map(lambda v: -v))
vectors = st.integers(1, 60).flatmap(
    lambda n: st.tuples(
        hnp.arrays(np.float64, n, elements=finite), hnp.arrays(np.float64, n, elements=finite)
    )
)


@given(vectors)
@settings(max_examples=200, deadline=None)
def test_figures_are_numpy_s(pair: tuple[np.ndarray, np.ndarray]) -> None:
    x, y = pair
    f = measure_fidelity(x, y)
    nx, ny = np.linalg.norm(x), np.linalg.norm(y)
    assert f.max_abs == (float(np.max(np.abs(y - x))))
    assert f.max_abs == measure_error(x, y).max_abs
    if nx > 0:
        assert f.rel_l2_error == pytest.approx(np.linalg.norm(y - x) / nx, rel=1e-9, abs=1e-300)
        assert f.norm_ratio == pytest.approx(ny / nx, rel=1e-9)
    else:
        assert f.norm_ratio is None
    if nx > 0 and ny > 0:
        assert f.cosine == pytest.approx(float(x @ y) / (nx * ny), rel=1e-9, abs=1e-12)
    else:
        assert f.cosine is None
    nonzero = x != 0
    if nonzero.any():
        agree = np.mean(np.sign(y[nonzero]) == np.sign(x[nonzero]))
        assert f.sign_agreement == pytest.approx(agree)
    else:
        assert f.sign_agreement is None
    assert f.bit_exact == (x.tobytes() == y.tobytes())


@given(st.lists(vectors, min_size=1, max_size=5))
@settings(max_examples=100, deadline=None)
def test_merged_chunks_are_the_chunks_end_to_end(
    pairs: list[tuple[np.ndarray, np.ndarray]],
) -> None:
    merged = Fidelity.merge(measure_fidelity(x, y) for x, y in pairs)
    whole = measure_fidelity(
        np.concatenate([x for x, _ in pairs]), np.concatenate([y for _, y in pairs])
    )
    for field in ("xx", "yy", "xy", "ee"):
        assert getattr(merged, field) == pytest.approx(getattr(whole, field), rel=1e-9, abs=1e-9)
    assert (merged.values, merged.max_abs, merged.signed, merged.same_sign) == (
        whole.values,
        whole.max_abs,
        whole.signed,
        whole.same_sign,
    )
    assert merged.chunks == len(pairs)
    assert merged.bit_exact == all(x.tobytes() == y.tobytes() for x, y in pairs)
    assert merged.worst_rel_l2 == max(measure_fidelity(x, y).rel_l2_error for x, y in pairs)


def test_an_overflow_is_counted_apart_from_the_l2_figures() -> None:
    x = np.float32([1.0, 1e5, 2.0, np.nan, -0.0])
    y = np.float32([1.5, np.inf, 2.0, np.nan, 0.0])
    f = measure_fidelity(x, y)
    assert f.overflows == 1
    assert f.max_abs == math.inf
    assert f.rel_l2_error == pytest.approx(0.5 / math.sqrt(5))  # over 1 and 2 only
    assert (f.signed, f.same_sign) == (3, 3)  # 1, 1e5 (inf keeps its sign), 2; not NaN, -0
    assert not f.bit_exact
    same = measure_fidelity(x, x.copy())
    assert same.bit_exact
    assert same.max_abs == 0
    assert same.rel_l2_error == 0
    # A value sparsified to zero disagrees in sign; -0.0 and 0.0 are not compared.
    assert measure_fidelity(np.array([2.0, -1.0]), np.array([2.0, 0.0])).sign_agreement == 0.5
    zeros = measure_fidelity(np.zeros(3), np.zeros(3))
    assert (zeros.cosine, zeros.norm_ratio, zeros.sign_agreement) == (None, None, None)
    assert measure_fidelity(np.zeros(2), np.ones(2)).rel_l2_error == math.inf
    with pytest.raises(InvalidInputError, match="3 elements, the original 2"):
        measure_fidelity(np.zeros(2), np.zeros(3))


@given(vectors, st.sampled_from([1e-3, 0.1, 0.5]))
@settings(max_examples=200, deadline=None)
def test_bound_usage_is_at_most_one_exactly_where_the_bound_holds(
    pair: tuple[np.ndarray, np.ndarray], size: float
) -> None:
    x, noise = pair
    y = x + noise * size * 1e-6
    for bound in (
        ErrorBound("rel", relative=size, absolute=1e-9),
        ErrorBound("l2", l2=size),
        ErrorBound("linf", linf=size),
        ErrorBound("all", relative=size, l2=size, linf=size),
    ):
        used = bound_usage(bound, x, y)
        assert used is not None
        if bound.holds(x, y):
            assert used <= 1 + 1e-9
        else:
            assert used > 1


def test_bound_usage_of_exact_and_statistical_bounds() -> None:
    x = np.float32([1.0, 2.0])
    assert bound_usage(ErrorBound.lossless(), x, x.copy()) == 0.0
    assert bound_usage(ErrorBound.lossless(), x, x + 1) == math.inf
    assert bound_usage(ErrorBound.lossless(), x, x.astype(np.float64)) == math.inf
    assert bound_usage(ErrorBound("sketch", reconstructs=False, norm_epsilon=0.1), x, x) is None
    assert bound_usage(ErrorBound("var", variance=0.5, unbiased=True), x, x) is None
    # An error where the bound allows none is infinitely over it.
    assert bound_usage(ErrorBound("rel", relative=0.1), np.zeros(1), np.ones(1)) == math.inf


def _keep_largest(v: np.ndarray) -> np.ndarray:
    return np.where(np.abs(v) >= np.abs(v).max(), v, 0.0)


def test_error_feedback_two_steps_by_hand() -> None:
    # Step 0 sends [3, 0], carries [0, 1]; step 1 corrects [0.5, 2.5] to [0.5, 3.5],
    # sends [0, 3.5]. Sent in all: [3, 3.5]; without feedback [3, 0] + [0, 2.5].
    fed, plain = simulate_feedback([np.array([3.0, 1.0]), np.array([0.5, 2.5])], _keep_largest)
    true = math.sqrt(3.5**2 * 2)
    assert fed.rel_l2_error == pytest.approx(0.5 / true, rel=1e-15)
    assert fed.cosine == pytest.approx((3.5 * 3 + 3.5 * 3.5) / (true * math.hypot(3, 3.5)))
    assert plain.rel_l2_error == pytest.approx(math.hypot(0.5, 1.0) / true, rel=1e-15)
    assert plain.norm_ratio == pytest.approx(math.hypot(3, 2.5) / true)
    assert fed.values == plain.values == 2


def test_error_feedback_keeps_everything_but_the_last_residual() -> None:
    # Σ sent = Σ g − e_T: the error of the accumulated updates is the final residual.
    rng = np.random.default_rng(0)
    grads = [rng.standard_normal(50) for _ in range(6)]
    fed, plain = simulate_feedback(grads, _keep_largest)
    residual = None
    from gradpipe.codecs.ops.sparsify import error_feedback

    for g in grads:
        _, residual = error_feedback(g, residual, _keep_largest)
    assert residual is not None
    assert fed.ee == pytest.approx(float(residual @ residual), rel=1e-12)
    assert fed.rel_l2_error < plain.rel_l2_error
    with pytest.raises(InvalidInputError, match="at least one step"):
        simulate_feedback([], _keep_largest)
    with pytest.raises(InvalidInputError, match="same chunk"):
        simulate_feedback([np.zeros(2), np.zeros(3)], _keep_largest)
