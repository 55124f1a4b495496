"""One chunk of a new version, decided: unchanged, zero, inline, in full, a delta or a replay.

:class:`ChunkVersioner` takes the decision against the chunk's keyframe (design note 008),
and, for a snapshot written with optimizer replay, against a :class:`Prediction` of the
chunk (design note 016);
:mod:`gradpipe.storage.chains` cuts a tensor into these chunks and records the version.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final

import numpy as np

from gradpipe.codecs.delta import DeltaCodec
from gradpipe.codecs.policy import estimate_size
from gradpipe.config import get_bytes, get_setting
from gradpipe.core.chain import DeltaLink, ReplayLink
from gradpipe.core.chunk_stats import ChunkStats, bit_nonzero, chunk_stats, stats_and_bit_nonzero
from gradpipe.core.dtypes import check_values, dtype_name
from gradpipe.core.ids import hash_bytes
from gradpipe.meter import RAW, digest_bytes
from gradpipe.storage.blocks import BlockToWrite, Frame, WriteStats

if TYPE_CHECKING:
    from gradpipe.storage.store import Store

__all__ = [
    "ChunkVersioner",
    "KeyframeValues",
    "ParentChunk",
    "Prediction",
    "VersionChunk",
    "account",
]

#: A delta at most this fraction of the parent's full copy wins without the
#: full encoding being made (halves the encoding work on parameters).
_CLEAR_WIN: Final = 0.8


#: A delta is kept only if at most this fraction of the full encoding: a
#: saving of a few percent does not pay for a second block on every read.
_MIN_GAIN: Final = 0.9


#: A delta whose size, estimated on a sample, is above this fraction of the full encoding's
#: is not made: it would almost surely miss :data:`_MIN_GAIN` (sampled estimates of both are
#: within a few percent; on Adam moments, where deltas gain little, this halves the encoding).
_HOPELESS: Final = _MIN_GAIN + 0.05


#: Chunks up to this many times ``inline-bytes`` are never delta-encoded: their
#: frames are a few KiB and may be kept inline, where no chain can reach them.
_SMALL_FACTOR: Final = 4


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
    replay: ReplayLink | None = None  # stored against an optimizer replay (then no keyframe)
    replay_depth: int = 0  # replays a read of it makes


@dataclass(frozen=True, slots=True)
class Prediction:
    """A chunk's values predicted by an optimizer replay, and the replays a read will make."""

    values: np.ndarray
    source: str = "step"  # or "decay": a moment predicted without the gradient


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
    replay: ReplayLink | None = None  # stored against an optimizer replay
    replay_depth: int = 0


#: Finds the values of a chunk's keyframe, when a delta is to be tried (None: not at hand).
KeyframeValues = Callable[[ParentChunk], np.ndarray | None]


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


class ChunkVersioner:
    """The per-chunk decisions of a new version (thread-safe: no state; picklable)."""

    def __init__(
        self,
        store: Store,
        *,
        kind: str,
        threshold: float,
        interval: int,
        replay_depth: int = 0,
    ) -> None:
        self.store = store
        self.kind, self.threshold, self.interval = kind, threshold, interval
        # The depth of this version's replayed chunks (0: none): one for the whole version,
        # so that every K-th version is self-contained and prune can drop what is before it.
        self.replay_depth = replay_depth
        self.inline_max = get_bytes("inline-bytes")
        self.level = int(get_setting("codec-level"))

    def chunk(
        self,
        chunk: np.ndarray,
        parent: ParentChunk | None,
        find_keyframe: KeyframeValues,
        *,
        where: str,
        prediction: Prediction | None = None,
    ) -> VersionChunk:
        """Decide how to store ``chunk``, the new values of ``parent`` (None: a first version).

        With a ``prediction`` (an optimizer replay; the versioner's ``replay_depth`` is then
        the version's, > 0), the chunk is stored as its residual when that is clearly the
        smallest, and as nothing at all when the prediction is exact.
        """
        check_values(chunk, where=where or "tensor")
        nonzero = bit_nonzero(chunk)
        if nonzero == 0:
            return VersionChunk(
                None, chunk_stats(chunk, bits_nonzero=0), outcome="zero", logical=chunk.nbytes
            )
        block_id = hash_bytes(chunk.view(np.uint8))
        if parent is not None and parent.block == block_id and parent.stored:
            same = self._same(parent, chunk, nonzero)
            if same is not None:
                return same
        record_stats = chunk_stats(chunk, bits_nonzero=nonzero)
        full_item = BlockToWrite(block_id, chunk, None, nonzero)
        if prediction is not None:
            replayed = self._replayed(full_item, record_stats, parent, prediction)
            if replayed is not None and prediction.source == "decay" and parent is not None:
                replayed = self._smallest(replayed, parent, find_keyframe, full_item, record_stats)
            if replayed is not None:
                return replayed
        if chunk.nbytes <= self.inline_max * _SMALL_FACTOR:
            return self._small(full_item, record_stats)
        base = None if parent is None or parent.keyframe is None else find_keyframe(parent)
        if base is None or parent is None or parent.keyframe is None:
            return self._full(full_item, self._encode(full_item), record_stats)
        return self._smaller(
            parent, chunk, (parent.keyframe, base), full=full_item, record_stats=record_stats
        )

    def _encode(self, item: BlockToWrite) -> Frame:
        return self.store.encode_frame(item, self.level)

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

    def _same(self, parent: ParentChunk, chunk: np.ndarray, nonzero: int) -> VersionChunk | None:
        """A chunk equal to its parent's; None when it must be stored anew (a replayed parent
        and a version that replays nothing: it is self-contained)."""
        if parent.replay is None:
            return self._unchanged(parent, chunk, nonzero)
        if self.replay_depth > 0:
            return self._previous(parent, chunk)
        return None

    def _smallest(
        self,
        replayed: VersionChunk,
        parent: ParentChunk,
        find_keyframe: KeyframeValues,
        full: BlockToWrite,
        record_stats: ChunkStats,
    ) -> VersionChunk:
        """A decay residual against the delta its keyframe gives: the smaller (a decay
        prediction is often no better than the keyframe's values, and costs reads)."""
        if replayed.write is None or parent.keyframe is None:
            return replayed
        base = find_keyframe(parent)
        if base is None:
            return replayed
        delta = self._smaller(parent, full.data, (parent.keyframe, base), full=full,
                              record_stats=record_stats)  # fmt: skip
        return delta if delta.links and delta.stored < replayed.stored else replayed

    def _previous(self, parent: ParentChunk, chunk: np.ndarray) -> VersionChunk:
        """A chunk equal to its parent's replayed one: read through the previous version.

        The parent's link predicts from the version before it, so it cannot be copied; this
        link's prediction is the previous version's chunk itself, at this version's depth.
        """
        assert parent.block is not None  # an all-zero chunk is never replayed
        link = ReplayLink(None, parent.block, "int", "previous")
        return VersionChunk(
            parent.block, parent.stats, None, (), 0, parent.full or 0, 0,
            logical=chunk.nbytes, outcome="unchanged", replay=link,
            replay_depth=self.replay_depth,
        )  # fmt: skip

    def _replayed(
        self,
        full: BlockToWrite,
        record_stats: ChunkStats,
        parent: ParentChunk | None,
        prediction: Prediction,
    ) -> VersionChunk | None:
        """The chunk as its residual against ``prediction``, if that is clearly the smallest.

        An exact prediction costs no block (a small chunk takes only that). Otherwise the
        residual is kept when at most :data:`_CLEAR_WIN` of the parent's full size (which moves
        little between versions), or :data:`_MIN_GAIN` of the chunk's own full encoding (a
        decay residual: smaller than it, and then than the keyframe's delta); else None, and
        the chunk is decided as without a prediction.
        """
        chunk = full.data
        predicted = np.ascontiguousarray(prediction.values)
        predicted_id = hash_bytes(predicted.view(np.uint8))
        kind = self.kind if self.kind in ("int", "xor") else "int"
        size = full_size = (parent.full or 0) if parent is not None else 0
        if predicted_id == full.block_id:
            residual_item = None
            size = 0
        else:
            if chunk.nbytes <= self.inline_max * _SMALL_FACTOR:
                return None  # a small chunk's residual frame would cost more than it is worth
            codec = DeltaCodec(kind, dtype_name(chunk.dtype)).bind(predicted)
            residual = codec.encode(chunk).view(chunk.dtype)
            residual_item = BlockToWrite(
                hash_bytes(residual.view(np.uint8)), residual, None, bit_nonzero(residual)
            )
            frame = self._encode(residual_item)
            size = len(frame)
            if size > _CLEAR_WIN * full_size:
                full_size = len(self._encode(full))
                # A decay residual needs only beat full here: the delta is tried next.
                if size > (_MIN_GAIN if prediction.source == "step" else 1.0) * full_size:
                    return None
            residual_item = BlockToWrite(
                residual_item.block_id, residual, None, residual_item.nonzero, frame
            )
        link = ReplayLink(
            None if residual_item is None else residual_item.block_id,
            predicted_id,
            kind,
            prediction.source,
        )
        return VersionChunk(
            full.block_id, record_stats, None, (), size, full_size or size, 0,
            logical=chunk.nbytes, write=residual_item, replay=link,
            replay_depth=self.replay_depth,
        )  # fmt: skip

    def _hopeless(self, delta: BlockToWrite, full: BlockToWrite, parent: ParentChunk) -> bool:
        """Whether sampled estimates put the delta's encoding clearly above the full one's."""
        estimated = estimate_size(delta.data, delta.nonzero, level=self.level)
        if estimated is None or estimated <= _CLEAR_WIN * (parent.full or 0):
            return False  # no estimate, or most likely a clear win: no full one needed
        full_size = estimate_size(full.data, full.nonzero, level=self.level)
        return full_size is not None and estimated > _HOPELESS * full_size

    def _small(self, item: BlockToWrite, record_stats: ChunkStats) -> VersionChunk:
        frame = self._encode(item)
        if len(frame) <= self.inline_max:
            size = len(frame)
            return VersionChunk(
                item.block_id, record_stats, bytes(frame), (), size, size,
                logical=item.data.nbytes, outcome="inline",
            )  # fmt: skip
        return self._full(item, frame, record_stats)

    def _full(self, item: BlockToWrite, frame: Frame, record_stats: ChunkStats) -> VersionChunk:
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
        if codec.lossless and self._hopeless(delta_item, full, parent):
            return self._full(full, self._encode(full), record_stats)
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
            record_stats = stats_and_bit_nonzero(rebuilt)[0]
            error = None if codec.exact else codec.max_abs_error
        links = (DeltaLink(delta_id, keyframe_id, self.kind),)
        write = BlockToWrite(delta_id, delta, None, delta_item.nonzero, delta_frame)
        return VersionChunk(
            block_id, record_stats, None, links, len(delta_frame), full_size, parent.age + 1,
            logical=chunk.nbytes, write=write, error=error,
        )  # fmt: skip
