"""The tasks of the codec-evaluation graph, and what one candidate's evaluation adds up to.

Each task takes the logical bytes of stored chunks (the results of the read
tasks of :mod:`gradpipe.graph.chains`, shared by every candidate) and returns a
few numbers, never an array:

- :func:`evaluate_chunk`: one candidate on one sampled chunk (sizes, times,
  :class:`~gradpipe.core.fidelity.Fidelity`, its bound checked; for a sketch,
  its stored norm checked against the Johnson–Lindenstrauss bound);
- :func:`evaluate_feedback`: error feedback over consecutive steps of one
  (peer, tensor, chunk);
- :func:`evaluate_pair`: a sketch's inner-product estimate of two chunks;
- :func:`summarise`: everything of one candidate, as a :class:`CodecResult`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Final

import numpy as np

from gradpipe.codecs.candidate import Candidate
from gradpipe.core.dtypes import parse_dtype
from gradpipe.core.encoding import encode_float
from gradpipe.core.fidelity import Fidelity, bound_usage, measure_fidelity, simulate_feedback
from gradpipe.core.lossy import ErrorBound
from gradpipe.core.projection import segment_layout

__all__ = [
    "ChunkOutcome",
    "CodecResult",
    "FeedbackOutcome",
    "PairOutcome",
    "SketchCheck",
    "evaluate_chunk",
    "evaluate_feedback",
    "evaluate_pair",
    "summarise",
]

MIB: Final = 2**20


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
    nonfinite = not bool(np.isfinite(x.astype(np.float64)).all()) if x.dtype.kind in "fV" else False
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
    from gradpipe.core.projection import jl_epsilon

    bound = codec.error_bound(size)
    _, k, segments = segment_layout(size, codec.ratio, codec.segment)
    return jl_epsilon(k, points=2 * segments, delta=bound.norm_delta or 0.05)


@dataclass(frozen=True)
class CodecResult:
    """What one candidate's evaluation adds up to (the sums; the report derives the figures)."""

    name: str
    family: str  # the (first) codec's family: "bf16", "topk"...
    lossy: bool
    reconstructs: bool
    bound: ErrorBound
    chunks: list[ChunkOutcome] = field(default_factory=list)
    feedback: list[FeedbackOutcome] = field(default_factory=list)
    pairs: list[PairOutcome] = field(default_factory=list)
    skipped: dict[str, int] = field(default_factory=dict)  # reason -> chunks left out

    @property
    def fidelity(self) -> Fidelity | None:
        """The fidelity of every evaluated chunk together (None for a sketch, or no chunk)."""
        if not self.reconstructs or not self.chunks:
            return None
        return Fidelity.merge(c.fidelity for c in self.chunks if c.fidelity is not None)

    @property
    def raw_bytes(self) -> int:
        return sum(c.raw_bytes for c in self.chunks)

    @property
    def encoded_bytes(self) -> int:
        return sum(c.encoded_bytes for c in self.chunks)

    @property
    def values(self) -> int:
        return sum(c.values for c in self.chunks)

    @property
    def ratio(self) -> float | None:
        """Logical bytes over stored bytes, all evaluated chunks together."""
        return self.raw_bytes / self.encoded_bytes if self.encoded_bytes else None

    @property
    def bits_per_value(self) -> float | None:
        return 8 * self.encoded_bytes / self.values if self.values else None

    @property
    def encode_mib_s(self) -> float | None:
        seconds = sum(c.encode_seconds for c in self.chunks)
        return self.raw_bytes / MIB / seconds if seconds > 0 else None

    @property
    def decode_mib_s(self) -> float | None:
        seconds = sum(c.decode_seconds for c in self.chunks)
        return self.raw_bytes / MIB / seconds if seconds > 0 else None

    @property
    def bound_held(self) -> bool:
        """Whether the stated bound held on every evaluated chunk."""
        return all(c.bound_held for c in self.chunks)

    @property
    def bound_held_chunks(self) -> int:
        return sum(c.bound_held for c in self.chunks)

    @property
    def bound_used(self) -> float | None:
        """The most of the bound any chunk used (measured over allowed; ≤ 1 where it held)."""
        used = [c.bound_used for c in self.chunks if c.bound_used is not None]
        return max(used) if used else None

    @property
    def variance_measured(self) -> float | None:
        """Mean over chunks of ``‖x̂ − x‖² / ‖x‖²``, beside a stated variance bound."""
        ratios = [
            c.fidelity.ee / c.fidelity.xx
            for c in self.chunks
            if c.fidelity is not None and c.fidelity.xx > 0
        ]
        return sum(ratios) / len(ratios) if ratios else None

    def feedback_figures(self) -> dict[str, Any] | None:
        """Accumulated updates with and without error feedback, every chain together."""
        done = [f for f in self.feedback if f.fed is not None and f.plain is not None]
        if not self.feedback:
            return None
        fed = Fidelity.merge(f.fed for f in done if f.fed is not None)
        plain = Fidelity.merge(f.plain for f in done if f.plain is not None)
        keys = ("rel_l2_error", "cosine", "norm_ratio", "sign_agreement")
        return {
            "chains": len(done),
            "not_simulated": len(self.feedback) - len(done),
            "steps": max((f.steps for f in done), default=0),
            "with_feedback": {k: v for k, v in fed.figures().items() if k in keys},
            "without_feedback": {k: v for k, v in plain.figures().items() if k in keys},
        }

    def sketch_figures(self) -> dict[str, Any] | None:
        """A sketch's norms and inner products beside the Johnson–Lindenstrauss bound."""
        checks = [c.sketch for c in self.chunks if c.sketch is not None]
        if self.reconstructs:
            return None
        original = sum(s.original_sq for s in checks)
        kept = sum(s.sketch_sq for s in checks)
        errors = [p.error for p in self.pairs]
        return {
            "norm_ratio": math.sqrt(kept / original) if original else None,
            "norm_deviation_max": encode_float(max((s.deviation for s in checks), default=0.0)),
            "norm_epsilon_max": encode_float(max((s.epsilon for s in checks), default=0.0)),
            "norm_delta": self.bound.norm_delta,
            "norm_held_chunks": sum(s.held for s in checks),
            "norm_chunks": len(checks),
            "pairs": len(self.pairs),
            "inner_error_max": encode_float(max(errors, default=0.0)),
            "inner_error_mean": sum(errors) / len(errors) if errors else None,
            "inner_epsilon_max": encode_float(max((p.epsilon for p in self.pairs), default=0.0)),
        }

    def to_dict(self) -> dict[str, Any]:
        """JSON-able figures (what ``gradpipe evaluate --json`` prints per codec)."""
        fidelity = self.fidelity
        out: dict[str, Any] = {
            "name": self.name,
            "family": self.family,
            "lossy": self.lossy,
            "reconstructs": self.reconstructs,
            "chunks": len(self.chunks),
            "skipped": dict(self.skipped),
            "values": self.values,
            "raw_bytes": self.raw_bytes,
            "encoded_bytes": self.encoded_bytes,
            "ratio": self.ratio,
            "bits_per_value": self.bits_per_value,
            "encode_mib_s": self.encode_mib_s,
            "decode_mib_s": self.decode_mib_s,
        }
        if fidelity is not None:
            out |= fidelity.figures()
        else:  # a sketch's, or no chunk's: nothing to say about reconstructed values
            out |= dict.fromkeys(Fidelity().figures())
        sketch = self.sketch_figures()
        if sketch is not None:
            out["norm_ratio"] = sketch["norm_ratio"]
            out["sketch"] = sketch
        out |= {
            "bound": self.bound.to_dict(),
            "bound_used": encode_float(self.bound_used),
            "bound_held": self.bound_held,
            "bound_held_chunks": self.bound_held_chunks,
            "variance_measured": self.variance_measured,
            "feedback": self.feedback_figures(),
            "per_chunk": [_chunk_dict(c) for c in self.chunks],
        }
        return out


def _chunk_dict(c: ChunkOutcome) -> dict[str, Any]:
    out: dict[str, Any] = {
        "index": c.index,
        "ratio": c.raw_bytes / c.encoded_bytes if c.encoded_bytes else None,
        "bound_held": c.bound_held,
        "bound_used": encode_float(c.bound_used),
    }
    if c.fidelity is not None:
        out["rel_l2_error"] = encode_float(c.fidelity.rel_l2_error)
        out["max_abs_error"] = encode_float(c.fidelity.max_abs)
    if c.sketch is not None:
        out["norm_deviation"] = encode_float(c.sketch.deviation)
        out["norm_epsilon"] = encode_float(c.sketch.epsilon)
    return out


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
