"""The store lock: writers share it, gc takes it alone, dead holders are ignored."""

from __future__ import annotations

import os
import threading
import time
import uuid
from pathlib import Path

import dask.config
import pytest

import gradpipe as gp
from gradpipe.errors import LockedError


def _store() -> gp.Store:
    return gp.open_store(f"memory://{uuid.uuid4().hex}", mode="w")


def test_writer_waits_for_gc_and_gives_up_with_a_clear_error() -> None:
    store = _store()
    other = gp.open_store(store.url, mode="r+")
    with (
        dask.config.set({"gradpipe.lock.wait": "1s"}),
        store.lock.exclusive("gc"),
        pytest.raises(LockedError, match="exclusive lock"),
        other.writing("ingest"),
    ):
        pass
    with other.writing("ingest") as lease:  # free again once gc is done
        assert lease is not None


def test_gc_waits_for_a_writer_then_proceeds() -> None:
    store = _store()
    gc_store = gp.open_store(store.url, mode="r+")
    order: list[str] = []
    with store.writing("ingest"):
        thread = threading.Thread(
            target=lambda: (gp.gc(gc_store, grace=0, wait=30), order.append("gc"))
        )
        thread.start()
        # gc has taken its exclusive lock object and is waiting for us.
        deadline = time.monotonic() + 30
        while not [i for i in store.lock.live_locks(time.time()) if i.mode == "exclusive"]:
            assert time.monotonic() < deadline, "gc never reached its sweep"
            time.sleep(0.01)
        time.sleep(0.2)  # gc polls every 0.05 s: it had several looks and still waits
        assert order == []
        order.append("writer done")
    thread.join(30)
    assert order == ["writer done", "gc"]


def test_dead_holders_are_ignored_after_the_ttl_and_removed_by_gc() -> None:
    store = _store()
    dead = gp.open_store(store.url, mode="r+")
    lease = dead.lock._acquire_shared("killed job", None)
    lease._stop.set()  # the holder dies: no more heartbeats, object left behind
    key = lease.key
    with dask.config.set({"gradpipe.lock.ttl": "1s"}):
        time.sleep(1.5)
        report = gp.gc(store, grace=0, wait=5)
    assert report.stale_locks_deleted == 1
    assert store.backend.mtimes([key]) == [None]


def test_a_lapsed_lease_publishes_nothing() -> None:
    store = _store()
    tid = store.put_tensor([1.0, 2.0])
    with store.writing("stalled job") as lease:
        assert lease is not None
        lease._stop.set()
        lease._last_refresh -= 3600  # as if suspended for an hour
        with pytest.raises(LockedError, match="lapsed"):
            store.refs.set("tensors/x", tid)
    with pytest.raises(gp.NotFoundError):
        store.refs.get("tensors/x")


def test_writers_share_the_lock() -> None:
    store = _store()
    other = gp.open_store(store.url, mode="r+")
    with store.writing("a"), other.writing("b"):
        assert len(store.lock.live_locks(time.time() + 1)) == 2
    assert store.lock.live_locks(time.time()) == []


def test_a_joined_lease_is_per_thread(tmp_path: Path) -> None:
    """Tasks of one worker share a Store object; each publishes under its own client's lease."""
    root = tmp_path / "s"
    gp.open_store(root, mode="w")
    clients = [gp.open_store(root, mode="r+") for _ in range(2)]
    worker = gp.open_store(root, mode="r+")
    leases = [c.lock._acquire_shared(f"client {i}", None) for i, c in enumerate(clients)]
    a_joined, b_joined, a_aged, b_left = (threading.Event() for _ in range(4))
    seen: dict[str, object] = {}

    def task_a() -> None:
        with worker.lock.join(leases[0].key):
            a_joined.set()
            b_joined.wait(10)
            worker.lock.check()  # A's lease is fresh
            seen["a fresh"] = True
            a_aged.wait(10)
            try:
                worker.lock.check()
            except LockedError as exc:
                seen["a aged"] = exc
            b_left.wait(10)
            try:
                worker.lock.check()  # B leaving must not clear A's lease
            except LockedError as exc:
                seen["a after b"] = exc

    def task_b() -> None:
        a_joined.wait(10)
        with worker.lock.join(leases[1].key):
            b_joined.set()
            a_aged.wait(10)
            worker.lock.check()  # B's lease is still fresh: A's age is not B's
            seen["b fresh"] = True
        b_left.set()

    threads = [threading.Thread(target=task_a), threading.Thread(target=task_b)]
    for t in threads:
        t.start()
    b_joined.wait(10)
    time.sleep(0.1)
    leases[0]._stop.set()  # client A stalls: its lock object ages
    old = time.time() - 3600
    os.utime(root / leases[0].key, (old, old))
    a_aged.set()
    for t in threads:
        t.join(20)
    for lease in leases:
        lease.release()
    assert seen.get("a fresh") is True
    assert seen.get("b fresh") is True
    assert isinstance(seen.get("a aged"), LockedError)
    assert isinstance(seen.get("a after b"), LockedError)


def test_threads_taking_the_lease_at_once_share_one(tmp_path: Path) -> None:
    store = gp.open_store(tmp_path / "s", mode="w")
    start = threading.Barrier(8)
    keys: list[str] = []

    def write() -> None:
        start.wait(10)
        with store.writing("many threads") as lease:
            assert lease is not None
            keys.append(lease.key)
            time.sleep(0.05)

    threads = [threading.Thread(target=write) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert len(keys) == 8
    assert store.lock.held is None
    # Every lease taken was released: nothing left to hold gc back.
    assert list(store.backend.list("locks")) == []


def test_gc_removes_a_clock_probe_left_behind(tmp_path: Path) -> None:
    root = tmp_path / "s"
    store = gp.open_store(root, mode="w")
    store.backend.write_if_absent("locks/probe-left-by-a-killed-task", b"{}")
    old = time.time() - 3600
    os.utime(root / "locks" / "probe-left-by-a-killed-task", (old, old))
    assert gp.gc(store, grace=0).stale_locks_deleted == 1
    assert list(store.backend.list("locks")) == []
