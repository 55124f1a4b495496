"""Clipping, DP-FedAvg noise and adaptive clipping."""

from __future__ import annotations

import math

import numpy as np
import pytest

from gradpipe.aggregation.exact import ExactSum
from gradpipe.aggregation.privacy import (
    adaptive_noise_multiplier,
    apply_scale,
    clip_scale,
    dp_noise_std,
    gaussian_noise,
    sq_norm_partial,
    update_clip_norm,
)
from gradpipe.aggregation.reduce import combine, finish, partial, reduce_peers
from gradpipe.errors import InvalidInputError


def test_clip_scale_is_the_seeds_clip_gradient_norm() -> None:
    assert clip_scale(25.0, 1.0) == 0.2  # [3, 4] has norm 5
    assert clip_scale(0.25, 1.0) == 1.0  # within the bound: unchanged
    assert clip_scale(0.0, 1.0) == 1.0
    with pytest.raises(InvalidInputError, match="clip norm"):
        clip_scale(1.0, 0.0)


def test_norm_partials_are_exact_in_any_order() -> None:
    rng = np.random.default_rng(0)
    tensors = [
        rng.standard_normal(s).astype(np.float32) * 10.0**e for s, e in ((1000, 3), (77, -4))
    ]
    parts = [sq_norm_partial(t[i : i + 10]) for t in tensors for i in range(0, t.size, 10)]
    first = ExactSum.combine(parts).to_array()
    rng2 = np.random.default_rng(1)
    for _ in range(3):
        order = rng2.permutation(len(parts))
        half = len(order) // 2
        a = ExactSum.combine(parts[i] for i in order[:half])
        b = ExactSum.combine(parts[i] for i in order[half:])
        assert ExactSum.combine([b, a]).to_array().tobytes() == first.tobytes()
    ref = math.fsum(float(v) ** 2 for t in tensors for v in t.astype(np.float64))
    assert abs(float(first) - ref) <= 10 * np.finfo(np.float64).eps * ref  # within-chunk rounding


def test_clipped_fedavg_matches_a_reference() -> None:
    rng = np.random.default_rng(2)
    peers = [rng.standard_normal(50).astype(np.float32) * s for s in (0.1, 1.0, 30.0)]
    clip = 2.0
    scales = [clip_scale(sq_norm_partial(p), clip) for p in peers]
    ours = reduce_peers(peers, weights=[1, 2, 3], scales=scales)
    clipped = [
        p.astype(np.float64) * min(1.0, clip / np.linalg.norm(p.astype(np.float64))) for p in peers
    ]
    ref = (clipped[0] + 2 * clipped[1] + 3 * clipped[2]) / 6
    assert np.allclose(ours, ref, rtol=2 * np.finfo(np.float32).eps, atol=1e-30)
    assert scales[0] == 1.0
    assert scales[2] < 1.0
    # clipping the aggregate: a second pass over its chunks
    agg_scale = clip_scale(sq_norm_partial(ours), 0.5)
    clipped_agg = apply_scale(ours, agg_scale)
    assert abs(np.linalg.norm(clipped_agg.astype(np.float64)) - 0.5) < 1e-6


def test_noise_is_addressed_by_element_not_by_chunk() -> None:
    whole = gaussian_noise(11, tensor="w", offset=0, count=200_000, std=1.0)
    for size in (999, 65536, 70_001):
        pieces = [
            gaussian_noise(11, tensor="w", offset=i, count=min(size, 200_000 - i), std=1.0)
            for i in range(0, 200_000, size)
        ]
        assert np.concatenate(pieces).tobytes() == whole.tobytes()
    for i in (0, 65535, 65536, 199_999):  # single elements on both sides of a block edge
        assert gaussian_noise(11, tensor="w", offset=i, count=1, std=1.0)[0] == whole[i]
    assert not np.array_equal(
        whole[:100], gaussian_noise(12, tensor="w", offset=0, count=100, std=1.0)
    )
    assert not np.array_equal(
        whole[:100], gaussian_noise(11, tensor="v", offset=0, count=100, std=1.0)
    )
    assert gaussian_noise(11, tensor="w", offset=5, count=0, std=1.0).size == 0


def test_noise_statistics_over_seeds() -> None:
    std = 0.3
    draws = np.concatenate(
        [gaussian_noise(s, tensor="t", offset=0, count=5000, std=std) for s in range(40)]
    )
    n = draws.size  # 200 000 draws
    # mean: standard error std/sqrt(n) = 6.7e-4; 5 sigma
    assert abs(draws.mean()) < 5 * std / math.sqrt(n)
    # standard deviation: standard error ~ std/sqrt(2n); 5 sigma
    assert abs(draws.std() - std) < 5 * std / math.sqrt(2 * n)
    # Gaussian tails: P(|z| > 3) = 0.0027 (binomial standard error ~1.2e-4)
    assert abs(np.mean(np.abs(draws) > 3 * std) - 0.0027) < 6e-4
    # the first element over seeds is as random as any other (no per-seed bias)
    firsts = np.array(
        [gaussian_noise(s, tensor="t", offset=0, count=1, std=1.0)[0] for s in range(2000)]
    )
    assert abs(firsts.mean()) < 5 / math.sqrt(2000)


def test_dp_fedavg_mean_plus_noise() -> None:
    rng = np.random.default_rng(3)
    n, clip, z = 4, 1.0, 1.1
    peers = [rng.standard_normal(1000).astype(np.float32) for _ in range(n)]
    scales = [clip_scale(sq_norm_partial(p), clip) for p in peers]
    state = combine(
        [partial(p, peer=i, scale=s) for i, (p, s) in enumerate(zip(peers, scales, strict=True))]
    )
    std = dp_noise_std(z, clip, n)
    assert std == z * clip / n  # Flower's compute_stdv
    noise = gaussian_noise(5, tensor="w", offset=0, count=1000, std=std)
    noised = finish(state, method="mean", peers=n, noise=noise)
    clean = finish(state, method="mean", peers=n)
    assert np.allclose(noised - clean, noise, atol=1e-6)
    with pytest.raises(InvalidInputError):
        dp_noise_std(-1.0, 1.0, 3)


@pytest.mark.parametrize("gamma", [0.2, 0.5, 0.9])
def test_adaptive_clipping_converges_to_the_target_quantile(gamma: float) -> None:
    rng = np.random.default_rng(4)
    norms = rng.lognormal(mean=0.0, sigma=1.0, size=100_000)  # a fixed distribution of norms
    target = float(np.quantile(norms, gamma))
    clip, lr = 0.01, 0.2  # start two orders of magnitude off
    for _ in range(400):
        batch = rng.choice(norms, size=100)
        clip = update_clip_norm(
            clip, batch.tolist(), target_quantile=gamma, lr=lr, count_stddev=100 / 20, rng=rng
        )
    tail = []
    for _ in range(400):
        batch = rng.choice(norms, size=100)
        clip = update_clip_norm(
            clip, batch.tolist(), target_quantile=gamma, lr=lr, count_stddev=100 / 20, rng=rng
        )
        tail.append(clip)
    # Geometric steps of at most exp(±η) around the fixed point F(C) = γ: the average
    # fraction of norms under C over the tail is γ within a few hundredths.
    fraction = float(np.mean([np.mean(norms <= c) for c in tail]))
    assert abs(fraction - gamma) < 0.03
    assert abs(math.log(float(np.median(tail)) / target)) < 0.15


def test_adaptive_clipping_without_noise_moves_the_right_way() -> None:
    assert update_clip_norm(1.0, [0.1, 0.2, 0.3], target_quantile=0.5) < 1.0  # all unclipped
    assert update_clip_norm(1.0, [5.0, 6.0], target_quantile=0.5) > 1.0  # all clipped
    assert update_clip_norm(1.0, [0.5, 5.0], target_quantile=0.5) == 1.0
    with pytest.raises(InvalidInputError, match="rng"):
        update_clip_norm(1.0, [1.0], count_stddev=1.0)
    with pytest.raises(InvalidInputError, match="empty"):
        update_clip_norm(1.0, [])


def test_adaptive_noise_multiplier() -> None:
    # Andrew et al.: z_Δ = (z^-2 - (2σ_b)^-2)^(-1/2)
    assert adaptive_noise_multiplier(1.0, 5.0) == pytest.approx((1 - 0.01) ** -0.5)
    assert adaptive_noise_multiplier(0.0, 5.0) == 0.0
    with pytest.raises(InvalidInputError, match="σ_b"):
        adaptive_noise_multiplier(1.0, 0.4)
