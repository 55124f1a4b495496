"""gp.analyze, gradpipe analyze and the workflow's analyze stage."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest

import gradpipe as gp
from gradpipe.analytics.options import ANALYSES, PARAMS, markdown_tables
from gradpipe.cli import main
from gradpipe.cli._app import build_parser
from gradpipe.testing.training import SampleRun, TrainingConfig, write_sample_run
from gradpipe.workflow.spec import STAGES

TINY = TrainingConfig(vocab_size=500, embed_dim=8, hidden=16, peers=4, steps=4)


@pytest.fixture(scope="module")
def sample(tmp_path_factory: pytest.TempPathFactory) -> SampleRun:
    return write_sample_run(tmp_path_factory.mktemp("sample"), TINY)


@pytest.fixture
def demo(sample: SampleRun, tmp_path: Path) -> gp.Store:
    store = gp.open_store(tmp_path / "store", mode="w")
    assert gp.ingest(store, sample.dump_pattern, run="demo").ok
    return store


def test_the_defaults_run_in_shared_passes(demo: gp.Store) -> None:
    report = gp.analyze(demo, "demo", window=3)
    assert isinstance(report, gp.AnalysisReport)
    assert list(report.results) == ["norms", "spikes", "nonfinite", "agreement", "gns"]
    assert report.ok, report.summary()
    head = report.headlines()
    assert head["spike_count"] == int(report["spikes"].spike.sum())
    assert head["first_nonfinite"] == ""
    assert isinstance(head["gns_latest"], float | None)
    assert report.to_dict()["ok"] is True
    rows = list(report.records())
    assert len(rows) == TINY.steps * TINY.peers
    assert {"l2_norm", "distance", "b_simple"} <= set(rows[0])
    again = gp.analyze(demo, "demo", window=3)
    assert again.chunks_read == 0
    assert all(r.attrs.get("computed_steps", 0) == 0 for r in again.results.values())


def test_parameters_go_to_the_analyses_that_take_them(demo: gp.Store) -> None:
    report = gp.analyze(demo, "demo", what=["spikes", "histograms"], threshold=2.0)
    assert list(gp.analyze(demo, "demo", what="norms").results) == ["norms"]
    assert report["spikes"].attrs["threshold"] == 2.0
    with pytest.raises(gp.InvalidInputError, match="takes no nope"):
        gp.analyze(demo, "demo", nope=1)
    with pytest.raises(gp.InvalidInputError, match="ema is a parameter of gns"):
        gp.analyze(demo, "demo", what=["norms"], ema=0.5)
    with pytest.raises(gp.InvalidInputError, match="influence needs a query"):
        gp.analyze(demo, "demo", what=["influence"])
    with pytest.raises(gp.InvalidInputError, match="the analyses are"):
        gp.analyze(demo, "demo", what=["nope"])


def test_one_failing_analysis_leaves_the_others(demo: gp.Store, tmp_path: Path) -> None:
    assert gp.aggregate(demo, run="demo", method="fedavg").ok
    report = gp.analyze(demo, "demo", aggregate="fedavg")
    assert list(report.results) == ["norms", "spikes", "nonfinite"]  # no peers to compare
    with pytest.raises(gp.InvalidInputError, match="only norms, spikes and nonfinite apply"):
        gp.analyze(demo, "demo", aggregate="fedavg", what=["agreement"])
    single = gp.open_store(tmp_path / "single", mode="w")
    one = tmp_path / "one" / "step=0" / "peer=a.npz"
    one.parent.mkdir(parents=True)
    import numpy as np

    np.savez(one, w=np.ones(4, np.float32))
    assert gp.ingest(single, str(tmp_path / "one" / "step={step}" / "peer={peer}.npz"), run="r").ok
    alone = gp.analyze(single, "r")  # one peer (one GPU): nothing to compare, no failure
    assert alone.ok, alone.summary()
    assert set(alone.skipped) == {"agreement", "gns"}
    partial = gp.analyze(single, "r", what=["norms", "agreement"])  # asked for: a failure
    assert "norms" in partial.results
    assert "agreement" in partial.failures
    assert not partial.ok
    assert "FAILED agreement" in partial.summary()


def test_the_command(demo: gp.Store, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["analyze", demo.url, "--run", "demo", "--window", "3"]) == 0
    out = capsys.readouterr().out
    assert "step" in out
    assert "B_simple" in out
    assert "outlier peers" in out
    assert main(["analyze", demo.url, "--run", "demo", "--format", "json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["ok"]
    assert doc["store"] == demo.url
    assert "spike_count" in doc
    assert main(["analyze", demo.url, "--run", "demo", "--what", "norms", "--format", "csv"]) == 0
    assert capsys.readouterr().out.splitlines()[0] == "step,peer,l2_norm"
    assert main(["analyze", demo.url, "--run", "demo", "--format", "csv", "--steps", "1:3"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("step,peer,")
    assert len(lines) == 1 + 2 * TINY.peers
    pytest.importorskip("matplotlib")
    plot = tmp_path / "a.png"
    assert main(["analyze", demo.url, "--run", "demo", "--plot", str(plot)]) == 0
    assert plot.read_bytes().startswith(b"\x89PNG")
    capsys.readouterr()
    assert main(["analyze", demo.url, "--run", "demo", "--what", "nope"]) == 2
    assert "the analyses are" in capsys.readouterr().err
    assert main(["ls", demo.url]) == 0
    listed = capsys.readouterr().out
    assert f"analyses: norms ({TINY.steps} steps), peers ({TINY.steps} steps)" in listed


def test_the_table_the_flags_and_the_stage_agree() -> None:
    parser = build_parser()
    [sub] = [a for a in parser._actions if a.dest == "command"]
    flags = {o for a in sub.choices["analyze"]._actions for o in a.option_strings}  # type: ignore[union-attr]
    for param in PARAMS:
        assert param.flag in flags
        assert param.name in STAGES["analyze"].fields
        assert param.name in markdown_tables()
    assert all(f"`{name}`" in markdown_tables() for name in ANALYSES)
    page = Path(__file__).parents[2] / "docs" / "user-guide" / "analytics.md"
    assert markdown_tables() in page.read_text(), "python -m gradpipe.analytics.options"


def test_the_workflow_stage(sample: SampleRun, tmp_path: Path) -> None:
    path = tmp_path / "w.yaml"
    path.write_text(
        textwrap.dedent(
            f"""
            version: 1
            store: {{url: archive, create: true}}
            backoff: 0
            stages:
              - ingest: {{pattern: "{sample.dump_pattern}", run: exp}}
              - analyze: {{run: exp, window: 3, csv: a.csv, json: a.json}}
            """
        )
    )
    report = gp.run_workflow(path)
    assert report.exit_status == 0, report.summary()
    assert (tmp_path / "a.csv").read_text().startswith("step,peer,")
    assert json.loads((tmp_path / "a.json").read_text())["ok"] is True
    bad = tmp_path / "bad.yaml"
    bad.write_text(path.read_text().replace("window: 3", "ema: 0.5, what: [norms]"))
    with pytest.raises(gp.GradpipeError, match="ema is a parameter of gns"):
        gp.run_workflow(bad, dry_run=True)  # refused on load, before anything runs


class _Recorder:
    """Stands in for a ``distributed.Client``: keeps what ``log_event`` was given."""

    def __init__(self) -> None:
        self.events: list[dict[str, object]] = []

    def log_event(self, topic: str, msg: dict[str, object]) -> None:
        self.events.append(msg)


def test_the_dashboard_shows_the_latest_analyses(demo: gp.Store) -> None:
    pytest.importorskip("distributed")
    from gradpipe.dashboard.board import Board, Live
    from gradpipe.dashboard.page import render_page

    gp.analyze(demo, "demo", window=3)  # memoised: the second call computes no graph
    client = _Recorder()
    report = gp.analyze(demo, "demo", window=3, runner=gp.Runner(client))  # type: ignore[arg-type]
    start, end = client.events
    assert (start["kind"], start["run"]) == ("analyze", "demo")
    assert end["state"] == "done"
    figures = end["figures"]
    assert isinstance(figures, dict)
    assert figures["spike_count"] == report.headlines()["spike_count"]
    board = Board()
    for when, event in enumerate(client.events):
        board.apply(float(when), event)
    [latest] = board.document(10.0, lambda spans: Live())["analyses"]
    assert latest["run"] == "demo"
    assert latest["spike_count"] == figures["spike_count"]
    page = render_page(board.document(10.0, lambda spans: Live()), refresh=0)
    assert "Latest analyses per run" in page
    assert "outlier peers" in page


def test_the_datatree_shows_what_is_recorded_and_computes_nothing(demo: gp.Store) -> None:
    import xarray as xr

    from gradpipe.analytics.stored import stored_analyses
    from gradpipe.core.ids import block_key
    from gradpipe.testing.faults import faulty_store

    assert "analytics" not in xr.open_datatree(demo, engine="gradpipe").children
    gp.analyze(demo, "demo", what=["norms", "agreement"])
    tree = xr.open_datatree(demo, engine="gradpipe")
    assert set(tree["analytics/demo"].children) == {"norms", "agreement", "gns"}  # one pass
    counted, backend = faulty_store(demo)
    assert set(stored_analyses(counted, "demo")) == {"norms", "agreement", "gns"}
    assert not [c for c in backend.calls if c[0] in ("write_if_absent", "swap")]
    dumps = {block_key(e.dump) for e in gp.open_run(demo, "demo")}
    assert not {k for op, k in backend.calls if op == "read"} & dumps  # results only
    norms = xr.open_dataset(demo, engine="gradpipe", kind="analysis", run="demo", name="norms")
    assert not norms.stale.any()
    assert norms.l2_norm.dims == ("step", "peer", "tensor")
    with pytest.raises(gp.NotFoundError, match="no analysis 'histograms'"):
        xr.open_dataset(demo, engine="gradpipe", kind="analysis", run="demo", name="histograms")


def test_the_functions_defaults_are_the_tables() -> None:
    import inspect

    from gradpipe.analytics.options import default, takers

    functions = {
        "spikes": gp.spikes,
        "nonfinite": gp.first_nonfinite,
        "agreement": gp.peer_agreement,
        "gns": gp.noise_scale,
        "histograms": gp.gradient_histograms,
        "projection": gp.project_gradients,
        "influence": gp.influence,
    }
    for param in PARAMS:
        for analysis in takers(param.name):
            signature = inspect.signature(functions[analysis])
            assert signature.parameters[param.name].default == default(param.name), (
                analysis,
                param.name,
            )


def test_steps_analysed_with_other_parameters_stay_out_of_the_tree(demo: gp.Store) -> None:
    from gradpipe.analytics.stored import stored_analyses

    gp.gradient_histograms(demo, "demo")
    gp.gradient_histograms(demo, "demo", steps=[1], bins_per_octave=4)
    counts = stored_analyses(demo, "demo")["histograms"]
    assert counts.sizes["step"] == TINY.steps - 1  # the steps of the default parameters
    assert counts.attrs["bins_per_octave"] == 2


def test_malformed_analyze_figures_do_not_break_the_page() -> None:
    from gradpipe.dashboard.board import Board, Live
    from gradpipe.dashboard.page import render_page

    board = Board()
    board.apply(1.0, {"event": "start", "operation": "o", "kind": "analyze", "run": "r"})
    figures = {"gns_latest": "not a number", "time": "x", "state": 3, "spike_count": True}
    board.apply(2.0, {"event": "end", "operation": "o", "state": "done", "figures": figures})
    [shown] = board.document(3.0, lambda spans: Live())["analyses"]
    assert shown["time"] == 2.0
    assert shown["state"] == "done"
    assert "gns_latest" not in shown
    assert "spike_count" not in shown
    assert "Latest analyses" in render_page(board.document(3.0, lambda spans: Live()), refresh=0)


def test_a_read_only_store_reads_the_peers_chunks_once(demo: gp.Store) -> None:
    import xarray as xr

    reader = gp.open_store(demo.url, mode="r")
    report = gp.analyze(reader, "demo", what=["agreement", "gns"])
    assert report.chunks_read == report["agreement"].attrs["chunks_read"] > 0  # one pass
    assert report["gns"].attrs["chunks_read"] == 0
    gp.project_gradients(demo, "demo", k=64)
    tree = xr.open_datatree(demo, engine="gradpipe")
    assert "analytics" not in tree.children  # projections alone: the largest, opened by name
    opened = xr.open_dataset(
        demo, engine="gradpipe", kind="analysis", run="demo", name="projection"
    )
    assert opened.projection.shape[-1] == 64
