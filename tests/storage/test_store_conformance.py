"""The store conformance suite on local disk, in memory and on S3 (a real server on loopback)."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

import gradpipe as gp
from gradpipe.testing.s3server import S3Server
from gradpipe.testing.store_suite import StoreTests

BUCKET = "gradpipe-test"


class TestLocalStore(StoreTests):
    @pytest.fixture
    def store(self, tmp_path: Path) -> gp.Store:
        return gp.open_store(tmp_path / "store", mode="w")


class TestFileUrlStore(StoreTests):
    @pytest.fixture
    def store(self, tmp_path: Path) -> gp.Store:
        return gp.open_store(f"file://{tmp_path}/store", mode="w")


class TestMemoryStore(StoreTests):
    @pytest.fixture
    def store(self) -> Iterator[gp.Store]:
        store = gp.open_store(f"memory://{uuid.uuid4().hex}", mode="w")
        yield store
        store.backend.delete_all()


class TestS3Store(StoreTests):
    @pytest.fixture
    def store(self, s3: S3Server) -> gp.Store:
        return gp.open_store(f"s3://{BUCKET}/{uuid.uuid4().hex[:8]}", mode="w")


class TestS3StoreWithStorageOptions(StoreTests):
    """Endpoint and credentials given explicitly instead of by environment."""

    @pytest.fixture
    def store(self, s3_server: S3Server) -> gp.Store:
        s3_server.reset()
        s3_server.make_bucket(BUCKET)
        return gp.open_store(
            f"s3://{BUCKET}/explicit", mode="w", storage_options=s3_server.storage_options
        )
