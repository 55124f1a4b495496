"""Spikes: a robust z-score of log(norm) over a trailing window of steps."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

import gradpipe as gp
from gradpipe.analytics.spikes import MAD_FLOOR, MAD_TO_SIGMA, robust_z
from gradpipe.formats.safetensors import write_safetensors


def _reference(series: list[float], window: int) -> list[float]:
    """The rule, written plainly: one series, NaN where not usable."""
    x = [math.log(v) if v > 0 and math.isfinite(v) else math.nan for v in series]
    out = []
    for t in range(len(x)):
        past = [v for v in x[max(0, t - window) : t] if not math.isnan(v)]
        if math.isnan(x[t]) or len(past) < math.ceil(window / 2):
            out.append(math.nan)
            continue
        m = float(np.median(past))
        mad = float(np.median([abs(v - m) for v in past]))
        d = x[t] - m
        out.append(d / (MAD_TO_SIGMA * max(mad, MAD_FLOOR)))
    return out


def test_z_equals_the_rule_written_plainly() -> None:
    rng = np.random.default_rng(0)
    norms = np.exp(rng.standard_normal((60, 5)) * 0.1)
    norms[17, 2] = np.nan
    norms[30, 4] = 0.0
    usable = ~np.isnan(norms) & (norms > 0)
    z = robust_z(norms, usable, window=10)
    for j in range(5):
        np.testing.assert_allclose(z[:, j], _reference(norms[:, j].tolist(), 10), rtol=1e-12)


def test_a_constant_series_has_z_zero_and_its_last_bit_is_no_spike() -> None:
    norms = np.full((12, 1), 2.0)
    norms[9] = 3.0
    norms[5] = np.nextafter(2.0, 3.0)  # one ulp: noise, not a spike
    z = robust_z(norms, np.ones_like(norms, bool), window=4)
    assert np.isnan(z[:2]).all()  # fewer than ceil(4/2) steps before
    assert (z[2:5] == 0).all()
    assert abs(z[5, 0]) < 1e-6
    assert z[9, 0] > 1e5  # 1.5x against a flat window
    assert robust_z(norms, np.ones_like(norms, bool), window=4)[10, 0] == 0  # median still 2


def test_a_twenty_times_step_is_flagged_per_layer(local_store: gp.Store, tmp_path: Path) -> None:
    rng = np.random.default_rng(1)
    for step in range(30):
        for peer in ("a", "b"):
            scale = 20.0 if (step, peer) == (24, "b") else 1.0
            tensors = {
                "layer.0.w": rng.standard_normal(256).astype(np.float32),
                "layer.1.w": (rng.standard_normal(256) * scale).astype(np.float32),
            }
            path = tmp_path / f"step={step}" / f"peer={peer}.safetensors"
            path.parent.mkdir(exist_ok=True)
            with path.open("wb") as f:
                write_safetensors(f, tensors, {})
    assert gp.ingest(
        local_store, str(tmp_path / "step={step}" / "peer={peer}.safetensors"), run="r"
    ).ok
    found = gp.spikes(local_store, "r", by="layer", window=20)
    hits = np.nonzero(found.spike.transpose("step", "peer", "layer").values)
    spots = {
        (int(found.step.values[s]), str(found.peer.values[p]), str(found.layer.values[g]))
        for s, p, g in zip(*hits, strict=True)
    }
    assert spots == {(24, "b", "layer.1")}
    assert found.attrs["window"] == 20
    assert found.attrs["by"] == "layer"
    total = gp.spikes(gp.gradient_norms(local_store, "r"), window=20)
    assert bool(total.spike.sel(step=24, peer="b"))
    assert int(total.spike.sum()) == 1


def test_bad_parameters(local_store: gp.Store) -> None:
    with pytest.raises(gp.InvalidInputError, match="window"):
        robust_z(np.ones((3, 1)), np.ones((3, 1), bool), window=2)
    with pytest.raises(gp.InvalidInputError, match="threshold"):
        gp.spikes(local_store, "r", threshold=0)
    with pytest.raises(gp.InvalidInputError, match="by 'peer' must be one of"):
        gp.spikes(local_store, "r", by="peer")
