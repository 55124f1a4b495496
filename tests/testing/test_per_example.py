"""Tests of the per-example-gradient classifier and the brute-force GNS reference."""

from __future__ import annotations

import itertools
import math
from pathlib import Path

import numpy as np
import pytest
from safetensors import safe_open
from safetensors.numpy import load_file

from gradpipe.errors import InvalidInputError
from gradpipe.testing.per_example import (
    PerExampleModel,
    gns_estimates,
    per_example_gradients,
    per_example_losses,
    population,
    true_noise_scale,
    write_peer_dumps,
)

MODEL = PerExampleModel()
BATCH_SIZES = (3, 5, 8, 16)


def flat(grads: dict[str, np.ndarray]) -> np.ndarray:
    """Per-example gradients as one (n, D) matrix, tensors in model order."""
    return np.concatenate([grads[name].reshape(len(grads[name]), -1) for name in MODEL.shapes], 1)


def test_gradients_match_central_finite_differences() -> None:
    x, y = population(MODEL, 7, seed=3)
    grads = per_example_gradients(MODEL, x, y)
    assert {name: g.shape for name, g in grads.items()} == {
        name: (7, *shape) for name, shape in MODEL.shapes.items()
    }
    assert all(g.dtype == np.float64 for g in grads.values())
    eps = 1e-6
    for name, shape in MODEL.shapes.items():
        for index in np.ndindex(shape):
            plus = {k: v.copy() for k, v in MODEL.parameters.items()}
            minus = {k: v.copy() for k, v in MODEL.parameters.items()}
            plus[name][index] += eps
            minus[name][index] -= eps
            numeric = (
                per_example_losses(MODEL, x, y, parameters=plus)
                - per_example_losses(MODEL, x, y, parameters=minus)
            ) / (2 * eps)
            np.testing.assert_allclose(grads[name][(slice(None), *index)], numeric, atol=1e-8)


def test_model_and_population_are_seeded_and_labels_are_mixed() -> None:
    assert not MODEL.parameters["head.weight"].flags.writeable
    same = PerExampleModel()
    for name in MODEL.shapes:
        np.testing.assert_array_equal(same.parameters[name], MODEL.parameters[name])
    other = PerExampleModel(seed=1).parameters["head.weight"]
    assert not np.array_equal(other, MODEL.parameters["head.weight"])
    x1, y1 = population(MODEL, 64, seed=1)
    x2, y2 = population(MODEL, 64, seed=1)
    np.testing.assert_array_equal(x1, x2)
    np.testing.assert_array_equal(y1, y2)
    assert len(np.unique(y1)) == MODEL.classes


def test_true_noise_scale_is_the_population_variance_and_mean() -> None:
    x, y = population(MODEL, 64, seed=1)
    g = flat(per_example_gradients(MODEL, x, y))
    trace, g2 = true_noise_scale(MODEL, x, y)
    assert trace == pytest.approx(g.var(axis=0).sum(), rel=1e-13)  # ddof=0: 1/N
    assert g2 == pytest.approx(np.sum(g.mean(axis=0) ** 2), rel=1e-13)
    # The two layers' figures add up to the whole model's.
    layers = [("layer.0.weight", "layer.0.bias"), ("head.weight", "head.bias")]
    parts = [true_noise_scale(MODEL, x, y, tensors=layer) for layer in layers]
    assert math.fsum(t for t, _ in parts) == pytest.approx(trace, rel=1e-14)
    assert math.fsum(q for _, q in parts) == pytest.approx(g2, rel=1e-14)


def test_combined_estimators_equal_the_weighted_per_peer_a1_estimators() -> None:
    rng = np.random.default_rng(5)
    grads = [{"a": rng.normal(size=(3, 4)), "b": rng.normal(size=2)} for _ in BATCH_SIZES]
    s, g2 = gns_estimates(grads, BATCH_SIZES)
    b = np.array(BATCH_SIZES, dtype=np.float64)
    total = b.sum()
    vectors = np.stack([np.concatenate([g["a"].ravel(), g["b"]]) for g in grads])
    mean = (b / total) @ vectors
    norm2 = (vectors**2).sum(axis=1)
    big = (mean**2).sum()
    s_p = (norm2 - big) / (1 / b - 1 / total)
    g2_p = (total * big - b * norm2) / (total - b)
    u = (1 - b / total) / (len(b) - 1)
    assert u.sum() == pytest.approx(1.0, rel=1e-15)
    assert s == pytest.approx(u @ s_p, rel=1e-12)
    assert g2 == pytest.approx(u @ g2_p, rel=1e-12)
    # A subset of tensors gives that subset's figures.
    s_a, _ = gns_estimates([{"a": g["a"]} for g in grads], BATCH_SIZES)
    assert gns_estimates(grads, BATCH_SIZES, tensors=["a"])[0] == s_a


def test_estimators_are_exactly_unbiased_with_unequal_batches() -> None:
    # Every index tuple of peers of b = 1, 2, 3 from a population of 3 is equally likely
    # (3^6 of them), so their plain average is the exact expectation.
    x, y = population(MODEL, 3, seed=2)
    g = flat(per_example_gradients(MODEL, x, y))
    sizes = (1, 2, 3)
    bounds = np.cumsum((0, *sizes))
    results = []
    for draw in itertools.product(range(3), repeat=bounds[-1]):
        idx = np.array(draw)
        means = [{"g": g[idx[lo:hi]].mean(axis=0)} for lo, hi in itertools.pairwise(bounds)]
        results.append(gns_estimates(means, sizes))
    trace, g2 = true_noise_scale(MODEL, x, y)
    assert math.fsum(s for s, _ in results) / len(results) == pytest.approx(trace, rel=1e-12)
    assert math.fsum(q for _, q in results) / len(results) == pytest.approx(g2, rel=1e-11)


def test_estimator_means_over_seeded_draws_match_the_population() -> None:
    x, y = population(MODEL, 64, seed=1)
    g = flat(per_example_gradients(MODEL, x, y))
    trace, g2 = true_noise_scale(MODEL, x, y)
    draws = 2000
    rng = np.random.default_rng(11)
    # (draws, D) mean gradients per peer, batches drawn with replacement.
    peer_means = [g[rng.integers(0, len(g), size=(draws, b))].mean(axis=1) for b in BATCH_SIZES]
    estimates = np.array(
        [gns_estimates([{"g": m[i]} for m in peer_means], BATCH_SIZES) for i in range(draws)]
    )
    for column, truth in ((0, trace), (1, g2)):
        values = estimates[:, column]
        se = values.std(ddof=1) / math.sqrt(draws)
        assert abs(values.mean() - truth) < 4 * se, (column, values.mean(), truth, se)
    # The check has power: the naive unweighted spread scaled by the arithmetic mean batch,
    # whose expectation is tr(Σ)·mean(b)/harmonic_mean(b) (1.44 tr(Σ) here), is rejected.
    stacked = np.stack(peer_means, axis=1)  # (draws, P, D)
    spread = ((stacked - stacked.mean(axis=1, keepdims=True)) ** 2).sum(axis=(1, 2))
    naive = np.mean(BATCH_SIZES) * spread / (len(BATCH_SIZES) - 1)
    assert abs(naive.mean() - trace) > 4 * naive.std(ddof=1) / math.sqrt(draws)
    # And |G|² of the big batch without the − 𝒮/B correction (biased by tr(Σ)/B) is rejected.
    uncorrected = estimates[:, 1] + estimates[:, 0] / sum(BATCH_SIZES)
    assert abs(uncorrected.mean() - g2) > 4 * uncorrected.std(ddof=1) / math.sqrt(draws)


def test_write_peer_dumps_writes_readable_mean_gradients(tmp_path: Path) -> None:
    x, y = population(MODEL, 64, seed=1)
    run = write_peer_dumps(tmp_path, MODEL, x, y, steps=2, batch_sizes=BATCH_SIZES, seed=4)
    assert run.peers == ["p0", "p1", "p2", "p3"]
    assert run.pattern == str(tmp_path / "step={step}" / "peer={peer}.safetensors")
    files = sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*.safetensors"))
    assert files == [f"step={s}/peer=p{p}.safetensors" for s in (0, 1) for p in range(4)]
    grads = per_example_gradients(MODEL, x, y)
    for step, p in itertools.product(run.steps, range(4)):
        path = run.dump_path(step, run.peers[p])
        loaded = load_file(path)
        idx = run.indices[step][p]
        assert idx.shape == (BATCH_SIZES[p],)
        for name in MODEL.shapes:
            assert loaded[name].dtype == np.float64
            np.testing.assert_array_equal(loaded[name], run.mean_gradients[step][p][name])
            np.testing.assert_allclose(loaded[name], grads[name][idx].mean(axis=0), rtol=1e-15)
        with safe_open(path, framework="numpy") as f:
            metadata = f.metadata()
        assert metadata == {"num_examples": str(BATCH_SIZES[p]), "lr": repr(0.1 / (1 + step))}
    # Seeded: the same seed draws the same batches, another does not.
    again = write_peer_dumps(tmp_path / "b", MODEL, x, y, steps=2, batch_sizes=BATCH_SIZES, seed=4)
    other = write_peer_dumps(tmp_path / "c", MODEL, x, y, steps=2, batch_sizes=BATCH_SIZES, seed=5)
    assert all(np.array_equal(a, b) for a, b in zip(run.indices[1], again.indices[1], strict=True))
    assert not np.array_equal(run.indices[1][3], other.indices[1][3])
    # The figures of the written arrays are those of the loaded files.
    loaded_step = [load_file(run.dump_path(0, peer)) for peer in run.peers]
    assert gns_estimates(loaded_step, BATCH_SIZES) == gns_estimates(
        run.mean_gradients[0], BATCH_SIZES
    )


def test_write_peer_dumps_in_float32(tmp_path: Path) -> None:
    x, y = population(MODEL, 16, seed=1)
    run = write_peer_dumps(
        tmp_path, MODEL, x, y, steps=1, batch_sizes=(2, 3), seed=0, dtype=np.float32
    )
    loaded = load_file(run.dump_path(0, "p1"))
    assert loaded["head.bias"].dtype == np.float32
    np.testing.assert_array_equal(loaded["head.bias"], run.mean_gradients[0][1]["head.bias"])


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: PerExampleModel(classes=1), "classes must be an integer >= 2"),
        (lambda: population(MODEL, 0, seed=0), "population size"),
        (lambda: gns_estimates([{"g": np.zeros(2)}], [3]), "at least 2 peers"),
        (lambda: gns_estimates([{"g": np.zeros(2)}] * 2, [3]), "2 peers' gradients but 1"),
        (lambda: gns_estimates([{"g": np.zeros(2)}] * 2, [3, 0]), "peer 1 must be an integer"),
        (
            lambda: gns_estimates([{"g": np.zeros(2)}, {"g": np.zeros(3)}], [1, 1]),
            "'g' of peer 1 has shape",
        ),
        (
            lambda: gns_estimates([{"g": np.zeros(2)}, {"h": np.zeros(2)}], [1, 1]),
            "peer 1 has tensors",
        ),
        (lambda: per_example_gradients(MODEL, np.zeros((2, 5)), [0, 1]), r"shape \(n, 6\)"),
        (lambda: per_example_gradients(MODEL, np.zeros((2, 6)), [0, 3]), r"in \[0, 3\)"),
    ],
)
def test_bad_input_is_named(call: object, message: str) -> None:
    assert callable(call)
    with pytest.raises(InvalidInputError, match=message):
        call()


def test_write_peer_dumps_rejects_bad_arguments(tmp_path: Path) -> None:
    x, y = population(MODEL, 4, seed=0)
    with pytest.raises(InvalidInputError, match="steps must be"):
        write_peer_dumps(tmp_path, MODEL, x, y, steps=0, batch_sizes=(1, 2), seed=0)
    with pytest.raises(InvalidInputError, match="dtype must be"):
        write_peer_dumps(tmp_path, MODEL, x, y, steps=1, batch_sizes=(1,), seed=0, dtype=np.int32)
    assert not any(tmp_path.iterdir())
