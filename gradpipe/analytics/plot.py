"""Figures of the analyses (matplotlib, the ``plot`` extra).

- :func:`plot_norms`: each peer's (or layer's) gradient norm over steps, spikes marked;
- :func:`plot_agreement`: the peers' cosine matrix at one step;
- :func:`plot_noise_scale`: ``B_simple`` over steps, raw and smoothed;
- :func:`plot_histograms`: one tensor's histograms over steps, offset in depth as
  TensorBoard's "offset" view draws them, on a signed log axis.

Built with matplotlib's object interface and drawn by its Agg canvas, as
:mod:`gradpipe.statistics.plot` is: no pyplot state, no display.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

import numpy as np
import xarray as xr

from gradpipe.core.display import printable
from gradpipe.errors import InvalidInputError

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

    from gradpipe.analytics.analyze import AnalysisReport

__all__ = [
    "figure",
    "plot_agreement",
    "plot_histograms",
    "plot_noise_scale",
    "plot_norms",
    "plot_report",
    "save",
]


def figure(size: tuple[float, float]) -> Figure:
    """An empty figure on matplotlib's Agg canvas (an error naming the extra without it)."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise InvalidInputError(
            "plotting analyses needs matplotlib; install it with pip install 'gradpipe[plot]'"
        ) from None
    fig = Figure(figsize=size, layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def save(fig: Figure, path: str | os.PathLike[str]) -> None:
    """Write ``fig`` as PNG to a local path (replaced atomically) or an fsspec URL."""
    from gradpipe.formats._output import write_output

    write_output(path, lambda f: fig.savefig(f, format="png", dpi=110), None)


def plot_norms(spikes: xr.Dataset, *, ax: Axes | None = None) -> Figure:
    """Norms over steps, one line per series, spikes marked (what :func:`gradpipe.spikes` gave)."""
    fig, ax = _axes(ax, (9, 4))
    l2 = spikes["l2_norm"]
    series = [d for d in l2.dims if d != "step"]
    stacked = l2.stack(series=series) if series else l2.expand_dims(series=[""])
    flags = spikes["spike"]
    flags = flags.stack(series=series) if series else flags.expand_dims(series=[""])
    steps = l2["step"].values
    for i in range(stacked.sizes["series"]):
        label = _series_label(stacked, i, series)
        values = stacked.isel(series=i).values
        line = ax.plot(steps, values, lw=1, label=label)[0]
        hit = flags.isel(series=i).values.astype(bool)
        ax.plot(steps[hit], values[hit], "o", ms=7, mfc="none", color=line.get_color())
    ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel("L2 norm")
    ax.set_title(f"gradient norms of {printable(spikes.attrs.get('run', ''))} (o: spike)")
    if stacked.sizes["series"] <= 12:
        ax.legend(fontsize=7, ncols=2)
    return fig


def _series_label(stacked: xr.DataArray, i: int, dims: list[Any]) -> str:
    if not dims:
        return "total"
    key = stacked["series"].values[i]
    parts = key if isinstance(key, tuple) else (key,)
    return " / ".join(str(p) for p in parts)


def plot_agreement(agreement: xr.Dataset, step: int, *, ax: Axes | None = None) -> Figure:
    """The peers' cosine matrix at ``step`` (what :func:`gradpipe.peer_agreement` gave)."""
    fig, ax = _axes(ax, (5.5, 4.5))
    cosine = agreement["cosine"].sel(step=step)
    if cosine.ndim != 2:
        raise InvalidInputError("plot the agreement of the whole gradient (by='total')")
    image = ax.imshow(cosine.values, vmin=-1, vmax=1, cmap="RdBu_r")
    peers = [str(p) for p in agreement["peer"].values]
    ax.set_xticks(range(len(peers)), peers, rotation=90, fontsize=7)
    ax.set_yticks(range(len(peers)), peers, fontsize=7)
    flagged = agreement["outlier"].sel(step=step).values.astype(bool)
    for i in np.flatnonzero(flagged):
        ax.add_patch(_outline(int(i), len(peers)))
    fig.colorbar(image, ax=ax, label="cosine")
    ax.set_title(f"peer agreement at step {step} (outlined: outliers)")
    return fig


def _outline(i: int, n: int) -> Any:
    from matplotlib.patches import Rectangle

    return Rectangle((-0.5, i - 0.5), n, 1, fill=False, lw=1.5, ec="black")


def plot_noise_scale(gns: xr.Dataset, *, ax: Axes | None = None) -> Figure:
    """``B_simple`` over steps, raw and smoothed (what :func:`gradpipe.noise_scale` gave)."""
    fig, ax = _axes(ax, (8, 3.5))
    if gns["b_simple"].ndim != 1:
        raise InvalidInputError("plot the noise scale of the whole gradient (by='total')")
    steps = gns["step"].values
    ax.plot(steps, gns["b_simple"].values, ".", alpha=0.5, label="B_simple")
    ax.plot(steps, gns["b_simple_ema"].values, lw=2, label="smoothed")
    ax.plot(steps, gns["batch"].values, "--", lw=1, color="grey", label="batch B")
    ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel("examples")
    ax.set_title("gradient noise scale (McCandlish et al. 2018)")
    ax.legend(fontsize=8)
    return fig


def plot_histograms(
    counts: xr.DataArray, tensor: str, *, ax: Axes | None = None, max_steps: int = 40
) -> Figure:
    """One tensor's histograms over steps, each a curve offset by its step (TensorBoard's view).

    The x axis is signed and logarithmic in magnitude: bins are placed at
    ``±(log2 |edge| - low_exp + 1)``, zero in the middle; NaN and the
    infinities are left out of the curves and counted in the title.
    """
    fig, ax = _axes(ax, (8, 5))
    if tensor not in counts["tensor"].values:
        raise InvalidInputError(f"no histogram of tensor {printable(tensor)}")
    data = counts.sel(tensor=tensor)
    if "peer" in data.dims:
        data = data.sum("peer")
    labels = [str(x) for x in counts["label"].values]
    keep = [i for i, x in enumerate(labels) if x not in ("nan", "-inf", "+inf")]
    low = float(counts.attrs.get("low_exp", -32))
    position = np.array([_position(counts, i, low) for i in keep])
    steps = data["step"].values
    shown = steps[np.linspace(0, len(steps) - 1, min(len(steps), max_steps)).astype(int)]
    top = float(data.values[:, keep].max()) or 1.0
    spacing = top / 4
    for k, step in enumerate(shown[::-1]):
        row = data.sel(step=step).values[keep].astype(np.float64)
        offset = (len(shown) - 1 - k) * spacing
        ax.fill_between(position, offset, offset + row, color="tab:orange", alpha=0.25, lw=0)
        ax.plot(position, offset + row, color="tab:orange", lw=0.8)
    ax.set_yticks([])
    ax.set_xlabel("signed log2 |value| (0: zero)")
    special = data.sel(bin=[i for i, x in enumerate(labels) if x in ("nan", "-inf", "+inf")])
    ax.set_title(
        f"{printable(tensor)}: {len(shown)} steps, oldest at the bottom "
        f"({int(special.sum())} NaN or infinite values not drawn)"
    )
    return fig


def _position(counts: xr.DataArray, i: int, low: float) -> float:
    """Where bin ``i`` sits on the signed log axis."""
    lower = float(counts["lower"].values[i])
    upper = float(counts["upper"].values[i])
    edge = upper if upper <= 0 else lower  # the edge nearer zero
    if edge == 0:
        return 0.0
    magnitude = abs(edge) if np.isfinite(edge) else abs(lower if upper <= 0 else upper)
    return float(np.sign(lower + upper) * (np.log2(magnitude) - low + 1))


def _axes(ax: Axes | None, size: tuple[float, float]) -> tuple[Figure, Axes]:
    if ax is not None:
        owner = ax.get_figure()
        assert owner is not None
        return owner, ax  # type: ignore[return-value]
    fig = figure(size)
    return fig, fig.subplots()


def _whole(result: xr.Dataset | xr.DataArray | None) -> bool:
    """A result of the whole gradient (no layer or tensor dim): what the report's figure shows."""
    return result is not None and not {"layer", "tensor"} & set(result.dims)


def plot_report(report: AnalysisReport, path: str | os.PathLike[str]) -> Figure:
    """One figure of an :func:`~gradpipe.analyze` report (norms with spikes, the noise
    scale, the latest step's agreement, as ran), written as PNG to ``path``."""
    panels = [n for n in ("spikes", "gns", "agreement") if _whole(report.results.get(n))]
    if not panels:
        raise InvalidInputError(
            "the plot draws spikes, gns or agreement of the whole gradient (by total); none ran"
        )
    fig = figure((9, 3.6 * len(panels)))
    axes = fig.subplots(len(panels), 1, squeeze=False)[:, 0]
    for ax, name in zip(axes, panels, strict=True):
        result = report.results[name]
        assert isinstance(result, xr.Dataset)
        if name == "spikes":
            plot_norms(result, ax=ax)
        elif name == "gns":
            plot_noise_scale(result, ax=ax)
        else:
            plot_agreement(result, int(result["step"].values[-1]), ax=ax)
    save(fig, path)
    return fig
