"""PowerSGD's rank-R approximation of a matrix (Vogels et al., 2019).

One step of subspace iteration from a seeded random start: ``P = M·Q``,
``P`` orthonormalised, ``Q = Mᵀ·P``; the approximation is ``P·Qᵀ``, that is
``P·Pᵀ·M``, the orthogonal projection of ``M``'s columns onto ``span(P)``.
So, deterministically, ``‖M − P·Qᵀ‖_F ≤ ‖M‖_F`` (a projection never adds
energy); how close it comes to the best rank-R error (the tail of the singular
values) depends on the spectrum, and more ``iterations`` bring it closer
(Halko, Martinsson and Tropp, 2011). PowerSGD proper warm-starts ``Q`` from
the previous step's and adds error feedback; both are properties of a
training loop, so an evaluator simulates them across steps, not this function.

Tensors of other shapes are viewed as PowerSGD does: an N-d tensor as a matrix
of its first dimension by the product of the others. Vectors (biases) are not
approximated: PowerSGD sends them uncompressed, and the codec stores them exactly.
"""

from __future__ import annotations

import numpy as np

from gradpipe.errors import InvalidInputError

__all__ = ["low_rank_factors", "low_rank_product", "parse_rank", "worth_factoring"]


def parse_rank(value: object) -> int:
    """A rank, an integer >= 1."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InvalidInputError(f"PowerSGD rank must be an integer >= 1, not {value!r}")
    return value


def worth_factoring(rows: int, cols: int, rank: int) -> bool:
    """Whether rank-``rank`` factors of a ``rows × cols`` matrix are smaller than it.

    >>> worth_factoring(768, 3072, 4), worth_factoring(1, 4096, 1), worth_factoring(8, 8, 4)
    (True, False, False)
    """
    r = min(rank, rows, cols)
    return rows > 1 and cols > 1 and r * (rows + cols) < rows * cols


def low_rank_factors(
    matrix: np.ndarray, rank: int, *, seed: int = 0, iterations: int = 1
) -> tuple[np.ndarray, np.ndarray]:
    """Float32 factors ``P`` (rows × r, orthonormal columns) and ``Q`` (cols × r).

    ``Q`` is computed from the float32-rounded ``P``, so that ``P·Qᵀ`` stays a
    projection of ``M`` up to the rounding of ``Q``.

    >>> m = np.outer([1.0, 2.0, 3.0], [1.0, -1.0, 0.5, 2.0])
    >>> p, q = low_rank_factors(m, 1)
    >>> bool(np.allclose(low_rank_product(p, q), m, atol=1e-5))
    True
    """
    m = np.asarray(matrix, dtype=np.float64)
    if m.ndim != 2:
        raise InvalidInputError(f"a low-rank approximation needs a matrix, not shape {m.shape}")
    rows, cols = m.shape
    r = min(rank, rows, cols)
    q = np.random.default_rng(seed).standard_normal((cols, r))
    p = np.zeros((rows, r))
    for _ in range(max(1, iterations)):
        p, _ = np.linalg.qr(m @ q)
        q = m.T @ p
    p32 = p.astype(np.float32)
    q32 = (m.T @ p32.astype(np.float64)).astype(np.float32)
    return p32, q32


def low_rank_product(p: np.ndarray, q: np.ndarray) -> np.ndarray:
    """``P·Qᵀ`` in float64, summed rank by rank in a fixed order.

    Elementwise products and sums, not a BLAS call: a stored block's id is
    the hash of this result, so it must come out bit-identical on every
    machine, whatever its BLAS blocks or threads.
    """
    rows, r = p.shape
    out = np.zeros((rows, q.shape[0]))
    for j in range(r):
        out += p[:, j, None].astype(np.float64) * q[None, :, j].astype(np.float64)
    return out
