"""``gradpipe stats``: compression and gradient statistics of a run, aggregate or snapshot chain.

Reads manifests and one listing of the store; never a chunk (see
:func:`gradpipe.compression_stats`). ``--format json`` and ``--json`` print the
same one JSON object: the per-(step, peer, tensor) ``records``, the ``totals``,
and with ``--by`` the ``summary`` rows.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any, Final

from gradpipe.cli._common import (
    EXIT_FAILED,
    EXIT_OK,
    CommandResult,
    Commands,
    aligned_lines,
    json_text,
    open_store_arg,
)
from gradpipe.core.display import NAME_LIMIT, printable, printable_text
from gradpipe.errors import InvalidInputError

if TYPE_CHECKING:
    import xarray as xr

__all__ = ["register"]

FORMATS: Final = ("table", "json", "csv")
BY: Final = ("step", "peer", "tensor")


def register(commands: Commands) -> None:
    """Add ``stats``."""
    p = commands.add(
        "stats",
        run_stats,
        "compression and gradient statistics (ratio, bits per value, density, norms, NaN/Inf) "
        "per step, peer and tensor, from manifests alone",
    )
    which = p.add_mutually_exclusive_group(required=True)
    which.add_argument("--run", help="the run whose dumps to describe")
    which.add_argument("--snapshot", metavar="NAME", help="describe a snapshot chain instead")
    p.add_argument(
        "--aggregate", metavar="NAME", help="with --run: describe this aggregate at every step"
    )
    p.add_argument(
        "--by",
        choices=BY,
        help="one row per step, peer or tensor (default: per tensor in the table; one row per "
        "(step, peer, tensor) in json and csv)",
    )
    p.add_argument(
        "--format",
        choices=FORMATS,
        default="table",
        help="table (default), json (one object, as --json) or csv",
    )
    p.add_argument(
        "--plot",
        metavar="OUT.png",
        help="also draw the figure (ratio and density per tensor, norms and bits per value "
        "across steps) to this PNG; needs matplotlib (pip install 'gradpipe[plot]')",
    )


def run_stats(args: argparse.Namespace) -> CommandResult:
    from gradpipe.output import parse_output_path

    if args.aggregate is not None and args.run is None:
        raise InvalidInputError("--aggregate needs the run it belongs to: --run RUN")
    if args.plot is not None:
        parse_output_path(args.plot, what="--plot")  # before reading anything
    store = open_store_arg(args, "r")
    from gradpipe.statistics.api import (
        compression_stats,
        records_csv,
        stats_records,
        summarize_stats,
    )

    ds = compression_stats(store, run=args.run, aggregate=args.aggregate, snapshot=args.snapshot)
    by = _dim(ds, args.by)
    if args.by == "peer" and by is None:
        raise InvalidInputError(f"--by peer: {ds.attrs['kind']} statistics have no peers")
    # Every record only where it is printed: 210,000 of them for 2,000 dumps.
    flat = args.json or args.format == "json" or (args.format == "csv" and not by)
    records = list(stats_records(ds)) if flat else []
    [totals] = list(stats_records(summarize_stats(ds))) or [{}]
    summary = list(stats_records(summarize_stats(ds, by=by))) if by else []
    missing = int(ds.attrs["missing_blocks"])
    doc: dict[str, Any] = {
        "ok": missing == 0,
        "store": store.url,
        **{k: ds.attrs[k] for k in ("kind", "run", "aggregate", "snapshot") if k in ds.attrs},
        "attribution": ds.attrs["attribution"],
        "codec_source": ds.attrs["codec_source"],
        "manifest_bytes": ds.attrs["manifest_bytes"],
        "missing_blocks": missing,
        "totals": _json_safe(totals),
        "records": [_json_safe(r) for r in records],
    }
    if by:
        doc["by"] = args.by
        doc["summary"] = [_json_safe(r) for r in summary]
    if args.plot is not None:
        from gradpipe.statistics.plot import plot_stats

        plot_stats(ds, args.plot)
        doc["plot"] = args.plot
    if args.format == "json":
        text = json_text(doc)
    elif args.format == "csv":
        rows = summary if by else records
        text = records_csv(rows).rstrip("\n")
    else:
        text = _table(ds, summary if by else _default_table(ds), totals, by or "tensor")
    if missing:
        problem = (
            f"{missing} block(s) the statistics need are missing from the store, so the ratios "
            "of their tensors are unknown; run `gradpipe verify`"
        )
        doc["problem"] = problem
        if args.format == "table":
            text += f"\nPROBLEM: {problem}"
    if args.plot is not None and args.format == "table":
        text += f"\nplot written to {args.plot}"
    status = EXIT_FAILED if missing else EXIT_OK
    return CommandResult(doc, text, status, verbatim=args.format != "table")


def _dim(ds: xr.Dataset, by: str | None) -> str | None:
    """The dim ``--by`` names: a snapshot's steps are its versions."""
    if by is None:
        return None
    if by == "step" and "version" in ds.dims:
        return "version"
    return by if by in ds.dims else None


def _default_table(ds: xr.Dataset) -> list[dict[str, Any]]:
    from gradpipe.statistics.api import stats_records, summarize_stats

    return list(stats_records(summarize_stats(ds, by="tensor")))


def _json_safe(record: dict[str, Any]) -> dict[str, Any]:
    """Non-finite floats as the strings manifests use (JSON has no infinities)."""
    from gradpipe.core.encoding import encode_float

    return {k: encode_float(v) if isinstance(v, float) else v for k, v in record.items()}


# --- the table ------------------------------------------------------------------------
_COLUMNS: Final = (
    ("raw MiB", "raw_bytes", lambda v: f"{v / 2**20:,.2f}"),
    ("stored MiB", "stored_bytes", lambda v: f"{v / 2**20:,.2f}"),
    ("ratio", "ratio", lambda v: "inf" if v == math.inf else f"{v:.2f}"),
    ("bits/val", "bits_per_value", lambda v: f"{v:.2f}"),
    ("density", "density", lambda v: f"{v:.3f}"),
    ("zero chunks", "zero_chunk_fraction", lambda v: f"{v:.0%}"),
    ("NaN", "nan_count", str),
    ("Inf", "inf_count", str),
    ("L2 norm", "l2_norm", lambda v: f"{v:.4g}"),
    ("max |x|", "max_abs", lambda v: f"{v:.4g}"),
    ("depth", "chain_depth", str),
    ("encoding", "encoding", str),
    ("codec", "codec", str),
)


def _table(ds: xr.Dataset, rows: Sequence[dict[str, Any]], totals: dict[str, Any], key: str) -> str:
    cells = int(ds["present"].sum())
    what = {"run": "dumps", "aggregate": "steps", "snapshot": "versions"}[ds.attrs["kind"]]
    if ds.attrs["kind"] == "snapshot":
        head = f"snapshot {printable(ds.attrs['snapshot'])}"
    elif "aggregate" in ds.attrs:
        head = f"aggregate {printable(ds.attrs['aggregate'])} of run {printable(ds.attrs['run'])}"
    else:
        head = f"run {printable(ds.attrs['run'])}"
    lines = [f"{head}: {cells} {what}, {ds.sizes['tensor']} tensors"]
    header = [key, *(title for title, _, _ in _COLUMNS)]
    body = [[_cell(row.get(key, "")), *_values(row)] for row in rows]
    if totals:
        body.append(["total", *_values(totals)])
    left = {0, len(header) - 1, len(header) - 2}  # the key, encoding and codec columns
    table = [[str(v) for v in row] for row in (header, *body)]
    lines += aligned_lines(table, right=set(range(len(header))) - left)
    lines.append(
        "stored MiB count a block several tensors share once, for the first (step, peer, "
        "tensor) that uses it"
    )
    return "\n".join(lines)


def _values(row: dict[str, Any]) -> Iterable[str]:
    for _, field, show in _COLUMNS:
        value = row.get(field)
        yield "-" if value is None or value == "" else show(value)


def _cell(value: object) -> str:
    # A tensor name of a thousand characters, or one with a bidi control, would
    # stretch or scramble every row; the JSON and CSV outputs keep it exact.
    return printable_text(str(value), limit=NAME_LIMIT)
