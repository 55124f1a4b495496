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
from typing import TYPE_CHECKING

import numpy as np

from gradpipe.codecs.delta import parse_delta_kind
from gradpipe.config import get_bytes
from gradpipe.core.chain import (
    DEFAULT_KEYFRAME_INTERVAL,
    ChainInfo,
    parse_keyframe_interval,
)
from gradpipe.core.chunking import choose_chunk_shape, chunk_ranges
from gradpipe.core.dtypes import canonical_dtype, dtype_name, is_float, parse_dtype
from gradpipe.core.ids import hash_bytes
from gradpipe.core.tensor_manifest import TensorManifest
from gradpipe.errors import IntegrityError, InvalidInputError, NotFoundError
from gradpipe.storage._pools import process_pool, read_threads
from gradpipe.storage.blocks import BlockToWrite, WriteStats
from gradpipe.storage.tensors import WRITE_WINDOW, WRITE_WINDOW_BYTES
from gradpipe.storage.versioner import (
    ChunkVersioner,
    KeyframeValues,
    ParentChunk,
    Prediction,
    VersionChunk,
    account,
)

if TYPE_CHECKING:
    from gradpipe.storage.store import Store

__all__ = [
    "ChainParent",
    "Predictor",
    "parent_chunks",
    "parse_version_kind",
    "version_manifest",
    "write_chunk_version",
    "write_version",
]


#: A chunk's optimizer-replay prediction, by chunk index and element range (None: none).
Predictor = Callable[[int, int, int], Prediction | None]


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


def parent_chunks(
    manifest: TensorManifest, *, interval: int, present: set[str] | None = None
) -> list[ParentChunk]:
    """Every chunk of ``manifest`` as :class:`ParentChunk`, for versions with ``interval``.

    ``present``: the blocks known to be in the store (None: all of them, for a
    caller that reads every parent chunk anyway and so finds a lost one).
    """
    out = []
    depths = manifest.chain.replay_depths if manifest.chain is not None else ()
    for i, block in enumerate(manifest.blocks):
        links = manifest.deltas.get(i, ())
        needed = _chunk_blocks(manifest, i)
        age = _age(manifest, i)
        keyframe = None
        replay = manifest.replays.get(i)
        # A replayed chunk is no keyframe: its values are only known through its snapshot.
        if replay is None and block is not None and i not in manifest.inline and age + 1 < interval:
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
                replay,
                depths[i] if depths else 0,
            )
        )
    return out


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
    predict: Predictor | None = None,
    replay_depth: int = 0,
    copy_to: np.ndarray | None = None,
) -> TensorManifest:
    """Write ``array`` as the next version after ``parent`` (None: the first, all full).

    Returns the (not yet stored) manifest. ``delta`` is the delta kind
    (``int``, ``xor``, or the lossy ``sparse`` with ``threshold``). With
    ``parallel`` the chunks are encoded on the process's encoding pool; a
    caller that writes many tensors at once on its own threads passes False.
    A graph that computes a version chunk by chunk uses the same steps one
    chunk per task: :func:`parent_chunks`, :func:`write_chunk_version` and
    :func:`version_manifest`.

    ``predict`` (a snapshot written with optimizer replay) gives a chunk's predicted values
    by its index and element range on the parent's grid, or None; ``replay_depth`` is the
    version's depth (the replays a read of it makes, > 0 with ``predict``; design note 016).

    ``copy_to``, a contiguous array of ``array``'s stored dtype and size, receives a copy of
    each chunk before it is hashed: the version is then of those values even if another
    thread changes ``array`` meanwhile, and the caller keeps them (the copies are made on
    the encoding threads, without the GIL, rather than in one pass afterwards).
    """
    store.check_writable()
    kind, threshold = parse_version_kind(delta, threshold, array.dtype)
    interval = parse_keyframe_interval(keyframe_interval)
    stats = stats if stats is not None else WriteStats()
    dtype = canonical_dtype(array.dtype)
    flat = np.ascontiguousarray(array, dtype=dtype).reshape(-1)
    name = dtype_name(dtype)
    if copy_to is not None:
        if not copy_to.flags.c_contiguous or copy_to.dtype != dtype or copy_to.size != flat.size:
            raise InvalidInputError(
                f"copy_to must be a C-contiguous {name} array of {flat.size} elements, "
                f"not {copy_to.dtype} of {copy_to.size} (contiguous: {copy_to.flags.c_contiguous})"
            )
        copy_to = copy_to.reshape(-1)
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
    if base is None:
        predict, replay_depth = None, 0  # a prediction is made on the parent's grid
    writer = ChunkVersioner(
        store, kind=kind, threshold=threshold, interval=interval, replay_depth=replay_depth
    )
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
            values = flat[start:stop]
            if copy_to is not None:
                np.copyto(copy_to[start:stop], values)
                values = copy_to[start:stop]
            if parents is None or finder is None:
                return writer.chunk(values, None, _no_keyframe, where=where)
            found = functools.partial(finder, i)
            prediction = None if predict is None else predict(i, start, stop)
            return writer.chunk(values, parents[i], found, where=where, prediction=prediction)

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
    replays = {i: c.replay for i, c in enumerate(chunks) if c.replay is not None}
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
            replay_depths=tuple(c.replay_depth for c in chunks) if replays else (),
        ),
        replays=replays,
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
    block, links, replay = manifest.blocks[i], manifest.deltas.get(i), manifest.replays.get(i)
    if links:
        return [*(link.block for link in links), links[-1].base]
    if replay is not None:  # its residual (the prediction is made, not stored)
        return [] if replay.block is None else [replay.block]
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


def _pool() -> ThreadPoolExecutor:
    """The process's encoding pool (apart from the decoding one: a writer reads keyframes)."""
    return process_pool("encode")
