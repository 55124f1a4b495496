"""Median, trimmed mean, Krum, Multi-Krum, Bulyan: references, Flower, out-of-core pieces."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest

from gradpipe.aggregation.exact import ExactSum
from gradpipe.aggregation.reduce import reduce_peers
from gradpipe.aggregation.robust import (
    bulyan_combine,
    bulyan_select,
    krum_scores,
    krum_select,
    median,
    pairwise_sq_distances_partial,
    sum_distance_partials,
    trimmed_mean,
)
from gradpipe.errors import InvalidInputError
from gradpipe.testing.transformer import TransformerConfig, train_transformer

agg = pytest.importorskip("flwr.server.strategy.aggregate")

EPS32 = float(np.finfo(np.float32).eps)


def _peers(n: int, size: int, seed: int = 0, byzantine: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    honest = [rng.normal(0.5, 1.0, size).astype(np.float32) for _ in range(n - byzantine)]
    bad = [rng.normal(40.0, 5.0, size).astype(np.float32) for _ in range(byzantine)]
    peers = honest + bad
    random.Random(seed).shuffle(peers)
    return peers


def _ulp32(ref: np.ndarray) -> np.ndarray:
    return np.spacing(np.abs(ref).astype(np.float32)).astype(np.float64)


@pytest.mark.parametrize("n", [1, 4, 5, 10])
def test_median_matches_a_sorting_reference_and_flower(n: int) -> None:
    chunks = _peers(n, 300, seed=n)
    ours = median(chunks)
    columns = np.sort(np.stack(chunks).astype(np.float64), axis=0)
    mid = n // 2
    ref = columns[mid] if n % 2 else (columns[mid - 1] + columns[mid]) / 2
    # odd n selects a value (exact); even n rounds one float64 mean of two float32s once
    assert (ours == ref.astype(np.float32)).all()
    (flower,) = agg.aggregate_median([([c], 1) for c in chunks])
    if n % 2:
        assert (ours == flower).all()
    else:  # Flower averages the middle two in float32: at most one ulp apart
        assert (np.abs(ours.astype(np.float64) - flower) <= _ulp32(ref)).all()


@pytest.mark.parametrize(("n", "beta"), [(10, 0.1), (10, 0.25), (7, 0.3), (20, 0.45), (5, 0.0)])
def test_trimmed_mean_matches_a_reference_and_flower(n: int, beta: float) -> None:
    chunks = _peers(n, 257, seed=n + 1, byzantine=int(beta * n))
    ours = trimmed_mean(chunks, beta)
    cut = int(beta * n)
    cols = np.stack(chunks).astype(np.float64).T
    ref = np.array([math.fsum(sorted(c)[cut : n - cut]) / (n - 2 * cut) for c in cols])
    assert (np.abs(ours - ref) <= _ulp32(ref)).all()  # one rounding of a float64 sum
    (flower,) = agg.aggregate_trimmed_avg([([c], 1) for c in chunks], beta)
    bound = 2 * n * EPS32 * max(float(np.abs(c).max()) for c in chunks)  # Flower sums in f32
    assert np.abs(ours.astype(np.float64) - flower).max() <= bound


def test_trimmed_mean_refuses_a_bad_beta() -> None:
    with pytest.raises(InvalidInputError, match=r"\[0, 0.5\)"):
        trimmed_mean(_peers(4, 3), 0.5)


def _tensors(n: int, seed: int, byzantine: int) -> list[list[np.ndarray]]:
    """Each peer's update as three tensors of different shapes (flattened together by Krum)."""
    flat = _peers(n, 60 + 24 + 7, seed=seed, byzantine=byzantine)
    return [[p[:60].reshape(6, 10), p[60:84].reshape(4, 6), p[84:]] for p in flat]


def _distances_by_chunks(peers: list[list[np.ndarray]], chunk: int, seed: int) -> np.ndarray:
    partials = []
    for t in range(len(peers[0])):
        flat = [p[t].reshape(-1) for p in peers]
        for i in range(0, flat[0].size, chunk):
            partials.append(pairwise_sq_distances_partial([f[i : i + chunk] for f in flat]))
    random.Random(seed).shuffle(partials)  # any order, any grouping: exact sums
    half = len(partials) // 2
    left = ExactSum.combine(ExactSum.of(p) for p in partials[:half]) if half else None
    right = ExactSum.combine(ExactSum.of(p) for p in partials[half:])
    return ExactSum.combine([right] + ([left] if left else [])).to_array()


def test_distance_partials_sum_to_the_reference_in_any_order() -> None:
    peers = _tensors(7, seed=1, byzantine=2)
    flat = [np.concatenate([t.reshape(-1) for t in p]).astype(np.float64) for p in peers]
    ref = np.array([[math.fsum((a - b) ** 2) for b in flat] for a in flat])
    first = _distances_by_chunks(peers, 5, seed=0)
    for seed in range(1, 4):  # shuffled and regrouped: bit-identical
        assert _distances_by_chunks(peers, 5, seed=seed).tobytes() == first.tobytes()
    # within a chunk the float64 sum rounds: relative error <= chunk size·ε64
    assert np.allclose(first, ref, rtol=16 * np.finfo(np.float64).eps, atol=0)
    assert (sum_distance_partials([first]) == first).all()


@pytest.mark.parametrize(("n", "f", "seed"), [(7, 2, 0), (10, 3, 1), (12, 1, 2), (9, 0, 3)])
def test_krum_and_multi_krum_select_as_flower(n: int, f: int, seed: int) -> None:
    peers = _tensors(n, seed=seed, byzantine=f)
    dist = _distances_by_chunks(peers, 16, seed)
    results = [(p, 10 + i) for i, p in enumerate(peers)]
    # Krum: the selected peer's update, exactly
    (best,) = krum_select(dist, f)
    flower = agg.aggregate_krum(results, num_malicious=f, to_keep=0)
    assert all((a == b).all() for a, b in zip(flower, peers[best], strict=True))
    # an independent score: sort the others' distances, sum the n - f - 2 smallest
    scores = krum_scores(dist, f)
    for i in range(n):
        others = sorted(dist[i, j] for j in range(n) if j != i)
        assert scores[i] == math.fsum(others[: n - f - 2])
    assert best == min(range(n), key=lambda i: (scores[i], i))
    # Multi-Krum: FedAvg of the m best (Flower weights them by num_examples too)
    m = n - f
    kept = krum_select(dist, f, m)
    assert len(kept) == m
    assert kept == sorted(kept)
    flower_m = agg.aggregate_krum(results, num_malicious=f, to_keep=m)
    for t in range(3):
        chunks = [peers[i][t] for i in kept]
        ours = reduce_peers(chunks, weights=[10 + i for i in kept])
        bound = 2 * m * EPS32 * max(float(np.abs(c).max()) for c in chunks)
        assert np.abs(ours.astype(np.float64) - flower_m[t]).max() <= bound
    # the Byzantine peers (far away) are never kept
    far = {i for i, p in enumerate(peers) if p[0].mean() > 20}
    assert not far & set(kept)


@pytest.mark.parametrize(("n", "f", "seed"), [(7, 1, 0), (11, 2, 1), (12, 2, 2), (4, 0, 3)])
def test_bulyan_selects_and_averages_as_flower(n: int, f: int, seed: int) -> None:
    peers = _tensors(n, seed=seed, byzantine=f)
    dist = _distances_by_chunks(peers, 16, seed)
    selected = bulyan_select(dist, f)
    assert len(selected) == n - 2 * f
    assert selected == sorted(selected)
    flower = agg.aggregate_bulyan(
        [(p, 1) for p in peers], num_malicious=f, aggregation_rule=agg.aggregate_krum, to_keep=0
    )
    theta, beta = n - 2 * f, n - 4 * f
    for t in range(3):
        chunks = [peers[i][t] for i in selected]
        ours = bulyan_combine(chunks, f)
        # independent reference: per coordinate, the β values nearest the float64 median
        cols = np.stack(chunks).astype(np.float64).reshape(theta, -1).T
        ref = []
        for col in cols:
            med = float(np.median(col))
            near = sorted(range(theta), key=lambda k: (abs(col[k] - med), k))[:beta]
            ref.append(math.fsum(col[k] for k in near) / beta)
        ref_arr = np.array(ref).reshape(ours.shape)
        assert (np.abs(ours - ref_arr) <= _ulp32(ref_arr)).all()
        bound = 2 * theta * EPS32 * max(float(np.abs(c).max()) for c in chunks)
        assert np.abs(ours.astype(np.float64) - flower[t]).max() <= bound


def test_krum_on_transformer_gradients_as_flower() -> None:
    config = TransformerConfig.tiny(peers=7, steps=1)
    (step,) = train_transformer(config, backend="numpy")
    names = sorted(step.gradients["peer0"])
    peers = [[step.gradients[p][k] for k in names] for p in config.peer_names]
    peers[3] = [g * 50 for g in peers[3]]  # one Byzantine peer, scaled
    dist = _distances_by_chunks(peers, 4096, seed=0)
    results = [(p, 8) for p in peers]
    (best,) = krum_select(dist, 2)
    flower = agg.aggregate_krum(results, num_malicious=2, to_keep=0)
    assert all((a == b).all() for a, b in zip(flower, peers[best], strict=True))
    assert 3 not in bulyan_select(dist, 1)
    assert 3 not in krum_select(dist, 2, 4)


def test_ties_go_to_the_lower_peer() -> None:
    same = [np.ones(4, np.float32)] * 5
    dist = sum_distance_partials([pairwise_sq_distances_partial(same)])
    assert krum_select(dist, 1) == [0]
    assert krum_select(dist, 1, 3) == [0, 1, 2]
    assert bulyan_select(dist, 0) == [0, 1, 2, 3, 4]


def test_too_few_peers_for_krum_or_bulyan() -> None:
    dist = np.zeros((6, 6))
    with pytest.raises(
        InvalidInputError, match=r"step 3: krum with f=2 needs at least 7 peers, got 6"
    ):
        krum_select(dist, 2, step=3)
    with pytest.raises(InvalidInputError, match=r"bulyan with f=1 needs at least 7 peers"):
        bulyan_select(dist, 1)
    with pytest.raises(InvalidInputError, match="keep=7"):
        krum_select(dist, 1, 7)
    with pytest.raises(InvalidInputError, match="square"):
        krum_select(np.zeros((3, 4)), 0)
    with pytest.raises(InvalidInputError, match="no peers"):
        median([])


def test_distance_partials_over_several_column_blocks_match_fsum() -> None:
    """A chunk longer than the kernel's column block, not a multiple of it, float32 inputs."""
    rng = np.random.default_rng(5)
    size = 3 * (1 << 14) + 123
    chunks = [rng.standard_normal(size).astype("float32") for _ in range(5)]
    chunks[2] *= 10
    got = pairwise_sq_distances_partial(chunks)
    wide = [c.astype(np.float64) for c in chunks]
    for i in range(5):
        assert got[i, i] == 0.0
        for j in range(5):
            want = math.fsum((wide[i] - wide[j]) ** 2)
            assert got[i, j] == got[j, i]
            assert abs(got[i, j] - want) <= 1e-12 * want
