"""A backend wrapper that loses requests and replies on a schedule, for tests.

Networks lose replies: a PUT can land on S3 and its answer never arrive. The
client then sees an error for a write that happened, and gradpipe must not
turn that into a false conflict, a duplicate, or a deleted block. Those
branches only run when something makes them run; :class:`FaultyBackend`
(modelled on zarr's ``LatencyStore``-style wrappers) does::

    faulty, backend = faulty_store(store, Fault("swap", calls={1}))
    faulty.refs.set("tags/x", target)   # the first swap lands, its reply is lost
    assert backend.fired("swap")

A :class:`Fault` names a primitive, a key pattern and which of the matching
calls fail; it either does the operation and then raises (``lose="reply"``:
the outcome is unknown to the caller) or raises without doing it
(``lose="request"``). The error is the one the real backends raise when
their client gives up, :class:`~gradpipe.errors.StorageError`. Batch
primitives fail per key, as S3 sends one request per key: a fault on
``write_if_absent`` also hits the items of ``write_many_if_absent``, ``read``
those of ``read_many``, ``delete`` those of ``delete_many``.

The faulty store is built over the wrapper directly, not through the backend
registry: a store sent to a Dask worker reopens its URL there, without faults,
which is what a test of one process wants.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Container, Iterator, Sequence
from dataclasses import dataclass, field
from fnmatch import fnmatchcase
from typing import Literal, TypeVar

from gradpipe.errors import StorageError
from gradpipe.storage.backend import Backend, KeyInfo, VersionedBytes
from gradpipe.storage.store import Store

__all__ = ["Fault", "FaultyBackend", "Injected", "faulty_store"]

T = TypeVar("T")

#: ``"reply"``: done, then the caller gets an error; ``"request"``: not done, error;
#: ``None``: done normally (the fault only runs its ``action``).
Lose = Literal["reply", "request"] | None


def lost(op: str, key: str, url: str, lose: Lose) -> StorageError:
    """The error a backend raises when its client gives up on a request."""
    what = "the reply was lost" if lose == "reply" else "the request never arrived"
    return StorageError(
        f"could not {op} {key!r} in store {url}: connection reset by peer (injected fault: {what})"
    )


@dataclass
class Fault:
    """One scheduled failure.

    Parameters
    ----------
    op : str
        The primitive: ``read``, ``write_if_absent``, ``mtimes``, ``touch``,
        ``delete``, ``list`` (key: the prefix), ``read_versioned``, ``swap``
        or ``delete_all`` (key: ``""``).
    key : str
        A :func:`fnmatch.fnmatchcase` pattern (``*`` crosses ``/``): ``"refs/*"``.
    calls : container of int, optional
        Which of the calls matching ``op`` and ``key`` fail, counting from 1
        (``{2}``: the second; ``range(1, 4)``: the first three); every one if None.
    lose : {"reply", "request", None}
        Do the operation and then fail, fail without doing it, or do not fail.
    action : callable, optional
        Run when the fault fires, before the operation (to hold a caller at a
        precise point, say).
    """

    op: str
    key: str = "*"
    calls: Container[int] | None = None
    lose: Lose = "reply"
    action: Callable[[], None] | None = None
    matched: int = field(default=0, init=False)
    fired: int = field(default=0, init=False)


@dataclass(frozen=True)
class Injected:
    """A fault that fired: on which primitive and key, and what was lost."""

    op: str
    key: str
    lose: Lose


class FaultyBackend(Backend):
    """Wraps ``inner`` and fails its primitives as ``faults`` say (thread-safe).

    ``injected`` records every fault that fired, so a test can check that the
    branch it meant to exercise did run; ``calls`` records every ``(op, key)``
    that reached the wrapper (batch primitives once per key).
    """

    def __init__(self, inner: Backend, *faults: Fault) -> None:
        self.inner = inner
        self.url = inner.url
        self.write_first = inner.write_first  # the order of the backend it stands for
        self.faults = list(faults)
        self.injected: list[Injected] = []
        self.calls: list[tuple[str, str]] = []
        self._lock = threading.Lock()

    def add(self, *faults: Fault) -> None:
        """Schedule more faults."""
        with self._lock:
            self.faults.extend(faults)

    def clear(self) -> None:
        """Drop every scheduled fault (``injected`` is kept)."""
        with self._lock:
            self.faults.clear()

    def fired(self, op: str | None = None) -> list[Injected]:
        """The faults that fired (on ``op`` only, if given)."""
        with self._lock:
            return [i for i in self.injected if op is None or i.op == op]

    # --- scheduling ------------------------------------------------------------
    def _due(self, op: str, key: str) -> Fault | None:
        due = None
        with self._lock:
            self.calls.append((op, key))
            for fault in self.faults:
                if fault.op != op or not fnmatchcase(key, fault.key):
                    continue
                fault.matched += 1
                if due is None and (fault.calls is None or fault.matched in fault.calls):
                    fault.fired += 1
                    self.injected.append(Injected(op, key, fault.lose))
                    due = fault
        if due is not None and due.action is not None:
            due.action()
        return due

    def _one(self, op: str, key: str, fn: Callable[[], T]) -> T:
        fault = self._due(op, key)
        if fault is None or fault.lose is None:
            return fn()
        if fault.lose == "request":
            raise lost(op, key, self.url, fault.lose)
        with contextlib.suppress(Exception):  # whatever the answer was, it never arrived
            fn()
        raise lost(op, key, self.url, fault.lose)

    def _batch(self, op: str, keys: Sequence[str]) -> tuple[list[bool], StorageError | None]:
        """Which keys to send, and the error the caller gets (if any fault fired)."""
        send, error = [], None
        for key in keys:
            fault = self._due(op, key)
            lose = None if fault is None else fault.lose
            send.append(lose != "request")
            if lose is not None and error is None:
                error = lost(op, key, self.url, lose)
        return send, error

    # --- primitives --------------------------------------------------------------
    def read(self, key: str) -> bytes:
        return self._one("read", key, lambda: self.inner.read(key))

    # read_many: Backend's own, one self.read per key, so each read meets its faults.

    def write_if_absent(self, key: str, data: bytes | memoryview) -> bool:
        return self._one("write_if_absent", key, lambda: self.inner.write_if_absent(key, data))

    def write_many_if_absent(self, items: Sequence[tuple[str, bytes | memoryview]]) -> list[bool]:
        send, error = self._batch("write_if_absent", [key for key, _ in items])
        results = self.inner.write_many_if_absent(
            [item for item, sent in zip(items, send, strict=True) if sent]
        )
        if error is not None:
            raise error
        return results

    def mtimes(self, keys: Sequence[str]) -> list[float | None]:
        _send, error = self._batch("mtimes", keys)
        if error is not None:
            raise error  # a read: losing the request or the reply looks the same
        return self.inner.mtimes(keys)

    def touch(self, key: str) -> None:
        self._one("touch", key, lambda: self.inner.touch(key))

    def delete(self, key: str) -> None:
        self._one("delete", key, lambda: self.inner.delete(key))

    def delete_many(self, keys: Sequence[str]) -> None:
        send, error = self._batch("delete", keys)
        self.inner.delete_many([k for k, s in zip(keys, send, strict=True) if s])
        if error is not None:
            raise error

    def list(self, prefix: str) -> Iterator[KeyInfo]:
        return iter(self._one("list", prefix, lambda: list(self.inner.list(prefix))))

    def read_versioned(self, key: str) -> VersionedBytes | None:
        return self._one("read_versioned", key, lambda: self.inner.read_versioned(key))

    def swap(self, key: str, data: bytes, expected: str | None) -> str:
        return self._one("swap", key, lambda: self.inner.swap(key, data, expected))

    def delete_all(self) -> None:
        self._one("delete_all", "", self.inner.delete_all)


def faulty_store(store: Store, *faults: Fault) -> tuple[Store, FaultyBackend]:
    """A writable store over ``store``'s backend wrapped in a :class:`FaultyBackend`."""
    backend = FaultyBackend(store.backend, *faults)
    return Store(backend, mode="a", url=store.url, storage_options=store.storage_options), backend
