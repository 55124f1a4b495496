"""The peers' figures of one chunk range: Gram matrix, distances to the mean, sign counts.

Given the same flat elements of ``P`` peers' tensor (rows of ``X``) and their
weights ``w`` (summing to ``W``), one pass in cache-sized blocks computes:

- the Gram matrix ``K[p, q] = Σ x_p x_q``;
- the weighted mean ``G = Σ_p (w_p / W) x_p`` (float64, summed in peer order),
  ``|G|²``, ``max |G|``, and each peer's squared distance to it,
  ``d²[p] = Σ (x_p − G)²``, summed directly (no cancellation, unlike
  ``K_pp − 2 (Kw)_p / W + wᵀKw / W²``);
- sign counts: ``both[p, q]``, the elements where both are non-zero, and
  ``disagree[p, q]``, those of them where the signs differ (exact integers,
  from packed bits).

Blocks that are zero on every peer are skipped: they add exactly nothing (a
sparse embedding gradient is mostly such blocks). Float sums follow
docs/design/009: float64 within a block (numpy's pairwise
``add.reduce``, a fixed order), :class:`~gradpipe.aggregation.exact.ExactSum`
across blocks and chunks, so the figures do not depend on how chunks are
grouped into tasks, on the scheduler or on the number of workers. Products of
float32, bfloat16 and float16 values are exact in float64.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final

import numpy as np

from gradpipe.aggregation.exact import ExactSum

__all__ = ["BLOCK", "PeerPartial", "combine_partials", "peer_partial"]

#: Elements per block: 8 peers' float64 rows of it stay in a core's L2 cache.
BLOCK: Final = 32768


@dataclass(frozen=True)
class PeerPartial:
    """The figures of some elements of ``P`` peers, exact so that parts add in any order.

    ``sums`` holds, exactly, the upper triangle of ``K`` (row by row), then
    ``d²`` (``P`` values), then ``|G|²``.
    """

    peers: int
    sums: ExactSum
    disagree: np.ndarray  # (P, P) int64, upper triangle
    both: np.ndarray  # (P, P) int64, upper triangle
    mean_max_abs: float
    mean_nonzero: int

    def gram(self) -> np.ndarray:
        """``K`` as a symmetric (P, P) float64 matrix."""
        values = self.sums.to_array()
        p = self.peers
        upper = np.triu_indices(p)
        out = np.zeros((p, p))
        out[upper] = values[: len(upper[0])]
        return out + np.triu(out, 1).T

    def dist_sq(self) -> np.ndarray:
        """``d²``, each peer's squared distance to the weighted mean."""
        p = self.peers
        start = p * (p + 1) // 2
        return self.sums.to_array()[start : start + p]

    def mean_sq(self) -> float:
        """``|G|²``."""
        return float(self.sums.to_array()[-1])

    def sign_counts(self) -> tuple[np.ndarray, np.ndarray]:
        """``(disagree, both)`` as symmetric (P, P) int64 matrices."""
        return _symmetric(self.disagree), _symmetric(self.both)


def _symmetric(upper: np.ndarray) -> np.ndarray:
    out: np.ndarray = upper + np.triu(upper, 1).T
    return out


@np.errstate(over="ignore", invalid="ignore")  # an overflow is refused by ExactSum, by name
def peer_partial(rows: Sequence[np.ndarray], weights: Sequence[float]) -> PeerPartial:
    """The figures of the elements in ``rows`` (one row per peer, equal lengths).

    Raises InvalidInputError where float64 products overflow (ExactSum refuses infinities).
    """
    p = len(rows)
    w = np.asarray(weights, dtype=np.float64)
    share = w / w.sum()
    upper = np.triu_indices(p)
    size = len(rows[0])
    parts: list[ExactSum] = []
    disagree = np.zeros((p, p), np.int64)
    both = np.zeros((p, p), np.int64)
    peak, nonzero = 0.0, 0
    x = np.empty((p, min(BLOCK, size)))
    for lo in range(0, size, BLOCK):
        hi = min(lo + BLOCK, size)
        if not any(row[lo:hi].any() for row in rows):
            continue  # zero on every peer (a sparse embedding's gradient): adds exactly 0
        block = x[:, : hi - lo]
        for i, row in enumerate(rows):
            block[i] = row[lo:hi]
        gram = np.empty((p, p))
        for i in range(p):
            gram[i, i:] = np.add.reduce(block[i] * block[i:], axis=1)
        mean = share[0] * block[0]
        for i in range(1, p):
            mean += share[i] * block[i]
        diff = block - mean
        dist = np.add.reduce(diff * diff, axis=1)
        mean_sq = np.add.reduce(mean * mean)
        parts.append(ExactSum.of(np.concatenate([gram[upper], dist, [mean_sq]])))
        if hi > lo:
            peak = max(peak, float(np.max(np.abs(mean))))
        nonzero += int(np.count_nonzero(mean))
        _count_signs(block, disagree, both)
    if not parts:  # an empty tensor
        parts.append(ExactSum.of(np.zeros(len(upper[0]) + p + 1)))
    return PeerPartial(p, ExactSum.combine(parts), disagree, both, peak, nonzero)


def _count_signs(block: np.ndarray, disagree: np.ndarray, both: np.ndarray) -> None:
    """Add the block's sign counts to the upper triangles of ``disagree`` and ``both``."""
    negative = np.packbits(block < 0, axis=1)
    nonzero = np.packbits(block != 0, axis=1)
    p = block.shape[0]
    for i in range(p):
        shared = nonzero[i] & nonzero[i:]
        both[i, i:] += np.bitwise_count(shared).sum(axis=1, dtype=np.int64)
        differ = (negative[i] ^ negative[i:]) & shared
        disagree[i, i:] += np.bitwise_count(differ).sum(axis=1, dtype=np.int64)


def combine_partials(parts: Sequence[PeerPartial]) -> PeerPartial:
    """The figures of the union of disjoint element ranges (exact: any order, any grouping)."""
    first = parts[0]
    return PeerPartial(
        first.peers,
        ExactSum.combine(p.sums for p in parts),
        sum((p.disagree for p in parts), np.zeros_like(first.disagree)),
        sum((p.both for p in parts), np.zeros_like(first.both)),
        max(p.mean_max_abs for p in parts),
        sum(p.mean_nonzero for p in parts),
    )
