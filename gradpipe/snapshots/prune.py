"""Retention for snapshot chains: keep some versions, relink them, let gc take the rest.

``prune`` writes the kept versions as a new chain (each one's ``previous``
now the kept version before it) and moves the ref to the new head with one
compare-and-swap; nothing is deleted here, so a crash leaves the old chain
whole. ``gradpipe gc`` then reclaims what only the dropped versions used.
Kept versions keep their step, time, loss, metadata and tensors exactly;
their ids change, because a version's id covers its history (as a rebased
git commit's does).

No data is rewritten: every delta is taken against a keyframe, and a kept
version's manifest lists the keyframes it needs, so a keyframe written by a
dropped version stays exactly as long as a kept delta uses it ("re-keyframing"
is never needed to keep a version readable). A dropped version's own deltas,
and keyframes no kept version uses, are what gc reclaims.

A version written with optimizer replay is read through the version before it
(design note 016), so a kept one keeps its previous version too, and so on
down to a self-contained one (at most the replay interval minus one more per
kept version); the report lists them as ``kept_for_replay``.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Final

from gradpipe.core.display import printable
from gradpipe.core.html import ReportHtml
from gradpipe.core.ids import block_key
from gradpipe.core.manifest import manifest_id
from gradpipe.core.snapshot_manifest import SnapshotManifest
from gradpipe.errors import ConflictError, InvalidInputError
from gradpipe.snapshots.api import snapshot_ref, snapshot_versions
from gradpipe.storage.walk import walk_reachable

if TYPE_CHECKING:
    from gradpipe.storage.store import Store

__all__ = ["PruneReport", "prune"]

_MAX_ATTEMPTS: Final = 8


@dataclass
class PruneReport(ReportHtml):
    """What :func:`prune` kept and dropped (or, with ``dry_run``, would)."""

    name: str
    dry_run: bool
    kept_steps: list[int] = field(default_factory=list)
    dropped_steps: list[int] = field(default_factory=list)
    freed_blocks: int = 0  # blocks only the dropped versions used (gc deletes them)
    freed_bytes: int = 0
    kept_for_replay: list[int] = field(default_factory=list)  # steps a kept replay reads

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
            "kept_for_replay": self.kept_for_replay,
        }

    def summary(self) -> str:
        verb = "would drop" if self.dry_run else "dropped"
        if not self.dropped_steps:
            return (
                f"snapshot {printable(self.name)}: nothing to prune ({len(self.kept_steps)} kept)"
            )
        lines = [
            f"snapshot {printable(self.name)}: {verb} {len(self.dropped_steps)} version(s) "
            f"(steps {_steps(self.dropped_steps)}), kept {len(self.kept_steps)} "
            f"(steps {_steps(self.kept_steps)})",
            f"{self.freed_blocks} block(s), {self.freed_bytes / 2**20:.1f} MiB used only by "
            "dropped versions: `gradpipe gc` reclaims them"
            + (" once the ref has moved" if self.dry_run else ""),
        ]
        if self.kept_for_replay:
            lines.append(
                f"kept {len(self.kept_for_replay)} more (steps {_steps(self.kept_for_replay)}): "
                "kept versions replay through them"
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
        raise InvalidInputError(f"keep_last must be an integer >= 1, not {printable(keep_last)}")
    if keep_every is not None and (
        isinstance(keep_every, bool) or not isinstance(keep_every, int) or keep_every < 1
    ):
        raise InvalidInputError(f"keep_every must be an integer >= 1, not {printable(keep_every)}")
    if not dry_run:
        store.check_writable()
    for _ in range(_MAX_ATTEMPTS):
        with store.writing(f"prune {name}") if not dry_run else nullcontext():
            chain = list(snapshot_versions(store, name))[::-1]  # oldest first
            head_id = chain[-1][0]
            kept = chain[-keep_last:]
            if keep_every is not None:
                every = [v for v in chain[:-keep_last] if v[1].step % keep_every == 0]
                kept = every + kept
            kept_ids = {i for i, _ in kept}
            for_replay = _replay_bases(chain, kept_ids)
            kept_ids |= set(for_replay)
            kept = [v for v in chain if v[0] in kept_ids]
            report = PruneReport(
                name,
                dry_run,
                [m.step for _, m in kept],
                [m.step for i, m in chain if i not in kept_ids],
                kept_for_replay=[m.step for i, m in chain if i in for_replay],
            )
            if not report.dropped_steps:
                return report
            new_head, rechained = _rechain(store, kept, dry_run=dry_run)
            _count_freed(store, name, [m for _, m in chain], rechained, report)
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
    raise ConflictError(f"snapshot {printable(name)} kept moving while pruning; retry")


def _replay_bases(chain: list[tuple[str, SnapshotManifest]], kept: set[str]) -> set[str]:
    """Versions not in ``kept`` that a kept one replays through (``chain`` oldest first)."""
    needed: set[str] = set()
    for i in range(len(chain) - 1, 0, -1):
        version_id, manifest = chain[i]
        if (version_id in kept or version_id in needed) and manifest.needs_previous:
            base_id = chain[i - 1][0]
            if base_id not in kept:
                needed.add(base_id)
    return needed


def _count_freed(
    store: Store,
    name: str,
    old: list[SnapshotManifest],
    new: list[SnapshotManifest],
    report: PruneReport,
) -> None:
    """Blocks the old chain uses and neither the new one nor any other ref does, and their size.

    Walks what every other ref reaches (as gc's mark does), so blocks shared
    with another snapshot name, a run or a named tensor are not counted.
    """
    used = {b for m in new for b in m.data_children()}
    dropped = {b for m in old for b in m.data_children()} - used
    if dropped:
        elsewhere = walk_reachable(store, skip_refs={snapshot_ref(name)})
        dropped -= set(elsewhere.data)
    if not dropped:
        return
    wanted = {block_key(b) for b in dropped}
    sizes = [info.size for info in store.backend.list("blocks") if info.key in wanted]
    report.freed_blocks = len(sizes)
    report.freed_bytes = sum(sizes)


def _rechain(
    store: Store, kept: list[tuple[str, SnapshotManifest]], *, dry_run: bool
) -> tuple[str, list[SnapshotManifest]]:
    """The kept versions linked into a new chain, oldest first: the new head's id, the chain."""
    out: list[SnapshotManifest] = []
    previous_id: str | None = None
    for _, version in kept:
        manifest = replace(version, previous=previous_id)
        previous_id = manifest_id(manifest) if dry_run else store.put_manifest(manifest)
        out.append(manifest)
    assert previous_id is not None  # keep_last >= 1
    return previous_id, out
