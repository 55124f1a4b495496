"""Shared fixtures: stores on local disk and on a real S3 server on loopback."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import dask.config
import pytest

import gradpipe as gp
from gradpipe.testing.s3server import S3Server

BUCKET = "gradpipe-test"


@pytest.fixture(scope="session")
def s3_server() -> Iterator[S3Server]:
    """moto's S3 on loopback, one per test session (as s3fs's own tests do)."""
    with S3Server() as server:
        yield server


@pytest.fixture
def s3(s3_server: S3Server, monkeypatch: pytest.MonkeyPatch) -> S3Server:
    """A clean S3 server with one bucket; the AWS environment points at it."""
    s3_server.reset()
    s3_server.make_bucket(BUCKET)
    for key, value in s3_server.environ.items():
        monkeypatch.setenv(key, value)
    import s3fs

    s3fs.S3FileSystem.clear_instance_cache()
    return s3_server


@pytest.fixture(params=["local", "s3"])
def store_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A URL for a new store, on local disk and on S3."""
    if request.param == "local":
        return str(tmp_path / "store")
    request.getfixturevalue("s3")
    return f"s3://{BUCKET}/{uuid.uuid4().hex[:8]}"


@pytest.fixture
def store(store_url: str) -> gp.Store:
    """A new, empty, writable store (local and S3)."""
    return gp.open_store(store_url, mode="w")


@pytest.fixture(autouse=True)
def _no_aws_config_files(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    # A developer's ~/.aws must not change what the tests see.
    monkeypatch.setenv("AWS_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", os.devnull)


@pytest.fixture(autouse=True)
def _short_lock_ttl(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Leases expire in seconds, not minutes: tests kill writers and then run gc.

    A killed writer's lock blocks gc until its ttl passes, by design; the
    subprocesses tests start read the same setting from the environment.
    """
    monkeypatch.setenv("DASK_GRADPIPE__LOCK__TTL", "6s")
    monkeypatch.setenv("DASK_GRADPIPE__LOCK__POLL", "0.05s")
    with dask.config.set({"gradpipe.lock.ttl": "6s", "gradpipe.lock.poll": "0.05s"}):
        yield
