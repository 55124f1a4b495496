"""``gradpipe demo``: the README's first command."""

from __future__ import annotations

from pathlib import Path

import pytest

import gradpipe as gp
from gradpipe.cli.testing import run_cli, run_cli_json
from gradpipe.demo import DEMO_CONFIG, run_demo
from gradpipe.testing.training import TrainingConfig

SMALL = TrainingConfig(vocab_size=300, embed_dim=4, hidden=8, peers=2, steps=2)


def test_demo(tmp_path: Path) -> None:
    """The README's first command, for real: ~100 MiB of dumps generated and ingested."""
    store = str(tmp_path / "demo")
    n = DEMO_CONFIG.steps * DEMO_CONFIG.peers
    status, doc = run_cli_json("demo", store)
    assert status == 0
    assert (doc["ok"], doc["ingested"], doc["failed"]) == (True, n, 0)
    assert doc["stored_bytes"] < doc["raw_bytes"]
    status, listing = run_cli_json("ls", store, "demo")
    assert status == 0
    assert listing["steps"] == list(range(DEMO_CONFIG.steps))
    assert listing["peers"] == DEMO_CONFIG.peer_names
    # Run again: the dumps are there and recorded, nothing to do.
    status, doc = run_cli_json("demo", store)
    assert status == 0
    assert (doc["ingested"], doc["skipped"], doc["blocks_written"]) == (0, n, 0)
    assert gp.verify(gp.open_store(store)).ok


@pytest.mark.parametrize("url", ["gs://bucket/x", "ftp://host/x", "s3://bucket/x"])
def test_demo_checks_the_store_url_before_any_work(
    url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`gradpipe demo gs://bucket/x` used to write 219 MB into ./gs:/bucket/x-dumps first."""
    monkeypatch.chdir(tmp_path)
    outcome = run_cli("demo", url)
    assert outcome.status == 2
    message = outcome.error_message("demo")
    if url.startswith("s3"):
        assert "--dumps DIR" in message  # a URL is never turned into a local path
    else:
        assert "unsupported store URL scheme" in message
    assert list(tmp_path.iterdir()) == []


def test_demo_refuses_a_foreign_directory_before_writing_dumps(tmp_path: Path) -> None:
    foreign = tmp_path / "mine"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    outcome = run_cli("demo", str(foreign))
    assert outcome.status == 2
    assert "not a gradpipe store" in outcome.error_message("demo")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine"]


@pytest.mark.s3
def test_demo_into_s3_with_local_dumps(s3: object, tmp_path: Path) -> None:
    url = "s3://gradpipe-test/demo"
    report = run_demo(url, config=SMALL, dumps_dir=tmp_path / "dumps", dashboard=False, workers=2)
    assert report.ok
    assert report.ingested == SMALL.steps * SMALL.peers
    assert (tmp_path / "dumps" / "dumps").is_dir()
    run = gp.open_run(gp.open_store(url), "demo")
    assert run.steps == list(range(SMALL.steps))
