"""``gradpipe ls STORE`` summarises each run as steps x peers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import gradpipe as gp
from gradpipe.cli import main
from gradpipe.testing import TrainingConfig, write_sample_run


def test_ls_store_summarises_runs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    sample = write_sample_run(tmp_path / "d", TrainingConfig(steps=3, peers=2))
    store = gp.open_store(tmp_path / "store", mode="w")
    assert gp.ingest(store, sample.dump_pattern, run="r1").ok
    store.refs.set("tags/best", store.refs.get("runs/r1"))
    capsys.readouterr()
    assert main(["ls", str(tmp_path / "store"), "--json"]) == 0
    rows = {r["ref"]: r for r in json.loads(capsys.readouterr().out)["refs"]}
    assert (rows["runs/r1"]["steps"], rows["runs/r1"]["peers"], rows["runs/r1"]["dumps"]) == (
        3,
        2,
        6,
    )
    assert "steps" not in rows["tags/best"]  # only run refs are described
    assert main(["ls", str(tmp_path / "store")]) == 0
    assert "3 steps x 2 peers" in capsys.readouterr().out
