"""In-memory backend: a store that lives in this process (``memory://name``).

For tests, notebooks and examples: every :class:`Store` opened on the same
``memory://name`` in one process shares the same objects (as fsspec's memory
filesystem does); nothing survives the process. It implements the same
primitives as the other backends, atomically under one lock, so the backend
conformance suite holds for it too.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from gradpipe.core.display import PATH_LIMIT, printable
from gradpipe.errors import ConflictError, NotFoundError
from gradpipe.storage.backend import Backend, KeyInfo, VersionedBytes

__all__ = ["MemoryBackend", "from_url"]


@dataclass
class _Object:
    data: bytes
    mtime: float
    token: str


_SPACES: dict[str, dict[str, _Object]] = {}
_SPACES_LOCK = threading.Lock()


def from_url(url: str, path: str, storage_options: dict[str, object]) -> MemoryBackend:
    """The backend of ``memory://name`` (``storage_options`` unused)."""
    return MemoryBackend(path.strip("/"))


class MemoryBackend(Backend):
    """A store held in a dict shared by every backend of the same name in this process."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.url = f"memory://{name}"
        with _SPACES_LOCK:
            self._objects = _SPACES.setdefault(name, {})
        self._lock = _SPACES_LOCK
        self._tokens = itertools.count(1)

    def _missing(self, key: str) -> NotFoundError:
        return NotFoundError(
            f"{printable(key, limit=PATH_LIMIT)} not found in store "
            f"{printable(self.url, limit=PATH_LIMIT)}"
        )

    def read(self, key: str) -> bytes:
        with self._lock:
            obj = self._objects.get(key)
        if obj is None:
            raise self._missing(key)
        return obj.data

    def write_if_absent(self, key: str, data: bytes | memoryview) -> bool:
        with self._lock:
            if key in self._objects:
                return False
            self._objects[key] = _Object(bytes(data), time.time(), self._token())
        return True

    def mtimes(self, keys: Sequence[str]) -> list[float | None]:
        with self._lock:
            return [o.mtime if (o := self._objects.get(k)) is not None else None for k in keys]

    def touch(self, key: str) -> None:
        with self._lock:
            obj = self._objects.get(key)
            if obj is None:
                raise self._missing(key)
            obj.mtime = time.time()

    def set_mtime(self, key: str, mtime: float) -> None:
        """Age (or rejuvenate) an object: for tests of time-based rules."""
        with self._lock:
            self._objects[key].mtime = mtime

    def delete(self, key: str) -> None:
        with self._lock:
            self._objects.pop(key, None)

    def list(self, prefix: str) -> Iterator[KeyInfo]:
        top = f"{prefix}/" if prefix else ""
        with self._lock:
            items = sorted((k, len(o.data), o.mtime) for k, o in self._objects.items())
        for key, size, mtime in items:
            if key.startswith(top):
                yield KeyInfo(key, size, mtime)

    def read_versioned(self, key: str) -> VersionedBytes | None:
        with self._lock:
            obj = self._objects.get(key)
        return None if obj is None else VersionedBytes(obj.data, obj.token)

    def swap(self, key: str, data: bytes, expected: str | None) -> str:
        with self._lock:
            obj = self._objects.get(key)
            if (obj.token if obj is not None else None) != expected:
                raise ConflictError(
                    f"ref {printable(key, limit=PATH_LIMIT)} in store "
                    f"{printable(self.url, limit=PATH_LIMIT)} was "
                    "moved by another writer"
                )
            token = self._token()
            self._objects[key] = _Object(bytes(data), time.time(), token)
        return token

    def delete_all(self) -> None:
        with self._lock:
            self._objects.clear()

    def _token(self) -> str:
        return f"{self.name}:{next(self._tokens)}:{time.monotonic_ns()}"
