"""Projections and influence against exact dot products on a small model."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

import gradpipe as gp
from gradpipe.core.sketch import dense_matrix
from gradpipe.formats.safetensors import write_safetensors
from gradpipe.testing.per_example import (
    PerExampleModel,
    per_example_gradients,
    population,
    write_peer_dumps,
)

K = 2048


@pytest.fixture
def trained(
    local_store: gp.Store, tmp_path: Path
) -> tuple[gp.Store, object, dict[str, np.ndarray]]:
    model = PerExampleModel()
    x, y = population(model, 200, seed=3)
    run = write_peer_dumps(tmp_path / "run", model, x, y, steps=4, batch_sizes=(4, 6, 9), seed=5)
    assert gp.ingest(local_store, run.pattern, run="train", chunk_bytes=4096).ok
    query = per_example_gradients(model, x[:3], y[:3])
    return local_store, run, query


def _layer(name: str) -> str:
    return "layer.0" if name.startswith("layer.0") else "head"


def test_stored_projections_equal_the_dense_matrix(trained: tuple) -> None:
    store, run, _ = trained
    ds = gp.project_gradients(store, "train", k=K, seed=7)
    assert ds.projection.dtype == np.float32
    for step in (0, 3):
        for p, peer in enumerate(run.peers):
            grads = run.mean_gradients[step][p]
            for layer in ("head", "layer.0"):
                want = sum(
                    dense_matrix(g.size, seed=7, tensor=n, k=K) @ g.astype(np.float64).ravel()
                    for n, g in grads.items()
                    if _layer(n) == layer
                )
                got = ds.projection.sel(step=step, peer=peer, layer=layer).values
                np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6 * np.abs(want).max())
    np.testing.assert_allclose(ds.lr.sel(step=2).values, 0.1 / 3)


def test_influence_estimates_the_exact_dot_products(trained: tuple) -> None:
    store, run, query = trained
    ds = gp.influence(store, "train", query, k=K, seed=1)
    assert ds.score.dims == ("example", "step", "peer")
    for step in run.steps:
        lr = run.learning_rates[step]
        for p, peer in enumerate(run.peers):
            g = run.mean_gradients[step][p]
            for q in range(3):
                exact = lr * math.fsum(float(np.dot(query[n][q].ravel(), g[n].ravel())) for n in g)
                norm_q = math.sqrt(sum(float(np.sum(query[n][q] ** 2)) for n in g))
                norm_g = math.sqrt(sum(float(np.sum(g[n] ** 2)) for n in g))
                bound = 5 * lr * norm_q * norm_g * math.sqrt(2 / K)
                got = ds.score.sel(example=f"q{q}", step=step, peer=peer).item()
                assert abs(got - exact) <= bound
    again = gp.influence(store, "train", query, k=K, seed=1)
    assert again.attrs["chunks_read"] == 0
    assert again.attrs["memoised_steps"] == len(run.steps)
    np.testing.assert_array_equal(again.score.values, ds.score.values)


def test_a_query_run_scores_each_step_with_its_own_gradient(trained: tuple, tmp_path: Path) -> None:
    store, run, query = trained
    for step in run.steps:
        for q in range(2):
            path = tmp_path / "query" / f"step={step}" / f"peer=q{q}.safetensors"
            path.parent.mkdir(parents=True, exist_ok=True)
            with path.open("wb") as f:
                write_safetensors(f, {n: v[q] for n, v in query.items()}, {})
    pattern = str(tmp_path / "query" / "step={step}" / "peer={peer}.safetensors")
    assert gp.ingest(store, pattern, run="query").ok
    by_run = gp.influence(store, "train", "query", k=K, seed=1)
    fixed = gp.influence(store, "train", {n: v[:2] for n, v in query.items()}, k=K, seed=1)
    assert by_run.example.values.tolist() == ["q0", "q1"]
    np.testing.assert_allclose(by_run.score.values, fixed.score.values, rtol=1e-5, atol=1e-9)


def test_the_learning_rate_must_be_known(local_store: gp.Store, tmp_path: Path) -> None:
    path = tmp_path / "step=0" / "peer=a.safetensors"
    path.parent.mkdir()
    with path.open("wb") as f:
        write_safetensors(f, {"w": np.ones(10, np.float32)}, {})
    assert gp.ingest(
        local_store, str(tmp_path / "step={step}" / "peer={peer}.safetensors"), run="r"
    ).ok
    query = {"w": np.ones((1, 10), np.float32)}
    with pytest.raises(gp.NotFoundError, match="step 0, peer 'a': the dump records no learning"):
        gp.influence(local_store, "r", query, k=64)
    assert gp.influence(local_store, "r", query, k=64, lr=0.5).score.shape == (1, 1, 1)
    assert gp.influence(local_store, "r", query, k=64, lr={0: 0.5}).score.shape == (1, 1, 1)
    with pytest.raises(gp.InvalidInputError, match="is not a tensor of run 'r'"):
        gp.influence(local_store, "r", {"w": query["w"], "v": np.ones((1, 3))}, k=64, lr=1.0)


def test_projections_do_not_depend_on_the_chunk_grid(trained: tuple) -> None:
    store, run, _ = trained
    assert gp.ingest(store, run.pattern, run="coarse", chunk_bytes=1 << 20).ok
    fine = gp.project_gradients(store, "train", k=K, steps=[1])
    coarse = gp.project_gradients(store, "coarse", k=K, steps=[1])
    np.testing.assert_allclose(coarse.projection.values, fine.projection.values, rtol=1e-5)


def test_a_query_must_fit_the_run(trained: tuple) -> None:
    store, _, query = trained
    name = next(iter(query))
    with pytest.raises(gp.InvalidInputError, match="is not a tensor of run 'train'"):
        gp.influence(store, "train", {"nope": query[name]}, k=64)
    with pytest.raises(gp.InvalidInputError, match="leading example axis"):
        gp.influence(store, "train", {name: query[name][0]}, k=64)
    with pytest.raises(gp.InvalidInputError, match="lr nan must be a finite number"):
        gp.influence(store, "train", query, k=64, lr=float("nan"))
