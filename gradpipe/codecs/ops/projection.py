"""The Rust prototype's sparse random projection and ternary quantisation, done so it keeps norms.

The projection is Achlioptas' (2003): ``A = sqrt(3/k)·S`` with ``S`` of
entries ``+1`` and ``−1`` with probability 1/6 each and 0 otherwise (the Rust prototype
drew 0.16, 0.16 and 0.68 but scaled by ``1/sqrt(n)``, so its sketch of a
vector had about ``sqrt(0.32·k/n)`` of its norm: 0.18 of it at ratio 0.1).
With this scale ``E‖Ax‖² = ‖x‖²`` and ``E[AᵀA] = I``, and Achlioptas'
theorem gives the Johnson–Lindenstrauss tail of a Gaussian projection:
for a fixed ``x``, ``P(|‖Ax‖² − ‖x‖²| > ε‖x‖²) ≤ 2·exp(−k(ε²/2 − ε³/3)/2)``
(:func:`jl_epsilon` inverts it).

A chunk of ``n`` values is cut into segments of ``L`` values (the last one
zero-padded), each projected with the same ``k × L`` matrix, ``k =
max(⌈L·ratio⌉, 64)`` (the Rust prototype's rule): the work is ``n·k`` instead of
``n²·ratio``, and the matrix, generated from the seed by a counter-based hash
(the same on every machine and numpy version), is ``k·L`` bytes. If every
segment's norm is kept within ``1 ± ε`` so is the chunk's (a sum of terms each
within the factor), so the bound for a chunk is the union bound over its
segments: ``points = ⌈n/L⌉``.

A random projection does not reconstruct the vector. ``Aᵀ·Ax`` is an
unbiased but very noisy estimate of ``x`` (relative L2 error about
``sqrt(L/k)``, 3.2 at ratio 0.1); what the sketch keeps are norms and inner
products. The ternary step (the Rust prototype's: scale = mean ``|y|``, ``t = ±1`` beyond
half the scale) then keeps mostly the signs of the sketch.
"""

from __future__ import annotations

import math
from functools import lru_cache
from typing import Final

import numpy as np

from gradpipe.errors import InvalidInputError

__all__ = [
    "MIN_SKETCH_DIM",
    "jl_epsilon",
    "jl_min_dim",
    "project",
    "projection_matrix",
    "quantize_ternary",
    "segment_layout",
    "transpose_project",
]

#: The Rust prototype's smallest sketch, whatever the ratio.
MIN_SKETCH_DIM: Final = 64

_GOLDEN: Final = np.uint64(0x9E3779B97F4A7C15)
_MIX1: Final = np.uint64(0xBF58476D1CE4E5B9)
_MIX2: Final = np.uint64(0x94D049BB133111EB)


def segment_layout(size: int, ratio: float, segment: int) -> tuple[int, int, int]:
    """``(L, k, m)``: segment length, sketch size per segment and number of segments.

    >>> segment_layout(1000, 0.1, 4096), segment_layout(10_000, 0.1, 4096)
    ((1000, 100, 1), (4096, 410, 3))
    """
    length = max(1, min(segment, size))
    k = max(math.ceil(length * ratio - 1e-9 * length), MIN_SKETCH_DIM)
    return length, k, -(-size // length)


def _splitmix64(counter: np.ndarray, seed: int) -> np.ndarray:
    """SplitMix64 of ``seed·φ + counter``: uniform 64-bit words, reproducible anywhere."""
    with np.errstate(over="ignore"):
        z = counter + np.uint64(seed % 2**64) * _GOLDEN
        z = (z ^ (z >> np.uint64(30))) * _MIX1
        z = (z ^ (z >> np.uint64(27))) * _MIX2
        return z ^ (z >> np.uint64(31))


@lru_cache(maxsize=8)
def projection_matrix(k: int, length: int, seed: int) -> np.ndarray:
    """The ternary ``S`` (int8, ``k × length``) of the projection ``A = sqrt(3/k)·S``.

    Entries are ``+1``/``−1`` with probability 1/6 each, from the top 53 bits of
    a SplitMix64 stream; cached, and read-only.
    """
    words = _splitmix64(np.arange(k * length, dtype=np.uint64), seed) >> np.uint64(11)
    sixth = np.uint64(2**53 // 6)
    s = np.where(words < sixth, 1, np.where(words < 2 * sixth, -1, 0)).astype(np.int8)
    s = s.reshape(k, length)
    s.flags.writeable = False
    return s


def project(values: np.ndarray, ratio: float, *, seed: int, segment: int) -> np.ndarray:
    """The sketch ``A·x`` of each segment, float64, shape ``(m, k)``."""
    x = np.asarray(values, dtype=np.float64).reshape(-1)
    length, k, m = segment_layout(x.size, ratio, segment)
    padded = np.zeros(m * length)
    padded[: x.size] = x
    s = projection_matrix(k, length, seed).astype(np.float64)
    sketch: np.ndarray = padded.reshape(m, length) @ s.T
    sketch *= math.sqrt(3 / k)
    return sketch


def transpose_project(
    ternary: np.ndarray, scale: float, size: int, ratio: float, *, seed: int, segment: int
) -> np.ndarray:
    """``Aᵀ·(scale·t)`` for ternary sketches ``t`` (``m × k``): the estimate decode returns.

    ``t·S`` is a product of small integers, exact in float32 whatever order a
    BLAS sums it in, and then scaled once: the result is bit-identical on
    every machine (a stored block's id is its hash).
    """
    length, k, m = segment_layout(size, ratio, segment)
    t = np.asarray(ternary).reshape(m, k).astype(np.float32)
    s = projection_matrix(k, length, seed).astype(np.float32)
    counts = (t @ s).reshape(-1)[:size].astype(np.float64)
    out: np.ndarray = counts * (scale * math.sqrt(3 / k))
    return out


def quantize_ternary(values: np.ndarray) -> tuple[np.ndarray, float]:
    """The prototype's ternary quantisation: ``t ∈ {−1, 0, 1}`` (int8) and scale = mean ``|v|``.

    ``tᵢ = sign(vᵢ)`` where ``|vᵢ| > scale/2``; a scale of 1e-10 or less becomes 1.

    >>> t, scale = quantize_ternary(np.array([0.9, -0.1, -2.0, 0.2]))
    >>> t.tolist(), scale
    ([1, 0, -1, 0], 0.8)
    """
    v = np.asarray(values, dtype=np.float64).reshape(-1)
    abs_mean = float(np.abs(v).mean()) if v.size else 0.0
    scale = abs_mean if abs_mean > 1e-10 else 1.0
    normalized = v / scale
    t = np.where(normalized > 0.5, 1, np.where(normalized < -0.5, -1, 0)).astype(np.int8)
    return t, scale


def jl_epsilon(k: int, *, points: int = 1, delta: float = 0.05) -> float:
    """The Johnson–Lindenstrauss distortion of a ``k``-dimensional Achlioptas sketch.

    With probability at least ``1 − delta``, each of ``points`` fixed vectors
    has ``|‖Ax‖² − ‖x‖²| ≤ ε·‖x‖²``, for the ``ε`` returned: the smallest
    with ``points·2·exp(−k(ε²/2 − ε³/3)/2) ≤ delta`` (Achlioptas 2003,
    Theorem 1.1, union bound over the points). Inner products follow by
    polarisation: keeping ``x/‖x‖ ± y/‖y‖`` too (two more points per pair)
    gives ``|⟨Ax, Ay⟩ − ⟨x, y⟩| ≤ ε·‖x‖·‖y‖``. Returns infinity when no
    ``ε ≤ 1`` is guaranteed (``k`` too small for ``points`` and ``delta``).

    >>> round(jl_epsilon(410, points=256), 3)
    0.342
    """
    if k < 1 or points < 1 or not 0 < delta < 1:
        raise InvalidInputError(
            f"jl_epsilon needs k >= 1, points >= 1 and 0 < delta < 1, not {k}, {points}, {delta}"
        )
    target = 2 * math.log(2 * points / delta) / k
    if target > 1 / 6:  # ε²/2 − ε³/3 peaks at 1/6, at ε = 1
        return math.inf
    lo, hi = 0.0, 1.0
    for _ in range(100):
        mid = (lo + hi) / 2
        if mid * mid / 2 - mid**3 / 3 < target:
            lo = mid
        else:
            hi = mid
    return hi


def jl_min_dim(epsilon: float, *, points: int = 1, delta: float = 0.05) -> int:
    """The smallest sketch size for which :func:`jl_epsilon` is at most ``epsilon`` (0 < ε < 1).

    >>> jl_min_dim(0.1, points=1000)
    4542
    """
    if not 0 < epsilon < 1:
        raise InvalidInputError(f"epsilon must be in (0, 1), not {epsilon!r}")
    return math.ceil(2 * math.log(2 * points / delta) / (epsilon**2 / 2 - epsilon**3 / 3))
