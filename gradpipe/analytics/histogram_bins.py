"""Log-spaced magnitude histograms of float values, binned exactly from their bits.

The bins are TensorBoard's (docs/design/017, step 5): ``m`` bins per octave, with
edges ``2**(e + j/m)`` over the magnitudes ``[2**low_exp, 2**high_exp)``, mirrored
for negative values, plus zero, under- and overflow per sign, the infinities and
NaN. :class:`BinLayout` fixes their order; :func:`histogram_counts` counts values
of float16, bfloat16, float32 or float64 into them.

No value is binned through a ``log``. The bit patterns of one sign are ordered as
their magnitudes, so each edge becomes one integer: the smallest pattern whose
value reaches it. For a normal number that is ``(e + bias) << F | T_j``, with the
mantissa threshold ``T_j = ceil((2**(j/m) - 1) * 2**F)`` (F mantissa bits), and a
subnormal edge is ``ceil(2**(e + j/m))`` in units of the smallest subnormal. Both
come from an exact integer m-th root, since a float ``2**(j/m)`` can round to the
wrong side of an edge. A value's bin is then the number of edge patterns at or
below its bits: exact at every edge, the same rule for every dtype, with no
special case for subnormals.

Counting is where the time goes, so it avoids a binary search per element where
it can: a 16-bit value's pattern is its own cell (65,536 of them); a float32 is
split into its top 16 bits and one comparison of its low 16 bits with the single
edge that can fall inside them. float64, and float32 layouts reaching deep into
its subnormals (two edges in one cell), take ``np.searchsorted`` over the edge
patterns. Each cell's count then goes to the cell's bin.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass, field
from fractions import Fraction
from functools import cache, lru_cache
from typing import Any, Final

import numpy as np

from gradpipe.core.dtypes import dtype_name, is_float
from gradpipe.errors import InvalidInputError

__all__ = ["BinLayout", "bin_layout", "histogram_counts", "parse_bins_per_octave"]

#: Exponents the magnitude range may span: every edge is then a normal float64, so
#: ``lower``/``upper`` hold each edge's nearest float64 exactly.
_MIN_EXP: Final = -1022
_MAX_EXP: Final = 1023

#: Values per counting pass: the temporaries (about 15 bytes a value) stay in cache.
_BLOCK: Final = 1 << 18

#: Which uint16 of a native uint32 holds its top 16 bits.
_HIGH_HALF: Final = 1 if sys.byteorder == "little" else 0


@dataclass(frozen=True)
class BinLayout:
    """The bins of a magnitude histogram, in increasing order of value.

    Bin order: ``nan``, ``-inf``, ``-overflow`` (finite ``x <= -2**high_exp``), the
    negative magnitude bins from the largest magnitude to the smallest,
    ``-underflow`` (``-2**low_exp < x < 0``), ``zero`` (both zeros), ``+underflow``,
    the positive magnitude bins from the smallest, ``+overflow`` and ``+inf``.

    A magnitude bin is labelled with its lower edge (``+2^-32``, ``-2^(15+1/2)``) and
    holds the magnitudes from that edge up to, not including, the next one.

    Attributes
    ----------
    bins_per_octave, low_exp, high_exp
        The parameters, as given to :func:`bin_layout`.
    labels
        One name per bin.
    lower, upper
        float64 bounds of each bin's values, increasing along the axis: a positive
        bin holds ``[lower, upper)``, a negative one ``(lower, upper]``, and the
        under- and overflow bins the open side up to zero or infinity. Inner edges
        ``2**(e + j/m)`` are irrational for ``j > 0`` and given as their nearest
        float64. ``zero``, ``-inf`` and ``+inf`` have ``lower == upper`` (0, -inf,
        inf); ``nan`` has NaN for both. Read-only.
    """

    bins_per_octave: int = 2
    low_exp: int = -32
    high_exp: int = 16
    labels: tuple[str, ...] = field(init=False, repr=False, compare=False)
    lower: np.ndarray = field(init=False, repr=False, compare=False)
    upper: np.ndarray = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        m = parse_bins_per_octave(self.bins_per_octave)
        low, high = _parse_exponent_range(self.low_exp, self.high_exp)
        # One edge list, smallest first: 2**low, ..., 2**(high - 1/m), then 2**high.
        octaves = np.repeat(np.arange(low, high), m)
        significands = np.tile([_nearest_significand(j, m) for j in range(m)], high - low)
        edges = np.append(np.ldexp(significands, octaves), math.ldexp(1.0, high))
        names = [_exponent_label(e, j, m) for e in range(low, high) for j in range(m)]
        zero, inf, nan = np.zeros(1), np.full(1, np.inf), np.full(1, np.nan)
        lower = [nan, -inf, -inf, -edges[:0:-1], -edges[:1], zero, zero, edges, inf]
        upper = [nan, -inf, -edges[-1:], -edges[-2::-1], zero, zero, edges, inf, inf]
        labels = (
            "nan",
            "-inf",
            "-overflow",
            *(f"-{name}" for name in reversed(names)),
            "-underflow",
            "zero",
            "+underflow",
            *(f"+{name}" for name in names),
            "+overflow",
            "+inf",
        )
        object.__setattr__(self, "bins_per_octave", m)
        object.__setattr__(self, "low_exp", low)
        object.__setattr__(self, "high_exp", high)
        object.__setattr__(self, "labels", labels)
        for name, parts in (("lower", lower), ("upper", upper)):
            bounds = np.concatenate(parts)
            bounds.flags.writeable = False
            object.__setattr__(self, name, bounds)

    def __reduce__(self) -> tuple[Any, ...]:
        # Rebuilt from its parameters: the unpickled layout is the cached, read-only one.
        return (bin_layout, (self.bins_per_octave, self.low_exp, self.high_exp))

    @property
    def size(self) -> int:
        """Number of bins: ``2 * bins_per_octave * (high_exp - low_exp) + 8``."""
        return len(self.labels)

    def to_dict(self) -> dict[str, int]:
        """JSON-able form: the parameters (the bins follow from them)."""
        return {
            "bins_per_octave": self.bins_per_octave,
            "low_exp": self.low_exp,
            "high_exp": self.high_exp,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> BinLayout:
        """Inverse of :meth:`to_dict` (validated like :func:`bin_layout`)."""
        return bin_layout(data["bins_per_octave"], data["low_exp"], data["high_exp"])


@lru_cache(maxsize=64, typed=True)  # typed: True and 2.0 must not hit 1's and 2's layouts
def bin_layout(bins_per_octave: int = 2, low_exp: int = -32, high_exp: int = 16) -> BinLayout:
    """The bins for ``bins_per_octave`` bins per octave over ``[2**low_exp, 2**high_exp)``.

    Parameters
    ----------
    bins_per_octave
        Bins per power of two, 1 to 16.
    low_exp, high_exp
        Exponents of the smallest and the first too large magnitude,
        ``-1022 <= low_exp < high_exp <= 1023``.

    Returns
    -------
    BinLayout
        The layout (cached: repeated calls share one object and its counting plans).

    Raises
    ------
    InvalidInputError
        If a parameter is out of range.

    Examples
    --------
    >>> layout = bin_layout(1, -1, 1)
    >>> layout.labels[6:]
    ('zero', '+underflow', '+2^-1', '+2^0', '+overflow', '+inf')
    >>> layout.lower[8:10].tolist(), layout.upper[8:10].tolist()
    ([0.5, 1.0], [1.0, 2.0])
    """
    return BinLayout(bins_per_octave, low_exp, high_exp)


def histogram_counts(values: np.ndarray, layout: BinLayout) -> np.ndarray:
    """Count ``values`` into the bins of ``layout``.

    Parameters
    ----------
    values
        float16, bfloat16, float32 or float64 values of any shape, in either byte
        order; read-only arrays are fine.
    layout
        The bins, from :func:`bin_layout`.

    Returns
    -------
    numpy.ndarray
        int64 counts, one per bin of ``layout``; they sum to ``values.size``.
        Counts of several arrays add up elementwise.

    Raises
    ------
    InvalidInputError
        If ``values`` are not of one of the four float dtypes.

    Examples
    --------
    >>> layout = bin_layout(1, -1, 1)
    >>> counts = histogram_counts(np.array([0.5, 0.75, 1.0, -0.0, np.nan]), layout)
    >>> {name: int(n) for name, n in zip(layout.labels, counts) if n}
    {'nan': 1, 'zero': 1, '+2^-1': 2, '+2^0': 1}
    """
    values = np.asarray(values)
    if not is_float(values.dtype):
        raise InvalidInputError(
            f"histogram_counts: values are {values.dtype}; histograms take float16, "
            "bfloat16, float32 or float64 values (convert other types first)"
        )
    plan = _plan(layout, dtype_name(values.dtype))
    if not values.dtype.isnative:
        values = values.astype(values.dtype.newbyteorder("="))
    bits = values.reshape(-1).view(plan.boundaries.dtype)
    cell_counts = np.zeros(plan.cell_bins.size, dtype=np.int64)
    for start in range(0, bits.size, _BLOCK):
        cells = _cells(plan, bits[start : start + _BLOCK])
        cell_counts += np.bincount(cells, minlength=plan.cell_bins.size)
    counts = np.zeros(layout.size, dtype=np.int64)
    np.add.at(counts, plan.cell_bins, cell_counts)
    return counts


def parse_bins_per_octave(value: object) -> int:
    """Return ``value`` if it is a valid number of bins per octave (an int, 1 to 16)."""
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or not 1 <= value <= 16:
        raise InvalidInputError(
            f"bins_per_octave must be an integer from 1 to 16, not {value!r}; "
            "TensorBoard's resolution is about 2 to 4"
        )
    return int(value)


def _parse_exponent_range(low_exp: object, high_exp: object) -> tuple[int, int]:
    low, high = _parse_exponent("low_exp", low_exp), _parse_exponent("high_exp", high_exp)
    if not _MIN_EXP <= low < high <= _MAX_EXP:
        raise InvalidInputError(
            f"the magnitude range [2**{low}, 2**{high}) is empty or outside float64's normal "
            f"numbers; pass {_MIN_EXP} <= low_exp < high_exp <= {_MAX_EXP}"
        )
    return low, high


def _parse_exponent(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int | np.integer):
        raise InvalidInputError(f"{name} must be an integer exponent of 2, not {value!r}")
    return int(value)


@dataclass(frozen=True, eq=False)
class _Plan:
    """How one dtype's values are counted into one layout.

    ``boundaries`` are the bit patterns at which a new bin starts, sorted as
    unsigned integers (positive values, then negative ones, each by magnitude):
    a pattern's "raw" bin is the number of boundaries at or below it.
    ``cell_bins`` gives the layout bin of each counting cell: a raw bin, a 16-bit
    pattern, or (when ``low_thresholds`` is set) a float32's top 16 bits doubled,
    plus one if its low 16 bits exceed that prefix's threshold.
    """

    boundaries: np.ndarray
    cell_bins: np.ndarray
    low_thresholds: np.ndarray | None = None


def _cells(plan: _Plan, bits: np.ndarray) -> np.ndarray:
    """The counting cell of each bit pattern (``bits`` contiguous, 1-D)."""
    if plan.low_thresholds is not None:
        words = bits.view(np.uint16)
        high, low = words[_HIGH_HALF::2], words[1 - _HIGH_HALF :: 2]
        cells = np.left_shift(high, 1, dtype=np.uint32)
        cells += low > plan.low_thresholds.take(high)
        return cells
    if bits.dtype.itemsize == 2:
        return bits
    return np.searchsorted(plan.boundaries, bits, side="right")


@lru_cache(maxsize=64)
def _plan(layout: BinLayout, name: str) -> _Plan:
    """The counting plan for values of dtype ``name`` (built once per layout and dtype)."""
    width, mantissa = _FORMATS[name]
    m = layout.bins_per_octave
    edges = [
        _edge_pattern(e, j, m, width, mantissa)
        for e in range(layout.low_exp, layout.high_exp)
        for j in range(m)
    ]
    edges.append(_edge_pattern(layout.high_exp, 0, m, width, mantissa))
    inf = ((1 << (width - 1 - mantissa)) - 1) << mantissa
    # A sign's raw bins: zero, underflow, the magnitude bins, overflow, inf, NaN.
    starts = [1, *edges, inf, inf + 1]
    sign = 1 << (width - 1)
    boundaries = np.array([*starts, sign, *(sign + s for s in starts)], dtype=f"u{width // 8}")
    raw_bins = _raw_to_layout(layout)
    if width == 16:
        patterns = np.arange(1 << 16, dtype=np.uint16)
        return _Plan(boundaries, raw_bins[np.searchsorted(boundaries, patterns, side="right")])
    if width == 32:
        split = _split_at_low_half(boundaries)
        if split is not None:
            low_thresholds, cell_starts = split
            cell_raw = np.searchsorted(boundaries, cell_starts, side="right")
            return _Plan(boundaries, raw_bins[cell_raw], low_thresholds)
    return _Plan(boundaries, raw_bins)


def _split_at_low_half(boundaries: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
    """Per top-16-bit prefix, the one boundary inside it as a low-half threshold.

    Returns the thresholds (a prefix's low halves above its threshold start a new
    bin; 0xFFFF where none does) and the first pattern of each cell (two per
    prefix), or None if some prefix holds two boundaries.
    """
    inner = np.unique(boundaries[(boundaries & 0xFFFF) != 0])
    prefixes = inner >> 16
    if np.any(prefixes[1:] == prefixes[:-1]):
        return None
    thresholds = np.full(1 << 16, 0xFFFF, dtype=np.uint16)
    thresholds[prefixes] = (inner & 0xFFFF) - 1
    cell_starts = np.arange(1 << 16, dtype=np.uint32) << 16
    cell_starts = np.stack([cell_starts, cell_starts + thresholds + 1], axis=1).reshape(-1)
    return thresholds, cell_starts


def _raw_to_layout(layout: BinLayout) -> np.ndarray:
    """Layout bin of each raw bin (positive values' raw bins first, then negatives')."""
    k = layout.size // 2 - 4  # magnitude bins per sign
    zero, nan = k + 4, 0
    positive = [zero, zero + 1, *range(zero + 2, zero + 2 + k), 2 * k + 6, 2 * k + 7, nan]
    negative = [zero, zero - 1, *range(zero - 2, 2, -1), 2, 1, nan]
    return np.array(positive + negative, dtype=np.intp)


#: Bit width and mantissa bits F of each dtype.
_FORMATS: Final[dict[str, tuple[int, int]]] = {
    "float16": (16, 10),
    "bfloat16": (16, 7),
    "float32": (32, 23),
    "float64": (64, 52),
}


def _edge_pattern(e: int, j: int, m: int, width: int, mantissa: int) -> int:
    """The smallest non-negative bit pattern whose value is at least ``2**(e + j/m)``.

    That is infinity's pattern when the edge is above every finite value.
    """
    exponent_bits = width - 1 - mantissa
    bias = (1 << (exponent_bits - 1)) - 1
    emin = 1 - bias
    if e >= emin:
        # Significand 2**F <= c <= 2**(F+1): c - 2**F is T_j (a carry into the exponent is fine).
        pattern = ((e - emin) << mantissa) + _ceil_pow2_root(mantissa * m + j, m)
    else:
        # A subnormal pattern is its value in units of 2**(emin - F).
        pattern = _ceil_pow2_root((e - emin + mantissa) * m + j, m)
    return min(pattern, ((1 << exponent_bits) - 1) << mantissa)


@cache
def _ceil_pow2_root(s: int, m: int) -> int:
    """``ceil(2**(s/m))``, exactly."""
    if s <= 0:
        return 1
    root = _floor_root(1 << s, m)
    return root if root**m == 1 << s else root + 1


def _floor_root(n: int, m: int) -> int:
    """The largest integer r with ``r**m <= n`` (n >= 1): Newton's method on integers."""
    root = 1 << -(-n.bit_length() // m)  # above the root: Newton then decreases to it
    while True:
        step = ((m - 1) * root + n // root ** (m - 1)) // m
        if step >= root:
            return root
        root = step


def _nearest_significand(j: int, m: int) -> float:
    """The float64 nearest to ``2**(j/m)``; scaled by a power of two, it stays the nearest."""
    n = 1 << (62 * m + j)
    root = _floor_root(n, m)  # 2**62 <= root < 2**63
    if root**m != n:
        # A sticky bit: the true root is not an integer, so never round as from a tie.
        return math.ldexp(float(2 * root + 1), -63)
    return math.ldexp(float(root), -62)


def _exponent_label(e: int, j: int, m: int) -> str:
    if j == 0:
        return f"2^{e}"
    fraction = Fraction(j, m)
    return f"2^({e}+{fraction.numerator}/{fraction.denominator})"
