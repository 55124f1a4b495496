"""The fault tools themselves: a fault fires exactly where its schedule says."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest

from gradpipe.errors import NotFoundError, StorageError
from gradpipe.storage._memory import MemoryBackend
from gradpipe.testing.faults import Fault, FaultyBackend, Injected
from gradpipe.testing.s3server import S3Server


@pytest.fixture
def inner() -> Iterator[MemoryBackend]:
    backend = MemoryBackend(uuid.uuid4().hex)
    yield backend
    backend.delete_all()


def test_the_second_matching_call_loses_its_reply(inner: MemoryBackend) -> None:
    backend = FaultyBackend(inner, Fault("swap", "refs/*", calls={2}))
    token = backend.swap("refs/a", b"1", None)
    backend.swap("other/a", b"1", None)  # does not match the key: not counted
    with pytest.raises(StorageError, match="reply was lost"):
        backend.swap("refs/a", b"2", token)
    current = inner.read_versioned("refs/a")
    assert current is not None
    assert current.data == b"2"  # it was done
    backend.swap("refs/a", b"3", current.token)  # the third is not faulted
    assert backend.fired() == [Injected("swap", "refs/a", "reply")]


def test_a_lost_request_is_not_done_and_hides_the_real_answer(inner: MemoryBackend) -> None:
    backend = FaultyBackend(inner, Fault("write_if_absent", lose="request", calls={1}))
    with pytest.raises(StorageError, match="never arrived"):
        backend.write_if_absent("k", b"v")
    assert inner.mtimes(["k"]) == [None]
    backend.add(Fault("read", "k", calls={1}))
    assert backend.write_if_absent("k", b"v") is True
    with pytest.raises(StorageError):  # not NotFoundError nor the bytes: no reply at all
        backend.read("k")
    backend.clear()
    assert backend.read("k") == b"v"
    with pytest.raises(NotFoundError):
        backend.read("absent")


def test_batches_fail_per_key(inner: MemoryBackend) -> None:
    backend = FaultyBackend(
        inner,
        Fault("write_if_absent", "b/2", lose="request"),
        Fault("write_if_absent", "b/3"),
    )
    with pytest.raises(StorageError, match="b/2"):
        backend.write_many_if_absent([("b/1", b"1"), ("b/2", b"2"), ("b/3", b"3")])
    assert inner.mtimes(["b/1", "b/2", "b/3"])[1] is None
    assert None not in (inner.mtimes(["b/1", "b/3"]))
    backend.add(Fault("read", "b/1", lose="request"))
    got = backend.read_many(["b/1", "b/3"])
    assert isinstance(got[0], StorageError)
    assert got[1] == b"3"
    assert ("read", "b/3") in backend.calls


def test_action_runs_when_the_fault_fires(inner: MemoryBackend) -> None:
    seen: list[str] = []
    backend = FaultyBackend(
        inner, Fault("touch", calls={2}, lose=None, action=lambda: seen.append("x"))
    )
    inner.write_if_absent("k", b"v")
    backend.touch("k")
    assert seen == []
    backend.touch("k")
    assert seen == ["x"]


def test_fault_layer_is_off_unless_asked_for() -> None:
    server = S3Server()
    with pytest.raises(RuntimeError, match="fault_layer"), server.lose_replies():
        pass
