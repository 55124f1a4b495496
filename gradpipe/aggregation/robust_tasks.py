"""The tasks of the robust and private aggregates: what runs on workers.

Built by :mod:`gradpipe.aggregation.robust_graph`; the task keys::

    gradpipe-aggregate-robust     median / trimmed mean of one chunk of every peer  per chunk
    gradpipe-aggregate-distance   one chunk's share of the (n, n) distances          per chunk
    gradpipe-aggregate-distsum    exact sums of distance shares (bounded tree)       per step
    gradpipe-aggregate-select     Krum / Multi-Krum / Bulyan's selection             per step
    gradpipe-aggregate-selected   one chunk of the result from the selected peers    per chunk
    gradpipe-aggregate-clipround  adaptive clipping: the clip norm of the step       per step

A task that holds peers' chunks holds one chunk of at most every peer
(``n x chunk``), never a whole tensor. The selection and the clip norm of a
step are small values the aggregate records in its ``params``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from gradpipe.aggregation.exact import ExactSum
from gradpipe.aggregation.privacy import clip_scale, gaussian_noise, update_clip_norm
from gradpipe.aggregation.reduce import (
    AggregationMethod,
    Partial,
    combine,
    finish,
    partial,
    weight_shift,
)
from gradpipe.aggregation.robust import (
    bulyan_combine,
    bulyan_select,
    krum_scores,
    krum_select,
    median,
    pairwise_sq_distances_partial,
    trimmed_mean,
)
from gradpipe.aggregation.tasks import (
    ChunkOut,
    ChunkSource,
    _isolated,
    _read,
    read_group,
    write_result,
)
from gradpipe.errors import InvalidInputError
from gradpipe.storage.store import Store

__all__ = [
    "ClipRound",
    "Selection",
    "clip_round",
    "clip_round_params",
    "read_distances",
    "robust_chunk",
    "round_scale",
    "select_peers",
    "selected_chunk",
    "selection_params",
    "write_noised_chunk",
]


# --- coordinate-wise: median, trimmed mean -------------------------------------------
@_isolated
def robust_chunk(
    step: int,
    store: Store,
    sources: list[list[ChunkSource]],
    start: int,
    stop: int,
    dtype: str,
    contexts: list[str],
    method: str,
    trim: float,
    context: str,
) -> ChunkOut:
    """One chunk of every peer, reduced coordinate-wise (median or trimmed mean), written."""
    chunks = read_group(store, sources, start, stop, dtype, contexts)
    # ``context`` names the aggregate, tensor, step and chunk: it leads the message once,
    # as write_chunk's does, rather than being passed as a tensor name.
    try:
        if method == AggregationMethod.MEDIAN:
            result = median(chunks)
        else:
            result = trimmed_mean(chunks, trim)
    except InvalidInputError as exc:
        raise InvalidInputError(f"{context}: {exc}") from None
    return write_result(store, result, context)


# --- Krum, Multi-Krum, Bulyan ---------------------------------------------------------
@_isolated
def read_distances(
    step: int,
    store: Store,
    sources: list[list[ChunkSource]],
    start: int,
    stop: int,
    dtype: str,
    contexts: list[str],
) -> ExactSum:
    """One chunk's share of the peers' pairwise squared distances, as an exact sum."""
    chunks = read_group(store, sources, start, stop, dtype, contexts)
    return ExactSum.of(pairwise_sq_distances_partial(chunks))


@dataclass(frozen=True)
class Selection:
    """The peers a selection method kept (ascending indices) and every peer's Krum score."""

    peers: tuple[int, ...]
    names: tuple[str, ...]
    scores: tuple[float, ...]

    def to_params(self) -> dict[str, Any]:
        return {
            "selected": [self.names[i] for i in self.peers],
            "scores": dict(zip(self.names, self.scores, strict=True)),
        }


@_isolated
def select_peers(
    step: int, total: ExactSum, method: str, byzantine: int, keep: int, names: list[str]
) -> Selection:
    """Krum's, Multi-Krum's or Bulyan's selection from the summed distances."""
    dist = total.to_array()
    if method == AggregationMethod.BULYAN:
        chosen = bulyan_select(dist, byzantine, step=step)
    else:
        chosen = krum_select(dist, byzantine, keep, step=step)
    scores = krum_scores(dist, byzantine)
    return Selection(tuple(chosen), tuple(names), tuple(float(v) for v in scores))


@_isolated
def selection_params(step: int, selection: Selection) -> dict[str, Any]:
    """What the aggregate records of its selection."""
    return selection.to_params()


@_isolated
def selected_chunk(
    step: int,
    store: Store,
    sources: list[list[ChunkSource]],
    start: int,
    stop: int,
    dtype: str,
    contexts: list[str],
    selection: Selection,
    method: str,
    byzantine: int,
    weights: list[float],
    context: str,
) -> ChunkOut:
    """One chunk of the result, from the selected peers' chunks only.

    Krum: the selected peer's chunk, bit for bit. Multi-Krum: the FedAvg of
    the selected peers (the partial / combine / finish reduction, one peer at
    a time). Bulyan: :func:`~gradpipe.aggregation.robust.bulyan_combine`.
    """
    chosen = selection.peers
    if method == AggregationMethod.KRUM:
        [p] = chosen
        return write_result(
            store, _read(store, sources[p], start, stop, dtype, contexts[p]), context
        )
    if method == AggregationMethod.MULTI_KRUM:
        state = None
        shift = weight_shift([weights[p] for p in chosen])  # the FedAvg of the kept peers
        for i, p in enumerate(chosen):  # one peer's chunk in memory at a time
            chunk = _read(store, sources[p], start, stop, dtype, contexts[p])
            leaf = partial(chunk, peer=i, weight=weights[p], shift=shift)
            state = leaf if state is None else combine([state, leaf])
        if state is None:  # krum_select keeps 1 <= m peers
            raise InvalidInputError(f"{context}: no peer selected")
        try:
            result = finish(state, method=AggregationMethod.FEDAVG, peers=len(chosen))
        except InvalidInputError as exc:  # the FedAvg does not fit the dtype
            raise InvalidInputError(f"{context}: {exc}") from None
        return write_result(store, result, context)
    chunks = [_read(store, sources[p], start, stop, dtype, contexts[p]) for p in chosen]
    try:
        result = bulyan_combine(chunks, byzantine)
    except InvalidInputError as exc:
        raise InvalidInputError(f"{context}: {exc}") from None
    return write_result(store, result, context)


# --- DP-FedAvg --------------------------------------------------------------------
@dataclass(frozen=True)
class ClipRound:
    """Adaptive clipping in one step: the clip norm used, and the next step's."""

    used: float
    next: float
    unclipped: int
    peers: int

    def to_params(self) -> dict[str, Any]:
        return {
            "clip_norm_used": self.used,
            "next_clip_norm": self.next,
            "unclipped": self.unclipped,
        }


@_isolated
def clip_round(
    step: int,
    start: float | ClipRound,
    totals: list[ExactSum | float],
    target_quantile: float,
    lr: float,
    count_stddev: float,
    seed: int,
) -> ClipRound:
    """This step clips at ``start`` (or the previous step's next norm) and moves it on.

    Andrew et al.'s Algorithm 1: ``C ← C·exp(-η·(b̄ - γ))`` from this step's
    update norms, the count of unclipped updates noised with ``σ_b`` drawn
    from a generator keyed by (seed, step).
    """
    used = start.next if isinstance(start, ClipRound) else float(start)
    norms = [
        math.sqrt(float(t.to_array()) if isinstance(t, ExactSum) else float(t)) for t in totals
    ]
    rng = np.random.default_rng([seed, step]) if count_stddev > 0 else None
    nxt = update_clip_norm(
        used,
        norms,
        target_quantile=target_quantile,
        lr=lr,
        count_stddev=count_stddev,
        rng=rng,
    )
    return ClipRound(used, nxt, sum(1 for v in norms if v <= used), len(norms))


@_isolated
def clip_round_params(step: int, state: ClipRound) -> dict[str, Any]:
    """What the aggregate records of its step's adaptive clipping."""
    return state.to_params()


@_isolated
def round_scale(step: int, total: ExactSum | float, state: float | ClipRound) -> float:
    """A peer's clipping factor at the step's clip norm (fixed, or adaptive's ``used``)."""
    clip_norm = state.used if isinstance(state, ClipRound) else float(state)
    return clip_scale(total, clip_norm)


@_isolated
def write_noised_chunk(
    step: int,
    store: Store,
    parts: list[Partial],
    peers: int,
    context: str,
    seed: int,
    noise_tensor: str,
    start: int,
    clip: float | ClipRound,
    noise_multiplier: float,
) -> ChunkOut:
    """DP-FedAvg's chunk: the mean of the clipped updates plus ``N(0, (z·C/n)²)`` noise.

    The noise is drawn by element (:func:`~gradpipe.aggregation.privacy.gaussian_noise`
    keyed by the seed and ``noise_tensor``), so it does not depend on the chunk grid.
    """
    clip_norm = clip.used if isinstance(clip, ClipRound) else float(clip)
    std = noise_multiplier * clip_norm / peers
    shape = parts[0].shape
    noise = gaussian_noise(seed, tensor=noise_tensor, offset=start, count=math.prod(shape), std=std)
    try:
        result = finish(
            parts, method=AggregationMethod.DP_FEDAVG, peers=peers, noise=noise.reshape(shape)
        )
    except InvalidInputError as exc:
        raise InvalidInputError(f"{context}: {exc}") from None
    return write_result(store, result, context)
