"""Tensors in a store: arrays cut into contiguous chunks, one block per chunk.

The write path hashes each chunk, computes its statistics, skips all-zero
chunks (they take no block) and hands the rest to the store in batched
windows; the read path fetches a tensor's blocks in batches and decodes each
straight into the output buffer. Both are used by :class:`Store` and by the
ingest graph's tasks, so every path into the store checks the same things.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Final

import numpy as np
from numcodecs.abc import Codec

from gradpipe.config import get_bytes
from gradpipe.core.chunk_stats import ChunkStats, bit_nonzero, chunk_stats
from gradpipe.core.chunking import choose_chunk_shape, chunk_ranges
from gradpipe.core.dtypes import canonical_dtype, check_values, dtype_name, parse_dtype
from gradpipe.core.ids import block_key, hash_bytes
from gradpipe.core.tensor_manifest import TensorManifest
from gradpipe.errors import NotFoundError
from gradpipe.storage.blocks import BlockToWrite, WriteStats, decode_block

if TYPE_CHECKING:
    from gradpipe.storage.store import Store

__all__ = ["READ_WINDOW", "read_tensor", "write_chunks", "write_tensor"]

# Blocks encoded and written per batched round trip (one existence check, then
# concurrent writes on S3): by count for small blocks, by bytes for large ones.
WRITE_WINDOW: Final = 64
WRITE_WINDOW_BYTES: Final = 64 * 2**20
#: Blocks fetched per batched read.
READ_WINDOW: Final = 64

ChunkRecord = tuple[str | None, ChunkStats]


def write_chunks(
    store: Store,
    chunks: Iterable[np.ndarray],
    *,
    codecs: Sequence[Codec] | None = None,
    stats: WriteStats | None = None,
    where: str = "",
) -> list[ChunkRecord]:
    """Write 1-D chunks (canonical little-endian); per chunk, its block id and stats.

    All-zero chunks take no block (id None). ``codecs=None`` lets the policy
    choose a lossless codec per chunk. Values a dtype cannot hold (a bool
    byte other than 0 and 1) are refused before anything is written.
    """
    store.check_writable()
    stats = stats if stats is not None else WriteStats()
    records: list[ChunkRecord] = []
    window: list[BlockToWrite] = []
    window_bytes = 0
    for chunk in chunks:
        check_values(chunk, where=where or "tensor")
        nonzero = bit_nonzero(chunk)
        record_stats = chunk_stats(chunk, bits_nonzero=nonzero)
        stats.logical_bytes += chunk.nbytes
        if nonzero == 0:
            stats.zero_chunks += 1  # all-zero bytes: no block at all
            records.append((None, record_stats))
            continue
        block_id = hash_bytes(chunk.view(np.uint8))
        records.append((block_id, record_stats))
        window.append(BlockToWrite(block_id, chunk, codecs, nonzero))
        window_bytes += chunk.nbytes
        if len(window) >= WRITE_WINDOW or window_bytes >= WRITE_WINDOW_BYTES:
            store.write_blocks(window, stats)
            window, window_bytes = [], 0
    if window:
        store.write_blocks(window, stats)
    return records


def write_tensor(
    store: Store,
    array: np.ndarray,
    *,
    chunk_bytes: int | None = None,
    codecs: Sequence[Codec] | None = None,
    stats: WriteStats | None = None,
    where: str = "",
) -> TensorManifest:
    """Write the chunks of ``array`` and return its (not yet stored) manifest."""
    dtype = canonical_dtype(array.dtype)
    flat = np.ascontiguousarray(array, dtype=dtype).reshape(-1)
    target = chunk_bytes if chunk_bytes is not None else get_bytes("chunk-bytes")
    chunk_shape = choose_chunk_shape(array.shape, dtype.itemsize, target)
    chunks = (flat[start:stop] for start, stop in chunk_ranges(array.shape, chunk_shape))
    records = write_chunks(store, chunks, codecs=codecs, stats=stats, where=where)
    return TensorManifest(
        dtype_name(dtype),
        array.shape,
        chunk_shape,
        tuple(block for block, _ in records),
        tuple(stat for _, stat in records),
    )


def read_tensor(store: Store, manifest: TensorManifest, *, context: str = "") -> np.ndarray:
    """Read the tensor a manifest describes, checking every block against its id."""
    dtype = parse_dtype(manifest.dtype)
    out = np.zeros(manifest.size, dtype=dtype)
    ranges = manifest.chunk_ranges()
    wanted = [(i, b) for i, b in enumerate(manifest.blocks) if b is not None]
    for lo in range(0, len(wanted), READ_WINDOW):
        batch = wanted[lo : lo + READ_WINDOW]
        frames = store.backend.read_many([block_key(b) for _, b in batch])
        for (i, block_id), frame in zip(batch, frames, strict=True):
            where = f"{context}, chunk {i}" if context else f"chunk {i}"
            if isinstance(frame, NotFoundError):
                raise store.missing_block(block_id, where)
            if isinstance(frame, Exception):
                raise frame
            start, stop = ranges[i]
            decode_block(frame, block_id, out=out[start:stop], context=where)
    return out.reshape(manifest.shape)
