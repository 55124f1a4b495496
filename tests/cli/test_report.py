"""``--report OUT.html``: Dask's performance report of an ingest or an aggregate, a real file.

Without ``--scheduler`` the job runs on an in-process cluster, whose dashboard
dies with the command; the report is what stays. It is Dask's own
``performance_report`` (a standalone HTML page with the task stream and
profiles), so the test checks it is that page and that it shows gradpipe's
tasks.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from gradpipe.cli.testing import run_cli, run_cli_json
from gradpipe.testing.training import SampleRun

pytest.importorskip("bokeh")  # distributed draws the report with it


def _check_report(path: Path, *prefixes: str) -> None:
    text = path.read_text()
    assert text.lstrip().lower().startswith("<!doctype html>")
    assert "Dask Performance Report" in text
    for prefix in prefixes:
        assert prefix in text, prefix


def test_ingest_and_aggregate_write_performance_reports(sample: SampleRun, tmp_path: Path) -> None:
    store = str(tmp_path / "store")
    out = tmp_path / "ingest.html"
    status, doc = run_cli_json(
        "ingest", store, sample.dump_pattern, "--run", "r", "--report", str(out)
    )
    assert status == 0, doc
    assert doc["ingested"] == len(sample.steps) * len(sample.peers)
    assert doc["performance_report"] == str(out)
    assert doc["dashboard"] is not None  # it ran on a cluster, which is gone now
    _check_report(out, "gradpipe-read", "gradpipe-encode", "gradpipe-commit")

    out = tmp_path / "aggregate.html"
    outcome = run_cli("aggregate", store, "--run", "r", "--method", "mean", "--report", str(out))
    assert outcome.status == 0, outcome.err
    assert outcome.out.rstrip().endswith(f"performance report: {out}")
    _check_report(out, "gradpipe-aggregate-reduce", "gradpipe-aggregate-commit")  # 3 peers


@pytest.mark.parametrize("where", ["missing/dir/report.html", "."])
def test_a_report_path_that_cannot_be_written_is_a_usage_error(
    sample: SampleRun, tmp_path: Path, where: str
) -> None:
    target = tmp_path / where
    store = str(tmp_path / "store")
    outcome = run_cli("ingest", store, sample.dump_pattern, "--run", "r", "--report", str(target))
    assert outcome.status == 2
    assert "--report" in outcome.err
    assert not (tmp_path / "store").exists()  # refused before anything ran


def test_a_workflow_writes_one_report_of_all_its_stages(sample: SampleRun, tmp_path: Path) -> None:
    workflow = tmp_path / "w.yaml"
    workflow.write_text(
        "version: 1\nstore: {url: store, create: true}\nstages:\n"
        f'  - ingest: {{pattern: "{sample.dump_pattern}", run: r}}\n'
        "  - aggregate: {run: r, method: mean}\n"
    )
    out = tmp_path / "nightly.html"
    status, doc = run_cli_json("run", str(workflow), "--report", str(out))
    assert status == 0, doc
    assert doc["performance_report"] == str(out)
    _check_report(out, "gradpipe-read", "gradpipe-aggregate-reduce")
