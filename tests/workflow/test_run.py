"""``gradpipe run``: stages in order, exit statuses, retries, idempotence, overlap, secrets."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

import gradpipe as gp
from gradpipe.cli import main
from gradpipe.testing.ids import run_tensor_ids
from gradpipe.testing.s3server import LostReply, S3Server
from gradpipe.testing.training import SampleRun, TrainingConfig, write_sample_run

REPO = Path(__file__).resolve().parents[2]
TINY = TrainingConfig(vocab_size=500, embed_dim=8, hidden=16, peers=3, steps=3)


@pytest.fixture(scope="module")
def sample(tmp_path_factory: pytest.TempPathFactory) -> SampleRun:
    return write_sample_run(tmp_path_factory.mktemp("sample"), TINY)


def _write(tmp_path: Path, text: str, name: str = "w.yaml") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


def _nightly(
    tmp_path: Path, sample: SampleRun, store: str = "{url: archive, create: true}"
) -> Path:
    return _write(
        tmp_path,
        f"""
        version: 1
        store: {store}
        backoff: 0
        stages:
          - ingest: {{pattern: "{sample.dump_pattern}", run: exp}}
          - aggregate: {{run: exp, method: fedavg}}
          - stats: {{run: exp, csv: stats.csv, json: stats.json, plot: stats.png}}
          - snapshot: {{name: model, pattern: "{sample.state_pattern}"}}
          - prune: {{snapshot: model, keep_last: 2}}
          - gc: {{grace: 24h}}
          - verify: {{}}
        """,
    )


def _files(root: Path) -> dict[str, bytes]:
    """Every object of a local store but the locks (held only while an operation runs)."""
    return {
        str(p.relative_to(root)): p.read_bytes()
        for p in sorted(root.rglob("*"))
        if p.is_file() and "locks" not in p.relative_to(root).parts
    }


def test_a_workflow_runs_its_stages_and_a_second_run_writes_nothing(
    sample: SampleRun, tmp_path: Path
) -> None:
    path = _nightly(tmp_path, sample)
    report = gp.run_workflow(path)
    assert isinstance(report, gp.Report)
    assert report.exit_status == 0, report.summary()
    assert [s.state for s in report.stages] == ["ok"] * 7
    ingest, agg, stats, snap, _, _, verify = (s.report or {} for s in report.stages)
    assert stats["totals"]["raw_bytes"] > stats["totals"]["stored_bytes"] > 0
    rows = (tmp_path / "stats.csv").read_text().splitlines()
    assert rows[0].startswith("step,peer,tensor,")
    assert len(rows) == 1 + TINY.steps * TINY.peers * len(
        gp.open_run(gp.open_store(tmp_path / "archive"), "exp").schema
    )
    assert json.loads((tmp_path / "stats.json").read_text())["totals"]["ratio"] > 1
    assert (tmp_path / "stats.png").read_bytes().startswith(b"\x89PNG")
    assert ingest["ingested"] == TINY.steps * TINY.peers
    assert agg["computed"] == TINY.steps
    assert [t["step"] for t in snap["taken"]] == list(range(TINY.steps))
    assert verify["ok"]
    store = gp.open_store(tmp_path / "archive")
    assert [i.step for i in gp.snapshot_log(store, "model")] == [1, 2]
    before = _files(tmp_path / "archive")
    again = gp.run_workflow(path)
    assert again.exit_status == 0, again.summary()
    assert again.stages[0].report["skipped"] == TINY.steps * TINY.peers  # type: ignore[index]
    assert again.stages[1].report["memoised"] == TINY.steps  # type: ignore[index]
    assert again.stages[3].report["taken"] == []  # type: ignore[index]
    assert _files(tmp_path / "archive") == before  # idempotent: not one object written


def _without_matplotlib(monkeypatch: pytest.MonkeyPatch) -> None:
    """This process as a base install sees it: matplotlib (the ``plot`` extra) not found."""
    import importlib.util

    real = importlib.util.find_spec

    def find_spec(name: str, package: str | None = None) -> Any:
        return None if name.split(".", maxsplit=1)[0] == "matplotlib" else real(name, package)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)


def test_a_plot_without_matplotlib_is_refused_before_anything_runs(
    sample: SampleRun, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    _without_matplotlib(monkeypatch)
    path = _nightly(tmp_path, sample)
    for extra in (["--dry-run"], []):
        assert main(["run", str(path), *extra]) == 2
        err = capsys.readouterr().err
        assert "needs matplotlib" in err
        assert "pip install 'gradpipe[plot]'" in err
        assert "w.yaml:" in err  # file:line:col of the plot
    assert not (tmp_path / "archive").exists()  # nothing written
    # A worker that runs one stage (``only``) needs only what that stage needs.
    assert gp.run_workflow(path, only=[0]).exit_status == 0


def test_the_quickstart_workflow_runs_from_the_cli(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    _without_matplotlib(monkeypatch)  # it runs on the install the README's first command makes
    (tmp_path / "workflows").mkdir()
    path = tmp_path / "workflows" / "quickstart.yaml"
    shutil.copy(REPO / "workflows" / "quickstart.yaml", path)
    assert main(["run", str(path), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["ok"] is True
    assert [s["kind"] for s in doc["stages"]][:2] == ["sample", "ingest"]
    assert (tmp_path / "gradpipe-quickstart" / "archive").is_dir()  # beside the file, as written


def test_a_failed_input_is_exit_1_and_the_next_stages_still_run(
    sample: SampleRun, tmp_path: Path
) -> None:
    dumps = tmp_path / "dumps"
    shutil.copytree(Path(sample.directory) / "dumps", dumps)
    bad = dumps / "step=0001" / "peer=peer2.safetensors"
    bad.write_bytes(bad.read_bytes()[:100])
    path = _write(
        tmp_path,
        """
        version: 1
        store: {url: archive, create: true}
        stages:
          - ingest: {pattern: "dumps/step={step}/peer={peer}.safetensors", run: exp}
          - aggregate: {run: exp, method: mean}
          - verify:
        """,
    )
    report = gp.run_workflow(path)
    assert report.exit_status == 1
    assert [s.state for s in report.stages] == ["failed", "ok", "ok"]
    assert str(bad) in report.stages[0].summary
    steps = report.stages[1].report["steps"]  # type: ignore[index]
    assert [s["status"] for s in steps] == ["computed", "skipped", "computed"]  # step 1 waits


def test_a_stage_that_cannot_run_is_exit_2_and_stops_the_workflow(
    sample: SampleRun, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    gp.open_store(tmp_path / "archive", mode="w")
    path = _write(
        tmp_path,
        """
        version: 1
        store: archive
        stages:
          - aggregate: {run: nope, method: fedavg}
          - verify: {}
        """,
    )
    report = gp.run_workflow(path)
    assert report.exit_status == 2
    assert [s.state for s in report.stages] == ["error", "not-run"]
    assert report.stages[0].error is not None
    assert f"{path}:5:5" in report.stages[0].error  # where the stage is
    assert "nope" in report.stages[0].error
    assert main(["run", str(path)]) == 2
    assert "not-run" in capsys.readouterr().out


def test_a_bad_file_or_a_missing_store_is_exit_2_before_anything_runs(
    sample: SampleRun, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = _write(tmp_path, "version: 1\nstore: archive\nstages:\n  - gc: {grase: 1h}\n")
    assert main(["run", str(bad)]) == 2
    assert f"{bad}:4:10: unknown key 'grase'" in capsys.readouterr().err
    missing = _nightly(tmp_path, sample, store="archive")  # no `create: true`
    assert main(["run", str(missing), "--json"]) == 2
    out = json.loads(capsys.readouterr().out)
    assert out["ok"] is False
    assert "create: true" in out["error"]
    assert not (tmp_path / "archive").exists()


def test_a_dry_run_lists_the_stages_and_writes_nothing(sample: SampleRun, tmp_path: Path) -> None:
    path = _nightly(tmp_path, sample)
    report = gp.run_workflow(path, dry_run=True)
    assert report.exit_status == 0
    assert [s.state for s in report.stages] == ["planned"] * 7
    assert "ingest" in report.summary()
    assert not (tmp_path / "archive").exists()


def test_retries_outlast_a_flaky_store_and_give_up_on_a_dead_one(
    s3_faults: S3Server, sample: SampleRun, tmp_path: Path
) -> None:
    options = json.dumps(s3_faults.storage_options)
    path = _write(
        tmp_path,
        f"""
        version: 1
        store: {{url: "s3://gradpipe-test/wf", storage_options: {options}, create: true}}
        retries: 2
        backoff: 7
        stages:
          - ingest: {{pattern: "{sample.dump_pattern}", run: exp}}
          - verify: {{}}
        """,
    )
    # Every commit of the run's ref fails until the "network" comes back during a backoff.
    failing: set[int] = set(range(1, 10_000))
    waits: list[float] = []

    def recover(seconds: float) -> None:
        waits.append(seconds)
        failing.clear()

    rule = LostReply("PUT", "gradpipe-test/wf/refs/runs/*", calls=failing, reach=False)
    with s3_faults.lose_replies(rule):
        report = gp.run_workflow(path, sleep=recover)
    assert report.exit_status == 0, report.summary()
    assert (report.stages[0].attempts, waits) == (2, [7.0])
    assert rule.fired > 0
    # A store that stays down: every attempt fails, then exit 3 and the rest is not run.
    rule = LostReply("GET", "gradpipe-test/wf/*", reach=False)
    with s3_faults.lose_replies(rule):
        waits.clear()
        dead = gp.run_workflow(path, sleep=waits.append)
    assert dead.exit_status == 3, dead.summary()
    assert waits == [7.0, 14.0]


def test_secrets_from_the_environment_never_reach_the_output(
    s3: S3Server,
    sample: SampleRun,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("WF_SECRET", "testing")  # moto's secret, so the run works
    monkeypatch.setenv("WF_ENDPOINT", s3.endpoint_url)
    path = _write(
        tmp_path,
        f"""
        version: 1
        store:
          url: s3://gradpipe-test/secret
          create: true
          storage_options:
            {{key: testing, secret: "${{WF_SECRET}}", endpoint_url: "${{WF_ENDPOINT}}"}}
        stages:
          - ingest: {{pattern: "{sample.dump_pattern}", run: exp}}
        """,
    )
    monkeypatch.setenv("WF_SECRET", "testing")
    assert main(["run", str(path), "--json"]) == 0
    out = capsys.readouterr()
    doc = json.loads(out.out)
    assert doc["ok"] is True
    assert "${WF_SECRET}" not in out.out  # storage options are not shown at all
    assert '"testing"' not in out.out.replace('"key": "testing"', "")


def test_two_runs_at_once_do_no_work_twice(sample: SampleRun, tmp_path: Path) -> None:
    path = _nightly(tmp_path, sample)
    gp.open_store(tmp_path / "archive", mode="w")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    runs = [
        subprocess.Popen(
            [sys.executable, "-m", "gradpipe.cli", "run", str(path), "--json"],
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        for _ in range(2)
    ]
    docs: list[dict[str, Any]] = [json.loads(p.communicate(timeout=300)[0]) for p in runs]
    assert [p.returncode for p in runs] == [0, 0], docs
    store = gp.open_store(tmp_path / "archive")
    run = gp.open_run(store, "exp")
    assert len(list(run)) == TINY.steps * TINY.peers  # every dump once
    ingested = sum(d["stages"][0]["report"]["ingested"] for d in docs)
    assert ingested == TINY.steps * TINY.peers  # no dump ingested by both
    ids = {run.aggregate("fedavg", step=s).id for s in range(TINY.steps)}
    assert len(ids) == TINY.steps
    steps = [i.step for i in gp.snapshot_log(store, "model")]
    assert steps == sorted(set(steps))  # no step snapshotted twice
    assert gp.verify(store).ok


def test_a_state_file_that_cannot_be_read_holds_the_chain_back(
    sample: SampleRun, tmp_path: Path
) -> None:
    states = tmp_path / "state"
    shutil.copytree(Path(sample.directory) / "state", states)
    (states / "step=0001.safetensors").write_bytes(b"not a state")
    path = _write(
        tmp_path,
        """
        version: 1
        store: {url: archive, create: true}
        stages:
          - snapshot: {name: model, pattern: "state/step={step}.safetensors"}
        """,
    )
    report = gp.run_workflow(path)
    assert report.exit_status == 1
    snap = report.stages[0].report or {}
    assert [t["step"] for t in snap["taken"]] == [0]  # not 2: step 1 must come first
    assert [f["step"] for f in snap["failures"]] == [1]
    shutil.copy(Path(sample.directory) / "state" / "step=0001.safetensors", states)
    again = gp.run_workflow(path)  # fixed: the chain goes on from step 1
    assert again.exit_status == 0
    assert [t["step"] for t in (again.stages[0].report or {})["taken"]] == [1, 2]


def test_a_step_another_writer_took_meanwhile_is_passed_over_not_taken(
    sample: SampleRun, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A racing copy of the stage lands a step between this one's look at the chain and write."""
    import gradpipe.formats.state_file as state_file

    path = _write(
        tmp_path,
        f"""
        version: 1
        store: {{url: archive, create: true}}
        stages:
          - snapshot: {{name: model, pattern: "{sample.state_pattern}"}}
        """,
    )
    store = gp.open_store(tmp_path / "archive", mode="w")
    real = state_file.read_state_file
    others: list[str] = []

    def read_then_race(file: str) -> Any:
        state, info = real(file)
        if not others:  # the other copy writes the same step, as the stage would
            meta = {state_file.STATE_FILE_KEY: json.dumps(info.to_dict(), separators=(",", ":"))}
            others.append(gp.snapshot(store, "model", state, step=0, metadata=meta))
        return state, info

    monkeypatch.setattr(state_file, "read_state_file", read_then_race)
    report = gp.run_workflow(path)
    assert report.exit_status == 0, report.summary()
    snap = report.stages[0].report or {}
    assert [t["step"] for t in snap["taken"]] == list(range(1, TINY.steps))
    assert snap["passed"] == [0]
    log = gp.snapshot_log(store, "model")
    assert [i.step for i in log] == list(range(TINY.steps))
    assert log[0].id == others[0]


def test_an_output_folder_that_is_not_there_is_exit_2_without_retries(
    sample: SampleRun, tmp_path: Path
) -> None:
    path = _write(
        tmp_path,
        f"""
        version: 1
        store: {{url: archive, create: true}}
        backoff: 100
        stages:
          - ingest: {{pattern: "{sample.dump_pattern}", run: exp}}
          - stats: {{run: exp, csv: no/such/folder/stats.csv}}
        """,
    )
    waits: list[float] = []
    report = gp.run_workflow(path, sleep=waits.append)
    assert report.exit_status == 2
    assert report.stages[1].state == "error"
    assert waits == []


def test_a_workflow_on_local_processes_stores_what_threads_store(
    sample: SampleRun, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``gradpipe run --processes``: every stage's graph on the process pool (issue 19)."""
    threads, processes = tmp_path / "threads", tmp_path / "processes"
    threads.mkdir()
    processes.mkdir()
    assert gp.run_workflow(_nightly(threads, sample)).exit_status == 0
    assert main(["run", str(_nightly(processes, sample)), "--processes", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert [s["state"] for s in doc["stages"]] == ["ok"] * 7

    def aggregates(root: Path) -> list[str | None]:
        run = gp.open_run(gp.open_store(root / "archive"), "exp")
        return [run.aggregate("fedavg", step=s).id for s in range(TINY.steps)]

    # Content-addressed ids: the same bytes, statistics and provenance (commits and
    # snapshots carry their times, so the stores' other objects differ).
    ids = [run_tensor_ids(gp.open_store(root / "archive"), "exp") for root in (processes, threads)]
    assert ids[0] == ids[1]
    assert aggregates(processes) == aggregates(threads)


def test_the_stats_stage_line_rounds_its_ratio_and_normalises_paths() -> None:
    from gradpipe.workflow.stages import StatsStageReport

    report = StatsStageReport(
        {"raw_bytes": 3 * 2**20, "stored_bytes": 2**20, "ratio": 2.987654321},
        {"csv": "/data/flows/../out/stats.csv"},
        0,
    )
    line = report.summary()
    assert "(ratio 2.99)" in line
    assert "wrote csv '/data/out/stats.csv'" in line  # /data/out: no symlinks on the way
