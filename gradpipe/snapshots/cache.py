"""What a process keeps of the last snapshot it wrote of each name, for the next write.

A snapshot is written against the previous one of its name: its deltas against the
keyframe chunks, its replays (design note 016) from the previous version's values. A
process keeps those values from its own last write, so the next one reads nothing back;
another process, or values that would not fit, reads them from the store. Copies, not
views: the caller's arrays may be changed in place by the next optimizer step. Every cache
of the process shares one budget, ``gradpipe.snapshot-cache-bytes``.
"""

from __future__ import annotations

import os
import threading
from typing import TYPE_CHECKING, Any

import numpy as np

from gradpipe.config import get_bytes

if TYPE_CHECKING:
    from gradpipe.storage.store import Store

__all__ = ["VersionCache"]

_LOCK = threading.Lock()
_CACHES: list[VersionCache] = []


def _after_fork_in_child() -> None:  # a lock held by a parent's thread would never be released
    global _LOCK  # noqa: PLW0603 - replacing the lock is the point
    _LOCK = threading.Lock()


os.register_at_fork(after_in_child=_after_fork_in_child)


class VersionCache:
    """Per (store, name): the version whose values are held, the values, and a note."""

    def __init__(self) -> None:
        self._held: dict[tuple[str, str], tuple[str, dict[str, np.ndarray], Any]] = {}
        _CACHES.append(self)

    def recall(
        self, store: Store, name: str, snapshot_id: str | None
    ) -> tuple[dict[str, np.ndarray], Any] | None:
        """The values and note kept of version ``snapshot_id`` of ``name`` (None: not held)."""
        with _LOCK:
            found = self._held.get((store.url, name))
        if found is None or found[0] != snapshot_id:
            return None
        return found[1], found[2]

    def forget(self, store: Store, name: str) -> int:
        """Drop what is held of ``name`` (before a write keeps its own); the room left."""
        with _LOCK:
            self._held.pop((store.url, name), None)
            return get_bytes("snapshot-cache-bytes") - sum(c._bytes() for c in _CACHES)

    def keep(
        self,
        store: Store,
        name: str,
        snapshot_id: str,
        values: dict[str, np.ndarray],
        note: Any = None,
    ) -> None:
        with _LOCK:
            self._held[(store.url, name)] = (snapshot_id, values, note)

    def held_bytes(self) -> int:
        with _LOCK:
            return self._bytes()

    def clear(self) -> None:
        with _LOCK:
            self._held.clear()

    def _bytes(self) -> int:  # under _LOCK
        return sum(a.nbytes for _, values, _ in self._held.values() for a in values.values())
