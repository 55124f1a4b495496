"""``--codec`` with a lossy codec name: the run is marked lossy in ``ls``, ``verify`` is clean."""

from __future__ import annotations

from pathlib import Path

import pytest

import gradpipe as gp
from gradpipe.cli.testing import run_cli, run_cli_json
from gradpipe.runs import open_run
from gradpipe.testing.training import SampleRun


def test_ingest_lossily_then_ls_and_verify(sample: SampleRun, tmp_path: Path) -> None:
    url = str(tmp_path / "store")
    status, doc = run_cli_json(
        "ingest", url, sample.dump_pattern, "--run", "z", "--codec", "topk-0.1+zstd"
    )
    assert status == 0
    assert doc["ingested"] == 9
    status, doc = run_cli_json("ls", url, "z")
    assert status == 0
    assert [d["lossy"] for d in doc["dumps"]] == [True] * 9
    listing = run_cli("ls", url, "z")
    assert "~: stored lossily (9 dump(s))" in listing.out
    grid = listing.out.splitlines()[2:5]
    assert [row.split()[1:] for row in grid] == [["~"] * 3] * 3
    info = open_run(gp.open_store(url), "z").dump(0, "peer0").info("dense1.weight")
    assert info.lossy is not None
    assert info.lossy.name == "topk-0.1"
    assert run_cli_json("verify", url)[0] == 0


def test_exact_runs_are_not_marked(sample: SampleRun, ingested: str) -> None:
    status, doc = run_cli_json("ls", ingested, "train")
    assert status == 0
    assert not any(d["lossy"] for d in doc["dumps"])
    assert "stored lossily" not in run_cli("ls", ingested, "train").out


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("topk", "topk-F"),
        ("zstd+bf16", "must come first"),
        ("default+zstd", "cannot be chained"),
        ("qsgd-0", "levels"),
    ],
)
def test_bad_lossy_specs_exit_2(spec: str, message: str, sample: SampleRun, tmp_path: Path) -> None:
    url = str(tmp_path / "store")
    status, doc = run_cli_json("ingest", url, sample.dump_pattern, "--run", "z", "--codec", spec)
    assert status == 2
    assert message in doc["error"]
    assert not (tmp_path / "store" / "refs" / "runs").exists()
