"""``gc``: delete blocks nothing reachable uses, once they are old enough.

Safety rests on two rules. Only blocks older than the grace period go, so a
job that has written blocks but not yet committed its ref keeps them. And a
writer that finds a block already present refreshes its time when it is
older than ``gradpipe.storage.touch-after`` (see ``Store._write_blocks``), so
an old unreferenced block that a new commit is about to reuse is young
again before gc can judge it. Keep the grace period longer than your
longest job plus ``touch-after``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from gradpipe.config import get_seconds
from gradpipe.core.ids import id_from_block_key
from gradpipe.errors import IntegrityError
from gradpipe.storage._backend import TEMP_PREFIX, KeyInfo
from gradpipe.storage.store import Store
from gradpipe.storage.walk import walk_reachable

__all__ = ["GcReport", "gc"]


@dataclass
class GcReport:
    """What :func:`gc` found and did (or, with ``dry_run``, would do)."""

    dry_run: bool
    reachable: int = 0
    deleted: int = 0
    deleted_bytes: int = 0
    kept_young: int = 0
    stray_deleted: int = 0

    def to_dict(self) -> dict[str, Any]:
        """JSON-able form (what ``gradpipe gc --json`` prints)."""
        return dict(self.__dict__)


def gc(store: Store, *, grace: float | None = None, dry_run: bool = False) -> GcReport:
    """Delete unreferenced blocks older than ``grace`` seconds.

    ``grace`` defaults to ``gradpipe.gc.grace`` (24 hours). Refuses to run
    when a reachable manifest is missing or corrupt: its children cannot be
    known, and deleting them would make a repair impossible.
    """
    store.check_writable()
    grace = get_seconds("gc.grace") if grace is None else float(grace)
    reachable = walk_reachable(store)
    if reachable.problems:
        first = reachable.problems[0]
        raise IntegrityError(
            f"gc stopped before deleting anything: {len(reachable.problems)} reachable "
            f"object(s) are damaged, first {first.id} ({first.context}); run `gradpipe verify`"
        )
    report = GcReport(dry_run=dry_run, reachable=len(reachable.manifests) + len(reachable.data))
    cutoff = time.time() - grace
    doomed: list[KeyInfo] = []
    for info in store.backend.list("blocks"):
        block_id = id_from_block_key(info.key)
        if block_id is not None and block_id in reachable:
            continue
        if info.mtime > cutoff:
            report.kept_young += block_id is not None
            continue
        doomed.append(info)
        if len(doomed) >= _DELETE_BATCH:
            _delete(store, doomed, cutoff, report, dry_run=dry_run)
            doomed = []
    _delete(store, doomed, cutoff, report, dry_run=dry_run)
    # A ref swap on local disk renames a temporary file beside the ref; a
    # writer killed before the rename leaves it there. (Lock files stay: one
    # may be held, and deleting it would let two writers lock different files.)
    for info in store.backend.list("refs"):
        if info.key.rsplit("/", 1)[-1].startswith(TEMP_PREFIX) and info.mtime <= cutoff:
            report.stray_deleted += 1
            if not dry_run:
                store.backend.delete(info.key)
    return report


# Keys re-checked and deleted per round: the listing can be minutes old on a
# big S3 store, so times are read again just before deleting.
_DELETE_BATCH = 256


def _delete(
    store: Store, doomed: list[KeyInfo], cutoff: float, report: GcReport, *, dry_run: bool
) -> None:
    """Delete listed keys that are still old: a writer may have reused (touched) one since."""
    if not doomed:
        return
    for info, mtime in zip(doomed, store.backend.mtimes([i.key for i in doomed]), strict=True):
        if mtime is None:
            continue  # gone already
        if mtime > cutoff:
            report.kept_young += 1
            continue
        if id_from_block_key(info.key) is None:
            report.stray_deleted += 1  # a temporary file left by a killed writer
        else:
            report.deleted += 1
            report.deleted_bytes += info.size
        if not dry_run:
            store.backend.delete(info.key)
