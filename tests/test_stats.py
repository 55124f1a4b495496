"""Compression statistics equal what the stored data says, and are computed without a chunk read.

Every figure is recomputed here from what the store holds: stored bytes from
the sizes of the block objects (``fs.size`` on local disk and on S3, not the
listing gradpipe uses), values from the arrays read back.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path

import fsspec
import numpy as np
import pytest
import xarray as xr

import gradpipe as gp
from gradpipe.core.dtypes import dtype_name
from gradpipe.core.ids import block_key
from gradpipe.core.run_manifest import DumpEntry, DumpManifest, RunManifest, TensorSchema
from gradpipe.core.tensor_manifest import TensorManifest
from gradpipe.formats.safetensors import write_safetensors
from gradpipe.runs import open_run
from gradpipe.statistics.api import stats_records
from gradpipe.testing.faults import faulty_store

STEPS = 3
PEERS = ("a", "b")
MISSING = (2, "b")  # this peer sent nothing at this step
CHUNK_BYTES = 65536  # 256 KiB tensors in 4 chunks, big enough to keep out of line and chain


def _tensors(step: int, peer: str) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(10 * step + ord(peer))
    emb = np.zeros((1024, 64), np.float32)  # rows 512.. are never touched: two all-zero chunks
    rows = rng.choice(512, 40, replace=False)
    emb[rows] = rng.standard_normal((40, 64)).astype(np.float32)
    bias = rng.standard_normal(16).astype(np.float32)
    if (step, peer) == (1, "b"):
        bias[3], bias[4], bias[5] = np.nan, -np.inf, -0.0
    # Parameters: one peer's values change in a few elements per step (deltas pay).
    param = np.random.default_rng(ord(peer)).standard_normal((256, 256)).astype(np.float32)
    param.reshape(-1)[: 10 * step] += 1
    return {
        "dense": rng.standard_normal((256, 256)).astype(np.float32),
        "emb": emb,
        "bias": bias,
        # The same values for every peer of a step: one block, shared.
        "shared": np.random.default_rng(step).standard_normal(16384).astype(np.float32),
        "param": param,
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
                write_safetensors(f, _tensors(step, peer), {"num_examples": "10"})
    return str(root / "step={step}" / "peer={peer}.safetensors")


@pytest.fixture
def filled(store: gp.Store, dumps: str) -> gp.Store:
    """The store with run ``r`` (plain) and run ``d`` (delta chains) of the same dumps."""
    assert gp.ingest(store, dumps, run="r", chunk_bytes=CHUNK_BYTES).ok
    assert gp.ingest(store, dumps, run="d", chunk_bytes=CHUNK_BYTES, delta=True).ok
    return store


def _object_size(store: gp.Store, block: str) -> int:
    """The size of a block's object, asked of the file system itself."""
    fs, root = fsspec.core.url_to_fs(store.url)
    return int(fs.size(f"{root}/{block_key(block)}"))


def _cells(store: gp.Store, run: str) -> Iterator[tuple[int, str, str, TensorManifest]]:
    """(step, peer, tensor, manifest) in the order attribution promises."""
    view = open_run(store, run)
    for entry in view:
        for name, manifest in sorted(view.dump(entry.step, entry.peer).infos().items()):
            yield entry.step, entry.peer, name, manifest


def _expected_bytes(
    store: gp.Store, cells: list[tuple[int, str, str, TensorManifest]]
) -> dict[tuple[int, str, str], tuple[int, int]]:
    """(stored, referenced) bytes of each cell, shared blocks to the first cell."""
    seen: set[str] = set()
    out = {}
    for step, peer, name, manifest in cells:
        inline = sum(len(frame) for frame in manifest.inline.values())
        blocks = set(manifest.data_children())
        sizes = {b: _object_size(store, b) for b in blocks}
        owned = sum(size for b, size in sizes.items() if b not in seen)
        seen |= blocks
        out[step, peer, name] = (owned + inline, sum(sizes.values()) + inline)
    return out


@pytest.mark.parametrize("run", ["r", "d"])
def test_statistics_equal_the_stored_data(filled: gp.Store, run: str) -> None:
    ds = gp.compression_stats(filled, run=run)
    assert dict(ds.sizes) == {"step": STEPS, "peer": len(PEERS), "tensor": 5}
    cells = list(_cells(filled, run))
    expected = _expected_bytes(filled, cells)
    view = open_run(filled, run)
    for step, peer, name, manifest in cells:
        cell = ds.sel(step=step, peer=peer, tensor=name)
        array = np.asarray(view.read(name, step=step, peer=peer), dtype=np.float64)
        finite = array[np.isfinite(array)]
        stored, referenced = expected[step, peer, name]
        where = (step, peer, name)
        assert cell.stored_bytes == stored, where
        assert cell.referenced_bytes == referenced, where
        assert cell.raw_bytes == array.size * 4 == manifest.nbytes, where
        assert cell.numel == array.size, where
        assert cell.ratio == (array.size * 4 / stored if stored else math.inf), where
        assert cell.bits_per_value == 8 * stored / array.size, where
        assert cell.density == np.count_nonzero(array) / array.size, where
        assert cell.nan_count == np.isnan(array).sum(), where
        assert cell.inf_count == np.isinf(array).sum(), where
        assert math.isclose(cell.l2_norm, np.sqrt(np.sum(finite**2)), rel_tol=1e-12), where
        assert cell.max_abs == np.max(np.abs(array[~np.isnan(array)])), where
        assert cell.chain_depth == manifest.depth, where
        assert str(cell["encoding"].values) == ("delta" if manifest.deltas else "full"), where
        zero = sum(b is None for b in manifest.blocks) / len(manifest.blocks)
        assert cell.zero_chunk_fraction == zero, where
        assert not cell.lossy
    # Every block the run references counted once, and nothing else.
    blocks = {b for *_, m in cells for b in m.data_children()}
    inline = sum(len(f) for *_, m in cells for f in m.inline.values())
    total = sum(_object_size(filled, b) for b in blocks) + inline
    assert ds.stored_bytes.sum() == total
    assert ds.attrs["blocks_counted"] == len(blocks)


def test_the_data_has_what_the_tests_mean_to_check(filled: gp.Store) -> None:
    plain = gp.compression_stats(filled, run="r")
    chained = gp.compression_stats(filled, run="d")
    cell = plain.sel(step=1, peer="b", tensor="bias")
    assert (cell.nan_count, cell.inf_count, cell.max_abs) == (1, 1, math.inf)
    assert plain.zero_chunk_fraction.sel(step=0, peer="a", tensor="emb") == 0.5
    assert plain.codec.sel(step=0, peer="a", tensor="emb") == "gradpipe_sparse"
    assert plain.codec.sel(step=0, peer="a", tensor="dense") == "gradpipe_bytegroup"
    # The shared block counts for peer a; peer b references it for nothing.
    shared = plain.sel(tensor="shared", step=0)
    assert shared.stored_bytes.sel(peer="a") == shared.referenced_bytes.sel(peer="b") > 0
    assert shared.stored_bytes.sel(peer="b") == 0
    assert shared.ratio.sel(peer="b") == math.inf
    # Deltas: the parameters of later steps, against the keyframe of step 0.
    param = chained.sel(tensor="param", peer="a")
    assert list(param["encoding"].values) == ["full", "delta", "delta"]
    assert list(param.chain_depth.values) == [0, 1, 1]
    assert param.stored_bytes.sel(step=1) < param.stored_bytes.sel(step=0) / 10
    assert "gradpipe_delta:int" in str(param.codec.sel(step=1).values)


def test_missing_cells_are_nan_not_zero(filled: gp.Store) -> None:
    ds = gp.compression_stats(filled, run="r")
    step, peer = MISSING
    assert not ds.present.sel(step=step, peer=peer)
    assert int(ds.present.sum()) == STEPS * len(PEERS) - 1
    gone = ds.sel(step=step, peer=peer)
    for name in ("raw_bytes", "stored_bytes", "ratio", "density", "l2_norm", "numel"):
        assert np.isnan(gone[name].values).all(), name
    assert (gone["encoding"].values == "").all()
    assert not gone.lossy.any()
    # Plain xarray sums are right for additive fields; min_count keeps a missing cell NaN.
    per_dump = ds.raw_bytes.sum("tensor", min_count=1)
    assert np.isnan(per_dump.sel(step=step, peer=peer))
    assert per_dump.sel(step=0, peer="a") == sum(a.nbytes for a in _tensors(0, "a").values())


def test_summaries_recompute_ratios_from_sums(filled: gp.Store) -> None:
    ds = gp.compression_stats(filled, run="r")
    for by in ("step", "peer", "tensor"):
        summary = gp.summarize_stats(ds, by=by)
        assert list(summary.sizes) == [by]
        others = [d for d in ("step", "peer", "tensor") if d != by]
        raw = ds.raw_bytes.sum(others)
        stored = ds.stored_bytes.sum(others)
        np.testing.assert_array_equal(summary.stored_bytes, stored)
        np.testing.assert_array_equal(summary.ratio, raw / stored)
        np.testing.assert_array_equal(
            summary.density, ds.nonzero_count.sum(others) / ds.numel.sum(others)
        )
        np.testing.assert_allclose(
            summary.l2_norm, np.sqrt((ds.l2_norm**2).sum(others)), rtol=1e-12
        )
        np.testing.assert_array_equal(summary.max_abs, ds.max_abs.max(others))
    totals = gp.summarize_stats(ds)
    assert totals.stored_bytes == ds.stored_bytes.sum()
    assert totals.ratio == ds.raw_bytes.sum() / ds.stored_bytes.sum()
    assert totals.ratio != ds.ratio.where(np.isfinite(ds.ratio)).mean()  # not a mean of ratios
    assert totals.nan_count == 1
    assert str(totals["codec"].values) == "gradpipe_bytegroup,gradpipe_sparse"
    per_cell = gp.summarize_stats(ds, by=["step", "peer"])
    assert np.isnan(per_cell.ratio.sel(step=MISSING[0], peer=MISSING[1]))
    assert str(gp.summarize_stats(gp.compression_stats(filled, run="d"))["encoding"].values) == (
        "delta,full"
    )
    with pytest.raises(gp.InvalidInputError, match="cannot summarize by version"):
        gp.summarize_stats(ds, by="version")


def test_records_carry_the_fields_by_name(filled: gp.Store) -> None:
    ds = gp.compression_stats(filled, run="r")
    records = list(stats_records(ds))
    assert len(records) == 5 * (STEPS * len(PEERS) - 1)
    first = records[0]
    assert list(first)[:3] == ["step", "peer", "tensor"]
    assert (first["step"], first["peer"], first["tensor"]) == (0, "a", "bias")
    assert isinstance(first["raw_bytes"], int)
    assert first["encoding"] == "full"
    [total] = stats_records(gp.summarize_stats(ds))
    assert total["stored_bytes"] == sum(r["stored_bytes"] for r in records)


def test_aggregate_statistics(filled: gp.Store) -> None:
    # Step 1 holds a NaN, which aggregation refuses; step 2 lacks a peer.
    report = gp.aggregate(filled, run="r", steps=[0], method="mean", name="avg")
    assert report.ok, report.summary()
    ds = gp.compression_stats(filled, run="r", aggregate="avg")
    assert dict(ds.sizes) == {"step": 1, "tensor": 5}
    assert ds.attrs["kind"] == "aggregate"
    view = open_run(filled, "r")
    for step in (0,):
        found = view.aggregate("avg", step=step)
        for name, manifest in found.infos().items():
            array = np.asarray(found.read(name), np.float64)
            cell = ds.sel(step=step, tensor=name)
            assert cell.raw_bytes == manifest.nbytes
            assert cell.density == np.count_nonzero(array) / array.size
            finite = array[np.isfinite(array)]
            assert math.isclose(cell.l2_norm, np.sqrt(np.sum(finite**2)), rel_tol=1e-12)
    with pytest.raises(gp.NotFoundError, match="aggregates: avg"):
        gp.compression_stats(filled, run="r", aggregate="fedavg")


def test_snapshot_statistics(store: gp.Store) -> None:
    rng = np.random.default_rng(0)
    weights = rng.standard_normal((128, 128)).astype(np.float32)
    for step in range(3):
        weights.reshape(-1)[: 50 * step] += 1
        state = {"w": weights.copy(), "b": np.full(8, step, np.float32)}
        gp.snapshot(store, "model", state, step=10 * step)
    ds = gp.compression_stats(store, snapshot="model")
    assert dict(ds.sizes) == {"version": 3, "tensor": 2}
    assert list(ds.step.values) == [0, 10, 20]
    assert list(ds["encoding"].sel(tensor="w").values) == ["full", "delta", "delta"]
    w = ds.sel(tensor="w")
    assert (w.stored_bytes.isel(version=slice(1, None)) < w.stored_bytes.isel(version=0)).all()
    records = list(stats_records(ds))
    assert [(r["version"], r["step"], r["tensor"]) for r in records[:2]] == [
        (0, 0, "b"),
        (0, 0, "w"),
    ]
    # A lossy (thresholded sparse) delta is marked, with its error: it drops these changes.
    weights.reshape(-1)[-20:] += 1e-4
    gp.snapshot(store, "model", {"w": weights, "b": np.zeros(8, np.float32)}, step=30,
                delta="sparse", threshold=1e-3)  # fmt: skip
    last = gp.compression_stats(store, snapshot="model").sel(tensor="w").isel(version=-1)
    assert bool(last.lossy)
    assert 1e-4 <= float(last.max_abs_error) <= 1e-3


def test_a_missing_block_is_reported_not_guessed(tmp_path: Path, dumps: str) -> None:
    store = gp.open_store(str(tmp_path / "store"), mode="w")
    assert gp.ingest(store, dumps, run="r", chunk_bytes=CHUNK_BYTES).ok
    manifest = open_run(store, "r").dump(0, "a").info("dense")
    victim = next(iter(manifest.data_children()))
    (tmp_path / "store" / block_key(victim)).unlink()
    ds = gp.compression_stats(store, run="r")
    cell = ds.sel(step=0, peer="a", tensor="dense")
    assert cell.missing_blocks == 1
    assert np.isnan(cell.ratio)
    assert ds.attrs["missing_blocks"] == 1
    assert np.isnan(gp.summarize_stats(ds).ratio)


def test_dumps_whose_tensors_are_manifests_of_their_own(tmp_path: Path) -> None:
    """Format 1 dumps list tensor manifests stored apart: fetched, in one batch per dump."""
    store = gp.open_store(str(tmp_path / "store"), mode="w")
    rng = np.random.default_rng(5)
    arrays = {"w": rng.standard_normal((64, 64)).astype(np.float32), "b": np.zeros(4, np.int8)}
    tensors = tuple((n, store.put_manifest(store.write_tensor(a))) for n, a in arrays.items())
    dump_id = store.put_manifest(DumpManifest("old", 0, "a", tensors))
    schema = {n: TensorSchema(dtype_name(a.dtype), a.shape) for n, a in arrays.items()}
    run = RunManifest("old", (DumpEntry(0, "a", dump_id, "file"),), schema)
    store.refs.set("runs/old", store.put_manifest(run))
    counted, backend = faulty_store(store)
    ds = gp.compression_stats(counted, run="old")
    reads = [key for op, key in backend.calls if op == "read"]
    assert len(reads) == 4  # the run, the dump, its two tensor manifests
    w = ds.sel(step=0, peer="a", tensor="w")
    assert w.density == 1.0
    assert math.isclose(w.l2_norm, float(np.linalg.norm(arrays["w"].astype(np.float64))))
    [block] = store.tensor_info(tensors[0][1]).blocks
    assert block is not None
    assert w.stored_bytes == _object_size(store, block)
    b = ds.sel(step=0, peer="a", tensor="b")
    assert (b.stored_bytes, b.density, b.ratio, str(b.codec.values)) == (0, 0.0, math.inf, "none")


def test_bad_arguments(filled: gp.Store) -> None:
    with pytest.raises(gp.InvalidInputError, match="run=NAME or snapshot=NAME"):
        gp.compression_stats(filled)
    with pytest.raises(gp.InvalidInputError, match="one of them"):
        gp.compression_stats(filled, run="r", snapshot="s")
    with pytest.raises(gp.InvalidInputError, match="needs the run"):
        gp.compression_stats(filled, snapshot="s", aggregate="a")
    with pytest.raises(gp.NotFoundError, match="no run 'nope'"):
        gp.compression_stats(filled, run="nope")
    with pytest.raises(gp.NotFoundError, match="no snapshot 'nope'"):
        gp.compression_stats(filled, snapshot="nope")


# --- 2,000 dumps -------------------------------------------------------------------
MANY = 2_000


@pytest.fixture(scope="module")
def many_dumps(tmp_path_factory: pytest.TempPathFactory) -> str:
    """2,000 small dumps: a 16 KiB tensor (a block of its own) and an inline bias each."""
    root = tmp_path_factory.mktemp("many")
    for i in range(MANY):
        step, peer = divmod(i, 4)
        path = root / f"step={step:04d}" / f"peer=p{peer}.safetensors"
        path.parent.mkdir(exist_ok=True)
        rng = np.random.default_rng(i)
        tensors = {
            "w": rng.standard_normal(4096).astype(np.float32),
            "b": rng.standard_normal(8).astype(np.float32),
        }
        with path.open("wb") as f:
            write_safetensors(f, tensors, {})
    return str(root / "step={step}" / "peer={peer}.safetensors")


def test_two_thousand_dumps_read_no_chunk(tmp_path: Path, many_dumps: str) -> None:
    store = gp.open_store(str(tmp_path / "store"), mode="w")
    assert gp.ingest(store, many_dumps, run="r", workers=2).ok
    counted, backend = faulty_store(store)  # no faults: it records every call
    ds = gp.compression_stats(counted, run="r")
    assert int(ds.present.sum()) == MANY
    view = open_run(store, "r")
    chunks = {block_key(b) for e in view for b in view.dump(e.step, e.peer).info("w").blocks if b}
    assert len(chunks) == MANY
    reads = [key for op, key in backend.calls if op == "read"]
    assert not set(reads) & chunks
    # One manifest per dump, each read once; beside them only the run manifest and its shards
    # (a run this long is a small tree of them, a few dozen nodes, not one per dump).
    dumps = {block_key(e.dump) for e in view}
    assert len(reads) == len(set(reads))
    assert dumps <= set(reads)
    assert 1 <= len(set(reads) - dumps) < MANY // 50
    assert [key for op, key in backend.calls if op == "list"] == ["blocks"]
    assert ds.stored_bytes.sel(tensor="w").sum() == sum(
        (tmp_path / "store" / key).stat().st_size for key in chunks
    )


def test_datasets_save_and_load(filled: gp.Store, tmp_path: Path) -> None:
    """What a Jupyter user does next: keep the statistics in Zarr and read them back."""
    pytest.importorskip("zarr")
    ds = gp.compression_stats(filled, run="r")
    path = tmp_path / "stats.zarr"
    ds.to_zarr(path, mode="w", consolidated=False)
    again = xr.open_zarr(path, consolidated=False).load()
    xr.testing.assert_identical(again, ds)
