"""Norm and scale series of a run: every (step, peer, tensor) from the manifests alone.

::

    norms(steps 0..k)  norms(steps k+1..m) ...   one task per <= 256 manifests read
          └────────── results ──────────┘        stored and indexed by the client

Each task reads the dump (or aggregate) manifests of whole steps in batched
round trips and computes, per tensor, the figures of
:mod:`gradpipe.analytics.norm_figures` from the chunk statistics alone: JSON
decoding is the work, so many manifests per task, and processes or a cluster
spread it. A step's figures are stored as one result
(:mod:`gradpipe.analytics.memo`), arrays of dims ``(peer, tensor)``, under a
key of the step's dump ids: asking again reads the index and the results only.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence
from typing import TYPE_CHECKING, Any, Final

import numpy as np
from dask.base import tokenize

from gradpipe.analytics.norm_figures import COUNTS, FIGURES, overflowed_chunks, tensor_figures
from gradpipe.analytics.selection import StepSources
from gradpipe.analytics.step_figures import StepFailure, StepFigures
from gradpipe.core.aggregate_manifest import AggregateManifest
from gradpipe.core.display import printable
from gradpipe.core.gc_pause import gc_paused
from gradpipe.core.run_manifest import DumpManifest
from gradpipe.core.tensor_manifest import TensorManifest, TensorRef, resolve_tensor
from gradpipe.errors import GradpipeError, IntegrityError
from gradpipe.graph.arrays import load_chunk
from gradpipe.storage.catalog import named_tensors

if TYPE_CHECKING:
    from gradpipe.storage.store import Store

__all__ = ["MANIFESTS_PER_TASK", "norms_graph", "step_norms"]

#: Dump manifests one task reads (whole steps, so a step of more peers is one task alone).
MANIFESTS_PER_TASK: Final = 256


def norms_graph(
    store: Store, sources: Sequence[StepSources]
) -> tuple[dict[Hashable, Any], list[Hashable]]:
    """The tasks computing ``sources``' figures: whole steps, <= 256 manifests per task."""
    graph: dict[Hashable, Any] = {}
    keys: list[Hashable] = []
    batch: list[StepSources] = []
    held = 0

    def close() -> None:
        key = ("gradpipe-norms", tokenize(store.url, [(s.step, s.inputs) for s in batch]))
        graph[key] = (step_norms, store, list(batch))
        keys.append(key)
        batch.clear()

    for step in sources:
        if batch and held + len(step.inputs) > MANIFESTS_PER_TASK:
            close()
            held = 0
        batch.append(step)
        held += len(step.inputs)
    if batch:
        close()
    return graph, keys


@gc_paused
def step_norms(store: Store, steps: list[StepSources]) -> list[StepFigures | StepFailure]:
    """The figures of each step (a task): its manifests read in one batch, no chunk read."""
    try:
        read = _read_sources(store, [i for s in steps for i in s.inputs], steps[0].kind)
    except GradpipeError:  # something is wrong with one step: read them apart to say which
        return [_one_step(store, s) for s in steps]
    out: list[StepFigures | StepFailure] = []
    at = 0
    for s in steps:
        manifests = read[at : at + len(s.inputs)]
        at += len(s.inputs)
        out.append(_figures_or_failure(store, s, manifests))
    return out


def _one_step(store: Store, step: StepSources) -> StepFigures | StepFailure:
    """One step's figures, its manifests read one by one: a failure names its peer."""
    manifests = []
    for source in step.inputs:
        try:
            [manifest] = _read_sources(store, [source], step.kind)
        except GradpipeError as exc:
            return StepFailure(step.step, f"{_where(step, source.label)}: {exc}")
        manifests.append(manifest)
    return _figures_or_failure(store, step, manifests)


def _where(step: StepSources, label: str) -> str:
    return f"step {step.step}, {_what(step.kind)} {printable(label)}"


def _read_sources(
    store: Store, inputs: Sequence[Any], kind: str
) -> list[DumpManifest] | list[AggregateManifest]:
    ids = [i.source for i in inputs]
    if kind == "dump":
        return store.get_typed_many(ids, DumpManifest, context="dump")
    return store.get_typed_many(ids, AggregateManifest, context="aggregate")


def _figures_or_failure(
    store: Store, step: StepSources, manifests: Sequence[DumpManifest | AggregateManifest]
) -> StepFigures | StepFailure:
    try:
        return _figures(store, step, manifests)
    except GradpipeError as exc:
        return StepFailure(step.step, str(exc))


def _figures(
    store: Store, step: StepSources, manifests: Sequence[DumpManifest | AggregateManifest]
) -> StepFigures:
    per_label: list[dict[str, TensorManifest | TensorRef]] = []
    for source, manifest in zip(step.inputs, manifests, strict=True):
        where = _where(step, source.label)
        per_label.append(
            named_tensors(store, manifest.tensors, manifest.embedded, where=where, lazy=True)
        )
    names = list(dict.fromkeys(n for tensors in per_label for n in tensors))
    at_name = {n: j for j, n in enumerate(names)}
    shape = (len(per_label), len(names))
    arrays = {
        f: np.zeros(shape, np.int64) if f in COUNTS else np.full(shape, math.nan) for f in FIGURES
    }
    arrays["present"] = np.zeros(shape, bool)
    result = StepFigures(step.step, step.labels, names, arrays)
    for p, (source, tensors) in enumerate(zip(step.inputs, per_label, strict=True)):
        for name, tensor in tensors.items():
            context = f"{_where(step, source.label)}, tensor {printable(name)}"
            try:
                stats = tensor.chunk_stats() if isinstance(tensor, TensorRef) else tensor.stats
            except GradpipeError as exc:
                raise IntegrityError(f"{context}: {exc}") from None
            reader = _ChunkReader(store, tensor, context) if overflowed_chunks(stats) else None
            figures = tensor_figures(stats, reader)
            j = at_name[name]
            for f, value in zip(FIGURES, figures.values(), strict=True):
                arrays[f][p, j] = value
            arrays["present"][p, j] = True
            result.chunks_read += reader.reads if reader is not None else 0
    return result


def _what(kind: str) -> str:
    return "peer" if kind == "dump" else "aggregate"


class _ChunkReader:
    """Reads chunks of one tensor for :func:`tensor_figures`, counting them."""

    def __init__(self, store: Store, tensor: TensorManifest | TensorRef, context: str) -> None:
        self.store, self.tensor, self.context, self.reads = store, tensor, context, 0

    def __call__(self, index: int) -> np.ndarray:
        manifest = resolve_tensor(self.tensor)
        start, stop = manifest.chunk_ranges()[index]
        self.reads += 1
        return load_chunk(
            self.store,
            manifest.blocks[index],
            manifest.dtype,
            (stop - start,),
            f"{self.context}, chunk {index}",
            manifest.inline.get(index),
            manifest.deltas.get(index, ()),
        )
