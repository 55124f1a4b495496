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
from typing import TYPE_CHECKING, Any, Final

import numpy as np

from gradpipe._version import __version__
from gradpipe.core.analysis_manifest import AnalysisInput, AnalysisManifest
from gradpipe.core.analytics_index import AnalyticsIndex, record_analyses
from gradpipe.core.display import printable
from gradpipe.core.manifest import manifest_id
from gradpipe.core.run_entries import AnalysisEntry, EntryKey
from gradpipe.core.tensor_manifest import TensorManifest
from gradpipe.errors import IntegrityError
from gradpipe.storage.catalog import (
    analytics_ref,
    read_analytics,
    read_analytics_at,
    read_many,
)
from gradpipe.storage.tensors import read_tensor, write_tensor

if TYPE_CHECKING:
    from gradpipe.storage.store import Store

__all__ = [
    "RESULT_ARRAYS",
    "Planned",
    "ResultSpec",
    "commit_analyses",
    "find_memoised",
    "read_results",
    "store_results",
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


def find_memoised(
    store: Store, run: str, planned: Sequence[Planned]
) -> dict[EntryKey, AnalysisEntry]:
    """The entries already recorded under the same keys, by (step, name).

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
            out[p.sort_key] = entry
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


def store_results(
    store: Store, results: Sequence[tuple[ResultSpec, Mapping[str, np.ndarray], Mapping[str, Any]]]
) -> list[AnalysisEntry]:
    """Write results (spec, arrays, coords) and their manifests in one batch; their entries.

    Small result arrays are kept inside their manifests; larger ones are
    blocks, written first. Call under the writer's lease that later commits
    the entries.
    """
    manifests = []
    for spec, arrays, coords in results:
        tensors, embedded = [], {}
        for name, array in arrays.items():
            manifest = write_tensor(store, np.ascontiguousarray(array), where=f"result {name}")
            tensor_id = manifest_id(manifest)  # embedded, as a dump's tensors are
            tensors.append((name, tensor_id))
            embedded[tensor_id] = manifest
        manifests.append(
            AnalysisManifest(
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
                coords=dict(coords),
                embedded=embedded,
            )
        )
    ids = store.put_manifests(manifests)
    return [
        AnalysisEntry(spec.step, spec.name, analysis_id, spec.key)
        for (spec, _, _), analysis_id in zip(results, ids, strict=True)
    ]


def _provenance() -> dict[str, str]:
    return {"gradpipe": __version__, "numpy": np.__version__, "python": platform.python_version()}


def read_results(
    store: Store, run: str, entries: Sequence[AnalysisEntry]
) -> list[tuple[str, AnalysisManifest, dict[str, np.ndarray]]]:
    """The results ``entries`` name, with their arrays by name (manifests in batched reads).

    Each is checked against its entry (run, step, name, key) and its arrays
    against its labels: an index moved by hand, or a damaged result, is an
    :class:`~gradpipe.errors.IntegrityError` naming the step, never a wrong figure.
    """
    ids = [e.analysis for e in entries]
    out = []
    manifests = read_many(store, ids, AnalysisManifest, context=f"analyses of run {run}")
    for entry, manifest in zip(entries, manifests, strict=True):
        where = f"analysis {printable(entry.name)} of run {printable(run)}, step {entry.step}"
        expected = (run, entry.step, entry.name, entry.key)
        if (manifest.run, manifest.step, manifest.name, manifest.key) != expected:
            raise IntegrityError(
                f"{where}: the index names {entry.analysis}, which is the analysis "
                f"{printable(manifest.name)} of run {printable(manifest.run)}, step "
                f"{manifest.step}; run `gradpipe verify`"
            )
        arrays = {}
        for name, tensor_id in manifest.tensors:
            tensor = manifest.embedded.get(tensor_id)
            if tensor is None:
                tensor = store.get_typed(tensor_id, TensorManifest, context=where)
            arrays[name] = read_tensor(store, tensor, context=f"{where}, result {name}")
        labels, tensors = manifest.coords.get("labels"), manifest.coords.get("tensors")
        if not isinstance(labels, list) or not isinstance(tensors, list):
            raise IntegrityError(f"{where}: the stored result lists no labels or tensors")
        problem = _shape_problem(manifest.analysis, arrays, len(labels), len(tensors))
        if problem:
            raise IntegrityError(f"{where}: {problem}; run `gradpipe verify`")
        out.append((entry.analysis, manifest, arrays))
    return out


#: The arrays each stored result holds and their leading dims: ``P`` its labels (peers),
#: ``T`` its tensors (or layers); dims past these are free.
RESULT_ARRAYS: Final[dict[str, dict[str, str]]] = {
    "norms": {
        **dict.fromkeys(
            ("sum_squares", "l2_norm", "max_abs", "nonzero", "nan", "inf", "numel", "present"),
            "PT",
        ),
    },
    "peers": {
        "gram": "TPP",
        "dist_sq": "TP",
        "mean_sq": "T",
        "mean_max_abs": "T",
        "disagree": "TPP",
        "both": "TPP",
        "included": "TP",
        "identical": "T",
        "numel": "T",
        "weights": "P",
        "counted": "P",
    },
    "histograms": {"counts": "T"},
    "projection": {"projection": "PT", "lr": "P"},
}


def _shape_problem(
    analysis: str, arrays: Mapping[str, np.ndarray], labels: int, tensors: int
) -> str:
    """Why ``arrays`` do not fit the result's labels and tensors ("" when they do)."""
    expected = RESULT_ARRAYS.get(analysis)
    if expected is None:
        return f"an analysis of unknown kind {printable(analysis)}"
    missing = sorted(set(expected) - set(arrays))
    if missing:
        return f"the stored result lacks {', '.join(missing)}"
    sizes = {"P": labels, "T": tensors}
    for name, dims in expected.items():
        shape = arrays[name].shape
        per_peer = name == "counts" and len(shape) == 3  # histograms per peer: (P, T, bins)
        want = tuple(sizes[d] for d in ("PT" if per_peer else dims))
        if shape[: len(want)] != want:
            return f"its array {name} has shape {list(shape)}, not {list(want)} + ..."
    return ""


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
