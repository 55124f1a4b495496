"""What one candidate's evaluation adds up to: the figures of its chunks, feedback, pairs."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Final

from gradpipe.core.encoding import encode_float
from gradpipe.core.lossy import ErrorBound
from gradpipe.evaluation.fidelity import Fidelity

if TYPE_CHECKING:
    from gradpipe.evaluation.tasks import ChunkOutcome, FeedbackOutcome, PairOutcome

__all__ = ["CodecResult"]

MIB: Final = 2**20


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
