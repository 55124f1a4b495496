"""The store lock: writers share it, gc takes it alone, dead holders are ignored."""

from __future__ import annotations

import threading
import time
import uuid

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
        time.sleep(0.5)
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
