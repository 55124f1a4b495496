"""Peer agreement and the gradient noise scale of a run, as xarray Datasets.

>>> ds = gp.peer_agreement(store, run="train", by="layer")        # doctest: +SKIP
>>> ds.cosine.sel(step=40, layer="encoder.layer.3").plot()          # doctest: +SKIP
>>> ds.outlier.any("layer").sum("step")                            # doctest: +SKIP
>>> gp.noise_scale(store, run="train").b_simple_ema.plot()         # doctest: +SKIP

Both read every chunk of every peer once, in one shared pass per step
(:mod:`gradpipe.analytics.peer_graph`), stored under ``analytics/<run>``: the
second call, and the other of the two, read the stored results only. The
figures are derived from those when read (:mod:`gradpipe.analytics.agreement`),
so another layer rule, outlier rule or smoothing needs no recomputation.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import numpy as np
import xarray as xr

from gradpipe.analytics.agreement import (
    AGREEMENT_VARIABLES,
    GNS_VARIABLES,
    agreement_figures,
    group_sums,
    noise_scale_figures,
    outliers,
)
from gradpipe.analytics.layers import LayerRule, layers_of, model_order
from gradpipe.analytics.options import STORED_VERSIONS, parse_params
from gradpipe.analytics.passes import PassOutcome, StepResult, run_pass
from gradpipe.analytics.peer_graph import peers_graph
from gradpipe.analytics.selection import Steps, step_sources
from gradpipe.core.display import printable
from gradpipe.errors import InvalidInputError, NotFoundError
from gradpipe.graph.runner import Runner

if TYPE_CHECKING:
    from gradpipe.storage.store import Store

__all__ = [
    "agreement_dataset",
    "noise_scale",
    "noise_scale_dataset",
    "peer_agreement",
    "peer_analyses",
]


def peer_agreement(
    store: Store,
    run: str,
    *,
    steps: Steps = None,
    by: str = "total",
    layers: LayerRule = None,
    outlier_z: float = 6.0,
    byzantine: int = 0,
    runner: Runner | None = None,
) -> xr.Dataset:
    """How the peers' gradients agree at each step: cosines, signs, distances, outliers.

    Parameters
    ----------
    store, run
        The store and the run (two peers or more per step).
    steps : range or sequence of int, optional
        The steps (default: all).
    by : {"total", "layer", "tensor"}
        The whole gradient, each layer (``layers``' rule) or each tensor.
    outlier_z : float
        A peer is an outlier at a step when its distance to the mean (relative
        to the step's median) or its cosine with the others' mean (below the
        step's median) lies more than this many robust standard deviations
        out, the scale pooled over every step and peer analysed.
    byzantine : int
        Faulty peers Krum's scores tolerate.

    Returns
    -------
    xarray.Dataset
        Dims ``step``, ``peer`` and ``peer_b`` (and ``layer`` or ``tensor``):
        ``cosine`` and ``sign_agreement`` (``peer``, ``peer_b``); ``distance``,
        ``loo_cosine``, ``krum_score``, ``distance_z``, ``cosine_z`` and
        ``outlier`` (``peer``; the z-scores' scale is pooled over the steps
        analysed, see :mod:`gradpipe.analytics.agreement`); ``mean_norm``,
        ``norm_ratio``, ``diversity``; and the
        ``weight`` of each peer (its ``num_examples``, else 1). ``peers_identical``
        marks steps whose peers stored the same gradient (taken after the
        all-reduce): their figures are trivial.
    """
    given = {"by": by, "outlier_z": outlier_z, "byzantine": byzantine}
    found = peer_analyses(store, run, agreement=given, steps=steps, layers=layers, runner=runner)
    return found["agreement"]


def agreement_dataset(
    outcome: PassOutcome,
    *,
    run: str,
    by: str,
    layers: LayerRule,
    outlier_z: float,
    byzantine: int,
) -> xr.Dataset:
    """:func:`peer_agreement`'s Dataset from the peers' pass (computed or read back)."""
    params = {"by": by, "outlier_z": outlier_z, "byzantine": byzantine}

    def figures(sums: dict[str, np.ndarray], weights: np.ndarray) -> dict[str, Any]:
        return agreement_figures(sums, weights, byzantine=int(byzantine))

    ds = _dataset(outcome, by=by, layers=layers, figures=figures)
    flags = outliers(
        ds["distance"].transpose(..., "peer").values,
        ds["loo_cosine"].transpose(..., "peer").values,
        outlier_z=float(outlier_z),
    )
    order = ds["distance"].transpose(..., "peer").dims
    for name, values in flags.items():
        ds[name] = (order, values)
    for name, text in AGREEMENT_VARIABLES.items():
        ds[name].attrs["description"] = text
    ds.attrs.update(params, analysis="agreement", run=run)
    return ds


def noise_scale(
    store: Store,
    run: str,
    *,
    steps: Steps = None,
    by: str = "total",
    layers: LayerRule = None,
    ema: float = 0.9,
    batch_size: int | None = None,
    runner: Runner | None = None,
) -> xr.Dataset:
    """The gradient noise scale of each step, from the peers' gradients and batch sizes.

    McCandlish et al. (2018), appendix A.1: each dump must hold the *mean*
    gradient of its ``num_examples`` i.i.d. examples (``batch_size`` gives
    every peer's where dumps record none). Dumps taken after the all-reduce
    hold one gradient on every peer and measure nothing: their steps are NaN.

    Returns
    -------
    xarray.Dataset
        Dims ``step`` (and ``layer`` or ``tensor``): ``trace_sigma`` (𝒮),
        ``true_grad_sq`` (``|𝒢|²``), ``b_simple`` (``𝒮/|𝒢|²``), ``batch`` (B), and
        ``b_simple_ema``: the ratio of the two estimates each smoothed over
        steps by an exponential moving average (``ema``, bias-corrected), as
        the paper advises.
    """
    given = {"by": by, "ema": ema, "batch_size": batch_size}
    return peer_analyses(store, run, gns=given, steps=steps, layers=layers, runner=runner)["gns"]


def noise_scale_dataset(
    outcome: PassOutcome,
    *,
    run: str,
    by: str,
    layers: LayerRule,
    ema: float,
    batch_size: int | None,
) -> xr.Dataset:
    """:func:`noise_scale`'s Dataset from the peers' pass (computed or read back)."""
    params = {"by": by, "ema": ema, "batch_size": batch_size}

    for r in outcome.results:
        _check_batches(r, batch_size)

    def figures(sums: dict[str, np.ndarray], weights: np.ndarray) -> dict[str, Any]:
        return noise_scale_figures(sums, _batches(weights, batch_size))

    ds = _dataset(outcome, by=by, layers=layers, figures=figures)
    ds = ds.drop_dims(["peer", "peer_b"], errors="ignore")
    batches = [_batches(r.arrays["weights"], batch_size) for r in outcome.results]
    ds["batch"] = ("step", [float(b.sum()) for b in batches])
    ds["b_simple_ema"] = _smoothed(ds["trace_sigma"], ds["true_grad_sq"], float(ema))
    described = {**GNS_VARIABLES, "b_simple_ema": "B_simple of the smoothed estimates"}
    for name, text in described.items():
        ds[name].attrs["description"] = text
    ds.attrs.update({k: v for k, v in params.items() if v is not None}, analysis="gns", run=run)
    return ds


def _check_batches(result: StepResult, batch_size: int | None) -> None:
    """Every peer's batch size is known: from its dump's num_examples, or from batch_size=."""
    counted = result.arrays.get("counted", np.ones(len(result.labels), bool))
    if batch_size is None and not counted.all():
        peer = result.labels[int(np.flatnonzero(~counted)[0])]
        raise InvalidInputError(
            f"step {result.step}, peer {printable(peer)}: the dump records no num_examples, "
            "its batch size; the noise scale needs it (pass batch_size= if every peer used one)"
        )
    if batch_size is not None and counted.any():
        peer = result.labels[int(np.flatnonzero(counted)[0])]
        raise InvalidInputError(
            f"step {result.step}, peer {printable(peer)}: the dump records num_examples; "
            "batch_size= is for dumps that record none"
        )


def _batches(weights: np.ndarray, batch_size: int | None) -> np.ndarray:
    if batch_size is None:
        return np.asarray(weights, dtype=np.float64)
    return np.full(len(weights), float(batch_size))


def _smoothed(trace: xr.DataArray, true_sq: xr.DataArray, beta: float) -> xr.DataArray:
    """The ratio of the two series each smoothed by a bias-corrected EMA over steps."""
    a = np.moveaxis(trace.values, 0, -1)
    b = np.moveaxis(true_sq.values, 0, -1)
    out = np.full(a.shape, np.nan)
    for cell in np.ndindex(*a.shape[:-1]):
        ema_a = ema_b = 0.0
        seen = 0
        for t in range(a.shape[-1]):
            x, y = a[(*cell, t)], b[(*cell, t)]
            if math.isnan(x) or math.isnan(y):
                continue
            seen += 1
            ema_a = beta * ema_a + (1 - beta) * x
            ema_b = beta * ema_b + (1 - beta) * y
            correction = 1 - beta**seen
            smooth_b = ema_b / correction
            out[(*cell, t)] = (ema_a / correction) / smooth_b if smooth_b > 0 else math.nan
    return trace.copy(data=np.moveaxis(out, -1, 0))


def peer_analyses(
    store: Store,
    run: str,
    *,
    agreement: dict[str, Any] | None = None,
    gns: dict[str, Any] | None = None,
    steps: Steps = None,
    layers: LayerRule = None,
    runner: Runner | None = None,
) -> dict[str, xr.Dataset]:
    """Agreement and the noise scale (those given parameters) from one pass: ``gp.analyze``'s.

    ``agreement`` and ``gns`` are :func:`peer_agreement`'s and :func:`noise_scale`'s
    keywords (``{}`` for the defaults); the chunks are read once for both, also
    where the store is read-only and records nothing between them.
    """
    chosen = {
        name: parse_params(name, given)  # checked, with the table's defaults
        for name, given in (("agreement", agreement), ("gns", gns))
        if given is not None
    }
    outcome = _peers_pass(store, run, steps=steps, runner=runner)
    out = {}
    if "agreement" in chosen:
        a = chosen["agreement"]
        out["agreement"] = agreement_dataset(
            outcome,
            run=run,
            by=str(a["by"]),
            layers=layers,
            outlier_z=a["outlier_z"],  # type: ignore[arg-type]
            byzantine=a["byzantine"],  # type: ignore[arg-type]
        )
    if "gns" in chosen:
        g = chosen["gns"]
        out["gns"] = noise_scale_dataset(
            outcome,
            run=run,
            by=str(g["by"]),
            layers=layers,
            ema=g["ema"],  # type: ignore[arg-type]
            batch_size=g["batch_size"],  # type: ignore[arg-type]
        )
        if "agreement" in out:  # one pass: its reads are counted once, with the agreement
            out["gns"].attrs["chunks_read"] = 0
    return out


def _peers_pass(store: Store, run: str, *, steps: Steps, runner: Runner | None) -> PassOutcome:
    _, sources = step_sources(store, run, steps=steps)
    outcome = run_pass(
        store,
        run,
        sources,
        analysis="peers",
        version=STORED_VERSIONS["peers"],
        params={"weights": "num_examples"},
        aggregate=None,
        build=peers_graph,
        runner=runner,
    )
    outcome.require_results(run)
    return outcome


def _dataset(
    outcome: PassOutcome,
    *,
    by: str,
    layers: LayerRule,
    figures: Any,
) -> xr.Dataset:
    """Per step and group, ``figures(group sums, weights)``, stacked over the run's peers."""
    results = outcome.results
    peers = sorted({x for r in results for x in r.labels})  # the run's peer order
    groups = _groups(results, by, layers)
    rows: list[list[dict[str, Any] | None]] = []
    for r in results:
        at = {x: i for i, x in enumerate(r.tensors)}
        per_group: list[dict[str, Any] | None] = []
        for members in groups.values():
            idx = [at[t] for t in members if t in at]
            if not idx:
                per_group.append(None)
                continue
            sums = group_sums(r.arrays, idx)
            if sums is None:  # no tensor of the group has figures (integers, one holder)
                per_group.append(None)
                continue
            per_group.append(_spread(figures(sums, r.arrays["weights"]), r.labels, peers))
        rows.append(per_group)
    names = next((list(g) for row in rows for g in row if g is not None), [])
    if not names:
        raise NotFoundError(
            "no float tensor is held by two peers or more at any step: no peer figures"
        )
    data_vars: dict[str, Any] = {}
    for name in names:
        sample = next(g[name] for row in rows for g in row if g is not None)
        shape = np.shape(sample)
        stacked = np.full((len(results), len(groups), *shape), np.nan)
        for s, row in enumerate(rows):
            for g, figs in enumerate(row):
                if figs is not None:
                    stacked[s, g] = figs[name]
        dims = ("step", "group", *("peer", "peer_b")[: len(shape)])
        data_vars[name] = (dims, stacked)
    weight = np.full((len(results), len(peers)), np.nan)
    for s, r in enumerate(results):
        for x, w in zip(r.labels, r.arrays["weights"], strict=True):
            weight[s, peers.index(x)] = w
    data_vars["weight"] = (("step", "peer"), weight, {"description": "num_examples, else 1"})
    identical = np.array([bool(r.arrays["identical"].all()) for r in results])
    coords: dict[str, Any] = {
        "step": np.array([r.step for r in results], np.int64),
        "peer": np.array(peers, dtype=object),
        "peer_b": np.array(peers, dtype=object),
        "peers_identical": ("step", identical),
        "analysis_id": ("step", np.array([r.analysis_id or "" for r in results], dtype=object)),
    }
    ds = xr.Dataset(data_vars, coords=coords)
    if by == "total":
        ds = ds.isel(group=0, drop=True)
    else:
        ds = ds.rename({"group": by}).assign_coords({by: np.array(list(groups), dtype=object)})
    ds.attrs = {
        **outcome.attrs(),
    }
    return ds


def _groups(results: list[StepResult], by: str, layers: LayerRule) -> dict[str, list[str]]:
    tensors = model_order(t for r in results for t in r.tensors)
    if by == "tensor":
        return {t: [t] for t in tensors}
    if by == "total":
        return {"total": tensors}
    out: dict[str, list[str]] = {}
    for tensor, layer in zip(tensors, layers_of(tensors, layers), strict=True):
        out.setdefault(layer, []).append(tensor)
    return out


def _spread(figures: dict[str, Any], labels: list[str], peers: list[str]) -> dict[str, Any]:
    """Per-peer figures placed on the run's peers (NaN for a peer absent at this step)."""
    where = [peers.index(x) for x in labels]
    n = len(peers)
    out: dict[str, Any] = {}
    for name, value in figures.items():
        array = np.asarray(value, dtype=np.float64)
        if array.ndim == 0:
            out[name] = array
        elif array.ndim == 1:
            full = np.full(n, np.nan)
            full[where] = array
            out[name] = full
        else:
            full = np.full((n, n), np.nan)
            full[np.ix_(where, where)] = array
            out[name] = full
    return out
