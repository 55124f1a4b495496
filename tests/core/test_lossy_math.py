"""The pure math under the lossy codecs: rounding, top-k, error feedback, QSGD, JL, errors."""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gradpipe.codecs.ops.half_precision import (
    BF16_MAX,
    bf16_bits,
    bf16_truncate_bits,
    from_bf16_bits,
    to_fp16,
)
from gradpipe.codecs.ops.lowrank import low_rank_factors, low_rank_product, worth_factoring
from gradpipe.codecs.ops.projection import jl_epsilon, jl_min_dim, quantize_ternary
from gradpipe.codecs.ops.qsgd import dequantize_qsgd, qsgd_variance_bound, quantize_qsgd
from gradpipe.codecs.ops.sparsify import error_feedback, topk_count, topk_indices
from gradpipe.core.lossy import ChunkError, ErrorBound, LossyInfo, measure_error
from gradpipe.errors import InvalidInputError


def test_bf16_rounding_matches_ml_dtypes_on_every_kind_of_word() -> None:
    rng = np.random.default_rng(0)
    words = rng.integers(0, 2**32, size=1_000_000, dtype=np.uint64).astype(np.uint32)
    # ties, and the words around them, on purpose
    ties = (rng.integers(0, 2**16, 10_000, dtype=np.uint64).astype(np.uint32) << 16) | 0x8000
    words = np.concatenate([words, ties, ties + 1, ties - 1])
    x = words.view(np.float32)
    ours = bf16_bits(x)
    with np.errstate(invalid="ignore"):  # ml_dtypes warns about casting NaNs
        theirs = x.astype(ml_dtypes.bfloat16).view(np.uint16)
    finite = np.isfinite(x)
    assert np.array_equal(ours[finite], theirs[finite])
    assert np.isnan(from_bf16_bits(ours[np.isnan(x)])).all()


def test_bf16_ties_go_to_even_and_truncation_does_not() -> None:
    x = np.float32([1 + 2**-8, 1 + 3 * 2**-8, -(1 + 2**-8), 1 + 2**-8 + 2**-20])
    assert from_bf16_bits(bf16_bits(x)).tolist() == [1.0, 1 + 2**-6, -1.0, 1 + 2**-7]
    assert from_bf16_bits(bf16_truncate_bits(x)).tolist() == [1.0, 1 + 2**-7, -1.0, 1.0]
    assert np.isinf(from_bf16_bits(bf16_bits(np.float32([3.4e38])))).all()
    assert from_bf16_bits(bf16_bits(np.float32([BF16_MAX]))).tolist() == [BF16_MAX]


def test_bf16_from_float64_rounds_once() -> None:
    # 1 + 2^-8 + 2^-30 is above the tie: direct rounding goes up, through float32 it would tie
    x = np.float64([1 + 2**-8 + 2**-30])
    assert from_bf16_bits(bf16_bits(x)).tolist() == [1 + 2**-7]


def test_fp16_counts_overflows() -> None:
    half, overflows = to_fp16(np.float64([65519.99, 65520, -1e6, np.inf, np.nan]))
    assert overflows == 2
    assert half[0] == 65504


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 10_000), st.floats(1e-6, 1.0))
def test_topk_keeps_at_least_the_fraction(size: int, fraction: float) -> None:
    k = topk_count(size, fraction)
    assert k >= fraction * size - 1e-6 * size
    assert k <= size
    assert k < fraction * size + 1 or k == 1


def test_topk_indices_break_ties_by_position() -> None:
    x = np.array([1.0, -2.0, 2.0, 2.0, 0.5])
    assert topk_indices(x, 2).tolist() == [1, 2]
    assert topk_indices(x, 0).tolist() == []
    assert topk_indices(x, 9).tolist() == [0, 1, 2, 3, 4]


def test_error_feedback_carries_what_was_dropped() -> None:
    def top1(v: np.ndarray) -> np.ndarray:
        out = np.zeros_like(v)
        out[topk_indices(v, 1)] = v[topk_indices(v, 1)]
        return out

    residual = None
    sent_total = np.zeros(3)
    grads = [np.array([1.0, 0.4, 0.3])] * 6
    for g in grads:
        sent, residual = error_feedback(g, residual, top1)
        sent_total += sent
    # nothing is lost: what was sent plus what is carried is everything
    assert np.allclose(sent_total + residual, np.sum(grads, axis=0))
    assert sent_total[1] > 0  # the small coordinates get their turn
    with pytest.raises(InvalidInputError, match="residual has shape"):
        error_feedback(np.ones(4), np.zeros(3), top1)


def test_qsgd_levels_and_variance_bound() -> None:
    x = np.array([0.6, -0.8, 0.0, 0.0])
    q, norms = quantize_qsgd(x, 10, 2, np.random.default_rng(0))
    assert q.tolist() == [6, -8, 0, 0]
    assert norms.tolist() == [1.0, 0.0]
    assert dequantize_qsgd(q, norms, 10, 2).tolist() == [0.6, -0.8, 0.0, 0.0]
    assert qsgd_variance_bound(1, 4) == 2.0  # √d/s < d/s²
    assert qsgd_variance_bound(4, 4) == 0.25  # d/s² < √d/s


def test_low_rank_is_a_projection() -> None:
    rng = np.random.default_rng(1)
    m = rng.standard_normal((30, 40))
    p, q = low_rank_factors(m, 3, seed=2)
    approx = low_rank_product(p, q)
    assert np.linalg.norm(m - approx) <= np.linalg.norm(m)
    assert np.allclose(p.T.astype(np.float64) @ p, np.eye(3), atol=1e-6)
    assert not worth_factoring(5, 5, 3)


def test_jl_bound_functions_agree() -> None:
    for points in (1, 10, 1000):
        k = jl_min_dim(0.2, points=points)
        assert jl_epsilon(k, points=points) <= 0.2
        assert jl_epsilon(k - 1, points=points) > 0.2
    assert jl_epsilon(8, points=1000) == math.inf
    with pytest.raises(InvalidInputError):
        jl_epsilon(0)


def test_ternary_is_the_seeds() -> None:
    t, scale = quantize_ternary(np.zeros(5))
    assert scale == 1.0
    assert t.tolist() == [0] * 5


def test_measure_error_handles_non_finite_values() -> None:
    x = np.array([1.0, np.nan, np.inf, 70000.0])
    y = np.array([1.5, np.nan, np.inf, np.inf])
    e = measure_error(x, y)
    assert e.max_abs == math.inf
    assert e.overflows == 1
    assert e.rel_l2 == math.inf
    exact = measure_error(x[:3], x[:3])
    assert exact.max_abs == 0
    assert exact.rel_l2 == 0
    merged = ChunkError.merge([measure_error([3.0], [3.0]), measure_error([4.0], [4.5])])
    assert merged.rel_l2 == pytest.approx(0.1)


def test_lossy_info_round_trips() -> None:
    bound = ErrorBound("x", relative=2.0**-8)
    info = LossyInfo.of({"id": "gradpipe_bf16", "dtype": "float32"}, "bf16", bound, ChunkError())
    assert LossyInfo.from_dict(info.to_dict()) == info
    with pytest.raises(TypeError):
        LossyInfo.from_dict({**info.to_dict(), "codec": []})
