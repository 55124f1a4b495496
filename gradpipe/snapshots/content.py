"""What a snapshot holds, as one id: how a step run again is told from a new state.

A snapshot's manifest id covers its time and its place in the chain, so the
same state saved twice gets two ids. Its *content id* covers only what the
caller gave: the state's skeleton, the loss, the metadata, and each array's
dtype, shape, chunk grid and the hash of each chunk's values (None for an
all-zero chunk), taken before any lossy delta. For an exact tensor those
hashes are the chunk ids its manifest lists already (a chunk keeps the id of
its logical bytes however it is stored, see :mod:`gradpipe.storage.chains`),
so only arrays stored lossily are hashed again when a version is written.

:func:`gradpipe.snapshots.api.write_snapshot` compares the content id of the state
it is given with the step's newest version before writing: the same one means
the step is recorded already (a job killed after its commit landed, run again).
Versions written before content ids were kept have theirs worked out from
their exact tensors' chunk ids; one with a lossy tensor cannot be told apart.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from gradpipe.core.dtypes import canonical_dtype, dtype_name
from gradpipe.core.encoding import encode_float, to_json_bytes
from gradpipe.core.ids import hash_bytes
from gradpipe.core.snapshot_manifest import SnapshotManifest
from gradpipe.core.state import FlatState
from gradpipe.core.tensor_manifest import TensorManifest
from gradpipe.storage._pools import read_threads

__all__ = ["holds_state", "recorded_content", "written_content"]


def _content_id(
    tree: Mapping[str, Any],
    loss: float | None,
    metadata: Mapping[str, str],
    arrays: Mapping[str, tuple[TensorManifest, Sequence[str | None]]],
) -> str:
    """The content id of a state: skeleton, loss, metadata, arrays by layout and chunk hashes."""
    doc = {
        "state": tree,
        "loss": encode_float(None if loss is None else float(loss)),
        "metadata": dict(metadata),
        "arrays": {
            key: [m.dtype, list(m.shape), list(m.chunk_shape), list(ids)]
            for key, (m, ids) in arrays.items()
        },
    }
    return hash_bytes(to_json_bytes(doc))


def _chunk_ids(array: np.ndarray, grid: TensorManifest) -> list[str | None]:
    """The hash of each chunk of ``array``'s values on ``grid``'s chunks, as a writer names them."""
    flat = np.ascontiguousarray(array, dtype=canonical_dtype(array.dtype)).reshape(-1)
    out: list[str | None] = []
    for start, stop in grid.chunk_ranges():
        chunk = flat[start:stop].view(np.uint8)
        out.append(hash_bytes(chunk) if chunk.any() else None)
    return out


def _same_layout(array: np.ndarray, manifest: TensorManifest) -> bool:
    dtype = dtype_name(canonical_dtype(array.dtype))
    return dtype == manifest.dtype and tuple(array.shape) == tuple(manifest.shape)


def written_content(
    flat: FlatState,
    loss: float | None,
    metadata: Mapping[str, str],
    tensors: Mapping[str, TensorManifest],
) -> str:
    """The content id of a state just written as ``tensors`` (one manifest per array key).

    Exact tensors lend their chunk ids; a lossy one's values are hashed on its grid.
    """
    arrays = {
        key: (m, m.blocks if m.exact else _chunk_ids(flat.arrays[key], m))
        for key, m in tensors.items()
    }
    return _content_id(flat.to_dict(), loss, metadata, arrays)


def recorded_content(
    manifest: SnapshotManifest, tensors: Mapping[str, TensorManifest]
) -> str | None:
    """The content id of a stored version; None if it cannot be known.

    ``tensors`` are the version's tensor manifests by array key. A version
    written before content ids were kept gets its id from its chunk ids when
    every tensor is exact; with a lossy one, the values it was given are gone.
    """
    if manifest.content is not None:
        return manifest.content
    if not all(m.exact for m in tensors.values()):
        return None
    arrays = {key: (m, m.blocks) for key, m in tensors.items()}
    return _content_id(manifest.state, manifest.loss, manifest.metadata, arrays)


def holds_state(
    manifest: SnapshotManifest,
    tensors: Mapping[str, TensorManifest],
    flat: FlatState,
    loss: float | None,
    metadata: Mapping[str, str],
) -> bool:
    """Whether the stored version ``manifest`` holds exactly this state, loss and metadata.

    Reads nothing from the store; hashes the arrays (on the version's chunk
    grids) only once their keys, dtypes and shapes agree.
    """
    recorded = recorded_content(manifest, tensors)
    if recorded is None or set(tensors) != set(flat.arrays):
        return False
    if not all(_same_layout(flat.arrays[k], m) for k, m in tensors.items()):
        return False
    keys = list(tensors)
    with ThreadPoolExecutor(read_threads(), thread_name_prefix="gradpipe-snapshot") as pool:
        ids = list(pool.map(lambda k: _chunk_ids(flat.arrays[k], tensors[k]), keys))
    arrays = {k: (tensors[k], i) for k, i in zip(keys, ids, strict=True)}
    return _content_id(flat.to_dict(), loss, metadata, arrays) == recorded
