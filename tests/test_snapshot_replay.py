"""Snapshots written with optimizer replay (issue 21, design note 016): bit-exact reads
through chains of replays, the gradient kept and checked, prune/gc/verify, races."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import dask.config
import ml_dtypes
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import gradpipe as gp
import gradpipe.snapshots.replay_write as replay_write
import gradpipe.snapshots.save as save_module
import gradpipe.storage.replays as replays_module
from gradpipe.core.ids import block_key
from gradpipe.core.replay import OptimizerStep, replay, roles
from gradpipe.errors import IntegrityError, InvalidInputError, NotFoundError
from gradpipe.snapshots.api import find_snapshot
from gradpipe.snapshots.save import write_snapshot

SMALL = {"gradpipe.chunk-bytes": 4096, "gradpipe.inline-bytes": 0}
SHAPES = {"embed": (200, 12), "w": (12, 40), "b": (40,)}


@pytest.fixture(autouse=True)
def _fresh_caches() -> Iterator[None]:
    replay_write._PREVIOUS.clear()
    save_module._KEYFRAMES.clear()
    yield
    replay_write._PREVIOUS.clear()
    save_module._KEYFRAMES.clear()


class Trainer:
    """A numpy "training run" shaped like torch's: model + optimizer state, one step at a time.

    ``noise`` perturbs the applied update in a few elements each step (a trainer whose
    arithmetic differs from the predictor's), so residuals are not all zero.
    """

    def __init__(
        self,
        kind: str = "adamw",
        dtype: Any = np.float32,
        *,
        seed: int = 0,
        noise: bool = False,
        shapes: dict[str, tuple[int, ...]] = SHAPES,
        hyper: dict[str, Any] | None = None,
    ) -> None:
        self.rng = np.random.default_rng(seed)
        self.kind, self.dtype, self.noise = kind, np.dtype(dtype), noise
        self.names = list(shapes)
        self.shapes = shapes
        self.params = {k: self.rng.standard_normal(s).astype(self.dtype) for k, s in shapes.items()}
        self.hyper = hyper or {}
        self.state: dict[str, dict[str, np.ndarray]] = {k: {} for k in self.names}
        self.t = 0
        self.lr = 1e-2

    def step(
        self, grads: dict[str, np.ndarray] | None = None, *, frozen: tuple[str, ...] = ()
    ) -> dict[str, np.ndarray]:
        """One step; ``frozen`` parameters are skipped (no gradient, as torch skips them)."""
        self.t += 1
        if grads is None:
            grads = {
                k: (self.rng.standard_normal(s) * 0.1).astype(self.dtype)
                for k, s in self.shapes.items()
            }
        step = OptimizerStep(cast(Any, self.kind), lr=self.lr, step=self.t, **self.hyper)
        for k in self.names:
            if k in frozen:
                continue
            before = {"param": self.params[k], **self.state[k]}
            if self.kind != "sgd" and self.t == 1:
                before.update(
                    {r: np.zeros_like(self.params[k]) for r in roles(step) if r != "param"}
                )
            out = replay(step, before, grads[k])
            if self.noise:
                flat = out["param"].reshape(-1)
                hit = self.rng.integers(0, flat.size, 3)
                flat[hit] = (flat[hit].astype(np.float64) * (1 + 1e-3)).astype(self.dtype)
            self.params[k] = out.pop("param")
            self.state[k] = out
        return grads

    def snapshot_state(self) -> dict[str, Any]:
        group = {
            "lr": self.lr,
            "params": list(range(len(self.names))),
            "weight_decay": self.hyper.get("weight_decay", 0.0),
            "maximize": self.hyper.get("maximize", False),
        }
        if self.kind == "sgd":
            group.update(
                momentum=self.hyper.get("momentum", 0.0),
                dampening=self.hyper.get("dampening", 0.0),
                nesterov=self.hyper.get("nesterov", False),
            )
        else:
            group.update(
                betas=(self.hyper.get("beta1", 0.9), self.hyper.get("beta2", 0.999)),
                eps=self.hyper.get("eps", 1e-8),
                amsgrad=self.hyper.get("amsgrad", False),
            )
        per_param = {}
        for i, k in enumerate(self.names):
            entry: dict[str, Any] = {r: v.copy() for r, v in self.state[k].items()}
            if self.kind != "sgd":
                entry["step"] = np.float32(self.t)
            per_param[i] = entry
        return {
            "model": {k: v.copy() for k, v in self.params.items()},
            "optimizer": {"state": per_param, "param_groups": [group]},
            "epoch": 3,
        }


def bits_equal(a: Any, b: Any) -> bool:
    if isinstance(a, np.ndarray):
        return (
            isinstance(b, np.ndarray)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and a.tobytes() == b.tobytes()
        )
    if isinstance(a, dict):
        return (
            isinstance(b, dict) and a.keys() == b.keys() and all(bits_equal(a[k], b[k]) for k in a)
        )
    if isinstance(a, list | tuple):
        return type(a) is type(b) and len(a) == len(b) and all(map(bits_equal, a, b))
    if isinstance(a, np.generic):
        return type(a) is type(b) and a.tobytes() == b.tobytes()
    return bool(type(a) is type(b) and a == b)


def run_chain(
    store: gp.Store, trainer: Trainer, steps: int, *, interval: int = 4, name: str = "run"
) -> dict[int, dict[str, Any]]:
    saved = {}
    for _ in range(steps):
        grads = trainer.step()
        state = trainer.snapshot_state()
        write_snapshot(
            store,
            name,
            state,
            step=trainer.t,
            gradient=grads,
            optimizer=trainer.kind,
            replay_interval=interval,
        )
        saved[trainer.t] = state
    return saved


def test_an_exact_replay_stores_nothing_and_every_version_reads_back(tmp_path: Path) -> None:
    store = gp.open_store(tmp_path / "s", mode="w")
    with dask.config.set(SMALL):
        saved = run_chain(store, Trainer(), 6)
    log = gp.snapshot_log(store, "run")
    assert log[0].stored_bytes > 0  # the first version has no previous: stored whole
    assert [v.stored_bytes for v in log[1:4]] == [0, 0, 0]  # an exact prediction: no block
    assert log[4].stored_bytes > 0  # depth 4 reached the interval: self-contained again
    _, head = find_snapshot(store, "run")
    assert head.replay is not None
    assert head.replay_depth == 1
    for step, state in saved.items():
        assert bits_equal(gp.restore(store, "run", step=step), state), step
    together = gp.restore_steps(store, "run", list(saved))
    assert all(bits_equal(together[s], saved[s]) for s in saved)
    part = gp.restore(store, "run", step=4, keys=["model"])
    assert bits_equal(part, {"model": saved[4]["model"]})
    assert gp.verify(store).ok


def test_residuals_make_an_imperfect_prediction_exact(tmp_path: Path) -> None:
    store = gp.open_store(tmp_path / "s", mode="w")
    with dask.config.set(SMALL):
        saved = run_chain(store, Trainer(noise=True), 5)
    log = gp.snapshot_log(store, "run")
    assert all(0 < v.stored_bytes < v.full_bytes / 4 for v in log[1:4])
    assert log[4].stored_bytes == log[4].full_bytes  # the interval: self-contained again
    for step, state in saved.items():
        assert bits_equal(gp.restore(store, "run", step=step), state)


@settings(
    max_examples=12,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(
    kind=st.sampled_from(["adam", "adamw", "sgd"]),
    dtype=st.sampled_from([np.float32, ml_dtypes.bfloat16, np.float16]),
    interval=st.sampled_from([1, 2, 4]),
    seed=st.integers(0, 2**16),
    special=st.sampled_from(["none", "nan", "inf", "zero"]),
    lrs=st.lists(st.floats(1e-4, 1e-1), min_size=4, max_size=4),
    weight_decay=st.sampled_from([0.0, 0.01]),
    momentum=st.sampled_from([0.0, 0.9]),
    amsgrad=st.booleans(),
    with_gradient=st.booleans(),
)
def test_replay_chains_are_bit_exact(
    tmp_path_factory: pytest.TempPathFactory,
    kind: str,
    dtype: Any,
    interval: int,
    seed: int,
    special: str,
    lrs: list[float],
    weight_decay: float,
    momentum: float,
    amsgrad: bool,
    with_gradient: bool,
) -> None:
    replay_write._PREVIOUS.clear()
    hyper: dict[str, Any] = {"weight_decay": weight_decay}
    if kind == "sgd":
        hyper["momentum"] = momentum
    else:
        hyper["amsgrad"] = amsgrad
    trainer = Trainer(kind, dtype, seed=seed, noise=seed % 2 == 1, hyper=hyper)
    store = gp.open_store(tmp_path_factory.mktemp("s"), mode="w")
    saved = {}
    with dask.config.set(SMALL):
        for lr in lrs:
            trainer.lr = lr  # a schedule: each step its own learning rate
            grads = {
                k: (trainer.rng.standard_normal(s) * 0.1).astype(trainer.dtype)
                for k, s in SHAPES.items()
            }
            if special == "nan":
                grads["w"].reshape(-1)[::7] = np.nan
            elif special == "inf":
                grads["b"][::3] = np.inf
            elif special == "zero":
                grads["embed"][:] = 0
            trainer.step(grads)
            state = trainer.snapshot_state()
            write_snapshot(
                store,
                "run",
                state,
                step=trainer.t,
                gradient=grads if with_gradient else None,  # None: the moments' decay
                optimizer=kind,
                replay_interval=interval,
            )
            saved[trainer.t] = state
    replay_write._PREVIOUS.clear()
    together = gp.restore_steps(store, "run", list(saved))
    for step, state in saved.items():
        assert bits_equal(together[step], state), step


def test_a_version_read_back_in_another_process_replays_the_same(tmp_path: Path) -> None:
    """No cached values (another process, or an evicted cache): the writer reads the
    previous version back through its replays and predicts the same."""
    store = gp.open_store(tmp_path / "s", mode="w")
    trainer = Trainer(noise=True)
    saved = {}
    with dask.config.set(SMALL):
        for _ in range(5):
            replay_write._PREVIOUS.clear()
            saved.update(run_chain(store, trainer, 1, interval=8))
    assert [v.stored_bytes < v.full_bytes / 4 for v in gp.snapshot_log(store, "run")][1:] == [
        True
    ] * 4
    for step, state in saved.items():
        assert bits_equal(gp.restore(store, "run", step=step), state)


def test_a_flat_state_with_groups_restores_to_a_file(tmp_path: Path) -> None:
    """``optimizer=`` as groups names any state's arrays; `gradpipe restore` writes the file."""
    from gradpipe.cli.testing import run_cli
    from gradpipe.formats.safetensors import read_safetensors

    store = gp.open_store(tmp_path / "s", mode="w")
    trainer = Trainer(shapes={"w": (50, 30)}, noise=True)
    with dask.config.set(SMALL):
        for _ in range(3):
            grads = trainer.step()
            flat = {
                "w": trainer.params["w"].copy(),
                "w.m": trainer.state["w"]["exp_avg"].copy(),
                "w.v": trainer.state["w"]["exp_avg_sq"].copy(),
            }
            step = OptimizerStep("adamw", lr=trainer.lr, step=trainer.t)
            groups = [
                {
                    "step": step,
                    "params": {"w": {"param": "w", "exp_avg": "w.m", "exp_avg_sq": "w.v"}},
                }
            ]
            done = write_snapshot(
                store, "run", flat, step=trainer.t, gradient=grads, optimizer=groups
            )
    assert done.replayed == 1
    out = tmp_path / "back.safetensors"
    outcome = run_cli("restore", str(tmp_path / "s"), "run", "-o", str(out))
    assert outcome.status == 0, outcome.err
    back, _ = read_safetensors(out)
    assert all(back[k].tobytes() == flat[k].tobytes() for k in flat)


def test_a_drifted_prediction_is_an_error_naming_the_chunk(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = gp.open_store(tmp_path / "s", mode="w")
    with dask.config.set(SMALL):
        run_chain(store, Trainer(), 3)
    real = replays_module.predict_chunk

    def off_by_one_ulp(*args: Any, **kwargs: Any) -> np.ndarray:
        out = real(*args, **kwargs).copy()
        out.view(f"u{out.itemsize}")[0] += 1
        return out

    monkeypatch.setattr(replays_module, "predict_chunk", off_by_one_ulp)
    drift = r"step \d, '[^']+', chunk \d+: the optimizer replay predicts other values"
    with pytest.raises(IntegrityError, match=drift):
        gp.restore(store, "run")
    report = gp.verify(store)
    assert {p.kind for p in report.problems} == {"drifted prediction"}
    assert "step 3" in report.problems[0].context


def test_generic_readers_refuse_a_replayed_tensor(tmp_path: Path) -> None:
    store = gp.open_store(tmp_path / "s", mode="w")
    with dask.config.set(SMALL):
        run_chain(store, Trainer(), 2)
    _, head = find_snapshot(store, "run")
    tensor = head.embedded[head.tensors["model.w"]]
    assert tensor.replays
    assert not tensor.self_contained
    with pytest.raises(InvalidInputError, match=r"chunk \d+ is stored as an optimizer replay"):
        store.read_tensor(tensor, context="model.w")
    from gradpipe.graph.arrays import lazy_tensor

    with pytest.raises(InvalidInputError, match="optimizer replay"):
        lazy_tensor(store, tensor, name="model.w")


def test_the_format_is_5_and_older_versions_keep_their_bytes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from gradpipe.core import manifest as manifest_module
    from gradpipe.core.manifest import encode_manifest
    from gradpipe.core.snapshot_manifest import SnapshotManifest
    from gradpipe.errors import UnsupportedFormatError

    store = gp.open_store(tmp_path / "s", mode="w")
    with dask.config.set(SMALL):
        run_chain(store, Trainer(), 2)
        gp.snapshot(store, "plain", {"w": np.arange(5000, dtype=np.float32)}, step=1)
    _plain_id, plain = find_snapshot(store, "plain")
    text = encode_manifest(plain)
    assert b'"replay' not in text
    assert b'"format":3' in text.replace(b" ", b"")
    head_id, head = find_snapshot(store, "run")
    assert b'"format":5' in encode_manifest(head).replace(b" ", b"")
    again = SnapshotManifest.from_dict(head.to_dict())
    assert again.replay == head.replay
    assert head.replay is not None
    assert head.replay.gradient.recorded  # embedded, outside the state
    assert set(head.gradient_tensors) <= set(head.embedded)
    assert not set(head.gradient_tensors) & set(head.tensors.values())
    for tensor in head.embedded.values():
        predicted = {link.predicted for link in tensor.replays.values()}
        assert not predicted & set(tensor.data_children()) - {
            link.block for link in tensor.replays.values()
        }
    monkeypatch.setattr(manifest_module, "FORMAT_VERSION", 4)
    with pytest.raises(UnsupportedFormatError):
        store.get_typed(head_id, SnapshotManifest)


def test_prune_keeps_what_a_kept_replay_reads_and_gc_keeps_the_rest_exact(
    tmp_path: Path,
) -> None:
    store = gp.open_store(tmp_path / "s", mode="w")
    with dask.config.set(SMALL):
        saved = run_chain(store, Trainer(noise=True), 7, interval=4)
    report = gp.prune(store, "run", keep_last=1)
    # Step 7 is at depth 2 (step 5 was self-contained again): it reads 6 and 5.
    assert report.kept_for_replay == [5, 6]
    assert "replay through them" in report.summary()
    assert [v.step for v in gp.snapshot_log(store, "run")] == [5, 6, 7]
    gp.gc(store, grace=0)
    for step in (5, 6, 7):
        assert bits_equal(gp.restore(store, "run", step=step), saved[step])
    assert gp.verify(store).ok


def _dump_run(root: Path, trainer: Trainer, steps: int) -> dict[int, dict[str, np.ndarray]]:
    """Two peers' gradient dumps per step (npz), named by parameter; the first peer's."""
    return {step: peers[0] for step, peers in _dump_run_peers(root, trainer, steps).items()}


def test_an_aggregate_as_the_gradient_is_kept_checked_and_named_when_lost(
    tmp_path: Path,
) -> None:
    trainer = Trainer(noise=True)
    _dump_run(tmp_path / "dumps", trainer, 3)
    store = gp.open_store(tmp_path / "s", mode="w")
    saved = {}
    with dask.config.set(SMALL):
        assert gp.ingest(store, str(tmp_path / "dumps/step={step}/peer={peer}.npz"), run="r").ok
        gp.aggregate(store, run="r", method="mean")
        run = gp.open_run(store, "r")
        for step in (1, 2, 3):
            aggregate = run.aggregate("mean", step=step)
            applied = {k: np.asarray(aggregate.read(k)) for k in trainer.names}
            trainer.step(applied)
            state = trainer.snapshot_state()
            done = write_snapshot(
                store, "run", state, step=step, gradient=f"r:mean@{step}", optimizer="adamw"
            )
            saved[step] = state
            assert done.replayed == (3 if step > 1 else 0), done.skipped
    _, head = find_snapshot(store, "run")
    assert head.replay is not None
    assert head.replay.gradient.aggregate == aggregate.id
    assert "r:mean@3" in head.replay.gradient.describe()
    # gc keeps the gradient a kept version needs, even without its run.
    store.refs.set("runs/r", None)
    gp.gc(store, grace=0)
    for step, state in saved.items():
        assert bits_equal(gp.restore(store, "run", step=step), state)
    assert gp.verify(store).ok
    # A gradient block lost: verify names the snapshot; restore names the gradient.
    tensor = aggregate.manifest.embedded[dict(aggregate.manifest.tensors)["w"]]
    lost = next(b for b in tensor.blocks if b is not None and not tensor.inline)
    store.backend.delete_many([block_key(lost)])
    report = gp.verify(store)
    kinds = {(p.kind, p.id) for p in report.problems}
    assert ("missing", lost) in kinds
    assert any(p.kind == "bad replay" and "step 3" in p.context for p in report.problems)
    with pytest.raises(NotFoundError, match=r"step 3.*gradient 'w'"):
        gp.restore(store, "run", step=3)


def test_a_version_saved_without_a_gradient_is_self_contained(tmp_path: Path) -> None:
    store = gp.open_store(tmp_path / "s", mode="w")
    trainer = Trainer()
    with dask.config.set(SMALL):
        saved = run_chain(store, trainer, 2)
        same = trainer.snapshot_state()  # the same state at a new step, no gradient given
        gp.snapshot(store, "run", same, step=3)
    _, head = find_snapshot(store, "run")
    assert head.replay is None
    assert not head.needs_previous
    assert bits_equal(gp.restore(store, "run", step=3), same)
    assert bits_equal(gp.restore(store, "run", step=2), saved[2])
    assert gp.prune(store, "run", keep_last=1).kept_for_replay == []


def test_a_frozen_parameter_reads_through_the_previous_version(tmp_path: Path) -> None:
    """A parameter the step skipped equals its replayed chunks before: a 'previous' link."""
    store = gp.open_store(tmp_path / "s", mode="w")
    trainer = Trainer()
    with dask.config.set(SMALL):
        saved = run_chain(store, trainer, 2, interval=8)
        grads = trainer.step(frozen=("b",))
        state = trainer.snapshot_state()
        write_snapshot(
            store, "run", state, step=3, gradient=grads, optimizer="adamw", replay_interval=8
        )
    _, head = find_snapshot(store, "run")
    b = head.embedded[head.tensors["model.b"]]
    assert {link.source for link in b.replays.values()} == {"previous"}
    assert head.replay_depth == 2
    assert bits_equal(gp.restore(store, "run", step=3), state)
    assert bits_equal(gp.restore(store, "run", step=2), saved[2])
    assert gp.verify(store).ok


def test_bad_replay_requests_are_refused(tmp_path: Path) -> None:
    store = gp.open_store(tmp_path / "s", mode="w")
    trainer = Trainer()
    grads = trainer.step()
    state = trainer.snapshot_state()
    with pytest.raises(InvalidInputError, match=r"needs optimizer= .* with gradient="):
        gp.snapshot(store, "run", state, step=1, gradient=grads)
    with pytest.raises(InvalidInputError, match="RUN:AGGREGATE@STEP"):
        gp.snapshot(store, "run", state, step=1, gradient="nope", optimizer="adam")
    with pytest.raises(InvalidInputError, match="replay interval"):
        gp.snapshot(
            store, "run", state, step=1, gradient=grads, optimizer="adam", replay_interval=0
        )
    with pytest.raises(InvalidInputError, match="not replayed"):
        gp.snapshot(store, "run", state, step=1, gradient=grads, optimizer="lion")


def test_parameters_that_do_not_match_are_written_without_replay(tmp_path: Path) -> None:
    store = gp.open_store(tmp_path / "s", mode="w")
    trainer = Trainer()
    with dask.config.set(SMALL):
        run_chain(store, trainer, 1)
        grads = trainer.step()
        grads["w"] = grads["w"].T.copy()  # the wrong shape: w is not replayed
        del grads["b"]  # no gradient: b is not replayed
        state = trainer.snapshot_state()
        done = write_snapshot(store, "run", state, step=2, gradient=grads, optimizer="adamw")
    assert done.replayed == 1
    assert set(done.skipped) == {"w", "b"}
    assert "shape" in done.skipped["w"]
    assert "no tensor" in done.skipped["b"]
    assert bits_equal(gp.restore(store, "run"), state)


def test_two_writers_racing_both_land_and_read_back_exactly(tmp_path: Path) -> None:
    store = gp.open_store(tmp_path / "s", mode="w")
    trainer = Trainer(noise=True)
    with dask.config.set(SMALL):
        run_chain(store, trainer, 2)
        states = []
        for _ in range(2):
            grads = trainer.step()
            states.append((trainer.t, trainer.snapshot_state(), grads))
        errors: list[BaseException] = []

        def write(step: int, state: dict[str, Any], grads: dict[str, np.ndarray]) -> None:
            try:
                write_snapshot(store, "run", state, step=step, gradient=grads, optimizer="adamw")
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=write, args=s) for s in states]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert not errors
    log = gp.snapshot_log(store, "run")
    assert len(log) == 4
    for version in log:
        expected = next((s for step, s, _ in states if step == version.step), None)
        got = gp.restore(store, "run", step=version.step)
        if expected is not None:
            assert bits_equal(got, expected)
    assert gp.verify(store).ok


def test_xarray_reads_a_chain_of_replay_versions(tmp_path: Path) -> None:
    xr = pytest.importorskip("xarray")
    store = gp.open_store(tmp_path / "s", mode="w")
    with dask.config.set(SMALL):
        saved = run_chain(store, Trainer(noise=True), 4)
    ds = xr.open_dataset(str(tmp_path / "s"), engine="gradpipe", kind="snapshot", name="run")
    w = ds["model.w"] if "model.w" in ds else ds[next(v for v in ds.data_vars if v.endswith("w"))]
    for version, step in enumerate(sorted(saved)):
        assert w.isel(version=version).values.tobytes() == saved[step]["model"]["w"].tobytes()
    assert w.isel(version=3, **{w.dims[1]: slice(2, 5)}).values.tobytes() == (
        saved[4]["model"]["w"][2:5].tobytes()
    )


def test_the_dumps_of_a_step_as_the_gradient(tmp_path: Path) -> None:
    """``gradient="RUN@STEP"``: the step's dumps, averaged (sum, then divided) in peer order."""
    trainer = Trainer()
    per_step = _dump_run_peers(tmp_path / "dumps", trainer, 3)
    store = gp.open_store(tmp_path / "s", mode="w")
    saved = {}
    with dask.config.set(SMALL):
        assert gp.ingest(store, str(tmp_path / "dumps/step={step}/peer={peer}.npz"), run="r").ok
        for step in (1, 2, 3):
            peers = per_step[step]
            applied = {k: (peers[0][k] + peers[1][k]) / np.float32(2) for k in trainer.names}
            trainer.step(applied)
            state = trainer.snapshot_state()
            write_snapshot(store, "run", state, step=step, gradient=f"r@{step}", optimizer="adamw")
            saved[step] = state
    log = gp.snapshot_log(store, "run")
    assert log[2].gradient == "dumps r@3 (2 peers, sum-then-scale)"
    assert log[1].stored_bytes == log[2].stored_bytes == 0  # the trainer's mean: exact
    _, head = find_snapshot(store, "run")
    assert head.replay is not None
    assert set(head.manifest_children()) >= {d for _, d in head.replay.gradient.dumps}
    store.refs.set("runs/r", None)
    gp.gc(store, grace=0)  # the dumps stay: the snapshots need them
    for step, state in saved.items():
        assert bits_equal(gp.restore(store, "run", step=step), state)
    assert gp.verify(store).ok


def _dump_run_peers(
    root: Path, trainer: Trainer, steps: int
) -> dict[int, list[dict[str, np.ndarray]]]:
    """Two peers' gradient dumps per step (npz), named by parameter; each step's, by peer."""
    out = {}
    for step in range(1, steps + 1):
        per_peer = []
        for peer in ("p0", "p1"):
            g = {
                k: (trainer.rng.standard_normal(s) * 0.1).astype(np.float32)
                for k, s in trainer.shapes.items()
            }
            path = root / f"step={step}" / f"peer={peer}.npz"
            path.parent.mkdir(parents=True, exist_ok=True)
            np.savez(path, **cast(dict[str, Any], g))
            per_peer.append(g)
        out[step] = per_peer
    return out


def test_replay_refuses_a_lossy_delta_and_a_too_deep_interval(tmp_path: Path) -> None:
    store = gp.open_store(tmp_path / "s", mode="w")
    trainer = Trainer()
    grads = trainer.step()
    state = trainer.snapshot_state()
    with pytest.raises(InvalidInputError, match="sparse"):
        gp.snapshot(store, "run", state, step=1, gradient=grads, optimizer="adam", delta="sparse")
    with pytest.raises(InvalidInputError, match=r"replay interval must be an integer in \[1, 64\]"):
        gp.snapshot(
            store, "run", state, step=1, gradient=grads, optimizer="adam", replay_interval=65
        )


def test_arrays_named_by_two_parameters_are_not_replayed(tmp_path: Path) -> None:
    store = gp.open_store(tmp_path / "s", mode="w")
    trainer = Trainer(shapes={"w": (40, 30), "u": (40, 30)})
    for step in (1, 2):
        grads = trainer.step()
        state = {"w": trainer.params["w"], "u": trainer.params["u"], "m": trainer.state["w"][
            "exp_avg"], "v": trainer.state["w"]["exp_avg_sq"]}  # fmt: skip
        adam = OptimizerStep("adamw", lr=trainer.lr, step=step)
        groups = [
            {"step": adam, "params": {
                "w": {"param": "w", "exp_avg": "m", "exp_avg_sq": "v"},
                "u": {"param": "u", "exp_avg": "m", "exp_avg_sq": "v"},
            }},
        ]  # fmt: skip
        done = write_snapshot(store, "run", state, step=step, gradient=grads, optimizer=groups)
    assert done.replayed == 1
    assert "another parameter's" in done.skipped["u"]
    assert bits_equal(gp.restore(store, "run"), state)


def test_the_replay_cache_stays_within_one_budget_per_process(tmp_path: Path) -> None:
    store = gp.open_store(tmp_path / "s", mode="w")
    budget = 60_000
    with dask.config.set({**SMALL, "gradpipe.snapshot-cache-bytes": budget}):
        for name in ("a", "b", "c", "d"):
            run_chain(store, Trainer(shapes={"w": (40, 100)}), 2, name=name)
    held = replay_write._PREVIOUS.held_bytes() + save_module._KEYFRAMES.held_bytes()
    assert 0 < held <= budget


def test_a_lost_dump_is_reported_without_false_drift(tmp_path: Path) -> None:
    trainer = Trainer()
    _dump_run_peers(tmp_path / "dumps", trainer, 3)
    store = gp.open_store(tmp_path / "s", mode="w")
    with dask.config.set(SMALL):
        assert gp.ingest(store, str(tmp_path / "dumps/step={step}/peer={peer}.npz"), run="r").ok
        for step in (1, 2, 3):
            trainer.step()
            state = trainer.snapshot_state()
            write_snapshot(store, "run", state, step=step, gradient=f"r@{step}", optimizer="adamw")
    _, head = find_snapshot(store, "run")
    assert head.replay is not None
    _, lost = head.replay.gradient.dumps[1]
    store.backend.delete_many([block_key(lost)])
    report = gp.verify(store)
    kinds = {p.kind for p in report.problems}
    assert "drifted prediction" not in kinds
    assert "bad replay" in kinds
    with pytest.raises(NotFoundError, match="which is not in the store"):
        gp.restore(store, "run", step=3)


def test_xarray_reads_a_replayed_array_whole_once_a_version(tmp_path: Path) -> None:
    xr = pytest.importorskip("xarray")
    store = gp.open_store(tmp_path / "s", mode="w")
    with dask.config.set(SMALL):
        run_chain(store, Trainer(), 3)
    ds = xr.open_dataset(str(tmp_path / "s"), engine="gradpipe", kind="snapshot", name="run")
    w = ds["model.w"]
    chunks = w.encoding["preferred_chunks"]
    assert [chunks[d] for d in w.dims[1:]] == list(w.shape[1:])  # read whole, once a version


def test_without_a_gradient_the_moments_are_stored_against_their_decay(tmp_path: Path) -> None:
    """``optimizer=`` alone: each moment chunk against ``beta * previous`` where that is the
    smallest, else as before; never larger than the chain without it."""
    saved = {}
    sizes = {}
    for mode in ("plain", "decay"):
        store = gp.open_store(tmp_path / mode, mode="w")
        trainer = Trainer(shapes={"w": (256, 256), "b": (256,)}, noise=True)
        with dask.config.set({**SMALL, "gradpipe.chunk-bytes": 65536}):
            for _ in range(5):
                trainer.step()
                state = trainer.snapshot_state()
                optimizer = "adamw" if mode == "decay" else None
                write_snapshot(store, "run", state, step=trainer.t, optimizer=optimizer)
                saved[mode, trainer.t] = state
        log = gp.snapshot_log(store, "run")
        sizes[mode] = sum(v.stored_bytes for v in log)
        if mode == "decay":
            assert log[2].gradient == "moments' decay (no gradient)"
            assert log[2].encoding["replay"] > 0
            _, head = find_snapshot(store, "run")
            links = [link.source for t in head.embedded.values() for link in t.replays.values()]
            assert set(links) <= {"decay", "previous"}
            assert gp.prune(store, "run", keep_last=1).kept_for_replay == [1, 2, 3, 4]
        for step in range(1, 6):
            assert bits_equal(gp.restore(store, "run", step=step), saved[mode, step])
        assert gp.verify(store).ok
    assert sizes["decay"] < sizes["plain"]


@pytest.mark.parametrize("mode", ["frozen", "decay"])
def test_every_kth_version_is_self_contained_so_prune_frees_the_rest(
    tmp_path: Path, mode: str
) -> None:
    """One depth per version: a parameter frozen for a step, or a decay residual that lost to
    a delta, must not put the chunks out of step (prune would then keep the whole chain)."""
    store = gp.open_store(tmp_path / "s", mode="w")
    trainer = Trainer(noise=True)
    saved = {}
    with dask.config.set(SMALL):
        for _ in range(12):
            grads = trainer.step(frozen=("b",) if trainer.t + 1 == 2 else ())
            state = trainer.snapshot_state()
            gradient = grads if mode == "frozen" else None
            write_snapshot(
                store, "run", state, step=trainer.t, gradient=gradient, optimizer="adamw",
                replay_interval=4,
            )  # fmt: skip
            saved[trainer.t] = state
    depths = [v.replay_depth for v in gp.snapshot_log(store, "run")]
    assert max(depths) <= 3
    report = gp.prune(store, "run", keep_last=1)
    assert len(report.kept_steps) <= 4
    assert len(report.dropped_steps) >= 8
    gp.gc(store, grace=0)
    for step in report.kept_steps:
        assert bits_equal(gp.restore(store, "run", step=step), saved[step])
    assert gp.verify(store).ok
