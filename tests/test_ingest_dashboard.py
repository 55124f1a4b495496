"""``dashboard=True`` runs the ingest on an in-process cluster, reports its dashboard, closes it."""

from __future__ import annotations

import urllib.request
from pathlib import Path

import gradpipe as gp
from gradpipe.testing import TrainingConfig, write_sample_run


def test_ingest_on_a_local_cluster_reports_and_closes_its_dashboard(tmp_path: Path) -> None:
    sample = write_sample_run(tmp_path / "d", TrainingConfig(steps=2, peers=2))
    store = gp.open_store(tmp_path / "store", mode="w")
    seen: list[bytes] = []

    report = gp.ingest(store, sample.dump_pattern, run="r", dashboard=True)
    assert report.ok, report.summary()
    assert report.ingested == 4
    assert report.dashboard is not None
    assert report.dashboard.startswith("http://127.0.0.1:")
    # The cluster is closed with the ingest: its dashboard no longer answers.
    try:
        with urllib.request.urlopen(report.dashboard.replace("/status", "/health"), timeout=2) as r:
            seen.append(r.read())
    except OSError:
        pass
    assert seen == []
    assert gp.verify(store).ok
