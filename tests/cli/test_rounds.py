"""``gradpipe rounds``, and ``gradpipe aggregate`` acting on ready steps only."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import gradpipe as gp
from gradpipe.cli.testing import run_cli, run_cli_json


def test_rounds_json_table_and_settings(ingested: str, tmp_path: Path) -> None:
    status, doc = run_cli_json("rounds", ingested, "--run", "train")
    assert status == 0, doc
    assert doc["ok"] is True
    assert doc["roster_inferred"] is True
    assert doc["roster"] == ["peer0", "peer1", "peer2"]
    assert doc["stats"]["total"] == 3
    assert doc["stats"]["ready"] == 3
    assert doc["steps"][0]["peers"] == {"pending": 0, "received": 3, "aggregated": 0, "failed": 0}

    roster = tmp_path / "peers.txt"
    roster.write_text("peer0\npeer1  # the big one\npeer2\npeer3\n")
    status, doc = run_cli_json("rounds", ingested, "--run", "train", "--expect", f"@{roster}")
    assert status == 0, doc
    assert doc["roster"] == ["peer0", "peer1", "peer2", "peer3"]
    assert doc["stats"]["pending"] == 3
    assert "peer3" in doc["steps"][0]["reason"]

    status, agg = run_cli_json("aggregate", ingested, "--run", "train", "--method", "mean")
    assert status == 0, agg
    assert [s["status"] for s in agg["steps"]] == ["skipped"] * 3
    assert all("peer3" in s["reason"] for s in agg["steps"])
    text = run_cli("aggregate", ingested, "--run", "train", "--method", "mean").out
    assert "skipped step 0: not ready" in text

    status, doc = run_cli_json(
        "rounds", ingested, "--run", "train", "--quorum", "3", "--fail", "peer3@0",
        "--reason", "node lost",
    )  # fmt: skip
    assert status == 0, doc
    assert doc["quorum"] == "at least 3"
    assert doc["steps"][0]["statuses"][3] == {
        "peer": "peer3",
        "status": "failed",
        "reason": "node lost",
    }
    status, agg = run_cli_json("aggregate", ingested, "--run", "train", "--method", "mean")
    assert [s["status"] for s in agg["steps"]] == ["computed"] * 3
    outcome = run_cli("rounds", ingested, "--run", "train")
    assert outcome.status == 0
    assert "3 completed" in outcome.out
    assert "peer3 failed: node lost" in outcome.out

    # the deadline has passed for a step nobody delivered: that step failed, exit 1
    status, doc = run_cli_json(
        "rounds", ingested, "--run", "train", "--deadline", "1h", "--start",
        "2020-01-01T00:00:00+00:00", "--fail", "peer0@9", "--reason", "gone",
    )  # fmt: skip
    assert status == 1
    assert doc["ok"] is False
    assert doc["stats"]["failed"] == 1
    assert doc["steps"][-1]["step"] == 9


def test_bad_arguments(ingested: str) -> None:
    for argv, words in [
        (["--quorum", "most"], "quorum"),
        (["--fail", "peer0@1"], "reason"),
        (["--fail", "peer0", "--reason", "x"], "PEER@STEP"),
        (["--expect", ","], "no peers"),
        (["--expect", "@/no/such/file"], "cannot read"),
        (["--deadline", "soon"], "duration"),
        (["--start", "yesterday"], "ISO 8601"),
    ]:
        outcome = run_cli("rounds", ingested, "--run", "train", *argv)
        assert outcome.status == 2, (argv, outcome.err)
        assert words in outcome.err, (argv, outcome.err)
    outcome = run_cli("rounds", ingested, "--run", "nope", "--quorum", "2")
    assert outcome.status == 1  # a missing object, as for every command
    assert "no run 'nope'" in outcome.err
    assert gp.open_store(ingested).refs.names("rounds") == []  # nothing set for it


def test_two_aggregate_processes_racing_record_one_result_per_step(ingested: str) -> None:
    root = str(Path(gp.__file__).parents[1])
    env = {**os.environ, "PYTHONPATH": root}
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "gradpipe.cli",
                "aggregate",
                ingested,
                "--run",
                "train",
                "--method",
                method,
                "--name",
                "avg",
                "--json",
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for method in ("mean", "sum")
    ]
    docs = []
    for proc in procs:
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err
        docs.append(json.loads(out))
    recorded = {
        a.step: a.aggregate for a in gp.open_run(gp.open_store(ingested), "train").aggregates
    }
    for step in range(3):
        outcomes = [next(s for s in d["steps"] if s["step"] == step) for d in docs]
        computed = [o for o in outcomes if o["status"] == "computed"]
        assert len(computed) == 1, outcomes  # never both
        [loser] = [o for o in outcomes if o["status"] != "computed"]
        assert loser["status"] == "skipped"
        assert "claimed by another" in loser["reason"] or "already aggregated" in loser["reason"]
        assert recorded[step] == computed[0]["aggregate"]
