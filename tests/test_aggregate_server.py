"""``gp.aggregate(method="fedadam", snapshot=..., server_lr=...)``: FedAvg, then server steps."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import dask.config
import numpy as np
import pytest

import gradpipe as gp
from gradpipe.aggregation.server_opt import ServerOptimizerConfig, init_server_state, server_step
from gradpipe.testing.training import SampleRun, TrainingConfig, write_sample_run

SMALL = TrainingConfig(vocab_size=500, embed_dim=8, hidden=8, peers=2, steps=3)


@pytest.fixture(scope="module")
def sample(tmp_path_factory: pytest.TempPathFactory) -> SampleRun:
    return write_sample_run(tmp_path_factory.mktemp("sample"), SMALL)


def _copy(sample: SampleRun, dest: Path, *, leave_out: tuple[int, str] | None = None) -> str:
    """The sample's dumps under ``dest``, without ``(step, peer)``; their pattern."""
    for step in sample.steps:
        for peer in sample.peers:
            if (step, peer) == leave_out:
                continue
            target = dest / f"step={step:04d}" / f"peer={peer}.safetensors"
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(Path(sample.dump_path(step, peer)).read_bytes())
    return str(dest / "step={step}/peer={peer}.safetensors")


def _store(tmp_path: Path, pattern: str) -> gp.Store:
    store = gp.open_store(tmp_path / "store", mode="a")
    with dask.config.set({"gradpipe.chunk-bytes": "8 KiB"}):
        assert gp.ingest(store, pattern, run="r").ok
    return store


def _initial(store: gp.Store) -> dict[str, np.ndarray]:
    schema = gp.open_run(store, "r").schema
    rng = np.random.default_rng(11)
    return {n: rng.normal(size=s.shape).astype(np.float32) for n, s in schema.items()}


FEDADAM: dict[str, Any] = {"method": "fedadam", "snapshot": "global", "server_lr": 0.02}


def test_fedadam_is_fedavg_then_a_server_step_per_step_and_memoised(
    sample: SampleRun, tmp_path: Path
) -> None:
    store = _store(tmp_path, sample.dump_pattern)
    params = _initial(store)
    gp.snapshot(store, "global", {"params": params}, step=0)
    report = gp.aggregate(store, run="r", beta1=0.8, **FEDADAM)
    assert report.ok, report.summary()
    assert report.method == "fedadam"
    assert report.name == "fedadam"
    assert report.computed == 3
    assert report.applied == 3
    config = ServerOptimizerConfig.from_dict({"method": "fedadam", "lr": 0.02, "beta1": 0.8})
    assert report.server_optimizer == config.to_dict()
    doc = report.to_dict()
    assert doc["snapshot"] == "global"
    assert doc["server_steps"] == {"applied": 3, "memoised": 0, "skipped": 0, "failed": 0}
    assert [s["server"]["status"] for s in doc["steps"]] == ["applied"] * 3
    # The pseudo-gradient is the FedAvg, recorded with the optimizer in its params.
    assert gp.aggregate(store, run="r", method="fedavg").ok
    run = gp.open_run(store, "r")
    x = dict(params)
    state = {n: init_server_state(a, config) for n, a in params.items()}
    for t, step in enumerate(range(3), start=1):
        ours, plain = run.aggregate("fedadam", step=step), run.aggregate("fedavg", step=step)
        assert ours.method == "fedavg"
        assert ours.params == {"server_optimizer": config.to_dict()}
        for name, g in plain.read_all().items():
            np.testing.assert_array_equal(ours.read(name), g)
            x[name], state[name] = server_step(x[name], g, state[name], config, t=t)
        info = gp.snapshot_log(store, "global")[step + 1]
        assert info.id == report.snapshot_id(step)
        assert info.step == step
        assert info.metadata["aggregate_id"] == ours.id
    restored = gp.restore(store, "global")
    for name, want in x.items():
        np.testing.assert_array_equal(restored["params"][name], want)
        np.testing.assert_array_equal(restored["server_optimizer"]["v"][name], state[name]["v"])
    again = gp.aggregate(store, run="r", beta1=0.8, **FEDADAM)
    assert again.ok
    assert again.memoised == 3
    assert [s.server.status for s in again.steps if s.server] == ["memoised"] * 3
    assert [again.snapshot_id(s) for s in range(3)] == [report.snapshot_id(s) for s in range(3)]
    assert len(gp.snapshot_log(store, "global")) == 4
    # Other settings under the same name: the aggregate is another one, and is not applied.
    other = gp.aggregate(store, run="r", beta1=0.5, **FEDADAM)
    assert other.ok
    assert other.applied == 0
    assert [s.status for s in other.steps] == ["skipped"] * 3
    assert all(s.server is not None and s.server.status == "skipped" for s in other.steps)
    assert len(gp.snapshot_log(store, "global")) == 4


def test_steps_apply_in_order_a_step_without_an_aggregate_holds_back_the_rest(
    sample: SampleRun, tmp_path: Path
) -> None:
    src = tmp_path / "src"
    store = _store(tmp_path, _copy(sample, src, leave_out=(1, "peer1")))
    gp.snapshot(store, "global", {"params": _initial(store)}, step=0)
    report = gp.aggregate(store, run="r", **FEDADAM)
    assert report.ok
    by_step = {s.step: s for s in report.steps}
    assert by_step[0].server is not None
    assert by_step[0].server.status == "applied"
    assert by_step[1].status == "skipped"  # step 1 is not ready: peer1 has not sent it
    assert by_step[1].server is not None
    assert by_step[1].server.status == "skipped"
    assert by_step[2].status == "computed"
    assert by_step[2].server is not None
    assert by_step[2].server.status == "skipped"
    assert "step 1 has no aggregate (skipped): steps apply in order" in by_step[2].server.reason
    assert "not applied server step 2" in report.summary()
    assert [i.step for i in gp.snapshot_log(store, "global")] == [0, 0]
    late = src / "step=0001" / "peer=peer1.safetensors"  # peer1's step 1 arrives
    late.write_bytes(Path(sample.dump_path(1, "peer1")).read_bytes())
    with dask.config.set({"gradpipe.chunk-bytes": "8 KiB"}):
        assert gp.ingest(store, str(src / "step={step}/peer={peer}.safetensors"), run="r").ok
    later = gp.aggregate(store, run="r", **FEDADAM)
    assert later.ok
    assert [(s.status, s.server.status if s.server else None) for s in later.steps] == [
        ("memoised", "memoised"),
        ("computed", "applied"),
        ("memoised", "applied"),
    ]
    assert [i.step for i in gp.snapshot_log(store, "global")] == [0, 0, 1, 2]


def test_a_chain_that_starts_later_skips_the_steps_before_it(
    sample: SampleRun, tmp_path: Path
) -> None:
    store = _store(tmp_path, sample.dump_pattern)
    gp.snapshot(store, "late", _initial(store), step=1)  # a flat {name: array}: the params
    report = gp.aggregate(store, run="r", method="sgd", snapshot="late", server_lr=0.1)
    assert report.ok
    servers = [s.server for s in report.steps]
    assert [s.status if s else None for s in servers] == ["skipped", "applied", "applied"]
    assert servers[0] is not None
    assert "is at step 1, after step 0" in servers[0].reason
    state = gp.restore(store, "late")
    assert set(state) == {"params", "server_optimizer"}
    assert state["server_optimizer"]["t"] == 2


def test_a_failed_server_step_fails_the_report_and_holds_back_the_rest(
    sample: SampleRun, tmp_path: Path
) -> None:
    store = _store(tmp_path, sample.dump_pattern)
    params = _initial(store)
    gp.snapshot(store, "global", {"params": params}, step=0)
    assert gp.aggregate(store, run="r", steps=[0], **FEDADAM).ok
    # Someone snapshots another kind of state on the chain: no server step can continue it.
    gp.snapshot(store, "global", {"params": params, "epoch": 1}, step=0)
    report = gp.aggregate(store, run="r", **FEDADAM)
    assert not report.ok
    servers = {s.step: s.server for s in report.steps}
    assert servers[0] is not None
    assert servers[0].status == "memoised"
    assert servers[1] is not None
    assert servers[1].status == "failed"
    assert "not a server state" in servers[1].reason
    assert servers[2] is not None
    assert servers[2].status == "skipped"
    assert "FAILED server step 1" in report.summary()
    assert report.computed == 2  # the aggregates themselves are recorded


@pytest.mark.parametrize(
    ("options", "error", "words"),
    [
        ({"method": "fedadam", "server_lr": 0.1}, gp.InvalidInputError, "--snapshot NAME"),
        ({"method": "fedadam", "snapshot": "global"}, gp.InvalidInputError, "--server-lr ETA"),
        ({**FEDADAM, "momentum": 0.5}, gp.InvalidInputError, "fedadam takes no momentum"),
        ({**FEDADAM, "method": "sgd", "tau": 0.1}, gp.InvalidInputError, "sgd takes no tau"),
        ({**FEDADAM, "beta2": 2.0}, gp.InvalidInputError, "beta2"),
        ({"method": "fedavg", "snapshot": "global"}, gp.InvalidInputError, "fedavg takes no"),
        ({"method": "mean", "server_lr": 0.1}, gp.InvalidInputError, "server_lr"),
        ({**FEDADAM, "snapshot": "nowhere"}, gp.NotFoundError, "no snapshot 'nowhere'"),
    ],
)
def test_bad_server_options_are_refused_before_anything_is_written(
    sample: SampleRun, tmp_path: Path, options: dict[str, Any], error: type, words: str
) -> None:
    store = _store(tmp_path, sample.dump_pattern)
    gp.snapshot(store, "global", {"params": _initial(store)}, step=0)
    before = store.refs.get("runs/r")
    with pytest.raises(error, match=words):
        gp.aggregate(store, run="r", **options)
    assert store.refs.get("runs/r") == before
    assert len(gp.snapshot_log(store, "global")) == 1
