"""One tensor of many dumps (or aggregates, or snapshots) as one lazy array for xarray.

:class:`TensorStack` stacks the tensor manifests of one tensor name over the
*lead* axes of a dataset (``(step, peer)`` of a run, ``(step,)`` of an
aggregate, ``(version,)`` of a snapshot chain): an array of shape
``lead + tensor shape``. It holds manifests only, resolved when the dataset
was opened, so what it reads is fixed by content ids and its dask token says
so. Indexing it reads exactly the chunks the selection touches
(:func:`gradpipe.core.chunk_select.select_chunks`), all of them in one
batched pass through the store's read path
(:func:`gradpipe.storage.reads.decode_windows`: windows of concurrent fetches,
decodes on a thread pool, inline frames and delta chains included), so there
is one decoder in gradpipe, not two.

Where the lead position has no tensor (a (step, peer) without a dump, a dump
without that tensor) the result holds the fill value: NaN for floats, 0 for
integers, False for bools. A chunk stored as all-zero reads as zeros.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import numpy as np
from xarray.backends import BackendArray
from xarray.core import indexing

from gradpipe.core.chunk_select import (
    ChunkPart,
    Index,
    contiguous_run,
    select_chunks,
    selected_length,
)
from gradpipe.core.display import printable
from gradpipe.core.dtypes import is_float, parse_dtype
from gradpipe.core.tensor_manifest import (
    TensorManifest,
    TensorRef,
    require_self_contained,
    resolve_tensor,
)
from gradpipe.errors import IntegrityError
from gradpipe.storage.reads import ChunkRead, decode_windows

if TYPE_CHECKING:
    from gradpipe.storage.store import Store

__all__ = ["TensorStack", "fill_value"]


def fill_value(dtype: str) -> Any:
    """What a missing tensor reads as: NaN for floats, 0 for integers, False for bools."""
    if is_float(parse_dtype(dtype)):
        return np.nan
    return False if dtype == "bool" else 0


class TensorStack(BackendArray):
    """A lazily read array of shape ``lead + shape`` over a grid of tensor manifests.

    Parameters
    ----------
    store : Store
        Where the chunks are.
    manifests : sequence of TensorManifest, TensorRef or None
        One per lead position, in C order of the lead axes; None where there
        is no tensor (it reads as the fill value). A ``TensorRef`` (a tensor
        kept in its dump's manifest, not decoded yet) is decoded on the first
        read that touches it.
    lead : tuple of int
        The shape of the lead axes.
    dtype, shape : str, tuple of int
        The tensor's dtype and shape (every manifest given has them).
    labels : sequence of str
        Per lead position, how an error names it ("run 'r', step 3, peer 'a'").
    name : str
        The tensor name, for errors.
    token : str
        What identifies the content: the id of the manifest the positions were
        read from (a run, a snapshot) and anything else that picks them.
    """

    def __init__(
        self,
        store: Store,
        manifests: Sequence[TensorManifest | TensorRef | ReplayedTensor | None],
        *,
        lead: tuple[int, ...],
        dtype: str,
        shape: tuple[int, ...],
        labels: Sequence[str],
        name: str,
        token: str,
    ) -> None:
        if len(manifests) != math.prod(lead) or len(labels) != len(manifests):
            raise ValueError(f"{len(manifests)} manifests for lead axes {lead}")
        self.store = store
        self.manifests = list(manifests)
        self.lead = lead
        self.tensor_dtype = dtype
        self.tensor_shape = shape
        self.labels = list(labels)
        self.name = name
        self.token = token
        self.shape = (*lead, *shape)
        self.dtype = parse_dtype(dtype)

    def __dask_tokenize__(self) -> object:
        # The content ids fix every byte this array can give; the store URL says
        # where they are read from, the rest what the positions are.
        return ("gradpipe.TensorStack", self.store.url, self.token, self.name, self.shape)

    def __reduce__(self) -> tuple[Any, ...]:
        # The store travels as its URL and options (a worker opens its own,
        # read-only: the same bytes whatever handle this one came from, so the
        # token xarray takes of a pickle depends on the content only); the
        # manifests travel with the array: no worker reads a manifest again.
        fields = {
            "manifests": self.manifests,
            "lead": self.lead,
            "dtype": self.tensor_dtype,
            "shape": self.tensor_shape,
            "labels": self.labels,
            "name": self.name,
            "token": self.token,
        }
        return (_rebuild, (self.store.url, self.store.storage_options, fields))

    def __getitem__(self, key: indexing.ExplicitIndexer) -> np.ndarray:
        return indexing.explicit_indexing_adapter(  # type: ignore[no-any-return]
            key, self.shape, indexing.IndexingSupport.OUTER, self._read
        )

    def _read(self, key: tuple[Any, ...]) -> np.ndarray:
        """The outer selection ``key`` (ints, slices, 1-D integer arrays), read."""
        nlead = len(self.lead)
        # Lead axes as index arrays (a few steps and peers); tensor axes keep a
        # step-1 slice as it is, which select_chunks cuts without an index array.
        picks: list[Index] = [
            _positions(k, n) if axis < nlead else _tensor_positions(k, n)
            for axis, (k, n) in enumerate(zip(key, self.shape, strict=True))
        ]
        dropped = tuple(i for i, k in enumerate(key) if isinstance(k, int | np.integer))
        # Every selected element of a position with a tensor is written by one
        # of its chunk parts (zeros for an all-zero chunk): only positions
        # without one are filled, so the output is not written twice.
        out = np.empty([selected_length(p) for p in picks], dtype=self.dtype)
        fill = fill_value(self.tensor_dtype)
        tensor_out = out.shape[nlead:]
        reads: list[ChunkRead] = []
        places: list[tuple[np.ndarray, ChunkPart, np.ndarray | None]] = []
        parts_by_grid: dict[tuple[int, ...], list[ChunkPart]] = {}
        for out_lead, lead in _lead_positions(cast(list[np.ndarray], picks[:nlead])):
            position = int(np.ravel_multi_index(lead, self.lead)) if nlead else 0
            cell, label = self.manifests[position], self.labels[position]
            # A C-contiguous view (0-d for a scalar tensor): the lead axes come first.
            index: tuple[Any, ...] = (*out_lead, Ellipsis)
            target = out[index]
            if cell is None:
                target[...] = fill
                continue
            if isinstance(cell, ReplayedTensor):
                target[...] = _outer(cell.read(self.store), picks[nlead:])
                continue
            try:
                manifest = resolve_tensor(cell)  # decoded on the first read that needs it
            except IntegrityError as exc:
                raise IntegrityError(f"tensor {printable(self.name)} of {label}: {exc}") from None
            require_self_contained(manifest, f"tensor {printable(self.name)} of {label}")
            parts = parts_by_grid.get(manifest.chunk_shape)
            if parts is None:
                parts = select_chunks(self.tensor_shape, manifest.chunk_shape, picks[nlead:])
                parts_by_grid[manifest.chunk_shape] = parts
            for part in parts:
                block = manifest.blocks[part.chunk]
                if block is None:  # an all-zero chunk takes no block
                    target[_box(part.out)] = 0
                    continue
                run = contiguous_run(part.out, tensor_out) if part.whole else None
                if run is not None:  # the chunk is a contiguous run of the result: decode in place
                    buffer, staged = target.reshape(-1)[run[0] : run[1]], None
                else:
                    staged = np.empty(part.chunk_shape, dtype=self.dtype)
                    buffer = staged.reshape(-1)
                reads.append(
                    ChunkRead(
                        block,
                        buffer,
                        f"tensor {printable(self.name)} of {label}, chunk {part.chunk}",
                        manifest.inline.get(part.chunk),
                        manifest.deltas.get(part.chunk, ()),
                    )
                )
                places.append((target, part, staged))
        placed = 0
        for done in decode_windows(self.store, reads):
            # Copy each decoded chunk out as soon as its window is done, so at
            # most two windows of staged chunks are held at any time.
            for target, part, staged in places[placed:done]:
                if staged is not None:
                    _place(target, part, staged)
            for i in range(placed, done):
                places[i] = (places[i][0], places[i][1], None)
            placed = done
        return out.squeeze(axis=dropped) if dropped else out


@dataclass(frozen=True)
class ReplayedTensor:
    """A snapshot's array stored with optimizer replay: read whole, through its snapshot.

    Its chunks replay the versions before it (design note 016), so it is read as
    ``gp.restore`` reads it, then the selection is taken.
    """

    snapshot_id: str
    key: str
    dtype: str
    shape: tuple[int, ...]
    chunk_shape: tuple[int, ...]  # as stored (the dask chunks xarray prefers)

    def read(self, store: Store) -> np.ndarray:
        return _read_replayed(store, self.snapshot_id, self.key)


@functools.lru_cache(maxsize=4)  # the last few arrays: selections of one array read it once
def _read_replayed(store: Store, snapshot_id: str, key: str) -> np.ndarray:
    from gradpipe.core.snapshot_manifest import SnapshotManifest
    from gradpipe.snapshots.restore import read_arrays

    manifest = store.get_typed(snapshot_id, SnapshotManifest, context="snapshot")
    values = read_arrays(store, snapshot_id, manifest, [key])[key]
    values.flags.writeable = False  # shared by the cache
    return values


def _outer(values: np.ndarray, picks: Sequence[Index]) -> np.ndarray:
    """``values`` at the outer selection ``picks`` (one slice or index array per axis)."""
    for axis, pick in enumerate(picks):
        if isinstance(pick, slice):
            values = values[(slice(None),) * axis + (pick,)]
        else:
            values = np.take(values, pick, axis=axis)
    return values


def _rebuild(url: str, storage_options: dict[str, Any], fields: dict[str, Any]) -> TensorStack:
    from gradpipe.storage.store import reopen_store

    return TensorStack(reopen_store(url, "r", storage_options), **fields)


def _positions(key: Any, n: int) -> np.ndarray:
    """One axis of an outer indexer as the array of indices it picks."""
    if isinstance(key, slice):
        return np.arange(n, dtype=np.intp)[key]
    picked = np.atleast_1d(np.asarray(key, dtype=np.intp))
    return np.where(picked < 0, picked + n, picked)


def _tensor_positions(key: Any, n: int) -> Index:
    """One tensor axis of an outer indexer: a step-1 slice in range, else an index array."""
    if isinstance(key, slice):
        start, stop, step = key.indices(n)
        if step == 1:
            return slice(start, max(start, stop))
    return _positions(key, n)


def _lead_positions(
    picks: Sequence[np.ndarray],
) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """``(position in the result, position in the stack)`` of every selected lead cell."""
    if not picks:
        return [((), ())]
    grids = np.meshgrid(*[np.arange(len(p)) for p in picks], indexing="ij")
    out_positions = np.stack([g.reshape(-1) for g in grids], axis=-1)
    return [
        (
            tuple(int(i) for i in row),
            tuple(int(p[i]) for p, i in zip(picks, row, strict=True)),
        )
        for row in out_positions
    ]


def _box(selection: Sequence[slice | np.ndarray]) -> tuple[Any, ...]:
    """A part's selection as a numpy index: basic if every axis is a slice, else ``np.ix_``."""
    if all(isinstance(s, slice) for s in selection):
        return tuple(selection)
    return np.ix_(*[_as_array(s) for s in selection])


def _as_array(selection: slice | np.ndarray) -> np.ndarray:
    if isinstance(selection, slice):
        return np.arange(selection.start, selection.stop, dtype=np.intp)
    return selection


def _place(target: np.ndarray, part: ChunkPart, chunk: np.ndarray) -> None:
    target[_box(part.out)] = chunk[_box(part.local)]
