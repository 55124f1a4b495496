"""Compression statistics of a run, its aggregates or a snapshot chain, as an xarray Dataset.

>>> ds = gp.compression_stats(store, run="train")               # doctest: +SKIP
>>> ds.ratio.sel(tensor="embed.weight").plot()                  # doctest: +SKIP
>>> gp.summarize_stats(ds, by="step")[["stored_bytes", "ratio"]]  # doctest: +SKIP

Nothing here reads a chunk. The manifests of the dumps (or aggregates, or
snapshot versions) hold each chunk's block id and value statistics; the stored
size of every block comes from one listing of the store's ``blocks/``; the
figures are computed in :mod:`gradpipe.statistics.tensor_stats`. A run of 2,000
dumps costs 2,000 manifest reads and one listing, whatever its size in bytes.

Cells that hold nothing (a peer that sent no dump at a step, a tensor a dump
lacks) are NaN in every numeric variable, ``""`` in the text ones and False in
``lossy``; ``present`` says which dumps exist. Counts are float64 so that they
can be NaN. Summing a variable of :data:`~gradpipe.statistics.tensor_stats.ADDITIVE`
over any dims gives the figure of the whole (pass ``min_count=1`` to keep an
all-missing cell NaN); ratios, densities and norms must be recomputed from
those sums, which :func:`summarize_stats` does.
"""

from __future__ import annotations

import csv
import io
import math
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from operator import attrgetter
from typing import TYPE_CHECKING, Any, Final

import numpy as np
import xarray as xr

from gradpipe.codecs.delta import DeltaCodec
from gradpipe.codecs.policy import policy_codec_id
from gradpipe.core.aggregate_manifest import AggregateManifest
from gradpipe.core.display import printable
from gradpipe.core.gc_pause import gc_paused
from gradpipe.core.ids import id_from_block_key
from gradpipe.core.names import parse_name
from gradpipe.core.run_manifest import DumpManifest
from gradpipe.core.tensor_manifest import TensorManifest, resolve_tensor
from gradpipe.errors import InvalidInputError, NotFoundError
from gradpipe.statistics.tensor_stats import (
    ADDITIVE,
    MAXIMA,
    RECORD_FIELDS,
    STORED_FIELDS,
    BlockLedger,
    TensorStats,
    derived_fields,
    tensor_stats,
)
from gradpipe.storage.blocks import frame_codec_ids
from gradpipe.storage.catalog import named_tensors, read_many, read_run

if TYPE_CHECKING:
    from gradpipe.storage.store import Store

__all__ = [
    "ATTRIBUTION",
    "CODEC_SOURCE",
    "chunk_codecs",
    "compression_stats",
    "records_csv",
    "stats_records",
    "summarize_stats",
]

#: How ``stored_bytes`` attributes a block that several tensors share (``ds.attrs``).
ATTRIBUTION: Final = (
    "first: a block's bytes count for the first (step, peer, tensor) of this Dataset "
    "that references it, in the Dataset's order (steps ascending, then peers, then tensors, "
    "by name); later references count in referenced_bytes only, so stored_bytes summed over "
    "any dims counts every block once. Inline chunks (kept inside their manifest) count for "
    "their own tensor."
)
#: Where ``codec`` comes from (``ds.attrs``).
CODEC_SOURCE: Final = (
    "inline chunks: the codec chain in their frame header (kept in the manifest); delta "
    "chunks: gradpipe_delta and its kind; other chunks: the lossless policy's choice for "
    "their recorded non-zero count. A chunk written with a fixed codec chain (ingest --codec) "
    "records it only in its block header, which statistics do not read."
)

_INTEGER_FIELDS: Final = frozenset(
    {
        "numel",
        "raw_bytes",
        "stored_bytes",
        "referenced_bytes",
        "chain_depth",
        "nan_count",
        "inf_count",
        "chunk_count",
        "zero_chunk_count",
        "inline_chunk_count",
        "delta_chunk_count",
        "nonzero_count",
        "missing_blocks",
    }
)
_TEXT_FIELDS: Final = ("encoding", "codec")
_DESCRIPTIONS: Final[dict[str, tuple[str, str]]] = {
    "raw_bytes": ("uncompressed bytes of the tensor", "bytes"),
    "stored_bytes": (
        "bytes of the blocks this tensor is first to reference (see attribution)",
        "bytes",
    ),
    "referenced_bytes": (
        "bytes of every block a read of this tensor fetches, shared or not",
        "bytes",
    ),
    "ratio": ("raw_bytes / stored_bytes (inf: took no bytes of its own)", "1"),
    "bits_per_value": ("8 * stored_bytes / numel", "bits"),
    "encoding": ("full: every stored chunk in full; delta: some chunks as deltas", ""),
    "chain_depth": ("longest delta chain of any chunk (blocks a read decodes, minus one)", "1"),
    "codec": ("codec ids of the chunks, sorted, comma-separated (see codec_source)", ""),
    "numel": ("elements", "1"),
    "density": ("fraction of elements that are not zero (NaN counts as not zero)", "1"),
    "zero_chunk_fraction": ("fraction of chunks that are all zero (they take no block)", "1"),
    "nan_count": ("NaN elements", "1"),
    "inf_count": ("infinite elements", "1"),
    "l2_norm": ("Euclidean norm of the finite elements", ""),
    "max_abs": ("largest absolute value, NaN ignored (inf if any element is infinite)", ""),
    "lossy": ("the stored values differ from those written (a lossy delta or codec)", ""),
    "max_abs_error": ("largest absolute error a lossy encoding left (0: bit-exact)", ""),
    "chunk_count": ("chunks of the tensor's grid", "1"),
    "zero_chunk_count": ("all-zero chunks", "1"),
    "inline_chunk_count": ("chunks kept inside the manifest", "1"),
    "delta_chunk_count": ("chunks stored as a delta", "1"),
    "nonzero_count": ("elements that are not zero", "1"),
    "sum_squares": ("sum of squares of the finite elements (l2_norm squared; additive)", ""),
    "missing_blocks": ("referenced blocks absent from the store (ratio unknown; run verify)", "1"),
}


@dataclass(frozen=True)
class _Cell:
    """One (step, peer) of a run, (step) of an aggregate or version of a snapshot."""

    index: tuple[int, ...]  # position along the Dataset's dims before ``tensor``
    manifest_id: str
    tensors: Mapping[str, TensorManifest]


@gc_paused
def compression_stats(
    store: Store,
    *,
    run: str | None = None,
    aggregate: str | None = None,
    snapshot: str | None = None,
) -> xr.Dataset:
    """Compression and value statistics of every stored tensor of a run, aggregate or snapshot.

    Reads manifests and one listing of the store's blocks; never a chunk.

    Parameters
    ----------
    store : Store
        The store (read-only is enough).
    run : str, optional
        A run: dims ``(step, peer, tensor)``, one cell per tensor of each dump.
    aggregate : str, optional
        With ``run``: the aggregate of that name at every step that has one;
        dims ``(step, tensor)``.
    snapshot : str, optional
        Instead of ``run``: every version of a snapshot chain, oldest first;
        dims ``(version, tensor)``, with the coordinate ``step(version)``.

    Returns
    -------
    xarray.Dataset
        The variables of :data:`gradpipe.statistics.tensor_stats.RECORD_FIELDS`
        (``raw_bytes``, ``stored_bytes``, ``ratio``, ``bits_per_value``,
        ``encoding``, ``chain_depth``, ``codec``, ``numel``, ``density``,
        ``zero_chunk_fraction``, ``nan_count``, ``inf_count``, ``l2_norm``,
        ``max_abs``, ...) and ``present``; ``attrs["attribution"]`` says how a
        block several tensors share is counted. Summaries and totals:
        :func:`summarize_stats`.

    Examples
    --------
    >>> ds = gp.compression_stats(store, run="train")                 # doctest: +SKIP
    >>> gp.summarize_stats(ds)["ratio"].item()  # the whole run      # doctest: +SKIP
    >>> gp.compression_stats(store, run="train", aggregate="fedavg")  # doctest: +SKIP
    >>> gp.compression_stats(store, snapshot="model")                 # doctest: +SKIP
    """
    if (run is None) == (snapshot is None):
        raise InvalidInputError("compression_stats needs run=NAME or snapshot=NAME (one of them)")
    if aggregate is not None and run is None:
        raise InvalidInputError("aggregate=NAME needs the run it belongs to: run=NAME")
    if run is not None and aggregate is not None:
        found = _aggregate_cells(store, run, aggregate)
    elif run is not None:
        found = _run_cells(store, run)
    else:
        found = _snapshot_cells(store, str(snapshot))
    return _assemble(store, *found)


# --- what to count ------------------------------------------------------------------
Coords = dict[str, Any]
Cells = tuple[tuple[str, ...], Coords, list[_Cell], dict[str, Any]]


def _run_cells(store: Store, run: str) -> Cells:
    run_id, manifest = read_run(store, run)
    steps, peers = manifest.steps, manifest.peers
    at_step = {s: i for i, s in enumerate(steps)}
    at_peer = {p: i for i, p in enumerate(peers)}
    entries = list(manifest.dumps)  # sorted by (step, peer)
    dumps = _read_many(store, [e.dump for e in entries], DumpManifest, f"run {printable(run)}")
    cells = [
        _Cell((at_step[e.step], at_peer[e.peer]), e.dump, tensors)
        for e, tensors in zip(entries, dumps, strict=True)
    ]
    coords = {"step": np.array(steps, np.int64), "peer": np.array(peers, dtype=object)}
    return ("step", "peer"), coords, cells, {"kind": "run", "run": run, "run_id": run_id or ""}


def _aggregate_cells(store: Store, run: str, name: str) -> Cells:
    parse_name(name, what="aggregate name")
    run_id, manifest = read_run(store, run)
    entries = [a for a in manifest.aggregates if a.name == name]
    if not entries:
        known = ", ".join(sorted({a.name for a in manifest.aggregates})) or "none"
        raise NotFoundError(
            f"run {printable(run)} has no aggregate {printable(name)} (aggregates: {known}); "
            "compute it with gradpipe aggregate"
        )
    found = _read_many(
        store, [a.aggregate for a in entries], AggregateManifest, f"aggregate {printable(name)}"
    )
    cells = [
        _Cell((i,), e.aggregate, tensors)
        for i, (e, tensors) in enumerate(zip(entries, found, strict=True))
    ]
    coords = {"step": np.array([e.step for e in entries], np.int64)}
    attrs = {"kind": "aggregate", "run": run, "run_id": run_id or "", "aggregate": name}
    return ("step",), coords, cells, attrs


def _snapshot_cells(store: Store, name: str) -> Cells:
    from gradpipe.snapshots.api import snapshot_versions

    versions = list(reversed(list(snapshot_versions(store, name))))  # oldest first
    cells = []
    for i, (snapshot_id, manifest) in enumerate(versions):
        tensors = _tensors_of(store, manifest.tensors.items(), manifest.embedded, name)
        cells.append(_Cell((i,), snapshot_id, tensors))
    coords = {
        "version": np.arange(len(versions), dtype=np.int64),
        "step": ("version", np.array([m.step for _, m in versions], np.int64)),
    }
    return ("version",), coords, cells, {"kind": "snapshot", "snapshot": name}


def _read_many(
    store: Store,
    ids: Sequence[str],
    cls: type[DumpManifest] | type[AggregateManifest],
    label: str,
) -> list[dict[str, TensorManifest]]:
    """The tensor manifests of each dump or aggregate, read in batched round trips."""
    out: list[dict[str, TensorManifest]] = []
    for manifest in read_many(store, ids, cls, context=label):
        where = f"{label}, step {manifest.step}"
        if isinstance(manifest, DumpManifest):
            where += f", peer {printable(manifest.peer)}"
        out.append(_tensors_of(store, manifest.tensors, manifest.embedded, where))
    return out


def _tensors_of(
    store: Store,
    tensors: Iterable[tuple[str, str]],
    embedded: Mapping[str, TensorManifest],
    where: str,
) -> dict[str, TensorManifest]:
    found = named_tensors(store, tensors, embedded, where=where)
    return {name: resolve_tensor(tensor) for name, tensor in found.items()}


# --- counting -----------------------------------------------------------------------
def _block_sizes(store: Store) -> dict[str, int]:
    """Block id → size of its stored object, from one listing of ``blocks/``."""
    sizes = {}
    for info in store.backend.list("blocks"):
        block_id = id_from_block_key(info.key)
        if block_id is not None:
            sizes[block_id] = info.size
    return sizes


def chunk_codecs(manifest: TensorManifest, *, where: str = "tensor") -> list[str | None]:
    """Each chunk's codec as the manifest tells it (see :data:`CODEC_SOURCE`); None: all zero."""
    out: list[str | None] = []
    for i, block in enumerate(manifest.blocks):
        frame = manifest.inline.get(i)
        links = manifest.deltas.get(i)
        if block is None:
            out.append(None)
        elif frame is not None:
            out.append("+".join(frame_codec_ids(frame, where=f"{where}, chunk {i}")) or "raw")
        elif links:
            out.append(f"{DeltaCodec.codec_id}:{links[0].kind}")
        elif i in manifest.replays:
            out.append(f"replay:{manifest.replays[i].kind}")
        else:
            stats = manifest.stats[i]
            out.append(policy_codec_id(stats.count, stats.nonzero))
    return out


def _assemble(
    store: Store,
    dims: tuple[str, ...],
    coords: Coords,
    cells: list[_Cell],
    attrs: dict[str, Any],
) -> xr.Dataset:
    names = sorted({name for cell in cells for name in cell.tensors})
    at_tensor = {name: i for i, name in enumerate(names)}
    sizes = _block_sizes(store)
    ledger = BlockLedger(sizes)
    positions: list[tuple[int, ...]] = []
    records: list[TensorStats] = []
    present = np.zeros(tuple(len(coords[d]) for d in dims), dtype=bool)
    # Cells in the Dataset's order, tensors by name: the order ATTRIBUTION promises.
    for cell in sorted(cells, key=lambda c: c.index):
        present[cell.index] = True
        for name in sorted(cell.tensors):
            manifest = cell.tensors[name]
            codecs = chunk_codecs(manifest, where=f"tensor {printable(name)}")
            records.append(tensor_stats(manifest, ledger, codecs))
            positions.append((*cell.index, at_tensor[name]))
    shape = (*present.shape, len(names))
    at = tuple(np.array(positions, dtype=np.int64).reshape(-1, len(shape)).T)
    row = attrgetter(*STORED_FIELDS)
    rows = [row(r) for r in records]
    columns = dict(zip(STORED_FIELDS, zip(*rows, strict=True), strict=True)) if rows else {}
    arrays: dict[str, np.ndarray] = {}
    for field in STORED_FIELDS:
        if field in _TEXT_FIELDS:
            values = np.full(shape, "", dtype=object)
        elif field == "lossy":
            values = np.zeros(shape, dtype=bool)
        else:
            values = np.full(shape, np.nan)
        values[at] = columns.get(field, ())
        arrays[field] = values
    arrays |= derived_fields(arrays)
    data_vars: dict[str, Any] = {}
    for field in RECORD_FIELDS:
        description, units = _DESCRIPTIONS[field]
        var_attrs = {"description": description} | ({"units": units} if units else {})
        data_vars[field] = ((*dims, "tensor"), arrays[field], var_attrs)
    data_vars["present"] = (dims, present, {"description": "a manifest exists for this cell"})
    ds = xr.Dataset(data_vars, coords={**coords, "tensor": np.array(names, dtype=object)})
    ds.attrs = {
        **attrs,
        "store": store.url,
        "attribution": ATTRIBUTION,
        "codec_source": CODEC_SOURCE,
        "additive": list(ADDITIVE),
        "maxima": list(MAXIMA),
        "blocks_counted": ledger.counted_blocks,
        "manifest_bytes": sum(sizes.get(cell.manifest_id, 0) for cell in cells),
        "store_blocks_bytes": sum(sizes.values()),
        "missing_blocks": sum(r.missing_blocks for r in records),
    }
    return ds


# --- summaries ----------------------------------------------------------------------
def summarize_stats(ds: xr.Dataset, by: str | Sequence[str] | None = None) -> xr.Dataset:
    """Statistics of groups of cells: per step, peer, tensor (or several), or of the whole.

    Additive fields are summed (a shared block counts once: see
    ``ds.attrs["attribution"]``), ``max_abs``, ``chain_depth`` and
    ``max_abs_error`` take the maximum, ``lossy`` is any, ``encoding`` and
    ``codec`` the distinct values; ``ratio``, ``bits_per_value``,
    ``density``, ``zero_chunk_fraction`` and ``l2_norm`` are recomputed from
    the sums (a ratio of sums, not a sum of ratios). ``referenced_bytes``,
    which is not additive, is left out.

    Parameters
    ----------
    ds : xarray.Dataset
        What :func:`compression_stats` returned.
    by : str or sequence of str, optional
        The dims to keep (``"tensor"``, ``["step", "peer"]``...); None: the
        totals (a Dataset of scalars).

    Examples
    --------
    >>> per_tensor = gp.summarize_stats(ds, by="tensor")         # doctest: +SKIP
    >>> totals = gp.summarize_stats(ds)                          # doctest: +SKIP
    >>> float(totals.stored_bytes) == float(ds.stored_bytes.sum())  # doctest: +SKIP
    True
    """
    keep = [by] if isinstance(by, str) else list(by or ())
    dims = [str(d) for d in ds["numel"].dims]
    unknown = [d for d in keep if d not in dims]
    if unknown:
        raise InvalidInputError(
            f"cannot summarize by {', '.join(unknown)}: these statistics have dims "
            f"{', '.join(dims)}"
        )
    over = [d for d in dims if d not in keep]
    sums = ds[list(ADDITIVE)].sum(over, min_count=1)
    template = sums["numel"]
    derived = derived_fields({k: sums[k].values for k in ADDITIVE})
    parts: dict[str, xr.DataArray] = {
        **{k: sums[k] for k in ADDITIVE},
        **{k: template.copy(data=v) for k, v in derived.items()},
        **{k: ds[k].max(over) for k in MAXIMA},
        "lossy": ds["lossy"].any(over),
        "encoding": _union(ds["encoding"], over),
        "codec": _union(ds["codec"], over),
    }
    out = xr.Dataset({k: parts[k] for k in RECORD_FIELDS if k in parts}, coords=sums.coords)
    for name in out.data_vars:
        out[name].attrs = dict(ds[name].attrs)
    out.attrs = {**ds.attrs, "summarized_over": over}
    return out


def _union(values: xr.DataArray, over: Sequence[str]) -> xr.DataArray:
    """The distinct comma-separated parts of text values over ``over``, sorted and joined."""
    keep = [d for d in values.dims if d not in over]
    arranged = values.transpose(*keep, *over).values
    head = arranged.shape[: len(keep)]
    rows = arranged.reshape(int(np.prod(head, dtype=np.int64)), -1)
    joined = []
    for row in rows:
        parts = {p for value in row for p in str(value).split(",") if p}
        if len(parts) > 1:
            parts.discard("none")  # "no stored chunk" says nothing beside a codec
        joined.append(",".join(sorted(parts)))
    coords = {d: values.coords[d] for d in keep}
    return xr.DataArray(np.array(joined, dtype=object).reshape(head), coords, keep)


# --- records ------------------------------------------------------------------------
def stats_records(ds: xr.Dataset) -> Iterator[dict[str, Any]]:
    """One record per cell that holds a tensor: its coordinates, then the fields it has.

    Works on what :func:`compression_stats` and :func:`summarize_stats`
    return alike (a summary of the whole gives one record). Fields follow
    :data:`~gradpipe.statistics.tensor_stats.RECORD_FIELDS`; counts are ints and a
    figure that does not exist (NaN) is None.
    """
    dims = [str(d) for d in ds["numel"].dims]
    fields = [f for f in RECORD_FIELDS if f in ds.data_vars]
    if not dims:
        if not np.isnan(ds["numel"].item()):
            yield {f: _plain(f, ds[f].item()) for f in fields}
        return
    where = np.nonzero(~np.isnan(ds["numel"].transpose(*dims).values))
    columns: dict[str, list[Any]] = {}
    for dim, index in zip(dims, where, strict=True):
        columns[dim] = ds[dim].values[index].tolist()
    for name, coord in ds.coords.items():  # e.g. step along a snapshot's versions
        if name not in dims and coord.dims and set(coord.dims) <= set(dims):
            spread = coord.broadcast_like(ds["numel"]).transpose(*dims).values
            columns[str(name)] = spread[where].tolist()
    for field in fields:
        picked = ds[field].transpose(*dims).values[where].tolist()
        columns[field] = [_plain(field, v) for v in picked]
    for i in range(len(where[0])):
        yield {key: column[i] for key, column in columns.items()}


def records_csv(rows: Sequence[Mapping[str, Any]]) -> str:
    """Records (:func:`stats_records`) as CSV text, a header first; missing figures empty."""
    if not rows:
        return ""
    out = io.StringIO()
    writer = csv.DictWriter(out, fieldnames=list(rows[0]), lineterminator="\n")
    writer.writeheader()
    writer.writerows({k: "" if v is None else v for k, v in row.items()} for row in rows)
    return out.getvalue()


def _plain(field: str, value: Any) -> Any:
    if isinstance(value, float):
        if math.isnan(value):  # a figure that does not exist
            return None
        if field in _INTEGER_FIELDS:
            return int(value)
    return value
