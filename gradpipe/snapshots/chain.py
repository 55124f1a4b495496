"""The versions of a named snapshot chain: its ref, its head, its log, and finding a version.

Each name's newest version is the target of the ref ``snapshots/<name>``; each version
names its parent, so the log is a walk from the head.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from gradpipe.core.chain import ChainTotals
from gradpipe.core.display import PATH_LIMIT, printable, printable_names
from gradpipe.core.names import parse_name
from gradpipe.core.snapshot_manifest import SnapshotManifest
from gradpipe.core.tensor_manifest import TensorManifest
from gradpipe.errors import IntegrityError, NotFoundError

if TYPE_CHECKING:
    from gradpipe.storage.store import Store

__all__ = [
    "SnapshotInfo",
    "chain_head",
    "find_snapshot",
    "read_version",
    "snapshot_head",
    "snapshot_log",
    "snapshot_ref",
    "snapshot_tensor",
    "snapshot_versions",
]


def snapshot_ref(name: str) -> str:
    """The ref that names a snapshot chain: ``snapshots/<name>``."""
    return f"snapshots/{parse_name(name, what='snapshot name')}"


@dataclass(frozen=True)
class SnapshotInfo:
    """One version of a snapshot chain, as ``gradpipe log`` lists it."""

    id: str
    name: str
    step: int
    time: str
    loss: float | None
    stored_bytes: int  # what this version added to the store
    full_bytes: int  # what it would take stored on its own
    logical_bytes: int  # uncompressed size of its arrays
    depth: int  # longest delta chain of any chunk (0 or 1: deltas are against keyframes)
    age: int = 0  # versions since the oldest keyframe it uses (< the keyframe interval)
    lossy: bool = False  # a sparse delta dropped or rounded changes
    max_abs_error: float = 0.0
    metadata: dict[str, str] = field(default_factory=dict)
    #: Chunks by how this version stored them: full, delta, unchanged, replay (exact: of
    #: those, predicted exactly and stored as nothing).
    encoding: dict[str, int] = field(default_factory=dict)
    replay_depth: int = 0  # most optimizer replays a read of one chunk makes
    gradient: str = ""  # the gradient its replay applied ("" when not replayed)
    gradient_bytes: int = 0  # a recorded gradient's bytes (not in stored_bytes)

    @property
    def ratio(self) -> float:
        """Stored bytes over a full (independently compressed) copy's."""
        return self.stored_bytes / self.full_bytes if self.full_bytes else 1.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "name": self.name,
            "step": self.step,
            "time": self.time,
            "loss": None if self.loss is None or not math.isfinite(self.loss) else self.loss,
            "stored_bytes": self.stored_bytes,
            "full_bytes": self.full_bytes,
            "logical_bytes": self.logical_bytes,
            "ratio": self.ratio,
            "depth": self.depth,
            "age": self.age,
            "lossy": self.lossy,
            "max_abs_error": self.max_abs_error if math.isfinite(self.max_abs_error) else None,
            "metadata": dict(self.metadata),
            "encoding": dict(self.encoding),
            "replay_depth": self.replay_depth,
            "gradient": self.gradient,
            "gradient_bytes": self.gradient_bytes,
        }

    @classmethod
    def of(cls, snapshot_id: str, manifest: SnapshotManifest) -> SnapshotInfo:
        return cls(
            snapshot_id,
            manifest.name,
            manifest.step,
            manifest.time,
            manifest.loss,
            manifest.stored_bytes,
            manifest.full_bytes,
            manifest.logical_bytes,
            manifest.depth,
            manifest.age,
            manifest.lossy,
            manifest.max_abs_error,
            dict(manifest.metadata),
            _encoding(manifest),
            manifest.replay_depth,
            "" if manifest.replay is None else manifest.replay.describe(),
            manifest.gradient_bytes,
        )


def _encoding(manifest: SnapshotManifest) -> dict[str, int]:
    """Chunks of a version by how they were stored (each tensor manifest counted once)."""
    totals = ChainTotals()
    for tensor_id in dict.fromkeys(manifest.tensors.values()):
        tensor = manifest.embedded.get(tensor_id)
        if tensor is not None:
            totals.add_version(tensor)
    return {
        "full": totals.full_chunks,
        "delta": totals.delta_chunks,
        "unchanged": totals.unchanged_chunks,
        "replay": totals.replay_chunks,
        "exact": totals.exact_chunks,
    }


def chain_head(store: Store, name: str) -> str | None:
    """The id of the chain's newest version; None before its first."""
    entry = store.refs.entry(snapshot_ref(name))
    return None if entry is None else entry.target


def snapshot_head(store: Store, name: str) -> tuple[str, SnapshotManifest]:
    """The newest snapshot of ``name``: its id and manifest (reads no array)."""
    snapshot_id, manifest = next(snapshot_versions(store, name))
    return snapshot_id, manifest


def read_version(store: Store, snapshot_id: str, name: str) -> SnapshotManifest:
    """One version's manifest (``name`` for messages)."""
    return store.get_typed(snapshot_id, SnapshotManifest, context=f"snapshot {printable(name)}")


def snapshot_versions(
    store: Store, name: str, *, head: str | None = None
) -> Iterator[tuple[str, SnapshotManifest]]:
    """The versions of ``name``, newest first.

    ``head`` starts the walk at that version (an id the ref pointed at once)
    instead of the newest, so a reader can pin the chain as it was.
    """
    snapshot_id = head if head is not None else chain_head(store, name)
    if snapshot_id is None:
        known = printable_names(n.split("/", 1)[1] for n in store.refs.list("snapshots"))
        raise NotFoundError(
            f"no snapshot {printable(name)} in store {printable(store.url, limit=PATH_LIMIT)} "
            f"(snapshots: {known or 'none'})"
        )
    seen: set[str] = set()
    while snapshot_id is not None:
        if snapshot_id in seen:
            raise IntegrityError(f"snapshot {printable(name)}: its history loops at {snapshot_id}")
        seen.add(snapshot_id)
        manifest = read_version(store, snapshot_id, name)
        yield snapshot_id, manifest
        snapshot_id = manifest.previous


def snapshot_log(store: Store, name: str) -> list[SnapshotInfo]:
    """Every version of ``name``, oldest first (what ``gradpipe log`` prints)."""
    return [SnapshotInfo.of(i, m) for i, m in reversed(list(snapshot_versions(store, name)))]


def find_snapshot(store: Store, name: str, step: int | None = None) -> tuple[str, SnapshotManifest]:
    """The newest snapshot of ``name`` (at ``step``, if given): its id and manifest."""
    steps = []
    for snapshot_id, manifest in snapshot_versions(store, name):
        if step is None or manifest.step == step:
            return snapshot_id, manifest
        steps.append(manifest.step)
    shown = ", ".join(map(str, sorted(steps)[-10:]))
    raise NotFoundError(f"snapshot {printable(name)} has no step {step} (latest steps: {shown})")


def snapshot_tensor(store: Store, manifest: SnapshotManifest, key: str) -> TensorManifest:
    """A snapshot's tensor manifest: embedded (as gradpipe writes them) or stored apart."""
    tensor_id = manifest.tensors[key]
    found = manifest.embedded.get(tensor_id)
    if found is not None:
        return found
    where = f"snapshot {printable(manifest.name)} at step {manifest.step}, {printable(key)}"
    return store.get_typed(tensor_id, TensorManifest, context=where)
