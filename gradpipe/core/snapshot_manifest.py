"""The manifest of a training-state snapshot, one version of a named chain.

A snapshot keeps the state's skeleton (the nesting, and every value that is
not an array, encoded exactly: see :mod:`gradpipe.core.state`) and one tensor
manifest per array, embedded, written as the next version of the same array
in the previous snapshot. ``previous`` links the versions of a name, newest
first, the way a commit links its parent: the ref ``snapshots/<name>``
points at the newest, and everything older stays reachable from it until
``prune`` writes a shorter chain. ``content`` is the id of what the caller
gave, without time or history (see :mod:`gradpipe.snapshots.content`): the
same state saved at the same step again is found by it, not written twice.

A version written with optimizer replay (format 5) keeps a ``replay`` record:
the gradient its step applied (an aggregate, a child of the snapshot so gc
keeps it; or recorded tensors, embedded beside the state's) and the optimizer
steps its chunks are predicted with (:mod:`gradpipe.core.replay_record`).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

from gradpipe.core.display import printable
from gradpipe.core.encoding import decode_float, encode_float
from gradpipe.core.ids import parse_id
from gradpipe.core.manifest import Manifest
from gradpipe.core.names import parse_name
from gradpipe.core.replay_record import ReplayRecord
from gradpipe.core.tensor_manifest import EmbeddedTensors, LazyTensors, TensorManifest
from gradpipe.errors import InvalidInputError

__all__ = ["SnapshotManifest"]


@dataclass(frozen=True)
class SnapshotManifest(EmbeddedTensors, Manifest):
    """One snapshot: step, time, loss, metadata, the state's skeleton and its tensors.

    ``content`` (None in versions written before it was kept) identifies the
    state, loss and metadata alone, so two versions of one content share it.
    """

    type: ClassVar[str] = "snapshot"

    name: str
    step: int
    time: str
    previous: str | None
    state: dict[str, Any]  # the skeleton of gradpipe.core.state
    tensors: Mapping[str, str]  # array key -> tensor manifest id
    embedded: Mapping[str, TensorManifest] = field(default_factory=dict)
    loss: float | None = None
    metadata: dict[str, str] = field(default_factory=dict)
    content: str | None = None
    replay: ReplayRecord | None = None

    def __post_init__(self) -> None:
        parse_name(self.name, what="snapshot name")
        if isinstance(self.step, bool) or not isinstance(self.step, int) or self.step < 0:
            raise InvalidInputError(
                f"snapshot step must be an integer >= 0, not {printable(self.step)}"
            )
        for ref in (self.previous, self.content):
            if ref is not None:
                parse_id(ref)
        for tensor_id in self.tensors.values():
            parse_id(tensor_id)
        listed = set(self.tensors.values()) | set(self.gradient_tensors)
        for tensor_id in self.embedded:
            if tensor_id not in listed:
                raise InvalidInputError(f"embedded tensor {tensor_id} is not one of the snapshot's")
        if self.replay is not None:
            if self.previous is None:
                raise InvalidInputError("a replay version has no previous version to replay")
            unknown = sorted(set(self.replay.array_keys()) - set(self.tensors))
            if unknown:
                raise InvalidInputError(
                    f"replay names arrays the snapshot lacks: {printable(unknown[:5])}"
                )

    @property
    def gradient_tensors(self) -> tuple[str, ...]:
        """Ids of the recorded gradient tensors (embedded; not part of the state)."""
        if self.replay is None or self.replay.gradient is None:
            return ()
        return tuple(dict.fromkeys(self.replay.gradient.recorded.values()))

    def _state_manifests(self) -> Iterator[TensorManifest]:
        for tensor_id in dict.fromkeys(self.tensors.values()):
            manifest = self.embedded.get(tensor_id)
            if manifest is not None:
                yield manifest

    @property
    def stored_bytes(self) -> int:
        """Bytes this snapshot added (its tensors' new blocks), as written; a recorded
        gradient's are :attr:`gradient_bytes`."""
        return sum(m.chain.stored_bytes for m in self._state_manifests() if m.chain is not None)

    @property
    def full_bytes(self) -> int:
        """Bytes its tensors would take stored on their own."""
        return sum(m.chain.full_bytes for m in self._state_manifests() if m.chain is not None)

    @property
    def gradient_bytes(self) -> int:
        """Bytes of the gradient recorded with it (0: none, or an aggregate kept by its run)."""
        total = 0
        for tensor_id in self.gradient_tensors:
            manifest = self.embedded.get(tensor_id)
            if manifest is not None and manifest.chain is not None:
                total += manifest.chain.stored_bytes
        return total

    @property
    def needs_previous(self) -> bool:
        """Whether reading it replays through the versions before it (optimizer replay)."""
        return any(m.replays for m in self._state_manifests())

    @property
    def replay_depth(self) -> int:
        """The most optimizer replays a read of one of its chunks makes (0: none)."""
        return max((m.replay_depth for m in self._state_manifests()), default=0)

    @property
    def logical_bytes(self) -> int:
        """Uncompressed bytes of its arrays, each counted: identical arrays share one
        embedded manifest, but a state that holds two holds twice the bytes. (Stored and
        full bytes count a shared manifest once: its blocks are written once.) A tensor
        whose manifest is not embedded (the format allows it) is not counted."""
        return sum(self.embedded[t].nbytes for t in self.tensors.values() if t in self.embedded)

    @property
    def depth(self) -> int:
        """The longest delta chain of any of its chunks (blocks a read decodes, minus one)."""
        return max((m.depth for m in self._state_manifests()), default=0)

    @property
    def age(self) -> int:
        """Versions since the oldest keyframe any of its chunks uses."""
        return max((m.age for m in self._state_manifests()), default=0)

    @property
    def lossy(self) -> bool:
        """Whether some tensor was stored lossily (a lossy codec, or a sparse delta)."""
        return any(not m.exact for m in self.embedded.values())

    @property
    def max_abs_error(self) -> float:
        """The largest error a lossy write left in any chunk (0.0 when exact)."""
        return max((m.max_abs_error for m in self.embedded.values()), default=0.0)

    def manifest_children(self) -> Iterator[str]:
        if self.previous is not None:
            yield self.previous
        yield from (t for t in dict.fromkeys(self.tensors.values()) if t not in self.embedded)
        if self.replay is not None and self.replay.gradient is not None:
            yield from self.replay.gradient.children()  # gc keeps the gradient a replay needs

    def format_needed(self) -> int:
        return 5 if self.replay is not None else 3

    def to_dict(self) -> dict[str, Any]:
        out = {
            "name": self.name,
            "step": self.step,
            "time": self.time,
            "previous": self.previous,
            "loss": encode_float(self.loss),
            "metadata": dict(self.metadata),
            "state": self.state,
            "tensors": dict(self.tensors),
            "embedded": {t: m.to_dict() for t, m in self.embedded.items()},
        }
        if self.content is not None:  # absent, an older version keeps its bytes and its id
            out["content"] = self.content
        if self.replay is not None:
            out["replay"] = self.replay.to_dict()
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> SnapshotManifest:
        state = data["state"]
        if not isinstance(state, dict):
            raise TypeError("snapshot state skeleton is not an object")
        return cls(
            name=str(data["name"]),
            step=int(data["step"]),
            time=str(data["time"]),
            previous=None if data["previous"] is None else str(data["previous"]),
            loss=decode_float(data["loss"]),
            metadata={str(k): str(v) for k, v in data["metadata"].items()},
            state=state,
            tensors={str(k): str(v) for k, v in data["tensors"].items()},
            embedded=LazyTensors(data["embedded"]),
            content=None if data.get("content") is None else str(data["content"]),
            replay=None if data.get("replay") is None else ReplayRecord.from_dict(data["replay"]),
        )
