"""A named mutex in the store: one holder at a time across processes and machines.

Overlapping runs of one scheduled workflow must not both do the same work (two
ingests of the same new dumps would both read and encode them; CAS refs keep
the store correct, not the work single). :func:`store_mutex` serialises them
with the store lock's algorithm (``docs/design/003-gc-safety.md``), restricted
to one name: each contender writes its own object
``locks/mutex/<name>/<order>-<uuid>`` with create-if-absent, keeps it fresh
with a heartbeat, then lists the name's objects; the oldest live one (by
``order``, a timestamp) holds the mutex, younger ones step back and retry.
Objects not refreshed within ``gradpipe.lock.ttl`` belong to dead holders and
are deleted by the next contender. These objects are not store locks: gc and
writers ignore them.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING

from gradpipe.config import get_seconds
from gradpipe.core.names import parse_name
from gradpipe.errors import GradpipeError, LockedError
from gradpipe.storage.locks import LOCK_PREFIX, Lease, _sleep, _ttl

if TYPE_CHECKING:
    from gradpipe.storage.store import Store

__all__ = ["store_mutex"]


class _MutexLease(Lease):
    def __init__(self, store: Store, name: str, purpose: str) -> None:
        super().__init__(store, "exclusive", purpose)
        self.folder = f"{LOCK_PREFIX}/mutex/{name}"
        self.key = f"{self.folder}/{self.key.rsplit('/', 1)[-1].removeprefix('exclusive-')}"

    @property
    def order(self) -> str:
        return self.key.rsplit("/", 1)[-1]


@contextlib.contextmanager
def store_mutex(
    store: Store, name: str, purpose: str, *, wait: float | None = None
) -> Iterator[None]:
    """Hold the mutex ``name`` of ``store`` while the block runs.

    Waits up to ``wait`` seconds (default ``gradpipe.lock.wait``) for the
    holder, then raises :class:`~gradpipe.errors.LockedError` naming it.
    """
    parse_name(name, what="mutex name")
    lease = _acquire(store, name, purpose, get_seconds("lock.wait") if wait is None else wait)
    try:
        yield
    finally:
        lease.release()


def _acquire(store: Store, name: str, purpose: str, wait: float) -> _MutexLease:
    """Hold only once no other live contender is listed (as the store's exclusive lock).

    A contender that sees an older one steps back entirely; one that sees only
    younger ones keeps its object and waits for them to go. So whatever the
    clocks say, a holder (which saw nobody) is never joined by a second one.
    """
    deadline = time.monotonic() + wait
    lease = _MutexLease(store, name, purpose)
    lease.write()
    lease.start_heartbeat()
    while True:
        now = lease.backend_now()
        others, older = [], []
        for entry in store.backend.list(lease.folder):
            order = entry.key.rsplit("/", 1)[-1]
            if entry.key == lease.key or order.startswith("."):
                continue
            if now - entry.mtime > _ttl():  # its holder died
                with contextlib.suppress(GradpipeError):
                    store.backend.delete(entry.key)
                continue
            others.append(entry)
            if order < lease.order:
                older.append(entry)
        if not others:
            return lease
        if time.monotonic() >= deadline:
            lease.release()
            holder = others[0].key.rsplit("/", 1)[-1]
            raise LockedError(
                f"'{purpose}' waited {wait:.0f} s for another holder of {name!r} on store "
                f"{store.url} ({holder}, refreshed {now - others[0].mtime:.0f} s ago) and gave up"
            )
        if older:  # step back entirely and queue again behind it
            lease.release()
            _sleep(deadline)
            lease = _MutexLease(store, name, purpose)
            lease.write()
            lease.start_heartbeat()
            continue
        _sleep(deadline)
