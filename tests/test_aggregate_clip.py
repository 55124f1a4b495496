"""``clip_aggregate``: the result of a step clipped to an L2 norm (the seed's coordinator)."""

from __future__ import annotations

import json
from pathlib import Path

import dask.config
import numpy as np
import pytest

import gradpipe as gp
from gradpipe.cli import main
from gradpipe.testing.training import SampleRun, TrainingConfig, write_sample_run

SMALL = TrainingConfig(vocab_size=3000, embed_dim=16, hidden=16, peers=4, steps=2)


@pytest.fixture(scope="module")
def sample(tmp_path_factory: pytest.TempPathFactory) -> SampleRun:
    return write_sample_run(tmp_path_factory.mktemp("sample"), SMALL)


@pytest.fixture
def store(sample: SampleRun, tmp_path: Path) -> gp.Store:
    store = gp.open_store(tmp_path / "store", mode="a")
    with dask.config.set({"gradpipe.chunk-bytes": "48 KiB"}):  # several chunks per tensor
        assert gp.ingest(store, sample.dump_pattern, run="r").ok
    return store


def _norm(arrays: dict[str, np.ndarray]) -> float:
    return float(np.sqrt(sum(np.sum(a.astype(np.float64) ** 2) for a in arrays.values())))


@pytest.mark.parametrize("method", ["fedavg", "mean", "median", "krum"])
def test_the_result_is_the_unclipped_one_scaled_once(store: gp.Store, method: str) -> None:
    assert gp.aggregate(store, run="r", method=method, name="plain").ok
    run = gp.open_run(store, "r")
    plain = run.aggregate("plain", step=1).read_all()
    norm = _norm(plain)
    clip = norm / 3  # bites
    report = gp.aggregate(store, run="r", method=method, name="clipped", clip_aggregate=clip)
    assert report.ok, report.summary()
    view = gp.open_run(store, "r").aggregate("clipped", step=1)
    assert view.params["clip_aggregate"] == clip
    # The recorded norm is summed exactly; numpy's float64 sums may differ in the last bits.
    assert view.params["aggregate_norm"] == pytest.approx(norm, rel=1e-12)
    factor = view.params["aggregate_clip_scale"]
    assert factor == clip / view.params["aggregate_norm"]
    got = view.read_all()
    for name, array in plain.items():  # float64 product, one rounding: exactly these bits
        want = (array.astype(np.float64) * factor).astype(array.dtype)
        assert got[name].tobytes() == want.tobytes(), name
    # The seed's test: the clipped aggregate's norm is the clip norm.
    assert _norm(got) == pytest.approx(clip, rel=1e-5)


def test_a_clip_above_the_norm_keeps_every_block(store: gp.Store) -> None:
    assert gp.aggregate(store, run="r", name="plain").ok
    assert gp.aggregate(store, run="r", name="loose", clip_aggregate=1e9).ok
    run = gp.open_run(store, "r")
    for step in run.steps:
        plain, loose = run.aggregate("plain", step=step), run.aggregate("loose", step=step)
        assert loose.params["aggregate_clip_scale"] == 1.0
        for name in plain.names:
            assert loose.info(name).blocks == plain.info(name).blocks


def test_the_clipped_id_does_not_depend_on_tree_or_scheduler(store: gp.Store) -> None:
    ids = set()
    for split_every in (2, 8):
        report = gp.aggregate(
            store, run="r", steps=[0], clip_aggregate=1e-3, split_every=split_every, force=True
        )
        ids.add(report.aggregate_id(0))
    with gp.runner(workers=2) as cluster:
        report = gp.aggregate(
            store, run="r", steps=[0], clip_aggregate=1e-3, force=True, runner=cluster
        )
    ids.add(report.aggregate_id(0))
    assert len(ids) == 1
    assert None not in ids


def test_memoised_under_its_own_key(store: gp.Store) -> None:
    first = gp.aggregate(store, run="r", clip_aggregate=1e-3)
    assert first.computed == SMALL.steps
    again = gp.aggregate(store, run="r", clip_aggregate=1e-3)
    assert again.memoised == SMALL.steps
    other = gp.aggregate(store, run="r", clip_aggregate=2e-3)  # same name, other parameters
    assert other.computed == 0
    assert all("another method or parameters" in s.reason for s in other.steps)


@pytest.mark.parametrize("bad", [0.0, -1.0, float("nan"), float("inf")])
def test_a_bad_clip_is_refused_before_anything_runs(store: gp.Store, bad: float) -> None:
    before = store.refs.get("runs/r")
    with pytest.raises(gp.InvalidInputError, match="clip_aggregate"):
        gp.aggregate(store, run="r", clip_aggregate=bad)
    assert store.refs.get("runs/r") == before


def test_cli_clip_aggregate(store: gp.Store, capsys: pytest.CaptureFixture[str]) -> None:
    url = store.url
    code = main(["aggregate", url, "--run", "r", "--method", "fedavg", "--clip-aggregate", "0.001"])
    assert code == 0
    capsys.readouterr()
    view = gp.open_run(gp.open_store(url), "r").aggregate("fedavg", step=0)
    assert view.params["clip_aggregate"] == 0.001
    assert _norm(view.read_all()) == pytest.approx(0.001, rel=1e-5)
    assert (
        main(["aggregate", url, "--run", "r", "--method", "fedavg", "--clip-aggregate", "0"]) == 2
    )
    assert "clip_aggregate" in capsys.readouterr().err
    json.dumps(view.params)  # recorded params stay plain JSON
