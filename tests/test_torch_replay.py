"""``save_state(gradients=True)``: training resumed from a replay-encoded snapshot matches
the uninterrupted run bit for bit (issue 21), for Adam, AdamW and SGD with a scheduler."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import dask.config
import pytest

import gradpipe as gp

torch = pytest.importorskip("torch")

from gradpipe.torch import load_state, save_state  # noqa: E402

SMALL = {"gradpipe.chunk-bytes": 8192, "gradpipe.inline-bytes": 0}


def _model() -> Any:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Embedding(300, 16),
        torch.nn.Linear(16, 64),
        torch.nn.GELU(),
        torch.nn.LayerNorm(64),
        torch.nn.Linear(64, 300),
    )


def _optimizer(kind: str, model: Any) -> Any:
    if kind == "adam":
        return torch.optim.Adam(model.parameters(), lr=3e-3)
    if kind == "adamw":
        return torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.05)
    if kind == "adamw-foreach":
        return torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.05, foreach=True)
    if kind == "adam-fused":
        return torch.optim.Adam(model.parameters(), lr=3e-3, fused=True)
    if kind == "sgd-plain":  # no momentum: torch keeps no state per parameter
        return torch.optim.SGD(model.parameters(), lr=3e-2)
    return torch.optim.SGD(model.parameters(), lr=3e-2, momentum=0.9, nesterov=True)


def _batch(step: int) -> Any:
    generator = torch.Generator().manual_seed(step)
    return torch.randint(0, 300, (24,), generator=generator)


def _train_step(model: Any, optimizer: Any, scheduler: Any, step: int) -> float:
    x = _batch(step)
    optimizer.zero_grad()
    loss = torch.nn.functional.cross_entropy(model(x), x)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # clipped in place: applied
    optimizer.step()
    scheduler.step()  # moves the lr after the step: the hook records the one applied
    return float(loss.detach())


def _state(model: Any, optimizer: Any) -> list[bytes]:
    out = [p.detach().numpy().tobytes() for p in model.parameters()]
    for state in optimizer.state.values():
        out += [v.detach().numpy().tobytes() for v in state.values() if v is not None]
    return out


@pytest.mark.parametrize(
    "kind", ["adam", "adamw", "sgd", "sgd-plain", "adamw-foreach", "adam-fused"]
)
@pytest.mark.parametrize("blocking", [True, False])
def test_resuming_from_a_replayed_snapshot_matches_the_uninterrupted_run(
    tmp_path: Path, kind: str, blocking: bool
) -> None:
    store = gp.open_store(tmp_path / "s", mode="w")
    model = _model()
    optimizer = _optimizer(kind, model)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 2, 0.5)
    losses = []
    schedules = {}
    with dask.config.set(SMALL):
        for step in range(1, 7):
            losses.append(_train_step(model, optimizer, scheduler, step))
            schedules[step] = scheduler.state_dict()
            if blocking:
                save_state(store, "run", model, optimizer, step=step, gradients=True)
            else:
                save_state(
                    store, "run", model, optimizer, step=step, gradients=True, blocking=False
                ).result()
    log = gp.snapshot_log(store, "run")
    full = log[0].full_bytes
    assert all(v.stored_bytes < full / 5 for v in log[1:4]), [v.stored_bytes for v in log]
    uninterrupted = _state(model, optimizer)

    model2 = _model()
    optimizer2 = _optimizer(kind, model2)
    scheduler2 = torch.optim.lr_scheduler.StepLR(optimizer2, 2, 0.5)
    load_state(store, "run", model2, optimizer2, step=3)
    scheduler2.load_state_dict(schedules[3])  # the scheduler is the caller's, as with torch.save
    resumed = [_train_step(model2, optimizer2, scheduler2, step) for step in range(4, 7)]
    assert resumed == losses[3:]
    assert _state(model2, optimizer2) == uninterrupted


def test_an_optimizer_that_is_not_replayed_is_refused(tmp_path: Path) -> None:
    store = gp.open_store(tmp_path / "s", mode="w")
    model = _model()
    optimizer = torch.optim.RMSprop(model.parameters())
    with pytest.raises(gp.InvalidInputError, match="RMSprop is not replayed"):
        save_state(store, "run", model, optimizer, step=1, gradients=True)


def _checkpoints(tmp_path: Path, steps: int = 3) -> list[Path]:
    """A torch AdamW run: per step, the applied gradient as one peer's dump and a checkpoint."""
    import numpy as np

    model = _model()
    optimizer = _optimizer("adamw", model)
    scheduler = torch.optim.lr_scheduler.ConstantLR(optimizer, factor=1.0)
    checkpoints = []
    for step in range(1, steps + 1):
        _train_step(model, optimizer, scheduler, step)
        dump = tmp_path / "dumps" / f"step={step}" / "peer=p0.npz"
        dump.parent.mkdir(parents=True, exist_ok=True)
        np.savez(dump, **{n: p.grad.numpy() for n, p in model.named_parameters()})
        path = tmp_path / "ckpt" / f"step={step}.pt"
        path.parent.mkdir(exist_ok=True)
        torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, path)
        checkpoints.append(path)
    return checkpoints


def test_the_command_line_replays_a_checkpoint_against_a_runs_aggregate(tmp_path: Path) -> None:
    """`gradpipe snapshot CKPT --gradient RUN:AGG@STEP --optimizer adamw`, `log`, `restore`."""
    import numpy as np

    from gradpipe.cli.testing import run_cli, run_cli_json
    from gradpipe.formats.state_file import read_state_file

    store = str(tmp_path / "store")
    gp.open_store(store, mode="w")
    checkpoints = _checkpoints(tmp_path)
    with dask.config.set(SMALL):
        pattern = str(tmp_path / "dumps" / "step={step}" / "peer={peer}.npz")
        assert run_cli("ingest", store, pattern, "--run", "r").status == 0
        assert run_cli("aggregate", store, "--run", "r", "--method", "mean").status == 0
        for step, path in enumerate(checkpoints, start=1):
            status, doc = run_cli_json(
                "snapshot", store, "c", str(path), "--step", str(step),
                "--gradient", f"r:mean@{step}", "--optimizer", "adamw",
            )  # fmt: skip
            assert status == 0, doc
            assert doc["replayed"] == (0 if step == 1 else 7), doc["skipped"]
    status, doc = run_cli_json("log", store, "c")
    rows = doc["snapshots"]
    assert rows[2]["gradient"] == "aggregate r:mean@3"
    assert rows[2]["encoding"]["replay"] > 0
    assert rows[2]["stored_bytes"] < rows[0]["stored_bytes"] / 5
    assert "replays aggregate r:mean@3" in run_cli("log", store, "c").out
    out = tmp_path / "back.pt"
    assert run_cli("restore", store, "c", "--step", "2", "-o", str(out)).status == 0
    want, _ = read_state_file(checkpoints[1])
    got, _ = read_state_file(out)
    for key, value in want["model"].items():
        assert got["model"][key].tobytes() == value.tobytes()
    for index, entry in want["optimizer"]["state"].items():
        for role, value in entry.items():
            assert (
                np.asarray(got["optimizer"]["state"][index][role]).tobytes()
                == np.asarray(value).tobytes()
            )


def test_a_workflow_snapshot_stage_replays_against_the_runs_aggregates(tmp_path: Path) -> None:
    _checkpoints(tmp_path)
    store = tmp_path / "store"
    gp.open_store(str(store), mode="w")
    workflow = tmp_path / "flow.yaml"
    workflow.write_text(
        f"""
version: 1
store: {store}
backoff: 0
stages:
  - ingest: {{pattern: "{tmp_path}/dumps/step={{step}}/peer={{peer}}.npz", run: r}}
  - aggregate: {{run: r, method: mean}}
  - snapshot:
      name: c
      pattern: "{tmp_path}/ckpt/step={{step}}.pt"
      gradient: "r:mean@{{step}}"
      optimizer: adamw
  - verify: {{}}
"""
    )
    with dask.config.set(SMALL):
        report = gp.run_workflow(str(workflow))
    assert report.exit_status == 0, report.summary()
    log = gp.snapshot_log(gp.open_store(str(store)), "c")
    assert [v.gradient for v in log] == ["", "aggregate r:mean@2", "aggregate r:mean@3"]
