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
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from gradpipe.config import get_seconds
from gradpipe.core.display import printable
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
) -> Iterator[Callable[[], None]]:
    """Hold the mutex ``name`` of ``store`` while the block runs.

    Waits up to ``wait`` seconds (default ``gradpipe.lock.wait``) for the
    holder, then raises :class:`~gradpipe.errors.LockedError` naming it.
    Yields a check to call before each unit of work: it raises
    :class:`~gradpipe.errors.LockedError` if the holder's object lapsed (not
    refreshed within the ttl: another contender may have taken the mutex).
    """
    parse_name(name, what="mutex name")
    lease = _acquire(store, name, purpose, get_seconds("lock.wait") if wait is None else wait)
    try:
        yield lease.check
    finally:
        lease.release()


def _acquire(store: Store, name: str, purpose: str, wait: float) -> _MutexLease:
    """Hold only once no other live contender is listed (as the store's exclusive lock).

    A contender that sees an older one steps back entirely and queues again;
    one that sees only younger ones keeps its object and waits for them to
    go. So whatever the clocks say, a holder (which saw nobody) is never
    joined by a second one. No object (nor its heartbeat) outlives a failure.
    """
    deadline = time.monotonic() + wait
    while True:
        lease = _MutexLease(store, name, purpose)
        try:
            held = _contend(store, lease, wait, deadline)
        except BaseException:
            lease.release()
            raise
        if held:
            return lease
        lease.release()  # an older contender: step back entirely
        _sleep(deadline)


def _contend(store: Store, lease: _MutexLease, wait: float, deadline: float) -> bool:
    """Write ``lease``'s object and wait: True once it holds, False to step back."""
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
            return True
        if time.monotonic() >= deadline:
            holder = others[0].key.rsplit("/", 1)[-1]
            raise LockedError(
                f"'{lease.purpose}' waited {wait:.0f} s for another holder of "
                f"{printable(lease.folder.rsplit('/', 1)[-1])} on store {store.url} "
                f"({holder}, refreshed "
                f"{now - others[0].mtime:.0f} s ago) and gave up"
            )
        if older:
            return False
        _sleep(deadline)
