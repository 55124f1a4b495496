"""Histograms of every tensor at every step: log-spaced magnitude bins, TensorBoard's view.

::

    dump(step, peer 0)  dump(step, peer 1) ...   one task per dump: its chunks decoded
            └────────── step ──────────┘         in windows, each binned and dropped

Bins come from :mod:`gradpipe.analytics.histogram_bins` (exact, from the values'
bits): ``bins_per_octave`` bins per octave over ``[2**low_exp, 2**high_exp)``,
mirrored for negative values, plus zero, under- and overflow per sign, the
infinities and NaN. Counts are summed over the step's peers (``per_peer``
keeps them apart), stored per step under ``analytics/<run>``, and returned as a
DataArray ``(step, tensor, bin)`` with the bins' ``lower`` and ``upper`` edges.
A task holds one window of decoded chunks (:mod:`gradpipe.analytics.dump_chunks`),
never a whole dump.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import xarray as xr
from dask.base import tokenize

from gradpipe.analytics.dump_chunks import DumpChunks
from gradpipe.analytics.histogram_bins import BinLayout, bin_layout, histogram_counts
from gradpipe.analytics.layers import model_order
from gradpipe.analytics.options import STORED_VERSIONS, parse_params
from gradpipe.analytics.passes import PassOutcome, run_pass
from gradpipe.analytics.selection import Steps, StepSources, step_sources
from gradpipe.analytics.step_figures import StepFailure, StepFigures
from gradpipe.errors import GradpipeError
from gradpipe.graph.runner import Runner

if TYPE_CHECKING:
    from gradpipe.storage.store import Store

__all__ = ["gradient_histograms", "histograms_array"]


def gradient_histograms(
    store: Store,
    run: str,
    *,
    steps: Steps = None,
    bins_per_octave: int = 2,
    low_exp: int = -32,
    high_exp: int = 16,
    per_peer: bool = False,
    runner: Runner | None = None,
) -> xr.DataArray:
    """The distribution of every float tensor's values at every step, in log-spaced bins.

    Parameters
    ----------
    store, run
        The store and the run.
    steps : range or sequence of int, optional
        The steps (default: all); histograms read every chunk once.
    bins_per_octave, low_exp, high_exp
        ``bins_per_octave`` bins per factor of two of magnitude, over
        ``[2**low_exp, 2**high_exp)``; smaller and larger magnitudes are
        counted as under- and overflow.
    per_peer : bool
        Keep each peer's counts (dims ``(step, peer, tensor, bin)``) instead
        of their sum.

    Returns
    -------
    xarray.DataArray
        int64 counts, dims ``(step, tensor, bin)``, with coordinates ``label``,
        ``lower`` and ``upper`` along ``bin`` (in increasing value order: NaN
        first, then -inf ... +inf). Every tensor's counts sum to its elements
        (times the peers). :func:`gradpipe.analytics.plot.plot_histograms`
        draws them.
    """
    params = parse_params(
        "histograms",
        {
            "bins_per_octave": bins_per_octave,
            "low_exp": low_exp,
            "high_exp": high_exp,
            "per_peer": per_peer,
        },
    )
    layout = bin_layout(int(bins_per_octave), int(low_exp), int(high_exp))
    _, sources = step_sources(store, run, steps=steps)

    def build(store: Store, chosen: Sequence[StepSources]) -> Any:
        return _graph(store, chosen, layout, per_peer=bool(per_peer))

    outcome = run_pass(
        store,
        run,
        sources,
        analysis="histograms",
        version=STORED_VERSIONS["histograms"],
        params=params,
        aggregate=None,
        build=build,
        runner=runner,
    )
    outcome.require_results(run)
    return histograms_array(outcome, run=run, params=params)


def histograms_array(outcome: PassOutcome, *, run: str, params: Mapping[str, Any]) -> xr.DataArray:
    """:func:`gradient_histograms`' DataArray from the pass (computed or read back)."""
    layout = bin_layout(
        int(params["bins_per_octave"]), int(params["low_exp"]), int(params["high_exp"])
    )
    per_peer = bool(params["per_peer"])
    tensors = model_order(t for r in outcome.results for t in r.tensors)
    peers = sorted({x for r in outcome.results for x in r.labels})  # the run's peer order
    shape = (len(peers),) if per_peer else ()
    counts = np.zeros((len(outcome.results), *shape, len(tensors), layout.size), np.int64)
    for s, r in enumerate(outcome.results):
        cols = [tensors.index(t) for t in r.tensors]
        if per_peer:
            rows = [peers.index(x) for x in r.labels]
            counts[s][np.ix_(rows, cols)] = r.arrays["counts"]
        else:
            counts[s][cols] = r.arrays["counts"]
    dims = ("step", *(("peer",) if per_peer else ()), "tensor", "bin")
    coords: dict[str, Any] = {
        "step": np.array([r.step for r in outcome.results], np.int64),
        "tensor": np.array(tensors, dtype=object),
        "bin": np.arange(layout.size),
        "label": ("bin", np.array(layout.labels, dtype=object)),
        "lower": ("bin", layout.lower),
        "upper": ("bin", layout.upper),
        "analysis_id": (
            "step",
            np.array([r.analysis_id or "" for r in outcome.results], dtype=object),
        ),
    }
    if per_peer:
        coords["peer"] = np.array(peers, dtype=object)
    out = xr.DataArray(counts, coords=coords, dims=dims, name="count")
    out.attrs = {
        "analysis": "histograms",
        "run": run,
        **params,
        **outcome.attrs(),
    }
    return out


def _graph(
    store: Store, sources: Sequence[StepSources], layout: BinLayout, *, per_peer: bool
) -> tuple[dict[Hashable, Any], list[Hashable]]:
    graph: dict[Hashable, Any] = {}
    keys: list[Hashable] = []
    for step in sources:
        dump_keys = []
        for source in step.inputs:
            key = ("gradpipe-histograms-dump", tokenize(store.url, source.source, layout))
            graph[key] = (_dump_counts, store, step.step, source.label, source.source, layout)
            dump_keys.append(key)
        key = ("gradpipe-histograms", tokenize(store.url, step.step, dump_keys, per_peer))
        graph[key] = (_step_counts, step.step, step.labels, dump_keys, per_peer)
        keys.append(key)
    return graph, keys


_DumpCounts = tuple[list[str], np.ndarray, int] | StepFailure


def _dump_counts(
    store: Store, step: int, peer: str, dump_id: str, layout: BinLayout
) -> _DumpCounts:
    """Counts of every float tensor of one dump, ``(tensor, bin)``; and chunks read."""
    zero = layout.labels.index("zero")
    try:
        chunks = DumpChunks(store, step, peer, dump_id)
        at = {name: j for j, name in enumerate(chunks.names)}
        counts = np.zeros((len(chunks.names), layout.size), np.int64)
        for chunk in chunks:
            if chunk.values is None:  # an all-zero chunk: counted without a read
                counts[at[chunk.tensor], zero] += chunk.stop - chunk.start
            else:
                counts[at[chunk.tensor]] += histogram_counts(chunk.values, layout)
    except GradpipeError as exc:
        return StepFailure(step, str(exc))
    return chunks.names, counts, chunks.reads


def _step_counts(
    step: int, labels: list[str], parts: list[_DumpCounts], per_peer: bool
) -> list[StepFigures | StepFailure]:
    failed = next((p for p in parts if isinstance(p, StepFailure)), None)
    if failed is not None:
        return [failed]
    done = [p for p in parts if not isinstance(p, StepFailure)]
    names = model_order(n for names, _, _ in done for n in names)
    at = {n: j for j, n in enumerate(names)}
    size = done[0][1].shape[1]
    if per_peer:
        counts = np.zeros((len(labels), len(names), size), np.int64)
        for p, (part_names, part, _) in enumerate(done):
            counts[p, [at[n] for n in part_names]] = part
    else:
        counts = np.zeros((len(names), size), np.int64)
        for part_names, part, _ in done:
            counts[[at[n] for n in part_names]] += part
    reads = sum(r for _, _, r in done)
    return [StepFigures(step, list(labels), names, {"counts": counts}, chunks_read=reads)]
