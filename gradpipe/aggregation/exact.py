"""Exact sums of a few float64 values, whatever the order and grouping of the additions.

Aggregation needs a handful of small sums that decide something: the squared
L2 norm of a peer's update (it sets the clipping scale of every element of
that peer) and the ``(n, n)`` matrix of squared distances between peers (it
selects peers for Krum and Bulyan). They are accumulated over the chunks of
every tensor by a tree whose shape depends on the scheduler. Float64 addition
is not associative, so a float64 running sum would round differently for
another tree, and one bit of a norm or a distance can change which peer is
selected or every bit of a clipped update.

:class:`ExactSum` keeps each sum as a Python integer in units of ``2**-1074``
(the smallest float64 subnormal), so every float64 value converts exactly and
additions are exact: the total is a function of the multiset of addends alone,
and :meth:`ExactSum.to_array` rounds it once (CPython's ``int / int`` is
correctly rounded). The cost is a few hundred nanoseconds per value, paid once
per chunk partial, never per element.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from gradpipe.errors import InvalidInputError

__all__ = ["ExactSum"]

_SCALE_BITS = 1074
_ONE = 1 << _SCALE_BITS


def _to_units(value: float) -> int:
    numerator, denominator = value.as_integer_ratio()
    # float64 denominators are powers of two no larger than 2**1074: the division is exact.
    return numerator * (_ONE // denominator)


@dataclass(frozen=True)
class ExactSum:
    """The exact sum of float64 arrays of one shape, as integers in units of ``2**-1074``.

    >>> a = ExactSum.of(np.array([1e16]))
    >>> b = ExactSum.of(np.array([1.0]))
    >>> c = ExactSum.of(np.array([-1e16]))
    >>> float(ExactSum.combine([a, b, c]).to_array()[0])  # float64 would give 0.0 or 2.0
    1.0
    """

    shape: tuple[int, ...]
    units: tuple[int, ...]  # C order

    @classmethod
    def of(cls, values: np.ndarray) -> ExactSum:
        """Exactly the float64 values of ``values`` (refuses NaN and infinities)."""
        array = np.asarray(values, dtype=np.float64)
        if not np.isfinite(array).all():
            raise InvalidInputError("an exact sum needs finite values; got NaN or infinity")
        return cls(array.shape, tuple(_to_units(float(v)) for v in array.reshape(-1)))

    @classmethod
    def combine(cls, parts: Iterable[ExactSum]) -> ExactSum:
        """The exact sum of ``parts`` (any order, any grouping: the same result)."""
        items = list(parts)
        if not items:
            raise InvalidInputError("nothing to combine: no partial sums")
        shape = items[0].shape
        if any(p.shape != shape for p in items):
            shapes = sorted({p.shape for p in items})
            raise InvalidInputError(f"partial sums of different shapes: {shapes}")
        totals = [sum(column) for column in zip(*(p.units for p in items), strict=True)]
        return cls(shape, tuple(totals))

    def to_array(self) -> np.ndarray:
        """The sums rounded once to float64 (correctly rounded; may overflow to inf)."""
        values = [_round(units) for units in self.units]
        return np.array(values, dtype=np.float64).reshape(self.shape)


def _round(units: int) -> float:
    try:
        return units / _ONE
    except OverflowError:
        return float("inf") if units > 0 else float("-inf")
