"""One analysis over the selected steps of a run: memo lookup, graph, stored results, index.

Every analysis runs the same way: each step's key is computed from its inputs
before anything is read; steps already recorded under their key are read back
from the store; the others are computed by one Dask graph (whose tasks return
:class:`~gradpipe.analytics.norms.StepFigures`); the client stores their
results and records them in the run's index with one compare-and-swap, under
the writer's lease it held throughout. A read-only store computes and returns
without writing anything. A step that fails is reported and leaves the others.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from gradpipe.analytics.memo import (
    Planned,
    ResultSpec,
    commit_analyses,
    find_memoised,
    read_results,
    store_results,
)
from gradpipe.analytics.selection import StepSources, entry_name
from gradpipe.analytics.step_figures import StepFailure, StepFigures
from gradpipe.core.analysis_manifest import analysis_key
from gradpipe.core.display import printable
from gradpipe.core.run_entries import AnalysisEntry
from gradpipe.errors import NotFoundError
from gradpipe.graph.runner import Runner, use_runner

if TYPE_CHECKING:
    from gradpipe.storage.store import Store

__all__ = ["PassOutcome", "StepResult", "run_pass"]

#: Builds the graph of the steps to compute: ``(graph, keys)``, each key a list of
#: :class:`StepFigures` or :class:`StepFailure`.
GraphBuilder = Callable[
    ["Store", Sequence[StepSources]], tuple[dict[Hashable, Any], list[Hashable]]
]


@dataclass
class StepResult:
    """One step's result: its arrays by name, their labels, its figures, where it is stored."""

    step: int
    labels: list[str]
    tensors: list[str]
    arrays: dict[str, np.ndarray]
    #: The stored result's id (None on a read-only store).
    analysis_id: str | None
    memoised: bool


@dataclass
class PassOutcome:
    """What one analysis pass did."""

    analysis: str
    results: list[StepResult] = field(default_factory=list)
    failures: list[StepFailure] = field(default_factory=list)
    chunks_read: int = 0
    #: Why nothing was recorded though results were computed (a read-only store), or "".
    not_recorded: str = ""

    @property
    def computed(self) -> list[int]:
        return [r.step for r in self.results if not r.memoised]

    @property
    def memoised(self) -> list[int]:
        return [r.step for r in self.results if r.memoised]

    def attrs(self) -> dict[str, Any]:
        """What every analysis' Dataset says of its pass (``ds.attrs``)."""
        return {
            "chunks_read": self.chunks_read,
            "computed_steps": len(self.computed),
            "memoised_steps": len(self.memoised),
            "failed": [f"step {f.step}: {f.reason}" for f in self.failures],
            "not_recorded": self.not_recorded,
        }

    def require_results(self, run: str) -> None:
        """Raise NotFoundError, with the first reasons, where no step could be analysed."""
        if not self.results:
            reasons = "; ".join(f"step {f.step}: {f.reason}" for f in self.failures[:3])
            raise NotFoundError(f"no step of run {printable(run)} could be analysed: {reasons}")


def run_pass(
    store: Store,
    run: str,
    sources: Sequence[StepSources],
    *,
    analysis: str,
    version: int,
    params: Mapping[str, Any],
    aggregate: str | None,
    build: GraphBuilder,
    runner: Runner | None = None,
) -> PassOutcome:
    """Run one analysis over ``sources``' steps, reusing what the store records."""
    name = entry_name(analysis, aggregate)
    specs = {
        s.step: ResultSpec(
            run,
            s.step,
            name,
            analysis,
            version,
            dict(params),
            s.inputs,
            analysis_key(analysis, version, params, s.inputs),
        )
        for s in sources
    }
    outcome = PassOutcome(analysis)
    hits = find_memoised(store, run, [Planned(s.step, name, s.key) for s in specs.values()])
    outcome.results.extend(_read_results(store, run, list(hits.values())))
    misses = [s for s in sources if (s.step, name) not in hits]
    if not misses:
        return outcome
    graph, keys = build(store, misses)
    with use_runner(runner) as active:
        if store.writable:
            with store.writing(f"analyze run {run}") as lease:
                computed = _compute(active, graph, keys, analysis)
                ids = _record(store, run, specs, computed, lease.key if lease else None)
        else:
            computed = _compute(active, graph, keys, analysis)
            ids = {}
            outcome.not_recorded = "the store is open read-only: results were not recorded"
    for figures in computed:
        if isinstance(figures, StepFailure):
            outcome.failures.append(figures)
            continue
        outcome.chunks_read += figures.chunks_read
        outcome.results.append(
            StepResult(
                figures.step,
                figures.labels,
                figures.tensors,
                figures.arrays,
                ids.get(figures.step),
                memoised=False,
            )
        )
    outcome.results.sort(key=lambda r: r.step)
    return outcome


def _record(
    store: Store,
    run: str,
    specs: Mapping[int, ResultSpec],
    computed: Sequence[StepFigures | StepFailure],
    lease: str | None,
) -> dict[int, str]:
    """Store each computed step's result and record them all in the index: step → id."""
    done = [f for f in computed if isinstance(f, StepFigures)]
    entries = store_results(store, [(specs[f.step], f.arrays, _coords(f)) for f in done])
    if entries:
        name = entries[0].name
        message = f"analyze {name} of {len(entries)} steps"
        commit_analyses(store, run, entries, lease=lease, message=message)
    return {e.step: e.analysis for e in entries}


def _compute(
    active: Runner, graph: dict[Hashable, Any], keys: list[Hashable], analysis: str
) -> list[StepFigures | StepFailure]:
    parts = active.get(graph, keys, name=f"gradpipe-{analysis}")
    return [item for part in parts for item in part]


def _coords(figures: StepFigures) -> dict[str, Any]:
    return {"labels": list(figures.labels), "tensors": list(figures.tensors)}


def _read_results(store: Store, run: str, entries: list[AnalysisEntry]) -> list[StepResult]:
    return [
        StepResult(
            manifest.step,
            list(manifest.coords["labels"]),
            list(manifest.coords["tensors"]),
            arrays,
            analysis_id,
            memoised=True,
        )
        for analysis_id, manifest, arrays in read_results(store, run, entries)
    ]
