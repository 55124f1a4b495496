"""Tensors in a store: arrays cut into contiguous chunks, one block per chunk.

The write path hashes each chunk, computes its statistics, skips all-zero
chunks (they take no block), keeps chunks whose encoded block is small
(``gradpipe.inline-bytes``) for their manifest, and hands the rest to the
store in batched windows; the read path decodes inline chunks from the
manifest, fetches the other blocks in batches and decodes each straight into
the output buffer, on a thread pool (:mod:`~gradpipe.storage.reads`). Both are
used by :class:`Store` and by the ingest graph's tasks, so every path into the
store checks the same things.

A lossy codec chain (one whose first codec is a
:class:`~gradpipe.codecs._lossy.LossyCodec`) takes another branch of the
write path: each chunk is encoded and decoded again, its block is named by the
hash of the *decoded* bytes (what reads give back and verify checks), its
stats are those of the decoded values, and its error against the original is
measured; the tensor's manifest records the codec, its bound and the error
(:class:`~gradpipe.core.lossy.LossyInfo`).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final

import numpy as np
from numcodecs.abc import Codec

from gradpipe.codecs._lossy import LossyCodec, bind_chain
from gradpipe.config import get_bytes
from gradpipe.core.chunk_stats import ChunkStats, stats_and_bit_nonzero
from gradpipe.core.chunking import choose_chunk_shape, chunk_ranges
from gradpipe.core.dtypes import canonical_dtype, check_values, dtype_name, parse_dtype
from gradpipe.core.ids import block_key, hash_bytes
from gradpipe.core.lossy import ChunkError, LossyInfo, measure_error
from gradpipe.core.tensor_manifest import TensorManifest, require_self_contained
from gradpipe.errors import NotFoundError
from gradpipe.meter import RAW, digest_bytes
from gradpipe.storage.blocks import BlockToWrite, WriteStats, encode_lossy_block
from gradpipe.storage.reads import READ_WINDOW, ChunkRead, decode_windows

if TYPE_CHECKING:
    from gradpipe.storage.store import Store

__all__ = [
    "READ_WINDOW",
    "ChunkRecord",
    "build_tensor_manifest",
    "chunk_frames",
    "iter_tensors",
    "read_tensor",
    "read_tensors",
    "write_chunks",
    "write_tensor",
]

# Blocks encoded and written per batched round trip (one existence check, then
# concurrent writes on S3): by count for small blocks, by bytes for large ones.
WRITE_WINDOW: Final = 64
WRITE_WINDOW_BYTES: Final = 64 * 2**20
#: Chunks up to this many times ``inline-bytes`` (raw) are encoded first, to see
#: whether their block is small enough to inline; larger ones never are (their
#: frame, once made, is not made twice).
_INLINE_RAW_FACTOR: Final = 4


@dataclass(frozen=True, slots=True)
class ChunkRecord:
    """What the manifest keeps of one written chunk."""

    block: str | None  # id of the chunk's logical bytes; None for an all-zero chunk
    stats: ChunkStats
    frame: bytes | None = None  # the encoded block, when it lives inside the manifest
    error: ChunkError | None = None  # written by a lossy codec: its measured error


def build_tensor_manifest(
    dtype: str,
    shape: tuple[int, ...],
    chunk_shape: tuple[int, ...],
    records: Sequence[ChunkRecord],
    lossy: LossyCodec | None = None,
) -> TensorManifest:
    """The manifest of a tensor from its chunks' records, in chunk order.

    ``lossy`` is the lossy codec the chunks were written with, if any.
    """
    info = None
    if lossy is not None:
        error = ChunkError.merge(r.error for r in records if r.error is not None)
        info = LossyInfo.of(lossy.get_config(), lossy.name, lossy.error_bound(), error)
    return TensorManifest(
        dtype,
        shape,
        chunk_shape,
        tuple(r.block for r in records),
        tuple(r.stats for r in records),
        {i: r.frame for i, r in enumerate(records) if r.frame is not None},
        lossy=info,
    )


def write_chunks(
    store: Store,
    chunks: Iterable[np.ndarray],
    *,
    codecs: Sequence[Codec] | None = None,
    stats: WriteStats | None = None,
    where: str = "",
    chunk_codecs: Sequence[Sequence[Codec] | None] | None = None,
) -> list[ChunkRecord]:
    """Write 1-D chunks (canonical little-endian); per chunk, its block id and stats.

    All-zero chunks take no block (id None); a chunk whose encoded block is at
    most ``gradpipe.inline-bytes`` keeps it in its record, for the manifest,
    and is not written as an object. ``codecs=None`` lets the policy choose a
    lossless codec per chunk; ``chunk_codecs``, if given, is one chain per
    chunk instead (chunks of several tensors, each bound with
    :func:`bind_chain`). A chain that starts with a lossy codec writes the
    chunk lossily (see the module docstring) and records its error. Values a
    dtype cannot hold (a bool byte other than 0 and 1) are refused before
    anything is written.
    """
    store.check_writable()
    stats = stats if stats is not None else WriteStats()
    inline_max = get_bytes("inline-bytes")
    records: list[ChunkRecord] = []
    window: list[BlockToWrite] = []
    window_bytes = logical = 0
    for n, chunk in enumerate(chunks):
        check_values(chunk, where=where or "tensor")
        chain = codecs if chunk_codecs is None else chunk_codecs[n]
        stats.logical_bytes += chunk.nbytes
        logical += chunk.nbytes
        if chain and getattr(chain[0], "lossy", False):
            record, item = _lossy_chunk(chunk, chain, inline_max, stats)
            records.append(record)
            if item is None:
                continue
        else:
            record_stats, nonzero = stats_and_bit_nonzero(chunk)
            if nonzero == 0:
                stats.zero_chunks += 1  # all-zero bytes: no block at all
                records.append(ChunkRecord(None, record_stats))
                continue
            block_id = hash_bytes(chunk.view(np.uint8))
            item = BlockToWrite(block_id, chunk, chain, nonzero)
            if chunk.nbytes <= inline_max * _INLINE_RAW_FACTOR:
                frame = store.encode_block(item)
                if len(frame) <= inline_max:
                    stats.inline_chunks += 1
                    records.append(ChunkRecord(block_id, record_stats, bytes(frame)))
                    continue
                item = BlockToWrite(block_id, chunk, chain, nonzero, frame)
            records.append(ChunkRecord(block_id, record_stats))
        window.append(item)
        window_bytes += chunk.nbytes
        if len(window) >= WRITE_WINDOW or window_bytes >= WRITE_WINDOW_BYTES:
            store.write_blocks(window, stats)
            window, window_bytes = [], 0
    if window:
        store.write_blocks(window, stats)
    digest_bytes(RAW, logical)
    return records


def _lossy_chunk(
    chunk: np.ndarray, chain: Sequence[Codec], inline_max: int, stats: WriteStats
) -> tuple[ChunkRecord, BlockToWrite | None]:
    """Encode one chunk lossily: its record, and the block to write (None: zero or inline).

    The block id is the hash of what the frame decodes to, so a read (which
    checks it) gets exactly those values, and a lossy block can only share an
    id with lossless data when the bytes are the same.
    """
    frame, decoded_bytes = encode_lossy_block(chunk, chain)
    decoded = decoded_bytes.view(chunk.dtype)
    error = measure_error(chunk, decoded)
    record_stats, nonzero = stats_and_bit_nonzero(decoded)
    if nonzero == 0:
        stats.zero_chunks += 1
        return ChunkRecord(None, record_stats, error=error), None
    block_id = hash_bytes(decoded_bytes)
    if len(frame) <= inline_max:
        stats.inline_chunks += 1
        return ChunkRecord(block_id, record_stats, bytes(frame), error), None
    item = BlockToWrite(block_id, decoded, chain, nonzero, frame)
    return ChunkRecord(block_id, record_stats, error=error), item


def write_tensor(
    store: Store,
    array: np.ndarray,
    *,
    chunk_bytes: int | None = None,
    codecs: Sequence[Codec] | None = None,
    stats: WriteStats | None = None,
    where: str = "",
) -> TensorManifest:
    """Write the chunks of ``array`` and return its (not yet stored) manifest.

    A lossy codec at the head of ``codecs`` is configured for the array's
    dtype and shape, and left out for integer and bool arrays (stored exactly).
    """
    dtype = canonical_dtype(array.dtype)
    flat = np.ascontiguousarray(array, dtype=dtype).reshape(-1)
    target = chunk_bytes if chunk_bytes is not None else get_bytes("chunk-bytes")
    chunk_shape = choose_chunk_shape(array.shape, dtype.itemsize, target)
    chunks = (flat[start:stop] for start, stop in chunk_ranges(array.shape, chunk_shape))
    chain, lossy = bind_chain(codecs, dtype_name(dtype), tuple(array.shape))
    records = write_chunks(store, chunks, codecs=chain, stats=stats, where=where)
    return build_tensor_manifest(dtype_name(dtype), array.shape, chunk_shape, records, lossy)


def read_tensor(store: Store, manifest: TensorManifest, *, context: str = "") -> np.ndarray:
    """Read the tensor a manifest describes, checking every block against its id."""
    [out] = read_tensors(store, [manifest], contexts=[context])
    return out


def read_tensors(
    store: Store, manifests: Sequence[TensorManifest], *, contexts: Sequence[str] | None = None
) -> list[np.ndarray]:
    """Read several tensors in one pass: every chunk of all of them decoded in parallel.

    ``contexts`` name the tensors in error messages.
    """
    return list(iter_tensors(store, manifests, contexts=contexts))


def iter_tensors(
    store: Store, manifests: Sequence[TensorManifest], *, contexts: Sequence[str] | None = None
) -> Iterator[np.ndarray]:
    """The tensors ``manifests`` describe, in order, each as soon as all its chunks are decoded.

    One pass over every chunk of every tensor (see :mod:`gradpipe.storage.reads`):
    each tensor is allocated once and its chunks are decoded straight into
    it, on a thread pool, a window ahead of the tensor being yielded. Every
    block is checked against its id.
    """
    names = contexts if contexts is not None else [""] * len(manifests)
    outs: list[np.ndarray] = []
    ends: list[int] = []  # chunks to decode before tensor k is whole
    chunks: list[ChunkRead] = []
    for manifest, context in zip(manifests, names, strict=True):
        require_self_contained(manifest, context or "tensor")
        # Zeroed pages: all-zero chunks, which have no block, need no write.
        out = np.zeros(manifest.size, dtype=parse_dtype(manifest.dtype))
        outs.append(out.reshape(manifest.shape))
        for i, (block_id, (start, stop)) in enumerate(
            zip(manifest.blocks, manifest.chunk_ranges(), strict=True)
        ):
            if block_id is not None:
                where = f"{context}, chunk {i}" if context else f"chunk {i}"
                chunks.append(
                    ChunkRead(
                        block_id,
                        out[start:stop],
                        where,
                        manifest.inline.get(i),
                        manifest.deltas.get(i, ()),
                    )
                )
        ends.append(len(chunks))
    ready = 0
    for done in decode_windows(store, chunks):
        while ready < len(outs) and ends[ready] <= done:
            yield outs[ready]
            ready += 1
    yield from outs[ready:]  # tensors after the last chunk: all zero, or empty


def chunk_frames(store: Store, manifest: TensorManifest) -> list[bytes | None]:
    """The encoded block of every chunk, wherever it is kept (None: an all-zero chunk).

    Frames are returned as stored, not decoded: for looking at codecs and
    stored sizes, and for tests that damage them.
    """
    out: list[bytes | None] = [None] * len(manifest.blocks)
    elsewhere = []
    for i, block_id in enumerate(manifest.blocks):
        if block_id is None:
            continue
        kept = manifest.inline.get(i)
        if kept is not None:
            out[i] = kept
        else:
            elsewhere.append((i, block_id))
    for lo in range(0, len(elsewhere), READ_WINDOW):
        batch = elsewhere[lo : lo + READ_WINDOW]
        frames = store.backend.read_many([block_key(b) for _, b in batch])
        for (i, block_id), frame in zip(batch, frames, strict=True):
            if isinstance(frame, NotFoundError):
                raise store.missing_block(block_id, f"chunk {i}")
            if isinstance(frame, Exception):
                raise frame
            out[i] = frame
    return out
