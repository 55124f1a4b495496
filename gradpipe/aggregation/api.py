"""``aggregate``: the aggregates of a run's steps, computed from its stored dumps.

The user operation: read the run, check every step's dumps against each
other (tensor names, dtypes, shapes, no NaN or infinity, valid weights)
before anything is written, skip the steps whose aggregate the run already
records under the same memo key, then compute the rest as one graph
(:mod:`gradpipe.aggregation.graph`) under a writer's lease and report.
Methods (:data:`METHODS`): the reducible ones (sum, mean, weighted mean,
FedAvg, DP-FedAvg), the coordinate-wise robust ones (median, trimmed mean), the
selection ones (Krum, Multi-Krum, Bulyan) and the server optimizers (SGD,
FedAvgM, FedAdagrad, FedAdam, FedYogi, on a snapshot chain), with optional
per-peer L2 clipping (``clip_norm``) and clipping of the result
(``clip_aggregate``). See ``docs/design/009-aggregation.md``.
"""

from __future__ import annotations

import dataclasses
import math
import secrets
import time
from collections.abc import Mapping, Sequence
from typing import Any, Final

from gradpipe.aggregation.graph import (
    StepPlan,
    TensorPlan,
    build_aggregate_graph,
    parse_split_every,
)
from gradpipe.aggregation.inputs import (
    check_byzantine,
    parse_weight_text,
    parse_weights,
    where,
)
from gradpipe.aggregation.privacy import adaptive_noise_multiplier
from gradpipe.aggregation.reduce import AggregationMethod
from gradpipe.aggregation.report import AggregateReport, StepOutcome
from gradpipe.aggregation.rounds import claim_aggregation, release_aggregation, step_rounds
from gradpipe.aggregation.server_opt_method import (
    SERVER_METHODS,
    apply_server_steps,
    parse_server_options,
)
from gradpipe.aggregation.tasks import AggregateCommit, CommitGuard, StepFailure, StepSpec
from gradpipe.core.aggregate_manifest import AggregateInput, AggregateManifest, aggregate_key
from gradpipe.core.display import printable
from gradpipe.core.dtypes import parse_dtype
from gradpipe.core.names import parse_name
from gradpipe.core.run_manifest import DumpManifest, RunManifest
from gradpipe.core.tensor_manifest import TensorManifest
from gradpipe.errors import InvalidInputError
from gradpipe.graph.runner import Runner, use_runner
from gradpipe.graph.telemetry import reported
from gradpipe.snapshots.api import snapshot_head
from gradpipe.storage.catalog import read_rounds, read_run
from gradpipe.storage.store import Store

__all__ = ["METHODS", "AggregateReport", "StepOutcome", "aggregate"]

#: The methods :func:`aggregate` computes.
METHODS: Final = (
    "sum",
    "mean",
    "weighted-mean",
    "fedavg",
    "median",
    "trimmed-mean",
    "krum",
    "multi-krum",
    "bulyan",
    "dp-fedavg",
    *SERVER_METHODS,
)

#: Methods that weigh every peer equally (``weights`` and ``num_examples`` do not apply).
_UNWEIGHTED: Final = frozenset(
    {
        AggregationMethod.MEAN,
        AggregationMethod.MEDIAN,
        AggregationMethod.TRIMMED_MEAN,
        AggregationMethod.KRUM,
        AggregationMethod.BULYAN,
        AggregationMethod.DP_FEDAVG,
    }
)


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
        One of :data:`METHODS`. ``fedavg`` weights each peer by its dump's
        ``num_examples`` metadata (or by ``weights``); ``weighted-mean`` needs
        ``weights``; ``mean`` is unweighted; ``sum`` is the (optionally
        weighted) sum. ``median`` and ``trimmed-mean`` (``trim``) are
        coordinate-wise; ``krum`` (the update of the peer of best score),
        ``multi-krum`` (the FedAvg of the ``keep`` best) and ``bulyan`` select
        peers tolerating ``byzantine`` faulty ones; ``dp-fedavg`` is the mean
        of the updates clipped to ``clip_norm`` plus seeded Gaussian noise of
        standard deviation ``noise_multiplier * clip_norm / n``.
    name : str, optional
        What the run records the aggregates as (default: the method).
    weights : mapping of peer name to weight, optional
        Explicit weights, finite and > 0, one for every peer of every step.
    clip_norm : float, optional
        Clip each peer's update (all its tensors) to this L2 norm first
        (sum, mean, weighted mean, FedAvg; DP-FedAvg needs it: its clip norm,
        or the first step's with ``adaptive_clip``).
    clip_aggregate : float, optional
        Clip each step's result (all its tensors) to this L2 norm, as the
        seed's coordinator does, for every method: ``x * min(1, C / ‖x‖)`` in
        float64, rounded once. The norm before and the factor are recorded in
        the aggregate's params (``aggregate_norm``, ``aggregate_clip_scale``).
    trim : float, optional
        ``trimmed-mean``: drop ``int(trim * n)`` values at each end per
        coordinate, ``0 <= trim < 0.5`` (default 0.1).
    byzantine : int, optional
        ``krum``, ``multi-krum``, ``bulyan``: the faulty peers tolerated, ``f``
        (default 0). Krum needs ``n >= 2f + 3`` peers, Bulyan ``n >= 4f + 3``.
    keep : int, optional
        ``multi-krum``: how many peers of best score to average (default
        ``n - f``).
    noise_multiplier : float, optional
        ``dp-fedavg``: ``z``, the noise's standard deviation over the clip norm
        (default 1.0).
    seed : int, optional
        ``dp-fedavg``: the noise's seed (default: one is picked); recorded in
        the aggregate's params.
    adaptive_clip : bool
        ``dp-fedavg``: move the clip norm every step toward the
        ``target_quantile`` of the update norms (Andrew et al.); the first
        step starts from the run's previous aggregate of this name, or
        ``clip_norm``.
    target_quantile : float, optional
        Adaptive clipping's ``γ`` (default 0.5).
    clip_lr : float, optional
        Adaptive clipping's learning rate ``η`` (default 0.2).
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
    snapshot, server_lr : str, float
        The server optimizers (``sgd``, ``fedavgm``, ``fedadagrad``,
        ``fedadam``, ``fedyogi``): the FedAvg of each step (``weights``,
        ``clip_norm`` and ``clip_aggregate`` as for ``fedavg``) is recorded
        as ``name``, with the optimizer's config in its params, then steps the
        newest snapshot of the chain ``snapshot`` with learning rate
        ``server_lr``, writing the next snapshot at that step, in step order
        (:mod:`gradpipe.aggregation.server_opt_method`; a step is applied once per chain).
    momentum, beta1, beta2, tau, initial_accumulator, bias_correction
        The server optimizer's hyperparameters (defaults of Reddi et al.:
        :class:`~gradpipe.aggregation.server_opt.ServerOptimizerConfig`).

    Returns
    -------
    AggregateReport
        Per step: computed, memoised, skipped or failed, with the aggregate's id.

    Examples
    --------
    >>> report = gp.aggregate(store, run="r", method="fedavg")  # doctest: +SKIP
    >>> gp.open_run(store, "r").aggregate("fedavg", step=0).read("w")  # doctest: +SKIP
    """
    store.check_writable()
    started = time.perf_counter()
    server = parse_server_options(
        method,
        snapshot=snapshot,
        server_lr=server_lr,
        momentum=momentum,
        beta1=beta1,
        beta2=beta2,
        tau=tau,
        initial_accumulator=initial_accumulator,
        bias_correction=bias_correction,
    )
    if server is not None:  # the chain must exist before anything is computed
        snapshot_head(store, server.snapshot)
    chosen = AggregationMethod.FEDAVG if server is not None else _parse_method(method)
    label = parse_name(name if name is not None else method, what="aggregate name")
    fan = parse_split_every(split_every)
    params = _parse_params(
        chosen,
        clip_norm=clip_norm,
        clip_aggregate=clip_aggregate,
        trim=trim,
        byzantine=byzantine,
        keep=keep,
        noise_multiplier=noise_multiplier,
        seed=seed,
        adaptive_clip=adaptive_clip,
        target_quantile=target_quantile,
        clip_lr=clip_lr,
    )
    if server is not None:  # in the memo key: other settings are another aggregate
        params["server_optimizer"] = server.config.to_dict()
    run_id, recorded = read_run(store, run)
    report = AggregateReport(run, label, method if server else chosen.value, run_id=run_id)
    wanted = _parse_steps(recorded, steps, report)
    wanted, excluded = _ready(store, recorded, wanted, force=force, report=report)
    dumps = _load_dumps(store, recorded, wanted)
    for step, peers in excluded.items():
        dumps[step] = [d for d in dumps[step] if d.peer not in peers]
    plans = []
    for step in wanted:
        plan = _plan_step(
            store,
            recorded,
            step,
            dumps[step],
            method=chosen,
            name=label,
            params=params,
            weights=weights,
        )
        entry = recorded.aggregate_entry(step, label)
        if entry is not None and entry.key == plan.spec.key and not force:
            report.steps.append(StepOutcome(step, "memoised", entry.aggregate))
        elif entry is not None and not force and _same_inputs(store, entry.aggregate, plan):
            report.steps.append(
                StepOutcome(
                    step,
                    "skipped",
                    entry.aggregate,
                    f"already aggregated as {printable(label)} from these dumps with another "
                    "method or parameters; choose another name, or force to replace it",
                )
            )
        else:
            plans.append(plan)
    if chosen is AggregationMethod.DP_FEDAVG:
        plans = _plan_privacy(store, recorded, label, plans, params)
    if plans:
        # Claim the steps in the run's rounds: one live aggregation per (step, name).
        claim, refused = claim_aggregation(store, run, label, [p.spec.step for p in plans])
        report.steps += [StepOutcome(s, "skipped", reason=r) for s, r in refused.items()]
        plans = [p for p in plans if p.spec.step not in refused]
        seen = {}
        for p in plans:
            entry = recorded.aggregate_entry(p.spec.step, label)
            seen[p.spec.step] = entry.aggregate if entry is not None else None
        try:
            if plans:
                result = _compute(
                    store,
                    plans,
                    runner,
                    params=params,
                    fan=fan,
                    guard=CommitGuard(label, claim, seen),
                )
                _add_commit(report, result)
        finally:
            release_aggregation(store, run, claim)
    report.steps.sort(key=lambda s: s.step)
    if server is not None:
        apply_server_steps(store, report, server, runner)
    report.seconds = time.perf_counter() - started
    return report


def _compute(
    store: Store,
    plans: list[StepPlan],
    runner: Runner | None,
    *,
    params: dict[str, Any],
    fan: int,
    guard: CommitGuard,
) -> AggregateCommit:
    spec = plans[0].spec
    with use_runner(runner) as active, store.writing(f"aggregate run {spec.run}") as lease:
        message = f"aggregate {spec.name} ({spec.method}) of {len(plans)} steps"
        graph, key = build_aggregate_graph(
            store,
            plans,
            clip_norm=params.get("clip_norm"),
            split_every=fan,
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


def _parse_method(method: str) -> AggregationMethod:
    if method not in METHODS:
        raise InvalidInputError(
            f"aggregation method {printable(method)} is not one gradpipe computes yet; "
            f"choose one of {', '.join(METHODS)}"
        )
    return AggregationMethod(method)


def _number(name: str, value: object, *, low: float, high: float = math.inf) -> float:
    """A finite number in ``[low, high)`` (``low`` excluded when it is 0 for a scale)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise InvalidInputError(f"{name} {printable(value)} must be a number")
    number = float(value)
    if not math.isfinite(number) or not low <= number < high:
        span = f">= {low}" if high == math.inf else f"in [{low}, {high})"
        raise InvalidInputError(f"{name} {printable(value)} must be a finite number {span}")
    return number


def _count(name: str, value: object, *, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise InvalidInputError(f"{name} {printable(value)} must be an integer >= {low}")
    return value


def _parse_params(
    method: AggregationMethod,
    *,
    clip_norm: float | None,
    clip_aggregate: float | None,
    trim: float | None,
    byzantine: int | None,
    keep: int | None,
    noise_multiplier: float | None,
    seed: int | None,
    adaptive_clip: bool,
    target_quantile: float | None,
    clip_lr: float | None,
) -> dict[str, Any]:
    """The method's parameters, checked; an option the method does not take is refused."""
    given = {
        "clip_norm": clip_norm,
        "trim": trim,
        "byzantine": byzantine,
        "keep": keep,
        "noise_multiplier": noise_multiplier,
        "seed": seed,
        "adaptive_clip": adaptive_clip or None,
        "target_quantile": target_quantile,
        "clip_lr": clip_lr,
    }
    takes = {
        AggregationMethod.TRIMMED_MEAN: {"trim"},
        AggregationMethod.KRUM: {"byzantine"},
        AggregationMethod.MULTI_KRUM: {"byzantine", "keep"},
        AggregationMethod.BULYAN: {"byzantine"},
        AggregationMethod.DP_FEDAVG: {
            "clip_norm",
            "noise_multiplier",
            "seed",
            "adaptive_clip",
            "target_quantile",
            "clip_lr",
        },
    }.get(method, {"clip_norm"} if method.reducible else set())
    extra = sorted(k for k, v in given.items() if v is not None and k not in takes)
    if extra:
        raise InvalidInputError(
            f"{method.value} takes no {', '.join(extra)}; "
            + (f"it takes {', '.join(sorted(takes))}" if takes else "it takes no parameters")
        )
    params: dict[str, Any] = {}
    if clip_aggregate is not None:  # every method: it acts on the result
        params["clip_aggregate"] = _number("clip_aggregate", clip_aggregate, low=0.0)
        if params["clip_aggregate"] <= 0:
            raise InvalidInputError(
                f"clip_aggregate {printable(clip_aggregate)} must be a finite number > 0"
            )
    if clip_norm is not None:
        params["clip_norm"] = _number("clip_norm", clip_norm, low=0.0)
        if params["clip_norm"] <= 0:
            raise InvalidInputError(f"clip_norm {printable(clip_norm)} must be a finite number > 0")
    if method is AggregationMethod.TRIMMED_MEAN:
        params["trim"] = _number("trim", 0.1 if trim is None else trim, low=0.0, high=0.5)
    if method in (AggregationMethod.KRUM, AggregationMethod.MULTI_KRUM, AggregationMethod.BULYAN):
        params["byzantine"] = _count("byzantine", 0 if byzantine is None else byzantine, low=0)
    if keep is not None:
        params["keep"] = _count("keep", keep, low=1)
    if method is AggregationMethod.DP_FEDAVG:
        if clip_norm is None:
            raise InvalidInputError(
                "dp-fedavg needs a clip norm (--clip-norm C): the noise is scaled to it"
            )
        z = 1.0 if noise_multiplier is None else noise_multiplier
        params["noise_multiplier"] = _number("noise_multiplier", z, low=0.0)
        if seed is not None:
            params["seed"] = _count("seed", seed, low=0)
        if adaptive_clip:
            params["adaptive_clip"] = True
            gamma = 0.5 if target_quantile is None else target_quantile
            params["target_quantile"] = _number("target_quantile", gamma, low=0.0, high=1.0)
            params["clip_lr"] = _number("clip_lr", 0.2 if clip_lr is None else clip_lr, low=0.0)
            if params["clip_lr"] <= 0:
                raise InvalidInputError(f"clip_lr {printable(clip_lr)} must be a finite number > 0")
        elif target_quantile is not None or clip_lr is not None:
            raise InvalidInputError(
                "target_quantile and clip_lr are adaptive clipping's (--adaptive-clip)"
            )
    return params


def _parse_steps(
    recorded: RunManifest, steps: range | Sequence[int] | None, report: AggregateReport
) -> list[int]:
    present = set(recorded.steps)
    if steps is None:
        if not present:
            raise InvalidInputError(f"run {printable(recorded.run)} has no dumps to aggregate")
        return recorded.steps
    if isinstance(steps, range):
        wanted = [s for s in steps if s in present]
        report.steps.extend(StepOutcome(s, "skipped") for s in steps if s not in present)
        if not wanted:
            raise InvalidInputError(
                f"run {printable(recorded.run)} has no dumps in steps {steps.start}:{steps.stop} "
                f"(it has steps {_span(recorded.steps)})"
            )
        return wanted
    out = []
    for s in steps:
        if isinstance(s, bool) or not isinstance(s, int):
            raise InvalidInputError(f"step {printable(s)} is not an integer")
        if s not in present:
            raise InvalidInputError(
                f"step {s}: run {printable(recorded.run)} has no dumps at this step, nothing to "
                f"aggregate (it has steps {_span(recorded.steps)})"
            )
        if s not in out:
            out.append(s)
    return sorted(out)


def _span(steps: list[int]) -> str:
    if not steps:
        return "none"
    return f"{steps[0]}..{steps[-1]}" if len(steps) > 1 else str(steps[0])


def _load_dumps(
    store: Store, recorded: RunManifest, steps: list[int]
) -> dict[int, list[DumpManifest]]:
    """The dump manifests of ``steps``, in peer order (one batched read)."""
    entries = [e for s in steps for e in recorded.step_dumps(s)]
    manifests = store.get_typed_many(
        [e.dump for e in entries], DumpManifest, context=f"run {printable(recorded.run)}"
    )
    out: dict[int, list[DumpManifest]] = {s: [] for s in steps}
    for entry, manifest in zip(entries, manifests, strict=True):
        out[entry.step].append(manifest)
    return out


def _peer_weights(
    step: int,
    dumps: list[DumpManifest],
    method: AggregationMethod,
    weights: Mapping[str, float] | None,
) -> tuple[float, ...]:
    peers = [d.peer for d in dumps]
    if method in _UNWEIGHTED:
        if weights is not None:
            raise InvalidInputError(
                f"{method.value} is unweighted; use weighted-mean, fedavg or multi-krum with "
                "weights"
            )
        return (1.0,) * len(dumps)
    if weights is not None:
        missing = [p for p in peers if p not in weights]
        if missing:
            raise InvalidInputError(
                f"{where(step=step, peer=missing[0])}: no weight given; --weights must name "
                "every peer of every step aggregated"
            )
        return parse_weights([weights[p] for p in peers], step=step, peers=peers)
    if method is AggregationMethod.SUM:
        return (1.0,) * len(dumps)
    if method is AggregationMethod.WEIGHTED_MEAN:
        raise InvalidInputError(
            "weighted-mean needs explicit weights (--weights '{\"peer\": w, ...}'); fedavg "
            "takes them from each dump's num_examples"
        )
    values = []
    for dump in dumps:
        text = dump.metadata.get("num_examples")
        if text is None:
            raise InvalidInputError(
                f"{where(step=step, peer=dump.peer)}: the dump has no num_examples metadata "
                f"for {method.value}; give --weights, or use mean"
            )
        try:
            values.append(parse_weight_text(text, what="num_examples"))
        except InvalidInputError as exc:
            raise InvalidInputError(f"{where(step=step, peer=dump.peer)}: {exc}") from None
    return parse_weights(values, step=step, peers=peers)


def _plan_step(
    store: Store,
    recorded: RunManifest,
    step: int,
    dumps: list[DumpManifest],
    *,
    method: AggregationMethod,
    name: str,
    params: dict[str, Any],
    weights: Mapping[str, float] | None,
) -> StepPlan:
    """Check one step's dumps against each other and define its aggregate; nothing is read."""
    if not dumps:
        raise InvalidInputError(f"step {step}: no dumps to aggregate (empty peer set)")
    values = _peer_weights(step, dumps, method, weights)
    params = _step_params(step, len(dumps), method, params)
    first = dumps[0]
    names = [n for n, _ in first.tensors]
    per_peer = [_infos(store, d) for d in dumps]
    for dump, infos in zip(dumps, per_peer, strict=True):
        missing = [n for n in names if n not in infos]
        extra = [n for n in infos if n not in names]
        if missing or extra:
            tensor = (missing or extra)[0]
            holder = first.peer if missing else dump.peer
            raise InvalidInputError(
                f"{where(step=step, peer=dump.peer, tensor=tensor)}: peer {printable(holder)} has "
                f"this tensor and peer {printable(dump.peer if missing else first.peer)} has not; "
                "every peer of a step must send the same tensors"
            )
    tensors = []
    for tensor in names:
        ref = per_peer[0][tensor]
        for dump, infos in zip(dumps, per_peer, strict=True):
            info = infos[tensor]
            context = where(step=step, peer=dump.peer, tensor=tensor)
            dtype = parse_dtype(info.dtype)
            if dtype.kind != "f" and dtype.name != "bfloat16":
                raise InvalidInputError(
                    f"{context}: dtype {info.dtype} cannot be averaged; aggregation needs floats"
                )
            if (info.dtype, info.shape) != (ref.dtype, ref.shape):
                raise InvalidInputError(
                    f"{context}: {info.dtype}{list(info.shape)} differs from peer "
                    f"{printable(first.peer)}'s {ref.dtype}{list(ref.shape)}; every peer must send "
                    "the tensor with one shape and dtype"
                )
            summary = info.summary()
            if summary.nan or summary.inf:
                raise InvalidInputError(
                    f"{context}: the update holds {summary.nan} NaN and {summary.inf} infinite "
                    "values; drop the peer or fix its dump"
                )
        tensors.append(
            TensorPlan(tensor, ref.dtype, ref.shape, tuple(infos[tensor] for infos in per_peer))
        )
    entries = {e.peer: e.dump for e in recorded.step_dumps(step)}
    inputs = tuple(
        AggregateInput(d.peer, entries[d.peer], w) for d, w in zip(dumps, values, strict=True)
    )
    key = aggregate_key(method.value, params, inputs)
    spec = StepSpec(recorded.run, step, name, method.value, params, inputs, key, tuple(names))
    return StepPlan(spec, tuple(tensors))


def _step_params(
    step: int, n: int, method: AggregationMethod, params: dict[str, Any]
) -> dict[str, Any]:
    """The parameters of one step's aggregate: enough peers for the method, defaults by ``n``."""
    if method not in (
        AggregationMethod.KRUM,
        AggregationMethod.MULTI_KRUM,
        AggregationMethod.BULYAN,
    ):
        return params
    f = int(params["byzantine"])
    out = dict(params)
    if method is AggregationMethod.MULTI_KRUM and "keep" not in out:
        out["keep"] = max(1, n - f)  # the peers Krum trusts
    check_byzantine(n, f, method=method.value, keep=out.get("keep"), step=step)
    return out


def _plan_privacy(
    store: Store,
    recorded: RunManifest,
    name: str,
    plans: list[StepPlan],
    params: dict[str, Any],
) -> list[StepPlan]:
    """DP-FedAvg's decisions before the graph: the seed, the noise, the clip norm to start from.

    Without a given seed one is picked for the call and recorded (and the memo
    key, which has no seed, finds the aggregate again). Adaptive clipping starts
    each step from the previous step's recorded ``next_clip_norm`` (the
    previous step in this call chains in the graph), or ``clip_norm``.
    """
    seed = params.get("seed")
    decided_seed = {} if seed is not None else {"seed": secrets.randbelow(2**63)}
    z = float(params["noise_multiplier"])
    out = []
    previous_step: int | None = None
    order = recorded.steps
    for plan in plans:
        step, n = plan.spec.step, len(plan.spec.inputs)
        decided: dict[str, Any] = dict(decided_seed)
        clip_start: float | None = None
        if params.get("adaptive_clip"):
            sigma = n / 20 if z > 0 else 0.0  # Andrew et al.'s default count noise
            try:
                decided["update_noise_multiplier"] = adaptive_noise_multiplier(z, sigma)
            except InvalidInputError as exc:
                raise InvalidInputError(
                    f"step {step}: {exc} (the count noise is n/20 for {n} peers); "
                    "lower --noise-multiplier"
                ) from None
            decided["count_stddev"] = sigma
            before = [s for s in order if s < step]
            if not before or before[-1] != previous_step:
                clip_start = _recorded_clip_norm(store, recorded, name, before, params)
        else:
            decided["update_noise_multiplier"] = z
        out.append(dataclasses.replace(plan, decided=decided, clip_start=clip_start))
        previous_step = step
    return out


def _recorded_clip_norm(
    store: Store, recorded: RunManifest, name: str, before: list[int], params: dict[str, Any]
) -> float:
    """Where adaptive clipping resumes: the previous step's recorded next clip norm."""
    if before:
        entry = recorded.aggregate_entry(before[-1], name)
        if entry is not None:
            manifest = store.get_typed(
                entry.aggregate, AggregateManifest, context=f"aggregate {printable(name)}"
            )
            value = manifest.params.get("next_clip_norm")
            if isinstance(value, int | float) and math.isfinite(value) and value > 0:
                return float(value)
    return float(params["clip_norm"])


def _infos(store: Store, dump: DumpManifest) -> dict[str, TensorManifest]:
    """Every tensor's manifest (dumps of format 1 keep them apart: one batched read)."""
    apart = [t for _, t in dump.tensors if t not in dump.embedded]
    fetched = store.get_typed_many(
        apart, TensorManifest, context=where(step=dump.step, peer=dump.peer)
    )
    manifests = {**dict(zip(apart, fetched, strict=True)), **dump.embedded}
    return {tensor: manifests[tensor_id] for tensor, tensor_id in dump.tensors}


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
