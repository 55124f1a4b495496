"""``verify``: read everything reachable (or everything) and check it against its id.

Chunks stored against something other than their own block are rebuilt too: a
delta on its keyframe, and a snapshot's optimizer replay on the versions before
it and its gradient (:mod:`gradpipe.storage.replays`), each checked against the
chunk's id.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, cast

import numpy as np
from dask.utils import format_bytes

from gradpipe.core.dtypes import parse_dtype
from gradpipe.core.html import ReportHtml
from gradpipe.core.ids import block_key, hash_bytes, id_from_block_key, is_id
from gradpipe.core.manifest import Manifest, encode_manifest
from gradpipe.core.run_manifest import RunManifest
from gradpipe.core.run_shards import RunShard, ShardLink, link_mismatch
from gradpipe.core.snapshot_manifest import SnapshotManifest
from gradpipe.core.tensor_manifest import TensorManifest
from gradpipe.errors import IntegrityError, NotFoundError, UnsupportedFormatError
from gradpipe.storage.blocks import decode_block
from gradpipe.storage.reads import ChunkRead, decode_chunks
from gradpipe.storage.replays import PredictionDriftError, ReplayGraph, snapshot_version
from gradpipe.storage.store import Store
from gradpipe.storage.walk import Problem, walk_reachable

__all__ = ["VerifyReport", "verify"]

_BATCH = 32


@dataclass
class VerifyReport(ReportHtml):
    """What :func:`verify` checked and what it found wrong."""

    manifests: int = 0
    blocks: int = 0
    bytes: int = 0
    unreferenced: int = 0
    unchecked: int = 0
    problems: list[Problem] = field(default_factory=list)
    deleted_corrupt: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """True when nothing is missing or corrupt."""
        return not self.problems

    def to_dict(self) -> dict[str, Any]:
        """JSON-able form (what ``gradpipe verify --json`` prints)."""
        return {
            "ok": self.ok,
            "manifests": self.manifests,
            "blocks": self.blocks,
            "bytes": self.bytes,
            "unreferenced": self.unreferenced,
            "unchecked": self.unchecked,
            "problems": [p.to_dict() for p in self.problems],
            "deleted_corrupt": list(self.deleted_corrupt),
        }

    def summary(self) -> str:
        """A few lines for people."""
        head = (
            f"checked {self.manifests} manifests and {self.blocks} blocks "
            f"({format_bytes(self.bytes)} of data)"
        )
        lines = [f"{head}: all good" if self.ok else f"{head}: {len(self.problems)} problem(s)"]
        lines += [f"  {p.kind:<10} {p.id}  needed by {p.context}" for p in self.problems]
        if self.deleted_corrupt:
            lines.append(
                f"deleted {len(self.deleted_corrupt)} corrupt block(s): they are missing now; "
                "`gradpipe ingest STORE PATTERN --run RUN --repair` writes them back from the "
                "dump files"
            )
        elif any(p.kind in ("missing", "corrupt", "corrupt inline") for p in self.problems):
            lines.append(
                "to mend dumps: `gradpipe ingest STORE PATTERN --run RUN --repair` rewrites what "
                "is missing from the dump files (`verify --delete-corrupt` first turns corrupt "
                "blocks into missing ones)"
            )
        if self.unchecked:
            lines.append(
                f"{self.unchecked} unreferenced block(s) not checked (nothing reachable from a "
                "ref uses them; gc deletes them after the grace period); --all checks them too"
            )
        return "\n".join(lines)


def verify(store: Store, *, all_blocks: bool = False, delete_corrupt: bool = False) -> VerifyReport:
    """Check every object reachable from the store's refs.

    Manifests are parsed and data blocks decoded, and every one is hashed
    and compared with its id. Blocks that nothing references are counted
    (one listing) and, with ``all_blocks=True``, checked too.

    With ``delete_corrupt=True`` (a writable store), blocks whose bytes do
    not match their id are deleted afterwards, under a writer's lease: their
    content is lost either way, and once missing they are what
    ``ingest(..., repair=True)`` rewrites from the dump files (a block cannot
    be replaced in place: writes are create-if-absent).
    """
    inside = _InsideChecker()
    reachable = walk_reachable(store, visit=inside.check)
    report = VerifyReport(
        manifests=len(reachable.manifests),
        blocks=inside.blocks,
        bytes=inside.bytes,
        problems=[*reachable.problems, *inside.problems],
    )
    todo = list(reachable.data.items())
    for info in store.backend.list("blocks"):
        block_id = id_from_block_key(info.key)
        if block_id is not None and block_id not in reachable:
            report.unreferenced += 1
            if all_blocks:
                todo.append((block_id, "unreferenced"))
            else:
                report.unchecked += 1
    _check_blocks(store, todo, report)
    bad = {p.id for p in report.problems if p.kind in ("missing", "corrupt", "unreadable")}
    report.problems += _check_deltas(store, inside.chained, bad)
    report.problems += _check_replays(store, inside.snapshots, bad)
    if delete_corrupt:
        _delete_corrupt(store, report)
    return report


@dataclass
class _InsideChecker:
    """What each manifest keeps inside itself, checked as the walk visits it."""

    problems: list[Problem] = field(default_factory=list)
    blocks: int = 0
    bytes: int = 0
    chained: list[tuple[str, TensorManifest, str]] = field(default_factory=list)  # with deltas
    snapshots: dict[str, SnapshotManifest] = field(default_factory=dict)  # replays read them
    # What each run shard must be, as its parent links it: (link, kind, level or None).
    links: dict[str, tuple[ShardLink, str, int | None]] = field(default_factory=dict)

    def check(self, manifest_id: str, manifest: Manifest, where: str) -> None:
        """Inline chunks and embedded manifests, and a run shard against its link.

        A problem there is the containing manifest's, reported under its id:
        the same content may be stored elsewhere as a good object of its own,
        which ``delete_corrupt`` must never touch.
        """
        for block_id, frame, part in manifest.inline_frames():
            self.blocks += 1
            context = f"{where}, {part}, inline block {block_id}"
            try:
                self.bytes += decode_block(frame, block_id, context=part).nbytes
            except UnsupportedFormatError as exc:
                self.problems.append(Problem("unreadable", manifest_id, context, str(exc)))
            except IntegrityError as exc:
                self.problems.append(Problem("corrupt inline", manifest_id, context, str(exc)))
        for embedded_id, embedded in manifest.embedded_manifests():
            if hash_bytes(encode_manifest(embedded)) != embedded_id:
                detail = f"the embedded manifest of tensor {embedded_id} does not hash to its id"
                self.problems.append(Problem("corrupt inline", manifest_id, where, detail))
            elif isinstance(embedded, TensorManifest) and embedded.deltas:
                self.chained.append((manifest_id, embedded, f"{where}, tensor {embedded_id}"))
        if isinstance(manifest, TensorManifest) and manifest.deltas:
            self.chained.append((manifest_id, manifest, where))
        if isinstance(manifest, SnapshotManifest):
            self.snapshots[manifest_id] = manifest
        self._check_shard(manifest_id, manifest, where)

    def _check_shard(self, manifest_id: str, manifest: Manifest, where: str) -> None:
        """A run's shards agree with the links that name them (the walk reads parents first)."""
        if isinstance(manifest, RunManifest):
            tops = [(manifest.dump_shards, "dumps"), (manifest.aggregate_shards, "aggregates")]
            for top, kind in tops:
                if top is not None:
                    self.links[top.id] = (top, kind, None)
        if not isinstance(manifest, RunShard):
            return
        expected = self.links.get(manifest_id)
        if expected is not None:
            link, kind, level = expected
            why = link_mismatch(link, manifest, kind, level)
            if why is not None:
                self.problems.append(Problem("bad shard", manifest_id, where, why))
        for child in manifest.children:
            self.links[child.id] = (child, manifest.kind, manifest.level - 1)


def _check_blocks(store: Store, todo: list[tuple[str, str]], report: VerifyReport) -> None:
    """Read, decode and hash each block of ``todo`` (id, context), in batches; record problems."""
    for lo in range(0, len(todo), _BATCH):
        batch = todo[lo : lo + _BATCH]
        frames = store.backend.read_many([block_key(block_id) for block_id, _ in batch])
        for (block_id, context), frame in zip(batch, frames, strict=True):
            report.blocks += 1
            if isinstance(frame, NotFoundError):
                report.problems.append(Problem("missing", block_id, context, str(frame)))
                continue
            if isinstance(frame, Exception):
                report.problems.append(Problem("unreadable", block_id, context, str(frame)))
                continue
            try:
                report.bytes += decode_block(frame, block_id, context=context).nbytes
            except UnsupportedFormatError as exc:
                report.problems.append(Problem("unreadable", block_id, context, str(exc)))
            except IntegrityError as exc:
                report.problems.append(Problem("corrupt", block_id, context, str(exc)))


def _check_deltas(
    store: Store, chained: list[tuple[str, TensorManifest, str]], bad: set[str]
) -> list[Problem]:
    """Rebuild every delta chunk whose blocks are sound and compare it with the chunk's id.

    Each block was checked against its own id above; this checks that a delta
    applied to its keyframe gives the chunk the manifest names (a writer that
    took the delta against other bytes would otherwise only show at read time).
    A failure is the containing manifest's: no block is damaged.
    """
    problems: list[Problem] = []
    seen: set[str] = set()
    for container, tensor, where in chained:
        dtype = parse_dtype(tensor.dtype)
        ranges = tensor.chunk_ranges()
        for i, links in sorted(tensor.deltas.items()):
            block = tensor.blocks[i]
            needed = {link.block for link in links} | {links[-1].base}
            if block is None or block in seen or needed & bad:
                continue  # already rebuilt elsewhere, or reported as damaged above
            seen.add(block)
            start, stop = ranges[i]
            out = np.empty(stop - start, dtype=dtype)
            context = f"{where}, chunk {i}"
            try:
                decode_chunks(store, [ChunkRead(block, out, context, None, links)])
            except (IntegrityError, NotFoundError) as exc:
                problems.append(Problem("bad delta", container, context, str(exc)))
    return problems


def _check_replays(
    store: Store, snapshots: dict[str, SnapshotManifest], bad: set[str]
) -> list[Problem]:
    """Rebuild every replayed chunk of every snapshot version and compare it with its id.

    One chunk position of one version at a time (with what its replays read), so memory
    stays a few chunks whatever the store. A prediction that differs from the writer's is
    ``"drifted prediction"`` (no block is damaged: read it with the numpy that wrote it);
    a residual that rebuilds other bytes is ``"bad replay"``; a gradient or base that is
    gone is ``"missing"``, in the context of the snapshot that needs it.
    """
    from dask.local import get_sync

    versions = {i: snapshot_version(store, i, m) for i, m in snapshots.items()}
    problems: list[Problem] = []
    for version_id, manifest in snapshots.items():
        if not manifest.needs_previous:
            continue
        version = versions[version_id]
        replayed = {
            key: tensor for key in manifest.tensors if (tensor := version.tensor(key)).replays
        }
        positions = sorted({i for tensor in replayed.values() for i in tensor.replays})
        for i in positions:
            graph = ReplayGraph(store, versions)
            wanted = [
                (key, tensor)
                for key, tensor in replayed.items()
                if i in tensor.replays
                and (tensor.replays[i].block is None or tensor.replays[i].block not in bad)
            ]
            if not wanted:
                continue  # its residuals are reported damaged above
            context = f"{version.context}, chunk {i}"
            try:
                keys = [graph.chunk(version_id, key, i) for key, _ in wanted]
                get_sync(graph.graph, cast(list[Any], keys))
            except PredictionDriftError as exc:
                problems.append(Problem("drifted prediction", version_id, context, str(exc)))
            except (IntegrityError, NotFoundError) as exc:  # a base or gradient gone, or bad
                problems.append(Problem("bad replay", version_id, context, str(exc)))
    return problems


def _delete_corrupt(store: Store, report: VerifyReport) -> None:
    store.check_writable()
    # Blocks only: a damaged ref is mended by moving it, never by deleting it.
    corrupt = sorted({p.id for p in report.problems if p.kind == "corrupt" and is_id(p.id)})
    with store.writing("verify --delete-corrupt"):
        store.backend.delete_many([block_key(i) for i in corrupt])
    report.deleted_corrupt = corrupt
