"""``gradpipe stats``: table, JSON and CSV carry the statistics by name; the plot is a PNG."""

from __future__ import annotations

import csv
import io
import json
import struct
from pathlib import Path

import numpy as np
import pytest

import gradpipe as gp
from gradpipe.cli.testing import run_cli, run_cli_json
from gradpipe.core.ids import block_key
from gradpipe.runs import open_run
from gradpipe.statistics.api import stats_records
from gradpipe.statistics.tensor_stats import RECORD_FIELDS

TENSORS = 7
DUMPS = 9  # the sample run: 3 steps x 3 peers


def _records(url: str) -> list[dict[str, object]]:
    return list(stats_records(gp.compression_stats(gp.open_store(url, mode="r"), run="train")))


def test_json_holds_one_record_per_step_peer_and_tensor(ingested: str) -> None:
    outcome = run_cli("stats", ingested, "--run", "train", "--format", "json")
    assert outcome.status == 0
    doc = json.loads(outcome.out)
    assert doc["ok"] is True
    assert (doc["kind"], doc["run"], doc["store"]) == ("run", "train", ingested)
    records = doc["records"]
    assert len(records) == DUMPS * TENSORS
    for record in records:
        assert list(record) == ["step", "peer", "tensor", *RECORD_FIELDS]
    assert records == _records(ingested)  # every value, as the Python API gives it
    assert doc["totals"]["stored_bytes"] == sum(r["stored_bytes"] for r in records)
    assert doc["totals"]["raw_bytes"] == sum(r["raw_bytes"] for r in records)
    assert "first" in doc["attribution"]
    # --json prints the very same object (the CLI contract: one JSON object).
    status, again = run_cli_json("stats", ingested, "--run", "train")
    assert status == 0
    assert again == doc


def test_csv_rows_are_the_records(ingested: str) -> None:
    outcome = run_cli("stats", ingested, "--run", "train", "--format", "csv")
    assert outcome.status == 0
    rows = list(csv.DictReader(io.StringIO(outcome.out)))
    assert len(rows) == DUMPS * TENSORS
    assert list(rows[0]) == ["step", "peer", "tensor", *RECORD_FIELDS]
    for row, record in zip(rows, _records(ingested), strict=True):
        assert row["tensor"] == record["tensor"]
        assert int(row["stored_bytes"]) == record["stored_bytes"]
        assert float(row["ratio"]) == record["ratio"]
        assert float(row["l2_norm"]) == record["l2_norm"]


@pytest.mark.parametrize(("by", "groups"), [("step", 3), ("peer", 3), ("tensor", TENSORS)])
def test_by_groups_and_recomputes_ratios(ingested: str, by: str, groups: int) -> None:
    outcome = run_cli("stats", ingested, "--run", "train", "--by", by, "--format", "csv")
    rows = list(csv.DictReader(io.StringIO(outcome.out)))
    assert [r[by] for r in rows] == sorted({str(r[by]) for r in _records(ingested)})
    assert len(rows) == groups
    assert "peer" not in rows[0] or by == "peer"
    records = _records(ingested)
    for row in rows:
        mine = [r for r in records if str(r[by]) == row[by]]
        raw = sum(int(r["raw_bytes"]) for r in mine)  # type: ignore[call-overload]
        stored = sum(int(r["stored_bytes"]) for r in mine)  # type: ignore[call-overload]
        assert (int(row["raw_bytes"]), int(row["stored_bytes"])) == (raw, stored)
        assert float(row["ratio"]) == raw / stored
    status, doc = run_cli_json("stats", ingested, "--run", "train", "--by", by)
    assert status == 0
    assert doc["by"] == by
    assert len(doc["summary"]) == groups


def test_table(ingested: str) -> None:
    outcome = run_cli("stats", ingested, "--run", "train")
    assert outcome.status == 0
    lines = outcome.out.splitlines()
    assert lines[0] == f"run 'train': {DUMPS} dumps, {TENSORS} tensors"
    assert lines[1].split()[:4] == ["tensor", "raw", "MiB", "stored"]
    names = [line.split()[0] for line in lines[2 : 2 + TENSORS]]
    assert names == sorted(names)
    assert "embedding.weight" in names
    total = next(line for line in lines if line.startswith("total"))
    totals = gp.summarize_stats(gp.compression_stats(gp.open_store(ingested), run="train"))
    assert f"{float(totals.ratio):.2f}" in total.split()
    by_peer = run_cli("stats", ingested, "--run", "train", "--by", "peer").out.splitlines()
    assert [line.split()[0] for line in by_peer[2:5]] == ["peer0", "peer1", "peer2"]


def _png_size(data: bytes) -> tuple[int, int]:
    """Width and height of a PNG, after checking its signature and first chunk."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    length, kind = struct.unpack(">I4s", data[8:16])
    assert (length, kind) == (13, b"IHDR")
    width, height = struct.unpack(">II", data[16:24])
    assert data.endswith(b"IEND\xaeB`\x82")
    return width, height


def test_plot_writes_a_png(ingested: str, tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    out = tmp_path / "stats.png"
    outcome = run_cli("stats", ingested, "--run", "train", "--plot", str(out))
    assert outcome.status == 0
    assert outcome.out.splitlines()[-1] == f"plot written to {out}"
    width, height = _png_size(out.read_bytes())
    assert width > 800
    assert height > 600
    status, doc = run_cli_json("stats", ingested, "--run", "train", "--plot", str(out))
    assert (status, doc["plot"]) == (0, str(out))


def test_plot_of_an_aggregate_and_a_snapshot(ingested: str, tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    from gradpipe.statistics.plot import plot_stats

    store = gp.open_store(ingested, mode="r+")
    assert gp.aggregate(store, run="train", method="fedavg").ok
    for step in range(3):
        state = {f"b{i:02d}": np.full(4, i + step, np.float32) for i in range(19)}
        gp.snapshot(store, "model", {"w": np.full((64, 64), step, np.float32), **state}, step=step)
    for args in (["--run", "train", "--aggregate", "fedavg"], ["--snapshot", "model"]):
        out = tmp_path / "plot.png"
        outcome = run_cli("stats", ingested, *args, "--plot", str(out), "--by", "step")
        assert outcome.status == 0, outcome.err
        _png_size(out.read_bytes())
        out.unlink()
    fig = plot_stats(gp.compression_stats(store, snapshot="model"))
    assert len(fig.axes) == 4
    assert fig.axes[2].get_xlabel() == "step"
    # 20 tensors: the 15 largest by name, the others as one bar.
    labels = [t.get_text() for t in fig.axes[0].get_yticklabels()]
    assert (len(labels), labels[0], labels[-1]) == (16, "w", "5 others")


def test_aggregate_and_snapshot_rows(ingested: str) -> None:
    store = gp.open_store(ingested, mode="r+")
    assert gp.aggregate(store, run="train", method="fedavg").ok
    gp.snapshot(store, "model", {"w": np.ones(8, np.float32)}, step=5)
    status, doc = run_cli_json("stats", ingested, "--run", "train", "--aggregate", "fedavg")
    assert status == 0
    assert (doc["kind"], doc["aggregate"]) == ("aggregate", "fedavg")
    assert len(doc["records"]) == 3 * TENSORS
    assert list(doc["records"][0])[:2] == ["step", "tensor"]
    status, doc = run_cli_json("stats", ingested, "--snapshot", "model", "--by", "step")
    assert status == 0
    assert doc["records"][0]["step"] == 5
    assert doc["records"][0]["version"] == 0
    assert len(doc["summary"]) == 1
    heads = [
        run_cli("stats", ingested, *args).out.splitlines()[0]
        for args in (["--run", "train", "--aggregate", "fedavg"], ["--snapshot", "model"])
    ]
    assert heads[0].startswith("aggregate 'fedavg' of run 'train': 3 steps")
    assert heads[1].startswith("snapshot 'model': 1 versions")


@pytest.mark.parametrize(
    ("argv", "word"),
    [
        (["--aggregate", "fedavg", "--snapshot", "model"], "--aggregate needs"),
        (["--run", "train", "--snapshot", "model"], "not allowed with argument"),
        (["--run", "train", "--by", "layer"], "invalid choice"),
        (["--run", "train", "--format", "xml"], "invalid choice"),
        (["--by", "step"], "one of the arguments --run --snapshot is required"),
    ],
)
def test_usage_errors(ingested: str, argv: list[str], word: str) -> None:
    status, doc = run_cli_json("stats", ingested, *argv)
    assert status == 2
    assert word in doc["error"]


def test_errors_name_what_is_wrong(ingested: str, tmp_path: Path) -> None:
    status, doc = run_cli_json("stats", ingested, "--run", "nope")
    assert status == 1
    assert "no run 'nope'" in doc["error"]
    status, doc = run_cli_json("stats", str(tmp_path / "nowhere"), "--run", "train")
    assert status == 2
    status, doc = run_cli_json(
        "stats", ingested, "--run", "train", "--plot", str(Path(ingested) / "x.png")
    )
    assert status == 2
    assert "inside the gradpipe store" in doc["error"]
    store = gp.open_store(ingested, mode="r+")
    gp.snapshot(store, "model", {"w": np.ones(8, np.float32)}, step=1)
    status, doc = run_cli_json("stats", ingested, "--snapshot", "model", "--by", "peer")
    assert status == 2
    assert "snapshot statistics have no peers" in doc["error"]


def test_a_missing_block_fails_the_command(ingested: str) -> None:
    store = gp.open_store(ingested, mode="r")
    info = open_run(store, "train").dump(0, "peer0").info("embedding.weight")
    victim = next(iter(info.data_children()))
    (Path(ingested) / block_key(victim)).unlink()
    outcome = run_cli("stats", ingested, "--run", "train")
    assert outcome.status == 1
    assert outcome.out.splitlines()[-1].startswith("PROBLEM: 1 block(s)")
    status, doc = run_cli_json("stats", ingested, "--run", "train")
    assert status == 1
    assert doc["ok"] is False
    assert doc["missing_blocks"] == 1
    assert "gradpipe verify" in doc["problem"]
