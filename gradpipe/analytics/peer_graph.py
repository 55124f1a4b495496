"""The peers' pass over a step's chunks: what agreement and the gradient noise scale read.

::

    chunk(t, 0) chunk(t, 1) ...      one task per chunk range of tensor t (the first
       └──── tensor(t) ────┘         peer's grid): every peer's elements of it, read
              step                   together; exact partials combined per tensor,
                                     then per step into one StepFigures

Planned from the step's dump manifests, before anything is read:

- **weights**: each dump's ``num_examples`` where every dump of the step has
  one, else 1 (the dump ids fix their metadata, so the memo key needs nothing more);
- **masks**: a (peer, tensor) holding a NaN or an infinity (its statistics say
  so), or of another dtype or shape than the tensor's first holder, is left out of
  that tensor's figures, which then cover the other peers; its cells are NaN;
- **identical peers**: where every included peer lists the same chunk ids (a
  frozen tensor, or dumps taken after the all-reduce), the figures follow from
  the statistics (``K_pq = |x|²``, ``d² = 0``), and nothing is read.

A task holds every peer's elements of one chunk range (``P`` chunks).
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final

import numpy as np
from dask.base import tokenize

from gradpipe.aggregation.exact import ExactSum
from gradpipe.aggregation.inputs import parse_weight_text, where
from gradpipe.aggregation.plan import overlapping, sources_of
from gradpipe.aggregation.tasks import ChunkSource, read_group
from gradpipe.analytics.layers import model_order
from gradpipe.analytics.norm_figures import exact_sum
from gradpipe.analytics.peer_kernel import PeerPartial, combine_partials, peer_partial
from gradpipe.analytics.selection import StepSources
from gradpipe.analytics.step_figures import StepFailure, StepFigures
from gradpipe.core.display import printable
from gradpipe.core.dtypes import is_float, parse_dtype
from gradpipe.core.run_manifest import DumpManifest
from gradpipe.core.tensor_manifest import TensorManifest, resolve_tensor
from gradpipe.errors import GradpipeError
from gradpipe.storage.catalog import named_tensors, read_many

if TYPE_CHECKING:
    from gradpipe.storage.store import Store

__all__ = ["PEER_ARRAYS", "peers_graph"]

#: The arrays a step's result holds (``T`` tensors, ``P`` peers).
PEER_ARRAYS: Final = {
    "gram": "(T, P, P) float64: Σ x_p x_q",
    "dist_sq": "(T, P) float64: Σ (x_p − G)², G the weighted mean",
    "mean_sq": "(T,) float64: |G|²",
    "mean_max_abs": "(T,) float64: max |G|",
    "disagree": "(T, P, P) int64: elements non-zero in both whose signs differ",
    "both": "(T, P, P) int64: elements non-zero in both",
    "included": "(T, P) bool: the peer counts in the tensor's figures",
    "identical": "(T,) bool: every included peer stored the same chunks",
    "numel": "(T,) int64: elements of the tensor",
    "weights": "(P,) float64: num_examples, or 1 for every peer",
    "counted": "(P,) bool: the dump records its num_examples",
}


@dataclass(frozen=True)
class _Failed:
    """A task's failure, passed on to the step (which reports it and no figures)."""

    reason: str


@dataclass(frozen=True)
class _TensorPlan:
    name: str
    included: tuple[bool, ...]
    numel: int
    identical: bool
    #: With ``identical``: the shared tensor's squared norm, non-zero count, max |x|.
    shared: tuple[float, int, float] = (0.0, 0, 0.0)
    #: Stored chunks the tasks read (none for identical peers).
    reads: int = 0


def peers_graph(
    store: Store, sources: Sequence[StepSources]
) -> tuple[dict[Hashable, Any], list[Hashable]]:
    """The tasks of ``sources``' steps (each step's key gives a one-item list)."""
    graph: dict[Hashable, Any] = {}
    keys: list[Hashable] = []
    ids = [i.source for s in sources for i in s.inputs]
    dumps = iter(read_many(store, ids, DumpManifest, context="dump"))
    for step in sources:
        manifests = [next(dumps) for _ in step.inputs]
        token = tokenize(store.url, step.step, [i.source for i in step.inputs])
        key = ("gradpipe-peers", token)
        try:
            tensor_keys, plans, weights = _plan_step(store, step, manifests, graph, token)
        except GradpipeError as exc:
            graph[key] = (_failed_step, step.step, str(exc))
        else:
            graph[key] = (_assemble_step, step.step, step.labels, plans, weights, tensor_keys)
        keys.append(key)
    return graph, keys


def _failed_step(step: int, reason: str) -> list[StepFailure]:
    return [StepFailure(step, reason)]


def _plan_step(
    store: Store,
    step: StepSources,
    dumps: Sequence[DumpManifest],
    graph: dict[Hashable, Any],
    token: str,
) -> tuple[list[Hashable], list[_TensorPlan], tuple[list[float], list[bool]]]:
    if len(dumps) < 2:
        raise GradpipeError("one peer: agreement and the noise scale compare two or more")
    weights = _weights(step.step, dumps)
    counted = _counted(dumps)
    per_peer = [
        named_tensors(store, d.tensors, d.embedded, where=where(step=step.step, peer=d.peer))
        for d in dumps
    ]
    tensor_keys: list[Hashable] = []
    plans: list[_TensorPlan] = []
    for name in model_order(n for tensors in per_peer for n in tensors):
        held = [tensors.get(name) for tensors in per_peer]
        manifests = [None if t is None else resolve_tensor(t) for t in held]
        plan, first = _plan_tensor(name, manifests)
        plans.append(plan)
        key = ("gradpipe-peers-tensor", token, name)
        tensor_keys.append(key)
        if plan.identical or first is None:
            graph[key] = (_shared_partial, plan)
            continue
        chunk_keys = []
        chosen = [m for m, keep in zip(manifests, plan.included, strict=True) if keep]
        labels = [x for x, keep in zip(step.labels, plan.included, strict=True) if keep]
        sources = [sources_of(m) for m in chosen if m is not None]
        kept = [w for w, keep in zip(weights, plan.included, strict=True) if keep]
        for i, (start, stop) in enumerate(first.chunk_ranges()):
            parts = [overlapping(s, start, stop) for s in sources]
            contexts = [where(step=step.step, peer=x, tensor=name) for x in labels]
            chunk_key = ("gradpipe-peers-chunk", token, name, i)
            graph[chunk_key] = (
                _chunk_partial,
                store,
                parts,
                start,
                stop,
                first.dtype,
                contexts,
                kept,
            )
            chunk_keys.append(chunk_key)
        graph[key] = (_tensor_partial, plan, chunk_keys)
    return tensor_keys, plans, (weights, counted)


def _weights(step: int, dumps: Sequence[DumpManifest]) -> list[float]:
    """Each dump's ``num_examples`` if every dump has it, else 1 each."""
    texts = [d.metadata.get("num_examples") for d in dumps]
    if any(t is None for t in texts):
        return [1.0] * len(dumps)
    return [
        parse_weight_text(str(t), what=f"{where(step=step, peer=d.peer)}: num_examples")
        for t, d in zip(texts, dumps, strict=True)
    ]


def _counted(dumps: Sequence[DumpManifest]) -> list[bool]:
    """Which dumps record their ``num_examples`` (what the noise scale needs)."""
    return ["num_examples" in d.metadata for d in dumps]


def _plan_tensor(
    name: str, manifests: Sequence[TensorManifest | None]
) -> tuple[_TensorPlan, TensorManifest | None]:
    """Which peers count for tensor ``name``, and the manifest whose grid the tasks follow."""
    first = next((m for m in manifests if m is not None), None)
    included = []
    for m in manifests:
        ok = (
            m is not None
            and first is not None
            and (m.dtype, m.shape) == (first.dtype, first.shape)
            and is_float(parse_dtype(m.dtype))
            and not m.replays
            and m.summary().nan + m.summary().inf == 0
        )
        included.append(ok)
    numel = first.size if first is not None else 0
    chosen = [m for m, keep in zip(manifests, included, strict=True) if keep and m is not None]
    if len(chosen) < 2:
        return _TensorPlan(name, tuple(included), numel, identical=False), None
    lead = next(m for m in chosen)
    if all(m.blocks == lead.blocks for m in chosen):
        summary = lead.summary()
        peak = max((abs(v) for v in (summary.min, summary.max) if v is not None), default=0.0)
        shared = (exact_sum(s.sumsq for s in lead.stats), summary.nonzero, peak)
        return _TensorPlan(name, tuple(included), numel, True, shared), lead
    reads = sum(1 for m in chosen for b in m.blocks if b is not None)
    return _TensorPlan(name, tuple(included), numel, identical=False, reads=reads), lead


def _chunk_partial(
    store: Store,
    sources: list[list[ChunkSource]],
    start: int,
    stop: int,
    dtype: str,
    contexts: list[str],
    weights: list[float],
) -> PeerPartial | _Failed:
    try:
        rows = read_group(store, sources, start, stop, dtype, contexts)
    except GradpipeError as exc:
        return _Failed(str(exc))
    try:
        return peer_partial(rows, weights)
    except GradpipeError:  # ExactSum refuses an infinity: float64 products overflowed
        return _Failed(f"{contexts[0]}, elements {start}..{stop}: {_OVERFLOW}")


def _tensor_partial(plan: _TensorPlan, parts: list[PeerPartial | _Failed]) -> PeerPartial | _Failed:
    failed = next((p for p in parts if isinstance(p, _Failed)), None)
    if failed is not None:
        return failed
    ready = [p for p in parts if isinstance(p, PeerPartial)]
    return combine_partials(ready)


def _shared_partial(plan: _TensorPlan) -> PeerPartial | _Failed | None:
    """The figures of identical peers from the statistics, or None (fewer than two peers)."""
    p = sum(plan.included)
    if not plan.identical:
        return None
    squares, nonzero, peak = plan.shared
    if math.isinf(squares):
        return _Failed(f"tensor {printable(plan.name)}: {_OVERFLOW}")
    upper = np.triu_indices(p)
    sums = np.concatenate([np.full(len(upper[0]), squares), np.zeros(p), [squares]])
    counts = np.triu(np.full((p, p), nonzero, np.int64))
    return PeerPartial(p, ExactSum.of(sums), np.zeros((p, p), np.int64), counts, peak, nonzero)


#: Why a float64 tensor has no peer figures.
_OVERFLOW: Final = "the products of its float64 values overflow float64; it has no peer figures"


def _assemble_step(
    step: int,
    labels: list[str],
    plans: list[_TensorPlan],
    weighting: tuple[list[float], list[bool]],
    parts: list[PeerPartial | _Failed | None],
) -> list[StepFigures | StepFailure]:
    failed = next((p for p in parts if isinstance(p, _Failed)), None)
    if failed is not None:
        return [StepFailure(step, failed.reason)]
    weights, counted = weighting
    t, p = len(plans), len(labels)
    arrays = {
        "gram": np.full((t, p, p), np.nan),
        "dist_sq": np.full((t, p), np.nan),
        "mean_sq": np.full(t, np.nan),
        "mean_max_abs": np.full(t, np.nan),
        "disagree": np.zeros((t, p, p), np.int64),
        "both": np.zeros((t, p, p), np.int64),
        "included": np.array([plan.included for plan in plans], dtype=bool).reshape(t, p),
        "identical": np.array([plan.identical for plan in plans], dtype=bool),
        "numel": np.array([plan.numel for plan in plans], dtype=np.int64),
        "weights": np.array(weights, dtype=np.float64),
        "counted": np.array(counted, dtype=bool),
    }
    for j, (plan, part) in enumerate(zip(plans, parts, strict=True)):
        if not isinstance(part, PeerPartial):
            continue
        at = np.flatnonzero(plan.included)
        arrays["gram"][j][np.ix_(at, at)] = part.gram()
        arrays["dist_sq"][j][at] = part.dist_sq()
        arrays["mean_sq"][j] = part.mean_sq()
        arrays["mean_max_abs"][j] = part.mean_max_abs
        disagree, both = part.sign_counts()
        arrays["disagree"][j][np.ix_(at, at)] = disagree
        arrays["both"][j][np.ix_(at, at)] = both
    names = [plan.name for plan in plans]
    reads = sum(plan.reads for plan in plans)
    return [StepFigures(step, list(labels), names, arrays, chunks_read=reads)]
