"""``gradpipe aggregate``, ``export --aggregate`` and the aggregates ``ls`` lists."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import gradpipe as gp
from gradpipe.aggregation.server_opt import ServerOptimizerConfig, init_server_state, server_step
from gradpipe.cli.testing import run_cli, run_cli_json
from gradpipe.formats.safetensors import read_safetensors, write_safetensors


def test_aggregate_then_ls_and_export(ingested: str, tmp_path: Path) -> None:
    status, doc = run_cli_json(
        "aggregate", ingested, "--run", "train", "--method", "fedavg", "--steps", "0:2",
        "--clip-norm", "0.1", "--split-every", "2",
    )  # fmt: skip
    assert status == 0, doc
    assert doc["computed"] == 2
    assert [s["status"] for s in doc["steps"]] == ["computed", "computed"]
    status, again = run_cli_json(
        "aggregate", ingested, "--run", "train", "--method", "fedavg", "--steps", "0:2",
        "--clip-norm", "0.1",
    )  # fmt: skip
    assert status == 0
    assert again["memoised"] == 2
    assert [s["aggregate"] for s in again["steps"]] == [s["aggregate"] for s in doc["steps"]]

    status, listing = run_cli_json("ls", ingested, "train")
    assert status == 0
    assert [(a["step"], a["name"], a["stale"]) for a in listing["aggregates"]] == [
        (0, "fedavg", None),
        (1, "fedavg", None),
    ]
    assert listing["aggregates"][0]["params"] == {"clip_norm": 0.1}
    text = run_cli("ls", ingested, "train").out
    lines = text.splitlines()
    table = lines[lines.index("aggregates:") + 1 :]
    assert table[0].split() == ["step", "name", "method", "id"]  # labelled columns
    assert table[1].split()[:3] == ["0", "fedavg", "fedavg"]

    out = tmp_path / "agg.safetensors"
    status, exported = run_cli_json(
        "export", ingested, "--run", "train", "--step", "1", "--aggregate", "fedavg",
        "-o", str(out),
    )  # fmt: skip
    assert status == 0, exported
    tensors, meta = read_safetensors(str(out))
    view = gp.open_run(gp.open_store(ingested), "train").aggregate("fedavg", step=1)
    assert meta["aggregate_id"] == view.id == exported["aggregate_id"]
    for name, array in view.read_all().items():
        np.testing.assert_array_equal(tensors[name], array)


def test_weights_and_force(ingested: str) -> None:
    weights = '{"peer0": 1, "peer1": 2, "peer2": 4}'
    argv = ["aggregate", ingested, "--run", "train", "--method", "weighted-mean"]
    status, doc = run_cli_json(*argv, "--weights", weights, "--name", "w", "--steps", "2:3")
    assert status == 0, doc
    assert doc["name"] == "w"
    status, forced = run_cli_json(*argv, "--weights", weights, "--name", "w", "--force")
    assert forced["computed"] == 3
    assert forced["steps"][2]["aggregate"] == doc["steps"][0]["aggregate"]
    view = gp.open_run(gp.open_store(ingested), "train").aggregate("w", step=2)
    assert view.weights == {"peer0": 1.0, "peer1": 2.0, "peer2": 4.0}


@pytest.mark.parametrize(
    ("extra", "words"),
    [
        (["--method", "adam"], "invalid choice: 'adam'"),
        (["--method", "fedadam", "--server-lr", "0.1"], "--snapshot NAME"),
        (
            ["--method", "fedavgm", "--snapshot", "g", "--server-lr", "0.1", "--beta1", "0.5"],
            "fedavgm takes no beta1",
        ),
        (["--method", "fedavg", "--server-lr", "0.1"], "fedavg takes no server_lr"),
        (["--method", "mean", "--steps", "3"], "expected A:B"),
        (["--method", "mean", "--steps", "2:1"], "0 <= A < B"),
        (["--method", "fedavg", "--weights", "[1]"], "JSON object"),
        (["--method", "fedavg", "--weights", '{"peer0": 0}'], "finite and > 0"),
        (["--method", "weighted-mean"], "needs explicit weights"),
        (["--method", "fedavg", "--weights", '{"peer0": 1}'], "step 0, peer 'peer1'"),
        (["--method", "mean", "--split-every", "6"], "power of two"),
        (["--method", "mean", "--clip-norm", "-1"], "clip_norm"),
        (["--method", "mean", "--steps", "7:9"], "no dumps in steps 7:9"),
        (["--method", "krum", "--byzantine", "1"], "needs at least 5 peers, got 3"),
        (["--method", "bulyan", "--byzantine", "1"], "needs at least 7 peers, got 3"),
        (["--method", "multi-krum", "--keep", "4"], "keep=4"),
        (["--method", "trimmed-mean", "--trim", "0.7"], "trim"),
        (["--method", "median", "--byzantine", "1"], "median takes no byzantine"),
        (["--method", "dp-fedavg"], "--clip-norm"),
        (["--method", "dp-fedavg", "--clip-norm", "1", "--target-quantile", "0.5"], "--adaptive"),
        (["--method", "dp-fedavg", "--clip-norm", "1", "--clip-lr", "0.5"], "--adaptive"),
        (["--method", "dp-fedavg", "--clip-norm", "1", "--adaptive-clip", "--clip-lr", "0"], "> 0"),
        (["--method", "fedadam", "--snapshot", "s", "--server-lr", "0.1", "--tau", "0"], "tau"),
    ],
)
def test_bad_arguments_exit_2_and_write_nothing(
    ingested: str, extra: list[str], words: str
) -> None:
    store = gp.open_store(ingested)
    before = store.refs.get("runs/train")
    outcome = run_cli("aggregate", ingested, "--run", "train", *extra)
    assert outcome.status == 2
    assert words in outcome.err
    assert store.refs.get("runs/train") == before


def test_a_missing_run_is_named(ingested: str) -> None:
    outcome = run_cli("aggregate", ingested, "--run", "nope", "--method", "mean")
    assert outcome.status != 0
    assert "no run 'nope'" in outcome.err


@pytest.mark.parametrize(
    ("extra", "params"),
    [
        (["--method", "median"], {}),
        (["--method", "trimmed-mean", "--trim", "0.34"], {"trim": 0.34}),
        (["--method", "krum", "--byzantine", "0"], {"byzantine": 0}),
        (["--method", "multi-krum", "--byzantine", "0", "--keep", "2"], {"keep": 2}),
        (["--method", "bulyan", "--byzantine", "0"], {"byzantine": 0}),
        (
            ["--method", "dp-fedavg", "--clip-norm", "0.1", "--noise-multiplier", "0.5",
             "--seed", "7"],
            {"seed": 7, "noise_multiplier": 0.5, "clip_norm": 0.1},
        ),
        (
            ["--method", "dp-fedavg", "--clip-norm", "0.1", "--noise-multiplier", "0.1",
             "--adaptive-clip", "--target-quantile", "0.7"],
            {"adaptive_clip": True, "target_quantile": 0.7, "clip_lr": 0.2, "clip_norm_used": 0.1},
        ),
        (
            ["--method", "dp-fedavg", "--clip-norm", "0.1", "--noise-multiplier", "0.1",
             "--adaptive-clip", "--clip-lr", "0.5"],
            {"adaptive_clip": True, "target_quantile": 0.5, "clip_lr": 0.5},
        ),
    ],
)  # fmt: skip
def test_robust_and_private_methods(
    ingested: str, extra: list[str], params: dict[str, object]
) -> None:
    status, doc = run_cli_json("aggregate", ingested, "--run", "train", "--steps", "0:1", *extra)
    assert status == 0, doc
    assert doc["computed"] == 1
    method = extra[1]
    found = gp.open_run(gp.open_store(ingested), "train").aggregate(method, step=0)
    assert found.method == method
    for key, value in params.items():
        assert found.params[key] == value
    if method in ("krum", "multi-krum", "bulyan"):
        assert set(found.params["selected"]) <= {"peer0", "peer1", "peer2"}
    if method == "dp-fedavg":
        assert isinstance(found.params["seed"], int)


def test_a_server_optimizer_steps_a_snapshot_chain(ingested: str, tmp_path: Path) -> None:
    store = gp.open_store(ingested)
    schema = gp.open_run(store, "train").schema
    rng = np.random.default_rng(5)
    params = {n: rng.normal(size=s.shape).astype(np.float32) for n, s in schema.items()}
    init = tmp_path / "init.safetensors"
    write_safetensors(str(init), params, {})
    assert run_cli("snapshot", ingested, "global", str(init), "--step", "0").status == 0
    argv = [
        "aggregate", ingested, "--run", "train", "--method", "fedyogi", "--snapshot", "global",
        "--server-lr", "0.01", "--beta2", "0.9", "--bias-correction", "--steps", "0:2",
    ]  # fmt: skip
    status, doc = run_cli_json(*argv)
    assert status == 0, doc
    assert doc["method"] == "fedyogi"
    assert doc["snapshot"] == "global"
    assert doc["server_optimizer"]["bias_correction"] is True
    assert doc["server_steps"]["applied"] == 2
    assert [s["server"]["status"] for s in doc["steps"]] == ["applied", "applied"]
    config = ServerOptimizerConfig.from_dict(doc["server_optimizer"])
    run = gp.open_run(store, "train")
    x = dict(params)
    state = {n: init_server_state(a, config) for n, a in params.items()}
    for t, step in enumerate((0, 1), start=1):
        for name, g in run.aggregate("fedyogi", step=step).read_all().items():
            x[name], state[name] = server_step(x[name], g, state[name], config, t=t)
    restored = gp.restore(store, "global")
    for name, want in x.items():
        np.testing.assert_array_equal(restored["params"][name], want)
    again = run_cli(*argv)
    assert again.status == 0
    assert "snapshot 'global': 0 server steps applied, 2 memoised" in again.out
    status, log = run_cli_json("log", ingested, "global")
    assert status == 0
    assert [v["step"] for v in log["snapshots"]] == [0, 0, 1]
