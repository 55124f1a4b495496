"""``gp.aggregate`` end to end: chunks read from the store, reduced, written back, recorded."""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from pathlib import Path
from typing import Any

import dask.config
import numpy as np
import pytest

import gradpipe as gp
from gradpipe.cli.testing import run_cli
from gradpipe.core.ids import block_key
from gradpipe.formats.safetensors import read_safetensors, write_safetensors
from gradpipe.testing.training import SampleRun, TrainingConfig, write_sample_run

#: 3 peers x 3 steps; the embedding spans several chunks at the chunk size below.
SMALL = TrainingConfig(vocab_size=3000, embed_dim=16, hidden=16, peers=3, steps=3)
CHUNK = {"gradpipe.chunk-bytes": "48 KiB"}


@pytest.fixture(scope="module")
def sample(tmp_path_factory: pytest.TempPathFactory) -> SampleRun:
    return write_sample_run(tmp_path_factory.mktemp("sample"), SMALL)


def _ingest(url: str | Path, pattern: str, chunk: str = "48 KiB", **kw: Any) -> gp.Store:
    store = gp.open_store(url, mode="a")
    with dask.config.set({"gradpipe.chunk-bytes": chunk}):
        report = gp.ingest(store, pattern, run="r", **kw)
    assert report.ok, report.failures
    return store


@pytest.fixture
def store(sample: SampleRun, tmp_path: Path) -> gp.Store:
    return _ingest(tmp_path / "store", sample.dump_pattern)


def _reference(
    store: gp.Store, step: int, method: str, weights: dict[str, float] | None, clip: float | None
) -> dict[str, np.ndarray]:
    """An independent float64 reference from the dumps read whole."""
    run = gp.open_run(store, "r")
    peers = [p for p in run.peers if run.manifest.entry(step, p)]
    dumps = {p: run.dump(step, p).read_all() for p in peers}
    if method == "fedavg" and weights is None:
        w = {p: float(run.dump(step, p).metadata["num_examples"]) for p in peers}
    else:
        w = weights or dict.fromkeys(peers, 1.0)
    scale = dict.fromkeys(peers, 1.0)
    if clip is not None:
        for p in peers:
            norm = np.sqrt(sum(float(np.sum(a.astype(np.float64) ** 2)) for a in dumps[p].values()))
            scale[p] = min(1.0, clip / norm)
    out = {}
    for name in dumps[peers[0]]:
        total = sum(w[p] * scale[p] * dumps[p][name].astype(np.float64) for p in peers)
        out[name] = total if method == "sum" else total / sum(w[p] for p in peers)
    return out


def _within_one_ulp32(got: np.ndarray, ref: np.ndarray, what: str) -> None:
    # docs/design/009: float64 accumulation, one rounding: within one float32 ulp.
    assert got.dtype == np.float32, what
    ulp = np.spacing(np.abs(ref).astype(np.float32)).astype(np.float64)
    assert (np.abs(got.astype(np.float64) - ref) <= ulp).all(), what


@pytest.mark.parametrize(
    ("method", "weights", "clip"),
    [
        ("sum", None, None),
        ("mean", None, None),
        ("weighted-mean", {"peer0": 3.0, "peer1": 1.0, "peer2": 0.5}, None),
        ("fedavg", None, None),
        ("fedavg", None, 0.05),
        ("sum", {"peer0": 2.0, "peer1": 1.0, "peer2": 7.0}, 0.05),
    ],
)
def test_methods_match_a_float64_reference(
    store: gp.Store, method: str, weights: dict[str, float] | None, clip: float | None
) -> None:
    report = gp.aggregate(store, run="r", method=method, weights=weights, clip_norm=clip)
    assert report.ok, report.summary()
    assert report.computed == SMALL.steps
    run = gp.open_run(store, "r")
    for step in run.steps:
        view = run.aggregate(method, step=step)
        assert view.stale is None
        assert view.method == method
        assert view.peers == SMALL.peer_names
        want = _reference(store, step, method, weights, clip)
        assert view.names == list(want)
        for name, ref in want.items():
            _within_one_ulp32(np.asarray(view.read(name)), ref, f"{method} step {step} {name}")
    if clip is not None:  # the clip bites: the clipped result differs from the plain one
        plain = _reference(store, 0, method, weights, None)["embedding.weight"]
        assert not np.allclose(plain, run.aggregate(method, step=0).read("embedding.weight"))


def test_the_aggregate_id_does_not_depend_on_tree_or_scheduler(store: gp.Store) -> None:
    ids = set()
    for split_every in (2, 4, 8):
        report = gp.aggregate(
            store, run="r", steps=[1], split_every=split_every, clip_norm=0.05, force=True
        )
        assert report.computed == 1
        ids.add(report.aggregate_id(1))
    with gp.runner(dashboard=True, workers=2) as cluster:  # an in-process LocalCluster
        assert cluster.client is not None
        report = gp.aggregate(
            store, run="r", steps=[1], clip_norm=0.05, force=True, runner=cluster, split_every=2
        )
    ids.add(report.aggregate_id(1))
    assert len(ids) == 1
    assert None not in ids


def test_the_chunk_grid_at_ingest_does_not_change_the_bits(
    sample: SampleRun, tmp_path: Path
) -> None:
    """The reduction is element-wise: any grid gives the same bits (the ids differ: the dumps'
    tensor manifests record their grid). Clipping sums squares in float64 within a chunk, so
    a different grid may change a scale in its last bit (design note 009); here it does not."""
    results = []
    for i, chunk in enumerate(("16 KiB", "48 KiB", "1 MiB")):
        store = _ingest(tmp_path / f"s{i}", sample.dump_pattern, chunk)
        grid = gp.open_run(store, "r").dump(0, "peer0").info("embedding.weight").chunk_shape
        plain = gp.aggregate(store, run="r", method="fedavg")
        clipped = gp.aggregate(store, run="r", method="fedavg", name="clipped", clip_norm=0.05)
        assert plain.ok
        assert clipped.ok
        run = gp.open_run(store, "r")
        out = {}
        for name in ("fedavg", "clipped"):
            view = run.aggregate(name, step=2)
            assert view.info("embedding.weight").chunk_shape == grid  # the first peer's grid
            out[name] = view.read_all()
        results.append((grid, out))
    assert len({grid for grid, _ in results}) == 3
    for _, out in results[1:]:
        for kind in ("fedavg", "clipped"):
            for name, array in out[kind].items():
                assert array.tobytes() == results[0][1][kind][name].tobytes(), (kind, name)


def _data_blocks(store: gp.Store) -> list[str]:
    run = gp.open_run(store, "r")
    return sorted({b for e in run for b in run.dump(e.step, e.peer).manifest.data_children()})


def test_memoised_reads_no_chunk_and_force_recomputes(store: gp.Store) -> None:
    first = gp.aggregate(store, run="r")
    assert first.computed == SMALL.steps
    blocks = _data_blocks(store)
    assert blocks  # chunks stored as objects of their own, not only inline
    for block in blocks:
        store.backend.delete(block_key(block))
    again = gp.aggregate(store, run="r")
    assert again.ok
    assert again.memoised == SMALL.steps
    assert again.computed == 0
    assert [s.aggregate for s in again.steps] == [s.aggregate for s in first.steps]
    before = store.refs.get("runs/r")
    forced = gp.aggregate(store, run="r", force=True)  # must read: the blocks are gone
    assert not forced.ok
    assert forced.failed == SMALL.steps
    assert "missing" in forced.steps[0].reason or "not found" in forced.steps[0].reason.lower()
    assert store.refs.get("runs/r") == before


def _store_files(store: gp.Store) -> list[str]:
    root = Path(store.url.removeprefix("file://"))
    return sorted(str(p) for p in root.rglob("*") if p.is_file() and "locks" not in p.parts)


def _bad_run(
    tmp_path: Path, arrays: dict[str, dict[str, np.ndarray]], meta: dict[str, str]
) -> gp.Store:
    for peer, tensors in arrays.items():
        path = tmp_path / "bad" / f"step=3/peer={peer}.safetensors"
        path.parent.mkdir(parents=True, exist_ok=True)
        write_safetensors(str(path), tensors, {"num_examples": meta[peer]} if peer in meta else {})
    return _ingest(tmp_path / "badstore", str(tmp_path / "bad/step={step}/peer={peer}.safetensors"))


W = np.ones((4, 3), np.float32)


@pytest.mark.parametrize(
    ("arrays", "meta", "kwargs", "words"),
    [
        ({"a": {"w": W}, "b": {"w": W, "v": W}}, {}, {"method": "mean"}, ["step 3", "'b'", "'v'"]),
        ({"a": {"w": W}, "b": {"w": W * np.nan}}, {}, {"method": "sum"}, ["step 3", "'b'", "NaN"]),
        ({"a": {"w": W}, "b": {"w": W}}, {"a": "3", "b": "0"}, {}, ["step 3", "'b'", "weight"]),
        ({"a": {"w": W}, "b": {"w": W}}, {"a": "3"}, {}, ["step 3", "'b'", "num_examples"]),
        (
            {"a": {"w": W}, "b": {"w": W}},
            {},
            {"method": "weighted-mean", "weights": {"a": 1.0, "b": -2.0}},
            ["step 3", "'b'", "weight"],
        ),
        (
            {"a": {"w": W}, "b": {"w": W}},
            {},
            {"method": "weighted-mean", "weights": {"a": 1.0, "b": float("nan")}},
            ["step 3", "'b'", "weight"],
        ),
        ({"a": {"w": W}, "b": {"w": W}}, {}, {"method": "mean", "steps": [99]}, ["step 99"]),
        ({"a": {"w": W}, "b": {"w": W}}, {}, {"method": "mean", "steps": range(5, 9)}, ["5:9"]),
        ({"a": {"w": W}, "b": {"w": W}}, {}, {"method": "adam"}, ["adam", "fedavg"]),
        ({"a": {"w": W}, "b": {"w": W}}, {}, {"method": "fedadam"}, ["fedadam", "--snapshot"]),
        ({"a": {"w": W}, "b": {"w": W}}, {}, {"method": "krum"}, ["step 3", "krum", "3 peers"]),
        (
            {"a": {"w": W}, "b": {"w": W}},
            {},
            {"method": "bulyan", "byzantine": 1},
            ["step 3", "bulyan", "7 peers"],
        ),
        ({"a": {"w": W}, "b": {"w": W}}, {}, {"method": "median", "trim": 0.1}, ["trim"]),
        ({"a": {"w": W}, "b": {"w": W}}, {}, {"method": "trimmed-mean", "trim": 0.5}, ["trim"]),
        ({"a": {"w": W}, "b": {"w": W}}, {}, {"method": "dp-fedavg"}, ["--clip-norm"]),
        ({"a": {"w": W}, "b": {"w": W}}, {}, {"split_every": 3}, ["power of two"]),
        ({"a": {"w": W}, "b": {"w": W}}, {}, {"method": "mean", "clip_norm": 0.0}, ["clip_norm"]),
    ],
)
def test_bad_input_names_what_and_writes_nothing(
    tmp_path: Path,
    arrays: dict[str, dict[str, np.ndarray]],
    meta: dict[str, str],
    kwargs: dict[str, Any],
    words: Sequence[str],
) -> None:
    store = _bad_run(tmp_path, arrays, meta)
    ref = store.refs.get("runs/r")
    files = _store_files(store)
    with pytest.raises(gp.InvalidInputError) as caught:
        gp.aggregate(store, run="r", **kwargs)
    for word in words:
        assert word in str(caught.value)
    assert store.refs.get("runs/r") == ref
    assert _store_files(store) == files


def test_mismatched_shapes_across_peers_are_refused(tmp_path: Path) -> None:
    """Ingest keeps one schema per run; a run assembled by hand still gets a clear error."""
    a = _bad_run(tmp_path / "a", {"a": {"w": W}}, {})
    b = _bad_run(tmp_path / "b", {"b": {"w": np.ones((5, 3), np.float32)}}, {})
    store = gp.open_store(tmp_path / "a" / "badstore", mode="a")
    run_a = gp.open_run(a, "r").manifest
    [entry_b] = gp.open_run(b, "r").manifest.dumps
    dump_b = b.get_manifest(entry_b.dump)
    assert store.put_manifest(dump_b) == entry_b.dump
    for block in dump_b.data_children():
        store.backend.write_if_absent(block_key(block), b.backend.read(block_key(block)))
    merged = gp.RunManifest("r", (*run_a.dumps, entry_b), run_a.schema)
    store.refs.set("runs/r", store.put_manifest(merged))
    ref = store.refs.get("runs/r")
    with pytest.raises(gp.InvalidInputError, match=r"step 3, peer 'b', tensor 'w'.*\[5, 3\]"):
        gp.aggregate(store, run="r", method="mean")
    assert store.refs.get("runs/r") == ref


class _IngestFirst(gp.Runner):
    """A runner that lets an ingest commit while the aggregate graph is about to run."""

    def __init__(self, store: gp.Store, pattern: str) -> None:
        super().__init__()
        self.store, self.pattern = store, pattern

    def get(self, graph: Any, keys: Sequence[Hashable], **kw: Any) -> list[Any]:
        if kw.get("name") == "gradpipe-aggregate":
            assert gp.ingest(self.store, self.pattern, run="r").ingested == 3
        return super().get(graph, keys, **kw)


def test_a_concurrent_ingest_and_an_aggregate_keep_both(sample: SampleRun, tmp_path: Path) -> None:
    store = gp.open_store(tmp_path / "t", mode="w")
    src = Path(sample.directory) / "dumps"
    for step in (0, 1):
        for peer in SMALL.peer_names:
            target = tmp_path / f"in{step}" / f"step={step:04d}" / f"peer={peer}.safetensors"
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes((src / f"step={step:04d}" / f"peer={peer}.safetensors").read_bytes())
    assert gp.ingest(store, str(tmp_path / "in0/step={step}/peer={peer}.safetensors"), run="r").ok
    runner = _IngestFirst(store, str(tmp_path / "in1/step={step}/peer={peer}.safetensors"))
    report = gp.aggregate(store, run="r", runner=runner)
    assert report.computed == 1
    run = gp.open_run(store, "r")
    assert run.steps == [0, 1]  # the ingest's dumps survived the aggregate's commit
    assert [(a.step, a.name) for a in run.aggregates] == [(0, "fedavg")]
    # ...and an ingest's commit keeps the aggregates
    assert gp.ingest(store, sample.dump_pattern, run="r").ingested == 3
    run = gp.open_run(store, "r")
    assert run.steps == [0, 1, 2]
    assert [(a.step, a.name) for a in run.aggregates] == [(0, "fedavg")]


def test_replacing_a_dump_leaves_the_aggregate_stale(sample: SampleRun, tmp_path: Path) -> None:
    src = tmp_path / "src"
    for peer in SMALL.peer_names:
        target = src / "step=0000" / f"peer={peer}.safetensors"
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(Path(sample.dump_path(0, peer)).read_bytes())
    pattern = str(src / "step={step}/peer={peer}.safetensors")
    store = _ingest(tmp_path / "s", pattern)
    first = gp.aggregate(store, run="r")
    old = gp.open_run(store, "r").aggregate("fedavg", step=0)
    tensors, meta = read_safetensors(str(src / "step=0000/peer=peer1.safetensors"))
    tensors = {k: v * 2 for k, v in tensors.items()}
    write_safetensors(str(src / "step=0000/peer=peer1.safetensors"), tensors, meta)
    _ingest(tmp_path / "s", pattern, replace=True)
    stale = gp.open_run(store, "r").aggregate("fedavg", step=0)
    assert stale.id == old.id  # still there, content-addressed
    assert stale.stale is not None
    assert "peer1" in stale.stale
    np.testing.assert_array_equal(stale.read("dense1.bias"), old.read("dense1.bias"))
    listing = run_cli("ls", store.url, "r")  # the table takes the STALE note as a last cell
    assert listing.status == 0
    assert "STALE (" in listing.out
    again = gp.aggregate(store, run="r")  # a new memo key: the dump ids differ
    assert again.computed == 1
    assert again.aggregate_id(0) != first.aggregate_id(0)
    assert gp.open_run(store, "r").aggregate("fedavg", step=0).stale is None


def test_gc_keeps_aggregates(store: gp.Store) -> None:
    report = gp.aggregate(store, run="r", method="mean")
    run = gp.open_run(store, "r")
    before = {s: run.aggregate("mean", step=s).read_all() for s in run.steps}
    assert gp.gc(store, grace=0).ok
    assert gp.verify(store).ok
    run = gp.open_run(store, "r")
    for step, arrays in before.items():
        view = run.aggregate("mean", step=step)
        assert view.id == report.aggregate_id(step)
        for name, array in view.read_all().items():
            assert array.tobytes() == arrays[name].tobytes()


def test_export_aggregate_round_trips(store: gp.Store, tmp_path: Path) -> None:
    gp.aggregate(store, run="r", steps=range(2))
    out = tmp_path / "agg.safetensors"
    view = gp.export_aggregate(store, "r", 1, "fedavg", out)
    tensors, meta = read_safetensors(str(out))
    assert meta["aggregate"] == "fedavg"
    assert meta["aggregate_id"] == view.id
    for name, array in view.read_all().items():
        assert tensors[name].tobytes() == array.tobytes()
    with pytest.raises(gp.NotFoundError, match="no aggregate 'fedavg' of step 2"):
        gp.open_run(store, "r").aggregate("fedavg", step=2)


def test_aggregate_on_every_store(store_url: str, sample: SampleRun) -> None:
    store = _ingest(store_url, sample.dump_pattern)
    report = gp.aggregate(store, run="r", steps=[2], split_every=2)
    assert report.ok
    assert report.writes.blocks_written > 0
    view = gp.open_run(store, "r").aggregate("fedavg", step=2)
    want = _reference(store, 2, "fedavg", None, None)
    for name, ref in want.items():
        _within_one_ulp32(np.asarray(view.read(name)), ref, name)
    assert gp.aggregate(store, run="r", steps=[2]).memoised == 1
