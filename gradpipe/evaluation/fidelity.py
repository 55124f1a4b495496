"""How close decoded values are to the originals, in float64, merged over many chunks.

:func:`measure_fidelity` reduces one chunk ``x`` and its decoded ``x̂`` to a
few float64 sums (:class:`Fidelity`); sums of several chunks add up, so the
figures of a sample are those of all its chunks laid end to end:

- ``rel_l2_error`` ``‖x̂ − x‖₂ / ‖x‖₂``, ``cosine`` ``⟨x, x̂⟩ / (‖x‖₂·‖x̂‖₂)`` and
  ``norm_ratio`` ``‖x̂‖₂ / ‖x‖₂`` over the positions where both ``x`` and ``x̂``
  are finite (a value a codec turned into an infinity, float16's overflow, is
  counted in ``overflows`` and in ``max_abs_error`` instead, so one overflow
  does not erase what the other million values say);
- ``max_abs_error`` the largest ``|x̂ᵢ − xᵢ|``, infinity where only one of the
  two is non-finite, 0 where both are the same non-finite value
  (as :func:`gradpipe.core.lossy.measure_error`);
- ``sign_agreement`` the share of the finite non-zero ``xᵢ`` whose ``x̂ᵢ`` has
  the same sign (a value sparsified to zero disagrees);
- ``bit_exact`` whether every chunk decoded to its own bytes.

A figure with no meaning on the data (the cosine of two zero vectors) is None.

:func:`bound_usage` says how much of a codec's deterministic bound a chunk
used (1.0: all of it), and :func:`simulate_feedback` runs error feedback over
a sequence of gradients and measures what the accumulated updates kept.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, fields
from typing import Any

import numpy as np

from gradpipe.codecs.ops.sparsify import error_feedback
from gradpipe.core.encoding import encode_float
from gradpipe.core.lossy import ErrorBound, l2_norm
from gradpipe.errors import InvalidInputError

__all__ = ["Fidelity", "bound_usage", "measure_fidelity", "simulate_feedback"]


@dataclass(frozen=True, slots=True)
class Fidelity:
    """Float64 sums of a comparison of decoded values with originals (see the module)."""

    values: int = 0
    xx: float = 0.0  # Σ x²
    yy: float = 0.0  # Σ x̂²
    xy: float = 0.0  # Σ x·x̂
    ee: float = 0.0  # Σ (x̂ − x)²
    max_abs: float = 0.0
    signed: int = 0  # finite non-zero originals
    same_sign: int = 0
    overflows: int = 0  # finite originals decoded as infinities or NaN
    chunks: int = 0
    exact_chunks: int = 0
    worst_rel_l2: float = 0.0  # the largest rel_l2_error of one chunk

    @property
    def bit_exact(self) -> bool:
        """Every chunk decoded to exactly its own bytes."""
        return self.exact_chunks == self.chunks

    @property
    def rel_l2_error(self) -> float:
        """``‖x̂ − x‖₂ / ‖x‖₂`` (0 when nothing differs, infinity when only ``x`` is 0)."""
        return _rel(self.ee, self.xx)

    @property
    def cosine(self) -> float | None:
        """``⟨x, x̂⟩ / (‖x‖₂·‖x̂‖₂)``; None when either is the zero vector."""
        if self.xx == 0 or self.yy == 0:
            return None
        return max(-1.0, min(1.0, self.xy / (math.sqrt(self.xx) * math.sqrt(self.yy))))

    @property
    def norm_ratio(self) -> float | None:
        """``‖x̂‖₂ / ‖x‖₂``; None when ``x`` is the zero vector."""
        return math.sqrt(self.yy / self.xx) if self.xx else None

    @property
    def sign_agreement(self) -> float | None:
        """Share of the finite non-zero ``xᵢ`` whose ``x̂ᵢ`` has their sign; None if none."""
        return self.same_sign / self.signed if self.signed else None

    @classmethod
    def merge(cls, parts: Iterable[Fidelity]) -> Fidelity:
        """The figures of several comparisons taken together (summed in the order given)."""
        out = cls()
        for p in parts:
            out = cls(
                values=out.values + p.values,
                xx=out.xx + p.xx,
                yy=out.yy + p.yy,
                xy=out.xy + p.xy,
                ee=out.ee + p.ee,
                max_abs=max(out.max_abs, p.max_abs),
                signed=out.signed + p.signed,
                same_sign=out.same_sign + p.same_sign,
                overflows=out.overflows + p.overflows,
                chunks=out.chunks + p.chunks,
                exact_chunks=out.exact_chunks + p.exact_chunks,
                worst_rel_l2=max(out.worst_rel_l2, p.worst_rel_l2),
            )
        return out

    def figures(self) -> dict[str, Any]:
        """The derived figures, JSON-able (non-finite floats as strings)."""
        return {
            "bit_exact": self.bit_exact,
            "max_abs_error": encode_float(self.max_abs),
            "rel_l2_error": encode_float(self.rel_l2_error),
            "worst_rel_l2_error": encode_float(self.worst_rel_l2),
            "cosine": self.cosine,
            "norm_ratio": self.norm_ratio,
            "sign_agreement": self.sign_agreement,
            "overflows": self.overflows,
        }

    def to_dict(self) -> dict[str, Any]:
        """The sums themselves, JSON-able."""
        return {
            f.name: encode_float(v) if isinstance(v := getattr(self, f.name), float) else v
            for f in fields(self)
        }


def _rel(error_sumsq: float, original_sumsq: float) -> float:
    if error_sumsq == 0:
        return 0.0
    if original_sumsq == 0:
        return math.inf
    return math.sqrt(error_sumsq / original_sumsq)


def measure_fidelity(original: np.ndarray, decoded: np.ndarray) -> Fidelity:
    """The :class:`Fidelity` of one chunk: ``decoded`` against ``original``, in float64.

    Both are compared as flat arrays of the same size; ``bit_exact`` compares
    their bytes, so give both in the chunk's dtype.

    >>> f = measure_fidelity(np.array([3.0, -4.0]), np.array([3.0, 0.0]))
    >>> f.rel_l2_error, f.norm_ratio, f.sign_agreement
    (0.8, 0.6, 0.5)
    """
    a, b = np.asarray(original), np.asarray(decoded)
    if a.size != b.size:
        raise InvalidInputError(
            f"decoded values have {b.size} elements, the original {a.size}; "
            "a codec must give back as many values as it was given"
        )
    x = a.astype(np.float64).reshape(-1)
    y = b.astype(np.float64).reshape(-1)
    finite_x = np.isfinite(x)
    finite_y = np.isfinite(y)
    both = finite_x & finite_y
    xs, ys = x[both], y[both]
    diff = ys - xs
    with np.errstate(invalid="ignore", over="ignore"):
        gap = np.abs(y - x)
    same_nonfinite = ~finite_x & ((x == y) | (np.isnan(x) & np.isnan(y)))
    gap = np.where(same_nonfinite, 0.0, gap)
    gap = np.where(np.isnan(gap), math.inf, gap)
    signed = finite_x & (x != 0)
    xx = float(np.dot(xs, xs))
    ee = float(np.dot(diff, diff))
    exact = a.dtype == b.dtype and a.tobytes() == b.tobytes()
    return Fidelity(
        values=int(x.size),
        xx=xx,
        yy=float(np.dot(ys, ys)),
        xy=float(np.dot(xs, ys)),
        ee=ee,
        max_abs=float(gap.max()) if gap.size else 0.0,
        signed=int(np.count_nonzero(signed)),
        same_sign=int(np.count_nonzero(signed & (np.sign(y) == np.sign(x)))),
        overflows=int(np.count_nonzero(finite_x & ~finite_y)),
        chunks=1,
        exact_chunks=int(exact),
        worst_rel_l2=_rel(ee, xx),
    )


def bound_usage(bound: ErrorBound, original: np.ndarray, decoded: np.ndarray) -> float | None:
    """How much of ``bound``'s deterministic parts one chunk used: measured over allowed.

    The largest of ``|x̂ᵢ − xᵢ| / (relative·|xᵢ| + absolute)`` (finite values
    that did not overflow), ``‖x̂ − x‖₂ / (l2·‖x‖₂)`` and ``max|x̂ᵢ − xᵢ| /
    (linf·‖x‖₂ + absolute)``: at most 1 where :meth:`ErrorBound.holds` (up to its float64
    allowance), over 1 where it does not; like ``holds``, the L2 part is left
    out of a chunk with an overflow (counted apart). A bit-exact bound is used 0 or
    infinitely; a bound with no deterministic part (a sketch's, a variance)
    gives None.

    >>> bound = ErrorBound("half", relative=0.5)
    >>> bound_usage(bound, np.array([2.0, 4.0]), np.array([2.5, 4.0]))
    0.5
    """
    if bound.exact:
        a, b = np.asarray(original), np.asarray(decoded)
        return 0.0 if a.dtype == b.dtype and a.tobytes() == b.tobytes() else math.inf
    if not bound.reconstructs or (bound.relative, bound.l2, bound.linf) == (None, None, None):
        return None
    x = np.asarray(original).astype(np.float64).reshape(-1)
    y = np.asarray(decoded).astype(np.float64).reshape(-1)
    finite = np.isfinite(x)
    x, y = x[finite], y[finite]
    kept = np.isfinite(y)
    diff = np.abs(y[kept] - x[kept])
    used = [0.0]
    if bound.relative is not None and diff.size:
        allowed = bound.relative * np.abs(x[kept]) + bound.absolute
        with np.errstate(divide="ignore", invalid="ignore"):
            ratio = np.where(diff == 0, 0.0, diff / allowed)
        used.append(float(ratio.max()))
    norm = l2_norm(x)
    if bound.l2 is not None and kept.all():  # as ErrorBound.holds: overflows are counted apart
        used.append(_over(l2_norm(diff), bound.l2 * norm))
    if bound.linf is not None and diff.size:
        used.append(_over(float(diff.max()), bound.linf * norm + bound.absolute))
    return max(used)


def _over(measured: float, allowed: float) -> float:
    if measured == 0:
        return 0.0
    return measured / allowed if allowed > 0 else math.inf


def simulate_feedback(
    gradients: Sequence[np.ndarray], compress: Callable[[np.ndarray], np.ndarray]
) -> tuple[Fidelity, Fidelity]:
    """What a compressor keeps of a gradient summed over steps, with and without error feedback.

    Step ``t`` sends ``compress(g_t + e_{t−1})`` and carries the residual
    ``e_t = g_t + e_{t−1} − sent_t`` (:func:`gradpipe.codecs.ops.sparsify.error_feedback`),
    as GRACE's memory does. Returned: the :class:`Fidelity` of the sum of
    what was sent against the true sum ``Σ g_t``, with error feedback and
    without it (each step compressed alone), all in float64.

    Examples
    --------
    >>> half = lambda v: np.where(np.abs(v) >= np.abs(v).max(), v, 0.0)
    >>> fed, plain = simulate_feedback([np.array([3.0, 1.0]), np.array([0.5, 2.5])], half)
    >>> round(fed.rel_l2_error, 4), round(plain.rel_l2_error, 4)
    (0.101, 0.2259)
    """
    if not gradients:
        raise InvalidInputError("error feedback needs at least one step's gradient")
    shape = np.shape(gradients[0])
    true = np.zeros(shape, dtype=np.float64)
    fed = np.zeros(shape, dtype=np.float64)
    plain = np.zeros(shape, dtype=np.float64)
    residual: np.ndarray | None = None
    for gradient in gradients:
        g = np.asarray(gradient, dtype=np.float64)
        if g.shape != shape:
            raise InvalidInputError(
                f"error feedback over gradients of shapes {shape} and {g.shape}; "
                "every step must give the same chunk"
            )
        sent, residual = error_feedback(g, residual, compress)
        true += g
        fed += np.asarray(sent, dtype=np.float64)
        plain += np.asarray(compress(g), dtype=np.float64)
    return measure_fidelity(true, fed), measure_fidelity(true, plain)
