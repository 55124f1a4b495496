"""Stored tensors as lazy ``dask.array``s whose chunks are the stored chunks."""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING, Any

import numpy as np

from gradpipe.core.chain import DeltaLink
from gradpipe.core.chunking import dask_chunks
from gradpipe.core.dtypes import parse_dtype
from gradpipe.core.tensor_manifest import TensorManifest, require_self_contained
from gradpipe.storage.reads import ChunkRead, decode_chunks
from gradpipe.storage.store import Store

if TYPE_CHECKING:
    from dask.array import Array as DaskArray

__all__ = ["lazy_tensor", "load_chunk"]


def load_chunk(
    store: Store,
    block_id: str | None,
    dtype: str,
    shape: tuple[int, ...],
    context: str,
    frame: bytes | None = None,
    links: tuple[DeltaLink, ...] = (),
) -> np.ndarray:
    """One chunk of a tensor (zeros for a chunk stored as all-zero).

    ``frame`` is the chunk's block when its manifest keeps it inline (a few
    KiB at most, so it travels in the task instead of a read); ``links`` its
    delta chain, if it has one.
    """
    if block_id is None:
        return np.zeros(shape, dtype=parse_dtype(dtype))
    out = np.empty(shape, dtype=parse_dtype(dtype))  # every byte is decoded into
    decode_chunks(store, [ChunkRead(block_id, out.reshape(-1), context, frame, links)])
    return out


def lazy_tensor(store: Store, manifest: TensorManifest, *, name: str = "tensor") -> DaskArray:
    """A ``dask.array`` reading ``manifest``'s chunks on demand (one task per chunk)."""
    import dask.array as da
    from dask.base import tokenize

    require_self_contained(manifest, name)
    grid = dask_chunks(manifest.shape, manifest.chunk_shape)
    # Everything that defines the array: two tensors differing only in dtype
    # (or all-zero tensors of one shape) must not share Dask keys.
    token = tokenize(
        store.url, manifest.dtype, manifest.shape, manifest.chunk_shape, manifest.blocks
    )
    key = f"gradpipe-chunk-{token}"
    graph: dict[Any, Any] = {}
    indices = list(itertools.product(*(range(len(c)) for c in grid))) if manifest.size else []
    for i, index in enumerate(indices):
        shape = tuple(c[j] for c, j in zip(grid, index, strict=True))
        graph[(key, *index)] = (
            load_chunk,
            store,
            manifest.blocks[i],
            manifest.dtype,
            shape,
            f"{name}, chunk {i}",
            manifest.inline.get(i),
            manifest.deltas.get(i, ()),
        )
    if not indices:
        empty: DaskArray = da.zeros(manifest.shape, dtype=parse_dtype(manifest.dtype), chunks=grid)
        return empty
    return da.Array(graph, key, grid, dtype=parse_dtype(manifest.dtype))
