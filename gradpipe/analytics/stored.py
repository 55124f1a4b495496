"""The analyses a store records, as Datasets, without computing anything.

What ``xr.open_datatree(STORE, engine="gradpipe")`` shows under
``/analytics/<run>/...`` and ``open_dataset(..., kind="analysis")`` opens: only
results the run's index names are read (its shards and the result manifests);
a step that was never analysed is simply absent, and a result computed from a
dump since replaced is marked ``stale``. Read-time choices (layers, outlier
rule, smoothing) take their defaults.
"""

from __future__ import annotations

import json
from collections import defaultdict
from typing import TYPE_CHECKING, Any, Final

import numpy as np
import xarray as xr

from gradpipe.analytics.memo import read_results
from gradpipe.analytics.options import default
from gradpipe.analytics.passes import PassOutcome, StepResult
from gradpipe.core.analysis_manifest import AnalysisManifest
from gradpipe.core.display import printable
from gradpipe.core.run_entries import AnalysisEntry
from gradpipe.errors import NotFoundError
from gradpipe.storage.catalog import read_analytics, read_run

if TYPE_CHECKING:
    from gradpipe.storage.store import Store

__all__ = ["STORED_NODES", "stored_analyses", "stored_analysis"]

#: The Datasets each stored result gives, by the result's analysis.
STORED_NODES: Final = {
    "norms": ("norms",),
    "peers": ("agreement", "gns"),
    "histograms": ("histograms",),
    "projection": ("projection",),
}


def stored_analyses(
    store: Store, run: str, *, only: str | None = None, projections: bool = True
) -> dict[str, xr.Dataset]:
    """Every recorded analysis of ``run`` by node name (``norms``, ``agreement``, ``norms@avg``).

    ``only`` reads just the results one node needs; ``projections=False`` leaves
    projections out (k floats per layer and dump: the tree's largest node by far).
    """
    _, index = read_analytics(store, run)
    wanted = None if only is None else _entry_name(only)
    by_name: defaultdict[str, list[AnalysisEntry]] = defaultdict(list)
    for entry in index.entries:
        kind = entry.name.partition(":")[0]
        if (wanted is None or entry.name == wanted) and (projections or kind != "projection"):
            by_name[entry.name].append(entry)
    if not by_name:
        return {}
    _, manifest = read_run(store, run, missing_ok=True)
    current = {(d.step, d.peer): d.dump for d in manifest.dumps}
    aggregates = {(a.step, a.name): a.aggregate for a in manifest.aggregates}
    out: dict[str, xr.Dataset] = {}
    for name, entries in by_name.items():
        kind, _, aggregate = name.partition(":")
        found = _one_parameter_set(read_results(store, run, entries))
        outcome = PassOutcome(kind)
        stale = []
        for analysis_id, result, arrays in found:
            outcome.results.append(
                StepResult(
                    result.step,
                    list(result.coords["labels"]),
                    list(result.coords["tensors"]),
                    arrays,
                    analysis_id,
                    memoised=True,
                )
            )
            used = {(result.step, i.label): i.source for i in result.inputs}
            if aggregate:
                now = {(result.step, aggregate): aggregates.get((result.step, aggregate))}
            else:
                now = {k: v for k, v in current.items() if k[0] == result.step}
            stale.append(used != now)
        params = found[0][1].params if found else {}
        for node, built in _datasets(kind, run, aggregate or None, outcome, params).items():
            ds = built.assign_coords(stale=("step", np.array(stale, dtype=bool)))
            ds["stale"].attrs["description"] = "a dump used was replaced, or a peer added, since"
            out[node if not aggregate else f"{node}@{aggregate}"] = ds
    return out


def _one_parameter_set(
    found: list[tuple[str, AnalysisManifest, dict[str, np.ndarray]]],
) -> list[tuple[str, AnalysisManifest, dict[str, np.ndarray]]]:
    """The results of the parameters most steps were analysed with (the latest on a tie).

    Steps analysed with other parameters (histograms of another bin width) do not
    fit one Dataset; ``gp.gradient_histograms(...)`` with those parameters reads them.
    """
    groups: dict[str, list[tuple[str, AnalysisManifest, dict[str, np.ndarray]]]] = {}
    for item in found:
        groups.setdefault(json.dumps(item[1].params, sort_keys=True), []).append(item)
    return max(groups.values(), key=lambda g: (len(g), max(m.step for _, m, _ in g)))


def stored_analysis(store: Store, run: str, name: str) -> xr.Dataset:
    """One recorded analysis of ``run`` (a node of :func:`stored_analyses`)."""
    found = stored_analyses(store, run, only=name)
    if name not in found:
        _, index = read_analytics(store, run)
        names = {_node_names(e.name) for e in index.entries}
        known = ", ".join(sorted(n for group in names for n in group))
        raise NotFoundError(
            f"run {printable(run)} records no analysis {printable(name)} (it records: "
            f"{known or 'none; run gradpipe analyze first'})"
        )
    return found[name]


def _entry_name(node: str) -> str:
    """The index entry a node is read from: ``gns`` → ``peers``, ``norms@avg`` → ``norms:avg``."""
    kind, at, aggregate = node.partition("@")
    stored = next((k for k, nodes in STORED_NODES.items() if kind in nodes), kind)
    return f"{stored}:{aggregate}" if at else stored


def _node_names(entry_name: str) -> tuple[str, ...]:
    kind, _, aggregate = entry_name.partition(":")
    nodes = STORED_NODES.get(kind, (kind,))
    return tuple(f"{n}@{aggregate}" if aggregate else n for n in nodes)


def _datasets(
    kind: str, run: str, aggregate: str | None, outcome: PassOutcome, params: dict[str, Any]
) -> dict[str, xr.Dataset]:
    outcome.results.sort(key=lambda r: r.step)
    if kind == "norms":
        from gradpipe.analytics.api import norms_dataset

        return {"norms": norms_dataset(outcome, run=run, aggregate=aggregate, layers=None)}
    if kind == "peers":
        from gradpipe.analytics.peers import agreement_dataset, noise_scale_dataset

        agreement = agreement_dataset(
            outcome,
            run=run,
            by="total",
            layers=None,
            outlier_z=default("outlier_z"),
            byzantine=default("byzantine"),
        )
        gns = noise_scale_dataset(
            outcome, run=run, by="total", layers=None, ema=default("ema"), batch_size=None
        )
        return {"agreement": agreement, "gns": gns}
    if kind == "histograms":
        from gradpipe.analytics.histograms import histograms_array

        counts = histograms_array(outcome, run=run, params=params)
        return {"histograms": counts.to_dataset().assign_attrs(counts.attrs)}
    from gradpipe.analytics.projections import projection_dataset

    return {"projection": projection_dataset(outcome, run=run, **params)}
