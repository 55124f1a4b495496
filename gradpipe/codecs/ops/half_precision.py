"""Rounding floats to fewer bits: bfloat16 and float16, round-to-nearest-even.

bfloat16 keeps float32's sign and 8-bit exponent and the top 7 of its 23
mantissa bits. Rounding to nearest, ties to even, adds ``0x7FFF`` plus the
lowest kept bit to the float32 word and drops the low 16 bits; the carry may
run into the exponent (that is the correct rounding up to the next binade, and
to infinity above bfloat16's largest value). NaNs are kept NaN (a quiet NaN
with the payload's top bits) instead of being carried into infinity.

The Rust prototype truncated (dropped the low 16 bits): always toward zero, so its
error is up to 2^-7 relative and biased, where rounding to nearest is at most
2^-8 and unbiased on average. :func:`bf16_truncate_bits` is the Rust prototype's rule,
kept for comparison (see ``benchmarks/bench_rounding.py``).

float16 comes from numpy's conversion, which rounds to nearest even from
float32 and float64 directly; values of magnitude at least 65520 become
infinities, which :func:`to_fp16` counts.
"""

from __future__ import annotations

from typing import Final

import numpy as np
import numpy.typing as npt

__all__ = [
    "BF16_MAX",
    "FP16_MAX",
    "bf16_bits",
    "bf16_truncate_bits",
    "from_bf16_bits",
    "to_fp16",
]

#: Largest finite bfloat16 value.
BF16_MAX: Final = float(np.uint32(0x7F7F0000).view(np.float32))
#: Largest finite float16 value.
FP16_MAX: Final = 65504.0

_F32_ABS: Final = np.uint32(0x7FFFFFFF)
_F32_INF: Final = np.uint32(0x7F800000)
_BF16_QUIET: Final = np.uint16(0x0040)


def bf16_bits(values: npt.ArrayLike) -> np.ndarray:
    """bfloat16 bit patterns (uint16) of float32 values, rounded to nearest even.

    Float64 values are rounded to bfloat16 directly (with ml_dtypes), never
    through float32, so no value is rounded twice.

    >>> bf16_bits(np.float32([1.0, 1.00390625, 1.01171875])).tolist()  # ties go to even
    [16256, 16256, 16258]
    """
    array = np.asarray(values)
    if array.dtype == np.float64:
        import ml_dtypes

        rounded: np.ndarray = array.astype(ml_dtypes.bfloat16).view(np.uint16)
        return rounded
    words = np.ascontiguousarray(array, dtype=np.float32).view(np.uint32)
    lsb = (words >> np.uint32(16)) & np.uint32(1)
    # uint32 arithmetic wraps only for NaN words near 0xFFFFFFFF, which are
    # replaced below; finite values and infinities never reach 2^32.
    top = ((words + np.uint32(0x7FFF) + lsb) >> np.uint32(16)).astype(np.uint16)
    nan = (words & _F32_ABS) > _F32_INF
    if nan.any():
        top = np.where(nan, (words >> np.uint32(16)).astype(np.uint16) | _BF16_QUIET, top)
    return top


def bf16_truncate_bits(values: npt.ArrayLike) -> np.ndarray:
    """The Rust prototype's bfloat16 conversion: the top 16 bits of each float32, toward zero."""
    words = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32)
    return (words >> np.uint32(16)).astype(np.uint16)


def from_bf16_bits(bits: npt.ArrayLike, dtype: npt.DTypeLike = np.float32) -> np.ndarray:
    """Values of bfloat16 bit patterns, as ``dtype`` (exact: every bfloat16 is a float32).

    >>> from_bf16_bits(np.uint16([16256, 49152])).tolist()
    [1.0, -2.0]
    """
    words = np.asarray(bits, dtype=np.uint16).astype(np.uint32) << np.uint32(16)
    out: np.ndarray = words.view(np.float32).astype(dtype, copy=False)
    return out


def to_fp16(values: npt.ArrayLike) -> tuple[np.ndarray, int]:
    """Values rounded to float16 (nearest even) and how many finite ones overflowed.

    >>> half, overflows = to_fp16(np.float32([1.0, 65519.0, 65520.0, np.inf]))
    >>> half.tolist(), overflows
    ([1.0, 65504.0, inf, inf], 1)
    """
    array = np.asarray(values)
    with np.errstate(over="ignore"):
        half = array.astype(np.float16)
    overflows = int(np.count_nonzero(np.isinf(half) & np.isfinite(array)))
    return half, overflows
