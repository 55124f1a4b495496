"""What ``evaluate_codecs`` reports: one row per candidate codec, the sample it was measured on.

The table :meth:`EvaluationReport.summary` prints, one row per candidate:

- ``chunks``: sampled chunks the codec was evaluated on (the others it does
  not apply to are listed below the table),
- ``ratio``: their logical bytes over the bytes the codec wrote, all together;
  ``bits/val``: stored bits per value,
- ``enc``/``dec MiB/s``: logical MiB over the summed seconds of encoding and
  decoding each chunk (inside graph tasks, in parallel with each other),
- ``exact``: every chunk decoded to its own bytes,
- ``max abs``, ``rel L2``, ``cosine``, ``norm``, ``sign``: fidelity in float64
  over every evaluated chunk laid end to end (see
  :mod:`gradpipe.evaluation.fidelity`),
- ``bound``: the codec's stated bound, ``used`` the most of it any chunk
  used (measured over allowed) and ``held`` on how many chunks it held.

A random projection does not reconstruct the vector, so its fidelity columns
are empty: it is measured on what it keeps (norms and inner products) beside
the Johnson–Lindenstrauss bound, below the table; so is error feedback.
"""

from __future__ import annotations

import math
import textwrap
from dataclasses import dataclass, field
from typing import Any

from gradpipe.core.display import printable
from gradpipe.core.lossy import ErrorBound
from gradpipe.evaluation.result import CodecResult
from gradpipe.evaluation.sampling import Unit

__all__ = ["EvaluationReport", "describe_bound"]


def describe_bound(bound: ErrorBound) -> str:
    """A stated bound in a few characters: ``|e| ≤ 0.0039|x|``, ``‖e‖ ≤ 0.99‖x‖``, ``JL ε 0.34``."""
    if bound.exact:
        return "bit-exact"
    if not bound.reconstructs:
        return f"JL ε {bound.norm_epsilon:.3g}" if bound.norm_epsilon is not None else "none"
    parts = []
    if bound.relative is not None:
        parts.append(f"|e| ≤ {bound.relative:.2g}|x|")
    if bound.l2 is not None:
        parts.append(f"‖e‖ ≤ {bound.l2:.3g}‖x‖")
    if bound.linf is not None:
        parts.append(f"max|e| ≤ {bound.linf:.2g}‖x‖")
    if bound.variance is not None and not parts:
        parts.append(f"E‖e‖² ≤ {bound.variance:.2g}‖x‖²")
    return ", ".join(parts) or "none"


@dataclass
class EvaluationReport:
    """Candidate codecs measured on a seeded, stratified sample of a run's chunks."""

    run: str
    seed: int
    sample_size: int  # asked for
    feedback_steps: int
    units: list[Unit] = field(default_factory=list)
    results: list[CodecResult] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """True when every codec's deterministic bound held on every chunk it was evaluated on.

        A sketch's Johnson–Lindenstrauss bound is a probability (it may miss on
        a share δ of chunks) and is reported, not judged.
        """
        return all(r.bound_held for r in self.results if r.reconstructs)

    def result(self, name: str) -> CodecResult:
        """The result of the candidate ``name``."""
        for r in self.results:
            if r.name == name:
                return r
        raise KeyError(f"no codec {printable(name)} was evaluated ({', '.join(self.codecs)})")

    @property
    def codecs(self) -> list[str]:
        return [r.name for r in self.results]

    def to_dict(self) -> dict[str, Any]:
        """JSON-able form (what ``gradpipe evaluate --json`` prints)."""
        return {
            "ok": self.ok,
            "run": self.run,
            "seed": self.seed,
            "sample_size": self.sample_size,
            "feedback_steps": self.feedback_steps,
            "sample": [
                {"step": u.step, "peer": u.peer, "tensor": u.tensor, "chunk": u.chunk}
                for u in self.units
            ],
            "codecs": [r.to_dict() for r in self.results],
        }

    def summary(self) -> str:
        """The table, then what it cannot hold: sketches, error feedback, skips, overflows."""
        steps = sorted({u.step for u in self.units})
        peers = sorted({u.peer for u in self.units})
        tensors = sorted({u.tensor for u in self.units})
        lines = [
            f"run {printable(self.run)}: {len(self.units)} sampled chunks (seed {self.seed}) of "
            f"{len(tensors)} tensors, {len(steps)} steps, {len(peers)} peers",
            "",
            _HEADER,
        ]
        lines += [_row(r) for r in self.results]
        lines += self._notes()
        if not self.ok:
            broken = [r.name for r in self.results if r.reconstructs and not r.bound_held]
            lines.append(f"BOUND NOT HELD: {', '.join(broken)} (a codec broke its stated bound)")
        return "\n".join(lines)

    def _notes(self) -> list[str]:
        notes: list[str] = []
        for r in self.results:
            sketch = r.sketch_figures()
            if sketch is not None:
                notes.append(_sketch_note(r, sketch))
            feedback = r.feedback_figures()
            if feedback is not None and feedback["chains"]:
                notes.append(_feedback_note(r, feedback))
            if r.variance_measured is not None and r.bound.variance is not None:
                notes.append(
                    f"{r.name}: unbiased; mean ‖x̂−x‖²/‖x‖² over chunks "
                    f"{r.variance_measured:.3g} (stated E ≤ {r.bound.variance:.3g})"
                )
            fidelity = r.fidelity
            if fidelity is not None and fidelity.overflows:
                notes.append(
                    f"{r.name}: {fidelity.overflows} finite values overflowed to infinity "
                    "(left out of rel L2, cosine and norm; max abs is infinite)"
                )
            elif r.family == "fp16" and fidelity is not None:
                notes.append(f"{r.name}: no value overflowed float16's range (±65504)")
            for reason, count in r.skipped.items():
                notes.append(f"{r.name}: {count} chunk(s) left out: {reason}")
        wrapped = [textwrap.fill(n, width=100, subsequent_indent="    ") for n in notes]
        return ["", *wrapped] if wrapped else []


_HEADER = (
    f"{'codec':<16} {'chunks':>6} {'ratio':>7} {'bits/val':>8} {'enc MiB/s':>9} "
    f"{'dec MiB/s':>9} {'exact':>5} {'max abs':>8} {'rel L2':>8} {'cosine':>8} "
    f"{'norm':>6} {'sign':>6}  {'bound':<24} {'used':>5} {'held':>7}"
)


def _num(value: float | None, spec: str, width: int) -> str:
    if value is None:
        return f"{'—':>{width}}"
    if math.isinf(value):
        return f"{'inf':>{width}}"
    return f"{value:>{width}{spec}}"


def _speed(value: float | None) -> str:
    """MiB/s: whole numbers, but two digits below 10 (tiny chunks are mostly call overhead)."""
    return _num(value, ".2g" if value is not None and value < 10 else ".0f", 9)


def _row(r: CodecResult) -> str:
    f = r.fidelity
    exact = "—" if f is None else ("yes" if f.bit_exact else "no")
    norm = f.norm_ratio if f is not None else (r.sketch_figures() or {}).get("norm_ratio")
    return (
        f"{r.name:<16} {len(r.chunks):>6} {_num(r.ratio, '.3f', 7)} "
        f"{_num(r.bits_per_value, '.2f', 8)} {_speed(r.encode_mib_s)} "
        f"{_speed(r.decode_mib_s)} {exact:>5} "
        f"{_num(None if f is None else f.max_abs, '.2g', 8)} "
        f"{_num(None if f is None else f.rel_l2_error, '.2g', 8)} "
        f"{_num(None if f is None else f.cosine, '.5f', 8)} {_num(norm, '.3f', 6)} "
        f"{_num(None if f is None else f.sign_agreement, '.3f', 6)}  "
        f"{describe_bound(r.bound):<24} {_num(r.bound_used, '.2f', 5)} "
        f"{f'{r.bound_held_chunks}/{len(r.chunks)}':>7}"
    )


def _sketch_note(r: CodecResult, s: dict[str, Any]) -> str:
    epsilon = s["norm_epsilon_max"]
    inner = (
        f"; inner products of {s['pairs']} pairs (the chunk and the same chunk of another "
        f"peer or step): |estimate − ⟨a,b⟩|/(‖a‖‖b‖) max {_g(s['inner_error_max'])}, mean "
        f"{_g(s['inner_error_mean'])} (JL ε ≤ {_g(s['inner_epsilon_max'])} for the projection "
        "alone; its ternary codes add error outside that bound)"
        if s["pairs"]
        else ""
    )
    delta = s["norm_delta"] if s["norm_delta"] is not None else 0.05
    return (
        f"{r.name}: does not reconstruct the vector (decode is the transpose estimate Aᵀŷ, "
        "not x), so it has no fidelity columns; it keeps norms: stored ‖Ax‖/‖x‖ "
        f"{_g(s['norm_ratio'])} over the sample, |‖Ax‖²/‖x‖² − 1| max "
        f"{_g(s['norm_deviation_max'])} against JL ε ≤ {_g(epsilon)} (held on "
        f"{s['norm_held_chunks']}/{s['norm_chunks']} chunks, promised with probability "
        f"≥ {1 - delta:g} each){inner}"
    )


def _feedback_note(r: CodecResult, fb: dict[str, Any]) -> str:
    fed, plain = fb["with_feedback"], fb["without_feedback"]
    skipped = f", {fb['not_simulated']} with NaN/inf not simulated" if fb["not_simulated"] else ""
    return (
        f"{r.name}: error feedback over up to {fb['steps']} consecutive steps of "
        f"{fb['chains']} (peer, tensor, chunk) chains{skipped}: the accumulated updates "
        f"against the true accumulated gradient have rel L2 {_g(fed['rel_l2_error'])}, "
        f"cosine {_g(fed['cosine'])}, norm {_g(fed['norm_ratio'])} (without feedback: "
        f"rel L2 {_g(plain['rel_l2_error'])}, cosine {_g(plain['cosine'])}, norm "
        f"{_g(plain['norm_ratio'])})"
    )


def _g(value: Any) -> str:
    if value is None:
        return "—"
    if isinstance(value, str):  # "Infinity" from encode_float
        return "inf" if value == "Infinity" else value
    return f"{value:.3g}"
