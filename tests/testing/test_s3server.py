"""The loopback S3 server's request counting, in this process and in a child process."""

from __future__ import annotations

import fsspec
import pytest

from gradpipe.testing.s3server import S3Server

pytestmark = pytest.mark.s3

BUCKET = "gradpipe-test"


def _exercise(server: S3Server) -> None:
    fs = fsspec.filesystem("s3", skip_instance_cache=True, **server.storage_options)
    fs.pipe(f"{BUCKET}/a/x", b"12345")
    fs.pipe(f"{BUCKET}/a/y", b"678")
    assert fs.cat(f"{BUCKET}/a/x") == b"12345"
    fs.info(f"{BUCKET}/a/y")
    fs.copy(f"{BUCKET}/a/x", f"{BUCKET}/a/z")
    fs.invalidate_cache()
    assert len(fs.find(f"{BUCKET}/a")) == 3
    fs.rm([f"{BUCKET}/a/x", f"{BUCKET}/a/y"])


def _check(server: S3Server) -> None:
    server.make_bucket(BUCKET)
    _exercise(server)  # not counted: counting is off outside the block
    with server.count_requests() as counts:
        _exercise(server)
    assert counts.bytes_put == 8
    assert counts.bytes_got == 5
    assert counts["PUT"] == 2
    assert counts["GET"] == 1
    assert counts["COPY"] == 1
    assert counts["LIST"] >= 1
    assert counts["DELETE"] == 1  # one bulk DeleteObjects
    assert counts["HEAD"] >= 1  # fs.info, and s3fs's own look before a copy
    assert counts.total == sum(counts.by_operation.values())
    with server.count_requests() as idle:
        pass
    assert idle.total == 0


def test_count_requests_in_this_process(s3_server: S3Server) -> None:
    s3_server.reset()
    _check(s3_server)


def test_count_requests_of_a_server_in_a_child_process() -> None:
    with S3Server(process=True) as server:
        _check(server)
        with pytest.raises(RuntimeError, match="this process"):
            server.set_mtime(BUCKET, "a/z", 0.0)
    with pytest.raises(ValueError, match="fault layer"):
        S3Server(process=True, fault_layer=True)
