"""Guarantees that once had holes: lossy codecs, worker reopen, lazy keys, gc's last look."""

from __future__ import annotations

import pickle
import shutil
from pathlib import Path

import numpy as np
import pytest
from numcodecs import BitRound, Zstd

import gradpipe as gp
from gradpipe.graph.arrays import lazy_tensor


def test_lossy_codec_chain_is_refused_and_poisons_nothing(tmp_path: Path) -> None:
    store = gp.open_store(tmp_path / "s", mode="w")
    x = np.random.default_rng(0).standard_normal(1000).astype(np.float32)
    with pytest.raises(gp.InvalidInputError, match="bit-exactly"):
        store.put_tensor(x, codecs=[BitRound(keepbits=5), Zstd()])
    assert list(store.backend.list("blocks")) == []
    tensor_id = store.put_tensor(x)  # the lossless default still stores it right
    assert store.get_tensor(tensor_id).tobytes() == x.tobytes()


def test_a_worker_never_creates_the_store_it_was_sent(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    store = gp.open_store("relative-store", mode="w")
    assert store.url == str(tmp_path / "relative-store")  # travels as an absolute path
    data = pickle.dumps(store)
    other = tmp_path / "elsewhere"
    other.mkdir()
    monkeypatch.chdir(other)
    assert pickle.loads(data).url == store.url
    gone = gp.open_store(tmp_path / "gone", mode="w")
    payload = pickle.dumps(gone)
    shutil.rmtree(tmp_path / "gone")
    (tmp_path / "gone").mkdir()
    with pytest.raises(gp.NotFoundError):
        pickle.loads(payload)
    assert not any((tmp_path / "gone").iterdir())


def test_lazy_keys_differ_by_dtype(tmp_path: Path) -> None:
    store = gp.open_store(tmp_path / "s", mode="w")
    floats = np.array([1.0, 2.0], np.float32)
    a = store.tensor_info(store.put_tensor(floats))
    b = store.tensor_info(store.put_tensor(floats.view(np.int32)))
    assert a.blocks == b.blocks  # same bytes, one block
    lazy_a, lazy_b = lazy_tensor(store, a), lazy_tensor(store, b)
    assert lazy_a.name != lazy_b.name
    import dask

    got_a, got_b = dask.compute(lazy_a, lazy_b)
    assert got_a.dtype == np.float32
    assert got_b.dtype == np.int32
    assert got_b.tobytes() == floats.tobytes()
