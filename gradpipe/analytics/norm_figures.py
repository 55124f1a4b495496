"""A stored tensor's norm and scale figures, from its manifest's chunk statistics.

Every figure comes from the statistics each chunk records when written
(:mod:`gradpipe.core.chunk_stats`), so no chunk is read, with one exception: a
float64 chunk whose sum of squares overflowed to infinity although it holds
only finite values. Its norm is recomputed from its data with scaling, and the
tensor's from the chunks' norms by :func:`math.hypot`.

Conventions (those of the chunk statistics): ``sum_squares`` and ``l2_norm``
cover the finite values; ``max_abs`` ignores NaN but sees infinities, so it is
inf when any value is; ``nonzero`` counts NaN as non-zero and ``-0.0`` as zero.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Final

import numpy as np

from gradpipe.core.chunk_stats import ChunkStats

__all__ = [
    "COUNTS",
    "FIGURES",
    "TensorFigures",
    "exact_sum",
    "overflowed_chunks",
    "scaled_l2",
    "tensor_figures",
]

#: The figures of one tensor, in the order results store them.
FIGURES: Final = ("sum_squares", "l2_norm", "max_abs", "nonzero", "nan", "inf", "numel")
#: The figures that are counts (int64 when stored).
COUNTS: Final = frozenset({"nonzero", "nan", "inf", "numel"})


@dataclass(frozen=True, slots=True)
class TensorFigures:
    """Norm and scale figures of one stored tensor (or of a layer, or of all)."""

    sum_squares: float
    l2_norm: float
    max_abs: float
    nonzero: int
    nan: int
    inf: int
    numel: int

    def values(self) -> tuple[float | int, ...]:
        return (
            self.sum_squares,
            self.l2_norm,
            self.max_abs,
            self.nonzero,
            self.nan,
            self.inf,
            self.numel,
        )


def overflowed_chunks(stats: Sequence[ChunkStats]) -> list[int]:
    """Chunks whose sum of squares overflowed (float64 only).

    ``sumsq`` covers the finite values alone, so an infinite one always means
    their squares overflowed, whatever NaN or infinity the chunk also holds.
    """
    return [i for i, s in enumerate(stats) if math.isinf(s.sumsq)]


def exact_sum(values: Iterable[float]) -> float:
    """``math.fsum`` of finite values, ``inf`` where the exact sum is beyond float64.

    (``math.fsum`` raises ``OverflowError`` for finite values whose sum overflows.)
    """
    try:
        return math.fsum(values)
    except OverflowError:
        return math.inf


def tensor_figures(
    stats: Sequence[ChunkStats], read_chunk: Callable[[int], np.ndarray] | None = None
) -> TensorFigures:
    """The figures of a tensor from its chunks' statistics.

    ``read_chunk(i)`` returns chunk ``i``'s values; it is called only for the
    chunks :func:`overflowed_chunks` names (and needed only then).
    """
    sum_squares = exact_sum(s.sumsq for s in stats)
    overflowed = overflowed_chunks(stats) if math.isinf(sum_squares) else []
    if math.isinf(sum_squares) and not overflowed:  # finite chunk sums, an infinite total
        l2_norm = math.hypot(*(math.sqrt(s.sumsq) for s in stats))
    elif overflowed:
        if read_chunk is None:
            raise ValueError("a chunk's sum of squares overflowed and no reader was given")
        recomputed = {i: scaled_l2(read_chunk(i)) for i in overflowed}
        norms = (recomputed.get(i, math.sqrt(s.sumsq)) for i, s in enumerate(stats))
        l2_norm = math.hypot(*norms)
    else:
        l2_norm = math.sqrt(sum_squares)
    extremes = [abs(v) for s in stats for v in (s.min, s.max) if v is not None]
    return TensorFigures(
        sum_squares=sum_squares,
        l2_norm=l2_norm,
        max_abs=max(extremes) if extremes else math.nan,
        nonzero=sum(s.nonzero for s in stats),
        nan=sum(s.nan for s in stats),
        inf=sum(s.inf for s in stats),
        numel=sum(s.count for s in stats),
    )


def scaled_l2(values: np.ndarray) -> float:
    """The L2 norm of the finite values, scaled so that no square overflows."""
    finite = np.asarray(values, dtype=np.float64).reshape(-1)
    finite = finite[np.isfinite(finite)]
    if not finite.size:
        return 0.0
    peak = float(np.max(np.abs(finite)))
    if peak == 0.0:
        return 0.0
    scaled = finite / peak
    return peak * math.sqrt(exact_sum(np.square(scaled).tolist()))
