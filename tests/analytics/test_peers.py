"""Peer agreement and the gradient noise scale against float64 references on generated dumps."""

from __future__ import annotations

import math
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

import gradpipe as gp
from gradpipe.aggregation.robust import krum_scores
from gradpipe.core.ids import block_key
from gradpipe.formats.safetensors import write_safetensors
from gradpipe.runs import open_run
from gradpipe.testing.faults import faulty_store

PEERS = ("p0", "p1", "p2", "p3", "p4")
BATCH = {"p0": 4, "p1": 8, "p2": 8, "p3": 16, "p4": 3}
CHUNK_BYTES = 16384


def _tensors(step: int, peer: str) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(1000 * step + int(peer[1:]))
    shared = np.random.default_rng(step)  # a common direction: the peers roughly agree
    return {
        "layer.0.w": (shared.standard_normal((96, 64)) + rng.standard_normal((96, 64))).astype(
            np.float32
        ),
        "layer.0.b": np.where(rng.random(200) < 0.3, 0.0, rng.standard_normal(200)).astype(
            np.float16
        ),
        "layer.1.w": (
            shared.standard_normal(3000) * 1e-2 + rng.standard_normal(3000) * 1e-2
        ).astype(ml_dtypes.bfloat16),
        "head.w": rng.standard_normal(40).astype(np.float64),
    }


def _pattern(root: Path) -> str:
    return str(root / "step={step}" / "peer={peer}.safetensors")


def _write(root: Path, step: int, peer: str, tensors: dict[str, np.ndarray], meta: dict) -> None:
    path = root / f"step={step}" / f"peer={peer}.safetensors"
    path.parent.mkdir(exist_ok=True, parents=True)
    with path.open("wb") as f:
        write_safetensors(f, tensors, meta)


@pytest.fixture(scope="module")
def dumps(tmp_path_factory: pytest.TempPathFactory) -> str:
    root = tmp_path_factory.mktemp("peers")
    for step in range(3):
        for peer in PEERS:
            _write(root, step, peer, _tensors(step, peer), {"num_examples": str(BATCH[peer])})
    return str(root / "step={step}" / "peer={peer}.safetensors")


@pytest.fixture
def filled(store: gp.Store, dumps: str) -> gp.Store:
    assert gp.ingest(store, dumps, run="r", chunk_bytes=CHUNK_BYTES).ok
    return store


def _flat(step: int, names: list[str] | None = None) -> np.ndarray:
    """Each peer's gradient, the chosen tensors concatenated, as float64 rows."""
    rows = []
    for peer in PEERS:
        tensors = _tensors(step, peer)
        chosen = names or list(tensors)
        rows.append(np.concatenate([tensors[n].astype(np.float64).ravel() for n in chosen]))
    return np.stack(rows)


def _fsum_dot(a: np.ndarray, b: np.ndarray) -> float:
    return math.fsum((a * b).tolist())


def test_agreement_equals_a_float64_reference(filled: gp.Store) -> None:
    ds = gp.peer_agreement(filled, "r")
    w = np.array([BATCH[p] for p in PEERS], dtype=np.float64)
    for step in range(3):
        x = _flat(step)
        cell = ds.sel(step=step)
        gram = np.array([[_fsum_dot(a, b) for b in x] for a in x])
        norms = np.sqrt(np.diagonal(gram))
        np.testing.assert_allclose(cell.cosine.values, gram / np.outer(norms, norms), rtol=1e-12)
        mean = (w[:, None] * x).sum(axis=0) / w.sum()
        dist = np.array([math.sqrt(_fsum_dot(r - mean, r - mean)) for r in x])
        np.testing.assert_allclose(cell.distance.values, dist, rtol=1e-12)
        assert cell.mean_norm.item() == pytest.approx(math.sqrt(_fsum_dot(mean, mean)), 1e-12)
        both = np.array([[np.count_nonzero((a != 0) & (b != 0)) for b in x] for a in x])
        differ = np.array(
            [[np.count_nonzero((a != 0) & (b != 0) & ((a < 0) != (b < 0))) for b in x] for a in x]
        )
        np.testing.assert_array_equal(cell.sign_agreement.values, 1 - differ / both)
        share = w / w.sum()
        assert cell.norm_ratio.item() == pytest.approx(
            math.sqrt(_fsum_dot(mean, mean)) / float(share @ norms), 1e-12
        )
        for p in range(len(PEERS)):
            others = np.delete(np.arange(len(PEERS)), p)
            rest = (w[others, None] * x[others]).sum(axis=0) / w[others].sum()
            loo = _fsum_dot(x[p], rest) / math.sqrt(_fsum_dot(x[p], x[p]) * _fsum_dot(rest, rest))
            assert cell.loo_cosine.values[p] == pytest.approx(loo, abs=1e-9)
        sq = np.array([[_fsum_dot(a - b, a - b) for b in x] for a in x])
        np.testing.assert_allclose(cell.krum_score.values, krum_scores(sq, 0), rtol=1e-9)
    np.testing.assert_array_equal(ds.weight.values[0], w)


def test_layers_and_tensors(filled: gp.Store) -> None:
    by_layer = gp.peer_agreement(filled, "r", by="layer")
    assert list(by_layer.layer.values) == ["head", "layer.0", "layer.1"]
    x = _flat(1, ["layer.0.b", "layer.0.w"])
    gram = np.array([[_fsum_dot(a, b) for b in x] for a in x])
    norms = np.sqrt(np.diagonal(gram))
    np.testing.assert_allclose(
        by_layer.cosine.sel(step=1, layer="layer.0").values, gram / np.outer(norms, norms), 1e-12
    )
    by_tensor = gp.peer_agreement(filled, "r", by="tensor")
    assert by_tensor.sizes["tensor"] == 4
    assert by_tensor.attrs["memoised_steps"] == 3  # one stored pass serves every level


def test_the_noise_scale_follows_the_estimators(filled: gp.Store) -> None:
    gns = gp.noise_scale(filled, "r")
    b = np.array([BATCH[p] for p in PEERS], dtype=np.float64)
    total = b.sum()
    for step in range(3):
        x = _flat(step)
        mean = (b[:, None] * x).sum(axis=0) / total
        squares = [bp * _fsum_dot(r - mean, r - mean) for bp, r in zip(b, x, strict=True)]
        trace = math.fsum(squares) / (len(b) - 1)
        true_sq = _fsum_dot(mean, mean) - trace / total
        cell = gns.sel(step=step)
        assert cell.trace_sigma.item() == pytest.approx(trace, rel=1e-12)
        assert cell.true_grad_sq.item() == pytest.approx(true_sq, rel=1e-9)
        assert cell.b_simple.item() == pytest.approx(trace / true_sq, rel=1e-9)
    assert gns.batch.values.tolist() == [total] * 3
    assert gns.b_simple_ema.values[0] == pytest.approx(gns.b_simple.values[0])  # bias-corrected
    assert gp.peer_agreement(filled, "r").attrs["memoised_steps"] == 3  # one shared pass
    by_layer = gp.noise_scale(filled, "r", by="layer")
    assert by_layer.b_simple.dims == ("step", "layer")
    with pytest.raises(gp.InvalidInputError, match="records num_examples; batch_size= is for"):
        gp.noise_scale(filled, "r", batch_size=4)


def test_memoised_passes_read_no_chunk(filled: gp.Store) -> None:
    first = gp.peer_agreement(filled, "r")
    assert first.attrs["chunks_read"] > 0
    counted, backend = faulty_store(filled)
    again = gp.noise_scale(counted, "r")
    dumps = {block_key(e.dump) for e in open_run(filled, "r")}
    assert not {key for op, key in backend.calls if op == "read"} & dumps
    assert again.attrs["chunks_read"] == 0
    assert list(again.analysis_id.values) == list(first.analysis_id.values)


def test_processes_give_the_same_ids(filled: gp.Store, tmp_path: Path, dumps: str) -> None:
    threads = gp.peer_agreement(filled, "r", steps=[0])
    other = gp.open_store(str(tmp_path / "other"), mode="w")
    assert gp.ingest(other, dumps, run="r", chunk_bytes=CHUNK_BYTES).ok
    with gp.runner(processes=True, workers=2) as runner:
        procs = gp.peer_agreement(other, "r", steps=[0], runner=runner)
    assert procs.analysis_id.values.tolist() == threads.analysis_id.values.tolist()


def test_a_non_finite_peer_is_left_out_of_its_tensors(
    local_store: gp.Store, tmp_path: Path
) -> None:
    for peer in PEERS:
        tensors = _tensors(0, peer)
        if peer == "p2":
            tensors["head.w"][3] = np.nan
        _write(tmp_path, 0, peer, tensors, {})
    assert gp.ingest(
        local_store, str(tmp_path / "step={step}" / "peer={peer}.safetensors"), run="r"
    ).ok
    by_layer = gp.peer_agreement(local_store, "r", by="layer").sel(step=0)
    assert np.isnan(by_layer.cosine.sel(layer="head", peer="p2")).all()
    assert not np.isnan(by_layer.cosine.sel(layer="head", peer="p1", peer_b="p3"))
    assert not np.isnan(by_layer.cosine.sel(layer="layer.0")).any()
    assert np.isnan(by_layer.mean_norm.sel(layer="head"))
    assert not by_layer.weight.isnull().any()  # no num_examples: every peer weighs 1


def test_identical_peers_read_nothing_and_measure_no_noise(store: gp.Store, tmp_path: Path) -> None:
    for step in range(2):
        for peer in PEERS:  # the all-reduced gradient, on every peer
            _write(tmp_path, step, peer, _tensors(step, "p0"), {"num_examples": "8"})
    pattern = str(tmp_path / "step={step}" / "peer={peer}.safetensors")
    assert gp.ingest(store, pattern, run="r", chunk_bytes=CHUNK_BYTES).ok
    counted, _backend = faulty_store(store)
    ds = gp.peer_agreement(counted, "r")
    assert ds.peers_identical.values.all()
    assert ds.attrs["chunks_read"] == 0
    np.testing.assert_allclose(ds.cosine.values, 1.0)
    np.testing.assert_array_equal(ds.distance.values, 0.0)
    gns = gp.noise_scale(store, "r")
    assert gns.b_simple.isnull().all()


def _corrupted_run(root: Path, steps: int, bad: dict[str, float]) -> str:
    rng = np.random.default_rng(7)
    for step in range(steps):
        truth = rng.standard_normal(4096)
        for p in range(8):
            g = truth + 0.5 * rng.standard_normal(4096)
            g *= bad.get(f"p{p}", 1.0)
            _write(root, step, f"p{p}", {"w": g.astype(np.float32)}, {"num_examples": "32"})
    return str(root / "step={step}" / "peer={peer}.safetensors")


def test_corrupted_peers_are_flagged_at_every_step(local_store: gp.Store, tmp_path: Path) -> None:
    pattern = _corrupted_run(tmp_path / "bad", 6, {"p3": 10.0, "p6": -1.0})
    assert gp.ingest(local_store, pattern, run="bad").ok
    flagged = gp.peer_agreement(local_store, "bad").outlier
    assert flagged.sel(peer="p3").all()
    assert flagged.sel(peer="p6").all()
    assert not flagged.drop_sel(peer=["p3", "p6"]).any()


def test_a_clean_run_flags_nobody(local_store: gp.Store, tmp_path: Path) -> None:
    pattern = _corrupted_run(tmp_path / "clean", 40, {})
    assert gp.ingest(local_store, pattern, run="clean").ok
    assert not gp.peer_agreement(local_store, "clean").outlier.any()


def test_one_peer_is_not_enough(local_store: gp.Store, tmp_path: Path) -> None:
    _write(tmp_path, 0, "a", {"w": np.ones(4, np.float32)}, {})
    assert gp.ingest(
        local_store, str(tmp_path / "step={step}" / "peer={peer}.safetensors"), run="r"
    ).ok
    with pytest.raises(gp.NotFoundError, match="step 0: one peer: agreement and the noise"):
        gp.peer_agreement(local_store, "r")


def test_integer_and_single_holder_tensors_have_no_figures(
    local_store: gp.Store, tmp_path: Path
) -> None:
    for peer in PEERS:
        tensors = _tensors(0, peer) | {"tokens_seen": np.array([5], np.int64)}
        if peer == "p1":
            tensors["p1.only"] = np.ones(8, np.float32)
        _write(tmp_path, 0, peer, tensors, {"num_examples": str(BATCH[peer])})
    assert gp.ingest(
        local_store, str(tmp_path / "step={step}" / "peer={peer}.safetensors"), run="r"
    ).ok
    total = gp.peer_agreement(local_store, "r").sel(step=0)
    assert not np.isnan(total.cosine.values).any()  # the total is the float tensors'
    assert np.isfinite(gp.noise_scale(local_store, "r").b_simple.values).all()
    by_tensor = gp.peer_agreement(local_store, "r", by="tensor").sel(step=0)
    assert np.isnan(by_tensor.cosine.sel(tensor="tokens_seen")).all()


def test_an_all_zero_layer_and_a_masked_peer(local_store: gp.Store, tmp_path: Path) -> None:
    for peer in PEERS:
        tensors = _tensors(0, peer) | {"frozen.w": np.zeros(64, np.float32)}
        if peer == "p2":
            tensors["head.w"][3] = np.nan
        _write(tmp_path, 0, peer, tensors, {"num_examples": str(BATCH[peer])})
    assert gp.ingest(
        local_store, str(tmp_path / "step={step}" / "peer={peer}.safetensors"), run="r"
    ).ok
    layers = gp.peer_agreement(local_store, "r", by="layer").sel(step=0)
    assert np.isnan(layers.norm_ratio.sel(layer="frozen"))  # nothing to divide: NaN
    head = layers.sel(layer="head")
    assert np.isnan(head.loo_cosine.sel(peer="p2"))
    assert not np.isnan(head.loo_cosine.sel(peer="p1"))  # the others keep their figures
    assert not np.isnan(head.krum_score.sel(peer="p1"))
    report = gp.analyze(local_store, "r", by="layer", what=["agreement", "gns"])
    assert report.ok, report.summary()
    assert list(report.records()) == []  # per-peer records are of the whole gradient


def test_the_noise_scale_needs_each_batch_size(local_store: gp.Store, tmp_path: Path) -> None:
    for peer in PEERS:
        meta = {} if peer == "p3" else {"num_examples": str(BATCH[peer])}
        _write(tmp_path, 0, peer, _tensors(0, peer), meta)
    assert gp.ingest(
        local_store, str(tmp_path / "step={step}" / "peer={peer}.safetensors"), run="r"
    ).ok
    with pytest.raises(gp.InvalidInputError, match="step 0, peer 'p3': the dump records no"):
        gp.noise_scale(local_store, "r")


def test_krum_scores_need_two_f_plus_three_peers(filled: gp.Store) -> None:
    assert not np.isnan(gp.peer_agreement(filled, "r", byzantine=1).krum_score).any()  # 5 >= 5
    assert np.isnan(gp.peer_agreement(filled, "r", byzantine=2).krum_score).all()  # 5 < 7
