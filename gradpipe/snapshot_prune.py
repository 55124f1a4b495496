"""Retention for snapshot chains: keep some versions, re-chain them, let gc take the rest.

``prune`` writes a new, shorter chain of the kept versions and moves the ref
to it with one compare-and-swap; nothing is deleted here, so a crash leaves
the old chain whole. ``gradpipe gc`` then reclaims what only the dropped
versions used. Kept versions keep their step, time, loss, metadata and
values bit-exactly; their ids change, because a version's id covers its
history (as a rebased git commit's does).

Re-chaining a kept version, tensor by tensor:

- chunks stored in full stay as they are;
- a chunk whose delta applies to the previous *kept* version (its original
  parent was kept) keeps its delta block, and its chain now continues with
  that version's (possibly shortened) chain: no data is rewritten;
- otherwise (the first kept version, a parent that was dropped, a chain that
  would grow past the keyframe interval) the tensor is rebuilt from the old
  chain, whose blocks are all still there, and written again against the
  previous kept version by :func:`~gradpipe.storage.chains.write_version`: a
  new keyframe or a new delta, whichever is smaller.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Final

from gradpipe.core.chain import DeltaLink
from gradpipe.core.ids import block_key
from gradpipe.core.manifest import manifest_id
from gradpipe.core.snapshot_manifest import SnapshotManifest
from gradpipe.core.tensor_manifest import TensorManifest
from gradpipe.errors import ConflictError, InvalidInputError
from gradpipe.snapshot import find_snapshot, snapshot_ref
from gradpipe.storage.blocks import WriteStats
from gradpipe.storage.chains import ChainParent, write_version
from gradpipe.storage.tensors import read_tensor

if TYPE_CHECKING:
    from gradpipe.storage.store import Store

__all__ = ["PruneReport", "prune"]

_MAX_ATTEMPTS: Final = 8


@dataclass
class PruneReport:
    """What :func:`prune` kept and dropped (or, with ``dry_run``, would)."""

    name: str
    dry_run: bool
    kept_steps: list[int] = field(default_factory=list)
    dropped_steps: list[int] = field(default_factory=list)
    freed_blocks: int = 0  # blocks only the dropped versions used (gc deletes them)
    freed_bytes: int = 0
    rewritten_tensors: int = 0  # tensors rebuilt as a new keyframe or delta
    written_bytes: int = 0  # what re-chaining stored

    @property
    def ok(self) -> bool:
        return True

    def to_dict(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "name": self.name,
            "dry_run": self.dry_run,
            "kept_steps": self.kept_steps,
            "dropped_steps": self.dropped_steps,
            "freed_blocks": self.freed_blocks,
            "freed_bytes": self.freed_bytes,
            "rewritten_tensors": self.rewritten_tensors,
            "written_bytes": self.written_bytes,
        }

    def summary(self) -> str:
        verb = "would drop" if self.dry_run else "dropped"
        if not self.dropped_steps:
            return f"snapshot {self.name!r}: nothing to prune ({len(self.kept_steps)} kept)"
        lines = [
            f"snapshot {self.name!r}: {verb} {len(self.dropped_steps)} version(s) "
            f"(steps {_steps(self.dropped_steps)}), kept {len(self.kept_steps)} "
            f"(steps {_steps(self.kept_steps)})",
            f"{self.freed_blocks} block(s), {self.freed_bytes / 2**20:.1f} MiB used only by "
            "dropped versions: `gradpipe gc` reclaims them"
            + (" once the ref has moved" if self.dry_run else ""),
        ]
        if self.dry_run:
            lines.append(f"re-chaining would rebuild {self.rewritten_tensors} tensor(s)")
        else:
            lines.append(
                f"re-chained: {self.rewritten_tensors} tensor(s) rebuilt, "
                f"{self.written_bytes / 2**20:.1f} MiB written"
            )
        return "\n".join(lines)


def _steps(steps: Sequence[int]) -> str:
    return ", ".join(map(str, steps[:12])) + (", ..." if len(steps) > 12 else "")


def prune(
    store: Store,
    name: str,
    *,
    keep_last: int,
    keep_every: int | None = None,
    dry_run: bool = False,
) -> PruneReport:
    """Keep the newest ``keep_last`` snapshots of ``name`` (and every step that is a
    multiple of ``keep_every``); drop the others from the chain.

    The kept versions stay bit-exact and reconstructible; run :func:`gc` afterwards
    to reclaim the space. With ``dry_run`` nothing is written.
    """
    if isinstance(keep_last, bool) or not isinstance(keep_last, int) or keep_last < 1:
        raise InvalidInputError(f"keep_last must be an integer >= 1, not {keep_last!r}")
    if keep_every is not None and (
        isinstance(keep_every, bool) or not isinstance(keep_every, int) or keep_every < 1
    ):
        raise InvalidInputError(f"keep_every must be an integer >= 1, not {keep_every!r}")
    if not dry_run:
        store.check_writable()
    for _ in range(_MAX_ATTEMPTS):
        with store.writing(f"prune {name}") if not dry_run else _NoLease():
            head_id, _ = find_snapshot(store, name)
            chain = _chain(store, name, head_id)
            kept = chain[-keep_last:]
            if keep_every is not None:
                every = [v for v in chain[:-keep_last] if v[1].step % keep_every == 0]
                kept = every + kept
            kept_ids = {i for i, _ in kept}
            report = PruneReport(
                name,
                dry_run,
                [m.step for _, m in kept],
                [m.step for i, m in chain if i not in kept_ids],
            )
            if not report.dropped_steps:
                return report
            new_head, rechained = _rechain(store, name, kept, report, dry_run=dry_run)
            _count_freed(store, [m for _, m in chain], rechained, report)
            if dry_run:
                return report
            try:
                store.refs.set(
                    snapshot_ref(name),
                    new_head,
                    expected=head_id,
                    message=f"prune: kept {len(kept)}, dropped {len(report.dropped_steps)}",
                )
            except ConflictError:
                continue  # a snapshot landed meanwhile: prune the chain it made
            return report
    raise ConflictError(f"snapshot {name!r} kept moving while pruning; retry")


class _NoLease:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def _chain(store: Store, name: str, head_id: str) -> list[tuple[str, SnapshotManifest]]:
    """Every version, oldest first."""
    out = []
    snapshot_id: str | None = head_id
    seen: set[str] = set()
    while snapshot_id is not None and snapshot_id not in seen:
        seen.add(snapshot_id)
        manifest = store.get_typed(snapshot_id, SnapshotManifest, context=f"snapshot {name!r}")
        out.append((snapshot_id, manifest))
        snapshot_id = manifest.previous
    return out[::-1]


def _count_freed(
    store: Store,
    old: list[SnapshotManifest],
    new: list[SnapshotManifest],
    report: PruneReport,
) -> None:
    """Blocks the old chain uses and the new one does not, and their stored size."""
    used = {b for m in new for b in m.data_children()}
    dropped = {b for m in old for b in m.data_children()} - used
    if not dropped:
        return
    wanted = {block_key(b) for b in dropped}
    sizes = [info.size for info in store.backend.list("blocks") if info.key in wanted]
    report.freed_blocks = len(sizes)
    report.freed_bytes = sum(sizes)


def _rechain(
    store: Store,
    name: str,
    kept: list[tuple[str, SnapshotManifest]],
    report: PruneReport,
    *,
    dry_run: bool,
) -> tuple[str, list[SnapshotManifest]]:
    """Write the kept versions as a new chain, oldest first: the new head's id, the chain.

    With ``dry_run`` nothing is written, and a tensor that needs rebuilding is
    taken to become a keyframe (its new blocks are not known without encoding).
    """
    stats = WriteStats()
    out: list[SnapshotManifest] = []
    previous_id: str | None = None
    previous: SnapshotManifest | None = None
    old_previous: str | None = None
    for old_id, version in kept:
        consecutive = previous is not None and version.previous == old_previous
        tensors: dict[str, str] = {}
        embedded: dict[str, TensorManifest] = {}
        for key, tensor_id in version.tensors.items():
            tensor = version.embedded[tensor_id]
            parent_id = previous.tensors.get(key) if previous is not None else None
            parent = previous.embedded[parent_id] if previous and parent_id else None
            new = None
            if consecutive or not tensor.deltas:
                new = _relinked(tensor, parent, parent_id)
            if new is None:
                where = f"snapshot {name!r}, step {version.step}, {key}"
                if dry_run:
                    new = replace(tensor, deltas={})
                else:
                    new = _rewritten(store, tensor, parent, parent_id, stats=stats, where=where)
                report.rewritten_tensors += 1
            new_id = manifest_id(new)
            tensors[key] = new_id
            embedded[new_id] = new
        manifest = replace(version, previous=previous_id, tensors=tensors, embedded=embedded)
        previous_id = manifest_id(manifest) if dry_run else store.put_manifest(manifest)
        previous, old_previous = manifest, old_id
        out.append(manifest)
    report.written_bytes = stats.stored_bytes
    assert previous_id is not None  # keep_last >= 1
    return previous_id, out


def _relinked(
    tensor: TensorManifest, parent: TensorManifest | None, parent_id: str | None
) -> TensorManifest | None:
    """``tensor`` with its chains continued on ``parent``'s new ones, or None if it cannot be."""
    if tensor.chain is None or not tensor.deltas:
        return tensor  # nothing chained: stands on its own
    if parent is None or (parent.dtype, parent.shape, parent.chunk_shape) != (
        tensor.dtype,
        tensor.shape,
        tensor.chunk_shape,
    ):
        return None
    interval = tensor.chain.keyframe_interval
    deltas: dict[int, tuple[DeltaLink, ...]] = {}
    for i, links in tensor.deltas.items():
        if parent.blocks[i] == tensor.blocks[i]:
            chained = parent.deltas.get(i, ())  # unchanged from the parent: share its chain
        elif links[0].base == parent.blocks[i] and i not in parent.inline:
            chained = (links[0], *parent.deltas.get(i, ()))
        else:
            return None
        if len(chained) >= interval:
            return None
        if chained:
            deltas[i] = chained
        elif parent.inline.get(i) is not None:
            return None  # the parent keeps this chunk inline: rewrite rather than copy frames
    chain = replace(tensor.chain, parent=parent_id)
    return replace(tensor, deltas=deltas, chain=chain)


def _rewritten(
    store: Store,
    tensor: TensorManifest,
    parent: TensorManifest | None,
    parent_id: str | None,
    *,
    stats: WriteStats,
    where: str,
) -> TensorManifest:
    """``tensor`` rebuilt and written again against ``parent`` (a keyframe if None)."""
    values = read_tensor(store, tensor, context=where)
    base = None
    if parent is not None:
        parent_values = read_tensor(store, parent, context=f"{where} (parent)")
        base = ChainParent(parent, parent_id, parent_values, trusted=True)
    interval = tensor.chain.keyframe_interval if tensor.chain is not None else None
    options: dict[str, Any] = {} if interval is None else {"keyframe_interval": interval}
    return write_version(store, values, base, stats=stats, where=where, **options)
