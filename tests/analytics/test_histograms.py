"""Histograms of a run: every chunk binned once, summed over peers, memoised per step."""

from __future__ import annotations

from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

import gradpipe as gp
from gradpipe.analytics.histogram_bins import bin_layout, histogram_counts
from gradpipe.formats.safetensors import write_safetensors

PEERS = ("a", "b", "c")


def _tensors(step: int, peer: str) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(10 * step + ord(peer))
    w = rng.standard_normal((128, 64)).astype(np.float32) * 2.0 ** rng.integers(-40, 20, (128, 64))
    w[0, :4] = [np.nan, np.inf, -np.inf, -0.0]
    sparse = np.zeros(20000, np.float32)  # all-zero chunks take no block and no read
    sparse[:10] = rng.standard_normal(10)
    return {
        "layer.0.w": w,
        "layer.0.h": rng.standard_normal(300).astype(np.float16),
        "layer.1.b": (rng.standard_normal(500) * 1e-3).astype(ml_dtypes.bfloat16),
        "layer.1.sparse": sparse,
        "layer.1.d": rng.standard_normal(64) * 1e-300,  # float64 subnormals too
        "steps": np.arange(3, dtype=np.int64),  # not a float: no histogram
    }


@pytest.fixture
def filled(local_store: gp.Store, tmp_path: Path) -> gp.Store:
    for step in range(2):
        for peer in PEERS:
            path = tmp_path / f"step={step}" / f"peer={peer}.safetensors"
            path.parent.mkdir(exist_ok=True)
            with path.open("wb") as f:
                write_safetensors(f, _tensors(step, peer), {})
    pattern = str(tmp_path / "step={step}" / "peer={peer}.safetensors")
    assert gp.ingest(local_store, pattern, run="r", chunk_bytes=16384).ok
    return local_store


def test_counts_equal_the_kernel_on_the_arrays(filled: gp.Store) -> None:
    counts = gp.gradient_histograms(filled, "r", bins_per_octave=3)
    layout = bin_layout(3)
    assert counts.sizes == {"step": 2, "tensor": 5, "bin": layout.size}
    assert "steps" not in counts.tensor.values
    for step in range(2):
        for name in counts.tensor.values:
            want = sum(histogram_counts(_tensors(step, p)[name], layout) for p in PEERS)
            np.testing.assert_array_equal(counts.sel(step=step, tensor=name).values, want)
    assert (counts.sum("bin").sel(tensor="layer.1.sparse") == 3 * 20000).all()
    assert counts.sel(step=0, tensor="layer.0.w").sel(bin=counts.label == "nan").item() == 3
    assert list(counts.label.values[:2]) == ["nan", "-inf"]
    again = gp.gradient_histograms(filled, "r", bins_per_octave=3)
    assert again.attrs["memoised_steps"] == 2
    assert again.attrs["chunks_read"] == 0
    assert again.equals(counts)


def test_per_peer_counts_sum_to_the_total(filled: gp.Store) -> None:
    total = gp.gradient_histograms(filled, "r", steps=[1])
    apart = gp.gradient_histograms(filled, "r", steps=[1], per_peer=True)
    assert apart.dims == ("step", "peer", "tensor", "bin")
    np.testing.assert_array_equal(apart.sum("peer").values, total.values)
    assert apart.attrs["computed_steps"] == 1  # another key: per_peer changes what is stored


def test_bad_parameters(filled: gp.Store) -> None:
    with pytest.raises(gp.InvalidInputError, match="bins_per_octave"):
        gp.gradient_histograms(filled, "r", bins_per_octave=0)
    with pytest.raises(gp.InvalidInputError):
        gp.gradient_histograms(filled, "r", low_exp=10, high_exp=5)
