"""The tasks of the codec-evaluation graph (what they add up to, per candidate, is
:class:`~gradpipe.evaluation.result.CodecResult`).

Each task takes the logical bytes of stored chunks (the results of the read
tasks of :mod:`gradpipe.graph.chains`, shared by every candidate) and returns a
few numbers, never an array:

- :func:`evaluate_chunk`: one candidate on one sampled chunk (sizes, times,
  :class:`~gradpipe.evaluation.fidelity.Fidelity`, its bound checked; for a sketch,
  its stored norm checked against the Johnson–Lindenstrauss bound);
- :func:`evaluate_feedback`: error feedback over consecutive steps of one
  (peer, tensor, chunk);
- :func:`evaluate_pair`: a sketch's inner-product estimate of two chunks;
- :func:`summarise`: everything of one candidate, as a
  :class:`~gradpipe.evaluation.result.CodecResult`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from gradpipe.codecs.candidate import Candidate
from gradpipe.codecs.ops.projection import jl_epsilon, segment_layout
from gradpipe.core.dtypes import parse_dtype
from gradpipe.core.lossy import ErrorBound
from gradpipe.evaluation.fidelity import Fidelity, bound_usage, measure_fidelity, simulate_feedback
from gradpipe.evaluation.result import CodecResult

__all__ = [
    "ChunkOutcome",
    "FeedbackOutcome",
    "PairOutcome",
    "SketchCheck",
    "evaluate_chunk",
    "evaluate_feedback",
    "evaluate_pair",
    "summarise",
]


def _values(data: np.ndarray | None, dtype: str, count: int) -> np.ndarray:
    """A chunk's values from its logical bytes (None: an all-zero chunk)."""
    typed = parse_dtype(dtype)
    if data is None:
        return np.zeros(count, dtype=typed)
    return np.asarray(data).view(typed)


@dataclass(frozen=True, slots=True)
class SketchCheck:
    """A sketch's stored norm against the chunk's: ``|‖Ax‖² / ‖x‖² − 1|`` beside its ε."""

    original_sq: float
    sketch_sq: float
    epsilon: float

    @property
    def deviation(self) -> float:
        if self.original_sq == 0:
            return 0.0 if self.sketch_sq == 0 else math.inf
        return abs(self.sketch_sq / self.original_sq - 1)

    @property
    def held(self) -> bool:
        return self.deviation <= self.epsilon


@dataclass(frozen=True, slots=True)
class ChunkOutcome:
    """One candidate on one sampled chunk."""

    index: int  # position in the sample
    values: int
    raw_bytes: int
    encoded_bytes: int
    encode_seconds: float
    decode_seconds: float
    fidelity: Fidelity | None  # None for a sketch (it does not reconstruct)
    bound_held: bool  # the deterministic bound (a sketch: the JL norm bound)
    bound_used: float | None
    sketch: SketchCheck | None = None
    nonfinite: bool = False  # the chunk held NaN or infinities


def evaluate_chunk(
    candidate: Candidate,
    data: np.ndarray | None,
    dtype: str,
    shape: tuple[int, ...],
    count: int,
    index: int,
) -> ChunkOutcome:
    """Encode and decode one chunk with ``candidate`` and measure what came back, in float64."""
    x = _values(data, dtype, count)
    coded = candidate.code(x, shape)
    bound = candidate.bound(dtype, x.size)
    nonfinite = not np.isfinite(x.astype(np.float64)).all()
    fidelity = None
    sketch = None
    if bound.reconstructs:
        fidelity = measure_fidelity(x, coded.decoded)
        held = bound.holds(x, coded.decoded)
        used = bound_usage(bound, x, coded.decoded)
    else:
        sketch = None if nonfinite else _sketch_check(coded.head, coded.frame, x, bound)
        held = sketch is None or sketch.held
        used = None if sketch is None else _ratio(sketch.deviation, sketch.epsilon)
    return ChunkOutcome(
        index=index,
        values=x.size,
        raw_bytes=x.nbytes,
        encoded_bytes=coded.encoded_bytes,
        encode_seconds=coded.encode_seconds,
        decode_seconds=coded.decode_seconds,
        fidelity=fidelity,
        bound_held=held,
        bound_used=used,
        sketch=sketch,
        nonfinite=nonfinite,
    )


def _ratio(measured: float, allowed: float) -> float:
    if measured == 0:
        return 0.0
    return measured / allowed if allowed > 0 else math.inf


def _sketch_check(
    codec: object, frame: bytes, x: np.ndarray, bound: ErrorBound
) -> SketchCheck | None:
    norm = getattr(codec, "norm", None)
    if norm is None or bound.norm_epsilon is None:
        return None
    xs = x.astype(np.float64)
    return SketchCheck(float(np.dot(xs, xs)), float(norm(frame)) ** 2, bound.norm_epsilon)


@dataclass(frozen=True, slots=True)
class FeedbackOutcome:
    """Error feedback over ``steps`` consecutive steps of one chunk, and without it."""

    index: int
    steps: int
    fed: Fidelity | None  # None: a step held NaN or infinities (not simulated)
    plain: Fidelity | None


def evaluate_feedback(
    candidate: Candidate,
    data: list[np.ndarray | None],
    dtype: str,
    shape: tuple[int, ...],
    count: int,
    index: int,
) -> FeedbackOutcome:
    """Run ``candidate`` with error feedback over the chunk's steps (oldest first)."""
    typed = parse_dtype(dtype)
    steps = [_values(d, dtype, count) for d in data]
    if any(not np.isfinite(s.astype(np.float64)).all() for s in steps):
        return FeedbackOutcome(index, len(steps), None, None)

    def compress(v: np.ndarray) -> np.ndarray:
        # The corrected gradient is float64; the codec takes the tensor's dtype, and
        # the rounding of that cast goes into the residual with the rest.
        decoded = candidate.code(v.astype(typed), shape).decoded
        return np.asarray(decoded, dtype=np.float64)

    fed, plain = simulate_feedback(steps, compress)
    return FeedbackOutcome(index, len(steps), fed, plain)


@dataclass(frozen=True, slots=True)
class PairOutcome:
    """A sketch's estimate of ``⟨a, b⟩`` for two chunks, beside the true value."""

    index: int
    inner: float
    estimate: float
    norms: float  # ‖a‖₂·‖b‖₂
    epsilon: float  # the JL bound on |⟨Aa, Ab⟩ − ⟨a, b⟩| / (‖a‖‖b‖) of the projection alone

    @property
    def error(self) -> float:
        """``|estimate − ⟨a, b⟩| / (‖a‖₂·‖b‖₂)``."""
        gap = abs(self.estimate - self.inner)
        if self.norms == 0:
            return 0.0 if gap == 0 else math.inf
        return gap / self.norms


def evaluate_pair(
    candidate: Candidate,
    first: np.ndarray | None,
    second: np.ndarray | None,
    dtype: str,
    count: int,
    index: int,
) -> PairOutcome | None:
    """The candidate's sketch estimate of the inner product of two equally long chunks."""
    a, b = _values(first, dtype, count), _values(second, dtype, count)
    xa, xb = a.astype(np.float64), b.astype(np.float64)
    if not (np.isfinite(xa).all() and np.isfinite(xb).all()):
        return None
    codec = candidate.chain(a, (a.size,))[0]
    inner = getattr(codec, "inner", None)
    if inner is None:
        return None
    estimate = float(inner(codec.encode(a), codec.encode(b)))
    epsilon = _inner_epsilon(codec, a.size)
    norms = math.sqrt(float(np.dot(xa, xa)) * float(np.dot(xb, xb)))
    return PairOutcome(index, float(np.dot(xa, xb)), estimate, norms, epsilon)


def _inner_epsilon(codec: Any, size: int) -> float:
    """ε of the projection's inner products: two points per segment (polarisation)."""
    bound = codec.error_bound(size)
    _, k, segments = segment_layout(size, codec.ratio, codec.segment)
    return jl_epsilon(k, points=2 * segments, delta=bound.norm_delta or 0.05)


def summarise(
    candidate: Candidate,
    bound: ErrorBound,
    skipped: dict[str, int],
    chunks: list[ChunkOutcome],
    feedback: list[FeedbackOutcome],
    pairs: list[PairOutcome | None],
) -> CodecResult:
    """One candidate's outcomes, in sample order."""
    return CodecResult(
        name=candidate.name,
        family=candidate.family,
        lossy=candidate.lossy,
        reconstructs=bound.reconstructs,
        bound=bound,
        chunks=sorted(chunks, key=lambda c: c.index),
        feedback=sorted(feedback, key=lambda f: f.index),
        pairs=sorted((p for p in pairs if p is not None), key=lambda p: p.index),
        skipped=dict(skipped),
    )
