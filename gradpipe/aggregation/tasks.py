"""The tasks of the aggregate graph: what runs on workers, one chunk of one peer at a time.

The graph is built by :mod:`gradpipe.aggregation.graph`; its task keys are::

    gradpipe-aggregate-norm      one stored chunk's squared norm     ┐ with clip_norm:
    gradpipe-aggregate-normsum   exact sums of norms (bounded tree)  │ per peer, before
    gradpipe-aggregate-scale     min(1, C / norm)                    ┘ the leaves
    gradpipe-aggregate-read      one chunk of ≤ split_every peers →   per (peer group, chunk)
                                 their Partial
    gradpipe-aggregate-combine   ≤ split_every partials, peer order   a tree per chunk
    gradpipe-aggregate-write     finish ≤ split_every partials,       per chunk
                                 encode, write the block
    gradpipe-aggregate-reduce    read ≤ split_every peers, reduce,    per chunk, instead of
                                 finish, write                        the three above
    gradpipe-aggregate-tensor    the tensor's manifest                per tensor
    gradpipe-aggregate-manifest  the aggregate's manifest             per step
    gradpipe-aggregate-commit    one compare-and-swap of the run      per call

Tasks take the store and small descriptions of chunks (:class:`ChunkSource`),
never arrays from the client. A task that fails returns a :class:`StepFailure`
instead of raising, and every later task of that step passes it on, so the
other steps of the call are still committed.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, ParamSpec, TypeVar

import numpy as np

from gradpipe._version import __version__
from gradpipe.aggregation.exact import ExactSum
from gradpipe.aggregation.privacy import clip_scale, sq_norm_partial
from gradpipe.aggregation.reduce import (
    AggregationMethod,
    Partial,
    combine,
    finish,
    finish_peers,
    partial_of,
)
from gradpipe.core.aggregate_manifest import AggregateInput, AggregateManifest
from gradpipe.core.chain import DeltaLink
from gradpipe.core.dtypes import parse_dtype
from gradpipe.core.ids import hash_bytes
from gradpipe.core.manifest import encode_manifest
from gradpipe.core.run_manifest import AggregateEntry, RunManifest, record_aggregates
from gradpipe.core.tensor_manifest import TensorManifest
from gradpipe.errors import InvalidInputError
from gradpipe.graph.arrays import load_chunk
from gradpipe.storage.blocks import WriteStats
from gradpipe.storage.catalog import read_rounds, read_run_at, run_ref
from gradpipe.storage.reads import ChunkRead, decode_chunks
from gradpipe.storage.store import Store
from gradpipe.storage.tensors import ChunkRecord, build_tensor_manifest, write_chunks

__all__ = [
    "AggregateCommit",
    "ChunkSource",
    "CommitGuard",
    "StepFailure",
    "StepResult",
    "StepSpec",
    "combine_norms",
    "combine_partials",
    "commit_aggregates",
    "peer_scale",
    "read_group",
    "read_partial",
    "read_sq_norm",
    "reduce_chunk",
    "store_aggregate",
    "tensor_manifest",
    "write_chunk",
    "write_result",
]

P = ParamSpec("P")
R = TypeVar("R")


@dataclass(frozen=True, slots=True)
class ChunkSource:
    """One stored chunk of a peer's tensor: flat range ``[start, stop)`` and how to decode it."""

    block: str | None  # None: an all-zero chunk
    start: int
    stop: int
    frame: bytes | None = None
    links: tuple[DeltaLink, ...] = ()


@dataclass(frozen=True)
class StepFailure:
    """A step whose aggregate could not be computed, and why."""

    step: int
    reason: str

    def to_dict(self) -> dict[str, Any]:
        return {"step": self.step, "reason": self.reason}


def _isolated(func: Callable[P, R]) -> Callable[P, R | StepFailure]:
    """Run a task of one step (its first argument); an exception becomes a :class:`StepFailure`.

    Failures from upstream tasks (arguments, or items of list arguments) pass through.
    """

    @functools.wraps(func)
    def task(*args: P.args, **kwargs: P.kwargs) -> R | StepFailure:
        for arg in args:
            items = arg if isinstance(arg, list) else [arg]
            failed = next((x for x in items if isinstance(x, StepFailure)), None)
            if failed is not None:
                return failed
        try:
            return func(*args, **kwargs)
        except Exception as exc:
            step = args[0]
            reason = str(exc) or type(exc).__name__
            return StepFailure(step if isinstance(step, int) else -1, reason)

    return task


def _read(
    store: Store, sources: Sequence[ChunkSource], start: int, stop: int, dtype: str, context: str
) -> np.ndarray:
    """The flat elements ``[start, stop)`` of a peer's tensor, from the chunks that hold them."""
    if len(sources) == 1 and (sources[0].start, sources[0].stop) == (start, stop):
        s = sources[0]
        return load_chunk(store, s.block, dtype, (stop - start,), context, s.frame, s.links)
    # The peer's tensor was chunked on another grid: copy the overlaps.
    out = np.empty(stop - start, dtype=parse_dtype(dtype))
    for s in sources:
        chunk = load_chunk(store, s.block, dtype, (s.stop - s.start,), context, s.frame, s.links)
        lo, hi = max(start, s.start), min(stop, s.stop)
        out[lo - start : hi - start] = chunk[lo - s.start : hi - s.start]
    return out


# --- per-peer clipping ------------------------------------------------------------
@_isolated
def read_sq_norm(
    step: int, store: Store, source: ChunkSource, dtype: str, context: str
) -> ExactSum:
    """One stored chunk's share of its peer's squared L2 norm."""
    if source.block is None:
        return ExactSum.of(np.array(0.0))
    return sq_norm_partial(_read(store, [source], source.start, source.stop, dtype, context))


@_isolated
def combine_norms(step: int, parts: list[ExactSum]) -> ExactSum:
    """Exact sum of norm shares: the same bits for any tree."""
    return ExactSum.combine(parts)


@_isolated
def peer_scale(step: int, total: ExactSum, clip_norm: float) -> float:
    """The peer's clipping factor ``min(1, C / norm)``."""
    return clip_scale(total, clip_norm)


# --- the reduction ----------------------------------------------------------------
def read_group(
    store: Store,
    sources: Sequence[Sequence[ChunkSource]],
    start: int,
    stop: int,
    dtype: str,
    contexts: Sequence[str],
) -> list[np.ndarray]:
    """The flat elements ``[start, stop)`` of several peers' tensor, in peer order.

    The peers' blocks are fetched together (one batched read: concurrent
    requests on S3) and decoded straight into one array, a row per peer.
    """
    rows = np.empty((len(sources), stop - start), dtype=parse_dtype(dtype))
    reads = []
    for row, peer_sources, context in zip(rows, sources, contexts, strict=True):
        if len(peer_sources) != 1 or (peer_sources[0].start, peer_sources[0].stop) != (start, stop):
            row[...] = _read(store, peer_sources, start, stop, dtype, context)  # another grid
            continue
        s = peer_sources[0]
        if s.block is None:
            row[...] = 0
        else:
            reads.append(ChunkRead(s.block, row, context, s.frame, s.links))
    decode_chunks(store, reads)
    return list(rows)


@_isolated
def read_partial(
    step: int,
    store: Store,
    sources: list[list[ChunkSource]],
    start: int,
    stop: int,
    dtype: str,
    contexts: list[str],
    where: str,
    names: list[str],
    first: int,
    weights: list[float],
    scales: list[float],
    shift: int,
) -> Partial:
    """One chunk of the contiguous peers ``first ..``, read and reduced to their :class:`Partial`.

    ``contexts`` name each peer's chunk in read errors, ``where`` the chunk in
    others; ``shift`` is the step's :func:`~gradpipe.aggregation.reduce.weight_shift`.
    """
    chunks = read_group(store, sources, start, stop, dtype, contexts)
    try:
        return partial_of(
            chunks, first=first, weights=weights, scales=scales, names=names, shift=shift
        )
    except InvalidInputError as exc:
        raise InvalidInputError(f"{where}: {exc}") from None


@_isolated
def combine_partials(step: int, parts: list[Partial]) -> Partial:
    """Adjacent peer ranges merged (at most ``split_every`` of them)."""
    return combine(parts)


@dataclass(frozen=True)
class ChunkOut:
    """One written chunk of an aggregate tensor."""

    record: ChunkRecord
    stats: WriteStats


def write_result(store: Store, result: np.ndarray, context: str) -> ChunkOut:
    """Encode and write one chunk of an aggregate."""
    stats = WriteStats()
    [record] = write_chunks(store, [result.reshape(-1)], stats=stats, where=context)
    return ChunkOut(record, stats)


@_isolated
def write_chunk(
    step: int, store: Store, parts: list[Partial], method: str, peers: int, context: str
) -> ChunkOut:
    """Finish a chunk's reduction from the partials covering every peer (one rounding), write it."""
    try:
        result = finish(parts, method=AggregationMethod(method), peers=peers)
    except InvalidInputError as exc:
        raise InvalidInputError(f"{context}: {exc}") from None
    return write_result(store, result, context)


@_isolated
def reduce_chunk(
    step: int,
    store: Store,
    sources: list[list[ChunkSource]],
    start: int,
    stop: int,
    dtype: str,
    contexts: list[str],
    where: str,
    names: list[str],
    weights: list[float],
    scales: list[float],
    method: str,
) -> ChunkOut:
    """One chunk of every peer (at most ``split_every``), reduced, rounded and written in one task.

    The same bits as the leaves, combines and finish of a tree, with no float64
    array of the chunk at all.
    """
    chunks = read_group(store, sources, start, stop, dtype, contexts)
    try:
        result = finish_peers(
            chunks, method=AggregationMethod(method), weights=weights, scales=scales, names=names
        )
    except InvalidInputError as exc:
        raise InvalidInputError(f"{where}: {exc}") from None
    return write_result(store, result, where)


@dataclass(frozen=True)
class TensorOut:
    """One aggregate tensor: its manifest and what writing its chunks did."""

    manifest: TensorManifest
    stats: WriteStats


@_isolated
def tensor_manifest(
    step: int,
    dtype: str,
    shape: tuple[int, ...],
    chunk_shape: tuple[int, ...],
    outs: list[ChunkOut],
) -> TensorOut:
    """The manifest of one aggregate tensor from its chunks, in chunk order."""
    stats = WriteStats()
    for out in outs:
        stats.add(out.stats)
    return TensorOut(
        build_tensor_manifest(dtype, shape, chunk_shape, [o.record for o in outs]), stats
    )


@dataclass(frozen=True)
class StepSpec:
    """What defines the aggregate of one step (everything but its tensors)."""

    run: str
    step: int
    name: str
    method: str
    params: dict[str, Any]
    inputs: tuple[AggregateInput, ...]
    key: str
    tensor_names: tuple[str, ...]


@dataclass(frozen=True)
class StepResult:
    """An aggregate stored, not yet recorded in its run."""

    entry: AggregateEntry
    stats: WriteStats
    logical_bytes: int


@_isolated
def store_aggregate(
    step: int,
    store: Store,
    spec: StepSpec,
    tensors: list[TensorOut],
    outcome: list[dict[str, Any]] | None = None,
) -> StepResult:
    """Store the aggregate manifest of one step, its tensors' manifests inside.

    ``outcome``: what the computation decided (a selection and its scores, the
    clip norm used, a seed picked), recorded in ``params`` beside the
    parameters asked for; the memo key stays that of the parameters asked for.
    """
    params = dict(spec.params)
    for decided in outcome or []:  # a failed decision never gets here (_isolated)
        params.update(decided)
    stats = WriteStats()
    embedded: dict[str, TensorManifest] = {}
    pairs: list[tuple[str, str]] = []
    for name, out in zip(spec.tensor_names, tensors, strict=True):
        stats.add(out.stats)
        tensor_id = hash_bytes(encode_manifest(out.manifest))
        embedded[tensor_id] = out.manifest
        pairs.append((name, tensor_id))
    manifest = AggregateManifest(
        run=spec.run,
        step=spec.step,
        name=spec.name,
        method=spec.method,
        params=params,
        inputs=spec.inputs,
        tensors=tuple(pairs),
        key=spec.key,
        provenance={"gradpipe": __version__},
        embedded=embedded,
    )
    [aggregate_id] = store.put_manifests([manifest], stats=stats)
    logical = sum(t.manifest.nbytes for t in tensors)
    return StepResult(AggregateEntry(spec.step, spec.name, aggregate_id, spec.key), stats, logical)


@dataclass(frozen=True)
class AggregateCommit:
    """What the commit published."""

    run_id: str | None
    committed: list[StepResult] = field(default_factory=list)
    failures: list[StepFailure] = field(default_factory=list)
    #: Steps not recorded: another aggregation claimed or recorded them meanwhile.
    lost: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class CommitGuard:
    """What the commit checks, per step, before it records an aggregate (see gradpipe.rounds).

    The step's claim in the run's rounds must still be ``claim_id``'s, and the
    run must still record for (step, name) what it did when the step was
    planned (``seen``: the aggregate id, or None): otherwise another
    aggregation took the step over, and this one records nothing for it.
    """

    name: str
    claim_id: str
    seen: dict[int, str | None]

    def lost(self, store: Store, run: str, base: RunManifest, steps: list[int]) -> set[int]:
        _, rounds = read_rounds(store, run)
        out = set()
        for step in steps:
            claim = rounds.claim(step, self.name)
            entry = base.aggregate_entry(step, self.name)
            now = entry.aggregate if entry is not None else None
            if claim is None or claim.claim_id != self.claim_id or now != self.seen.get(step):
                out.add(step)
        return out


class _NothingLeftError(Exception):
    """Every step of the commit was taken over by another aggregation."""


def commit_aggregates(
    store: Store,
    run: str,
    results: list[StepResult | StepFailure],
    message: str,
    lease: str | None = None,
    guard: CommitGuard | None = None,
) -> AggregateCommit:
    """Record every stored aggregate in the run with one compare-and-swap.

    The run is re-read at the swap: a concurrent ingest's dumps (or another
    aggregate's entries) are kept, and only this call's (step, name) entries change.
    With a ``guard``, steps another aggregation took over are left out (``lost``).
    """
    failures = [r for r in results if isinstance(r, StepFailure)]
    done = [r for r in results if isinstance(r, StepResult)]
    if not done:
        return AggregateCommit(None, [], failures)
    kept = list(done)

    def decide(current: str | None) -> str | None:
        base = read_run_at(store, current, run) if current else RunManifest(run)
        lost = (
            set() if guard is None else guard.lost(store, run, base, [r.entry.step for r in done])
        )
        kept[:] = [r for r in done if r.entry.step not in lost]
        if not kept:
            raise _NothingLeftError
        return store.put_manifest(record_aggregates(base, [r.entry for r in kept]))

    with store.lock.join(lease):
        try:
            entry = store.refs.update(run_ref(run), decide, message=message)
        except _NothingLeftError:
            return AggregateCommit(None, [], failures, [r.entry.step for r in done])
    lost = [r.entry.step for r in done if r not in kept]
    return AggregateCommit(entry.target, kept, failures, lost)
