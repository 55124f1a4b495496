"""The stored noise scale against brute force: per-example gradients of a small model."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import gradpipe as gp
from gradpipe.testing.per_example import (
    PerExampleModel,
    gns_estimates,
    population,
    true_noise_scale,
    write_peer_dumps,
)

BATCHES = (3, 5, 8, 16)
STEPS = 30


def test_the_store_gives_the_estimators_of_the_per_example_gradients(
    local_store: gp.Store, tmp_path: Path
) -> None:
    model = PerExampleModel()
    x, y = population(model, 400, seed=1)
    run = write_peer_dumps(tmp_path, model, x, y, steps=STEPS, batch_sizes=BATCHES, seed=2)
    assert gp.ingest(local_store, run.pattern, run="pe").ok
    gns = gp.noise_scale(local_store, "pe")
    by_layer = gp.noise_scale(local_store, "pe", by="layer")
    assert list(by_layer.layer.values) == ["head", "layer.0"]
    for step in run.steps:
        trace, true_sq = gns_estimates(run.mean_gradients[step], BATCHES)
        cell = gns.sel(step=step)
        assert cell.trace_sigma.item() == pytest.approx(trace, rel=1e-12)
        assert cell.true_grad_sq.item() == pytest.approx(true_sq, rel=1e-10, abs=1e-14)
        for layer in ("head", "layer.0"):
            names = {n for n in run.mean_gradients[step][0] if n.startswith(layer)}
            trace, true_sq = gns_estimates(run.mean_gradients[step], BATCHES, tensors=names)
            got = by_layer.sel(step=step, layer=layer)
            assert got.trace_sigma.item() == pytest.approx(trace, rel=1e-12)
            assert got.true_grad_sq.item() == pytest.approx(true_sq, rel=1e-10, abs=1e-14)
    assert gns.batch.values.tolist() == [float(sum(BATCHES))] * STEPS
    # Unbiased: over the steps (independent draws), each estimate's mean lies within four
    # standard errors of the population's figure.
    for name, truth in zip(
        ("trace_sigma", "true_grad_sq"), true_noise_scale(model, x, y), strict=True
    ):
        values = gns[name].values
        error = values.std(ddof=1) / np.sqrt(values.size)
        assert abs(values.mean() - truth) < 4 * error, (name, values.mean(), truth, error)
    assert np.isfinite(gns.b_simple_ema.values[-1])
