"""One figure of what :func:`gradpipe.compression_stats` found (matplotlib, the ``plot`` extra).

Four panels: how well each tensor compresses (raw over stored bytes, log
scale) and how dense it is (with the share of all-zero chunks), then, across
steps, the norm of each peer's whole update and the stored bits per value. The
figure is built with matplotlib's object interface and drawn by its Agg
canvas: nothing here touches pyplot's global state or a display, so it works
the same in a batch job, a Dask worker and a notebook.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Final

import numpy as np
import xarray as xr

from gradpipe.core.display import printable
from gradpipe.errors import InvalidInputError
from gradpipe.statistics.api import summarize_stats
from gradpipe.statistics.tensor_stats import fraction, ratio

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

__all__ = ["plot_stats"]

#: Tensors shown by name in the per-tensor panels (the largest by raw bytes); the
#: rest are drawn as one bar.
MAX_TENSORS: Final = 16
_MIB: Final = 2**20


def plot_stats(ds: xr.Dataset, path: str | os.PathLike[str] | None = None) -> Figure:
    """A figure of compression and gradient statistics; written as PNG to ``path`` if given.

    Parameters
    ----------
    ds : xarray.Dataset
        What :func:`gradpipe.compression_stats` returned (a run, an aggregate
        or a snapshot chain).
    path : str or path, optional
        Where to write the figure as PNG: a local path (replaced atomically)
        or an fsspec URL.

    Returns
    -------
    matplotlib.figure.Figure

    Examples
    --------
    >>> fig = plot_stats(gp.compression_stats(store, run="train"), "stats.png")  # doctest: +SKIP
    """
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise InvalidInputError(
            "plotting statistics needs matplotlib; install it with pip install 'gradpipe[plot]'"
        ) from None
    if not int(ds["present"].sum()):
        raise InvalidInputError(f"{_title(ds)} holds no tensors: nothing to plot")
    fig = Figure(figsize=(13, 9), layout="constrained")
    FigureCanvasAgg(fig)
    ratio_ax, density_ax, norm_ax, bits_ax = fig.subplots(2, 2).flat
    per_tensor = _largest_tensors(summarize_stats(ds, by="tensor"))
    _tensor_bars(ratio_ax, density_ax, per_tensor)
    _over_steps(norm_ax, bits_ax, ds)
    totals = summarize_stats(ds)
    fig.suptitle(
        f"{_title(ds)}: {float(totals['raw_bytes']) / _MIB:,.1f} MiB raw -> "
        f"{float(totals['stored_bytes']) / _MIB:,.1f} MiB stored "
        f"(ratio {float(totals['ratio']):.2f}, {float(totals['bits_per_value']):.2f} bits/value)",
        fontsize=12,
    )
    if path is not None:
        from gradpipe.formats._output import write_output

        write_output(path, lambda f: fig.savefig(f, format="png", dpi=110), None)
    return fig


def _size(nbytes: float) -> str:
    if nbytes >= _MIB / 10:
        return f"{nbytes / _MIB:,.1f} MiB"
    return f"{nbytes / 1024:,.1f} KiB"


def _title(ds: xr.Dataset) -> str:
    kind = ds.attrs.get("kind")
    if kind == "aggregate":
        return f"aggregate {printable(ds.attrs['aggregate'])} of run {printable(ds.attrs['run'])}"
    if kind == "snapshot":
        return f"snapshot {printable(ds.attrs['snapshot'])}"
    return f"run {printable(ds.attrs.get('run', '?'))}"


def _largest_tensors(per_tensor: xr.Dataset) -> xr.Dataset:
    """The largest tensors by raw bytes, largest first; the others summed into one row."""
    order = per_tensor.sortby(per_tensor["raw_bytes"].fillna(0), ascending=False)
    if order.sizes["tensor"] <= MAX_TENSORS:
        return order
    head = order.isel(tensor=slice(0, MAX_TENSORS - 1))
    rest = order.isel(tensor=slice(MAX_TENSORS - 1, None))
    label = f"{rest.sizes['tensor']} others"
    summed = ("raw_bytes", "stored_bytes", "nonzero_count", "numel", "zero_chunk_count")
    other = xr.Dataset(
        {name: ("tensor", [float(rest[name].sum())]) for name in (*summed, "chunk_count")},
        coords={"tensor": [label]},
    )
    other["ratio"] = xr.apply_ufunc(ratio, other["raw_bytes"], other["stored_bytes"])
    other["density"] = xr.apply_ufunc(fraction, other["nonzero_count"], other["numel"])
    other["zero_chunk_fraction"] = xr.apply_ufunc(
        fraction, other["zero_chunk_count"], other["chunk_count"]
    )
    keep = ["raw_bytes", "stored_bytes", "ratio", "density", "zero_chunk_fraction"]
    return xr.concat([head[keep], other[keep]], dim="tensor")


def _tensor_bars(ratio_ax: Axes, density_ax: Axes, per_tensor: xr.Dataset) -> None:
    names = [str(n) for n in per_tensor["tensor"].values]
    y = np.arange(len(names))
    ratios = per_tensor["ratio"].values
    # A tensor that took no bytes of its own (all zero, or deduplicated) has no
    # finite ratio: drawn to the axis' end, grey, and labelled so.
    finite = np.isfinite(ratios)
    top = float(np.nanmax(ratios[finite])) * 3 if finite.any() else 10.0
    shown = np.where(finite, ratios, top)
    # Bars start at 1 (stored as is): compressed tensors reach right, those
    # that take more than their raw bytes (small ones: the frame header) left.
    colors = np.where(~finite, "#999999", np.where(shown >= 1, "#3b75af", "#c44e52"))
    ratio_ax.barh(y, shown - 1, left=1, color=colors)
    stored = per_tensor["stored_bytes"].values
    for i, (value, size) in enumerate(zip(ratios, stored, strict=True)):
        text = f"{value:.2f}x, {_size(size)}" if np.isfinite(value) else "no bytes of its own"
        ratio_ax.text(max(shown[i], 1.0), i, f" {text}", va="center", fontsize=7)
    ratio_ax.set_xscale("log")
    low = min(float(np.nanmin(shown)), 1.0) / 1.5
    ratio_ax.set_xlim(low, top * 4)
    ratio_ax.axvline(1.0, color="black", linewidth=0.8)
    ratio_ax.set_yticks(y, names, fontsize=7)
    ratio_ax.invert_yaxis()
    ratio_ax.set_xlabel("raw / stored bytes (log scale; 1 = stored as is)")
    ratio_ax.set_title("compression ratio per tensor, largest first")
    density = per_tensor["density"].values
    zero = per_tensor["zero_chunk_fraction"].values
    density_ax.barh(y, density, color="#e1812c", label="non-zero values")
    density_ax.scatter(zero, y, color="black", marker="|", s=80, label="all-zero chunks")
    density_ax.set_xlim(0, 1.05)
    density_ax.set_yticks(y, names, fontsize=7)
    density_ax.invert_yaxis()
    density_ax.set_xlabel("fraction")
    density_ax.set_title("density per tensor")
    density_ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.12), ncols=2, fontsize=8)


def _over_steps(norm_ax: Axes, bits_ax: Axes, ds: xr.Dataset) -> None:
    """Per step: each peer's update norm and stored bits per value (one line per peer)."""
    from matplotlib.ticker import MaxNLocator

    keep = [str(d) for d in ds["numel"].dims if d != "tensor"]
    cells = summarize_stats(ds, by=keep)
    along = "version" if "version" in cells.dims else "step"
    x = cells["step"].values
    lines = cells["peer"].values if "peer" in cells.dims else [None]
    for peer in lines:
        one = cells if peer is None else cells.sel(peer=peer)
        label = "aggregate" if ds.attrs.get("kind") == "aggregate" else "snapshot"
        label = str(peer) if peer is not None else label
        marker = "o" if cells.sizes[along] <= 30 else None
        norm_ax.plot(x, one["l2_norm"].values, marker=marker, markersize=3, label=label)
        bits_ax.plot(x, one["bits_per_value"].values, marker=marker, markersize=3, label=label)
    norm_ax.set_xlabel("step")
    norm_ax.set_ylabel("L2 norm of all tensors")
    norm_ax.set_title("update norm across steps" + (", per peer" if "peer" in cells.dims else ""))
    bits_ax.set_xlabel("step")
    bits_ax.set_ylabel("stored bits per value")
    bits_ax.set_title("stored bits per value across steps")
    bits_ax.set_ylim(bottom=0)
    for ax in (norm_ax, bits_ax):
        ax.grid(alpha=0.3)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        if len(lines) <= 12:
            ax.legend(fontsize=8, title="peer" if "peer" in cells.dims else None)
