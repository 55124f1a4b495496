"""How a chunk of a chained tensor is stored: in full, or as a delta against a keyframe.

A tensor stored as a version of another (a snapshot's parameters after the
previous snapshot's, a peer's gradient after its previous step's) lists, per
chunk that is a delta, its :class:`DeltaLink`: the chunk is ``link.block``
(the delta's bytes) applied to ``link.base``, the chunk's *keyframe*, a full
block. gradpipe writes one link per chunk (every delta against the keyframe);
readers follow any number, nearest first, each applying to the next one's
result. Every id a reader needs is in the manifest, so reads fetch a chunk's
blocks in one batch and gc keeps them alive from the manifest alone (see
docs/design/008).

A chunk of a snapshot version written with optimizer replay (format 5, docs/design/016)
lists its :class:`ReplayLink` instead: the chunk is ``link.block`` (a residual, or nothing
when the prediction was exact) applied to a *prediction* made from the previous version,
the step's gradient and the optimizer's hyperparameters. The prediction is no block: only
the snapshot's reader can make it, so generic tensor readers refuse such a chunk.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any, Final

from gradpipe.core.display import printable
from gradpipe.core.encoding import decode_float, encode_float
from gradpipe.core.ids import parse_id
from gradpipe.errors import InvalidInputError

if TYPE_CHECKING:
    from gradpipe.core.tensor_manifest import TensorManifest

__all__ = [
    "DEFAULT_KEYFRAME_INTERVAL",
    "ChainInfo",
    "ChainTotals",
    "DeltaLink",
    "ReplayLink",
    "parse_keyframe_interval",
]

#: A chunk is stored in full again every this many versions. Deltas are taken
#: against the keyframe, so K costs no read time (a read decodes the keyframe and
#: one delta); on parameters K = 8 stores ~0.54 of full copies against ~0.60 for
#: K = 4 and ~0.53 for K = 16 (design note 008, from benchmarks/bench_delta.py).
DEFAULT_KEYFRAME_INTERVAL: Final = 8


def parse_keyframe_interval(value: object) -> int:
    """A keyframe interval (versions per chain, >= 1; 1 stores every version in full)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InvalidInputError(
            f"keyframe interval must be an integer >= 1, not {printable(value)}"
        )
    return value


@dataclass(frozen=True, slots=True)
class DeltaLink:
    """One step of a chunk's chain: the delta block and the chunk it applies to."""

    block: str  # id of the delta's bytes (an ordinary block)
    base: str  # logical id of the chunk the delta applies to
    kind: str  # the delta kind: "int", "xor" or "sparse" (see gradpipe.codecs.delta)

    def __post_init__(self) -> None:
        parse_id(self.block)
        parse_id(self.base)
        if self.kind not in ("int", "xor", "sparse"):
            raise InvalidInputError(f"unknown delta kind {printable(self.kind)}")

    def to_list(self) -> list[str]:
        """Compact JSON form: ``[block, base, kind]``."""
        return [self.block, self.base, self.kind]

    @classmethod
    def from_list(cls, data: Sequence[Any]) -> DeltaLink:
        block, base, kind = data
        return cls(str(block), str(base), str(kind))


@dataclass(frozen=True, slots=True)
class ReplayLink:
    """How a chunk of a replay version is stored: a residual against a prediction.

    ``source`` is ``"step"`` (the prediction replays the optimizer step from the previous
    version's chunks and the gradient), ``"previous"`` (the prediction is the previous
    version's same chunk, unchanged: a parameter the step skipped) or ``"decay"`` (a moment
    kept without the gradient: the previous version's chunk times its decay factor).
    ``predicted`` is the hash of the prediction's bytes, so a reader whose arithmetic
    drifted says so instead of rebuilding other values. ``block`` is the residual
    (``kind``: ``"int"`` or ``"xor"`` of the bit patterns), None when the prediction was exact.
    """

    block: str | None
    predicted: str
    kind: str
    source: str = "step"

    def __post_init__(self) -> None:
        if self.block is not None:
            parse_id(self.block)
        parse_id(self.predicted)
        if self.kind not in ("int", "xor"):
            raise InvalidInputError(f"unknown replay residual kind {printable(self.kind)}")
        if self.source not in ("step", "previous", "decay"):
            raise InvalidInputError(f"unknown replay source {printable(self.source)}")

    def to_list(self) -> list[str | None]:
        """Compact JSON form: ``[block, predicted, kind, source]``."""
        return [self.block, self.predicted, self.kind, self.source]

    @classmethod
    def from_list(cls, data: Sequence[Any]) -> ReplayLink:
        if not isinstance(data, list | tuple) or len(data) != 4:
            raise InvalidInputError(f"a replay link is 4 fields, not {printable(data)}")
        block, predicted, kind, source = data
        return cls(None if block is None else str(block), str(predicted), str(kind), str(source))


@dataclass(frozen=True, slots=True)
class ChainInfo:
    """What chaining did for one tensor version (kept in its manifest, for reports).

    ``stored[i]`` is the bytes chunk ``i`` of this version added (its delta,
    residual or full block; 0 when unchanged from the parent), ``full[i]`` what
    the chunk takes stored on its own, ``ages[i]`` how many versions ago its keyframe
    was written (0: stored in full), ``replay_depths[i]`` how many optimizer
    replays a read of the chunk makes (empty: none anywhere), so
    ``sum(full) - sum(stored)`` is what the chain saved against independent storage.
    ``parent`` is the id of the tensor this version was written against
    (provenance only: reads and gc never follow it, so pruning the parent
    leaves it dangling by design).
    """

    parent: str | None
    keyframe_interval: int
    stored: tuple[int, ...]
    full: tuple[int, ...]
    ages: tuple[int, ...] = ()
    lossy: bool = False
    max_abs_error: float = 0.0
    replay_depths: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.parent is not None:
            parse_id(self.parent)
        parse_keyframe_interval(self.keyframe_interval)
        n = len(self.full)
        if (
            len(self.stored) != n
            or len(self.ages) not in (0, n)
            or len(self.replay_depths) not in (0, n)
        ):
            raise InvalidInputError("chain info lists sizes, ages or depths for different chunks")
        if any(d < 0 for d in self.replay_depths):
            raise InvalidInputError("chain info lists a negative replay depth")
        if any(n < 0 for n in (*self.stored, *self.full)):
            raise InvalidInputError("chain info lists a negative size")

    @property
    def stored_bytes(self) -> int:
        """Bytes this version added to the store."""
        return sum(self.stored)

    @property
    def full_bytes(self) -> int:
        """Bytes this version would take stored on its own."""
        return sum(self.full)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "parent": self.parent,
            "keyframe_interval": self.keyframe_interval,
            "stored": list(self.stored),
            "full": list(self.full),
            "ages": list(self.ages),
            "lossy": self.lossy,
            "max_abs_error": encode_float(self.max_abs_error),
        }
        if self.replay_depths:  # absent, a version without replay keeps its bytes and its id
            out["replay_depths"] = list(self.replay_depths)
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ChainInfo:
        return cls(
            parent=None if data["parent"] is None else str(data["parent"]),
            keyframe_interval=int(data["keyframe_interval"]),
            stored=tuple(int(n) for n in data["stored"]),
            full=tuple(int(n) for n in data["full"]),
            ages=tuple(int(n) for n in data.get("ages", ())),
            lossy=bool(data.get("lossy", False)),
            max_abs_error=decode_float(data.get("max_abs_error", 0.0)) or 0.0,
            replay_depths=tuple(int(n) for n in data.get("replay_depths", ())),
        )


@dataclass
class ChainTotals:
    """What chaining did for many tensor versions, chunk by chunk (for reports; accumulates).

    Each stored chunk of a version is counted once: ``delta_chunks`` were
    stored as a new delta, ``full_chunks`` as a full block (a keyframe, a
    first version, or a chunk whose delta was no smaller), ``unchanged_chunks``
    were equal to the parent's chunk and added nothing (content addressing
    would have stored nothing for them without a chain, too), ``replay_chunks``
    were stored against an optimizer replay (``exact_chunks`` of them with no
    residual at all). Chunks kept
    inline or all-zero are not counted: they are never delta-encoded.
    ``stored_bytes`` is what the delta and full chunks took, ``full_bytes``
    what they would have taken all stored in full, so ``saved_bytes`` is what
    the deltas saved against an ingest without chains.
    """

    tensors: int = 0
    chained_tensors: int = 0  # tensors written against a parent version
    delta_chunks: int = 0
    full_chunks: int = 0
    unchanged_chunks: int = 0
    replay_chunks: int = 0  # stored as a residual against an optimizer replay
    exact_chunks: int = 0  # of those, predicted exactly: no block at all
    stored_bytes: int = 0
    full_bytes: int = 0
    max_depth: int = 0

    @property
    def saved_bytes(self) -> int:
        """Bytes the deltas saved against storing the same chunks in full."""
        return self.full_bytes - self.stored_bytes

    @property
    def saved_fraction(self) -> float:
        """``saved_bytes`` over ``full_bytes`` (0.0 when nothing was stored)."""
        return self.saved_bytes / self.full_bytes if self.full_bytes else 0.0

    def add_version(self, manifest: TensorManifest) -> None:
        """Count the chunks of one tensor version written with a chain."""
        info = manifest.chain
        self.tensors += 1
        if info is None:
            return
        self.chained_tensors += info.parent is not None
        self.max_depth = max(self.max_depth, manifest.depth)
        for i, block in enumerate(manifest.blocks):
            if block is None or i in manifest.inline:
                continue
            if i in manifest.replays:
                self.replay_chunks += 1
                self.exact_chunks += manifest.replays[i].block is None
                self.stored_bytes += info.stored[i]
                self.full_bytes += info.full[i]
                continue
            if info.stored[i] == 0:
                self.unchanged_chunks += 1
                continue
            if i in manifest.deltas:
                self.delta_chunks += 1
            else:
                self.full_chunks += 1
            self.stored_bytes += info.stored[i]
            self.full_bytes += info.full[i]

    def add(self, other: ChainTotals) -> None:
        """Accumulate ``other`` into this one."""
        for f in fields(self):
            mine, theirs = getattr(self, f.name), getattr(other, f.name)
            setattr(self, f.name, max(mine, theirs) if f.name == "max_depth" else mine + theirs)

    def to_dict(self) -> dict[str, Any]:
        """JSON-able form."""
        out: dict[str, Any] = {f.name: getattr(self, f.name) for f in fields(self)}
        out["saved_bytes"] = self.saved_bytes
        out["saved_fraction"] = round(self.saved_fraction, 4)
        return out
