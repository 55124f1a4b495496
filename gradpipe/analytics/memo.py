"""Where analyses live: stored results, the run's index, and the memo that reuses them.

A result is an :class:`~gradpipe.core.analysis_manifest.AnalysisManifest` with
its arrays embedded, named in the run's index (``analytics/<run>``) under
(step, name) with its memo key. Asking again with the same key reads the index
(and the shards on the keys' paths) and nothing else. Results are
deterministic, so two callers racing on one step write the same ids: the merge
at the swap is then a no-op, and no claim is needed. A different key under the
same (step, name) (a replaced dump, other parameters) replaces the entry.
"""

from __future__ import annotations

import platform
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from gradpipe._version import __version__
from gradpipe.core.analysis_manifest import AnalysisInput, AnalysisManifest
from gradpipe.core.analytics_index import AnalyticsIndex, record_analyses
from gradpipe.core.manifest import manifest_id
from gradpipe.core.run_entries import AnalysisEntry, EntryKey
from gradpipe.storage.catalog import analytics_ref, read_analytics, read_analytics_at, read_many
from gradpipe.storage.tensors import read_tensor, write_tensor

if TYPE_CHECKING:
    from gradpipe.storage.store import Store

__all__ = [
    "Planned",
    "ResultSpec",
    "commit_analyses",
    "find_memoised",
    "read_results",
    "store_result",
]


@dataclass(frozen=True, slots=True)
class Planned:
    """One (step, name) an analysis is asked for, under the key its inputs give."""

    step: int
    name: str
    key: str

    @property
    def sort_key(self) -> EntryKey:
        return (self.step, self.name)


def find_memoised(store: Store, run: str, planned: Sequence[Planned]) -> dict[EntryKey, str]:
    """The result ids already recorded under the same keys, by (step, name).

    Reads the run's index and the shards on the keys' paths, nothing else.
    """
    if not planned:
        return {}
    _, index = read_analytics(store, run)
    found = index.lookup(p.sort_key for p in planned)
    out = {}
    for p in planned:
        entry = found.get(p.sort_key)
        if entry is not None and entry.key == p.key:
            out[p.sort_key] = entry.analysis
    return out


@dataclass(frozen=True)
class ResultSpec:
    """Everything that defines one result but its arrays (see :class:`AnalysisManifest`)."""

    run: str
    step: int
    name: str
    analysis: str
    version: int
    params: Mapping[str, Any]
    inputs: tuple[AnalysisInput, ...]
    key: str
    extra: tuple[str, ...] = ()


def store_result(
    store: Store,
    spec: ResultSpec,
    arrays: Mapping[str, np.ndarray],
    *,
    coords: Mapping[str, Any] | None = None,
    figures: Mapping[str, Any] | None = None,
) -> AnalysisEntry:
    """Write the result arrays and their manifest; the entry that records them.

    Call under the writer's lease that later commits the entry.
    """
    tensors, embedded = [], {}
    for name, array in arrays.items():
        manifest = write_tensor(store, np.ascontiguousarray(array), where=f"result {name}")
        tensor_id = manifest_id(manifest)  # embedded, as a dump's tensors are
        tensors.append((name, tensor_id))
        embedded[tensor_id] = manifest
    result = AnalysisManifest(
        run=spec.run,
        step=spec.step,
        name=spec.name,
        analysis=spec.analysis,
        version=spec.version,
        params=dict(spec.params),
        inputs=spec.inputs,
        key=spec.key,
        tensors=tuple(tensors),
        extra=spec.extra,
        provenance=_provenance(),
        coords=dict(coords or {}),
        figures=dict(figures or {}),
        embedded=embedded,
    )
    return AnalysisEntry(spec.step, spec.name, store.put_manifest(result), spec.key)


def _provenance() -> dict[str, str]:
    return {"gradpipe": __version__, "numpy": np.__version__, "python": platform.python_version()}


def read_results(
    store: Store, ids: Sequence[str]
) -> list[tuple[str, AnalysisManifest, dict[str, np.ndarray]]]:
    """Stored results with their arrays by name (manifests in batched reads)."""
    out = []
    manifests = read_many(store, ids, AnalysisManifest, context="analysis")
    for analysis_id, manifest in zip(ids, manifests, strict=True):
        arrays = {
            name: read_tensor(store, manifest.embedded[tensor_id], context=f"result {name}")
            for name, tensor_id in manifest.tensors
        }
        out.append((analysis_id, manifest, arrays))
    return out


class _NothingNewError(Exception):
    """Every entry is recorded already: the index is left as it is."""


def commit_analyses(
    store: Store,
    run: str,
    entries: Iterable[AnalysisEntry],
    *,
    lease: str | None = None,
    message: str = "analyze",
) -> str | None:
    """Record ``entries`` in the run's index with one compare-and-swap; the index's new id.

    The index is re-read at the swap, so entries another caller recorded
    meanwhile are kept. None when nothing changed (nothing is written then).
    """
    new = list(entries)
    if not new:
        return None

    def decide(current: str | None) -> str | None:
        base = read_analytics_at(store, current, run) if current else AnalyticsIndex(run)
        held = base.lookup(e.sort_key for e in new)
        if all(held.get(e.sort_key) == e for e in new):
            raise _NothingNewError
        return store.put_manifest(record_analyses(base, new))

    with store.lock.join(lease):
        try:
            entry = store.refs.update(analytics_ref(run), decide, message=message)
        except _NothingNewError:
            return None
    return entry.target
