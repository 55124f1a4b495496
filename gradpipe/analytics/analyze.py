"""``gp.analyze``: several analyses of a run in one call, one report.

The batch entry point of ``gradpipe analyze``, the workflow's ``analyze`` stage
and the dashboard: it runs the analyses asked for (by default every one that
needs no extra input: norms, spikes, first non-finite, agreement and the noise
scale) over shared passes (the norms serve spikes and the non-finite search;
one peers' pass serves agreement and the noise scale), isolates a failing
analysis from the others, and reports headline figures. In a notebook, the
per-analysis functions (:func:`gradpipe.gradient_norms`, ...) read better.
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Final

import numpy as np
import xarray as xr

from gradpipe.analytics.options import check_request, takers
from gradpipe.analytics.selection import Steps
from gradpipe.core.display import printable
from gradpipe.core.html import ReportHtml
from gradpipe.errors import GradpipeError
from gradpipe.graph.runner import Runner, use_runner
from gradpipe.graph.telemetry import operation

if TYPE_CHECKING:
    from gradpipe.storage.store import Store

__all__ = ["AnalysisReport", "analyze"]


@dataclass
class AnalysisReport(ReportHtml):
    """What :func:`analyze` computed: a Dataset per analysis, failures, headline figures.

    ``report["norms"]`` is the analysis' Dataset (a DataArray for
    ``histograms``); ``failures`` maps an analysis that failed to why.
    """

    run: str
    results: dict[str, xr.Dataset | xr.DataArray] = field(default_factory=dict)
    failures: dict[str, str] = field(default_factory=dict)
    #: Default analyses that do not apply to this run, and why (one peer per step).
    skipped: dict[str, str] = field(default_factory=dict)

    def __getitem__(self, name: str) -> xr.Dataset | xr.DataArray:
        if name not in self.results:
            raise KeyError(f"no {name!r} in this report (it has {', '.join(self.results)})")
        return self.results[name]

    @property
    def ok(self) -> bool:
        """No analysis failed, and none left a step out."""
        return not self.failures and not any(r.attrs.get("failed") for r in self.results.values())

    @property
    def chunks_read(self) -> int:
        return sum(int(r.attrs.get("chunks_read", 0)) for r in self.results.values())

    def headlines(self) -> dict[str, Any]:
        """The scalar figures a dashboard shows (numbers and text only)."""
        out: dict[str, Any] = {"chunks_read": self.chunks_read}
        if "spikes" in self.results:
            out["spike_count"] = int(self.results["spikes"]["spike"].sum())
        if "nonfinite" in self.results:
            out["first_nonfinite"] = str(self.results["nonfinite"].attrs.get("first", ""))
        if "agreement" in self.results:
            flagged = self.results["agreement"]["outlier"]
            counts = flagged.sum("step") if "step" in flagged.dims else flagged
            while counts.ndim > 1:
                counts = counts.sum(str(next(d for d in counts.dims if d != "peer")))
            peers = [str(p) for p, n in zip(counts["peer"].values, counts.values, strict=True) if n]
            out["outlier_peers"] = ", ".join(peers)
        if _whole(self.results.get("gns")):
            latest = self.results["gns"]["b_simple_ema"].values
            values = latest[~np.isnan(latest)]
            out["gns_latest"] = float(values[-1]) if values.size else None
        return out

    def to_dict(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "run": self.run,
            **self.headlines(),
            "analyses": {
                name: {
                    k: r.attrs.get(k)
                    for k in ("computed_steps", "memoised_steps", "failed", "not_recorded")
                    if k in r.attrs
                }
                for name, r in self.results.items()
            },
            "failures": dict(self.failures),
            "skipped": dict(self.skipped),
        }

    def summary(self) -> str:
        head = self.headlines()
        lines = [f"run {printable(self.run)}: {', '.join(self.results) or 'nothing'} analysed"]
        for name, r in self.results.items():
            done = r.attrs.get("computed_steps")
            memo = r.attrs.get("memoised_steps")
            counts = f" ({done} steps computed, {memo} memoised)" if done is not None else ""
            lines.append(f"  {name}{counts}")
            lines += [f"    failed: {f}" for f in r.attrs.get("failed", [])[:5]]
        if "spike_count" in head:
            lines.append(f"spikes: {head['spike_count']}")
        if head.get("first_nonfinite"):
            lines.append(f"first non-finite: {head['first_nonfinite']}")
        if "outlier_peers" in head:
            lines.append(f"outlier peers: {head['outlier_peers'] or 'none'}")
        if head.get("gns_latest") is not None:
            lines.append(f"gradient noise scale (latest, smoothed): {head['gns_latest']:.4g}")
        lines += [f"skipped {name}: {why}" for name, why in self.skipped.items()]
        lines += [f"FAILED {name}: {why}" for name, why in self.failures.items()]
        lines.append(f"{head['chunks_read']} chunks read")
        return "\n".join(lines)

    def failure_lines(self) -> list[str]:
        """One line per failed analysis, and per step an analysis left out."""
        lines = [f"{name}: {why}" for name, why in self.failures.items()]
        for name, result in self.results.items():
            lines += [f"{name}: {line}" for line in result.attrs.get("failed", [])]
        return lines

    def records(self) -> Iterator[dict[str, Any]]:
        """One record per (step, peer): the headline figures of the whole gradient.

        (Per layer or tensor, read the analyses' Datasets.)
        """
        rows: dict[tuple[int, str], dict[str, Any]] = {}
        per_peer = {
            "spikes": ("l2_norm", "z", "spike"),
            "agreement": ("distance", "loo_cosine", "outlier"),
        }
        for name, fields in per_peer.items():
            result = self.results.get(name)
            if not _whole(result) or "peer" not in result.dims:  # type: ignore[union-attr]
                continue
            assert isinstance(result, xr.Dataset)
            steps, peers = result["step"].values, result["peer"].values
            columns = {f: result[f].transpose("step", "peer").values for f in fields}
            for s, step in enumerate(steps):
                for p, peer in enumerate(peers):
                    row = rows.setdefault(
                        (int(step), str(peer)), {"step": int(step), "peer": str(peer)}
                    )
                    row.update({f: _plain(columns[f][s, p]) for f in fields})
        norms = self.results.get("norms")
        if "spikes" not in self.results and isinstance(norms, xr.Dataset) and "peer" in norms.dims:
            from gradpipe.analytics.api import norms_by

            total = norms_by(norms, "total")["l2_norm"].transpose("step", "peer")
            for s, step in enumerate(total["step"].values):
                for p, peer in enumerate(total["peer"].values):
                    key = (int(step), str(peer))
                    row = rows.setdefault(key, {"step": key[0], "peer": key[1]})
                    row["l2_norm"] = _plain(total.values[s, p])
        gns = self.results.get("gns")
        if _whole(gns):
            assert isinstance(gns, xr.Dataset)
            at = {int(step): i for i, step in enumerate(gns["step"].values)}
            columns = {f: gns[f].values for f in ("b_simple", "b_simple_ema")}
            for row in rows.values():
                if row["step"] in at:
                    row.update({f: _plain(v[at[row["step"]]]) for f, v in columns.items()})
        yield from (rows[k] for k in sorted(rows))


def _whole(result: xr.Dataset | xr.DataArray | None) -> bool:
    """A result of the whole gradient (``by="total"``): what headlines and records show."""
    return result is not None and not {"layer", "tensor"} & set(result.dims)


def _plain(value: Any) -> Any:
    item = value.item() if hasattr(value, "item") else value
    if isinstance(item, float) and math.isnan(item):
        return None
    return item


def analyze(
    store: Store,
    run: str,
    *,
    what: Sequence[str] | str | None = None,
    steps: Steps = None,
    aggregate: str | None = None,
    runner: Runner | None = None,
    **params: Any,
) -> AnalysisReport:
    """Run several analyses of a run (see :mod:`gradpipe.analytics.options` for the table).

    Parameters
    ----------
    store, run
        The store and the run.
    what : sequence of str, optional
        The analyses (default: every one needing no extra input: norms, spikes,
        nonfinite, agreement, gns). ``influence`` needs a query: call
        :func:`gradpipe.influence`.
    steps : range or sequence of int, optional
        The steps (default: all).
    aggregate : str, optional
        Norms, spikes and non-finite values of this aggregate instead of the dumps.
    **params
        The analyses' parameters (``window``, ``threshold``, ``outlier_z``,
        ``ema``, ``bins_per_octave``, ``k``...), each going to the analyses
        that take it.

    Returns
    -------
    AnalysisReport
    """
    chosen = check_request(what, aggregate, params)
    report = AnalysisReport(run)
    if what is None and aggregate is None and _one_peer_per_step(store, run):
        for name in PEER_ANALYSES:
            if name in chosen:
                chosen.remove(name)
                report.skipped[name] = "every step has one peer: nothing to compare"
    with (
        use_runner(runner) as active,
        operation(active, "analyze", run=run, store=store.url) as reporting,
    ):
        peers = [n for n in chosen if n in PEER_ANALYSES]
        for name in chosen:
            if name in PEER_ANALYSES:
                if name == peers[0]:  # one pass over the peers' chunks for both
                    _peer_results(report, store, run, peers, params, steps=steps, runner=active)
                continue
            try:
                report.results[name] = _run_one(
                    store,
                    run,
                    name,
                    params=params,
                    steps=steps,
                    aggregate=aggregate,
                    runner=active,
                )
            except GradpipeError as exc:
                report.failures[name] = str(exc)
            except Exception as exc:  # a bug of one analysis leaves the others their results
                report.failures[name] = f"{type(exc).__name__}: {exc}"
        reporting.finish(report, failures=report.failure_lines(), commit=None)
    return report


#: Each analysis' function (imported when run), and whether it takes ``aggregate=``.
_FUNCTIONS: Final = {
    "norms": ("gradpipe.analytics.api:gradient_norms", True),
    "spikes": ("gradpipe.analytics.api:spikes", True),
    "nonfinite": ("gradpipe.analytics.api:first_nonfinite", True),
    "histograms": ("gradpipe.analytics.histograms:gradient_histograms", False),
    "projection": ("gradpipe.analytics.projections:project_gradients", False),
}


#: The analyses that compare a step's peers.
PEER_ANALYSES: Final = ("agreement", "gns")


def _peer_results(
    report: AnalysisReport,
    store: Store,
    run: str,
    names: list[str],
    params: Mapping[str, Any],
    *,
    steps: Steps,
    runner: Runner,
) -> None:
    from gradpipe.analytics.peers import peer_analyses

    given = {n: {k: v for k, v in params.items() if n in takers(k)} for n in names}
    try:
        report.results.update(
            peer_analyses(
                store,
                run,
                agreement=given.get("agreement"),
                gns=given.get("gns"),
                steps=steps,
                runner=runner,
            )
        )
    except Exception as exc:  # one failure of the shared pass fails both
        why = str(exc) if isinstance(exc, GradpipeError) else f"{type(exc).__name__}: {exc}"
        report.failures.update(dict.fromkeys(names, why))


def _one_peer_per_step(store: Store, run: str) -> bool:
    from gradpipe.storage.catalog import read_run

    _, manifest = read_run(store, run)
    counts: dict[int, int] = {}
    for entry in manifest.dumps:
        counts[entry.step] = counts.get(entry.step, 0) + 1
    return bool(counts) and max(counts.values()) < 2


def _run_one(
    store: Store, run: str, name: str, *, params: Mapping[str, Any], **common: Any
) -> xr.Dataset | xr.DataArray:
    module, _, function = _FUNCTIONS[name][0].partition(":")
    call = getattr(importlib.import_module(module), function)
    if not _FUNCTIONS[name][1]:
        common.pop("aggregate")
    mine = {k: v for k, v in params.items() if name in takers(k)}
    result: xr.Dataset | xr.DataArray = call(store, run, **common, **mine)
    return result
