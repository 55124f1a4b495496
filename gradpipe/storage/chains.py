"""Writing a tensor as the next version of another: per chunk, full or a delta.

:func:`write_version` cuts the new version on its parent's chunk grid and
decides chunk by chunk (design note 008):

- a chunk equal to the parent's costs nothing: it keeps the parent's block,
  inline frame or delta;
- a changed chunk whose *keyframe* (the last version of that chunk stored in
  full) is fewer than ``keyframe_interval`` versions old is encoded as a delta
  against the keyframe (:class:`~gradpipe.codecs.delta.DeltaCodec`), and in
  full, and the smaller is kept: gradients of consecutive steps are
  uncorrelated and stay full, parameters take about a third;
- every other chunk (the next keyframe, a small chunk, a changed grid) is
  stored in full, as :func:`~gradpipe.storage.tensors.write_chunks` would.

Deltas are taken against the keyframe, not the previous version: a read then
decodes two blocks per chunk whatever the version (the keyframe is shared by
all versions that use it), dropping a version frees its deltas with nothing
to rewrite, and on parameters a delta against a keyframe seven versions back
is only ~6% larger than one against the previous version (design note 008).

The chunk keeps its id (the hash of its logical bytes) whichever way it is
stored; a delta block is an ordinary block named by the hash of the delta's
bytes, so verify, repair and gc treat it like any other. The manifest lists
each delta chunk's link to its keyframe, and :class:`ChainInfo` each chunk's
age and what the version stored against what it would have stored alone.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Final

import numpy as np

from gradpipe.codecs.delta import DeltaCodec, parse_delta_kind
from gradpipe.config import get_bytes, get_setting
from gradpipe.core.chain import (
    DEFAULT_KEYFRAME_INTERVAL,
    ChainInfo,
    DeltaLink,
    parse_keyframe_interval,
)
from gradpipe.core.chunk_stats import ChunkStats, bit_nonzero, chunk_stats
from gradpipe.core.chunking import choose_chunk_shape, chunk_ranges
from gradpipe.core.dtypes import canonical_dtype, check_values, dtype_name, is_float, parse_dtype
from gradpipe.core.ids import hash_bytes
from gradpipe.core.tensor_manifest import TensorManifest
from gradpipe.errors import IntegrityError, NotFoundError
from gradpipe.meter import RAW, digest_bytes
from gradpipe.storage._pools import process_pool, read_threads
from gradpipe.storage.blocks import BlockToWrite, WriteStats
from gradpipe.storage.tensors import WRITE_WINDOW, WRITE_WINDOW_BYTES

if TYPE_CHECKING:
    from gradpipe.storage.store import Store

__all__ = [
    "ChainParent",
    "ChunkVersioner",
    "KeyframeValues",
    "ParentChunk",
    "VersionChunk",
    "account",
    "parent_chunks",
    "parse_version_kind",
    "version_manifest",
    "write_chunk_version",
    "write_version",
]

#: A delta at most this fraction of the parent's full copy wins without the
#: full encoding being made (halves the encoding work on parameters).
_CLEAR_WIN: Final = 0.8
#: A delta is kept only if at most this fraction of the full encoding: a
#: saving of a few percent does not pay for a second block on every read.
_MIN_GAIN: Final = 0.9
#: Chunks up to this many times ``inline-bytes`` are never delta-encoded: their
#: frames are a few KiB and may be kept inline, where no chain can reach them.
_SMALL_FACTOR: Final = 4


@dataclass(frozen=True)
class ChainParent:
    """The version a tensor is written against: its manifest, and values at hand.

    ``values`` are the parent's logical values, if the writer has them (the
    previous file of an ingest); they serve for the chunks the parent stores
    in full. ``keyframes`` are keyframe chunks the writer kept from earlier
    writes, by block id. A keyframe found in neither is read from the store
    (one block). ``trusted=False`` makes every chunk of ``values`` used as a
    base be checked against the parent's block id first, so a file changed
    since it was stored only costs a full chunk.
    """

    manifest: TensorManifest
    manifest_id: str | None
    values: np.ndarray | None = None
    trusted: bool = False
    keyframes: Mapping[str, np.ndarray] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class ParentChunk:
    """What writing one chunk of a new version needs of its parent's chunk.

    Small and picklable, so a task writing one chunk of a version takes this
    instead of the parent's whole manifest (:func:`parent_chunks` makes them).
    """

    block: str | None  # the chunk's logical id (None: all-zero)
    stats: ChunkStats
    frame: bytes | None  # kept inline
    links: tuple[DeltaLink, ...]
    full: int | None  # what the chunk takes stored alone, as the parent's chain records it
    age: int  # versions since its keyframe
    stored: bool  # every block it needs is in the store (or inline)
    keyframe: str | None  # the block a delta may be taken against now; None: store in full


def parent_chunks(
    manifest: TensorManifest, *, interval: int, present: set[str] | None = None
) -> list[ParentChunk]:
    """Every chunk of ``manifest`` as :class:`ParentChunk`, for versions with ``interval``.

    ``present``: the blocks known to be in the store (None: all of them, for a
    caller that reads every parent chunk anyway and so finds a lost one).
    """
    out = []
    for i, block in enumerate(manifest.blocks):
        links = manifest.deltas.get(i, ())
        needed = _chunk_blocks(manifest, i)
        age = _age(manifest, i)
        keyframe = None
        if block is not None and i not in manifest.inline and age + 1 < interval:
            keyframe = links[-1].base if links else block
            if present is not None and keyframe not in present:
                keyframe = None  # lost (or deleted as corrupt) since: start a new keyframe
        out.append(
            ParentChunk(
                block,
                manifest.stats[i],
                manifest.inline.get(i),
                links,
                manifest.chain.full[i] if manifest.chain is not None else None,
                age,
                present is None or all(b in present for b in needed),
                keyframe,
            )
        )
    return out


@dataclass
class VersionChunk:
    """What the manifest keeps of one chunk of a new version, and what it cost."""

    block: str | None
    stats: ChunkStats
    frame: bytes | None = None  # kept inline
    links: tuple[DeltaLink, ...] = ()
    stored: int = 0
    full: int = 0
    age: int = 0  # versions since the chunk's keyframe
    logical: int = 0  # bytes of the chunk's values
    write: BlockToWrite | None = None  # the block to store, if any
    outcome: str = "written"  # or "zero", "inline", "unchanged": for the write stats
    error: float | None = None  # a lossy delta's largest error


#: Finds the values of a chunk's keyframe, when a delta is to be tried (None: not at hand).
KeyframeValues = Callable[[ParentChunk], np.ndarray | None]


class _Writes:
    """Blocks to write, flushed to the store in windows (one batched round trip each)."""

    def __init__(self, store: Store, stats: WriteStats) -> None:
        self.store, self.stats = store, stats
        self.items: list[BlockToWrite] = []
        self.size = 0

    def add(self, item: BlockToWrite) -> None:
        self.items.append(item)
        self.size += len(item.frame or b"")
        if len(self.items) >= WRITE_WINDOW or self.size >= WRITE_WINDOW_BYTES:
            self.flush()

    def flush(self) -> None:
        if self.items:
            self.store.write_blocks(self.items, self.stats)
        self.items, self.size = [], 0


def write_version(
    store: Store,
    array: np.ndarray,
    parent: ChainParent | None,
    *,
    delta: str = "int",
    threshold: float = 0.0,
    keyframe_interval: int = DEFAULT_KEYFRAME_INTERVAL,
    chunk_bytes: int | None = None,
    stats: WriteStats | None = None,
    where: str = "",
    parallel: bool = True,
) -> TensorManifest:
    """Write ``array`` as the next version after ``parent`` (None: the first, all full).

    Returns the (not yet stored) manifest. ``delta`` is the delta kind
    (``int``, ``xor``, or the lossy ``sparse`` with ``threshold``). With
    ``parallel`` the chunks are encoded on the process's encoding pool; a
    caller that writes many tensors at once on its own threads passes False.
    A graph that computes a version chunk by chunk uses the same steps one
    chunk per task: :func:`parent_chunks`, :func:`write_chunk_version` and
    :func:`version_manifest`.
    """
    store.check_writable()
    kind, threshold = parse_version_kind(delta, threshold, array.dtype)
    interval = parse_keyframe_interval(keyframe_interval)
    stats = stats if stats is not None else WriteStats()
    dtype = canonical_dtype(array.dtype)
    flat = np.ascontiguousarray(array, dtype=dtype).reshape(-1)
    name = dtype_name(dtype)
    base = parent.manifest if parent is not None else None
    if base is not None and (base.dtype != name or base.shape != tuple(array.shape)):
        base = None  # another dtype or shape: nothing to delta against
    if base is not None:
        chunk_shape = base.chunk_shape
    else:
        target = chunk_bytes if chunk_bytes is not None else get_bytes("chunk-bytes")
        chunk_shape = choose_chunk_shape(array.shape, dtype.itemsize, target)
    parents: list[ParentChunk] | None = None
    finder: _KeyframeFinder | None = None
    if base is not None and parent is not None:
        present = _present_parent_blocks(store, base)
        parents = parent_chunks(base, interval=interval, present=present)
        finder = _KeyframeFinder(store, parent, where)
    writer = ChunkVersioner(store, kind=kind, threshold=threshold, interval=interval)
    ranges = list(chunk_ranges(array.shape, chunk_shape))
    writes = _Writes(store, stats)
    chunks: list[VersionChunk] = []
    # Chunks are encoded on a pool (the codecs release the GIL), a few windows
    # of them at a time so that only those windows' frames are held.
    step = 4 * read_threads()
    for lo in range(0, len(ranges), step):
        window = range(lo, min(lo + step, len(ranges)))

        def encode(i: int) -> VersionChunk:
            start, stop = ranges[i]
            if parents is None or finder is None:
                return writer.chunk(flat[start:stop], None, _no_keyframe, where=where)
            found = functools.partial(finder, i)
            return writer.chunk(flat[start:stop], parents[i], found, where=where)

        serial = len(window) == 1 or not parallel
        done = map(encode, window) if serial else _pool().map(encode, window)
        for chunk in done:
            account(chunk, stats)
            if chunk.write is not None:
                writes.add(chunk.write)
            chunks.append(chunk)
    writes.flush()
    return version_manifest(
        name,
        tuple(array.shape),
        chunk_shape,
        chunks,
        parent_id=parent.manifest_id if parent is not None else None,
        interval=interval,
    )


def parse_version_kind(delta: str, threshold: float, dtype: np.dtype) -> tuple[str, float]:
    """The delta kind and threshold a version of ``dtype`` is written with."""
    kind = parse_delta_kind(delta)
    if kind == "sparse" and not is_float(canonical_dtype(dtype)):
        return "int", 0.0  # the sparse delta is for floats; others stay exact
    return kind, threshold


def write_chunk_version(
    versioner: ChunkVersioner,
    values: np.ndarray,
    parent: ParentChunk | None,
    find_keyframe: KeyframeValues,
    *,
    stats: WriteStats,
    where: str,
) -> VersionChunk:
    """One chunk of a new version, decided, counted in ``stats`` and its block written.

    Returns the chunk without its block's bytes (what :func:`version_manifest`
    needs), so a task can hand it on cheaply.
    """
    chunk = versioner.chunk(values, parent, find_keyframe, where=where)
    account(chunk, stats)
    if chunk.write is not None:
        versioner.store.write_blocks([chunk.write], stats)
    return dataclasses.replace(chunk, write=None)


def version_manifest(
    dtype: str,
    shape: tuple[int, ...],
    chunk_shape: tuple[int, ...],
    chunks: Sequence[VersionChunk],
    *,
    parent_id: str | None,
    interval: int,
) -> TensorManifest:
    """The manifest of a version from its chunks, in chunk order."""
    errors = [c.error for c in chunks if c.error is not None]
    return TensorManifest(
        dtype,
        shape,
        chunk_shape,
        tuple(c.block for c in chunks),
        tuple(c.stats for c in chunks),
        {i: c.frame for i, c in enumerate(chunks) if c.frame is not None},
        {i: c.links for i, c in enumerate(chunks) if c.links},
        ChainInfo(
            parent_id,
            interval,
            tuple(c.stored for c in chunks),
            tuple(c.full for c in chunks),
            tuple(c.age for c in chunks),
            lossy=bool(errors),
            max_abs_error=max(errors, default=0.0),
        ),
    )


def _no_keyframe(parent: ParentChunk) -> np.ndarray | None:
    return None


class _KeyframeFinder:
    """:data:`KeyframeValues` of :func:`write_version`: the parent's values, kept ones, or a read.

    The parent's own values serve for a chunk it stores in full (checked
    against its id unless ``trusted``); then keyframes the writer kept; else
    the keyframe block is read (a damaged one is no base: the chunk is then
    stored in full and starts a new keyframe).
    """

    def __init__(self, store: Store, parent: ChainParent, where: str) -> None:
        self.store, self.parent, self.where = store, parent, where
        self.dtype = parse_dtype(parent.manifest.dtype)
        self.flat = (
            None if parent.values is None else np.ascontiguousarray(parent.values).reshape(-1)
        )
        self.ranges = parent.manifest.chunk_ranges()

    def __call__(self, i: int, chunk: ParentChunk) -> np.ndarray | None:
        keyframe = chunk.keyframe
        if keyframe is None:
            return None
        if not chunk.links and self.flat is not None:
            start, stop = self.ranges[i]
            values = self.flat[start:stop]
            if self.parent.trusted or hash_bytes(values.view(np.uint8)) == keyframe:
                return values
        found = self.parent.keyframes.get(keyframe)
        if found is not None:
            return found
        where = f"{self.where}, keyframe of chunk {i}" if self.where else f"keyframe of chunk {i}"
        try:
            raw = self.store.get_raw(keyframe, context=where)
        except (NotFoundError, IntegrityError):
            return None  # a damaged keyframe is no base: this chunk starts a new one
        return np.frombuffer(raw, dtype=np.uint8).view(self.dtype)


def _chunk_blocks(manifest: TensorManifest, i: int) -> list[str]:
    """The stored blocks chunk ``i`` of ``manifest`` needs (none when inline or all-zero)."""
    block, links = manifest.blocks[i], manifest.deltas.get(i)
    if links:
        return [*(link.block for link in links), links[-1].base]
    return [] if block is None or i in manifest.inline else [block]


def _present_parent_blocks(store: Store, parent: TensorManifest) -> set[str]:
    """The parent's blocks that are in the store, in one batched check.

    A new version refers to its parent's blocks without writing them: one lost
    since (or deleted by ``verify --delete-corrupt``) must not be referred to,
    so such a chunk is written in full instead. gc cannot delete a block the
    parent's snapshot or run still reaches while the writer holds its lease.
    """
    wanted = sorted({b for i in range(len(parent.blocks)) for b in _chunk_blocks(parent, i)})
    return {b for b, there in zip(wanted, store.has_blocks(wanted), strict=True) if there}


def _age(manifest: TensorManifest, i: int) -> int:
    """Versions since chunk ``i``'s keyframe, as ``manifest`` records it."""
    if manifest.chain is not None and manifest.chain.ages:
        return manifest.chain.ages[i]
    return len(manifest.deltas.get(i, ()))


def account(chunk: VersionChunk, stats: WriteStats) -> None:
    """Count what one chunk's decision did (the block writes count themselves)."""
    stats.logical_bytes += chunk.logical
    digest_bytes(RAW, chunk.logical)
    if chunk.outcome == "zero":
        stats.zero_chunks += 1
    elif chunk.outcome == "inline":
        stats.inline_chunks += 1
    elif chunk.outcome == "unchanged":
        stats.blocks_reused += 1


def _pool() -> ThreadPoolExecutor:
    """The process's encoding pool (apart from the decoding one: a writer reads keyframes)."""
    return process_pool("encode")


class ChunkVersioner:
    """The per-chunk decisions of a new version (thread-safe: no state; picklable)."""

    def __init__(self, store: Store, *, kind: str, threshold: float, interval: int) -> None:
        self.store = store
        self.kind, self.threshold, self.interval = kind, threshold, interval
        self.inline_max = get_bytes("inline-bytes")
        self.level = int(get_setting("codec-level"))

    def chunk(
        self,
        chunk: np.ndarray,
        parent: ParentChunk | None,
        find_keyframe: KeyframeValues,
        *,
        where: str,
    ) -> VersionChunk:
        """Decide how to store ``chunk``, the new values of ``parent`` (None: a first version)."""
        check_values(chunk, where=where or "tensor")
        nonzero = bit_nonzero(chunk)
        if nonzero == 0:
            return VersionChunk(
                None, chunk_stats(chunk, bits_nonzero=0), outcome="zero", logical=chunk.nbytes
            )
        block_id = hash_bytes(chunk.view(np.uint8))
        if parent is not None and parent.block == block_id and parent.stored:
            return self._unchanged(parent, chunk, nonzero)
        record_stats = chunk_stats(chunk, bits_nonzero=nonzero)
        full_item = BlockToWrite(block_id, chunk, None, nonzero)
        if chunk.nbytes <= self.inline_max * _SMALL_FACTOR:
            return self._small(full_item, record_stats)
        base = None if parent is None or parent.keyframe is None else find_keyframe(parent)
        if base is None or parent is None or parent.keyframe is None:
            return self._full(full_item, self._encode(full_item), record_stats)
        return self._smaller(
            parent, chunk, (parent.keyframe, base), full=full_item, record_stats=record_stats
        )

    def _encode(self, item: BlockToWrite) -> bytes | memoryview:
        return self.store.encode_block(item, self.level)

    def _unchanged(self, parent: ParentChunk, chunk: np.ndarray, nonzero: int) -> VersionChunk:
        """The parent's chunk as it is stored: no new block."""
        frame = parent.frame
        if parent.full is not None:
            full = parent.full
        elif frame is not None:
            full = len(frame)
        else:  # a parent written without a chain: what this chunk takes alone
            full = len(self._encode(BlockToWrite(parent.block or "", chunk, None, nonzero)))
        # A full chunk stays its own keyframe; an unchanged delta ages up to the
        # interval (the next change then makes a keyframe).
        age = min(parent.age + 1, self.interval - 1) if parent.links else 0
        return VersionChunk(
            parent.block, parent.stats, frame, parent.links, 0, full, age,
            logical=chunk.nbytes, outcome="unchanged",
        )  # fmt: skip

    def _small(self, item: BlockToWrite, record_stats: ChunkStats) -> VersionChunk:
        frame = self._encode(item)
        if len(frame) <= self.inline_max:
            size = len(frame)
            return VersionChunk(
                item.block_id, record_stats, bytes(frame), (), size, size,
                logical=item.data.nbytes, outcome="inline",
            )  # fmt: skip
        return self._full(item, frame, record_stats)

    def _full(
        self, item: BlockToWrite, frame: bytes | memoryview, record_stats: ChunkStats
    ) -> VersionChunk:
        write = BlockToWrite(item.block_id, item.data, None, item.nonzero, frame)
        size = len(frame)
        return VersionChunk(
            item.block_id, record_stats, None, (), size, size,
            logical=item.data.nbytes, write=write,
        )  # fmt: skip

    def _smaller(
        self,
        parent: ParentChunk,
        chunk: np.ndarray,
        keyframe: tuple[str, np.ndarray],
        *,
        full: BlockToWrite,
        record_stats: ChunkStats,
    ) -> VersionChunk:
        """The chunk as a delta against ``base`` if that is smaller, else in full.

        When the delta is clearly smaller than the parent's own full copy of
        the chunk (a full copy's size moves little between versions), the full
        encoding is not made, and the parent's size stands for it.
        """
        keyframe_id, base = keyframe
        codec = DeltaCodec(self.kind, dtype_name(chunk.dtype), self.threshold).bind(base)
        words = codec.encode(chunk)
        # Lossless deltas are shown to the policy as the tensor's dtype, so the
        # byte planes of a float's exponent and mantissa line up.
        delta = words if self.kind == "sparse" else words.view(chunk.dtype)
        delta_id = hash_bytes(delta.view(np.uint8))
        delta_item = BlockToWrite(delta_id, delta, None, bit_nonzero(delta))
        delta_frame = self._encode(delta_item)
        known = parent.full or 0
        if len(delta_frame) <= _CLEAR_WIN * known:
            full_size = known
        else:
            full_frame = self._encode(full)
            if len(delta_frame) > _MIN_GAIN * len(full_frame):
                return self._full(full, full_frame, record_stats)
            full_size = len(full_frame)
        block_id, error = full.block_id, None
        if not codec.lossless:
            rebuilt = codec.decode(words).view(chunk.dtype)
            block_id = hash_bytes(rebuilt.view(np.uint8))
            record_stats = chunk_stats(rebuilt, bits_nonzero=bit_nonzero(rebuilt))
            error = None if codec.exact else codec.max_abs_error
        links = (DeltaLink(delta_id, keyframe_id, self.kind),)
        write = BlockToWrite(delta_id, delta, None, delta_item.nonzero, delta_frame)
        return VersionChunk(
            block_id, record_stats, None, links, len(delta_frame), full_size, parent.age + 1,
            logical=chunk.nbytes, write=write, error=error,
        )  # fmt: skip
