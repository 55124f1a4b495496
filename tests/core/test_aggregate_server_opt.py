"""Server optimizers: float64 references written from Reddi et al., and Flower's strategies."""

from __future__ import annotations

import logging

import numpy as np
import pytest

from gradpipe.aggregation.server_opt import (
    ServerOptimizer,
    ServerOptimizerConfig,
    init_server_state,
    server_step,
)
from gradpipe.errors import InvalidInputError

ROUNDS = 5


def _grads(size: int = 40, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(size).astype(np.float32) * 0.1 for _ in range(ROUNDS)]


def _run(config: ServerOptimizerConfig, x0: np.ndarray, grads: list[np.ndarray]) -> np.ndarray:
    x, state = x0, init_server_state(x0, config)
    for t, g in enumerate(grads, start=1):
        x, state = server_step(x, g, state, config, t=t)
    return x


def _reference(method: str, x0: np.ndarray, grads: list[np.ndarray], **hp: float) -> np.ndarray:
    """Reddi et al. 2021, Algorithm 2 (and FedAvgM, SGD), written out in float64."""
    x = x0.astype(np.float64)
    m = np.zeros_like(x)
    v = np.full_like(x, hp["tau"] ** 2)
    u = np.zeros_like(x)
    for g32 in grads:
        g = g32.astype(np.float64)
        if method == "sgd":
            x = x - hp["lr"] * g
            continue
        if method == "fedavgm":
            u = hp["momentum"] * u + g
            x = x - hp["lr"] * u
            continue
        m = hp["beta1"] * m + (1 - hp["beta1"]) * g
        if method == "fedadagrad":
            v = v + g**2
        elif method == "fedadam":
            v = hp["beta2"] * v + (1 - hp["beta2"]) * g**2
        else:
            v = v - (1 - hp["beta2"]) * g**2 * np.sign(v - g**2)
        x = x - hp["lr"] * m / (np.sqrt(v) + hp["tau"])
    return x


@pytest.mark.parametrize("method", [m.value for m in ServerOptimizer])
def test_each_optimizer_matches_the_paper(method: str) -> None:
    hp = {"lr": 0.05, "momentum": 0.8, "beta1": 0.9, "beta2": 0.99, "tau": 1e-3}
    config = ServerOptimizerConfig(ServerOptimizer(method), **hp)
    x0 = np.linspace(-1, 1, 40, dtype=np.float32)
    grads = _grads()
    ours = _run(config, x0, grads)
    ref = _reference(method, x0, grads, **hp)
    # state kept in float32 between rounds: each round rounds m, v (and x) once, relative
    # ε32; over 5 rounds the parameters stay within a few float32 ulps of the float64 path.
    assert ours.dtype == np.float32
    assert np.allclose(ours, ref, rtol=0, atol=16 * np.finfo(np.float32).eps)


def test_sgd_is_the_seeds_apply_gradient() -> None:
    config = ServerOptimizerConfig("sgd", lr=0.1)  # type: ignore[arg-type]
    new, state = server_step(
        np.array([1.0, 2.0, 3.0], np.float32),
        np.array([0.5, 1.0, 1.5], np.float32),
        {},
        config,
    )
    assert state == {}
    assert np.allclose(new, [0.95, 1.90, 2.85], atol=1e-6)


def _flower(strategy_name: str, x0: np.ndarray, grads: list[np.ndarray], **kw: float) -> np.ndarray:
    from flwr.common import Code, FitRes, Status, ndarrays_to_parameters, parameters_to_ndarrays
    from flwr.server import strategy

    logging.getLogger("flwr").setLevel(logging.ERROR)
    cls = getattr(strategy, strategy_name)
    strat = cls(initial_parameters=ndarrays_to_parameters([x0]), **kw)
    x = x0
    for r, g in enumerate(grads, start=1):
        client = (x.astype(np.float64) - g).astype(np.float32)  # the peers' average model
        fit = FitRes(Status(Code.OK, ""), ndarrays_to_parameters([client]), 10, {})
        params, _ = strat.aggregate_fit(r, [(None, fit)], [])
        (x,) = parameters_to_ndarrays(params)
    return x


@pytest.mark.parametrize(
    ("name", "config", "flower_kw", "round_offset"),
    [
        (
            "FedAvgM",
            ServerOptimizerConfig("fedavgm", lr=0.5, momentum=0.9),
            {"server_learning_rate": 0.5, "server_momentum": 0.9},
            0,
        ),  # type: ignore[arg-type]
        (
            "FedAdagrad",
            ServerOptimizerConfig(
                "fedadagrad", lr=0.1, beta1=0.0, tau=1e-3, initial_accumulator=0.0
            ),
            {"eta": 0.1, "tau": 1e-3},
            0,
        ),  # type: ignore[arg-type]
        (
            "FedAdam",
            ServerOptimizerConfig(
                "fedadam", lr=0.1, tau=1e-3, initial_accumulator=0.0, bias_correction=True
            ),
            {"eta": 0.1, "tau": 1e-3, "beta_1": 0.9, "beta_2": 0.99},
            1,
        ),  # type: ignore[arg-type]
        (
            "FedYogi",
            ServerOptimizerConfig("fedyogi", lr=0.01, tau=1e-3, initial_accumulator=0.0),
            {"eta": 0.01, "tau": 1e-3},
            0,
        ),  # type: ignore[arg-type]
    ],
)
def test_optimizers_match_flower_with_its_conventions(
    name: str, config: ServerOptimizerConfig, flower_kw: dict[str, float], round_offset: int
) -> None:
    pytest.importorskip("flwr")
    x0 = np.linspace(-1, 1, 40, dtype=np.float32)
    grads = _grads(seed=1)
    x, state = x0, init_server_state(x0, config)
    for r, g in enumerate(grads, start=1):
        # Flower's peers send models: the pseudo-gradient is params - average model, in float32
        client = (x.astype(np.float64) - g).astype(np.float32)
        x, state = server_step(x, x - client, state, config, t=r + round_offset)
    flower = _flower(name, x0, grads, **flower_kw)
    # Flower computes in float32 (and the FedOpt family keeps float64 current weights):
    # agreement to a few float32 ulps of the parameters' magnitude (<= 1) over 5 rounds.
    assert np.allclose(x, flower, rtol=0, atol=64 * np.finfo(np.float32).eps)


def test_state_round_trips_through_to_dict_and_has_array_state() -> None:
    config = ServerOptimizerConfig(ServerOptimizer.FEDYOGI, lr=0.01)
    assert ServerOptimizerConfig.from_dict(config.to_dict()) == config
    state = init_server_state(np.zeros((2, 3), np.float16), config)
    assert set(state) == {"m", "v"}
    assert state["v"].dtype == np.float32
    assert (state["v"] == np.float32(1e-6)).all()  # v starts at tau**2 (Reddi et al.)
    assert init_server_state(np.zeros(2), config)["m"].dtype == np.float64


def test_bad_configs_and_inputs() -> None:
    with pytest.raises(InvalidInputError, match="lr"):
        ServerOptimizerConfig(ServerOptimizer.SGD, lr=float("nan"))
    with pytest.raises(InvalidInputError, match="beta2"):
        ServerOptimizerConfig(ServerOptimizer.FEDADAM, lr=0.1, beta2=1.5)
    with pytest.raises(InvalidInputError):
        ServerOptimizerConfig.from_dict({"method": "lion", "lr": 0.1})
    config = ServerOptimizerConfig(ServerOptimizer.FEDADAM, lr=0.1)
    x = np.zeros(3, np.float32)
    with pytest.raises(InvalidInputError, match="needs state"):
        server_step(x, x, {}, config)
    with pytest.raises(InvalidInputError, match="differ"):
        server_step(x, np.zeros(4, np.float32), init_server_state(x, config), config)
