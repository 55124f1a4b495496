"""``apply_server_update``: a server optimizer step from an aggregate to the next snapshot.

>>> sid = gp.apply_server_update(  # doctest: +SKIP
...     store, run="r", step=3, aggregate="fedavg", snapshot="global", optimizer="fedadam", lr=0.01
... )

The aggregate of a round is the *pseudo-gradient* (the direction to descend,
:mod:`gradpipe.aggregation.server_opt`); the newest snapshot of a named chain holds
the global parameters and the server optimizer's state, and the step writes the
next snapshot of that chain:

.. code-block:: python

    {"params": {name: array},
     "server_optimizer": {"m": {name: array}, "v": {name: array},  # per the optimizer
                          "t": rounds_applied, "config": ServerOptimizerConfig.to_dict()}}

The first snapshot of the chain may hold only ``{"params": ...}``, or a flat
``{name: array}`` (``gradpipe snapshot`` of a safetensors or npz file), taken as
the parameters: the optimizer's state is then initialised
(:func:`~gradpipe.aggregation.server_opt.init_server_state`).
FedAdam and FedYogi follow Reddi et al. and have **no bias correction** unless
``bias_correction=True`` is passed (Flower's FedAdam corrects it).

Out of core: the step is a Dask graph (:mod:`gradpipe.aggregation.server_opt_graph`) with one
task per chunk of the parameters, which reads that chunk of the parameters, of
the update and of the state, steps, and writes the new chunks as the next
version of the old ones (deltas against their keyframes, as :func:`gp.snapshot
<gradpipe.snapshots.api.snapshot>` writes them). The math is element-wise, so the
result is the same bits as :func:`~gradpipe.aggregation.server_opt.server_step` on
whole tensors. The snapshot is published by one compare-and-swap of its ref
once every chunk is written: a failure anywhere leaves the chain as it was.

Idempotence. A server optimizer is stateful: applying one round twice moves
the parameters twice and counts the round twice. So a chain applies each step
of a run **at most once**: every snapshot a server step writes records the run,
step, aggregate and aggregate id in its metadata, and asking again for a step
the chain already applied returns that snapshot (``memoised``) when it came
from the same aggregate with the same optimizer settings, and is refused
otherwise (the aggregate was recomputed, or other settings were asked for:
start a new chain from the parameters to apply it differently). Steps apply in
order: a step older than the chain's newest snapshot is refused.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Final

from gradpipe.aggregation.options import SERVER_PARAMS, check_value
from gradpipe.aggregation.server_opt import ServerOptimizer, ServerOptimizerConfig
from gradpipe.aggregation.server_opt_plan import plan_server_step
from gradpipe.core.display import printable
from gradpipe.core.manifest import manifest_id
from gradpipe.core.names import parse_name
from gradpipe.core.snapshot_manifest import SnapshotManifest
from gradpipe.core.state import state_skeleton
from gradpipe.core.tensor_manifest import TensorManifest
from gradpipe.errors import ConflictError, InvalidInputError
from gradpipe.graph.runner import Runner, use_runner
from gradpipe.runs import Aggregate, open_run
from gradpipe.snapshots.api import (
    commit_snapshot,
    snapshot_head,
    snapshot_versions,
)
from gradpipe.storage.blocks import WriteStats

if TYPE_CHECKING:
    from gradpipe.aggregation.server_opt_graph import ServerPlan
    from gradpipe.aggregation.tasks import TensorOut
    from gradpipe.storage.store import Store

__all__ = ["ServerUpdate", "apply_server_update", "parse_server_config", "server_update"]

#: Rebuilds after another writer moved the chain while the step was computed.
_MAX_ATTEMPTS: Final = 4


@dataclass(frozen=True)
class ServerUpdate:
    """What one server step did: ``applied`` (a new snapshot) or ``memoised`` (found)."""

    status: str
    snapshot_id: str
    writes: WriteStats = field(default_factory=WriteStats)


def apply_server_update(
    store: Store,
    *,
    run: str,
    step: int,
    aggregate: str,
    snapshot: str,
    optimizer: str = "sgd",
    lr: float,
    runner: Runner | None = None,
    **hyperparams: float | bool | None,
) -> str:
    """Apply the aggregate of ``(run, step)`` to the newest snapshot of ``snapshot``.

    Reads the aggregate named ``aggregate`` of ``step`` as the pseudo-gradient
    ``g`` and applies one server optimizer step to the parameters and state of
    the newest snapshot of ``snapshot``, chunk by chunk on a Dask graph, and
    writes the result as the next snapshot of ``snapshot`` at ``step``;
    returns its id. Tensors of the parameters that the aggregate lacks are
    carried over unchanged, with their state. A step the chain already applied
    from this aggregate returns that snapshot's id (see the module's notes on
    idempotence).

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
    runner : Runner, optional
        Where the graph runs (default: local threads).
    **hyperparams
        Other fields of :class:`~gradpipe.aggregation.server_opt.ServerOptimizerConfig`
        (``momentum``, ``beta1``, ``beta2``, ``tau``, ``initial_accumulator``,
        ``bias_correction``: off by default, as in Reddi et al.). The call's
        values are used, and recorded, even when the snapshot recorded others
        (so a schedule may change ``lr``).

    Raises
    ------
    InvalidInputError
        For a bad optimizer or hyperparameter; a snapshot state of another
        shape or optimizer; an aggregate tensor missing from the parameters, of
        another shape, or not finite; a stale aggregate (a dump it used was
        replaced: re-run ``gradpipe aggregate --force``); a step the chain
        applied already from another aggregate or with other settings, or one
        older than its newest snapshot; a step that leaves non-finite values.
        Nothing is written.
    NotFoundError
        If the run, its aggregate or the snapshot chain does not exist.
    """
    config = parse_server_config(optimizer, lr, hyperparams)
    done = server_update(
        store,
        run=run,
        step=step,
        aggregate=aggregate,
        snapshot=snapshot,
        config=config,
        runner=runner,
    )
    return done.snapshot_id


def parse_server_config(
    optimizer: str, lr: float, hyperparams: Mapping[str, float | bool | None]
) -> ServerOptimizerConfig:
    """The server optimizer's config, checked against the options table.

    ``hyperparams`` left None are the defaults. The values are kept as given (an integer
    stays one): the config is recorded in the aggregate's params, and so in its memo key.
    """
    try:
        method = ServerOptimizer(optimizer)
    except ValueError:
        known = ", ".join(m.value for m in ServerOptimizer)
        raise InvalidInputError(
            f"server update: unknown optimizer {printable(optimizer)} (one of {known})"
        ) from None
    given = {k: v for k, v in hyperparams.items() if v is not None}
    check_value("server_lr", lr)
    for key, value in given.items():
        if key in SERVER_PARAMS:
            check_value(key, value)
    return ServerOptimizerConfig.from_dict({"method": method, "lr": lr, **given})


def server_update(
    store: Store,
    *,
    run: str,
    step: int,
    aggregate: str,
    snapshot: str,
    config: ServerOptimizerConfig,
    runner: Runner | None = None,
) -> ServerUpdate:
    """:func:`apply_server_update` with a parsed config, saying whether it applied or found it."""
    store.check_writable()
    parse_name(snapshot, what="snapshot name")
    view = open_run(store, run).aggregate(aggregate, step=step)
    updates = _check_aggregate(view, run)
    with store.writing(f"server update {snapshot}"), use_runner(runner) as active:
        for _ in range(_MAX_ATTEMPTS):
            head_id, head = snapshot_head(store, snapshot)
            found = _already_applied(store, snapshot, run=run, step=step, view=view, config=config)
            if found is not None:
                return ServerUpdate("memoised", found)
            if head.step > step:
                raise InvalidInputError(
                    f"server update: snapshot {printable(snapshot)} is at step "
                    f"{head.step}, after step "
                    f"{step} of run {printable(run)}: server steps apply in order; start "
                    "a new chain to "
                    "apply older steps"
                )
            plan, tree, keys = plan_server_step(
                store, snapshot, head, step=step, updates=updates, config=config
            )
            outs = _compute(store, plan, active)
            writes = WriteStats()
            tensors: dict[str, str] = {}
            embedded: dict[str, TensorManifest] = {}
            for key in keys:
                writes.add(outs[key].stats)
                tensor_id = manifest_id(outs[key].manifest)
                tensors[key] = tensor_id
                embedded[tensor_id] = outs[key].manifest
            metadata = {
                "run": run,
                "aggregate": aggregate,
                "aggregate_id": view.id,
                "server_optimizer": config.method.value,
            }
            try:
                snapshot_id = commit_snapshot(
                    store,
                    snapshot,
                    previous=head_id,
                    step=step,
                    tree=tree,
                    tensors=tensors,
                    embedded=embedded,
                    metadata=metadata,
                )
            except ConflictError:
                continue  # another writer moved the chain: step again from its snapshot
            return ServerUpdate("applied", snapshot_id, writes)
    raise ConflictError(
        f"server update: other writers moved snapshot {printable(snapshot)} "
        f"{_MAX_ATTEMPTS} times in a "
        "row while this step was computed; retry"
    )


def _compute(store: Store, plan: ServerPlan, runner: Runner) -> dict[str, TensorOut]:
    from gradpipe.aggregation.server_opt_graph import build_server_graph
    from gradpipe.aggregation.tasks import TensorOut

    graph, keys = build_server_graph(store, plan)
    results = runner.get(graph, [k for _, k in keys], name="gradpipe-server")
    out = {}
    for (array, _), result in zip(keys, results, strict=True):
        if not isinstance(result, TensorOut):  # our own graph's invariant
            raise TypeError(f"the tensor task of {array} returned {type(result).__name__}")
        out[array] = result
    return out


def _check_aggregate(view: Aggregate, run: str) -> dict[str, TensorManifest]:
    """The aggregate's tensors, refused if stale or not finite (from its stats: reads nothing)."""
    label = f"aggregate {printable(view.name)} of step {view.step} of run {printable(run)}"
    if view.stale is not None:
        raise InvalidInputError(
            f"server update: {label} is stale ({view.stale}): it no longer matches the dumps the "
            f"run records; re-run `gradpipe aggregate --force` for step {view.step} first"
        )
    infos = view.infos()
    for name, info in infos.items():
        summary = info.summary()
        if summary.nan or summary.inf:
            raise InvalidInputError(
                f"server update: tensor {printable(name)} of {label} holds {summary.nan} NaN and "
                f"{summary.inf} infinite values; a server step needs a finite update"
            )
    return infos


def _already_applied(
    store: Store,
    snapshot: str,
    *,
    run: str,
    step: int,
    view: Aggregate,
    config: ServerOptimizerConfig,
) -> str | None:
    """The snapshot that applied ``step`` of ``run`` to the chain already, if any (checked)."""
    for snapshot_id, manifest in snapshot_versions(store, snapshot):
        if manifest.step < step:
            return None  # steps apply in order: older versions hold older steps
        meta = manifest.metadata
        if manifest.step != step or meta.get("run") != run or "aggregate_id" not in meta:
            continue
        where = (
            f"step {step} of run {printable(run)} was applied to snapshot "
            f"{printable(snapshot)} already"
        )
        if meta["aggregate_id"] != view.id:
            raise InvalidInputError(
                f"server update: {where}, from aggregate {printable(meta.get('aggregate'))} "
                f"{meta['aggregate_id']}, not {printable(view.name)} {view.id}; a chain "
                "applies each "
                "step once (the optimizer's state moved on): start a new chain from its "
                "parameters to apply it again"
            )
        recorded = _recorded_config(manifest)
        if recorded != config.to_dict():
            raise InvalidInputError(
                f"server update: {where} with {recorded}, not {config.to_dict()}; a chain "
                "applies each step once: start a new chain to apply it with other settings"
            )
        return snapshot_id
    return None


def _recorded_config(manifest: SnapshotManifest) -> dict[str, Any] | None:
    """The optimizer config a snapshot's state records (from its skeleton: reads no array)."""
    try:
        server = state_skeleton(manifest.state).get("server_optimizer")
    except (ValueError, KeyError, TypeError, AttributeError):
        return None
    config = server.get("config") if isinstance(server, Mapping) else None
    return dict(config) if isinstance(config, Mapping) else None
