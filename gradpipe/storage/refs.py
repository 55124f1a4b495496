"""Refs: the only mutable objects of a store, moved by compare-and-swap.

A ref lives at ``refs/<kind>/<name>`` and holds the canonical bytes of a
:class:`~gradpipe.core.manifest.RefEntry`. Before every swap the new entry is
also written as a block, so entries chain through ``previous`` into the ref's
history. Each attempt stamps a fresh ``write_id``: when a swap reports a
conflict or fails without a reply, reading the ref back tells whether our own
write landed (its reply was lost and a retry collided with it), possibly with
another writer's entry already on top of it, or someone else's did. If even
that read fails, the next attempt's read of the ref checks again before
writing anything, so a lost reply never becomes a false conflict or a second
history entry.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Final

from gradpipe.core.display import printable
from gradpipe.core.ids import hash_bytes
from gradpipe.core.manifest import decode_manifest, encode_manifest
from gradpipe.core.names import parse_name, parse_ref_name
from gradpipe.core.ref_entry import RefEntry
from gradpipe.errors import (
    ConflictError,
    IntegrityError,
    InvalidInputError,
    NotFoundError,
    StorageError,
)
from gradpipe.storage.backend import VersionedBytes

if TYPE_CHECKING:
    from gradpipe.storage.store import Store

__all__ = ["ANY", "Refs"]


class _Any:
    def __repr__(self) -> str:
        return "ANY"


#: ``expected=ANY``: move the ref whatever it points at now (retrying on conflict).
ANY: Final = _Any()

_MAX_ATTEMPTS: Final = 64
# Swaps whose outcome was unknown (no reply) retried before the error is raised;
# counted apart from lost races, which say nothing about the connection.
_MAX_LOST_REPLIES: Final = 4
#: How far back a writer looks for its own landed entry after a lost reply.
_MAX_LOOKBACK: Final = 64
#: Writers' clocks may disagree by this much when entry times are compared.
_CLOCK_MARGIN: Final = timedelta(minutes=5)


def _now() -> str:
    return datetime.now(UTC).isoformat(timespec="microseconds")


class Refs:
    """The refs of one store; reached as ``store.refs``."""

    def __init__(self, store: Store) -> None:
        self._store = store

    def _key(self, name: str) -> str:
        return f"refs/{parse_ref_name(name)}"

    def read(self, name: str) -> tuple[VersionedBytes | None, RefEntry | None]:
        """The ref's stored bytes (with their CAS token) and its decoded entry, one read."""
        current = self._store.backend.read_versioned(self._key(name))
        if current is None:
            return None, None
        try:
            entry = decode_manifest(
                current.data, what=f"ref {printable(name)} in store {self._store.url}"
            )
        except IntegrityError as exc:
            raise IntegrityError(f"{exc}; the ref is damaged, run `gradpipe verify`") from None
        if not isinstance(entry, RefEntry) or entry.ref != name:
            raise IntegrityError(
                f"ref {printable(name)} in store {self._store.url} holds a foreign entry"
            )
        return current, entry

    def entry(self, name: str) -> RefEntry | None:
        """The current entry of ``name`` (None if it never existed or was deleted)."""
        _, entry = self.read(name)
        return entry if entry is not None and entry.target is not None else None

    def get(self, name: str) -> str:
        """The id ``name`` points at; :class:`NotFoundError` if there is none."""
        entry = self.entry(name)
        if entry is None or entry.target is None:
            raise NotFoundError(f"ref {printable(name)} does not exist in store {self._store.url}")
        return entry.target

    def set(
        self,
        name: str,
        target: str | None,
        *,
        expected: str | _Any | None = ANY,
        message: str = "",
        meta: dict[str, str] | None = None,
    ) -> RefEntry:
        """Point ``name`` at ``target`` (None deletes it, keeping its history).

        With ``expected`` set to an id (or None for "must not exist"), the move
        happens only if the ref still points there, else :class:`ConflictError`.
        """

        def decide(current: str | None) -> str | None:
            if not isinstance(expected, _Any) and current != expected:
                raise ConflictError(
                    f"ref {printable(name)} points at {current}, not {expected}; "
                    "someone else moved it: re-read and retry"
                )
            return target

        return self.update(name, decide, message=message, meta=meta)

    def update(
        self,
        name: str,
        decide: Callable[[str | None], str | None],
        *,
        message: str = "",
        meta: dict[str, str] | None = None,
    ) -> RefEntry:
        """Move ``name`` to ``decide(current_target)``, retrying lost races.

        ``decide`` may be called several times and must not have side effects
        it cannot repeat; it may raise to give up.
        """
        self._store.check_writable()
        key = self._key(name)
        # Every entry we tried to publish, by the hash of its bytes: a swap
        # whose reply was lost may have landed, and only our bytes tell.
        tried: dict[str, RefEntry] = {}
        lost_replies = 0
        with self._store.writing(f"update ref {name}"):
            for _attempt in range(_MAX_ATTEMPTS):
                current, entry = self.read(name)
                ours = self._ours(name, current, entry, tried)
                if ours is not None:  # an earlier attempt landed after all
                    return ours
                target = decide(entry.target if entry else None)
                new = RefEntry(
                    ref=name,
                    target=target,
                    previous=hash_bytes(current.data) if current else None,
                    time=_now(),
                    write_id=uuid.uuid4().hex,
                    message=message,
                    meta=dict(meta or {}),
                )
                data = encode_manifest(new)
                self._store.put_raw(data)  # the history entry, before it becomes visible
                # Publishing is only safe while our lease holds: a writer that was
                # suspended past the lock's ttl may have been taken for dead by gc.
                self._store.lock.check()
                try:
                    self._store.backend.swap(key, data, current.token if current else None)
                except (ConflictError, StorageError) as exc:
                    # A conflict, or no reply at all: the swap may still have landed
                    # (a retry that collided with our own first attempt). Our bytes,
                    # with their unique write id, tell.
                    tried[hash_bytes(data)] = new
                    ours = self._landed(name, tried)
                    if ours is not None:
                        return ours
                    if isinstance(exc, StorageError):
                        lost_replies += 1
                        if lost_replies > _MAX_LOST_REPLIES:
                            raise
                    continue
                return new
        raise ConflictError(
            f"ref {printable(name)} in store {self._store.url} kept moving; gave up after "
            f"{_MAX_ATTEMPTS} attempts"
        )

    def _landed(self, name: str, tried: dict[str, RefEntry]) -> RefEntry | None:
        """Which of our attempts the ref shows, if the ref can be read now."""
        try:
            current, entry = self.read(name)
            return self._ours(name, current, entry, tried)
        except StorageError:
            return None  # unknown yet: the next attempt's read looks again

    def _ours(
        self,
        name: str,
        current: VersionedBytes | None,
        entry: RefEntry | None,
        tried: dict[str, RefEntry],
    ) -> RefEntry | None:
        """Our entry if the ref's history since our first attempt holds it.

        Other writers may have moved the ref on top of our landed entry before
        we could look, so the history is walked back through the entries
        written since our first attempt (by their times, with a margin for
        skewed clocks; at most :data:`_MAX_LOOKBACK`). This costs reads only
        after a lost reply or a conflict, never on the common path.
        """
        if current is None or entry is None or not tried:
            return None
        mine = tried.get(hash_bytes(current.data))
        since = min(e.time for e in tried.values())
        horizon = (datetime.fromisoformat(since) - _CLOCK_MARGIN).isoformat()
        for _ in range(_MAX_LOOKBACK):
            if mine is not None or entry.previous is None:
                break
            mine = tried.get(entry.previous)
            if mine is not None:
                break
            entry = self._store.get_typed(
                entry.previous, RefEntry, context=f"history of ref {printable(name)}"
            )
            if entry.time < horizon:
                break
        return mine

    def history(self, name: str, *, limit: int | None = None) -> list[RefEntry]:
        """Entries of ``name``, newest first (deletions included, target None).

        Each entry is one read; ``limit`` stops after that many (a run committed 20,000
        times has 20,000 entries).
        """
        if limit is not None and (isinstance(limit, bool) or limit < 1):
            raise InvalidInputError(f"limit must be a positive number of entries, got {limit!r}")
        current, entry = self.read(name)
        if current is None or entry is None:
            raise NotFoundError(f"ref {printable(name)} does not exist in store {self._store.url}")
        out = [entry]
        while entry.previous is not None and (limit is None or len(out) < limit):
            entry = self._store.get_typed(
                entry.previous, RefEntry, context=f"history of ref {printable(name)}"
            )
            out.append(entry)
        return out

    def names(self, kind: str | None = None) -> list[str]:
        """Names of every stored ref (deleted ones included), optionally of one kind."""
        prefix = "refs" if kind is None else f"refs/{parse_name(kind, what='ref kind')}"
        out = []
        for info in self._store.backend.list(prefix):
            parts = info.key.split("/")
            if len(parts) == 3 and not parts[2].startswith("."):  # not lock or temporary files
                out.append(f"{parts[1]}/{parts[2]}")
        return sorted(out)

    def list(self, kind: str | None = None) -> dict[str, RefEntry]:
        """Current entries of all live refs (optionally of one kind), by name."""
        out: dict[str, RefEntry] = {}
        for name in self.names(kind):
            entry = self.entry(name)
            if entry is not None:
                out[name] = entry
        return out
