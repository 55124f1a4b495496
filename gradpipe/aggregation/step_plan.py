"""Each step's aggregate, planned before anything is read: the steps asked for, every step's
dumps checked against each other (tensor names, dtypes, shapes, no NaN or infinity), the peers'
weights, the method's parameters at that step, and DP-FedAvg's decisions (seed, noise, where
adaptive clipping resumes). :func:`gradpipe.aggregate` (:mod:`gradpipe.aggregation.api`) then
memoises, claims and computes what is planned here.
"""

from __future__ import annotations

import dataclasses
import math
import secrets
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Final

from gradpipe.aggregation.graph import StepPlan, TensorPlan
from gradpipe.aggregation.inputs import check_byzantine, parse_weight_text, parse_weights, where
from gradpipe.aggregation.privacy import adaptive_noise_multiplier
from gradpipe.aggregation.reduce import AggregationMethod
from gradpipe.aggregation.report import AggregateReport, StepOutcome
from gradpipe.aggregation.tasks import StepSpec
from gradpipe.core.aggregate_manifest import AggregateInput, AggregateManifest, aggregate_key
from gradpipe.core.display import printable
from gradpipe.core.dtypes import parse_dtype
from gradpipe.core.run_manifest import DumpManifest, RunManifest
from gradpipe.core.tensor_manifest import TensorManifest, resolve_tensor
from gradpipe.errors import InvalidInputError
from gradpipe.storage.catalog import named_tensors

if TYPE_CHECKING:
    from gradpipe.storage.store import Store

__all__ = ["UNWEIGHTED", "load_dumps", "parse_steps", "plan_privacy", "plan_step"]

#: Methods that weigh every peer equally (``weights`` and ``num_examples`` do not apply).
UNWEIGHTED: Final = frozenset(
    {
        AggregationMethod.MEAN,
        AggregationMethod.MEDIAN,
        AggregationMethod.TRIMMED_MEAN,
        AggregationMethod.KRUM,
        AggregationMethod.BULYAN,
        AggregationMethod.DP_FEDAVG,
    }
)


def parse_steps(
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


def load_dumps(
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
    if method in UNWEIGHTED:
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


def plan_step(
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


def plan_privacy(
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
    found = named_tensors(
        store, dump.tensors, dump.embedded, where=where(step=dump.step, peer=dump.peer)
    )
    return {name: resolve_tensor(tensor) for name, tensor in found.items()}
