"""L2 clipping, DP-FedAvg noise and adaptive clipping, in pieces a graph runs per chunk.

Clipping a peer's update needs its L2 norm over every chunk of every tensor:
each chunk gives :func:`sq_norm_partial` (an :class:`~gradpipe.aggregation.exact.ExactSum`,
summed exactly by a tree of any shape), :func:`clip_scale` turns the total into
the factor ``min(1, C / norm)`` (the Rust prototype's ``clip_gradient_norm``), and the
factor enters the peer's leaf as ``partial(chunk, scale=...)``. Clipping the
aggregate is the same over the aggregate's chunks, then :func:`apply_scale`.

DP-FedAvg with fixed clipping (McMahan et al. 2018, "Learning Differentially
Private Recurrent Language Models", the fixed-denominator estimator with equal
weights): the unweighted mean of the clipped updates plus Gaussian noise of
standard deviation ``z·C/n`` per coordinate (:func:`dp_noise_std`; the same as
Flower's ``compute_stdv``). Equal weights, because the sensitivity of the mean
to one peer is then ``C/n``; a weighted mean would need ``max w·C/Σw``.

The noise (:func:`gaussian_noise`) is addressed by element: a numpy
``Generator(Philox)`` keyed by the recorded seed and the tensor name, one
counter per fixed block of 65536 flat elements, so every chunk grid draws the
same value for the same element, and a chunk never needs the others' draws.

Adaptive clipping (Andrew et al. 2021, "Differentially Private Learning with
Adaptive Clipping", Algorithm 1): :func:`update_clip_norm` moves ``C`` toward
the ``γ`` quantile of the update norms, ``C ← C·exp(-η·(b̄ - γ))`` with
``b̄`` the (noised) fraction of updates whose norm is ``<= C``. The paper's
defaults: ``η = 0.2``, ``γ = 0.5``, count noise ``σ_b = n/20``; the noise
multiplier of the updates becomes ``(z⁻² - (2σ_b)⁻²)^(-1/2)``
(:func:`adaptive_noise_multiplier`) so the round's privacy cost stays ``z``.
(Flower's server-side ``DifferentialPrivacyServerSideAdaptiveClipping``
counts the *clipped* updates with the same sign of the step; gradpipe follows
the paper's unclipped count.)
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence

import numpy as np

from gradpipe.aggregation.exact import ExactSum
from gradpipe.aggregation.result_range import round_result
from gradpipe.core.display import printable
from gradpipe.errors import InvalidInputError

__all__ = [
    "NOISE_BLOCK",
    "adaptive_noise_multiplier",
    "apply_scale",
    "clip_scale",
    "dp_noise_std",
    "gaussian_noise",
    "sq_norm_partial",
    "update_clip_norm",
]

#: Flat elements per noise block: one Philox counter value each.
NOISE_BLOCK = 65536


def sq_norm_partial(chunk: np.ndarray) -> ExactSum:
    """This chunk's share of a squared L2 norm (float64 within the chunk, exact across chunks)."""
    values = np.asarray(chunk, dtype=np.float64).reshape(-1)
    return ExactSum.of(np.array(np.square(values).sum()))


def clip_scale(sq_norm: ExactSum | float, clip_norm: float) -> float:
    """``min(1, C / norm)`` from the squared norm (1.0 for a zero update).

    >>> clip_scale(25.0, 1.0)
    0.2
    """
    if not math.isfinite(clip_norm) or clip_norm <= 0:
        raise InvalidInputError(f"clip norm {printable(clip_norm)} must be a finite number > 0")
    total = float(sq_norm.to_array()) if isinstance(sq_norm, ExactSum) else float(sq_norm)
    if not math.isfinite(total) or total < 0:
        raise InvalidInputError(f"a squared norm must be finite and >= 0, got {printable(total)}")
    norm = math.sqrt(total)
    return 1.0 if norm <= clip_norm else clip_norm / norm


def apply_scale(
    chunk: np.ndarray, scale: float, *, dtype: np.dtype | str | None = None
) -> np.ndarray:
    """``chunk * scale`` in float64, rounded once (clipping a stored aggregate).

    A result beyond ``dtype``'s range is refused
    (:func:`~gradpipe.aggregation.result_range.round_result`).
    """
    return round_result(np.asarray(chunk, dtype=np.float64) * scale, dtype or chunk.dtype)


def dp_noise_std(noise_multiplier: float, clip_norm: float, peers: int) -> float:
    """DP-FedAvg's noise standard deviation on the mean: ``z·C/n``."""
    if not noise_multiplier >= 0 or not clip_norm > 0 or peers < 1:
        raise InvalidInputError(
            f"DP noise needs z >= 0, C > 0 and n >= 1; got z={printable(noise_multiplier)}, "
            f"C={printable(clip_norm)}, n={printable(peers)}"
        )
    return noise_multiplier * clip_norm / peers


def _key(seed: int, tensor: str) -> int:
    digest = hashlib.blake2b(f"{seed}\x00{tensor}".encode(), digest_size=16).digest()
    return int.from_bytes(digest, "little")


def gaussian_noise(seed: int, *, tensor: str, offset: int, count: int, std: float) -> np.ndarray:
    """``N(0, std²)`` float64 noise for the flat elements ``[offset, offset + count)`` of a tensor.

    The same element gets the same value whatever the chunk that asks.

    >>> a = gaussian_noise(7, tensor="w", offset=0, count=10, std=1.0)
    >>> b = gaussian_noise(7, tensor="w", offset=4, count=6, std=1.0)
    >>> bool((a[4:] == b).all())
    True
    """
    if offset < 0 or count < 0:
        raise InvalidInputError(f"noise for elements [{offset}, {offset + count}) is out of range")
    if not math.isfinite(std) or std < 0:
        raise InvalidInputError(
            f"noise standard deviation {printable(std)} must be finite and >= 0"
        )
    key = _key(seed, tensor)
    out = np.empty(count, dtype=np.float64)
    first, last = offset // NOISE_BLOCK, (offset + count - 1) // NOISE_BLOCK
    for block in range(first, last + 1) if count else ():
        # the block index in the counter's high words: blocks never share a counter value
        rng = np.random.Generator(np.random.Philox(key=key, counter=block << 128))
        values = rng.standard_normal(NOISE_BLOCK)
        start = block * NOISE_BLOCK
        lo, hi = max(offset, start), min(offset + count, start + NOISE_BLOCK)
        out[lo - offset : hi - offset] = values[lo - start : hi - start]
    return out * std


def update_clip_norm(
    clip_norm: float,
    norms: Sequence[float],
    *,
    target_quantile: float = 0.5,
    lr: float = 0.2,
    count_stddev: float = 0.0,
    rng: np.random.Generator | None = None,
) -> float:
    """One round of Andrew et al.'s geometric update of the clip norm.

    ``norms`` are the round's update norms (before clipping); ``count_stddev``
    is ``σ_b``, the noise on the count of unclipped updates (needs ``rng``, a
    generator from the recorded seed).
    """
    if not clip_norm > 0 or not 0.0 <= target_quantile <= 1.0 or not lr > 0:
        raise InvalidInputError(
            f"adaptive clipping needs C > 0, 0 <= γ <= 1 and η > 0; got C={printable(clip_norm)}, "
            f"γ={printable(target_quantile)}, η={printable(lr)}"
        )
    if not norms:
        raise InvalidInputError("adaptive clipping: no update norms (empty peer set)")
    unclipped = float(sum(1 for v in norms if v <= clip_norm))
    if count_stddev > 0:
        if rng is None:
            raise InvalidInputError("a noised count needs rng (a seeded numpy Generator)")
        unclipped += float(rng.normal(0.0, count_stddev))
    fraction = unclipped / len(norms)
    return clip_norm * math.exp(-lr * (fraction - target_quantile))


def adaptive_noise_multiplier(noise_multiplier: float, count_stddev: float) -> float:
    """The updates' noise multiplier ``(z⁻² - (2σ_b)⁻²)^(-1/2)`` under adaptive clipping."""
    if noise_multiplier == 0:
        return 0.0
    if not count_stddev > 0 or noise_multiplier >= 2 * count_stddev:
        raise InvalidInputError(
            f"adaptive clipping: z={printable(noise_multiplier)} needs a count noise σ_b > z/2, "
            f"got σ_b={printable(count_stddev)}"
        )
    return float((noise_multiplier**-2 - (2 * count_stddev) ** -2) ** -0.5)
