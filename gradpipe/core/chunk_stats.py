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
from dataclasses import dataclass, replace
from typing import Any, Final

import numpy as np

from gradpipe.core.dtypes import is_float
from gradpipe.core.encoding import decode_float, encode_float
from gradpipe.core.kernels import native

__all__ = [
    "ChunkStats",
    "bit_nonzero",
    "chunk_stats",
    "merge_stats",
    "stats_and_bit_nonzero",
    "stats_from_columns",
]

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


def stats_from_columns(
    columns: dict[str, list[Any]], counts: tuple[int, ...]
) -> tuple[ChunkStats, ...]:
    """The records :meth:`ChunkStats.from_dict` would give, from per-field columns at once.

    How a tensor manifest stores them (one list per field, one entry per
    chunk); building each record straight from the columns, without a dict
    per chunk, halves the cost of decoding the manifests of a long run.
    """
    if not counts:  # a tensor of no chunks stores no columns
        return ()
    nonzero, nan, inf, low, high, total, squares = (columns[k] for k in _STAT_FIELDS)
    decode = decode_float
    return tuple(
        ChunkStats(
            count,
            int(nz),
            int(na),
            int(nf),
            decode(lo),
            decode(hi),
            decode(s) or 0.0,
            decode(q) or 0.0,
        )
        for count, nz, na, nf, lo, hi, s, q in zip(
            counts, nonzero, nan, inf, low, high, total, squares, strict=True
        )
    )


def bit_nonzero(flat: np.ndarray) -> int:
    """Number of elements whose bit pattern is not all zeros (``-0.0`` counts)."""
    return int(np.count_nonzero(_unsigned_view(flat)))


def chunk_stats(flat: np.ndarray, *, bits_nonzero: int | None = None) -> ChunkStats:
    """Statistics of a 1-D chunk of any gradpipe dtype.

    ``bits_nonzero``, the count of elements whose bits are not all zero
    (:func:`bit_nonzero`), saves a pass when the caller has it already.
    Sums of float64 values near the top of their range overflow to ±inf
    (or NaN); that is the honest float64 answer, not an error.
    """
    # ml_dtypes warns when it casts NaN; float64 sums may overflow (see above).
    with np.errstate(invalid="ignore", over="ignore"):
        return _chunk_stats(flat, bits_nonzero)


def stats_and_bit_nonzero(flat: np.ndarray) -> tuple[ChunkStats, int]:
    """:func:`chunk_stats` and :func:`bit_nonzero` of a 1-D chunk, in one pass where the
    compiled kernel takes the chunk (it counts the non-zero bit patterns as it goes).

    A writer needs both: the count says whether the chunk needs a block at all.
    """
    kind = _native_kind(flat)
    if kind is not None:
        stats, bits_nonzero = _native_stats(_unsigned_view(flat), kind)
        if bits_nonzero == 0:
            return _all_zero(stats.count), 0
        return stats, bits_nonzero
    bits_nonzero = bit_nonzero(flat)
    return chunk_stats(flat, bits_nonzero=bits_nonzero), bits_nonzero


def _sum_sq(wide: np.ndarray) -> tuple[float, float]:
    # Not np.dot: its BLAS thread pool fights Dask's worker threads and
    # was measured several times slower inside an ingest than einsum.
    return float(wide.sum()), float(np.einsum("i,i->", wide, wide))


def _chunk_stats(flat: np.ndarray, bits_nonzero: int | None) -> ChunkStats:
    count = int(flat.size)
    if count == 0:
        return ChunkStats(count=0, nonzero=0)
    if flat.dtype == np.bool_:
        flat = flat.view(np.uint8)
    unsigned = _unsigned_view(flat)
    if bits_nonzero is None:
        bits_nonzero = int(np.count_nonzero(unsigned))
    if bits_nonzero == 0:  # all +0 (or False): common in embedding gradients, no pass needed
        return _all_zero(count)
    kind = _native_kind(flat)
    if kind is not None:
        return _native_stats(unsigned, kind)[0]
    zeros = count - bits_nonzero
    values, bits = flat, unsigned
    if bits_nonzero <= count // _SPARSE_FRACTION:
        # Sparse (an embedding gradient): two passes pick the non-zero values,
        # then every statistic runs over a few percent of the chunk.
        keep = unsigned != 0
        values, bits = flat[keep], unsigned[keep]
    # The whole chunk's count of non-zero bit patterns is known: no pass for it.
    known = bits_nonzero if values is flat else None
    stats = _value_stats(values, bits, count, known)
    if zeros:
        # The +0 elements left out above still count for the minimum and maximum.
        lo = 0.0 if stats.min is None else min(stats.min, 0.0)
        hi = 0.0 if stats.max is None else max(stats.max, 0.0)
        stats = replace(stats, min=lo, max=hi)
    # -0.0 and 0.0 are one number: the record (and the tensor id) must not depend on which
    # of them a reduction happened to return.
    if stats.min == 0.0 or stats.max == 0.0:
        stats = replace(stats, min=_unsigned_zero(stats.min), max=_unsigned_zero(stats.max))
    return stats


def _unsigned_zero(value: float | None) -> float | None:
    return 0.0 if value == 0.0 else value


def _unsigned_view(flat: np.ndarray) -> np.ndarray:
    return flat.view(np.dtype(f"u{flat.dtype.itemsize}"))


def _all_zero(count: int) -> ChunkStats:
    """The record of a chunk whose bits are all zero (+0.0, or False)."""
    return ChunkStats(count=count, nonzero=0, min=0.0, max=0.0)


def _native_kind(flat: np.ndarray) -> str | None:
    """The compiled kernel's code for ``flat``'s dtype, or None where the kernel does not
    compute its statistics (no kernel; an empty, strided or byte-swapped chunk; another dtype)."""
    if native is None or not flat.size or not flat.flags.c_contiguous or not flat.dtype.isnative:
        return None
    return _NATIVE_KINDS.get(flat.dtype.name)


#: The float dtypes whose statistics the compiled kernel computes, by its code for them.
_NATIVE_KINDS: Final = {"float32": "f", "float64": "d", "bfloat16": "b", "float16": "e"}


def _native_stats(bits: np.ndarray, kind: str) -> tuple[ChunkStats, int]:
    """:func:`_chunk_stats` of a float chunk (``bits``: its unsigned view) in one pass of the
    compiled kernel, without the GIL, and the chunk's count of non-zero bit patterns.

    The same figures as the numpy code below but the last bits of ``sum`` and ``sumsq``
    (another summation order, fixed whatever the machine; both are pairwise). The kernel
    counts the chunk's non-zero bit patterns itself, so the record agrees with the values it
    read.
    """
    assert native is not None
    bits_nonzero, negative_zeros, nan, inf, low, high, total, squares = native.float_stats(
        bits, kind
    )
    stats = ChunkStats(
        count=int(bits.size),
        nonzero=bits_nonzero - negative_zeros,
        nan=nan,
        inf=inf,
        min=low,
        max=high,
        sum=total,
        sumsq=squares,
    )
    return stats, bits_nonzero


# Below 1/4 non-zero, selecting the non-zero values first is cheaper than
# running the statistics over every element.
_SPARSE_FRACTION = 4


def _value_stats(
    values: np.ndarray, bits: np.ndarray, count: int, bits_nonzero: int | None = None
) -> ChunkStats:
    """Statistics of ``values`` (all of a chunk or its non-zero part) for a chunk of ``count``.

    ``bits_nonzero``, when known, is the count of non-zero bit patterns in ``bits``.
    """
    if not is_float(values.dtype):
        total, total_sq = _sum_sq(values.astype(np.float64))
        return ChunkStats(
            count=count,
            nonzero=int(np.count_nonzero(bits)),
            min=float(values.min()),
            max=float(values.max()),
            sum=total,
            sumsq=total_sq,
        )
    wide = values.astype(np.float64)
    # Minimum and maximum are exact in the values' own dtype, at half the memory
    # traffic of float64 (ml_dtypes' bfloat16 has no fast reductions: widen it).
    own_dtype = values if values.dtype in (np.float32, np.float64) else wide
    low, high = float(own_dtype.min()), float(own_dtype.max())
    lo: float | None = low
    hi: float | None = high
    # -0.0 has a bit set but is zero: the one value where bits and value disagree.
    signbit = np.array(1, bits.dtype) << np.array(8 * bits.dtype.itemsize - 1, bits.dtype)
    if bits_nonzero is None:
        bits_nonzero = int(np.count_nonzero(bits))
    # Only a range that holds 0 (or NaN, which hides the range) can hold -0.0.
    skip = low > 0.0 or high < 0.0
    negative_zeros = 0 if skip else int(np.count_nonzero(bits == signbit))
    nonzero = bits_nonzero - negative_zeros
    nan = inf = 0
    if not (math.isfinite(low) and math.isfinite(high)):  # min/max see every NaN and Inf
        finite = np.isfinite(wide)
        is_nan = np.isnan(wide)
        nan = int(np.count_nonzero(is_nan))
        inf = wide.size - int(np.count_nonzero(finite)) - nan
        seen = wide[~is_nan]
        lo = float(seen.min()) if seen.size else None
        hi = float(seen.max()) if seen.size else None
        wide = wide[finite]
    total, total_sq = _sum_sq(wide)
    return ChunkStats(
        count=count, nonzero=nonzero, nan=nan, inf=inf, min=lo, max=hi, sum=total, sumsq=total_sq
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
