"""Server optimizers (Reddi et al. 2021, "Adaptive Federated Optimization"), element-wise.

Every optimizer is one pure function of one chunk, :func:`server_step`
``(params, grad, state, config, t) -> (new_params, new_state)``, so a graph
runs it chunk by chunk; the state is a dict of arrays of the chunk's shape
(``"momentum"``, or ``"m"`` and ``"v"``) that a snapshot stores beside the
parameters, plus the round counter ``t`` the caller keeps.

Sign convention: ``grad`` is a *pseudo-gradient*, the direction to descend.
For gradient dumps it is the aggregate of the peers' gradients (the Rust prototype's
``apply_gradient``: ``params -= lr * aggregate``). For peers that send model
updates ``Δ_i = x_i - x`` (Flower's FedOpt strategies, Reddi et al.'s
``Δ_t``), pass ``grad = -aggregate(Δ)``, i.e. ``params - aggregate(x_i)``.

- ``sgd``: ``x ← x - η·g``.
- ``fedavgm`` (Hsu et al. 2019; Flower's FedAvgM): ``u ← μ·u + g``, ``x ← x - η·u``.
- ``fedadagrad``: ``v ← v + g²``;
  ``fedadam``: ``v ← β₂·v + (1-β₂)·g²``;
  ``fedyogi``: ``v ← v - (1-β₂)·g²·sign(v - g²)``; for all three
  ``m ← β₁·m + (1-β₁)·g`` and ``x ← x - η·m / (√v + τ)``.

Defaults follow Reddi et al.: ``β₁ = 0.9``, ``β₂ = 0.99``, ``τ = 1e-3``, ``v``
starting at ``τ²`` (their Algorithm 2's ``v₋₁ ≥ τ²``), and **no bias
correction** (the paper has none). Flower differs: its FedAdam corrects bias
through ``η_t = η·√(1-β₂^(r+1)) / (1-β₁^(r+1))`` at server round ``r`` (set
``bias_correction=True`` and ``t = r + 1`` to reproduce it), its FedAdagrad has
``β₁ = 0``, its ``v`` starts at 0 (``initial_accumulator=0``), and its ``τ``
defaults to 1e-9 (FedYogi 1e-3). Arithmetic is float64; parameters come back
in their dtype, the state in float32 (float64 for float64 parameters).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from enum import StrEnum
from typing import Any

import numpy as np

from gradpipe.core.display import PATH_LIMIT, printable, printable_text
from gradpipe.errors import InvalidInputError

__all__ = [
    "ServerOptimizer",
    "ServerOptimizerConfig",
    "init_server_state",
    "server_step",
    "state_dtype",
]


class ServerOptimizer(StrEnum):
    """The server optimizers, by their CLI names."""

    SGD = "sgd"
    FEDAVGM = "fedavgm"
    FEDADAGRAD = "fedadagrad"
    FEDADAM = "fedadam"
    FEDYOGI = "fedyogi"


_ADAPTIVE = frozenset(
    {ServerOptimizer.FEDADAGRAD, ServerOptimizer.FEDADAM, ServerOptimizer.FEDYOGI}
)


def _finite(name: str, value: float, lo: float, hi: float = math.inf) -> float:
    v = float(value)
    if not (math.isfinite(v) and lo <= v <= hi):
        raise InvalidInputError(f"server optimizer: {name}={value!r} must be in [{lo}, {hi}]")
    return v


@dataclass(frozen=True)
class ServerOptimizerConfig:
    """A server optimizer and its hyperparameters (validated at construction)."""

    method: ServerOptimizer
    lr: float
    momentum: float = 0.9
    beta1: float = 0.9
    beta2: float = 0.99
    tau: float = 1e-3
    initial_accumulator: float | None = None  # v's start; None: tau**2
    bias_correction: bool = False

    def __post_init__(self) -> None:
        # What a user may ask for is the options table's (gradpipe.aggregation.options, checked
        # by parse_server_config); these wider checks guard configs read back from the store.
        object.__setattr__(self, "method", ServerOptimizer(self.method))
        _finite("lr", self.lr, 0.0)
        _finite("momentum", self.momentum, 0.0, 1.0)
        _finite("beta1", self.beta1, 0.0, 1.0)
        _finite("beta2", self.beta2, 0.0, 1.0)
        _finite("tau", self.tau, 0.0)
        if self.initial_accumulator is not None:
            _finite("initial_accumulator", self.initial_accumulator, 0.0)

    @property
    def state_names(self) -> tuple[str, ...]:
        """The arrays of the optimizer's state."""
        if self.method is ServerOptimizer.FEDAVGM:
            return ("momentum",)
        return ("m", "v") if self.method in _ADAPTIVE else ()

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready fields (for provenance and snapshots)."""
        out = asdict(self)
        out["method"] = self.method.value
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ServerOptimizerConfig:
        """The inverse of :meth:`to_dict`."""
        try:
            return cls(**data)
        except (TypeError, ValueError) as exc:
            raise InvalidInputError(
                f"bad server optimizer config {printable(data, limit=PATH_LIMIT)}: "
                f"{printable_text(str(exc), limit=PATH_LIMIT)}"
            ) from None


def state_dtype(params: np.dtype) -> np.dtype:
    """The dtype of the state kept for parameters of dtype ``params``."""
    return np.dtype(np.float64) if params == np.float64 else np.dtype(np.float32)


def init_server_state(params: np.ndarray, config: ServerOptimizerConfig) -> dict[str, np.ndarray]:
    """The state before the first step, for a chunk of ``params``."""
    dtype = state_dtype(params.dtype)
    v0 = config.tau**2 if config.initial_accumulator is None else config.initial_accumulator
    starts = {"momentum": 0.0, "m": 0.0, "v": v0}
    return {name: np.full(params.shape, starts[name], dtype=dtype) for name in config.state_names}


def server_step(
    params: np.ndarray,
    grad: np.ndarray,
    state: dict[str, np.ndarray],
    config: ServerOptimizerConfig,
    *,
    t: int = 1,
) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """One server step on one chunk; ``t`` (1-based) is used by bias correction only."""
    if params.shape != grad.shape:
        raise InvalidInputError(
            f"server step: parameters {list(params.shape)} and update {list(grad.shape)} differ"
        )
    missing = [k for k in config.state_names if k not in state]
    if missing or any(state[k].shape != params.shape for k in config.state_names):
        raise InvalidInputError(
            f"server step: {config.method.value} needs state {list(config.state_names)} of "
            f"shape {list(params.shape)}; got { ({k: v.shape for k, v in state.items()}) }"
        )
    if t < 1:
        raise InvalidInputError(f"server step: round t={t} must be >= 1")
    x = params.astype(np.float64)
    g = np.asarray(grad, dtype=np.float64)
    dtype = state_dtype(params.dtype)
    method = config.method
    if method is ServerOptimizer.SGD:
        return (x - config.lr * g).astype(params.dtype), {}
    if method is ServerOptimizer.FEDAVGM:
        u = config.momentum * state["momentum"].astype(np.float64) + g
        return (x - config.lr * u).astype(params.dtype), {"momentum": u.astype(dtype)}
    b1, b2 = config.beta1, config.beta2
    m = b1 * state["m"].astype(np.float64) + (1.0 - b1) * g
    v = state["v"].astype(np.float64)
    g2 = g * g
    if method is ServerOptimizer.FEDADAGRAD:
        v = v + g2
    elif method is ServerOptimizer.FEDADAM:
        v = b2 * v + (1.0 - b2) * g2
    else:
        v = v - (1.0 - b2) * g2 * np.sign(v - g2)
    lr = config.lr
    if config.bias_correction:
        lr = lr * math.sqrt(1.0 - b2**t) / (1.0 - b1**t) if b1 < 1.0 else lr
    new = x - lr * m / (np.sqrt(v) + config.tau)
    return new.astype(params.dtype), {"m": m.astype(dtype), "v": v.astype(dtype)}
