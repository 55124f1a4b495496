"""Workflow files: what checks out, what does not (with file, line and column), the schema."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest

from gradpipe.workflow import STAGES, WorkflowError, json_schema, load_workflow
from gradpipe.workflow.spec import parse_workflow
from gradpipe.workflow.stages import RUNNERS

REPO = Path(__file__).resolve().parents[2]
#: A file's first lines, up to its first stage ("- " ends at column 4).
HEAD = "version: 1\nstore: a\nstages:\n  - "
#: The workflow files among workflows/*.yaml (k8s-cronjob.yaml is a Kubernetes manifest).
EXAMPLES = sorted(p for p in (REPO / "workflows").glob("*.yaml") if "\nstages:" in p.read_text())
SHIPPED = REPO / "gradpipe" / "workflow" / "workflow.schema.json"


def _parse(text: str, env: dict[str, str] | None = None):  # type: ignore[no-untyped-def]
    return parse_workflow(text, "/data/w.yaml", env=env or {})


def test_a_full_file_checks_out() -> None:
    w = _parse(
        """
version: 1
name: nightly
store: {url: "s3://${BUCKET}/archive", storage_options: {key: "${KEY}"}}
retries: 4
backoff: 30s
stages:
  - ingest: {pattern: "dumps/step={step}/peer={peer}.npz", run: exp7, retries: 0}
  - rounds: {run: exp7, expect: [p0, p1], quorum: "75%", deadline: 2h}
  - aggregate: {run: exp7, method: trimmed-mean, trim: 0.2, steps: "0:10"}
  - prune: {snapshot: model, keep_last: 3}
  - gc: {grace: 24h}
  - verify:
""",
        env={"BUCKET": "b", "KEY": "s3cret"},
    )
    assert (w.name, w.store_url, w.store_shown) == (
        "nightly",
        "s3://b/archive",
        "s3://${BUCKET}/archive",
    )
    assert w.storage_options == {"key": "s3cret"}
    ingest, rounds, agg, _, gc, verify = w.stages
    assert ingest.params["pattern"] == "/data/dumps/step={step}/peer={peer}.npz"  # beside the file
    assert (ingest.retries, ingest.backoff, agg.retries, agg.backoff) == (0, 30.0, 4, 30.0)
    assert rounds.params == {
        "run": "exp7",
        "expect": ["p0", "p1"],
        "quorum": "75%",
        "deadline": 7200.0,
    }
    assert agg.params["steps"] == range(10)
    assert gc.params == {"grace": 86400.0}
    assert verify.params == {}
    assert verify.where == "/data/w.yaml:13:5"


@pytest.mark.parametrize(
    ("text", "where", "words"),
    [
        ("version: 2\nstore: a\nstages: [gc: {}]", "1:10", ["version 1", "2"]),
        ("store: a\nstages: [gc: {}]", "1:1", ["needs 'version'"]),
        ("version: 1\nstore: a\nstages: []", "3:9", ["non-empty list"]),
        ("version: 1\nstore: a\nstages: [gc: {}]\nstagse: []", "4:1", ["unknown key 'stagse'"]),
        (
            HEAD + "gc: {grase: 1h}",
            "4:10",
            ["unknown key 'grase'", "grace"],
        ),
        (HEAD + "clean: {}", "4:5", ["unknown stage 'clean'", "gc"]),
        (HEAD + "gc: {}\n    verify: {}", "4:5", ["one key"]),
        (
            HEAD + "aggregate: {run: r, method: fedavgg}",
            "4:33",
            ["'fedavgg' is not one of", "fedavg"],
        ),
        (HEAD + "ingest: {run: r}", "4:13", ["needs 'pattern'"]),
        (
            HEAD + "prune: {snapshot: m, keep_last: two}",
            "4:37",
            ["an integer"],
        ),
        (HEAD + "prune: {snapshot: m, keep_last: 0}", "4:37", [">= 1"]),
        (HEAD + "gc: {grace: soon}", "4:17", ["not a duration"]),
        (
            HEAD + "aggregate: {run: r, method: fedavg, weights: {a: 1" + "0" * 400 + "}}",
            "4:54",
            ["at most 100 characters"],  # before float64's range is even asked
        ),
        (
            HEAD + "rounds: {run: r, quorum: lots}",
            "4:30",
            ["quorum", "lots"],
        ),
        (
            HEAD + "aggregate: {run: 'a b', method: sum}",
            "4:22",
            ["run's name"],
        ),
        (
            HEAD + "aggregate: {run: r, method: sum, steps: 5}",
            "4:45",
            ["A:B"],
        ),
        ("version: 1\nstore: {path: a}\nstages: [gc: {}]", "2:9", ["unknown key 'path'"]),
        ("version: 1\nstore: [a]\nstages: [gc: {}]", "2:8", ["a path, a URL or a mapping"]),
        ('version: 1\nstore: "${NOPE}"\nstages: [gc: {}]', "2:8", ["NOPE is not set"]),
        ("version: 1\nversion: 1\nstore: a\nstages: [gc: {}]", "2:1", ["twice"]),
        ("version: 1\nstore: a\nstages: [gc: {grace: 2020-01-01}]", "3:22", ["quote it"]),
        ("version: 1\nstore: a\nstages: [gc: {]", "3:15", ["not valid YAML"]),
        ("", "", ["empty"]),
    ],
)
def test_a_bad_file_says_where_and_what(text: str, where: str, words: list[str]) -> None:
    with pytest.raises(WorkflowError) as caught:
        _parse(text)
    message = str(caught.value)
    assert message.startswith(f"/data/w.yaml:{where}" if where else "/data/w.yaml:"), message
    for word in words:
        assert word in message


def test_secrets_are_substituted_but_never_shown() -> None:
    w = _parse(
        'version: 1\nstore: a\nstages:\n  - ingest: {pattern: "s3://b/{step}/{peer}.npz", run: r,'
        ' storage_options: {secret: "${SECRET}", key: "$${literal}"}}',
        env={"SECRET": "hunter2"},
    )
    [stage] = w.stages
    assert stage.params["storage_options"] == {"secret": "hunter2", "key": "${literal}"}
    assert "hunter2" not in json.dumps(stage.shown)
    assert stage.shown["storage_options"] == "<hidden>"


def test_a_variable_may_have_a_default() -> None:
    text = 'version: 1\nstore: "${ROOT:-/srv}/archive"\nstages: [gc: {}]'
    assert _parse(text).store_url == "/srv/archive"
    assert _parse(text, env={"ROOT": "/data"}).store_url == "/data/archive"


def test_every_stage_has_a_runner() -> None:
    assert list(STAGES) == list(RUNNERS)


def test_every_example_is_checked() -> None:
    names = {p.name for p in EXAMPLES}
    assert {"quickstart.yaml", "nightly.yaml", "federated-round.yaml"} <= names


def test_the_shipped_schema_is_the_generated_one() -> None:
    assert json.loads(SHIPPED.read_text()) == json_schema()


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_the_examples_check_out_both_ways(path: Path) -> None:
    import yaml

    load_workflow(path, env={"GRADPIPE_BUCKET": "b"})
    jsonschema.validate(yaml.safe_load(path.read_text()), json_schema())


@pytest.mark.parametrize(
    "doc",
    [
        {"version": 1, "store": "a", "stages": [{"gc": {"grase": "1h"}}]},
        {"version": 1, "store": "a", "stages": [{"clean": {}}]},
        {"version": 1, "store": "a", "stages": [{"aggregate": {"run": "r"}}]},
        {"version": 2, "store": "a", "stages": [{"gc": {}}]},
        {"version": 1, "store": "a", "stages": [{"gc": {}, "verify": {}}]},
    ],
)
def test_the_schema_refuses_what_the_checker_refuses(
    doc: dict[str, object], tmp_path: Path
) -> None:
    import yaml

    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(doc, json_schema())
    path = tmp_path / "w.yaml"
    path.write_text(yaml.safe_dump(doc))
    with pytest.raises(WorkflowError):
        load_workflow(path)


def test_a_missing_file_is_named(tmp_path: Path) -> None:
    with pytest.raises(WorkflowError, match="no such workflow file"):
        load_workflow(tmp_path / "nope.yaml")


def test_outputs_are_local_and_empty_variables_take_their_default() -> None:
    with pytest.raises(WorkflowError, match="local path"):
        _parse(HEAD + "stats: {run: r, csv: s3://b/stats.csv}")
    text = 'version: 1\nstore: "${ROOT:-/srv}/archive"\nstages: [gc: {}]'
    assert _parse(text, env={"ROOT": ""}).store_url == "/srv/archive"  # as the shell


def test_an_alias_inside_itself_is_an_error() -> None:
    with pytest.raises(
        WorkflowError, match=r"3:13: the alias \*a refers to a node that holds it \(&a at 3:9\)"
    ):
        _parse("version: 1\nstore: a\nstages: &a [*a]")


@pytest.mark.parametrize(
    ("stage", "words"),
    [
        ({"run": "r", "method": "fedavg", "split_every": 3}, "power of two"),
        ({"run": "r", "method": "krum", "trim": 0.2}, "krum takes no trim"),
        ({"run": "r", "method": "dp-fedavg"}, "needs a clip norm"),
        ({"run": "r", "method": "median", "momentum": 0.0}, "median takes no momentum"),
        ({"run": "r", "method": "fedadam", "snapshot": "g"}, "server learning rate"),
        ({"run": "r", "method": "dp-fedavg", "clip_norm": 1.0, "clip_lr": 0.3}, "adaptive"),
    ],
)
def test_an_aggregate_stage_is_checked_as_gp_aggregate_checks_it(
    stage: dict[str, object], words: str, tmp_path: Path
) -> None:
    import yaml

    path = tmp_path / "w.yaml"
    path.write_text(yaml.safe_dump({"version": 1, "store": "s", "stages": [{"aggregate": stage}]}))
    with pytest.raises(WorkflowError, match=words) as caught:
        load_workflow(path)
    assert "w.yaml:" in str(caught.value)
    assert "stage 'aggregate'" in str(caught.value)
