"""The backend conformance suite on every backend: local disk, file://, memory:// and S3."""

from __future__ import annotations

import errno
import os
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gradpipe.errors import NotFoundError, StorageError
from gradpipe.storage._local import _IOV_MAX, LocalBackend
from gradpipe.storage._memory import MemoryBackend
from gradpipe.storage._s3 import S3Backend
from gradpipe.storage.backend import Backend
from gradpipe.storage.registry import backend_for_url
from gradpipe.testing.backend_suite import BackendTests, race, visible_keys
from gradpipe.testing.faults import FaultyBackend
from gradpipe.testing.s3server import S3Server

BUCKET = "gradpipe-test"


class TestLocalBackend(BackendTests):
    @pytest.fixture
    def backend(self, tmp_path: Path) -> Backend:
        return LocalBackend(tmp_path / "b")

    def set_mtime(self, backend: Backend, key: str, mtime: float) -> None:
        assert isinstance(backend, LocalBackend)
        os.utime(backend.root / key, (mtime, mtime))


class TestLocalBackendWithNamedTempFiles(TestLocalBackend):
    """Where ``O_TMPFILE`` or ``/proc`` is missing: a named temporary file and ``os.link``."""

    @pytest.fixture
    def backend(self, tmp_path: Path) -> Backend:
        backend = LocalBackend(tmp_path / "b")
        backend._tmpfile = False
        return backend


def test_local_writes_use_anonymous_files_and_leave_none(tmp_path: Path) -> None:
    backend = LocalBackend(tmp_path / "b")
    if not hasattr(os, "O_TMPFILE") or not Path("/proc/self/fd").is_dir():
        pytest.skip("no O_TMPFILE or /proc here")
    assert backend._tmpfile
    assert backend.write_if_absent("blocks/aa/x", b"data") is True
    assert backend.write_if_absent("blocks/aa/x", b"other") is False
    assert backend._tmpfile  # still on: nothing made it fall back
    assert backend.read("blocks/aa/x") == b"data"
    assert [p.name for p in (tmp_path / "b" / "blocks" / "aa").iterdir()] == ["x"]


def test_local_writes_of_parts_survive_short_writes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``writev`` may write less than asked: the rest follows, and an object of more parts
    than one call takes is written in several calls."""
    real, calls = os.writev, []

    def short(fd: int, buffers: list[memoryview]) -> int:
        calls.append(len(buffers))
        return real(fd, [buffers[0][:3]])  # at most 3 bytes, of the first part only

    backend = LocalBackend(tmp_path / "b")
    parts = [bytes([65 + i]) * 7 for i in range(5)]
    monkeypatch.setattr(os, "writev", short)
    assert backend.write_parts_if_absent([("blocks/aa/x", parts)]) == [True]
    assert backend.read("blocks/aa/x") == b"".join(parts)
    monkeypatch.setattr(
        os, "writev", lambda fd, buffers: calls.append(len(buffers)) or real(fd, buffers)
    )
    calls.clear()
    many = [bytes([i % 256]) for i in range(3 * _IOV_MAX + 5)]
    assert backend.write_parts_if_absent([("blocks/aa/y", many)]) == [True]
    assert backend.read("blocks/aa/y") == b"".join(many)
    assert len(calls) >= 4
    assert max(calls) <= _IOV_MAX


def test_local_reads_survive_short_reads(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``read`` may return less than asked: the rest is read to the end of the file."""
    backend = LocalBackend(tmp_path / "b")
    data = bytes(range(256)) * 40
    assert backend.write_if_absent("blocks/aa/x", data) is True
    assert backend.write_if_absent("blocks/aa/empty", b"") is True
    real = os.read
    monkeypatch.setattr(os, "read", lambda fd, n: real(fd, min(n, 7)))
    assert backend.read("blocks/aa/x") == data
    assert backend.read("blocks/aa/empty") == b""
    with pytest.raises(NotFoundError):
        backend.read("blocks/aa/missing")


class TestLocalBackendWithoutHardLinks(TestLocalBackend):
    """A file system without hard links (some FUSE and SMB mounts): the rename fallback."""

    @pytest.fixture
    def backend(self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Backend:
        def no_link(*args: object, **kwargs: object) -> None:
            raise OSError(errno.EPERM, "Operation not permitted")

        monkeypatch.setattr(os, "link", no_link)
        return LocalBackend(tmp_path / "b")

    def test_racing_creates_of_one_key_exactly_one_wins(self, backend: Backend) -> None:
        # Weaker here, and documented: the check and the rename are two steps, so
        # racing creates may both report True. Readers still never see a partial
        # file, and the bytes are one writer's, which is what content-addressed
        # blocks need; a test that needs exactly one winner runs on a real link.
        results = race(lambda i: backend.write_if_absent("race/block", f"writer {i}".encode()))
        assert all(r is True or r is False for r in results), results
        assert True in results
        winners = {f"writer {i}".encode() for i, r in enumerate(results) if r is True}
        assert backend.read("race/block") in winners
        assert visible_keys(backend, "race") == {"race/block": len(b"writer 0")}


class TestFileUrlBackend(TestLocalBackend):
    @pytest.fixture
    def backend(self, tmp_path: Path) -> Backend:
        backend = backend_for_url(f"file://{tmp_path}/b")
        assert isinstance(backend, LocalBackend)
        return backend


class TestMemoryBackend(BackendTests):
    @pytest.fixture
    def backend(self) -> Iterator[Backend]:
        backend = backend_for_url(f"memory://{uuid.uuid4().hex}")
        assert isinstance(backend, MemoryBackend)
        yield backend
        backend.delete_all()

    def set_mtime(self, backend: Backend, key: str, mtime: float) -> None:
        assert isinstance(backend, MemoryBackend)
        backend.set_mtime(key, mtime)


class TestFaultyBackendWithoutFaults(TestMemoryBackend):
    """The fault wrapper, with nothing scheduled, is a conforming backend itself."""

    @pytest.fixture
    def backend(self) -> Iterator[Backend]:
        inner = MemoryBackend(uuid.uuid4().hex)
        yield FaultyBackend(inner)
        inner.delete_all()

    def set_mtime(self, backend: Backend, key: str, mtime: float) -> None:
        assert isinstance(backend, FaultyBackend)
        super().set_mtime(backend.inner, key, mtime)


@pytest.mark.s3
class TestS3Backend(BackendTests):
    model_examples = 12  # each step is a round trip to moto

    @pytest.fixture
    def backend(self, s3: S3Server) -> Backend:
        self.server = s3
        return backend_for_url(f"s3://{BUCKET}/{uuid.uuid4().hex[:8]}")

    def set_mtime(self, backend: Backend, key: str, mtime: float) -> None:
        assert isinstance(backend, S3Backend)
        self.server.set_mtime(backend.bucket, backend._key(key), mtime)


@pytest.mark.s3
class TestS3BackendAtBucketRoot(TestS3Backend):
    """No prefix: keys are the bucket's own keys."""

    @pytest.fixture
    def backend(self, s3: S3Server) -> Backend:
        self.server = s3
        return backend_for_url(f"s3://{BUCKET}")


@pytest.mark.s3
def test_s3_missing_bucket_is_a_clear_storage_error(s3: S3Server) -> None:
    backend = backend_for_url("s3://no-such-bucket-here/p")
    with pytest.raises(StorageError, match=r"does not exist.*create it first"):
        backend.write_if_absent("k", b"v")
    with pytest.raises(StorageError, match="does not exist"):
        backend.swap("refs/k/x", b"v", None)


def test_a_raw_plane_is_not_written_from_the_callers_array(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Incompressible int8 values are kept as a raw plane, a view of the chunk: the caller's
    array moving on between the encoding and the write must not reach the block (an
    array of numpy's memory, and one of an ``mmap``'s)."""
    import mmap

    import numpy as np

    import gradpipe as gp
    from gradpipe.core.ids import hash_bytes
    from gradpipe.storage.blocks import BlockToWrite, WriteStats

    values = np.random.default_rng(3).integers(-128, 128, 2**20, dtype=np.int8)
    mapped = mmap.mmap(-1, values.nbytes)  # an array whose memory is not numpy's
    real = LocalBackend.write_parts_if_absent
    for n, data in enumerate((values, np.frombuffer(mapped, np.int8))):
        data[:] = values
        original = data.tobytes()
        store = gp.open_store(tmp_path / f"store{n}", mode="w")

        def moving(self: LocalBackend, items: Any, data: np.ndarray = data) -> list[bool]:
            data[::5] += 1  # a training thread, after the hash and the encoding
            return real(self, items)

        monkeypatch.setattr(LocalBackend, "write_parts_if_absent", moving)
        block_id = hash_bytes(original)
        store.write_blocks([BlockToWrite(block_id, data, None, None)], WriteStats())
        monkeypatch.undo()
        assert data.tobytes() != original  # it did move
        assert bytes(store.get_raw(block_id)) == original  # and the block is what was hashed


def test_a_frame_in_parts_keeps_little_more_memory_alive_than_its_size(tmp_path: Path) -> None:
    """float64 values whose low byte alone is noise: one raw plane, a row of the codec's
    eight-plane array, would keep 8x the frame alive; the frame is joined instead. A frame
    of mostly raw planes stays in parts. Both are the bytes ``encode_block`` makes."""
    import numpy as np

    import gradpipe as gp
    from gradpipe.codecs.policy import choose_codec
    from gradpipe.core.buffers import nbytes
    from gradpipe.core.ids import hash_bytes
    from gradpipe.storage.blocks import BlockToWrite, encode_block
    from gradpipe.storage.store import _owner

    store = gp.open_store(tmp_path / "store", mode="w")
    rng = np.random.default_rng(5)
    words = np.full(1 << 19, 1.5).view(np.uint64) ^ rng.integers(0, 256, 1 << 19, np.uint64)
    for data, parts_kept in ((words.view(np.float64), False), (rng.standard_normal(1 << 19), True)):
        item = BlockToWrite(hash_bytes(data.view(np.uint8)), data, None, None)
        frame = store.encode_frame(item, 1)
        held = {id(_owner(part)): nbytes(_owner(part)) for part in frame.parts}
        assert sum(held.values()) <= 2 * len(frame) + 4096
        assert (len(frame.parts) > 1) is parts_kept
        assert bytes(frame) == bytes(encode_block(data, (choose_codec(data, level=1),)))
