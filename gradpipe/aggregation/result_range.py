"""The one final rounding of every aggregate, and what happens when a result does not fit.

Every aggregation method computes in float64 and rounds once to the output
dtype (the peers' dtype): the reducible methods in
:mod:`gradpipe.aggregation.kernel`, the coordinate-wise and Bulyan
methods in :mod:`gradpipe.aggregation.robust`, clipping of the aggregate in
:mod:`gradpipe.aggregation.privacy`. They all round through :func:`round_result`.
Krum copies one peer's chunk bit for bit, so it has nothing to round; the
server optimizers check their own float32 parameters and state for
non-finite values (``graph/server_tasks``) and refuse a step the same way.

A finite float64 result can still be too large for the output dtype (a
``sum`` of float16 updates past 65504, a float32 sum past 3.4e38, DP noise
with a huge clip norm), and a float64 sum itself can overflow. numpy would
store an infinity there; the aggregate would then look computed while
holding values no peer sent. The policy, the same for every method: such a
result is refused with an :class:`~gradpipe.errors.InvalidInputError` that
names the element and its value (callers add the step, tensor and chunk),
exactly as NaN or infinite inputs are refused. There is no opt-in: an
aggregate is never stored with infinities. The methods that average (mean,
weighted mean, FedAvg, median, trimmed mean, Krum, Multi-Krum, Bulyan)
cannot overflow their inputs' dtype, their result lying between the peers'
values; ``sum`` and DP-FedAvg's noise can.
"""

from __future__ import annotations

import numpy as np

from gradpipe.errors import InvalidInputError

__all__ = ["round_result"]

_FAST = (np.dtype(np.float32), np.dtype(np.float64))


def round_result(
    values: np.ndarray,
    dtype: np.dtype | str | None = None,
    *,
    out: np.ndarray | None = None,
    offset: int = 0,
    context: str = "",
) -> np.ndarray:
    """``values`` (float64) rounded once to ``dtype`` (or into ``out``), refused if they do not fit.

    Raises :class:`~gradpipe.errors.InvalidInputError` naming the first
    element (its flat index plus ``offset``) whose rounded value is NaN or
    infinite, after ``context`` (where the result is: step, tensor, chunk).

    >>> round_result(np.array([1.0, 2.5]), "float16").tolist()
    [1.0, 2.5]
    """
    if out is None:
        out = np.empty(values.shape, dtype=np.dtype(dtype) if dtype is not None else values.dtype)
    with np.errstate(over="ignore", invalid="ignore"):  # an overflow is refused below
        np.copyto(out, values, casting="unsafe")
    if not _all_finite(out):
        flat = out.reshape(-1)
        index = int(np.flatnonzero(~np.isfinite(flat))[0])
        message = _message(float(values.reshape(-1)[index]), out.dtype, offset + index)
        raise InvalidInputError(f"{context}: {message}" if context else message)
    return out


def _all_finite(array: np.ndarray) -> bool:
    # One reduction, no temporary, in the common case: a sum of finite values is
    # finite unless it overflows, which the elementwise check then tells apart.
    with np.errstate(over="ignore", invalid="ignore"):  # finite values may sum past the range
        if array.dtype in _FAST and np.isfinite(np.add.reduce(array, axis=None)):
            return True
    return bool(np.isfinite(array).all())


def _message(value: float, dtype: np.dtype, element: int) -> str:
    if not np.isfinite(value):
        return (
            f"element {element} of the result is {value} in float64 (the float64 "
            "computation overflows); nothing is stored: scale the updates down"
        )
    largest = float(np.finfo(dtype).max)
    return (
        f"element {element} of the result is {value:.6g}, beyond {dtype}'s largest finite "
        f"value {largest:.6g}; the aggregate is not stored with infinities: use a method "
        "that averages (mean, fedavg) instead of sum, scale the updates down, or send them "
        "in a wider dtype"
    )
