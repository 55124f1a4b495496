"""Reading chained tensors as a Dask graph: one task per chunk version, shared by key.

Every chunk a read needs becomes a task named by its logical id: a keyframe's
task decodes its block, a delta chunk's task decodes its delta block and applies
it to the result of its base's task. Versions of one chain share their
ancestors' keys, so reading eight snapshots together decodes each keyframe once
and each delta once, however many versions pass through it, and every task
checks its result against its id. Tensors are assembled from their chunks by
one task each; only the chunks of the tensors asked for are read.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
from dask.base import tokenize

from gradpipe.codecs.delta import DeltaCodec
from gradpipe.core.chain import DeltaLink
from gradpipe.core.dtypes import parse_dtype
from gradpipe.core.ids import hash_bytes
from gradpipe.core.manifest import manifest_id
from gradpipe.core.tensor_manifest import TensorManifest, require_self_contained
from gradpipe.errors import IntegrityError
from gradpipe.storage.blocks import decode_block
from gradpipe.storage.store import Store

if TYPE_CHECKING:
    from gradpipe.graph.runner import Runner

__all__ = [
    "add_chunk_read",
    "assemble_chunks",
    "build_read_graph",
    "chunk_key",
    "read_tensors_graph",
]

# What restores (their only user) read: named for the dashboard as restore tasks.
_CHUNK = "gradpipe-restore-chunk"
_TENSOR = "gradpipe-restore-tensor"


def build_read_graph(
    store: Store, manifests: Sequence[TensorManifest], *, contexts: Sequence[str] | None = None
) -> tuple[dict[Hashable, Any], list[Hashable]]:
    """The graph reading ``manifests``, and the key of each tensor in it (in order)."""
    names = contexts if contexts is not None else [f"tensor {i}" for i in range(len(manifests))]
    graph: dict[Hashable, Any] = {}
    keys: list[Hashable] = []
    for t, (manifest, context) in enumerate(zip(manifests, names, strict=True)):
        require_self_contained(manifest, context)
        parts: list[Any] = []
        for i, block in enumerate(manifest.blocks):
            if block is None:
                parts.append(None)
                continue
            where = f"{context}, chunk {i}"
            frame = manifest.inline.get(i)
            links = manifest.deltas.get(i, ())
            parts.append(_add_chunk(graph, store, block, frame, links, manifest.dtype, where))
        # Named by content, not position: two reads on one cluster must never
        # share a key unless they read the same tensor.
        key = (f"{_TENSOR}-{tokenize(manifest_id(manifest))}", t)
        ranges = manifest.chunk_ranges()
        graph[key] = (assemble_chunks, manifest.dtype, manifest.shape, ranges, parts)
        keys.append(key)
    return graph, keys


def read_tensors_graph(
    store: Store,
    manifests: Sequence[TensorManifest],
    *,
    runner: Runner,
    contexts: Sequence[str] | None = None,
) -> list[np.ndarray]:
    """The tensors ``manifests`` describe, computed on ``runner``."""
    graph, keys = build_read_graph(store, manifests, contexts=contexts)
    return runner.get(graph, keys, name="gradpipe-restore")


def chunk_key(block: str) -> Hashable:
    """The key of the task whose result is the logical bytes (uint8) of chunk ``block``."""
    return (_CHUNK, block)


def add_chunk_read(
    graph: dict[Hashable, Any], store: Store, manifest: TensorManifest, i: int, where: str
) -> Hashable | None:
    """Add the tasks reading chunk ``i`` of ``manifest`` (and its chain); its key.

    The result is the chunk's logical bytes as uint8; None (no task) for an
    all-zero chunk. Keys are named by content, so the keyframe a delta chunk
    is rebuilt from is the task :func:`chunk_key` of its id, shared with every
    other chunk (and every later write against it) in the graph.
    """
    block = manifest.blocks[i]
    if block is None:
        return None
    if i in manifest.replays:
        require_self_contained(manifest, where)
    links = manifest.deltas.get(i, ())
    return _add_chunk(graph, store, block, manifest.inline.get(i), links, manifest.dtype, where)


def _add_chunk(
    graph: dict[Hashable, Any],
    store: Store,
    block: str,
    frame: bytes | None,
    links: tuple[DeltaLink, ...],
    dtype: str,
    where: str,
) -> Hashable:
    """Add the tasks of one chunk (and its chain) to ``graph``; its key."""
    if not links:
        key = (_CHUNK, block)
        graph.setdefault(key, (_load, store, block, frame, where))
        return key
    # Oldest first: the keyframe, then each delta on the result of the one before.
    base_key: Hashable = (_CHUNK, links[-1].base)
    graph.setdefault(base_key, (_load, store, links[-1].base, None, f"{where}, keyframe"))
    targets = [block, *(link.base for link in links[:-1])]
    for link, target in zip(reversed(links), reversed(targets), strict=True):
        key = (_CHUNK, target)
        graph.setdefault(key, (_apply, store, link, target, dtype, base_key, where))
        base_key = key
    return base_key


def _load(store: Store, block: str, frame: bytes | None, where: str) -> np.ndarray:
    """A full block's logical bytes."""
    if frame is not None:
        data = decode_block(frame, block, context=where)
    else:
        data = store.get_raw(block, context=where)
    return np.frombuffer(data, dtype=np.uint8)


def _apply(
    store: Store, link: DeltaLink, target: str, dtype: str, base: np.ndarray, where: str
) -> np.ndarray:
    """The chunk ``target``: delta ``link`` applied to its base's bytes, checked."""
    delta = store.get_raw(link.block, context=f"{where}, delta")
    out = np.empty(base.nbytes, dtype=np.uint8)
    typed = parse_dtype(dtype)
    codec = DeltaCodec(link.kind, dtype).bind(base.view(typed))
    codec.decode(delta, out=out)
    if hash_bytes(out) != target:
        raise IntegrityError(
            f"{where}: a delta of its chain rebuilds other bytes than chunk {target}; "
            "run `gradpipe verify`"
        )
    return out


def assemble_chunks(
    dtype: str,
    shape: tuple[int, ...],
    ranges: list[tuple[int, int]],
    parts: list[np.ndarray | None],
) -> np.ndarray:
    """One tensor from its chunks' bytes (None: an all-zero chunk)."""
    typed = parse_dtype(dtype)
    out = np.zeros(int(np.prod(shape, dtype=np.int64)), dtype=typed)
    for (start, stop), part in zip(ranges, parts, strict=True):
        if part is not None:
            out[start:stop] = part.view(typed)
    return out.reshape(shape)
