"""``gp.apply_server_update``: server optimizer rounds from stored aggregates to snapshots."""

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
ROUNDS = [0, 1, 2]


@pytest.fixture(scope="module")
def sample(tmp_path_factory: pytest.TempPathFactory) -> SampleRun:
    return write_sample_run(tmp_path_factory.mktemp("sample"), SMALL)


@pytest.fixture
def store(sample: SampleRun, tmp_path: Path) -> gp.Store:
    store = gp.open_store(tmp_path / "store", mode="a")
    with dask.config.set({"gradpipe.chunk-bytes": "8 KiB"}):
        assert gp.ingest(store, sample.dump_pattern, run="r").ok
        assert gp.aggregate(store, run="r", method="fedavg").ok
    return store


def _initial(store: gp.Store) -> dict[str, np.ndarray]:
    shapes = {n: a.shape for n, a in _grads(store, 0).items()}
    rng = np.random.default_rng(7)
    return {n: rng.normal(size=s).astype(np.float32) for n, s in shapes.items()}


def _grads(store: gp.Store, step: int) -> dict[str, np.ndarray]:
    return gp.open_run(store, "r").aggregate("fedavg", step=step).read_all()


def _numpy_round(
    method: str, x: np.ndarray, g: np.ndarray, s: dict[str, np.ndarray], hp: dict[str, Any], t: int
) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """The formulas of Reddi et al. (and FedAvgM) in float64, written out again."""
    x64, g64 = x.astype(np.float64), g.astype(np.float64)
    lr = hp["lr"]
    if method == "sgd":
        return (x64 - lr * g64).astype(np.float32), {}
    if method == "fedavgm":
        u = hp["momentum"] * s["momentum"].astype(np.float64) + g64
        return (x64 - lr * u).astype(np.float32), {"momentum": u.astype(np.float32)}
    b1, b2, tau = hp["beta1"], hp["beta2"], hp["tau"]
    m = b1 * s["m"].astype(np.float64) + (1 - b1) * g64
    v = s["v"].astype(np.float64)
    if method == "fedadagrad":
        v = v + g64**2
    elif method == "fedadam":
        v = b2 * v + (1 - b2) * g64**2
    else:
        v = v - (1 - b2) * g64**2 * np.sign(v - g64**2)
    if hp.get("bias_correction"):
        lr = lr * np.sqrt(1 - b2**t) / (1 - b1**t)
    x_new = x64 - lr * m / (np.sqrt(v) + tau)
    return x_new.astype(np.float32), {"m": m.astype(np.float32), "v": v.astype(np.float32)}


CASES = [
    ("sgd", {}),
    ("fedavgm", {"momentum": 0.8}),
    ("fedadagrad", {}),
    ("fedadam", {}),
    ("fedadam", {"bias_correction": True, "beta1": 0.5}),
    ("fedyogi", {"tau": 1e-2}),
]


@pytest.mark.parametrize(("method", "extra"), CASES)
def test_three_rounds_match_server_step_and_the_formula(
    store: gp.Store, method: str, extra: dict[str, Any]
) -> None:
    params = _initial(store)
    gp.snapshot(store, "global", {"params": params}, step=0)
    config = ServerOptimizerConfig.from_dict({"method": method, "lr": 0.05, **extra})
    hp = config.to_dict()
    ours = dict(params)
    ours_state = {n: init_server_state(a, config) for n, a in params.items()}
    formula = dict(params)
    formula_state = {n: init_server_state(a, config) for n, a in params.items()}
    for t, step in enumerate(ROUNDS, start=1):
        sid = gp.apply_server_update(
            store, run="r", step=step, aggregate="fedavg", snapshot="global",
            optimizer=method, lr=0.05, **extra,
        )  # fmt: skip
        grads = _grads(store, step)
        for name, g in grads.items():
            ours[name], ours_state[name] = server_step(ours[name], g, ours_state[name], config, t=t)
            formula[name], formula_state[name] = _numpy_round(
                method, formula[name], g, formula_state[name], hp, t
            )
        state = gp.restore(store, "global")
        assert set(state) == {"params", "server_optimizer"}
        server = state["server_optimizer"]
        assert server["t"] == t
        assert server["config"] == hp
        assert set(server) == {"t", "config", *config.state_names}
        for name in params:
            got = state["params"][name]
            assert got.dtype == np.float32
            np.testing.assert_array_equal(got, ours[name], err_msg=f"{method} {name} t={t}")
            np.testing.assert_array_equal(got, formula[name])
            for k in config.state_names:
                np.testing.assert_array_equal(server[k][name], ours_state[name][k])
                np.testing.assert_array_equal(server[k][name], formula_state[name][k])
        info = gp.snapshot_log(store, "global")[-1]
        assert info.id == sid
        assert info.step == step
        view = gp.open_run(store, "r").aggregate("fedavg", step=step)
        assert info.metadata == {
            "run": "r",
            "aggregate": "fedavg",
            "aggregate_id": view.id,
            "server_optimizer": method,
        }
    assert len(gp.snapshot_log(store, "global")) == 1 + len(ROUNDS)
    assert not all(np.array_equal(ours[n], params[n]) for n in params)  # the steps moved them


def test_the_first_round_initialises_the_state(store: gp.Store) -> None:
    params = _initial(store)
    gp.snapshot(store, "g", {"params": params}, step=0)
    gp.apply_server_update(
        store, run="r", step=0, aggregate="fedavg", snapshot="g", optimizer="fedadam", lr=0.1
    )
    config = ServerOptimizerConfig.from_dict({"method": "fedadam", "lr": 0.1})
    server = gp.restore(store, "g")["server_optimizer"]
    grads = _grads(store, 0)
    for name, g in grads.items():  # from m = 0, v = tau**2
        want = init_server_state(params[name], config)
        np.testing.assert_array_equal(want["v"], np.float32(1e-6))
        _, after = server_step(params[name], g, want, config, t=1)
        np.testing.assert_array_equal(server["m"][name], after["m"])
        np.testing.assert_array_equal(server["v"][name], after["v"])


def _refused(store: gp.Store, name: str, match: str, **kw: Any) -> None:
    before = gp.snapshot_log(store, name)
    with pytest.raises(gp.InvalidInputError, match=match):
        gp.apply_server_update(store, run="r", step=1, aggregate="fedavg", snapshot=name, **kw)
    assert gp.snapshot_log(store, name) == before


def test_a_tensor_missing_from_the_params_is_refused(store: gp.Store) -> None:
    params = _initial(store)
    gone = sorted(params)[0]
    del params[gone]
    gp.snapshot(store, "g", {"params": params}, step=0)
    _refused(store, "g", f"tensor '{gone}'", lr=0.1)


def test_a_tensor_of_another_shape_is_refused(store: gp.Store) -> None:
    params = _initial(store)
    name = sorted(params)[-1]
    params[name] = np.zeros((*params[name].shape, 2), np.float32)
    gp.snapshot(store, "g", {"params": params}, step=0)
    _refused(store, "g", f"tensor '{name}' has shape", optimizer="fedyogi", lr=0.1)


def test_other_states_optimizers_and_hyperparameters_are_refused(store: gp.Store) -> None:
    gp.snapshot(store, "g", {"params": _initial(store)}, step=0)
    _refused(store, "g", "unknown optimizer 'adam'", optimizer="adam", lr=0.1)
    _refused(store, "g", "beta2", optimizer="fedadam", lr=0.1, beta2=1.5)
    gp.apply_server_update(
        store, run="r", step=0, aggregate="fedavg", snapshot="g", optimizer="fedavgm", lr=0.1
    )
    _refused(store, "g", "holds fedavgm state", optimizer="fedadam", lr=0.1)
    gp.snapshot(store, "other", {"params": _initial(store), "epoch": 3}, step=0)
    _refused(store, "other", "not a server state", lr=0.1)


def test_a_stored_state_of_another_shape_is_refused(store: gp.Store) -> None:
    params = _initial(store)
    config = ServerOptimizerConfig.from_dict({"method": "fedavgm", "lr": 0.1})
    name = sorted(params)[0]
    momentum = {n: np.zeros_like(a) for n, a in params.items()}
    momentum[name] = np.zeros(3, np.float32)
    server = {"momentum": momentum, "t": 1, "config": config.to_dict()}
    gp.snapshot(store, "g", {"params": params, "server_optimizer": server}, step=0)
    _refused(store, "g", f"tensor '{name}'.*needs state", optimizer="fedavgm", lr=0.1)
    del momentum[name]
    gp.snapshot(store, "g", {"params": params, "server_optimizer": server}, step=0)
    _refused(
        store,
        "g",
        "state 'momentum' must have one array per parameter",
        optimizer="fedavgm",
        lr=0.1,
    )


def test_parameters_without_an_update_are_carried_over_with_their_state(store: gp.Store) -> None:
    params = {**_initial(store), "extra.scale": np.arange(4, dtype=np.float32)}
    gp.snapshot(store, "g", {"params": params}, step=0)
    for step in (0, 1):
        gp.apply_server_update(
            store, run="r", step=step, aggregate="fedavg", snapshot="g", optimizer="fedyogi", lr=0.1
        )
    state = gp.restore(store, "g")
    np.testing.assert_array_equal(state["params"]["extra.scale"], params["extra.scale"])
    np.testing.assert_array_equal(state["server_optimizer"]["v"]["extra.scale"], np.float32(1e-6))
    assert state["server_optimizer"]["t"] == 2
