"""Lost requests and lost replies, at Store level: the branches that handle them, made to run.

Each test wraps a real backend in a :class:`FaultyBackend` that fails one
precise call, then checks what the store holds afterwards, not only what the
call returned.
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Iterator
from pathlib import Path

import dask.config
import numpy as np
import pytest

import gradpipe as gp
from gradpipe.errors import ConflictError, LockedError, StorageError
from gradpipe.storage.refs import ANY
from gradpipe.storage.store import Store
from gradpipe.testing.faults import Fault, faulty_store

REF = "tags/x"
KEY = f"refs/{REF}"


@pytest.fixture(params=["memory", "local", pytest.param("s3", marks=pytest.mark.s3)])
def inner(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Store]:
    """A real store; tests put a faulty one over its backend."""
    if request.param == "s3":
        request.getfixturevalue("s3")
        url = f"s3://gradpipe-test/{uuid.uuid4().hex[:8]}"
    elif request.param == "memory":
        url = f"memory://{uuid.uuid4().hex}"
    else:
        url = str(tmp_path / "s")
    store = gp.open_store(url, mode="w")
    yield store
    if request.param == "memory":
        store.backend.delete_all()


def targets(store: Store, n: int = 2) -> list[str]:
    return [store.put_tensor(np.full(4, i, np.float32)) for i in range(n)]


def history(store: Store, name: str = REF) -> list[str | None]:
    return [e.target for e in store.refs.history(name)]


# --- (a) a swap that landed, its reply lost -------------------------------------------
@pytest.mark.parametrize("expected", ["exact", "any"])
def test_swap_landed_reply_lost_is_our_commit(inner: Store, expected: str) -> None:
    a, b = targets(inner)
    inner.refs.set(REF, a, expected=None)
    store, backend = faulty_store(inner, Fault("swap", KEY))
    entry = store.refs.set(REF, b, expected=a if expected == "exact" else ANY)
    assert [(i.op, i.lose) for i in backend.fired()] == [("swap", "reply")]
    assert entry.target == b
    assert history(inner) == [b, a]  # no second entry of ours
    assert inner.refs.list()[REF].write_id == entry.write_id


def test_create_landed_reply_lost_is_our_commit(inner: Store) -> None:
    [a] = targets(inner, 1)
    store, backend = faulty_store(inner, Fault("swap", KEY))
    entry = store.refs.set(REF, a, expected=None)
    assert len(backend.fired("swap")) == 1
    assert history(inner) == [a]
    assert inner.refs.list()[REF].write_id == entry.write_id


@pytest.mark.parametrize("expected", ["exact", "any"])
def test_swap_landed_and_the_read_back_failed_too(inner: Store, expected: str) -> None:
    # The read that would tell whether our swap landed fails as well: the next
    # attempt then finds our own entry as the ref's current value.
    a, b = targets(inner)
    inner.refs.set(REF, a, expected=None)
    store, backend = faulty_store(
        inner,
        Fault("swap", KEY, calls={1}),
        Fault("read_versioned", KEY, calls={2}, lose="request"),  # 1: the attempt's read
    )
    entry = store.refs.set(REF, b, expected=a if expected == "exact" else ANY)
    assert [i.op for i in backend.fired()] == ["swap", "read_versioned"]
    assert entry.target == b
    assert history(inner) == [b, a]
    assert inner.refs.list()[REF].write_id == entry.write_id
    assert [op for op, _ in backend.calls].count("swap") == 1  # recognised, not redone


@pytest.mark.parametrize("expected", ["exact", "any"])
def test_swap_landed_and_was_moved_on_before_the_read_back(inner: Store, expected: str) -> None:
    # Another writer commits on top of ours before we read back: ours landed all
    # the same (it is in the history), so it is no conflict and no retry.
    a, b, c = targets(inner, 3)
    inner.refs.set(REF, a, expected=None)
    other = gp.open_store(inner.url, mode="r+")
    store, backend = faulty_store(
        inner,
        Fault("swap", KEY, calls={1}),
        Fault(
            "read_versioned",
            KEY,
            calls={2},
            lose=None,
            action=lambda: other.refs.set(REF, c, message="other"),
        ),
    )
    entry = store.refs.set(REF, b, expected=a if expected == "exact" else ANY)
    assert len(backend.fired()) == 2
    assert entry.target == b
    assert history(inner) == [c, b, a]
    assert list(inner.refs.history(REF))[1].write_id == entry.write_id


@pytest.mark.parametrize("expected", ["exact", "any"])
def test_swap_landed_and_two_writers_moved_on_before_the_read_back(
    inner: Store, expected: str
) -> None:
    # Ours landed, its reply was lost, and two other commits landed on top
    # before we could look: still ours, found further back in the history.
    a, b, c, d = targets(inner, 4)
    inner.refs.set(REF, a, expected=None)
    other = gp.open_store(inner.url, mode="r+")

    def two_commits() -> None:
        other.refs.set(REF, c, message="other 1")
        other.refs.set(REF, d, message="other 2")

    store, backend = faulty_store(
        inner,
        Fault("swap", KEY, calls={1}),
        Fault("read_versioned", KEY, calls={2}, lose=None, action=two_commits),
    )
    entry = store.refs.set(REF, b, expected=a if expected == "exact" else ANY)
    assert len(backend.fired()) == 2
    assert entry.target == b
    assert history(inner) == [d, c, b, a]  # no second entry of ours, no false conflict
    assert list(inner.refs.history(REF))[2].write_id == entry.write_id


# --- (b) a swap that did not land -------------------------------------------------------
def test_swap_lost_before_landing_is_retried_cleanly(inner: Store) -> None:
    a, b = targets(inner)
    inner.refs.set(REF, a, expected=None)
    store, backend = faulty_store(inner, Fault("swap", KEY, calls={1}, lose="request"))
    entry = store.refs.set(REF, b, expected=a)
    assert len(backend.fired("swap")) == 1
    assert [op for op, _ in backend.calls].count("swap") == 2
    assert history(inner) == [b, a]
    assert inner.refs.list()[REF].write_id == entry.write_id


def test_swap_that_never_lands_raises_and_leaves_the_ref(inner: Store) -> None:
    a, b = targets(inner)
    inner.refs.set(REF, a, expected=None)
    store, backend = faulty_store(inner, Fault("swap", KEY, lose="request"))
    with pytest.raises(StorageError, match="tags/x"):
        store.refs.set(REF, b, expected=a)
    assert 1 < len(backend.fired("swap")) < 10  # retried, a bounded number of times
    assert history(inner) == [a]


def test_lost_replies_are_retried_after_lost_races(inner: Store) -> None:
    # Four races lost to another writer, then one request lost: the lost request
    # still gets its retries (they are not counted against the races).
    a, b = targets(inner)
    inner.refs.set(REF, a, expected=None)
    other = gp.open_store(inner.url, mode="r+")
    moves = iter(range(100))

    def move() -> None:
        other.refs.set(REF, a, message=f"other {next(moves)}")

    store, backend = faulty_store(
        inner,
        Fault("swap", KEY, calls=range(1, 5), lose=None, action=move),
        Fault("swap", KEY, calls={5}, lose="request"),
    )
    entry = store.refs.set(REF, b)
    assert len(backend.fired("swap")) == 5
    assert [op for op, _ in backend.calls].count("swap") == 6
    assert history(inner) == [b, a, a, a, a, a]
    assert inner.refs.list()[REF].write_id == entry.write_id


def test_a_real_conflict_is_still_a_conflict(inner: Store) -> None:
    # The reply of a swap that lost its race is lost: reading back shows
    # someone else's entry, so the caller's expectation failed.
    a, b, c = targets(inner, 3)
    inner.refs.set(REF, a, expected=None)
    other = gp.open_store(inner.url, mode="r+")
    store, backend = faulty_store(
        inner,
        Fault("swap", KEY, calls={1}, action=lambda: other.refs.set(REF, c, expected=a)),
    )
    with pytest.raises(ConflictError, match="tags/x"):
        store.refs.set(REF, b, expected=a)
    assert len(backend.fired("swap")) == 1
    assert history(inner) == [c, a]


# --- (c) a block write that landed, its reply lost -----------------------------------------
def test_block_write_landed_reply_lost_then_retry_writes_nothing_twice(inner: Store) -> None:
    array = np.arange(3000, dtype=np.float32)
    store, backend = faulty_store(inner, Fault("write_if_absent", "blocks/*", calls={1}))
    with pytest.raises(StorageError, match="blocks/"):
        store.put_tensor(array, name="w", chunk_bytes=4096)
    [landed] = backend.fired("write_if_absent")
    assert landed.lose == "reply"
    assert inner.backend.mtimes([landed.key]) != [None]  # it did land
    assert "tensors/w" not in inner.refs.list()  # nothing published
    before = len(backend.calls)
    tensor_id = store.put_tensor(array, name="w", chunk_bytes=4096)
    retried = backend.calls[before:]
    assert ("mtimes", landed.key) in retried
    if backend.write_first:
        # S3: the conditional create goes again and is refused (the object is not
        # written twice); only that refusal has its age looked up.
        created = retried.index(("write_if_absent", landed.key))
        assert created < retried.index(("mtimes", landed.key))
    else:
        assert ("write_if_absent", landed.key) not in retried  # seen to exist, not rewritten
    assert store.refs.get("tensors/w") == tensor_id
    assert store.get_tensor(tensor_id).tobytes() == array.tobytes()
    assert gp.verify(inner).ok


def test_block_write_lost_before_landing_then_retry_writes_it(inner: Store) -> None:
    array = np.arange(3000, dtype=np.float32)
    store, backend = faulty_store(
        inner, Fault("write_if_absent", "blocks/*", calls={1}, lose="request")
    )
    with pytest.raises(StorageError):
        store.put_tensor(array, chunk_bytes=4096)
    [lost] = backend.fired("write_if_absent")
    assert inner.backend.mtimes([lost.key]) == [None]
    tensor_id = store.put_tensor(array, chunk_bytes=4096)
    assert store.get_tensor(tensor_id).tobytes() == array.tobytes()


# --- (d) gc meeting a failing backend -------------------------------------------------
def _garbage(inner: Store) -> tuple[str, set[str]]:
    """A named tensor and some unreferenced blocks; returns the tensor id and all block keys."""
    kept = inner.put_tensor(np.arange(2000, dtype=np.float32), name="kept", chunk_bytes=2048)
    inner.put_tensor(np.ones(2000, dtype=np.float64), chunk_bytes=2048)  # unreferenced
    keys = {i.key for i in inner.backend.list("blocks")}
    return kept, keys


def _blocks(store: Store) -> set[str]:
    return {i.key for i in store.backend.list("blocks")}


@pytest.mark.parametrize("lose", ["request", "reply"])
def test_gc_stops_before_deleting_when_mtimes_fail(inner: Store, lose: str) -> None:
    kept, keys = _garbage(inner)
    store, backend = faulty_store(inner, Fault("mtimes", "blocks/*", lose=lose))  # type: ignore[arg-type]
    with pytest.raises(StorageError):
        gp.gc(store, grace=0)
    assert backend.fired("mtimes")
    assert [k for op, k in backend.calls if op == "delete" and k.startswith("blocks/")] == []
    assert _blocks(inner) == keys
    assert gp.verify(inner).ok
    assert inner.get_tensor(kept).size == 2000


def test_gc_stops_before_deleting_when_its_lease_cannot_be_refreshed(inner: Store) -> None:
    kept, keys = _garbage(inner)
    beats_failed = threading.Event()

    def count_failed_beats() -> None:
        if len(backend.fired("touch")) >= 3:  # this one included
            beats_failed.set()

    def hold_the_sweep() -> None:
        # Keep gc at its sweep until the heartbeat has failed long enough for
        # its lease to be in doubt (event-driven: no sleep decides the outcome).
        assert beats_failed.wait(timeout=30), "the heartbeat never ran"

    store, backend = faulty_store(
        inner,
        Fault("touch", "locks/*", lose="request", action=count_failed_beats),
        Fault("mtimes", "blocks/*", lose=None, action=hold_the_sweep),
    )
    with dask.config.set({"gradpipe.lock.ttl": "0.4s"}), pytest.raises(LockedError, match="lapsed"):
        gp.gc(store, grace=0)
    assert len(backend.fired("touch")) >= 3
    assert [k for op, k in backend.calls if op == "delete" and k.startswith("blocks/")] == []
    assert _blocks(inner) == keys
    assert inner.get_tensor(kept).size == 2000


def test_gc_after_a_failed_gc_deletes_only_garbage(inner: Store) -> None:
    kept, keys = _garbage(inner)
    store, backend = faulty_store(inner, Fault("mtimes", "blocks/*", calls={1}, lose="request"))
    with pytest.raises(StorageError):
        gp.gc(store, grace=0)
    assert len(backend.fired("mtimes")) == 1
    report = gp.gc(store, grace=0)
    assert report.deleted > 0
    assert _blocks(inner) < keys
    assert gp.verify(inner).ok
    assert inner.get_tensor(kept).tobytes() == np.arange(2000, dtype=np.float32).tobytes()


def test_reused_block_whose_touch_reply_is_lost_is_not_published(inner: Store) -> None:
    # A writer reuses an old block and must refresh its time so gc keeps it; if
    # the touch cannot be confirmed, nothing may point at the block yet.
    array = np.arange(1000, dtype=np.float32)
    inner.put_tensor(array, chunk_bytes=8192)
    store, backend = faulty_store(inner, Fault("touch", "blocks/*", calls={1}, lose="request"))
    with dask.config.set({"gradpipe.storage.touch-after": "0s"}), pytest.raises(StorageError):
        store.put_tensor(array, name="w", chunk_bytes=8192)
    assert backend.fired("touch")
    assert "tensors/w" not in inner.refs.list()
