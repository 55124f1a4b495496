"""The Rust prototype's training utilities, numpy in and numpy out.

- :class:`GradientAccumulator`: the mean of gradients accumulated over batches.
- :class:`LossScaler`: dynamic loss scaling for mixed precision, the Rust prototype's
  schedule (start at 2^16, halve on overflow, double after 2000 clean steps).
- :func:`to_bf16` / :func:`from_bf16` / :func:`to_fp16`: conversions that
  round to nearest even. The Rust prototype truncated to bfloat16; measured on
  ``gradpipe.testing`` gradients (``python benchmarks/bench_rounding.py``),
  truncation's mean relative error is twice rounding's and biased toward zero
  (the training page of the documentation has the table).
- :func:`has_nan_or_inf` and :func:`safe_clip`.
- :class:`GradientCompressor`: the Rust prototype's random projection plus ternary
  quantisation, on :mod:`gradpipe.codecs.ops.projection` (the same math as the
  ``projection-R`` codec). It does not reconstruct gradients; see that module.

Errors are :class:`~gradpipe.errors.InvalidInputError` (the Rust prototype's
``InvalidRatio``, ``DimensionMismatch`` and ``SeedMismatch``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Final

import numpy as np
import numpy.typing as npt

from gradpipe.codecs.ops.half_precision import bf16_bits, from_bf16_bits
from gradpipe.codecs.ops.half_precision import to_fp16 as _to_fp16
from gradpipe.codecs.ops.projection import (
    project,
    quantize_ternary,
    segment_layout,
    transpose_project,
)
from gradpipe.codecs.ops.sparsify import parse_fraction
from gradpipe.errors import InvalidInputError

__all__ = [
    "CompressedGradient",
    "GradientAccumulator",
    "GradientCompressor",
    "LossScaler",
    "TernaryCompressedGradient",
    "TrainingConfig",
    "from_bf16",
    "has_nan_or_inf",
    "safe_clip",
    "to_bf16",
    "to_fp16",
]

#: Values per projected segment of :class:`GradientCompressor` (see core.projection).
SEGMENT: Final = 4096


# --- mixed precision ------------------------------------------------------------------
def to_bf16(values: npt.ArrayLike) -> np.ndarray:
    """bfloat16 bit patterns (uint16) of float32/float64 values, rounded to nearest even.

    The Rust prototype kept the top 16 bits (truncation toward zero); see the module docstring.

    >>> to_bf16(np.float32([3.14159])).tolist(), from_bf16(to_bf16(np.float32([3.14159])))
    ([16457], array([3.140625], dtype=float32))
    """
    return bf16_bits(values)


def from_bf16(bits: npt.ArrayLike) -> np.ndarray:
    """float32 values of bfloat16 bit patterns (exact)."""
    return from_bf16_bits(bits)


def to_fp16(values: npt.ArrayLike) -> tuple[np.ndarray, int]:
    """float16 values (nearest even) and how many finite values overflowed to infinity."""
    return _to_fp16(values)


def has_nan_or_inf(values: npt.ArrayLike) -> bool:
    """Whether any value is NaN or infinite (integers never are).

    >>> has_nan_or_inf(np.float32([1.0, np.inf])), has_nan_or_inf(np.arange(3))
    (True, False)
    """
    array = np.asarray(values)
    if array.dtype.kind not in "fc" and array.dtype.name != "bfloat16":
        return False
    return not bool(np.isfinite(array).all())


def safe_clip(values: npt.ArrayLike, low: float, high: float) -> np.ndarray:
    """Values clamped to ``[low, high]``, NaNs replaced by 0 (a new array, same dtype).

    Infinities clamp to the bounds, as the Rust prototype's ``f32::clamp`` does.

    >>> safe_clip(np.float32([np.nan, -np.inf, 0.5, 7.0]), -1.0, 1.0).tolist()
    [0.0, -1.0, 0.5, 1.0]
    """
    if not low <= high:  # also refuses NaN bounds
        raise InvalidInputError(f"safe_clip needs low <= high, not {low!r} and {high!r}")
    array = np.asarray(values)
    out: np.ndarray = np.clip(np.nan_to_num(array, nan=0.0, posinf=high, neginf=low), low, high)
    return out.astype(array.dtype, copy=False)


class LossScaler:
    """Dynamic loss scaling: halve the scale on overflow, double it after a clean interval.

    The Rust prototype's schedule: start at 2^16; :meth:`update` with ``overflow=True``
    multiplies the scale by ``backoff_factor`` and restarts the count; each
    clean step counts, and after ``growth_interval`` of them in a row the
    scale is multiplied by ``growth_factor`` and the count restarts.

    >>> scaler = LossScaler(growth_interval=2)
    >>> for overflow in [True, False, False, False]:
    ...     scaler.update(overflow)
    >>> scaler.scale
    65536.0
    """

    def __init__(
        self,
        initial_scale: float = 65536.0,
        *,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
    ) -> None:
        if not (math.isfinite(initial_scale) and initial_scale > 0):
            raise InvalidInputError(f"loss scale must be positive, not {initial_scale!r}")
        if not growth_factor > 1 or not 0 < backoff_factor < 1:
            raise InvalidInputError(
                "growth factor must be > 1 and backoff factor in (0, 1), not "
                f"{growth_factor!r} and {backoff_factor!r}"
            )
        if isinstance(growth_interval, bool) or growth_interval < 1:
            raise InvalidInputError(f"growth interval must be >= 1, not {growth_interval!r}")
        self.scale = float(initial_scale)
        self.growth_factor = growth_factor
        self.backoff_factor = backoff_factor
        self.growth_interval = growth_interval
        self.steps_since_growth = 0

    def scale_loss(self, loss: float) -> float:
        """The loss times the scale, for the backward pass."""
        return loss * self.scale

    def unscale(self, gradients: npt.ArrayLike) -> np.ndarray:
        """Gradients divided by the scale (a new array, same dtype)."""
        array = np.asarray(gradients)
        out: np.ndarray = (array * (1.0 / self.scale)).astype(array.dtype, copy=False)
        return out

    @staticmethod
    def check_overflow(gradients: npt.ArrayLike) -> bool:
        """Whether the gradients hold a NaN or an infinity."""
        return has_nan_or_inf(gradients)

    def update(self, overflow: bool) -> None:
        """Advance the schedule by one step."""
        if overflow:
            self.scale *= self.backoff_factor
            self.steps_since_growth = 0
            return
        self.steps_since_growth += 1
        if self.steps_since_growth >= self.growth_interval:
            self.scale *= self.growth_factor
            self.steps_since_growth = 0


class GradientAccumulator:
    """The mean of gradients accumulated over batches.

    Sums in float64 and rounds once to the gradients' dtype when read, where
    the Rust prototype summed in float32 (rounding at every batch).

    >>> acc = GradientAccumulator(2)
    >>> acc.accumulate(np.float32([1.0, 2.0]))
    >>> acc.accumulate(np.float32([2.0, 4.0]))
    >>> acc.get_and_reset().tolist(), acc.count
    ([1.5, 3.0], 0)
    """

    def __init__(self, size: int) -> None:
        if isinstance(size, bool) or not isinstance(size, int) or size < 0:
            raise InvalidInputError(f"accumulator size must be an integer >= 0, not {size!r}")
        self._sum = np.zeros(size)
        self._dtype: np.dtype = np.dtype(np.float32)
        self.count = 0

    @property
    def size(self) -> int:
        """Number of values per gradient."""
        return self._sum.size

    def accumulate(self, gradients: npt.ArrayLike) -> None:
        """Add one batch's gradients (any shape with ``size`` values)."""
        array = np.asarray(gradients)
        if array.size != self._sum.size:
            raise InvalidInputError(
                f"gradient has {array.size} values, the accumulator {self._sum.size}: "
                "dimension mismatch"
            )
        self._sum += array.reshape(-1)
        self._dtype = array.dtype
        self.count += 1

    def get_and_reset(self) -> np.ndarray:
        """The mean of the accumulated gradients; the accumulator starts again.

        With nothing accumulated, zeros (the Rust prototype's behaviour).
        """
        mean = self._sum / self.count if self.count else self._sum.copy()
        self._sum[:] = 0
        self.count = 0
        return mean.astype(self._dtype)


# --- compression ------------------------------------------------------------------------
@dataclass(frozen=True)
class TrainingConfig:
    """The prototype's configuration: default ratio, projection seed, optional norm clipping."""

    default_compression_ratio: float = 0.1
    seed: int = 42
    gradient_clipping: float | None = None


@dataclass(frozen=True)
class CompressedGradient:
    """A projected gradient: the sketch ``A·x`` (float32), its dimension, seed and ratio."""

    data: np.ndarray
    original_dim: int
    seed: int
    ratio: float


@dataclass(frozen=True)
class TernaryCompressedGradient:
    """A projected gradient quantised to ternary codes (int8) and one scale."""

    data: np.ndarray
    scale: float
    original_dim: int
    compressed_dim: int
    seed: int
    ratio: float

    def compression_ratio(self) -> float:
        """The prototype's figure: 32 bits per original value over 2 bits per code plus a scale.

        >>> c = GradientCompressor().compress_ternary(np.ones(1000, dtype="float32"), 0.1)
        >>> round(c.compression_ratio(), 2)
        137.93
        """
        return self.original_dim * 32 / (self.compressed_dim * 2 + 32)


class GradientCompressor:
    """The Rust prototype's gradient compressor: sparse random projection, optionally ternary.

    Each segment of up to 4096 values is projected to ``max(⌈L·ratio⌉, 64)``
    values (the Rust prototype projected the whole vector at once, at ``n²·ratio`` cost);
    for gradients of up to 4096 values the sizes are the Rust prototype's exactly.
    :meth:`decompress` returns the transpose estimate, not the gradient.
    """

    def __init__(self, config: TrainingConfig | None = None) -> None:
        self.config = config or TrainingConfig()

    def _ratio(self, ratio: float | None) -> float:
        value = self.config.default_compression_ratio if ratio is None else ratio
        return parse_fraction(value, what="compression ratio")

    def _prepare(self, gradients: npt.ArrayLike) -> np.ndarray:
        x = np.asarray(gradients, dtype=np.float64).reshape(-1)
        clip = self.config.gradient_clipping
        if clip is not None:
            norm = float(np.linalg.norm(x))
            if norm > clip:
                x = x * (clip / norm)
        return x

    def compress(self, gradients: npt.ArrayLike, ratio: float | None = None) -> CompressedGradient:
        """The sketch of ``gradients`` at ``ratio`` (default: the config's)."""
        r = self._ratio(ratio)
        x = self._prepare(gradients)
        sketch = project(x, r, seed=self.config.seed, segment=SEGMENT)
        data = sketch.reshape(-1).astype(np.float32)
        return CompressedGradient(data, x.size, self.config.seed, r)

    def _check_seed(self, seed: int) -> None:
        if seed != self.config.seed:
            raise InvalidInputError(
                f"seed mismatch: compression used {seed}, decompression uses "
                f"{self.config.seed}; decompress with the compressor's seed"
            )

    def decompress(self, compressed: CompressedGradient) -> np.ndarray:
        """The transpose estimate ``Aᵀ·(A·x)`` (float32): unbiased, not a reconstruction."""
        self._check_seed(compressed.seed)
        x = _transpose(compressed.data, compressed.original_dim, compressed.ratio, compressed.seed)
        return x.astype(np.float32)

    def compress_ternary(
        self, gradients: npt.ArrayLike, ratio: float | None = None
    ) -> TernaryCompressedGradient:
        """The sketch quantised to ternary codes with the Rust prototype's mean-magnitude scale."""
        compressed = self.compress(gradients, ratio)
        t, scale = quantize_ternary(compressed.data)
        return TernaryCompressedGradient(
            t, scale, compressed.original_dim, t.size, compressed.seed, compressed.ratio
        )

    def decompress_ternary(self, compressed: TernaryCompressedGradient) -> np.ndarray:
        """The transpose estimate from ternary codes (float32)."""
        self._check_seed(compressed.seed)
        x = transpose_project(
            compressed.data,
            compressed.scale,
            compressed.original_dim,
            compressed.ratio,
            seed=compressed.seed,
            segment=SEGMENT,
        )
        return x.astype(np.float32)


def _transpose(sketch: np.ndarray, size: int, ratio: float, seed: int) -> np.ndarray:
    """``Aᵀ·y`` for a float sketch ``y`` (BLAS is fine here: nothing is hashed)."""
    from gradpipe.codecs.ops.projection import projection_matrix

    length, k, m = segment_layout(size, ratio, SEGMENT)
    s = projection_matrix(k, length, seed).astype(np.float64)
    out: np.ndarray = (np.asarray(sketch, dtype=np.float64).reshape(m, k) @ s).reshape(-1)
    return out[:size] * math.sqrt(3 / k)
