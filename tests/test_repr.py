"""Jupyter renderings: every handle and report has a compact ``_repr_html_`` that reads no data."""

from __future__ import annotations

import shutil
from pathlib import Path

import dask.config
import pytest

import gradpipe as gp
from gradpipe.core.ids import block_key
from gradpipe.testing.training import TrainingConfig, write_sample_run

TINY = TrainingConfig(vocab_size=3000, embed_dim=16, hidden=16, peers=2, steps=2)


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> gp.Store:
    root = tmp_path_factory.mktemp("repr")
    sample = write_sample_run(root / "sample", TINY)
    store = gp.open_store(root / "store", mode="w")
    with dask.config.set({"gradpipe.chunk-bytes": "32 KiB"}):
        assert gp.ingest(store, sample.dump_pattern, run="r").ok
    assert gp.aggregate(store, run="r", method="fedavg").ok
    gp.snapshot(
        store,
        "model",
        {"w": gp.open_run(store, "r").dump(0, "peer0").read("dense1.weight")},
        step=0,
    )
    return store


def test_handles_render_without_reading_data(store: gp.Store, tmp_path: Path) -> None:
    # A copy of the store without its data blocks: manifests are all a rendering may read.
    shutil.copytree(store.url, tmp_path / "copy")
    copy = gp.open_store(tmp_path / "copy")
    run = gp.open_run(copy, "r")
    sets = [run.dump(e.step, e.peer) for e in run]
    sets += [run.aggregate(a.name, step=a.step) for a in run.aggregates]
    data = {b for t in sets for info in t.infos().values() for b in info.blocks if b is not None}
    assert data
    for block in data:
        copy.backend.delete(block_key(block))
    dump = run.dump(1, "peer1")
    agg = run.aggregate("fedavg", step=1)
    pages = {
        "store": copy._repr_html_(),
        "run": run._repr_html_(),
        "dump": dump._repr_html_(),
        "aggregate": agg._repr_html_(),
    }
    assert "runs" in pages["store"]
    assert "model" in pages["store"]  # runs and snapshots named
    assert "embedding.weight" in pages["run"]
    assert "float32" in pages["run"]
    assert "num_examples" in pages["dump"]
    assert "KiB" in pages["dump"]
    assert "fedavg" in pages["aggregate"]
    assert "peer0" in pages["aggregate"]
    for page in pages.values():
        assert page.startswith('<div class="gp-repr">')
        assert "<script" not in page
    # The plain reprs fit on a line and say what the object is.
    assert repr(run) == "<gradpipe.Run 'r': 4 dumps, steps 0..1, 2 peers, 7 tensors>"
    assert repr(dump).startswith("<gradpipe.Dump step 1, peer 'peer1': ")
    assert repr(agg).startswith("<gradpipe.Aggregate aggregate 'fedavg' of step 1: ")


def test_names_from_files_are_escaped(tmp_path: Path) -> None:
    from gradpipe.core.html import key_values, table

    page = key_values(
        "<b>run</b>", {"peer": "<img src=x onerror=alert(1)>"}, table(["t"], [["<i>"]])
    )
    assert "<img" not in page
    assert "&lt;img" in page
    assert "<i>" not in page


def test_reports_render(store: gp.Store) -> None:
    reports = [gp.verify(store), gp.gc(store, dry_run=True), gp.rounds(store, run="r")]
    reports.append(gp.aggregate(store, run="r", method="fedavg"))
    for report in reports:
        page = report._repr_html_()
        assert type(report).__name__ in page
        assert ("gp-ok" if report.ok else "gp-bad") in page
        assert report.summary().splitlines()[0].replace("'", "&#x27;") in page


def test_long_tables_are_cut(tmp_path: Path) -> None:
    from gradpipe.core.html import table

    page = table(["n"], [[i] for i in range(100)], limit=5)
    assert page.count("<tr>") == 1 + 5 + 1  # header, five rows, "… 95 more"
    assert "95 more" in page
