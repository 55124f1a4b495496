"""``apply_server_update``: a server optimizer step from an aggregate to the next snapshot.

>>> sid = gp.apply_server_update(  # doctest: +SKIP
...     store, run="r", step=3, aggregate="fedavg", snapshot="global", optimizer="fedadam", lr=0.01
... )

The aggregate of a round is the *pseudo-gradient* (the direction to descend,
:mod:`gradpipe.core.server_opt`); the newest snapshot of a named chain holds
the global parameters and the server optimizer's state, and the step writes the
next snapshot of that chain:

.. code-block:: python

    {"params": {name: array},
     "server_optimizer": {"m": {name: array}, "v": {name: array},  # per the optimizer
                          "t": rounds_applied, "config": ServerOptimizerConfig.to_dict()}}

The first snapshot of the chain may hold only ``{"params": ...}``: the
optimizer's state is then initialised (:func:`~gradpipe.core.server_opt.init_server_state`).
FedAdam and FedYogi follow Reddi et al. and have **no bias correction** unless
``bias_correction=True`` is passed (Flower's FedAdam corrects it).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Final

import numpy as np

from gradpipe.core.names import parse_name
from gradpipe.core.server_opt import (
    ServerOptimizer,
    ServerOptimizerConfig,
    init_server_state,
    server_step,
)
from gradpipe.errors import InvalidInputError
from gradpipe.runs import open_run
from gradpipe.snapshot import restore
from gradpipe.snapshot import snapshot as write_snapshot

if TYPE_CHECKING:
    from gradpipe.storage.store import Store

__all__ = ["apply_server_update"]

_STATE_KEYS: Final = frozenset({"params", "server_optimizer"})


def apply_server_update(
    store: Store,
    *,
    run: str,
    step: int,
    aggregate: str,
    snapshot: str,
    optimizer: str = "sgd",
    lr: float,
    **hyperparams: float | bool | None,
) -> str:
    """Apply the aggregate of ``(run, step)`` to the newest snapshot of ``snapshot``.

    Reads the aggregate named ``aggregate`` of ``step`` as the pseudo-gradient
    ``g``, restores the newest snapshot of ``snapshot``, applies one server
    optimizer step per tensor and writes the result as the next snapshot of
    ``snapshot`` at ``step``; returns its id. Tensors of the parameters that
    the aggregate lacks are carried over unchanged, with their state.

    This step reads and computes whole tensors in memory: it is not out of core
    yet (the math, :func:`~gradpipe.core.server_opt.server_step`, is element-wise,
    so a chunked version can follow).

    Parameters
    ----------
    store : Store
        A writable store holding the run and the snapshot chain.
    run, step, aggregate : str, int, str
        The aggregate recorded by :func:`gradpipe.aggregate` as ``aggregate``
        for ``step`` of ``run``. Pass ``-aggregate`` yourself (as a new
        aggregate) for peers that send model deltas rather than gradients.
    snapshot : str
        The chain whose newest snapshot holds ``{"params": {name: array}}``
        and, after the first call, ``"server_optimizer"``.
    optimizer : {"sgd", "fedavgm", "fedadagrad", "fedadam", "fedyogi"}
        The server optimizer. It must be the one whose state the snapshot holds.
    lr : float
        The server learning rate η.
    **hyperparams
        Other fields of :class:`~gradpipe.core.server_opt.ServerOptimizerConfig`
        (``momentum``, ``beta1``, ``beta2``, ``tau``, ``initial_accumulator``,
        ``bias_correction``: off by default, as in Reddi et al.). The call's
        values are used, and recorded, even when the snapshot recorded others
        (so a schedule may change ``lr``).

    Raises
    ------
    InvalidInputError
        For a bad optimizer or hyperparameter, a snapshot state of another shape
        or optimizer, or an aggregate tensor missing from the parameters or of
        another shape; nothing is written.
    NotFoundError
        If the run, its aggregate or the snapshot chain does not exist.
    """
    parse_name(snapshot, what="snapshot name")
    config = _config(optimizer, lr, hyperparams)
    view = open_run(store, run).aggregate(aggregate, step=step)
    state = restore(store, snapshot)
    params, opt_state, t = _parse_state(state, snapshot, config)
    grads = view.read_all()
    for name, grad in grads.items():
        if name not in params:
            raise InvalidInputError(
                f"server update: aggregate {aggregate!r} of step {step} has tensor {name!r}, "
                f"which snapshot {snapshot!r} has not (parameters: {', '.join(sorted(params))})"
            )
        if params[name].shape != grad.shape:
            raise InvalidInputError(
                f"server update: tensor {name!r} has shape {list(grad.shape)} in aggregate "
                f"{aggregate!r} of step {step} but {list(params[name].shape)} in snapshot "
                f"{snapshot!r}"
            )
    new_params: dict[str, np.ndarray] = {}
    new_state: dict[str, dict[str, np.ndarray]] = {k: {} for k in config.state_names}
    for name, value in params.items():
        own = {k: opt_state[k][name] for k in config.state_names}
        new_params[name] = value
        if name in grads:
            try:
                new_params[name], own = server_step(value, grads[name], own, config, t=t + 1)
            except InvalidInputError as exc:
                raise InvalidInputError(f"server update: tensor {name!r}: {exc}") from None
        for k in config.state_names:
            new_state[k][name] = own[k]
    server: dict[str, Any] = {**new_state, "t": t + 1, "config": config.to_dict()}
    return write_snapshot(
        store,
        snapshot,
        {"params": new_params, "server_optimizer": server},
        step=step,
        metadata={
            "run": run,
            "aggregate": aggregate,
            "aggregate_id": view.id,
            "server_optimizer": config.method.value,
        },
    )


def _config(
    optimizer: str, lr: float, hyperparams: Mapping[str, float | bool | None]
) -> ServerOptimizerConfig:
    try:
        method = ServerOptimizer(optimizer)
    except ValueError:
        known = ", ".join(m.value for m in ServerOptimizer)
        raise InvalidInputError(
            f"server update: unknown optimizer {optimizer!r} (one of {known})"
        ) from None
    return ServerOptimizerConfig.from_dict({"method": method, "lr": lr, **hyperparams})


def _parse_state(
    state: Any, name: str, config: ServerOptimizerConfig
) -> tuple[dict[str, np.ndarray], dict[str, dict[str, np.ndarray]], int]:
    """The parameters, the optimizer's per-tensor state and its round counter."""
    shape = '{"params": {name: array}, "server_optimizer": {...}}'
    if not isinstance(state, Mapping) or "params" not in state or set(state) - _STATE_KEYS:
        keys = sorted(map(str, state)) if isinstance(state, Mapping) else type(state).__name__
        raise InvalidInputError(f"snapshot {name!r} holds {keys}, not a server state {shape}")
    params = state["params"]
    if not isinstance(params, Mapping) or not all(
        isinstance(k, str) and isinstance(v, np.ndarray) for k, v in params.items()
    ):
        raise InvalidInputError(f"snapshot {name!r}: 'params' must map tensor names to arrays")
    params = dict(params)
    server = state.get("server_optimizer")
    if server is None:  # the first round: the optimizer starts here
        inits = {n: init_server_state(v, config) for n, v in params.items()}
        per = {k: {n: inits[n][k] for n in params} for k in config.state_names}
        return params, per, 0
    if not isinstance(server, Mapping) or not isinstance(server.get("config"), Mapping):
        raise InvalidInputError(f"snapshot {name!r}: 'server_optimizer' has no config")
    stored = ServerOptimizerConfig.from_dict(dict(server["config"]))
    if stored.method is not config.method:
        raise InvalidInputError(
            f"snapshot {name!r} holds {stored.method.value} state; it cannot continue with "
            f"{config.method.value} (start a new chain from its params)"
        )
    t = server.get("t")
    if isinstance(t, bool) or not isinstance(t, int) or t < 0:
        raise InvalidInputError(f"snapshot {name!r}: server optimizer round t={t!r} is not >= 0")
    per = {}
    for k in config.state_names:
        arrays = server.get(k)
        if not isinstance(arrays, Mapping) or set(arrays) != set(params):
            raise InvalidInputError(
                f"snapshot {name!r}: server optimizer state {k!r} must have one array per "
                f"parameter ({', '.join(sorted(params))})"
            )
        per[k] = dict(arrays)
    return params, per, t
