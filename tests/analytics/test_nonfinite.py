"""The first NaN or infinity: only the chunks the manifests flag are read."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import gradpipe as gp
from gradpipe.core.ids import block_key
from gradpipe.formats.safetensors import write_safetensors
from gradpipe.runs import open_run
from gradpipe.testing.faults import faulty_store

CHUNK_BYTES = 16384  # 4,096 float32 values per chunk: blocks of their own, not inline


def _write(root: Path, step: int, peer: str, tensors: dict[str, np.ndarray]) -> None:
    path = root / f"step={step}" / f"peer={peer}.safetensors"
    path.parent.mkdir(exist_ok=True)
    with path.open("wb") as f:
        write_safetensors(f, tensors, {})


@pytest.fixture
def poisoned(store: gp.Store, tmp_path: Path) -> gp.Store:
    """Steps 0-4 of peers a, b; NaN and infinities from step 2 on, in a few chunks only."""
    for step in range(5):
        for peer in ("a", "b"):
            rng = np.random.default_rng(10 * step + ord(peer))
            w = rng.standard_normal((64, 640)).astype(np.float32)  # 10 chunks
            bias = rng.standard_normal(32).astype(np.float32)  # inline
            if (step, peer) == (2, "b"):
                w[40, 7] = -np.inf  # chunk 6
                w[50, 0] = np.nan  # chunk 7
            if (step, peer) == (2, "a"):
                bias[9] = np.nan
            if step == 4:
                w[3, 3] = np.inf
            _write(tmp_path, step, peer, {"layer.1.w": w, "layer.0.bias": bias})
    pattern = str(tmp_path / "step={step}" / "peer={peer}.safetensors")
    assert gp.ingest(store, pattern, run="r", chunk_bytes=CHUNK_BYTES).ok
    return store


def _chunk_reads(backend: object, store: gp.Store) -> list[tuple[int, str, str, int]]:
    view = open_run(store, "r")
    names = {}
    for e in view:
        for name in view.dump(e.step, e.peer).names:
            info = view.dump(e.step, e.peer).info(name)
            for i, b in enumerate(info.blocks):
                if b and i not in info.inline:
                    names[block_key(b)] = (e.step, e.peer, name, i)
    assert len(names) >= 100  # the test means chunks that are blocks of their own
    calls: list[tuple[str, str]] = backend.calls  # type: ignore[attr-defined]
    return [names[key] for op, key in calls if op == "read" and key in names]


def test_the_earliest_is_found_reading_only_the_flagged_chunks(poisoned: gp.Store) -> None:
    gp.gradient_norms(poisoned, "r")  # memoised: the search reads no dump manifest again
    counted, backend = faulty_store(poisoned)
    found = gp.first_nonfinite(counted, "r")
    rows = [
        (int(s), str(p), str(t), int(c), int(f), str(i), str(v))
        for s, p, t, c, f, i, v in zip(
            found.step.values,
            found.peer.values,
            found.tensor.values,
            found.chunk_index.values,
            found.flat_index.values,
            found.element.values,
            found.value.values,
            strict=True,
        )
    ]
    assert rows == [
        (2, "a", "layer.0.bias", 0, 9, "9", "nan"),  # inline: no block read
        (2, "b", "layer.1.w", 6, 40 * 640 + 7, "40,7", "-inf"),
    ]
    assert found.tensor_count.values.tolist() == [1, 2]
    assert found.attrs["first"].startswith("step 2, peer a, tensor layer.0.bias, element [9]")
    assert _chunk_reads(backend, poisoned) == [(2, "b", "layer.1.w", 6)]
    assert found.attrs["chunks_read"] == 2


def test_every_flagged_step_when_asked(poisoned: gp.Store) -> None:
    found = gp.first_nonfinite(poisoned, "r", first_only=False)
    assert found.step.values.tolist() == [2, 2, 4, 4]
    assert found.value.values.tolist() == ["nan", "-inf", "+inf", "+inf"]
    assert found.element.values.tolist()[2:] == ["3,3", "3,3"]


def test_a_clean_run_finds_nothing(store: gp.Store, tmp_path: Path) -> None:
    _write(tmp_path, 0, "a", {"w": np.ones(8, np.float32)})
    assert gp.ingest(store, str(tmp_path / "step={step}" / "peer={peer}.safetensors"), run="r").ok
    found = gp.first_nonfinite(store, "r")
    assert found.sizes.get("found", 0) == 0
    assert found.attrs["first"] == ""


def test_an_unreadable_earlier_step_makes_the_first_uncertain(poisoned: gp.Store) -> None:
    view = open_run(poisoned, "r")
    [entry] = [e for e in view if (e.step, e.peer) == (0, "b")]
    poisoned.backend.delete(block_key(entry.dump))
    found = gp.first_nonfinite(poisoned, "r")
    assert found.step.values.tolist()[:1] == [2]
    assert "uncertain: step 0 could not be analysed" in found.attrs["first"]
    [failed] = found.attrs["failed"]
    assert "step 0, peer 'b'" in failed
