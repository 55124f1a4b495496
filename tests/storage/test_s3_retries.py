"""S3 requests are retried by the S3 client's standard retry configuration, through real faults.

Each fault kind of :class:`~gradpipe.testing.faultproxy.FaultProxy` is put
between the store and the loopback S3 server at a high rate; every operation
still succeeds, reads come back bit-exact, and what could not be retried
surfaces as a :class:`~gradpipe.errors.StorageError`, never as a client
library's exception.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import dask.config
import numpy as np
import pytest

import gradpipe as gp
from gradpipe.errors import InvalidInputError, StorageError
from gradpipe.storage.retries import with_retries
from gradpipe.testing.faultproxy import FaultProxy
from gradpipe.testing.s3server import S3Server

pytestmark = pytest.mark.s3

BUCKET = "gradpipe-test"


@pytest.fixture
def proxy(s3: S3Server) -> Iterator[FaultProxy]:
    with FaultProxy(s3.endpoint_url, seed=2024) as proxy:
        yield proxy


def _url() -> str:
    return f"s3://{BUCKET}/{uuid.uuid4().hex[:8]}"


# --- the configuration ------------------------------------------------------------
def test_default_is_botocores_standard_mode(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("AWS_RETRY_MODE", raising=False)
    monkeypatch.delenv("AWS_MAX_ATTEMPTS", raising=False)
    options = {"endpoint_url": "http://x", "config_kwargs": {"connect_timeout": 3}}
    out = with_retries(options)
    assert out["config_kwargs"] == {
        "connect_timeout": 3,
        "retries": {"mode": "standard", "total_max_attempts": 5},
    }
    assert out["endpoint_url"] == "http://x"
    assert options == {"endpoint_url": "http://x", "config_kwargs": {"connect_timeout": 3}}
    with dask.config.set(
        {"gradpipe.storage.retries.mode": "adaptive", "gradpipe.storage.retries.max-attempts": 3}
    ):
        assert with_retries({})["config_kwargs"]["retries"] == {
            "mode": "adaptive",
            "total_max_attempts": 3,
        }


def test_explicit_options_and_aws_variables_win(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("AWS_RETRY_MODE", raising=False)
    monkeypatch.delenv("AWS_MAX_ATTEMPTS", raising=False)
    given = {"config_kwargs": {"retries": {"mode": "legacy", "max_attempts": 2}}}
    assert with_retries(given) == given
    monkeypatch.setenv("AWS_RETRY_MODE", "adaptive")
    assert with_retries({})["config_kwargs"]["retries"] == {"total_max_attempts": 5}
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "4")
    assert with_retries({}) == {}  # botocore reads both variables itself


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [("mode", "eager", "must be one of"), ("max-attempts", 0, "integer >= 1")],
)
def test_bad_settings_are_refused(
    monkeypatch: pytest.MonkeyPatch, key: str, value: object, message: str
) -> None:
    monkeypatch.delenv("AWS_RETRY_MODE", raising=False)
    monkeypatch.delenv("AWS_MAX_ATTEMPTS", raising=False)
    with (
        dask.config.set({f"gradpipe.storage.retries.{key}": value}),
        pytest.raises(InvalidInputError, match=message),
    ):
        with_retries({})


def test_the_store_client_is_configured(s3: S3Server, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("AWS_RETRY_MODE", raising=False)
    monkeypatch.delenv("AWS_MAX_ATTEMPTS", raising=False)
    store = gp.open_store(_url(), mode="w", storage_options=s3.storage_options)
    config = store.backend.fs.s3.meta.config  # type: ignore[attr-defined]
    assert config.retries == {"mode": "standard", "total_max_attempts": 5}
    assert store.storage_options == s3.storage_options  # what travels to workers: unchanged


# --- faults -------------------------------------------------------------------------
# ids not plain kinds: the id "slow" would read as the slow marker (tests/conftest.py)
@pytest.mark.parametrize(
    "kind",
    ["500", "502", "503", "reset", "truncate", "drop", "slow"],
    ids=lambda kind: f"fault-{kind}",
)
def test_store_operations_survive_each_fault_kind(proxy: FaultProxy, kind: str) -> None:
    rng = np.random.default_rng(7)
    arrays = [rng.standard_normal(3000).astype("<f4") for _ in range(6)]
    proxy.delay = (0.001, 0.01)
    with dask.config.set({"gradpipe.inline-bytes": 0}):
        store = gp.open_store(_url(), mode="w", storage_options=proxy.storage_options)
        proxy.set_rates({kind: 0.15})
        ids = [store.put_tensor(a, name=f"t{i}") for i, a in enumerate(arrays)]
        moved = store.put_tensor(arrays[0] + 1, name="t1")  # a ref moved with If-Match
        got = [store.get_tensor(i) for i in ids]
        names = store.refs.names("tensors")
        gc = gp.gc(store, grace=0)
    assert proxy.counts()[kind] > 0
    with proxy.paused():
        for a, g in zip(arrays, got, strict=True):
            assert g.tobytes() == a.tobytes()
        assert names == [f"tensors/t{i}" for i in range(6)]
        assert store.refs.get("tensors/t1") == moved
        assert [e.target for e in store.refs.history("tensors/t1")] == [moved, ids[1]]
        assert gc.deleted >= 1  # the tensor t1 pointed at before (its blocks)
        assert gp.verify(store).ok


def test_a_body_cut_short_is_read_again(proxy: FaultProxy) -> None:
    data = bytes(range(256)) * 64
    store = gp.open_store(_url(), mode="w", storage_options=proxy.storage_options)
    store.backend.write_if_absent("blocks/aa/x", data)
    proxy.set_rates({"truncate": {"GET": 0.5}})
    for _ in range(10):
        assert store.backend.read("blocks/aa/x") == data
    assert proxy.counts()["truncate"] >= 2


def test_faults_that_outlast_the_retries_are_storage_errors(proxy: FaultProxy) -> None:
    store = gp.open_store(_url(), mode="w", storage_options=proxy.storage_options)
    store.backend.write_if_absent("blocks/aa/x", b"0123456789")
    with dask.config.set({"gradpipe.storage.retries.max-attempts": 2}):
        # A new client: settings are read when a store's filesystem is made.
        fresh = gp.open_store(
            store.url, storage_options={**proxy.storage_options, "skip_instance_cache": True}
        )
    proxy.set_rates({"truncate": {"GET": 1.0}, "502": {"LIST": 1.0}})
    with pytest.raises(StorageError, match="could not read 'blocks/aa/x'"):
        store.backend.read("blocks/aa/x")
    with pytest.raises(StorageError, match="could not list 'blocks'"):
        list(fresh.backend.list("blocks"))
    assert proxy.counts_by_operation()[("502", "LIST")] == 2  # max-attempts: 2 in all
