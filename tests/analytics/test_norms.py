"""Norm and scale series from the manifests: every figure against a float64 numpy reference."""

from __future__ import annotations

import math
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

import gradpipe as gp
from gradpipe.core.ids import block_key
from gradpipe.formats.safetensors import write_safetensors
from gradpipe.runs import open_run
from gradpipe.testing.faults import faulty_store

STEPS = 4
PEERS = ("a", "b", "c")
MISSING = (2, "c")
CHUNK_BYTES = 16384  # several chunks per tensor, some inline, some blocks


def _tensors(step: int, peer: str) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(100 * step + ord(peer))
    bias = rng.standard_normal(40).astype(np.float32)
    if (step, peer) == (1, "b"):
        bias[3], bias[4], bias[5], bias[6] = np.nan, -np.inf, -0.0, np.inf
    half = (rng.standard_normal((64, 48)) * 3).astype(np.float16)
    if (step, peer) == (3, "a"):
        half[10, 5] = np.float16(np.inf)
    return {
        "embeddings.word.weight": rng.standard_normal((300, 64)).astype(np.float32),
        "encoder.layer.0.attn.weight": half,
        "encoder.layer.0.attn.bias": bias,
        "encoder.layer.1.mlp.weight": (rng.standard_normal((128, 32)) * 1e-3).astype(
            ml_dtypes.bfloat16
        ),
        "encoder.layer.1.mlp.bias": rng.standard_normal(24).astype(np.float64),
        "pooler.zero": np.zeros(50, np.float32),
    }


@pytest.fixture(scope="module")
def dumps(tmp_path_factory: pytest.TempPathFactory) -> str:
    root = tmp_path_factory.mktemp("dumps")
    for step in range(STEPS):
        for peer in PEERS:
            if (step, peer) == MISSING:
                continue
            path = root / f"step={step}" / f"peer={peer}.safetensors"
            path.parent.mkdir(exist_ok=True)
            with path.open("wb") as f:
                write_safetensors(f, _tensors(step, peer), {"num_examples": "8"})
    return str(root / "step={step}" / "peer={peer}.safetensors")


@pytest.fixture
def filled(store: gp.Store, dumps: str) -> gp.Store:
    """Run ``r`` (plain) and run ``d`` (delta chains) of the same dumps."""
    assert gp.ingest(store, dumps, run="r", chunk_bytes=CHUNK_BYTES).ok
    assert gp.ingest(store, dumps, run="d", chunk_bytes=CHUNK_BYTES, delta=True).ok
    return store


def _reference(values: np.ndarray) -> dict[str, float]:
    x = np.asarray(values, dtype=np.float64).reshape(-1)
    finite = x[np.isfinite(x)]
    peaks = np.abs(x[~np.isnan(x)])
    return {
        "sum_squares": math.fsum((finite * finite).tolist()),
        "max_abs": float(peaks.max()) if peaks.size else math.nan,
        "nonzero_count": float(np.count_nonzero(x)),  # NaN counts, -0.0 does not
        "nan_count": float(np.isnan(x).sum()),
        "inf_count": float(np.isinf(x).sum()),
        "numel": float(x.size),
    }


def _block_reads(backend: object, store: gp.Store, run: str) -> set[str]:
    view = open_run(store, run)
    chunks = {
        block_key(b)
        for e in view
        for name in view.dump(e.step, e.peer).names
        for i, b in enumerate(view.dump(e.step, e.peer).info(name).blocks)
        if b and i not in view.dump(e.step, e.peer).info(name).inline
    }
    assert len(chunks) >= 20  # the test means chunks that are blocks of their own
    return {key for op, key in backend.calls if op == "read"} & chunks  # type: ignore[attr-defined]


@pytest.mark.parametrize("run", ["r", "d"])
def test_figures_equal_a_float64_reference_and_read_no_chunk(filled: gp.Store, run: str) -> None:
    counted, backend = faulty_store(filled)  # no faults: it records every call
    ds = gp.gradient_norms(counted, run)
    assert not _block_reads(backend, filled, run)
    assert ds.attrs["chunks_read"] == 0
    assert ds.sizes == {"step": STEPS, "peer": len(PEERS), "tensor": 6}
    assert list(ds.tensor.values) == [  # model order, not the files' (by dtype and size)
        "embeddings.word.weight",
        "encoder.layer.0.attn.bias",
        "encoder.layer.0.attn.weight",
        "encoder.layer.1.mlp.bias",
        "encoder.layer.1.mlp.weight",
        "pooler.zero",
    ]
    for step in range(STEPS):
        for peer in PEERS:
            cell = ds.sel(step=step, peer=peer)
            if (step, peer) == MISSING:
                assert np.isnan(cell.l2_norm).all()
                assert np.isnan(cell.numel).all()
                continue
            for name, values in _tensors(step, peer).items():
                want = _reference(values)
                got = cell.sel(tensor=name)
                for field, value in want.items():
                    assert got[field].item() == pytest.approx(value, rel=1e-12, nan_ok=True)
                assert got.l2_norm.item() == pytest.approx(math.sqrt(want["sum_squares"]), 1e-12)
    assert ds.sel(step=1, peer="b", tensor="encoder.layer.0.attn.bias").inf_count == 2
    assert ds.sel(step=1, peer="b", tensor="encoder.layer.0.attn.bias").max_abs == np.inf
    assert ds.sel(step=0, peer="a", tensor="pooler.zero").l2_norm == 0
    assert list(ds.layer.values[:3]) == ["embeddings", "encoder.layer.0", "encoder.layer.0"]


def test_layers_and_totals_are_exact_sums(filled: gp.Store) -> None:
    ds = gp.gradient_norms(filled, "r")
    layers = gp.norms_by(ds, "layer")
    total = gp.norms_by(ds, "total")
    assert list(layers.layer.values) == [
        "embeddings",
        "encoder.layer.0",
        "encoder.layer.1",
        "pooler",
    ]
    for step, peer in [(0, "a"), (1, "b"), (3, "c")]:
        tensors = _tensors(step, peer)
        squares = {n: _reference(v)["sum_squares"] for n, v in tensors.items()}
        layer = [n for n in tensors if n.startswith("encoder.layer.0")]
        got = layers.sel(step=step, peer=peer, layer="encoder.layer.0")
        # Exact sums of the chunks' sums of squares (each rounded once when written).
        assert got.sum_squares.item() == pytest.approx(math.fsum(squares[n] for n in layer), 1e-14)
        assert got.numel.item() == sum(tensors[n].size for n in layer)
        all_squares = math.fsum(squares.values())
        got_total = total.sel(step=step, peer=peer)
        assert got_total.l2_norm.item() == pytest.approx(math.sqrt(all_squares), rel=1e-14)
        assert got_total.sum_squares.item() == math.fsum(
            ds.sel(step=step, peer=peer).sum_squares.values.tolist()
        )
    assert np.isnan(total.sel(step=2, peer="c").l2_norm)  # nothing there: NaN, not 0
    custom = gp.gradient_norms(filled, "r", layers=r"^(\w+)")
    assert set(custom.layer.values) == {"embeddings", "encoder", "pooler"}
    assert custom.attrs["memoised_steps"] == STEPS  # a layer rule is read-time only


def test_the_second_call_reads_only_the_index_and_the_results(filled: gp.Store) -> None:
    first = gp.gradient_norms(filled, "r")
    assert first.attrs["computed_steps"] == STEPS
    counted, backend = faulty_store(filled)
    again = gp.gradient_norms(counted, "r")
    assert again.attrs["memoised_steps"] == STEPS
    assert again.attrs["computed_steps"] == 0
    dumps = {block_key(e.dump) for e in open_run(filled, "r")}
    assert not {key for op, key in backend.calls if op == "read"} & dumps
    assert list(again.analysis_id.values) == list(first.analysis_id.values)
    assert again.identical(first.assign_attrs(again.attrs))


def test_a_replaced_dump_recomputes_its_step_only(filled: gp.Store, tmp_path: Path) -> None:
    gp.gradient_norms(filled, "r")
    path = tmp_path / "step=1" / "peer=a.safetensors"
    path.parent.mkdir()
    tensors = _tensors(1, "a")
    tensors["pooler.zero"] = np.ones(50, np.float32)
    with path.open("wb") as f:
        write_safetensors(f, tensors, {})
    pattern = str(tmp_path / "step={step}" / "peer={peer}.safetensors")
    assert gp.ingest(filled, pattern, run="r", chunk_bytes=CHUNK_BYTES, replace=True).ok
    ds = gp.gradient_norms(filled, "r")
    assert ds.attrs["computed_steps"] == 1
    assert ds.attrs["memoised_steps"] == STEPS - 1
    assert ds.sel(step=1, peer="a", tensor="pooler.zero").l2_norm == pytest.approx(math.sqrt(50))


def test_a_read_only_store_computes_without_writing(filled: gp.Store) -> None:
    reader = gp.open_store(filled.url, mode="r")
    ds = gp.gradient_norms(reader, "r", steps=range(2))
    assert ds.attrs["not_recorded"]
    assert ds.sizes["step"] == 2
    assert filled.refs.entry("analytics/r") is None


def test_aggregate_norms(filled: gp.Store) -> None:
    assert gp.aggregate(filled, run="r", method="mean", name="avg", steps=[0]).ok
    ds = gp.gradient_norms(filled, "r", aggregate="avg")
    assert ds.l2_norm.dims == ("step", "tensor")
    assert list(ds.step.values) == [0]
    arrays = open_run(filled, "r").aggregate("avg", step=0).read_all()
    for name, values in arrays.items():
        want = _reference(values)
        assert ds.sel(step=0, tensor=name).sum_squares.item() == pytest.approx(
            want["sum_squares"], rel=1e-12
        )
    with pytest.raises(gp.NotFoundError, match="no aggregate 'nope'"):
        gp.gradient_norms(filled, "r", aggregate="nope")


def test_overflowed_float64_chunks_are_read_and_only_they(
    local_store: gp.Store, tmp_path: Path
) -> None:
    big = np.ones(4096, np.float64)
    big[100:110] = 1e200  # squares overflow in the first chunk only
    path = tmp_path / "step=0" / "peer=a.safetensors"
    path.parent.mkdir()
    with path.open("wb") as f:
        write_safetensors(f, {"big": big, "small": np.ones(8)}, {})
    pattern = str(tmp_path / "step={step}" / "peer={peer}.safetensors")
    assert gp.ingest(local_store, pattern, run="r", chunk_bytes=4096).ok
    ds = gp.gradient_norms(local_store, "r")
    assert ds.attrs["chunks_read"] == 1
    cell = ds.sel(step=0, peer="a", tensor="big")
    assert cell.sum_squares == np.inf
    assert cell.l2_norm.item() == pytest.approx(math.sqrt(10) * 1e200 * math.sqrt(1 + 4086e-400))
    total = gp.norms_by(ds, "total")
    assert total.l2_norm.item() == pytest.approx(math.sqrt(10) * 1e200)


def test_a_broken_step_does_not_take_the_others_down(filled: gp.Store) -> None:
    view = open_run(filled, "r")
    victim = next(e for e in view if e.step == 2)
    filled.backend.delete(block_key(victim.dump))
    ds = gp.gradient_norms(filled, "r")
    assert list(ds.step.values) == [0, 1, 3]
    [failure] = ds.attrs["failed"]
    assert failure.startswith("step 2:")
    assert victim.dump in failure


def test_bad_requests(filled: gp.Store) -> None:
    with pytest.raises(gp.NotFoundError, match="no run 'nope'"):
        gp.gradient_norms(filled, "nope")
    with pytest.raises(gp.InvalidInputError, match="nothing recorded at step 9"):
        gp.gradient_norms(filled, "r", steps=[9])
    ds = gp.gradient_norms(filled, "r")
    with pytest.raises(gp.InvalidInputError, match="layer or total"):
        gp.norms_by(ds, "peer")


def test_sums_beyond_float64_fall_back_to_the_norms(local_store: gp.Store, tmp_path: Path) -> None:
    big = np.full(2, 9.2e153)  # each square finite, the sum of the tensor's squares not
    nan_and_big = np.array([1e200, np.nan, 3.0])
    path = tmp_path / "step=0" / "peer=a.safetensors"
    path.parent.mkdir()
    with path.open("wb") as f:
        write_safetensors(f, {"a": big, "b": big.copy(), "c": nan_and_big}, {})
    pattern = str(tmp_path / "step={step}" / "peer={peer}.safetensors")
    assert gp.ingest(local_store, pattern, run="r").ok
    ds = gp.gradient_norms(local_store, "r")
    assert ds.sel(tensor="c").l2_norm.item() == pytest.approx(1e200)  # finite values only
    total = gp.norms_by(ds, "total").l2_norm.item()
    assert total == pytest.approx(math.hypot(1e200, 2 * 9.2e153), rel=1e-12)
    assert bool(gp.spikes(ds).nonfinite.all())  # c holds a NaN: flagged, no z


def test_the_peers_are_in_the_runs_order_whoever_comes_first(
    local_store: gp.Store, tmp_path: Path
) -> None:
    for step, peers in ((0, ("b",)), (1, ("a", "b"))):
        for peer in peers:
            path = tmp_path / f"step={step}" / f"peer={peer}.safetensors"
            path.parent.mkdir(exist_ok=True)
            with path.open("wb") as f:
                write_safetensors(f, {"w": np.ones(4, np.float32)}, {})
    pattern = str(tmp_path / "step={step}" / "peer={peer}.safetensors")
    assert gp.ingest(local_store, pattern, run="r").ok
    assert list(gp.gradient_norms(local_store, "r").peer.values) == ["a", "b"]


def test_bad_step_selections_and_layer_rules(filled: gp.Store) -> None:
    with pytest.raises(gp.InvalidInputError, match="selects no step"):
        gp.gradient_norms(filled, "r", steps=[])
    with pytest.raises(gp.InvalidInputError, match="must be a range or a list"):
        gp.gradient_norms(filled, "r", steps=5)  # type: ignore[arg-type]
    with pytest.raises(gp.InvalidInputError, match=r"it has steps 0\.\.3"):
        gp.gradient_norms(filled, "r", steps=range(10, 20))
    with pytest.raises(gp.InvalidInputError, match="gave None for tensor"):
        gp.gradient_norms(filled, "r", layers=lambda name: None)  # type: ignore[arg-type,return-value]
    ds = gp.gradient_norms(filled, "r")
    with pytest.raises(gp.InvalidInputError, match="take no layers"):
        gp.spikes(ds, layers="x")
