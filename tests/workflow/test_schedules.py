"""The scheduling examples call the same command: crontab, Kubernetes CronJob, compose, Airflow."""

from __future__ import annotations

import ast
import shlex
from pathlib import Path
from typing import Any

import yaml

from gradpipe.workflow import load_workflow

REPO = Path(__file__).resolve().parents[2]
FLOWS = REPO / "workflows"
#: What every scheduler runs (the test suite runs it too: test_deploy.py).
COMMAND = ["gradpipe", "run", "workflows/nightly.yaml", "--json"]


def _cron_fields(line: str) -> tuple[list[str], str]:
    parts = line.split(None, 5)
    return parts[:5], parts[5]


def _valid_cron(fields: list[str]) -> bool:
    ranges = [(0, 59), (0, 23), (1, 31), (1, 12), (0, 7)]
    for field, (low, high) in zip(fields, ranges, strict=True):
        for part in field.split(","):
            base = part.split("/")[0]
            if base == "*":
                continue
            for bound in base.split("-"):
                if not bound.isdigit() or not low <= int(bound) <= high:
                    return False
    return len(fields) == 5


def _crontab() -> tuple[list[str], list[str], dict[str, str]]:
    """The job line's schedule and command, and the variables set above it."""
    env, jobs = {}, []
    for line in (FLOWS / "crontab").read_text().splitlines():
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        name, sep, value = line.partition("=")
        if sep and " " not in name:
            env[name] = value
        else:
            jobs.append(line)
    [job] = jobs
    fields, command = _cron_fields(job)
    return fields, shlex.split(command), env


def test_the_crontab_line_runs_the_nightly_workflow() -> None:
    fields, words, env = _crontab()
    assert _valid_cron(fields)
    assert words[:3] == ["cd", "/srv/gradpipe", "&&"]
    assert words[3 : 3 + len(COMMAND)] == COMMAND
    assert {"GRADPIPE_BUCKET", "DASK_SCHEDULER_ADDRESS"} <= set(env)
    load_workflow(FLOWS / "nightly.yaml", env=env)  # what it needs is set


def test_the_cronjob_manifest_runs_the_same_command() -> None:
    doc: Any = yaml.safe_load((FLOWS / "k8s-cronjob.yaml").read_text())
    assert (doc["apiVersion"], doc["kind"]) == ("batch/v1", "CronJob")
    spec = doc["spec"]
    fields, _, _ = _crontab()
    assert spec["schedule"].split() == fields
    assert spec["concurrencyPolicy"] == "Forbid"
    pod = spec["jobTemplate"]["spec"]["template"]["spec"]
    assert pod["restartPolicy"] in ("Never", "OnFailure")
    [container] = pod["containers"]
    assert container["command"] == COMMAND
    assert container["workingDir"] == "/srv/gradpipe"
    env = {e["name"]: e for e in container["env"]}
    assert {"GRADPIPE_BUCKET", "DASK_SCHEDULER_ADDRESS", "AWS_SECRET_ACCESS_KEY"} <= set(env)
    assert "secretKeyRef" in env["AWS_SECRET_ACCESS_KEY"]["valueFrom"]  # never inline


def test_the_compose_job_runs_the_same_command() -> None:
    doc: Any = yaml.safe_load((REPO / "docker" / "compose.yaml").read_text())
    assert doc["services"]["job"]["command"] == COMMAND


def test_the_airflow_dag_opens_a_client_and_runs_the_workflow() -> None:
    source = (FLOWS / "airflow_nightly.py").read_text()
    tree = ast.parse(source)
    calls = {ast.unparse(node.func): node for node in ast.walk(tree) if isinstance(node, ast.Call)}
    assert "Client" in calls  # distributed.Client
    assert "gp.run_workflow" in calls
    dag = calls["DAG"]
    options = {
        k.arg: ast.literal_eval(k.value)
        for k in dag.keywords
        if k.arg in ("schedule", "max_active_runs", "catchup")
    }
    fields, _, _ = _crontab()
    assert options == {"schedule": " ".join(fields), "max_active_runs": 1, "catchup": False}
    assert "nightly.yaml" in source
    imports = {
        node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module
    }
    assert {"distributed", "airflow"} <= imports
