"""Byzantine-robust aggregation: median, trimmed mean, Krum, Multi-Krum, Bulyan.

Out of core, each method splits into steps a graph runs chunk by chunk:

- **median, trimmed mean** are coordinate-wise: one task holds one chunk of
  every peer (``n x chunk``), never a whole tensor.
- **Krum, Multi-Krum** need the ``(n, n)`` squared L2 distances between the
  peers' updates, all tensors flattened together. Each chunk gives
  :func:`pairwise_sq_distances_partial`; the graph sums the partials by a
  bounded tree of :class:`~gradpipe.aggregation.exact.ExactSum` (exact integer
  addition, so the total is the same for every tree and order; see
  :func:`sum_distance_partials`), then :func:`krum_select` picks peers from the
  small matrix, and the result is that peer's update (Krum) or the FedAvg of the
  kept peers (Multi-Krum, by :mod:`gradpipe.aggregation.reduce`).
- **Bulyan** selects from the same matrix (:func:`bulyan_select`, repeated
  Krum on submatrices: no second pass over the data), then
  :func:`bulyan_combine` runs per chunk on the selected peers' chunks.

The distances are float64 sums within a chunk (fixed order), exact across
chunks: the selection is the same for every scheduler and worker count. A
different chunk grid changes the within-chunk rounding (relative 1e-16) and can
flip a selection only between peers whose scores tie to that precision.

Ties are broken by the lower peer index everywhere, and the selections are
returned as ascending peer indices, so a result never depends on sort stability.
The definitions follow Flower's ``flwr.server.strategy.aggregate`` (its Krum
scores use ``max(1, n - f - 2)`` neighbours, and so do ours inside Bulyan's
shrinking rounds), computed in float64 with one final rounding where Flower
works in the peers' dtype.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Final

import numpy as np

from gradpipe.aggregation.exact import ExactSum
from gradpipe.aggregation.inputs import check_byzantine, check_peer_chunks, where
from gradpipe.aggregation.result_range import round_result
from gradpipe.core.display import printable
from gradpipe.errors import InvalidInputError

__all__ = [
    "bulyan_combine",
    "bulyan_select",
    "krum_scores",
    "krum_select",
    "median",
    "pairwise_sq_distances_partial",
    "sum_distance_partials",
    "trim_count",
    "trimmed_mean",
]


def _stack(chunks: Sequence[np.ndarray], tensor: str | None) -> np.ndarray:
    check_peer_chunks(chunks, tensor=tensor)
    return np.stack([np.asarray(c, dtype=np.float64) for c in chunks])


def _round(values: np.ndarray, dtype: np.dtype | str, tensor: str | None) -> np.ndarray:
    # The one rounding of every method, which refuses a result that does not fit the dtype.
    return round_result(np.asarray(values, dtype=np.float64), dtype, context=where(tensor=tensor))


def median(
    chunks: Sequence[np.ndarray], *, dtype: np.dtype | str | None = None, tensor: str | None = None
) -> np.ndarray:
    """Coordinate-wise median of one chunk of every peer (even ``n``: mean of the middle two).

    >>> median([np.array([1.0]), np.array([5.0]), np.array([2.0])]).tolist()
    [2.0]
    """
    stack = _stack(chunks, tensor)
    return _round(np.median(stack, axis=0), dtype or chunks[0].dtype, tensor)


def trim_count(n: int, beta: float) -> int:
    """``⌊β·n⌋`` as Flower's ``_trim_mean`` computes it (``int(beta * n)``), ``0 <= β < 0.5``."""
    if not 0.0 <= beta < 0.5:
        raise InvalidInputError(
            f"trimmed mean: trim fraction {printable(beta)} must be in [0, 0.5)"
        )
    return int(beta * n)


def trimmed_mean(
    chunks: Sequence[np.ndarray],
    beta: float,
    *,
    dtype: np.dtype | str | None = None,
    tensor: str | None = None,
) -> np.ndarray:
    """Per coordinate: drop the ``⌊β·n⌋`` largest and smallest values, average the rest.

    The kept values are summed in float64 in sorted order (a fixed order), so
    the result depends only on the multiset of values per coordinate.

    >>> chunks = [np.array([v]) for v in (0.0, 1.0, 2.0, 100.0)]
    >>> trimmed_mean(chunks, 0.25).tolist()
    [1.5]
    """
    stack = _stack(chunks, tensor)
    n = stack.shape[0]
    cut = trim_count(n, beta)
    kept = np.sort(stack, axis=0)[cut : n - cut]
    return _round(kept.sum(axis=0) / kept.shape[0], dtype or chunks[0].dtype, tensor)


#: Columns of the peers' chunks taken at a time by :func:`pairwise_sq_distances_partial`:
#: their float64 copies and differences stay in a core's cache (2 MiB for 8 peers).
_DISTANCE_COLUMNS: Final = 1 << 14


def pairwise_sq_distances_partial(chunks: Sequence[np.ndarray]) -> np.ndarray:
    """This chunk's share of the ``(n, n)`` squared L2 distances between peers (float64).

    Summed over every chunk of every tensor (:func:`sum_distance_partials`),
    it gives the distances Krum and Bulyan select from. Within the chunk, the columns are
    taken in blocks (fixed, so the sum's order is too): each block of every peer is
    widened once, every pair's difference is made in place and its squares summed by one
    ``einsum``: no chunk-sized temporaries for contiguous chunks (4x faster than
    whole-chunk differences for 8 peers of 4 MiB chunks).
    """
    check_peer_chunks(chunks, tensor=None)
    n = len(chunks)
    flat = [np.asarray(c).reshape(-1) for c in chunks]
    size = flat[0].size
    dist = np.zeros((n, n), dtype=np.float64)
    width = min(_DISTANCE_COLUMNS, max(size, 1))
    stack = np.empty((n, width), dtype=np.float64)
    diff = np.empty((n, width), dtype=np.float64)
    for start in range(0, size, width):
        m = min(width, size - start)
        block = stack[:, :m]
        for k, values in enumerate(flat):
            block[k] = values[start : start + m]
        for i in range(n - 1):
            rows = np.subtract(block[i + 1 :], block[i], out=diff[: n - i - 1, :m])
            dist[i, i + 1 :] += np.einsum("ij,ij->i", rows, rows)
    upper = np.triu_indices(n, 1)
    dist.T[upper] = dist[upper]
    return dist


def sum_distance_partials(partials: Iterable[np.ndarray | ExactSum]) -> np.ndarray:
    """The exact sum of distance partials, rounded once (any order or grouping: same bits).

    Inner tasks of a tree combine ``ExactSum.of(partial)`` values with
    :meth:`ExactSum.combine`; this is the one-call form of that.
    """
    exact = [p if isinstance(p, ExactSum) else ExactSum.of(p) for p in partials]
    return ExactSum.combine(exact).to_array()


def _check_dist(dist: np.ndarray) -> int:
    if dist.ndim != 2 or dist.shape[0] != dist.shape[1]:
        raise InvalidInputError(f"a distance matrix must be square, got shape {dist.shape}")
    if not np.isfinite(dist).all() or (dist < 0).any():
        raise InvalidInputError("distances must be finite and >= 0")
    return int(dist.shape[0])


def krum_scores(dist: np.ndarray, f: int) -> np.ndarray:
    """Krum's score of each peer: the sum of its ``max(1, n - f - 2)`` smallest distances.

    Summed exactly (``math.fsum``) over the ascending distances.
    """
    n = _check_dist(dist)
    k = max(1, n - f - 2)
    scores = np.empty(n, dtype=np.float64)
    for i in range(n):
        others = np.sort(np.delete(dist[i], i))
        scores[i] = math.fsum(others[:k].tolist())
    return scores


def _best(scores: np.ndarray, m: int) -> list[int]:
    # lexsort: by score, then by peer index (the last key is the primary one)
    order = np.lexsort((np.arange(scores.shape[0]), scores))
    return [int(i) for i in order[:m]]


def krum_select(dist: np.ndarray, f: int, m: int = 1, *, step: int | None = None) -> list[int]:
    """Krum (``m = 1``) or Multi-Krum: the ``m`` peers of lowest score, as ascending indices.

    Needs ``n >= 2f + 3``. Krum's result is the update of the one selected
    peer; Multi-Krum's the FedAvg of the selected peers (Flower's
    ``aggregate_krum(..., to_keep=m)``).
    """
    n = _check_dist(dist)
    check_byzantine(n, f, method="krum" if m == 1 else "multi-krum", keep=m, step=step)
    return sorted(_best(krum_scores(dist, f), m))


def bulyan_select(dist: np.ndarray, f: int, *, step: int | None = None) -> list[int]:
    """Bulyan's selection set: ``θ = n - 2f`` peers by repeated Krum (ascending indices).

    Each round scores the peers not yet selected on the submatrix of their
    distances (``max(1, n' - f - 2)`` neighbours, as Flower) and moves the best
    one to the set. Needs ``n >= 4f + 3``.
    """
    n = _check_dist(dist)
    check_byzantine(n, f, method="bulyan", step=step)
    remaining = list(range(n))
    selected = []
    for _ in range(n - 2 * f):
        sub = dist[np.ix_(remaining, remaining)]
        best = _best(krum_scores(sub, f), 1)[0]
        selected.append(remaining.pop(best))
    return sorted(selected)


def bulyan_combine(
    chunks: Sequence[np.ndarray],
    f: int,
    *,
    dtype: np.dtype | str | None = None,
    tensor: str | None = None,
) -> np.ndarray:
    """Bulyan's coordinate step on one chunk of each selected peer (ascending peer order).

    Per coordinate, the ``β = θ - 2f`` values closest to the median of the
    ``θ`` selected values are averaged (float64, one rounding). Among values
    equally far from the median the earlier peer wins (Flower leaves that to
    ``argpartition``).
    """
    stack = _stack(chunks, tensor)
    theta = stack.shape[0]
    beta = theta - 2 * f
    if f < 0 or beta < 1:
        raise InvalidInputError(
            f"bulyan: {theta} selected peers leave no value to average with f={f}"
        )
    distance = np.abs(stack - np.median(stack, axis=0))
    order = np.argsort(distance, axis=0, kind="stable")[:beta]
    closest = np.take_along_axis(stack, order, axis=0)
    return _round(closest.sum(axis=0) / beta, dtype or chunks[0].dtype, tensor)
