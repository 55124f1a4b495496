"""The seed's training utilities: accumulator, loss-scaler schedule, conversions, compressor."""

from __future__ import annotations

import math

import numpy as np
import pytest

from gradpipe.codecs.ops.projection import segment_layout
from gradpipe.errors import InvalidInputError
from gradpipe.training import (
    GradientAccumulator,
    GradientCompressor,
    LossScaler,
    TrainingConfig,
    from_bf16,
    has_nan_or_inf,
    safe_clip,
    to_bf16,
    to_fp16,
)


def test_accumulator_means_batches_and_resets() -> None:
    acc = GradientAccumulator(4)
    acc.accumulate(np.float32([1.0, 2.0, 3.0, 4.0]))
    acc.accumulate(np.float32([2.0, 4.0, 6.0, 8.0]))
    assert acc.count == 2
    result = acc.get_and_reset()
    assert result.dtype == np.float32
    assert result.tolist() == [1.5, 3.0, 4.5, 6.0]  # the seed's test, exactly
    assert acc.count == 0
    assert acc.get_and_reset().tolist() == [0.0] * 4  # nothing accumulated: zeros
    acc.accumulate(np.float32([[1, 1], [1, 1]]))  # any shape with the right size
    assert acc.get_and_reset().tolist() == [1.0] * 4


def test_accumulator_checks_dimensions() -> None:
    acc = GradientAccumulator(4)
    with pytest.raises(InvalidInputError, match="5 values, the accumulator 4"):
        acc.accumulate(np.zeros(5, dtype=np.float32))
    assert acc.count == 0


def test_accumulator_sums_in_float64() -> None:
    acc = GradientAccumulator(1)
    for value in [1e8, 1.0, -1e8]:
        acc.accumulate(np.float32([value]))
    assert acc.get_and_reset().tolist() == [pytest.approx(1 / 3)]  # float32 sums would give 0


def test_loss_scaler_reproduces_the_seed_schedule() -> None:
    scaler = LossScaler()
    assert scaler.scale == 65536.0
    scaler.update(overflow=True)
    assert scaler.scale == 32768.0
    for _ in range(1999):
        scaler.update(overflow=False)
    assert scaler.scale == 32768.0  # one step short of the interval
    scaler.update(overflow=False)
    assert scaler.scale == 65536.0  # grown after 2000 clean steps
    assert scaler.steps_since_growth == 0
    for _ in range(1000):
        scaler.update(overflow=False)
    scaler.update(overflow=True)  # an overflow restarts the count
    for _ in range(1999):
        scaler.update(overflow=False)
    assert scaler.scale == 32768.0
    assert scaler.scale_loss(2.0) == 65536.0
    assert scaler.unscale(np.float32([32768.0])).tolist() == [1.0]
    assert LossScaler.check_overflow(np.float32([1.0, np.inf]))


def test_loss_scaler_refuses_bad_settings() -> None:
    with pytest.raises(InvalidInputError):
        LossScaler(0.0)
    with pytest.raises(InvalidInputError):
        LossScaler(backoff_factor=1.5)
    with pytest.raises(InvalidInputError):
        LossScaler(growth_interval=0)


def test_bf16_rounds_where_the_seed_truncated() -> None:
    x = np.float32([3.14159, 1 + 3 * 2**-9])
    assert np.abs(from_bf16(to_bf16(x))[0] - x[0]) < 0.01  # the seed's test
    # 1 + 3·2^-9 lies 3/4 of the way to the next bfloat16: rounding goes up, truncation down
    assert from_bf16(to_bf16(x))[1] == 1 + 2**-7
    half, overflows = to_fp16(np.float32([1.0, 1e5]))
    assert (half.tolist(), overflows) == ([1.0, math.inf], 1)


def test_nan_and_clip() -> None:
    assert has_nan_or_inf(np.float32([0.0, np.nan]))
    assert not has_nan_or_inf(np.float32([0.0, 1.0]))
    assert not has_nan_or_inf(np.arange(3))
    clipped = safe_clip(np.float32([np.nan, -np.inf, np.inf, -2.0, 0.5]), -1.0, 1.0)
    assert clipped.dtype == np.float32
    assert clipped.tolist() == [0.0, -1.0, 1.0, -1.0, 0.5]
    with pytest.raises(InvalidInputError, match="low <= high"):
        safe_clip(np.zeros(2), 1.0, -1.0)


SEED_GRADIENTS = (np.arange(1000, dtype=np.float32) - 500) / 500


def test_ternary_compression_ratio_is_the_seeds() -> None:
    compressor = GradientCompressor(TrainingConfig())
    compressed = compressor.compress_ternary(SEED_GRADIENTS, 0.1)
    # the seed: k = max(ceil(1000·0.1), 64) = 100 codes, 32000 bits over 2·100 + 32
    assert compressed.compressed_dim == 100
    assert compressed.compression_ratio() == pytest.approx(32000 / 232)
    assert compressed.compression_ratio() > 10
    assert set(np.unique(compressed.data)) <= {-1, 0, 1}
    small = compressor.compress_ternary(np.ones(100, dtype=np.float32), 0.1)
    assert small.compressed_dim == 64  # the seed's floor


def test_projection_round_trip_as_the_seed_tests_it() -> None:
    compressor = GradientCompressor()
    compressed = compressor.compress(SEED_GRADIENTS, 0.1)
    recovered = compressor.decompress(compressed)
    assert recovered.shape == SEED_GRADIENTS.shape
    # The seed asserted MSE < 1, which zeros meet (MSE 0.33 here): its 1/sqrt(n) scale made
    # the estimate ~3% of the gradient. With a norm-keeping scale the estimate is unbiased
    # but noisy, E‖Aᵀ·Ax − x‖² ≈ (n/k)·‖x‖²/n per value: no reconstruction, as documented.
    mse = float(np.mean((recovered - SEED_GRADIENTS) ** 2))
    assert float(np.mean(SEED_GRADIENTS**2)) < mse < 30 * float(np.mean(SEED_GRADIENTS**2))
    cosine = recovered @ SEED_GRADIENTS / np.linalg.norm(recovered) / np.linalg.norm(SEED_GRADIENTS)
    assert cosine > 0.1  # it points the gradient's way
    # the sketch keeps the norm, which the seed's 1/sqrt(n) scale did not
    ratio = np.linalg.norm(compressed.data) / np.linalg.norm(SEED_GRADIENTS)
    assert 0.7 < ratio < 1.3
    ternary = compressor.decompress_ternary(compressor.compress_ternary(SEED_GRADIENTS, 0.1))
    assert ternary.shape == SEED_GRADIENTS.shape


def test_compressor_checks_ratio_seed_and_clips() -> None:
    compressor = GradientCompressor()
    with pytest.raises(InvalidInputError, match="compression ratio"):
        compressor.compress(SEED_GRADIENTS, 0.0)
    other = GradientCompressor(TrainingConfig(seed=7))
    with pytest.raises(InvalidInputError, match="seed mismatch"):
        other.decompress(compressor.compress(SEED_GRADIENTS))
    clipped = GradientCompressor(TrainingConfig(gradient_clipping=1.0))
    big = clipped.compress(SEED_GRADIENTS * 100)
    small = clipped.compress(SEED_GRADIENTS / np.linalg.norm(SEED_GRADIENTS))
    assert np.allclose(big.data, small.data, rtol=1e-5)


def test_large_gradients_are_projected_by_segment() -> None:
    x = np.random.default_rng(0).standard_normal(10_000).astype(np.float32)
    compressed = GradientCompressor().compress_ternary(x, 0.1)
    _, k, m = segment_layout(10_000, 0.1, 4096)
    assert compressed.compressed_dim == k * m
