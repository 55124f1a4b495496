"""``store_mutex``: one holder at a time, dead holders ignored, a clear error on timeout."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import dask.config
import pytest

import gradpipe as gp
from gradpipe.storage.mutex import store_mutex


def test_holders_take_turns(store_url: str) -> None:
    store = gp.open_store(store_url, mode="w")
    inside: list[int] = []
    peak: list[int] = []
    errors: list[BaseException] = []

    def contend() -> None:
        try:
            own = gp.open_store(store_url, mode="r+")  # another Store object, as another process
            with store_mutex(own, "nightly", "test", wait=60):
                inside.append(1)
                peak.append(len(inside))
                time.sleep(0.05)
                inside.pop()
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    with dask.config.set({"gradpipe.lock.poll": "10ms"}):
        threads = [threading.Thread(target=contend) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert not errors
    assert peak == [1, 1, 1, 1]
    assert list(store.backend.list("locks/mutex")) == []  # every holder removed its object


def test_a_dead_holder_is_ignored_and_a_live_one_times_out(tmp_path: Path) -> None:
    store = gp.open_store(tmp_path / "s", mode="w")
    store.backend.write_if_absent("locks/mutex/nightly/00000000000000000001-dead", b"{}")
    with dask.config.set({"gradpipe.lock.ttl": "1s", "gradpipe.lock.poll": "10ms"}):
        time.sleep(1.2)  # the dead holder's object is older than the ttl
        with store_mutex(store, "nightly", "first", wait=0):
            other = gp.open_store(tmp_path / "s", mode="r+")
            with (
                pytest.raises(gp.LockedError, match=r"'second' waited 0 s .*'nightly'"),
                store_mutex(other, "nightly", "second", wait=0),
            ):
                pass  # pragma: no cover - never entered
    assert list(store.backend.list("locks/mutex")) == []


def test_a_holder_whose_object_lapsed_is_told(tmp_path: Path) -> None:
    store = gp.open_store(tmp_path / "s", mode="w")
    with (
        dask.config.set({"gradpipe.lock.ttl": "1s", "gradpipe.lock.poll": "10ms"}),
        store_mutex(store, "nightly", "first", wait=0) as still_held,
    ):
        still_held()  # fresh
        [entry] = store.backend.list("locks/mutex/nightly")
        store.backend.delete(entry.key)  # taken for dead by another contender
        time.sleep(0.6)  # the heartbeat finds its object gone
        with pytest.raises(gp.LockedError, match="lapsed"):
            still_held()


def test_a_failed_contender_leaves_no_object(tmp_path: Path) -> None:
    store = gp.open_store(tmp_path / "s", mode="w")
    with dask.config.set({"gradpipe.lock.poll": "10ms"}), store_mutex(store, "n", "first", wait=0):
        other = gp.open_store(tmp_path / "s", mode="r+")
        for _ in range(3):
            with pytest.raises(gp.LockedError), store_mutex(other, "n", "second", wait=0):
                pass  # pragma: no cover - never entered
        assert len(list(store.backend.list("locks/mutex/n"))) == 1  # the holder's only
