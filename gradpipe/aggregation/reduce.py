"""Sum, mean, weighted mean and FedAvg as partial states, reducible by any tree.

A graph reduces one chunk of a tensor over the ``n`` peers of a step by a
bounded tree: leaves :func:`partial` (one peer's chunk), inner tasks
:func:`combine`, the root :func:`finish`. The result must be the same bits
whatever the tree (``split_every``), the worker count or the scheduler, because
the aggregate's id is the hash of those bits.

Exactness: a canonical tree, not exact summation
------------------------------------------------
Peers are numbered ``0 .. n-1`` in a fixed order (the caller's: sorted peer
names). Each peer's term is ``fl64(c_i * x_i)`` with ``c_i = weight_i * scale_i``
(exact for a float32/16 chunk and an integer weight below ``2**29``). The sum
is then *defined* by one binary tree that depends on ``n`` only: the aligned
dyadic blocks ``[a, a + 2**k)``, ``a`` a multiple of ``2**k``, each summed as
left child + right child in float64, and the blocks of the binary
decomposition of ``[0, n)`` added left to right. A :class:`Partial` covers a
contiguous peer range and holds the sums of the maximal dyadic blocks inside it
(its canonical forest); :func:`combine` concatenates adjacent ranges and merges
sibling blocks only. So every block sum is computed by the same additions in
every tree, and :func:`finish` folds the same forest in the same order: the
float64 total, and after the one final rounding the result, are bit-identical
for any grouping of the peers into contiguous runs. (Pairwise summation also
bounds the float64 error by ``ceil(log2 n)·ε₆₄·Σ|c_i x_i|``, against
``(n-1)·ε₆₄·...`` for a running sum.)

Cost: the same ``n`` multiplies and ``n - 1`` float64 additions per element as
a naive weighted sum. :func:`partial_of` (a contiguous group of peers),
:func:`combine`, :func:`finish` and :func:`reduce_peers` run the tree in
cache-sized blocks of elements (:mod:`gradpipe.aggregation.kernel`), so
the float64 terms and sibling sums never make whole-chunk arrays: a partial
holds one array per block of its canonical forest (one when its range is an
aligned power of two), and a reduction finished in the same call holds none.
Measured on a shared 2-core machine, 8 peers x 1 M float32 in memory:
:func:`reduce_peers` 0.66x the time of the whole-array version, and
:func:`partial_of` of the 8 peers a third of the time of :func:`combine` of
the leaf :func:`partial` of each (which allocated a float64 array per peer and per
merge). Exact summation (an integer superaccumulator per element, some
ten int64 limbs per float32 product and three scattered adds per term) would
also free the result from the peer order, but was estimated at tens of times
the cost of a float64 add and not built: FedAvg must run near memory
bandwidth, and the peer order is fixed by the caller anyway (it is part of the
aggregate's provenance).

Chunking does not matter: the reduction is element-wise, so any chunk grid
gives the same bits per element.

Weights of any magnitude
------------------------
Weights are positive finite float64 numbers, from 5e-324 to 1.8e308. Used as
given, tiny weights make the terms ``w_i * x_i`` underflow (weights of 5e-324
average 0.3 and 0.5 to 0) and large ones make the terms or the total weight
overflow. So every reduction first multiplies all weights of the step by one
power of two, ``2**shift`` (:func:`weight_shift`), chosen so that the largest
is below ``1/n`` and the total weight below 1. A power of two changes no bit of
a normal float64 product, sum or quotient, so for ordinary weights the result
is bit for bit the unshifted one (the exception: float64 updates within a few
hundred binades of the subnormal range, below about ``2**-960``, whose scaled
terms may leave the normal range and round differently, within the bound below;
float32, float16 and bfloat16 values never come near it); the terms can no
longer overflow (``|c_i x_i| <= |x_i|``), and no weighted mean is lost to
underflow. A coefficient that still falls below float64's normal range (a
weight more than ``2**1022`` times smaller than the largest, or a tiny clipping
factor) is applied as a normal mantissa times an exact power of two
(``Item.exponent``), so it keeps its 53 bits. ``sum`` scales its float64 total
back by ``2**-shift`` before the one rounding. Error bound (tested against
exact rationals over the whole float64 range of weights): ``|result - exact| <=
(4*ceil(log2 n) + 4) * 2**-53 * sum(w_i |x_i|) / D + n**2 * 2**-1073 * max(w) /
D`` before the rounding to the output dtype (D: the total weight, or 1 for
``sum``), then at most one unit in the last place of the output dtype; a result
that does not fit the output dtype is refused
(:mod:`gradpipe.aggregation.result_range`).
"""

from __future__ import annotations

import itertools
import math
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from enum import StrEnum

import numpy as np

from gradpipe.aggregation.inputs import check_peer_chunks, parse_weights, where
from gradpipe.aggregation.kernel import Item, NotFiniteError, Program
from gradpipe.errors import InvalidInputError

__all__ = [
    "AggregationMethod",
    "Partial",
    "combine",
    "finish",
    "finish_peers",
    "partial",
    "partial_of",
    "reduce_peers",
    "weight_shift",
]

_MIN_NORMAL = sys.float_info.min


class AggregationMethod(StrEnum):
    """The aggregation methods, by their CLI names."""

    SUM = "sum"
    MEAN = "mean"
    WEIGHTED_MEAN = "weighted-mean"
    FEDAVG = "fedavg"
    MEDIAN = "median"
    TRIMMED_MEAN = "trimmed-mean"
    KRUM = "krum"
    MULTI_KRUM = "multi-krum"
    BULYAN = "bulyan"
    DP_FEDAVG = "dp-fedavg"

    @property
    def reducible(self) -> bool:
        """True for the methods this module reduces by a tree of partials."""
        return self in _REDUCIBLE

    @property
    def divides(self) -> bool:
        """True when :func:`finish` divides the weighted sum by the total weight."""
        return self in _REDUCIBLE and self is not AggregationMethod.SUM


_REDUCIBLE = frozenset(
    {
        AggregationMethod.SUM,
        AggregationMethod.MEAN,
        AggregationMethod.WEIGHTED_MEAN,
        AggregationMethod.FEDAVG,
        # the unweighted mean of the clipped updates, noise added in finish
        AggregationMethod.DP_FEDAVG,
    }
)


@dataclass(frozen=True)
class _Block:
    """The float64 sum of the terms of the aligned dyadic peer block ``[lo, lo + size)``."""

    lo: int
    size: int
    total: np.ndarray
    weight: float

    @property
    def hi(self) -> int:
        return self.lo + self.size

    def is_left_sibling_of(self, other: _Block) -> bool:
        return self.size == other.size and self.lo % (2 * self.size) == 0 and self.hi == other.lo


@dataclass(frozen=True)
class Partial:
    """The weighted sum of one chunk over the contiguous peer range ``[lo, hi)``.

    ``blocks`` is the range's canonical forest (see the module docstring); the
    weight of a block is the float64 sum of its peers' weights, summed by the
    same tree, so the total weight is also independent of the grouping.
    Weights (and so sums) are scaled by ``2**shift`` (:func:`weight_shift`):
    only partials of one shift combine.
    """

    lo: int
    hi: int
    shape: tuple[int, ...]
    dtype: np.dtype
    blocks: tuple[_Block, ...]
    shift: int = 0

    @property
    def count(self) -> int:
        """The number of peers this partial covers."""
        return self.hi - self.lo

    @property
    def weight(self) -> float:
        """The total weight of the covered peers (folded like the sums)."""
        total = self.blocks[0].weight
        for block in self.blocks[1:]:
            total += block.weight
        return total

    @property
    def nbytes(self) -> int:
        """Bytes of array data held (what a task keeps in memory)."""
        return sum(b.total.nbytes for b in self.blocks)


def weight_shift(weights: Sequence[float]) -> int:
    """The power of two that scales the weights of a step so their total is below 1.

    ``shift`` is such that every ``w_i * 2**shift`` is below ``1/n`` (``n``
    weights), so their sum is below 1, and the largest is at least
    ``1/(4n)``. Every partial of a step's reduction must use the same shift:
    the caller computes it from all the step's weights.

    >>> weight_shift([1.0, 1.0])  # 2**-2: weights 1/4 each, total 1/2
    -2
    >>> weight_shift([5e-324])  # the smallest subnormal becomes 1/2
    1073
    """
    values = parse_weights(weights)
    _, exponent = math.frexp(max(values))  # max = m * 2**exponent, 0.5 <= m < 1
    return -(exponent + (len(values) - 1).bit_length())  # (n - 1).bit_length() = ceil(log2 n)


def _coefficient(weight: float, scale: float, shift: int) -> tuple[float, int]:
    """``weight * scale * 2**shift`` as ``(c, e)`` meaning ``c * 2**e``, with ``c`` normal.

    In the normal range ``e`` is 0 and ``c`` is the one product the unshifted
    weights would give, times the exact power of two. Below it ``c`` is the
    product of the mantissas, so no bit is lost to underflow before the term.
    """
    try:
        shifted = math.ldexp(weight, shift)
    except OverflowError:
        raise InvalidInputError(
            f"weight {weight!r} times 2**{shift} overflows float64; pass weight_shift(weights)"
        ) from None
    product = shifted * scale
    if product == 0.0 and scale == 0.0:
        return 0.0, 0
    if shifted >= _MIN_NORMAL and product >= _MIN_NORMAL:
        return product, 0
    weight_m, weight_e = math.frexp(weight)
    scale_m, scale_e = math.frexp(scale)
    return weight_m * scale_m, weight_e + scale_e + shift


def _peer_items(
    chunks: Sequence[np.ndarray],
    first: int,
    weights: Sequence[float],
    scales: Sequence[float],
    shift: int,
) -> list[Item]:
    """The kernel's leaf items: peer ``first + i``'s chunk, weight and coefficient."""
    items = []
    for i, (chunk, weight, scale) in enumerate(zip(chunks, weights, scales, strict=True)):
        peer = first + i
        if not np.isfinite(scale) or scale < 0:
            raise InvalidInputError(f"peer #{peer}: scale {scale!r} must be finite and >= 0")
        if chunk.dtype.kind != "f" and chunk.dtype.name != "bfloat16":
            raise InvalidInputError(f"peer #{peer}: dtype {chunk.dtype} cannot be averaged")
        # c_i = weight_i * scale_i * 2**shift: the term is fl64(c_i * x_i), one rounding at most
        # (two when c_i is below the normal range: the mantissa's product, then the exponent's).
        coefficient, exponent = _coefficient(weight, float(scale), shift)
        shifted = math.ldexp(weight, shift)  # finite: _coefficient checked it
        items.append(Item(peer, 1, shifted, chunk.reshape(-1), coefficient, exponent))
    return items


def _not_finite(
    chunks: Sequence[np.ndarray], first: int, names: Sequence[str] | None
) -> InvalidInputError:
    """The error for a reduction whose sum is not finite: the first peer holding NaN or inf."""
    for i, chunk in enumerate(chunks):
        if not np.isfinite(chunk).all():
            name = repr(names[i]) if names is not None else f"#{first + i}"
            return InvalidInputError(f"peer {name}: the update holds NaN or infinity")
    # Every value finite, the float64 sum not: float64 updates near the overflow.
    return InvalidInputError(
        f"peers #{first} to #{first + len(chunks) - 1}: the weighted sum overflows float64"
    )


def partial_of(
    chunks: Sequence[np.ndarray],
    *,
    first: int = 0,
    weights: Sequence[float] | None = None,
    scales: Sequence[float] | None = None,
    names: Sequence[str] | None = None,
    shift: int = 0,
) -> Partial:
    """The partial of the contiguous peers ``first .. first + len(chunks) - 1``, in one pass.

    The same bits as :func:`combine` of each peer's :func:`partial`, without
    a float64 array per peer: the terms and sibling sums are computed in
    cache-sized blocks (:mod:`gradpipe.aggregation.kernel`). ``names``
    name the peers in errors (default ``#index``). ``shift`` scales the
    weights by ``2**shift``: pass :func:`weight_shift` of *all* the step's
    weights, so extreme weights neither underflow nor overflow.
    """
    if isinstance(first, bool) or not isinstance(first, int) or first < 0:
        raise InvalidInputError(f"peer index {first!r} must be an integer >= 0")
    _check_group(chunks, first)
    values = parse_weights([1.0] * len(chunks) if weights is None else weights)
    factors = [1.0] * len(chunks) if scales is None else list(scales)
    head = chunks[0]
    program = Program(_peer_items(chunks, first, values, factors, _parse_shift(shift)))
    try:
        arrays = program.partials()
    except NotFiniteError:
        raise _not_finite(chunks, first, names) from None
    blocks = tuple(
        _Block(lo, size, total.reshape(head.shape), weight)
        for (lo, size, weight), total in zip(program.outputs, arrays, strict=True)
    )
    return Partial(first, first + len(chunks), head.shape, head.dtype, blocks, shift)


def _parse_shift(shift: int) -> int:
    if isinstance(shift, bool) or not isinstance(shift, int) or abs(shift) > 4096:
        raise InvalidInputError(f"weight shift {shift!r} must be an integer (see weight_shift)")
    return shift


def _check_group(chunks: Sequence[np.ndarray], first: int) -> None:
    if not chunks:
        raise InvalidInputError("nothing to reduce: no chunks")
    head = chunks[0]
    for i, chunk in enumerate(chunks[1:], start=1):
        if chunk.shape != head.shape or chunk.dtype != head.dtype:
            raise InvalidInputError(
                f"peer #{first + i}: {chunk.dtype}{list(chunk.shape)} differs from peer "
                f"#{first}'s {head.dtype}{list(head.shape)}"
            )


def partial(
    chunk: np.ndarray, *, peer: int, weight: float = 1.0, scale: float = 1.0, shift: int = 0
) -> Partial:
    """The leaf partial of peer number ``peer`` (its position in the fixed peer order).

    ``weight`` weights the peer in a weighted mean (FedAvg: its ``num_examples``),
    ``scale`` multiplies its update without counting in the total weight (the
    clipping factor ``min(1, C / norm)``), ``shift`` is :func:`weight_shift`
    of all the weights. The term is a fresh array: a partial never aliases
    its input.
    """
    if isinstance(peer, bool) or not isinstance(peer, int) or peer < 0:
        raise InvalidInputError(f"peer index {peer!r} must be an integer >= 0")
    return partial_of([chunk], first=peer, weights=[weight], scales=[scale], shift=shift)


def _check_adjacent(parts: Sequence[Partial]) -> None:
    if not parts:
        raise InvalidInputError("nothing to combine: no partials")
    first = parts[0]
    for left, right in itertools.pairwise(parts):
        if left.hi != right.lo:
            raise InvalidInputError(
                f"partials cover peers [{left.lo}, {left.hi}) and [{right.lo}, {right.hi}): "
                "only adjacent, non-overlapping peer ranges combine"
            )
        if right.shape != first.shape or right.dtype != first.dtype:
            raise InvalidInputError(
                f"partials of peers [{right.lo}, {right.hi}) hold {right.dtype}"
                f"{list(right.shape)}, not {first.dtype}{list(first.shape)}"
            )
        if right.shift != first.shift:
            raise InvalidInputError(
                f"partials of peers [{right.lo}, {right.hi}) scale their weights by "
                f"2**{right.shift}, not 2**{first.shift}; give every partial of a step "
                "the weight_shift of all its weights"
            )


def _block_items(parts: Sequence[Partial]) -> list[Item]:
    return [Item(b.lo, b.size, b.weight, b.total.reshape(-1)) for p in parts for b in p.blocks]


def combine(partials: Iterable[Partial]) -> Partial:
    """Merge partials of adjacent peer ranges (given in any order) into one.

    Only sibling blocks are added, so the result is the same for every way of
    splitting the range into contiguous runs. The inputs are never written.
    """
    parts = sorted(partials, key=lambda p: p.lo)
    _check_adjacent(parts)
    first = parts[0]
    program = Program(_block_items(parts))
    arrays = program.partials(check=False)
    blocks = tuple(
        _Block(lo, size, total.reshape(first.shape), weight)
        for (lo, size, weight), total in zip(program.outputs, arrays, strict=True)
    )
    return Partial(first.lo, parts[-1].hi, first.shape, first.dtype, blocks, first.shift)


def finish(
    state: Partial | Sequence[Partial],
    *,
    method: AggregationMethod | str = AggregationMethod.FEDAVG,
    peers: int | None = None,
    dtype: np.dtype | str | None = None,
    noise: np.ndarray | None = None,
) -> np.ndarray:
    """The aggregate of a partial covering all peers, rounded once to ``dtype``.

    ``state`` may also be the partials of adjacent peer ranges covering all
    peers (in any order): the same bits as finishing their :func:`combine`,
    without building it. ``sum`` returns the weighted sum; the other
    reducible methods divide it by the total weight (``mean``: give every
    peer weight 1). ``noise`` (float64, the chunk's shape) is added before
    the rounding: the DP-FedAvg noise. ``dtype`` defaults to the peers' dtype.
    """
    chosen = AggregationMethod(method)
    if not chosen.reducible:
        raise InvalidInputError(f"{chosen.value!r} is not a reducible method")
    parts = [state] if isinstance(state, Partial) else sorted(state, key=lambda p: p.lo)
    _check_adjacent(parts)
    lo, hi = parts[0].lo, parts[-1].hi
    if lo != 0 or (peers is not None and hi != peers):
        expected = "all peers" if peers is None else f"peers [0, {peers})"
        raise InvalidInputError(f"finish needs a partial of {expected}, got peers [{lo}, {hi})")
    shape = parts[0].shape
    if noise is not None and noise.shape != shape:
        raise InvalidInputError(f"noise of shape {noise.shape} for a chunk of {shape}")
    program = Program(_block_items(parts))
    out = np.empty(shape, dtype=parts[0].dtype if dtype is None else np.dtype(dtype))
    program.finish(
        out.reshape(-1),
        divisor=program.weight if chosen.divides else None,
        noise=None if noise is None else noise.reshape(-1),
        check=False,
        exponent=0 if chosen.divides else -parts[0].shift,
    )
    return out


def reduce_peers(
    chunks: Sequence[np.ndarray],
    *,
    method: AggregationMethod | str = AggregationMethod.FEDAVG,
    weights: Sequence[float] | None = None,
    scales: Sequence[float] | None = None,
    dtype: np.dtype | str | None = None,
    step: int | None = None,
    peers: Sequence[str] | None = None,
    tensor: str | None = None,
) -> np.ndarray:
    """One chunk of every peer, in peer order, reduced in one call (a whole-step convenience).

    The same bits as any tree of :func:`partial` / :func:`combine` / :func:`finish`
    with ``shift=weight_shift(weights)``.

    >>> a = np.array([1.0, 2.0], np.float32)
    >>> b = np.array([3.0, 6.0], np.float32)
    >>> reduce_peers([a, b], method="fedavg", weights=[1, 3]).tolist()
    [2.5, 5.0]
    """
    chosen = AggregationMethod(method)
    check_peer_chunks(chunks, step=step, peers=peers, tensor=tensor, allow_nan=True)
    if weights is None or chosen in (AggregationMethod.MEAN, AggregationMethod.SUM):
        if weights is not None and chosen is AggregationMethod.MEAN:
            raise InvalidInputError("mean is unweighted; use weighted-mean or fedavg")
        weights = [1.0] * len(chunks) if weights is None else weights
    names = list(peers) if peers is not None else [f"#{i}" for i in range(len(chunks))]
    values = parse_weights(weights, step=step, peers=names)
    factors = [1.0] * len(chunks) if scales is None else list(scales)
    try:
        return _finish_terms(chunks, values, factors, chosen, dtype)
    except NotFiniteError:
        check_peer_chunks(chunks, step=step, peers=peers, tensor=tensor)  # names the peer
        raise _not_finite(chunks, 0, peers) from None
    except InvalidInputError as exc:  # the result does not fit its dtype
        context = where(step=step, tensor=tensor)
        raise InvalidInputError(f"{context}: {exc}" if context else str(exc)) from None


def finish_peers(
    chunks: Sequence[np.ndarray],
    *,
    method: AggregationMethod | str = AggregationMethod.FEDAVG,
    weights: Sequence[float] | None = None,
    scales: Sequence[float] | None = None,
    dtype: np.dtype | str | None = None,
    names: Sequence[str] | None = None,
) -> np.ndarray:
    """``finish(partial_of(chunks, ...))`` of all ``n`` peers, without the float64 partial.

    The same bits, with ``shift=weight_shift(weights)``; the weights are used
    as given (default 1), whatever the method. ``names`` name the peers in errors.
    """
    chosen = AggregationMethod(method)
    if not chosen.reducible:
        raise InvalidInputError(f"{chosen.value!r} is not a reducible method")
    _check_group(chunks, 0)
    values = parse_weights([1.0] * len(chunks) if weights is None else weights)
    factors = [1.0] * len(chunks) if scales is None else list(scales)
    try:
        return _finish_terms(chunks, values, factors, chosen, dtype)
    except NotFiniteError:
        raise _not_finite(chunks, 0, names) from None


def _finish_terms(
    chunks: Sequence[np.ndarray],
    weights: Sequence[float],
    scales: Sequence[float],
    method: AggregationMethod,
    dtype: np.dtype | str | None,
) -> np.ndarray:
    # Every peer's terms and the whole fold in cache-sized blocks: no float64 array of the chunk.
    shift = weight_shift(weights)
    program = Program(_peer_items(chunks, 0, weights, scales, shift))
    out = np.empty(chunks[0].shape, dtype=chunks[0].dtype if dtype is None else np.dtype(dtype))
    program.finish(
        out.reshape(-1),
        divisor=program.weight if method.divides else None,
        exponent=0 if method.divides else -shift,
    )
    return out
