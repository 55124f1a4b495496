"""The few primitives a store needs from a storage system.

Everything gradpipe writes goes through two kinds of write: *create-if-absent*
for immutable objects (blocks, manifests) and *compare-and-swap* for refs.
Backends translate their own errors into gradpipe's here, at one boundary.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from gradpipe.core.buffers import Buffer, joined

__all__ = ["TEMP_PREFIX", "Backend", "KeyInfo", "VersionedBytes"]

#: Name prefix of a writer's temporary files (backends that need them); gc removes stale ones.
TEMP_PREFIX = ".tmp."


@dataclass(frozen=True, slots=True)
class KeyInfo:
    """A listed key: its size in bytes and last-modified time (Unix seconds)."""

    key: str
    size: int
    mtime: float


@dataclass(frozen=True, slots=True)
class VersionedBytes:
    """The content of a ref and the token a compare-and-swap must present."""

    data: bytes
    token: str


class Backend(ABC):
    """Keys are ``/``-separated paths relative to the store root."""

    url: str
    #: Create blocks before checking whether they exist: True where a check
    #: costs a round trip, as much as the conditional create that answers it
    #: too (S3); False where it costs a ``stat``, far less than encoding the
    #: block it may spare (local disk, memory). See ``Store.write_blocks``.
    write_first: bool = False

    @abstractmethod
    def read(self, key: str) -> bytes:
        """The bytes at ``key``; :class:`~gradpipe.errors.NotFoundError` if absent."""

    def read_many(self, keys: Sequence[str]) -> list[bytes | Exception]:
        """Read several keys; a failure is returned in place, not raised."""
        out: list[bytes | Exception] = []
        for key in keys:
            try:
                out.append(self.read(key))
            except Exception as exc:
                out.append(exc)
        return out

    @abstractmethod
    def write_if_absent(self, key: str, data: bytes | memoryview) -> bool:
        """Create ``key`` atomically; False (not an error) if it already exists.

        Of concurrent creates of one key exactly one returns True. After a lost
        reply a retry may return False for a create of its own that landed.
        """

    def write_many_if_absent(self, items: Sequence[tuple[str, bytes | memoryview]]) -> list[bool]:
        """:meth:`write_if_absent` for several keys, concurrently where it pays."""
        return [self.write_if_absent(key, data) for key, data in items]

    def write_parts_if_absent(self, items: Sequence[tuple[str, Sequence[Buffer]]]) -> list[bool]:
        """:meth:`write_many_if_absent` of objects given as parts to write one after another.

        A backend that writes a list of buffers as it is (the local disk: ``os.writev``)
        overrides this and saves joining them; the others write the parts joined.
        """
        return self.write_many_if_absent([(key, joined(parts)) for key, parts in items])

    @abstractmethod
    def mtimes(self, keys: Sequence[str]) -> list[float | None]:
        """Last-modified time of each key, None where it does not exist."""

    @abstractmethod
    def touch(self, key: str) -> None:
        """Set the last-modified time of an existing key to now."""

    @abstractmethod
    def delete(self, key: str) -> None:
        """Remove ``key``; absent keys are not an error."""

    def delete_many(self, keys: Sequence[str]) -> None:
        """:meth:`delete` for several keys (one bulk request where the backend has one)."""
        for key in keys:
            self.delete(key)

    @abstractmethod
    def list(self, prefix: str) -> Iterator[KeyInfo]:
        """Every key under ``prefix`` (a folder, without trailing slash; ``""``: all).

        ``"p"`` lists ``p/a`` and ``p/q/b``, never ``pq/x``. A backend may also
        list its own bookkeeping files (lock files, temporary files of killed
        writers); their last path segment starts with ``.``.
        """

    @abstractmethod
    def read_versioned(self, key: str) -> VersionedBytes | None:
        """A ref's content and version token, None if the ref does not exist."""

    @abstractmethod
    def swap(self, key: str, data: bytes, expected: str | None) -> str:
        """Replace ``key`` if its token is still ``expected`` (None: if absent).

        Returns the new token; raises :class:`~gradpipe.errors.ConflictError`
        when someone else changed the key first (or it exists and ``expected``
        is None, or it is absent and ``expected`` is a token). Of concurrent
        swaps from one token exactly one wins. The token changes whenever the
        bytes do; identical bytes may keep it (an S3 ETag is an MD5), so a
        caller that must tell two writes apart writes unique bytes, as refs
        do. A :class:`~gradpipe.errors.StorageError` leaves the outcome unknown:
        the swap may have landed (see :mod:`gradpipe.storage.refs`).
        """

    @abstractmethod
    def delete_all(self) -> None:
        """Remove everything under the store root (for ``mode="w"``)."""
