r"""A block-sparse random sign projection that chunks add up to, whatever the grid.

:func:`sign_sketch` applies a ``k × d`` matrix ``P`` to a tensor's flat values,
one chunk at a time: the projection of the whole tensor is the sum of the
projections of any partition of its flat index range. ``P`` is a CountSketch
with ``s`` blocks (Kane and Nelson 2014, "Sparser Johnson–Lindenstrauss
Transforms", the block construction): the ``k`` rows are cut into ``s`` blocks of
``m = k/s`` rows, and element ``i`` (its global flat index) goes to one row
``r_j(i)`` of each block ``j`` with a sign ``σ_j(i)``::

    P[j·m + r_j(i), i] = σ_j(i) / √s

**Draws.** A numpy ``Generator(Philox)`` keyed by ``blake2b(seed, tensor)``
(personalised ``gradpipe.sketch``, so a sketch never reuses the stream of
another feature keyed by the same seed and name, such as the DP noise) gives
each run of :data:`SKETCH_BLOCK` flat elements its own counter range, as
:func:`gradpipe.aggregation.privacy.gaussian_noise` does. Element ``i`` takes
the ``⌈s/2⌉`` 64-bit words at its place in its run's stream; row block ``j``
reads 32 bits of them (word ``j // 2``, low half for even ``j``): the top bit is
the sign, the other 31 bits give the row by multiply-shift,
``r = ⌊u₃₁·m / 2³¹⌋``. Philox can start at any counter value, so a chunk draws
only its own elements' words, and any chunk draws what the whole tensor would
for the same elements.

**Bound.** For any ``x, y`` and every ``s`` (proof: the diagonal ``i = l`` of
``⟨Px, Py⟩ = (1/s)·Σ_j Σ_{i,l} σ_j(i)σ_j(l)·x_i·y_l·[r_j(i) = r_j(l)]`` is
exactly ``⟨x, y⟩``; an off-diagonal pair collides with probability ``1/m``,
only the pairs ``(i, l)`` and ``(l, i)`` are correlated, and the ``s`` blocks are
independent)::

    E⟨Px, Py⟩ = ⟨x, y⟩
    Var⟨Px, Py⟩ = (|x|²|y|² + ⟨x,y⟩² − 2·Σ_i x_i²y_i²) / k  ≤  2|x|²|y|²/k

the variance of a dense Rademacher projection. At ``k = 8192`` the standard
deviation is at most ``|x||y|/64 = 0.0156·|x||y|``, and Chebyshev gives
``P(|err| > ε|x||y|) ≤ 2/(kε²)``. The rows are exactly uniform when ``m`` is a
power of two; otherwise each row's probability is within ``2⁻³¹`` of ``1/m``,
which moves the variance by a relative ``m²·2⁻⁶²`` at most. The default
``s = 4`` has this variance but not a Johnson–Lindenstrauss tail for many
vectors at once; Kane and Nelson's tail needs ``s = Θ(ε⁻¹·log(1/δ))``.

**Rounding.** The result is float64. Identical ``(values, offset)`` give
identical bits; different chunkings of the same tensor agree to rounding
(their float64 sums are added in different orders).
"""

from __future__ import annotations

import hashlib
import math
import operator
from collections.abc import Iterator
from typing import Final

import numpy as np

from gradpipe.core.display import printable
from gradpipe.errors import InvalidInputError

__all__ = [
    "MAX_K",
    "MAX_S",
    "SKETCH_BLOCK",
    "dense_matrix",
    "parse_sketch_size",
    "sign_sketch",
    "sign_sketch_many",
]

#: Flat elements per counter range of the draws (as the DP noise's blocks).
SKETCH_BLOCK: Final = 65536
#: The largest sketch: 8 MiB of float64 per projected vector.
MAX_K: Final = 2**20
#: The most non-zeros per column; the draws cost ``⌈s/2⌉`` words per element.
MAX_S: Final = 64

# Elements drawn and accumulated at a time: the temporaries stay in the L2 cache.
_PIECE: Final = 8192
# Philox4x64 gives four 64-bit words per counter value.
_WORDS_PER_COUNTER: Final = 4
# Largest dense_matrix (float64 entries): 512 MiB.
_MAX_DENSE: Final = 2**26
_LOW31: Final = 0x7FFFFFFF


def parse_sketch_size(k: int, s: int) -> tuple[int, int]:
    """Validate a sketch's size: ``1 <= k <= MAX_K``, ``1 <= s <= MAX_S`` and ``s`` divides ``k``.

    >>> parse_sketch_size(8192, 4)
    (8192, 4)
    """
    k, s = _parse_int(k, "sketch size k"), _parse_int(s, "non-zeros per column s")
    if not 1 <= k <= MAX_K:
        raise InvalidInputError(f"sketch size k={k} must be between 1 and {MAX_K}")
    if not 1 <= s <= MAX_S or k % s:
        raise InvalidInputError(
            f"non-zeros per column s={s} must be between 1 and {MAX_S} and divide k={k}"
        )
    return k, s


def sign_sketch(
    values: np.ndarray,
    *,
    seed: int,
    tensor: str,
    offset: int,
    k: int,
    s: int = 4,
    out: np.ndarray | None = None,
) -> np.ndarray:
    """Project a chunk of a tensor: ``P[:, offset:offset + n] @ values.ravel()``.

    Parameters
    ----------
    values
        The chunk, of any shape; its C-order elements are the tensor's flat
        elements ``[offset, offset + values.size)``. Integers and floats,
        converted to float64.
    seed, tensor
        Key of the draws: the same pair gives the same ``P``.
    offset
        Global flat index of the chunk's first element.
    k, s
        Rows of ``P`` and non-zeros per column (:func:`parse_sketch_size`).
    out
        A float64 array of shape ``(k,)`` to add the projection into.

    Returns
    -------
    numpy.ndarray
        float64 of shape ``(k,)``: ``out`` when given.

    Examples
    --------
    >>> x = np.arange(10.0)
    >>> whole = sign_sketch(x, seed=1, tensor="w", offset=0, k=8)
    >>> parts = sign_sketch(x[:3], seed=1, tensor="w", offset=0, k=8)
    >>> parts = sign_sketch(x[3:], seed=1, tensor="w", offset=3, k=8, out=parts)
    >>> bool(np.allclose(whole, parts))
    True
    """
    k, s = parse_sketch_size(k, s)
    flat = np.asarray(values).reshape(1, -1)
    if out is not None:
        _check_out(out, (k,))
        sign_sketch_many(flat, seed=seed, tensor=tensor, offset=offset, k=k, s=s, out=out[None])
        return out
    sums = sign_sketch_many(flat, seed=seed, tensor=tensor, offset=offset, k=k, s=s)
    return sums.reshape(k)


def sign_sketch_many(
    values: np.ndarray,
    *,
    seed: int,
    tensor: str,
    offset: int,
    k: int,
    s: int = 4,
    out: np.ndarray | None = None,
) -> np.ndarray:
    """Project a chunk of ``n`` examples at once, sharing the draws (their cost) between them.

    ``values`` has a leading example axis: ``values[q]`` is example ``q``'s chunk,
    whose C-order elements are the flat elements ``[offset, offset + values[q].size)``.
    Returns float64 of shape ``(n, k)`` (``out`` when given, the projections
    added into it); row ``q`` is ``sign_sketch(values[q], ...)``, bit for bit.
    The other parameters are :func:`sign_sketch`'s.
    """
    k, s = parse_sketch_size(k, s)
    array = np.asarray(values)
    if array.ndim < 1 or array.dtype.kind not in "iuf":
        raise InvalidInputError(
            f"a sketch of tensor {printable(tensor)} needs integer or float values with an "
            f"example axis, got {array.dtype} of shape {array.shape}"
        )
    count = math.prod(array.shape[1:])
    examples = array.reshape(array.shape[0], count)
    offset = _parse_int(offset, "offset")
    if offset < 0 or offset + count >= 2**63:
        raise InvalidInputError(
            f"elements [{offset}, {offset + count}) of tensor {printable(tensor)} are out of range"
        )
    key = _key(seed, tensor)
    if out is not None:
        _check_out(out, (examples.shape[0], k))
    sums = np.zeros((examples.shape[0], k))
    # No examples, no draws: their cost is all there is.
    pieces = _draws(key, offset, count, k, s) if examples.size else iter(())
    for lo, hi, rows, flips in pieces:
        chunk = np.ascontiguousarray(examples[:, lo:hi], dtype=np.float64)
        flat_rows = rows.reshape(-1)
        for q, example in enumerate(chunk):
            # Flipping the float64 sign bit is the cheapest multiplication by ±1.
            signed = (example.view(np.uint64) ^ flips).view(np.float64)
            sums[q] += np.bincount(flat_rows, weights=signed.reshape(-1), minlength=k)
    # Scaled once per call: exact when s is a power of 4.
    sums *= 1.0 / math.sqrt(s)
    if out is None:
        return sums
    out += sums
    return out


def dense_matrix(d: int, *, seed: int, tensor: str, k: int, s: int = 4) -> np.ndarray:
    """The explicit ``k × d`` matrix ``P`` of a tensor of ``d`` elements, from the same draws.

    For tests and small models: ``dense_matrix(d, ...) @ x`` is
    ``sign_sketch(x, offset=0, ...)`` up to rounding.

    >>> p = dense_matrix(5, seed=1, tensor="w", k=8, s=2)
    >>> np.count_nonzero(p, axis=0).tolist()
    [2, 2, 2, 2, 2]
    """
    k, s = parse_sketch_size(k, s)
    d = _parse_int(d, "tensor size d")
    if d < 0 or k * d > _MAX_DENSE:
        raise InvalidInputError(
            f"a dense {k} x {d} sketch matrix must have d >= 0 and at most {_MAX_DENSE} entries"
        )
    matrix = np.zeros((k, d))
    scale = 1.0 / math.sqrt(s)
    for lo, hi, rows, flips in _draws(_key(seed, tensor), 0, d, k, s):
        columns = np.broadcast_to(np.arange(lo, hi), rows.shape)
        matrix[rows, columns] = np.where(flips != 0, -scale, scale)
    return matrix


def _draws(
    key: int, offset: int, count: int, k: int, s: int
) -> Iterator[tuple[int, int, np.ndarray, np.ndarray]]:
    """Rows and sign flips of the flat elements ``[offset, offset + count)``, piece by piece.

    Yields ``(lo, hi, rows, flips)`` for the elements ``offset + [lo, hi)``:
    ``rows`` (int64, ``(s, hi - lo)``) are global rows ``j·m + r_j(i)``; ``flips``
    (uint64, same shape) are ``σ_j(i) < 0`` in the float64 sign bit.
    """
    rows_per_block = k // s
    words = (s + 1) // 2
    # ⌊(u₃₁ + j·2³¹)·m / 2³¹⌋ = j·m + ⌊u₃₁·m / 2³¹⌋: the block's first row rides in the multiply.
    block_bits = (np.arange(s, dtype=np.uint64) << 31)[:, None]
    start, end = offset, offset + count
    while start < end:
        block, place = divmod(start, SKETCH_BLOCK)
        stop = min(end, start + _PIECE, (block + 1) * SKETCH_BLOCK)
        skip, drop = divmod(place * words, _WORDS_PER_COUNTER)
        # The block index in the counter's high words: blocks never share a counter value.
        bitgen = np.random.Philox(key=key, counter=(block << 128) + skip)
        raw = bitgen.random_raw(drop + (stop - start) * words)[drop:]
        # Little-endian halves: block 2t reads word t's low 32 bits, block 2t + 1 its high ones.
        halves = raw.astype("<u8", copy=False).view("<u4").reshape(stop - start, 2 * words)
        # Block-major, so that every broadcast below runs along the elements.
        bits = halves[:, :s].T.astype(np.uint64, order="C")
        rows = bits & _LOW31
        rows |= block_bits
        rows *= rows_per_block
        rows >>= 31
        bits >>= 31
        bits <<= 63
        yield start - offset, stop - offset, rows.view(np.int64), bits
        start = stop


def _key(seed: int, tensor: str) -> int:
    seed = _parse_int(seed, "seed")
    if not isinstance(tensor, str):
        raise InvalidInputError(f"a sketch's tensor name must be a string, got {printable(tensor)}")
    message = f"{seed}\x00{tensor}".encode("utf-8", "surrogatepass")
    digest = hashlib.blake2b(message, digest_size=16, person=b"gradpipe.sketch").digest()
    return int.from_bytes(digest, "little")


def _check_out(out: np.ndarray, shape: tuple[int, ...]) -> None:
    if (
        not isinstance(out, np.ndarray)
        or out.dtype != np.float64
        or out.shape != shape
        or not out.flags.writeable
    ):
        got = f"{out.dtype} {out.shape}" if isinstance(out, np.ndarray) else type(out).__name__
        raise InvalidInputError(f"out must be a writable float64 array of shape {shape}, got {got}")


def _parse_int(value: object, what: str) -> int:
    if isinstance(value, bool):
        raise InvalidInputError(f"{what} must be an integer, got {printable(value)}")
    try:
        return operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        raise InvalidInputError(f"{what} must be an integer, got {printable(value)}") from None
