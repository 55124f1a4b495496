"""Per-chunk statistics, computed once at write time and kept in the manifest.

Statistics never need a chunk read afterwards: tensor-level figures are merged
from chunk records. Conventions: ``nonzero`` counts values that are not zero
(``-0.0`` is zero, NaN is not); ``min``/``max`` ignore NaN and see infinities;
``sum``/``sumsq`` are float64 over finite values only, so one overflow does not
erase the signal of a whole chunk.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np

from gradpipe.core.dtypes import is_float
from gradpipe.core.encoding import decode_float, encode_float

__all__ = ["ChunkStats", "bit_nonzero", "chunk_stats", "merge_stats"]

_STAT_FIELDS = ("nonzero", "nan", "inf", "min", "max", "sum", "sumsq")


@dataclass(frozen=True, slots=True)
class ChunkStats:
    """Statistics of one chunk (or, merged, of a whole tensor)."""

    count: int
    nonzero: int
    nan: int = 0
    inf: int = 0
    min: float | None = None
    max: float | None = None
    sum: float = 0.0
    sumsq: float = 0.0

    @property
    def finite(self) -> int:
        """Number of finite values."""
        return self.count - self.nan - self.inf

    @property
    def mean(self) -> float:
        """Mean of the finite values (NaN when there are none)."""
        return self.sum / self.finite if self.finite else math.nan

    @property
    def l2_norm(self) -> float:
        """Euclidean norm of the finite values."""
        return math.sqrt(self.sumsq)

    @property
    def density(self) -> float:
        """Fraction of non-zero values (NaN for an empty tensor)."""
        return self.nonzero / self.count if self.count else math.nan

    def to_dict(self) -> dict[str, Any]:
        """JSON-able form (without ``count``, which the chunk grid gives)."""
        return {
            "nonzero": self.nonzero,
            "nan": self.nan,
            "inf": self.inf,
            "min": encode_float(self.min),
            "max": encode_float(self.max),
            "sum": encode_float(self.sum),
            "sumsq": encode_float(self.sumsq),
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any], *, count: int) -> ChunkStats:
        """Inverse of :meth:`to_dict`."""
        return cls(
            count=count,
            nonzero=int(data["nonzero"]),
            nan=int(data["nan"]),
            inf=int(data["inf"]),
            min=decode_float(data["min"]),
            max=decode_float(data["max"]),
            sum=decode_float(data["sum"]) or 0.0,
            sumsq=decode_float(data["sumsq"]) or 0.0,
        )


def bit_nonzero(flat: np.ndarray) -> int:
    """Number of elements whose bit pattern is not all zeros (``-0.0`` counts)."""
    unsigned = np.dtype(f"u{flat.dtype.itemsize}") if flat.dtype.itemsize > 1 else np.uint8
    return int(np.count_nonzero(flat.view(unsigned)))


def chunk_stats(flat: np.ndarray) -> ChunkStats:
    """Statistics of a 1-D chunk of any gradpipe dtype.

    Sums of float64 values near the top of their range overflow to ±inf
    (or NaN); that is the honest float64 answer, not an error.
    """
    # ml_dtypes warns when it casts NaN; float64 sums may overflow (see above).
    with np.errstate(invalid="ignore", over="ignore"):
        return _chunk_stats(flat)


def _chunk_stats(flat: np.ndarray) -> ChunkStats:
    count = int(flat.size)
    if count == 0:
        return ChunkStats(count=0, nonzero=0)
    if flat.dtype == np.bool_:
        flat = flat.view(np.uint8)
    if not is_float(flat.dtype):
        wide = flat.astype(np.float64)
        return ChunkStats(
            count=count,
            nonzero=int(np.count_nonzero(flat)),
            min=float(flat.min()),
            max=float(flat.max()),
            sum=float(wide.sum()),
            sumsq=float(np.dot(wide, wide)),
        )
    wide = flat.astype(np.float64)
    finite = np.isfinite(wide)
    n_finite = int(np.count_nonzero(finite))
    if n_finite == count:
        nan = inf = 0
        lo: float | None = float(wide.min())
        hi: float | None = float(wide.max())
    else:
        is_nan = np.isnan(wide)
        nan = int(np.count_nonzero(is_nan))
        inf = count - n_finite - nan
        seen = wide[~is_nan]
        lo = float(seen.min()) if seen.size else None
        hi = float(seen.max()) if seen.size else None
        wide = wide[finite]
    return ChunkStats(
        count=count,
        nonzero=int(np.count_nonzero(wide)) + nan + inf,
        nan=nan,
        inf=inf,
        min=lo,
        max=hi,
        sum=float(wide.sum()),
        sumsq=float(np.dot(wide, wide)),
    )


def merge_stats(parts: Iterable[ChunkStats]) -> ChunkStats:
    """Statistics of the concatenation of chunks."""
    parts = list(parts)
    mins = [p.min for p in parts if p.min is not None]
    maxs = [p.max for p in parts if p.max is not None]
    return ChunkStats(
        count=sum(p.count for p in parts),
        nonzero=sum(p.nonzero for p in parts),
        nan=sum(p.nan for p in parts),
        inf=sum(p.inf for p in parts),
        min=min(mins) if mins else None,
        max=max(maxs) if maxs else None,
        # math.fsum: the merged figure must not depend on chunking more than it must.
        sum=math.fsum(p.sum for p in parts),
        sumsq=math.fsum(p.sumsq for p in parts),
    )
