"""What a process keeps of the last snapshot it wrote of each name, for the next write.

A snapshot is written against the previous one of its name: its deltas against the
keyframe chunks, its replays (design note 016) from the previous version's values. A
process keeps those values from its own last write, so the next one reads nothing back;
another process, or values that would not fit, reads them from the store. Copies, not
views: the caller's arrays may be changed in place by the next optimizer step (a value may
be a view of a private copy the writer made, which nobody else changes). Every cache of the
process shares one budget, ``gradpipe.snapshot-cache-bytes``, counted by the arrays that own
the memory: a view keeps its whole array alive, and two caches may hold the same array.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any

import numpy as np

from gradpipe.config import get_bytes

if TYPE_CHECKING:
    from gradpipe.storage.store import Store

__all__ = ["VersionCache", "owned_bytes", "owner"]

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
            return get_bytes("snapshot-cache-bytes") - _held_bytes()

    @staticmethod
    def held_owners() -> set[int]:
        """``id()`` of every array that owns memory some cache holds."""
        with _LOCK:
            return {id(owner(a)) for a in _held_arrays()}

    @staticmethod
    def room() -> int:
        """The budget left while every cache keeps what it holds."""
        with _LOCK:
            return get_bytes("snapshot-cache-bytes") - _held_bytes()

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
            return owned_bytes(a for _, values, _ in self._held.values() for a in values.values())

    def clear(self) -> None:
        with _LOCK:
            self._held.clear()


def owner(array: np.ndarray) -> np.ndarray:
    """The array that owns ``array``'s memory (itself, or the array it is a view of)."""
    base = array.base
    return base if isinstance(base, np.ndarray) else array


def owned_bytes(arrays: Iterable[np.ndarray]) -> int:
    """The memory ``arrays`` keep alive: each owning array counted once."""
    owners = {id(o): o.nbytes for o in map(owner, arrays)}
    return sum(owners.values())


def _held_arrays() -> Iterator[np.ndarray]:  # under _LOCK
    """Every array every cache of the process holds."""
    return (a for c in _CACHES for _, values, _ in c._held.values() for a in values.values())


def _held_bytes() -> int:  # under _LOCK
    return owned_bytes(_held_arrays())
