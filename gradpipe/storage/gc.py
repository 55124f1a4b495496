"""``gc``: delete blocks nothing reachable uses, while no writer can reuse them.

gc works in two phases (``docs/design/003-gc-safety.md`` has the argument):

1. **Mark, unlocked.** Walk everything reachable from the refs and list the
   blocks; the candidates are the blocks that are unreachable and older than
   the grace period. Writers carry on meanwhile.
2. **Sweep, exclusive.** Take the store lock exclusively: new writers wait,
   and gc waits until every writer's lease has ended (or expired: its holder
   died). Then re-read the refs and walk again, incrementally (manifests are
   immutable, so only new ones are read), re-check each candidate's time,
   and delete what is still unreachable and old, in bulk. Stale lock objects
   and temporary files of killed writers go too.

Every job that writes blocks holds a writer's lease from its first existence
check to its last ref update, so no block a job has decided to reuse can be
judged garbage while the job runs; the grace period is a second margin for
writers that took no lease.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from dask.utils import format_bytes

from gradpipe.config import get_seconds
from gradpipe.core.html import ReportHtml
from gradpipe.core.ids import id_from_block_key
from gradpipe.errors import IntegrityError
from gradpipe.storage.backend import TEMP_PREFIX, KeyInfo
from gradpipe.storage.locks import Lease
from gradpipe.storage.store import Store
from gradpipe.storage.walk import Reachable, walk_reachable

__all__ = ["GcReport", "gc"]

# Keys deleted per bulk request (S3 takes up to 1,000 per DeleteObjects).
_DELETE_BATCH = 1000


@dataclass
class GcReport(ReportHtml):
    """What :func:`gc` found and did (or, with ``dry_run``, would do)."""

    dry_run: bool
    reachable: int = 0
    deleted: int = 0
    deleted_bytes: int = 0
    kept_young: int = 0
    unreferenced: int = 0
    stray_deleted: int = 0
    stale_locks_deleted: int = 0
    waited_seconds: float = 0.0

    @property
    def ok(self) -> bool:
        """gc either finishes or raises: a report is always a success."""
        return True

    def to_dict(self) -> dict[str, Any]:
        """JSON-able form (what ``gradpipe gc --json`` prints)."""
        return {"ok": self.ok, **self.__dict__, "waited_seconds": round(self.waited_seconds, 3)}

    def summary(self) -> str:
        """A few lines for people."""
        verb = "would delete" if self.dry_run else "deleted"
        lines = [
            f"{verb} {self.deleted} unreferenced block(s), {format_bytes(self.deleted_bytes)}; "
            f"kept {self.reachable} reachable and {self.kept_young} unreferenced younger than "
            "the grace period",
            f"{verb} {self.stray_deleted} temporary file(s) of killed writers and "
            f"{self.stale_locks_deleted} lock(s) of dead jobs",
        ]
        if self.dry_run and self.unreferenced:
            lines.append(
                f"{self.unreferenced} block(s) are unreferenced (nothing reachable from a ref "
                "uses them, e.g. tensors put without a name): gc deletes them once older than "
                "the grace period"
            )
        if self.waited_seconds >= 1:
            lines.append(f"waited {self.waited_seconds:.0f} s for running jobs to finish")
        return "\n".join(lines)


def gc(
    store: Store,
    *,
    grace: float | None = None,
    dry_run: bool = False,
    wait: float | None = None,
) -> GcReport:
    """Delete unreferenced blocks older than ``grace`` seconds.

    Parameters
    ----------
    store : Store
        A writable store.
    grace : float, optional
        Seconds an unreferenced block is kept after its last write or reuse
        (default ``gradpipe.gc.grace``, 24 hours). Safe at any value, 0
        included: running jobs are protected by their leases, not by time.
    dry_run : bool
        Report what would be deleted; take no lock and delete nothing.
    wait : float, optional
        Seconds to wait for running writers before giving up with
        :class:`~gradpipe.errors.LockedError` (default ``gradpipe.lock.wait``).

    Raises
    ------
    IntegrityError
        When a reachable manifest is missing or corrupt: its children cannot
        be known, and deleting them would make a repair impossible.
    LockedError
        When writers kept the store busy for longer than ``wait``.
    """
    store.check_writable()
    grace = get_seconds("gc.grace") if grace is None else float(grace)
    report = GcReport(dry_run=dry_run)
    marked = _checked_walk(store, None)
    candidates = _candidates(store, marked, time.time() - grace, report)
    old_blocks = [c for c in candidates if id_from_block_key(c.key) is not None]
    report.unreferenced = len(old_blocks) + report.kept_young  # as the mark found them
    if dry_run:
        report.reachable = len(marked.manifests) + len(marked.data)
        report.deleted = len(old_blocks)
        report.stray_deleted = len(candidates) - report.deleted
        report.deleted_bytes = sum(c.size for c in old_blocks)
        report.stray_deleted += len(_ref_strays(store, time.time() - grace))
        report.stale_locks_deleted = len(store.lock.stale_locks(time.time()))
        return report
    started = time.monotonic()
    with store.lock.exclusive("gc", wait=wait) as lease:
        report.waited_seconds = time.monotonic() - started
        reachable = _checked_walk(store, marked)
        report.reachable = len(reachable.manifests) + len(reachable.data)
        cutoff = lease.backend_now() - grace
        doomed = [c for c in candidates if id_from_block_key(c.key) not in reachable]
        _sweep(store, lease, doomed, cutoff, report)
        _sweep_strays(store, lease, cutoff, report)
    return report


def _checked_walk(store: Store, known: Reachable | None) -> Reachable:
    reachable = walk_reachable(store, known=known)
    if reachable.problems:
        first = reachable.problems[0]
        raise IntegrityError(
            f"gc stopped before deleting anything: {len(reachable.problems)} reachable "
            f"object(s) are damaged, first {first.id} ({first.context}); run `gradpipe verify`"
        )
    return reachable


def _candidates(store: Store, marked: Reachable, cutoff: float, report: GcReport) -> list[KeyInfo]:
    """Listed blocks that are unreachable and old, plus temporary files of killed writers."""
    out = []
    for info in store.backend.list("blocks"):
        block_id = id_from_block_key(info.key)
        if block_id is not None and block_id in marked:
            continue
        if info.mtime > cutoff:
            report.kept_young += block_id is not None
            continue
        out.append(info)
    return out


def _sweep(
    store: Store, lease: Lease, doomed: list[KeyInfo], cutoff: float, report: GcReport
) -> None:
    """Delete candidates that are still old: a job may have reused one before we locked."""
    for lo in range(0, len(doomed), _DELETE_BATCH):
        batch = doomed[lo : lo + _DELETE_BATCH]
        mtimes = store.backend.mtimes([i.key for i in batch])
        keys = []
        for info, mtime in zip(batch, mtimes, strict=True):
            if mtime is None:
                continue  # gone already
            if mtime > cutoff:
                report.kept_young += 1
                continue
            if id_from_block_key(info.key) is None:
                report.stray_deleted += 1
            else:
                report.deleted += 1
                report.deleted_bytes += info.size
            keys.append(info.key)
        # Deleting is only safe while we still hold the store: if our lock
        # lapsed (a stalled gc), writers may be running again.
        lease.check()
        store.backend.delete_many(keys)


def _ref_strays(store: Store, cutoff: float) -> list[str]:
    return [
        i.key
        for i in store.backend.list("refs")
        if i.key.rsplit("/", 1)[-1].startswith(TEMP_PREFIX) and i.mtime <= cutoff
    ]


def _sweep_strays(store: Store, lease: Lease, cutoff: float, report: GcReport) -> None:
    # A ref swap on local disk renames a temporary file beside the ref; a
    # writer killed before the rename leaves it there. (Ref lock files stay:
    # one may be held, and deleting it would let two writers lock different files.)
    strays = _ref_strays(store, cutoff)
    stale = [i.key for i in store.lock.stale_locks(lease.backend_now())]
    lease.check()
    store.backend.delete_many(strays + stale)
    report.stray_deleted += len(strays)
    report.stale_locks_deleted = len(stale)
