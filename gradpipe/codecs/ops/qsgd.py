"""QSGD: stochastic quantisation to ``s`` levels per bucket (Alistarh et al., 2017).

Each bucket ``v`` of ``d`` values (the last may be shorter) keeps its norm
``‖v‖₂`` and, per value, its sign and a level ``ξᵢ ∈ {0, 1/s, …, 1}``: with
``r = s·|vᵢ|/‖v‖₂``, ``ξᵢ = ⌈r⌉/s`` with probability ``r − ⌊r⌋``, else
``⌊r⌋/s``. The decoded value is ``‖v‖₂·sign(vᵢ)·ξᵢ``. Then (Lemma 3.1 of the
paper)

- it is unbiased: ``E[x̂] = x``;
- ``E‖x̂ − x‖₂² ≤ min(d/s², √d/s)·‖x‖₂²`` (per bucket, so for the whole);
- deterministically ``|x̂ᵢ − xᵢ| ≤ ‖v‖₂/s ≤ ‖x‖₂/s``: a value moves to one of
  the two levels around it.

Norms are kept in float64, measured scaled by the bucket's largest value where
the squares would leave float64's range (values beyond 1e±154). The decoded
values are rounded once to the output dtype, which adds at most its unit
roundoff times ``‖v‖₂`` per value, and, on subnormal outputs, up to one step of
the subnormal grid (half for the norm's rounding, half for the value's).
"""

from __future__ import annotations

import math
from typing import Final

import numpy as np

from gradpipe.core.lossy import SQUARES_SAFE
from gradpipe.errors import InvalidInputError

__all__ = [
    "MAX_LEVELS",
    "dequantize_qsgd",
    "parse_levels",
    "qsgd_variance_bound",
    "quantize_qsgd",
]

#: Most levels a quantised value may take per sign (stored as int16).
MAX_LEVELS: Final = 32767


def parse_levels(value: object) -> int:
    """A number of QSGD levels, 1 to :data:`MAX_LEVELS`."""
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_LEVELS:
        raise InvalidInputError(
            f"QSGD levels must be an integer from 1 to {MAX_LEVELS}, not {value!r}"
        )
    return value


def qsgd_variance_bound(levels: int, bucket: int) -> float:
    """``min(d/s², √d/s)``: the variance bound relative to ``‖x‖₂²``.

    >>> qsgd_variance_bound(16, 512)
    1.4142135623730951
    """
    return min(bucket / levels**2, math.sqrt(bucket) / levels)


def quantize_qsgd(
    values: np.ndarray, levels: int, bucket: int, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray]:
    """Signed levels (int8 or int16, in ``[-s, s]``) and float64 bucket norms of 1-D finite values.

    >>> q, norms = quantize_qsgd(np.array([3.0, -4.0]), 5, 2, np.random.default_rng(0))
    >>> q.tolist(), norms.tolist()
    ([3, -4], [5.0])
    """
    x = np.asarray(values, dtype=np.float64).reshape(-1)
    n = x.size
    count = -(-n // bucket)
    padded = np.zeros(count * bucket)
    padded[:n] = x
    grid = padded.reshape(count, bucket)
    with np.errstate(invalid="ignore", divide="ignore", over="ignore", under="ignore"):
        norms = np.sqrt(np.einsum("ij,ij->i", grid, grid))
        scaled = np.abs(grid) * (levels / norms)[:, None]
    # The squares underflowed (losing bits) or overflowed: measure those buckets scaled.
    extreme = (norms < SQUARES_SAFE) | np.isinf(norms)
    if extreme.any():
        norms[extreme], scaled[extreme] = _scaled_buckets(grid[extreme], levels)
    scaled = np.nan_to_num(scaled, nan=0.0)  # an all-zero bucket
    # r can exceed s by a rounding hair when one value holds the whole norm.
    np.minimum(scaled, levels, out=scaled)
    low = np.floor(scaled)
    up = rng.random(scaled.shape) < (scaled - low)
    level = (low + up) * np.sign(grid)
    dtype = np.int8 if levels <= 127 else np.int16
    return level.reshape(-1)[:n].astype(dtype), norms


def _scaled_buckets(grid: np.ndarray, levels: int) -> tuple[np.ndarray, np.ndarray]:
    """Norms and ``s·|vᵢ|/‖v‖₂`` of buckets whose squares leave float64's range, scaled first.

    >>> norms, scaled = _scaled_buckets(np.array([[3.0, 4.0], [3.0, -4.0]]) * 2.0**600, 5)
    >>> (norms / 2.0**600).tolist(), scaled.tolist()
    ([5.0, 5.0], [[3.0, 4.0], [3.0, 4.0]])
    """
    peak = np.abs(grid).max(axis=1)
    safe_peak = np.where(peak > 0, peak, 1.0)[:, None]
    unit = grid / safe_peak
    relative = np.sqrt(np.einsum("ij,ij->i", unit, unit))
    with np.errstate(over="ignore"):
        norms: np.ndarray = peak * relative
    if np.isinf(norms).any():
        raise InvalidInputError(
            "QSGD: a bucket's L2 norm exceeds float64's largest value (1.8e308), so its "
            "values cannot be quantised against it; use smaller buckets "
            "(QSGDCodec(levels, bucket=...)) or a lossless codec for this tensor"
        )
    with np.errstate(invalid="ignore", divide="ignore"):
        scaled: np.ndarray = np.abs(unit) / relative[:, None] * levels
    return norms, scaled


def dequantize_qsgd(
    levels_found: np.ndarray, norms: np.ndarray, levels: int, bucket: int
) -> np.ndarray:
    """Float64 values of quantised levels: ``‖v‖₂·qᵢ/s`` (elementwise, so bit-reproducible)."""
    q = np.asarray(levels_found).reshape(-1)
    n = q.size
    if norms.size != -(-n // bucket):
        raise InvalidInputError(f"{norms.size} bucket norms for {n} values in buckets of {bucket}")
    per_value = np.repeat(norms, bucket)[:n]
    out: np.ndarray = per_value * (q.astype(np.float64) / levels)
    return out
