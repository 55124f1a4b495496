"""gc: what it deletes, what it keeps, and that it never races a writer."""

from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np
import pytest

import gradpipe as gp
from gradpipe.core.ids import block_key
from gradpipe.storage import gc as gc_module
from gradpipe.storage.backend import KeyInfo

# These tests damage and count data blocks: every chunk is a block of its own.
pytestmark = pytest.mark.usefixtures("no_inline")


def test_sweep_keeps_a_block_touched_after_it_was_listed(tmp_path: Path) -> None:
    store = gp.open_store(tmp_path / "s", mode="w")
    block_id = store.put_raw(b"about to be reused")
    key = block_key(block_id)
    path = tmp_path / "s" / key
    old = time.time() - 10 * 86400
    os.utime(path, (old, old))
    listed = KeyInfo(key, path.stat().st_size, old)  # what gc saw when it listed
    os.utime(path)  # a job reused the block before gc took the lock
    report = gc_module.GcReport(dry_run=False)
    with store.lock.exclusive("test") as lease:
        gc_module._sweep(store, lease, [listed], time.time() - 3600, report)
    assert path.exists()
    assert report.deleted == 0
    assert report.kept_young == 1


def test_unnamed_tensor_is_unreferenced_and_named_one_is_kept(tmp_path: Path) -> None:
    store = gp.open_store(tmp_path / "s", mode="w")
    loose = store.put_tensor(np.arange(10, dtype=np.float32))
    kept = store.put_tensor(np.ones(10, dtype=np.float32), name="w")
    dry = gp.gc(store, grace=0, dry_run=True)
    assert dry.unreferenced == 2  # the loose tensor's manifest and its block
    assert "unreferenced" in dry.summary()
    report = gp.verify(store)
    assert report.unchecked == 2
    assert "--all" in report.summary()
    gp.gc(store, grace=0)
    assert store.get_tensor(kept).tobytes() == np.ones(10, np.float32).tobytes()
    try:
        store.get_tensor(loose)
    except gp.NotFoundError:
        pass
    else:
        raise AssertionError("gc kept an unreferenced tensor past a grace of 0")
    assert gp.verify(store, all_blocks=True).unreferenced == 0
