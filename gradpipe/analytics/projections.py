"""Seeded random projections of every dump: what influence scores are computed from.

::

    dump(step, peer 0)  dump(step, peer 1) ...   one task per dump: each chunk projected
            └────────── step ──────────┘         (gradpipe.core.sketch) and added to its
                                                 layer's k-vector, in float64

Each dump's gradient is projected to ``k`` dimensions per layer (the default
layer rule of :mod:`gradpipe.analytics.layers`) by the block-sparse sign
projection of :mod:`gradpipe.core.sketch`: reproducible from ``(seed, tensor,
element)`` alone, so any chunk grid gives the same projection up to rounding,
and a query projected later lands in the same space. The per-layer sums are
kept in float64 through the dump and rounded once to float32 when stored
(``(peer, layer, k)`` per step: 32 KiB per layer and dump at ``k = 8192``).
The dump's learning rate (metadata ``lr`` or ``learning_rate``) is stored beside it.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Final

import numpy as np
import xarray as xr
from dask.base import tokenize

from gradpipe.analytics.dump_chunks import DumpChunks
from gradpipe.analytics.layers import layers_of
from gradpipe.analytics.options import STORED_VERSIONS, parse_params
from gradpipe.analytics.passes import PassOutcome, run_pass
from gradpipe.analytics.selection import Steps, StepSources, step_sources
from gradpipe.analytics.step_figures import StepFailure, StepFigures
from gradpipe.core.sketch import parse_sketch_size, sign_sketch
from gradpipe.errors import GradpipeError
from gradpipe.graph.runner import Runner

if TYPE_CHECKING:
    from gradpipe.storage.store import Store

__all__ = [
    "LR_KEYS",
    "dump_lr",
    "project_gradients",
    "projection_dataset",
    "projection_pass",
]

#: The metadata keys a dump's learning rate is read from, in order.
LR_KEYS: Final = ("lr", "learning_rate")


def project_gradients(
    store: Store,
    run: str,
    *,
    k: int = 8192,
    seed: int = 0,
    s: int = 4,
    steps: Steps = None,
    runner: Runner | None = None,
) -> xr.Dataset:
    """The random projection of every dump of a run, per layer (see :mod:`gradpipe.core.sketch`).

    Returns
    -------
    xarray.Dataset
        ``projection`` (float32, dims ``(step, peer, layer, k)``; NaN where a
        peer has no dump or a dump no such layer) and ``lr`` (``(step, peer)``,
        from the dumps' metadata; NaN where none is recorded).
    """
    outcome = projection_pass(store, run, k=k, seed=seed, s=s, steps=steps, runner=runner)
    return projection_dataset(outcome, run=run, k=k, seed=seed, s=s)


def projection_dataset(outcome: PassOutcome, *, run: str, k: int, seed: int, s: int) -> xr.Dataset:
    """:func:`project_gradients`' Dataset from the pass (computed or read back)."""
    results = outcome.results
    peers = sorted({x for r in results for x in r.labels})  # the run's peer order
    layers = list(dict.fromkeys(x for r in results for x in r.tensors))
    data = np.full((len(results), len(peers), len(layers), k), np.nan, np.float32)
    lr = np.full((len(results), len(peers)), np.nan)
    for i, r in enumerate(results):
        rows = [peers.index(x) for x in r.labels]
        cols = [layers.index(x) for x in r.tensors]
        data[i][np.ix_(rows, cols)] = r.arrays["projection"]
        lr[i, rows] = r.arrays["lr"]
    ds = xr.Dataset(
        {
            "projection": (("step", "peer", "layer", "k"), data),
            "lr": (("step", "peer"), lr, {"description": "the dump's metadata lr"}),
        },
        coords={
            "step": np.array([r.step for r in results], np.int64),
            "peer": np.array(peers, dtype=object),
            "layer": np.array(layers, dtype=object),
            "analysis_id": ("step", np.array([r.analysis_id or "" for r in results], object)),
        },
    )
    ds.attrs = {"analysis": "projection", "run": run, "k": k, "seed": seed, "s": s}
    ds.attrs.update(outcome.attrs())
    return ds


def projection_pass(
    store: Store,
    run: str,
    *,
    k: int,
    seed: int,
    s: int,
    steps: Steps = None,
    runner: Runner | None = None,
) -> PassOutcome:
    """Project (or read back) every dump of the selected steps."""
    params = parse_params("projection", {"k": k, "seed": seed, "s": s})
    parse_sketch_size(k, s)
    _, sources = step_sources(store, run, steps=steps)

    def build(store: Store, chosen: Sequence[StepSources]) -> Any:
        return _graph(store, chosen, k=k, seed=seed, s=s)

    outcome = run_pass(
        store,
        run,
        sources,
        analysis="projection",
        version=STORED_VERSIONS["projection"],
        params=params,
        aggregate=None,
        build=build,
        runner=runner,
    )
    outcome.require_results(run)
    return outcome


def _graph(
    store: Store, sources: Sequence[StepSources], *, k: int, seed: int, s: int
) -> tuple[dict[Hashable, Any], list[Hashable]]:
    graph: dict[Hashable, Any] = {}
    keys: list[Hashable] = []
    for step in sources:
        dump_keys = []
        for source in step.inputs:
            key = ("gradpipe-projection-dump", tokenize(store.url, source.source, k, seed, s))
            graph[key] = (
                _project_dump,
                store,
                step.step,
                source.label,
                source.source,
                (k, seed, s),
            )
            dump_keys.append(key)
        key = ("gradpipe-projection", tokenize(store.url, step.step, dump_keys))
        graph[key] = (_assemble, step.step, step.labels, dump_keys)
        keys.append(key)
    return graph, keys


_Projected = tuple[list[str], np.ndarray, float, int] | StepFailure


def _project_dump(
    store: Store, step: int, peer: str, dump_id: str, sketch: tuple[int, int, int]
) -> _Projected:
    """One dump's per-layer projections ``(layer, k)`` float64, its lr, and chunks read."""
    k, seed, s = sketch
    try:
        chunks = DumpChunks(store, step, peer, dump_id)
        layers = list(dict.fromkeys(layers_of(chunks.names)))
        of_tensor = dict(zip(chunks.names, layers_of(chunks.names), strict=True))
        sums = np.zeros((len(layers), k))
        at = {layer: i for i, layer in enumerate(layers)}
        for chunk in chunks:
            if chunk.values is not None:
                row = sums[at[of_tensor[chunk.tensor]]]
                sign_sketch(
                    chunk.values,
                    seed=seed,
                    tensor=chunk.tensor,
                    offset=chunk.start,
                    k=k,
                    s=s,
                    out=row,
                )
        lr = dump_lr(chunks.dump.metadata)
    except GradpipeError as exc:
        return StepFailure(step, str(exc))
    return layers, sums, lr, chunks.reads


def dump_lr(metadata: Mapping[str, str]) -> float:
    """The learning rate a dump's metadata records (``lr`` or ``learning_rate``), or NaN."""
    for key in LR_KEYS:
        text = metadata.get(key)
        if text is not None:
            try:
                value = float(text)
            except ValueError:
                return math.nan
            return value if math.isfinite(value) else math.nan
    return math.nan


def _assemble(
    step: int, labels: list[str], parts: list[_Projected]
) -> list[StepFigures | StepFailure]:
    failed = next((p for p in parts if isinstance(p, StepFailure)), None)
    if failed is not None:
        return [failed]
    done = [p for p in parts if not isinstance(p, StepFailure)]
    layers = list(dict.fromkeys(x for names, _, _, _ in done for x in names))
    k = done[0][1].shape[1]
    out = np.full((len(labels), len(layers), k), np.nan, np.float32)
    lr = np.array([part[2] for part in done], dtype=np.float64)
    for p, (names, sums, _, _) in enumerate(done):
        out[p, [layers.index(x) for x in names]] = sums.astype(np.float32)  # rounded once
    reads = sum(part[3] for part in done)
    arrays: dict[str, np.ndarray] = {"projection": out, "lr": lr}
    return [StepFigures(step, list(labels), layers, arrays, chunks_read=reads)]
