"""``aggregate``: the aggregates of a run's steps, computed from its stored dumps.

The user operation, in named stages: check the request against the options table
(:mod:`gradpipe.aggregation.options`); plan every step (:mod:`gradpipe.aggregation.step_plan`:
its dumps checked against each other before anything is written); leave out the steps the run
already records under the same memo key; claim the rest in the run's rounds; compute them as one
graph (:mod:`gradpipe.aggregation.graph`) under a writer's lease; then, for a server optimizer,
step its snapshot chain (:mod:`gradpipe.aggregation.server_opt_method`). See
``docs/design/009-aggregation.md``.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from gradpipe.aggregation.graph import StepPlan, build_aggregate_graph, parse_split_every
from gradpipe.aggregation.options import (
    METHOD_TABLE,
    METHODS,
    PARAMS,
    SERVER_PARAMS,
    check_value,
    params_of,
)
from gradpipe.aggregation.reduce import AggregationMethod
from gradpipe.aggregation.report import AggregateReport, StepOutcome
from gradpipe.aggregation.rounds import claim_aggregation, release_aggregation, step_rounds
from gradpipe.aggregation.server_opt_method import (
    ServerOptions,
    apply_server_steps,
    parse_server_options,
)
from gradpipe.aggregation.step_plan import load_dumps, parse_steps, plan_privacy, plan_step
from gradpipe.aggregation.tasks import AggregateCommit, CommitGuard, StepFailure
from gradpipe.core.aggregate_manifest import AggregateManifest
from gradpipe.core.display import printable
from gradpipe.core.names import parse_name
from gradpipe.core.run_manifest import RunManifest
from gradpipe.errors import InvalidInputError
from gradpipe.graph.runner import Runner, use_runner
from gradpipe.graph.telemetry import reported
from gradpipe.snapshots.api import snapshot_head
from gradpipe.storage.catalog import read_rounds, read_run
from gradpipe.storage.store import Store

__all__ = ["METHODS", "AggregateReport", "StepOutcome", "aggregate", "check_request"]


def _failure_lines(report: AggregateReport) -> list[str]:
    """The failed steps, a line each (for the dashboard)."""
    return [f"step {s.step}: {s.reason}" for s in report.steps if s.status == "failed"]


def _commit(report: AggregateReport) -> str | None:
    """The run manifest the call committed, if it computed a step (for the dashboard)."""
    return report.run_id if report.computed else None


@reported("aggregate", _failure_lines, _commit)
def aggregate(
    store: Store,
    *,
    run: str,
    steps: range | Sequence[int] | None = None,
    method: str = "fedavg",
    name: str | None = None,
    weights: Mapping[str, float] | None = None,
    clip_norm: float | None = None,
    clip_aggregate: float | None = None,
    trim: float | None = None,
    byzantine: int | None = None,
    keep: int | None = None,
    noise_multiplier: float | None = None,
    seed: int | None = None,
    adaptive_clip: bool = False,
    target_quantile: float | None = None,
    clip_lr: float | None = None,
    split_every: int | None = None,
    force: bool = False,
    runner: Runner | None = None,
    snapshot: str | None = None,
    server_lr: float | None = None,
    momentum: float | None = None,
    beta1: float | None = None,
    beta2: float | None = None,
    tau: float | None = None,
    initial_accumulator: float | None = None,
    bias_correction: bool = False,
) -> AggregateReport:
    """Aggregate the dumps of each step of ``run`` over its peers, and record the results.

    Parameters
    ----------
    store : Store
        A writable store.
    run : str
        The run whose dumps to aggregate.
    steps : range or list of int, optional
        The steps (default: every recorded step). Steps of a ``range`` that
        have no dumps are skipped; a listed step without dumps is an error.
        Only steps that are ready in the run's rounds (quorum met, or deadline
        passed with at least one peer) are aggregated, unless ``force``; the
        others are skipped with the reason. Peers marked failed are left out.
    method : str
        One of :data:`~gradpipe.aggregation.options.METHODS`:
    {method_table}
    name : str, optional
        What the run records the aggregates as (default: the method).
    weights : mapping of peer name to weight, optional
        Explicit weights, finite and > 0, one for every peer of every step.
    {method_parameters}
    split_every : int, optional
        Partials per combine task, a power of two (default 8). The result's
        bits do not depend on it.
    force : bool
        Recompute steps the run already records under the same memo key (or
        under ``name`` with other parameters), and aggregate steps that are not
        ready in the run's rounds (:func:`gradpipe.rounds`). A step another
        live aggregation has claimed is skipped even so.
    runner : Runner, optional
        Where the graph runs (default: local threads).

    Returns
    -------
    AggregateReport
        Per step: computed, memoised, skipped or failed, with the aggregate's id.

    Examples
    --------
    >>> report = gp.aggregate(store, run="r", method="fedavg")  # doctest: +SKIP
    >>> gp.open_run(store, "r").aggregate("fedavg", step=0).read("w")  # doctest: +SKIP
    """
    given = locals()  # the method parameters, by the names of the options table
    store.check_writable()
    started = time.perf_counter()
    request = _parse_request(method, name, split_every, {p.name: given[p.name] for p in PARAMS})
    if request.server is not None:  # the chain must exist before anything is computed
        snapshot_head(store, request.server.snapshot)
    run_id, recorded = read_run(store, run)
    report = AggregateReport(run, request.name, request.shown, run_id=run_id)
    plans = _plan(store, recorded, request, steps, weights, force=force, report=report)
    if plans:
        _claim_and_compute(store, recorded, request, plans, runner=runner, report=report)
    report.steps.sort(key=lambda s: s.step)
    if request.server is not None:
        apply_server_steps(store, report, request.server, runner)
    report.seconds = time.perf_counter() - started
    return report


def check_request(
    *,
    method: str = "fedavg",
    name: str | None = None,
    split_every: int | None = None,
    **params: Any,
) -> None:
    """Refuse what :func:`aggregate` would refuse from its arguments alone, reading nothing.

    For checks ahead of a job (``gradpipe run --dry-run``); ``params`` are the method
    parameters of :mod:`gradpipe.aggregation.options`. Raises :class:`InvalidInputError`.
    """
    unknown = sorted(set(params) - {p.name for p in PARAMS})
    if unknown:
        raise InvalidInputError(f"{', '.join(unknown)}: not a parameter of any aggregation method")
    _parse_request(method, name, split_every, params)


# --- stage 1: the request, checked against the options table ------------------------
@dataclass(frozen=True)
class _Request:
    """What a call asks for, checked: the method computed per step and its parameters."""

    method: AggregationMethod  # FedAvg for a server optimizer
    shown: str  # the method as reported (the server optimizer's name)
    name: str  # what the run records the aggregates as
    params: dict[str, Any]  # in the memo key
    server: ServerOptions | None
    fan: int


def _parse_request(
    method: str, name: str | None, split_every: int | None, given: dict[str, Any]
) -> _Request:
    if method not in METHODS:
        raise InvalidInputError(
            f"aggregation method {printable(method)} is not one gradpipe computes yet; "
            f"choose one of {', '.join(METHODS)}"
        )
    server_given = {k: given.get(k) for k in SERVER_PARAMS}
    server = parse_server_options(method, **server_given)
    chosen = AggregationMethod.FEDAVG if server is not None else AggregationMethod(method)
    own = {k: v for k, v in given.items() if k not in SERVER_PARAMS}
    params = _parse_params(chosen, own)
    if server is not None:  # in the memo key: other settings are another aggregate
        params["server_optimizer"] = server.config.to_dict()
    label = parse_name(name if name is not None else method, what="aggregate name")
    shown = method if server is not None else chosen.value
    return _Request(chosen, shown, label, params, server, parse_split_every(split_every))


def _parse_params(method: AggregationMethod, given: dict[str, Any]) -> dict[str, Any]:
    """The method's parameters, checked; an option the method does not take is refused.

    What is recorded (and so in the memo key): each given value; the table's default of a
    number the method always uses (``trim``, ``byzantine``, ``noise_multiplier``); adaptive
    clipping's settings only with ``adaptive_clip``.
    """
    takes = {p.name for p in params_of(method.value)}
    extra = sorted(k for k, v in given.items() if _is_set(v) and k not in takes)
    if extra:
        raise InvalidInputError(
            f"{method.value} takes no {', '.join(extra)}; "
            + (f"it takes {', '.join(sorted(takes))}" if takes else "it takes no parameters")
        )
    adaptive = given.get("adaptive_clip") is True
    params: dict[str, Any] = {}
    for param in params_of(method.value):
        value = given.get(param.name)
        if param.name in _ADAPTIVE_ONLY and not adaptive:
            if value is not None:
                raise InvalidInputError(
                    "target_quantile and clip_lr are adaptive clipping's (--adaptive-clip)"
                )
            continue
        if not _is_set(value):
            if method.value in param.required_by:
                raise InvalidInputError(_REQUIRED[param.name])
            if param.default is None or param.type is bool:
                continue
            value = param.default
        params[param.name] = check_value(param.name, value)
    return params


def _is_set(value: object) -> bool:
    """Given: not left at None, nor a flag left off (0 is a value, although 0 == False)."""
    return value is not None and value is not False


#: Adaptive clipping's settings, recorded only with ``adaptive_clip``.
_ADAPTIVE_ONLY = frozenset({"target_quantile", "clip_lr"})

#: Why a required parameter is: said when it is missing.
_REQUIRED = {"clip_norm": "dp-fedavg needs a clip norm (--clip-norm C): the noise is scaled to it"}


# --- stage 2: plan every step, and leave out what is recorded already ------------------
def _plan(
    store: Store,
    recorded: RunManifest,
    request: _Request,
    steps: range | Sequence[int] | None,
    weights: Mapping[str, float] | None,
    *,
    force: bool,
    report: AggregateReport,
) -> list[StepPlan]:
    wanted = parse_steps(recorded, steps, report)
    wanted, excluded = _ready(store, recorded, wanted, force=force, report=report)
    dumps = load_dumps(store, recorded, wanted)
    for step, peers in excluded.items():
        dumps[step] = [d for d in dumps[step] if d.peer not in peers]
    plans = []
    for step in wanted:
        plan = plan_step(
            store,
            recorded,
            step,
            dumps[step],
            method=request.method,
            name=request.name,
            params=request.params,
            weights=weights,
        )
        entry = recorded.aggregate_entry(step, request.name)
        if entry is not None and entry.key == plan.spec.key and not force:
            report.steps.append(StepOutcome(step, "memoised", entry.aggregate))
        elif entry is not None and not force and _same_inputs(store, entry.aggregate, plan):
            report.steps.append(
                StepOutcome(
                    step,
                    "skipped",
                    entry.aggregate,
                    f"already aggregated as {printable(request.name)} from these dumps with "
                    "another method or parameters; choose another name, or force to replace it",
                )
            )
        else:
            plans.append(plan)
    if request.method is AggregationMethod.DP_FEDAVG:
        plans = plan_privacy(store, recorded, request.name, plans, request.params)
    return plans


# --- stage 3: claim the steps in the run's rounds, compute, release --------------------
def _claim_and_compute(
    store: Store,
    recorded: RunManifest,
    request: _Request,
    plans: list[StepPlan],
    *,
    runner: Runner | None,
    report: AggregateReport,
) -> None:
    """One live aggregation per (step, name): the claimed steps are computed as one graph.

    The commit checks that each step's entry is still the one the plan saw in ``recorded``.
    """
    claim, refused = claim_aggregation(
        store, report.run, request.name, [p.spec.step for p in plans]
    )
    report.steps += [StepOutcome(s, "skipped", reason=r) for s, r in refused.items()]
    plans = [p for p in plans if p.spec.step not in refused]
    try:
        if plans:
            seen = {}
            for p in plans:
                entry = recorded.aggregate_entry(p.spec.step, request.name)
                seen[p.spec.step] = entry.aggregate if entry is not None else None
            guard = CommitGuard(request.name, claim, seen)
            result = _compute(store, plans, runner, request=request, guard=guard)
            _add_commit(report, result)
    finally:
        release_aggregation(store, report.run, claim)


def _compute(
    store: Store,
    plans: list[StepPlan],
    runner: Runner | None,
    *,
    request: _Request,
    guard: CommitGuard,
) -> AggregateCommit:
    spec = plans[0].spec
    with use_runner(runner) as active, store.writing(f"aggregate run {spec.run}") as lease:
        message = f"aggregate {spec.name} ({spec.method}) of {len(plans)} steps"
        graph, key = build_aggregate_graph(
            store,
            plans,
            clip_norm=request.params.get("clip_norm"),
            split_every=request.fan,
            message=message,
            lease=lease.key if lease is not None else None,
            guard=guard,
        )
        [result] = active.get(graph, [key], name="gradpipe-aggregate")
    if not isinstance(result, AggregateCommit):  # our own graph's invariant
        raise TypeError(f"the commit task returned {type(result).__name__}")
    return result


def _ready(
    store: Store, recorded: RunManifest, wanted: list[int], *, force: bool, report: AggregateReport
) -> tuple[list[int], dict[int, list[str]]]:
    """The steps of ``wanted`` that are ready (all with ``force``), and the peers to leave out."""
    _, manifest = read_rounds(store, recorded.run)
    evaluated = step_rounds(store, recorded, manifest, wanted)
    out = []
    for step in wanted:
        if evaluated[step].ready or force:
            out.append(step)
        else:
            report.steps.append(StepOutcome(step, "skipped", reason=evaluated[step].reason))
    return out, {s: evaluated[s].excluded for s in out if evaluated[s].excluded}


def _same_inputs(store: Store, aggregate_id: str, plan: StepPlan) -> bool:
    """Whether the recorded aggregate was computed from the dumps ``plan`` would use."""
    recorded = store.get_typed(aggregate_id, AggregateManifest, context=f"step {plan.spec.step}")
    return {(i.peer, i.dump) for i in recorded.inputs} == {
        (i.peer, i.dump) for i in plan.spec.inputs
    }


def _add_commit(report: AggregateReport, result: AggregateCommit) -> None:
    if result.run_id is not None:
        report.run_id = result.run_id
    for done in result.committed:
        report.steps.append(StepOutcome(done.entry.step, "computed", done.entry.aggregate))
        report.writes.add(done.stats)
        report.logical_bytes += done.logical_bytes
    for failure in result.failures:
        report.steps.append(_failed(failure))
    for step in result.lost:
        reason = "claimed by another aggregation, which recorded this step first; nothing written"
        report.steps.append(StepOutcome(step, "skipped", reason=reason))


def _failed(failure: StepFailure) -> StepOutcome:
    return StepOutcome(failure.step, "failed", reason=failure.reason)


def _method_table() -> str:
    rows = (f"        - ``{m.name}``: {m.help.replace('`', '``')}." for m in METHOD_TABLE)
    return "\n" + "\n".join(rows) + "\n"


def _parameter_docs() -> str:
    """The numpydoc entries of the method parameters, from the options table."""
    out = []
    for p in PARAMS:
        kind = {float: "float", int: "int", bool: "bool", str: "str"}[p.type]
        extra = [f"methods: {p.methods_text}", *p.notes()]
        optional = "" if p.type is bool else ", optional"
        out.append(
            f"    {p.name} : {kind}{optional}\n        {p.help[0].upper()}{p.help[1:]} "
            f"({'; '.join(extra)}).\n"
        )
    return "".join(out)


if aggregate.__doc__:  # None under python -OO
    aggregate.__doc__ = aggregate.__doc__.replace("    {method_table}", _method_table()).replace(
        "    {method_parameters}\n", _parameter_docs()
    )
