"""Norms, spikes and the first non-finite value of a run, as xarray Datasets.

>>> ds = gp.gradient_norms(store, run="train")                     # doctest: +SKIP
>>> gp.norms_by(ds, "layer").l2_norm.sel(peer="rank0").plot.line(x="step")  # doctest: +SKIP
>>> gp.spikes(ds, by="layer").spike.any("layer")                   # doctest: +SKIP
>>> gp.first_nonfinite(store, run="train")                         # doctest: +SKIP

None of these reads a chunk, but for :func:`first_nonfinite`, which reads the
chunks the statistics flag, and a float64 chunk whose sum of squares overflowed.
The norms are memoised per step under ``analytics/<run>``: a second call reads
the index and the stored results only.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence
from typing import TYPE_CHECKING, Any, Final

import numpy as np
import xarray as xr
from dask.base import tokenize

from gradpipe.analytics.layers import LayerRule, layers_of, model_order
from gradpipe.analytics.nonfinite import FlaggedCell, NonFinite, locate_nonfinite
from gradpipe.analytics.norm_figures import FIGURES, exact_sum
from gradpipe.analytics.norms import norms_graph
from gradpipe.analytics.options import STORED_VERSIONS, parse_params
from gradpipe.analytics.passes import PassOutcome, run_pass
from gradpipe.analytics.selection import Steps, StepSources, step_sources
from gradpipe.analytics.spikes import robust_z
from gradpipe.core.display import printable
from gradpipe.errors import InvalidInputError
from gradpipe.graph.runner import Runner, use_runner

if TYPE_CHECKING:
    from gradpipe.storage.store import Store

__all__ = ["first_nonfinite", "gradient_norms", "norms_by", "norms_dataset", "spikes"]

#: The Dataset's name of each stored figure.
_VARIABLES: Final = {
    "sum_squares": "sum_squares",
    "l2_norm": "l2_norm",
    "max_abs": "max_abs",
    "nonzero": "nonzero_count",
    "nan": "nan_count",
    "inf": "inf_count",
    "numel": "numel",
}
_DESCRIPTIONS: Final = {
    "sum_squares": "sum of squares of the finite elements",
    "l2_norm": "Euclidean norm of the finite elements",
    "max_abs": "largest absolute value, NaN ignored (inf if any element is infinite)",
    "nonzero_count": "elements that are not zero (NaN counts, -0.0 does not)",
    "nan_count": "NaN elements",
    "inf_count": "infinite elements",
    "numel": "elements",
}


def gradient_norms(
    store: Store,
    run: str,
    *,
    steps: Steps = None,
    aggregate: str | None = None,
    layers: LayerRule = None,
    runner: Runner | None = None,
) -> xr.Dataset:
    """Norm and scale figures of every tensor of every dump of a run, from its manifests.

    Parameters
    ----------
    store : Store
        The store. Results are recorded under ``analytics/<run>`` when it is
        writable; a read-only store computes them each time.
    run : str
        The run.
    steps : range or sequence of int, optional
        The steps to analyse (default: all).
    aggregate : str, optional
        The run's aggregate of that name at each step instead of the dumps:
        dims ``(step, tensor)``.
    layers : str, regex or callable, optional
        How tensor names map to layers (the ``layer`` coordinate; see
        :mod:`gradpipe.analytics.layers`). Read-time only: never recomputes.
    runner : Runner, optional
        Where the graph runs (default: a temporary one).

    Returns
    -------
    xarray.Dataset
        Dims ``(step, peer, tensor)``: ``l2_norm``, ``sum_squares``,
        ``max_abs``, ``nonzero_count``, ``nan_count``, ``inf_count`` and
        ``numel`` (float64, NaN where a dump lacks the tensor), coordinates
        ``layer(tensor)`` and ``analysis_id(step)``; ``attrs`` say how many
        chunks were read and which steps were computed or memoised. Per layer
        and in total: :func:`norms_by`.
    """
    _, outcome = _norms_pass(store, run, steps=steps, aggregate=aggregate, runner=runner)
    return norms_dataset(outcome, run=run, aggregate=aggregate, layers=layers)


def _norms_pass(
    store: Store, run: str, *, steps: Steps, aggregate: str | None, runner: Runner | None
) -> tuple[list[StepSources], PassOutcome]:
    _, sources = step_sources(store, run, steps=steps, aggregate=aggregate)
    return sources, run_pass(
        store,
        run,
        sources,
        analysis="norms",
        version=STORED_VERSIONS["norms"],
        params={},
        aggregate=aggregate,
        build=norms_graph,
        runner=runner,
    )


def norms_dataset(
    outcome: PassOutcome, *, run: str, aggregate: str | None, layers: LayerRule
) -> xr.Dataset:
    """:func:`gradient_norms`' Dataset from the pass (computed or read back)."""
    outcome.require_results(run)
    results = outcome.results
    labels = sorted({label for r in results for label in r.labels})  # the run's peer order
    tensors = model_order(t for r in results for t in r.tensors)
    at_label = {x: i for i, x in enumerate(labels)}
    at_tensor = {x: i for i, x in enumerate(tensors)}
    shape = (len(results), len(labels), len(tensors))
    data = {f: np.full(shape, np.nan) for f in FIGURES}
    for s, r in enumerate(results):
        rows = np.array([at_label[x] for x in r.labels], dtype=np.intp)
        cols = np.array([at_tensor[x] for x in r.tensors], dtype=np.intp)
        present = r.arrays["present"]
        for f in FIGURES:
            block = np.where(present, r.arrays[f].astype(np.float64), np.nan)
            data[f][s][np.ix_(rows, cols)] = block
    dims: tuple[str, ...] = ("step", "peer", "tensor")
    if aggregate is not None:
        data = {f: v[:, 0, :] for f, v in data.items()}
        dims = ("step", "tensor")
    data_vars = {
        _VARIABLES[f]: (dims, data[f], {"description": _DESCRIPTIONS[_VARIABLES[f]]})
        for f in FIGURES
    }
    coords: dict[str, Any] = {
        "step": np.array([r.step for r in results], np.int64),
        "tensor": np.array(tensors, dtype=object),
        "layer": ("tensor", np.array(layers_of(tensors, layers), dtype=object)),
        "analysis_id": ("step", np.array([r.analysis_id or "" for r in results], dtype=object)),
    }
    if aggregate is None:
        coords["peer"] = np.array(labels, dtype=object)
    ds = xr.Dataset(data_vars, coords=coords)
    ds.attrs = {
        "analysis": "norms",
        "run": run,
        **({"aggregate": aggregate} if aggregate is not None else {}),
        **outcome.attrs(),
    }
    return ds


def norms_by(ds: xr.Dataset, by: str = "layer") -> xr.Dataset:
    """The figures of :func:`gradient_norms` per layer (``by="layer"``) or in total.

    ``sum_squares`` is summed exactly (``math.fsum``) and ``l2_norm`` is its
    square root (from the tensors' norms by ``math.hypot`` where the sum
    overflows); counts are summed, ``max_abs`` is the maximum. A cell with no
    tensor at all stays NaN.
    """
    if by not in ("layer", "total"):
        raise InvalidInputError(f"norms_by groups by layer or total, not {printable(by)}")
    keep = [str(d) for d in ds["l2_norm"].dims if d != "tensor"]
    groups = (
        {"total": np.arange(ds.sizes["tensor"])}
        if by == "total"
        else {
            name: np.flatnonzero(ds["layer"].values == name)
            for name in dict.fromkeys(ds["layer"].values.tolist())
        }
    )
    values = {v: ds[v].transpose(*keep, "tensor").values for v in _VARIABLES.values()}
    lead = values["numel"].shape[:-1]
    out = {v: np.full((*lead, len(groups)), np.nan) for v in values}
    for g, idx in enumerate(groups.values()):
        present = ~np.isnan(values["numel"][..., idx])
        some = present.any(axis=-1)
        for v in ("nonzero_count", "nan_count", "inf_count", "numel"):
            out[v][..., g] = np.where(some, np.nansum(values[v][..., idx], axis=-1), np.nan)
        with np.errstate(invalid="ignore"):
            peaks = np.where(present, values["max_abs"][..., idx], -np.inf)
            peak = np.max(np.where(np.isnan(peaks), -np.inf, peaks), axis=-1)
        out["max_abs"][..., g] = np.where(some & (peak > -np.inf), peak, np.nan)
        squares = values["sum_squares"][..., idx]
        norms = values["l2_norm"][..., idx]
        for cell in np.ndindex(*lead):
            if not some[cell]:
                continue
            total = exact_sum(x for x in squares[cell] if not math.isnan(x))
            out["sum_squares"][(*cell, g)] = total
            out["l2_norm"][(*cell, g)] = (
                math.sqrt(total)
                if not math.isinf(total)
                else math.hypot(*(x for x in norms[cell] if not math.isnan(x)))
            )
    coords = {d: ds[d] for d in keep}
    data_vars: dict[str, Any]
    if by == "total":
        data_vars = {v: (keep, a[..., 0], ds[v].attrs) for v, a in out.items()}
    else:
        coords["layer"] = xr.DataArray(np.array(list(groups), dtype=object), dims="layer")
        data_vars = {v: ((*keep, "layer"), a, ds[v].attrs) for v, a in out.items()}
    result = xr.Dataset(data_vars, coords=coords)
    result.attrs = {**ds.attrs, "by": by}
    return result


def spikes(
    source: xr.Dataset | Store,
    run: str | None = None,
    *,
    by: str = "total",
    window: int = 50,
    threshold: float = 6.0,
    two_sided: bool = False,
    steps: Steps = None,
    aggregate: str | None = None,
    layers: LayerRule = None,
    runner: Runner | None = None,
) -> xr.Dataset:
    """Steps whose gradient norm jumps: a robust z-score over a trailing window.

    See :mod:`gradpipe.analytics.spikes` for the rule.

    Parameters
    ----------
    source : xarray.Dataset or Store
        What :func:`gradient_norms` returned, or a store (then ``run`` is needed
        and the norms are computed, or read back, first).
    by : {"total", "layer", "tensor"}
        The series: each peer's total norm, each layer's, or each tensor's.
    window, threshold, two_sided
        The trailing window of recorded steps, the z-score above which a step
        is a spike, and whether a fall below ``-threshold`` is one too.

    Returns
    -------
    xarray.Dataset
        ``l2_norm``, ``z`` and the booleans ``spike`` and ``nonfinite`` (a
        NaN or an infinity in the series' tensors: no z), with the dims of
        the norms grouped ``by``; the parameters in ``attrs``.
    """
    params = parse_params(
        "spikes", {"by": by, "window": window, "threshold": threshold, "two_sided": two_sided}
    )
    if isinstance(source, xr.Dataset):
        given = {"run": run, "aggregate": aggregate, "steps": steps, "layers": layers}
        extra = [k for k, v in {**given, "runner": runner}.items() if v is not None]
        if extra:
            raise InvalidInputError(
                f"spikes of a norms Dataset take no {', '.join(extra)}: those choose what "
                "gradient_norms computes (pass layers= to gradient_norms)"
            )
        norms = source
    else:
        if run is None:
            raise InvalidInputError("spikes of a store need the run: spikes(store, run)")
        norms = gradient_norms(
            source, run, steps=steps, aggregate=aggregate, layers=layers, runner=runner
        )
    grouped = norms if params["by"] == "tensor" else norms_by(norms, str(params["by"]))
    l2 = grouped["l2_norm"]
    step_axis = l2.dims.index("step")
    values = np.moveaxis(l2.values, step_axis, 0)
    bad = np.moveaxis((grouped["nan_count"] + grouped["inf_count"]).values, step_axis, 0) > 0
    usable = ~np.isnan(values) & (values > 0) & ~bad
    z = np.moveaxis(robust_z(values, usable, window=int(window)), 0, step_axis)
    limit = float(threshold)
    with np.errstate(invalid="ignore"):
        spike = z > limit
        if two_sided:
            spike |= z < -limit
    flagged = np.moveaxis(bad, 0, step_axis)
    out = xr.Dataset(
        {
            "l2_norm": l2,
            "z": (l2.dims, z, {"description": "robust z-score of log(l2_norm) (MAD-scaled)"}),
            "spike": (l2.dims, spike, {"description": _spike_rule(limit, two_sided)}),
            "nonfinite": (l2.dims, flagged, {"description": "holds a NaN or an infinity"}),
        }
    )
    out.attrs = {**norms.attrs, **params, "analysis": "spikes"}
    return out


def _spike_rule(limit: float, two_sided: bool) -> str:
    return f"|z| > {limit}" if two_sided else f"z > {limit}"


def first_nonfinite(
    store: Store,
    run: str,
    *,
    steps: Steps = None,
    aggregate: str | None = None,
    first_only: bool = True,
    runner: Runner | None = None,
) -> xr.Dataset:
    """Where the NaNs and infinities are: the first such element of each flagged tensor.

    The norms (computed, or read back) say which (step, peer, tensor) hold a
    non-finite value; only the first flagged chunk of each is read. With
    ``first_only`` (the default) only the earliest such step is examined.

    Returns
    -------
    xarray.Dataset
        One entry per flagged tensor along dim ``found``, earliest first
        (step, then peer in the run's order, then tensor in model order):
        ``step``, ``peer``, ``tensor``, ``chunk_index``, ``flat_index``,
        ``element`` (text, ``"3,17"``), ``value`` (``nan``, ``+inf`` or ``-inf``),
        ``chunk_count`` and ``tensor_count`` (non-finite elements in that
        chunk and tensor). Empty when there is none; ``attrs["first"]``
        describes the earliest.
    """
    parse_params("nonfinite", {"first_only": first_only})
    sources, outcome = _norms_pass(store, run, steps=steps, aggregate=aggregate, runner=runner)
    kind = "dump" if aggregate is None else "aggregate"
    by_step = {s.step: s for s in sources}
    cells: list[FlaggedCell] = []
    for r in outcome.results:
        counts = r.arrays["nan"] + r.arrays["inf"]
        at_tensor = {t: j for j, t in enumerate(r.tensors)}
        found = [
            FlaggedCell(r.step, label, by_step[r.step].inputs[p].source, kind, tensor)
            for p, label in enumerate(r.labels)
            for tensor in model_order(r.tensors)
            if counts[p, at_tensor[tensor]] > 0
        ]
        cells.extend(found)
        if found and first_only:
            break
    located = _locate(store, cells, runner)
    rows = [
        {
            "step": x.cell.step,
            "peer": x.cell.label,
            "tensor": x.cell.tensor,
            "chunk_index": x.chunk,
            "flat_index": x.flat_index,
            "element": ",".join(map(str, x.index)),
            "value": x.value,
            "chunk_count": x.chunk_count,
            "tensor_count": x.tensor_count,
        }
        for x in located
    ]
    ds = xr.Dataset(
        {
            c: (
                "found",
                np.array([row[c] for row in rows], dtype=object if c in _TEXT else np.int64),
            )
            for c in _NONFINITE_COLUMNS
        }
    )
    failed = [f"step {f.step}: {f.reason}" for f in outcome.failures]
    first = _describe(located[0]) if located else ""
    earlier = [f for f in outcome.failures if not located or f.step < located[0].cell.step]
    if earlier:  # a step that could not be read may hold an earlier one
        first = (first + "; " if first else "") + (
            f"uncertain: step {earlier[0].step} could not be analysed"
        )
    ds.attrs = {
        "analysis": "nonfinite",
        "run": run,
        "chunks_read": len(located) + outcome.chunks_read,
        "first": first,
        "first_only": first_only,
        "failed": failed,
    }
    return ds


_NONFINITE_COLUMNS: Final = (
    "step",
    "peer",
    "tensor",
    "chunk_index",
    "flat_index",
    "element",
    "value",
    "chunk_count",
    "tensor_count",
)
_TEXT: Final = frozenset({"peer", "tensor", "element", "value"})


def _locate(store: Store, cells: Sequence[FlaggedCell], runner: Runner | None) -> list[NonFinite]:
    if not cells:
        return []
    graph: dict[Hashable, Any] = {}
    keys: list[Hashable] = []
    for cell in cells:
        key = ("gradpipe-nonfinite", tokenize(store.url, cell))
        graph[key] = (locate_nonfinite, store, cell)
        keys.append(key)
    with use_runner(runner) as active:
        return list(active.get(graph, keys, name="gradpipe-nonfinite"))


def _describe(x: NonFinite) -> str:
    who = "peer" if x.cell.kind == "dump" else "aggregate"
    return (
        f"step {x.cell.step}, {who} {x.cell.label}, tensor {x.cell.tensor}, element "
        f"[{', '.join(map(str, x.index))}] (flat {x.flat_index}): {x.value}"
    )
