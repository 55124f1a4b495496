"""Server optimizers as aggregation methods: FedAvg of each ready step, then a server step.

``gp.aggregate(store, run=..., method="fedadam", snapshot="global", server_lr=0.01)``
(``gradpipe aggregate STORE --run RUN --method fedadam --snapshot global
--server-lr 0.01``) works the way Flower's FedOpt strategies do: each ready
step's FedAvg of the peers' updates is the round's pseudo-gradient, recorded
as an aggregate under ``name`` (default: the method) whose params hold the
server optimizer's config (so the memo key does), and the server optimizer
then steps the newest snapshot of ``snapshot`` with it, writing the next
snapshot at that step (:func:`gradpipe.aggregation.server_update.server_update`, out of core).

Steps apply in ascending order. A step that has no aggregate (not ready,
failed, claimed by another aggregation) stops the steps after it: they are
reported ``skipped``, to be applied by a later call once it is there. A step
the chain applied already is ``memoised`` (see :mod:`gradpipe.aggregation.server_update` for what
idempotence means for a stateful optimizer); a step older than the chain's
newest snapshot, never applied to it, is ``skipped`` without stopping the rest.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final

from gradpipe.aggregation.options import SERVER_METHODS, SERVER_PARAMS, params_of
from gradpipe.aggregation.report import AggregateReport, ServerStepOutcome, StepOutcome
from gradpipe.aggregation.server_opt import ServerOptimizerConfig
from gradpipe.aggregation.server_update import parse_server_config, server_update
from gradpipe.core.names import parse_name
from gradpipe.errors import GradpipeError, InvalidInputError
from gradpipe.snapshots.api import snapshot_head

if TYPE_CHECKING:
    from gradpipe.graph.runner import Runner
    from gradpipe.storage.store import Store

__all__ = ["SERVER_METHODS", "ServerOptions", "apply_server_steps", "parse_server_options"]

#: The hyperparameters each server optimizer takes besides its chain and learning rate
#: (from the options table).
_TAKES: Final = {
    method: tuple(
        p.name
        for p in params_of(method)
        if p.name in SERVER_PARAMS and p.name not in ("snapshot", "server_lr")
    )
    for method in SERVER_METHODS
}


@dataclass(frozen=True)
class ServerOptions:
    """The chain a server optimizer steps, and its config."""

    snapshot: str
    config: ServerOptimizerConfig


def parse_server_options(
    method: str,
    *,
    snapshot: str | None,
    server_lr: float | None,
    momentum: float | None,
    beta1: float | None,
    beta2: float | None,
    tau: float | None,
    initial_accumulator: float | None,
    bias_correction: bool | None,
) -> ServerOptions | None:
    """The server step a method asks for (None for a plain aggregation), checked.

    An option the method does not take is refused, as are server options with
    a plain aggregation method.
    """
    given = {
        "momentum": momentum,
        "beta1": beta1,
        "beta2": beta2,
        "tau": tau,
        "initial_accumulator": initial_accumulator,
        "bias_correction": bias_correction or None,
    }
    if method not in SERVER_METHODS:
        named = {"snapshot": snapshot, "server_lr": server_lr, **given}
        extra = [k for k, v in named.items() if v is not None]  # 0 is a value too
        if extra:
            raise InvalidInputError(
                f"{method} takes no {', '.join(extra)}: those are for the server optimizers "
                f"({', '.join(SERVER_METHODS)})"
            )
        return None
    extra = sorted(k for k, v in given.items() if v is not None and k not in _TAKES[method])
    if extra:
        takes = ", ".join(_TAKES[method]) or "no other hyperparameter"
        raise InvalidInputError(
            f"{method} takes no {', '.join(extra)}; it takes the server learning rate and {takes}"
        )
    if snapshot is None:
        raise InvalidInputError(
            f"{method} steps the parameters of a snapshot chain: name it (--snapshot NAME); its "
            'newest snapshot holds {"params": {name: array}}'
        )
    if server_lr is None:
        raise InvalidInputError(f"{method} needs the server learning rate (--server-lr ETA)")
    parse_name(snapshot, what="snapshot name")
    return ServerOptions(snapshot, parse_server_config(method, server_lr, given))


def apply_server_steps(
    store: Store, report: AggregateReport, options: ServerOptions, runner: Runner | None
) -> None:
    """Step the chain with each step's aggregate in ``report``, in order; record what happened."""
    report.snapshot = options.snapshot
    report.server_optimizer = options.config.to_dict()
    head = snapshot_head(store, options.snapshot)[1].step
    waiting = ""  # why later steps wait: an earlier one has no aggregate or was not applied
    out: list[StepOutcome] = []
    for outcome in sorted(report.steps, key=lambda s: s.step):
        server = None
        if outcome.aggregate is None or outcome.status not in ("computed", "memoised"):
            if outcome.status == "failed" or outcome.reason:  # not a step without dumps
                waiting = waiting or f"step {outcome.step} has no aggregate ({outcome.status})"
                server = ServerStepOutcome("skipped", reason=outcome.reason or outcome.status)
        elif waiting:
            server = ServerStepOutcome("skipped", reason=f"{waiting}: steps apply in order")
        else:
            server = _step(store, report, outcome, options, runner, head=head)
            if server.status == "applied":
                head = outcome.step
            elif server.status == "failed":
                waiting = f"step {outcome.step} was not applied"
        out.append(outcome if server is None else dataclasses.replace(outcome, server=server))
    report.steps = out


def _step(
    store: Store,
    report: AggregateReport,
    outcome: StepOutcome,
    options: ServerOptions,
    runner: Runner | None,
    *,
    head: int,
) -> ServerStepOutcome:
    try:
        done = server_update(
            store,
            run=report.run,
            step=outcome.step,
            aggregate=report.name,
            snapshot=options.snapshot,
            config=options.config,
            runner=runner,
        )
    except GradpipeError as exc:
        if outcome.step < head:  # before the chain's newest snapshot: not for this chain
            return ServerStepOutcome("skipped", reason=str(exc))
        return ServerStepOutcome("failed", reason=str(exc))
    report.writes.add(done.writes)
    return ServerStepOutcome(done.status, done.snapshot_id)
