"""Stored tensors as lazy dask arrays: keys that never collide between different tensors."""

from __future__ import annotations

from pathlib import Path

import dask
import numpy as np

import gradpipe as gp
from gradpipe.graph.arrays import lazy_tensor


def test_lazy_keys_differ_by_dtype(tmp_path: Path) -> None:
    store = gp.open_store(tmp_path / "s", mode="w")
    floats = np.array([1.0, 2.0], np.float32)
    a = store.tensor_info(store.put_tensor(floats))
    b = store.tensor_info(store.put_tensor(floats.view(np.int32)))
    assert a.blocks == b.blocks  # same bytes, one block
    lazy_a, lazy_b = lazy_tensor(store, a), lazy_tensor(store, b)
    assert lazy_a.name != lazy_b.name
    got_a, got_b = dask.compute(lazy_a, lazy_b)
    assert got_a.dtype == np.float32
    assert got_b.dtype == np.int32
    assert got_b.tobytes() == floats.tobytes()
