"""Every operation's report has one shape: ``ok``, ``to_dict()`` and ``summary()``."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

import gradpipe as gp
from gradpipe.core.ids import block_key

# The damaged report deletes a data block: every chunk is a block of its own.
pytestmark = pytest.mark.usefixtures("no_inline")


def _reports(tmp_path: Path) -> dict[str, list[gp.Report]]:
    """Reports of each operation, one that succeeded and (where it can) one that did not."""
    dumps = tmp_path / "dumps"
    dumps.mkdir()
    np.savez(dumps / "step=1.npz", w=np.arange(4, dtype=np.float32))
    store = gp.open_store(tmp_path / "store", mode="w")
    good = gp.ingest(store, str(dumps / "step={step}.npz"), run="r")
    (dumps / "step=2.npz").write_bytes(b"not a zip")
    bad = gp.ingest(store, str(dumps / "step={step}.npz"), run="r")
    clean = gp.verify(store)
    info = gp.open_run(store, "r").dump(1, "0").info("w")
    assert info.blocks[0] is not None
    store.backend.delete(block_key(info.blocks[0]))
    damaged = gp.verify(store)
    return {
        "ingest": [good, bad],
        "verify": [clean, damaged],
        "gc": [gp.gc(store, dry_run=True)],
    }


@pytest.fixture
def reports(tmp_path: Path) -> dict[str, list[gp.Report]]:
    return _reports(tmp_path)


def test_every_report_is_a_report(reports: dict[str, list[gp.Report]]) -> None:
    for kind in ("ingest", "verify", "gc"):
        for report in reports[kind]:
            assert isinstance(report, gp.Report), kind


def test_to_dict_is_json_and_agrees_with_ok(reports: dict[str, list[gp.Report]]) -> None:
    for kind, items in reports.items():
        for report in items:
            doc = json.loads(json.dumps(report.to_dict()))
            assert doc["ok"] is report.ok, kind
            text = report.summary()
            assert isinstance(text, str)
            assert text.strip(), kind


def test_ok_says_whether_something_failed(reports: dict[str, list[gp.Report]]) -> None:
    good, bad = reports["ingest"]
    assert (good.ok, bad.ok) == (True, False)
    assert "FAILED step 2" in bad.summary()
    clean, damaged = reports["verify"]
    assert (clean.ok, damaged.ok) == (True, False)
    assert "missing" in damaged.summary()


def test_an_object_without_the_three_members_is_not_a_report() -> None:
    class NoSummary:
        ok = True

        def to_dict(self) -> dict[str, object]:
            return {"ok": True}

    assert not isinstance(NoSummary(), gp.Report)
    assert not isinstance({"ok": True}, gp.Report)
