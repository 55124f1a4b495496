"""The datasets of a store's objects: a run, one aggregate name of a run, a snapshot chain.

Each builder reads manifests only (in batches where their ids are known up
front) and returns an :class:`xarray.Dataset` whose tensor variables are
:class:`~gradpipe.xarray.array.TensorStack` arrays behind xarray's
``LazilyIndexedArray``: nothing is read until a value is asked for.

- a **run**: dims ``(step, peer, <tensor>_dim0, ...)``; coordinates ``step``,
  ``peer``, ``dump_id`` and ``source`` (the dump's file), and every metadata
  key of the dumps (``num_examples``...), all on ``(step, peer)``; a boolean
  variable ``present`` (is there a dump).
- an **aggregate** name of a run: dims ``(step, ...)``; coordinates ``step``,
  ``aggregate_id``, ``method``, ``stale`` (why its inputs changed, or ""),
  each scalar parameter as ``param_<key>``, and ``weight`` on ``(step, peer)``
  (NaN where a peer was not an input).
- a **snapshot** chain: dims ``(version, ...)``, oldest first; coordinates
  ``version``, and on ``version`` ``step``, ``time``, ``loss``,
  ``snapshot_id`` and every metadata key.

Tensor names, array keys and metadata keys are shown as
:mod:`gradpipe.xarray.view_names` says: reversibly escaped where they would
clash, each tensor variable with its name in ``attrs["tensor"]``.

Metadata (strings in a dump) becomes a typed coordinate: int64 where every
value is an integer (float64 with NaN when some position has none), float64
where every value is a number, else strings ("" where missing).
"""

from __future__ import annotations

import json
import re
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any, Final

import numpy as np
import xarray as xr
from xarray.core import indexing

from gradpipe._version import __version__
from gradpipe.core.aggregate_manifest import AggregateManifest, stale_reason
from gradpipe.core.display import printable, printable_names
from gradpipe.core.gc_pause import gc_paused
from gradpipe.core.run_manifest import DumpManifest
from gradpipe.core.snapshot_manifest import SnapshotManifest
from gradpipe.core.tensor_manifest import (
    TensorManifest,
    TensorRef,
    embedded_tensor,
    resolve_tensor,
)
from gradpipe.errors import NotFoundError
from gradpipe.storage.catalog import read_many
from gradpipe.xarray.array import ReplayedTensor, TensorStack
from gradpipe.xarray.view_names import coordinate_name, dim_name, variable_name

if TYPE_CHECKING:
    from gradpipe.runs import Run
    from gradpipe.storage.store import Store

__all__ = ["aggregate_dataset", "run_dataset", "snapshot_dataset"]

#: Names a tensor of a run or an aggregate is not shown as: their coordinates and
#: dimensions. One set for both, so a tensor has one name in a run and its aggregates.
RUN_RESERVED: Final = frozenset(
    {"step", "peer", "present", "dump_id", "source", "aggregate_id", "method", "stale", "weight"}
)
#: Names an array key of a snapshot chain is not shown as.
SNAPSHOT_RESERVED: Final = frozenset({"version", "step", "time", "loss", "snapshot_id"})

_INT = re.compile(r"[+-]?[0-9]+")
_FLOAT = re.compile(r"[+-]?([0-9]+\.?[0-9]*([eE][+-]?[0-9]+)?|\.[0-9]+([eE][+-]?[0-9]+)?|nan|inf)")


@gc_paused
def run_dataset(store: Store, run: Run, *, drop: Iterable[str] = ()) -> xr.Dataset:
    """The dataset of a run: one variable per tensor name over ``(step, peer)``."""
    steps, peers = run.steps, run.peers
    entries = list(run)
    dumps = read_many(
        store, [e.dump for e in entries], DumpManifest, context=f"run {printable(run.name)}"
    )
    where = {(e.step, e.peer): i for i, e in enumerate(entries)}
    positions = [where.get((s, p)) for s in steps for p in peers]
    cells = [None if i is None else dumps[i] for i in positions]
    shown, shown_peers = printable(run.name), [printable(p) for p in peers]
    labels = [f"run {shown}, step {s}, peer {p}" for s in steps for p in shown_peers]
    lead = (len(steps), len(peers))
    dims = ("step", "peer")
    coords: dict[str, xr.Variable] = {
        "step": xr.Variable("step", np.array(steps, dtype=np.int64)),
        "peer": xr.Variable("peer", np.array(peers, dtype=object)),
        "dump_id": xr.Variable(
            dims, _strings([None if i is None else entries[i].dump for i in positions], lead)
        ),
        "source": xr.Variable(
            dims, _strings([None if d is None else d.source.get("path") for d in cells], lead)
        ),
    }
    present = xr.Variable(dims, np.array([d is not None for d in cells]).reshape(lead))
    variables = _tensor_variables(
        store,
        cells,
        order=_names(run.schema, cells),
        lead=lead,
        dims=dims,
        labels=labels,
        token=f"run {run.id}",
        drop=set(drop),
    )
    taken = {*_names_of(variables), *coords, "present"}
    coords |= _record_coords(
        [None if d is None else d.metadata for d in cells], dims, lead, taken, drop=set(drop)
    )
    attrs = _attrs("run", store, run=run.name, run_id=run.id)
    data = {**variables, **({} if "present" in set(drop) else {"present": present})}
    return xr.Dataset(data, coords=_without(coords, drop), attrs=attrs)


@gc_paused
def aggregate_dataset(store: Store, run: Run, name: str, *, drop: Iterable[str] = ()) -> xr.Dataset:
    """The dataset of aggregate ``name`` of a run: one variable per tensor over ``(step,)``."""
    entries = [a for a in run.aggregates if a.name == name]
    if not entries:
        known = sorted({a.name for a in run.aggregates})
        raise NotFoundError(
            f"run {printable(run.name)} has no aggregate {printable(name)} (aggregates: "
            f"{printable_names(known) or 'none'}); compute it with gradpipe aggregate"
        )
    found = read_many(
        store,
        [a.aggregate for a in entries],
        AggregateManifest,
        context=f"run {printable(run.name)} aggregate {printable(name)}",
    )
    steps = [a.step for a in entries]
    lead = (len(steps),)
    peers = sorted({i.peer for m in found for i in m.inputs})
    weights = np.full((len(steps), len(peers)), np.nan)
    for row, manifest in enumerate(found):
        for item in manifest.inputs:
            weights[row, peers.index(item.peer)] = item.weight
    coords: dict[str, xr.Variable] = {
        "step": xr.Variable("step", np.array(steps, dtype=np.int64)),
        "peer": xr.Variable("peer", np.array(peers, dtype=object)),
        "aggregate_id": xr.Variable("step", _strings([a.aggregate for a in entries], lead)),
        "method": xr.Variable("step", _strings([m.method for m in found], lead)),
        "stale": xr.Variable(
            "step", _strings([stale_reason(run.manifest, m) or "" for m in found], lead)
        ),
        "weight": xr.Variable(("step", "peer"), weights),
    }
    head = f"aggregate {printable(name)} of run {printable(run.name)}"
    variables = _tensor_variables(
        store,
        found,
        order=_names(run.schema, found),
        lead=lead,
        dims=("step",),
        labels=[f"{head}, step {s}" for s in steps],
        token=f"run {run.id} aggregate {name}",
        drop=set(drop),
    )
    params = [{f"param_{k}": v for k, v in m.params.items()} for m in found]
    taken = {*_names_of(variables), *coords}
    coords |= _record_coords(params, ("step",), lead, taken, drop=set(drop))
    attrs = _attrs("aggregate", store, run=run.name, run_id=run.id, name=name)
    return xr.Dataset(variables, coords=_without(coords, drop), attrs=attrs)


@gc_paused
def snapshot_dataset(
    store: Store,
    name: str,
    versions: Sequence[tuple[str, SnapshotManifest]],
    *,
    drop: Iterable[str] = (),
) -> xr.Dataset:
    """The dataset of a snapshot chain (``versions`` oldest first), over ``(version,)``.

    An array key whose dtype or shape changed along the chain takes the
    newest version's; the versions where it differs read as the fill value,
    and the variable's ``other_shape_versions`` attribute lists them.
    """
    lead = (len(versions),)
    manifests = [m for _, m in versions]
    schema: dict[str, tuple[str, tuple[int, ...]]] = {}
    for manifest in reversed(manifests):  # newest first: the newest schema wins
        for key in manifest.tensors:
            if key not in schema:
                newest = _snapshot_tensor(store, manifest, key)
                schema[key] = (newest.dtype, newest.shape)
    order = list(dict.fromkeys(k for m in manifests for k in m.tensors))
    coords: dict[str, xr.Variable] = {
        "version": xr.Variable("version", np.arange(len(versions), dtype=np.int64)),
        "step": xr.Variable("version", np.array([m.step for m in manifests], dtype=np.int64)),
        "time": xr.Variable("version", np.array([_time(m.time) for m in manifests])),
        "loss": xr.Variable(
            "version", np.array([np.nan if m.loss is None else m.loss for m in manifests])
        ),
        "snapshot_id": xr.Variable("version", _strings([i for i, _ in versions], lead)),
    }
    drops = set(drop)
    variables: dict[str, xr.Variable] = {}
    for key in order:
        shown = variable_name(key, SNAPSHOT_RESERVED)
        if key in drops or shown in drops:
            continue
        dtype, shape = schema[key]
        cells: list[TensorManifest | TensorRef | ReplayedTensor | None] = []
        other: list[int] = []
        for version, manifest in enumerate(manifests):
            tensor: TensorManifest | TensorRef | ReplayedTensor | None = None
            if key in manifest.tensors:
                tensor = _snapshot_tensor(store, manifest, key)
                if manifest.needs_previous and (found := resolve_tensor(tensor)).replays:
                    # Read whole (its chunks replay through the versions before): one dask
                    # chunk, so a computation asks for it once.
                    tensor = ReplayedTensor(
                        versions[version][0], key, found.dtype, found.shape, found.shape
                    )
            if tensor is not None and (tensor.dtype, tensor.shape) != (dtype, shape):
                other.append(version)
                tensor = None
            cells.append(tensor)
        labels = [f"snapshot {printable(name)} at step {m.step}" for m in manifests]
        variables[shown] = _stack(
            store,
            key,
            shown,
            cells,
            lead=lead,
            dims=("version",),
            dtype=dtype,
            shape=shape,
            labels=labels,
            token=f"snapshot {versions[-1][0] if versions else ''}",
            extra={"other_shape_versions": other} if other else {},
        )
    taken = {*_names_of(variables), *coords}
    coords |= _record_coords([m.metadata for m in manifests], ("version",), lead, taken, drop=drops)
    head = versions[-1][0] if versions else ""
    attrs = _attrs("snapshot", store, name=name, snapshot_id=head)
    return xr.Dataset(variables, coords=_without(coords, drop), attrs=attrs)


# --- tensors ----------------------------------------------------------------------
def _tensor_variables(
    store: Store,
    cells: Sequence[DumpManifest | AggregateManifest | None],
    *,
    order: Sequence[str],
    lead: tuple[int, ...],
    dims: tuple[str, ...],
    labels: Sequence[str],
    token: str,
    drop: set[str],
) -> dict[str, xr.Variable]:
    """One variable per tensor name of a grid of tensor sets (dumps or aggregates).

    A variable's name is the tensor's shown name (:func:`variable_name`): ``drop``
    may give either.
    """
    out: dict[str, xr.Variable] = {}
    for name in order:
        shown = variable_name(name, RUN_RESERVED)
        if name in drop or shown in drop:
            continue
        grid = [None if c is None else _tensor_of(store, c, name) for c in cells]
        first = next((m for m in grid if m is not None), None)
        if first is None:
            continue
        out[shown] = _stack(
            store,
            name,
            shown,
            grid,
            lead=lead,
            dims=dims,
            dtype=first.dtype,
            shape=first.shape,
            labels=labels,
            token=token,
        )
    return out


def _stack(
    store: Store,
    name: str,
    shown: str,
    grid: Sequence[TensorManifest | TensorRef | ReplayedTensor | None],
    *,
    lead: tuple[int, ...],
    dims: tuple[str, ...],
    dtype: str,
    shape: tuple[int, ...],
    labels: Sequence[str],
    token: str,
    extra: Mapping[str, Any] | None = None,
) -> xr.Variable:
    """A lazily indexed variable of tensor ``name`` (shown as ``shown``), chunked as stored."""
    array = TensorStack(
        store, grid, lead=lead, dtype=dtype, shape=shape, labels=labels, name=name, token=token
    )
    tensor_dims = tuple(dim_name(shown, i) for i in range(len(shape)))
    # The chunk grid most of the stored tensors have (all of them, unless
    # chunk-bytes changed between ingests): one dask block per stored chunk.
    shapes = [m.chunk_shape for m in grid if m is not None]
    if shapes and shapes.count(shapes[0]) == len(shapes):
        chunk_shape = shapes[0]
    else:
        grids = Counter(shapes)
        chunk_shape = grids.most_common(1)[0][0] if grids else shape
    preferred = dict.fromkeys(dims, 1)
    preferred |= {d: c for d, c, n in zip(tensor_dims, chunk_shape, shape, strict=True) if n}
    attrs = {"tensor": name, "dtype": dtype, "chunk_shape": list(chunk_shape), **(extra or {})}
    variable = xr.Variable((*dims, *tensor_dims), indexing.LazilyIndexedArray(array), attrs=attrs)
    variable.encoding = {"preferred_chunks": preferred}
    return variable


def _tensor_of(
    store: Store, tensors: DumpManifest | AggregateManifest, name: str
) -> TensorManifest | TensorRef | None:
    """The manifest of tensor ``name`` in a dump or aggregate, decoded when first read
    (None if it has none)."""
    tensor_id = tensors.tensor_ids.get(name)
    if tensor_id is None:
        return None
    embedded = embedded_tensor(tensors.embedded, tensor_id)
    if embedded is not None:
        return embedded
    # Written by an older gradpipe (format 1): the tensor is a manifest of its own.
    return store.get_typed(tensor_id, TensorManifest, context=f"tensor {printable(name)}")


def _snapshot_tensor(
    store: Store, manifest: SnapshotManifest, key: str
) -> TensorManifest | TensorRef:
    tensor_id = manifest.tensors[key]
    found = embedded_tensor(manifest.embedded, tensor_id)
    if found is not None:
        return found
    where = f"snapshot {printable(manifest.name)} at step {manifest.step}, {printable(key)}"
    return store.get_typed(tensor_id, TensorManifest, context=where)


def _names(
    schema: Mapping[str, Any], cells: Sequence[DumpManifest | AggregateManifest | None]
) -> list[str]:
    """Tensor names in the order the first dump lists them, then the rest of the schema."""
    first = next((c for c in cells if c is not None), None)
    listed = [] if first is None else [n for n, _ in first.tensors]
    seen = {n for c in cells if c is not None for n in c.tensor_ids}
    return list(dict.fromkeys([*listed, *sorted(n for n in schema if n in seen)]))


# --- coordinates ------------------------------------------------------------------
def _record_coords(
    records: Sequence[Mapping[str, Any] | None],
    dims: tuple[str, ...],
    lead: tuple[int, ...],
    taken: set[str],
    *,
    drop: set[str],
) -> dict[str, xr.Variable]:
    """One coordinate per key of ``records`` (metadata, parameters), typed (module doc)."""
    keys = list(dict.fromkeys(k for r in records if r is not None for k in r))
    out: dict[str, xr.Variable] = {}
    for key in keys:
        values = [None if r is None else r.get(key) for r in records]
        name = coordinate_name(key, taken)
        if key in drop or name in drop:
            continue
        taken.add(name)
        # A renamed or escaped key keeps its own name beside it.
        attrs = {} if name == key else {"key": key}
        out[name] = xr.Variable(dims, _column(values).reshape(lead), attrs=attrs)
    return out


def _column(values: Sequence[Any]) -> np.ndarray:
    """Values of one key, typed: ints, floats, bools or strings (see the module doc)."""
    present = [v for v in values if v is not None]
    numbers = [_number(v) for v in present]
    if present and all(n is not None for n in numbers):
        if all(isinstance(n, int) for n in numbers) and len(present) == len(values):
            return np.array([_number(v) for v in values], dtype=np.int64)
        return np.array([np.nan if v is None else _number(v) for v in values], dtype=np.float64)
    if present and all(isinstance(v, bool) for v in present) and len(present) == len(values):
        return np.array(values, dtype=bool)
    return np.array([_text(v) for v in values], dtype=object)


def _number(value: Any) -> int | float | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, int | float):
        return value
    if isinstance(value, str):
        if _INT.fullmatch(value):
            return int(value)
        if _FLOAT.fullmatch(value.lower()):
            return float(value)
    return None


def _text(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    return json.dumps(value, sort_keys=True)


def _strings(values: Sequence[str | None], lead: tuple[int, ...]) -> np.ndarray:
    return np.array([v or "" for v in values], dtype=object).reshape(lead)


def _time(text: str) -> np.datetime64:
    """An ISO time as a UTC ``datetime64[us]`` (NaT if it does not parse)."""
    try:
        parsed = datetime.fromisoformat(text)
    except ValueError:
        return np.datetime64("NaT", "us")
    if parsed.tzinfo is not None:
        parsed = parsed.astimezone(UTC).replace(tzinfo=None)
    return np.datetime64(parsed, "us")


def _names_of(variables: Mapping[str, xr.Variable]) -> set[str]:
    """The variables' names and dimensions: what a coordinate may not be called."""
    return {*variables, *(str(d) for v in variables.values() for d in v.dims)}


def _without(coords: dict[str, xr.Variable], drop: Iterable[str]) -> dict[str, xr.Variable]:
    dims = {d for v in coords.values() for d in v.dims}
    gone = set(drop) - dims  # a dimension coordinate stays: the variables need it
    return {k: v for k, v in coords.items() if k not in gone}


def _attrs(kind: str, store: Store, **fields: str) -> dict[str, str]:
    """Dataset attributes: what this is and where it came from."""
    return {"kind": kind, "store": store.url, **fields, "gradpipe_version": __version__}
