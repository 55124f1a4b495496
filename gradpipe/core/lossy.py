"""What a lossy codec promises, what it did, and how a stored tensor records both.

Three value objects:

- :class:`ErrorBound`: the error a codec states for its decoded values
  ``x̂`` against its input ``x`` (every lossy codec's ``error_bound()``
  returns one). Deterministic parts (per value, L2, L∞) can be checked on
  data with :meth:`ErrorBound.holds`; statistical ones (unbiasedness, a
  variance bound, a Johnson–Lindenstrauss norm bound) are stated for an
  evaluator to put beside its measurements.
- :class:`ChunkError`: the measured error of one chunk, in float64, merged
  over a tensor's chunks.
- :class:`LossyInfo`: what a tensor manifest keeps of a lossy write: the
  codec, its bound, and the measured ``max_abs_error`` and ``rel_l2_error``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, fields
from typing import Any

import numpy as np

from gradpipe.core.encoding import decode_float, encode_float
from gradpipe.errors import InvalidInputError

__all__ = [
    "SQUARES_SAFE",
    "ChunkError",
    "ErrorBound",
    "LossyInfo",
    "l2_norm",
    "measure_error",
    "unit_roundoff",
]

#: Relative allowance for float64 summation when a bound on sums is checked.
_SUM_SLACK = 1e-12

#: An L2 norm below this came from squares that lost bits to underflow (values under 1e-154).
SQUARES_SAFE = 1e-150


def unit_roundoff(dtype: np.dtype) -> float:
    """Half the distance from 1 to the next value of a float dtype (2^-24 for float32).

    >>> unit_roundoff(np.dtype("float32")) == 2.0**-24
    True
    """
    return float(np.finfo(dtype).eps) / 2


def l2_norm(values: np.ndarray) -> float:
    """``‖x‖₂`` in float64; scaled by the largest value where the squares leave float64's range.

    >>> [l2_norm(np.array([3.0, 4.0]) * 2.0**e) == 5 * 2.0**e for e in (-600, 0, 600)]
    [True, True, True]
    """
    x = np.asarray(values, dtype=np.float64).reshape(-1)
    with np.errstate(over="ignore", under="ignore"):
        norm = math.sqrt(float(np.dot(x, x)))
        if SQUARES_SAFE <= norm < math.inf or not x.size:
            return norm
        peak = float(np.abs(x).max())
        if peak == 0 or not math.isfinite(peak):
            return peak
        unit = x / peak
        return float(np.float64(peak) * math.sqrt(float(np.dot(unit, unit))))


@dataclass(frozen=True, slots=True)
class ErrorBound:
    """What a codec promises about decoded values ``x̂`` against its input ``x``, per chunk.

    Every field left ``None`` (or False) promises nothing. Non-finite inputs
    are outside every bound; the codecs keep them where they were.

    Attributes
    ----------
    text : str
        The bound in words, for people.
    exact : bool
        ``x̂`` is ``x`` bit for bit.
    relative, absolute : float or None
        ``|x̂ᵢ − xᵢ| ≤ relative·|xᵢ| + absolute`` for every finite ``xᵢ`` whose
        rounded value does not overflow to infinity (``absolute`` covers
        subnormals).
    l2 : float or None
        ``‖x̂ − x‖₂ ≤ l2·‖x‖₂`` (finite ``x``).
    linf : float or None
        ``max |x̂ᵢ − xᵢ| ≤ linf·‖x‖₂ + absolute``.
    unbiased : bool
        ``E[x̂] = x`` over the codec's random draws.
    variance : float or None
        ``E‖x̂ − x‖₂² ≤ variance·‖x‖₂²``.
    reconstructs : bool
        False when decoding gives an estimate that is not meant to be ``x``
        (a random projection): only the ``norm_*`` fields then apply.
    norm_epsilon, norm_delta : float or None
        For sketches: with probability at least ``1 − norm_delta`` the
        sketch's squared norm is within ``(1 ± norm_epsilon)·‖x‖₂²``.
    """

    text: str
    exact: bool = False
    relative: float | None = None
    absolute: float = 0.0
    l2: float | None = None
    linf: float | None = None
    unbiased: bool = False
    variance: float | None = None
    reconstructs: bool = True
    norm_epsilon: float | None = None
    norm_delta: float | None = None

    @classmethod
    def lossless(cls) -> ErrorBound:
        """The bound of a bit-exact codec."""
        return cls("bit-exact", exact=True, relative=0.0, l2=0.0, linf=0.0, unbiased=True)

    def holds(self, original: np.ndarray, decoded: np.ndarray) -> bool:
        """Whether the deterministic parts of the bound hold for one chunk.

        Compared in float64 over the positions where ``original`` is finite
        and, for the per-value bound, where ``decoded`` did not overflow.
        Sums get a relative allowance of 1e-12 for float64 rounding.
        """
        x = np.asarray(original).astype(np.float64).reshape(-1)
        y = np.asarray(decoded).astype(np.float64).reshape(-1)
        if x.shape != y.shape:
            return False
        if self.exact:
            return np.asarray(original).tobytes() == np.asarray(decoded).tobytes()
        if not self.reconstructs:
            return True
        finite = np.isfinite(x)
        x, y = x[finite], y[finite]
        diff = np.abs(y - x)
        if self.relative is not None:
            kept = np.isfinite(y)
            if np.any(diff[kept] > self.relative * np.abs(x[kept]) + self.absolute):
                return False
        norm = l2_norm(x)
        if self.l2 is not None and np.all(np.isfinite(y)):
            error = l2_norm(y - x)
            if error > self.l2 * norm * (1 + _SUM_SLACK):
                return False
        return not (
            self.linf is not None
            and diff.size
            and float(diff.max()) > self.linf * norm * (1 + _SUM_SLACK) + self.absolute
        )

    def to_dict(self) -> dict[str, Any]:
        """JSON-able form (non-finite floats as strings)."""
        out: dict[str, Any] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            out[f.name] = encode_float(value) if isinstance(value, float) else value
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ErrorBound:
        """Inverse of :meth:`to_dict`."""
        kwargs: dict[str, Any] = {}
        for f in fields(cls):
            if f.name not in data:
                continue
            value = data[f.name]
            if f.name in ("text",):
                kwargs[f.name] = str(value)
            elif f.name in ("exact", "unbiased", "reconstructs"):
                kwargs[f.name] = bool(value)
            elif f.name == "absolute":
                kwargs[f.name] = decode_float(value) or 0.0
            else:
                kwargs[f.name] = decode_float(value)
        return cls(**kwargs)


@dataclass(frozen=True, slots=True)
class ChunkError:
    """Measured error of decoded values against the originals (merges over chunks).

    ``max_abs`` is the largest ``|x̂ᵢ − xᵢ|`` (0 where both are the same
    non-finite value, infinity where only one is non-finite); ``error_sumsq``
    and ``original_sumsq`` are float64 sums of squares over the positions where
    the original is finite; ``overflows`` counts finite originals decoded as
    infinities (float16's range).
    """

    max_abs: float = 0.0
    error_sumsq: float = 0.0
    original_sumsq: float = 0.0
    overflows: int = 0

    @property
    def rel_l2(self) -> float:
        """``‖x̂ − x‖₂ / ‖x‖₂`` (0 when both are 0, infinity when only ``x`` is)."""
        if self.error_sumsq == 0:
            return 0.0
        if self.original_sumsq == 0:
            return math.inf
        return math.sqrt(self.error_sumsq / self.original_sumsq)

    @classmethod
    def merge(cls, errors: Iterable[ChunkError]) -> ChunkError:
        """The error of a tensor from its chunks'."""
        max_abs, err, ref, over = 0.0, 0.0, 0.0, 0
        for e in errors:
            max_abs = max(max_abs, e.max_abs)
            err += e.error_sumsq
            ref += e.original_sumsq
            over += e.overflows
        return cls(max_abs, err, ref, over)


def measure_error(original: np.ndarray, decoded: np.ndarray) -> ChunkError:
    """The :class:`ChunkError` of ``decoded`` against ``original``, in float64.

    >>> e = measure_error(np.array([1.0, 2.0]), np.array([1.0, 2.5]))
    >>> e.max_abs, round(e.rel_l2, 4)
    (0.5, 0.2236)
    """
    x = np.asarray(original).astype(np.float64).reshape(-1)
    y = np.asarray(decoded).astype(np.float64).reshape(-1)
    if x.shape != y.shape:
        raise InvalidInputError(
            f"decoded values have {y.size} elements, the original {x.size}; "
            "a lossy codec must keep the size"
        )
    finite = np.isfinite(x)
    same_nonfinite = ~finite & ((x == y) | (np.isnan(x) & np.isnan(y)))
    with np.errstate(invalid="ignore", over="ignore"):
        diff = np.where(same_nonfinite, 0.0, np.abs(y - x))
    diff = np.where(np.isnan(diff), math.inf, diff)
    xf, yf = x[finite], y[finite]
    with np.errstate(invalid="ignore", over="ignore"):
        err = yf - xf
        error_sumsq = float(np.dot(err, err)) if err.size else 0.0
    if math.isnan(error_sumsq):
        error_sumsq = math.inf
    return ChunkError(
        max_abs=float(diff.max()) if diff.size else 0.0,
        error_sumsq=error_sumsq,
        original_sumsq=float(np.dot(xf, xf)) if xf.size else 0.0,
        overflows=int(np.count_nonzero(~np.isfinite(yf))),
    )


@dataclass(frozen=True, slots=True)
class LossyInfo:
    """How a tensor was stored lossily (kept in its manifest, format 4).

    ``codec`` is the numcodecs config of the lossy codec, ``name`` its
    registry name (``"bf16"``, ``"topk-0.1"``...), ``bound`` what the codec
    promises and ``max_abs_error`` / ``rel_l2_error`` what was measured on
    this tensor's values at write time (float64, non-finite values excluded
    from the L2 figure); ``overflows`` counts finite values stored as
    infinities.
    """

    codec: dict[str, Any]
    name: str
    bound: ErrorBound
    max_abs_error: float
    rel_l2_error: float
    overflows: int = 0

    @classmethod
    def of(
        cls, codec: dict[str, Any], name: str, bound: ErrorBound, error: ChunkError
    ) -> LossyInfo:
        """The record of a tensor written with ``codec`` whose chunks measured ``error``."""
        return cls(dict(codec), name, bound, error.max_abs, error.rel_l2, error.overflows)

    def to_dict(self) -> dict[str, Any]:
        """JSON-able form."""
        return {
            "codec": dict(self.codec),
            "name": self.name,
            "bound": self.bound.to_dict(),
            "max_abs_error": encode_float(self.max_abs_error),
            "rel_l2_error": encode_float(self.rel_l2_error),
            "overflows": self.overflows,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> LossyInfo:
        """Inverse of :meth:`to_dict`."""
        codec = data["codec"]
        if not isinstance(codec, dict) or not isinstance(codec.get("id"), str):
            raise TypeError("lossy codec config is not an object with an id")
        return cls(
            codec=dict(codec),
            name=str(data["name"]),
            bound=ErrorBound.from_dict(dict(data["bound"])),
            max_abs_error=decode_float(data["max_abs_error"]) or 0.0,
            rel_l2_error=decode_float(data["rel_l2_error"]) or 0.0,
            overflows=int(data.get("overflows", 0)),
        )
