"""Top-k sparsification and the error-feedback residual.

Top-k keeps the ``k = ⌈F·n⌉`` values of largest magnitude, exactly, and drops
the rest. What the dropped values add up to is a precise bound: they are the
``n − k`` smallest squares, whose mean is at most the mean of all squares, so

    ‖x̂ − x‖₂ ≤ sqrt(1 − k/n)·‖x‖₂ ≤ sqrt(1 − F)·‖x‖₂.

It is a bound only with ``k`` rounded *up* (``⌊F·n⌋`` can keep less than F of
the values), only for finite ``x`` (the codecs keep non-finite values apart),
and only against the vector that was compressed: with error feedback that is
``x + e``, the gradient plus the carried residual, not the gradient alone, and
the error against the gradient is unbounded by F (a residual can grow over
steps). Kept values are stored in their own dtype, so they add no error.

Error feedback (Seide et al. 2014; Karimireddy et al. 2019) compresses the
gradient plus what earlier steps dropped, and carries what this step drops:
:func:`error_feedback` is that step for any compressor, pure.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np

from gradpipe.errors import InvalidInputError

__all__ = ["error_feedback", "parse_fraction", "topk_bound", "topk_count", "topk_indices"]


def parse_fraction(value: object, *, what: str = "top-k fraction") -> float:
    """A fraction in (0, 1]."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value <= 1:
        raise InvalidInputError(f"{what} must be a number in (0, 1], not {value!r}")
    return float(value)


def topk_count(size: int, fraction: float) -> int:
    """How many of ``size`` values top-k keeps: ``⌈fraction·size⌉`` (all of a tiny chunk).

    >>> topk_count(1000, 0.1), topk_count(7, 0.1), topk_count(0, 0.5)
    (100, 1, 0)
    """
    # ceil of a product that floating point may land a hair above an integer
    k = math.ceil(fraction * size - 1e-9 * size)
    return min(size, max(k, 1 if size else 0))


def topk_indices(values: np.ndarray, k: int) -> np.ndarray:
    """Sorted positions of the ``k`` values of largest magnitude (1-D, finite values).

    Ties at the threshold are broken by position (the earliest kept), so the
    choice is deterministic.

    >>> topk_indices(np.array([0.1, -3.0, 2.0, 0.0]), 2).tolist()
    [1, 2]
    """
    n = values.size
    if k >= n:
        return np.arange(n, dtype=np.int64)
    if k <= 0:
        return np.empty(0, dtype=np.int64)
    magnitude = np.abs(values)
    # The k-th largest magnitude, then everything above it and the first ties.
    threshold = np.partition(magnitude, n - k)[n - k]
    above = np.flatnonzero(magnitude > threshold)
    ties = np.flatnonzero(magnitude == threshold)[: k - above.size]
    return np.sort(np.concatenate([above, ties]))


def topk_bound(size: int, fraction: float) -> float:
    """``sqrt(1 − k/n)``: the L2 error bound, relative to ``‖x‖₂``, of top-k on ``size`` values."""
    if size == 0:
        return 0.0
    return math.sqrt(1 - topk_count(size, fraction) / size)


def error_feedback(
    gradient: np.ndarray,
    residual: np.ndarray | None,
    compress: Callable[[np.ndarray], np.ndarray],
) -> tuple[np.ndarray, np.ndarray]:
    """One step of error feedback: compress ``gradient + residual``, carry what was lost.

    Parameters
    ----------
    gradient : numpy.ndarray
        This step's gradient.
    residual : numpy.ndarray or None
        What earlier steps dropped (None or zeros at the first step).
    compress : callable
        The compressor, as encode-then-decode: array in, array of the same shape out.

    Returns
    -------
    (numpy.ndarray, numpy.ndarray)
        What is sent (the compressed corrected gradient, as ``compress``
        returns it) and the next residual, ``gradient + residual − sent``, in float64.

    Examples
    --------
    >>> keep_largest = lambda v: np.where(np.abs(v) >= np.abs(v).max(), v, 0.0)
    >>> sent, e = error_feedback(np.array([3.0, 1.0]), None, keep_largest)
    >>> sent.tolist(), e.tolist()
    ([3.0, 0.0], [0.0, 1.0])
    >>> sent, e = error_feedback(np.array([0.5, 2.5]), e, keep_largest)
    >>> sent.tolist(), e.tolist()
    ([0.0, 3.5], [0.5, 0.0])
    """
    corrected = np.asarray(gradient, dtype=np.float64)
    if residual is not None:
        if np.shape(residual) != corrected.shape:
            raise InvalidInputError(
                f"error-feedback residual has shape {np.shape(residual)}, the gradient "
                f"{corrected.shape}; start a new residual when the tensor changes shape"
            )
        corrected = corrected + residual
    sent = compress(corrected)
    return sent, corrected - np.asarray(sent, dtype=np.float64)
