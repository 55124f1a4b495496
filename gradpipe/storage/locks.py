"""The store lock: writers share it, gc takes it alone; leases expire if their holder dies.

Every lock holder writes its own small object, ``locks/<mode>-<order>-<uuid>``,
with create-if-absent (so two holders never share one), then lists ``locks/``
and decides from what it sees; a holder keeps its object fresh by touching it
(a heartbeat thread) and removes it when done. A lock object whose time is older
than ``gradpipe.lock.ttl`` belongs to a holder that died: everyone ignores it,
and gc deletes it.

- A **writer** (``shared``) that sees a live exclusive lock removes its own
  object and waits; otherwise it proceeds.
- **gc** (``exclusive``) keeps its object and waits until the listing shows no
  other live lock; of two gcs the younger (by ``order``) steps back.

Because each side writes its object *before* it lists, a writer and a gc can
never both proceed: whichever listed second sees the other (the argument is in
``docs/design/003-gc-safety.md``; it needs a strongly consistent listing, which
local disks and S3 give). Times are compared on the backend's own clock: each
holder measures the skew between its clock and the backend's when it writes its
object.
"""

from __future__ import annotations

import contextlib
import contextvars
import json
import logging
import os
import random
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final, Literal

from gradpipe.config import get_seconds
from gradpipe.core.display import PATH_LIMIT, printable
from gradpipe.errors import GradpipeError, LockedError, NotFoundError

if TYPE_CHECKING:
    from gradpipe.storage.store import Store

__all__ = ["LOCK_PREFIX", "Lease", "LockInfo", "StoreLock", "check_lease"]

LOCK_PREFIX: Final = "locks"
LockMode = Literal["shared", "exclusive"]
_log = logging.getLogger("gradpipe")


@dataclass(frozen=True, slots=True)
class LockInfo:
    """A lock object as listed: its key, mode, order and age on the backend's clock."""

    key: str
    mode: LockMode
    order: str
    mtime: float

    @classmethod
    def parse(cls, key: str, mtime: float) -> LockInfo | None:
        name = key.rsplit("/", 1)[-1]
        mode, _, order = name.partition("-")
        if mode not in ("shared", "exclusive") or not order:
            return None  # a temporary file or something foreign: not a lock
        return cls(key, mode, order, mtime)  # type: ignore[arg-type]


def _ttl() -> float:
    return get_seconds("lock.ttl")


def _describe(store: Store, info: LockInfo, now: float) -> str:
    try:
        doc = json.loads(store.backend.read(info.key))
        who = f"{doc.get('purpose', '?')} by {doc.get('owner', '?')} since {doc.get('created')}"
    except (GradpipeError, ValueError, AttributeError):
        who = info.key
    name = info.key.rsplit("/", 1)[-1]
    return f"{info.mode} lock {name} ({who}; refreshed {now - info.mtime:.0f} s ago)"


class Lease:
    """A held lock object, kept fresh by a heartbeat until released."""

    def __init__(self, store: Store, mode: LockMode, purpose: str) -> None:
        self.store = store
        self.mode = mode
        self.purpose = purpose
        order = f"{time.time_ns():020d}" if mode == "exclusive" else "0"
        self.key = f"{LOCK_PREFIX}/{mode}-{order}-{uuid.uuid4().hex}"
        self.skew = 0.0  # backend clock minus ours
        self._last_refresh = 0.0  # our clock
        self._lost: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # --- life cycle -----------------------------------------------------------
    def write(self) -> None:
        """Create the lock object and measure the backend's clock skew."""
        doc = {
            "gradpipe": "lock",
            "mode": self.mode,
            "purpose": self.purpose,
            "owner": f"{socket.gethostname()}:{os.getpid()}",
            "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        }
        before = time.time()
        self.store.backend.write_if_absent(self.key, json.dumps(doc).encode())
        after = time.time()
        [mtime] = self.store.backend.mtimes([self.key])
        if mtime is not None:
            # Backends keep whole or fractional seconds; the midpoint is within a second.
            self.skew = mtime - (before + after) / 2
        self._last_refresh = after

    def start_heartbeat(self) -> None:
        """Touch the lock object every quarter of ``lock.ttl`` until released."""
        interval = max(_ttl() / 4, 0.05)

        def beat() -> None:
            while not self._stop.wait(interval):
                self.refresh()

        self._thread = threading.Thread(target=beat, name=f"gradpipe-lease-{self.key}", daemon=True)
        self._thread.start()

    def refresh(self) -> None:
        """Touch the lock object now; a lock object gone means the lease is lost."""
        started = time.time()
        try:
            self.store.backend.touch(self.key)
        except NotFoundError:
            self._lost = "its lock object was removed (it looked dead: not refreshed in time)"
            return
        except Exception as exc:  # a flaky backend: the next beat retries
            _log.warning("gradpipe: could not refresh %s: %s", self.key, exc)
            return
        if started - self._last_refresh > _ttl():
            self._lost = f"it was not refreshed for {started - self._last_refresh:.0f} s"
        self._last_refresh = started

    def release(self) -> None:
        """Stop the heartbeat and remove the lock object."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        with contextlib.suppress(GradpipeError):
            self.store.backend.delete(self.key)

    # --- checks ---------------------------------------------------------------
    def check(self) -> None:
        """Raise :class:`LockedError` unless the lease is certainly still held.

        Called before every ref update: a holder that was suspended past the
        ttl may have been taken for dead, and gc may have run meanwhile.
        """
        age = time.time() - self._last_refresh
        if self._lost is None and age > _ttl() / 2:
            self._lost = f"it was last refreshed {age:.0f} s ago"
        if self._lost is not None:
            raise LockedError(
                f"the {self.mode} lease of {printable(self.purpose)} on store "
                f"{printable(self.store.url, limit=PATH_LIMIT)} lapsed: {self._lost}; nothing more "
                "was published. Re-run the job (what it wrote is reused)"
            )

    def backend_now(self) -> float:
        """Now, on the backend's clock."""
        return time.time() + self.skew


def check_lease(store: Store, key: str, *, purpose: str = "job") -> None:
    """Check, from another process, that the lease at ``key`` is alive (fresh enough).

    A Dask task that publishes on behalf of a client (the ingest commit) calls
    this: the client's heartbeat keeps the lock object younger than a quarter
    of the ttl, so an object older than half of it means the client stalled.
    """
    [mtime] = store.backend.mtimes([key])
    if mtime is None:
        raise LockedError(
            f"the lease of {printable(purpose)} on store {printable(store.url, limit=PATH_LIMIT)} "
            "is gone (its holder stopped, or "
            "was taken for dead); nothing was published. Re-run the job"
        )
    # Our clock against the backend's: measure it with a touch-free probe of the
    # lock object's own time, which the holder refreshed on the backend's clock.
    skew = _probe_skew(store)
    age = time.time() + skew - mtime
    if age > _ttl() / 2:
        raise LockedError(
            f"the lease of {printable(purpose)} on store {printable(store.url, limit=PATH_LIMIT)} "
            f"was last refreshed {age:.0f} s "
            "ago, too long for it to be safe; nothing was published. Re-run the job"
        )


_SKEWS: dict[str, float] = {}
_PROBE: Final = "probe-"


def _probe_skew(store: Store) -> float:
    """The backend's clock minus ours, measured once per store URL per process."""
    skew = _SKEWS.get(store.url)
    if skew is None:
        key = f"{LOCK_PREFIX}/{_PROBE}{uuid.uuid4().hex}"
        before = time.time()
        store.backend.write_if_absent(key, b"{}")
        after = time.time()
        [mtime] = store.backend.mtimes([key])
        store.backend.delete(key)
        skew = 0.0 if mtime is None else mtime - (before + after) / 2
        _SKEWS[store.url] = skew
    return skew


class StoreLock:
    """The lock of one :class:`Store` object: shared leases are re-entrant within it."""

    def __init__(self, store: Store) -> None:
        self._store = store
        self._mutex = threading.Lock()
        self._acquiring = threading.Lock()
        self._shared: Lease | None = None
        self._depth = 0
        # The lease a task publishes under (join) is the task's own: one Store
        # object serves every task of a worker, concurrently, each for its own
        # client, so it lives in the running context (per thread), not here.
        self._joined: contextvars.ContextVar[str | None] = contextvars.ContextVar(
            f"gradpipe-joined-lease-{id(self)}", default=None
        )

    @property
    def held(self) -> Lease | None:
        """The shared lease this store object holds now, if any."""
        return self._shared

    def live_locks(self, now: float) -> list[LockInfo]:
        """Lock objects refreshed within the ttl, on the backend's clock ``now``."""
        out = []
        for entry in self._store.backend.list(LOCK_PREFIX):
            info = LockInfo.parse(entry.key, entry.mtime)
            if info is not None and now - info.mtime <= _ttl():
                out.append(info)
        return out

    def stale_locks(self, now: float) -> list[LockInfo]:
        """Lock objects whose holders died (not refreshed within the ttl).

        Clock probes (``locks/probe-*``) a process could not delete count too:
        they are no lock, but nothing else would ever remove them.
        """
        out = []
        for entry in self._store.backend.list(LOCK_PREFIX):
            if now - entry.mtime <= _ttl():
                continue
            info = LockInfo.parse(entry.key, entry.mtime)
            if info is None and entry.key.rsplit("/", 1)[-1].startswith(_PROBE):
                info = LockInfo(entry.key, "shared", "probe", entry.mtime)
            if info is not None:
                out.append(info)
        return out

    def check(self) -> None:
        """Raise :class:`LockedError` unless this store object holds a live lease."""
        joined = self._joined.get()
        if joined is not None:
            check_lease(self._store, joined)
        elif self._shared is not None:
            self._shared.check()

    # --- writers --------------------------------------------------------------
    @contextlib.contextmanager
    def shared(self, purpose: str, *, wait: float | None = None) -> Iterator[Lease | None]:
        """Hold a writer's lease (re-entrant); waits while gc holds the store."""
        if self._joined.get() is not None:
            yield None  # publishing under the client's lease: no lease of our own
            return
        # One thread acquires; the others wait for it and share its lease (two
        # leases acquired at once would leave one counted by nobody, alive for ever).
        with self._acquiring:
            with self._mutex:
                lease = self._shared
                if lease is not None:
                    self._depth += 1
            if lease is None:
                lease = self._acquire_shared(purpose, wait)
                with self._mutex:
                    self._shared, self._depth = lease, 1
        try:
            yield lease
        finally:
            with self._mutex:
                self._depth -= 1
                done = self._depth == 0
                if done:
                    self._shared = None
            if done:
                lease.release()

    def _acquire_shared(self, purpose: str, wait: float | None) -> Lease:
        deadline = time.monotonic() + (get_seconds("lock.wait") if wait is None else wait)
        announced = False
        while True:
            lease = Lease(self._store, "shared", purpose)
            lease.write()
            lease.start_heartbeat()
            blockers = [
                i
                for i in self.live_locks(lease.backend_now())
                if i.mode == "exclusive" and i.key != lease.key
            ]
            if not blockers:
                return lease
            lease.release()
            now = lease.backend_now()
            if time.monotonic() >= deadline:
                raise LockedError(
                    f"store {printable(self._store.url, limit=PATH_LIMIT)} is held by "
                    f"{_describe(self._store, blockers[0], now)}; {printable(purpose)} waited and "
                    "gave up. Retry when it is done, or raise gradpipe.lock.wait"
                )
            if not announced:
                _log.warning("gradpipe: waiting for %s", _describe(self._store, blockers[0], now))
                announced = True
            _sleep(deadline)

    @contextlib.contextmanager
    def join(self, key: str | None) -> Iterator[None]:
        """Act under a lease held by another process (the client of a Dask task).

        Ref updates inside the block check that lease instead of taking a new
        one: a new shared lock would wait behind a gc that itself waits for the
        client's lease to end.
        """
        if key is None:
            yield
            return
        check_lease(self._store, key)
        token = self._joined.set(key)
        try:
            yield
        finally:
            self._joined.reset(token)

    # --- gc -------------------------------------------------------------------
    @contextlib.contextmanager
    def exclusive(self, purpose: str, *, wait: float | None = None) -> Iterator[Lease]:
        """Hold the store alone: no writer runs while the block runs."""
        if self._shared is not None or self._joined.get() is not None:
            raise LockedError(
                f"{printable(purpose)} cannot take store "
                f"{printable(self._store.url, limit=PATH_LIMIT)} exclusively while this "
                "store object is writing; use another Store object or wait for the write"
            )
        lease = self._acquire_exclusive(purpose, wait)
        try:
            yield lease
        finally:
            lease.release()

    def _acquire_exclusive(self, purpose: str, wait: float | None) -> Lease:
        deadline = time.monotonic() + (get_seconds("lock.wait") if wait is None else wait)
        lease = Lease(self._store, "exclusive", purpose)
        lease.write()
        lease.start_heartbeat()
        announced = False
        while True:
            others = [i for i in self.live_locks(lease.backend_now()) if i.key != lease.key]
            own_order = lease.key.rsplit("/", 1)[-1]
            older = [
                i for i in others if i.mode == "exclusive" and i.key.rsplit("/", 1)[-1] < own_order
            ]
            if not others:
                return lease
            now = lease.backend_now()
            if older:
                # Another gc came first: step back entirely and queue behind it.
                lease.release()
                if time.monotonic() >= deadline:
                    raise LockedError(
                        f"store {printable(self._store.url, limit=PATH_LIMIT)} is held by "
                        f"{_describe(self._store, older[0], now)}; {printable(purpose)} gave up"
                    )
                _sleep(deadline)
                lease = Lease(self._store, "exclusive", purpose)
                lease.write()
                lease.start_heartbeat()
                continue
            if time.monotonic() >= deadline:
                lease.release()
                raise LockedError(
                    f"store {printable(self._store.url, limit=PATH_LIMIT)} is in use by "
                    f"{len(others)} job(s), e.g. {_describe(self._store, others[0], now)}; "
                    f"{printable(purpose)} waited for them and gave up. Retry later, or raise the "
                    "wait (gc --wait, gradpipe.lock.wait)"
                )
            if not announced:
                _log.warning(
                    "gradpipe: %s waits for %d job(s) writing to the store, e.g. %s",
                    purpose,
                    len(others),
                    _describe(self._store, others[0], now),
                )
                announced = True
            _sleep(deadline)


def _sleep(deadline: float) -> None:
    """Back off a little, with jitter, without overshooting the deadline by much."""
    pause = min(get_seconds("lock.poll"), _ttl() / 4) * random.uniform(0.5, 1.5)  # noqa: S311 - jitter
    time.sleep(max(0.0, min(pause, deadline - time.monotonic() + 0.01)))
