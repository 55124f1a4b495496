"""The analyses' figures draw without a display (matplotlib's Agg canvas)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import gradpipe as gp
from gradpipe.analytics.plot import (
    plot_agreement,
    plot_histograms,
    plot_noise_scale,
    plot_norms,
    save,
)
from gradpipe.formats.safetensors import write_safetensors

pytest.importorskip("matplotlib")


@pytest.fixture
def run(local_store: gp.Store, tmp_path: Path) -> gp.Store:
    rng = np.random.default_rng(0)
    for step in range(12):
        truth = rng.standard_normal(2048)
        for p in range(5):
            g = truth + rng.standard_normal(2048) * (30 if (step, p) == (9, 2) else 1)
            path = tmp_path / f"step={step}" / f"peer=p{p}.safetensors"
            path.parent.mkdir(exist_ok=True)
            with path.open("wb") as f:
                tensors = {
                    "layer.0.w": g.astype(np.float32),
                    "layer.1.w": g[:64].astype(np.float32),
                }
                write_safetensors(f, tensors, {"num_examples": "16"})
    assert gp.ingest(
        local_store, str(tmp_path / "step={step}" / "peer={peer}.safetensors"), run="r"
    ).ok
    return local_store


def test_every_figure_draws_and_saves(run: gp.Store, tmp_path: Path) -> None:
    spikes = gp.spikes(run, "r", window=6)
    assert bool(spikes.spike.sel(step=9, peer="p2"))
    figures = {
        "norms": plot_norms(spikes),
        "layers": plot_norms(gp.spikes(run, "r", by="layer", window=6)),
        "agreement": plot_agreement(gp.peer_agreement(run, "r"), 9),
        "gns": plot_noise_scale(gp.noise_scale(run, "r")),
        "histograms": plot_histograms(gp.gradient_histograms(run, "r"), "layer.0.w"),
    }
    for name, fig in figures.items():
        path = tmp_path / f"{name}.png"
        save(fig, path)
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert path.stat().st_size > 5000
    with pytest.raises(gp.InvalidInputError, match="no histogram of tensor 'x'"):
        plot_histograms(gp.gradient_histograms(run, "r"), "x")
