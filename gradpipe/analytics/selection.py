"""What an analysis reads at each step: the step's dumps in peer order, or one aggregate.

Resolved from the run's manifest before anything is computed, so that every
step's memo key (:func:`~gradpipe.core.analysis_manifest.analysis_key`) is known
up front and memoised steps are never planned.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from gradpipe.core.analysis_manifest import AnalysisInput
from gradpipe.core.display import printable
from gradpipe.core.names import parse_name
from gradpipe.core.run_manifest import RunManifest
from gradpipe.errors import InvalidInputError, NotFoundError
from gradpipe.storage.catalog import read_run

if TYPE_CHECKING:
    from gradpipe.storage.store import Store

__all__ = ["StepSources", "entry_name", "parse_steps", "step_sources"]

#: Which steps to analyse: all of them (None), a range, or a list.
Steps = range | Sequence[int] | None


@dataclass(frozen=True)
class StepSources:
    """One step's sources: each peer's dump (or the one aggregate), in the run's peer order."""

    step: int
    inputs: tuple[AnalysisInput, ...]
    #: ``"dump"`` or ``"aggregate"``: what ``inputs`` name.
    kind: str

    @property
    def labels(self) -> list[str]:
        """Peers (or the aggregate's name), in order."""
        return [i.label for i in self.inputs]


def entry_name(analysis: str, aggregate: str | None) -> str:
    """The index entry's name: ``norms`` (the dumps) or ``norms:fedavg`` (an aggregate)."""
    return analysis if aggregate is None else f"{analysis}:{aggregate}"


def parse_steps(recorded: Sequence[int], steps: Steps, *, run: str) -> list[int]:
    """The recorded steps ``steps`` selects, ascending (a step not recorded is an error)."""
    if steps is None:
        return sorted(recorded)
    if isinstance(steps, int | str) or not isinstance(steps, range | Sequence):
        raise InvalidInputError(
            f"steps {printable(steps)} must be a range or a list of steps, e.g. range(0, 10)"
        )
    if not len(steps):
        raise InvalidInputError("steps selects no step; pass None for every step")
    present = set(recorded)
    if isinstance(steps, range):
        chosen = [s for s in steps if s in present]
        if not chosen:
            raise InvalidInputError(
                f"run {printable(run)} has nothing recorded in steps {steps.start}:{steps.stop} "
                f"(it has steps {_span(recorded)})"
            )
        return chosen
    out = set()
    for s in steps:
        if isinstance(s, bool) or not isinstance(s, int):
            raise InvalidInputError(f"step {printable(s)} is not an integer")
        if s not in present:
            raise InvalidInputError(
                f"run {printable(run)} has nothing recorded at step {s} "
                f"(it has steps {_span(recorded)})"
            )
        out.add(s)
    return sorted(out)


def _span(steps: Sequence[int]) -> str:
    ordered = sorted(steps)
    return f"{ordered[0]}..{ordered[-1]}" if ordered else "none"


def step_sources(
    store: Store, run: str, *, steps: Steps = None, aggregate: str | None = None
) -> tuple[RunManifest, list[StepSources]]:
    """The run's manifest and, per selected step, what an analysis of it reads."""
    _, manifest = read_run(store, run)
    if aggregate is None:
        by_step: dict[int, list[AnalysisInput]] = {}
        for d in manifest.dumps:
            by_step.setdefault(d.step, []).append(AnalysisInput(d.peer, d.dump))
        if not by_step:
            raise NotFoundError(f"run {printable(run)} has no dumps to analyse")
        chosen = parse_steps(list(by_step), steps, run=run)
        return manifest, [StepSources(s, tuple(by_step[s]), "dump") for s in chosen]
    parse_name(aggregate, what="aggregate name")
    found = {a.step: a.aggregate for a in manifest.aggregates if a.name == aggregate}
    if not found:
        known = ", ".join(sorted({a.name for a in manifest.aggregates})) or "none"
        raise NotFoundError(
            f"run {printable(run)} has no aggregate {printable(aggregate)} (aggregates: {known}); "
            "compute it with gradpipe aggregate"
        )
    chosen = parse_steps(list(found), steps, run=run)
    return manifest, [
        StepSources(s, (AnalysisInput(aggregate, found[s]),), "aggregate") for s in chosen
    ]
